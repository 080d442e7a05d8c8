"""Criteo rows that are already tables: Parquet files, folders or patterns of them, and `datasets` save_to_disk
folders (docs/criteo.md#parquet-and-hugging-face-datasets).

Shapes: N rows of a record batch, F = 26 sparse features (C1..C26), 13 dense features (I1..I13).

Columns are found by name (case ignored); the values become the cache's raw values, so a table and the text
file it came from give the same batches:
    label   0/1 as any integer, float or bool type (null or another value: a bad row); or, with `label_specs`
            (label_columns), the columns they name, any number (null or NaN: missing), [N, T]
    I1..13  any number type (null or NaN: missing); strings as in text files ("": missing)
    C1..26  8-hex-character strings as in text files (null or "": missing), integer ids >= 0 (null: missing),
            or floats holding whole numbers (NaN: missing); ids are hashed as text hashes are
    I, C    a column of nulls only (Arrow's null type): missing in every row
Bad rows follow `on_bad_row` as in text files, named by file and row (0-based, within that file). A table is
cached (`read_criteo_table`), streamed in blocks of rows read by index (`TableBlocks`), or cut into shards."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from lightning_rec.data.criteo.parse import decode_hex, strings_to_float, to_table
from lightning_rec.data.criteo.report import ParseReport, minus_one_label_fix, raise_or_record
from lightning_rec.data.criteo.schema import NUM_DENSE_FEATURES, NUM_SPARSE_FEATURES, check_on_bad_row
from lightning_rec.data.labels import LabelSpec, check_label_columns, label_matrix, source_columns

_PARQUET_MAGIC = b"PAR1"
_SPLIT_FILE = re.compile(r"^(.+?)-\d+-of-\d+")  # the Hub's shard names: <split>-00000-of-00004[-hash].parquet
_SAVED_DATASET = ("dataset_info.json", "state.json")  # what datasets' save_to_disk writes beside its .arrow files
TABLE_SOURCE_VERSION = 1  # part of the cache key: bumped when the conversion below changes its output


def _is_parquet_file(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == _PARQUET_MAGIC
    except OSError:
        return False


def glob_files(path: str | os.PathLike) -> list[Path]:
    """The files a pattern such as `data/train-*.parquet` names (none for a path without * ? [)."""
    text = os.fspath(path)
    if not any(c in text for c in "*?[") or os.path.exists(text):
        return []
    return sorted(Path(m) for m in glob.glob(text) if os.path.isfile(m))


def table_source_kind(path: str | os.PathLike | None) -> str | None:
    """"parquet" (a file, a folder or a pattern of them), "saved_dataset" (save_to_disk), or None."""
    if path is None:
        return None
    matches = glob_files(path)
    if matches:
        return "parquet" if all(_is_parquet_file(m) for m in matches) else None
    p = Path(path)
    if p.is_file():
        return "parquet" if _is_parquet_file(p) else None
    if p.is_dir():
        if all((p / name).is_file() for name in _SAVED_DATASET) or (p / "dataset_dict.json").is_file():
            return "saved_dataset"
        if any(p.glob("*.parquet")):
            return "parquet"
    return None


def source_files(path: str | os.PathLike) -> list[Path]:
    """The files a table source reads, in order (what its cache key covers)."""
    p = Path(path)
    kind = table_source_kind(p)
    if kind == "saved_dataset":
        return sorted(f for f in p.iterdir() if f.is_file())
    if kind == "parquet":
        if not p.is_dir():
            return glob_files(path) or [p]
        files = sorted(p.glob("*.parquet"))
        # the Hub's data/ folder holds every split's files: read whole, it would train on the test rows
        splits = sorted({m.group(1) for f in files if (m := _SPLIT_FILE.match(f.name))})
        if len(splits) > 1:
            example = "train" if "train" in splits else splits[0]
            raise ValueError(f"{path} holds the .parquet files of several splits ({', '.join(splits)}): pass one "
                             f"split's files as a pattern, e.g. '{p / f'{example}-*.parquet'}'")
        return files
    raise ValueError(f"{path} is neither a Parquet file, a folder of .parquet files nor a datasets save_to_disk "
                     f"folder")


def _columns(path: str | os.PathLike, schema: pa.Schema, has_label: bool | None,
             specs: Sequence[LabelSpec] = ()) -> dict[str, str | None]:
    """Our field ("label", "I1".."I13", "C1".."C26"; with `specs` "label:<column>" for each column they read) -> the
    source's column name (None: no label)."""
    by_lower = {name.lower(): name for name in schema.names}
    wanted = [f"I{i}" for i in range(1, NUM_DENSE_FEATURES + 1)] + [f"C{i}" for i in range(1, NUM_SPARSE_FEATURES + 1)]
    missing = [w for w in wanted if w.lower() not in by_lower]
    if missing and schema.names and all(re.fullmatch(r"-?\d+(\.\d*)?|[0-9a-f]{8}(\.\d+)?|Unnamed: \d+|", name)
                                        for name in schema.names):
        # a headerless file read as headed: its first row became the names (renaming them would lose that row)
        raise ValueError(f"{path}: its column names {schema.names[:5]} ... are a Criteo row: the file had no header "
                         f"line, so its first row was taken as the names (and is not among the rows). Pass the file "
                         f"itself (train.txt and day files are read without a header), or read it again with names, "
                         f"e.g. load_dataset('csv', data_files=..., sep='\\t', column_names=['label', 'I1', ..., "
                         f"'C26'])")
    if missing:
        raise ValueError(f"{path}: the table has no column for {missing} (its columns: {schema.names[:8]}"
                         f"{' ...' if len(schema.names) > 8 else ''}): a Criteo table names label (optional), I1..I13 "
                         f"and C1..C26; rename its columns (e.g. `ds.rename_columns({{...}})`) first")
    columns: dict[str, str | None] = {w: by_lower[w.lower()] for w in wanted}
    if specs:
        check_label_columns(specs, schema.names, str(path))
        return {"label": None, **columns, **{f"label:{c}": c for c in source_columns(specs)}}
    columns["label"] = None if has_label is False else by_lower.get("label")
    if has_label is True and columns["label"] is None:
        raise ValueError(f"{path}: has_label=True but the table has no 'label' column")
    return columns


def _schema(path: str | os.PathLike) -> pa.Schema:
    kind = table_source_kind(path)
    if kind == "saved_dataset":
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):  # save_to_disk of a DatasetDict: one folder per split
            raise ValueError(f"{path} holds the splits {list(ds)} (a DatasetDict saved to disk): pass one split's "
                             f"folder, e.g. {Path(path) / next(iter(ds))}")
        return ds.data.schema
    import pyarrow.parquet as pq

    return pq.read_schema(source_files(path)[0])


