"""Managed-collision tables in DCP checkpoints: the id map and counters save with the tables and load at another
world size (2 -> 3 ranks) with every (id, row content) pair kept."""

import pytest
import torch
from dist_utils import run_ranks
from test_managed_collision_dist import MCModel, _batch

from lightning_rec import checkpoint as ckpt
from lightning_rec.model_parallel import DistributedModelParallel, construct_module_sharding_plan, row_wise
from lightning_rec.types import ShardingPlan

WEIGHT = "mc._embedding_module.embedding_bags.t.weight"


def _sharded(W: int, seed: int) -> MCModel:
    torch.manual_seed(seed)
    model = MCModel()
    plan = ShardingPlan({"mc._embedding_module": construct_module_sharding_plan(
        model.mc._embedding_module, {"t": row_wise()}, world_size=W)})
    DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)  # swaps the collection in `model`
    return model


def _view(model: MCModel) -> tuple[dict, list]:
    """(the managed-collision buffers, this rank's table pieces as (first row, rows))."""
    state = model.state_dict()
    buffers = {k: v.clone() for k, v in state.items() if "_managed_collision_modules" in k}
    pieces = [(m.shard_offsets[0], t.clone()) for m, t in state[WEIGHT].local_shards]
    return buffers, pieces


def _save_worker(rank, W, path):
    model = _sharded(W, 0)
    for step in range(6):
        model(_batch(rank, step)).sum().backward()
    ckpt.save({"state_dict": model.state_dict()}, path)
    return _view(model)


def _load_worker(rank, W, path):
    model = _sharded(W, 7)
    ckpt.load_model(model, path)
    return _view(model)


def _pairs(results) -> dict[int, torch.Tensor]:
    buffers = results[0][0]
    table = torch.cat([rows for _, pieces in results for _, rows in sorted(pieces, key=lambda p: p[0])])
    prefix = "mc._managed_collision_collection._managed_collision_modules.t."
    ids, rows = buffers[prefix + "_sorted_ids"], buffers[prefix + "_sorted_rows"]
    admitted = ids != torch.iinfo(torch.int64).max
    return {int(i): table[int(r)] for i, r in zip(ids[admitted], rows[admitted])}


def test_reshard_2_to_3_keeps_every_id_and_its_row(tmp_path):
    path = str(tmp_path / "mc.ckpt")
    saved = run_ranks(_save_worker, 2, path, timeout=120)
    loaded = run_ranks(_load_worker, 3, path, timeout=120)
    for b, _ in loaded:  # the same map and counters on every rank, as saved
        assert b.keys() == saved[0][0].keys() and all(torch.equal(b[k], saved[0][0][k]) for k in b)
    before, after = _pairs(saved), _pairs(loaded)
    assert len(before) > 0 and before.keys() == after.keys()
    assert all(torch.equal(before[i], after[i]) for i in before)


class _Plain(torch.nn.Module):
    """MCModel's tables and dense layer without the id map."""

    def __init__(self) -> None:
        super().__init__()
        self.mc = torch.nn.Module()
        self.mc._embedding_module = MCModel().mc._embedding_module
        self.dense = torch.nn.Linear(8, 1)


def test_id_map_checkpoint_into_a_table_without_one_and_reverse(tmp_path):
    with_map, without = tmp_path / "with.ckpt", tmp_path / "without.ckpt"
    ckpt.save({"state_dict": MCModel().state_dict()}, str(with_map))
    ckpt.save({"state_dict": _Plain().state_dict()}, str(without))
    with pytest.raises(ValueError, match="in the checkpoint but not in this model: .*_managed_collision"):
        ckpt.load_model(_Plain(), str(with_map))
    with pytest.raises(ValueError, match="not in the checkpoint: .*_managed_collision"):
        ckpt.load_model(MCModel(), str(without))
