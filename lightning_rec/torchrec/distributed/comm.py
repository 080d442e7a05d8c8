"""`torchrec.distributed.comm`: get_local_size and get_local_rank."""

from lightning_rec.comm import get_local_rank, get_local_size

__all__ = ["get_local_rank", "get_local_size"]
