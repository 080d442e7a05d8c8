"""Per-task metrics with TorchRec's definitions (`torchrec.metrics`): NE, log loss, CTR, calibration, AUC (exact and
binned), grouped AUC, AUPRC, MSE / MAE / RMSE, throughput (docs/metrics.md). Each is a torchmetrics `Metric` synced
across ranks whose compute() gives one value per task, shape [T].

Shapes: B rows in one update, T tasks, N rows in all (every update, every rank), G groups, U distinct scores.
update(preds, labels, weights=None, mask=None, groups=None): preds and labels [B, T] (or [B] for one task), weights
[B] or [B, T], mask [B, T] (0 = no label), groups [B] (GAUC). A NaN label or a mask of 0 leaves the row out of that
task (weight 0, never read as a 0 label). Bad labels are counted on the device and raised at compute, naming the
task: update never reads the device, so a training step can update every batch without a host sync."""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from lightning_rec.errors import short_list

ETA = 1e-12  # TorchRec's clamp on probabilities and counts (ne.py)


@dataclass(frozen=True)
class RecTaskInfo:
    """One task, as TorchRec's `torchrec.metrics.RecTaskInfo`: where its label, prediction and weight are found in a
    model's output dict (`TaskMetrics.update_from`)."""

    name: str = "DefaultTask"
    label_name: str = "label"
    prediction_name: str = "prediction"
    weight_name: str = "weight"


def task_infos(tasks: str | RecTaskInfo | Sequence[str | RecTaskInfo] | int) -> tuple[RecTaskInfo, ...]:
    """Task names, RecTaskInfos, or a count (tasks named task0, task1, ...) -> RecTaskInfos, names unique."""
    if isinstance(tasks, int) and not isinstance(tasks, bool):
        tasks = [f"task{t}" for t in range(tasks)]
    elif isinstance(tasks, (str, RecTaskInfo)):
        tasks = [tasks]
    infos = tuple(t if isinstance(t, RecTaskInfo) else RecTaskInfo(name=t) for t in tasks)
    names = [t.name for t in infos]
    if not infos or any(not isinstance(n, str) or not n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"tasks={tasks!r}: give one or more distinct task names (or RecTaskInfo), e.g. "
                         f"tasks=['click', 'like']")
    return infos


def _as_BT(x: Tensor, B: int, T: int, what: str, where: str, names: Sequence[str]) -> Tensor:
    given = list(x.shape)  # the message names the shape handed in, not the reshaped one
    if x.dim() == 1 and T == 1:
        x = x.reshape(-1, 1)
    if x.dim() == 1 and x.shape[0] == B and what == "weights":
        x = x.reshape(-1, 1).expand(B, T)
    if tuple(x.shape) != (B, T):
        raise ValueError(f"{where}: {what} of shape {given}: give [B, T] = [{B}, {T}] for tasks "
                         f"{short_list(list(names))}{' (or [B] for one task)' if T == 1 else ''}, one column per task")
    return x


