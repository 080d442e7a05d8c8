"""The one-label click metrics, AUC, BinnedAUC, NormalizedEntropy, LogLoss, CTR and RecMetricCollection: the per-task
metrics of tasks.py (TorchRec's definitions, docs/metrics.md) over one unnamed task, with the arguments they always
took (docs/criteo.md#click-metrics). update(preds, target) takes [B] or [B, 1]; compute() gives a scalar.

Shapes: N predictions in all (every update, every rank)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import MetricCollection

from lightning_rec.metrics.tasks import TaskAUC, TaskBinnedAUC, TaskCTR, TaskLogLoss, TaskNE, weighted_auc


class AUC(TaskAUC):
    """Exact ROC AUC over every prediction of every rank (ties count 1/2; 0.5 for one class, as TorchRec's). Logits and
    probabilities give the same AUC; they are kept as float32 logits, so confident ones stay apart."""

    def __init__(self, from_logits: bool = True, **kwargs) -> None:
        super().__init__("task", from_logits, **kwargs)


class BinnedAUC(TaskBinnedAUC):
    """ROC AUC from `num_thresholds` equal probability bins (fixed memory; within a bin's width of the exact AUC).
    Logits go through a sigmoid first."""

    def __init__(self, num_thresholds: int = 10_000, from_logits: bool = True, **kwargs) -> None:
        if not isinstance(num_thresholds, int) or num_thresholds < 2:
            raise ValueError(f"BinnedAUC(num_thresholds={num_thresholds!r}): use an int >= 2 (10,000 is typical)")
        super().__init__("task", from_logits, num_bins=num_thresholds, **kwargs)


class NormalizedEntropy(TaskNE):
    """Log loss divided by the entropy of the observed click rate (lower is better; 1 = no skill)."""

    def __init__(self, from_logits: bool = True, **kwargs) -> None:
        super().__init__("task", from_logits, **kwargs)


class LogLoss(TaskLogLoss):
    """Mean binary cross-entropy (nats)."""

    def __init__(self, from_logits: bool = True, **kwargs) -> None:
        super().__init__("task", from_logits, **kwargs)


class CTR(TaskCTR):
    """Click-through rate of the labels seen: mean label."""

    def __init__(self, from_logits: bool = True, **kwargs) -> None:
        super().__init__("task", from_logits, **kwargs)


def binary_entropy(p: Tensor) -> Tensor:
    """H(p) in nats; 0 at p = 0 or 1."""
    return -(torch.xlogy(p, p) + torch.xlogy(1 - p, 1 - p))


def exact_auc(scores_N: Tensor, labels_N: Tensor) -> Tensor:
    """P(score of a random positive > score of a random negative) + 1/2 P(equal); 0.5 if one class (TorchRec's)."""
    labels_N = labels_N.reshape(-1).double()
    return weighted_auc(scores_N.reshape(-1).double(), labels_N, torch.ones_like(labels_N))


_METRICS = {"auc": AUC, "binned_auc": BinnedAUC, "ne": NormalizedEntropy, "logloss": LogLoss, "ctr": CTR}


class RecMetricCollection(MetricCollection):
    """AUC, NE, log loss and CTR, updated together; log them from a LightningModule.

    ```python
    self.val_metrics = RecMetricCollection(prefix="val/")           # in __init__
    self.val_metrics.update(logits_B, batch.labels)                 # in validation_step
    self.val_metrics.log_to(self)                                   # same step: epoch values, prog bar
    ```
    Lightning then computes each metric over the epoch (all ranks) and resets it. (TaskMetrics(None, ...) is the same
    over a model's epoch by hand, and takes any of TASK_METRICS.)
    """

    def __init__(self, prefix: str | None = "val/", from_logits: bool = True,
                 metrics: Sequence[str] = ("auc", "ne", "logloss", "ctr"), num_thresholds: int = 10_000,
                 **metric_kwargs) -> None:
        unknown = [m for m in metrics if m not in _METRICS]
        if unknown:
            raise ValueError(f"unknown metrics {unknown}: choose from {sorted(_METRICS)}")
        # num_thresholds is BinnedAUC's alone: the other metrics refuse it ("Unexpected keyword")
        own = {"binned_auc": {"num_thresholds": num_thresholds}}
        super().__init__(
            {name: _METRICS[name](from_logits=from_logits, **own.get(name, {}), **metric_kwargs) for name in metrics},
            prefix=prefix,
            compute_groups=False,
        )

    def log_to(self, module, prog_bar: bool = True, **log_kwargs) -> None:
        """`module.log_dict(self)` with epoch-level values, shown in the progress bar by default."""
        module.log_dict(self, on_step=False, on_epoch=True, prog_bar=prog_bar, **log_kwargs)
