"""Lightning: how a DataLoader of RecStrategy's loops is read, pipelined or stepping together.

What the strategy keeps on a loader for the loop that reads it is one LoopState, in one attribute
(`loader._rec_loop`). The loader's class is swapped once for a subclass of its own class whose
`__iter__` reads it by the state's rule (`LoopState.iterate`: the pipeline's feeder, `wrap_loader`,
or the strategy's step-together rule) and whose `__len__` is the ranks' agreed length. The loader
keeps its class's behaviour otherwise (Lightning checks isinstance(DataLoader), seeds workers,
reads .sampler).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lightning_rec.pipeline.train_pipeline import InputPipeline

_STATE = "_rec_loop"  # the loader's attribute that holds its LoopState
_MARK = "_rec_loop_class"  # in the __dict__ of our subclasses only


@dataclass
class LoopState:
    """What RecStrategy keeps on a DataLoader for the one loop that reads it (a loader two loops share gets a copy
    per loop)."""

    training: bool | None = None  # the loop this loader object belongs to
    evaluating: bool = False  # a rank that ran out steps on with `pad`'s empty batches
    agreed_len: int | None = None  # training: the fewest batches of any rank, where fewer than this rank's own
    padded_len: int | None = None  # evaluation: the most batches of any rank, where more than this rank's own
    pad: Callable[[], Any] | None = None  # an empty batch (evaluation), else None
    iterate: Callable[[Any, LoopState], Iterator] | None = None  # (loader, state) -> the batches the loop takes
    all_have_a_batch: Callable | None = None  # stepping together: the ranks' agreement before each batch
    pipeline: InputPipeline | None = None  # pipelined: the feeder reads, routes and keeps the ranks together
    position: Callable[[], int] | None = None  # pipelined training: the batches the steps took this epoch
    states: dict[int, Any] = field(default_factory=dict)  # the loader's own state after each batch the feeder read
    first_step: int | None = None  # the epoch's step count when this pass's first batch was taken


def loop_state(loader: Any) -> LoopState | None:
    """The LoopState on `loader` (None: none, a loader no RecStrategy loop has processed)."""
    return vars(loader).get(_STATE) if hasattr(loader, "__dict__") else None


def set_loop_state(loader: Any, state: LoopState | None) -> None:
    """Give `loader` its state; the class swap follows the state: a loader whose state reads it by a rule of ours
    iterates through `state.iterate`, one without goes back to its own class."""
    if state is None:
        vars(loader).pop(_STATE, None)
    else:
        vars(loader)[_STATE] = state
    cls = base_loader_class(type(loader))
    if state is None or state.iterate is None:
        loader.__class__ = cls
        return
    sub = _LOOP_CLASSES.get(cls)
    if sub is None:
        namespace = {"__iter__": _iter_loop, "__len__": _loop_len, _MARK: True}
        if callable(getattr(cls, "state_dict", None)):
            namespace["state_dict"] = _state_at_the_step
        sub = _LOOP_CLASSES[cls] = type(f"RecLoop{cls.__name__}", (cls,), namespace)
    loader.__class__ = sub


_LOOP_CLASSES: dict[type, type] = {}


def base_loader_class(cls: type) -> type:
    """The loader's own class, under lightning_rec's loop subclass."""
    return next(c for c in cls.__mro__ if _MARK not in c.__dict__)


def _iter_loop(self):
    state = loop_state(self)
    if state is None or state.iterate is None:
        return base_loader_class(type(self)).__iter__(self)
    return state.iterate(self, state)


def _loop_len(self) -> int:
    """The loader's own length, or the ranks' agreed one: in training the fewest batches of any rank where that is
    fewer; in evaluation the most, where that is more (this rank's last steps are empty padding batches)."""
    n = base_loader_class(type(self)).__len__(self)
    state = loop_state(self)
    if state is None:
        return n
    n = n if state.agreed_len is None else min(n, state.agreed_len)
    return n if state.padded_len is None else max(n, state.padded_len)


def wrap_loader(loader, pipeline: InputPipeline, pad=None, position=None):
    """The loader iterates through `pipeline` (the feeder also keeps the ranks stepping together).

    pad: evaluation: a callable giving an empty batch, which a rank whose data ran out steps with while
    another rank still has batches (None: the first rank to run out ends the pass for all).
    position: training: a callable giving the batches the steps have taken in this epoch. A stateful loader
    (torchdata's StatefulDataLoader) then saves its state at the step, not at the feeder, which reads ahead
    (lightning_rec's own loaders keep their history themselves: data/batch.py, consumed_batches).
    """
    state = loop_state(loader) or LoopState()
    state.pipeline, state.pad, state.iterate = pipeline, pad, _iter_pipelined
    state.position, state.states, state.first_step = None, {}, None
    own_state = getattr(base_loader_class(type(loader)), "state_dict", None)
    if position is not None and callable(own_state) and not hasattr(loader, "consumed_batches"):
        state.position = position
    set_loop_state(loader, state)
    return loader


_STATES_KEPT = 64  # more than any feeder reads ahead


def _read_with_states(loader, state: LoopState, batches):
    """The pass's batches, keeping the loader's state after each one read (the feeder's thread reads them)."""
    own_state = base_loader_class(type(loader)).state_dict
    states = state.states = {}
    count = 0
    for batch in batches:
        count += 1
        states[count] = own_state(loader)
        states.pop(count - _STATES_KEPT, None)
        yield batch


def _counting_from_the_first_step(state: LoopState, batches):
    """The pass's batches as Lightning takes them; notes the epoch's step count when the pass's first is taken
    (0 at an epoch's start, the checkpoint's when resumed mid-epoch)."""
    state.first_step = None
    for batch in batches:
        if state.first_step is None:
            state.first_step = state.position()
        yield batch


def _state_at_the_step(self):
    """What Lightning saves: pipelined training, the loader's state after the batches the steps took."""
    own_state = base_loader_class(type(self)).state_dict
    state = loop_state(self)
    if state is None or state.position is None or state.first_step is None or not state.states:
        return own_state(self)
    read = state.position() - state.first_step  # batches of this pass the steps have taken
    return state.states.get(read) or own_state(self)


def _iter_pipelined(loader, state: LoopState):
    pipeline = state.pipeline
    if not pipeline.closed:
        # the last pass's feeder stops before the loader restarts: a pass cut short (limit_*_batches) leaves it
        # reading ahead, and with persistent_workers the loader's __iter__ resets the very iterator it reads
        pipeline.stop_feeder()
    batches = base_loader_class(type(loader)).__iter__(loader)
    if state.agreed_len is not None:  # the ranks' agreed length: the feeder reads no further
        batches = itertools.islice(batches, state.agreed_len)
    if pipeline.closed:  # the loader went on to a run without this strategy
        return batches
    if state.position is not None:
        batches = _read_with_states(loader, state, batches)
        return _counting_from_the_first_step(state, pipeline.iterate(batches, pad=state.pad))
    return pipeline.iterate(batches, pad=state.pad, evaluating=state.evaluating)
