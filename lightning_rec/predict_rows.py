"""Prediction rows in bounded memory: a rank's rows spilled to disk in sorted runs, runs (and ranks) merged in row
order a chunk at a time, and the file written a chunk at a time. `PredictionWriter` (predict.py) does the
communication around these; nothing here talks to another rank.

A table is a dict of numpy columns with the same first dim (its rows), one of them ROW ("row", int64): the row's
place in the input, the order the file is written in. A stream is a sequence of tables sorted by ROW.

    rank's batches --> RunSpill (memory up to spill_bytes, then one sorted run file per spill)
                   --> local_stream: SortedMerge of the runs, chunk by chunk
                   --> (rank 0, one chunk per rank asked for) SortedMerge of the ranks' streams
                   --> TableWriter (.csv / .tsv / .parquet, temporary file renamed into place)

A rank holds at most spill_bytes of unsorted rows, plus a chunk per run while merging (rank 0 a chunk per rank on
top). A row seen twice (a sampler's padding repeat) is written once."""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROW = "row"
FORMATS = {".csv": ",", ".tsv": "\t", ".parquet": None}


def suffix_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"prediction output {path}: unknown format {suffix or '(no suffix)'!r}; end the path in "
                         f"{', '.join(FORMATS)}")
    return suffix


def num_rows(table: dict[str, np.ndarray]) -> int:
    return len(table[ROW]) if table else 0


def concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    parts = [p for p in parts if num_rows(p)]
    if not parts:
        return {}
    if len(parts) == 1:
        return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def take(table: dict[str, np.ndarray], index: Any) -> dict[str, np.ndarray]:
    return {k: v[index] for k, v in table.items()}


