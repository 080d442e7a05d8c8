"""Sharded DCP checkpoints: save at one world size and plan, load at another, or unsharded; export.

Parity: after a load, every table, its fused optimizer state and the dense optimizer state,
assembled whole, equal what was saved (bitwise; per-row state of a table that was split by
columns is the width-weighted mean of its column shards, as `merge_fused_state` defines it,
which every new column split keeps). At the same plan each shard's own pieces are bitwise equal.
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import SHARED_DATA
from dist_utils import expect_error, run_ranks

from lightning_rec import checkpoint as ckpt
from lightning_rec.checkpoint import files as ckpt_files
from lightning_rec.checkpoint import optimizer_state
from lightning_rec.data.synthetic import SyntheticCriteoDataModule
from lightning_rec.model_parallel import (
    DistributedModelParallel,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_column_wise,
    table_wise,
)
from lightning_rec.models.dlrm_module import DLRMModule
from lightning_rec.optim import merge_fused_state
from lightning_rec.sharding.sharded_tensor import ShardedTensor
from lightning_rec.types import ShardingPlan

NAMES = ["a", "b", "c", "d"]
SMALL = dict(num_embeddings_per_feature=64, embedding_dim=8, sparse_feature_names=NAMES,
             dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1], sparse_lr=0.05, dense_lr=0.02)
EBC = "model.sparse_arch.embedding_bag_collection"


def _layout(kind: str, W: int) -> dict:
    if kind == "table_wise":
        return {f"t_{n}": table_wise(rank=i % W) for i, n in enumerate(NAMES)}
    if kind == "row_wise":
        return {f"t_{n}": row_wise() for n in NAMES}
    if kind == "columns":  # every way of splitting columns; t_b keeps two column blocks on rank W - 1
        return {"t_a": column_wise(ranks=[0, W - 1]),
                "t_b": column_wise(ranks=[W - 1, 0, W - 1], size_per_rank=[2, 4, 2]),
                "t_c": table_column_wise(host_index=0), "t_d": grid_shard(host_indexes=[0])}
    assert kind == "mixed"  # a column split (two per-row states per row), rows, a whole table, a replica
    return {"t_a": column_wise(ranks=[0, W - 1]), "t_b": row_wise(), "t_c": table_wise(rank=W - 1),
            "t_d": data_parallel()}


def _module(sparse_optimizer: str = "rowwise_adagrad") -> DLRMModule:
    torch.manual_seed(0)
    return DLRMModule(**SMALL, sparse_optimizer=sparse_optimizer)


def _shard(module, kind: str, W: int) -> DistributedModelParallel:
    ebc = module.get_submodule(EBC)
    plan = ShardingPlan({EBC: construct_module_sharding_plan(ebc, _layout(kind, W), world_size=W, local_size=W)})
    return DistributedModelParallel(module, plan=plan, device="cpu", timeout=30)


def _train(module, dmp, optimizer, rank: int, steps: int = 3, start: int = 0) -> None:
    data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=0, num_sparse_features=4,
                                     num_signal_features=2, sparse_feature_names=NAMES,
                                     num_embeddings_per_feature=64, seed=rank)
    split = data.make_split("train")
    for step in range(start, start + steps):
        batch = split.__getitems__(list(range(step * 16, step * 16 + 16)))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            dmp(batch.dense_features, batch.sparse_features), batch.labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _all(obj):
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _full_state(module, optimizer) -> dict:
    """Every table, fused state and dense optimizer state, whole (collective)."""
    local = module.state_dict()
    sharded = {k: ShardedTensor(v.global_shape, [(m, t.clone()) for m, t in v.local_shards])
               for k, v in local.items() if isinstance(v, ShardedTensor)}
    parts = _all(sharded)
    out = {k: v.clone() for k, v in local.items() if not isinstance(v, ShardedTensor)}
    for k in sharded:
        out[k] = ShardedTensor.merge([p[k] for p in parts]).full()
    fused = dict(optimizer.optimizers)["fused"]
    pieces = {k: (s, [(m, t.clone()) for m, t in p]) for k, (s, p) in fused.global_state_pieces().items()}
    out.update({f"fused:{k}": v for k, v in merge_fused_state(_all(pieces)).items()})
    dense = dict(optimizer.optimizers)["dense"].state_dict()
    for pid, st in dense["state"].items():
        for name, v in st.items():
            out[f"dense:{pid}.{name}"] = v.clone() if torch.is_tensor(v) else torch.tensor(v)
    out["lr:fused"] = torch.tensor([g["lr"] for g in fused.param_groups[:1]])
    return out


def _save_worker(rank, W, path, kind, sparse_optimizer="rowwise_adagrad"):
    module = _module(sparse_optimizer)
    dmp = _shard(module, kind, W)
    optimizer = module.configure_optimizers()
    _train(module, dmp, optimizer, rank)
    ckpt.save({"state_dict": module.state_dict(), "epoch": 1}, path, optimizers=[optimizer], loader_state={"r": rank})
    return _full_state(module, optimizer)


def _load_worker(rank, W, path, kind, sparse_optimizer="rowwise_adagrad", train_after=False):
    module = _module(sparse_optimizer)
    torch.manual_seed(100 + rank)  # other weights than the saved ones, so that a missed piece shows
    dmp = _shard(module, kind, W)
    optimizer = module.configure_optimizers()
    ckpt.load_model(module, path)
    ckpt.load_optimizer(optimizer, path, 0)
    state = _full_state(module, optimizer)
    if train_after:
        _train(module, dmp, optimizer, rank, steps=1)  # the loaded fused state drives the next update
    return state


def _same(a: dict, b: dict, per_row_tol: bool = False) -> None:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for k in a:
        if per_row_tol and k.startswith("fused:"):
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=0)  # a width-weighted mean, rounded once
        else:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(("save", "load"), [
    ((2, "row_wise"), (1, "row_wise")), ((1, "table_wise"), (2, "row_wise")), ((2, "mixed"), (3, "row_wise")),
    ((2, "table_wise"), (4, "mixed")), ((2, "row_wise"), (2, "table_wise")), ((2, "columns"), (1, "mixed")),
    ((2, "columns"), (3, "row_wise")),
])
def test_dcp_reshards_to_any_world_size_and_plan(tmp_path, save, load):
    path = str(tmp_path / "c.ckpt")
    saved = run_ranks(_save_worker, save[0], path, save[1], timeout=120)[0]
    # each rank wrote its own file; nothing partial is left
    assert sorted(p.name for p in Path(path).iterdir() if p.suffix == ".distcp") == [
        f"__{r}_0.distcp" for r in range(save[0])]
    assert not list(tmp_path.glob(".*partial*"))
    loaded = run_ranks(_load_worker, load[0], path, load[1], timeout=120)
    for state in loaded:
        _same(saved, state, per_row_tol=save[1] in ("mixed", "columns"))


def _own_state(module, optimizer) -> dict:
    """This rank's own pieces: table shards, fused state per shard, dense layers and their optimizer state."""
    out = {}
    for k, v in module.state_dict().items():
        for m, t in (v.local_shards if isinstance(v, ShardedTensor) else [(None, v)]):
            out[f"{k}@{None if m is None else (m.shard_offsets, m.shard_sizes)}"] = t.clone()
    for k, (_, parts) in dict(optimizer.optimizers)["fused"].global_state_pieces().items():
        for m, t in parts:
            out[f"fused:{k}@{None if m is None else (m.shard_offsets, m.shard_sizes)}"] = t.clone()
    for pid, st in dict(optimizer.optimizers)["dense"].state_dict()["state"].items():
        out.update({f"dense:{pid}.{n}": v.clone() if torch.is_tensor(v) else torch.tensor(v) for n, v in st.items()})
    return out


def _resume_worker(rank, W, path, kind, sparse_optimizer, checkpoint_format="dcp"):
    module = _module(sparse_optimizer)
    dmp = _shard(module, kind, W)
    optimizer = module.configure_optimizers()
    _train(module, dmp, optimizer, rank)
    if checkpoint_format == "dcp":
        ckpt.save({"state_dict": module.state_dict()}, path, optimizers=[optimizer])
    else:  # as RecStrategy(checkpoint_format="gathered") writes it
        whole = {"state_dict": ckpt.gathered_state_dict(module.state_dict(), dmp),
                 "optimizer_states": [ckpt.gathered_optimizer_state(optimizer, dmp, module)]}
        if rank == 0:
            ckpt.save_file(whole, path)
        dist.barrier()
    _train(module, dmp, optimizer, rank, steps=1, start=3)
    uninterrupted = _own_state(module, optimizer)
    module = _module(sparse_optimizer)
    torch.manual_seed(100 + rank)
    dmp = _shard(module, kind, W)
    optimizer = module.configure_optimizers()
    ckpt.load_model(module, path)
    ckpt.load_optimizer(optimizer, path, module=module)
    _train(module, dmp, optimizer, rank, steps=1, start=3)
    resumed = _own_state(module, optimizer)
    assert uninterrupted.keys() == resumed.keys()
    return [k for k in uninterrupted if not torch.equal(uninterrupted[k], resumed[k])]


@pytest.mark.parametrize(("kind", "sparse_optimizer", "checkpoint_format"), [
    *[("columns", o, "dcp") for o in ["rowwise_adagrad", "partial_rowwise_adam", "adagrad", "adam", "sgd"]],  # (CPU's)
    *[("mixed", o, "dcp") for o in ["rowwise_adagrad", "adagrad", "sgd"]],  # (a replica takes these three)
    # the one-file format: per-element state is whole tables there (exact); per-row state is what it must keep
    ("columns", "rowwise_adagrad", "gathered"), ("columns", "partial_rowwise_adam", "gathered"),
    ("mixed", "rowwise_adagrad", "gathered"),
])
def test_a_resume_at_the_same_plan_is_bitwise_for_every_sharding_and_optimizer(tmp_path, kind, sparse_optimizer,
                                                                             checkpoint_format):
    """Each column shard of a table keeps its own row-wise state (the mean of g^2 over its own columns). Loading gave
    every column shard the width-weighted mean of all of them: one more step then moved that table's weights by up to
    1.4e-2 away from the uninterrupted run's. Each shard gets its own state back, in either format (the one-file
    format keeps each column shard's per-row state beside the whole-table mean that other layouts read)."""
    differ = run_ranks(_resume_worker, 2, str(tmp_path / "c.ckpt"), kind, sparse_optimizer, checkpoint_format,
                       timeout=120)
    assert differ == [[], []]


def test_per_row_state_under_another_column_split_keeps_its_meaning():
    """Saved column shards [0, 2), [2, 6), [6, 8) of an 8-column table, each with its row-wise state (a mean over its
    columns): a live shard inside one gets that one's, bitwise; one over several gets the mean over its columns."""
    from lightning_rec.optim import column_overlaps, per_row_of_blocks

    blocks = [torch.tensor([1.0, 10.0]), torch.tensor([2.0, 20.0]), torch.tensor([4.0, 40.0])]
    for (c, nc), want in [((2, 4), blocks[1]), ((3, 2), blocks[1]), ((6, 2), blocks[2]),
                          ((0, 4), (2 * blocks[0] + 2 * blocks[1]) / 4),
                          ((0, 8), (2 * blocks[0] + 4 * blocks[1] + 2 * blocks[2]) / 8)]:
        got = per_row_of_blocks(blocks, column_overlaps([0, 2, 6], 8, c, nc))
        assert torch.equal(got, want), (c, nc, got, want)


def test_dcp_loads_into_the_unsharded_module_without_distributed(tmp_path):
    path = str(tmp_path / "c.ckpt")
    saved = run_ranks(_save_worker, 2, path, "mixed", timeout=120)[0]
    assert not dist.is_initialized()
    module = _module()
    optimizer = module.configure_optimizers()
    ckpt.load_model(module, path)
    ckpt.load_optimizer(optimizer, path, 0)
    _same(saved, _full_state(module, optimizer), per_row_tol=True)


def test_a_resume_with_another_sparse_weight_decay_keeps_the_tables_own(tmp_path):
    """The fused groups show the kernels' weight_decay (a write is refused at step); a checkpoint's groups must not
    write theirs back, or a resume built with another sparse_weight_decay stopped at its first step."""
    path = str(tmp_path / "c.ckpt")
    module = _module()
    optimizer = module.configure_optimizers()
    optimizer.step()
    ckpt.save({"state_dict": module.state_dict(), "epoch": 1}, path, optimizers=[optimizer])
    torch.manual_seed(0)
    resumed = DLRMModule(**SMALL, sparse_weight_decay=0.01)
    optimizer = resumed.configure_optimizers()
    ckpt.load_optimizer(optimizer, path, 0)
    fused = dict(optimizer.optimizers)["fused"]
    assert fused.param_groups[0]["weight_decay"] == 0.01
    optimizer.step()


def _hand_loop_save_worker(rank, W, path):
    from lightning_rec.optim import combined_optimizer, dense_parameters

    module = _module()
    dmp = _shard(module, "row_wise", W)
    optimizer = combined_optimizer(dmp, torch.optim.SGD(dense_parameters(dmp), lr=0.02))  # the README's loop
    _train(module, dmp, optimizer, rank)
    ckpt.save({"state_dict": dmp.state_dict()}, path, optimizers=[optimizer])
    return _full_state(module, optimizer)


