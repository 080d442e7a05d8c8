"""Several label columns in the Criteo readers (text cached and streamed, Parquet, datasets): labels [B, T] by task,
NaN where missing, the features as the one-label read gives them; a missing or misspelt column named. Then what the
models do with them: a prediction column per task, the metric configuration DLRMModule shares with MultiTaskModule
(calibration, AUPRC, GAUC by a group feature) and the per-task W&B calibration plot."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch
from conftest import SHARED_DATA, needs_wandb

from lightning_rec.data import CriteoDataModule

NAMES = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """300 real Criteo rows, once as they are and once with a second label in field 2 ("purchase": empty on ~30%
    of rows: no label), and the purchase labels written (NaN: missing)."""
    sample = SHARED_DATA / "criteo" / "criteo_kaggle_train_sample.tsv"
    if not sample.is_file():
        pytest.skip(f"real data not found at {sample}")
    lines = sample.read_text().splitlines()[:300]
    g = np.random.default_rng(0)
    purchase = np.where(g.random(300) < 0.3, np.nan, (g.random(300) < 0.5).astype(float))
    d = tmp_path_factory.mktemp("labels")
    (d / "one.tsv").write_text("\n".join(lines) + "\n")
    two = ["\t".join([ln.split("\t", 1)[0], "" if math.isnan(p) else str(int(p)), ln.split("\t", 1)[1]])
           for ln, p in zip(lines, purchase)]
    (d / "two.tsv").write_text("\n".join(two) + "\n")
    (d / "two_header.tsv").write_text("\t".join(["click", "purchase", *NAMES[1:]]) + "\n" + "\n".join(two) + "\n")
    return d, purchase


def _batches(path, cache, **kwargs) -> list:
    dm = CriteoDataModule(train_path=str(path) if isinstance(path, Path) else path, batch_size=64, shuffle=False,
                          cache_dir=str(cache), num_embeddings_per_feature=1000, **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return list(dm.train_dataloader())


def _parquet(files, tmp_path) -> Path:
    d, _ = files
    table = pacsv.read_csv(d / "two_header.tsv", parse_options=pacsv.ParseOptions(delimiter="\t"),
                           convert_options=pacsv.ConvertOptions(column_types={f"C{i}": pa.string()
                                                                              for i in range(1, 27)}))
    pq.write_table(table, tmp_path / "two.parquet")
    return tmp_path / "two.parquet"


@pytest.mark.parametrize("form", ["text", "text_header", "streamed", "parquet", "parquet_streamed", "dataset"])
def test_several_label_columns_give_labels_by_task_and_the_same_features(files, tmp_path, form):
    d, purchase = files
    one = _batches(d / "one.tsv", tmp_path / "c1")
    path = {"text": d / "two.tsv", "text_header": d / "two_header.tsv", "streamed": d / "two.tsv"}.get(form)
    if form.startswith("parquet"):
        path = _parquet(files, tmp_path)
    if form == "dataset":
        import datasets

        path = datasets.Dataset.from_parquet(str(_parquet(files, tmp_path)), cache_dir=str(tmp_path / "hf"))
    two = _batches(path, tmp_path / "c2", label_columns=["click", "purchase"], streaming="streamed" in form)
    assert len(one) == len(two) == 5
    labels = torch.cat([b.labels for b in two])
    assert labels.shape == (300, 2) and all(b.task_names == ("click", "purchase") for b in two)
    assert torch.equal(labels[:, 0], torch.cat([b.labels for b in one]))  # the click column as the one-label read
    np.testing.assert_array_equal(labels[:, 1].numpy(), purchase.astype(np.float32))  # NaN where no label
    for a, b in zip(one, two):
        assert torch.equal(a.dense_features, b.dense_features)
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert one[0].task_names is None and one[0].labels.dim() == 1  # one label: unchanged


def test_derived_tasks_and_masks_read_from_criteo_columns(files, tmp_path):
    d, purchase = files
    [*batches] = _batches(d / "two_header.tsv", tmp_path / "c",
                          label_columns={"click": "click", "bought": "purchase == 1"},
                          label_masks={"click": "I1"})
    labels = torch.cat([b.labels for b in batches])
    one = torch.cat([b.labels for b in _batches(d / "one.tsv", tmp_path / "c1")])
    i1 = np.array([ln.split("\t")[1] for ln in (d / "one.tsv").read_text().splitlines()])
    no_click = torch.from_numpy((i1 == "") | (i1 == "0"))  # masked: I1 empty or 0
    assert torch.equal(torch.isnan(labels[:, 0]), no_click)
    assert torch.equal(labels[~no_click, 0], one[~no_click])
    np.testing.assert_array_equal(labels[:, 1].numpy(), np.where(np.isnan(purchase), np.nan, purchase == 1))


def test_a_missing_or_misspelt_label_column_is_named_with_the_columns_there(files, tmp_path):
    d, _ = files
    for path in (d / "two_header.tsv", _parquet(files, tmp_path)):
        with pytest.raises(ValueError, match=r"reads column 'purchases', which is not there \(did you mean "
                                             r"'purchase'\?\): its columns are \['click', 'purchase', 'I1'"):
            _batches(path, tmp_path / "c", label_columns=["click", "purchases"])
    with pytest.raises(ValueError, match=r"rows have 41 fields, not 42 \(the 3 label columns \['click', 'purchase', "
                                         r"'view'\] that label_columns reads"):
        _batches(d / "two.tsv", tmp_path / "c", label_columns=["click", "purchase", "view"])


def test_bad_label_values_are_bad_rows_and_binary_ones_are_checked_by_the_model(files, tmp_path):
    d, _ = files
    text = (d / "two.tsv").read_text().splitlines()
    bad = tmp_path / "bad.tsv"
    bad.write_text("\n".join(text[:3] + ["0\tyes\t" + text[3].split("\t", 2)[2]] + text[4:10]) + "\n")
    with pytest.raises(ValueError, match=r"bad.tsv:4: .*label column 'purchase' must be a number, got 'yes'"):
        _batches(bad, tmp_path / "c", label_columns=["click", "purchase"])
    [batch] = _batches(bad, tmp_path / "c2", label_columns=["click", "purchase"], on_bad_row="skip")
    assert len(batch) == 9

    from lightning_rec.data.criteo import preprocess_criteo

    preprocess_criteo([d / "one.tsv"], tmp_path / "shards", num_embeddings=1000, progress=False)
    with pytest.raises(ValueError, match="is preprocessed with one label column: preprocess the files again with "
                                         "--label_columns"):
        _batches(tmp_path / "shards", tmp_path / "c4", label_columns=["click", "purchase"])

    real = tmp_path / "real.tsv"  # a real-valued task is read as it is; a binary task of it is refused by the model
    real.write_text("\n".join("\t".join([ln.split("\t", 1)[0], "2.5", ln.split("\t", 2)[2]]) for ln in text[:8]) + "\n")
    [batch] = _batches(real, tmp_path / "c3", label_columns=["click", "watch"])
    assert torch.equal(batch.labels[:, 1], torch.full((8,), 2.5))
    from lightning_rec.models import MultiTaskModule

    names = [f"C{i}" for i in range(1, 27)]
    model = MultiTaskModule(task_names=["click", "watch"], num_embeddings_per_feature={n: 1000 for n in names},
                            embedding_dim=4, dense_in_features=13, dense_arch_layer_sizes=[4])
    with pytest.raises(ValueError, match=r"task 'watch' is binary but its labels include \[2.5"):
        model._loss(batch)


def test_prediction_writer_writes_a_column_per_task_and_its_labels(files, tmp_path):
    import lightning.pytorch as L

    from lightning_rec.models import MultiTaskModule
    from lightning_rec.predict import PredictionWriter

    d, purchase = files
    dm = CriteoDataModule(predict_path=str(d / "two.tsv"), val_batch_size=128, cache_dir=str(tmp_path / "c"),
                          num_embeddings_per_feature=1000, label_columns=["click", "purchase"])
    names = [f"C{i}" for i in range(1, 27)]
    model = MultiTaskModule(task_names=["click", "purchase"], task_types=["binary", "regression"],
                            num_embeddings_per_feature={n: 1000 for n in names}, embedding_dim=4,
                            dense_in_features=13, dense_arch_layer_sizes=[4])
    writer = PredictionWriter(str(tmp_path / "p.parquet"))
    L.Trainer(accelerator="cpu", devices=1, callbacks=[writer], logger=False, enable_progress_bar=False,
              enable_model_summary=False).predict(model, dm, return_predictions=False)
    table = pq.read_table(tmp_path / "p.parquet").to_pydict()
    assert list(table) == ["row", "click", "purchase", "click_label", "purchase_label"]
    dm.setup("predict")
    batch = dm.datasets["predict"][0:300]
    with torch.no_grad():
        out = model(batch.dense_features, batch.sparse_features)
    np.testing.assert_allclose(table["click"], torch.sigmoid(out[:, 0]).numpy(), rtol=1e-6)
    np.testing.assert_allclose(table["purchase"], out[:, 1].numpy(), rtol=1e-6)  # a regression task: its value
    np.testing.assert_array_equal(table["purchase_label"], purchase.astype(np.float32))
    with pytest.raises(ValueError, match="'row' is a column predictions are written with"):
        MultiTaskModule(task_names=["click", "row"], num_embeddings_per_feature={"a": 10})


def test_calibration_curve_equals_a_reference_and_sums_over_ranks():
    from lightning_rec.metrics import TaskCalibrationCurve

    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(500, 2, generator=g), (torch.rand(500, 2, generator=g) < 0.3).float()
    labels[::7, 1] = float("nan")  # no label: left out
    weights = torch.rand(500, generator=g)
    whole = TaskCalibrationCurve(["click", "buy"], num_buckets=10)
    whole.update(logits, labels, weights=weights)
    halves = [TaskCalibrationCurve(["click", "buy"], num_buckets=10) for _ in range(2)]
    halves[0].update(logits[:200], labels[:200], weights=weights[:200])
    halves[1].update(logits[200:], labels[200:], weights=weights[200:])
    halves[0].merge_state(halves[1])  # what the sync over ranks does: sums of the states
    curve = whole.compute()
    torch.testing.assert_close(halves[0].compute(), curve, equal_nan=True, rtol=1e-12, atol=0)
    p, y, w = torch.sigmoid(logits.double()), labels.double(), weights.double()  # float64, as the metric
    for t in range(2):
        keep = ~torch.isnan(y[:, t])
        bucket = (p[keep, t] * 10).long().clamp(max=9)
        for k in range(10):
            rows = bucket == k
            if not rows.any():
                assert curve[t, k].isnan().all()
                continue
            wk = w[keep][rows]
            expected = [(p[keep, t][rows] * wk).sum() / wk.sum(), (y[keep, t][rows] * wk).sum() / wk.sum(), wk.sum()]
            torch.testing.assert_close(curve[t, k], torch.stack(expected), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match=r"predictions of shape \[500, 3\]: give \[B, T\] = \[500, 2\]"):
        whole.update(torch.zeros(500, 3), labels)


def _trainer(tmp_path, logger):
    import lightning.pytorch as L

    return L.Trainer(accelerator="cpu", devices=1, logger=logger, max_epochs=1, limit_train_batches=2,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     default_root_dir=str(tmp_path))


def _group_auc_reference(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray) -> float:
    """Impression-weighted mean of each scorable group's AUC (pairs: positive above negative, ties 1/2)."""
    total = weight = 0.0
    for g in np.unique(groups):
        s, y = scores[groups == g], labels[groups == g]
        pos, neg = s[y == 1], s[y == 0]
        if len(pos) and len(neg) and len(np.unique(s)) > 1:
            auc = ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (len(pos) * len(neg))
            total, weight = total + len(s) * auc, weight + len(s)
    return total / weight


