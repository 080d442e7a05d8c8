"""The `.pt2` serving package: compiled once (AOTInductor on CPU takes a minute or two: the run's `ranker_package`,
tests/conftest.py, a multi-task ranker exported through the command line, one feature's raw ids read through a
managed-collision id map) and served in a process where lightning_rec cannot be imported: its outputs against the
eager model on 1,000 rows (raw ids the map holds and raw ids it does not), the requests it refuses, what its metadata
says. Every other network (a DLRM, weighted tables, each tower) is checked as torch.export traces it, the program
the compile takes, against the eager model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import RANKER_RAW_IDS

from lightning_rec.models import DLRMModule, MultiTaskModule
from lightning_rec.serving import quantize_inference_model
from lightning_rec.serving.package import example_inputs, export_package, export_program, serving_module
from lightning_rec.sparse import KeyedJaggedTensor

ROWS = 1000

# a fresh process: lightning_rec blocked at import, each package loaded with torch and fbgemm_gpu alone
SERVER = textwrap.dedent("""
    import importlib.abc, json, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "lightning_rec":
                raise ImportError("lightning_rec is blocked in this process")
    sys.meta_path.insert(0, Block())
    import torch, fbgemm_gpu  # noqa: F401
    said, outputs = [], []
    for job in torch.load(sys.argv[1]):
        package = torch._inductor.aoti_load_package(job["package"])
        out = {"meta": json.loads(package.get_metadata()["inputs"])}
        outputs.append(package(*job["good"]))
        for name, bad in job["bad"].items():
            try:
                package(*bad)
                out[name] = "served"
            except Exception as e:
                out[name] = type(e).__name__
        said.append(out)
    torch.save(outputs, sys.argv[2])
    print(json.dumps({"jobs": said, "imported": any(m.split(".")[0] == "lightning_rec" for m in sys.modules)}))
