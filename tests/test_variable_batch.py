"""Variable batch per feature (TorchRec's VBE): request-level features with one row per request beside candidate rows,
`stride_per_key_per_rank` giving each key its bag count and `inverse_indices` each candidate's bag.

Parity is against the unsharded EmbeddingBagCollection fed the same batch expanded (every candidate given its
request's bags: a few-line reference below), forward outputs and table weights after fused updates, ATOL = 1e-5
(fp32; the expanded batch repeats request rows, so the kernels sum their gradients in another order). Sharded: 2
ranks (gloo), table-wise, row-wise and column-wise (plus a data-parallel table), through shared memory and through
gloo, with uneven batches per rank and a step where one rank's batch is an ordinary one.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from dist_utils import expect_error, run_ranks

from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from lightning_rec.model_parallel import (
    DistributedModelParallel,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from lightning_rec.optim import FusedOptimizerConfig, gather_fused_gradients
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.types import ShardingPlan

ATOL = 1e-5
STEPS = 3
KEYS = ["c0", "u0", "u1", "u2"]  # input order differs from the collection's
USER = {"u0", "u1", "u2"}
ROWS = {"tu": 13, "tc": 11, "tx": 7}
DIMS = {"tu": 8, "tc": 4, "tx": 6}
FEATURES = {"tu": ["u0", "u1"], "tc": ["c0"], "tx": ["u2"]}
ROWS_OF = {"u0": 13, "u1": 13, "c0": 11, "u2": 7}


def _tables(pooling: str = "sum") -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=t, num_embeddings=ROWS[t], embedding_dim=DIMS[t], feature_names=FEATURES[t],
                               pooling=pooling) for t in ROWS]


def vbe_batch(seed: int, requests: int, candidates: int, weighted: bool = False) -> KeyedJaggedTensor:
    """`requests` user rows, `candidates` candidate rows, each candidate reading one request's user bags."""
    g = torch.Generator().manual_seed(seed)
    strides = [candidates if k not in USER else requests for k in KEYS]
    lengths = torch.cat([torch.randint(0, 4, (s,), generator=g) for s in strides])
    values = torch.cat([torch.randint(0, ROWS_OF[k], (int(n),), generator=g)
                        for k, n in zip(KEYS, torch.stack([b.sum() for b in lengths.split(strides)]))])
    request_of = torch.randint(0, requests, (candidates,), generator=g)
    inverse = torch.stack([request_of if k in USER else torch.arange(candidates) for k in KEYS])
    # learned weights (a leaf that trains): their gradient comes back through the weights' all-to-all
    weights = torch.rand(values.numel(), generator=g).requires_grad_() if weighted else None
    return KeyedJaggedTensor(KEYS, values, weights, lengths=lengths, stride_per_key_per_rank=[[s] for s in strides],
                             inverse_indices=(KEYS, inverse))


