"""What a Criteo row holds and how its values become table rows: the feature counts and names, the options for
missing and bad values, and the id mapping that the batch builders and preprocess share."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NUM_DENSE_FEATURES = 13
NUM_SPARSE_FEATURES = 26
DEFAULT_SPARSE_FEATURE_NAMES = [f"C{i}" for i in range(1, NUM_SPARSE_FEATURES + 1)]
# TorchRec's torchrec.datasets.criteo names, with the values our loaders use (their KJT keys)
CAT_FEATURE_COUNT, INT_FEATURE_COUNT = NUM_SPARSE_FEATURES, NUM_DENSE_FEATURES
DEFAULT_CAT_NAMES = DEFAULT_SPARSE_FEATURE_NAMES
DEFAULT_INT_NAMES = [f"I{i}" for i in range(1, NUM_DENSE_FEATURES + 1)]
DEFAULT_LABEL_NAME = "label"
MISSING_CATEGORICAL = ("reserved_id", "empty_bag")


def check_missing_categorical(missing_categorical: str) -> None:
    if missing_categorical not in MISSING_CATEGORICAL:
        raise ValueError(f"missing_categorical must be one of {MISSING_CATEGORICAL}, got {missing_categorical!r}")


def check_on_bad_row(on_bad_row: str) -> None:
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")


def feature_names(sparse_feature_names: Sequence[str] | None) -> list[str]:
    """The KJT keys of the 26 sparse features: C1..C26, or the names given."""
    keys = list(sparse_feature_names or DEFAULT_SPARSE_FEATURE_NAMES)
    if len(keys) != NUM_SPARSE_FEATURES:
        raise ValueError(f"sparse_feature_names needs {NUM_SPARSE_FEATURES} names, got {len(keys)}")
    return keys


def resolve_num_embeddings(num_embeddings_per_feature: int | Sequence[int], num_features: int) -> list[int]:
    """Table rows per feature: one int for all, or one per feature (each >= 2)."""
    if isinstance(num_embeddings_per_feature, int):
        sizes = [num_embeddings_per_feature] * num_features
    else:
        sizes = [int(n) for n in num_embeddings_per_feature]
    if len(sizes) != num_features:
        raise ValueError(f"num_embeddings_per_feature has {len(sizes)} entries for {num_features} sparse features: "
                         f"give one int for all, or one per feature")
    if min(sizes) < 2:
        raise ValueError(f"num_embeddings_per_feature must be >= 2 for every feature, got {sizes}")
    return sizes


# the id a missing value reads with hash_ids=False and "reserved_id": outside the 32-bit hashes, so never a real one
MISSING_RAW_ID = 1 << 32


def table_ids(raw: np.ndarray, num_embeddings: np.ndarray, missing_categorical: str) -> np.ndarray:
    """Raw 32-bit hashes (-1: missing) -> table rows, `num_embeddings` broadcast against `raw`: reserved_id
    1 + v % (n - 1) (0: missing), empty_bag v % n (-1: missing). The native op's hash modes compute the same."""
    present = raw >= 0
    if missing_categorical == "reserved_id":
        return np.where(present, raw % (num_embeddings - 1) + 1, 0)
    return np.where(present, raw % num_embeddings, -1)
