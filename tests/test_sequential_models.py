"""SASRec and HSTU LightningModules: they learn a next-item pattern with either loss, the sampled softmax equals a
few-line reference, evaluation ranks every item (history excluded or not), an empty batch trains nothing, bad
arguments are refused."""

from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from conftest import SHARED_DATA

from lightning_rec.data.sequence import SequenceDataModule
from lightning_rec.models.sequence_losses import candidate_log_q, sampled_softmax_loss
from lightning_rec.models.sequential_module import HSTU, SASRec

ML100K = SHARED_DATA / "movielens" / "ml-100k"


def _pattern_log(tmp_path, users=24, items=12, length=9):
    """Each user walks the items in a cycle from its own start: the next item is always (item + 1) % items."""
    rows = [(u, (u + j) % items, j * 60) for u in range(users) for j in range(length)]
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "ratings.csv").write_text("user,item,rating,timestamp\n" + "".join(f"{u},{i},5,{t}\n"
                                                                                  for u, i, t in rows))
    return SequenceDataModule(str(tmp_path), max_len=6, batch_size=8, eval_batch_size=16, num_workers=0)


def _trainer(epochs):
    return L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     check_val_every_n_epoch=1000)


@pytest.mark.parametrize("cls,loss", [(SASRec, "softmax"), (HSTU, "sampled_softmax")])
def test_learns_the_next_item(tmp_path, cls, loss):
    torch.manual_seed(0)
    dm = _pattern_log(tmp_path)
    # 10 epochs of 3 steps at these rates learn the cycle (NDCG@10 0.9-1.0 over seeds 0-2); 25 at 0.2/0.01 took 15 s
    model = cls(embedding_dim=16, num_blocks=1, dropout=0.0, loss=loss, num_negatives=8, sparse_lr=0.5,
                dense_lr=0.03, **({"attention_dim": 8, "value_dim": 8} if cls is HSTU else {}))
    _trainer(10).fit(model, dm)
    (metrics,) = _trainer(1).test(model, dm, verbose=False)
    assert metrics["test_hit_rate@10"] == 1.0 and metrics["test_ndcg@10"] > 0.6, metrics


