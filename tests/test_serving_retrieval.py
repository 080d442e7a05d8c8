"""A retrieval export on ml-100k: Recall@10 through the exported FAISS flat index equals the in-training evaluation;
IVF keeps at least 0.98 of it; and the bad input the index refuses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

faiss = pytest.importorskip("faiss")

ML100K = Path(os.environ.get("LIGHTNING_REC_SHARED_DATA", "/nonexistent")) / "movielens" / "ml-100k"
needs_ml100k = pytest.mark.skipif(not (ML100K / "u.data").is_file(), reason="shared ml-100k not present")
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    if not (ML100K / "u.data").is_file():
        pytest.skip("shared ml-100k not present")
    import lightning as L

    from lightning_rec.data import MovieLensDataModule
    from lightning_rec.models import TwoTowerModule

    torch.manual_seed(0)
    dm = MovieLensDataModule(str(ML100K), batch_size=512, eval_batch_size=200)
    module = TwoTowerModule(embedding_dim=16, user_layer_sizes=[32, 16], item_layer_sizes=[32, 16], score="cosine",
                            temperature=0.2, sparse_lr=0.05, dense_lr=0.01, top_k_table_users=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=40, **QUIET)
    trainer.fit(module, dm)
    metrics = trainer.validate(module, dm, verbose=False)[0]
    return module.eval(), dm, metrics


@needs_ml100k
def test_recall_through_the_flat_index_equals_the_evaluation_and_ivf_keeps_most(trained, tmp_path):
    from lightning_rec.serving.retrieval import evaluate_index, export_retrieval, load_index

    module, dm, metrics = trained
    out = export_retrieval(module, dm, tmp_path / "flat", package=False)
    index = load_index(out, user_dim=16)
    assert index.ntotal == dm.num_items
    flat = evaluate_index(module, dm.val_dataloader(), index)
    assert abs(float(flat["recall@10"]) - metrics["val_recall@10"]) <= 1e-6, (flat, metrics)
    assert metrics["val_recall@10"] > 0.05  # learnt something
    ivf = evaluate_index(module, dm.val_dataloader(), load_index(export_retrieval(module, dm, tmp_path / "ivf",
                                                                                  index="ivf", package=False)))
    assert float(ivf["recall@10"]) >= 0.98 * metrics["val_recall@10"], (ivf, metrics)
    hnsw = load_index(export_retrieval(module, dm, tmp_path / "hnsw", index="hnsw", package=False))
    assert float(evaluate_index(module, dm.val_dataloader(), hnsw)["recall@10"]) >= 0.98 * metrics["val_recall@10"]


@needs_ml100k
def test_an_index_of_another_dim_and_an_existing_path_are_refused(trained, tmp_path):
    from lightning_rec.serving.retrieval import export_retrieval, load_index

    module, dm, _ = trained
    out = export_retrieval(module, dm, tmp_path / "r", package=False)
    with pytest.raises(ValueError, match="holds 16-dim item vectors but the user tower gives 32-dim"):
        load_index(out, user_dim=32)
    with pytest.raises(ValueError, match="exists and is not empty"):
        export_retrieval(module, dm, out, package=False)
    export_retrieval(module, dm, out, index="ivf", package=False, overwrite=True)


def test_search_leaves_out_the_excluded_items():
    from lightning_rec.serving.retrieval import build_index, search

    items = torch.eye(4)
    scores, found = search(build_index(items), torch.tensor([[4.0, 3.0, 2.0, 1.0]]), k=2,
                           exclude=[torch.tensor([0])])
    assert found.tolist() == [[1, 2]] and scores.tolist() == [[3.0, 2.0]]
    with pytest.raises(ValueError, match="give one of flat, ivf, hnsw"):
        build_index(items, "lsh")


def _traced_only(program, package_path, inductor_configs):
    """In place of AOTInductor's compile (a minute or two, and tests/test_serving_package.py's): the user tower's
    program as torch.export traced it, its metadata beside it."""
    meta = inductor_configs["aot_inductor.metadata"]["inputs"]
    torch.export.save(program, package_path, extra_files={"meta.json": meta})


def _traced_package(path):
    import json

    extra = {"meta.json": ""}
    program = torch.export.load(str(path), extra_files=extra)
    return program.module(), json.loads(extra["meta.json"])


class ShopCatalogue:
    """A data module of a small synthetic shop: item i's features are its id, its shop (i % 3) and two tags."""

    def __init__(self, num_items: int = 50, seed: int = 0) -> None:
        self.hparams = {"num_items": num_items, "seed": seed}
        self.num_items = num_items
        g = torch.Generator().manual_seed(seed)
        self.tags_I2 = torch.randint(0, 7, (num_items, 2), generator=g)

    def setup(self, stage=None) -> None:
        pass

    def item_catalog(self, rows):
        from lightning_rec.sparse import KeyedJaggedTensor

        B = len(rows)
        values = torch.cat([rows, rows % 3, self.tags_I2[rows].flatten()])
        lengths = torch.cat([torch.ones(2 * B, dtype=torch.long), torch.full((B,), 2)])
        return KeyedJaggedTensor.from_lengths_sync(["item_id", "shop", "tag"], values, lengths)


