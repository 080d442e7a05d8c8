"""Where a batch keeps its KeyedJaggedTensors, and moving a batch (or any tensors inside it) to a device."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_rec.sparse import KeyedJaggedTensor

_SEARCH_DEPTH = 4  # how deep inside a batch a KJT is looked for


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
        elif hasattr(type(obj), "__slots__"):  # no __dict__ (attrs' @define classes)
            items = [(("attr", n), getattr(obj, n)) for n in _slot_names(type(obj)) if hasattr(obj, n)]
        else:
            return
        for step, value in items:
            visit(value, path + (step,), depth + 1)

    visit(batch, (), 0)
    return out


def _slot_names(cls: type) -> list[str]:
    names: list[str] = []
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [n for n in slots if n not in ("__dict__", "__weakref__")]
    return names


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


def _follow(batch: Any, path: tuple) -> KeyedJaggedTensor | None:
    obj = batch
    try:
        for kind, key in path:
            obj = getattr(obj, key) if kind == "attr" else obj[key]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
    return obj if isinstance(obj, KeyedJaggedTensor) else None
