"""TwoTower / TwoTowerModule: losses against autograd references, errors, sharded training at 2 CPU ranks
(evaluation identical to the unsharded module on the same weights), and the two recipes, smoke-run with
W&B offline. The full-length recipe runs (the issue's figures) are not tests: see the README."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from conftest import SHARED_DATA, needs_wandb

from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.models import TwoTower, TwoTowerModule
from lightning_rec.models.two_tower import Tower, bpr_loss, in_batch_softmax_loss
from lightning_rec.sparse import KeyedJaggedTensor
from tests.dist_utils import run_ranks

ML100K = SHARED_DATA / "movielens" / "ml-100k"
needs_ml100k = pytest.mark.skipif(not (ML100K / "u.data").is_file(), reason="shared ml-100k not present")
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)


def test_in_batch_softmax_with_logq_and_accidental_hits_equals_reference():
    g = torch.Generator().manual_seed(0)
    user, item = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    items = torch.tensor([3, 1, 3, 2, 5, 1])  # items 3 and 1 appear twice: accidental hits
    log_q = torch.log(torch.tensor([0.1, 0.2, 0.1, 0.05, 0.3, 0.2]))
    got = in_batch_softmax_loss(user, item, items, log_q, temperature=0.5)
    want = 0.0
    for b in range(6):
        logits = [(user[b] @ item[j]) / 0.5 - log_q[j] for j in range(6) if j == b or items[j] != items[b]]
        pos = [j for j in range(6) if j == b or items[j] != items[b]].index(b)
        want += -torch.log_softmax(torch.stack(logits), 0)[pos]
    torch.testing.assert_close(got, want / 6, atol=1e-6, rtol=1e-6)  # fp32, six terms
    plain = in_batch_softmax_loss(user, item, torch.arange(6), None, 1.0)
    torch.testing.assert_close(plain, F.cross_entropy(user @ item.t(), torch.arange(6)))
    neg = torch.randn(6, 4, generator=g)
    want_bpr = -F.logsigmoid((user * item).sum(1) - (user * neg).sum(1)).mean()
    torch.testing.assert_close(bpr_loss(user, item, neg), want_bpr)



def test_in_batch_softmax_masks_accidental_hits_in_half_precision():
    # precision="16-mixed" on a GPU gives float16 logits (logq_correction=False keeps them so): the mask's
    # -1e9 does not fit in float16, and every step failed with "value cannot be converted to type c10::Half"
    g = torch.Generator().manual_seed(0)
    user, item = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    items = torch.tensor([3, 1, 3, 2, 5, 1])
    want = in_batch_softmax_loss(user, item, items, None, temperature=0.5)
    for dtype in (torch.float16, torch.bfloat16):
        got = in_batch_softmax_loss(user.to(dtype), item.to(dtype), items, None, temperature=0.5)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)  # 16-bit logits: ~3 digits
    # masked for any score: the mask sits below every finite logit (with -1e9, scores ~1e10 leaked through)
    big = in_batch_softmax_loss(user * 1e5, item * 1e5, torch.zeros(6, dtype=torch.int64), None)
    assert big == 0.0  # every other item is the positive itself: nothing is a negative

def _ebc(prefix, sizes, dim=8):
    return EmbeddingBagCollection([EmbeddingBagConfig(name=f"t_{prefix}_{f}", num_embeddings=n, embedding_dim=dim,
                                                      feature_names=[f]) for f, n in sizes.items()])


def test_two_tower_scores_and_errors():
    model = TwoTower(_ebc("u", {"user_id": 10}), _ebc("i", {"item_id": 20, "genre": 5}), [16, 4], [16, 4], "cosine")
    users = KeyedJaggedTensor.from_lengths_sync(["user_id"], torch.tensor([1, 2, 3]), torch.ones(3, dtype=torch.long))
    items = KeyedJaggedTensor.from_lengths_sync(["item_id", "genre"], torch.tensor([4, 5, 6, 1, 2]),
                                                torch.tensor([1, 1, 1, 2, 0, 0]))
    u, v = model(users, items)
    assert u.shape == v.shape == (3, 4)
    torch.testing.assert_close(u.norm(dim=1), torch.ones(3))  # cosine: unit vectors
    with pytest.raises(ValueError, match="same dim"):
        TwoTower(_ebc("u", {"user_id": 10}), _ebc("i", {"item_id": 20}), [8], [4])
    with pytest.raises(ValueError, match="unknown score"):
        TwoTower(_ebc("u", {"user_id": 10}), _ebc("i", {"item_id": 20}), score="l2")
    with pytest.raises(ValueError, match="unknown loss"):
        TwoTowerModule(loss="hinge")
    with pytest.raises(ValueError, match="configure_model"):
        TwoTowerModule().configure_optimizers()
    with pytest.raises(ValueError, match="table sizes"):
        TwoTowerModule().configure_model()
    # said "drop optimizer=..., or use kernel='auto'", arguments TwoTowerModule does not have (and, without table
    # sizes, only at configure_model)
    for sizes in ((), ({"user_id": 5}, {"item_id": 5})):
        with pytest.raises(ValueError, match=r"\(embedding_kernel='dense'\).*use embedding_kernel='auto'"):
            TwoTowerModule(*sizes, embedding_kernel="dense")
    with pytest.raises(ValueError, match=r"TwoTowerModule\(embedding_kernel='foo'\): unknown kernel"):
        TwoTowerModule(embedding_kernel="foo")


def test_tower_skip_feature_adds_the_id_embedding_to_the_mlp_output_and_checks_its_shape():
    torch.manual_seed(0)
    ebc = _ebc("i", {"item_id": 20, "genre": 5})
    tower = Tower(ebc, [16, 8], skip_feature="item_id", dropout=0.5)
    items = KeyedJaggedTensor.from_lengths_sync(["item_id", "genre"], torch.tensor([4, 5, 6, 1, 2, 3]),
                                                torch.tensor([1, 1, 1, 2, 0, 1]))
    tower.eval()  # dropout off: the reference below has none
    got = tower(items)
    pooled = ebc(items)
    want = tower.mlp(torch.cat([pooled["item_id"], pooled["genre"]], 1)) + pooled["item_id"]
    torch.testing.assert_close(got, want)
    # the residual path: with the MLP's last layer zeroed the tower is the id embedding alone (matrix factorisation)
    last = [m for m in tower.mlp if isinstance(m, torch.nn.Linear)][-1]
    torch.nn.init.zeros_(last.weight)
    torch.nn.init.zeros_(last.bias)
    torch.testing.assert_close(tower(items), pooled["item_id"])
    tower.train()  # dropout acts on the MLP in training (a different output), never on the id path
    assert [type(m).__name__ for m in tower.mlp] == ["Dropout", "Linear", "ReLU", "Dropout", "Linear"]
    with pytest.raises(ValueError, match="choose one of item_id, genre"):
        Tower(ebc, [16, 8], skip_feature="user_id")
    with pytest.raises(ValueError, match="no MLP"):
        Tower(ebc, [], skip_feature="item_id")
    with pytest.raises(ValueError, match="make the last layer size 8"):
        Tower(ebc, [16, 4], skip_feature="item_id")
    with pytest.raises(ValueError, match="dropout"):
        Tower(ebc, [8], dropout=1.0)


def test_module_id_skip_builds_residual_towers_and_names_the_id_features():
    module = TwoTowerModule({"user_id": 10, "age": 8}, {"item_id": 20, "genre": 5}, embedding_dim=8,
                            user_layer_sizes=[16, 8], item_layer_sizes=[16, 8], id_skip=True, tower_dropout=0.1)
    assert module.model.user_tower.skip_feature == "user_id" and module.model.item_tower.skip_feature == "item_id"
    with pytest.raises(ValueError, match="name the id features user_id and item_id"):
        TwoTowerModule({"uid": 10}, {"item_id": 20}, embedding_dim=8, user_layer_sizes=[8], item_layer_sizes=[8],
                       id_skip=True)


# side features (the data module's default) + residual towers: the skip reads one feature of the sharded output
SMALL = dict(embedding_dim=8, user_layer_sizes=[16, 8], item_layer_sizes=[16, 8], score="cosine", temperature=0.2,
             sparse_lr=0.05, dense_lr=0.01, top_k_table_users=0, id_skip=True, tower_dropout=0.1)


def _data(**kw):
    from lightning_rec.data import MovieLensDataModule

    return MovieLensDataModule(str(ML100K), batch_size=256, eval_batch_size=200, **kw)


def _fit_sharded(rank, world_size, ckpt):
    L.seed_everything(1)  # not the data module's seed (0)
    module = TwoTowerModule(**SMALL)
    trainer = L.Trainer(strategy="rec", accelerator="cpu", devices=world_size, max_epochs=1, limit_train_batches=8,
                        logger=False, num_sanity_val_steps=0, **QUIET)
    data = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    # the module's all_gather (throughput, memory) goes through the strategy's, not torch's deprecated one
    assert not [w for w in caught if "nn.functional.all_gather is deprecated" in str(w.message)]
    # the data module's seed sets the shuffle order at any world size, as it says (Lightning's own sampler took
    # seed_everything's), and each rank reads its own share
    from torch.utils.data import DistributedSampler

    want = DistributedSampler(data.datasets["train"], num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    assert list(trainer.train_dataloader.batch_sampler.sampler) == list(want)
    plan = str(trainer.strategy.plan)
    trainer.save_checkpoint(ckpt)
    return {k: float(v) for k, v in trainer.callback_metrics.items() if "@" in k}, plan


@needs_ml100k
def test_sharded_two_tower_at_2_ranks_evaluates_like_the_unsharded_module(tmp_path):
    ckpt = str(tmp_path / "tt.ckpt")
    (metrics0, plan), (metrics1, _) = run_ranks(_fit_sharded, 2, ckpt, timeout=300)
    assert metrics0 == metrics1  # synced: every rank logs the same values
    assert "t_user_user_id" in plan and "t_item_item_id" in plan
    assert metrics0["val_ndcg@10"] > 0.05  # learnt something in 8 steps (random ranking gives ~0.01)
    # the checkpoint holds whole tables: the unsharded module, one process, ranks the same users the same way
    from lightning_rec.checkpoint import full_state_dict, read_lightning_state

    hparams = read_lightning_state(ckpt)["hyper_parameters"]  # a sharded (DCP) checkpoint directory
    module = TwoTowerModule(**{**SMALL, **{k: hparams[k] for k in ("user_num_embeddings", "item_num_embeddings")}})
    module.load_state_dict(full_state_dict(ckpt))
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, **QUIET)
    single = trainer.validate(module, _data(), verbose=False)[0]
    for key, value in metrics0.items():
        assert single[key] == pytest.approx(value, abs=1e-6), key


def _recipe_args(tmp_path, name, steps):
    return ["fit", "--config", f"recipes/configs/{name}.yaml", f"--data.init_args.data_dir={ML100K}",
            f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--trainer.max_epochs=1", f"--trainer.limit_train_batches={steps}", "--trainer.check_val_every_n_epoch=1",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


@needs_wandb
@needs_ml100k
@pytest.mark.parametrize("recipe", ["two_tower_movielens", "matrix_factorization_movielens"])
def test_recipe_smoke_run_logs_to_wandb_offline(recipe, tmp_path, monkeypatch, capsys):
    from lightning_rec.cli import run_cli

    monkeypatch.setenv("WANDB_MODE", "offline")
    first = Path(f"recipes/configs/{recipe}.yaml").read_text().splitlines()
    assert first[0].startswith("# lightning-rec fit --config") and first[1].startswith("# Hardware:")
    cli = run_cli(_recipe_args(tmp_path, recipe, steps=3))
    metrics = cli.trainer.callback_metrics
    for key in ("val_ndcg@10", "test_ndcg@10", "val_recall@20", "test_mrr@10", "train_samples_per_s",
                "mem/rank0_max_rss_mb"):
        assert key in metrics, key
    printed = capsys.readouterr().out
    assert "final test: test_hit_rate@10=" in printed and printed.count("test_ndcg@10=") == 1, printed
    run_dir = Path(cli.trainer.logger.experiment.dir).parent  # where this run's offline file is, whatever WANDB_DIR
    cli.trainer.logger.experiment.finish()
    # (the sharding plan table is logged by strategy="rec": tests/test_strategy.py checks it)
    keys = (b"val_top10", b"train_samples_per_s", b"mem/rank0_max_rss_mb", b"embedding_dim")
    blob = b""
    for _ in range(60):  # the W&B service writes the offline file shortly after finish() returns
        blob = b"".join(p.read_bytes() for p in run_dir.glob("run-*.wandb"))
        if all(k in blob for k in keys):
            break
        time.sleep(0.5)
    for key in keys:
        assert key in blob, key


@needs_ml100k
def test_resumed_mid_epoch_ends_on_the_uninterrupted_weights(tmp_path):
    """A checkpoint from inside an epoch (Lightning then skips that epoch's on_train_epoch_start)."""
    from lightning_rec.cli import run_cli

    args = ["fit", "--config", "recipes/configs/matrix_factorization_movielens.yaml",
            f"--data.init_args.data_dir={ML100K}", "--trainer.logger=false", "--trainer.max_steps=12",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            "--trainer.enable_checkpointing=true", "--trainer.callbacks+=ModelCheckpoint",
            "--trainer.callbacks.every_n_train_steps=5", f"--trainer.callbacks.dirpath={tmp_path}",
            "--trainer.callbacks.save_top_k=-1", f"--trainer.default_root_dir={tmp_path}"]
    whole = run_cli(args)
    assert whole.trainer.num_training_batches > 12  # step 5 is inside the first epoch
    resumed = run_cli([*args, f"--ckpt_path={tmp_path / 'epoch=0-step=5.ckpt'}"])
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert not [k for k in a if not torch.equal(a[k], b[k])]


@needs_ml100k
def test_export_of_a_plain_lightning_checkpoint_rebuilds_the_two_tower_module(tmp_path):
    """Saved without strategy="rec" or the CLI: the module's own hook says which class wrote it."""
    import json

    from lightning_rec import checkpoint as ckpt

    L.seed_everything(0)
    module = TwoTowerModule(**SMALL)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, num_sanity_val_steps=0,
                        limit_val_batches=0, **QUIET)
    trainer.fit(module, _data())
    trainer.save_checkpoint(tmp_path / "tt.ckpt")
    exported = ckpt.load_exported(ckpt.export(tmp_path / "tt.ckpt", tmp_path / "out"))
    assert isinstance(exported, TwoTowerModule)
    for k, v in module.state_dict().items():
        assert torch.equal(exported.state_dict()[k], v), k
    # a checkpoint that names no class (a user's own module, plain Lightning): said, never guessed
    state = torch.load(tmp_path / "tt.ckpt", weights_only=False)
    del state["lightning_rec_module_class"]
    torch.save(state, tmp_path / "anon.ckpt")
    with pytest.warns(UserWarning, match="does not say which LightningModule"):
        out = ckpt.export(tmp_path / "anon.ckpt", tmp_path / "anon")
    assert json.loads((out / "config.json").read_text())["class_path"] is None
    with pytest.raises(ValueError, match=r"module=YourModule"):
        ckpt.load_exported(out)
    assert isinstance(ckpt.load_exported(out, module=TwoTowerModule(**{**SMALL, **{
        k: module.hparams[k] for k in ("user_num_embeddings", "item_num_embeddings")}})), TwoTowerModule)


