"""The collectives of the training loop, written once: rank agreement, object collectives, one error wording.

    agree(row)            every rank's row of ints, on every rank: one-hot int64 slots (rank r writes its row at
                          [r*n, (r+1)*n) of W*n zeros) summed by one all-reduce; through shared memory when the
                          group has a transport, else the group's all-reduce, waited through its guard
    gather_object(obj)    every rank's picklable obj on one rank (all_gather_object: on every rank), broadcast_object
    barrier(tag)          a barrier waited through the group's guard
    collective_error(...) the one error for a collective that failed or timed out
    get_local_size/rank   ranks on this host and this rank's index there (TorchRec's names)

A group with a CollectiveGuard (the embedding group of a DistributedModelParallel, a pipeline's channel)
waits through it: a peer at another collective, or gone, is named within seconds and a timeout names the
setting. Other groups (the default one) run torch.distributed's own calls. The embedding exchanges of
input_dist / output_dist keep their own calls; their errors come from `collective_error` too.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_rec.collective_guard import CollectiveMismatch, CollectiveTimeout, PeerExited, guard_of, peer_failure
from lightning_rec.shm_transport import SharedMemoryGroup

GUARD_VERDICTS = (CollectiveMismatch, CollectiveTimeout, PeerExited)  # each names its ranks and the setting


def distributed() -> bool:
    """torch.distributed is up with more than one rank (else every collective here is the identity)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_local_size(world_size: int | None = None) -> int:
    """Ranks on this host (TorchRec's name): $LOCAL_WORLD_SIZE, else the world (`world_size` or the group's)."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return world_size


def get_local_rank(world_size: int | None = None, rank: int | None = None) -> int:
    """This rank's index on its host (TorchRec's name): $LOCAL_RANK, else the rank modulo get_local_size()."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return rank % get_local_size(world_size)


def collective_error(what: str, err: BaseException, timeout_s: float | None = None, group: Any = None,
                     setting: str = "DistributedModelParallel(timeout=...)", then: str = "") -> BaseException:
    """The error for a collective (`what`) that failed with `err`.

    A guard's verdict as it is; a guarded group's failure names the ranks that exited and the setting; else a
    peer known to have exited is named (PeerExited); else a RuntimeError naming the timeout and `setting`.
    `then`: what became of the work (said before the cause)."""
    if isinstance(err, GUARD_VERDICTS):
        return err
    pg = group.pg if isinstance(group, SharedMemoryGroup) else group
    guard = guard_of(pg, enabled_only=False) if pg is not None else None
    if guard is not None:
        return guard.failure(what, guard.k, err)
    peer = peer_failure(what, err, then)
    if peer is not None:
        return peer
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return RuntimeError(f"{what} failed on rank {rank}: a peer rank exited or did not answer within the process "
                        f"group timeout ({timeout_s} s; set {setting}). {then}{' ' if then else ''}Cause: {err}")


def agree(row: Sequence[int], group: Any = None, transport: SharedMemoryGroup | None = None,
          device: torch.device | None = None, stream: Any = None, tag: str = "ranks agree") -> list[list[int]]:
    """Collective: every rank's `row` (ints, the same length on every rank), in group-rank order, on every rank.

    transport: the group's shared-memory transport (same-host CPU ranks), used instead of the process group.
    device: where the slots travel for the all-reduce (NCCL: the rank's GPU; None: the host).
    stream: a side CUDA stream for it: on the compute stream the all-reduce would wait for every queued step,
    and reading it back would drain the GPU."""
    pg = group if group is not None else dist.group.WORLD
    world, me, n = dist.get_world_size(pg), dist.get_rank(pg), len(row)
    if world == 1:  # nobody to agree with (on a GPU, each read-back was a wait)
        return [list(row)]
    values = [0] * (world * n)
    values[me * n:(me + 1) * n] = row
    slots = torch.tensor(values, dtype=torch.int64)
    try:
        if transport is not None:
            transport.all_reduce_sum_(slots, tag=tag)
        else:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                on_device = slots.to(device) if device is not None else slots
                _all_reduce(on_device, pg, tag)
                slots = on_device.cpu()
    except GUARD_VERDICTS:
        raise
    except RuntimeError as e:
        raise collective_error(tag, e, group=pg) from e
    flat = slots.tolist()
    return [flat[r * n:(r + 1) * n] for r in range(world)]


def _all_reduce(t: torch.Tensor, pg: Any, tag: str) -> None:
    guard = guard_of(pg, enabled_only=False)
    if guard is None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=pg)
        return
    k = guard.begin()
    guard.wait_work(dist.all_reduce(t, op=dist.ReduceOp.SUM, group=pg, async_op=True), tag, k)


