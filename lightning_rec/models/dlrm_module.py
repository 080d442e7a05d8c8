"""DLRMModule: DLRM / DLRM-DCNv2 as a LightningModule (BCE-with-logits; AUC/NE/logloss/CTR, or the `metrics` chosen).

Every argument is a plain value so that a recipe YAML (LightningCLI) sets it. The embedding tables train with a fused
optimizer (updated inside backward); the dense layers with a torch.optim optimizer; `configure_optimizers` returns both
as one CombinedOptimizer, so a scheduler (here an optional linear warm-up) drives both learning rates."""

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
from lightning_rec.managed_collision import managed_collision_tables
from lightning_rec.models.dlrm import DLRM, DLRM_DCN
from lightning_rec.models.eval_metrics import (
    add_calibration_curves,
    check_metric_args,
    group_ids,
    log_calibration_plots,
    task_metrics,
)
from lightning_rec.models.module_hooks import RecModuleHooks
from lightning_rec.optim import DENSE_OPTIMIZERS  # noqa: F401  (imported from here too)

CRITEO_SPARSE_FEATURES = [f"C{i}" for i in range(1, 27)]


def _per_feature(value: int | Sequence[int], names: Sequence[str]) -> list[int]:
    sizes = [int(value)] * len(names) if isinstance(value, int) else [int(v) for v in value]
    if len(sizes) != len(names):
        raise ValueError(f"num_embeddings_per_feature has {len(sizes)} entries for {len(names)} sparse features "
                         f"({names[:3]}...): give one size per feature, or a single int for all")
    return sizes


