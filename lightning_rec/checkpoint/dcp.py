"""The sharded format through torch.distributed.checkpoint (DCP): save (a commit of every rank's pieces), and load a
model or an optimizer at any world size and plan, or unsharded (see format.py for the layout)."""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor

from lightning_rec.checkpoint.checks import (
    LOAD_MODEL_SIGNATURE,
    check_bytes_entries,
    check_load_optimizer_args,
    check_module,
    check_path,
    check_same_directory,
    check_same_fused_optimizer,
    check_same_path,
    check_save_args,
    check_targets,
    saved_rest_key,
)
from lightning_rec.checkpoint.collectives import all_gather, barrier, broadcast, dcp_group, failure, rank_world
from lightning_rec.checkpoint.files import commit, remove_stale_partials, sees
from lightning_rec.checkpoint.format import (
    LIGHTNING_FILE,
    STATE_DICT,
    module_class,
    optimizer_prefix,
    partial_name,
    unblob,
)
from lightning_rec.checkpoint.gathered import load_model_from_file, load_optimizer_from_file, weights_written
from lightning_rec.checkpoint.optimizer_state import (
    copy_per_row,
    fused_child,
    fused_part,
    fused_targets,
    load_dense_parts,
    load_fused_groups,
    named_model,
    optimizer_entries,
    unwrap,
)
from lightning_rec.checkpoint.paths import local_path, readable_path, refuse_url
from lightning_rec.checkpoint.reader import dcp_load, dmp_of, full_model_state, lightning_meta, read_metadata
from lightning_rec.checkpoint.reshard import SavePlanner, device_of, pieces_of
from lightning_rec.sharding.sharded_tensor import ShardedTensor

# ------------------------------------------------------------------------------------------------
# save


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
    check_save_args(checkpoint, path, optimizers, module)
    path = local_path(path)  # file://: the local directory it names
    refuse_url(path)
    path = Path(path)
    tag, loader_states, rng_states = _first_exchange(path, loader_state, rng_state, dmp)
    partial = partial_name(path, tag)
    entries, columns = _entries(checkpoint, optimizers, module, dmp)
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    meta["lightning_rec"] = {"format": "dcp", "world_size": rank_world()[1], "num_optimizers": len(optimizers),
                             "module_class": module_class, "per_row_columns": columns,
                             "loader_states": list(loader_states),
                             "rng_states": list(rng_states) if rng_state is not None else None}
    error: BaseException | None = None
    try:
        _write(entries, meta, path, partial, dmp)
    except BaseException as e:  # noqa: BLE001 - every rank must still reach the agreement below
        error = e
    failed = _failed_ranks(error, path, partial, dmp)
    rank = rank_world()[0]
    if failed:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        if error is not None:
            raise error
        raise OSError(f"checkpoint {path}: rank(s) {failed} could not write their part; nothing was committed "
                      f"and the previous checkpoint is unchanged")
    if rank == 0:
        commit(partial, path)
    barrier(dmp)


def _first_exchange(path: Path, loader_state: Any, rng_state: Any, dmp: Any) -> tuple[str, tuple, tuple]:
    """Collective: the save's tag (rank 0's) and every rank's loader and generator states, the ranks' paths agreed.
    A rank that does not come (or left) shows here, before anything is written."""
    rank, world = rank_world()
    try:
        tag = broadcast(uuid.uuid4().hex[:12] if rank == 0 else None, dmp)
        loader_states, rng_states, paths = zip(*all_gather((loader_state, rng_state, os.path.normpath(path)), dmp))
    except Exception as e:  # noqa: BLE001 - named with the usual cause below
        said = ("The save is collective: every rank calls it (trainer.save_checkpoint too, not only under "
                "`if trainer.is_global_zero:`). Nothing was written.")
        said_so = failure(f"saving checkpoint {path}", e, said)
        raise said_so or RuntimeError(f"saving checkpoint {path}: rank {rank} of {world} could not reach the other "
                                      f"ranks ({e}). {said}") from e
    check_same_path(paths)
    return tag, loader_states, rng_states


def _entries(checkpoint: Mapping[str, Any], optimizers: Sequence[torch.optim.Optimizer], module: Any,
             dmp: Any) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """This rank's DCP entries, and the per-row state's column offsets (see format.py)."""
    entries = {f"{STATE_DICT}{key}": pieces_of(value) if isinstance(value, ShardedTensor) else value
               for key, value in checkpoint["state_dict"].items()}
    columns: dict[str, list[int]] = {}
    for i, optimizer in enumerate(optimizers):
        entries.update(optimizer_entries(optimizer, optimizer_prefix(i), columns, module, dmp))
    return entries, columns


