"""Plan checks: from metadata alone, so every rank refuses a bad plan with the same message before any collective.

`validate_module_plan` checks one collection's plan (tables, ranks, tiling, labels, kernels); `check_same_everywhere` is
the one collective: every rank holds the same tables, optimizer and plan."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import comm
from lightning_rec.collective_guard import CollectiveGuard
from lightning_rec.embedding import EmbeddingCollection
from lightning_rec.errors import plain
from lightning_rec.lookup import choose_kernel, pad_multiple
from lightning_rec.optim.config import EmbOptimType
from lightning_rec.sharded_embedding import SEQUENCE_SHARDING_TYPES
from lightning_rec.sharding.layout import row_block_size
from lightning_rec.sharding.plan_verbs import collection_configs
from lightning_rec.types import ComputeKernel, ParameterSharding, ShardingPlan, ShardingType, ShardMetadata


def _enum_value(value, enum_type: type[enum.Enum], field: str, table: str):
    try:
        return enum_type(str(getattr(value, "value", value)).lower())
    except ValueError:
        raise ValueError(f"table '{table}': unknown {field} {value!r} in its ParameterSharding: use one of "
                         f"{', '.join(e.value for e in enum_type)}") from None


_UVM_KERNELS = (ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING)


def validate_module_plan(path: str, module: nn.Module, table_plans: Mapping[str, ParameterSharding],
                         world_size: int, device: torch.device | None = None) -> None:
    """Metadata only, so every rank refuses a bad plan with the same message."""
    where = f"module '{path}'" if path else "the model"
    configs = {c.name: c for c in collection_configs(module)}
    unknown = [t for t in table_plans if t not in configs]
    if unknown:
        raise ValueError(f"the plan for {where} names table(s) {unknown}, which it does not have; its tables are "
                         f"{sorted(configs)}: fix the table names in the plan")
    missing = [t for t in configs if t not in table_plans]
    if missing:
        raise ValueError(f"the plan for {where} has no entry for table(s) {missing}: add one for each "
                         f"(e.g. table_wise(rank=0) or data_parallel())")
    sequence = isinstance(module, EmbeddingCollection)
    for name, ps in table_plans.items():
        c = configs[name]
        st = _enum_value(ps.sharding_type, ShardingType, "sharding_type", name)
        kernel = _enum_value(ps.compute_kernel, ComputeKernel, "compute_kernel", name)
        if kernel == ComputeKernel.DENSE and st != ShardingType.DATA_PARALLEL:
            # the shards would train with the collection's fused optimizer anyway (routing.py), not a dense one
            raise ValueError(f"table '{name}' is planned {st} with compute_kernel 'dense', which is for data_parallel "
                             f"tables only: sharded tables train with the collection's fused optimizer; use "
                             f"compute_kernel 'fused' (the plan verbs' default), or data_parallel()")
        if kernel in _UVM_KERNELS and device is not None and device.type == "cpu":
            raise ValueError(f"table '{name}' is planned with compute_kernel '{kernel}' (GPU unified memory), but this "
                             f"run is on CPU, where every table is in host memory already: plan it with compute_kernel "
                             f"'fused' (the planner does for CPU topologies), or run on GPU")
        if sequence and st not in SEQUENCE_SHARDING_TYPES:
            raise ValueError(f"table '{name}' of the EmbeddingCollection {where} is planned {st}: sequence tables "
                             f"take {', '.join(str(t) for t in SEQUENCE_SHARDING_TYPES)}")
        for r in list(ps.ranks) + [s.placement for s in ps.shards]:
            if not 0 <= r < world_size:
                raise ValueError(f"table '{name}' is placed on rank {r} but world_size={world_size}: use ranks in "
                                 f"0..{world_size - 1}")
        if st == ShardingType.DATA_PARALLEL:
            _check_replicas(name, c.num_embeddings, c.embedding_dim, ps, world_size)
            _check_ranks(name, st, ps, world_size)
            continue
        if not ps.shards:
            raise ValueError(f"table '{name}' is planned {st} but its ParameterSharding lists no shards: build it "
                             f"with construct_module_sharding_plan and a verb such as {st}(...)")
        # Column blocks of any width work: fbgemm's kernels pad dims to multiples of 4 inside (lookup.py).
        _check_tiling(name, c.num_embeddings, c.embedding_dim, ps)
        _check_label(name, st, c.num_embeddings, ps)
        _check_ranks(name, st, ps, world_size)
    _check_fused_kernels(module, configs, table_plans, device)


def _check_replicas(name: str, rows: int, dim: int, ps: ParameterSharding, world_size: int) -> None:
    """A data_parallel entry lists no shards, or whole copies of the table."""
    partial = [str(s) for s in ps.shards if tuple(s.shard_offsets) != (0, 0) or tuple(s.shard_sizes) != (rows, dim)]
    sizes = {(tuple(s.shard_offsets), tuple(s.shard_sizes)) for s in ps.shards}
    copies = sorted(s.placement for s in ps.shards) == list(range(world_size))
    if partial and copies and len(sizes) == 1 and next(iter(sizes))[0] == (0, 0):  # one per rank, all alike
        other = next(iter(sizes))[1]
        raise ValueError(f"table '{name}' is {rows} x {dim}, but its data_parallel "
                         f"copies in the plan are {other[0]} x {other[1]}: the plan was made for the table at "
                         f"another size (num_embeddings / embedding_dim changed since): plan again for this "
                         f"model (EmbeddingShardingPlanner(...).plan(model)), or use data_parallel()")
    if partial:  # every rank holds the whole table: such a shard would be printed, never built
        raise ValueError(f"table '{name}' is planned data_parallel (a whole copy on every rank) but lists "
                         f"shards that are not the whole {rows} x {dim} table: "
                         f"{partial}; use data_parallel() (no shards), or a sharding type that splits it")


def _check_fused_kernels(module: nn.Module, configs: Mapping[str, Any], table_plans: Mapping[str, ParameterSharding],
                         device: torch.device | None) -> None:
    """The fused kernels' refusals, for every shard on every rank (not only on the ranks that build it)."""
    optimizer = getattr(module, "_optimizer", None)
    sharded = [t for t, ps in table_plans.items()
               if ShardingType(str(ps.sharding_type)) != ShardingType.DATA_PARALLEL]  # replicas: a dense kernel
    if optimizer is None or device is None or not sharded:
        return
    kernel = getattr(module, "_kernel", "auto")
    for pooling in dict.fromkeys(configs[t].pooling_name() for t in sharded):
        choose_kernel(kernel, optimizer, device, pooling)  # raises as FusedKernel would, on every rank
    on_fbgemm = kernel == "fbgemm" or device.type != "cpu"  # as FusedKernel decides
    if not on_fbgemm or EmbOptimType(optimizer.optimizer) != EmbOptimType.PARTIAL_ROWWISE_ADAM:
        return
    multiple = pad_multiple("fbgemm")
    odd = {}
    for name in sharded:
        widths = sorted({s.shard_sizes[1] for s in table_plans[name].shards if s.shard_sizes[1] % multiple})
        if widths:
            odd[name] = widths
    if odd:
        raise ValueError(f"table(s) {odd} (name: column widths) are planned in blocks that fbgemm's {device.type} "
                         f"kernel cannot take with partial_rowwise_adam (padding would change its per-row moment): "
                         f"plan column blocks whose widths are multiples of {multiple} "
                         f"(column_wise(size_per_rank=...)), or use the adam / rowwise_adagrad optimizer")


