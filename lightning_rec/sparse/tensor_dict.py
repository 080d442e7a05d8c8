"""TorchRec's `maybe_td_to_kjt`: a TensorDict of jagged (nested) tensors, one per feature, as a KeyedJaggedTensor.

tensordict is not a dependency: a TensorDict is recognised by its module, never imported here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_rec.sparse.jagged_tensor import KeyedJaggedTensor


def maybe_td_to_kjt(features: Any, keys: Sequence[str] | None = None) -> Any:
    """A TensorDict {feature: nested tensor of jagged layout} -> a KeyedJaggedTensor of `keys` (default: the
    TensorDict's order); anything else (a KeyedJaggedTensor) is returned as it is."""
    if type(features).__module__.partition(".")[0] != "tensordict":
        return features
    keys = list(features.keys()) if keys is None else list(keys)
    nested = [features[key] for key in keys]
    lengths = [t.lengths() if t.lengths() is not None else torch.diff(t.offsets()) for t in nested]
    return KeyedJaggedTensor(keys, torch.cat([t.values() for t in nested]), lengths=torch.cat(lengths))
