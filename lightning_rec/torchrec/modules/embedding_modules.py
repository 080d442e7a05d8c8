"""`torchrec.modules.embedding_modules`: EmbeddingBagCollection and EmbeddingCollection."""

from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingCollection

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection"]
