"""Optimizer state as checkpoint entries, and back: the fused part per table shard (any layout loads it), the dense
(torch.optim) part pickled whole, or by parameter name when FSDP shards it.

Replicated (DDP) dense state is one pickled entry, written once. FSDP's is sharded (DTensors): it goes through
torch.distributed.checkpoint.state_dict's get_optimizer_state_dict (state keyed by parameter name, each DTensor
written as its shards), so it loads at any world size; its place in the pickled entry holds DENSE_IN_DCP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from lightning_rec.checkpoint.collectives import all_gather, rank_world
from lightning_rec.checkpoint.format import (
    DENSE_IN_DCP,
    PER_ROW,
    blob,
    dense_key,
    is_dense_in_dcp,
    rest_key,
    saved_name,
)
from lightning_rec.checkpoint.reader import dcp_load, read_metadata
from lightning_rec.checkpoint.reshard import Pieces
from lightning_rec.fqn import DMP_WRAPPED, canonical_fqn
from lightning_rec.model_parallel import DistributedModelParallel
from lightning_rec.optim import CombinedOptimizer, FusedOptimizer, column_overlaps, per_row_of_blocks
from lightning_rec.table_weight import FusedTableWeight


def unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the real one


def fused_part(optimizer: torch.optim.Optimizer) -> str | None:
    """Where a FusedOptimizer's state sits in `optimizer.state_dict()`: "" (itself), a child name, or None."""
    if isinstance(optimizer, FusedOptimizer):
        return ""
    if isinstance(optimizer, CombinedOptimizer):
        for name, child in optimizer.optimizers:
            if isinstance(child, FusedOptimizer):
                return name
    return None


def fused_child(optimizer: torch.optim.Optimizer, key: str) -> FusedOptimizer:
    if key == "":
        return optimizer
    child = dict(optimizer.optimizers)[key]
    assert isinstance(child, FusedOptimizer)
    return child


def full_options(**kwargs: Any) -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, **kwargs)


