"""Managed-collision tables under DistributedModelParallel (2 gloo ranks): each rank keeps the id map of the row
shards it holds and remaps after the id all-to-all. The reference is the unsharded model whose map is split the same
way (ids of row shard j, `owner_of(id, k)`, in a module of their own over that shard's rows), fed the global batch:
outputs, dense gradients, id maps and (id -> row content) pairs match it (1e-5); the pipeline matches the plain loop."""

import pytest
import torch
from dist_utils import run_ranks
from torch import nn

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.managed_collision import (
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
    reinit_rows,
)
from lightning_rec.managed_collision.mch import owner_of
from lightning_rec.model_parallel import DistributedModelParallel, column_wise, construct_module_sharding_plan, row_wise
from lightning_rec.optim import FusedOptimizerConfig
from lightning_rec.sharding.layout import row_block_size, split_evenly
from lightning_rec.sharding.plan_verbs import data_parallel
from lightning_rec.sharding.sharded_tensor import ShardedTensor
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.types import ShardingPlan

ATOL = 1e-5
KEYS = ["f", "g"]
DIM = 4
ROWS = 9


class MCModel(nn.Module):
    def __init__(self, rows: int = ROWS) -> None:
        super().__init__()
        tables = [EmbeddingBagConfig(name="t", num_embeddings=rows, embedding_dim=DIM, feature_names=KEYS)]
        # adagrad: per-element state, the same whole or in column pieces (row-wise adagrad's is per piece)
        ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("adagrad", lr=0.1))
        mcc = ManagedCollisionCollection(
            {"t": MCHManagedCollisionModule(rows, eviction_policy="lru", eviction_interval=2)}, tables
        )
        self.mc = ManagedCollisionEmbeddingBagCollection(ebc, mcc)
        self.dense = nn.Linear(2 * DIM, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.mc(kjt)[0].values())


class SplitMapReference(nn.Module):
    """MCModel's tables and dense layer, its id map split over `shards` [(first row, rows)] as the sharded one is."""

    def __init__(self, model: MCModel, shards: list[tuple[int, int]]) -> None:
        super().__init__()
        self.model, self.shards = model, shards
        cands = split_evenly(ROWS, len(shards))
        self.maps = nn.ModuleList(
            MCHManagedCollisionModule(
                min(o + n, ROWS) - o, eviction_policy="lru", eviction_interval=2, max_candidates=c
            )
            for (o, n), c in zip(shards, cands)
        )

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        ebc = self.model.mc._embedding_module
        values = kjt.values()
        rows, owner = values.clone(), owner_of(values, len(self.shards))
        for j, ((o, _), m) in enumerate(zip(self.shards, self.maps)):
            mine = owner == j
            m.train().profile(values[mine])
            rows[mine] = m.remap(values[mine]) + o
            reused = m.take_reused_rows()
            if reused is not None:
                reinit_rows(ebc, {"t": reused + o}, {"t": int(m._step)}, seed_names={"t": "t" if o == 0 else f"t@{o}"})
        remapped = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), rows, kjt.lengths())
        return self.model.dense(ebc(remapped).values())

    def id_rows(self) -> dict[int, int]:
        return {int(i): int(r) + o for (o, _), m in zip(self.shards, self.maps) for i, r in zip(*m.id_map())}


def _batch(rank: int, step: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    B = 3 + rank
    lengths = torch.randint(0, 4, (2 * B,), generator=g)
    values = torch.randint(0, 30, (int(lengths.sum()),), generator=g) * 1_000_000_007  # raw ids, many new
    return KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths)


def _global(W: int, step: int) -> KeyedJaggedTensor:
    parts = [_batch(r, step).to_dict() for r in range(W)]
    return KeyedJaggedTensor.from_lengths_sync(
        KEYS,
        torch.cat([p[k].values() for k in KEYS for p in parts]),
        torch.cat([p[k].lengths() for k in KEYS for p in parts]),
    )


def shard(model: MCModel, W: int, kind: str = "row_wise") -> DistributedModelParallel:
    table_plan = {"t": {"row_wise": row_wise(), "data_parallel": data_parallel()}.get(
        kind, column_wise(ranks=list(range(W))))}
    plan = ShardingPlan(
        {"mc._embedding_module": construct_module_sharding_plan(model.mc._embedding_module, table_plan, world_size=W)}
    )
    return DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)


