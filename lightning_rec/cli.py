"""`lightning-rec`: the recipe command line (LightningCLI).

    lightning-rec fit --config recipes/configs/dlrm_synthetic.yaml [--trainer.max_steps=200]
    lightning-rec fit --config recipes/configs/dlrm_criteo_kaggle.yaml \
        --data.train_path=train.tsv --data.val_path=valid.tsv
    lightning-rec preprocess --input day_0.gz ... --output_dir shards/train   (lightning_rec/data/preprocess.py)

Model and data are chosen by class path in the YAML (`model.class_path`, `data.class_path`), so a
recipe can swap either without code. After `fit`, the final validation metrics are printed.

    lightning-rec export CHECKPOINT OUT [--fp16-tables]

writes an unsharded model for inference (OUT/model.safetensors + OUT/config.json) from a sharded
checkpoint directory or an old one-file checkpoint; `lightning_rec.checkpoint.load_exported(OUT)`
rebuilds it on one CPU process (see checkpoint.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

import lightning_rec.strategy  # noqa: F401  (registers --trainer.strategy=rec)


class RecCLI(LightningCLI):
    def instantiate_trainer(self, **kwargs):
        try:
            return super().instantiate_trainer(**kwargs)
        except MisconfigurationException as e:
            # Lightning's "No supported gpu backend found!" names neither what is missing nor the fix
            from lightning_rec.lookup import cuda_missing

            accelerator = str(self._get(self.config_init, "trainer", {}).get("accelerator", "")).lower()
            what = cuda_missing()
            if accelerator in ("gpu", "cuda") and what is not None:
                raise SystemExit(f"lightning-rec: --trainer.accelerator={accelerator} needs a CUDA GPU, but {what}; "
                                 f"or use --trainer.accelerator=cpu") from e
            raise

    def after_fit(self) -> None:
        # the last validation's metrics; recipes that also rank the test split in fit (eval_test_in_fit)
        # log test_* there too
        for prefix, what in (("val_", "validation"), ("test_", "test")):
            metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith(prefix)}
            if metrics and self.trainer.is_global_zero:
                shown = "  ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()))
                print(f"final {what}: {shown}", flush=True)


def run_cli(args: list[str] | None = None) -> RecCLI:
    """Run the CLI and return it (tests read its trainer and model)."""
    # W&B never reaches the network unless the user asks for it (WANDB_MODE=online).
    os.environ.setdefault("WANDB_MODE", "offline")
    # Lightning 2.6 asks torch 2.13's pytree an isinstance() that torch now deprecates: a FutureWarning in every
    # run (each rank) that no recipe can act on; Lightning's to change
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    return RecCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,  # None: LightningCLI reads sys.argv itself (passing it too makes Lightning warn)
    )


def export_main(argv: list[str]) -> int:
    """`lightning-rec export CHECKPOINT OUT [--fp16-tables]`."""
    from lightning_rec.checkpoint import export

    parser = argparse.ArgumentParser(prog="lightning-rec export",
                                     description="Write an unsharded model for inference: OUT/model.safetensors + "
                                                 "OUT/config.json (load with lightning_rec.checkpoint.load_exported)")
    parser.add_argument("checkpoint", help="a checkpoint directory (sharded) or file (gathered), e.g. "
                                           "lightning_logs/version_0/checkpoints/last.ckpt")
    parser.add_argument("out", help="the directory to write")
    parser.add_argument("--fp16-tables", action="store_true", help="store embedding tables in float16 (half size)")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, fp16_tables=args.fp16_tables)
    except ValueError as e:
        parser.exit(2, f"lightning-rec export: error: {e}\n")
    print(f"exported {args.checkpoint} -> {out}/model.safetensors, {out}/config.json", flush=True)
    return 0


def main() -> None:
    """Console entry point `lightning-rec`."""
    if sys.argv[1:2] == ["preprocess"]:  # not a Trainer subcommand: its own arguments
        from lightning_rec.data.preprocess import preprocess_main

        preprocess_main(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "export":
        sys.exit(export_main(sys.argv[2:]))
    run_cli()


if __name__ == "__main__":
    main()
