"""AUC, NE, log loss and CTR against hand-computed numpy references, across simulated ranks, in Lightning."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchmetrics.classification import BinaryAUROC
from torchmetrics.utilities import dim_zero_cat

from lightning_rec.metrics import AUC, CTR, LogLoss, NormalizedEntropy, RecMetricCollection, exact_auc


def ref_auc(scores, labels) -> float:
    """Mann-Whitney: count positive/negative pairs, ties as half (O(P*N), small inputs only)."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels)
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (pos.size * neg.size))


def ref_logloss(probs, labels) -> float:
    p, y = np.asarray(probs, np.float64), np.asarray(labels, np.float64)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def ref_ne(probs, labels) -> float:
    ctr = float(np.mean(np.asarray(labels, np.float64)))
    return ref_logloss(probs, labels) / -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    labels = (torch.rand(600, generator=g) < 0.3).float()
    # rounded logits: many ties, the case where a careless AUC goes wrong
    logits = torch.round((labels * 0.8 + torch.randn(600, generator=g)) * 4) / 4
    return logits, labels


def test_auc_exact_with_ties_over_updates(data):
    logits, labels = data
    auc = AUC()
    for chunk_l, chunk_y in zip(logits.split(128), labels.split(128)):
        auc.update(chunk_l, chunk_y)
    expected = ref_auc(logits.numpy(), labels.numpy())
    assert float(auc.compute()) == pytest.approx(expected, abs=1e-12)
    assert float(BinaryAUROC()(torch.sigmoid(logits), labels.long())) == pytest.approx(expected, abs=1e-6)
    probs_auc = AUC(from_logits=False)
    probs_auc.update(torch.sigmoid(logits).unsqueeze(1), labels)  # [B, 1] is accepted too
    assert float(probs_auc.compute()) == pytest.approx(expected, abs=1e-12)
    assert float(exact_auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0]))) == 1.0
    assert float(exact_auc(torch.tensor([0.9, 0.1]), torch.tensor([0.0, 1.0]))) == 0.0
    assert math.isnan(float(exact_auc(torch.tensor([0.3, 0.4]), torch.tensor([1.0, 1.0]))))


def test_logloss_ne_ctr_match_formulas(data):
    logits, labels = data
    probs = torch.sigmoid(logits.double())
    for from_logits, preds in ((True, logits), (False, probs)):
        ll, ne, ctr = LogLoss(from_logits), NormalizedEntropy(from_logits), CTR(from_logits)
        for metric in (ll, ne, ctr):
            for p, y in zip(preds.split(100), labels.split(100)):
                metric.update(p, y)
        assert float(ll.compute()) == pytest.approx(ref_logloss(probs.numpy(), labels.numpy()), rel=1e-9)
        assert float(ne.compute()) == pytest.approx(ref_ne(probs.numpy(), labels.numpy()), rel=1e-9)
        assert float(ctr.compute()) == pytest.approx(float(labels.double().mean()), rel=1e-12)


def test_ne_of_the_constant_ctr_predictor_is_one(data):
    _, labels = data
    ne = NormalizedEntropy(from_logits=False)
    ne.update(torch.full_like(labels, float(labels.mean())), labels)
    assert float(ne.compute()) == pytest.approx(1.0, rel=1e-9)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="one prediction per sample"):
        LogLoss().update(torch.zeros(4, 2), torch.zeros(4))
    with pytest.raises(ValueError, match="unknown metrics"):
        RecMetricCollection(metrics=("auc", "mrr"))


def _as_rank0_of_two(rank0, rank1) -> None:
    """Make rank0's compute() take torchmetrics' real sync path, with an all_gather giving [rank0, rank1].

    torchmetrics gathers the states in `_reductions` order, list states concatenated first.
    """
    prepared = []
    for attr in rank1._reductions:
        value = getattr(rank1, attr)
        prepared.append(dim_zero_cat(value) if isinstance(value, list) else value)
    others = iter(prepared)
    rank0.dist_sync_fn = lambda t, group=None: [t, next(others)]
    rank0.distributed_available_fn = lambda: True


@pytest.mark.parametrize("cls", [AUC, NormalizedEntropy, LogLoss, CTR])
def test_compute_over_ranks_equals_compute_over_all_data(data, cls):
    logits, labels = data
    whole, rank0, rank1 = cls(), cls(), cls()
    whole.update(logits, labels)
    rank0.update(logits[:250], labels[:250])  # uneven shares, as at the end of an epoch
    rank1.update(logits[250:400], labels[250:400])
    rank1.update(logits[400:], labels[400:])
    _as_rank0_of_two(rank0, rank1)
    assert float(rank0.compute()) == pytest.approx(float(whole.compute()), rel=1e-9)
    alone = cls()
    alone.update(logits[:250], labels[:250])
    assert float(alone.compute()) != pytest.approx(float(whole.compute()), rel=1e-9)


def test_collection_logs_to_progress_bar_in_lightning():
    import lightning.pytorch as pl

    from lightning_rec.data import SyntheticCriteoDataModule

    class Tiny(pl.LightningModule):
        def __init__(self, sizes: list[int]) -> None:
            super().__init__()
            self.tables = torch.nn.ModuleList(torch.nn.EmbeddingBag(n, 4, mode="sum") for n in sizes)
            self.head = torch.nn.Linear(13 + 4 * len(sizes), 1)
            self.val_metrics = RecMetricCollection(prefix="val/")

        def forward(self, batch):
            kjt = batch.sparse_features
            pooled = [t(jt.values(), jt.offsets()[:-1]) for t, jt in zip(self.tables, kjt.to_dict().values())]
            return self.head(torch.cat([batch.dense_features, *pooled], dim=1)).squeeze(1)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(self(batch), batch.labels)
            self.log("train/loss", loss, batch_size=len(batch))
            return loss

        def validation_step(self, batch, batch_idx):
            self.val_metrics.update(self(batch), batch.labels)
            self.val_metrics.log_to(self)

        def configure_optimizers(self):
            return torch.optim.Adagrad(self.parameters(), lr=0.1)

    dm = SyntheticCriteoDataModule(num_train_samples=4096, num_val_samples=2048, batch_size=256,
                                   num_embeddings_per_feature=200)
    trainer = pl.Trainer(
        max_epochs=1, num_sanity_val_steps=0, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_model_summary=False, enable_progress_bar=False,
    )
    model = Tiny(dm.num_embeddings_per_feature)
    trainer.fit(model, dm)
    metrics = trainer.callback_metrics
    assert {"val/auc", "val/ne", "val/logloss", "val/ctr"} <= set(trainer.progress_bar_metrics)
    assert float(metrics["val/auc"]) > 0.6  # the planted signal is learnt
    assert float(metrics["val/ne"]) < 1.0
    val_labels = dm.datasets["val"].labels_N
    assert float(metrics["val/ctr"]) == pytest.approx(float(val_labels.mean()), rel=1e-6)
