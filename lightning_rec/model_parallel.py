"""DistributedModelParallel: embedding tables sharded over ranks, dense layers data parallel.

    model = DLRM(EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("rowwise_adagrad")), ...)
    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        model.sparse_arch.embedding_bag_collection,
        {"t0": table_wise(rank=0), "t1": row_wise(), "t2": column_wise(ranks=[0, 1]), "t3": data_parallel()},
    )})
    print(plan)
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", dense="ddp")
    opt = CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", torch.optim.Adagrad(dmp.parameters()))])

Every EmbeddingBagCollection / EmbeddingCollection inside `module` is swapped for its sharded
version (sharded_embedding.py); what remains (the dense layers) is wrapped in DDP or FSDP2. The
plan verbs mirror TorchRec's (`table_wise(rank=)`, `row_wise()`, `column_wise(ranks=)`,
`table_row_wise(host_index=)`, `table_column_wise(host_index=)`, `grid_shard(host_indexes=)`,
`data_parallel()`); each becomes concrete shards once the table's size and the world size are
known (`construct_module_sharding_plan`). With no plan, the planner decides (lightning_rec.planner),
or every table goes table-wise, largest first onto the least loaded rank, if the planner is absent.

Every plan is checked on every rank from metadata alone (identical everywhere) before any
collective starts, so a bad plan raises the same ValueError everywhere instead of a hang.
Embedding traffic gets its own process group with a timeout (`timeout=` seconds), so a rank that
dies mid-step makes the others raise a clear error.

Loss scaling: fused tables (and replicas) are updated with the SUM of every rank's gradient, i.e.
as if trained on the concatenated global batch with loss = sum of the per-rank losses; DDP
averages dense gradients over ranks (divide by world size relative to that sum). Use a per-rank
loss that is a sum over samples, or scale the fused learning rate, to make the two agree.
"""

from __future__ import annotations

import dataclasses
import enum
import gc
import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import comm
from lightning_rec._compat import ddp_has_forward_sync_buffers
from lightning_rec._device import with_cuda_index  # noqa: F401  (imported from here too)
from lightning_rec.collective_guard import CollectiveGuard, CollectiveMismatch, named_failure_allreduce_hook
from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingCollection, refuse_dtype_cast
from lightning_rec.errors import plain, short_repr
from lightning_rec.lookup import choose_kernel, pad_multiple
from lightning_rec.optim import EmbOptimType, FusedOptimizer
from lightning_rec.planner.fits import check_plan_fits
from lightning_rec.sharded_embedding import (
    SEQUENCE_SHARDING_TYPES,
    ShardingEnv,
    _ShardedCollectionBase,
    shard_collection,
)
from lightning_rec.sharding.layout import row_block_size, shard_layout
from lightning_rec.shm_transport import SharedMemoryGroup, ddp_comm_hook
from lightning_rec.types import (
    ComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)

DEFAULT_TIMEOUT_S = 300.0  # a peer still computing after 5 minutes is stuck; a mismatch is named in seconds

# plan verbs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardingSpec:
    """A plan verb's choice for one table; `__call__` makes it concrete shards for a table's shape."""

    sharding_type: ShardingType
    ranks: tuple[int, ...] | None = None
    host_indexes: tuple[int, ...] | None = None
    size_per_rank: tuple[int, ...] | None = None  # column sizes (column-wise family)
    compute_kernel: ComputeKernel = ComputeKernel.FUSED

    def __call__(self, table: str, num_rows: int, dim: int, world_size: int,
                 local_world_size: int | None = None) -> ParameterSharding:
        shards = shard_layout(table, num_rows, dim, self.sharding_type, world_size,
                              ranks=self.ranks, local_world_size=local_world_size,
                              host_indexes=self.host_indexes, column_sizes=self.size_per_rank)
        ranks = sorted({s.placement for s in shards})
        return ParameterSharding(self.sharding_type, self.compute_kernel, ranks=ranks,
                                 shards=[] if self.sharding_type == ShardingType.DATA_PARALLEL else shards)

    def __str__(self) -> str:
        args = [f"{k}={list(v)}" for k, v in (("ranks", self.ranks), ("host_indexes", self.host_indexes),
                                              ("size_per_rank", self.size_per_rank)) if v is not None]
        return f"{self.sharding_type}({', '.join(args)})"


