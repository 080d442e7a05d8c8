"""Causal attention over jagged sequences without padding the batch to B x Lmax (docs/sequential.md#jagged-attention).

Sequences are grouped into buckets of lengths within a factor of two (1, 2, 3-4, 5-8, ...); each bucket is padded to
its own longest, so attention memory grows with about sum(L_i^2), never B * Lmax^2. Padding sits at the end of a
sequence: under a causal mask no real query sees it, so only the padded rows' outputs (dropped) differ.
On CUDA, softmax attention uses torch's nested (jagged) tensors when this torch can run them there.

Shapes: T positions of the batch (sum of lengths), B sequences, H heads, d per-head dim, b sequences of a bucket,
L the bucket's length."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# attend(q_bHLd, k_bHLd, v_bHLd, *extras_bL) -> out_bHLd: one bucket, padded to its longest, causal
Attend = Callable[..., Tensor]


def causal_softmax_attend(q: Tensor, k: Tensor, v: Tensor, *_: Tensor) -> Tensor:
    """SASRec's: softmax(q k^T / sqrt(d)) v, each position attending to itself and the ones before it."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _bucket_of(lengths_B: Tensor) -> Tensor:
    """ceil(log2(L)): lengths within a factor of two share a bucket (0 and 1 both bucket 0)."""
    return torch.ceil(torch.log2(lengths_B.clamp(min=1).double())).long()


def _padded_index(lengths_b: Tensor, starts_b: Tensor, L: int) -> tuple[Tensor, Tensor]:
    """(flat index [b, L] into the T positions, valid mask [b, L]) of b sequences padded at their end to L."""
    pos_L = torch.arange(L, device=lengths_b.device)
    valid_bL = pos_L.unsqueeze(0) < lengths_b.unsqueeze(1)
    index_bL = torch.where(valid_bL, starts_b.unsqueeze(1) + pos_L, 0)
    return index_bL, valid_bL


def _run_padded(attend: Attend, lengths_b: Tensor, starts_b: Tensor, L: int, qkv: tuple[Tensor, Tensor, Tensor],
                extras: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """One group of sequences padded to L -> (its outputs [t, H, d] in order, their flat positions [t])."""
    index_bL, valid_bL = _padded_index(lengths_b, starts_b, L)
    q, k, v = (x[index_bL].transpose(1, 2) for x in qkv)  # [b, H, L, d]
    out_bHLd = attend(q, k, v, *(e[index_bL] for e in extras))
    return out_bHLd.transpose(1, 2)[valid_bL], index_bL[valid_bL]


def jagged_attention(q_THd: Tensor, k_THd: Tensor, v_THd: Tensor, lengths_B: Tensor,
                     attend: Attend = causal_softmax_attend, extras: tuple[Tensor, ...] = (),
                     bucketed: bool = True) -> Tensor:
    """Causal attention of B jagged sequences, [T, H, d] -> [T, H, d]. `extras` are per-position tensors [T, ...]
    that `attend` gets padded alongside (HSTU's timestamps). bucketed=False pads to the batch's longest: the
    reference the bucketed path is tested against."""
    lengths_B = lengths_B.to(q_THd.device)
    if q_THd.shape[0] == 0:
        return q_THd.new_zeros(v_THd.shape) + 0 * (q_THd.sum() + k_THd.sum() + v_THd.sum())  # keeps the graph
    if attend is causal_softmax_attend and not extras and _nested_sdpa_ok(q_THd):
        return _nested_attention(q_THd, k_THd, v_THd, lengths_B)
    starts_B = torch.cumsum(lengths_B, 0) - lengths_B
    qkv = (q_THd, k_THd, v_THd)
    if not bucketed:
        out, _ = _run_padded(attend, lengths_B, starts_B, int(lengths_B.max()), qkv, extras)
        return out
    bucket_B = _bucket_of(lengths_B)
    outs, where = [], []
    for bucket in torch.unique(bucket_B).tolist():
        members = torch.nonzero(bucket_B == bucket).flatten()
        lengths_b = lengths_B[members]
        if int(lengths_b.max()) == 0:
            continue
        out, at = _run_padded(attend, lengths_b, starts_B[members], int(lengths_b.max()), qkv, extras)
        outs.append(out)
        where.append(at)
    out_THd = torch.cat(outs)
    return out_THd[torch.argsort(torch.cat(where))]  # back to the batch's order


def per_sequence_reference(q_THd: Tensor, k_THd: Tensor, v_THd: Tensor, lengths_B: Tensor,
                           attend: Attend = causal_softmax_attend, extras: tuple[Tensor, ...] = ()) -> Tensor:
    """Each sequence alone (no padding at all): the plainest reference of `jagged_attention`."""
    outs, start = [], 0
    for n in lengths_B.tolist():
        sl = slice(start, start + n)
        q, k, v = (x[sl].transpose(0, 1).unsqueeze(0) for x in (q_THd, k_THd, v_THd))
        outs.append(attend(q, k, v, *(e[sl].unsqueeze(0) for e in extras))[0].transpose(0, 1))
        start += n
    return torch.cat(outs) if outs else q_THd.new_zeros(v_THd.shape)


_NESTED_OK: dict[str, bool] = {}


def _nested_sdpa_ok(x: Tensor) -> bool:
    """Whether torch runs causal SDPA on jagged nested tensors on this device (CUDA only; probed once per dtype)."""
    if x.device.type != "cuda":
        return False
    key = f"{x.device}:{x.dtype}"
    if key not in _NESTED_OK:
        try:
            probe = torch.randn(5, 2, 8, device=x.device, dtype=x.dtype)
            _nested_attention(probe, probe, probe, torch.tensor([2, 3], device=x.device))
            _NESTED_OK[key] = True
        except (RuntimeError, NotImplementedError, AttributeError):
            _NESTED_OK[key] = False
    return _NESTED_OK[key]


def _nested_attention(q_THd: Tensor, k_THd: Tensor, v_THd: Tensor, lengths_B: Tensor) -> Tensor:
    offsets = F.pad(torch.cumsum(lengths_B, 0), (1, 0))
    q, k, v = (torch.nested.nested_tensor_from_jagged(x.contiguous(), offsets).transpose(1, 2)
               for x in (q_THd, k_THd, v_THd))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(q_THd.shape[-1]))
    return out.transpose(1, 2).values()
