"""Proposers: which option each table takes (greedy with memory relief and balancing, uniform, grid search around the
best), each proposal scored by its slowest rank. See plan.py."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from lightning_rec.planner.estimate import (
    COMM,
    COMPUTE,
    DDR,
    HBM,
    ShardingOption,
)
from lightning_rec.planner.partition import _EPS, _partition, _Placement
from lightning_rec.planner.topology import Topology
from lightning_rec.types import (
    ShardingType,
)


class _Search:
    """Proposals over per-table option lists, each partitioned once (results cached)."""

    def __init__(self, options: list[list[ShardingOption]], topology: Topology, caps: np.ndarray, max_proposals: int):
        self.options = options
        self.W, self.L = topology.world_size, topology.local_world_size
        self.caps = caps
        self.max_proposals = max_proposals
        self.cache: dict[tuple[int, ...], _Placement] = {}
        self.best: tuple[tuple, tuple[int, ...], str] | None = None  # (rank key, choice, proposer)
        self.last_failure: tuple[tuple[int, ...], _Placement] | None = None
        self.greedy_failed = False

    @property
    def exhausted(self) -> bool:
        return len(self.cache) >= self.max_proposals

    def evaluate(self, choice: Sequence[int], proposer: str) -> _Placement:
        key = tuple(choice)
        if key in self.cache:
            return self.cache[key]
        chosen = [opts[j] for opts, j in zip(self.options, key)]
        p = _partition(chosen, self.caps, self.W, self.L, by_memory=False)
        if not p.ok:
            by_mem = _partition(chosen, self.caps, self.W, self.L, by_memory=True)
            if by_mem.ok or len(by_mem.failed) < len(p.failed):
                p = by_mem
        self.cache[key] = p
        if p.ok:
            peak = float((p.load[:, :2] / np.where(self.caps > 0, self.caps, 1.0)).max())
            rank = (round(p.score, 9), round(peak, 9))
            if self.best is None or rank < self.best[0]:
                self.best = (rank, key, proposer)
        elif not self.greedy_failed:
            self.last_failure = (key, p)
        return p

    # --- greedy -------------------------------------------------------------------------------
    def greedy(self) -> None:
        choice = [0] * len(self.options)  # options are sorted cheapest total work first
        p = self.evaluate(choice, "greedy")
        while not p.ok and not self.exhausted:
            if not self._relieve_memory(choice, p):
                break
            p = self.evaluate(choice, "greedy")
        if not p.ok:  # the error reports this one: memory already relieved as far as it goes
            self.last_failure = (tuple(choice), p)
            self.greedy_failed = True
        else:
            self._balance(choice, p, "greedy")

    def _relieve_memory(self, choice: list[int], p: _Placement) -> bool:
        chosen = [opts[j] for opts, j in zip(self.options, choice)]
        demand = np.sum([o.totals[:2] for o in chosen], axis=0)
        capacity = self.caps * self.W
        deficit = demand - capacity
        for m in (HBM, DDR):
            if deficit[m] > 0 and self._move_totals(
                choice, chosen, m, deficit[m], capacity[1 - m] - demand[1 - m]
            ):
                return True
        # enough memory in all, but pieces too big to pack: split the tables that found no room
        safe = np.where(self.caps > 0, self.caps, 1.0)
        frac = lambda o: float((o.max_piece_bytes / safe).max())
        order = p.failed + sorted(set(range(len(chosen))) - set(p.failed), key=lambda t: (-frac(chosen[t]), t))
        for t in order:
            cur, before = chosen[t], choice[t]
            alts = [j for j, o in enumerate(self.options[t]) if frac(o) < frac(cur) - _EPS]
            if alts:
                choice[t] = min(alts, key=lambda j: (self.options[t][j].total_ms, j))
                if tuple(choice) not in self.cache:
                    return True
                choice[t] = before
        return False

    def _move_totals(self, choice, chosen, m: int, deficit: float, slack: float) -> bool:
        """Move the biggest holders of memory kind `m` to options that hold less, until it fits."""
        moved = False
        for t in sorted(range(len(chosen)), key=lambda t: (-chosen[t].totals[m], t)):
            cur = chosen[t]
            alts = [
                j
                for j, o in enumerate(self.options[t])
                if o.totals[m] < cur.totals[m] - _EPS and o.totals[1 - m] - cur.totals[1 - m] <= slack
            ]
            if not alts:
                continue
            j = min(alts, key=lambda j: (self.options[t][j].total_ms, j))
            new = self.options[t][j]
            choice[t] = j
            deficit -= cur.totals[m] - new.totals[m]
            slack -= new.totals[1 - m] - cur.totals[1 - m]
            moved = True
            if deficit <= 0:
                break
        return moved and tuple(choice) not in self.cache

    def _balance(self, choice: list[int], p: _Placement, proposer: str) -> None:
        """Move the slowest rank's biggest contributor to a finer split while that helps."""
        while not self.exhausted:
            slow = int(np.argmax(p.load[:, COMPUTE] + p.load[:, COMM]))
            contrib = self._contributions(choice, p, slow)
            improved = False
            for ms, t in contrib:
                alts = [j for j, o in enumerate(self.options[t]) if o.max_piece_ms < ms - _EPS and j != choice[t]]
                for j in sorted(alts, key=lambda j: (self.options[t][j].total_ms, j))[:2]:
                    trial = list(choice)
                    trial[t] = j
                    q = self.evaluate(trial, proposer)
                    if q.ok and q.score < p.score - _EPS:
                        choice[:], p, improved = trial, q, True
                        break
                    if self.exhausted:
                        return
                if improved:
                    break
            if not improved:
                return

    def _contributions(self, choice, p: _Placement, r: int) -> list[tuple[float, int]]:
        """(ms, table) of every table with a piece on rank r, biggest first."""
        out = []
        for t, j in enumerate(choice):
            o = self.options[t][j]
            ms = 0.0
            if o.kind == "fixed":
                ms = o.pieces[0][r, COMPUTE] + o.pieces[0][r, COMM]
            elif o.kind == "rank":
                ms = sum(pc[0, COMPUTE] + pc[0, COMM] for pc, rr in zip(o.pieces, p.where[t]) if rr == r)
            else:
                for pc, h in zip(o.pieces, p.where[t]):
                    if h == r // self.L:
                        ms += pc[r % self.L, COMPUTE] + pc[r % self.L, COMM]
            if ms > 0:
                out.append((float(ms), t))
        return sorted(out, key=lambda x: (-x[0], x[1]))

    # --- uniform and grid ---------------------------------------------------------------------
    def uniform(self) -> None:
        for st in ShardingType:
            if self.exhausted:
                return
            choice = []
            for opts in self.options:
                js = [j for j, o in enumerate(opts) if o.sharding_type == st]
                choice.append(js[0] if js else 0)
            self.evaluate(choice, f"uniform {st}")

    def grid(self, limit: int, per_table: int = 3) -> None:
        if self.best is None or limit < 2:
            return
        base = list(self.best[1])
        heavy = sorted(range(len(base)), key=lambda t: (-self.options[t][base[t]].total_ms, t))
        axes, size = [], 1
        for t in heavy:
            choices = [base[t]]
            seen = {(self.options[t][base[t]].sharding_type, self.options[t][base[t]].kernel)}
            for j in sorted(range(len(self.options[t])), key=lambda j: (self.options[t][j].total_ms, j)):
                o = self.options[t][j]
                if len(choices) < per_table and (o.sharding_type, o.kernel) not in seen:
                    choices.append(j)
                    seen.add((o.sharding_type, o.kernel))
            if len(choices) < 2:
                continue
            if size * len(choices) > limit:
                break
            axes.append((t, choices))
            size *= len(choices)
        for combo in itertools.product(*(c for _, c in axes)):
            if self.exhausted:
                return
            trial = list(base)
            for (t, _), j in zip(axes, combo):
                trial[t] = j
            self.evaluate(trial, "grid search")
