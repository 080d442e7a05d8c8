"""MultiTaskModule(managed_collision={...}) on raw ids: the arguments checked where the module is made (as
DLRMModule's and TwoTowerModule's), a few Trainer steps on MovieLens' raw user and item ids (hash_ids=False) with the
maps' metrics logged, a checkpoint round trip that keeps the maps, and the bad input (negative ids, raw ids into
tables without maps) refused naming the fix. The compiled package of such a model: tests/test_serving_package.py."""

from __future__ import annotations

import warnings

import lightning.pytorch as L
import pytest
import torch
from conftest import fit_movielens_recipe_briefly, needs_ml100k

from lightning_rec.models import MultiTaskModule
from lightning_rec.sparse import KeyedJaggedTensor

QUIET = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
             num_sanity_val_steps=0)
USER, ITEM = 10**12, 2**40  # raw ids far beyond any table's rows


def _maps(module) -> dict[str, torch.Tensor]:
    """table -> the raw ids its map holds."""
    mcc = module.model.sparse_arch.embedding_bag_collection._managed_collision_collection
    return {t: m.id_map()[0] for t, m in mcc.modules_by_table().items()}


def test_managed_collision_arguments_are_checked_where_the_module_is_made():
    kw = dict(num_embeddings_per_feature={"a": 8, "b": 8}, embedding_dim=4)
    with pytest.raises(ValueError, match=r"\['zch'\] are not MCHManagedCollisionModule arguments: give any of "
                                         r"eviction_policy"):
        MultiTaskModule(**kw, managed_collision={"zch": 3})
    with pytest.raises(ValueError, match=r"eviction_interval=0\): the eviction runs every"):
        MultiTaskModule(**kw, managed_collision={"eviction_interval": 0})
    with pytest.raises(ValueError, match=r"managed_collision_features=\['a'\]\) names the features that read raw ids, "
                                         r"but managed_collision is None: give managed_collision=\{\}"):
        MultiTaskModule(**kw, managed_collision_features=["a"])
    with pytest.raises(ValueError, match=r"\['user'\] are not among the sparse features \['a', 'b'\]"):
        MultiTaskModule(**kw, managed_collision={}, managed_collision_features=["a", "user"])
    with pytest.raises(ValueError, match=r"names none of the sparse features"):
        MultiTaskModule(**kw, managed_collision={}, managed_collision_features=[])
    module = MultiTaskModule(**kw, managed_collision={}, managed_collision_features=["b"])
    assert set(_maps(module)) == {"t_b"}  # a keeps its ids as rows


def test_negative_raw_ids_are_refused_before_anything_changes():
    module = MultiTaskModule(num_embeddings_per_feature={"a": 8, "b": 8}, embedding_dim=4, managed_collision={},
                             managed_collision_features=["a"]).train()
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([ITEM, ITEM + 1, 3, 4]),
                                              torch.tensor([1, 1, 1, 1]))
    module(torch.empty(2, 0), kjt)
    before = _maps(module)["t_a"]
    bad = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([ITEM + 2, -5, 3, 4]), kjt.lengths())
    with pytest.raises(ValueError, match=r"managed-collision table 't_a' got negative ids \[-5\]: it maps raw "
                                         r"non-negative int64 ids"):
        module(torch.empty(2, 0), bad)
    assert torch.equal(_maps(module)["t_a"], before)  # ITEM + 2 not admitted: refused before the map counted it


def _raw_movielens(tmp_path, **kw):
    from lightning_rec.data import MovieLensDataModule

    (tmp_path / "log").mkdir(exist_ok=True)
    rows = [f"{USER + 7 * u},{ITEM + 13 * i},{1 + (u + i) % 5},{u * 100 + i}" for u in range(12) for i in range(10)]
    (tmp_path / "log" / "ratings.csv").write_text("user_id,item_id,rating,timestamp\n" + "\n".join(rows) + "\n")
    dm = MovieLensDataModule(str(tmp_path / "log"), label_columns={"liked": "rating >= 4", "loved": "rating == 5"},
                             side_features=False, batch_size=16, eval_batch_size=32, hash_ids=False, **kw)
    dm.setup("fit")
    return dm


def _module(**kw) -> MultiTaskModule:
    return MultiTaskModule(task_names=["liked", "loved"], num_embeddings_per_feature={"user_id": 8, "item_id": 16},
                           embedding_dim=4, expert_layer_sizes=[8], num_experts=2, tower_layer_sizes=[4],
                           sparse_lr=0.1, **kw)


