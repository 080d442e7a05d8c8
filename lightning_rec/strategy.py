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
restores every rank's dataloader position (exact mid-epoch resume). See lightning_rec/checkpoint/
`checkpoint_format="gathered"` writes the previous format: every table gathered whole to rank 0
one table at a time, one file written straight to disk (rank 0 holds the whole model once); both
formats load (a gathered file is memory-mapped: each rank reads only its pieces).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_rec import _compat, comm
from lightning_rec import checkpoint as rec_checkpoint
from lightning_rec._strategy import groups, loaders
from lightning_rec._strategy.groups import CLOSE_AFTER_ERROR_S, close_process_groups  # noqa: F401  (imported from here)
from lightning_rec._strategy.signals import SignalTakeover, workers_outlive_sigterm
from lightning_rec.dense_compile import compile_options
from lightning_rec.embedding import fused_table_modules
from lightning_rec.model_parallel import DistributedModelParallel
from lightning_rec.optim import fused_modules, holds_fused_optimizer
from lightning_rec.pipeline import InputPipeline, PipelineConfig, wrap_loader
from lightning_rec.pipeline.lightning import LoopState, set_loop_state
from lightning_rec.planner import EmbeddingShardingPlanner, Topology
from lightning_rec.table_weight import FusedTableWeight
from lightning_rec.types import ShardingPlan

