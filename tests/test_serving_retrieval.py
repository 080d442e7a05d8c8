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


@needs_ml100k
def test_cli_retrieval_writes_the_index_and_the_user_tower_package(trained, tmp_path, monkeypatch):
    # `lightning-rec export CKPT OUT --retrieval`: a user's top 10 from the two files, as the model ranks them. The
    # user tower's program is saved as torch.export traced it, not compiled: AOTInductor's compile of a package (a
    # minute or two) and its serving without lightning_rec are tests/test_serving_package.py's
    import json

    from lightning_rec import checkpoint as ckpt
    from lightning_rec.cli import export_main
    from lightning_rec.serving.retrieval import load_index, search

    def traced_only(program, package_path, inductor_configs):
        meta = inductor_configs["aot_inductor.metadata"]["inputs"]
        torch.export.save(program, package_path, extra_files={"meta.json": meta})

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", traced_only)
    module, dm, _ = trained
    ckpt.save_file({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                    "datamodule_hyper_parameters": dict(dm.hparams),
                    "lightning_rec": {"module_class": "lightning_rec.models.TwoTowerModule"}}, tmp_path / "c.ckpt")
    export_main([str(tmp_path / "c.ckpt"), str(tmp_path / "out"), "--retrieval"])
    served = tmp_path / "out" / "retrieval"
    extra = {"meta.json": ""}
    package = torch.export.load(str(served / "user_tower.pt2"), extra_files=extra).module()
    meta = json.loads(extra["meta.json"])
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
