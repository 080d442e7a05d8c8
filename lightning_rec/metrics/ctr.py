"""Click-through-rate metrics on torchmetrics: AUC, BinnedAUC, normalized entropy (NE), log loss, CTR (what each keeps
and computes: docs/criteo.md#click-metrics). Sums are float64: float32 loses digits over tens of millions of samples.
Labels are checked on CPU at once; on GPU the bad ones are counted on the device and raised at compute.

Shapes: B predictions in one update, N predictions in all (every update, every rank)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import BinaryAUROC
from torchmetrics.utilities import dim_zero_cat


def _target_of(target: Tensor | None, labels: Tensor | None, where: str) -> Tensor:
    """torchmetrics' `target`, or `labels` (this module's earlier name): one of them."""
    if (target is None) == (labels is None):
        raise TypeError(f"{where}(preds, target) takes the 0/1 labels once, as target (torchmetrics' name) or "
                        f"labels, got {'both' if target is not None else 'neither'}")
    return target if target is not None else labels


def _flat(preds: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    preds_B, labels_B = preds.detach().reshape(-1), labels.detach().reshape(-1)
    if preds_B.shape != labels_B.shape:
        raise ValueError(f"{preds_B.numel()} predictions for {labels_B.numel()} labels: pass one prediction per "
                         f"sample (shape [B] or [B, 1]) and labels of shape [B]")
    return preds_B, labels_B


def _bad_label_count(labels_B: Tensor) -> Tensor:
    """How many labels are not 0 or 1 (NaN included), as a tensor on the labels' device."""
    return ((labels_B != 0) & (labels_B != 1)).sum()


def _label_error(num_bad: int, num_labels: int | None, where: str) -> ValueError:
    of = f" of {num_labels}" if num_labels is not None else ""
    return ValueError(
        f"{where}: {num_bad}{of} labels are not 0 or 1: click metrics need binary labels. Binarize them "
        f"first (e.g. `labels = (rating >= 4).float()`, or `(labels > 0).float()` for -1/1 labels); NaN labels "
        f"come from unlabelled data (such as the Kaggle test file), which has no metric"
    )


def _raise_now_or_count(bad: Tensor, total: int, error, where: str) -> Tensor | None:
    """On CPU: raise `error(bad, total, where)` at once if any entry is bad; elsewhere return the count (no sync)."""
    if bad.device.type == "cpu":
        if int(bad):
            raise error(int(bad), total, where)
        return None
    return bad


def _check_labels_now(labels_B: Tensor, where: str) -> Tensor | None:
    return _raise_now_or_count(_bad_label_count(labels_B), labels_B.numel(), _label_error, where)


def _prob_error(num_bad: int, num_preds: int | None, where: str) -> ValueError:
    of = f" of {num_preds}" if num_preds is not None else ""
    return ValueError(
        f"{where}: {num_bad}{of} predictions are outside [0, 1] with from_logits=False, so they are not probabilities "
        f"(logits?): pass from_logits=True (the default) for a model's output before its sigmoid, or apply the "
        f"sigmoid first"
    )


def _check_probs_now(preds_B: Tensor, from_logits: bool, where: str) -> Tensor | None:
    """from_logits=False: a prediction outside [0, 1] raised at once on CPU, else counted on the device (as labels)."""
    if from_logits:
        return None
    return _raise_now_or_count(((preds_B < 0) | (preds_B > 1)).sum(), preds_B.numel(), _prob_error, where)


def _one_class_nan(num_pos: float, num_neg: float, name: str) -> Tensor | None:
    if num_pos > 0 and num_neg > 0:
        return None
    if num_pos + num_neg == 0:
        warnings.warn(f"{name}: the evaluation set is empty (no labels were passed to update on any rank), so AUC is "
                      f"undefined: returning NaN", UserWarning, stacklevel=3)
        return torch.tensor(float("nan"), dtype=torch.float64)
    warnings.warn(f"{name}: the evaluation set has only {'negative' if num_pos == 0 else 'positive'} labels "
                  f"({int(num_pos)} positive, {int(num_neg)} negative), so AUC is undefined: returning NaN. "
                  f"Evaluate on a set with both clicks and non-clicks",
                  UserWarning,
                  stacklevel=3,)
    return torch.tensor(float("nan"), dtype=torch.float64)


