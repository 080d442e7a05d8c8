"""`RecCLI`: LightningCLI for the recipes (fit / validate / test / predict), and `run_cli`, which runs it.

Model and data are chosen by class path in the YAML (`model.class_path`, `data.class_path`), so a recipe can swap either
without code. After `fit`, the final validation metrics are printed."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import re
import sys
import warnings
from types import MethodType

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback, instantiate_class

import lightning_rec.strategy  # noqa: F401  (registers --trainer.strategy=rec)
from lightning_rec.cli import run_summary
from lightning_rec.cli.ckpt_path import CheckpointPathCLI
from lightning_rec.cli.hints import (
    _raised_in_lightning,
    _warn_options_a_later_config_sets,
    constructor_refusal,
    did_you_mean,
    remember_command_line,
    strategy_hint,
)


class RecArgumentParser(LightningArgumentParser):
    """Lightning's parser, whose refusal of a misspelt option also names the option that was meant."""

    def error(self, message: str, ex: Exception | None = None):
        return super().error(message + did_you_mean(self, message), ex)

    def print_usage(self, file=None) -> None:
        # argparse prints the usage before an error: for `fit`, 50 lines that push the error off the screen
        usage = self.format_usage()
        if usage.count("\n") > 3:
            usage = f"usage: {self.prog} [options]\n"
        self._print_message(usage, file or sys.stderr)


def _strategy_class(strategy) -> type | None:
    """The Strategy class that --trainer.strategy names (a registered name, a class or its path), else None."""
    from lightning.pytorch.strategies import Strategy, StrategyRegistry

    name = strategy if isinstance(strategy, str) else str(getattr(strategy, "class_path", "") or "")
    if not name:
        return None
    if name in StrategyRegistry:
        return StrategyRegistry[name]["strategy"]
    module, _, attr = name.rpartition(".")
    found = None
    for where in [module] if module else ["lightning_rec.strategy", "lightning.pytorch.strategies"]:
        try:
            found = getattr(importlib.import_module(where), attr, None)
        except ImportError:
            found = None
        if found is not None:
            break
    return found if isinstance(found, type) and issubclass(found, Strategy) else None


def _scheduled(configure, scheduler_init, ours: bool):
    """A configure_optimizers whose one optimizer (fused tables and dense layers) the --lr_scheduler drives."""
    name = str(scheduler_init.get("class_path", "")).rsplit(".", 1)[-1]

    def configure_optimizers(module):
        optimizer = configure()
        if not isinstance(optimizer, torch.optim.Optimizer):
            warmup = getattr(module.hparams, "warmup_steps", 0) if ours else 0
            because = (f"it warms up with a scheduler of its own (--model.warmup_steps={warmup}): set "
                       f"--model.warmup_steps=0" if warmup else "give the optimizer and scheduler there")
            raise ValueError(f"--lr_scheduler={name} schedules the one optimizer that "
                             f"{type(module).__name__}.configure_optimizers returns, but it returned "
                             f"{type(optimizer).__name__}: {because}, or leave --lr_scheduler out")
        try:
            scheduler = instantiate_class(optimizer, scheduler_init)
        except ValueError as e:
            if "cycle_momentum" not in str(e):
                raise
            # the combined optimizer's refusal names the Python argument; here the flag
            raise ValueError(f"--lr_scheduler={name} cycles the momentum by default, but the optimizer that "
                             f"{type(module).__name__} returns ({type(optimizer).__name__}: fused tables + dense "
                             f"layers) has no one momentum to cycle (the fused tables' hyper-parameters are fixed "
                             f"when they are built; only their lr follows a scheduler): add "
                             f"--lr_scheduler.cycle_momentum=false") from None
        return LightningCLI.configure_optimizers(module, optimizer, scheduler)

    return configure_optimizers


