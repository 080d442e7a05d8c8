"""Side files (users' age / gender / occupation / zip, items' genres / release decade / title) of the GroupLens and
RecBole layouts, the ratings' raw ids as rows 0..n-1 joined with them, and their `FeatureTable`s."""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from lightning_rec.data.movielens.batches import FeatureTable
from lightning_rec.data.movielens.read import detect_layout

log = logging.getLogger(__name__)

_AGE_EDGES = (18, 25, 35, 45, 50, 56)  # ml-1m's age groups; ml-100k's exact ages fall into them


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")  # ml-100k / ml-1m metadata: every byte is a latin-1 character


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
    vocab = {"gender": _Vocab(), "occupation": _Vocab(), "genre": _Vocab()}
    users: dict[int, dict] = {}
    items: dict[int, dict] = {}
    titles: dict[int, str] = {}
    if layout in _SIDE_READERS:
        users, items, titles = _SIDE_READERS[layout](data_dir, vocab)
    elif (data_dir / "movies.csv").is_file():
        items, titles = _ml20m_items(data_dir / "movies.csv", vocab["genre"])
    sizes = {"gender": len(vocab["gender"]), "occupation": max(len(vocab["occupation"]), 22),
             "age": len(_AGE_EDGES) + 2, "zip": 12, "genre": max(len(vocab["genre"]), 20), "year": 16}
    return users, items, titles, sizes


def _ml100k_side(data_dir: Path, vocab: dict[str, _Vocab]) -> tuple[dict, dict, dict]:
    """u.user (id|age|gender|occupation|zip) and u.item (id|title|date|video date|url|19 genre flags)."""
    users, items, titles = {}, {}, {}
    if (data_dir / "u.user").is_file():
        for n, line in enumerate(_read_text(data_dir / "u.user").splitlines(), 1):
            f = line.split("|")
            if len(f) < 5:
                raise ValueError(f"{data_dir / 'u.user'}:{n}: {len(f)} fields; "
                                 f"expected id|age|gender|occupation|zip")
            users[int(f[0])] = {"age": _bucket_age(int(f[1])), "gender": vocab["gender"](f[2]),
                                "occupation": vocab["occupation"](f[3]), "zip": _zip_bucket(f[4])}
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
    return users, items, titles


def _ml1m_side(data_dir: Path, vocab: dict[str, _Vocab]) -> tuple[dict, dict, dict]:
    """users.dat (id::gender::age::occupation::zip) and movies.dat (id::title (year)::Genre|Genre)."""
    users, items, titles = {}, {}, {}
    if (data_dir / "users.dat").is_file():
        for line in _read_text(data_dir / "users.dat").splitlines():
            f = line.split("::")
            users[int(f[0])] = {"gender": vocab["gender"](f[1]), "age": _bucket_age(int(f[2])),
                                "occupation": int(f[3]) + 1, "zip": _zip_bucket(f[4])}
    if (data_dir / "movies.dat").is_file():
        for line in _read_text(data_dir / "movies.dat").splitlines():
            f = line.split("::")
            year = re.search(r"\((\d{4})\)\s*$", f[1])
            items[int(f[0])] = {"genre": [vocab["genre"](g) for g in f[2].split("|") if g],
                                "year": _decade(int(year.group(1)) if year else None)}
            titles[int(f[0])] = f[1]
    return users, items, titles


