"""AUC, NE, log loss, CTR and the ranking metrics against hand-computed references and torchmetrics,
across simulated and real (gloo) ranks, in Lightning; bad labels and one-class sets. The one-label click metrics are
the per-task ones (test_task_metrics.py) over one task: here, the arguments and behaviour they keep."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchmetrics.classification import BinaryAUROC
from torchmetrics.utilities import dim_zero_cat

from lightning_rec.metrics import (
    AUC,
    CTR,
    MRR,
    NDCG,
    BinnedAUC,
    HitRate,
    LogLoss,
    NormalizedEntropy,
    Precision,
    RankingMetrics,
    Recall,
    RecMetricCollection,
    exact_auc,
)
from tests.dist_utils import run_ranks


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
    # one class: 0.5, TorchRec's no-signal value (auc.py), as the per-task AUC gives (it was NaN before they merged)
    assert float(exact_auc(torch.tensor([0.3, 0.4]), torch.tensor([1.0, 1.0]))) == 0.5


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


def test_click_metrics_take_torchmetrics_target_keyword(data):
    """update(preds=..., target=...), torchmetrics' names, was a TypeError (the labels were called `labels`)."""
    logits, labels = data
    for cls in (AUC, BinnedAUC, NormalizedEntropy, LogLoss, CTR):
        by_name, by_place, old_name = cls(), cls(), cls()
        by_name.update(preds=logits, target=labels)
        by_place.update(logits, labels)
        old_name.update(logits, labels=labels)
        assert float(by_name.compute()) == float(by_place.compute()) == float(old_name.compute()), cls.__name__
        with pytest.raises(TypeError, match="target"):
            cls().update(logits, labels, labels=labels)
    collection = RecMetricCollection(prefix="")
    collection.update(preds=logits, target=labels)
    assert float(collection.compute()["auc"]) == pytest.approx(ref_auc(logits.numpy(), labels.numpy()), abs=1e-12)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"predictions of shape \[4, 2\]: give \[B, T\] = \[4, 1\]"):
        LogLoss().update(torch.zeros(4, 2), torch.zeros(4))
    with pytest.raises(ValueError, match="unknown metrics"):
        RecMetricCollection(metrics=("auc", "mrr"))


def test_collection_gives_num_thresholds_to_binned_auc_only(data):
    """RecMetricCollection(metrics=("auc", "binned_auc"), num_thresholds=100) was "Unexpected keyword arguments:
    `num_thresholds`": the keyword went to every metric, and only BinnedAUC has it."""
    logits, labels = data
    collection = RecMetricCollection(prefix="", metrics=("auc", "binned_auc", "ne"), num_thresholds=100)
    collection.update(logits, labels)
    alone = BinnedAUC(num_thresholds=100)
    alone.update(logits, labels)
    assert collection["binned_auc"].num_bins == 100
    assert float(collection.compute()["binned_auc"]) == float(alone.compute())


def _as_rank0_of_two(rank0, rank1) -> None:
    """Make rank0's compute() take torchmetrics' real sync path, with an all_gather giving [rank0, rank1].

    torchmetrics gathers the states in `_reductions` order, list states concatenated first (an empty one as an empty
    tensor).
    """
    prepared = []
    for attr in rank1._reductions:
        value = getattr(rank1, attr)
        prepared.append((dim_zero_cat(value) if value else torch.tensor([])) if isinstance(value, list) else value)
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


# labels outside {0, 1}, one-class sets, binned AUC ----------------------------------------------


@pytest.mark.parametrize("cls", [AUC, BinnedAUC, NormalizedEntropy, LogLoss, CTR])
def test_labels_outside_0_1_are_an_error_naming_the_fix(cls):
    """Counted on the device at update (no host sync per batch, CPU or GPU) and raised at compute, as the per-task
    metrics do: the click metrics raised at once on CPU before they became those."""
    ratings = torch.tensor([1.0, 5.0, 3.0, 4.0])  # the bug report: these gave AUC 1.67
    metric = cls()
    metric.update(torch.randn(4), ratings)
    with pytest.raises(ValueError, match=r"labels not 0 or 1 \(task 'task': 3 of them\).*binarize"):
        metric.compute()
    metric = cls()
    metric.update(torch.randn(4), torch.tensor([0.0, 1.0, 1.0, 0.0]))  # 0/1 as floats or ints: fine
    metric.update(torch.randn(2), torch.tensor([1, 0]))
    assert torch.isfinite(torch.as_tensor(metric.compute())).all()


