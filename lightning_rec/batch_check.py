"""Checks a batch passes before any kernel reads it: offsets, ids in their tables, finite weights.

Shapes: F features, B samples, N ids.

Every KJT that reaches a table-batched kernel (ours or fbgemm's) is checked first, so a bad batch
is a ValueError naming the feature, the table and the fix, never a crash, a wrong row or a NaN row
written by the fused update:

    offsets  start at 0, never decrease, end at N            (a slice of a larger batch, not rebased)
    ids      in [0, rows of the feature's table)              (one table's size per feature, not per key name)
    weights  finite                                           (one NaN weight poisons every row it touches)

Where the check runs, and what it costs:

- **CPU batches**: one pass in C++ (`torch.ops.lightning_rec.check_batch`, multi-threaded over
  features), before the lookup, so a bad batch changes nothing. Without the extension, the same
  rules in vectorised torch ops.
- **GPU batches built on the host** (the usual data path: a CPU batch moved with `.to("cuda")`):
  the KJT keeps its host copy, which is checked on the host. No device sync, nothing updated.
- **GPU batches that never were on the host**: reading a flag back every step would stall the
  stream, so the check is lazy: fbgemm's own bounds check (BoundsCheckMode.WARNING) keeps the kernel
  safe (a bad id reads row 0) and counts bad ids on the device; the count travels to pinned host
  memory without waiting, and the next call raises once it has arrived, naming the feature and table
  of the batch that had them. That batch has trained (as row 0); build batches on the host for the
  strict check.

`validate_ids=False` on a collection turns the id and weight checks off (the kernels' own memory
safety stays: the native kernel checks offsets and ids in C++; fbgemm's bounds check on GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_rec.sparse import KeyedJaggedTensor

OK, BAD_START, DECREASING, BAD_END, BAD_ID, BAD_WEIGHT, BAD_COUNT = range(7)


def _native_check():
    """torch.ops.lightning_rec.check_batch when the C++ extension is built, else None."""
    try:
        from lightning_rec.native_embedding import native_kernel_available
    except ImportError:
        return None
    return torch.ops.lightning_rec.check_batch if native_kernel_available() else None


def find_problem(rows_F: Tensor, values_N: Tensor, offsets: Tensor, weights_N: Tensor | None) -> list[int]:
    """{code, position, value, feature, count} for a CPU batch; code OK (0) when the batch is fine."""
    op = _native_check()
    if op is not None:
        return op(rows_F, values_N, offsets, weights_N).tolist()
    return _find_problem_torch(rows_F, values_N, offsets, weights_N)


def _find_problem_torch(rows_F: Tensor, values_N: Tensor, offsets: Tensor, weights_N: Tensor | None) -> list[int]:
    """The same rules as the C++ op, in torch ops (the reference it is tested against)."""
    F, N, n_off = rows_F.numel(), values_N.numel(), offsets.numel()
    if n_off < 1 or F == 0 or (n_off - 1) % F:
        return [BAD_COUNT, 0, n_off, 0, 0]
    B = (n_off - 1) // F
    offsets = offsets.long()
    if int(offsets[0]) != 0:
        return [BAD_START, 0, int(offsets[0]), 0, 0]
    down = (offsets[1:] < offsets[:-1]).nonzero()
    if down.numel():
        j = int(down[0, 0])
        return [DECREASING, j, int(offsets[j + 1]), j // max(B, 1), 0]
    if int(offsets[-1]) != N:
        return [BAD_END, 0, int(offsets[-1]), 0, N]
    ids_per_feature = offsets[:: max(B, 1)].diff() if B else torch.zeros(F, dtype=torch.int64)
    read_F = rows_F >= 0  # -1: a feature no table reads
    limit_N = torch.repeat_interleave(torch.where(read_F, rows_F, torch.iinfo(torch.int64).max),
                                      ids_per_feature, output_size=N)
    feature_N = torch.repeat_interleave(torch.arange(F), ids_per_feature, output_size=N)
    bad_N = ((values_N < 0) & read_F[feature_N]) | (values_N >= limit_N)
    if bool(bad_N.any()):
        p = int(bad_N.nonzero()[0, 0])
        return [BAD_ID, p, int(values_N[p]), int(feature_N[p]), int(bad_N.sum())]
    if weights_N is not None and weights_N.numel() == N:
        bad_N = ~torch.isfinite(weights_N) & read_F[feature_N]
        if bool(bad_N.any()):
            p = int(bad_N.nonzero()[0, 0])
            return [BAD_WEIGHT, p, 0, int(feature_N[p]), int(bad_N.sum())]
    return [OK, 0, 0, 0, 0]


def describe(problem: Sequence[int], keys: Sequence[str], tables_F: Sequence[str], rows_F: Sequence[int],
             weights_N: Tensor | None = None, owner: str = "collection") -> str:
    """The error message for a problem found by find_problem: what is wrong, where, and the fix."""
    code, p, value, f, count = problem
    if code == BAD_COUNT:
        return (f"the batch has {value} offsets but {len(keys)} features: offsets must have features x batch + 1 "
                f"entries (key-major)")
    if code == BAD_START:
        return (f"offsets must start at 0 but start at {value}: a KJT sliced out of a larger batch needs its "
                f"offsets rebased (offsets - offsets[0]), or build it from lengths")
    if code == DECREASING:
        return (f"offsets must be non-decreasing, but they decrease after bag {p} of feature '{keys[f]}' "
                f"(offsets[{p + 1}] = {value}): offsets are cumulative bag sizes")
    if code == BAD_END:
        return (f"offsets must end at the number of ids ({count}) but end at {value}: the last offset counts "
                f"every id of the batch")
    if code == BAD_ID:
        rows = int(rows_F[f])
        return (f"feature '{keys[f]}' has id {value} outside table '{tables_F[f]}' (valid ids 0..{rows - 1}); "
                f"{count} id(s) in this batch are out of range. Hash or clip ids into [0, num_embeddings), or "
                f"raise num_embeddings for '{tables_F[f]}'. Nothing was updated.")
    if code == BAD_WEIGHT:
        w = float(weights_N[p]) if weights_N is not None else float("nan")
        return (f"feature '{keys[f]}' has per-id weight {w} at position {p} ({count} non-finite weight(s) in "
                f"this batch): a NaN or infinite weight would write NaN into table '{tables_F[f]}'. Fix the "
                f"weights (e.g. torch.nan_to_num), or pass validate_ids=False to the {owner} to skip this check. "
                f"Nothing was updated.")
    raise AssertionError(f"unknown batch problem code {code}")


def check_features(features: KeyedJaggedTensor, rows_F: Tensor, tables_F: Sequence[str],
                   owner: str = "collection") -> None:
    """ValueError if `features` (exactly the features rows_F / tables_F describe, in order) is unsafe."""
    values_N = features.values()
    host = features if values_N.device.type == "cpu" else features.host_copy()
    if host is None:
        return  # a device batch with no host copy: the lazy device check (DeviceBoundsCheck) covers it
    if host.values().numel() == 0 and host.offsets_or_none() is None:
        return
    problem = find_problem(rows_F, host.values(), host.offsets(), host.weights_or_none())
    if problem[0] != OK:
        raise ValueError(describe(problem, features.keys(), tables_F, rows_F.tolist(), host.weights_or_none(), owner))


# Kept for callers of the earlier name.
def check_ids(features: KeyedJaggedTensor, rows_F: Tensor, tables_F: Sequence[str]) -> None:
    check_features(features, rows_F, tables_F)


class _Arrived:
    """The event of a host copy: recorded and complete at once."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True


