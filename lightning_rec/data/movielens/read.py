"""Finding the ratings in `data_dir` (a GroupLens folder, RecBole's atomic files, your own ratings.csv / .parquet, a
Parquet file or pattern, or split="given"'s files) and reading them as one Arrow table."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa

from lightning_rec.data.criteo.tables import glob_files
from lightning_rec.data.movielens.columns import _NO_TIME
from lightning_rec.data.movielens.parquet import _read_ratings_parquet
from lightning_rec.data.movielens.splits import _SPLIT_WORDS
from lightning_rec.data.movielens.text import _read_ratings_text

_LOG_SUFFIXES = (".csv", ".tsv", ".txt", ".parquet")
_COMPRESSED = (".gz", ".bz2", ".zst")  # the suffixes a ratings file may add (read as the Criteo readers detect them)
_OWN_FILE = ("Your own interactions: save them as <folder>/ratings.csv with the header user,item[,rating][,timestamp] "
             "(integer or string ids; no rating: implicit feedback, 1.0), or as <folder>/ratings.parquet with "
             "columns user, item[, rating][, timestamp], and pass the folder (or pass a .parquet file or pattern "
             "itself)")


def parquet_ratings(path: Path) -> list[Path]:
    """The Parquet files that `path` itself names (a .parquet file, or a pattern such as data/train-*.parquet)."""
    if path.is_file():
        return [path] if path.suffix == ".parquet" else []
    return [f for f in glob_files(path) if f.suffix == ".parquet"]


def read_ratings(path: str | Path, columns: dict[str, str] | None = None) -> pa.Table:
    """A ratings file (any GroupLens layout, a Parquet log or pattern) -> Arrow table user_id, item_id, rating, time."""
    path = Path(path)
    pieces = parquet_ratings(path)
    if len(pieces) > 1 or (pieces and pieces[0] != path):
        return _concat_logs([_read_ratings_parquet(f, columns) for f in pieces], pieces, path)
    if not path.is_file():
        raise ValueError(f"ratings file {path} does not exist" + (" (it is a directory)" if path.is_dir() else ""))
    if path.suffix == ".parquet":
        return _read_ratings_parquet(path, columns)
    return _read_ratings_text(path, columns)


def given_split_files(data_dir: Path) -> dict[int, list[Path]]:
    """split="given": part (0 train, 1 validation, 2 test) -> its files in data_dir, in name order. A file belongs
    to the split a word of its name says (words between . _ - and spaces); other files are left alone."""
    if not data_dir.is_dir():
        raise ValueError(f"split='given' reads a folder of split files (train / valid / test), but {data_dir} is "
                         f"not a folder")
    parts: dict[int, list[Path]] = {0: [], 1: [], 2: []}
    for f in sorted(data_dir.iterdir()):
        suffixes = [x.lower() for x in f.suffixes]
        if suffixes and suffixes[-1] in _COMPRESSED and suffixes[-2:-1] != [".parquet"]:
            suffixes = suffixes[:-1]  # train.csv.gz: read decompressed, as the ratings files are
        if not f.is_file() or not suffixes or suffixes[-1] not in _LOG_SUFFIXES:
            continue
        said = {_SPLIT_WORDS[w] for w in re.split(r"[._\-\s]+", f.stem.lower()) if w in _SPLIT_WORDS}
        if len(said) > 1:
            raise ValueError(f"{f}: its name says more than one split (train / valid / test): rename it")
        if said:
            parts[said.pop()].append(f)
    if not parts[0] or not parts[2]:
        found = [f.name for f in sorted(data_dir.iterdir()) if f.is_file()][:10]
        raise ValueError(f"split='given' needs a train and a test file in {data_dir} (named by a word of their names: "
                         f"train, valid / validation / val / dev, test; .csv with a header (or .csv.gz), or .parquet), "
                         f"found "
                         f"{found or 'no files'}{' (no train file)' if not parts[0] else ''}"
                         f"{' (no test file)' if not parts[2] else ''}")
    return parts


def _concat_logs(tables: list[pa.Table], files: list[Path], what: Path) -> pa.Table:
    """Several files' ratings tables as one (a Parquet log's pieces, or split="given"'s files): ids that are integers
    in one file and strings in another become strings; some files with a timestamp and some without are refused."""
    if len({_NO_TIME in (t.schema.metadata or {}) for t in tables}) > 1:
        have = [f.name for f, t in zip(files, tables) if _NO_TIME not in (t.schema.metadata or {})]
        raise ValueError(f"{what}: only {have} of its files have a timestamp column: give all of them one, or none")
    for name in ("user_id", "item_id", "timestamp", "rating"):
        if len({t.schema.field(name).type for t in tables}) > 1:
            to = pa.string() if name in ("user_id", "item_id") else pa.float64()
            tables = [t.set_column(t.schema.get_field_index(name), name, t.column(name).cast(to)) for t in tables]
    return pa.concat_tables([t.replace_schema_metadata(tables[0].schema.metadata) for t in tables])


def detect_layout(data_dir: Path) -> tuple[str, Path]:
    """(layout, its ratings file): ml-100k, ml-1m, ml-20m (a ratings.csv), parquet or recbole."""
    if parquet_ratings(data_dir):  # data_dir names the Parquet log itself (a Hub dataset's file, or a pattern)
        return "parquet", data_dir
    for layout, name in (("ml-100k", "u.data"), ("ml-1m", "ratings.dat"), ("ml-20m", "ratings.csv"),
                         ("parquet", "ratings.parquet")):
        for suffix in ("",) + (_COMPRESSED if layout != "parquet" else ()):  # ratings.csv.gz: read decompressed
            if (data_dir / (name + suffix)).is_file():
                return layout, data_dir / (name + suffix)
    inter = sorted(data_dir.glob("*.inter"))  # RecBole's atomic files (its dataset downloads): ml-100k.inter
    if len(inter) == 1:
        return "recbole", inter[0]
    if inter:
        raise ValueError(f"{data_dir} holds several RecBole .inter files ({', '.join(p.name for p in inter)}): "
                         f"keep one per folder")
    raise ValueError(f"{data_dir} holds no GroupLens ratings file: expected u.data (ml-100k), ratings.dat "
                     f"(ml-1m, ml-10m), ratings.csv (ml-20m, ml-25m, ml-latest), each optionally compressed "
                     f"(.gz, .bz2, .zst), or RecBole's <name>.inter; pass the unpacked folder as data_dir. {_OWN_FILE}")
