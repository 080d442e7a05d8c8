"""compile_dense: torch.compile on a model's dense layers, its embedding collections left outside the graph.

The dense modules are the largest submodules with trainable parameters and no sharded collection inside (DLRM's
bottom and top MLPs); the Python around them and the collections stay eager. Each is compiled whole
(fullgraph=True), in place (its `forward`), so that parameter names, state dicts and checkpoints are unchanged. One
that cannot be captured whole (data-dependent control flow, an op Dynamo does not trace) runs eagerly from its first
call on, named in one warning."""

from __future__ import annotations

import functools
import warnings
from typing import Any

from torch import nn

from lightning_rec._compat import dynamo_capture_errors
from lightning_rec._device import no_cuda_error
from lightning_rec.sharded_embedding import _ShardedCollectionBase


def compile_options(value: bool | dict | None, owner: str, cuda_graphs: bool = False) -> dict | None:
    """What `compile_dense=` takes: False/None (off), True (torch.compile's defaults), or torch.compile's keyword
    arguments ({"backend": "aot_eager", "mode": "max-autotune", ...}; fullgraph is always True).

    cuda_graphs: the compiled dense layers' forward and backward replay as CUDA graphs (torch.compile's
    mode="reduce-overhead": one graph per batch shape, so a last short batch is captured once more)."""
    if cuda_graphs:
        error = no_cuda_error(f"{owner}(cuda_graphs=True) (it replays the dense layers as CUDA graphs)",
                              "leave cuda_graphs out on the CPU (compile_dense=True compiles the dense layers there)")
        if error is not None:
            raise error
        if isinstance(value, dict) and value.get("mode", "reduce-overhead") != "reduce-overhead":
            raise ValueError(f"{owner}(cuda_graphs=True, compile_dense={value!r}): cuda_graphs is torch.compile's "
                             f"mode='reduce-overhead': leave mode out of compile_dense")
        value = {**(value if isinstance(value, dict) else {}), "mode": "reduce-overhead"}
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict):
        if "fullgraph" in value:
            raise ValueError(f"{owner}(compile_dense={value!r}): leave fullgraph out: each dense module is captured "
                             f"whole, and one that cannot be runs eagerly (named in a warning)")
        return dict(value)
    raise ValueError(f"{owner}(compile_dense={value!r}): use True, False, or a dict of torch.compile arguments")


def dense_modules(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """(name, module): the largest submodules with trainable parameters and no sharded collection inside."""
    out = []
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, _ShardedCollectionBase):
            continue
        if any(isinstance(m, _ShardedCollectionBase) for m in child.modules()):
            out += dense_modules(child, path)
        elif any(p.requires_grad for p in child.parameters()):
            out.append((path, child))
    return out


def compile_dense(module: nn.Module, options: dict) -> list[str]:
    """Compile `module`'s dense modules in place (their `forward`); returns their names."""
    import torch

    names = []
    for name, child in dense_modules(module):
        if "forward" in vars(child):  # compiled already (a second DistributedModelParallel over this model)
            continue
        eager = child.forward
        compiled = torch.compile(eager, fullgraph=True, **options)
        child.forward = _compiled_or_eager(child, name, compiled, eager)
        names.append(name)
    return names


def _compiled_or_eager(child: nn.Module, name: str, compiled, eager):
    @functools.wraps(eager)
    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except dynamo_capture_errors() as error:
            child.forward = eager  # from now on: eager (no second capture, no second warning)
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            warnings.warn(f"compile_dense: the dense module '{name}' ({type(child).__name__}) cannot be compiled "
                          f"whole ({first}); it runs eagerly. Data-dependent control flow (a Python `if` on a tensor) "
                          f"is the usual cause: use torch.where, or move the branch out of the module", stacklevel=2)
            return eager(*args, **kwargs)

    return forward