def test_cli_retrieval_reads_the_catalogue_of_any_data_module_with_an_item_table(tmp_path, monkeypatch, capsys):
    # `--datamodule CLASS`: the checkpoint's data hyper-parameters build it; its item_catalog(rows) feeds the item
    # tower, whatever the features (here not MovieLens': a shop and a bag of tags)
    from lightning_rec import checkpoint as ckpt
    from lightning_rec.cli import export_main
    from lightning_rec.models import TwoTowerModule
    from lightning_rec.serving.retrieval import load_index, search

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", _traced_only)
    torch.manual_seed(0)
    module = TwoTowerModule(user_num_embeddings={"user_id": 10}, item_num_embeddings={"item_id": 50, "shop": 3,
                                                                                       "tag": 7},
                            embedding_dim=8, item_layer_sizes=[8], score="cosine").eval()
    dm = ShopCatalogue(num_items=50, seed=3)
    ckpt.save_file({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                    "datamodule_hyper_parameters": dm.hparams,
                    "lightning_rec": {"module_class": "lightning_rec.models.TwoTowerModule"}}, tmp_path / "c.ckpt")
    export_main([str(tmp_path / "c.ckpt"), str(tmp_path / "out"), "--retrieval", "--datamodule",
                 f"{__name__}.ShopCatalogue"])
    index = load_index(tmp_path / "out" / "retrieval", user_dim=8)
    with torch.no_grad():
        items_ID = module.embed_catalog(dm)
    assert index.ntotal == 50 and (torch.from_numpy(index.reconstruct_n(0, 50)) - items_ID).abs().max() <= 1e-6
    user_tower, meta = _traced_package(tmp_path / "out" / "retrieval" / "user_tower.pt2")
    users = torch.arange(10)
    user_UD = user_tower(users, torch.ones(10, dtype=torch.long))
    _, top = search(index, user_UD, k=5)
    assert top.tolist() == (user_UD @ items_ID.t()).topk(5).indices.tolist()
    with pytest.raises(SystemExit):  # a class without item_catalog: named, with what it needs
        export_main([str(tmp_path / "c.ckpt"), str(tmp_path / "out2"), "--retrieval", "--datamodule",
                     "lightning_rec.data.tables.TableDataModule"])
    assert "TableDataModule has no item_catalog(rows)" in capsys.readouterr().err


@needs_ml100k
def test_cli_retrieval_writes_the_index_and_the_user_tower_package(trained, tmp_path, monkeypatch):
    # `lightning-rec export CKPT OUT --retrieval`: a user's top 10 from the two files, as the model ranks them. The
    # user tower's program is saved as torch.export traced it, not compiled: AOTInductor's compile of a package (a
    # minute or two) and its serving without lightning_rec are tests/test_serving_package.py's
    from lightning_rec import checkpoint as ckpt
    from lightning_rec.cli import export_main
    from lightning_rec.serving.retrieval import load_index, search

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", _traced_only)
    module, dm, _ = trained
    ckpt.save_file({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                    "datamodule_hyper_parameters": dict(dm.hparams),
                    "lightning_rec": {"module_class": "lightning_rec.models.TwoTowerModule"}}, tmp_path / "c.ckpt")
    export_main([str(tmp_path / "c.ckpt"), str(tmp_path / "out"), "--retrieval"])
    served = tmp_path / "out" / "retrieval"
    package, meta = _traced_package(served / "user_tower.pt2")
    assert meta["tower"] == "user" and meta["inputs"] == ["values", "lengths"]
    batch = next(iter(dm.val_dataloader()))
    kjt = batch.user_features.permute([batch.user_features.keys().index(f["name"]) for f in meta["sparse_features"]])
    user_UD = package(kjt.values(), kjt.lengths())
    with torch.no_grad():
        eager_UD = module.model.user_embeddings(batch.user_features)
    assert (user_UD - eager_UD).abs().max() <= 1e-4
    _, top = search(load_index(served, user_dim=user_UD.shape[1]), user_UD[:20], k=10)
    with torch.no_grad():
        want = (eager_UD[:20] @ module.embed_catalog(dm).t()).topk(10).indices
    assert (top == want).float().mean() >= 0.95  # near-ties may swap across float paths
