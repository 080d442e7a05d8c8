"""MovieLens (GroupLens) ratings, or your own interaction log, as implicit feedback for retrieval: training pairs and
full-ranking users (docs/movielens.md: layouts, splits, evaluation, features).

Shapes: N interactions of a split, B interactions in a batch, U users in an evaluation batch, I items, R held-out items
of an evaluation batch, X excluded (already seen) items of it."""

from lightning_rec.data.movielens.batches import FeatureTable, RankingBatch, RetrievalBatch
from lightning_rec.data.movielens.columns import (
    DEFAULT_COLUMN_NAMES,
    DEFAULT_MOVIES_COLUMN_NAMES,
    DEFAULT_RATINGS_COLUMN_NAMES,
)
from lightning_rec.data.movielens.datamodule import MovieLensDataModule, MovieLensReport, default_cache_dir
from lightning_rec.data.movielens.datasets import EvalShardSampler, InteractionDataset, UserRankingDataset
from lightning_rec.data.movielens.read import detect_layout, given_split_files, parquet_ratings, read_ratings
from lightning_rec.data.movielens.splits import (
    GIVEN,
    OFFICIAL_SPLITS,
    SPLITS,
    TEMPORAL_SPLITS,
    _csr_by_user,  # noqa: F401  (benchmarks/ranking_eval.py)
    loo_split,
    ro_split,
    to_split,
)

__all__ = [
    "DEFAULT_COLUMN_NAMES", "DEFAULT_MOVIES_COLUMN_NAMES", "DEFAULT_RATINGS_COLUMN_NAMES",
    "GIVEN", "OFFICIAL_SPLITS", "SPLITS", "TEMPORAL_SPLITS", "EvalShardSampler", "FeatureTable", "InteractionDataset",
    "MovieLensDataModule", "MovieLensReport", "RankingBatch", "RetrievalBatch", "UserRankingDataset",
    "default_cache_dir", "detect_layout", "given_split_files", "loo_split", "parquet_ratings", "read_ratings",
    "ro_split", "to_split"]
