"""Sharded checkpoints through torch.distributed.checkpoint (DCP): save, load, reshard, export.

`save` writes a directory that loads at any world size and plan, or into the unsharded model (`load_model`,
`load_optimizer`); the one-file format of `RecStrategy(checkpoint_format="gathered")` loads through the same calls.
`full_state_dict`, `lightning_checkpoint`, `load_from_checkpoint` and `export` / `load_exported` read a checkpoint
whole on one process.

Modules, lowest first: format (files, entry names, keys), collectives, reshard (DCP's pieces and planners), paths,
files (commit, the one-file IO), reader (opening a checkpoint), optimizer_state, checks, gathered (the one-file
format), dcp (save, load_model, load_optimizer), resume (loader and generator states), unsharded (whole reads, export).
"""

from lightning_rec.checkpoint.checks import LOAD_MODEL_SIGNATURE, LOAD_OPTIMIZER_SIGNATURE, SAVE_SIGNATURE
from lightning_rec.checkpoint.collectives import GUARD_ERRORS, all_gather, barrier, barrier_device_ids
from lightning_rec.checkpoint.dcp import (
    DCPCheckpoint,
    IncompatibleKeys,
    load_model,
    load_optimizer,
    read_lightning_state,
    save,
)
from lightning_rec.checkpoint.files import UNREADABLE, check_readable, load_file, save_file
from lightning_rec.checkpoint.format import (
    DENSE_IN_DCP,
    FORMATS,
    FULL_BY_NAME,
    LIGHTNING_FILE,
    METADATA_FILE,
    MODULE_CLASS_KEY,
    PER_ROW,
    is_dcp_checkpoint,
)
from lightning_rec.checkpoint.gathered import (
    gathered_optimizer_state,
    gathered_state_dict,
    has_whole_by_name,
    load_gathered_optimizer,
    localize_full_state,
    state_dict_gather,
    state_dict_to_device,
)
from lightning_rec.checkpoint.optimizer_state import (
    fused_part,
    load_torch_optimizer_state,
    named_model,
    wrapped_named_model,
)
from lightning_rec.checkpoint.paths import is_local_path, local_path, refuse_resolved_file_url, refuse_url
from lightning_rec.checkpoint.reader import lightning_meta, read_metadata
from lightning_rec.checkpoint.resume import loader_state_for_rank, rng_state, rng_state_for_rank, set_rng_state
from lightning_rec.checkpoint.unsharded import (
    export,
    full_state_dict,
    lightning_checkpoint,
    load_exported,
    load_from_checkpoint,
)

# the names this module's callers used before it was a package (lightning_rec.strategy, lightning_rec.cli, tests)
_refuse_url = refuse_url
_barrier = barrier
_all_gather_object = all_gather
_lightning_meta = lightning_meta
_read_metadata = read_metadata
_named_model = named_model
_wrapped_named_model = wrapped_named_model

__all__ = [
    "DCPCheckpoint", "DENSE_IN_DCP", "FORMATS", "FULL_BY_NAME", "GUARD_ERRORS", "IncompatibleKeys", "LIGHTNING_FILE",
    "LOAD_MODEL_SIGNATURE", "LOAD_OPTIMIZER_SIGNATURE", "METADATA_FILE", "MODULE_CLASS_KEY", "PER_ROW",
    "SAVE_SIGNATURE", "UNREADABLE", "barrier_device_ids", "check_readable", "export", "full_state_dict", "fused_part",
    "gathered_optimizer_state", "gathered_state_dict", "has_whole_by_name", "is_dcp_checkpoint", "is_local_path",
    "lightning_checkpoint", "load_exported", "load_file", "load_from_checkpoint", "load_gathered_optimizer",
    "load_model", "load_optimizer", "load_torch_optimizer_state", "loader_state_for_rank", "local_path",
    "localize_full_state", "read_lightning_state", "refuse_resolved_file_url", "rng_state", "rng_state_for_rank",
    "save", "save_file", "set_rng_state", "state_dict_gather", "state_dict_to_device",
]
