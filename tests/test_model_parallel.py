"""DistributedModelParallel against the unsharded collection, on 2 and 4 CPU ranks (gloo).

Parity: every rank builds the unsharded module with the same weights and trains it on the
concatenated global batch with loss = sum of the per-rank losses; the sharded module sees only
its own samples. Fused tables get the sum of every rank's gradient, exactly the reference's; DDP
averages the dense gradient, so the dense reference gradient is divided by the world size.
Tolerance ATOL = 1e-5: fp32, but row shards add partial sums in another order and the kernels
aggregate duplicate ids before updating. Column splits are trained with (element-wise) adagrad /
sgd: row-wise adagrad keeps one accumulator per row of each column block, so a column-split table
differs from the unsharded one by design (as in TorchRec).

Uneven shapes in every case: rows not divisible by the world size (5, 7, 11 rows; one empty row
shard at 4 ranks), batch sizes 3 + rank, and one feature with no ids at all on rank 1.
"""

from __future__ import annotations

import io
import os
import time

import pytest
import torch
from dist_utils import expect_error, run_ranks
from torch import nn

from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from lightning_rec.model_parallel import (
    DistributedModelParallel,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
    validate_module_plan,
)
from lightning_rec.optim import FusedOptimizerConfig
from lightning_rec.sharding.sharded_tensor import ShardedTensor
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.types import ComputeKernel, ParameterSharding, ShardingPlan, ShardingType, ShardMetadata

ATOL = 1e-5
STEPS = 5
KEYS = ["f0", "f1", "f2", "f3"]
ROWS = {"t0": 11, "t1": 7, "t2": 5}
DIMS = {"t0": 8, "t1": 4, "t2": 6}
SEQ_DIMS = {"t0": 8, "t1": 4, "t2": 6}  # 6: fbgemm pads it to 8 inside the kernel (column blocks of 3, too)
FEATURES = {"t0": ["f0", "f1"], "t1": ["f2"], "t2": ["f3"]}
ROWS_F = [11, 11, 7, 5]


def _tables(pooling: str | None):
    if pooling is None:  # sequence tables run on fbgemm
        return [EmbeddingConfig(name=t, num_embeddings=ROWS[t], embedding_dim=SEQ_DIMS[t], feature_names=FEATURES[t])
                for t in ROWS]
    return [EmbeddingBagConfig(name=t, num_embeddings=ROWS[t], embedding_dim=DIMS[t], feature_names=FEATURES[t],
                               pooling=pooling) for t in ROWS]


def _batch(rank: int, step: int, weighted: bool) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    B = 3 + rank
    lengths = torch.randint(0, 4, (len(KEYS) * B,), generator=g)
    if rank == 1:
        lengths[3 * B :] = 0  # f3 has no ids on rank 1
    values = torch.cat([torch.randint(0, n, (int(lengths[f * B : (f + 1) * B].sum()),), generator=g)
                        for f, n in enumerate(ROWS_F)])
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths, weights=weights)


def _global_batch(world_size: int, step: int, weighted: bool) -> KeyedJaggedTensor:
    per_rank = [_batch(r, step, weighted).to_dict() for r in range(world_size)]
    lengths, values, weights = [], [], []
    for k in KEYS:
        lengths += [d[k].lengths() for d in per_rank]
        values += [d[k].values() for d in per_rank]
        if weighted:
            weights += [d[k].weights() for d in per_rank]
    return KeyedJaggedTensor.from_lengths_sync(KEYS, torch.cat(values), torch.cat(lengths),
                                               weights=torch.cat(weights) if weighted else None)


class PooledModel(nn.Module):
    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc
        self.dense = nn.Linear(sum(DIMS[t] * len(FEATURES[t]) for t in ROWS), 3)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.ebc(kjt).values())


def _plan(kind: str, world_size: int, local_world_size: int, sequence: bool = False) -> dict:
    W, hosts = world_size, world_size // local_world_size
    last = W - 1
    if sequence:
        return {
            "table_wise": {"t0": table_wise(rank=last), "t1": table_wise(rank=0), "t2": table_wise(rank=1 % W)},
            "row_wise": {"t0": row_wise(), "t1": row_wise(), "t2": row_wise()},
            "column_wise": {"t0": column_wise(ranks=[last, 0]), "t1": table_wise(rank=0),
                            "t2": column_wise(ranks=[0, 0])},
            "data_parallel": {"t0": data_parallel(), "t1": data_parallel(), "t2": data_parallel()},
            "mixed": {"t0": row_wise(), "t1": data_parallel(), "t2": column_wise(ranks=[last, 0])},
        }[kind]
    plans = {
        "table_wise": {"t0": table_wise(rank=last), "t1": table_wise(rank=0), "t2": table_wise(rank=1 % W)},
        "row_wise": {"t0": row_wise(), "t1": row_wise(), "t2": row_wise()},
        "column_wise": {"t0": column_wise(ranks=list(range(W))),
                        "t1": column_wise(ranks=[1 % W, 0], size_per_rank=[1, 3]),
                        "t2": column_wise(ranks=[0, 0])},
        "table_row_wise": {"t0": table_row_wise(host_index=hosts - 1), "t1": table_row_wise(host_index=0),
                           "t2": table_wise(rank=0)},
        "table_column_wise": {"t0": table_column_wise(host_index=hosts - 1), "t1": table_column_wise(host_index=0),
                              "t2": table_wise(rank=last)},
        "grid_shard": {"t0": grid_shard(host_indexes=list(range(hosts))), "t1": grid_shard(host_indexes=[hosts - 1]),
                       "t2": row_wise()},
        "data_parallel": {"t0": data_parallel(), "t1": data_parallel(), "t2": data_parallel()},
        "mixed": {"t0": row_wise(), "t1": data_parallel(), "t2": column_wise(ranks=[last, 0])},
    }
    return plans[kind]


POOLED_CASES = [
    # (plan kind, pooling, weighted, fused optimizer)
    ("table_wise", "sum", False, "rowwise_adagrad"), ("table_wise", "mean", True, "adagrad"),
    ("row_wise", "sum", False, "rowwise_adagrad"), ("row_wise", "mean", True, "adagrad"),
    ("column_wise", "sum", False, "adagrad"), ("column_wise", "mean", True, "sgd"),
    ("table_row_wise", "sum", True, "rowwise_adagrad"), ("table_row_wise", "mean", False, "adagrad"),
    ("table_column_wise", "sum", False, "adagrad"), ("table_column_wise", "mean", True, "sgd"),
    ("grid_shard", "sum", False, "adagrad"), ("grid_shard", "mean", True, "sgd"),
    ("data_parallel", "sum", False, "rowwise_adagrad"), ("data_parallel", "mean", True, "adagrad"),
    ("mixed", "sum", True, "adagrad"), ("mixed", "mean", False, "sgd"),
]
SEQUENCE_CASES = [("table_wise", "adagrad"), ("row_wise", "sgd"), ("column_wise", "adagrad"),
                  ("data_parallel", "rowwise_adagrad"), ("mixed", "adagrad")]


def _check_pieces(dmp, reference: nn.Module, attr: str, what: str) -> None:
    ref = {k: v for k, v in reference.state_dict().items() if ".weight" in k and attr in k}
    state = dmp.state_dict()
    for key, full in ref.items():
        value = state[key]
        if isinstance(value, ShardedTensor):
            assert tuple(value.global_shape) == tuple(full.shape)
            for meta, piece in value.local_shards:
                (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
                torch.testing.assert_close(piece, full[r : r + nr, c : c + nc], atol=ATOL, rtol=0,
                                           msg=f"{what} {key} {meta}")
        else:
            torch.testing.assert_close(value, full, atol=ATOL, rtol=0, msg=f"{what} {key}")


def _pooled_case(rank, W, lws, kind, pooling, weighted, opt, device="cpu", shared_memory=None):
    torch.manual_seed(0)
    config = FusedOptimizerConfig(opt, lr=0.1)
    model = PooledModel(EmbeddingBagCollection(_tables(pooling), is_weighted=weighted, optimizer=config, device=device))
    reference = PooledModel(EmbeddingBagCollection(_tables(pooling), is_weighted=weighted, optimizer=config,
                                                   device=device)).to(device)
    reference.load_state_dict(model.state_dict())
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, _plan(kind, W, lws), local_size=lws,
                                                               world_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device=device, timeout=30, shared_memory=shared_memory)
    assert (dmp._transport is None) == (shared_memory is False or device != "cpu" or W == 1)  # one rank: no peers
    what = f"{kind}/{pooling}/{'weighted' if weighted else 'unweighted'}/{opt} W={W} {device} shm={shared_memory}"
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(3 + r, 3, generator=g).to(device) for r in range(W)]
        out = dmp(_batch(rank, step, weighted).to(device))
        ref_out = reference(_global_batch(W, step, weighted).to(device))
        start = sum(3 + r for r in range(rank))
        torch.testing.assert_close(out, ref_out[start : start + 3 + rank], atol=ATOL, rtol=0,
                                   msg=f"{what} step {step} forward")
        (out * grads[rank]).sum().backward()
        (ref_out * torch.cat(grads)).sum().backward()
        for (name, p), (_, q) in zip(dmp.module.dense.named_parameters(), reference.dense.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad / W, atol=ATOL, rtol=0,
                                       msg=f"{what} step {step} dense grad {name}")
            p.grad, q.grad = None, None
    _check_pieces(dmp, reference, "embedding_bags", what)
    return what


