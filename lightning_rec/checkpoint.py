"""Sharded checkpoints through torch.distributed.checkpoint (DCP): save, load, reshard, export.

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
    ...fused.<path>.<t>.<s>@per_row           fused state per row (row-wise Adagrad): [rows, dim]
                                              whose chunks are one column wide, at the column
                                              offset of the shard that kept it (a table split by
                                              columns keeps one per column shard: loading takes
                                              their mean weighted by shard width, as
                                              `optim.merge_fused_state` does)
    ...fused.<path>.<t>.<s>                   a scalar (Adam's step): replicated
    optimizer_states.<i>.fused.param_groups   the fused learning rates (bytes)
    optimizer_states.<i>.rest                 the rest of the optimizer's state dict (the dense
                                              torch.optim part), pickled once
    optimizer_states.<i>.dense[.<part>]....   a dense part sharded by FSDP, by parameter name
                                              (get_optimizer_state_dict): DTensors written as their
                                              shards, so it loads at any world size; `rest` holds
                                              DENSE_IN_DCP in its place

Saving writes only this rank's pieces, straight from the kernels' memory (no copy on CPU; from a
GPU one piece at a time), so the extra host memory per rank is bounded by a piece, not the model.
Loading asks DCP for the rectangles this rank's layout holds and copies them straight into the
kernels: any world size, any plan, or the unsharded module.

A save is a commit: every rank writes into `.<name>.partial-<id>/`; after rank 0 has written
`lightning.pt`, rank 0 renames the directory to its final name. A save killed midway leaves a
hidden partial directory that nothing loads (Lightning's `ckpt_path="last"` only sees `last*.ckpt`),
and the previous checkpoint stays whole. The next save of that name removes the partial leftovers.

Checkpoints from before (one file gathered on rank 0, `RecStrategy(checkpoint_format="gathered")`,
which still writes them) still load: the file is memory-mapped on every rank and each rank copies
its pieces out of it (see "the gathered format" below).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import pickle
import re
import shutil
import sys
import uuid
import warnings
import zipfile
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from lightning_rec._compat import distribute_tensor_takes_src_data_rank
from lightning_rec.collective_guard import CollectiveMismatch, CollectiveTimeout, PeerExited, peer_failure
from lightning_rec.errors import short_list
from lightning_rec.sharding.sharded_tensor import ShardedTensor

LIGHTNING_FILE = "lightning.pt"
METADATA_FILE = ".metadata"
PER_ROW = "@per_row"
FORMATS = ("dcp", "gathered")
# the LightningModule's class path in a checkpoint (the library's modules write it): export rebuilds the module from it
MODULE_CLASS_KEY = "lightning_rec_module_class"


# ------------------------------------------------------------------------------------------------
# the pieces of one global tensor, as DCP sees them


class _Pieces:
    """Rectangles of a tensor of `global_shape` that this rank writes (save) or wants (load).

    pieces: [(offsets, sizes, tensor)], the tensor holding (or receiving) exactly that rectangle.
    DCP asks for its chunks (`__create_write_items__` / `__create_chunk_list__`) and for the tensor
    of one chunk (the planners' lookup below).
    """

    def __init__(self, global_shape: Sequence[int], pieces: Sequence[tuple[Sequence[int], Sequence[int], Tensor]]):
        self.global_shape = torch.Size(global_shape)
        self.pieces = [(torch.Size(o), torch.Size(s), t) for o, s, t in pieces]

    def size(self) -> torch.Size:
        return self.global_shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self.global_shape,
                ),
            )
            for offsets, sizes, t in self.pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=s) for o, s, _ in self.pieces]

    def chunk(self, offset: torch.Size) -> Tensor:
        for o, _, t in self.pieces:
            if o == offset:
                return t
        raise AssertionError(f"no piece at {tuple(offset)}")


_NUMPY_DTYPES = {torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8}


def _own_storage(t: Tensor) -> Tensor:
    """The same memory as a tensor whose storage is exactly its bytes.

    DCP's writer (torch 2.11-2.13) copies a tensor whose storage is larger than itself (a table
    view into a fused kernel's flat weights) and keeps every copy until the rank's file is
    written: the rank's whole model in copies. Wrapped through numpy, the piece is written in
    place, with no copy at all.
    """
    if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in _NUMPY_DTYPES:
        return t
    if t.untyped_storage().nbytes() == t.nbytes:
        return t
    return torch.from_numpy(t.detach().numpy())


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, _Pieces):
            return _own_storage(obj.chunk(index.offset))
        value = super().lookup_object(index)
        return _own_storage(value) if isinstance(value, Tensor) else value


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's _init_state_dict rewrites the dict in place and turns objects it does not know into None
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, _Pieces)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(pieces)
        self.state_dict.update(pieces)  # our dicts are flat: flattening keeps their keys

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, _Pieces):
            return obj.chunk(index.offset)
        return super().lookup_tensor(index)


def _pieces_of(st: ShardedTensor) -> _Pieces:
    return _Pieces(st.global_shape, [(m.shard_offsets, m.shard_sizes, t) for m, t in st.local_shards])


# ------------------------------------------------------------------------------------------------
# optimizers: where the fused part sits


def fused_part(optimizer: torch.optim.Optimizer) -> str | None:
    """Where a FusedOptimizer's state sits in `optimizer.state_dict()`: "" (itself), a child name, or None."""
    from lightning_rec.optim import CombinedOptimizer, FusedOptimizer

    if isinstance(optimizer, FusedOptimizer):
        return ""
    if isinstance(optimizer, CombinedOptimizer):
        for name, child in optimizer.optimizers:
            if isinstance(child, FusedOptimizer):
                return name
    return None


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the real one


def _fused_child(optimizer: torch.optim.Optimizer, key: str):
    from lightning_rec.optim import FusedOptimizer

    if key == "":
        return optimizer
    child = dict(optimizer.optimizers)[key]
    assert isinstance(child, FusedOptimizer)
    return child


def _per_row_columns(fused) -> dict[str, list[int]]:
    """Per-row state key -> the column offsets of the shards that keep one (this rank's)."""
    out: dict[str, set[int]] = {}
    for key, (_, parts) in fused.global_state_pieces().items():
        if parts[0][1].dim() == 1:
            out.setdefault(key, set()).update(m.shard_offsets[1] if m is not None else 0 for m, _ in parts)
    return {k: sorted(v) for k, v in out.items()}


def _fused_entries(fused, prefix: str, columns: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """This rank's fused optimizer state as DCP entries (see the module docstring for the names).

    Per-row state is stored as [rows, K], K the number of column shards of the table over all
    ranks (`columns`: their offsets), column k holding the state kept by the k-th column shard.
    """
    out: dict[str, Any] = {}
    for key, ((rows, cols), parts) in fused.global_state_pieces().items():
        first = parts[0][1]
        if first.dim() == 0:
            out[f"{prefix}{key}"] = first
            continue
        chunks = []
        for meta, t in parts:
            (r, c), (nr, nc) = (meta.shard_offsets, meta.shard_sizes) if meta is not None else ((0, 0), (rows, cols))
            if first.dim() == 1:
                chunks.append(((r, list(columns[key]).index(c)), (nr, 1), t.view(nr, 1)))
            else:
                chunks.append(((r, c), (nr, nc), t))
        if first.dim() == 1:
            out[f"{prefix}{key}{PER_ROW}"] = _Pieces((rows, len(columns[key])), chunks)
        else:
            out[f"{prefix}{key}"] = _Pieces((rows, cols), chunks)
    return out


def _optimizer_entries(optimizer: torch.optim.Optimizer, i: int, columns: dict[str, list[int]],
                       module: torch.nn.Module | None = None, dmp: Any = None) -> dict[str, Any]:
    """Optimizer i's DCP entries; `columns` receives its per-row keys' column offsets over all ranks."""
    optimizer = _unwrap(optimizer)
    prefix = f"optimizer_states.{i}."
    fused_key = fused_part(optimizer)
    state = optimizer.state_dict()
    out: dict[str, Any] = {}
    if fused_key is not None:
        fused = _fused_child(optimizer, fused_key)
        mine = _per_row_columns(fused)
        everyone: dict[str, set[int]] = {}
        for part in _gather(mine, dmp):
            for k, offsets in part.items():
                everyone.setdefault(k, set()).update(offsets)
        for k, offsets in everyone.items():
            columns[f"{prefix}fused.{k}{PER_ROW}"] = sorted(offsets)
        out = _fused_entries(fused, f"{prefix}fused.", {k: sorted(v) for k, v in everyone.items()})
        out[f"{prefix}fused.param_groups"] = _blob(fused.state_dict()["param_groups"])
    out.update(_dense_entries(optimizer, fused_key, state, prefix, module))
    return out


# The dense (torch.optim) part. Replicated (DDP) state is one pickled entry, written once. FSDP's is
# sharded (DTensors): it goes through torch.distributed.checkpoint.state_dict's
# get_optimizer_state_dict (state keyed by parameter name, each DTensor written as its shards), so
# it loads at any world size; its place in the pickled entry holds DENSE_IN_DCP.

DENSE_IN_DCP = "lightning_rec: state in DCP entries"

try:  # torch >= 2.2; every torch this project supports (2.11-2.13) has both
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
except ImportError:  # pragma: no cover
    get_optimizer_state_dict = set_optimizer_state_dict = None


def _dense_parts(optimizer: torch.optim.Optimizer, fused_key: str | None,
                 state: Mapping[str, Any]) -> tuple[Any, dict[str, torch.optim.Optimizer]]:
    """The non-fused state (as the pickled entry holds it) and the optimizers it belongs to, by name
    ("" when it is the whole optimizer's)."""
    from lightning_rec.optim import CombinedOptimizer

    if isinstance(optimizer, CombinedOptimizer):
        return ({k: v for k, v in state.items() if k != fused_key},
                {n: c for n, c in optimizer.optimizers if n != fused_key})
    if fused_key is None:
        return state, {"": optimizer}
    return {}, {}


def _dense_key(prefix: str, name: str) -> str:
    return f"{prefix}dense.{name}" if name else f"{prefix}dense"


def _named_model(module: torch.nn.Module) -> torch.nn.Module:
    """The model whose parameter names the dense state is saved under: a DistributedModelParallel's own model, so
    that `save(..., module=dmp)` names them as the unsharded model does (not `_dmp_wrapped_module.<name>`, which
    only another DistributedModelParallel could load)."""
    from lightning_rec.model_parallel import DistributedModelParallel

    return module.module if isinstance(module, DistributedModelParallel) else module


def _wrapped_named_model(module: torch.nn.Module) -> torch.nn.Module:
    """A DistributedModelParallel's model under the names its wrappers gave the dense state before _named_model
    (and before DistributedModelParallel.named_parameters left them out): '_dmp_wrapped_module.<param>'
    (DDP's 'module.' is left out by torch's state_dict helpers). Checkpoints written so still load."""
    from lightning_rec.model_parallel import DistributedModelParallel

    if not isinstance(module, DistributedModelParallel):
        return module
    shim = torch.nn.Module()
    shim._dmp_wrapped_module = module._dmp_wrapped_module
    return shim


def _dense_entries(optimizer: torch.optim.Optimizer, fused_key: str | None, state: Mapping[str, Any], prefix: str,
                   module: torch.nn.Module | None) -> dict[str, Any]:
    rest, children = _dense_parts(optimizer, fused_key, state)
    out: dict[str, Any] = {}
    module = None if module is None else _named_model(module)
    if module is not None and get_optimizer_state_dict is not None:
        if "" in children:
            if _sharded(rest):
                out[_dense_key(prefix, "")] = get_optimizer_state_dict(module, optimizer)
                rest = DENSE_IN_DCP
        else:
            rest = dict(rest)
            for name, child in children.items():
                if _sharded(rest[name]):  # (an empty state has nothing to shard: pickled as before)
                    out[_dense_key(prefix, name)] = get_optimizer_state_dict(module, child)
                    rest[name] = DENSE_IN_DCP
    out[_rest_key(prefix, rest)] = _blob(rest)
    return out


def _sharded(obj: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return True
    if isinstance(obj, Mapping):
        return any(_sharded(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_sharded(v) for v in obj)
    return False


def _rest_key(prefix: str, rest: Any) -> str:
    """The pickled dense state is written once; sharded (DTensor) state that could not go through
    get_optimizer_state_dict (no module given) once per rank, and loads only at that world size."""
    return f"{prefix}rest.rank{_rank_world()[0]}" if _sharded(rest) else f"{prefix}rest"


def _is_dense_in_dcp(value: Any) -> bool:
    return isinstance(value, str) and value == DENSE_IN_DCP


def _load_dense(optimizer: torch.optim.Optimizer, key: str, module: torch.nn.Module | None, path: Path) -> None:
    """A dense optimizer's state saved through get_optimizer_state_dict: DCP reads the shards this
    rank's parameters hold (any world size), set_optimizer_state_dict puts them in place."""
    if module is None or set_optimizer_state_dict is None:
        raise ValueError(f"checkpoint {path}: the dense optimizer's state was saved sharded (FSDP) by parameter "
                         f"name: pass module= (the model the optimizer trains) to checkpoint.load_optimizer")
    reader, md = _read_metadata(path)
    # saved before _named_model, by a DistributedModelParallel: its names still load into one
    wrapped = any(k.startswith(f"{key}.state._dmp_wrapped_module.") for k in md.state_dict_metadata)
    names = _wrapped_named_model(module) if wrapped else _named_model(module)
    template = get_optimizer_state_dict(names, optimizer)  # this rank's layout (fresh state: zero-filled)
    _load({key: template}, reader, path)
    set_optimizer_state_dict(names, optimizer, template)


def _load_dense_parts(optimizer: torch.optim.Optimizer, fused_key: str | None, rest: Any, prefix: str,
                      module: torch.nn.Module | None, path: Path) -> None:
    from lightning_rec.optim import CombinedOptimizer

    if isinstance(optimizer, CombinedOptimizer):
        parts = [(name, child) for name, child in optimizer.optimizers if name != fused_key]
        for name, child in parts:
            saved_name = name
            if name not in rest and len(parts) == 1 and len(rest) == 1:
                # one dense part on each side, named by another way of combining them: TorchRec's
                # CombinedOptimizer([dmp.fused_optimizer, KeyedOptimizerWrapper(...)]) names it
                # '1_keyedoptimizerwrapper', combined_optimizer 'dense'
                saved_name = next(iter(rest))
            if saved_name not in rest:
                raise ValueError(f"checkpoint {path} has no state for optimizer part '{name}'; it has {list(rest)}")
            if _is_dense_in_dcp(rest[saved_name]):
                _load_dense(child, _dense_key(prefix, saved_name), module, path)
            else:
                _load_whole_state(child, rest[saved_name], module, path)
        optimizer._sync_groups()
    elif fused_key is None:
        if _is_dense_in_dcp(rest):
            _load_dense(optimizer, _dense_key(prefix, ""), module, path)
        elif isinstance(rest, Mapping) and "param_groups" not in rest:
            # a combined optimizer's (its parts by name) into one torch optimizer: torch said KeyError: 'param_groups'
            index = prefix.split(".")[1]
            raise ValueError(f"checkpoint {path}: optimizer {index} was saved as a combined optimizer (the fused "
                             f"tables' part and the dense part(s) {list(rest)}), and this one is a "
                             f"{type(optimizer).__name__}: restore it into the same kind, lightning_rec.optim."
                             f"combined_optimizer(model, dense_optimizer) (the module's configure_optimizers()), or "
                             f"load only the weights with checkpoint.load_model(model, path)")
        else:
            _load_whole_state(optimizer, rest, module, path)


def load_torch_optimizer_state(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    """`optimizer.load_state_dict(saved)` for a torch.optim optimizer, also when `saved` was written before a sharded
    collection had table parameters.

    An optimizer built over `model.parameters()` holds, since then, one (empty) parameter per sharded table: its
    state saved before (by index, without them) met torch's "loaded state dict contains a parameter group that
    doesn't match the size of optimizer's group". The tables never hold optimizer state (no gradient), so each group
    that differs by exactly its table parameters gets them back in their places, with no state."""
    from lightning_rec.table_weight import FusedTableWeight

    theirs = saved.get("param_groups") if isinstance(saved, Mapping) else None
    ours = optimizer.param_groups
    by_index = isinstance(theirs, list) and all(isinstance(s, Mapping) and isinstance(s.get("params"), list)
                                                for s in theirs)  # torch's format (a fused part's has no "params")
    if by_index and len(theirs) == len(ours) and any(
            len(g["params"]) != len(s["params"]) for g, s in zip(ours, theirs)):
        tables = [[isinstance(p, FusedTableWeight) for p in g["params"]] for g in ours]
        if all(len(flags) - sum(flags) == len(s["params"]) for flags, s in zip(tables, theirs)):
            taken = [i for s in theirs for i in s["params"] if isinstance(i, int)]
            fresh = iter(range(max(taken, default=-1) + 1, 1 << 62))
            groups = []
            for flags, s in zip(tables, theirs):
                kept = iter(s["params"])
                groups.append({**s, "params": [next(fresh) if table else next(kept) for table in flags]})
            saved = {**saved, "param_groups": groups}
    optimizer.load_state_dict(saved)


def _load_whole_state(optimizer: torch.optim.Optimizer, saved: Any, module: torch.nn.Module | None,
                      path: Any = None) -> None:
    """A dense optimizer's whole-tensor state (saved with dense='ddp', or unsharded) into `optimizer`; when the
    optimizer now trains FSDP-sharded parameters (dense='fsdp'), the state goes in by parameter name and each rank
    keeps its shards. Loaded as it was, its whole tensors met the parameters' DTensors at the first step ("got mixed
    torch.Tensor and DTensor")."""
    from torch.distributed.tensor import DTensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    theirs = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not any(isinstance(p, DTensor) for p in params) or _sharded(saved) or not isinstance(theirs, list):
        load_torch_optimizer_state(optimizer, saved)
        return
    if module is None or set_optimizer_state_dict is None:
        raise ValueError(f"checkpoint {path}: the dense optimizer's state was saved whole (dense='ddp') and this one "
                         f"trains sharded (FSDP) parameters: pass module= (the model it trains) to "
                         f"checkpoint.load_optimizer, which then keeps each rank's shards")
    names = _named_model(module)
    template = get_optimizer_state_dict(names, optimizer, options=_full_options())  # our parameters' names, in order
    ours = [g["params"] for g in template["param_groups"]]
    if [len(g) for g in ours] != [len(g.get("params", ())) for g in theirs]:
        load_torch_optimizer_state(optimizer, saved)  # torch names the difference
        return
    fqn = {i: name for g, t in zip(ours, theirs) for name, i in zip(g, t["params"])}
    whole = {"state": {fqn[i]: st for i, st in saved.get("state", {}).items() if i in fqn},
             "param_groups": [{**t, "params": g} for g, t in zip(ours, theirs)]}
    set_optimizer_state_dict(names, optimizer, whole, options=_full_options())


def _blob(obj: Any) -> bytes:
    """A small non-tensor object as one DCP bytes entry (DCP would otherwise split dicts into entries)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unblob(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


# ------------------------------------------------------------------------------------------------
# the public calls' arguments: a model, an optimizer and a path are easy to swap, and each of them
# used to fail deep inside (`'DLRMModule' object is not subscriptable`) or, worse, be written as
# something else (a model in `optimizers` was saved as an optimizer)

SAVE_SIGNATURE = ("lightning_rec.checkpoint.save({'state_dict': model.state_dict(), ...}, path, "
                  "optimizers=[optimizer], module=model)")
LOAD_MODEL_SIGNATURE = "lightning_rec.checkpoint.load_model(model, path)"
LOAD_OPTIMIZER_SIGNATURE = "lightning_rec.checkpoint.load_optimizer(optimizer, path, index=0, module=model)"


def _is_optimizer(obj: Any) -> bool:
    return isinstance(_unwrap(obj), torch.optim.Optimizer)


def _is_path(obj: Any) -> bool:
    return isinstance(obj, (str, os.PathLike))


def _what(obj: Any) -> str:
    name = type(obj).__name__
    if isinstance(obj, torch.nn.Module):
        return f"a model ({name})"
    if _is_optimizer(obj):
        return f"an optimizer ({name})"
    if _is_path(obj):
        return f"a path ({str(obj)!r})"
    if isinstance(obj, (list, tuple)):
        return f"a {name} of {len(obj)}: [{', '.join(type(o).__name__ for o in obj)}]"
    return f"a {name}"


def _wrong(signature: str, arg: str, obj: Any, want: str) -> TypeError:
    return TypeError(f"{signature.split('(')[0]}: {arg} must be {want}, got {_what(obj)}. Call it as {signature}")


def _check_path(signature: str, path: Any) -> None:
    if not _is_path(path):
        raise _wrong(signature, "path", path, "a path (str or os.PathLike)")


def _check_module(signature: str, module: Any, optional: bool = False) -> None:
    if optional and module is None:
        return
    if not isinstance(module, torch.nn.Module):
        raise _wrong(signature, "module" if optional else "model", module,
                     "the model (an nn.Module: the DistributedModelParallel, LightningModule or unsharded model)")


def _check_save_args(checkpoint: Any, path: Any, optimizers: Any, module: Any) -> None:
    if not isinstance(checkpoint, Mapping):
        raise _wrong(SAVE_SIGNATURE, "checkpoint (the first argument)", checkpoint,
                     "a dict holding the model's state dict: {'state_dict': model.state_dict()}")
    if "state_dict" not in checkpoint:
        raise ValueError(f"lightning_rec.checkpoint.save: the checkpoint dict has no 'state_dict' entry (its keys: "
                         f"{short_list([str(k) for k in checkpoint], 4)}); a model's state dict goes in as "
                         f"{{'state_dict': model.state_dict()}}. Call it as {SAVE_SIGNATURE}")
    _check_path(SAVE_SIGNATURE, path)
    if not isinstance(optimizers, Sequence) or isinstance(optimizers, (str, bytes)):
        raise _wrong(SAVE_SIGNATURE, "optimizers", optimizers, "a list of optimizers: optimizers=[optimizer]")
    for i, opt in enumerate(optimizers):
        if not _is_optimizer(opt):
            raise _wrong(SAVE_SIGNATURE, f"optimizers[{i}]", opt, "an optimizer (torch.optim.Optimizer)")
    _check_module(SAVE_SIGNATURE, module, optional=True)


# ------------------------------------------------------------------------------------------------
# save


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).is_dir()


def _partial_name(path: Path, tag: str) -> Path:
    return path.parent / f".{path.name}.partial-{tag}"


GUARD_ERRORS = (CollectiveMismatch, CollectiveTimeout, PeerExited)  # the guard's verdicts: each names its ranks


def _broadcast(obj: Any, dmp: Any = None) -> Any:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    if dmp is not None:  # guarded: a peer that does not come is named within its timeout
        return dmp.all_gather_object(obj)[0]
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj: Any, dmp: Any = None) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    if dmp is not None:
        return dmp.all_gather_object(obj)
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier_device_ids(backend: str, current_index: Callable[[], int]) -> dict[str, Any]:
    """dist.barrier's device_ids on NCCL (the current device), so that it neither warns nor guesses a
    device from the rank; nothing for gloo, whose barrier takes none."""
    return {"device_ids": [current_index()]} if backend == "nccl" else {}


def _barrier(dmp: Any = None, tag: str = "checkpoint barrier") -> None:
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    if dmp is None:
        dist.barrier(**barrier_device_ids(dist.get_backend(), torch.cuda.current_device))
        return
    # through the DistributedModelParallel's embedding group and its guard: a peer stopped or stuck is named
    # within RecStrategy(embedding_timeout=...), not after the default group's timeout (Lightning's: 30 min)
    pg, guard = dmp._emb_pg, dmp._guard
    k = guard.begin()
    work = dist.barrier(group=pg, async_op=True, **barrier_device_ids(dist.get_backend(pg), torch.cuda.current_device))
    guard.wait_work(work, tag, k)


def _group(dmp: Any = None) -> Any:
    """The process group of DCP's own exchanges: the DistributedModelParallel's checkpoint group, whose timeout is
    the strategy's (None: the default group)."""
    return getattr(dmp, "_checkpoint_pg", None)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def save(checkpoint: Mapping[str, Any], path: str | os.PathLike, optimizers: Sequence[torch.optim.Optimizer] = (),
         loader_state: Any = None, module_class: str | None = None, module: torch.nn.Module | None = None,
         rng_state: Any = None, dmp: Any = None) -> None:
    """Write a Lightning checkpoint dict as a sharded DCP directory (collective: every rank calls it).

    checkpoint: Lightning's dict, whose "state_dict" is this rank's (sharded tables as ShardedTensor);
        its "optimizer_states" are ignored: the `optimizers` themselves are read, shard by shard.
    loader_state: this rank's dataloader state (gathered to rank 0's `lightning.pt`, one per rank).
    module: the model the optimizers train. With FSDP dense layers it lets their optimizer state be
        saved by parameter name (get_optimizer_state_dict), which loads at any world size; without
        it, FSDP's dense optimizer state reloads only at this world size.
    rng_state: this rank's `rng_state()` (gathered like loader_state; `rng_state_for_rank` reads it back).
    dmp: the DistributedModelParallel of the model (RecStrategy passes its own): every exchange of the save, DCP's
        included, then runs on its embedding group, so a peer that stops or hangs mid-save is named within its
        timeout (RecStrategy(embedding_timeout=...)) instead of blocking the others for the default group's
        timeout (Lightning's: 30 min). None: the default group.
    """
    _check_save_args(checkpoint, path, optimizers, module)
    path = local_path(path)  # file://: the local directory it names
    _refuse_url(path)
    path = Path(path)
    rank, world = _rank_world()
    try:  # the first exchanges: a rank that does not come (or left) shows here, before anything is written
        tag = _broadcast(uuid.uuid4().hex[:12] if rank == 0 else None, dmp)
        loader_states, rng_states, paths = zip(*_gather((loader_state, rng_state, os.path.normpath(path)), dmp))
    except Exception as e:  # noqa: BLE001 - named with the usual cause below
        said = "The save is collective: every rank calls it (trainer.save_checkpoint too, not only under " \
               "`if trainer.is_global_zero:`). Nothing was written."
        if isinstance(e, GUARD_ERRORS):  # the guard's verdict names the rank and the timeout's setting
            raise type(e)(f"saving checkpoint {path}: {e}. {said}") from e
        peer = peer_failure(f"saving checkpoint {path}", e, said)
        if peer is not None:
            raise peer from e
        raise RuntimeError(f"saving checkpoint {path}: rank {rank} of {world} could not reach the other ranks ({e}). "
                           f"{said}") from e
    if len(set(paths)) > 1:  # each rank's pieces would go to its own directory: rank 0's would lack the others'
        given = ", ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
        raise ValueError(f"checkpoint.save got another path on each rank ({given}): every rank passes the same path "
                         f"(one checkpoint directory holds every rank's pieces; trainer.save_checkpoint too). Nothing "
                         f"was written")
    partial = _partial_name(path, tag)
    entries: dict[str, Any] = {}
    for key, value in checkpoint["state_dict"].items():
        entries[f"state_dict.{key}"] = _pieces_of(value) if isinstance(value, ShardedTensor) else value
    columns: dict[str, list[int]] = {}
    for i, optimizer in enumerate(optimizers):
        entries.update(_optimizer_entries(optimizer, i, columns, module, dmp))
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    meta["lightning_rec"] = {"format": "dcp", "world_size": world, "num_optimizers": len(optimizers),
                             "module_class": module_class, "per_row_columns": columns, "loader_states": None,
                             "rng_states": None}
    error: BaseException | None = None
    try:
        if rank == 0:
            for stale in path.parent.glob(f".{path.name}.partial-*"):
                _remove_stale(stale)  # a save killed earlier
            partial.mkdir(parents=True)
        _barrier(dmp)
        # One file per rank when the pieces are host memory (written in place, see _own_storage); from a
        # GPU, one file per piece, so that host copies live one piece at a time, not a rank's worth.
        on_host = all(_device_of(v) == "cpu" for v in entries.values())
        on_host = all(_gather(on_host, dmp))
        writer = dcp.FileSystemWriter(str(partial), sync_files=True, single_file_per_rank=on_host)
        with warnings.catch_warnings():  # one process without torch.distributed is what we mean here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(entries, storage_writer=writer, planner=_SavePlanner(), process_group=_group(dmp))
        if rank == 0:
            meta["lightning_rec"]["loader_states"] = list(loader_states)
            meta["lightning_rec"]["rng_states"] = list(rng_states) if rng_state is not None else None
            with open(partial / (LIGHTNING_FILE + ".tmp"), "wb") as f:
                torch.save(meta, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial / (LIGHTNING_FILE + ".tmp"), partial / LIGHTNING_FILE)
    except BaseException as e:  # noqa: BLE001 - every rank must still reach the agreement below
        error = e
    try:
        failed = [r for r, e in enumerate(_gather(error is not None, dmp)) if e]
    except Exception as e:  # noqa: BLE001 - a peer is gone: say which, and that nothing was committed
        kept = f"Nothing was committed: {path} is unchanged (the partial directory {partial.name} is removed by the " \
               f"next save of that name)."
        if isinstance(e, GUARD_ERRORS):
            raise type(e)(f"saving checkpoint {path}: {e}. {kept}") from (error or e)
        peer = peer_failure(f"saving checkpoint {path}", error or e, kept)
        if peer is not None:
            raise peer from (error or e)
        raise RuntimeError(f"saving checkpoint {path}: the ranks could not agree that every part was written "
                           f"({e}). {kept}") from (error or e)
    if failed:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        if error is not None:
            raise error
        raise OSError(f"checkpoint {path}: rank(s) {failed} could not write their part; nothing was committed "
                      f"and the previous checkpoint is unchanged")
    if rank == 0:
        _commit(partial, path)
    _barrier(dmp)


def _remove_stale(stale: Path) -> None:
    """A killed save's leftover, a directory (sharded format) or a file (gathered): either format's next save of that
    name removes both kinds (unlink on a directory raised IsADirectoryError and failed the save; rmtree left a file)."""
    if stale.is_dir() and not stale.is_symlink():
        shutil.rmtree(stale, ignore_errors=True)
    else:
        stale.unlink(missing_ok=True)


def _refuse_url(path: str | os.PathLike) -> None:
    """Every rank writes its pieces with local file calls: an s3:// path became a local directory named `s3:` (on a
    cloud machine, gone with its disk) while the run said it had saved. Refused on every rank, before any collective.
    A file:// URL names a local path: written there."""
    if not is_local_path(local_path(path)):
        head = str(path).split("://")[0]
        raise ValueError(f"checkpoint {path} is a URL, but sharded checkpoints are written by every rank to a local or "
                         f"mounted file system (it would have gone to a local directory named '{head}:'): give "
                         f"ModelCheckpoint(dirpath=...) a local or mounted path (copy it to {head}:// after), or use "
                         f"RecStrategy(checkpoint_format='gathered'), one file written through Lightning's "
                         f"CheckpointIO (fsspec: s3://, gs://, ...)")


def refuse_resolved_file_url(dirpath: str | os.PathLike) -> None:
    """ModelCheckpoint(dirpath="file:///data/ckpt"): Lightning (2.6) resolves a dirpath it takes for local with
    os.path.realpath, which reads "file:" as a directory name: the checkpoints went to <cwd>/file:/data/ckpt, and a
    later run with the same dirpath only found them from the same working directory. Refused before training."""
    parts = Path(dirpath).parts
    if is_local_path(dirpath) and "file:" in parts:
        at = parts.index("file:")
        meant = Path("/", *parts[at + 1:])
        raise ValueError(f"ModelCheckpoint(dirpath=...) was given as a file:// URL, which Lightning resolves against "
                         f"the working directory: its checkpoints would go to {dirpath}, not {meant}. Give the path "
                         f"itself: ModelCheckpoint(dirpath={str(meant)!r})")


def _device_of(value: Any) -> str:
    if isinstance(value, _Pieces):
        return next((t.device.type for _, _, t in value.pieces if t.device.type != "cpu"), "cpu")
    return value.device.type if isinstance(value, Tensor) else "cpu"


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the OS or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc without it (glibc < 2.28, musl)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _commit(partial: Path, path: Path) -> None:
    if path.exists() or path.is_symlink():
        # Two renames (path -> old, partial -> path) left, if killed between them, no checkpoint under `path`: the
        # previous one hidden as `.old-*`, the new one as `.partial-*` (which the next save deletes), and
        # ckpt_path="last" starting over. Swapped in one step, `path` is always one whole checkpoint.
        if _exchange(partial, path):
            old = partial  # now holds the previous checkpoint
        else:
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(path, old)
            os.replace(partial, path)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    else:
        os.replace(partial, path)


# ------------------------------------------------------------------------------------------------
# load


class DCPCheckpoint(MutableMapping):
    """Stands in for the tensors of a DCP checkpoint in Lightning's loaded dict until they are read.

    The model's (`index` None) is also the state dict that a LightningModule's `on_load_checkpoint(checkpoint)` finds
    in `checkpoint["state_dict"]`: read, it holds every tensor whole, read on this rank alone on first use; changed
    (a key renamed, one dropped), that dict is what loads (each rank keeping its pieces). Untouched, every rank reads
    only its pieces from disk. (It was an opaque marker: "'DCPCheckpoint' object has no attribute 'items'".)
    """

    def __init__(self, path: Path, index: int | None = None) -> None:
        self.path, self.index = path, index
        self._whole: dict[str, Tensor] | None = None
        self.modified = False

    def __repr__(self) -> str:
        return f"DCPCheckpoint({str(self.path)!r}{'' if self.index is None else f', optimizer {self.index}'})"

    def _state(self) -> dict[str, Tensor]:
        if self.index is not None:
            raise TypeError(f"{self!r}: a sharded checkpoint's optimizer state is read by the strategy, shard by "
                            f"shard (lightning_rec.checkpoint.load_optimizer), not as a dict")
        if self._whole is None:
            self._whole = _full_model_state(self.path, local=True)[0]
        return self._whole

    def __getitem__(self, key: str) -> Tensor:
        return self._state()[key]

    def __iter__(self):
        return iter(self._state())

    def __len__(self) -> int:
        return len(self._state())

    def __setitem__(self, key: str, value: Tensor) -> None:
        self._state()[key] = value
        self.modified = True

    def __delitem__(self, key: str) -> None:
        del self._state()[key]
        self.modified = True


def _not_a_dcp_checkpoint(path: Path, wanted: str = "a checkpoint directory written by lightning_rec.checkpoint.save "
                                                          "(DCP)") -> str | None:
    """What `path` is, and what loads it, when it is not a DCP checkpoint directory; None when it may be one
    (a file or an export directory was reported as "a checkpoint directory whose save did not finish")."""
    if path.is_dir():
        if (path / "model.safetensors").is_file() and (path / "config.json").is_file():
            return (f"{path} is an export directory (lightning-rec export / checkpoint.export), not a checkpoint: "
                    f"load it with lightning_rec.checkpoint.load_exported({str(path)!r})")
        return None
    head = f"{path} is a file, not {wanted}"
    if path.suffix == ".safetensors":
        return (f"{head}: a safetensors file; an export's loads with lightning_rec.checkpoint.load_exported"
                f"({str(path.parent)!r})")
    try:
        obj = load_file(path)
    except ValueError:
        return f"{head}, and not one torch.load reads either"
    if isinstance(obj, Mapping) and "state_dict" in obj:
        return (f"{head}: a one-file Lightning checkpoint (RecStrategy(checkpoint_format='gathered') or another "
                f"strategy). Resume from it with trainer.fit(..., ckpt_path={str(path)!r}), or load its weights with "
                f"model.load_state_dict(lightning_rec.checkpoint.full_state_dict({str(path)!r}))")
    if isinstance(obj, Mapping) and any(isinstance(v, ShardedTensor) for v in obj.values()):
        return (f"{head}: one rank's state dict written by torch.save(dmp.state_dict()), holding only that rank's "
                f"pieces of the sharded tables. Combine every rank's file (ShardedTensor.merge per table) and load "
                f"with dmp.load_state_dict(merged); lightning_rec.checkpoint.save writes one checkpoint every layout "
                f"loads")
    if isinstance(obj, Mapping) and obj and all(isinstance(v, Tensor) for v in obj.values()):
        return (f"{head}: a state dict written by torch.save(model.state_dict()). Load it with "
                f"model.load_state_dict(torch.load({str(path)!r})) (a sharded model takes whole tables too, "
                f"each rank keeping its pieces)")
    return f"{head}: torch.save wrote a {type(obj).__name__} into it"


def _check_complete(path: Path) -> None:
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    other = _not_a_dcp_checkpoint(path)
    if other is not None:
        raise ValueError(other)
    if not (path / METADATA_FILE).is_file() or not (path / LIGHTNING_FILE).is_file():
        missing = [n for n in (METADATA_FILE, LIGHTNING_FILE) if not (path / n).is_file()]
        held = sorted(p.name for p in path.iterdir() if p.name.endswith(".ckpt") or (p / LIGHTNING_FILE).is_file())
        if len(missing) == 2 and held:  # ModelCheckpoint's dirpath, given for one of its checkpoints: not a broken save
            last = "last.ckpt" if "last.ckpt" in held else held[-1]
            shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
            raise ValueError(f"{path} is a folder of checkpoints ({shown}), not one checkpoint: give one of them, "
                             f"e.g. {path / last} (or ckpt_path='last' with "
                             f"ModelCheckpoint(dirpath={str(path)!r}, save_last=True))")
        raise ValueError(f"checkpoint directory {path} is incomplete (no {', '.join(missing)}): its save did not "
                         f"finish. Use an earlier checkpoint (with ModelCheckpoint(save_last=True), ckpt_path='last' "
                         f"picks the last complete one)")


def _read_metadata(path: Path):
    _check_complete(path)
    reader = dcp.FileSystemReader(str(path))
    try:
        md = reader.read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise ValueError(f"checkpoint {path} is damaged: its index {path / '.metadata'} cannot be read "
                         f"({type(e).__name__}: {e}): restore it from where the checkpoint was written, or use an "
                         f"earlier checkpoint") from e
    # every file that an entry lives in must be there, and long enough (a copy cut short, a lost rank's file)
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    problems = []
    for rel, size in sorted(needed.items()):
        f = path / rel
        if not f.is_file():
            problems.append(f"{f} is missing")
        elif f.stat().st_size < size:
            problems.append(f"{f} is incomplete ({f.stat().st_size} of {size} bytes)")
    if problems:
        raise ValueError(f"checkpoint {path} is damaged: " + "; ".join(problems) +
                         ". Restore the file(s) from where the checkpoint was written, or use an earlier checkpoint")
    return reader, md


def _lightning_meta(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / LIGHTNING_FILE, map_location="cpu", weights_only=False)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as e:
        raise ValueError(f"checkpoint file {path / LIGHTNING_FILE} is incomplete or damaged ({e}): "
                         f"use an earlier checkpoint") from e


lightning_meta = _lightning_meta  # the Lightning dict of a sharded checkpoint, tensors left out (the CLI reads it)


def read_lightning_state(path: str | os.PathLike) -> dict[str, Any]:
    """Lightning's checkpoint dict of a DCP directory, its tensors left on disk (`DCPCheckpoint` markers)."""
    path = _readable_path(path)
    _read_metadata(path)
    meta = _lightning_meta(path)
    info = meta.get("lightning_rec", {})
    meta["state_dict"] = DCPCheckpoint(path)
    if info.get("num_optimizers", 0) or "lr_schedulers" in meta:
        meta["optimizer_states"] = [DCPCheckpoint(path, i) for i in range(info.get("num_optimizers", 0))]
    # else ModelCheckpoint(save_weights_only=True) wrote it: without the entry Lightning's resume says so (with an
    # empty one it went past the optimizers, fresh, and named the learning-rate schedulers instead)
    return meta


def _chunks(md_entry) -> list[ChunkStorageMetadata]:
    return list(md_entry.chunks) if isinstance(md_entry, TensorStorageMetadata) else []


def _uncovered(md_entry, offsets: Sequence[int], sizes: Sequence[int]) -> bool:
    """Whether the saved chunks (which never overlap) leave part of this rectangle unwritten."""
    need = 1
    for s in sizes:
        need *= int(s)
    got = 0
    for ch in _chunks(md_entry):
        area = 1
        for o, s, co, cs in zip(offsets, sizes, ch.offsets, ch.sizes):
            lo, hi = max(int(o), int(co)), min(int(o) + int(s), int(co) + int(cs))
            area *= max(0, hi - lo)
        got += area
    return got < need


def _check_targets(path: Path, md, targets: Mapping[str, Any], what: str, strict: bool = True,
                   saved_prefix: str | None = None, written_by: str | None = None,
                   nothing_matched: bool = False) -> None:
    """Names every entry the checkpoint lacks or holds with another shape, before anything is read.

    nothing_matched: strict=False was given and no entry of the model is in the checkpoint (said, not skipped)."""
    saved = md.state_dict_metadata
    missing, shapes, holes = [], [], []
    for fqn, obj in targets.items():
        if fqn not in saved:
            missing.append(fqn)
            continue
        entry = saved[fqn]
        if isinstance(obj, (Tensor, _Pieces)):
            if not isinstance(entry, TensorStorageMetadata):
                shapes.append(f"{fqn}: not a tensor in the checkpoint")
                continue
            if tuple(entry.size) != tuple(obj.size()):
                shapes.append(f"{fqn}: {tuple(entry.size)} in the checkpoint, {tuple(obj.size())} here")
                continue
            chunks = obj.__create_chunk_list__() if isinstance(obj, _Pieces) else [
                ChunkStorageMetadata(torch.Size([0] * obj.dim()), obj.shape)]
            if any(_uncovered(entry, c.offsets, c.sizes) for c in chunks):
                holes.append(fqn)
    unexpected = []
    if strict and saved_prefix is not None:
        unexpected = [k for k in saved if k.startswith(saved_prefix) and k not in targets]
    lines = []
    prefix_hint = _prefix_hint(missing, unexpected, saved_prefix) if saved_prefix is not None else None
    if prefix_hint:
        lines.append(prefix_hint)
    if shapes:
        lines.append("shapes differ: " + "; ".join(shapes))
    if missing:
        lines.append(f"not in the checkpoint: {short_list(missing)}")
    if unexpected:
        lines.append(f"in the checkpoint but not in this model: {short_list(unexpected)}")
    if holes:
        lines.append(f"the checkpoint's chunks do not cover what this rank holds of: {short_list(holes)} "
                     f"(a rank's part is missing)")
    if lines and written_by:
        lines.insert(0, f"it was written by {written_by}")
    if lines and nothing_matched:
        lines.insert(0, "strict=False would skip every entry of this model: none is in the checkpoint")
    if lines:
        fix = ("\nLoad it into a model built with the same tables and dims (resharding to another world size or plan "
               "is fine)")
        if shapes:  # strict=False skips entries, never loads one into another shape: naming it sent users round
            fix += ": strict=False skips missing and unexpected entries, not a table or layer of another size"
        elif prefix_hint or nothing_matched:  # strict=False would load nothing
            pass
        else:
            fix += (", or pass strict=False to skip the entries that differ (under a Trainer: "
                    "`self.strict_loading = False` in the LightningModule)")
        raise ValueError(f"checkpoint {path} does not match this {what}: " + "\n  ".join(lines) + fix)


def _prefix_hint(missing: Sequence[str], unexpected: Sequence[str], head: str) -> str | None:
    """When the two sides' names differ by one leading prefix (a checkpoint of a LightningModule loaded into its
    `self.model`, or the other way), say so: the lists alone showed every name twice and named no cause."""
    if not missing or len(missing) != len(unexpected):
        return None
    ours = sorted(k[len(head):] for k in missing)
    theirs = set(k[len(head):] for k in unexpected)
    first = ours[0]
    for t in theirs:
        if t != first and t.endswith("." + first):  # the checkpoint's names carry a prefix ours lack
            extra = t[: -len(first)]
            if all(extra + k in theirs for k in ours):
                return (f"the checkpoint's names start with '{extra}' where this model's do not: it was saved from "
                        f"a module around this one (e.g. the LightningModule whose '{extra[:-1]}' this is); load it "
                        f"into that module")
        if first != t and first.endswith("." + t):  # ours carry a prefix the checkpoint's lack
            extra = first[: -len(t)]
            if all(k.startswith(extra) and k[len(extra):] in theirs for k in ours):
                return (f"this model's names start with '{extra}' where the checkpoint's do not: it was saved from "
                        f"this model's '{extra[:-1]}' (e.g. a hand loop over LightningModule.{extra[:-1]}); load it "
                        f"into that submodule (model.{extra[:-1]})")
    return None


def _dmp_of(module: Any) -> Any:
    """The DistributedModelParallel whose groups bound a load's waits: `module` itself, or the one RecStrategy sharded
    it with; None (the default group) when there is none or its groups were destroyed."""
    if module is None:
        return None
    dmp = module if hasattr(module, "_checkpoint_pg") else vars(module).get("_lightning_rec_dmp")
    return dmp if dmp is not None and dmp.groups_alive() else None


def _load(targets: dict[str, Any], reader, path: Path, local: bool = False, dmp: Any = None) -> None:
    """local: this rank reads alone (not a collective), whatever the process group.
    dmp: DCP's exchanges run on its checkpoint group, bounded by its timeout (see save)."""
    if not targets:
        return
    try:
        with warnings.catch_warnings():  # one process without torch.distributed is what we mean here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=reader, planner=_LoadPlanner(), process_group=_group(dmp),
                     no_dist=local or not (dist.is_available() and dist.is_initialized()))
    except (Exception, CheckpointException) as e:  # DCP's errors name no file
        then = "Its files are not at fault: load it again with every rank running."
        peer = peer_failure(f"reading checkpoint {path}", e, then)
        if peer is not None:
            raise peer from e
        if dmp is not None and not local:
            # DCP's timeout names no rank (and no file is at fault): the guard's barrier names a peer that does not
            # come (stopped, stuck); with every peer there the error was DCP's own, said below
            try:
                _barrier(dmp, "checkpoint load (after a failed read)")
            except GUARD_ERRORS as verdict:
                raise type(verdict)(f"reading checkpoint {path}: {verdict}. {then}") from e
        # (DCP's text holds its traceback, whose source line shows the message's f-string too)
        missing = re.findall(r"Missing key in checkpoint state_dict: ([^\s{}]+?)\.?$", str(e), re.MULTILINE)
        if missing:  # not damage: the entry was saved under another name (or not at all)
            raise ValueError(f"checkpoint {path} has no entry '{missing[-1]}': it was saved from a model whose "
                             f"parameters are named otherwise. Pass the same module= to checkpoint.save and "
                             f"checkpoint.load_optimizer (the model the optimizer trains, or its "
                             f"DistributedModelParallel)") from e
        raise ValueError(f"reading checkpoint {path} failed: {e}\nA file of it may be damaged or cut short: "
                         f"use an earlier checkpoint") from e


class IncompatibleKeys(NamedTuple):
    """What `load_model(..., strict=False)` skipped, as torch's `module.load_state_dict` returns it: the model's
    entries the checkpoint lacks, and the checkpoint's entries the model lacks (state-dict names)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


@torch.no_grad()
def load_model(module: torch.nn.Module, path: str | os.PathLike, strict: bool = True) -> IncompatibleKeys:
    """Read this rank's pieces of the module's state from a DCP checkpoint (or a one-file one), in place.

    The module may be sharded by any plan at any world size, or not sharded at all (then call it
    on one process, torch.distributed not needed): every tensor reads the rectangles it holds.
    Returns `IncompatibleKeys(missing_keys, unexpected_keys)`, as `module.load_state_dict` does: with
    strict=False, the entries that were skipped (a table added since the save keeps its weights); with
    strict=True, any difference raises, so both lists are empty.
    """
    _check_module(LOAD_MODEL_SIGNATURE, module)
    _check_path(LOAD_MODEL_SIGNATURE, path)
    path = _readable_path(path)
    if path.is_file():  # the one-file format (checkpoint_format="gathered"), every table whole: it was refused
        return _load_model_from_file(module, path, strict)
    reader, md = _read_metadata(path)
    targets: dict[str, Any] = {}
    for key, value in module.state_dict().items():
        if isinstance(value, ShardedTensor):
            targets[f"state_dict.{key}"] = _pieces_of(value)
        elif isinstance(value, Tensor):
            targets[f"state_dict.{key}"] = value
    model = _named_model(module)
    ours = f"{type(model).__module__}.{type(model).__qualname__}"
    written_by = _module_class(_lightning_meta(path))  # a checkpoint of another model class: say which
    written_by = written_by if written_by not in (None, ours) else None
    head = "state_dict."
    unexpected = [k[len(head):] for k in md.state_dict_metadata if k.startswith(head) and k not in targets]
    missing = [k[len(head):] for k in targets if k not in md.state_dict_metadata]
    if not strict:
        kept = {k: v for k, v in targets.items() if k in md.state_dict_metadata}
        if targets and not kept:  # strict=False skipped every entry: it loaded nothing, and said nothing
            _check_targets(path, md, targets, f"model ({type(module).__name__})", True, saved_prefix="state_dict.",
                           written_by=written_by, nothing_matched=True)
        targets = kept
    _check_targets(path, md, targets, f"model ({type(module).__name__})", strict, saved_prefix="state_dict.",
                   written_by=written_by)
    _load(targets, reader, path, dmp=_dmp_of(module))
    for m in module.modules():  # written through views: GPU row caches (fused_uvm_caching) start empty
        if callable(getattr(m, "weights_written", None)):
            m.weights_written()
    return IncompatibleKeys(missing, unexpected)


def _lightning_file(path: Path) -> Mapping[str, Any]:
    """A one-file Lightning checkpoint's dict (memory-mapped), or what the file is and what loads it."""
    whole = load_file(path)
    if not (isinstance(whole, Mapping) and "state_dict" in whole):
        raise ValueError(_not_a_dcp_checkpoint(path, "a checkpoint (a directory written by lightning_rec.checkpoint"
                                                     ".save, or a one-file Lightning checkpoint)"))
    return whole


def _load_model_from_file(module: torch.nn.Module, path: Path, strict: bool) -> IncompatibleKeys:
    """load_model for a one-file checkpoint: whole tensors into `module.load_state_dict` (each sharded table keeps
    its pieces; FSDP's dense layers are cut to this rank's shards first)."""
    state = {k: v.full() if isinstance(v, ShardedTensor) else v for k, v in _lightning_file(path)["state_dict"].items()}
    ours = [k for k, v in module.state_dict().items() if isinstance(v, (Tensor, ShardedTensor))]
    if not strict and ours and not any(k in state for k in ours):  # strict=False would load nothing, and say nothing
        hint = _prefix_hint(ours, [k for k in state if k not in ours], "")
        raise ValueError(f"checkpoint {path} does not match this model ({type(module).__name__}): strict=False would "
                         f"skip every entry of this model: none is in the checkpoint"
                         + (f"\n  {hint}" if hint else f" (it holds {short_list(list(state), 4)})"))
    keys = module.load_state_dict(localize_full_state(module, state), strict=strict)
    for m in module.modules():  # written through views: GPU row caches (fused_uvm_caching) start empty
        if callable(getattr(m, "weights_written", None)):
            m.weights_written()
    if keys is None:  # a module whose load_state_dict returns nothing
        return IncompatibleKeys([], [])
    return IncompatibleKeys(list(keys.missing_keys), list(keys.unexpected_keys))


@torch.no_grad()
def load_optimizer(optimizer: torch.optim.Optimizer, path: str | os.PathLike, index: int = 0,
                   module: torch.nn.Module | None = None, strict: bool = True) -> None:
    """Restore optimizer `index` of a DCP checkpoint (or a one-file one): fused state shard by shard, the rest whole.

    module: the model the optimizer trains; needed when its dense state was saved sharded (FSDP),
    which then loads at any world size (DCP reads the shards this rank's parameters hold).
    strict=False: the fused state of a table the checkpoint does not hold (one added since) keeps its
    initial value, as `load_model(..., strict=False)` leaves its weights.
    """
    if isinstance(optimizer, (list, tuple)):
        raise TypeError(f"lightning_rec.checkpoint.load_optimizer restores one optimizer, got {_what(optimizer)}: call "
                        f"it once per optimizer, load_optimizer(optimizers[i], path, index=i, module=model)")
    if not _is_optimizer(optimizer):
        raise _wrong(LOAD_OPTIMIZER_SIGNATURE, "optimizer", optimizer, "an optimizer (torch.optim.Optimizer)")
    _check_path(LOAD_OPTIMIZER_SIGNATURE, path)
    if not isinstance(index, int) or isinstance(index, bool):
        raise _wrong(LOAD_OPTIMIZER_SIGNATURE, "index", index, "the optimizer's place in save's optimizers (an int)")
    _check_module(LOAD_OPTIMIZER_SIGNATURE, module, optional=True)
    path = _readable_path(path)
    optimizer = _unwrap(optimizer)
    if path.is_file():  # the one-file format: its whole-table state, each rank keeping its pieces
        states = _lightning_file(path).get("optimizer_states") or []
        if not 0 <= index < len(states):
            raise ValueError(f"checkpoint {path} holds no state for optimizer {index}: it was saved with "
                             f"{len(states)} optimizer(s)" + ("" if states else " (ModelCheckpoint(save_weights_only="
                                                                                  "True), or a model's state dict "
                                                                                  "alone): load its weights only, "
                                                                                  "checkpoint.load_model(model, path)"))
        load_gathered_optimizer(optimizer, states[index], module=module, strict=strict)
        return
    reader, md = _read_metadata(path)
    prefix = f"optimizer_states.{index}."
    saved = md.state_dict_metadata
    rest_key = f"{prefix}rest"
    if rest_key not in saved:
        rank, world = _rank_world()
        rest_key = f"{prefix}rest.rank{rank}"  # FSDP dense state: one per rank
        if not any(k.startswith(f"{prefix}rest") for k in saved):
            raise ValueError(f"checkpoint {path} holds no state for optimizer {index}: it was saved with "
                             f"{len({k.split('.')[1] for k in saved if k.startswith('optimizer_states.')})} "
                             f"optimizer(s)")
        if rest_key not in saved:
            raise ValueError(f"checkpoint {path}: optimizer {index}'s dense state was saved sharded (FSDP) by "
                             f"{sum(1 for k in saved if k.startswith(f'{prefix}rest.rank'))} ranks; load it at "
                             f"that world size (its tables and fused state load at any)")
    fused_key = fused_part(optimizer)
    per_row_columns = _lightning_meta(path).get("lightning_rec", {}).get("per_row_columns", {})
    targets: dict[str, Any] = {rest_key: None}
    post = []
    if fused_key is not None:
        fused = _fused_child(optimizer, fused_key)
        _check_same_fused_optimizer(path, saved, f"{prefix}fused.", fused)
        targets[f"{prefix}fused.param_groups"] = None
        for key, ((rows, cols), parts) in fused.global_state_pieces().items():
            first = parts[0][1]
            fqn = _as_saved(f"{prefix}fused.", key, PER_ROW if first.dim() == 1 else "", saved)
            if first.dim() == 0:
                targets[fqn] = first
            elif first.dim() == 2:
                targets[fqn] = _Pieces((rows, cols), [
                    ((m.shard_offsets, m.shard_sizes) if m is not None else ((0, 0), (rows, cols))) + (t,)
                    for m, t in parts])
            else:
                fqn += PER_ROW
                col_offsets = list(per_row_columns.get(fqn, [0]))
                widths = [b - a for a, b in zip(col_offsets, col_offsets[1:] + [cols])]
                buffers: dict[tuple[int, int], list[Tensor]] = {}
                chunks = []
                for m, t in parts:
                    r, nr = (m.shard_offsets[0], m.shard_sizes[0]) if m is not None else (0, rows)
                    if (r, nr) not in buffers:
                        bufs = [t.new_empty(nr, 1) for _ in col_offsets]
                        buffers[(r, nr)] = bufs
                        chunks += [((r, k), (nr, 1), b) for k, b in enumerate(bufs)]
                    post.append((fqn, t, buffers[(r, nr)], widths))
                targets[fqn] = _Pieces((rows, len(col_offsets)), chunks)
    if not strict:  # tables added since the save: their state stays as it starts (a missing bytes entry is still named)
        targets = {k: v for k, v in targets.items() if v is None or k in saved}
        post = [p for p in post if p[0] in targets]
    bytes_targets = {k for k, v in targets.items() if v is None}
    _check_targets(path, md, {k: v for k, v in targets.items() if k not in bytes_targets}, "optimizer's fused state")
    missing = [k for k in bytes_targets if k not in saved]
    if missing:
        raise ValueError(f"checkpoint {path} has no {missing}: it was saved without a fused optimizer; build the "
                         f"model's tables with the same optimizer=FusedOptimizerConfig(...)")
    for k in bytes_targets:
        if not isinstance(saved[k], BytesStorageMetadata):
            raise ValueError(f"checkpoint {path}: '{k}' is not what this version writes there")
    _load(targets, reader, path, dmp=_dmp_of(module))
    for _, live, bufs, widths in post:
        if len(bufs) == 1:
            live.copy_(bufs[0].view(-1))
        else:  # a table that was split by columns kept one per-row state per column shard: their weighted mean
            acc = sum(b.view(-1).double() * w for b, w in zip(bufs, widths))
            live.copy_((acc / sum(widths)).to(live.dtype))
    rest = _unblob(targets[rest_key])
    if fused_key is not None:
        fused = _fused_child(optimizer, fused_key)
        fused.state_loaded()
        saved_groups = _unblob(targets[f"{prefix}fused.param_groups"])
        by_name = {g["name"]: g for g in saved_groups}
        for g in saved_groups:  # groups saved under wrappers' names (see _WRAPPER_PREFIXES)
            by_name.setdefault(_unwrapped(g["name"]), g)
        fused.load_param_groups(by_name)
    _load_dense_parts(optimizer, fused_key, rest, prefix, module, path)


def _check_same_fused_optimizer(path: Path, saved: Mapping[str, Any], head: str, fused) -> None:
    """A table whose fused state the checkpoint holds under other names was trained by another sparse optimizer:
    said as such (the generic "not in the checkpoint: ...exp_avg" told to rebuild the same tables and dims)."""
    ours: dict[str, set[str]] = {}
    # Every table, sgd's (no state) too, and per-row state told from per-element state of the same name:
    # rowwise_adagrad's 'sum' into adagrad said "not in the checkpoint: ...sum", into sgd tables it loaded, silently.
    for table in fused.global_table_names():
        ours[table] = set()
    for key, (_, parts) in fused.global_state_pieces().items():
        table, name = key.rsplit(".", 1)
        ours.setdefault(table, set()).add(name + (PER_ROW if parts[0][1].dim() == 1 else ""))
    theirs: dict[str, set[str]] = {}
    for key in saved:
        if key.startswith(head) and key != f"{head}param_groups":
            per_row = key.endswith(PER_ROW)
            table, _, name = key[len(head):].removesuffix(PER_ROW).rpartition(".")
            theirs.setdefault(table, set()).add(name + (PER_ROW if per_row else ""))
    other = sorted(t for t in ours if t in theirs and ours[t] != theirs[t])
    if not other:
        return
    t = other[0]

    def said(names: set[str]) -> list[str]:
        return sorted(n.replace(PER_ROW, " (per row)") for n in names)

    optimizers = sorted({str(g.get("optimizer")) for g in fused.param_groups})
    raise ValueError(f"checkpoint {path} was trained with another sparse (fused) optimizer: its state for table "
                     f"'{t}' is {said(theirs[t])}, but this model's tables train with {', '.join(optimizers)}, whose "
                     f"state is {said(ours[t]) or 'none'} ({len(other)} table(s) like it). Build the tables with the "
                     f"sparse optimizer the checkpoint was trained with to resume from it "
                     f"(DLRMModule(sparse_optimizer=...), FusedOptimizerConfig(...)), or load only its weights: "
                     f"checkpoint.load_model(model, path), or "
                     f"trainer.validate / test(..., ckpt_path=...)")


# Before fused state was named by the model's own paths (optim.fused_modules), an optimizer built on a
# DistributedModelParallel (or DDP) saved it under its wrappers' names too: these still load.
_WRAPPER_PREFIXES = ("_dmp_wrapped_module.module.", "_dmp_wrapped_module.", "module.")


def _as_saved(head: str, key: str, suffix: str, saved: Mapping[str, Any]) -> str:
    """`head + key` (without `suffix`, which the caller adds), or the wrapped name it was saved under."""
    if head + key + suffix not in saved:
        for wrapped in _WRAPPER_PREFIXES:
            if head + wrapped + key + suffix in saved:
                return head + wrapped + key
    return head + key


def _unwrapped(name: str) -> str:
    for wrapped in _WRAPPER_PREFIXES:
        if name.startswith(wrapped):
            return name[len(wrapped):]
    return name


def loader_state_for_rank(meta: Mapping[str, Any], rank: int, world_size: int) -> Any:
    """This rank's dataloader state from a checkpoint's Lightning dict, either format (None: start the epoch over)."""
    info = meta.get("lightning_rec", {})
    states = info.get("loader_states")
    if states is None:
        return None
    if len(states) != world_size:
        warnings.warn(f"the checkpoint's dataloader state was saved by {len(states)} ranks, this run has "
                      f"{world_size}: each rank's loader starts the interrupted epoch over (the steps already "
                      f"taken in it are not repeated; its batches are)", stacklevel=2)
        return None
    return states[rank]


def rng_state() -> dict[str, Any]:
    """This process's random number generators: torch's (CPU, and the current CUDA device's once CUDA is in use),
    numpy's and Python's. Lightning's checkpoints leave them out, so a resumed run drew other dropout masks (or
    anything else a step draws) than the uninterrupted one."""
    import random

    import numpy as np

    # numpy's state as a tensor and plain numbers: a gathered file must still load with torch.load(weights_only=True)
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (str(kind), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    import random

    import numpy as np

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


# ------------------------------------------------------------------------------------------------
# the gathered format: one file, every table whole, written by rank 0
#
# The file is Lightning's checkpoint dict as torch.save writes it, with every sharded table whole
# under its state-dict name and the fused optimizer state whole under its global names
# (`optim.merge_fused_state`), so it loads into any world size, plan, or the unsharded model.
# Gathering goes one table (one state-dict key, one fused optimizer state) at a time: rank 0 holds
# the whole model once plus one table in flight, the other ranks one table in flight.


def _gather_to_zero(obj: Any, dmp: Any = None) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (None elsewhere); through the DistributedModelParallel's guard when given."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    if dmp is not None:  # guarded: a rank elsewhere is named in seconds, not after the process group's timeout
        return dmp.gather_object(obj)
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, parts, dst=0)
    return parts


def _all_gather_object(obj: Any, dmp: Any = None) -> list[Any]:
    if dmp is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dmp.all_gather_object(obj)
    return _gather(obj)


def _sendable(t: Tensor) -> Tensor:
    """A piece that pickles as its own bytes: a view into a fused kernel's flat weights would pickle the
    kernel's whole storage (13 tables of one kernel sent 13 copies of all of them). Host memory is
    wrapped without a copy where it can be (`_own_storage`), else copied."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.cpu()
    own = _own_storage(t)
    return own if own.untyped_storage().nbytes() == own.nbytes else t.clone()


@torch.no_grad()
def gathered_state_dict(state_dict: Mapping[str, Any], dmp: Any = None) -> dict[str, Any]:
    """Collective: on rank 0, `state_dict` with every sharded table whole (CPU); elsewhere `state_dict`.

    state_dict: this rank's (`module.state_dict()`: sharded tables as ShardedTensor, every rank holding
        an entry for every sharded table; FSDP's dense layers as DTensors). dmp: the
        DistributedModelParallel whose guarded gather is used (None: torch.distributed's
        gather_object). One table in flight at a time.
    """
    from torch.distributed.tensor import DTensor

    rank, world = _rank_world()
    out = dict(state_dict)
    for key, value in state_dict.items():
        if isinstance(value, DTensor):  # FSDP: whole (every rank of its mesh calls this, in one order)
            full = value.full_tensor()
            if rank == 0:
                out[key] = full.cpu()
            continue
        if not isinstance(value, ShardedTensor):
            continue
        mine = value if world == 1 else ShardedTensor(value.global_shape,
                                                      [(m, _sendable(t)) for m, t in value.local_shards])
        parts = _gather_to_zero(mine, dmp)
        del mine
        if parts is not None:
            out[key] = ShardedTensor.merge(parts).full()
        del parts
    return out


# A dense optimizer part whose state was sharded (FSDP) is stored whole, by parameter name
# (get_optimizer_state_dict(full_state_dict=True)), as {FULL_BY_NAME: that state}.
FULL_BY_NAME = "lightning_rec: whole state by parameter name"


def _full_options(**kwargs: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


@torch.no_grad()
def gathered_optimizer_state(optimizer: torch.optim.Optimizer, dmp: Any = None,
                             module: torch.nn.Module | None = None) -> dict[str, Any]:
    """Collective: on rank 0, `optimizer.state_dict()` with the fused state whole under global names
    (loads into any world size, plan, or the unsharded model); elsewhere `optimizer.state_dict()`.

    One fused state (a table's `sum`, `momentum1`, ...) in flight at a time; the names are agreed first
    (a table-wise table's state lives on one rank only). module: the model the optimizer trains, needed
    when its dense state is sharded (FSDP): that part is stored whole by parameter name (FULL_BY_NAME).
    """
    optimizer = _unwrap(optimizer)
    state = optimizer.state_dict()
    fused_key = fused_part(optimizer)
    rank, world = _rank_world()
    rest, children = _dense_parts(optimizer, fused_key, state)
    for name, child in children.items():
        if not _sharded(rest[name] if name else rest):
            continue
        if module is None or get_optimizer_state_dict is None:
            raise ValueError("the dense optimizer's state is sharded (FSDP): pass module= (the model it trains) to "
                             "gathered_optimizer_state, or save with checkpoint_format='dcp'")
        whole = {FULL_BY_NAME: get_optimizer_state_dict(_named_model(module), child,
                                                        options=_full_options(cpu_offload=True))}
        if name:
            state = {**state, name: whole}
        else:
            state = whole
    if fused_key is None:
        return state
    mine = _fused_child(optimizer, fused_key).global_state_pieces()
    names = dict.fromkeys(k for part in _all_gather_object(list(mine), dmp) for k in part)  # rank order
    merged: dict[str, Tensor] = {}
    for key in names:
        piece = None
        if key in mine:
            shape, parts = mine[key]
            piece = (shape, parts if world == 1 else [(m, _sendable(t)) for m, t in parts])
        gathered = _gather_to_zero(piece, dmp)
        del piece
        if gathered is not None:
            from lightning_rec.optim import merge_fused_state

            merged.update(merge_fused_state([{key: p} for p in gathered if p is not None]))
        del gathered
    if rank != 0:
        return state
    fused = state[fused_key] if fused_key else state
    fused = {**fused, "state": merged}
    return {**state, fused_key: fused} if fused_key else fused


def has_whole_by_name(optimizer_states: Sequence[Any]) -> bool:
    """Whether a gathered checkpoint's optimizer states hold a part stored whole by parameter name."""
    def found(obj: Any) -> bool:
        return isinstance(obj, Mapping) and (FULL_BY_NAME in obj or any(found(v) for v in obj.values()
                                                                        if isinstance(v, Mapping)))

    return any(found(s) for s in optimizer_states)


@torch.no_grad()
def load_gathered_optimizer(optimizer: torch.optim.Optimizer, state: Mapping[str, Any],
                            module: torch.nn.Module | None = None, strict: bool = True) -> None:
    """An optimizer's state from a gathered checkpoint; parts stored whole by parameter name (FSDP)
    go through set_optimizer_state_dict, which keeps this rank's shards (any world size).
    strict=False: a fused table the checkpoint does not hold (one added since) keeps its fresh state,
    as `load_optimizer(..., strict=False)` does for a sharded checkpoint."""
    from lightning_rec.optim import CombinedOptimizer, FusedOptimizer

    optimizer = _unwrap(optimizer)

    def load(part: torch.optim.Optimizer, saved: Any) -> None:
        if isinstance(part, FusedOptimizer):
            part.load_state_dict(saved, strict=strict)
        elif isinstance(saved, Mapping) and FULL_BY_NAME in saved:
            if module is None or set_optimizer_state_dict is None:
                raise ValueError("the checkpoint's dense optimizer state is stored by parameter name (FSDP): pass "
                                 "module= (the model the optimizer trains)")
            whole = saved[FULL_BY_NAME]
            # saved with module=dmp before _named_model: names under '_dmp_wrapped_module.'
            wrapped = any(str(k).startswith("_dmp_wrapped_module.") for k in whole.get("state", {}))
            names = _wrapped_named_model(module) if wrapped else _named_model(module)
            set_optimizer_state_dict(names, part, whole, options=_full_options())
        else:
            _load_whole_state(part, saved, module)

    if isinstance(optimizer, CombinedOptimizer):
        for name, child in optimizer.optimizers:
            if name not in state:
                raise ValueError(f"the checkpoint has no optimizer state for '{name}'; it has {list(state)}")
            load(child, state[name])
        optimizer._sync_groups()
    else:
        load(optimizer, state)


def localize_full_state(module: torch.nn.Module, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A whole-tensor state dict with the entries that are DTensors in `module` (FSDP) cut to this
    rank's shards, so that `module.load_state_dict` takes it (at any world size)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    live = module.state_dict()
    local_only = distribute_tensor_takes_src_data_rank()
    out = dict(state_dict)
    for key, value in state_dict.items():
        cur = live.get(key)
        if isinstance(cur, DTensor) and isinstance(value, Tensor) and not isinstance(value, DTensor):
            value = value.to(device=cur.device, dtype=cur.dtype)
            kwargs = {"src_data_rank": None} if local_only else {}  # every rank holds the whole tensor
            out[key] = distribute_tensor(value, cur.device_mesh, cur.placements, **kwargs)
    return out


def is_local_path(path: str | os.PathLike) -> bool:
    """A path on this machine's file system (not a URL such as s3://...)."""
    return "://" not in str(path)


def local_path(path: Any) -> Any:
    """A file:// URL as the local path it names (Path() made 'file:/tmp/x' of it, which does not exist, and
    fsspec opened a sharded checkpoint's directory as a file: IsADirectoryError); anything else as given."""
    if isinstance(path, (str, os.PathLike)) and str(path).startswith("file://"):
        from urllib.parse import unquote, urlparse

        parsed = urlparse(str(path))
        if parsed.netloc in ("", "localhost"):
            return unquote(parsed.path)
    return path


_REMOTE_SHARDED = ("a sharded checkpoint (a directory, checkpoint_format='dcp') is read by every rank from a local or "
                   "mounted file system, not from a URL: copy the directory to a local or mounted path (aws s3 cp "
                   "--recursive, gsutil -m cp -r, ...) and give that path; only the one-file format "
                   "(RecStrategy(checkpoint_format='gathered')) is read straight from a URL, through fsspec")


def _remote_sharded(path: Any, why: str) -> str:
    return f"checkpoint {path}{why}: {_REMOTE_SHARDED}"


def _readable_path(path: str | os.PathLike) -> Path:
    """A path the readers below can open: a file:// URL's local path; any other URL refused, naming the fix (Path()
    mangled 's3://b/x' into 's3:/b/x' and said it did not exist)."""
    path = local_path(path)
    if not is_local_path(path):
        raise ValueError(f"checkpoint {path} is a URL, and lightning_rec.checkpoint reads checkpoints from a local or "
                         f"mounted file system: copy it there (a sharded checkpoint is a directory: aws s3 cp "
                         f"--recursive, gsutil -m cp -r, ...) and give that path. Trainer(strategy='rec') resumes from "
                         f"a one-file checkpoint (checkpoint_format='gathered') at a URL too, through fsspec")
    return Path(path)


def save_file(checkpoint: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write a gathered checkpoint (one process): torch.save straight into a temporary file, fsync, rename.

    Nothing is buffered in memory (Lightning's default writer first serialises the whole checkpoint
    into a BytesIO, then copies it out: twice the model on rank 0), and a save killed midway leaves
    the previous file whole (the next save of that name removes the leftover).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.partial-*"):
        _remove_stale(stale)
    tmp = _partial_name(path, uuid.uuid4().hex[:12])
    try:
        with _no_crc32():
            torch.save(checkpoint, str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if path.is_dir() and not path.is_symlink():
            # a sharded checkpoint of that name (a run resumed from it with checkpoint_format="gathered"): os.replace
            # cannot put a file over a directory and the save failed with IsADirectoryError; swapped in one step
            _commit(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _no_crc32():
    """torch.save without the zip records' CRC32 (where torch has the switch): torch.load never checks
    it, and computing it costs more than the write itself (1.33 GB: 3.4-5.6 s with, 1.2-1.3 s without).
    Completeness is what the rename guarantees."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # pragma: no cover - older torch: the CRC is computed
        yield
        return
    save = getattr(config, "save", None)
    if save is None or not hasattr(save, "compute_crc32"):  # pragma: no cover
        yield
        return
    before = save.compute_crc32
    save.compute_crc32 = False
    try:
        yield
    finally:
        save.compute_crc32 = before


def load_file(path: str | os.PathLike) -> dict[str, Any]:
    """A gathered (one-file) checkpoint, with a clear error when the file is cut short.

    The file is memory-mapped (torch.save's zip format): its tensors are read from disk only where
    a rank copies from them, so each rank pages in the pieces it keeps, not the whole model. Files
    in torch's legacy format (not a zip) are read whole.
    """
    path = local_path(path)
    if not is_local_path(path):  # written through Lightning's CheckpointIO (fsspec) by the gathered format: read so
        from lightning.fabric.utilities.cloud_io import get_filesystem

        try:
            fs = get_filesystem(path)
        except (ImportError, ValueError) as e:  # fsspec's backend for the scheme is not installed, or not known
            raise ValueError(f"checkpoint {path}: {e}. A one-file checkpoint is read from a URL through fsspec, which "
                             f"needs that package; {_REMOTE_SHARDED}") from e
        if not fs.exists(str(path)):
            raise ValueError(f"checkpoint {path} does not exist: check the URL")
        if fs.isdir(str(path)):  # fsspec opened the directory as a file: IsADirectoryError
            raise ValueError(_remote_sharded(path, " is a directory at a URL"))
        with fs.open(str(path), "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=False)
    if not os.path.exists(path):  # not a damaged file: there is none (a typo, or a fit that saved nothing)
        raise ValueError(f"checkpoint {path} does not exist: check the path (a fit writes its checkpoints where "
                         f"ModelCheckpoint's dirpath says, by default <default_root_dir>/.../checkpoints)")
    try:
        mmap = zipfile.is_zipfile(path)
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as e:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        raise ValueError(f"checkpoint file {path} ({size} bytes) is incomplete or damaged and cannot be read ({e}): "
                         f"it was probably cut short by an interrupted save or copy; use an earlier checkpoint") from e


# ------------------------------------------------------------------------------------------------
# export for inference


def _full_model_state(path: Path, local: bool = False) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Every model tensor whole (CPU), and the Lightning dict, from a DCP directory or a gathered file.

    local: read by this rank alone (see _load), not together with the process group's other ranks."""
    if is_dcp_checkpoint(path):
        reader, md = _read_metadata(path)
        meta = _lightning_meta(path)
        targets = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
                   for k, v in md.state_dict_metadata.items()
                   if k.startswith("state_dict.") and isinstance(v, TensorStorageMetadata)}
        _load(targets, reader, path, local=local)
        return {k[len("state_dict."):]: v for k, v in targets.items()}, meta
    ckpt = load_file(path) if path.suffix != ".safetensors" else None
    if not (isinstance(ckpt, Mapping) and "state_dict" in ckpt):  # not a one-file Lightning checkpoint
        raise ValueError(_not_a_dcp_checkpoint(path, "a checkpoint (a directory written by lightning_rec.checkpoint"
                                                     ".save, or a one-file Lightning checkpoint)"))
    state = {}
    for k, v in ckpt["state_dict"].items():
        state[k] = v.full() if isinstance(v, ShardedTensor) else v
    return state, ckpt


def full_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """The model's state dict with every table whole (CPU), from a DCP directory or a gathered file.

    One process, no torch.distributed; it holds the whole model (for inspection, comparison, export).
    """
    path = _readable_path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    return _full_model_state(path)[0]


def lightning_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint at `path` as the dict a one-file Lightning checkpoint holds (what `torch.load` of one
    gives): every table whole (CPU) in "state_dict", and Lightning's other keys (epoch, global_step,
    hyper_parameters, loops, callbacks). No optimizer state, and no rank's dataloader position or random
    number generators: for weights and evaluation, not for resuming (`Trainer(strategy="rec")` resumes).

    One process, no torch.distributed; it holds the whole model.
    """
    path = _readable_path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    state, meta = _full_model_state(path)
    drop = ("state_dict", "optimizer_states", "lightning_rec")
    out = {**{k: v for k, v in meta.items() if k not in drop}, "state_dict": state}
    if "pytorch-lightning_version" not in out:  # written by save() from a hand loop: Lightning's readers need it
        import lightning

        out["pytorch-lightning_version"] = lightning.__version__
    return out


def load_from_checkpoint(cls: type, path: str | os.PathLike, map_location: Any = None, hparams_file: Any = None,
                         strict: bool | None = None, weights_only: bool | None = None, **kwargs: Any) -> Any:
    """`cls.load_from_checkpoint(path, ...)` for a checkpoint directory that `strategy="rec"` wrote: the
    LightningModule rebuilt from its hyperparameters, unsharded, on one process (no torch.distributed).

    Lightning's `load_from_checkpoint` reads one file (`torch.load`), so it fails on a directory
    (IsADirectoryError); this hands it the whole checkpoint instead and keeps all of its behaviour
    (`**kwargs` override hyperparameters, `strict`, `map_location`, `on_load_checkpoint`).
    DLRMModule.load_from_checkpoint and TwoTowerModule.load_from_checkpoint call it themselves.
    """
    checkpoint = lightning_checkpoint(path)
    hparams = checkpoint.get("hyper_parameters") or {}
    if hparams.get("embedding_device") == "meta" and "embedding_device" not in kwargs:
        kwargs["embedding_device"] = "cpu"  # one unsharded module: its tables take the checkpoint's values
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    # a file-like object: RecModuleHooks' load_from_checkpoint passes it on to Lightning's
    return cls.load_from_checkpoint(buffer, map_location=map_location, hparams_file=hparams_file, strict=strict,
                                    weights_only=weights_only, **kwargs)


def _module_class(meta: Mapping[str, Any]) -> str | None:
    """The LightningModule class that wrote a checkpoint; None when nothing in it says.

    strategy="rec" records it, as do DLRMModule / TwoTowerModule under any strategy, and LightningCLI
    keeps `_class_path` in the hyperparameters; a user's own module saved by plain Lightning from Python
    carries none of them.
    """

    return (meta.get("lightning_rec", {}).get("module_class") or meta.get(MODULE_CLASS_KEY)
            or (meta.get("hyper_parameters") or {}).get("_class_path"))


def _is_table(key: str) -> bool:
    return ".embedding_bags." in key or ".embeddings." in key


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, fp16_tables: bool = False) -> Path:
    """Write an unsharded model for inference: `out/model.safetensors` + `out/config.json`.

    Reads a DCP checkpoint directory (or an old gathered file) on one process, without
    torch.distributed. `config.json` holds the LightningModule's class and init arguments;
    `load_exported(out)` rebuilds the module on CPU and loads the weights. fp16_tables: tables are
    stored in float16 (half the size; loading casts them back to the module's dtype).
    """
    from safetensors.torch import save_file

    checkpoint, out = _readable_path(checkpoint), Path(out)
    if not checkpoint.exists():
        raise ValueError(f"checkpoint {checkpoint} does not exist")
    state, meta = _full_model_state(checkpoint)
    tensors = {}
    for k, v in state.items():
        v = v.detach().cpu().contiguous()
        if fp16_tables and _is_table(k) and v.is_floating_point():
            v = v.half()
        tensors[k] = v
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file: give export a directory to write model.safetensors and config.json in "
                         f"(a new one, or an earlier export's, whose two files are replaced)")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    # safetensors creates the file 0600; an export is meant to be served, so the user's umask decides, as for
    # config.json
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(out / "model.safetensors", 0o666 & ~mask)
    # LightningCLI adds its own keys (`_class_path`, `_instantiator`): not init arguments
    hparams = {k: v for k, v in (meta.get("hyper_parameters") or {}).items() if not str(k).startswith("_")}
    if hparams.get("embedding_device") == "meta":
        hparams["embedding_device"] = "cpu"  # an export is one unsharded module: its tables are the file's values
    class_path = _module_class(meta)
    if class_path is None:
        warnings.warn(f"{checkpoint} does not say which LightningModule wrote it (saved by plain Lightning from "
                      f"Python, without strategy='rec', or by checkpoint.save(...) without module_class='pkg.Module'): "
                      f"{out}/config.json names no class, so load it with "
                      f"load_exported({str(out)!r}, module=YourModule(...))", stacklevel=2)
    config = {"class_path": class_path, "init_args": _jsonable(hparams), "fp16_tables": fp16_tables,
              "source": str(checkpoint), "epoch": meta.get("epoch"), "global_step": meta.get("global_step")}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def load_exported(path: str | os.PathLike, module: torch.nn.Module | None = None) -> torch.nn.Module:
    """The module of an `export` directory, on CPU, in eval mode (no torch.distributed needed)."""
    import importlib

    from safetensors.torch import load_file as load_safetensors

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ValueError(f"{path} is not an export directory (needs config.json and model.safetensors): "
                         f"write one with `lightning-rec export CHECKPOINT {path}`")
    config = json.loads((path / "config.json").read_text())
    if module is None:
        if not config.get("class_path"):
            raise ValueError(f"{path}/config.json names no LightningModule class (its checkpoint did not say): pass "
                             f"the module to load into, load_exported({str(path)!r}, module=YourModule(...))")
        mod_name, _, cls_name = config["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(mod_name), cls_name)
        module = cls(**config["init_args"])
    state = load_safetensors(str(path / "model.safetensors"))
    live = module.state_dict()
    state = {k: v.to(live[k].dtype) if k in live and v.dtype != live[k].dtype else v for k, v in state.items()}
    module.load_state_dict(state)
    return module.eval()