def row_shards(W: int, kind: str = "row_wise") -> list[tuple[int, int]]:
    if kind != "row_wise":
        return [(0, ROWS)]
    block = row_block_size(ROWS, W)
    return [(o, min(block, ROWS - o)) for o in range(0, ROWS, block)]


def owned_pairs(model: nn.Module) -> dict[int, tuple[int, torch.Tensor]]:
    """id -> (table row, this rank's columns of it) for the ids this rank's row shards hold."""
    m = model.mc._managed_collision_collection.modules_by_table()["t"]
    shards = model.mc._embedding_module.local_shards().get("t", [])
    out = {}
    for i, r in zip(*m.id_map()):
        cols = [
            w[int(r) - meta.shard_offsets[0]]
            for meta, w in sorted(shards, key=lambda s: s[0].shard_offsets[1])
            if meta.shard_offsets[0] <= r < meta.shard_offsets[0] + meta.shard_sizes[0]
        ]
        out[int(i)] = (int(r), torch.cat(cols).clone())
    return out


def _parity_worker(rank, W):
    return {kind: _parity(rank, W, kind) for kind in ("row_wise", "column_wise", "data_parallel")}


def _parity(rank, W, kind):
    torch.manual_seed(0)
    model, plain = MCModel(), MCModel()
    plain.load_state_dict(model.state_dict())
    reference = SplitMapReference(plain, row_shards(W, kind))
    dmp = shard(model, W, kind)
    for step in range(8):
        out = dmp(_batch(rank, step))
        ref = reference(_global(W, step))
        start = sum(3 + r for r in range(rank))
        torch.testing.assert_close(out, ref[start : start + 3 + rank], atol=ATOL, rtol=0, msg=f"step {step}")
        out.sum().backward()
        ref.sum().backward()
        for p, q in zip(dmp.module.dense.parameters(), plain.dense.parameters()):
            torch.testing.assert_close(p.grad, q.grad / W, atol=ATOL, rtol=0)
            p.grad = q.grad = None
    m = dmp.module.mc._managed_collision_collection.modules_by_table()["t"]
    if kind == "data_parallel":  # the replicated map, every rank's ids gathered: the whole unsharded map
        return sorted(m.id_map()[0].tolist()), reference.id_rows(), int(m._evictions_total)
    table = plain.mc._embedding_module.lookup.table_weights()["t"]
    pairs = owned_pairs(dmp.module)
    for i, (r, content) in pairs.items():  # the same row, the same content (this rank's columns of it)
        assert reference.id_rows()[i] == r, i
        piece = [
            w
            for meta, w in dmp.module.mc._embedding_module.local_shards()["t"]
            if meta.shard_offsets[0] <= r < meta.shard_offsets[0] + meta.shard_sizes[0]
        ]
        cols = torch.cat(
            [
                table[r, meta.shard_offsets[1] : meta.shard_offsets[1] + meta.shard_sizes[1]]
                for meta, _ in sorted(
                    dmp.module.mc._embedding_module.local_shards()["t"], key=lambda s: s[0].shard_offsets[1]
                )
                if meta.shard_offsets[0] <= r < meta.shard_offsets[0] + meta.shard_sizes[0]
            ]
        )
        assert piece and torch.allclose(content, cols, atol=ATOL, rtol=0), i
    evictions = sum(int(o.module._evictions_total) for o in m._owners)
    return sorted(pairs), reference.id_rows(), evictions


def test_sharded_id_maps_match_the_split_unsharded_map():
    every = run_ranks(_parity_worker, 2)
    for kind in ("row_wise", "column_wise", "data_parallel"):
        results = [r[kind] for r in every]
        ref = results[0][1]
        if kind == "row_wise":  # each id on one rank only, together every id of the reference
            assert not set(results[0][0]) & set(results[1][0])
            assert sorted(results[0][0] + results[1][0]) == sorted(ref)
            assert all(r[2] > 0 for r in results), [r[2] for r in results]  # eviction on every owner
        else:  # one row shard, or a replica: every rank keeps the whole map
            assert results[0][0] == results[1][0] == sorted(ref), kind