def _sequence_case(rank, W, lws, kind, opt, device="cpu", shared_memory=None):
    torch.manual_seed(0)
    config = FusedOptimizerConfig(opt, lr=0.1)
    ec = EmbeddingCollection(_tables(None), optimizer=config, device=device)
    reference = EmbeddingCollection(_tables(None), optimizer=config, device=device)
    reference.load_state_dict(ec.state_dict())
    layout = _plan(kind, W, lws, sequence=True)
    plan = ShardingPlan({"": construct_module_sharding_plan(ec, layout, local_size=lws, world_size=W)})
    dmp = DistributedModelParallel(ec, plan=plan, device=device, timeout=30, shared_memory=shared_memory)
    what = f"sequence {kind}/{opt} W={W} {device} shm={shared_memory}"
    for step in range(STEPS):
        out = dmp(_batch(rank, step, False).to(device))
        ref = reference(_global_batch(W, step, False).to(device))
        loss, ref_loss = 0.0, 0.0
        for f in KEYS:
            lengths = ref[f].lengths()
            bags = [3 + r for r in range(W)]
            ids = [int(n) for n in torch.stack([s.sum() for s in lengths.split(bags)])]
            mine = ref[f].values().split(ids)[rank]
            torch.testing.assert_close(out[f].values(), mine, atol=ATOL, rtol=0,
                                       msg=f"{what} step {step} {f}")
            assert torch.equal(out[f].lengths(), lengths.split(bags)[rank])
            g = torch.Generator().manual_seed(step * 10 + KEYS.index(f))
            grad = torch.randn(ref[f].values().shape, generator=g).to(device)
            loss = loss + (out[f].values() * grad.split(ids)[rank]).sum()
            ref_loss = ref_loss + (ref[f].values() * grad).sum()
        loss.backward()
        ref_loss.backward()
    _check_pieces(dmp, reference, "embeddings", what)
    return what


def _parity_worker(rank, W, lws, device="cpu", shared_memory=None):
    if device == "cuda":
        device = f"cuda:{rank}"
    done = []
    for case in POOLED_CASES:
        done.append(_pooled_case(rank, W, lws, *case, device=device, shared_memory=shared_memory))
    for case in SEQUENCE_CASES:
        done.append(_sequence_case(rank, W, lws, *case, device=device, shared_memory=shared_memory))
    return done


# CPU ranks of one host talk through shared memory by default (shm_transport.py); gloo's own
# path (other hosts, shared_memory=False) gets the same cases; one rank exchanges nothing (no collective at all).
@pytest.mark.parametrize("world_size,local_world_size,shared_memory", [(1, 1, None), (2, 2, None), (4, 2, None),
                                                                       (3, 3, None), (2, 2, False)])
def test_parity_every_sharding_type(world_size, local_world_size, shared_memory):
    done = run_ranks(_parity_worker, world_size, local_world_size, timeout=240,
                     local_world_size=local_world_size, shared_memory=shared_memory)
    assert len(done[0]) == len(POOLED_CASES) + len(SEQUENCE_CASES)


def _one_rank_collectives_worker(rank, W):
    import torch.distributed as dist

    torch.manual_seed(0)
    config = FusedOptimizerConfig("adagrad", lr=0.1)
    model = PooledModel(EmbeddingBagCollection(_tables("sum"), is_weighted=True, optimizer=config))
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, _plan("mixed", 1, 1), local_size=1,
                                                               world_size=1)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)
    calls = []
    for name in ("all_to_all_single", "all_reduce", "all_gather", "broadcast", "barrier"):
        real = getattr(dist, name)
        setattr(dist, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    for step in range(3):
        assert dmp.step_together(True, step)
        dmp(_batch(0, step, True)).sum().backward()
    return calls


def test_one_rank_runs_no_collective_in_a_step():
    """At world size 1 (Trainer(strategy="rec") on one device) the embedding exchanges and the step agreement
    have nobody to talk to: no collective, and on a GPU no host read of their counts (a drained stream each step).
    The dense layers' DDP all-reduce is DDP's (a C++ reducer, not counted here)."""
    assert run_ranks(_one_rank_collectives_worker, 1, timeout=60) == [[]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and fbgemm-gpu (CUDA build)")
def test_parity_every_sharding_type_nccl():
    """The same parity cases on GPUs with NCCL, one rank per visible device (1 on a one-GPU machine)."""
    world_size = torch.cuda.device_count()
    done = run_ranks(_parity_worker, world_size, world_size, "cuda", timeout=600, local_world_size=world_size,
                     backend="nccl")
    assert len(done[0]) == len(POOLED_CASES) + len(SEQUENCE_CASES)


# bad input: the same ValueError on every rank, before any collective (no hang) -------------------


def _expect_error(fn, *words) -> str:
    return expect_error(ValueError, fn, *words)


def _bad_input_worker(rank, W):
    config = FusedOptimizerConfig("sgd", lr=0.1)

    def model():
        torch.manual_seed(0)
        return PooledModel(EmbeddingBagCollection(_tables("sum"), optimizer=config))

    m = model()
    plan = lambda tables: ShardingPlan({"ebc": construct_module_sharding_plan(m.ebc, tables, world_size=W)})  # noqa
    everything_else = {"t1": table_wise(rank=0), "t2": table_wise(rank=0)}
    _expect_error(lambda: plan({"nope": table_wise(rank=0), **everything_else}), "'nope'", "t0")
    _expect_error(lambda: plan({"t0": table_wise(rank=W), **everything_else}), "'t0'", f"rank {W}", "world_size")
    _expect_error(lambda: plan({"t0": column_wise(ranks=[0, 1], size_per_rank=[3, 4]), **everything_else}),
                  "'t0'", "size_per_rank")
    tiny = EmbeddingBagCollection([EmbeddingBagConfig(name="tiny", num_embeddings=1, embedding_dim=4)],
                                  optimizer=config)
    _expect_error(lambda: construct_module_sharding_plan(tiny, {"tiny": row_wise()}, world_size=W),
                  "'tiny'", "table_wise")
    # a hand-written plan that names a missing table / module reaches DMP: it checks before any collective
    bad = ShardingPlan({"ebc": construct_module_sharding_plan(m.ebc, {"t0": table_wise(rank=0), **everything_else},
                                                              world_size=W)})
    bad.plan["ebc"]["ghost"] = bad.plan["ebc"]["t0"]
    _expect_error(lambda: DistributedModelParallel(model(), plan=bad, device="cpu"), "'ghost'")
    _expect_error(lambda: DistributedModelParallel(model(), plan=ShardingPlan({"nowhere": bad.plan["ebc"]}),
                                                   device="cpu"), "'nowhere'")
    # a kernel CPU cannot run, on a table only rank 1 holds: rank 1 alone refused it while building its shard, and
    # rank 0 waited for it in the next collective until the timeout; now every rank refuses it before any collective
    uvm = plan({"t0": table_wise(rank=1, compute_kernel=ComputeKernel.FUSED_UVM), **everything_else})
    _expect_error(lambda: DistributedModelParallel(model(), plan=uvm, device="cpu", timeout=20), "'t0'", "fused_uvm",
                  "compute_kernel 'fused'")

    # a batch with other keys on rank 1 only: both ranks raise, nobody hangs
    dmp = DistributedModelParallel(model(), plan=plan({"t0": row_wise(), **everything_else}), device="cpu",
                                   timeout=20)
    batch = _batch(rank, 0, False)
    if rank == 1:
        batch = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2", "oops"], batch.values(), batch.lengths())
    start = time.monotonic()
    text = _expect_error(lambda: dmp(batch), "f3" if rank == 1 else "rank(s) [1]")
    assert time.monotonic() - start < 10
    # an out-of-range id on rank 0 only
    batch = _batch(rank, 1, False)
    if rank == 0:
        values = batch.values().clone()
        values[0] = 999
        batch = KeyedJaggedTensor.from_lengths_sync(KEYS, values, batch.lengths())
    _expect_error(lambda: dmp(batch), "999" if rank == 0 else "rank(s) [0]")
    # and the next good batch still works on every rank
    dmp(_batch(rank, 2, False)).sum().backward()
    return text


def test_bad_input_raises_on_every_rank():
    texts = run_ranks(_bad_input_worker, 2, timeout=60)
    assert "oops" in texts[1] or "f3" in texts[1]


def test_hand_written_plans_that_cannot_be_built_are_refused_by_the_checks_every_rank_runs():
    """validate_module_plan runs on every rank before any collective; these were refused (or silently changed)
    only later, on the rank that built the shard, or not at all."""
    config = FusedOptimizerConfig("sgd", lr=0.1)
    ebc = EmbeddingBagCollection(_tables("sum"), optimizer=config)
    good = construct_module_sharding_plan(ebc, {"t0": row_wise(), "t1": table_wise(rank=1), "t2": data_parallel()},
                                          world_size=2)
    validate_module_plan("ebc", ebc, good, 2, torch.device("cpu"))

    def check(table: str, ps: ParameterSharding, *words: str) -> None:
        _expect_error(lambda: validate_module_plan("ebc", ebc, {**good, table: ps}, 2, torch.device("cpu")), *words)

    t1 = good["t1"].shards
    check("t1", ParameterSharding("tablewise", ranks=[1], shards=t1), "'t1'", "'tablewise'", "table_wise")
    check("t1", ParameterSharding(ShardingType.TABLE_WISE, "fusedd", ranks=[1], shards=t1), "'t1'", "'fusedd'",
          "fused_uvm_caching")
    # dense on a sharded table trained with the fused optimizer all the same (routing maps it to fused)
    check("t1", ParameterSharding(ShardingType.TABLE_WISE, ComputeKernel.DENSE, ranks=[1], shards=t1), "'t1'",
          "'dense'", "data_parallel")
    check("t1", ParameterSharding(ShardingType.TABLE_WISE, ComputeKernel.FUSED_UVM_CACHING, ranks=[1], shards=t1),
          "'t1'", "GPU unified memory", "compute_kernel 'fused'")
    # a 0-column block "tiled" the dim; the rank holding it failed alone, building a dim-0 table
    rows, dim = ROWS["t0"], DIMS["t0"]
    zero = [ShardMetadata((0, 0), (rows, dim), 0), ShardMetadata((0, dim), (rows, 0), 1)]
    check("t0", ParameterSharding(ShardingType.COLUMN_WISE, ranks=[0, 1], shards=zero), "'t0'", "no columns",
          "size_per_rank")
    # a data-parallel entry with a partial shard printed as if that were what each rank held
    part = [ShardMetadata((0, 0), (2, DIMS["t2"]), 0)]
    check("t2", ParameterSharding(ShardingType.DATA_PARALLEL, ranks=[0, 1], shards=part), "'t2'", "rows 0:2",
          "data_parallel()")



def test_plans_that_build_but_are_mislabelled_are_refused_by_the_checks_every_rank_runs():
    """A table_wise entry with two row shards, or ranks that disagree with the shards' placements, built and
    trained (routing reads only the shards) while print(plan) told another story."""
    ebc = EmbeddingBagCollection(_tables("sum"), optimizer=FusedOptimizerConfig("sgd", lr=0.1))
    good = construct_module_sharding_plan(ebc, {"t0": row_wise(), "t1": column_wise(ranks=[1, 0, 1]),
                                                "t2": data_parallel()}, world_size=2)
    validate_module_plan("ebc", ebc, good, 2, torch.device("cpu"))

    def check(table: str, ps: ParameterSharding, *words: str) -> None:
        _expect_error(lambda: validate_module_plan("ebc", ebc, {**good, table: ps}, 2, torch.device("cpu")), *words)

    rows, cols = good["t0"].shards, good["t1"].shards
    check("t0", ParameterSharding(ShardingType.TABLE_WISE, ranks=[0, 1], shards=rows), "'t0'", "labelled table_wise",
          "label it row_wise")
    check("t1", ParameterSharding(ShardingType.ROW_WISE, ranks=[0, 1], shards=cols), "'t1'", "labelled row_wise",
          "label it column_wise")
    check("t0", ParameterSharding(ShardingType.COLUMN_WISE, ranks=[0, 1], shards=rows), "'t0'", "column blocks of all",
          "label it row_wise")
    check("t0", ParameterSharding(ShardingType.ROW_WISE, ranks=[1], shards=rows), "'t0'", "on ranks [1]",
          "shards sit on ranks [0, 1]")
    check("t2", ParameterSharding(ShardingType.DATA_PARALLEL, ranks=[0]), "'t2'", "on ranks [0]", "[0, 1]")
    validate_module_plan("ebc", ebc, {**good, "t0": ParameterSharding(ShardingType.ROW_WISE, shards=rows)}, 2)


def _fused_refusal_worker(rank, W):
    # built on meta, so that the unsharded collection (which would refuse on every rank) builds no kernel
    tables = [EmbeddingBagConfig(name=t, num_embeddings=10, embedding_dim=16, feature_names=[t]) for t in ("t0", "t1")]
    ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("partial_rowwise_adam", lr=0.1),
                                 kernel="fbgemm", device=torch.device("meta"))
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, {"t0": table_wise(rank=0), "t1": table_wise(rank=0)},
                                                            world_size=W)})
    return _expect_error(lambda: DistributedModelParallel(ebc, plan=plan, device="cpu", timeout=30),
                         "fbgemm's CPU kernel does not implement", "partial_rowwise_adam", "kernel='native'")


