"""lightning_rec: train large recommendation models with Lightning.

Keyed jagged tensors, fused embedding collections on fbgemm kernels, model-parallel sharding,
a planner, and Lightning integration (`Trainer(strategy="rec")`, the `lightning-rec` recipe CLI).
"""

from lightning_rec.embedding import (
    BaseEmbeddingConfig,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    PoolingType,
)
from lightning_rec.optim import (
    CombinedOptimizer,
    EmbOptimType,
    FusedOptimizer,
    FusedOptimizerConfig,
    combined_optimizer,
)
from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from lightning_rec.types import (
    ComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)

__all__ = [
    "BaseEmbeddingConfig",
    "CombinedOptimizer",
    "ComputeKernel",
    "EmbOptimType",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "EmbeddingModuleShardingPlan",
    "FusedOptimizer",
    "FusedOptimizerConfig",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "ParameterSharding",
    "PoolingType",
    "ShardMetadata",
    "ShardingPlan",
    "ShardingType",
    "combined_optimizer",
]
