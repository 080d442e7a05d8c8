"""Click-through-rate metrics on torchmetrics: AUC, normalized entropy (NE), log loss, CTR.

Shapes: B predictions in one update, N predictions in all (every update, every rank).

Every metric takes `update(preds_B, labels_B)`, with `preds` logits (`from_logits=True`, the
default: what a CTR model outputs before its sigmoid) or probabilities, and labels 0./1. States
are torchmetrics states with a `dist_reduce_fx`, so `compute()` is over all ranks:

    LogLoss   sum of per-sample BCE, count                  ("sum")   -> mean BCE
    CTR       sum of labels, count                          ("sum")   -> positives / count
    NE        sum of BCE, sum of labels, count              ("sum")   -> logloss / H(ctr)
    AUC       every prediction and label                    ("cat")   -> exact, tie-aware

    H(p) = -(p log p + (1 - p) log(1 - p)), the log loss of always predicting the data's own
    click rate; NE < 1 means the model beats that constant (He et al., 2014).

Sums are kept in float64: over tens of millions of samples float32 sums lose digits. AUC keeps
all predictions (4 bytes each, plus the label); pass `compute_on_cpu=True` to keep them on the
host. Labels must be 0 or 1 (not checked per batch: that would read the device every step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric, MetricCollection
from torchmetrics.utilities import dim_zero_cat


def _flat(preds: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    preds_B, labels_B = preds.detach().reshape(-1), labels.detach().reshape(-1)
    if preds_B.shape != labels_B.shape:
        raise ValueError(
            f"{preds_B.numel()} predictions for {labels_B.numel()} labels: pass one prediction per "
            f"sample (shape [B] or [B, 1]) and labels of shape [B]"
        )
    return preds_B, labels_B


def _bce_sum(preds_B: Tensor, labels_B: Tensor, from_logits: bool) -> Tensor:
    x, y = preds_B.double(), labels_B.double()
    if from_logits:
        return F.binary_cross_entropy_with_logits(x, y, reduction="sum")
    # torch clamps each log at -100, as in BCELoss: a probability of exactly 0 or 1 stays finite
    return F.binary_cross_entropy(x, y, reduction="sum")


def binary_entropy(p: Tensor) -> Tensor:
    """H(p) in nats; 0 at p = 0 or 1 (where NE is then undefined: inf or nan)."""
    return -(torch.xlogy(p, p) + torch.xlogy(1 - p, 1 - p))


class _SumMetric(Metric):
    is_differentiable = False
    full_state_update = False

    def __init__(self, from_logits: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.from_logits = from_logits
        zero = lambda: torch.zeros((), dtype=torch.float64)  # noqa: E731
        self.add_state("loss_sum", default=zero(), dist_reduce_fx="sum")
        self.add_state("label_sum", default=zero(), dist_reduce_fx="sum")
        self.add_state("count", default=zero(), dist_reduce_fx="sum")

    def update(self, preds: Tensor, labels: Tensor) -> None:
        preds_B, labels_B = _flat(preds, labels)
        self.loss_sum += _bce_sum(preds_B, labels_B, self.from_logits)
        self.label_sum += labels_B.double().sum()
        self.count += labels_B.numel()


class LogLoss(_SumMetric):
    """Mean binary cross-entropy (nats)."""

    higher_is_better = False

    def compute(self) -> Tensor:
        return self.loss_sum / self.count


class CTR(_SumMetric):
    """Click-through rate of the labels seen: mean label."""

    higher_is_better = None

    def compute(self) -> Tensor:
        return self.label_sum / self.count


class NormalizedEntropy(_SumMetric):
    """Log loss divided by the entropy of the observed click rate (lower is better; 1 = no skill)."""

    higher_is_better = False

    def compute(self) -> Tensor:
        return (self.loss_sum / self.count) / binary_entropy(self.label_sum / self.count)


class AUC(Metric):
    """Exact ROC AUC over every prediction of every rank (Mann-Whitney rank statistic, ties count 1/2).

    Logits and probabilities give the same AUC (the sigmoid keeps the order), so `from_logits`
    only documents the input; predictions are stored as float32.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, from_logits: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.from_logits = from_logits
        self.add_state("preds", default=[], dist_reduce_fx="cat")
        self.add_state("labels", default=[], dist_reduce_fx="cat")

    def update(self, preds: Tensor, labels: Tensor) -> None:
        preds_B, labels_B = _flat(preds, labels)
        self.preds.append(preds_B.float())
        self.labels.append(labels_B.float())

    def compute(self) -> Tensor:
        return exact_auc(dim_zero_cat(self.preds), dim_zero_cat(self.labels))


def exact_auc(scores_N: Tensor, labels_N: Tensor) -> Tensor:
    """P(score of a random positive > score of a random negative) + 1/2 P(equal); NaN if one class."""
    scores_N, labels_N = scores_N.reshape(-1), labels_N.reshape(-1).double()
    _, group_N, size_U = torch.unique(scores_N, sorted=True, return_inverse=True, return_counts=True)
    # tied scores share the mean of the 1-based ranks they span
    mean_rank_U = torch.cumsum(size_U, 0).double() - (size_U.double() - 1) / 2
    rank_N = mean_rank_U[group_N]
    num_pos = labels_N.sum()
    num_neg = labels_N.numel() - num_pos
    rank_sum_pos = (rank_N * labels_N).sum()
    return (rank_sum_pos - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg)


_METRICS = {"auc": AUC, "ne": NormalizedEntropy, "logloss": LogLoss, "ctr": CTR}


class RecMetricCollection(MetricCollection):
    """AUC, NE, log loss and CTR, updated together; log them from a LightningModule.

    ```python
    self.val_metrics = RecMetricCollection(prefix="val/")           # in __init__
    self.val_metrics.update(logits_B, batch.labels)                 # in validation_step
    self.val_metrics.log_to(self)                                   # same step: epoch values, prog bar
    ```
    Lightning then computes each metric over the epoch (all ranks) and resets it.
    """

    def __init__(
        self,
        prefix: str | None = "val/",
        from_logits: bool = True,
        metrics: Sequence[str] = ("auc", "ne", "logloss", "ctr"),
        **metric_kwargs,
    ) -> None:
        unknown = [m for m in metrics if m not in _METRICS]
        if unknown:
            raise ValueError(f"unknown metrics {unknown}: choose from {sorted(_METRICS)}")
        super().__init__(
            {name: _METRICS[name](from_logits=from_logits, **metric_kwargs) for name in metrics},
            prefix=prefix,
            compute_groups=False,
        )

    def log_to(self, module, prog_bar: bool = True, **log_kwargs) -> None:
        """`module.log_dict(self)` with epoch-level values, shown in the progress bar by default."""
        module.log_dict(self, on_step=False, on_epoch=True, prog_bar=prog_bar, **log_kwargs)