def test_hand_written_loop_optimizer_of_the_dmp_loads_into_the_unsharded_model(tmp_path):
    """combined_optimizer(dmp, ...) saved its fused state under '_dmp_wrapped_module.module.<path>' (the wrappers'
    names), so load_optimizer into the unsharded model (or any model without DDP around it) found no entry."""
    from lightning_rec.optim import combined_optimizer, dense_parameters

    path = str(tmp_path / "c.ckpt")
    saved = run_ranks(_hand_loop_save_worker, 2, path, timeout=120)[0]
    module = _module()
    optimizer = combined_optimizer(module, torch.optim.SGD(dense_parameters(module), lr=0.02))
    ckpt.load_model(module, path)
    ckpt.load_optimizer(optimizer, path, module=module)
    _same(saved, _full_state(module, optimizer))
    # its export names no class, and says why: this save was given no module_class (not "plain Lightning")
    with pytest.warns(UserWarning, match=r"or by checkpoint.save\(...\) without module_class="):
        ckpt.export(path, tmp_path / "out")


def _torchrec_optimizer_worker(rank, W, path):
    from lightning_rec import CombinedOptimizer, KeyedOptimizerWrapper, in_backward_optimizer_filter

    module = _module()
    dmp = _shard(module, "row_wise", W)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.Adagrad(params, lr=0.02))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])  # TorchRec's way
    _train(module, dmp, optimizer, rank)
    ckpt.save({"state_dict": dmp.state_dict()}, path, optimizers=[optimizer])
    return {f"{pid}.{n}": v.clone() for pid, st in dense.state_dict()["state"].items() for n, v in st.items()}


def test_torchrec_style_combined_optimizer_loads_into_combined_optimizer(tmp_path):
    """CombinedOptimizer([dmp.fused_optimizer, KeyedOptimizerWrapper(...)]) names its dense part
    '1_keyedoptimizerwrapper'; the LightningModule's combined_optimizer calls it 'dense': 'no state for optimizer
    part 'dense''. One dense part on each side now loads whatever it is called."""
    from lightning_rec.optim import combined_optimizer, dense_parameters

    path = str(tmp_path / "c.ckpt")
    saved = run_ranks(_torchrec_optimizer_worker, 2, path, timeout=120)[0]
    module = _module()
    # the tables' paths from the module the DistributedModelParallel wrapped (configure_optimizers' are from .model)
    optimizer = combined_optimizer(module, torch.optim.Adagrad(dense_parameters(module), lr=0.02))
    ckpt.load_model(module, path)
    ckpt.load_optimizer(optimizer, path, module=module)
    dense = dict(optimizer.optimizers)["dense"].state_dict()["state"]
    loaded = {f"{pid}.{n}": v for pid, st in dense.items() for n, v in st.items()}
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_fused_state_saved_under_the_wrappers_names_still_loads(tmp_path, monkeypatch):
    """Checkpoints written before the fix above (fused state and learning rates under '_dmp_wrapped_module...')."""
    from lightning_rec.optim import combined_optimizer, dense_parameters, fused_paths

    path = str(tmp_path / "old.ckpt")
    module = _module()
    wrapper = torch.nn.Module()
    wrapper._dmp_wrapped_module = module  # a DistributedModelParallel(dense=None)'s layout
    with monkeypatch.context() as m:
        m.setattr(fused_paths, "is_wrapper_child", lambda parent, name: False)  # the old naming
        optimizer = combined_optimizer(wrapper, torch.optim.SGD(dense_parameters(module), lr=0.02))
    _train(module, module, optimizer, 0, steps=2)
    optimizer.param_groups[0]["lr"] = 0.125  # the fused rate a scheduler left
    ckpt.save({"state_dict": module.state_dict()}, path, optimizers=[optimizer])
    assert any("_dmp_wrapped_module" in k for k in ckpt._read_metadata(Path(path))[1].state_dict_metadata)
    saved = {k.replace("_dmp_wrapped_module.", ""): v for k, v in _full_state(module, optimizer).items()}
    fresh = _module()
    again = combined_optimizer(fresh, torch.optim.SGD(dense_parameters(fresh), lr=0.02))
    ckpt.load_model(fresh, path)
    ckpt.load_optimizer(again, path, module=fresh)
    _same(saved, _full_state(fresh, again))
    assert again.param_groups[0]["lr"] == 0.125


def test_dcp_per_element_state_adagrad(tmp_path):
    path = str(tmp_path / "c.ckpt")
    saved = run_ranks(_save_worker, 2, path, "mixed", "adagrad", timeout=120)[0]
    loaded = run_ranks(_load_worker, 3, path, "row_wise", "adagrad", timeout=120)
    _same(saved, loaded[0])


def test_export_loads_in_a_plain_process(tmp_path):
    path = str(tmp_path / "c.ckpt")
    saved = run_ranks(_save_worker, 2, path, "row_wise", timeout=120)[0]
    # the module class and its arguments come from the checkpoint's Lightning part
    meta = torch.load(Path(path) / ckpt.LIGHTNING_FILE, weights_only=False)
    meta["hyper_parameters"] = dict(_module().hparams)
    meta["lightning_rec"]["module_class"] = "lightning_rec.models.dlrm_module.DLRMModule"
    torch.save(meta, Path(path) / ckpt.LIGHTNING_FILE)
    out = ckpt.export(path, tmp_path / "export")
    module = ckpt.load_exported(out)
    assert isinstance(module, DLRMModule) and not module.training
    for k, v in module.state_dict().items():
        if k in saved:
            assert torch.equal(v, saved[k]), k
    half = ckpt.export(path, tmp_path / "export16", fp16_tables=True)
    assert (half / "model.safetensors").stat().st_size < 0.75 * (out / "model.safetensors").stat().st_size
    m16 = ckpt.load_exported(half)
    table = f"{EBC}.embedding_bags.t_a.weight"
    torch.testing.assert_close(m16.state_dict()[table], saved[table], atol=1e-3, rtol=1e-3)  # fp16 rounding


# bad input -----------------------------------------------------------------------------------------


def _other_dims_worker(rank, W, path):
    module = DLRMModule(**{**SMALL, "num_embeddings_per_feature": [64, 64, 32, 64]})
    _shard(module, "row_wise", W)
    expect_error(ValueError, lambda: ckpt.load_model(module, path), "t_c", "(64, 8)", "(32, 8)")
    torch.manual_seed(0)
    other = DLRMModule(**{**SMALL, "sparse_feature_names": ["a", "b", "c", "e"]})  # table t_e instead of t_d
    ebc = other.get_submodule(EBC)
    DistributedModelParallel(other, plan=ShardingPlan({EBC: construct_module_sharding_plan(
        ebc, {f"t_{n}": row_wise() for n in "abce"}, world_size=W, local_size=W)}), device="cpu", timeout=30)
    return expect_error(ValueError, lambda: ckpt.load_model(other, path), "t_e", "t_d", "not in the checkpoint")


def test_checkpoint_of_other_tables_names_them(tmp_path):
    path = str(tmp_path / "c.ckpt")
    run_ranks(_save_worker, 2, path, "row_wise", timeout=120)
    run_ranks(_other_dims_worker, 2, path, timeout=120)


@pytest.mark.parametrize("other_optimizer, ours", [("adam", "['exp_avg', 'exp_avg_sq', 'step']"),
                                                    ("adagrad", "['sum']"), ("sgd", "none")])
def test_fused_state_of_another_sparse_optimizer_is_named_as_such(tmp_path, other_optimizer, ours):
    # adam: it listed the missing 'exp_avg' entries and told to rebuild "the same tables and dims", or pass
    # strict=False; adagrad (per-element 'sum'): "not in the checkpoint: ...sum"; sgd (no state): loaded, silently
    path = str(tmp_path / "c.ckpt")
    module = _module("rowwise_adagrad")
    ckpt.save({"state_dict": module.state_dict()}, path, optimizers=[module.configure_optimizers()])
    other = _module(other_optimizer)
    expect_error(ValueError, lambda: ckpt.load_optimizer(other.configure_optimizers(), path),
                 "another sparse (fused) optimizer", "['sum (per row)']", f"train with {other_optimizer}, whose "
                 f"state is {ours}", "sparse_optimizer=", "load_model")
    ckpt.load_model(other, path)  # its weights still load


def test_checkpoint_of_another_model_class_names_the_class_that_wrote_it(tmp_path):
    from lightning_rec.models import TwoTowerModule

    path = str(tmp_path / "c.ckpt")
    ckpt.save({"state_dict": _module().state_dict()}, path, module_class="lightning_rec.models.dlrm_module.DLRMModule")
    other = TwoTowerModule(user_num_embeddings={"a": 64}, item_num_embeddings={"b": 64}, embedding_dim=8)
    expect_error(ValueError, lambda: ckpt.load_model(other, path), "written by lightning_rec.models.dlrm_module"
                 ".DLRMModule", "TwoTowerModule", "not in the checkpoint")
    smaller = DLRMModule(**{**SMALL, "num_embeddings_per_feature": 32})
    text = expect_error(ValueError, lambda: ckpt.load_model(smaller, path), "shapes differ")
    assert "written by" not in text  # its own class: only the shapes


def _plain_dcp_worker(rank, W, path):
    import torch.distributed.checkpoint as dcp

    module = _module()
    dmp = _shard(module, "row_wise", W)
    try:  # DCP's default planner pickled each table once and kept one rank's rows, silently
        dcp.save(dmp.state_dict(), checkpoint_id=path)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        text = str(e)
    else:
        raise AssertionError("dcp.save of a sharded state dict wrote a checkpoint")
    assert "lightning_rec.checkpoint.save" in text and "t_a.weight" in text, text
    ckpt.save({"state_dict": dmp.state_dict()}, path)  # the way that keeps every rank's rows
    return _full_state_of(dmp)


def _full_state_of(dmp) -> dict:
    return {k: ShardedTensor.merge(_all(ShardedTensor(v.global_shape, [(m, t.clone()) for m, t in v.local_shards])))
            .full() if isinstance(v, ShardedTensor) else v for k, v in dmp.state_dict().items()}


def test_plain_dcp_save_of_a_sharded_model_refuses_and_names_ours(tmp_path):
    path = str(tmp_path / "c.ckpt")
    saved = run_ranks(_plain_dcp_worker, 2, path, timeout=120)[0]
    loaded = ckpt.full_state_dict(path)
    assert saved.keys() == loaded.keys()
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k