@needs_ml100k
def test_validate_ranks_the_validation_split_once_even_when_fit_also_ranks_test():
    L.seed_everything(0)
    module, data = TwoTowerModule(**SMALL), _data(eval_test_in_fit=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, num_sanity_val_steps=0,
                        limit_train_batches=1, **QUIET)
    trainer.fit(module, data)
    assert "val_ndcg@10" in trainer.callback_metrics and "test_ndcg@10" in trainer.callback_metrics  # fit: both
    results = trainer.validate(module, data, verbose=False)
    # one dataloader, val_* only (it printed every metric under "DataLoader 0" and again under "DataLoader 1")
    assert len(results) == 1 and "val_ndcg@10" in results[0] and not [k for k in results[0] if k.startswith("test_")]


def _tiny_data(tmp_path, **kw):
    from test_movielens import _generated_ml100k

    from lightning_rec.data import MovieLensDataModule

    dm = MovieLensDataModule(str(_generated_ml100k(tmp_path / "ml-100k")), batch_size=64, side_features=False, **kw)
    dm.setup("fit")
    return dm


def test_training_step_runs_in_a_hand_written_loop(tmp_path):
    """No Trainer, so no on_train_epoch_start: training_step raised AttributeError '_samples'."""
    dm = _tiny_data(tmp_path, num_negatives=1)
    module = TwoTowerModule(dm.user_num_embeddings, dm.item_num_embeddings, embedding_dim=8, loss="bpr",
                            top_k_table_users=0)
    optimizer = module.configure_optimizers()
    before = module.model.user_tower.embedding_bag_collection.state_dict()
    before = {k: v.clone() for k, v in before.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer warns (Lightning's own)
        for i, batch in enumerate(dm.train_dataloader()):
            loss = module.training_step(batch, i)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    after = module.model.user_tower.embedding_bag_collection.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the fused update ran


def test_embed_catalog_exports_item_embeddings_outside_the_trainer_in_eval_mode(tmp_path):
    """embed_catalog() took no data module (only the Trainer's), and a module in train mode gave dropout noise."""
    dm = _tiny_data(tmp_path)
    module = TwoTowerModule(dm.user_num_embeddings, dm.item_num_embeddings, embedding_dim=8, user_layer_sizes=[8],
                            item_layer_sizes=[16, 8], tower_dropout=0.5, top_k_table_users=0, ks=[5])
    module.train()
    items_ID = module.embed_catalog(dm)
    assert module.training and module.model.item_tower.training  # the caller's mode is left as it was
    module.eval()
    with torch.no_grad():
        expected_ID = module.model.item_embeddings(dm.item_catalog())
        users_UD = module.model.user_embeddings(dm.user_catalog())
    torch.testing.assert_close(items_ID, expected_ID)
    # scoring users against the export by hand ranks as the Trainer's validation does
    from lightning_rec.metrics import RankingMetrics

    metric = RankingMetrics(ks=[5])
    val = dm.datasets["val"]
    metric.update_full(users_UD @ items_ID.t(), val.target[0], val.target[1], val.exclude[0], val.exclude[1])
    ours = metric.compute()["ndcg@5"]
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, **QUIET)
    assert trainer.validate(module, dm, verbose=False)[0]["val_ndcg@5"] == pytest.approx(float(ours), abs=1e-6)
    with pytest.raises(ValueError, match=r"embed_catalog\(dm\)"):
        TwoTowerModule(dm.user_num_embeddings, dm.item_num_embeddings, embedding_dim=8).embed_catalog()


def test_towers_without_mlp_on_side_features_say_to_turn_them_off():
    """MF (no MLP) on the data module's default side_features=True: the message spoke of layer sizes only."""
    user, item = {"user_id": 10, "age": 8, "gender": 3}, {"item_id": 20, "genre": 5}
    with pytest.raises(ValueError, match=r"3 features \(user_id, age, gender\) x embedding_dim 8.*side_features=False"):
        TwoTowerModule(user, item, embedding_dim=8)
    with pytest.raises(ValueError, match=r"its MLP's last layer.*side_features=False"):
        TwoTowerModule(user, item, embedding_dim=8, user_layer_sizes=[24])
    TwoTowerModule(user, item, embedding_dim=8, user_layer_sizes=[16], item_layer_sizes=[16])  # fine


def _table_logger():
    """A Lightning logger with W&B's log_table, keeping the tables it is given."""
    from lightning.pytorch.loggers import Logger

    class TableLogger(Logger):
        name, version = "t", 0

        def __init__(self):
            super().__init__()
            self.tables = []

        def log_metrics(self, metrics, step=None):
            pass

        def log_hyperparams(self, params, *args, **kwargs):
            self.hparams = dict(params)

        def log_table(self, key, columns, data):
            self.tables.append(data)

    return TableLogger()


def test_top_k_table_with_more_users_asked_than_the_data_has(tmp_path):
    """top_k_table_users=50 on 30 users raised IndexError at the end of validation, losing the run."""
    dm, logger = _tiny_data(tmp_path), _table_logger()
    module = TwoTowerModule(dm.user_num_embeddings, dm.item_num_embeddings, embedding_dim=8, top_k_table_users=50)
    L.Trainer(accelerator="cpu", devices=1, logger=logger, **QUIET).validate(module, dm, verbose=False)
    assert len(logger.tables) == 1 and {row[0] for row in logger.tables[0]} == set(range(dm.num_users))


def test_evaluation_sizes_are_checked_when_the_module_is_made():
    """eval_item_chunk=0 raised "range() arg 3 must not be zero" at the first validation, after training."""
    for kwargs in (dict(eval_item_chunk=0), dict(top_k_table_users=-1), dict(eval_item_chunk=2.5)):
        name = next(iter(kwargs))
        with pytest.raises(ValueError, match=f"{name}=.*give an int"):
            TwoTowerModule({"user_id": 4}, {"item_id": 5}, embedding_dim=4, **kwargs)


def test_predict_never_recommends_an_item_scored_nan_first(tmp_path):
    """topk ranked a NaN score first: a diverged item row topped every user's recommendations."""
    dm = _tiny_data(tmp_path)
    module = TwoTowerModule(dm.user_num_embeddings, dm.item_num_embeddings, embedding_dim=8, predict_top_k=5)
    module._item_emb_ID = module.embed_catalog(dm)
    module._item_emb_ID[7] = float("nan")
    module._predict_user_ids = module._predict_item_ids = None
    out = module.predict_step(dm.datasets["test"].__getitems__(list(range(6))), 0)
    assert not (out["item"] == 7).any() and torch.isfinite(out["score"]).all()


def test_empty_target_action_is_forwarded_to_the_ranking_metrics(tmp_path):
    """Validation always skipped users without a held-out item: torchmetrics' empty_target_action="neg" (count them
    as 0) could not be asked of the module."""
    from test_movielens import _generated_ml100k

    from lightning_rec.data import MovieLensDataModule

    dm = MovieLensDataModule(str(_generated_ml100k(tmp_path / "ml-100k")), batch_size=64, side_features=False,
                             min_rating=4)  # ratings >= 4 only: 1 of the 30 users has no validation item
    dm.setup("fit")
    assert dm.report.users_without_heldout["val"] == 1 and len(dm.datasets["val"]) == 30
    got = {}
    for action in ("skip", "neg", "pos"):
        L.seed_everything(0)  # the same weights for each
        module = TwoTowerModule(dm.user_num_embeddings, dm.item_num_embeddings, embedding_dim=8, ks=[5],
                                top_k_table_users=0, empty_target_action=action)
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, **QUIET)
        got[action] = {k: v for k, v in trainer.validate(module, dm, verbose=False)[0].items()}
    assert got["skip"]["val_hit_rate@5"] > 0  # else "neg" equals "skip"
    for key, skip in got["skip"].items():
        assert got["neg"][key] == pytest.approx(skip * 29 / 30, abs=1e-6), key
        assert got["pos"][key] == pytest.approx((skip * 29 + 1) / 30, abs=1e-6), key
    assert module.test_metrics.empty_target_action == "pos"
    with pytest.raises(ValueError, match="empty_target_action='zero'"):
        TwoTowerModule({"user_id": 4}, {"item_id": 5}, embedding_dim=4, empty_target_action="zero")


