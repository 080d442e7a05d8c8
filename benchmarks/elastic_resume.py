"""Resume at another world size, mid-epoch: the synthetic DLRM saved at 2 ranks at step 50, resumed in 1 process,
against the same checkpoint resumed at 2 ranks: validation NE at step 63.

    python benchmarks/elastic_resume.py            # the synthetic recipe's DLRM, 131,072 rows, batch 512 per rank
    python benchmarks/elastic_resume.py --smoke    # seconds: 4,096 rows, batch 64, saved at step 10, compared at 13

Before the resumed loader dealt the rest of the epoch over the new ranks, the 1-process run started the epoch's
shuffle over while Lightning counted 50 of 128 batches done: it replayed rows already trained and left 14,336
unread, and reached NE 1.00 against 0.787 resumed at 2 ranks. Each phase is a fresh `python` (Lightning starts
the second rank itself); the first writes the checkpoint both resumes read.
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
    """One fit (this process is one of Lightning's ranks): to `max_steps`, from `ckpt` if given; rank 0 writes the
    validation metrics at the end to `out`."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_rec import RecStrategy
    from lightning_rec.data import SyntheticCriteoDataModule
    from lightning_rec.models import DLRMModule

    size = SMOKE if args.smoke else FULL
    L.seed_everything(0)
    callbacks = [ModelCheckpoint(dirpath=os.path.join(args.root, "ckpt"), every_n_train_steps=size["save_at"],
                                 save_last=True)]
    trainer = L.Trainer(strategy=RecStrategy(), accelerator="cpu", devices=args.world, max_steps=args.max_steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                        num_sanity_val_steps=0, val_check_interval=1.0, accumulate_grad_batches=args.accumulate)
    module = DLRMModule(num_embeddings_per_feature=size["tables"], embedding_dim=16, dense_arch_layer_sizes=[64, 16],
                        over_arch_layer_sizes=[64, 32, 1], sparse_optimizer="rowwise_adagrad", sparse_lr=0.05,
                        dense_optimizer="adagrad", dense_lr=0.02)
    data = SyntheticCriteoDataModule(num_train_samples=size["rows"], num_val_samples=size["val_rows"],
                                     batch_size=size["batch"], num_embeddings_per_feature=size["tables"])
    trainer.fit(module, data, ckpt_path=args.ckpt)
    metrics = trainer.validate(module, datamodule=data, verbose=False)[0]
    if trainer.is_global_zero:
        Path(args.out).write_text(json.dumps({"step": trainer.global_step, **{k: float(v) for k, v in
                                                                             metrics.items()}}))


def run_phase(smoke: bool, root: str, world: int, max_steps: int, ckpt: str | None, out: str,
              accumulate: int = 1) -> dict:
    command = [sys.executable, __file__, "--phase", "--root", root, "--world", str(world), "--max_steps",
               str(max_steps), "--out", out, "--accumulate", str(accumulate), *(["--smoke"] if smoke else []),
               *(["--ckpt", ckpt] if ckpt else [])]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--phase", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--max_steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--accumulate", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        return phase(args)
    size = SMOKE if args.smoke else FULL
    results = []
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        saved = run_phase(args.smoke, root, 2, size["save_at"], None, os.path.join(root, "saved.json"))
        ckpt = os.path.join(root, "ckpt", "last.ckpt")
        # 1 rank at the same step has read half the rows of 2 ranks; at twice the steps after the save, as many
        same_rows = size["save_at"] + 2 * (size["compare_at"] - size["save_at"])
        # accumulate 2 at 1 rank keeps the global batch of 2 ranks: a step reads the rows a 2-rank step reads
        for world, steps, k in ((2, size["compare_at"], 1), (1, size["compare_at"], 1), (1, same_rows, 1),
                                (1, size["compare_at"], 2)):
            name = f"resumed{world}_{steps}_k{k}"
            got = run_phase(args.smoke, os.path.join(root, name), world, steps, ckpt,
                            os.path.join(root, f"{name}.json"), accumulate=k)
            results.append({"resumed_at_ranks": world, "step": got["step"], "accumulate_grad_batches": k,
                            "val_ne": got["val_ne"], "val_auc": got["val_auc"]})
            print(f"saved at 2 ranks, step {size['save_at']} (val NE {saved['val_ne']:.4f}); resumed at {world} "
                  f"rank(s), accumulate_grad_batches={k}: step {got['step']} val NE {got['val_ne']:.4f} "
                  f"AUC {got['val_auc']:.4f}", flush=True)
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
