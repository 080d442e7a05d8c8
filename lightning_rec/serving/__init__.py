"""Serving: row-wise quantized tables (QuantEmbeddingBagCollection, quantize_inference_model)."""

from lightning_rec.serving.quant import (  # noqa: F401
    TABLE_TYPES,
    QuantEmbeddingBagCollection,
    dequantize_rows,
    quantize_inference_model,
    quantize_rows,
)

__all__ = ["TABLE_TYPES", "QuantEmbeddingBagCollection", "dequantize_rows", "quantize_inference_model",
           "quantize_rows"]