def test_softmax_refuses_batches_with_sampled_negatives_it_would_not_use(tmp_path):
    """loss="softmax" on num_negatives=1 data trained on in-batch negatives only: every batch's sampled negatives were
    drawn (and their KJT built) for nothing, without a word."""
    dm = _tiny_data(tmp_path, num_negatives=1)
    batch = next(iter(dm.train_dataloader()))
    assert batch.neg_item_features is not None
    module = TwoTowerModule(dm.user_num_embeddings, dm.item_num_embeddings, embedding_dim=8, top_k_table_users=0)
    with pytest.raises(ValueError, match="num_negatives=0.*loss='bpr'"):
        module.training_step(batch, 0)


def test_softmax_on_a_batch_of_one_pair_warns_once_naming_batch_size(tmp_path):
    """In-batch softmax over 1 pair: loss 0, no gradient, every step of such a run trained nothing, in silence."""
    dm = _tiny_data(tmp_path)
    module = TwoTowerModule(dm.user_num_embeddings, dm.item_num_embeddings, embedding_dim=8, top_k_table_users=0)
    one = dm.datasets["train"].__getitems__([0])
    with pytest.warns(UserWarning, match=r"batch of 1 pair.*loss is 0.*batch_size >= 2") as caught:
        assert module.training_step(one, 0).item() == 0.0
        module.training_step(one, 1)
    assert len([w for w in caught if "batch of 1 pair" in str(w.message)]) == 1  # once, not every step
    module = TwoTowerModule(dm.user_num_embeddings, dm.item_num_embeddings, embedding_dim=8, top_k_table_users=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*batch of 1 pair")
        assert module.training_step(dm.datasets["train"].__getitems__([0, 1]), 0).item() > 0


def _own_log(folder, shift: int = 0):
    from lightning_rec.data import MovieLensDataModule

    folder.mkdir()
    (folder / "ratings.csv").write_text("user,item,rating,timestamp\n" + "".join(
        f"{u},{i + shift},4,{u * 100 + i}\n" for u in range(12) for i in range(u % 4, 24, 3)))
    dm = MovieLensDataModule(str(folder), batch_size=16, side_features=False)
    dm.setup("fit")
    return dm


def test_another_data_snapshot_with_the_same_item_count_is_refused_at_evaluation_and_export(tmp_path):
    """Row i of the item table is dm.item_ids[i] of the training data: a snapshot whose ids differ but whose count is
    the same was ranked and predicted with the rows mapped to other items, silently (checkpoint and export too)."""
    from lightning_rec import checkpoint as ckpt

    trained, other = _own_log(tmp_path / "a"), _own_log(tmp_path / "b", shift=1)
    assert other.num_items == trained.num_items and other.item_ids.tolist() != trained.item_ids.tolist()
    module = TwoTowerModule(embedding_dim=8, top_k_table_users=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, max_steps=1, num_sanity_val_steps=0, **QUIET)
    trainer.fit(module, trained)
    trainer.save_checkpoint(tmp_path / "tt.ckpt")
    refused = r"item ids are not the items this model was trained on: .*train again on this one"
    with pytest.raises(ValueError, match=refused):
        trainer.predict(module, other)
    with pytest.raises(ValueError, match=refused):
        module.embed_catalog(other)
    with pytest.raises(ValueError, match=refused):  # a fresh module restored from the checkpoint
        L.Trainer(accelerator="cpu", devices=1, logger=False, **QUIET).validate(
            TwoTowerModule(embedding_dim=8, top_k_table_users=0), other, ckpt_path=tmp_path / "tt.ckpt", verbose=False)
    exported = ckpt.load_exported(ckpt.export(tmp_path / "tt.ckpt", tmp_path / "out"))
    with pytest.raises(ValueError, match=refused):
        exported.embed_catalog(other)
    torch.testing.assert_close(exported.embed_catalog(trained), module.embed_catalog(trained))
    trainer.validate(module, trained, verbose=False)  # the data it was trained on: as before


def test_another_snapshot_with_as_many_users_but_other_ones_is_refused(tmp_path):
    """Row i of the user table is dm.user_ids[i] too: a log where user 0 left and user 100 came (same count, same
    items) was predicted with every user on another user's row, and written under the new ids, in silence."""
    from lightning_rec import checkpoint as ckpt
    from lightning_rec.data import MovieLensDataModule

    def log(folder, users):
        folder.mkdir()
        (folder / "ratings.csv").write_text("user,item,rating,timestamp\n" + "".join(
            f"{u},{i},4,{k * 100 + i}\n" for k, u in enumerate(users) for i in range(k % 4, 24, 3)))
        dm = MovieLensDataModule(str(folder), batch_size=16, side_features=False)
        dm.setup("fit")
        return dm

    trained, other = log(tmp_path / "a", range(12)), log(tmp_path / "b", [100, *range(1, 12)])
    assert other.item_ids.tolist() == trained.item_ids.tolist() and other.num_users == trained.num_users
    module = TwoTowerModule(embedding_dim=8, top_k_table_users=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, max_steps=1, num_sanity_val_steps=0, **QUIET)
    trainer.fit(module, trained)
    trainer.save_checkpoint(tmp_path / "tt.ckpt")
    refused = r"user ids are not the users this model was trained on: row i of its user table is user_ids\[i\]"
    with pytest.raises(ValueError, match=refused):
        trainer.predict(module, other)
    exported = ckpt.load_exported(ckpt.export(tmp_path / "tt.ckpt", tmp_path / "out"))
    assert exported.hparams.user_ids_digest == module.hparams.user_ids_digest is not None
    with pytest.raises(ValueError, match=refused):
        L.Trainer(accelerator="cpu", devices=1, logger=False, **QUIET).predict(exported, other)
    L.Trainer(accelerator="cpu", devices=1, logger=False, **QUIET).predict(exported, trained)  # its own data: fine


def test_string_item_ids_kept_in_an_object_array_digest_and_predict_as_str_ids(tmp_path):
    """A data module of one's own may hold its ids as pandas does, an object array of str: the digest read them as
    int64 ("invalid literal for int()") and predict as a tensor; now they are the str ids' digest and columns."""
    import numpy as np

    from lightning_rec.models.two_tower_module import _ids_digest

    dm = _tiny_data(tmp_path)
    names = np.array([f"B{i:04d}" for i in range(dm.num_items)])
    dm.item_ids, dm.user_ids = names.astype(object), dm.user_ids.astype(object)  # ints in an object array too
    as_str = type("Data", (), {"item_ids": names})()
    assert _ids_digest(dm, "item_ids") == _ids_digest(as_str, "item_ids")
    module = TwoTowerModule(embedding_dim=8, top_k_table_users=0, predict_top_k=3)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, **QUIET)
    (out,) = trainer.predict(module, dm)[:1]
    assert module.hparams.item_ids_digest == _ids_digest(as_str, "item_ids")
    assert out["item"].dtype.kind == "U" and set(out["item"].ravel()) <= set(names)
    assert torch.is_tensor(out["user"]) and out["user"].dtype == torch.int64