def test_a_kernel_refusal_on_the_ranks_holding_tables_is_raised_on_every_rank():
    """kernel='fbgemm' with partial_rowwise_adam on CPU was refused while rank 0 built its kernel; rank 1, which
    holds no table, returned from DistributedModelParallel and waited in its first collective until the timeout."""
    messages = run_ranks(_fused_refusal_worker, 2, timeout=90)
    assert messages[0] == messages[1]


def test_partial_rowwise_adam_blocks_fbgemm_pads_are_refused_for_every_rank():
    """On GPU, FusedKernel refused a partial_rowwise_adam column block of a width fbgemm pads only on the rank
    holding it. validate_module_plan (metadata only: no GPU needed) refuses it on every rank."""
    table = EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=16, feature_names=["f"])
    ebc = EmbeddingBagCollection([table], optimizer=FusedOptimizerConfig("partial_rowwise_adam", lr=0.1),
                                 device=torch.device("meta"))
    cuda = torch.device("cuda")
    odd = construct_module_sharding_plan(ebc, {"t0": column_wise(ranks=[0, 1, 1], size_per_rank=[8, 6, 2])},
                                         world_size=2)
    _expect_error(lambda: validate_module_plan("", ebc, odd, 2, cuda), "'t0': [2, 6]", "partial_rowwise_adam",
                  "multiples of 4")
    validate_module_plan("", ebc, odd, 2, torch.device("cpu"))  # the native CPU kernel takes any width
    even = construct_module_sharding_plan(ebc, {"t0": column_wise(ranks=[0, 1, 1], size_per_rank=[8, 4, 4])},
                                          world_size=2)
    validate_module_plan("", ebc, even, 2, cuda)


def test_a_saved_plan_and_sharded_state_load_with_torch_loads_default_weights_only():
    """torch.save(plan, f); torch.load(f) failed under torch >= 2.6 (weights_only=True by default): 'Unsupported
    global: lightning_rec.types.ShardingPlan', and the module plan (a dict subclass) 'Can only SETITEMS for dict'."""
    ebc = EmbeddingBagCollection(_tables("sum"), optimizer=FusedOptimizerConfig("sgd", lr=0.1))
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(
        ebc, {"t0": row_wise(), "t1": table_wise(rank=1), "t2": data_parallel()}, world_size=2)})
    table = ShardedTensor(global_shape=(4, 2), local_shards=[(ShardMetadata((0, 0), (4, 2), 0), torch.ones(4, 2))])
    buf = io.BytesIO()
    torch.save({"plan": plan, "table": table}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert back["plan"] == plan and type(back["plan"].plan["ebc"]) is type(plan.plan["ebc"])
    assert str(back["plan"]) == str(plan) and torch.equal(back["table"].full(), table.full())


def test_a_saved_plan_for_tables_of_another_size_says_so():
    """A plan saved (or planned) before num_embeddings / embedding_dim changed: a table_wise table's one shard was
    refused as 'row shards do not follow the block rule', a new dim as 'fix size_per_rank', both asking to edit
    shards that were right for the table they were planned for."""
    from lightning_rec.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    names = ("tw", "rw", "cw", "dp")

    def ebc(changed: str | None = None, rows: int = 1000, dim: int = 64) -> EmbeddingBagCollection:
        tables = [EmbeddingBagConfig(name=t, num_embeddings=rows if t == changed else 1000,
                                     embedding_dim=dim if t == changed else 64, feature_names=[t]) for t in names]
        return EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("sgd", lr=0.1),
                                      device=torch.device("meta"))

    constraints = {t: ParameterConstraints(sharding_types=[st]) for t, st in
                   zip(names, ("table_wise", "row_wise", "column_wise", "data_parallel"))}
    planner = EmbeddingShardingPlanner(Topology(world_size=2), constraints=constraints, print_stats=False)
    saved = planner.plan(ebc()).plan[""]
    validate_module_plan("", ebc(), saved, 2)
    for rows, dim in ((3000, 64), (999, 64), (1000, 32)):
        for table in names:
            changed = ebc(table, rows, dim)
            _expect_error(lambda: validate_module_plan("", changed, saved, 2), f"'{table}'",  # noqa: B023 - called now
                          f"is {rows} x {dim}", "1000 x 64", "another size", "plan again")


def test_plan_that_is_not_a_sharding_plan_is_named():
    """A dict of module plans, or one collection's plan, failed with AttributeError: 'dict' object has no
    attribute 'plan' (after the process-group check, so the test needs a group of one)."""
    done = run_ranks(_not_a_plan_worker, 1, timeout=60)
    assert done == [2]


def _not_a_plan_worker(rank, W):
    ebc = EmbeddingBagCollection(_tables("sum"), optimizer=FusedOptimizerConfig("sgd", lr=0.1))
    module_plan = construct_module_sharding_plan(ebc, {t: table_wise(rank=0) for t in ROWS}, world_size=1)
    for plan in ({"": module_plan}, module_plan):
        _expect_error(lambda plan=plan: DistributedModelParallel(ebc, plan=plan, device="cpu"), "takes a ShardingPlan",
                      type(plan).__name__, "ShardingPlan({module_path: construct_module_sharding_plan(")
    return 2


def test_torchrec_sharders_argument_is_explained():
    """DistributedModelParallel(model, sharders=[...]), TorchRec's call, was Python's 'unexpected keyword argument'."""
    ebc = EmbeddingBagCollection(_tables("sum"), optimizer=FusedOptimizerConfig("sgd", lr=0.1))
    expect_error(ValueError, lambda: DistributedModelParallel(ebc, sharders=[object()]), "no sharders are needed",
                 "Drop sharders=", "ParameterConstraints(sharding_types=", "FusedOptimizerConfig(")
    # sharders=None is taken: what stops this one process is the missing process group, named as before
    expect_error(ValueError, lambda: DistributedModelParallel(ebc, sharders=None), "init_process_group")
    # TorchRec's env=ShardingEnv.from_process_group(pg) is pg= here (it was 'unexpected keyword argument')
    expect_error(ValueError, lambda: DistributedModelParallel(ebc, env=object()), "pg=<group>")
    expect_error(ValueError, lambda: DistributedModelParallel(ebc, env=None, init_data_parallel=True),
                 "init_process_group")


