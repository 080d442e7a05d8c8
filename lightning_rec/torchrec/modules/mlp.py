"""`torchrec.modules.mlp`: MLP with TorchRec's arguments, over lightning_rec's MLP (an nn.Sequential of Linear and
activation layers: its state dict says `0.weight` where TorchRec's says `_mlp.0._linear.weight`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_rec.models.dlrm import MLP as _MLP


class MLP(_MLP):
    """TorchRec's `MLP(in_size, layer_sizes, bias, activation, device, dtype, activation_on_last)`."""

    def __init__(self, in_size: int, layer_sizes: Sequence[int], bias: bool = True, activation: Any = torch.relu,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                 activation_on_last: bool = True) -> None:
        super().__init__(in_size, layer_sizes, last_activation=activation_on_last, bias=bias, activation=activation,
                         device=device, dtype=dtype)


__all__ = ["MLP"]
