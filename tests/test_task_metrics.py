"""Per-task metrics (lightning_rec.metrics.tasks / multitask) against few-line references written from TorchRec's
formulas (torchrec/metrics/ne.py, calibration.py, ctr.py, auc.py, gauc.py, auprc.py, mse.py, mae.py), at 1e-6 on
random inputs with weights, several tasks and one-class tasks; identical at 1, 2 and 4 ranks; the windowed ones with
no host sync between logs; and the bad input each one names."""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from dist_utils import run_ranks

import lightning_rec.torchrec.metrics as trm
from lightning_rec.metrics import RecTaskInfo, TaskCalibrationCurve, TaskGAUC, TaskMetrics, TaskNE, WindowedTaskMetrics

ETA = 1e-12
TASKS = ["click", "like", "none_pos", "all_pos"]  # the last two: one-class tasks
ALL = ["auc", "binned_auc", "ne", "logloss", "ctr", "calibration", "gauc", "auprc", "mse", "mae", "rmse"]

# TorchRec's formulas, one task at a time (p: probabilities, y: 0/1 labels, w: weights; 1-D) -----------------------


def ref_ne(p, y, w):
    p = p.double().clamp(ETA, 1 - ETA)
    ce = (-w * y * torch.log2(p) - w * (1 - y) * torch.log2(1 - p)).sum()
    pos, neg = (w * y).sum(), (w * (1 - y)).sum()
    mean = (pos / w.sum().clamp(min=ETA)).clamp(ETA, 1 - ETA)
    return ce / (-pos * torch.log2(mean) - neg * torch.log2(1 - mean))


def ref_calibration(p, y, w):
    return 0.0 if (y * w).sum() <= 0 else (p * w).sum() / (y * w).sum()


def ref_ctr(p, y, w):
    return (y * w).sum() / w.sum()


def ref_mse(p, y, w):
    return (w * (y - p) ** 2).sum() / w.sum()


def ref_auc(p, y, w):
    i = torch.argsort(p, descending=True)
    fp, tp = torch.cumsum(w[i] * (1 - y[i]), 0), torch.cumsum(w[i] * y[i], 0)
    return 0.5 if fp[-1] * tp[-1] == 0 else torch.trapz(tp, fp) / fp[-1] / tp[-1]


def ref_auprc(p, y, w):
    i = torch.argsort(p, descending=True)
    mask = torch.nn.functional.pad(p[i].diff() != 0, [0, 1], value=True)
    tp, fp = torch.cumsum(w[i] * y[i], 0)[mask], torch.cumsum(w[i] * (1 - y[i]), 0)[mask]
    prec = torch.cat([(tp / (tp + fp)).flip(0), tp.new_ones(1)])
    rec = torch.nan_to_num(torch.cat([(tp / tp[-1]).flip(0), tp.new_zeros(1)]), 1.0)
    return -torch.sum((rec[1:] - rec[:-1]) * prec[:-1])


def ref_gauc(p, y, w, groups):
    """gauc.py: per session, pos-weight x negative weight ranked lower; sessions with one class or one prediction
    left out; the mean over sessions."""
    auc_sum, n = 0.0, 0
    for g in groups.unique():
        s = groups == g
        i = torch.argsort(p[s])
        ys, ws = y[s][i], w[s][i]
        num = (ys * ws * torch.cumsum(ws * (1 - ys), 0)).sum()
        wp, wn = (ys * ws).sum(), ((1 - ys) * ws).sum()
        if wp > 0 and wn > 0 and not bool((p[s] == p[s][0]).all()):
            auc_sum, n = auc_sum + num / (wp * wn + 1e-10), n + 1
    return (auc_sum + 1e-9) / (n + 2e-9)


REFS = {"ne": ref_ne, "calibration": ref_calibration, "ctr": ref_ctr, "auc": ref_auc, "auprc": ref_auprc,
        "mse": ref_mse}


def _data(seed=0, updates=3, B=64, T=4):
    g = torch.Generator().manual_seed(seed)
    batches = []
    for u in range(updates):
        p = torch.rand(B, T, generator=g, dtype=torch.float64) * 0.98 + 0.01
        y = (torch.rand(B, T, generator=g) < 0.3).double()
        if T == len(TASKS):
            y[:, 2], y[:, 3] = 0.0, 1.0
        w = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.1
        groups = torch.randint(0, 8, (B,), generator=g) + 100 * u  # each group within one batch, as TorchRec's
        batches.append((p, y, w, groups))
    return batches


