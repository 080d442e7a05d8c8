"""`torchrec.inference`: state_dict_transform (a sharded model's state dict to CPU, gathered whole) and modules
(quantize_embeddings, refused: no quantized tables here)."""

from lightning_rec.torchrec.inference import modules, state_dict_transform  # noqa: F401

__all__ = ["modules", "state_dict_transform"]
