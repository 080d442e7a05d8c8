"""The tables' configs: EmbeddingBagConfig / EmbeddingConfig (TorchRec's fields), PoolingType, DataType.

Each config checks its own fields once, when it is built: the collections, the planner and the CLI take them as given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import Tensor

from lightning_rec.errors import is_int, is_number
from lightning_rec.lookup import LocalTable


class PoolingType(str, Enum):
    SUM = "sum"
    MEAN = "mean"
    NONE = "none"

    def __str__(self) -> str:
        return self.value


class DataType(str, Enum):
    """TorchRec's name for a table's data_type (`data_type=DataType.FP16`); torch dtypes work as well."""

    FP32 = "fp32"
    FP16 = "fp16"

    def __str__(self) -> str:
        return self.value


_TABLE_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
                 "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def _table_dtype(table: str, value) -> torch.dtype:
    """A table's data_type from a torch dtype or its name (YAML configs give names)."""
    if isinstance(value, str):
        key = value.lower().removeprefix("torch.")
        if key in _TABLE_DTYPES:
            return _TABLE_DTYPES[key]
    elif value in (torch.float32, torch.float16):
        return value
    raise ValueError(f"table '{table}': data_type {value!r} is not supported: use torch.float32 ('float32') or "
                     f"torch.float16 ('float16')")


@dataclass(kw_only=True)
class BaseEmbeddingConfig:
    num_embeddings: int
    embedding_dim: int
    name: str
    feature_names: list[str] = field(default_factory=list)
    data_type: torch.dtype = torch.float32
    weight_init_min: float | None = None  # default: -sqrt(1 / num_embeddings), as TorchRec
    weight_init_max: float | None = None
    # TorchRec's: called on each table's weight in place instead of the uniform draw (per shard on "meta")
    init_fn: Callable[[Tensor], object] | None = None
    # TorchRec's flag for position-weighted tables: learned per-id weights train under every sharding type here
    need_pos: bool = False
    # TorchRec's fields for what this package does not do: the default taken, another value refused
    num_embeddings_post_pruning: int | None = None
    input_dim: int | None = None
    total_num_buckets: int | None = None
    use_virtual_table: bool = False
    virtual_table_eviction_policy: object | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "." in self.name:
            raise ValueError(f"an embedding table needs a name without dots (it becomes a state dict key), got "
                             f"{self.name!r}")
        for field_name in ("num_embeddings", "embedding_dim"):
            value = getattr(self, field_name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"table '{self.name}': {field_name} must be a positive integer, got {value!r}"
                                 + (f": write {field_name}={value.strip()}" if isinstance(value, str) else ""))
        if isinstance(self.feature_names, str):
            raise ValueError(f"table '{self.name}': feature_names must be a list of names, got the string "
                             f"{self.feature_names!r}: write feature_names=[{self.feature_names!r}]")
        if not self.feature_names:
            # TorchRec's convention: a table with no feature names is read by a feature of its own name.
            self.feature_names = [self.name]
        self.feature_names = list(self.feature_names)
        bad = [f for f in self.feature_names if not isinstance(f, str) or not f]
        if bad:
            raise ValueError(f"table '{self.name}': feature names must be non-empty strings, got {bad}")
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError(f"table '{self.name}' lists a feature twice: {self.feature_names}")
        self.data_type = _table_dtype(self.name, self.data_type)
        self._refuse_unsupported_torchrec_fields()
        for field_name in ("weight_init_min", "weight_init_max"):
            value = getattr(self, field_name)
            if value is not None and not is_number(value):
                raise ValueError(f"table '{self.name}': {field_name} must be a number (finite) or None, got {value!r}")
        if self.init_fn is not None and not callable(self.init_fn):
            raise ValueError(f"table '{self.name}': init_fn must be a function of the weight (e.g. "
                             f"functools.partial(torch.nn.init.normal_, std=0.01)), got {self.init_fn!r}")
        lo_hi = self.init_range()
        if lo_hi is not None and lo_hi[0] > lo_hi[1]:
            raise ValueError(f"table '{self.name}': weight_init_min={lo_hi[0]} is above weight_init_max={lo_hi[1]}: "
                             f"rows are drawn uniformly from [weight_init_min, weight_init_max]")

    def _refuse_unsupported_torchrec_fields(self) -> None:
        if not isinstance(self.need_pos, bool):
            raise ValueError(f"table '{self.name}': need_pos must be True or False, got {self.need_pos!r}")
        pruned = self.num_embeddings_post_pruning
        if pruned is not None and pruned != self.num_embeddings:
            raise ValueError(f"table '{self.name}': num_embeddings_post_pruning={pruned!r} (TorchRec's row pruning for "
                             f"quantized inference) is not supported: leave it None; to serve a table of {pruned} "
                             f"rows, train it with num_embeddings={pruned} (ids hashed into that many rows)")
        if self.input_dim is not None and self.input_dim != self.embedding_dim:
            raise ValueError(f"table '{self.name}': input_dim={self.input_dim!r} is not supported (rows are "
                             f"embedding_dim={self.embedding_dim} wide, in and out): leave it None")
        refused = {
            "total_num_buckets": (self.total_num_buckets is not None, "bucketized (ZCH) tables"),
            "use_virtual_table": (bool(self.use_virtual_table), "virtual (SSD / key-value) tables"),
            "virtual_table_eviction_policy": (self.virtual_table_eviction_policy is not None,
                                              "virtual tables' eviction"),
        }
        for field_name, (given, what) in refused.items():
            if given:
                raise ValueError(f"table '{self.name}': {field_name}={getattr(self, field_name)!r}: {what} are not "
                                 f"supported; tables have num_embeddings fixed rows (hash ids into them): leave "
                                 f"{field_name} out")

    def init_range(self) -> tuple[float, float] | None:
        if self.weight_init_min is None and self.weight_init_max is None:
            return None
        bound = (1.0 / self.num_embeddings) ** 0.5
        lo = self.weight_init_min if self.weight_init_min is not None else -bound
        hi = self.weight_init_max if self.weight_init_max is not None else bound
        return (lo, hi)

    def pooling_name(self) -> str:
        return "none"

    def num_features(self) -> int:
        """TorchRec's: how many features read this table."""
        return len(self.feature_names)

    def local_table(self) -> LocalTable:
        return LocalTable(self.name, self.num_embeddings, self.embedding_dim, tuple(self.feature_names),
                          self.pooling_name(), self.data_type, self.init_range())


@dataclass(kw_only=True)
class EmbeddingBagConfig(BaseEmbeddingConfig):
    pooling: PoolingType = PoolingType.SUM

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            self.pooling = PoolingType(str(self.pooling).lower())
        except ValueError:
            raise ValueError(f"table '{self.name}': unknown pooling {self.pooling!r}: use sum or mean") from None
        if self.pooling == PoolingType.NONE:
            raise ValueError(f"table '{self.name}': pooling none is a sequence table: use EmbeddingConfig")

    def pooling_name(self) -> str:
        return self.pooling.value


@dataclass(kw_only=True)
class EmbeddingConfig(BaseEmbeddingConfig):
    """A sequence (unpooled) table: every id gets its own embedding row out."""
