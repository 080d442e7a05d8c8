"""`torchrec.distributed.planner.planners`: EmbeddingShardingPlanner."""

from lightning_rec.planner import EmbeddingShardingPlanner

__all__ = ["EmbeddingShardingPlanner"]