def _bce_sum(preds_B: Tensor, labels_B: Tensor, from_logits: bool) -> Tensor:
    x, y = preds_B.double(), labels_B.double()
    if from_logits:
        return F.binary_cross_entropy_with_logits(x, y, reduction="sum")
    # torch clamps each log at -100, as in BCELoss: a probability of exactly 0 or 1 stays finite
    return F.binary_cross_entropy(x, y, reduction="sum")


def binary_entropy(p: Tensor) -> Tensor:
    """H(p) in nats; 0 at p = 0 or 1 (where NE is undefined: NormalizedEntropy warns and gives NaN)."""
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
        self.add_state("bad_labels", default=zero(), dist_reduce_fx="sum")
        self.add_state("bad_preds", default=zero(), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor | None = None, *, labels: Tensor | None = None) -> None:
        where = f"{type(self).__name__}.update"
        preds_B, labels_B = _flat(preds, _target_of(target, labels, where))
        bad = _check_labels_now(labels_B, where)
        if bad is not None:
            self.bad_labels += bad
        bad = _check_probs_now(preds_B, self.from_logits, where)  # torch's BCE says only "between 0 and 1"
        if bad is not None:
            self.bad_preds += bad
            preds_B = preds_B.clamp(0, 1)  # counted, raised at compute; a CUDA BCE would assert on the device
        self.loss_sum += _bce_sum(preds_B, labels_B, self.from_logits)
        self.label_sum += labels_B.double().sum()
        self.count += labels_B.numel()

    def _checked_count(self) -> Tensor:
        if float(self.bad_labels):  # one host read per compute, not per batch
            raise _label_error(int(self.bad_labels), int(self.count), f"{type(self).__name__}.compute")
        if float(self.bad_preds):
            raise _prob_error(int(self.bad_preds), int(self.count), f"{type(self).__name__}.compute")
        return self.count


class LogLoss(_SumMetric):
    """Mean binary cross-entropy (nats)."""

    higher_is_better = False

    def compute(self) -> Tensor:
        return self.loss_sum / self._checked_count()


class CTR(_SumMetric):
    """Click-through rate of the labels seen: mean label."""

    higher_is_better = None

    def compute(self) -> Tensor:
        return self.label_sum / self._checked_count()


class NormalizedEntropy(_SumMetric):
    """Log loss divided by the entropy of the observed click rate (lower is better; 1 = no skill)."""

    higher_is_better = False

    def compute(self) -> Tensor:
        count = self._checked_count()
        entropy = binary_entropy(self.label_sum / count)
        if not float(entropy) > 0:
            # one class: H(ctr) is 0, no baseline to normalize by (loss / -0.0 would read as the best score)
            positives = float(self.label_sum)
            warnings.warn(f"NormalizedEntropy: the evaluation set has {int(positives)} positive and "
                          f"{int(float(count) - positives)} negative labels, so the entropy of its click rate is 0 "
                          f"and NE is undefined: returning NaN. Evaluate on a set with both clicks and non-clicks "
                          f"(LogLoss is defined on any set)", UserWarning, stacklevel=2)
            return torch.tensor(float("nan"), dtype=torch.float64)
        return (self.loss_sum / count) / entropy