@pytest.mark.parametrize("cls", [AUC, NormalizedEntropy, LogLoss, CTR])
def test_a_nan_label_is_a_missing_one_left_out(cls, data):
    """NaN was an error here ("unlabelled data has no metric"); the per-task metrics, which these now are, read it as
    a missing label (DLRMModule refuses NaN labels before its forward, so its metrics never see one)."""
    logits, labels = data
    with_nan, without = cls(), cls()
    with_nan.update(torch.cat([logits, torch.tensor([3.0])]), torch.cat([labels, torch.tensor([float("nan")])]))
    without.update(logits, labels)
    assert float(with_nan.compute()) == pytest.approx(float(without.compute()), rel=1e-12)


@pytest.mark.parametrize("cls", [BinnedAUC, NormalizedEntropy, LogLoss])
def test_logits_given_as_probabilities_are_an_error_naming_from_logits(cls):
    """BinnedAUC(from_logits=False) fed logits put them in its end bins: AUC 0.12 where torchmetrics' BinaryAUROC gives
    0.64 (it applies the sigmoid itself); LogLoss and NE raised torch's "between 0 and 1", which names no fix.
    Counted at update, raised at compute (no host sync per batch)."""
    g = torch.Generator().manual_seed(0)
    labels = (torch.rand(400, generator=g) < 0.3).float()
    logits = torch.randn(400, generator=g) * 2 + labels
    metric = cls(from_logits=False)
    metric.update(logits, labels)
    with pytest.raises(ValueError, match=r"predictions outside \[0, 1\] with from_logits=False.*from_logits=True"):
        metric.compute()
    metric = cls(from_logits=False)
    metric.update(torch.sigmoid(logits), labels)
    assert torch.isfinite(torch.as_tensor(metric.compute()))
    metric = cls(from_logits=False)
    metric.update(torch.sigmoid(logits), labels)
    metric.bad_preds += 2  # a count from another rank: raised after the sync
    with pytest.raises(ValueError, match="predictions outside .*task 'task': 2 of them"):
        metric.compute()


@pytest.mark.parametrize("cls", [AUC, BinnedAUC])
def test_auc_of_one_class_is_half_with_a_warning_and_of_no_rows_nan(cls):
    """One class gave NaN; TorchRec's AUC gives 0.5 there (auc.py: "the no-signal default value"), and so does the
    per-task AUC these now are: the warning says it."""
    for labels in (torch.ones(5), torch.zeros(5)):
        metric = cls()
        metric.update(torch.randn(5), labels)
        with pytest.warns(UserWarning, match="one class only.*AUC 0.5, as TorchRec gives"):
            assert float(metric.compute()) == 0.5
    # an empty evaluation set was said to hold "only negative labels (0 positive, 0 negative)"
    for given in ([], [(torch.empty(0), torch.empty(0))]):
        empty = cls()
        for preds, labels in given:
            empty.update(preds, labels)
        with pytest.warns(UserWarning, match=rf"^{cls.__name__}: the evaluation set is empty for task\(s\) task"):
            assert math.isnan(float(empty.compute()))


def test_ne_of_one_class_is_large_not_minus_inf():
    """All-positive labels gave NE = -inf (loss / -0.0): the best score there is for a lower-is-better metric. Then
    NaN; now TorchRec's value (ne.py clamps the click rate to 1e-12), far above 1 (no skill), with a warning."""
    for labels in (torch.ones(5), torch.zeros(5)):
        metric = NormalizedEntropy()
        metric.update(torch.randn(5, generator=torch.Generator().manual_seed(0)), labels)
        with pytest.warns(UserWarning, match="one class only"):
            assert float(metric.compute()) > 1e6


def test_binned_auc_is_close_to_exact_and_bins_the_edges(data):
    logits, labels = data
    binned, exact = BinnedAUC(num_thresholds=1000), AUC()
    for chunk_l, chunk_y in zip(logits.split(100), labels.split(100)):
        binned.update(chunk_l, chunk_y)
        exact.update(chunk_l, chunk_y)
    assert float(binned.compute()) == pytest.approx(float(exact.compute()), abs=2e-3)
    # probabilities 0 and 1 fall in the first and last bin, each bin [k / n, (k + 1) / n)
    edge = BinnedAUC(num_thresholds=5, from_logits=False)
    edge.update(torch.tensor([0.0, 1.0, 0.2, 0.19]), torch.tensor([0.0, 1.0, 1.0, 0.0]))
    assert edge.pos_hist[0].tolist() == [0, 1, 0, 0, 1] and edge.neg_hist[0].tolist() == [2, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="num_thresholds"):
        BinnedAUC(num_thresholds=1)


