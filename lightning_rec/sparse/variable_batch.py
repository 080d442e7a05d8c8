"""A variable batch (TorchRec's VBE) as the collections read it: an ordinary batch of its largest key's stride.

Shapes: F keys, B_f bags of key f, B = max B_f.

    lengths  [ u0 u1 | c0 c1 c2 c3 ]            u: B_u = 2 (one row per request), c: B_c = 4 (candidates)
      -> padded  [ u0 u1 0 0 | c0 c1 c2 c3 ]    stride B = 4; values and weights unchanged (key-major order is kept)

The padding bags are empty: a lookup pools them to zeros, the id all-to-all sends no id for them, and the pooled
all-to-all leaves them out (sharding/variable_batch.py). The output is expanded to the full batch by
`inverse_indices` (each sample's bag of each key), as TorchRec's collections expand it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_rec.sparse.checks import validate_kjt
from lightning_rec.sparse.jagged_tensor import KeyedJaggedTensor


def is_variable_batch(kjt: object) -> bool:
    return isinstance(kjt, KeyedJaggedTensor) and kjt.variable_stride_per_key()


def padded_batch(kjt: KeyedJaggedTensor, owner: str, contents: bool = True) -> KeyedJaggedTensor:
    """The variable batch `kjt` as an ordinary one of stride max(B_f): each key's bags, then empty ones. Its strides
    are checked against its lengths first (`contents`: the lengths' values too, as validate_kjt)."""
    validate_kjt(kjt, contents=contents)
    if kjt.inverse_indices_or_none() is None:
        raise ValueError(f"{owner}: the input is a variable batch (stride_per_key_per_rank "
                         f"{kjt.stride_per_key_per_rank()}) without inverse_indices, so its outputs cannot be "
                         f"expanded to the full batch: build it "
                         f"with inverse_indices=(keys, [keys, batch] tensor of bag positions), as TorchRec's VBE")
    strides = kjt.stride_per_key()
    F, B = len(strides), max(strides, default=0)  # kjt.stride() is the full batch when inverse_indices are given
    lengths = kjt.lengths()
    device = lengths.device
    strides_t = torch.tensor(strides, dtype=torch.long, device=device)
    key_of_bag = torch.repeat_interleave(torch.arange(F, device=device), strides_t, output_size=lengths.numel())
    first_bag = torch.cumsum(strides_t, 0) - strides_t
    to_N = key_of_bag * B + torch.arange(lengths.numel(), device=device) - first_bag[key_of_bag]
    padded = lengths.new_zeros(F * B).index_copy_(0, to_N, lengths)
    out = KeyedJaggedTensor(kjt.keys(), kjt.values(), kjt.weights_or_none(), lengths=padded, stride=B,
                            length_per_key=kjt.length_per_key_or_none(), _validate=False,
                            inverse_indices=kjt.inverse_indices())
    return out


def strides_of(kjt: KeyedJaggedTensor, features: list[str]) -> list[int]:
    """Bags per feature of `features` (a collection's order) in the variable batch `kjt`."""
    by_key = dict(zip(kjt.keys(), kjt.stride_per_key()))
    return [by_key[f] for f in features]


class _ExpandRows(torch.autograd.Function):
    """Column blocks of [B, D], each by its own row index -> [B_full, D]. Backward sums each row's gradients as bags
    of one embedding_bag (the rows sorted once in forward): index_add_ adds row by row, ~3x slower on CPU."""

    @staticmethod
    def forward(ctx, pooled_BD: Tensor, blocks: list[tuple[Tensor, int, int]]) -> Tensor:
        B = pooled_BD.shape[0]
        # bags per row counted by scatter_add (bincount would read its maximum back from a GPU)
        ctx.blocks = [(torch.argsort(row, stable=True),
                       row.new_zeros(B).scatter_add_(0, row, torch.ones_like(row)).cumsum(0), c, d)
                      for row, c, d in blocks]
        parts = [pooled_BD[:, c : c + d].index_select(0, row) for row, c, d in blocks]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        parts = []
        for order, ends, c, d in ctx.blocks:
            offsets = torch.cat([ends.new_zeros(1), ends[:-1]])  # each row's first position in `order`
            parts.append(torch.nn.functional.embedding_bag(order, grad[:, c : c + d].contiguous(), offsets,
                                                           mode="sum"))
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)), None


def expand_by_inverse_indices(pooled_BD: Tensor, names: Sequence[str], dims: Sequence[int],
                              inverse: tuple[list[str], Tensor]) -> Tensor:
    """TorchRec's deduplicated or variable batch: each feature's rows of its bags -> a row per sample of the full
    batch. Neighbouring features with the same inverse indices (a request's features) share one index_select."""
    keys, index_FB = inverse
    at = {k: i for i, k in enumerate(keys)}
    rows = [index_FB[at[name]] for name in names]
    blocks: list[list] = []
    c0 = 0
    tracing = torch.compiler.is_compiling() or torch.compiler.is_exporting()  # no comparing symbolic rows
    for i, d in enumerate(dims):
        if blocks and (rows[i] is rows[i - 1] or not tracing and torch.equal(rows[i], rows[i - 1])):
            blocks[-1][2] += d
        else:
            blocks.append([rows[i], c0, d])
        c0 += d
    device = pooled_BD.device
    return _ExpandRows.apply(pooled_BD, [(row.to(device).long(), c, d) for row, c, d in blocks])
