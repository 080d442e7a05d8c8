"""Per-task metrics updated together and logged as `<prefix><task>/<metric>` (docs/metrics.md): `TaskMetrics` over
an evaluation epoch, `WindowedTaskMetrics` over the last N training batches.

The windowed sums live on the metric's device in a ring of N slots (one per batch, overwritten in turn): update
writes one slot and never reads the device, so a training step has no host sync until a log step (every k)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_rec.errors import short_list
from lightning_rec.metrics.tasks import (
    TASK_METRICS,
    RecTaskInfo,
    Throughput,
    _SumTaskMetric,
    raise_bad_labels,
    read_update,
    task_infos,
)

# windowed: the metrics kept as sums (the exact AUC keeps every row, so the window's AUC is the binned one)
WINDOWED = {"auc": "binned_auc", "binned_auc": "binned_auc", "ne": "ne", "logloss": "logloss", "ctr": "ctr",
            "calibration": "calibration", "mse": "mse", "mae": "mae", "rmse": "rmse"}


class WindowedTaskMetric(Metric):
    """A sum metric (NE, calibration, binned AUC, ...) over the last `window` updates: its per-batch sums in a ring
    of `window` slots, summed at compute (synced across ranks: sums of rings are rings of sums)."""

    is_differentiable, full_state_update = False, False

    def __init__(self, metric: _SumTaskMetric, window: int = 100, **kwargs) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window={window!r}: give the number of recent batches, an int >= 1 (e.g. 100)")
        super().__init__(**kwargs)
        self.__dict__["inner"] = metric  # its formulas only: its own states stay unused (and unregistered)
        self.tasks, self.binary, self.name, self.window = metric.tasks, metric.binary, metric.name, window
        self.from_logits = metric.from_logits
        T = len(self.tasks)
        self.add_state("bad_labels", default=torch.zeros(T, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("bad_preds", default=torch.zeros(T, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("ring_labelled", default=torch.zeros(window, T, dtype=torch.float64), dist_reduce_fx="sum")
        for s, shape in metric.state_shapes().items():
            self.add_state(f"ring_{s}", default=torch.zeros(window, *shape, dtype=torch.float64),
                           dist_reduce_fx="sum")
        self._slot = 0  # a host counter: which slot the next batch overwrites

    def update(self, preds: Tensor, target: Tensor | None = None, *, labels: Tensor | None = None,
               weights: Tensor | None = None, mask: Tensor | None = None, groups: Tensor | None = None) -> None:
        p_TB, y_TB, w_TB, labelled_TB = read_update(self, preds, target, labels, weights, mask)
        slot = self._slot % self.window
        self.ring_labelled[slot] = labelled_TB.sum(1)
        for s, v in self.inner.batch_states(p_TB, y_TB, w_TB).items():
            getattr(self, f"ring_{s}")[slot] = v
        self._slot += 1

    def compute(self) -> Tensor:
        raise_bad_labels(self)
        value_T = self.inner.value({s: getattr(self, f"ring_{s}").sum(0) for s in self.inner.state_shapes()})
        return torch.where(self.ring_labelled.sum(0) > 0, value_T.double(), float("nan"))

    def reset(self) -> None:
        super().reset()
        self._slot = 0


class TaskMetrics(nn.Module):
    """Per-task metrics updated together; compute() gives `{f"{prefix}{task}/{metric}": value}` (throughput:
    `f"{prefix}throughput"`; tasks=None: one label and the single-task names `f"{prefix}{metric}"`).

    ```python
    self.val_metrics = TaskMetrics(["click", "like"], ["auc", "ne", "calibration", "gauc"])  # in __init__
    self.val_metrics.update(logits_BT, labels_BT, groups=user_ids_B)      # in validation_step
    self.val_metrics.log_to(self)                                        # in on_validation_epoch_end
    ```
    Keyword arguments go to the metrics that take them: from_logits, recalibration_coefficient (binary metrics),
    num_bins (binned_auc), group_weighting (gauc)."""

    def __init__(self, tasks: str | RecTaskInfo | Sequence[str | RecTaskInfo] | int | None,
                 metrics: Sequence[str] = ("auc", "ne", "logloss", "ctr", "calibration"), prefix: str = "val/",
                 **metric_kwargs) -> None:
        super().__init__()
        self.unnamed = tasks is None  # one label, logged under the single-task names: f"{prefix}{metric}"
        self.task_infos = task_infos("task" if tasks is None else tasks)
        self.tasks = [t.name for t in self.task_infos]
        self.prefix = prefix
        names = self._known(metrics)
        self.metrics = nn.ModuleDict({m: self._build(m, metric_kwargs) for m in names})

    def _known(self, metrics: Sequence[str]) -> list[str]:
        metrics = [metrics] if isinstance(metrics, str) else list(metrics)
        choices = [*TASK_METRICS, "throughput"]
        unknown = [m for m in metrics if m not in choices]
        if unknown or not metrics:
            raise ValueError(f"metrics={metrics!r}: unknown {short_list(unknown)}; choose from {choices}")
        return metrics

    def _build(self, name: str, kwargs: dict) -> Metric:
        if name == "throughput":
            return Throughput()
        cls = TASK_METRICS[name]
        own = {"num_bins": cls is TASK_METRICS["binned_auc"], "group_weighting": name == "gauc",
               "recalibration_coefficient": cls.binary, "from_logits": cls.binary}
        return cls(self.task_infos, **{k: v for k, v in kwargs.items() if own.get(k, True)})

    def update(self, preds: Tensor, labels: Tensor, weights: Tensor | None = None, mask: Tensor | None = None,
               groups: Tensor | None = None) -> None:
        """preds and labels [B, T] (or [B] for one task); weights [B] or [B, T]; mask [B, T]; groups [B] (gauc)."""
        for name, metric in self.metrics.items():
            if name == "throughput":
                metric.update(preds.shape[0])
            else:
                metric.update(preds, labels, weights=weights, mask=mask, groups=groups if name == "gauc" else None)

    def update_from(self, model_out: Mapping[str, Tensor], groups: Tensor | None = None) -> None:
        """TorchRec's way: each task's prediction, label and weight read from a dict by its RecTaskInfo names."""
        def column(key: str, required: bool) -> Tensor | None:
            if key not in model_out:
                if not required:
                    return None
                raise KeyError(f"TaskMetrics.update_from: no {key!r} in the model output; it has "
                               f"{short_list(sorted(model_out))}: name the columns in RecTaskInfo(label_name=..., "
                               f"prediction_name=..., weight_name=...)")
            return model_out[key].reshape(-1)

        preds = torch.stack([column(t.prediction_name, True) for t in self.task_infos], 1)
        labels = torch.stack([column(t.label_name, True) for t in self.task_infos], 1)
        weights = [column(t.weight_name, False) for t in self.task_infos]
        weights_BT = None if all(w is None for w in weights) else torch.stack(
            [torch.ones_like(preds[:, 0]) if w is None else w for w in weights], 1)
        self.update(preds, labels, weights=weights_BT, groups=groups)

    def compute(self) -> dict[str, Tensor]:
        out = {}
        for name, metric in self.metrics.items():
            value = metric.compute()
            if name == "throughput":
                out[f"{self.prefix}throughput"] = value
                continue
            for task, v in zip(self.tasks, value.reshape(-1).unbind(0)):  # torchmetrics squeezes one task to a scalar
                out[f"{self.prefix}{name}" if self.unnamed else f"{self.prefix}{task}/{name}"] = v
        return out

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()

    def log_to(self, module, **log_kwargs) -> dict[str, Tensor]:
        """compute() (synced over ranks), `module.log_dict` of it, then reset (call once per epoch)."""
        values = self.compute()
        module.log_dict(values, **log_kwargs)
        self.reset()
        return values


class WindowedTaskMetrics(TaskMetrics):
    """The same over the last `window` training batches, computed every `log_every` updates by `log_to`:

    ```python
    self.train_window = WindowedTaskMetrics(["click", "like"], ["auc", "ne", "calibration"], window=100, log_every=50)
    self.train_window.update(logits_BT.detach(), labels_BT)      # in training_step, every step: no host sync
    self.train_window.log_to(self)                               # same step: logs on every 50th update only
    ```
    "auc" is the binned AUC here (a window keeps sums, not rows); gauc and auprc keep rows and are not windowed."""

    def __init__(self, tasks, metrics: Sequence[str] = ("auc", "ne", "calibration"), prefix: str = "train/window/",
                 window: int = 100, log_every: int = 100, **metric_kwargs) -> None:
        if not isinstance(log_every, int) or isinstance(log_every, bool) or log_every < 1:
            raise ValueError(f"log_every={log_every!r}: give an int >= 1 (updates between logs)")
        self.window, self.log_every, self.updates = window, log_every, 0
        super().__init__(tasks, metrics, prefix, **metric_kwargs)

    def _known(self, metrics):
        metrics = [metrics] if isinstance(metrics, str) else list(metrics)
        refused = [m for m in metrics if m not in WINDOWED and m != "throughput"]
        if refused:
            raise ValueError(f"metrics={metrics!r}: {short_list(refused)} cannot be windowed (they keep every row); "
                             f"windowed metrics: {sorted(WINDOWED)} and throughput")
        return metrics

    def _build(self, name, kwargs):
        if name == "throughput":
            return Throughput()
        return WindowedTaskMetric(super()._build(WINDOWED[name], kwargs), self.window)

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        self.updates += 1

    def log_to(self, module, **log_kwargs) -> dict[str, Tensor] | None:
        """On every `log_every`-th update: compute (the one host sync) and log at this step; else nothing."""
        if self.updates == 0 or self.updates % self.log_every:
            return None
        values = self.compute()
        module.log_dict(values, **{"on_step": True, "on_epoch": False, **log_kwargs})
        return values

    def reset(self) -> None:
        super().reset()
        self.updates = 0
