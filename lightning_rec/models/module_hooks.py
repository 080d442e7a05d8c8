"""Lightning hooks that the library's LightningModules (DLRMModule, TwoTowerModule) share."""

from __future__ import annotations

import functools
import os
import resource
from typing import Any

import torch

from lightning_rec.checkpoint import MODULE_CLASS_KEY
from lightning_rec.embedding import _EmbeddingCollectionBase, fused_table_modules
from lightning_rec.managed_collision import ManagedCollisionCollection
from lightning_rec.optim import DENSE_OPTIMIZERS, FusedOptimizerConfig, combined_optimizer, dense_parameters
from lightning_rec.strategy import RecStrategy, warn_fused_dense_only


def _read_rec_checkpoints(trainer: Any, owner: str) -> None:
    """Let a Trainer of another strategy read `strategy="rec"` checkpoint directories (a torch.load fails on them)."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from lightning.pytorch.trainer.states import TrainerFn

    class RecDirectoryCheckpointIO(TorchCheckpointIO):
        def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            from lightning_rec import checkpoint as rec_checkpoint

            if not (isinstance(path, (str, os.PathLike)) and os.path.isdir(path)):
                try:
                    return super().load_checkpoint(path, *args, **kwargs)
                except rec_checkpoint.UNREADABLE:
                    rec_checkpoint.check_readable(path)  # a file cut short, named
                    raise
            # asked at load time: the same Trainer may validate, then fit
            if trainer.state.fn == TrainerFn.FITTING:  # whole tables, but no fused optimizer state or positions
                raise ValueError(
                    f"{path} is a checkpoint directory written by strategy='rec': resume from it with "
                    f"Trainer(strategy='rec', ...) (any number of devices, devices=1 too; it reshards), not "
                    f"{type(trainer.strategy).__name__}. For its weights alone, "
                    f"{owner}.load_from_checkpoint({str(path)!r})")
            return rec_checkpoint.lightning_checkpoint(path)

    if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # a CheckpointIO of the user's own stays theirs
        trainer.strategy.checkpoint_io = RecDirectoryCheckpointIO()


class _ClassOnly(classmethod):
    """A classmethod that refuses to be called on an instance, as Lightning's load_from_checkpoint does."""

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return super().__get__(instance, owner)
        name = f"{type(instance).__name__}.{self.__func__.__name__}"

        @functools.wraps(self.__func__)
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise TypeError(f"The classmethod `{name}` cannot be called on an instance. Please call it on the class "
                            f"type and make sure the return value is used.")

        return refuse


class RecCheckpointLoading:
    """Mixed in before LightningModule: `MyModule.load_from_checkpoint(path)` also reads `strategy="rec"` checkpoint
    directories (as `lightning_rec.checkpoint.load_from_checkpoint(MyModule, path)` does without it)."""

    @_ClassOnly
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's, which also reads `strategy="rec"` checkpoint directories (the module comes back unsharded)."""
        from lightning_rec import checkpoint as rec_checkpoint

        if isinstance(checkpoint_path, (str, os.PathLike)) and os.path.isdir(checkpoint_path):
            return rec_checkpoint.load_from_checkpoint(cls, checkpoint_path, *args, **kwargs)
        try:
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)
        except rec_checkpoint.UNREADABLE:
            rec_checkpoint.check_readable(checkpoint_path)  # a file cut short, named
            raise


