"""Names shared by the sharder, the planner and the strategy: sharding types, compute kernels, plans.

TorchRec's public names, so that its users feel at home. A plan maps module paths to per-table
`ParameterSharding`s; each says how a table is split (`sharding_type`), which kernel runs its
lookup (`compute_kernel`), and where each shard sits (`shards`: global row/column offsets, sizes,
owning rank). Plans are plain data: they print, compare, and travel between ranks as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class ShardingType(str, Enum):
    DATA_PARALLEL = "data_parallel"  # every rank holds the whole table; gradients all-reduced
    TABLE_WISE = "table_wise"  # the whole table on one rank
    ROW_WISE = "row_wise"  # rows split evenly over all ranks
    COLUMN_WISE = "column_wise"  # columns split into blocks, each block table-wise on a rank
    TABLE_ROW_WISE = "table_row_wise"  # rows split over the ranks of one host
    TABLE_COLUMN_WISE = "table_column_wise"  # columns split over the ranks of one host
    GRID_SHARD = "grid_shard"  # column blocks, each row-wise over the ranks of one host

    def __str__(self) -> str:
        return self.value


# What a sequence collection (EmbeddingCollection) can be sharded by: its rows travel back per id,
# so the host-level types (whose pooled partial sums are reduced inside a host) do not apply.
SEQUENCE_SHARDING_TYPES = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE,
                           ShardingType.DATA_PARALLEL)


class ComputeKernel(str, Enum):
    DENSE = "dense"  # autograd gradient, a torch.optim optimizer steps the table
    FUSED = "fused"  # TBE with the update inside backward, table in device (or host on CPU) memory
    FUSED_UVM = "fused_uvm"  # GPU: table in host memory through unified memory
    FUSED_UVM_CACHING = "fused_uvm_caching"  # GPU: a device cache over a host table

    def __str__(self) -> str:
        return self.value


EmbeddingComputeKernel = ComputeKernel  # TorchRec's name (its members' values are the same strings)


@dataclass(frozen=True)
class ShardMetadata:
    """One rectangular piece of a table: rows [row_offset, row_offset+rows), same for columns."""

    shard_offsets: tuple[int, int]  # (row, column) of the shard's first element in the global table
    shard_sizes: tuple[int, int]  # (rows, columns)
    placement: int  # owning rank

    def __str__(self) -> str:
        (r, c), (nr, nc) = self.shard_offsets, self.shard_sizes
        return f"rank {self.placement}: rows {r}:{r + nr} cols {c}:{c + nc}"


@dataclass
class ParameterSharding:
    sharding_type: ShardingType
    compute_kernel: ComputeKernel = ComputeKernel.FUSED
    ranks: list[int] = field(default_factory=list)
    shards: list[ShardMetadata] = field(default_factory=list)

    def __str__(self) -> str:
        pieces = "; ".join(str(s) for s in self.shards) if self.shards else f"ranks {self.ranks}"
        return f"{self.sharding_type} ({self.compute_kernel}) -> {pieces}"


class EmbeddingModuleShardingPlan(dict):
    """table name -> ParameterSharding, for one embedding collection."""

    def __reduce__(self):
        # rebuilt from a plain dict: torch.load(weights_only=True) fills only plain dicts item by item
        return type(self), (dict(self),)

    def __str__(self) -> str:
        width = max((len(k) for k in self), default=0)
        return "\n".join(f"  {name:<{width}}  {ps}" for name, ps in self.items())


@dataclass
class ShardingPlan:
    """module path (as in `model.named_modules()`) -> EmbeddingModuleShardingPlan."""

    plan: dict[str, EmbeddingModuleShardingPlan] = field(default_factory=dict)

    def get_plan_for_module(self, module_path: str) -> EmbeddingModuleShardingPlan | None:
        return self.plan.get(module_path)

    def __str__(self) -> str:
        lines = []
        for path, module_plan in self.plan.items():
            lines.append(f"{path or '<root>'}:")
            lines.append(str(module_plan))
        return "\n".join(lines)


# Plans are plain data: torch.save(plan, f) then torch.load(f) (weights_only=True, torch's default since
# 2.6) reads them back once this module is imported (any plan name, e.g. `from lightning_rec import
# ShardingPlan`), without weights_only=False, which would let the file run arbitrary code.
torch.serialization.add_safe_globals(
    [ShardingType, ComputeKernel, ShardMetadata, ParameterSharding, EmbeddingModuleShardingPlan, ShardingPlan]
)
