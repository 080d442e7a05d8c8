"""JaggedTensor / KeyedJaggedTensor / KeyedTensor as pytree nodes (registered when lightning_rec.sparse is imported)."""

from __future__ import annotations

from lightning_rec._compat import pytree_takes_flatten_with_keys
from lightning_rec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, _lengths_from_offsets
from lightning_rec.sparse.keyed_tensor import KeyedTensor, regroup_kts

# pytree nodes ---------------------------------------------------------------------------------
#
# As TorchRec registers its own: torch.export (and anything that flattens with torch.utils._pytree) sees a KJT's
# tensors as leaves (None where absent: lengths a JT / KJT was not given, offsets not computed yet); the context is
# what is not a tensor. A KJT's children are TorchRec's six (values, weights, lengths, offsets,
# stride_per_key_per_rank, inverse indices), so TorchRec's `dynamic_shapes` lists line up; a variable batch's bag
# counts ride in the context, not in TorchRec's tensor (they set shapes, so an export is specialised on them, as on
# the keys). Unflattening does not validate (the leaves may be symbolic mid-trace); an ordinary batch's stride comes
# from its lengths, so an export takes other batch sizes.

_JT_FIELDS = ("_values", "_weights", "_lengths", "_offsets")
_KJT_FIELDS = _JT_FIELDS + ("_stride_per_key_per_rank", "_inverse_indices")  # TorchRec's KeyedJaggedTensor._fields


def _jt_leaves(jt: JaggedTensor) -> list:
    return [jt._values, jt._weights, None if jt._lengths_derived else jt._lengths, jt._offsets]


def _jt_flatten(jt: JaggedTensor) -> tuple[list, None]:
    return _jt_leaves(jt), None


def _jt_unflatten(leaves, context: None) -> JaggedTensor:
    values, weights, lengths, offsets = leaves
    jt = JaggedTensor.__new__(JaggedTensor)
    jt._values, jt._weights, jt._lengths, jt._offsets = values, weights, lengths, offsets
    if lengths is None and offsets is not None:
        jt._lengths, jt._lengths_derived = _lengths_from_offsets(offsets), True
    return jt


def _kjt_leaves(kjt: KeyedJaggedTensor) -> list:
    inverse = kjt.inverse_indices_or_none()
    return _jt_leaves(kjt) + [None, None if inverse is None else inverse[1]]


def _kjt_flatten(kjt: KeyedJaggedTensor) -> tuple[list, tuple]:
    inverse = kjt.inverse_indices_or_none()
    return _kjt_leaves(kjt), (list(kjt.keys()), kjt.stride_per_key_per_rank() or None,
                              None if inverse is None else list(inverse[0]))


def _kjt_unflatten(leaves, context) -> KeyedJaggedTensor:
    leaves = list(leaves)
    if len(leaves) > len(_KJT_FIELDS):
        raise ValueError(f"a KeyedJaggedTensor unflattens from at most {len(_KJT_FIELDS)} children "
                         f"{list(_KJT_FIELDS)}, got {len(leaves)}")
    values, weights, lengths, offsets, _, inverse = leaves + [None] * (len(_KJT_FIELDS) - len(leaves))
    if all(isinstance(k, str) for k in context):  # a program saved when the context was the keys alone
        context = (context, None, None)
    keys, per_rank, inverse_keys = context
    if per_rank is None and lengths is not None:
        stride = lengths.numel() // len(keys) if keys else 0
    elif per_rank is None and offsets is not None:
        stride = (offsets.numel() - 1) // len(keys) if keys else 0
    else:
        stride = None
    return KeyedJaggedTensor(list(keys), values, weights=weights, lengths=lengths, offsets=offsets, stride=stride,
                             _validate=False, stride_per_key_per_rank=per_rank,
                             inverse_indices=None if inverse is None else (list(inverse_keys), inverse))


def _kt_flatten(kt: KeyedTensor) -> tuple[list, tuple]:
    return [kt._values], (list(kt._keys), list(kt._length_per_key), kt._key_dim)


def _kt_unflatten(leaves, context) -> KeyedTensor:
    keys, length_per_key, key_dim = context
    kt = KeyedTensor._of_collection(list(keys), list(length_per_key), list(leaves)[0])
    kt._key_dim = key_dim
    return kt


def _jt_flatten_spec(jt: JaggedTensor, spec) -> list:
    return _jt_leaves(jt)


def _kjt_flatten_spec(kjt: KeyedJaggedTensor, spec) -> list:
    return _kjt_leaves(kjt)


def _kt_flatten_spec(kt: KeyedTensor, spec) -> list:
    """As TorchRec's: an exported program's KeyedTensor input, its blocks put in the order of the spec's keys."""
    keys = list(spec.context[0])
    return [kt._values if kt.keys() == keys else regroup_kts([kt], [keys])[0]]


def _register_pytree_nodes() -> None:
    from torch.fx._pytree import register_pytree_flatten_spec
    from torch.utils import _pytree as pytree

    with_keys = pytree_takes_flatten_with_keys()
    nodes = ((JaggedTensor, _jt_flatten, _jt_unflatten, _JT_FIELDS, _jt_flatten_spec),
             (KeyedJaggedTensor, _kjt_flatten, _kjt_unflatten, _KJT_FIELDS, _kjt_flatten_spec),
             (KeyedTensor, _kt_flatten, _kt_unflatten, ("_values",), _kt_flatten_spec))
    for cls, flatten, unflatten, fields, flatten_spec in nodes:
        if cls in pytree.SUPPORTED_NODES:  # a re-import (importlib.reload) must not register twice
            continue
        kwargs = {"serialized_type_name": f"lightning_rec.sparse.{cls.__name__}"}  # in saved programs: never changes
        if with_keys:  # names the leaves in export's signatures (kjt._values, ...)
            kwargs["flatten_with_keys_fn"] = (
                lambda obj, flatten=flatten, fields=fields: (
                    [(pytree.GetAttrKey(f), leaf) for f, leaf in zip(fields, flatten(obj)[0])], flatten(obj)[1]))
        pytree.register_pytree_node(cls, flatten, unflatten, **kwargs)
        register_pytree_flatten_spec(cls, flatten_spec)