def test_missing_rank_file_and_truncated_files_are_named(tmp_path):
    path = tmp_path / "c.ckpt"
    run_ranks(_save_worker, 2, str(path), "row_wise", timeout=120)
    module = _module()
    broken = tmp_path / "broken.ckpt"
    shutil.copytree(path, broken)
    (broken / "__1_0.distcp").unlink()
    before = sorted(p.name for p in broken.iterdir())
    expect_error(ValueError, lambda: ckpt.load_model(module, broken), "__1_0.distcp", "missing")
    assert sorted(p.name for p in broken.iterdir()) == before  # nothing overwritten or removed
    shutil.rmtree(broken)
    shutil.copytree(path, broken)
    with open(broken / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    expect_error(ValueError, lambda: ckpt.load_model(module, broken), "__0_0.distcp", "incomplete")
    # an interrupted save: no metadata / no lightning.pt
    (broken / ckpt.LIGHTNING_FILE).unlink()
    expect_error(ValueError, lambda: ckpt.read_lightning_state(broken), "incomplete", "ckpt_path='last'")


@pytest.mark.parametrize("write", [torch.save, ckpt.save_file])  # save_file: no CRC32, still named
def test_truncated_gathered_file_is_named(tmp_path, write):
    f = tmp_path / "old.ckpt"
    write({"state_dict": {"w": torch.randn(1000)}}, f)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    expect_error(ValueError, lambda: ckpt.load_file(f), str(f), "incomplete")
    # no file at all is not a damaged one (it said "(0 bytes) is incomplete or damaged ... interrupted save")
    missing = tmp_path / "nope.ckpt"
    expect_error(ValueError, lambda: ckpt.load_file(missing), f"checkpoint {missing} does not exist: check the path")


@pytest.mark.parametrize("reader", ["cli", "load_from_checkpoint", "trainer"])
def test_a_one_file_checkpoint_cut_short_is_named_by_lightnings_readers_too(tmp_path, reader):
    # Lightning's own readers (the CLI's hyperparameters, load_from_checkpoint, another strategy's Trainer) said
    # "OSError: [Errno 22] Invalid argument" (or a miniz error) for a file cut short: each now says it as load_file does
    import lightning as L

    from lightning_rec.cli import run_cli

    f = tmp_path / "cut.ckpt"
    module = _module()
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "pytorch-lightning_version": L.__version__}, f)
    f.write_bytes(f.read_bytes()[: f.stat().st_size - 100])
    data = SyntheticCriteoDataModule(num_train_samples=64, num_val_samples=32, num_sparse_features=4,
                                     num_signal_features=2, sparse_feature_names=NAMES, num_embeddings_per_feature=64)
    call = {"cli": lambda: run_cli(["validate", "--config", "recipes/configs/dlrm_synthetic.yaml", f"--ckpt_path={f}",
                                    f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false"]),
            "load_from_checkpoint": lambda: DLRMModule.load_from_checkpoint(f),
            "trainer": lambda: L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False).validate(
                DLRMModule(**SMALL), data, ckpt_path=f, verbose=False)}[reader]
    expect_error(ValueError, call, str(f), "incomplete", "copy it again")


def test_an_export_cut_short_names_the_file_and_to_export_again(tmp_path):
    # config.json cut short said json's "Expecting ',' delimiter: line 3 column 5", model.safetensors safetensors'
    # "Error while deserializing header: incomplete metadata, file not fully covered": neither named the file
    f, out = tmp_path / "one.ckpt", tmp_path / "export"
    ckpt.save_file({"state_dict": _module().state_dict(), "hyper_parameters": dict(SMALL)}, f)
    with pytest.warns(UserWarning, match="names no class"):
        ckpt.export(f, out)
    for name in ("config.json", "model.safetensors"):
        whole = (out / name).read_bytes()
        (out / name).write_bytes(whole[: len(whole) // 2])
        expect_error(ValueError, lambda: ckpt.load_exported(out, module=_module()), str(out / name), "incomplete",
                     "Copy the export again", "export again", "lightning-rec export", f"{out}")
        (out / name).write_bytes(whole)
    ckpt.load_exported(out, module=_module())


# the gathered format (one file written by rank 0): one table in flight at a time --------------------

BIG_ROWS = 4096  # 128 KB per table (dim 8, fp32): a gather holding two tables shows above the bound


def _tree_equal(a, b, where: str = "") -> None:
    """Same keys, same types, bitwise-equal tensors (dtype, shape, values), recursively."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), (where, set(a) ^ set(b))
        for k in a:
            _tree_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _tree_equal(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, where


def _gathered_before(module, optimizer) -> dict | None:
    """The gathered checkpoint as the previous version built it: every rank's whole dicts to rank 0 in one go."""
    local = module.state_dict()
    sharded = {k: ShardedTensor(v.global_shape, [(m, t.clone()) for m, t in v.local_shards])
               for k, v in local.items() if isinstance(v, ShardedTensor)}
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(sharded, parts, dst=0)
    fused = dict(optimizer.optimizers)["fused"]
    pieces = {k: (s, [(m, t.clone()) for m, t in p]) for k, (s, p) in fused.global_state_pieces().items()}
    opt_parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(pieces, opt_parts, dst=0)
    if parts is None:
        return None
    state = {k: ShardedTensor.merge([p[k] for p in parts]).full() if k in sharded else v for k, v in local.items()}
    opt = optimizer.state_dict()
    # (each column shard's own per-row state too, since it resumes exactly)
    opt = {**opt, "fused": {**opt["fused"], "state": merge_fused_state(opt_parts, column_blocks=True)}}
    return {"state_dict": state, "optimizer_states": [opt], "epoch": 1}


def _gathered_worker(rank, W, out, kind):
    import pickle

    torch.manual_seed(0)
    module = DLRMModule(**{**SMALL, "num_embeddings_per_feature": BIG_ROWS})
    dmp = _shard(module, kind, W)
    optimizer = module.configure_optimizers()
    _train(module, dmp, optimizer, rank)
    payloads = []
    gather = dmp.gather_object

    def recording(obj, dst=0):
        payloads.append(len(pickle.dumps(obj)))
        return gather(obj, dst)

    dmp.gather_object = recording
    state = ckpt.gathered_state_dict(module.state_dict(), dmp)
    opt = ckpt.gathered_optimizer_state(optimizer, dmp)
    dmp.gather_object = gather
    before = _gathered_before(module, optimizer)
    if rank == 0:
        ckpt.save_file({"state_dict": state, "optimizer_states": [opt], "epoch": 1}, os.path.join(out, "new.ckpt"))
        torch.save(before, os.path.join(out, "before.ckpt"))
    dist.barrier()
    return max(payloads)


@pytest.mark.parametrize("kind", ["table_wise", "mixed"])
def test_gathered_file_equals_before_and_gathers_one_table_at_a_time(tmp_path, kind):
    largest = run_ranks(_gathered_worker, 2, str(tmp_path), kind, timeout=120)
    new, before = ckpt.load_file(tmp_path / "new.ckpt"), ckpt.load_file(tmp_path / "before.ckpt")
    _tree_equal(new, before)
    assert not list(tmp_path.glob(".*partial*"))
    # rank 0's extra memory is the model once plus one table in flight: no gather carries two tables
    table_bytes = BIG_ROWS * SMALL["embedding_dim"] * 4
    assert max(largest) < table_bytes + 16 * 1024, (largest, table_bytes)
    # the file reloads into the unsharded module (the gathered format's promise)
    module = DLRMModule(**{**SMALL, "num_embeddings_per_feature": BIG_ROWS})
    module.load_state_dict(new["state_dict"])


def _mapped_from(t: torch.Tensor) -> str | None:
    """The file whose mapping holds the tensor's memory (Linux), or None."""
    ptr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5] if len(fields) > 5 else None
    return None


def test_gathered_file_is_mapped_and_legacy_files_still_load(tmp_path):
    state = {"state_dict": {"w": torch.randn(64, 8), "n": torch.arange(5)}, "epoch": 3}
    ckpt.save_file(state, tmp_path / "a.ckpt")
    loaded = ckpt.load_file(tmp_path / "a.ckpt")
    _tree_equal(loaded, state)
    if os.path.exists("/proc/self/maps"):  # mapped from the file, not read whole into memory
        assert _mapped_from(loaded["state_dict"]["w"]) == str(tmp_path / "a.ckpt")
    torch.save(state, tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)  # torch < 1.6's format
    _tree_equal(ckpt.load_file(tmp_path / "legacy.ckpt"), state)


def _custom_io_worker(rank, W, root):
    import lightning.pytorch as L
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from lightning_rec.strategy import RecStrategy

    calls = []

    class RecordingIO(TorchCheckpointIO):  # a user's plugin (remote storage, say): it must still be used
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            calls.append(os.path.basename(path))
            super().save_checkpoint(checkpoint, path, storage_options)

    data = SyntheticCriteoDataModule(num_train_samples=128, num_val_samples=0, batch_size=64, num_sparse_features=4,
                                     num_signal_features=2, sparse_feature_names=NAMES, num_embeddings_per_feature=64)
    trainer = L.Trainer(strategy=RecStrategy(checkpoint_format="gathered"), plugins=[RecordingIO()], accelerator="cpu",
                        devices=W, max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(DLRMModule(**SMALL), data)
    trainer.save_checkpoint(os.path.join(root, "custom.ckpt"))
    return calls


def test_gathered_format_keeps_a_custom_checkpoint_io(tmp_path):
    assert run_ranks(_custom_io_worker, 1, str(tmp_path), timeout=120)[0] == ["custom.ckpt"]
    assert "state_dict" in ckpt.load_file(tmp_path / "custom.ckpt")


def _disk_full_worker(rank, W, path):
    module = _module()
    dmp = _shard(module, "row_wise", W)
    optimizer = module.configure_optimizers()
    _train(module, dmp, optimizer, rank, steps=1)
    import torch.distributed.checkpoint.filesystem as fs

    real = fs._write_item

    def full(*args, **kwargs):  # the disk fills while rank 1 writes its tables
        if rank == 1:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    fs._write_item = full
    try:
        ckpt.save({"state_dict": module.state_dict()}, path, optimizers=[optimizer])
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return f"{type(e).__name__}: {e}"
    finally:
        fs._write_item = real
    return "saved"


def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "last.ckpt")
    saved = run_ranks(_save_worker, 2, path, "row_wise", timeout=120)[0]
    errors = run_ranks(_disk_full_worker, 2, path, timeout=120)
    assert all(e != "saved" for e in errors), errors
    assert not list(tmp_path.glob(".*partial*"))  # the unfinished save is removed
    loaded = run_ranks(_load_worker, 2, path, "row_wise", timeout=120)
    _same(saved, loaded[0])  # the previous checkpoint is whole and still loads


def test_swapped_or_wrong_arguments_name_the_signature(tmp_path):
    """A model, an optimizer and a path swapped used to fail deep inside ('object is not subscriptable') or be
    written as something else (a model in `optimizers` was saved as an optimizer, a path as `module` ignored)."""
    module = _module()
    optimizer = module.configure_optimizers()
    path = tmp_path / "c.ckpt"
    ckpt.save({"state_dict": module.state_dict()}, path, optimizers=[optimizer])
    other = tmp_path / "other.ckpt"
    ck = {"state_dict": module.state_dict()}
    calls = [
        (TypeError, lambda: ckpt.save(module, other),
         ["checkpoint", "got a model (DLRMModule)", "Call it as lightning_rec.checkpoint.save({'state_dict'"]),
        (ValueError, lambda: ckpt.save(module.state_dict(), other), ["no 'state_dict' entry", "{'state_dict'"]),
        (TypeError, lambda: ckpt.save(other, ck), ["checkpoint", "got a path"]),
        (TypeError, lambda: ckpt.save(ck, optimizer), ["path must be", "got an optimizer"]),
        (TypeError, lambda: ckpt.save(ck, other, optimizer), ["optimizers=[optimizer]", "got an optimizer"]),
        (TypeError, lambda: ckpt.save(ck, other, [module]), ["optimizers[0]", "got a model"]),
        (TypeError, lambda: ckpt.save(ck, other, [optimizer], module=optimizer), ["module must", "got an optimizer"]),
        (TypeError, lambda: ckpt.save(ck, other, [optimizer], module=str(path)), ["module must", "got a path"]),
        (TypeError, lambda: ckpt.load_model(path, module), ["load_model", "got a path", "load_model(model, path)"]),
        (TypeError, lambda: ckpt.load_model(optimizer, path), ["load_model", "got an optimizer"]),
        (TypeError, lambda: ckpt.load_optimizer(path, optimizer),
         ["load_optimizer", "got a path", "load_optimizer(optimizer, path, index=0"]),
        (TypeError, lambda: ckpt.load_optimizer(module, path), ["optimizer must", "got a model"]),
        (TypeError, lambda: ckpt.load_optimizer([optimizer, optimizer], path), ["one optimizer", "index=i"]),
        (TypeError, lambda: ckpt.load_optimizer(optimizer, path, module), ["index must", "got a model"]),
        (TypeError, lambda: ckpt.load_optimizer(optimizer, path, module=str(path)), ["module must", "got a path"]),
    ]
    for exc, call, words in calls:
        expect_error(exc, call, *words)
    assert not other.exists() and not list(tmp_path.glob(".other*"))  # refused before anything was written


def test_a_torch_save_file_is_named_with_what_loads_it(tmp_path):
    """A file written by torch.save was reported as 'checkpoint directory ... is incomplete: its save did not
    finish' (load_model) or a KeyError 'state_dict' (full_state_dict)."""
    from lightning_rec.types import ShardMetadata

    module = _module()
    optimizer = module.configure_optimizers()
    state = module.state_dict()
    torch.save(state, tmp_path / "model.pt")
    table = f"{EBC}.embedding_bags.t_a.weight"
    one_rank = {**state, table: ShardedTensor((64, 8), [(ShardMetadata((0, 0), (32, 8), 0), state[table][:32])])}
    torch.save(one_rank, tmp_path / "rank0.pt")
    ckpt.save_file({"state_dict": state, "optimizer_states": [optimizer.state_dict()]}, tmp_path / "one.ckpt")
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text("{}")
    (tmp_path / "export" / "model.safetensors").write_bytes(b"")
    for name, words in [("model.pt", ["torch.save(model.state_dict())", "model.load_state_dict(torch.load("]),
                        ("rank0.pt", ["one rank's state dict", "ShardedTensor.merge"]),
                        ("export", ["export directory", "load_exported("])]:
        path = tmp_path / name
        for load in (lambda p=path: ckpt.load_model(module, p), lambda p=path: ckpt.load_optimizer(optimizer, p),
                     lambda p=path: ckpt.full_state_dict(p)):
            text = expect_error(ValueError, load, name, *words)
            assert "incomplete" not in text, text
    ckpt.full_state_dict(tmp_path / "one.ckpt")  # a one-file checkpoint loads (test_load_model_and_load_optimizer_...)


def test_sharded_state_into_unsharded_collection_says_how_to_merge(tmp_path):
    run_ranks(_piece_worker, 2, str(tmp_path), timeout=120)
    parts = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    module = _module()
    expect_error(ValueError, lambda: module.load_state_dict(parts[0]), "ShardedTensor.merge")
    merged = {k: ShardedTensor.merge([p[k] for p in parts]) if isinstance(v, ShardedTensor) else v
              for k, v in parts[0].items()}
    module.load_state_dict(merged)  # every piece there: loads whole


def _piece_worker(rank, W, out):
    module = _module()
    _shard(module, "row_wise", W)
    torch.save(module.state_dict(), os.path.join(out, f"rank{rank}.pt"))


# end to end: Trainer(strategy="rec") writes sharded checkpoints; `lightning-rec export` --------------


def _trainer_worker(rank, W, root):
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_samples=1024, num_val_samples=256, batch_size=64,
                                     num_sparse_features=4, num_signal_features=2, sparse_feature_names=NAMES,
                                     num_embeddings_per_feature=64)
    module = DLRMModule(**SMALL)
    trainer = L.Trainer(strategy="rec", accelerator="cpu", devices=W, max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=4)])
    trainer.fit(module, data)
    return _full_state(module, trainer.strategy.optimizers[0])


