"""`torchrec.sparse.jagged_tensor`: JaggedTensor, KeyedJaggedTensor, KeyedTensor and their helpers."""

from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor"]
