"""`torchrec.quant.embedding_modules`: EmbeddingBagCollection, the quantized one (QuantEmbeddingBagCollection)."""

from lightning_rec.serving.quant import QuantEmbeddingBagCollection

EmbeddingBagCollection = QuantEmbeddingBagCollection

__all__ = ["EmbeddingBagCollection", "QuantEmbeddingBagCollection"]