def test_exact_auc_keeps_confident_logits_apart_where_binary_auroc_ties_them():
    # float32 sigmoid rounds every logit above ~17 to 1.0: BinaryAUROC sees ties, ours the true order
    logits = torch.tensor([18.0, 19.0, 20.0, 21.0, 22.0, 23.0])
    labels = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    auc = AUC()
    auc.update(logits, labels)
    assert float(auc.compute()) == 1.0
    assert float(BinaryAUROC()(logits, labels.long())) == pytest.approx(0.5)


# ranking metrics ---------------------------------------------------------------------------------


def test_ranking_metrics_hand_computed():
    # user 0: relevant items {1, 3}; ranking by score: 3, 0, 1, 2 -> hits at ranks 1 and 3
    # user 1: relevant item {2};    ranking: 0, 1, 2, 3       -> hit at rank 3
    scores = torch.tensor([[0.8, 0.3, 0.1, 0.9], [0.9, 0.5, 0.4, 0.1]])
    target = torch.tensor([[0, 1, 0, 1], [0, 0, 1, 0]])
    m = RankingMetrics(ks=[1, 3])
    m.update(scores, target)
    got = {k: float(v) for k, v in m.compute().items()}
    d = [1 / math.log2(j + 1) for j in range(1, 5)]
    expected = {
        "ndcg@1": (1.0 + 0.0) / 2, "ndcg@3": ((d[0] + d[2]) / (d[0] + d[1]) + d[2] / d[0]) / 2,
        "recall@1": (0.5 + 0) / 2, "recall@3": (1.0 + 1.0) / 2,
        "precision@1": (1 + 0) / 2, "precision@3": (2 / 3 + 1 / 3) / 2,
        "mrr@1": (1 + 0) / 2, "mrr@3": (1 + 1 / 3) / 2,
        "hit_rate@1": 0.5, "hit_rate@3": 1.0,
    }
    assert got == pytest.approx(expected, abs=1e-12)
    assert float(NDCG(ks=3)(scores, target)) == pytest.approx(expected["ndcg@3"], abs=1e-12)
    assert set(Recall(ks=[1, 3])(scores, target)) == {"recall@1", "recall@3"}


def test_a_relevant_item_scored_nan_is_never_found():
    """topk ranks NaN first: a held-out item the model scored NaN counted as found at rank 1 (NDCG 1.0)."""
    scores = torch.tensor([[0.1, 0.2, float("nan"), 0.3, 0.4], [0.1, 0.2, float("nan"), 0.3, 0.4]])
    target = torch.tensor([[0, 0, 1, 0, 0], [0, 0, 1, 0, 1]])
    m = RankingMetrics(ks=[1, 5])
    m.update(scores, target)
    with pytest.warns(UserWarning, match="2 of the scores are NaN"):  # counted on the device, said at compute
        got = {k: float(v) for k, v in m.compute().items()}
    # user 0: its only relevant item is never found, even at k=5 (every item ranked); user 1: item 4 at rank 1
    assert got["hit_rate@1"] == got["hit_rate@5"] == got["ndcg@1"] == 0.5
    assert got["recall@1"] == got["recall@5"] == pytest.approx((0 + 0.5) / 2)


def _random_lists(seed, num_users=40, num_items=30):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_users, num_items, generator=g, dtype=torch.float64).float()  # distinct: no ties
    target = torch.rand(num_users, num_items, generator=g) < 0.15
    target[3] = False  # a user with nothing held out: skipped by both
    return scores, target


