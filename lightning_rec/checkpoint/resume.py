"""What a resumed run needs beyond the weights, per rank: its dataloader position and its random number generators
(either format keeps one of each per rank under the Lightning dict's "lightning_rec" key)."""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def loader_state_for_rank(meta: Mapping[str, Any], rank: int, world_size: int) -> Any:
    """This rank's dataloader state from a checkpoint's Lightning dict, either format (None: start the epoch over).

    Saved at another number of ranks: each loader's state holds every saved rank's (`{"ranks": [...]}`), and the
    loader continues the epoch over the rows no rank read, or says why it cannot (lightning_rec/data/elastic.py)."""
    info = meta.get("lightning_rec", {})
    states = info.get("loader_states")
    if states is None:
        return None
    if len(states) == world_size:
        return states[rank]
    # lightning_rec's loaders (a "fingerprint") read every rank's state; any other loader gets none, as before
    if not all(isinstance(s, list) and len(s) == len(states[0]) and
               all(isinstance(one, dict) and "fingerprint" in one for one in s) for s in states):
        warnings.warn(f"the checkpoint's dataloader state was saved by {len(states)} ranks, this run has "
                      f"{world_size}: each rank's loader starts the interrupted epoch over (the steps already "
                      f"taken in it are not repeated; its batches are)", stacklevel=2)
        return None
    return [{"ranks": [s[i] for s in states]} for i in range(len(states[0]))]


def rng_state() -> dict[str, Any]:
    """This process's random number generators: torch's (CPU, and the current CUDA device's once CUDA is in use),
    numpy's and Python's. Lightning's checkpoints leave them out, so a resumed run would draw other dropout masks (or
    anything else a step draws) than the uninterrupted one."""
    # numpy's state as a tensor and plain numbers: a gathered file must still load with torch.load(weights_only=True)
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (str(kind), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_state_for_rank(meta: Mapping[str, Any], rank: int, world_size: int) -> Any:
    """This rank's generator states from a checkpoint's Lightning dict (either format); None when it has none, or
    was saved by another number of ranks (whose batches and draws differ anyway)."""
    states = (meta.get("lightning_rec") or {}).get("rng_states")
    if not states or len(states) != world_size or states[rank] is None:
        return None
    return states[rank]