def _check_ranks(name: str, st: ShardingType, ps: ParameterSharding, world_size: int) -> None:
    placements = sorted({s.placement for s in ps.shards}) if ps.shards else list(range(world_size))
    if ps.ranks and sorted(set(ps.ranks)) != placements:
        # routing reads only the shards: ranks that disagree would only make the printed plan lie
        raise ValueError(f"table '{name}' is planned {st} on ranks {list(ps.ranks)} but its shards sit on ranks "
                         f"{placements}: make ranks the shards' placements (construct_module_sharding_plan does), "
                         f"or leave ranks empty")


# what each sharding type's shards look like, beyond tiling the table (the label must match the layout)
_ONE_COLUMN_BLOCK = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)
_WHOLE_ROWS = (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE)


def _check_label(name: str, st: ShardingType, rows: int, ps: ParameterSharding) -> None:
    shards = [str(s) for s in ps.shards]
    if st == ShardingType.TABLE_WISE and len(ps.shards) != 1:
        why = "one shard, the whole table on one rank"
    elif st in _ONE_COLUMN_BLOCK and len({s.shard_offsets[1] for s in ps.shards}) != 1:
        why = "row shards of the full width"
    elif st in _WHOLE_ROWS and any(s.shard_sizes[0] != rows for s in ps.shards):
        why = f"column blocks of all {rows} rows"
    else:
        return
    fits = {1: "table_wise", 0: "grid_shard"}
    if len({s.shard_offsets[1] for s in ps.shards}) == 1:
        fits[0] = "row_wise"
    elif all(s.shard_sizes[0] == rows for s in ps.shards):
        fits[0] = "column_wise"
    raise ValueError(f"table '{name}' is labelled {st}, which is {why}, but its shards are {shards}: label it "
                     f"{fits[1] if len(ps.shards) == 1 else fits[0]}, or fix the shards (the plan verbs build both)")


def _check_tiling(name: str, rows: int, dim: int, ps: ParameterSharding) -> None:
    other = _tiled_size(ps.shards)
    if other is not None and other != (rows, dim):
        # a plan saved or built for this table at another size: said so, not as a wrong shard
        raise ValueError(f"table '{name}' is {rows} x {dim}, but its shards in the plan tile a {other[0]} x {other[1]} "
                         f"table: the plan was made for the table at another size (num_embeddings / embedding_dim "
                         f"changed since): plan again for this model (EmbeddingShardingPlanner(...).plan(model)), or "
                         f"rebuild its entry with construct_module_sharding_plan")
    _check_tiling_of(name, rows, dim, ps.shards)


