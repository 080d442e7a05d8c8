"""Jagged (variable-length) sparse features: JaggedTensor (one feature) and KeyedJaggedTensor (many).

Shapes: F keys (features), B stride (samples in the batch), N ids in all, D embedding dims.

A KeyedJaggedTensor holds, for every feature and every sample, a bag of ids. Lengths are
key-major: feature 0's B lengths, then feature 1's, and so on; values follow the same order.

    keys = ["f1", "f2"], B = 3
             sample0  sample1  sample2
      f1     [1, 2]   []       [3]
      f2     [4]      [5, 6]   [7]

      values_N   = [1, 2, 3, 4, 5, 6, 7]
      lengths_FB = [2, 0, 1, 1, 2, 1]
      offsets    = [0, 2, 2, 3, 4, 6, 7]     (F*B + 1)
      length_per_key = [3, 4], offset_per_key = [0, 3, 7]

Values may be of any dtype and 1-d or 2-d, as TorchRec's (scores, dense sequences); integer ids are the contract
of the collections that read them. The constructors only assign (but for TorchRec's assert that lengths and offsets
are integers); `validate()` (checks.py) checks that keys, lengths and values agree, and a collection runs it on every
batch it reads. Jagged work (permute, cumsum) uses fbgemm ops."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_rec._device import move_or_explain  # noqa: F401  (imported from here too)
from lightning_rec.errors import NoTorchScript
from lightning_rec.sparse.checks import (
    JaggedArgumentError,
    _is_inverse_pair,
    _need_tensor,
    _no_key,
    _readable,
    _refuse_dtype_as_device,
    _variable_stride,
    check_sync_shapes,
    validate_jt,
    validate_kjt,
)

try:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm.*)
except (ImportError, OSError) as _e:  # absent, or built for another torch (its .so fails to load)
    raise ImportError(
        f"lightning_rec needs fbgemm-gpu built for the installed torch {torch.__version__} ({_e}). CPU: "
        "pip install 'lightning_rec[cpu]' (torch 2.13.0 + fbgemm-gpu-cpu 1.8.0). GPU: the fbgemm-gpu release "
        "built for your CUDA torch (1.8.0 for torch 2.13, 1.6.0 for 2.11; README, 'GPU'); never both"
    ) from _e


def _cumsum_with_zero(lengths: Tensor) -> Tensor:
    """[n] lengths -> [n + 1] offsets starting at 0 (fbgemm's complete cumsum)."""
    if lengths.numel() == 0:
        return torch.zeros(1, dtype=lengths.dtype, device=lengths.device)
    return torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)


def _lengths_from_offsets(offsets: Tensor) -> Tensor:
    return offsets[1:] - offsets[:-1]


# permute's indices_tensors found equal to their indices, by id (weakly: gone with the tensor)
_CHECKED_PERMUTES: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
_FBGEMM_PERMUTE_WEIGHTS = (torch.float32, torch.float64, torch.float16)  # per-id weights fbgemm's permute takes


def _integer_or_empty(what: str, name: str, t: Tensor | None) -> None:
    """TorchRec's constructor assert: lengths / offsets hold integers (or nothing)."""
    if isinstance(t, Tensor) and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool) \
            and not torch.compiler.is_compiling() and t.numel():
        raise JaggedArgumentError(f"{what}: {name} must be of integer type, but got {t.dtype}: convert them "
                                  f"with {name}.long()")


def _bags_string(data: Tensor, offsets: list[int], first: int, end: int) -> str:
    """`[[1.0], [], [2.0, 3.0]]`: bags first..end-1 of 1-d or 2-d data, as TorchRec prints them."""
    if data.dim() > 2:
        raise ValueError(f"a jagged tensor prints values of 1 or 2 dims, these have {data.dim()}: print "
                         f"values() itself")
    rows = data.tolist()
    return "[" + ", ".join("[" + ", ".join(str(v) for v in rows[offsets[b]:offsets[b + 1]]) + "]"
                           for b in range(first, end)) + "]"


class _JTGiven(NamedTuple):  # what a JaggedTensor's constructor was given, kept for validate()
    lengths: bool
    offsets: bool


class _KJTGiven(NamedTuple):  # the arguments of a KeyedJaggedTensor that validate() checks
    lengths: Tensor | None
    stride: bool
    length_per_key: Sequence[int] | None
    offset_per_key: Sequence[int] | None
    index_per_key: dict[str, int] | None


