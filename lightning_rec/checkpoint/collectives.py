"""The collectives of a save or a load: lightning_rec.comm's, on the DistributedModelParallel's groups.

dmp: the DistributedModelParallel of the model (RecStrategy passes its own). Given, every exchange runs through its
guard on its groups, so a peer that stops or hangs is named within its timeout (RecStrategy(embedding_timeout=...))
instead of blocking the others for the default group's timeout (Lightning's: 30 min). None: the default group.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_rec import comm
from lightning_rec.collective_guard import peer_failure
from lightning_rec.comm import GUARD_VERDICTS as GUARD_ERRORS
from lightning_rec.comm import barrier_device_ids  # noqa: F401  (imported from here too)


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def broadcast(obj: Any, dmp: Any = None) -> Any:
    """Rank 0's `obj` on every rank."""
    if dmp is None:
        return comm.broadcast_object(obj)
    return comm.broadcast_object(obj, group=dmp._emb_pg, device=dmp._device)


def all_gather(obj: Any, dmp: Any = None) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    return comm.all_gather_object(obj) if dmp is None else dmp.all_gather_object(obj)


def gather_to_zero(obj: Any, dmp: Any = None) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (None elsewhere)."""
    return comm.gather_object(obj) if dmp is None else dmp.gather_object(obj)


def barrier(dmp: Any = None, tag: str = "checkpoint barrier") -> None:
    comm.barrier(tag, group=None if dmp is None else dmp._emb_pg)


def dcp_group(dmp: Any = None) -> Any:
    """The process group of DCP's own exchanges: the DistributedModelParallel's checkpoint group, whose timeout is
    the strategy's (None: the default group)."""
    return getattr(dmp, "_checkpoint_pg", None)


def failure(doing: str, err: BaseException, then: str, cause: BaseException | None = None) -> BaseException | None:
    """A failed collective of `doing` ("saving checkpoint <path>") as the error to raise, `then` saying what became of
    the work: the guard's verdict (it names the rank and the timeout's setting), or PeerExited naming the ranks that
    exited (`cause`, default `err`, is what failed); None when neither explains it (the caller words that)."""
    if isinstance(err, GUARD_ERRORS):
        return type(err)(f"{doing}: {err}. {then}")
    return peer_failure(doing, cause if cause is not None else err, then)
