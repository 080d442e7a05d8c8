"""What a user tells the planner about one table: allowed options and how hot it is."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

from lightning_rec.types import DEFAULT_CACHE_LOAD_FACTOR, ComputeKernel, ShardingType, cache_params_load_factor

__all__ = ["DEFAULT_CACHE_LOAD_FACTOR", "ParameterConstraints"]
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
            close = difflib.get_close_matches(str(v).lower().replace("-", "_"), [e.value for e in enum], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(
                f"ParameterConstraints{table}: unknown {field_name} {v!r}{hint}: choose from {valid}"
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
    - `min_partition`: narrowest column block for column-wise, table-column-wise and grid shards.
    - `pooling_factors`: expected ids per sample, one per feature of the table (a float is one
      feature); this, not the table size, drives the lookup and communication estimates.
    - `is_weighted`: ids carry per-id weights (4 more bytes per id on the wire).
    - `enforce_hbm`: keep this table in device memory: never the UVM kernels.
    - `cache_load_factor`: fraction of rows the `fused_uvm_caching` kernel keeps in device memory
      (TorchRec's `cache_params=CacheParams(load_factor=...)`, which is accepted too).

    The fields come in TorchRec's order. TorchRec's other fields (`num_poolings`, `batch_sizes`, ...) are
    accepted where they mean what this planner does anyway and refused by name otherwise (docs/torchrec.md)."""

    sharding_types: list[ShardingType | str] | None = None
    compute_kernels: list[ComputeKernel | str] | None = None
    min_partition: int | None = None
    pooling_factors: list[float] | float = 1.0
    num_poolings: list[float] | None = None
    batch_sizes: list[int] | None = None
    is_weighted: bool = False
    cache_params: object | None = None
    enforce_hbm: bool | None = False
    stochastic_rounding: bool | None = None
    bounds_check_mode: object | None = None
    feature_names: list[str] | None = None
    output_dtype: object | None = None
    device_group: str | None = None
    key_value_params: object | None = None
    cache_load_factor: float | None = None
    use_virtual_table: bool | None = None  # TorchRec's (after key_value_params there): False only

    def __post_init__(self) -> None:
        self.sharding_types = _enum_list(self.sharding_types, ShardingType, "sharding type", "")
        self.compute_kernels = _enum_list(self.compute_kernels, ComputeKernel, "compute kernel", "")
        pf = self.pooling_factors
        try:  # a str is one figure (a YAML "2.5"): iterated, "12" read as two features of 1.0 and 2.0
            self.pooling_factors = [float(pf)] if isinstance(pf, (int, float, str)) else [float(p) for p in pf]
        except (TypeError, ValueError):
            raise ValueError(
                f"ParameterConstraints pooling_factors={pf!r}: give the mean ids per sample, a number or one per "
                f"feature of the table (pooling_factors=[2.0, 1.5])"
            ) from None
        if not self.pooling_factors:
            raise ValueError("ParameterConstraints pooling_factors=[]: give one ids-per-sample figure per feature")
        self.enforce_hbm = bool(self.enforce_hbm)  # TorchRec's default is None: not enforced
        self._torchrec_fields()
        if self.min_partition is not None and self.min_partition <= 0:
            raise ValueError(f"ParameterConstraints min_partition={self.min_partition} must be a positive number of "
                             "columns")
        if self.cache_load_factor is not None and not 0 < self.cache_load_factor <= 1:
            raise ValueError(f"ParameterConstraints cache_load_factor={self.cache_load_factor} must be in (0, 1]: "
                             f"the fraction of rows cached in device memory")

    def _torchrec_fields(self) -> None:
        """TorchRec's fields: kept where they mean what this planner does, else refused by name."""
        n = len(self.pooling_factors)
        for name in ("num_poolings", "batch_sizes"):
            values = getattr(self, name)
            if values is not None and n != 1 and len(values) != n:
                raise ValueError(
                    f"ParameterConstraints {name}={values} has {len(values)} entries but pooling_factors has "
                    f"{n}: give one per feature of the table, as TorchRec requires"
                )
        if self.num_poolings is not None and any(float(p) != 1.0 for p in self.num_poolings):
            raise ValueError(f"ParameterConstraints num_poolings={self.num_poolings}: this planner prices one pooled "
                             f"embedding per feature per sample; several poolings per sample are not modelled: leave "
                             f"num_poolings out (or all 1.0)")
        # batch_sizes must equal the planner's batch_size: checked in check_batch_size (the planner knows it)
        lf = cache_params_load_factor(self.cache_params, "ParameterConstraints")
        if lf is not None:
            if self.cache_load_factor is not None and lf != self.cache_load_factor:
                raise ValueError(f"ParameterConstraints cache_params.load_factor={lf} disagrees with "
                                 f"cache_load_factor={self.cache_load_factor}: pass one of them")
            self.cache_load_factor = lf
        if self.stochastic_rounding is not None:
            raise ValueError(
                f"ParameterConstraints stochastic_rounding={self.stochastic_rounding} is not a setting here: "
                f"float16 tables round as the kernel does (fbgemm: stochastically, its default); leave it out"
            )
        refused = {
            "output_dtype": "embeddings come out in float32, from float16 tables too",
            "device_group": "one kind of device per plan: Topology(compute_device=...)",
            "key_value_params": "SSD / parameter-server tables are not supported; tables live in device or host memory",
        }
        if self.use_virtual_table:  # was a TypeError "unexpected keyword argument", False (its default) included
            refused["use_virtual_table"] = "virtual (SSD / dynamic) tables are not supported; tables have fixed rows"
        for name, instead in refused.items():
            value = getattr(self, name)
            if value is not None:
                raise ValueError(f"ParameterConstraints {name}={value!r} is not a setting here: {instead}; "
                                 f"leave it out")
        if self.bounds_check_mode is not None:
            raise ValueError(
                f"ParameterConstraints bounds_check_mode={self.bounds_check_mode} is not a setting here: ids "
                f"are always checked (on CPU before the lookup, naming the feature and table; on GPU by "
                f"fbgemm's counter, raised with the names a few steps later); leave it out"
            )

    def check_features(self, table: str, features: list[str]) -> None:
        """TorchRec's feature_names say which features the pooling factors are for: here, the table's own."""
        if self.feature_names is not None and list(self.feature_names) != list(features):
            raise ValueError(
                f"table '{table}': ParameterConstraints feature_names={list(self.feature_names)}, but the table's "
                f"features are {list(features)}: pooling_factors follow the table's features in that order; list "
                f"them so (or leave feature_names out)"
            )

    def check_batch_size(self, table: str, batch_size: int) -> None:
        """TorchRec's per-feature batch_sizes mean the same here only when each is the planner's."""
        if self.batch_sizes is not None and any(int(b) != batch_size for b in self.batch_sizes):
            raise ValueError(
                f"table '{table}': ParameterConstraints batch_sizes={self.batch_sizes}: this planner prices "
                f"every feature at its batch_size={batch_size}; per-feature batch sizes are not modelled: "
                f"leave batch_sizes out, or set EmbeddingShardingPlanner(batch_size=...)"
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