# the metaclass: torch.fx records a construction from traced tensors as one node
class _Jagged(NoTorchScript, metaclass=torch.fx.ProxyableClassMeta):
    """What JaggedTensor and KeyedJaggedTensor hold alike: values_N, weights_N, lengths and (lazy) offsets."""

    _values: Tensor
    _weights: Tensor | None
    _lengths: Tensor
    _offsets: Tensor | None
    _lengths_derived = False  # lengths computed from the given offsets, not yet read: TorchRec holds none yet

    def values(self) -> Tensor:
        return self._values

    def weights(self) -> Tensor:
        if self._weights is None:
            raise ValueError(f"this {type(self).__name__} has no weights: use weights_or_none()")
        return self._weights

    def weights_or_none(self) -> Tensor | None:
        return self._weights

    def lengths(self) -> Tensor:
        self._lengths_derived = False
        return self._lengths

    def lengths_or_none(self) -> Tensor | None:
        """TorchRec's: the lengths if given or read already (`lengths()`), else None (built from offsets)."""
        return None if self._lengths_derived else self._lengths

    def offsets(self) -> Tensor:
        if self._offsets is None:
            self._offsets = _cumsum_with_zero(self._lengths)
        return self._offsets

    def offsets_or_none(self) -> Tensor | None:
        """TorchRec's: the offsets if given or computed already (`offsets()`), else None."""
        return self._offsets


class JaggedTensor(_Jagged):
    """One feature's bags: values_N with lengths_B (or offsets_B+1), optional weights_N."""

    def __init__(self, values: Tensor, weights: Tensor | None = None, lengths: Tensor | None = None,
                 offsets: Tensor | None = None) -> None:
        # Assigns only, as TorchRec's (but for its two asserts): jt.validate() checks that the tensors agree
        if lengths is None and offsets is None:
            raise JaggedArgumentError("JaggedTensor needs lengths or offsets (Must provide lengths or offsets)")
        _integer_or_empty("JaggedTensor", "lengths", lengths)
        _integer_or_empty("JaggedTensor", "offsets", offsets)
        self._unchecked = _JTGiven(lengths is not None, offsets is not None)
        if lengths is None and isinstance(offsets, Tensor):
            lengths, self._lengths_derived = _lengths_from_offsets(offsets), True
        self._values, self._weights, self._lengths, self._offsets = values, weights, lengths, offsets

    def validate(self) -> JaggedTensor:
        """Check that values, lengths, offsets and weights agree (ValueError naming what differs); returns self."""
        validate_jt(self)
        return self

    @staticmethod
    def empty(is_weighted: bool = False, device: torch.device | str | None = None,
              values_dtype: torch.dtype | None = None, weights_dtype: torch.dtype | None = None,
              lengths_dtype: torch.dtype = torch.int32) -> JaggedTensor:
        """TorchRec's: no bag, lengths and offsets empty; values default to int64 ids, weights to the default float
        dtype."""
        return JaggedTensor(values=torch.empty(0, dtype=values_dtype or torch.int64, device=device),
                            weights=torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
                            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
                            offsets=torch.empty(0, dtype=lengths_dtype, device=device))

    @staticmethod
    def from_dense(values: list[Tensor], weights: list[Tensor] | None = None) -> JaggedTensor:
        """One tensor per sample -> a JaggedTensor (a convenience for tests and small inputs)."""
        lengths = torch.tensor([v.shape[0] for v in values], dtype=torch.int64)
        cat = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        w = torch.cat(weights) if weights else None
        return JaggedTensor(values=cat, weights=w, lengths=lengths)

    @staticmethod
    def from_dense_lengths(values: Tensor, lengths: Tensor, weights: Tensor | None = None) -> JaggedTensor:
        """TorchRec's: padded rows -> a JaggedTensor. values [B, L] (or [B, L, ...]); sample b keeps its first
        lengths[b] entries; weights (optional) are padded as values are. One node when torch.fx traces it."""
        return _jt_from_dense_lengths(values, lengths, weights)

    def to_dense(self) -> list[Tensor]:
        """One tensor per sample (splits values by lengths; a convenience, not a hot path)."""
        return list(torch.split(self._values, self._lengths.tolist()))

    def to_dense_weights(self) -> list[Tensor] | None:
        """Each sample's weights (as `to_dense` splits values); None when there are no weights (TorchRec's)."""
        if self._weights is None:
            return None
        return list(torch.split(self._weights, self._lengths.tolist()))

    def to_padded_dense(self, desired_length: int | None = None, padding_value: float = 0) -> Tensor:
        """[B, L]: each bag left-aligned, cut or padded to L (default: the longest bag)."""
        return self._padded(self._values, desired_length, padding_value, "to_padded_dense")

    def to_padded_dense_weights(self, desired_length: int | None = None,
                                padding_value: float = 0) -> Tensor | None:
        """`to_padded_dense` of the weights: [B, L]; None when there are no weights (TorchRec's)."""
        if self._weights is None:
            return None
        return self._padded(self._weights, desired_length, padding_value, "to_padded_dense_weights")

    def _padded(self, data_N: Tensor, desired_length: int | None, padding_value: float, name: str) -> Tensor:
        lengths_B = self._lengths
        B = lengths_B.numel()
        if desired_length is not None and desired_length < 0:
            raise ValueError(f"{name}: desired_length={desired_length} must be >= 0 (None: the longest bag)")
        L = desired_length if desired_length is not None else int(lengths_B.max()) if B else 0
        out = data_N.new_full((B, L) + tuple(data_N.shape[1:]), padding_value)
        sample_N = torch.arange(B, device=lengths_B.device).repeat_interleave(lengths_B)
        data_N = data_N[: sample_N.numel()]  # values past what the lengths cover belong to no bag (TorchRec's)
        position_N = torch.arange(data_N.shape[0], device=lengths_B.device) - self.offsets()[sample_N]
        keep_N = position_N < L
        out[sample_N[keep_N], position_N[keep_N]] = data_N[keep_N]
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedTensor:
        if isinstance(device, torch.dtype) and self._values.dtype.is_floating_point:
            # an EmbeddingCollection's output: its values are embeddings, not the ids _refuse_dtype_as_device names
            raise ValueError(f"JaggedTensor.to({device}): to() moves devices only (the lengths stay integers); convert "
                             f"the embedding values themselves: JaggedTensor(values=jt.values().to({device}), "
                             f"lengths=jt.lengths()), or jt.values().to({device})")
        _refuse_dtype_as_device("JaggedTensor", device)
        return move_or_explain(f"JaggedTensor.to({str(device)!r})", device, lambda: self._map(
            lambda t: t.to(device, non_blocking=non_blocking)))

    def device(self) -> torch.device:
        """TorchRec's: the values' device (a method, as there)."""
        return self._values.device

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None:
                t.record_stream(stream)

    def _map(self, fn) -> JaggedTensor:
        jt = JaggedTensor.__new__(JaggedTensor)
        jt._values = fn(self._values)
        jt._weights = None if self._weights is None else fn(self._weights)
        jt._lengths = fn(self._lengths)
        jt._offsets = None if self._offsets is None else fn(self._offsets)
        jt._lengths_derived = self._lengths_derived
        return jt

    def __str__(self) -> str:
        """TorchRec's: each sample's values (and weights)."""
        offsets = self.offsets().tolist()
        if self._weights is None:
            return "JaggedTensor({\n    " + _bags_string(self._values, offsets, 0, len(offsets) - 1) + "\n})\n"
        return ("JaggedTensor({\n    \"values\": " + _bags_string(self._values, offsets, 0, len(offsets) - 1)
                + ',\n    "weights": ' + _bags_string(self._weights, offsets, 0, len(offsets) - 1) + "\n})\n")

    def __repr__(self) -> str:
        return str(self).rstrip("\n")


