"""A text ratings file (GroupLens' u.data / ratings.dat / ratings.csv, RecBole's .inter, your own CSV; compressed or
not) -> a ratings table (user_id, item_id, rating, timestamp). The separator and a header line are detected from
the first line; a header names the columns, else they are user, item, rating[, timestamp] in that order."""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from lightning_rec.data.criteo.layout import open_criteo_stream
from lightning_rec.data.movielens.columns import _NAMES, _empty_ids, _header_map, _marked, _refuse_ambiguous

_UTF8_BOM = b"\xef\xbb\xbf"


def _sniff(path: Path, data: bytes) -> tuple[str, bool]:
    """(separator, has_header) from the first line of a ratings file (`data`: its text, decompressed)."""
    first = data.split(b"\n", 1)[0].removeprefix(_UTF8_BOM).decode("latin-1").rstrip("\r\n")
    if not first:
        raise ValueError(f"{path}: the ratings file is empty (expected lines of user, item, rating[, timestamp])")
    for least in (3, 2):  # two fields: a header `user,item` of implicit feedback (no rating, as in Parquet logs)
        for sep in ("::", "\t", ",", ";", "|", " "):
            fields = first.split(sep)
            if len(fields) >= least:
                has_header = not re.fullmatch(r"\s*-?\d+\s*", fields[0])
                return sep, has_header
    raise ValueError(f"{path}:1: cannot find the separator of {first[:80]!r}: expected user, item, rating[, timestamp] "
                     f"separated by '::', a tab, ',', ';', '|' or a space")


def _first_bad_line(data: bytes, sep: str, has_header: bool, string_fields: Sequence[int] = (),
                    checked: Sequence[tuple[int, type]] = ((0, int), (1, int), (2, float))) -> str:
    """':LINE' of the first row whose user, item or rating (`checked`, less `string_fields`) is not a number."""
    for i, raw in enumerate(data.split(b"\n"), start=1):
        if (has_header and i == 1) or not raw.strip():
            continue
        fields = raw.decode("latin-1").rstrip("\r").split(sep)
        try:
            for k, parse in checked:
                if k not in string_fields:
                    parse(fields[k])
        except (ValueError, IndexError):
            return f":{i}"
    return ""


def _line_of_row(data: bytes, row: int, has_header: bool) -> int:
    """The 1-based line of a table's 0-based `row` (pyarrow skips empty lines: row + 1 is not always the line)."""
    line, start, seen = 0, 0, -1
    while start <= len(data):
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end
        line += 1
        if not (has_header and line == 1) and data[start:end].rstrip(b"\r"):
            seen += 1
            if seen == row:
                return line
        start = end + 1
    return row + 1 + has_header


def _refuse_missing(table: pa.Table, data: bytes, path: Path, has_header: bool) -> None:
    """An empty field where a number belongs reads as null: refused, naming its line."""
    for name in table.column_names:
        col = table.column(name)
        if col.null_count:
            row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            what = {"user_id": "no user id", "item_id": "no item id"}.get(name, f"no {name}")
            raise ValueError(f"{path}:{_line_of_row(data, row, has_header)}: {what} (an empty field, or NA / NaN / "
                             f"null, which pyarrow reads as missing): every interaction needs a user, an item, a "
                             f"rating and (when the file has the column) a timestamp; fix or drop that line")


def _read_ratings_text(path: Path, columns: dict[str, str] | None = None) -> pa.Table:
    """A text ratings file (any GroupLens layout, header or not) -> Arrow table user_id, item_id, rating, timestamp."""
    # ratings.csv.gz (and bz2 / zstd, detected from the first bytes as the Criteo reader does): read decompressed
    with open_criteo_stream(path) as stream:
        raw = stream.read()
    sep, has_header = _sniff(path, raw)
    data = raw.removeprefix(_UTF8_BOM)  # a CSV saved by Excel ("CSV UTF-8") starts with a byte order mark
    if sep == "::":
        data, sep = data.replace(b"::", b"\t"), "\t"  # pyarrow reads one-character separators
    column_names = _column_names(path, data, sep, has_header, columns)
    # without a rating column (a header of user, item[, timestamp]) the log is implicit feedback, as a Parquet log
    included = [n for n in _NAMES if n in column_names]
    table, string_ids = _parse(path, data, sep, has_header, column_names, included)
    _refuse_missing(table, data, path, has_header)
    for name in string_ids:
        table = table.set_column(table.column_names.index(name), name, _ids_from_text(table.column(name), data, path,
                                                                                      name, has_header))
    if "rating" not in included:  # implicit feedback: every interaction 1.0 (the mark tells min_rating so)
        table = table.add_column(2, "rating", pa.array(np.ones(table.num_rows, np.float32)))
    if "timestamp" not in included:  # zeros keep one schema for every file (the mark says there is no time)
        table = table.append_column("timestamp", pa.array(np.zeros(table.num_rows, np.int64)))
    else:  # read as float, kept as whole seconds: a log's fractional timestamps read too
        where = table.column_names.index("timestamp")
        table = table.set_column(where, "timestamp", pc.cast(pc.floor(table.column("timestamp")), pa.int64()))
    return _marked(table, implicit="rating" not in included, timeless="timestamp" not in included)


