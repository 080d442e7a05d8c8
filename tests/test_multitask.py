"""Several labels per row and MultiTaskModule: label columns, NaN-masked losses against a torch reference, MMoE / PLE /
shared-bottom shapes, ESMM, bad input, and training under strategy="rec" (plain and pipelined) at 1 and 2 ranks."""

from __future__ import annotations

import warnings

import lightning.pytorch as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from lightning_rec.data.batch import Batch
from lightning_rec.data.labels import check_label_columns, label_matrix, label_specs
from lightning_rec.data.tables import TableDataModule
from lightning_rec.models import MultiTaskModule
from lightning_rec.models.multitask import esmm_logit
from lightning_rec.sparse import KeyedJaggedTensor
from tests.dist_utils import run_ranks

FEATURES = ["a", "b", "c"]
ROWS = 50


def _module(**kw) -> MultiTaskModule:
    args = dict(task_names=["click", "buy"], num_embeddings_per_feature=ROWS, sparse_feature_names=FEATURES,
                embedding_dim=4, dense_in_features=2, dense_arch_layer_sizes=[8, 4], expert_layer_sizes=[8],
                num_experts=3, tower_layer_sizes=[4])
    return MultiTaskModule(**{**args, **kw})


def _batch(B: int = 8, labels=None, task_names=("click", "buy"), seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    kjt = KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.randint(ROWS, (3 * B,), generator=g),
                                              torch.ones(3 * B, dtype=torch.int64), stride=B)
    if labels is None:
        labels = torch.randint(2, (B, 2), generator=g).float()
    return Batch(torch.randn(B, 2, generator=g), kjt, labels, task_names=task_names)


# labels ------------------------------------------------------------------------------------------------------------

def test_label_columns_derive_tasks_and_keep_missing_labels_missing():
    specs = label_specs({"liked": "rating >= 4", "loved": "rating == 5", "watch": "minutes", "single": "m == Never"},
                        label_masks={"watch": "has_watch"})
    cols = {"rating": np.array([5.0, 3.0, np.nan]), "minutes": np.array([1.5, 2.0, 3.0]),
            "has_watch": np.array([1, 0, 1]), "m": np.array([" Never", "Married", None], dtype=object)}
    labels = label_matrix(specs, cols.__getitem__)
    expected = torch.tensor([[1, 1, 1.5, 1], [0, 0, np.nan, 0], [np.nan, np.nan, 3.0, np.nan]])
    assert torch.equal(labels.isnan(), expected.isnan())
    assert torch.equal(labels.nan_to_num(-1), expected.nan_to_num(-1))
    assert [s.task for s in label_specs(["click", "buy"])] == ["click", "buy"]


def test_a_missing_or_misspelt_label_column_is_named_with_the_columns_there():
    with pytest.raises(ValueError, match=r"'ratin'.*did you mean 'rating'.*\['user', 'rating'\]"):
        check_label_columns(label_specs(["ratin"]), ["user", "rating"], "ratings.csv")
    with pytest.raises(ValueError, match="OP one of"):
        label_specs({"liked": "rating => 4"})
    with pytest.raises(ValueError, match="label_masks names tasks"):
        label_specs(["click"], label_masks={"buy": "x"})


def _table(path, n=256, seed=0):
    rng = np.random.default_rng(seed)
    a, b, c = (rng.integers(0, 20, n) for _ in range(3))
    x = rng.normal(size=n)
    click = ((a % 2) ^ (rng.random(n) < 0.1)).astype(float)
    buy = np.where(rng.random(n) < 0.3, np.nan, (b % 3 == 0).astype(float))  # a third unlabelled
    pq.write_table(pa.table({"a": a.astype(str), "b": b, "c": c, "x": x, "y": -x, "click": click, "buy": buy}), path)
    return str(path)


def test_table_data_module_reads_several_labels(tmp_path):
    path = _table(tmp_path / "t.parquet")
    dm = TableDataModule(path, path, label_columns=["click", "buy"], sparse_columns=FEATURES,
                         dense_columns=["x", "y"], num_embeddings=ROWS, batch_size=32)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.labels.shape == (32, 2) and batch.task_names == ("click", "buy")
    assert batch.dense_features.shape == (32, 2) and batch.sparse_features.keys() == FEATURES
    assert int(batch.sparse_features.values().max()) < ROWS
    assert batch.labels[:, 1].isnan().any()  # unlabelled rows stay NaN
    with pytest.raises(ValueError, match=r"'clik'.*did you mean 'click'"):
        TableDataModule(path, path, label_columns=["clik"], sparse_columns=FEATURES).setup("fit")


