"""Ranks agree on which collective they are in: a wait that lasts finds out why, within seconds.

Every collective lightning_rec runs (the embedding exchanges of input_dist.py / output_dist.py, the
shared-memory transport's barrier, the rank agreements and object collectives of comm.py) waits
through the CollectiveGuard of its process group:

    begin(tag)   numbers the call: call k of the group (the same k on every rank, as every rank
                 runs the same collectives in the same order)
    wait GRACE_S one blocking wait with a time limit (at most half the timeout): the normal case ends here,
                 at no extra cost
    watch        past the grace, this rank publishes where it waits (group, k, tag) in the process
                 group's c10d Store and, every POLL_S until the timeout, reads where its peers are:
                   the same group, call and tag    a third rank is late: keep waiting
                   another of our calls            CollectiveMismatch naming both calls (the peer,
                                                   waiting too, raises the same from its side)
                   blocked in torch.distributed    e.g. a rank that caught an error and went on to its
                                                   own dist.barrier(): CollectiveMismatch naming that
                                                   call and the line that made it
                   nothing published               computing (or loading data): keep waiting, until
                                                   the timeout, whose message names `setting`
    failure      a collective that fails (gloo: "Connection closed by peer") names the ranks that
                 exited: on this host, their pid is gone; elsewhere, their heartbeat stopped. DDP's
                 gradient all-reduce over gloo gets this too (named_failure_allreduce_hook), and so do
                 checkpoint saves and loads (peer_failure: DCP's exchanges on the default group)

A rank blocked inside torch.distributed runs no code of ours, so every process runs one watcher
thread: each TICK_S it bumps its heartbeat and looks at the main thread's Python stack; once that
thread has sat in one torch.distributed call for GRACE_S, it publishes the call and the user's line
that made it (and prints the verdict of a peer that raised because of it, so the blocked rank's
log says why its peer stopped).

Cost when all is well: a counter per collective and a timed wait instead of a plain one, about
1-2 us per call (benchmarks/collective_guard.py; a DLRM step makes about six such calls); the
Store is touched only by waits longer than the grace and by the heartbeat (one add per second per
rank). Without a c10d Store the guard keeps the timeouts only; LIGHTNING_REC_COLLECTIVE_GUARD=0
turns it off. A peer blocked for GRACE_S in a collective of a group that does not include this
rank, which would complete later, is reported too (a single-threaded rank at another collective is
taken to be stuck there).

NCCL: collectives do not block the host, and a timed wait would add a host sync, so there only
the waits the host makes anyway are guarded (the id counts, whose sizes the host reads; the step
agreement; checkpoint gathers); a mismatch elsewhere surfaces at the next of those. The watcher
sees a rank blocked in torch.distributed only where the host blocks (barrier, object collectives,
.item() after a collective).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from lightning_rec._compat import default_store

GRACE_S = 3.0  # a wait longer than this starts watching the peers (a normal collective takes ms)
POLL_S = 0.25  # how often a watching rank reads its peers' entries (up to 64 ranks; longer beyond)
TICK_S = 1.0  # the watcher thread's period: heartbeat, and a look at the main thread
_PREFIX = "lightning_rec/guard/"


class CollectiveMismatch(RuntimeError):
    """Ranks reached the same exchange with different collectives (or sizes): raised on every rank."""


def step_mismatch(what: str, steps: Sequence[int]) -> CollectiveMismatch:
    """The error for ranks (group ranks, in order) that reach one exchange at different `steps`: calls of
    DistributedModelParallel.forward, which every embedding exchange of a step carries (no collective of its own);
    a pipeline's feeder: the batches the steps claimed. Every wait of this process that it leaves unpaired raises it."""
    where = ", ".join(f"rank {r} at step {s}" for r, s in enumerate(steps))
    _FOUND[:] = [time.monotonic(), where]
    return CollectiveMismatch(
        f"'{what}': the ranks are at different steps of DistributedModelParallel ({where}; a step is a call of "
        f"dmp(...); routed ahead by a pipeline, a step that reached its embedding exchanges): a rank whose step "
        f"raised before its embedding exchanges and went on (a try/except around the training step or around "
        f"pipeline.progress()) meets the other ranks' previous step there. Let the error propagate on every rank, "
        f"or skip that step on every rank")


