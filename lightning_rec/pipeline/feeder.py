"""One pass over a loader: the feeder reads, copies and routes batches (ahead in its thread, or inline in the step's
thread as it asks for each); the plan it follows."""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_rec.collective_guard import CollectiveMismatch
from lightning_rec.pipeline.batch import _follow, _pinned, _record_stream, find_kjts, path_name
from lightning_rec.pipeline.config import PipelineConfig
from lightning_rec.sharded_embedding import ShardedBatch, _ShardedCollectionBase
from lightning_rec.sparse import KeyedJaggedTensor

# what the feeders of one model share -------------------------------------------------------------


@dataclass
class _Registered:
    kjt: KeyedJaggedTensor  # held, so its id is not reused while registered
    entry: _Entry
    path: tuple


class _Inputs:
    """One per model: its sharded collections' input source, and which batch every KJT came from."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {m: name or type(m).__name__ for name, m in model.named_modules()
                      if isinstance(m, _ShardedCollectionBase)}
        self.modules = list(self.names)
        self._registered: dict[int, _Registered] = {}
        self._batches: dict[int, Any] = {}
        self._lock = threading.Lock()
        self.recording: _Feeder | None = None  # the feeder whose first batch is running plainly
        self.current: _Feeder | None = None  # the feeder that handed out the last batch, until its step is done
        # TrainPipelineSparseDist: id(iterator) -> (iterator, ReadAhead): batches read from it that no step has taken
        self.read_ahead: dict[int, tuple[Any, Any]] = {}
        self.iterables: dict[int, tuple[Any, Any]] = {}  # TrainPipelineSparseDist: a DataLoader's current pass
        self._warned_read_ahead = False
        # semi_sync: (id(module), id(kjt)) -> (kjt, the collection's output computed ahead), taken once
        self.looked_up: dict[tuple[int, int], tuple[KeyedJaggedTensor, Any]] = {}
        for m in self.modules:
            m._input_source = self.claim
            m._output_source = self.claim_output

    @classmethod
    def of(cls, model: nn.Module) -> _Inputs:
        """The model's (attached on first use; every pipeline over the model shares it)."""
        for m in model.modules():
            if isinstance(m, _ShardedCollectionBase):
                source = m._input_source
                owner = getattr(source, "__self__", None)
                if isinstance(owner, _Inputs) and set(owner.modules) == {
                        x for x in model.modules() if isinstance(x, _ShardedCollectionBase)}:
                    return owner
                break
        return cls(model)

    def envs(self) -> list:
        out: list = []
        for m in self.modules:
            if all(m.env is not e for e in out):
                out.append(m.env)
        return out

    def register(self, entry: _Entry) -> None:
        with self._lock:
            for kjt, path in entry.kjts:
                self._registered[id(kjt)] = _Registered(kjt, entry, path)
            self._batches[id(entry.batch)] = entry.batch

    def unregister(self, entry: _Entry) -> None:
        with self._lock:
            for kjt, _ in entry.kjts:
                reg = self._registered.get(id(kjt))
                if reg is not None and reg.kjt is kjt:
                    del self._registered[id(kjt)]
            if self._batches.get(id(entry.batch)) is entry.batch:
                del self._batches[id(entry.batch)]

    def _warn_read_ahead(self) -> None:
        """A plain training step while batches a pipeline read ahead are kept untrained: say so once."""
        waiting = sum(len(batches) for _, batches in self.read_ahead.values())
        if waiting:
            self._warned_read_ahead = True
            warnings.warn(f"lightning_rec pipeline: a plain training step runs while {waiting} batch(es) that a "
                          f"TrainPipelineSparseDist read ahead of its steps are not trained yet. If this loop "
                          f"iterates the same iterator, it skips them: take them first, "
                          f"`for batch in itertools.chain(pipeline.close(), it)` (close() returns them), or give the "
                          f"iterator to a TrainPipelineSparseDist over this model again (it starts with them)",
                          stacklevel=4)

    def registered(self, kjt: Any) -> _Registered | None:
        with self._lock:
            reg = self._registered.get(id(kjt))
        return reg if reg is not None and reg.kjt is kjt else None

    def owns(self, batch: Any) -> bool:
        """Was `batch` handed out by a feeder (so it is on the device already)?"""
        with self._lock:
            return self._batches.get(id(batch)) is batch

    def claim_output(self, module: _ShardedCollectionBase, features: KeyedJaggedTensor) -> Any:
        """The sharded collections' output source: what a semi-synchronous step looked up ahead, or None. Taken once:
        a second call with the same input looks up again, as in the plain loop (one fused update per call)."""
        if not self.looked_up:
            return None
        held = self.looked_up.pop((id(module), id(features)), None)
        return held[1] if held is not None and held[0] is features else None

    def claim(self, module: _ShardedCollectionBase, features: KeyedJaggedTensor) -> ShardedBatch | None:
        """The sharded collections' input source: a routed batch, or None (route it in the step)."""
        with self._lock:
            reg = self._registered.get(id(features))
        if reg is None or reg.kjt is not features:
            if self.current is not None:
                self.current.stats["routed_in_step"] += 1
            elif module.training and not self._warned_read_ahead and self.read_ahead:
                self._warn_read_ahead()
            recording = self.recording
            if recording is not None and self.current is recording:  # not another pass's step (a validation's)
                recording.plan.note(module, self.names[module],
                                    "it was called with a KeyedJaggedTensor that is not part of the batch (computed "
                                    "inside the model, or replaced by a batch hook)")
            return None
        return reg.entry.feeder.claim(module, features, reg.entry, reg.path)


