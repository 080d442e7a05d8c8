"""`torchrec.inference`: state_dict_transform (a sharded model's state dict to CPU, gathered whole) and modules
(quantize_embeddings, quantize_inference_model: row-wise int8 / int4 tables)."""

from lightning_rec.torchrec.inference import modules, state_dict_transform  # noqa: F401

__all__ = ["modules", "state_dict_transform"]