def sharded(obj: Any) -> bool:
    """Whether `obj` holds a DTensor (FSDP's dense state) anywhere."""
    if isinstance(obj, DTensor):
        return True
    if isinstance(obj, Mapping):
        return any(sharded(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(sharded(v) for v in obj)
    return False


def named_model(module: torch.nn.Module) -> torch.nn.Module:
    """The model whose parameter names the dense state is saved under: a DistributedModelParallel's own model, so
    that `save(..., module=dmp)` names them as the unsharded model does (which any layout loads)."""
    return module.module if isinstance(module, DistributedModelParallel) else module


def wrapped_named_model(module: torch.nn.Module) -> torch.nn.Module:
    """A DistributedModelParallel's model under the names older saves gave the dense state:
    '_dmp_wrapped_module.<param>' (DDP's 'module.' is left out by torch's state_dict helpers). These still load."""
    if not isinstance(module, DistributedModelParallel):
        return module
    shim = torch.nn.Module()
    setattr(shim, DMP_WRAPPED, getattr(module, DMP_WRAPPED))
    return shim


# ------------------------------------------------------------------------------------------------
# save


def _per_row_columns(fused: FusedOptimizer) -> dict[str, list[int]]:
    """Per-row state key -> the column offsets of the shards that keep one (this rank's)."""
    out: dict[str, set[int]] = {}
    for key, (_, parts) in fused.global_state_pieces().items():
        if parts[0][1].dim() == 1:
            out.setdefault(key, set()).update(m.shard_offsets[1] if m is not None else 0 for m, _ in parts)
    return {k: sorted(v) for k, v in out.items()}


def _fused_entries(fused: FusedOptimizer, prefix: str, columns: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """This rank's fused optimizer state as DCP entries (see format.py for the names).

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
            out[f"{prefix}{key}{PER_ROW}"] = Pieces((rows, len(columns[key])), chunks)
        else:
            out[f"{prefix}{key}"] = Pieces((rows, cols), chunks)
    return out


def optimizer_entries(optimizer: torch.optim.Optimizer, prefix: str, columns: dict[str, list[int]],
                      module: torch.nn.Module | None = None, dmp: Any = None) -> dict[str, Any]:
    """An optimizer's DCP entries under `prefix`; `columns` receives its per-row keys' column offsets over all ranks
    (collective: the ranks agree on them)."""
    optimizer = unwrap(optimizer)
    fused_key = fused_part(optimizer)
    state = optimizer.state_dict()
    out: dict[str, Any] = {}
    if fused_key is not None:
        fused = fused_child(optimizer, fused_key)
        everyone: dict[str, set[int]] = {}
        for part in all_gather(_per_row_columns(fused), dmp):
            for k, offsets in part.items():
                everyone.setdefault(k, set()).update(offsets)
        for k, offsets in everyone.items():
            columns[f"{prefix}fused.{k}{PER_ROW}"] = sorted(offsets)
        out = _fused_entries(fused, f"{prefix}fused.", {k: sorted(v) for k, v in everyone.items()})
        out[f"{prefix}fused.param_groups"] = blob(fused.state_dict()["param_groups"])
    out.update(_dense_entries(optimizer, fused_key, state, prefix, module))
    return out


def dense_parts(optimizer: torch.optim.Optimizer, fused_key: str | None,
                state: Mapping[str, Any]) -> tuple[Any, dict[str, torch.optim.Optimizer]]:
    """The non-fused state (as the pickled entry holds it) and the optimizers it belongs to, by name
    ("" when it is the whole optimizer's)."""
    if isinstance(optimizer, CombinedOptimizer):
        return ({k: v for k, v in state.items() if k != fused_key},
                {n: c for n, c in optimizer.optimizers if n != fused_key})
    if fused_key is None:
        return state, {"": optimizer}
    return {}, {}


def _dense_entries(optimizer: torch.optim.Optimizer, fused_key: str | None, state: Mapping[str, Any], prefix: str,
                   module: torch.nn.Module | None) -> dict[str, Any]:
    rest, children = dense_parts(optimizer, fused_key, state)
    out: dict[str, Any] = {}
    module = None if module is None else named_model(module)
    if module is not None:
        if "" in children:
            if sharded(rest):
                out[dense_key(prefix, "")] = get_optimizer_state_dict(module, optimizer)
                rest = DENSE_IN_DCP
        else:
            rest = dict(rest)
            for name, child in children.items():
                if sharded(rest[name]):  # (an empty state has nothing to shard: pickled as before)
                    out[dense_key(prefix, name)] = get_optimizer_state_dict(module, child)
                    rest[name] = DENSE_IN_DCP
    # sharded state that could not go by name (no module given) is written once per rank
    out[rest_key(prefix, rank_world()[0] if sharded(rest) else None)] = blob(rest)
    return out


# ------------------------------------------------------------------------------------------------
# load: the fused part


def fused_targets(fused: FusedOptimizer, prefix: str, saved: Mapping[str, Any],
                  per_row_columns: Mapping[str, Sequence[int]]) -> tuple[dict[str, Any], list[tuple]]:
    """What DCP reads of the fused state into this rank's kernels, by entry name (a scalar, the pieces of per-element
    state, buffers for per-row state), and the per-row copies to do once read: [(entry, live state, buffers,
    column widths)]."""
    targets: dict[str, Any] = {}
    post: list[tuple] = []
    for key, ((rows, cols), parts) in fused.global_state_pieces().items():
        first = parts[0][1]
        fqn = saved_name(prefix, key, PER_ROW if first.dim() == 1 else "", saved)
        if first.dim() == 0:
            targets[fqn] = first
        elif first.dim() == 2:
            targets[fqn] = Pieces((rows, cols), [
                ((m.shard_offsets, m.shard_sizes) if m is not None else ((0, 0), (rows, cols))) + (t,)
                for m, t in parts])
        else:
            fqn += PER_ROW
            targets[fqn] = _per_row_target(fqn, rows, cols, parts, list(per_row_columns.get(fqn, [0])), post)
    return targets, post


def _per_row_target(fqn: str, rows: int, cols: int, parts: Sequence[tuple[Any, Tensor]], col_offsets: list[int],
                    post: list[tuple]) -> Pieces:
    """One [rows, 1] buffer per saved column shard for each row range this rank holds; `post` gets the copies, with
    how many of each saved shard's columns the live shard holds."""
    buffers: dict[tuple[int, int], list[Tensor]] = {}
    chunks = []
    for m, t in parts:
        (r, c), (nr, nc) = (m.shard_offsets, m.shard_sizes) if m is not None else ((0, 0), (rows, cols))
        if (r, nr) not in buffers:
            bufs = [t.new_empty(nr, 1) for _ in col_offsets]
            buffers[(r, nr)] = bufs
            chunks += [((r, k), (nr, 1), b) for k, b in enumerate(bufs)]
        post.append((fqn, t, buffers[(r, nr)], column_overlaps(col_offsets, cols, c, nc)))
    return Pieces((rows, len(col_offsets)), chunks)


def copy_per_row(post: Sequence[tuple]) -> None:
    """Each live shard's per-row state from the saved column shards it overlaps (see optim.per_row_of_blocks)."""
    for _, live, bufs, overlaps in post:
        live.copy_(per_row_of_blocks(bufs, overlaps))


def load_fused_groups(fused: FusedOptimizer, saved_groups: Sequence[Mapping[str, Any]]) -> None:
    """The saved fused param groups' values into this optimizer's groups of the same name (or its wrapped name)."""
    by_name = {g["name"]: g for g in saved_groups}
    for g in saved_groups:
        by_name.setdefault(canonical_fqn(g["name"]), g)
    fused.load_param_groups(by_name)


# ------------------------------------------------------------------------------------------------
# load: the dense part


def _load_dense(optimizer: torch.optim.Optimizer, key: str, module: torch.nn.Module | None, path: Path) -> None:
    """A dense optimizer's state saved through get_optimizer_state_dict: DCP reads the shards this
    rank's parameters hold (any world size), set_optimizer_state_dict puts them in place."""
    if module is None:
        raise ValueError(f"checkpoint {path}: the dense optimizer's state was saved sharded (FSDP) by parameter "
                         f"name: pass module= (the model the optimizer trains) to checkpoint.load_optimizer")
    reader, md = read_metadata(path)
    wrapped = any(k.startswith(f"{key}.state.{DMP_WRAPPED}.") for k in md.state_dict_metadata)  # an older save's
    names = wrapped_named_model(module) if wrapped else named_model(module)
    template = get_optimizer_state_dict(names, optimizer)  # this rank's layout (fresh state: zero-filled)
    dcp_load({key: template}, reader, path)
    set_optimizer_state_dict(names, optimizer, template)


def _refuse_combined_into_one(path: Path, prefix: str, rest: Mapping[str, Any], optimizer: Any) -> None:
    index = prefix.split(".")[1]  # (torch said KeyError: 'param_groups')
    raise ValueError(f"checkpoint {path}: optimizer {index} was saved as a combined optimizer (the fused "
                     f"tables' part and the dense part(s) {list(rest)}), and this one is a "
                     f"{type(optimizer).__name__}: restore it into the same kind, lightning_rec.optim."
                     f"combined_optimizer(model, dense_optimizer) (the module's configure_optimizers()), or "
                     f"load only the weights with checkpoint.load_model(model, path)")


def load_dense_parts(optimizer: torch.optim.Optimizer, fused_key: str | None, rest: Any, prefix: str,
                     module: torch.nn.Module | None, path: Path) -> None:
    if isinstance(optimizer, CombinedOptimizer):
        parts = [(name, child) for name, child in optimizer.optimizers if name != fused_key]
        for name, child in parts:
            saved = name
            if name not in rest and len(parts) == 1 and len(rest) == 1:
                # one dense part on each side, named by another way of combining them (TorchRec's
                # CombinedOptimizer names it '1_keyedoptimizerwrapper', combined_optimizer 'dense')
                saved = next(iter(rest))
            if saved not in rest:
                raise ValueError(f"checkpoint {path} has no state for optimizer part '{name}'; it has {list(rest)}")
            if is_dense_in_dcp(rest[saved]):
                _load_dense(child, dense_key(prefix, saved), module, path)
            else:
                load_whole_state(child, rest[saved], module, path)
        optimizer._sync_groups()
    elif fused_key is None:
        if is_dense_in_dcp(rest):
            _load_dense(optimizer, dense_key(prefix, ""), module, path)
        elif isinstance(rest, Mapping) and "param_groups" not in rest:
            _refuse_combined_into_one(path, prefix, rest, optimizer)
        else:
            load_whole_state(optimizer, rest, module, path)


def load_torch_optimizer_state(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    """`optimizer.load_state_dict(saved)` for a torch.optim optimizer, also when `saved` was written before a sharded
    collection had table parameters.

    An optimizer built over `model.parameters()` holds, since then, one (empty) parameter per sharded table, which its
    state saved before (by index) lacks. The tables never hold optimizer state (no gradient), so each group that
    differs by exactly its table parameters gets them back in their places, with no state."""
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


def load_whole_state(optimizer: torch.optim.Optimizer, saved: Any, module: torch.nn.Module | None,
                     path: Any = None) -> None:
    """A dense optimizer's whole-tensor state (saved with dense='ddp', or unsharded) into `optimizer`; when the
    optimizer now trains FSDP-sharded parameters, the state goes in by parameter name and each rank keeps its
    shards (whole tensors met the parameters' DTensors at the first step otherwise)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    theirs = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not any(isinstance(p, DTensor) for p in params) or sharded(saved) or not isinstance(theirs, list):
        load_torch_optimizer_state(optimizer, saved)
        return
    if module is None:
        raise ValueError(f"checkpoint {path}: the dense optimizer's state was saved whole (dense='ddp') and this one "
                         f"trains sharded (FSDP) parameters: pass module= (the model it trains) to "
                         f"checkpoint.load_optimizer, which then keeps each rank's shards")
    names = named_model(module)
    template = get_optimizer_state_dict(names, optimizer, options=full_options())  # our parameters' names, in order
    ours = [g["params"] for g in template["param_groups"]]
    if [len(g) for g in ours] != [len(g.get("params", ())) for g in theirs]:
        load_torch_optimizer_state(optimizer, saved)  # torch names the difference
        return
    fqn = {i: name for g, t in zip(ours, theirs) for name, i in zip(g, t["params"])}
    whole = {"state": {fqn[i]: st for i, st in saved.get("state", {}).items() if i in fqn},
             "param_groups": [{**t, "params": g} for g, t in zip(ours, theirs)]}
    set_optimizer_state_dict(names, optimizer, whole, options=full_options())
