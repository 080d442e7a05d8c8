"""CPU collectives between ranks of one host: the shared-memory transport against gloo, same run.

    python benchmarks/collectives.py [--ranks 2] [--iters 30]
    python benchmarks/collectives.py --smoke      # seconds: 2 calls per size

Per size: all_to_all_single (equal splits; `MB` is what each rank sends in all) and all-reduce
(sum) through `SharedMemoryGroup` (lightning_rec/shm_transport.py) and through gloo, both in the
same processes, alternating, 1 thread per rank. Sizes are those of the DLRM benchmark's traffic
(benchmarks/dlrm_distributed.py): ids (~0.4 MB), pooled embeddings (6.8 MB), dense gradients
(~3 MB), plus a tiny exchange (latency). Results must match gloo's (checked before timing).
Then the collective guard's cost (lightning_rec/collective_guard.py): a tiny all-to-all through
input_dist.all_to_all with the guard on and off, over gloo and over shared memory, alternating.
Last line: {"benchmark": "collectives", "results": [...], "ratios": {"a2a_<size>_gloo_over_shm",
"all_reduce_<size>_gloo_over_shm", "a2a_tiny_<gloo|shm>_guard_over_plain"}, "figures": {"<op>_<size>_<path>_ms",
"ranks", "iters"}}.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_MB = {"tiny": 64 * 4 / 2**20, "ids": 0.4, "dense_grads": 3.0, "pooled": 6.8}


def _time(fn, iters: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def _measure(group, x: torch.Tensor, iters: int, name: str) -> tuple[dict, dict]:
    """Median ms per call of (all-to-all, all-reduce) through gloo and shared memory."""
    out_shm, out_gloo = torch.empty_like(x), torch.empty_like(x)
    group.all_to_all_single(out_shm, x)
    dist.all_to_all_single(out_gloo, x)
    assert torch.equal(out_shm, out_gloo), name
    r_shm, r_gloo = x.clone(), x.clone()
    group.all_reduce_sum_(r_shm)
    dist.all_reduce(r_gloo)
    torch.testing.assert_close(r_shm, r_gloo)
    a2a = {"shm": [], "gloo": []}
    ar = {"shm": [], "gloo": []}
    for _ in range(3):  # alternate, so both see the same machine
        a2a["gloo"].append(_time(lambda: dist.all_to_all_single(out_gloo, x), iters))
        a2a["shm"].append(_time(lambda: group.all_to_all_single(out_shm, x), iters))
        ar["gloo"].append(_time(lambda: dist.all_reduce(r_gloo), iters))
        ar["shm"].append(_time(lambda: group.all_reduce_sum_(r_shm), iters))
    median = {k: round(sorted(v)[1], 3) for k, v in a2a.items()}, {k: round(sorted(v)[1], 3) for k, v in ar.items()}
    return median


def _measure_guard(group, iters: int) -> dict:
    """ms per tiny all-to-all (latency: where a per-call cost would show) with the collective guard
    (lightning_rec/collective_guard.py) on and off, through gloo and through shared memory."""
    from lightning_rec.collective_guard import CollectiveGuard
    from lightning_rec.input_dist import all_to_all

    pg = group.pg
    guard = CollectiveGuard(pg, "bench", 60.0, "the benchmark's timeout")
    x = torch.randn(64 * dist.get_world_size(pg))
    out = torch.empty_like(x)
    calls = {
        "gloo": lambda: all_to_all(pg, out, x, None, None, "bench a2a", 60.0),
        "shm": lambda: all_to_all(group, out, x, None, None, "bench a2a", 60.0),
    }
    times: dict[str, list[float]] = {f"{path}_{mode}": [] for path in calls for mode in ("guard", "plain")}
    for i in range(5):  # alternate (and swap which goes first), so both see the same machine
        for path, call in calls.items():
            for mode in ("plain", "guard") if i % 2 else ("guard", "plain"):
                guard.enabled = mode == "guard"
                group.guard = guard if mode == "guard" else None
                times[f"{path}_{mode}"].append(_time(call, iters))
    group.guard = None
    return {k: round(sorted(v)[2], 4) for k, v in times.items()}


def rank_main(rank: int, world: int, port: int, iters: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from lightning_rec.shm_transport import SharedMemoryGroup

    group = SharedMemoryGroup.create(dist.group.WORLD, timeout_s=60)
    if group is None:
        raise SystemExit("the ranks cannot share /dev/shm here")
    rows = []
    for name, mb in SIZES_MB.items():
        n = max(world, int(mb * 2**20 / 4) // world * world)
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        a2a, ar = _measure(group, x, iters, name)
        rows.append(dict(size=name, mb=round(n * 4 / 2**20, 2), a2a_ms=a2a, all_reduce_ms=ar))
    guard_ms = _measure_guard(group, 10 * iters)
    group.close()
    if rank == 0:
        queue.put((rows, guard_ms))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="seconds: 2 calls per size")
    args = parser.parse_args()
    if args.smoke:
        args.iters = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.smoke:  # fork: the ranks start with torch and lightning_rec imported once (spawn: seconds a rank)
        import lightning_rec.collective_guard  # noqa: F401
        import lightning_rec.input_dist  # noqa: F401
        import lightning_rec.shm_transport  # noqa: F401
    ctx = mp.get_context("fork" if args.smoke else "spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, args.iters, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows, guard_ms = queue.get(timeout=600)
    for p in procs:
        p.join()
    print(f"{args.ranks} ranks, 1 thread each; median of 3 alternating rounds of {args.iters} calls (ms per call)")
    print(f"{'traffic':<13}{'MB':>7}{'a2a gloo':>11}{'a2a shm':>10}{'x':>7}"
          f"{'reduce gloo':>13}{'reduce shm':>12}{'x':>7}")
    ratios, figures = {}, {"ranks": args.ranks, "iters": args.iters}
    for r in rows:
        a, b = r["a2a_ms"], r["all_reduce_ms"]
        ratios[f"a2a_{r['size']}_gloo_over_shm"] = round(a["gloo"] / a["shm"], 2)
        ratios[f"all_reduce_{r['size']}_gloo_over_shm"] = round(b["gloo"] / b["shm"], 2)
        figures |= {f"{op}_{r['size']}_{path}_ms": ms[path] for op, ms in (("a2a", a), ("all_reduce", b))
                    for path in ("gloo", "shm")}
        print(f"{r['size']:<13}{r['mb']:>7.2f}{a['gloo']:>11.3f}{a['shm']:>10.3f}{a['gloo'] / a['shm']:>7.2f}"
              f"{b['gloo']:>13.3f}{b['shm']:>12.3f}{b['gloo'] / b['shm']:>7.2f}")
    print(f"\ncollective guard, tiny all-to-all through input_dist.all_to_all (median of 5 alternating rounds of "
          f"{10 * args.iters} calls, ms per call):")
    for path in ("gloo", "shm"):
        plain, guarded = guard_ms[f"{path}_plain"], guard_ms[f"{path}_guard"]
        ratios[f"a2a_tiny_{path}_guard_over_plain"] = round(guarded / plain, 3)
        print(f"{path:<6} plain {plain:.4f}  guarded {guarded:.4f}  x{guarded / plain:.3f}")
    rows.append(dict(size="tiny", guard_ms=guard_ms))
    print(json.dumps({"benchmark": "collectives", "results": rows, "ratios": ratios, "figures": figures}))


if __name__ == "__main__":
    main()