def test_evaluation_given_dataloaders_only_says_to_pass_the_data_module(tmp_path):
    """It said "call it inside trainer.fit/validate/predict" to a user calling trainer.validate."""
    dm = _tiny_data(tmp_path)
    module = TwoTowerModule(dm.user_num_embeddings, dm.item_num_embeddings, embedding_dim=8, top_k_table_users=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, **QUIET)
    with pytest.raises(ValueError, match=r"given dataloaders only: pass the data module, trainer\.validate\(module, "
                                         r"datamodule=dm\)"):
        trainer.validate(module, dataloaders=dm.val_dataloader(), verbose=False)
    with pytest.raises(ValueError, match=r"given dataloaders only"):
        trainer.predict(module, dataloaders=dm.predict_dataloader())
    # fit with a validation loader: refused at setup, not after a whole epoch of training
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, max_epochs=1, num_sanity_val_steps=0, **QUIET)
    with pytest.raises(ValueError, match=r"given dataloaders only: pass the data module"):
        trainer.fit(module, train_dataloaders=dm.train_dataloader(), val_dataloaders=dm.val_dataloader())
    assert trainer.global_step == 0
    # no validation loader: nothing to rank, so it trains
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, max_steps=1, **QUIET)
    trainer.fit(module, train_dataloaders=dm.train_dataloader())
    assert trainer.global_step == 1


