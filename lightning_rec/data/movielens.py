"""MovieLens (GroupLens) ratings as implicit feedback for retrieval: training pairs and full-ranking users.

Shapes: N interactions of a split, B interactions in a batch, U users in an evaluation batch,
I items, R held-out items of an evaluation batch, X excluded (already seen) items of it.

Layouts read from `data_dir` (a GroupLens folder as unpacked; the separator and a header line are
detected from the first line, so a ratings file re-saved with a header or commas also reads; RecBole's
atomic files too, `<name>.inter` with `<name>.user` / `<name>.item`: its ml-100k gives the same ids,
split and features, except the release decade, read from the title's year there):

    ml-100k    u.data       user \\t item \\t rating \\t time     u.user  id|age|gender|occupation|zip
                                                                u.item  id|title|date|video date|url|19 genre flags
    ml-1m/10m  ratings.dat  user::item::rating::time            users.dat  id::gender::age::occupation::zip
                                                                movies.dat id::title (year)::Genre|Genre
    ml-20m/25m ratings.csv  userId,movieId,rating,timestamp      movies.csv movieId,title,genres
               (and ml-latest)
    your own   ratings.csv with a header (user,item[,rating][,timestamp]; no rating: implicit, 1.0; ids integers
               or strings: a column is read as integers when every id is one), or
               ratings.parquet  columns user, item[, rating][, timestamp] by name (as in a ratings.csv
               header; no rating: implicit, 1.0; timestamp: seconds or an Arrow timestamp); data_dir
               may also be such a .parquet file itself, or a pattern of them (a Hub dataset's
               data/train-*.parquet)

Text files are decoded as UTF-8, else latin-1 (ml-100k's u.item and ml-1m's movies.dat are
latin-1). Ratings are parsed by pyarrow into one Arrow table and kept as a Hugging Face
`datasets.Dataset` (`dm.ratings`); batches are numpy gathers from its columns (zero copy).

Implicit feedback: every rating is an interaction (`min_rating=None`, RecBole's ml-100k setting),
or only ratings >= `min_rating` (e.g. 4: "liked"); lower ratings are dropped before splitting, so
they are neither positives nor excluded at evaluation. A (user, item) pair rated twice (a log of
clicks saved as ratings.csv) is one interaction: repeats are dropped, counted and warned about.

Splits (`split=`):
    "ro_811"          RecBole's RO 8:1:1: per user, interactions in random order (seeded), the last
                      10% test, the 10% before validation (RecBole's rounding: int(0.1 n) each, and
                      at least one when 0.1 n < 1 and training keeps two)
    "to_811"          RecBole's TO 8:1:1: the same counts, each user's interactions in time order
                      (the newest 10% test, the 10% before them validation)
    "loo"             leave-one-out (RecBole's LS "valid_and_test"): each user's newest interaction is the
                      test item, the one before it validation; a user with two interactions gives only
                      a test item, one with one only trains
    "u1".."u5","ua","ub"  ml-100k's official splits: <split>.base trains, <split>.test is both the
                      validation and the test set (the official splits have no validation part)
    "given"           a log split already (Amazon Reviews'23's benchmark files, a Hub dataset's splits): data_dir
                      holds one file per split (.csv with a header, or .parquet), named by a word of its name:
                      train, valid / validation / val / dev, test (All_Beauty.train.csv, test.parquet,
                      train-00000-of-00002.parquet: several files of a split are read in name order); without a
                      validation file the test file is both, as in the official splits. In Python, a
                      `datasets.DatasetDict` of such splits. A pair repeated in a later split is dropped
                      there (its first copy kept), so no test target was seen in training. GroupLens side
                      files beside them (u.user / u.item, users.dat / movies.dat, movies.csv) are read.

Time order is the timestamp column's, ties in the file's order (a stable sort, as RecBole's); a
ratings file without timestamps has no temporal split. A repeated (user, item) pair keeps its
earliest copy under a temporal split (the first in the file otherwise).

Evaluation is full ranking: one sample per user, scored against every item; the held-out items of
the split are the targets and the items the user already has are excluded: training items for
validation, training + validation items for test (as RecBole does). Ids are re-indexed to 0..U-1
and 0..I-1 (`user_ids`, `item_ids` hold the raw ids: int64, or str for string ids); every item of the
ratings and item files has a row, so an item never seen in training is still ranked (`report` counts
those held-out pairs).

Features (KJT keys; side features on when `side_features=True` and the layout has them):
    user: user_id, and for ml-100k/1m age (7 buckets), gender, occupation, zip (first digit)
    item: item_id, genre (a bag: one id per genre), year (release decade)
Id 0 of every side feature is "missing".
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_rec.data.batch import make_train_loader, moved, parse_to, passthrough_collate, worker_options
from lightning_rec.data.criteo_parse import open_criteo_stream
from lightning_rec.data.criteo_tables import glob_files
from lightning_rec.data.hf_dataset import check_same_rows, dataset_path, is_hf_dataset, rows_digest
from lightning_rec.sparse import KeyedJaggedTensor, move_or_explain

log = logging.getLogger(__name__)

OFFICIAL_SPLITS = ("u1", "u2", "u3", "u4", "u5", "ua", "ub")  # ml-100k's own files
TEMPORAL_SPLITS = ("to_811", "loo")  # each user's interactions in time order
GIVEN = "given"  # the log's own split files (train / validation / test)
SPLITS = ("ro_811", *TEMPORAL_SPLITS, *OFFICIAL_SPLITS, GIVEN)
# a word of a file's name -> the part it holds (0 train, 1 validation, 2 test), for split="given"
_SPLIT_WORDS = {"train": 0, "training": 0, "valid": 1, "validation": 1, "val": 1, "dev": 1, "test": 2}
_LOG_SUFFIXES = (".csv", ".tsv", ".txt", ".parquet")
_COMPRESSED = (".gz", ".bz2", ".zst")  # the suffixes a ratings file may add (read as criteo_parse detects them)
_NO_RATING = b"lightning_rec.no_rating"  # schema mark of an implicit-feedback log (no rating column: every row 1.0)
_NO_TIME = b"lightning_rec.no_timestamp"  # schema mark of a ratings table whose file had no timestamp column
_AGE_EDGES = (18, 25, 35, 45, 50, 56)  # ml-1m's age groups; ml-100k's exact ages fall into them


# ----------------------------------------------------------------------------------------------
# batches


@dataclass
class RetrievalBatch:
    """Training pairs: B (user, item) interactions, and optionally one sampled negative item each.

    item_log_q_B is log P(an in-batch item is this item) (its training frequency): the logQ
    correction of in-batch softmax. neg_* are None unless the data module samples negatives (BPR).
    """

    user_features: KeyedJaggedTensor
    item_features: KeyedJaggedTensor
    user_index: Tensor  # [B] int64
    item_index: Tensor  # [B] int64
    item_log_q: Tensor  # [B] float32
    neg_item_features: KeyedJaggedTensor | None = None
    neg_item_index: Tensor | None = None

    def to(self, *args, **kwargs) -> RetrievalBatch:
        """nn.Module.to's arguments: a dtype converts item_log_q only (the floating tensor); ids keep their type."""
        device, dtype, non_blocking = parse_to("RetrievalBatch", args, kwargs)
        return move_or_explain(f"RetrievalBatch.to({str(device)!r})", device, lambda: RetrievalBatch(
            *(moved(getattr(self, f), device, dtype, non_blocking) for f in self.__dataclass_fields__)))

    def pin_memory(self) -> RetrievalBatch:
        return move_or_explain("RetrievalBatch.pin_memory()", None, lambda: RetrievalBatch(
            *(None if (x := getattr(self, f)) is None else x.pin_memory() for f in self.__dataclass_fields__)))

    def __len__(self) -> int:
        return self.user_index.shape[0]


