"""`torchrec.distributed`: DistributedModelParallel, TrainPipelineSparseDist, the plan types and the local-rank
helpers. Sharding is DistributedModelParallel's own: docs/torchrec.md#no-sharders."""

from lightning_rec.comm import get_local_rank, get_local_size  # noqa: F401
from lightning_rec.model_parallel import DistributedModelParallel  # noqa: F401
from lightning_rec.pipeline import TrainPipelineSparseDist  # noqa: F401
from lightning_rec.sharding.sharded_tensor import ShardedTensor  # noqa: F401
from lightning_rec.types import ParameterSharding  # noqa: F401

__all__ = ["DistributedModelParallel", "ParameterSharding", "ShardedTensor", "TrainPipelineSparseDist",
           "get_local_rank", "get_local_size"]
