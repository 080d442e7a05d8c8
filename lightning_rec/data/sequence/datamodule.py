"""`SequenceDataModule`: an interaction log read as each user's history in time order, split leave-one-out and
served as jagged `SequenceBatch`es (docs/sequential.md)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader

from lightning_rec.data.batch import make_eval_loader, make_train_loader, worker_options
from lightning_rec.data.hf_dataset import check_same_rows, dataset_path, is_hf_dataset, rows_digest
from lightning_rec.data.movielens.columns import _NO_RATING, _header_map
from lightning_rec.data.movielens.datamodule import default_cache_dir
from lightning_rec.data.movielens.read import _OWN_FILE, detect_layout, parquet_ratings, read_ratings
from lightning_rec.data.movielens.side import _indexed, raw_ids
from lightning_rec.data.sequence.histories import (
    SequenceEvalDataset,
    SequenceTrainDataset,
    loo_lengths,
    ranges,
    user_histories,
)
from lightning_rec.errors import is_int

log = logging.getLogger(__name__)


@dataclass
class SequenceReport:
    layout: str = ""
    num_interactions: int = 0  # after min_rating
    num_users: int = 0
    num_items: int = 0
    users_skipped: int = 0  # one interaction: no target to train or evaluate on
    users_not_evaluated: int = 0  # two interactions: both train, none held out
    users_truncated: int = 0  # histories longer than max_len (the most recent max_len kept)
    timestamps_tied: int = 0  # interactions at the same time as the one before them (log order kept)
    heldout_items_unseen_in_train: dict = field(default_factory=dict)  # split -> users whose item never trained
    split_sizes: dict = field(default_factory=dict)  # users per split


class SequenceDataModule(pl.LightningDataModule):
    """Users' histories, oldest first, as jagged batches for sequential models (SASRec, HSTU).

    Args:
        data_dir: an unpacked GroupLens folder, your own log (a folder with ratings.csv / ratings.parquet, a .parquet
            file or pattern), or a `datasets.Dataset` of interactions (MovieLensDataModule's readers).
        max_len: the most recent items of a history a sample holds (inputs; older ones are dropped).
        batch_size: users per training batch.
        eval_batch_size: users per evaluation batch.
        min_rating: None: every rating is an interaction; a number: only ratings >= it.
        columns: your log's column names where they are not GroupLens' ({"item": "parent_asin", ...}).
        eval_test_in_fit: the validation loop also ranks the test split (logged as test_*).
        seed: the training shuffle.
        shuffle, drop_last, num_workers, pin_memory: the training loader's.
        hash_ids: history items are rows 0..n-1 of the distinct item ids (sorted); False: the inputs' item ids are
            the log's raw ids, unfolded, for a managed-collision table (string ids: a stable 62-bit hash); targets
            and exclusions stay rows of the catalogue (what the output ranks) either way.

    Order: each user's interactions sorted by timestamp; ties keep the log's own order (stable), and a log whose
    timestamps go backwards is read in time order. Split: leave-one-out (validation = the second-to-last item, test
    = the last); a user of one interaction is skipped, one of two trains only (both counted in `report`)."""

    def __init__(self, data_dir, max_len: int = 50, batch_size: int = 128, eval_batch_size: int = 256,
                 min_rating: float | None = None, columns: dict[str, str] | None = None,
                 eval_test_in_fit: bool = False, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 num_workers: int = 0, pin_memory: bool = False, hash_ids: bool = True) -> None:
        super().__init__()
        if not is_int(max_len) or max_len < 1:
            raise ValueError(f"SequenceDataModule max_len={max_len!r}: give the number of most recent items a "
                             f"history keeps, an int >= 1 (e.g. 50 for ml-100k, 200 for ml-1m)")
        for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            if not is_int(value) or value < 1:
                raise ValueError(f"SequenceDataModule {name}={value!r}: give a positive number of users per batch")
        worker_options("SequenceDataModule", num_workers, pin_memory)
        _header_map(columns)
        given = data_dir
        data_dir = dataset_path(data_dir, "SequenceDataModule data_dir", default_cache_dir, "ratings.parquet")
        self._dataset_rows = {"data_dir": rows_digest(given)} if is_hf_dataset(given) else {}
        self.save_hyperparameters()
        self.data_dir, self.columns = Path(data_dir), dict(columns) if columns else None
        self.max_len, self.batch_size, self.eval_batch_size = max_len, batch_size, eval_batch_size
        self.min_rating, self.eval_test_in_fit, self.seed = min_rating, eval_test_in_fit, seed
        self.shuffle, self.drop_last, self.num_workers, self.pin_memory = shuffle, drop_last, num_workers, pin_memory
        self.hash_ids = hash_ids
        self.report = SequenceReport()
        self.datasets: dict = {}
        self._built = False

    def _read(self) -> pa.Table:
        if parquet_ratings(self.data_dir):
            layout, path = "parquet", self.data_dir
        elif self.data_dir.is_dir():
            layout, path = detect_layout(self.data_dir)
        else:
            raise ValueError(f"SequenceDataModule data_dir {self.data_dir} is not a folder: pass the unpacked "
                             f"GroupLens folder (https://grouplens.org/datasets/movielens/). {_OWN_FILE}")
        table = read_ratings(path, self.columns)
        if self.min_rating is not None:
            if table.schema.metadata and _NO_RATING in table.schema.metadata:
                raise ValueError(f"min_rating={self.min_rating}: {path} has no rating column: leave min_rating out")
            table = table.filter(pa.array(np.asarray(table.column("rating")) >= self.min_rating))
        if table.num_rows == 0:
            raise ValueError(f"no interactions in {path}" + (f" with min_rating={self.min_rating}: lower it"
                                                             if self.min_rating is not None else ""))
        self.report.layout = layout
        return table

    def _build(self) -> None:
        table = self._read()
        self.user_ids, user_N = _indexed(table.column("user_id"), [])
        self.item_ids, item_N = _indexed(table.column("item_id"), [])
        self.num_users, self.num_items = len(self.user_ids), len(self.item_ids)
        time_N = np.asarray(table.column("timestamp"))
        order_N, offsets_U1 = user_histories(user_N, time_N, self.num_users)
        items_N = torch.from_numpy(item_N[order_N].astype(np.int64))
        times_N = torch.from_numpy(np.asarray(time_N[order_N]).astype(np.int64))
        train_len_U, evaluated_U = loo_lengths(offsets_U1)
        start_U, end_U = torch.from_numpy(offsets_U1[:-1]), torch.from_numpy(offsets_U1[1:])
        train_len_U, evaluated_U = torch.from_numpy(train_len_U), torch.from_numpy(evaluated_U)
        users_E = torch.nonzero(evaluated_U).flatten()
        # how often each item is in a training history: the sampled softmax's logQ correction reads it
        self.item_counts = torch.bincount(items_N[ranges(start_U, train_len_U)], minlength=self.num_items)
        raw = None if self.hash_ids else raw_ids(self.item_ids)
        self.datasets = {
            "train": SequenceTrainDataset(items_N, times_N, start_U, train_len_U, self.max_len, raw),
            "val": SequenceEvalDataset(items_N, times_N, start_U, end_U - 2, users_E, self.max_len, raw),
            "test": SequenceEvalDataset(items_N, times_N, start_U, end_U - 1, users_E, self.max_len, raw)}
        self._fill_report(offsets_U1, items_N, times_N, start_U, train_len_U, users_E)
        self._built = True

    def _fill_report(self, offsets_U1, items_N, times_N, start_U, train_len_U, users_E) -> None:
        r, n_U = self.report, np.diff(offsets_U1)
        r.num_interactions, r.num_users, r.num_items = int(offsets_U1[-1]), self.num_users, self.num_items
        r.users_skipped, r.users_not_evaluated = int((n_U == 1).sum()), int((n_U == 2).sum())
        r.users_truncated = int((n_U - 1 > self.max_len).sum())
        same_user = np.ones(len(items_N), dtype=bool)
        same_user[offsets_U1[:-1]] = False
        r.timestamps_tied = int((same_user[1:] & (times_N[1:] == times_N[:-1]).numpy()).sum())
        trained = torch.zeros(self.num_items, dtype=torch.bool)
        trained[items_N[ranges(start_U, train_len_U)]] = True  # every item of a training history
        for split in ("val", "test"):
            ds = self.datasets[split]
            r.split_sizes[split] = len(ds)
            r.heldout_items_unseen_in_train[split] = int((~trained[items_N[ds.target_at_E]]).sum())
        r.split_sizes["train"] = len(self.datasets["train"])
        if r.users_skipped:
            log.info("SequenceDataModule: %d users with one interaction skipped (no target)", r.users_skipped)
        if r.heldout_items_unseen_in_train["test"]:
            log.info("SequenceDataModule: %d test items never seen in training (still ranked)",
                     r.heldout_items_unseen_in_train["test"])

    def prepare_data(self) -> None:
        pass

    def setup(self, stage: str | None = None) -> None:
        check_same_rows(self._dataset_rows, "SequenceDataModule")
        if not self._built:
            self._build()

    def _need_setup(self) -> None:
        if not self._built:
            raise ValueError("SequenceDataModule.setup() has not run: call dm.setup() (Trainer.fit does) first")

    def train_dataloader(self) -> DataLoader:
        self._need_setup()
        return make_train_loader(self.datasets["train"], self.batch_size, shuffle=self.shuffle,
                                 drop_last=self.drop_last, seed=self.seed, num_workers=self.num_workers,
                                 pin_memory=self.pin_memory, trainer=self.trainer)

    def _eval_loader(self, split: str) -> DataLoader:
        self._need_setup()
        return make_eval_loader(self.datasets[split], self.eval_batch_size, self.num_workers, self.pin_memory)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        """A training batch gets its step's item-table lookup from the model it feeds (SASRec's and HSTU's
        `prepare_batch`) here, in the data path: a pipeline (RecStrategy(pipeline=True)) routes it ahead of the
        step."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        prepare = getattr(module, "prepare_batch", None)
        return prepare(batch) if callable(prepare) else batch

    def eval_split_names(self) -> list[str]:
        """The split each validation dataloader ranks, in order (what a module prefixes its metrics with)."""
        fitting = self.trainer is None or self.trainer.state.fn == "fit"
        return ["val", "test"] if self.eval_test_in_fit and fitting else ["val"]

    def val_dataloader(self):
        loaders = [self._eval_loader(split) for split in self.eval_split_names()]
        return loaders if len(loaders) > 1 else loaders[0]

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
