"""Resume at another world size, mid-epoch: the synthetic DLRM saved at 2 ranks at step 50, resumed in 1 process,
against the same checkpoint resumed at 2 ranks: validation NE at step 63.

    python benchmarks/elastic_resume.py            # the synthetic recipe's DLRM, 131,072 rows, batch 512 per rank
    python benchmarks/elastic_resume.py --smoke    # seconds: 4,096 rows, batch 64, saved at step 10, compared at 13

Before the resumed loader dealt the rest of the epoch over the new ranks, the 1-process run started the epoch's
shuffle over while Lightning counted 50 of 128 batches done: it replayed rows already trained and left 14,336
unread, and reached NE 1.00 against 0.787 resumed at 2 ranks. Each world size is one fresh `python` (Lightning
starts the second rank itself) whose fits run one after another, each a new Trainer, module and data from seed 0:
at 2 ranks the fit that writes the checkpoint, then the resume at 2; then the resumes at 1 in one process.
At the same step, 1 rank has trained on half the rows 2 ranks have (batch 512 per rank): the run resumed at 1 rank
is also taken on to as many rows (step 50 + 2 x 13 = 76), `ne_2_to_1_same_rows`, and resumed with
`accumulate_grad_batches=2`, which keeps the global batch of 2 ranks, to step 63, `ne_2_to_1_accumulate2`.
Last line: {"benchmark": "elastic_resume", "results": [...], "ratios": {}, "figures": {"ne_2_to_1", "ne_2_to_2",
"abs_ne_diff", "ne_2_to_1_same_rows", "abs_ne_diff_same_rows", "ne_2_to_1_accumulate2", "abs_ne_diff_accumulate2",
"saved_step", "compared_step"}}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FULL = {"rows": 131_072, "val_rows": 16_384, "batch": 512, "save_at": 50, "compare_at": 63, "tables": 1000}
SMOKE = {"rows": 4096, "val_rows": 1024, "batch": 64, "save_at": 10, "compare_at": 13, "tables": 100}


def phase(args: argparse.Namespace) -> None:
    """The fits of one world size, one after another (this process is one of Lightning's ranks): each to its
    `max_steps`, from its `ckpt` if given; rank 0 writes each fit's validation metrics at its end to its `out`."""
    for run in json.loads(args.runs):
        fit(args.smoke, args.world, **run)


def fit(smoke: bool, world: int, root: str, max_steps: int, ckpt: str | None, out: str, accumulate: int) -> None:
    """One fit of `phase`'s: a new Trainer, module and data, from seed 0."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_rec import RecStrategy
    from lightning_rec.data import SyntheticCriteoDataModule
    from lightning_rec.models import DLRMModule

    size = SMOKE if smoke else FULL
    L.seed_everything(0)
    callbacks = [ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=size["save_at"],
                                 save_last=True)]
    trainer = L.Trainer(strategy=RecStrategy(), accelerator="cpu", devices=world, max_steps=max_steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                        num_sanity_val_steps=0, val_check_interval=1.0, accumulate_grad_batches=accumulate)
    module = DLRMModule(num_embeddings_per_feature=size["tables"], embedding_dim=16, dense_arch_layer_sizes=[64, 16],
                        over_arch_layer_sizes=[64, 32, 1], sparse_optimizer="rowwise_adagrad", sparse_lr=0.05,
                        dense_optimizer="adagrad", dense_lr=0.02)
    data = SyntheticCriteoDataModule(num_train_samples=size["rows"], num_val_samples=size["val_rows"],
                                     batch_size=size["batch"], num_embeddings_per_feature=size["tables"])
    trainer.fit(module, data, ckpt_path=ckpt)
    metrics = trainer.validate(module, datamodule=data, verbose=False)[0]
    if trainer.is_global_zero:
        Path(out).write_text(json.dumps({"step": trainer.global_step, **{k: float(v) for k, v in metrics.items()}}))


def run_phase(smoke: bool, world: int, runs: list[dict]) -> list[dict]:
    """`runs` (each root, max_steps, ckpt, out, accumulate) at `world` ranks in one fresh process: their metrics."""
    command = [sys.executable, __file__, "--phase", "--world", str(world), "--runs", json.dumps(runs),
               *(["--smoke"] if smoke else [])]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(Path(run["out"]).read_text()) for run in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--phase", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--runs", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        return phase(args)
    size = SMOKE if args.smoke else FULL
    results = []
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        ckpt = os.path.join(root, "ckpt", "last.ckpt")
        # 1 rank at the same step has read half the rows of 2 ranks; at twice the steps after the save, as many
        same_rows = size["save_at"] + 2 * (size["compare_at"] - size["save_at"])
        # accumulate 2 at 1 rank keeps the global batch of 2 ranks: a step reads the rows a 2-rank step reads
        resumes = [(2, size["compare_at"], 1), (1, size["compare_at"], 1), (1, same_rows, 1),
                   (1, size["compare_at"], 2)]
        runs = {w: [] for w in (2, 1)}
        runs[2].append({"root": root, "max_steps": size["save_at"], "ckpt": None,
                        "out": os.path.join(root, "saved.json"), "accumulate": 1})
        for world, steps, k in resumes:
            name = f"resumed{world}_{steps}_k{k}"
            runs[world].append({"root": os.path.join(root, name), "max_steps": steps, "ckpt": ckpt,
                                "out": os.path.join(root, f"{name}.json"), "accumulate": k})
        saved, *got = run_phase(args.smoke, 2, runs[2]) + run_phase(args.smoke, 1, runs[1])
        for (world, _, k), one in zip(resumes, got):
            results.append({"resumed_at_ranks": world, "step": one["step"], "accumulate_grad_batches": k,
                            "val_ne": one["val_ne"], "val_auc": one["val_auc"]})
            print(f"saved at 2 ranks, step {size['save_at']} (val NE {saved['val_ne']:.4f}); resumed at {world} "
                  f"rank(s), accumulate_grad_batches={k}: step {one['step']} val NE {one['val_ne']:.4f} "
                  f"AUC {one['val_auc']:.4f}", flush=True)
        seconds = time.perf_counter() - start
    ne = {(r["resumed_at_ranks"], r["step"], r["accumulate_grad_batches"]): r["val_ne"] for r in results}
    ne_2, ne_1, ne_1_rows = ne[2, size["compare_at"], 1], ne[1, size["compare_at"], 1], ne[1, same_rows, 1]
    ne_1_k2 = ne[1, size["compare_at"], 2]
    figures = {"ne_2_to_1": ne_1, "ne_2_to_2": ne_2, "abs_ne_diff": abs(ne_1 - ne_2),
               "ne_2_to_1_same_rows": ne_1_rows, "abs_ne_diff_same_rows": abs(ne_1_rows - ne_2),
               "ne_2_to_1_accumulate2": ne_1_k2, "abs_ne_diff_accumulate2": abs(ne_1_k2 - ne_2),
               "saved_step": size["save_at"], "compared_step": size["compare_at"], "seconds": seconds}
    print(json.dumps({"benchmark": "elastic_resume", "results": results, "ratios": {}, "figures": figures}))


if __name__ == "__main__":
    main()