@pytest.mark.parametrize("k", [1, 5, 10, 30])
def test_ranking_metrics_equal_torchmetrics_retrieval(k):
    from torchmetrics import retrieval as tr

    scores, target = _random_lists(k)
    indexes = torch.arange(scores.shape[0]).unsqueeze(1).expand_as(scores)
    # empty_target_action="skip": a user with nothing held out has no value (torchmetrics' default counts 0)
    references = {
        "ndcg": tr.RetrievalNormalizedDCG(top_k=k, empty_target_action="skip"),
        "recall": tr.RetrievalRecall(top_k=k, empty_target_action="skip"),
        "precision": tr.RetrievalPrecision(top_k=k, empty_target_action="skip"),
        "mrr": tr.RetrievalMRR(top_k=k, empty_target_action="skip"),
        "hit_rate": tr.RetrievalHitRate(top_k=k, empty_target_action="skip"),
    }
    ours = RankingMetrics(ks=[k])
    for rows in torch.arange(scores.shape[0]).split(16):  # batches of users
        ours.update(scores[rows], target[rows])
    got = ours.compute()
    for name, ref in references.items():
        want = ref(scores.reshape(-1), target.reshape(-1), indexes=indexes.reshape(-1))
        assert float(got[f"{name}@{k}"]) == pytest.approx(float(want), abs=1e-6), name
    empty = int((target.sum(1) == 0).sum())
    assert empty >= 1 and int(ours.skipped_users) == empty and int(ours.num_users) == scores.shape[0] - empty
    singles = {"ndcg": NDCG, "recall": Recall, "precision": Precision, "mrr": MRR, "hit_rate": HitRate}
    for name, cls in singles.items():
        assert float(cls(ks=k)(scores, target)) == pytest.approx(float(got[f"{name}@{k}"]), abs=1e-12)


def test_ranking_metrics_take_torchmetrics_flat_indexes_and_top_k():
    """torchmetrics' retrieval form, update(preds, target, indexes) with flat tensors and top_k=, was refused (no
    top_k) or misread (the third positional argument was a mask)."""
    from torchmetrics import retrieval as tr

    scores, target = _random_lists(11, num_users=30, num_items=12)
    g = torch.Generator().manual_seed(2)
    keep = torch.rand(scores.shape, generator=g) < 0.7  # lists of different lengths
    ids = torch.randperm(1000, generator=g)[: scores.shape[0]]  # any ids, not 0..U-1
    indexes = ids.unsqueeze(1).expand_as(scores)[keep]
    preds, relevant = scores[keep], target[keep]
    order = torch.randperm(preds.numel(), generator=g)  # entries of one user need not be together
    preds, relevant, indexes = preds[order], relevant[order], indexes[order]
    references = {NDCG: tr.RetrievalNormalizedDCG, Recall: tr.RetrievalRecall, Precision: tr.RetrievalPrecision,
                  MRR: tr.RetrievalMRR, HitRate: tr.RetrievalHitRate}
    for k in (3, 10):  # 10: longer than some lists
        for ours, theirs in references.items():
            want = theirs(top_k=k, empty_target_action="skip")(preds, relevant, indexes=indexes)
            metric = ours(top_k=k)
            metric.update(preds, relevant, indexes)  # positional, as torchmetrics takes it
            assert float(metric.compute()) == pytest.approx(float(want), abs=1e-6), (ours.__name__, k)
            assert float(ours(top_k=k)(preds=preds, target=relevant, indexes=indexes)) == pytest.approx(
                float(want), abs=1e-6)
    # the same as the padded candidate form
    padded = RankingMetrics(top_k=5)
    padded.update(scores, target, mask=keep)
    flat = RankingMetrics(ks=5)
    flat.update(preds, relevant, indexes=indexes)
    for key, value in padded.compute().items():
        assert float(flat.compute()[key]) == pytest.approx(float(value), abs=1e-12), key
    with pytest.raises(ValueError, match="mask="):  # a bool mask where torchmetrics puts indexes
        RankingMetrics(ks=5).update(scores, target, keep)
    with pytest.raises(ValueError, match="give one of them"):
        NDCG(ks=5, top_k=10)
    # torchmetrics' top_k=None ranks whole lists: it was taken as the default cutoff, NDCG@10, without a word
    for cls in (NDCG, RankingMetrics):
        with pytest.raises(ValueError, match=r"top_k=None is torchmetrics' 'every item.*give top_k=K"):
            cls(top_k=None)
    assert NDCG().ks == RankingMetrics().ks == (10,)


def _csr(rows_of_items):
    lengths = torch.tensor([len(r) for r in rows_of_items])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    items = torch.tensor([i for r in rows_of_items for i in r], dtype=torch.int64)
    return offsets, items