# the plan: which collection reads which KJT of the batch -------------------------------------------


class _Plan:
    """Recorded on a pipeline's first batch; the same on every rank (same code, same batch layout)."""

    def __init__(self) -> None:
        self.routes: list[tuple[_ShardedCollectionBase, tuple]] = []
        self.not_pipelined: dict[str, str] = {}
        self.final = threading.Event()
        self.record_entry: _Entry | None = None
        # the recording step called no collection (a dense warm-up step): the next one that calls one records
        self.record_next = False
        self._warned = False

    def record(self, module: _ShardedCollectionBase, path: tuple) -> None:
        if (module, path) not in self.routes:
            self.routes.append((module, path))

    def note(self, module, name: str, why: str) -> None:
        self.not_pipelined.setdefault(name, why)

    def finalize(self, inputs: _Inputs) -> None:
        if self.final.is_set():
            return
        if inputs.recording is not None and inputs.recording.plan is self:
            inputs.recording = None
        if self.not_pipelined and not self._warned:
            self._warned = True
            what = "; ".join(f"'{n}': {why}" for n, why in self.not_pipelined.items())
            rest = ("the other collections stay pipelined" if self.routes else
                    "nothing is left to pipeline: this runs the plain loop")
            warnings.warn(f"lightning_rec pipeline: these sharded collections cannot route their ids ahead of the "
                          f"step ({what}); they route inside the step as in the plain loop, {rest}. To pipeline "
                          f"them, build the KeyedJaggedTensor in the dataset or collate_fn and pass it to the "
                          f"collection unchanged", stacklevel=3)
        self.final.set()


# one pass over a loader --------------------------------------------------------------------------


class _Entry:
    __slots__ = ("index", "batch", "kjts", "routed", "ready", "error", "copied", "routed_event", "feeder", "in_step",
                 "stop", "claimed", "step", "prefetched")

    def __init__(self, index: int, batch: Any, feeder: _Feeder) -> None:
        self.index, self.batch, self.feeder = index, batch, feeder
        self.kjts = find_kjts(batch)
        self.routed: dict[tuple, ShardedBatch] = {}
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.copied = None  # CUDA events (GPU only)
        self.routed_event = None
        self.prefetched = None  # prefetch: recorded on the prefetch stream after its caches were filled
        self.in_step = False  # in_step_order: its turn came before the plan was recorded; it routes in the step
        self.stop: dict[int, int] = {}  # the signals the ranks were sent ({rank: bits}) as they agreed on this batch
        self.claimed = False  # a collection of the step took its routed input (the step reached its exchanges)
        self.step = 0  # what its id exchange carries as the step (process groups: _step_of)


