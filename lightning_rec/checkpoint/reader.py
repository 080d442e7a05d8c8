"""Opening a checkpoint: what a path is (and what loads it when it is not a checkpoint directory), whether the
directory is whole, its metadata and Lightning dict, and DCP's read of a set of targets."""

from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_rec.checkpoint.collectives import GUARD_ERRORS, barrier, dcp_group, failure
from lightning_rec.checkpoint.files import load_file
from lightning_rec.checkpoint.format import LIGHTNING_FILE, METADATA_FILE, STATE_DICT, is_dcp_checkpoint
from lightning_rec.checkpoint.reshard import LoadPlanner
from lightning_rec.sharding.sharded_tensor import ShardedTensor

_A_CHECKPOINT = ("a checkpoint (a directory written by lightning_rec.checkpoint.save, or a one-file Lightning "
                 "checkpoint)")


def _what_file(path: Path, head: str) -> str:
    """What a file that is not a checkpoint directory holds, and what loads it."""
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


def not_a_dcp_checkpoint(path: Path, wanted: str = "a checkpoint directory written by lightning_rec.checkpoint.save "
                                                         "(DCP)") -> str | None:
    """What `path` is, and what loads it, when it is not a DCP checkpoint directory; None when it may be one
    (a file or an export directory is not "a checkpoint directory whose save did not finish")."""
    if path.is_dir():
        if (path / "model.safetensors").is_file() and (path / "config.json").is_file():
            return (f"{path} is an export directory (lightning-rec export / checkpoint.export), not a checkpoint: "
                    f"load it with lightning_rec.checkpoint.load_exported({str(path)!r})")
        return None
    return _what_file(path, f"{path} is a file, not {wanted}")


def _check_complete(path: Path) -> None:
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    other = not_a_dcp_checkpoint(path)
    if other is not None:
        raise ValueError(other)
    missing = [n for n in (METADATA_FILE, LIGHTNING_FILE) if not (path / n).is_file()]
    if not missing:
        return
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


def _check_files(path: Path, md) -> None:
    """Every file that an entry lives in is there, and long enough (a copy cut short, a lost rank's file)."""
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


def read_metadata(path: Path):
    """DCP's reader and metadata of a whole checkpoint directory (what it lacks, or what it is instead, raises)."""
    _check_complete(path)
    reader = dcp.FileSystemReader(str(path))
    try:
        md = reader.read_metadata()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise ValueError(f"checkpoint {path} is damaged: its index {path / METADATA_FILE} cannot be read "
                         f"({type(e).__name__}: {e}): restore it from where the checkpoint was written, or use an "
                         f"earlier checkpoint") from e
    _check_files(path, md)
    return reader, md


def lightning_meta(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / LIGHTNING_FILE, map_location="cpu", weights_only=False)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as e:
        raise ValueError(f"checkpoint file {path / LIGHTNING_FILE} is incomplete or damaged ({e}): "
                         f"use an earlier checkpoint") from e


def lightning_file(path: Path) -> Mapping[str, Any]:
    """A one-file Lightning checkpoint's dict (memory-mapped), or what the file is and what loads it."""
    whole = load_file(path)
    if not (isinstance(whole, Mapping) and "state_dict" in whole):
        raise ValueError(not_a_dcp_checkpoint(path, _A_CHECKPOINT))
    return whole


def dmp_of(module: Any) -> Any:
    """The DistributedModelParallel whose groups bound a load's waits: `module` itself, or the one RecStrategy sharded
    it with; None (the default group) when there is none or its groups were destroyed."""
    if module is None:
        return None
    dmp = module if hasattr(module, "_checkpoint_pg") else vars(module).get("_lightning_rec_dmp")
    return dmp if dmp is not None and dmp.groups_alive() else None


def _read_failure(path: Path, e: BaseException, local: bool, dmp: Any) -> BaseException:
    """A failed DCP read, said: a peer that exited or does not come, an entry saved under another name, or damage."""
    doing, then = f"reading checkpoint {path}", "Its files are not at fault: load it again with every rank running."
    peer = failure(doing, e, then)
    if peer is not None:
        return peer
    if dmp is not None and not local:
        # DCP's timeout names no rank: the guard's barrier names a peer that does not come (stopped, stuck); with
        # every peer there the error was DCP's own, said below
        try:
            barrier(dmp, "checkpoint load (after a failed read)")
        except GUARD_ERRORS as verdict:
            return failure(doing, verdict, then)
    # (DCP's text holds its traceback, whose source line shows the message's f-string too)
    missing = re.findall(r"Missing key in checkpoint state_dict: ([^\s{}]+?)\.?$", str(e), re.MULTILINE)
    if missing:  # not damage: the entry was saved under another name (or not at all)
        return ValueError(f"checkpoint {path} has no entry '{missing[-1]}': it was saved from a model whose "
                          f"parameters are named otherwise. Pass the same module= to checkpoint.save and "
                          f"checkpoint.load_optimizer (the model the optimizer trains, or its "
                          f"DistributedModelParallel)")
    return ValueError(f"reading checkpoint {path} failed: {e}\nA file of it may be damaged or cut short: "
                      f"use an earlier checkpoint")


def dcp_load(targets: dict[str, Any], reader, path: Path, local: bool = False, dmp: Any = None) -> None:
    """DCP reads `targets` in place. local: this rank reads alone (not a collective), whatever the process group.
    dmp: DCP's exchanges run on its checkpoint group, bounded by its timeout."""
    if not targets:
        return
    try:
        with warnings.catch_warnings():  # one process without torch.distributed is what we mean here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=reader, planner=LoadPlanner(), process_group=dcp_group(dmp),
                     no_dist=local or not (dist.is_available() and dist.is_initialized()))
    except (Exception, CheckpointException) as e:  # DCP's errors name no file
        raise _read_failure(path, e, local, dmp) from e


def full_model_state(path: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Every model tensor whole (CPU), and the Lightning dict, from a DCP directory or a gathered file: read by this
    process alone (no collective, whatever the process group: one rank may call it while the others train)."""
    if is_dcp_checkpoint(path):
        reader, md = read_metadata(path)
        meta = lightning_meta(path)
        targets = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
                   for k, v in md.state_dict_metadata.items()
                   if k.startswith(STATE_DICT) and isinstance(v, TensorStorageMetadata)}
        dcp_load(targets, reader, path, local=True)
        return {k[len(STATE_DICT):]: v for k, v in targets.items()}, meta
    ckpt = load_file(path) if path.suffix != ".safetensors" else None
    if not (isinstance(ckpt, Mapping) and "state_dict" in ckpt):  # not a one-file Lightning checkpoint
        raise ValueError(not_a_dcp_checkpoint(path, _A_CHECKPOINT))
    state = {k: v.full() if isinstance(v, ShardedTensor) else v for k, v in ckpt["state_dict"].items()}
    return state, ckpt
