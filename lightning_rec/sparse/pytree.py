"""JaggedTensor / KeyedJaggedTensor / KeyedTensor as pytree nodes (registered when lightning_rec.sparse is imported)."""

from __future__ import annotations

from lightning_rec._compat import pytree_takes_flatten_with_keys
from lightning_rec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor
from lightning_rec.sparse.keyed_tensor import KeyedTensor, regroup_kts

# pytree nodes ---------------------------------------------------------------------------------
#
# As TorchRec registers its own: torch.export (and anything that flattens with torch.utils._pytree) sees a KJT's
# tensors as leaves (None where absent); the context is what is not a tensor. Unflattening does not validate (the
# leaves may be symbolic mid-trace); the stride comes from the lengths, so an export takes other batch sizes.

_JT_FIELDS = ("_values", "_weights", "_lengths", "_offsets")


def _jt_flatten(jt: JaggedTensor) -> tuple[list, None]:
    return [getattr(jt, f) for f in _JT_FIELDS], None


def _jt_unflatten(leaves, context: None) -> JaggedTensor:
    jt = JaggedTensor.__new__(JaggedTensor)
    jt._values, jt._weights, jt._lengths, jt._offsets = leaves
    return jt


def _kjt_flatten(kjt: KeyedJaggedTensor) -> tuple[list, list[str]]:
    return [getattr(kjt, f) for f in _JT_FIELDS], list(kjt.keys())


def _kjt_unflatten(leaves, keys: list[str]) -> KeyedJaggedTensor:
    values, weights, lengths, offsets = leaves
    return KeyedJaggedTensor(list(keys), values, weights=weights, lengths=lengths, offsets=offsets,
                             stride=lengths.numel() // len(keys) if keys else 0, _validate=False)


def _kt_flatten(kt: KeyedTensor) -> tuple[list, tuple]:
    return [kt._values], (list(kt._keys), list(kt._length_per_key), kt._key_dim)


def _kt_unflatten(leaves, context) -> KeyedTensor:
    keys, length_per_key, key_dim = context
    kt = KeyedTensor._of_collection(list(keys), list(length_per_key), list(leaves)[0])
    kt._key_dim = key_dim
    return kt


def _jagged_flatten_spec(jt, spec) -> list:
    return [getattr(jt, f) for f in _JT_FIELDS]


def _kt_flatten_spec(kt: KeyedTensor, spec) -> list:
    """As TorchRec's: an exported program's KeyedTensor input, its blocks put in the order of the spec's keys."""
    keys = list(spec.context[0])
    return [kt._values if kt.keys() == keys else regroup_kts([kt], [keys])[0]]


def _register_pytree_nodes() -> None:
    from torch.fx._pytree import register_pytree_flatten_spec
    from torch.utils import _pytree as pytree

    with_keys = pytree_takes_flatten_with_keys()
    nodes = ((JaggedTensor, _jt_flatten, _jt_unflatten, _JT_FIELDS),
             (KeyedJaggedTensor, _kjt_flatten, _kjt_unflatten, _JT_FIELDS),
             (KeyedTensor, _kt_flatten, _kt_unflatten, ("_values",)))
    for cls, flatten, unflatten, fields in nodes:
        if cls in pytree.SUPPORTED_NODES:  # a re-import (importlib.reload) must not register twice
            continue
        kwargs = {"serialized_type_name": f"lightning_rec.sparse.{cls.__name__}"}  # in saved programs: never changes
        if with_keys:  # names the leaves in export's signatures (kjt._values, ...)
            kwargs["flatten_with_keys_fn"] = (
                lambda obj, flatten=flatten, fields=fields: (
                    [(pytree.GetAttrKey(f), leaf) for f, leaf in zip(fields, flatten(obj)[0])], flatten(obj)[1]))
        pytree.register_pytree_node(cls, flatten, unflatten, **kwargs)
        register_pytree_flatten_spec(cls, _kt_flatten_spec if cls is KeyedTensor else _jagged_flatten_spec)