def _init_data_parallel_worker(rank, W):
    torch.manual_seed(0)
    model = PooledModel(EmbeddingBagCollection(_tables("sum"), optimizer=FusedOptimizerConfig("sgd", lr=0.1)))
    dmp = DistributedModelParallel(model, device="cpu", timeout=30, init_data_parallel=False)
    before = (type(dmp._dmp_wrapped_module).__name__, dmp.dense)
    dmp.init_data_parallel()
    dmp.init_data_parallel()  # once only, as TorchRec's
    dmp(_batch(rank, 0, False)).sum().backward()
    return before, type(dmp._dmp_wrapped_module).__name__, dmp.dense


def test_torchrec_init_data_parallel_false_then_init_data_parallel():
    """TorchRec's DistributedModelParallel(..., init_data_parallel=False) and dmp.init_data_parallel() later:
    the keyword was 'unexpected'; now it is dense=None, and the method wraps the dense layers in DDP."""
    before, after, dense = run_ranks(_init_data_parallel_worker, 2, timeout=60)[0]
    assert before == ("PooledModel", None) and (after, dense) == ("DistributedDataParallel", "ddp")


def _dead_rank_worker(rank, W):
    torch.manual_seed(0)
    # the collection alone (no DDP, whose own collectives would notice first): the embedding path is tested
    ebc = EmbeddingBagCollection(_tables("sum"), optimizer=FusedOptimizerConfig("sgd", lr=0.1))
    plan = ShardingPlan({"": construct_module_sharding_plan(
        ebc, {"t0": row_wise(), "t1": table_wise(rank=1), "t2": table_wise(rank=0)}, world_size=W)})
    dmp = DistributedModelParallel(ebc, plan=plan, device="cpu", timeout=3)
    dmp(_batch(rank, 0, False)).values().sum().backward()
    if rank == 1:
        os._exit(0)  # dies mid-training, without a word
    start = time.monotonic()
    try:
        dmp(_batch(rank, 1, False)).values().sum().backward()
    except RuntimeError as e:
        assert "rank 1 exited" in str(e), str(e)
        return time.monotonic() - start
    raise AssertionError("the step went through without rank 1")


def test_dead_rank_times_out_with_clear_error():
    seconds = run_ranks(_dead_rank_worker, 2, timeout=60, allow_missing=True)[0]
    assert seconds < 30


class _CountingModel(PooledModel):
    """A dense buffer each rank changes in its own way at every forward (as BatchNorm statistics do)."""

    def __init__(self, ebc):
        super().__init__(ebc)
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, kjt):
        self.seen += 1 + dist_rank()
        return super().forward(kjt)


def dist_rank() -> int:
    return torch.distributed.get_rank()


def _buffer_sync_worker(rank, W, shared_memory):
    torch.manual_seed(0)
    model = _CountingModel(EmbeddingBagCollection(_tables("sum"), optimizer=FusedOptimizerConfig("sgd", lr=0.1)))
    model.seen.fill_(100.0 * rank)  # ranks start apart
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, _plan("table_wise", W, W), world_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30, shared_memory=shared_memory)
    synced = model.seen.item()
    for step in range(2):
        dmp(_batch(rank, step, False)).sum().backward()
    return synced, model.seen.item()


@pytest.mark.parametrize("shared_memory", [False, True], ids=["gloo", "shm"])
def test_dense_buffers_sync_at_construction_not_every_forward(shared_memory):
    """On every torch (2.13: forward_sync_buffers=False; 2.11 / 2.12: broadcast_buffers turned off after
    DDP's construction) buffers start from rank 0's and are not broadcast again before each forward: that
    would cost a collective per step and undo each rank's own updates."""
    (synced0, after0), (synced1, after1) = run_ranks(_buffer_sync_worker, 2, shared_memory, timeout=60)
    assert synced0 == synced1 == 0.0  # rank 0's value, everywhere
    assert (after0, after1) == (2.0, 4.0)  # each rank's own two updates (a forward broadcast gives rank 1 3.0)


class _DetachedModel(PooledModel):
    def forward(self, kjt):  # no embedding exchange in the backward: DDP's all-reduce is its only collective
        return self.dense(self.ebc(kjt).values().detach())


def _dead_rank_in_ddp_worker(rank, W):
    torch.manual_seed(0)
    model = _DetachedModel(EmbeddingBagCollection(_tables("sum"), optimizer=FusedOptimizerConfig("sgd", lr=0.1)))
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, _plan("table_wise", W, W), world_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30, shared_memory=False)
    dmp(_batch(rank, 0, False)).sum().backward()
    out = dmp(_batch(rank, 1, False))
    if rank == 1:
        os._exit(0)  # gone between its forward and its backward
    start = time.monotonic()
    try:
        out.sum().backward()
    except RuntimeError as e:
        assert "DDP gradient all-reduce" in str(e) and "rank(s) [1] exited" in str(e), str(e)
        return time.monotonic() - start
    raise AssertionError("the backward went through without rank 1")


def test_dead_rank_in_ddp_gradient_all_reduce_is_named():
    """gloo alone says "Connection closed by peer" (torch 2.13) or "Read error ... reset by peer" (2.11)."""
    seconds = run_ranks(_dead_rank_in_ddp_worker, 2, timeout=60, allow_missing=True)[0]
    assert seconds < 15


# state dict: global shapes + offsets; loads across layouts and world sizes ------------------------


