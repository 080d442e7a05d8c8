"""Several label columns in the Criteo readers (text cached and streamed, Parquet, datasets): labels [B, T] by task,
NaN where missing, the features as the one-label read gives them; a missing or misspelt column named."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

from lightning_rec.data import CriteoDataModule

NAMES = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """300 real Criteo rows, once as they are and once with a second label in field 2 ("purchase": empty on ~30%
    of rows: no label), and the purchase labels written (NaN: missing)."""
    from tests.conftest import SHARED_DATA

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
    with pytest.raises(ValueError, match="parser='native' reads one label column"):
        CriteoDataModule(train_path=str(bad), label_columns=["click", "purchase"], parser="native")

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
