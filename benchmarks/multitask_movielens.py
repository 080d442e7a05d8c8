"""Multi-task vs single-task on MovieLens-100K: each task's test AUC from MMoE, PLE and a shared bottom, beside a
single-task model trained on that task alone (the same split, the same features and sizes), over seeds.

    flock /tmp/lightning_rec_bench.lock .venv/bin/python benchmarks/multitask_movielens.py [--data-dir ...] \
        [--seeds 3] [--epochs 2]
    .venv/bin/python benchmarks/multitask_movielens.py --smoke     # seconds: a small synthetic log, 1 seed, 1 epoch

Tasks: "liked" (rating >= 4) and "loved" (rating == 5), from MovieLensDataModule(label_columns=...), RO 8:1:1 split
(data seed 0 for every run; --seeds vary the model's initialisation and the shuffle). Features: user id, age,
gender, occupation, zip region, item id, year, genres; MultiTaskModule with embedding_dim 16, experts [64, 32],
towers [32]. The data is $LIGHTNING_REC_SHARED_DATA/movielens/ml-100k (or --data-dir). Target: MMoE's AUC >= the
single-task AUC - 0.002 on every task (mean over seeds). The last line is one JSON object: {"benchmark":
"multitask_movielens", "results": [...], "ratios": {}, "figures": {"auc_mmoe_minus_single_min" (the worst task),
"auc": {task: {model: mean}}, "auc_sd": {task: {model: sd}}, ...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TASKS = {"liked": "rating >= 4", "loved": "rating == 5"}
MODELS = ("mmoe", "ple", "shared_bottom", "single")


def default_data() -> Path:
    root = os.environ.get("LIGHTNING_REC_SHARED_DATA")
    return (Path(root) if root else REPO.parent / "shared" / "data") / "movielens" / "ml-100k"


def synthetic_log(folder: Path, users: int = 60, items: int = 80, per_user: int = 30, seed: int = 0) -> Path:
    """A ratings.csv whose ratings follow user and item biases (a learnable signal)."""
    rng = np.random.default_rng(seed)
    bias_u, bias_i = rng.normal(size=users), rng.normal(size=items)
    rows = ["user_id,item_id,rating,timestamp"]
    for u in range(users):
        for i in rng.choice(items, per_user, replace=False):
            score = bias_u[u] + bias_i[i] + rng.normal(scale=0.5)
            rows.append(f"{u},{i},{int(np.clip(np.round(3 + score), 1, 5))},{u * 1000 + int(i)}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ratings.csv").write_text("\n".join(rows) + "\n")
    return folder


def run(data_dir: Path, mix: str, tasks: dict[str, str], seed: int, epochs: int) -> dict[str, float]:
    import lightning.pytorch as L

    from lightning_rec.data import MovieLensDataModule
    from lightning_rec.models import MultiTaskModule

    L.seed_everything(seed, verbose=False)
    dm = MovieLensDataModule(str(data_dir), label_columns=tasks, batch_size=512, eval_batch_size=8192, seed=0)
    dm.setup("fit")
    sizes = {**dm.user_num_embeddings, **dm.item_num_embeddings}
    model = MultiTaskModule(task_names=list(tasks), mix="mmoe" if mix == "single" else mix,
                            num_embeddings_per_feature=sizes, embedding_dim=16, expert_layer_sizes=[64, 32],
                            tower_layer_sizes=[32], num_experts=4, sparse_optimizer="adam", sparse_lr=0.003,
                            dense_lr=0.003)
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, dm)
        out = trainer.test(model, dm, verbose=False)[0]
    return {task: out[f"test/{task}/auc"] for task in tasks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    tmp = tempfile.TemporaryDirectory()
    if args.smoke:
        data_dir, seeds, epochs, source = synthetic_log(Path(tmp.name) / "log"), 1, 1, "synthetic (smoke)"
    else:
        data_dir, seeds, epochs = args.data_dir or default_data(), args.seeds, args.epochs
        source = data_dir.name
    auc: dict[str, dict[str, list[float]]] = {t: {m: [] for m in MODELS} for t in TASKS}
    results, start = [], time.perf_counter()
    for seed in range(seeds):  # alternate models within each seed
        for mix in MODELS:
            t0 = time.perf_counter()
            runs = [run(data_dir, mix, {t: TASKS[t]}, seed, epochs) for t in TASKS] if mix == "single" else \
                [run(data_dir, mix, TASKS, seed, epochs)]
            for values in runs:
                for task, value in values.items():
                    auc[task][mix].append(value)
            results.append({"seed": seed, "model": mix, "auc": {t: auc[t][mix][-1] for t in TASKS},
                            "seconds": time.perf_counter() - t0})
            print(f"seed {seed} {mix:<14}" + "".join(f"{t} {auc[t][mix][-1]:.4f}  " for t in TASKS), flush=True)
    mean = {t: {m: statistics.fmean(v) for m, v in per.items()} for t, per in auc.items()}
    sd = {t: {m: statistics.stdev(v) if len(v) > 1 else 0.0 for m, v in per.items()} for t, per in auc.items()}
    print(f"\n{'task':<8}" + "".join(f"{m:>22}" for m in MODELS))
    for t in TASKS:
        print(f"{t:<8}" + "".join(f"{mean[t][m]:>14.4f} +- {sd[t][m]:.4f}" for m in MODELS))
    gap = {t: mean[t]["mmoe"] - mean[t]["single"] for t in TASKS}
    print("MMoE - single per task: " + ", ".join(f"{t} {g:+.4f}" for t, g in gap.items()) + " (target >= -0.002)")
    print(json.dumps({
        "benchmark": "multitask_movielens",
        "results": results,
        "ratios": {},
        "figures": {"auc_mmoe_minus_single_min": min(gap.values()), "auc_mmoe_minus_single": gap, "auc": mean,
                    "auc_sd": sd, "seeds": seeds, "epochs": epochs, "data": source,
                    "seconds": time.perf_counter() - start},
    }))


if __name__ == "__main__":
    main()
