"""Wrapper names in parameter and state paths, known in one place.

DistributedModelParallel holds the user's model as `_dmp_wrapped_module`, DDP as `module`. The model's own names
(its state dict's, the unsharded model's) leave both out, and so does everything we save; checkpoints written before
that carry them, and still load.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

DMP_WRAPPED = "_dmp_wrapped_module"  # DistributedModelParallel's child that holds the model (or DDP around it)
DDP_WRAPPED = "module"  # DistributedDataParallel's child that holds the model

# the prefixes a wrapped name starts with, longest first
WRAPPER_PREFIXES = (f"{DMP_WRAPPED}.{DDP_WRAPPED}.", f"{DMP_WRAPPED}.", f"{DDP_WRAPPED}.")


def canonical_fqn(name: str) -> str:
    """`name` without its leading wrapper prefix: `_dmp_wrapped_module.module.ebc.t` -> `ebc.t`.

    For names that may have been written under a wrapper (an older checkpoint's); a plain model's own name may start
    with `module.` too, so look the exact name up first.
    """
    for prefix in WRAPPER_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def is_wrapper_child(parent: torch.nn.Module, name: str) -> bool:
    """Whether `parent.<name>` is the child a wrapper holds the user's model under (it adds no path component)."""
    return name == DMP_WRAPPED or (name == DDP_WRAPPED and isinstance(parent, DistributedDataParallel))
