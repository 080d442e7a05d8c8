"""Managed-collision tables in checkpoints (DCP and one-file): each rank's id maps and counters save with its table
pieces, by row position, and load at another world size (2 -> 3, 3 -> 1 ranks): every id moves to its owner under the
new layout with its counters, row content and fused optimizer state, so every (id, row content, state) is kept, the
one-file load ending bitwise where the DCP one does; the unsharded model loads the same checkpoint."""

import pytest
import torch
from dist_utils import run_ranks
from test_managed_collision_dist import MCModel, _batch, owned_pairs, shard

from lightning_rec import checkpoint as ckpt

ROWS = 64


def _sharded(W: int, seed: int):
    torch.manual_seed(seed)
    model = MCModel(ROWS)  # room for every id at 3 ranks too (each row shard keeps a row for unknown ids)
    return model, shard(model, W)  # the DMP swaps the collection in `model`


def _view(model: MCModel, with_state: bool = False) -> dict[int, tuple]:
    """id -> (row content, count, last seen[, optimizer state row]) for the ids this rank's row shards hold."""
    m = model.mc._managed_collision_collection.modules_by_table()["t"]
    counters = {int(i): (int(c), int(s)) for o in m._owners for _, ids, counts, last, _ in [o.module.entries()]
                for i, c, s in zip(ids, counts, last)}
    out = {}
    for i, (r, content) in owned_pairs(model).items():
        state = ()
        if with_state:  # adagrad's per-element state: this rank's columns of the row
            state = (torch.cat([v[r - first] for first, c0, states in sorted(m._state_pieces(), key=lambda p: p[1])
                                if first <= r < first + next(iter(states.values())).shape[0]
                                for v in states.values()]).clone(),)
        out[i] = (content, *counters[i], *state)
    return out


def _save_worker(rank, W, path):
    model, dmp = _sharded(W, 0)
    opt = dmp.fused_optimizer
    for step in range(6):
        model(_batch(rank, step)).sum().backward()
    ckpt.save({"state_dict": model.state_dict()}, path, optimizers=[opt])
    # the one-file format: every buffer and the fused optimizer state whole
    whole = {"state_dict": ckpt.gathered_state_dict(model.state_dict()),
             "optimizer_states": [ckpt.gathered_optimizer_state(opt)]}
    if rank == 0:
        torch.save(whole, path + ".pt")
    return _view(model, with_state=True)


def _load_worker(rank, W, path):
    """The DCP checkpoint and the one-file one, each with the optimizer (the one-file one also as Lightning's
    strategy loads it: the modules' own load_state_dict), and the unsharded model loaded from it then sharded: each
    view, and the (id -> row) map of the sharded loads."""
    views, rows = [], []
    for source in (path, path + ".pt", None):
        model, dmp = _sharded(W, 7)
        if source is None:
            whole = torch.load(path + ".pt", weights_only=False)
            model.load_state_dict(whole["state_dict"])
            dmp.fused_optimizer.load_state_dict(whole["optimizer_states"][0])
        else:
            ckpt.load_model(model, source)
            ckpt.load_optimizer(dmp.fused_optimizer, source)  # the moved ids' state rows move with them
        views.append(_view(model, with_state=True))
        rows.append({i: r for i, (r, _) in owned_pairs(model).items()})
    torch.manual_seed(7)
    model = MCModel(ROWS)
    ckpt.load_model(model, path)
    shard(model, W)  # the whole map is split over the owners as the model is sharded
    return views + [_view(model)], rows


def _union(results: list[dict]) -> dict:
    out: dict = {}
    for r in results:
        assert not out.keys() & r.keys()  # each id on one owner
        out.update(r)
    return out


@pytest.mark.parametrize("saved_at, loaded_at", [(2, 3), (3, 1)])
def test_reshard_keeps_every_id_its_row_and_its_optimizer_state(tmp_path, saved_at, loaded_at):
    """A one-file checkpoint's optimizer state used to load by row position only: the first re-homing (the load hook)
    recorded which ids moved, then load_model's second, idempotent call found nothing moving and forgot them, so
    every moved id kept its content but met the state of whatever id had sat at its new row."""
    path = str(tmp_path / "mc.ckpt")
    before = _union(run_ranks(_save_worker, saved_at, path, timeout=120))
    loaded = run_ranks(_load_worker, loaded_at, path, timeout=120)
    for k in range(4):
        after = _union([views[k] for views, _ in loaded])
        assert len(before) > 0 and before.keys() == after.keys(), k
        for i, (content, count, last, state) in before.items():
            assert torch.equal(after[i][0], content) and after[i][1:3] == (count, last), (k, i)
            assert k == 3 or torch.equal(after[i][3], state), (k, i)  # loaded with the optimizer: its state too
    # the one-file loads end where the DCP one does: the same rows, contents, counters and state, bitwise
    for k in (1, 2):
        dcp, one_file = ([views[j] for views, _ in loaded] for j in (0, k))
        assert all(a.keys() == b.keys() and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                                for i in a for x, y in zip(a[i], b[i])) for a, b in zip(dcp, one_file))
        assert [rows[0] for _, rows in loaded] == [rows[k] for _, rows in loaded]
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
