"""The two ways in: InputPipeline (what RecStrategy drives) and TrainPipelineSparseDist (hand-written loops)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_rec.pipeline.batch import move_to_device
from lightning_rec.pipeline.channel import _Channel
from lightning_rec.pipeline.config import PipelineConfig
from lightning_rec.pipeline.feeder import _Feeder, _Inputs, _Plan


class InputPipeline:
    """The parts a pipeline over one model needs: its channels, its plan, one feeder per pass.

    TrainPipelineSparseDist drives it from a hand loop; RecStrategy(pipeline=True) builds one per
    dataloader of Lightning's loops (lightning_rec.pipeline.wrap_loader).
    """

    def __init__(self, model: nn.Module, device: torch.device | str, config: PipelineConfig | None = None,
                 to_device: Callable[[Any], Any] | None = None) -> None:
        from lightning_rec.model_parallel import with_cuda_index

        self.config = config or PipelineConfig()
        # "cuda" alone: the current device's index (the feeder thread sets it, and set_device needs one)
        self.device = with_cuda_index(torch.device(device), torch.cuda.current_device)
        self.inputs = _Inputs.of(model)
        self.to_device = to_device or (lambda b: move_to_device(b, self.device))
        self.plan = _Plan()
        self.channels: dict[int, _Channel] = {}
        for env in self.inputs.envs():  # collective: every rank builds its pipelines in the same order
            self.channels[id(env)] = _Channel.acquire(env)
        self._envs = {id(e): e for e in self.inputs.envs()}
        self.feeder: _Feeder | None = None
        self.closed = False
        self.loader: Any = None  # RecStrategy: the Lightning dataloader it serves (closed once no loop holds it)
        # RecStrategy: (this rank's signals: () -> bits, told every rank's: ({rank: bits}) -> None); see _Feeder
        self.stop_signal: tuple | None = None
        # inputs the step received already routed / routed itself (the first batch, unpipelined collections)
        self.stats = {"routed_ahead": 0, "routed_in_step": 0}

    def iterate(self, source: Iterator, pad: Callable[[], Any] | None = None) -> _Feeder:
        """A new pass over `source` (the previous pass, if any, is stopped first).

        pad: evaluation: an empty batch for a rank whose `source` ran out while another's has not, so that
        every rank's batches are all used (None: the pass ends when the first rank's source does)."""
        if self.closed:
            raise ValueError("this pipeline was closed: build a new one (TrainPipelineSparseDist(...))")
        self.stop_feeder()
        plan = self.plan
        if not plan.final.is_set() and plan.record_entry is not None:  # the last pass stopped while recording
            if plan.routes or plan.not_pipelined:
                plan.finalize(self.inputs)
            else:
                plan.record_entry = None  # nothing was called: record on this pass
        elif plan.final.is_set() and not plan.routes and not plan.not_pipelined:
            # the last pass's recording step called no collection (a dense warm-up step): an empty plan would route
            # every later batch in the step, silently; record on this pass (the same on every rank: same code)
            self.plan = _Plan()
        self.feeder = _Feeder(iter(source), self.inputs, self.plan, self.channels, self.device, self.config,
                              self.to_device, self.stats, pad, self.stop_signal)
        return self.feeder

    def stop_feeder(self, keep_unused: bool = False) -> list:
        """Stop the current pass's feeder, if any (at the same point on every rank: it agrees where to stop).

        keep_unused: return the batches it read ahead that no step took (on the device already), else drop them."""
        unused: list = []
        if self.feeder is not None:
            unused = self.feeder.close(keep_unused)
            self.feeder = None
        return unused

    def owns(self, batch: Any) -> bool:
        return self.inputs.owns(batch)

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
    order; StopIteration comes once every batch is done. A new iterator starts a new pass; one given again
    (training resumed after an evaluation pass) goes on where its steps stopped. Build,
    close (or let go) and rebuild pipelines over the same model freely; the plain loop
    (`model(batch)` yourself) works in between.
    """

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
        # iterators left mid-pass for another (an evaluation between training steps): the batches read ahead
        self._read_ahead: dict[int, tuple[Iterator, list]] = {}

    def progress(self, dataloader_iter: Iterator) -> Any:
        if self._source is not dataloader_iter or self._pipeline.feeder is None:
            self._switch_to(dataloader_iter)
        batch = next(self._pipeline.feeder)  # StopIteration: every batch is done
        training = self._model.training and self._optimizer is not None
        if training:
            self._optimizer.zero_grad()
        with torch.set_grad_enabled(training and torch.is_grad_enabled()):
            result = self._model(batch)
        self._pipeline.forward_done()
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            model = type(getattr(self._model, "module", self._model)).__name__  # the user's, inside DMP
            raise TypeError(f"TrainPipelineSparseDist: model(batch) must return (loss, output), TorchRec's convention; "
                            f"{model} returned a {type(result).__name__}"
                            + (f" of {len(result)} items" if isinstance(result, (tuple, list)) else "")
                            + ": return (loss, output) from its forward (output may be None)")
        losses, output = result
        if training:
            torch.sum(losses).backward()
            self._optimizer.step()
        return output

    def _switch_to(self, source: Iterator) -> None:
        """A pass over `source`. The batches the last pass read ahead are kept for its iterator, and come first when it
        is given again: dropped, every evaluation between training steps cost a training batch, silently."""
        previous = self._source
        unused = self._pipeline.stop_feeder(keep_unused=previous is not None and previous is not source)
        if unused:
            self._read_ahead[id(previous)] = (previous, unused)
        kept = self._read_ahead.pop(id(source), None)
        batches = itertools.chain(kept[1], source) if kept is not None and kept[0] is source else source
        self._pipeline.iterate(batches)
        self._source = source

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