def test_loggers_get_the_table_sizes_read_from_the_data_module(tmp_path):
    """W&B's run config said user_num_embeddings: null (Lightning logs the hyperparameters as first saved), while the
    checkpoint held the sizes built."""
    dm, logger = _tiny_data(tmp_path), _table_logger()
    module = TwoTowerModule(embedding_dim=8, top_k_table_users=0)  # sizes from dm
    L.Trainer(accelerator="cpu", devices=1, logger=logger, **QUIET).validate(module, dm, verbose=False)
    assert logger.hparams["user_num_embeddings"] == dm.user_num_embeddings == {"user_id": dm.num_users}
    assert logger.hparams["item_num_embeddings"] == dm.item_num_embeddings
    assert module.hparams_initial["item_num_embeddings"] == module.hparams["item_num_embeddings"]


def test_top_k_table_lists_only_unseen_items(tmp_path):
    """A user with fewer than 10 unseen items had its list filled up with items it was seen with in training (scored
    -inf), shown as recommendations."""
    from test_movielens import _generated_ml100k

    from lightning_rec.data import MovieLensDataModule

    dm = MovieLensDataModule(str(_generated_ml100k(tmp_path / "ml-100k", items=12)), batch_size=64,
                             side_features=False)  # every user rated all 12 items: 10 in training, 2 unseen
    dm.setup("fit")
    logger = _table_logger()
    module = TwoTowerModule(dm.user_num_embeddings, dm.item_num_embeddings, embedding_dim=8, top_k_table_users=4)
    L.Trainer(accelerator="cpu", devices=1, logger=logger, **QUIET).validate(module, dm, verbose=False)
    (rows,) = logger.tables
    val = dm.datasets["val"]
    for u in range(4):
        seen = set(val.exclude[1][val.exclude[0][u]:val.exclude[0][u + 1]].tolist())
        mine = [row for row in rows if row[0] == u]
        assert [row[1] for row in mine] == [1, 2] and not {row[2] for row in mine} & seen, mine
        assert sum(row[4] for row in mine) == 1  # the held-out item is one of the two
    # items scored NaN (diverged rows) are no recommendations either: topk put them first, filling the list
    dm, logger = _tiny_data(tmp_path / "40"), _table_logger()  # 30 unseen items per user
    module = TwoTowerModule(dm.user_num_embeddings, dm.item_num_embeddings, embedding_dim=8, top_k_table_users=4)
    embed_catalog = module.embed_catalog

    def diverged(datamodule=None):
        items_ID = embed_catalog(datamodule)
        items_ID[:20] = float("nan")
        return items_ID

    module.embed_catalog = diverged
    L.Trainer(accelerator="cpu", devices=1, logger=logger, **QUIET).validate(module, dm, verbose=False)
    items = [row[2] for row in logger.tables[0] if row[0] == 0]
    assert len(items) == 10 and min(items) >= 20, items  # user 0 has >= 10 unseen items among 20..39


