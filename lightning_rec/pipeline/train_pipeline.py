"""The two ways in: InputPipeline (what RecStrategy drives) and TrainPipelineSparseDist (hand-written loops)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import sys
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_rec._compat import dataloader_batches_left, persistent_iterator_reset
from lightning_rec._device import with_cuda_index
from lightning_rec.comm import agree, get_local_size
from lightning_rec.errors import short_repr
from lightning_rec.fqn import canonical_fqn
from lightning_rec.pipeline.batch import find_kjts, move_to_device
from lightning_rec.pipeline.channel import _Channel
from lightning_rec.pipeline.config import PipelineConfig, choose_read_ahead
from lightning_rec.pipeline.feeder import _Entry, _Feeder, _Inputs, _Plan


class InputPipeline:
    """The parts a pipeline over one model needs: its channels, its plan, one feeder per pass.
    TrainPipelineSparseDist drives it; RecStrategy(pipeline=True) builds one per dataloader (wrap_loader)."""

    def __init__(self, model: nn.Module, device: torch.device | str, config: PipelineConfig | None = None,
                 to_device: Callable[[Any], Any] | None = None) -> None:
        self.config = config or PipelineConfig()
        # "cuda" alone: the current device's index (the feeder thread sets it, and set_device needs one)
        self.device = with_cuda_index(torch.device(device), torch.cuda.current_device,
                                      f"TrainPipelineSparseDist(device={str(device)!r})",
                                      "or give the device the model's tables are on (device='cpu')")
        self.inputs = _Inputs.of(model)
        self.prefetch_stream = self._use_prefetch() if self.config.prefetch else None
        self.to_device = to_device or (lambda b: move_to_device(b, self.device))
        self.plan = _Plan()
        self.channels: dict[int, _Channel] = {}
        for env in self.inputs.envs():  # collective: every rank builds its pipelines in the same order
            self.channels[id(env)] = _Channel.acquire(env)
        self._envs = {id(e): e for e in self.inputs.envs()}
        # where the feeder works (read_ahead, resolved: the feeders read it) and why, the same on every rank
        mode, self.read_ahead_why = _read_ahead(self.config, self.channels, self.device)
        self.config = dataclasses.replace(self.config, read_ahead=mode)
        self.feeder: _Feeder | None = None
        self.closed = False
        self.loader: Any = None  # RecStrategy: the Lightning dataloader it serves (closed once no loop holds it)
        # RecStrategy: (this rank's signals: () -> bits, told every rank's: ({rank: bits}) -> None); see _Feeder
        self.stop_signal: tuple | None = None
        # inputs the step received already routed / routed itself (the first batch, unpipelined collections)
        self.stats = {"routed_ahead": 0, "routed_in_step": 0}

    def iterate(self, source: Iterator, pad: Callable[[], Any] | None = None, evaluating: bool = False,
                length: int | None = None) -> _Feeder:
        """A new pass over `source` (the previous pass, if any, is stopped first).

        pad: evaluation's empty batch for a rank whose `source` ran out before another's (None: no padding).
        length: the batches `source` gives, when known: where every rank's is the same, the ranks agree on it once
        instead of before every batch."""
        if self.closed:
            raise ValueError("this pipeline was closed: build a new one (TrainPipelineSparseDist(...))")
        self.stop_feeder()
        plan = self.plan
        plan.record_next = False  # (a step that called no collection left it open: batch 0 records, as below)
        if not plan.final.is_set() and plan.record_entry is not None:  # the last pass stopped while recording
            if plan.routes or plan.not_pipelined:
                plan.finalize(self.inputs)
            else:
                plan.record_entry = None  # nothing was called: record on this pass
        elif plan.final.is_set() and not plan.routes and not plan.not_pipelined:
            # the last pass's recording step called no collection: record on this pass (the same on every rank)
            self.plan = _Plan()
        self.feeder = _Feeder(iter(source), self.inputs, self.plan, self.channels, self.device, self.config,
                              self.to_device, self.stats, pad, evaluating, self.stop_signal, length)
        return self.feeder

    def stop_feeder(self, keep_unused: bool = False) -> list:
        """Stop the current pass's feeder, if any (at the same point on every rank: it agrees where to stop).
        keep_unused: return the batches it read ahead that no step took (on the device already), else drop them."""
        unused: list = []
        if self.feeder is not None:
            if self.feeder.peeked is not None:
                self.inputs.looked_up = {}  # looked up early for a step that will not come
            unused = self.feeder.close(keep_unused)
            self.feeder = None
        return unused

    def owns(self, batch: Any) -> bool:
        return self.inputs.owns(batch)

    def _use_prefetch(self) -> torch.cuda.Stream | None:
        """prefetch: the model's fused_uvm_caching kernels in prefetch mode; the stream prefetches run on (None: the
        current one, on CPU). The plan, the same on every rank, must put some table in fused_uvm_caching."""
        if not any(m.cached_tables() for m in self.inputs.modules):
            names = ", ".join(f"'{canonical_fqn(n)}'" for n in self.inputs.names.values()) or "none"
            raise ValueError(f"PipelineConfig(prefetch=True): the plan puts no table of this model's sharded "
                             f"collections ({names}) in compute_kernel 'fused_uvm_caching', so there is no cache to "
                             f"prefetch into: leave prefetch out, or plan the tables that live in host memory as "
                             f"fused_uvm_caching (ParameterConstraints(compute_kernels=['fused_uvm_caching']))")
        for module in self.inputs.modules:
            module.use_prefetch_pipeline()
        if self.device.type != "cuda":
            return None
        # one per device: fbgemm keeps the stream of a TBE's first prefetch and syncs its backward with that one
        if self.device not in _PREFETCH_STREAMS:
            _PREFETCH_STREAMS[self.device] = torch.cuda.Stream(self.device)
        return _PREFETCH_STREAMS[self.device]

    def look_ahead(self, batch: Any) -> None:
        """After the current step's forward, before its backward, for the next batch:
        semi_sync: run `batch`'s lookup and output_dist now, before the current step's backward updates the tables;
        its step's collections take these outputs (autograd attached: its own backward updates the rows it read).
        prefetch: fill the fused_uvm_caching tables' caches with `batch`'s rows (_Feeder.prefetch)."""
        self.inputs.looked_up = {}
        plan = self.plan
        if not plan.final.is_set():  # the plan is recorded on a step: until then, the next batch runs synchronously
            return
        if self.config.prefetch:
            self.feeder.prefetch(batch, self.prefetch_stream)
            return
        kjts = {path: kjt for kjt, path in find_kjts(batch)}
        for module, path in plan.routes:
            kjt = kjts.get(path)
            if kjt is not None and (id(module), id(kjt)) not in self.inputs.looked_up:
                self.inputs.looked_up[(id(module), id(kjt))] = (kjt, module(kjt))

    def forward_done(self) -> None:
        if self.feeder is not None:
            self.feeder.forward_done()

    def close(self) -> None:
        """Stop the feeder and give the channels back (call it at the same point on every rank)."""
        if self.closed:
            return
        self.stop_feeder()
        for key, channel in self.channels.items():
            _Channel.release(self._envs[key], channel)
        self.channels = {}
        self.closed = True

    def __del__(self) -> None:
        # let go without close(): the thread ends when idle; the channels are not reused (GC timing differs by rank)
        feeder = getattr(self, "feeder", None)
        if feeder is not None:
            try:
                feeder.stop_soon()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


_SAID: set[str] = set()  # the read-ahead choices this process has logged
_PREFETCH_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _read_ahead(config: PipelineConfig, channels: dict, device: torch.device) -> tuple[str, str]:
    """(mode, why) for `config.read_ahead`; auto agrees across ranks (inline if any rank's host has no spare core:
    the feeders' order of work must be one on every rank). Logged once per process, on rank 0."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    mode, why = choose_read_ahead(config, get_local_size(), torch.get_num_threads(), cores, device.type == "cuda")
    channel = next(iter(channels.values()), None)
    if config.read_ahead == "auto" and channel is not None and channel.world_size > 1 and device.type != "cuda":
        rows = agree([int(mode == "inline")], channel.pg, channel.transport, tag="pipeline: read-ahead mode")
        inline = [r for r, (x,) in enumerate(rows) if x]
        if inline and mode != "inline":
            mode, why = "inline", f"rank(s) {inline} have no core to spare for a feeder thread"
    if (channel is None or channel.rank == 0) and why not in _SAID:
        _SAID.add(why)
        logging.getLogger(__name__).info("lightning_rec pipeline: read-ahead %s: %s", mode, why)
    return mode, why


def _batches_left(source: Iterator) -> int | None:
    """The batches `source` has yet to give, where it knows: a pass of lightning_rec's loaders (`batches_left()`) or
    of a map-style DataLoader; None for other iterators."""
    own = getattr(source, "batches_left", None)
    return own() if callable(own) else dataloader_batches_left(source)


def _reference(obj: Any) -> Callable[[], Any]:
    """A weak reference where the object takes one (a DataLoader, its iterators), else a strong one."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class ReadAhead:
    """Batches a pipeline read ahead of its steps that no step took; iterating takes them (once, oldest first). One
    object is both what `close()` returns and what the model keeps for the iterator: no batch is given twice."""

    def __init__(self, batches: list | None = None, rest: ReadAhead | None = None) -> None:
        # rest: kept batches the pass began with and had not read yet (they come after the ones it read)
        self._batches = deque(list(batches or []) + list(rest or []))

    def __iter__(self) -> ReadAhead:
        return self

    def __next__(self) -> Any:
        if not self._batches:
            raise StopIteration
        return self._batches.popleft()

    def __len__(self) -> int:
        return len(self._batches)

    def __repr__(self) -> str:
        return f"ReadAhead({len(self)} batches)"


def _process_ending() -> bool:
    """At exit: the main thread has finished (atexit hooks, such as the one closing the process groups, collect
    what is left) or the interpreter is being torn down."""
    return sys.is_finalizing() or not threading.main_thread().is_alive()


class TrainPipelineSparseDist:
    """TorchRec's pipeline for hand-written loops, without tracing.

        pipeline = TrainPipelineSparseDist(dmp, optimizer, device)
        it = iter(dataloader)
        while True:
            try:
                output = pipeline.progress(it)   # one step: batch i computes, batch i+1 is routed
            except StopIteration:
                break

    `model(batch)` returns `(loss, output)`; in training mode `progress` runs zero_grad, forward, backward and
    `optimizer.step()`, and returns `output` (eval mode, or optimizer=None: the forward only). Batches come out in
    order; StopIteration comes once every batch is done (docs/pipeline.md#hand-written-loops)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device | str,
                 config: PipelineConfig | None = None, *, execute_all_batches: bool = True) -> None:
        if isinstance(config, bool):  # TorchRec's fourth positional argument is execute_all_batches
            config, execute_all_batches = None, config
        if not execute_all_batches:
            raise ValueError("TrainPipelineSparseDist(execute_all_batches=False): this pipeline always runs every "
                             "batch (StopIteration comes after the last one); to stop earlier, give it fewer "
                             "batches (itertools.islice(dataloader, n)). Leave execute_all_batches out")
        self._model = model
        self._optimizer = optimizer
        self._pipeline = InputPipeline(model, device, config)
        self._source: Iterator | None = None
        # iterators left mid-pass: id -> (a reference to it, the batches read ahead), kept on the model
        self._read_ahead: dict[int, tuple[Callable[[], Any], ReadAhead]] = self._pipeline.inputs.read_ahead
        self._pass_kept: ReadAhead | None = None  # the kept batches this pass began with (read before its source)
        # iterables given to progress (a DataLoader itself): id -> (a reference to it, the iterator of its current pass)
        self._iterables: dict[int, tuple[Callable[[], Any], Iterator]] = self._pipeline.inputs.iterables

    def progress(self, dataloader_iter: Iterator) -> Any:
        iterable = None
        if not isinstance(dataloader_iter, Iterator):
            # the DataLoader itself: its passes one after another, a call going on with the current one
            iterable = dataloader_iter
            held = self._iterables.get(id(iterable))
            if held is None or held[0]() is not iterable:
                for key in [k for k, (ref, _) in self._iterables.items() if ref() is None]:
                    del self._iterables[key]  # loaders let go: their passes' iterators (and workers) with them
                held = self._iterables[id(iterable)] = (_reference(iterable), iter(iterable))
            dataloader_iter = held[1]
        if self._source is not dataloader_iter or self._pipeline.feeder is None:
            self._switch_to(dataloader_iter)
        try:
            batch = next(self._pipeline.feeder)  # StopIteration: every batch is done
        except StopIteration:
            if iterable is not None:
                self._iterables.pop(id(iterable), None)  # the next call starts its next pass
            raise
        training = self._model.training and self._optimizer is not None
        if not training:
            self._pipeline.inputs.looked_up = {}  # (looked up for a training step) evaluation looks up now
        if training:
            self._optimizer.zero_grad()
        with torch.set_grad_enabled(training and torch.is_grad_enabled()):
            result = self._model(batch)
        self._pipeline.forward_done()
        model = type(getattr(self._model, "module", self._model)).__name__  # the user's, inside DMP
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise TypeError(f"TrainPipelineSparseDist: model(batch) must return (loss, output), TorchRec's convention; "
                            f"{model} returned a {type(result).__name__}"
                            + (f" of {len(result)} items" if isinstance(result, (tuple, list)) else "")
                            + ": return (loss, output) from its forward (output may be None)")
        losses, output = result
        if training and not isinstance(losses, torch.Tensor):  # a float (loss.item()) has no backward
            raise TypeError(f"TrainPipelineSparseDist: the loss in model(batch)'s (loss, output) must be a tensor, "
                            f"but {model} returned a {type(losses).__name__} ({short_repr(losses)}): return the loss "
                            f"tensor itself (not loss.item()), so that the pipeline can run its backward")
        if training:
            if self._pipeline.config.semi_sync or self._pipeline.config.prefetch:
                self._look_ahead()
            torch.sum(losses).backward()
            self._optimizer.step()
        return output

    def _look_ahead(self) -> None:
        """semi_sync / prefetch: take the next batch now; look it up (tables one update stale) or fill the caches with
        its rows, before this step's backward."""
        after = self._pipeline.feeder.peek()
        if after is not None:
            self._pipeline.look_ahead(after)

    def _switch_to(self, source: Iterator) -> None:
        """A pass over `source`; what the last pass read ahead is kept for its iterator, first when it is back."""
        previous = self._source
        if previous is not None and previous is not source:
            self._keep_read_ahead()
        else:
            self._pipeline.stop_feeder()
            self._forget_taken()
        self._watch_reset(source)
        kept = self._read_ahead.pop(id(source), None)
        self._pass_kept = kept[1] if kept is not None and kept[0]() is source else None
        length = _batches_left(source)  # a sized loader's: the ranks agree on it once, not before each batch
        if length is not None and self._pass_kept is not None:
            length += len(self._pass_kept)
        self._pipeline.iterate(itertools.chain(self._pass_kept, source) if self._pass_kept is not None else source,
                               length=length)
        self._source = source

    def _watch_reset(self, source: Iterator) -> None:
        """A DataLoader with persistent_workers=True reuses one iterator, which `iter(loader)` resets: the feeder stops
        before the reset, and the next step starts a new pass (what was read ahead is dropped, as in the plain loop)."""
        # weak references only: the iterator holds this function, and must not hold the pipeline alive
        me, store = weakref.ref(self), self._read_ahead

        def before_reset(source):
            pipeline = me()
            if pipeline is not None and pipeline._source is source:
                pipeline._pipeline.stop_feeder()
                pipeline._pass_kept = None
            store.pop(id(source), None)

        persistent_iterator_reset(source, before_reset)

    def _keep_read_ahead(self) -> ReadAhead:
        """Stop the pass; keep the batches it read ahead that no step took for its iterator (first when it is back)."""
        source, feeder = self._source, self._pipeline.feeder
        kept = ReadAhead(self._pipeline.stop_feeder(keep_unused=True), rest=self._pass_kept)
        self._pass_kept = None
        if source is not None and feeder is not None:
            self._read_ahead[id(source)] = (_reference(source), kept)
        self._forget_taken()
        return kept

    def _forget_taken(self) -> None:
        for key in [k for k, (ref, batches) in self._read_ahead.items() if not len(batches) or ref() is None]:
            del self._read_ahead[key]  # taken, or its iterator is gone

    @property
    def read_ahead(self) -> tuple[str, str]:
        """Where the feeder works, "thread" or "inline" (PipelineConfig.read_ahead, auto resolved), and why."""
        return self._pipeline.config.read_ahead, self._pipeline.read_ahead_why

    @property
    def stats(self) -> dict[str, int]:
        """How many collection inputs came routed ahead, and how many were routed inside the step."""
        return dict(self._pipeline.stats)

    def close(self) -> ReadAhead:
        """Stop the feeder (at the same point on every rank) and give the channels back. Returns the batches read
        ahead from the current iterator, oldest first (on the device), for a plain loop,
        `itertools.chain(pipeline.close(), it)`, or the next pipeline given that iterator: taken once."""
        kept = self._keep_read_ahead() if not self._pipeline.closed else ReadAhead([])
        self._pipeline.close()
        return kept

    def __del__(self) -> None:
        # let go mid-pass: the batches cannot be handed back (a join at the collector's moment): say so
        pipeline = getattr(self, "_pipeline", None)
        feeder = getattr(pipeline, "feeder", None)
        if pipeline is None or pipeline.closed or feeder is None or feeder._finished or _process_ending():
            return  # (at exit: a script's pipeline left open, nothing after it to take its batches)
        try:
            with feeder._cond:
                dropped = (sum(isinstance(item, _Entry) for item in feeder._queue) + len(feeder._held)
                           + (feeder.peeked is not None))
            if dropped:
                warnings.warn(f"lightning_rec pipeline: a TrainPipelineSparseDist was let go mid-pass, dropping "
                              f"{dropped} batch(es) it had read ahead of its steps; call pipeline.close() instead: it "
                              f"returns them (for batch in itertools.chain(pipeline.close(), it)), and a pipeline "
                              f"given that iterator again starts with them", stacklevel=2)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __enter__(self) -> TrainPipelineSparseDist:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