class RecCLI(CheckpointPathCLI):
    """LightningCLI for the recipes: one-line errors with their fix, fused tables kept in step, predict writing rows."""

    def _check_accelerator(self, config) -> None:
        # before the model is built (its GPU-sized tables would fill host memory first), naming what is missing
        from lightning_rec.lookup import cuda_missing

        accelerator = str(self._get(config, "trainer", {}).get("accelerator", "")).lower()
        what = cuda_missing() if accelerator in ("gpu", "cuda") else None
        if what is not None:
            raise SystemExit(f"lightning-rec: --trainer.accelerator={accelerator} needs a CUDA GPU, but {what}; "
                             f"or use --trainer.accelerator=cpu")

    def instantiate_trainer(self, **kwargs):
        from lightning.pytorch.strategies import StrategyRegistry

        strategy = self._get(self.config_init, "trainer", {}).get("strategy")
        if isinstance(strategy, str) and strategy not in StrategyRegistry and "strategy" not in kwargs:
            # `--trainer.strategy=RecStrategy` without options stays a string, which Lightning refuses
            cls = _strategy_class(strategy)
            if cls is not None:
                kwargs["strategy"] = cls()
        if strategy in (None, "auto") and "strategy" not in kwargs and self.subcommand == "fit":
            kwargs.update(self._rec_for_fused_tables_on_ranks())
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except MisconfigurationException as e:
            self._check_accelerator(self.config_init)
            # a refused Trainer option (`--trainer.devices=0`) in a line that names it, not a traceback
            raise SystemExit(f"lightning-rec: error: {self._trainer_options_named(e)}{e}") from None
        except TypeError as e:
            # `--trainer.devices=two`: a TypeError from Lightning's device parsing (elsewhere: a bug, traceback kept)
            if not _raised_in_lightning(e):
                raise
            raise SystemExit(f"lightning-rec: error: {self._trainer_options_named(e)}{e}") from None
        except ValueError as e:  # Lightning's refusal of a misspelt strategy name: a 40-line traceback, no guess
            said = strategy_hint(str(e))
            if said:
                raise SystemExit(said) from None
            raise
        if self.subcommand == "fit":  # metrics.csv beside W&B's files, and the final step's metrics
            run_summary.add_csv_logger(trainer)
            trainer.callbacks.append(run_summary.FinalStepValidation())
        run_summary.quiet_wandb(trainer)
        return trainer

    def _rec_for_fused_tables_on_ranks(self) -> dict:
        # strategy auto at 2+ ranks would be DDP, under which fused tables cannot train: for such a model it means rec
        trainer = self._get(self.config_init, "trainer", {}) or {}
        devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
        count = len(devices) if isinstance(devices, (list, tuple)) else \
            int(devices) if isinstance(devices, int) or str(devices).isdigit() else 1  # ("auto", -1: not counted)
        world = count * (nodes if isinstance(nodes, int) else 1)
        if world <= 1 or self.model is None:
            return {}
        from lightning_rec.models.module_hooks import RecModuleHooks, fused_table_modules

        fused = fused_table_modules(self.model)
        if not fused and not isinstance(self.model, RecModuleHooks):
            return {}
        if not fused:  # a library module that builds its tables later (the two-tower's, sized from the data)
            optimizer = getattr(getattr(self.model, "hparams", None), "sparse_optimizer", None)
            if not optimizer:
                return {}
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(f"lightning-rec fit: {type(self.model).__name__} trains its tables with a fused optimizer, "
                       f"which only --trainer.strategy=rec keeps in step over {world} processes: using it "
                       f"(the recipe's strategy is auto)")
        return {"strategy": "rec"}

    def _trainer_options_named(self, error: BaseException) -> str:
        """`--trainer.devices=two: ` for the Trainer options that Lightning's refusal names in backticks, or ''."""
        trainer = self._get(self.config, "trainer", {}) or {}
        named = dict.fromkeys(m for m in re.findall(r"`(\w+)`", str(error)) if m in trainer)
        return "".join(f"--trainer.{k}={trainer.get(k)}: " for k in named)

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        self._argv = list(sys.argv[1:] if args is None else args) if args is None or isinstance(args, list) else []
        _warn_options_a_later_config_sets(self._argv)  # (before parsing: --print_config exits inside it)
        remember_command_line(self._argv)  # a refusal of a config file names the file (did_you_mean)
        super().parse_arguments(parser, args)
        self._checkpoints_under_root_dir()

    def _checkpoints_under_root_dir(self) -> None:
        # a ModelCheckpoint without dirpath (the recipes') saves in <default_root_dir>/checkpoints, the same folder
        # from run to run (Lightning's default, a new logger version each run, is one --ckpt_path=last cannot find)
        subcommand = self.config.get("subcommand")
        trainer = (self.config.get(subcommand) if subcommand else self.config).get("trainer") or {}
        callbacks = trainer.get("callbacks") or []
        for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
            init = getattr(callback, "init_args", None)
            if str(getattr(callback, "class_path", "")).endswith(".ModelCheckpoint") and init is not None \
                    and not init.get("dirpath"):
                init.dirpath = os.path.join(str(trainer.get("default_root_dir") or os.getcwd()), "checkpoints")

    def _instantiate_trainer(self, config: dict, callbacks: list):
        # a config saying enable_checkpointing: false, to which the user adds a ModelCheckpoint: the ask to save
        from lightning.pytorch.callbacks import ModelCheckpoint

        given = config.get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        if config.get("enable_checkpointing") is False and any(isinstance(c, ModelCheckpoint) for c in given):
            config = {**config, "enable_checkpointing": True}
        return super()._instantiate_trainer(config, callbacks)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # every command's parser gets them (LightningCLI adds arguments to all alike); only predict reads them
        parser.add_argument("--predictions.output_path", type=str | None, default=None,
                            help="predict: the file to write (.csv, .tsv or .parquet); default "
                                 "<trainer.default_root_dir>/predictions.csv (or the next free predictions_<n>.csv)")
        parser.add_argument("--predictions.overwrite", type=bool, default=False,
                            help="predict: replace an existing predictions.output_path (default: refuse it)")

    def before_predict(self) -> None:
        # Lightning's predict keeps what predict_step returns in memory and writes nothing: add the writer
        from lightning.pytorch.callbacks import BasePredictionWriter

        from lightning_rec.predict import PredictionWriter

        options = self._get(self.config, "predictions", None) or {}
        given = [c for c in self.trainer.callbacks if isinstance(c, BasePredictionWriter)]
        if given and (options.get("output_path") is not None or options.get("overwrite")):
            raise ValueError(f"--predictions.* set the writer that predict adds, but trainer.callbacks has one "
                             f"already ({type(given[0]).__name__}): set its own options, or drop it")
        if not given:
            self.trainer.callbacks.append(PredictionWriter(options.get("output_path"), bool(options.get("overwrite"))))
        arguments = self.config_init[self.subcommand]
        if arguments.get("return_predictions") is None:
            # the writer has every row: Lightning need not keep them all in memory too
            arguments["return_predictions"] = False

    def after_predict(self) -> None:
        from lightning_rec.predict import PredictionWriter

        for writer in self.trainer.callbacks:
            if isinstance(writer, PredictionWriter) and writer.written_path is not None and self.trainer.is_global_zero:
                print(f"predictions: {writer.num_rows} rows written to {writer.written_path}", flush=True)

    def _logs_under_root_dir(self, config) -> None:
        # a W&B logger with no save_dir writes under --trainer.default_root_dir, as Lightning's default logger does
        trainer = self._get(config, "trainer", {})
        loggers = trainer.get("logger")
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            init = getattr(logger, "init_args", None) if str(getattr(logger, "class_path", "")).endswith(
                "WandbLogger") else None
            if init is not None and init.get("save_dir") in (None, ".") and not init.get("dir") and \
                    trainer.get("default_root_dir"):
                init.save_dir = trainer.get("default_root_dir")

    def _check_wandb_installed(self, config) -> None:
        # Lightning's "Requirement 'wandb>=0.12.10' not met" does not say how to run without it
        loggers = self._get(config, "trainer", {}).get("logger")
        wandb = [logger for logger in (loggers if isinstance(loggers, list) else [loggers])
                 if str(getattr(logger, "class_path", "")).endswith("WandbLogger")]
        if wandb and importlib.util.find_spec("wandb") is None:
            raise SystemExit("lightning-rec: error: the logger is W&B's (trainer.logger: WandbLogger), but wandb is "
                             "not installed: `pip install wandb` (it runs offline unless WANDB_MODE=online), or run "
                             "without it: --trainer.logger=false (or --trainer.logger=CSVLogger "
                             "--trainer.logger.save_dir=DIR)")

    def instantiate_classes(self) -> None:
        self._check_accelerator(self.config)
        self._check_wandb_installed(self.config)
        self._logs_under_root_dir(self.config)
        try:
            super().instantiate_classes()
        except ValueError as e:
            # a model's or data module's own ValueError, out of jsonargparse's 70-line Union report
            said = constructor_refusal(e)
            if said:
                raise SystemExit(f"lightning-rec: error: {said}") from None
            raise

    def _add_configure_optimizers_method_to_model(self, subcommand: str | None) -> None:
        # Lightning's --optimizer would optimize model.parameters(), leaving the fused tables out: here --optimizer is
        # the dense layers' optimizer and --lr_scheduler drives what the module returns (fused tables and dense layers)
        from lightning_rec.models.module_hooks import RecModuleHooks

        optimizer_init = self._get(self.config_init, "optimizer")
        scheduler_init = self._get(self.config_init, "lr_scheduler")
        model = self.model
        ours = isinstance(model, RecModuleHooks)
        if not scheduler_init and not (optimizer_init and ours) or optimizer_init and not ours:
            return super()._add_configure_optimizers_method_to_model(subcommand)
        if optimizer_init:
            model.cli_dense_optimizer = functools.partial(instantiate_class, init=optimizer_init)  # picklable
        if not scheduler_init:
            return
        model.configure_optimizers = MethodType(_scheduled(model.configure_optimizers, scheduler_init, ours), model)

    def _run_subcommand(self, subcommand: str) -> None:
        self._check_ckpt_path(subcommand, self._prepare_subcommand_kwargs(subcommand).get("ckpt_path"))
        if subcommand != "fit":  # evaluation restores no callback state: Lightning's advice has nothing to act on
            warnings.filterwarnings("ignore", message=r"Be aware that when using `ckpt_path`, callbacks used to create")
        check_paths = getattr(self.datamodule, "check_paths", None)
        if callable(check_paths):  # a missing file: one line here, before N ranks start (not N tracebacks)
            try:
                check_paths(subcommand)
            except ValueError as e:
                raise SystemExit(f"lightning-rec {subcommand}: error: {e}") from None
        super()._run_subcommand(subcommand)

    def after_fit(self) -> None:
        # the last validation's metrics (test_* too, with eval_test_in_fit), of the last step (FinalStepValidation)
        trainer = self.trainer
        validated = False
        step = next((c.step for c in trainer.callbacks if isinstance(c, run_summary.FinalStepValidation)), None)
        final = {}
        for split, what in (("val", "validation"), ("test", "test")):  # val_auc, and a task's val/<task>/auc
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                       if k.startswith((f"{split}_", f"{split}/"))}
            validated |= bool(metrics) and split == "val"
            final.update(metrics)
            if metrics and trainer.is_global_zero:
                shown = "  ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()))
                at = f"  (step {step})" if step is not None else ""
                print(f"final {what}: {shown}{at}", flush=True)
        # a fit shorter than the recipe's validation interval would end without a metric and without a word
        if not validated and trainer.is_global_zero and trainer.global_step > 0 and self._has_validation_data():
            every = trainer.check_val_every_n_epoch
            why = (f"it runs every {every} epochs here and this fit ran {trainer.current_epoch}" if every and
                   every > trainer.current_epoch else f"none of its points was reached in {trainer.global_step} steps")
            print(f"final validation: none ran ({why}): set --trainer.check_val_every_n_epoch (or "
                  f"--trainer.val_check_interval), or run `lightning-rec validate` with the fit's checkpoint",
                  flush=True)
        self._say_if_no_checkpoint_was_saved()
        if trainer.is_global_zero:
            run_summary.summarize(trainer, final, step)

    def _has_validation_data(self) -> bool:
        trainer = self.trainer
        if sum(trainer.num_val_batches or [0]) > 0:  # the sanity check read some
            return True
        if not trainer.limit_val_batches or trainer.datamodule is None:
            return False
        try:  # no sanity check (the MovieLens recipes skip it): ask the data module; building a loader reads nothing
            loaders = trainer.datamodule.val_dataloader()
            loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
            return any(len(loader) > 0 for loader in loaders)
        except Exception:  # noqa: BLE001 (a stream without a length, a module without validation: stay quiet)
            return False

    def _say_if_no_checkpoint_was_saved(self) -> None:
        # a ModelCheckpoint saves after validation: a fit shorter than the validation interval saves nothing, silently
        from lightning.pytorch.callbacks import ModelCheckpoint

        trainer = self.trainer
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and trainer.global_step > 0 and not callback.best_model_path \
                    and not callback.last_model_path and trainer.is_global_zero:
                every = trainer.check_val_every_n_epoch
                why = (f"it saves after validation, which runs every {every} epochs here and did not run in "
                       f"{trainer.current_epoch} epoch(s)" if every and every > trainer.current_epoch
                       else "none of its save points was reached")
                # --trainer.callbacks.X sets the last callback of the command line's list, which may not be this one
                callbacks = (self._get(self.config, "trainer", None) or {}).get("callbacks") or []
                last = callbacks[-1] if isinstance(callbacks, list) and callbacks else None
                given = str(getattr(last, "class_path", None) or "").endswith("ModelCheckpoint")
                add = "" if given else "--trainer.callbacks+=ModelCheckpoint "
                warnings.warn(f"ModelCheckpoint(dirpath={callback.dirpath}) saved no checkpoint in this fit: {why}. "
                              f"Add {add}--trainer.callbacks.save_last=true (a last.ckpt when fit ends) or "
                              f"{add}--trainer.callbacks.every_n_train_steps=N", stacklevel=1)


