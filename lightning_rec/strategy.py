"""RecStrategy: `Trainer(strategy="rec")` shards embedding tables and keeps dense layers data parallel.

    trainer = L.Trainer(strategy="rec", accelerator="cpu", devices=2)
    trainer.fit(DLRMModule(...), CriteoDataModule(...))

Setup, on every rank: the LightningModule's embedding collections are swapped in place for sharded
ones by DistributedModelParallel (the plan is the user's `plan=`, else the planner's: `planner=`,
or one built from the topology), and the module is wrapped in DDP (or FSDP2) for its dense
layers. This happens before `configure_optimizers`, so the module's combined optimizer sees the
sharded fused kernels. Evaluation-only runs (validate/test/predict) are sharded too, without DDP.

Checkpoints (`checkpoint_format="dcp"`, the default) are sharded directories written through
torch.distributed.checkpoint: every rank writes its own shards and their fused optimizer state,
the dense layers and dense optimizer are written once, and a save commits only when whole.
Loading reads each rank's pieces into any world size or plan, or into the unsharded module, and
restores every rank's dataloader position (exact mid-epoch resume). See checkpoint.py.
`checkpoint_format="gathered"` writes the previous format: every table gathered whole to rank 0
one table at a time, one file written straight to disk (rank 0 holds the whole model once); both
formats load (a gathered file is memory-mapped: each rank reads only its pieces).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import sys
import warnings
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_rec import checkpoint as rec_checkpoint
from lightning_rec import comm
from lightning_rec.data.batch import Batch
from lightning_rec.embedding import fused_table_modules
from lightning_rec.model_parallel import DistributedModelParallel
from lightning_rec.planner import EmbeddingShardingPlanner
from lightning_rec.types import ShardingPlan

_SHARDED_BY = "_lightning_rec_dmp"  # LightningModule.__dict__ key: the DistributedModelParallel of its tables


def close_process_groups() -> None:
    """Destroy every process group and collect the objects that held one, while the interpreter is whole.

    Lightning leaves the process group open (another fit may follow in the same process). A process that
    then exits with gloo's worker threads alive aborted now and then after its work was done ("terminate
    called without an active exception", 2 of 8 two-rank CLI predicts, SIGABRT: torchrun reports the job
    failed): a worker releasing the last reference to a finished collective's tensors needs the GIL, which a
    finalizing interpreter no longer gives. Destroyed here, each group's destructor (which releases the GIL)
    joins its workers first. Call it after a run that ended well: not after an error, when a rank still inside
    a collective could wait on this one (on NCCL).
    """
    import gc

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()  # our modules, guards and pipelines hold groups too, in reference cycles


_exit_hook: list[bool] = []


# after an uncaught exception, how long the exit hook waits for the groups to close before it leaves without them
CLOSE_AFTER_ERROR_S = 10.0


def _close_gloo_groups_at_exit() -> None:
    """For scripts (`python train.py` with RecStrategy on CPU): close_process_groups at exit. gloo's destroy is
    local to the rank.

    After an uncaught exception too (a peer that died, say): left open, gloo's threads aborted the process at
    finalization ("terminate called without an active exception", exit 134 and a core file where those are on)
    after our error was printed. But a destroy can wait on a collective still pending with a live, stuck peer,
    so it runs on a side thread for at most CLOSE_AFTER_ERROR_S; past that the process leaves at once, with
    status 1 as for any uncaught exception, its output flushed."""
    import atexit
    import sys

    def close() -> None:
        if getattr(sys, "last_value", None) is None and getattr(sys, "last_exc", None) is None:
            close_process_groups()
        else:
            _close_after_error(CLOSE_AFTER_ERROR_S)

    if not _exit_hook:
        _exit_hook.append(True)
        atexit.register(close)


def _close_after_error(timeout_s: float) -> None:
    import logging
    import os
    import sys
    import threading

    closed = threading.Event()

    def close() -> None:
        try:
            close_process_groups()
        except Exception:  # noqa: BLE001, S110 - a group broken by the error: leaving is all that is left to do
            pass
        finally:
            closed.set()

    threading.Thread(target=close, name="lightning_rec: close process groups", daemon=True).start()
    if closed.wait(timeout_s):
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110
            pass
    logging.shutdown()
    os._exit(1)


class RecStrategy(DDPStrategy):
    """DDP for dense layers + model-parallel embedding tables.

    Args:
        plan: a ShardingPlan keyed by module paths inside the LightningModule
            (e.g. "model.sparse_arch.embedding_bag_collection"); None: the planner decides.
        planner: an EmbeddingShardingPlanner to use when plan is None (default: one built from
            the machine's topology).
        dense: "ddp" | "fsdp" for the dense layers.
        embedding_timeout: seconds an embedding collective (and the step agreement, and checkpoint
            gathers) waits for a peer still computing before raising (default 300). A peer at another
            collective, or gone, is named within seconds instead.
        checkpoint_format: "dcp" (sharded directory, each rank writes its pieces) | "gathered"
            (one file written by rank 0, every table gathered whole). Both load.
        pipeline: True (or a depth, or a PipelineConfig) runs every loop pipelined: the next batch is
            read, copied and its ids routed while this one computes (lightning_rec.pipeline); the
            LightningModule's steps stay as they are.
        **kwargs: DDPStrategy's arguments (process_group_backend, find_unused_parameters, ...).
    """

    # read by the data modules' loaders: the ranks agree on every batch and gather loader states here
    steps_ranks_together = True

    strategy_name = "rec"

    # planner typed (not Any): a recipe's `planner:` whose init_args jsonargparse refuses (a misspelt field) is an
    # error naming the field, not a dict handed on ("'dict' object has no attribute 'collective_plan'" at setup)
    def __init__(self, plan: ShardingPlan | None = None, planner: EmbeddingShardingPlanner | None = None,
                 dense: str = "ddp", embedding_timeout: float = 300.0, pipeline: Any = False,
                 checkpoint_format: str = "dcp", **kwargs: Any) -> None:
        from lightning_rec.pipeline import PipelineConfig

        if dense not in ("ddp", "fsdp"):
            raise ValueError(f"RecStrategy(dense={dense!r}): use 'ddp' or 'fsdp'")
        if checkpoint_format not in rec_checkpoint.FORMATS:
            raise ValueError(f"RecStrategy(checkpoint_format={checkpoint_format!r}): "
                             f"use one of {rec_checkpoint.FORMATS}")
        if isinstance(embedding_timeout, bool) or not isinstance(embedding_timeout, (int, float)) or not (
                math.isfinite(embedding_timeout) and embedding_timeout > 0):
            raise ValueError(f"RecStrategy(embedding_timeout={embedding_timeout!r}): give the seconds a rank waits "
                             f"for a slow peer, a number > 0 (default 300)")
        if plan is not None and not isinstance(plan, ShardingPlan):
            raise ValueError(f"RecStrategy(plan=...) takes a ShardingPlan, got a {type(plan).__name__}: build it with "
                             f"ShardingPlan({{module_path: construct_module_sharding_plan(collection, {{table: "
                             f"row_wise(), ...}})}}) (README, 'Many ranks')")
        self._checkpoint_format = checkpoint_format
        super().__init__(**_given_ddp_kwargs(kwargs))
        self._plan = plan
        self._planner = planner
        self._dense = dense
        self._embedding_timeout = embedding_timeout
        self._dmp: DistributedModelParallel | None = None
        self._pipeline_config = PipelineConfig.of(pipeline)
        self._pipelines: list = []  # one per dataloader of this run's loops (closed at teardown)
        self._backwards_unstepped = 0  # manual optimization: backwards since the last optimizer step
        self._step_hooks: list = []
        self._warned_manual_accumulation = False
        self._sigterm_pending = False  # this rank got a SIGTERM the ranks have not agreed on yet (_on_sigterm)
        self._stop_told = False
        self._requeue: tuple | None = None  # SLURM auto-requeue: (Lightning's handler, the signal noted or None)
        self._requeue_state = ""  # "" -> "due" (agreed, runs at the next training batch) -> "done"

    @property
    def dmp(self) -> DistributedModelParallel:
        if self._dmp is None:
            raise ValueError("the model is sharded during Trainer setup: read strategy.dmp after fit/validate starts")
        return self._dmp

    @property
    def plan(self) -> ShardingPlan:
        return self.dmp.plan

    def _default_planner(self):
        """A planner told what this run trains: the batch per rank (each collection's fused optimizer it reads from
        the module it plans: passing the first one's made every collection planned by it)."""
        from lightning_rec.planner import EmbeddingShardingPlanner

        topology, batch_size = self._run_topology_and_batch_size()
        pipelined = self._pipeline_config.depth if self._pipeline_config is not None else False  # batches held
        return EmbeddingShardingPlanner(topology, batch_size=batch_size, print_stats=False, pipelined=pipelined)

    def _run_topology_and_batch_size(self):
        from lightning_rec.planner import Topology

        datamodule = getattr(self._lightning_module.trainer, "datamodule", None)
        batch_size = getattr(datamodule, "batch_size", None) or 512
        topology = Topology(world_size=self.world_size, compute_device=self.root_device.type,
                            local_world_size=self.num_processes)
        return topology, int(batch_size)

    def _given_planner(self):
        """The user's planner, with what it left to its defaults (topology, batch_size) set to this run's: built
        before the ranks exist (a recipe's `planner:`, or `RecStrategy(planner=EmbeddingShardingPlanner(constraints=
        ...))` before `Trainer(devices=2)`), its default topology had one rank, and planning refused the run's 2."""
        planner = self._planner
        defaulted = getattr(planner, "_defaulted", ())
        if defaulted:
            topology, batch_size = self._run_topology_and_batch_size()
            if "topology" in defaulted:
                planner.topology = topology
            if "batch_size" in defaulted:
                planner._cost_args = (batch_size, *planner._cost_args[1:])
        return planner

    def _shard(self, dense: str | None) -> None:
        module = self.lightning_module
        prior = vars(module).get(_SHARDED_BY)
        if prior is not None:
            self._dmp = self._reuse(prior, dense)
            return
        plan = self._plan
        if plan is None:
            planner = self._given_planner() if self._planner is not None else self._default_planner()
            plan = planner.collective_plan(module)
            self._log_plan_stats(planner)
        self._dmp = DistributedModelParallel(
            module, plan=plan, device=self.root_device, dense=dense,
            timeout=timedelta(seconds=self._embedding_timeout), ddp_kwargs=self._ddp_kwargs,
            timeout_setting="RecStrategy(embedding_timeout=...)",
        )
        # in the module's own __dict__ (not a submodule): a later Trainer over this module finds its tables sharded
        vars(module)[_SHARDED_BY] = self._dmp
        if self.is_global_zero:
            print(f"lightning_rec sharding plan ({self.world_size} ranks):\n{self._dmp.plan}", flush=True)

    def _reuse(self, prior: DistributedModelParallel, dense: str | None) -> DistributedModelParallel:
        """An earlier Trainer in this process sharded this module's tables (fit, then a new Trainer to test or
        to fit on): they stay sharded as they are, with that run's plan, groups and timeout."""
        fix = ("build a new LightningModule (or load this run's checkpoint into one: checkpoints reshard to any "
               "world size and plan) for this Trainer")
        if prior.world_size != self.world_size:
            raise ValueError(f"this LightningModule's tables were sharded for {prior.world_size} ranks by an earlier "
                             f"Trainer, and this one runs {self.world_size}: {fix}")
        if torch.device(prior._device) != torch.device(self.root_device):
            raise ValueError(f"this LightningModule's tables were sharded onto {prior._device} by an earlier Trainer, "
                             f"and this one runs on {self.root_device}: {fix}")
        if self._plan is not None and self._plan != prior.plan:
            raise ValueError(f"RecStrategy(plan=...) differs from the plan this LightningModule's tables were sharded "
                             f"with by an earlier Trainer:\n{prior.plan}\nLeave plan=None to keep it, or {fix}")
        if dense is not None and prior.dense not in (None, dense):
            raise ValueError(f"RecStrategy(dense={dense!r}), but an earlier Trainer wrapped this LightningModule's "
                             f"dense layers with {prior.dense!r}: use dense={prior.dense!r}, or {fix}")
        if dense is not None:  # a fit: a new DDP wrapper (Lightning unwrapped the last one at teardown)
            prior.wrap_dense(dense, self._ddp_kwargs)
        return prior

    def _log_plan_stats(self, planner) -> None:
        """Print the planner's per-rank table once, and give it to the logger (a W&B table)."""
        if not self.is_global_zero:  # rank 0 plans; the others only receive the plan
            return
        stats = planner.stats
        if not getattr(planner, "print_stats", False):  # a planner of the user's (print_stats=True) printed it already
            print(stats, flush=True)
        logger = self._lightning_module.trainer.logger
        if logger is not None and callable(getattr(logger, "log_table", None)):
            columns, rows = stats.rank_rows()
            logger.log_table(key="sharding_plan", columns=columns, data=rows)

    @override
    def configure_ddp(self) -> None:
        self._shard(self._dense)
        # DDP(LightningModule) when dense="ddp": Lightning redirects training_step through it as usual.
        self.model = self._dmp._dmp_wrapped_module
        if self._dense == "ddp" and isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            self._register_ddp_hooks()
        self._note_trainable_dense()

    def _note_trainable_dense(self) -> None:
        # DDP reduces the gradients of the parameters that required one when it was built: a dense layer frozen then
        # (BaseFinetuning.freeze_before_training runs before the wrap) and unfrozen later trained on each rank's own
        # gradient, the replicas drifting apart silently; one frozen after it stopped DDP's reduction. Tables
        # (FusedTableWeight: requires_grad reads False) are not DDP's.
        from lightning_rec.table_weight import FusedTableWeight

        self._dense_params = [p for p in self._dmp._unwrapped.parameters() if not isinstance(p, FusedTableWeight)]
        self._dense_trainable = [p.requires_grad for p in self._dense_params]

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._requeue_state == "due" and self._requeue is not None:  # SLURM's requeue signal, agreed on: Lightning's
            # handler, on every rank here (before the step's collectives; the feeder's wait for the step's next())
            self._requeue_state = "done"
            handler, signum = self._requeue
            handler(signum if signum is not None else 10, None)
        # after the callbacks' and the module's on_train_*_start hooks, where BaseFinetuning (un)freezes
        if self._dense != "ddp" or self.world_size == 1 or self._dmp is None:
            return
        if [p.requires_grad for p in self._dense_params] == self._dense_trainable:  # ~1 us for a DLRM's layers
            return
        # the same change on every rank (as BaseFinetuning makes it): DDP is built again over the parameters that
        # train now (a collective; DDP checks that the ranks agree on them)
        self._dmp.wrap_dense("ddp", self._ddp_kwargs)
        self.model = self._dmp._dmp_wrapped_module
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            self._register_ddp_hooks()
        self._note_trainable_dense()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._check_same_pipeline()
        self._take_over_sigterm(trainer)
        if trainer.state.fn != TrainerFn.FITTING and self._dmp is None:
            self._shard(dense=None)  # evaluation: tables stay sharded, no gradients to reduce
        if trainer.state.fn == TrainerFn.PREDICTING and self.world_size > 1:
            self._deal_fewer_rows_than_ranks(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            for callback in trainer.checkpoint_callbacks:  # said now, not at the first save after hours of training
                if getattr(callback, "dirpath", None):
                    rec_checkpoint.refuse_resolved_file_url(callback.dirpath)
                    if self._checkpoint_format == "dcp":
                        rec_checkpoint._refuse_url(callback.dirpath)

            if not getattr(self.lightning_module, "warns_fused_dense_only", False):  # said in the module's setup()
                warn_fused_dense_only(self.lightning_module, trainer)
            self._warn_if_fused_optimizer_left_out()
            self._backwards_unstepped = 0
            for handle in self._step_hooks:
                handle.remove()
            # every step resets the count, Lightning's (opt.step()) or the raw optimizer's
            self._step_hooks = [o.register_step_post_hook(self._stepped) for o in self.optimizers]

    def _stepped(self, *_: Any) -> None:
        self._backwards_unstepped = 0

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        if module is None or module.automatic_optimization or self._warned_manual_accumulation:
            return out
        # Manual optimization with gradients accumulated by hand (opt.step() every N batches): the automatic path
        # warns through accumulate_grad_batches, this one trained the tables N x as often without a word. A second
        # backward with no optimizer step between is what accumulation looks like, and costs a counter to see.
        self._backwards_unstepped += 1
        if self._backwards_unstepped == 2:
            fused = fused_table_modules(module)
            self._warned_manual_accumulation = True
            if fused:
                warnings.warn(
                    f"manual optimization: a second backward (self.manual_backward) before an optimizer step, as "
                    f"when accumulating gradients by hand. It accumulates the dense layers' gradients only: the fused "
                    f"tables ({fused[0]}) update inside every backward, not at opt.step(). To give both one larger "
                    f"batch, raise the data module's batch_size and step after every backward",
                    stacklevel=3)  # the user's manual_backward line (backward <- LightningModule.manual_backward)
        return out

    def _check_same_pipeline(self) -> None:
        """Collective, once per run: every rank pipelines alike. A rank that pipelines builds its channel's group when
        its first loader comes, one that does not goes on to Lightning's collectives: the two failed 20 s or minutes
        later with a c10d Store timeout naming no setting."""
        if self.world_size <= 1 or not dist.is_initialized():
            return
        depth = self._pipeline_config.depth if self._pipeline_config is not None else 0
        depths = [d for (d,) in comm.agree([depth], device=self.root_device, tag="the ranks' pipeline depths")]
        least, most = min(depths), max(depths)
        if least != most:
            raise ValueError(f"RecStrategy(pipeline=...) differs between ranks: rank {self.global_rank} has depth "
                             f"{depth}, the ranks' depths range from {least} to {most} (0: not pipelined). Pass "
                             f"the same pipeline setting on every rank")

    def _warn_if_fused_optimizer_left_out(self) -> None:
        """configure_optimizers returned only a dense optimizer while tables train fused: said, not silent.

        The tables still train (inside backward, at their configured rate), but no scheduler reaches that rate and
        the checkpoints hold none of their optimizer state (row-wise Adagrad's sums, Adam's moments), so a resumed
        run restarts it: Adagrad's first steps after a resume are the large ones of a fresh start."""
        from lightning_rec.optim import fused_modules, holds_fused_optimizer

        fused = fused_modules(self.lightning_module)
        if not fused or any(holds_fused_optimizer(o) for o in self.optimizers):
            return
        kernels = [k for _, m in fused for k in m.fused_kernels()]  # none on a rank that holds no shard
        config = fused[0][1].fused_optimizer_config()
        rate = kernels[0].get_learning_rate() if kernels else config.lr
        warnings.warn(
            f"{type(self.lightning_module).__name__}'s tables ({fused[0][0] or 'the model'}) train with the fused "
            f"optimizer {config.optimizer} inside backward, but configure_optimizers returned no optimizer that holds "
            f"it: an LR scheduler does not reach their rate (it stays {rate:g}) and "
            f"checkpoints leave out their optimizer state, so a resumed run restarts it. Return "
            f"lightning_rec.combined_optimizer(self, dense_optimizer) (or TorchRec's CombinedOptimizer with "
            f"FusedOptimizer(self))", stacklevel=1)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        dataloader = self._own_loader_of_this_loop(dataloader)
        dataloader = self._without_repeated_rows(dataloader)
        _workers_outlive_sigterm(dataloader)
        self._track_loader_position(dataloader)  # the pipeline reads ahead too: the position is the step's
        agreed = self._agree_training_length(dataloader)
        pad = self._padding_for(dataloader)
        padded = self._agree_evaluation_length(dataloader, pad)
        if self._pipeline_config is not None and self._dmp is not None and isinstance(dataloader, DataLoader):
            from lightning_rec.pipeline import InputPipeline, wrap_loader

            self._close_replaced_pipelines()
            if any(p.loader is dataloader and p.feeder is None and not p.closed for p in self._pipelines):
                # one loader object twice in one loop ({"a": loader, "b": loader}), iterated twice at once: each pass
                # stopped the other's feeder (the pipeline lives on the loader), and the epoch ended with 0 steps
                dataloader = self._loader_copy(dataloader)
            # collective (the pipeline's own channel): every rank builds its loaders' pipelines in one order
            pipeline = InputPipeline(self.lightning_module, self.root_device, self._pipeline_config,
                                     to_device=self._batch_hooks_for(dataloader))
            pipeline.loader = dataloader
            pipeline.stop_signal = (self._stop_requested, self._stop_agreed)
            self._pipelines.append(pipeline)
            self._skip_hooks_for_pipelined_batches()
            position = self._batches_this_epoch if self.lightning_module.trainer.training else None
            # it keeps ranks together too
            dataloader = wrap_loader(dataloader, pipeline, pad, position=position)
            dataloader._rec_evaluating = not self.lightning_module.trainer.training
        elif self.world_size > 1 and isinstance(dataloader, DataLoader):
            evaluating = not self.lightning_module.trainer.training
            _stop_together(dataloader, self._all_have_a_batch, pad, evaluating=evaluating)
        if isinstance(dataloader, DataLoader) and getattr(type(dataloader), "_rec_step_together", False):
            dataloader._rec_agreed_len = agreed
            dataloader._rec_padded_len = padded
        return dataloader

    # what process_dataloader (and pipeline.wrap_loader) keep on a loader for the loop that iterates it
    _LOOP_STATE = ("_rec_agreed_len", "_rec_padded_len", "_rec_all_have_a_batch", "_rec_evaluating", "_rec_pad_batch",
                   "_rec_pipeline", "_rec_position", "_rec_states", "_rec_first_step", "state_dict")

    def _own_loader_of_this_loop(self, dataloader: object) -> object:
        """A loader that training and evaluation share (train_dataloaders=dl, val_dataloaders=dl; a data module that
        returns one loader for both): a shallow copy for this loop, so that each loop's state on it is its own. The
        validation loop's replaced the training loop's (its pipeline, its padding, no agreed length), and pipelined,
        each validation pass stopped the training pass's feeder: epochs ended early, silently (14 steps of 24)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not isinstance(dataloader, DataLoader):
            return dataloader
        training = bool(trainer.training)
        seen = vars(dataloader).get("_rec_training")
        if seen is not None and seen != training:
            dataloader = self._loader_copy(dataloader)
        dataloader._rec_training = training
        return dataloader

    def _loader_copy(self, dataloader: DataLoader) -> DataLoader:
        """The same dataset, sampler and settings (no DataLoader.__init__), without the other loop's state."""
        from lightning_rec.pipeline import base_loader_class

        dataloader = copy.copy(dataloader)
        for key in self._LOOP_STATE:
            vars(dataloader).pop(key, None)
        dataloader.__class__ = base_loader_class(type(dataloader))
        dataloader._iterator = None  # persistent_workers: workers of its own, not the other loop's iterator
        return dataloader

    def _without_repeated_rows(self, dataloader: object) -> object:
        """Validation / test, several ranks: the loader without the rows torch's DistributedSampler (which Lightning
        puts into evaluation loaders) repeats to even the ranks' shares. They were scored twice: a 33-row split at 2
        ranks counted 34 in every metric. Each rank keeps its share's own rows, in the sampler's order (Lightning's
        prediction sampler, UnrepeatedDistributedSampler, does the same); a rank whose share is a batch shorter steps
        on with an empty batch (_agree_evaluation_length)."""
        from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
        from lightning.pytorch.utilities.data import _update_dataloader
        from torch.utils.data import BatchSampler, DistributedSampler

        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.world_size <= 1 or trainer is None or trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader
        sampler = dataloader.sampler
        if (type(sampler) not in (DistributedSampler, DistributedSamplerWrapper) or sampler.drop_last
                or type(dataloader.batch_sampler) is not BatchSampler):
            return dataloader  # a sampler of the user's own kind (or one that drops rows): theirs to keep
        rows = len(sampler.dataset)
        if rows % sampler.num_replicas == 0:
            return dataloader  # nothing repeated
        if self._padding_for(dataloader) is None:
            return dataloader  # no empty batch to step with: the repeated row keeps the ranks' batch counts equal
        return _update_dataloader(dataloader, _OwnRowsOnly(sampler, rows), mode=trainer.state.stage)

    def _deal_fewer_rows_than_ranks(self, trainer: pl.Trainer) -> None:
        """predict with fewer rows than ranks: Lightning's prediction sampler (UnrepeatedDistributedSampler) asserted
        on the rank that gets no row (a bare AssertionError in lightning/pytorch/overrides/distributed.py). Here such
        a loader gets the same deal without the assertion (rank r: rows r, r+W, ...); the rank with no row steps with
        an empty batch (_agree_evaluation_length), or, where none can be made, the run is refused naming the fix.
        Lightning 2.6: the sampler is chosen in its data connector's private `_resolve_sampler`, before any strategy
        hook sees the loader; wrapped on this trainer only."""
        from lightning.fabric.utilities.data import sized_len
        from lightning.pytorch.trainer.states import RunningStage

        connector = getattr(trainer, "_data_connector", None)
        if not callable(getattr(connector, "_resolve_sampler", None)) or not hasattr(
                connector, "_requires_distributed_sampler"):
            return  # another Lightning: its own sampler deal (and message) stays
        if getattr(connector._resolve_sampler, "_rec_fewer_rows", False):
            return
        resolve = connector._resolve_sampler

        def resolve_sampler(dataloader, shuffle, mode=None):
            dataset = getattr(dataloader, "dataset", None)
            rows = sized_len(dataset) if dataset is not None else None
            if (mode != RunningStage.PREDICTING or rows is None or not 0 < rows < self.world_size
                    or not connector._requires_distributed_sampler(dataloader)):
                return resolve(dataloader, shuffle, mode)
            if self._padding_for(dataloader) is None:
                raise ValueError(f"trainer.predict: the predict dataloader has {rows} row(s) for {self.world_size} "
                                 f"ranks, so rank(s) {list(range(rows, self.world_size))} get none, and an empty "
                                 f"batch to step with cannot be made for this loader (a collate_fn of your own). Give "
                                 f"its dataset an `empty_batch()` method returning a batch of 0 rows, give it at least "
                                 f"{self.world_size} rows, or predict on fewer devices (Trainer(devices={rows}))")
            return _RowsOfThisRank(dataloader.sampler, self.world_size, self.global_rank)

        resolve_sampler._rec_fewer_rows = True
        connector._resolve_sampler = resolve_sampler

    def _agree_evaluation_length(self, dataloader: object, pad) -> int | None:
        """Evaluation, several ranks (collective, once per loader: every rank processes its loaders in one order): the
        most batches of any rank's sized loader, when that is more than this rank's own and every rank can make an
        empty batch (`_padding_for`); the loader then says that length, and its steps past its own batches are empty
        batches that weigh nothing. Lightning stops a sized loader at its len() on each rank: a rank with one batch
        fewer (Lightning's UnrepeatedDistributedSampler deals 17 and 16 rows of 33) ended the pass for all, and
        predict lost the longer share's last rows."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.world_size <= 1 or trainer is None or trainer.training or not isinstance(dataloader, DataLoader):
            return None
        from lightning.fabric.utilities.data import sized_len

        own = sized_len(dataloader)
        rows = comm.agree([0 if own is None else own, int(pad is not None)], device=self.root_device,
                          tag="the ranks' evaluation lengths")
        most, all_can_pad = max(n for n, _ in rows), all(can for _, can in rows)
        if own is None or most <= own or not all_can_pad:
            return None  # (without padding, the rank with more batches says which it skips: _iter_together)
        return most

    def _agree_training_length(self, dataloader: object) -> int | None:
        """Training, several ranks (collective: every rank processes its loaders in one order): the fewest batches of
        any rank's sized loader, when that is fewer than this rank's own; the loader then says that length, so that
        every rank's Lightning loop counts the same epoch. With each rank's own length, a rank with more batches
        validated at another batch (val_check_batch) or not at all, and ran one more advance at the epoch's end
        to find its loader stopped, whose collective (Lightning's SIGTERM broadcast) paired with another one
        elsewhere: CollectiveMismatch in the first validation or the second epoch."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.world_size <= 1 or trainer is None or not trainer.training or not isinstance(dataloader, DataLoader):
            return None
        from lightning.fabric.utilities.data import sized_len

        own = sized_len(dataloader)
        rows = comm.agree([-1 if own is None else own], device=self.root_device, tag="the ranks' training lengths")
        fewest = min((n for (n,) in rows if n >= 0), default=None)
        if own is None or fewest >= own:
            return None
        warnings.warn(f"rank {self.global_rank}: the rest of this epoch's batches are skipped: this rank's training "
                      f"dataloader has {own} batches, another rank's {fewest}, and sharded embeddings need every "
                      f"rank in every step, so every epoch takes {fewest} on every rank. Give every rank the same "
                      f"number of batches (e.g. drop_last, or an even split) to use them all", stacklevel=2)
        return fewest

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        self._step_done()
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with _empty_batch_logs_weigh_nothing(self.lightning_module, args[0] if args else None):
            out = super().validation_step(*args, **kwargs)
        self._step_done()
        return out

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with _empty_batch_logs_weigh_nothing(self.lightning_module, args[0] if args else None):
            out = super().test_step(*args, **kwargs)
        self._step_done()
        return out

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().predict_step(*args, **kwargs)
        self._step_done()
        return out

    def _step_done(self) -> None:
        """A step ran: its pipeline's recording (which KJT of the batch each collection reads) ends here, not when
        Lightning takes the batch after next. Left open, a validation after the first training step that embedded
        ids of its own (TwoTowerModule's item catalogue) was charged to the training pipeline: a warning that the
        collection cannot be pipelined, and its calls counted as training inputs routed in the step."""
        for pipeline in self._pipelines:
            pipeline.forward_done()

    def _close_replaced_pipelines(self) -> None:
        """Close the pipelines of loaders that no loop holds any more (reload_dataloaders_every_n_epochs, or a
        loop that requested its loaders again): their channels go back to the pool for the next pipeline, their
        feeder threads end. Without this every reload kept a process group, a shared-memory group and a waiting
        thread until the run ended. Collective-safe: the loops hold the same loaders on every rank, and a replaced
        loader's feeder starts no batch past the ones every rank's may start (InputPipeline.close)."""
        trainer = self.lightning_module.trainer
        loops = (trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop,
                 trainer.predict_loop)
        held = {id(dl) for loop in loops
                for dl in (getattr(getattr(loop, "_combined_loader", None), "flattened", None) or [])}
        # a pipeline no pass has used yet may belong to a loader of the loop setting up now (its loaders are
        # processed one by one, and the loop holds them once all are)
        for pipeline in [p for p in self._pipelines if id(p.loader) not in held and p.feeder is not None]:
            pipeline.close()
            self._pipelines.remove(pipeline)

    def _padding_for(self, loader: object):
        """Evaluation: what a rank whose data ran out steps with while others still have batches (the dataset's
        `empty_batch`, a batch of 0 rows that the metrics do not see), so every row is scored. Training: None
        (the first rank to run out ends the epoch for all)."""
        trainer = self.lightning_module.trainer
        if trainer is None or trainer.training:
            return None
        dataset = getattr(loader, "dataset", None)
        pad = getattr(dataset, "empty_batch", None)
        if not callable(pad):
            pad = None
            getitems = getattr(dataset, "__getitems__", None)
            if callable(getitems) and getattr(loader, "batch_sampler", None) is not None:  # batches of indices
                # a map-style dataset that builds whole batches (lightning_rec's own, under a plain DataLoader): the
                # loader's batch of no rows, tried once here: one that fails (torch's Subset over a per-row dataset
                # gives default_collate an empty list) would fail on the rank that ran out, mid-pass
                def pad():
                    return loader.collate_fn(getitems([]))

                try:
                    pad()
                except Exception:  # noqa: BLE001 - no empty batch: the rows are dealt as Lightning deals them
                    pad = None
            if pad is None:
                pad = _empty_collated_batch(loader)
        if pad is None:
            return None
        batch_sampler = getattr(loader, "batch_sampler", None)
        if isinstance(batch_sampler, _IndexBatchSamplerWrapper):
            # predict: the loop reads each step's row indices from what the batch sampler gave; a padding step has none
            # (without this entry, the step past this rank's share failed with an IndexError)
            made = pad

            def pad():
                batch_sampler.seen_batch_indices.append([])
                return made()
        return pad

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if any(p.owns(batch) for p in self._pipelines):
            return batch  # the pipeline copied it (on GPU: on its side stream, from pinned memory)
        return super().batch_to_device(batch, device, dataloader_idx)

    # The batch hooks of a pipelined loop. Lightning runs on_before_batch_transfer,
    # transfer_batch_to_device and on_after_batch_transfer (the module's or the datamodule's) on each
    # batch just before its step. Pipelined, the feeder thread runs the same three, in that order, once
    # per batch, ahead of the step (on GPU inside the copy stream), and the ids it routes are those of
    # the batch the hooks returned; the loop's own calls then see a batch the pipeline owns and pass it
    # through. The hooks are called directly, not through the Trainer's hook runner, which records the
    # running hook on the module (`_current_fx_name`, read by self.log in the step running meanwhile).
    # A loop that combines several loaders' batches into one (training on a dict of loaders) gives the hooks
    # that combined batch: there the feeder only copies each loader's batch, and the loop runs the hooks.

    def _batch_hooks_for(self, loader: DataLoader):
        """batch -> the batch the step gets: the three batch hooks, for the feeder thread."""
        trainer = self.lightning_module.trainer
        selector = getattr(getattr(trainer, "_data_connector", None), "_datahook_selector", None)
        device = self.root_device
        index: list = []

        def hook(name: str):
            if selector is not None:
                return getattr(selector.get_instance(name), name)
            return getattr(self.lightning_module, name)

        def transfer(batch: Any) -> Any:
            if not index:  # which dataloader of its loop: the hooks' dataloader_idx
                index.append(_dataloader_index(trainer, loader))
                index.append(_in_a_combined_batch(trainer, loader))
            i, combined = index
            if combined:  # the loop runs the hooks on its batch of every loader (which no pipeline owns)
                from lightning_rec.pipeline import move_to_device

                return move_to_device(batch, device)
            batch = hook("on_before_batch_transfer")(batch, i)
            batch = hook("transfer_batch_to_device")(batch, device, i)
            return hook("on_after_batch_transfer")(batch, i)

        return transfer

    def _skip_hooks_for_pipelined_batches(self) -> None:
        module = self.lightning_module
        if "_on_before_batch_transfer" in vars(module):
            return
        hooks = module._on_before_batch_transfer  # Lightning's runner, bound

        def on_before_batch_transfer(batch: Any, dataloader_idx: int = 0) -> Any:
            if any(p.owns(batch) for p in self._pipelines):
                return batch  # the feeder ran it (and the other two) already
            return hooks(batch, dataloader_idx=dataloader_idx)

        module._on_before_batch_transfer = on_before_batch_transfer  # this run only: teardown removes it

    @override
    def setup_environment(self) -> None:
        self._refuse_weight_averaging()
        self._refuse_destroyed_groups()
        if dist.is_available() and not dist.is_initialized():
            # an earlier run's groups, destroyed since (dist.destroy_process_group() between two fits) but held by
            # its garbage (Trainer, strategy, pipelines: reference cycles), keep its c10d Store serving on
            # MASTER_PORT; init_process_group here reuses that Store, the old run's keys included, and the second
            # fit hung in its first collective
            import gc

            from lightning_rec.collective_guard import old_store_alive

            gc.collect()
            if old_store_alive():
                warnings.warn(
                    "a process group destroyed by torch.distributed.destroy_process_group() is still held (a "
                    "LightningModule sharded by an earlier Trainer, or a DistributedModelParallel, holds its groups): "
                    "its c10d Store still serves on MASTER_PORT, and init_process_group reuses it with the earlier "
                    "run's keys, which can hang. Delete those objects (del model) before this fit, or keep the process "
                    "group between fits (no destroy_process_group() is needed)", stacklevel=2)
        super().setup_environment()
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            _close_gloo_groups_at_exit()

    def _refuse_destroyed_groups(self) -> None:
        """A module sharded by an earlier Trainer keeps that run's process groups; once they were destroyed
        (dist.destroy_process_group()) its tables cannot reach their peers again: said before the new groups are
        made (while its old groups live, a new init_process_group in this process hangs on their old Store)."""
        prior = vars(self.lightning_module).get(_SHARDED_BY) if self.lightning_module is not None else None
        if prior is None or prior.groups_alive():
            return
        raise ValueError(
            f"this {type(self.lightning_module).__name__}'s tables were sharded by an earlier Trainer over process "
            f"groups that have been destroyed since (torch.distributed.destroy_process_group()): its shards cannot "
            f"reach their peers again. Build a new LightningModule for this Trainer (a checkpoint of this one loads "
            f"into it), and drop the old one (del it) before this fit; or keep the process group between fits "
            f"(Lightning leaves it open: no destroy_process_group() is needed)")

    def _refuse_weight_averaging(self) -> None:
        """Lightning's weight-averaging callbacks copy the module when fit begins (before it is sharded) and then pair
        that copy's parameters with the module's one by one. Sharded tables are not parameters of the module (their
        kernels hold them, updated inside backward), so the pairs slid: a table's average met a dense weight, and the
        first validation or SWA epoch failed with "The size of tensor a (4) must match ... b (21)". Said before the
        copy is made (a copy of every table, which may not fit)."""
        from lightning.pytorch.callbacks import StochasticWeightAveraging

        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return  # evaluation: the callbacks average nothing
        try:
            from lightning.pytorch.callbacks import WeightAveraging  # Lightning 2.6
        except ImportError:  # pragma: no cover - older Lightning
            WeightAveraging = StochasticWeightAveraging
        for callback in trainer.callbacks:
            if isinstance(callback, (WeightAveraging, StochasticWeightAveraging)):
                raise ValueError(
                    f"Trainer(callbacks=[{type(callback).__name__}(...)]) cannot average sharded embedding tables: "
                    f"it pairs the module's parameters with those of a copy made before sharding, and under "
                    f"strategy='rec' the tables' parameters are empty (each rank's kernels hold its pieces, "
                    f"updated inside backward). Remove the callback, or train on one device without "
                    f"strategy='rec' (unsharded tables, which it averages)")

    @override
    def teardown(self) -> None:
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []
        for pipeline in self._pipelines:  # every rank reaches teardown at the same point of its loops
            pipeline.close()
        self._pipelines = []
        module = self.lightning_module
        if module is not None:
            vars(module).pop("_on_before_batch_transfer", None)
        if module is None or self._dmp is None or self.root_device.type == "cpu":
            super().teardown()
            return
        # Lightning moves the module to the CPU here. Sharded tables cannot follow (each rank holds its pieces in
        # the device's kernels, and a replica moved alone left a module on two devices: a forward after fit then
        # failed with "indices is on cpu"), so the whole module stays on its device, as a later Trainer or
        # `module(...)` expects it: module.device stays the device it trained on.
        vars(module)["cpu"] = lambda: module
        try:
            super().teardown()
        finally:
            vars(module).pop("cpu", None)

    def _all_have_a_batch(self, have: bool, index: int, last: bool = False) -> tuple[bool, bool, bool]:
        """Collective: (does every rank have batch `index`, is it some rank's last, does any rank have one).
        Through the embedding group's guard (and shared memory when the tables use it): ranks at different
        batches raise on every rank. `last`: this rank's sized loader has no batch after this one."""
        stop = self._stop_requested()  # a SIGTERM (or SLURM's requeue signal) rides on it (_take_over_sigterm)
        if self._dmp is not None:
            all_have = self._dmp.step_together(have, index, last, stop=stop)
            self._stop_agreed(self._dmp.stop_agreed)
            return all_have, self._dmp.last_batch_agreed, self._dmp.any_batch_agreed
        rows = comm.agree([int(have), int(have and last), stop], device=self.root_device, tag="ranks step together")
        self._stop_agreed({r: bits for r, (_, _, bits) in enumerate(rows) if bits})
        return all(h for h, _, _ in rows), any(x for _, x, _ in rows), any(h for h, _, _ in rows)

    def _all_gather_object(self, obj: Any) -> list:
        if self._dmp is not None:  # guarded: a rank elsewhere is named within embedding_timeout
            return self._dmp.all_gather_object(obj)
        return comm.all_gather_object(obj)

    # SIGTERM (a preempted job), several ranks ----------------------------------------------------------------
    #
    # Lightning 2.6's SIGTERM handler ran a broadcast inside the signal handler, paired with whatever collective
    # the other ranks were in: a signalled 2-rank fit hung, or failed with CollectiveMismatch (rank 0 in its id
    # all-to-all, rank 1 in the handler's broadcast). And a rank that was signalled alone stopped alone at its next
    # loop check, leaving the others waiting. Here the handler only notes the signal; the note rides on the
    # agreement every batch already makes (every rank has a batch? _all_have_a_batch, or the pipeline's), and every
    # rank sets Lightning's `trainer.received_sigterm` when it takes the same batch. Lightning's loops then raise
    # SIGTERMException after the same step on every rank: the callbacks' on_exception runs (OnExceptionCheckpoint
    # saves a checkpoint, a collective every rank reaches), teardown, and the process exits as Lightning's does.
    # SLURM's auto-requeue signal (SIGUSR1 by default) had the same flaw: Lightning's handler saved the checkpoint (a
    # collective) inside the signal handler. It is noted the same way, and Lightning's handler (save, then requeue
    # from rank 0) runs on every rank at the same training batch's start.

    def _take_over_sigterm(self, trainer: pl.Trainer) -> None:
        """Replace Lightning's SIGTERM notifier (registered after setup, until teardown) by _on_sigterm, and its SLURM
        requeue handler by _on_requeue_signal. Lightning 2.6 private: `_SignalConnector._sigterm_notifier_fn` and
        `_slurm_sigusr_handler_fn`, looked up on the instance when the handlers are registered; where a Lightning has
        none, its own stays."""
        self._sigterm_pending, self._stop_told, self._requeue, self._requeue_state = False, False, None, ""
        connector = getattr(trainer, "_signal_connector", None)
        if self.world_size > 1 and callable(getattr(connector, "_sigterm_notifier_fn", None)):
            connector._sigterm_notifier_fn = self._on_sigterm
            # Lightning's epoch loop also broadcasts rank 0's flag before every training batch, then reads it back
            # (`.item()`): a collective and, on GPU, a host sync per step. Every rank's flag is set at the same batch
            # here (_stop_agreed), so each rank reads its own: the same stop, without the per-step sync
            epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
            if callable(getattr(epoch_loop, "_broadcast_sigterm_tensor", None)):
                epoch_loop._broadcast_sigterm_tensor = functools.partial(_raise_agreed_sigterm, trainer)
        slurm_handler = vars(type(connector)).get("_slurm_sigusr_handler_fn") if connector is not None else None
        if self.world_size > 1 and callable(slurm_handler):
            self._requeue = (slurm_handler.__get__(connector), None)  # Lightning's own, run at a batch (below)
            connector._slurm_sigusr_handler_fn = self._on_requeue_signal

    def _on_sigterm(self, signum: Any, _frame: Any) -> None:
        """The SIGTERM handler: notes it, and passes it on to the ranks this process launched (as Lightning's does).
        No collective, no print (a signal handler interrupts the main thread anywhere, in a write to stderr too)."""
        import os

        if self._sigterm_pending:
            return
        self._sigterm_pending = True
        with contextlib.suppress(OSError):
            os.write(2, f"lightning_rec (rank {self.global_rank}): received SIGTERM ({int(signum)}); every rank stops "
                        f"after the step that takes the next batch\n".encode())
        if self.launcher is not None:
            self.launcher.kill(signum)

    def _on_requeue_signal(self, signum: Any, _frame: Any) -> None:
        """SLURM's requeue signal (auto_requeue): noted; Lightning's handler runs at a batch every rank agrees on."""
        import os

        if self._requeue is None or self._requeue[1] is not None or self._requeue_state:
            return
        self._requeue = (self._requeue[0], signum)
        with contextlib.suppress(OSError):
            os.write(2, f"lightning_rec (rank {self.global_rank}): received the requeue signal ({int(signum)}); "
                        f"every rank saves the checkpoint at its next training batch, then rank 0 requeues the "
                        f"job\n".encode())

    def _stop_requested(self) -> int:
        """This rank's signals, as bits: 1 a SIGTERM, 2 SLURM's requeue signal (not yet acted on)."""
        requeue = self._requeue is not None and self._requeue[1] is not None and not self._requeue_state
        return int(self._sigterm_pending) | (2 if requeue else 0)

    def _stop_agreed(self, ranks: dict[int, int]) -> None:
        """Every rank calls this at the same batch (the one whose agreement carried the signals: {rank: bits})."""
        if any(bits & 2 for bits in ranks.values()) and not self._requeue_state:
            self._requeue_state = "due"  # at the next training batch's start (on_train_batch_start), every rank
        ranks = sorted(r for r, bits in ranks.items() if bits & 1)
        if not ranks or self._stop_told:
            return
        self._stop_told = True
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        connector = getattr(trainer, "_signal_connector", None)
        if connector is None:
            return
        connector.received_sigterm = True  # what Lightning's loops read (trainer.received_sigterm)
        if self.global_rank == 0:
            print(f"lightning_rec: SIGTERM received by rank(s) {ranks}: every rank stops after this step (Lightning's "
                  f"SIGTERMException: callbacks' on_exception run, e.g. OnExceptionCheckpoint saves a checkpoint)",
                  file=sys.stderr, flush=True)

    @override
    def barrier(self, name: str | None = None) -> None:
        # Lightning's barriers (one after every trainer.save_checkpoint, a few per fit; none per step) waited on the
        # default group, for its timeout (30 min), when a peer stopped; once the tables are sharded they run on the
        # embedding group, through its guard: that peer is named within embedding_timeout
        if self._dmp is not None and self._dmp.groups_alive():
            comm.barrier(f"barrier ({name})" if name else "barrier", group=self._dmp._emb_pg)
            return
        super().barrier(name)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        # LightningModule.all_gather: Lightning gathers through torch.distributed.nn.functional.all_gather, which
        # torch 2.13 deprecates with a warning on every call; without gradients plain all_gather does the same
        if sync_grads or not dist.is_initialized():
            return super().all_gather(tensor, group, sync_grads)
        tensor = tensor.contiguous()
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
        return torch.stack(gathered)

    # checkpoints: sharded through DCP (checkpoint.py), or gathered whole to rank 0 ------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # weights load into the sharded tables: each rank reads only its pieces

    def _track_loader_position(self, dataloader: object) -> None:
        if hasattr(dataloader, "consumed_batches"):
            # Lightning fetches a batch ahead of the step; the loader's saved position is the step's
            dataloader.consumed_batches = self._batches_this_epoch

    def _batches_this_epoch(self) -> int:
        return int(self.lightning_module.trainer.fit_loop.epoch_loop.batch_progress.current.processed)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._checkpoint_format == "dcp":
            return self.lightning_module.state_dict()  # this rank's pieces; save_checkpoint writes them
        return self._gathered_state_dict()

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self._checkpoint_format == "dcp":
            return {}  # save_checkpoint reads the optimizers themselves, shard by shard
        return self._gathered_optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        module = self.lightning_module
        module_class = f"{type(module).__module__}.{type(module).__qualname__}"  # export rebuilds it
        # every rank's generators (collective): a resumed run draws what the uninterrupted one would have
        rng = rec_checkpoint.rng_state()
        if self._checkpoint_format != "dcp":
            # every rank's loader position too: a data module's sampler is each rank's own (its rank is in the
            # position's fingerprint), so rank 0's position would make every other rank start its epoch over
            loops = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
            per_rank = self._all_gather_object((rng, loops.get("combined_loader")))
            checkpoint["lightning_rec"] = {"format": "gathered", "module_class": module_class,
                                           "rng_states": [r for r, _ in per_rank],
                                           "loader_states": [state for _, state in per_rank]}
            if (storage_options is None and type(self.checkpoint_io) is TorchCheckpointIO
                    and rec_checkpoint.is_local_path(filepath)):
                if self.is_global_zero:  # straight to disk: Lightning's writer buffers the file in memory twice
                    rec_checkpoint.save_file(checkpoint, filepath)
                return None
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # remote paths, custom IO
        loops = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        loader_state = loops.pop("combined_loader", None)  # one per rank: checkpoint.save keeps them all
        optimizers = self.optimizers if "optimizer_states" in checkpoint else []  # weights_only=True: none
        rec_checkpoint.save(checkpoint, filepath, optimizers=optimizers, loader_state=loader_state,
                            module_class=module_class, module=module,  # module: FSDP's dense state reshards
                            rng_state=rng, dmp=self._dmp)  # dmp: every wait of the save bounded by its timeout

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint_path = rec_checkpoint.local_path(checkpoint_path)  # file://: a sharded one is a local directory
        if not rec_checkpoint.is_dcp_checkpoint(checkpoint_path):
            meta = rec_checkpoint.load_file(checkpoint_path)
        else:
            meta = rec_checkpoint.read_lightning_state(checkpoint_path)
        if not self.lightning_module.trainer.training:  # validate / test / predict: nothing to resume
            return meta
        if rec_checkpoint.is_dcp_checkpoint(checkpoint_path) or "loader_states" in (meta.get("lightning_rec") or {}):
            state = rec_checkpoint.loader_state_for_rank(meta, self.global_rank, self.world_size)
            loops = meta.setdefault("loops", {}).setdefault("fit_loop", {}).setdefault("state_dict", {})
            if state is not None:
                loops["combined_loader"] = state
            else:  # another world size (said once above): a gathered file's rank-0 position is no rank's here
                loops.pop("combined_loader", None)
        # before the loaders start (each pass's iterator leaves the global generator as it found it: data/batch.py)
        rng = rec_checkpoint.rng_state_for_rank(meta, self.global_rank, self.world_size)
        if rng is not None:
            rec_checkpoint.set_rng_state(rng)
        return meta

    @override
    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        state = checkpoint["state_dict"]
        if isinstance(state, rec_checkpoint.DCPCheckpoint) and not state.modified:
            rec_checkpoint.load_model(self.lightning_module, state.path, strict=strict)
        else:  # a gathered file, or a state dict on_load_checkpoint changed: whole tensors (FSDP's dense layers are
            # cut to this rank's shards first; each sharded table keeps its pieces)
            state = rec_checkpoint.localize_full_state(self.lightning_module, dict(state))
            super().load_model_state_dict({**checkpoint, "state_dict": state}, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        self._restore_finetuning_groups()
        states = checkpoint["optimizer_states"]
        if states and isinstance(states[0], rec_checkpoint.DCPCheckpoint):
            for optimizer, ref in zip(self.optimizers, states):
                # strict_loading=False: a table added since the save starts its fused state afresh, as its weights
                rec_checkpoint.load_optimizer(optimizer, ref.path, ref.index, module=self.lightning_module,
                                              strict=self.lightning_module.strict_loading)
        elif (rec_checkpoint.has_whole_by_name(states) or self._dense == "fsdp"
              or not self.lightning_module.strict_loading):
            # a gathered file written with FSDP dense layers, or with DDP's whole tensors into FSDP's shards; or
            # strict_loading=False, under which a table added since the save keeps its fresh fused state (the
            # optimizer's own load_state_dict, which Lightning calls, refused it as missing)
            for optimizer, state in zip(self.optimizers, states):
                rec_checkpoint.load_gathered_optimizer(optimizer, state, module=self.lightning_module,
                                                       strict=self.lightning_module.strict_loading)
        else:
            super().load_optimizer_state_dict(checkpoint)

    def _restore_finetuning_groups(self) -> None:
        """Lightning's BaseFinetuning puts the param groups it added back into the optimizer in on_fit_start, from the
        state it loaded; this strategy restores checkpoints after setup (into the sharded tables), so Lightning loads
        that state after on_fit_start, and the optimizer state then met an optimizer short of those groups ("loaded
        state dict has a different number of parameter groups"). Its restore runs here, before the state loads."""
        from lightning.pytorch.callbacks import BaseFinetuning

        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        for callback in trainer.callbacks if trainer is not None else []:
            if isinstance(callback, BaseFinetuning) and getattr(callback, "_restarting", False):
                callback.on_fit_start(trainer, self.lightning_module)

    def _gathered_state_dict(self) -> dict[str, Any]:
        # one table at a time, through the DMP's guarded gather (checkpoint.py, "the gathered format")
        return rec_checkpoint.gathered_state_dict(self.lightning_module.state_dict(), self._dmp)

    def _gathered_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return rec_checkpoint.gathered_optimizer_state(optimizer, self._dmp, module=self.lightning_module)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            "rec", cls, description="lightning_rec: sharded embedding tables + data-parallel dense layers"
        )


@contextlib.contextmanager
def _empty_batch_logs_weigh_nothing(module: pl.LightningModule, batch: Any):
    """While the step runs on a batch of 0 rows (a rank whose evaluation share ran out steps with these while the
    others finish), a non-finite value it logs (the mean loss over no rows is NaN) is logged as 0. Its weight is the
    batch size, 0, but Lightning's weighted mean multiplies: NaN x 0 made the epoch's value NaN on every rank."""
    if isinstance(batch, Batch):  # the usual batch, sized without Lightning's walk of it (~10 us a step)
        empty = batch.labels.shape[0] == 0
    else:
        try:
            with warnings.catch_warnings():  # its "ambiguous collection" note is for self.log's callers, said there
                warnings.simplefilter("ignore")
                empty = batch is not None and extract_batch_size(batch) == 0
        except Exception:  # noqa: BLE001 - a batch Lightning cannot size: the step logs as it is
            empty = False
    if not empty or module is None or "log" in vars(module):
        yield
        return
    log = module.log

    def weightless_log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            value = torch.zeros_like(value)
        return log(name, value, *args, **kwargs)

    vars(module)["log"] = weightless_log  # log_dict logs through self.log too
    try:
        yield
    finally:
        vars(module).pop("log", None)


def _empty_collated_batch(loader: object):
    """A per-row map-style dataset under torch's default_collate (a TensorDataset, say): its first row collated, every
    tensor cut to 0 rows, so a rank whose share ran out steps with a batch of the usual structure and no rows. Without
    it, Lightning's samplers were kept: validate counted a repeated row twice (33 rows at 2 ranks: 34 in every
    metric) and predict wrote 32 of 33 rows (the rank with one batch fewer ended the pass for all). None where a leaf
    is not a tensor of that one row (strings, a collate of one's own): the rows are dealt as Lightning deals them."""
    from lightning.fabric.utilities.apply_func import apply_to_collection
    from torch.utils.data import IterableDataset, default_collate

    dataset = getattr(loader, "dataset", None)
    if getattr(loader, "collate_fn", None) is not default_collate or dataset is None \
            or isinstance(dataset, IterableDataset):
        return None
    try:
        if len(dataset) == 0:
            return None
        one = default_collate([dataset[0]])
    except Exception:  # noqa: BLE001 - a row that cannot be read or collated alone: no padding
        return None
    def one_row(x) -> bool:
        if isinstance(x, torch.Tensor):
            return x.dim() >= 1 and x.shape[0] == 1
        if isinstance(x, (list, tuple)):
            return all(one_row(v) for v in x)
        if isinstance(x, dict):
            return all(one_row(v) for v in x.values())
        return False

    if not one_row(one):
        return None

    def pad():
        return apply_to_collection(one, torch.Tensor, lambda t: t[:0])

    return pad


class _OwnRowsOnly(torch.utils.data.Sampler):
    """A DistributedSampler's indices for its rank without the repeated ones it pads a shorter share with (the last
    index of every rank whose share is one row short): rank r keeps len(range(r, rows, W)) indices, its share's own."""

    def __init__(self, sampler: torch.utils.data.DistributedSampler, rows: int) -> None:
        self.sampler = sampler
        self.num_samples = len(range(sampler.rank, rows, sampler.num_replicas))

    def __iter__(self):
        import itertools

        return itertools.islice(iter(self.sampler), self.num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:  # Lightning calls it on the loader's sampler each epoch
        self.sampler.set_epoch(epoch)


class _RowsOfThisRank(torch.utils.data.Sampler):
    """Lightning's prediction deal (rank r: the sampler's rows r, r+W, ...), without its assertion that every rank
    gets one: a rank with none steps with an empty batch."""

    def __init__(self, sampler: torch.utils.data.Sampler, world_size: int, rank: int) -> None:
        self.sampler, self.world_size, self.rank = sampler, world_size, rank

    def __iter__(self):
        import itertools

        return itertools.islice(iter(self.sampler), self.rank, None, self.world_size)

    def __len__(self) -> int:
        return len(range(self.rank, len(self.sampler), self.world_size))


def _in_a_combined_batch(trainer: pl.Trainer, loader: object) -> bool:
    """Is `loader` one of several whose batches its loop combines into one (training on a dict / list of loaders,
    CombinedLoader's modes other than "sequential")? Lightning's batch hooks then get that combined batch."""
    loops = (trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop,
             trainer.predict_loop)
    for loop in loops:
        combined = getattr(loop, "_combined_loader", None)  # Lightning 2.6: the loop's CombinedLoader
        if combined is not None and any(dl is loader for dl in combined.flattened):
            return getattr(combined, "_mode", "sequential") != "sequential" and combined.iterables is not loader
    return False


def _dataloader_index(trainer: pl.Trainer, loader: object) -> int:
    """`loader`'s dataloader_idx in its loop (0 for training, as Lightning passes; 0 when not found)."""
    if trainer.training:
        return 0
    loops = (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop)
    for loop in loops:
        combined = getattr(loop, "_combined_loader", None)
        for i, dl in enumerate(getattr(combined, "flattened", None) or []):
            if dl is loader:
                return i
    return 0


# Ranks that step together ------------------------------------------------------------------------
#
# Every step runs embedding collectives, so a rank with one more batch than the others (a streaming
# dataset whose blocks do not split evenly, an IterableDataset of any kind) would wait in its
# all-to-all for peers that have finished the epoch, until the timeout. Instead, before each batch
# the ranks agree (one tiny all-reduce) that all of them have one. Training: the first rank to run
# out ends the epoch for everyone, and a rank that had more says so. Evaluation (validate, test,
# predict, fit's validation), when the dataset has `empty_batch()`: a rank that ran out steps on with
# empty batches until every rank has, so every row of the split is scored exactly once.

_TOGETHER_CLASSES: dict[type, type] = {}


def _stop_together(loader: DataLoader, all_have_a_batch, pad=None, evaluating: bool = False) -> None:
    # a subclass whose only change is __iter__ (of the loader's own class: a loader that ran
    # pipelined before, pipeline.wrap_loader, goes back to the plain rule)
    from lightning_rec.pipeline.lightning import swap_iter

    swap_iter(loader, "StepTogether", _iter_together, _TOGETHER_CLASSES)
    loader._rec_all_have_a_batch = all_have_a_batch
    loader._rec_pad_batch = pad
    loader._rec_evaluating = evaluating


def _iter_together(self):
    base = next(c for c in type(self).__mro__[1:] if not getattr(c, "_rec_step_together", False))
    batches = base.__iter__(self)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        yield from batches  # the loader went on to a run without ranks
        return
    try:  # a sized loader's last batch is known: Lightning does not ask such a loader for one more
        length = len(self)
    except TypeError:
        length = None
    skipped = (f"rank {dist.get_rank()}: the rest of this epoch's batches are skipped: another rank's dataloader "
               f"ran out first, and sharded embeddings need every rank in every step. Give every rank the same "
               f"number of batches (e.g. drop_last, or an even split) to use them all")
    pad = getattr(self, "_rec_pad_batch", None)
    if pad is None and (not length or getattr(self, "_rec_evaluating", False)):
        skipped += (" (in evaluation, a dataset with an `empty_batch()` method (a batch of 0 rows) lets a rank that "
                    "ran out step on with empty batches instead, so that every row is scored)")
    index, exhausted = 0, False
    while True:
        batch, have = None, False
        if not exhausted:
            try:
                batch, have = next(batches), True
            except StopIteration:
                exhausted = True
        last = length is not None and index == length - 1
        all_have, someones_last, any_has = self._rec_all_have_a_batch(have, index, last)
        if not all_have:
            if pad is None or not any_has:
                if have:  # the rest is not read: parsing it could keep the others waiting
                    warnings.warn(skipped, stacklevel=2)
                return
            if not have:  # evaluation: this rank's data ran out, another's has not: an empty batch keeps it stepping
                batch = pad()
        index += 1
        yield batch
        if someones_last:
            # a rank's sized loader gave its last batch: it will not be asked again, so the epoch ends here
            # for every rank, with no further agreement (without this, the others would wait for it there)
            if not last:
                warnings.warn(skipped, stacklevel=2)
            return


class _IgnoreSigterm:
    """A DataLoader's worker_init_fn: the worker ignores a SIGTERM that does not come from its rank, then runs the
    loader's own worker_init_fn (if any).

    A preempted job's SIGTERM reaches every process of the job (SLURM signals the whole job step, `kill -- -PGID` the
    process group), the loader workers too, and torch's workers die of it at once: the rank's next batch failed with
    "DataLoader worker (pid N) is killed by signal: Terminated" instead of the step it was to stop after (_on_sigterm).
    The rank stops its workers itself, by SIGTERM too where they do not end (torch's shutdown, multiprocessing's exit):
    that one still ends the worker (ignored, the rank's exit waited for it). Told apart by the sender, which a thread
    waiting on the blocked signal sees (sigwaitinfo; where there is none, the worker keeps torch's behaviour)."""

    def __init__(self, own: Any) -> None:
        self.own = own

    def __call__(self, worker_id: int) -> None:
        import signal
        import threading

        if hasattr(signal, "sigwaitinfo") and threading.current_thread() is threading.main_thread():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started from here on inherit it
            threading.Thread(target=_end_on_the_ranks_sigterm, name="lightning_rec: SIGTERM from the rank",
                             daemon=True).start()
        if self.own is not None:
            self.own(worker_id)


def _raise_agreed_sigterm(trainer: pl.Trainer) -> None:
    """Lightning's per-batch SIGTERM check (`_TrainingEpochLoop._broadcast_sigterm_tensor`) without its broadcast:
    RecStrategy sets `received_sigterm` on every rank at the same batch, so the local flag is rank 0's."""
    if getattr(trainer, "received_sigterm", False):
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        raise SIGTERMException()


def _end_on_the_ranks_sigterm() -> None:
    import os
    import signal

    rank = os.getppid()
    while True:
        sent = signal.sigwaitinfo({signal.SIGTERM})
        if sent.si_pid == rank or os.getppid() != rank:
            os._exit(128 + signal.SIGTERM)  # as a SIGTERM'd process's status reads to a shell


def _workers_outlive_sigterm(loader: object) -> None:
    if not isinstance(loader, DataLoader) or loader.num_workers <= 0 or isinstance(loader.worker_init_fn,
                                                                                    _IgnoreSigterm):
        return
    loader.worker_init_fn = _IgnoreSigterm(loader.worker_init_fn)


def _given_ddp_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """kwargs without DistributedDataParallel arguments set to DDP's own default.

    A recipe (LightningCLI, `strategy: {class_path: ...RecStrategy}`) spells out every DDP argument
    at its default; passed on, `process_group=None` would collide with the model-parallel group and
    `gradient_as_bucket_view=False` undo DistributedModelParallel's choice.
    """
    ddp = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    own = inspect.signature(DDPStrategy.__init__).parameters
    plain = (bool, int, float, str, type(None))

    def at_default(name: str, value: Any) -> bool:
        p = ddp.get(name)
        return (name not in own and p is not None and p.default is not inspect.Parameter.empty
                and isinstance(value, plain) and isinstance(p.default, plain) and value == p.default)

    return {k: v for k, v in kwargs.items() if not at_default(k, v)}


if "rec" not in StrategyRegistry:
    RecStrategy.register_strategies(StrategyRegistry)


def warn_fused_dense_only(module: torch.nn.Module, trainer: Any, fused: list[str] | None = None) -> None:
    """accumulate_grad_batches > 1 or gradient_clip_val with fused tables: say that it reaches the dense layers only.

    fused: fused_table_modules(module), when the caller has it already."""
    accumulate = trainer.accumulate_grad_batches
    clip = trainer.gradient_clip_val
    if accumulate <= 1 and not clip:
        return
    if fused is None:
        fused = fused_table_modules(module)
    if fused and clip:
        # Lightning clips between backward and the optimizer step; the fused rows moved inside backward
        by_norm = (trainer.gradient_clip_algorithm or "norm") == "norm"
        norm = ", and the norm clipped is the dense layers' alone" if by_norm else ""
        warnings.warn(
            f"gradient_clip_val={clip} clips the dense layers' gradients only: the fused tables ({fused[0]}) update "
            f"inside backward, before Lightning clips, from unclipped gradients{norm}. The fused update clips "
            f"nothing: to bound the tables' steps, lower their learning rate",
            stacklevel=1)
    if fused and accumulate > 1:
        warnings.warn(
            f"accumulate_grad_batches={accumulate} accumulates the dense layers' gradients only: the fused tables "
            f"({fused[0]}) update inside every batch's backward, {accumulate}x as often as the dense layers, each "
            f"time from that batch's loss divided by {accumulate} (Lightning's scaling for accumulation). To give "
            f"both one larger batch, raise the data module's batch_size instead", stacklevel=1)
