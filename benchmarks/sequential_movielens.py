"""SASRec and HSTU against the BPR-MF recipe's model on MovieLens-100K, one leave-one-out split, full ranking.

    flock /tmp/lightning_rec_bench.lock .venv/bin/python benchmarks/sequential_movielens.py [--seeds 0 1 2]
    .venv/bin/python benchmarks/sequential_movielens.py --smoke     # a generated log, one epoch, one seed

Each model is built from its recipe (recipes/configs/sasrec_movielens.yaml, hstu_movielens.yaml,
matrix_factorization_movielens.yaml with split=loo) and trained for the recipe's epochs (or --epochs) per seed; the
test split is the last item of each user, ranked against every item with the user's earlier items excluded (the
same protocol for all three). Printed: test NDCG@10 per seed, mean and spread, and the median training epoch's
seconds on this machine's CPU (torch threads: --threads). The last line is one JSON object:
{"benchmark": "sequential_movielens", "results": [...], "ratios": {"hstu_over_sasrec", "sasrec_over_bpr_mf",
"hstu_over_bpr_mf"}, "figures": {"ndcg10_sasrec", "ndcg10_hstu", "ndcg10_bpr_mf", "epoch_s_cpu", ...}}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("LIGHTNING_REC_SHARED_DATA", REPO.parent / "shared" / "data"))
RECIPES = {"sasrec": "sasrec_movielens.yaml", "hstu": "hstu_movielens.yaml",
           "bpr_mf": "matrix_factorization_movielens.yaml"}


def _class(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class EpochTimer:
    """Seconds of each training epoch (the Trainer's hooks; validation not included)."""

    def __init__(self):
        import lightning.pytorch as L

        class _Timer(L.Callback):
            def on_train_epoch_start(cb, trainer, module):
                cb.start = time.perf_counter()

            def on_train_epoch_end(cb, trainer, module):
                self.seconds.append(time.perf_counter() - cb.start)

        self.seconds: list[float] = []
        self.callback = _Timer()


def run(name: str, seed: int, data_dir: Path, epochs: int | None, smoke: bool = False) -> dict:
    import lightning.pytorch as L

    cfg = yaml.safe_load((REPO / "recipes" / "configs" / RECIPES[name]).read_text())
    data_args = dict(cfg["data"]["init_args"], data_dir=str(data_dir), eval_test_in_fit=False)
    if name == "bpr_mf":
        data_args["split"] = "loo"  # the sequential models' split: the last item tests, the one before validates
    L.seed_everything(seed, verbose=False)
    dm = _class(cfg["data"]["class_path"])(**data_args)
    model = _class(cfg["model"]["class_path"])(**cfg["model"]["init_args"])
    timer = EpochTimer()
    max_epochs = 1 if smoke else (epochs if name != "bpr_mf" else None) or cfg["trainer"]["max_epochs"]
    trainer = L.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer.callback])
    start = time.perf_counter()
    trainer.fit(model, dm)
    (metrics,) = trainer.test(model, dm, verbose=False)
    return {"model": name, "seed": seed, "epochs": max_epochs, "test_ndcg@10": metrics["test_ndcg@10"],
            "test_hit_rate@10": metrics.get("test_hit_rate@10", metrics.get("test_recall@10")),
            "epoch_s": statistics.median(timer.seconds), "fit_s": time.perf_counter() - start}


def _generated_log(folder: Path) -> Path:
    """A small log for --smoke: 60 users walking 40 items in steps of 1 or 2, hourly."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for u in range(60):
        item, step = int(torch.randint(40, (1,), generator=g)), 1 + u % 2
        for j in range(12):
            rows.append(f"{u},{item},5,{3600 * j}\n")
            item = (item + step) % 40
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ratings.csv").write_text("user,item,rating,timestamp\n" + "".join(rows))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=SHARED / "movielens" / "ml-100k")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=None, help="SASRec's and HSTU's epochs (default: their recipes')")
    parser.add_argument("--models", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    data_dir, note = args.data_dir, "ml-100k"
    if args.smoke:
        data_dir, note = _generated_log(Path(tempfile.mkdtemp()) / "log"), "generated log (smoke)"
        args.seeds, args.epochs = args.seeds[:1], 1
    results = []
    for seed in args.seeds:  # models alternate within a seed
        for name in args.models:
            results.append(run(name, seed, data_dir, args.epochs, args.smoke))
            r = results[-1]
            print(f"{r['model']:<7} seed {seed}  NDCG@10 {r['test_ndcg@10']:.4f}  HR@10 {r['test_hit_rate@10']:.4f}  "
                  f"epoch {r['epoch_s']:.2f} s  fit {r['fit_s']:.1f} s ({r['epochs']} epochs)", flush=True)
    figures, summary = {"data": note, "seeds": args.seeds}, {}
    for name in args.models:
        vals = [r["test_ndcg@10"] for r in results if r["model"] == name]
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        summary[name] = statistics.mean(vals)
        figures[f"ndcg10_{name}"], figures[f"ndcg10_{name}_sd"] = summary[name], sd
        figures[f"epoch_s_{name}"] = statistics.median(r["epoch_s"] for r in results if r["model"] == name)
        print(f"{name:<7} test NDCG@10 mean {summary[name]:.4f} +- {sd:.4f} over seeds {args.seeds}")
    seq = [figures[f"epoch_s_{m}"] for m in ("sasrec", "hstu") if m in args.models]
    figures["epoch_s_cpu"] = max(seq) if seq else None
    ratios = {}
    for a, b in (("hstu", "sasrec"), ("sasrec", "bpr_mf"), ("hstu", "bpr_mf")):
        if a in summary and b in summary:
            ratios[f"{a}_over_{b}"] = summary[a] / max(summary[b], 1e-12)
    print(json.dumps({"benchmark": "sequential_movielens", "results": results, "ratios": ratios, "figures": figures}))


if __name__ == "__main__":
    main()
