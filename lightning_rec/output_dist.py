"""Stage 3 of the sharded data path: embeddings travel back to the ranks whose samples they are.

Legend: W world size, B local batch, B_r batch of source rank r, D_p width of rank p's pooled
lookup, N_r ids received from rank r, Dmax widest shard (sequence rows are padded to it).

    pooled    rank p sends rows B_r of its [B_0+...+B_{W-1}, D_p] to each r   (one all-to-all)
              -> rank r: one [B_r, D_p] block per owner p; sharding/embeddings.py places columns
                 and adds the row shards' partial sums (all-to-all + sum = reduce-scatter)
    sequence  rank p sends each source its ids' rows [N_r, Dmax]              (one all-to-all)

Backward is the reverse all-to-all of the gradient (`_AllToAll`), so every rank's fused kernels
receive the gradient of every sample that read their rows. Data-parallel replicas instead
all-reduce (sum) their gradient in backward (`all_reduce_sum_`).
On one CPU host with shared memory (shm_transport.py), the pooled exchange places the columns
while it copies (`PooledAllToAll.placed`): no receive buffer, cat or permutation.
Only this file, input_dist.py and shm_transport.py call torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_rec.collective_guard import guard_of
from lightning_rec.comm import collective_error
from lightning_rec.input_dist import DistContext, all_to_all, wait
from lightning_rec.sharding.embeddings import OutputColumns, gather_columns, gather_dp, place_parts
from lightning_rec.sharding.variable_batch import Block, received_sizes, trim_rows
from lightning_rec.shm_transport import SharedMemoryGroup, Writer


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0; backward sends the gradient back the way it came."""

    @staticmethod
    def forward(ctx, input_: Tensor, pg, out_splits: list[int], in_splits: list[int], what: str,
                timeout_s: float | None) -> Tensor:
        ctx.pg, ctx.out_splits, ctx.in_splits, ctx.what, ctx.timeout_s = pg, out_splits, in_splits, what, timeout_s
        out = input_.new_empty((sum(out_splits),) + tuple(input_.shape[1:]))
        work = all_to_all(pg, out, input_.contiguous(), out_splits, in_splits, what, timeout_s, async_op=True)
        wait(work, what, timeout_s)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_in = grad_out.new_empty((sum(ctx.in_splits),) + tuple(grad_out.shape[1:]))
        what = f"{ctx.what} (backward)"
        work = all_to_all(ctx.pg, grad_in, grad_out.contiguous(), ctx.in_splits, ctx.out_splits, what,
                          ctx.timeout_s, async_op=True)
        wait(work, what, ctx.timeout_s)
        return grad_in, None, None, None, None, None


class _PlacedPooledExchange(torch.autograd.Function):
    """Pooled all-to-all through shared memory whose copies put every column where it belongs.

    Forward: owner p sends rows B_r of its [B_0+...+B_{W-1}, D_p] to each source r; source r copies
    each received block (and its data-parallel block) straight into its output's columns: one copy
    per byte after the sender's, where the process-group path needs a receive buffer, a cat and a
    permutation. Backward: each source gathers the gradient columns of owner p straight into shared
    memory (Writer), and owner p stacks the rows it gets back.
    """

    @staticmethod
    def forward(ctx, owned_BD: Tensor, dp_BD: Tensor | None, group, cols: OutputColumns, rank_dims: list[int],
                batch_per_source: list[int], batch: int, what: str, timeout_s: float | None) -> Tensor:
        ctx.group, ctx.cols, ctx.rank_dims, ctx.what, ctx.timeout_s = group, cols, rank_dims, what, timeout_s
        ctx.batch_per_source, ctx.batch = batch_per_source, batch
        ctx.dtype, ctx.dp_dtype = owned_BD.dtype, dp_BD.dtype if dp_BD is not None else None
        sends, at = [], 0
        for b in batch_per_source:
            sends.append(owned_BD[at : at + b])
            at += b
        received = _exchange(group, sends, what, timeout_s)
        parts = [raw.view(owned_BD.dtype).view(batch, d) if d else None for raw, d in zip(received, rank_dims)]
        return place_parts(parts, dp_BD, cols, batch, owned_BD)

    @staticmethod
    def backward(ctx, grad_BD: Tensor):
        group, batch, dtype, runs = ctx.group, ctx.batch, ctx.dtype, ctx.cols.part_runs
        grad_BD = grad_BD.to(dtype).contiguous()
        elem = grad_BD.element_size()

        def gather(p: int):
            return lambda u8: gather_columns(u8.view(dtype).view(batch, ctx.rank_dims[p]), grad_BD, runs[p])

        sends = [Writer(batch * d * elem, gather(p)) for p, d in enumerate(ctx.rank_dims)]
        received = _exchange(group, sends, f"{ctx.what} (backward)", ctx.timeout_s)
        D_me = ctx.rank_dims[group.rank]
        grad_owned = grad_BD.new_empty(sum(ctx.batch_per_source), D_me)
        at = 0
        for raw, b in zip(received, ctx.batch_per_source):
            grad_owned[at : at + b].copy_(raw.view(dtype).view(b, D_me))
            at += b
        grad_dp = gather_dp(grad_BD, ctx.cols, ctx.dp_dtype) if ctx.dp_dtype is not None else None
        return grad_owned, grad_dp, None, None, None, None, None, None, None