def _state_worker(rank, W, path, mode):
    config = FusedOptimizerConfig("adagrad", lr=0.1)
    torch.manual_seed(0)
    m = PooledModel(EmbeddingBagCollection(_tables("sum"), optimizer=config))
    torch.manual_seed(1)
    full = {k: torch.randn(v.shape) for k, v in m.state_dict().items() if "embedding_bags" in k}
    layout = {"t0": grid_shard(host_indexes=[0]), "t1": column_wise(ranks=[W - 1, 0]), "t2": data_parallel()}
    if mode == "load":
        layout = {"t0": row_wise(), "t1": table_wise(rank=W - 1), "t2": column_wise(ranks=[0, 1])}
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(m.ebc, layout, world_size=W, local_size=W)})
    dmp = DistributedModelParallel(m, plan=plan, device="cpu", timeout=30)
    if mode == "save":
        dmp.load_state_dict({**{k: v for k, v in dmp.state_dict().items() if "dense" in k}, **full})
        torch.save(dmp.state_dict(), os.path.join(path, f"rank{rank}.pt"))
        # FusedOptimizer sees every piece on this rank, replicas included, under unambiguous names
        names = set(dmp.fused_optimizer.state_dict()["state"])
        assert any(n.startswith("ebc.t1") for n in names) and any(n.startswith("ebc.t2.") for n in names), names
        return sorted(names)
    saved = [torch.load(os.path.join(path, f), weights_only=False) for f in sorted(os.listdir(path))]
    merged = {}
    for key in saved[0]:
        parts = [s[key] for s in saved]
        merged[key] = ShardedTensor.merge(parts) if isinstance(parts[0], ShardedTensor) else parts[0]
    dmp.load_state_dict(merged)
    state = dmp.state_dict()
    for key, value in full.items():
        if isinstance(state[key], ShardedTensor):
            for meta, piece in state[key].local_shards:
                (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
                assert torch.equal(piece, value[r : r + nr, c : c + nc]), key
        else:
            assert torch.equal(state[key], value), key
    # what a single rank saved does not cover another layout: a clear error names the fix
    single = {k: v for k, v in saved[0].items()}
    try:
        dmp.load_state_dict(single)
    except RuntimeError as e:
        assert "ShardedTensor.merge" in str(e)
    return True


def test_state_dict_loads_into_another_world_size(tmp_path):
    names = run_ranks(_state_worker, 2, str(tmp_path), "save", timeout=60)
    assert names[0] != names[1]
    run_ranks(_state_worker, 4, str(tmp_path), "load", timeout=60)


def _fsdp_worker(rank, W):
    torch.manual_seed(0)
    config = FusedOptimizerConfig("sgd", lr=0.1)
    m = PooledModel(EmbeddingBagCollection(_tables("sum"), optimizer=config))
    reference = PooledModel(EmbeddingBagCollection(_tables("sum"), optimizer=config))
    reference.load_state_dict(m.state_dict())
    dmp = DistributedModelParallel(m, device="cpu", dense="fsdp", timeout=30)  # no plan: the planner's
    out = dmp(_batch(rank, 0, False))
    ref = reference(_global_batch(W, 0, False))
    start = sum(3 + r for r in range(rank))
    torch.testing.assert_close(out, ref[start : start + 3 + rank], atol=ATOL, rtol=0)
    out.sum().backward()
    return str(dmp.plan)


def test_fsdp_dense_and_default_plan():
    plans = run_ranks(_fsdp_worker, 2, timeout=60)
    assert plans[0] == plans[1]


# fused optimizer state follows the tables into another world size and plan --------------------------

RESHARD_PLANS = {  # saved at 2 ranks, loaded at 3; column splits only with element-wise state (see top)
    "adagrad": ({"t0": row_wise(), "t1": column_wise(ranks=[1, 0]), "t2": table_wise(rank=0)},
                {"t0": column_wise(ranks=[2, 0, 1]), "t1": row_wise(), "t2": table_wise(rank=1)}),
    "rowwise_adagrad": ({"t0": row_wise(), "t1": table_wise(rank=1), "t2": data_parallel()},
                        {"t0": table_wise(rank=2), "t1": row_wise(), "t2": row_wise()}),
}


def _reshard_reference(opt: str, steps: list[tuple[int, int]]):
    """The unsharded collection trained on the global batches of (world size, step)."""
    from lightning_rec.optim import FusedOptimizer

    torch.manual_seed(0)
    reference = PooledModel(EmbeddingBagCollection(_tables("sum"), optimizer=FusedOptimizerConfig(opt, lr=0.1)))
    for W, step in steps:
        reference(_global_batch(W, step, False)).sum().backward()
    return reference, FusedOptimizer(reference)


def _reshard_worker(rank, W, path, opt, mode):
    import torch.distributed as dist

    from lightning_rec.optim import merge_fused_state

    plan_a, plan_b = RESHARD_PLANS[opt]
    torch.manual_seed(0 if mode == "save" else 7)  # the loading side starts from other weights
    model = PooledModel(EmbeddingBagCollection(_tables("sum"), optimizer=FusedOptimizerConfig(opt, lr=0.1)))
    layout = plan_a if mode == "save" else plan_b
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, layout, world_size=W, local_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30, dense=None)
    if mode == "save":
        for step in range(3):
            dmp(_batch(rank, step, False)).sum().backward()
        pieces = [None] * W
        dist.all_gather_object(pieces, dmp.fused_optimizer.global_state_pieces())
        tables = [None] * W
        dist.all_gather_object(tables, {k: v for k, v in dmp.state_dict().items() if isinstance(v, ShardedTensor)})
        merged_state = merge_fused_state(pieces)
        _, ref_opt = _reshard_reference(opt, [(2, s) for s in range(3)])
        ref_state = ref_opt.state_dict()["state"]
        assert set(merged_state) == set(ref_state), (sorted(merged_state), sorted(ref_state))
        for key, value in ref_state.items():  # the merged state is the unsharded optimizer's
            torch.testing.assert_close(merged_state[key], value, atol=ATOL, rtol=0, msg=key)
        if rank == 0:
            weights = {k: ShardedTensor.merge([t[k] for t in tables]).full() for k in tables[0]}
            plain = {k: v for k, v in dmp.state_dict().items() if not isinstance(v, ShardedTensor)}  # dense, replicas
            torch.save({"model": {**weights, **plain}, "fused": {"state": merged_state}}, path)
        return sorted(merged_state)
    saved = torch.load(path, weights_only=False)
    dmp.load_state_dict(saved["model"])
    dmp.fused_optimizer.load_state_dict(saved["fused"])
    for step in range(3, 5):  # training goes on as if nothing had moved
        dmp(_batch(rank, step, False)).sum().backward()
    reference, ref_opt = _reshard_reference(opt, [(2, s) for s in range(3)] + [(3, s) for s in range(3, 5)])
    _check_pieces(dmp, reference, "embedding_bags", f"resharded {opt}")
    expected = {k: v for k, v in ref_opt.state_dict()["state"].items()}
    checked = 0
    for key, (_, parts) in dmp.fused_optimizer.global_state_pieces().items():
        for meta, t in parts:
            want = expected[key]
            if meta is not None and want.dim() == 2:
                (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
                want = want[r : r + nr, c : c + nc]
            elif meta is not None and want.dim() == 1:
                (r, _), (nr, _) = meta.shard_offsets, meta.shard_sizes
                want = want[r : r + nr]
            torch.testing.assert_close(t, want, atol=ATOL, rtol=0, msg=f"{key} {meta}")
            checked += 1
    return checked


@pytest.mark.parametrize("opt", sorted(RESHARD_PLANS))
def test_fused_state_reshards_to_another_world_size_and_plan(tmp_path, opt):
    path = str(tmp_path / "ckpt.pt")
    keys = run_ranks(_reshard_worker, 2, path, opt, "save", timeout=90)[0]
    assert any(k.startswith("ebc.t0.") for k in keys) and all("@" not in k for k in keys)  # whole-table names
    assert all(n > 0 for n in run_ranks(_reshard_worker, 3, path, opt, "load", timeout=90))


def _init_worker(rank, W, device, same_seed):
    # "meta": TorchRec's way, DistributedModelParallel draws the values
    torch.manual_seed(0 if same_seed else rank)
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=40, embedding_dim=4, feature_names=[f"f{i}"])
              for i in range(4)]
    ebc = EmbeddingBagCollection(tables, device=device, optimizer=FusedOptimizerConfig("sgd", lr=0.1))
    plan = construct_module_sharding_plan(ebc, {"t0": data_parallel(), "t1": row_wise(), "t2": table_wise(rank=0),
                                                "t3": table_wise(rank=1)})
    from lightning_rec.types import ShardingPlan

    dmp = DistributedModelParallel(ebc, plan=ShardingPlan({"": plan}), device="cpu", timeout=30)
    pieces = {}
    for key, value in dmp.state_dict().items():
        shards = [(None, value)] if isinstance(value, torch.Tensor) else value.local_shards
        for meta, t in shards:
            pieces[(key, None if meta is None else meta.shard_offsets)] = t.clone()
    return pieces


@pytest.mark.parametrize("device, same_seed", [("meta", True), ("meta", False), ("cpu", False)])
def test_tables_start_distinct_and_replicas_alike(device, same_seed):
    """Before: on "meta", ranks seeded alike drew the same values for rank 0's t2 and rank 1's t3 (and for t1's two
    row blocks); ranks seeded apart (on "meta" or "cpu") started the data-parallel replica t0 differently on each
    rank, for good. Now replicas take rank 0's values, as DDP's dense layers do."""
    per_rank = run_ranks(_init_worker, 2, device, same_seed, timeout=60)
    replica = ("embedding_bags.t0.weight", None)
    torch.testing.assert_close(per_rank[0][replica], per_rank[1][replica], atol=0, rtol=0)
    pieces = [t for rank_pieces in per_rank for key, t in rank_pieces.items() if key != replica] + \
        [per_rank[0][replica]]
    assert len(pieces) == 5  # t0 (one replica), t1's two row blocks, t2, t3
    bound = (1 / 40) ** 0.5  # TorchRec's default range: +-sqrt(1 / rows) of the whole table
    for i, a in enumerate(pieces):
        assert a.abs().max() <= bound and a.std() > bound / 4
        for b in pieces[i + 1 :]:
            assert not torch.equal(a[:5], b[:5])


def test_full_of_one_ranks_state_dict_names_merge():
    """Before: "table: the checkpoint's pieces ... do not cover" for dmp.state_dict()[key].full() on one rank."""
    from lightning_rec.types import ShardMetadata

    mine = ShardedTensor((4, 2), [(ShardMetadata((0, 0), (2, 2), 0), torch.zeros(2, 2))])
    with pytest.raises(ValueError, match=r"ShardedTensor.full\(\) of a \(4, 2\) table: the pieces held .* do not "
                                         r"cover rows 0:4 .* ShardedTensor.merge"):
        mine.full()


def _names_worker(rank, W):
    torch.manual_seed(0)
    model = _CountingModel(EmbeddingBagCollection(_tables("sum"), optimizer=FusedOptimizerConfig("sgd", lr=0.1)))
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, _plan("table_wise", W, W), world_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optimizer = torch.optim.Adagrad(dmp.parameters(), lr=0.1)  # torch's helper walks each name from the dmp
    # the tables' (empty) parameters are the model's too, as unsharded; Adagrad keeps an empty state for them
    tables = [f"ebc.embedding_bags.{t}.weight" for t in ROWS]
    assert list(get_optimizer_state_dict(dmp, optimizer)["state"]) == tables + ["dense.weight", "dense.bias"]
    return ([n for n, _ in dmp.named_parameters()], [n for n, _ in model.named_parameters()],
            [n for n, _ in dmp.named_buffers()], [n for n, _ in model.named_buffers()],
            [n for n, _ in dmp.named_parameters(prefix="m")], list(dmp.state_dict()),
            len(list(dmp.parameters())) == len(list(model.parameters())), type(dmp._dmp_wrapped_module).__name__)


def test_named_parameters_are_the_models_own_names():
    """TorchRec's DistributedModelParallel names parameters and buffers as its model does; ours yielded
    '_dmp_wrapped_module.module.dense.weight' (DDP inside), names that neither dmp.state_dict() nor the
    unsharded model has."""
    params, model_params, buffers, model_buffers, prefixed, state, same_count, wrapper = \
        run_ranks(_names_worker, 2, timeout=60)[0]
    assert wrapper == "DistributedDataParallel"  # the case that added two wrapper names
    assert params == model_params and "dense.weight" in params
    assert buffers == model_buffers == ["seen"]
    assert prefixed == [f"m.{n}" for n in params]
    assert set(params + buffers) <= set(state) and same_count



def _learned_batches(rank: int, W: int, step: int, grad_ranks: list[int]):
    """This rank's batch with weights that are a leaf (requires_grad on `grad_ranks`), and the global batch whose
    weights are built from leaves of their own per rank, so the reference's backward fills each one's grad."""
    batches = [_batch(r, step, True) for r in range(W)]
    leaves = [b.weights().clone().requires_grad_(r in grad_ranks) for r, b in enumerate(batches)]
    mine = batches[rank]
    w = mine.weights().clone().requires_grad_(rank in grad_ranks)
    mine = KeyedJaggedTensor.from_lengths_sync(KEYS, mine.values(), mine.lengths(), weights=w)
    per_rank = [KeyedJaggedTensor.from_lengths_sync(KEYS, b.values(), b.lengths(), weights=lw).to_dict()
                for b, lw in zip(batches, leaves)]
    lengths, values, weights = [], [], []
    for k in KEYS:
        lengths += [d[k].lengths() for d in per_rank]
        values += [d[k].values() for d in per_rank]
        weights += [d[k].weights() for d in per_rank]
    return mine, w, leaves[rank], KeyedJaggedTensor.from_lengths_sync(KEYS, torch.cat(values), torch.cat(lengths),
                                                                      weights=torch.cat(weights))


