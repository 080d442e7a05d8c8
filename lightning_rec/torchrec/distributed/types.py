"""`torchrec.distributed.types`: sharding types, compute kernels, parameter shardings and plans, sharded tensors."""

from lightning_rec.sharding.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata  # noqa: F401
from lightning_rec.types import (  # noqa: F401
    CacheParams,
    ComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)

__all__ = ["CacheParams", "ComputeKernel", "EmbeddingModuleShardingPlan", "ParameterSharding", "Shard",
           "ShardMetadata", "ShardedTensor", "ShardedTensorMetadata", "ShardingPlan", "ShardingType"]