def _ints(values: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if values is None else tuple(int(v) for v in values)


def table_wise(rank: int, compute_kernel: ComputeKernel = ComputeKernel.FUSED) -> ShardingSpec:
    """The whole table on `rank`."""
    return ShardingSpec(ShardingType.TABLE_WISE, ranks=(int(rank),), compute_kernel=compute_kernel)


def row_wise(ranks: Sequence[int] | None = None, compute_kernel: ComputeKernel = ComputeKernel.FUSED) -> ShardingSpec:
    """Rows in blocks of ceil(rows / n) over all ranks (or `ranks`)."""
    return ShardingSpec(ShardingType.ROW_WISE, ranks=_ints(ranks), compute_kernel=compute_kernel)


def column_wise(ranks: Sequence[int], size_per_rank: Sequence[int] | None = None,
                compute_kernel: ComputeKernel = ComputeKernel.FUSED) -> ShardingSpec:
    """One column block per entry of `ranks` (even split, or `size_per_rank` columns each)."""
    return ShardingSpec(ShardingType.COLUMN_WISE, ranks=_ints(ranks), size_per_rank=_ints(size_per_rank),
                        compute_kernel=compute_kernel)


def table_row_wise(host_index: int, compute_kernel: ComputeKernel = ComputeKernel.FUSED) -> ShardingSpec:
    """Rows split over the ranks of host `host_index`."""
    return ShardingSpec(ShardingType.TABLE_ROW_WISE, host_indexes=(int(host_index),), compute_kernel=compute_kernel)


def table_column_wise(host_index: int, size_per_rank: Sequence[int] | None = None,
                      compute_kernel: ComputeKernel = ComputeKernel.FUSED) -> ShardingSpec:
    """Columns split over the ranks of host `host_index`."""
    return ShardingSpec(ShardingType.TABLE_COLUMN_WISE, host_indexes=(int(host_index),),
                        size_per_rank=_ints(size_per_rank), compute_kernel=compute_kernel)


def grid_shard(host_indexes: Sequence[int], size_per_rank: Sequence[int] | None = None,
               compute_kernel: ComputeKernel = ComputeKernel.FUSED) -> ShardingSpec:
    """One column block per host in `host_indexes`, each block row-wise over that host's ranks."""
    return ShardingSpec(ShardingType.GRID_SHARD, host_indexes=_ints(host_indexes),
                        size_per_rank=_ints(size_per_rank), compute_kernel=compute_kernel)


def data_parallel() -> ShardingSpec:
    """A replica on every rank; gradients summed over ranks, then the fused rule."""
    return ShardingSpec(ShardingType.DATA_PARALLEL)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    raise ValueError("world_size is unknown: pass world_size=..., or call torch.distributed.init_process_group first")


def _collection_configs(module) -> list:
    if hasattr(module, "embedding_bag_configs"):
        return list(module.embedding_bag_configs())
    if hasattr(module, "embedding_configs"):
        return list(module.embedding_configs())
    raise ValueError(f"{type(module).__name__} is not an embedding collection: pass the EmbeddingBagCollection or "
                     f"EmbeddingCollection whose tables the plan covers")


def construct_module_sharding_plan(
    module: nn.Module,
    per_param_sharding: Mapping[str, ShardingSpec],
    local_size: int | None = None,
    world_size: int | None = None,
    device_type: str | None = None,
) -> EmbeddingModuleShardingPlan:
    """table name -> verb, for one collection -> its EmbeddingModuleShardingPlan (concrete shards).

    `world_size` / `local_size` (ranks per host) default to the initialised process group's.
    `device_type` is accepted for TorchRec compatibility.
    """
    del device_type
    if world_size is None:
        world_size, default_local = _world()
        local_size = local_size or default_local
    configs = {c.name: c for c in _collection_configs(module)}
    plan = EmbeddingModuleShardingPlan()
    for name, spec in per_param_sharding.items():
        if name not in configs:
            raise ValueError(f"the plan names table '{name}', which this {type(module).__name__} does not have; "
                             f"its tables are {sorted(configs)}: fix the table name in the plan")
        if not isinstance(spec, ShardingSpec):
            raise ValueError(f"table '{name}': plan entries are verbs like table_wise(rank=0), row_wise(); got "
                             f"{type(spec).__name__}")
        c = configs[name]
        plan[name] = spec(name, c.num_embeddings, c.embedding_dim, world_size, local_size)
    return plan


# plan checks: metadata only, identical on every rank ---------------------------------------------


def find_collections(module: nn.Module) -> dict[str, nn.Module]:
    """module path -> every EmbeddingBagCollection / EmbeddingCollection in `module` (outermost only)."""
    found: dict[str, nn.Module] = {}
    for path, m in module.named_modules():
        if any(path == p or path.startswith(p + ".") for p in found if p) or ("" in found):
            continue
        if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection)):
            found[path] = m
    return found


