"""lightning_rec: train large recommendation models with Lightning.

Keyed jagged tensors, fused embedding collections on fbgemm kernels, model-parallel sharding, a planner, and Lightning
integration (`Trainer(strategy="rec")`, the `lightning-rec` recipe CLI).

Names are imported on first use, so `import lightning_rec` stays light. Importing any LightningModule or the CLI
registers `strategy="rec"` with Lightning, and so does `import lightning_rec`, before or after Lightning is imported."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    # sparse data
    "JaggedTensor": "sparse", "KeyedJaggedTensor": "sparse", "KeyedTensor": "sparse",
    # embeddings and optimizers
    "BaseEmbeddingConfig": "embedding", "EmbeddingBagCollection": "embedding", "EmbeddingBagConfig": "embedding",
    "EmbeddingCollection": "embedding", "EmbeddingConfig": "embedding", "PoolingType": "embedding",
    "DataType": "embedding",
    "CombinedOptimizer": "optim", "EmbOptimType": "optim", "FusedOptimizer": "optim",
    "FusedOptimizerConfig": "optim", "combined_optimizer": "optim", "apply_optimizer_in_backward": "optim",
    "KeyedOptimizerWrapper": "optim", "in_backward_optimizer_filter": "optim", "RowWiseAdagrad": "optim",
    # sharding
    "ComputeKernel": "types", "EmbeddingComputeKernel": "types", "EmbeddingModuleShardingPlan": "types",
    "ParameterSharding": "types", "ShardingPlan": "types", "ShardingType": "types", "ShardMetadata": "types",
    "DistributedModelParallel": "model_parallel", "construct_module_sharding_plan": "model_parallel",
    "table_wise": "model_parallel", "row_wise": "model_parallel", "column_wise": "model_parallel",
    "table_row_wise": "model_parallel", "table_column_wise": "model_parallel", "grid_shard": "model_parallel",
    "data_parallel": "model_parallel",
    "TrainPipelineSparseDist": "pipeline", "PipelineConfig": "pipeline",
    # planner
    "EmbeddingShardingPlanner": "planner", "ParameterConstraints": "planner", "PlannerError": "planner",
    "PlanStats": "planner", "Topology": "planner",
    # Lightning side
    "RecStrategy": "strategy", "DLRM": "models", "DLRM_DCN": "models", "DLRMModule": "models", "DLRMTrain": "models",
    "DLRM_Projection": "models",
    "Batch": "data", "CriteoDataModule": "data", "SyntheticCriteoDataModule": "data",
    "AUC": "metrics", "CTR": "metrics", "LogLoss": "metrics", "NormalizedEntropy": "metrics",
    "RecMetricCollection": "metrics", "BinnedAUC": "metrics", "RankingMetrics": "metrics", "NDCG": "metrics",
    "Recall": "metrics", "Precision": "metrics", "MRR": "metrics", "HitRate": "metrics",
    "MovieLensDataModule": "data", "TwoTower": "models", "TwoTowerModule": "models",
    "SequenceDataModule": "data", "SASRec": "models", "HSTU": "models",
    "PredictionWriter": "predict", "RecCheckpointLoading": "models.module_hooks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_rec' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_rec.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return __all__


class _RegisterWithLightning(importlib.abc.MetaPathFinder):
    """Registers `strategy="rec"` once `lightning.pytorch` is imported after us, so that `Trainer(strategy="rec")`
    works whatever the user's import order, without making `import lightning_rec` load Lightning."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "lightning.pytorch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                run(module)
                importlib.import_module("lightning_rec.strategy")

            spec.loader.exec_module = exec_module
        return spec


if "lightning.pytorch" in sys.modules:  # Lightning is loaded already: registering costs nothing more
    importlib.import_module("lightning_rec.strategy")
else:
    sys.meta_path.insert(0, _RegisterWithLightning())


if TYPE_CHECKING:  # static tools see the names as if imported eagerly
    from lightning_rec.data import (  # noqa: F401
        Batch,
        CriteoDataModule,
        MovieLensDataModule,
        SequenceDataModule,
        SyntheticCriteoDataModule,
    )
    from lightning_rec.embedding import (  # noqa: F401
        BaseEmbeddingConfig,
        DataType,
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
        PoolingType,
    )
    from lightning_rec.metrics import (  # noqa: F401
        AUC,
        CTR,
        MRR,
        NDCG,
        BinnedAUC,
        HitRate,
        LogLoss,
        NormalizedEntropy,
        Precision,
        RankingMetrics,
        Recall,
        RecMetricCollection,
    )
    from lightning_rec.model_parallel import (  # noqa: F401
        DistributedModelParallel,
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        grid_shard,
        row_wise,
        table_column_wise,
        table_row_wise,
        table_wise,
    )
    from lightning_rec.models import (  # noqa: F401
        DLRM,
        DLRM_DCN,
        HSTU,
        DLRM_Projection,
        DLRMModule,
        DLRMTrain,
        SASRec,
        TwoTower,
        TwoTowerModule,
    )
    from lightning_rec.optim import (  # noqa: F401
        CombinedOptimizer,
        EmbOptimType,
        FusedOptimizer,
        FusedOptimizerConfig,
        KeyedOptimizerWrapper,
        RowWiseAdagrad,
        apply_optimizer_in_backward,
        combined_optimizer,
        in_backward_optimizer_filter,
    )
    from lightning_rec.pipeline import PipelineConfig, TrainPipelineSparseDist  # noqa: F401
    from lightning_rec.planner import (  # noqa: F401
        EmbeddingShardingPlanner,
        ParameterConstraints,
        PlannerError,
        PlanStats,
        Topology,
    )
    from lightning_rec.predict import PredictionWriter  # noqa: F401
    from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor  # noqa: F401
    from lightning_rec.strategy import RecStrategy  # noqa: F401
    from lightning_rec.types import (  # noqa: F401
        ComputeKernel,
        EmbeddingComputeKernel,
        EmbeddingModuleShardingPlan,
        ParameterSharding,
        ShardingPlan,
        ShardingType,
        ShardMetadata,
    )
