"""A Hugging Face `datasets.Dataset` object where a data module takes a path: written once, named by its fingerprint.

    dm = CriteoDataModule(train_path=load_dataset("parquet", data_files="train-*.parquet")["train"], ...)
    dm = MovieLensDataModule(ds.filter(lambda r: r["rating"] >= 3), columns={"item": "parent_asin"})

Data modules keep paths: their arguments are saved as hyperparameters in checkpoints (read back with
`weights_only=True`, which loads no Dataset object) and their sources are handed to loader workers and to the
other ranks. So a Dataset becomes the path of a copy written once under
`<cache>/hf_datasets/<fingerprint><suffix>`: `save_to_disk` for Criteo (a table source, cached or streamed as
any other), `to_parquet` for MovieLens (the folder's `ratings.parquet`). The fingerprint is datasets' own hash
of the data and of every transform applied to it (`map`, `filter`, `shuffle`, `select`, ...), so the same Dataset
built again, by another rank or the next run, finds its copy instead of writing another. Pending index mappings
(`shuffle`, `select`) are applied in the copy, in their order. A process that writes holds a lock beside the
folder while the others wait, and the copy appears whole or not at all (written aside, then renamed).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

_READY = "lightning_rec_complete"  # written last inside a copy: a folder without it is not used


def _dataset_types():
    import datasets

    return datasets.Dataset, (datasets.DatasetDict, datasets.IterableDatasetDict), datasets.IterableDataset


def is_hf_dataset(value: Any) -> bool:
    """Whether `value` is any `datasets` object (Dataset, DatasetDict, IterableDataset, IterableDatasetDict)."""
    if type(value).__module__.split(".")[0] != "datasets":  # no import of datasets for an ordinary path
        return False
    dataset, dicts, iterable = _dataset_types()
    return isinstance(value, (dataset, iterable, *dicts))


@contextlib.contextmanager
def _locked(path: Path):
    try:
        import fcntl
    except ImportError:  # no flock (Windows): ranks may write a copy each; the rename keeps one whole
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def dataset_path(value: Any, what: str, cache_root: str | os.PathLike, form: str) -> Any:
    """`value` unchanged unless it is a `datasets` object; a Dataset: the path of its copy in `form`
    ("saved_dataset": a save_to_disk folder; "ratings_parquet": a folder holding ratings.parquet).

    `what` names the argument in errors ("CriteoDataModule train_path")."""
    if not is_hf_dataset(value):
        return value
    dataset, dicts, iterable = _dataset_types()
    if isinstance(value, dicts):
        splits = list(value)
        example = next((s for s in ("train", "validation", "test") if s in splits), splits[0] if splits else "train")
        raise ValueError(f"{what} is a {type(value).__name__} of the splits {splits}: pass one split, e.g. "
                         f"ds[{example!r}]")
    if isinstance(value, iterable):
        raise ValueError(f"{what} is an IterableDataset (load_dataset(..., streaming=True)), which is read only in "
                         f"order, once: pass its files instead (a Parquet file, folder or pattern such as "
                         f"'data/train-*.parquet', with streaming=True to read them in blocks), or load it without "
                         f"streaming=True")
    if form not in ("saved_dataset", "ratings_parquet"):
        raise ValueError(f"unknown form {form!r}")
    folder = Path(cache_root) / "hf_datasets" / f"{value._fingerprint}-{form}"
    if (folder / _READY).is_file():
        return str(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent / f"{folder.name}.lock"):
        if (folder / _READY).is_file():  # another rank wrote it while this one waited
            return str(folder)
        aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            if form == "saved_dataset":
                shutil.rmtree(aside)  # save_to_disk makes its own folder
                value.save_to_disk(str(aside))
            else:
                value.to_parquet(str(aside / "ratings.parquet"))
            (aside / _READY).write_text(f"{value._fingerprint}\n")
            if folder.exists():  # a copy left incomplete by an interrupted run
                shutil.rmtree(folder)
            os.replace(aside, folder)
        finally:
            shutil.rmtree(aside, ignore_errors=True)
    return str(folder)
