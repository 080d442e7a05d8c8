"""The one-file format: every table whole, written by rank 0 (`RecStrategy(checkpoint_format="gathered")`).

The file is Lightning's checkpoint dict as torch.save writes it, with every sharded table whole under its state-dict
name and the fused optimizer state whole under its global names (`optim.merge_fused_state`), so it loads into any
world size, plan, or the unsharded model. Gathering goes one table (one state-dict key, one fused optimizer state) at
a time: rank 0 holds the whole model once plus one table in flight, the other ranks one table in flight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_rec._compat import distribute_tensor_takes_src_data_rank
from lightning_rec.checkpoint.checks import prefix_hint
from lightning_rec.checkpoint.collectives import all_gather, gather_to_zero, rank_world
from lightning_rec.checkpoint.format import FULL_BY_NAME
from lightning_rec.checkpoint.optimizer_state import (
    dense_parts,
    full_options,
    fused_child,
    fused_part,
    load_whole_state,
    named_model,
    sharded,
    unwrap,
    wrapped_named_model,
)
from lightning_rec.checkpoint.reader import lightning_file
from lightning_rec.checkpoint.reshard import sendable
from lightning_rec.errors import short_list
from lightning_rec.fqn import DMP_WRAPPED
from lightning_rec.optim import CombinedOptimizer, FusedOptimizer, merge_fused_state
from lightning_rec.sharding.sharded_tensor import ShardedTensor

# ------------------------------------------------------------------------------------------------
# save (collective): what rank 0 writes


@torch.no_grad()
def gathered_state_dict(state_dict: Mapping[str, Any], dmp: Any = None) -> dict[str, Any]:
    """Collective: on rank 0, `state_dict` with every sharded table whole (CPU); elsewhere `state_dict`.

    state_dict: this rank's (`module.state_dict()`: sharded tables as ShardedTensor, every rank holding
        an entry for every sharded table; FSDP's dense layers as DTensors). dmp: the
        DistributedModelParallel whose guarded gather is used (None: torch.distributed's
        gather_object). One table in flight at a time.
    """
    rank, world = rank_world()
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
                                                      [(m, sendable(t)) for m, t in value.local_shards])
        parts = gather_to_zero(mine, dmp)
        del mine
        if parts is not None:
            out[key] = ShardedTensor.merge(parts).full()
        del parts
    return out


def state_dict_to_device(state_dict: Mapping[str, Any], pg: Any = None,
                         device: torch.device | str = "cpu") -> dict[str, Any]:
    """TorchRec's `state_dict_to_device`: `state_dict` with every tensor, and every piece of a sharded table, on
    `device` (tables stay sharded). Every rank holds every key here, so no exchange is needed and `pg` is unused."""
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        if isinstance(value, ShardedTensor):
            out[key] = ShardedTensor(value.global_shape, [(m, t.to(device)) for m, t in value.local_shards])
        else:
            out[key] = value.to(device) if isinstance(value, Tensor) else value
    return out


@torch.no_grad()
def state_dict_gather(src: Mapping[str, Any], dst: Mapping[str, Tensor]) -> None:
    """TorchRec's `state_dict_gather` (collective): `dst`'s tensors take `src`'s values of their keys, sharded
    tables whole, on rank 0 (elsewhere only the unsharded entries are copied, as TorchRec does)."""
    missing = [k for k in dst if k not in src]
    if missing:
        raise ValueError(f"state_dict_gather: the source state dict has no {short_list(missing, 4)}: gather into a "
                         f"model of the same structure (its state_dict() keys are the source's)")
    whole = gathered_state_dict({k: src[k] for k in dst})
    rank, _ = rank_world()
    for key, target in dst.items():
        value = whole[key]
        if isinstance(value, ShardedTensor):  # not rank 0: the table went to rank 0
            continue
        if rank == 0 or not isinstance(src[key], ShardedTensor):
            target.copy_(value)


def _whole_dense_state(state: dict[str, Any], optimizer: torch.optim.Optimizer, fused_key: str | None,
                       module: torch.nn.Module | None) -> dict[str, Any]:
    """`state` with each dense part that FSDP shards stored whole by parameter name ({FULL_BY_NAME: ...})."""
    rest, children = dense_parts(optimizer, fused_key, state)
    for name, child in children.items():
        if not sharded(rest[name] if name else rest):
            continue
        if module is None:
            raise ValueError("the dense optimizer's state is sharded (FSDP): pass module= (the model it trains) to "
                             "gathered_optimizer_state, or save with checkpoint_format='dcp'")
        whole = {FULL_BY_NAME: get_optimizer_state_dict(named_model(module), child,
                                                        options=full_options(cpu_offload=True))}
        state = {**state, name: whole} if name else whole
    return state


def _merged_fused_state(fused: FusedOptimizer, dmp: Any) -> dict[str, Tensor]:
    """Collective: on rank 0, every fused state whole under its global name; elsewhere {}. One state in flight; the
    names are agreed first (a table-wise table's state lives on one rank only)."""
    world = rank_world()[1]
    mine = fused.global_state_pieces()
    names = dict.fromkeys(k for part in all_gather(list(mine), dmp) for k in part)  # rank order
    merged: dict[str, Tensor] = {}
    for key in names:
        piece = None
        if key in mine:
            shape, parts = mine[key]
            piece = (shape, parts if world == 1 else [(m, sendable(t)) for m, t in parts])
        gathered = gather_to_zero(piece, dmp)
        del piece
        if gathered is not None:
            merged.update(merge_fused_state([{key: p} for p in gathered if p is not None], column_blocks=True))
        del gathered
    return merged


@torch.no_grad()
def gathered_optimizer_state(optimizer: torch.optim.Optimizer, dmp: Any = None,
                             module: torch.nn.Module | None = None) -> dict[str, Any]:
    """Collective: on rank 0, `optimizer.state_dict()` with the fused state whole under global names
    (loads into any world size, plan, or the unsharded model); elsewhere `optimizer.state_dict()`.

    module: the model the optimizer trains, needed when its dense state is sharded (FSDP): that part is
    stored whole by parameter name (FULL_BY_NAME).
    """
    optimizer = unwrap(optimizer)
    fused_key = fused_part(optimizer)
    state = _whole_dense_state(optimizer.state_dict(), optimizer, fused_key, module)
    if fused_key is None:
        return state
    merged = _merged_fused_state(fused_child(optimizer, fused_key), dmp)
    if rank_world()[0] != 0:
        return state
    fused = state[fused_key] if fused_key else state
    fused = {**fused, "state": merged}
    return {**state, fused_key: fused} if fused_key else fused


# ------------------------------------------------------------------------------------------------
# load: each rank keeps its pieces of the whole tensors


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
    optimizer = unwrap(optimizer)

    def load(part: torch.optim.Optimizer, saved: Any) -> None:
        if isinstance(part, FusedOptimizer):
            part.load_state_dict(saved, strict=strict)
        elif isinstance(saved, Mapping) and FULL_BY_NAME in saved:
            if module is None:
                raise ValueError("the checkpoint's dense optimizer state is stored by parameter name (FSDP): pass "
                                 "module= (the model the optimizer trains)")
            whole = saved[FULL_BY_NAME]
            wrapped = any(str(k).startswith(f"{DMP_WRAPPED}.") for k in whole.get("state", {}))  # an older save's
            names = wrapped_named_model(module) if wrapped else named_model(module)
            set_optimizer_state_dict(names, part, whole, options=full_options())
        else:
            load_whole_state(part, saved, module)

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


def weights_written(module: torch.nn.Module, rehome: bool = True) -> None:
    """Tables were written through views: GPU row caches (fused_uvm_caching) start empty; then (rehome) sharded id
    maps re-home their ids and rows (collective). rehome=False after `module.load_state_dict`, whose hook re-homed
    them: a second re-homing finds nothing moving and forgets which ids moved, whose optimizer state rows
    load_optimizer then moves with them."""
    for m in module.modules():
        if callable(getattr(m, "weights_written", None)):
            m.weights_written()
    for m in module.modules() if rehome else ():
        if callable(getattr(m, "state_loaded", None)):
            m.state_loaded()


def load_model_from_file(module: torch.nn.Module, path: Path, strict: bool) -> tuple[list[str], list[str]]:
    """load_model for a one-file checkpoint: whole tensors into `module.load_state_dict` (each sharded table keeps
    its pieces; FSDP's dense layers are cut to this rank's shards first). Returns (missing, unexpected) keys."""
    state = {k: v.full() if isinstance(v, ShardedTensor) else v for k, v in lightning_file(path)["state_dict"].items()}
    ours = [k for k, v in module.state_dict().items() if isinstance(v, (Tensor, ShardedTensor))]
    if not strict and ours and not any(k in state for k in ours):  # strict=False would load nothing, and say nothing
        hint = prefix_hint(ours, [k for k in state if k not in ours], "")
        raise ValueError(f"checkpoint {path} does not match this model ({type(module).__name__}): strict=False would "
                         f"skip every entry of this model: none is in the checkpoint"
                         + (f"\n  {hint}" if hint else f" (it holds {short_list(list(state), 4)})"))
    keys = module.load_state_dict(localize_full_state(module, state), strict=strict)
    weights_written(module, rehome=False)
    if keys is None:  # a module whose load_state_dict returns nothing
        return [], []
    return list(keys.missing_keys), list(keys.unexpected_keys)


def load_optimizer_from_file(optimizer: torch.optim.Optimizer, path: Path, index: int,
                             module: torch.nn.Module | None, strict: bool) -> None:
    """load_optimizer for a one-file checkpoint: its whole-table state, each rank keeping its pieces."""
    states = lightning_file(path).get("optimizer_states") or []
    if not 0 <= index < len(states):
        raise ValueError(f"checkpoint {path} holds no state for optimizer {index}: it was saved with "
                         f"{len(states)} optimizer(s)" + ("" if states else " (ModelCheckpoint(save_weights_only="
                                                                              "True), or a model's state dict "
                                                                              "alone): load its weights only, "
                                                                              "checkpoint.load_model(model, path)"))
    load_gathered_optimizer(optimizer, states[index], module=module, strict=strict)
