"""Two-rank plumbing: run a case's function on two ranks and bring its outcome back."""

from __future__ import annotations

import os
import sys
import time

from .helpers import ROOT, _t, kjt_lengths
from .registry import Hang, RemoteError


def _threads():
    _t().set_num_threads(int(os.environ.get("BATTERY_THREADS", "1")))


def _outcome(fn):
    start = time.monotonic()
    try:
        value = fn()
    except BaseException as e:  # noqa: BLE001 - sent back to the case
        return ("error", [k.__name__ for k in type(e).__mro__], f"{type(e).__name__}: {e}", time.monotonic() - start)
    return ("ok", value, "", time.monotonic() - start)


def _fast_guard():
    from lightning_rec import collective_guard
    collective_guard.GRACE_S = 1.0


def _dmp_of(ebc, verbs, W, shared_memory, timeout=20.0):
    from lightning_rec import DistributedModelParallel, ShardingPlan, construct_module_sharding_plan
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, verbs, world_size=W)})
    return DistributedModelParallel(ebc, plan=plan, device="cpu", timeout=timeout, shared_memory=shared_memory)


def _verbs(kind="tw"):
    from lightning_rec import column_wise, row_wise, table_wise
    return {"tw": {"t_a": table_wise(rank=0), "t_b": table_wise(rank=1)},
            "rw": {"t_a": row_wise(), "t_b": row_wise()},
            "cw": {"t_a": column_wise(ranks=[0, 1]), "t_b": table_wise(rank=0)}}[kind]


def _rank_batches(rank):
    # rank 0: B=2, rank 1: B=3 (different batch sizes per rank)
    if rank == 0:
        return kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0])
    return kjt_lengths(["a", "b"], [9, 4, 5, 5, 1], [1, 0, 2, 1, 0, 1])


def run_two_ranks(fn, *args, timeout=50.0, W=2):
    sys.path.insert(0, str(ROOT / "tests"))
    from dist_utils import RankFailed, run_ranks
    try:
        return run_ranks(fn, W, *args, timeout=timeout, pg_timeout=timeout, allow_missing=True)
    except RankFailed as e:
        text = str(e)
        if "still running after" in text:
            raise Hang(text) from None
        raise


def raise_first_error(outcomes, need_all=False, max_s=None):
    """Re-raise the first rank's error here (names and message); need_all: every live rank must raise."""
    errs = [(r, o) for r, o in enumerate(outcomes) if o is not None and o[0] == "error"]
    if max_s is not None:
        slow = [(r, o[3]) for r, o in enumerate(outcomes) if o is not None and o[3] > max_s]
        if slow:
            raise Hang(f"rank(s) took {slow} s (> {max_s} s) to notice")
    if need_all:
        oks = [r for r, o in enumerate(outcomes) if o is not None and o[0] == "ok"]
        if oks and errs:
            raise RemoteError(["Silent"], f"ranks {oks} went on without an error while rank {errs[0][0]} raised: "
                              f"{errs[0][1][2]}")
    if errs:
        r, o = errs[0]
        raise RemoteError(o[1], " | ".join(f"rank {rr}: {oo[2]}" for rr, oo in errs))
    return [o[1] if o is not None else None for o in outcomes]
