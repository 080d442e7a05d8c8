"""Zero-collision remapping of raw int64 ids to table rows: a sorted id map kept as buffers, eviction in batches.

Rows `0..zch_size-2` are managed: each holds at most one raw id. Row `zch_size-1` is the shared "unknown" row: ids
not (yet) admitted read it. A new id takes a free row at the step it is seen (once its count reaches
`min_count_to_admit`); when the table is full it waits as a candidate, and every `eviction_interval` training
steps one batched run lets the eviction policy swap the lowest-scored resident ids for higher-scored candidates.
Rows handed to a new id are listed in `take_reused_rows()` so that the owner re-initialises their weights and
optimizer state before the new id trains.

`remap_tables` runs one step of several tables: on CPU one C++ call (csrc/mch_cpu.cpp) for all of them, the
eviction run of the due ones in one more; each table's torch methods below are the other devices' path and the
reference the C++ pass is tested against.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_rec._native import native_op

_FREE = -1  # a row without id (ids are non-negative)
_REPLACED = [0]  # how often any module's buffers were replaced (moved, loaded with assign=True)
_NO_ID = torch.iinfo(torch.int64).max  # sorts after every id: the free rows' key in the sorted map


class MCHEvictionPolicy:
    """Scores resident and candidate ids at an eviction run: the lowest-scored residents leave first."""

    name = "base"

    def scores(self, counts: Tensor, last_seen: Tensor, step: int) -> Tensor:
        raise NotImplementedError


class LFU_EvictionPolicy(MCHEvictionPolicy):  # noqa: N801 (TorchRec's name)
    """Least frequently used: the score is the id's count of lookups."""

    name = "lfu"

    def scores(self, counts: Tensor, last_seen: Tensor, step: int) -> Tensor:
        return counts.double()


class LRU_EvictionPolicy(MCHEvictionPolicy):  # noqa: N801 (TorchRec's name)
    """Least recently used: the score is the step the id was last seen (ties: the more frequent stays)."""

    name = "lru"

    def scores(self, counts: Tensor, last_seen: Tensor, step: int) -> Tensor:
        return last_seen.double() + counts.double() / (counts.max().double() + 1 if counts.numel() else 1)


class DistanceLFU_EvictionPolicy(MCHEvictionPolicy):  # noqa: N801 (TorchRec's name)
    """TorchRec's distance-LFU: count / (steps since last seen + 1) ** decay_exponent."""

    name = "distance_lfu"

    def __init__(self, decay_exponent: float = 1.0) -> None:
        if decay_exponent < 0:
            raise ValueError(f"DistanceLFU_EvictionPolicy(decay_exponent={decay_exponent}): use a value >= 0")
        self.decay_exponent = decay_exponent

    def scores(self, counts: Tensor, last_seen: Tensor, step: int) -> Tensor:
        distance = (step - last_seen).clamp(min=0).double() + 1
        return counts.double() / distance.pow(self.decay_exponent)


_POLICIES = {"lfu": LFU_EvictionPolicy, "lru": LRU_EvictionPolicy, "distance_lfu": DistanceLFU_EvictionPolicy}


def as_policy(policy: MCHEvictionPolicy | str) -> MCHEvictionPolicy:
    if isinstance(policy, MCHEvictionPolicy):
        return policy
    if policy not in _POLICIES:
        raise ValueError(f"eviction_policy={policy!r}: use one of {sorted(_POLICIES)} or an MCHEvictionPolicy "
                         f"(LFU_EvictionPolicy(), LRU_EvictionPolicy(), DistanceLFU_EvictionPolicy())")
    return _POLICIES[policy]()


def owner_of(ids: Tensor, owners: int | Tensor) -> Tensor:
    """The owner (0..owners-1) of each raw id under sharding: its row shard, from the id's value alone (a
    multiplicative hash, then modulo), so that an id routes the same way at every step and on every rank."""
    if isinstance(owners, int) and owners == 1:
        return torch.zeros_like(ids)
    op = native_op("mch_owner_of") if ids.device.type == "cpu" and ids.dtype == torch.int64 else None
    if op is not None:  # one pass (csrc/mch_cpu.cpp), the same bits as the torch ops below
        return op(ids.contiguous(), torch.as_tensor(owners, dtype=torch.int64).contiguous())
    # two multiply-xorshift rounds (int64 products wrap): one round's bits above 29 sent ids 1..45 all to owner 1
    mixed = ids * _MIX
    mixed = (mixed ^ ((mixed >> 32) & 0xFFFFFFFF)) * _MIX2
    return ((mixed >> 33) & (2**30 - 1)) % owners


