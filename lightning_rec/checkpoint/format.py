"""The on-disk format of a checkpoint: its files, its entry names and the keys of its Lightning dict
(docs/checkpoints.md, "On disk": the layout, every entry name, the commit, the one-file format)."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_rec.fqn import WRAPPER_PREFIXES

LIGHTNING_FILE = "lightning.pt"
METADATA_FILE = ".metadata"
FORMATS = ("dcp", "gathered")
STATE_DICT = "state_dict."  # the model's entries
PER_ROW = "@per_row"
# the LightningModule's class path in a checkpoint (the library's modules write it): export rebuilds the module from it
MODULE_CLASS_KEY = "lightning_rec_module_class"
# in the pickled `rest` entry: this dense part's state is in `optimizer_states.<i>.dense[.<part>]` entries
DENSE_IN_DCP = "lightning_rec: state in DCP entries"
# in the one-file format: a dense part whose state was sharded (FSDP), stored whole by parameter name
# (get_optimizer_state_dict(full_state_dict=True)) as {FULL_BY_NAME: that state}
FULL_BY_NAME = "lightning_rec: whole state by parameter name"


def optimizer_prefix(index: int) -> str:
    return f"optimizer_states.{index}."


def dense_key(prefix: str, name: str) -> str:
    return f"{prefix}dense.{name}" if name else f"{prefix}dense"


def rest_key(prefix: str, rank: int | None = None) -> str:
    """The pickled dense state, written once; sharded (DTensor) state saved without module= is written once per rank
    (`rank`) and loads only at that world size."""
    return f"{prefix}rest" if rank is None else f"{prefix}rest.rank{rank}"


def is_dense_in_dcp(value: Any) -> bool:
    return isinstance(value, str) and value == DENSE_IN_DCP


def saved_name(head: str, key: str, suffix: str, saved: Mapping[str, Any]) -> str:
    """`head + key` (without `suffix`, which the caller adds), or the wrapped name an older save used.

    Before fused state was named by the model's own paths (optim.fused_modules), an optimizer built on a
    DistributedModelParallel (or DDP) saved it under its wrappers' names too: these still load."""
    if head + key + suffix not in saved:
        for wrapped in WRAPPER_PREFIXES:
            if head + wrapped + key + suffix in saved:
                return head + wrapped + key
    return head + key


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).is_dir()


def partial_name(path: Path, tag: str) -> Path:
    """Where a save of `path` writes before its commit: hidden, so that nothing loads it."""
    return path.parent / f".{path.name}.partial-{tag}"


def module_class(meta: Mapping[str, Any]) -> str | None:
    """The LightningModule class that wrote a checkpoint; None when nothing in it says.

    strategy="rec" records it, as do DLRMModule / TwoTowerModule under any strategy, and LightningCLI
    keeps `_class_path` in the hyperparameters; a user's own module saved by plain Lightning from Python
    carries none of them.
    """
    return (meta.get("lightning_rec", {}).get("module_class") or meta.get(MODULE_CLASS_KEY)
            or (meta.get("hyper_parameters") or {}).get("_class_path"))


def blob(obj: Any) -> bytes:
    """A small non-tensor object as one DCP bytes entry (DCP would otherwise split dicts into entries)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unblob(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
