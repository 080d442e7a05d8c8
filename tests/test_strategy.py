"""Trainer(strategy="rec") on 2 CPU ranks (gloo): sharded tables, DDP dense layers, checkpoints and exact resume."""

import os
import signal
import time
import warnings
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from conftest import SHARED_DATA, needs_wandb

from lightning_rec import DLRMModule, SyntheticCriteoDataModule
from lightning_rec.pipeline import PipelineConfig
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
    # the gathered format (one file, every table whole): still written on request, still loads
    trainer = L.Trainer(strategy=RecStrategy(checkpoint_format="gathered"), accelerator="cpu", devices=world_size,
                        max_epochs=1, logger=logger, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    # the per-rank peak memory, gathered and logged at epoch end, drew Lightning's "use sync_dist=True" at 2+ ranks
    assert not [w for w in said if "sync_dist=True" in str(w.message)], [str(w.message) for w in said]
    assert isinstance(trainer.strategy, RecStrategy)
    trainer.save_checkpoint(ckpt)
    shards = {k: [(m, t.clone()) for m, t in v.local_shards]
              for k, v in module.state_dict().items() if isinstance(v, ShardedTensor)}
    assert trainer.global_step == 4096 // world_size // 128  # whole batches of 128 on every rank, not samples
    logger.experiment.finish()  # flush the offline run file (ranks leave with os._exit)
    return float(trainer.callback_metrics["val_auc"]), str(trainer.strategy.plan), shards


@needs_wandb  # the plan goes to W&B (offline)
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


def _trainers_worker(rank, world_size, pipeline):
    """Several Trainers over one LightningModule, as in a notebook: its tables stay sharded between them."""
    from lightning_rec.model_parallel import construct_module_sharding_plan, row_wise
    from lightning_rec.types import ShardingPlan

    def data():
        return SyntheticCriteoDataModule(num_train_samples=1024, num_val_samples=256, batch_size=64,
                                         num_embeddings_per_feature=64)

    def trainer(**kw):
        kw = {"max_epochs": 1, **kw}
        return L.Trainer(strategy=RecStrategy(pipeline=pipeline, **kw.pop("rec", {})), accelerator="cpu",
                         devices=world_size, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, **kw)

    def weights(module):
        return {k: (torch.cat([t.reshape(-1) for _, t in v.local_shards] + [torch.empty(0)])
                    if isinstance(v, ShardedTensor) else v).clone() for k, v in module.state_dict().items()}

    out = {}
    # evaluation shards the tables (no dense wrapper); a new Trainer then trains them (DDP added then)
    L.seed_everything(0)
    evaluated_first = DLRMModule(**SMALL)
    out["validate_then_fit_val"] = trainer().validate(evaluated_first, data(), verbose=False)
    L.seed_everything(1)
    trainer().fit(evaluated_first, data())
    L.seed_everything(0)
    fresh = DLRMModule(**SMALL)
    L.seed_everything(1)
    trainer().fit(fresh, data())
    out["validate_then_fit"], out["fit_alone"] = weights(evaluated_first), weights(fresh)
    # fit, then new Trainers: validate (same numbers as the fit's own Trainer) and fit on
    fit_trainer = trainer()
    fit_trainer.fit(fresh, data())
    out["same_trainer_val"] = fit_trainer.validate(fresh, data(), verbose=False)
    out["new_trainer_val"] = trainer().validate(fresh, data(), verbose=False)
    before = weights(fresh)
    import weakref

    first_ddp = weakref.ref(fit_trainer.strategy.dmp._dmp_wrapped_module)
    second = trainer(max_steps=4)
    second.fit(fresh, data())
    out["first_ddp_freed"] = first_ddp() is None  # its gradient hooks went with it: one reduction per bucket
    out["second_fit_steps"] = second.global_step
    out["second_fit_changed"] = sorted(k for k in before if not torch.equal(before[k], weights(fresh)[k]))
    dense = {k: v for k, v in weights(fresh).items() if "embedding_bags" not in k}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, dense)
    out["dense_same_on_ranks"] = all(torch.equal(everyone[0][k], everyone[q][k]) for q in range(world_size)
                                     for k in dense)
    out["after_second_fit"] = weights(fresh)
    # another plan for the sharded tables: refused, naming the way out
    ebc = fresh.get_submodule("model.sparse_arch.embedding_bag_collection")
    tables = {c.name: row_wise() for c in ebc._configs}
    other = ShardingPlan({"model.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        DLRMModule(**SMALL).get_submodule("model.sparse_arch.embedding_bag_collection"), tables,
        world_size=world_size)})
    try:
        trainer(rec={"plan": other}).fit(fresh, data())
        out["other_plan"] = "accepted"
    except ValueError as e:
        out["other_plan"] = str(e)
    from lightning_rec.model_parallel import DistributedModelParallel

    try:  # the plain API: a second DistributedModelParallel over the sharded model says what it is
        DistributedModelParallel(fresh, device="cpu")
        out["dmp_again"] = "accepted"
    except ValueError as e:
        out["dmp_again"] = str(e)
    return out


def test_new_trainers_over_a_sharded_module_reuse_its_tables():
    plain = run_ranks(_trainers_worker, 2, False, timeout=300)
    pipelined = run_ranks(_trainers_worker, 2, True, timeout=300)
    for r in plain + pipelined:
        # validate, then fit with a new Trainer == fit alone (bitwise): the dense layers got DDP when training began
        assert all(torch.equal(r["validate_then_fit"][k], r["fit_alone"][k]) for k in r["fit_alone"])
        assert r["new_trainer_val"] == r["same_trainer_val"]  # a new Trainer evaluates the same sharded tables
        assert r["second_fit_steps"] == 4 and any("embedding_bags" in k for k in r["second_fit_changed"])
        assert any("embedding_bags" not in k for k in r["second_fit_changed"])
        assert r["dense_same_on_ranks"] and r["first_ddp_freed"]  # one DDP wrapper at a time
        assert "differs from the plan" in r["other_plan"] and "checkpoints reshard" in r["other_plan"]
        assert "sharded already" in r["dmp_again"] and "embedding_bag_collection" in r["dmp_again"]
    for p, q in zip(plain, pipelined):  # the pipelined Trainers give what the plain ones give, bit for bit
        assert all(torch.equal(p["after_second_fit"][k], q["after_second_fit"][k]) for k in p["after_second_fit"])


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


