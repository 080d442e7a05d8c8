"""MultiTaskModule: several labels per row (`Batch.labels` [B, T]), one sharded sparse part, MMoE / PLE / a shared
bottom, a tower per task; binary tasks train with BCE, regression tasks with MSE, each weighted.

A missing label (NaN) is left out of its task's loss and metrics: each task's loss is the mean over the rows that
label it, and a task no row of the batch labels adds nothing (no division by zero). Metrics are per task, logged as
`val/<task>/<metric>` (`metrics`, chosen in models/eval_metrics.py; by default binary: auc, ne, logloss, ctr;
regression: mse, mae), and `val_loss`, the weighted sum of the tasks' epoch losses."""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lightning_rec.strategy  # noqa: F401  (registers Trainer(strategy="rec"))
from lightning_rec.data.batch import Batch
from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.errors import refuse_non_finite
from lightning_rec.managed_collision import check_managed_collision, managed_collision_tables
from lightning_rec.models.dlrm_module import _per_feature
from lightning_rec.models.eval_metrics import (
    add_calibration_curves,
    check_metric_args,
    group_ids,
    log_calibration_plots,
    task_metrics,
)
from lightning_rec.models.module_hooks import RecModuleHooks
from lightning_rec.models.multitask import MIXES, MultiTaskNet

TASK_TYPES = ("binary", "regression")