# (monotonic time, the steps) of the last step mismatch this process found: a thread of it waiting in an exchange
# that the mismatch leaves unpaired (the step, while the pipeline's feeder found it) raises it, not PeerExited
_FOUND: list = []


def _found_since(start: float, head: str) -> CollectiveMismatch | None:
    if not _FOUND or _FOUND[0] < start:
        return None
    return CollectiveMismatch(f"{head} cannot pair: another exchange of this rank found the ranks at different steps "
                              f"({_FOUND[1]}): a rank whose step raised before its embedding exchanges went on (a "
                              f"try/except around the training step or around pipeline.progress()). Let the error "
                              f"propagate on every rank, or skip that step on every rank")


class CollectiveTimeout(RuntimeError):
    """A peer did not reach a collective within the timeout (the message names the setting)."""


class PeerExited(RuntimeError):
    """A peer process exited while this rank waited for it (the message names the rank)."""


# global rank -> (host, pid) of every peer this process has read from the Store. Rank 0 often hosts the Store
# (Lightning's launcher): once it dies nothing can be read there, so its pid must have been read before.
_KNOWN_PEERS: dict[int, tuple[str, int]] = {}

# id(process group) -> its guard, while its owner (DistributedModelParallel) keeps it; the guard
# holds its group, so the id is not reused while the entry exists
_GUARDS: weakref.WeakValueDictionary[int, CollectiveGuard] = weakref.WeakValueDictionary()


def guard_of(pg, enabled_only: bool = True) -> CollectiveGuard | None:
    """The guard of process group `pg` (None: an unguarded group, plain waits)."""
    guard = _GUARDS.get(id(pg))
    if guard is None or guard.pg is not pg or (enabled_only and not guard.enabled):
        return None
    return guard


def _is_wait_timeout(err: RuntimeError) -> bool:
    # Work.wait(timeout) says exactly this when the time is up and the work is still pending
    return "Operation timed out" in str(err)


def _timed_out(err: Exception) -> bool:
    # a collective's own time limit (gloo: "Timed out waiting 3000ms for send operation to complete")
    return "timed out" in str(err).lower()


def _process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(")") + 2 : stat.rfind(")") + 3]
    return state not in ("Z", "X")