def _uneven_sized_fit(rank, world_size, pipeline):
    import warnings

    from torch.utils.data import DataLoader

    from lightning_rec.data.batch import passthrough_collate

    class UnevenData(SyntheticCriteoDataModule):  # map-style: rank r has 3 + r batches, and its loader says so
        def train_dataloader(self):
            split = self.make_split("train")
            batches = [split.__getitems__(list(range(i * 64, (i + 1) * 64))) for i in range(3 + rank)]
            return DataLoader(batches, batch_size=None, collate_fn=passthrough_collate)

    L.seed_everything(0)
    data = UnevenData(num_train_samples=1024, num_val_samples=192, batch_size=64, num_embeddings_per_feature=64)
    trainer = L.Trainer(strategy=RecStrategy(pipeline=pipeline), accelerator="cpu", devices=world_size, max_epochs=2,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(DLRMModule(**SMALL), data)
    skipped = [str(w.message) for w in caught if "batches are skipped" in str(w.message)]
    return trainer.global_step, len(skipped), trainer.fit_loop.epoch_loop.val_loop.batch_progress.total.completed


@pytest.mark.parametrize("pipeline", [False, True])
def test_ranks_with_uneven_sized_loaders_stop_together(pipeline):
    """Sized loaders of 3, 4 and 5 batches on 3 ranks: the epoch ends after 3 on every rank. Lightning's loop on a
    rank whose loader had more validated at another batch (or not at all), and ran one more advance to find its
    loader stopped, whose collective (the SIGTERM broadcast) paired with another elsewhere: CollectiveMismatch. The
    ranks now agree on the fewest batches when the loaders are set up (as limit_train_batches would), and the
    ranks with more say once that theirs are cut."""
    results = run_ranks(_uneven_sized_fit, 3, pipeline, timeout=240, pg_timeout=60)
    assert [r[0] for r in results] == [6, 6, 6]  # 3 steps per epoch on every rank, 2 epochs
    assert [r[1] for r in results] == [0, 1, 1]  # the ranks with batches left say so, once
    assert len({r[2] for r in results}) == 1 and results[0][2] > 0  # every rank validated, as often


def test_ranks_with_uneven_batches_stop_together():
    # without the agreement, rank 0's 5th step would wait in its all-to-all until the timeout
    results = run_ranks(_uneven_fit, 2, timeout=180, pg_timeout=60)
    assert [r[0] for r in results] == [8, 8]  # 4 steps per epoch on both ranks, 2 epochs
    assert results[0][1] == 2 and results[1][1] == 0  # rank 0 said it skipped, once per epoch


# exact resume: SIGKILL every rank mid-epoch, resume from the last complete checkpoint ------------------

CRITEO = SHARED_DATA / "criteo"


class _KillAt(L.Callback):
    """SIGKILL this rank (no cleanup, no flush) when the trainer is about to take step `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def _gather_full(module) -> dict:
    """Every table, fused optimizer state and dense optimizer state, whole (collective)."""
    from lightning_rec.optim import merge_fused_state

    local = module.state_dict()
    sharded = {k: ShardedTensor(v.global_shape, [(m, t.clone()) for m, t in v.local_shards])
               for k, v in local.items() if isinstance(v, ShardedTensor)}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, sharded)
    out = {k: v.clone() for k, v in local.items() if not isinstance(v, ShardedTensor)}
    out.update({k: ShardedTensor.merge([p[k] for p in parts]).full() for k in sharded})
    optimizer = module.trainer.strategy.optimizers[0]
    fused = dict(optimizer.optimizers)["fused"]
    pieces = {k: (s, [(m, t.clone()) for m, t in p]) for k, (s, p) in fused.global_state_pieces().items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    out.update({f"fused:{k}": v for k, v in merge_fused_state(everyone).items()})
    for pid, st in dict(optimizer.optimizers)["dense"].state_dict()["state"].items():
        out.update({f"dense:{pid}.{n}": v.clone() for n, v in st.items() if torch.is_tensor(v)})
    return out


def _data(kind: str):
    from lightning_rec import CriteoDataModule

    if kind == "synthetic":  # 16 steps per epoch at 2 ranks
        return SyntheticCriteoDataModule(num_train_samples=4096, num_val_samples=512, batch_size=128,
                                         num_embeddings_per_feature=64)
    return CriteoDataModule(train_path=str(CRITEO / "criteo_kaggle_train_sample.tsv"),
                            val_path=str(CRITEO / "criteo_kaggle_valid_sample.tsv"), batch_size=128,
                            num_embeddings_per_feature=64, streaming=kind == "criteo_stream",
                            drop_last=kind == "criteo", cache_dir=os.environ["LRT_CACHE"])


def _resume_run(rank, world_size, root, kind, kill_at, resume, every, checkpoint_format="dcp", pipeline=False):
    from lightning.pytorch.callbacks import ModelCheckpoint

    os.environ["LRT_CACHE"] = os.path.join(root, "cache")
    L.seed_everything(0)
    callbacks = [ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=every, save_top_k=-1,
                                 save_last=True)]
    if kill_at is not None:
        callbacks.append(_KillAt(kill_at))
    strategy = RecStrategy(checkpoint_format=checkpoint_format, pipeline=pipeline)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_epochs=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                        num_sanity_val_steps=0)
    module = DLRMModule(**SMALL)
    trainer.fit(module, _data(kind), ckpt_path="last" if resume else None)
    return trainer.global_step, _gather_full(module)


_WHOLE: dict[str, list] = {}  # the uninterrupted run of each data kind (checkpoint frequency changes nothing)


def _exact_resume(tmp_path, kind: str, kill_at: int, every: int, checkpoint_format: str = "dcp",
                  pipeline: bool = False) -> None:
    if kind not in _WHOLE:
        _WHOLE[kind] = run_ranks(_resume_run, 2, str(tmp_path / "whole"), kind, None, False, every, timeout=300)
    whole = _WHOLE[kind]
    root = str(tmp_path / "killed")
    killed = run_ranks(_resume_run, 2, root, kind, kill_at, False, every, checkpoint_format, pipeline,
                       timeout=300, allow_missing=True)
    assert killed == [None, None]  # every rank died
    last = Path(root, "ckpt", "last.ckpt")
    assert last.is_dir() if checkpoint_format == "dcp" else last.is_file()
    resumed = run_ranks(_resume_run, 2, root, kind, None, True, every, checkpoint_format, pipeline, timeout=300)
    assert resumed[0][0] == whole[0][0]
    reference, state = whole[0][1], resumed[0][1]
    assert reference.keys() == state.keys()
    differ = [k for k in reference if not torch.equal(reference[k], state[k])]
    assert not differ, differ  # bitwise: weights, fused optimizer state, dense optimizer state


def test_sigkill_mid_epoch_resumes_bitwise_synthetic(tmp_path):
    _exact_resume(tmp_path, "synthetic", kill_at=25, every=10)  # epoch 2 of 16 steps; resumes at step 20


def test_gathered_checkpoints_still_load_and_resume_bitwise(tmp_path):
    # the previous format: one file, every table whole (rank 0's loader position serves every rank here)
    _exact_resume(tmp_path, "synthetic", kill_at=25, every=10, checkpoint_format="gathered")


def test_sigkill_mid_epoch_resumes_bitwise_pipelined(tmp_path):
    # the pipeline's feeder reads batches ahead of the step: the saved position is still the step's
    _exact_resume(tmp_path, "synthetic", kill_at=25, every=10, pipeline=True)


def test_sigkill_at_epoch_boundary_resumes_bitwise(tmp_path):
    _exact_resume(tmp_path, "synthetic", kill_at=19, every=8)  # the step-16 checkpoint ends epoch 1


class _DropoutDLRM(DLRMModule):
    """DLRM with dropout on its logits: every training step draws from the global generator."""

    def forward(self, dense_features, sparse_features):
        return torch.nn.functional.dropout(super().forward(dense_features, sparse_features), 0.5, self.training)


def _dropout_run(rank, world_size, root, max_steps, resume, checkpoint_format):
    from lightning.pytorch.callbacks import ModelCheckpoint

    L.seed_everything(0)
    checkpoints = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=4, save_last=True)
    trainer = L.Trainer(strategy=RecStrategy(checkpoint_format=checkpoint_format), accelerator="cpu",
                        devices=world_size, max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[checkpoints], limit_val_batches=0)
    data = SyntheticCriteoDataModule(num_train_samples=1024, num_val_samples=128, batch_size=64,
                                     num_embeddings_per_feature=64)  # 8 steps per epoch at 2 ranks
    module = _DropoutDLRM(**SMALL)
    trainer.fit(module, data, ckpt_path="last" if resume else None)
    return _gather_full(module)


@pytest.mark.parametrize("checkpoint_format", ["dcp", "gathered"])
def test_resume_draws_the_same_dropout_as_the_uninterrupted_run(tmp_path, checkpoint_format):
    """Lightning's checkpoints hold no RNG state: a resumed run drew other dropout masks. Stopped at step 6
    (resumed from step 4, mid-epoch), run on past the epoch's end: bitwise equal to 12 steps straight."""
    whole = run_ranks(_dropout_run, 2, str(tmp_path / "whole"), 12, False, checkpoint_format, timeout=240)[0]
    root = str(tmp_path / "stopped")
    run_ranks(_dropout_run, 2, root, 6, False, checkpoint_format, timeout=240)
    resumed = run_ranks(_dropout_run, 2, root, 12, True, checkpoint_format, timeout=240)[0]
    if checkpoint_format == "gathered":  # the generators' states keep the file loadable as plain Lightning loads it
        assert torch.load(os.path.join(root, "ckpt", "last.ckpt"), weights_only=True)["lightning_rec"]["rng_states"]
    assert whole.keys() == resumed.keys()
    differ = [k for k in whole if not torch.equal(whole[k], resumed[k])]
    assert not differ, differ


class _TorchdataLoaderData(SyntheticCriteoDataModule):
    """A user's own torchdata StatefulDataLoader (not lightning_rec's): Lightning saves and restores its state."""

    def train_dataloader(self):
        from torchdata.stateful_dataloader import StatefulDataLoader

        from lightning_rec.data.batch import passthrough_collate

        return StatefulDataLoader(self.datasets["train"], batch_size=self.batch_size, collate_fn=passthrough_collate)


def _torchdata_run(rank, world_size, root, max_steps, resume):
    from lightning.pytorch.callbacks import ModelCheckpoint

    L.seed_everything(0)
    trainer = L.Trainer(strategy=RecStrategy(pipeline=True), accelerator="cpu", devices=world_size,
                        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_last=True)],
                        limit_val_batches=0)
    data = _TorchdataLoaderData(num_train_samples=1024, num_val_samples=128, batch_size=64,
                                num_embeddings_per_feature=64)  # 8 steps per epoch at 2 ranks
    module = DLRMModule(**SMALL)
    trainer.fit(module, data, ckpt_path="last" if resume else None)
    return _gather_full(module)


