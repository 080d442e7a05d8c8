"""Criteo rows -> whole `Batch`es: `make_criteo_batch` (raw values -> dense transform and table ids), `CriteoDataset`
(map-style, over the memory-mapped cache) and `CriteoIterableDataset` (streaming: parsed block by block while iterating,
nothing cached).

Shapes: B rows in a batch, F = 26 sparse features, 13 dense features."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from lightning_rec.data.batch import Batch, PassEpoch
from lightning_rec.data.criteo.blocks import iter_blocks_resumable
from lightning_rec.data.criteo.layout import check_criteo_file
from lightning_rec.data.criteo.parse import CriteoReadOptions, parse_block
from lightning_rec.data.criteo.report import ParseReport
from lightning_rec.data.criteo.schema import (
    DEFAULT_SPARSE_FEATURE_NAMES,
    MISSING_RAW_ID,
    NUM_DENSE_FEATURES,
    NUM_SPARSE_FEATURES,
    check_missing_categorical,
    feature_names,
    resolve_num_embeddings,
    table_ids,
)
from lightning_rec.data.criteo.shards import dist_rank_world
from lightning_rec.data.criteo.stream_elastic import (
    continue_stream_epoch,
    continued_batches,
    read_position,
    stored_position,
    stream_elastic_state,
)
from lightning_rec.data.criteo.tables import TableBlocks, table_source_kind
from lightning_rec.sparse import KeyedJaggedTensor


def make_criteo_batch(label_B: np.ndarray, dense_raw_B13: np.ndarray, sparse_raw_BF: np.ndarray,
                      num_embeddings_F: np.ndarray, keys: Sequence[str],
                      missing_categorical: str = "reserved_id", hash_ids: bool = True,
                      task_names: Sequence[str] | None = None) -> Batch:
    """Raw values of B rows -> Batch: log(1 + max(x, 0)) on dense, hashing into tables on sparse. `task_names`: the
    tasks of a label [B, T] (several labels; None: one click label [B]).

    hash_ids=False: the sparse ids stay raw (unfolded, for managed-collision tables); a missing value reads
    MISSING_RAW_ID ("reserved_id") or an empty bag ("empty_bag")."""
    # fmax ignores NaN, so a missing count becomes log(1 + 0) = 0
    dense_B13 = np.log1p(np.fmax(dense_raw_B13, 0.0)).astype(np.float32, copy=False)
    sparse_FB = sparse_raw_BF.T
    mod_F1 = num_embeddings_F[:, None]
    batch_size = label_B.shape[0]
    if not hash_ids:
        present_FB = sparse_FB >= 0
        if missing_categorical == "reserved_id":
            values_N = np.where(present_FB, sparse_FB, MISSING_RAW_ID).reshape(-1)
            lengths_FB = np.ones(sparse_FB.size, dtype=np.int64)
        else:
            values_N = sparse_FB[present_FB]
            lengths_FB = present_FB.reshape(-1).astype(np.int64)
    elif missing_categorical == "reserved_id":
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
    return Batch(dense_features=torch.from_numpy(np.ascontiguousarray(dense_B13)), sparse_features=kjt,
                 labels=torch.from_numpy(np.ascontiguousarray(label_B, dtype=np.float32)),
                 task_names=tuple(task_names) if task_names is not None else None)


class CriteoDataset(Dataset):
    """Map-style dataset over a cached (memory-mapped) Criteo Arrow file; one item = one Batch. Use with
    `make_batch_loader`: the DataLoader calls `__getitems__(indices)` once per batch, gathered in numpy.
    `task_names`: the tasks of a cache with several labels (its label column [N, T])."""

    def __init__(self, arrow_path: str | os.PathLike, num_embeddings_per_feature: int | Sequence[int],
                 sparse_feature_names: Sequence[str] | None = None, missing_categorical: str = "reserved_id",
                 hash_ids: bool = True, task_names: Sequence[str] | None = None) -> None:
        self.arrow_path = str(arrow_path)
        self.task_names = tuple(task_names) if task_names is not None else None
        self.hash_ids = hash_ids
        self.keys = feature_names(sparse_feature_names)
        check_missing_categorical(missing_categorical)
        self.missing_categorical = missing_categorical
        self.num_embeddings_F = np.asarray(
            resolve_num_embeddings(num_embeddings_per_feature, NUM_SPARSE_FEATURES), dtype=np.int64
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
            label = rb.column(0)
            chunks.append(
                (
                    label.flatten().to_numpy(zero_copy_only=True).reshape(rb.num_rows, -1) if self.task_names else
                    label.to_numpy(zero_copy_only=True),
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
            np.empty((idx_B.size, len(self.task_names)) if self.task_names else idx_B.size, np.float32),
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
            label_B, dense_B13, sparse_BF, self.num_embeddings_F, self.keys, self.missing_categorical, self.hash_ids,
            self.task_names,
        )

    def empty_batch(self) -> Batch:
        """A batch of 0 rows: what a rank whose evaluation share ran out steps with (_strategy/loaders.py)."""
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

    Blocks (each `block_bytes` of text) are dealt round-robin to (rank, worker) pairs, so every row is read by exactly
    one of them: rank r of W reads the blocks b with b % W == r, at any num_workers; a file of fewer than two blocks per
    pair is dealt row by row instead. With `shuffle`, rows are shuffled within each block, per epoch (`set_epoch`);
    the block order stays the file order. Rows left over carry into the next block's batches.

    `row_ids=True` (predict): each batch carries an order key per row (`Batch.row_ids`), growing with the file order.
    `rank` / `world_size`: the ranks to deal to (default: the process group's). A checkpoint taken mid-epoch resumes
    at another world size over the rows no reader had read (stream_elastic.py)."""

    def __init__(self, path: str | os.PathLike, batch_size: int, num_embeddings_per_feature: int | Sequence[int],
                 sparse_feature_names: Sequence[str] | None = None, missing_categorical: str = "reserved_id",
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False, on_bad_row: str = "error",
                 separator: str | None = None, has_header: bool | None = None, has_label: bool | None = None,
                 block_bytes: int = 16 << 20, parser: str = "auto", row_ids: bool = False,
                 hash_ids: bool = True, label_columns: list[str] | dict[str, str] | None = None,
                 label_masks: dict[str, str] | None = None, rank: int | None = None,
                 world_size: int | None = None) -> None:
        options = CriteoReadOptions(separator, has_header, has_label, on_bad_row, block_bytes, parser, label_columns,
                                    label_masks)
        self.task_names = options.task_names
        check_missing_categorical(missing_categorical)
        # a table streams in blocks of rows: about as many as block_bytes of the cache's rows (264 bytes each)
        self.table = TableBlocks(path, has_label, block_bytes // 256, options.specs) if table_source_kind(path) \
            else None
        if self.table is None:
            check_criteo_file(path)
        self.row_ids = row_ids
        self.hash_ids = hash_ids
        self.parser = options.parser
        self.path = str(path)
        self.layout = options.layout(path) if self.table is None else None
        self.batch_size = batch_size
        self.num_embeddings_F = np.asarray(
            resolve_num_embeddings(num_embeddings_per_feature, NUM_SPARSE_FEATURES), dtype=np.int64
        )
        self.keys = list(sparse_feature_names or DEFAULT_SPARSE_FEATURE_NAMES)
        self.missing_categorical = missing_categorical
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.on_bad_row, self.block_bytes = on_bad_row, block_bytes
        self._epoch = PassEpoch()
        self._rank, self._world = rank, world_size
        self._dist = dist_rank_world()
        self._elastic: dict[str, Any] | None = None  # an epoch begun at another world size, continued here
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

    def rank_world(self) -> tuple[int, int]:
        """(rank, world size) this stream deals its blocks to: the constructor's, else the process group's."""
        if self._rank is not None:
            return self._rank, self._world or 1
        # DataLoader workers have no process group: they use what the main process saw (kept in their copy)
        if torch.utils.data.get_worker_info() is None:
            self._dist = dist_rank_world()
        return self._dist

    def _shard(self) -> tuple[int, int]:
        info = torch.utils.data.get_worker_info()
        rank, world = self.rank_world()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # ranks alternate in the deal (pair w * W + r): a rank's blocks do not depend on its worker count
        return worker * world + rank, world * num_workers

    # torchdata's Stateful protocol: the position is where the block being read began (reader position, block
    # index, generator state, rows carried over) plus the batches yielded from it; a resumed pass seeks there
    # (stored_position / read_position: the carried-over rows travel as tensors, which weights_only loads take).

    def state_dict(self) -> dict[str, Any]:
        return {"position": stored_position(getattr(self, "_position", None))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = read_position(state.get("position"))

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
        if position.get("continued"):  # its place is a count of the loader's (StatefulBatchLoader resumes it)
            warnings.warn(f"{self.path}: the saved reading position is in an epoch continued from another world size, "
                          f"which resumes through its loader's state: this pass starts from the beginning of the file",
                          stacklevel=3)
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
        if resume is None and self._elastic is not None and self._elastic["epoch"] == epoch:
            # an epoch begun at another world size (stream_elastic.py): a checkpoint records the rows read in it
            for columns in continued_batches(self, self._elastic, report):
                self._position = {**base, "continued": True}
                yield self._batch(*columns)
        else:
            for position, columns in self.read(shard, num_shards, epoch, resume, report, not self.drop_last):
                self._position = position  # before the yield: the loader reads the state while this waits there
                yield self._batch(*columns)
        self._position = {**base, "done": True}
        report.log_skips()

    def read(self, shard: int, num_shards: int, epoch: int, resume: dict | None, report: ParseReport,
             keep_last: bool, parsed: dict | None = None) -> Iterator[tuple[dict, list[np.ndarray]]]:
        """(the position once this batch is taken, its columns) of reader `shard` of `num_shards` in epoch `epoch`,
        from `resume` (a saved position of that reader; None: its share's start). `keep_last`: the share's last
        partial batch too. `parsed`: blocks parsed by readers that read alongside (rows dealt one by one: every
        reader parses every block), by block index."""
        base = {"shard": shard, "num_shards": num_shards, "block_bytes": self.block_bytes,
                "fingerprint": self.fingerprint, "epoch": epoch}
        if resume is not None and resume.get("done"):  # this reader had yielded its share's last batch (its only key)
            return
        rng = np.random.default_rng([self.seed, epoch, shard])
        if resume is None:
            start, k, seen, pending, skip = None, 0, 0, [], 0
        else:
            rng.bit_generator.state = resume["rng"]
            start, k, seen, pending, skip = (resume["reader"], resume["block"], resume["seen"], list(resume["pending"]),
                                             resume["yielded"])
        num_pending = sum(p[0].shape[0] for p in pending)
        blocks, num_blocks = self._blocks(start, k, report)
        # few blocks per shard: deal rows (a small file is shared evenly); many: deal whole blocks
        by_rows = num_shards > 1 and num_blocks < 2 * num_shards
        for reader, parse in blocks:
            here, k = k, k + 1
            if not by_rows and here % num_shards != shard:
                continue
            boundary = {**base, "reader": reader, "block": here, "seen": seen, "rng": rng.bit_generator.state,
                        "pending": list(pending)}
            if by_rows and parsed is not None:  # the readers alongside are within a block or two of this one
                if here not in parsed:
                    parsed[here] = parse()
                    for old in [b for b in parsed if b < here - 2]:
                        del parsed[old]
                block = parsed[here]
            else:
                block = parse()
            arrays, seen = self._rows_of(block, here, seen, (shard, num_shards) if by_rows else None, rng)
            pending.append(arrays)
            num_pending += arrays[0].shape[0]
            if num_pending < self.batch_size:
                continue
            columns = [np.concatenate(parts) for parts in zip(*pending)]  # label, dense, sparse (, row ids)
            full = (num_pending // self.batch_size) * self.batch_size
            for i, s in enumerate(range(0, full, self.batch_size)):
                if i < skip:  # a resumed pass: trained before the checkpoint
                    continue
                yield {**boundary, "yielded": i + 1}, [c[s:s + self.batch_size] for c in columns]
            skip = 0
            pending = [tuple(c[full:] for c in columns)]
            num_pending -= full
        if num_pending and keep_last:
            yield {**base, "done": True}, [np.concatenate(parts) for parts in zip(*pending)]

    # An epoch begun at N ranks, continued at M (data/elastic.py): see stream_elastic.py

    def elastic_state(self, epoch: int, batches: int, batch_size: int | None, finished: bool,
                      loader_state: dict | None = None) -> dict:
        """What a checkpoint records for a run at another world size: this rank's readers' positions after
        `batches` of epoch `epoch` (read from the loader's state), or the count of a continued epoch's rows read."""
        return stream_elastic_state(self, epoch, batches, finished, loader_state or {})

    def continue_epoch(self, epoch: int, elastic: dict, lead_batches: int, batch_size: int | None) -> bool:
        """Make the pass of epoch `epoch` the rows no reader had read (`elastic`: the elastic_state of every rank
        saved at another world size, under "ranks"); False: that epoch was over."""
        return continue_stream_epoch(self, epoch, elastic, lead_batches)

    def _blocks(self, start: dict | None, k: int, report: ParseReport) -> tuple[Iterator, int]:
        """(where each block begins: a text reader's position or a table's block index, a call that parses it)
        from `start` (text) or block `k` (a table), and the file's block count."""
        if self.table is None:
            blocks = ((reader, lambda b=block, line=first_line: parse_block(
                b, line, self.layout, self.path, self.on_bad_row, report, self.parser))
                for block, first_line, reader in iter_blocks_resumable(self.path, self.block_bytes,
                                                                       self.layout.has_header, start))
            return blocks, math.ceil(os.path.getsize(self.path) / self.block_bytes)
        blocks = ((b, lambda b=b: self.table.read(b, self.on_bad_row, report)) for b in range(k, self.table.num_blocks))
        return blocks, self.table.num_blocks

    def _rows_of(self, arrays: tuple, block: int, seen: int, dealt: tuple[int, int] | None,
                 rng: np.random.Generator) -> tuple[tuple, int]:
        """A parsed block's rows that this reader keeps (with their order keys when `row_ids`), shuffled if asked;
        and the rows seen so far. `dealt`: (shard, num_shards) when rows are dealt (None: this reader's block)."""
        n = arrays[0].shape[0]
        if self.row_ids:  # an order key per row (see the class doc), carried beside the rows
            arrays = (*arrays, np.arange(seen, seen + n) if dealt else (block << 32) + np.arange(n))
        if dealt:
            shard, num_shards = dealt
            mine = (np.arange(seen, seen + n) % num_shards) == shard
            seen += n
            arrays = tuple(a[mine] for a in arrays)
        if self.shuffle:
            perm = rng.permutation(arrays[0].shape[0])
            arrays = tuple(a[perm] for a in arrays)
        return arrays, seen

    def empty_batch(self) -> Batch:
        """A batch of 0 rows, what a rank whose stream ran out steps with in evaluation (_strategy/loaders.py)."""
        return self._batch(np.empty((0, len(self.task_names)) if self.task_names else 0, np.float32),
                           np.empty((0, NUM_DENSE_FEATURES), np.float32),
                           np.empty((0, NUM_SPARSE_FEATURES), np.int64),
                           *((np.empty(0, np.int64),) if self.row_ids else ()))

    def _batch(self, label: np.ndarray, dense: np.ndarray, sparse: np.ndarray,
               row_ids: np.ndarray | None = None) -> Batch:
        batch = make_criteo_batch(label, dense, sparse, self.num_embeddings_F, self.keys, self.missing_categorical,
                                  self.hash_ids, self.task_names)
        if row_ids is not None:
            batch.row_ids = torch.from_numpy(np.ascontiguousarray(row_ids, dtype=np.int64))
        return batch
