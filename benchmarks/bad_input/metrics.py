"""Metrics: labels and shapes they refuse, results against torchmetrics."""

from __future__ import annotations

import warnings

from .helpers import T, _t
from .registry import case, expect, simple

SMOKE = ("metric.auc_label_two", "metric.auc_ties_correct", "metric.ndcg_k_zero", "more.binned_auc_nan_scores",
         "metric.task_label_two", "metric.gauc_one_row_per_group")


def upd(m, p, lab):
    m.update(p, lab)
    return m.compute()


def _expect_close(v, x):
    expect(abs(float(v) - x) < 1e-6, f"{float(v)} != {x}")


def metric_label_cases() -> None:
    """Labels and scores the binary metrics refuse; ties, NaN and one class."""
    torch = _t()
    from lightning_rec import AUC, CTR, BinnedAUC, LogLoss, NormalizedEntropy

    simple("metric.auc_label_two", lambda: upd(AUC(), T([0.1, 0.2, 0.3]), T([0, 1, 2])), ValueError,
           ["0", "1", "label"])
    simple("metric.auc_label_half", lambda: upd(AUC(), T([0.1, 0.2]), T([0.5, 1.0])), ValueError, ["label"])
    simple("metric.auc_label_minus_one", lambda: upd(AUC(), T([0.1, 0.2]), T([-1, 1])), ValueError, ["label"])
    simple("metric.ne_label_two", lambda: upd(NormalizedEntropy(), T([0.1, 0.2]), T([2.0, 1.0])), ValueError, ["label"])
    simple("metric.logloss_label_nan_left_out", lambda: _expect_close(
        upd(LogLoss(), T([0.1, 0.2]), T([float("nan"), 1.0])), float(torch.nn.functional.softplus(T(-0.2)))),
           ValueError, ["label"], ok=True, legit="a NaN label is a missing one: its row is left out")
    simple("metric.ctr_labels_bool", lambda: _expect_close(upd(CTR(), T([0.1, 0.2]), T([True, False])), 0.5),
           ValueError, ["label"], ok=True, legit="bool labels are 0/1")
    simple("metric.binned_auc_label_three", lambda: upd(BinnedAUC(), T([0.1, 0.2]), T([3, 1])), ValueError, ["label"])
    simple("metric.auc_shape_mismatch", lambda: upd(AUC(), T([0.1, 0.2, 0.3]), T([0, 1])), ValueError, ["shape"])
    simple("metric.binned_auc_zero_thresholds", lambda: BinnedAUC(num_thresholds=0), ValueError, ["num_thresholds"])

    @case("metric.auc_nan_score", ValueError, ["nan"], ok=True,
          legit="a NaN score makes the AUC undefined: NaN out is honest")
    def _(ctx):
        v = upd(AUC(from_logits=False), T([0.1, float("nan"), 0.3, 0.9]), T([0, 1, 0, 1]))
        expect(bool(torch.isnan(v)), f"AUC with a NaN score is {float(v)}, a number that looks valid")

    @case("metric.auc_ties_correct")
    def _(ctx):
        # all scores tied: AUC 0.5; mixed ties: Mann-Whitney with half credit
        v = upd(AUC(), T([0.3, 0.3, 0.3, 0.3]), T([0, 1, 0, 1]))
        expect(abs(float(v) - 0.5) < 1e-6, f"tied AUC {float(v)}")
        v = upd(AUC(), T([0.1, 0.4, 0.4, 0.8]), T([0, 0, 1, 1]))
        expect(abs(float(v) - 0.875) < 1e-6, f"AUC {float(v)} != 0.875")

    @case("metric.auc_empty_set_says_empty", legit="an empty evaluation set: AUC undefined, NaN with a warning "
          "that says it is empty")
    def _(ctx):
        for cls in (AUC, BinnedAUC):
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                v = upd(cls(), T([]), T([]))
            expect(bool(torch.isnan(v)), f"{cls.__name__} of an empty set {float(v)}")
            expect(any("evaluation set is empty" in str(w.message) for w in said),
                   f"{cls.__name__}: no warning says the set is empty: {[str(w.message) for w in said]}")

    @case("metric.auc_one_class_half", legit="one class only: AUC 0.5 (TorchRec's no-signal value), with a warning")
    def _(ctx):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            v = upd(AUC(), T([0.1, 0.2]), T([1, 1]))
        expect(float(v) == 0.5, f"one-class AUC {float(v)}")
        expect(any("one class only" in str(w.message) for w in said), f"no word of one class: {said}")


