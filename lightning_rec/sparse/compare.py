"""TorchRec's helpers over the jagged types: equality (`jt_is_equal`, `kjt_is_equal`) and the modules that convert
a KeyedJaggedTensor to and from a dict of JaggedTensors (`ComputeKJTToJTDict`, `ComputeJTDictToKJT`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_rec.errors import NoTorchScript
from lightning_rec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor


def _same(a: Any, b: Any) -> bool:
    """Equal tensors (floating ones within allclose's tolerance), lists or ints; None only equals None."""
    if a is None or b is None:
        return a is None and b is None
    if not isinstance(a, Tensor):
        return a == b
    if not isinstance(b, Tensor) or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point or b.dtype.is_floating_point:
        return torch.allclose(a.double(), b.double())
    return torch.equal(a, b)


def jt_is_equal(jt_1: JaggedTensor, jt_2: JaggedTensor) -> bool:
    """TorchRec's: the same values, weights, lengths and offsets (floating ones within allclose's tolerance)."""
    if not isinstance(jt_1, JaggedTensor) or not isinstance(jt_2, JaggedTensor):
        return False
    return all(_same(a, b) for a, b in (
        (jt_1.values(), jt_2.values()), (jt_1.weights_or_none(), jt_2.weights_or_none()),
        (jt_1.lengths(), jt_2.lengths()), (jt_1.offsets(), jt_2.offsets())))


def kjt_is_equal(kjt_1: KeyedJaggedTensor, kjt_2: KeyedJaggedTensor) -> bool:
    """TorchRec's: the same keys in the same order, values, weights, lengths, offsets, ids per key and stride."""
    if not isinstance(kjt_1, KeyedJaggedTensor) or not isinstance(kjt_2, KeyedJaggedTensor):
        return False
    if list(kjt_1.keys()) != list(kjt_2.keys()) or not _same(kjt_1.values(), kjt_2.values()):
        return False
    return all(_same(a, b) for a, b in (
        (kjt_1.lengths(), kjt_2.lengths()), (kjt_1.weights_or_none(), kjt_2.weights_or_none()),
        (kjt_1.offsets(), kjt_2.offsets()), (kjt_1.length_per_key(), kjt_2.length_per_key()),
        (kjt_1.offset_per_key(), kjt_2.offset_per_key()), (kjt_1.stride(), kjt_2.stride())))


torch.fx.wrap("jt_is_equal")
torch.fx.wrap("kjt_is_equal")


class ComputeKJTToJTDict(NoTorchScript, nn.Module):
    """TorchRec's: a KeyedJaggedTensor -> {key: JaggedTensor} (`kjt.to_dict()` as a module)."""

    def forward(self, keyed_jagged_tensor: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        out = keyed_jagged_tensor.to_dict()
        for jt in out.values():
            jt.offsets()  # TorchRec's module hands each JaggedTensor out with its offsets computed
        return out


class ComputeJTDictToKJT(NoTorchScript, nn.Module):
    """TorchRec's: {key: JaggedTensor} -> a KeyedJaggedTensor (`KeyedJaggedTensor.from_jt_dict` as a module)."""

    def forward(self, jt_dict: dict[str, JaggedTensor]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_jt_dict(jt_dict)
