"""Exact AUC: ours (lightning_rec.metrics.AUC, a rank statistic) vs torchmetrics' exact BinaryAUROC, and the
binned AUC (BinnedAUC, 10,000 equal probability bins): time, state memory, and agreement.

    flock /tmp/lightning_rec_bench.lock .venv/bin/python benchmarks/auc.py [--sizes 1000000 4000000] [--rounds 3]
    .venv/bin/python benchmarks/auc.py --smoke      # seconds: 20,000 logits, one round

Each variant sees the same N logits (a CTR model's outputs, 25% positives) in batches of 65,536
(update), then computes; variants alternate over rounds and the table shows medians. torchmetrics'
BinaryAUROC gets probabilities (the sigmoid of the logits, as a user would pass them; given logits it
applies the same float32 sigmoid itself). State memory is the bytes the metric holds before compute.
The last line is one JSON object: {"benchmark": "auc", "results": [...], "ratios":
{"torchmetrics_over_ours_time_n<N>", "torchmetrics_over_ours_state_n<N>"}, "figures":
{"abs_diff_ours_vs_torchmetrics_n<N>", "abs_diff_binned_vs_exact_n<N>", "confident_logits_ours",
"confident_logits_torchmetrics"}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torchmetrics.classification import BinaryAUROC

from lightning_rec.metrics import AUC, BinnedAUC

BATCH = 65_536


def state_bytes(metric) -> int:
    total = 0
    for name in metric._defaults:
        value = getattr(metric, name)
        for t in value if isinstance(value, list) else [value]:
            total += t.numel() * t.element_size()
    return total


def run(variant: str, logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    if variant == "ours_exact":
        metric = AUC()
        for x, y in zip(logits.split(BATCH), labels.split(BATCH)):
            metric.update(x, y)
    elif variant == "torchmetrics_exact":
        metric = BinaryAUROC()
        for x, y in zip(logits.split(BATCH), labels.split(BATCH)):
            metric.update(torch.sigmoid(x), y.long())
    else:
        metric = BinnedAUC(num_thresholds=10_000)
        for x, y in zip(logits.split(BATCH), labels.split(BATCH)):
            metric.update(x, y)
    held = state_bytes(metric)
    value = float(metric.compute())
    return time.perf_counter() - t0, value, held


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 4_000_000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="seconds: 20,000 logits, one round")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.rounds = [20_000], 1
    variants = ("ours_exact", "torchmetrics_exact", "binned_10k")
    results, ratios, figures = [], {}, {}
    print(f"{'N':>10} {'variant':<20}{'median s':>10}{'state MB':>10}{'AUC':>12}")
    for n in args.sizes:
        g = torch.Generator().manual_seed(n)
        labels = (torch.rand(n, generator=g) < 0.25).float()
        logits = torch.randn(n, generator=g) * 1.5 + labels  # a mediocre CTR model: AUC ~0.68
        times = {v: [] for v in variants}
        values, held = {}, {}
        for _ in range(args.rounds):
            for v in variants:
                seconds, values[v], held[v] = run(v, logits, labels)
                times[v].append(seconds)
        for v in variants:
            med = statistics.median(times[v])
            print(f"{n:>10} {v:<20}{med:>10.3f}{held[v] / 2**20:>10.1f}{values[v]:>12.6f}")
            results.append({"n": n, "variant": v, "median_s": med, "times_s": times[v], "state_bytes": held[v],
                            "auc": values[v]})
        med_tm, med_ours = statistics.median(times["torchmetrics_exact"]), statistics.median(times["ours_exact"])
        ratios[f"torchmetrics_over_ours_time_n{n}"] = med_tm / med_ours
        ratios[f"torchmetrics_over_ours_state_n{n}"] = held["torchmetrics_exact"] / held["ours_exact"]
        figures[f"abs_diff_ours_vs_torchmetrics_n{n}"] = abs(values["ours_exact"] - values["torchmetrics_exact"])
        figures[f"abs_diff_binned_vs_exact_n{n}"] = abs(values["binned_10k"] - values["ours_exact"])
    # confident logits: a float32 sigmoid rounds them to 1.0, torchmetrics sees ties
    logits = torch.tensor([18.0, 19.0, 20.0, 21.0, 22.0, 23.0])
    labels = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    ours = AUC()
    ours.update(logits, labels)
    figures["confident_logits_ours"] = float(ours.compute())
    figures["confident_logits_torchmetrics"] = float(BinaryAUROC()(logits, labels.long()))
    print(f"logits 18..23 (3 negatives below 3 positives): ours {figures['confident_logits_ours']:.3f}, "
          f"torchmetrics {figures['confident_logits_torchmetrics']:.3f} (true AUC 1.0)")
    print(json.dumps({"benchmark": "auc", "results": results, "ratios": ratios, "figures": figures}))


if __name__ == "__main__":
    main()