def _exchange(group: SharedMemoryGroup, sends, what: str, timeout_s: float | None) -> list[Tensor]:
    try:
        return group.exchange(sends, tag=what)
    except RuntimeError as e:
        raise collective_error(what, e, timeout_s, group) from e


def _differentiable(t: Tensor) -> Tensor:
    # A rank with nothing to send must still take part in the backward all-to-all that the
    # others run, so its (empty) input must carry autograd too.
    return t if t.requires_grad else t.detach().requires_grad_(True)


class PooledAllToAll:
    """[B_0+...+B_{W-1}, D_p] on owner p -> flat blocks [B_r x D_q for each q] on source r."""

    def __init__(self, pg, rank: int, rank_dims: list[int], timeout_s: float | None = None) -> None:
        self.pg, self.rank, self.rank_dims, self.timeout_s = pg, rank, rank_dims, timeout_s

    def placed(self, pooled_BD: Tensor, dp_BD: Tensor | None, ctx: DistContext, cols: OutputColumns) -> Tensor | None:
        """[B, D] in feature order, columns placed (row shards summed) while copying; None without shared memory."""
        if not isinstance(self.pg, SharedMemoryGroup):
            return None
        return _PlacedPooledExchange.apply(_differentiable(pooled_BD), dp_BD, self.pg, cols, self.rank_dims,
                                           list(ctx.batch_per_source), ctx.batch,
                                           "pooled embedding all-to-all", self.timeout_s)

    def __call__(self, pooled_BD: Tensor, ctx: DistContext) -> Tensor:
        if len(self.rank_dims) == 1:  # one rank: the rows are already where they go
            return pooled_BD.reshape(-1)
        D_me = self.rank_dims[self.rank]
        in_splits = [b * D_me for b in ctx.batch_per_source]
        out_splits = [ctx.batch * d for d in self.rank_dims]
        return _AllToAll.apply(_differentiable(pooled_BD).reshape(-1), self.pg, out_splits, in_splits,
                               "pooled embedding all-to-all", self.timeout_s)


class VariableBatchPooledAllToAll:
    """PooledAllToAll for a variable batch: each feature's own rows only (sharding/variable_batch.py), received as
    each owner's blocks one after another (assemble_variable expands them). Either transport."""

    def __init__(self, pg, rank: int, blocks_per_rank: list[list[Block]], timeout_s: float | None = None) -> None:
        self.pg, self.rank, self.blocks, self.timeout_s = pg, rank, blocks_per_rank, timeout_s

    def __call__(self, pooled_BD: Tensor, ctx: DistContext) -> Tensor:
        send, in_splits = trim_rows(_differentiable(pooled_BD), self.blocks[self.rank], ctx.strides_per_source,
                                    ctx.batch_per_source)
        out_splits = received_sizes(self.blocks, ctx.strides_F)
        return _AllToAll.apply(send, self.pg, out_splits, in_splits, "pooled embedding all-to-all", self.timeout_s)


class SequenceAllToAll:
    """Rows of every id, source-major on owner p -> [ids this rank sent, Dmax] in routed order."""

    def __init__(self, pg, rank: int, timeout_s: float | None = None) -> None:
        self.pg, self.rank, self.timeout_s = pg, rank, timeout_s

    def __call__(self, rows_ND: Tensor, ctx: DistContext) -> Tensor:
        if len(ctx.ids_per_source) == 1:  # one rank: the rows are already where they go
            return rows_ND
        in_splits = list(ctx.ids_per_source)
        out_splits = list(ctx.routed.ids_per_rank)
        return _AllToAll.apply(_differentiable(rows_ND), self.pg, out_splits, in_splits,
                               "sequence embedding all-to-all", self.timeout_s)


def all_reduce_sum_(pg, tensor: Tensor, timeout_s: float | None = None) -> None:
    """In place: the sum over ranks (data-parallel replicas' gradients)."""
    if not isinstance(pg, SharedMemoryGroup) and dist.get_world_size(pg) == 1:
        return  # one rank: its gradient is the sum
    what = "replica gradient all-reduce"
    try:
        if isinstance(pg, SharedMemoryGroup):
            pg.all_reduce_sum_(tensor, tag=what)
            return
        guard = guard_of(pg)
        if guard is None:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=pg)
            return
        k = guard.begin()
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=pg, async_op=True)
        guard.wait_work(work, what, k, host=False)
    except RuntimeError as e:
        raise collective_error(what, e, timeout_s, pg) from e