""")


def _kjt(meta: dict, inputs: tuple) -> tuple[torch.Tensor | None, KeyedJaggedTensor]:
    given = dict(zip(meta["inputs"], inputs))
    kjt = KeyedJaggedTensor.from_lengths_sync([f["name"] for f in meta["sparse_features"]], given["values"],
                                              given["lengths"], weights=given.get("weights"))
    return given.get("dense_features"), kjt


@pytest.fixture(scope="module")
def served(ranker_package, tmp_path_factory):
    """The package served in a fresh process: (eager output, package output, what the server said, whether it
    imported lightning_rec, which of feature a's raw ids the map holds)."""
    model, out = ranker_package
    tmp = tmp_path_factory.mktemp("served")
    meta = serving_module(model, "int8")[1]
    good = example_inputs(meta, batch=ROWS, seed=1, raw_ids={"a": RANKER_RAW_IDS})  # held and never seen, about half
    dense, kjt = _kjt(meta, good)
    with torch.no_grad():
        eager = quantize_inference_model(model, "int8")(dense, kjt)
    dense, values, lengths = good
    held = model.model.sparse_arch.embedding_bag_collection._managed_collision_collection.modules_by_table()["t_a"]
    hits = torch.isin(kjt["a"].values(), held.id_map()[0])
    missing = lengths[: (len(meta["sparse_features"]) - 1) * ROWS]  # the last feature left out
    beyond, negative, negative_raw = values.clone(), values.clone(), values.clone()
    beyond[-1] = meta["sparse_features"][-1]["rows"]  # c's last id: a row (c has no map)
    negative[-1] = -1
    negative_raw[0] = -1  # a's first id: a raw id
    bad = {"missing": (dense, values[: int(missing.sum())], missing), "beyond": (dense, beyond, lengths),
           "negative": (dense, negative, lengths), "negative_raw": (dense, negative_raw, lengths)}
    torch.save([{"package": str(out / "model.pt2"), "good": good, "bad": bad}], tmp / "in.pt")
    done = subprocess.run([sys.executable, "-c", SERVER, str(tmp / "in.pt"), str(tmp / "out.pt")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    return eager, torch.load(tmp / "out.pt")[0], said["jobs"][0], said["imported"], hits


def test_package_serves_every_task_in_a_process_without_lightning_rec(served):
    # one column per task (ESMM's purchase included), as the eager model gives them; feature a's raw ids (about
    # 2**40) read their rows through the package's id map, the ids it does not hold the unknown row
    eager, out, said, imported, hits = served
    assert imported is False
    assert 0.3 < hits.float().mean() < 0.7, hits.float().mean()  # both kinds, many of each
    assert out.shape == (ROWS, 3) and (out - eager).abs().max() <= 1e-4
    assert said["missing"] == said["beyond"] == said["negative"] == said["negative_raw"] == "RuntimeError", said
    meta = said["meta"]
    assert meta["inputs"] == ["dense_features", "values", "lengths"] and meta["tables"] == "int8"
    assert [f["name"] for f in meta["sparse_features"]] == ["a", "b", "c"] and meta["dense_features"] == 4
    assert [f["raw_ids"] for f in meta["sparse_features"]] == [True, False, False]
    assert meta["tasks"] == [{"name": "click", "type": "binary", "column": 0},
                             {"name": "buy", "type": "binary", "column": 1},
                             {"name": "rating", "type": "regression", "column": 2}]
    assert meta["weighted"] is False and meta["model"] == "MultiTaskNet" and "[B, 3]" in meta["output"]


def test_an_existing_package_path_is_refused_unless_overwrite(ranker_package):
    model, out = ranker_package
    with pytest.raises(ValueError, match="exists: give a new path, or overwrite=True"):
        export_package(model, out / "model.pt2")


def _weighted(module):
    """`module` with its tables weighted (each id's weight scales its row in the bag)."""
    from lightning_rec.embedding import EmbeddingBagCollection

    arch = module.model.sparse_arch
    arch.embedding_bag_collection = EmbeddingBagCollection(arch.embedding_bag_collection.embedding_bag_configs(),
                                                           is_weighted=True)
    return module


@pytest.mark.parametrize("kind", ["dlrm", "weighted_multitask"])
def test_a_rankers_program_equals_the_eager_model(kind):
    # what the compile takes, as torch.export traced it (the compile itself: the package above): a DLRM's logits,
    # and a ranker over weighted tables, whose per-id weights are the package's last input
    torch.manual_seed(0)
    if kind == "dlrm":
        model = DLRMModule(num_embeddings_per_feature=[40, 30], embedding_dim=8, sparse_feature_names=["s0", "s1"],
                           dense_in_features=4, dense_arch_layer_sizes=[8], over_arch_layer_sizes=[8, 1]).eval()
    else:
        model = _weighted(MultiTaskModule(task_names=["click", "rating"], task_types=["binary", "regression"],
                                          mix="mmoe", num_embeddings_per_feature={"a": 30, "b": 20}, embedding_dim=8,
                                          expert_layer_sizes=[8], tower_layer_sizes=[4]).eval())
    module, meta = serving_module(model, "int4")
    inputs = example_inputs(meta, batch=50, seed=2)
    dense, kjt = _kjt(meta, inputs)
    with torch.no_grad():
        eager = quantize_inference_model(model, "int4")(dense if dense is not None else torch.empty(50, 0), kjt)
        program = export_program(module, meta).module()
        torch.testing.assert_close(program(*inputs), eager, atol=1e-6, rtol=1e-6)
    if kind == "dlrm":
        assert meta["inputs"] == ["dense_features", "values", "lengths"] and meta["output"] == "logits float32 [B]"
    else:  # no dense inputs: none taken
        assert meta["inputs"] == ["values", "lengths", "weights"] and meta["weighted"] is True
        assert [t["name"] for t in meta["tasks"]] == ["click", "rating"] and eager.shape == (50, 2)
        unweighted = kjt.weights().clone().fill_(1.0)
        with torch.no_grad():  # the weights change the answer: they are read, not ignored
            assert not torch.allclose(program(*inputs[:2], unweighted), eager)


def test_a_tower_is_asked_for_on_two_tower_models_only(tmp_path):
    dlrm = DLRMModule(num_embeddings_per_feature=[10], embedding_dim=4, sparse_feature_names=["s0"],
                      dense_in_features=2, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[1])
    with pytest.raises(ValueError, match="DLRMModule|DLRM has no towers"):
        export_package(dlrm, tmp_path / "x.pt2", tower="user")
    with pytest.raises(ValueError, match="ends in .pt2"):
        export_package(dlrm, tmp_path / "x.zip")


@pytest.mark.parametrize("score", ["dot", "cosine"])
def test_a_towers_serving_module_equals_the_towers_embeddings(score):
    # what each tower's package compiles (the compile itself: the rankers' above), eager and as torch.export traces
    from lightning_rec.models import TwoTowerModule

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
            if tower == "user":
                traced = export_program(module, meta).module()
                torch.testing.assert_close(traced(values, lengths), expected, atol=1e-6, rtol=1e-6)
        assert meta["inputs"] == ["values", "lengths"] and meta["tower"] == tower
