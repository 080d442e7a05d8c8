"""The `.pt2` serving package: compiled once (AOTInductor on CPU takes a minute or two), loaded in a process where
lightning_rec cannot be imported, its outputs against the eager model on 1,000 rows; and the requests it refuses."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_rec.models import DLRMModule
from lightning_rec.serving import quantize_inference_model
from lightning_rec.serving.package import example_inputs, export_package
from lightning_rec.sparse import KeyedJaggedTensor

NAMES = ["s0", "s1", "s2"]
TINY = dict(num_embeddings_per_feature=[40, 30, 20], embedding_dim=8, sparse_feature_names=NAMES,
            dense_in_features=4, dense_arch_layer_sizes=[8], over_arch_layer_sizes=[8, 1])

# a fresh process: lightning_rec blocked at import, the package loaded with torch and fbgemm_gpu alone
SERVER = textwrap.dedent("""
    import importlib.abc, json, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "lightning_rec":
                raise ImportError("lightning_rec is blocked in this process")
    sys.meta_path.insert(0, Block())
    import torch, fbgemm_gpu  # noqa: F401
    package = torch._inductor.aoti_load_package(sys.argv[1])
    inputs = torch.load(sys.argv[2])
    out = {"meta": json.loads(package.get_metadata()["inputs"])}
    torch.save(package(*inputs["good"]), sys.argv[3])
    for name, bad in inputs["bad"].items():
        try:
            package(*bad)
            out[name] = "served"
        except Exception as e:
            out[name] = type(e).__name__
    out["imported"] = any(m.split(".")[0] == "lightning_rec" for m in sys.modules)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    # through the command line: `lightning-rec export CKPT OUT --tables int8 --package`
    from lightning_rec import checkpoint as ckpt
    from lightning_rec.cli import export_main

    torch.manual_seed(0)
    model = DLRMModule(**TINY).eval()
    tmp = tmp_path_factory.mktemp("pkg")
    ckpt.save_file({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams),
                    "lightning_rec": {"module_class": "lightning_rec.models.dlrm_module.DLRMModule"}}, tmp / "c.ckpt")
    export_main([str(tmp / "c.ckpt"), str(tmp / "out"), "--tables", "int8", "--package"])
    return model, tmp / "out" / "model.pt2"


def test_package_serves_in_a_process_without_lightning_rec(package, tmp_path):
    model, path = package
    meta = {"sparse_features": [{"name": n, "rows": r} for n, r in zip(NAMES, [40, 30, 20])], "dense_features": 4}
    dense, values, lengths = example_inputs(meta, batch=1000, seed=1)
    kjt = KeyedJaggedTensor.from_lengths_sync(NAMES, values, lengths)
    with torch.no_grad():
        eager = quantize_inference_model(model, "int8")(dense, kjt)
    missing = lengths[: 2 * 1000]  # feature s2 left out
    beyond = values.clone()
    beyond[-1] = 20  # s2 has 20 rows
    negative = values.clone()
    negative[0] = -1
    torch.save({"good": (dense, values, lengths),
                "bad": {"missing": (dense, values[: int(missing.sum())], missing), "beyond": (dense, beyond, lengths),
                        "negative": (dense, negative, lengths)}}, tmp_path / "in.pt")
    done = subprocess.run([sys.executable, "-c", SERVER, str(path), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["imported"] is False
    out = torch.load(tmp_path / "out.pt")
    assert out.shape == (1000,) and (out - eager).abs().max() <= 1e-4
    assert said["missing"] == said["beyond"] == said["negative"] == "RuntimeError", said
    meta = said["meta"]
    assert meta["inputs"] == ["dense_features", "values", "lengths"] and meta["tables"] == "int8"
    assert [f["name"] for f in meta["sparse_features"]] == NAMES and meta["dense_features"] == 4


def test_an_existing_package_path_is_refused_unless_overwrite(package):
    model, path = package
    with pytest.raises(ValueError, match="exists: give a new path, or overwrite=True"):
        export_package(model, path)


def test_a_tower_is_asked_for_on_two_tower_models_only(tmp_path):
    with pytest.raises(ValueError, match="DLRMModule|DLRM has no towers"):
        export_package(DLRMModule(**TINY), tmp_path / "x.pt2", tower="user")
    with pytest.raises(ValueError, match="ends in .pt2"):
        export_package(DLRMModule(**TINY), tmp_path / "x.zip")


@pytest.mark.parametrize("score", ["dot", "cosine"])
def test_a_towers_serving_module_equals_the_towers_embeddings(score):
    # what each tower's package compiles (the compile itself: the DLRM's above)
    from lightning_rec.models import TwoTowerModule
    from lightning_rec.serving.package import serving_module

    torch.manual_seed(0)
    model = TwoTowerModule(user_num_embeddings={"user_id": 30, "age": 5}, item_num_embeddings={"item_id": 20},
                           embedding_dim=8, user_layer_sizes=[16, 8], item_layer_sizes=[8], id_skip=True,
                           score=score).eval()
    quant = quantize_inference_model(model, "int8").model
    for tower in ("user", "item"):
        module, meta = serving_module(model, "int8", tower=tower)
        values, lengths = example_inputs(meta, batch=50, seed=2)
        kjt = KeyedJaggedTensor.from_lengths_sync([f["name"] for f in meta["sparse_features"]], values, lengths)
        expected = getattr(quant, f"{tower}_embeddings")(kjt)
        with torch.no_grad():
            torch.testing.assert_close(module(values, lengths), expected, atol=1e-6, rtol=1e-6)
        assert meta["inputs"] == ["values", "lengths"] and meta["tower"] == tower