def table_has_label(path: str | os.PathLike, has_label: bool | None = None, specs: Sequence[LabelSpec] = ()) -> bool:
    """Whether a table source has a label column (after `has_label`, as for text files; `specs`: their columns)."""
    columns = _columns(path, _schema(path), has_label, specs)
    return columns["label"] is not None or bool(specs)


def _numbers(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Any number / bool / string column -> float64 [N] (NaN: null) and a bad-value mask [N]."""
    if pa.types.is_null(col.type):  # no value in any row (Arrow's type for a column of None only): all missing
        return np.full(len(col), np.nan), np.zeros(len(col), dtype=bool)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        # "" is missing, as an empty field of the text
        col = col.cast(pa.string())
        return strings_to_float(pc.if_else(pc.equal(col, ""), pa.scalar(None, pa.string()), col))
    if pa.types.is_dictionary(col.type):
        return _numbers(col.dictionary_decode())
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type)):
        raise TypeError(col.type)
    values_N = pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)  # nulls -> NaN
    return values_N, np.isinf(values_N)  # NaN (numpy's and Polars' missing float) is missing, as a null


def _ids(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A C column -> raw ids int64 [N] (-1: missing) and a bad-value mask [N]."""
    if pa.types.is_null(col.type):  # every value missing, as above
        return np.full(len(col), -1, dtype=np.int64), np.zeros(len(col), dtype=bool)
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return decode_hex(col.cast(pa.string()))
    if pa.types.is_integer(col.type):
        # uint64 ids past 2^63 wrap to negatives here: bad rows that name the value, not Arrow's cast error
        ids_N = pc.fill_null(pc.cast(col, pa.int64(), safe=False), -1).to_numpy(zero_copy_only=False)
        bad_N = ids_N < 0
        bad_N &= col.is_valid().to_numpy(zero_copy_only=False)
        return np.where(bad_N, -1, ids_N), bad_N
    if pa.types.is_floating(col.type):
        values_N = pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)
        missing_N = np.isnan(values_N)
        bad_N = ~missing_N & ~((values_N >= 0) & (values_N < 2.0**53) & (np.floor(values_N) == values_N))
        ids_N = np.where(missing_N | bad_N, -1, np.nan_to_num(values_N)).astype(np.int64)
        return ids_N, bad_N
    raise TypeError(col.type)