class AUC(Metric):
    """Exact ROC AUC over every prediction of every rank (Mann-Whitney rank statistic, ties count 1/2). Logits and
    probabilities give the same AUC, so `from_logits` only documents the input; kept as float32."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, from_logits: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.from_logits = from_logits
        self.add_state("preds", default=[], dist_reduce_fx="cat")
        self.add_state("labels", default=[], dist_reduce_fx="cat")

    def update(self, preds: Tensor, target: Tensor | None = None, *, labels: Tensor | None = None) -> None:
        preds_B, labels_B = _flat(preds, _target_of(target, labels, "AUC.update"))
        _check_labels_now(labels_B, "AUC.update")  # off CPU, compute() checks all labels once
        self.preds.append(preds_B.float())
        self.labels.append(labels_B.float())

    def compute(self) -> Tensor:
        empty = isinstance(self.labels, list) and not self.labels  # a list before sync, a tensor after
        labels_N = torch.zeros(0) if empty else dim_zero_cat(self.labels)
        preds_N = torch.zeros(0) if empty else dim_zero_cat(self.preds)
        bad = int(_bad_label_count(labels_N))
        if bad:
            raise _label_error(bad, labels_N.numel(), "AUC.compute")
        num_pos = float(labels_N.sum())
        nan = _one_class_nan(num_pos, labels_N.numel() - num_pos, "AUC")
        if nan is not None:
            return nan
        num_nan = int(torch.isnan(preds_N).sum())
        if num_nan:  # NaN sorts as the largest score: the rank statistic would look like a valid AUC
            warnings.warn(f"AUC: {num_nan} of {preds_N.numel()} predictions are NaN (a diverged model?), so the "
                          f"AUC is undefined: NaN", stacklevel=2)
            return torch.tensor(float("nan"))
        return exact_auc(preds_N, labels_N)


class BinnedAUC(BinaryAUROC):
    """ROC AUC from confusion counts at `num_thresholds` evenly spaced probabilities (torchmetrics' binned
    `BinaryAUROC`, fixed memory), its counts built from a histogram. Logits go through a sigmoid first."""

    def __init__(self, num_thresholds: int = 10_000, from_logits: bool = True, **kwargs) -> None:
        if not isinstance(num_thresholds, int) or num_thresholds < 2:
            raise ValueError(f"BinnedAUC(num_thresholds={num_thresholds!r}): use an int >= 2 (10,000 is typical)")
        # validate_args=False: its label check reads the device every batch; ours does not
        super().__init__(thresholds=num_thresholds, validate_args=False, **kwargs)
        self.from_logits = from_logits
        self.add_state("bad_labels", default=torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        # NaN scores fall in the top bin: counted (on the device, no sync) so compute() says so instead
        self.add_state("nan_preds", default=torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("bad_preds", default=torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor | None = None, *, labels: Tensor | None = None) -> None:
        preds_B, labels_B = _flat(preds, _target_of(target, labels, "BinnedAUC.update"))
        bad = _check_labels_now(labels_B, "BinnedAUC.update")
        if bad is not None:
            self.bad_labels += bad
        self.nan_preds += torch.isnan(preds_B).sum()
        bad = _check_probs_now(preds_B, self.from_logits, "BinnedAUC.update")
        if bad is not None:
            self.bad_preds += bad
        probs_B = torch.sigmoid(preds_B.float()) if self.from_logits else preds_B.float()
        # a histogram over the thresholds: torchmetrics' counts in O(B log T), not O(B T)
        thresholds_T = self.thresholds
        T = thresholds_T.numel()
        above_B = torch.searchsorted(thresholds_T, probs_B, right=True)  # how many thresholds are <= p
        labels_i = labels_B.long()
        hist_2J = torch.bincount(above_B + (T + 1) * labels_i, minlength=2 * (T + 1)).view(2, T + 1)
        # predicted positive at threshold t (p >= thr_t) <=> above > t: counts of above in t+1..T
        positive_2T = hist_2J.flip(1).cumsum(1).flip(1)[:, 1:]
        negative_2T = hist_2J.sum(1, keepdim=True) - positive_2T
        confmat_T22 = torch.stack([torch.stack([negative_2T[0], positive_2T[0]], 1),   # label 0: tn, fp
                                   torch.stack([negative_2T[1], positive_2T[1]], 1)], 1)  # label 1: fn, tp
        self.confmat += confmat_T22.to(self.confmat.dtype)

    def compute(self) -> Tensor:  # states are synced over ranks before this runs
        if int(self.bad_labels):
            raise _label_error(int(self.bad_labels), None, "BinnedAUC.compute")
        if int(self.bad_preds):
            raise _prob_error(int(self.bad_preds), None, "BinnedAUC.compute")
        counts = self.confmat[0]  # [label, prediction] at the first threshold: every sample once
        nan = _one_class_nan(float(counts[1].sum()), float(counts[0].sum()), "BinnedAUC")
        if nan is not None:
            return nan
        if int(self.nan_preds):
            warnings.warn(f"BinnedAUC: {int(self.nan_preds)} predictions are NaN (a diverged model?), so the AUC is "
                          f"undefined: NaN", stacklevel=2)
            return torch.tensor(float("nan"), dtype=torch.float64)
        return super().compute().double()


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


_METRICS = {"auc": AUC, "binned_auc": BinnedAUC, "ne": NormalizedEntropy, "logloss": LogLoss, "ctr": CTR}


class RecMetricCollection(MetricCollection):
    """AUC, NE, log loss and CTR, updated together; log them from a LightningModule.

    ```python
    self.val_metrics = RecMetricCollection(prefix="val/")           # in __init__
    self.val_metrics.update(logits_B, batch.labels)                 # in validation_step
    self.val_metrics.log_to(self)                                   # same step: epoch values, prog bar
    ```
    Lightning then computes each metric over the epoch (all ranks) and resets it.
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
