"""Data: Criteo files, synthetic Criteo-shaped data, MovieLens and users' histories (sequences), as whole batches."""

from lightning_rec.data.batch import (
    Batch,
    StatefulBatchLoader,
    make_batch_loader,
    make_stream_loader,
    make_train_loader,
    passthrough_collate,
)
from lightning_rec.data.criteo import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    DEFAULT_INT_NAMES,
    DEFAULT_LABEL_NAME,
    DEFAULT_SPARSE_FEATURE_NAMES,
    INT_FEATURE_COUNT,
    CriteoDataModule,
    CriteoDataset,
    CriteoIterableDataset,
    CriteoLayout,
    CriteoShardDataset,
    ParseReport,
    build_criteo_cache,
    detect_layout,
    make_criteo_batch,
    preprocess_criteo,
    read_criteo,
)
from lightning_rec.data.movielens import MovieLensDataModule, RankingBatch, RetrievalBatch, read_ratings
from lightning_rec.data.sequence import SequenceBatch, SequenceDataModule
from lightning_rec.data.synthetic import SyntheticCriteoDataModule, SyntheticCriteoDataset

__all__ = ["Batch", "CAT_FEATURE_COUNT", "CriteoDataModule", "CriteoDataset", "CriteoIterableDataset",
    "CriteoLayout", "CriteoShardDataset", "DEFAULT_CAT_NAMES", "DEFAULT_INT_NAMES", "DEFAULT_LABEL_NAME",
    "DEFAULT_SPARSE_FEATURE_NAMES", "INT_FEATURE_COUNT", "MovieLensDataModule", "ParseReport", "RankingBatch",
    "RetrievalBatch", "SequenceBatch", "SequenceDataModule", "StatefulBatchLoader", "SyntheticCriteoDataModule",
    "SyntheticCriteoDataset", "build_criteo_cache", "detect_layout", "make_batch_loader", "make_criteo_batch",
    "make_stream_loader", "make_train_loader", "passthrough_collate", "preprocess_criteo", "read_criteo",
    "read_ratings"]