def test_movielens_serves_labelled_rows_with_label_columns(tmp_path):
    from lightning_rec.data import MovieLensDataModule

    (tmp_path / "log").mkdir()
    rows = [f"{u},{i},{1 + (u + i) % 5},{u * 100 + i}" for u in range(12) for i in range(10)]
    (tmp_path / "log" / "ratings.csv").write_text("user_id,item_id,rating,timestamp\n" + "\n".join(rows) + "\n")
    dm = MovieLensDataModule(str(tmp_path / "log"), label_columns={"liked": "rating >= 4", "loved": "rating == 5"},
                             side_features=False, batch_size=16, eval_batch_size=8)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.labels.shape == (16, 2) and batch.task_names == ("liked", "loved")
    assert batch.sparse_features.keys() == ["user_id", "item_id"] and batch.dense_features.shape == (16, 0)
    assert ((batch.labels[:, 1] == 1) <= (batch.labels[:, 0] == 1)).all()  # loved implies liked
    assert sum(len(b) for b in dm.val_dataloader()) == dm.report.split_sizes["val"]
    with pytest.raises(ValueError, match=r"'ratings'.*did you mean 'rating'"):
        MovieLensDataModule(str(tmp_path / "log"), label_columns=["ratings"], side_features=False).setup("fit")


# the model ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mix", ["shared_bottom", "mmoe", "ple"])
def test_every_mix_gives_one_output_per_task(mix):
    m = _module(mix=mix, task_names=["a", "b", "c"], task_types=["binary", "binary", "regression"])
    b = _batch()
    out = m(b.dense_features, b.sparse_features)
    assert out.shape == (8, 3)
    out.sum().backward()
    assert all(p.grad is not None for n, p in m.model.named_parameters() if "towers" in n)
    if mix == "ple":
        assert len(m.model.levels) == 2 and len(m.model.levels[0].per_task) == 3


