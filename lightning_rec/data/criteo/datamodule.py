"""`CriteoDataModule`: Criteo text files, tables or preprocessed shard directories as a LightningDataModule."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_rec.data.batch import (
    follow_fit_loop,
    make_eval_loader,
    make_stream_loader,
    make_train_loader,
    worker_options,
)
from lightning_rec.data.criteo.cache import build_criteo_cache, default_cache_dir
from lightning_rec.data.criteo.datasets import CriteoDataset, CriteoIterableDataset
from lightning_rec.data.criteo.layout import check_criteo_file
from lightning_rec.data.criteo.parse import CriteoReadOptions
from lightning_rec.data.criteo.report import ParseReport
from lightning_rec.data.criteo.schema import (
    NUM_DENSE_FEATURES,
    NUM_SPARSE_FEATURES,
    check_missing_categorical,
    feature_names,
    resolve_num_embeddings,
)
from lightning_rec.data.criteo.shards import CriteoShardDataset, check_shard_tasks, is_shard_dir, load_manifest
from lightning_rec.data.criteo.tables import source_files, table_has_label, table_source_kind
from lightning_rec.data.hf_dataset import check_same_rows, dataset_path, is_hf_dataset, rows_digest
from lightning_rec.errors import is_int

_STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}


class CriteoDataModule(pl.LightningDataModule):
    """Criteo click logs (Kaggle CSV, dac train.txt / day files, DeepCTR sample) as `Batch`es (docs/criteo.md).

    Each file is parsed once into a memory-mapped Arrow cache (`prepare_data`), or with `streaming=True` while
    iterating. A path may also be a table, a `datasets.Dataset` or a `lightning-rec preprocess` directory.

    Args:
        train_path: the training data: a Criteo text file, a table, or a `lightning-rec preprocess` directory.
        val_path: the validation data, in the same forms (None: no validation).
        test_path: the data `test` scores (labelled).
        predict_path: the data `predict` scores, labelled or not (None: test_path).
        batch_size: rows per training batch (per rank).
        val_batch_size: rows per evaluation and predict batch (None: batch_size).
        num_embeddings_per_feature: table rows, one int for all features or one per feature (the model's).
        sparse_feature_names: the KJT keys (None: C1..C26).
        missing_categorical: "reserved_id" (id 0 of each table means missing) or "empty_bag" (an empty bag).
        cache_dir: where the memory-mapped Arrow cache goes (None: under datasets' cache, HF_DATASETS_CACHE).
        streaming: parse the files while iterating, without a cache (for files too big to cache).
        num_workers: DataLoader worker processes (0: load in the main process).
        pin_memory: pin batches in host memory for the copy to a GPU.
        shuffle: shuffle the training rows each epoch (streaming: within blocks of block_bytes).
        seed: the shuffle's seed.
        drop_last: drop the last, smaller training batch.
        on_bad_row: "error" (stop, naming file, line and field) or "skip" (leave the row out, logged).
        separator: "\t" or "," (or the words "tab" / "comma"; None: detected from the file).
        has_header: whether the first line is a header (None: detected).
        has_label: whether rows carry a label (None: detected from the field count or columns).
        block_bytes: bytes read and parsed at a time when streaming (and the shuffle's block).
        parser: "auto" (the native op when built), "native" or "python" (the reference).
        prefetch_factor: batches each worker loads ahead (None: torch's default).
        persistent_workers: keep the workers between epochs (None: whenever there are any).
        hash_ids: fold ids into the tables (`1 + v % (n - 1)`); False: raw 32-bit ids, unfolded, for
            managed-collision tables (docs/managed_collision.md).
        label_columns: several labels (docs/multitask.md): a list of columns or {task: "column" | "column OP value"};
            batches carry labels [B, T] and task_names. A header names the columns; in a header-less text file the
            leading fields are the columns they read, in order (["click", "purchase"]: fields 1 and 2, then I1..C26).
            Values are any number, an empty field / null / NaN a missing label. A directory of `lightning-rec
            preprocess --label_columns` holds its tasks' labels: pass the same label_columns (and label_masks).
        label_masks: {task: column}: rows where that column is 0 / empty have no label for the task."""

    def __init__(self, train_path: str | None = None, val_path: str | None = None, test_path: str | None = None,
                 predict_path: str | None = None, batch_size: int = 2048, val_batch_size: int | None = None,
                 num_embeddings_per_feature: int | list[int] = 100_000, sparse_feature_names: list[str] | None = None,
                 missing_categorical: str = "reserved_id", cache_dir: str | None = None, streaming: bool = False,
                 num_workers: int = 0, pin_memory: bool = False, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, on_bad_row: str = "error", separator: str | None = None,
                 has_header: bool | None = None, has_label: bool | None = None, block_bytes: int = 64 << 20,
                 parser: str = "auto", prefetch_factor: int | None = None,
                 persistent_workers: bool | None = None, hash_ids: bool = True,
                 label_columns: list[str] | dict[str, str] | None = None,
                 label_masks: dict[str, str] | None = None) -> None:
        super().__init__()
        self.hash_ids = hash_ids
        # said here, not when the first loader is built
        worker_options("CriteoDataModule", num_workers, pin_memory, prefetch_factor, persistent_workers)
        self.prefetch_factor, self.persistent_workers = prefetch_factor, persistent_workers
        self.read_options = CriteoReadOptions(separator, has_header, has_label, on_bad_row, block_bytes, parser,
                                              label_columns, label_masks)
        self.label_specs = self.read_options.specs or None  # the tasks (MultiTaskModule checks its own against them)
        check_missing_categorical(missing_categorical)
        # a datasets.Dataset becomes the path of its Parquet copy, before the hyperparameters are saved
        root = cache_dir or default_cache_dir()
        given = {"train_path": train_path, "val_path": val_path, "test_path": test_path, "predict_path": predict_path}
        train_path, val_path, test_path, predict_path = (
            dataset_path(p, f"CriteoDataModule {n}", root, "data.parquet", streams=True) for n, p in given.items())
        # compared over the ranks at setup: a Dataset shuffled without a seed differs between them
        self._dataset_rows = {n: rows_digest(p) for n, p in given.items() if is_hf_dataset(p)}
        self.save_hyperparameters()
        self.paths = {"train": train_path, "val": val_path, "test": test_path, "predict": predict_path or test_path}
        _check_batch_size("batch_size", batch_size)
        _check_batch_size("val_batch_size", val_batch_size)
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.num_embeddings_per_feature = resolve_num_embeddings(num_embeddings_per_feature, NUM_SPARSE_FEATURES)
        self.sparse_feature_names = feature_names(sparse_feature_names)
        self.num_dense_features = NUM_DENSE_FEATURES
        self.missing_categorical = missing_categorical
        self.cache_dir = cache_dir
        self.streaming = streaming
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.datasets: dict[str, Dataset] = {}
        self.parse_reports: dict[str, ParseReport] = {}

    @property
    def num_skipped_rows(self) -> int:
        """Bad rows dropped under on_bad_row='skip', over all files parsed so far (map-style)."""
        return sum(r.num_skipped_rows for r in self.parse_reports.values())

    def _cache(self, split: str) -> Path:
        arrow_path, report = build_criteo_cache(self.paths[split], self.cache_dir, **self.read_options.kwargs())
        self.parse_reports[split] = report
        return arrow_path

    def _check_labelled(self, split: str) -> None:
        """Training / validation on an unlabelled file would give NaN labels and NaN loss: refuse it."""
        path = self.paths[split]
        if split not in ("train", "val", "test") or path is None:
            return
        if is_shard_dir(path):
            labelled = load_manifest(path)["has_label"]
        elif table_source_kind(path):
            labelled = table_has_label(path, self.read_options.has_label, self.read_options.specs)
        else:
            labelled = self.read_options.layout(path).has_label
        if not labelled:
            raise ValueError(
                f"{split}_path {path} has no label column (the Kaggle test layout: 39 fields, or a header without "
                f"Label): {split} needs labelled rows. Pass a labelled file (train.txt, a day file, train.csv), "
                f"and give unlabelled files as predict_path"
            )

    def _splits_of(self, stage: str | None, check: bool = True) -> tuple[str, ...]:
        """The splits a Trainer stage reads (every split given outside a Trainer). `check`: a split the stage needs but
        has no path for is an error naming the option (raised by setup, which runs on every rank)."""
        if stage is None:
            return tuple(s for s, p in self.paths.items() if p is not None)
        stage = getattr(stage, "value", stage)  # Lightning passes a TrainerFn (a str enum)
        needed = {"fit": "train", "validate": "val", "test": "test", "predict": "predict"}.get(stage)
        if check and needed is not None and self.paths[needed] is None:
            what = {"predict": "the rows to predict, labelled or not; default: test_path"}.get(
                needed, f"labelled rows to {stage} on")
            raise ValueError(f"CriteoDataModule has no {needed}_path, which {stage} needs: set --data.{needed}_path="
                             f"FILE ({what})")
        return tuple(s for s in _STAGE_SPLITS.get(stage, tuple(self.paths)) if self.paths[s] is not None)

    def check_paths(self, stage: str) -> None:
        """A clear ValueError for a file `stage` reads that does not exist (called before any process group)."""
        for split in self._splits_of(stage):
            if table_source_kind(self.paths[split]):
                source_files(self.paths[split])  # a folder of several splits' files is refused here, before any rank
            elif not is_shard_dir(self.paths[split]):
                check_criteo_file(self.paths[split], what=f"CriteoDataModule {split}_path",
                                  fix=f"check the path (--data.{split}_path on the command line)")

    def prepare_data(self) -> None:
        # Lightning's prepare_data has no stage argument: the attached Trainer's state names it
        trainer = self.trainer
        stage = trainer.state.fn.value if trainer is not None and trainer.state.fn is not None else None
        splits = self._splits_of(stage, check=False)
        for split in ("train", "val"):  # (test_dataloader checks test: an unlabelled test_path may be predicted)
            if split in splits:
                self._check_labelled(split)
        if self.streaming:
            return
        for split in splits:
            if not is_shard_dir(self.paths[split]):
                self._cache(split)

    def _check_same_ids(self, splits: Sequence[str]) -> None:
        """The splits a stage reads must map a value to the same table row: a preprocessed directory's ids are hashed
        by its --missing_categorical or mapped through a vocabulary; a text or table file's by `missing_categorical`."""
        maps = {}
        for split in splits:
            path = self.paths[split]
            if not is_shard_dir(path):
                maps[split] = ("hashed", self.missing_categorical)
                continue
            manifest = load_manifest(path)
            options = manifest.get("options", {})
            vocabulary = options.get("min_frequency") or options.get("vocab_from")
            maps[split] = ("vocabulary", None) if vocabulary else ("hashed", manifest["missing_categorical"])
        if len(set(maps.values())) < 2:
            return
        order = sorted(maps, key=lambda split: not is_shard_dir(self.paths[split]))  # a directory first: it is fixed
        a = order[0]
        b = next(split for split in order if maps[split] != maps[a])
        if "vocabulary" in (maps[a][0], maps[b][0]):
            vocab, other = (a, b) if maps[a][0] == "vocabulary" else (b, a)
            raise ValueError(
                f"{vocab}_path {self.paths[vocab]} holds ids through a vocabulary (preprocessed with --min_frequency "
                f"or --vocab_from), but the ids of {other}_path {self.paths[other]} are hashed: the same value is "
                f"another table row there. Preprocess that split with the vocabulary, `lightning-rec preprocess "
                f"--input ... --output_dir DIR --vocab_from <the train split's directory>` (the train split's "
                f"--num_embeddings), and pass DIR")
        fix = ("preprocess both with one --missing_categorical" if is_shard_dir(self.paths[b]) else
               f"set data.missing_categorical={maps[a][1]} (a preprocessed directory keeps the one it was made with)")
        raise ValueError(
            f"{a}_path {self.paths[a]} holds ids of --missing_categorical {maps[a][1]}, but {b}_path {self.paths[b]} "
            f"{'holds them of' if is_shard_dir(self.paths[b]) else 'is hashed with'} {maps[b][1]}: the same value is "
            f"another table row there. {fix[0].upper() + fix[1:]}")

    def setup(self, stage: str | None = None) -> None:
        self._check_same_ids(self._splits_of(stage))
        check_same_rows(self._dataset_rows, "CriteoDataModule")
        for split in self._splits_of(stage):
            if split in self.datasets:
                continue
            if split in ("train", "val"):
                self._check_labelled(split)
            if is_shard_dir(self.paths[split]):
                check_shard_tasks(self.paths[split], load_manifest(self.paths[split]), self.label_specs,
                                  "CriteoDataModule")
                if not self.hash_ids:
                    raise ValueError(f"CriteoDataModule(hash_ids=False): {self.paths[split]} is preprocessed, its "
                                     f"ids already folded into the tables: give the text or table files instead")
                dataset = CriteoShardDataset(
                    self.paths[split], self.batch_size if split == "train" else self.val_batch_size,
                    self.sparse_feature_names, shuffle=self.shuffle and split == "train", seed=self.seed,
                    drop_last=self.drop_last and split == "train", every_row=split != "train",
                )
                if dataset.num_embeddings_per_feature != self.num_embeddings_per_feature:
                    raise ValueError(
                        f"{self.paths[split]} was preprocessed for num_embeddings_per_feature="
                        f"{dataset.num_embeddings_per_feature}, but data.num_embeddings_per_feature is "
                        f"{self.num_embeddings_per_feature}: set the data and model num_embeddings_per_feature "
                        f"to the directory's (manifest.json), or preprocess again"
                    )
                if split == "predict" and dataset.manifest["options"].get("shuffle_rows"):
                    rank_zero_warn(f"{self.paths[split]}: preprocess shuffled the rows within each shard, so the "
                                   f"predictions' row column counts the directory's order, not the input file's; "
                                   f"to predict in the input's order, preprocess it again with --no_shuffle_rows",
                                   category=UserWarning)
                self.datasets[split] = dataset
            elif self.streaming:
                self.datasets[split] = CriteoIterableDataset(
                    self.paths[split], self.batch_size if split == "train" else self.val_batch_size,
                    self.num_embeddings_per_feature, self.sparse_feature_names, self.missing_categorical,
                    shuffle=self.shuffle and split == "train", seed=self.seed,
                    drop_last=self.drop_last and split == "train", row_ids=split == "predict", hash_ids=self.hash_ids,
                    **self.read_options.kwargs(block_bytes=min(self.read_options.block_bytes, 16 << 20)),
                )
            else:
                self.datasets[split] = CriteoDataset(
                    self._cache(split), self.num_embeddings_per_feature, self.sparse_feature_names,
                    self.missing_categorical, self.hash_ids, self.read_options.task_names,
                )

    def _loader_options(self) -> dict:
        # read at each loader (not kept from __init__): a data module's num_workers may be set after construction
        return worker_options("CriteoDataModule", self.num_workers, self.pin_memory, self.prefetch_factor,
                              self.persistent_workers)

    def _loader(self, split: str) -> DataLoader:
        if self.paths[split] is None:
            raise ValueError(f"CriteoDataModule has no {split}_path: set it to use the {split} loop")
        if split not in self.datasets:
            raise ValueError(f"CriteoDataModule.setup() has not run for {split}: call setup() first")
        dataset = self.datasets[split]
        train = split == "train"
        if isinstance(dataset, IterableDataset):
            loader = make_stream_loader(dataset, **self._loader_options())
            return follow_fit_loop(loader, self.trainer) if train else loader
        if not train:  # every row once at any world size (not torch's DistributedSampler: it repeats rows)
            return make_eval_loader(dataset, self.val_batch_size, **self._loader_options())
        return make_train_loader(dataset, self.batch_size, shuffle=self.shuffle, drop_last=self.drop_last,
                                 seed=self.seed, trainer=self.trainer, **self._loader_options())

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader | list:
        # no val_path: an empty list tells Lightning there is no validation loop
        return self._loader("val") if self.paths["val"] is not None else []

    def test_dataloader(self) -> DataLoader:
        self._check_labelled("test")  # the test loop computes loss and metrics from labels
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")


def _check_batch_size(name: str, value: int | None) -> None:
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"CriteoDataModule {name}={value!r}: give a positive number of samples per batch")