def _validate_worker(rank, W, path):
    import warnings

    import lightning.pytorch as L

    data = SyntheticCriteoDataModule(num_train_samples=1024, num_val_samples=256, batch_size=64,
                                     num_sparse_features=4, num_signal_features=2, sparse_feature_names=NAMES,
                                     num_embeddings_per_feature=64)
    trainer = L.Trainer(strategy="rec", accelerator="cpu", devices=W, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = trainer.validate(DLRMModule(**SMALL), data, ckpt_path=path, verbose=False)[0]
    return metrics, [str(w.message) for w in caught if "dataloader state" in str(w.message)]


def test_trainer_writes_sharded_checkpoints_and_export_cli(tmp_path, capsys):
    import subprocess
    import sys

    from lightning_rec.cli import export_main

    saved = run_ranks(_trainer_worker, 2, str(tmp_path / "ckpt"), timeout=180)[0]
    last = tmp_path / "ckpt" / "last.ckpt"
    assert (last / ".metadata").is_file() and (last / "__0_0.distcp").is_file() and (last / "__1_0.distcp").is_file()
    # step 4's directory was removed when step 8's replaced it (save_top_k=1): nothing else is left
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=8.ckpt", "last.ckpt"]
    out = tmp_path / "export"
    done = subprocess.run([sys.executable, "-m", "lightning_rec.cli", "export", str(last), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    module = ckpt.load_exported(out)  # this process never initialised torch.distributed
    assert not dist.is_initialized()
    state = module.state_dict()
    for k, v in saved.items():
        if k in state:
            assert torch.equal(state[k], v), k
    # the refusals in this process (the command above showed the entry point; a fresh python costs ~5 s)
    with pytest.raises(SystemExit) as bad:
        export_main([str(tmp_path / "nope"), str(out)])
    assert bad.value.code == 2 and "does not exist" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(SystemExit) as bad:
        export_main([str(last), str(tmp_path / "a_file")])
    said = capsys.readouterr().err
    assert bad.value.code == 2 and "is a file: give export a directory" in said, said
    # the user's umask decides, as for config.json (safetensors made it 0600)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == (out / "config.json").stat().st_mode & 0o777
    # validated at another world size: no word about the training loader's position, which it does not use
    (metrics, said), = run_ranks(_validate_worker, 1, str(last), timeout=120)
    assert "val_auc" in metrics and not said, said


def _weights_only_worker(rank, W, root):
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=64, batch_size=64,
                                     num_sparse_features=4, num_signal_features=2, sparse_feature_names=NAMES,
                                     num_embeddings_per_feature=64)

    def trainer(**kwargs):
        return L.Trainer(strategy="rec", accelerator="cpu", devices=W, max_steps=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, **kwargs)

    saving = ModelCheckpoint(dirpath=root, save_weights_only=True, every_n_train_steps=2)
    trainer(callbacks=[saving]).fit(DLRMModule(**SMALL), data)
    return expect_error(KeyError, lambda: trainer().fit(DLRMModule(**SMALL), data, ckpt_path=saving.best_model_path),
                        "optimizer state", "save_weights_only")


def test_resuming_from_a_weights_only_checkpoint_says_it_holds_no_optimizer_state(tmp_path):
    # the error named the learning-rate schedulers (the DLRM here has none), after restoring no optimizer state
    run_ranks(_weights_only_worker, 1, str(tmp_path), timeout=120)


def _killed_save_worker(rank, W, path, victim=1):
    module = _module()
    dmp = _shard(module, "row_wise", W)
    optimizer = module.configure_optimizers()
    _train(module, dmp, optimizer, rank, steps=5)
    import torch.distributed.checkpoint.filesystem as fs

    real = fs._write_item

    def die(*args, **kwargs):  # the victim is killed while it writes its tables
        if rank == victim:
            os.kill(os.getpid(), 9)
        return real(*args, **kwargs)

    fs._write_item = die
    ckpt.save({"state_dict": module.state_dict()}, path, optimizers=[optimizer])


def test_save_killed_midway_leaves_the_previous_checkpoint_whole(tmp_path):
    path = str(tmp_path / "last.ckpt")
    saved = run_ranks(_save_worker, 2, path, "row_wise", timeout=120)[0]
    with pytest.raises(AssertionError) as failed:
        run_ranks(_killed_save_worker, 2, path, timeout=60, pg_timeout=10, allow_missing=True)
    # rank 0 names its peer's death (not gloo's "Connection closed by peer" alone) and what became of the save
    assert "rank 0: PeerExited: saving checkpoint" in str(failed.value), failed.value
    assert "rank(s) [1] exited" in str(failed.value) and "is unchanged" in str(failed.value), failed.value
    partial = list(tmp_path.glob(".last.ckpt.partial-*"))
    assert partial and not (partial[0] / ckpt.LIGHTNING_FILE).exists()  # hidden and incomplete
    expect_error(ValueError, lambda: ckpt.read_lightning_state(partial[0]), "incomplete")
    loaded = run_ranks(_load_worker, 2, path, "table_wise", timeout=120)
    _same(saved, loaded[0])  # last.ckpt is the previous, whole checkpoint
    run_ranks(_save_worker, 2, path, "row_wise", timeout=120)
    assert not list(tmp_path.glob(".last.ckpt.partial-*"))  # the next save of that name clears the leftovers


def test_save_killed_on_rank_zero_names_it_on_the_others(tmp_path):
    """Rank 0 hosts the c10d Store (Lightning's launcher, run_ranks): once it is killed, its pid could no longer be
    read from the Store, and the other ranks said only "the ranks could not agree that every part was written
    (Connection reset by peer)". The ranks' pids are now read while every rank is known to be up (when
    DistributedModelParallel is built), so a dead rank 0 is named as any other."""
    path = str(tmp_path / "last.ckpt")
    saved = run_ranks(_save_worker, 3, path, "row_wise", timeout=120)[0]
    with pytest.raises(AssertionError) as failed:
        run_ranks(_killed_save_worker, 3, path, 0, timeout=60, pg_timeout=10, allow_missing=True)
    text = str(failed.value)
    for r in (1, 2):
        assert f"rank {r}: PeerExited: saving checkpoint {path} failed on rank {r}: rank(s) [0" in text, text
    assert "is unchanged" in text, text
    _same(saved, run_ranks(_load_worker, 3, path, "table_wise", timeout=120)[0])  # the previous checkpoint


class _Killed(BaseException):
    pass


@pytest.mark.parametrize("replaced", ["checkpoint", "symlink"])
def test_replacing_a_checkpoint_never_leaves_its_name_empty(tmp_path, monkeypatch, replaced):
    """A save over an existing checkpoint renamed it away, then the new one in: killed between the two, 'last.ckpt'
    was gone (ckpt_path="last" started over; the new one hid as '.partial-*', which the next save deletes). The
    two now swap in one step: a kill after the data is written finds one whole checkpoint under the name."""
    from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig

    tables = [EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=4)]
    module = EmbeddingBagCollection(tables)
    path = tmp_path / "last.ckpt"
    with torch.no_grad():
        module.table_parameters()["t"].fill_(1.0)
    if replaced == "symlink":  # save_last="link"'s kind of name
        ckpt.save({"state_dict": module.state_dict()}, tmp_path / "epoch=0.ckpt")
        path.symlink_to("epoch=0.ckpt")
    else:
        ckpt.save({"state_dict": module.state_dict()}, path)
    real = os.replace

    def killed_when_putting_the_new_one_in(src, dst):
        if str(dst) == str(path) and ".partial-" in str(src):
            raise _Killed()
        return real(src, dst)

    monkeypatch.setattr(os, "replace", killed_when_putting_the_new_one_in)
    with torch.no_grad():
        module.table_parameters()["t"].fill_(2.0)
    ckpt.save({"state_dict": module.state_dict()}, path)
    monkeypatch.setattr(os, "replace", real)
    fresh = EmbeddingBagCollection(tables)
    ckpt.load_model(fresh, path)
    assert torch.equal(fresh.table_parameters()["t"], torch.full((4, 4), 2.0)) and path.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["epoch=0.ckpt", "last.ckpt"] if replaced == "symlink"
                                                          else ["last.ckpt"])
    if replaced == "symlink":  # the link's target is untouched
        ckpt.load_model(fresh, tmp_path / "epoch=0.ckpt")
        assert torch.equal(fresh.table_parameters()["t"], torch.ones(4, 4))
    # where the swap is not available (not Linux, an old libc or a file system without it): the two renames
    monkeypatch.setattr(ckpt_files, "exchange", lambda a, b: False)
    with torch.no_grad():
        module.table_parameters()["t"].fill_(3.0)
    ckpt.save({"state_dict": module.state_dict()}, path)
    ckpt.load_model(fresh, path)
    assert torch.equal(fresh.table_parameters()["t"], torch.full((4, 4), 3.0))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _killed_load_worker(rank, W, path):
    module = _module()
    dmp = _shard(module, "table_wise", W)  # noqa: F841 - its guard publishes the ranks' pids
    import torch.distributed.checkpoint.filesystem as fs

    real = fs.FileSystemReader.read_data

    def die(self, *args, **kwargs):  # rank 1 is killed while it reads its tables
        if rank == 1:
            os.kill(os.getpid(), 9)
        return real(self, *args, **kwargs)

    fs.FileSystemReader.read_data = die
    ckpt.load_model(module, path)


def test_peer_killed_during_load_is_named_not_a_damaged_file(tmp_path):
    path = str(tmp_path / "last.ckpt")
    run_ranks(_save_worker, 2, path, "row_wise", timeout=120)
    with pytest.raises(AssertionError) as failed:
        run_ranks(_killed_load_worker, 2, path, timeout=60, pg_timeout=10, allow_missing=True)
    text = str(failed.value)
    assert "rank 0: PeerExited: reading checkpoint" in text and "rank(s) [1] exited" in text, text
    assert "not at fault" in text and "damaged" not in text.split("Traceback")[0], text
    run_ranks(_load_worker, 2, path, "table_wise", timeout=120)  # the files were fine


# loader state ---------------------------------------------------------------------------------------


def _loader(batch_size: int, n: int = 512):
    from lightning_rec.data.batch import make_batch_loader

    data = SyntheticCriteoDataModule(num_train_samples=n, num_val_samples=0, num_sparse_features=4,
                                     num_signal_features=2, sparse_feature_names=NAMES, num_embeddings_per_feature=64)
    return make_batch_loader(data.make_split("train"), batch_size, shuffle=True, drop_last=False, seed=3,
                             num_workers=0)


def _labels(batches) -> list[torch.Tensor]:
    return [b.labels for b in batches]


def test_loader_resumes_exactly_where_the_step_was():
    import itertools

    loader = _loader(32)
    loader.sampler.set_epoch(1)
    everything = _labels(loader)
    it = iter(loader)
    _labels(itertools.islice(it, 5))  # read 5, of which the step "consumed" 3 (a fetcher read ahead)
    loader.consumed_batches = lambda: 3
    state = loader.state_dict()
    assert state["batches"] == 3 and state["pass"] == 1
    fresh = _loader(32)
    fresh.load_state_dict(state)
    fresh.sampler.set_epoch(1)  # Lightning sets the epoch before the first batch; the iterator starts after
    rest = _labels(fresh)
    assert len(rest) == len(everything) - 3
    assert all(torch.equal(a, b) for a, b in zip(rest, everything[3:]))


