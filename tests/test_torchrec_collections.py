"""The collections as TorchRec users build and feed them: under `with torch.device("meta")`, materialised with
`to_empty` (then `reset_parameters()` or `load_state_dict`), or sharded straight from meta; one feature read by
several tables (outputs `feature@table`); a dense optimizer built over `model.parameters()` beside fused tables."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from dist_utils import run_ranks
from torch import nn

from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from lightning_rec.model_parallel import (
    DistributedModelParallel,
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from lightning_rec.optim import FusedOptimizer, FusedOptimizerConfig, combined_optimizer
from lightning_rec.optim.combined import CombinedOptimizer
from lightning_rec.sharding.sharded_tensor import ShardedTensor
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.types import ShardingPlan

SGD = FusedOptimizerConfig("sgd", lr=0.1)


def _bags(**kw):
    return [EmbeddingBagConfig(name="t1", num_embeddings=10, embedding_dim=4, feature_names=["f1", "f2"], **kw),
            EmbeddingBagConfig(name="t2", num_embeddings=6, embedding_dim=8, feature_names=["f3"])]


def _seqs():
    return [EmbeddingConfig(name="t1", num_embeddings=10, embedding_dim=4, feature_names=["f1", "f2"]),
            EmbeddingConfig(name="t2", num_embeddings=6, embedding_dim=4, feature_names=["f3"])]


def _kjt(keys=("f1", "f2", "f3"), device=None, B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(keys) * B,), generator=g)
    values = torch.randint(0, 6, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(list(keys), values.to(device), lengths.to(device))


# -- built on meta: TorchRec's `with torch.device("meta")` -------------------------------------------------------


@pytest.mark.parametrize("optimizer", [None, SGD])
def test_collections_built_under_a_meta_device_context_hold_meta_tables(optimizer):
    """`with torch.device("meta"): EmbeddingBagCollection(...)` crashed with "Cannot copy out of meta tensor"
    (the row counts the batch check reads were made on meta too); device="meta" worked."""
    with torch.device("meta"):
        ebc = EmbeddingBagCollection(_bags(), optimizer=optimizer)
        ec = EmbeddingCollection(_seqs(), optimizer=optimizer)
    for m, attr in ((ebc, "embedding_bags"), (ec, "embeddings")):
        assert m.device == torch.device("meta")
        assert all(getattr(m, attr)[t].weight.is_meta for t in ("t1", "t2"))
    # a batch on meta gives outputs of the right shapes (TorchRec's, for shape inference)
    kjt = KeyedJaggedTensor.from_offsets_sync(["f1", "f2", "f3"], torch.tensor([1, 2, 3, 4], device="meta"),
                                              torch.tensor([0, 1, 2, 2, 3, 3, 4], device="meta"))
    kt = ebc(kjt)
    assert kt.values().is_meta and kt.keys() == ["f1", "f2", "f3"] and kt.offset_per_key() == [0, 4, 8, 16]
    assert kt.values().shape == (kjt.stride(), 16)
    assert ec(kjt)["f3"].values().is_meta and ec(kjt)["f3"].values().shape[1] == 4
    # sync() on meta: TorchRec's stand-in lengths per key (the ids spread over the keys), no read
    lazy = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3], device="meta"),
                             lengths=torch.tensor([1, 0, 1, 1], device="meta"))
    assert lazy.sync().length_per_key() == [2, 1] and lazy["b"].values().shape == (1,)
    ec.to_empty(device="cpu")
    ec.reset_parameters()
    assert ec(_kjt())["f3"].values().shape[1] == 4 and ec.embeddings["t1"].weight.device == torch.device("cpu")


def test_a_meta_collection_fed_real_ids_names_to_empty():
    """A collection still on meta given a real batch: one line naming to_empty (and sharding), not a kernel error."""
    with torch.device("meta"):
        ebc = EmbeddingBagCollection(_bags())
    with pytest.raises(ValueError, match=r"built on device='meta': .*model.to_empty\(device='cpu'\).*"
                                         r"reset_parameters\(\).*DistributedModelParallel"):
        ebc(_kjt())


@pytest.mark.parametrize("optimizer", [None, SGD])
@pytest.mark.parametrize("assign", [False, True])
def test_to_empty_materialises_meta_tables_that_then_load_for_real(optimizer, assign):
    """to_empty(device="cpu") left the tables on meta, and load_state_dict (with or without assign=True) then
    reported no missing key while loading nothing; the first forward failed without naming to_empty."""
    torch.manual_seed(0)
    source = EmbeddingBagCollection(_bags(), optimizer=optimizer)
    with torch.device("meta"):
        model = nn.ModuleDict({"ebc": EmbeddingBagCollection(_bags(), optimizer=optimizer), "dense": nn.Linear(2, 2)})
    model.to_empty(device="cpu")
    ebc = model["ebc"]
    assert ebc.device == torch.device("cpu") and not any(p.is_meta for p in model.parameters())
    result = ebc.load_state_dict(source.state_dict(), assign=assign)
    assert not result.missing_keys and not result.unexpected_keys
    for t in ("t1", "t2"):
        torch.testing.assert_close(ebc.embedding_bags[t].weight, source.embedding_bags[t].weight, atol=0, rtol=0)
    kjt = _kjt()
    torch.testing.assert_close(ebc(kjt).values(), source(kjt).values(), atol=0, rtol=0)
    if optimizer is not None:  # it trains: the fused update reaches the loaded rows
        before = ebc.embedding_bags["t1"].weight.detach().clone()
        ebc(kjt).values().sum().backward()
        assert not torch.equal(before, ebc.embedding_bags["t1"].weight)


def test_to_empty_then_reset_parameters_or_init_per_table():
    """TorchRec users initialise after to_empty: reset_parameters() (each config's init_fn, else uniform in its
    range), or an init of their own per table parameter; tables frozen on meta stay frozen."""
    normal = functools.partial(nn.init.normal_, std=1e-3)
    with torch.device("meta"):
        ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="a", num_embeddings=50, embedding_dim=4,
                                                         feature_names=["fa"], init_fn=normal),
                                      EmbeddingBagConfig(name="b", num_embeddings=50, embedding_dim=4,
                                                         feature_names=["fb"], weight_init_min=0.5,
                                                         weight_init_max=0.6)], optimizer=SGD)
    ebc.requires_grad_(False)
    ebc.to_empty(device="cpu")
    ebc.reset_parameters()
    a, b = ebc.embedding_bags["a"].weight, ebc.embedding_bags["b"].weight
    assert 0 < a.std() < 3e-3 and b.min() >= 0.5 and b.max() <= 0.6
    assert ebc.frozen_tables() == frozenset({"a", "b"})
    for p in ebc.parameters():
        nn.init.constant_(p, 0.25)  # per table, in place: the kernels read it
    kjt = KeyedJaggedTensor.from_lengths_sync(["fa", "fb"], torch.tensor([1, 2]), torch.tensor([1, 1]))
    torch.testing.assert_close(ebc(kjt).values(), torch.full((1, 8), 0.25))


def test_load_state_dict_into_meta_tables_needs_to_empty_or_assign():
    """Into tables still on meta: assign=True (torch's own advice) materialises them with the checkpoint's values;
    without it torch would copy into meta (a no-op): refused, naming to_empty and assign=True."""
    source = EmbeddingBagCollection(_bags(), optimizer=SGD)
    with torch.device("meta"):
        ebc = EmbeddingBagCollection(_bags(), optimizer=SGD)
    with pytest.raises(ValueError, match=r"on 'meta'.*to_empty\(device='cpu'\).*assign=True"):
        ebc.load_state_dict(source.state_dict())
    ebc.load_state_dict(source.state_dict(), assign=True)
    assert ebc.device == torch.device("cpu")
    kjt = _kjt()
    torch.testing.assert_close(ebc(kjt).values(), source(kjt).values(), atol=0, rtol=0)


# -- one feature read by several tables: TorchRec's `feature@table` -------------------------------------------------


def _shared_bags():
    # f1 read by t1 (dim 4, 10 rows) and t2 (dim 8, 6 rows): different dims, the names say which
    return [EmbeddingBagConfig(name="t1", num_embeddings=10, embedding_dim=4, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(name="t2", num_embeddings=6, embedding_dim=8, feature_names=["f1", "f3"],
                               pooling="mean")]


def _by_hand(ebc, kjt, pooled=True):
    """Each output from the table it names, with torch's embedding_bag / embedding."""
    tables = {n: p.detach() for n, p in ebc.table_parameters().items()}
    out = {}
    for c in (ebc.embedding_bag_configs() if pooled else ebc.embedding_configs()):
        for f in c.feature_names:
            shared = sum(f in d.feature_names for d in ebc._configs) > 1
            jt = kjt[f]
            name = f"{f}@{c.name}" if shared else f
            if pooled:
                out[name] = nn.functional.embedding_bag(jt.values(), tables[c.name], jt.offsets()[:-1],
                                                        mode=str(c.pooling))
            else:
                out[name] = nn.functional.embedding(jt.values(), tables[c.name])
    return out


@pytest.mark.parametrize("optimizer", [None, SGD])
def test_a_feature_read_by_two_tables_gives_one_output_per_table(optimizer):
    """TorchRec serves a feature that several tables read, naming the outputs `feature@table`; ours refused it."""
    ebc = EmbeddingBagCollection(_shared_bags(), optimizer=optimizer)
    assert ebc.feature_names() == ["f1@t1", "f2", "f1@t2", "f3"]
    kjt = _kjt(("f3", "f2", "f1"))  # any key order
    kt = ebc(kjt)
    assert kt.keys() == ["f1@t1", "f2", "f1@t2", "f3"] and kt.offset_per_key() == [0, 4, 8, 16, 24]
    for name, want in _by_hand(ebc, kjt).items():
        torch.testing.assert_close(kt[name], want, atol=1e-6, rtol=0, msg=name)
    ec = EmbeddingCollection([EmbeddingConfig(name="t1", num_embeddings=10, embedding_dim=4, feature_names=["f1"]),
                              EmbeddingConfig(name="t2", num_embeddings=6, embedding_dim=8, feature_names=["f1"])],
                             optimizer=optimizer, need_indices=True)
    out = ec(_kjt(("f1",)))
    assert list(out) == ["f1@t1", "f1@t2"] and ec.embedding_names_by_table() == [["f1@t1"], ["f1@t2"]]
    for name, want in _by_hand(ec, _kjt(("f1",)), pooled=False).items():
        torch.testing.assert_close(out[name].values(), want, atol=0, rtol=0, msg=name)
        assert torch.equal(out[name].weights(), _kjt(("f1",))["f1"].values())  # need_indices: the ids


def test_a_shared_feature_trains_both_tables():
    """The gradient of each output reaches its own table; the fused update of each table sees only its output's."""
    ebc = EmbeddingBagCollection(_shared_bags(), optimizer=FusedOptimizerConfig("sgd", lr=1.0))
    ref = EmbeddingBagCollection(_shared_bags(), optimizer=None)
    ref.load_state_dict(ebc.state_dict())
    kjt = _kjt(("f1", "f2", "f3"))
    grad = torch.randn(kjt.stride(), 24, generator=torch.Generator().manual_seed(1))
    (ebc(kjt).values() * grad).sum().backward()
    (ref(kjt).values() * grad).sum().backward()
    for name, p in ref.table_parameters().items():
        torch.testing.assert_close(ebc.table_parameters()[name], (p - p.grad).detach(), atol=1e-6, rtol=0)


def test_a_shared_feature_checks_ids_against_its_smallest_table():
    ebc = EmbeddingBagCollection(_shared_bags())
    kjt = KeyedJaggedTensor.from_lengths_sync(["f1", "f2", "f3"], torch.tensor([8, 1, 1]), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match=r"'f1'.*\b8\b.*'t2'"):
        ebc(kjt)


def test_an_output_name_given_twice_is_refused():
    tables = [EmbeddingBagConfig(name="a", num_embeddings=5, embedding_dim=4, feature_names=["f"]),
              EmbeddingBagConfig(name="b", num_embeddings=5, embedding_dim=4, feature_names=["f"]),
              EmbeddingBagConfig(name="c", num_embeddings=5, embedding_dim=4, feature_names=["f@a"])]
    with pytest.raises(ValueError, match=r"table 'c': feature 'f@a' gives the output name 'f@a', which another "
                                         r"feature already has .*'feature@table'.*rename"):
        EmbeddingBagCollection(tables)


# -- sharded: parity with the unsharded collection -------------------------------------------------------------------

SHARED_PLANS = {
    "table_wise": lambda W: {"t1": table_wise(rank=W - 1), "t2": table_wise(rank=0)},
    "row_wise": lambda W: {"t1": row_wise(), "t2": row_wise()},
    "column_wise": lambda W: {"t1": column_wise(ranks=[0, W - 1]), "t2": column_wise(ranks=list(range(W)))},
}


def _shared_sharded_worker(rank, W, meta):
    """Each plan, bags and sequences, against the unsharded collection over every rank's samples."""
    done = []
    for kind, layout in SHARED_PLANS.items():
        for pooled in (True, False):
            torch.manual_seed(0)
            if pooled:
                configs = _shared_bags()
                make = functools.partial(EmbeddingBagCollection, configs, optimizer=FusedOptimizerConfig("adagrad"))
            else:
                configs = [EmbeddingConfig(name=c.name, num_embeddings=c.num_embeddings, embedding_dim=4,
                                           feature_names=c.feature_names) for c in _shared_bags()]
                make = functools.partial(EmbeddingCollection, configs, optimizer=FusedOptimizerConfig("adagrad"))
            ref = make()
            with torch.device("meta" if meta else "cpu"):
                m = make()
            plan = ShardingPlan({"": construct_module_sharding_plan(m, layout(W), world_size=W)})
            dmp = DistributedModelParallel(m, plan=plan, device="cpu", timeout=30)
            dmp.load_state_dict(ref.state_dict())  # whole tables into the shards
            for step in range(3):
                batches = [_kjt(("f3", "f2", "f1"), B=2 + r, seed=10 * step + r) for r in range(W)]
                out = dmp(batches[rank])
                whole = _concat(batches)
                want = ref(whole)
                start = sum(2 + r for r in range(rank))
                if pooled:
                    assert out.keys() == want.keys() == ["f1@t1", "f2", "f1@t2", "f3"]
                    torch.testing.assert_close(out.values(), want.values()[start : start + 2 + rank], atol=1e-5,
                                               rtol=0, msg=f"{kind} step {step}")
                    out.values().sum().backward()
                    want.values().sum().backward()
                else:
                    assert list(out) == list(want) == ["f1@t1", "f2", "f1@t2", "f3"]
                    loss, ref_loss = 0.0, 0.0
                    for name in want:
                        ids = [int(s.sum()) for s in want[name].lengths().split([2 + r for r in range(W)])]
                        mine = want[name].values().split(ids)[rank]
                        torch.testing.assert_close(out[name].values(), mine, atol=1e-5, rtol=0,
                                                   msg=f"{kind} seq {name} step {step}")
                        loss = loss + out[name].values().sum()
                        ref_loss = ref_loss + want[name].values().sum()
                    loss.backward()
                    ref_loss.backward()
            _same_pieces(dmp, ref, f"{kind} {'bags' if pooled else 'sequence'} after training")
            done.append((kind, pooled))
    return done


def _same_pieces(dmp, ref, what):
    state = dmp.state_dict()
    for key, full in ref.state_dict().items():
        value = state[key]
        pieces = value.local_shards if isinstance(value, ShardedTensor) else [(None, value)]
        for meta, piece in pieces:
            (r, c), (nr, nc) = (meta.shard_offsets, meta.shard_sizes) if meta is not None else ((0, 0), full.shape)
            torch.testing.assert_close(piece, full[r : r + nr, c : c + nc], atol=1e-5, rtol=0, msg=f"{what} {key}")


def _concat(batches):
    keys = batches[0].keys()
    per = [b.to_dict() for b in batches]
    return KeyedJaggedTensor.from_lengths_sync(
        keys, torch.cat([d[k].values() for k in keys for d in per]),
        torch.cat([d[k].lengths() for k in keys for d in per]))


@pytest.mark.parametrize("meta", [False, True])
def test_sharded_collections_serve_a_shared_feature_as_unsharded(meta):
    """DistributedModelParallel over a collection where one feature feeds two tables of different dims: each plan
    (table-, row-, column-wise) gives the unsharded outputs and trains the same rows; built under
    `with torch.device("meta")` it shards straight from meta."""
    done = run_ranks(_shared_sharded_worker, 2, meta, timeout=120)
    assert len(done[0]) == 2 * len(SHARED_PLANS)


# -- a dense optimizer over model.parameters() beside fused tables -------------------------------------------------


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(_bags(), optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.5))
        self.dense = nn.Linear(16, 1)

    def forward(self, kjt):
        return self.dense(self.ebc(kjt).values())


