"""What windowed training metrics cost a CPU DLRM step: 8 tasks x (binned AUC + NE + calibration) over the last 100
batches, logged every 50 steps, against the same step without them.

    python benchmarks/metrics.py [--steps 10] [--rounds 10] [--batch 2048]
    python benchmarks/metrics.py --smoke          # seconds: small tables, a few steps, one round
    python benchmarks/metrics.py --device cuda --profile   # GPU: host syncs of the metrics between logs

On CUDA the metrics' calls of every step run under torch's sync debug mode, which reports each operation that waits
for the device: figures.host_syncs_between_logs counts those of the steps that did not log (0: no `.item()` or
copy to the host between logs), figures.host_syncs_per_log those of the steps that did. --profile also records one
log interval with torch.profiler and counts its device-to-host copies (figures.profile_dtoh_copies, and its table).

Model: benchmarks/dlrm_distributed.py's (26 tables x 100,000 rows x dim 64, dense 512-256-64, over 512-512-256-1,
fused row-wise Adagrad), one process, 2 threads, batch 2048. The 8 tasks' logits are the model's logit plus a fixed
offset per task and their labels random (the metrics' cost does not depend on what they score). Rounds alternate
which mode runs first; each step is timed, and the ratio is the median step time with metrics over the median
without, over every timed step of every round. figures.metrics_part_over_step_without: the median time of the
metrics' own calls (update + log_to) over the median step without them, the same cost measured on its own.
Last line: {"benchmark": "metrics", "results": [...], "ratios": {"step_with_metrics_vs_without": ...},
"figures": {...}}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dlrm_distributed import build_model, make_batches  # noqa: E402

TASKS = 8


class _Sink:
    """Stands in for a LightningModule: log_dict keeps the values (each read on the host, as a logger does)."""

    def __init__(self) -> None:
        self.logs = 0

    def log_dict(self, values, **kwargs) -> None:
        self.logs += 1
        {k: float(v) for k, v in values.items()}  # noqa: B018  (the one host read of a log step)


@contextlib.contextmanager
def count_host_syncs(device: str):
    """Counts the operations inside that wait for a CUDA device (torch's sync debug mode, "warn"); none on a CPU."""
    counted = [0]
    if device != "cuda":
        yield counted
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counted
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counted[0] = sum("synchroniz" in str(w.message) for w in caught)


def profile_log_interval(step, steps: int) -> dict:
    """One log interval of steps with metrics under torch.profiler: its device-to-host copies and syncs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i, True)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    return {"profile_steps": steps, "profile_dtoh_copies": sum(n.startswith("Memcpy DtoH") for n in names),
            "profile_stream_syncs": sum(n in ("cudaStreamSynchronize", "cudaDeviceSynchronize") for n in names)}


def run(args) -> dict:
    from lightning_rec.metrics import WindowedTaskMetrics
    from lightning_rec.optim import combined_optimizer, dense_parameters

    torch.set_num_threads(2)
    device = args.device
    model = build_model(device, args.rows).to(device)
    opt = combined_optimizer(model, torch.optim.Adagrad(dense_parameters(model), lr=0.01))
    batches = [tuple(x.to(device) for x in b) for b in make_batches(args.batch, 4, seed=0, rows=args.rows)]
    g = torch.Generator().manual_seed(1)
    labels_BT = [(torch.rand(args.batch, TASKS, generator=g) < 0.2).float().to(device) for _ in batches]
    offsets_T = torch.linspace(-1, 1, TASKS, device=device)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    window = WindowedTaskMetrics([f"task{t}" for t in range(TASKS)], ["auc", "ne", "calibration"],
                                 window=args.window, log_every=args.log_every)
    sink = _Sink()
    metric_times: list[float] = []  # the metrics' own part of each step with them
    syncs = {"between_logs": 0, "at_logs": 0}

    def step(i: int, metrics: bool) -> float:
        start = time.perf_counter()
        dense, sparse, labels = batches[i % len(batches)]
        logits = model(dense, sparse)
        loss = loss_fn(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if metrics:
            before, logs = time.perf_counter(), sink.logs
            with count_host_syncs(device) as counted:
                window.update(logits.detach() + offsets_T, labels_BT[i % len(batches)])
                window.log_to(sink)
            metric_times.append(time.perf_counter() - before)
            syncs["between_logs" if sink.logs == logs else "at_logs"] += counted[0]
        if device == "cuda":
            torch.cuda.synchronize()  # the step's time, not its launch
        return time.perf_counter() - start

    for i in range(args.warmup):
        step(i, True)
    times = {"with": [], "without": []}
    rounds = []
    for r in range(args.rounds):
        order = ("without", "with") if r % 2 == 0 else ("with", "without")
        medians = {}
        for mode in order:
            t = [step(i, mode == "with") for i in range(args.steps)]
            times[mode] += t
            medians[mode] = statistics.median(t)
        rounds.append({"round": r, "order": list(order), **{f"median_{m}_s": round(v, 5) for m, v in medians.items()},
                       "ratio": round(medians["with"] / medians["without"], 4)})
        print(f"round {r}: without {medians['without'] * 1e3:.1f} ms, with {medians['with'] * 1e3:.1f} ms "
              f"({rounds[-1]['ratio']:.3f}x)", flush=True)
    profiled = profile_log_interval(step, args.log_every) if args.profile and device == "cuda" else {}
    return {"rounds": rounds, "times": times, "logs": sink.logs, "metric_times": metric_times[args.warmup:],
            "syncs": syncs, "profiled": profiled}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode per round")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--window", type=int, default=100, help="batches in the metrics' window")
    p.add_argument("--log-every", type=int, default=50, help="steps between metric logs")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--profile", action="store_true", help="cuda: profile one log interval (device-to-host copies)")
    p.add_argument("--smoke", action="store_true", help="seconds: small tables, a few steps, one round")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.rounds, args.warmup, args.batch, args.rows = 4, 1, 1, 256, 1000
        args.window, args.log_every = 3, 2
    return args


def main() -> None:
    args = parse_args()
    out = run(args)
    without, with_ = statistics.median(out["times"]["without"]), statistics.median(out["times"]["with"])
    ratio = with_ / without
    print(f"DLRM step, batch {args.batch}, {TASKS} tasks x windowed AUC + NE + calibration (window {args.window}, "
          f"logged every {args.log_every}): median {without * 1e3:.1f} ms without, {with_ * 1e3:.1f} ms with: "
          f"{ratio:.3f}x over {args.rounds} alternating rounds of {args.steps} steps; the metrics' own part: median "
          f"{statistics.median(out['metric_times']) * 1e3:.2f} ms a step")
    figures = {"step_ms_without": round(without * 1e3, 3), "step_ms_with": round(with_ * 1e3, 3),
               "metrics_part_ms": round(statistics.median(out["metric_times"]) * 1e3, 3),
               # the metrics' own time over the step without them: less exposed to a busy machine's swings
               "metrics_part_over_step_without": round(statistics.median(out["metric_times"]) / without, 4),
               "median_of_round_ratios": round(statistics.median(r["ratio"] for r in out["rounds"]), 4),
               "metric_logs": out["logs"], "batch": args.batch, "tasks": TASKS, "device": args.device}
    if args.device == "cuda":
        figures |= {"host_syncs_between_logs": out["syncs"]["between_logs"],
                    "host_syncs_per_log": round(out["syncs"]["at_logs"] / max(out["logs"], 1), 2), **out["profiled"]}
    print(json.dumps({"benchmark": "metrics", "results": out["rounds"],
                      "ratios": {"step_with_metrics_vs_without": round(ratio, 4)}, "figures": figures}))


if __name__ == "__main__":
    main()
