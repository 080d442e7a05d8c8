"""Lightning: the dataloaders of a pipelined RecStrategy iterate through their InputPipeline."""

from __future__ import annotations

from lightning_rec.pipeline.train_pipeline import InputPipeline

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
