"""The contracts of JaggedTensor and KeyedJaggedTensor, checked where they are owned.

The constructors only assign (as TorchRec's): a batch is checked when a collection first reads it (FeatureRouter,
embedding.py), or on demand with `kjt.validate()` / `jt.validate()`. Each check raises a ValueError that names what
disagrees and the fix. Tensor values are read only on the host (a device read would stall the stream; a device batch is
checked on the host copy it was moved from)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

ID_DTYPES = (torch.int32, torch.int64)  # what the kernels (ours and fbgemm's) read
_ID_DTYPES = ID_DTYPES


class JaggedArgumentError(ValueError, AssertionError):
    """A JaggedTensor constructor's refusal: a ValueError, and the AssertionError TorchRec's constructor raises."""


def _refuse_dtype_as_device(what: str, device: object, weights: bool = False) -> None:
    """`.to(torch.float64)`: ids and lengths keep their integer type (as floats every lookup would read other rows)."""
    if isinstance(device, torch.dtype):
        how = (f"{what}.to(device, dtype={device}) converts the weights only" if weights else
               "it has no dtype= of its own")
        raise ValueError(f"{what}.to({device}): a {what} holds integer ids and lengths, which keep their type ({how}); "
                         f"to convert a batch's floating-point tensors, batch.to({device}) (as nn.Module.to)")


def _need_tensor(what: str, name: str, value) -> None:
    """Lists and numpy arrays would fail later with an AttributeError naming nothing the user wrote."""
    if value is not None and not isinstance(value, Tensor):
        raise ValueError(f"{what}: {name} must be a torch.Tensor, got {type(value).__name__}: "
                         f"wrap it with torch.tensor({name})")


def _check_index_dtype(what: str, name: str, t: Tensor) -> None:
    """Lengths and offsets of int8/int16/uint8 have no kernel (fbgemm: 'not implemented for Short')."""
    if t.dtype not in _ID_DTYPES and not (t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex):
        raise ValueError(f"{what}: {name} must be int32 or int64, got {t.dtype}: convert them with {name}.long()")


def _readable(t: Tensor) -> bool:
    """Whether a check may read this tensor's values: on the host, and not while torch.export / compile traces."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _check_offsets(what: str, offsets: Tensor, num_values: int, read: bool = True) -> None:
    """Offsets given directly: they must start at 0, never decrease, and end at the number of values. A KJT sliced
    out of a larger batch keeps its parent's offsets: refused, with the fix. CPU tensors only."""
    if offsets.numel() == 0:
        raise ValueError(f"{what}: offsets cannot be empty: give one entry per bag + 1, starting at 0")
    if offsets.dim() != 1:
        raise ValueError(f"{what}: offsets must be 1-d with one entry per bag + 1, got shape {tuple(offsets.shape)}")
    if offsets.dtype.is_floating_point or offsets.dtype == torch.bool or offsets.dtype.is_complex:
        raise ValueError(f"{what}: offsets must be an integer tensor, got {offsets.dtype}")
    _check_index_dtype(what, "offsets", offsets)
    if not read or not _readable(offsets):
        return
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0:
        raise ValueError(f"{what}: Expected first offset to be 0, but got {first}: offsets start at {first}, not 0: "
                         f"rebase offsets sliced out of a larger batch (offsets - offsets[0], "
                         f"values[offsets[0]:offsets[-1]]), or build the KJT from lengths")
    down = (offsets[1:] < offsets[:-1]).nonzero()
    if down.numel():
        j = int(down[0, 0])
        raise ValueError(f"{what}: offsets must never decrease, but offsets[{j + 1}] = {int(offsets[j + 1])} < "
                         f"offsets[{j}] = {int(offsets[j])}: offsets are cumulative bag sizes")
    if last != num_values:
        raise ValueError(f"{what}: The last element of offsets must equal to the number of values, but got {last} and "
                         f"{num_values}: offsets end at {last} but there are {num_values} values")


def _check_same_bags(what: str, lengths: Tensor, offsets: Tensor) -> None:
    """Lengths and offsets both given must agree (readers pick one or the other). CPU tensors only."""
    if offsets.numel() != lengths.numel() + 1:
        raise ValueError(f"{what}: lengths and offsets were both given: Expected lengths size to be 1 more than "
                         f"offsets size, but got lengths size: {lengths.numel()} and offsets size: {offsets.numel()} "
                         f"(offsets hold one entry per bag + 1): pass one of them (the other is derived)")
    if _readable(lengths) and _readable(offsets) and not torch.equal(offsets[1:] - offsets[:-1],
                                                                     lengths.to(offsets.dtype)):
        raise ValueError(f"{what}: lengths and offsets were both given and describe different bags (offsets is not "
                         f"equal to the cumulative sum of lengths; lengths {lengths.tolist()[:8]}, offsets "
                         f"{offsets.tolist()[:9]}): pass one of them (the other is derived)")


