"""Managed-collision tables under DistributedModelParallel (2 gloo ranks): the id maps stay the same on every rank
and equal to one unsharded module fed the global batch; outputs, dense gradients and table pieces match it (1e-5)."""

import torch
from dist_utils import run_ranks
from torch import nn

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.managed_collision import (
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
)
from lightning_rec.model_parallel import DistributedModelParallel, column_wise, construct_module_sharding_plan, row_wise
from lightning_rec.optim import FusedOptimizerConfig
from lightning_rec.sharding.sharded_tensor import ShardedTensor
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.types import ShardingPlan

ATOL = 1e-5
KEYS = ["f", "g"]
DIM = 4


class MCModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        tables = [EmbeddingBagConfig(name="t", num_embeddings=9, embedding_dim=DIM, feature_names=KEYS)]
        # adagrad: per-element state, the same whole or in column pieces (row-wise adagrad's is per piece)
        ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("adagrad", lr=0.1))
        mcc = ManagedCollisionCollection({"t": MCHManagedCollisionModule(9, eviction_interval=2)}, tables)
        self.mc = ManagedCollisionEmbeddingBagCollection(ebc, mcc)
        self.dense = nn.Linear(2 * DIM, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.mc(kjt)[0].values())


def _batch(rank: int, step: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    B = 3 + rank
    lengths = torch.randint(0, 4, (2 * B,), generator=g)
    values = torch.randint(0, 30, (int(lengths.sum()),), generator=g) * 1_000_000_007  # raw ids, many new
    return KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths)


def _global(W: int, step: int) -> KeyedJaggedTensor:
    parts = [_batch(r, step).to_dict() for r in range(W)]
    return KeyedJaggedTensor.from_lengths_sync(KEYS, torch.cat([p[k].values() for k in KEYS for p in parts]),
                                               torch.cat([p[k].lengths() for k in KEYS for p in parts]))


def _parity_worker(rank, W, kind):
    torch.manual_seed(0)
    model, reference = MCModel(), MCModel()
    reference.load_state_dict(model.state_dict())
    table_plan = {"t": row_wise()} if kind == "row_wise" else {"t": column_wise(ranks=[0, 1])}
    plan = ShardingPlan({"mc._embedding_module": construct_module_sharding_plan(
        model.mc._embedding_module, table_plan, world_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)
    for step in range(8):
        out = dmp(_batch(rank, step))
        ref = reference(_global(W, step))
        start = sum(3 + r for r in range(rank))
        torch.testing.assert_close(out, ref[start:start + 3 + rank], atol=ATOL, rtol=0, msg=f"step {step}")
        out.sum().backward()
        ref.sum().backward()
        for p, q in zip(dmp.module.dense.parameters(), reference.dense.parameters()):
            torch.testing.assert_close(p.grad, q.grad / W, atol=ATOL, rtol=0)
            p.grad = q.grad = None
    state, ref_state = dmp.state_dict(), reference.state_dict()
    for key, full in ref_state.items():
        value = state[key]
        if isinstance(value, ShardedTensor):
            for meta, piece in value.local_shards:
                (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
                torch.testing.assert_close(piece, full[r:r + nr, c:c + nc], atol=ATOL, rtol=0, msg=key)
        elif "dense" not in key:
            assert torch.equal(value, full), key
    m = dmp.module.mc._managed_collision_collection.modules_by_table()["t"]
    return int(m._evictions_total), m.id_map()[0].tolist()


def test_sharded_id_maps_match_unsharded_global_batch():
    for kind in ("row_wise", "column_wise"):
        results = run_ranks(_parity_worker, 2, kind)
        assert results[0] == results[1] and results[0][0] > 0  # the same map everywhere, evictions exercised


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
                                     num_signal_features=1, sparse_feature_names=names, num_embeddings_per_feature=32)
    trainer.fit(module, data, ckpt_path="last" if resume else None)
    mc = module.model.sparse_arch.embedding_bag_collection._managed_collision_collection
    assert all(m._evictions_total > 0 for m in mc.modules_by_table().values())
    weights = module.state_dict()
    assert sum(isinstance(v, ShardedTensor) for v in weights.values()) == 2  # both tables split over the ranks
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
        for k in want:
            assert torch.equal(want[k], got[k]), k