def test_a_hand_loop_resumed_mid_epoch_reshuffles_the_epochs_after_it():
    """Outside Lightning a loader numbers its own passes; one resumed mid-epoch drew the resumed epoch's order
    again in the next pass (the epoch after it trained the same batches in the same order)."""
    import itertools

    from lightning_rec.data.batch import follow_fit_loop

    def hand_loop_loader():
        return follow_fit_loop(_loader(64), None)

    loader = hand_loop_loader()
    passes = [_labels(loader) for _ in range(3)]
    interrupted = hand_loop_loader()
    _labels(interrupted)
    _labels(itertools.islice(iter(interrupted), 3))  # pass 1, stopped after 3 batches
    resumed = hand_loop_loader()
    resumed.load_state_dict(interrupted.state_dict())
    rest, after = _labels(resumed), _labels(resumed)
    assert all(torch.equal(a, b) for a, b in zip(rest, passes[1][3:], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(after, passes[2], strict=True))


def test_a_pass_over_the_loader_leaves_the_global_generator_where_it_was():
    """torch's iterator draws its workers' seed from the global generator: a run resumed mid-epoch makes one
    iterator more than the uninterrupted run, so the restored RNG state moved on and every later dropout mask
    differed."""
    loader = _loader(128)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    _labels(loader)
    assert torch.equal(torch.rand(3), expected)


def test_loader_state_of_another_batch_size_warns_and_starts_the_epoch_over():
    import itertools

    loader = _loader(32)
    it = iter(loader)
    _labels(itertools.islice(it, 4))
    state = loader.state_dict()
    other = _loader(64)
    with pytest.warns(UserWarning, match="batch_size"):
        other.load_state_dict(state)
    assert len(_labels(other)) == len(other)  # the whole epoch, from its first batch
    smaller = _loader(32, n=256)  # another dataset (size): same
    with pytest.warns(UserWarning, match="dataset_id|num_samples"):
        smaller.load_state_dict(state)
    assert len(_labels(smaller)) == len(smaller)


def _fsdp_worker(rank, W, path, mode, module_arg="module"):
    from torch.distributed.tensor import DTensor

    module = _module()
    if mode == "load":
        torch.manual_seed(7)
    ebc = module.get_submodule(EBC)
    plan = ShardingPlan({EBC: construct_module_sharding_plan(ebc, _layout("row_wise", W), world_size=W, local_size=W)})
    dmp = DistributedModelParallel(module, plan=plan, device="cpu", dense="fsdp", timeout=30)
    optimizer = module.configure_optimizers()
    trains = dmp if module_arg == "dmp" else module  # the README's hand-written loop passes module=dmp
    if mode == "save_old":  # as before _named_model: the dense state under '_dmp_wrapped_module.<param>'
        optimizer_state.named_model, mode = optimizer_state.wrapped_named_model, "save"
    if mode == "save":
        _train(module, dmp, optimizer, rank)
        ckpt.save({"state_dict": module.state_dict()}, path, optimizers=[optimizer], module=trains)
    else:
        ckpt.load_model(module, path)
        ckpt.load_optimizer(optimizer, path, 0, module=trains)

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.clone()

    out = {k: full(v) for k, v in module.state_dict().items() if torch.is_tensor(v)}
    for pid, st in dict(optimizer.optimizers)["dense"].state_dict()["state"].items():
        out.update({f"dense:{pid}.{n}": full(v) for n, v in st.items() if torch.is_tensor(v)})
    return out


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 2), (2, 1), (1, 2)])
def test_dcp_with_fsdp_dense_layers_reshards(tmp_path, save_world, load_world):
    """FSDP's dense optimizer state (DTensor shards) reloads at any world size, bitwise."""
    path = str(tmp_path / "c.ckpt")
    saved = run_ranks(_fsdp_worker, save_world, path, "save", timeout=120)[0]
    loaded = run_ranks(_fsdp_worker, load_world, path, "load", timeout=120)[0]
    assert any(k.startswith("dense:") for k in saved)
    assert saved.keys() == loaded.keys()
    assert not [k for k in saved if not torch.equal(saved[k], loaded[k])]


def test_fsdp_dense_state_saved_with_module_dmp_loads_into_the_unsharded_model(tmp_path):
    """save(..., module=dmp) named the dense state '_dmp_wrapped_module.<param>': only a DistributedModelParallel could
    load it; the unsharded model (module=model) failed with 'Missing key ... A file of it may be damaged'."""
    path = str(tmp_path / "c.ckpt")
    saved = run_ranks(_fsdp_worker, 2, path, "save", "dmp", timeout=120)[0]
    assert not dist.is_initialized()
    module = _module()
    optimizer = module.configure_optimizers()
    ckpt.load_model(module, path)
    ckpt.load_optimizer(optimizer, path, 0, module=module)
    dense = dict(optimizer.optimizers)["dense"].state_dict()["state"]
    loaded = {f"dense:{pid}.{n}": v for pid, st in dense.items() for n, v in st.items() if torch.is_tensor(v)}
    loaded.update({k: v for k, v in module.state_dict().items() if k in saved})  # the dense layers (tables: above)
    assert any(k.startswith("dense:") for k in saved) and saved.keys() == loaded.keys()
    assert not [k for k in saved if not torch.equal(saved[k], loaded[k])]
    assert run_ranks(_fsdp_worker, 2, path, "load", "dmp", timeout=120)[0].keys() == saved.keys()  # and into a dmp
    old = str(tmp_path / "old.ckpt")  # written the old way: still loads into a DistributedModelParallel
    saved = run_ranks(_fsdp_worker, 2, old, "save_old", "dmp", timeout=120)[0]
    assert any("_dmp_wrapped_module" in k for k in ckpt._read_metadata(Path(old))[1].state_dict_metadata)
    loaded = run_ranks(_fsdp_worker, 2, old, "load", "dmp", timeout=120)[0]
    assert saved.keys() == loaded.keys() and not [k for k in saved if not torch.equal(saved[k], loaded[k])]


def _fsdp_wrong_module_worker(rank, W, path):
    module = _module()
    ebc = module.get_submodule(EBC)
    plan = ShardingPlan({EBC: construct_module_sharding_plan(ebc, _layout("row_wise", W), world_size=W, local_size=W)})
    DistributedModelParallel(module, plan=plan, device="cpu", dense="fsdp", timeout=30)
    optimizer = module.configure_optimizers()
    return expect_error(ValueError, lambda: ckpt.load_optimizer(optimizer, path, 0, module=module.model))


def test_dense_state_read_through_other_names_is_not_called_damage(tmp_path):
    """module=module.model (the inner model) at load, module=module at save: the names differ by 'model.'. It said
    'A file of it may be damaged or cut short: use an earlier checkpoint'."""
    path = str(tmp_path / "c.ckpt")
    run_ranks(_fsdp_worker, 1, path, "save", timeout=120)
    msg = run_ranks(_fsdp_wrong_module_worker, 1, path, timeout=120)[0]
    assert "has no entry 'optimizer_states.0.dense.dense.state.dense_arch" in msg, msg
    assert "Pass the same module=" in msg and "damaged" not in msg, msg


def _fsdp_trainer_worker(rank, W, root, resume, checkpoint_format="dcp", dense="fsdp", max_steps=3):
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.tensor import DTensor

    from lightning_rec.strategy import RecStrategy

    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_samples=512, num_val_samples=0, batch_size=64,
                                     num_sparse_features=4, num_signal_features=2, sparse_feature_names=NAMES,
                                     num_embeddings_per_feature=64)
    module = DLRMModule(**SMALL)
    trainer = L.Trainer(strategy=RecStrategy(dense=dense, checkpoint_format=checkpoint_format), accelerator="cpu",
                        devices=W, max_steps=max_steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[ModelCheckpoint(dirpath=root, save_last=True)])
    # resume: at max_steps already, fit only restores the checkpoint
    trainer.fit(module, data, ckpt_path=os.path.join(root, "last.ckpt") if resume else None)
    dense_kind, dense = dense, dict(trainer.strategy.optimizers[0].optimizers)["dense"]
    out = {}
    for pid, st in dense.state_dict()["state"].items():
        out.update({f"{pid}.{n}": (v.full_tensor() if isinstance(v, DTensor) else v.clone())
                    for n, v in st.items() if torch.is_tensor(v)})
        if dense_kind == "fsdp":  # state of FSDP's parameters is sharded as they are
            assert all(isinstance(v, DTensor) for n, v in st.items() if torch.is_tensor(v) and v.dim()), (pid, st)
    out.update({k: v.full_tensor() for k, v in module.state_dict().items() if isinstance(v, DTensor)})
    return out


@pytest.mark.parametrize("checkpoint_format", ["dcp", "gathered"])
def test_trainer_fsdp_dense_optimizer_state_resumes_at_another_world_size(tmp_path, checkpoint_format):
    """Dense layers and their optimizer state under FSDP, saved at 2 ranks, resumed at 1: bitwise (the
    gathered format stores them whole: every rank's shards, by parameter name)."""
    saved = run_ranks(_fsdp_trainer_worker, 2, str(tmp_path), False, checkpoint_format, timeout=180)[0]
    loaded = run_ranks(_fsdp_trainer_worker, 1, str(tmp_path), True, checkpoint_format, timeout=180)[0]
    assert any(k.endswith(".sum") for k in saved) and any(k.endswith(".weight") for k in saved)
    assert saved.keys() == loaded.keys()
    assert not [k for k in saved if not torch.equal(saved[k], loaded[k])]


CRITEO = SHARED_DATA / "criteo"


@pytest.mark.skipif(not CRITEO.is_dir(), reason="shared Criteo samples not present")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_streaming_criteo_loader_resumes_exactly(num_workers):
    import itertools

    from lightning_rec import CriteoDataModule

    def loader():
        data = CriteoDataModule(train_path=str(CRITEO / "criteo_kaggle_train_sample.tsv"), batch_size=256,
                                num_embeddings_per_feature=64, streaming=True, num_workers=num_workers, seed=5)
        data.setup("fit")
        return data.train_dataloader()

    first = loader()
    _labels(first)  # epochs 0 and 1
    _labels(first)
    it = iter(first)
    _labels(itertools.islice(it, 6))
    first.consumed_batches = lambda: 4  # the step had trained 4 (a fetcher read 2 ahead)
    state = first.state_dict()
    assert state["pass"] == 2 and state["batches"] == 4
    del it
    reference = loader()
    epoch2 = [_labels(reference) for _ in range(3)][2]  # the order of epoch 2 (shuffled by epoch)
    again = loader()
    again.load_state_dict(state)
    rest = _labels(again)
    assert len(rest) == len(epoch2) - 4
    assert all(torch.equal(a, b) for a, b in zip(rest, epoch2[4:]))


@pytest.mark.skipif(not CRITEO.is_dir(), reason="shared Criteo samples not present")
@pytest.mark.parametrize(("num_workers", "gzipped"), [(0, False), (2, False), (0, True)])
def test_streaming_criteo_resume_seeks_to_the_saved_block(tmp_path, num_workers, gzipped, monkeypatch):
    """The resumed pass reads from the block it was in (its byte offset), not the file's start; a
    compressed file is decompressed up to there, not parsed."""
    import gzip
    import itertools

    from lightning_rec.data import criteo
    from lightning_rec.data.batch import make_stream_loader
    from lightning_rec.data.criteo import datasets as criteo_datasets  # where the stream looks parse_block up

    path = CRITEO / "criteo_kaggle_train_sample.tsv"
    if gzipped:
        path = tmp_path / "train.tsv.gz"
        path.write_bytes(gzip.compress((CRITEO / "criteo_kaggle_train_sample.tsv").read_bytes()))

    def loader():  # 64 KiB blocks: the 1 MB sample is 17 of them
        data = criteo.CriteoIterableDataset(path, batch_size=100,
                                            num_embeddings_per_feature=64, shuffle=True, seed=5, block_bytes=1 << 16)
        return make_stream_loader(data, num_workers=num_workers)

    everything = _labels(loader())
    first = loader()
    it = iter(first)
    _labels(itertools.islice(it, 30))
    state = first.state_dict()
    del it
    # as a checkpoint holds it: Lightning reads checkpoints with weights_only=True (no numpy arrays)
    saved = io.BytesIO()
    torch.save(state, saved)
    state = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
    parsed = []
    parse = criteo_datasets.parse_block

    def counting(block, *args, **kwargs):
        parsed.append(len(block))
        return parse(block, *args, **kwargs)

    monkeypatch.setattr(criteo_datasets, "parse_block", counting)
    again = loader()
    again.load_state_dict(state)
    rest = _labels(again)
    assert len(rest) == len(everything) - 30
    assert all(torch.equal(a, b) for a, b in zip(rest, everything[30:]))
    if num_workers == 0:  # (workers parse in their own processes)
        size = (CRITEO / "criteo_kaggle_train_sample.tsv").stat().st_size
        assert 0 < sum(parsed) < size * 0.8, (sum(parsed), size)  # ~30 of ~45 batches were not read again