class CollectiveGuard:
    """Numbers the collectives of one process group and turns a long wait into a verdict.

    Args:
        pg: the process group (every rank of it builds its guard, in the same order).
        name: what the messages call the group ("embedding").
        timeout_s: the longest wait for a peer before CollectiveTimeout.
        setting: how the user sets that timeout ("DistributedModelParallel(timeout=...)").
        enabled: False (or LIGHTNING_REC_COLLECTIVE_GUARD=0 in the environment): the group's
            collectives wait plainly, with their timeouts only (to measure what the guard costs).
        slot: "" for the main thread's groups; another name for a group whose collectives run in a
            thread of their own (the pipeline's feeder): its waits are published, and its peers'
            read, under that slot, so two threads of a rank never overwrite each other's entry.
    """

    def __init__(self, pg, name: str, timeout_s: float, setting: str, enabled: bool | None = None,
                 slot: str = "") -> None:
        if enabled is None:
            enabled = os.environ.get("LIGHTNING_REC_COLLECTIVE_GUARD", "1") != "0"
        self.enabled = enabled
        self.pg, self.name, self.timeout_s, self.setting = pg, name, float(timeout_s), setting
        self.rank = dist.get_rank()  # global ranks: entries in the Store are keyed by them
        self.ranks = list(dist.get_process_group_ranks(pg))
        self.uid = f"{name}:{getattr(pg, 'group_name', id(pg))}"
        self.nccl = dist.get_backend(pg) == "nccl"
        self.k = 0
        self._slot = f"/{slot}" if slot else ""
        self._store = default_store() if enabled else None
        self._peers_info: dict[int, tuple[str, int]] = {}
        self._store_down = False
        self._grace_cache: tuple[float, timedelta] = (-1.0, timedelta(0))
        if self._store is not None:
            _Watcher.ensure(self._store, self.rank)
        _GUARDS[id(pg)] = self  # disabled too: its failure messages still name the setting

    # the calls ---------------------------------------------------------------------------------

    def publish_as(self, slot: str) -> None:
        """Publish this group's waits (and read its peers') under `slot` from now on ("": the main thread's)."""
        self._slot = f"/{slot}" if slot else ""

    def begin(self) -> int:
        self.k += 1
        return self.k

    def wait_work(self, work, tag: str, k: int, host: bool = True) -> None:
        """Wait for a Work of this group. NCCL with host=False: a stream wait only (no host sync)."""
        if self.nccl and not host:
            work.wait()
            return
        if not self.nccl:  # the usual case first, in one call: the collective ends within the grace
            try:
                work.wait(self._grace_td)
                return
            except RuntimeError as e:
                if not _is_wait_timeout(e):
                    raise self.failure(tag, k, e) from e
            self.wait_until(lambda s: _work_done(work, s, False), tag, k, graced=True)
            return
        self.wait_until(lambda s: _work_done(work, s, True), tag, k)

    @property
    def grace_s(self) -> float:
        # at most half the timeout: the peers are watched before it, and the group's own limit (the same timeout)
        # ends a wait inside the watch, where the verdict names the late ranks
        return min(GRACE_S, self.timeout_s / 2)

    @property
    def _grace_td(self) -> timedelta:
        if self._grace_cache[0] != self.grace_s:  # GRACE_S is read at call time (tests lower it)
            self._grace_cache = (self.grace_s, timedelta(seconds=self.grace_s))
        return self._grace_cache[1]

    def wait_until(self, wait_for, tag: str, k: int, graced: bool = False) -> None:
        """`wait_for(seconds) -> bool` blocks at most `seconds`, True once the collective is done.

        graced: the caller has already waited the grace (its own fast path).
        """
        start = time.monotonic() - (self.grace_s if graced else 0.0)
        if not graced:
            try:
                if wait_for(self.grace_s):
                    return
            except RuntimeError as e:
                raise self.failure(tag, k, e) from e
        if self._store is None:
            self._wait_plain(wait_for, tag, k, start)
            return
        self._publish({"kind": "guard", "group": self.uid, "name": self.name, "k": k, "tag": tag})
        for p in self.ranks:  # while the Store is surely up: to name a peer that exits later
            self._peer_info(p)
        seen: dict[int, str] = {}
        try:
            while True:
                waited = time.monotonic() - start
                if waited >= self.timeout_s:
                    raise self._timeout(tag, k, waited)
                try:
                    if wait_for(min(self._poll_s(), self.timeout_s - waited)):
                        return
                except RuntimeError as e:
                    # a peer that raised a mismatch and left: what this rank saw of it says why; the collective's
                    # own limit (the group's, the same timeout) reached first: the verdict of this wait's timeout
                    waited = time.monotonic() - start
                    raise self._mismatch(tag, k, waited, seen, e) or (
                        self._timeout(tag, k, waited) if _timed_out(e) else self.failure(tag, k, e)) from e
                found = _found_since(start, f"{self.name} {self._where(tag, k)} on rank {self.rank}")
                if found is not None:
                    raise found
                self._check_peers(tag, k, time.monotonic() - start, seen)
        finally:
            self._publish(None)

    def _wait_plain(self, wait_for, tag: str, k: int, start: float) -> None:
        while True:
            waited = time.monotonic() - start
            if waited >= self.timeout_s:
                raise self._timeout(tag, k, waited)
            try:
                if wait_for(min(1.0, self.timeout_s - waited)):
                    return
            except RuntimeError as e:
                raise self.failure(tag, k, e) from e

    # verdicts ------------------------------------------------------------------------------------

    def _where(self, tag: str, k: int) -> str:
        return f"'{tag}' ({self.name} collective #{k})"

    def _poll_s(self) -> float:
        # every waiting rank reads every peer's entry: at scale, poll less often so that rank 0's Store
        # serves about the same load (64 ranks: POLL_S; 1024 ranks: 16x longer)
        return POLL_S * max(1.0, len(self.ranks) / 64)

    def _entries(self) -> dict[int, str]:
        """Every peer's published entry ("" when none), in one Store round trip when all exist."""
        peers = [p for p in self.ranks if p != self.rank]
        keys = [f"{_PREFIX}at/{p}{self._slot}" for p in peers]
        if not self._store_down and callable(getattr(self._store, "multi_get", None)):
            try:
                if self._store.check(keys):  # multi_get would wait for a missing key
                    return {p: v.decode() for p, v in zip(peers, self._store.multi_get(keys))}
            except RuntimeError:
                self._store_down = True
        return {p: self._read(f"at/{p}{self._slot}") for p in peers}

    def _check_peers(self, tag: str, k: int, waited: float, seen: dict[int, str]) -> None:
        for p, raw in self._entries().items():
            if not raw:
                seen.pop(p, None)
                continue
            entry = json.loads(raw)
            if entry["kind"] == "guard" and entry["group"] == self.uid and entry["k"] == k and entry["tag"] == tag:
                seen.pop(p, None)  # the same call: someone else is late
                continue
            # entries are cleared as soon as their wait ends: one seen on two polls in a row is where p is
            if seen.get(p) != raw:
                seen[p] = raw
                continue
            err = self._mismatch(tag, k, waited, {p: raw})
            if entry["kind"] == "guard":
                time.sleep(2 * self._poll_s())  # the peer confirms on its next polls: both raise, not one
            else:  # the peer cannot raise from inside torch.distributed: its watcher prints why we did
                self._set(f"verdict/{p}", f"rank {self.rank} raised CollectiveMismatch: {err}")
                time.sleep(TICK_S + self._poll_s())  # one watcher tick (and a margin) to read it
            raise err

    def _mismatch(self, tag: str, k: int, waited: float, seen: dict[int, str],
                  cause: Exception | None = None) -> CollectiveMismatch | None:
        for p, raw in sorted(seen.items()):
            entry = json.loads(raw)
            if entry["kind"] == "guard":
                if entry["group"] == self.uid and entry["k"] == k and entry["tag"] == tag:
                    continue
                how, theirs = "waits in", f"'{entry['tag']}' ({entry['name']} collective #{entry['k']})"
            else:
                how, theirs = "is blocked in", f"{entry['call']} (called at {entry['where']})"
            text = (f"collective mismatch: rank {self.rank} waits in {self._where(tag, k)} for {waited:.1f} s, but "
                    f"rank {p} {how} {theirs}. Every rank must run the same collectives in the same order: a "
                    f"rank that catches an error and goes on, or skips a batch, leaves the others waiting; let "
                    f"the error propagate on every rank (or skip the batch on every rank)")
            if cause is not None:
                text += f". Then rank {p} left: {cause}"
            return CollectiveMismatch(text)
        return None

    def _timeout(self, tag: str, k: int, waited: float) -> RuntimeError:
        dead = self.exited_peers()
        if dead:
            return PeerExited(f"{self.name} {self._where(tag, k)} on rank {self.rank}: {_describe(dead)}")
        late = self._late_peers(tag, k)
        who = (f"rank {late[0]} did not" if len(late) == 1 else f"ranks {', '.join(map(str, late))} did not"
               if late else "a peer did not")
        return CollectiveTimeout(
            f"{self.name} {self._where(tag, k)} on rank {self.rank}: {who} reach it within "
            f"{self.timeout_s:g} s; every peer is alive and none is in another collective, so "
            f"{'it is' if len(late) == 1 else 'one is'} still computing (or stuck outside torch.distributed). "
            f"Raise the limit with {self.setting} if a step legitimately takes that long")

    def _late_peers(self, tag: str, k: int) -> list[int]:
        """At the timeout: the peers not waiting in this call (each waiter has published it, past its grace);
        [] when no Store tells."""
        if self._store is None:
            return []
        late = []
        for p, raw in self._entries().items():
            entry = json.loads(raw) if raw else {}
            if not (entry.get("kind") == "guard" and entry.get("group") == self.uid and entry.get("k") == k
                    and entry.get("tag") == tag):
                late.append(p)
        return late

    def failure(self, tag: str, k: int, err: Exception) -> RuntimeError:
        """The error for a collective that failed: names the ranks that exited, and the setting."""
        if isinstance(err, (CollectiveMismatch, CollectiveTimeout, PeerExited)):
            return err
        head = f"{self.name} {self._where(tag, k)} failed on rank {self.rank}"
        dead = self.exited_after_failure()  # (first: a thread of this rank may be finding the mismatch meanwhile)
        found = _found_since(time.monotonic() - self.timeout_s, head)  # (this wait began within the timeout)
        if found is not None:
            return found
        if dead:
            return PeerExited(f"{head}: {_describe(dead)}. Cause: {err}")
        if _timed_out(err):
            return CollectiveTimeout(f"{head}: a peer did not answer within the timeout ({self.timeout_s:.0f} s; set "
                                     f"{self.setting}). Cause: {err}")
        return RuntimeError(f"{head}: a peer rank failed or closed its connection (no peer is known to have exited; "
                            f"see the other ranks' logs). Cause: {err}")

    def exited_after_failure(self, ranks: Sequence[int] | None = None) -> list[tuple[int, str]]:
        """exited_peers() after a collective failed: gloo notices a closed connection before the peer's
        process is gone, so an empty answer is asked again for up to a second."""
        dead = self.exited_peers(ranks=ranks)
        for _ in range(10):
            if dead or self._store is None:
                break
            time.sleep(0.1)
            dead = self.exited_peers(remote=False, ranks=ranks)
        return dead

    def exited_peers(self, remote: bool = True, ranks: Sequence[int] | None = None) -> list[tuple[int, str]]:
        """(rank, how we know) for every peer (of this group, or of `ranks`) known to have exited."""
        if self._store is None:
            return []
        me = socket.gethostname()
        out, others = [], []
        for p in self.ranks if ranks is None else ranks:
            if p == self.rank:
                continue
            info = self._peer_info(p)
            if info is None:
                continue
            host, pid = info
            if host == me:
                if not _process_alive(pid):
                    out.append((p, f"pid {pid} on this host is gone"))
            elif remote:
                others.append(p)
        if others:  # other hosts: a heartbeat that stopped for 2.5 ticks
            try:
                before = {p: self._read(f"hb/{p}") for p in others}
                time.sleep(2.5 * TICK_S)
                out += [(p, f"its heartbeat on {self._peer_info(p)[0]} stopped") for p in others
                        if self._read(f"hb/{p}") == before[p]]
            except RuntimeError:
                pass
        return sorted(out)

    # the Store -------------------------------------------------------------------------------------

    def _peer_info(self, p: int) -> tuple[str, int] | None:
        if p not in self._peers_info:
            raw = self._read(f"pid/{p}")
            if not raw:
                return _KNOWN_PEERS.get(p)  # the Store is gone (with its host, rank 0): what was read before
            host, pid = raw.rsplit(":", 1)
            self._peers_info[p] = _KNOWN_PEERS[p] = (host, int(pid))
        return self._peers_info[p]

    def remember_peers(self) -> None:
        """Read every rank's pid now, in one Store request. Call it when every rank of the group has built its
        guard (after a collective of the group): a peer that exits later is named even if the Store exited with
        it. Without this the pids were read only once a wait had lasted the grace."""
        if self._store is None or self._store_down:
            return
        keys = [f"{_PREFIX}pid/{p}" for p in self.ranks]
        try:
            if not self._store.check(keys):  # a rank without a guard (LIGHTNING_REC_COLLECTIVE_GUARD=0 there)
                return
            values = self._store.multi_get(keys)
        except (RuntimeError, AttributeError):  # AttributeError: a Store without multi_get
            return
        for p, raw in zip(self.ranks, values):
            host, pid = raw.decode().rsplit(":", 1)
            self._peers_info[p] = _KNOWN_PEERS[p] = (host, int(pid))

    def _read(self, key: str) -> str:
        if self._store_down:
            return ""
        key = _PREFIX + key
        try:
            if not self._store.check([key]):
                return ""
            return self._store.get(key).decode()
        except RuntimeError:  # the Store's host is gone: the collective's own failure says so
            self._store_down = True
            return ""

    def _set(self, key: str, value: str) -> None:
        if self._store_down:
            return
        try:
            self._store.set(_PREFIX + key, value)
        except RuntimeError:
            self._store_down = True

    def _publish(self, entry: dict | None) -> None:
        self._set(f"at/{self.rank}{self._slot}", json.dumps(entry) if entry is not None else "")