def _convert(rb: pa.RecordBatch, columns: dict[str, str | None], file: Path, first: int, seen: int,
             specs: Sequence[LabelSpec] = ()):
    """One record batch -> (label [N] or the tasks' [N, T], dense [N, 13], sparse [N, 26]) raw values, the bad-row
    mask [N] and the problems as `raise_or_record` takes them (rows counted over the source, reasons naming the
    file's row)."""
    n = rb.num_rows
    problems: list[tuple[np.ndarray, object, int]] = []
    bad_N = np.zeros(n, dtype=bool)

    def column(field: str, to, what: str, rank: int) -> np.ndarray:
        col = rb.column(columns[field])
        try:
            values, bad = to(col)
        except TypeError:
            raise ValueError(f"{file}: column {columns[field]!r} ({field}) is of type {col.type}: {what}; cast it "
                             f"first") from None
        if field == "label":
            bad |= ~np.isin(values, (0.0, 1.0))  # a missing label too
        if bad.any():
            rows = np.flatnonzero(bad)
            problems.append((seen + rows, lambda i: f"{file}, row {first + int(rows[i])}: {field} {what.split(':')[0]},"
                                                    f" got {col[int(rows[i])].as_py()!r}", rank))
            bad_N[rows] = True
        return values

    label_N = np.full((n, len(specs)) if specs else n, np.nan, dtype=np.float32)
    dense_N13 = np.empty((n, NUM_DENSE_FEATURES), dtype=np.float32)
    sparse_NF = np.empty((n, NUM_SPARSE_FEATURES), dtype=np.int64)

    def tasks() -> None:  # several labels: any number, null / NaN missing, derived by the tasks' rules
        values = {c: column(f"label:{c}", _numbers, "must be a number: a number or bool column", 0)
                  for c in source_columns(specs)}
        label_N[:] = label_matrix(specs, values.__getitem__).numpy()

    def label() -> None:
        label_N[:] = column("label", _numbers, "must be 0 or 1: an integer, float or bool column", 0)

    def dense(j: int) -> None:
        dense_N13[:, j] = column(f"I{j + 1}", _numbers, "must be a number: a number column, or strings of numbers",
                                 1 + j)

    def sparse(j: int) -> None:
        sparse_NF[:, j] = column(f"C{j + 1}", _ids, "must be 8 hex characters or an integer id in 0..2**63 - 1: a "
                                 "string column of hashes, or an integer one of ids", 14 + j)

    jobs = [label] if columns["label"] is not None else [tasks] if specs else []
    jobs += [lambda j=j: dense(j) for j in range(NUM_DENSE_FEATURES)]
    jobs += [lambda j=j: sparse(j) for j in range(NUM_SPARSE_FEATURES)]
    # numpy / Arrow release the GIL: a thread per column; the first bad row is chosen by (row, rank) after
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), torch.get_num_threads()))) as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()
    return label_N, dense_N13, sparse_NF, bad_N, problems