def _jt_from_dense_lengths(values: Tensor, lengths: Tensor, weights: Tensor | None) -> JaggedTensor:
    """JaggedTensor.from_dense_lengths (a leaf of torch.fx traces: its checks read the tensors)."""
    for name, t in (("values", values), ("lengths", lengths), ("weights", weights)):
        _need_tensor("JaggedTensor.from_dense_lengths", name, t)
    if values.dim() < 2 or lengths.dim() != 1 or lengths.numel() != values.shape[0]:
        raise ValueError(f"JaggedTensor.from_dense_lengths: values must be [B, L] with one length per row, got "
                         f"values {tuple(values.shape)} and lengths {tuple(lengths.shape)}")
    if weights is not None and weights.shape[:2] != values.shape[:2]:
        raise ValueError(f"JaggedTensor.from_dense_lengths: weights {tuple(weights.shape)} must be padded as "
                         f"values {tuple(values.shape)} are")
    L = values.shape[1]
    if _readable(lengths) and lengths.numel() and not bool(((lengths >= 0) & (lengths <= L)).all()):
        raise ValueError(f"JaggedTensor.from_dense_lengths: lengths must be within 0..{L} (the padded width of "
                         f"values), got {lengths.tolist()}")
    keep_BL = torch.arange(L, device=values.device) < lengths.unsqueeze(-1)
    return JaggedTensor(values=values[keep_BL], weights=None if weights is None else weights[keep_BL],
                        lengths=lengths)


torch.fx.wrap("_jt_from_dense_lengths")


