"""Names shared by the sharder, the planner and the strategy: sharding types, compute kernels, plans.

TorchRec's public names. A plan maps module paths to per-table `ParameterSharding`s (sharding type, compute kernel,
shards with their offsets, sizes and ranks); plans are plain data that print, compare and travel between ranks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import torch

from lightning_rec.errors import is_number


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


# what a sequence collection can be sharded by (host-level types reduce pooled partial sums: not for rows)
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
    """One rectangular piece of a table: rows [row_offset, row_offset+rows), same for columns (a 1-D tensor, a
    sharded id map's buffer: one offset and one size)."""

    shard_offsets: tuple[int, int]  # (row, column) of the shard's first element in the global table
    shard_sizes: tuple[int, int]  # (rows, columns)
    placement: int  # owning rank

    def __str__(self) -> str:
        if len(self.shard_offsets) == 1:
            (p,), (n,) = self.shard_offsets, self.shard_sizes
            return f"rank {self.placement}: positions {p}:{p + n}"
        (r, c), (nr, nc) = self.shard_offsets, self.shard_sizes
        return f"rank {self.placement}: rows {r}:{r + nr} cols {c}:{c + nc}"


@dataclass
class ParameterSharding:
    """One table's entry in a plan: how it is split, its kernel, and its shards (with their ranks). TorchRec's
    `sharding_spec=EnumerableShardingSpec([...])` is read into `shards` (the placement's rank is kept)."""

    sharding_type: ShardingType
    compute_kernel: ComputeKernel = ComputeKernel.FUSED
    ranks: list[int] = field(default_factory=list)
    shards: list[ShardMetadata] = field(default_factory=list)
    # fused_uvm_caching: the share of the table's rows its device cache holds (None: fbgemm's default, 20%)
    cache_load_factor: float | None = None

    # TorchRec's other per-table settings: None passes, a value is refused naming ours (_TORCHREC_SETTINGS)
    enforce_hbm = stochastic_rounding = bounds_check_mode = output_dtype = key_value_params = None

    def __init__(self, sharding_type: ShardingType, compute_kernel: ComputeKernel = ComputeKernel.FUSED,
                 ranks: list[int] | None = None, shards: list[ShardMetadata] | None = None,
                 sharding_spec=None, cache_params=None, enforce_hbm: bool | None = None,
                 stochastic_rounding: bool | None = None, bounds_check_mode=None, output_dtype=None,
                 key_value_params=None, cache_load_factor: float | None = None) -> None:
        self.cache_load_factor = _cache_load_factor(compute_kernel, cache_params, cache_load_factor)
        given = dict(enforce_hbm=enforce_hbm, stochastic_rounding=stochastic_rounding,
                     bounds_check_mode=bounds_check_mode, output_dtype=output_dtype, key_value_params=key_value_params)
        for name, value in given.items():
            if value is not None:  # a ported plan's setting: refused naming what does its job here
                raise ValueError(f"ParameterSharding({name}={value!r}) is TorchRec's; a plan here carries no such "
                                 f"setting: {_TORCHREC_SETTINGS[name]}; leave it out (None)")
        if sharding_spec is not None:
            if shards:
                raise ValueError("ParameterSharding got both shards and sharding_spec: pass one of them")
            try:
                shards = [ShardMetadata(tuple(s.shard_offsets), tuple(s.shard_sizes), _placement_rank(s.placement))
                          for s in sharding_spec.shards]
            except (AttributeError, TypeError, ValueError):
                raise ValueError(
                    f"ParameterSharding(sharding_spec={sharding_spec!r}): pass torch's EnumerableShardingSpec of "
                    f"ShardMetadata(shard_offsets, shard_sizes, placement='rank:N/...'), or shards=[ShardMetadata"
                    f"((row, col), (rows, cols), rank), ...]"
                ) from None
        self.sharding_type = sharding_type
        self.compute_kernel = compute_kernel
        self.ranks = list(ranks) if ranks is not None else []
        self.shards = list(shards) if shards is not None else []

    @property
    def sharding_spec(self):
        # TorchRec's holds torch ShardMetadata with device placements; ours name ranks only (the device is the run's)
        raise AttributeError(
            "ParameterSharding has no sharding_spec here: its shards are in .shards (ShardMetadata with "
            "shard_offsets, shard_sizes and placement, the owning rank), and .ranks lists the ranks"
        )

    @property
    def cache_params(self) -> CacheParams | None:
        """TorchRec's name for the cache's settings: its load_factor is the one kept here."""
        return None if self.cache_load_factor is None else CacheParams(load_factor=self.cache_load_factor)

    def __str__(self) -> str:
        shards = [str(s) for s in self.shards]
        pieces = "; ".join(shards) if shards else f"ranks {self.ranks}"
        if len(shards) > _SHARDS_SHOWN:
            # one line per table stays readable at 64 ranks; all shards are in .shards
            ranks = _ranks_text(sorted({s.placement for s in self.shards}))
            pieces = f"{len(shards)} shards on ranks {ranks}: " + "; ".join([*shards[:2], "...", shards[-1]])
        cache = f", cache {self.cache_load_factor:.0%}" if self.cache_load_factor is not None else ""
        return f"{self.sharding_type} ({self.compute_kernel}{cache}) -> {pieces}"


_SHARDS_SHOWN = 4  # a table with more shards prints their count, their ranks, the first two and the last


def _ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8, 9, 12] -> "0-3, 8-9, 12"."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


