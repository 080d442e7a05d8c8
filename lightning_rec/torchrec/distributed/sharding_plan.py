"""`torchrec.distributed.sharding_plan`: construct_module_sharding_plan and the per-table verbs."""

from lightning_rec.sharding.plan_verbs import (  # noqa: F401
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)

__all__ = ["column_wise", "construct_module_sharding_plan", "data_parallel", "grid_shard", "row_wise",
           "table_column_wise", "table_row_wise", "table_wise"]
