"""A stream's epoch (`CriteoIterableDataset`) begun at N ranks, continued at M (docs/checkpoints.md; data/elastic.py
has the rule for the other sources).

A stream has no order that every rank knows: reader k of K (k = worker * N + rank, one per DataLoader worker of each
rank) parses the blocks (or rows) dealt to it and shuffles within them. So each rank's checkpoint records its readers'
positions (every rank's reaches the checkpoint: RecStrategy and the plain strategies gather the loader states), and
the continued epoch's order is the readers' rests taken batch by batch in turn (reader 0's next batch as it would
have yielded it, reader 1's, ..., K-1's, reader 0's again; a reader whose rest ran out is passed over), its last
partial batch included (drop_last leaves it out of a whole epoch). Rank m of M takes positions m, m + M, ... of that
order, `share = len(order) // M` rows each (the fewer than M rows past M * share are the epoch's remainder, read by
no rank), in batches of B in order (drop_last: its last partial batch is left out too); its DataLoader workers take
its batches j = worker, worker + num_workers, ....

    readers' rests (K = 2, B = 2):  a0 a1 | a2 a3 | a4     b0 b1 | b2 b3
    order: a0 a1 b0 b1 a2 a3 b2 b3 a4                    M = 2
    rank 0: a0 b0 | a2 b2           rank 1: a1 b1 | a3 b3            (a4: the remainder)

Cost: every reader of the continued epoch (rank x worker) reads the whole order to find its rows in it: each parses
the rest of the epoch once (the saved readers, read in step, share the blocks they all parse), so the rest is parsed
M x num_workers times over the ranks, in parallel. As in any stream epoch each saved reader reads the text of the
file past its place and parses only its own blocks. The epochs after it are ordinary M-rank epochs.

M ranks after s steps of a continued epoch have read positions [0, s * M * B) of its order (rank m's batch j holds
positions m + M * (j * B ..)): a checkpoint records that count (`rows_consumed`), and a resume, at M ranks or at
another world size, continues the same order from there by the same rule (a position in a continued epoch is a
count, not a reader's place in a file).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def stored_position(position: dict | None) -> dict | None:
    """A reader's position as a checkpoint keeps it: the rows carried over as tensors (torch.load(weights_only=True)
    refuses numpy arrays)."""
    if position is not None and position.get("pending"):
        position = {**position, "pending": [tuple(torch.from_numpy(a) for a in rows) for rows in position["pending"]]}
    return position


def read_position(position: dict | None) -> dict | None:
    """A stored position as a reader resumes from it (the rows carried over as numpy arrays)."""
    if position is not None and position.get("pending"):
        position = {**position, "pending": [tuple(np.asarray(a) for a in rows) for rows in position["pending"]]}
    return position


def reader_positions(loader_state: dict) -> list[dict | None]:
    """This rank's readers' positions in a StatefulDataLoader's state: its dataset's, or each worker's in worker
    order (None: a reader with none yet)."""
    snapshot = loader_state.get("_snapshot")
    if snapshot is None:
        states = [loader_state.get("dataset_state")]
    else:
        workers = snapshot.get("_worker_snapshots") or {}
        states = [workers[k].get("dataset_state") for k in sorted(workers, key=lambda k: int(k.rsplit("_", 1)[1]))]
    return [(s or {}).get("position") for s in states]


def stream_elastic_state(ds: Any, epoch: int, batches: int, finished: bool, loader_state: dict) -> dict:
    """What a checkpoint records for a run at another world size after `batches` of epoch `epoch` on this rank."""
    rank, world = ds.rank_world()
    record: dict[str, Any] = {"world_size": world, "finished": bool(finished), "block_bytes": ds.block_bytes}
    continued = ds._elastic
    if continued is not None and continued["epoch"] == epoch:
        rows = (batches - continued["lead"]) * ds.batch_size * continued["world"]
        # resumed through continue_epoch at any world size, this one too (the order is not any reader's file place)
        return {**record, "continued": continued, "rows_consumed": continued["start"] + rows, "continue_here": True}
    positions = reader_positions(loader_state)
    num_shards = world * len(positions)
    readers = []
    for worker, position in enumerate(positions):
        shard = worker * world + rank
        same = (position is not None and position.get("epoch") == epoch and position.get("shard") == shard
                and position.get("num_shards") == num_shards)
        readers.append([shard, position if same else None])  # not of this pass: the reader had not started it
    return {**record, "num_shards": num_shards, "readers": readers}


def continue_stream_epoch(ds: Any, epoch: int, elastic: dict, lead_batches: int) -> bool:
    """Make the pass of epoch `epoch` the continued order (module doc); False: that epoch was over."""
    records = elastic.get("ranks") or [elastic]
    if any(r.get("finished") for r in records):
        return False
    first = records[0]
    if first.get("block_bytes") != ds.block_bytes:
        warnings.warn(f"{ds.path}: the checkpoint's stream positions were read in blocks of {first.get('block_bytes')} "
                      f"bytes, this stream reads {ds.block_bytes}: the interrupted epoch starts over from its first "
                      f"batch instead of continuing over the rows not yet read (keep block_bytes to continue it)",
                      stacklevel=3)
        ds._elastic = None
        return True
    _, world = ds.rank_world()
    if "continued" in first:
        defn = {**first["continued"], "start": int(first["rows_consumed"])}
    else:
        readers = sorted((reader for r in records for reader in r["readers"]), key=lambda reader: reader[0])
        if [k for k, _ in readers] != list(range(first["num_shards"])):  # a state not saved by one run's ranks
            warnings.warn(f"{ds.path}: the checkpoint's stream positions name readers {[k for k, _ in readers]}, not "
                          f"each of its {first['num_shards']} readers once (ranks' states from different runs?): "
                          f"the interrupted epoch starts over from its first batch", stacklevel=3)
            ds._elastic = None
            return True
        if all(p is not None and p.get("done") for _, p in readers):
            return False
        defn = {"epoch": int(epoch), "num_shards": int(first["num_shards"]), "readers": readers, "start": 0}
    ds._elastic = {**defn, "lead": int(lead_batches), "world": world}
    ds.set_epoch(epoch)
    return True


def continued_batches(ds: Any, defn: dict, report: Any) -> Iterator[list[np.ndarray]]:
    """This rank's (and DataLoader worker's) batches of a continued epoch: columns, as `ds.read` gives them."""
    rank, world = ds.rank_world()
    info = torch.utils.data.get_worker_info()
    worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
    size = ds.batch_size
    kept: list[list[np.ndarray]] = []  # this rank's rows not yet batched, in chunks
    num_kept, batch, at = 0, 0, -int(defn["start"])  # at: the order position of the next row, from `start`

    def take(n: int) -> list[np.ndarray]:
        nonlocal kept, num_kept
        columns = [np.concatenate(parts) for parts in zip(*kept)]
        kept = [[c[n:] for c in columns]]
        num_kept -= n
        return [c[:n] for c in columns]

    for columns in _order(ds, defn, report):
        n = columns[0].shape[0]
        lo = max(0, -at)  # rows before `start` were read before the checkpoint
        if lo < n:
            first = lo + (rank - (at + lo)) % world
            kept.append([c[first::world] for c in columns])
            num_kept += kept[-1][0].shape[0]
        at += n
        while num_kept > size:  # a whole batch and a row after it: none of it is past this rank's share
            rows = take(size)
            if batch % num_workers == worker:
                yield rows
            batch += 1
    share = max(at, 0) // world  # every rank reads as many rows: the ranks step together to the end
    mine = batch * size + num_kept
    if mine > share:  # the one row past M * share that this rank was dealt: the epoch's remainder
        columns = [np.concatenate(parts) for parts in zip(*kept)]
        num_kept -= mine - share
        kept = [[c[:num_kept] for c in columns]]
    while num_kept >= size or (num_kept > 0 and not ds.drop_last):
        rows = take(min(size, num_kept))
        if batch % num_workers == worker:
            yield rows
        batch += 1


def _order(ds: Any, defn: dict, report: Any) -> Iterator[list[np.ndarray]]:
    """The continued epoch's order from `start` on: the saved readers' rests, batch by batch in turn (reader 0's
    next batch, reader 1's, ..., a reader whose rest ran out left out), as the readers would have yielded them. Read
    in step, the readers share the blocks they all parse (rows dealt one by one)."""
    parsed: dict[int, Any] = {}
    readers = [ds.read(shard, defn["num_shards"], defn["epoch"], read_position(position), report, True, parsed)
               for shard, position in defn["readers"]]
    while readers:
        for reader in list(readers):
            batch = next(reader, None)
            if batch is None:
                readers.remove(reader)
            else:
                yield batch[1]