def test_raw_ids_train_log_the_maps_and_come_back_from_a_checkpoint(tmp_path):
    dm = _raw_movielens(tmp_path)
    torch.manual_seed(0)
    # 12 users through 7 rows (evicted every 2 steps), 10 items in 15 rows
    module = _module(managed_collision={"eviction_policy": "lru", "eviction_interval": 2})
    trainer = L.Trainer(max_steps=6, default_root_dir=tmp_path, enable_checkpointing=False, **QUIET)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "managed-collision table")  # 12 users churn through 7 rows: meant
        trainer.fit(module, dm)
    logged = trainer.logged_metrics
    for table in ("t_user_id", "t_item_id"):
        assert {f"mc/{table}/fill_ratio", f"mc/{table}/evictions_per_interval",
                f"mc/{table}/reused_row_lookup_share"} <= set(logged)
    assert float(logged["mc/t_user_id/fill_ratio"]) == 1.0  # 7 rows, 12 users
    maps = _maps(module)
    assert set(maps["t_user_id"].tolist()) <= {USER + 7 * u for u in range(12)} and maps["t_user_id"].numel() == 7
    assert 0 < maps["t_item_id"].numel() <= 10 and set(maps["t_item_id"].tolist()) <= {ITEM + 13 * i for i in range(10)}

    trainer.save_checkpoint(tmp_path / "m.ckpt")
    loaded = MultiTaskModule.load_from_checkpoint(tmp_path / "m.ckpt").eval()
    assert loaded.hparams.managed_collision == {"eviction_policy": "lru", "eviction_interval": 2}
    assert all(torch.equal(ids, maps[t]) for t, ids in _maps(loaded).items()) and set(_maps(loaded)) == set(maps)
    batch = next(iter(dm.val_dataloader()))
    module.eval()
    with torch.no_grad():  # raw ids in; users without a row read the unknown one, in both
        torch.testing.assert_close(loaded(batch.dense_features, batch.sparse_features),
                                   module(batch.dense_features, batch.sparse_features), atol=0, rtol=0)


def test_raw_ids_into_tables_without_maps_are_refused_naming_the_fix(tmp_path):
    dm = _raw_movielens(tmp_path)
    trainer = L.Trainer(max_steps=1, default_root_dir=tmp_path, enable_checkpointing=False, **QUIET)
    with pytest.raises(ValueError, match=r"MovieLensDataModule\(hash_ids=False\) hands the raw ids, which its tables "
                                         r"would read as rows: give MultiTaskModule\(managed_collision=\{\}\)"):
        trainer.fit(_module(), dm)


def test_raw_ids_on_a_feature_left_out_of_the_maps_are_refused_naming_it(tmp_path):
    """managed_collision_features=['user_id'] over raw item ids too: item ids around 2**40 went to a 16-row table
    and the batch check said only that an id was outside the table."""
    dm = _raw_movielens(tmp_path)
    trainer = L.Trainer(max_steps=1, default_root_dir=tmp_path, enable_checkpointing=False, **QUIET)
    with pytest.raises(ValueError, match=r"hands raw ids on \['item_id'\], which MultiTaskModule\(managed_collision_"
                                         r"features=\['user_id'\]\) leaves without an id map .*: add them"):
        trainer.fit(_module(managed_collision={}, managed_collision_features=["user_id"]), dm)


def test_a_checkpoint_with_maps_on_other_features_is_refused_and_every_feature_named_or_not_loads(tmp_path):
    from lightning_rec.data import MovieLensDataModule

    _raw_movielens(tmp_path)  # writes the log
    dm = MovieLensDataModule(str(tmp_path / "log"), label_columns={"liked": "rating >= 4", "loved": "rating == 5"},
                             side_features=False, batch_size=16, eval_batch_size=32)  # rows: maps on any feature
    quiet = dict(default_root_dir=tmp_path, enable_checkpointing=False, **QUIET)
    every, named = tmp_path / "every.ckpt", tmp_path / "named.ckpt"
    for path, features in ((every, None), (named, ["user_id", "item_id"])):
        trainer = L.Trainer(max_steps=1, **quiet)
        trainer.fit(_module(managed_collision={}, managed_collision_features=features), dm)
        trainer.save_checkpoint(path)
    both = _module(managed_collision={}, managed_collision_features=["item_id", "user_id"])
    L.Trainer(max_steps=2, **quiet).fit(both, dm, ckpt_path=every)  # None: every feature, the same maps
    with pytest.raises(ValueError, match=r"saved by a MultiTaskModule\(managed_collision=\{\}, managed_collision_"
                                         r"features=\['user_id', 'item_id'\]\), and this one is built with .*"
                                         r"managed_collision_features=\['user_id'\]"):
        L.Trainer(max_steps=2, **quiet).fit(_module(managed_collision={}, managed_collision_features=["user_id"]),
                                            dm, ckpt_path=named)


@needs_ml100k
def test_recipe_fits_a_few_steps_on_raw_ids(tmp_path):
    cli = fit_movielens_recipe_briefly("recipes/configs/mmoe_movielens_zch.yaml", tmp_path,
                                       "--trainer.limit_val_batches=1")
    maps = _maps(cli.model)
    assert cli.datamodule.hash_ids is False and set(maps) == {"t_user_id", "t_item_id"}
    assert maps["t_item_id"].numel() > 0 and set(maps["t_item_id"].tolist()) <= set(cli.datamodule.item_ids.tolist())
    assert "val/liked/auc" in cli.trainer.callback_metrics
