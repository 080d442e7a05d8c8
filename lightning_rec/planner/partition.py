"""Placing one proposal's pieces onto ranks under memory limits, slowest rank first (a heap).

Fixed pieces stay where they are, host pieces go to the host whose slowest rank stays fastest, rank pieces go
slowest-first onto the least-loaded rank with room. See plan.py for the whole flow."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from lightning_rec.planner.estimate import (
    COMM,
    COMPUTE,
    DDR,
    HBM,
    ShardingOption,
)

_EPS = 1e-9


class _Placement:
    """A partitioned proposal: where each piece went and what each rank holds."""

    def __init__(self, load: np.ndarray, where: list[list[int]], failed: list[int]):
        self.load = load  # [W, 4]
        self.where = where  # per table: rank (rank pieces) or host (host pieces) per piece
        self.failed = failed  # tables whose pieces found no room
        self.ok = not failed
        self.score = float((load[:, COMPUTE] + load[:, COMM]).max()) if self.ok else float("inf")


def _partition(options: Sequence[ShardingOption], caps: np.ndarray, W: int, L: int, by_memory: bool) -> _Placement:
    """Place one option per table. `by_memory`: biggest pieces first onto the emptiest rank."""
    load = np.zeros((W, 4))
    where: list[list[int]] = [[-1] * len(o.pieces) for o in options]
    failed: set[int] = set()
    safe = tuple(float(c) if c > 0 else 1.0 for c in caps)  # CPU ranks have no HBM
    fixed, host, rank = _ordered_pieces(options, by_memory, safe)
    _place_fixed(options, fixed, load, caps, failed)
    _place_on_hosts(options, host, load, where, failed, caps, L, by_memory, safe)
    added = _place_on_ranks(options, rank, load, where, failed, caps, by_memory, safe)
    return _Placement(load + added, where, sorted(failed))


_Piece = tuple[float, int, int]  # (sort key, table, piece)


def _ordered_pieces(options: Sequence[ShardingOption], by_memory: bool,
                    safe: tuple[float, float]) -> tuple[list[_Piece], list[_Piece], list[_Piece]]:
    """The fixed, host and rank pieces, each list biggest (by memory share) or slowest first."""
    safe_h, safe_d = safe
    lists: dict[str, list[_Piece]] = {"fixed": [], "host": [], "rank": []}
    for t, o in enumerate(options):
        out = lists[o.kind]
        for k in range(len(o.pieces)):
            if by_memory:
                h, d = o.piece_bytes[k]
                out.append((-max(h / safe_h, d / safe_d), t, k))
            else:
                out.append((-o.piece_ms[k], t, k))
    for pieces in lists.values():
        pieces.sort()
    return lists["fixed"], lists["host"], lists["rank"]


def _place_fixed(options: Sequence[ShardingOption], fixed: list[_Piece], load: np.ndarray, caps: np.ndarray,
                 failed: set[int]) -> None:
    """Pieces whose ranks are given (every rank's [W, 4] load at once): added to `load` where they fit."""
    if fixed:
        together = np.sum([options[t].pieces[0] for _, t, _ in fixed], axis=0)
        if (together[:, :2] <= caps + _EPS).all():  # the common case: no need to go one by one
            load += together
            return
    for _, t, _ in fixed:
        piece = options[t].pieces[0]
        new = load[:, :2] + piece[:, :2]
        if (new <= caps + _EPS).all():
            load += piece
        else:
            failed.add(t)


def _place_on_hosts(options: Sequence[ShardingOption], host: list[_Piece], load: np.ndarray, where: list[list[int]],
                    failed: set[int], caps: np.ndarray, L: int, by_memory: bool, safe: tuple[float, float]) -> None:
    """Host pieces ([L, 4]): each onto the host with room whose fullest (or slowest) rank stays lowest."""
    H = load.shape[0] // L
    for _, t, k in host:
        if t in failed:
            continue
        piece = options[t].pieces[k]
        new = load.reshape(H, L, 4) + piece  # [H, L, 4]: the piece on each host
        fits = (new[:, :, :2] <= caps + _EPS).all(axis=(1, 2))
        fits[[h for h in where[t] if h >= 0]] = False  # a grid's column blocks go to distinct hosts
        if not fits.any():
            failed.add(t)
            continue
        if by_memory:
            key = (new[:, :, :2] / np.array(safe)).max(axis=(1, 2))
        else:
            key = (new[:, :, COMPUTE] + new[:, :, COMM]).max(axis=1)
        h = int(np.argmin(np.where(fits, key, np.inf)))
        load[h * L : (h + 1) * L] += piece
        where[t][k] = h


def _place_on_ranks(options: Sequence[ShardingOption], rank: list[_Piece], load: np.ndarray, where: list[list[int]],
                    failed: set[int], caps: np.ndarray, by_memory: bool, safe: tuple[float, float]) -> np.ndarray:
    """Rank pieces: each onto the emptiest (or fastest) rank with room; the [W, 4] load they add."""
    # one slot each, so plain floats; a heap of (key, rank) finds the emptiest rank
    safe_h, safe_d = safe
    cap_h, cap_d = float(caps[HBM]) + _EPS, float(caps[DDR]) + _EPS
    used_h, used_d = load[:, HBM].tolist(), load[:, DDR].tolist()
    ms = (load[:, COMPUTE] + load[:, COMM]).tolist()
    added = np.zeros_like(load)

    def rank_key(r: int) -> float:
        return max(used_h[r] / safe_h, used_d[r] / safe_d) if by_memory else ms[r]

    heap = [(rank_key(r), r) for r in range(load.shape[0])]
    heapq.heapify(heap)
    for _, t, k in rank:
        if t in failed:
            continue
        ph, pd = options[t].piece_bytes[k]
        used = where[t]  # -1 for blocks not placed yet
        popped, chosen, spare = [], None, None
        while heap:
            entry = heapq.heappop(heap)
            popped.append(entry)
            r = entry[1]
            if used_h[r] + ph <= cap_h and used_d[r] + pd <= cap_d:
                if r not in used:
                    chosen = entry
                    break
                if spare is None:
                    spare = entry  # a column block may share a rank when no other has room
        chosen = chosen or spare
        for entry in popped:
            if entry is not chosen:
                heapq.heappush(heap, entry)
        if chosen is None:
            failed.add(t)
            continue
        r = chosen[1]
        used_h[r] += ph
        used_d[r] += pd
        ms[r] += options[t].piece_ms[k]
        added[r] += options[t].pieces[k][0]
        used[k] = r
        heapq.heappush(heap, (rank_key(r), r))
    return added
