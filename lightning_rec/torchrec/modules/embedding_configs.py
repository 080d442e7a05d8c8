"""`torchrec.modules.embedding_configs`: table configs."""

from lightning_rec.embedding_configs import (  # noqa: F401
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)

__all__ = ["BaseEmbeddingConfig", "DataType", "EmbeddingBagConfig", "EmbeddingConfig", "PoolingType"]