def ranking_metric_cases() -> None:
    """Ranking metrics: k, shapes, full-ranking offsets, torchmetrics' values."""
    torch = _t()
    from lightning_rec import NDCG, RankingMetrics, Recall

    simple("metric.ndcg_k_zero", lambda: NDCG(ks=0), ValueError, ["k"])
    simple("metric.recall_k_negative", lambda: Recall(ks=[5, -1]), ValueError, ["-1"])
    simple("metric.ranking_unknown_metric", lambda: RankingMetrics(metrics=["ndcg", "f1"]), ValueError,
           ["'f1'", "ndcg"])
    simple("metric.ndcg_k_float", lambda: NDCG(ks=2.5), ValueError, ["2.5"])

    @case("metric.ndcg_target_shape_mismatch", ValueError, ["shape"])
    def _(ctx):
        m = NDCG(ks=2)
        m.update(torch.rand(3, 5), torch.zeros(3, 4, dtype=torch.bool))
        m.compute()

    @case("metric.full_target_item_out_of_range", ValueError, ["item", "5"])
    def _(ctx):
        m = NDCG(ks=2)
        m.update_full(torch.rand(2, 5), T([0, 1, 2]), T([1, 5]))
        m.compute()

    @case("metric.full_target_offsets_decreasing", ValueError, ["offsets"])
    def _(ctx):
        m = Recall(ks=2)
        m.update_full(torch.rand(2, 5), T([0, 2, 1]), T([1, 2]))
        m.compute()

    @case("metric.full_offsets_wrong_count", ValueError, ["offsets", "users"])
    def _(ctx):
        m = Recall(ks=2)
        m.update_full(torch.rand(3, 5), T([0, 1, 2]), T([1, 2]))
        m.compute()

    @case("metric.ndcg_matches_torchmetrics")
    def _(ctx):
        from torchmetrics.retrieval import RetrievalNormalizedDCG
        torch.manual_seed(0)
        preds, target = torch.rand(4, 6), torch.rand(4, 6) > 0.6
        target[:, 0] = True
        m = NDCG(ks=3)
        m.update(preds, target)
        ours = m.compute()
        ref = RetrievalNormalizedDCG(top_k=3)
        ref.update(preds.flatten(), target.flatten(), indexes=torch.arange(4).repeat_interleave(6))
        ours = ours if isinstance(ours, torch.Tensor) else next(iter(ours.values()))
        expect(torch.allclose(ours.float(), ref.compute().float(), atol=1e-5), f"NDCG {ours} vs {ref.compute()}")

    @case("metric.recall_user_without_relevant", legit="torchmetrics' default: such users are left out or count 0;"
          " documented either way, never NaN")
    def _(ctx):
        m = Recall(ks=2)
        m.update(T([[0.9, 0.1, 0.5], [0.2, 0.3, 0.1]]), T([[True, False, False], [False, False, False]]))
        v = m.compute()
        v = v if isinstance(v, torch.Tensor) else next(iter(v.values()))
        expect(bool(torch.isfinite(v)), f"recall {v}")


