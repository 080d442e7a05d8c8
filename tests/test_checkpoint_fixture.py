"""Checkpoints written by an earlier version still load: files committed under tests/fixtures/.

`tests/fixtures/tiny.ckpt/` (a DCP directory, `checkpoint.save` at one rank) and `tests/fixtures/tiny_gathered.ckpt`
(the one-file format, as `RecStrategy(checkpoint_format="gathered")` writes it) hold `_TinyModel` after two steps:
two fused row-wise Adagrad tables, one fused Adam table, a dense layer trained by torch.optim.Adagrad. The tests
load them into a fresh model and compare the exact values recorded when the files were written (`EXPECTED`).

Regenerate (only on purpose: the point is that these files stay as an earlier version wrote them):
`python tests/test_checkpoint_fixture.py` prints the new EXPECTED and rewrites both fixtures.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks

from lightning_rec import checkpoint as ckpt
from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.optim import FusedOptimizerConfig, combined_optimizer, merge_fused_state
from lightning_rec.sparse import KeyedJaggedTensor

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DCP_DIR = FIXTURES / "tiny.ckpt"
GATHERED_FILE = FIXTURES / "tiny_gathered.ckpt"
MODULE_CLASS = "test_checkpoint_fixture._TinyModel"


class _TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="t_a", num_embeddings=6, embedding_dim=4, feature_names=["a"]),
             EmbeddingBagConfig(name="t_b", num_embeddings=5, embedding_dim=4, feature_names=["b"])],
            optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.1))
        self.adam = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="t_c", num_embeddings=4, embedding_dim=4, feature_names=["c"])],
            optimizer=FusedOptimizerConfig("adam", lr=0.05))
        self.dense = torch.nn.Linear(12, 1)

    def forward(self, rowwise: KeyedJaggedTensor, adam: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(torch.cat([self.ebc(rowwise).values(), self.adam(adam).values()], dim=1))


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = _TinyModel()
    return model, combined_optimizer(model, torch.optim.Adagrad(model.dense.parameters(), lr=0.2))


def _batch(step: int) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    ids = {"a": [0, 1, 5, 2 + step], "b": [4, 0, step], "c": [1, 3, 2]}
    lengths = {"a": [2, 2], "b": [1, 2], "c": [2, 1]}

    def kjt(keys: str) -> KeyedJaggedTensor:
        values = torch.tensor([i for k in keys for i in ids[k]])
        return KeyedJaggedTensor.from_lengths_sync(keys=list(keys), values=values,
                                                   lengths=torch.tensor([n for k in keys for n in lengths[k]]))

    return kjt("ab"), kjt("c")


def _state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every value the checkpoint restores: weights, fused state (whole, by global name), dense optimizer state."""
    out = {f"w:{k}": v.detach().clone() for k, v in model.state_dict().items()}
    fused, dense = dict(optimizer.optimizers)["fused"], dict(optimizer.optimizers)["dense"]
    out.update({f"fused:{k}": v.clone() for k, v in merge_fused_state([fused.global_state_pieces()]).items()})
    for pid, st in dense.state_dict()["state"].items():
        out.update({f"dense:{pid}.{n}": torch.as_tensor(v).clone() for n, v in st.items()})
    return out


def _summary(state: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], float, list[float]]]:
    """(shape, float64 sum, the first three values) per entry: what EXPECTED pins."""
    return {k: (tuple(v.shape), float(v.double().sum()), [float(x) for x in v.flatten()[:3]])
            for k, v in sorted(state.items())}