def test_pipelined_resume_of_a_users_stateful_loader_skips_no_batch(tmp_path):
    """The feeder reads ahead of the step: a torchdata StatefulDataLoader's state was saved past batches no step
    had trained, and the resumed run skipped them. Stopped at step 5 (resumed from 3): as 12 steps straight."""
    whole = run_ranks(_torchdata_run, 2, str(tmp_path / "whole"), 12, False, timeout=240)[0]
    run_ranks(_torchdata_run, 2, str(tmp_path / "stopped"), 5, False, timeout=240)
    resumed = run_ranks(_torchdata_run, 2, str(tmp_path / "stopped"), 12, True, timeout=240)[0]
    differ = [k for k in whole if not torch.equal(whole[k], resumed[k])]
    assert not differ, differ


needs_criteo = pytest.mark.skipif(not CRITEO.is_dir(), reason="shared Criteo samples not present")


@needs_criteo
def test_plain_lightning_resumes_a_criteo_stream_mid_epoch_exactly(tmp_path):
    """Without strategy="rec": Lightning reads a stream a batch ahead of the step and reads its checkpoint
    back with weights_only=True; the resumed run still ends on the uninterrupted one's weights."""
    from lightning_rec.cli import run_cli

    args = ["fit", "--config", "recipes/configs/dlrm_criteo_kaggle.yaml",
            f"--data.train_path={CRITEO / 'criteo_kaggle_train_sample.tsv'}", "--data.val_path=null",
            "--data.streaming=true", "--data.block_bytes=100000", "--trainer.max_steps=16",
            "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            "--trainer.enable_checkpointing=true", "--trainer.callbacks+=ModelCheckpoint",
            "--trainer.callbacks.every_n_train_steps=7", f"--trainer.callbacks.dirpath={tmp_path}",
            "--trainer.callbacks.save_top_k=-1", f"--trainer.default_root_dir={tmp_path}"]
    whole = run_cli(args).model.state_dict()
    resumed = run_cli([*args, f"--ckpt_path={tmp_path / 'epoch=0-step=7.ckpt'}"]).model.state_dict()
    assert not [k for k in whole if not torch.equal(whole[k], resumed[k])]


@needs_criteo
@pytest.mark.parametrize("kind", ["criteo", "criteo_stream"])
def test_sigkill_mid_epoch_resumes_bitwise_criteo(tmp_path, kind):
    _exact_resume(tmp_path, kind, kill_at=25, every=10)  # 17-18 steps per epoch at 2 ranks


def _destroyed_between_fits_worker(rank, world_size):
    """A script that destroys the process group between two fits (as Lightning itself does not)."""
    import gc

    from tests.dist_utils import expect_error

    def fit(module):
        trainer = L.Trainer(strategy="rec", accelerator="cpu", devices=world_size, max_steps=2, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(module, SyntheticCriteoDataModule(num_train_samples=512, num_val_samples=128, batch_size=64,
                                                      num_embeddings_per_feature=64))
        return trainer.global_step

    held = [DLRMModule(**SMALL)]
    fit(held[0])
    dist.destroy_process_group()
    # the same module: its shards' groups are gone; said before a new group is made
    refused = expect_error(ValueError, lambda: fit(held[0]), "destroy_process_group", "new LightningModule")
    held.clear()
    gc.collect()  # what the refused Trainer left in reference cycles
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = fit(DLRMModule(**SMALL))  # a new module: trains (it hung in its first collective)
    return refused, steps, [str(w.message) for w in caught if "destroy_process_group" in str(w.message)]


def test_fit_after_destroy_process_group_trains_a_new_module_and_refuses_the_old_one():
    for refused, steps, said in run_ranks(_destroyed_between_fits_worker, 2, timeout=180):
        assert steps == 2 and not said, said
        assert "del it" in refused, refused


def _pipelined_on_one_rank_worker(rank, world_size):
    from tests.dist_utils import expect_error

    trainer = L.Trainer(strategy=RecStrategy(pipeline=rank == 0, embedding_timeout=20), accelerator="cpu",
                        devices=world_size, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    data = SyntheticCriteoDataModule(num_train_samples=512, num_val_samples=128, batch_size=64,
                                     num_embeddings_per_feature=64)
    return expect_error(ValueError, lambda: trainer.fit(DLRMModule(**SMALL), data), "pipeline", "every rank")


def test_pipeline_on_some_ranks_only_is_refused_on_every_rank():
    """It failed 20 s later (the embedding timeout) with "DistStoreError: wait timeout ..., keys:
    /default_pg/0//2//cpu//0/1" on the pipelined rank and "Connection closed by peer" on the other."""
    for said in run_ranks(_pipelined_on_one_rank_worker, 2, timeout=120):
        assert "differs between ranks" in said, said


def _plain_ddp_worker(rank, world_size):
    import warnings

    from tests.dist_utils import expect_error

    def trainer():
        return L.Trainer(strategy="ddp", accelerator="cpu", devices=world_size, max_steps=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0)

    data = SyntheticCriteoDataModule(num_train_samples=512, num_val_samples=128, batch_size=64,
                                     num_embeddings_per_feature=64)
    module = DLRMModule(**SMALL)
    # training: each rank's fused update would move its own copy of the tables
    expect_error(ValueError, lambda: trainer().fit(module, data), "DDPStrategy", "drift apart", "strategy='rec'")
    metrics = trainer().validate(module, data, verbose=False)  # evaluation replicates the same weights: allowed
    # a user's own module around a collection: the collection itself says so, once
    ebc = module.model.sparse_arch.embedding_bag_collection
    batch = next(iter(data.train_dataloader()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            ebc(batch.sparse_features).values().sum().backward()
    said = [str(w.message) for w in caught if "drift apart" in str(w.message)]
    return len(said), said[0] if said else "", metrics[0]["val_auc"]


def test_fused_tables_under_plain_ddp_are_refused_not_left_to_drift():
    for count, message, _ in run_ranks(_plain_ddp_worker, 2, timeout=120):
        assert count == 1 and "2 ranks" in message and "--trainer.strategy=rec" in message, message


@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_true_half_precision_is_refused_naming_bf16_mixed(tmp_path, stage):
    """It failed deep in Lightning's module conversion, "tables keep their configured data_type", naming no
    Trainer argument; bf16-mixed trains (the dense layers autocast, the tables keep float32)."""
    data = SyntheticCriteoDataModule(num_train_samples=128, num_val_samples=64, batch_size=64,
                                     num_embeddings_per_feature=64)
    kw = dict(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"precision='bf16-true'\) converts every parameter.*bf16-mixed"):
        getattr(L.Trainer(precision="bf16-true", **kw), stage)(DLRMModule(**SMALL), data)
    module = DLRMModule(**SMALL)
    getattr(L.Trainer(precision="bf16-mixed", **kw), stage)(module, data)
    assert next(module.model.dense_arch.parameters()).dtype == torch.float32


def test_gradient_accumulation_says_the_fused_tables_update_every_batch(tmp_path):
    data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=0, batch_size=64,
                                     num_embeddings_per_feature=64)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match=r"accumulate_grad_batches=2 accumulates the dense layers' gradients only "
                                         r"under SingleDeviceStrategy.*Trainer\(strategy='rec'\)"):
        trainer.fit(DLRMModule(**SMALL), data)


class _OwnModule(L.LightningModule):
    """A user's LightningModule (not one of the library's): a fused collection and a dense layer."""

    def __init__(self):
        super().__init__()
        from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig

        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=64, embedding_dim=4,
                                                              feature_names=["C1"])],
                                          optimizer=FusedOptimizerConfig("sgd", lr=0.1))
        self.dense = torch.nn.Linear(13 + 4, 1)

    def training_step(self, batch, batch_idx):
        pooled = self.ebc(batch.sparse_features).values()
        logits = self.dense(torch.cat([batch.dense_features, pooled], 1)).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)

    def configure_optimizers(self):
        from lightning_rec.optim import combined_optimizer, dense_parameters

        return combined_optimizer(self, torch.optim.SGD(dense_parameters(self), lr=0.1))


def _one_table_fit(tmp_path, train: int = 128, val: int = 0, **trainer_kw):
    """A one-feature synthetic data module and quiet Trainer keywords (a fit of a few steps, CPU, one device)."""
    data = SyntheticCriteoDataModule(num_train_samples=train, num_val_samples=val, batch_size=64, num_sparse_features=1,
                                     num_embeddings_per_feature=64, num_signal_features=1)
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, default_root_dir=tmp_path)
    if not val:
        kw["limit_val_batches"] = 0
    return data, {**kw, **trainer_kw}


def test_gradient_accumulation_under_rec_is_quiet(tmp_path):
    """strategy="rec" gathers the fused tables' gradients over the micro-batches (tests/test_accumulation.py): no
    word about the dense layers only, for a user's module nor the library's."""
    import warnings

    data, kw = _one_table_fit(tmp_path, train=256, strategy="rec", max_steps=1)
    for module in (_OwnModule(), DLRMModule(**SMALL, sparse_feature_names=["C1"])):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            L.Trainer(accumulate_grad_batches=2, **kw).fit(module, data)
        assert not [w for w in caught if "accumulate_grad_batches" in str(w.message)]


