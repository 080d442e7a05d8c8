"""Embeddings on their way back: where each returned column or row lands. Pure tensors.

Legend: B local batch, B_r batch of source rank r, D output width (sum of feature dims), D_p width
of rank p's pooled lookup, D_all = sum_p D_p + data-parallel width, N ids, W world size.

Pooled. Rank p's lookup gives pooled [B_0 + ... + B_{W-1}, D_p], its rows already source-major,
so rows B_r of it go back to source r as one block. Source r receives one [B_r, D_p] block per
owner p and places the columns:

    [ from rank 0 | from rank 1 | ... | data-parallel ]  [B, D_all]
          |  each column to its feature's column (Routing.output_columns)
          v
    [ f0 cols | f1 cols | ... ]                           [B, D]   a gather, or a sum (index_add)
                                                                   when row shards add up

Mean pooling under any split is sum then divide by the global bag length, known at the source. Sequence: rows go
back source-major (the inverse of the ids' permutation), and each source puts them in its features' id order."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_rec.sharding.routing import Routing


def inverse_permutation(perm_N: Tensor) -> Tensor:
    inv_N = torch.empty_like(perm_N)
    inv_N[perm_N] = torch.arange(perm_N.numel(), device=perm_N.device, dtype=perm_N.dtype)
    return inv_N


def column_runs(dst_cols: Sequence[int]) -> list[tuple[int, int, int, int, int]]:
    """Where a part's columns land, as few strided copies as possible: (src, dst, width, count, stride). Column i of
    the part goes to output column dst_cols[i]; consecutive columns form a run of `width`, and `count` equal runs
    that sit `stride` apart in the output form one strided copy."""
    runs: list[list[int]] = []  # [src, dst, width]
    for i, d in enumerate(dst_cols):
        if runs and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([i, d, 1])
    out: list[tuple[int, int, int, int, int]] = []
    for src, dst, width in runs:
        if out:
            s0, d0, w0, n0, stride0 = out[-1]
            stride = dst - d0 if n0 == 1 else stride0
            if width == w0 and src == s0 + n0 * w0 and stride >= w0 and dst == d0 + n0 * stride:
                out[-1] = (s0, d0, w0, n0 + 1, stride)
                continue
        out.append((src, dst, width, 1, width))
    return out


def _strided(whole_BD: Tensor, start: int, width: int, count: int, stride: int) -> Tensor:
    B = whole_BD.shape[0]
    return whole_BD.as_strided((B, count, width), (whole_BD.stride(0), stride, 1),
                               whole_BD.storage_offset() + start)


def place_columns(out_BD: Tensor, part_BD: Tensor, runs: Sequence[tuple[int, int, int, int, int]],
                  add: bool = False) -> None:
    """out_BD[:, dst columns] = part_BD (or += with `add`: row shards' partial sums), run by run."""
    B = part_BD.shape[0]
    for src, dst, width, count, stride in runs:
        piece = part_BD[:, src : src + width * count].reshape(B, count, width)
        view = _strided(out_BD, dst, width, count, stride)
        view.add_(piece) if add else view.copy_(piece)


def gather_columns(part_BD: Tensor, whole_BD: Tensor, runs: Sequence[tuple[int, int, int, int, int]]) -> None:
    """part_BD = whole_BD[:, dst columns] (the inverse of place_columns), run by run."""
    B = part_BD.shape[0]
    whole_BD = whole_BD.contiguous()
    for src, dst, width, count, stride in runs:
        part_BD[:, src : src + width * count].view(B, count, width).copy_(_strided(whole_BD, dst, width, count, stride))


class OutputColumns:
    """Where each received part's columns land in the output (Routing.output_columns, as runs)."""

    def __init__(self, routing: Routing, device: torch.device) -> None:
        self.width = sum(routing.feature_dims)
        # Row shards add partial sums into the same columns; otherwise every column comes once.
        self.summed = routing.row_split
        self.rank_dims = routing.rank_dims
        # per part of the received layout (each owner rank's block, then the data-parallel block)
        cols = routing.output_columns().tolist()
        at, self.part_runs = 0, []
        for d in list(routing.rank_dims) + [len(cols) - sum(routing.rank_dims)]:
            self.part_runs.append(column_runs(cols[at : at + d]))
            at += d
        # identity: one part already in feature order (e.g. one owner holds everything): no copy at all
        self.width_dp = len(cols) - sum(routing.rank_dims)
        whole = [(0, 0, self.width, 1, self.width)]
        self.identity = not self.summed and self.part_runs[:-1].count(whole) == 1 and \
            sum(1 for d in self.rank_dims if d) == 1
        dims = torch.tensor(routing.feature_dims, device=device)
        self.width_F = dims
        mean_F = torch.tensor(routing.mean_features, device=device)
        self.mean_D = torch.repeat_interleave(mean_F, dims) if bool(mean_F.any()) else None


def place_parts(parts_BD: Sequence[Tensor | None], dp_BD: Tensor | None, cols: OutputColumns, batch: int,
                like: Tensor) -> Tensor:
    """Each owner's block [B, D_p] (None: nothing) and the data-parallel block -> [B, D] in feature order."""
    out_BD = (like.new_zeros if cols.summed else like.new_empty)(batch, cols.width)
    for part_BD, runs in zip(parts_BD, cols.part_runs):
        if part_BD is not None:
            place_columns(out_BD, part_BD, runs, add=cols.summed)
    if dp_BD is not None:
        place_columns(out_BD, dp_BD, cols.part_runs[-1], add=cols.summed)
    return out_BD


def gather_dp(grad_BD: Tensor, cols: OutputColumns, dtype: torch.dtype) -> Tensor:
    """The data-parallel block's gradient: its columns gathered out of the output's gradient."""
    grad_dp = grad_BD.new_empty(grad_BD.shape[0], cols.width_dp)
    gather_columns(grad_dp, grad_BD, cols.part_runs[-1])
    return grad_dp.to(dtype)


class _PlaceParts(torch.autograd.Function):
    """Received parts and the data-parallel part -> [B, D] in feature order; backward gathers each part's columns."""

    @staticmethod
    def forward(ctx, received: Tensor, dp_BD: Tensor | None, cols: OutputColumns, batch: int) -> Tensor:
        ctx.cols, ctx.batch = cols, batch
        ctx.dp_dtype = dp_BD.dtype if dp_BD is not None else None
        return place_parts(_parts(received, batch, cols.rank_dims), dp_BD, cols, batch, received)

    @staticmethod
    def backward(ctx, grad_BD: Tensor):
        cols, batch = ctx.cols, ctx.batch
        grad_received = grad_BD.new_empty(batch * sum(cols.rank_dims))
        for part_BD, runs in zip(_parts(grad_received, batch, cols.rank_dims), cols.part_runs):
            gather_columns(part_BD, grad_BD, runs)
        grad_dp = gather_dp(grad_BD, cols, ctx.dp_dtype) if ctx.dp_dtype is not None else None
        return grad_received, grad_dp, None, None


def _parts(flat: Tensor, batch: int, dims: Sequence[int]) -> list[Tensor]:
    return [block.view(batch, d) for block, d in zip(flat.split([batch * d for d in dims]), dims)]


def assemble_pooled(received: Tensor, batch: int, dp_BD: Tensor | None, cols: OutputColumns,
                    lengths_FB: Tensor | None) -> Tensor:
    """Received blocks (flat, one [B, D_p] per owner p, in rank order) -> [B, D] in feature order."""
    if cols.identity and dp_BD is None:
        out_BD = received.view(batch, cols.width)
    else:
        out_BD = _PlaceParts.apply(received, dp_BD, cols, batch)
    return divide_means(out_BD, cols, lengths_FB)


def divide_means(out_BD: Tensor, cols: OutputColumns, lengths_FB: Tensor | None) -> Tensor:
    """Mean-pooled features: the summed row shards divided by the global bag length (known here)."""
    if cols.mean_D is None:
        return out_BD
    count_BF = lengths_FB.t().clamp(min=1).to(out_BD.dtype)
    count_BD = torch.repeat_interleave(count_BF, cols.width_F, dim=1, output_size=cols.width)
    return out_BD / torch.where(cols.mean_D, count_BD, torch.ones_like(count_BD))


def pad_rows(rows: Sequence[Tensor], width: int) -> Tensor:
    """Sequence lookup outputs (one [N_g, D_g] per kernel group) as one [N, width] (zero padded)."""
    padded = [r if r.shape[1] == width else torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in rows]
    return padded[0] if len(padded) == 1 else torch.cat(padded, dim=0)


def assemble_sequence(received_ND: Tensor, order_N: Tensor, routing: Routing,
                      copy_lengths: Sequence[int]) -> list[Tensor]:
    """Rows back in each feature's id order: one [N_f, D_f] per routed feature (output order). `received_ND` is in
    routed order; `order_N[i]` is the copy-order position of routed id i; `copy_lengths` the ids per copy
    (feature-major, column blocks in order)."""
    rows_ND = received_ND.index_select(0, inverse_permutation(order_N)) if order_N.numel() else received_ND
    per_copy = rows_ND.split(list(copy_lengths))
    by_feature: dict[int, list[Tensor]] = {}
    for c, rows in enumerate(per_copy):
        _, width = routing.copy_cols[c]
        by_feature.setdefault(routing.copy_feature_index[c], []).append(rows[:, :width])
    return [parts[0] if len(parts) == 1 else torch.cat(parts, dim=1) for _, parts in sorted(by_feature.items())]
