"""A variable batch (TorchRec's VBE) through the all-to-alls: only each feature's own rows travel. Pure tensors.

Legend: W world size, B_r padded batch of source rank r (its largest feature's bags), B_{f,r} bags of feature f on
source r, D_p width of rank p's pooled lookup, made of blocks (feature f, columns c0 .. c0 + w).

A variable batch is padded (sparse/variable_batch.py): feature f has B_{f,r} bags then empty ones up to B_r. The
id all-to-all sends each shard feature's own B_{f,r} lengths with its bag count (trim_lengths; the owner pads them
back, pad_lengths), so the owner knows every source's counts for its shard features. Owner p's pooled output
[B_0 + ... + B_{W-1}, D_p] then holds, for source r and block (f, c0, w), B_{f,r} real rows and zero rows after
them. Only the real rows go back:

    owner p, to source r:   [ block 0: B_{f0,r} x w0 | block 1: B_{f1,r} x w1 | ... ]   flat   (trim_rows)
    source r, from owner p: each block's rows expanded by its feature's inverse indices straight into its output
                            columns [B_full, w] (assemble_variable; row shards add, mean features divided first)

so the padded [B_r, D] layout is never built on the way back. A request-level feature (one row per request, e.g. 1
per 32 candidates) thus sends 1/32 of the rows an expanded batch would, in the id all-to-all and in the pooled one."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_rec.sharding.routing import Routing

Block = tuple[int, int, int]  # (feature index, first column, width) of a rank's pooled output


def rank_blocks(routing: Routing) -> list[list[Block]]:
    """Per rank p, the column blocks of its pooled output [.., D_p], in column order (its shard features')."""
    out = []
    for p in range(routing.world_size):
        blocks, c0 = [], 0
        for sf in routing.shard_features[routing.rank_slice(p)]:
            blocks.append((sf.feature_index, c0, sf.cols))
            c0 += sf.cols
        out.append(blocks)
    return out


def shard_strides(routing: Routing, strides_F: Sequence[int]) -> list[int]:
    """Bags per shard feature (every rank's, rank by rank) of a batch with `strides_F` bags per feature."""
    return [strides_F[sf.feature_index] for sf in routing.shard_features]


def _kept(strides_S: Sequence[int], B: int, device: torch.device) -> Tensor:
    return torch.arange(B, device=device) < torch.tensor(list(strides_S), device=device).unsqueeze(1)


def trim_lengths(lengths_SB: Tensor, strides_S: Sequence[int], B: int) -> Tensor:
    """Sender: [S x B] lengths (B bags per shard feature) -> each shard feature's first B_s, flat."""
    if B == 0 or not len(strides_S):
        return lengths_SB[:0]
    return lengths_SB.view(-1, B)[_kept(strides_S, B, lengths_SB.device)]


def pad_lengths(trimmed: Tensor, strides_S: Sequence[int], B: int) -> Tensor:
    """Owner: `trim_lengths`' output -> [S x B] again, zero lengths (empty bags) after each shard feature's B_s."""
    out = trimmed.new_zeros(len(strides_S), B)
    if B and len(strides_S):
        out[_kept(strides_S, B, trimmed.device)] = trimmed
    return out.view(-1)


Rect = tuple[int, int, int, int]  # (offset, rows, cols, row stride) of a [rows, cols] block in a flat tensor


def _view(flat: Tensor, rect: Rect) -> Tensor:
    offset, rows, cols, stride = rect
    return flat.as_strided((rows, cols), (stride, 1), flat.storage_offset() + offset)


class _Move(torch.autograd.Function):
    """Blocks of a flat tensor copied to blocks of a new one (zeros elsewhere); backward copies the gradient back.
    One copy per block each way (autograd's slicing would add a whole-size zero gradient per block)."""

    @staticmethod
    def forward(ctx, src: Tensor, src_rects: list[Rect], dst_rects: list[Rect], numel: int) -> Tensor:
        ctx.src_rects, ctx.dst_rects, ctx.numel = src_rects, dst_rects, src.numel()
        src = src.contiguous()
        out = (src.new_empty if sum(r[1] * r[2] for r in dst_rects) == numel else src.new_zeros)(numel)
        for a, b in zip(src_rects, dst_rects):
            _view(out, b).copy_(_view(src, a))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        covered = sum(r[1] * r[2] for r in ctx.src_rects) == ctx.numel
        grad_src = (grad.new_empty if covered else grad.new_zeros)(ctx.numel)
        for a, b in zip(ctx.src_rects, ctx.dst_rects):
            _view(grad_src, a).copy_(_view(grad, b))
        return grad_src, None, None, None


def trim_rows(owned_BD: Tensor, blocks: Sequence[Block], strides_per_source: Sequence[Sequence[int]],
              batch_per_source: Sequence[int]) -> tuple[Tensor, list[int]]:
    """Owner: for each source r, each block's first B_{s,r} rows among r's B_r rows, flat -> (send, numel per r).
    `strides_per_source[r]`: source r's bags per block (this owner's shard features)."""
    D = owned_BD.shape[1]
    src, dst, sizes, row, at = [], [], [], 0, 0
    for strides_S, b in zip(strides_per_source, batch_per_source):
        n = 0
        for (_, c0, w), rows in zip(blocks, strides_S):
            src.append((row * D + c0, rows, w, D))
            dst.append((at, rows, w, w))
            at += rows * w
            n += rows * w
        sizes.append(n)
        row += b
    return _Move.apply(owned_BD.reshape(-1), src, dst, at), sizes


def received_sizes(blocks_per_rank: Sequence[Sequence[Block]], strides_F: Sequence[int]) -> list[int]:
    """Source: how many values each owner p sends it (its blocks' rows of this source's features)."""
    return [sum(strides_F[f] * w for f, _, w in blocks) for blocks in blocks_per_rank]


class VariableLayout:
    """Where each received block and each data-parallel block lands in the expanded output [B_full, D]."""

    def __init__(self, routing: Routing) -> None:
        cols = routing.output_columns().tolist()
        self.width = sum(routing.feature_dims)
        self.summed = routing.row_split  # row shards' partial sums add up
        self.mean_F = list(routing.mean_features)
        self.blocks = rank_blocks(routing)
        # (feature, first column in the received part or the data-parallel block, width, first output column)
        self.received = [(f, c0, w, cols[start + c0]) for blocks, start in
                         zip(self.blocks, [sum(routing.rank_dims[:p]) for p in range(routing.world_size)])
                         for f, c0, w in blocks]
        starts = [sum(routing.feature_dims[:f]) for f in range(len(routing.feature_dims))]
        self.dp, c0 = [], 0
        for f in routing.dp_feature_index:
            self.dp.append((f, c0, routing.feature_dims[f], starts[f]))
            c0 += routing.feature_dims[f]


class _AssembleVariable(torch.autograd.Function):
    """Received blocks (each feature's own rows) and the data-parallel block -> the expanded output [B_full, D]:
    each block's rows expanded by its feature's inverse indices straight into its output columns (mean features
    divided by their bag lengths first). Backward sums each row's gradients as embedding_bag bags."""

    @staticmethod
    def forward(ctx, received: Tensor, dp_BD: Tensor | None, layout: VariableLayout, strides_F: list[int],
                count_F: list[Tensor | None], rows_F: list[Tensor]) -> Tensor:
        ctx.layout, ctx.strides_F, ctx.count_F, ctx.numel = layout, strides_F, count_F, received.numel()
        ctx.dp = None if dp_BD is None else (dp_BD.shape, dp_BD.dtype)
        B_full = rows_F[0].numel()
        out = (received.new_zeros if layout.summed else received.new_empty)(B_full, layout.width)
        at = 0
        for f, _, w, dst in layout.received:
            n = strides_F[f]
            _place(out[:, dst : dst + w], received[at : at + n * w].view(n, w), count_F[f], rows_F[f], layout.summed)
            at += n * w
        for f, c0, w, dst in layout.dp if dp_BD is not None else []:
            _place(out[:, dst : dst + w], dp_BD[: strides_F[f], c0 : c0 + w], count_F[f], rows_F[f], layout.summed)
        # per feature: its inverse indices sorted, and where each bag's run ends (backward's embedding_bag)
        ctx.bags_F = [(torch.argsort(row, stable=True),
                       row.new_zeros(n).scatter_add_(0, row, torch.ones_like(row)).cumsum(0))
                      for row, n in zip(rows_F, strides_F)]
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        layout = ctx.layout

        def rows(f: int, dst: int, w: int) -> Tensor:
            order, ends = ctx.bags_F[f]
            offsets = torch.cat([ends.new_zeros(1), ends[:-1]])
            g = torch.nn.functional.embedding_bag(order, grad[:, dst : dst + w].contiguous(), offsets, mode="sum")
            return g if ctx.count_F[f] is None else g / ctx.count_F[f]

        grad_received = grad.new_empty(ctx.numel)
        at = 0
        for f, _, w, dst in layout.received:
            n = ctx.strides_F[f]
            grad_received[at : at + n * w].view(n, w).copy_(rows(f, dst, w))
            at += n * w
        grad_dp = None
        if ctx.dp is not None:
            grad_dp = grad.new_zeros(ctx.dp[0])
            for f, c0, w, dst in layout.dp:
                grad_dp[: ctx.strides_F[f], c0 : c0 + w] = rows(f, dst, w)
            grad_dp = grad_dp.to(ctx.dp[1])
        return grad_received, grad_dp, None, None, None, None


def _place(out_cols: Tensor, block: Tensor, count: Tensor | None, row: Tensor, add: bool) -> None:
    block = block if count is None else block / count
    rows = block.index_select(0, row)
    out_cols.add_(rows) if add else out_cols.copy_(rows)


def assemble_variable(received: Tensor, dp_BD: Tensor | None, layout: VariableLayout, strides_F: list[int],
                      lengths_FB: Tensor, rows_F: list[Tensor]) -> Tensor:
    """Source: the trimmed blocks every owner sent (in rank order, each owner's blocks in order) and this rank's
    data-parallel lookup -> [B_full, D] in feature order, each feature expanded by its inverse indices `rows_F`."""
    count_F = [lengths_FB[f, :n].clamp(min=1).to(received.dtype).unsqueeze(1) if mean else None
               for f, (n, mean) in enumerate(zip(strides_F, layout.mean_F))]
    return _AssembleVariable.apply(received, dp_BD, layout, list(strides_F), count_F, rows_F)