def peer_failure(what: str, err: BaseException, then: str = "") -> PeerExited | None:
    """For a failed torch.distributed call of ours outside the guarded groups (a checkpoint's DCP
    exchanges, on the default group): PeerExited naming the ranks of the world that exited, when
    that explains `err`, with `then` (what became of the work) after it; None when no peer is known
    to have exited, or no guard runs in this process (nothing publishes the ranks' pids then)."""
    guard = next((g for g in list(_GUARDS.values()) if g._store is not None), None)
    if guard is None or not dist.is_initialized():
        return None
    dead = guard.exited_after_failure(ranks=range(dist.get_world_size()))
    if not dead:
        return None
    return PeerExited(f"{what} failed on rank {guard.rank}: {_describe(dead)}. {then}{' ' if then else ''}"
                      f"Cause: {err}")


def _describe(dead: list[tuple[int, str]]) -> str:
    ranks = [p for p, _ in dead]
    why = "; ".join(f"rank {p}: {how}" for p, how in dead)
    return f"rank(s) {ranks} exited ({why}): see their logs for the cause"


def _work_done(work, seconds: float, nccl: bool) -> bool:
    if nccl:  # a timed NCCL wait may abort the communicator: poll instead, then join the streams
        start = time.monotonic()
        nap = 1e-4
        while not work.is_completed():
            now = time.monotonic()
            if now - start >= seconds:
                return False
            if now - start > 2e-3:  # spin for the first 2 ms (the usual wait), then nap
                time.sleep(nap)
                nap = min(nap * 2, 1e-3)
        work.wait()
        return True
    try:
        work.wait(timedelta(seconds=max(seconds, 1e-3)))
        return True
    except RuntimeError as e:
        if _is_wait_timeout(e):
            return False
        raise


