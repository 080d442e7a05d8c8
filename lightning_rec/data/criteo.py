"""Criteo click logs -> whole `Batch`es, through a memory-mapped Hugging Face Arrow cache.

Shapes: N rows (of a file or a parsed block), B rows in a batch, F = 26 sparse features (C1..C26),
13 dense features (I1..I13), L bytes of a block.

Layouts read (detected from the first lines, each overridable):

    train.txt / day_N   label \\t I1..I13 \\t C1..C26          40 fields, no header
    Kaggle test file    I1..I13 \\t C1..C26                    39 fields, no header, no label
    Kaggle train.csv    Id,Label,I1..I13,C1..C26              header, comma (test.csv: no Label)
    DeepCTR sample      label,I1..I13,C1..C26                 header, comma, ints may be "260.0"
    Parquet / datasets  columns label (optional), I1..I13, C1..C26 by name: a .parquet file, a folder
                        of them (the Hugging Face Hub's layout) or a `save_to_disk` folder; C as hash
                        strings or integer ids (`lightning_rec.data.criteo_tables`); cached or
                        streamed like text

How a file becomes batches:

    file --(blocks of ~64 MiB, cut at newlines)--> _parse_block --> Arrow record batch
         label [N] float32 (NaN: no label), dense [N, 13] float32 raw (NaN: missing),
         sparse [N, 26] int64 raw 32-bit hash (-1: missing)
    --(datasets.ArrowWriter)--> <cache_dir>/<file>-<key>.arrow --(Dataset.from_file: mmap)-->
    CriteoDataset.__getitems__(indices of one batch) --numpy gather--> _make_batch --> Batch

The cache keeps the raw values, so changing table sizes, the dense transform or the missing-id
policy needs no re-parse; `% num_embeddings` and `log(1 + max(x, 0))` are applied per batch.

Missing categorical values (`missing_categorical`):
    "reserved_id" (default)  id 0 of every table means "missing"; a present hash v maps to
                             1 + v % (num_embeddings - 1). Every bag holds exactly one id.
    "empty_bag"              a missing value is an empty bag (length 0, pooled to zeros);
                             a present hash v maps to v % num_embeddings.

Rows that are not clean Criteo rows (both parsers, the native op and the Python reference, agree):
    fewer fields than the layout, ending in a value
                            trailing empty fields were stripped: padded as missing (counted in
                            ParseReport.num_padded_rows, and a warning at the end of the file)
    fewer fields, ending in a separator (a file cut mid-row), more fields, a non-numeric I, a label
    other than 0/1, a C that is not 8 hex characters, a non-ASCII byte (corruption, bad encoding)
        on_bad_row="error"  ValueError naming file, line and field
        on_bad_row="skip"   the row is dropped, counted (ParseReport.num_skipped_rows), the first
                            few logged with their line and reason; no column is ever shifted.
    blank lines             ignored (counted in ParseReport.num_blank_lines)
Files: gzip / bz2 / zstd are detected from their first bytes (a `.tsv` holding gzip is read, with a
warning); a directory, a fully quoted CSV, a binary file and an unlabelled file given for training
or validation are errors that say what to pass instead.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
import socket
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
)

from lightning_rec.data.batch import (
    Batch,
    PassEpoch,
    follow_fit_loop,
    make_eval_loader,
    make_stream_loader,
    make_train_loader,
    worker_options,
)
from lightning_rec.data.criteo_parse import (
    _PARSER_VERSION,
    DEFAULT_SPARSE_FEATURE_NAMES,
    NUM_DENSE_FEATURES,
    NUM_SPARSE_FEATURES,
    ParseReport,
    _cache_features,
    _check_missing_categorical,
    _check_on_bad_row,
    check_criteo_file,
    detect_layout,
    iter_blocks_resumable,
    parse_block,
    read_criteo,
    resolve_parser,
    table_ids,
)
from lightning_rec.data.criteo_shards import CriteoShardDataset, dist_rank_world, is_shard_dir
from lightning_rec.data.criteo_tables import (
    TABLE_SOURCE_VERSION,
    TableBlocks,
    read_criteo_table,
    source_files,
    table_has_label,
    table_source_kind,
)
from lightning_rec.data.hf_dataset import check_same_rows, dataset_path, is_hf_dataset, rows_digest
from lightning_rec.sparse import KeyedJaggedTensor

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# cache


def default_cache_dir() -> Path:
    import datasets.config

    return Path(datasets.config.HF_DATASETS_CACHE) / "lightning_rec" / "criteo"


def _writer_tag() -> str:
    """Who writes a temporary cache file: "<host>~<pid>" (a host name holds no "~"; dots are kept)."""
    return f"{socket.gethostname().replace('~', '-')}~{os.getpid()}"


_LEGACY_TMP_AGE_S = 24 * 3600  # "<pid>" names (no host) written before the host was part of the name


def _remove_abandoned_tmp(cache_dir: Path, prefix: str) -> None:
    """Remove `<prefix><host>~<pid>.<uuid>.tmp` files that a killed build left (hidden, GBs each, never reused).

    Only those provably abandoned: written on this host by a process that no longer runs (ranks building the same
    cache at once each write their own file; another host's, or a live process's, are left alone), or, for names
    without a host, by a dead pid and untouched for a day. A minute's grace covers a writer in another pid
    namespace of this host that is between two blocks.
    """
    host, now = socket.gethostname().replace("~", "-"), time.time()
    for tmp in cache_dir.glob(f"{glob.escape(prefix)}*.tmp"):
        writer = tmp.name[len(prefix):].split(".")
        if len(writer) < 3:
            continue
        tag = ".".join(writer[:-2])  # the host may hold dots
        name_host, _, pid = tag.rpartition("~")
        if not pid.isdigit() or (name_host and name_host != host) or _pid_alive(int(pid)):
            continue
        try:
            age = now - tmp.stat().st_mtime
            if age > (60 if name_host else _LEGACY_TMP_AGE_S):
                tmp.unlink()
                log.info("removed %s, left by a cache build that was killed (pid %s)", tmp, pid)
        except FileNotFoundError:  # another rank removed it first
            pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # alive, another user's; or no way to tell: keep the file
        return True
    return True


def build_criteo_cache(
    path: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    separator: str | None = None,
    has_header: bool | None = None,
    has_label: bool | None = None,
    on_bad_row: str = "error",
    block_bytes: int = 64 << 20,
    parser: str = "auto",
) -> tuple[Path, ParseReport]:
    """Parse `path` once into a memory-mappable Arrow file; later calls find it and return at once.

    The cache key covers the file (absolute path, size, mtime), the parse options and the parser
    version. The file is written under a temporary name and renamed, so ranks that build the same
    cache at once never read a half-written file.
    """
    from datasets.arrow_writer import ArrowWriter

    path = Path(path)
    table_source = table_source_kind(path) is not None
    if table_source:  # Parquet / a saved `datasets` folder: every file it reads is in the key
        files = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in source_files(path)]
        key_src = json.dumps([str(path.resolve()), files, "table", TABLE_SOURCE_VERSION, has_label, on_bad_row])
    else:
        check_criteo_file(path)
        resolve_parser(parser)
        stat = path.stat()
        key_src = json.dumps(
            [str(path.resolve()), stat.st_size, stat.st_mtime_ns, _PARSER_VERSION,
             separator, has_header, has_label, on_bad_row]
        )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    stem = "".join("_" if c in "*?[]" else c for c in path.name)  # a pattern's name: train-_.parquet
    arrow_path = cache_dir / f"{stem}-{key}.arrow"
    meta_path = cache_dir / f"{stem}-{key}.json"
    if arrow_path.is_file() and meta_path.is_file():
        return arrow_path, ParseReport.from_json(meta_path.read_text())

    _remove_abandoned_tmp(cache_dir, f".{arrow_path.name}.")
    _remove_abandoned_tmp(cache_dir, f"{meta_path.name}.")
    tmp = cache_dir / f".{arrow_path.name}.{_writer_tag()}.{uuid.uuid4().hex[:8]}.tmp"
    report = ParseReport(path=str(path))
    try:
        with ArrowWriter(features=_cache_features(), path=str(tmp)) as writer:
            tables = (read_criteo_table(path, has_label, on_bad_row) if table_source else
                      read_criteo(path, separator, has_header, has_label, on_bad_row, block_bytes, parser))
            for table, block_report in tables:
                report = block_report
                if table.num_rows:
                    # one record batch per parsed block: few chunks, so a batch gather loops over few
                    writer.write_table(table, writer_batch_size=max(table.num_rows, 1))
            writer.finalize()
        if report.num_rows == 0:
            raise ValueError(
                f"{path} has no data rows ({report.num_skipped_rows} bad rows skipped, "
                f"{report.num_blank_lines} blank lines): expected Criteo rows (label, I1..I13, C1..C26)"
            )
        os.replace(tmp, arrow_path)
    finally:
        if tmp.exists():
            tmp.unlink()
    meta_tmp = meta_path.with_name(meta_path.name + f".{_writer_tag()}.{uuid.uuid4().hex[:8]}.tmp")
    meta_tmp.write_text(json.dumps(asdict(report)))
    os.replace(meta_tmp, meta_path)
    report.log_skips()
    return arrow_path, report


# ----------------------------------------------------------------------------------------------
# batches


def _resolve_num_embeddings(num_embeddings_per_feature: int | Sequence[int], num_features: int) -> list[int]:
    if isinstance(num_embeddings_per_feature, int):
        sizes = [num_embeddings_per_feature] * num_features
    else:
        sizes = [int(n) for n in num_embeddings_per_feature]
    if len(sizes) != num_features:
        raise ValueError(
            f"num_embeddings_per_feature has {len(sizes)} entries for {num_features} sparse features: "
            f"give one int for all, or one per feature"
        )
    if min(sizes) < 2:
        raise ValueError(f"num_embeddings_per_feature must be >= 2 for every feature, got {sizes}")
    return sizes


def make_criteo_batch(
    label_B: np.ndarray,
    dense_raw_B13: np.ndarray,
    sparse_raw_BF: np.ndarray,
    num_embeddings_F: np.ndarray,
    keys: Sequence[str],
    missing_categorical: str = "reserved_id",
) -> Batch:
    """Raw values of B rows -> Batch: log(1 + max(x, 0)) on dense, hashing into tables on sparse."""
    # fmax ignores NaN, so a missing count becomes log(1 + 0) = 0
    dense_B13 = np.log1p(np.fmax(dense_raw_B13, 0.0)).astype(np.float32, copy=False)
    sparse_FB = sparse_raw_BF.T
    mod_F1 = num_embeddings_F[:, None]
    batch_size = label_B.shape[0]
    if missing_categorical == "reserved_id":
        ids_FB = table_ids(sparse_FB, mod_F1, missing_categorical)
        values_N = ids_FB.reshape(-1)
        lengths_FB = np.ones(ids_FB.size, dtype=np.int64)
    else:
        present_FB = sparse_FB >= 0
        # table_ids' empty_bag rows of the present ids only (no where over the missing ones: a hot path)
        values_N = (sparse_FB % mod_F1)[present_FB]  # boolean mask keeps [F, B] order: key-major
        lengths_FB = present_FB.reshape(-1).astype(np.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        list(keys), torch.from_numpy(np.ascontiguousarray(values_N, dtype=np.int64)),
        torch.from_numpy(lengths_FB), stride=batch_size,
    )
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(dense_B13)),
        sparse_features=kjt,
        labels=torch.from_numpy(np.ascontiguousarray(label_B, dtype=np.float32)),
    )


class CriteoDataset(Dataset):
    """Map-style dataset over a cached (memory-mapped) Criteo Arrow file; one item = one Batch.

    Use with `make_batch_loader` (batch_size + sampler, `collate_fn=passthrough_collate`): the
    DataLoader then calls `__getitems__(indices)` once per batch and the whole batch is gathered in numpy.
    """

    def __init__(
        self,
        arrow_path: str | os.PathLike,
        num_embeddings_per_feature: int | Sequence[int],
        sparse_feature_names: Sequence[str] | None = None,
        missing_categorical: str = "reserved_id",
    ) -> None:
        self.arrow_path = str(arrow_path)
        self.keys = list(sparse_feature_names or DEFAULT_SPARSE_FEATURE_NAMES)
        if len(self.keys) != NUM_SPARSE_FEATURES:
            raise ValueError(f"sparse_feature_names needs {NUM_SPARSE_FEATURES} names, got {len(self.keys)}")
        _check_missing_categorical(missing_categorical)
        self.missing_categorical = missing_categorical
        self.num_embeddings_F = np.asarray(
            _resolve_num_embeddings(num_embeddings_per_feature, NUM_SPARSE_FEATURES), dtype=np.int64
        )
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
        self._open()

    def _open(self) -> None:
        import datasets

        # Dataset.from_file memory-maps the file: pages are read on demand, shared between workers.
        self._hf = datasets.Dataset.from_file(self.arrow_path)
        chunks = []
        for rb in self._hf.data.table.to_batches():
            if rb.num_rows == 0:
                continue
            chunks.append(
                (
                    rb.column(0).to_numpy(zero_copy_only=True),
                    rb.column(1).flatten().to_numpy(zero_copy_only=True).reshape(-1, NUM_DENSE_FEATURES),
                    rb.column(2).flatten().to_numpy(zero_copy_only=True).reshape(-1, NUM_SPARSE_FEATURES),
                )
            )
        self._chunks = chunks
        self._starts = np.cumsum([0] + [c[0].shape[0] for c in chunks])

    @property
    def fingerprint(self) -> str:
        """What a saved loader position belongs to: the cache file (its name carries the parse key)."""
        return os.path.basename(self.arrow_path)

    def __getstate__(self) -> dict:
        # workers reopen the memory map instead of receiving pickled arrays
        state = dict(self.__dict__)
        state["_chunks"] = state["_hf"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _gather(self, idx_B: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(self._chunks) == 1:
            label, dense, sparse = self._chunks[0]
            return label[idx_B], dense[idx_B], sparse[idx_B]
        chunk_B = np.searchsorted(self._starts, idx_B, side="right") - 1
        out = (
            np.empty(idx_B.size, np.float32),
            np.empty((idx_B.size, NUM_DENSE_FEATURES), np.float32),
            np.empty((idx_B.size, NUM_SPARSE_FEATURES), np.int64),
        )
        # a loop over the file's blocks (each ~64 MiB of text), not over rows
        for c in np.unique(chunk_B):
            rows = np.flatnonzero(chunk_B == c)
            local = idx_B[rows] - self._starts[c]
            for dst, src in zip(out, self._chunks[c]):
                dst[rows] = src[local]
        return out

    def __getitems__(self, indices: Sequence[int]) -> Batch:
        idx_B = np.asarray(indices, dtype=np.int64)
        if idx_B.size and idx_B.min() < 0:
            idx_B = idx_B[idx_B != -1]  # -1: an evaluation share's padding (EvalDistributedSampler), no row
        if idx_B.size and (idx_B.min() < 0 or idx_B.max() >= len(self)):
            raise IndexError(f"indices out of range for {len(self)} rows")
        label_B, dense_B13, sparse_BF = self._gather(idx_B)
        return make_criteo_batch(
            label_B, dense_B13, sparse_BF, self.num_embeddings_F, self.keys, self.missing_categorical
        )

    def empty_batch(self) -> Batch:
        """A batch of 0 rows: what a rank whose evaluation share ran out steps with (strategy.py)."""
        return self.__getitems__([])

    def __getitem__(self, index: int | Sequence[int] | slice) -> Batch:
        """A batch of the given rows (an int gives a batch of one)."""
        if isinstance(index, slice):
            return self.__getitems__(range(len(self))[index])
        if isinstance(index, (int, np.integer)):
            return self.__getitems__([int(index)])
        return self.__getitems__(index)


class CriteoIterableDataset(IterableDataset):
    """Streaming: parse the file block by block while iterating; nothing is cached.

    Blocks (each `block_bytes` of text) are dealt round-robin to (rank, worker) pairs, so every
    row is read by exactly one of them: rank r of W reads the blocks b with b % W == r, its workers
    taking turns among them, so a rank reads the same rows at any num_workers and ranks' shares differ
    by one block at most; a file of fewer than two blocks per pair is dealt row by
    row instead (every pair parses it, each keeps its rows), so small files split evenly too.
    With `shuffle`, rows are shuffled within each block (and the order differs per epoch: in your own
    DataLoader, call `set_epoch(epoch)` before each epoch, as with torch's DistributedSampler; its workers,
    persistent ones too, read the epoch told; untold, each process counts its own passes); the
    block order stays the file order. Rows left over at the end of a block carry into the next
    block's batches, so only the last batch can be short.

    `row_ids=True` (CriteoDataModule's predict set): each batch carries an order key per row
    (`Batch.row_ids`): its line's place among the file's rows when rows are dealt, (block << 32) + its place
    in the block when blocks are. Keys grow with the file order, so predictions made at N ranks are put
    back in input order by sorting them (lightning_rec.predict renumbers them 0..R-1).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        batch_size: int,
        num_embeddings_per_feature: int | Sequence[int],
        sparse_feature_names: Sequence[str] | None = None,
        missing_categorical: str = "reserved_id",
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        on_bad_row: str = "error",
        separator: str | None = None,
        has_header: bool | None = None,
        has_label: bool | None = None,
        block_bytes: int = 16 << 20,
        parser: str = "auto",
        row_ids: bool = False,
    ) -> None:
        _check_on_bad_row(on_bad_row)
        _check_missing_categorical(missing_categorical)
        # a table (Parquet, a save_to_disk folder) streams in blocks of rows instead of bytes: about as many rows
        # as block_bytes of the cache's rows (264 bytes each)
        self.table = TableBlocks(path, has_label, block_bytes // 256) if table_source_kind(path) else None
        if self.table is None:
            check_criteo_file(path)
        self.row_ids = row_ids
        self.parser = resolve_parser(parser)
        self.path = str(path)
        self.layout = detect_layout(path, separator, has_header, has_label) if self.table is None else None
        self.batch_size = batch_size
        self.num_embeddings_F = np.asarray(
            _resolve_num_embeddings(num_embeddings_per_feature, NUM_SPARSE_FEATURES), dtype=np.int64
        )
        self.keys = list(sparse_feature_names or DEFAULT_SPARSE_FEATURE_NAMES)
        self.missing_categorical = missing_categorical
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.on_bad_row, self.block_bytes = on_bad_row, block_bytes
        self._epoch = PassEpoch()
        self._dist = dist_rank_world()
        # The report of the latest pass made in this process (a worker's own rows, with workers).
        self.report = self._new_report()

    def _new_report(self) -> ParseReport:
        return ParseReport(path=self.path, layout=asdict(self.layout) if self.table is None else self.table.layout)

    @property
    def fingerprint(self) -> str:
        """What a saved loader position belongs to: the file, its size and the batch size."""
        source = self.table.fingerprint if self.table is not None else \
            f"{os.path.basename(self.path)}:{os.path.getsize(self.path)}"
        return f"{source}:{self.batch_size}:{int(self.shuffle)}"

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next pass shuffles for (a resumed run's loader sets it; see StatefulBatchLoader)."""
        self._epoch.set(epoch)

    def _shard(self) -> tuple[int, int]:
        info = torch.utils.data.get_worker_info()
        # DataLoader workers have no process group: they use what the main process saw (kept in their copy)
        if info is None:
            self._dist = dist_rank_world()
        rank, world = self._dist
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # ranks alternate in the deal (pair w * W + r): block b goes to rank b % W whatever the worker count. Dealt
        # rank-major (r * num_workers + w), a rank's blocks depended on its workers and its share could be a block per
        # worker short of another rank's; in training every rank stops at the shortest share, so those rows were
        # never trained on (15% of a 10 MB file at 2 ranks x 2 workers)
        return worker * world + rank, world * num_workers

    # Resuming (torchdata's Stateful protocol: StatefulDataLoader saves the state after every batch,
    # per worker). The position is where the block being read began (the reader's position, the block
    # index, the shuffling generator's state, the rows carried over from earlier blocks) plus the
    # batches already yielded from it: a resumed pass seeks there, reads that one block again and skips
    # those batches, instead of re-reading the stream from the start.

    # The carried-over rows travel as tensors: checkpoints are read back with torch.load(weights_only=True)
    # (Lightning's default), which refuses numpy arrays ("Unsupported global ... _reconstruct").

    def state_dict(self) -> dict[str, Any]:
        position = getattr(self, "_position", None)
        if position is not None and position.get("pending"):
            position = {**position, "pending": [tuple(torch.from_numpy(a) for a in rows)
                                                for rows in position["pending"]]}
        return {"position": position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position = state.get("position")
        if position is not None and position.get("pending"):
            position = {**position, "pending": [tuple(np.asarray(a) for a in rows) for rows in position["pending"]]}
        self._resume = position

    def _resume_position(self, shard: int, num_shards: int) -> dict[str, Any] | None:
        position, self._resume = getattr(self, "_resume", None), None
        if position is None:
            return None
        mine = {"shard": shard, "num_shards": num_shards, "block_bytes": self.block_bytes,
                "fingerprint": self.fingerprint}
        if any(position.get(k) != v for k, v in mine.items()):
            warnings.warn(f"{self.path}: the saved reading position belongs to another file, batch size or "
                          f"split ({ {k: position.get(k) for k in mine} } saved, {mine} here): this pass starts "
                          f"from the beginning of the file", stacklevel=3)
            return None
        return position

    def __iter__(self) -> Iterator[Batch]:
        shard, num_shards = self._shard()
        resume = self._resume_position(shard, num_shards)
        self._position = None
        epoch = self._epoch.take(None if resume is None else resume["epoch"])
        base = {"shard": shard, "num_shards": num_shards, "block_bytes": self.block_bytes,
                "fingerprint": self.fingerprint, "epoch": epoch}
        report = self._new_report()
        self.report = report
        if resume is not None and resume.get("done"):  # this reader had yielded its share's last batch (its only key)
            self._position = {**base, "done": True}
            return
        rng = np.random.default_rng([self.seed, epoch, shard])
        if resume is None:
            start, k, seen, pending, skip = None, 0, 0, [], 0
        else:
            rng.bit_generator.state = resume["rng"]
            start, k, seen, pending, skip = (resume["reader"], resume["block"], resume["seen"], list(resume["pending"]),
                                             resume["yielded"])
        num_pending = sum(p[0].shape[0] for p in pending)
        # (where the block begins: a byte offset, or a table's block index; its rows, parsed when asked for)
        if self.table is None:
            blocks = ((reader, lambda b=block, line=first_line: parse_block(
                b, line, self.layout, self.path, self.on_bad_row, report, self.parser))
                for block, first_line, reader in iter_blocks_resumable(self.path, self.block_bytes,
                                                                       self.layout.has_header, start))
            num_blocks = math.ceil(os.path.getsize(self.path) / self.block_bytes)
        else:
            blocks = ((b, lambda b=b: self.table.read(b, self.on_bad_row, report))
                      for b in range(k, self.table.num_blocks))
            num_blocks = self.table.num_blocks
        # Few blocks per shard: deal rows (every shard parses every block, keeps every num_shards-th
        # row), so ranks get equal shares of a small file; many blocks: deal whole blocks (each is
        # parsed once), and shares differ by at most about a block.
        by_rows = num_shards > 1 and num_blocks < 2 * num_shards
        for reader, parse in blocks:
            here, k = k, k + 1
            if not by_rows and here % num_shards != shard:
                continue
            boundary = {**base, "reader": reader, "block": here, "seen": seen, "rng": rng.bit_generator.state,
                        "pending": list(pending)}
            arrays = parse()
            n = arrays[0].shape[0]
            if self.row_ids:  # an order key per row (see the class doc), carried beside the rows
                arrays = (*arrays, np.arange(seen, seen + n) if by_rows else (here << 32) + np.arange(n))
            if by_rows:
                mine = (np.arange(seen, seen + n) % num_shards) == shard
                seen += n
                arrays = tuple(a[mine] for a in arrays)
            if self.shuffle:
                perm = rng.permutation(arrays[0].shape[0])
                arrays = tuple(a[perm] for a in arrays)
            pending.append(arrays)
            num_pending += arrays[0].shape[0]
            if num_pending < self.batch_size:
                continue
            columns = [np.concatenate(parts) for parts in zip(*pending)]  # label, dense, sparse (, row ids)
            full = (num_pending // self.batch_size) * self.batch_size
            for i, s in enumerate(range(0, full, self.batch_size)):
                if i < skip:  # a resumed pass: trained before the checkpoint
                    continue
                self._position = {**boundary, "yielded": i + 1}  # the state once this batch is taken
                yield self._batch(*(c[s:s + self.batch_size] for c in columns))
            skip = 0
            pending = [tuple(c[full:] for c in columns)]
            num_pending -= full
        if num_pending and not self.drop_last:
            columns = [np.concatenate(parts) for parts in zip(*pending)]
            self._position = {**base, "done": True}
            yield self._batch(*columns)
        self._position = {**base, "done": True}
        report.log_skips()

    def empty_batch(self) -> Batch:
        """A batch of 0 rows. Streams of ranks end at different batches: in evaluation, a rank whose stream
        ran out steps with these until every rank's has (RecStrategy), so every row is scored once."""
        return self._batch(np.empty(0, np.float32), np.empty((0, NUM_DENSE_FEATURES), np.float32),
                           np.empty((0, NUM_SPARSE_FEATURES), np.int64),
                           *((np.empty(0, np.int64),) if self.row_ids else ()))

    def _batch(self, label: np.ndarray, dense: np.ndarray, sparse: np.ndarray,
               row_ids: np.ndarray | None = None) -> Batch:
        batch = make_criteo_batch(label, dense, sparse, self.num_embeddings_F, self.keys, self.missing_categorical)
        if row_ids is not None:
            batch.row_ids = torch.from_numpy(np.ascontiguousarray(row_ids, dtype=np.int64))
        return batch


# ----------------------------------------------------------------------------------------------
# LightningDataModule


_STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}


class CriteoDataModule(pl.LightningDataModule):
    """Criteo click logs (Kaggle CSV, dac train.txt / day files, DeepCTR sample) as `Batch`es.

    Map-style (default): each file is parsed once into a memory-mapped Arrow cache under
    `cache_dir` (`prepare_data`, local rank 0), then read by index; shuffling is exact.
    `streaming=True`: files are parsed while iterating (no cache; for files too big to cache);
    shuffling is within blocks of `block_bytes`. See the module docstring for layouts, missing
    values and bad rows.

    A path may also be a table: a Parquet file, a folder of them (a Hugging Face Hub dataset's files) or a
    `datasets` save_to_disk folder, with columns label, I1..I13, C1..C26; it is converted once into the
    same cache, or streamed in blocks of rows, and gives the batches its text would
    (`lightning_rec.data.criteo_tables`). In Python, a `datasets.Dataset` with those columns may be passed
    as a path: it is written once as Parquet under `cache_dir`, in a folder named by its fingerprint
    (`lightning_rec.data.hf_dataset`), and read as that folder.
    Or a directory written by `lightning-rec preprocess` (the Kaggle set, the 1TB
    logs): each rank then reads its share of the .npy shards as batch slices
    (`lightning_rec.data.criteo_shards`); `num_embeddings_per_feature` must match the directory's.
    `parser`: "auto" (the native op when built), "native" or "python" (the reference).
    Training and validation need labelled files: an unlabelled file (the Kaggle test layout) there is
    an error, not NaN labels.

    Args:
        train_path: the training data: a Criteo text file, a table, or a `lightning-rec preprocess` directory.
        val_path: the validation data, in the same forms (None: no validation).
        test_path: the data `test` scores (labelled).
        predict_path: the data `predict` scores, labelled or not (None: test_path).
        batch_size: rows per training batch (per rank).
        val_batch_size: rows per evaluation and predict batch (None: batch_size).
        num_embeddings_per_feature: table rows, one int for all features or one per feature (equal to the
            model's; for a preprocess directory, equal to its manifest's).
        sparse_feature_names: the KJT keys (None: C1..C26).
        missing_categorical: "reserved_id" (id 0 of each table means missing) or "empty_bag" (a missing value is an
            empty bag).
        cache_dir: where the memory-mapped Arrow cache goes (None: under datasets' cache, HF_DATASETS_CACHE).
        streaming: parse the files while iterating, without a cache (for files too big to cache).
        num_workers: DataLoader worker processes (0: load in the main process).
        pin_memory: pin batches in host memory for the copy to a GPU.
        shuffle: shuffle the training rows each epoch (streaming: within blocks of block_bytes).
        seed: the shuffle's seed.
        drop_last: drop the last, smaller training batch.
        on_bad_row: "error" (stop, naming file, line and field) or "skip" (leave the row out, logged).
        separator: "\t" or "," (or the words "tab" / "comma"; None: detected from the file).
        has_header: whether the first line is a header (None: detected).
        has_label: whether rows carry a label (None: detected from the field count or columns).
        block_bytes: bytes read and parsed at a time when streaming (and the shuffle's block).
        parser: "auto" (the native op when built), "native" or "python" (the reference).
        prefetch_factor: batches each worker loads ahead (None: torch's default).
        persistent_workers: keep the workers between epochs (None: whenever there are any).
    """

    def __init__(
        self,
        train_path: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        predict_path: str | None = None,
        batch_size: int = 2048,
        val_batch_size: int | None = None,
        num_embeddings_per_feature: int | list[int] = 100_000,
        sparse_feature_names: list[str] | None = None,
        missing_categorical: str = "reserved_id",
        cache_dir: str | None = None,
        streaming: bool = False,
        num_workers: int = 0,
        pin_memory: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        on_bad_row: str = "error",
        separator: str | None = None,
        has_header: bool | None = None,
        has_label: bool | None = None,
        block_bytes: int = 64 << 20,
        parser: str = "auto",
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
    ) -> None:
        super().__init__()
        # said here, not when the first loader is built
        worker_options("CriteoDataModule", num_workers, pin_memory, prefetch_factor, persistent_workers)
        self.prefetch_factor, self.persistent_workers = prefetch_factor, persistent_workers
        _check_on_bad_row(on_bad_row)
        _check_missing_categorical(missing_categorical)
        self.parser = resolve_parser(parser)
        # a datasets.Dataset becomes the path of its Parquet copy, before the arguments are saved as
        # hyperparameters (lightning_rec.data.hf_dataset)
        root = cache_dir or default_cache_dir()
        given = {"train_path": train_path, "val_path": val_path, "test_path": test_path, "predict_path": predict_path}
        train_path, val_path, test_path, predict_path = (
            dataset_path(p, f"CriteoDataModule {n}", root, "data.parquet", streams=True) for n, p in given.items())
        # compared over the ranks at setup: a Dataset shuffled without a seed differs between them
        self._dataset_rows = {n: rows_digest(p) for n, p in given.items() if is_hf_dataset(p)}
        self.save_hyperparameters()
        self.paths = {
            "train": train_path, "val": val_path, "test": test_path, "predict": predict_path or test_path
        }
        for name, value in (("batch_size", batch_size), ("val_batch_size", val_batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"CriteoDataModule {name}={value!r}: give a positive number of samples per batch")
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.num_embeddings_per_feature = _resolve_num_embeddings(
            num_embeddings_per_feature, NUM_SPARSE_FEATURES
        )
        self.sparse_feature_names = list(sparse_feature_names or DEFAULT_SPARSE_FEATURE_NAMES)
        if len(self.sparse_feature_names) != NUM_SPARSE_FEATURES:
            raise ValueError(
                f"sparse_feature_names needs {NUM_SPARSE_FEATURES} names, "
                f"got {len(self.sparse_feature_names)}"
            )
        self.num_dense_features = NUM_DENSE_FEATURES
        self.missing_categorical = missing_categorical
        self.cache_dir = cache_dir
        self.streaming = streaming
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.on_bad_row = on_bad_row
        self.layout_args = {"separator": separator, "has_header": has_header, "has_label": has_label}
        self.block_bytes = block_bytes
        self.datasets: dict[str, Dataset] = {}
        self.parse_reports: dict[str, ParseReport] = {}

    @property
    def num_skipped_rows(self) -> int:
        """Bad rows dropped under on_bad_row='skip', over all files parsed so far (map-style)."""
        return sum(r.num_skipped_rows for r in self.parse_reports.values())

    def _cache(self, split: str) -> Path:
        arrow_path, report = build_criteo_cache(
            self.paths[split], self.cache_dir, on_bad_row=self.on_bad_row, block_bytes=self.block_bytes,
            parser=self.parser, **self.layout_args,
        )
        self.parse_reports[split] = report
        return arrow_path

    def _check_labelled(self, split: str) -> None:
        """Training / validation on an unlabelled file would give NaN labels and NaN loss: refuse it."""
        path = self.paths[split]
        if split not in ("train", "val", "test") or path is None:
            return
        if is_shard_dir(path):
            from lightning_rec.data.criteo_shards import load_manifest

            labelled = load_manifest(path)["has_label"]
        elif table_source_kind(path):
            labelled = table_has_label(path, self.layout_args["has_label"])
        else:
            labelled = detect_layout(path, **self.layout_args).has_label
        if not labelled:
            raise ValueError(
                f"{split}_path {path} has no label column (the Kaggle test layout: 39 fields, or a header without "
                f"Label): {split} needs labelled rows. Pass a labelled file (train.txt, a day file, train.csv), "
                f"and give unlabelled files as predict_path"
            )

    def _splits_of(self, stage: str | None, check: bool = True) -> tuple[str, ...]:
        """The splits a Trainer stage reads (fit: train and val, if given; predict: predict); every split
        given when the stage is unknown (outside a Trainer). `check`: a split the stage needs but has no
        path is an error naming the option to set (raised by setup: it runs on every rank, where
        prepare_data runs on one while the others wait for it)."""
        if stage is None:
            return tuple(s for s, p in self.paths.items() if p is not None)
        stage = getattr(stage, "value", stage)  # Lightning passes a TrainerFn (a str enum)
        needed = {"fit": "train", "validate": "val", "test": "test", "predict": "predict"}.get(stage)
        if check and needed is not None and self.paths[needed] is None:
            what = {"predict": "the rows to predict, labelled or not; default: test_path"}.get(
                needed, f"labelled rows to {stage} on")
            raise ValueError(f"CriteoDataModule has no {needed}_path, which {stage} needs: set --data.{needed}_path="
                             f"FILE ({what})")
        return tuple(s for s in _STAGE_SPLITS.get(stage, tuple(self.paths)) if self.paths[s] is not None)

    def check_paths(self, stage: str) -> None:
        """A clear ValueError for a file that `stage` reads and that does not exist (or a split it needs and has
        no path for). The CLI calls it before the Trainer starts, so that at N ranks the error comes once, before
        any process group: found in prepare_data (local rank 0 only), it left rank 1 in a barrier, whose gloo
        "Connection closed by peer" traceback was the last thing on the screen. Only the stage's files: predict
        on a machine without the recipe's training files works."""
        for split in self._splits_of(stage):
            if table_source_kind(self.paths[split]):
                source_files(self.paths[split])  # a folder of several splits' files is refused here, before any rank
            elif not is_shard_dir(self.paths[split]):
                check_criteo_file(self.paths[split], what=f"CriteoDataModule {split}_path",
                                  fix=f"check the path (--data.{split}_path on the command line)")

    def prepare_data(self) -> None:
        # Lightning's prepare_data has no stage argument: the attached Trainer's state names it
        trainer = self.trainer
        stage = trainer.state.fn.value if trainer is not None and trainer.state.fn is not None else None
        splits = self._splits_of(stage, check=False)
        for split in ("train", "val"):  # (test_dataloader checks test: an unlabelled test_path may be predicted)
            if split in splits:
                self._check_labelled(split)
        if self.streaming:
            return
        for split in splits:
            if not is_shard_dir(self.paths[split]):
                self._cache(split)

    def _check_same_ids(self, splits: Sequence[str]) -> None:
        """The splits a stage reads must map a value to the same table row. A preprocessed directory holds ids hashed
        by its --missing_categorical, or mapped through a vocabulary (--min_frequency / --vocab_from); a text or table
        file is hashed here by `missing_categorical`. Mixed, the same value was another row in training than in
        validation, in silence."""
        from lightning_rec.data.criteo_shards import load_manifest

        maps = {}
        for split in splits:
            path = self.paths[split]
            if not is_shard_dir(path):
                maps[split] = ("hashed", self.missing_categorical)
                continue
            manifest = load_manifest(path)
            options = manifest.get("options", {})
            vocabulary = options.get("min_frequency") or options.get("vocab_from")
            maps[split] = ("vocabulary", None) if vocabulary else ("hashed", manifest["missing_categorical"])
        if len(set(maps.values())) < 2:
            return
        order = sorted(maps, key=lambda split: not is_shard_dir(self.paths[split]))  # a directory first: it is fixed
        a = order[0]
        b = next(split for split in order if maps[split] != maps[a])
        if "vocabulary" in (maps[a][0], maps[b][0]):
            vocab, other = (a, b) if maps[a][0] == "vocabulary" else (b, a)
            raise ValueError(
                f"{vocab}_path {self.paths[vocab]} holds ids through a vocabulary (preprocessed with --min_frequency "
                f"or --vocab_from), but the ids of {other}_path {self.paths[other]} are hashed: the same value is "
                f"another table row there. Preprocess that split with the vocabulary, `lightning-rec preprocess "
                f"--input ... --output_dir DIR --vocab_from <the train split's directory>` (the train split's "
                f"--num_embeddings), and pass DIR")
        fix = ("preprocess both with one --missing_categorical" if is_shard_dir(self.paths[b]) else
               f"set data.missing_categorical={maps[a][1]} (a preprocessed directory keeps the one it was made with)")
        raise ValueError(
            f"{a}_path {self.paths[a]} holds ids of --missing_categorical {maps[a][1]}, but {b}_path {self.paths[b]} "
            f"{'holds them of' if is_shard_dir(self.paths[b]) else 'is hashed with'} {maps[b][1]}: the same value is "
            f"another table row there. {fix[0].upper() + fix[1:]}")

    def setup(self, stage: str | None = None) -> None:
        self._check_same_ids(self._splits_of(stage))
        check_same_rows(self._dataset_rows, "CriteoDataModule")
        for split in self._splits_of(stage):
            if split in self.datasets:
                continue
            if split in ("train", "val"):
                self._check_labelled(split)
            if is_shard_dir(self.paths[split]):
                dataset = CriteoShardDataset(
                    self.paths[split], self.batch_size if split == "train" else self.val_batch_size,
                    self.sparse_feature_names, shuffle=self.shuffle and split == "train", seed=self.seed,
                    drop_last=self.drop_last and split == "train", every_row=split != "train",
                )
                if dataset.num_embeddings_per_feature != self.num_embeddings_per_feature:
                    raise ValueError(
                        f"{self.paths[split]} was preprocessed for num_embeddings_per_feature="
                        f"{dataset.num_embeddings_per_feature}, but data.num_embeddings_per_feature is "
                        f"{self.num_embeddings_per_feature}: set the data and model num_embeddings_per_feature "
                        f"to the directory's (manifest.json), or preprocess again"
                    )
                if split == "predict" and dataset.manifest["options"].get("shuffle_rows"):
                    rank_zero_warn(f"{self.paths[split]}: preprocess shuffled the rows within each shard, so the "
                                   f"predictions' row column counts the directory's order, not the input file's; "
                                   f"to predict in the input's order, preprocess it again with --no_shuffle_rows",
                                   category=UserWarning)
                self.datasets[split] = dataset
            elif self.streaming:
                self.datasets[split] = CriteoIterableDataset(
                    self.paths[split], self.batch_size if split == "train" else self.val_batch_size,
                    self.num_embeddings_per_feature, self.sparse_feature_names, self.missing_categorical,
                    shuffle=self.shuffle and split == "train", seed=self.seed,
                    drop_last=self.drop_last and split == "train", on_bad_row=self.on_bad_row,
                    block_bytes=min(self.block_bytes, 16 << 20), row_ids=split == "predict", **self.layout_args,
                )
            else:
                self.datasets[split] = CriteoDataset(
                    self._cache(split), self.num_embeddings_per_feature, self.sparse_feature_names,
                    self.missing_categorical,
                )

    def _loader_options(self) -> dict:
        # read at each loader (not kept from __init__): a data module's num_workers may be set after construction
        return worker_options("CriteoDataModule", self.num_workers, self.pin_memory, self.prefetch_factor,
                              self.persistent_workers)

    def _loader(self, split: str) -> DataLoader:
        if self.paths[split] is None:
            raise ValueError(f"CriteoDataModule has no {split}_path: set it to use the {split} loop")
        if split not in self.datasets:
            raise ValueError(f"CriteoDataModule.setup() has not run for {split}: call setup() first")
        dataset = self.datasets[split]
        train = split == "train"
        if isinstance(dataset, IterableDataset):
            loader = make_stream_loader(dataset, **self._loader_options())
            return follow_fit_loop(loader, self.trainer) if train else loader
        if not train:  # every row once at any world size (not torch's DistributedSampler: it repeats rows)
            return make_eval_loader(dataset, self.val_batch_size, **self._loader_options())
        return make_train_loader(dataset, self.batch_size, shuffle=self.shuffle, drop_last=self.drop_last,
                                 seed=self.seed, trainer=self.trainer, **self._loader_options())

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader | list:
        # no val_path: an empty list tells Lightning there is no validation loop
        return self._loader("val") if self.paths["val"] is not None else []

    def test_dataloader(self) -> DataLoader:
        self._check_labelled("test")  # the test loop computes loss and metrics from labels
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")