_END = object()
_EVALUATION_FIX = (" (in evaluation, a dataset with an `empty_batch()` method (a batch of 0 rows) lets a rank that ran "
                   "out step on with empty batches instead, so that every row is scored)")
_STEP_BATCHES_KEPT = 16  # batches one step may take (training_step(dataloader_iter)) that stay registered


def _in_step_order(config: PipelineConfig, channels: dict) -> bool:
    if config.read_ahead == "inline":  # all of the feeder's work waits for its turn, its collectives too
        return True
    if config.feeder_collectives != "auto":
        return config.feeder_collectives == "in_step_order"
    import torch.distributed as dist

    # one rank: no other rank to launch in another order, and step order costs speed (docs/pipeline.md)
    return any(dist.get_backend(c.pg) == "nccl" and dist.get_world_size(c.pg) > 1 for c in channels.values())


class _Feeder(Iterator):
    """Iterates `source` with the feeder thread working ahead; yields the batches, on the device, in order."""

    def __init__(self, source: Iterator, inputs: _Inputs, plan: _Plan, channels: dict, device: torch.device,
                 config: PipelineConfig, to_device: Callable[[Any], Any], stats: dict[str, int],
                 pad: Callable[[], Any] | None = None, evaluating: bool = False,
                 stop_signal: tuple | None = None, length: int | None = None) -> None:
        self.source, self.inputs, self.plan, self.channels = source, inputs, plan, channels
        # InputPipeline.stop_signal: the bits ride on each batch's agreement, told as the step takes that batch
        self.stop_signal = stop_signal
        self._end_stop: dict[int, int] = {}
        self.pad = pad  # evaluation: an empty batch, stepped with while another rank still has data
        self.evaluating = evaluating  # (without pad: the warning on skipped batches names the evaluation fix)
        self.stats = stats
        self.device, self.config, self.to_device = device, config, to_device
        self.taken = 0
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._finished = False
        self._live: deque[_Entry] = deque()  # entries handed out, still registered
        self._taken_in_step = 0  # entries handed out since the last step ended (forward_done)
        self._waiting = False  # the step's thread waits in __next__ for a batch the feeder has not put yet
        # in_step_order: the feeder runs batch k's collectives only while the step's thread waits in
        # __next__ for batch k (its turn: `_turn`), so both threads' collectives come in one order on every rank
        self._ordered = _in_step_order(config, channels)
        for channel in channels.values():
            channel.waits_for_the_step(self._ordered)
        self._turn = -1
        self._held: list = []  # in_step_order: a batch read (and copied) whose turn never came before the stop
        self._peeked: Any = None  # semi_sync: the batch peek() took for the next __next__ (_END: the data ended)
        # batches handed out that no collection took (a step that raised before its exchanges), counted as the step's
        # thread asks for batch t (unused[t], the same on every rank that ran the same steps): the agreement of a
        # later batch carries it, so that ranks whose steps no longer pair raise CollectiveMismatch
        self._open: deque[_Entry] = deque()
        self._unused, self._unused_at = 0, {}
        # a process group's id exchange of batch k carries the batches claimed when batch k-1 was claimed or passed
        # over (the step's thread asked for batch k first): ranks whose steps no longer pair raise in that exchange,
        # before the step's embedding all-to-all pairs another batch's rows (shared memory: its headers carry DMP's)
        self._claims, self._claims_at, self._resolved = 0, {}, -1
        self._stepped = bool(channels) and all(c.transport is None and c.world_size > 1 for c in channels.values())
        cuda = device.type == "cuda" and torch.cuda.is_available()
        self._copy_stream = torch.cuda.Stream(device) if cuda else None
        self._dist_stream = torch.cuda.Stream(device) if cuda else None
        # this rank's batches left in `source` when known (a map-style DataLoader's): batch 0's agreement carries it,
        # and where every rank's is the same (and no signal rides on the agreements) the later batches skip theirs
        self._length, self._sized = length, None
        # inline: the step's thread does the feeder's work itself when it asks for a batch (no thread, no hand-off)
        self._inline_at: tuple[int, bool] | None = (0, False) if config.read_ahead == "inline" else None
        self._thread: threading.Thread | None = None
        if self._inline_at is None:
            self._thread = threading.Thread(target=self._run, name="lightning_rec-pipeline-feeder", daemon=True)
            self._thread.start()

    # main thread ---------------------------------------------------------------------------------

    def __next__(self) -> Any:
        peeked, self._peeked = self._peeked, None
        if peeked is None:
            return self._take()
        if peeked is _END:
            raise StopIteration
        return peeked

    def peek(self) -> Any:
        """semi_sync: the next batch, taken now (its step's lookups run early), handed out by the next __next__;
        None at the end of the data."""
        if self._peeked is None:
            try:
                self._peeked = self._take()
            except StopIteration:
                self._peeked = _END
        return None if self._peeked is _END else self._peeked

    @property
    def peeked(self) -> Any:
        """The batch peek() took that no __next__ has handed out yet, or None."""
        return None if self._peeked is None or self._peeked is _END else self._peeked

    def _take(self) -> Any:
        if self._finished:
            raise StopIteration
        plan = self.plan
        # (the recording ends with its step, forward_done, or at a later batch's claim; a step may take several
        # batches before its forward: training_step(dataloader_iter))
        with self._cond:
            self._count_unused()
            self._resolve(self.taken - 1)  # passed over, unless claimed
            if self._ordered:
                self._turn = self.taken  # batch `taken`'s collectives may run now: this thread waits here
                self._cond.notify_all()
        if self._inline_at is not None and not self._queue:
            self._feed_inline()
        with self._cond:
            while not self._queue:
                if not self._feeding():
                    break
                self._waiting = True  # the feeder stops waiting for the plan (_wait_plan): the step is not over
                self._cond.notify_all()
                self._cond.wait(1.0)
            self._waiting = False
            item = self._queue.popleft() if self._queue else RuntimeError(
                "lightning_rec pipeline: the feeder thread ended without a result")
            if isinstance(item, _Entry):
                self.taken += 1
                self._cond.notify_all()
        if item is _END:
            self._finished = True
            self._release_all()
            self._tell_stop(self._end_stop)
            raise StopIteration
        if isinstance(item, BaseException):
            self._finished = True
            self._release_all()
            raise item
        entry: _Entry = item
        self._open.append(entry)
        self._tell_stop(entry.stop)
        if entry is plan.record_entry:
            self.inputs.recording = self
        self.inputs.current = self
        self._live.append(entry)
        self._taken_in_step += 1
        # the batches this step took, and the one a loop may take ahead (of the last step), stay registered (at most
        # _STEP_BATCHES_KEPT: a driver that never calls forward_done still lets go of old batches)
        while len(self._live) > max(2, min(self._taken_in_step, _STEP_BATCHES_KEPT) + 1):
            self.inputs.unregister(self._live.popleft())
        if self._copy_stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(entry.copied)
            _record_stream(entry.batch, current)
        return entry.batch

    def _count_unused(self) -> None:
        """unused[taken]: the batches handed out so far that no collection took (held: the cond lock)."""
        while self._open and (self._open[0].claimed or len(self._open) > _STEP_BATCHES_KEPT):
            self._unused += not self._open.popleft().claimed  # one never taken by now is counted for good
        if self._sized is None:  # (sized: no agreement carries it)
            self._unused_at[self.taken] = self._unused + sum(not e.claimed for e in self._open)

    def _resolve(self, k: int) -> None:
        """Batch k is claimed or passed over (in batch order; held: the cond lock): batch k+1's exchange carries it."""
        if self._stepped and k > self._resolved:
            self._claims_at[k], self._resolved = self._claims, k
            self._cond.notify_all()

    def _tell_stop(self, ranks: dict[int, int]) -> None:
        if ranks and self.stop_signal is not None:
            self.stop_signal[1](ranks)

    def claim(self, module, features, entry: _Entry, path: tuple) -> ShardedBatch | None:
        if not entry.claimed:
            with self._cond:
                entry.claimed = True
                self._claims += 1
                self._resolve(entry.index)
        plan = self.plan
        if plan.record_next and not plan.final.is_set() and self.inputs.recording is self:
            # this batch's step records the plan. No batch is routed ahead before the plan is final, and the
            # feeder, which routes this one once it is (it has not yet), leaves it alone: it is routed here
            plan.record_next = False
            plan.record_entry = entry
            entry.in_step = True
        if entry is plan.record_entry and not plan.final.is_set():
            plan.record(module, path)
            self.stats["routed_in_step"] += 1
            return None  # the first batch routes in the step, as in the plain loop
        plan.finalize(self.inputs)
        if (module, path) not in plan.routes:
            self.stats["routed_in_step"] += 1
            return None
        self._wait_routed(entry)
        if entry.error is not None:
            raise entry.error
        if entry.in_step:
            self.stats["routed_in_step"] += 1
            return None
        routed = entry.routed[(module, path)]
        if self._dist_stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(entry.routed_event)
            if entry.prefetched is not None:
                current.wait_event(entry.prefetched)
            _record_stream(routed, current)
        self.stats["routed_ahead"] += 1
        return routed

    def _wait_routed(self, entry: _Entry) -> None:
        while not entry.ready.wait(1.0):
            if not self._feeding() and not entry.ready.is_set():
                raise RuntimeError("lightning_rec pipeline: the feeder thread ended before routing this batch")

    def prefetch(self, batch: Any, stream: torch.cuda.Stream | None) -> None:
        """prefetch: `batch`'s routed ids (waited for) fill its collections' fused_uvm_caching caches now, on `stream`
        (GPU: the prefetch stream, after the routing; the lookups' stream waits for it when the step claims the batch).
        A batch routed in its step (or whose routing failed: the step raises) is left to its lookups."""
        reg = self.inputs.registered(_follow(batch, self.plan.routes[0][1])) if self.plan.routes else None
        if reg is None or reg.entry.feeder is not self:
            return
        entry = reg.entry
        self._wait_routed(entry)
        if entry.error is not None or entry.in_step:
            return
        if stream is None:
            for (module, _), routed in entry.routed.items():
                module.prefetch(routed)
            return
        forward = torch.cuda.current_stream(self.device)
        stream.wait_event(entry.routed_event)
        with torch.cuda.stream(stream):
            for (module, _), routed in entry.routed.items():
                _record_stream(routed, stream)
                module.prefetch(routed, forward)
        entry.prefetched = torch.cuda.Event()
        entry.prefetched.record(stream)

    def forward_done(self) -> None:
        """The step's forward has run: the recording (if any) is complete; later calls are no input of this pass."""
        plan = self.plan
        if not plan.final.is_set() and self.inputs.recording is self:
            if plan.routes or plan.not_pipelined:
                plan.finalize(self.inputs)
            else:
                # the step called no collection: the next step that calls one records the plan (the same on every
                # rank: a step that skips the sharded collections on one rank only would hang the plain loop too)
                plan.record_entry, plan.record_next = None, True
        self._taken_in_step = 0
        if self.inputs.current is self:
            self.inputs.current = None

    def stop_soon(self) -> None:
        """Let the thread end once idle (at the same point on every rank); no join."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def close(self, keep_unused: bool = False) -> list:
        """Stop after the batches every rank's feeder is allowed to start (the same everywhere); join.

        keep_unused: return the batches read ahead that no step took, else drop them."""
        self.stop_soon()
        timeout = max((c.timeout_s or 0.0) for c in self.channels.values()) if self.channels else 0.0
        if self._thread is not None:
            self._thread.join(timeout + 30.0)
        peeked, self._peeked = self._peeked, None
        with self._cond:
            taken = [peeked] if peeked is not None and peeked is not _END else []
            queued = [item.batch for item in self._queue if isinstance(item, _Entry)]
            unused = taken + queued + self._held if keep_unused else []
            self._held = []
        self._finished = True
        self._release_all()
        return unused

    def _release_all(self) -> None:
        while self._live:
            self.inputs.unregister(self._live.popleft())
        with self._cond:
            for item in self._queue:
                if isinstance(item, _Entry):
                    self.inputs.unregister(item)
            self._queue.clear()
        if self.inputs.recording is self:
            self.inputs.recording = None
        if self.inputs.current is self:
            self.inputs.current = None

    def _feeding(self) -> bool:
        """Can a batch still come: the feeder thread runs (inline: the step's thread feeds, never waits for one)."""
        return self._thread is not None and self._thread.is_alive()

    def _feed_inline(self) -> None:
        """inline: batch `taken`'s read, copy, agreement and routing, in the step's thread (its turn is now); what the
        feeder thread would put (the entry, the end, an error) is put for `_take`."""
        k, exhausted = self._inline_at
        channel = next(iter(self.channels.values()), None)
        try:
            with torch.no_grad():
                _, exhausted = self._feed_one(k, exhausted, channel)
        except BaseException as e:  # noqa: BLE001 - raised by _take, as the thread's would be
            self._put(e)
        self._inline_at = (k + 1, exhausted)

    # feeder thread -------------------------------------------------------------------------------

    def _put(self, item: Any) -> None:
        with self._cond:
            self._queue.append(item)
            self._cond.notify_all()

    def _may_start(self, k: int) -> bool:
        """Wait until batch k may start (k < taken + depth); False when stopped while waiting."""
        with self._cond:
            while k >= self.taken + self.config.depth:
                if self._stop:
                    return False
                self._cond.wait()
            return True

    def _wait_turn(self, k: int) -> bool:
        """in_step_order: wait until the step's thread waits for batch k; False when stopped first."""
        with self._cond:
            while self._turn < k:
                if self._stop:
                    return False
                self._cond.wait()
            return True

    def _wait_plan(self, k: int) -> bool | None:
        """Wait until the plan is recorded before routing batch k. False: stopped. None: the step's thread took batch
        k and waits for the next one while the recording step still runs (a step that takes several batches before
        its forward): batch k routes in the step. The same on every rank: only the step's thread ends a recording,
        and it is waiting, having set the plan (or not) before."""
        while not self.plan.final.wait(0.02):
            with self._cond:
                if self._stop:
                    return False
                if self._waiting and self.taken > k and not self.plan.final.is_set():
                    return None
        return True

    def _run(self) -> None:
        try:
            if self._copy_stream is not None:
                torch.cuda.set_device(self.device)
            with torch.no_grad():
                self._feed()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, raised there
            self._put(e)

    def _feed(self) -> None:
        k, exhausted, going = 0, False, True
        channel = next(iter(self.channels.values()), None)
        while going and self._may_start(k):
            going, exhausted = self._feed_one(k, exhausted, channel)
            k += 1

    def _feed_one(self, k: int, exhausted: bool, channel) -> tuple[bool, bool]:
        """Batch k read, copied, agreed on and handed out (routed ahead once the plan is known). (whether the pass goes
        on, whether the source is exhausted)"""
        batch, error, exhausted = self._read(exhausted, k, channel)
        if self._sized is not None and k >= self._sized:  # every rank's agreed length: the pass ends for all here
            if error is not None:  # (read all the same: the loader notes the end of its pass, as in the plain loop)
                raise error
            if batch is not None:
                warnings.warn(f"rank {channel.rank}: the dataloader gave more than its length ({self._sized}) of "
                              f"batches; the rest are skipped, as every rank's pass ends at that length. Give it a "
                              f"length that its iteration keeps (len(batch_sampler))", stacklevel=3)
            self._put(_END)
            return False, True
        if self._sized is not None and error is None and batch is None:
            error = ValueError(f"rank {channel.rank}: the dataloader ended after {k} batches, but its length "
                               f"said {self._sized}: give it a length that its iteration keeps (len(batch_sampler))")
        if self._ordered:
            if batch is not None and error is None:
                batch = self._copy(batch)  # the copy (and pinning) stays ahead of the turn
            if not self._wait_turn(k):
                if batch is not None and error is None:
                    self._held.append(batch)  # read from the source: close(keep_unused) hands it back
                return False, exhausted
        if self._sized is not None:  # sized: no agreement (as in the plain loop, an error is this rank's)
            if error is not None:
                raise error
            missing, failed, stopping = [], [], {}
        else:
            missing, failed, stopping = self._agree(channel, batch, error, k)
        if failed:
            if error is not None:
                raise error
            raise RuntimeError(f"the dataloader of rank(s) {failed} raised (or gave None) at batch {k} (see the "
                               f"error on those ranks); this rank stopped there too")
        if missing and self.pad is not None and channel is not None and len(missing) < channel.world_size:
            if batch is None:  # evaluation: this rank ran out, another has not: step on with an empty batch
                batch = self._copy(self.pad()) if self._ordered else self.pad()
        elif missing:
            self._end_early(channel, batch, stopping)
            return False, exhausted
        return self._hand_out(k, batch, stopping), exhausted

    def _read(self, exhausted: bool, k: int, channel) -> tuple[Any, BaseException | None, bool]:
        """(the source's next batch or None, the error it raised or None, whether it is exhausted)."""
        if exhausted:
            return None, None, True
        try:
            batch = next(self.source)
        except StopIteration:
            return None, None, True
        except Exception as e:  # noqa: BLE001 - every rank must hear of it first
            return None, e, False
        if batch is None:  # not the end of the data (that is StopIteration): a batch lost on this rank alone
            return None, ValueError(
                f"rank {channel.rank if channel is not None else 0}: the dataloader gave None as batch {k} (a "
                f"collate_fn that returns None for a bad batch?), which every rank would have to skip together: "
                f"drop the bad rows in the dataset or collate_fn and return the rest (a batch of 0 rows is fine), "
                f"or raise"), False
        return batch, None, False

    def _agree(self, channel, batch, error, k: int) -> tuple[list[int], list[int], dict[int, int]]:
        """The ranks without a batch, the ranks whose loader raised, and the signals sent: agreed by every rank. Ranks
        whose steps left different numbers of batches unused raise CollectiveMismatch."""
        stop = int(self.stop_signal[0]()) if self.stop_signal is not None else 0
        if channel is None:
            return ([0] if batch is None and error is None else []), ([0] if error else []), ({0: stop} if stop else {})
        at = k if self._ordered else k - self.config.depth  # the step's thread asked for that batch before this one
        with self._cond:
            unused = self._unused_at.pop(at, 0)
        length = -1 if k or self._length is None else self._length
        missing, failed, stops, unused_R, lengths = channel.agree(batch is None and error is None, error is not None,
                                                                  self._dist_stream, stop=stop, unused=unused,
                                                                  length=length)
        if k == 0 and self.stop_signal is None and lengths[0] >= 0 and len(set(lengths)) == 1:
            self._sized = lengths[0]
        if len(set(unused_R)) > 1:
            where = ", ".join(f"rank {r}: {n}" for r, n in enumerate(unused_R))
            raise CollectiveMismatch(
                f"the ranks' steps left different numbers of batches unused by batch {at} ({where}): a step that "
                f"raised before its embedding exchanges on some ranks only, and a loop that went on (a try/except "
                f"around pipeline.progress()), pairs those ranks' exchanges with the others' previous step. Let "
                f"the error propagate on every rank, or skip that batch on every rank")
        return missing, failed, stops

    def _end_early(self, channel, batch, stopping: dict[int, int]) -> None:
        """A rank ran out: the pass ends for every rank here (this rank's unused batch is said to be skipped)."""
        if batch is not None:
            warnings.warn(f"rank {channel.rank if channel else 0}: the rest of this epoch's batches are "
                          f"skipped: another rank's dataloader ran out first, and sharded embeddings need "
                          f"every rank in every step. Give every rank the same number of batches (e.g. "
                          f"drop_last, or an even split) to use them all" + _EVALUATION_FIX * self.evaluating,
                          stacklevel=3)
        self._end_stop = stopping
        self._put(_END)

    def _hand_out(self, k: int, batch, stopping: dict[int, int]) -> bool:
        """Batch k to the loop, routed ahead once the plan is known; False when the pipeline stopped meanwhile."""
        entry = self._entry(k, batch) if self._ordered else self._prepare(k, batch)
        entry.stop = stopping
        recording = k == 0 and self.plan.record_entry is None and not self.plan.final.is_set()
        if recording:
            self.plan.record_entry = entry  # the recording batch: routed in the step
            entry.ready.set()
        if self._ordered and not recording:  # routed in its turn, then handed out
            if self.plan.final.is_set():
                self._step_of(entry)  # (its turn came: the step's thread asked for it, so it never waits)
                self._route(entry, put_on_error=True)
            else:  # the plan is still being recorded (a loop that takes a batch ahead): route it in the step
                entry.in_step = True
                entry.ready.set()
        self._put(entry)  # unordered: the loop may take it now; its routing follows
        if recording or self._ordered:
            return True
        waited = self._wait_plan(k)
        if waited is False:
            entry.error = RuntimeError("lightning_rec pipeline: stopped before this batch was routed")
            entry.ready.set()
            return False
        if waited is None:
            entry.in_step = True
            entry.ready.set()
        elif not self._step_of(entry):
            entry.error = RuntimeError("lightning_rec pipeline: stopped before this batch was routed")
            entry.ready.set()
            return False
        else:
            self._route(entry)
        return True

    def _step_of(self, entry: _Entry) -> bool:
        """Wait until the step's thread claimed or passed over the previous batch; False when stopped first."""
        if not self._stepped or entry.index == 0:
            return True
        with self._cond:
            while entry.index - 1 not in self._claims_at:
                if self._stop:
                    return False
                self._cond.wait()
            entry.step = self._claims_at.pop(entry.index - 1)
            return True

    def _prepare(self, k: int, batch: Any) -> _Entry:
        return self._entry(k, self._copy(batch))

    def _copy(self, batch: Any) -> Any:
        """The batch on the device (GPU: on the copy stream, from pinned memory; `_entry` records the event)."""
        if self._copy_stream is None:
            return self.to_device(batch)
        batch = _pinned(batch)
        with torch.cuda.stream(self._copy_stream):
            return self.to_device(batch)

    def _entry(self, k: int, batch: Any) -> _Entry:
        entry = _Entry(k, batch, self)
        if self._copy_stream is not None:
            entry.copied = torch.cuda.Event()
            entry.copied.record(self._copy_stream)
            _record_stream(batch, self._copy_stream)
        return self._register(entry)

    def _register(self, entry: _Entry) -> _Entry:
        self.inputs.register(entry)
        return entry

    def _route(self, entry: _Entry, put_on_error: bool = False) -> None:
        if entry.in_step:  # its step recorded the plan (claim): routed there already
            entry.ready.set()
            return
        try:
            if self._dist_stream is None:
                self._route_all(entry)
            else:
                self._dist_stream.wait_event(entry.copied)
                with torch.cuda.stream(self._dist_stream):
                    _record_stream(entry.batch, self._dist_stream)
                    self._route_all(entry)
                entry.routed_event = torch.cuda.Event()
                entry.routed_event.record(self._dist_stream)
        except BaseException as e:
            entry.error = e  # a bad batch: the same ValueError on every rank (input_dist agrees first)
            entry.ready.set()
            if put_on_error:  # handed out all the same: the step raises it where the plain loop would
                self._put(entry)
            raise
        entry.ready.set()

    def _route_all(self, entry: _Entry) -> None:
        for module, path in self.plan.routes:
            kjt = _follow(entry.batch, path)
            if kjt is None:
                raise ValueError(f"batch {entry.index} has no KeyedJaggedTensor at {path_name(path)}, where the "
                                 f"first batch had the input of '{self.inputs.names[module]}': give every batch "
                                 f"the same layout")
            channel = self.channels[id(module.env)]
            entry.routed[(module, path)] = module.route(kjt, channel.ids_all_to_all(module), ahead=True,
                                                      step=entry.step)