def test_full_ranking_excludes_training_items_and_equals_candidates_without_them():
    from torchmetrics.retrieval import RetrievalNormalizedDCG

    scores, target = _random_lists(7)
    g = torch.Generator().manual_seed(1)
    seen = (torch.rand(scores.shape, generator=g) < 0.3) & ~target  # training items
    seen[0, target[0].nonzero()[0]] = True  # a held-out item also seen in training is still ranked
    t_off, t_items = _csr([r.nonzero().flatten().tolist() for r in target])
    x_off, x_items = _csr([r.nonzero().flatten().tolist() for r in seen])
    full = RankingMetrics(ks=[5, 10])
    full.update_full(scores, t_off, t_items, x_off, x_items)
    candidates = RankingMetrics(ks=[5, 10])
    candidates.update(scores, target, mask=~seen | target)
    for key, value in full.compute().items():
        assert float(value) == pytest.approx(float(candidates.compute()[key]), abs=1e-12), key
    # against torchmetrics on the items that are not excluded
    keep = ~seen | target
    indexes = torch.arange(scores.shape[0]).unsqueeze(1).expand_as(scores)
    ndcg = RetrievalNormalizedDCG(top_k=10, empty_target_action="skip")
    ref = ndcg(scores[keep], target[keep], indexes=indexes[keep])
    assert float(full.compute()["ndcg@10"]) == pytest.approx(float(ref), abs=1e-6)
    # and excluding changes the answer (the test can fail)
    plain = RankingMetrics(ks=[10])
    plain.update(scores, target)
    assert float(plain.compute()["ndcg@10"]) != pytest.approx(float(full.compute()["ndcg@10"]), abs=1e-6)


def test_ranking_bad_input():
    m = RankingMetrics(ks=[10])
    scores = torch.rand(3, 5)
    off, items = _csr([[1], [], [7]])  # item 7 of 5 scored items
    with pytest.raises(ValueError, match=r"item ids \[7\].*score every item"):
        m.update_full(scores, off, items)
    with pytest.raises(ValueError, match="U \\+ 1 offsets"):
        m.update_full(scores, off[:-1], torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="binarize"):
        m.update(scores, torch.full((3, 5), 4.0))
    with pytest.raises(ValueError, match="ks="):
        RankingMetrics(ks=[0])
    with pytest.raises(ValueError, match="unknown ranking metrics"):
        RankingMetrics(metrics=["auc"])
    # a user with no held-out item is skipped and counted, never a division by zero
    off, items = _csr([[1], [], [3]])
    with pytest.warns(UserWarning, match="larger than the 5 items"):  # K=10 > 5 items
        m.update_full(scores, off, items)
    out = m.compute()
    assert int(m.skipped_users) == 1 and int(m.num_users) == 2
    assert float(out["recall@10"]) == 1.0 and float(out["precision@10"]) == pytest.approx(0.1)
    assert all(math.isfinite(float(v)) for v in out.values())
    nobody = RankingMetrics(ks=[2])
    nobody.update(torch.rand(2, 4), torch.zeros(2, 4))
    with pytest.warns(UserWarning, match="no user"):
        assert math.isnan(float(nobody.compute()["ndcg@2"]))


def _ranks_compute(rank, world_size, scores, target):
    torch.manual_seed(rank)
    metric = RankingMetrics(ks=[5, 10, 20])
    mine = torch.arange(scores.shape[0])[rank::world_size]  # an uneven share of users per rank
    for rows in mine.split(7):
        metric.update(scores[rows], target[rows])
    return {k: v.float() for k, v in metric.compute().items()}, {k: float(v) for k, v in metric.compute().items()}


def _flat_batches(seed=0, n=600, users=20):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g), torch.rand(n, generator=g) < 0.2, torch.randint(0, users, (n,), generator=g))


def test_flat_form_keeps_64_bit_ids_apart():
    """indexes were kept as float64: hashed user ids above 2**53 that differ in their last bits became one user."""
    from torchmetrics import retrieval as tr

    for base in (2**60, -(2**62) - 7, 0):
        indexes = torch.tensor([base, base, base + 1, base + 1, base - 1])
        preds, target = torch.tensor([0.9, 0.1, 0.8, 0.2, 0.5]), torch.tensor([0, 1, 1, 0, 1])
        ours, ref = NDCG(top_k=1), tr.RetrievalNormalizedDCG(top_k=1)
        ours.update(preds, target, indexes)
        ref.update(preds, target, indexes)
        assert float(ours.compute()) == pytest.approx(float(ref.compute())) == pytest.approx(2 / 3), base


