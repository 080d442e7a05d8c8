"""`torchrec.inference.state_dict_transform`: state_dict_to_device and state_dict_gather."""

from lightning_rec.checkpoint import state_dict_gather, state_dict_to_device

__all__ = ["state_dict_gather", "state_dict_to_device"]
