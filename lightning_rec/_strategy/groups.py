"""Process-group lifecycle under RecStrategy: groups closed at exit, destroyed groups and an old Store refused."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import threading
import warnings
from typing import Any

import torch.distributed as dist

from lightning_rec.collective_guard import old_store_alive

# after an uncaught exception, how long the exit hook waits for the groups to close before it leaves without them
CLOSE_AFTER_ERROR_S = 10.0

_exit_hook: list[bool] = []


def close_process_groups() -> None:
    """Destroy every process group and collect the objects that held one, while the interpreter is whole.

    Lightning leaves the process group open (another fit may follow). Left open, gloo's worker threads could
    abort the finished process at exit (SIGABRT): a worker releasing a collective's tensors needs the GIL,
    which a finalizing interpreter no longer gives; destroyed here, each group joins its workers first.
    Call it after a run that ended well: after an error a rank still inside a collective could wait on this
    one (on NCCL).
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()  # our modules, guards and pipelines hold groups too, in reference cycles


def close_gloo_groups_at_exit() -> None:
    """For scripts on CPU: close_process_groups at exit (gloo's destroy is local to the rank).

    After an uncaught exception too (gloo's threads aborted the process after our error was printed), but on
    a side thread for at most CLOSE_AFTER_ERROR_S, since a destroy can wait on a collective that a live,
    stuck peer never joins; past that the process leaves with status 1, its output flushed."""
    def close() -> None:
        if getattr(sys, "last_value", None) is None and getattr(sys, "last_exc", None) is None:
            close_process_groups()
        else:
            _close_after_error(CLOSE_AFTER_ERROR_S)

    if not _exit_hook:
        _exit_hook.append(True)
        atexit.register(close)


def _close_after_error(timeout_s: float) -> None:
    closed = threading.Event()

    def close() -> None:
        try:
            close_process_groups()
        except Exception:  # noqa: BLE001, S110 - a group broken by the error: leaving is all that is left to do
            pass
        finally:
            closed.set()

    threading.Thread(target=close, name="lightning_rec: close process groups", daemon=True).start()
    if closed.wait(timeout_s):
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110
            pass
    logging.shutdown()
    os._exit(1)


def warn_if_old_store_alive() -> None:
    """Before init_process_group: an earlier run's destroyed groups, still held by its garbage, keep its c10d
    Store serving on MASTER_PORT; init_process_group reuses that Store with the old run's keys, and the first
    collective can hang."""
    gc.collect()
    if old_store_alive():
        warnings.warn(
            "a process group destroyed by torch.distributed.destroy_process_group() is still held (a "
            "LightningModule sharded by an earlier Trainer, or a DistributedModelParallel, holds its groups): "
            "its c10d Store still serves on MASTER_PORT, and init_process_group reuses it with the earlier "
            "run's keys, which can hang. Delete those objects (del model) before this fit, or keep the process "
            "group between fits (no destroy_process_group() is needed)", stacklevel=3)


def refuse_destroyed_groups(module: Any, prior: Any) -> None:
    """`prior`: the DistributedModelParallel an earlier Trainer sharded `module`'s tables with (None: none). Once its
    groups are destroyed its shards cannot reach their peers again: said before new groups are made (while the
    old ones live, a new init_process_group in this process hangs on their Store)."""
    if prior is None or prior.groups_alive():
        return
    raise ValueError(
        f"this {type(module).__name__}'s tables were sharded by an earlier Trainer over process "
        f"groups that have been destroyed since (torch.distributed.destroy_process_group()): its shards cannot "
        f"reach their peers again. Build a new LightningModule for this Trainer (a checkpoint of this one loads "
        f"into it), and drop the old one (del it) before this fit; or keep the process group between fits "
        f"(Lightning leaves it open: no destroy_process_group() is needed)")