def _ours(batches, metrics=ALL, **kw):
    m = TaskMetrics(TASKS, metrics, from_logits=False, **kw)
    for p, y, w, groups in batches:
        m.update(p, y, weights=w, groups=groups)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one-class tasks warn; their values are checked below
        return {k: float(v) for k, v in m.compute().items()}


def test_each_metric_equals_torchrecs_formula_with_weights_several_and_one_class_tasks():
    batches = _data()
    p, y, w, groups = (torch.cat(x) for x in zip(*batches))
    got = _ours(batches, group_weighting="uniform")
    for t, task in enumerate(TASKS):
        for name, ref in REFS.items():
            want = float(ref(p[:, t], y[:, t], w[:, t]))
            assert got[f"val/{task}/{name}"] == pytest.approx(want, rel=1e-6, abs=1e-6), (task, name)
        assert got[f"val/{task}/gauc"] == pytest.approx(float(ref_gauc(p[:, t], y[:, t], w[:, t], groups)),
                                                        abs=1e-6), task
        assert got[f"val/{task}/rmse"] == pytest.approx(float(ref_mse(p[:, t], y[:, t], w[:, t])) ** 0.5, abs=1e-6)
        assert got[f"val/{task}/mae"] == pytest.approx(float((w[:, t] * (y[:, t] - p[:, t]).abs()).sum()
                                                             / w[:, t].sum()), abs=1e-6)
        assert got[f"val/{task}/binned_auc"] == pytest.approx(got[f"val/{task}/auc"], abs=2e-3)
        # log loss in nats: TorchRec's (bits) times ln 2
        ce = -(w[:, t] * (y[:, t] * torch.log(p[:, t]) + (1 - y[:, t]) * torch.log(1 - p[:, t]))).sum()
        assert got[f"val/{task}/logloss"] == pytest.approx(float(ce / w[:, t].sum()), abs=1e-6)
    assert got["val/none_pos/auc"] == 0.5 and got["val/none_pos/calibration"] == 0.0


def test_logits_recalibration_and_impression_weighted_gauc():
    batches = _data(seed=1, updates=1)
    p, y, w, groups = batches[0]
    logits = torch.logit(p)
    m = TaskMetrics(TASKS, ["ne", "calibration", "gauc"], recalibration_coefficient=0.25)
    m.update(logits, y, weights=w, groups=groups)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = {k: float(v) for k, v in m.compute().items()}
    q = p / (p + (1 - p) / 0.25)  # TorchRec's recalibration (calibration_with_recalibration.py)
    assert got["val/click/calibration"] == pytest.approx(float(ref_calibration(q[:, 0], y[:, 0], w[:, 0])), abs=1e-6)
    assert got["val/click/ne"] == pytest.approx(float(ref_ne(q[:, 0], y[:, 0], w[:, 0])), abs=1e-6)
    num = den = 0.0  # impressions: each scorable group's AUC weighted by its summed row weights
    for gid in groups.unique():
        s = groups == gid
        ys = y[s, 0]
        if 0 < ys.sum() < s.sum():
            num, den = num + float(ref_auc(p[s, 0], ys, w[s, 0])) * float(w[s, 0].sum()), den + float(w[s, 0].sum())
    assert got["val/click/gauc"] == pytest.approx(num / den, abs=1e-6)


def test_missing_labels_are_left_out_never_read_as_zero():
    p, y, w, groups = _data(seed=2, updates=1)[0]
    y_nan, mask = y.clone(), torch.ones_like(y, dtype=torch.bool)
    y_nan[::3, 0] = float("nan")
    mask[::3, 0] = False
    kept = torch.ones(len(y), dtype=torch.bool)
    kept[::3] = False
    want = _ours([(p[kept], y[kept], w[kept], groups[kept])])
    for missing in ({"labels": y_nan}, {"labels": y, "mask": mask}):
        m = TaskMetrics(TASKS, ALL, from_logits=False)
        m.update(p, missing["labels"], weights=w, mask=missing.get("mask"), groups=groups)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = m.compute()
        for key in want:
            if key.startswith("val/click/"):
                assert float(got[key]) == pytest.approx(want[key], abs=1e-9), key