def _check_jagged(what: str, values: Tensor, lengths: Tensor, weights: Tensor | None, read: bool = True) -> None:
    """Raise ValueError if lengths do not describe values (and weights). CPU tensors only."""
    if values.dim() < 1:
        raise ValueError(f"{what}: values must be at least 1-d, got shape {tuple(values.shape)}")
    if lengths.dim() != 1 and lengths.numel():  # TorchRec's (B, 0) lengths of no bag pass
        raise ValueError(f"{what}: lengths must be 1-d, got shape {tuple(lengths.shape)}")
    if lengths.numel():  # TorchRec's empty lengths may be float (torch.tensor([]))
        if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise ValueError(f"{what}: lengths must be an integer tensor, got {lengths.dtype}")
        _check_index_dtype(what, "lengths", lengths)
    if values.device != lengths.device or (weights is not None and weights.device != values.device):
        where = f"values on {values.device}, lengths on {lengths.device}" + (
            f", weights on {weights.device}" if weights is not None else "")
        raise ValueError(f"{what}: {where}: put them on one device (kjt.to(device) moves them together)")
    if weights is not None and weights.numel() != values.numel() and (weights.dim() != 1 or weights.shape[0] != \
            values.shape[0]):  # one weight per id (per row of 2-d values), or per entry (TorchRec's)
        raise ValueError(f"{what}: weights size must equal to values size, but got {weights.numel()} and "
                         f"{values.numel()}: weights of shape {tuple(weights.shape)} for {values.shape[0]} values: "
                         f"give one weight per id")
    if lengths.numel() == 0 and values.shape[0] != 0:
        raise ValueError(f"{what}: Sum of lengths must equal the number of values, but got 0 and {values.shape[0]}: "
                         f"{values.shape[0]} values but no lengths")
    if not read or not _readable(lengths) or lengths.numel() == 0:
        return
    total, smallest = int(lengths.sum()), int(lengths.min())
    if smallest < 0:
        raise ValueError(f"{what}: lengths must be >= 0, found {smallest}")
    if total != values.shape[0]:
        raise ValueError(f"{what}: Sum of lengths must equal the number of values, but got {total} and "
                         f"{values.shape[0]}: lengths add up to {total} but there are {values.shape[0]} values")


def _variable_stride(keys: list[str], stride: int | None, stride_per_key_per_rank, stride_per_key,
                     inverse_indices) -> tuple[int | None, list[list[int]] | None]:
    """TorchRec's variable-batch (VBE) arguments -> (stride, per key its bags per rank, or None when every key has
    `stride` bags). A variable batch's stride is, as TorchRec's, the one given, else its full batch (the inverse
    indices' width), else its largest key's bags; its lengths are key-major, each key's bags rank after rank. The
    strides' shape is checked by validate() (`_check_variable_stride`), as TorchRec's constructor only assigns."""
    per_rank: list[list[int]] | None = None
    if stride_per_key_per_rank is not None and len(stride_per_key_per_rank):
        per_rank = [[int(b) for b in r] for r in (stride_per_key_per_rank.tolist() if isinstance(
            stride_per_key_per_rank, Tensor) else stride_per_key_per_rank)]
    if stride_per_key is not None and len(stride_per_key):
        given = [int(s) for s in stride_per_key]
        if len(given) != len(keys) or (per_rank is not None and given != [sum(r) for r in per_rank]):
            raise ValueError(f"KeyedJaggedTensor: stride_per_key {given} must give one batch size per key {keys}"
                             f"{'' if per_rank is None else ' agreeing with stride_per_key_per_rank ' + str(per_rank)}")
        per_rank = per_rank or [[s] for s in given]
    if per_rank is None:
        return stride, None
    per_key = [sum(r) for r in per_rank]
    if len(set(per_key)) <= 1 and len(per_rank) == len(keys):  # every key has the batch's stride: an ordinary batch
        if stride is not None and per_key and per_key[0] != stride:
            raise ValueError(f"KeyedJaggedTensor: keys {keys} have batch size {per_key[0]} by their strides, but "
                             f"stride={stride}: leave stride out, or give the keys' own")
        return (per_key[0] if per_key else stride), None
    if stride is None:
        full = inverse_indices[1] if _is_inverse_pair(inverse_indices) else None
        stride = full.shape[-1] if full is not None and full.numel() else max(per_key)
    return stride, per_rank


