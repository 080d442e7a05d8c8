"""Preprocessed Criteo shards (`lightning-rec preprocess`) -> whole `Batch`es, each rank reading its share.

Shapes: n rows of a shard, B rows in a batch, F = 26 sparse features, 13 dense features, W ranks.

The on-disk format (written by `lightning_rec.data.criteo.preprocess`):

    <dir>/manifest.json               format, options, num_embeddings_per_feature, has_label, shards
    <dir>/<shard>.label.npy           [n]      float32  0 / 1
                                      [n, T]   float32  format /2 (preprocess --label_columns): the tasks'
                                                        labels, NaN where missing; manifest "task_names", "labels"
    <dir>/<shard>.dense.npy           [n, 13]  float32  log(1 + max(x, 0)), missing -> 0
    <dir>/<shard>.sparse.npy          [n, 26]  int32    table ids (see manifest "missing_categorical")
    <dir>/<shard>.json                the shard's record: rows, sha256 of each file, input byte range

.npy, not Arrow: a batch is three contiguous slices of memory-mapped arrays. How the rows are dealt (every rank
computes the same split from the manifest, no communication):

    shard i, rows [0, n_i)  ->  rank r reads rows [n_i * r / W, n_i * (r + 1) / W) of every shard
    training: every rank reads the smallest share's row count per epoch (same steps on every rank);
    epoch e starts where epoch e - 1 stopped in the rank's share, cyclically, so every row is trained on
    evaluation (`every_row=True`): every rank keeps its whole share; a shorter one steps on with empty
    batches (0 rows) to the longest share's count
    batch k of a rank = its rows [s + k * B, s + (k + 1) * B) (s: the epoch's start; past the share's end
    it wraps to its start): slices, never a per-sample gather
    workers of a rank take batches k = worker, worker + num_workers, ...; shuffle=True permutes the
    batch order each epoch (rows were shuffled within each shard by preprocess)"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from lightning_rec.data.batch import Batch, PassEpoch
from lightning_rec.data.criteo.schema import NUM_DENSE_FEATURES, NUM_SPARSE_FEATURES, feature_names
from lightning_rec.data.elastic import deal
from lightning_rec.data.labels import LabelSpec
from lightning_rec.sparse import KeyedJaggedTensor

MANIFEST = "manifest.json"
REDO = ("rerun the `lightning-rec preprocess` command that wrote it (it checks every shard and redoes the damaged "
        "ones), or copy the directory again")
SHARD_FORMAT = "lightning_rec.criteo_shards/1"  # one label [n]: what every directory before /2 holds
SHARD_FORMAT_TASKS = "lightning_rec.criteo_shards/2"  # several labels [n, T] (a shard record's "tasks": T)
ARRAYS = {  # name: (dtype, columns or None)
    "label": (np.float32, None),
    "dense": (np.float32, NUM_DENSE_FEATURES),
    "sparse": (np.int32, NUM_SPARSE_FEATURES),
}


def is_shard_dir(path: str | os.PathLike | None) -> bool:
    """True for a directory written by `lightning-rec preprocess` (it holds manifest.json)."""
    return path is not None and os.path.isfile(os.path.join(os.fspath(path), MANIFEST))


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def shard_files(directory: str | os.PathLike, shard: str) -> dict[str, Path]:
    return {name: Path(directory) / f"{shard}.{name}.npy" for name in ARRAYS}


def verify_shard(directory: str | os.PathLike, record: dict, checksum: bool = True) -> str | None:
    """None when the shard's files exist with its row count (and checksums); else what is wrong."""
    for name, path in shard_files(directory, record["name"]).items():
        if not path.is_file():
            return f"{path.name} is missing"
        try:
            arr = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as e:
            return f"{path.name} is not a readable .npy file ({e})"
        dtype, cols = ARRAYS[name]
        cols = record.get("tasks") if name == "label" else cols
        want = (record["rows"],) if cols is None else (record["rows"], cols)
        if arr.shape != want or arr.dtype != dtype:
            return f"{path.name} holds {arr.dtype} {arr.shape}, the record says {np.dtype(dtype)} {want}"
        if checksum and file_sha256(path) != record["sha256"][name]:
            return f"{path.name} does not match its sha256 (a partial or altered write)"
    return None


