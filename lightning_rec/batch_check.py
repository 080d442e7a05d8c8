"""Checks a batch passes before any kernel reads it: offsets, ids in their tables, finite weights
(docs/kernels.md; on GPU, docs/gpu.md#on-gpu).

Shapes: F features, B samples, N ids.

    offsets  start at 0, never decrease, end at N            (a slice of a larger batch, not rebased)
    ids      in [0, rows of the feature's table)              (one table's size per feature, not per key name)
    weights  finite                                           (one NaN weight poisons every row it touches)

CPU batches, and GPU batches that keep their host copy, are checked on the host (one C++ pass, or the same
rules in torch ops) before anything is updated. GPU batches never on the host are counted on the device
(fbgemm's bounds check, or DeviceIdGuard before routing) and raised a few lookups later, without a sync."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_rec._native import native_op
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.sparse.checks import validate_kjt

OK, BAD_START, DECREASING, BAD_END, BAD_ID, BAD_WEIGHT, BAD_COUNT = range(7)


def _native_check():
    """torch.ops.lightning_rec.check_batch when the C++ extension is built, else None."""
    return native_op("check_batch")


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


RAW_ID_ROWS = 2**63 - 1  # a managed-collision table's bound in the checks: raw ids, non-negative, below its empty slot


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
        if rows == RAW_ID_ROWS:
            return (f"feature '{keys[f]}' has id {value} but table '{tables_F[f]}' is a managed-collision table, "
                    f"which maps raw non-negative int64 ids below 2**63 - 1 (its empty slot); {count} id(s) in this "
                    f"batch are outside that: pass ids unfolded and >= 0 (e.g. `ids & (2**62 - 1)`). Nothing was "
                    f"updated.")
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
    if torch.compiler.is_compiling():
        # torch.compile cannot trace the host reads below: the same check as one op of the graph
        if features.values().device.type == "cpu":
            torch._assert_async(_compiled_check(rows_F, features.values(), features.offsets(),
                                                features.weights_or_none(), _SEP.join(features.keys()),
                                                _SEP.join(tables_F), owner), "lightning_rec batch check")
        return
    values_N = features.values()
    host = features if values_N.device.type == "cpu" else features.host_copy()
    if host is None:
        return  # a device batch with no host copy: the lazy device check (DeviceBoundsCheck) covers it
    if host.values().numel() == 0 and host.offsets_or_none() is None:
        return
    problem = find_problem(rows_F, host.values(), host.offsets(), host.weights_or_none())
    if problem[0] != OK:
        validate_kjt(host)  # a malformed KJT is named as such (its lengths, its offsets), before its ids
        raise ValueError(describe(problem, features.keys(), tables_F, rows_F.tolist(), host.weights_or_none(), owner))


_SEP = "\x1f"  # joins names into the one string a custom op takes (it has no list of strings)


@torch.library.custom_op("lightning_rec::check_features", mutates_args=())
def _compiled_check(rows_F: Tensor, values_N: Tensor, offsets: Tensor, weights_N: Tensor | None, keys: str,
                    tables: str, owner: str) -> Tensor:
    """check_features inside a compiled graph: raises its ValueError, else a True flag (kept by torch._assert_async)."""
    problem = find_problem(rows_F, values_N, offsets, weights_N)
    if problem[0] != OK:
        raise ValueError(describe(problem, keys.split(_SEP), tables.split(_SEP), rows_F.tolist(), weights_N, owner))
    return torch.ones((), dtype=torch.bool)


@_compiled_check.register_fake
def _(rows_F, values_N, offsets, weights_N, keys, tables, owner) -> Tensor:
    return torch.empty((), dtype=torch.bool)


# the earlier name
def check_ids(features: KeyedJaggedTensor, rows_F: Tensor, tables_F: Sequence[str]) -> None:
    check_features(features, rows_F, tables_F)


class _Arrived:
    """The event of a host copy: recorded and complete at once."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _CountRing:
    """Per-lookup counts on the device, read back a block of `copy_every` lookups at a time without waiting.
    counts[block, j, c]: lookup j of a block writes its row (c: a kernel, or a feature); a full block travels to
    pinned host memory in one non-blocking copy. `drain()` reads arrived blocks, oldest first (none lost unread)."""

    SLOTS = 4  # blocks in flight

    def __init__(self, columns: int, device: torch.device, every: int) -> None:
        self.every = max(1, int(every))
        self.counts = torch.zeros(self.SLOTS, self.every, columns, dtype=torch.int64, device=device)
        cuda = device.type == "cuda"
        self._host = [(torch.zeros(self.every, columns, dtype=torch.int64, pin_memory=cuda),
                       torch.cuda.Event() if cuda else _Arrived()) for _ in range(self.SLOTS)]
        self.block, self.j, self.lookups = 0, 0, 0
        self._pending: list[tuple[int, int]] = []  # (block, number of its first lookup), oldest first
        # CUDA streams that wrote rows of the block being filled: its copy must follow every write
        self._cuda = cuda
        self._writers: dict[int, torch.cuda.Stream] = {}

    def row(self) -> Tensor:
        """This lookup's row of counts (a view: write into it, on the current stream)."""
        if self._cuda:
            stream = torch.cuda.current_stream(self.counts.device)
            self._writers.setdefault(stream.stream_id, stream)
        return self.counts[self.block, self.j]

    def drain(self) -> tuple[int, Tensor] | None:
        """(lookup number, its host counts) of the first arrived lookup with a count, else None (reported once)."""
        while self._pending and self._host[self._pending[0][0]][1].query():
            block, first = self._pending.pop(0)
            counts_JC = self._host[block][0]
            bad = counts_JC.nonzero()
            if bad.numel():
                j = int(bad[0, 0])
                self._pending.clear()
                return first + j, counts_JC[j].clone()
        return None

    def advance(self) -> tuple[int, Tensor] | None:
        """A lookup wrote its row: the next gets the next; a full block is copied. Returns what a forced drain found."""
        self.lookups += 1
        self.j += 1
        found = None
        if self.j == self.every:
            block = self.block
            if any(b == block for b, _ in self._pending):
                self._host[block][1].synchronize()
                found = self.drain()
            host, event = self._host[block]
            if self._writers:
                copying = torch.cuda.current_stream(self.counts.device)
                for stream in self._writers.values():
                    if stream.stream_id != copying.stream_id:
                        copying.wait_stream(stream)  # a row written on another stream: copied after it
                self._writers = {}
            host.copy_(self.counts[block], non_blocking=True)
            event.record()
            self._pending.append((block, self.lookups - self.every + 1))
            self.block, self.j = (block + 1) % self.SLOTS, 0
        return found


