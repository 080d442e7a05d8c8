"""TorchRec's module paths over lightning_rec: a port changes `torchrec.` to `lightning_rec.torchrec.` in its imports.

Each module here re-exports the real one (no second implementation); docs/torchrec.md lists the names we have, the
ones we do not, and why. As `import torchrec`, this gives the configs, collections and jagged types, and its
subpackages (`distributed`, `optim`, `models`, ...) as attributes, each imported on first use."""

from __future__ import annotations

import importlib
from typing import Any

from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

_SUBPACKAGES = ("datasets", "distributed", "fx", "inference", "metrics", "models", "modules", "optim", "quant",
                "sparse")

__all__ = ["DataType", "EmbeddingBagCollection", "EmbeddingBagConfig", "EmbeddingCollection", "EmbeddingConfig",
           "JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "PoolingType"]


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:  # `torchrec.distributed.X` after `import torchrec`, as TorchRec's eager imports allow
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
