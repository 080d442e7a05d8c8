"""The collectives of a save or a load, guarded or plain, and the wording of their failures.

dmp: the DistributedModelParallel of the model (RecStrategy passes its own). Given, every exchange runs through its
guard on its groups, so a peer that stops or hangs is named within its timeout (RecStrategy(embedding_timeout=...))
instead of blocking the others for the default group's timeout (Lightning's: 30 min). None: the default group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_rec.collective_guard import CollectiveMismatch, CollectiveTimeout, PeerExited, peer_failure

GUARD_ERRORS = (CollectiveMismatch, CollectiveTimeout, PeerExited)  # the guard's verdicts: each names its ranks


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def broadcast(obj: Any, dmp: Any = None) -> Any:
    """Rank 0's `obj` on every rank."""
    if not _distributed():
        return obj
    if dmp is not None:
        return dmp.all_gather_object(obj)[0]
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(obj: Any, dmp: Any = None) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not _distributed():
        return [obj]
    if dmp is not None:
        return dmp.all_gather_object(obj)
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_to_zero(obj: Any, dmp: Any = None) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (None elsewhere)."""
    if not _distributed():
        return [obj]
    if dmp is not None:
        return dmp.gather_object(obj)
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, parts, dst=0)
    return parts


def barrier_device_ids(backend: str, current_index: Callable[[], int]) -> dict[str, Any]:
    """dist.barrier's device_ids on NCCL (the current device), so that it neither warns nor guesses a
    device from the rank; nothing for gloo, whose barrier takes none."""
    return {"device_ids": [current_index()]} if backend == "nccl" else {}


def barrier(dmp: Any = None, tag: str = "checkpoint barrier") -> None:
    if not _distributed():
        return
    if dmp is None:
        dist.barrier(**barrier_device_ids(dist.get_backend(), torch.cuda.current_device))
        return
    pg, guard = dmp._emb_pg, dmp._guard  # the embedding group's guard names a peer that does not come
    k = guard.begin()
    work = dist.barrier(group=pg, async_op=True, **barrier_device_ids(dist.get_backend(pg), torch.cuda.current_device))
    guard.wait_work(work, tag, k)


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
