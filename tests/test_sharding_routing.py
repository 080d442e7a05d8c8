"""The pure routing math of sharding/ on one process: bucketize, remap, permute, place, update."""

from __future__ import annotations

import pytest
import torch

from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.model_parallel import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_wise,
)
from lightning_rec.optim import FusedOptimizerConfig
from lightning_rec.sharding import data_parallel as dp_math
from lightning_rec.sharding.embeddings import OutputColumns, assemble_pooled, column_runs, gather_columns, place_columns
from lightning_rec.sharding.ids import RouteTables, key_major_permutation, route_ids, to_key_major, to_source_major
from lightning_rec.sharding.layout import shard_layout
from lightning_rec.sharding.routing import build_routing
from lightning_rec.sharding.sharded_tensor import ShardedTensor
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.types import ShardingPlan, ShardingType

TABLES = [
    EmbeddingBagConfig(name="a", num_embeddings=10, embedding_dim=4, feature_names=["fa"]),
    EmbeddingBagConfig(name="b", num_embeddings=7, embedding_dim=8, feature_names=["fb1", "fb2"]),
]
KEYS = ["fa", "fb1", "fb2"]


def _routing(verbs, W=3, lws=None):
    ebc = EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("sgd"))
    plan = construct_module_sharding_plan(ebc, verbs, world_size=W, local_size=lws or W)
    return build_routing(TABLES, ebc.feature_names(), plan, W, pooled=True)


def _kjt(B=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(KEYS) * B,), generator=g)
    rows = [10, 7, 7]
    values = torch.cat([torch.randint(0, n, (int(lengths[f * B : (f + 1) * B].sum()),), generator=g)
                        for f, n in enumerate(rows)])
    return KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths)


def test_row_wise_ids_go_to_their_block_owner_remapped():
    W = 3
    routing = _routing({"a": row_wise(), "b": row_wise()}, W)
    kjt = _kjt()
    routed = route_ids(kjt, RouteTables(routing, torch.device("cpu")))
    B = kjt.stride()
    lengths = routed.lengths_SB.view(-1, B)
    # hand reference: per shard feature, per sample, the ids in its row range, minus the offset
    start = 0
    for i, sf in enumerate(routing.shard_features):
        r0, nr = sf.shard.shard_offsets[0], sf.shard.shard_sizes[0]
        jt = kjt[sf.feature]
        expect = []
        for b, bag in enumerate(jt.values().split(jt.lengths().tolist())):
            ids = [int(v) - r0 for v in bag if r0 <= v < r0 + nr]
            assert int(lengths[i, b]) == len(ids)
            expect += ids
        got = routed.values_N[start : start + len(expect)].tolist()
        assert got == expect, sf
        start += len(expect)
    assert sum(routed.ids_per_rank) == kjt.values().numel()
    # block rule: a = 10 rows over 3 ranks -> 4, 4, 2
    assert [s.shard_sizes[0] for s in routing.table_shardings["a"].shards] == [4, 4, 2]


@pytest.mark.parametrize("W", [3, 4])  # 4: table b (7 rows) leaves its last row shard empty
def test_unchecked_out_of_range_ids_stay_in_their_own_features_shards(W):
    """validate_ids=False: an id past its table's rows indexed the next copy's shard (here feature 'fa' id 12 read
    table 'b''s first row; -1 read the previous copy's last shard) and, remapped into range there, trained that row
    silently. It now stays with its own feature's shards, outside their rows, where the owner's kernel refuses it."""
    routing = _routing({"a": row_wise(), "b": row_wise()}, W)
    kjt = KeyedJaggedTensor.from_lengths_sync(KEYS, torch.tensor([12, -1, 3, 9, 7, -3]),
                                              torch.tensor([2, 1, 1, 0, 1, 1]))  # fa: 12, -1 | 3; fb2: 7 | -3
    routed = route_ids(kjt, RouteTables(routing, torch.device("cpu")))
    sf_of_id = torch.repeat_interleave(torch.arange(routing.num_routed).repeat_interleave(2), routed.lengths_SB)
    got = [(routing.shard_features[int(s)], int(v)) for s, v in zip(sf_of_id, routed.values_N)]
    inside = {(sf.feature, v + sf.shard.shard_offsets[0]) for sf, v in got if 0 <= v < sf.shard.shard_sizes[0]}
    assert inside == {("fa", 3)}  # the only id in range is the only one a shard may read
    assert sorted(sf.feature for sf, _ in got) == ["fa", "fa", "fa", "fb1", "fb2", "fb2"]