class _DenseOnlyOptimizer(_OwnModule):
    def configure_optimizers(self):
        from lightning_rec.optim import dense_parameters

        return torch.optim.SGD(dense_parameters(self), lr=0.1)


class _TwoOptimizersModule(_OwnModule):
    """A second collection that trains with fused adam, reading the same feature."""

    def __init__(self):
        super().__init__()
        from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig

        self.adam_ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="a", num_embeddings=64, embedding_dim=4,
                                                                    feature_names=["C1"])],
                                               optimizer=FusedOptimizerConfig("adam", lr=0.01))
        self.dense = torch.nn.Linear(13 + 8, 1)

    def training_step(self, batch, batch_idx):
        pooled = torch.cat([self.ebc(batch.sparse_features).values(), self.adam_ebc(batch.sparse_features).values()], 1)
        logits = self.dense(torch.cat([batch.dense_features, pooled], 1)).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)


def test_collections_with_different_fused_optimizers_are_planned_by_their_own(tmp_path):
    """The strategy's planner was given the first collection's optimizer (sgd) for every table, so it replicated the
    adam collection's small table, and the fit stopped in sharding: 'table 'a' is data_parallel with fused optimizer
    adam, which replicated tables do not implement'."""
    data, kw = _one_table_fit(tmp_path, strategy="rec", max_steps=2)
    module = _TwoOptimizersModule()
    L.Trainer(**kw).fit(module, data)
    plan = module.trainer.strategy.plan.plan
    assert str(plan["ebc"]["t"].sharding_type) == "data_parallel"
    assert str(plan["adam_ebc"]["a"].sharding_type) != "data_parallel"


def test_a_planner_of_ones_own_prints_its_table_once(tmp_path, capsys):
    """RecStrategy(planner=EmbeddingShardingPlanner(topology)) (print_stats=True, its default): the planner printed
    its per-rank table, then the strategy printed it again."""
    from lightning_rec.planner import EmbeddingShardingPlanner, Topology

    data, kw = _one_table_fit(tmp_path, max_steps=1)
    planner = EmbeddingShardingPlanner(Topology(world_size=1))
    L.Trainer(strategy=RecStrategy(planner=planner), **kw).fit(_OwnModule(), data)
    assert capsys.readouterr().out.count("planner: 1 ranks") == 1


def test_a_dense_only_optimizer_beside_fused_tables_is_said(tmp_path):
    """configure_optimizers returning the dense optimizer alone: the tables trained on at their configured rate,
    untouched by the user's LR scheduler, and the checkpoints held none of their optimizer state, without a word."""
    data, kw = _one_table_fit(tmp_path, strategy="rec", max_steps=1)
    with pytest.warns(UserWarning, match=r"_DenseOnlyOptimizer's tables \(ebc\) train with the fused optimizer sgd "
                                         r".*returned no optimizer that holds it.*combined_optimizer\(self"):
        L.Trainer(**kw).fit(_DenseOnlyOptimizer(), data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(**kw).fit(_OwnModule(), data)  # combined_optimizer: nothing to say
    assert not [w for w in caught if "no optimizer that holds it" in str(w.message)]


def test_tables_built_on_meta_are_drawn_where_the_strategy_shards_them(tmp_path):
    """DLRMModule(embedding_device="meta"): no table values until Trainer(strategy="rec") shards them (Lightning's
    move to the device before sharding failed with "Cannot copy out of meta tensor", reported as a missing CUDA).
    It trains (loss falls), its checkpoint exports to a CPU module with the trained logits, and without
    strategy="rec" (or used unsharded) it says what gives the tables their values."""
    from lightning_rec import checkpoint as ckpt

    kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, default_root_dir=tmp_path)
    data = SyntheticCriteoDataModule(num_train_samples=2048, num_val_samples=512, batch_size=128,
                                     num_embeddings_per_feature=64)
    with pytest.raises(ValueError, match=r"built on device='meta' \(embedding_device='meta'\).*strategy='rec'"):
        L.Trainer(max_steps=1, **kw).fit(DLRMModule(**SMALL, embedding_device="meta"), data)
    with pytest.raises(ValueError, match="use 'cpu'.*or 'meta'"):
        DLRMModule(**SMALL, embedding_device="cuda:3")
    unsharded = DLRMModule(**SMALL, embedding_device="meta")
    data.setup("fit")
    batch = next(iter(data.val_dataloader()))
    with pytest.raises(ValueError, match=r"built on device='meta': its tables hold no values until"):
        unsharded(batch.dense_features, batch.sparse_features)

    L.seed_everything(0)
    module = DLRMModule(**SMALL, embedding_device="meta")
    trainer = L.Trainer(strategy="rec", max_epochs=2, **kw)
    first = trainer.validate(module, data, verbose=False)[0]["val_loss"]
    trainer.fit(module, data)
    after = trainer.validate(module, data, verbose=False)[0]["val_loss"]
    assert after < first, (first, after)
    trainer.save_checkpoint(tmp_path / "meta.ckpt")
    cpu = ckpt.load_exported(ckpt.export(tmp_path / "meta.ckpt", tmp_path / "export"))
    with torch.no_grad():
        torch.testing.assert_close(cpu(batch.dense_features, batch.sparse_features),
                                   module(batch.dense_features, batch.sparse_features))


def _logged_eval_loss(rank, world_size, pipeline):
    import torch.nn.functional as F

    class Module(DLRMModule):
        """A validation_step of one's own that logs its batch's mean loss, Lightning's way."""

        def validation_step(self, batch, batch_idx):
            super().validation_step(batch, batch_idx)  # val_logloss: the exact mean over every row
            logits = self(batch.dense_features, batch.sparse_features)
            self.log("my_val_loss", F.binary_cross_entropy_with_logits(logits, batch.labels), sync_dist=True,
                     batch_size=len(batch))

        def test_step(self, batch, batch_idx):
            super().test_step(batch, batch_idx)
            logits = self(batch.dense_features, batch.sparse_features)
            self.log("my_test_loss", F.binary_cross_entropy_with_logits(logits, batch.labels), sync_dist=True)

    L.seed_everything(0)
    # 129 rows in batches of 64: rank 0 has 2 batches, rank 1 one, then a 0-row batch while rank 0 finishes
    data = SyntheticCriteoDataModule(num_train_samples=128, num_val_samples=129, num_test_samples=129, batch_size=64,
                                     num_embeddings_per_feature=64)
    kw = dict(accelerator="cpu", devices=world_size, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False)
    module = Module(**SMALL)
    val = L.Trainer(strategy=RecStrategy(pipeline=pipeline), **kw).validate(module, data, verbose=False)[0]
    test = L.Trainer(strategy=RecStrategy(pipeline=pipeline), **kw).test(module, data, verbose=False)[0]
    return val, test


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_loss_logged_per_batch_is_not_nan_when_a_rank_steps_with_an_empty_batch(pipeline):
    """A rank whose evaluation share ran out steps with 0-row batches while the others finish. Their mean loss is
    NaN, and Lightning's weighted mean (value x batch_size) kept it: NaN x 0. A validation_step logging its
    loss, the usual `self.log("val_loss", loss)`, logged NaN at 2 ranks (EarlyStopping then stopped the run)."""
    # every row once, weighted by its batch's rows; Lightning syncs the rows counted as an integer mean over the
    # ranks, (65 + 64) / 2 -> 64, so the mean it gives is the sum over 128 rows, not 129 (at one rank it is exact)
    for val, test in run_ranks(_logged_eval_loss, 2, pipeline, timeout=180):
        assert val["my_val_loss"] == pytest.approx(val["val_logloss"] * 129 / 128, rel=1e-5)
        assert test["my_test_loss"] == pytest.approx(test["test_logloss"] * 129 / 128, rel=1e-5)


class _ScheduledModule(_OwnModule):
    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}


