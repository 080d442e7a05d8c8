"""`torchrec.inference.modules`: quantize_embeddings, refused (this package has no int8 / int4 tables)."""

from __future__ import annotations

from typing import Any

QUANTIZE_REFUSED = ("quantize_embeddings: lightning_rec has no quantized (int8 / int4) tables; for a smaller "
                    "inference model, export with fp16 tables (lightning_rec.checkpoint.export(ckpt, out, "
                    "fp16_tables=True)) or build the tables with data_type=DataType.FP16")


def quantize_embeddings(module: Any, dtype: Any = None, inplace: bool = False, *args: Any, **kwargs: Any) -> Any:
    """TorchRec's int8 / int4 table quantization for inference: refused, naming what exists (QUANTIZE_REFUSED)."""
    raise NotImplementedError(QUANTIZE_REFUSED)


__all__ = ["quantize_embeddings"]