def load_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a finished preprocess run (a clear error for an unfinished or foreign one)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        hint = "it is still being written or was interrupted: rerun the same `lightning-rec preprocess` command"
        if not any(Path(directory).glob("*.json")):
            hint = "it is not a `lightning-rec preprocess` output directory"
        raise ValueError(f"{directory} has no {MANIFEST}: {hint}")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:  # (a JSON or UTF-8 error) cut short: a partial copy, a full disk
        raise ValueError(f"{path} is damaged or incomplete ({e}): {REDO}") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in (SHARD_FORMAT, SHARD_FORMAT_TASKS):
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"{path} has format {found!r}, this version reads {SHARD_FORMAT!r} and "
                         f"{SHARD_FORMAT_TASKS!r}: rerun `lightning-rec preprocess` with this version")
    return manifest


def check_shard_tasks(directory: str | os.PathLike, manifest: dict, specs: Sequence[LabelSpec] | None,
                      where: str) -> None:
    """The tasks a data module asks for (`specs`: its label_columns / label_masks) are the ones the directory holds."""
    held = manifest.get("labels")  # the LabelSpecs preprocess derived the directory's labels with
    if held == ([asdict(s) for s in specs] if specs else None):
        return
    if held is None:
        raise ValueError(f"{where}(label_columns=...): {directory} is preprocessed with one label column: preprocess "
                         f"the files again with --label_columns (the same tasks), or give the text or table files")
    options = manifest["options"]
    given = ", ".join(f"{k}={options[k]!r}" for k in ("label_columns", "label_masks") if options.get(k))
    raise ValueError(f"{where}: {directory} was preprocessed with {given} (tasks {manifest['task_names']}) and holds "
                     f"those labels only: pass the same {given}, or preprocess again")