def test_a_new_fit_starts_the_fused_tables_at_their_configured_rate(tmp_path):
    """configure_optimizers builds the optimizers anew for every fit, and the dense part started again at its lr;
    the fused part started where the last scheduler had left the kernels (here 0.1 / 2**2 after two epochs), so a
    second fit of the same module, or a fit after Tuner.lr_find (whose sweep writes every group's lr), trained the
    tables at another rate than configured."""
    from lightning.pytorch.tuner import Tuner

    data, kw = _one_table_fit(tmp_path, strategy="rec")
    module = _ScheduledModule()
    L.Trainer(max_epochs=2, **kw).fit(module, data)
    assert module.ebc.fused_kernels()[0].get_learning_rate() == pytest.approx(0.025)  # the scheduler reached it
    second = L.Trainer(max_steps=1, **kw)
    second.fit(module, data)
    assert [g["lr"] for g in second.optimizers[0].param_groups] == pytest.approx([0.1, 0.1])

    module.lr = 0.1  # lr_find's attribute (it writes its suggestion there; configure_optimizers here ignores it)
    Tuner(L.Trainer(max_epochs=1, **kw)).lr_find(module, datamodule=data, num_training=4, min_lr=1e-5, max_lr=1e-3)
    third = L.Trainer(max_steps=1, **kw)
    third.fit(module, data)
    assert [g["lr"] for g in third.optimizers[0].param_groups] == pytest.approx([0.1, 0.1])


@pytest.mark.parametrize("callback", ["EMAWeightAveraging", "StochasticWeightAveraging"])
def test_weight_averaging_callbacks_are_refused_naming_the_way_out(tmp_path, callback):
    """Lightning's EMA / SWA callbacks pair the module's parameters with a copy made before sharding; the sharded
    tables are no parameters of the module, so the pairs slid and the first validation (EMA) or SWA epoch failed
    with "The size of tensor a (4) must match the size of tensor b (17)". Unsharded, on one device, they average
    the fused tables too (as plain tables trained by torch.optim.SGD: checked by hand)."""
    from lightning.pytorch import callbacks

    made = getattr(callbacks, callback)(**({"swa_lrs": 0.05, "swa_epoch_start": 1} if "Stochastic" in callback else {}))
    data, kw = _one_table_fit(tmp_path, val=64, max_epochs=2)
    with pytest.raises(ValueError, match=rf"callbacks=\[{callback}\(...\)\]\) cannot average sharded embedding "
                                         r"tables.*Remove the callback, or train on one device without"):
        L.Trainer(strategy="rec", callbacks=[made], **kw).fit(_OwnModule(), data)
    L.Trainer(callbacks=[made], **kw).fit(_OwnModule(), data)  # the way out trains


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_says_the_fused_tables_are_not_clipped(tmp_path, algorithm):
    """Trainer(gradient_clip_val=...) clipped the dense layers only, by the dense layers' norm, without a word: the
    fused rows had moved inside backward, from unclipped gradients (the user's own module and the library's)."""
    data, kw = _one_table_fit(tmp_path, max_steps=1, gradient_clip_val=0.5, gradient_clip_algorithm=algorithm)
    norm = ", and the norm clipped is the dense layers' alone" if algorithm == "norm" else ""
    said = (rf"gradient_clip_val=0.5 clips the dense layers' gradients only: the fused tables \(%s\) update inside "
            rf"backward, before Lightning clips, from unclipped gradients{norm}\. The fused update clips nothing")
    with pytest.warns(UserWarning, match=said % "ebc"):
        L.Trainer(strategy="rec", **kw).fit(_OwnModule(), data)
    with pytest.warns(UserWarning, match=said % r"model\.sparse_arch\.embedding_bag_collection"):
        L.Trainer(**kw).fit(DLRMModule(**SMALL, sparse_feature_names=["C1"]), data)


class _HalfTableModule(_OwnModule):
    """FP16 tables (the README's half-size tables) with row-wise Adagrad."""

    def __init__(self):
        super().__init__()
        from lightning_rec import DataType, EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig

        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=64, embedding_dim=4,
                                                              feature_names=["C1"], data_type=DataType.FP16)],
                                          optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.1))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fp16_tables_replicated_by_the_plan_train_as_unsharded(tmp_path, precision):
    """The planner replicates small tables (data_parallel). An FP16 replica ran row-wise Adagrad in float16: a
    batch's mean squared gradient and eps=1e-8 rounded to 0, the row stepped by g / 0, and the loss was NaN within
    the first epoch (at 1 rank; unsharded it trained). Under bf16-mixed the replica's lookup failed instead, "Unexpected
    floating ScalarType in at::autocast::prioritize" (torch.cat of float16 outputs under CPU autocast)."""
    from lightning_rec.model_parallel import construct_module_sharding_plan, data_parallel
    from lightning_rec.types import ShardingPlan

    data, kw = _one_table_fit(tmp_path, train=1024, max_epochs=1, precision=precision)
    trained = {}
    for name in ("unsharded", "replicated"):
        L.seed_everything(0)
        module = _HalfTableModule()
        strategy = "auto"
        if name == "replicated":
            plan = ShardingPlan({"ebc": construct_module_sharding_plan(module.ebc, {"t": data_parallel()},
                                                                       world_size=1)})
            strategy = RecStrategy(plan=plan)
        L.Trainer(strategy=strategy, **kw).fit(module, data)
        trained[name] = {k: v.float() for k, v in module.state_dict().items()}
    for key, weight in trained["unsharded"].items():
        assert torch.isfinite(trained["replicated"][key]).all(), key
        # float16 tables: the two round their rows apart by an ulp or two (2.4e-4 at 0.25..0.5)
        torch.testing.assert_close(trained["replicated"][key], weight, atol=2e-3, rtol=0, msg=key)


# fine-tuning: Lightning's BaseFinetuning over sharded tables -------------------------------------------------------

_FT_ROWS, _FT_DIMS = {"t0": 11, "t1": 7, "t2": 5}, {"t0": 8, "t1": 4, "t2": 4}


def _ft_batch(rank: int, step: int):
    from lightning_rec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 3, (3 * 2,), generator=g)  # 3 features x 2 samples
    values = torch.cat([torch.randint(0, n, (int(lengths[2 * f : 2 * f + 2].sum()),), generator=g)
                        for f, n in enumerate(_FT_ROWS.values())])
    return KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], values, lengths)


class _FinetuneTower(L.LightningModule):
    def __init__(self, fused: bool = True) -> None:
        from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig

        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(
            [EmbeddingBagConfig(name=t, num_embeddings=n, embedding_dim=_FT_DIMS[t], feature_names=[f"f{i}"])
             for i, (t, n) in enumerate(_FT_ROWS.items())],
            optimizer=FusedOptimizerConfig("sgd", lr=0.1) if fused else None)
        self.dense = torch.nn.Linear(sum(_FT_DIMS.values()), 2)

    def forward(self, kjt):
        return self.dense(self.ebc(kjt).values()).square().sum()

    def training_step(self, batch, batch_idx):
        return self(batch)

    def configure_optimizers(self):
        from lightning_rec import combined_optimizer

        return combined_optimizer(self, torch.optim.SGD(self.dense.parameters(), lr=0.1))


def _gathered_tables(ebc) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in ebc.state_dict().items():
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, [(m, t.clone()) for m, t in value.local_shards]
                               if isinstance(value, ShardedTensor) else [(None, value.clone())])
        whole = torch.zeros(*value.shape) if not isinstance(value, ShardedTensor) else torch.zeros(*value.global_shape)
        for m, t in (p for rank_pieces in pieces for p in rank_pieces):
            (r, c), (nr, nc) = m.shard_offsets if m else (0, 0), m.shard_sizes if m else t.shape
            whole[r : r + nr, c : c + nc] = t
        out[key] = whole
    return out


def _base_finetuning_worker(rank, world_size):
    from lightning.pytorch.callbacks import BaseFinetuning

    from lightning_rec.model_parallel import construct_module_sharding_plan, data_parallel, row_wise, table_wise
    from lightning_rec.types import ShardingPlan

    class Finetune(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.ebc)

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.ebc, optimizer)
            if epoch == 2:  # after sharding, through the sharded collection's parameters
                self.freeze(pl_module.ebc)

    class Snapshots(L.Callback):
        def __init__(self):
            self.tables = []

        def on_train_epoch_start(self, trainer, pl_module):
            self.tables.append(_gathered_tables(pl_module.ebc))

        def on_train_end(self, trainer, pl_module):
            self.tables.append(_gathered_tables(pl_module.ebc))

    module, snapshots = _FinetuneTower(), Snapshots()
    start = {k: v.clone() for k, v in module.state_dict().items()}
    layout = {"t0": row_wise(), "t1": table_wise(rank=1), "t2": data_parallel()}
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(module.ebc, layout, world_size=world_size)})
    loader = torch.utils.data.DataLoader([_ft_batch(rank, step) for step in range(2)], batch_size=None)
    L.Trainer(strategy=RecStrategy(plan=plan), accelerator="cpu", devices=world_size, max_epochs=3, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              use_distributed_sampler=False, callbacks=[Finetune(), snapshots]).fit(module, loader)
    return start, snapshots.tables