def _train(model, optimizer, steps=4):
    for step in range(steps):
        optimizer.zero_grad()
        model(_kjt(seed=step)).pow(2).sum().backward()
        optimizer.step()


def test_a_dense_optimizer_over_every_parameter_leaves_the_fused_tables_out(caplog):
    """TorchRec's examples write Adagrad(model.parameters()) beside fused tables (whose weights get no gradient, so
    torch.optim skips them); CombinedOptimizer refused it. Now the tables leave the dense groups (one info line),
    the dense layers train exactly as with the dense parameters alone, and the tables get their fused update once."""
    torch.manual_seed(0)
    model, ref = _Model(), _Model()
    ref.load_state_dict(model.state_dict())
    with caplog.at_level(logging.INFO):
        optimizer = combined_optimizer(model, torch.optim.Adagrad(model.parameters(), lr=0.1))
    said = [r.getMessage() for r in caplog.records if "fused table weights" in r.getMessage()]
    assert len(said) == 1 and "'dense' holds fused table weights (ebc.fused0: t1, ebc.fused0: t2): left out" in said[0]
    dense = dict(optimizer.optimizers)["dense"]
    tables = {id(p) for p in model.ebc.parameters()}
    assert not any(id(p) in tables for g in dense.param_groups for p in g["params"])
    assert len(dense.state) == 2  # Adagrad's sums: the dense weight and bias only
    reference = CombinedOptimizer([("fused", FusedOptimizer(ref)),
                                   ("dense", torch.optim.Adagrad(ref.dense.parameters(), lr=0.1))])
    _train(model, optimizer)
    _train(ref, reference)
    for (name, p), (_, q) in zip(model.state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)
    # a group of new layers mixed with table weights (BaseFinetuning over a whole module): the layers join
    extra = nn.Linear(2, 1)
    optimizer.add_param_group({"params": list(extra.parameters()) + list(model.ebc.parameters()), "lr": 0.5})
    assert [len(g["params"]) for g in dense.param_groups] == [2, 2]


