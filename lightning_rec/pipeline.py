"""TrainPipelineSparseDist: the next batch is read, copied and routed while this one computes.

Legend: i the batch the step computes, K the depth (batches routed ahead, 1 by default).

    feeder thread (one per pass over a loader)          main thread (the step)
      read batch i+1 from the loader                      batch i: lookup (fused TBE) ->
      agree: does every rank have one? (tiny all-reduce)  output_dist -> dense forward ->
      copy to the device (GPU: side stream, pinned)       backward (fused update inside) ->
      input_dist(i+1): check, route, ids all-to-all       optimizer.step
        (GPU: on its own stream; always over the
         pipeline's own channel)

So the loader, the host-to-device copy and the id routing (its local work and its all-to-all)
leave the step's critical path. Batches come out in order; the last ones are drained. Under
RecStrategy, "copy" is Lightning's three batch hooks (strategy.py `_batch_hooks_for`), so the ids
routed are those of the batch the hooks return.

No tracing. The first batch of a pipeline runs plainly while the pipeline records which input each
sharded collection is called with: a KeyedJaggedTensor found, by identity, inside the batch (a
dataclass field, a dict entry, a tuple item, ...) gets a path such as `batch.sparse_features`.
From the next batch on, the feeder routes the KJT at each recorded path for its collection, and the
collection's `input_dist` hands that result back when it is called with that very object. Whatever
Python the forward runs around the embeddings does not matter. A collection called with a KJT
that is not in the batch (computed inside the model) cannot be routed ahead: the pipeline says so
once, naming the collection and the reason, and that collection routes its ids inside the step, as
in the plain loop (the others stay pipelined).

Agreement, and why nothing hangs (each channel also waits through a CollectiveGuard of its own, in a
slot of its own: a peer that exits is named within seconds, a timeout names the model's setting).
Each channel carries the same collectives in the same order on every rank: the step's run on the
model's channel (main thread), the feeder's on the pipeline's own (a second process group, plus a
second shared-memory group on CPU). The feeder starts batch k only while k < taken + K (taken:
batches the loop has taken), the same on every rank, so whenever a pass stops (end of data, an
exception in the step, a loop cut short) every rank's feeder has run the same collectives and stops
at the same point. A rank whose loader ends first ends the pass for all (the step-together rule of
strategy.py); a batch whose features do not match raises the same ValueError on every rank at that
batch; an exception in one rank's loader stops every rank there.

Variants are a field (`PipelineConfig.variant`), not subclasses: "sparse_dist" runs read, copy and
input_dist ahead (TorchRec's TrainPipelineSparseDist). A semi-synchronous variant would add the
next batch's lookup to the feeder's stages (embeddings one update stale); a fused-lookup one would
start the lookup from the routed ids in the same stage: another entry of `_STAGES_AHEAD`.

GPU (written against torch 2.11-2.13's stream API, not yet run on a GPU): the copy runs on a side
stream from pinned memory (pinned here when the loader did not), input_dist on a second stream that
waits for the copy's event; the step's stream waits for each event before using a batch or its
routed ids, and every tensor crossing streams is `record_stream`-ed so the caching allocator keeps
it until the step is done. The feeder's all-to-alls are NCCL calls on the pipeline's own
communicator, issued from the feeder thread while the step's run on the model's: to be checked for
overlap (and for NCCL's rule on concurrent communicators) on real GPUs.

Memory: with depth K the step holds 1 + K batches' routed ids (Lightning's loop takes one more
batch ahead: 2 + K); the planner counts them (`planner.CostModel(pipelined=K)`).
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_rec.collective_guard import CollectiveGuard, CollectiveMismatch, CollectiveTimeout, PeerExited, guard_of
from lightning_rec.sharded_embedding import ShardedBatch, _ShardedCollectionBase
from lightning_rec.shm_transport import SharedMemoryGroup
from lightning_rec.sparse import KeyedJaggedTensor

_STAGES_AHEAD = {"sparse_dist": ("read", "copy", "input_dist")}
_SEARCH_DEPTH = 4  # how deep inside a batch a KJT is looked for


@dataclass(frozen=True)
class PipelineConfig:
    """depth: batches routed ahead of the step (1: batch i+1 while i computes). variant: see the module doc."""

    depth: int = 1
    variant: str = "sparse_dist"

    def __post_init__(self) -> None:
        if self.variant not in _STAGES_AHEAD:
            raise ValueError(f"PipelineConfig(variant={self.variant!r}): choose one of {sorted(_STAGES_AHEAD)}")
        if int(self.depth) < 1:
            raise ValueError(f"PipelineConfig(depth={self.depth}): use depth >= 1 (batches routed ahead)")

    @classmethod
    def of(cls, value: bool | int | dict | PipelineConfig | None) -> PipelineConfig | None:
        """What RecStrategy(pipeline=...) and recipes accept: False/None (off), True, a depth, a dict."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, PipelineConfig):
            return value
        if isinstance(value, int):
            return cls(depth=value)
        if isinstance(value, dict):
            return cls(**value)
        raise ValueError(f"pipeline={value!r}: use True/False, a depth (int), a dict of PipelineConfig fields, "
                         f"or a PipelineConfig")