def test_flat_form_groups_a_users_entries_across_updates_as_torchmetrics():
    """Rows of (user, item, label) in batches: each update was regrouped alone, so a user whose entries came in 6
    batches counted as 6 users with partial lists (NDCG@5 0.64, Recall@5 0.87; torchmetrics: 0.27, 0.23)."""
    from torchmetrics import retrieval as tr

    preds, target, indexes = _flat_batches()
    ours = RankingMetrics(ks=[5])
    theirs = {"ndcg@5": tr.RetrievalNormalizedDCG(top_k=5), "recall@5": tr.RetrievalRecall(top_k=5),
              "mrr@5": tr.RetrievalMRR(top_k=5), "hit_rate@5": tr.RetrievalHitRate(top_k=5)}
    for rows in torch.arange(600).split(100):
        ours.update(preds[rows], target[rows], indexes[rows])
        for metric in theirs.values():
            metric.update(preds[rows], target[rows], indexes=indexes[rows])
    got = ours.compute()
    for key, metric in theirs.items():
        assert float(got[key]) == pytest.approx(float(metric.compute()), abs=1e-6), key


def _flat_ranks_compute(rank, world_size, only_rank0):
    preds, target, indexes = _flat_batches()
    metric = RankingMetrics(ks=[5])
    mine = torch.arange(600) if only_rank0 else torch.arange(600)[rank::world_size]  # users' entries on both
    for rows in mine.split(50) if rank == 0 or not only_rank0 else ():
        metric.update(preds[rows], target[rows], indexes[rows])
    return {k: float(v) for k, v in metric.compute().items()}


@pytest.mark.parametrize("only_rank0", [False, True])
def test_flat_form_identical_when_a_users_entries_are_on_two_ranks(only_rank0):
    """only_rank0: the other rank's empty state is torchmetrics' float64 placeholder, which gloo aborted the process
    gathering against int64 ids: every flat state is float64."""
    preds, target, indexes = _flat_batches()
    single = RankingMetrics(ks=[5])
    single.update(preds, target, indexes)
    want = {k: float(v) for k, v in single.compute().items()}
    for got in run_ranks(_flat_ranks_compute, 2, only_rank0, timeout=120):
        assert got == pytest.approx(want, abs=1e-12)


def test_ranking_metrics_identical_at_1_2_and_4_ranks():
    scores, target = _random_lists(3, num_users=101, num_items=50)
    single = RankingMetrics(ks=[5, 10, 20])
    single.update(scores, target)
    want32 = {k: v.float() for k, v in single.compute().items()}
    for world_size in (2, 4):
        for got32, got64 in run_ranks(_ranks_compute, world_size, scores, target, timeout=120):
            for key in want32:
                assert torch.equal(got32[key], want32[key]), (world_size, key)
                assert got64[key] == pytest.approx(float(single.compute()[key]), abs=1e-14)


# empty_target_action: torchmetrics' argument, with its meaning for each value -------------------------------------

_EMPTY_ACTIONS = ("skip", "neg", "pos", "error")


def _lists_with_empty_users():
    """Per-user [U, C] lists (5 users have no relevant item) and the flat (preds, target, indexes) form of the same
    lists with some entries dropped (9 users then have none) and shuffled, under ids that are not 0..U-1."""
    scores, target = _random_lists(5, num_users=30, num_items=12)
    target[[8, 21]] = False
    g = torch.Generator().manual_seed(4)
    keep = torch.rand(scores.shape, generator=g) < 0.7
    ids = torch.randperm(1000, generator=g)[: scores.shape[0]]
    order = torch.randperm(int(keep.sum()), generator=g)
    flat = (scores[keep][order], target[keep][order], ids.unsqueeze(1).expand_as(scores)[keep][order])
    return scores, target, flat


def _torchmetrics_values(preds, target, indexes, k, action):
    from torchmetrics import retrieval as tr

    refs = {"ndcg": tr.RetrievalNormalizedDCG, "recall": tr.RetrievalRecall, "precision": tr.RetrievalPrecision,
            "mrr": tr.RetrievalMRR, "hit_rate": tr.RetrievalHitRate}
    return {f"{name}@{k}": float(cls(top_k=k, empty_target_action=action)(preds, target, indexes=indexes))
            for name, cls in refs.items()}


