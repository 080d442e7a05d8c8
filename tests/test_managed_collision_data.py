"""Criteo readers hand raw ids unfolded (hash_ids=False) for managed-collision tables."""

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA

from lightning_rec.data import CriteoDataModule
from lightning_rec.data.criteo.datasets import make_criteo_batch
from lightning_rec.data.criteo.schema import MISSING_RAW_ID

CRITEO = SHARED_DATA / "criteo"


def _raw(rows=3):
    sparse = np.arange(rows * 26, dtype=np.int64).reshape(rows, 26) * 1_000_003 + 2**31
    sparse[0, 0] = -1  # missing
    return np.zeros(rows, np.float32), np.zeros((rows, 13), np.float32), sparse


def test_raw_ids_are_unfolded():
    label, dense, sparse = _raw()
    sizes = np.full(26, 100, dtype=np.int64)
    keys = [f"C{i}" for i in range(1, 27)]
    kjt = make_criteo_batch(label, dense, sparse, sizes, keys, hash_ids=False).sparse_features
    want = np.where(sparse >= 0, sparse, MISSING_RAW_ID).T.reshape(-1)
    assert kjt.values().tolist() == want.tolist() and int(kjt.values().max()) >= 2**31
    bag = make_criteo_batch(label, dense, sparse, sizes, keys, "empty_bag", hash_ids=False).sparse_features
    assert bag.lengths().tolist()[0] == 0 and bag.values().tolist() == [v for v in want.tolist() if v != MISSING_RAW_ID]


@pytest.mark.skipif(not CRITEO.is_dir(), reason="needs the shared Criteo samples")
@pytest.mark.parametrize("streaming", [False, True])
def test_datamodule_hands_raw_ids(tmp_path, streaming):
    dm = CriteoDataModule(train_path=str(CRITEO / "criteo_kaggle_valid_sample.tsv"), batch_size=256, shuffle=False,
                          num_embeddings_per_feature=50, cache_dir=str(tmp_path), streaming=streaming,
                          hash_ids=False)
    dm.prepare_data()
    dm.setup("fit")
    values = next(iter(dm.train_dataloader())).sparse_features.values()
    assert values.dtype == torch.int64 and int(values.max()) >= 50 and int(values.min()) >= 0
