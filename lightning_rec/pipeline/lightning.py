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
    """The loader's own length, or the ranks' agreed one (RecStrategy.process_dataloader): in training the fewest
    batches of any rank where that is fewer; in evaluation the most, where that is more (this rank's last steps are
    empty padding batches)."""
    n = base_loader_class(type(self)).__len__(self)
    agreed = getattr(self, "_rec_agreed_len", None)
    padded = getattr(self, "_rec_padded_len", None)
    n = n if agreed is None else min(n, agreed)
    return n if padded is None else max(n, padded)


def wrap_loader(loader, pipeline: InputPipeline, pad=None, position=None):
    """The loader iterates through `pipeline` (the feeder also keeps the ranks stepping together).

    pad: evaluation: a callable giving an empty batch, which a rank whose data ran out steps with while
    another rank still has batches (None: the first rank to run out ends the pass for all).
    position: training: a callable giving the batches the steps have taken in this epoch. A stateful loader
    (torchdata's StatefulDataLoader) then saves its state at the step, not at the feeder, which reads ahead:
    a run resumed from its checkpoint skipped the batches the feeder had read but no step had trained.
    (lightning_rec's own loaders keep their history themselves: data/batch.py, consumed_batches.)
    """
    swap_iter(loader, "Pipelined", _iter_pipelined, _PIPELINED_CLASSES)
    loader._rec_pipeline = pipeline
    loader._rec_pad_batch = pad
    vars(loader).pop("state_dict", None)
    loader._rec_position = None
    own_state = getattr(base_loader_class(type(loader)), "state_dict", None)
    if position is not None and callable(own_state) and not hasattr(loader, "consumed_batches"):
        loader._rec_position = position
        loader._rec_states = {}
        loader.state_dict = lambda: _state_at_the_step(loader)  # what Lightning saves
    return loader


_STATES_KEPT = 64  # more than any feeder reads ahead


def _read_with_states(loader, batches):
    """The pass's batches, keeping the loader's state after each one read (the feeder's thread reads them)."""
    own_state = base_loader_class(type(loader)).state_dict
    states = loader._rec_states = {}
    count = 0
    for batch in batches:
        count += 1
        states[count] = own_state(loader)
        states.pop(count - _STATES_KEPT, None)
        yield batch


def _counting_from_the_first_step(loader, batches):
    """The pass's batches as Lightning takes them; notes the epoch's step count when the pass's first is taken
    (0 at an epoch's start, the checkpoint's when resumed mid-epoch)."""
    loader._rec_first_step = None
    for batch in batches:
        if loader._rec_first_step is None:
            loader._rec_first_step = loader._rec_position()
        yield batch


def _state_at_the_step(loader):
    states, first = getattr(loader, "_rec_states", {}), getattr(loader, "_rec_first_step", None)
    own_state = base_loader_class(type(loader)).state_dict
    if first is None or not states:
        return own_state(loader)
    read = loader._rec_position() - first  # batches of this pass the steps have taken
    return states.get(read) or own_state(loader)


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
    if getattr(self, "_rec_position", None) is not None:
        batches = _read_with_states(self, batches)
        return _counting_from_the_first_step(self, pipeline.iterate(batches, pad=getattr(self, "_rec_pad_batch", None)))
    return pipeline.iterate(batches, pad=getattr(self, "_rec_pad_batch", None),
                            evaluating=getattr(self, "_rec_evaluating", False))
