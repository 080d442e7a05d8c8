"""`TableDataModule`: labelled rows of a table (Parquet, CSV or a `datasets.Dataset`), several labels per row.

Each named categorical column becomes one sparse feature (its text hashed into `num_embeddings` buckets, the same
id on every run and rank), each numeric column one dense feature (standardised by the training split's mean and
spread, missing values 0), and `label_columns` the labels [B, T] (see lightning_rec.data.labels)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import Dataset

from lightning_rec.data.batch import Batch, make_eval_loader, make_train_loader, worker_options
from lightning_rec.data.labels import check_label_columns, label_matrix, label_specs
from lightning_rec.sparse import KeyedJaggedTensor


def read_table(source, column_names: Sequence[str] | None = None, delimiter: str = ",") -> pa.Table:
    """A Parquet file, a CSV file (header-less when `column_names` is given) or a datasets.Dataset -> Arrow."""
    if hasattr(source, "data") and hasattr(source, "column_names"):  # a datasets.Dataset
        return source.data.table if hasattr(source.data, "table") else pa.table(source.data)
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"TableDataModule: {path} is not a file: give a Parquet or CSV file (or a datasets.Dataset)")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path)
    import pyarrow.csv as pcsv

    read = pcsv.ReadOptions(column_names=list(column_names) if column_names else None)
    return pcsv.read_csv(path, read_options=read, parse_options=pcsv.ParseOptions(delimiter=delimiter),
                         convert_options=pcsv.ConvertOptions(strings_can_be_null=False))


def hashed_ids(column: pa.ChunkedArray, num_embeddings: int) -> np.ndarray:
    """Each value's stable bucket in [0, num_embeddings) (crc32 of its stripped text; a null -> 0)."""
    values = np.array([None if v is None else str(v).strip() for v in column.to_pylist()], dtype=object)
    uniq, inverse = np.unique(values.astype(str), return_inverse=True)
    buckets = np.array([zlib.crc32(u.encode()) % num_embeddings for u in uniq], dtype=np.int64)
    return buckets[inverse]


class TableRowsDataset(Dataset):
    """Rows (sparse ids [N, F], dense [N, I], labels [N, T]) -> one Batch per index list (-1: padding, dropped)."""

    def __init__(self, sparse_NF: torch.Tensor, dense_NI: torch.Tensor, labels_NT: torch.Tensor,
                 feature_names: Sequence[str], task_names: Sequence[str]) -> None:
        self.sparse_NF, self.dense_NI, self.labels_NT = sparse_NF, dense_NI, labels_NT
        self.feature_names, self.task_names = list(feature_names), tuple(task_names)

    def __len__(self) -> int:
        return self.labels_NT.shape[0]

    def __getitems__(self, indices: Sequence[int]) -> Batch:
        idx_B = torch.as_tensor(indices, dtype=torch.int64)
        idx_B = idx_B[idx_B >= 0]
        B, F = idx_B.shape[0], self.sparse_NF.shape[1]
        kjt = KeyedJaggedTensor.from_lengths_sync(self.feature_names, self.sparse_NF[idx_B].t().reshape(-1),
                                                  torch.ones(F * B, dtype=torch.int64), stride=B)
        return Batch(dense_features=self.dense_NI[idx_B], sparse_features=kjt, labels=self.labels_NT[idx_B],
                     task_names=self.task_names)

    def __getitem__(self, index):
        return self.__getitems__([index] if isinstance(index, int) else index)


class TableDataModule(pl.LightningDataModule):
    """Labelled rows of tables: training, validation and test each a Parquet / CSV file or a datasets.Dataset.

    Args:
        train_path, val_path, test_path: the splits (test_path None: the validation split).
        label_columns: the tasks: a list of columns or {task: "column" | "column OP value"} (docs/multitask.md).
        sparse_columns: categorical columns, one sparse feature each (named as the column).
        dense_columns: numeric columns, the dense features in this order.
        num_embeddings: hash buckets of every sparse feature (the model's rows per table).
        label_masks: {task: column}: rows where it is 0 / null have no label for the task.
        column_names: a header-less CSV's column names.
        delimiter: the CSV's separator.
        batch_size, eval_batch_size, shuffle, drop_last, seed, num_workers, pin_memory: the loaders'."""

    def __init__(self, train_path, val_path, label_columns: list[str] | dict[str, str], sparse_columns: list[str],
                 dense_columns: list[str] | None = None, test_path=None, num_embeddings: int = 10_000,
                 label_masks: dict[str, str] | None = None, column_names: list[str] | None = None,
                 delimiter: str = ",", batch_size: int = 1024, eval_batch_size: int = 4096, shuffle: bool = True,
                 drop_last: bool = False, seed: int = 0, num_workers: int = 0, pin_memory: bool = False) -> None:
        super().__init__()
        worker_options("TableDataModule", num_workers, pin_memory)
        self.label_specs = label_specs(label_columns, label_masks)
        self.paths = {"train": train_path, "val": val_path, "test": test_path if test_path is not None else val_path}
        self.sparse_columns, self.dense_columns = list(sparse_columns), list(dense_columns or [])
        self.num_embeddings, self.column_names, self.delimiter = int(num_embeddings), column_names, delimiter
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.shuffle, self.drop_last = shuffle, drop_last
        self.seed, self.num_workers, self.pin_memory = seed, num_workers, pin_memory
        self.datasets: dict[str, TableRowsDataset] = {}

    @property
    def task_names(self) -> list[str]:
        return [spec.task for spec in self.label_specs]

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        stats = None
        for split in ("train", "val", "test"):
            table = read_table(self.paths[split], self.column_names, self.delimiter)
            where = f"TableDataModule {split} ({self.paths[split]})"
            check_label_columns(self.label_specs, table.column_names, where)
            missing = [c for c in self.sparse_columns + self.dense_columns if c not in table.column_names]
            if missing:
                raise ValueError(f"{where}: feature columns {missing} are not there: its columns are "
                                 f"{table.column_names}; fix sparse_columns / dense_columns")
            labels = label_matrix(self.label_specs, lambda c, t=table: t.column(c).to_numpy(zero_copy_only=False))
            sparse = np.stack([hashed_ids(table.column(c), self.num_embeddings) for c in self.sparse_columns], 1)
            dense = np.stack([np.nan_to_num(table.column(c).to_numpy(zero_copy_only=False).astype(np.float64))
                              for c in self.dense_columns], 1) if self.dense_columns else np.zeros((table.num_rows, 0))
            if stats is None:  # the training split's
                stats = dense.mean(0), dense.std(0) + 1e-8
            dense = (dense - stats[0]) / stats[1]
            self.datasets[split] = TableRowsDataset(torch.from_numpy(sparse), torch.from_numpy(dense).float(), labels,
                                                    self.sparse_columns, self.task_names)

    def train_dataloader(self):
        return make_train_loader(self.datasets["train"], self.batch_size, shuffle=self.shuffle,
                                 drop_last=self.drop_last, seed=self.seed, num_workers=self.num_workers,
                                 pin_memory=self.pin_memory, trainer=self.trainer)

    def val_dataloader(self):
        return make_eval_loader(self.datasets["val"], self.eval_batch_size, self.num_workers, self.pin_memory)

    def test_dataloader(self):
        return make_eval_loader(self.datasets["test"], self.eval_batch_size, self.num_workers, self.pin_memory)
