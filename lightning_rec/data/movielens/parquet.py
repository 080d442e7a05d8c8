"""A Parquet log of interactions -> a ratings table (user_id, item_id, rating, timestamp)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lightning_rec.data.movielens.columns import _empty_ids, _header_map, _marked, _refuse_ambiguous

_NEEDS = "every interaction needs a user, an item and (when the column is there) a rating"


def _read_ratings_parquet(path: Path, columns: dict[str, str] | None = None) -> pa.Table:
    """A Parquet log of interactions, columns by name as in a ratings.csv header: user, item[, rating][, timestamp].
    No rating column: implicit feedback (1.0); a timestamp column: integer seconds or an Arrow timestamp."""
    import pyarrow.parquet as pq

    ours = _parquet_columns(path, pq.read_schema(path), columns)
    table = pq.read_table(path, columns=list(ours.values()))
    out = {column: _id_column(path, ours[column], table.column(ours[column])) for column in ("user_id", "item_id")}
    if "rating" in ours:
        out["rating"] = _rating_column(path, ours["rating"], table.column(ours["rating"]))
    else:
        out["rating"] = pa.array(np.ones(table.num_rows, np.float32))  # implicit feedback
    if "timestamp" in ours:
        out["timestamp"] = _timestamp_column(path, ours["timestamp"], table.column(ours["timestamp"]))
    else:
        out["timestamp"] = pa.array(np.zeros(table.num_rows, np.int64))
    return _marked(pa.table(out), implicit="rating" not in ours, timeless="timestamp" not in ours)


def _parquet_columns(path: Path, schema: pa.Schema, columns: dict[str, str] | None) -> dict[str, str]:
    """Our column -> the file's column, for those the file has (a user and an item column at least)."""
    header_names = _header_map(columns)
    fields = [header_names.get(name.strip().lower()) for name in schema.names]
    _refuse_ambiguous(str(path), schema.names, fields)
    ours = {mapped: name for name, mapped in zip(schema.names, fields) if mapped}
    missing = [n for n in ("user_id", "item_id") if n not in ours]
    if not missing:
        return ours
    if schema.names and all(re.fullmatch(r"\s*-?\d+(\.\d*)?\s*", name) for name in schema.names):
        # a headerless log loaded as if headed (load_dataset("csv", ...) of u.data): its first row became the names
        raise ValueError(f"{path}: its column names {schema.names[:4]} are numbers: the log had no header line, so "
                         f"its first row was taken as the names (and is not among the rows). Read it again with "
                         f"names, e.g. load_dataset('csv', data_files=..., sep='\\t', "
                         f"column_names=['user', 'item', 'rating', 'timestamp']), or pass the file's folder itself")
    raise ValueError(f"{path}: no column for {missing} among {schema.names[:8]}: name the columns user (or userId, "
                     f"user_id), item (or movieId, item_id)[, rating][, timestamp], or say which are which: "
                     f"columns={{'user': ..., 'item': ...}} (--data.init_args.columns)")


def _refuse_null(path: Path, name: str, col: pa.ChunkedArray) -> None:
    if col.null_count:
        row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"{path}, row {row}: {name} is null: {_NEEDS}")


def _id_column(path: Path, name: str, col: pa.ChunkedArray) -> pa.ChunkedArray:
    """A user or item column as int64 ids, or as strings (string ids, or uint64 ids beyond int64: the data's own)."""
    _refuse_null(path, name, col)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        empty = _empty_ids(col)  # "" is a missing id, as an empty field of a CSV log (not a user named "")
        if empty is not None:
            raise ValueError(f"{path}, row {empty}: {name} is empty: {_NEEDS}")
        return pc.cast(col, pa.string())  # string ids ("A3SGXH7AUHU8GW"): kept as the data's own ids
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)) or (
            pa.types.is_floating(col.type) and not bool(pc.all(pc.equal(pc.floor(col), col)).as_py())):
        raise ValueError(f"{path}: column {name!r} is {col.type}: ids must be integers or strings")
    if pa.types.is_unsigned_integer(col.type) and (pc.max(col).as_py() or 0) > np.iinfo(np.int64).max:
        return pc.cast(col, pa.string())  # 64-bit hashes: Arrow cannot cast them to int64; as text they stay exact
    return pc.cast(col, pa.int64())


def _rating_column(path: Path, name: str, col: pa.ChunkedArray) -> pa.ChunkedArray:
    _refuse_null(path, name, col)
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
        raise ValueError(f"{path}: column {name!r} is {col.type}: ratings must be numbers")
    if pa.types.is_floating(col.type) and pc.any(pc.is_nan(col)).as_py():
        # a NaN is not a null (Polars and numpy-built tables keep NaN) but no rating either, as a CSV's "NaN"
        row = int(np.flatnonzero(pc.is_nan(col).to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"{path}, row {row}: {name} is NaN: {_NEEDS}")
    return pc.cast(col, pa.float32())


def _timestamp_column(path: Path, name: str, col: pa.ChunkedArray) -> pa.ChunkedArray:
    """Whole seconds (int64) from an Arrow timestamp or a number of seconds, in every row (no null, no NaN)."""
    nans = int(pc.sum(pc.is_nan(col)).as_py() or 0) if pa.types.is_floating(col.type) else 0
    if col.null_count or nans or not (pa.types.is_timestamp(col.type) or pa.types.is_integer(col.type)
                                      or pa.types.is_floating(col.type)):
        raise ValueError(f"{path}: column {name!r} ({col.type}"
                         f"{f', {col.null_count} nulls' if col.null_count else ''}"
                         f"{f', {nans} NaN' if nans else ''}): a timestamp is a time or a number of seconds in "
                         f"every row")
    if pa.types.is_timestamp(col.type):  # whole seconds, as GroupLens' files (sub-second ties keep file order)
        return pc.cast(pc.cast(col, pa.timestamp("s"), safe=False), pa.int64())
    return pc.cast(pc.floor(pc.cast(col, pa.float64())), pa.int64())