def _windowed(batches, share=slice(None)):
    wm = WindowedTaskMetrics(TASKS, ["auc", "ne", "calibration", "mse"], window=2, from_logits=False)
    for p, y, w, _ in batches:
        wm.update(p[share], y[share], weights=w[share])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {k: float(v) for k, v in wm.compute().items()}


def _curve(batches, share=slice(None)) -> list[float]:
    """The W&B calibration plot's buckets (TaskCalibrationCurve), flattened."""
    curve = TaskCalibrationCurve(TASKS, from_logits=False, num_buckets=7)
    for p, y, w, _ in batches:
        curve.update(p[share], y[share], weights=w[share])
    return curve.compute().reshape(-1).tolist()


def _ranks_all(rank, world_size, batches):
    p, y, w, groups = (torch.cat(x) for x in zip(*batches))
    share = slice(rank, None, world_size)  # an uneven share of rows per rank
    return _ours([(p[share], y[share], w[share], groups[share])]), _windowed(batches, share), _curve(batches, share)


def test_identical_at_1_2_and_4_ranks():
    batches = _data(seed=3, updates=3, B=50)
    want, want_window, want_curve = _ours(batches), _windowed(batches), _curve(batches)
    for world_size in (2, 4):
        for got, got_window, got_curve in run_ranks(_ranks_all, world_size, batches, timeout=120):
            assert got == pytest.approx(want, rel=1e-12, abs=1e-12, nan_ok=True), world_size  # float64 sums
            assert got_window == pytest.approx(want_window, rel=1e-12, abs=1e-12), world_size
            assert got_curve == pytest.approx(want_curve, rel=1e-12, abs=1e-12, nan_ok=True), world_size


def test_rectaskinfo_reads_each_tasks_columns_from_a_model_output():
    p, y, w, _ = _data(seed=4, updates=1, T=2)[0]
    tasks = [RecTaskInfo("click", "label_c", "pred_c", "w_c"), RecTaskInfo("like", "label_l", "pred_l", "w_l")]
    by_name = TaskMetrics(tasks, ["ne", "ctr"], from_logits=False)
    by_name.update_from({"pred_c": p[:, 0], "pred_l": p[:, 1], "label_c": y[:, 0], "label_l": y[:, 1],
                         "w_c": w[:, 0], "w_l": w[:, 1]})
    stacked = TaskMetrics(["click", "like"], ["ne", "ctr"], from_logits=False)
    stacked.update(p, y, weights=w)
    assert by_name.compute() == stacked.compute()
    with pytest.raises(KeyError, match="no 'label_c' in the model output; it has .*pred_c"):
        by_name.update_from({"pred_c": p[:, 0], "pred_l": p[:, 1]})


def test_torchrec_prefix_names():
    assert trm.RecTaskInfo is RecTaskInfo and trm.NEMetric is TaskNE and trm.GAUCMetric is TaskGAUC


# windowed training metrics ----------------------------------------------------------------------------------------