class DLRMModule(RecModuleHooks, L.LightningModule):
    """DLRM on click logs: `batch` is a lightning_rec.data.Batch (dense [B, I], KJT, labels [B]).

    Args:
        num_embeddings_per_feature: table rows, one int for all features or one per feature.
        embedding_dim: D, the dim of every table (and of the dense arch's last layer).
        sparse_feature_names: the KJT keys, one table each (default Criteo's C1..C26).
        dense_in_features: I, the number of dense inputs (13 for Criteo).
        dense_arch_layer_sizes: the dense arch's MLP sizes (it ends in embedding_dim).
        over_arch_layer_sizes: the over arch's MLP sizes (it ends in 1).
        interaction: "dot" (DLRM) or "dcn" (DLRM-DCNv2 low-rank cross layers).
        dcn_num_layers: cross layers of interaction="dcn".
        dcn_low_rank_dim: the rank of each cross layer's kernel (interaction="dcn").
        sparse_optimizer: the tables' fused update: sgd, adagrad, rowwise_adagrad, adam, partial_rowwise_adam, lamb
            or lars_sgd (fbgemm's / TorchRec's names too).
        sparse_lr: the fused update's learning rate.
        sparse_eps: the fused update's eps.
        sparse_weight_decay: the fused update's weight decay (of the rows a batch reads).
        dense_optimizer: torch.optim for the dense layers: adagrad, adam, adamw or sgd (--optimizer replaces it).
        dense_lr: the dense optimizer's learning rate.
        dense_weight_decay: the dense optimizer's weight decay.
        embedding_kernel: "auto" | "fbgemm" | "native" (CPU) for the fused tables.
        warmup_steps: linear learning-rate warm-up of both parts (0 = none).
        embedding_device: "cpu", or "meta": no values until Trainer(strategy="rec") shards them, each shard drawn
            where it lives (tables larger than host memory).
        metrics: the evaluation metrics, lightning_rec.metrics.TASK_METRICS names (e.g. [auc, ne, logloss,
            calibration, auprc, gauc]), logged as val_<metric>: the configuration and the metrics MultiTaskModule
            takes (models/eval_metrics.py). None: val_auc, val_ne, val_logloss, val_ctr.
        group_feature: the sparse feature whose id is a row's group (user or request) for "gauc".
        calibration_buckets: buckets of the calibration plot logged to W&B for each validation dataloader (0:
            none).
        managed_collision: raw ids (e.g. CriteoDataModule(hash_ids=False)) remapped per table by an
            MCHManagedCollisionModule as big as the table, built with these arguments ({"eviction_policy": "lfu",
            "eviction_interval": 100, "min_count_to_admit": 2}; {} for the defaults); None: ids are rows
            (docs/managed_collision.md)."""

    def __init__(self, num_embeddings_per_feature: int | list[int] = 100_000, embedding_dim: int = 64,
                 sparse_feature_names: list[str] | None = None, dense_in_features: int = 13,
                 dense_arch_layer_sizes: list[int] = (512, 256, 64),
                 over_arch_layer_sizes: list[int] = (512, 512, 256, 1), interaction: str = "dot",
                 dcn_num_layers: int = 3, dcn_low_rank_dim: int = 64, sparse_optimizer: str = "rowwise_adagrad",
                 sparse_lr: float = 0.01, sparse_eps: float = 1e-8, sparse_weight_decay: float = 0.0,
                 dense_optimizer: str = "adagrad", dense_lr: float = 0.01, dense_weight_decay: float = 0.0,
                 embedding_kernel: str = "auto", warmup_steps: int = 0, embedding_device: str = "cpu",
                 metrics: list[str] | None = None, group_feature: str | None = None,
                 calibration_buckets: int = 20, managed_collision: dict | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        refuse_non_finite(type(self).__name__, self.hparams)
        names = list(sparse_feature_names or CRITEO_SPARSE_FEATURES)
        check_metric_args("DLRMModule", metrics, group_feature, names, calibration_buckets)
        self.check_dense_args("DLRMModule", dense_optimizer, dense_lr, dense_weight_decay, warmup_steps)
        if interaction not in ("dot", "dcn"):
            raise ValueError(f"unknown interaction {interaction!r}: choose dot (DLRM) or dcn (DLRM-DCNv2)")
        if interaction == "dot" and (dcn_num_layers, dcn_low_rank_dim) != (3, 64):
            # a recipe's dcn_* without `interaction: dcn` would train the dot model
            raise ValueError(f"DLRMModule(dcn_num_layers={dcn_num_layers}, dcn_low_rank_dim={dcn_low_rank_dim}) with "
                             f"interaction='dot': the cross layers are built for interaction='dcn' only: set "
                             f"interaction: dcn (--model.interaction=dcn), or leave the dcn_* arguments out")
        # the layer sizes are checked before the tables are drawn (26 x 40M rows take minutes and most of the memory)
        dense_sizes, over_sizes = list(dense_arch_layer_sizes), list(over_arch_layer_sizes)
        if not dense_sizes or dense_sizes[-1] != embedding_dim:
            raise ValueError(f"dense_arch_layer_sizes={dense_sizes} must end in embedding_dim={embedding_dim} (the "
                             f"dense vector meets the embeddings in the interaction): make the last size "
                             f"{embedding_dim}")
        if not over_sizes or over_sizes[-1] != 1:
            raise ValueError(f"over_arch_layer_sizes={over_sizes} must end in 1: DLRMModule predicts one click logit "
                             f"per sample (BCE); make the last size 1")
        tables = [
            EmbeddingBagConfig(name=f"t_{name}", num_embeddings=rows, embedding_dim=embedding_dim, feature_names=[name])
            for name, rows in zip(names, _per_feature(num_embeddings_per_feature, names))
        ]
        fused = self.fused_config("DLRMModule", sparse_optimizer, sparse_lr, sparse_eps, sparse_weight_decay)
        self.check_embedding_device("DLRMModule", embedding_device)
        self.check_embedding_kernel("DLRMModule", embedding_kernel)
        ebc = EmbeddingBagCollection(tables, optimizer=fused, kernel=embedding_kernel, device=embedding_device)
        if managed_collision is not None:
            ebc = managed_collision_tables(ebc, managed_collision)
        if interaction == "dcn":
            self.model = DLRM_DCN(ebc, dense_in_features, dense_sizes, over_sizes, dcn_num_layers, dcn_low_rank_dim)
        else:
            self.model = DLRM(ebc, dense_in_features, dense_sizes, over_sizes)
        self.val_metrics = task_metrics(None, "binary", metrics, "val_")
        self.test_metrics = task_metrics(None, "binary", metrics, "test_")
        # the W&B calibration plots', one per validation dataloader, made at validation start (none without W&B)
        self.calibration_curves = nn.ModuleList()
        # the second and later evaluation dataloaders' own metrics ("val_1", ...), made at the epoch start
        self.more_eval_metrics = nn.ModuleDict()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        data = getattr(self.trainer, "datamodule", None)
        self.check_raw_ids(data)
        self._check_data_sizes(data)

    def _check_data_sizes(self, data) -> None:
        """The data module's id ranges against the tables' rows, named before any batch."""
        theirs = getattr(data, "hparams", {}).get("num_embeddings_per_feature")
        ours = self.hparams.num_embeddings_per_feature
        if theirs is None or theirs == ours or self.hparams.get("managed_collision") is not None:  # raw ids: any range
            return
        names = list(self.hparams.sparse_feature_names or CRITEO_SPARSE_FEATURES)
        try:
            pairs = list(zip(names, _per_feature(theirs, names), _per_feature(ours, names)))
        except ValueError:
            return  # another feature list: the batch check names the features
        over = [(name, d, m) for name, d, m in pairs if d > m]
        if over:
            name, d, m = over[0]
            raise ValueError(
                f"the data module draws feature {name}'s ids from {d} values but the model's table for it has {m} "
                f"rows ({len(over)} feature(s) like it): give both the same sizes, --data.num_embeddings_per_feature "
                f"and --model.num_embeddings_per_feature (`lightning-rec preprocess` prints them)")

    def forward(self, dense_features: Tensor, sparse_features) -> Tensor:
        """Click logits [B] (not probabilities: torch.sigmoid of them is what predict_step writes)."""
        return self.model(dense_features, sparse_features).squeeze(1)

    def _loss(self, batch: Batch) -> tuple[Tensor, Tensor]:
        labels = batch.labels
        if labels is None:
            raise ValueError("the batch has no labels: DLRMModule trains and evaluates on labelled click logs; an "
                             "unlabelled file (e.g. Kaggle's test.txt) can only be used for prediction")
        if labels.device.type == "cpu" and labels.numel() and not bool(((labels >= 0) & (labels <= 1)).all()):
            # checked before the forward (CPU batches only): a NaN loss would write NaN rows
            bad = labels[~((labels >= 0) & (labels <= 1))][:3].tolist()
            raise ValueError(f"labels must be click labels in [0, 1], found {bad}: an unlabelled file (NaN labels) "
                             f"or labels on another scale; fix the data or map labels to 0/1")
        if labels.dim() > 2 or labels.numel() != batch.sparse_features.stride():
            # before the forward: the fused update in backward must not run for a batch whose loss cannot be formed
            raise ValueError(f"labels of shape {tuple(labels.shape)} for a batch of {batch.sparse_features.stride()} "
                             f"samples: give one label per sample (shape [B])")
        logits_B = self(batch.dense_features, batch.sparse_features)
        if batch.labels.numel() == 0:
            # An empty batch still runs backward (the fused kernels see zero rows): a zero loss, not NaN.
            return logits_B.sum() * 0.0, logits_B
        # integer / bool labels and a [B, 1] column too; float32 at least, for soft labels under bf16
        labels_B = labels.reshape(-1).to(torch.promote_types(logits_B.dtype, torch.float32))
        return F.binary_cross_entropy_with_logits(logits_B, labels_B), logits_B

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss, _ = self._loss(batch)
        self.log_train_loss(loss, batch_size=max(len(batch), 1))
        return loss

    def _loader_metrics(self, split: str, count: int | None = None) -> list[nn.Module]:
        """One metric collection per evaluation dataloader: the first keeps the plain names (val_auc), loader k >= 1
        logs val_auc/dataloader_idx_k (Lightning's naming)."""
        first = self.val_metrics if split == "val" else self.test_metrics
        if count is not None:  # at the epoch start, the same on every rank (a rank's empty share still syncs)
            for k in range(1, count):
                if f"{split}_{k}" not in self.more_eval_metrics:
                    self.more_eval_metrics[f"{split}_{k}"] = task_metrics(None, "binary", self.hparams.metrics,
                                                                          f"{split}_").to(self.device)
        more = sorted((int(key.split("_")[1]), m) for key, m in self.more_eval_metrics.items()
                      if key.startswith(f"{split}_"))
        return [first] + [m for _, m in more]

    def _evaluation_step(self, split: str, batch: Batch, dataloader_idx: int) -> None:
        _, logits_B = self._loss(batch)
        labels_B = batch.labels.reshape(logits_B.shape)
        self._loader_metrics(split)[dataloader_idx].update(logits_B, labels_B,
                                                           groups=group_ids(batch, self.hparams.group_feature))
        if split == "val" and dataloader_idx < len(self.calibration_curves):
            self.calibration_curves[dataloader_idx].update(logits_B.float(), labels_B)

    def _log_evaluation(self, split: str, count: int, prog_bar: bool) -> None:
        # compute() already covers every rank's samples (torchmetrics syncs); sync_dist averages equal values
        for k, metrics in enumerate(self._loader_metrics(split)[:count]):
            suffix = self._suffix(k)
            values = metrics.compute()
            self.log_dict({name + suffix: v for name, v in values.items()}, prog_bar=prog_bar and not k,
                          sync_dist=True, add_dataloader_idx=False)
            # {split}_loss is the log loss metric, exact at any world size (Lightning's per-batch sync is not)
            self.log(f"{split}_loss{suffix}", values[f"{split}_logloss"], sync_dist=True, add_dataloader_idx=False)
            metrics.reset()

    @staticmethod
    def _loader_count(batches) -> int:
        return len(batches) if isinstance(batches, (list, tuple)) else 1

    @staticmethod
    def _suffix(k: int) -> str:
        """Loader k's suffix to its logged names: the first keeps the plain names (Lightning's naming)."""
        return f"/dataloader_idx_{k}" if k else ""

    def on_validation_epoch_start(self) -> None:
        count = self._loader_count(self.trainer.num_val_batches)
        self._loader_metrics("val", count)
        add_calibration_curves(self, self.calibration_curves, ["click"], self.hparams.calibration_buckets, count)

    def validation_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluation_step("val", batch, dataloader_idx)

    def on_validation_epoch_end(self) -> None:
        count = self._loader_count(self.trainer.num_val_batches)
        self._log_evaluation("val", count, prog_bar=True)
        for k, curve in enumerate(self.calibration_curves[:count]):
            log_calibration_plots(self, curve, "val_calibration_plot", self._suffix(k))

    def on_test_epoch_start(self) -> None:
        self._loader_metrics("test", self._loader_count(self.trainer.num_test_batches))

    def test_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluation_step("test", batch, dataloader_idx)

    def on_test_epoch_end(self) -> None:
        self._log_evaluation("test", self._loader_count(self.trainer.num_test_batches), prog_bar=False)

    def predict_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        """The click probability of each row, and its label (NaN in an unlabelled file: the column is left out)."""
        # float32 whatever the precision: under bf16-mixed the logit is bfloat16, whose sigmoid keeps ~3 digits
        return {"probability": torch.sigmoid(self(batch.dense_features, batch.sparse_features).float()),
                "label": batch.labels}

    def configure_optimizers(self):
        return self.combined_optimizers(self.model)