def _is_inverse_pair(x: object) -> bool:
    return isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[1], Tensor)


def _check_variable_stride(keys: list[str], lengths: Tensor, per_rank: list[list[int]]) -> None:
    """A variable batch's strides say how many lengths there are: key-major, each key's bags rank after rank."""
    if len(per_rank) != len(keys) or len({len(r) for r in per_rank}) > 1 or any(b < 0 for r in per_rank for b in r):
        raise ValueError(f"KeyedJaggedTensor: stride_per_key_per_rank {per_rank} must give each of the "
                         f"{len(keys)} keys {keys} its bags per rank (>= 0, as many ranks for every key)")
    per_key = [sum(r) for r in per_rank]
    if lengths.numel() != sum(per_key):
        raise ValueError(f"KeyedJaggedTensor: stride_per_key_per_rank {per_rank} gives {sum(per_key)} bags (per key "
                         f"{dict(zip(keys, per_key))}) but there are {lengths.numel()} lengths: give one length per "
                         f"bag (key-major, each key's bags rank after rank), or the strides of these lengths")


def _check_inverse_indices(keys: list[str], strides: list[int], inverse_indices) -> tuple[list[str], Tensor]:
    """TorchRec's (keys, [F, B] tensor): each key's samples of the full batch as positions among its bags (`strides`:
    per key)."""
    if not (isinstance(inverse_indices, (tuple, list)) and len(inverse_indices) == 2
            and isinstance(inverse_indices[1], Tensor)):
        raise ValueError("KeyedJaggedTensor: inverse_indices must be (keys, tensor), TorchRec's: the keys and a "
                         "[keys, batch] tensor of bag positions")
    inv_keys, index_FB = list(inverse_indices[0]), inverse_indices[1]
    missing = [k for k in keys if k not in inv_keys]
    if missing:
        raise ValueError(f"KeyedJaggedTensor: inverse_indices name keys {inv_keys}, not the KJT's {missing}: give "
                         f"one row of inverse indices per key")
    if index_FB.dim() != 2 or index_FB.shape[0] != len(inv_keys) or index_FB.dtype not in _ID_DTYPES:
        raise ValueError(f"KeyedJaggedTensor: inverse_indices' tensor must be an integer [{len(inv_keys)}, batch] "
                         f"tensor (one row per key named), got {index_FB.dtype} of shape {tuple(index_FB.shape)}")
    if not (_readable(index_FB) and index_FB.numel()):
        return inv_keys, index_FB
    bags = dict(zip(keys, strides))
    limit = torch.tensor([bags.get(k, max(strides, default=0)) for k in inv_keys]).unsqueeze(1)
    bad = ((index_FB < 0) | (index_FB >= limit)).any(dim=1).nonzero()
    if bad.numel():
        k = int(bad[0, 0])
        stride, row = int(limit[k, 0]), index_FB[k]
        raise ValueError(f"KeyedJaggedTensor: inverse_indices must be bag positions in 0..{stride - 1} (key "
                         f"'{inv_keys[k]}' has {stride} bags), got values {int(row.min())}..{int(row.max())}")
    return inv_keys, index_FB


