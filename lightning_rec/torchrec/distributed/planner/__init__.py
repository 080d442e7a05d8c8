"""`torchrec.distributed.planner`: EmbeddingShardingPlanner, ParameterConstraints, Topology (what they take:
docs/torchrec.md#the-planner)."""

from lightning_rec.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

__all__ = ["EmbeddingShardingPlanner", "ParameterConstraints", "Topology"]
