"""A Hugging Face `datasets.Dataset` object where a data module takes a path: written once, named by its fingerprint
(docs/criteo.md#a-datasetsdataset-in-python, docs/movielens.md).

    dm = CriteoDataModule(train_path=load_dataset("parquet", data_files="train-*.parquet")["train"], ...)

Data modules keep paths (saved as hyperparameters, handed to workers and ranks), so a Dataset becomes a Parquet copy
in `<cache>/hf_datasets/<fingerprint>/` (datasets' hash of the data and its transforms), written once under a lock,
aside, then renamed. A `set_transform` function is refused."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_READY = "lightning_rec_complete"  # written last inside a copy: a folder without it is not used


def is_hf_dataset(value: Any) -> bool:
    """Whether `value` is any `datasets` object (Dataset, DatasetDict, IterableDataset, IterableDatasetDict)."""
    if type(value).__module__.split(".")[0] != "datasets":  # no import of datasets for an ordinary path
        return False
    import datasets

    return isinstance(value, (datasets.Dataset, datasets.DatasetDict, datasets.IterableDataset,
                              datasets.IterableDatasetDict))


@contextlib.contextmanager
def _locked(path: Path):
    try:
        import fcntl
    except ImportError:  # no flock (Windows): ranks may write a copy each; the rename keeps one whole
        yield False
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_parquet(ds, path: str | os.PathLike, chunk_rows: int = 1 << 20, row_group_rows: int = 1 << 16) -> None:
    """`ds`'s rows, in its order, as one Parquet file of `row_group_rows`-row groups (small enough for streaming
    readers, lightning_rec.data.criteo.tables). Index mappings (`shuffle`, `select`, `sort`) are applied by Arrow,
    `chunk_rows` at a time (datasets' own writers gather 1000 rows at a time, far slower)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = ds.data.table  # the Arrow table as transformed (columns renamed or dropped), before index mappings
    indices = None if ds._indices is None else ds._indices.column(0)
    # a column per thread (Arrow releases the GIL): a random gather is bound by memory latency
    with pq.ParquetWriter(str(path), table.schema) as writer, ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for start in range(0, len(ds), chunk_rows):
            if indices is None:
                piece = table.slice(start, chunk_rows)
            else:
                rows = indices.slice(start, chunk_rows)
                piece = pa.Table.from_arrays(list(pool.map(pa.ChunkedArray.take, table.columns,
                                                           [rows] * table.num_columns)), schema=table.schema)
            writer.write_table(piece, row_group_size=row_group_rows)


def dataset_path(value: Any, what: str, cache_root: str | os.PathLike | Callable[[], Path], file_name: str,
                 split_names: Sequence[str] = (), dict_hint: str = "", streams: bool = False) -> Any:
    """`value` unchanged unless it is a `datasets` object; a Dataset: the folder holding its copy `file_name`; a
    DatasetDict whose splits are all `split_names` (else refused, with `dict_hint`): the folder of `<split>.parquet`.
    `what` names the argument in errors; `streams`: its data module can stream (said to an IterableDataset's user).
    `cache_root` may be a function, called only for a Dataset (finding datasets' cache imports it: ~1 s per rank)."""
    if not is_hf_dataset(value):
        return value
    import datasets

    cache_root = cache_root() if callable(cache_root) else cache_root

    if isinstance(value, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise ValueError(f"{what} is an {type(value).__name__} (load_dataset(..., streaming=True)), which is read only "
                         f"in order, once: pass its files instead (a Parquet file, folder or pattern such as "
                         f"'data/train-*.parquet'{', with streaming=True to read them in blocks' if streams else ''}), "
                         f"or load it without streaming=True")
    if isinstance(value, datasets.DatasetDict):
        splits = list(value)
        unknown = [k for k in splits if k not in split_names]
        if not split_names or unknown or not splits:
            example = next((k for k in ("train", "validation", "test") if k in splits), (splits or ["train"])[0])
            raise ValueError(f"{what} is a DatasetDict of the splits {splits}: pass one split, e.g. ds[{example!r}]"
                             + (f" (its splits {unknown} are none of {list(split_names)})" if split_names and unknown
                                else dict_hint))
        for split, ds in value.items():
            _refuse_transform(ds, f"{what}[{split!r}]")
        key = hashlib.sha256("".join(f"{k}={v._fingerprint};" for k, v in sorted(value.items())).encode())
        return _written(dict(value), key.hexdigest()[:16], cache_root, what)
    _refuse_transform(value, what)
    if len(value) == 0:
        # said here, of the argument: later it would be refused naming its cache copy, or, streamed, train on nothing
        raise ValueError(f"{what} is a Dataset of 0 rows (columns {value.column_names}): pass one that holds rows "
                         f"(a filter or select may have left none)")
    return _written({file_name: value}, value._fingerprint, cache_root, what)


def rows_digest(value: Any) -> str | None:
    """A digest of a Dataset's rows (length, columns, up to 256 rows), for `check_same_rows`; else None."""
    if not is_hf_dataset(value):
        return None
    import datasets

    parts = sorted(value.items()) if isinstance(value, datasets.DatasetDict) else [("", value)]
    digest = hashlib.sha256()
    for name, ds in parts:
        n = len(ds)
        rows = sorted({i * n // 256 for i in range(min(n, 256))} | {n - 1}) if n else []
        sample = ds.with_format("arrow")[rows].to_pydict() if rows else None
        digest.update(repr((name, n, ds.column_names, sample)).encode())
    return digest.hexdigest()[:16]


def check_same_rows(digests: dict[str, str], what: str) -> None:
    """At 2+ ranks, refuse Datasets (`rows_digest` of each argument given one) whose rows differ between ranks.

    Every rank builds its own Dataset, and one shuffled or split without a seed holds its rows in another order on
    each rank: each would read its share of another order. A collective, called from setup on every rank."""
    import torch.distributed as dist

    from lightning_rec import comm

    if not digests or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    gathered = comm.all_gather_object(digests)
    for name in sorted(digests):
        values = [g.get(name) if isinstance(g, dict) else None for g in gathered]
        other = next((rank for rank, v in enumerate(values) if v != values[0]), None)
        if other is not None:
            raise ValueError(
                f"{what} {name}: the Dataset given on rank {other} holds other rows (or another order) than on rank 0, "
                f"so the ranks' shares would overlap and leave rows out: each process built it, and a shuffle or split "
                f"without a seed draws another order in each. Pass a seed, ds.shuffle(seed=0), "
                f"ds.train_test_split(test_size=..., seed=0) (or call lightning.seed_everything(...) before building "
                f"it), and give every rank the whole Dataset (the data module deals the rows to the ranks itself)")


def _refuse_transform(ds, what: str) -> None:
    # a set_transform function runs only as rows are read: the copy would lack it
    if ds.format.get("type") == "custom":
        raise ValueError(f"{what} is a Dataset with a transform (with_transform / set_transform), which datasets runs "
                         f"only as rows are read, so its copy would hold the rows without it: apply it first, "
                         f"ds.map(transform, batched=True), or pass the Dataset without it")


def _written(files: dict, fingerprint: str, cache_root: str | os.PathLike, what: str) -> str:
    """The folder `<cache_root>/hf_datasets/<fingerprint>` holding each Dataset of `files`, written once."""
    files = {name if name.endswith(".parquet") else f"{name}.parquet": ds for name, ds in files.items()}
    folder = Path(cache_root) / "hf_datasets" / fingerprint
    if (folder / _READY).is_file():
        return str(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent / f"{folder.name}.lock") as exclusive:
        if (folder / _READY).is_file():  # another rank wrote it while this one waited
            return str(folder)
        if exclusive:
            # a copy is written only under this lock: any other one here was left by a killed run
            for stale in folder.parent.glob(f".{glob.escape(folder.name)}-*"):
                shutil.rmtree(stale, ignore_errors=True)
        aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            for name, ds in files.items():
                log.info("%s: writing the Dataset (%d rows, fingerprint %s) to %s", what, len(ds), ds._fingerprint,
                         folder / name)
                write_parquet(ds, aside / name)
            (aside / _READY).write_text(f"{fingerprint}\n")
            if folder.exists():  # a copy left incomplete by an interrupted run
                shutil.rmtree(folder)
            os.replace(aside, folder)
        finally:
            shutil.rmtree(aside, ignore_errors=True)
    return str(folder)
