"""What a `lightning-rec fit` leaves and says: metrics.csv beside any other logger's files, a validation at the
last step, and at the end summary.md, learning_curves.png (from metrics.csv; also to W&B) and where everything went."""

from __future__ import annotations

import csv
import math
import os
import re
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_rec import _compat

CURVES = "learning_curves.png"
SUMMARY = "summary.md"
LOWER_IS_BETTER = {"loss", "logloss", "ne", "mse", "rmse", "mae"}
NO_BEST = {"ctr", "calibration"}  # the data's rate; calibration is best nearest 1, neither highest nor lowest


class FinalStepValidation(Callback):
    """Validates after the fit's last step when the last validation was at an earlier one (max_steps between two
    validation points): the printed, logged and checkpointed metrics are the final model's."""

    def __init__(self) -> None:
        self.step: int | None = None  # the step of this fit's last validation

    def on_train_start(self, trainer, pl_module) -> None:
        _compat.validate_also_after(trainer, lambda: self._due(trainer))

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self.step = trainer.global_step

    def _due(self, trainer) -> bool:
        if self.step is None or self.step == trainer.global_step:  # none yet (the recipe's choice), or this step's
            return False
        if 0 < trainer.max_steps <= trainer.global_step:
            return True
        max_epochs = trainer.max_epochs
        return (max_epochs is not None and max_epochs >= 0 and trainer.current_epoch + 1 >= max_epochs
                and _compat.is_last_batch_of_epoch(trainer))


def add_csv_logger(trainer) -> None:
    """A CSVLogger beside the run's other loggers (W&B's files: their save_dir), unless one is there or none is."""
    from lightning.pytorch.loggers import CSVLogger

    loggers = list(trainer.loggers)
    if not loggers or any(isinstance(logger, CSVLogger) for logger in loggers):
        return
    save_dir = next((logger.save_dir for logger in loggers if logger.save_dir), None) or trainer.default_root_dir
    trainer.loggers = [*loggers, CSVLogger(save_dir)]


def quiet_wandb(trainer) -> None:
    """Before W&B's run starts: no `anonymous` argument (wandb: "has no effect") and its folder made (wandb: "git
    root ... does not exist", which it says of a save_dir not yet created)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            arguments = _compat.wandb_init_arguments(logger)
            if arguments.get("anonymous", "") is None:
                del arguments["anonymous"]
            if logger.save_dir and trainer.is_global_zero:
                os.makedirs(logger.save_dir, exist_ok=True)


def csv_log_dir(trainer) -> str | None:
    from lightning.pytorch.loggers import CSVLogger

    return next((logger.log_dir for logger in trainer.loggers if isinstance(logger, CSVLogger)), None)


def read_metrics(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv as column -> [(step, value)], the rows where the column has a value; steps as the Trainer's
    global_step (Lightning writes the count before the step's increment: 30 for the validation after step 31)."""
    series: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or 0)) + 1
            for name, value in row.items():
                if name not in ("step", "epoch") and value not in ("", None):
                    series.setdefault(name, []).append((step, float(value)))
    return series


def _kind(column: str) -> str | None:
    """`ndcg` for val_ndcg@10, `auc` for test_auc/click and for a task's val/click/auc; None for columns that are
    no evaluation metric."""
    found = re.match(r"(val|test)_([^/]+?)(@\d+)?(/.*)?$", column) or re.match(r"(val|test)/[^/]+/([^/]+?)$", column)
    return found[2] if found else None


def _panels(series: dict[str, list]) -> dict[str, list[str]]:
    """Panel title -> columns: train loss, then one panel per metric (ndcg, recall, auc, ...): its splits, @K and
    tasks (`val_auc/click`, `val_click_auc` stay apart by name) as lines."""
    panels: dict[str, list[str]] = {}
    losses = [c for c in series if c.startswith("train") and "loss" in c]
    if losses:
        panels["train loss"] = losses
    kinds: dict[str, list[str]] = {}
    for column in series:
        kind = _kind(column)
        if kind and kind not in ("loss", "ctr"):  # (val_loss: the logloss again; ctr: the data's, not learnt)
            kinds.setdefault(kind, []).append(column)
    first = ["auc", "ndcg", "recall"]  # the metrics recipes are judged by, then the rest as logged
    for kind in sorted(kinds, key=lambda k: first.index(k) if k in first else len(first)):
        panels[kind] = kinds[kind]
    return panels