def test_table_wise_is_a_key_permutation_grouped_by_rank():
    routing = _routing({"a": table_wise(rank=2), "b": table_wise(rank=0)})
    tables = RouteTables(routing, torch.device("cpu"))
    assert tables.fast
    kjt = _kjt()
    routed = route_ids(kjt, tables)
    assert routing.local_feature_names(0) == ["fb1", "fb2"] and routing.local_feature_names(2) == ["fa"]
    n_b = sum(kjt.length_per_key()[1:])
    assert routed.ids_per_rank == [n_b, 0, kjt.length_per_key()[0]]


def test_key_major_permutation_with_uneven_batches():
    S, B_r = 2, [1, 3]
    # source-major bags: r0: s0 b0 | s1 b0 ; r1: s0 b0 b1 b2 | s1 b0 b1 b2  (lengths = bag labels)
    labels = torch.tensor([0, 10, 1, 2, 3, 11, 12, 13])
    perm = key_major_permutation(S, B_r, torch.device("cpu"))
    lengths, values, _, pos = to_key_major(perm, torch.ones(8, dtype=torch.long), labels, None, True)
    assert values.tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert labels[pos].tolist() == values.tolist()


def test_to_source_major_undoes_to_key_major_per_id():
    """Learned weights' gradient goes back source-major: each id's value returns to the place it came from."""
    S, B_r = 2, [2, 1]
    lengths = torch.tensor([2, 0, 1, 3, 1, 2])  # source-major: r0: s0 [2, 0] s1 [1, 3]; r1: s0 [1] s1 [2]
    ids = torch.arange(9)
    perm = key_major_permutation(S, B_r, torch.device("cpu"))
    _, ids_km, _, _ = to_key_major(perm, lengths, ids, None)
    assert ids_km.tolist() == [0, 1, 6, 2, 3, 4, 5, 7, 8]
    grad_km = ids_km.float() * 10
    assert to_source_major(perm, lengths, grad_km).tolist() == (ids.float() * 10).tolist()


def test_output_columns_place_and_sum_row_shards():
    routing = _routing({"a": row_wise(), "b": column_wise(ranks=[1, 0])}, W=2)
    cols = OutputColumns(routing, torch.device("cpu"))
    assert cols.summed
    B = 2
    # every rank returns its pooled block filled with (rank + 1): row shards of 'a' add up to 1 + 2
    received = torch.cat([torch.full((B * d,), float(p + 1)) for p, d in enumerate(routing.rank_dims)])
    out = assemble_pooled(received, B, None, cols, None)
    assert out.shape == (B, 4 + 8 + 8)
    assert torch.all(out[:, :4] == 3)
    # b: columns 0:4 on rank 1, 4:8 on rank 0, for both of its features
    assert torch.all(out[:, 4:8] == 2) and torch.all(out[:, 8:12] == 1)
    assert torch.all(out[:, 12:16] == 2) and torch.all(out[:, 16:20] == 1)


def test_grid_shard_layout_and_copies():
    routing = _routing({"a": table_wise(rank=0), "b": grid_shard(host_indexes=[0, 1])}, W=4, lws=2)
    shards = routing.table_shardings["b"].shards
    assert [(s.shard_offsets, s.placement) for s in shards] == [((0, 0), 0), ((4, 0), 1), ((0, 4), 2), ((4, 4), 3)]
    # 'a' is one copy; 'b' has 2 features x 2 column blocks = 4 copies, each over 2 row shards
    assert routing.copy_feature_index == [0, 1, 1, 2, 2] and routing.row_split


def test_sharded_tensor_reads_any_rectangle_and_names_missing_pieces():
    full = torch.arange(40.0).view(10, 4)
    pieces = [(m, full[m.shard_offsets[0] : m.shard_offsets[0] + m.shard_sizes[0],
                       m.shard_offsets[1] : m.shard_offsets[1] + m.shard_sizes[1]])
              for m in shard_layout("t", 10, 4, ShardingType.GRID_SHARD, 4, local_world_size=2, host_indexes=[0, 1])]
    st = ShardedTensor.merge([ShardedTensor((10, 4), pieces[:2]), ShardedTensor((10, 4), pieces[2:])])
    assert torch.equal(st.full(), full)
    assert torch.equal(st.read(3, 1, 5, 2), full[3:8, 1:3])
    with pytest.raises(ValueError, match="ShardedTensor.merge"):
        ShardedTensor((10, 4), pieces[:1]).read(0, 0, 10, 4)


def test_replica_update_matches_rowwise_adagrad_rule():
    config = FusedOptimizerConfig("rowwise_adagrad", lr=0.1)
    w = torch.randn(5, 3)
    grad = torch.zeros(5, 3)
    grad[1] = torch.tensor([1.0, -2.0, 0.5])
    state = dp_math.new_state(config, w)
    expected = w.clone()
    s = grad[1].pow(2).mean()
    expected[1] -= 0.1 * grad[1] / (s.sqrt() + config.eps)
    dp_math.apply_update(w, grad, state, config, 0.1)
    torch.testing.assert_close(w, expected)
    assert state["sum"][1] == s and state["sum"][0] == 0