# where a batch keeps its KJTs ----------------------------------------------------------------------


def find_kjts(batch: Any) -> list[tuple[KeyedJaggedTensor, tuple]]:
    """Every KeyedJaggedTensor inside `batch` with its path (("attr", name) / ("item", key) steps)."""
    out: list[tuple[KeyedJaggedTensor, tuple]] = []

    def visit(obj: Any, path: tuple, depth: int) -> None:
        if isinstance(obj, KeyedJaggedTensor):
            out.append((obj, path))
            return
        if depth >= _SEARCH_DEPTH or obj is None or isinstance(obj, (Tensor, str, bytes, int, float, bool, nn.Module)):
            return
        if isinstance(obj, dict):
            items = [(("item", k), v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple)):
            items = [(("item", i), v) for i, v in enumerate(obj)]
        elif dataclasses.is_dataclass(obj):
            items = [(("attr", f.name), getattr(obj, f.name)) for f in dataclasses.fields(obj)]
        elif hasattr(obj, "__dict__"):
            items = [(("attr", k), v) for k, v in vars(obj).items()]
        else:
            return
        for step, value in items:
            visit(value, path + (step,), depth + 1)

    visit(batch, (), 0)
    return out


def path_name(path: tuple) -> str:
    return "batch" + "".join(f".{k}" if kind == "attr" else f"[{k!r}]" for kind, k in path)


