"""The fused dot interaction (csrc/interaction_cpu.cpp) against the composed torch ops it replaces, CPU.

    flock /tmp/lightning_rec_bench.lock .venv/bin/python benchmarks/interaction.py [--rounds 15] [--threads 2]
    .venv/bin/python benchmarks/interaction.py --smoke      # tiny sizes, two rounds: the same code path

Each case times forward + backward of one variant (a fixed random output gradient), the two variants alternating
over --rounds rounds in this process (which goes first swaps each round; one round of warm-up); the figure is the
median of the per-round ratios composed time / fused time, so > 1 means the fused kernel is faster.
  dot:   DLRM's dot interaction, B 2048, F 26, D 64 and 128: cat + bmm + triangle gather + cat (InteractionArch's
         composed ops) against one kernel computing only the (F+1)F/2 pairs.
The last line is one JSON object: {"benchmark": "interaction", "results": [...], "ratios":
{"fused_vs_composed_dot", and one per case}, "figures": {per-case milliseconds}}; the headline ratio is the least
favourable case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lightning_rec.models.dlrm import InteractionArch
from lightning_rec.models.fused_interaction import fused_interaction_available


def dot_case(B: int, F_: int, D: int):
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(B, D, generator=g, requires_grad=True)
    sparse = torch.randn(B, F_, D, generator=g, requires_grad=True)
    arch = InteractionArch(F_)
    grad = torch.randn(B, arch.output_dim(D), generator=g)

    def step(fused: bool) -> None:
        arch.fused = fused
        arch(dense, sparse).backward(grad)
        dense.grad = sparse.grad = None

    return step


def measure(step, rounds: int) -> tuple[float, float, float]:
    """(median composed / fused per round, median fused ms, median composed ms)."""
    times: dict[bool, list[float]] = {True: [], False: []}
    ratios = []
    for r in range(rounds + 1):
        for fused in ((True, False) if r % 2 else (False, True)):
            t0 = time.perf_counter()
            step(fused)
            times[fused].append(time.perf_counter() - t0)
        if r:  # round 0 warms up
            ratios.append(times[False][-1] / times[True][-1])
    return (statistics.median(ratios), 1e3 * statistics.median(times[True][1:]),
            1e3 * statistics.median(times[False][1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if not fused_interaction_available():
        raise SystemExit("the fused interaction kernels are not built: pip install --no-build-isolation -e .")
    torch.set_num_threads(args.threads)
    B, F_, dims = args.batch, 26, (64, 128)
    if args.smoke:
        B, F_, dims, args.rounds = 8, 3, (4, 8), 2
    cases = [(f"dot_d{D}", dot_case(B, F_, D)) for D in dims]
    print(f"forward + backward, {args.threads} threads, B {B}, F {F_}, median of {args.rounds} alternating rounds")
    print(f"{'case':<18}{'fused ms':>10}{'composed ms':>13}{'composed/fused':>16}")
    results, ratios, figures = [], {}, {}
    for name, step in cases:
        ratio, fused_ms, composed_ms = measure(step, args.rounds)
        print(f"{name:<18}{fused_ms:>10.2f}{composed_ms:>13.2f}{ratio:>16.3f}", flush=True)
        results.append({"case": name, "fused_ms": fused_ms, "composed_ms": composed_ms, "composed_over_fused": ratio})
        ratios[f"fused_vs_composed_{name}"] = ratio
        figures[f"{name}_fused_ms"], figures[f"{name}_composed_ms"] = fused_ms, composed_ms
    ratios["fused_vs_composed_dot"] = min(r["composed_over_fused"] for r in results)
    figures.update(batch=B, features=F_, threads=args.threads, rounds=args.rounds)
    print(json.dumps({"benchmark": "interaction", "results": results, "ratios": ratios, "figures": figures}))


if __name__ == "__main__":
    main()