def test_plan_prints_readably_and_verbs_check_the_table():
    ebc = EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("sgd"))
    plan = ShardingPlan({"sparse.ebc": construct_module_sharding_plan(
        ebc, {"a": row_wise(), "b": data_parallel()}, world_size=2)})
    text = str(plan)
    assert "sparse.ebc:" in text and "row_wise" in text and "rank 1: rows 5:10" in text and "data_parallel" in text
    with pytest.raises(ValueError, match="'c'"):
        construct_module_sharding_plan(ebc, {"c": row_wise()}, world_size=2)
    with pytest.raises(ValueError, match="table_wise or data_parallel"):
        construct_module_sharding_plan(ebc, {"b": row_wise()}, world_size=8)


def test_plan_compute_kernel_reaches_the_shard_tables():
    from lightning_rec.types import ComputeKernel

    routing = _routing({"a": table_wise(rank=1, compute_kernel=ComputeKernel.FUSED_UVM_CACHING),
                        "b": row_wise(compute_kernel=ComputeKernel.FUSED_UVM)})
    kernels = {t.name.split("@")[0]: t.compute_kernel for tables in routing.rank_tables for t in tables}
    assert kernels == {"a": "fused_uvm_caching", "b": "fused_uvm"}  # GPU: managed (+cache); CPU: host either way


def test_placed_parts_match_a_column_gather_with_gradients():
    # a data-parallel table, and b's column halves on ranks 1 and 0 for both its features: interleaved
    routing = _routing({"a": data_parallel(), "b": column_wise(ranks=[1, 0])}, W=2)
    cols = OutputColumns(routing, torch.device("cpu"))
    assert not cols.summed and not cols.identity
    B = 3
    received = torch.randn(B * sum(routing.rank_dims), requires_grad=True)
    dp_BD = torch.randn(B, cols.width_dp, requires_grad=True)
    out = assemble_pooled(received, B, dp_BD, cols, None)
    # the reference: the received blocks side by side, then each column to routing.output_columns()
    parts = [blk.view(B, d) for blk, d in zip(received.split([B * d for d in routing.rank_dims]), routing.rank_dims)]
    all_BD = torch.cat(parts + [dp_BD], dim=1)
    ref = torch.empty(B, cols.width).index_copy(1, routing.output_columns(), all_BD)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    g = torch.randn(B, cols.width)
    got = torch.autograd.grad(out, (received, dp_BD), g)
    expected = torch.autograd.grad(ref, (received, dp_BD), g)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_column_runs_place_and_gather_any_block_permutation():
    # table-wise round robin: every other 4-column block is one strided copy
    assert column_runs([0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]) == [(0, 0, 4, 3, 8)]
    assert column_runs([]) == []
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        width = 48
        b = [1, 2, 4, 8, 16][trial % 5]
        blocks = torch.randperm(width // b, generator=g).tolist()
        perm = [blocks[i // b] * b + i % b for i in range(width)]
        part = perm[: int(torch.randint(0, width + 1, (1,), generator=g))]
        x = torch.randn(5, len(part), generator=g)
        out = torch.zeros(5, width)
        place_columns(out, x, column_runs(part))
        expected = torch.zeros(5, width)
        expected[:, part] = x
        assert torch.equal(out, expected), part
        back = torch.empty(5, len(part))
        gather_columns(back, expected, column_runs(part))
        assert torch.equal(back, x), part


def test_a_table_or_feature_named_like_a_piece_is_refused():
    """Pieces are named '<table>@r<row>c<col>' on their rank: a table or feature of the collection already named so
    met a piece there, and one's ids were looked up in the other's rows (outputs wrong, no error)."""
    def routing(tables, verbs):
        ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("sgd"))
        plan = construct_module_sharding_plan(ebc, verbs, world_size=2)
        return build_routing(tables, ebc.feature_names(), plan, 2, pooled=True)

    def table(name, features):
        return EmbeddingBagConfig(name=name, num_embeddings=10, embedding_dim=4, feature_names=features)

    with pytest.raises(ValueError, match=r"feature name\(s\) \['a@r0c0'\] on rank 0 .* rename the feature"):
        routing([table("t0", ["a"]), table("t1", ["a@r0c0"])], {"t0": row_wise(), "t1": table_wise(rank=0)})
    with pytest.raises(ValueError, match=r"table name\(s\) \['t0@r0c0'\] on rank 0 .* rename the table"):
        routing([table("t0", ["a"]), table("t0@r0c0", ["b"])], {"t0": row_wise(), "t0@r0c0": data_parallel()})
    routing([table("t0", ["a"]), table("t0@r0c0", ["b"])], {"t0": row_wise(), "t0@r0c0": table_wise(rank=1)})  # apart