def test_a_stream_resumed_after_one_worker_finished_its_share(tmp_path):
    """3 blocks, 2 workers: worker 0 reads two, worker 1 one. A position saved after a worker had yielded its last
    batch held {"done": True} for it, and the resumed pass raised KeyError: 'rng' in that worker."""
    from lightning_rec.data import criteo
    from lightning_rec.data.batch import make_stream_loader

    rows = ["\t".join([str(n % 2), str(n)] + [str(k) for k in range(2, 14)] + [f"{k:08x}" for k in range(1, 27)])
            for n in range(300)]
    path = tmp_path / "rows.tsv"
    path.write_text("\n".join(rows) + "\n")

    def loader():
        data = criteo.CriteoIterableDataset(path, batch_size=20, num_embeddings_per_feature=8, shuffle=True,
                                            block_bytes=path.stat().st_size // 3 + 1)
        return make_stream_loader(data, num_workers=2)

    def rows(batches) -> list[list[int]]:
        return [b.dense_features[:, 0].expm1().round().long().tolist() for b in batches]

    everything = rows(loader())
    for taken in (len(everything) - 2, len(everything) - 1):  # a worker's last batch (short) is taken: it is done
        first = loader()
        it = iter(first)
        for _ in range(taken):
            next(it)
        state = first.state_dict()
        del it
        again = loader()
        again.load_state_dict(state)
        assert rows(again) == everything[taken:]


def test_one_process_save_and_load_say_nothing_about_torch_distributed(tmp_path):
    # DCP warns "torch.distributed is disabled, unavailable or uninitialized" on every call without a process
    # group; one process is a use we support, not a mistake to warn about
    import warnings

    model = torch.nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save({"state_dict": model.state_dict()}, tmp_path / "c")
        ckpt.load_model(model, tmp_path / "c")


# a strategy="rec" checkpoint directory used without strategy="rec" -------------------------------------


def _hparams_save_worker(rank, W, path):
    module = _module()
    dmp = _shard(module, "mixed", W)
    optimizer = module.configure_optimizers()
    _train(module, dmp, optimizer, rank)
    ckpt.save({"state_dict": module.state_dict(), "epoch": 1, "hyper_parameters": dict(module.hparams)}, path,
              optimizers=[optimizer], module_class="lightning_rec.models.dlrm_module.DLRMModule")


def _rank_zero_reads_whole_worker(rank, W, path, out):
    import time

    _hparams_save_worker(rank, W, path)
    done = Path(out) / "read"
    if rank == 1:  # goes on with its own work (here: waits for rank 0 without any collective), as in training
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        dist.barrier()
        return None
    start = time.monotonic()
    try:
        state = ckpt.full_state_dict(path)
        meta = ckpt.lightning_checkpoint(path)
        ckpt.export(path, Path(out) / "export")
    finally:
        done.touch()
    took = time.monotonic() - start
    dist.barrier()
    return took, sorted(state) == sorted(meta["state_dict"]), (Path(out) / "export" / "model.safetensors").is_file()


def test_whole_reads_on_rank_zero_alone_do_not_wait_for_the_other_ranks(tmp_path):
    """`if rank == 0: checkpoint.full_state_dict(path)` inside a running job (to gather for export) went into DCP's
    collective load, which the other ranks never joined: it hung with nothing printed. A whole read is one process's
    (as its docstring says): it reads the files alone, whatever the process group."""
    took, same_keys, exported = run_ranks(_rank_zero_reads_whole_worker, 2, str(tmp_path / "c.ckpt"), str(tmp_path),
                                          timeout=90, pg_timeout=20)[0]
    assert took < 10 and same_keys and exported


def test_rec_checkpoint_directory_loads_without_strategy_rec(tmp_path):
    # Lightning's loaders torch.load one file: DLRMModule.load_from_checkpoint(dir) and trainer.validate /
    # test / predict(ckpt_path=dir) under another strategy raised IsADirectoryError
    import lightning.pytorch as L

    path = str(tmp_path / "c.ckpt")
    run_ranks(_hparams_save_worker, 2, path, timeout=120)
    assert not dist.is_initialized()
    whole = ckpt.full_state_dict(path)
    module = DLRMModule.load_from_checkpoint(path, dense_lr=0.5)  # rebuilt from the saved hyperparameters
    assert module.hparams.dense_lr == 0.5 and module.hparams.sparse_lr == SMALL["sparse_lr"]
    with pytest.raises(TypeError, match="cannot be called on an instance"):  # as Lightning's: it loads nothing into it
        module.load_from_checkpoint(path)
    state = module.state_dict()
    assert state.keys() == whole.keys() and all(torch.equal(state[k], whole[k]) for k in whole)

    data = SyntheticCriteoDataModule(num_train_samples=64, num_val_samples=128, batch_size=64, num_sparse_features=4,
                                     num_signal_features=2, sparse_feature_names=NAMES, num_embeddings_per_feature=64)
    quiet = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    loaded = L.Trainer(**quiet).validate(module, data, verbose=False)
    trainer = L.Trainer(**quiet, max_steps=1)
    with pytest.raises(ValueError, match=r"strategy='rec'.*devices=1 too.*DLRMModule.load_from_checkpoint"):
        trainer.fit(DLRMModule(**SMALL), data, ckpt_path=path)
    assert trainer.validate(DLRMModule(**SMALL), data, ckpt_path=path, verbose=False) == loaded  # the same Trainer


def _rank_zero_save_worker(rank, W, path):
    module = _module()
    _shard(module, "row_wise", W)
    if rank == 0:  # `if trainer.is_global_zero: trainer.save_checkpoint(...)`; rank 1 goes on, and ends
        return expect_error(RuntimeError, lambda: ckpt.save({"state_dict": module.state_dict()}, path),
                            "every rank calls it", "is_global_zero", "Nothing was written")


def test_save_called_on_one_rank_only_says_it_is_collective(tmp_path):
    # rank 0 alone raised gloo's "Connection closed by peer ... GLHF!" once the others had exited
    run_ranks(_rank_zero_save_worker, 2, str(tmp_path / "c.ckpt"), timeout=120)
    assert not (tmp_path / "c.ckpt").exists()


def _per_rank_path_worker(rank, W, root):
    module = _module()
    _shard(module, "row_wise", W)
    return expect_error(ValueError, lambda: ckpt.save({"state_dict": module.state_dict()}, f"{root}/r{rank}.ckpt"),
                        "every rank passes the same path", f"rank 1: {root}/r1.ckpt", "Nothing was written")


def test_save_to_another_path_on_each_rank_is_refused(tmp_path):
    # rank 0 committed r0.ckpt without rank 1's pieces (left in a hidden partial directory of r1.ckpt), silently:
    # loading it said 'damaged: __1_0.distcp is missing'
    run_ranks(_per_rank_path_worker, 2, str(tmp_path), timeout=120)
    assert list(tmp_path.iterdir()) == []


def _own_disk_worker(rank, W, root):
    own = Path(root) / f"host{rank}"  # each rank's own disk: the same path names another directory on each host
    own.mkdir()
    os.chdir(own)
    module = _module()
    _shard(module, "row_wise", W)
    return expect_error(ValueError, lambda: ckpt.save({"state_dict": module.state_dict()}, "last.ckpt"),
                        "rank(s) [1]", "shared storage", "Nothing was written")


def test_a_save_to_node_local_disks_is_refused_naming_shared_storage(tmp_path):
    # with last.ckpt/ on each host's own disk, every rank's save succeeded without a word; only the next load said
    # '__1_0.distcp is missing'. The ranks now agree that they see the directory rank 0 created for the save.
    said = run_ranks(_own_disk_worker, 2, str(tmp_path), timeout=120)
    assert said[0] == said[1]
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*")] == [Path("host0"), Path("host1")]


def _rank_without_shards_worker(rank, W, path):
    from torch import nn

    from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, KeyedJaggedTensor
    from lightning_rec.optim import combined_optimizer

    def build():
        torch.manual_seed(0)
        model = nn.ModuleDict({"ebc": EmbeddingBagCollection(
            [EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"])],
            optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.1)), "dense": nn.Linear(4, 1)})
        plan = ShardingPlan({"ebc": construct_module_sharding_plan(model["ebc"], {"t": table_wise(rank=1)},
                                                                   world_size=W)})
        dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)
        optimizer = combined_optimizer(dmp, torch.optim.SGD(model["dense"].parameters(), lr=0.1))
        return dmp, optimizer

    dmp, optimizer = build()
    ids = torch.tensor([rank, 3, 7])
    dmp.module["ebc"](KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.ones(3, dtype=torch.long))).values() \
        .sum().backward()
    optimizer.param_groups[0]["lr"] = 0.05  # a scheduler's write
    ckpt.save({"state_dict": dmp.state_dict()}, path, optimizers=[optimizer])
    other, other_optimizer = build()
    ckpt.load_model(other, path)
    ckpt.load_optimizer(other_optimizer, path, module=other)
    saved = optimizer.state_dict()["fused"]["state"]
    loaded = other_optimizer.state_dict()["fused"]["state"]
    return ([g.get("name") for g in optimizer.param_groups], other_optimizer.param_groups[0]["lr"],
            sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved))


def test_a_rank_holding_no_fused_shard_keeps_a_fused_optimizer(tmp_path):
    """A table placed table_wise on rank 1 only: rank 0's combined_optimizer had no fused part (FusedOptimizer(dmp)
    raised 'the model has no fused embedding tables' there), so its param groups differed from rank 1's and
    checkpoint.save failed ('tuple' object has no attribute 'items' on rank 1: rank 0 skipped the fused state's
    gather). Now every rank has the fused part, empty where it holds no shard."""
    names, lrs, same = zip(*run_ranks(_rank_without_shards_worker, 2, str(tmp_path / "c"), timeout=120))
    assert names[0] == names[1] == ["ebc.fused0", None]
    assert lrs == (0.05, 0.05) and all(same)


def test_dense_state_saved_without_table_parameters_loads_into_an_optimizer_over_all_parameters(tmp_path):
    """torch.optim.Adam(model.parameters()) holds one parameter per table (an empty one once sharded) since freezing
    after sharding came in; its state saved before, without them, met torch's "loaded state dict contains a parameter
    group that doesn't match the size of optimizer's group" at resume. The tables hold no state: it loads, each dense
    parameter's state onto the same parameter."""
    from lightning_rec.embedding import FusedTableWeight

    path = str(tmp_path / "c.ckpt")
    module = _module()
    params = list(module.parameters())
    assert any(isinstance(p, FusedTableWeight) for p in params) and not isinstance(params[-1], FusedTableWeight)
    old = torch.optim.Adam([p for p in params if not isinstance(p, FusedTableWeight)], lr=0.01)
    for p in params:
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    old.step()
    ckpt.save({"state_dict": module.state_dict()}, path, optimizers=[old])
    for load in (lambda o: ckpt.load_optimizer(o, path, 0, module=module),
                 lambda o: ckpt.load_gathered_optimizer(o, old.state_dict(), module=module)):
        new = torch.optim.Adam(module.parameters(), lr=0.01)
        load(new)
        for p in params:
            if isinstance(p, FusedTableWeight):
                assert p not in new.state
            else:
                assert new.state[p].keys() == old.state[p].keys()
                assert all(torch.equal(new.state[p][k], old.state[p][k]) for k in old.state[p])


def test_a_module_of_ones_own_with_rec_checkpoint_loading_loads_a_checkpoint_directory(tmp_path):
    """MyModule.load_from_checkpoint(dir) for a LightningModule of one's own raised IsADirectoryError (Lightning's
    reads one file); lightning_rec.RecCheckpointLoading mixed in reads the directory, as DLRMModule's does."""
    import lightning.pytorch as pl

    from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig, RecCheckpointLoading

    class Mine(RecCheckpointLoading, pl.LightningModule):
        def __init__(self, rows: int = 10):
            super().__init__()
            self.save_hyperparameters()
            self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=rows, embedding_dim=4,
                                                                  feature_names=["f"])],
                                              optimizer=FusedOptimizerConfig("sgd"))
            self.dense = torch.nn.Linear(4, 1)

    path = str(tmp_path / "c.ckpt")
    module = Mine(rows=12)
    ckpt.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    with pytest.raises(IsADirectoryError):
        pl.LightningModule.load_from_checkpoint(path)  # Lightning's own, without the mixin
    loaded = Mine.load_from_checkpoint(path)
    assert loaded.hparams.rows == 12
    for name, value in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value)


class _GrowingModule:
    """A LightningModule of one's own whose collection gains a table (or resizes one) between a save and a resume."""

    @staticmethod
    def make(tables=("t",), rows: int = 64, strict: bool = True):
        import lightning.pytorch as pl

        from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
        from lightning_rec.optim import combined_optimizer, dense_parameters

        class Own(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.strict_loading = strict
                self.ebc = EmbeddingBagCollection(
                    [EmbeddingBagConfig(name=n, num_embeddings=rows, embedding_dim=4, feature_names=[f"C{i + 1}"])
                     for i, n in enumerate(tables)], optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.1))
                self.dense = torch.nn.Linear(13 + 4, 1)  # reads the first table: the same whatever is added

            def training_step(self, batch, batch_idx):
                pooled = self.ebc(batch.sparse_features).values()[:, :4]
                logits = self.dense(torch.cat([batch.dense_features, pooled], 1)).squeeze(1)
                return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)

            def configure_optimizers(self):
                return combined_optimizer(self, torch.optim.SGD(dense_parameters(self), lr=0.1))

        torch.manual_seed(0)
        return Own()


