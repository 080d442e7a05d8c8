"""TwoTowerModule(managed_collision={...}) on MovieLens' raw user and item ids (hash_ids=False): the user_id / item_id
tables read them through id maps (one row more than the ids, for the unknown row); training under strategy="rec" at
1 and 2 ranks (the id tables row-wise, each rank owning the ids that route to it), full-ranking evaluation,
embed_catalog and the exported item tower all read the raw ids through the maps."""

from __future__ import annotations

import os
import warnings

import lightning.pytorch as L
import pytest
import torch
from conftest import ML100K, fit_movielens_recipe_briefly, needs_ml100k
from dist_utils import run_ranks

from lightning_rec.models import TwoTowerModule

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False)
MC = {"eviction_policy": "lfu", "eviction_interval": 4}
SMALL = dict(embedding_dim=8, sparse_lr=0.05, top_k_table_users=0, ks=[10], managed_collision=MC)


def _data(**kw):
    from lightning_rec.data import MovieLensDataModule

    return MovieLensDataModule(str(ML100K), batch_size=256, eval_batch_size=256, side_features=False, hash_ids=False,
                               **kw)


def test_managed_collision_arguments_are_checked_where_the_module_is_made():
    """As DLRMModule's (one check, managed_collision_tables'), also when the table sizes come later from the data."""
    with pytest.raises(ValueError, match=r"\['zch'\] are not MCHManagedCollisionModule arguments: give any of "
                                         r"eviction_policy"):
        TwoTowerModule(managed_collision={"zch": 3})
    with pytest.raises(ValueError, match=r"eviction_interval=0\): the eviction runs every"):
        TwoTowerModule(managed_collision={"eviction_interval": 0})
    with pytest.raises(ValueError, match="managed_collision maps the raw ids of the item_id feature, but the item "
                                         "tower's features are \\['movie'\\]: name the id feature item_id"):
        TwoTowerModule({"user_id": 5}, {"movie": 5}, managed_collision={})


def test_raw_ids_into_tables_without_an_id_map_are_refused_naming_the_fix(tmp_path):
    from test_two_tower import _tiny_data

    dm = _tiny_data(tmp_path, hash_ids=False)
    module = TwoTowerModule(dm.user_num_embeddings, dm.item_num_embeddings, embedding_dim=8, top_k_table_users=0)
    with pytest.raises(ValueError, match=r"hash_ids=False\) hands the raw user and item ids, which the towers' tables "
                                         r"would read as rows: give TwoTowerModule\(managed_collision=\{\}\)"):
        module.embed_catalog(dm)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, **QUIET)
    with pytest.raises(ValueError, match=r"managed_collision=\{\}"):
        trainer.fit(TwoTowerModule(embedding_dim=8, top_k_table_users=0), dm)


def _fit(rank, world_size, root):
    from lightning_rec import RecStrategy
    from lightning_rec.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    L.seed_everything(1)
    planner = EmbeddingShardingPlanner(Topology(world_size=world_size, compute_device="cpu"), constraints={
        t: ParameterConstraints(sharding_types=["row_wise"]) for t in ("t_user_user_id", "t_item_item_id")})
    module, data = TwoTowerModule(**SMALL), _data()
    trainer = L.Trainer(strategy=RecStrategy(planner=planner), accelerator="cpu", devices=world_size, max_epochs=1,
                        limit_train_batches=8, num_sanity_val_steps=0, **QUIET)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "managed-collision table")  # churn at the first evictions: meant
        trainer.fit(module, data)
    plan = str(trainer.strategy.plan)
    net = module.model
    maps = {tower: getattr(net, f"{tower}_tower").embedding_bag_collection._managed_collision_collection
            .modules_by_table()[f"t_{tower}_{tower}_id"].id_map()[0] for tower in ("user", "item")}
    items_ID = module.embed_catalog(data)  # every rank: the item table is sharded
    trainer.save_checkpoint(os.path.join(root, "tt"))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if "@" in k}
    return metrics, plan, maps, items_ID


@needs_ml100k
@pytest.mark.parametrize("world_size", [1, 2])
def test_raw_movielens_ids_train_evaluate_and_export_through_the_id_maps(tmp_path, world_size):
    from lightning_rec.checkpoint import export, load_exported
    from lightning_rec.serving.package import serving_module

    results = run_ranks(_fit, world_size, str(tmp_path), timeout=300)
    metrics, plan, _, items_ID = results[0]
    assert all(r[0] == metrics for r in results)  # synced: every rank logs the same values
    if world_size == 2:
        assert plan.count("row_wise") >= 2, plan
    # learnt in 8 steps as rows do: hash_ids=True without the maps gives 0.029 at 1 rank (0.031 here), a random
    # ranking below 0.01
    assert metrics["val_ndcg@10"] > 0.02, metrics
    data = _data()
    data.setup("fit")
    for tower, ids in (("user", data.user_ids), ("item", data.item_ids)):
        held = [r[2][tower] for r in results]
        together = torch.cat(held)
        # raw ids of the log, each on one owner; 8 steps of 256 pairs reach about half the items (a long tail)
        assert together.unique().numel() == together.numel() and set(together.tolist()) <= set(ids.tolist())
        assert together.numel() > 0.4 * len(ids), (tower, together.numel(), len(ids))
    # the export rebuilds the managed towers: embed_catalog and the item tower's serving module (what --package
    # compiles) read the catalogue's raw ids through the map, as the trained module did
    out = export(tmp_path / "tt", tmp_path / "out")
    loaded = load_exported(out)
    exported_ID = loaded.embed_catalog(data)
    # an item with a row reads it; one without reads the unknown row: its owner's in training, the export's one
    # (the last row) after (docs/managed_collision.md, Limits)
    has_row = torch.isin(torch.as_tensor(data.item_ids), torch.cat([r[2]["item"] for r in results]))
    torch.testing.assert_close(exported_ID[has_row], items_ID[has_row], atol=1e-6, rtol=0)  # fp32, same sums
    unknown_D = exported_ID[~has_row]
    assert unknown_D.shape[0] > 0 and bool((unknown_D == unknown_D[0]).all())
    if world_size == 1:
        assert torch.equal(exported_ID, items_ID)
    kjt = data.item_catalog()
    module, meta = serving_module(loaded, "fp32", tower="item")
    assert [f["raw_ids"] for f in meta["sparse_features"]] == [True]
    with torch.no_grad():
        torch.testing.assert_close(module(kjt.values(), kjt.lengths()), exported_ID, atol=1e-6, rtol=0)
        if world_size == 1:  # traced as --package traces it
            served = torch.export.export(module, (kjt.values(), kjt.lengths()), strict=False).module()
            torch.testing.assert_close(served(kjt.values(), kjt.lengths()), exported_ID, atol=1e-6, rtol=0)


@needs_ml100k
def test_recipe_fits_a_few_steps_on_raw_ids(tmp_path):
    cli = fit_movielens_recipe_briefly("recipes/configs/two_tower_movielens_zch.yaml", tmp_path,
                                       "--trainer.check_val_every_n_epoch=1")
    module = cli.model
    assert cli.datamodule.hash_ids is False and module.hparams.managed_collision["eviction_interval"] == 100
    ids, _ = (module.model.item_tower.embedding_bag_collection._managed_collision_collection
              .modules_by_table()["t_item_item_id"].id_map())
    assert ids.numel() > 0 and set(ids.tolist()) <= set(cli.datamodule.item_ids.tolist())
    assert "val_ndcg@10" in cli.trainer.callback_metrics