def plot_curves(series: dict[str, list], path: str | Path) -> str | None:
    """The learning curves PNG (matplotlib, no display); None when there is nothing to plot."""
    panels = _panels(series)
    if not panels:
        return None
    try:
        import matplotlib
    except ImportError:  # an environment installed before matplotlib was a dependency: the rest still written
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, columns) in zip(axes.flat, panels.items()):
        for column in columns:
            steps, values = zip(*series[column])
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=column)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def checkpoints(trainer) -> list[tuple[str, str]]:
    """(what, path) of each ModelCheckpoint's best and last checkpoints."""
    out = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            if callback.best_model_path:
                score = callback.best_model_score
                said = f" ({callback.monitor}={float(score):.4f})" if callback.monitor and score is not None else ""
                out.append((f"best{said}" if callback.monitor else "newest", callback.best_model_path))
            if callback.last_model_path:
                out.append(("last", callback.last_model_path))
    return out


def wandb_dirs(trainer) -> list[str]:
    from lightning.pytorch.loggers import WandbLogger

    dirs = []
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):  # (rank 0, after fit: its run started with the fit)
            run_dir = getattr(logger.experiment, "dir", None)  # <run>/files
            dirs.append(str(Path(run_dir).parent) if run_dir else str(logger.save_dir))
    return dirs


def write_summary(trainer, final: dict[str, float], step: int | None) -> dict[str, str]:
    """summary.md and learning_curves.png in the CSVLogger's folder (rank 0); what was written, by name."""
    log_dir = csv_log_dir(trainer)
    metrics_csv = os.path.join(log_dir, "metrics.csv") if log_dir else None
    if not metrics_csv or not os.path.isfile(metrics_csv):
        return {}
    written = {"metrics": metrics_csv}
    series = read_metrics(metrics_csv)
    curves = plot_curves(series, os.path.join(log_dir, CURVES))
    if curves:
        written["curves"] = curves
    lines = [f"# {Path(str(trainer.default_root_dir)).name or 'run'}: fit summary", "",
             f"{trainer.global_step} steps, {trainer.current_epoch} epoch(s) completed"
             + (f"; final metrics from the validation at step {step}" if step is not None else ""), ""]
    if final:
        lines += ["| metric | final |", "|---|---|", *(f"| {k} | {v:.4f} |" for k, v in sorted(final.items())), ""]
    best = {c: (min if _kind(c) in LOWER_IS_BETTER else max)(series[c], key=lambda sv: sv[1]) for c in series
            if _kind(c) and _kind(c) not in NO_BEST}
    if best:
        lines += ["| metric | best during the fit | at step |", "|---|---|---|"]
        lines += [f"| {column} | {value:.4f} | {at} |" for column, (at, value) in sorted(best.items())]
        lines.append("")
    for what, path in checkpoints(trainer):
        lines.append(f"- checkpoint, {what}: `{path}`")
    lines += [f"- metrics: `{metrics_csv}`", *(f"- W&B run: `{d}`" for d in wandb_dirs(trainer)), ""]
    if curves:
        lines += [f"![learning curves]({CURVES})", ""]
    path = os.path.join(log_dir, SUMMARY)
    Path(path).write_text("\n".join(lines))
    written["summary"] = path
    return written


def to_wandb(trainer, written: dict[str, str]) -> None:
    """The learning curves to each W&B run, as an image."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and "curves" in written:
            logger.log_image(key="learning_curves", images=[written["curves"]])


def where_it_went(trainer, written: dict[str, str]) -> list[str]:
    """The lines `fit` ends with: logs, checkpoints, W&B files."""
    lines = []
    if written:
        names = ", ".join(os.path.basename(written[k]) for k in ("metrics", "summary", "curves") if k in written)
        lines.append(f"logs: {os.path.dirname(written['metrics'])} ({names})")
    elif not trainer.loggers:
        lines.append("logs: none (--trainer.logger=false)")
    for what, path in checkpoints(trainer):
        lines.append(f"checkpoint, {what}: {path}")
    for run_dir in wandb_dirs(trainer):
        offline = os.path.basename(run_dir).startswith("offline-")
        lines.append(f"W&B: {run_dir}" + (f" (upload: wandb sync {run_dir})" if offline else ""))
    return lines


def summarize(trainer, final: dict[str, Any], step: int | None) -> None:
    """Rank 0, after fit: summary.md + learning curves, to W&B too, and where everything went (printed)."""
    written = write_summary(trainer, final, step)
    to_wandb(trainer, written)
    for line in where_it_went(trainer, written):
        print(line, flush=True)