def _write(entries: dict[str, Any], meta: dict[str, Any], path: Path, partial: Path, dmp: Any) -> None:
    """Every rank's pieces into `partial`, then rank 0's `lightning.pt` (last: its presence marks a whole save)."""
    rank = rank_world()[0]
    if rank == 0:
        remove_stale_partials(path)  # a save killed earlier
        partial.mkdir(parents=True)
    barrier(dmp)
    # One file per rank when the pieces are host memory (written in place, see reshard.own_storage); from a
    # GPU, one file per piece, so that host copies live one piece at a time, not a rank's worth. The same exchange
    # says whether every rank sees the directory rank 0 made (not each its own disk).
    on_host, seen = zip(*all_gather((all(device_of(v) == "cpu" for v in entries.values()),
                                     rank == 0 or sees(partial)), dmp))
    check_same_directory(path, partial, seen)
    writer = dcp.FileSystemWriter(str(partial), sync_files=True, single_file_per_rank=all(on_host))
    with warnings.catch_warnings():  # one process without torch.distributed is what we mean here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(entries, storage_writer=writer, planner=SavePlanner(), process_group=dcp_group(dmp))
    if rank == 0:
        tmp = partial / (LIGHTNING_FILE + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, partial / LIGHTNING_FILE)


def _failed_ranks(error: BaseException | None, path: Path, partial: Path, dmp: Any) -> list[int]:
    """Collective: the ranks that could not write their part (a peer gone raises: nothing was committed)."""
    try:
        return [r for r, e in enumerate(all_gather(error is not None, dmp)) if e]
    except Exception as e:  # noqa: BLE001 - a peer is gone: say which, and that nothing was committed
        kept = (f"Nothing was committed: {path} is unchanged (the partial directory {partial.name} is removed by the "
                f"next save of that name).")
        cause = error or e
        said_so = failure(f"saving checkpoint {path}", e, kept, cause=cause)
        raise said_so or RuntimeError(f"saving checkpoint {path}: the ranks could not agree that every part was "
                                      f"written ({e}). {kept}") from cause


# ------------------------------------------------------------------------------------------------
# load


class DCPCheckpoint(MutableMapping):
    """Stands in for the tensors of a DCP checkpoint in Lightning's loaded dict until they are read.

    The model's (`index` None) is also the state dict that a LightningModule's `on_load_checkpoint(checkpoint)` finds
    in `checkpoint["state_dict"]`: read, it holds every tensor whole, read on this rank alone on first use; changed
    (a key renamed, one dropped), that dict is what loads (each rank keeping its pieces). Untouched, every rank reads
    only its pieces from disk.
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
            self._whole = full_model_state(self.path)[0]
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


def read_lightning_state(path: str | os.PathLike) -> dict[str, Any]:
    """Lightning's checkpoint dict of a DCP directory, its tensors left on disk (`DCPCheckpoint` markers)."""
    path = readable_path(path)
    read_metadata(path)
    meta = lightning_meta(path)
    info = meta.get("lightning_rec", {})
    meta["state_dict"] = DCPCheckpoint(path)
    if info.get("num_optimizers", 0) or "lr_schedulers" in meta:
        meta["optimizer_states"] = [DCPCheckpoint(path, i) for i in range(info.get("num_optimizers", 0))]
    # else ModelCheckpoint(save_weights_only=True) wrote it: without the entry Lightning's resume says so (with an
    # empty one it went past the optimizers, fresh, and named the learning-rate schedulers instead)
    return meta


class IncompatibleKeys(NamedTuple):
    """What `load_model(..., strict=False)` skipped, as torch's `module.load_state_dict` returns it: the model's
    entries the checkpoint lacks, and the checkpoint's entries the model lacks (state-dict names)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _written_by(path: Path, module: torch.nn.Module) -> str | None:
    """The class that wrote the checkpoint when it is not this model's (said in a mismatch)."""
    model = named_model(module)
    ours = f"{type(model).__module__}.{type(model).__qualname__}"
    written_by = module_class(lightning_meta(path))
    return written_by if written_by not in (None, ours) else None