def test_base_finetuning_freezes_and_unfreezes_sharded_tables_under_strategy_rec():
    """Lightning's BaseFinetuning under Trainer(strategy="rec") with combined_optimizer stopped at the first epoch
    start with Lightning's KeyError (a tensor: the fused param groups held the shards' kernel views, no parameters of
    the module), and freezing after sharding did not reach the tables. Now the tables stay bitwise unchanged while
    frozen (epoch 0 frozen before sharding, epoch 2 frozen after it) and train in epoch 1 as an unsharded collection
    under plain SGD over both ranks' batches does."""
    world_size = 2
    start, tables = run_ranks(_base_finetuning_worker, world_size, timeout=180)[0]
    reference = _FinetuneTower(fused=False)
    reference.load_state_dict(start)
    embedding_opt = torch.optim.SGD(reference.ebc.parameters(), lr=0.1)
    dense_opt = torch.optim.SGD(reference.dense.parameters(), lr=0.1 / world_size)  # DDP averages the dense grads
    expected = []
    for epoch in range(3):
        expected.append({k: v.detach().clone() for k, v in reference.ebc.state_dict().items()})
        for step in range(2):
            sum(reference(_ft_batch(r, step)) for r in range(world_size)).backward()
            dense_opt.step()
            if epoch == 1:
                embedding_opt.step()
            dense_opt.zero_grad()
            embedding_opt.zero_grad()
    expected.append({k: v.detach().clone() for k, v in reference.ebc.state_dict().items()})
    for epoch, (got, want) in enumerate(zip(tables, expected)):
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0, msg=f"{key} at epoch {epoch}")
    assert all(torch.equal(tables[0][k], tables[1][k]) for k in tables[0])  # frozen: bitwise
    assert all(torch.equal(tables[2][k], tables[3][k]) for k in tables[0])
    assert not torch.equal(tables[1]["embedding_bags.t0.weight"], tables[2]["embedding_bags.t0.weight"])


class _FinetuneHead(_FinetuneTower):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(2, 1)

    def forward(self, kjt):
        return self.head(self.dense(self.ebc(kjt).values())).square().sum()


def _finetuning_resume_worker(rank, world_size, tmp_path):
    from lightning.pytorch.callbacks import BaseFinetuning

    class Finetune(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.head)

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.head, optimizer, lr=0.05, initial_denom_lr=1.0)

    def fit(max_epochs, ckpt_path=None):
        module = _FinetuneHead()
        loader = torch.utils.data.DataLoader([_ft_batch(rank, step) for step in range(2)], batch_size=None)
        trainer = L.Trainer(strategy="rec", accelerator="cpu", devices=world_size, max_epochs=max_epochs,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False, callbacks=[Finetune()])
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return module, trainer

    module, trainer = fit(2)
    trainer.save_checkpoint(f"{tmp_path}/finetuned.ckpt")
    saved = trainer.optimizers[0].optimizers[1][1].state_dict()
    resumed, trainer = fit(2, ckpt_path=f"{tmp_path}/finetuned.ckpt")  # restores, trains nothing more
    dense = trainer.optimizers[0].optimizers[1][1]
    assert dense.param_groups[1]["params"] == list(resumed.head.parameters())
    torch.testing.assert_close(dense.state_dict(), saved, atol=0, rtol=0)
    torch.testing.assert_close(resumed.head.weight, module.head.weight, atol=0, rtol=0)


def test_a_run_that_base_finetuning_added_groups_to_resumes_under_strategy_rec(tmp_path):
    """BaseFinetuning puts the param groups it added back in on_fit_start, from its saved state, but RecStrategy
    restores checkpoints after setup (into the sharded tables), so Lightning loaded that state only after on_fit_start:
    resuming failed with torch's "loaded state dict has a different number of parameter groups". Now RecStrategy
    replays BaseFinetuning's restore before the optimizer state loads."""
    run_ranks(_finetuning_resume_worker, 1, str(tmp_path), timeout=120)


def _dense_unfrozen_worker(rank, world_size):
    from lightning.pytorch.callbacks import BaseFinetuning

    class Finetune(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.head)  # before DDP is built: DDP left the head out

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.head, optimizer, lr=0.1, initial_denom_lr=1.0)
            if epoch == 2:
                self.freeze(pl_module.dense)  # after it: DDP waited for gradients that never came

    module = _FinetuneHead()
    loader = torch.utils.data.DataLoader([_ft_batch(rank, step) for step in range(2)], batch_size=None)
    L.Trainer(strategy="rec", accelerator="cpu", devices=world_size, max_epochs=3, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              use_distributed_sampler=False, callbacks=[Finetune()]).fit(module, loader)
    return {k: v.detach().clone() for k, v in module.named_parameters() if k.startswith(("head", "dense"))}


def test_dense_layers_unfrozen_after_ddp_was_built_average_their_gradients():
    """BaseFinetuning froze a dense layer before training (before DDP is built), then unfroze it: DDP had left it out,
    so each rank trained it on its own batches and the replicas drifted apart silently (Lightning's DDP too). A
    layer frozen after DDP was built stopped DDP's reduction. Now RecStrategy builds DDP again when the trainable
    dense set changes: both ranks hold the same head, as plain SGD over both ranks' batches gives it."""
    world_size = 2
    got = run_ranks(_dense_unfrozen_worker, world_size, timeout=180)
    reference = _FinetuneHead()  # its tables train with their own fused sgd inside backward, as the sharded ones
    dense_opt = torch.optim.SGD(reference.dense.parameters(), lr=0.1 / world_size)  # DDP averages the dense grads
    head_opt = torch.optim.SGD(reference.head.parameters(), lr=0.1 / world_size)
    for epoch in range(3):
        for step in range(2):
            sum(reference(_ft_batch(r, step)) for r in range(world_size)).backward()
            if epoch < 2:
                dense_opt.step()
            if epoch >= 1:
                head_opt.step()
            dense_opt.zero_grad()
            head_opt.zero_grad()
    for name, value in got[0].items():
        torch.testing.assert_close(got[1][name], value, atol=0, rtol=0, msg=f"ranks disagree on {name}")
    for name, value in got[0].items():
        torch.testing.assert_close(value, dict(reference.named_parameters())[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_module_sharded_by_rec_refuses_a_dtype_cast_and_trains_under_mixed_precision(tmp_path, precision):
    """After strategy="rec" sharded it, module.double() / .half() were accepted without a word (the dense layers
    converted, the tables not), while the unsharded collection refuses; the mixed precisions autocast, untouched."""
    data, kw = _one_table_fit(tmp_path, strategy="rec", max_steps=2, precision=precision)
    module = _OwnModule()
    L.Trainer(**kw).fit(module, data)
    for cast in (module.double, module.half):
        with pytest.raises(ValueError, match=r"sharded EmbeddingBagCollection tables keep their configured data_type"):
            cast()
    module.to("cpu")
    assert {p.dtype for p in module.parameters()} == {torch.float32}


class _ManualModule(_OwnModule):
    """Manual optimization stepping every `every` batches (gradients accumulated by hand)."""

    def __init__(self, every: int, raw: bool = False):
        super().__init__()
        self.automatic_optimization = False
        self.every, self.raw = every, raw

    def training_step(self, batch, batch_idx):
        opt = self.optimizers(use_pl_optimizer=not self.raw)
        self.manual_backward(super().training_step(batch, batch_idx) / self.every)
        if (batch_idx + 1) % self.every == 0:
            opt.step()
            opt.zero_grad()


def test_manual_gradient_accumulation_with_fused_tables_warns_once(tmp_path):
    """Manual optimization with opt.step() every 2 batches: the fused tables still updated at every backward, without
    a word (the automatic path warns through accumulate_grad_batches)."""
    import warnings

    data, kw = _one_table_fit(tmp_path, train=256, strategy="rec", max_epochs=1)
    with pytest.warns(UserWarning, match=r"second backward \(self.manual_backward\) before an optimizer step.*"
                                         r"fused tables \(ebc\) update inside every backward") as caught:
        L.Trainer(**kw).fit(_ManualModule(every=2), data)
    said = [w for w in caught if "second backward" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__  # once, at the user's manual_backward line
    semi_sync = RecStrategy(pipeline=PipelineConfig(semi_sync=True))
    for module, strategy in ((_ManualModule(every=1), "rec"), (_ManualModule(every=1, raw=True), semi_sync)):
        with warnings.catch_warnings(record=True) as caught:  # a step after every backward: quiet
            warnings.simplefilter("always")
            L.Trainer(**{**kw, "strategy": strategy}).fit(module, data)
        assert not [w for w in caught if "second backward" in str(w.message)]
    # the semi-synchronous pipeline cannot look ahead of a manual step's own backward: it says so, once
    assert len([w for w in caught if "manual optimization: the step runs its own backward" in str(w.message)]) == 1


def _planner_built_before_the_ranks_worker(rank, world_size, planner):
    data, kw = _one_table_fit(None, devices=world_size, strategy=RecStrategy(planner=planner), max_steps=1)
    module = _OwnModule()
    L.Trainer(**kw).fit(module, data)
    return str(module.trainer.strategy.plan.plan["ebc"]["t"].sharding_type), planner._cost_args[0]


def test_a_planner_built_before_the_ranks_plans_for_the_runs_ranks():
    """RecStrategy(planner=EmbeddingShardingPlanner(constraints=...)) built before Trainer(devices=2) started the ranks
    (as a recipe's `planner:` is): its default topology had one rank, and the fit stopped with "Topology(world_size=1)
    but the process group has 2 ranks". What it left to its defaults (topology, batch size) is now the run's."""
    from lightning_rec.planner import EmbeddingShardingPlanner, ParameterConstraints

    planner = EmbeddingShardingPlanner(constraints={"t": ParameterConstraints(sharding_types=["row_wise"])},
                                       print_stats=False)
    assert planner.topology.world_size == 1  # no process group here
    for sharding_type, batch_size in run_ranks(_planner_built_before_the_ranks_worker, 2, planner, timeout=180):
        assert sharding_type == "row_wise" and batch_size == 64  # the constraint kept; the data's batch per rank


# SIGTERM (a preempted job) and other signals, 2 ranks ---------------------------------------------------------


class _MarkAt(L.Callback):
    """Writes this rank's pid to `<out>/at<rank>` once training reaches step `step` (`during` "train"), or the
    validation or checkpoint save after it, and slows things from there on (the signal comes while the ranks work, in
    or between their collectives); notes the exception fit ends with."""

    def __init__(self, out: str, step: int, during: str = "train") -> None:
        self.out, self.step, self.during, self.seen = out, step, during, None

    def _mark(self, trainer, during: str, pause: float) -> None:
        if self.during != during or trainer.global_step < self.step:
            return
        path = os.path.join(self.out, f"at{trainer.global_rank}")
        if not os.path.exists(path):
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
        time.sleep(pause)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._mark(trainer, "train", 0.05)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._mark(trainer, "validation", 0.1)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self._mark(trainer, "save", 0.5)  # before its files are written: the signal comes in the save

    def on_exception(self, trainer, pl_module, exception):
        self.seen = (type(exception).__name__, trainer.global_step)


def _signalled_fit(rank, world_size, out, pipeline, during="train", num_workers=0):
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_samples=64 * 2 * 200, num_val_samples=64 * 2 * 40, batch_size=64,
                                     num_embeddings_per_feature=64, num_workers=num_workers)
    mark = _MarkAt(out, step=3, during=during)
    callbacks = [mark, OnExceptionCheckpoint(dirpath=out)]
    if during == "save":
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(out, "every"), every_n_train_steps=4, save_top_k=-1))
    trainer = L.Trainer(strategy=RecStrategy(pipeline=pipeline, embedding_timeout=20), accelerator="cpu",
                        devices=world_size, max_steps=120, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=40 if during == "validation" else 0, val_check_interval=4,
                        callbacks=callbacks)
    try:
        trainer.fit(DLRMModule(**SMALL), data)
        ended = "finished"
    except SystemExit as e:  # Lightning's SIGTERMException is one
        ended = type(e).__name__
    return ended, mark.seen, trainer.global_step