def test_torchscript_is_refused_in_one_line():
    """torch.jit.script(ebc) failed deep in TorchScript's parser ("Only a single generator is currently supported")."""
    model = _Model()
    with pytest.raises(RuntimeError,
                       match=r"torch.jit.script: lightning_rec's EmbeddingBagCollection does not support TorchScript"):
        torch.jit.script(model)
    with pytest.raises(RuntimeError, match=r"EmbeddingCollection does not support TorchScript"):
        torch.jit.script(EmbeddingCollection(_seqs()))


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.scale


def _whole_model_on_meta_worker(rank, W):
    torch.manual_seed(rank)  # the ranks' own draws differ: the dense layers agree through DDP
    with torch.device("meta"):
        model = _Model()
    dmp = DistributedModelParallel(model, device="cpu", timeout=30)
    assert not any(p.is_meta for p in dmp.parameters())
    dmp(_kjt(seed=rank)).sum().backward()
    gm = torch.fx.symbolic_trace(dmp.module)  # torch's own: the sharded collection is one call in the graph
    assert "collection_call(" in gm.code
    with torch.no_grad():
        torch.testing.assert_close(gm(_kjt(seed=rank)), dmp.module(_kjt(seed=rank)), atol=0, rtol=0)
    with torch.device("meta"):
        odd = nn.ModuleDict({"ebc": EmbeddingBagCollection(_bags(), optimizer=SGD), "scale": _Scale()})
    error = None
    try:
        DistributedModelParallel(odd, device="cpu", timeout=30)
    except ValueError as e:
        error = str(e)
    return dmp.module.dense.weight.detach().clone(), error


def test_a_model_built_on_meta_shards_straight_from_meta():
    """TorchRec's way: the whole model built under `with torch.device("meta")`, then DistributedModelParallel. The
    tables are drawn where their shards live; the dense layers stayed on meta ("Cannot copy out of meta tensor, use
    to_empty"): now drawn by their reset_parameters() (TorchRec's init_parameters), and one without is named. torch's
    own torch.fx.symbolic_trace of the sharded model gives its outputs."""
    (w0, error), (w1, _) = run_ranks(_whole_model_on_meta_worker, 2, timeout=90)
    torch.testing.assert_close(w0, w1, atol=0, rtol=0)
    assert w0.abs().sum() > 0
    assert "'scale' (_Scale) has parameters on 'meta' and no reset_parameters()" in error