def _enum_value(value, enum_type: type[enum.Enum], field: str, table: str):
    try:
        return enum_type(str(getattr(value, "value", value)).lower())
    except ValueError:
        raise ValueError(f"table '{table}': unknown {field} {value!r} in its ParameterSharding: use one of "
                         f"{', '.join(e.value for e in enum_type)}") from None


_UVM_KERNELS = (ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING)


def validate_module_plan(path: str, module: nn.Module, table_plans: Mapping[str, ParameterSharding],
                         world_size: int, device: torch.device | None = None) -> None:
    """Metadata only, so every rank refuses a bad plan with the same message: a check left to the rank that
    builds a shard (its kernel, its shape) failed on that rank alone, and its peers waited for it in the next
    collective until the embedding timeout."""
    where = f"module '{path}'" if path else "the model"
    configs = {c.name: c for c in _collection_configs(module)}
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
            partial = [str(s) for s in ps.shards if tuple(s.shard_offsets) != (0, 0)
                       or tuple(s.shard_sizes) != (c.num_embeddings, c.embedding_dim)]
            sizes = {(tuple(s.shard_offsets), tuple(s.shard_sizes)) for s in ps.shards}
            copies = sorted(s.placement for s in ps.shards) == list(range(world_size))
            if partial and copies and len(sizes) == 1 and next(iter(sizes))[0] == (0, 0):  # one per rank, all alike
                other = next(iter(sizes))[1]
                raise ValueError(f"table '{name}' is {c.num_embeddings} x {c.embedding_dim}, but its data_parallel "
                                 f"copies in the plan are {other[0]} x {other[1]}: the plan was made for the table at "
                                 f"another size (num_embeddings / embedding_dim changed since): plan again for this "
                                 f"model (EmbeddingShardingPlanner(...).plan(model)), or use data_parallel()")
            if partial:  # every rank holds the whole table: such a shard would be printed, never built
                raise ValueError(f"table '{name}' is planned data_parallel (a whole copy on every rank) but lists "
                                 f"shards that are not the whole {c.num_embeddings} x {c.embedding_dim} table: "
                                 f"{partial}; use data_parallel() (no shards), or a sharding type that splits it")
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


def _check_fused_kernels(module: nn.Module, configs: Mapping[str, Any], table_plans: Mapping[str, ParameterSharding],
                         device: torch.device | None) -> None:
    """The fused kernels' refusals, for every shard on every rank. Raised while a rank builds its kernels, they
    failed only on the ranks holding such a shard, and the others waited in the next collective until the
    timeout: fbgemm's CPU kernel without the optimizer (kernel='fbgemm'), and partial_rowwise_adam on column
    blocks whose width fbgemm pads (GPU)."""
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


# what each sharding type's shards look like, beyond tiling the table: a plan that builds but is labelled
# with another type prints (and prices) one layout while the ranks hold another
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
        # a plan saved (torch.save) or built for this table at another size: "do not follow the block rule" and
        # "fix size_per_rank" sent the user to edit shards that were right for the table they were planned for
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
                     f"{[c.name for c in _collection_configs(m)]}")
        opt = m.fused_optimizer_config() if callable(getattr(m, "fused_optimizer_config", None)) else None
        lines.append(f"{where}: fused optimizer {opt}")
        for c in _collection_configs(m):  # a line per field: the message shows the one that differs, alone
            for f in dataclasses.fields(c):
                if not f.name.startswith("weight_init") and f.name != "init_fn":  # a function's repr has its address
                    lines.append(f"{where}: table '{c.name}' {f.name}={plain(getattr(c, f.name))}")
        for name, ps in sorted(plan.plan[path].items()):
            lines.append(f"{where}: table '{name}' planned {ps}")
    return lines


def check_same_everywhere(collections: Mapping[str, nn.Module], plan: ShardingPlan, guard: CollectiveGuard,
                          device: torch.device, extra: Sequence[str] = ()) -> None:
    """Collective: every rank holds the same tables, optimizer and plan, else ValueError naming the first difference.

    Ranks that disagree would route ids by different maps and return wrong embeddings without an
    error, so this runs once at construction: a digest all-gathered (through `guard`: a rank that
    never comes is named or timed out), and the full descriptions only when the digests differ
    (the same message on every rank).
    """
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
    everyone: list = [None] * len(digests)
    dist.all_gather_object(everyone, lines, group=pg)
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


