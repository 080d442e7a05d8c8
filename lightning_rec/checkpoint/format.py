"""The on-disk format of a checkpoint: its files, its entry names and the keys of its Lightning dict.

A checkpoint is a directory (Lightning's `ModelCheckpoint` names it `epoch=0-step=20.ckpt`):

    <name>.ckpt/
      .metadata        DCP: every tensor's global shape and where each of its chunks lies
      __<r>_0.distcp   what rank r wrote: its own table shards and their fused optimizer state,
                       and its share of the replicated entries (dense layers, dense optimizer:
                       DCP writes each replicated entry once)
      lightning.pt     the rest of Lightning's checkpoint (epoch, loops, callbacks, hparams,
                       schedulers), with every rank's dataloader state and random number generator
                       states; written last by rank 0

Entry names in DCP (a flat dict; `t` a table, `s` an optimizer state name):

    state_dict.<key>                          the LightningModule's state dict; a sharded table is
                                              one tensor of its global shape [rows, dim], each rank
                                              writing the chunks it holds
    optimizer_states.<i>.fused.<path>.<t>.<s> fused state per element [rows, dim] (Adagrad, Adam)
    ...fused.<path>.<t>.<s>@per_row           fused state per row (row-wise Adagrad): [rows, K]
                                              whose chunks are one column wide, column k holding
                                              the state kept by the table's k-th column shard
                                              (loading takes their mean weighted by shard width,
                                              as `optim.merge_fused_state` does)
    ...fused.<path>.<t>.<s>                   a scalar (Adam's step): replicated
    optimizer_states.<i>.fused.param_groups   the fused learning rates (bytes)
    optimizer_states.<i>.rest                 the rest of the optimizer's state dict (the dense
                                              torch.optim part), pickled once
    optimizer_states.<i>.dense[.<part>]....   a dense part sharded by FSDP, by parameter name
                                              (get_optimizer_state_dict): DTensors written as their
                                              shards, so it loads at any world size; `rest` holds
                                              DENSE_IN_DCP in its place

Saving writes only this rank's pieces, straight from the kernels' memory, so the extra host memory
per rank is bounded by a piece, not the model. Loading asks DCP for the rectangles this rank's
layout holds and copies them straight into the kernels: any world size, any plan, or the unsharded
module.

A save is a commit: every rank writes into `.<name>.partial-<id>/`; after rank 0 has written
`lightning.pt`, rank 0 swaps the directory in under its final name. A save killed midway leaves a
hidden partial directory that nothing loads, and the previous checkpoint stays whole; the next save
of that name removes the leftovers.

The one-file format (`RecStrategy(checkpoint_format="gathered")`, and checkpoints from before the
directories) is Lightning's checkpoint dict as torch.save writes it, every sharded table whole under
its state-dict name and the fused optimizer state whole under its global names (FULL_BY_NAME marks a
dense part stored whole by parameter name); it loads into any world size, plan or the unsharded model.
"""

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
