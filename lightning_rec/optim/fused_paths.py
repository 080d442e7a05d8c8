"""Which modules of a model own fused embedding kernels, under the model's own paths.

Below the collections (embedding.fused_table_modules reads it): it imports only the leaf that knows the wrappers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lightning_rec.fqn import is_wrapper_child


def _model_named_modules(module: torch.nn.Module, prefix: str = "", seen: set | None = None):
    """named_modules() under the model's own names: wrappers add no path component."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    yield prefix, module
    for name, child in module.named_children():
        if child is None:
            continue
        path = prefix if is_wrapper_child(module, name) else (f"{prefix}.{name}" if prefix else name)
        yield from _model_named_modules(child, path, seen)


def fused_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) for every module in `model` that owns fused embedding kernels. Paths are the model's own (its
    state_dict's), also when `model` is a DistributedModelParallel (with DDP inside), so that the fused state saved
    under them loads into the unsharded model too."""
    return [(path, m) for path, m in _model_named_modules(model) if _has_fused_update(m)]


def _has_fused_update(module: torch.nn.Module) -> bool:
    if not callable(getattr(module, "fused_kernels", None)):
        return False
    if module.fused_kernels():
        return True
    # a sharded collection with no shard here still counts: every rank's optimizer has the same parts
    config = getattr(module, "fused_optimizer_config", None)
    return callable(getattr(module, "shard_of", None)) and callable(config) and config() is not None


def _fused_kernels(model: torch.nn.Module) -> list:
    return [k for _, m in fused_modules(model) for k in m.fused_kernels()]


@contextmanager
def gather_fused_gradients(model: torch.nn.Module) -> Iterator[None]:
    """Gradient accumulation through fused tables: inside, a lookup's backward adds its rows' gradients to a buffer
    of the rows touched (each fused kernel's own, [unique rows, dim]) and updates nothing; the first backward of a
    lookup outside applies the buffer and its own gradient in one fused update, as one batch would (as DDP's
    no_sync defers the gradient sync). `FusedOptimizer.step()` applies what is still gathered."""
    kernels = _fused_kernels(model)
    before = [k.gathering for k in kernels]
    for k in kernels:
        k.gathering = True
    try:
        yield
    finally:
        for k, was in zip(kernels, before):
            k.gathering = was


def apply_gathered(model: torch.nn.Module) -> None:
    """The one fused update of what `gather_fused_gradients` gathered and no backward applied yet (none: nothing)."""
    for k in _fused_kernels(model):
        k.apply_gathered()