def test_masked_loss_equals_a_torch_reference():
    """Each task's loss is the mean over the rows that label it, weighted; a NaN label adds nothing."""
    m = _module(task_names=["click", "watch"], task_types=["binary", "regression"], loss_weights=[1.0, 0.5])
    labels = torch.tensor([[1, 2.0], [0, np.nan], [np.nan, 1.0], [1, 0.5], [0, 3.0], [np.nan, np.nan], [1, 1], [0, 0]])
    b = _batch(labels=labels, task_names=("click", "watch"))
    loss, task_T, out, _ = m._loss(b)
    keep0, keep1 = ~labels[:, 0].isnan(), ~labels[:, 1].isnan()
    ref0 = F.binary_cross_entropy_with_logits(out[keep0, 0], labels[keep0, 0])
    ref1 = F.mse_loss(out[keep1, 1], labels[keep1, 1])
    torch.testing.assert_close(task_T, torch.stack([ref0, ref1]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, ref0 + 0.5 * ref1, rtol=1e-6, atol=1e-6)


def test_a_task_without_any_label_in_the_batch_is_skipped():
    m = _module()
    labels = torch.tensor([[1, np.nan], [0, np.nan], [1, np.nan], [0, np.nan]])
    loss, task_T, _, _ = m._loss(_batch(B=4, labels=labels))
    assert torch.isfinite(loss) and task_T[1] == 0
    loss.backward()
    tower = m.model.towers[1]
    assert all(p.grad is None or not p.grad.any() for p in tower.parameters())


def test_esmm_predicts_the_product_of_the_two_probabilities():
    a, b = torch.randn(100) * 4, torch.randn(100) * 4
    torch.testing.assert_close(torch.sigmoid(esmm_logit(a, b)), torch.sigmoid(a) * torch.sigmoid(b),
                               rtol=1e-5, atol=1e-6)
    assert torch.isfinite(esmm_logit(torch.tensor([30.0, -60.0]), torch.tensor([30.0, -60.0]))).all()
    m = _module(esmm=True)
    out = m(*(lambda x: (x.dense_features, x.sparse_features))(_batch()))
    assert (torch.sigmoid(out[:, 1]) <= torch.sigmoid(out[:, 0]) + 1e-6).all()  # p(buy) <= p(click)
    with pytest.raises(ValueError, match="two binary tasks"):
        _module(esmm=True, task_types=["binary", "regression"])


def test_bad_input_is_named():
    m = _module()
    with pytest.raises(ValueError, match=r"task 'buy' is binary.*5\.0"):
        m._loss(_batch(labels=torch.tensor([[1.0, 5.0]] * 8)))
    with pytest.raises(ValueError, match=r"\['click', 'like'\] but the model predicts \['click', 'buy'\]"):
        m._loss(_batch(task_names=("click", "like")))
    with pytest.raises(ValueError, match=r"labels \[B, 2\]"):
        m._loss(_batch(labels=torch.zeros(8, 3), task_names=None))
    with pytest.raises(ValueError, match="task_types"):
        _module(task_types=["binary", "ranking"])
    with pytest.raises(ValueError, match="mix"):
        _module(mix="moe")
    # a model without dense inputs read Criteo batches and dropped their 13 dense columns without a word
    b = _batch()
    with pytest.raises(ValueError, match=r"built for 0 dense features .* \(8, 2\): build it with dense_in_features=2"):
        _module(dense_in_features=0)(b.dense_features, b.sparse_features)


def test_task_names_of_the_model_and_the_data_module_must_agree(tmp_path):
    path = _table(tmp_path / "t.parquet", n=64)
    dm = TableDataModule(path, path, label_columns=["buy", "click"], sparse_columns=FEATURES,
                         dense_columns=["x", "y"], num_embeddings=ROWS)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    with pytest.raises(ValueError, match=r"label_columns give tasks \['buy', 'click'\]"):
        trainer.fit(_module(), dm)


# training under strategy="rec" --------------------------------------------------------------------------------------

def _fit(rank, world_size, path, pipeline, mix):
    from lightning_rec.strategy import RecStrategy

    L.seed_everything(0)
    dm = TableDataModule(path, path, label_columns=["click", "buy"], sparse_columns=FEATURES,
                         dense_columns=["x", "y"], num_embeddings=ROWS, batch_size=32, eval_batch_size=64)
    # GAUC groups read from the batch's features, pipelined or not
    module = _module(mix=mix, sparse_lr=0.3, dense_lr=0.03, metrics=["auc", "ne", "gauc"], group_feature="c")
    trainer = L.Trainer(strategy=RecStrategy(pipeline=pipeline), accelerator="cpu", devices=world_size, max_epochs=3,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, dm)
    sharded = type(module.model.sparse_arch.embedding_bag_collection).__name__
    return {k: float(v) for k, v in trainer.callback_metrics.items()}, sharded, trainer.global_step


@pytest.mark.parametrize("pipeline", [False, True])
def test_trains_sharded_on_one_rank(tmp_path, pipeline):
    metrics, sharded, steps = _fit(0, 1, _table(tmp_path / "t.parquet"), pipeline, "mmoe")
    assert "Sharded" in sharded and steps == 24
    assert metrics["val/click/auc"] > 0.8  # click follows feature a
    assert {"val/buy/auc", "val/buy/ne", "val/buy/gauc", "val/buy/logloss", "val_loss"} <= set(metrics)
    assert metrics["val/click/gauc"] > 0.7


def test_trains_sharded_and_pipelined_on_two_ranks(tmp_path):
    path = _table(tmp_path / "t.parquet")
    for pipeline, mix in ((False, "mmoe"), (True, "shared_bottom")):
        results = run_ranks(_fit, 2, path, pipeline, mix, timeout=240)
        (m0, sharded, steps), (m1, _, _) = results
        assert "Sharded" in sharded and steps == 12
        assert m0["val/click/auc"] == m1["val/click/auc"] > 0.7  # every rank's rows, synced
        assert m0["val/click/gauc"] == m1["val/click/gauc"] > 0.7


# recipes ------------------------------------------------------------------------------------------------------------

def test_the_census_income_recipe_reads_its_layout(tmp_path, capsys):
    """A few rows in census-income.data's layout (no header, ", " separated) through the recipe as it is. The fit's
    last line gives each task's metrics (it once gave val_loss alone: a task's are named val/<task>/<metric>)."""
    import yaml

    from lightning_rec.cli import run_cli

    recipe = "recipes/configs/mmoe_census_income.yaml"
    columns = yaml.safe_load(open(recipe))["data"]["init_args"]["column_names"]
    numeric = {"age", "wage_per_hour", "capital_gains", "capital_losses", "dividends_from_stocks", "instance_weight",
               "num_persons_worked_for_employer", "weeks_worked_in_year", "year", "industry_code", "occupation_code"}
    rng = np.random.default_rng(0)
    rows = []
    for i in range(64):
        value = {c: str(int(rng.integers(0, 90))) if c in numeric else f" v{int(rng.integers(0, 3))}" for c in columns}
        value["income"] = " 50000+." if i % 4 == 0 else " - 50000."
        value["marital_status"] = " Never married" if i % 3 == 0 else " Married-civilian spouse present"
        rows.append(",".join(value[c] for c in columns))
    path = tmp_path / "census-income.data"
    path.write_text("\n".join(rows) + "\n")
    cli = run_cli(["fit", "--config", recipe, f"--data.init_args.train_path={path}",
                   f"--data.init_args.val_path={path}",
                   "--trainer.max_epochs=1", f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
                   "--trainer.enable_progress_bar=false"])
    assert cli.trainer.global_step == 1
    assert {"val/income/auc", "val/marital/auc"} <= set(cli.trainer.callback_metrics)
    final = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("final validation:"))
    assert "val/income/auc=" in final and "val/marital/auc=" in final, final