class MultiTaskModule(RecModuleHooks, L.LightningModule):
    """Multi-task ranking: `batch` is a lightning_rec.data.Batch with labels [B, T] (columns in `task_names` order).

    Args:
        task_names: the tasks, in the order of the labels' columns (a data module's `label_columns`).
        task_types: "binary" (BCE, logits; default) or "regression" (MSE) per task.
        loss_weights: each task's weight in the loss (default 1 each).
        mix: "shared_bottom", "mmoe" (experts + a gate per task) or "ple" (shared and task experts, progressive
            levels).
        num_embeddings_per_feature: table rows: one int for all features, one per feature, or {feature: rows}.
        embedding_dim: D of every table.
        sparse_feature_names: the KJT keys, one table each (default: the keys of num_embeddings_per_feature).
        dense_in_features: the number of dense inputs (0: sparse features only).
        dense_arch_layer_sizes: the dense inputs' MLP.
        expert_layer_sizes: each expert's MLP (the shared bottom's for mix="shared_bottom").
        num_experts: MMoE's experts.
        num_shared_experts: PLE's shared experts per level.
        num_task_experts: PLE's experts of each task per level.
        num_levels: PLE's levels.
        tower_layer_sizes: each task tower's hidden sizes (a last layer of 1 is added).
        esmm: task 1 is predicted as p(task 0) * p(task 1 | task 0) over every row (both binary; e.g. click, then
            conversion: the conversion label is 0 on rows without a click).
        metrics: the evaluation metrics of each task (lightning_rec.metrics.TASK_METRICS names; each task gets those
            of its kind; None: auc, ne, logloss, ctr / mse, mae), as DLRMModule's (models/eval_metrics.py).
        group_feature: the sparse feature whose id is a row's group (user or request) for "gauc".
        calibration_buckets: buckets of the per-task calibration plot logged to W&B for each validation dataloader
            (0: none).
        managed_collision: raw ids (e.g. MovieLensDataModule(hash_ids=False)'s user_id / item_id) mapped to rows by
            an MCHManagedCollisionModule as big as each table, built with these arguments (as DLRMModule's; {} for the
            defaults); None: ids are rows (docs/managed_collision.md).
        managed_collision_features: the features whose tables read raw ids through a map (None: every feature);
            the others keep their ids as rows.
        sparse_optimizer, sparse_lr, sparse_eps, sparse_weight_decay, dense_optimizer, dense_lr, dense_weight_decay,
        embedding_kernel, warmup_steps, embedding_device: as DLRMModule's."""

    def __init__(self, task_names: list[str] = ("click",), task_types: list[str] | None = None,
                 loss_weights: list[float] | None = None, mix: str = "mmoe",
                 num_embeddings_per_feature: int | list[int] | dict[str, int] = 100_000, embedding_dim: int = 16,
                 sparse_feature_names: list[str] | None = None, dense_in_features: int = 0,
                 dense_arch_layer_sizes: list[int] = (64, 16), expert_layer_sizes: list[int] = (64, 32),
                 num_experts: int = 4, num_shared_experts: int = 2, num_task_experts: int = 1, num_levels: int = 2,
                 tower_layer_sizes: list[int] = (32,), esmm: bool = False, sparse_optimizer: str = "rowwise_adagrad",
                 sparse_lr: float = 0.05, sparse_eps: float = 1e-8, sparse_weight_decay: float = 0.0,
                 dense_optimizer: str = "adam", dense_lr: float = 0.001, dense_weight_decay: float = 0.0,
                 embedding_kernel: str = "auto", warmup_steps: int = 0, embedding_device: str = "cpu",
                 metrics: list[str] | None = None, group_feature: str | None = None,
                 calibration_buckets: int = 20, managed_collision: dict | None = None,
                 managed_collision_features: list[str] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        refuse_non_finite(type(self).__name__, self.hparams)
        self.task_names = [str(t) for t in task_names]
        self.task_types = list(task_types) if task_types is not None else ["binary"] * len(self.task_names)
        weights = list(loss_weights) if loss_weights is not None else [1.0] * len(self.task_names)
        self._check_tasks(mix, weights, esmm)
        self.register_buffer("loss_weights", torch.tensor(weights, dtype=torch.float32), persistent=False)
        self.check_dense_args("MultiTaskModule", dense_optimizer, dense_lr, dense_weight_decay, warmup_steps)
        if isinstance(num_embeddings_per_feature, dict):
            names = list(sparse_feature_names or num_embeddings_per_feature)
            missing = [n for n in names if n not in num_embeddings_per_feature]
            if missing:
                raise ValueError(f"MultiTaskModule: sparse features {missing} have no rows in "
                                 f"num_embeddings_per_feature ({sorted(num_embeddings_per_feature)}): give each "
                                 f"feature its rows")
            sizes = [int(num_embeddings_per_feature[n]) for n in names]
        else:
            if not sparse_feature_names:
                raise ValueError("MultiTaskModule: name the sparse features (sparse_feature_names), or give "
                                 "num_embeddings_per_feature as {feature: rows}")
            names = list(sparse_feature_names)
            sizes = _per_feature(num_embeddings_per_feature, names)
        self.sparse_feature_names = names
        check_metric_args("MultiTaskModule", metrics, group_feature, names, calibration_buckets)
        managed = self._managed_tables(names, managed_collision, managed_collision_features)
        fused = self.fused_config("MultiTaskModule", sparse_optimizer, sparse_lr, sparse_eps, sparse_weight_decay)
        self.check_embedding_device("MultiTaskModule", embedding_device)
        self.check_embedding_kernel("MultiTaskModule", embedding_kernel)
        tables = [EmbeddingBagConfig(name=f"t_{n}", num_embeddings=rows, embedding_dim=embedding_dim, feature_names=[n])
                  for n, rows in zip(names, sizes)]
        ebc = EmbeddingBagCollection(tables, optimizer=fused, kernel=embedding_kernel, device=embedding_device)
        if managed_collision is not None:
            ebc = managed_collision_tables(ebc, managed_collision, managed)
        self.model = MultiTaskNet(ebc, dense_in_features, list(dense_arch_layer_sizes), len(self.task_names), mix,
                                  list(expert_layer_sizes), num_experts, num_shared_experts, num_task_experts,
                                  num_levels, list(tower_layer_sizes), esmm)
        self.binary_mask = [t == "binary" for t in self.task_types]
        # one collection per (split, dataloader, task), made at the epoch start
        self.eval_metrics = nn.ModuleDict()
        # the binary tasks' W&B calibration plots, one per validation dataloader, made at validation start
        self.calibration_curves = nn.ModuleList()

    @staticmethod
    def _managed_tables(names: Sequence[str], managed_collision: dict | None,
                        features: Sequence[str] | None) -> list[str] | None:
        """The tables read through id maps (None: every one), checked before any table is drawn."""
        if managed_collision is None:
            if features is not None:  # raw ids would be read as rows
                raise ValueError(f"MultiTaskModule(managed_collision_features={list(features)}) names the features "
                                 f"that read raw ids, but managed_collision is None: give managed_collision={{}} "
                                 f"(the defaults) too")
            return None
        check_managed_collision(managed_collision)
        if features is None:
            return None
        unknown = [f for f in features if f not in names]
        if unknown or not features:
            said = f"{unknown} are not among" if unknown else "names none of"
            raise ValueError(f"MultiTaskModule(managed_collision_features={list(features)}): {said} the sparse "
                             f"features {list(names)}: name some of them (None: every feature)")
        return [f"t_{f}" for f in features]

    def _check_tasks(self, mix: str, weights: Sequence[float], esmm: bool) -> None:
        names, types = self.task_names, self.task_types
        if not names or len(set(names)) != len(names):
            raise ValueError(f"MultiTaskModule(task_names={names}): give one name per task, each once")
        taken = [n for n in names if n == "row" or (n.endswith("_label") and n[:-len("_label")] in names)]
        if taken:
            raise ValueError(f"MultiTaskModule(task_names={names}): {taken[0]!r} is a column predictions are written "
                             f"with (row: each row's number, <task>_label: a task's label): rename that task")
        if len(types) != len(names) or any(t not in TASK_TYPES for t in types):
            raise ValueError(f"MultiTaskModule(task_types={types}): give one of {', '.join(TASK_TYPES)} per task "
                             f"({len(names)}: {names})")
        if len(weights) != len(names) or any(w < 0 for w in weights):
            raise ValueError(f"MultiTaskModule(loss_weights={list(weights)}): give one weight >= 0 per task "
                             f"({len(names)}: {names})")
        if mix not in MIXES:
            raise ValueError(f"MultiTaskModule(mix={mix!r}): choose one of {', '.join(MIXES)}")
        if esmm and (len(names) < 2 or types[:2] != ["binary", "binary"]):
            raise ValueError(f"MultiTaskModule(esmm=True) predicts task 1 as p(task 0) * p(task 1 | task 0): it needs "
                             f"two binary tasks first, got {list(zip(names, types))[:2]}")

    def setup(self, stage: str) -> None:
        super().setup(stage)
        data = getattr(self.trainer, "datamodule", None)
        self.check_raw_ids(data)
        specs = getattr(data, "label_specs", None)
        if specs is not None:
            self.check_task_names([spec.task for spec in specs], "the data module's label_columns")

    def check_task_names(self, theirs: Sequence[str], what: str) -> None:
        if list(theirs) != self.task_names:
            raise ValueError(f"{what} give tasks {list(theirs)} but the model predicts {self.task_names}: give both "
                             f"the same tasks in the same order (--model.task_names, --data.label_columns)")

    def forward(self, dense_features: Tensor, sparse_features) -> Tensor:
        """[B, T]: logits of binary tasks, values of regression tasks."""
        return self.model(dense_features, sparse_features)

    def _labels(self, batch: Batch) -> Tensor:
        labels = batch.labels
        if labels is None:
            raise ValueError("the batch has no labels: MultiTaskModule trains and evaluates on labelled rows")
        if batch.task_names is not None and tuple(batch.task_names) != tuple(self.task_names):
            self.check_task_names(batch.task_names, "the batch's labels")
        labels_BT = labels.reshape(labels.shape[0], -1) if labels.dim() == 1 else labels
        if labels_BT.dim() != 2 or labels_BT.shape[1] != len(self.task_names):
            raise ValueError(f"labels of shape {tuple(labels.shape)} for {len(self.task_names)} tasks "
                             f"{self.task_names}: give labels [B, {len(self.task_names)}], one column per task")
        if labels_BT.device.type == "cpu" and labels_BT.numel():  # before the forward: the fused update runs in it
            binary_BT = labels_BT[:, torch.tensor(self.binary_mask)]
            bad = ~torch.isnan(binary_BT) & ((binary_BT < 0) | (binary_BT > 1))
            if bool(bad.any()):
                task = [n for n, b in zip(self.task_names, self.binary_mask) if b][int(bad.any(0).nonzero()[0])]
                raise ValueError(f"task {task!r} is binary but its labels include {binary_BT[bad][:3].tolist()}: "
                                 f"binary labels are 0 / 1 (NaN: no label); map them to 0/1, or declare the task "
                                 f"task_types: regression")
        return labels_BT.to(torch.float32)

    def _loss(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(weighted loss, per-task losses [T], outputs [B, T], labels [B, T])."""
        labels_BT = self._labels(batch)
        out_BT = self(batch.dense_features, batch.sparse_features)
        has_BT = ~torch.isnan(labels_BT)
        target_BT = torch.where(has_BT, labels_BT, torch.zeros_like(labels_BT))
        out_f = out_BT.float()
        bce_BT = F.binary_cross_entropy_with_logits(out_f, target_BT.clamp(0, 1), reduction="none")
        binary_T = torch.tensor(self.binary_mask, device=out_BT.device)
        per_row_BT = torch.where(binary_T, bce_BT, (out_f - target_BT) ** 2) * has_BT
        # a task no row labels: 0 / 1, nothing divides by zero
        task_T = per_row_BT.sum(0) / has_BT.sum(0).clamp(min=1)
        return (task_T * self.loss_weights.to(task_T.device)).sum(), task_T, out_BT, labels_BT

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss, task_T, _, _ = self._loss(batch)
        self.log_train_loss(loss, batch_size=max(len(batch), 1))
        for name, value in zip(self.task_names, task_T):
            self.log(f"train/{name}/loss", value, batch_size=max(len(batch), 1))
        return loss

    def _names(self, split: str, k: int) -> tuple[str, str]:
        """(prefix, suffix) of loader k's metrics: the data module's split name where it gives one (MovieLens'
        eval_test_in_fit: val, test), else `split` and Lightning's /dataloader_idx_k."""
        names = getattr(getattr(self.trainer, "datamodule", None), "eval_split_names", None) if split == "val" else None
        names = names() if callable(names) else None
        if names and k < len(names):
            return names[k], ""
        return split, f"/dataloader_idx_{k}" if k else ""

    def _metrics(self, split: str, k: int) -> nn.ModuleDict:
        key = f"{split}_{k}"
        if key not in self.eval_metrics:
            prefix = self._names(split, k)[0]
            metrics = self.hparams.metrics
            self.eval_metrics[key] = nn.ModuleDict(
                {name: task_metrics(name, kind, metrics, f"{prefix}/") for name, kind in zip(self.task_names,
                                                                                             self.task_types)}
            ).to(self.device)
        return self.eval_metrics[key]

    def _evaluation_step(self, split: str, batch: Batch, dataloader_idx: int) -> None:
        _, _, out_BT, labels_BT = self._loss(batch)
        groups_B = group_ids(batch, self.hparams.group_feature)
        for t, metrics in enumerate(self._metrics(split, dataloader_idx).values()):
            metrics.update(out_BT[:, t].float(), labels_BT[:, t], groups=groups_B)
        if split == "val" and dataloader_idx < len(self.calibration_curves):
            binary_T = torch.tensor(self.binary_mask, device=out_BT.device)
            self.calibration_curves[dataloader_idx].update(out_BT[:, binary_T].float(), labels_BT[:, binary_T])

    def _log_evaluation(self, split: str, count: int, prog_bar: bool) -> None:
        for k in range(count):
            prefix, suffix = self._names(split, k)
            total = 0.0
            for t, metrics in enumerate(self._metrics(split, k).values()):
                values = metrics.compute()
                self.log_dict({n + suffix: v for n, v in values.items()}, prog_bar=prog_bar and not k, sync_dist=True,
                              add_dataloader_idx=False)
                name = self.task_names[t]
                loss = values[f"{prefix}/{name}/{'logloss' if self.binary_mask[t] else 'mse'}"]
                total = total + float(self.loss_weights[t]) * torch.nan_to_num(loss.double(), nan=0.0)
                metrics.reset()
            self.log(f"{prefix}_loss{suffix}", total, sync_dist=True, add_dataloader_idx=False)

    @staticmethod
    def _loader_count(batches) -> int:
        return len(batches) if isinstance(batches, (list, tuple)) else 1

    def on_validation_epoch_start(self) -> None:
        count = self._loader_count(self.trainer.num_val_batches)
        for k in range(count):  # every rank, the same (a share may be empty)
            self._metrics("val", k)
        binary = [n for n, b in zip(self.task_names, self.binary_mask) if b]
        add_calibration_curves(self, self.calibration_curves, binary, self.hparams.calibration_buckets, count)

    def validation_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluation_step("val", batch, dataloader_idx)

    def on_validation_epoch_end(self) -> None:
        count = self._loader_count(self.trainer.num_val_batches)
        self._log_evaluation("val", count, prog_bar=True)
        for k, curve in enumerate(self.calibration_curves[:count]):
            prefix, suffix = self._names("val", k)  # as loader k's metrics are named
            log_calibration_plots(self, curve, f"{prefix}/{{task}}/calibration_plot", suffix)

    def on_test_epoch_start(self) -> None:
        for k in range(self._loader_count(self.trainer.num_test_batches)):
            self._metrics("test", k)

    def test_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluation_step("test", batch, dataloader_idx)

    def on_test_epoch_end(self) -> None:
        self._log_evaluation("test", self._loader_count(self.trainer.num_test_batches), prog_bar=False)

    def predict_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        """Each task's prediction (binary: its probability; regression: its value), by task name, then each task's
        label as `<task>_label` (NaN where missing; PredictionWriter leaves out a column NaN in every row)."""
        out_BT = self(batch.dense_features, batch.sparse_features).float()
        out = {name: torch.sigmoid(out_BT[:, t]) if binary else out_BT[:, t]
               for t, (name, binary) in enumerate(zip(self.task_names, self.binary_mask))}
        labels = batch.labels
        if labels is not None and labels.dim() == 2 and labels.shape[1] == len(self.task_names):
            out.update({f"{name}_label": labels[:, t].float() for t, name in enumerate(self.task_names)})
        return out

    def configure_optimizers(self):
        return self.combined_optimizers(self.model)