class DeviceBoundsCheck:
    """Bad ids on GPU batches that were never on the host, reported without a per-step sync.

    After each lookup, `after_lookup(counters, features)` copies the kernels' device-side bad-id
    counters (fbgemm's, one per fused kernel) into a pinned host slot without waiting and records an
    event; `before_lookup()` raises once an earlier copy has arrived with a count above the last one
    seen. The slots and events are allocated once (a ring of SLOTS), so a step adds one async copy
    and one event record. fbgemm's check replaces each bad id by 0 in the ids it reads, so the message
    names the tables of the kernels whose count rose (and the feature, where the batch still shows it).
    """

    SLOTS = 4
    # Copy the counters after every `copy_every`-th lookup (fbgemm's counts only grow, so none is missed; a bad
    # batch between copies is named by its tables). 1: every lookup; the GPU benchmark measures the others.
    copy_every = 1

    def __init__(self, rows_F: Tensor, tables_F: Sequence[str], owner: str) -> None:
        self.rows_F, self.tables_F, self.owner = rows_F, list(tables_F), owner
        self._ring: list[tuple[Tensor, object]] | None = None
        self._tables_K: list[list[str]] = []  # the tables behind each counter
        self._pending: list[tuple[int, KeyedJaggedTensor]] = []  # (slot, batch), oldest first
        self._next = 0
        self._seen_K: list[int] = []
        self._lookups = 0

    def before_lookup(self) -> None:
        while self._pending and self._ring[self._pending[0][0]][1].query():
            slot, features = self._pending.pop(0)
            counts_K = self._ring[slot][0].tolist()
            rose = [k for k, (n, seen) in enumerate(zip(counts_K, self._seen_K)) if n > seen]
            if rose:
                self._seen_K = counts_K
                self._pending.clear()
                raise ValueError(self._message(features, [t for k in rose for t in self._tables_K[k]]))

    def after_lookup(self, counters: Sequence[tuple[Tensor, Sequence[str]]], features: KeyedJaggedTensor) -> None:
        if not counters:
            return
        self._lookups += 1
        if self._lookups % self.copy_every:
            return
        if self._ring is None:
            self._tables_K = [list(tables) for _, tables in counters]
            self._seen_K = [0] * len(counters)
            # CPU counters (fbgemm's CPU kernel in the same mode, for tests): the copy is done when it returns
            cuda = counters[0][0].is_cuda
            self._ring = [(torch.zeros(len(counters), dtype=torch.int64, pin_memory=cuda),
                           torch.cuda.Event() if cuda else _Arrived()) for _ in range(self.SLOTS)]
        if len(self._pending) == self.SLOTS:  # the stream is far behind: this slot's copy is overwritten
            self._pending.pop(0)
        slot = self._next
        self._next = (slot + 1) % self.SLOTS
        host, event = self._ring[slot]
        if len(counters) == 1:
            host.copy_(counters[0][0].view(-1), non_blocking=True)
        else:
            host.copy_(torch.cat([c.view(-1) for c, _ in counters]), non_blocking=True)
        event.record()
        self._pending.append((slot, features))

    def _message(self, features: KeyedJaggedTensor, tables: list[str]) -> str:
        cpu = features.to("cpu")
        problem = find_problem(self.rows_F, cpu.values(), cpu.offsets(), cpu.weights_or_none())
        if problem[0] != OK:  # the batch still shows it (the kernel read a copy), or holds another problem
            where = describe(problem, features.keys(), self.tables_F, self.rows_F.tolist(), cpu.weights_or_none(),
                             self.owner).rstrip(".").replace(" Nothing was updated", "")
        else:
            read_by = [f for f, t in zip(features.keys(), self.tables_F) if t in tables]
            where = (f"an id outside its table in table(s) {', '.join(repr(t) for t in tables)} of {self.owner}, "
                     f"read by feature(s) {', '.join(repr(f) for f in read_by)}")
        return (f"a GPU batch had {where}. It was checked on the device (the batch was never on the host), so it "
                f"trained with the bad ids read as row 0; build batches on the host and move them with .to('cuda') "
                f"to have them refused, naming the feature, before any update.")