_SHARDED_BY = "_lightning_rec_dmp"  # LightningModule.__dict__ key: the DistributedModelParallel of its tables


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
        compile_dense: True (or a dict of torch.compile arguments): torch.compile on the dense layers, the
            embedding lookups outside the graphs (DistributedModelParallel's argument).
        cuda_graphs: CUDA only: the compiled dense layers replay as CUDA graphs (mode="reduce-overhead").
        **kwargs: DDPStrategy's arguments (process_group_backend, find_unused_parameters, ...).
    """

    # read by the data modules' loaders: the ranks agree on every batch and gather loader states here
    steps_ranks_together = True

    strategy_name = "rec"

    # typed (not Any): jsonargparse then names a recipe's misspelt `planner:` field instead of handing on a dict
    def __init__(self, plan: ShardingPlan | None = None, planner: EmbeddingShardingPlanner | None = None,
                 dense: str = "ddp", embedding_timeout: float = 300.0, pipeline: Any = False,
                 checkpoint_format: str = "dcp", compile_dense: bool | dict = False, cuda_graphs: bool = False,
                 **kwargs: Any) -> None:
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
        compile_options(compile_dense, "RecStrategy", cuda_graphs)  # refused here, not at setup
        self._compile = dict(compile_dense=compile_dense, cuda_graphs=cuda_graphs)
        self._checkpoint_format = checkpoint_format
        super().__init__(**_given_ddp_kwargs(kwargs))
        self._plan = plan
        self._planner = planner
        self._dense = dense
        self._embedding_timeout = embedding_timeout
        self._dmp: DistributedModelParallel | None = None
        self._pipeline_config = PipelineConfig.of(pipeline)
        self._step_batch: Any = None  # semi_sync: the batch this training step trains
        self._warned_manual_semi_sync = False
        self._pipelines: list = []  # one per dataloader of this run's loops (closed at teardown)
        self._backwards_unstepped = 0  # manual optimization: backwards since the last optimizer step
        self._step_hooks: list = []
        self._warned_manual_accumulation = False
        self._gathering = False  # inside block_backward_sync: a micro-batch of gradient accumulation
        self._signals = SignalTakeover()  # SIGTERM / SLURM requeue, acted on by every rank at one batch

    @property
    def dmp(self) -> DistributedModelParallel:
        if self._dmp is None:
            raise ValueError("the model is sharded during Trainer setup: read strategy.dmp after fit/validate starts")
        return self._dmp

    @property
    def plan(self) -> ShardingPlan:
        return self.dmp.plan

    @property
    def pipeline_config(self) -> PipelineConfig | None:
        """The pipeline's settings (None: the loops are not pipelined)."""
        return self._pipeline_config

    def _default_planner(self):
        """A planner told what this run trains: the batch per rank (each collection's fused optimizer it reads from
        the module it plans: passing the first one's made every collection planned by it)."""
        topology, batch_size = self._run_topology_and_batch_size()
        pipelined = self._pipeline_config.depth if self._pipeline_config is not None else False  # batches held
        return EmbeddingShardingPlanner(topology, batch_size=batch_size, print_stats=False, pipelined=pipelined)

    def _run_topology_and_batch_size(self):
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
            timeout_setting="RecStrategy(embedding_timeout=...)", local_world_size=self.num_processes,
            **self._compile,
        )
        # in the module's own __dict__ (not a submodule): a later Trainer over this module finds its tables sharded
        vars(module)[_SHARDED_BY] = self._dmp
        if self.is_global_zero:
            print(f"lightning_rec sharding plan ({self.world_size} ranks):\n{self._dmp.plan}", flush=True)
            if self.world_size > 1:
                print(self._dmp.transport(), flush=True)

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
        prior.compile_dense_layers(**self._compile)  # (none again where an earlier run compiled them)
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
        for logger in self._lightning_module.trainer.loggers:  # (W&B's, wherever it is in the list)
            if callable(getattr(logger, "log_table", None)):
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
        # DDP reduces only the parameters that required a gradient when it was built: a change of what is frozen
        # rebuilds it (below). Tables (FusedTableWeight: requires_grad reads False) are not DDP's.
        self._dense_params = [p for p in self._dmp._unwrapped.parameters() if not isinstance(p, FusedTableWeight)]
        self._dense_trainable = [p.requires_grad for p in self._dense_params]

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._step_batch = batch
        # SLURM's requeue signal, agreed on: Lightning's handler, on every rank here (before the step's collectives)
        self._signals.run_due_requeue()
        # after the callbacks' and the module's on_train_*_start hooks, where BaseFinetuning (un)freezes
        if self._dense != "ddp" or self.world_size == 1 or self._dmp is None:
            return
        if [p.requires_grad for p in self._dense_params] == self._dense_trainable:  # ~1 us for a DLRM's layers
            return
        # the same change on every rank (as BaseFinetuning makes it): DDP again over what trains now (collective)
        self._dmp.wrap_dense("ddp", self._ddp_kwargs)
        self.model = self._dmp._dmp_wrapped_module
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            self._register_ddp_hooks()
        self._note_trainable_dense()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._check_same_pipeline()
        self._signals = SignalTakeover.take_over(trainer, self.world_size, self.global_rank, self.launcher)
        if trainer.state.fn != TrainerFn.FITTING and self._dmp is None:
            self._shard(dense=None)  # evaluation: tables stay sharded, no gradients to reduce
        if trainer.state.fn == TrainerFn.PREDICTING and self.world_size > 1:
            loaders.deal_fewer_rows_than_ranks(trainer, self.world_size, self.global_rank)
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_fit(trainer)

    def _setup_fit(self, trainer: pl.Trainer) -> None:
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
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's accumulate_grad_batches (and, by hand, a manual-optimization step's batches before it): the
        micro-batches' backward syncs no dense gradient and updates no fused table (DistributedModelParallel.no_sync);
        the step's backward applies the tables' gathered gradients in one fused update."""
        if self._dmp is None:
            with super().block_backward_sync():
                yield
            return
        self._gathering = True
        try:
            with self._dmp.no_sync():
                yield
        finally:
            self._gathering = False

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        if module is None or module.automatic_optimization or self._warned_manual_accumulation or self._gathering:
            return out
        # a second backward with no optimizer step between is manual accumulation: the fused tables do not accumulate
        self._backwards_unstepped += 1
        if self._backwards_unstepped == 2:
            fused = fused_table_modules(module)
            self._warned_manual_accumulation = True
            if fused:
                warnings.warn(
                    f"manual optimization: a second backward (self.manual_backward) before an optimizer step, as "
                    f"when accumulating gradients by hand. It accumulates the dense layers' gradients only: the fused "
                    f"tables ({fused[0]}) update inside every backward, not at opt.step(). To accumulate both, "
                    f"run the batches before the step (forward and backward) under "
                    f"`with self.trainer.strategy.block_backward_sync():`",
                    stacklevel=3)  # the user's manual_backward line (backward <- LightningModule.manual_backward)
        return out

    def _check_same_pipeline(self) -> None:
        """Collective, once per run: every rank pipelines alike (a rank that pipelines builds its channel's group at
        its first loader while the others go on to Lightning's collectives: a Store timeout naming no setting)."""
        if self.world_size <= 1 or not dist.is_initialized():
            return
        config = self._pipeline_config
        depth, semi = (config.depth, int(config.semi_sync)) if config is not None else (0, 0)
        rows = comm.agree([depth, semi], device=self.root_device, tag="the ranks' pipeline depths")
        depths, semis = [d for d, _ in rows], sorted({bool(x) for _, x in rows})
        least, most = min(depths), max(depths)
        if least != most or len(semis) > 1:
            raise ValueError(f"RecStrategy(pipeline=...) differs between ranks: rank {self.global_rank} has depth "
                             f"{depth} and semi_sync={bool(semi)}; the ranks' depths range from {least} to {most} "
                             f"(0: not pipelined), their semi_sync settings are {semis}. Pass the same pipeline "
                             f"setting on every rank")

    def _warn_if_fused_optimizer_left_out(self) -> None:
        """configure_optimizers returned only a dense optimizer while tables train fused: said, not silent.

        The tables still train (inside backward, at their configured rate), but no scheduler reaches that rate and
        the checkpoints hold none of their optimizer state (row-wise Adagrad's sums, Adam's moments), so a resumed
        run restarts it: Adagrad's first steps after a resume are the large ones of a fresh start."""
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

    # dataloaders: every rank runs every step (_strategy/loaders.py) ---------------------------------------------

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        if isinstance(dataloader, DataLoader):
            dataloader = self._loader_of_this_loop(dataloader, self.lightning_module.trainer)
        # the pipeline reads ahead too: the loader's saved position is the step's
        loaders.track_loader_position(dataloader, self._batches_this_epoch)
        return dataloader

    def _loader_of_this_loop(self, loader: DataLoader, trainer: pl.Trainer) -> DataLoader:
        """The loader as this loop reads it: its own copy, each rank's own rows, the ranks' agreed length, and every
        batch agreed on (by the pipeline's feeder, or before each batch)."""
        training, several = bool(trainer.training), self.world_size > 1
        loader = loaders.own_loader_of_this_loop(loader, training)
        if several and not training:
            loader = loaders.without_repeated_rows(loader, trainer.state.stage)
        workers_outlive_sigterm(loader)
        state = LoopState(training=training, evaluating=not training)
        if several and training:
            state.agreed_len = loaders.agree_training_length(loader, self.global_rank, self.root_device)
        state.pad = loaders.padding_for(loader, training)
        if several and not training:
            state.padded_len = loaders.agree_evaluation_length(loader, state.pad, self.root_device)
        if self._pipeline_config is not None and self._dmp is not None:
            return self._pipelined(loader, state)
        if several:
            loaders.step_together(loader, state, self._all_have_a_batch)
        else:
            set_loop_state(loader, state)
        return loader

    def _pipelined(self, loader: DataLoader, state: LoopState) -> DataLoader:
        self._close_replaced_pipelines()
        if any(p.loader is loader and p.feeder is None and not p.closed for p in self._pipelines):
            # one loader twice in one loop ({"a": loader, "b": loader}): each pass would stop the other's feeder
            loader = loaders.loader_copy(loader)
        # collective (the pipeline's own channel): every rank builds its loaders' pipelines in one order
        hooks = loaders.batch_hooks_for(self.lightning_module.trainer, self.lightning_module, self.root_device, loader)
        pipeline = InputPipeline(self.lightning_module, self.root_device, self._pipeline_config, to_device=hooks)
        pipeline.loader = loader
        pipeline.stop_signal = (self._stop_requested, self._stop_agreed)
        self._pipelines.append(pipeline)
        loaders.skip_hooks_for_pipelined_batches(self.lightning_module, self._pipelined_batch)
        set_loop_state(loader, state)
        # it keeps ranks together too
        return wrap_loader(loader, pipeline, state.pad, position=self._batches_this_epoch if state.training else None)

    def _pipelined_batch(self, batch: Any) -> bool:
        return any(p.owns(batch) for p in self._pipelines)

    def _close_replaced_pipelines(self) -> None:
        """Close the pipelines of loaders no loop holds any more (reloaded loaders): their channels go back to the
        pool, their feeder threads end. Collective-safe: the loops hold the same loaders on every rank."""
        held = loaders.held_loaders(self.lightning_module.trainer)
        # a pipeline no pass has used yet may belong to a loader of the loop setting up now (processed one by one)
        for pipeline in [p for p in self._pipelines if id(p.loader) not in held and p.feeder is not None]:
            pipeline.close()
            self._pipelines.remove(pipeline)

    def _all_have_a_batch(self, have: bool, index: int, last: bool = False) -> tuple[bool, bool, bool]:
        """Collective: (does every rank have batch `index`, is it some rank's last, does any rank have one).
        Through the embedding group's guard (and shared memory when the tables use it): ranks at different
        batches raise on every rank. `last`: this rank's sized loader has no batch after this one."""
        stop = self._stop_requested()  # a SIGTERM (or SLURM's requeue signal) rides on it
        if self._dmp is not None:
            all_have = self._dmp.step_together(have, index, last, stop=stop)
            self._stop_agreed(self._dmp.stop_agreed)
            return all_have, self._dmp.last_batch_agreed, self._dmp.any_batch_agreed
        rows = comm.agree([int(have), int(have and last), stop], device=self.root_device, tag="ranks step together")
        self._stop_agreed({r: bits for r, (_, _, bits) in enumerate(rows) if bits})
        return all(h for h, _, _ in rows), any(x for _, x, _ in rows), any(h for h, _, _ in rows)

    def _stop_requested(self) -> int:
        return self._signals.requested()

    def _stop_agreed(self, ranks: dict[int, int]) -> None:
        self._signals.agreed(ranks)

    def _batches_this_epoch(self) -> int:
        return int(self.lightning_module.trainer.fit_loop.epoch_loop.batch_progress.current.processed)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if self._pipelined_batch(batch):
            return batch  # the pipeline copied it (on GPU: on its side stream, from pinned memory)
        return super().batch_to_device(batch, device, dataloader_idx)

    # steps -----------------------------------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        self._step_done()
        config = self._pipeline_config
        if config is not None and (config.semi_sync or config.prefetch):
            self._look_ahead()
        return out

    def _look_ahead(self) -> None:
        """semi_sync / prefetch: the next batch is taken from the pipeline now and looked up (or its rows prefetched)
        before this step's backward. Automatic optimization only: a manual step has run its backward already."""
        module = self.lightning_module
        if module is not None and not module.automatic_optimization and not self._warned_manual_semi_sync:
            self._warned_manual_semi_sync = True
            variant = "semi_sync" if self._pipeline_config.semi_sync else "prefetch"
            warnings.warn(f"RecStrategy(pipeline=PipelineConfig({variant}=True)) with manual optimization: the step "
                          f"runs its own backward before the next batch could be "
                          f"{'looked up' if variant == 'semi_sync' else 'prefetched'}, so the pipeline runs "
                          f"synchronously (sparse_dist)", stacklevel=2)
        if module is None or not module.automatic_optimization or not torch.is_grad_enabled():
            return
        for pipeline in self._pipelines:
            if pipeline.feeder is not None and pipeline.owns(self._step_batch):
                after = pipeline.feeder.peek()
                if after is not None:
                    pipeline.look_ahead(after)
                return

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with loaders.empty_batch_logs_weigh_nothing(self.lightning_module, args[0] if args else None):
            out = super().validation_step(*args, **kwargs)
        self._step_done()
        return out

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with loaders.empty_batch_logs_weigh_nothing(self.lightning_module, args[0] if args else None):
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
        Lightning takes the batch after next (a validation's own ids were charged to the training pipeline)."""
        for pipeline in self._pipelines:
            pipeline.forward_done()

    # process groups (_strategy/groups.py) ------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        self._refuse_weight_averaging()
        module = self.lightning_module
        groups.refuse_destroyed_groups(module, vars(module).get(_SHARDED_BY) if module is not None else None)
        if dist.is_available() and not dist.is_initialized():
            groups.warn_if_old_store_alive()
        super().setup_environment()
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            groups.close_gloo_groups_at_exit()

    def _refuse_weight_averaging(self) -> None:
        """Lightning's weight-averaging callbacks copy the module before it is sharded, then pair that copy's
        parameters with the module's one by one; sharded tables are not parameters of the module, so the pairs
        slid (a table's average met a dense weight). Said before the copy (of every table) is made."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return  # evaluation: the callbacks average nothing
        for callback in trainer.callbacks:
            if isinstance(callback, _compat.weight_averaging_callbacks()):
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
            _compat.unwrap_before_batch_transfer(module)
        if module is None or self._dmp is None or self.root_device.type == "cpu":
            super().teardown()
            return
        # Lightning moves the module to the CPU here; sharded tables cannot follow, so the whole module stays put
        vars(module)["cpu"] = lambda: module
        try:
            super().teardown()
        finally:
            vars(module).pop("cpu", None)

    @override
    def barrier(self, name: str | None = None) -> None:
        # once the tables are sharded, on the embedding group through its guard: a stopped peer is named within
        # embedding_timeout (the default group would wait its 30 minutes)
        if self._dmp is not None and self._dmp.groups_alive():
            comm.barrier(f"barrier ({name})" if name else "barrier", group=self._dmp._emb_pg)
            return
        super().barrier(name)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        # without gradients, plain all_gather (torch 2.13 deprecates the autograd one Lightning calls, per call)
        if sync_grads or not dist.is_initialized():
            return super().all_gather(tensor, group, sync_grads)
        tensor = tensor.contiguous()
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
        return torch.stack(gathered)

    # checkpoints: sharded through DCP (lightning_rec/checkpoint/), or gathered whole to rank 0 ------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # weights load into the sharded tables: each rank reads only its pieces

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
            # every rank's loader position too: each rank's sampler is its own (rank 0's would restart the others)
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
            # a gathered file written with FSDP dense layers (or DDP's into FSDP's), or strict_loading=False, under
            # which a table added since the save keeps its fresh fused state (torch's load_state_dict refuses it)
            for optimizer, state in zip(self.optimizers, states):
                rec_checkpoint.load_gathered_optimizer(optimizer, state, module=self.lightning_module,
                                                       strict=self.lightning_module.strict_loading)
        else:
            super().load_optimizer_state_dict(checkpoint)

    def _restore_finetuning_groups(self) -> None:
        """Lightning's BaseFinetuning puts the param groups it added back in on_fit_start; this strategy restores
        checkpoints after setup, so the optimizer state met an optimizer short of those groups ("loaded state dict
        has a different number of parameter groups"). Its restore runs here, before the state loads."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        for callback in trainer.callbacks if trainer is not None else []:
            if isinstance(callback, BaseFinetuning) and _compat.finetuning_restarting(callback):
                callback.on_fit_start(trainer, self.lightning_module)

    def _all_gather_object(self, obj: Any) -> list:
        if self._dmp is not None:  # guarded: a rank elsewhere is named within embedding_timeout
            return self._dmp.all_gather_object(obj)
        return comm.all_gather_object(obj)

    def _gathered_state_dict(self) -> dict[str, Any]:
        # one table at a time, through the DMP's guarded gather (checkpoint/gathered.py)
        return rec_checkpoint.gathered_state_dict(self.lightning_module.state_dict(), self._dmp)

    def _gathered_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return rec_checkpoint.gathered_optimizer_state(optimizer, self._dmp, module=self.lightning_module)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            "rec", cls, description="lightning_rec: sharded embedding tables + data-parallel dense layers"
        )


def _given_ddp_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """kwargs without DistributedDataParallel arguments set to DDP's own default.

    A recipe (LightningCLI, `strategy: {class_path: ...RecStrategy}`) spells out every DDP argument
    at its default; passed on, `process_group=None` would collide with the model-parallel group and
    `gradient_as_bucket_view=False` undo DistributedModelParallel's choice.
    """
    import inspect

    defaults = _compat.ddp_keyword_defaults()
    own = inspect.signature(DDPStrategy.__init__).parameters
    plain = (bool, int, float, str, type(None))

    def at_default(name: str, value: Any) -> bool:
        return (name not in own and name in defaults and isinstance(value, plain)
                and isinstance(defaults[name], plain) and value == defaults[name])

    return {k: v for k, v in kwargs.items() if not at_default(k, v)}


if "rec" not in StrategyRegistry:
    RecStrategy.register_strategies(StrategyRegistry)


def warn_fused_dense_only(module: torch.nn.Module, trainer: Any, fused: list[str] | None = None) -> None:
    """gradient_clip_val with fused tables, or accumulate_grad_batches > 1 under a strategy that cannot gather their
    gradients (not "rec"): say that it reaches the dense layers only.

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
    if fused and accumulate > 1 and not isinstance(trainer.strategy, RecStrategy):
        # Lightning asks only a parallel strategy to hold back a micro-batch's sync (block_backward_sync)
        warnings.warn(
            f"accumulate_grad_batches={accumulate} accumulates the dense layers' gradients only under "
            f"{type(trainer.strategy).__name__}: the fused tables ({fused[0]}) update inside every batch's backward, "
            f"{accumulate}x as often as the dense layers. Use Trainer(strategy='rec') (devices=1 too), which "
            f"gathers the tables' gradients and updates them once per step", stacklevel=1)
