"""Plan verbs: TorchRec's `table_wise(rank=)`, `row_wise()`, `column_wise(ranks=)`, `table_row_wise(host_index=)`,
`table_column_wise(host_index=)`, `grid_shard(host_indexes=)` and `data_parallel()`.

Each verb is a choice for one table; `construct_module_sharding_plan` makes it concrete shards once the
table's size and the world size are known:

    construct_module_sharding_plan(ebc, {"t0": table_wise(rank=0), "t1": row_wise(), "t2": data_parallel()})"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from lightning_rec.sharding.layout import shard_layout
from lightning_rec.types import ComputeKernel, EmbeddingModuleShardingPlan, ParameterSharding, ShardingType


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




def collection_configs(module) -> list:
    if hasattr(module, "embedding_bag_configs"):
        return list(module.embedding_bag_configs())
    if hasattr(module, "embedding_configs"):
        return list(module.embedding_configs())
    raise ValueError(f"{type(module).__name__} is not an embedding collection: pass the EmbeddingBagCollection or "
                     f"EmbeddingCollection whose tables the plan covers")


def construct_module_sharding_plan(module: nn.Module, per_param_sharding: Mapping[str, ShardingSpec],
                                   local_size: int | None = None, world_size: int | None = None,
                                   device_type: str | None = None) -> EmbeddingModuleShardingPlan:
    """table name -> verb, for one collection -> its EmbeddingModuleShardingPlan (sizes: the process group's)."""
    del device_type
    if world_size is None:
        world_size, default_local = _world()
        local_size = local_size or default_local
    configs = {c.name: c for c in collection_configs(module)}
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

