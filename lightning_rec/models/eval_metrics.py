"""The evaluation metrics of DLRMModule and MultiTaskModule, chosen in one place (docs/metrics.md#in-a-model).

- `metrics`: names of lightning_rec.metrics.TASK_METRICS. Each task gets those of its kind (binary or regression),
  and its loss metric (logloss / mse), of which `<split>_loss` is made. None: auc, ne, logloss, ctr for a binary
  task; mse, mae for a regression one. DLRMModule's one label logs them under the single-task names (`val_auc`).
- `group_feature`: the sparse feature whose id in a row is that row's group (a user or request id) for "gauc".
- `calibration_buckets`: a per-task calibration plot (predicted vs observed rate by prediction bucket, a
  TaskCalibrationCurve synced over ranks) logged to W&B at validation end, when a WandbLogger is attached; nothing
  is kept or written without one."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_rec.errors import short_list
from lightning_rec.metrics import TASK_METRICS, TaskCalibrationCurve, TaskMetrics

DEFAULT_METRICS = {"binary": ("auc", "ne", "logloss", "ctr"), "regression": ("mse", "mae")}
LOSS_METRIC = {"binary": "logloss", "regression": "mse"}


def check_metric_args(owner: str, metrics: Sequence[str] | None, group_feature: str | None,
                      feature_names: Sequence[str], calibration_buckets: int) -> None:
    """The metric arguments of a model, at its construction."""
    if metrics is not None:
        metrics = [metrics] if isinstance(metrics, str) else list(metrics)
        unknown = [m for m in metrics if m not in TASK_METRICS]
        if unknown or not metrics:
            raise ValueError(f"{owner}(metrics={metrics!r}): unknown {short_list(unknown)}; choose from "
                             f"{sorted(TASK_METRICS)}")
        if "gauc" in metrics and group_feature is None:
            raise ValueError(f"{owner}(metrics=[..., 'gauc']): GAUC scores each group (user or request) apart: name "
                             f"the sparse feature whose id is a row's group, group_feature=... (one of "
                             f"{short_list(list(feature_names))})")
    if group_feature is not None and group_feature not in feature_names:
        raise ValueError(f"{owner}(group_feature={group_feature!r}): not a sparse feature of the model; its features "
                         f"are {short_list(list(feature_names))}")
    if not isinstance(calibration_buckets, int) or isinstance(calibration_buckets, bool) or calibration_buckets < 0:
        raise ValueError(f"{owner}(calibration_buckets={calibration_buckets!r}): give the buckets of the W&B "
                         f"calibration plot, an int >= 1 (0: no plot)")


def task_metrics(task: str | None, task_type: str, metrics: Sequence[str] | None, prefix: str) -> TaskMetrics:
    """One task's metrics, logged as `<prefix><task>/<metric>` (task None: one label, `<prefix><metric>`)."""
    regression = task_type == "regression"
    names = [m for m in (metrics or DEFAULT_METRICS[task_type]) if TASK_METRICS[m].binary != regression]
    names += [LOSS_METRIC[task_type]] if LOSS_METRIC[task_type] not in names else []
    return TaskMetrics(None if task is None else [task], names, prefix=prefix)


def group_ids(batch, group_feature: str | None) -> Tensor | None:
    """[B] each row's group: its first id of `group_feature` (-1 for an empty bag); None without a group feature."""
    if group_feature is None:
        return None
    jt = batch.sparse_features[group_feature]
    lengths_B, values_N = jt.lengths(), jt.values()
    starts_B = torch.cumsum(lengths_B, 0) - lengths_B
    first_B = values_N[starts_B.clamp(max=max(values_N.numel() - 1, 0))] if values_N.numel() else \
        torch.zeros_like(lengths_B)
    return torch.where(lengths_B > 0, first_B.long(), -1)


def wandb_loggers(module) -> list:
    """The module's WandbLoggers (the same on every rank: each rank keeps the curve's states, rank 0 logs)."""
    try:
        from lightning.pytorch.loggers import WandbLogger
    except ImportError:  # pragma: no cover
        return []
    return [lg for lg in getattr(module, "loggers", []) if isinstance(lg, WandbLogger)]


def add_calibration_curves(module, curves: nn.ModuleList, tasks: Sequence[str], buckets: int, count: int) -> None:
    """Grow `curves` to one curve over `tasks` (binary ones) per validation dataloader, `count` of them, when the
    module logs to W&B; nothing is kept without one."""
    if not buckets or not tasks or not wandb_loggers(module):
        return
    while len(curves) < count:
        curves.append(TaskCalibrationCurve(list(tasks), num_buckets=buckets).to(module.device))


def log_calibration_plots(module, curve: TaskCalibrationCurve, key: str, suffix: str = "") -> None:
    """compute() (synced over ranks), then one wandb line plot per task, predicted vs observed rate, at key
    `key.format(task=...) + suffix` (suffix: a dataloader's, as its metrics'), with its table of buckets; then reset."""
    import wandb

    if module.trainer.sanity_checking:  # Lightning logs nothing of the sanity check: nor does this
        curve.reset()
        return
    values = curve.compute().cpu()  # [T, buckets, 3]: mean prediction, observed rate, weight
    curve.reset()
    if module.global_rank != 0:  # its loggers' experiments are stand-ins
        return
    columns = ["bucket", "predicted", "observed", "weight"]
    for task, rows_K3 in zip(curve.tasks, values):
        rows = [[k, *map(float, r)] for k, r in enumerate(rows_K3.tolist()) if r[2] == r[2] and r[2] > 0]
        table = wandb.Table(columns=columns, data=rows)
        name = key.format(task=task)
        plot = wandb.plot.line(table, "predicted", "observed", title=f"{name}{suffix}: observed vs predicted rate")
        for logger in wandb_loggers(module):
            logger.experiment.log({name + suffix: plot, f"{name}_table{suffix}": table,
                                   "trainer/global_step": module.global_step})