LEARNED_KINDS = ["table_wise", "row_wise", "column_wise", "grid_shard", "mixed", "all_on_rank_1"]


def _learned_weights_worker(rank, W, shared_memory):
    """Per-id weights that require a gradient (learned, as TorchRec's PositionWeightedModule makes them): w.grad
    was None under every sharded type (they silently did not train). Now the gradient comes back through the
    reverse of the id all-to-all and equals the unsharded collection's, summed over the column blocks of an id."""
    config = FusedOptimizerConfig("sgd", lr=0.1)
    done = []
    for kind in LEARNED_KINDS:
        for pooling in ["sum", "mean"]:
            torch.manual_seed(0)
            model = PooledModel(EmbeddingBagCollection(_tables(pooling), is_weighted=True, optimizer=config))
            reference = PooledModel(EmbeddingBagCollection(_tables(pooling), is_weighted=True, optimizer=config))
            reference.load_state_dict(model.state_dict())
            # all_on_rank_1: rank 0 looks nothing up, yet the others wait for it in the weights' backward exchange
            layout = {t: table_wise(rank=1) for t in ROWS} if kind == "all_on_rank_1" else _plan(kind, W, W)
            plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, layout, world_size=W)})
            dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=20, shared_memory=shared_memory)
            # both ranks learn; rank 0 only (rank 1 must still take part in the backward exchange); none
            for step, grad_ranks in enumerate([list(range(W)), [0], []]):
                what = f"{kind}/{pooling} step {step} learned on {grad_ranks} shm={shared_memory}"
                mine, w, ref_w, whole = _learned_batches(rank, W, step, grad_ranks)
                g = torch.Generator().manual_seed(step)
                grads = [torch.randn(3 + r, 3, generator=g) for r in range(W)]
                (dmp(mine) * grads[rank]).sum().backward()
                (reference(whole) * torch.cat(grads)).sum().backward()
                if rank in grad_ranks:
                    # atol: fp32; a column-wise id's gradient is a sum of per-block dot products, not one
                    torch.testing.assert_close(w.grad, ref_w.grad, atol=1e-5, rtol=0, msg=what)
                else:
                    assert w.grad is None, what
                dmp.module.dense.zero_grad()
                reference.dense.zero_grad()
            _check_pieces(dmp, reference, "embedding_bags", f"{kind}/{pooling}")
            done.append(f"{kind}/{pooling}")
    return done


@pytest.mark.parametrize("shared_memory", [None, False])
def test_learned_weights_get_their_gradient_under_every_sharding_type(shared_memory):
    done = run_ranks(_learned_weights_worker, 2, shared_memory, timeout=180)
    assert len(done[0]) == 2 * len(LEARNED_KINDS)


def _local_table_state(dmp) -> list[torch.Tensor]:
    """This rank's pieces of every table and their optimizer state."""
    sharded = dmp.module.ebc
    states = [v.clone() for k in sharded.fused_kernels() for st in k.optimizer_states() for v in st.values()]
    return [w.detach().clone() for w in sharded.table_weights().values()] + states


def _frozen_sharded_worker(rank, W, when):
    from lightning.pytorch.callbacks import BaseFinetuning

    torch.manual_seed(0)
    optimizer = FusedOptimizerConfig("rowwise_adagrad", lr=0.1)
    model = PooledModel(EmbeddingBagCollection(_tables("sum"), optimizer=optimizer))
    ref = PooledModel(EmbeddingBagCollection(_tables("sum")))
    ref.load_state_dict(model.state_dict())
    ref.ebc.requires_grad_(False)
    if when == "before":  # Lightning's BaseFinetuning freezes in setup, before RecStrategy shards
        BaseFinetuning.freeze(model.ebc)
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(
        model.ebc, {"t0": row_wise(), "t1": table_wise(rank=1), "t2": data_parallel()}, world_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)
    if when == "after":
        dmp.module.ebc.requires_grad_(False)
    elif when == "after_params":  # BaseFinetuning in finetune_function, as LightningModule.freeze: the parameters
        BaseFinetuning.freeze(dmp.module.ebc)
    elif when == "dmp":
        dmp.requires_grad_(False)
        dmp.module.dense.requires_grad_(True)
    before = _local_table_state(dmp)
    opt = torch.optim.SGD([p for p in dmp.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD(ref.dense.parameters(), lr=0.1)
    for step in range(3):
        dmp(_batch(rank, step, False)).square().sum().backward()  # DDP averages the dense gradient over ranks
        (ref(_global_batch(W, step, False)).square().sum() / W).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    frozen_same = all(torch.equal(a, b) for a, b in zip(before, _local_table_state(dmp)))
    torch.testing.assert_close(dmp.module.dense.weight, ref.dense.weight, atol=ATOL, rtol=0)
    if when in ("before", "after_params"):  # BaseFinetuning.make_trainable / LightningModule.unfreeze after sharding
        for p in dmp.module.ebc.parameters():
            p.requires_grad = True
    elif when == "dmp":
        dmp.requires_grad_(True)
    else:
        dmp.module.ebc.requires_grad_(True)
    assert dmp.module.ebc.frozen_tables() == frozenset()
    dmp(_batch(rank, 5, False)).sum().backward()
    return frozen_same, [not torch.equal(a, b) for a, b in zip(before, _local_table_state(dmp))]


@pytest.mark.parametrize("when", ["before", "after", "after_params", "dmp"])
def test_frozen_sharded_tables_stay_unchanged_on_every_rank(when):
    """A fused collection frozen before sharding (Lightning's BaseFinetuning freezes in setup, before RecStrategy
    shards) or a sharded collection frozen with requires_grad_(False) kept training its tables inside backward on
    every rank. Now no rank updates a frozen table (row-wise, table-wise, data-parallel), the backward all-to-all
    still pairs across ranks, the dense layer trains as over a plain frozen collection, and unfreezing
    (requires_grad_(True), or BaseFinetuning's make_trainable on the sharded collection's parameters) resumes.
    Freezing after sharding through the parameters (BaseFinetuning.freeze, LightningModule.freeze(),
    dmp.requires_grad_(False)) found none on a collection sharded unfrozen, and the tables kept training."""
    done = run_ranks(_frozen_sharded_worker, 2, when, timeout=120)
    assert [same for same, _ in done] == [True, True]
    assert all(any(changed) for _, changed in done)  # unfrozen: every rank updates some of its pieces again


def _replica_step_worker(rank, W, opt):
    def collection():
        torch.manual_seed(0)
        return EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=8, embedding_dim=4,
                                                          feature_names=["f"])],
                                      optimizer=FusedOptimizerConfig(opt, lr=0.1, weight_decay=0.5))

    ebc, reference = collection(), collection()
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, {"t": data_parallel()}, world_size=W)})
    dmp = DistributedModelParallel(ebc, plan=plan, device="cpu", timeout=30)

    def kjt(ids):
        return KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor(ids), torch.ones(len(ids), dtype=torch.long))

    zero_second = torch.tensor([[1.0], [0.0]])  # the bag that reads row 7 gets a zero gradient
    for _ in range(2):
        # two calls before one backward (BPR's positives, then negatives): one fused update per call
        pos, neg = dmp(kjt([rank, 7])).values(), dmp(kjt([rank + 4, 3])).values()
        ((pos * zero_second).sum() + 2 * neg.sum()).backward()
        pos = reference(kjt([r for k in range(W) for r in (k, 7)])).values()
        neg = reference(kjt([r for k in range(W) for r in (k + 4, 3)])).values()
        ((pos * zero_second.repeat(W, 1)).sum() + 2 * neg.sum()).backward()
    return dmp.state_dict()["embedding_bags.t.weight"], reference.state_dict()["embedding_bags.t.weight"]


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise_adagrad"])
def test_replicated_table_steps_as_the_fused_kernels(opt):
    """A data_parallel table with weight_decay left a row named only with a zero gradient undecayed (fused kernels
    step every row a batch names: 0.03 to 0.2 apart after two steps), and a collection called twice before one
    backward took one Adagrad step on the summed gradient where its sharded tables take one per call (0.07 apart).
    Now the replica steps as the unsharded fused collection. atol 1e-6: fp32, the same rule on sums of two terms."""
    for replica, unsharded in run_ranks(_replica_step_worker, 2, opt, timeout=60):
        torch.testing.assert_close(replica, unsharded, atol=1e-6, rtol=0)



def _fp16_replica_worker(rank, W, pooled):
    config = EmbeddingBagConfig if pooled else EmbeddingConfig
    table = config(name="t", num_embeddings=8, embedding_dim=4, feature_names=["f"], data_type=torch.float16)
    collection = (EmbeddingBagCollection if pooled else EmbeddingCollection)(
        [table], optimizer=FusedOptimizerConfig("sgd", lr=1000.0))
    collection.load_state_dict({k: torch.zeros(8, 4, dtype=torch.float16) for k in collection.state_dict()})
    plan = ShardingPlan({"": construct_module_sharding_plan(collection, {"t": data_parallel()}, world_size=W)})
    dmp = DistributedModelParallel(collection, plan=plan, device="cpu", timeout=30)
    out = dmp(KeyedJaggedTensor.from_lengths_sync(["f"], torch.arange(8), torch.ones(8, dtype=torch.long)))
    out = out.values() if pooled else out["f"].values()
    grads = [torch.randn(8, 4, generator=torch.Generator().manual_seed(r)) * 3e-7 for r in range(W)]
    (out * grads[rank]).sum().backward()
    step = next(iter(dmp.state_dict().values())).float()
    return out.dtype, ((step + 1000.0 * sum(grads)).norm() / (1000.0 * sum(grads)).norm()).item()


