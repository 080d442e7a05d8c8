"""Lightning: the dataloaders of a pipelined RecStrategy iterate through their InputPipeline."""

from __future__ import annotations

import itertools

from lightning_rec.pipeline.train_pipeline import InputPipeline

_PIPELINED_CLASSES: dict[type, type] = {}


def base_loader_class(cls: type) -> type:
    """The loader's own class, under lightning_rec's iteration wrappers (strategy.py swaps classes)."""
    return next(c for c in cls.__mro__ if "_rec_step_together" not in c.__dict__)


def swap_iter(loader, prefix: str, iter_fn, cache: dict[type, type]) -> None:
    """Give `loader` a subclass of its own class whose only change is `__iter__` (one per class, cached).

    The loader keeps its class's behaviour (Lightning checks isinstance(DataLoader), sets worker
    seeding, reads .sampler). `_rec_step_together` marks our subclasses: a loader that ran under one
    wrapper goes back to its own class before getting another.
    """
    cls = base_loader_class(type(loader))
    sub = cache.get(cls)
    if sub is None:
        sub = type(f"{prefix}{cls.__name__}", (cls,), {"__iter__": iter_fn, "__len__": _agreed_len,
                                                       "_rec_step_together": True})
        cache[cls] = sub
    loader.__class__ = sub


def _agreed_len(self) -> int:
    """The loader's own length, or the ranks' agreed one where that is shorter (RecStrategy.process_dataloader)."""
    n = base_loader_class(type(self)).__len__(self)
    agreed = getattr(self, "_rec_agreed_len", None)
    return n if agreed is None else min(n, agreed)


def wrap_loader(loader, pipeline: InputPipeline, pad=None):
    """The loader iterates through `pipeline` (the feeder also keeps the ranks stepping together).

    pad: evaluation: a callable giving an empty batch, which a rank whose data ran out steps with while
    another rank still has batches (None: the first rank to run out ends the pass for all).
    """
    swap_iter(loader, "Pipelined", _iter_pipelined, _PIPELINED_CLASSES)
    loader._rec_pipeline = pipeline
    loader._rec_pad_batch = pad
    return loader


def _iter_pipelined(self):
    pipeline: InputPipeline = self._rec_pipeline
    if not pipeline.closed:
        # the last pass's feeder stops before the loader restarts: a pass cut short (limit_*_batches) leaves it
        # reading ahead, and with persistent_workers the loader's __iter__ resets the very iterator it reads
        pipeline.stop_feeder()
    batches = base_loader_class(type(self)).__iter__(self)
    agreed = getattr(self, "_rec_agreed_len", None)
    if agreed is not None:  # the ranks' agreed length (RecStrategy.process_dataloader): the feeder reads no further
        batches = itertools.islice(batches, agreed)
    if pipeline.closed:  # the loader went on to a run without this strategy
        return batches
    return pipeline.iterate(batches, pad=getattr(self, "_rec_pad_batch", None))