DEFAULT_CACHE_LOAD_FACTOR = 0.2  # fbgemm's and TorchRec's default: a fused_uvm_caching cache of 20% of the rows


@dataclass(frozen=True)
class CacheParams:
    """TorchRec's cache settings of a fused_uvm_caching table: load_factor honoured, the rest refused when set."""

    algorithm: object = None
    load_factor: float | None = None
    reserved_memory: float | None = None
    precision: object = None
    prefetch_pipeline: bool | None = None
    stats: object = None
    multipass_prefetch_config: object = None


def cache_params_load_factor(cache_params, where: str) -> float | None:
    """The load_factor of TorchRec's CacheParams (or a mapping of its fields); its other settings refused."""
    if cache_params is None:
        return None
    items = dict(cache_params) if isinstance(cache_params, Mapping) else {
        k: v for k, v in vars(cache_params).items() if not k.startswith("_")}
    other = sorted(k for k, v in items.items() if k != "load_factor" and v is not None)
    if other:
        raise ValueError(f"{where} cache_params sets {', '.join(other)}: only its load_factor is honoured (pass "
                         f"cache_load_factor=...); the cache runs fbgemm's defaults for the rest")
    lf = items.get("load_factor")
    return None if lf is None else float(lf)


def _cache_load_factor(compute_kernel, cache_params, cache_load_factor) -> float | None:
    lf = cache_params_load_factor(cache_params, "ParameterSharding")
    if lf is not None and cache_load_factor is not None and float(cache_load_factor) != lf:
        raise ValueError(f"ParameterSharding cache_params.load_factor={lf} disagrees with "
                         f"cache_load_factor={cache_load_factor}: pass one of them")
    lf = lf if cache_load_factor is None else cache_load_factor
    if lf is None:
        return None
    if not is_number(lf) or not 0 < lf <= 1:
        raise ValueError(f"ParameterSharding cache_load_factor={lf!r}: give the share of the table's rows its "
                         f"device cache holds, a number in (0, 1] (default {DEFAULT_CACHE_LOAD_FACTOR})")
    if str(compute_kernel) != "fused_uvm_caching":  # ComputeKernel's str is its value
        raise ValueError(f"ParameterSharding(compute_kernel='{compute_kernel}', cache_load_factor={lf}): only "
                         f"compute_kernel 'fused_uvm_caching' has a cache; leave cache_load_factor out or plan the "
                         f"table with that kernel")
    return float(lf)


_TORCHREC_SETTINGS = {
    "enforce_hbm": "the compute_kernel says where the table lives ('fused': device memory)",
    "stochastic_rounding": "float16 tables round as the kernel does (fbgemm: stochastically, its default)",
    "bounds_check_mode": "ids are always checked, naming the feature and table",
    "output_dtype": "embeddings come out in float32, from float16 tables too",
    "key_value_params": "SSD / parameter-server tables are not supported",
}


def _placement_rank(placement) -> int:
    """A torch ShardMetadata placement ('rank:1/cuda:1', a _remote_device, or a bare rank) -> the rank."""
    if isinstance(placement, int):
        return placement
    if hasattr(placement, "rank") and callable(placement.rank):
        return int(placement.rank())
    text = str(placement)
    if text.startswith("rank:"):
        return int(text[5:].split("/")[0])
    raise ValueError(f"placement {placement!r} names no rank")


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


# plans are plain data: torch.load(f) (weights_only=True) reads them back once this module is imported
torch.serialization.add_safe_globals(
    [ShardingType, ComputeKernel, ShardMetadata, ParameterSharding, EmbeddingModuleShardingPlan, ShardingPlan]
)