def _signal_when_marked(out: str, ranks: list[int], signum: int, deadline_s: float = 60.0, children: bool = False):
    """A thread that sends `signum` to each of `ranks` once it has written its marker (from outside, as a scheduler
    does: wherever the rank is then, a collective included); `children`: to the rank's own processes too (its
    DataLoader workers), as SLURM signals every process of a job step."""
    import threading

    def send():
        end = time.monotonic() + deadline_s
        pending = list(ranks)
        while pending and time.monotonic() < end:
            for r in list(pending):
                path = os.path.join(out, f"at{r}")
                if os.path.exists(path):
                    pid = int(Path(path).read_text())
                    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split() if children else []
                    for p in [pid, *map(int, kids)]:
                        os.kill(p, signum)
                    pending.remove(r)
            time.sleep(0.01)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("ranks,pipeline", [([0, 1], False), ([1], True), ([0], False)],
                         ids=["both", "rank1-only-pipelined", "rank0-only"])
def test_sigterm_stops_every_rank_after_the_same_step_and_saves_on_exception(tmp_path, ranks, pipeline):
    """A preempted job: SIGTERM to every rank, or to one. Lightning 2.6's handler ran a broadcast inside the signal
    handler, paired with whatever collective the other rank was in: the ranks hung, or failed with
    CollectiveMismatch (rank 0 in its id all-to-all, rank 1 in the handler's broadcast); a rank signalled alone
    stopped alone. Now every rank stops after the same step with Lightning's SIGTERMException (SystemExit), and the
    callbacks' on_exception saves a whole checkpoint there."""
    from lightning_rec.checkpoint import read_lightning_state

    out = str(tmp_path)
    sender = _signal_when_marked(out, ranks, signal.SIGTERM)
    results = run_ranks(_signalled_fit, 2, out, pipeline, timeout=90)
    sender.join()
    assert [r[0] for r in results] == ["SIGTERMException"] * 2, results
    assert results[0][1] == results[1][1] and results[0][1][0] == "SIGTERMException", results  # the same step
    step = results[0][2]
    assert 3 <= step < 120 and results[1][2] == step, results  # stopped early, together
    saved = read_lightning_state(tmp_path / "on_exception.ckpt")
    assert saved["global_step"] == step


@pytest.mark.parametrize("during", ["validation", "save"])
def test_sigterm_during_validation_or_a_checkpoint_save_stops_every_rank_after_it(tmp_path, during):
    """The signal comes while the ranks validate (40 batches from step 4), or inside a checkpoint save (every 4 steps).
    Lightning's handler broadcast inside the validation's or the save's collectives (CollectiveMismatch, or a hang);
    now the save finishes whole, and every rank stops together at its next batch."""
    from lightning_rec.checkpoint import read_lightning_state

    out = str(tmp_path)
    sender = _signal_when_marked(out, [1], signal.SIGTERM)
    results = run_ranks(_signalled_fit, 2, out, False, during, timeout=90)
    sender.join()
    assert [r[0] for r in results] == ["SIGTERMException"] * 2, results
    assert results[0][1] == results[1][1] and results[0][2] == results[1][2], results
    step = results[0][2]
    assert read_lightning_state(tmp_path / "on_exception.ckpt")["global_step"] == step
    if during == "validation":  # stopped inside the first validation, before its end
        assert step == 4, results
    else:  # the save the signal came in (after step 4; batch 5 was agreed on before it) is whole, under its name
        assert step == 5 and read_lightning_state(tmp_path / "every" / "epoch=0-step=4.ckpt")["global_step"] == 4
        assert not [p.name for p in (tmp_path / "every").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("pipeline", [False, True])
def test_sigterm_to_every_process_of_the_job_spares_the_dataloader_workers(tmp_path, pipeline):
    """SLURM signals every process of a preempted job step, the DataLoader workers too. torch's workers died of it at
    once, and the fit failed with "DataLoader worker (pid N) is killed by signal: Terminated" instead of stopping after
    the agreed step; they now leave a SIGTERM that is not their rank's to the rank (which still ends them with one)."""
    out = str(tmp_path)
    sender = _signal_when_marked(out, [0, 1], signal.SIGTERM, children=True)
    results = run_ranks(_signalled_fit, 2, out, pipeline, "train", 1, timeout=90)
    sender.join()
    assert [r[0] for r in results] == ["SIGTERMException"] * 2, results
    assert results[0][1] == results[1][1] and results[0][2] == results[1][2], results


def _slurm_requeue_fit(rank, world_size, out, pipeline):
    from lightning.fabric.plugins.environments import SLURMEnvironment

    # what srun gives each task (the process group is up already, on MASTER_ADDR / MASTER_PORT)
    os.environ.update(SLURM_NTASKS=str(world_size), SLURM_NTASKS_PER_NODE=str(world_size), SLURM_PROCID=str(rank),
                      SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_JOB_ID="4242", SLURM_JOB_NAME="train",
                      SLURM_NODELIST="localhost")
    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_samples=64 * 2 * 200, num_val_samples=128, batch_size=64,
                                     num_embeddings_per_feature=64)
    trainer = L.Trainer(strategy=RecStrategy(pipeline=pipeline, embedding_timeout=20), accelerator="cpu",
                        devices=world_size, max_steps=40, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                        limit_val_batches=0, default_root_dir=out,
                        plugins=[SLURMEnvironment(auto_requeue=True)], callbacks=[_MarkAt(out, step=3)])
    trainer.fit(DLRMModule(**SMALL), data)
    return trainer.global_step


