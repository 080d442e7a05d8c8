"""The `lightning-rec` commands (fit, export, preprocess), run in process."""

from __future__ import annotations

import contextlib
import io
import shutil

from .helpers import ROOT, CLIError
from .registry import case, expect, simple

SMOKE = ("cli.fit_config_missing", "cli.preprocess_missing_input")


# CLI (in process; argparse/jsonargparse errors exit with a message on stderr)
def cli(*args, entry="fit"):
    from lightning_rec import cli as cli_mod
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            if entry == "export":
                return cli_mod.export_main(list(args))
            if entry == "preprocess":
                from lightning_rec.cli import preprocess_main
                return preprocess_main(list(args))
            return cli_mod.run_cli([entry, *args])
        except SystemExit as e:
            if e.code in (0, None):
                return None
            raise CLIError(err.getvalue()[-2000:] or f"exit {e.code}") from None


def cli_cases() -> None:
    """Configs, flags and paths the commands refuse, naming them."""
    simple("cli.fit_config_missing", lambda: cli("--config", "/nonexistent/cfg.yaml"), CLIError, ["cfg.yaml"])
    simple("cli.fit_max_steps_text", lambda: cli("--config", str(ROOT / "recipes/configs/dlrm_synthetic.yaml"),
                                                  "--trainer.max_steps=abc"), CLIError, ["max_steps", "abc"],
           timeout=60)
    simple("cli.fit_unknown_model_class", lambda: cli("--model=lightning_rec.NoSuchModel"), CLIError,
           ["NoSuchModel"], timeout=60)
    simple("cli.fit_negative_sparse_lr", lambda: cli("--config", str(ROOT / "recipes/configs/dlrm_synthetic.yaml"),
                                                      "--model.init_args.sparse_lr=-1", "--trainer.max_steps=1"),
           CLIError, ["sparse_lr=-1", ">= 0"], timeout=60)
    simple("cli.export_missing_checkpoint", lambda: cli("/nonexistent/x.ckpt", "/tmp/out_never", entry="export"),
           (CLIError, ValueError, FileNotFoundError), ["x.ckpt"])
    @case("cli.export_into_its_checkpoint", (CLIError, ValueError), ["is the checkpoint", "outside it"])
    def _(ctx):
        checkpoint = ctx.tmp / "last.ckpt"
        shutil.copytree(ROOT / "tests" / "fixtures" / "tiny.ckpt", checkpoint)
        before = sorted(checkpoint.rglob("*"))
        ctx.after(lambda: expect(sorted(checkpoint.rglob("*")) == before, "export wrote into the checkpoint"))
        cli(str(checkpoint), str(checkpoint), entry="export")

    @case("cli.predict_two_tower_recipe_dlrm_checkpoint", CLIError, ["DLRMModule", "TwoTowerModule",
                                                                     "MovieLensDataModule"], timeout=90)
    def _(ctx):
        cli("--config", str(ROOT / "recipes/configs/dlrm_synthetic.yaml"), f"--trainer.default_root_dir={ctx.tmp}",
            "--data.init_args.num_train_samples=64", "--data.init_args.num_val_samples=0", "--trainer.logger=false",
            "--trainer.max_steps=1", "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={ctx.tmp}",
            "--trainer.callbacks.filename=last")
        cli("--config", str(ROOT / "recipes/configs/two_tower_movielens.yaml"), "--trainer.logger=false",
            f"--trainer.default_root_dir={ctx.tmp}", f"--ckpt_path={ctx.tmp / 'last.ckpt'}", entry="predict")

    simple("cli.preprocess_26_sizes_wrong", lambda: cli("--input", str(ROOT / "README.md"), "--output_dir",
                                                         "/tmp/battery_never",
                                                         "--num_embeddings", "1,2,3", entry="preprocess"),
           (CLIError, ValueError), ["26", "num_embeddings"])
    simple("cli.preprocess_num_embeddings_fraction", lambda: cli("--input", str(ROOT / "README.md"), "--output_dir",
                                                                  "/tmp/battery_never", "--num_embeddings", "1.5",
                                                                  entry="preprocess"),
           (CLIError, ValueError), ["--num_embeddings 1.5", "one int"])

    @case("cli.preprocess_num_embeddings_exponent", (CLIError, ValueError), ["num_embeddings"], ok=True,
          legit="--num_embeddings 1e3 is the integer 1000")
    def _(ctx):
        (ctx.tmp / "d.tsv").write_text("".join("0\t" + "\t".join(["1"] * 13 + [f"{i:08x}" for i in range(26)]) + "\n"
                                               for _ in range(8)))
        manifest = cli("--input", str(ctx.tmp / "d.tsv"), "--output_dir", str(ctx.tmp / "o"), "--num_embeddings",
                       "1e3", "--no_progress", entry="preprocess")
        expect(manifest["num_embeddings_per_feature"] == [1000] * 26, f"{manifest['num_embeddings_per_feature']}")

    @case("cli.preprocess_output_dir_is_a_file", (CLIError, ValueError), ["--output_dir", "is a file"])
    def _(ctx):
        (ctx.tmp / "out.txt").write_text("x")
        ctx.after(lambda: expect((ctx.tmp / "out.txt").read_text() == "x", "the file was changed"))
        cli("--input", str(ROOT / "README.md"), "--output_dir", str(ctx.tmp / "out.txt"), entry="preprocess")

    simple("cli.preprocess_missing_input", lambda: cli("--input", "/nonexistent/day_0.gz", "--output_dir",
                                                        "/tmp/battery_never", entry="preprocess"),
           (CLIError, ValueError, FileNotFoundError), ["day_0.gz"])
    simple("cli.preprocess_rows_per_shard_zero", lambda: cli("--input", str(ROOT / "README.md"), "--output_dir",
                                                              "/tmp/battery_never", "--rows_per_shard", "0",
                                                              entry="preprocess"),
           (CLIError, ValueError), ["rows_per_shard"])


CASES = (cli_cases,)
