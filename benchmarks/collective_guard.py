"""What the collective guard costs per call: the CPU time it adds to a collective, without peers.

    python benchmarks/collective_guard.py [--calls 20000] [--rounds 7]
    python benchmarks/collective_guard.py --smoke      # seconds: 200 calls, 2 rounds

One process, a 1-rank gloo group, so a collective completes at once and what is timed is the
code around it: `input_dist.all_to_all` (the embedding path's entry point) with the group's
CollectiveGuard on and off (lightning_rec/collective_guard.py), through gloo and through the
shared-memory transport, alternating (and swapping which goes first) over rounds; the figure is
the median. With peers, the same code runs around a wait that costs 0.1-5 ms
(benchmarks/collectives.py), and a DLRM step runs about six such calls.
Last line: {"benchmark": "collective_guard", "results": [...], "ratios": {...}, "figures": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="seconds: 200 calls, 2 rounds")
    args = parser.parse_args()
    if args.smoke:
        args.calls, args.rounds = 200, 2
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60))
    from lightning_rec.collective_guard import CollectiveGuard
    from lightning_rec.input_dist import all_to_all
    from lightning_rec.shm_transport import SharedMemoryGroup

    pg = dist.new_group([0], backend="gloo")
    shm = SharedMemoryGroup.create(pg, 60.0)
    guard = CollectiveGuard(pg, "bench", 60.0, "the benchmark's timeout")
    x = torch.randn(64)
    out = torch.empty_like(x)
    paths = {"gloo": pg, "shm": shm}

    def per_call_us(comm) -> float:
        start = time.perf_counter()
        for _ in range(args.calls):
            all_to_all(comm, out, x, None, None, "bench a2a", 60.0)
        return (time.perf_counter() - start) / args.calls * 1e6

    times = {f"{p}_{m}": [] for p in paths for m in ("plain", "guard")}
    for i in range(args.rounds):
        for path, comm in paths.items():
            for mode in ("plain", "guard") if i % 2 else ("guard", "plain"):
                guard.enabled = mode == "guard"
                shm.guard = guard if mode == "guard" else None
                times[f"{path}_{mode}"].append(per_call_us(comm))
    med = {k: round(statistics.median(v), 2) for k, v in times.items()}
    print(f"1 rank, 64-float all-to-all through input_dist.all_to_all, median of {args.rounds} alternating rounds of "
          f"{args.calls} calls (us per call)")
    print(f"{'path':<6}{'plain':>9}{'guarded':>10}{'added':>8}")
    ratios, figures, rows = {}, {}, []
    for p in paths:
        plain, guarded = med[f"{p}_plain"], med[f"{p}_guard"]
        print(f"{p:<6}{plain:>9.2f}{guarded:>10.2f}{guarded - plain:>8.2f}")
        ratios[f"{p}_guard_over_plain"] = round(guarded / plain, 3)
        figures[f"{p}_guard_added_us_per_call"] = round(guarded - plain, 2)
        rows.append(dict(path=p, plain_us=plain, guard_us=guarded))
    shm.close()
    dist.destroy_process_group()
    print(json.dumps({"benchmark": "collective_guard", "results": rows, "ratios": ratios, "figures": figures}))


if __name__ == "__main__":
    main()