def more_metric_cases() -> None:
    """Second wave: k above the candidates, NaN scores binned, top-k shapes."""
    torch = _t()
    from lightning_rec import NDCG, BinnedAUC

    @case("more.ndcg_k_above_items", legit="k larger than the candidate list: all of it is ranked")
    def _(ctx):
        from torchmetrics.retrieval import RetrievalNormalizedDCG
        preds, target = T([[0.9, 0.1, 0.5], [0.2, 0.3, 0.1]]), T([[True, False, True], [False, True, False]])
        m = NDCG(ks=100)
        m.update(preds, target)
        v = m.compute()
        v = v if isinstance(v, torch.Tensor) else next(iter(v.values()))
        ref = RetrievalNormalizedDCG(top_k=100)
        ref.update(preds.flatten(), target.flatten(), indexes=torch.arange(2).repeat_interleave(3))
        expect(abs(float(v) - float(ref.compute())) < 1e-5, f"NDCG@100 {float(v)} vs {float(ref.compute())}")

    @case("more.binned_auc_nan_scores", ValueError, ["nan"], ok=True, legit="NaN out for NaN scores is honest")
    def _(ctx):
        m = BinnedAUC(num_thresholds=100, from_logits=False)
        m.update(T([0.1, float("nan"), 0.3, 0.9]), T([0, 1, 0, 1]))
        v = m.compute()
        expect(bool(torch.isnan(v)), f"BinnedAUC with a NaN score is {float(v)}")

    @case("more.ranking_topk_hits_shape", ValueError, ["hits"])
    def _(ctx):
        m = NDCG(ks=2)
        m.update_topk(torch.ones(3, 2, dtype=torch.bool), T([1, 1]))
        m.compute()


def task_metric_cases() -> None:
    """Per-task metrics: bad labels name the task; unlabelled tasks and unscorable groups are said, not divided by."""
    torch = _t()
    from lightning_rec.metrics import TaskGAUC, TaskMetrics, WindowedTaskMetrics

    def two_tasks(labels, metrics=("auc", "ne")):
        m = TaskMetrics(["click", "like"], list(metrics))
        m.update(torch.zeros(len(labels), 2), T(labels))
        return m.compute()

    simple("metric.task_label_two", lambda: two_tasks([[0, 1], [1, 2.0]]), ValueError, ["'like'", "0 or 1"])
    simple("metric.task_preds_wrong_shape", lambda: TaskMetrics(["click", "like"]).update(torch.zeros(4), torch.zeros(
        4, 2)), ValueError, ["predictions of shape [4]", "[B, T] = [4, 2]"])
    simple("metric.task_window_zero", lambda: WindowedTaskMetrics(["click"], window=0), ValueError, ["window"])
    simple("metric.task_unknown_metric", lambda: TaskMetrics(["click"], ["auc", "f1"]), ValueError, ["f1", "gauc"])

    def warned(fn):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            value = fn()
        return value, " ".join(str(w.message) for w in seen)

    @case("metric.task_unlabelled_in_a_batch", legit="a task without labels in a batch is left out of that batch")
    def _(ctx):
        nan = float("nan")
        v, said = warned(lambda: two_tasks([[0, nan], [1, nan], [0, nan]], ("ne", "calibration", "ctr")))
        expect(all(bool(torch.isnan(x)) for k, x in v.items() if "/like/" in k), f"unlabelled task gave {v}")
        expect("empty for task(s) like" in said, f"no word of the empty task: {said!r}")
        expect(all(bool(torch.isfinite(x)) for k, x in v.items() if "/click/" in k), f"labelled task gave {v}")

    @case("metric.gauc_one_row_per_group", legit="no group can be scored: GAUC 0.5 (TorchRec's), and it says so")
    def _(ctx):
        m = TaskGAUC(["click"], from_logits=False)
        m.update(torch.rand(10), T([0.0, 1.0] * 5), groups=torch.arange(10))
        v, said = warned(m.compute)
        expect(float(v) == 0.5 and "'click': 0 of 10" in said, f"GAUC {float(v)}, said {said!r}")

    @case("metric.task_auc_empty", legit="no rows: AUC undefined, NaN, and it says the set is empty")
    def _(ctx):
        v, said = warned(lambda: TaskMetrics(["click"], ["auc"]).compute()["val/click/auc"])
        expect(bool(torch.isnan(v)) and "empty" in said, f"empty AUC {float(v)}, said {said!r}")


CASES = (metric_label_cases, ranking_metric_cases, more_metric_cases, task_metric_cases)
