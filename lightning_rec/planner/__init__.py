"""The planner: which sharding type, compute kernel and ranks each embedding table gets."""

from lightning_rec.planner.constraints import ParameterConstraints
from lightning_rec.planner.plan import EmbeddingShardingPlanner, PlannerError, find_tables
from lightning_rec.planner.stats import PlanStats, RankStats, TableStats
from lightning_rec.planner.topology import GB, Topology

__all__ = [
    "GB", "EmbeddingShardingPlanner", "ParameterConstraints", "PlanStats", "PlannerError", "RankStats", "TableStats",
    "Topology", "find_tables"]
