"""What `--ckpt_path` means to the recipe commands: the checkpoint's hyperparameters, `last`, sharded directories.

`CheckpointPathCLI` is LightningCLI with the library's reading of --ckpt_path; `RecCLI` (recipe.py) builds on it."""

from __future__ import annotations

import importlib
import os
import re
import sys
import warnings

from lightning.pytorch.cli import LightningCLI


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class CheckpointPathCLI(LightningCLI):
    """LightningCLI whose --ckpt_path also reads sharded directories and `last`, and says what it replaced."""

    def _parse_ckpt_path(self) -> None:
        # the checkpoint's hyperparameters win (its weights fit only its shapes): say which --model options lost
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return super()._parse_ckpt_path()

        def init_args() -> dict:
            model = self.config[subcommand].get("model")
            return dict(vars(model.get("init_args") or {})) if model is not None else {}

        def class_path() -> str | None:
            return (self.config[subcommand].get("model") or {}).get("class_path")

        from lightning_rec.checkpoint import LIGHTNING_FILE, UNREADABLE, check_readable

        before, recipes_class = init_args(), class_path()
        ckpt_path = self.config[subcommand].get("ckpt_path")
        if ckpt_path == "last":  # the checkpoint Lightning will load: its hyperparameters were not read at all
            ckpt_path = self._last_checkpoint(subcommand) or ckpt_path
        if ckpt_path and os.path.isfile(os.path.join(str(ckpt_path), LIGHTNING_FILE)):
            self._strategy_for_sharded_checkpoint(subcommand, str(ckpt_path))
            self._parse_dcp_ckpt_hparams(subcommand, str(ckpt_path))
        else:
            given_path = self.config[subcommand].get("ckpt_path")
            self.config[subcommand].ckpt_path = ckpt_path  # Lightning's reads the config's (a file's hyperparameters)
            try:
                super()._parse_ckpt_path()
            except UNREADABLE:
                check_readable(ckpt_path)  # a file cut short, named
                raise
            finally:
                self.config[subcommand].ckpt_path = given_path
        self._refuse_another_model_class(subcommand, ckpt_path, recipes_class, class_path())
        self._warn_unused_model_options(subcommand, before, init_args())

    def _refuse_another_model_class(self, subcommand: str, ckpt_path, recipes: str | None, its: str | None) -> None:
        """The checkpoint's class replaced the recipe's model (Lightning's rule): refused when neither is the other's
        subclass, before anything is built (the recipe's data is another model's)."""
        if not recipes or not its or recipes == its:
            return
        try:
            recipe_class, its_class = _class(recipes), _class(its)
        except (ImportError, AttributeError, ValueError):
            return  # (the parser says what does not import)
        if issubclass(its_class, recipe_class) or issubclass(recipe_class, its_class):
            return
        data = (self.config[subcommand].get("data") or {}).get("class_path")
        on = f" on {data.rsplit('.', 1)[-1]}" if data else ""
        raise SystemExit(f"lightning-rec {subcommand}: error: --ckpt_path {ckpt_path} holds a {its_class.__name__} "
                         f"({its}), but the recipe builds a {recipe_class.__name__}{on}: give the recipe (--config) "
                         f"that trained the checkpoint, or a checkpoint of a {recipe_class.__name__} fit")

    def _warn_unused_model_options(self, subcommand: str, before: dict, after: dict) -> None:
        """Name the --model.* options that the checkpoint's hyperparameters replaced."""
        given = dict.fromkeys(m[1] for a in getattr(self, "_argv", [])
                              for m in [re.match(r"--model\.(?:init_args\.)?(\w+)", str(a))] if m)
        unused = [k for k in given if k in before and k in after and before[k] != after[k]]
        if unused:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(
                f"lightning-rec {subcommand}: {', '.join(f'--model.{k}={before[k]!r}' for k in unused)} "
                f"{'is' if len(unused) == 1 else 'are'} not used: "
                f"--ckpt_path rebuilds the model with the checkpoint's own hyperparameters "
                f"({', '.join(f'{k}={after[k]!r}' for k in unused)}); start without --ckpt_path to train another "
                f"configuration", category=UserWarning)

    def _checkpoint_dirpaths(self, subcommand: str) -> list[str]:
        """The dirpath of every ModelCheckpoint the config adds; [] unless each one names it."""
        callbacks = (self.config[subcommand].get("trainer") or {}).get("callbacks") or []
        dirpaths = []
        for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
            name = str(getattr(callback, "class_path", ""))
            dirpath = (getattr(callback, "init_args", None) or {}).get("dirpath")
            if name.endswith("OnExceptionCheckpoint") or name.endswith("ModelCheckpoint") and not dirpath:
                return []
            if name.endswith("ModelCheckpoint"):
                dirpaths.append(str(dirpath))
        return dirpaths

    def _last_checkpoint(self, subcommand: str) -> str | None:
        """What `--ckpt_path=last` loads (the newest last*.ckpt in a ModelCheckpoint's dirpath), or None."""
        found: dict[str, float] = {}
        for dirpath in self._checkpoint_dirpaths(subcommand):
            if os.path.isdir(dirpath):
                for name in os.listdir(dirpath):
                    if name.endswith(".ckpt") and re.match(r"last(-\d+)?", name):
                        path = os.path.join(dirpath, name)
                        found[path] = os.path.getmtime(path)
        return max(found, key=found.__getitem__) if found else None

    def _strategy_for_sharded_checkpoint(self, subcommand: str, ckpt_path: str) -> None:
        # a sharded checkpoint says what loads it: strategy "auto" means rec here (a named one is kept)
        trainer = self.config[subcommand].get("trainer")
        if trainer is not None and trainer.get("strategy") in (None, "auto"):
            from lightning.pytorch.utilities import rank_zero_info

            trainer.strategy = "rec"
            rank_zero_info(f"lightning-rec {subcommand}: {ckpt_path} is a sharded checkpoint: loading it with "
                           f"--trainer.strategy=rec (its default settings; --trainer.strategy=RecStrategy "
                           f"--trainer.strategy.OPTION=... sets others)")

    def _parse_dcp_ckpt_hparams(self, subcommand: str, ckpt_path: str) -> None:
        # Lightning's _parse_ckpt_path reads only a file: the same steps (lightning 2.6) on a directory's Lightning dict
        from pathlib import Path

        from lightning_rec.checkpoint import lightning_meta

        try:
            hparams = dict(lightning_meta(Path(ckpt_path)).get("hyper_parameters") or {})
        except ValueError:  # a damaged lightning.pt: said when the checkpoint is loaded, with what to do
            return
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise

    def _check_ckpt_path(self, subcommand: str, ckpt_path) -> None:
        """Refuse, in one line before any rank starts, a --ckpt_path that this command cannot load."""
        if ckpt_path is None and subcommand != "fit":
            self._warn_untrained(subcommand)
        if ckpt_path == "best":
            self._refuse_best(subcommand)
        if ckpt_path == "last":
            self._check_last(subcommand)
        local = ckpt_path not in (None, "last", "best", "hpc", "registry") and "://" not in str(ckpt_path)
        if local and not os.path.exists(str(ckpt_path)):  # one line now, not after the model is built on every rank
            raise SystemExit(f"lightning-rec {subcommand}: error: --ckpt_path {ckpt_path} does not exist: check the "
                             f"path (a fit writes its checkpoints where ModelCheckpoint's dirpath says)")
        if local and os.path.isdir(str(ckpt_path)):
            self._check_sharded_strategy(subcommand, str(ckpt_path))

    def _warn_untrained(self, subcommand: str) -> None:
        # each command builds the model anew: without a checkpoint it is untrained
        from lightning.pytorch.utilities import rank_zero_warn

        does = "predicts" if subcommand == "predict" else "evaluates"
        rank_zero_warn(f"lightning-rec {subcommand} without --ckpt_path {does} with the model as the recipe builds "
                       f"it, untrained: pass --ckpt_path=CHECKPOINT, or --ckpt_path=last (a recipe's fit saves "
                       f"its best and last checkpoints in <default_root_dir>/checkpoints and prints their paths)",
                       category=UserWarning)

    def _refuse_best(self, subcommand: str) -> None:
        # Lightning's "not configured to save the best model" did not name the cause
        saved = sorted(os.path.join(d, n) for d in self._checkpoint_dirpaths(subcommand) if os.path.isdir(d)
                       for n in os.listdir(d) if n.endswith(".ckpt"))
        raise SystemExit(f"lightning-rec {subcommand}: error: --ckpt_path=best is the best checkpoint of a fit run "
                         f"by the same Trainer, and each lightning-rec command starts a new one: give the "
                         f"checkpoint's path, --ckpt_path=CHECKPOINT" +
                         (f" ({', '.join(saved[:4])}{', ...' if len(saved) > 4 else ''})" if saved else "") +
                         ", or --ckpt_path=last")

    def _check_last(self, subcommand: str) -> None:
        """--ckpt_path=last with no last checkpoint yet: refused to evaluate, a fresh start for a fit (said once)."""
        dirpaths = self._checkpoint_dirpaths(subcommand)
        if not dirpaths or self._last_checkpoint(subcommand) is not None:
            return
        where = " or ".join(dirpaths)
        if subcommand != "fit":  # Lightning warned, then evaluated the model as built, untrained
            raise SystemExit(f"lightning-rec {subcommand}: error: --ckpt_path=last found no last checkpoint "
                             f"(last*.ckpt) in {where}: give the fit's checkpoint, --ckpt_path=CHECKPOINT")
        # a first run of a resumable command: Lightning's hint asks for what the command sets
        warnings.filterwarnings("ignore", message=r'\.fit\(ckpt_path="last"\) is set, but there is no last')
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(f"--ckpt_path=last: no last checkpoint in {where} yet; this fit starts from the beginning")

    def _check_sharded_strategy(self, subcommand: str, ckpt_path: str) -> None:
        # Lightning's own strategies torch.load() a file; the library's modules read a directory whole to evaluate
        from lightning_rec.checkpoint import LIGHTNING_FILE
        from lightning_rec.models.module_hooks import RecModuleHooks
        from lightning_rec.strategy import RecStrategy

        strategy = self.trainer.strategy
        if not os.path.isfile(os.path.join(ckpt_path, LIGHTNING_FILE)) or isinstance(strategy, RecStrategy) \
                or subcommand != "fit" and isinstance(self.model, RecModuleHooks):
            return
        given = self._get(self.config, "trainer", {}).get("strategy")
        given = given if isinstance(given, str) else getattr(given, "class_path", type(strategy).__name__)
        raise SystemExit(
            f"lightning-rec {subcommand}: error: {ckpt_path} is a sharded checkpoint (a directory written by "
            f"strategy=rec), which --trainer.strategy={given} cannot "
            f"{'resume from' if subcommand == 'fit' else 'load'}: drop --trainer.strategy (a sharded "
            f"checkpoint picks strategy=rec itself) or pass --trainer.strategy=rec (any number of devices)" +
            ("" if subcommand == "fit" else
             f", or write a one-file model with `lightning-rec export {ckpt_path} OUT`"))