def expanded(kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """The reference: each batch's candidates given their bags (inverse_indices applied to the ids), batches one
    after another."""
    lengths, values, weights = [], [], []
    for k in KEYS:
        for kjt in kjts:
            jt = kjt[k]
            bags_l, bags_v = jt.lengths(), list(torch.split(jt.values(), jt.lengths().tolist()))
            bags_w = list(torch.split(jt.weights(), jt.lengths().tolist())) if kjt.weights_or_none() is not None \
                else None
            inverse = kjt.inverse_indices_or_none()
            rows = inverse[1][inverse[0].index(k)].tolist() if inverse is not None else range(bags_l.numel())
            lengths.append(bags_l[list(rows)])
            values += [bags_v[i] for i in rows]
            weights += [bags_w[i] for i in rows] if bags_w is not None else []
    return KeyedJaggedTensor.from_lengths_sync(KEYS, torch.cat(values), torch.cat(lengths),
                                               weights=torch.cat(weights) if weights else None)


def _pair(pooling: str, weighted: bool, opt: str):
    torch.manual_seed(0)
    config = FusedOptimizerConfig(opt, lr=0.1)
    ebc = EmbeddingBagCollection(_tables(pooling), is_weighted=weighted, optimizer=config)
    reference = EmbeddingBagCollection(_tables(pooling), is_weighted=weighted, optimizer=config)
    reference.load_state_dict(ebc.state_dict())
    return ebc, reference


@pytest.mark.parametrize("pooling,weighted,opt", [("sum", False, "rowwise_adagrad"), ("mean", True, "sgd")])
def test_unsharded_collection_looks_request_rows_up_once_and_expands_them(pooling, weighted, opt):
    ebc, reference = _pair(pooling, weighted, opt)
    for step in range(STEPS):
        kjt, twin = (vbe_batch(step, requests=3, candidates=7, weighted=weighted) for _ in range(2))
        out, ref = ebc(kjt), reference(expanded([twin]))
        assert out.keys() == ref.keys() == ["u0", "u1", "c0", "u2"]
        torch.testing.assert_close(out.values(), ref.values(), atol=ATOL, rtol=0)
        grad = torch.randn(ref.values().shape, generator=torch.Generator().manual_seed(step))
        (out.values() * grad).sum().backward()
        (ref.values() * grad).sum().backward()
        if weighted:
            torch.testing.assert_close(kjt.weights().grad, twin.weights().grad, atol=ATOL, rtol=0)
    for key, w in reference.state_dict().items():
        torch.testing.assert_close(ebc.state_dict()[key], w, atol=ATOL, rtol=0, msg=key)


@pytest.mark.parametrize("pooling,weighted,opt", [("sum", False, "rowwise_adagrad"), ("mean", True, "adam")])
def test_variable_batches_accumulate_as_one_step_on_all_of_them(pooling, weighted, opt):
    """Gradient accumulation (gather_fused_gradients): STEPS variable batches gathered, then one update, as one step
    on their expanded concatenation."""
    ebc, reference = _pair(pooling, weighted, opt)
    kjts = [vbe_batch(step, requests=3, candidates=7, weighted=weighted) for step in range(STEPS)]
    ref = reference(expanded(kjts)).values()
    grads = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9))
    (ref * grads).sum().backward()
    for step, (kjt, grad) in enumerate(zip(kjts, grads.split(7))):
        with gather_fused_gradients(ebc) if step < STEPS - 1 else contextlib.nullcontext():
            (ebc(kjt).values() * grad).sum().backward()
    for key, w in reference.state_dict().items():
        torch.testing.assert_close(ebc.state_dict()[key], w, atol=ATOL, rtol=0, msg=key)


def test_variable_batch_kjt_reads_as_torchrecs():
    kjt = vbe_batch(0, requests=2, candidates=5)
    assert kjt.variable_stride_per_key() and kjt.stride() == 5 and kjt.stride_per_key() == [5, 2, 2, 2]
    assert kjt.stride_per_key_per_rank() == [[5], [2], [2], [2]]
    assert kjt["u1"].lengths().numel() == 2 and sum(kjt.length_per_key()) == kjt.values().numel()
    moved = kjt.permute([1, 0, 2, 3])
    assert moved.stride_per_key() == [2, 5, 2, 2] and torch.equal(moved["c0"].values(), kjt["c0"].values())
    assert torch.equal(moved["u0"].values(), kjt["u0"].values())
    assert [p.stride_per_key() for p in kjt.split([1, 3])] == [[5], [2, 2, 2]]
    assert KeyedJaggedTensor.concat(kjt.split([2, 2])).stride_per_key() == [5, 2, 2, 2]
    # several ranks' bags per key (a KJT after TorchRec's input dist): a key's bags are its ranks' one after another
    two = KeyedJaggedTensor(["a", "b"], torch.arange(4), lengths=torch.tensor([1, 1, 0, 1, 1]),
                            stride_per_key_per_rank=[[1, 1], [2, 1]]).validate()
    assert two.stride_per_key() == [2, 3] and two.length_per_key() == [2, 2]


