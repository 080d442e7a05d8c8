"""`torchrec.datasets.movielens`: MovieLens' column names. The MovieLens loader is lightning_rec.data's
MovieLensDataModule (docs/movielens.md)."""

from lightning_rec.data.movielens.columns import (  # noqa: F401
    DEFAULT_COLUMN_NAMES,
    DEFAULT_MOVIES_COLUMN_NAMES,
    DEFAULT_RATINGS_COLUMN_NAMES,
)

__all__ = ["DEFAULT_COLUMN_NAMES", "DEFAULT_MOVIES_COLUMN_NAMES", "DEFAULT_RATINGS_COLUMN_NAMES"]
