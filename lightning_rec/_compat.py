"""Every probe of a torch or Lightning version, and every private Lightning hook the library touches.

lightning_rec runs on torch 2.11-2.13 and Lightning 2.6.x: a feature newer than the oldest supported
release is detected here, by what the installed version offers, never assumed from a version string.
Each probe names the versions it covers; tests/test_compat.py pins what the pinned versions give.
Lightning itself is imported only inside the functions that need it (`import lightning_rec` stays light).
"""

from __future__ import annotations

import functools
import inspect

import torch


def _takes(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


@functools.cache
def ddp_has_forward_sync_buffers() -> bool:
    """DistributedDataParallel(forward_sync_buffers=...): torch >= 2.13 (2.11 / 2.12: broadcast_buffers only)."""
    from torch.nn.parallel import DistributedDataParallel

    return _takes(DistributedDataParallel.__init__, "forward_sync_buffers")


@functools.cache
def compiler_disable_takes_reason() -> bool:
    """torch.compiler.disable(fn, reason=...): the reason shows in fullgraph's error (newer torch; absent in some)."""
    return _takes(torch.compiler.disable, "reason")


@functools.cache
def distribute_tensor_takes_src_data_rank() -> bool:
    """distribute_tensor(..., src_data_rank=None) keeps each rank's own copy: torch >= 2.6."""
    from torch.distributed.tensor import distribute_tensor

    return _takes(distribute_tensor, "src_data_rank")


@functools.cache
def pytree_takes_flatten_with_keys() -> bool:
    """register_pytree_node(..., flatten_with_keys_fn=...): names the leaves in torch.export signatures."""
    from torch.utils import _pytree as pytree

    return _takes(pytree.register_pytree_node, "flatten_with_keys_fn")