@dataclass
class RankingBatch:
    """U users to rank against every item: targets (held out) and exclusions (seen) as CSR.

        target_offsets = [0, 2, 2, 5]: user 0's targets are target_items[0:2], user 1 has none
    """

    user_features: KeyedJaggedTensor
    user_index: Tensor  # [U]
    target_offsets: Tensor  # [U + 1]
    target_items: Tensor  # [R]
    exclude_offsets: Tensor  # [U + 1]
    exclude_items: Tensor  # [X]

    def to(self, *args, **kwargs) -> RankingBatch:
        """nn.Module.to's arguments; a dtype changes nothing here (ids and offsets keep their integer type)."""
        device, dtype, non_blocking = parse_to("RankingBatch", args, kwargs)
        return move_or_explain(f"RankingBatch.to({str(device)!r})", device, lambda: RankingBatch(
            *(moved(getattr(self, f), device, dtype, non_blocking) for f in self.__dataclass_fields__)))

    def pin_memory(self) -> RankingBatch:
        return move_or_explain("RankingBatch.pin_memory()", None, lambda: RankingBatch(
            *(getattr(self, f).pin_memory() for f in self.__dataclass_fields__)))

    def __len__(self) -> int:
        return self.user_index.shape[0]


def _gather_csr(offsets_N1: Tensor, values: Tensor, rows_B: Tensor) -> tuple[Tensor, Tensor]:
    """Rows of a CSR matrix, whole: (lengths_B, values of rows_B concatenated in order)."""
    starts_B = offsets_N1[rows_B]
    lengths_B = offsets_N1[rows_B + 1] - starts_B
    total = int(lengths_B.sum())
    if total == 0:
        return lengths_B, values[:0]
    # position of each output value: its row's start + its rank inside the row
    row_start_out_B = torch.cumsum(lengths_B, 0) - lengths_B
    within = torch.arange(total) - torch.repeat_interleave(row_start_out_B, lengths_B, output_size=total)
    return lengths_B, values[torch.repeat_interleave(starts_B, lengths_B, output_size=total) + within]


class FeatureTable:
    """Per-row categorical features of users or items: single ids [N, F1] and bags (CSR); -> KJT."""

    def __init__(self, single: dict[str, tuple[Tensor, int]], bags: dict[str, tuple[Tensor, Tensor, int]]) -> None:
        self.single = single  # name -> (ids_N, num_embeddings)
        self.bags = bags  # name -> (offsets_N1, values, num_embeddings)
        self.keys = list(single) + list(bags)
        self._single_NF = torch.stack([ids for ids, _ in single.values()], dim=1) if single else None

    @property
    def num_embeddings(self) -> dict[str, int]:
        return {**{k: n for k, (_, n) in self.single.items()}, **{k: n for k, (_, _, n) in self.bags.items()}}

    def kjt(self, rows_B: Tensor) -> KeyedJaggedTensor:
        B = rows_B.shape[0]
        values, lengths = [], []
        if self._single_NF is not None:
            values.append(self._single_NF[rows_B].t().reshape(-1))  # key-major
            lengths.append(torch.ones(B * len(self.single), dtype=torch.int64))
        for offsets, bag_values, _ in self.bags.values():
            lengths_B, values_B = _gather_csr(offsets, bag_values, rows_B)
            values.append(values_B)
            lengths.append(lengths_B)
        return KeyedJaggedTensor.from_lengths_sync(self.keys, torch.cat(values), torch.cat(lengths), stride=B)


# ----------------------------------------------------------------------------------------------
# reading GroupLens files


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")  # ml-100k / ml-1m metadata: every byte is a latin-1 character


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


_HEADER_NAMES = {"userid": "user_id", "user_id": "user_id", "user": "user_id", "movieid": "item_id",
                 "movie_id": "item_id", "itemid": "item_id", "item_id": "item_id", "item": "item_id",
                 "rating": "rating", "timestamp": "timestamp"}
_FIELDS = {"user": "user_id", "item": "item_id", "rating": "rating", "timestamp": "timestamp"}


def _header_map(columns: dict[str, str] | None) -> dict[str, str]:
    """Lower-cased header name -> our column, with `columns` ({"item": "parent_asin", ...}: a log's own names)
    taking precedence over the GroupLens / RecBole names."""
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
    """Two of a file's columns read as the same field (user and userId): it took the first, silently."""
    for ours in dict.fromkeys(f for f in fields if f):
        names = [h for h, f in zip(header, fields) if f == ours]
        if len(names) > 1:
            what = next(k for k, v in _FIELDS.items() if v == ours)
            both = "both" if len(names) == 2 else "all"
            raise ValueError(f"{where}: columns {', '.join(map(repr, names))} {both} name the {what}: say which one, "
                             f"columns={{{what!r}: {names[0]!r}}} (--data.init_args.columns)")


def _first_bad_line(data: bytes, sep: str, has_header: bool, string_fields: Sequence[int] = (),
                    checked: Sequence[tuple[int, type]] = ((0, int), (1, int), (2, float))) -> str:
    """':LINE' of the first row whose user, item or rating is not a number (pyarrow names only the column);
    `string_fields` hold string ids, any text; `checked`: (field, type) of the user, item and rating."""
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
    """An empty field where a number belongs reads as null: in an id column np.asarray then made every id a float
    (user 1.0, and a user NaN), a null rating was kept as an interaction (or dropped by min_rating without a word)."""
    for name in table.column_names:
        col = table.column(name)
        if col.null_count:
            row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            what = {"user_id": "no user id", "item_id": "no item id"}.get(name, f"no {name}")
            raise ValueError(f"{path}:{_line_of_row(data, row, has_header)}: {what} (an empty field, or NA / NaN / "
                             f"null, which pyarrow reads as missing): every interaction needs a user, an item, a "
                             f"rating and (when the file has the column) a timestamp; fix or drop that line")


