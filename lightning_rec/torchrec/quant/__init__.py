"""`torchrec.quant`: the quantized pooled collection (`EmbeddingBagCollection`, row-wise int8 / int4 / fp16 tables
read by fbgemm's integer kernel) and `quantize_inference_model`."""

from lightning_rec.torchrec.quant import embedding_modules  # noqa: F401
from lightning_rec.torchrec.quant.embedding_modules import EmbeddingBagCollection, QuantEmbeddingBagCollection

__all__ = ["EmbeddingBagCollection", "QuantEmbeddingBagCollection", "embedding_modules"]