class DeviceBoundsCheck:
    """Bad ids on GPU batches that were never on the host, reported without a per-step sync.

    fbgemm's bounds check (BoundsCheckMode.WARNING) counts a call's bad ids on the device (read as row 0). Each
    kernel's counter is pointed at its column of this lookup's row of a _CountRing, and a later call raises once a
    block with a count has arrived, naming the kernel's tables and features and the lookup (the batch is not kept)."""

    SLOTS = _CountRing.SLOTS
    copy_every = 32  # lookups per block: one host copy per block

    def __init__(self, rows_F: Tensor, tables_F: Sequence[str], owner: str,
                 kernels: Sequence[tuple[torch.nn.Module, Sequence[str]]], feature_names: Sequence[str],
                 copy_every: int | None = None) -> None:
        """kernels: (fbgemm TBE with a `bounds_check_warning` buffer, the tables it holds) per fused kernel;
        copy_every: lookups per block read back (None: the class's)."""
        self.rows_F, self.tables_F, self.owner = rows_F, list(tables_F), owner
        self.feature_names = list(feature_names)
        self._tbes = [tbe for tbe, _ in kernels]
        self._tables_K = [list(tables) for _, tables in kernels]
        K = len(self._tbes)
        self._ring = _CountRing(K, self._tbes[0].bounds_check_warning.device, copy_every or self.copy_every)
        counts = self._ring.counts
        # views made once: pointing a kernel at its slot is a dict write, not a tensor op
        self._slots = [[[counts[b, j, k : k + 1] for k in range(K)] for j in range(self._ring.every)]
                       for b in range(self.SLOTS)]
        self._point()

    def _point(self) -> None:
        for tbe, view in zip(self._tbes, self._slots[self._ring.block][self._ring.j]):
            tbe._buffers["bounds_check_warning"] = view  # fbgemm reads the attribute at each call

    def before_lookup(self, now: KeyedJaggedTensor | None = None, rows_F: Tensor | None = None,
                      tables_F: Sequence[str] | None = None) -> None:
        """Raise for an earlier lookup whose count has arrived with bad ids (never waits).

        now, rows_F, tables_F: the batch about to be looked up, its features' table sizes and names. When raising, it
        is checked on the host (a sync on the error path alone), to name the feature, table and id."""
        found = self._ring.drain()
        if found is not None:
            self._raise(found, self._check_now(now, rows_F, tables_F) if now is not None else "")

    def _check_now(self, now: KeyedJaggedTensor, rows_F: Tensor, tables_F: Sequence[str]) -> str:
        host = now.to("cpu")
        problem = find_problem(rows_F, host.values(), host.offsets(), host.weights_or_none())
        if problem[0] == OK:
            return " The batch of this call is fine (not looked up)."
        said = describe(problem, now.keys(), tables_F, rows_F.tolist(), host.weights_or_none(), self.owner)
        return f" The batch of this call has the problem too (not looked up): {said}"

    def after_lookup(self) -> None:
        """A device batch went through the kernels: the next lookup gets the next slot; a full block is copied."""
        found = self._ring.advance()
        self._point()
        self._raise(found)

    def _raise(self, found: tuple[int, Tensor] | None, now: str = "") -> None:
        if found is None:
            return
        lookup, counts_K = found
        k = int(counts_K.nonzero()[0, 0])
        tables = self._tables_K[k]
        read_by = [f for f, t in zip(self.feature_names, self.tables_F) if t in tables]
        where = f"table(s) {', '.join(repr(t) for t in tables)}"
        if len(tables) > 1:  # fbgemm's count is per kernel: which of its tables is not known
            where = f"one or more of the {len(tables)} {where} (one fbgemm kernel, one count)"
        raise ValueError(_device_message(int(counts_K[k]), where, read_by, lookup, self._ring.lookups, self.owner)
                         + now)