def _write_fixtures() -> dict:
    model, optimizer = _model_and_optimizer()
    for step in range(2):
        model(*_batch(step)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    extra = {"epoch": 3, "global_step": 2}
    shutil.rmtree(DCP_DIR, ignore_errors=True)
    ckpt.save({"state_dict": model.state_dict(), **extra}, DCP_DIR, optimizers=[optimizer],
              loader_state={"batches": 2}, module_class=MODULE_CLASS, module=model)
    gathered = {"state_dict": ckpt.gathered_state_dict(model.state_dict()),
                "optimizer_states": [ckpt.gathered_optimizer_state(optimizer, module=model)], **extra,
                "lightning_rec": {"format": "gathered", "module_class": MODULE_CLASS, "rng_states": [None],
                                  "loader_states": [{"batches": 2}]}}
    ckpt.save_file(gathered, GATHERED_FILE)
    return _summary(_state(model, optimizer))


# written by the code at commit 522df6c (before lightning_rec/checkpoint.py became a package)
EXPECTED = {
    "dense:0.step": ((), 2.0, [2.0]),
    "dense:0.sum": ((1, 12), 5.55408660788089, [0.49785685539245605, 0.6179959774017334, 0.3446088135242462]),
    "dense:1.step": ((), 2.0, [2.0]),
    "dense:1.sum": ((1,), 8.0, [8.0]),
    "fused:adam.t_c.exp_avg": ((4, 4), 0.07297193389968015, [0.0, 0.0, 0.0]),
    "fused:adam.t_c.exp_avg_sq": ((4, 4), 0.0017546882318129065, [0.0, 0.0, 0.0]),
    "fused:adam.t_c.step": ((), 2.0, [2.0]),
    "fused:ebc.t_a.sum": ((6,), 0.19729547202587128, [0.04932386800646782, 0.04932386800646782, 0.016846146434545517]),
    "fused:ebc.t_b.sum": ((5,), 0.2354455590248108, [0.09658686816692352, 0.06554970145225525, 0.0]),
    "w:adam.embedding_bags.t_c.weight": ((4, 4), -0.11334303021430969,
                                         [-0.3612831234931946, -0.257764995098114, 0.315468966960907]),
    "w:dense.bias": ((1,), -0.2279691845178604, [-0.2279691845178604]),
    "w:dense.weight": ((1, 12), 1.39559768140316, [0.5301496982574463, -0.1166667640209198, 0.09753786772489548]),
    "w:ebc.embedding_bags.t_a.weight": ((6, 4), -1.2500705858692527,
                                        [-0.25255879759788513, 0.1673370599746704, -0.21731916069984436]),
    "w:ebc.embedding_bags.t_b.weight": ((5, 4), -2.5553214140236378,
                                        [-0.3673357367515564, 0.036055516451597214, 0.45323532819747925]),
}


def _check(state: dict[str, torch.Tensor]) -> None:
    got = _summary(state)
    assert got.keys() == EXPECTED.keys(), set(got) ^ set(EXPECTED)
    for key, (shape, total, first) in EXPECTED.items():
        assert got[key][0] == shape, key
        assert got[key][1] == pytest.approx(total, rel=1e-12, abs=1e-12), key
        assert got[key][2] == first, key


@pytest.mark.parametrize("path", [DCP_DIR, GATHERED_FILE], ids=["dcp", "gathered"])
def test_a_checkpoint_written_before_loads_with_its_exact_values(path):
    model, optimizer = _model_and_optimizer(seed=123)  # other weights than the saved ones
    assert ckpt.load_model(model, path) == ckpt.IncompatibleKeys([], [])
    ckpt.load_optimizer(optimizer, path, 0, module=model)
    _check(_state(model, optimizer))


@pytest.mark.parametrize("path", [DCP_DIR, GATHERED_FILE], ids=["dcp", "gathered"])
def test_a_checkpoint_written_before_reads_whole_with_its_metadata(path):
    whole = ckpt.full_state_dict(path)
    assert {f"w:{k}": v for k, v in whole.items()}.keys() == {k for k in EXPECTED if k.startswith("w:")}
    for k, v in whole.items():
        assert float(v.double().sum()) == pytest.approx(EXPECTED[f"w:{k}"][1], rel=1e-12, abs=1e-12), k
    meta = ckpt.read_lightning_state(path) if path.is_dir() else ckpt.load_file(path)
    assert (meta["epoch"], meta["global_step"]) == (3, 2)
    assert meta["lightning_rec"]["module_class"] == MODULE_CLASS
    assert ckpt.loader_state_for_rank(meta, 0, 1) == {"batches": 2}
    assert ckpt.lightning_checkpoint(path)["global_step"] == 2


def _sharded_load_worker(rank, W):
    from lightning_rec.model_parallel import (
        DistributedModelParallel,
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from lightning_rec.types import ShardingPlan

    model, _ = _model_and_optimizer(seed=123)
    plan = ShardingPlan({
        "ebc": construct_module_sharding_plan(model.ebc, {"t_a": row_wise(), "t_b": column_wise(ranks=[0, 1])},
                                              world_size=W, local_size=W),
        "adam": construct_module_sharding_plan(model.adam, {"t_c": table_wise(rank=1)}, world_size=W, local_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)
    optimizer = combined_optimizer(dmp, torch.optim.Adagrad(model.dense.parameters(), lr=0.2))
    ckpt.load_model(model, DCP_DIR)
    ckpt.load_optimizer(optimizer, DCP_DIR, 0, module=model)
    fused = dict(optimizer.optimizers)["fused"]
    pieces = {k: (s, [(m, t.clone()) for m, t in p]) for k, (s, p) in fused.global_state_pieces().items()}
    tables = {k: v for k, v in model.state_dict().items() if not torch.is_tensor(v)}
    return pieces, {k: [(m, t.clone()) for m, t in v.local_shards] for k, v in tables.items()}


def test_the_dcp_fixture_loads_into_a_model_sharded_over_two_ranks():
    """Row-wise, column-wise (two per-row states of one table, merged) and table-wise pieces of the old file."""
    from lightning_rec.sharding.sharded_tensor import ShardedTensor

    outs = run_ranks(_sharded_load_worker, 2, timeout=120)
    fused = merge_fused_state([pieces for pieces, _ in outs])
    for k, v in fused.items():
        shape, total, _ = EXPECTED[f"fused:{k}"]
        assert tuple(v.shape) == shape and float(v.double().sum()) == pytest.approx(total, rel=1e-6), k
    assert sorted(fused) == ["adam.t_c.exp_avg", "adam.t_c.exp_avg_sq", "adam.t_c.step", "ebc.t_a.sum", "ebc.t_b.sum"]
    assert sorted(outs[0][1]) == ["adam.embedding_bags.t_c.weight", "ebc.embedding_bags.t_a.weight",
                                  "ebc.embedding_bags.t_b.weight"]
    for key in outs[0][1]:
        shape = tuple(EXPECTED[f"w:{key}"][0])
        whole = ShardedTensor.merge([ShardedTensor(shape, shards[key]) for _, shards in outs]).full()
        assert float(whole.double().sum()) == pytest.approx(EXPECTED[f"w:{key}"][1], rel=1e-12, abs=1e-12), key


def test_the_dcp_fixture_keeps_its_layout_and_entry_names():
    assert sorted(p.name for p in DCP_DIR.iterdir()) == [".metadata", "__0_0.distcp", "lightning.pt"]
    import torch.distributed.checkpoint as dcp

    names = set(dcp.FileSystemReader(str(DCP_DIR)).read_metadata().state_dict_metadata)
    assert {"state_dict.ebc.embedding_bags.t_a.weight", "state_dict.dense.weight",
            "optimizer_states.0.fused.ebc.t_a.sum@per_row", "optimizer_states.0.fused.adam.t_c.exp_avg",
            "optimizer_states.0.fused.param_groups", "optimizer_states.0.rest"} <= names, sorted(names)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    FIXTURES.mkdir(exist_ok=True)
    import pprint

    pprint.pprint(_write_fixtures(), width=120)
