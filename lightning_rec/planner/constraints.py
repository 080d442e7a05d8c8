"""What a user tells the planner about one table: allowed options and how hot it is."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_rec.types import ComputeKernel, ShardingType

DEFAULT_CACHE_LOAD_FACTOR = 0.2  # TorchRec's default: a device cache of 20% of the rows
DEFAULT_MIN_PARTITION = 32  # narrowest column block; narrower rows waste gather bandwidth


def _enum_list(values, enum, field_name: str, table: str) -> list | None:
    if values is None:
        return None
    if isinstance(values, (str, enum)):
        values = [values]
    out = []
    for v in values:
        try:
            out.append(enum(str(v.value if isinstance(v, enum) else v).lower()))
        except ValueError:
            valid = ", ".join(e.value for e in enum)
            raise ValueError(
                f"ParameterConstraints{table}: unknown {field_name} {v!r}: choose from {valid}"
            ) from None
    if not out:
        raise ValueError(
            f"ParameterConstraints{table}: {field_name}=[] allows nothing: leave it out (None) to allow all"
        )
    return list(dict.fromkeys(out))  # dedupe, keep the user's order


@dataclass
class ParameterConstraints:
    """Per-table constraints and statistics, passed as `constraints={table_name: ParameterConstraints}`.

    - `sharding_types` / `compute_kernels`: allowed options (None: all that apply).
    - `pooling_factors`: expected ids per sample, one per feature of the table (a float is one
      feature); this, not the table size, drives the lookup and communication estimates.
    - `min_partition`: narrowest column block for column-wise, table-column-wise and grid shards.
    - `is_weighted`: ids carry per-id weights (4 more bytes per id on the wire).
    - `cache_load_factor`: fraction of rows the `fused_uvm_caching` kernel keeps in device memory.
    - `enforce_hbm`: keep this table in device memory: never the UVM kernels.
    """

    sharding_types: list[ShardingType | str] | None = None
    compute_kernels: list[ComputeKernel | str] | None = None
    pooling_factors: list[float] | float = 1.0
    min_partition: int | None = None
    is_weighted: bool = False
    cache_load_factor: float | None = None
    enforce_hbm: bool = False

    def __post_init__(self) -> None:
        self.sharding_types = _enum_list(self.sharding_types, ShardingType, "sharding type", "")
        self.compute_kernels = _enum_list(self.compute_kernels, ComputeKernel, "compute kernel", "")
        pf = self.pooling_factors
        self.pooling_factors = [float(pf)] if isinstance(pf, (int, float)) else [float(p) for p in pf]
        if not self.pooling_factors:
            raise ValueError(
                "ParameterConstraints pooling_factors=[]: give one ids-per-sample figure per feature"
            )
        if self.min_partition is not None and self.min_partition <= 0:
            raise ValueError(
                f"ParameterConstraints min_partition={self.min_partition} must be a positive number of "
                "columns"
            )
        if self.cache_load_factor is not None and not 0 < self.cache_load_factor <= 1:
            raise ValueError(
                f"ParameterConstraints cache_load_factor={self.cache_load_factor} must be in (0, 1]: "
                f"the fraction of rows cached in device memory"
            )

    def validate_for(self, table: str) -> None:
        """Checks that need the table's name in the message (the pooling factor is per table)."""
        for p in self.pooling_factors:
            if not 0 < p < math.inf:  # inf priced every option at inf ms: the plan kept was arbitrary
                raise ValueError(
                    f"table '{table}': pooling factor {p} must be finite and > 0 (expected ids per sample): "
                    f"set ParameterConstraints(pooling_factors=...) to the mean number of ids per sample, "
                    f"e.g. 1.0 for one-hot features"
                )