def _column_names(path: Path, data: bytes, sep: str, has_header: bool, columns: dict[str, str] | None) -> list[str]:
    """Our column for each field of a line: by the header's names (a header without movieId must not shift the
    rating into the item column; "_unused<i>" for a column we do not read), else user, item, rating[, timestamp]."""
    first_line = data.split(b"\n", 2)[1 if has_header else 0]
    num_fields = len(first_line.decode("latin-1").rstrip("\r").split(sep))
    if not has_header:
        if num_fields not in (3, 4):
            raise ValueError(f"{path}:1: {num_fields} fields separated by {sep!r}; expected user, item, "
                             f"rating[, timestamp] (implicit feedback, without a rating: start the file with a header "
                             f"line naming its columns, user{sep}item[{sep}timestamp])")
        return _NAMES[:num_fields]
    header = data.split(b"\n", 1)[0].decode("latin-1").rstrip("\r").split(sep)
    # ":token" / ":float": RecBole's atomic files type their columns in the header ("user_id:token")
    header_names = _header_map(columns)
    column_names = [header_names.get(h.strip().strip('"').split(":")[0].lower(), f"_unused{i}")
                    for i, h in enumerate(header)]
    _refuse_ambiguous(f"{path}:1", [h.strip().strip('"') for h in header],
                      [n if not n.startswith("_unused") else None for n in column_names])
    missing = [n for n in _NAMES[:2] if n not in column_names]
    if missing:
        raise ValueError(f"{path}:1: the header {header} has no column for {missing}: expected userId, movieId"
                         f"[, rating][, timestamp] (ml-20m/25m's ratings.csv), or name yours: columns={{'user': "
                         f"..., 'item': ..., 'rating': ...}} (--data.init_args.columns)")
    return column_names


def _parse(path: Path, data: bytes, sep: str, has_header: bool, column_names: list[str],
           included: list[str]) -> tuple[pa.Table, set[str]]:
    """The parsed table, and the id columns read as text: integer ids first; a headed file whose ids do not parse is
    read again with text ids (ASINs). Headerless files keep integer ids: a letter there is damage."""

    def read(string_ids: set[str]) -> pa.Table:
        return pacsv.read_csv(
            io.BytesIO(data),
            read_options=pacsv.ReadOptions(column_names=column_names, skip_rows=1 if has_header else 0),
            parse_options=pacsv.ParseOptions(delimiter=sep),
            convert_options=pacsv.ConvertOptions(column_types={"user_id": pa.int64(), "item_id": pa.int64(),
                                                               "rating": pa.float32(), "timestamp": pa.float64(),
                                                               **{n: pa.string() for n in string_ids}},
                                                 include_columns=included),
        )

    string_ids: set[str] = set()
    try:
        return read(string_ids), string_ids
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        error = e
    if has_header:
        string_ids = {"user_id", "item_id"}
        try:
            return read(string_ids), string_ids
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            error = e
    ids = "numeric user, item" if not string_ids else "user, item"
    checked = [(column_names.index(n), t) for n, t in (("user_id", int), ("item_id", int), ("rating", float))
               if n in column_names]
    bad_line = _first_bad_line(data, sep, has_header, [column_names.index(n) for n in string_ids], checked)
    raise ValueError(f"{path}{bad_line}: cannot parse the ratings ({error}); expected {ids}, a numeric "
                     f"rating[, timestamp] separated by {sep!r}") from None


def _ids_from_text(col: pa.ChunkedArray, data: bytes, path: Path, name: str, has_header: bool) -> pa.ChunkedArray:
    """A header-named id column read as text: int64 when every id is an integer, else the strings (mixed: a warning)."""
    col = pc.utf8_trim_whitespace(col)
    empty = _empty_ids(col)  # an empty field is a missing id, not the id "" (nor a reason to read strings)
    if empty is not None:
        raise ValueError(f"{path}:{_line_of_row(data, empty, has_header)}: no {name.split('_')[0]} id (an empty "
                         f"field): every interaction needs a user and an item; fix or drop that line")
    is_int = pc.match_substring_regex(col, r"^-?\d{1,18}$").to_numpy(zero_copy_only=False)
    if is_int.all():
        return pc.cast(col, pa.int64())
    if is_int.any():
        row = int(np.flatnonzero(~is_int)[0])
        warnings.warn(f"{path}: {int((~is_int).sum())} of {len(is_int)} {name.split('_')[0]} ids are not integers "
                      f"(the first, {col[row].as_py()!r}, on line {_line_of_row(data, row, has_header)}): every "
                      f"{name.split('_')[0]} "
                      f"id is read as a string. If those rows are damage, not ids, fix them", stacklevel=4)
    return col