def task_inputs(preds: Tensor, labels: Tensor, weights: Tensor | None, mask: Tensor | None, names: Sequence[str],
                where: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> preds_TB (float64), labels_TB (missing ones 0), weights_TB (missing ones 0), labelled_TB (bool)."""
    T = len(names)
    preds, labels = preds.detach(), labels.detach()
    if preds.dim() == 2 and preds.shape[1] == 1 and T == 1:
        preds = preds.reshape(-1)
    B = labels.shape[0] if labels.dim() >= 1 else 0
    preds_BT = _as_BT(preds, B, T, "predictions", where, names)
    labels_BT = _as_BT(labels, B, T, "labels", where, names).double()
    labelled_BT = ~torch.isnan(labels_BT)
    if mask is not None:
        labelled_BT &= _as_BT(mask.detach(), B, T, "mask", where, names).bool()
    w_BT = torch.ones_like(labels_BT) if weights is None else _as_BT(
        weights.detach(), B, T, "weights", where, names).double()
    w_BT = torch.where(labelled_BT, w_BT, 0.0)
    labels_BT = torch.where(labelled_BT, labels_BT, 0.0)
    return preds_BT.double().T, labels_BT.T, w_BT.T, labelled_BT.T


def read_update(metric, preds: Tensor, target: Tensor | None, labels: Tensor | None, weights: Tensor | None,
                mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A metric's update inputs as [T, B]; a binary metric's bad labels added to its `bad_labels` state and, given
    probabilities, its predictions outside [0, 1] to `bad_preds` (device ops only: raised at compute)."""
    where = f"{type(metric).__name__}.update"
    if (target is None) == (labels is None):
        raise TypeError(f"{where}(preds, target) takes the labels once, as target or labels=")
    p_TB, y_TB, w_TB, labelled_TB = task_inputs(preds, target if labels is None else labels, weights, mask,
                                                metric.tasks, where)
    if metric.binary:
        metric.bad_labels += (labelled_TB & (y_TB != 0) & (y_TB != 1)).sum(1)
        if not metric.from_logits:  # logits read as probabilities would score without an error
            metric.bad_preds += (labelled_TB & ((p_TB < 0) | (p_TB > 1))).sum(1)
    return p_TB, y_TB, w_TB, labelled_TB


def raise_bad_labels(metric) -> None:
    """The error for labels not 0 or 1 seen by a binary metric, or predictions outside [0, 1] given as
    probabilities, naming each task (one host read)."""
    bad_labels, bad_preds = torch.stack([metric.bad_labels, metric.bad_preds]).tolist()
    where = f"{type(metric).__name__}.compute"
    if any(bad_labels):
        named = ", ".join(f"task {n!r}: {b}" for n, b in zip(metric.tasks, bad_labels) if b)
        raise ValueError(f"{where}: labels not 0 or 1 ({named} of them): binary metrics need 0/1 labels; binarize "
                         f"them first (e.g. `(rating >= 4).float()`, or `(labels > 0).float()` for -1/1 labels) or "
                         f"use mse/mae/rmse for a regression task, and mark a missing label NaN (or 0 in mask)")
    if any(bad_preds):
        named = ", ".join(f"task {n!r}: {b}" for n, b in zip(metric.tasks, bad_preds) if b)
        raise ValueError(f"{where}: predictions outside [0, 1] with from_logits=False ({named} of them), so they are "
                         f"not probabilities (logits?): pass from_logits=True (the default) for a model's output "
                         f"before its sigmoid, or apply the sigmoid first")


class TaskMetric(Metric):
    """Base: one value per task. Subclasses give `_update(p_TB, y_TB, w_TB, groups_B)` and `_compute() -> [T]`;
    `binary` ones need 0/1 labels and read predictions as logits (from_logits=True) or probabilities."""

    is_differentiable = False
    full_state_update = False
    binary = True
    name = "metric"

    def __init__(self, tasks: str | RecTaskInfo | Sequence[str | RecTaskInfo] | int = "task", from_logits: bool = True,
                 recalibration_coefficient: float | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.task_infos = task_infos(tasks)
        self.tasks = [t.name for t in self.task_infos]
        self.from_logits = from_logits
        if recalibration_coefficient is not None and not recalibration_coefficient > 0:
            raise ValueError(f"recalibration_coefficient={recalibration_coefficient!r}: give the negative "
                             f"downsampling rate kept, > 0 (0.1 when one negative in 10 was kept)")
        self.recalibration_coefficient = recalibration_coefficient
        T = len(self.tasks)
        self.add_state("bad_labels", default=torch.zeros(T, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("bad_preds", default=torch.zeros(T, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("labelled", default=torch.zeros(T, dtype=torch.float64), dist_reduce_fx="sum")

    def probs(self, p_TB: Tensor) -> Tensor:
        """Probabilities, recalibrated as TorchRec's for negative downsampling: p / (p + (1 - p) / c)."""
        p_TB = torch.sigmoid(p_TB) if self.from_logits else p_TB
        c = self.recalibration_coefficient
        return p_TB if c is None else p_TB / (p_TB + (1.0 - p_TB) / c)

    def update(self, preds: Tensor, target: Tensor | None = None, *, labels: Tensor | None = None,
               weights: Tensor | None = None, mask: Tensor | None = None, groups: Tensor | None = None) -> None:
        p_TB, y_TB, w_TB, labelled_TB = read_update(self, preds, target, labels, weights, mask)
        self.labelled += labelled_TB.sum(1)
        self._update(p_TB, y_TB, w_TB, groups)

    def _update(self, p_TB: Tensor, y_TB: Tensor, w_TB: Tensor, groups_B: Tensor | None) -> None:
        raise NotImplementedError

    def compute(self) -> Tensor:
        raise_bad_labels(self)
        empty = [n for n, c in zip(self.tasks, self.labelled.tolist()) if c == 0]
        if empty:
            warnings.warn(f"{type(self).__name__}: the evaluation set is empty for task(s) {short_list(empty)} (no "
                          f"labelled row was passed to update): NaN for them", UserWarning, stacklevel=2)
        value_T = self._compute().double().reshape(-1)
        return torch.where(self.labelled.to(value_T.device) > 0, value_T, float("nan"))

    def _compute(self) -> Tensor:
        raise NotImplementedError

    def _warn_one_class(self, pos_T: Tensor, neg_T: Tensor, default: str) -> None:
        pos, neg, labelled = pos_T.tolist(), neg_T.tolist(), self.labelled.tolist()
        one = [f"{n!r} (positive weight {p:g}, negative {q:g})" for n, p, q, c in zip(self.tasks, pos, neg, labelled)
               if c and not (p > 0 and q > 0)]
        if one:
            warnings.warn(f"{type(self).__name__}: one class only in task(s) {', '.join(one)}: {default}, as "
                          f"TorchRec gives. Evaluate on a set with both labels", UserWarning, stacklevel=3)


class _SumTaskMetric(TaskMetric):
    """Float64 sums per task; `batch_states` gives one batch's sums and `value` the metric from sums, so the
    windowed version (multitask.py) keeps the same sums for the last N batches."""

    state_names: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for s, shape in self.state_shapes().items():
            self.add_state(s, default=torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {s: (len(self.tasks),) for s in self.state_names}

    def batch_states(self, p_TB: Tensor, y_TB: Tensor, w_TB: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    def value(self, states: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError

    def _update(self, p_TB, y_TB, w_TB, groups_B) -> None:
        for s, v in self.batch_states(p_TB, y_TB, w_TB).items():
            getattr(self, s).add_(v)

    def _compute(self) -> Tensor:
        return self.value({s: getattr(self, s) for s in self.state_shapes()})


class TaskNE(_SumTaskMetric):
    """Normalized entropy: cross-entropy over that of the weighted click rate (TorchRec's ne.py, eta clamps)."""

    name, higher_is_better = "ne", False
    state_names = ("cross_entropy_sum", "weighted_num_samples", "pos_labels", "neg_labels")

    def batch_states(self, p_TB, y_TB, w_TB):
        p_TB = self.probs(p_TB).clamp(ETA, 1 - ETA)
        # TorchRec's -w y log p - w (1 - y) log(1 - p) for 0/1 labels, in one log (each is a parallel kernel)
        ce_TB = -w_TB * torch.log(torch.where(y_TB == 1, p_TB, 1.0 - p_TB))
        return {"cross_entropy_sum": ce_TB.sum(1), "weighted_num_samples": w_TB.sum(1),
                "pos_labels": (w_TB * y_TB).sum(1), "neg_labels": (w_TB * (1.0 - y_TB)).sum(1)}

    def value(self, s):
        mean = (s["pos_labels"] / s["weighted_num_samples"].clamp(min=ETA)).clamp(ETA, 1 - ETA)
        norm = -s["pos_labels"] * torch.log(mean) - s["neg_labels"] * torch.log(1.0 - mean)
        return s["cross_entropy_sum"] / norm

    def _compute(self):
        self._warn_one_class(self.pos_labels, self.neg_labels, "NE is that of a click rate clamped to 1e-12")
        return super()._compute()


class TaskLogLoss(TaskNE):
    """Weighted mean binary cross-entropy in nats (TorchRec's logloss is the same in bits: times 1 / ln 2)."""

    name = "logloss"

    def value(self, s):
        return s["cross_entropy_sum"] / (s["pos_labels"] + s["neg_labels"]).clamp(min=ETA)

    def _compute(self):
        return _SumTaskMetric._compute(self)


class TaskCTR(_SumTaskMetric):
    """Weighted mean label (TorchRec's ctr.py)."""

    name, higher_is_better = "ctr", None
    state_names = ("ctr_num", "ctr_denom")

    def batch_states(self, p_TB, y_TB, w_TB):
        return {"ctr_num": (w_TB * y_TB).sum(1), "ctr_denom": w_TB.sum(1)}

    def value(self, s):
        return torch.where(s["ctr_denom"] == 0, 0.0, s["ctr_num"] / s["ctr_denom"])


class TaskCalibration(_SumTaskMetric):
    """Sum of (recalibrated) predicted probabilities / sum of labels, weighted; 0 where no positive (TorchRec's
    calibration.py and calibration_with_recalibration.py). 1 is calibrated."""

    name, higher_is_better = "calibration", None
    state_names = ("calibration_num", "calibration_denom")

    def batch_states(self, p_TB, y_TB, w_TB):
        return {"calibration_num": (self.probs(p_TB) * w_TB).sum(1), "calibration_denom": (y_TB * w_TB).sum(1)}

    def value(self, s):
        denom = s["calibration_denom"]
        return torch.where(denom <= 0, 0.0, s["calibration_num"] / denom)


class TaskMSE(_SumTaskMetric):
    """Weighted mean squared error of raw predictions (a regression task: any real label; TorchRec's mse.py)."""

    name, higher_is_better, binary = "mse", False, False
    state_names = ("error_sum", "weighted_num_samples")

    def batch_states(self, p_TB, y_TB, w_TB):
        return {"error_sum": (w_TB * (y_TB - p_TB).square()).sum(1), "weighted_num_samples": w_TB.sum(1)}

    def value(self, s):
        n = s["weighted_num_samples"]
        return torch.where(n == 0, 0.0, s["error_sum"] / n)


class TaskRMSE(TaskMSE):
    name = "rmse"

    def value(self, s):
        return super().value(s).sqrt()


class TaskMAE(TaskMSE):
    """Weighted mean absolute error (TorchRec's mae.py)."""

    name = "mae"

    def batch_states(self, p_TB, y_TB, w_TB):
        return {"error_sum": (w_TB * (y_TB - p_TB).abs()).sum(1), "weighted_num_samples": w_TB.sum(1)}


class TaskBinnedAUC(_SumTaskMetric):
    """ROC AUC from weighted histograms of probabilities in `num_bins` equal bins per task (fixed memory, ties
    within a bin count 1/2): the windowed AUC. 0.5 for a one-class task."""

    name, higher_is_better = "binned_auc", True

    def __init__(self, *args, num_bins: int = 1000, **kwargs) -> None:
        if not isinstance(num_bins, int) or num_bins < 2:
            raise ValueError(f"num_bins={num_bins!r}: give an int >= 2 (1000 is typical)")
        self.num_bins = num_bins
        super().__init__(*args, **kwargs)

    def state_shapes(self):
        T = len(self.tasks)
        return {"pos_hist": (T, self.num_bins), "neg_hist": (T, self.num_bins), "nan_preds": (T,)}

    def batch_states(self, p_TB, y_TB, w_TB):
        T, nb = p_TB.shape[0], self.num_bins
        nan_TB = torch.isnan(p_TB) & (w_TB > 0)  # counted: in the top bin they would give an AUC that looks valid
        bin_TB = (self.probs(p_TB).nan_to_num(1.0) * nb).long().clamp(0, nb - 1)
        bin_TB = bin_TB + torch.arange(T, device=p_TB.device).unsqueeze(1) * nb  # one histogram per task
        # index_add, not bincount: CUDA's bincount reads the largest index back to the host (a sync per batch)
        def hist(v_TB: Tensor) -> Tensor:
            return v_TB.new_zeros(T * nb).index_add_(0, bin_TB.reshape(-1), v_TB.reshape(-1)).view(T, nb)
        return {"pos_hist": hist(w_TB * y_TB), "neg_hist": hist(w_TB * (1 - y_TB)),
                "nan_preds": nan_TB.sum(1, dtype=torch.float64)}

    def value(self, s):
        pos, neg = s["pos_hist"], s["neg_hist"]
        below = neg.cumsum(1) - neg
        area = (pos * (below + 0.5 * neg)).sum(1)
        pn = pos.sum(1) * neg.sum(1)
        auc = torch.where(pn > 0, area / pn.clamp(min=ETA), 0.5)
        return torch.where(s["nan_preds"] > 0, float("nan"), auc)

    def _compute(self):
        self._warn_one_class(self.pos_hist.sum(1), self.neg_hist.sum(1), "AUC 0.5")
        warn_nan_scores(self, self.nan_preds)
        return super()._compute()


class TaskCalibrationCurve(_SumTaskMetric):
    """Predicted vs observed rate by prediction bucket, per task: `num_buckets` equal buckets of the (recalibrated)
    probability, each with its weighted sum of predictions, of labels and of weights (float64 sums, synced over
    ranks). compute() gives [T, num_buckets, 3]: the bucket's mean prediction, its observed rate (weighted mean
    label) and its weight; NaN for a bucket no row fell in. A calibrated model's points lie on the diagonal."""

    name, higher_is_better = "calibration_curve", None

    def __init__(self, *args, num_buckets: int = 20, **kwargs) -> None:
        if not isinstance(num_buckets, int) or num_buckets < 1:
            raise ValueError(f"num_buckets={num_buckets!r}: give an int >= 1 (e.g. 20)")
        self.num_buckets = num_buckets
        super().__init__(*args, **kwargs)

    def state_shapes(self):
        return {s: (len(self.tasks), self.num_buckets) for s in ("bucket_pred", "bucket_label", "bucket_weight")}

    def batch_states(self, p_TB, y_TB, w_TB):
        T, nb = p_TB.shape[0], self.num_buckets
        p_TB = self.probs(p_TB)
        bucket_TB = (p_TB.nan_to_num(1.0) * nb).long().clamp(0, nb - 1)
        bucket_TB = bucket_TB + torch.arange(T, device=p_TB.device).unsqueeze(1) * nb  # one row of buckets per task

        def sums(v_TB: Tensor) -> Tensor:  # index_add: no host read (as the binned AUC's)
            return v_TB.new_zeros(T * nb).index_add_(0, bucket_TB.reshape(-1), v_TB.reshape(-1)).view(T, nb)
        return {"bucket_pred": sums(w_TB * p_TB), "bucket_label": sums(w_TB * y_TB), "bucket_weight": sums(w_TB)}

    def compute(self) -> Tensor:
        raise_bad_labels(self)
        w = self.bucket_weight
        rates = torch.stack([self.bucket_pred / w, self.bucket_label / w, w], -1)
        return torch.where((w > 0).unsqueeze(-1), rates, float("nan"))


def weighted_auc(scores_N: Tensor, labels_N: Tensor, weights_N: Tensor) -> Tensor:
    """P(positive scored above negative) + 1/2 P(tie), each pair weighted by w_pos * w_neg; 0.5 if one class.
    Without ties this is TorchRec's trapezoid over the weighted ROC curve (auc.py)."""
    _, tie_N = torch.unique(scores_N, sorted=True, return_inverse=True)
    U = int(tie_N.max()) + 1 if tie_N.numel() else 0
    pos_U = torch.zeros(U, dtype=torch.float64, device=scores_N.device).index_add_(0, tie_N, weights_N * labels_N)
    neg_U = torch.zeros(U, dtype=torch.float64, device=scores_N.device).index_add_(
        0, tie_N, weights_N * (1 - labels_N))
    pn = pos_U.sum() * neg_U.sum()
    area = (pos_U * (neg_U.cumsum(0) - 0.5 * neg_U)).sum()
    return torch.where(pn > 0, area / pn.clamp(min=ETA), 0.5)


def weighted_auprc(scores_N: Tensor, labels_N: Tensor, weights_N: Tensor) -> Tensor:
    """TorchRec's AUPRC (auprc.py): precision over recall at every distinct score, Riemann sum."""
    order = torch.argsort(scores_N, descending=True)
    s, y, w = scores_N[order], labels_N[order], weights_N[order]
    last = F.pad(s.diff() != 0, [0, 1], value=True)
    tp, fp = torch.cumsum(w * y, 0)[last], torch.cumsum(w * (1 - y), 0)[last]
    precision = torch.cat([(tp / (tp + fp)).flip(0), tp.new_ones(1)])
    recall = torch.cat([(tp / tp[-1]).flip(0), tp.new_zeros(1)])
    recall = torch.nan_to_num(recall, 1.0) if bool(torch.isnan(recall[0])) else recall
    return -torch.sum((recall[1:] - recall[:-1]) * precision[:-1])


def warn_nan_scores(metric, nan_T: Tensor) -> None:
    """NaN predictions sort as the top score, so a rank metric of them would look valid: it is NaN, said here."""
    counts = nan_T.tolist()
    if any(counts):
        named = ", ".join(f"task {n!r}: {int(c)}" for n, c in zip(metric.tasks, counts) if c)
        warnings.warn(f"{type(metric).__name__}: predictions are NaN ({named} of them; a diverged model?), so the "
                      f"{metric.name} is undefined: NaN for those tasks", UserWarning, stacklevel=3)


class _ListTaskMetric(TaskMetric):
    """Keeps every labelled row (cat over ranks at compute): exact AUC, AUPRC, GAUC."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for s in ("preds_NT", "labels_NT", "weights_NT", "groups_N"):
            self.add_state(s, default=[], dist_reduce_fx="cat")

    def _update(self, p_TB, y_TB, w_TB, groups_B) -> None:
        self.preds_NT.append(p_TB.T.float())  # float32 as the single-task AUC: half the memory
        self.labels_NT.append(y_TB.T.float())
        self.weights_NT.append(w_TB.T.float())
        if groups_B is not None:
            self.groups_N.append(groups_B.detach().reshape(-1).long())

    def _rows(self) -> tuple[Tensor, Tensor, Tensor]:
        def cat(s):  # (a synced state with no row on any rank is a flat empty tensor: reshaped to [0, T])
            state = getattr(self, s)
            return dim_zero_cat(state).double().reshape(-1, len(self.tasks)) if not isinstance(state, list) or state \
                else None
        p, y, w = cat("preds_NT"), cat("labels_NT"), cat("weights_NT")
        if p is None:
            p = y = w = torch.zeros(0, len(self.tasks), dtype=torch.float64)
        return p, y, w

    def _per_task(self, fn) -> Tensor:
        p_NT, y_NT, w_NT = self._rows()
        out = []
        for t in range(len(self.tasks)):
            keep = w_NT[:, t] > 0
            out.append(fn(p_NT[keep, t], y_NT[keep, t], w_NT[keep, t]) if bool(keep.any()) else torch.tensor(0.5))
        self._warn_one_class((y_NT * w_NT).sum(0), ((1 - y_NT) * w_NT).sum(0), "AUC 0.5" if
                             self.name == "auc" else "AUPRC by its formula")
        value_T = torch.stack([o.double().reshape(()) for o in out])
        nan_T = (torch.isnan(p_NT) & (w_NT > 0)).sum(0)
        warn_nan_scores(self, nan_T)
        return torch.where(nan_T.to(value_T.device) > 0, float("nan"), value_T)


class TaskAUC(_ListTaskMetric):
    """Exact weighted ROC AUC per task (ties count 1/2; TorchRec's auc.py where no score ties). 0.5 if one class."""

    name, higher_is_better = "auc", True

    def _compute(self):
        return self._per_task(weighted_auc)


class TaskAUPRC(_ListTaskMetric):
    """Area under the weighted precision-recall curve per task (TorchRec's auprc.py). Logits and probabilities give
    the same value."""

    name, higher_is_better = "auprc", True

    def _compute(self):
        return self._per_task(weighted_auprc)


class TaskGAUC(_ListTaskMetric):
    """Grouped AUC: the AUC of each group (user or request id, passed as `groups` to update), averaged over the
    groups that can be scored (both labels, two different predictions), weighted by the group's impressions (its
    summed row weights; `group_weighting="uniform"` is TorchRec's gauc.py, one vote per group). After compute,
    `scored_groups` / `num_groups` say how many groups each task could score."""

    name, higher_is_better = "gauc", True

    def __init__(self, *args, group_weighting: str = "impressions", **kwargs) -> None:
        if group_weighting not in ("impressions", "uniform"):
            raise ValueError(f"group_weighting={group_weighting!r}: 'impressions' (rows in the group) or 'uniform' "
                             f"(TorchRec's GAUC)")
        super().__init__(*args, **kwargs)
        self.group_weighting = group_weighting
        self.scored_groups: list[int] = []
        self.num_groups: list[int] = []

    def update(self, preds, target=None, *, labels=None, weights=None, mask=None, groups=None) -> None:
        if groups is None or groups.reshape(-1).shape[0] != preds.shape[0]:
            got = "none" if groups is None else f"shape {list(groups.shape)}"
            raise ValueError(f"TaskGAUC.update: groups (one user or request id per row, shape [{preds.shape[0]}]) "
                             f"are needed, got {got}")
        super().update(preds, target, labels=labels, weights=weights, mask=mask, groups=groups)

    def _compute(self):
        p_NT, y_NT, w_NT = self._rows()
        g_N = dim_zero_cat(self.groups_N) if not isinstance(self.groups_N, list) or self.groups_N else \
            torch.zeros(0, dtype=torch.long)
        values, self.scored_groups, self.num_groups = [], [], []
        for t in range(len(self.tasks)):
            keep = w_NT[:, t] > 0
            auc, scored, num = _group_auc(p_NT[keep, t], y_NT[keep, t], w_NT[keep, t], g_N[keep],
                                          self.group_weighting)
            values.append(auc)
            self.scored_groups.append(scored)
            self.num_groups.append(num)
        unscored = [f"{n!r}: {s} of {g}" for n, s, g in zip(self.tasks, self.scored_groups, self.num_groups) if s < g]
        if unscored:
            warnings.warn(f"TaskGAUC: groups scored ({', '.join(unscored)}); a group is scored when it has both a "
                          f"positive and a negative label and two different predictions (a group of one row never "
                          f"is). With none scored GAUC is 0.5, as TorchRec gives", UserWarning, stacklevel=2)
        nan_T = (torch.isnan(p_NT) & (w_NT > 0)).sum(0)
        warn_nan_scores(self, nan_T)
        return torch.where(nan_T > 0, float("nan"), torch.stack(values))


def _group_auc(s_N: Tensor, y_N: Tensor, w_N: Tensor, g_N: Tensor, weighting: str) -> tuple[Tensor, int, int]:
    """(GAUC, groups scored, groups) over rows sorted by (group, score), tied scores in a group counting 1/2."""
    if not s_N.numel():
        return torch.tensor(0.5, dtype=torch.float64), 0, 0
    order = torch.argsort(s_N, stable=True)
    order = order[torch.argsort(g_N[order], stable=True)]
    s, y, w, g = s_N[order], y_N[order], w_N[order], g_N[order]
    new_group = F.pad(g.diff() != 0, [1, 0], value=True)
    group_N = new_group.cumsum(0) - 1
    tie_N = (new_group | F.pad(s.diff() != 0, [1, 0], value=True)).cumsum(0) - 1
    G, U = int(group_N[-1]) + 1, int(tie_N[-1]) + 1
    zeros = lambda n: torch.zeros(n, dtype=torch.float64, device=s.device)  # noqa: E731
    pos_U, neg_U = zeros(U).index_add_(0, tie_N, w * y), zeros(U).index_add_(0, tie_N, w * (1 - y))
    group_U = torch.zeros(U, dtype=torch.long, device=s.device).index_copy_(0, tie_N, group_N)
    cum_neg_U = neg_U.cumsum(0)
    start_neg_G = (cum_neg_U - neg_U)[F.pad(group_U.diff() != 0, [1, 0], value=True)]  # at each group's first tie
    below_U = cum_neg_U - neg_U - start_neg_G[group_U]
    area_G = zeros(G).index_add_(0, group_U, pos_U * (below_U + 0.5 * neg_U))
    pos_G, neg_G = zeros(G).index_add_(0, group_U, pos_U), zeros(G).index_add_(0, group_U, neg_U)
    ties_G = torch.zeros(G, dtype=torch.long, device=s.device).index_add_(0, group_U, torch.ones_like(group_U))
    scored_G = (pos_G > 0) & (neg_G > 0) & (ties_G > 1)
    vote_G = (pos_G + neg_G) if weighting == "impressions" else torch.ones_like(pos_G)
    vote_G = torch.where(scored_G, vote_G, 0.0)
    auc_G = area_G / (pos_G * neg_G).clamp(min=ETA)
    total = vote_G.sum()
    gauc = torch.where(total > 0, (vote_G * auc_G).sum() / total.clamp(min=ETA), 0.5)
    return gauc, int(scored_G.sum()), G


class Throughput(Metric):
    """Samples per second summed over ranks, from the first update to the last (the first batch's time is not
    seen, so its samples are not counted). update(batch_size) reads only the host clock."""

    is_differentiable, higher_is_better, full_state_update = False, True, False
    name = "throughput"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("samples", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("seconds", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="max")
        self._start: float | None = None

    def update(self, batch_size: int) -> None:
        now = time.perf_counter()
        if self._start is None:
            self._start = now
            return
        self.samples += batch_size
        self.seconds.fill_(now - self._start)

    def compute(self) -> Tensor:
        return torch.where(self.seconds > 0, self.samples / self.seconds.clamp(min=ETA), 0.0)

    def reset(self) -> None:
        super().reset()
        self._start = None


TASK_METRICS = {cls.name: cls for cls in (TaskAUC, TaskBinnedAUC, TaskNE, TaskLogLoss, TaskCTR, TaskCalibration,
                                          TaskGAUC, TaskAUPRC, TaskMSE, TaskMAE, TaskRMSE)}
