"""The columns of a ratings table (user_id, item_id, rating, timestamp), the names a file may give them, and the
schema marks of a log without a rating or a timestamp column; shared by the text and the Parquet readers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_NO_RATING = b"lightning_rec.no_rating"  # schema mark of an implicit-feedback log (no rating column: every row 1.0)
_NO_TIME = b"lightning_rec.no_timestamp"  # schema mark of a ratings table whose file had no timestamp column
_NAMES = ["user_id", "item_id", "rating", "timestamp"]  # a ratings table's columns, in order

_HEADER_NAMES = {"userid": "user_id", "user_id": "user_id", "user": "user_id", "movieid": "item_id",
                 "movie_id": "item_id", "itemid": "item_id", "item_id": "item_id", "item": "item_id",
                 "rating": "rating", "timestamp": "timestamp"}
# MovieLens' own header names (ratings.csv, movies.csv), which TorchRec's constants hold; read_ratings maps them to ours
DEFAULT_RATINGS_COLUMN_NAMES = ["userId", "movieId", "rating", "timestamp"]
DEFAULT_MOVIES_COLUMN_NAMES = ["movieId", "title", "genres"]
DEFAULT_COLUMN_NAMES = DEFAULT_RATINGS_COLUMN_NAMES + DEFAULT_MOVIES_COLUMN_NAMES[1:]
_FIELDS = {"user": "user_id", "item": "item_id", "rating": "rating", "timestamp": "timestamp"}


def _header_map(columns: dict[str, str] | None) -> dict[str, str]:
    """Lower-cased header name -> our column, `columns` (a log's own names) before GroupLens / RecBole's."""
    names = dict(_HEADER_NAMES)
    if columns is not None and not isinstance(columns, dict):
        raise ValueError(f"columns={columns!r}: give a mapping of user / item / rating / timestamp to your file's "
                         f"column names, e.g. columns={{'item': 'parent_asin'}}")
    for what, name in (columns or {}).items():
        if what not in _FIELDS:
            raise ValueError(f"columns={columns!r}: {what!r} is not one of {', '.join(_FIELDS)} (give your file's "
                             f"column name for each, e.g. columns={{'item': 'parent_asin'}})")
        names = {k: v for k, v in names.items() if v != _FIELDS[what]}  # only the given name means that field
        names[str(name).strip().lower()] = _FIELDS[what]
    return names


def _refuse_ambiguous(where: str, header: Sequence[str], fields: Sequence[str | None]) -> None:
    """Two of a file's columns read as the same field (user and userId): say which one, rather than take the first."""
    for ours in dict.fromkeys(f for f in fields if f):
        names = [h for h, f in zip(header, fields) if f == ours]
        if len(names) > 1:
            what = next(k for k, v in _FIELDS.items() if v == ours)
            both = "both" if len(names) == 2 else "all"
            raise ValueError(f"{where}: columns {', '.join(map(repr, names))} {both} name the {what}: say which one, "
                             f"columns={{{what!r}: {names[0]!r}}} (--data.init_args.columns)")


def _empty_ids(col: pa.ChunkedArray) -> int | None:
    """The first row whose string id is null or blank, or None."""
    missing = pc.or_kleene(pc.is_null(col), pc.equal(pc.utf8_trim_whitespace(col), "")).fill_null(True)
    if not pc.any(missing).as_py():
        return None
    return int(np.flatnonzero(missing.to_numpy(zero_copy_only=False))[0])


def _marked(table: pa.Table, implicit: bool, timeless: bool) -> pa.Table:
    """The table with its schema marks: no rating column, no timestamp column."""
    marks = {_NO_RATING: b"1"} if implicit else {}
    if timeless:
        marks[_NO_TIME] = b"1"
    return table.replace_schema_metadata(marks or None)