def _checked(rb: pa.RecordBatch, columns: dict[str, str | None], file: Path, first: int, seen: int,
             on_bad_row: str, report: ParseReport, specs: Sequence[LabelSpec] = ()
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """_convert, then `on_bad_row`: raise for the first bad row (its first bad field), or drop, count and record."""
    label_N, dense_N13, sparse_NF, bad_N, problems = _convert(rb, columns, file, first, seen, specs)
    if problems and on_bad_row == "error":  # the first bad row, its first bad field (by rank)
        rows, why, _ = min(problems, key=lambda p: (int(p[0].min()), p[2]))
        reason = why(int(rows.argmin()))
        raise ValueError(f"{reason}. " + (minus_one_label_fix(reason, "table") or "Fix the table, or pass "
                                          "on_bad_row='skip' to drop such rows (they are counted and logged)"))
    raise_or_record(problems, on_bad_row, str(report.path), report)
    report.num_skipped_rows += int(bad_N.sum())
    report.num_rows += int((~bad_N).sum())
    if bad_N.any():
        return label_N[~bad_N], dense_N13[~bad_N], sparse_NF[~bad_N]
    return label_N, dense_N13, sparse_NF


def _names(columns: dict[str, str | None]) -> list[str]:
    """The source's columns to read, in our order: label (if any) or the tasks' label columns, I1..I13, C1..C26."""
    tasks = [c for k, c in columns.items() if k.startswith("label:")]
    features = [columns[f"I{i}"] for i in range(1, NUM_DENSE_FEATURES + 1)]
    features += [columns[f"C{i}"] for i in range(1, NUM_SPARSE_FEATURES + 1)]
    return [c for c in dict.fromkeys([columns["label"], *tasks, *features]) if c is not None]  # a mask may be a feature


def table_layout(path: str | os.PathLike, has_label: bool | None = None, specs: Sequence[LabelSpec] = ()) -> dict:
    """What a report says of a table source's layout: its format and which column holds each field."""
    return {"format": table_source_kind(path), "columns": _columns(path, _schema(path), has_label, specs)}


def read_criteo_table(path: str | os.PathLike, has_label: bool | None = None, on_bad_row: str = "error",
                      batch_rows: int = 1 << 20, label_specs: Sequence[LabelSpec] = ()
                      ) -> Iterator[tuple[pa.Table, ParseReport]]:
    """A table source -> Arrow tables of raw values (label, dense, sparse), as `read_criteo` gives for text; the
    report's `skipped` rows count over the whole source, its reasons name the file and its own row."""
    check_on_bad_row(on_bad_row)
    blocks = TableBlocks(path, has_label, batch_rows, label_specs)
    report = ParseReport(path=str(path), layout=blocks.layout)
    for k in range(blocks.num_blocks):
        yield to_table(*blocks.read(k, on_bad_row, report)), report


class TableBlocks:
    """A table source cut into blocks of `block_rows` rows (its files end to end), read by index: what streaming,
    preprocess and the cache read instead of text blocks. Block k is found from the Parquet row-group sizes (read in
    one call, kept for the next block) or sliced from a save_to_disk table, so a pass reads only its own blocks."""

    def __init__(self, path: str | os.PathLike, has_label: bool | None, block_rows: int,
                 label_specs: Sequence[LabelSpec] = ()) -> None:
        self.path, self.block_rows = str(path), max(1, int(block_rows))
        self.specs = list(label_specs)
        self.layout = table_layout(path, has_label, self.specs)
        self.columns = self.layout["columns"]
        self._names = _names(self.columns)
        self._table = None
        self._kept: tuple[tuple[int, int], pa.Table] | None = None  # (first, last row group), their rows
        self._is_saved = table_source_kind(path) == "saved_dataset"
        if self._is_saved:
            self.num_rows = self._saved().num_rows
            self._groups: list[tuple[Path, int, int, int]] = []
        else:
            import pyarrow.parquet as pq

            self._files = source_files(path)
            self._groups = []  # (file, row group, its first row in the whole, its first row in its file)
            start = 0
            for f in self._files:
                parquet = pq.ParquetFile(f)
                missing = [c for c in self._names if c not in parquet.schema_arrow.names]
                if missing:
                    raise ValueError(f"{f}: no column {missing}, which {self._files[0].name} has: the .parquet files "
                                     f"of {path} must share their columns")
                meta = parquet.metadata
                in_file = 0
                for g in range(meta.num_row_groups):
                    self._groups.append((f, g, start, in_file))
                    rows = meta.row_group(g).num_rows
                    start, in_file = start + rows, in_file + rows
            self._starts = np.array([g[2] for g in self._groups] + [start], dtype=np.int64)
            self.num_rows = start
        if self.num_rows == 0:
            raise ValueError(f"{path} has no data rows: expected Criteo rows (label, I1..I13, C1..C26)")
        sizes = json.dumps([[f.name, f.stat().st_size] for f in source_files(path)])
        digest = hashlib.sha1(sizes.encode()).hexdigest()[:8]  # not hash(): it differs between processes
        self.fingerprint = f"{os.path.basename(self.path)}:{self.num_rows}:{digest}"

    def _saved(self) -> pa.Table:
        if self._table is None:  # memory-mapped, once per process
            import datasets

            self._table = datasets.load_from_disk(self.path).data.table.select(self._names)
        return self._table

    def __getstate__(self) -> dict:
        # a DataLoader worker gets the source, not its rows: a pickled Arrow table would carry every row with it
        return {**self.__dict__, "_table": None, "_kept": None}

    @property
    def num_blocks(self) -> int:
        return -(-self.num_rows // self.block_rows)

    def _row_groups(self, first: int, last: int) -> pa.Table:
        """Row groups first..last (of one file) in one read; kept for the next block, which often starts there."""
        import pyarrow.parquet as pq

        if self._kept is None or self._kept[0] != (first, last):
            f = self._groups[first][0]
            groups = [g for _, g, _, _ in self._groups[first:last + 1]]
            self._kept = ((first, last), pq.ParquetFile(f).read_row_groups(groups, columns=self._names))
        return self._kept[1]

    def read(self, k: int, on_bad_row: str, report: ParseReport) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Block k's rows as raw values (label [N], dense [N, 13], sparse [N, 26]), bad rows per `on_bad_row`."""
        lo, hi = k * self.block_rows, min((k + 1) * self.block_rows, self.num_rows)
        pieces = []  # (file, first row in that file, first row in the whole, record batch)
        if self._is_saved:
            for rb in self._saved().slice(lo, hi - lo).combine_chunks().to_batches():
                pieces.append((Path(self.path), lo, lo, rb))
                lo += rb.num_rows
        else:
            g = int(np.searchsorted(self._starts, lo, side="right")) - 1
            while lo < hi:  # one piece per file: the row groups of it that the block spans, converted together
                f, _, start, in_file = self._groups[g]
                last = g
                while last + 1 < len(self._groups) and self._groups[last + 1][0] == f and self._starts[last + 1] < hi:
                    last += 1
                take = min(hi, int(self._starts[last + 1])) - lo
                if take > 0:
                    for rb in self._row_groups(g, last).slice(lo - start, take).combine_chunks().to_batches():
                        pieces.append((f, in_file + lo - start, lo, rb))
                        lo += rb.num_rows
                g = last + 1
        arrays = [_checked(rb, self.columns, f, first, whole, on_bad_row, report, self.specs)
                  for f, first, whole, rb in pieces]
        if not arrays:
            return (np.empty((0, len(self.specs)) if self.specs else 0, np.float32),
                    np.empty((0, NUM_DENSE_FEATURES), np.float32), np.empty((0, NUM_SPARSE_FEATURES), np.int64))
        return tuple(np.concatenate(parts) for parts in zip(*arrays))