class KeyedJaggedTensor(_Jagged):
    """Many features' bags over one batch. See the module docstring for the layout.

    A variable batch (TorchRec's VBE: `stride_per_key_per_rank`) gives each key its own number of bags, e.g. one user
    row per request beside many candidate rows; `inverse_indices` then say which bag each sample of the full batch
    reads, and the collections expand their outputs by them."""

    _stride_per_key_per_rank: list[list[int]] | None = None  # a variable batch's bags per key per rank

    def __init__(self, keys: Sequence[str], values: Tensor, weights: Tensor | None = None,
                 lengths: Tensor | None = None, offsets: Tensor | None = None, stride: int | None = None,
                 length_per_key: list[int] | None = None, offset_per_key: list[int] | None = None,
                 _validate: bool = True, *, stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
                 stride_per_key: Sequence[int] | None = None, index_per_key: dict[str, int] | None = None,
                 jt_dict: dict[str, JaggedTensor] | None = None,
                 inverse_indices: tuple[list[str], Tensor] | None = None) -> None:
        # assigns only, as TorchRec's (but for its integer asserts; kjt.validate() checks the rest); _validate=False:
        # built from a checked KJT
        del jt_dict  # TorchRec's cache of to_dict(): computed here when asked
        _integer_or_empty("KeyedJaggedTensor", "lengths", lengths)
        _integer_or_empty("KeyedJaggedTensor", "offsets", offsets)
        self._keys = list(keys) if isinstance(keys, (list, tuple)) else keys
        self._unchecked = _KJTGiven(lengths, stride is not None, length_per_key, offset_per_key,
                                    index_per_key) if _validate else None
        stride, self._stride_per_key_per_rank = _variable_stride(self._keys, stride, stride_per_key_per_rank,
                                                                 stride_per_key, inverse_indices)
        if lengths is None and isinstance(offsets, Tensor):
            lengths, self._lengths_derived = _lengths_from_offsets(offsets), True
        if stride is None:
            num_keys = len(self._keys) if isinstance(self._keys, list) else 0
            stride = lengths.numel() // num_keys if num_keys and isinstance(lengths, Tensor) else 0
        self._host: KeyedJaggedTensor | None = None  # this batch on the host, when it was moved from there
        self._values, self._weights = values, weights
        self._lengths, self._offsets = lengths, offsets
        self._stride = stride
        self._length_per_key = length_per_key
        self._offset_per_key = offset_per_key
        self._index_per_key: dict[str, int] | None = None
        self._inverse_indices = (list(inverse_indices[0]), inverse_indices[1]) \
            if _is_inverse_pair(inverse_indices) else inverse_indices

    def validate(self) -> KeyedJaggedTensor:
        """TorchRec's validator: keys, lengths, offsets, ids and weights agree, else a ValueError; returns self."""
        validate_kjt(self)
        return self

    # construction --------------------------------------------------------------------------

    @staticmethod
    def from_lengths_sync(keys: Sequence[str], values: Tensor, lengths: Tensor,
                          weights: Tensor | None = None, stride: int | None = None,
                          stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
                          inverse_indices: tuple[list[str], Tensor] | None = None) -> KeyedJaggedTensor:
        kjt = KeyedJaggedTensor(keys, values, weights=weights, lengths=lengths, stride=stride,
                                stride_per_key_per_rank=stride_per_key_per_rank, inverse_indices=inverse_indices)
        return kjt._synced()

    @staticmethod
    def from_offsets_sync(keys: Sequence[str], values: Tensor, offsets: Tensor,
                          weights: Tensor | None = None, stride: int | None = None,
                          stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
                          inverse_indices: tuple[list[str], Tensor] | None = None) -> KeyedJaggedTensor:
        kjt = KeyedJaggedTensor(keys, values, weights=weights, offsets=offsets, stride=stride,
                                stride_per_key_per_rank=stride_per_key_per_rank, inverse_indices=inverse_indices)
        return kjt._synced()

    @staticmethod
    def from_jt_dict(jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        """Features given one JaggedTensor each. Features of different numbers of bags make a variable batch (each
        key its own stride, TorchRec's VBE), as TorchRec's."""
        keys = list(jt_dict)
        if not keys:
            return KeyedJaggedTensor.empty()
        jts = [jt.validate() for jt in jt_dict.values()]  # where user JaggedTensors enter a batch
        strides = [jt.lengths().numel() for jt in jts]
        weighted = [jt.weights_or_none() is not None for jt in jts]
        if any(weighted) and not all(weighted):
            raise ValueError("from_jt_dict: either every JaggedTensor has weights or none does")
        variable = len(set(strides)) > 1
        return KeyedJaggedTensor(keys, values=torch.cat([jt.values() for jt in jts]),
                                 weights=torch.cat([jt.weights() for jt in jts]) if all(weighted) else None,
                                 lengths=torch.cat([jt.lengths() for jt in jts]),
                                 stride=None if variable else strides[0],
                                 stride_per_key_per_rank=[[n] for n in strides] if variable else None).sync()

    @staticmethod
    def empty(is_weighted: bool = False, device: torch.device | str | None = None,
              values_dtype: torch.dtype | None = None, weights_dtype: torch.dtype | None = None,
              lengths_dtype: torch.dtype = torch.int64) -> KeyedJaggedTensor:
        """TorchRec's arguments; values default to int64 ids, weights to the default float dtype."""
        return KeyedJaggedTensor(keys=[], values=torch.empty(0, dtype=values_dtype or torch.int64, device=device),
                                 weights=torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
                                 lengths=torch.empty(0, dtype=lengths_dtype, device=device), stride=0)

    @staticmethod
    def empty_like(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Same keys and stride, every bag empty."""
        device = kjt.values().device
        return KeyedJaggedTensor(kjt.keys(), values=torch.empty(0, dtype=kjt.values().dtype, device=device),
                                 weights=None if kjt.weights_or_none() is None else torch.empty(0, device=device),
                                 lengths=torch.zeros_like(kjt.lengths()), stride=kjt.stride(),
                                 stride_per_key_per_rank=kjt.stride_per_key_per_rank() or None)

    @staticmethod
    def concat(kjt_list: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """Features of several KJTs over the same samples, side by side (keys concatenated)."""
        return _kjt_concat(kjt_list)

    def _synced(self) -> KeyedJaggedTensor:
        check_sync_shapes(self)  # what sync reads; the rest is checked where it is read (validate(), a collection)
        return self.sync()

    def sync(self) -> KeyedJaggedTensor:
        """Compute the per-key lengths now (one host read), so later splits need no sync."""
        self.length_per_key()
        return self

    def unsync(self) -> KeyedJaggedTensor:
        """TorchRec's: forget the per-key lengths and offsets (computed again, with a host read, when asked)."""
        self._length_per_key = self._offset_per_key = None
        return self

    # accessors ----------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return self._keys

    def stride(self) -> int:
        return self._stride

    def stride_per_key(self) -> list[int]:
        """TorchRec's: bags per key (each key's own in a variable batch, else the batch's stride)."""
        if self._stride_per_key_per_rank is None:
            return [self._stride] * len(self._keys)
        return [sum(r) for r in self._stride_per_key_per_rank]

    def variable_stride_per_key(self) -> bool:
        """TorchRec's: whether keys have their own batch sizes (a variable batch, TorchRec's VBE)."""
        return self._stride_per_key_per_rank is not None

    def stride_per_key_per_rank(self) -> list[list[int]]:
        """TorchRec's: each key's bags per rank of a variable-batch KJT; [] for an ordinary batch (one stride)."""
        return [] if self._stride_per_key_per_rank is None else [list(r) for r in self._stride_per_key_per_rank]

    def inverse_indices(self) -> tuple[list[str], Tensor]:
        """TorchRec's: (keys, [F, B] tensor): for each key and sample of the full batch, the bag it reads."""
        if self._inverse_indices is None:
            raise ValueError("this KeyedJaggedTensor has no inverse indices: build it with "
                             "inverse_indices=(keys, tensor), or use inverse_indices_or_none()")
        return self._inverse_indices

    def inverse_indices_or_none(self) -> tuple[list[str], Tensor] | None:
        """TorchRec's: `inverse_indices()`, or None when none were given."""
        return self._inverse_indices

    def lengths_FB(self) -> Tensor:
        """Lengths as a [F, B] view (an ordinary batch: every key has `stride()` bags)."""
        if self._stride_per_key_per_rank is not None:
            raise ValueError(f"lengths_FB(): keys of this variable batch have their own bag counts "
                             f"{self.stride_per_key()}: split lengths() by stride_per_key() instead")
        return self._lengths.view(len(self._keys), self._stride)

    def lengths_offset_per_key(self) -> list[int]:
        """TorchRec's: where each key's lengths start in `lengths()` (and where the last ends): [0, B, 2B, ..]."""
        if self._stride_per_key_per_rank is None:
            return [i * self._stride for i in range(len(self._keys) + 1)]
        out = [0]
        for n in self.stride_per_key():
            out.append(out[-1] + n)
        return out

    def flatten_lengths(self) -> KeyedJaggedTensor:
        """TorchRec's: the lengths as one flat tensor; they are flat here always, so the same KJT."""
        return self

    def length_per_key(self) -> list[int]:
        """Ids per key. Reads the lengths on the host once, then cached."""
        if self._length_per_key is None:
            if not self._keys:
                self._length_per_key = []
            elif self._stride == 0:
                self._length_per_key = [0] * len(self._keys)
            elif self._values.is_meta:  # no data to count: TorchRec's stand-in split of the values
                n, F = self._values.shape[0], len(self._keys)
                self._length_per_key = [n // F + (n % F if i == 0 else 0) for i in range(F)]
            elif self._stride_per_key_per_rank is not None:
                self._length_per_key = [int(n) for n in torch.stack(
                    [b.sum() for b in self._lengths.split(self.stride_per_key())]).tolist()]
            else:
                self._length_per_key = self.lengths_FB().sum(dim=1).tolist()
        return self._length_per_key

    def length_per_key_or_none(self) -> list[int] | None:
        """TorchRec's: the ids per key if known already (no host read), else None."""
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        if self._offset_per_key is None:
            acc, out = 0, [0]
            for n in self.length_per_key():
                acc += n
                out.append(acc)
            self._offset_per_key = out
        return self._offset_per_key

    def offset_per_key_or_none(self) -> list[int] | None:
        """TorchRec's: `offset_per_key()` if computed already, else None."""
        return self._offset_per_key

    def index_per_key(self) -> dict[str, int]:
        if self._index_per_key is None:
            self._index_per_key = {k: i for i, k in enumerate(self._keys)}
        return self._index_per_key

    def __len__(self) -> int:
        return len(self._keys)

    # reshaping ----------------------------------------------------------------------------

    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """Consecutive key groups of the given sizes, each its own KJT (views, no copy)."""
        if sum(segments) != len(self._keys) or any(int(n) < 0 for n in segments):
            raise ValueError(f"split: segments {list(segments)} must be >= 0 and add up to the {len(self._keys)} keys")
        opk = self.offset_per_key()
        lpk = self.length_per_key()
        bags, per_rank = self.lengths_offset_per_key(), self._stride_per_key_per_rank
        out, k = [], 0
        for n in segments:
            v0, v1 = opk[k], opk[k + n]
            part = KeyedJaggedTensor(self._keys[k : k + n], values=self._values[v0:v1],
                                     weights=None if self._weights is None else self._weights[v0:v1],
                                     lengths=self._lengths[bags[k] : bags[k + n]], stride=self._stride,
                                     length_per_key=lpk[k : k + n], _validate=False,
                                     inverse_indices=self._inverse_indices)
            if per_rank is not None and n:
                part._set_variable_stride(per_rank[k : k + n], self._stride)
            out.append(part)
            k += n
        return out

    def permute(self, indices: Sequence[int], indices_tensor: Tensor | None = None) -> KeyedJaggedTensor:
        """Keys reordered (or selected, or repeated) by index: keys()[i] for i in indices."""
        bad = [i for i in indices if isinstance(i, bool) or not 0 <= int(i) < len(self._keys)]
        if bad:  # fbgemm's permute reads out of bounds (a segfault) on a bad index
            raise ValueError(f"permute: indices {bad} are not key positions: use 0..{len(self._keys) - 1} "
                             f"(keys {self._keys})")
        if list(indices) == list(range(len(self._keys))):
            return self  # every key in its place: nothing to move (a routing of one rank, a collection's own order)
        keys = [self._keys[i] for i in indices]
        if self._stride_per_key_per_rank is not None:
            return self._permute_variable(keys, indices)
        if self._length_per_key is None and sorted(indices) == list(range(len(self._keys))):
            # A reordering of every key keeps all N ids: no need to read the lengths back (a device sync).
            new_lpk, total = None, self._values.shape[0]
        else:
            lpk = self.length_per_key()
            new_lpk = [lpk[i] for i in indices]
            total = sum(new_lpk)
        if indices_tensor is None:
            indices_tensor = torch.tensor(list(indices), dtype=torch.int32, device=self._values.device)
        else:
            # TorchRec's cached int32 copy of `indices` (fbgemm reads int32): checked where no device sync is needed
            indices_tensor = indices_tensor.to(device=self._values.device, dtype=torch.int32)
            # once per tensor: a read per batch would sync on GPU (tests/test_gpu_paths.py counts them)
            if _readable(indices_tensor) and _CHECKED_PERMUTES.get(id(indices_tensor)) is not indices_tensor:
                if indices_tensor.tolist() != [int(i) for i in indices]:
                    raise ValueError(f"permute: indices_tensor {indices_tensor.tolist()} is not indices "
                                     f"{list(indices)}: pass the same positions (or leave indices_tensor out; it is "
                                     f"built from indices)")
                _CHECKED_PERMUTES[id(indices_tensor)] = indices_tensor
        if self._stride == 0 or not keys:
            lengths = self._lengths.new_zeros(len(keys) * self._stride)
            return KeyedJaggedTensor(keys, self._values[:0], None if self._weights is None else
                                     self._weights[:0], lengths=lengths, stride=self._stride,
                                     length_per_key=new_lpk, _validate=False, inverse_indices=self._inverse_indices)
        weights = self._weights
        if weights is not None and (weights.requires_grad and torch.is_grad_enabled()
                                    or weights.dtype not in _FBGEMM_PERMUTE_WEIGHTS):
            # learned (or bfloat16) weights: fbgemm's backward assumes a full permutation; gather by position instead
            src_N = torch.arange(self._values.shape[0], device=self._values.device)
            lengths_FB, src_N, _ = torch.ops.fbgemm.permute_2D_sparse_data(
                indices_tensor, self.lengths_FB(), src_N, None, total
            )
            values_N, weights_N = self._values[src_N], weights[src_N]
        else:
            lengths_FB, values_N, weights_N = torch.ops.fbgemm.permute_2D_sparse_data(
                indices_tensor, self.lengths_FB(), self._values, weights, total
            )
        return KeyedJaggedTensor(keys, values_N, weights_N, lengths=lengths_FB.reshape(-1), stride=self._stride,
                                 length_per_key=new_lpk, _validate=False, inverse_indices=self._inverse_indices)

    def _set_variable_stride(self, per_rank: list[list[int]], stride: int | None = None) -> None:
        """A KJT the library cut out of a variable batch: its keys' own bag counts; its stride the one it was cut
        from (TorchRec's split and permute keep it), else the largest."""
        self._stride_per_key_per_rank = [list(r) for r in per_rank]
        self._stride = stride if stride is not None else max((sum(r) for r in per_rank), default=0)

    def _permute_variable(self, keys: list[str], indices: Sequence[int]) -> KeyedJaggedTensor:
        """permute of a variable batch: each key's bags moved whole (fbgemm's permute of 1-d segments)."""
        bags = self.lengths_offset_per_key()
        device = self._lengths.device
        bag_perm = torch.cat([torch.arange(bags[i], bags[i + 1], device=device) for i in indices]).int() \
            if indices else torch.empty(0, dtype=torch.int32, device=device)
        lpk = self.length_per_key()
        new_lpk = [lpk[i] for i in indices]
        weights = self._weights
        if weights is not None and weights.dtype not in _FBGEMM_PERMUTE_WEIGHTS:
            weights = weights.float()
        lengths, values, weights = torch.ops.fbgemm.permute_1D_sparse_data(
            bag_perm, self._lengths, self._values, weights, sum(new_lpk))
        if weights is not None and self._weights is not None:
            weights = weights.to(self._weights.dtype)
        out = KeyedJaggedTensor(keys, values, weights, lengths=lengths, stride=self._stride, length_per_key=new_lpk,
                                _validate=False, inverse_indices=self._inverse_indices)
        out._set_variable_stride([self._stride_per_key_per_rank[i] for i in indices], self._stride)
        return out

    def to_dict(self) -> dict[str, JaggedTensor]:
        return {key: self.split_one(i) for i, key in enumerate(self._keys)}

    def __getitem__(self, key: str) -> JaggedTensor:
        index = self.index_per_key().get(key) if isinstance(key, str) else None
        if index is None:
            _no_key("KeyedJaggedTensor", key, self._keys)
        return self.split_one(index)

    def __contains__(self, key: object) -> bool:
        # without it, `"f1" in kjt` would go through __getitem__(0), which refuses positions
        return key in self.index_per_key()

    def split_one(self, index: int) -> JaggedTensor:
        opk = self.offset_per_key()
        bags = self.lengths_offset_per_key()
        jt = JaggedTensor.__new__(JaggedTensor)
        jt._values = self._values[opk[index] : opk[index + 1]]
        jt._weights = None if self._weights is None else self._weights[opk[index] : opk[index + 1]]
        if self._lengths.numel():
            jt._lengths, jt._offsets = self._lengths[bags[index] : bags[index + 1]], None
        else:  # no bag at all (lengths may be (F, 0)): TorchRec's empty lengths and offsets
            jt._lengths = jt._offsets = self._lengths.new_empty(0)
        return jt

    # device movement ----------------------------------------------------------------------

    def _map(self, fn, weights_fn=None) -> KeyedJaggedTensor:
        out = KeyedJaggedTensor(
            self._keys,
            values=fn(self._values),
            weights=None if self._weights is None else (weights_fn or fn)(self._weights),
            lengths=fn(self._lengths),
            offsets=None if self._offsets is None else fn(self._offsets),
            stride=self._stride,
            length_per_key=self._length_per_key,
            offset_per_key=self._offset_per_key,
            _validate=False,
            inverse_indices=None if self._inverse_indices is None else (
                self._inverse_indices[0], fn(self._inverse_indices[1])),
        )
        if self._stride_per_key_per_rank is not None:
            out._set_variable_stride(self._stride_per_key_per_rank, self._stride)
        out._lengths_derived = self._lengths_derived
        return out

    def to(self, device: torch.device | str | None, non_blocking: bool = False,
           dtype: torch.dtype | None = None) -> KeyedJaggedTensor:
        """A copy on `device` (None: where it is), as TorchRec's: `dtype` converts the weights only."""
        _refuse_dtype_as_device("KeyedJaggedTensor", device, weights=True)
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"KeyedJaggedTensor.to(dtype={dtype}): dtype converts the per-id weights, which are "
                             f"floating point: give a floating dtype (the ids keep their integer type)")

        def move(t: Tensor) -> Tensor:
            return t if device is None else t.to(device, non_blocking=non_blocking)

        def move_weights(t: Tensor) -> Tensor:
            return move(t) if dtype is None else t.to(device=device, dtype=dtype, non_blocking=non_blocking)

        moved = move_or_explain(f"KeyedJaggedTensor.to({str(device)!r})", device, lambda: self._map(move, move_weights))
        if all(getattr(moved, a) is getattr(self, a) for a in ("_values", "_weights", "_lengths", "_offsets")):
            # already there: itself, as Tensor.to (the pipeline knows a batch's KJT by identity)
            return self
        if moved.device().type != "cpu":
            # The host copy lets collections check ids on the host, without reading the device back.
            moved._host = self if self.device().type == "cpu" else self._host
        return moved

    def host_copy(self) -> KeyedJaggedTensor | None:
        """This batch on the host: itself on CPU; on a device, the KJT it was moved from, if any."""
        return self if self.device().type == "cpu" else self._host

    def pin_memory(self) -> KeyedJaggedTensor:
        return move_or_explain("KeyedJaggedTensor.pin_memory()", None, lambda: self._map(lambda t: t.pin_memory()))

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self._values, self._weights, self._lengths, self._offsets):
            if t is not None:
                t.record_stream(stream)

    def device(self) -> torch.device:
        """The values' device. A method, as TorchRec's `kjt.device()`."""
        return self._values.device

    def __str__(self) -> str:
        """TorchRec's: each key's samples' values (and weights)."""
        if not self._keys or self._lengths is None:
            return "KeyedJaggedTensor()\n"
        offsets, bags, parts = self.offsets().tolist(), self.lengths_offset_per_key(), []
        for i, key in enumerate(self._keys):
            first, end = bags[i], bags[i + 1]
            if self._weights is None:
                parts.append(f'    "{key}": ' + _bags_string(self._values, offsets, first, end))
            else:
                parts.append(f'    "{key}": {{\n        "values": '
                             + _bags_string(self._values, offsets, first, end) + ',\n        "weights": '
                             + _bags_string(self._weights, offsets, first, end) + "\n    }")
        return "KeyedJaggedTensor({\n" + ",\n".join(parts) + "\n})\n"

    def __repr__(self) -> str:
        return str(self).rstrip("\n")


def _kjt_concat(kjt_list: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """KeyedJaggedTensor.concat (a leaf of torch.fx traces: it reads the KJTs' keys and strides)."""
    kjts = kjt_list  # TorchRec's argument name
    if not kjts:
        return KeyedJaggedTensor.empty()
    if any(k.variable_stride_per_key() for k in kjts):
        per_rank = [r for k in kjts for r in (k.stride_per_key_per_rank() or [[k.stride()]] * len(k.keys()))]
        out = _kjt_concat([KeyedJaggedTensor(k.keys(), k.values(), k.weights_or_none(), lengths=k.lengths(), stride=0,
                                             length_per_key=k.length_per_key(), _validate=False) for k in kjts])
        out._set_variable_stride(per_rank)
        return out
    strides = {k.stride() for k in kjts if k.keys()}
    if len(strides) > 1:
        raise ValueError(f"concat: KJTs have different strides {sorted(strides)}")
    weighted = {k.weights_or_none() is not None for k in kjts if k.keys()}
    if len(weighted) > 1:
        raise ValueError("concat: either every KJT has weights or none does")
    keys = [key for k in kjts for key in k.keys()]
    lpk = [n for k in kjts for n in k.length_per_key()]
    return KeyedJaggedTensor(
        keys,
        values=torch.cat([k.values() for k in kjts]),
        # a KJT with no keys (KeyedJaggedTensor.empty()) adds nothing, weights or not
        weights=torch.cat([k.weights() for k in kjts if k.keys()]) if weighted == {True} else None,
        lengths=torch.cat([k.lengths() for k in kjts]),
        stride=strides.pop() if strides else 0,
        length_per_key=lpk,
    )


torch.fx.wrap("_kjt_concat")