def _read_ratings_parquet(path: Path, columns: dict[str, str] | None = None) -> pa.Table:
    """A Parquet log of interactions, columns by name as in a ratings.csv header: user, item[, rating][, timestamp].

    A missing rating column is implicit feedback (every row 1.0); a timestamp column may be integer seconds or an
    Arrow timestamp; without one there is no time order (the temporal splits refuse it)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    header_names = _header_map(columns)
    fields = [header_names.get(name.strip().lower()) for name in schema.names]
    _refuse_ambiguous(str(path), schema.names, fields)
    ours = {mapped: name for name, mapped in zip(schema.names, fields) if mapped}
    missing = [n for n in ("user_id", "item_id") if n not in ours]
    if missing:
        if schema.names and all(re.fullmatch(r"\s*-?\d+(\.\d*)?\s*", name) for name in schema.names):
            # a headerless file read as if headed (load_dataset("csv", ...) of u.data): its first row became the
            # names, and columns={'user': '196', ...}, the fix said below, then dropped that interaction in silence
            raise ValueError(f"{path}: its column names {schema.names[:4]} are numbers: the log had no header line, so "
                             f"its first row was taken as the names (and is not among the rows). Read it again with "
                             f"names, e.g. load_dataset('csv', data_files=..., sep='\\t', "
                             f"column_names=['user', 'item', 'rating', 'timestamp']), or pass the file's folder itself")
        raise ValueError(f"{path}: no column for {missing} among {schema.names[:8]}: name the columns user (or userId, "
                         f"user_id), item (or movieId, item_id)[, rating][, timestamp], or say which are which: "
                         f"columns={{'user': ..., 'item': ...}} (--data.init_args.columns)")
    table = pq.read_table(path, columns=list(ours.values()))
    out, marks = {}, {}
    for column, kind in (("user_id", pa.int64()), ("item_id", pa.int64()), ("rating", pa.float32())):
        if column not in ours:
            out[column] = pa.array(np.ones(table.num_rows, np.float32))  # implicit feedback
            marks[_NO_RATING] = b"1"
            continue
        col = table.column(ours[column])
        if col.null_count:
            row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise ValueError(f"{path}, row {row}: {ours[column]} is null: every interaction needs a user, an item and "
                             f"(when the column is there) a rating")
        whole = column != "rating"
        if whole and (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            empty = _empty_ids(col)  # "" is a missing id, as an empty field of a CSV log (not a user named "")
            if empty is not None:
                raise ValueError(f"{path}, row {empty}: {ours[column]} is empty: every interaction needs a user, an "
                                 f"item and (when the column is there) a rating")
            out[column] = pc.cast(col, pa.string())  # string ids ("A3SGXH7AUHU8GW"): kept as the data's own ids
            continue
        if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)) or (
                whole and pa.types.is_floating(col.type) and not bool(pc.all(pc.equal(pc.floor(col), col)).as_py())):
            need = "ids must be integers or strings" if whole else "ratings must be numbers"
            raise ValueError(f"{path}: column {ours[column]!r} is {col.type}: {need}")
        if whole and pa.types.is_unsigned_integer(col.type) and (pc.max(col).as_py() or 0) > np.iinfo(np.int64).max:
            # 64-bit hashes as uint64: Arrow's cast to int64 refused them ("Integer value ... not in range"); as
            # text they stay the data's own ids, exactly
            out[column] = pc.cast(col, pa.string())
            continue
        if not whole and pa.types.is_floating(col.type) and pc.any(pc.is_nan(col)).as_py():
            # a NaN (not a null: Polars and numpy-built tables keep NaN) was an interaction rated NaN, kept without
            # min_rating and dropped without a word with it; a CSV's "NaN" reads as missing and is refused
            row = int(np.flatnonzero(pc.is_nan(col).to_numpy(zero_copy_only=False))[0])
            raise ValueError(f"{path}, row {row}: {ours[column]} is NaN: every interaction needs a user, an item and "
                             f"(when the column is there) a rating")
        out[column] = pc.cast(col, kind)
    if "timestamp" in ours:
        col = table.column(ours["timestamp"])
        # a NaN (numpy's missing float) reached Arrow's cast as "Float value nan was truncated converting to int64"
        nans = int(pc.sum(pc.is_nan(col)).as_py() or 0) if pa.types.is_floating(col.type) else 0
        if col.null_count or nans or not (pa.types.is_timestamp(col.type) or pa.types.is_integer(col.type)
                                          or pa.types.is_floating(col.type)):
            raise ValueError(f"{path}: column {ours['timestamp']!r} ({col.type}"
                             f"{f', {col.null_count} nulls' if col.null_count else ''}"
                             f"{f', {nans} NaN' if nans else ''}): a timestamp is a time or a number of seconds in "
                             f"every row")
        if pa.types.is_timestamp(col.type):  # whole seconds, as GroupLens' files (sub-second ties keep file order)
            out["timestamp"] = pc.cast(pc.cast(col, pa.timestamp("s"), safe=False), pa.int64())
        else:
            out["timestamp"] = pc.cast(pc.floor(pc.cast(col, pa.float64())), pa.int64())
        return pa.table(out).replace_schema_metadata(marks or None)
    out["timestamp"] = pa.array(np.zeros(table.num_rows, np.int64))
    return pa.table(out).replace_schema_metadata({**marks, _NO_TIME: b"1"})


def parquet_ratings(path: Path) -> list[Path]:
    """The Parquet files that `path` itself names (a .parquet file, or a pattern such as data/train-*.parquet)."""
    if path.is_file():
        return [path] if path.suffix == ".parquet" else []
    return [f for f in glob_files(path) if f.suffix == ".parquet"]


def read_ratings(path: str | Path, columns: dict[str, str] | None = None) -> pa.Table:
    """A ratings file (any GroupLens layout, header or not; or a Parquet log, or a pattern naming its pieces)
    -> Arrow table user_id, item_id, rating, timestamp."""
    path = Path(path)
    pieces = parquet_ratings(path)
    if len(pieces) > 1 or (pieces and pieces[0] != path):
        return _concat_logs([_read_ratings_parquet(f, columns) for f in pieces], pieces, path)
    if not path.is_file():
        raise ValueError(f"ratings file {path} does not exist" + (" (it is a directory)" if path.is_dir() else ""))
    if path.suffix == ".parquet":
        return _read_ratings_parquet(path, columns)
    # ratings.csv.gz (and bz2 / zstd, detected from the first bytes as the Criteo reader does) is read through the
    # decompressor: it was "holds no GroupLens ratings file", or pyarrow's parse error on the compressed bytes
    with open_criteo_stream(path) as stream:
        raw = stream.read()
    sep, has_header = _sniff(path, raw)
    # a CSV saved by Excel ("CSV UTF-8") starts with a byte order mark, which made its first header name "ï»¿user"
    data = raw.removeprefix(_UTF8_BOM)
    if sep == "::":
        data, sep = data.replace(b"::", b"\t"), "\t"  # pyarrow reads one-character separators
    names = ["user_id", "item_id", "rating", "timestamp"]
    first_line = data.split(b"\n", 2)[1 if has_header else 0]
    num_fields = len(first_line.decode("latin-1").rstrip("\r").split(sep))
    column_names = names[:num_fields]
    if has_header:  # columns by name: a header without movieId must not shift rating into the item column
        header = data.split(b"\n", 1)[0].decode("latin-1").rstrip("\r").split(sep)
        # ":token" / ":float": RecBole's atomic files type their columns in the header ("user_id:token")
        header_names = _header_map(columns)
        column_names = [header_names.get(h.strip().strip('"').split(":")[0].lower(), f"_unused{i}")
                        for i, h in enumerate(header)]
        _refuse_ambiguous(f"{path}:1", [h.strip().strip('"') for h in header],
                          [n if not n.startswith("_unused") else None for n in column_names])
        missing = [n for n in names[:2] if n not in column_names]
        if missing:
            raise ValueError(f"{path}:1: the header {header} has no column for {missing}: expected userId, movieId"
                             f"[, rating][, timestamp] (ml-20m/25m's ratings.csv), or name yours: columns={{'user': "
                             f"..., 'item': ..., 'rating': ...}} (--data.init_args.columns)")
    elif num_fields not in (3, 4):
        raise ValueError(f"{path}:{2 if has_header else 1}: {num_fields} fields separated by {sep!r}; expected "
                         f"user, item, rating[, timestamp] (implicit feedback, without a rating: start the file with "
                         f"a header line naming its columns, user{sep}item[{sep}timestamp])")
    # without a rating column (a header of user, item[, timestamp]) the log is implicit feedback, as a Parquet log
    # without one: it was refused as "cannot find the separator of 'user,item'" or "no column for ['rating']"
    included = [n for n in names if n in column_names]
    num_fields = len(included)

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

    # your own file may name users and items by strings ("A3SGXH7AUHU8GW", an ASIN): when integer ids do not parse,
    # a file with a header is read again with its ids as text (GroupLens' headerless files keep integer ids: a
    # letter there is damage). Integers first: reading text and casting it costs 2.3x on ml-25m-like files
    string_ids: set[str] = set()
    try:
        table = read(string_ids)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        error = e
        table = None
        if has_header:
            string_ids = {"user_id", "item_id"}
            try:
                table = read(string_ids)
            except (pa.ArrowInvalid, pa.ArrowTypeError) as e2:
                error = e2
        if table is None:
            ids = "numeric user, item" if not string_ids else "user, item"
            checked = [(column_names.index(n), t) for n, t in (("user_id", int), ("item_id", int), ("rating", float))
                       if n in column_names]
            bad_line = _first_bad_line(data, sep, has_header, [column_names.index(n) for n in string_ids], checked)
            raise ValueError(f"{path}{bad_line}: cannot parse the ratings ({error}); expected {ids}, a numeric "
                             f"rating[, timestamp] separated by {sep!r}") from None
    _refuse_missing(table, data, path, has_header)
    for name in string_ids:
        table = table.set_column(table.column_names.index(name), name, _ids_from_text(table.column(name), data, path,
                                                                                      name, has_header))
    marks = {}
    if "rating" not in included:  # implicit feedback: every interaction 1.0 (the mark tells min_rating so)
        table = table.add_column(2, "rating", pa.array(np.ones(table.num_rows, np.float32)))
        marks[_NO_RATING] = b"1"
    if "timestamp" not in included:
        # zeros keep one schema for every file; the mark tells a temporal split there is no time to order by
        table = table.append_column("timestamp", pa.array(np.zeros(table.num_rows, np.int64)))
        table = table.replace_schema_metadata({**marks, _NO_TIME: b"1"})
    else:
        # read as float, kept as whole seconds: a log's fractional timestamps (1700000000.25) were refused, though
        # no split uses them (GroupLens' integer seconds, < 2**53, pass through float64 exactly)
        import pyarrow.compute as pc

        where = table.column_names.index("timestamp")
        table = table.set_column(where, "timestamp", pc.cast(pc.floor(table.column("timestamp")), pa.int64()))
        table = table.replace_schema_metadata(marks or None)
    return table


def _empty_ids(col: pa.ChunkedArray) -> int | None:
    """The first row whose string id is null or blank, or None."""
    import pyarrow.compute as pc

    missing = pc.or_kleene(pc.is_null(col), pc.equal(pc.utf8_trim_whitespace(col), "")).fill_null(True)
    if not pc.any(missing).as_py():
        return None
    return int(np.flatnonzero(missing.to_numpy(zero_copy_only=False))[0])


def _ids_from_text(col: pa.ChunkedArray, data: bytes, path: Path, name: str, has_header: bool) -> pa.ChunkedArray:
    """A header-named id column read as text: int64 when every id is an integer, else the strings (with a warning
    when integers and other ids are mixed: ISBN-like ids beside ASINs are fine, a damaged row is not)."""
    import pyarrow.compute as pc

    col = pc.utf8_trim_whitespace(col)
    # an empty field is a missing id, not the id "" (it turned a whole integer column into strings, with a warning
    # that called the empty field a non-integer id)
    empty = _empty_ids(col)
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
                      f"id is read as a string. If those rows are damage, not ids, fix them", stacklevel=3)
    return col


def _keyed_like(side: dict, strings: bool, where: Path, what: str) -> dict:
    """A side file's rows keyed as the ratings' ids are: str keys for string ids, int keys for integer ids; a key
    of the other kind cannot be one of the ratings' users or items (dropped, logged)."""
    if strings:
        return {str(k): v for k, v in side.items()}
    kept = {k: v for k, v in side.items() if isinstance(k, int)}
    if len(kept) < len(side) and what:
        log.info("%s: %d %s rows of the side file have ids that are not integers, unlike the ratings': not joined",
                 where, len(side) - len(kept), what)
    return kept


