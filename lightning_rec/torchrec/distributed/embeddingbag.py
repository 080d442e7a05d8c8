"""`torchrec.distributed.embeddingbag`: EmbeddingBagCollectionSharder, taken by DistributedModelParallel(sharders=)
and the planner, which need none (lightning_rec/sharding/sharders.py says what they do with it)."""

from lightning_rec.sharding.sharders import EmbeddingBagCollectionSharder

__all__ = ["EmbeddingBagCollectionSharder"]