def sort_by_row(table: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if not num_rows(table) or bool((np.diff(table[ROW]) >= 0).all()):
        return table  # the usual case: a rank's rows arrive in input order
    return take(table, np.argsort(table[ROW], kind="stable"))


class SortedMerge:
    """Merges S streams, each sorted by ROW, into one in ROW order with each ROW once, holding a chunk per stream: the
    caller asks `needs()`, `feed`s those chunks (None: ended) and `pop`s what no stream can still precede."""

    def __init__(self, num_streams: int) -> None:
        self._buffers: list[dict[str, np.ndarray]] = [{} for _ in range(num_streams)]
        self._ended = [False] * num_streams
        self._last: int | None = None  # the last row popped: rows come out strictly increasing
        self.held_rows_peak = 0

    def needs(self) -> list[int]:
        """The streams to read before anything more can be popped: the unended ones with nothing buffered."""
        return [s for s, (b, ended) in enumerate(zip(self._buffers, self._ended)) if not ended and not num_rows(b)]

    def feed(self, stream: int, chunk: dict[str, np.ndarray] | None) -> None:
        if chunk is None:
            self._ended[stream] = True
            return
        if not num_rows(chunk):
            return  # an empty chunk says nothing: the stream is read again
        rows = chunk[ROW]
        if num_rows(self._buffers[stream]):
            raise RuntimeError(f"stream {stream} fed while it still holds rows")  # needs() said otherwise
        if len(rows) > 1 and not bool((np.diff(rows) >= 0).all()):
            raise ValueError(f"stream {stream} gave rows out of order")
        self._buffers[stream] = chunk
        self.held_rows_peak = max(self.held_rows_peak, sum(num_rows(b) for b in self._buffers))

    @property
    def done(self) -> bool:
        return all(self._ended) and not any(num_rows(b) for b in self._buffers)

    def pop(self) -> dict[str, np.ndarray]:
        """Every buffered row that is ready, in ROW order, each once; {} when none is (read what needs() says)."""
        if self.needs():
            return {}
        lasts = [int(b[ROW][-1]) for b, ended in zip(self._buffers, self._ended) if not ended]
        bound = min(lasts) if lasts else None
        ready = []
        for s, b in enumerate(self._buffers):
            if not num_rows(b):
                continue
            cut = len(b[ROW]) if bound is None else int(np.searchsorted(b[ROW], bound, side="right"))
            ready.append(take(b, slice(0, cut)))
            self._buffers[s] = take(b, slice(cut, None))
        table = concat(ready)
        if not num_rows(table):
            return {}
        if len(ready) > 1:
            table = take(table, np.argsort(table[ROW], kind="stable"))
        rows = table[ROW]
        keep = np.ones(len(rows), dtype=bool)
        keep[1:] = rows[1:] != rows[:-1]  # a repeat within what is ready
        if self._last is not None:
            keep &= rows != self._last  # a repeat of the last row popped before
        self._last = int(rows[-1])
        return table if keep.all() else take(table, keep)


def merged(streams: list[Iterator[dict[str, np.ndarray]]]) -> Iterator[dict[str, np.ndarray]]:
    """The merge of local streams (iterators of sorted chunks), chunk by chunk."""
    merge = SortedMerge(len(streams))
    while not merge.done:
        for s in merge.needs():
            merge.feed(s, next(streams[s], None))
        table = merge.pop()
        if num_rows(table):
            yield table


def promoted(shapes: list[dict[str, tuple[np.dtype, tuple[int, ...]]]]) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """One set of columns for batches (or ranks) of `shapes`: each column's widest dtype; names and shapes agree."""
    first = shapes[0]

    def shown(shape: tuple[int, ...]) -> str:
        return f"[rows, {', '.join(map(str, shape))}]" if shape else "[rows]"

    for other in shapes[1:]:
        if set(other) != set(first):
            raise ValueError(f"predict_step returned the columns {sorted(other)} after {sorted(first)}: return the "
                             f"same columns for every batch")
        for k, (_, shape) in other.items():
            if shape != first[k][1]:
                raise ValueError(f"predict_step returned column {k!r} of shape {shown(shape)} after "
                                 f"{shown(first[k][1])}: return the same shape per row in every batch (pad a shorter "
                                 f"top-K list, e.g. with -1)")
        first = {k: (np.result_type(dtype, other[k][0]), shape) for k, (dtype, shape) in first.items()}
    return first


class RunSpill:
    """One rank's rows: in memory up to `spill_bytes`, then sorted and written as a run (one .npy per column) into a
    directory that `make_dir()` gives on the first spill. `stream(chunk_bytes)` gives every row in ROW order, each
    once, in chunks of at most about chunk_bytes (the runs merged); `close()` removes the runs."""

    def __init__(self, spill_bytes: int, make_dir: Callable[[], Path]) -> None:
        self.spill_bytes = spill_bytes
        self._make_dir = make_dir
        self._dir: Path | None = None
        self._parts: list[dict[str, np.ndarray]] = []
        self._bytes = self._rows = 0
        self._runs: list[Path] = []
        self.columns: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}  # name -> (dtype, shape past the rows)
        self.all_nan: dict[str, bool] = {}  # a float column NaN in every row so far (an unlabelled file's label)
        self.held_rows_peak = 0

    def add(self, table: dict[str, np.ndarray]) -> None:
        if not self.columns:
            self.columns = {k: (v.dtype, v.shape[1:]) for k, v in table.items()}
            self.all_nan = {k: v.dtype.kind == "f" for k, v in table.items()}
        else:
            self.columns = promoted([self.columns, {k: (v.dtype, v.shape[1:]) for k, v in table.items()}])
        for k, v in table.items():
            if self.all_nan[k] and v.size and not np.isnan(v).all():
                self.all_nan[k] = False
        self._parts.append(table)
        self._bytes += sum(v.nbytes for v in table.values())
        self._rows += num_rows(table)  # a running count: a sum over the parts per batch grows with the parts
        self.held_rows_peak = max(self.held_rows_peak, self._rows)
        if self._bytes >= self.spill_bytes:
            self._spill()

    def _spill(self) -> None:
        table = sort_by_row(concat(self._parts))
        self._parts, self._bytes, self._rows = [], 0, 0
        if not num_rows(table):
            return
        try:
            if self._dir is None:
                self._dir = self._make_dir()
            run = self._dir / f"run{len(self._runs)}"
            self._runs.append(run)  # removed by close() even when written only in part
            run.mkdir()
            for i, k in enumerate(self.columns):  # read back in the same order (_read_run)
                np.save(run / f"{i}.npy", table[k], allow_pickle=False)
        except OSError as e:
            raise OSError(e.errno, f"predictions past {self.spill_bytes >> 20} MB per rank are written to disk beside "
                                   f"the output file, and writing {self._dir or 'there'} failed ({e.strerror or e}): "
                                   f"free space there, or write the predictions to another disk "
                                   f"(--predictions.output_path)") from e

    def _read_run(self, run: Path, chunk_rows: int) -> Iterator[dict[str, np.ndarray]]:
        columns = {k: np.load(run / f"{i}.npy", mmap_mode="r") for i, k in enumerate(self.columns)}
        rows = len(columns[ROW])
        for lo in range(0, rows, chunk_rows):
            yield {k: np.array(v[lo:lo + chunk_rows]) for k, v in columns.items()}

    def stream(self, chunk_bytes: int) -> Iterator[dict[str, np.ndarray]]:
        in_memory = sort_by_row(concat(self._parts))
        self._parts = []
        if not self.columns:
            return iter(())
        per_row = sum(np.dtype(d).itemsize * int(np.prod(s, dtype=np.int64)) for d, s in self.columns.values())
        sources = len(self._runs) + (1 if num_rows(in_memory) else 0) or 1  # one chunk each while merging
        chunk_rows = max(1, chunk_bytes // (per_row * sources))
        streams = [self._read_run(run, chunk_rows) for run in self._runs]
        streams.append(take(in_memory, slice(lo, lo + chunk_rows))
                       for lo in range(0, num_rows(in_memory), chunk_rows))
        return merged(streams)

    @property
    def num_runs(self) -> int:
        return len(self._runs)

    def close(self) -> None:
        self._parts, self._runs = [], []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


class TableWriter:
    """Writes tables with the same columns to one .csv / .tsv / .parquet file, a chunk at a time, into a temporary
    file that `close()` renames into place (`abort()` removes it): the path holds the whole file or nothing.

    `columns` is name -> (dtype, shape past the rows); a [R, K] column is K csv columns name_1..name_K, or a list
    column in parquet. Columns not named are left out. ROW comes first; `renumber` writes it as 0, 1, 2, ..."""

    def __init__(self, path: Path, columns: dict[str, tuple[np.dtype, tuple[int, ...]]],
                 renumber: bool = False) -> None:
        import pyarrow as pa

        self.path, self.suffix, self.renumber = path, suffix_of(path), renumber
        columns = dict(columns) or {ROW: (np.dtype(np.int64), ())}
        self.columns = {ROW: columns.pop(ROW), **columns} if ROW in columns else columns  # the row first
        fields = []
        for name, (dtype, shape) in self.columns.items():
            kind = pa.from_numpy_dtype(np.dtype(dtype))
            if shape and self.suffix == ".parquet":
                fields.append(pa.field(name, pa.list_(kind, int(shape[0]))))
            elif shape:
                fields.extend(pa.field(f"{name}_{j + 1}", kind) for j in range(int(shape[0])))
            else:
                fields.append(pa.field(name, kind))
        self.schema = pa.schema(fields)
        self.num_rows = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        if self.suffix == ".parquet":
            import pyarrow.parquet as pq

            self._sink = pq.ParquetWriter(str(self._tmp), self.schema)
        else:
            self._sink = pa.OSFile(str(self._tmp), "wb")
            # the header unquoted (pyarrow's writer quotes it always)
            self._sink.write((FORMATS[self.suffix].join(self.schema.names) + "\n").encode())

    def write(self, table: dict[str, np.ndarray]) -> None:
        import pyarrow as pa

        rows = num_rows(table)
        if not rows:
            return
        if self.renumber:
            table = {**table, ROW: np.arange(self.num_rows, self.num_rows + rows, dtype=np.int64)}
        arrays = []
        for name, (dtype, shape) in self.columns.items():
            values = table[name].astype(dtype, copy=False)  # a batch of a narrower type than another's
            if shape and self.suffix == ".parquet":
                arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), int(shape[0])))
            elif shape:
                arrays.extend(pa.array(values[:, j]) for j in range(int(shape[0])))
            else:
                arrays.append(pa.array(values))
        batch = pa.Table.from_arrays(arrays, schema=self.schema)
        if self.suffix == ".parquet":
            self._sink.write_table(batch)
        else:
            import pyarrow.csv as pcsv

            pcsv.write_csv(batch, self._sink, pcsv.WriteOptions(include_header=False, delimiter=FORMATS[self.suffix],
                                                                 quoting_style=self._quoting(batch)))
        self.num_rows += rows

    def _quoting(self, batch) -> str:
        """"none" (ids as they are), or "needed" (RFC 4180: pyarrow then quotes every string of the batch) for a batch
        with a string id that holds the separator, a quote or a line break, which "none" refuses (ArrowInvalid)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        structural = f'[{re.escape(FORMATS[self.suffix])}"\r\n]'
        for column in batch.columns:
            if (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)) and \
                    pc.any(pc.match_substring_regex(column, structural)).as_py():
                return "needed"
        return "none"

    def close(self) -> None:
        self._sink.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        try:
            self._sink.close()
        finally:
            if self._tmp.exists():
                self._tmp.unlink()


def written_columns(columns: dict[str, tuple[np.dtype, tuple[int, ...]]],
                    all_nan: dict[str, bool]) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The columns a file gets: all but a float column NaN in every row (the label of an unlabelled file)."""
    return {k: v for k, v in columns.items() if not all_nan.get(k, False)}


def write_table(table: dict[str, np.ndarray], path: Path) -> None:
    """Write `table` (columns of equal rows, in the order given) to `path` in one piece: all or nothing."""
    columns = {k: (v.dtype, v.shape[1:]) for k, v in table.items()}
    all_nan = {k: v.dtype.kind == "f" and bool(v.size) and bool(np.isnan(v).all()) for k, v in table.items()}
    writer = TableWriter(path, written_columns(columns, all_nan))
    try:
        writer.write(table)
        writer.close()
    except BaseException:
        writer.abort()
        raise