@pytest.mark.parametrize("pipeline", [False, True])
def test_slurm_requeue_signal_saves_on_every_rank_at_the_same_batch(tmp_path, pipeline):
    """SLURM's requeue signal (`sbatch --signal=SIGUSR1@90`, Lightning's auto_requeue) to one rank: Lightning's handler
    saved the checkpoint, a collective, inside the signal handler, on that rank alone (the other one was in a step:
    CollectiveMismatch, or a hang). Now every rank saves it at the same batch, whole, and training goes on (then rank
    0 asks scontrol to requeue the job, which fails here without SLURM and says so)."""
    from lightning_rec.checkpoint import read_lightning_state

    out = str(tmp_path)
    sender = _signal_when_marked(out, [1], signal.SIGUSR1)
    steps = run_ranks(_slurm_requeue_fit, 2, out, pipeline, timeout=90)
    sender.join()
    assert steps == [40, 40]
    saved = read_lightning_state(tmp_path / "hpc_ckpt_1.ckpt")
    assert 3 <= saved["global_step"] < 40, saved["global_step"]


def _broadcasts_per_fit(rank, world_size, steps):
    import torch.distributed as tdist

    calls = []
    plain = tdist.broadcast

    def counted(*args, **kwargs):
        calls.append(1)
        return plain(*args, **kwargs)

    tdist.broadcast = counted  # counts the calls made through the module's name (Lightning's per-step one is)
    try:
        L.seed_everything(0)
        data = SyntheticCriteoDataModule(num_train_samples=64 * 2 * steps, num_val_samples=64, batch_size=64,
                                         num_embeddings_per_feature=64)
        trainer = L.Trainer(strategy=RecStrategy(embedding_timeout=20), accelerator="cpu", devices=world_size,
                            max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=False)
        trainer.fit(DLRMModule(**SMALL), data)
    finally:
        tdist.broadcast = plain
    return len(calls), trainer.global_step


def test_no_sigterm_broadcast_and_host_read_per_training_step():
    """Lightning's epoch loop broadcast rank 0's SIGTERM flag before every training batch and read it back
    (`.item()`): a collective per step and, over NCCL, a host sync per step that stalls the stream. Under rec every
    rank's flag is set at the same batch, so each rank reads its own: no broadcast a step."""
    for calls, step in run_ranks(_broadcasts_per_fit, 2, 12, timeout=90):
        assert step == 12 and calls < 12, (calls, step)


class _StopWhenPickled:
    """A checkpoint entry that stops its rank (SIGSTOP to itself, after writing its pid to `<out>/at<rank>`) as DCP
    pickles it: inside dcp.save, between its exchanges."""

    def __init__(self, out: str, rank: int) -> None:
        self.out, self.rank = out, rank

    def __reduce__(self):
        path = os.path.join(self.out, f"at{self.rank}")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
        os.kill(os.getpid(), signal.SIGSTOP)
        return (str, ("resumed",))


class _StopInDCP(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.global_step == 4 and trainer.global_rank == 1:
            checkpoint["state_dict"]["stop_here"] = _StopWhenPickled(self.out, 1)


def _stopped_in_save_fit(rank, world_size, out, where):
    from lightning.pytorch.callbacks import ModelCheckpoint

    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_samples=64 * 2 * 40, num_val_samples=64, batch_size=64,
                                     num_embeddings_per_feature=64)
    every = ModelCheckpoint(dirpath=os.path.join(out, "every"), every_n_train_steps=2, save_top_k=-1)
    stopper = _MarkAt(out, step=3, during="save") if where == "before" else _StopInDCP(out)
    trainer = L.Trainer(strategy=RecStrategy(embedding_timeout=3), accelerator="cpu", devices=world_size,
                        max_steps=40, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[stopper, every])
    try:
        trainer.fit(DLRMModule(**SMALL), data)
        return "finished", "", trainer.global_step
    except Exception as e:  # noqa: BLE001 - what each rank saw is the test's subject
        return type(e).__name__, str(e), trainer.global_step
    finally:
        Path(out, f"ended{rank}").touch()


@pytest.mark.parametrize("where", ["before", "in_dcp"])
def test_a_rank_stopped_in_a_sharded_save_is_named_within_the_embedding_timeout(tmp_path, where):
    """Rank 1 is stopped (SIGSTOP: alive, stuck) as the checkpoint save at step 4 begins, or inside dcp.save. The
    save's exchanges (and DCP's) ran on the default group: rank 0 waited for its timeout (Lightning's: 30 min), leaving
    a hidden partial directory. Now they run through the embedding group's guard (DCP's on a checkpoint group with the
    same timeout): rank 0 raises within RecStrategy(embedding_timeout=...) naming rank 1 and the setting, and the
    step-2 checkpoint is intact."""
    from lightning_rec.checkpoint import full_state_dict, read_lightning_state

    out = str(tmp_path)
    sender = _signal_when_marked(out, [1], signal.SIGSTOP) if where == "before" else None
    resumer = _resume_rank1_when_rank0_ends(tmp_path, sender)
    results = run_ranks(_stopped_in_save_fit, 2, out, where, timeout=60, pg_timeout=120, allow_missing=True)
    resumer.join()
    kind, message, step = results[0]
    assert kind == "CollectiveTimeout" and step == 4, results[0]
    assert "rank 1 did not reach it within 3 s" in message and "RecStrategy(embedding_timeout=...)" in message, message
    assert "saving checkpoint" in message and "epoch=0-step=4.ckpt" in message, message
    names = sorted(p.name for p in (tmp_path / "every").iterdir() if not p.name.startswith("."))
    assert names == ["epoch=0-step=2.ckpt"], names  # nothing under the new name
    assert read_lightning_state(tmp_path / "every" / names[0])["global_step"] == 2
    assert full_state_dict(tmp_path / "every" / names[0])  # its tensors read back


class _MarkOnLoad(DLRMModule):
    """Writes this rank's pid to `<out>/at<rank>` as the checkpoint it resumes from is about to load, and pauses (the
    signal comes there)."""

    def __init__(self, out: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out = out

    def on_load_checkpoint(self, checkpoint):
        path = os.path.join(self.out, f"at{self.global_rank}")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
        time.sleep(0.5)


def _stopped_in_load_fit(rank, world_size, out):
    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_samples=64 * 2 * 40, num_val_samples=64, batch_size=64,
                                     num_embeddings_per_feature=64)
    kwargs = dict(accelerator="cpu", devices=world_size, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=False)
    trainer = L.Trainer(strategy=RecStrategy(embedding_timeout=3), max_steps=2, **kwargs)
    trainer.fit(DLRMModule(**SMALL), data)
    trainer.save_checkpoint(os.path.join(out, "first.ckpt"))
    trainer = L.Trainer(strategy=RecStrategy(embedding_timeout=3), max_steps=4, **kwargs)
    try:
        trainer.fit(_MarkOnLoad(out, **SMALL), data, ckpt_path=os.path.join(out, "first.ckpt"))
        return "finished", ""
    except Exception as e:  # noqa: BLE001 - what each rank saw is the test's subject
        return type(e).__name__, str(e)
    finally:
        Path(out, f"ended{rank}").touch()


def test_a_rank_stopped_while_a_sharded_checkpoint_loads_is_named_within_the_embedding_timeout(tmp_path):
    """Rank 1 is stopped (SIGSTOP) as the run resumes from a sharded checkpoint. DCP's load exchanges ran on the
    default group: rank 0 waited for its timeout (Lightning's: 30 min). Now they run on the checkpoint group
    (embedding_timeout), and the guard names rank 1 and the setting (not a damaged file)."""
    out = str(tmp_path)
    sender = _signal_when_marked(out, [1], signal.SIGSTOP)
    resumer = _resume_rank1_when_rank0_ends(tmp_path, sender)
    results = run_ranks(_stopped_in_load_fit, 2, out, timeout=60, pg_timeout=120, allow_missing=True)
    resumer.join()
    kind, message = results[0]
    assert kind == "CollectiveTimeout", results[0]
    assert "rank 1 did not reach it within 3 s" in message and "RecStrategy(embedding_timeout=...)" in message, message
    assert "reading checkpoint" in message and "first.ckpt" in message and "not at fault" in message, message


def _resume_rank1_when_rank0_ends(tmp_path, sender):
    """A thread that sends SIGCONT to the stopped rank 1 once rank 0 has ended (`ended0`), so that rank 1 can run on,
    find rank 0 gone, and exit; `sender`: the thread that stopped it (or None: it stopped itself)."""
    import threading

    def resume():
        if sender is not None:
            sender.join()
        end = time.monotonic() + 60
        while not (tmp_path / "ended0").exists() and time.monotonic() < end:
            time.sleep(0.05)
        os.kill(int((tmp_path / "at1").read_text()), signal.SIGCONT)

    thread = threading.Thread(target=resume, daemon=True)
    thread.start()
    return thread