def _recbole_side(data_dir: Path, vocab: dict[str, _Vocab]) -> tuple[dict, dict, dict]:
    """RecBole's <name>.user and <name>.item beside <name>.inter."""
    users, items, titles = {}, {}, {}
    stem = detect_layout(data_dir)[1].stem
    for row in _atomic_rows(data_dir / f"{stem}.user"):
        age = row.get("age", "")
        users[_token(row["user_id"])] = {"age": _bucket_age(int(age)) if age.isdigit() else 0,
                                         "gender": vocab["gender"](row.get("gender", "")),
                                         "occupation": vocab["occupation"](row.get("occupation", "")),
                                         "zip": _zip_bucket(row["zip_code"]) if row.get("zip_code") else 0}
    for row in _atomic_rows(data_dir / f"{stem}.item"):
        year = row.get("release_year", "")
        # ml-100k: "class", ml-1m: "genre", RecBole's Amazon sets: "categories"
        genres = (row.get("class") or row.get("genre") or row.get("categories") or "").split()
        items[_token(row["item_id"])] = {"genre": [vocab["genre"](g) for g in genres],
                                         "year": _decade(int(year)) if year.isdigit() else 0}
        titles[_token(row["item_id"])] = row.get("movie_title") or row.get("title") or ""
    return users, items, titles


def _ml20m_items(path: Path, genre: _Vocab) -> tuple[dict, dict]:
    """movies.csv (movieId,title (year),Genre|Genre) of ml-20m / ml-25m / ml-latest, or beside your own log."""
    items, titles = {}, {}
    rows = csv.reader(io.StringIO(_read_text(path)))
    next(rows, None)
    for f in rows:
        if len(f) < 3:
            continue
        year = re.search(r"\((\d{4})\)\s*$", f[1])
        items[int(f[0])] = {"genre": [genre(g) for g in f[2].split("|") if g and g != "(no genres listed)"],
                            "year": _decade(int(year.group(1)) if year else None)}
        titles[int(f[0])] = f[1]
    return items, titles


_SIDE_READERS = {"ml-100k": _ml100k_side, "ml-1m": _ml1m_side, "recbole": _recbole_side}


def _keyed_like(side: dict, strings: bool, where: Path, what: str) -> dict:
    """A side file's rows keyed as the ratings' ids are (str or int); keys of the other kind are dropped, logged."""
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
    """(the distinct ids of the column and of `extra`, sorted: int64, or fixed-width unicode for strings; each row's
    place among them). String ids are dictionary-encoded by Arrow and only the distinct ones sorted."""
    if not _is_text(column):
        raw = np.asarray(column)
        ids = np.unique(np.concatenate([raw, np.asarray(extra, dtype=np.int64)]) if extra else raw)
        return ids, np.searchsorted(ids, raw)
    chunks = [c.cast(pa.string()) for c in column.chunks] + ([pa.array(extra, pa.string())] if extra else [])
    encoded = pc.dictionary_encode(pa.chunked_array(chunks, pa.string())).combine_chunks()
    order = pc.sort_indices(encoded.dictionary).to_numpy()  # bytewise: UTF-8's order is the code points' (numpy's)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    ids = encoded.dictionary.take(pa.array(order)).to_numpy(zero_copy_only=False).astype(str)
    return ids, rank[encoded.indices.to_numpy(zero_copy_only=False)[:len(column)]].astype(np.int64)


def raw_ids(ids: np.ndarray) -> torch.Tensor:
    """The log's own ids as int64 for managed-collision tables (hash_ids=False): integers as they are, a string id
    (an ASIN) as the first 62 bits of its BLAKE2b digest (the same on every machine and run)."""
    if ids.dtype.kind in "iu":
        return torch.from_numpy(ids.astype(np.int64))
    digest = [int.from_bytes(hashlib.blake2b(str(i).encode(), digest_size=8).digest(), "little") >> 2 for i in ids]
    return torch.tensor(digest, dtype=torch.int64)


def _feature_table(kind: str, ids: np.ndarray, side: dict[int, dict], names: Sequence[str], sizes: dict,
                   bags: Sequence[str] = (), hash_ids: bool = True) -> FeatureTable:
    """`kind`_id (the row; hash_ids=False: the raw id) and, with side features, the `names` (single ids) and `bags`
    (lists) a row has."""
    n = len(ids)
    single = {f"{kind}_id": (torch.arange(n) if hash_ids else raw_ids(ids), n)}
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