def _tiled_size(shards) -> tuple[int, int] | None:
    """(rows, dim) of the table these shards tile exactly, None if they tile none."""
    if not shards:
        return None
    size = (max(s.shard_offsets[0] + s.shard_sizes[0] for s in shards),
            max(s.shard_offsets[1] + s.shard_sizes[1] for s in shards))
    try:
        _check_tiling_of("", *size, shards)
    except ValueError:
        return None
    return size


def _check_tiling_of(name: str, rows: int, dim: int, all_shards: Sequence[ShardMetadata]) -> None:
    empty = [str(s) for s in all_shards if s.shard_sizes[1] <= 0]
    if empty:  # a 0-column block tiles nothing, and no kernel takes a table of dim 0
        raise ValueError(f"table '{name}': shard(s) {empty} have no columns: every column block needs at least one "
                         f"column; fix size_per_rank (or the shards) so the blocks add up to {dim}")
    blocks: dict[int, list] = {}
    for s in all_shards:
        blocks.setdefault(s.shard_offsets[1], []).append(s)
    col = 0
    for c0, shards in sorted(blocks.items()):
        widths = {s.shard_sizes[1] for s in shards}
        if c0 != col or len(widths) != 1:
            raise ValueError(f"table '{name}': its shards' columns {[str(s) for s in all_shards]} do not tile the dim "
                             f"{dim} in blocks: fix size_per_rank (or the shards) so the blocks add up to {dim}")
        col += widths.pop()
        shards = sorted(shards, key=lambda s: s.shard_offsets[0])
        block = row_block_size(rows, len(shards))
        for i, s in enumerate(shards):
            start = min(i * block, rows)
            if s.shard_offsets[0] != start or s.shard_sizes[0] != min(block, rows - start):
                raise ValueError(f"table '{name}': row shards {[str(s) for s in shards]} do not follow the block rule "
                                 f"(ceil({rows}/{len(shards)}) = {block} rows each): build them with "
                                 f"shard_layout / row_wise()")
    if col != dim:
        raise ValueError(f"table '{name}': its shards cover {col} of its {dim} columns: fix size_per_rank so the "
                         f"column sizes add up to {dim}")


def _describe_model(collections: Mapping[str, nn.Module], plan: ShardingPlan) -> list[str]:
    """One line per fact every rank must agree on: each collection's kind, tables, optimizer and plan."""
    lines = []
    for path in sorted(collections):
        m = collections[path]
        where = f"module '{path}'" if path else "the model"
        weighted = m.is_weighted() if callable(getattr(m, "is_weighted", None)) else None
        lines.append(f"{where}: {type(m).__name__} (weighted={weighted}), tables "
                     f"{[c.name for c in collection_configs(m)]}")
        opt = m.fused_optimizer_config() if callable(getattr(m, "fused_optimizer_config", None)) else None
        lines.append(f"{where}: fused optimizer {opt}")
        for c in collection_configs(m):  # a line per field: the message shows the one that differs, alone
            for f in dataclasses.fields(c):
                if not f.name.startswith("weight_init") and f.name != "init_fn":  # a function's repr has its address
                    lines.append(f"{where}: table '{c.name}' {f.name}={plain(getattr(c, f.name))}")
        for name, ps in sorted(plan.plan[path].items()):
            lines.append(f"{where}: table '{name}' planned {ps}")
    return lines


def check_same_everywhere(collections: Mapping[str, nn.Module], plan: ShardingPlan, guard: CollectiveGuard,
                          device: torch.device, extra: Sequence[str] = ()) -> None:
    """Collective: every rank holds the same tables, optimizer and plan, else ValueError naming the first difference.
    A digest all-gathered once at construction (through `guard`); the full descriptions only when digests differ."""
    pg = guard.pg
    W = dist.get_world_size(pg)
    if W == 1:
        return
    lines = [*_describe_model(collections, plan), *extra]  # extra: settings every rank must share
    dev = device if guard.nccl else torch.device("cpu")
    mine = torch.tensor(list(hashlib.sha256("\n".join(lines).encode()).digest()), dtype=torch.uint8, device=dev)
    gathered = [torch.empty_like(mine) for _ in range(W)]
    k = guard.begin()
    guard.wait_work(dist.all_gather(gathered, mine, group=pg, async_op=True), "plan and tables digest", k)
    digests = [bytes(t.tolist()) for t in gathered]
    if len(set(digests)) == 1:
        return
    everyone = comm.all_gather_object(lines, group=pg, device=dev, tag="plan and tables descriptions")
    ranks = dist.get_process_group_ranks(pg)
    other = next(i for i, d in enumerate(digests) if d != digests[0])
    a, b = everyone[0], everyone[other]
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    mine = a[i] if i < len(a) else "(nothing more)"
    theirs = b[i] if i < len(b) else "(nothing more)"
    raise ValueError(
        f"ranks hold different embedding tables, plans or settings, so ids would be routed by different maps: rank "
        f"{ranks[0]} has\n  {mine}\nbut rank {ranks[other]} has\n  {theirs}\nBuild the same model and plan, with the "
        f"same settings, on every rank (plan with planner.collective_plan(model), or pass plan=None and let "
        f"DistributedModelParallel plan)")