class DeviceIdGuard:
    """A sharded collection's check of GPU batches never on the host, before the ids are routed.

    Row-wise routing would send an id outside its table to another shard's rows or past the routing tables (a device
    assert), and no kernel would count it. So, without a sync: such ids are read as row 0 (as fbgemm's WARNING mode
    does), counted per feature into a _CountRing, and a later call raises."""

    copy_every = 32

    def __init__(self, rows_F: Tensor, tables_F: Sequence[str], feature_names: Sequence[str], owner: str,
                 device: torch.device, copy_every: int | None = None) -> None:
        self.tables_F, self.feature_names, self.owner = list(tables_F), list(feature_names), owner
        self.rows_F = rows_F.to(device)
        self.features_F = torch.arange(len(self.feature_names), device=device)
        self._ring = _CountRing(len(self.feature_names), device, copy_every or self.copy_every)

    def __call__(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """`features` (in the collection's order) with bad ids read as row 0; raises for an earlier batch."""
        self._raise(self._ring.drain())
        values_N = features.values()
        N, F = values_N.numel(), len(self.feature_names)
        ids_per_feature_F = features.lengths().view(F, features.stride()).sum(1)
        feature_N = torch.repeat_interleave(self.features_F, ids_per_feature_F, output_size=N)
        bad_N = (values_N < 0) | (values_N >= self.rows_F[feature_N])
        row = self._ring.row()
        row.zero_().index_add_(0, feature_N, bad_N.long())
        found = self._ring.advance()
        guarded = KeyedJaggedTensor(features.keys(), values_N.masked_fill(bad_N, 0),
                                    features.weights_or_none(), lengths=features.lengths(),
                                    offsets=features.offsets_or_none(), stride=features.stride(),
                                    length_per_key=features._length_per_key, _validate=False)
        self._raise(found)
        return guarded

    def _raise(self, found: tuple[int, Tensor] | None) -> None:
        if found is None:
            return
        lookup, counts_F = found
        bad = [int(f) for f in counts_F.nonzero()[:, 0]]
        where = "; ".join(f"feature {self.feature_names[f]!r}: {int(counts_F[f])} id(s) outside table "
                          f"{self.tables_F[f]!r} (valid ids 0..{int(self.rows_F[f]) - 1})" for f in bad)
        raise ValueError(f"a GPU batch had ids outside their tables ({where}) of {self.owner}: the batch of lookup "
                         f"{lookup} of this {self.owner} (its latest: {self._ring.lookups}). {_DEVICE_FIX}")


_DEVICE_FIX = ("It was checked on the device (the batch was never on the host), so it trained with the bad ids read "
               "as row 0; hash or clip ids into [0, num_embeddings), or build batches on the host and move them "
               "with .to('cuda') to have them refused, naming the feature and id, before any update.")


def _device_message(count: int, where: str, read_by: Sequence[str], lookup: int, latest: int, owner: str) -> str:
    return (f"a GPU batch had {count} id(s) outside their table in {where} of {owner}, read by "
            f"feature(s) {', '.join(repr(f) for f in read_by)}: the batch of lookup {lookup} of this "
            f"{owner} (its latest: {latest}). {_DEVICE_FIX}")