def test_windowed_metrics_are_those_of_the_last_n_batches():
    batches = _data(seed=5, updates=7, B=40)
    wm = WindowedTaskMetrics(TASKS, ["auc", "ne", "calibration", "ctr"], window=3, log_every=7, from_logits=False)
    for p, y, w, _ in batches:
        wm.update(p, y, weights=w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = _ours(batches[-3:], ["binned_auc", "ne", "calibration", "ctr"])
    got = {k: float(v) for k, v in wm.compute().items()}
    assert got == pytest.approx({k.replace("val/", "train/window/").replace("binned_auc", "auc"): v
                                 for k, v in want.items()}, abs=1e-9)


class _Syncs:
    """Counts the ways a host reads a tensor (item, tolist, cpu, numpy, bool/int/float): on CUDA each is a sync."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def counted(t, *a, _orig=orig, **k):
                self.count += 1
                return _orig(t, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, counted)


class _Logger:
    def __init__(self):
        self.logged = []

    def log_dict(self, values, **kw):
        self.logged.append(values)


def test_windowed_update_has_no_host_sync_between_logs(monkeypatch):
    batches = _data(seed=6, updates=9, B=32)
    wm = WindowedTaskMetrics(TASKS, ["auc", "ne", "calibration", "logloss", "mse", "throughput"], window=4,
                             log_every=4)
    module = _Logger()
    syncs = _Syncs(monkeypatch)
    float(torch.ones(()))  # the counter can fail: a host read counts
    assert syncs.count == 1
    per_step = []
    for p, y, w, _ in batches:
        before = syncs.count
        wm.update(torch.logit(p), y, weights=w)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wm.log_to(module)
        per_step.append(syncs.count - before)
    assert len(module.logged) == 2  # at updates 4 and 8
    assert [n > 0 for n in per_step] == [False, False, False, True, False, False, False, True, False], per_step


# bad input ----------------------------------------------------------------------------------------------------------


def test_labels_outside_0_1_name_the_task():
    m = TaskMetrics(["click", "like"], ["auc", "ne"])
    m.update(torch.zeros(4, 2), torch.tensor([[0, 1], [1, 2], [0, 1], [1, 5.0]]))
    with pytest.raises(ValueError, match=r"task 'like': 2.*binarize"):
        m.compute()
    reg = TaskMetrics(["rating"], ["mse"])  # a regression task takes any real label
    reg.update(torch.zeros(2), torch.tensor([3.0, 5.0]))
    assert float(reg.compute()["val/rating/mse"]) == 17.0


def test_a_task_with_no_label_in_a_batch_is_skipped_and_nothing_divides_by_zero():
    p, y, w, groups = _data(seed=7, updates=2, B=30)[0]
    y2 = y.clone()
    y2[:, 1] = float("nan")  # task "like" unlabelled in the second batch
    m = TaskMetrics(TASKS, ALL, from_logits=False)
    m.update(p, y, weights=w, groups=groups)
    m.update(p, y2, weights=w, groups=groups + 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = {k: float(v) for k, v in m.compute().items()}
        want = _ours([(p, y, w, groups)])
    assert {k: v for k, v in got.items() if "/like/" in k} == pytest.approx(
        {k: v for k, v in want.items() if "/like/" in k}, abs=1e-9)
    never = TaskMetrics(["a", "b"], ["auc", "ne", "calibration", "mse"])
    never.update(torch.zeros(3, 2), torch.tensor([[0, float("nan")], [1, float("nan")], [0, float("nan")]]))
    with pytest.warns(UserWarning, match=r"the evaluation set is empty for task\(s\) b"):
        values = never.compute()
    assert all(torch.isnan(v) for k, v in values.items() if "/b/" in k)


def test_gauc_says_how_many_groups_it_could_score():
    m = TaskGAUC(["click"], from_logits=False)
    m.update(torch.rand(10), torch.tensor([0.0, 1.0] * 5), groups=torch.arange(10))  # one row per group
    with pytest.warns(UserWarning, match=r"'click': 0 of 10.*a group of one row never is"):
        assert float(m.compute()) == 0.5
    assert m.scored_groups == [0] and m.num_groups == [10]
    with pytest.raises(ValueError, match="groups .* are needed"):
        m.update(torch.rand(4), torch.ones(4))


@pytest.mark.parametrize("name", ["auc", "binned_auc", "auprc", "gauc"])
def test_nan_predictions_make_the_rank_metrics_nan_not_a_value_that_looks_valid(name):
    """DLRMModule's default metrics moved from the click AUC, which said NaN for a diverged model's NaN scores, to
    these: NaN sorted as the top score (the binned AUC put it in the top bin) and a diverged model scored 1.0. The
    windowed AUC carries the count in its ring, so its window says NaN too until the NaN batch leaves it."""
    p = torch.tensor([[0.1, 0.1], [float("nan"), 0.4], [0.3, 0.3], [0.9, 0.9]])
    y = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    m = TaskMetrics(["diverged", "fine"], [name], from_logits=False)
    m.update(p, y, groups=torch.tensor([0, 0, 0, 0]))
    with pytest.warns(UserWarning, match=r"predictions are NaN \(task 'diverged': 1 of them"):
        values = m.compute()
    assert math.isnan(values[f"val/diverged/{name}"]) and values[f"val/fine/{name}"] == 1.0
    if name == "auc":
        w = WindowedTaskMetrics(["diverged", "fine"], ["auc"], window=2, log_every=1, from_logits=False)
        w.update(p, y)
        assert math.isnan(w.compute()["train/window/diverged/auc"])
        w.update(p[[0, 3, 2]], y[[0, 3, 2]])
        w.update(p[[0, 3, 2]], y[[0, 3, 2]])  # the NaN batch has left the window of 2
        assert w.compute()["train/window/diverged/auc"] == 1.0


@pytest.mark.parametrize("preds_shape", [(8,), (8, 3), (4, 2)])
def test_predictions_of_the_wrong_shape_are_named(preds_shape):
    m = TaskMetrics(["click", "like"], ["auc"])
    want = rf"predictions of shape {re.escape(str(list(preds_shape)))}: give \[B, T\] = \[8, 2\] for tasks click, like"
    with pytest.raises(ValueError, match=want):
        m.update(torch.zeros(preds_shape), torch.zeros(8, 2))


def test_one_tasks_predictions_of_the_wrong_shape_are_named_as_given():
    """[3] against 4 labels was once named "[3, 1]": the shape after the metric's own reshape."""
    with pytest.raises(ValueError, match=r"predictions of shape \[3\]: give \[B, T\] = \[4, 1\]"):
        TaskMetrics(["click"], ["auc"]).update(torch.zeros(3), torch.zeros(4))


def test_auc_over_an_empty_evaluation_set_says_it_is_empty():
    m = TaskMetrics(["click"], ["auc"])
    with pytest.warns(UserWarning, match="empty"):
        assert torch.isnan(m.compute()["val/click/auc"])


def _empty_synced(rank, world_size):
    m = TaskMetrics(["click", "like"], ["auc", "auprc"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {k: float(v.nan_to_num(-1.0).sum()) for k, v in m.compute().items()}


def test_exact_auc_synced_over_ranks_that_saw_no_row_is_nan_not_an_index_error():
    """A validation pass with no batch on any rank, under a process group: the synced list states come back as one
    flat empty tensor, which the per-task read indexed as [N, T] (IndexError at the first DLRM validation of a run
    whose loaders were reloaded empty)."""
    got = run_ranks(_empty_synced, 2, timeout=120)
    assert got[0] == got[1] and set(got[0].values()) == {-1.0}, got  # NaN for every task


@pytest.mark.parametrize("cls", ["AUC", "BinnedAUC"])
def test_single_task_auc_over_an_empty_evaluation_set_says_it_is_empty(cls):
    """It said "only negative labels (0 positive, 0 negative)", as if the set had a class."""
    import lightning_rec.metrics as metrics

    with pytest.warns(UserWarning, match="the evaluation set is empty"):
        assert torch.isnan(getattr(metrics, cls)().compute())


def test_logged_from_a_lightning_module_under_task_names():
    import lightning.pytorch as pl

    class TwoTasks(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(3, 2)
            self.val_metrics = TaskMetrics(["click", "like"], ["auc", "ne", "calibration"])
            self.train_window = WindowedTaskMetrics(["click", "like"], window=2, log_every=2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.net(x)
            self.train_window.update(logits.detach(), y)
            self.train_window.log_to(self)
            return torch.nn.functional.binary_cross_entropy_with_logits(logits, y)

        def validation_step(self, batch, batch_idx):
            self.val_metrics.update(self.net(batch[0]), batch[1])

        def on_validation_epoch_end(self):
            self.val_metrics.log_to(self)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 3, generator=g), (torch.rand(64, 2, generator=g) < 0.5)
                                          .float())
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(TwoTasks(), loader, loader)
    logged = set(trainer.callback_metrics)
    assert {"val/click/auc", "val/like/ne", "val/like/calibration", "train/window/click/auc",
            "train/window/like/calibration"} <= logged, logged


def test_tasks_none_logs_one_label_under_the_single_task_names():
    p, y, w, _ = _data(seed=8, updates=1, T=1)[0]
    one = TaskMetrics(None, ["auc", "ne", "calibration"], from_logits=False)
    one.update(p[:, 0], y[:, 0], weights=w[:, 0])
    named = TaskMetrics(["click"], ["auc", "ne", "calibration"], from_logits=False)
    named.update(p, y, weights=w)
    assert one.compute() == {k.replace("click/", ""): v for k, v in named.compute().items()}
    assert set(one.compute()) == {"val/auc", "val/ne", "val/calibration"}