def test_tables_built_on_meta_train_sharded_and_export_to_cpu(tmp_path):
    """TwoTowerModule(embedding_device="meta"): the towers' tables get values when Trainer(strategy="rec") shards
    them; it trains, ranks, and its checkpoint exports to a CPU module with the same item embeddings."""
    from lightning_rec import checkpoint as ckpt

    with pytest.raises(ValueError, match="use 'cpu'.*or 'meta'"):
        TwoTowerModule(**SMALL, embedding_device="cuda")
    dm = _tiny_data(tmp_path)
    L.seed_everything(0)
    module = TwoTowerModule(**SMALL, ks=[5], embedding_device="meta")
    trainer = L.Trainer(strategy="rec", accelerator="cpu", devices=1, max_epochs=3, logger=False,
                        num_sanity_val_steps=0, default_root_dir=tmp_path, **QUIET)
    trainer.fit(module, dm)
    assert 0 <= float(trainer.callback_metrics["val_ndcg@5"]) <= 1
    trainer.save_checkpoint(tmp_path / "meta.ckpt")
    cpu = ckpt.load_exported(ckpt.export(tmp_path / "meta.ckpt", tmp_path / "out"))
    assert cpu.hparams.embedding_device == "cpu"
    torch.testing.assert_close(cpu.embed_catalog(dm), module.embed_catalog(dm))


def test_users_are_scored_against_items_in_float32_under_bf16_autocast():
    """Under precision='bf16-mixed' the user x item matmul ran in bfloat16 (autocast): 8-bit scores tied and swapped
    items (46% of ml-100k users' top-10 lists differed from float32's). The scores are float32 now."""
    from lightning_rec.models.two_tower_module import _scores

    g = torch.Generator().manual_seed(0)
    user_UD, item_ID = torch.randn(8, 32, generator=g), torch.randn(500, 32, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores_UI = _scores(user_UD, item_ID)
    assert scores_UI.dtype == torch.float32
    torch.testing.assert_close(scores_UI, user_UD @ item_ID.t(), atol=1e-5, rtol=0)
