"""`torchrec.inference.modules`: quantize_embeddings and quantize_inference_model (row-wise int8 / int4 / fp16
tables read by fbgemm's integer kernel; lightning_rec.serving)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_rec.serving.quant import quantize_inference_model as _quantize

_DTYPES = {torch.qint8: "int8", torch.quint8: "int8", torch.int8: "int8", torch.quint4x2: "int4",
           torch.half: "fp16", torch.float: "fp32"}


def quantize_embeddings(module: Any, dtype: Any = torch.qint8, inplace: bool = False, *args: Any,
                        **kwargs: Any) -> Any:
    """TorchRec's table quantization for inference: dtype torch.qint8 (int8), torch.quint4x2 (int4), torch.half
    or torch.float; every EmbeddingBagCollection becomes a QuantEmbeddingBagCollection."""
    if dtype not in _DTYPES and dtype not in _DTYPES.values():
        raise ValueError(f"quantize_embeddings: dtype={dtype}: give torch.qint8, torch.quint4x2, torch.half or "
                         f"torch.float")
    return _quantize(module, _DTYPES.get(dtype, dtype), inplace=inplace)


def quantize_inference_model(model: Any, quantization_mapping: Any = None, per_table_weight_dtype: Any = None,
                             fp_weight_dtype: Any = None, *, dtype: Any = torch.qint8, inplace: bool = False) -> Any:
    """TorchRec's quantize_inference_model: int8 tables by default (dtype as quantize_embeddings')."""
    return quantize_embeddings(model, dtype=dtype, inplace=inplace)


__all__ = ["quantize_embeddings", "quantize_inference_model"]
