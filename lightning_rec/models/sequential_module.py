"""`SASRec` and `HSTU`: next-item LightningModules on jagged histories (SequenceDataModule), whose item table is one
`EmbeddingCollection` shared by the inputs and the output scores, sharded under `Trainer(strategy="rec")`
(docs/sequential.md).

Training batches give every position's next item (causal); evaluation ranks every item of the catalog for the held-out
item after each history, with `RankingMetrics` (NDCG@10, HR@10, MRR, ...). The catalog is embedded once per
evaluation through the collection (every rank the same calls), so evaluation batches need no collective.

Shapes: B histories, T positions (sum of lengths), I items, C candidates of a sampled softmax, D dim."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import lightning_rec.strategy  # noqa: F401  (registers Trainer(strategy="rec"))
from lightning_rec.data.sequence import SequenceBatch
from lightning_rec.embedding import EmbeddingCollection, EmbeddingConfig
from lightning_rec.errors import is_int
from lightning_rec.metrics.ranking import RankingMetrics
from lightning_rec.models.dlrm_module import DENSE_OPTIMIZERS
from lightning_rec.models.module_hooks import RecModuleHooks
from lightning_rec.models.sequence_losses import LOSSES, candidate_log_q, full_softmax_loss, sampled_softmax_loss
from lightning_rec.models.sequential import HSTUEncoder, SASRecEncoder, positions_from_end, scale_inputs
from lightning_rec.optim import FusedOptimizerConfig, combined_optimizer, dense_parameters
from lightning_rec.sparse import KeyedJaggedTensor

_SAME_ON_EVERY_RANK = dict(sync_dist=True, reduce_fx="max")
INPUT, OUTPUT = "item_id", "output_item"  # the two features of the one item table: history items, scored items


def lookup_features(input_ids: Tensor, output_ids: Tensor, lengths_B: Tensor) -> KeyedJaggedTensor:
    """The item table's one lookup of a step: each history's items under "item_id" (a bag per user), the scored
    items under "output_item" (all in the first bag). An empty batch still looks up (a sharded table's ranks call
    together): a stride of 1."""
    B = max(lengths_B.shape[0], 1)
    in_lengths = torch.zeros(B, dtype=torch.int64, device=input_ids.device)
    in_lengths[: lengths_B.shape[0]] = lengths_B.to(input_ids.device)
    out_lengths = torch.zeros(B, dtype=torch.int64, device=input_ids.device)
    out_lengths[0] = output_ids.shape[0]
    return KeyedJaggedTensor.from_lengths_sync([INPUT, OUTPUT], torch.cat([input_ids, output_ids.to(input_ids.device)]),
                                               torch.cat([in_lengths, out_lengths]), stride=B)


class SequentialRecModule(RecModuleHooks, L.LightningModule):
    """What SASRec and HSTU share: the item table, positions, losses, full-ranking evaluation. Subclasses build
    `self.encoder` in `_encoder()`."""

    def __init__(self, num_items: int | None, max_len: int | None, embedding_dim: int, dropout: float, loss: str,
                 num_negatives: int, logq_correction: bool, temperature: float, l2_norm: bool, exclude_history: bool,
                 sparse_optimizer: str, sparse_lr: float, dense_optimizer: str, dense_lr: float,
                 dense_weight_decay: float, embedding_kernel: str, ks: Sequence[int], embedding_device: str,
                 bucketed_attention: bool) -> None:
        super().__init__()
        name = type(self).__name__
        if loss not in LOSSES:
            raise ValueError(f"{name}(loss={loss!r}): choose one of {', '.join(LOSSES)}")
        if dense_optimizer not in DENSE_OPTIMIZERS:
            raise ValueError(f"{name}(dense_optimizer={dense_optimizer!r}): choose one of "
                             f"{', '.join(DENSE_OPTIMIZERS)}")
        if not temperature > 0:
            raise ValueError(f"{name}(temperature={temperature!r}): give a number > 0")
        if loss == "sampled_softmax" and (not is_int(num_negatives) or num_negatives < 0):
            raise ValueError(f"{name}(num_negatives={num_negatives!r}): give the uniform negatives per batch (>= 0)")
        for arg, value in (("num_items", num_items), ("max_len", max_len)):
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name}({arg}={value!r}): give an int >= 1, or None to read it from the data module")
        self.check_embedding_device(name, embedding_device)
        self.check_embedding_kernel(name, embedding_kernel)
        self.items: EmbeddingCollection | None = None
        self.positions: nn.Embedding | None = None
        self.encoder: nn.Module | None = None
        self.register_buffer("item_counts", torch.ones(num_items or 1), persistent=False)
        self.eval_splits = ["val"]
        self.val_metrics = nn.ModuleList([RankingMetrics(ks=ks)])
        self.test_metrics = RankingMetrics(ks=ks)
        self._catalog_ID: Tensor | None = None

    # building -----------------------------------------------------------------------------------

    def _encoder(self) -> nn.Module:
        raise NotImplementedError

    def _build(self, num_items: int, max_len: int) -> None:
        hp = self.hparams
        hp.num_items, hp.max_len = num_items, max_len  # checkpoints rebuild these
        table = EmbeddingConfig(name="t_item", num_embeddings=num_items, embedding_dim=hp.embedding_dim,
                                feature_names=[INPUT, OUTPUT])
        fused = FusedOptimizerConfig(hp.sparse_optimizer, lr=hp.sparse_lr)
        self.items = EmbeddingCollection([table], optimizer=fused, kernel=hp.embedding_kernel,
                                         device=hp.embedding_device)
        self.positions = nn.Embedding(max_len, hp.embedding_dim)
        self.input_dropout = nn.Dropout(hp.dropout)
        self.encoder = self._encoder()
        if self.item_counts.shape[0] != num_items:
            self.item_counts = torch.ones(num_items)

    def configure_model(self) -> None:
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is not None and callable(getattr(datamodule, "eval_split_names", None)):
            datamodule.setup("fit")
            self.eval_splits = list(datamodule.eval_split_names())
            while len(self.val_metrics) < len(self.eval_splits):
                self.val_metrics.append(RankingMetrics(ks=self.hparams.ks))
        if self.items is None:
            hp = self.hparams
            num_items = hp.num_items or getattr(datamodule, "num_items", None)
            max_len = hp.max_len or getattr(datamodule, "max_len", None)
            if num_items is None or max_len is None:
                raise ValueError(f"{type(self).__name__} needs num_items and max_len: pass them, or train with a data "
                                 f"module that has them (SequenceDataModule)")
            self._build(int(num_items), int(max_len))
        counts = getattr(datamodule, "item_counts", None)
        if counts is not None and counts.shape[0] == self.item_counts.shape[0]:
            self.item_counts = counts.to(self.item_counts.device, torch.float32)

    # the data path ------------------------------------------------------------------------------

    def _lookup(self, input_ids: Tensor, output_ids: Tensor, lengths_B: Tensor) -> tuple[Tensor, Tensor]:
        """One lookup of the item table for the history items and the scored items (one fused update per step)."""
        return self._look_up(lookup_features(input_ids, output_ids, lengths_B))

    def _look_up(self, kjt: KeyedJaggedTensor) -> tuple[Tensor, Tensor]:
        out = self.items(kjt.to(self.device))  # (the very KJT of the batch when it is there: a pipeline routed it)
        return out[INPUT].values(), out[OUTPUT].values()

    def _candidates(self, batch) -> Tensor:
        """The items a training batch scores: the catalog (softmax), or its targets and uniform draws (sampled
        softmax) from a generator of their own, seeded by the run's seed, the epoch and the batch's users: the same
        draws whether the batch is prepared in the step or ahead of it (a pipeline's feeder thread)."""
        hp = self.hparams
        device = batch.targets.device
        if hp.loss == "softmax":
            return torch.arange(hp.num_items, device=device)
        epoch = self._trainer.current_epoch if self._trainer is not None else 0
        key = hashlib.blake2b(f"{torch.initial_seed()}/{epoch}/".encode(), digest_size=8)
        key.update(batch.user_index.cpu().numpy().tobytes())
        draws = torch.Generator().manual_seed(int.from_bytes(key.digest(), "little") >> 1)
        uniform = torch.randint(hp.num_items, (hp.num_negatives,), generator=draws)
        return torch.cat([batch.targets, uniform.to(device)])

    def prepare_batch(self, batch):
        """A training SequenceBatch with its step's lookup (`lookup`: the histories' items and the candidates, one
        KJT of the item table) and `candidates`; other batches unchanged. SequenceDataModule's
        on_before_batch_transfer calls it, so that under RecStrategy(pipeline=True) the ids are routed ahead of the
        step."""
        if not isinstance(batch, SequenceBatch) or batch.exclude_offsets is not None or batch.lookup is not None:
            return batch
        candidates = self._candidates(batch)
        return dataclasses.replace(batch, candidates=candidates,
                                   lookup=lookup_features(batch.item_ids, candidates, batch.lengths))

    def forward(self, batch):
        raise TypeError(f"{type(self).__name__}(batch): a sequential module has no forward; train it with "
                        f"Trainer.fit (RecStrategy(pipeline=True) pipelines it) and rank with Trainer.validate / test; "
                        f"a TrainPipelineSparseDist loop (model(batch) -> (loss, output)) or Trainer.predict cannot "
                        f"run it")

    def _check_not_pipelined(self) -> None:
        """Under a pipeline the step's lookup must come with the batch (the feeder routes it ahead of the step)."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        if getattr(strategy, "pipeline_config", None) is not None:
            raise ValueError(
                f"{type(self).__name__} under RecStrategy(pipeline=True) got a training batch without its item-table "
                f"lookup (batch.lookup), which SequenceDataModule's on_before_batch_transfer adds ahead of the step "
                f"(model.prepare_batch): train with a SequenceDataModule, return model.prepare_batch(batch) from your "
                f"datamodule's on_before_batch_transfer, or train with pipeline=False")

    def encode(self, emb_TD: Tensor, lengths_B: Tensor, timestamps_T: Tensor) -> Tensor:
        """Item embeddings of the histories -> each position's output [T, D] (L2-normalised with l2_norm)."""
        lengths_B = lengths_B.to(emb_TD.device)
        x_TD = scale_inputs(emb_TD) + self.positions(positions_from_end(lengths_B).clamp(max=self.hparams.max_len - 1))
        h_TD = self.encoder(self.input_dropout(x_TD), lengths_B, timestamps_T.to(emb_TD.device),
                            bucketed=self.hparams.bucketed_attention)
        return F.normalize(h_TD, dim=-1) if self.hparams.l2_norm else h_TD

    def _out_items(self, emb_ND: Tensor) -> Tensor:
        return F.normalize(emb_ND, dim=-1) if self.hparams.l2_norm else emb_ND

    def training_step(self, batch, batch_idx: int) -> Tensor:
        hp, targets_T = self.hparams, batch.targets.to(self.device)
        lookup, candidates = getattr(batch, "lookup", None), getattr(batch, "candidates", None)
        if lookup is None:  # a batch no hook prepared (plain loaders, a datamodule's own hook): built in the step
            self._check_not_pipelined()
            candidates = self._candidates(batch)
            lookup = lookup_features(batch.item_ids, candidates, batch.lengths)
        candidates = candidates.to(self.device)
        emb_TD, cand_CD = self._look_up(lookup)
        h_TD, cand_CD = self.encode(emb_TD, batch.lengths, batch.timestamps), self._out_items(cand_CD)
        if targets_T.shape[0] == 0:  # an empty batch: no target, but every parameter in the graph
            loss = 0.0 * (h_TD.sum() + cand_CD.sum() + sum(p.sum() for p in dense_parameters(self)))
        elif hp.loss == "softmax":
            loss = full_softmax_loss(h_TD, cand_CD, targets_T, hp.temperature)
        else:
            log_q = (candidate_log_q(self.item_counts, candidates, targets_T.shape[0], hp.num_negatives)
                     if hp.logq_correction else None)
            loss = sampled_softmax_loss(h_TD, cand_CD, candidates, targets_T, log_q, hp.temperature)
        self.log_train_loss(loss, batch_size=len(batch))
        return loss

    # evaluation: the catalog once, then histories in batches -----------------------------------

    @torch.no_grad()
    def embed_catalog(self) -> Tensor:
        """Every item's row [I, D] through the table (every rank the same call: it may be sharded)."""
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        _, items_ID = self._lookup(empty, torch.arange(self.hparams.num_items, device=self.device),
                                   torch.zeros(1, dtype=torch.int64))
        return items_ID.float()

    def last_outputs(self, batch) -> Tensor:
        """Each history's newest position's output [B, D]: what scores its next item."""
        lengths_B = batch.lengths.to(self.device)
        emb_TD = self._catalog_ID[batch.item_ids.to(self.device)]
        h_TD = self.encode(emb_TD, lengths_B, batch.timestamps)
        return h_TD[torch.cumsum(lengths_B, 0) - 1]

    def _rank(self, batch, metric: RankingMetrics) -> None:
        B = len(batch)
        if B == 0:
            return
        scores_BI = self.last_outputs(batch).float() @ self._out_items(self._catalog_ID).t()
        offsets = torch.arange(B + 1, device=self.device)
        if self.hparams.exclude_history:
            ex_off, ex_items = batch.exclude_offsets.to(self.device), batch.exclude_items.to(self.device)
        else:
            ex_off, ex_items = torch.zeros(B + 1, dtype=torch.int64, device=self.device), offsets[:0]
        metric.update_full(scores_BI, offsets, batch.targets.to(self.device), ex_off, ex_items)

    def on_validation_epoch_start(self) -> None:
        self._catalog_ID = self.embed_catalog()

    on_test_epoch_start = on_validation_epoch_start

    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._rank(batch, self.val_metrics[dataloader_idx])

    def test_step(self, batch, batch_idx: int) -> None:
        self._rank(batch, self.test_metrics)

    def on_validation_epoch_end(self) -> None:
        for split, metric in zip(self.eval_splits, self.val_metrics):
            self.log_dict({f"{split}_{k}": v.float() for k, v in metric.compute().items()},
                          prog_bar=split == "val", **_SAME_ON_EVERY_RANK)
            metric.reset()
        self._catalog_ID = None

    def on_test_epoch_end(self) -> None:
        self.log_dict({f"test_{k}": v.float() for k, v in self.test_metrics.compute().items()},
                      **_SAME_ON_EVERY_RANK)
        self.test_metrics.reset()
        self._catalog_ID = None

    def configure_optimizers(self):
        if self.items is None:
            raise ValueError(f"{type(self).__name__} is built by Trainer setup (configure_model): run trainer.fit")
        dense = self.dense_optimizer(dense_parameters(self))
        return self.fused_rate_from_hparams(combined_optimizer(self, dense))


_COMMON_DOC = """
        num_items: rows of the item table; None: the data module's `num_items`.
        max_len: the longest history (positions); None: the data module's `max_len`.
        embedding_dim: D of the item table and the model.
        num_blocks, num_heads, dropout: the encoder's.
        loss: "softmax" (full softmax over the catalog) or "sampled_softmax" (the batch's other targets and
            num_negatives uniform items as negatives).
        num_negatives: uniform negatives per batch of the sampled softmax.
        logq_correction: sampled softmax: subtract each candidate's log expected count among the candidates.
        temperature: divides the scores (~0.05 with l2_norm).
        l2_norm: score L2-normalised outputs and item rows (cosine), as generative-recommenders does.
        exclude_history: evaluation leaves the history's items out of the ranking (False: every item ranked, the
            SASRec and HSTU papers' full-ranking protocol).
        sparse_optimizer, sparse_lr: the item table's fused update.
        dense_optimizer, dense_lr, dense_weight_decay: the encoder's and positions' optimizer.
        embedding_kernel, embedding_device: as TwoTowerModule's.
        ks: ranking cutoffs of the metrics.
        bucketed_attention: attention over length buckets (False: padded to the batch's longest, the reference)."""


class SASRec(SequentialRecModule):
    __doc__ = ("SASRec (Kang & McAuley, 2018): causal multi-head self-attention over the history, learned positions, "
               "the item table shared by inputs and output scores.\n\n    Args:" + _COMMON_DOC)

    def __init__(self, num_items: int | None = None, max_len: int | None = None, embedding_dim: int = 64,
                 num_blocks: int = 2, num_heads: int = 1, dropout: float = 0.2, loss: str = "softmax",
                 num_negatives: int = 128, logq_correction: bool = True, temperature: float = 1.0,
                 l2_norm: bool = False, exclude_history: bool = False, sparse_optimizer: str = "rowwise_adagrad",
                 sparse_lr: float = 0.05, dense_optimizer: str = "adam", dense_lr: float = 0.001,
                 dense_weight_decay: float = 0.0, embedding_kernel: str = "auto", ks: Sequence[int] = (10,),
                 embedding_device: str = "cpu", bucketed_attention: bool = True) -> None:
        super().__init__(num_items, max_len, embedding_dim, dropout, loss, num_negatives, logq_correction,
                         temperature, l2_norm, exclude_history, sparse_optimizer, sparse_lr, dense_optimizer,
                         dense_lr, dense_weight_decay, embedding_kernel, ks, embedding_device, bucketed_attention)
        self.save_hyperparameters()
        if num_items is not None and max_len is not None:
            self._build(num_items, max_len)

    def _encoder(self) -> nn.Module:
        hp = self.hparams
        return SASRecEncoder(hp.embedding_dim, hp.num_blocks, hp.num_heads, hp.dropout)


class HSTU(SequentialRecModule):
    __doc__ = ("HSTU (Zhai et al., 2024, 'Actions speak louder than words'): pointwise aggregated attention "
               "SiLU(QK^T + relative position and time biases) V / N, gated by U.\n\n    Args:" + _COMMON_DOC +
               "\n        attention_dim, value_dim: per-head dims of Q/K and of V/U.\n        num_time_buckets: "
               "log-scale buckets of the time gaps.")

    def __init__(self, num_items: int | None = None, max_len: int | None = None, embedding_dim: int = 64,
                 num_blocks: int = 2, num_heads: int = 1, attention_dim: int = 64, value_dim: int = 64,
                 num_time_buckets: int = 128, dropout: float = 0.2, loss: str = "softmax", num_negatives: int = 128,
                 logq_correction: bool = True, temperature: float = 1.0, l2_norm: bool = False,
                 exclude_history: bool = False, sparse_optimizer: str = "rowwise_adagrad", sparse_lr: float = 0.05,
                 dense_optimizer: str = "adam", dense_lr: float = 0.001, dense_weight_decay: float = 0.0,
                 embedding_kernel: str = "auto", ks: Sequence[int] = (10,), embedding_device: str = "cpu",
                 bucketed_attention: bool = True) -> None:
        super().__init__(num_items, max_len, embedding_dim, dropout, loss, num_negatives, logq_correction,
                         temperature, l2_norm, exclude_history, sparse_optimizer, sparse_lr, dense_optimizer,
                         dense_lr, dense_weight_decay, embedding_kernel, ks, embedding_device, bucketed_attention)
        self.save_hyperparameters()
        if num_items is not None and max_len is not None:
            self._build(num_items, max_len)

    def _encoder(self) -> nn.Module:
        hp = self.hparams
        return HSTUEncoder(hp.embedding_dim, hp.num_blocks, hp.num_heads, hp.attention_dim, hp.value_dim,
                           hp.max_len, hp.num_time_buckets, hp.dropout)