class GuardedWork:
    """An async collective's Work whose wait() goes through the guard."""

    __slots__ = ("work", "guard", "tag", "k", "host")

    def __init__(self, work, guard: CollectiveGuard, tag: str, k: int, host: bool = False) -> None:
        self.work, self.guard, self.tag, self.k, self.host = work, guard, tag, k, host

    def wait(self) -> bool:
        self.guard.wait_work(self.work, self.tag, self.k, self.host)
        return True


def named_failure_allreduce_hook(guard: CollectiveGuard, pg):
    """A DDP comm hook for gloo groups: torch's own averaging all-reduce of each gradient bucket, whose
    failure names the peer that exited (gloo itself says "Connection closed by peer" or "Read error
    ... Connection reset by peer", depending on the torch release).

    The hook does not number its calls in the guard: DDP reduces buckets from the autograd engine,
    whose order beside the embedding exchanges is not the same on every rank.
    """
    world = dist.get_world_size(pg)
    calls = [0]

    def hook(_state, bucket):  # unannotated: DDP compares annotations as objects, and this module defers them
        calls[0] += 1
        n = calls[0]
        buf = bucket.buffer().div_(world)  # torch's allreduce_hook: average, in the bucket's own dtype
        fut = dist.all_reduce(buf, group=pg, async_op=True).get_future()

        def done(f):
            try:
                return f.value()[0]
            except RuntimeError as e:
                raise guard.failure("DDP gradient all-reduce", n, e) from e

        return fut.then(done)

    return hook