def test_dlrm_logs_calibration_auprc_and_gauc_through_the_multitask_metric_configuration(shared_data, tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from lightning_rec.metrics import weighted_auc, weighted_auprc
    from lightning_rec.models import DLRMModule

    valid = shared_data / "criteo" / "criteo_kaggle_valid_sample.tsv"
    dm = CriteoDataModule(val_path=str(valid), val_batch_size=512, cache_dir=str(tmp_path / "c"),
                          num_embeddings_per_feature=1000)
    torch.manual_seed(0)
    model = DLRMModule(num_embeddings_per_feature=1000, embedding_dim=8, dense_arch_layer_sizes=[8],
                       over_arch_layer_sizes=[8, 1], metrics=["auc", "calibration", "auprc", "gauc"],
                       group_feature="C6")
    [values] = _trainer(tmp_path, CSVLogger(str(tmp_path))).validate(model, dm, verbose=False)
    assert not model.calibration_curves and not (tmp_path / "wandb").exists()  # no W&B logger: no plot
    assert sorted(values) == ["val_auc", "val_auprc", "val_calibration", "val_gauc", "val_logloss", "val_loss"]
    batch = dm.datasets["val"][0:len(dm.datasets["val"])]
    with torch.no_grad():
        logits = model(batch.dense_features, batch.sparse_features).double()
    labels, ones = batch.labels.double(), torch.ones_like(batch.labels, dtype=torch.float64)
    groups = batch.sparse_features["C6"].values().numpy()  # reserved_id: one id per row
    assert values["val_auc"] == pytest.approx(float(weighted_auc(logits, labels, ones)), abs=1e-6)
    assert values["val_auprc"] == pytest.approx(float(weighted_auprc(logits, labels, ones)), abs=1e-6)
    assert values["val_calibration"] == pytest.approx(float(torch.sigmoid(logits).sum() / labels.sum()), rel=1e-6)
    assert values["val_gauc"] == pytest.approx(_group_auc_reference(logits.numpy(), labels.numpy(), groups), abs=1e-6)
    for bad, match in [({"metrics": ["gauc"]}, "name the sparse feature whose id is a row's group"),
                       ({"metrics": ["auc", "calibation"]}, r"unknown calibation; choose from \['auc'"),
                       ({"group_feature": "user"}, "'user'\\): not a sparse feature of the model")]:
        with pytest.raises(ValueError, match=match):
            DLRMModule(num_embeddings_per_feature=10, embedding_dim=8, dense_arch_layer_sizes=[8], **bad)


@needs_wandb  # ~9 s, most of it wandb's offline run starting
def test_multitask_logs_a_calibration_plot_per_binary_task_to_wandb(files, tmp_path):
    from lightning.pytorch.loggers import WandbLogger

    from lightning_rec.models import MultiTaskModule

    d, purchase = files
    dm = CriteoDataModule(train_path=str(d / "two_header.tsv"), val_path=str(d / "two_header.tsv"), batch_size=64,
                          cache_dir=str(tmp_path / "c"), num_embeddings_per_feature=1000,
                          label_columns=["click", "purchase", "I2"])  # I2, a count: a regression task
    names = [f"C{i}" for i in range(1, 27)]
    model = MultiTaskModule(task_names=["click", "purchase", "I2"], task_types=["binary", "binary", "regression"],
                            num_embeddings_per_feature={n: 1000 for n in names}, embedding_dim=4,
                            dense_in_features=13, dense_arch_layer_sizes=[4], calibration_buckets=5,
                            metrics=["auc", "calibration", "mae"])
    logger = WandbLogger(save_dir=str(tmp_path), offline=True)
    logged = []
    run = logger.experiment
    log = run.log
    run.log = lambda data, *a, **k: (logged.append(data), log(data, *a, **k))[1]
    trainer = _trainer(tmp_path, logger)
    try:
        trainer.fit(model, dm)
    finally:  # a run left open is the one a later WandbLogger in this process would log to
        run.finish()
    plots = [k for data in logged for k in data if k.endswith("calibration_plot")]
    assert plots == ["val/click/calibration_plot", "val/purchase/calibration_plot"]  # binary tasks only
    table = next(data["val/purchase/calibration_plot_table"] for data in logged if "val/purchase/calibration_plot_table"
                 in data)
    assert table.columns == ["bucket", "predicted", "observed", "weight"]
    assert sum(row[3] for row in table.data) == (~np.isnan(purchase)).sum()  # every labelled row once
    metrics = trainer.callback_metrics
    assert {"val/click/calibration", "val/purchase/auc", "val/I2/mae", "val/I2/mse"} <= set(metrics)
    assert "val/I2/auc" not in metrics


@needs_wandb  # ~10 s, most of it wandb's offline run starting
def test_calibration_plots_are_logged_for_every_validation_dataloader(files, tmp_path):
    """The plot was made for the first validation dataloader only: a second one (say a later day's data) had its
    metrics logged under /dataloader_idx_1 but no plot. Each loader now gets its own curve, its keys suffixed as its
    metrics are, and each table counts that loader's labelled rows only."""
    import lightning.pytorch as L
    from lightning.pytorch.loggers import WandbLogger

    from lightning_rec.models import DLRMModule, MultiTaskModule

    d, purchase = files
    (tmp_path / "part_header.tsv").write_text("\n".join((d / "two_header.tsv").read_text().splitlines()[:101]) + "\n")
    (tmp_path / "part.tsv").write_text("\n".join((d / "one.tsv").read_text().splitlines()[:100]) + "\n")

    def loaders(full, part, **kwargs):
        out = []
        for path in (full, part):
            dm = CriteoDataModule(val_path=str(path), val_batch_size=64, cache_dir=str(tmp_path / "c"),
                                  num_embeddings_per_feature=1000, **kwargs)
            dm.prepare_data()
            dm.setup("validate")
            out.append(dm.val_dataloader())
        return out

    names = [f"C{i}" for i in range(1, 27)]
    dlrm = DLRMModule(num_embeddings_per_feature=1000, embedding_dim=4, dense_arch_layer_sizes=[4],
                      over_arch_layer_sizes=[4, 1], calibration_buckets=5)
    multi = MultiTaskModule(task_names=["click", "purchase"], num_embeddings_per_feature={n: 1000 for n in names},
                            embedding_dim=4, dense_in_features=13, dense_arch_layer_sizes=[4], calibration_buckets=5)
    logger = WandbLogger(save_dir=str(tmp_path), offline=True)
    logged = []
    run = logger.experiment
    log = run.log
    run.log = lambda data, *a, **k: (logged.append(data), log(data, *a, **k))[1]
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=logger, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    try:
        trainer.validate(dlrm, loaders(d / "one.tsv", tmp_path / "part.tsv"), verbose=False)
        assert {"val_auc", "val_auc/dataloader_idx_1"} <= set(trainer.callback_metrics)
        trainer.validate(multi, loaders(d / "two_header.tsv", tmp_path / "part_header.tsv",
                                        label_columns=["click", "purchase"]), verbose=False)
    finally:  # a run left open is the one a later WandbLogger in this process would log to
        run.finish()
    tables = {k: v for data in logged for k, v in data.items() if "_table" in k}
    plots = [k for data in logged for k in data if "calibration_plot" in k and "_table" not in k]
    assert plots == ["val_calibration_plot", "val_calibration_plot/dataloader_idx_1",
                     "val/click/calibration_plot", "val/purchase/calibration_plot",
                     "val/click/calibration_plot/dataloader_idx_1", "val/purchase/calibration_plot/dataloader_idx_1"]
    rows = {k: sum(row[3] for row in t.data) for k, t in tables.items()}  # the buckets' weights: labelled rows
    labelled = (~np.isnan(purchase)).sum(), (~np.isnan(purchase[:100])).sum()
    assert rows == {"val_calibration_plot_table": 300, "val_calibration_plot_table/dataloader_idx_1": 100,
                    "val/click/calibration_plot_table": 300, "val/purchase/calibration_plot_table": labelled[0],
                    "val/click/calibration_plot_table/dataloader_idx_1": 100,
                    "val/purchase/calibration_plot_table/dataloader_idx_1": labelled[1]}