def _check_per_key(what: str, keys: list[str], lengths: Tensor, strides: list[int],
                   length_per_key: Sequence[int] | None, offset_per_key: Sequence[int] | None) -> None:
    """`length_per_key` / `offset_per_key` given with the lengths must describe the same ids (they are trusted
    afterwards: a stale list would send one feature's ids to another's table). CPU tensors only."""
    n = len(keys)
    if length_per_key is not None and any(isinstance(x, (list, tuple)) for x in length_per_key):
        raise ValueError(f"{what}: length_per_key {list(length_per_key)} holds lists: TorchRec's 7th positional "
                         f"argument is stride_per_key_per_rank, ours length_per_key; pass it by keyword")
    if length_per_key is not None and len(length_per_key) != n:
        raise ValueError(f"{what}: length_per_key has {len(length_per_key)} entries for the {n} keys {keys}: give "
                         f"one id count per key, or leave length_per_key out (it is computed from the lengths)")
    if offset_per_key is not None and len(offset_per_key) != n + 1:
        raise ValueError(f"{what}: offset_per_key has {len(offset_per_key)} entries for the {n} keys {keys}: give "
                         f"one per key + 1, or leave offset_per_key out (it is computed from the lengths)")
    if not _readable(lengths):
        return
    key_of_bag = torch.repeat_interleave(torch.arange(n), torch.tensor(strides, dtype=torch.long))
    actual = torch.zeros(n, dtype=torch.long).index_add_(0, key_of_bag, lengths.long()).tolist()
    if length_per_key is not None and [int(x) for x in length_per_key] != actual:
        raise ValueError(f"{what}: length_per_key {list(length_per_key)} disagrees with the lengths, which give "
                         f"{actual} ids per key for keys {keys}: leave length_per_key out (it is computed from the "
                         f"lengths), or pass the lengths' own")
    if offset_per_key is not None:
        expected = [0]
        for x in actual:
            expected.append(expected[-1] + x)
        if [int(x) for x in offset_per_key] != expected:
            raise ValueError(f"{what}: offset_per_key {list(offset_per_key)} disagrees with the lengths, which give "
                             f"{expected} for keys {keys}: leave offset_per_key out (it is computed from the "
                             f"lengths), or pass the lengths' own")


def _no_key(what: str, key: object, keys: list[str]) -> None:
    """A KJT / KT is indexed by key name: a position (`kt[0]`, `for x in kjt`) is refused as such."""
    if not isinstance(key, str):
        raise TypeError(f"{what} is indexed by key name (one of {keys}), got {key!r}: iterate over .keys(), or "
                        f".to_dict().items() for each key's {'JaggedTensor' if what != 'KeyedTensor' else 'block'}")
    raise KeyError(f"no key {key!r} in this {what}; keys are {keys}")


def validate_jt(jt: Any) -> None:
    """A JaggedTensor's values, lengths, offsets and weights agree (ValueError naming the difference). Once per JT."""
    given = getattr(jt, "_unchecked", None)
    if given is None:
        return
    what = "JaggedTensor"
    values, weights, lengths, offsets = jt._values, jt._weights, jt._lengths, jt._offsets
    for name, t in (("values", values), ("weights", weights), ("lengths", lengths), ("offsets", offsets)):
        _need_tensor(what, name, t)
    if given.offsets:
        _check_offsets(what, offsets, values.shape[0] if values.dim() else 0)
    _check_jagged(what, values, lengths, weights)
    if given.offsets and given.lengths:  # to_dense reads the lengths, to_padded_dense the offsets
        _check_same_bags(what, lengths, offsets)
    jt._unchecked = None


def _check_keys(keys: Any) -> None:
    if isinstance(keys, str):
        raise ValueError(f"KeyedJaggedTensor: keys must be a list of feature names, got the string {keys!r}: "
                         f"write keys=[{keys!r}]")
    if not isinstance(keys, list):
        raise ValueError(f"KeyedJaggedTensor: keys must be a list of feature names, got {keys!r}")
    if len(set(keys)) != len(keys):
        raise ValueError(f"KeyedJaggedTensor: keys must be unique: duplicate keys in {keys}")
    if not all(isinstance(k, str) for k in keys):
        raise ValueError(f"KeyedJaggedTensor: keys must be feature names (str), got {keys}")


def _check_stride(keys: list[str], lengths: Tensor, stride: int, stride_given: bool) -> None:
    if not keys and lengths.numel():
        raise ValueError(f"KeyedJaggedTensor: keys is empty but lengths or offsets is not ({lengths.numel()} bags): "
                         f"name the features in keys")
    if not stride_given and keys and lengths.numel() % len(keys):
        raise ValueError(f"KeyedJaggedTensor: lengths size must be divisible by keys size: {lengths.numel()} lengths "
                         f"is not a multiple of the {len(keys)} keys {keys}: give one length per key per sample "
                         f"(key-major)")
    if lengths.numel() != len(keys) * stride:
        raise ValueError(f"KeyedJaggedTensor: {lengths.numel()} lengths for {len(keys)} keys x stride {stride}: give "
                         f"one length per key per sample (key-major)")


