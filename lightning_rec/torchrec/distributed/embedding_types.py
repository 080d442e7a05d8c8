"""`torchrec.distributed.embedding_types`: EmbeddingComputeKernel."""

from lightning_rec.types import EmbeddingComputeKernel

__all__ = ["EmbeddingComputeKernel"]