@torch.no_grad()
def load_model(module: torch.nn.Module, path: str | os.PathLike, strict: bool = True) -> IncompatibleKeys:
    """Read this rank's pieces of the module's state from a DCP checkpoint (or a one-file one), in place.

    The module may be sharded by any plan at any world size, or not sharded at all (then call it
    on one process, torch.distributed not needed): every tensor reads the rectangles it holds.
    Returns `IncompatibleKeys(missing_keys, unexpected_keys)`, as `module.load_state_dict` does: with
    strict=False, the entries that were skipped (a table added since the save keeps its weights); with
    strict=True, any difference raises, so both lists are empty.
    """
    check_module(LOAD_MODEL_SIGNATURE, module)
    check_path(LOAD_MODEL_SIGNATURE, path)
    path = readable_path(path)
    if path.is_file():  # the one-file format (checkpoint_format="gathered"), every table whole
        return IncompatibleKeys(*load_model_from_file(module, path, strict))
    reader, md = read_metadata(path)
    targets: dict[str, Any] = {}
    for key, value in module.state_dict().items():
        if isinstance(value, ShardedTensor):
            targets[f"{STATE_DICT}{key}"] = pieces_of(value)
        elif isinstance(value, Tensor):
            targets[f"{STATE_DICT}{key}"] = value
    written_by, saved = _written_by(path, module), md.state_dict_metadata
    unexpected = [k[len(STATE_DICT):] for k in saved if k.startswith(STATE_DICT) and k not in targets]
    missing = [k[len(STATE_DICT):] for k in targets if k not in saved]
    what = f"model ({type(module).__name__})"
    if not strict:
        kept = {k: v for k, v in targets.items() if k in saved}
        if targets and not kept:  # strict=False would skip every entry: load nothing, and say nothing
            check_targets(path, md, targets, what, True, saved_prefix=STATE_DICT, written_by=written_by,
                          nothing_matched=True)
        targets = kept
    check_targets(path, md, targets, what, strict, saved_prefix=STATE_DICT, written_by=written_by)
    dcp_load(targets, reader, path, dmp=dmp_of(module))
    weights_written(module)
    return IncompatibleKeys(missing, unexpected)


def _optimizer_targets(path: Path, md, optimizer: torch.optim.Optimizer, fused_key: str | None, prefix: str,
                       rest_entry: str, strict: bool) -> tuple[dict[str, Any], list[tuple]]:
    """What DCP reads for one optimizer (None: a bytes entry) and the per-row copies to do after; checked first."""
    saved = md.state_dict_metadata
    per_row_columns = lightning_meta(path).get("lightning_rec", {}).get("per_row_columns", {})
    targets: dict[str, Any] = {rest_entry: None}
    post: list[tuple] = []
    if fused_key is not None:
        fused = fused_child(optimizer, fused_key)
        check_same_fused_optimizer(path, saved, f"{prefix}fused.", fused)
        targets[f"{prefix}fused.param_groups"] = None
        fused_entries, post = fused_targets(fused, f"{prefix}fused.", saved, per_row_columns)
        targets.update(fused_entries)
    if not strict:  # tables added since the save: their state stays as it starts (a missing bytes entry is still named)
        targets = {k: v for k, v in targets.items() if v is None or k in saved}
        post = [p for p in post if p[0] in targets]
    check_targets(path, md, {k: v for k, v in targets.items() if v is not None}, "optimizer's fused state")
    check_bytes_entries(path, saved, [k for k, v in targets.items() if v is None])
    return targets, post


@torch.no_grad()
def load_optimizer(optimizer: torch.optim.Optimizer, path: str | os.PathLike, index: int = 0,
                   module: torch.nn.Module | None = None, strict: bool = True) -> None:
    """Restore optimizer `index` of a DCP checkpoint (or a one-file one): fused state shard by shard, the rest whole.

    module: the model the optimizer trains; needed when its dense state was saved sharded (FSDP),
    which then loads at any world size (DCP reads the shards this rank's parameters hold).
    strict=False: the fused state of a table the checkpoint does not hold (one added since) keeps its
    initial value, as `load_model(..., strict=False)` leaves its weights.
    """
    check_load_optimizer_args(optimizer, path, index, module)
    path = readable_path(path)
    optimizer = unwrap(optimizer)
    if path.is_file():
        load_optimizer_from_file(optimizer, path, index, module, strict)
        return
    reader, md = read_metadata(path)
    prefix = optimizer_prefix(index)
    rest_entry = saved_rest_key(path, md.state_dict_metadata, prefix, index, rank_world()[0])
    fused_key = fused_part(optimizer)
    targets, post = _optimizer_targets(path, md, optimizer, fused_key, prefix, rest_entry, strict)
    dcp_load(targets, reader, path, dmp=dmp_of(module))
    copy_per_row(post)
    if fused_key is not None:
        fused = fused_child(optimizer, fused_key)
        fused.state_loaded()
        load_fused_groups(fused, unblob(targets[f"{prefix}fused.param_groups"]))
    load_dense_parts(optimizer, fused_key, unblob(targets[rest_entry]), prefix, module, path)
