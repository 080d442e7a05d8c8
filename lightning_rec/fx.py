"""torch.fx tracing of models that hold lightning_rec's collections and jagged types (TorchRec's `torchrec.fx`).

The jagged types are recorded, not traced into: constructing one from traced tensors is one node (their metaclass),
their methods are method calls on the traced value, and the collections (whose batch checks read the ids) are leaf
modules, called as such in the graph. torch's own `torch.fx.symbolic_trace` works as well: there each collection is
one call of `collection_call` (a torch.fx.wrap-ed function, embedding.py). TorchScript, deprecated by PyTorch, is
not supported (torch.export and torch.compile are)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_rec.embedding import _EmbeddingCollectionBase
from lightning_rec.sharded_embedding import _ShardedCollectionBase

_LEAVES = (_EmbeddingCollectionBase, _ShardedCollectionBase)


class Tracer(torch.fx.Tracer):
    """torch.fx's tracer with lightning_rec's collections as leaf modules, and any module whose class name is in
    `leaf_modules` (TorchRec's argument)."""

    def __init__(self, leaf_modules: list[str] | None = None) -> None:
        super().__init__()
        self._leaf_modules = list(leaf_modules or [])

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, _LEAVES) or type(m).__name__ in self._leaf_modules:
            return True
        return super().is_leaf_module(m, module_qualified_name)


def symbolic_trace(root: nn.Module | Callable[..., Any], concrete_args: dict[str, Any] | None = None,
                   leaf_modules: list[str] | None = None) -> torch.fx.GraphModule:
    """TorchRec's `torchrec.fx.symbolic_trace`: a GraphModule of `root`, the collections and jagged types as leaves."""
    tracer = Tracer(leaf_modules)
    graph = tracer.trace(root, concrete_args)
    name = type(root).__name__ if isinstance(root, nn.Module) else root.__name__
    return torch.fx.GraphModule(tracer.root, graph, name)
