"""Trainer(strategy="rec") on 2 CPU ranks (gloo): sharded tables, DDP dense layers, whole checkpoints."""

import lightning.pytorch as L
import torch

from lightning_rec import DLRMModule, SyntheticCriteoDataModule
from lightning_rec.sharding.sharded_tensor import ShardedTensor
from lightning_rec.strategy import RecStrategy
from tests.dist_utils import run_ranks

SMALL = dict(num_embeddings_per_feature=64, embedding_dim=8, dense_arch_layer_sizes=[16, 8],
             over_arch_layer_sizes=[16, 1], sparse_lr=0.05, dense_lr=0.02)


def _fit(rank, world_size, ckpt, wandb_dir):
    from lightning.pytorch.loggers import WandbLogger

    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_samples=4096, num_val_samples=1024, batch_size=128,
                                     num_embeddings_per_feature=64)
    module = DLRMModule(**SMALL)
    logger = WandbLogger(project="lightning_rec_test", save_dir=wandb_dir, offline=True)
    trainer = L.Trainer(strategy="rec", accelerator="cpu", devices=world_size, max_epochs=1, logger=logger,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, data)
    assert isinstance(trainer.strategy, RecStrategy)
    trainer.save_checkpoint(ckpt)
    shards = {k: [(m, t.clone()) for m, t in v.local_shards]
              for k, v in module.state_dict().items() if isinstance(v, ShardedTensor)}
    assert trainer.global_step == 4096 // world_size // 128  # whole batches of 128 on every rank, not samples
    logger.experiment.finish()  # flush the offline run file (ranks leave with os._exit)
    return float(trainer.callback_metrics["val_auc"]), str(trainer.strategy.plan), shards


def test_rec_strategy_trains_and_writes_whole_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    ckpt = str(tmp_path / "rec.ckpt")
    results = run_ranks(_fit, 2, ckpt, str(tmp_path), timeout=240)
    aucs = [r[0] for r in results]
    assert aucs[0] == aucs[1] and aucs[0] > 0.6  # metrics synced across ranks; the model learned
    assert "t_C1" in results[0][1]
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    table = state["model.sparse_arch.embedding_bag_collection.embedding_bags.t_C1.weight"]
    assert table.shape == (64, 8)  # whole table in the file, whatever the plan
    for _, _, shards in results:  # every rank's pieces are in it
        for key, pieces in shards.items():
            for meta, t in pieces:
                (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
                torch.testing.assert_close(state[key][r : r + nr, c : c + nc], t)
    # the planner's per-rank table went to the logger (W&B, offline run files)
    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert runs and any(b"sharding_plan" in r.read_bytes() for r in runs)
    unsharded = DLRMModule(**SMALL)
    unsharded.load_state_dict(state)  # an unsharded module reads the checkpoint as is
    # ... optimizer state too: the fused state is saved whole, under table names (no shard names)
    saved_opt = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    fused_key = next(k for k, v in saved_opt.items() if isinstance(v, dict) and "state" in v
                     and any(".embedding_bags." not in n and "t_C1" in n for n in v["state"]))
    fused_state = saved_opt[fused_key]["state"]
    assert not any("@" in n for n in fused_state)
    sums = fused_state["sparse_arch.embedding_bag_collection.t_C1.sum"]
    assert sums.shape[0] == 64 and bool((sums > 0).any())  # whole table's rows, trained
    optimizer = unsharded.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    optimizer.load_state_dict(saved_opt)
    restored = dict(optimizer.optimizers)[fused_key].table_states()["sparse_arch.embedding_bag_collection.t_C1"]
    torch.testing.assert_close(restored["sum"], sums)


def _uneven_fit(rank, world_size):
    import warnings

    from torch.utils.data import DataLoader, IterableDataset

    from lightning_rec.data.batch import passthrough_collate

    class Uneven(IterableDataset):  # rank 0 has 6 batches, rank 1 has 4 (a stream that splits unevenly)
        def __init__(self, data):
            self.data = data

        def __iter__(self):
            n = 6 if rank == 0 else 4
            for i in range(n):
                yield self.data.__getitems__(list(range(i * 64, (i + 1) * 64)))

    class UnevenData(SyntheticCriteoDataModule):
        def train_dataloader(self):
            return DataLoader(Uneven(self.make_split("train")), batch_size=None, collate_fn=passthrough_collate)

    L.seed_everything(0)
    data = UnevenData(num_train_samples=1024, num_val_samples=256, batch_size=64, num_embeddings_per_feature=64)
    trainer = L.Trainer(strategy="rec", accelerator="cpu", devices=world_size, max_epochs=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(DLRMModule(**SMALL), data)
    skipped = [str(w.message) for w in caught if "batches are skipped" in str(w.message)]
    return trainer.global_step, len(skipped)


def test_ranks_with_uneven_batches_stop_together():
    # without the agreement, rank 0's 5th step would wait in its all-to-all until the timeout
    results = run_ranks(_uneven_fit, 2, timeout=180, pg_timeout=60)
    assert [r[0] for r in results] == [8, 8]  # 4 steps per epoch on both ranks, 2 epochs
    assert results[0][1] == 2 and results[1][1] == 0  # rank 0 said it skipped, once per epoch