class _LoggedConfig(SaveConfigCallback):
    """config.yaml beside the run, as Lightning writes it; and the run's seed and Trainer settings to its loggers."""

    def save_config(self, trainer, pl_module, stage: str) -> None:
        # Lightning logs the modules' hyperparameters only: the seed and Trainer settings too
        import json

        trainer_config = self.config.get("trainer")
        if hasattr(trainer_config, "as_dict"):
            trainer_config = trainer_config.as_dict()
        settings = {"seed_everything": self.config.get("seed_everything"), "trainer": trainer_config}
        settings = json.loads(json.dumps(settings, default=str))  # paths and the like as text: every logger takes it
        for logger in trainer.loggers:  # (rank 0 only: Lightning calls save_config there)
            logger.log_hyperparams(settings)


class _NoLitLoggerTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:  # Lightning's advertisements (litlogger, litmodels)
        return not str(record.msg).startswith("💡 Tip")


def run_cli(args: list[str] | None = None) -> RecCLI:
    """Run the CLI and return it (tests read its trainer and model)."""
    # W&B never reaches the network unless the user asks for it (WANDB_MODE=online).
    os.environ.setdefault("WANDB_MODE", "offline")
    # warnings no recipe can act on: Lightning 2.6's use of a pytree API torch 2.13 deprecates,
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    # Lightning's note that the default logger is a CSVLogger without tensorboard,
    warnings.filterwarnings("ignore", message=r"Starting from v1\.9\.0, `tensorboardX` has been removed")
    # two about our loaders that do not apply (they split rows between workers and place predicted rows themselves),
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    warnings.filterwarnings("ignore", message=r"Couldn't infer the batch indices fetched from your dataloader")
    # and that a fit without --data.val_path has no validation batches (the data module's empty list, on purpose),
    warnings.filterwarnings("ignore", message=r"Total length of `list` across ranks is zero")
    # nor, then, the metric the recipe's ModelCheckpoint monitors (missing after a validation: Lightning's error)
    warnings.filterwarnings("ignore", message=r"`ModelCheckpoint\(monitor='(val|test)_.*could not find the monitored")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        rank_zero_log = logging.getLogger(name)
        if not any(isinstance(f, _NoLitLoggerTip) for f in rank_zero_log.filters):
            rank_zero_log.addFilter(_NoLitLoggerTip())
    # jsonargparse resolves a short class name (`--model=DLRMModule`) among the subclasses imported so far
    import lightning_rec.data  # noqa: F401
    import lightning_rec.models  # noqa: F401

    return RecCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=_LoggedConfig,
        save_config_kwargs={"overwrite": True},
        parser_class=RecArgumentParser,
        # the two commands main() runs itself are not LightningCLI's subcommands: --help names them too
        parser_kwargs={"description": "Train, evaluate and predict with a recipe (fit / validate / test / predict "
                                      "--config recipes/configs/<recipe>.yaml); also `lightning-rec preprocess "
                                      "--help` (Criteo days to shards) and `lightning-rec export --help` (a "
                                      "checkpoint to an unsharded model for inference)."},
        args=args,  # None: LightningCLI reads sys.argv itself (passing it too makes Lightning warn)
    )