def test_a_variable_batch_flattens_with_its_strides_and_inverse_indices_and_exports():
    """pytree (torch.export, DDP's output flattening) dropped a variable batch's bag counts and inverse_indices: the
    KJT unflattened as an ordinary batch. Now they ride along (the counts in the spec, the indices as a leaf), in
    TorchRec's six children, and torch.export of a collection reading a variable batch matches eager."""
    from torch.fx._pytree import tree_flatten_spec
    from torch.utils import _pytree as pytree

    kjt = vbe_batch(0, requests=2, candidates=5)
    leaves, spec = pytree.tree_flatten(kjt)
    assert spec.num_children == 6 and leaves[-1] is kjt.inverse_indices()[1]
    assert all(a is b for a, b in zip(tree_flatten_spec(kjt, spec), leaves, strict=True))  # torch.fx's flattening
    for back in (pytree.tree_unflatten(leaves, spec),
                 pytree.tree_unflatten(leaves, pytree.treespec_loads(pytree.treespec_dumps(spec)))):
        assert back.stride_per_key_per_rank() == kjt.stride_per_key_per_rank() and back.stride() == 5
        assert back.inverse_indices()[0] == KEYS and back.inverse_indices()[1] is kjt.inverse_indices()[1]
    ebc, _ = _pair("sum", False, "sgd")
    auto = {0: torch.export.Dim.AUTO}
    with torch.no_grad():
        program = torch.export.export(ebc, (kjt,), dynamic_shapes={"features": [auto, None, None, None, None, None]})
        for batch in (kjt, vbe_batch(1, requests=2, candidates=5)):  # same bag counts, other ids and requests
            torch.testing.assert_close(program.module()(batch).values(), ebc(batch).values(), atol=0, rtol=0)


def test_a_variable_batch_whose_strides_disagree_with_its_lengths_is_named_where_the_collection_reads_it():
    ebc, _ = _pair("sum", False, "sgd")
    good = vbe_batch(0, requests=2, candidates=5)
    bad = KeyedJaggedTensor(KEYS, good.values(), lengths=good.lengths(),
                            stride_per_key_per_rank=[[5], [2], [2], [3]], inverse_indices=good.inverse_indices())
    with pytest.raises(ValueError, match=r"stride_per_key_per_rank \[\[5\], \[2\], \[2\], \[3\]\] gives 12 bags .* "
                                         r"there are 11 lengths"):
        ebc(bad)
    outside = KeyedJaggedTensor(KEYS, good.values(), lengths=good.lengths(),
                                stride_per_key_per_rank=good.stride_per_key_per_rank(),
                                inverse_indices=(KEYS, torch.full((4, 5), 4)))
    with pytest.raises(ValueError, match="inverse_indices must be bag positions in 0..1 .*'u0' has 2 bags"):
        ebc(outside)
    unexpanded = KeyedJaggedTensor(KEYS, good.values(), lengths=good.lengths(),
                                   stride_per_key_per_rank=good.stride_per_key_per_rank())
    with pytest.raises(ValueError, match="variable batch .* without inverse_indices"):
        ebc(unexpanded)
    ec = EmbeddingCollection([EmbeddingConfig(name="t", num_embeddings=13, embedding_dim=4,
                                              feature_names=["u0", "u1"])])
    with pytest.raises(ValueError, match="expand pooled outputs only"):
        ec(unexpanded)


PLANS = {
    "table_wise": {"tu": table_wise(rank=1), "tc": table_wise(rank=0), "tx": table_wise(rank=1)},
    "row_wise": {"tu": row_wise(), "tc": row_wise(), "tx": row_wise()},
    "column_wise": {"tu": column_wise(ranks=[0, 1]), "tc": table_wise(rank=0), "tx": column_wise(ranks=[1, 0])},
    "mixed": {"tu": row_wise(), "tc": data_parallel(), "tx": column_wise(ranks=[1, 1])},
    "one_rank": {"tu": column_wise(ranks=[0, 0]), "tc": data_parallel(), "tx": row_wise()},
}
CASES = [("table_wise", "sum", False, "rowwise_adagrad"), ("row_wise", "mean", True, "adagrad"),
         ("column_wise", "sum", True, "sgd"), ("mixed", "mean", False, "adagrad")]