_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 (the golden ratio's), as an int64
_MIX2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 (splitmix64's), as an int64


class _HostCounters:
    """What a step counts on the host, in a plain object: a Module attribute write costs microseconds per table."""

    __slots__ = ("step", "lookups")

    def __init__(self) -> None:
        self.step = 0  # the _step buffer of a device mirrored, read without a device read (on CPU: the buffer's)
        # [lookups of reused rows, lookups] since the last metrics(), summed where the ids are, and the rows the last
        # eviction run handed over: no host read per step; one tensor for life on its device (zeroed in place), so
        # that a TableGroup's state stays valid
        self.lookups: Tensor | None = None

    def counter(self, device: torch.device) -> Tensor:
        if self.lookups is None or self.lookups.device != device:
            self.lookups = torch.zeros(3, dtype=torch.int64, device=device)
        return self.lookups

    def take_lookups(self) -> tuple[int, int]:
        """(lookups of reused rows, lookups) since the last call (one host read)."""
        if self.lookups is None:
            return 0, 0
        reused, lookups, _ = self.lookups.tolist()
        self.lookups[:2].zero_()
        return reused, lookups

    @property
    def last_evictions(self) -> int:
        return 0 if self.lookups is None else int(self.lookups[2])


def _merge(ids: Tensor, counts: Tensor, last: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Same ids summed (counts) and maxed (last seen), sorted by id."""
    uniq, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    c = torch.zeros_like(uniq).scatter_add_(0, inverse, counts)
    s = torch.full_like(uniq, -1).scatter_reduce_(0, inverse, last, "amax")
    return uniq, c, s


class MCHManagedCollisionModule(nn.Module):
    """One table's remapper: raw non-negative int64 ids -> rows `0..zch_size-1` (TorchRec's name and arguments).

    Args:
        zch_size: rows it hands out, the last one the shared "unknown" row (at most the table's num_embeddings).
        device: where the id map lives.
        eviction_policy: an MCHEvictionPolicy or "lfu" | "lru" | "distance_lfu".
        eviction_interval: training steps between two batched eviction runs (>= 1).
        min_count_to_admit: lookups a new id needs before it takes a row (1: at once).
        churn_warning: warn when an eviction run replaces more than this share of the managed rows.
        max_candidates: new ids remembered between two runs (the most frequent kept; None: zch_size)."""

    def __init__(self, zch_size: int, device: torch.device | str | None = None,
                 eviction_policy: MCHEvictionPolicy | str = "lfu", eviction_interval: int = 1,
                 min_count_to_admit: int = 1, churn_warning: float = 0.5, name: str | None = None,
                 max_candidates: int | None = None) -> None:
        super().__init__()
        if not isinstance(zch_size, int) or zch_size < 2:
            raise ValueError(f"MCHManagedCollisionModule(zch_size={zch_size!r}): zch_size counts the rows it hands "
                             f"out, the last one shared by unknown ids: use an int >= 2 (at most the table's rows)")
        if not isinstance(eviction_interval, int) or eviction_interval < 1:
            raise ValueError(f"MCHManagedCollisionModule(eviction_interval={eviction_interval!r}): the eviction "
                             f"runs every eviction_interval training steps: use an int >= 1")
        if min_count_to_admit < 1:
            raise ValueError(f"MCHManagedCollisionModule(min_count_to_admit={min_count_to_admit}): use an int >= 1")
        self._zch_size = zch_size
        self._eviction_interval = eviction_interval
        self._eviction_policy = as_policy(eviction_policy)
        self._min_count = int(min_count_to_admit)
        self._churn_warning = churn_warning
        self._name = name
        device = torch.device(device) if device is not None else None
        m = zch_size - 1
        i64 = dict(dtype=torch.int64, device=device)
        self.register_buffer("_row_ids", torch.full((m,), _FREE, **i64))  # row -> raw id
        self.register_buffer("_counts", torch.zeros(m, **i64))
        self.register_buffer("_last_seen", torch.full((m,), -1, **i64))
        self.register_buffer("_reused", torch.zeros(m, dtype=torch.bool, device=device))  # evicted, then reused
        self.register_buffer("_sorted_ids", torch.full((m,), _NO_ID, **i64))
        self.register_buffer("_sorted_rows", torch.zeros(m, **i64))
        c = max(1, max_candidates if max_candidates is not None else zch_size)
        # ids waiting for a row, sorted, _NO_ID after the last: fixed sizes, so a checkpoint loads in place
        self.register_buffer("_cand_ids", torch.full((c,), _NO_ID, **i64))
        self.register_buffer("_cand_counts", torch.zeros(c, **i64))
        self.register_buffer("_cand_last", torch.zeros(c, **i64))
        self.register_buffer("_step", torch.zeros((), **i64))
        self.register_buffer("_evictions_total", torch.zeros((), **i64))
        self._pending_rows: list[Tensor] = []  # rows handed to a new id since the owner last re-initialised
        self._host = _HostCounters()

    # -- TorchRec's accessors --------------------------------------------------------------------------------------
    def output_size(self) -> int:
        return self._zch_size

    @property
    def unknown_row(self) -> int:
        return self._zch_size - 1

    @property
    def eviction_interval(self) -> int:
        return self._eviction_interval

    def open_slots(self) -> Tensor:
        return (self._row_ids == _FREE).sum()

    def id_map(self) -> tuple[Tensor, Tensor]:
        """(raw ids, their rows) of the admitted ids, sorted by id."""
        n = int((self._sorted_ids != _NO_ID).sum())
        return self._sorted_ids[:n].clone(), self._sorted_rows[:n].clone()

    # -- the hot path ----------------------------------------------------------------------------------------------
    def forward(self, ids: Tensor) -> Tensor:
        """Raw ids -> rows. Training: profiles the ids first (admission, eviction runs), so new ids read their row."""
        self.check_ids(ids)
        out = torch.empty_like(ids)
        spans = [[(0, ids.numel())]]
        remap_tables([self], ids, out, spans, (ids, None, spans) if self.training else None, self.training)
        return out

    def _now(self) -> int:
        """The step: the buffer on CPU (the C++ pass advances it there), else the host mirror (no device read)."""
        step = self._buffers["_step"]
        return int(step) if step.device.type == "cpu" else self._host.step

    def check_ids(self, ids: Tensor) -> None:
        if ids.numel() and bool(((ids < 0) | (ids == _NO_ID)).any()):
            bad = ids[(ids < 0) | (ids == _NO_ID)][:3].tolist()
            raise ValueError(f"managed-collision table{self._named()} got negative ids {bad}: it maps raw "
                             f"non-negative int64 ids below 2**63 - 1 (its empty slot); pass ids unfolded and >= 0 "
                             f"(e.g. `ids & (2**62 - 1)`)")

    def remap(self, ids: Tensor) -> Tensor:
        """Rows of the ids (the unknown row for ids without one); counts the lookups of reused rows."""
        if not ids.numel():
            return ids.clone()
        pos = torch.searchsorted(self._sorted_ids, ids).clamp_(max=self._sorted_ids.numel() - 1)
        found = self._sorted_ids[pos] == ids
        rows = torch.where(found, self._sorted_rows[pos], torch.full_like(ids, self.unknown_row))
        if self.training:
            reused = found & self._reused[rows.clamp(max=self._reused.numel() - 1)]
            counter = self._host.counter(ids.device)
            counter[0] += reused.sum()
            counter[1] += ids.numel()
        return rows

    def profile(self, ids: Tensor) -> None:
        """Counts the batch's ids, admits new ones to free rows, and runs the eviction every eviction_interval."""
        self.profile_counts(*torch.unique(ids, return_counts=True))

    @torch.no_grad()
    def profile_counts(self, uniq: Tensor, counts: Tensor) -> None:
        """profile() of a batch given as its distinct ids (sorted) and their counts (all ranks' under sharding)."""
        TableGroup([self]).advance()
        self._count_and_admit(uniq, counts)
        if self._now() % self._eviction_interval == 0:
            self._evict(self._now())

    def _count_and_admit(self, uniq: Tensor, counts: Tensor) -> None:
        """The torch path of one table's profile (csrc/mch_cpu.cpp does the same for all tables at once)."""
        step = self._now()
        if uniq.numel():
            pos = torch.searchsorted(self._sorted_ids, uniq).clamp_(max=self._sorted_ids.numel() - 1)
            found = self._sorted_ids[pos] == uniq
            rows = self._sorted_rows[pos[found]]
            self._counts.index_add_(0, rows, counts[found])
            self._last_seen[rows] = step
            new, new_counts = uniq[~found], counts[~found]
            if new.numel():
                n = self._num_candidates()
                self._set_candidates(*_merge(torch.cat([self._cand_ids[:n], new]),
                                             torch.cat([self._cand_counts[:n], new_counts]),
                                             torch.cat([self._cand_last[:n], torch.full_like(new, step)])))
                self._admit_to_free_rows()

    def _num_candidates(self) -> int:
        return int((self._cand_ids != _NO_ID).sum())

    def _set_candidates(self, ids: Tensor, counts: Tensor, last: Tensor) -> None:
        """Writes candidates (sorted by id) into the fixed buffers; past capacity, the most frequent stay."""
        cap = self._cand_ids.numel()
        if ids.numel() > cap:  # by count, then the most recent, then the smaller id: the same choice everywhere
            order = torch.argsort(last, descending=True, stable=True)
            order = order[torch.argsort(counts[order], descending=True, stable=True)][:cap]
            keep = torch.sort(order).values
            ids, counts, last = ids[keep], counts[keep], last[keep]
        n = ids.numel()
        self._cand_ids[:n], self._cand_counts[:n], self._cand_last[:n] = ids, counts, last
        self._cand_ids[n:], self._cand_counts[n:], self._cand_last[n:] = _NO_ID, 0, 0

    def _admit_to_free_rows(self) -> None:
        free = (self._row_ids == _FREE).nonzero().flatten()
        ready = ((self._cand_counts >= self._min_count) & (self._cand_ids != _NO_ID)).nonzero().flatten()
        if not free.numel() or not ready.numel():
            return
        ready = ready[torch.argsort(self._cand_counts[ready], descending=True, stable=True)][: free.numel()]
        self._place(free[: ready.numel()], ready)

    def _place(self, rows: Tensor, cand: Tensor) -> None:
        """Candidates `cand` (indices into the candidate buffers) take `rows`; the sorted map is merged."""
        self._merge_map(self._row_ids[rows], self._cand_ids[cand], rows)
        self._row_ids[rows] = self._cand_ids[cand]
        self._counts[rows] = self._cand_counts[cand]
        self._last_seen[rows] = self._cand_last[cand]
        keep = self._cand_ids != _NO_ID
        keep[cand] = False
        self._set_candidates(self._cand_ids[keep], self._cand_counts[keep], self._cand_last[keep])
        self._pending_rows.append(rows.clone())

    def _merge_map(self, old_ids: Tensor, new_ids: Tensor, rows: Tensor) -> None:
        """Drops `old_ids` (_FREE: none) from the sorted map and merges `new_ids` -> `rows` in: O(map) copies, no
        sort of the map (a step admitting a few ids into a table of millions stays cheap)."""
        keep = self._sorted_ids != _NO_ID
        old = old_ids[old_ids != _FREE]
        if old.numel():
            keep[torch.searchsorted(self._sorted_ids, old)] = False
        kept_ids, kept_rows = self._sorted_ids[keep], self._sorted_rows[keep]
        new_ids, order = torch.sort(new_ids)
        new_rows = rows[order]
        at_new = torch.searchsorted(kept_ids, new_ids) + torch.arange(new_ids.numel(), device=new_ids.device)
        at_kept = torch.arange(kept_ids.numel(), device=kept_ids.device) + torch.searchsorted(new_ids, kept_ids)
        n = kept_ids.numel() + new_ids.numel()
        self._sorted_ids[n:], self._sorted_rows[n:] = _NO_ID, 0
        self._sorted_ids[at_kept], self._sorted_rows[at_kept] = kept_ids, kept_rows
        self._sorted_ids[at_new], self._sorted_rows[at_new] = new_ids, new_rows

    @torch.no_grad()
    def _evict(self, step: int) -> None:
        """One batched run: candidates outscoring the lowest residents take their rows; candidates are cleared."""
        ready = ((self._cand_counts >= self._min_count) & (self._cand_ids != _NO_ID)).nonzero().flatten()
        evicted = 0
        if ready.numel() and not bool((self._row_ids == _FREE).any()):
            policy = self._eviction_policy
            resident = policy.scores(self._counts, self._last_seen, step)
            incoming = policy.scores(self._cand_counts[ready], self._cand_last[ready], step)
            k = min(ready.numel(), resident.numel())
            # stable sorts, not topk: ties fall the same way on every rank and in every run
            low_rows = torch.argsort(resident, stable=True)[:k]  # weakest residents, weakest first
            high_idx = torch.argsort(incoming, descending=True, stable=True)[:k]  # strongest candidates first
            wins = incoming[high_idx] > resident[low_rows]  # residents keep ties
            evicted = int(wins.sum())
            if evicted:
                rows = low_rows[wins]
                self._reused[rows] = True
                self._place(rows, ready[high_idx[wins]])
        self._set_candidates(*(t[:0] for t in (self._cand_ids, self._cand_counts, self._cand_last)))
        self._host.counter(self._step.device)[2] = evicted
        self._evictions_total += evicted
        self._warn_churn(evicted)

    def _eviction_scores(self) -> tuple[Tensor, Tensor]:
        """(residents' scores, ready candidates' scores) for the C++ eviction run of a policy it does not know."""
        ready = ((self._cand_counts >= self._min_count) & (self._cand_ids != _NO_ID)).nonzero().flatten()
        policy, step = self._eviction_policy, self._now()
        return (policy.scores(self._counts, self._last_seen, step).double().contiguous(),
                policy.scores(self._cand_counts[ready], self._cand_last[ready], step).double().contiguous())

    def _warn_churn(self, evicted: int) -> None:
        if evicted > self._churn_warning * self._row_ids.numel():
            warnings.warn(f"managed-collision table{self._named()}: {evicted} of {self._row_ids.numel()} rows "
                          f"({evicted / self._row_ids.numel():.0%}) evicted at step {self._now()}: the table churns "
                          f"(ids rarely come back); raise zch_size, eviction_interval or min_count_to_admit",
                          stacklevel=3)

    # -- the owner's side ------------------------------------------------------------------------------------------
    def take_reused_rows(self) -> Tensor | None:
        """Rows handed to a new id since the last call (to re-initialise), or None."""
        if not self._pending_rows:
            return None
        rows = torch.cat(self._pending_rows).unique()
        self._pending_rows.clear()
        return rows

    def metrics(self) -> dict[str, float]:
        """Fill ratio, evictions at the last run, share of lookups since the last call that read a reused row."""
        reused, lookups = self._host.take_lookups()
        return {"fill_ratio": float((self._row_ids != _FREE).sum()) / self._row_ids.numel(),
                "evictions_per_interval": float(self._host.last_evictions),
                "reused_row_lookup_share": reused / lookups if lookups else 0.0}

    def _named(self) -> str:
        return f" '{self._name}'" if self._name else ""

    # -- a map written by position (a checkpoint of any layout, a sharded owner's hand-over) ---------------------
    @torch.no_grad()
    def weights_written(self) -> None:
        """The buffers were written in place (a DCP load): the sorted map and the candidates are rebuilt from the
        rows' ids, so a checkpoint of any layout (a sharded one's pieces side by side) loads."""
        self._host.step = int(self._step)
        occupied = (self._row_ids != _FREE).nonzero().flatten()
        ids, order = torch.sort(self._row_ids[occupied])
        n = ids.numel()
        self._sorted_ids[:n], self._sorted_rows[:n] = ids, occupied[order]
        self._sorted_ids[n:], self._sorted_rows[n:] = _NO_ID, 0
        waiting = self._cand_ids != _NO_ID
        self._set_candidates(*_merge(self._cand_ids[waiting], self._cand_counts[waiting], self._cand_last[waiting]))

    def entries(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(rows, ids, counts, last seen, reused) of the rows holding an id."""
        rows = (self._row_ids != _FREE).nonzero().flatten()
        return rows, self._row_ids[rows], self._counts[rows], self._last_seen[rows], self._reused[rows]

    def candidates(self) -> tuple[Tensor, Tensor, Tensor]:
        n = self._num_candidates()
        return self._cand_ids[:n], self._cand_counts[:n], self._cand_last[:n]

    @torch.no_grad()
    def release(self, rows: Tensor) -> None:
        """The ids at `rows` leave (their rows become free), counters cleared."""
        self._row_ids[rows], self._counts[rows], self._last_seen[rows], self._reused[rows] = _FREE, 0, -1, False
        self.weights_written()

    @torch.no_grad()
    def adopt(self, ids: Tensor, counts: Tensor, last: Tensor, reused: Tensor) -> tuple[Tensor, Tensor]:
        """Ids from another owner take free rows, the most counted first: (their indices into `ids`, their rows).
        Ids beyond the free rows are left out (the caller says so)."""
        free = (self._row_ids == _FREE).nonzero().flatten()
        order = torch.argsort(ids, stable=True)
        order = order[torch.argsort(counts[order], descending=True, stable=True)][: free.numel()]
        rows = free[: order.numel()]
        self._row_ids[rows], self._counts[rows] = ids[order], counts[order]
        self._last_seen[rows], self._reused[rows] = last[order], reused[order]
        self.weights_written()
        return order, rows

    @torch.no_grad()
    def set_candidates(self, ids: Tensor, counts: Tensor, last: Tensor) -> None:
        """The candidates replaced by these (merged by id; past capacity the most frequent stay)."""
        self._set_candidates(*_merge(ids, counts, last))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        saved = state_dict.get(prefix + "_row_ids")
        if saved is not None and saved.shape != self._row_ids.shape:
            raise ValueError(f"managed-collision table{self._named()}: the checkpoint's id map has "
                             f"{saved.numel() + 1} rows (zch_size), this module {self._zch_size}: build it with "
                             f"zch_size={saved.numel() + 1} to load it")
        _REPLACED[0] += 1  # assign=True replaces the buffers
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._pending_rows = []
        self.weights_written()

    def _apply(self, fn, recurse: bool = True):
        _REPLACED[0] += 1  # a move replaces the buffers: a TableGroup gathers them again
        out = super()._apply(fn, recurse)
        if not self._step.is_meta:  # the mirror a device reads (the C++ pass advanced the buffer alone)
            self._host.step = int(self._step)
        return out


# -- every table of a step in one pass -------------------------------------------------------------------------------
Spans = Sequence[Sequence[tuple[int, int]]]  # per table: the (begin, end) slices of a flat id tensor that it reads
_STATE = ("_sorted_ids", "_sorted_rows", "_row_ids", "_counts", "_last_seen", "_reused", "_cand_ids", "_cand_counts",
          "_cand_last", "_step", "_evictions_total")
_N_STATE = len(_STATE) + 1  # and the host counters
_POLICY_CODES = {LFU_EvictionPolicy: 1, LRU_EvictionPolicy: 2}  # csrc/mch_cpu.cpp scores these itself


def _policy_code(policy: MCHEvictionPolicy) -> int:
    """How mch_evict scores this policy: 1 lfu, 2 lru, 3 distance-lfu of decay 1; 0 its scores are given (a policy
    of the user's, or a decay whose pow could round otherwise than torch's)."""
    if type(policy) is DistanceLFU_EvictionPolicy:
        return 3 if policy.decay_exponent == 1.0 else 0
    return _POLICY_CODES.get(type(policy), 0)


class KeySpans:
    """Spans as keys of a jagged batch: table i reads the keys `keys[i]`, at the positions a step's lengths [K, B]
    give. Made once for a key layout: a step passes its lengths, the C++ pass reads the segments made here."""

    def __init__(self, keys: Sequence[Sequence[int]]) -> None:
        self.keys = [list(k) for k in keys]
        rows: list[list[int]] = []
        for i, ks in enumerate(self.keys):
            for k in ks:  # a table's adjacent keys: one segment
                if rows and rows[-1][0] == i and rows[-1][2] == k:
                    rows[-1][2] = k + 1
                else:
                    rows.append([i, k, k + 1])
        self.segments = torch.tensor(rows, dtype=torch.int64).view(-1, 3)

    def at(self, key_lengths: Tensor) -> list[list[tuple[int, int]]]:
        offsets = [0, *key_lengths.sum(1).cumsum(0).tolist()]
        return [[(offsets[k], offsets[k + 1]) for k in ks] for ks in self.keys]


class TableGroup:
    """Tables remapped together at every step (a collection's, or a rank's row-shard owners'): what stays the same
    from step to step, gathered once."""

    def __init__(self, modules: Sequence[MCHManagedCollisionModule]) -> None:
        self.modules = list(modules)
        self.policies = [_policy_code(m._eviction_policy) for m in self.modules]
        self.builtin = all(self.policies)  # every eviction run scored in C++: profile, evict and remap in one call
        self._flat: list[Tensor] = []
        self._seen = -1  # _REPLACED when the state was last gathered
        self._native: tuple[list[Tensor], object] | None = None

    def __getstate__(self) -> dict:  # a copied or pickled module gathers its own tensors again
        return {**self.__dict__, "_flat": [], "_seen": -1, "_native": None}

    def state(self) -> list[Tensor]:
        """Every table's tensors in csrc/mch_cpu.cpp's order; gathered again after its buffers were replaced (a
        move to another device, a load with assign=True), which replaces them all."""
        if self._seen == _REPLACED[0]:
            return self._flat
        flat = self._flat
        if not flat or any(flat[i * _N_STATE] is not m._buffers["_sorted_ids"] for i, m in enumerate(self.modules)):
            flat = self._flat = [t for m in self.modules for t in (
                *(m._buffers[n] for n in _STATE), m._host.counter(m._buffers["_step"].device))]
        self._seen = _REPLACED[0]
        return flat

    def native_state(self):
        """The state as the C++ pass holds it (torch.classes.lightning_rec.MchState), made again with the tensors."""
        flat = self.state()
        if self._native is None or self._native[0] is not flat:
            self._native = flat, torch.classes.lightning_rec.MchState(
                flat, [m._min_count for m in self.modules], [m._eviction_interval for m in self.modules],
                self.policies)
        return self._native[1]

    def advance(self) -> list[int]:
        """A training step of the torch path begins: every table's step counter (buffers and host mirrors). Returns
        the tables whose eviction run is due at this step."""
        torch._foreach_add_(self.state()[_STATE.index("_step")::_N_STATE], 1)
        due = []
        for i, m in enumerate(self.modules):
            m._host.step += 1
            if m._now() % m._eviction_interval == 0:
                due.append(i)
        return due


def _evict_tables(group: TableGroup, due: list[int]) -> int:
    """The eviction run of the group's tables at `due` (their step is due), one C++ call; the built-in policies are
    scored there, any other's scores are computed here. Returns the rows handed over."""
    if not due:
        return 0
    modules = [group.modules[i] for i in due]
    given = [m._eviction_scores() if group.policies[i] == 0 else (_EMPTY, _EMPTY) for i, m in zip(due, modules)]
    rows, per_table = _call(native_op("mch_evict"), group.native_state(), due, [g[0] for g in given],
                            [g[1] for g in given])
    _warn_churn(modules, per_table.tolist())
    return _hand_out(modules, rows, per_table)


def _warn_churn(modules: Sequence[MCHManagedCollisionModule], evicted: list[int]) -> None:
    """The eviction runs of `modules` handed `evicted` rows each (-1: no run): a table that churns warns."""
    for m, n in zip(modules, evicted):
        if n > 0:
            m._warn_churn(n)


_EMPTY = torch.empty(0, dtype=torch.float64)
_NO_SEGMENTS = torch.empty(0, 3, dtype=torch.int64)


def _segments(spans: Spans | KeySpans) -> Tensor:
    if isinstance(spans, KeySpans):
        return spans.segments
    flat = [x for i, s in enumerate(spans) for a, b in s for x in (i, a, b)]
    return torch.tensor(flat, dtype=torch.int64).view(-1, 3)


@torch.no_grad()
def remap_tables(group: TableGroup | Sequence[MCHManagedCollisionModule], values: Tensor, out: Tensor,
                 spans: Spans | KeySpans, profile: tuple[Tensor, Tensor | None, Spans | KeySpans] | None,
                 training: bool, native: bool = True, key_lengths: Tensor | None = None) -> int:
    """One step of several tables: `out` gets the rows of the ids at each table's `spans` of `values`; returns how
    many rows it handed to new ids (their modules list them in take_reused_rows).

    In training each table first profiles its ids: `profile` = (ids, their counts or None for one each, spans per
    table) (the remapped ids themselves, or distinct ids with every rank's counts). Eviction runs for the tables
    whose step it is, between profile and remap. Spans given as KeySpans are the keys of a jagged batch whose
    lengths are `key_lengths` [K, B]. On CPU with the C++ extension built, profile and remap of
    every table are one call (csrc/mch_cpu.cpp); else (or native=False) each table's torch path."""
    group = group if isinstance(group, TableGroup) else TableGroup(group)
    modules = group.modules
    if profile is not None and isinstance(spans, KeySpans) != isinstance(profile[2], KeySpans):  # one kind a pass
        spans, profile = _plain(spans, key_lengths), (*profile[:2], _plain(profile[2], key_lengths))
    cpu = values.device.type == "cpu" and values.dtype == torch.int64 and values.is_contiguous()
    op = native_op("mch_profile_remap") if native and cpu else None
    if op is None:
        due = group.advance() if training else []
        spans, profile = _plain(spans, key_lengths), profile and (*profile[:2], _plain(profile[2], key_lengths))
        _remap_tables_torch(modules, values, out, spans, profile, training, [modules[i] for i in due])
        return sum(r.numel() for m in modules for r in m._pending_rows)
    state, bounds = group.native_state(), key_lengths if isinstance(spans, KeySpans) else None
    remap_segments, none = _segments(spans), _NO_SEGMENTS
    if not training:
        _call(op, state, values[:0], None, none, values, out, remap_segments, bounds, False, False, False)
        return 0
    ids, counts, profile_spans = profile
    profile_segments = remap_segments if profile_spans is spans else _segments(profile_spans)
    if group.builtin:
        rows, per_table, evicted = _call(op, state, ids, counts, profile_segments, values, out, remap_segments,
                                         bounds, True, True, True)
        if evicted.numel():  # a step with eviction runs
            _warn_churn(modules, evicted.tolist())
        return _hand_out(modules, rows, per_table)
    rows, per_table, _ = _call(op, state, ids, counts, profile_segments, values, out, none, bounds, False, True, False)
    due = [i for i, m in enumerate(modules) if m._now() % m._eviction_interval == 0]
    handed = _hand_out(modules, rows, per_table) + _evict_tables(group, due)
    _call(op, state, values[:0], None, none, values, out, remap_segments, bounds, True, False, False)
    return handed


def _call(op, *args):
    # without: the state argument's __torch_function__ lookup throws and catches in C++, ~6 us a call
    with torch._C.DisableTorchFunctionSubclass():
        return op(*args)


def _plain(spans: Spans | KeySpans, key_lengths: Tensor | None) -> Spans:
    return spans.at(key_lengths) if isinstance(spans, KeySpans) else spans


def _hand_out(modules: Sequence[MCHManagedCollisionModule], rows: Tensor, per_table: Tensor) -> int:
    """Rows given to new ids (table after table), kept to be re-initialised by the owner; returns their number."""
    if not rows.numel():  # most steps once the tables are full: nothing to read per table
        return 0
    at = 0
    for m, n in zip(modules, per_table.tolist()):
        if n:
            m._pending_rows.append(rows[at:at + n])
        at += n
    return at


def _remap_tables_torch(modules, values, out, spans, profile, training, due) -> None:
    """remap_tables with each table's torch ops (any device; the reference the C++ pass is tested against)."""
    for i, m in enumerate(modules):
        if training and profile is not None:
            ids, counts, profile_spans = profile
            mine = _gather(ids, profile_spans[i])
            m._count_and_admit(*((mine, _gather(counts, profile_spans[i])) if counts is not None
                                 else torch.unique(mine, return_counts=True)))
        if m in due:
            m._evict(m._now())
        was, m.training = m.training, training
        for a, b in spans[i]:
            out[a:b] = m.remap(values[a:b])
        m.training = was


def _gather(values: Tensor, spans: Sequence[tuple[int, int]]) -> Tensor:
    pieces = [values[a:b] for a, b in spans] or [values[:0]]
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]
