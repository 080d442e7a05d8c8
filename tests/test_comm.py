"""lightning_rec.comm: one slot layout for rank agreement, guarded-or-plain object collectives, one error wording."""

from __future__ import annotations

import torch.distributed as dist
from dist_utils import run_ranks

from lightning_rec import comm


def _collectives(rank, world_size):
    from datetime import timedelta

    from lightning_rec.collective_guard import CollectiveGuard
    from lightning_rec.shm_transport import SharedMemoryGroup

    guarded = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    guard = CollectiveGuard(guarded, "test", 30.0, "the test's timeout")
    transport = SharedMemoryGroup.create(guarded, 30.0)
    row = [rank, 10 * rank, -rank]
    out = {
        "plain": comm.agree(row),
        "guarded": comm.agree(row, guarded),
        "shared memory": comm.agree(row, guarded, transport) if transport is not None else comm.agree(row),
        "gather plain": comm.gather_object({"rank": rank}),
        "gather guarded": comm.gather_object({"rank": rank}, 1, guarded),
        "all_gather guarded": comm.all_gather_object(("r", rank), guarded),
        "broadcast plain": comm.broadcast_object(f"from {rank}"),
        "broadcast guarded": comm.broadcast_object(f"from {rank}", 1, guarded),
    }
    comm.barrier("test barrier", guarded)
    comm.barrier()
    out["calls"] = guard.k
    return out


def test_agree_gives_every_rank_every_row_and_the_object_collectives_match_torchs():
    results = run_ranks(_collectives, 2)
    rows = [[0, 0, 0], [1, 10, -1]]
    for rank, out in enumerate(results):
        assert out["plain"] == out["guarded"] == out["shared memory"] == rows
        assert out["gather plain"] == ([{"rank": 0}, {"rank": 1}] if rank == 0 else None)
        assert out["gather guarded"] == ([{"rank": 0}, {"rank": 1}] if rank == 1 else None)
        assert out["all_gather guarded"] == [("r", 0), ("r", 1)]
        assert out["broadcast plain"] == "from 0" and out["broadcast guarded"] == "from 1"
        assert out["calls"] == 8  # agree 1, gather 2, all_gather 2, broadcast 2, barrier 1: all through the guard


def test_one_rank_agrees_with_itself_without_a_collective():
    assert not dist.is_initialized()
    assert comm.gather_object("x") == ["x"] and comm.broadcast_object("x") == "x"
    comm.barrier()


def test_a_failed_collective_names_what_failed_the_timeout_and_its_setting():
    err = comm.collective_error("id all-to-all", RuntimeError("Connection closed by peer"), 300.0)
    assert type(err) is RuntimeError
    assert str(err) == ("id all-to-all failed on rank 0: a peer rank exited or did not answer within the process "
                        "group timeout (300.0 s; set DistributedModelParallel(timeout=...)). Cause: Connection closed "
                        "by peer")
    from lightning_rec.collective_guard import CollectiveMismatch

    verdict = CollectiveMismatch("ranks at different collectives")
    assert comm.collective_error("x", verdict) is verdict  # a guard's verdict names the ranks already


def _late_rank_at_the_timeout(rank, world_size):
    import time
    from datetime import timedelta

    from lightning_rec.collective_guard import CollectiveGuard

    out = []
    for own_limit in (1.5, 2.0):  # the group's own time limit, under or equal to the guard's 2 s
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=own_limit))
        guard = CollectiveGuard(group, "test", 2.0, "the test's timeout")  # noqa: F841 (held: the group's guard)
        if rank == 1:
            time.sleep(3.5)  # computing: alive, in no collective, past rank 0's timeout
        else:
            try:
                comm.barrier("late barrier", group)
                out.append("no error")
            except RuntimeError as e:
                out.append(f"{type(e).__name__}: {e}")
        dist.barrier()
    return out


def test_a_late_rank_is_named_when_the_groups_own_time_limit_ends_the_wait():
    """A rank stopped in a checkpoint save got 'a peer did not answer within the timeout' instead of its name now
    and then: gloo's own limit (the group's timeout, the guard's too) ended the wait before the guard's watch loop
    checked the clock, or during the first timed wait, which lasted the whole timeout (the grace was the timeout)."""
    messages = run_ranks(_late_rank_at_the_timeout, 2)[0]
    for message in messages:
        assert message.startswith("CollectiveTimeout: test 'late barrier'"), message
        assert "rank 1 did not reach it within 2 s" in message and "the test's timeout" in message, message


_EXIT_IN_A_STORE_CALL = """
import sys, time
import torch.distributed as dist
from lightning_rec.collective_guard import _Watcher

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, True)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)

def tick(self):  # Store calls (the GIL released in each) going on while the main thread ends
    while _Watcher._instance is self:
        self.store().add("ticks", 1)
    return False

_Watcher._tick = tick
_Watcher.ensure(store, 0)
time.sleep(1.3)  # the watcher's first tick (1 s) is under way
dist.destroy_process_group()
"""


def test_the_collective_watcher_leaves_before_the_interpreter_finalizes():
    """A second host's rank aborted at exit (SIGABRT, "terminate called without an active exception"): the
    watcher's daemon thread was inside a Store call when the interpreter finalized; torchrun's first host then
    waited 300 s for it at its exit barrier."""
    import subprocess
    import sys

    from dist_utils import free_port

    done = subprocess.run([sys.executable, "-c", _EXIT_IN_A_STORE_CALL, str(free_port())], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
