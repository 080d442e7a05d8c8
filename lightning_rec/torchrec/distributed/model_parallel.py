"""`torchrec.distributed.model_parallel`: DistributedModelParallel."""

from lightning_rec.model_parallel import DistributedModelParallel

__all__ = ["DistributedModelParallel"]
