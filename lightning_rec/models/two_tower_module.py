"""TwoTowerModule: two-tower retrieval (or BPR-MF) as a LightningModule, evaluated by full ranking (docs/movielens.md).

Training batches are `RetrievalBatch`es; evaluation batches are `RankingBatch`es of users, scored against the whole
catalogue, which the item tower embeds once per validation (`on_validation_epoch_start`). Table sizes come from the data
module when not given (`configure_model`) and are written back into the hyperparameters.

Logged: train_loss, train_samples_per_s, mem/rank<r>_max_rss_mb, <split>_ndcg@10 ..., and on loggers with `log_table`
(W&B) a few users' top-10 unseen items with the held-out ones marked."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import lightning.pytorch as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

import lightning_rec.strategy  # noqa: F401  (registers Trainer(strategy="rec"))
from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.errors import is_int, refuse_non_finite
from lightning_rec.managed_collision import check_managed_collision, managed_collision_tables
from lightning_rec.metrics.ranking import RankingMetrics
from lightning_rec.models.dlrm_module import DENSE_OPTIMIZERS
from lightning_rec.models.module_hooks import RecModuleHooks
from lightning_rec.models.two_tower import LOSSES, TwoTower, bpr_loss, in_batch_softmax_loss
from lightning_rec.optim import FusedOptimizerConfig, combined_optimizer, dense_parameters

# values every rank already holds: "max" is an exact identity reduce, and sync_dist stops Lightning's warning
_SAME_ON_EVERY_RANK = dict(sync_dist=True, reduce_fx="max")
_RAW_IDS = "raw user and item ids, which the towers' tables"  # hash_ids=False without id maps: the error's words
_DATALOADERS_ONLY = ("TwoTowerModule ranks every item of the data module's catalogue, but the Trainer was given "
                     "dataloaders only: pass the data module, trainer.validate(module, datamodule=dm) (fit, test and "
                     "predict alike), or call module.embed_catalog(dm) yourself")


class TwoTowerModule(RecModuleHooks, L.LightningModule):
    """Two-tower retrieval on implicit feedback (MovieLensDataModule or any module giving the same batches).

    Args:
        user_num_embeddings: {feature: rows} of the user tower; None: read from the data module at setup.
        item_num_embeddings: the same for the item tower (`item_num_embeddings`).
        embedding_dim: D of every table.
        user_layer_sizes: the user tower's MLP ([] = no MLP: matrix factorisation).
        item_layer_sizes: the item tower's MLP ([] = no MLP).
        id_skip: each tower's output is its id embedding + the MLP of all its features (last layer = embedding_dim).
        tower_dropout: dropout on the MLPs' inputs and hidden layers (training only).
        score: "dot" or "cosine".
        temperature: divides the scores (use ~0.05-0.2 with cosine).
        loss: "softmax" (in-batch negatives; num_negatives=0 data) or "bpr" (num_negatives=1 data).
        logq_correction: softmax loss: subtract each in-batch item's log training frequency from its scores.
        embedding_l2: lambda of BPR's regulariser lambda * mean(|u|^2 + |v_pos|^2 + |v_neg|^2) on the batch's
            tower outputs; 0 = none.
        sparse_optimizer: the tables' fused update: sgd, adagrad, rowwise_adagrad, adam, partial_rowwise_adam, lamb
            or lars_sgd (fbgemm's / TorchRec's names too).
        sparse_lr: the fused update's learning rate.
        sparse_weight_decay: the fused update's weight decay (of the rows a batch reads).
        dense_optimizer: torch.optim for the MLPs (if any): adagrad, adam, adamw or sgd.
        dense_lr: the dense optimizer's learning rate.
        dense_weight_decay: the dense optimizer's weight decay.
        embedding_kernel: "auto" | "fbgemm" | "native" (CPU) for the fused tables, as DLRMModule's.
        ks: ranking cutoffs of the metrics (NDCG@k, Recall@k, ...).
        top_k_table_users: users shown in the top-10 table (0 = none).
        empty_target_action: what a user with no held-out item counts for in the ranking metrics, as in
            torchmetrics: "skip" (left out; the default), "neg" (0: torchmetrics' default), "pos" (1) or "error".
        eval_item_chunk: items embedded per item-tower call at evaluation.
        predict_top_k: items per user that `predict` writes (None: max(ks)).
        embedding_device: "cpu" or "meta" (no values until Trainer(strategy="rec") shards them), as DLRMModule's.
        item_ids_digest: which item each row of the item tables is (a digest of the data module's `item_ids`); None:
            taken from the data module at setup and kept in the checkpoint. Evaluation and prediction refuse a data
            module whose item ids differ.
        user_ids_digest: the same for the users: row i of the user tables is the data module's `user_ids[i]`.
        managed_collision: raw user and item ids (MovieLensDataModule(hash_ids=False)) mapped to rows by an
            MCHManagedCollisionModule in front of the user_id and item_id tables (one row more than the ids: the
            unknown row), built with these arguments as DLRMModule's ({} for the defaults); side features stay rows.
            Training, evaluation, embed_catalog and export read the raw ids through the maps. None: ids are rows.

    Predict writes each user's top predict_top_k unseen items, best first (docs/predict.md#two-tower-models)."""

    def __init__(self, user_num_embeddings: dict[str, int] | None = None,
                 item_num_embeddings: dict[str, int] | None = None, embedding_dim: int = 64,
                 user_layer_sizes: Sequence[int] = (), item_layer_sizes: Sequence[int] = (), id_skip: bool = False,
                 tower_dropout: float = 0.0, score: str = "dot", temperature: float = 1.0, loss: str = "softmax",
                 logq_correction: bool = True, embedding_l2: float = 0.0, sparse_optimizer: str = "rowwise_adagrad",
                 sparse_lr: float = 0.05, sparse_weight_decay: float = 0.0, dense_optimizer: str = "adam",
                 dense_lr: float = 0.001, dense_weight_decay: float = 0.0, embedding_kernel: str = "auto",
                 ks: Sequence[int] = (10, 20), top_k_table_users: int = 5, eval_item_chunk: int = 8192,
                 predict_top_k: int | None = None, empty_target_action: str = "skip", embedding_device: str = "cpu",
                 item_ids_digest: str | None = None, user_ids_digest: str | None = None,
                 managed_collision: dict | None = None) -> None:
        super().__init__()
        # predict_top_k is an inference choice: kept out of checkpoints, whose value would override the command line
        self.save_hyperparameters(ignore=["predict_top_k"])
        refuse_non_finite(type(self).__name__, self.hparams)
        self.predict_top_k = predict_top_k
        if loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}: choose one of {', '.join(LOSSES)}")
        if dense_optimizer not in DENSE_OPTIMIZERS:
            raise ValueError(f"unknown dense_optimizer {dense_optimizer!r}: "
                             f"choose one of {', '.join(DENSE_OPTIMIZERS)}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.check_embedding_device("TwoTowerModule", embedding_device)
        if managed_collision is not None:
            check_managed_collision(managed_collision)
        self.check_embedding_kernel("TwoTowerModule", embedding_kernel)
        if predict_top_k is not None and (isinstance(predict_top_k, bool) or predict_top_k < 1):
            raise ValueError(f"predict_top_k={predict_top_k!r}: give the number of items to write per user (>= 1), "
                             f"or None for max(ks)")
        # checked here, not at the first validation after training
        for name, value, least in (("eval_item_chunk", eval_item_chunk, 1),
                                   ("top_k_table_users", top_k_table_users, 0)):
            if not is_int(value) or value < least:
                raise ValueError(f"{name}={value!r}: give an int >= {least}")
        self.model: TwoTower | None = None
        self.eval_splits = ["val"]
        self.val_metrics = torch.nn.ModuleList([self._ranking_metrics()])
        self.test_metrics = self._ranking_metrics()
        self._item_emb_ID: Tensor | None = None
        # set here as well as per epoch: a hand-written loop calls training_step without the Trainer's hooks
        self._samples, self._epoch_start = 0, time.perf_counter()
        self._warned_one_pair = False
        if user_num_embeddings is not None and item_num_embeddings is not None:
            self._build(dict(user_num_embeddings), dict(item_num_embeddings))

    # building -----------------------------------------------------------------------------------

    def _ranking_metrics(self) -> RankingMetrics:
        return RankingMetrics(ks=self.hparams.ks, empty_target_action=self.hparams.empty_target_action)

    def _tables(self, sizes: dict[str, int], tower: str) -> EmbeddingBagCollection:
        hp = self.hparams
        managed, raw = hp.get("managed_collision"), f"{tower}_id"
        if managed is not None and raw not in sizes:
            raise ValueError(f"managed_collision maps the raw ids of the {raw} feature, but the {tower} tower's "
                             f"features are {sorted(sizes)}: name the id feature {raw}, or managed_collision=None")
        # a managed table keeps its last row for unknown ids: one more, so that every id of the catalogue has a row
        tables = [EmbeddingBagConfig(name=f"t_{tower}_{feature}", embedding_dim=hp.embedding_dim,
                                     num_embeddings=int(rows) + (managed is not None and feature == raw),
                                     feature_names=[feature])
                  for feature, rows in sizes.items()]
        fused = FusedOptimizerConfig(hp.sparse_optimizer, lr=hp.sparse_lr, weight_decay=hp.sparse_weight_decay)
        ebc = EmbeddingBagCollection(tables, optimizer=fused, kernel=hp.embedding_kernel,
                                     device=hp.get("embedding_device", "cpu"))
        return ebc if managed is None else managed_collision_tables(ebc, managed, [f"t_{tower}_{raw}"])

    def _build(self, user_sizes: dict[str, int], item_sizes: dict[str, int]) -> None:
        hp = self.hparams
        skips = (None, None)
        if hp.id_skip:
            if "user_id" not in user_sizes or "item_id" not in item_sizes:
                raise ValueError(f"id_skip adds the user_id / item_id embedding to each tower's MLP output, but the "
                                 f"towers' features are {sorted(user_sizes)} and {sorted(item_sizes)}: name the id "
                                 f"features user_id and item_id, or set id_skip=False")
            skips = ("user_id", "item_id")
        outs = {tower: (list(layers)[-1] if layers else hp.embedding_dim * len(sizes), sizes, layers)
                for tower, sizes, layers in (("user", user_sizes, hp.user_layer_sizes),
                                             ("item", item_sizes, hp.item_layer_sizes))}
        if outs["user"][0] != outs["item"][0] and not (hp.user_layer_sizes and hp.item_layer_sizes):
            # a tower without MLP is its features side by side: side features widen it (said here, with the fix)
            said = "; ".join(f"the {tower} tower gives {dim} = " + ("its MLP's last layer" if layers else
                             f"{len(sizes)} features ({', '.join(sizes)}) x embedding_dim {hp.embedding_dim}")
                             for tower, (dim, sizes, layers) in outs.items())
            raise ValueError(f"the towers must end in the same dim to be scored: {said}. For matrix factorisation "
                             f"(no MLP) use the ids only: MovieLensDataModule(side_features=False); with side "
                             f"features, give both towers layer sizes ending in the same size")
        self.model = TwoTower(self._tables(user_sizes, "user"), self._tables(item_sizes, "item"),
                              list(hp.user_layer_sizes), list(hp.item_layer_sizes), hp.score, *skips,
                              dropout=hp.tower_dropout)
        hp.user_num_embeddings, hp.item_num_embeddings = user_sizes, item_sizes  # checkpoints rebuild these
        # and the loggers show them: Lightning logs the hyperparameters as first saved (None until now)
        initial = getattr(self, "_hparams_initial", None)
        if initial is not None:
            initial["user_num_embeddings"], initial["item_num_embeddings"] = dict(user_sizes), dict(item_sizes)

    def configure_model(self) -> None:
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is not None:
            self._check_ids(datamodule)
            self.check_raw_ids(datamodule, _RAW_IDS)
        if datamodule is not None and callable(getattr(datamodule, "eval_split_names", None)):
            datamodule.setup("fit")  # Trainer has run it already; a no-op then
            self.eval_splits = list(datamodule.eval_split_names())
            while len(self.val_metrics) < len(self.eval_splits):
                self.val_metrics.append(self._ranking_metrics())
        if self.model is not None:
            return
        if datamodule is None or not hasattr(datamodule, "user_num_embeddings"):
            raise ValueError("TwoTowerModule needs its table sizes: pass user_num_embeddings and item_num_embeddings "
                             "({feature: rows}), or train with a data module that has them (MovieLensDataModule)")
        self._build(dict(datamodule.user_num_embeddings), dict(datamodule.item_num_embeddings))

    def _check_ids(self, datamodule) -> None:
        """Keep the data module's item and user ids' digests (the first time), or refuse other ids than the model's."""
        for kind in ("item", "user"):
            key, digest = f"{kind}_ids_digest", _ids_digest(datamodule, f"{kind}_ids")
            if digest is None:  # a data module without such ids: rows are positions
                continue
            self._same_items(self.hparams.get(key), digest, f"the data module's {kind} ids", kind)
            if self.hparams.get(key) is None:
                self.hparams[key] = digest
                initial = getattr(self, "_hparams_initial", None)
                if initial is not None:  # the loggers' copy, as the table sizes
                    initial[key] = digest

    @staticmethod
    def _same_items(model: str | None, data: str | None, what: str, kind: str = "item") -> None:
        if model is not None and data is not None and model != data:
            raise ValueError(
                f"{what} are not the {kind}s this model was trained on: row i of its {kind} table is {kind}_ids[i] of "
                f"its training data ({kind}_ids_digest {model!r}), but these give {data!r} (digest 'count:hash'). "
                f"Another snapshot or filter (min_rating, ...) of the data maps the rows to other {kind}s: evaluate "
                f"and predict with the data the model was trained on, or train again on this one")

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        # trainer.fit/validate/predict(module, dm, ckpt_path=...): the module's digest came from dm (configure_model)
        for kind in ("item", "user"):
            key = f"{kind}_ids_digest"
            saved = (checkpoint.get("hyper_parameters") or {}).get(key)
            self._same_items(saved, self.hparams.get(key), f"the data module's {kind} ids", kind)
            if saved is not None:
                self.hparams[key] = saved

    def setup(self, stage: str) -> None:
        super().setup(stage)
        trainer = self.trainer
        if stage == "fit" and trainer.datamodule is None and trainer.limit_val_batches != 0 \
                and trainer.fit_loop.epoch_loop.val_loop._data_source.is_defined():
            # said now, not at the first validation after a whole epoch of training
            raise ValueError(_DATALOADERS_ONLY)

    def _need_model(self) -> TwoTower:
        if self.model is None:
            raise ValueError("the towers are built by Trainer setup (configure_model) from the data module's table "
                             "sizes: run trainer.fit/validate, or pass user_num_embeddings and item_num_embeddings")
        return self.model

    # training -----------------------------------------------------------------------------------

    def training_step(self, batch, batch_idx: int) -> Tensor:
        model, hp = self._need_model(), self.hparams
        user_BD = model.user_embeddings(batch.user_features)
        item_BD = model.item_embeddings(batch.item_features)
        if hp.loss == "bpr":
            if batch.neg_item_features is None:
                raise ValueError("loss='bpr' needs a sampled negative per pair: set the data module's num_negatives=1")
            neg_BD = model.item_embeddings(batch.neg_item_features)
            loss = bpr_loss(user_BD, item_BD, neg_BD, hp.temperature)
            if hp.embedding_l2:
                loss = loss + hp.embedding_l2 * (user_BD.square() + item_BD.square() + neg_BD.square()).sum(1).mean()
        else:
            if batch.neg_item_features is not None:
                # its logQ correction is for in-batch negatives, not uniform ones: refused rather than mixed in
                raise ValueError("loss='softmax' takes its negatives from the batch's other items, but the batches "
                                 "carry sampled negatives it would never use: set the data module's num_negatives=0 "
                                 "(or loss='bpr' to train on them)")
            if len(batch) == 1 and not self._warned_one_pair:
                self._warned_one_pair = True
                rank_zero_warn("loss='softmax' got a batch of 1 pair: its negatives are the batch's other items, so "
                               "its loss is 0 and it trains nothing. Use the data module's batch_size >= 2 (and "
                               "drop_last=True if only the last batch is that short), or loss='bpr' with "
                               "num_negatives=1")
            log_q = batch.item_log_q if hp.logq_correction else None
            loss = in_batch_softmax_loss(user_BD, item_BD, batch.item_index, log_q, hp.temperature)
        self.log_train_loss(loss, batch_size=len(batch))
        self._samples += len(batch)
        return loss

    def on_train_start(self) -> None:
        # a run resumed mid-epoch starts there: Lightning skips that epoch's on_train_epoch_start
        self.on_train_epoch_start()

    def on_train_epoch_start(self) -> None:
        self._samples, self._epoch_start = 0, time.perf_counter()

    def on_train_epoch_end(self) -> None:
        seconds = time.perf_counter() - self._epoch_start
        rate = torch.tensor([self._samples / max(seconds, 1e-9)], dtype=torch.float64, device=self.device)
        self.log("train_samples_per_s", float(self.all_gather(rate).sum()), **_SAME_ON_EVERY_RANK)
        self.log_memory_per_rank()

    # evaluation: item embeddings once, then users in batches --------------------------------------

    @torch.no_grad()
    def embed_catalog(self, datamodule=None) -> Tensor:
        """Every item through the item tower, in chunks (every rank the same calls: tables may be sharded): [I, D].
        `datamodule` (with `item_catalog()` and `num_items`, e.g. a set-up MovieLensDataModule) defaults to the
        Trainer's. The tower runs in eval mode. Score users with `model.user_embeddings(kjt) @ items_ID.t()`."""
        if datamodule is None and self._trainer is not None:
            datamodule = getattr(self._trainer, "datamodule", None)
        if datamodule is None and self._trainer is not None:
            # inside trainer.fit/validate/predict already: the dataloaders-only case
            raise ValueError(_DATALOADERS_ONLY)
        if datamodule is None:
            raise ValueError("embed_catalog() has no data module to read the items from: pass one, "
                             "module.embed_catalog(dm) (set up, e.g. MovieLensDataModule after dm.setup()), or call it "
                             "inside trainer.fit/validate/predict")
        if not callable(getattr(datamodule, "item_catalog", None)):
            raise ValueError(f"full-ranking evaluation needs the item catalogue, but {type(datamodule).__name__} has "
                             f"no item_catalog(): use a data module with item_catalog() and num_items "
                             f"(MovieLensDataModule)")
        self._same_items(self.hparams.get("item_ids_digest"), _ids_digest(datamodule, "item_ids"),
                         f"{type(datamodule).__name__}'s item ids")
        self.check_raw_ids(datamodule, _RAW_IDS)
        model = self._need_model()
        chunk, num_items = self.hparams.eval_item_chunk, datamodule.num_items
        tower, was_training = model.item_tower, model.item_tower.training
        tower.eval()
        try:
            parts = [model.item_embeddings(datamodule.item_catalog(torch.arange(s, min(s + chunk, num_items)))
                                           .to(self.device)) for s in range(0, num_items, chunk)]
        finally:
            tower.train(was_training)
        return torch.cat(parts)

    def _scoring_catalog(self) -> Tensor:
        # float32 once per epoch (scores are float32, `_scores`), not a cast of the whole catalogue per batch
        return self.embed_catalog().float()

    def on_validation_epoch_start(self) -> None:
        self._item_emb_ID = self._scoring_catalog()

    def on_test_epoch_start(self) -> None:
        self._item_emb_ID = self._scoring_catalog()

    def _rank(self, batch, metric: RankingMetrics) -> None:
        user_UD = self._need_model().user_embeddings(batch.user_features)
        scores_UI = _scores(user_UD, self._item_emb_ID)  # one batch of users x every item, never all users
        metric.update_full(scores_UI, batch.target_offsets, batch.target_items, batch.exclude_offsets,
                           batch.exclude_items)

    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._rank(batch, self.val_metrics[dataloader_idx])

    def test_step(self, batch, batch_idx: int) -> None:
        self._rank(batch, self.test_metrics)

    def on_validation_epoch_end(self) -> None:
        for split, metric in zip(self.eval_splits, self.val_metrics):
            values = metric.compute()  # synced over ranks: every rank logs the same numbers
            self.log_dict({f"{split}_{k}": v.float() for k, v in values.items()}, prog_bar=split == "val",
                          **_SAME_ON_EVERY_RANK)
            metric.reset()
        self._log_top_k_table()
        self._item_emb_ID = None

    def on_test_epoch_end(self) -> None:
        values = self.test_metrics.compute()
        self.log_dict({f"test_{k}": v.float() for k, v in values.items()}, **_SAME_ON_EVERY_RANK)
        self.test_metrics.reset()
        self._item_emb_ID = None

    # prediction: each user's top items among those it has not seen -------------------------------

    def on_predict_epoch_start(self) -> None:
        self._item_emb_ID = self._scoring_catalog()
        datamodule = self._trainer.datamodule
        num_items = self._item_emb_ID.shape[0]
        # the data's own ids (MovieLens' user_id / item_id) where the data module keeps them; else positions
        self._predict_user_ids = _ids_of(datamodule, "user_ids")
        self._predict_item_ids = _ids_of(datamodule, "item_ids", num_items)

    @torch.no_grad()
    def predict_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        k = min(self.predict_top_k or max(self.hparams.ks), self._item_emb_ID.shape[0])
        user_UD = self._need_model().user_embeddings(batch.user_features)  # every rank: tables may be sharded
        # topk puts NaN first: an item the model scores NaN (a diverged row) is recommended last, as in the metrics
        scores_UI = _scores(user_UD, self._item_emb_ID).nan_to_num(nan=float("-inf"), posinf=float("inf"),
                                                                    neginf=float("-inf"))
        rows = torch.repeat_interleave(torch.arange(len(batch), device=scores_UI.device), batch.exclude_offsets.diff())
        scores_UI[rows, batch.exclude_items] = float("-inf")  # seen items are not recommended
        top_UK = torch.topk(scores_UI, k, dim=1)
        users_U, items_UK = batch.user_index.cpu(), top_UK.indices.cpu()
        return {
            "row": users_U,  # the split's users are its rows (the writer puts them in this order, each once)
            "user": _take(self._predict_user_ids, users_U),
            "item": _take(self._predict_item_ids, items_UK),
            "score": top_UK.values,
        }

    def on_predict_epoch_end(self) -> None:
        self._item_emb_ID = None

    @torch.no_grad()
    def _log_top_k_table(self, k: int = 10) -> None:
        n = self.hparams.top_k_table_users
        logger = self.logger
        datamodule = getattr(self._trainer, "datamodule", None)
        if not n or logger is None or not callable(getattr(logger, "log_table", None)) or datamodule is None:
            return
        if not hasattr(datamodule, "datasets") or "val" not in datamodule.datasets:
            return
        n = min(n, len(datamodule.datasets["val"]))  # fewer users than asked for: show them all
        batch = datamodule.datasets["val"].__getitems__(list(range(n))).to(self.device)
        user_UD = self._need_model().user_embeddings(batch.user_features)  # every rank: tables may be sharded
        if not self.trainer.is_global_zero:
            return
        scores_UI = _scores(user_UD, self._item_emb_ID)
        rows = torch.repeat_interleave(torch.arange(len(batch), device=self.device), batch.exclude_offsets.diff())
        scores_UI[rows, batch.exclude_items] = float("-inf")
        scores_UI = scores_UI.masked_fill(scores_UI.isnan(), float("-inf"))  # topk puts NaN first: last here
        top_UK = torch.topk(scores_UI, min(k, scores_UI.shape[1]), dim=1)
        # a user with fewer than k unseen items gets a shorter list: its seen (-inf) items are no recommendation
        shown_UK, top_UK = (top_UK.values > float("-inf")).cpu(), top_UK.indices.cpu()
        titles = getattr(datamodule, "item_titles", None)
        data = []
        for u in range(len(batch)):
            lo, hi = batch.target_offsets[u].item(), batch.target_offsets[u + 1].item()
            held_out = set(batch.target_items[lo:hi].tolist())
            for rank, item in enumerate(top_UK[u][shown_UK[u]].tolist(), 1):
                name = titles[item] if titles is not None else str(item)
                data.append([int(batch.user_index[u]), rank, item, name, item in held_out])
        logger.log_table(key="val_top10", columns=["user", "rank", "item", "title", "held_out"], data=data)

    # optimizers --------------------------------------------------------------------------------

    def configure_optimizers(self):
        model = self._need_model()
        dense = self.dense_optimizer(dense_parameters(model))
        return self.fused_rate_from_hparams(combined_optimizer(model, dense))


def _scores(user_UD: Tensor, item_ID: Tensor) -> Tensor:
    """Every user's dot product with every item, in float32 whatever the precision (bfloat16 scores tie and swap)."""
    with torch.autocast(user_UD.device.type, enabled=False):
        return user_UD.float() @ item_ID.float().t()


def _id_array(ids) -> np.ndarray:
    """Raw ids as numpy int64 or str (a data module may keep them in an object array, as pandas does)."""
    ids = np.asarray(ids)
    if ids.dtype.kind == "O":
        try:
            return ids.astype(np.int64)
        except (TypeError, ValueError):
            return ids.astype(str)
    return ids


def _ids_digest(datamodule, name: str) -> str | None:
    """'count:hash' of the data module's `item_ids` / `user_ids` (row i's own id), or None where it has none."""
    ids = getattr(datamodule, name, None)
    if ids is None:
        return None
    ids = _id_array(ids)
    data = "\0".join(ids.tolist()).encode() if ids.dtype.kind == "U" else ids.astype(np.int64).tobytes()
    return f"{len(ids)}:{hashlib.sha256(data).hexdigest()[:16]}"


def _ids_of(datamodule, name: str, size: int | None = None) -> Tensor | np.ndarray | None:
    """The data's own ids (a tensor; a numpy array of str for string ids), or None."""
    ids = getattr(datamodule, name, None)
    if ids is None:
        return None
    ids = _id_array(ids)
    ids = ids if ids.dtype.kind == "U" else torch.as_tensor(ids)
    return ids if size is None or ids.shape[0] == size else None


def _take(ids: Tensor | np.ndarray | None, index: Tensor) -> Tensor | np.ndarray:
    """ids[index] (positions where the data module keeps no ids); string ids stay numpy str arrays."""
    if ids is None:
        return index
    return ids[index.numpy()] if isinstance(ids, np.ndarray) else ids[index]