def gather_object(obj: Any, dst: int | None = 0, group: Any = None, device: torch.device | None = None,
                  tag: str = "checkpoint gather") -> list | None:
    """Collective: every rank's picklable `obj`, in group-rank order, on group rank `dst`; None elsewhere.

    dst=None: on every rank (all_gather_object). As torch.distributed's gather_object, but a guarded group's
    waits go through its guard and are bounded by its timeout. Host memory: the pickle and one padded buffer
    on every rank, and the world's buffers on `dst` (checkpoints send one table at a time).
    device: the rank's GPU, where the group is NCCL's (default: the current CUDA device)."""
    if not distributed():
        return [obj]
    pg = group if group is not None else dist.group.WORLD
    guard = guard_of(pg, enabled_only=False)
    if guard is None:
        return _plain_gather(obj, dst, pg)
    dev = _device(guard, device)
    buf, sizes = _padded_pickle(obj, pg, guard, dev, f"{tag} (sizes)")
    world, me = dist.get_world_size(pg), dist.get_rank(pg)
    out = [torch.empty_like(buf) for _ in range(world)] if dst is None or me == dst else None
    k = guard.begin()
    if dst is None:
        work = dist.all_gather(out, buf, group=pg, async_op=True)
    else:
        work = dist.gather(buf, out, dst=dist.get_global_rank(pg, dst), group=pg, async_op=True)
    guard.wait_work(work, tag, k)
    del buf
    if out is None:
        return None
    objs = []
    for i, n in enumerate(sizes):  # each buffer freed once read
        t, out[i] = out[i], None
        objs.append(pickle.loads(t[:n].cpu().numpy().data) if n else None)
        del t
    return objs


def all_gather_object(obj: Any, group: Any = None, device: torch.device | None = None,
                      tag: str = "checkpoint gather") -> list:
    """Collective: every rank's picklable `obj`, in group-rank order, on every rank (see gather_object)."""
    return gather_object(obj, None, group, device, tag)


def broadcast_object(obj: Any, src: int = 0, group: Any = None, device: torch.device | None = None,
                     tag: str = "checkpoint broadcast") -> Any:
    """Collective: group rank `src`'s picklable `obj`, on every rank (guarded as gather_object)."""
    if not distributed():
        return obj
    pg = group if group is not None else dist.group.WORLD
    guard = guard_of(pg, enabled_only=False)
    if guard is None:
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(pg, src), group=pg)
        return box[0]
    return all_gather_object(obj if dist.get_rank(pg) == src else None, pg, device, tag)[src]


def barrier(tag: str = "barrier", group: Any = None) -> None:
    """Collective: a barrier of `group` (default: every rank), through its guard when it has one."""
    if not distributed():
        return
    pg = group if group is not None else dist.group.WORLD
    device_ids = barrier_device_ids(dist.get_backend(pg), torch.cuda.current_device)
    guard = guard_of(pg, enabled_only=False)
    if guard is None:
        dist.barrier(group=pg, **device_ids)
        return
    k = guard.begin()
    guard.wait_work(dist.barrier(group=pg, async_op=True, **device_ids), tag, k)


def barrier_device_ids(backend: str, current_index: Callable[[], int]) -> dict[str, Any]:
    """dist.barrier's device_ids on NCCL (the current device), so that it neither warns nor guesses a device from the
    rank; nothing for gloo, whose barrier takes none."""
    return {"device_ids": [current_index()]} if backend == "nccl" else {}


def _device(guard: Any, device: torch.device | None) -> torch.device:
    if not guard.nccl:
        return torch.device("cpu")
    return device if device is not None else torch.device("cuda", torch.cuda.current_device())


def _plain_gather(obj: Any, dst: int | None, pg: Any) -> list | None:
    world = dist.get_world_size(pg)
    if dst is None:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, obj, group=pg)
        return out
    parts = [None] * world if dist.get_rank(pg) == dst else None
    dist.gather_object(obj, parts, dst=dist.get_global_rank(pg, dst), group=pg)
    return parts


def _padded_pickle(obj: Any, pg: Any, guard: Any, dev: torch.device, tag: str) -> tuple[torch.Tensor, list[int]]:
    """`obj` pickled into a buffer as long as the longest of any rank's (gather needs one size everywhere),
    and every rank's pickle size (one guarded all-gather)."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(dist.get_world_size(pg))]
    k = guard.begin()
    work = dist.all_gather(sizes, torch.tensor([len(payload)], device=dev), group=pg, async_op=True)
    guard.wait_work(work, tag, k)
    sizes_W = [int(t) for t in sizes]
    buf = torch.empty(max(sizes_W), dtype=torch.uint8, device=dev)
    if payload:
        with warnings.catch_warnings():  # read-only bytes, copied at once: no write goes through them
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            buf[: len(payload)].copy_(torch.frombuffer(payload, dtype=torch.uint8))
    return buf, sizes_W