def default_plan(collections: Mapping[str, nn.Module], world_size: int) -> ShardingPlan:
    """Every table table-wise: largest first, each onto the rank with the fewest bytes so far."""
    load = [0] * world_size
    items = [(path, c) for path, m in collections.items() for c in _collection_configs(m)]
    items.sort(key=lambda pc: -pc[1].num_embeddings * pc[1].embedding_dim)
    plan = ShardingPlan()
    for path, c in items:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        load[rank] += c.num_embeddings * c.embedding_dim
        plan.plan.setdefault(path, EmbeddingModuleShardingPlan())[c.name] = table_wise(rank)(
            c.name, c.num_embeddings, c.embedding_dim, world_size)
    for path in collections:  # keep the model's table order when printed
        module_plan = plan.plan[path]
        plan.plan[path] = EmbeddingModuleShardingPlan(
            {c.name: module_plan[c.name] for c in _collection_configs(collections[path])})
    return plan


def plan_device_bytes(plan: ShardingPlan, collections: Mapping[str, nn.Module], world_size: int) -> list[dict]:
    """rank -> {table: bytes in device memory} for a concrete plan (see planner/fits.py)."""
    from lightning_rec.planner.fits import device_bytes_by_rank

    configs = {p: {c.name: c for c in _collection_configs(m)} for p, m in collections.items()}
    optimizers = {p: str(m.fused_optimizer_config().optimizer) for p, m in collections.items()
                  if m.fused_optimizer_config() is not None}
    return device_bytes_by_rank({p: plan.plan[p] for p in collections}, configs, optimizers, world_size)


def _planner_plan(module: nn.Module, world_size: int, local_world_size: int, device: torch.device,
                  pg) -> ShardingPlan | None:
    try:
        from lightning_rec.planner import EmbeddingShardingPlanner, Topology
    except ImportError:
        return None
    topology = Topology(world_size=world_size, compute_device=device.type, local_world_size=local_world_size)
    return EmbeddingShardingPlanner(topology).collective_plan(module, pg=pg)


# DistributedModelParallel ----------------------------------------------------------------------


def _set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, new)


