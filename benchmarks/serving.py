"""Serving: what int8 / int4 tables cost in validation AUC and save in bytes, and how a `.pt2` package answers
512-row requests against the eager fp32 model, in the same run.

    flock /tmp/lightning_rec_bench.lock .venv/bin/python benchmarks/serving.py [--epochs 3] [--rounds 200]
    .venv/bin/python benchmarks/serving.py --smoke     # a tiny model, synthetic rows, a few requests
    .venv/bin/python benchmarks/serving.py --smoke --package OUT   # requests to OUT/model.pt2, compiled before

`--package OUT`: an export with a ranker's package (`lightning-rec export CKPT OUT --package`) answers the requests
against its eager model (`load_exported(OUT)`), instead of the trained DLRM compiled here (the compile takes a minute
or two on CPU); the tests' smoke reuses the package their session compiled.

A DLRM (tables of dim 64) trains on the Criteo sample ($LIGHTNING_REC_SHARED_DATA/criteo, its train file; the valid
file is the validation set); smoke mode uses synthetic rows and small tables. Validation AUC of the fp32 model and of
`quantize_inference_model(model, "int8" / "int4")`; table bytes of each. The fp32 model is then packaged
(`export_package`, AOTInductor) and loaded; requests of 512 rows alternate between the package and the eager module
(one round each per request), p50 / p99 latency and rows/s from those rounds. The last line is one JSON object:
{"benchmark": "serving", "results": [...], "ratios": {"table_bytes_int8_vs_fp32", "table_bytes_int4_vs_fp32",
"p50_package_vs_eager"}, "figures": {"auc_fp32", "auc_loss_int8", "auc_loss_int4", "max_abs_diff_package",
"recall10_index_vs_eval", "p50_ms_package", "p99_ms_package", "p50_ms_eager", "p99_ms_eager",
"rows_per_s_package", "rows_per_s_eager", "compile_s", "recall10_eval", "recall10_ivf_vs_flat",
"recall10_hnsw_vs_flat"}}. Retrieval: a two-tower model on ml-100k ($LIGHTNING_REC_SHARED_DATA/movielens), its val
Recall@10 as evaluated and through FAISS indexes of the catalogue (recall10_index_vs_eval: |flat - evaluated|; null
without faiss or the data).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lightning_rec.metrics import AUC
from lightning_rec.models import DLRMModule
from lightning_rec.serving import quantize_inference_model
from lightning_rec.serving.package import example_inputs, export_package
from lightning_rec.sparse import KeyedJaggedTensor

REQUEST_ROWS = 512


def _criteo(smoke: bool, epochs: int):
    """(model trained, validation batches as (dense, kjt, labels))."""
    import lightning

    from lightning_rec.data import CriteoDataModule, SyntheticCriteoDataModule

    root = Path(os.environ.get("LIGHTNING_REC_SHARED_DATA", "")) / "criteo"
    rows = 1000 if smoke else 10_000
    if smoke or not (root / "criteo_kaggle_train_sample.tsv").is_file():
        data = SyntheticCriteoDataModule(num_train_samples=2048 if smoke else 20_000, num_val_samples=1024,
                                         num_embeddings_per_feature=rows, batch_size=256)
    else:
        data = CriteoDataModule(train_path=str(root / "criteo_kaggle_train_sample.tsv"),
                                val_path=str(root / "criteo_kaggle_valid_sample.tsv"),
                                num_embeddings_per_feature=rows, batch_size=256)
    dim = 16 if smoke else 64
    torch.manual_seed(0)
    model = DLRMModule(num_embeddings_per_feature=rows, embedding_dim=dim, dense_arch_layer_sizes=[64, dim],
                       over_arch_layer_sizes=[64, 32, 1], sparse_lr=0.05, dense_lr=0.01)
    trainer = lightning.Trainer(max_epochs=1 if smoke else epochs, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    data.setup("validate")
    batches = [(b.dense_features, b.sparse_features, b.labels) for b in data.val_dataloader()]
    return model.eval(), batches


def _retrieval(smoke: bool) -> dict:
    """ml-100k two-tower: val Recall@10 of the evaluation, and through the exported flat and IVF indexes."""
    import lightning

    root = Path(os.environ.get("LIGHTNING_REC_SHARED_DATA", "")) / "movielens" / "ml-100k"
    try:
        import faiss  # noqa: F401
    except ImportError:
        return {}
    if not (root / "u.data").is_file():
        return {}
    from lightning_rec.data import MovieLensDataModule
    from lightning_rec.models import TwoTowerModule
    from lightning_rec.serving.retrieval import build_index, evaluate_index

    torch.manual_seed(0)
    dm = MovieLensDataModule(str(root), batch_size=512, eval_batch_size=200)
    module = TwoTowerModule(embedding_dim=32, user_layer_sizes=[64, 32], item_layer_sizes=[64, 32], score="cosine",
                            temperature=0.2, top_k_table_users=0)
    trainer = lightning.Trainer(max_epochs=1 if smoke else 5, limit_train_batches=5 if smoke else None,
                                accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, dm)
    evaluated = trainer.validate(module, dm, verbose=False)[0]["val_recall@10"]
    with torch.no_grad():
        items = module.eval().embed_catalog(dm)
    found = {kind: float(evaluate_index(module, dm.val_dataloader(), build_index(items, kind))["recall@10"])
             for kind in ("flat", "ivf", "hnsw")}
    print(f"ml-100k val Recall@10: evaluation {evaluated:.5f}, flat index {found['flat']:.5f}, ivf {found['ivf']:.5f}"
          f", hnsw {found['hnsw']:.5f}", flush=True)
    return {"recall10_eval": evaluated, "recall10_index_vs_eval": abs(found["flat"] - evaluated),
            "recall10_ivf_vs_flat": found["ivf"] / found["flat"],
            "recall10_hnsw_vs_flat": found["hnsw"] / found["flat"]}


@torch.no_grad()
def _auc(model, batches) -> float:
    metric = AUC()
    for dense, kjt, labels in batches:
        metric.update(model(dense, kjt), labels)
    return float(metric.compute())


def _table_bytes(model) -> int:
    ebc = model.model.sparse_arch.embedding_bag_collection
    if hasattr(ebc, "table_bytes"):
        return ebc.table_bytes()
    return sum(p.numel() * p.element_size() for p in ebc.table_parameters().values())


def _latency(package, model, meta, rounds: int) -> dict:
    """Alternating rounds, one 512-row request each (the side that goes first swaps each round); seconds per
    request for each side."""
    names = [f["name"] for f in meta["sparse_features"]]
    times = {"package": [], "eager": []}
    diffs = []
    for r in range(rounds):
        inputs = example_inputs(meta, batch=REQUEST_ROWS, seed=r)
        given = dict(zip(meta["inputs"], inputs))
        kjt = KeyedJaggedTensor.from_lengths_sync(names, given["values"], given["lengths"],
                                                  weights=given.get("weights"))
        dense = given.get("dense_features", torch.empty(REQUEST_ROWS, 0))
        sides = {"package": (package, inputs), "eager": (model, (dense, kjt))}
        out = {}
        with torch.no_grad():
            for side in (("package", "eager") if r % 2 == 0 else ("eager", "package")):  # who goes first swaps
                t0 = time.perf_counter()
                call, args = sides[side]
                out[side] = call(*args)
                times[side].append(time.perf_counter() - t0)
        diffs.append(float((out["package"] - out["eager"]).abs().max()))
    warm = {k: sorted(v[min(3, rounds - 1):]) for k, v in times.items()}  # the first requests warm caches
    out = {"max_abs_diff": max(diffs)}
    for k, v in warm.items():
        out[f"p50_ms_{k}"] = 1e3 * statistics.median(v)
        out[f"p99_ms_{k}"] = 1e3 * v[min(len(v) - 1, int(0.99 * len(v)))]
        out[f"rows_per_s_{k}"] = REQUEST_ROWS * len(v) / sum(v)
    return out


def _served(model, exported: str | None, rounds: int) -> tuple[dict, float | None]:
    """(latency figures, compile seconds): `model` packaged here, or the package and model of an export."""
    if exported is not None:
        from lightning_rec.checkpoint import load_exported

        package = torch._inductor.aoti_load_package(str(Path(exported) / "model.pt2"))
        meta = json.loads(package.get_metadata()["inputs"])
        return _latency(package, load_exported(exported).eval(), meta, rounds), None
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = export_package(model, Path(tmp) / "dlrm.pt2", tables="fp32")
        compile_s = time.perf_counter() - t0
        package = torch._inductor.aoti_load_package(str(path))
        meta = json.loads(package.get_metadata()["inputs"])
        return _latency(package, model, meta, rounds), compile_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--package", default=None, help="an export directory with model.pt2 to serve instead")
    args = parser.parse_args()
    rounds = 8 if args.smoke else args.rounds
    model, batches = _criteo(args.smoke, args.epochs)
    results, auc, table_bytes = [], {}, {}
    for kind in ("fp32", "int8", "int4"):
        served = model if kind == "fp32" else quantize_inference_model(model, kind)
        auc[kind], table_bytes[kind] = _auc(served, batches), _table_bytes(served)
        results.append({"tables": kind, "val_auc": auc[kind], "table_bytes": table_bytes[kind]})
        print(f"{kind}: val AUC {auc[kind]:.5f}, table bytes {table_bytes[kind]:,}", flush=True)
    latency, compile_s = _served(model, args.package, rounds)
    source = f"compiled in {compile_s:.0f} s" if compile_s is not None else f"from {args.package}"
    print(f"package {source}; 512-row requests: package p50 {latency['p50_ms_package']:.2f} ms "
          f"p99 {latency['p99_ms_package']:.2f} ms, eager p50 {latency['p50_ms_eager']:.2f} ms p99 "
          f"{latency['p99_ms_eager']:.2f} ms; max |package - eager| {latency['max_abs_diff']:.2e}", flush=True)
    figures = {"auc_fp32": auc["fp32"], "auc_loss_int8": auc["fp32"] - auc["int8"],
               "auc_loss_int4": auc["fp32"] - auc["int4"], "max_abs_diff_package": latency.pop("max_abs_diff"),
               "recall10_index_vs_eval": None, "compile_s": compile_s, **latency, **_retrieval(args.smoke)}
    ratios = {"table_bytes_int8_vs_fp32": table_bytes["int8"] / table_bytes["fp32"],
              "table_bytes_int4_vs_fp32": table_bytes["int4"] / table_bytes["fp32"],
              "p50_package_vs_eager": latency["p50_ms_package"] / latency["p50_ms_eager"]}
    print(json.dumps({"benchmark": "serving", "results": results, "ratios": ratios, "figures": figures}))


if __name__ == "__main__":
    main()