def dist_rank_world() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def rank_segments(shard_rows: Sequence[int], rank: int, world_size: int, every_row: bool = False
                  ) -> list[tuple[int, int, int]]:
    """(shard, lo, hi) row ranges of `rank`: the same total on every rank, or its whole share (`every_row`)."""
    segs_per_rank = []
    for r in range(world_size):
        segs_per_rank.append([(i, n * r // world_size, n * (r + 1) // world_size) for i, n in enumerate(shard_rows)])
    if every_row:
        return [seg for seg in segs_per_rank[rank] if seg[2] > seg[1]]
    common = min(sum(hi - lo for _, lo, hi in segs) for segs in segs_per_rank)
    out, left = [], common
    for i, lo, hi in segs_per_rank[rank]:
        take = min(hi - lo, left)
        if take > 0:
            out.append((i, lo, lo + take))
        left -= take
    return out


class CriteoShardDataset(IterableDataset):
    """Batches of a preprocessed Criteo directory; each rank reads only its share of every shard.

    Use with `DataLoader(dataset, batch_size=None, ...)`; `len()` is this rank's batch count. With `shuffle=True`, call
    `set_epoch(epoch)` before each epoch, as with torch's DistributedSampler. `every_row=True` (evaluation): each rank
    reads its whole share, `len()` is the longest share's count, and batches past it are empty."""

    def __init__(self, directory: str | os.PathLike, batch_size: int, sparse_feature_names: Sequence[str] | None = None,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None, every_row: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.directory = str(directory)
        self.manifest = load_manifest(directory)
        self.keys = feature_names(sparse_feature_names)
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self.num_embeddings_per_feature = list(self.manifest["num_embeddings_per_feature"])
        self.has_label = bool(self.manifest["has_label"])
        # several labels (format /2): labels [B, T] of these tasks; None: one label [B]
        self.task_names = tuple(self.manifest["task_names"]) if self.manifest.get("task_names") else None
        self.empty_bag = self.manifest["missing_categorical"] == "empty_bag"
        self._rank, self._world = rank, world_size
        self.every_row = every_row
        self._dist = dist_rank_world()
        self._epoch = PassEpoch()
        self._skip = 0  # batches of the next epoch already trained on (resume_from)
        self._pass_epoch, self._yielded, self._resume = 0, 0, None  # the loader's saved position (state_dict)
        # an epoch begun at another world size, continued here (continue_epoch): epoch, order_world, start, lead
        self._elastic: dict[str, int] | None = None
        self._elastic_next = False  # the next pass is that epoch
        self._arrays: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None

    @property
    def num_rows(self) -> int:
        """Rows in the directory (all ranks)."""
        return int(sum(s["rows"] for s in self.manifest["shards"]))

    def _rank_world(self) -> tuple[int, int]:
        if self._rank is not None:
            return self._rank, self._world or 1
        # DataLoader workers have no process group: they use what the main process saw (kept in the copy)
        if torch.utils.data.get_worker_info() is None:
            self._dist = dist_rank_world()
        return self._dist

    def segments(self, rank: int | None = None) -> list[tuple[int, int, int]]:
        me, world = self._rank_world()
        return rank_segments([s["rows"] for s in self.manifest["shards"]], me if rank is None else rank, world,
                             every_row=self.every_row)

    def rank_rows(self, rank: int | None = None) -> int:
        return sum(hi - lo for _, lo, hi in self.segments(rank))

    def _num_batches(self, rows: int) -> int:
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    def __len__(self) -> int:
        if self.every_row:  # the same on every rank (each rank computes every share): they step together
            return max(self._num_batches(self.rank_rows(r)) for r in range(self._rank_world()[1]))
        whole = self._num_batches(self.rank_rows())
        if self._elastic is None:
            return whole
        # the steps counted before the resume and the batches left: Lightning keeps this length for later epochs
        return max(whole, self._elastic["lead"] + self._num_batches(self._elastic_share()))

    def rank_world(self) -> tuple[int, int]:
        """(rank, world size) this dataset deals its rows to."""
        return self._rank_world()

    @property
    def fingerprint(self) -> str:
        """What a saved reading position belongs to: the shard set (names, rows) and how batches are made."""
        shards = hashlib.sha256(",".join(f"{r['name']}:{r['rows']}" for r in self.manifest["shards"]).encode())
        return f"{shards.hexdigest()[:16]}:{self.batch_size}:{int(self.shuffle)}:{self.seed}:{int(self.drop_last)}"

    # An epoch begun at N ranks, continued at M (data/elastic.py). The epoch's rows at N ranks, step-major (step k:
    # rank 0's batch, rank 1's, ...), are an order of which N ranks after s steps have read a prefix; the rest is
    # dealt over the M ranks row by row (elastic.deal), each rank's share the same, batched in order. The rows past
    # M * share (fewer than M) are this epoch's remainder, as rows past the shortest share are in a whole epoch.

    def _epoch_plan(self, world: int) -> tuple[int, int]:
        """(rows each rank reads in an epoch at `world` ranks, its batches)."""
        common = sum(hi - lo for _, lo, hi in rank_segments([r["rows"] for r in self.manifest["shards"]], 0, world))
        batches = self._num_batches(common)
        return min(batches * self.batch_size, common), batches

    def _batch_rows(self, rank: int, world: int, epoch: int) -> list[np.ndarray]:
        """Rank `rank`'s batches of epoch `epoch` at `world` ranks, in the order it reads them, as directory rows."""
        rows, num_batches = self._epoch_plan(world)
        shard_start = np.cumsum([0] + [r["rows"] for r in self.manifest["shards"]])
        segments = rank_segments([r["rows"] for r in self.manifest["shards"]], rank, world, every_row=True)
        share_rows = np.concatenate([np.arange(shard_start[i] + lo, shard_start[i] + hi) for i, lo, hi in segments]
                                    or [np.empty(0, np.int64)])
        share = share_rows.size
        first_row = (epoch * rows) % share if share else 0
        order = self._batch_order(epoch, num_batches)
        return [share_rows[(first_row + np.arange(k * self.batch_size, min((k + 1) * self.batch_size, rows))) % share]
                for k in order]

    def _batch_order(self, epoch: int, num_batches: int) -> np.ndarray:
        """The order an epoch reads a rank's batches in (the same on every rank)."""
        if self.shuffle:
            return np.random.default_rng([self.seed, epoch]).permutation(num_batches)
        return np.arange(num_batches)

    def _epoch_order(self, epoch: int, world: int) -> np.ndarray:
        per_rank = [self._batch_rows(r, world, epoch) for r in range(world)]
        return np.concatenate([b for step in zip(*per_rank) for b in step] or [np.empty(0, np.int64)])

    def elastic_state(self, epoch: int, batches: int, batch_size: int, finished: bool,
                      loader_state: dict | None = None) -> dict:
        """What a checkpoint records for a run at another world size: the rows all ranks have read, a prefix of the
        epoch's order at `order_world` ranks (data/elastic.py)."""
        _, world = self._rank_world()
        if self._elastic is not None and self._elastic["epoch"] == epoch:
            order_world, start, lead = self._elastic["order_world"], self._elastic["start"], self._elastic["lead"]
            share = self._elastic_share()
            read = (batches - lead) * self.batch_size
            total = self._epoch_plan(order_world)[0] * order_world
            done = finished or read >= share or (self.drop_last and read + self.batch_size > share)
            consumed = total if done else start + read * world
        else:
            rows, num_batches = self._epoch_plan(world)
            order_world, done = world, finished or batches >= num_batches
            first = self._batch_order(epoch, num_batches)[:batches]
            read = rows if done else int((np.minimum((first + 1) * self.batch_size, rows) - first * self.batch_size)
                                         .sum())
            consumed = read * world  # every rank's batch k has the same size
        return {"world_size": world, "order_world": order_world, "rows_consumed": int(consumed)}

    def continue_epoch(self, epoch: int, elastic: dict, lead_batches: int, batch_size: int) -> bool:
        """Make the next pass epoch `epoch` over the rows no rank read (`elastic`: elastic_state saved at another
        world size); False: that epoch was over."""
        order_world = int(elastic.get("order_world", elastic["world_size"]))
        if elastic["rows_consumed"] >= self._epoch_plan(order_world)[0] * order_world:
            return False
        self._elastic = {"epoch": int(epoch), "order_world": order_world, "start": int(elastic["rows_consumed"]),
                         "lead": int(lead_batches)}
        self._elastic_next = True
        self._epoch.set(epoch)
        return True

    def _elastic_share(self) -> int:
        """Rows of the continued epoch each rank reads here."""
        e = self._elastic
        return (self._epoch_plan(e["order_world"])[0] * e["order_world"] - e["start"]) // self._rank_world()[1]

    def _elastic_batches(self, done: int) -> Iterator[Batch]:
        """The continued epoch's batches of this rank (and worker), past its first `done`."""
        e, (me, world) = self._elastic, self._rank_world()
        share = self._elastic_share()
        mine = np.asarray(deal(self._epoch_order(e["epoch"], e["order_world"])[e["start"]:], me, world, share))
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        arrays = self._open()
        shard_start = np.cumsum([0] + [r["rows"] for r in self.manifest["shards"]])
        for j in list(range(self._num_batches(share)))[worker::num_workers][done:]:
            self._yielded += 1  # before the yield (see __iter__)
            rows = mine[j * self.batch_size : (j + 1) * self.batch_size]
            shard_of = np.searchsorted(shard_start, rows, side="right") - 1
            columns = [np.empty((rows.size, *a.shape[1:]), a.dtype) for a in arrays[0]]
            for shard in np.unique(shard_of):
                picked = shard_of == shard
                for column, a in zip(columns, arrays[shard]):
                    column[picked] = a[rows[picked] - shard_start[shard]]
            yield self.make_batch(*columns)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose batch order the next iteration uses (shuffle=True). Untold, each iteration counts one
        epoch in the process that iterates; the workers read the epoch told here."""
        self._epoch.set(epoch)

    def resume_from(self, epoch: int, batches_done: int) -> None:
        """Make the next iteration epoch `epoch` without its first `batches_done` batches (mid-epoch resume). The
        batch order depends only on (seed, epoch), so the skipped batches are exactly the ones trained on."""
        if not 0 <= batches_done <= len(self):
            raise ValueError(f"batches_done must be in [0, {len(self)}] for this rank, got {batches_done}")
        self._epoch.set(epoch)
        self._skip = batches_done

    # torchdata's Stateful protocol: a resumed pass skips the batches yielded without reading them

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self._pass_epoch, "yielded": self._yielded}
        if self._elastic is not None and self._elastic["epoch"] == self._pass_epoch:
            state["elastic"] = dict(self._elastic)  # a continued epoch resumes as one
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = (int(state["epoch"]), int(state["yielded"]))
        if state.get("elastic") is not None:
            self._elastic, self._elastic_next = dict(state["elastic"]), True

    def _open(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        # memory maps: pages are read on demand and shared with the other workers through the page cache
        if self._arrays is None:
            for record in self.manifest["shards"]:  # the files' sizes against the manifest's rows (no checksum)
                problem = verify_shard(self.directory, record, checksum=False)
                if problem is not None:
                    raise ValueError(f"{self.directory}: shard {record['name']} is damaged or incomplete: {problem} "
                                     f"(a partial copy, a full disk?): {REDO}")
            self._arrays = [
                tuple(np.load(p, mmap_mode="r") for p in shard_files(self.directory, s["name"]).values())
                for s in self.manifest["shards"]
            ]
        return self._arrays

    def _ones(self, n: int) -> torch.Tensor:
        # one id per bag: the same lengths every batch of this size (not shared in a DataLoader worker)
        if torch.utils.data.get_worker_info() is not None:
            return torch.ones(n, dtype=torch.int64)
        if getattr(self, "_ones_n", None) is None or self._ones_n.numel() != n:
            self._ones_n = torch.from_numpy(np.ones(n, dtype=np.int64))
        return self._ones_n

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_arrays"] = None  # workers map the files themselves
        return state

    def __iter__(self) -> Iterator[Batch]:
        resume, self._resume = self._resume, None
        if self._elastic_next and not self.every_row:  # an epoch begun at another world size
            self._elastic_next = False
            self._pass_epoch = self._epoch.take(self._elastic["epoch"])
            self._yielded = resume[1] if resume is not None else 0
            yield from self._elastic_batches(self._yielded)
            return
        self._elastic = None  # (before len(): the epochs after a continued one are whole ones)
        me, world = self._rank_world()
        segments = rank_segments([s["rows"] for s in self.manifest["shards"]], me, world, every_row=True)  # the share
        # where each segment starts in this rank's row order
        seg_start = np.cumsum([0] + [hi - lo for _, lo, hi in segments])
        share = int(seg_start[-1])
        num_batches = len(self)
        # rows an epoch reads (training: drop_last's remainder and rows past the shortest share left out)
        rows = min(num_batches * self.batch_size, self.rank_rows())
        epoch = self._epoch.take(None if resume is None else resume[0])
        # epoch e starts where epoch e - 1 stopped (a function of the epoch alone: a resumed epoch reads the same rows)
        first_row = (epoch * rows) % share if share else 0
        order, self._skip = self._batch_order(epoch, num_batches)[self._skip:], 0
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        done = resume[1] if resume is not None else 0  # this worker's batches of the pass already trained on
        self._pass_epoch, self._yielded = epoch, done
        arrays = self._open()
        # where each shard starts in the directory's row order (Batch.row_ids of evaluation rows)
        shard_start = np.cumsum([0] + [s["rows"] for s in self.manifest["shards"]])
        for k in order[worker::num_workers][done:]:
            self._yielded += 1  # before the yield: the loader reads the state while this generator waits there
            lo, hi = int(k) * self.batch_size, min((int(k) + 1) * self.batch_size, rows)
            if lo >= hi:  # every_row: past this rank's share, an empty batch keeps it stepping with the others
                yield self.empty_batch()
                continue
            lo, hi = first_row + lo, first_row + hi  # in the share, where the batch may wrap past its end
            pieces, places = [], []
            s = int(np.searchsorted(seg_start, lo % share, side="right")) - 1
            while lo < hi:  # a batch spans at most a few shards
                shard, seg_lo, _ = segments[s]
                at = lo % share
                a = seg_lo + at - int(seg_start[s])
                take = min(hi - lo, int(seg_start[s + 1]) - at)
                pieces.append(tuple(arr[a:a + take] for arr in arrays[shard]))
                places.append((int(shard_start[shard]) + a, take))
                lo += take
                s = (s + 1) % len(segments)
            batch = self.make_batch(*(np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])
                                      for parts in zip(*pieces)))
            if self.every_row:
                batch.row_ids = torch.from_numpy(np.concatenate([np.arange(a, a + n) for a, n in places]))
            yield batch

    def empty_batch(self) -> Batch:
        """A batch of 0 rows (evaluation padding; see `every_row`)."""
        labels = np.empty((0, len(self.task_names)) if self.task_names else 0, np.float32)
        batch = self.make_batch(labels, np.empty((0, NUM_DENSE_FEATURES), np.float32),
                                np.empty((0, NUM_SPARSE_FEATURES), np.int32))
        batch.row_ids = torch.empty(0, dtype=torch.int64)
        return batch

    def make_batch(self, label_B: np.ndarray, dense_B13: np.ndarray, sparse_BF: np.ndarray) -> Batch:
        """Slices -> Batch: the ids become key-major KJT values, nothing else is computed. Small numpy steps rather
        than torch ops, which would each open a thread pool region for arrays this small."""
        batch_size = label_B.shape[0]
        ids_FB = torch.from_numpy(np.ascontiguousarray(sparse_BF.T, dtype=np.int64))  # int32 [B, F] -> int64 [F, B]
        if self.empty_bag:
            present_FB = ids_FB >= 0
            values_N, lengths = ids_FB[present_FB], present_FB.reshape(-1).to(torch.int64)
        else:
            values_N, lengths = ids_FB.reshape(-1), self._ones(ids_FB.numel())
        kjt = KeyedJaggedTensor.from_lengths_sync(self.keys, values_N, lengths, stride=batch_size)
        labels = torch.from_numpy(label_B)
        if not self.has_label:
            labels = torch.full((batch_size,), float("nan"))
        return Batch(dense_features=torch.from_numpy(dense_B13), sparse_features=kjt, labels=labels,
                     task_names=self.task_names)
