"""The public calls' checks: their arguments (a model, an optimizer and a path are easy to swap, and each failed deep
inside, or was written as something else), and whether a checkpoint holds what the model or optimizer loads."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, TensorStorageMetadata

from lightning_rec.checkpoint.format import PER_ROW
from lightning_rec.checkpoint.optimizer_state import unwrap
from lightning_rec.checkpoint.reshard import Pieces
from lightning_rec.errors import is_int, short_list

SAVE_SIGNATURE = ("lightning_rec.checkpoint.save({'state_dict': model.state_dict(), ...}, path, "
                  "optimizers=[optimizer], module=model)")
LOAD_MODEL_SIGNATURE = "lightning_rec.checkpoint.load_model(model, path)"
LOAD_OPTIMIZER_SIGNATURE = "lightning_rec.checkpoint.load_optimizer(optimizer, path, index=0, module=model)"


def _is_optimizer(obj: Any) -> bool:
    return isinstance(unwrap(obj), torch.optim.Optimizer)


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


def check_path(signature: str, path: Any) -> None:
    if not _is_path(path):
        raise _wrong(signature, "path", path, "a path (str or os.PathLike)")


def check_module(signature: str, module: Any, optional: bool = False) -> None:
    if optional and module is None:
        return
    if not isinstance(module, torch.nn.Module):
        raise _wrong(signature, "module" if optional else "model", module,
                     "the model (an nn.Module: the DistributedModelParallel, LightningModule or unsharded model)")


def check_save_args(checkpoint: Any, path: Any, optimizers: Any, module: Any) -> None:
    if not isinstance(checkpoint, Mapping):
        raise _wrong(SAVE_SIGNATURE, "checkpoint (the first argument)", checkpoint,
                     "a dict holding the model's state dict: {'state_dict': model.state_dict()}")
    if "state_dict" not in checkpoint:
        raise ValueError(f"lightning_rec.checkpoint.save: the checkpoint dict has no 'state_dict' entry (its keys: "
                         f"{short_list([str(k) for k in checkpoint], 4)}); a model's state dict goes in as "
                         f"{{'state_dict': model.state_dict()}}. Call it as {SAVE_SIGNATURE}")
    check_path(SAVE_SIGNATURE, path)
    if not isinstance(optimizers, Sequence) or isinstance(optimizers, (str, bytes)):
        raise _wrong(SAVE_SIGNATURE, "optimizers", optimizers, "a list of optimizers: optimizers=[optimizer]")
    for i, opt in enumerate(optimizers):
        if not _is_optimizer(opt):
            raise _wrong(SAVE_SIGNATURE, f"optimizers[{i}]", opt, "an optimizer (torch.optim.Optimizer)")
    check_module(SAVE_SIGNATURE, module, optional=True)


def check_load_optimizer_args(optimizer: Any, path: Any, index: Any, module: Any) -> None:
    if isinstance(optimizer, (list, tuple)):
        raise TypeError(f"lightning_rec.checkpoint.load_optimizer restores one optimizer, got {_what(optimizer)}: call "
                        f"it once per optimizer, load_optimizer(optimizers[i], path, index=i, module=model)")
    if not _is_optimizer(optimizer):
        raise _wrong(LOAD_OPTIMIZER_SIGNATURE, "optimizer", optimizer, "an optimizer (torch.optim.Optimizer)")
    check_path(LOAD_OPTIMIZER_SIGNATURE, path)
    if not is_int(index):
        raise _wrong(LOAD_OPTIMIZER_SIGNATURE, "index", index, "the optimizer's place in save's optimizers (an int)")
    check_module(LOAD_OPTIMIZER_SIGNATURE, module, optional=True)


def check_same_path(paths: Sequence[str]) -> None:
    """Every rank's save path (each rank's pieces would go to its own directory: rank 0's would lack the others')."""
    if len(set(paths)) > 1:
        given = ", ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
        raise ValueError(f"checkpoint.save got another path on each rank ({given}): every rank passes the same path "
                         f"(one checkpoint directory holds every rank's pieces; trainer.save_checkpoint too). Nothing "
                         f"was written")


def check_same_directory(path: Path, partial: Path, seen: Sequence[bool]) -> None:
    """Every rank sees the directory rank 0 created for the save (each rank writing to its own disk would leave rank
    0's checkpoint without the others' pieces)."""
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise ValueError(f"checkpoint {path}: rank(s) {blind} do not see the directory rank 0 created for this save "
                         f"({partial.name} in {partial.parent}): the path names another directory on their host "
                         f"(a node-local disk, or a relative path from another working directory). A sharded "
                         f"checkpoint needs one directory every rank writes into: put it on shared storage (a "
                         f"network file system every host mounts at the same path), or save the one-file format "
                         f"rank 0 writes alone (RecStrategy(checkpoint_format='gathered')). Nothing was written")


# ------------------------------------------------------------------------------------------------
# does the checkpoint hold what loads?


def saved_rest_key(path: Path, saved: Mapping[str, Any], prefix: str, index: int, rank: int) -> str:
    """The entry that holds optimizer `index`'s pickled state (FSDP's dense state without module=: one per rank)."""
    key = f"{prefix}rest"
    if key in saved:
        return key
    key = f"{prefix}rest.rank{rank}"
    if not any(k.startswith(f"{prefix}rest") for k in saved):
        raise ValueError(f"checkpoint {path} holds no state for optimizer {index}: it was saved with "
                         f"{len({k.split('.')[1] for k in saved if k.startswith('optimizer_states.')})} "
                         f"optimizer(s)")
    if key not in saved:
        raise ValueError(f"checkpoint {path}: optimizer {index}'s dense state was saved sharded (FSDP) by "
                         f"{sum(1 for k in saved if k.startswith(f'{prefix}rest.rank'))} ranks; load it at "
                         f"that world size (its tables and fused state load at any)")
    return key


def check_bytes_entries(path: Path, saved: Mapping[str, Any], keys: Sequence[str]) -> None:
    missing = [k for k in keys if k not in saved]
    if missing:
        raise ValueError(f"checkpoint {path} has no {missing}: it was saved without a fused optimizer; build the "
                         f"model's tables with the same optimizer=FusedOptimizerConfig(...)")
    for k in keys:
        if not isinstance(saved[k], BytesStorageMetadata):
            raise ValueError(f"checkpoint {path}: '{k}' is not what this version writes there")


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


def _differences(saved: Mapping[str, Any], targets: Mapping[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """The targets the checkpoint lacks, those it holds with another shape, and those whose chunks leave holes."""
    missing, shapes, holes = [], [], []
    for fqn, obj in targets.items():
        if fqn not in saved:
            missing.append(fqn)
            continue
        entry = saved[fqn]
        if not isinstance(obj, (Tensor, Pieces)):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            shapes.append(f"{fqn}: not a tensor in the checkpoint")
        elif tuple(entry.size) != tuple(obj.size()):
            shapes.append(f"{fqn}: {tuple(entry.size)} in the checkpoint, {tuple(obj.size())} here")
        else:
            chunks = obj.__create_chunk_list__() if isinstance(obj, Pieces) else [
                ChunkStorageMetadata(torch.Size([0] * obj.dim()), obj.shape)]
            if any(_uncovered(entry, c.offsets, c.sizes) for c in chunks):
                holes.append(fqn)
    return missing, shapes, holes


def check_targets(path: Path, md, targets: Mapping[str, Any], what: str, strict: bool = True,
                  saved_prefix: str | None = None, written_by: str | None = None,
                  nothing_matched: bool = False) -> None:
    """Names every entry the checkpoint lacks or holds with another shape, before anything is read.

    nothing_matched: strict=False was given and no entry of the model is in the checkpoint (said, not skipped)."""
    saved = md.state_dict_metadata
    missing, shapes, holes = _differences(saved, targets)
    unexpected = []
    if strict and saved_prefix is not None:
        unexpected = [k for k in saved if k.startswith(saved_prefix) and k not in targets]
    hint = prefix_hint(missing, unexpected, saved_prefix) if saved_prefix is not None else None
    lines = [hint] if hint else []
    if shapes:
        lines.append("shapes differ: " + "; ".join(shapes))
    if missing:
        lines.append(f"not in the checkpoint: {short_list(missing)}")
    if unexpected:
        lines.append(f"in the checkpoint but not in this model: {short_list(unexpected)}")
    if holes:
        lines.append(f"the checkpoint's chunks do not cover what this rank holds of: {short_list(holes)} "
                     f"(a rank's part is missing)")
    if not lines:
        return
    if written_by:
        lines.insert(0, f"it was written by {written_by}")
    if nothing_matched:
        lines.insert(0, "strict=False would skip every entry of this model: none is in the checkpoint")
    fix = ("\nLoad it into a model built with the same tables and dims (resharding to another world size or plan "
           "is fine)")
    if shapes:  # strict=False skips entries, never loads one into another shape
        fix += ": strict=False skips missing and unexpected entries, not a table or layer of another size"
    elif not (hint or nothing_matched):  # (with those, strict=False would load nothing)
        fix += (", or pass strict=False to skip the entries that differ (under a Trainer: "
                "`self.strict_loading = False` in the LightningModule)")
    raise ValueError(f"checkpoint {path} does not match this {what}: " + "\n  ".join(lines) + fix)


def prefix_hint(missing: Sequence[str], unexpected: Sequence[str], head: str) -> str | None:
    """When the two sides' names differ by one leading prefix (a checkpoint of a LightningModule loaded into its
    `self.model`, or the other way), say so: the lists alone show every name twice and name no cause."""
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



def _fused_state_names(fused) -> dict[str, set[str]]:
    """This optimizer's fused state names per table (per-row ones marked), every table, sgd's (no state) too."""
    ours: dict[str, set[str]] = {table: set() for table in fused.global_table_names()}
    for key, (_, parts) in fused.global_state_pieces().items():
        table, name = key.rsplit(".", 1)
        ours.setdefault(table, set()).add(name + (PER_ROW if parts[0][1].dim() == 1 else ""))
    return ours


def check_same_fused_optimizer(path: Path, saved: Mapping[str, Any], head: str, fused) -> None:
    """A table whose fused state the checkpoint holds under other names was trained by another sparse optimizer:
    said as such (rowwise_adagrad's 'sum' loaded silently into sgd tables, which have none)."""
    ours = _fused_state_names(fused)
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