def _is_text(column: pa.ChunkedArray) -> bool:
    return pa.types.is_string(column.type) or pa.types.is_large_string(column.type)


def _indexed(column: pa.ChunkedArray, extra: list) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct ids of the column and of `extra`, a side file's keys, sorted; each row's place among them).

    Raw ids are int64, or fixed-width unicode for string ids (sortable, saved without pickle). String ids are
    dictionary-encoded by Arrow and only the distinct ones sorted: numpy's unique + searchsorted over every row's
    string took 22 s for 5M rows (Arrow: 5.5 s)."""
    if not _is_text(column):
        raw = np.asarray(column)
        ids = np.unique(np.concatenate([raw, np.asarray(extra, dtype=np.int64)]) if extra else raw)
        return ids, np.searchsorted(ids, raw)
    import pyarrow.compute as pc

    chunks = [c.cast(pa.string()) for c in column.chunks] + ([pa.array(extra, pa.string())] if extra else [])
    encoded = pc.dictionary_encode(pa.chunked_array(chunks, pa.string())).combine_chunks()
    order = pc.sort_indices(encoded.dictionary).to_numpy()  # bytewise: UTF-8's order is the code points' (numpy's)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    ids = encoded.dictionary.take(pa.array(order)).to_numpy(zero_copy_only=False).astype(str)
    return ids, rank[encoded.indices.to_numpy(zero_copy_only=False)[:len(column)]].astype(np.int64)


def _bucket_age(age: int) -> int:
    return 1 + sum(age >= e for e in _AGE_EDGES)  # 1..7; 0 = missing


def _zip_bucket(zip_code: str) -> int:
    return 1 + int(zip_code[0]) if zip_code[:1].isdigit() else 11  # US zip region 0-9; 11: other (Canada, ...)


def _decade(year: int | None) -> int:
    return 0 if year is None else max(1, (year - 1900) // 10 + 2)  # 1: before 1910, ... ; 0 = missing


class _Vocab:
    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, value: str) -> int:
        if not value:
            return 0
        return self.ids.setdefault(value, len(self.ids) + 1)

    def __len__(self) -> int:
        return len(self.ids) + 1


def _token(value: str) -> int | str:
    """An id of a side file: an int where it is one (GroupLens, RecBole's ml-100k), else the string (an ASIN)."""
    text = value.strip()
    return int(text) if re.fullmatch(r"-?\d{1,18}", text) else text


def _atomic_rows(path: Path):
    """RecBole's atomic file (tab-separated, header "name:type"): one {name: text} per line; none if absent."""
    if not path.is_file():
        return
    lines = _read_text(path).splitlines()
    names = [h.split(":")[0] for h in lines[0].split("\t")] if lines else []
    for line in lines[1:]:
        if line.strip():
            yield dict(zip(names, line.split("\t")))


def _read_side(data_dir: Path, layout: str) -> tuple[dict[int, dict], dict[int, dict], dict[int, str], dict]:
    """Raw user id -> {feature: id}, raw item id -> {feature: id or [ids]}, item id -> title, feature sizes."""
    users: dict[int, dict] = {}
    items: dict[int, dict] = {}
    titles: dict[int, str] = {}
    gender, occupation = _Vocab(), _Vocab()
    genre = _Vocab()
    if layout == "ml-100k":
        if (data_dir / "u.user").is_file():
            for n, line in enumerate(_read_text(data_dir / "u.user").splitlines(), 1):
                f = line.split("|")
                if len(f) < 5:
                    raise ValueError(f"{data_dir / 'u.user'}:{n}: {len(f)} fields; "
                                     f"expected id|age|gender|occupation|zip")
                users[int(f[0])] = {"age": _bucket_age(int(f[1])), "gender": gender(f[2]),
                                    "occupation": occupation(f[3]), "zip": _zip_bucket(f[4])}
        if (data_dir / "u.item").is_file():
            for n, line in enumerate(_read_text(data_dir / "u.item").splitlines(), 1):
                f = line.split("|")
                if len(f) < 24:
                    raise ValueError(f"{data_dir / 'u.item'}:{n}: {len(f)} fields; expected id|title|date|video date|"
                                     f"url|19 genre flags")
                year = re.search(r"(\d{4})$", f[2])
                items[int(f[0])] = {"genre": [g + 1 for g, flag in enumerate(f[5:24]) if flag == "1"],
                                    "year": _decade(int(year.group(1)) if year else None)}
                titles[int(f[0])] = f[1]
    elif layout == "ml-1m":
        if (data_dir / "users.dat").is_file():
            for line in _read_text(data_dir / "users.dat").splitlines():
                f = line.split("::")
                users[int(f[0])] = {"gender": gender(f[1]), "age": _bucket_age(int(f[2])),
                                    "occupation": int(f[3]) + 1, "zip": _zip_bucket(f[4])}
        if (data_dir / "movies.dat").is_file():
            for line in _read_text(data_dir / "movies.dat").splitlines():
                f = line.split("::")
                year = re.search(r"\((\d{4})\)\s*$", f[1])
                items[int(f[0])] = {"genre": [genre(g) for g in f[2].split("|") if g],
                                    "year": _decade(int(year.group(1)) if year else None)}
                titles[int(f[0])] = f[1]
    elif layout == "recbole":
        stem = detect_layout(data_dir)[1].stem
        for row in _atomic_rows(data_dir / f"{stem}.user"):
            age = row.get("age", "")
            users[_token(row["user_id"])] = {"age": _bucket_age(int(age)) if age.isdigit() else 0,
                                          "gender": gender(row.get("gender", "")),
                                          "occupation": occupation(row.get("occupation", "")),
                                          "zip": _zip_bucket(row["zip_code"]) if row.get("zip_code") else 0}
        for row in _atomic_rows(data_dir / f"{stem}.item"):
            year = row.get("release_year", "")
            # ml-100k: "class", ml-1m: "genre", RecBole's Amazon sets: "categories"
            genres = (row.get("class") or row.get("genre") or row.get("categories") or "").split()
            items[_token(row["item_id"])] = {"genre": [genre(g) for g in genres],
                                          "year": _decade(int(year)) if year.isdigit() else 0}
            titles[_token(row["item_id"])] = row.get("movie_title") or row.get("title") or ""
    elif (data_dir / "movies.csv").is_file():
        import csv

        rows = csv.reader(io.StringIO(_read_text(data_dir / "movies.csv")))
        next(rows, None)
        for f in rows:
            if len(f) < 3:
                continue
            year = re.search(r"\((\d{4})\)\s*$", f[1])
            items[int(f[0])] = {"genre": [genre(g) for g in f[2].split("|") if g and g != "(no genres listed)"],
                                "year": _decade(int(year.group(1)) if year else None)}
            titles[int(f[0])] = f[1]
    sizes = {"gender": len(gender), "occupation": max(len(occupation), 22), "age": len(_AGE_EDGES) + 2, "zip": 12,
             "genre": max(len(genre), 20), "year": 16}
    return users, items, titles, sizes


_OWN_FILE = ("Your own interactions: save them as <folder>/ratings.csv with the header user,item[,rating][,timestamp] "
             "(integer or string ids; no rating: implicit feedback, 1.0), or as <folder>/ratings.parquet with "
             "columns user, item[, rating][, timestamp], and pass the folder (or pass a .parquet file or pattern "
             "itself)")


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


# ----------------------------------------------------------------------------------------------
# splits


def ro_split(user_N: Tensor, ratios: Sequence[float], seed: int) -> Tensor:
    """RecBole's RO split: per user, random order, ratio counts -> part of each interaction (0, 1, 2)."""
    g = torch.Generator().manual_seed(seed)
    return _ratio_parts(user_N, ratios, torch.randperm(user_N.shape[0], generator=g))


def to_split(user_N: Tensor, time_N: Tensor, ratios: Sequence[float]) -> Tensor:
    """RecBole's TO split: per user, time order (ties: file order), ratio counts -> part (0, 1, 2)."""
    return _ratio_parts(user_N, ratios, torch.sort(time_N, stable=True).indices)


def loo_split(user_N: Tensor, time_N: Tensor) -> Tensor:
    """Leave-one-out (RecBole's LS "valid_and_test"): per user in time order, the last interaction is
    test (2), the one before validation (1), the rest train (0); a user leaves out at most n - 1."""
    order_N, pos_N, count_N = _grouped(user_N, torch.sort(time_N, stable=True).indices)
    left_out_N = torch.clamp(count_N - 1, max=2)
    part_sorted = torch.where(pos_N >= count_N - left_out_N, pos_N - count_N + 3, 0)
    part_N = torch.empty_like(part_sorted)
    part_N[order_N] = part_sorted
    return part_N


def _grouped(user_N: Tensor, within_N: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Interactions grouped by user, in `within_N`'s order inside a user: (order_N, position in its user,
    its user's count), the last two in that grouped order."""
    order_N = within_N[torch.sort(user_N[within_N], stable=True).indices]
    _, counts_U = torch.unique_consecutive(user_N[order_N], return_counts=True)
    starts_U = torch.cumsum(counts_U, 0) - counts_U
    pos_N = torch.arange(user_N.shape[0]) - torch.repeat_interleave(starts_U, counts_U)
    return order_N, pos_N, torch.repeat_interleave(counts_U, counts_U)


def _ratio_parts(user_N: Tensor, ratios: Sequence[float], within_N: Tensor) -> Tensor:
    """Per user, in `within_N`'s order, RecBole's ratio counts: the first int-rounded share trains, and so on."""
    order_N, pos_in_user, _ = _grouped(user_N, within_N)
    _, counts_U = torch.unique_consecutive(user_N[order_N], return_counts=True)
    tot_U = counts_U.double()
    cnt_UP = torch.stack([torch.floor(tot_U * r) for r in ratios], 1)  # int(ratio * tot), as RecBole
    cnt_UP[:, 0] = tot_U - cnt_UP[:, 1:].sum(1)
    for p in range(len(ratios) - 1, 0, -1):  # RecBole: a part that rounds to 0 gets one from training
        bump = (cnt_UP[:, 0] > 1) & (tot_U * ratios[p] > 0) & (tot_U * ratios[p] < 1)
        cnt_UP[bump, p] += 1
        cnt_UP[bump, 0] -= 1
    ends_NP = torch.repeat_interleave(cnt_UP.cumsum(1), counts_U, dim=0)
    part_sorted = (pos_in_user.unsqueeze(1).double() >= ends_NP).sum(1)
    part_N = torch.empty(user_N.shape[0], dtype=torch.int64)
    part_N[order_N] = part_sorted
    return part_N


def _csr_by_user(user_N: Tensor, item_N: Tensor, num_users: int) -> tuple[Tensor, Tensor]:
    order = torch.argsort(user_N * (item_N.max() + 1 if item_N.numel() else 1) + item_N)
    counts = torch.bincount(user_N, minlength=num_users)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    return offsets, item_N[order]


# ----------------------------------------------------------------------------------------------
# datasets: whole batches from index lists


class InteractionDataset(Dataset):
    """Training (user, item) pairs; one item of the loader = one RetrievalBatch (`__getitems__`).

    With `num_negatives=1` each pair gets one item drawn uniformly among the items the user has
    not interacted with in training (BPR); rejection is redrawn a few times, whole-batch.
    """

    def __init__(self, user_N: Tensor, item_N: Tensor, users: FeatureTable, items: FeatureTable, num_items: int,
                 num_negatives: int, seed: int, epoch_in_seed: bool = False) -> None:
        self.user_N, self.item_N = user_N, item_N
        # unshuffled, a pair is in the same batch every epoch: the epoch (told by the loader's set_epoch, in shared
        # memory so that loader workers see it) then varies its negatives (see _batch_generator)
        self.epoch_in_seed = epoch_in_seed
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.users, self.items, self.num_items = users, items, num_items
        counts_I = torch.bincount(item_N, minlength=num_items).double()
        # an item absent from training has frequency 0; clamp so log q stays finite (it is never in a batch)
        self.log_q_I = torch.log(counts_I.clamp(min=1) / max(item_N.shape[0], 1)).float()
        self.num_negatives = num_negatives
        self._pairs_sorted = torch.unique(user_N * num_items + item_N)  # sorted; each seen (user, item) once
        self._seed_key = (seed + 7).to_bytes(8, "little", signed=True)
        if num_negatives:
            seen_U = torch.bincount(self._pairs_sorted // num_items)
            full = int((seen_U >= num_items).sum())
            if full:
                warnings.warn(f"{full} training users interacted with every one of the {num_items} items: BPR has "
                              f"no unseen item to draw as their negative, so their pairs train against a seen one. "
                              f"Drop those users, or use loss='softmax' (num_negatives=0)", UserWarning, stacklevel=2)

    def __len__(self) -> int:
        return self.user_N.shape[0]

    def set_epoch(self, epoch: int) -> None:
        """The pass the loader starts (StatefulBatchLoader calls it; the fit loop's epoch in a Trainer, also when a run
        resumes)."""
        self._epoch[0] = int(epoch)

    def _batch_generator(self, idx_B: Tensor) -> torch.Generator:
        """A generator seeded by the batch itself (its pair indices and the module's seed).

        Not one generator advanced batch by batch: that would tie a batch's negatives to how many
        batches this process drew before (a resumed run, a loader worker, the loop's read-ahead), so a
        run resumed mid-epoch would train other negatives. Seeded by content, a batch is the same
        wherever and whenever it is drawn; shuffling makes each epoch's batches differ. Without shuffling
        (`epoch_in_seed`) the epoch is part of the seed: each pair met the same negative in every epoch.
        """
        data = idx_B.numpy().tobytes()
        if self.epoch_in_seed:
            data += int(self._epoch[0]).to_bytes(8, "little", signed=True)
        digest = hashlib.blake2b(data, digest_size=8, key=self._seed_key).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))

    def _seen(self, user_B: Tensor, item_B: Tensor) -> Tensor:
        key_B = user_B * self.num_items + item_B
        pos = torch.searchsorted(self._pairs_sorted, key_B).clamp(max=self._pairs_sorted.numel() - 1)
        return self._pairs_sorted[pos] == key_B

    def _unseen_item(self, user: int, gen: torch.Generator) -> int:
        """An item drawn uniformly among those `user` has not seen, exactly (any item if it has seen all)."""
        lo, hi = torch.searchsorted(self._pairs_sorted, torch.tensor([user, user + 1]) * self.num_items).tolist()
        seen = self._pairs_sorted[lo:hi] - user * self.num_items  # sorted
        if seen.numel() >= self.num_items:
            return int(torch.randint(self.num_items, (1,), generator=gen))  # none unseen (warned at construction)
        r = torch.randint(self.num_items - seen.numel(), (1,), generator=gen)
        # the r-th unseen item is r plus the seen items at or below it: seen[j] - j counts the unseen below seen[j]
        return int(r + torch.searchsorted(seen - torch.arange(seen.numel()), r, right=True))

    def _negatives(self, user_B: Tensor, idx_B: Tensor) -> Tensor:
        gen = self._batch_generator(idx_B)
        neg_B = torch.randint(self.num_items, user_B.shape, generator=gen)
        for _ in range(10):  # redraw the ones the user has (few: ml-100k users hold ~6% of items)
            seen_B = self._seen(user_B, neg_B)
            if not bool(seen_B.any()):
                return neg_B
            neg_B = torch.where(seen_B, torch.randint(self.num_items, user_B.shape, generator=gen), neg_B)
        # still seen after 10 draws (a user who has seen most items; the last draw was never checked): drawn
        # among the unseen items exactly, which keeps the negative uniform over them
        for j in self._seen(user_B, neg_B).nonzero().flatten().tolist():
            neg_B[j] = self._unseen_item(int(user_B[j]), gen)
        return neg_B

    def __getitems__(self, indices: Sequence[int]) -> RetrievalBatch:
        idx_B = torch.as_tensor(indices, dtype=torch.int64)
        user_B, item_B = self.user_N[idx_B], self.item_N[idx_B]
        batch = RetrievalBatch(self.users.kjt(user_B), self.items.kjt(item_B), user_B, item_B, self.log_q_I[item_B])
        if self.num_negatives:
            neg_B = self._negatives(user_B, idx_B)
            batch.neg_item_features, batch.neg_item_index = self.items.kjt(neg_B), neg_B
        return batch

    def __getitem__(self, index):
        return self.__getitems__([index] if isinstance(index, int) else index)


class UserRankingDataset(Dataset):
    """One sample per user to rank; index -1 is padding (dropped: see `EvalShardSampler`)."""

    def __init__(self, users_U: Tensor, users: FeatureTable, target: tuple[Tensor, Tensor],
                 exclude: tuple[Tensor, Tensor]) -> None:
        self.users_U, self.users = users_U, users
        self.target, self.exclude = target, exclude

    def __len__(self) -> int:
        return self.users_U.shape[0]

    def __getitems__(self, indices: Sequence[int]) -> RankingBatch:
        idx_U = torch.as_tensor(indices, dtype=torch.int64)
        user_U = self.users_U[idx_U[idx_U >= 0]]
        t_len, t_items = _gather_csr(*self.target, user_U)
        x_len, x_items = _gather_csr(*self.exclude, user_U)
        zero = torch.zeros(1, dtype=torch.int64)
        return RankingBatch(self.users.kjt(user_U), user_U, torch.cat([zero, t_len.cumsum(0)]), t_items,
                            torch.cat([zero, x_len.cumsum(0)]), x_items)

    def __getitem__(self, index):
        return self.__getitems__([index] if isinstance(index, int) else index)


class EvalShardSampler(DistributedSampler):
    """Every user once over all ranks (DistributedSampler would repeat some to even the shares, which
    counts them twice in the metrics): rank r takes users r, r + W, ...; shorter shares are padded
    with -1, which the dataset drops, so every rank runs the same number of batches."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)

    def __iter__(self):
        n, w = len(self.dataset), self.num_replicas
        mine = list(range(self.rank, n, w))
        return iter(mine + [-1] * (self.num_samples - len(mine)))

    def __len__(self) -> int:
        return self.num_samples


# ----------------------------------------------------------------------------------------------
# LightningDataModule


@dataclass
class MovieLensReport:
    layout: str = ""
    num_ratings: int = 0
    num_interactions: int = 0  # after min_rating
    num_users: int = 0
    num_items: int = 0
    split_sizes: dict = field(default_factory=dict)
    heldout_items_unseen_in_train: dict = field(default_factory=dict)  # split -> pairs whose item has no train row
    users_without_heldout: dict = field(default_factory=dict)  # split -> users skipped by the ranking metrics
    duplicates_dropped: int = 0  # repeated (user, item) rows, only the first kept


def default_cache_dir() -> Path:
    """Where a `datasets.Dataset` given as data_dir is written (beside datasets' own cache)."""
    import datasets.config

    return Path(datasets.config.HF_DATASETS_CACHE) / "lightning_rec" / "movielens"


class MovieLensDataModule(pl.LightningDataModule):
    """MovieLens as implicit feedback: training pairs (RetrievalBatch) and full-ranking users (RankingBatch).

    Args:
        data_dir: an unpacked GroupLens folder (ml-100k, ml-1m, ml-20m, ml-25m, ...), your own log (a folder
            with ratings.csv or ratings.parquet, a .parquet file or a pattern), or, in Python, a
            `datasets.Dataset` of interactions (written once as ratings.parquet in a folder named by its
            fingerprint, under datasets' cache: `lightning_rec.data.hf_dataset`).
        split: "ro_811" (RecBole's random-order 8:1:1 per user), "to_811" (the same in time order), "loo"
            (leave-one-out in time order), ml-100k's "u1".."u5", "ua", "ub", or "given" (data_dir holds the log's own
            train / valid / test files, or is a DatasetDict) (see the module's docstring).
        min_rating: None: every rating is an interaction; a number: only ratings >= it.
        side_features: add age/gender/occupation/zip and genre/year features where the layout has them.
        batch_size: training pairs per batch.
        eval_batch_size: users per evaluation batch.
        num_negatives: 0 (in-batch negatives) or 1 (one sampled negative per pair, for BPR).
        eval_test_in_fit: the validation loop also ranks the test split (logged as test_*), so one
            `fit` reports both; `trainer.test` works either way.
        seed: the random split (ro_811) and the negatives (the shuffle order too).
        columns: your log's column names where they are not GroupLens' (a headed ratings.csv or a Parquet log):
            {"user": "reviewer_id", "item": "parent_asin", "rating": "stars", "timestamp": "time"}, any of them.
        shuffle: shuffle the training pairs each epoch.
        drop_last: drop the last, smaller training batch.
        num_workers: DataLoader worker processes (0: load in the main process).
        pin_memory: pin batches in host memory for the copy to a GPU.
        prefetch_factor: batches each worker loads ahead (None: torch's default).
        persistent_workers: keep the workers between epochs (None: whenever there are any).
    """

    def __init__(self, data_dir: str, split: str = "ro_811", min_rating: float | None = None,
                 side_features: bool = True, batch_size: int = 1024, eval_batch_size: int = 256,
                 num_negatives: int = 0, eval_test_in_fit: bool = False, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, num_workers: int = 0, pin_memory: bool = False,
                 columns: dict[str, str] | None = None, prefetch_factor: int | None = None,
                 persistent_workers: bool | None = None) -> None:
        super().__init__()
        # said here, not when the first loader is built
        worker_options("MovieLensDataModule", num_workers, pin_memory, prefetch_factor, persistent_workers)
        self.prefetch_factor, self.persistent_workers = prefetch_factor, persistent_workers
        # a datasets.Dataset of interactions becomes a folder holding its ratings.parquet (a DatasetDict, with
        # split="given": <split>.parquet each), before the arguments are saved as hyperparameters
        # (lightning_rec.data.hf_dataset)
        given = data_dir
        data_dir = dataset_path(data_dir, "MovieLensDataModule data_dir", default_cache_dir(), "ratings.parquet",
                                split_names=tuple(_SPLIT_WORDS) if split == GIVEN else (),
                                dict_hint=", or split='given' to train, validate and test on its splits as they are")
        # compared over the ranks at setup: a Dataset shuffled without a seed differs between them
        self._dataset_rows = {"data_dir": rows_digest(given)} if is_hf_dataset(given) else {}
        self.save_hyperparameters()
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
        if num_negatives not in (0, 1):
            raise ValueError(f"num_negatives={num_negatives}: use 0 (in-batch negatives) or 1 (BPR)")
        for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MovieLensDataModule {name}={value!r}: give a positive number per batch")
        _header_map(columns)  # an unknown field is said here, not at setup
        self.columns = dict(columns) if columns else None
        self.data_dir = Path(data_dir)
        # here, on every rank before any process group exists, as well as in prepare_data (the folder may be
        # removed in between): found only in prepare_data (local rank 0), it left rank 1 in a barrier, whose gloo
        # "Connection closed by peer" traceback was the last thing on the screen
        self._check_data_dir()
        self.split, self.min_rating, self.side_features = split, min_rating, side_features
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.num_negatives, self.eval_test_in_fit, self.seed = num_negatives, eval_test_in_fit, seed
        self.shuffle, self.drop_last, self.num_workers, self.pin_memory = shuffle, drop_last, num_workers, pin_memory
        self.report = MovieLensReport()
        self.datasets: dict[str, Dataset] = {}
        self.ratings = None  # datasets.Dataset after setup
        self._built = False

    # building ---------------------------------------------------------------------------------

    def _ratings_of(self, path: Path) -> pa.Table:
        table = read_ratings(path, self.columns)
        self.report.num_ratings += table.num_rows
        if self.min_rating is not None:
            if table.schema.metadata and _NO_RATING in table.schema.metadata:
                # every interaction reads as 1.0: min_rating=4 left none, and the error said only "lower it"
                raise ValueError(f"min_rating={self.min_rating}: {path} has no rating column (implicit feedback: every "
                                 f"interaction counts, as 1.0), so there is nothing to threshold: leave min_rating "
                                 f"out, or name the rating column: columns={{'rating': ...}}")
            keep = np.asarray(table.column("rating")) >= self.min_rating
            table = table.filter(pa.array(keep))
        return table

    def _build(self) -> None:
        import datasets

        if not self.data_dir.is_dir() and not parquet_ratings(self.data_dir):
            raise ValueError(f"MovieLens data_dir {self.data_dir} is not a folder: pass the unpacked GroupLens "
                             f"folder (e.g. ml-100k/ with u.data, u.user, u.item)")
        given = given_split_files(self.data_dir) if self.split == GIVEN else None
        layout, ratings_path = ("given", given[0][0]) if given else detect_layout(self.data_dir)
        self.report.layout = layout
        if given:
            files, parts = zip(*[(f, p) for p in (0, 1, 2) for f in given[p]])
            tables = [self._ratings_of(f) for f in files]
            table = _concat_logs(tables, list(files), self.data_dir)
            part_N = torch.from_numpy(np.concatenate([np.full(t.num_rows, p) for t, p in zip(tables, parts)]))
        elif self.split in OFFICIAL_SPLITS:
            if layout != "ml-100k":
                raise ValueError(f"split={self.split!r} is one of ml-100k's official splits, but {self.data_dir} is "
                                 f"{layout}: use split='ro_811'")
            base, test = self.data_dir / f"{self.split}.base", self.data_dir / f"{self.split}.test"
            tables = [self._ratings_of(base), self._ratings_of(test)]
            parts = [np.full(tables[0].num_rows, 0), np.full(tables[1].num_rows, 2)]
            table = pa.concat_tables(tables)
            part_N = torch.from_numpy(np.concatenate(parts))
        else:
            table = self._ratings_of(ratings_path)
            part_N = None
            if self.split in TEMPORAL_SPLITS and table.schema.metadata and _NO_TIME in table.schema.metadata:
                raise ValueError(f"split={self.split!r} orders each user's interactions by time, but {ratings_path} "
                                 f"has no timestamp column: add one (user, item, rating, timestamp) or use "
                                 f"split='ro_811'")
        if table.num_rows == 0:
            raise ValueError(f"no interactions left in {ratings_path}" +
                             (f" with min_rating={self.min_rating}: lower it" if self.min_rating is not None else ""))
        side_layout = layout
        if given:  # split files beside GroupLens' side files (u.user / u.item, users.dat / movies.dat, movies.csv)
            side_layout = next((name for name, files in (("ml-100k", ("u.user", "u.item")),
                                                         ("ml-1m", ("users.dat", "movies.dat")))
                                if any((self.data_dir / f).is_file() for f in files)), layout)
        users, items, titles, sizes = _read_side(self.data_dir, side_layout)
        if self.side_features and not users and not items:
            warnings.warn(f"side_features=True, but {self.data_dir} has no user or item file to read them from "
                          f"(u.user / u.item, users.dat / movies.dat, movies.csv, RecBole's .user / .item): the "
                          f"towers get the id features only; side_features=False says so without this warning",
                          stacklevel=2)
        if not self.side_features:
            users, items = {}, {}  # ids only (titles still name the items in logs)
        user_col, item_col = table.column("user_id"), table.column("item_id")
        # side files key users and items as the ratings do (ints; RecBole's Amazon files: strings): keys of the
        # other kind cannot be one of these users or items
        users = _keyed_like(users, _is_text(user_col), self.data_dir, "user")
        items = _keyed_like(items, _is_text(item_col), self.data_dir, "item")
        titles = _keyed_like(titles, _is_text(item_col), self.data_dir, "")
        self.user_ids, user_N = _indexed(user_col, list(users))
        self.item_ids, item_N = _indexed(item_col, list(items))
        user_N, item_N = torch.from_numpy(user_N), torch.from_numpy(item_N)
        # implicit feedback is one interaction per (user, item): a repeated pair (a log of clicks or re-ratings,
        # never in GroupLens' files) would be split into training and test alike, and the test copy, kept as a
        # target though seen in training, scored as found: metrics inflated, silently
        # under a temporal split the earliest copy is the interaction (the file's first may be a later one)
        time_N = np.asarray(table.column("timestamp"))
        first_N = np.argsort(time_N, kind="stable") if self.split in TEMPORAL_SPLITS else np.arange(table.num_rows)
        _, first_P = np.unique((user_N.numpy() * len(self.item_ids) + item_N.numpy())[first_N], return_index=True)
        if first_P.shape[0] < table.num_rows:
            keep_N = np.sort(first_N[first_P])
            self.report.duplicates_dropped = table.num_rows - keep_N.shape[0]
            warnings.warn(f"{ratings_path.parent}: {self.report.duplicates_dropped} repeated (user, item) rows dropped "
                          f"(the first of each pair kept): an interaction is a (user, item) pair, and a repeat split "
                          f"into both training and test would be a target the model has seen", stacklevel=2)
            table, user_N, item_N = table.take(pa.array(keep_N)), user_N[keep_N], item_N[keep_N]
            if part_N is not None:
                part_N = part_N[keep_N]
        table = table.append_column("user", pa.array(user_N.numpy())).append_column("item", pa.array(item_N.numpy()))
        self.ratings = datasets.Dataset(table)  # Arrow-backed; columns read zero-copy below
        num_users, num_items = len(self.user_ids), len(self.item_ids)
        self.num_users, self.num_items = num_users, num_items
        self.user_features = self._feature_table("user", self.user_ids, users, ("age", "gender", "occupation", "zip"),
                                                 sizes)
        self.item_features = self._feature_table("item", self.item_ids, items, ("year",), sizes, bags=("genre",))
        self.item_titles = [titles.get(i) or str(i) for i in self.item_ids.tolist()]

        if part_N is None:
            time_N = torch.tensor(np.asarray(table.column("timestamp")))
            part_N = {"ro_811": lambda: ro_split(user_N, (0.8, 0.1, 0.1), self.seed),
                      "to_811": lambda: to_split(user_N, time_N, (0.8, 0.1, 0.1)),
                      "loo": lambda: loo_split(user_N, time_N)}[self.split]()
        self.part_N = part_N
        r = self.report
        r.num_interactions, r.num_users, r.num_items = table.num_rows, num_users, num_items
        train = part_N == 0
        csr = {p: _csr_by_user(user_N[part_N == p], item_N[part_N == p], num_users) for p in (0, 1, 2)}
        seen_val = csr[0]
        tv = (part_N == 0) | (part_N == 1)
        seen_test = _csr_by_user(user_N[tv], item_N[tv], num_users)
        # ml-100k's official splits, and given splits without a validation file: validation = test
        official = self.split in OFFICIAL_SPLITS or (given is not None and not given[1])
        if official:
            csr[1], seen_val = csr[2], csr[0]
        train_items = torch.zeros(num_items, dtype=torch.bool)
        train_items[item_N[train]] = True
        all_users = torch.arange(num_users)
        self.datasets["train"] = InteractionDataset(user_N[train], item_N[train], self.user_features,
                                                    self.item_features, num_items, self.num_negatives, self.seed)
        self.datasets["val"] = UserRankingDataset(all_users, self.user_features, csr[1], seen_val)
        self.datasets["test"] = UserRankingDataset(all_users, self.user_features, csr[2],
                                                   csr[0] if official else seen_test)
        for name, p in (("val", 1), ("test", 2)):
            in_part = part_N == (2 if official else p)
            r.split_sizes[name] = int(in_part.sum())
            r.heldout_items_unseen_in_train[name] = int((~train_items[item_N[in_part]]).sum())
            r.users_without_heldout[name] = int((csr[p][0].diff() == 0).sum())
        r.split_sizes["train"] = int(train.sum())
        empty = [name for name in ("val", "test") if r.split_sizes[name] == 0]
        if empty and given:
            warnings.warn(f"{self.data_dir}: the {' and '.join(empty)} split{'s are' if len(empty) > 1 else ' is'} "
                          f"empty, so {'its' if len(empty) == 1 else 'their'} ranking metrics will be NaN: its file "
                          f"holds no interaction left after min_rating and repeated pairs (a pair also in an earlier "
                          f"split counts there)", stacklevel=2)
        elif empty:  # said here, with the cause; the metrics can only say "NaN" at the end of the first validation
            warnings.warn(f"{self.data_dir}: the {' and '.join(empty)} split{'s are' if len(empty) > 1 else ' is'} "
                          f"empty, so {'its' if len(empty) == 1 else 'their'} ranking metrics will be NaN: split "
                          f"{self.split!r} holds a user's item out only from "
                          f"{'its .test file' if official else '3 (validation) or 2 (test)'} "
                          f"interactions on, and these {r.num_users} users have at most "
                          f"{int(torch.bincount(user_N).max())}", stacklevel=2)
        unseen = r.heldout_items_unseen_in_train["test"]
        if unseen:
            log.info("MovieLens %s: %d held-out test pairs are items never seen in training (still ranked)",
                     self.split, unseen)
        self._built = True

    def _feature_table(self, kind: str, ids: np.ndarray, side: dict[int, dict], names: Sequence[str],
                       sizes: dict, bags: Sequence[str] = ()) -> FeatureTable:
        n = len(ids)
        single = {f"{kind}_id": (torch.arange(n), n)}
        if side:
            for name in names:
                col = torch.tensor([side.get(i, {}).get(name, 0) for i in ids.tolist()], dtype=torch.int64)
                if bool((col != 0).any()):
                    single[name] = (col, max(sizes[name], int(col.max()) + 1))
        bag_tables = {}
        for name in bags if side else ():
            rows = [side.get(i, {}).get(name, []) for i in ids.tolist()]
            if not any(rows):
                continue
            lengths = torch.tensor([len(x) for x in rows], dtype=torch.int64)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            values = torch.tensor([v for x in rows for v in x], dtype=torch.int64)
            bag_tables[name] = (offsets, values, max(sizes[name], int(values.max()) + 1))
        return FeatureTable(single, bag_tables)

    def _check_data_dir(self) -> None:
        if parquet_ratings(self.data_dir):
            return
        if self.data_dir.is_file():
            raise ValueError(f"MovieLens data_dir {self.data_dir} is a file, not a folder. {_OWN_FILE}")
        if not self.data_dir.is_dir():
            raise ValueError(f"MovieLens data_dir {self.data_dir} is not a folder: pass the unpacked GroupLens "
                             f"folder (download https://grouplens.org/datasets/movielens/; --data.data_dir on the "
                             f"command line)")

    def prepare_data(self) -> None:
        self._check_data_dir()

    def setup(self, stage: str | None = None) -> None:
        check_same_rows(self._dataset_rows, "MovieLensDataModule")
        if not self._built:
            self._build()

    # what a model needs to know ------------------------------------------------------------------

    def _need_setup(self) -> None:
        if not self._built:
            raise ValueError("MovieLensDataModule.setup() has not run: call dm.setup() (Trainer.fit does) first")

    @property
    def user_num_embeddings(self) -> dict[str, int]:
        self._need_setup()
        return self.user_features.num_embeddings

    @property
    def item_num_embeddings(self) -> dict[str, int]:
        self._need_setup()
        return self.item_features.num_embeddings

    def user_catalog(self, rows: Tensor | None = None) -> KeyedJaggedTensor:
        """Users' features (all, rows 0..U-1, or the given rows): what the user tower embeds (`user_ids[row]` is
        the data's own id)."""
        self._need_setup()
        return self.user_features.kjt(torch.arange(self.num_users) if rows is None else rows.cpu())

    def item_catalog(self, rows: Tensor | None = None) -> KeyedJaggedTensor:
        """Items' features (all, rows 0..I-1, or the given rows): what a retrieval model embeds per evaluation."""
        self._need_setup()
        return self.item_features.kjt(torch.arange(self.num_items) if rows is None else rows.cpu())

    # loaders ------------------------------------------------------------------------------------

    def _loader_options(self) -> dict:
        # read at each loader (not kept from __init__): a data module's num_workers may be set after construction
        return worker_options("MovieLensDataModule", self.num_workers, self.pin_memory, self.prefetch_factor,
                              self.persistent_workers)

    def _ranking_loader(self, split: str) -> DataLoader:
        self._need_setup()
        dataset = self.datasets[split]
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            sampler = EvalShardSampler(dataset, dist.get_world_size(), dist.get_rank())
        else:
            sampler = None
        return DataLoader(dataset, batch_size=self.eval_batch_size, sampler=sampler, shuffle=False,
                          collate_fn=passthrough_collate, **self._loader_options())

    def train_dataloader(self) -> DataLoader:
        self._need_setup()
        self.datasets["train"].epoch_in_seed = not self.shuffle  # (read here: shuffle may be set after setup)
        return make_train_loader(self.datasets["train"], self.batch_size, shuffle=self.shuffle,
                                 drop_last=self.drop_last, seed=self.seed, trainer=self.trainer,
                                 **self._loader_options())

    def val_dataloader(self):
        loaders = [self._ranking_loader(split) for split in self.eval_split_names()]
        return loaders if len(loaders) > 1 else loaders[0]

    def test_dataloader(self) -> DataLoader:
        return self._ranking_loader("test")

    def predict_dataloader(self) -> DataLoader:
        # a retrieval model's predictions: the test split's users (every user), ranked against every item
        return self._ranking_loader("test")

    def eval_split_names(self) -> list[str]:
        """The split each validation dataloader ranks, in order (what a module prefixes its metrics with)."""
        # in fit only: `validate` ranks the validation split (Lightning would show every metric under both
        # dataloaders, as they are logged once per epoch), and `test` the test split
        fitting = self.trainer is None or self.trainer.state.fn == "fit"
        return ["val", "test"] if self.eval_test_in_fit and fitting else ["val"]