def test_sampled_softmax_equals_reference():
    g = torch.Generator().manual_seed(0)
    T, U, n_items, D = 5, 4, 9, 3
    h, targets = torch.randn(T, D, generator=g), torch.tensor([1, 2, 1, 7, 3])
    candidates = torch.cat([targets, torch.tensor([2, 0, 8, 1])])
    table = torch.randn(n_items, D, generator=g)
    counts = torch.arange(1, n_items + 1).float()
    log_q = candidate_log_q(counts, candidates, T, U)
    got = sampled_softmax_loss(h, table[candidates], candidates, targets, log_q, temperature=0.5)
    losses = []
    for t in range(T):  # candidate t is the positive; every other copy of the same item is left out
        keep = [c for c in range(T + U) if c == t or candidates[c] != targets[t]]
        q = torch.log(T * counts[candidates[keep]] / counts.sum() + U / n_items)
        logits = h[t] @ table[candidates[keep]].t() / 0.5 - q
        losses.append(-F.log_softmax(logits, 0)[keep.index(t)])
    torch.testing.assert_close(got, torch.stack(losses).mean(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("exclude", [False, True])
def test_evaluation_ranks_the_catalog_history_excluded_or_not(tmp_path, exclude):
    dm = _pattern_log(tmp_path)
    dm.setup()
    model = SASRec(num_items=dm.num_items, max_len=6, embedding_dim=8, exclude_history=exclude)
    seen = {}
    model.test_metrics.update_full = lambda scores, t_off, t_items, x_off, x_items: seen.update(
        shape=scores.shape, excluded=x_items.numel(), targets=t_items.tolist())
    model.eval()
    model.on_test_epoch_start()
    batch = dm.datasets["test"].__getitems__(list(range(4)))
    model.test_step(batch, 0)
    assert seen["shape"] == (4, dm.num_items) and seen["targets"] == batch.targets.tolist()
    assert seen["excluded"] == (int(batch.exclude_offsets[-1]) if exclude else 0)


def test_empty_batch_trains_nothing(tmp_path):
    dm = _pattern_log(tmp_path)
    dm.setup()
    model = HSTU(num_items=dm.num_items, max_len=6, embedding_dim=8, attention_dim=4, value_dim=4)
    loss = model.training_step(dm.datasets["train"].__getitems__([]), 0)
    assert float(loss.detach()) == 0.0
    loss.backward()
    model.on_test_epoch_start()
    model.test_step(dm.datasets["test"].__getitems__([-1]), 0)  # an evaluation rank's padding: nothing counted
    assert int(model.test_metrics.num_users) == 0


def test_history_longer_than_the_model_refused(tmp_path):
    dm = _pattern_log(tmp_path)
    dm.setup()
    model = HSTU(num_items=dm.num_items, max_len=3, embedding_dim=8, attention_dim=4, value_dim=4)
    with pytest.raises(ValueError, match="longer than its max_len"):
        model.training_step(dm.datasets["train"].__getitems__([0]), 0)


@pytest.mark.parametrize("kwargs,match", [({"loss": "bpr"}, "loss"), ({"max_len": 0}, "max_len"),
                                          ({"temperature": 0}, "temperature"), ({"num_items": -1}, "num_items")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SASRec(**kwargs)


@pytest.mark.skipif(not (ML100K / "u.data").is_file(), reason="shared ml-100k not present")
@pytest.mark.parametrize("recipe", ["sasrec_movielens", "hstu_movielens"])
def test_recipe_smoke_run(recipe, tmp_path):
    from lightning_rec.cli import run_cli

    first = Path(f"recipes/configs/{recipe}.yaml").read_text().splitlines()
    assert first[0].startswith("# lightning-rec fit --config") and first[1].startswith("# Hardware:")
    cli = run_cli(["fit", "--config", f"recipes/configs/{recipe}.yaml", f"--data.init_args.data_dir={ML100K}",
                   f"--trainer.default_root_dir={tmp_path}", "--trainer.max_epochs=1",
                   "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
                   "--trainer.check_val_every_n_epoch=1", "--trainer.enable_progress_bar=false",
                   "--trainer.enable_model_summary=false"])
    metrics = cli.trainer.callback_metrics
    assert {"val_ndcg@10", "test_ndcg@10", "train_loss"} <= set(metrics), sorted(metrics)


@pytest.mark.parametrize("recipe,pipelined", [("sasrec_ml1m", True), ("hstu_ml1m", False)])
def test_ml1m_recipe_runs_on_an_ml1m_format_folder(recipe, pipelined, tmp_path):
    """The ml-1m recipes as their headers run them, on a folder in ml-1m's format (ratings.dat, '::'), SASRec
    under RecStrategy(pipeline=True) as its header gives it."""
    from lightning_rec.cli import run_cli

    header = Path(f"recipes/configs/{recipe}.yaml").read_text()
    assert "wget https://files.grouplens.org/datasets/movielens/ml-1m.zip" in header
    assert ("0.1603" if recipe.startswith("sasrec") else "0.1720") in header
    (tmp_path / "ml-1m").mkdir()
    (tmp_path / "ml-1m" / "ratings.dat").write_text("".join(
        f"{u}::{(u * 7 + j * 3) % 23 + 1}::4::{978300000 + 60 * j}\n" for u in range(1, 13) for j in range(4 + u % 5)))
    pipeline = ["--trainer.strategy=RecStrategy", "--trainer.strategy.pipeline=true"] if pipelined else []
    cli = run_cli(["fit", "--config", f"recipes/configs/{recipe}.yaml", f"--data.init_args.data_dir={tmp_path}/ml-1m",
                   f"--trainer.default_root_dir={tmp_path}", "--trainer.max_epochs=1", "--data.init_args.batch_size=4",
                   "--trainer.check_val_every_n_epoch=1", "--trainer.enable_progress_bar=false",
                   "--trainer.enable_model_summary=false", *pipeline])
    assert cli.datamodule.report.layout == "ml-1m" and cli.trainer.global_step == 3
    assert {"val_ndcg@10", "test_ndcg@10", "train_loss"} <= set(cli.trainer.callback_metrics)