def test_a_table_added_since_the_save_resumes_with_strict_loading_false_and_a_resized_one_is_named(tmp_path):
    """A collection that gained a table, resumed with `self.strict_loading = False`: its weights loaded, then the fused
    optimizer state refused the new table and said "pass strict=False", which the user had done (and which no
    Trainer argument passes). Now the new table's fused state starts afresh, as its weights do, and the others load.
    A resized table said "pass strict=False to skip the missing entries" too, which loads no table of another size:
    now it says so, and the hint for missing entries names strict_loading under a Trainer."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=0, batch_size=64, num_sparse_features=2,
                                     num_embeddings_per_feature=64, num_signal_features=1)
    kw = dict(strategy="rec", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)  # no checkpoints/ in cwd
    saving = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    saved = _GrowingModule.make()
    pl.Trainer(max_steps=2, callbacks=[saving], **kw).fit(saved, data)
    path = saving.last_model_path
    state = ckpt.full_state_dict(path)
    grown = _GrowingModule.make(("t", "u"), strict=False)
    seen = {}

    class Look(pl.Callback):  # what the resume restored, before it trains on
        def on_train_start(self, trainer, module):
            fused = dict(trainer.optimizers[0].optimizers)["fused"].global_state_pieces()
            seen.update(t=module.ebc.state_dict()["embedding_bags.t.weight"].clone(),
                        u_sum=fused["ebc.u.sum"][1][0][1].clone(), t_sum=fused["ebc.t.sum"][1][0][1].clone())

    pl.Trainer(max_steps=3, callbacks=[Look()], **kw).fit(grown, data, ckpt_path=path)
    assert torch.equal(seen["t"], state["ebc.embedding_bags.t.weight"])
    assert seen["t_sum"].abs().sum() > 0 and not seen["u_sum"].any()  # t's state restored, u's starts at zero

    fresh = _GrowingModule.make(("t", "u"))
    said = expect_error(ValueError, lambda: ckpt.load_model(fresh, path), "not in the checkpoint",
                        "pass strict=False", "self.strict_loading = False")
    ckpt.load_model(fresh, path, strict=False)
    expect_error(ValueError, lambda: ckpt.load_optimizer(fresh.configure_optimizers(), path, module=fresh),
                 "ebc.u.sum", "pass strict=False")
    ckpt.load_optimizer(fresh.configure_optimizers(), path, module=fresh, strict=False)
    resized = _GrowingModule.make(rows=100, strict=False)
    for strict in (True, False):
        said = expect_error(ValueError, lambda s=strict: ckpt.load_model(resized, path, strict=s),
                            "(64, 4) in the checkpoint, (100, 4) here", "not a table or layer of another size")
        assert "pass strict=False" not in said, said


def test_a_url_dirpath_is_refused_before_training_and_the_gathered_format_saves_and_resumes_there(tmp_path,
                                                                                                  monkeypatch):
    """ModelCheckpoint(dirpath="s3://bucket/ckpt") under strategy="rec": every rank wrote its pieces with local file
    calls into a local directory named "s3:" (on a cloud machine, gone with its disk), and the run said it had saved.
    Now fit refuses the URL before training, as checkpoint.save does, naming a local path or the gathered format;
    the gathered format, which writes through Lightning's CheckpointIO, also reads it back to resume."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_rec.strategy import RecStrategy

    monkeypatch.chdir(tmp_path)
    url = f"memory://{tmp_path.name}/ckpt"  # fsspec's in-memory file system stands in for s3://
    data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=0, batch_size=64,
                                     num_embeddings_per_feature=64)
    small = {k: v for k, v in SMALL.items() if k != "sparse_feature_names"}

    def fit(strategy, steps: int, **kw):
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                             callbacks=[ModelCheckpoint(dirpath=url, save_last=True, every_n_train_steps=2)])
        trainer.fit(DLRMModule(**small), data, **kw)
        return trainer

    expect_error(ValueError, lambda: fit("rec", 2), f"checkpoint {url} is a URL", "local directory named 'memory:'",
                 "checkpoint_format='gathered'")
    expect_error(ValueError, lambda: ckpt.save({"state_dict": {}}, url + "/x.ckpt"), "is a URL")
    assert not list(tmp_path.iterdir())  # nothing written locally
    fit(RecStrategy(checkpoint_format="gathered"), 2)
    assert fit(RecStrategy(checkpoint_format="gathered"), 4, ckpt_path=url + "/last.ckpt").global_step == 4


def test_a_combined_optimizers_state_into_one_torch_optimizer_names_the_kind_to_build(tmp_path):
    """A Trainer checkpoint (DLRMModule: fused tables + dense Adagrad, one combined optimizer) restored in a hand loop
    into torch.optim.SGD(dense parameters) crashed inside torch with KeyError: 'param_groups'. Now it says what the
    checkpoint holds and what to build."""
    from lightning_rec.optim import dense_parameters

    path = str(tmp_path / "c.ckpt")
    module = _module()
    ckpt.save({"state_dict": module.state_dict()}, path, optimizers=[module.configure_optimizers()])
    plain = torch.optim.SGD(dense_parameters(module), lr=0.1)
    expect_error(ValueError, lambda: ckpt.load_optimizer(plain, path, module=module),
                 "optimizer 0 was saved as a combined optimizer", "['dense']", "this one is a SGD",
                 "combined_optimizer(model, dense_optimizer)", "checkpoint.load_model")
    ckpt.load_optimizer(module.configure_optimizers(), path, module=module)  # the same kind loads


def test_a_checkpoint_of_the_module_around_or_inside_names_the_prefix_and_strict_false_never_loads_nothing(tmp_path):
    """A Trainer checkpoint (names 'model.dense_arch...') loaded by a hand loop into the DLRM itself, or a hand loop's
    (names 'dense_arch...') into the DLRMModule, listed every name twice and suggested strict=False, which then
    loaded nothing at all without a word. Now the error names the prefix and where to load, and strict=False that
    would skip every entry is refused the same way."""
    outer, inner = str(tmp_path / "outer.ckpt"), str(tmp_path / "inner.ckpt")
    module = _module()
    ckpt.save({"state_dict": module.state_dict()}, outer)
    ckpt.save({"state_dict": module.model.state_dict()}, inner)
    said = expect_error(ValueError, lambda: ckpt.load_model(_module().model, outer),
                        "the checkpoint's names start with 'model.' where this model's do not", "load it into that")
    assert "strict=False" not in said, said
    expect_error(ValueError, lambda: ckpt.load_model(_module(), inner),
                 "this model's names start with 'model.' where the checkpoint's do not", "(model.model)")
    expect_error(ValueError, lambda: ckpt.load_model(_module().model, outer, strict=False),
                 "strict=False would skip every entry of this model", "start with 'model.'")
    target = _module()
    ckpt.load_model(target.model, inner)  # each into its own module loads
    assert all(torch.equal(v, target.model.state_dict()[k]) for k, v in module.model.state_dict().items())


