"""`MovieLensDataModule`: a ratings log read, split and served as training pairs and full-ranking users."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_rec.data.batch import make_eval_loader, make_train_loader, passthrough_collate, worker_options
from lightning_rec.data.hf_dataset import check_same_rows, dataset_path, is_hf_dataset, rows_digest
from lightning_rec.data.labels import check_label_columns, label_matrix, label_specs
from lightning_rec.data.movielens.columns import _NO_RATING, _NO_TIME, _header_map
from lightning_rec.data.movielens.datasets import EvalShardSampler, InteractionDataset, UserRankingDataset
from lightning_rec.data.movielens.pointwise import LabelledRowsDataset
from lightning_rec.data.movielens.read import (
    _OWN_FILE,
    _concat_logs,
    detect_layout,
    given_split_files,
    parquet_ratings,
    read_ratings,
)
from lightning_rec.data.movielens.side import _feature_table, _indexed, _is_text, _keyed_like, _read_side
from lightning_rec.data.movielens.splits import (
    _SPLIT_WORDS,
    GIVEN,
    OFFICIAL_SPLITS,
    SPLITS,
    TEMPORAL_SPLITS,
    _csr_by_user,
    loo_split,
    ro_split,
    to_split,
)
from lightning_rec.errors import is_int, is_number
from lightning_rec.sparse import KeyedJaggedTensor

log = logging.getLogger(__name__)


@dataclass
class MovieLensReport:
    layout: str = ""
    num_ratings: int = 0
    num_interactions: int = 0  # after min_rating
    num_users: int = 0
    num_items: int = 0
    split_sizes: dict = field(default_factory=dict)
    heldout_items_unseen_in_train: dict = field(default_factory=dict)  # split -> pairs whose item has no train row
    users_without_heldout: dict = field(default_factory=dict)  # split -> users skipped by the ranking metrics
    duplicates_dropped: int = 0  # repeated (user, item) rows, only the first kept


def default_cache_dir() -> Path:
    """Where a `datasets.Dataset` given as data_dir is written (beside datasets' own cache)."""
    import datasets.config

    return Path(datasets.config.HF_DATASETS_CACHE) / "lightning_rec" / "movielens"


def _check_args(split: str, min_rating: float | None, num_negatives: int, batch_size: int, eval_batch_size: int,
                columns: dict[str, str] | None) -> None:
    """The arguments' own checks, at construction (the data's are made as it is read, at setup)."""
    if min_rating is not None and not is_number(min_rating):  # "4" met numpy's UFuncTypeError at setup
        raise ValueError(f"MovieLensDataModule min_rating={min_rating!r}: give a number (ratings >= it are kept), or "
                         f"None to keep every rating")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
    if num_negatives not in (0, 1):
        raise ValueError(f"num_negatives={num_negatives}: use 0 (in-batch negatives) or 1 (BPR)")
    for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
        if not is_int(value) or value < 1:
            raise ValueError(f"MovieLensDataModule {name}={value!r}: give a positive number per batch")
    _header_map(columns)  # an unknown field is said here, not at setup


def _first_of_pairs(user_N: Tensor, item_N: Tensor, num_items: int, time_N: np.ndarray | None) -> np.ndarray | None:
    """The rows to keep, one per (user, item) pair (the earliest by `time_N`, or the first); None when none repeats."""
    first_N = np.argsort(time_N, kind="stable") if time_N is not None else np.arange(user_N.shape[0])
    _, first_P = np.unique((user_N.numpy() * num_items + item_N.numpy())[first_N], return_index=True)
    return None if first_P.shape[0] == user_N.shape[0] else np.sort(first_N[first_P])


class MovieLensDataModule(pl.LightningDataModule):
    """MovieLens as implicit feedback: training pairs (RetrievalBatch) and full-ranking users (RankingBatch).

    Args:
        data_dir: an unpacked GroupLens folder (ml-100k, ml-1m, ml-20m, ml-25m, ...), your own log (a folder
            with ratings.csv or ratings.parquet, a .parquet file or a pattern), or, in Python, a
            `datasets.Dataset` of interactions.
        split: "ro_811" (RecBole's random-order 8:1:1 per user), "to_811" (the same in time order), "loo"
            (leave-one-out in time order), ml-100k's "u1".."u5", "ua", "ub", or "given" (data_dir holds the log's own
            train / valid / test files, or is a DatasetDict) (docs/movielens.md).
        min_rating: None: every rating is an interaction; a number: only ratings >= it.
        side_features: add age/gender/occupation/zip and genre/year features where the layout has them.
        batch_size: training pairs per batch.
        eval_batch_size: users per evaluation batch.
        num_negatives: 0 (in-batch negatives) or 1 (one sampled negative per pair, for BPR).
        eval_test_in_fit: the validation loop also ranks the test split (logged as test_*), so one
            `fit` reports both; `trainer.test` works either way.
        seed: the random split (ro_811) and the negatives (the shuffle order too).
        columns: your log's column names where they are not GroupLens' (a headed ratings.csv or a Parquet log):
            {"user": "reviewer_id", "item": "parent_asin", "rating": "stars", "timestamp": "time"}, any of them.
        shuffle: shuffle the training pairs each epoch.
        drop_last: drop the last, smaller training batch.
        num_workers: DataLoader worker processes (0: load in the main process).
        pin_memory: pin batches in host memory for the copy to a GPU.
        prefetch_factor: batches each worker loads ahead (None: torch's default).
        persistent_workers: keep the workers between epochs (None: whenever there are any).
        label_columns: labelled rows instead of pairs and users: every loader yields `Batch`es (user and item
            features sparse, no dense features, labels [B, T]) of the split's ratings, one label per task: a list of
            columns (["rating"]) or task -> column or "column OP number" ({"liked": "rating >= 4"}; docs/multitask.md).
        label_masks: task -> a column whose 0 / null rows have no label for that task (label_columns only).
        hash_ids: the user_id / item_id features are rows 0..n-1 of the distinct ids (sorted); False: the log's raw
            ids, unfolded, for managed-collision tables (docs/managed_collision.md; string ids: a stable 62-bit
            hash). user_index / item_index and the ranking's items stay rows either way."""

    def __init__(self, data_dir: str, split: str = "ro_811", min_rating: float | None = None,
                 side_features: bool = True, batch_size: int = 1024, eval_batch_size: int = 256,
                 num_negatives: int = 0, eval_test_in_fit: bool = False, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, num_workers: int = 0, pin_memory: bool = False,
                 columns: dict[str, str] | None = None, prefetch_factor: int | None = None,
                 persistent_workers: bool | None = None, label_columns: list[str] | dict[str, str] | None = None,
                 label_masks: dict[str, str] | None = None, hash_ids: bool = True) -> None:
        super().__init__()
        # said at construction: a misspelt operator or a mask of no task
        self.label_specs = None if label_columns is None else label_specs(label_columns, label_masks)
        # said here, not when the first loader is built
        worker_options("MovieLensDataModule", num_workers, pin_memory, prefetch_factor, persistent_workers)
        _check_args(split, min_rating, num_negatives, batch_size, eval_batch_size, columns)
        self.prefetch_factor, self.persistent_workers = prefetch_factor, persistent_workers
        # a datasets.Dataset becomes a folder holding its ratings.parquet, before the hyperparameters are saved
        given = data_dir
        data_dir = dataset_path(data_dir, "MovieLensDataModule data_dir", default_cache_dir, "ratings.parquet",
                                split_names=tuple(_SPLIT_WORDS) if split == GIVEN else (),
                                dict_hint=", or split='given' to train, validate and test on its splits as they are")
        # compared over the ranks at setup: a Dataset shuffled without a seed differs between them
        self._dataset_rows = {"data_dir": rows_digest(given)} if is_hf_dataset(given) else {}
        self.save_hyperparameters()
        self.columns = dict(columns) if columns else None
        self.data_dir = Path(data_dir)
        # here, on every rank before any process group exists; again at prepare_data and setup
        self._check_data_dir()
        self.split, self.min_rating, self.side_features = split, min_rating, side_features
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.num_negatives, self.eval_test_in_fit, self.seed = num_negatives, eval_test_in_fit, seed
        self.shuffle, self.drop_last, self.num_workers, self.pin_memory = shuffle, drop_last, num_workers, pin_memory
        self.hash_ids = hash_ids
        self.report = MovieLensReport()
        self.datasets: dict[str, Dataset] = {}
        self.ratings = None  # datasets.Dataset after setup
        self._built = False

    # reading ----------------------------------------------------------------------------------

    def _check_data_dir(self) -> None:
        if parquet_ratings(self.data_dir):
            return
        if self.data_dir.is_file():
            raise ValueError(f"MovieLens data_dir {self.data_dir} is a file, not a folder. {_OWN_FILE}")
        if not self.data_dir.is_dir():
            raise ValueError(f"MovieLens data_dir {self.data_dir} is not a folder: pass the unpacked GroupLens "
                             f"folder (download https://grouplens.org/datasets/movielens/; --data.data_dir on the "
                             f"command line)")

    def _ratings_of(self, path: Path) -> pa.Table:
        table = read_ratings(path, self.columns)
        self.report.num_ratings += table.num_rows
        if self.min_rating is not None:
            if table.schema.metadata and _NO_RATING in table.schema.metadata:
                # every interaction reads as 1.0: a threshold would keep all or none
                raise ValueError(f"min_rating={self.min_rating}: {path} has no rating column (implicit feedback: every "
                                 f"interaction counts, as 1.0), so there is nothing to threshold: leave min_rating "
                                 f"out, or name the rating column: columns={{'rating': ...}}")
            keep = np.asarray(table.column("rating")) >= self.min_rating
            table = table.filter(pa.array(keep))
        return table

    def _read_interactions(self) -> tuple[str, Path, dict[int, list[Path]] | None, pa.Table, Tensor | None]:
        """(layout, its ratings file, split="given"'s files or None, the interactions, each one's part or None)."""
        given = given_split_files(self.data_dir) if self.split == GIVEN else None
        layout, ratings_path = ("given", given[0][0]) if given else detect_layout(self.data_dir)
        self.report.layout = layout
        part_N = None
        if given:
            files, parts = zip(*[(f, p) for p in (0, 1, 2) for f in given[p]])
            tables = [self._ratings_of(f) for f in files]
            table = _concat_logs(tables, list(files), self.data_dir)
            part_N = torch.from_numpy(np.concatenate([np.full(t.num_rows, p) for t, p in zip(tables, parts)]))
        elif self.split in OFFICIAL_SPLITS:
            if layout != "ml-100k":
                raise ValueError(f"split={self.split!r} is one of ml-100k's official splits, but {self.data_dir} is "
                                 f"{layout}: use split='ro_811'")
            tables = [self._ratings_of(self.data_dir / f"{self.split}.{name}") for name in ("base", "test")]
            table = pa.concat_tables(tables)
            part_N = torch.from_numpy(np.concatenate([np.full(tables[0].num_rows, 0), np.full(tables[1].num_rows, 2)]))
        else:
            table = self._ratings_of(ratings_path)
            if self.split in TEMPORAL_SPLITS and table.schema.metadata and _NO_TIME in table.schema.metadata:
                raise ValueError(f"split={self.split!r} orders each user's interactions by time, but {ratings_path} "
                                 f"has no timestamp column: add one (user, item, rating, timestamp) or use "
                                 f"split='ro_811'")
        if table.num_rows == 0:
            raise ValueError(f"no interactions left in {ratings_path}" +
                             (f" with min_rating={self.min_rating}: lower it" if self.min_rating is not None else ""))
        return layout, ratings_path, given, table, part_N

    def _side_of(self, layout: str, given: dict | None, table: pa.Table) -> tuple[dict, dict, dict, dict]:
        """Users' and items' side features (none unless side_features), item titles, feature sizes."""
        side_layout = layout
        if given:  # split files beside GroupLens' side files (u.user / u.item, users.dat / movies.dat, movies.csv)
            side_layout = next((name for name, files in (("ml-100k", ("u.user", "u.item")),
                                                         ("ml-1m", ("users.dat", "movies.dat")))
                                if any((self.data_dir / f).is_file() for f in files)), layout)
        users, items, titles, sizes = _read_side(self.data_dir, side_layout)
        if self.side_features and not users and not items:
            warnings.warn(f"side_features=True, but {self.data_dir} has no user or item file to read them from "
                          f"(u.user / u.item, users.dat / movies.dat, movies.csv, RecBole's .user / .item): the "
                          f"towers get the id features only; side_features=False says so without this warning",
                          stacklevel=3)
        if not self.side_features:
            users, items = {}, {}  # ids only (titles still name the items in logs)
        # side files keyed as the ratings' ids are (ints or strings): keys of the other kind are no one's
        user_text, item_text = _is_text(table.column("user_id")), _is_text(table.column("item_id"))
        users = _keyed_like(users, user_text, self.data_dir, "user")
        items = _keyed_like(items, item_text, self.data_dir, "item")
        titles = _keyed_like(titles, item_text, self.data_dir, "")
        return users, items, titles, sizes

    # building ---------------------------------------------------------------------------------

    def _build(self) -> None:
        import datasets

        layout, ratings_path, given, table, part_N = self._read_interactions()
        users, items, titles, sizes = self._side_of(layout, given, table)
        self.user_ids, user_N = _indexed(table.column("user_id"), list(users))
        self.item_ids, item_N = _indexed(table.column("item_id"), list(items))
        user_N, item_N = torch.from_numpy(user_N), torch.from_numpy(item_N)
        self.num_users, self.num_items = len(self.user_ids), len(self.item_ids)
        # one interaction per (user, item): a repeat in training and test would be a target the model has seen
        time_N = np.asarray(table.column("timestamp")) if self.split in TEMPORAL_SPLITS else None
        keep_N = _first_of_pairs(user_N, item_N, self.num_items, time_N)
        if keep_N is not None:
            self.report.duplicates_dropped = table.num_rows - keep_N.shape[0]
            warnings.warn(f"{ratings_path.parent}: {self.report.duplicates_dropped} repeated (user, item) rows dropped "
                          f"(the first of each pair kept): an interaction is a (user, item) pair, and a repeat split "
                          f"into both training and test would be a target the model has seen", stacklevel=2)
            table, user_N, item_N = table.take(pa.array(keep_N)), user_N[keep_N], item_N[keep_N]
            part_N = None if part_N is None else part_N[keep_N]
        table = table.append_column("user", pa.array(user_N.numpy())).append_column("item", pa.array(item_N.numpy()))
        self.ratings = datasets.Dataset(table)  # Arrow-backed; columns read zero-copy below
        if self.label_specs is not None:
            check_label_columns(self.label_specs, table.column_names, f"MovieLensDataModule {ratings_path}")
            self.labels_NT = label_matrix(self.label_specs, lambda c: table.column(c).to_numpy(zero_copy_only=False))
        self.user_features = _feature_table("user", self.user_ids, users, ("age", "gender", "occupation", "zip"),
                                            sizes, hash_ids=self.hash_ids)
        self.item_features = _feature_table("item", self.item_ids, items, ("year",), sizes, bags=("genre",),
                                            hash_ids=self.hash_ids)
        self.item_titles = [titles.get(i) or str(i) for i in self.item_ids.tolist()]
        if part_N is None:
            time_N = torch.tensor(np.asarray(table.column("timestamp")))
            part_N = {"ro_811": lambda: ro_split(user_N, (0.8, 0.1, 0.1), self.seed),
                      "to_811": lambda: to_split(user_N, time_N, (0.8, 0.1, 0.1)),
                      "loo": lambda: loo_split(user_N, time_N)}[self.split]()
        self.part_N = part_N
        r = self.report
        r.num_interactions, r.num_users, r.num_items = table.num_rows, self.num_users, self.num_items
        # ml-100k's official splits, and given splits without a validation file: validation = test
        official = self.split in OFFICIAL_SPLITS or (given is not None and not given[1])
        self._make_datasets(user_N, item_N, part_N, official)
        self._warn_empty_splits(user_N, given is not None, official)
        if r.heldout_items_unseen_in_train["test"]:
            log.info("MovieLens %s: %d held-out test pairs are items never seen in training (still ranked)",
                     self.split, r.heldout_items_unseen_in_train["test"])
        self._built = True

    def _make_datasets(self, user_N: Tensor, item_N: Tensor, part_N: Tensor, official: bool) -> None:
        """Training pairs; validation and test users (seen items excluded); the report's split counts."""
        num_users, r = self.num_users, self.report
        csr = {p: _csr_by_user(user_N[part_N == p], item_N[part_N == p], num_users) for p in (0, 1, 2)}
        if official:
            csr[1], seen_test = csr[2], csr[0]
        else:
            tv = (part_N == 0) | (part_N == 1)
            seen_test = _csr_by_user(user_N[tv], item_N[tv], num_users)
        train = part_N == 0
        train_items = torch.zeros(self.num_items, dtype=torch.bool)
        train_items[item_N[train]] = True
        all_users = torch.arange(num_users)
        if self.label_specs is not None:
            names = [spec.task for spec in self.label_specs]
            for name, p in (("train", 0), ("val", 2 if official else 1), ("test", 2)):
                rows = part_N == p
                self.datasets[name] = LabelledRowsDataset(user_N[rows], item_N[rows], self.labels_NT[rows], names,
                                                          self.user_features, self.item_features)
        else:
            self.datasets["train"] = InteractionDataset(user_N[train], item_N[train], self.user_features,
                                                        self.item_features, self.num_items, self.num_negatives,
                                                        self.seed)
            self.datasets["val"] = UserRankingDataset(all_users, self.user_features, csr[1], csr[0])
            self.datasets["test"] = UserRankingDataset(all_users, self.user_features, csr[2], seen_test)
        for name, p in (("val", 1), ("test", 2)):
            in_part = part_N == (2 if official else p)
            r.split_sizes[name] = int(in_part.sum())
            r.heldout_items_unseen_in_train[name] = int((~train_items[item_N[in_part]]).sum())
            r.users_without_heldout[name] = int((csr[p][0].diff() == 0).sum())
        r.split_sizes["train"] = int(train.sum())

    def _warn_empty_splits(self, user_N: Tensor, given: bool, official: bool) -> None:
        """Said at setup, with the cause: the metrics can only say "NaN" at the end of the first validation."""
        r = self.report
        empty = [name for name in ("val", "test") if r.split_sizes[name] == 0]
        if not empty:
            return
        which = (f"the {' and '.join(empty)} split{'s are' if len(empty) > 1 else ' is'} empty, so "
                 f"{'its' if len(empty) == 1 else 'their'} ranking metrics will be NaN")
        if given:
            warnings.warn(f"{self.data_dir}: {which}: its file holds no interaction left after min_rating and repeated "
                          f"pairs (a pair also in an earlier split counts there)", stacklevel=3)
        else:
            warnings.warn(f"{self.data_dir}: {which}: split {self.split!r} holds a user's item out only from "
                          f"{'its .test file' if official else '3 (validation) or 2 (test)'} interactions on, and "
                          f"these {r.num_users} users have at most {int(torch.bincount(user_N).max())}", stacklevel=3)

    def prepare_data(self) -> None:
        self._check_data_dir()

    def setup(self, stage: str | None = None) -> None:
        check_same_rows(self._dataset_rows, "MovieLensDataModule")
        if not self._built:
            self._check_data_dir()
            self._build()

    # what a model needs to know ------------------------------------------------------------------

    def _need_setup(self) -> None:
        if not self._built:
            raise ValueError("MovieLensDataModule.setup() has not run: call dm.setup() (Trainer.fit does) first")

    @property
    def raw_id_features(self) -> tuple[str, ...]:
        """The features that carry the log's raw ids (hash_ids=False), which a model maps to rows."""
        return () if self.hash_ids else ("user_id", "item_id")

    @property
    def user_num_embeddings(self) -> dict[str, int]:
        self._need_setup()
        return self.user_features.num_embeddings

    @property
    def item_num_embeddings(self) -> dict[str, int]:
        self._need_setup()
        return self.item_features.num_embeddings

    def user_catalog(self, rows: Tensor | None = None) -> KeyedJaggedTensor:
        """Users' features (all, rows 0..U-1, or the given rows): what the user tower embeds."""
        self._need_setup()
        return self.user_features.kjt(torch.arange(self.num_users) if rows is None else rows.cpu())

    def item_catalog(self, rows: Tensor | None = None) -> KeyedJaggedTensor:
        """Items' features (all, rows 0..I-1, or the given rows): what a retrieval model embeds per evaluation."""
        self._need_setup()
        return self.item_features.kjt(torch.arange(self.num_items) if rows is None else rows.cpu())

    # loaders ------------------------------------------------------------------------------------

    def _loader_options(self) -> dict:
        # read at each loader (not kept from __init__): a data module's num_workers may be set after construction
        return worker_options("MovieLensDataModule", self.num_workers, self.pin_memory, self.prefetch_factor,
                              self.persistent_workers)

    def _ranking_loader(self, split: str) -> DataLoader:
        self._need_setup()
        dataset = self.datasets[split]
        if self.label_specs is not None:  # labelled rows: every row once over the ranks, in order
            return make_eval_loader(dataset, self.eval_batch_size, **self._loader_options())
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            sampler = EvalShardSampler(dataset, dist.get_world_size(), dist.get_rank())
        else:
            sampler = None
        return DataLoader(dataset, batch_size=self.eval_batch_size, sampler=sampler, shuffle=False,
                          collate_fn=passthrough_collate, **self._loader_options())

    def train_dataloader(self) -> DataLoader:
        self._need_setup()
        self.datasets["train"].epoch_in_seed = not self.shuffle  # (read here: shuffle may be set after setup)
        return make_train_loader(self.datasets["train"], self.batch_size, shuffle=self.shuffle,
                                 drop_last=self.drop_last, seed=self.seed, trainer=self.trainer,
                                 **self._loader_options())

    def val_dataloader(self):
        loaders = [self._ranking_loader(split) for split in self.eval_split_names()]
        return loaders if len(loaders) > 1 else loaders[0]

    def test_dataloader(self) -> DataLoader:
        return self._ranking_loader("test")

    def predict_dataloader(self) -> DataLoader:
        # a retrieval model's predictions: the test split's users (every user), ranked against every item
        return self._ranking_loader("test")

    def eval_split_names(self) -> list[str]:
        """The split each validation dataloader ranks, in order (what a module prefixes its metrics with)."""
        # in fit only: `validate` ranks the validation split, `test` the test split
        fitting = self.trainer is None or self.trainer.state.fn == "fit"
        return ["val", "test"] if self.eval_test_in_fit and fitting else ["val"]