@pytest.mark.parametrize("pooled", [True, False])
def test_fp16_replicated_tables_give_fp32_rows_and_take_an_fp32_gradient(pooled):
    """As the fused kernels (test_embedding's test_fp16_tables_give_fp32_rows_and_take_an_fp32_gradient): an FP16
    data_parallel table looked up in float16, so a sharded EmbeddingCollection's rows came out float16 where the
    unsharded one's (and every other sharding type's) are float32, bags summed in float16, and a small gradient
    (3e-7: subnormal in float16) kept a few bits, a step 2-30% off. Bound: the fp16 storage of the step (2^-11)."""
    for dtype, relative_error in run_ranks(_fp16_replica_worker, 2, pooled, timeout=60):
        assert dtype == torch.float32
        assert relative_error < 2e-3

def _frozen_disagree_worker(rank, W, shared_memory):
    torch.manual_seed(0)
    model = PooledModel(EmbeddingBagCollection(_tables("sum"), optimizer=FusedOptimizerConfig("sgd", lr=0.1)))
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(
        model.ebc, {"t0": row_wise(), "t1": table_wise(rank=1), "t2": data_parallel()}, world_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=20, shared_memory=shared_memory)
    if rank == 0:  # rank-dependent code
        dmp.module.ebc.requires_grad_(False)
    before = _local_table_state(dmp)
    text = expect_error(ValueError, lambda: dmp(_batch(rank, 0, False)), "froze different tables",
                        "[[0], [1]]", "every rank alike")
    assert all(torch.equal(a, b) for a, b in zip(before, _local_table_state(dmp)))  # nothing moved anywhere
    # every rank freezes t1 alone, whose whole table shares rank 1's fused kernel with t0's rows there: rank 1 alone
    # refused it in its lookup while rank 0 waited for it in the output all-to-all; now both raise before the lookup
    dmp.module.ebc.requires_grad_(True)
    dmp.module.ebc.embedding_bags["t1"].weight.requires_grad = False
    words = ["freeze all of ['t1', 't0'] together"] if rank == 1 else ["rank(s) [1] rejected"]
    expect_error(ValueError, lambda: dmp(_batch(rank, 0, False)), *words)
    dmp.module.ebc.requires_grad_(False)  # now every rank agrees: the step runs, and nothing updates
    dmp(_batch(rank, 1, False)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(before, _local_table_state(dmp)))
    return text


@pytest.mark.parametrize("shared_memory", [None, False])
def test_ranks_that_freeze_different_tables_all_raise(shared_memory):
    """Freezing under `if rank == 0`: the other rank kept updating its pieces while rank 0 did not (silently
    diverging), and a frozen replica on one rank only left the others waiting in its gradient all-reduce until the
    timeout. Now the id all-to-all's counts carry each rank's frozen tables, and every rank raises, naming the fix,
    before anything moves. The same for freezing a table whose pieces share a fused kernel with an unfrozen table's
    on one rank only (that rank refused it in its lookup, the others waited in the output all-to-all)."""
    texts = run_ranks(_frozen_disagree_worker, 2, shared_memory, timeout=60)
    assert "this rank (0) has ['t0', 't1', 't2'] frozen" in texts[0] and "this rank (1) has no table" in texts[1]


def _summary_worker(rank, W):
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_summary import ModelSummary

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.ebc = EmbeddingBagCollection(_tables("sum"), optimizer=FusedOptimizerConfig("sgd", lr=0.1))
            self.dense = nn.Linear(26, 3)

    module = Module()
    unsharded = ModelSummary(module)
    counts = (unsharded.param_nums, unsharded.total_parameters, unsharded.trainable_parameters)
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(
        module.ebc, {"t0": row_wise(), "t1": table_wise(rank=1), "t2": data_parallel()}, world_size=W)})
    dmp = DistributedModelParallel(module, plan=plan, device="cpu", timeout=20)
    sharded = ModelSummary(module)
    assert (sharded.param_nums, sharded.total_parameters, sharded.trainable_parameters) == counts
    assert sum(p.numel() for p in dmp.parameters()) == counts[1]
    assert all(p.shape == (0,) for p in dmp.module.ebc.parameters())  # nothing held: DDP's broadcast moves nothing
    return counts


def test_model_summary_counts_sharded_tables_as_the_unsharded_model():
    """Lightning's ModelSummary (printed at fit start) showed a sharded collection with 0 parameters, and the
    model's total without its tables. Now every rank counts each table whole (rows x columns, not trainable by
    autograd, as an unsharded fused table), the same numbers as before sharding."""
    counts = run_ranks(_summary_worker, 2, timeout=60)
    assert counts[0] == counts[1] and counts[0][0][0] == sum(ROWS[t] * DIMS[t] for t in ROWS)


