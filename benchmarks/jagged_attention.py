"""Jagged causal attention (length buckets) against padding the batch to its longest, on lengths skewed 10x.

    flock /tmp/lightning_rec_bench.lock .venv/bin/python benchmarks/jagged_attention.py [--rounds 5]
    .venv/bin/python benchmarks/jagged_attention.py --smoke       # small batch, one round

A batch of --batch sequences: 90% of length --short, 10% of length 10 x --short, H heads of d dims, float32.
Both variants run forward and backward of the same attention (`jagged_attention(..., bucketed=True/False)`):
SASRec's softmax attention (torch's SDPA per bucket) and HSTU's pointwise attention (SiLU of scores + relative
position and time biases, an L x L matrix per sequence and head). Time: medians of alternating rounds in this
process. Peak memory: each variant once in its own process, forked from a fresh one that has only imported the code
(one import for the four), its resident memory sampled every millisecond, above the memory held before the call
(CPU); on CUDA, torch.cuda.max_memory_allocated above the start.
The last line is one JSON object: {"benchmark": "jagged_attention", "results": [...], "ratios":
{"peak_memory_vs_padded", "time_vs_padded", "softmax_peak_memory_vs_padded", "softmax_time_vs_padded"},
"figures": {...}}; the unprefixed ratios are HSTU's (the attention whose memory is the L x L matrices).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from ranking_eval import PeakRSS

REPO = Path(__file__).resolve().parents[1]


def _lengths(batch: int, short: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    lengths = torch.full((batch,), short)
    lengths[torch.randperm(batch, generator=g)[: max(1, batch // 10)]] = 10 * short
    return lengths


def _case(kind: str, batch: int, short: int, heads: int, dim: int, device: str):
    """(a function running forward + backward of one variant, given bucketed)."""
    from lightning_rec.models.jagged_attention import causal_softmax_attend, jagged_attention
    from lightning_rec.models.sequential import HSTUAttend

    lengths = _lengths(batch, short).to(device)
    T, N = int(lengths.sum()), 10 * short
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(T, heads, dim, device=device, generator=g, requires_grad=True) for _ in range(3))
    times = torch.cumsum(torch.randint(0, 3600, (T,), device=device, generator=g), 0)
    if kind == "softmax":
        attend, extras = causal_softmax_attend, ()
    else:
        pos_w = torch.randn(2 * N - 1, device=device, requires_grad=True)
        ts_w = torch.randn(129, device=device, requires_grad=True)
        attend, extras = HSTUAttend(pos_w, ts_w, N, 128), (times, torch.repeat_interleave(lengths, lengths))

    def step(bucketed: bool) -> None:
        out = jagged_attention(q, k, v, lengths, attend, extras, bucketed=bucketed)
        out.sum().backward()
        q.grad = k.grad = v.grad = None

    return step


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _forked_peak(case: tuple, bucketed: bool, threads: int) -> float:
    """One variant's peak resident memory above its start, in a child forked from this process: the child's heap is
    this process's, which has only imported the code, as a fresh process's would be."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: warm up, then the measured call; its figure goes back through the pipe
        status = 1  # an error ends the child here, never in its parent's loop
        try:
            os.close(read)
            torch.set_num_threads(threads)
            step = _case(*case, "cpu")
            step(bucketed)
            with PeakRSS() as m:
                step(bucketed)
            os.write(write, f"{m.peak - m.start}".encode())
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read()
    _, status = os.waitpid(pid, 0)
    if status != 0 or not said:
        raise RuntimeError(f"the peak memory probe of {case} (bucketed={bucketed}) failed: wait status {status}")
    return float(said)


def probe(cases: list, threads: int) -> None:
    """Run in a fresh process (imports only): prints each (kind, batch, short, heads, dim, bucketed)'s peak MB, one
    per line, each in its own forked child (a fresh process per variant cost an import of torch and Lightning)."""
    for *case, bucketed in cases:
        print(_forked_peak(tuple(case), bucketed, threads), flush=True)


def peak_mb(cases: list, args) -> list[float]:
    """Each (kind, bucketed)'s peak memory above its start: on CPU each in its own process (see `probe`), on CUDA
    from the allocator."""
    if args.device == "cuda":
        out = []
        for kind, bucketed in cases:
            step = _case(kind, args.batch, args.short, args.heads, args.dim, "cuda")
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            step(bucketed)
            torch.cuda.synchronize()
            out.append((torch.cuda.max_memory_allocated() - start) / 2**20)
        return out
    specs = [(kind, args.batch, args.short, args.heads, args.dim, bucketed) for kind, bucketed in cases]
    here = str(Path(__file__).parent)
    code = (f"import sys; sys.path[:0] = [{str(REPO)!r}, {here!r}]; import jagged_attention as J; "
            "import lightning_rec.models.jagged_attention, lightning_rec.models.sequential; "
            f"J.probe({specs!r}, {args.threads})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [float(line) for line in out.stdout.strip().splitlines()[-len(cases):]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--short", type=int, default=30, help="the common length; 10% of sequences are 10x it")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.short, args.rounds = 20, 8, 1
    torch.set_num_threads(args.threads)
    lengths = _lengths(args.batch, args.short)
    print(f"{args.batch} sequences on {args.device}: {int((lengths == args.short).sum())} of length {args.short}, "
          f"{int((lengths > args.short).sum())} of {10 * args.short}; sum L^2 = {int((lengths ** 2).sum())}, "
          f"B x Lmax^2 = {args.batch * int(lengths.max()) ** 2}")
    results, ratios = [], {}
    variants = [(kind, bucketed) for kind in ("hstu", "softmax") for bucketed in (True, False)]
    peaks = dict(zip(variants, peak_mb(variants, args)))
    for kind in ("hstu", "softmax"):
        step = _case(kind, args.batch, args.short, args.heads, args.dim, args.device)
        times = {True: [], False: []}
        for _ in range(args.rounds + 1):  # the first round warms up, alternating the variants
            for bucketed in (True, False):
                _sync(args.device)
                t0 = time.perf_counter()
                step(bucketed)
                _sync(args.device)
                times[bucketed].append(time.perf_counter() - t0)
        row = {"attention": kind}
        for bucketed, name in ((True, "jagged"), (False, "padded")):
            row[f"{name}_ms"] = 1e3 * statistics.median(times[bucketed][1:] or times[bucketed])
            row[f"{name}_peak_mb"] = peaks[kind, bucketed]
        results.append(row)
        prefix = "" if kind == "hstu" else "softmax_"
        ratios[f"{prefix}time_vs_padded"] = row["jagged_ms"] / row["padded_ms"]
        ratios[f"{prefix}peak_memory_vs_padded"] = row["jagged_peak_mb"] / max(row["padded_peak_mb"], 1e-6)
        print(f"{kind:<8} jagged {row['jagged_ms']:8.1f} ms {row['jagged_peak_mb']:8.1f} MB   padded "
              f"{row['padded_ms']:8.1f} ms {row['padded_peak_mb']:8.1f} MB   "
              f"time x{ratios[prefix + 'time_vs_padded']:.2f}  memory x{ratios[prefix + 'peak_memory_vs_padded']:.2f}",
              flush=True)
    figures = {"device": args.device, "batch": args.batch, "short": args.short, "long": 10 * args.short,
               "sum_l2_over_b_lmax2": float((lengths ** 2).sum()) / (args.batch * int(lengths.max()) ** 2)}
    print(json.dumps({"benchmark": "jagged_attention", "results": results, "ratios": ratios, "figures": figures}))


if __name__ == "__main__":
    main()