def validate_kjt(kjt: Any, contents: bool = True) -> None:
    """A KeyedJaggedTensor built from user arguments is well formed (keys, lengths, offsets, values and weights agree,
    TorchRec's validator), else a ValueError naming what disagrees and the fix; one the library built from a checked one
    passes at once. Any dtype of values: integer ids are the collections' contract (`check_ids_contract`).
    contents=False leaves out the reads of the lengths' and offsets' values, which a collection's id check
    (batch_check) makes anyway."""
    given = getattr(kjt, "_unchecked", None)  # a KJT pickled by an older version carries none
    if given is None:
        return
    what = "KeyedJaggedTensor"
    keys, values, weights, lengths, offsets = kjt._keys, kjt._values, kjt._weights, kjt._lengths, kjt._offsets
    _check_keys(keys)
    for name, t in (("values", values), ("weights", weights), ("lengths", given.lengths), ("offsets", offsets)):
        _need_tensor(what, name, t)
    if lengths is None:
        raise ValueError("KeyedJaggedTensor: lengths and offsets cannot be both empty: give lengths (one per key per "
                         "sample) or offsets")
    if given.lengths is None:
        _check_offsets(what, offsets, values.shape[0] if values.dim() else 0, contents)
    per_rank = getattr(kjt, "_stride_per_key_per_rank", None)
    if per_rank is None:
        _check_stride(keys, lengths, kjt._stride, given.stride)
    else:
        _check_variable_stride(keys, lengths, per_rank)
    strides = [kjt._stride] * len(keys) if per_rank is None else [sum(r) for r in per_rank]
    _check_jagged(what, values, lengths, weights, contents)
    if offsets is not None and given.lengths is not None:  # both given (or offsets computed since): they must agree
        _check_offsets(what, offsets, values.shape[0] if values.dim() else 0, contents)
        _check_same_bags(what, lengths, offsets)
    if given.length_per_key is not None or given.offset_per_key is not None:
        _check_per_key(what, keys, lengths, strides, given.length_per_key, given.offset_per_key)
    if given.index_per_key is not None and dict(given.index_per_key) != {k: i for i, k in enumerate(keys)}:
        raise ValueError(f"KeyedJaggedTensor: index_per_key {dict(given.index_per_key)} does not give each key its "
                         f"position in keys {keys}: leave it out (it is computed from the keys)")
    if kjt._inverse_indices is not None:
        _check_inverse_indices(keys, strides, kjt._inverse_indices)
    if contents:
        kjt._unchecked = None


def check_sync_shapes(kjt: Any) -> None:
    """What `sync()` reads: a list of keys, and lengths (or offsets) of one bag per key per sample."""
    given = getattr(kjt, "_unchecked", None)
    _check_keys(kjt._keys)
    for name, t in (("values", kjt._values), ("lengths", kjt._lengths), ("offsets", kjt._offsets)):
        _need_tensor("KeyedJaggedTensor", name, t)
    if kjt._lengths is None:
        raise ValueError("KeyedJaggedTensor: lengths and offsets cannot be both empty: give lengths (one per key per "
                         "sample) or offsets")
    per_rank = getattr(kjt, "_stride_per_key_per_rank", None)
    if per_rank is None:
        _check_stride(kjt._keys, kjt._lengths, kjt._stride, given is None or given.stride)
    else:
        _check_variable_stride(kjt._keys, kjt._lengths, per_rank)


def validate_keyed_jagged_tensor(kjt: Any) -> None:
    """TorchRec's `torchrec.sparse.jagged_tensor_validator.validate_keyed_jagged_tensor`: `kjt.validate()`."""
    validate_kjt(kjt)


def check_ids_contract(kjt: Any) -> None:
    """What a collection reads as ids: one integer (int64 or int32) id per value, per-id weights floating point.
    Checked at its first look at a batch (a KJT itself holds values of any dtype, as TorchRec's)."""
    values, weights = kjt._values, kjt._weights
    if not isinstance(values, Tensor):
        return  # named by validate_kjt
    if values.dtype not in ID_DTYPES:  # int8/int16/uint8 too: no kernel reads them
        raise ValueError(f"KeyedJaggedTensor: ids must be integers (int64 or int32), got values of {values.dtype}: "
                         f"convert them with values.long()")
    if values.dim() != 1:
        raise ValueError(f"KeyedJaggedTensor: values must be 1-d ids, got shape {tuple(values.shape)}")
    if isinstance(weights, Tensor) and not weights.dtype.is_floating_point:
        raise ValueError(f"KeyedJaggedTensor: weights must be floating point, got {weights.dtype}: pass "
                         f"weights.float()")
    if isinstance(weights, Tensor) and weights.dim() != 1:
        raise ValueError(f"KeyedJaggedTensor: weights of shape {tuple(weights.shape)} for {values.shape[0]} ids: give "
                         f"one weight per id")