class _Task(nn.Module):
    """MCModel as TorchRec's pipelines take it: model(batch) -> (loss, output)."""

    def __init__(self) -> None:
        super().__init__()
        self.mc, self.dense = MCModel().mc, nn.Linear(2 * DIM, 1)

    def forward(self, batch):
        out = self.dense(self.mc(batch.sparse_features)[0].values())
        return out.sum(), out.detach()


def _pipeline_worker(rank, W):
    return [_train(rank, W, pipelined) for pipelined in (False, True)] + [_negative_id(rank, W), _sequence(rank, W)]


def _sequence(rank, W):
    """A ManagedCollisionEmbeddingCollection sharded row-wise: every id reads the row its owner gave it (admitted)
    or its owner's unknown row. Returns (this rank's ids -> rows, [(id, output row)], this rank's table rows)."""
    from lightning_rec import EmbeddingCollection, EmbeddingConfig
    from lightning_rec.managed_collision import ManagedCollisionEmbeddingCollection

    torch.manual_seed(0)
    tables = [EmbeddingConfig(name="t", num_embeddings=ROWS, embedding_dim=DIM, feature_names=KEYS)]
    ec = EmbeddingCollection(tables, optimizer=FusedOptimizerConfig("adagrad", lr=0.1))
    mcc = ManagedCollisionCollection({"t": MCHManagedCollisionModule(ROWS, eviction_interval=100)}, tables)
    model = nn.Module()
    model.mc = ManagedCollisionEmbeddingCollection(ec, mcc)
    plan = ShardingPlan({"mc._embedding_module": construct_module_sharding_plan(ec, {"t": row_wise()}, world_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)
    kjt = _batch(rank, 0)
    with torch.no_grad():
        out = dmp.module.mc(kjt)[0]
    ids = torch.cat([kjt[k].values() for k in KEYS])
    rows = torch.cat([out[k].values() for k in KEYS])
    m = dmp.module.mc._managed_collision_collection.modules_by_table()["t"]
    local = {int(meta.shard_offsets[0]) + r: w[r].clone() for meta, w in dmp.module.mc._embedding_module.local_shards()[
        "t"] for r in range(w.shape[0])}
    return dict(zip(*(t.tolist() for t in m.id_map()))), list(zip(ids.tolist(), rows)), local


def _negative_id(rank, W) -> str:
    """Rank 0's batch has a negative id: every rank raises before any id travels, rank 0 naming the fix, and no
    rank's map counts the step (a step counted on one side only would shift the eviction runs after a resume)."""
    dmp = shard(MCModel(), W)
    kjt = _batch(rank, 0)
    values = kjt.values().clone()
    values[0] = -5 if rank == 0 else values[0]
    try:
        dmp(KeyedJaggedTensor.from_lengths_sync(KEYS, values, kjt.lengths()))
    except ValueError as e:
        assert int(dmp.module.mc._managed_collision_collection.modules_by_table()["t"]._step) == 0
        return str(e)
    return "no error"


def _train(rank, W, pipelined):
    from lightning_rec import TrainPipelineSparseDist
    from lightning_rec.data import Batch

    torch.manual_seed(0)
    dmp = shard(_Task(), W)
    opt = torch.optim.SGD(dmp.module.dense.parameters(), lr=0.1)
    batches = [Batch(torch.zeros(3 + rank, 1), _batch(rank, step), torch.zeros(3 + rank)) for step in range(6)]
    outs = []
    if pipelined:
        with TrainPipelineSparseDist(dmp, opt, "cpu") as pipeline:
            it = iter(batches)
            for _ in batches:
                outs.append(pipeline.progress(it))
            assert pipeline.stats["routed_ahead"] >= len(batches) - 1, pipeline.stats
    else:
        for batch in batches:
            opt.zero_grad()
            loss, out = dmp(batch)
            loss.backward()
            opt.step()
            outs.append(out)
    return outs, owned_pairs(dmp.module)


def test_pipeline_matches_the_plain_loop():
    results = run_ranks(_pipeline_worker, 2)
    id_rows = {**results[0][3][0], **results[1][3][0]}
    table = {**results[0][3][2], **results[1][3][2]}
    unknown = {j: min(o + n, ROWS) - 1 for j, (o, n) in enumerate(row_shards(2))}
    for i, row in results[0][3][1] + results[1][3][1]:  # the sequence collection: each id's own row
        expected = id_rows.get(i, unknown[int(owner_of(torch.tensor([i]), 2))])
        assert torch.equal(row, table[expected]), i
    assert len(id_rows) == 7  # both owners full: 4 + 3 managed rows
    assert "id -5" in results[0][2] and "managed-collision table" in results[0][2] and ">= 0" in results[0][2]
    assert "rank(s) [0] rejected their batch" in results[1][2], results[1][2]
    for (outs, pairs), (p_outs, p_pairs), *_ in results:
        for a, b in zip(outs, p_outs):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
        assert pairs.keys() == p_pairs.keys()
        assert all(pairs[i][0] == p_pairs[i][0] and torch.allclose(pairs[i][1], p_pairs[i][1], atol=ATOL, rtol=0)
                   for i in pairs)


def _lightning_worker(rank, W):
    import lightning.pytorch as L

    from lightning_rec.data import Batch
    from lightning_rec.models.module_hooks import RecModuleHooks
    from lightning_rec.strategy import RecStrategy

    class Module(RecModuleHooks, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.task, self.losses = _Task(), []

        def training_step(self, batch, batch_idx):
            loss, _ = self.task(batch)
            self.log_train_loss(loss, batch_size=3 + rank)
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.task.dense.parameters(), lr=0.1)

        def on_train_end(self):
            self.stats = [dict(p.stats) for p in self.trainer.strategy._pipelines]

    batches = [Batch(torch.zeros(3 + rank, 1), _batch(rank, step), torch.zeros(3 + rank)) for step in range(6)]
    out = {}
    for pipeline in (False, True):
        torch.manual_seed(0)
        module = Module()
        plan = ShardingPlan({"task.mc._embedding_module": construct_module_sharding_plan(
            module.task.mc._embedding_module, {"t": row_wise()}, world_size=W)})
        trainer = L.Trainer(strategy=RecStrategy(plan=plan, pipeline=pipeline), accelerator="cpu", devices=W,
                            max_epochs=1,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, use_distributed_sampler=False)
        trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
        out[pipeline] = (module.losses, owned_pairs(module.task), module.stats)
    return out


def test_rec_strategy_pipeline_matches_plain_fit():
    for result in run_ranks(_lightning_worker, 2, timeout=300):
        (losses, pairs, _), (p_losses, p_pairs, stats) = result[False], result[True]
        assert len(losses) == 6 and p_losses == losses
        assert stats and stats[0]["routed_ahead"] == 5  # every batch but the recording one routed ahead
        assert pairs and pairs.keys() == p_pairs.keys() and all(torch.equal(pairs[i][1], p_pairs[i][1]) for i in pairs)


# a Trainer run with eviction on, SIGKILLed mid-epoch and resumed from its last checkpoint ----------------------------


def _flat(obj, prefix: str, out: dict) -> dict:
    """Every tensor of a nested state (a table's local pieces for a sharded one), on the CPU, by its path."""
    if isinstance(obj, ShardedTensor):
        for i, (_, t) in enumerate(obj.local_shards):
            out[f"{prefix}.{i}"] = t.detach().cpu().clone()
    elif isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().cpu().clone()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flat(v, f"{prefix}.{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flat(v, f"{prefix}.{i}", out)
    return out


def _mc_fit_rank(rank, world_size, root, kill_at, resume):
    import os
    import signal

    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_rec import RecStrategy
    from lightning_rec.data import SyntheticCriteoDataModule
    from lightning_rec.models import DLRMModule
    from lightning_rec.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    class KillAt(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    L.seed_everything(0)
    callbacks = [ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=4, save_last=True)]
    planner = EmbeddingShardingPlanner(Topology(world_size=world_size, compute_device="cpu"), constraints={
        "t_a": ParameterConstraints(sharding_types=["row_wise"]),
        "t_b": ParameterConstraints(sharding_types=["column_wise"], min_partition=2)})
    trainer = L.Trainer(strategy=RecStrategy(planner=planner), accelerator="cpu", devices=world_size, max_steps=12,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks + ([KillAt()] if kill_at is not None else []), num_sanity_val_steps=0,
                        limit_val_batches=0)
    names = ["a", "b"]  # 32 raw ids a feature into 8-row tables: LRU evicts every 2 steps
    module = DLRMModule(num_embeddings_per_feature=8, embedding_dim=4, dense_arch_layer_sizes=[8, 4],
                        over_arch_layer_sizes=[8, 1], sparse_feature_names=names, dense_optimizer="adam",
                        managed_collision={"eviction_policy": "lru", "eviction_interval": 2, "churn_warning": 1.0})
    data = SyntheticCriteoDataModule(num_train_samples=512, num_val_samples=16, batch_size=16, num_sparse_features=2,
                                     num_signal_features=1, sparse_feature_names=names, num_embeddings_per_feature=32,
                                     zipf_exponent=0.5)
    trainer.fit(module, data, ckpt_path="last" if resume else None)
    mc = module.model.sparse_arch.embedding_bag_collection._managed_collision_collection
    # eviction ran on this rank's owners of both tables (a row shard's own map, or the table's whole one)
    evictions = {t: sum(int(o.module._evictions_total) for o in m._owners) for t, m in mc.modules_by_table().items()}
    assert all(evictions.values()), evictions
    weights = module.state_dict()
    tables = [k for k, v in weights.items() if isinstance(v, ShardedTensor) and k.endswith(".weight")]
    assert len(tables) == 2, tables  # both tables split over the ranks
    state = _flat(weights, "model", {})
    for name, opt in trainer.optimizers[0].optimizers:
        _flat(opt.table_states() if hasattr(opt, "table_states") else opt.state_dict()["state"], name, state)
    return trainer.global_step, state


def test_sigkill_mid_epoch_with_eviction_resumes_bitwise():
    """2 ranks (a row-wise and a column-wise table), eviction every 2 steps, SIGKILLed at step 10 (last checkpoint:
    step 8) and resumed: the weights (every rank's pieces), the fused and dense optimizer state and the id maps equal
    an uninterrupted run's bit for bit."""
    import tempfile

    with tempfile.TemporaryDirectory() as whole, tempfile.TemporaryDirectory() as killed:
        expected = run_ranks(_mc_fit_rank, 2, whole, None, False, timeout=120)
        assert run_ranks(_mc_fit_rank, 2, killed, 10, False, timeout=120, allow_missing=True) == [None, None]
        resumed = run_ranks(_mc_fit_rank, 2, killed, None, True, timeout=120)
    for (steps, want), (steps_b, got) in zip(expected, resumed):
        assert steps == steps_b == 12 and sorted(want) == sorted(got)
        assert any("_row_ids" in k for k in want) and any(".fused." in k or k.startswith("fused") for k in want)
        # the lifetime eviction count, a statistic, restarts at a resume for sharded tables (docs: Limits)
        differ = [k for k in want if not torch.equal(want[k], got[k]) and not k.endswith("_evictions_total")]
        assert not differ, differ


def _uvm_worker(rank, W):
    from lightning_rec.types import ComputeKernel

    device = torch.device("cuda", rank)
    got = {}
    for kernel in (ComputeKernel.FUSED, ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING):
        torch.manual_seed(0)
        model = MCModel()
        table_plan = {"t": row_wise(compute_kernel=kernel)}
        plan = ShardingPlan({"mc._embedding_module": construct_module_sharding_plan(
            model.mc._embedding_module, table_plan, world_size=W)})
        dmp = DistributedModelParallel(model, plan=plan, device=device, timeout=60)
        outs = []
        for step in range(8):  # new raw ids every step, LRU eviction every 2: rows re-drawn in host memory too
            out = dmp(_batch(rank, step).to(device))
            out.sum().backward()
            outs.append(out.detach().cpu())
        m = dmp.module.mc._managed_collision_collection.modules_by_table()["t"]
        got[kernel.value] = outs, sorted(zip(*(x.tolist() for x in m.id_map())))
    return got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and fbgemm-gpu (CUDA build)")
def test_cuda_id_maps_over_uvm_and_uvm_cached_tables_train_as_device_tables():
    """Managed collision over tables in host memory (fused_uvm) and behind a device cache (fused_uvm_caching): the
    same outputs (1e-5) and id maps as tables in device memory, evictions and re-drawn rows included."""
    got = run_ranks(_uvm_worker, 1, timeout=300, backend="nccl")[0]
    outs, ids = got["fused"]
    for kernel in ("fused_uvm", "fused_uvm_caching"):
        assert got[kernel][1] == ids, kernel
        for step, (a, b) in enumerate(zip(got[kernel][0], outs)):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=f"{kernel}, step {step}")