class RecModuleHooks(RecCheckpointLoading):
    """Mixed in before LightningModule: `class DLRMModule(RecModuleHooks, L.LightningModule)`."""

    # RecStrategy reads it: these modules' setup() warns about settings that reach the dense layers only
    warns_fused_dense_only = True

    def setup(self, stage: str) -> None:
        super().setup(stage)
        trainer = self.trainer
        # keys both modules have: the data's is logged as data_<key> (Lightning refuses two values)
        initial = getattr(getattr(trainer, "datamodule", None), "_hparams_initial", None)
        for key in ("num_embeddings_per_feature", "sparse_feature_names"):
            if initial is not None and key in initial and key in self.hparams_initial and \
                    initial[key] != self.hparams_initial[key]:
                initial[f"data_{key}"] = initial.pop(key)

        precision = str(trainer.precision)
        if precision.endswith("-true") and precision != "32-true":
            # said here, before Lightning converts the module, naming the precision
            raise ValueError(
                f"Trainer(precision={precision!r}) converts every parameter, the embedding tables too, which keep "
                f"the data_type of their configs: use precision='bf16-mixed' (--trainer.precision=bf16-mixed: the "
                f"dense layers compute in bfloat16 under autocast), and DataType.FP16 in the table configs "
                f"for half-size tables")
        on_meta = [name for name, m in self.named_modules()
                   if isinstance(m, _EmbeddingCollectionBase) and getattr(m, "_device", None) == torch.device("meta")]
        if on_meta and not isinstance(trainer.strategy, RecStrategy):
            raise ValueError(
                f"{type(self).__name__}'s tables ({on_meta[0]}) were built on device='meta' (embedding_device='meta'): "
                f"they get their values when Trainer(strategy='rec') shards them (--trainer.strategy=rec); with "
                f"{type(trainer.strategy).__name__}, build them on the CPU (embedding_device='cpu')")
        if not isinstance(trainer.strategy, RecStrategy):
            _read_rec_checkpoints(trainer, type(self).__name__)
        if stage != "fit":
            return

        fused = fused_table_modules(self)
        warn_fused_dense_only(self, trainer, fused)
        if fused and trainer.world_size > 1 and not isinstance(trainer.strategy, RecStrategy):
            # evaluation may replicate the tables (every rank holds the same weights); training may not
            raise ValueError(
                f"{type(self).__name__} trains its tables with a fused optimizer ({fused[0]}), which "
                f"{type(trainer.strategy).__name__} cannot keep in step across {trainer.world_size} processes: each "
                f"rank would update its own copy and the tables would drift apart. Use Trainer(strategy='rec') "
                f"(--trainer.strategy=rec), which shards them")

    def check_raw_ids(self, datamodule: Any, what: str = "raw ids, which its tables") -> None:
        """A data module handing raw ids (hash_ids=False) to a module built without id maps (managed_collision=None),
        refused naming the fix (the modules with a `managed_collision` argument call it)."""
        if getattr(datamodule, "hash_ids", True) is not False:
            return
        owner = type(self).__name__
        if self.hparams.get("managed_collision") is None:
            raise ValueError(f"{type(datamodule).__name__}(hash_ids=False) hands the {what} would read as rows: give "
                             f"{owner}(managed_collision={{}}) (--model.init_args.managed_collision '{{}}') to map "
                             f"them to rows, or hash_ids=True")
        mapped = self.hparams.get("managed_collision_features")
        unmapped = [f for f in getattr(datamodule, "raw_id_features", ()) if mapped is not None and f not in mapped]
        if unmapped:
            raise ValueError(f"{type(datamodule).__name__}(hash_ids=False) hands raw ids on {unmapped}, which "
                             f"{owner}(managed_collision_features={list(mapped)}) leaves without an id map (they would "
                             f"be read as rows): add them, or managed_collision_features=None (every feature)")

    @staticmethod
    def check_embedding_device(owner: str, embedding_device: str) -> None:
        """The modules' `embedding_device` argument: 'cpu' or 'meta', else a ValueError naming both."""
        if embedding_device not in ("cpu", "meta"):
            raise ValueError(f"{owner}(embedding_device={embedding_device!r}): use 'cpu' (tables drawn here, then "
                             f"moved or sharded) or 'meta' (drawn where Trainer(strategy='rec') places each shard)")

    @staticmethod
    def check_embedding_kernel(owner: str, embedding_kernel: str) -> None:
        """The modules' `embedding_kernel` argument, checked at construction by the module's own names."""
        from lightning_rec.lookup import KERNELS

        if embedding_kernel == "dense":
            raise ValueError(f"{owner}(embedding_kernel='dense'): the tables train with the fused sparse_optimizer "
                             f"(updated inside backward), which the 'dense' kernel does not run: use "
                             f"embedding_kernel='auto' (or 'fbgemm' / 'native' on CPU)")
        if embedding_kernel not in KERNELS:
            raise ValueError(f"{owner}(embedding_kernel={embedding_kernel!r}): unknown kernel: use 'auto', 'fbgemm' or "
                             f"'native'")

    @staticmethod
    def check_dense_args(owner: str, dense_optimizer: str, dense_lr: float, dense_weight_decay: float,
                         warmup_steps: int) -> None:
        """The dense optimizer's arguments, said at construction by name (torch.optim would say it once fit began)."""
        if dense_optimizer not in DENSE_OPTIMIZERS:
            raise ValueError(
                f"unknown dense_optimizer {dense_optimizer!r}: choose one of {', '.join(DENSE_OPTIMIZERS)}"
            )
        bad = {k: v for k, v in (("dense_lr", dense_lr), ("dense_weight_decay", dense_weight_decay),
                                 ("warmup_steps", warmup_steps)) if v < 0}
        if bad:
            raise ValueError(f"{owner}({', '.join(f'{k}={v!r}' for k, v in bad.items())}): must be >= 0 "
                             f"(warmup_steps=0: no warm-up)")

    @staticmethod
    def fused_config(owner: str, sparse_optimizer: str, sparse_lr: float, sparse_eps: float,
                     sparse_weight_decay: float) -> FusedOptimizerConfig:
        """The tables' fused update; an error names the module's arguments the user set, not the config's fields."""
        try:
            return FusedOptimizerConfig(sparse_optimizer, lr=sparse_lr, eps=sparse_eps,
                                        weight_decay=sparse_weight_decay)
        except ValueError as e:
            raise ValueError(f"{owner}(sparse_optimizer={sparse_optimizer!r}, sparse_lr={sparse_lr!r}, "
                             f"sparse_eps={sparse_eps!r}, sparse_weight_decay={sparse_weight_decay!r}): {e}") from None

    def combined_optimizers(self, model: torch.nn.Module):
        """configure_optimizers' answer: the fused tables and the dense optimizer as one, with hparams.warmup_steps
        of linear warm-up (a scheduler driving both learning rates)."""
        hp = self.hparams
        dense = self.dense_optimizer(dense_parameters(model))
        optimizer = self.fused_rate_from_hparams(combined_optimizer(model, dense))
        if hp.warmup_steps <= 0:
            return optimizer
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / hp.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    # `lightning-rec fit --optimizer=CLASS` sets it: the dense layers' optimizer, in place of dense_optimizer
    cli_dense_optimizer: Any = None

    def dense_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
        """The dense layers' optimizer (None without any): hparams.dense_optimizer, or the CLI's --optimizer."""
        if self.cli_dense_optimizer is not None:
            if not params:
                raise ValueError(f"--optimizer trains the dense layers, and this {type(self).__name__} has none (its "
                                 f"tables update with their fused optimizer, --model.sparse_optimizer and "
                                 f"--model.sparse_lr): leave --optimizer out")
            return self.cli_dense_optimizer(params)
        if not params:
            return None
        hp = self.hparams
        return DENSE_OPTIMIZERS[hp.dense_optimizer](params, lr=hp.dense_lr, weight_decay=hp.dense_weight_decay)

    def fused_rate_from_hparams(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The fused tables start at hparams.sparse_lr, read when the optimizer is built (so lr_find's rate applies)."""
        fused = dict(getattr(optimizer, "optimizers", [])).get("fused")
        for group in fused.param_groups if fused is not None else []:
            group["lr"] = float(self.hparams.sparse_lr)
        return optimizer

    def log_train_loss(self, loss, batch_size: int) -> None:
        """train_loss for the loggers every step; on the progress bar only where reading it costs no device sync."""
        self.log("train_loss", loss, prog_bar=loss.device.type == "cpu", batch_size=batch_size)
        for m in self.modules():  # managed-collision tables: fill ratio, evictions, reused-row lookups (host floats)
            if isinstance(m, ManagedCollisionCollection):
                self.log_dict(m.metrics(), batch_size=batch_size)

    def on_train_epoch_end(self) -> None:
        self.log_memory_per_rank()

    def log_memory_per_rank(self) -> None:
        """mem/rank<r>_max_rss_mb (and _max_gpu_mb) for the loggers: each rank's peak memory (a collective)."""
        mem = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0]  # KiB on Linux: this process's peak
        if self.device.type == "cuda":
            mem.append(torch.cuda.max_memory_allocated(self.device) / 2**20)
        per_rank = self.all_gather(torch.tensor(mem, dtype=torch.float64, device=self.device)).reshape(-1, len(mem))
        # every rank holds the same gathered rows: sync_dist only keeps Lightning's epoch-level warning away (a mean
        # of equal values); batch_size: a training_step(dataloader_iter) has none to infer
        for rank, row in enumerate(per_rank.tolist()):
            self.log(f"mem/rank{rank}_max_rss_mb", row[0], batch_size=1, sync_dist=True)
            if len(row) > 1:
                self.log(f"mem/rank{rank}_max_gpu_mb", row[1], batch_size=1, sync_dist=True)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[MODULE_CLASS_KEY] = f"{type(self).__module__}.{type(self).__qualname__}"

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.check_same_id_maps(checkpoint.get("hyper_parameters") or {})

    def check_same_id_maps(self, saved: dict[str, Any]) -> None:
        """A checkpoint whose tables read raw ids through id maps into a module whose tables do not (or the
        reverse, or other tables), said from the saved hyperparameters before the state dict (a wall of keys)."""
        keys = [k for k in ("managed_collision", "managed_collision_features") if k in self.hparams and k in saved
                and (k == "managed_collision" or None not in (saved[k], self.hparams[k]))]
        if all(_id_maps(k, saved[k]) == _id_maps(k, self.hparams[k]) for k in keys):
            return
        owner = type(self).__name__
        given = ", ".join(f"{k}={saved[k]!r}" for k in keys)
        raise ValueError(f"this checkpoint was saved by a {owner}({given}), and this one is built with "
                         f"{', '.join(f'{k}={self.hparams[k]!r}' for k in keys)}: the id maps are part of the "
                         f"checkpoint's state. Build the module as it was saved ({owner}.load_from_checkpoint(path) "
                         f"does), or train the new configuration from the start")


def _id_maps(key: str, value: Any) -> Any:
    """What of a managed-collision hyperparameter decides the checkpoint's keys: whether there are maps, on which
    features (the maps' settings load into any map; None, every feature, is left to the state dict's load)."""
    if key == "managed_collision":
        return value is None
    return sorted(value)