def old_store_alive() -> bool:
    """While no process group is initialised: is the Store of one this process watched before still alive (some
    object holds a destroyed group)? A new init_process_group would reuse its server, old keys and all."""
    watcher = _Watcher._instance
    return watcher is not None and watcher.store() is not None and not dist.is_initialized()


# the watcher thread ----------------------------------------------------------------------------------

_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")
_TORCH_DIST = os.path.join("torch", "distributed", "")


class _Watcher:
    """One daemon thread per process: heartbeat, and publishes a main thread blocked in torch.distributed.

    It holds the Store weakly: a Store kept alive past destroy_process_group() keeps its server (rank 0) serving
    on MASTER_PORT, and the next init_process_group in this process reuses that server, old keys and all (the
    second fit of a script that destroyed the group between two fits hung in its first collective). The
    thread ends once the process group it watched is gone, and at exit before the interpreter finalizes: a
    daemon thread inside a Store call then aborts the process (SIGABRT, "terminate called without an active
    exception"), and torchrun's other hosts wait for it at their exit barrier."""

    _instance: _Watcher | None = None
    _lock = threading.Lock()
    _stop_registered = False

    @classmethod
    def ensure(cls, store, rank: int) -> None:
        with cls._lock:
            if cls._instance is not None and cls._instance.store() is store and cls._instance.thread.is_alive():
                return
            if not cls._stop_registered:
                cls._stop_registered = True
                atexit.register(cls.stop)
            if cls._instance is not None:
                cls._instance.stopped.set()
            cls._instance = cls(store, rank)

    @classmethod
    def stop(cls, timeout_s: float = 5.0) -> None:
        """The watcher leaves (its Store call, if one is under way, finishes first)."""
        with cls._lock:
            watcher, cls._instance = cls._instance, None
        if watcher is not None:
            watcher.stopped.set()
            if watcher.thread is not threading.current_thread():
                watcher.thread.join(timeout_s)

    def __init__(self, store, rank: int) -> None:
        self.store, self.rank = weakref.ref(store), rank
        self.main = threading.main_thread().ident
        store.set(f"{_PREFIX}pid/{rank}", f"{socket.gethostname()}:{os.getpid()}")
        store.set(f"{_PREFIX}at/{rank}", "")
        self.frame = None  # the torch.distributed frame the main thread sits in, and since when
        self.since = 0.0
        self.published = False
        self.told = False
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="lightning_rec collective watcher", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(TICK_S):
            if _Watcher._instance is not self or not self._tick():
                self.frame = None  # a finished frame keeps its locals (a group, its Store) alive
                return

    def _tick(self) -> bool:
        """One heartbeat and look; False: the watched group is gone (the Store only while this runs)."""
        store = self.store()
        try:
            if store is None or not dist.is_initialized():
                return False
            store.add(f"{_PREFIX}hb/{self.rank}", 1)
            self._look(store)
            return True
        except Exception:  # noqa: BLE001 - the store's host exited: the collectives say so themselves
            return False

    def _look(self, store) -> None:
        frame = sys._current_frames().get(self.main)
        c10d, caller = None, None
        while frame is not None:
            name = frame.f_code.co_filename
            if name.endswith(_C10D_FILE):
                c10d = frame
            elif c10d is not None and _TORCH_DIST not in name:
                caller = frame
                break
            frame = frame.f_back
        now = time.monotonic()
        if c10d is None or c10d is not self.frame:
            if self.published:
                store.set(f"{_PREFIX}at/{self.rank}", "")
                self.published = False
            self.frame, self.since, self.told = c10d, now, False
            return
        if not self.published and now - self.since >= GRACE_S:
            where = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else "?"
            entry = {"kind": "torch", "call": f"torch.distributed.{c10d.f_code.co_name}", "where": where}
            store.set(f"{_PREFIX}verdict/{self.rank}", "")
            store.set(f"{_PREFIX}at/{self.rank}", json.dumps(entry))
            self.published = True
        elif self.published and not self.told:
            key = f"{_PREFIX}verdict/{self.rank}"
            verdict = store.get(key).decode() if store.check([key]) else ""
            if verdict:
                print(f"lightning_rec (rank {self.rank}, blocked in torch.distributed.{c10d.f_code.co_name}): "
                      f"{verdict}", file=sys.stderr, flush=True)
                self.told = True
