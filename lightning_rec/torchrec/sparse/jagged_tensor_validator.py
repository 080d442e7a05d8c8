"""`torchrec.sparse.jagged_tensor_validator`: a KeyedJaggedTensor's contract, checked on demand."""

from lightning_rec.sparse import validate_keyed_jagged_tensor

__all__ = ["validate_keyed_jagged_tensor"]
