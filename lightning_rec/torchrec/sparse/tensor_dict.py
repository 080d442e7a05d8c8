"""`torchrec.sparse.tensor_dict`: a TensorDict of jagged tensors as a KeyedJaggedTensor."""

from lightning_rec.sparse.tensor_dict import maybe_td_to_kjt

__all__ = ["maybe_td_to_kjt"]
