"""Placing one proposal's pieces onto ranks under memory limits, slowest rank first (a heap).

Fixed pieces stay where they are, host pieces go to the host whose slowest rank stays fastest,
rank pieces go slowest-first onto the least-loaded rank with room. See plan.py for the whole flow.
"""

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


def _partition(
    options: Sequence[ShardingOption], caps: np.ndarray, W: int, L: int, by_memory: bool
) -> _Placement:
    """Place one option per table. `by_memory`: biggest pieces first onto the emptiest rank."""
    load = np.zeros((W, 4))
    where: list[list[int]] = [[-1] * len(o.pieces) for o in options]
    failed: set[int] = set()
    safe_h, safe_d = (float(c) if c > 0 else 1.0 for c in caps)  # CPU ranks have no HBM
    cap_h, cap_d = float(caps[HBM]) + _EPS, float(caps[DDR]) + _EPS

    fixed, host, rank = [], [], []
    lists = {"fixed": fixed, "host": host, "rank": rank}
    for t, o in enumerate(options):
        out = lists[o.kind]
        for k in range(len(o.pieces)):
            if by_memory:
                h, d = o.piece_bytes[k]
                out.append((-max(h / safe_h, d / safe_d), t, k))
            else:
                out.append((-o.piece_ms[k], t, k))
    fixed.sort()
    host.sort()
    rank.sort()

    if fixed:
        together = np.sum([options[t].pieces[0] for _, t, _ in fixed], axis=0)
        if (together[:, :2] <= caps + _EPS).all():  # the common case: no need to go one by one
            load += together
            fixed = []
    for _, t, _ in fixed:
        piece = options[t].pieces[0]
        new = load[:, :2] + piece[:, :2]
        if (new <= caps + _EPS).all():
            load += piece
        else:
            failed.add(t)

    H = W // L
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
            key = (new[:, :, :2] / np.array([safe_h, safe_d])).max(axis=(1, 2))
        else:
            key = (new[:, :, COMPUTE] + new[:, :, COMM]).max(axis=1)
        h = int(np.argmin(np.where(fits, key, np.inf)))
        load[h * L : (h + 1) * L] += piece
        where[t][k] = h

    # rank pieces: one slot each, so plain floats; a heap of (key, rank) finds the emptiest rank
    used_h, used_d = load[:, HBM].tolist(), load[:, DDR].tolist()
    ms = (load[:, COMPUTE] + load[:, COMM]).tolist()
    added = np.zeros((W, 4))

    def rank_key(r: int) -> float:
        return max(used_h[r] / safe_h, used_d[r] / safe_d) if by_memory else ms[r]

    heap = [(rank_key(r), r) for r in range(W)]
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
    return _Placement(load + added, where, sorted(failed))