@pytest.mark.parametrize("action", _EMPTY_ACTIONS)
@pytest.mark.parametrize("k", [1, 5])
def test_empty_target_action_equals_torchmetrics_per_user_and_flat(action, k):
    """Users with no relevant item were always skipped: torchmetrics' empty_target_action ("neg" its default, "pos",
    "error") was refused as an unknown argument, so its numbers could not be reproduced here."""
    scores, target, (preds, relevant, indexes) = _lists_with_empty_users()
    users = torch.arange(scores.shape[0]).unsqueeze(1).expand_as(scores)
    per_user = RankingMetrics(ks=[k], empty_target_action=action)
    for rows in torch.arange(scores.shape[0]).split(7):  # batches of users
        per_user.update(scores[rows], target[rows])
    flat = RankingMetrics(ks=[k], empty_target_action=action)
    for rows in torch.arange(preds.numel()).split(50):  # a user's entries spread over updates
        flat.update(preds[rows], relevant[rows], indexes[rows])
    if action == "error":
        with pytest.raises(ValueError, match="no positive target"):
            _torchmetrics_values(preds, relevant, indexes, k, action)
        for ours in (per_user, flat):
            with pytest.raises(ValueError, match=r"\d users have no relevant.*empty_target_action='skip'"):
                ours.compute()
        return
    want = _torchmetrics_values(scores.reshape(-1), target.reshape(-1), users.reshape(-1), k, action)
    assert {key: float(v) for key, v in per_user.compute().items()} == pytest.approx(want, abs=1e-6)
    want_flat = _torchmetrics_values(preds, relevant, indexes, k, action)
    assert {key: float(v) for key, v in flat.compute().items()} == pytest.approx(want_flat, abs=1e-6)
    empty = int((target.sum(1) == 0).sum())
    skipped = empty if action == "skip" else 0
    assert empty == 5 and int(per_user.skipped_users) == skipped and int(per_user.num_users) == 30 - skipped
    # the one-metric classes take it too, and the actions differ on these users (the test can fail)
    values = {a: float(NDCG(top_k=k, empty_target_action=a)(scores, target)) for a in ("skip", "neg", "pos")}
    assert values[action] == pytest.approx(want[f"ndcg@{k}"], abs=1e-6)
    assert values["neg"] < values["skip"] < values["pos"]


def _empty_action_ranks(rank, world_size, action):
    scores, target, (preds, relevant, indexes) = _lists_with_empty_users()
    per_user, flat = RankingMetrics(ks=[1, 5], empty_target_action=action), RankingMetrics(
        ks=[1, 5], empty_target_action=action)
    per_user.update(scores[rank::world_size], target[rank::world_size])  # an uneven share of users per rank
    flat.update(preds[rank::world_size], relevant[rank::world_size], indexes[rank::world_size])  # users on both
    out = []
    for metric in (per_user, flat):
        try:
            out.append({key: float(v) for key, v in metric.compute().items()})
        except ValueError as e:  # every rank raises, after the sync: none waits for the other
            out.append(str(e))
    return out


def test_empty_target_action_identical_at_two_ranks():
    scores, target, (preds, relevant, indexes) = _lists_with_empty_users()
    users = torch.arange(scores.shape[0]).unsqueeze(1).expand_as(scores)
    for action in _EMPTY_ACTIONS:
        got = run_ranks(_empty_action_ranks, 2, action, timeout=120)
        if action == "error":
            # 5 users without a relevant item per user, 9 in the flat form (entries dropped), counted over both ranks
            assert len(got) == 2 and all(msg.startswith(f"{n} users have no relevant")
                                         for rank in got for n, msg in zip((5, 9), rank, strict=True)), got
            continue
        for per_user, flat in got:
            for k in (1, 5):
                want = _torchmetrics_values(scores.reshape(-1), target.reshape(-1), users.reshape(-1), k, action)
                assert {key: v for key, v in per_user.items() if key.endswith(f"@{k}")} == pytest.approx(want,
                                                                                                      abs=1e-6)
                want = _torchmetrics_values(preds, relevant, indexes, k, action)
                assert {key: v for key, v in flat.items() if key.endswith(f"@{k}")} == pytest.approx(want, abs=1e-6)


def test_empty_target_action_unknown_value_names_the_choices():
    with pytest.raises(ValueError, match="'skip', 'neg', 'pos', 'error'"):
        RankingMetrics(ks=5, empty_target_action="zero")


