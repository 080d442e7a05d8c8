"""Managed-collision tables in DCP checkpoints: each rank's id maps and counters save with its table pieces, by row
position, and load at another world size (2 -> 3 ranks): every id moves to its owner under the new layout with its
counters and row content, so every (id, row content) pair is kept; the unsharded model loads the same checkpoint."""

import pytest
import torch
from dist_utils import run_ranks
from test_managed_collision_dist import MCModel, _batch, owned_pairs, shard

from lightning_rec import checkpoint as ckpt

ROWS = 64


def _sharded(W: int, seed: int) -> MCModel:
    torch.manual_seed(seed)
    model = MCModel(ROWS)  # room for every id at 3 ranks too (each row shard keeps a row for unknown ids)
    shard(model, W)  # swaps the collection in `model`
    return model


def _view(model: MCModel) -> dict[int, tuple]:
    """id -> (row content, count, last seen) for the ids this rank's row shards hold."""
    m = model.mc._managed_collision_collection.modules_by_table()["t"]
    counters = {int(i): (int(c), int(s)) for o in m._owners for _, ids, counts, last, _ in [o.module.entries()]
                for i, c, s in zip(ids, counts, last)}
    return {i: (content, *counters[i]) for i, (_, content) in owned_pairs(model).items()}


def _save_worker(rank, W, path):
    model = _sharded(W, 0)
    for step in range(6):
        model(_batch(rank, step)).sum().backward()
    ckpt.save({"state_dict": model.state_dict()}, path)
    whole = ckpt.gathered_state_dict(model.state_dict())  # the one-file format: every buffer whole
    if rank == 0:
        torch.save({"state_dict": whole}, path + ".pt")
    return _view(model)


def _load_worker(rank, W, path):
    """The DCP checkpoint, the one-file one, and the unsharded model loaded from it then sharded: each view."""
    views = []
    for source in (path, path + ".pt"):
        model = _sharded(W, 7)
        ckpt.load_model(model, source)
        views.append(_view(model))
    torch.manual_seed(7)
    model = MCModel(ROWS)
    ckpt.load_model(model, path)
    shard(model, W)  # the whole map is split over the owners as the model is sharded
    return views + [_view(model)]


def _union(results: list[dict]) -> dict:
    out: dict = {}
    for r in results:
        assert not out.keys() & r.keys()  # each id on one owner
        out.update(r)
    return out


def test_reshard_2_to_3_keeps_every_id_and_its_row(tmp_path):
    path = str(tmp_path / "mc.ckpt")
    before = _union(run_ranks(_save_worker, 2, path, timeout=120))
    loaded = run_ranks(_load_worker, 3, path, timeout=120)
    for k in range(3):
        after = _union([views[k] for views in loaded])
        assert len(before) > 0 and before.keys() == after.keys(), k
        for i, (content, count, last) in before.items():
            assert torch.equal(after[i][0], content) and after[i][1:] == (count, last), (k, i)
    # the unsharded model reads the same checkpoint: its map from the rows' ids, every pair as saved
    plain = MCModel(ROWS)
    ckpt.load_model(plain, path)
    ids, rows = plain.mc._managed_collision_collection.modules_by_table()["t"].id_map()
    table = plain.mc._embedding_module.lookup.table_weights()["t"]
    assert sorted(ids.tolist()) == sorted(before)
    assert all(torch.equal(table[int(r)], before[int(i)][0]) for i, r in zip(ids, rows))


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