def _rank_batch(rank: int, step: int, weighted: bool) -> KeyedJaggedTensor:
    kjt = vbe_batch(100 * step + rank, requests=2 + rank, candidates=5 + 3 * rank, weighted=weighted)
    # step 1: rank 1's batch is an ordinary one (the same samples, expanded); rank 0's stays variable
    return expanded([kjt]) if step == 1 and rank == 1 else kjt


def _sharded_case(rank, W, kind, pooling, weighted, opt, shared_memory):
    ebc, reference = _pair(pooling, weighted, opt)
    model = torch.nn.ModuleDict({"ebc": ebc})
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(ebc, PLANS[kind], world_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30, shared_memory=shared_memory)
    what = f"{kind}/{pooling}/{'weighted' if weighted else 'unweighted'}/{opt} shm={shared_memory}"
    for step in range(STEPS):
        batches, twins = ([_rank_batch(r, step, weighted) for r in range(W)] for _ in range(2))
        out = dmp.module["ebc"](batches[rank]).values()
        ref = reference(expanded(twins)).values()
        sizes = [5 + 3 * r for r in range(W)]
        torch.testing.assert_close(out, ref.split(sizes)[rank], atol=ATOL, rtol=0, msg=f"{what} step {step}")
        grads = torch.randn(ref.shape, generator=torch.Generator().manual_seed(step))
        (out * grads.split(sizes)[rank]).sum().backward()
        (ref * grads).sum().backward()
        if weighted:
            torch.testing.assert_close(batches[rank].weights().grad, twins[rank].weights().grad, atol=ATOL, rtol=0,
                                       msg=f"{what} step {step} weights")
    _assert_tables_equal(dmp, reference, what)
    return what


def _assert_tables_equal(dmp, reference, what: str) -> None:
    """This rank's pieces of every table equal the unsharded reference's rows and columns there."""
    state = dmp.state_dict()
    for key, full in reference.state_dict().items():
        value = state[f"ebc.{key}"]
        pieces = [(m.shard_offsets, p) for m, p in value.local_shards] if hasattr(value, "local_shards") else \
            [((0, 0), value)]
        for (r, c), piece in pieces:
            torch.testing.assert_close(piece, full[r : r + piece.shape[0], c : c + piece.shape[1]], atol=ATOL,
                                       rtol=0, msg=f"{what} {key}")


def _accumulated_case(rank, W, kind, pooling, opt):
    """STEPS variable batches per rank under dmp.no_sync() but the last: one update, as one step on all of them."""
    ebc, reference = _pair(pooling, False, opt)
    model = torch.nn.ModuleDict({"ebc": ebc})
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(ebc, PLANS[kind], world_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)
    sizes = [5 + 3 * r for r in range(W)]
    batches = [[_rank_batch(r, step, False) for r in range(W)] for step in range(STEPS)]
    ref = reference(expanded([b for step in batches for b in step])).values()
    grads = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    (ref * grads).sum().backward()
    for step, grad in enumerate(grads.split(sum(sizes))):
        with dmp.no_sync() if step < STEPS - 1 else contextlib.nullcontext():
            (dmp.module["ebc"](batches[step][rank]).values() * grad.split(sizes)[rank]).sum().backward()
    _assert_tables_equal(dmp, reference, f"accumulated {kind}")
    return f"accumulated {kind}"


