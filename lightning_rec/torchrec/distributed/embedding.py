"""`torchrec.distributed.embedding`: EmbeddingCollectionSharder (taken, as EmbeddingBagCollectionSharder)."""

from lightning_rec.sharding.sharders import EmbeddingCollectionSharder

__all__ = ["EmbeddingCollectionSharder"]