def _walk_tensors(obj: Any, fn: Callable[[Tensor], None], depth: int = 0) -> None:
    """fn(t) for every tensor inside obj (batches, KJTs, routed batches): for CUDA stream bookkeeping."""
    if isinstance(obj, Tensor):
        fn(obj)
    elif depth > 6 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk_tensors(v, fn, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk_tensors(v, fn, depth + 1)
    elif hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            _walk_tensors(v, fn, depth + 1)
    elif hasattr(obj, "__slots__"):
        for name in obj.__slots__:
            _walk_tensors(getattr(obj, name, None), fn, depth + 1)


def _record_stream(obj: Any, stream) -> None:
    """The caching allocator must not hand these blocks out again until `stream` is done with them."""
    _walk_tensors(obj, lambda t: t.record_stream(stream) if t.is_cuda else None)


def move_to_device(batch: Any, device: torch.device) -> Any:
    """batch.to(device, non_blocking=True) when it has one, else each tensor inside (dict/list/tuple)."""
    if callable(getattr(batch, "to", None)):
        try:
            return batch.to(device, non_blocking=True)
        except TypeError:
            return batch.to(device)
    if isinstance(batch, dict):
        return type(batch)((k, move_to_device(v, device)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: move_to_device(getattr(batch, f.name), device)
                                             for f in dataclasses.fields(batch) if f.init})
    return batch


def _pinned(batch: Any) -> Any:
    """A pinned copy of a host batch (the side-stream copy needs pinned memory to be asynchronous)."""
    found: list[Tensor] = []
    _walk_tensors(batch, found.append)
    if not found or all(t.is_cuda or t.is_pinned() for t in found):
        return batch
    if callable(getattr(batch, "pin_memory", None)):
        return batch.pin_memory()
    return batch  # nothing we know how to pin: the copy is synchronous with the host, still off the step


# the pipeline's own channel ----------------------------------------------------------------------


class _Channel:
    """The feeder's collectives: a process group of its own (+ a shared-memory group when the model uses one).

    Its own group, so the feeder's all-to-alls never interleave with the step's (each channel keeps
    one order on every rank). Built collectively; kept in a pool on the collections' ShardingEnv.
    """

    def __init__(self, env) -> None:
        ranks = dist.get_process_group_ranks(env.pg)
        timeout = None if env.timeout_s is None else timedelta(seconds=env.timeout_s)
        self.pg = dist.new_group(ranks=ranks, backend=dist.get_backend(env.pg), timeout=timeout)
        self.transport = SharedMemoryGroup.create(self.pg, env.timeout_s) if env.transport is not None else None
        self.comm = self.transport if self.transport is not None else self.pg
        # under a guard of its own, as the model's collectives are (collective_guard.py): a peer that
        # exited is named, a timeout names the model's setting; its entries live in their own slot,
        # since the feeder thread waits while the step's thread may wait elsewhere
        model_guard = guard_of(env.pg, enabled_only=False)
        setting = model_guard.setting if model_guard is not None else "DistributedModelParallel(timeout=...)"
        self.guard = CollectiveGuard(self.pg, "pipeline", env.timeout_s or 1800.0, setting,
                                     enabled=model_guard.enabled if model_guard is not None else None,
                                     slot="pipeline")
        if self.transport is not None:
            self.transport.timeout_setting = setting
            self.transport.guard = self.guard if self.guard.enabled else None
        self.rank, self.world_size = env.rank, env.world_size
        self.device, self.timeout_s = env.device, env.timeout_s
        self._a2a: dict[int, Any] = {}

    def ids_all_to_all(self, module: _ShardedCollectionBase):
        a2a = self._a2a.get(id(module))
        if a2a is None:
            a2a = self._a2a[id(module)] = module.ids_all_to_all(self.comm)
        return a2a

    def agree(self, missing: bool, failed: bool) -> tuple[list[int], list[int]]:
        """Collective: the ranks without a batch, and the ranks whose loader raised."""
        status = torch.zeros(2, self.world_size, dtype=torch.int64)
        status[0, self.rank], status[1, self.rank] = int(missing), int(failed)
        tag = "pipeline: every rank has a batch"
        try:
            if self.transport is not None:
                self.transport.all_reduce_sum_(status, tag=tag)
            else:
                on_device = status.to(self.device)
                k = self.guard.begin()
                self.guard.wait_work(dist.all_reduce(on_device, group=self.pg, async_op=True), tag, k)
                status = on_device.cpu()
        except (CollectiveMismatch, CollectiveTimeout, PeerExited):
            raise  # they name the ranks and the setting already
        except RuntimeError as e:
            raise RuntimeError(f"pipeline: rank {self.rank} could not agree with its peers on the next batch: a peer "
                               f"exited or did not answer within the timeout ({self.timeout_s} s). Cause: {e}") from e
        missing_r, failed_r = status.tolist()
        return [r for r, m in enumerate(missing_r) if m], [r for r, f in enumerate(failed_r) if f]

    @staticmethod
    def acquire(env) -> _Channel:
        """A free channel of `env`'s pool, else a new one (collective). Deterministic on every rank."""
        pool = env.__dict__.setdefault("_pipeline_channels", [])
        return pool.pop() if pool else _Channel(env)

    @staticmethod
    def release(env, channel: _Channel) -> None:
        env.__dict__.setdefault("_pipeline_channels", []).append(channel)


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
        self.current: _Feeder | None = None  # the feeder that handed out the last batch
        for m in self.modules:
            m._input_source = self.claim

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

    def owns(self, batch: Any) -> bool:
        """Was `batch` handed out by a feeder (so it is on the device already)?"""
        with self._lock:
            return self._batches.get(id(batch)) is batch

    def claim(self, module: _ShardedCollectionBase, features: KeyedJaggedTensor) -> ShardedBatch | None:
        """The sharded collections' input source: a routed batch, or None (route it in the step)."""
        with self._lock:
            reg = self._registered.get(id(features))
        if reg is None or reg.kjt is not features:
            if self.current is not None:
                self.current.stats["routed_in_step"] += 1
            recording = self.recording
            if recording is not None:
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
    __slots__ = ("index", "batch", "kjts", "routed", "ready", "error", "copied", "routed_event", "feeder")

    def __init__(self, index: int, batch: Any, feeder: _Feeder) -> None:
        self.index, self.batch, self.feeder = index, batch, feeder
        self.kjts = find_kjts(batch)
        self.routed: dict[tuple, ShardedBatch] = {}
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.copied = None  # CUDA events (GPU only)
        self.routed_event = None


_END = object()


class _Feeder(Iterator):
    """Iterates `source` with the feeder thread working ahead; yields the batches, on the device, in order."""

    def __init__(self, source: Iterator, inputs: _Inputs, plan: _Plan, channels: dict, device: torch.device,
                 config: PipelineConfig, to_device: Callable[[Any], Any], stats: dict[str, int]) -> None:
        self.source, self.inputs, self.plan, self.channels = source, inputs, plan, channels
        self.stats = stats
        self.device, self.config, self.to_device = device, config, to_device
        self.taken = 0
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._finished = False
        self._live: deque[_Entry] = deque()  # entries handed out, still registered
        cuda = device.type == "cuda" and torch.cuda.is_available()
        self._copy_stream = torch.cuda.Stream(device) if cuda else None
        self._dist_stream = torch.cuda.Stream(device) if cuda else None
        self._thread = threading.Thread(target=self._run, name="lightning_rec-pipeline-feeder", daemon=True)
        self._thread.start()

    # main thread ---------------------------------------------------------------------------------

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        plan = self.plan
        if not plan.final.is_set() and plan.record_entry is not None and self.taken >= plan.record_entry.index + 2:
            plan.finalize(self.inputs)  # the recording step is over (a loop takes at most one batch ahead)
        with self._cond:
            while not self._queue:
                if not self._thread.is_alive() and not self._queue:
                    break
                self._cond.wait(1.0)
            item = self._queue.popleft() if self._queue else RuntimeError(
                "lightning_rec pipeline: the feeder thread ended without a result")
            if isinstance(item, _Entry):
                self.taken += 1
                self._cond.notify_all()
        if item is _END:
            self._finished = True
            self._release_all()
            raise StopIteration
        if isinstance(item, BaseException):
            self._finished = True
            self._release_all()
            raise item
        entry: _Entry = item
        if entry is plan.record_entry:
            self.inputs.recording = self
        self.inputs.current = self
        self._live.append(entry)
        while len(self._live) > 2:  # this step's batch and the one a loop may take ahead stay registered
            self.inputs.unregister(self._live.popleft())
        if self._copy_stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(entry.copied)
            _record_stream(entry.batch, current)
        return entry.batch

    def claim(self, module, features, entry: _Entry, path: tuple) -> ShardedBatch | None:
        plan = self.plan
        if entry is plan.record_entry and not plan.final.is_set():
            plan.record(module, path)
            self.stats["routed_in_step"] += 1
            return None  # the first batch routes in the step, as in the plain loop
        plan.finalize(self.inputs)
        if (module, path) not in plan.routes:
            self.stats["routed_in_step"] += 1
            return None
        while not entry.ready.wait(1.0):
            if not self._thread.is_alive() and not entry.ready.is_set():
                raise RuntimeError("lightning_rec pipeline: the feeder thread ended before routing this batch")
        if entry.error is not None:
            raise entry.error
        routed = entry.routed[(module, path)]
        if self._dist_stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(entry.routed_event)
            _record_stream(routed, current)
        self.stats["routed_ahead"] += 1
        return routed

    def forward_done(self) -> None:
        """The step's forward has run: the recording (if any) is complete."""
        if not self.plan.final.is_set() and self.inputs.recording is self:
            self.plan.finalize(self.inputs)

    def stop_soon(self) -> None:
        """Let the thread end once idle (at the same point on every rank); no join."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def close(self) -> None:
        """Stop after the batches every rank's feeder is allowed to start (the same everywhere); join."""
        self.stop_soon()
        timeout = max((c.timeout_s or 0.0) for c in self.channels.values()) if self.channels else 0.0
        self._thread.join(timeout + 30.0)
        self._finished = True
        self._release_all()

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

    def _wait_plan(self) -> bool:
        while not self.plan.final.wait(0.2):
            with self._cond:
                if self._stop:
                    return False
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
        k = 0
        channel = next(iter(self.channels.values()), None)
        while self._may_start(k):
            batch, error = None, None
            try:
                batch = next(self.source)
            except StopIteration:
                pass
            except Exception as e:  # noqa: BLE001 - every rank must hear of it first
                error = e
            if channel is not None:
                missing, failed = channel.agree(batch is None and error is None, error is not None)
            else:
                missing, failed = ([0] if batch is None and error is None else []), ([0] if error else [])
            if failed:
                if error is not None:
                    raise error
                raise RuntimeError(f"the dataloader of rank(s) {failed} raised at batch {k} (see the error on those "
                                   f"ranks); this rank stopped there too")
            if missing:
                if batch is not None:
                    warnings.warn(f"rank {channel.rank if channel else 0}: the rest of this epoch's batches are "
                                  f"skipped: another rank's dataloader ran out first, and sharded embeddings need "
                                  f"every rank in every step. Give every rank the same number of batches (e.g. "
                                  f"drop_last, or an even split) to use them all", stacklevel=2)
                self._put(_END)
                return
            entry = self._prepare(k, batch)
            recording = k == 0 and self.plan.record_entry is None and not self.plan.final.is_set()
            if recording:
                self.plan.record_entry = entry  # the recording batch: routed in the step
                entry.ready.set()
            self._put(entry)  # the loop may take it now; its routing follows
            if recording:
                pass
            elif not self._wait_plan():
                entry.error = RuntimeError("lightning_rec pipeline: stopped before this batch was routed")
                entry.ready.set()
                return
            else:
                self._route(entry)
            k += 1

    def _prepare(self, k: int, batch: Any) -> _Entry:
        if self._copy_stream is None:
            return self._register(_Entry(k, self.to_device(batch), self))
        batch = _pinned(batch)
        with torch.cuda.stream(self._copy_stream):
            batch = self.to_device(batch)
        entry = _Entry(k, batch, self)
        entry.copied = torch.cuda.Event()
        entry.copied.record(self._copy_stream)
        _record_stream(batch, self._copy_stream)
        return self._register(entry)

    def _register(self, entry: _Entry) -> _Entry:
        self.inputs.register(entry)
        return entry

    def _route(self, entry: _Entry) -> None:
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
            entry.routed[(module, path)] = module.route(kjt, channel.ids_all_to_all(module))


def _follow(batch: Any, path: tuple) -> KeyedJaggedTensor | None:
    obj = batch
    try:
        for kind, key in path:
            obj = getattr(obj, key) if kind == "attr" else obj[key]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
    return obj if isinstance(obj, KeyedJaggedTensor) else None


# the two ways in: a hand loop, and Lightning's loops -----------------------------------------------


class InputPipeline:
    """The parts a pipeline over one model needs: its channels, its plan, one feeder per pass.

    TrainPipelineSparseDist drives it from a hand loop; RecStrategy(pipeline=True) builds one per
    dataloader of Lightning's loops (lightning_rec.pipeline.wrap_loader).
    """

    def __init__(self, model: nn.Module, device: torch.device | str, config: PipelineConfig | None = None,
                 to_device: Callable[[Any], Any] | None = None) -> None:
        self.config = config or PipelineConfig()
        self.device = torch.device(device)
        self.inputs = _Inputs.of(model)
        self.to_device = to_device or (lambda b: move_to_device(b, self.device))
        self.plan = _Plan()
        self.channels: dict[int, _Channel] = {}
        for env in self.inputs.envs():  # collective: every rank builds its pipelines in the same order
            self.channels[id(env)] = _Channel.acquire(env)
        self._envs = {id(e): e for e in self.inputs.envs()}
        self.feeder: _Feeder | None = None
        self.closed = False
        # inputs the step received already routed / routed itself (the first batch, unpipelined collections)
        self.stats = {"routed_ahead": 0, "routed_in_step": 0}

    def iterate(self, source: Iterator) -> _Feeder:
        """A new pass over `source` (the previous pass, if any, is stopped first)."""
        if self.closed:
            raise ValueError("this pipeline was closed: build a new one (TrainPipelineSparseDist(...))")
        if self.feeder is not None:
            self.feeder.close()
        plan = self.plan
        if not plan.final.is_set() and plan.record_entry is not None:  # the last pass stopped while recording
            if plan.routes or plan.not_pipelined:
                plan.finalize(self.inputs)
            else:
                plan.record_entry = None  # nothing was called: record on this pass
        self.feeder = _Feeder(iter(source), self.inputs, self.plan, self.channels, self.device, self.config,
                              self.to_device, self.stats)
        return self.feeder

    def owns(self, batch: Any) -> bool:
        return self.inputs.owns(batch)

    def forward_done(self) -> None:
        if self.feeder is not None:
            self.feeder.forward_done()

    def close(self) -> None:
        """Stop the feeder and give the channels back (call it at the same point on every rank)."""
        if self.closed:
            return
        if self.feeder is not None:
            self.feeder.close()
            self.feeder = None
        for key, channel in self.channels.items():
            _Channel.release(self._envs[key], channel)
        self.channels = {}
        self.closed = True

    def __del__(self) -> None:
        # let go without close(): the thread ends when idle; the channels are not reused (a garbage
        # collector's timing differs between ranks, and channels must be handed out in one order)
        feeder = getattr(self, "feeder", None)
        if feeder is not None:
            try:
                feeder.stop_soon()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


class TrainPipelineSparseDist:
    """TorchRec's pipeline for hand-written loops, without tracing.

        pipeline = TrainPipelineSparseDist(dmp, optimizer, device)
        it = iter(dataloader)
        while True:
            try:
                output = pipeline.progress(it)   # one step: batch i computes, batch i+1 is routed
            except StopIteration:
                break

    `model(batch)` returns `(loss, output)`; in training mode `progress` runs zero_grad, forward,
    `loss.sum().backward()` and `optimizer.step()`, and returns `output`. With the model in eval
    mode (or optimizer=None) it runs the forward only, without gradients. Batches come out in
    order; StopIteration comes once every batch is done. A new iterator starts a new pass. Build,
    close (or let go) and rebuild pipelines over the same model freely; the plain loop
    (`model(batch)` yourself) works in between.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device | str,
                 config: PipelineConfig | None = None) -> None:
        self._model = model
        self._optimizer = optimizer
        self._pipeline = InputPipeline(model, device, config)
        self._source: Iterator | None = None

    def progress(self, dataloader_iter: Iterator) -> Any:
        if self._source is not dataloader_iter or self._pipeline.feeder is None:
            self._pipeline.iterate(dataloader_iter)
            self._source = dataloader_iter
        batch = next(self._pipeline.feeder)  # StopIteration: every batch is done
        training = self._model.training and self._optimizer is not None
        if training:
            self._optimizer.zero_grad()
        with torch.set_grad_enabled(training and torch.is_grad_enabled()):
            losses, output = self._model(batch)
        self._pipeline.forward_done()
        if training:
            torch.sum(losses).backward()
            self._optimizer.step()
        return output

    @property
    def stats(self) -> dict[str, int]:
        """How many collection inputs came routed ahead, and how many were routed inside the step."""
        return dict(self._pipeline.stats)

    def close(self) -> None:
        self._pipeline.close()

    def __enter__(self) -> TrainPipelineSparseDist:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# Lightning: the dataloaders of a pipelined RecStrategy ---------------------------------------------

_PIPELINED_CLASSES: dict[type, type] = {}


def base_loader_class(cls: type) -> type:
    """The loader's own class, under lightning_rec's iteration wrappers (strategy.py swaps classes)."""
    return next(c for c in cls.__mro__ if "_rec_step_together" not in c.__dict__)


def wrap_loader(loader, pipeline: InputPipeline):
    """The loader iterates through `pipeline` (its class swapped for a subclass whose only change is __iter__)."""
    cls = base_loader_class(type(loader))
    sub = _PIPELINED_CLASSES.get(cls)
    if sub is None:
        # `_rec_step_together`: the feeder keeps the ranks stepping together (strategy.py's rule)
        sub = type(f"Pipelined{cls.__name__}", (cls,), {"__iter__": _iter_pipelined, "_rec_step_together": True})
        _PIPELINED_CLASSES[cls] = sub
    loader.__class__ = sub
    loader._rec_pipeline = pipeline
    return loader


def _iter_pipelined(self):
    batches = base_loader_class(type(self)).__iter__(self)
    pipeline: InputPipeline = self._rec_pipeline
    if pipeline.closed:  # the loader went on to a run without this strategy
        return batches
    return pipeline.iterate(batches)