def test_ranking_metrics_in_a_metric_collection_keep_their_own_k_and_action():
    """MetricCollection shares one state between metrics whose states are equal after the first update: with sums per
    asked k, NDCG(top_k=5) beside NDCG(top_k=10) (and "skip" beside "neg") looked alike on a first batch without a hit,
    and each then reported the other's value (NDCG@5 0.2006, the NDCG@10, where alone it is 0.125)."""
    from torchmetrics import MetricCollection

    torch.manual_seed(0)
    first_P, first_T = torch.rand(4, 20), torch.zeros(4, 20, dtype=torch.bool)
    first_T[:, 0], first_P[:, 0] = True, -1.0  # every relevant item ranked last: no hit at any k <= 10
    second_P, second_T = torch.rand(4, 20), torch.zeros(4, 20, dtype=torch.bool)
    second_T[:3, 3], second_P[:, 3] = True, torch.tensor([0.5, 0.5, 2.0, 0.5])  # the last user has no relevant item
    made = {"n5": lambda: NDCG(top_k=5), "n10": lambda: NDCG(top_k=10), "r10": lambda: Recall(ks=[5, 10]),
            "n10_neg": lambda: NDCG(top_k=10, empty_target_action="neg")}
    together, alone = MetricCollection({k: f() for k, f in made.items()}), {k: f() for k, f in made.items()}
    for preds, target in ((first_P, first_T), (second_P, second_T)):
        together.update(preds, target)
        for metric in alone.values():
            metric.update(preds, target)
    got = together.compute()
    for name, metric in alone.items():
        want = metric.compute()
        want = want if isinstance(want, dict) else {"": want}
        for key, value in want.items():
            assert float(got[name if not key else key]) == pytest.approx(float(value), abs=1e-12), name
    assert float(alone["n5"].compute()) != pytest.approx(float(alone["n10"].compute()))
    assert float(alone["n10"].compute()) != pytest.approx(float(alone["n10_neg"].compute()))


def test_ignore_index_leaves_entries_out_as_torchmetrics_and_other_retrieval_arguments_name_the_fix():
    """torchmetrics' ignore_index was refused as an "Unexpected keyword argument" of Metric, and entries holding it
    (padding, -100) as non-0/1 relevance; adaptive_k and aggregation got the same message, naming nothing."""
    from torchmetrics import retrieval as tr

    g = torch.Generator().manual_seed(0)
    preds = torch.rand(400, generator=g)  # > 0: torchmetrics 1.9 counts no item scored <= 0 in Recall / MRR
    target = (torch.rand(400, generator=g) < 0.2).long()
    target[torch.rand(400, generator=g) < 0.3] = -100
    indexes = torch.randint(0, 30, (400,), generator=g)
    refs = {"ndcg": tr.RetrievalNormalizedDCG, "recall": tr.RetrievalRecall, "precision": tr.RetrievalPrecision,
            "mrr": tr.RetrievalMRR, "hit_rate": tr.RetrievalHitRate}
    want = {f"{n}@5": float(cls(top_k=5, ignore_index=-100)(preds, target, indexes=indexes)) for n, cls in refs.items()}
    flat = RankingMetrics(ks=5, ignore_index=-100, empty_target_action="neg")
    flat.update(preds, target, indexes)
    assert {k: float(v) for k, v in flat.compute().items()} == pytest.approx(want, abs=1e-6)
    # the candidate form: an ignored entry is no candidate (as padding under mask=False)
    preds_UC, target_UC = preds[:240].reshape(30, 8), target[:240].reshape(30, 8)
    lists = RankingMetrics(ks=3, ignore_index=-100, empty_target_action="neg")
    lists.update(preds_UC, target_UC)
    want = {f"{n}@3": float(cls(top_k=3, ignore_index=-100)(preds[:240], target[:240],
                                                             indexes=torch.arange(30).repeat_interleave(8)))
            for n, cls in refs.items()}
    assert {k: float(v) for k, v in lists.compute().items()} == pytest.approx(want, abs=1e-6)
    with pytest.raises(ValueError, match="ignore_index"):
        RankingMetrics(ks=5).update(preds, target, indexes)
    with pytest.raises(ValueError, match="adaptive_k=True .* Recall@k"):
        Precision(top_k=3, adaptive_k=True)
    with pytest.raises(ValueError, match="aggregation='median'.*torchmetrics.retrieval"):
        NDCG(top_k=3, aggregation="median")


def test_a_score_nan_in_the_flat_form_is_said_as_in_the_other_forms():
    """update(preds, target, indexes) with a NaN score ranked it last, as the other forms do, but compute() said
    nothing (the candidate and full forms warn): a diverged model's flat scores gave quiet numbers."""
    preds = torch.tensor([float("nan"), 0.5, 0.2, 0.9, 0.1, 0.3])
    target = torch.tensor([1, 0, 0, 1, 0, 0])
    flat, lists = RankingMetrics(ks=2), RankingMetrics(ks=2)
    flat.update(preds, target, torch.tensor([0, 0, 0, 1, 1, 1]))
    lists.update(preds.view(2, 3), target.view(2, 3))
    for metric in (flat, lists):
        with pytest.warns(UserWarning, match="1 of the scores are NaN: ranked last"):
            assert float(metric.compute()["ndcg@2"]) == 0.5