class DistributedModelParallel(nn.Module):
    """Shards every embedding collection in `module` by `plan`; wraps the dense rest in DDP or FSDP2.

    Args:
        module: any model holding EmbeddingBagCollection / EmbeddingCollection (built with a fused
            optimizer), or one collection.
        plan: a ShardingPlan (module path -> table -> ParameterSharding); None: the planner's.
        device: where shards and dense layers live; default cuda:LOCAL_RANK when CUDA is there, else cpu.
            Embedding traffic uses NCCL on cuda, gloo on cpu.
        dense: "ddp" | "fsdp" (FSDP2 fully_shard) | None (leave the dense layers alone).
        pg: the process group to shard over (default: the world).
        timeout: seconds an embedding collective may wait for a peer before raising (default 300). A peer
            that is alive but at another collective (a rank that caught an error and went on), or that
            exited, is named within seconds instead (collective_guard.py); the timeout is for a peer
            that is still computing.
        timeout_setting: how error messages name the timeout setting; wrappers that build this
            module pass their own (RecStrategy: "RecStrategy(embedding_timeout=...)").
        sharders: TorchRec's argument, taken so that its code reads here; None only. Every collection
            is sharded without one: sharding types per table come from the plan (or the planner's
            ParameterConstraints), the fused optimizer from the collection's FusedOptimizerConfig.
        env: TorchRec's argument (ShardingEnv.from_process_group(pg)); None only: pass the group as pg=.
        init_data_parallel: TorchRec's argument; False is dense=None (the dense layers left unwrapped; wrap
            them later with `init_data_parallel()`, as in TorchRec, or `wrap_dense("ddp" | "fsdp")`).
        local_world_size: ranks per host (host-level types); default $LOCAL_WORLD_SIZE or the world.
        ddp_kwargs: extra DistributedDataParallel arguments.
        shared_memory: CPU only. None (default): when every rank shares this host's /dev/shm, the
            embedding all-to-alls and DDP's gradient all-reduce move bytes through shared memory
            (shm_transport.py; gloo carries only a barrier), else through gloo. False: always gloo
            (e.g. to register your own DDP comm hook). True: shared memory or a ValueError.
    """

    def __init__(self, module: nn.Module, plan: ShardingPlan | None = None, device: torch.device | str | None = None,
                 dense: str | None = "ddp", *, pg=None, timeout: float | timedelta = DEFAULT_TIMEOUT_S,
                 local_world_size: int | None = None, ddp_kwargs: dict | None = None,
                 shared_memory: bool | None = None,
                 timeout_setting: str = "DistributedModelParallel(timeout=...)", sharders=None, env=None,
                 init_data_parallel: bool = True) -> None:
        super().__init__()
        if env is not None:  # TorchRec's ShardingEnv.from_process_group(pg): the group is all it carries for us
            raise ValueError(f"DistributedModelParallel(env={short_repr(env)}): pass the process group itself, "
                             f"pg=<group> (TorchRec's env=ShardingEnv.from_process_group(pg)); leave both out to "
                             f"shard over the world")
        if not init_data_parallel:
            dense = None
        if sharders is not None:  # TorchRec's list of EmbeddingBagCollectionSharder(fused_params=...) and the like
            raise ValueError(
                f"DistributedModelParallel(sharders={short_repr(sharders)}): no sharders are needed here, every "
                f"EmbeddingBagCollection / EmbeddingCollection is sharded by DistributedModelParallel itself. Drop "
                f"sharders=; choose sharding types per table with plan= (construct_module_sharding_plan) or "
                f"EmbeddingShardingPlanner(constraints={{table: ParameterConstraints(sharding_types=[...])}}), and the "
                f"fused optimizer (a sharder's fused_params) with EmbeddingBagCollection(optimizer="
                f"FusedOptimizerConfig(...))")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("DistributedModelParallel needs torch.distributed: call "
                             "torch.distributed.init_process_group(backend='gloo' or 'nccl') on every rank first")
        if dense not in ("ddp", "fsdp", None):
            raise ValueError(f"dense={dense!r}: use 'ddp', 'fsdp' or None")
        if plan is not None and not isinstance(plan, ShardingPlan):  # a dict failed on `plan.plan`, unexplained
            raise ValueError(f"DistributedModelParallel(plan=...) takes a ShardingPlan, got a {type(plan).__name__}: "
                             f"build it with ShardingPlan({{module_path: construct_module_sharding_plan(collection, "
                             f"{{table: row_wise(), ...}})}}) (module_path as in model.named_modules(), '' for a "
                             f"collection passed alone)")
        pg = pg if pg is not None else dist.group.WORLD
        world_size, rank = dist.get_world_size(pg), dist.get_rank(pg)
        self._timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        if not (math.isfinite(self._timeout_s) and self._timeout_s > 0):  # gloo would abort on its own assertion
            raise ValueError(f"{timeout_setting.replace('...', repr(timeout))}: the timeout is the seconds a rank "
                             f"waits for a slow peer; give a number > 0 (default {DEFAULT_TIMEOUT_S})")
        if device is None:
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        device = with_cuda_index(torch.device(device), torch.cuda.current_device)
        if device.type == "cuda":
            # NCCL's object collectives (the planner's broadcast below, checkpoint gathers) stage through the
            # current device: a rank left at cuda:0 would meet rank 0 there
            torch.cuda.set_device(device)
        local_world_size = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))

        collections = find_collections(module)
        # A collection held at several paths (one tower's tables shared by another): named_modules lists it once,
        # and only that path was swapped; the others kept the unsharded collection, which trained a copy of its own
        # beside the sharded one. Every path now holds the one sharded collection (planned under its first path).
        aliases = {path: [p for p, x in module.named_modules(remove_duplicate=False) if x is m and p != path]
                   for path, m in collections.items()}
        first_path = {alias: path for path, others in aliases.items() for alias in others}
        if plan is not None and any(p in first_path for p in plan.plan):
            named = [p for p in plan.plan if p in first_path and first_path[p] in plan.plan]
            if named:
                raise ValueError(f"the plan names one collection twice, at {named[0]!r} and {first_path[named[0]]!r} "
                                 f"(both paths hold the same module): keep one entry")
            plan = ShardingPlan({first_path.get(p, p): v for p, v in plan.plan.items()})
        already = [p for p, m in module.named_modules() if isinstance(m, _ShardedCollectionBase)]
        if already:
            raise ValueError(f"the model's embedding collection(s) {already} are sharded already, by an earlier "
                             f"DistributedModelParallel: keep using that one (its .module is this model), or build a "
                             f"new model (a checkpoint of this one loads into it at any world size and plan)")
        if plan is None and collections:
            plan = _planner_plan(module, world_size, local_world_size, device, pg)
        plan = plan or ShardingPlan()
        missing = {p: m for p, m in collections.items() if p not in plan.plan}
        if missing:
            plan = ShardingPlan({**plan.plan, **default_plan(missing, world_size).plan})
        for path in plan.plan:
            if path not in collections:
                raise ValueError(f"the plan names module '{path}', which is not an embedding collection in the model; "
                                 f"its collections are {sorted(collections)}: fix the module path")
        for path, m in collections.items():
            validate_module_plan(path, m, plan.plan[path], world_size, device)
        if device.type == "cuda":  # a plan bigger than the GPU: the planner's kind of explanation, not a CUDA OOM
            check_plan_fits(plan_device_bytes(plan, collections, world_size),
                            torch.cuda.get_device_properties(device).total_memory)
        self.plan = plan

        # Embedding traffic gets its own group: its own timeout, and no interleaving with DDP's.
        backend = "nccl" if device.type == "cuda" else "gloo"
        ranks = dist.get_process_group_ranks(pg)
        emb_pg = dist.new_group(ranks=ranks, backend=backend, timeout=timedelta(seconds=self._timeout_s))
        # every embedding collective (and the strategy's own) waits through this guard: a peer at another
        # collective, or gone, is named within seconds; the timeout is for a peer still computing
        self._guard = CollectiveGuard(emb_pg, "embedding", self._timeout_s, timeout_setting)
        # before any table is built, and before the transport (collective only where shared_memory allows it: ranks
        # given different settings paired its set-up with this check's all-gather, "Connection closed by peer")
        check_same_everywhere(collections, plan, self._guard, device,
                              extra=[f"DistributedModelParallel(shared_memory={shared_memory!r})"])
        self._guard.remember_peers()  # every rank has published its pid before that collective
        transport = None
        if device.type == "cpu" and shared_memory is not False and world_size > 1:
            transport = SharedMemoryGroup.create(emb_pg, self._timeout_s)
            if transport is None and shared_memory:
                raise ValueError("shared_memory=True, but the ranks cannot map each other's /dev/shm files (other "
                                 "hosts, or no /dev/shm): leave shared_memory=None to use gloo there")
        if transport is not None:
            transport.timeout_setting = timeout_setting
            transport.guard = self._guard if self._guard.enabled else None
        self._emb_pg = emb_pg
        # a checkpoint's DCP exchanges (checkpoint.save(dmp=...)) get a group of their own with the same timeout,
        # gloo (they are small pickled plans): a peer that stops mid-save times out there, and the embedding group
        # stays sound for the guarded agreement after it, whose verdict names that peer. Built here, with every rank
        # present (built at a save, a stopped peer would hold it up with an unnamed error)
        self._checkpoint_pg = (dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=self._timeout_s))
                               if world_size > 1 else None)
        self._transport = transport
        env = ShardingEnv(emb_pg, rank, world_size, device, self._timeout_s, transport)
        init_seed = self._agree_init_seed(collections, device)
        for path, m in collections.items():
            built_on_meta = any(w.is_meta for w in m.lookup.table_weights().values())
            sharded = shard_collection(m, plan.plan[path], env)
            if built_on_meta:  # values drawn now: the same replicas everywhere, no two pieces alike
                sharded.init_weights(init_seed)
            else:
                self._broadcast_replicas(sharded, device)
            if path:
                for p in [path] + aliases[path]:
                    _set_submodule(module, p, sharded)
            else:
                module = sharded
        module.to(device)
        self._sharded_paths = list(collections)
        self._device = device
        self._pg, self.world_size = pg, world_size
        object.__setattr__(self, "_unwrapped", module)
        self._dmp_wrapped_module, self.dense = module, None
        if dense is not None:
            self.wrap_dense(dense, ddp_kwargs)
        self._fused_optimizer: FusedOptimizer | None = None
        self._control_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # step_together

    def groups_alive(self) -> bool:
        """False once torch.distributed.destroy_process_group() has destroyed the groups these shards talk over."""
        if not (dist.is_available() and dist.is_initialized()):
            return False
        try:
            dist.get_backend(self._emb_pg)  # a destroyed group is no longer in torch's map of groups
        except ValueError:
            return False
        return True

    def _agree_init_seed(self, collections: Mapping[str, nn.Module], device: torch.device) -> int:
        """Collective (when a collection was built on "meta"): rank 0's draw from its global RNG, on every rank.

        Ranks seeded alike would otherwise draw the same values for different tables (rank 0's first table
        = rank 1's first table), and ranks seeded apart would start data-parallel replicas apart for good.
        """
        if not any(w.is_meta for m in collections.values() for w in m.lookup.table_weights().values()):
            return 0
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        if dist.get_world_size(self._emb_pg) > 1:
            dev = device if self._guard.nccl else torch.device("cpu")
            seed = seed.to(dev)
            k = self._guard.begin()
            work = dist.broadcast(seed, src=dist.get_global_rank(self._emb_pg, 0), group=self._emb_pg, async_op=True)
            self._guard.wait_work(work, "initial values of tables built on 'meta' (seed)", k)
        return int(seed)

    @torch.no_grad()
    def _broadcast_replicas(self, sharded: _ShardedCollectionBase, device: torch.device) -> None:
        """Collective: data-parallel replicas take rank 0's values, as DDP does for dense layers.

        Each rank copies its replicas from its own unsharded model; ranks seeded apart would otherwise
        train different copies of one table for good (every rank applies the same summed update).
        """
        if dist.get_world_size(self._emb_pg) == 1:
            return
        src = dist.get_global_rank(self._emb_pg, 0)
        for name, w in sharded.replica_weights().items():
            k = self._guard.begin()
            work = dist.broadcast(w.data, src=src, group=self._emb_pg, async_op=True)
            self._guard.wait_work(work, f"data-parallel table '{name}' from rank 0", k)

    def wrap_dense(self, dense: str, ddp_kwargs: dict | None = None) -> None:
        """(Re)wrap the dense layers for a new training run ("ddp" | "fsdp"): a model sharded with dense=None
        (evaluation) that goes on to train, or another fit over this model. DDP gets a new wrapper, as
        Lightning gives a plain model one per fit; the old one is dropped first, so that its gradient hooks
        go with it. FSDP's sharding is in place and stays."""
        if self.dense is not None and self.dense != dense:
            raise ValueError(f"the dense layers are wrapped with {self.dense!r} already, not {dense!r}")
        if self.dense == "fsdp":
            return
        if self._dmp_wrapped_module is not self._unwrapped:
            self._dmp_wrapped_module = self._unwrapped
            gc.collect()  # the old DDP and its reducer (whose autograd hooks are on these parameters) are freed now
        self._dmp_wrapped_module = self._wrap_dense(self._unwrapped, dense, self._device, self._pg, ddp_kwargs or {},
                                                    self._transport, self._guard)
        self.dense = dense if self._dmp_wrapped_module is not self._unwrapped or dense == "fsdp" else None

    def init_data_parallel(self) -> None:
        """TorchRec's: wrap the dense layers in DDP now (after DistributedModelParallel(init_data_parallel=False));
        nothing when they are wrapped already."""
        if self.dense is None:
            self.wrap_dense("ddp")

    @staticmethod
    def _wrap_dense(module: nn.Module, dense: str | None, device: torch.device, pg, ddp_kwargs: dict,
                    transport: SharedMemoryGroup | None = None, guard: CollectiveGuard | None = None) -> nn.Module:
        if dense is None or not any(p.requires_grad for p in module.parameters()):
            return module
        if dense == "ddp" and dist.is_initialized() and dist.get_world_size(pg) == 1:
            return module  # one rank: DDP would copy every gradient into its buckets to average it with nobody
        if dense == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [device.index] if device.type == "cuda" else None
            # TorchRec's defaults: buffers are synced once at construction, not re-broadcast every step
            # (a collective per forward); gradients share DDP's buckets.
            kwargs = dict(gradient_as_bucket_view=True)
            new_ddp = ddp_has_forward_sync_buffers()
            if new_ddp:  # torch >= 2.13
                kwargs["forward_sync_buffers"] = False
            kwargs.update(ddp_kwargs)
            ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=pg, **kwargs)
            if not new_ddp and "broadcast_buffers" not in ddp_kwargs:
                # torch 2.11 / 2.12: broadcast_buffers=False would skip the construction sync too, so keep
                # the default for __init__ and turn the per-forward broadcast off after it (DDP reads the
                # attribute at every forward).
                ddp.broadcast_buffers = False
            if transport is not None:  # gradient buckets averaged through shared memory, not gloo's TCP
                ddp.register_comm_hook(None, ddp_comm_hook(transport))
            elif guard is not None and guard.enabled and not guard.nccl:  # gloo: a dead peer is named
                ddp.register_comm_hook(None, named_failure_allreduce_hook(guard, pg))
            return ddp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(pg),))
        for child in _dense_children(module):
            fully_shard(child, mesh=mesh)
        return module

    # the model -------------------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The model with its collections sharded (without the DDP wrapper)."""
        return self._unwrapped

    def _apply(self, fn, recurse: bool = True):
        # checked before anything converts: the sharded collections refuse a dtype cast too, but only after the
        # dense layers that come before them in the model had been converted
        refuse_dtype_cast("DistributedModelParallel: its sharded", fn)
        return super()._apply(fn, recurse)

    def forward(self, *args, **kwargs):
        return self._dmp_wrapped_module(*args, **kwargs)

    # Parameters and buffers under the model's own names, as TorchRec's DistributedModelParallel (and this
    # module's state_dict) name them: without these, the wrappers' '_dmp_wrapped_module.' (and DDP's 'module.')
    # came first, so that names from dmp.named_parameters() matched neither dmp.state_dict() nor the unsharded
    # model. named_modules() keeps the wrappers, as TorchRec's does.

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):  # type: ignore[override]
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True):  # type: ignore[override]
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def _fqn_modifiers(self) -> dict[str, str]:
        """For torch.distributed.checkpoint.state_dict (get_optimizer_state_dict(dmp, optimizer)), which finds each
        name's module attribute by attribute from here: the names above start under self.module."""
        return {name: "_unwrapped" for name, _ in self.module.named_children()}

    def sharded_modules(self) -> dict[str, _ShardedCollectionBase]:
        return {p: (self.module.get_submodule(p) if p else self.module) for p in self._sharded_paths}

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        """The fused embedding updates (and replicas) of this rank, as an optimizer (state per shard)."""
        if self._fused_optimizer is None:
            self._fused_optimizer = FusedOptimizer(self.module)
        return self._fused_optimizer

    # collectives of the training loop, through the embedding group's guard ---------------------------

    def step_together(self, have: bool, batch_index: int, last: bool = False, stop: int = 0) -> bool:
        """Collective: does every rank have batch `batch_index` of this epoch? (False ends it for all.)

        last: this rank's batch is its loader's last (a sized loader, which Lightning does not ask
        again): `self.last_batch_agreed` then tells every rank that the epoch ends after this batch.
        stop: the signals this rank was sent, as bits (RecStrategy: 1 a SIGTERM, 2 SLURM's requeue signal):
        `self.stop_agreed` then maps each rank that was sent one to its bits, on every rank, so that all of them act
        at this batch (the bits ride on this reduction: no collective of their own).

        Every rank reports (has a batch, its index): ranks at different indexes (one consumed a batch
        the others did not) raise CollectiveMismatch on every rank, naming each rank's index, before
        their batches are mixed in one step. One tiny all-reduce, through shared memory when the
        tables use it.
        """
        nccl = self._guard.nccl  # NCCL: on a side stream, so that neither the all-reduce nor its read-back waits
        triples = comm.agree([int(have) + int(have and last), batch_index, int(stop)], self._emb_pg, self._transport,
                             device=self._device if nccl else None, stream=self._control_stream if nccl else None,
                             tag="ranks step together")
        indexes = [i for _, i, _ in triples]
        if len(set(indexes)) > 1:
            ranks = dist.get_process_group_ranks(self._emb_pg)
            where = ", ".join(f"rank {ranks[r]} at batch {i}" for r, i in enumerate(indexes))
            raise CollectiveMismatch(
                f"ranks are at different batches of the epoch ({where}): one rank skipped or consumed a batch "
                f"the others did not (a training_step that calls next(dataloader_iter) on some ranks only?). "
                f"Every rank must run every step")
        self.last_batch_agreed = any(h == 2 for h, _, _ in triples)  # 2: a rank's last batch (see `last`)
        self.any_batch_agreed = any(h for h, _, _ in triples)  # evaluation steps on while any rank has data
        self.stop_agreed = {dist.get_global_rank(self._emb_pg, r): s for r, (_, _, s) in enumerate(triples) if s}
        return all(h for h, _, _ in triples)

    def gather_object(self, obj, dst: int | None = 0) -> list | None:
        """Collective: every rank's picklable `obj`, in rank order, on group rank `dst`; None elsewhere.

        As torch.distributed.gather_object (dst=None: all_gather_object), but through the embedding
        group's guard: a rank that is elsewhere is named within seconds, and the wait is bounded by
        this module's timeout. Host memory: the pickle and one padded buffer on every rank, and the
        world's buffers on `dst`; checkpoints send one table at a time (checkpoint.gathered_state_dict).
        """
        return comm.gather_object(obj, dst, self._emb_pg, self._device)

    def all_gather_object(self, obj) -> list:
        """Collective: every rank's picklable `obj`, in rank order, on every rank (guarded: see gather_object)."""
        return self.gather_object(obj, dst=None)

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        """The model's state dict under its own names; sharded tables as ShardedTensor (global shape + pieces)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Full tensors or ShardedTensors from any world size; each rank reads the pieces it owns."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def _dense_children(module: nn.Module) -> list[nn.Module]:
    """The largest submodules with parameters and no sharded collection inside (FSDP2 units)."""
    out = []
    for child in module.children():
        if isinstance(child, _ShardedCollectionBase):
            continue
        holds_sharded = any(isinstance(m, _ShardedCollectionBase) for m in child.modules())
        if holds_sharded:
            out += _dense_children(child)
        elif any(True for _ in child.parameters()):
            out.append(child)
    if any(True for _ in module.parameters(recurse=False)):
        raise ValueError(f"{type(module).__name__} holds parameters next to an embedding collection: move them into "
                         f"a submodule so FSDP can shard them, or use dense='ddp'")
    return out