def test_a_gathered_save_replaces_a_sharded_checkpoint_of_the_same_name(tmp_path):
    """A run resumed from a sharded last.ckpt with RecStrategy(checkpoint_format="gathered"), saving to the same
    dirpath, crashed at its first save of last.ckpt with IsADirectoryError (a file cannot replace a directory). The
    file now takes the directory's place, and the other way round still works."""
    path = tmp_path / "last.ckpt"
    module = _module()
    ckpt.save({"state_dict": module.state_dict()}, path)
    assert path.is_dir()
    ckpt.save_file({"state_dict": module.state_dict(), "epoch": 3}, path)
    assert path.is_file() and ckpt.load_file(path)["epoch"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # nothing hidden left behind
    ckpt.save({"state_dict": module.state_dict(), "epoch": 4}, path)
    assert path.is_dir() and ckpt.read_lightning_state(path)["epoch"] == 4


@pytest.mark.parametrize("checkpoint_format", ["dcp", "gathered"])
def test_a_ddp_checkpoint_resumes_with_fsdp_dense_layers(tmp_path, checkpoint_format):
    """Saved with RecStrategy(dense="ddp") (whole dense optimizer state), resumed with dense="fsdp": the whole tensors
    went into the optimizer of FSDP's sharded parameters as they were, and the first step crashed with "aten.addcmul_
    got mixed torch.Tensor and DTensor". Now they go in by parameter name, each rank keeping its shards: equal to what
    was saved, and training goes on."""
    saved = run_ranks(_fsdp_trainer_worker, 2, str(tmp_path), False, checkpoint_format, "ddp", timeout=180)[0]
    loaded = run_ranks(_fsdp_trainer_worker, 2, str(tmp_path), True, checkpoint_format, "fsdp", timeout=180)[0]
    assert any(k.endswith(".sum") for k in saved) and saved.keys() <= loaded.keys()
    assert not [k for k in saved if not torch.equal(saved[k], loaded[k])]
    run_ranks(_fsdp_trainer_worker, 1, str(tmp_path), True, checkpoint_format, "fsdp", 4, timeout=180)  # steps on


def test_either_formats_save_clears_the_others_killed_leftover(tmp_path):
    """A sharded save of last.ckpt killed midway leaves a hidden partial directory; the next save of that name in the
    gathered format (a run resumed with checkpoint_format="gathered") failed with IsADirectoryError removing it, and a
    sharded save left a gathered save's partial file behind for good. Each now removes both kinds."""
    path = tmp_path / "last.ckpt"
    (tmp_path / ".last.ckpt.partial-0dead").mkdir()
    (tmp_path / ".last.ckpt.partial-0dead" / "__0_0.distcp").write_bytes(b"x")
    ckpt.save_file({"state_dict": {}}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    (tmp_path / ".last.ckpt.partial-1dead").write_bytes(b"x")
    ckpt.save({"state_dict": {}}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"] and path.is_dir()


class _RenamingModule(DLRMModule):
    """Renames a key in on_load_checkpoint, as a LightningModule does after its attributes were renamed."""

    def on_load_checkpoint(self, checkpoint):
        state = checkpoint["state_dict"]
        self.read = len(state)  # every name, read whole on this rank
        state["model.over_arch.0.bias"] = state.pop("model.over_arch.0.old_bias")


def _on_load_checkpoint_worker(rank, W, root, resume):
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_samples=512, num_val_samples=0, batch_size=64, num_sparse_features=4,
                                     num_signal_features=2, sparse_feature_names=NAMES, num_embeddings_per_feature=64)
    module = _RenamingModule(**SMALL) if resume else DLRMModule(**SMALL)
    trainer = L.Trainer(strategy="rec", accelerator="cpu", devices=W, max_steps=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[ModelCheckpoint(dirpath=root, save_last=True)])
    if not resume:
        trainer.fit(module, data)
        return None
    trainer.fit(module, data, ckpt_path=os.path.join(root, "last.ckpt"))  # at max_steps: restores, trains no step
    return module.read, _full_state(module, trainer.strategy.optimizers[0])


def test_on_load_checkpoint_reads_and_renames_the_state_dict_of_a_sharded_checkpoint(tmp_path):
    """A LightningModule's on_load_checkpoint(checkpoint) that reads or renames checkpoint["state_dict"] (after an
    attribute was renamed) found an opaque marker under strategy="rec" ("'DCPCheckpoint' object has no attribute
    'items'"). It now reads as the state dict, every tensor whole, and what the hook changed is what loads."""
    run_ranks(_on_load_checkpoint_worker, 2, str(tmp_path), False, timeout=180)
    saved = ckpt.full_state_dict(tmp_path / "last.ckpt")
    # the checkpoint under the old name: last.ckpt rewritten (one process) with the bias renamed, its optimizer
    # state left out (the resume below restores the model; the optimizer's own test is elsewhere)
    renamed = {("model.over_arch.0.old_bias" if k == "model.over_arch.0.bias" else k): v for k, v in saved.items()}
    lightning = {k: v for k, v in ckpt._lightning_meta(tmp_path / "last.ckpt").items() if k != "lightning_rec"}
    ckpt.save({**lightning, "state_dict": renamed}, tmp_path / "last.ckpt")
    (read, state), _ = run_ranks(_on_load_checkpoint_worker, 2, str(tmp_path), True, timeout=180)
    assert read == len(saved)
    assert all(torch.equal(state[k], v) for k, v in saved.items())  # the renamed bias and every sharded table


def test_a_folder_of_checkpoints_is_named_as_one_not_as_a_broken_save(tmp_path):
    # --ckpt_path=checkpoints/dlrm (ModelCheckpoint's dirpath, not one of its checkpoints) was reported as "checkpoint
    # directory ... is incomplete (no .metadata, lightning.pt): its save did not finish"
    folder = tmp_path / "dlrm"
    for name in ("epoch=0-step=8.ckpt", "last.ckpt"):
        (folder / name).mkdir(parents=True)
        (folder / name / ckpt.LIGHTNING_FILE).write_bytes(b"")
    with pytest.raises(ValueError, match=r"dlrm is a folder of checkpoints \(epoch=0-step=8.ckpt, last.ckpt\), not one "
                                         r"checkpoint: give one of them, e.g. .*dlrm/last.ckpt"):
        ckpt.lightning_checkpoint(folder)
    (tmp_path / "half").mkdir()  # a save cut short: still said as such
    with pytest.raises(ValueError, match=r"is incomplete \(no .metadata, lightning.pt\): its save did not finish"):
        ckpt.lightning_checkpoint(tmp_path / "half")


def test_a_table_added_since_a_one_file_save_resumes_with_strict_loading_false(tmp_path):
    """The one-file format (checkpoint_format="gathered") with a table added since the save and
    `self.strict_loading = False`: the weights loaded, then Lightning's optimizer.load_state_dict refused the new
    table's missing fused state ("has no entry for ['ebc.u.sum']"), which the sharded format starts afresh. Now the
    new table keeps its fresh state and the others restore exactly, in either format."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_rec.strategy import RecStrategy

    data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=0, batch_size=64, num_sparse_features=2,
                                     num_embeddings_per_feature=64, num_signal_features=1)
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
              limit_val_batches=0, default_root_dir=tmp_path)
    saving = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    saved = _GrowingModule.make()
    pl.Trainer(max_steps=2, callbacks=[saving], strategy=RecStrategy(checkpoint_format="gathered"),
               **kw).fit(saved, data)
    path = saving.last_model_path
    assert Path(path).is_file()
    whole = torch.load(path, weights_only=False)
    saved_sum = whole["optimizer_states"][0]["fused"]["state"]["ebc.t.sum"]
    seen = {}

    class Look(pl.Callback):  # what the resume restored, before it trains on
        def on_train_start(self, trainer, module):
            fused = dict(trainer.optimizers[0].optimizers)["fused"].global_state_pieces()
            seen.update(t=module.ebc.state_dict()["embedding_bags.t.weight"].clone(),
                        u_sum=fused["ebc.u.sum"][1][0][1].clone(), t_sum=fused["ebc.t.sum"][1][0][1].clone())

    grown = _GrowingModule.make(("t", "u"), strict=False)
    pl.Trainer(max_steps=3, callbacks=[Look()], strategy=RecStrategy(checkpoint_format="gathered"),
               **kw).fit(grown, data, ckpt_path=path)
    assert torch.equal(seen["t"], whole["state_dict"]["ebc.embedding_bags.t.weight"])
    assert torch.equal(seen["t_sum"], saved_sum) and saved_sum.abs().sum() > 0
    assert not seen["u_sum"].any()  # u's state starts at zero

    # the optimizer's own load, as a hand loop calls it: strict by default, and it names strict=False
    fresh = _GrowingModule.make(("t", "u"))
    optimizer = fresh.configure_optimizers()
    expect_error(ValueError, lambda: optimizer.load_state_dict(whole["optimizer_states"][0]), "ebc.u.sum",
                 "strict=False")
    optimizer.load_state_dict(whole["optimizer_states"][0], strict=False)
    fused = dict(optimizer.optimizers)["fused"].table_states()
    assert torch.equal(fused["ebc.t"]["sum"], saved_sum) and not fused["ebc.u"]["sum"].any()


def _larger_fused_state_worker(rank, W, kind):
    from lightning_rec.models.dlrm_module import DLRMModule as Module

    torch.manual_seed(0)
    larger = dict(Module(**{**SMALL, "num_embeddings_per_feature": 100}).configure_optimizers().optimizers)["fused"]
    for states in larger.table_states().values():
        for t in states.values():
            t.fill_(1.0)
    module = _module()
    _shard(module, kind, W)
    fused = dict(module.configure_optimizers().optimizers)["fused"]
    before = {k: {n: t.clone() for n, t in s.items()} for k, s in fused.table_states().items()}
    said = expect_error(ValueError, lambda: fused.load_state_dict(larger.state_dict()), "has shape (100,) in the "
                        "checkpoint but (64,) here", f"table '{EBC[6:]}.t_", "is 64 x 8", "the table sizes differ",
                        "num_embeddings")
    assert "another world size" not in said, said
    assert all(torch.equal(t, before[k][n]) for k, s in fused.table_states().items() for n, t in s.items())


@pytest.mark.parametrize("kind", ["row_wise", "table_wise"])
def test_fused_state_of_a_larger_table_is_refused_not_cut_to_size(kind):
    """FusedOptimizer.load_state_dict given the whole-table state of a table with more rows: each row-wise shard cut
    its rows out of it without a word (the module's load refuses the larger table's weights); a table-wise one said
    it "was saved at another world size or plan". Now both name the table, its two sizes and the fix."""
    run_ranks(_larger_fused_state_worker, 2, kind, timeout=60)


def test_load_model_returns_the_missing_and_unexpected_keys_as_torch_does(tmp_path):
    """`checkpoint.load_model(model, path, strict=False)` returned None: what it skipped was nowhere to be seen, where
    torch's `load_state_dict` returns them. Now it returns (missing_keys, unexpected_keys) as torch does."""
    path = str(tmp_path / "c.ckpt")
    saved = _GrowingModule.make(("t", "v"))
    ckpt.save({"state_dict": saved.state_dict()}, path)
    grown = _GrowingModule.make(("t", "u"))
    keys = ckpt.load_model(grown, path, strict=False)
    assert keys.missing_keys == ["ebc.embedding_bags.u.weight"]
    assert keys.unexpected_keys == ["ebc.embedding_bags.v.weight"]
    missing, unexpected = keys  # a NamedTuple, unpacked as torch's
    t = "ebc.embedding_bags.t.weight"
    assert missing == keys.missing_keys and torch.equal(grown.state_dict()[t], saved.state_dict()[t])
    same = ckpt.load_model(_GrowingModule.make(("t", "v")), path)
    assert same == ([], []) and same._fields == ("missing_keys", "unexpected_keys")


def test_a_sharded_checkpoint_at_a_file_url_resumes_and_one_at_a_remote_url_is_refused_naming_the_fix(tmp_path):
    """A sharded checkpoint given as a URL: `ckpt_path="file:///.../last.ckpt"` failed in fsspec with
    IsADirectoryError, `load_model(m, "file://...")` said "checkpoint file:/... does not exist", and a remote one
    (s3://, here fsspec's memory:// in its place) failed with IsADirectoryError or the fsspec backend's ImportError.
    Now file:// reads the local directory, and a remote one is refused naming the fix (a local or mounted copy, or
    the one-file format)."""
    import fsspec
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=0, batch_size=64, num_sparse_features=1,
                                     num_embeddings_per_feature=64, num_signal_features=1)
    kw = dict(strategy="rec", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
    saving = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    pl.Trainer(max_steps=2, callbacks=[saving], **kw).fit(_GrowingModule.make(), data)
    path = Path(saving.last_model_path)
    url = path.resolve().as_uri()
    assert url.startswith("file:///")
    resumed = pl.Trainer(max_steps=3, **kw)
    resumed.fit(_GrowingModule.make(), data, ckpt_path=url)
    assert resumed.global_step == 3  # resumed at step 2, not started over
    module = _GrowingModule.make()
    ckpt.load_model(module, url)
    assert torch.equal(module.state_dict()["ebc.embedding_bags.t.weight"],
                       ckpt.full_state_dict(path)["ebc.embedding_bags.t.weight"])

    remote = f"memory://{tmp_path.name}/last.ckpt"  # fsspec's in-memory file system stands in for s3://
    fsspec.filesystem("memory").put(str(path), remote, recursive=True)
    expect_error(ValueError, lambda: pl.Trainer(max_steps=3, **kw).fit(_GrowingModule.make(), data, ckpt_path=remote),
                 f"checkpoint {remote} is a directory at a URL", "copy the directory to a local or mounted path",
                 "checkpoint_format='gathered'")
    for read in (lambda: ckpt.load_model(module, remote), lambda: ckpt.full_state_dict(remote)):
        expect_error(ValueError, read, f"checkpoint {remote} is a URL", "local or mounted", "give that path")


def _torch_state_dict_api_worker(rank, W):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict, set_state_dict

    module = _module()
    dmp = _shard(module, "row_wise", W)
    optimizer = module.configure_optimizers()
    _train(module, dmp, optimizer, rank, steps=1)
    fused, dense = dict(optimizer.optimizers)["fused"], dict(optimizer.optimizers)["dense"]
    words = ("cannot read a", "lightning_rec.checkpoint.save(", "load_optimizer(optimizer, path, module=dmp)")
    expect_error(ValueError, lambda: get_state_dict(dmp, optimizer), "CombinedOptimizer", *words)
    expect_error(ValueError, lambda: get_optimizer_state_dict(dmp, fused), "FusedOptimizer", *words)
    expect_error(ValueError, lambda: set_state_dict(dmp, optimizer, model_state_dict={},
                                                    optim_state_dict={"state": {}, "param_groups": []}), *words)
    assert get_optimizer_state_dict(dmp, dense)["state"]  # a torch.optim part alone is torch's to read
    assert optimizer.state_dict().keys() == {"fused", "dense"}  # our own calls are untouched


def test_torchs_get_state_dict_of_a_fused_optimizer_names_the_supported_calls():
    """torch.distributed.checkpoint.state_dict.get_state_dict(dmp, optimizer), torch's public API, raised
    KeyError: 'state' (a fused-only optimizer: KeyError on a table's name): it reads state by parameter index. Now
    it says it cannot read it and names checkpoint.save / load_model / load_optimizer."""
    run_ranks(_torch_state_dict_api_worker, 2, timeout=60)


def test_load_model_and_load_optimizer_read_a_one_file_checkpoint(tmp_path):
    """`checkpoint.load_model` / `load_optimizer` on a one-file checkpoint (checkpoint_format="gathered", whose files
    README says still load) refused it as "a file, not a checkpoint directory", and for the optimizer named no way
    to restore its state in a hand loop. Now both read it (every table whole, each rank keeping its pieces), and
    strict=False works as for a directory."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_rec.strategy import RecStrategy

    data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=0, batch_size=64, num_sparse_features=2,
                                     num_embeddings_per_feature=64, num_signal_features=1)
    saving = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2)
    pl.Trainer(strategy=RecStrategy(checkpoint_format="gathered"), accelerator="cpu", devices=1, max_steps=2,
               logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
               default_root_dir=tmp_path, callbacks=[saving]).fit(_GrowingModule.make(), data)
    path = saving.last_model_path
    whole = torch.load(path, weights_only=False)
    module = _GrowingModule.make(("t", "u"))
    optimizer = module.configure_optimizers()
    keys = ckpt.load_model(module, path, strict=False)
    assert keys.missing_keys == ["ebc.embedding_bags.u.weight"] and not keys.unexpected_keys
    ckpt.load_optimizer(optimizer, path, module=module, strict=False)
    for name, value in whole["state_dict"].items():
        assert torch.equal(module.state_dict()[name], value), name
    fused = dict(optimizer.optimizers)["fused"].table_states()
    assert torch.equal(fused["ebc.t"]["sum"], whole["optimizer_states"][0]["fused"]["state"]["ebc.t.sum"])
    assert fused["ebc.t"]["sum"].any() and not fused["ebc.u"]["sum"].any()
    dense = dict(optimizer.optimizers)["dense"].state_dict()
    assert dense["param_groups"][0]["lr"] == whole["optimizer_states"][0]["dense"]["param_groups"][0]["lr"]
    expect_error(ValueError, lambda: ckpt.load_optimizer(optimizer, path, index=1), "holds no state for optimizer 1",
                 "1 optimizer(s)")
    around = tmp_path / "around.ckpt"  # saved from the module around this one: strict=False would load nothing
    ckpt.save_file({"state_dict": {f"model.{k}": v for k, v in whole["state_dict"].items()}}, around)
    expect_error(ValueError, lambda: ckpt.load_model(_GrowingModule.make(), around, strict=False), "would skip every",
                 "names start with 'model.'")


def _pieces_strict_false_worker(rank, W):
    module = _module()
    _shard(module, "row_wise", W)
    pieces = dict(module.configure_optimizers().optimizers)["fused"].state_dict()  # "<table>@r<row>c<col>.sum"
    other = _module()
    _shard(other, "table_wise", W)
    fused = dict(other.configure_optimizers().optimizers)["fused"]
    expect_error(ValueError, lambda: fused.load_state_dict(pieces, strict=False), "saved by one rank of a model "
                 "sharded otherwise", "checkpoint.save")


def test_strict_false_does_not_skip_tables_saved_as_another_layouts_pieces():
    """FusedOptimizer.load_state_dict(strict=False) skips tables the state holds nothing for (added since); one rank's
    state of another layout holds the tables as pieces ("t_a@r0c0.sum"): those were skipped as absent, silently
    loading nothing. They are named as another layout's pieces, as with strict=True."""
    run_ranks(_pieces_strict_false_worker, 2, timeout=60)


@pytest.mark.parametrize("checkpoint_format", ["dcp", "gathered"])
def test_a_file_url_dirpath_is_refused_naming_the_path_and_save_takes_a_file_url(tmp_path, monkeypatch,
                                                                                   checkpoint_format):
    """ModelCheckpoint(dirpath="file:///data/ckpt"): Lightning resolves it against the working directory, and the
    checkpoints went to ./file:/data/ckpt (a later run from elsewhere found none). Now fit refuses it before
    training, naming the path to give; checkpoint.save("file:///...") writes the local directory it names."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_rec.strategy import RecStrategy

    monkeypatch.chdir(tmp_path)
    target = tmp_path / "ck"
    data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=0, batch_size=64, num_sparse_features=1,
                                     num_embeddings_per_feature=64, num_signal_features=1)
    trainer = pl.Trainer(strategy=RecStrategy(checkpoint_format=checkpoint_format), accelerator="cpu", devices=1,
                         max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, default_root_dir=tmp_path,
                         callbacks=[ModelCheckpoint(dirpath=target.as_uri(), every_n_train_steps=2)])
    expect_error(ValueError, lambda: trainer.fit(_GrowingModule.make(), data), "file:// URL",
                 f"ModelCheckpoint(dirpath='{target}')")
    assert trainer.global_step == 0 and not (tmp_path / "file:").exists()
    module = _GrowingModule.make()
    ckpt.save({"state_dict": module.state_dict()}, (target / "c.ckpt").as_uri())
    assert (target / "c.ckpt" / ".metadata").is_file()
    assert ckpt.load_model(_GrowingModule.make(), (target / "c.ckpt").as_uri()) == ([], [])