def _sharded_worker(rank, W, shared_memory):
    cases = CASES if W > 1 else [("one_rank", "mean", True, "adagrad")]
    done = [_sharded_case(rank, W, *case, shared_memory) for case in cases]
    if W > 1 and shared_memory is None:  # accumulation: the gathered rows of every sharding, one update
        done += [_accumulated_case(rank, W, "mixed", "sum", "adagrad"),  # (column blocks keep row-wise state apart)
                 _accumulated_case(rank, W, "column_wise", "mean", "adam")]
    return done


@pytest.mark.parametrize("world_size,shared_memory", [(2, None), (2, False), (1, None)])
def test_sharded_collections_send_request_rows_once_and_expand_after_the_output_all_to_all(world_size,
                                                                                          shared_memory):
    done = run_ranks(_sharded_worker, world_size, shared_memory, timeout=120)
    assert len(done[0]) == (len(CASES) + 2 * (shared_memory is None) if world_size > 1 else 1)


def _bad_worker(rank, W):
    ebc, _ = _pair("sum", False, "sgd")
    model = torch.nn.ModuleDict({"ebc": ebc})
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(ebc, PLANS["table_wise"], world_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)
    good = vbe_batch(rank, requests=2, candidates=5)
    # rank 1's strides disagree with its lengths: it names them, rank 0 stops with it (nothing sent or updated)
    strides = [[5], [2], [2], [3]] if rank == 1 else good.stride_per_key_per_rank()
    bad = KeyedJaggedTensor(KEYS, good.values(), lengths=good.lengths(), stride_per_key_per_rank=strides,
                            inverse_indices=good.inverse_indices())
    words = ("gives 12 bags", "11 lengths") if rank == 1 else ("rank(s) [1] rejected their batch",)
    message = expect_error(ValueError, lambda: dmp.module["ebc"](bad), *words)
    dmp.module["ebc"](good)  # both ranks go on with the next batch
    return message


def test_a_sharded_collection_names_a_variable_batch_whose_strides_disagree_with_its_lengths_on_every_rank():
    messages = run_ranks(_bad_worker, 2, timeout=60)
    assert "stride_per_key_per_rank" in messages[1]


class _Ranker(torch.nn.Module):
    """model(batch) -> (loss, logits), as TrainPipelineSparseDist expects."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(_tables(), optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.1))
        self.dense = torch.nn.Linear(sum(DIMS[t] * len(FEATURES[t]) for t in ROWS), 1)

    def forward(self, batch: dict):
        logits = self.dense(self.ebc(batch["features"]).values()).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["labels"], reduction="sum"), logits


def _pipeline_worker(rank, W):
    from lightning_rec.optim import CombinedOptimizer
    from lightning_rec.pipeline import TrainPipelineSparseDist

    def batches():
        for step in range(4):
            kjt = vbe_batch(100 * step + rank, requests=2 + rank, candidates=5 + 3 * rank)
            yield {"features": kjt, "labels": torch.rand(5 + 3 * rank, generator=torch.Generator().manual_seed(step))}

    runs = []
    for piped in (False, True):
        torch.manual_seed(0)
        model = _Ranker()
        plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, PLANS["row_wise"], world_size=W)})
        dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)
        opt = CombinedOptimizer([("fused", dmp.fused_optimizer),
                                 ("dense", torch.optim.SGD([p for p in dmp.parameters() if p.requires_grad], lr=0.1))])
        logits = []
        if piped:
            pipeline = TrainPipelineSparseDist(dmp, opt, "cpu")
            it = iter(batches())
            for _ in range(4):
                logits.append(pipeline.progress(it).detach())
            assert pipeline.stats["routed_ahead"] == 3, pipeline.stats
            pipeline.close()
        else:
            for batch in batches():
                opt.zero_grad()
                loss, out = dmp(batch)
                loss.backward()
                opt.step()
                logits.append(out.detach())
        runs.append(logits)
    return all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_pipeline_routes_variable_batches_ahead_as_the_plain_loop_does():
    assert run_ranks(_pipeline_worker, 2, timeout=120) == [True, True]