class _SharedTowers(nn.Module):
    """Two towers holding one collection object (shared embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(_tables("sum"), optimizer=FusedOptimizerConfig("adagrad", lr=0.1))
        self.user, self.item = nn.ModuleDict({"ebc": ebc}), nn.ModuleDict({"ebc": ebc})

    def forward(self, users: KeyedJaggedTensor, items: KeyedJaggedTensor) -> torch.Tensor:
        return self.user["ebc"](users).values() * self.item["ebc"](items).values()


def _shared_towers_worker(rank, W, plan_path):
    model, reference = _SharedTowers(), _SharedTowers()
    plan = ShardingPlan({plan_path: construct_module_sharding_plan(model.user["ebc"], _plan("mixed", W, W),
                                                                   world_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)
    assert model.user["ebc"] is model.item["ebc"] and list(dmp.plan.plan) == ["user.ebc"]
    for step in range(3):
        out = dmp(_batch(rank, step, False), _batch(rank, step + 10, False))
        ref = reference(_global_batch(W, step, False), _global_batch(W, step + 10, False))
        start = sum(3 + r for r in range(rank))
        torch.testing.assert_close(out, ref[start : start + 3 + rank], atol=ATOL, rtol=0)
        out.sum().backward()
        ref.sum().backward()
    _check_pieces(dmp, reference, "embedding_bags", "shared towers")
    return sorted({k.split(".embedding_bags")[0] for k in dmp.state_dict() if "embedding_bags" in k})


@pytest.mark.parametrize("plan_path", ["user.ebc", "item.ebc"])
def test_a_collection_shared_by_two_towers_is_sharded_at_both_paths(plan_path):
    """named_modules lists a shared module once: DistributedModelParallel swapped only 'user.ebc', and 'item.ebc' kept
    the unsharded collection, which trained a copy of its own beside the sharded tables (the outputs of the two
    towers drifted apart from the first step). A plan may name either path."""
    for prefixes in run_ranks(_shared_towers_worker, 2, plan_path, timeout=90):
        assert prefixes == ["item.ebc", "user.ebc"]


def _rank_state_worker(rank, W, path):
    import copy

    from lightning_rec.optim import combined_optimizer, dense_parameters

    module = nn.Module()
    module.ebc = EmbeddingBagCollection(_tables("sum"), optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.1))
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(
        module.ebc, {"t0": row_wise(), "t1": table_wise(rank=W - 1), "t2": data_parallel()}, world_size=W)})
    dmp = DistributedModelParallel(module, plan=plan, device="cpu", timeout=20)
    optimizer = combined_optimizer(dmp, torch.optim.Adam(dense_parameters(dmp) or [nn.Parameter(torch.ones(1))]))
    module.ebc(_batch(rank, 0, False)).values().sum().backward()
    if W == 2:
        expect_error(TypeError, lambda: copy.deepcopy(optimizer), "sharded model", "torch.save(optimizer.state_dict()")
        from torch.optim.swa_utils import AveragedModel

        expect_error(TypeError, lambda: AveragedModel(dmp), "cannot be deep-copied or pickled",
                     "AveragedModel(dmp.module")
        torch.save(optimizer.state_dict(), f"{path}.{rank}")
        return None
    saved = torch.load(f"{path}.1")
    return expect_error(ValueError, lambda: optimizer.load_state_dict(saved), "saved by one rank of a model sharded "
                        "otherwise (it holds pieces ['ebc.t0@r6c0'", "checkpoint.save")


def test_one_ranks_optimizer_state_at_another_world_size_is_refused_naming_checkpoint_save(tmp_path):
    """torch.save(optimizer.state_dict()) on each rank, loaded at another world size: the refusal said "saved with
    other tables or another fused optimizer" (the same tables, sharded otherwise), naming no way that reshards. Now
    it says so and names checkpoint.save / load_optimizer. copy.deepcopy of a sharded model's optimizer, and of the
    model (AveragedModel(dmp), EMA helpers), said "cannot pickle 'ProcessGroup' object"; now they name what to do."""
    path = str(tmp_path / "opt")
    run_ranks(_rank_state_worker, 2, path, timeout=60)
    run_ranks(_rank_state_worker, 1, path, timeout=60)


def _dtype_cast_worker(rank, W):
    torch.manual_seed(0)
    dmp = DistributedModelParallel(PooledModel(EmbeddingBagCollection(_tables("sum"),
                                                                      optimizer=FusedOptimizerConfig("sgd", lr=0.1))),
                                   device="cpu", timeout=30)
    said = [expect_error(ValueError, cast, "keep their configured data_type", "data_type in the table configs")
            for cast in (dmp.double, dmp.half, lambda: dmp.to(torch.float64))]
    ebc = next(m for m in dmp.modules() if type(m).__name__ == "ShardedEmbeddingBagCollection")
    said.append(expect_error(ValueError, ebc.double, "sharded EmbeddingBagCollection tables keep"))
    dmp.to("cpu").float()  # a device move, and float32, stay accepted
    dtypes = {p.dtype for p in dmp.parameters()}
    return said, dtypes, dmp(_batch(rank, 0, False)).dtype


def test_a_dtype_cast_of_a_sharded_model_is_refused_as_the_unsharded_collections_is():
    """dmp.double() / .half() / .to(torch.float64) were accepted without a word: the dense layers converted, the
    tables stayed float32, and the next forward failed on mismatched dtypes (unsharded, the cast is refused)."""
    said, dtypes, out = run_ranks(_dtype_cast_worker, 1, timeout=60)[0]
    assert said[0].startswith("DistributedModelParallel: its sharded tables") and "torch.float64" in said[0]
    assert "torch.float16" in said[1] and "bf16-mixed" in said[1]
    assert dtypes == {torch.float32} and out == torch.float32


def _resized_state_worker(rank, W):
    config = FusedOptimizerConfig("sgd", lr=0.1)

    def sharded(rows: dict) -> DistributedModelParallel:
        torch.manual_seed(0)
        tables = [EmbeddingBagConfig(name=t, num_embeddings=rows[t], embedding_dim=DIMS[t], feature_names=FEATURES[t])
                  for t in ROWS]
        m = PooledModel(EmbeddingBagCollection(tables, optimizer=config))
        layout = construct_module_sharding_plan(m.ebc, {t: row_wise() for t in ROWS}, world_size=W, local_size=W)
        return DistributedModelParallel(m, plan=ShardingPlan({"ebc": layout}), device="cpu", timeout=30)

    dmp = sharded(ROWS)
    def t0() -> torch.Tensor:
        return dmp.state_dict()["ebc.embedding_bags.t0.weight"].local_shards[0][1].clone()

    before = t0()
    said = [expect_error(RuntimeError, lambda n=n: dmp.load_state_dict(sharded({**ROWS, "t0": n}).state_dict()),
                         "'ebc.embedding_bags.t0.weight' has shape", f"({n}, 8) in the checkpoint but the table is "
                         "(11, 8): the table sizes differ", "num_embeddings")
            for n in (2 * ROWS["t0"], ROWS["t0"] - 3)]
    assert torch.equal(before, t0())  # (torch loads the tables that match)
    return said


def test_a_sharded_state_of_a_larger_table_is_refused_not_cut_to_size():
    """dmp.load_state_dict(another dmp's state_dict()) whose table had twice the rows loaded its first rows without a
    word (its pieces cover every rectangle of the smaller table); one with fewer rows said "combine every rank's with
    ShardedTensor.merge", which the user had no need of. Both now say the table sizes differ."""
    run_ranks(_resized_state_worker, 2, timeout=60)


def _vector_worker(rank, W):
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    torch.manual_seed(0)
    dmp = DistributedModelParallel(PooledModel(EmbeddingBagCollection(_tables("sum"),
                                                                      optimizer=FusedOptimizerConfig("sgd", lr=0.1))),
                                   device="cpu", timeout=30)
    vec = parameters_to_vector(dmp.parameters())
    said = expect_error(ValueError, lambda: vector_to_parameters(vec, dmp.parameters()),
                        "vector_to_parameters", "if p.requires_grad]", "dmp.load_state_dict")
    dense = [p for p in dmp.parameters() if p.requires_grad]  # the fix the error names
    vector_to_parameters(parameters_to_vector(dense) * 0, dense)
    return said, dmp(_batch(rank, 0, False)).abs().max().item()


def test_vector_to_parameters_over_a_sharded_model_names_the_fix():
    """torch.nn.utils.vector_to_parameters(parameters_to_vector(dmp.parameters()), dmp.parameters()) failed with
    "shape '[0]' is invalid for input of size N": a sharded table's parameter holds nothing but its numel() is the
    whole table's (for ModelSummary), and vector_to_parameters steps by numel(). Now the error says to pass the dense
    parameters (requires_grad), and that round trip works."""
    said, out = run_ranks(_vector_worker, 1, timeout=60)[0]
    assert "holds none" in said, said
    assert out == 0.0  # the dense layer, written through the vector, now zero


def _need_indices_worker(rank, W):
    torch.manual_seed(0)
    config = FusedOptimizerConfig("rowwise_adagrad", lr=0.1)
    ec = EmbeddingCollection(_tables(None), optimizer=config, need_indices=True)
    reference = EmbeddingCollection(_tables(None), optimizer=config)
    reference.load_state_dict(ec.state_dict())
    plan = ShardingPlan({"": construct_module_sharding_plan(ec, _plan("mixed", W, W, sequence=True), world_size=W)})
    dmp = DistributedModelParallel(ec, plan=plan, device="cpu", timeout=30)
    batch = _batch(rank, 0, False)
    shuffled = batch.permute(list(range(len(KEYS)))[::-1])  # any key order in; each output keeps its own ids
    out, ref = dmp(shuffled), reference(batch)
    for f in KEYS:
        assert torch.equal(out[f].weights(), batch[f].values()), f
        torch.testing.assert_close(out[f].values(), ref[f].values(), atol=1e-6, rtol=0)
    return True


def test_torchrec_need_indices_gives_each_sequence_output_its_ids_sharded_and_not():
    """EmbeddingCollection(..., need_indices=True) (TorchRec's keyword; port code passes it) was a TypeError. Now each
    output JaggedTensor carries its feature's ids as its weights, as TorchRec's, unsharded and sharded (routed and
    data-parallel tables), whatever the input's key order."""
    ec = EmbeddingCollection(_tables(None), need_indices=True)
    batch = _batch(0, 0, False)
    out = ec(batch.permute([2, 0, 1, 3]))
    assert list(out) == KEYS and ec.need_indices() and not EmbeddingCollection(_tables(None)).need_indices()
    for f in KEYS:
        assert torch.equal(out[f].weights(), batch[f].values()) and out[f].values().shape[0] == out[f].weights().numel()
    assert EmbeddingCollection(_tables(None))(batch)[KEYS[0]].weights_or_none() is None
    with pytest.raises(ValueError, match="need_indices=1.*True or False"):
        EmbeddingCollection(_tables(None), need_indices=1)
    run_ranks(_need_indices_worker, 2, timeout=60)


def _init_fn_worker(rank, W):
    import functools

    torch.manual_seed(rank)  # the ranks' own RNGs differ
    tables = [EmbeddingBagConfig(name=t, num_embeddings=ROWS[t], embedding_dim=DIMS[t], feature_names=FEATURES[t],
                                 init_fn=functools.partial(nn.init.normal_, std=1e-3) if t != "t2" else None)
              for t in ROWS]
    ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("sgd", lr=0.1), device="meta")
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, _plan("mixed", W, W), world_size=W)})
    dmp = DistributedModelParallel(ebc, plan=plan, device="cpu", timeout=30)
    full = {k: (v.local_shards[0][1] if isinstance(v, ShardedTensor) else v) for k, v in dmp.state_dict().items()}
    return {k: (float(v.std()), v.sum().item()) for k, v in full.items()}


def test_torchrec_init_fn_draws_the_shards_of_tables_built_on_meta():
    """init_fn on tables built on "meta": DistributedModelParallel drew every shard uniform, ignoring it. Now each
    piece gets the table's init_fn under the piece's own seed: row-wise pieces normal(std=1e-3), the data-parallel
    replica (t1) equal on both ranks though their RNGs differ; the table without one (t2) keeps the uniform draw."""
    a, b = run_ranks(_init_fn_worker, 2, timeout=60)
    assert a["embedding_bags.t0.weight"][0] < 2e-3 and b["embedding_bags.t0.weight"][0] < 2e-3
    assert a["embedding_bags.t1.weight"] == b["embedding_bags.t1.weight"] and a["embedding_bags.t1.weight"][0] < 2e-3
    assert a["embedding_bags.t2.weight"][0] > 0.01


def _inverse_indices_worker(rank, W):
    table = EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["a"])
    ebc = EmbeddingBagCollection([table], optimizer=FusedOptimizerConfig("sgd", lr=0.1))
    expected = ebc(KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1, 2, 2]), torch.tensor([1, 1, 1])))
    model = torch.nn.ModuleDict({"ebc": ebc})
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(ebc, {"t": table_wise(rank=0)}, world_size=1)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)
    dedup = KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1, 2]), torch.tensor([1, 1]),
                                                inverse_indices=(["a"], torch.tensor([[0, 1, 1]])))
    torch.testing.assert_close(dmp.module["ebc"](dedup).values(), expected.values(), atol=0, rtol=0)
    ec = EmbeddingCollection([EmbeddingConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["a"])],
                             optimizer=FusedOptimizerConfig("sgd", lr=0.1))
    plan = ShardingPlan({"": construct_module_sharding_plan(ec, {"t": table_wise(rank=0)}, world_size=1)})
    sharded_ec = DistributedModelParallel(ec, plan=plan, device="cpu", timeout=30)
    return expect_error(ValueError, lambda: sharded_ec(dedup), "inverse_indices", "expand pooled outputs only")


def test_a_sharded_collection_expands_inverse_indices_as_the_unsharded_one():
    """A KJT with inverse_indices (TorchRec's deduplicated batch) was refused by the sharded collections; a sharded
    EmbeddingBagCollection now expands it after the output all-to-all, as the unsharded one (variable batches per
    feature: tests/test_variable_batch.py), and a sequence collection refuses it, as the unsharded one does."""
    assert "without inverse_indices" in run_ranks(_inverse_indices_worker, 1, timeout=60)[0]
