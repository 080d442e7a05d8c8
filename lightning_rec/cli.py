"""`lightning-rec`: the recipe command line (LightningCLI).

    lightning-rec fit --config recipes/configs/dlrm_synthetic.yaml [--trainer.max_steps=200]
    lightning-rec fit --config recipes/configs/dlrm_criteo_kaggle.yaml \
        --data.train_path=train.tsv --data.val_path=valid.tsv
    lightning-rec preprocess --input day_0.gz ... --output_dir shards/train   (lightning_rec/data/preprocess.py)

Model and data are chosen by class path in the YAML (`model.class_path`, `data.class_path`), so a
recipe can swap either without code. After `fit`, the final validation metrics are printed.

    lightning-rec export CHECKPOINT OUT [--fp16-tables]

writes an unsharded model for inference (OUT/model.safetensors + OUT/config.json) from a sharded
checkpoint directory or an old one-file checkpoint; `lightning_rec.checkpoint.load_exported(OUT)`
rebuilds it on one CPU process (see checkpoint.py).
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import importlib.util
import inspect
import logging
import os
import re
import sys
import warnings

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

import lightning_rec.strategy  # noqa: F401  (registers --trainer.strategy=rec)


def _option_names(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its subcommands' parsers (`--trainer.max_epochs`, ...)."""
    names = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action.choices, dict):  # a subcommands action: name -> parser
            for sub in action.choices.values():
                if isinstance(sub, argparse.ArgumentParser):
                    names |= _option_names(sub)
    return names


def _init_arg_names(class_path: str) -> list[str]:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        return [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    except (ImportError, AttributeError, TypeError, ValueError):
        return []


def _public_names(module: str) -> list[str]:
    try:
        found = importlib.import_module(module)
    except ImportError:
        return []
    return [n for n in getattr(found, "__all__", dir(found)) if not n.startswith("_")]


def strategy_hint(message: str) -> str:
    """Lightning's refusal of a misspelt strategy name (`--trainer.strategy=recc`), with the name meant."""
    wrong = re.search(r"invalid strategy name: `strategy='([^']*)'`", message)
    if wrong is None:
        return ""
    from lightning.pytorch.strategies import StrategyRegistry

    meant = difflib.get_close_matches(wrong[1], StrategyRegistry.available_strategies(), n=1)
    return (f"lightning-rec: error: --trainer.strategy={wrong[1]} is not a strategy name"
            + (f": did you mean {meant[0]}?" if meant else "")
            + " (rec: sharded tables, lightning_rec's; auto, ddp, fsdp, ...: Lightning's)")


_ARGV: list[str] = []  # the command line being parsed


def _config_file_that_fails(argv: list[str]) -> str:
    """' in FILE: yaml's own words' for the first --config file of `argv` that is not YAML ('' when all are)."""
    import yaml

    for i, arg in enumerate(argv):
        path = arg.partition("=")[2] if arg.startswith("--config=") else \
            argv[i + 1] if arg in ("--config", "-c") and i + 1 < len(argv) else None
        if path is None or not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                yaml.safe_load(f)
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            line = f" line {where.line + 1}, column {where.column + 1}:" if where is not None else ""
            return f"\n  in {path},{line} {getattr(e, 'problem', None) or e}"
        except OSError:
            continue
    return ""


def _where_set(key: str, argv: list[str]) -> str:
    """'in FILE' or 'on the command line (--KEY=...)': the last of `argv` that sets `key` ('' when none does)."""
    import yaml

    found = ""
    for i, arg in enumerate(argv):
        path = arg.partition("=")[2] if arg.startswith("--config=") else \
            argv[i + 1] if arg in ("--config", "-c") and i + 1 < len(argv) else None
        if path is not None:
            try:
                with open(path) as f:
                    if key in _config_keys(yaml.safe_load(f)):
                        found = f"in {path}"
            except (OSError, yaml.YAMLError):
                pass
        elif re.match("--" + re.escape(key).replace(r"\.", r"\.(?:init_args\.)?") + r"(?:[=+]|$)", arg):
            found = f"on the command line ({arg})"
    return found


def did_you_mean(parser: argparse.ArgumentParser, message: str) -> str:
    """The close spellings of the options `message` refuses, as lines to add to it ('' when none).

    jsonargparse refuses a misspelt option in three ways: on the command line ("unrecognized arguments:
    --trainer.max_epocs=1"), as a key of the config file ("does not accept option 'trainer.max_epocs'") and
    as an init argument of a class_path ("Problem with given class_path 'X': Option 'embeding_dim' is not
    accepted"); none says what was meant.
    """
    if "Problems parsing config" in message:  # yaml's error says "<unicode string>", line 3: not which file
        return _config_file_that_fails(_ARGV)
    keys = re.findall(r'Parser key "([\w.]+)":', message)
    located = ""
    if keys and re.search(r"Expected a <class '\w+'>(\. Got value|\n[\s\S]*Given value)", message):
        # a value refused (`max_epochs: two`): jsonargparse names the key, not where it was set (the recipe, a file
        # of one's own, the command line)
        key = ".".join(keys[:2]) if len(keys) > 1 and keys[0] in ("model", "data") else keys[0]
        where = _where_set(key, _ARGV)
        located = f"\n  {key} is set {where}" if where.startswith("in ") else ""  # (the command line's is on screen)
    command = re.search(r"invalid choice: '([^']*)' \(choose from 'fit'", message)
    if command:  # a misspelt command; main() runs two more than LightningCLI knows
        commands = ["fit", "validate", "test", "predict", "preprocess", "export"]
        meant = difflib.get_close_matches(command[1], commands, n=1)
        return (f"\n  did you mean {meant[0]} instead of {command[1]}?" if meant else "") + \
            "\n  (the commands are fit, validate, test, predict, preprocess and export)"
    recipe = "lightning-rec {} --config recipes/configs/dlrm_synthetic.yaml (or another of recipes/configs/)"
    if re.search(r'expected "subcommand" to be one of', message):  # `lightning-rec` alone: a command, and a recipe
        return "\n  (the commands are fit, validate, test, predict, preprocess and export), e.g. " + \
            recipe.format("fit")
    no_recipe = re.search(r"the following arguments are required: (\w+)\.data, \w+\.model", message)
    if no_recipe:  # `lightning-rec fit` without --config
        return (f"\n  a recipe gives both: {recipe.format(no_recipe[1])}; or name them, --model=DLRMModule "
                f"--data=SyntheticCriteoDataModule")
    missing = re.search(r'Parser key "config": File does not exist: \'([^\']*)\'', message)
    if missing:  # `--config recipes/configs/dlrm_synthetic`: the suffix left off, or a name misspelt
        folder, name = os.path.split(missing[1])
        there = [f for f in os.listdir(folder) if f.endswith((".yaml", ".yml", ".json"))] if os.path.isdir(folder) \
            else []
        meant = difflib.get_close_matches(name, there, n=1, cutoff=0.7)
        if not meant:
            return ""
        path = os.path.join(folder, meant[0])  # as typed, when under the working directory (jsonargparse's is absolute)
        shown = os.path.relpath(path) if path.startswith(os.path.join(os.getcwd(), "")) else path
        return f"\n  did you mean {shown}?"
    options = _option_names(parser)
    _, _, unrecognized = message.partition("unrecognized arguments:")
    hints = [(unknown, m) for unknown in re.findall(r"(--[\w.\-]+)", unrecognized)
             for m in difflib.get_close_matches(unknown, options, n=1)]
    keys = {o[2:] for o in options if o.startswith("--")}  # a config file's keys: trainer.max_epochs
    hints += [(unknown, m) for unknown in re.findall(r"does not accept option '([\w.\-]+)'", message)
              for m in difflib.get_close_matches(unknown, keys, n=1)]
    for module, unknown in dict.fromkeys(re.findall(r"class_path '[\w.]+':\s*module '([\w.]+)' has no attribute "
                                                    r"'(\w+)'", message)):  # --model.class_path=...DLRMModul
        hints += [(unknown, f"{module}.{m}") for m in difflib.get_close_matches(unknown, _public_names(module), n=1)]
    short = re.search(r"Parser key \"(model|data)\":[\s\S]*?Expected a dot import path string: (\w+)\n", message)
    if short:  # --model=DLRMModul: a short class name, resolved among the package's modules or data modules
        package = {"model": "lightning_rec.models", "data": "lightning_rec.data"}[short[1]]
        names = [n for n in _public_names(package) if n.endswith("Module")]
        hints += [(short[2], m) for m in difflib.get_close_matches(short[2], names, n=1)]
    named = re.search(r"Parser key \"(trainer\.logger|trainer\.callbacks|trainer\.strategy|optimizer|lr_scheduler)\":"
                      r"[\s\S]*?Expected a dot import path string: (\w+)\n", message)
    if named:  # --trainer.logger=wandb / CSVLoger: a class name misspelt (or in another case) got no guess
        modules = {"trainer.logger": ["lightning.pytorch.loggers"],
                   "trainer.callbacks": ["lightning.pytorch.callbacks", "lightning_rec.predict"],
                   "trainer.strategy": ["lightning.pytorch.strategies", "lightning_rec.strategy"],
                   "optimizer": ["torch.optim"], "lr_scheduler": ["torch.optim.lr_scheduler"]}[named[1]]
        names = {n.lower(): n for module in modules for n in _public_names(module) if n[:1].isupper()}
        given = "+=" if named[1] == "trainer.callbacks" else "="  # callbacks are added to the recipe's list
        hints += [(named[2], f"{names[m]} (--{named[1]}{given}{names[m]})")
                  for m in difflib.get_close_matches(named[2].lower(), list(names), n=1)]
    literal = re.search(r"Parser key \"([\w.]+)\":[\s\S]*?Expected a typing\.Literal\[[\s\S]*Given value: (\S+)\n?$",
                        message)
    if literal:  # --trainer.precision=bf16-mix: the report lists every allowed value, and names none as meant
        allowed = [v for values in re.findall(r"Literal\[([^\]]*)\]", message)
                   for v in re.findall(r"'([^']*)'|(\d+)", values) for v in v if v]
        hints += [(literal[2], f"{m} (--{literal[1]}={m})")
                  for m in difflib.get_close_matches(literal[2], list(dict.fromkeys(allowed)), n=1)]
    for class_path, unknown in dict.fromkeys(
            re.findall(r"class_path '([\w.]+)':\s*Option '(\w+)' is not accepted", message)):
        hints += [(unknown, f"{m} (an argument of {class_path})")
                  for m in difflib.get_close_matches(unknown, _init_arg_names(class_path), n=1)]
    said = "".join(f"\n  did you mean {meant} instead of {unknown}?" for unknown, meant in hints)
    for key, class_path, required in dict.fromkeys(re.findall(
            r"Parser key \"([\w.]+)\":[\s\S]*?class_path '([\w.]+)':\s*the following arguments are required: "
            r"([\w, ]+)", message)):  # --trainer.logger=CSVLogger: its save_dir has no default (W&B's has)
        for argument in required.split(", "):
            where = " (a folder: the run's is --trainer.default_root_dir)" if argument == "save_dir" else ""
            said += (f"\n  {class_path.rpartition('.')[2]} needs {argument}: add --{key}.{argument}=...{where}, or "
                     f"{argument}: under {key}.init_args in the config file")
    nested = re.search(r"Parser key \"trainer.strategy\":[\s\S]*dot import path string: (\w+)[\s\S]*"
                       r"NestedArg\(key='(\w+)'", message)
    if nested:  # --trainer.strategy=rec --trainer.strategy.pipeline=true: a registered name takes no options
        said += (f"\n  a strategy with options is named by its class: --trainer.strategy=RecStrategy "
                 f"--trainer.strategy.{nested[2]}=... (the short name '{nested[1]}' takes none)")
    return said + located


def _strategy_class(strategy) -> type | None:
    """The Strategy class that --trainer.strategy names: a registered name (`rec`, `ddp`), a class (`RecStrategy`,
    `lightning.pytorch.strategies.DDPStrategy`, as a string or a class_path); None for anything else."""
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


def _raised_in_lightning(error: BaseException) -> bool:
    """Whether `error` was raised by Lightning's own code (its innermost frame is in the lightning package)."""
    import lightning

    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    root = os.path.dirname(lightning.__file__)
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(root + os.sep)


_JSONARGPARSE_WORDS = ("Does not validate against any of the Union subtypes", "Expected a ",
                       "Problem with given class_path")


def constructor_refusal(error: ValueError) -> str:
    """A class's own refusal of its arguments inside jsonargparse's report of an instantiation ('' when none).

    A model's or data module's ValueError is in the report's exception chain; a strategy's is not: its Union (a name
    or a Strategy) chains "Expected a <class 'str'>", which alone was shown for `--trainer.strategy.dense=ddpp`, and
    the strategy's own sentence is an entry of the report's Errors list.
    """
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ValueError) and not str(cause).startswith(_JSONARGPARSE_WORDS):
            return str(cause)
        cause = cause.__cause__ or cause.__context__
    # at any depth: a planner's constraint (`--trainer.strategy.planner.constraints='{t_C1: {sharding_types:
    # [row_wize]}}'`) refuses three Unions down (strategy, planner, constraints), and its sentence was left inside
    # jsonargparse's 20-line report
    _, listed, rest = str(error).partition("\nErrors:\n")
    entries = re.findall(r"^\s*- (.*)$", rest, re.MULTILINE) if listed else []
    return next((entry for entry in entries if not entry.startswith(_JSONARGPARSE_WORDS)), "")


def _config_keys(value, prefix: str = "") -> set[str]:
    """Every dotted key a config file sets (`trainer.max_epochs`, `model.embedding_dim`: init_args left out)."""
    if not isinstance(value, dict):
        return {prefix} if prefix else set()
    keys = {prefix} if prefix else set()
    for name, inner in value.items():
        name = str(name)
        keys |= _config_keys(inner, prefix if name == "init_args" else f"{prefix}.{name}".lstrip("."))
    return keys


def _warn_options_a_later_config_sets(argv: list[str]) -> None:
    # jsonargparse applies arguments in order: `fit --trainer.max_epochs=1 --config recipe.yaml` trained the recipe's
    # 2 epochs, without a word (the option was read, then the file set it again)
    import yaml
    from lightning.pytorch.utilities import rank_zero_warn

    options: list[tuple[int, str]] = []
    for i, arg in enumerate(argv):
        config = arg.partition("=")[2] if arg.startswith("--config=") else \
            argv[i + 1] if arg in ("--config", "-c") and i + 1 < len(argv) else None
        if config is None:
            match = re.match(r"--((?:model|data|trainer|optimizer|lr_scheduler)\.[\w.]+|seed_everything)(?:[=+]|$)",
                             arg)
            if match:
                options.append((i, match[1]))
            continue
        try:
            with open(config) as f:
                keys = _config_keys(yaml.safe_load(f))
        except (OSError, yaml.YAMLError):  # jsonargparse says what is wrong with the file
            continue
        for _, key in options:
            short = key.replace(".init_args.", ".")
            if short in keys:
                rank_zero_warn(f"--{key} comes before --config {config}, which sets {short} again: arguments apply "
                               f"in order, so the file's value is used. Put --{key} after --config",
                               category=UserWarning)
        options = []


class HintingArgumentParser(argparse.ArgumentParser):
    """argparse's parser for `preprocess` and `export`, whose refusal of a misspelt option names the one meant
    (`--num_embedings` was "unrecognized arguments" alone)."""

    def error(self, message: str):
        return super().error(message + did_you_mean(self, message))


class RecArgumentParser(LightningArgumentParser):
    """Lightning's parser, whose refusal of a misspelt option also names the option that was meant."""

    def error(self, message: str, ex: Exception | None = None):
        return super().error(message + did_you_mean(self, message), ex)

    def print_usage(self, file=None) -> None:
        # argparse prints the usage before an error: for `fit` that is 50 lines of every option, which push
        # the one line that matters off the screen; the tip after it names --help for the whole list
        usage = self.format_usage()
        if usage.count("\n") > 3:
            usage = f"usage: {self.prog} [options]\n"
        self._print_message(usage, file or sys.stderr)


class RecCLI(LightningCLI):
    def _check_accelerator(self, config) -> None:
        # Lightning's "No supported gpu backend found!" names neither what is missing nor the fix; and
        # LightningCLI builds the model before the Trainer, so a GPU recipe on a CPU machine first tried to
        # allocate its GPU-sized tables in host memory and reported that instead of the missing GPU
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
            # `--trainer.strategy=RecStrategy` (the class, as with options: --trainer.strategy.pipeline=true) stays a
            # string without options, and Lightning refused it: "recstrategy is not a strategy name"
            cls = _strategy_class(strategy)
            if cls is not None:
                kwargs["strategy"] = cls()
        if strategy in (None, "auto") and "strategy" not in kwargs and self.subcommand == "fit":
            kwargs.update(self._rec_for_fused_tables_on_ranks())
        try:
            return super().instantiate_trainer(**kwargs)
        except MisconfigurationException as e:
            self._check_accelerator(self.config_init)
            # Lightning's refusal of a Trainer option (`--trainer.devices=0`, `--trainer.max_epochs=-5`) names the
            # option: it came after a 40-line traceback
            raise SystemExit(f"lightning-rec: error: {self._trainer_options_named(e)}{e}") from None
        except TypeError as e:
            # `--trainer.devices=two` / `=-3`: "`devices` selected with `CPUAccelerator` should be an int > 0", raised
            # as a TypeError by Lightning's device parsing (a TypeError from elsewhere is a bug: its traceback stays)
            if not _raised_in_lightning(e):
                raise
            raise SystemExit(f"lightning-rec: error: {self._trainer_options_named(e)}{e}") from None
        except ValueError as e:  # Lightning's refusal of a misspelt strategy name: a 40-line traceback, no guess
            said = strategy_hint(str(e))
            if said:
                raise SystemExit(said) from None
            raise

    def _rec_for_fused_tables_on_ranks(self) -> dict:
        # `fit --config dlrm_synthetic.yaml --trainer.devices=2` (the recipe leaves the strategy to auto): Lightning
        # picks DDP, under which fused tables cannot train (each rank would update its own copy), and each rank
        # refused it with "use --trainer.strategy=rec". What auto can mean for such a model at 2+ ranks is rec
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
        global _ARGV
        _ARGV = self._argv  # a refusal of a config file names the file (did_you_mean)
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        # Lightning rebuilds the model from the checkpoint's hyperparameters, replacing what the command line
        # said: `validate --ckpt_path=X --model.embedding_dim=8` ran the checkpoint's 16 without a word. The
        # checkpoint must win (its weights only fit its own shapes); the user is told which options were not used
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return super()._parse_ckpt_path()
        def init_args() -> dict:
            model = self.config[subcommand].get("model")
            return dict(vars(model.get("init_args") or {})) if model is not None else {}

        from lightning_rec.checkpoint import LIGHTNING_FILE

        before = init_args()
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
            finally:
                self.config[subcommand].ckpt_path = given_path
        after = init_args()
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
        """The dirpath of every ModelCheckpoint the config adds (`--trainer.callbacks.dirpath=DIR`); [] unless each
        one names it (one without saves under the logger's folder, which Lightning finds itself, as it does the
        on-exception checkpoint)."""
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
        """What `--ckpt_path=last` loads (Lightning's rule: the newest last*.ckpt in a ModelCheckpoint's dirpath), found
        from the config before the Trainer exists; None when no callback names a dirpath or none is there yet."""
        found: dict[str, float] = {}
        for dirpath in self._checkpoint_dirpaths(subcommand):
            if os.path.isdir(dirpath):
                for name in os.listdir(dirpath):
                    if name.endswith(".ckpt") and re.match(r"last(-\d+)?", name):
                        path = os.path.join(dirpath, name)
                        found[path] = os.path.getmtime(path)
        return max(found, key=found.__getitem__) if found else None

    def _strategy_for_sharded_checkpoint(self, subcommand: str, ckpt_path: str) -> None:
        # A sharded checkpoint (a directory) resumes only under strategy=rec, and evaluates under another strategy
        # only in the library's modules (read whole: one rank's memory). `validate --config two_tower_movielens.yaml
        # --ckpt_path=DIR` (the recipe says strategy: auto) was refused until --trainer.strategy=rec was added: the
        # checkpoint says what loads it, so "auto" means rec here. The plan is made for this run (the checkpoint
        # reshards to any number of devices), so the defaults load it. A strategy the user names is kept
        # (_run_subcommand refuses it where it cannot load the checkpoint).
        trainer = self.config[subcommand].get("trainer")
        if trainer is not None and trainer.get("strategy") in (None, "auto"):
            from lightning.pytorch.utilities import rank_zero_info

            trainer.strategy = "rec"
            rank_zero_info(f"lightning-rec {subcommand}: {ckpt_path} is a sharded checkpoint: loading it with "
                           f"--trainer.strategy=rec (its default settings; --trainer.strategy=RecStrategy "
                           f"--trainer.strategy.OPTION=... sets others)")

    def _parse_dcp_ckpt_hparams(self, subcommand: str, ckpt_path: str) -> None:
        # Lightning's _parse_ckpt_path reads only a file (`Path.is_file()`): a strategy=rec checkpoint is a
        # directory, whose hyperparameters were not read at all, so the model was built from the command line
        # (a fit with --model.embedding_dim=8, predicted with the recipe's 16, failed on the shapes). The same
        # steps as Lightning's (lightning 2.6), on the directory's Lightning dict.
        from pathlib import Path

        from lightning_rec.checkpoint import _lightning_meta

        try:
            hparams = dict(_lightning_meta(Path(ckpt_path)).get("hyper_parameters") or {})
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

    def _instantiate_trainer(self, config: dict, callbacks: list):
        # Every recipe says enable_checkpointing: false (no checkpoints unless asked); asking is adding a
        # ModelCheckpoint (`--trainer.callbacks+=ModelCheckpoint`, as the README shows), which Lightning then
        # refused with a MisconfigurationException traceback. The callback the user added is the ask.
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
            # the writer has every row; Lightning would also keep every batch's output in memory to return them,
            # and the CLI drops what predict returns (--return_predictions=true still asks for it)
            arguments["return_predictions"] = False

    def after_predict(self) -> None:
        from lightning_rec.predict import PredictionWriter

        for writer in self.trainer.callbacks:
            if isinstance(writer, PredictionWriter) and writer.written_path is not None and self.trainer.is_global_zero:
                print(f"predictions: {writer.num_rows} rows written to {writer.written_path}", flush=True)

    def _logs_under_root_dir(self, config) -> None:
        # A W&B logger with no save_dir of its own writes where the run writes (--trainer.default_root_dir), as
        # Lightning's default logger does; WandbLogger's own default is the working directory
        trainer = self._get(config, "trainer", {})
        loggers = trainer.get("logger")
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            init = getattr(logger, "init_args", None) if str(getattr(logger, "class_path", "")).endswith(
                "WandbLogger") else None
            if init is not None and init.get("save_dir") in (None, ".") and not init.get("dir") and \
                    trainer.get("default_root_dir"):
                init.save_dir = trainer.get("default_root_dir")

    def _check_wandb_installed(self, config) -> None:
        # Lightning says "Requirement 'wandb>=0.12.10' not met. HINT: Try running `pip install -U ...`": the two
        # MovieLens recipes log to W&B, and the way to run them without it was not said
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
            # A model's or data module's own ValueError (our way of naming a bad argument and its fix) comes
            # wrapped in jsonargparse's Union report, after two tracebacks: 70 lines for one sentence
            said = constructor_refusal(e)
            if said:
                raise SystemExit(f"lightning-rec: error: {said}") from None
            raise

    def _add_configure_optimizers_method_to_model(self, subcommand: str | None) -> None:
        # LightningCLI's --optimizer / --lr_scheduler. Lightning's own handling swaps configure_optimizers for an
        # optimizer over model.parameters(): for the library's modules that left the fused tables out of it (the
        # scheduler never moved their rate, their optimizer state left the checkpoint) and dropped
        # --model.dense_optimizer and warmup_steps without a word; and --lr_scheduler without --optimizer did nothing.
        # Here --optimizer is the dense layers' optimizer (in place of --model.dense_optimizer / dense_lr /
        # dense_weight_decay) and --lr_scheduler drives the optimizer the module returns: fused tables and dense layers
        from types import MethodType

        from lightning.pytorch.cli import instantiate_class

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
        configure = model.configure_optimizers
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
                # the combined optimizer's refusal (lightning_rec.optim) names the Python argument; here the flag:
                # the fused tables' betas are fixed when they are built, and the combined optimizer has no one momentum
                raise ValueError(f"--lr_scheduler={name} cycles the momentum by default, but the optimizer that "
                                 f"{type(module).__name__} returns ({type(optimizer).__name__}: fused tables + dense "
                                 f"layers) has no one momentum to cycle (the fused tables' hyper-parameters are fixed "
                                 f"when they are built; only their lr follows a scheduler): add "
                                 f"--lr_scheduler.cycle_momentum=false") from None
            return LightningCLI.configure_optimizers(module, optimizer, scheduler)

        model.configure_optimizers = MethodType(configure_optimizers, model)

    def _run_subcommand(self, subcommand: str) -> None:
        ckpt_path = self._prepare_subcommand_kwargs(subcommand).get("ckpt_path")
        if ckpt_path is None and subcommand != "fit":
            # each command builds the model anew: without a checkpoint, predict wrote a file of an untrained model's
            # probabilities (validate / test: its metrics) without a word
            from lightning.pytorch.utilities import rank_zero_warn

            does = "predicts" if subcommand == "predict" else "evaluates"
            rank_zero_warn(f"lightning-rec {subcommand} without --ckpt_path {does} with the model as the recipe builds "
                           f"it, untrained: pass --ckpt_path=CHECKPOINT (a fit "
                           f"saves them with --trainer.callbacks+=ModelCheckpoint --trainer.callbacks.dirpath=DIR)",
                           category=UserWarning)
        if ckpt_path == "best":  # Lightning's "not configured to save the best model" did not name the cause
            saved = sorted(os.path.join(d, n) for d in self._checkpoint_dirpaths(subcommand) if os.path.isdir(d)
                           for n in os.listdir(d) if n.endswith(".ckpt"))
            raise SystemExit(f"lightning-rec {subcommand}: error: --ckpt_path=best is the best checkpoint of a fit run "
                             f"by the same Trainer, and each lightning-rec command starts a new one: give the "
                             f"checkpoint's path, --ckpt_path=CHECKPOINT" +
                             (f" ({', '.join(saved[:4])}{', ...' if len(saved) > 4 else ''})" if saved else "") +
                             ", or --ckpt_path=last")
        dirpaths = self._checkpoint_dirpaths(subcommand) if ckpt_path == "last" else []
        if dirpaths and self._last_checkpoint(subcommand) is None:
            where = " or ".join(dirpaths)
            if subcommand != "fit":  # Lightning warned, then evaluated the model as built, untrained
                raise SystemExit(f"lightning-rec {subcommand}: error: --ckpt_path=last found no last checkpoint "
                                 f"(last*.ckpt) in {where}: give the fit's checkpoint, --ckpt_path=CHECKPOINT")
            # a first run of the README's resumable command: Lightning's "HINT: Set ModelCheckpoint(...,
            # save_last=True)" asked for what the command sets
            warnings.filterwarnings("ignore", message=r'\.fit\(ckpt_path="last"\) is set, but there is no last')
            from lightning.pytorch.utilities import rank_zero_info

            rank_zero_info(f"--ckpt_path=last: no last checkpoint in {where} yet; this fit starts from the beginning")
        local = ckpt_path not in (None, "last", "best", "hpc", "registry") and "://" not in str(ckpt_path)
        if local and not os.path.exists(str(ckpt_path)):  # one line now, not after the model is built on every rank
            raise SystemExit(f"lightning-rec {subcommand}: error: --ckpt_path {ckpt_path} does not exist: check the "
                             f"path (a fit writes its checkpoints where ModelCheckpoint's dirpath says)")
        if local and os.path.isdir(str(ckpt_path)):
            from lightning_rec.checkpoint import LIGHTNING_FILE
            from lightning_rec.models.module_hooks import RecModuleHooks
            from lightning_rec.strategy import RecStrategy

            strategy = self.trainer.strategy
            # Lightning's own strategies torch.load() it ("IsADirectoryError: [Errno 21] Is a directory"); the
            # library's modules read it whole under them to evaluate (not to resume: no fused optimizer state)
            if os.path.isfile(os.path.join(str(ckpt_path), LIGHTNING_FILE)) and not isinstance(strategy, RecStrategy) \
                    and (subcommand == "fit" or not isinstance(self.model, RecModuleHooks)):
                given = self._get(self.config, "trainer", {}).get("strategy")
                given = given if isinstance(given, str) else getattr(given, "class_path", type(strategy).__name__)
                raise SystemExit(
                    f"lightning-rec {subcommand}: error: {ckpt_path} is a sharded checkpoint (a directory written by "
                    f"strategy=rec), which --trainer.strategy={given} cannot "
                    f"{'resume from' if subcommand == 'fit' else 'load'}: drop --trainer.strategy (a sharded "
                    f"checkpoint picks strategy=rec itself) or pass --trainer.strategy=rec (any number of devices)" +
                    ("" if subcommand == "fit" else
                     f", or write a one-file model with `lightning-rec export {ckpt_path} OUT`"))
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
        # the last validation's metrics; recipes that also rank the test split in fit (eval_test_in_fit)
        # log test_* there too
        trainer = self.trainer
        validated = False
        for prefix, what in (("val_", "validation"), ("test_", "test")):
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix)}
            validated |= bool(metrics) and prefix == "val_"
            if metrics and trainer.is_global_zero:
                shown = "  ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()))
                print(f"final {what}: {shown}", flush=True)
        # a recipe that validates every 16 epochs, run for 3: the sanity check read validation batches, so there is
        # data to validate on, yet the run ended without a metric and without a word
        if not validated and trainer.is_global_zero and trainer.global_step > 0 and self._has_validation_data():
            every = trainer.check_val_every_n_epoch
            why = (f"it runs every {every} epochs here and this fit ran {trainer.current_epoch}" if every and
                   every > trainer.current_epoch else f"none of its points was reached in {trainer.global_step} steps")
            print(f"final validation: none ran ({why}): set --trainer.check_val_every_n_epoch (or "
                  f"--trainer.val_check_interval), or run `lightning-rec validate` with the fit's checkpoint",
                  flush=True)
        self._say_if_no_checkpoint_was_saved()

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
        # A ModelCheckpoint without a monitor saves after validation when validation is not every epoch: a fit
        # shorter than the recipe's check_val_every_n_epoch (1 epoch of a 40-epoch recipe, say) saved nothing, and
        # Lightning does not say so
        from lightning.pytorch.callbacks import ModelCheckpoint

        trainer = self.trainer
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and trainer.global_step > 0 and not callback.best_model_path \
                    and not callback.last_model_path and trainer.is_global_zero:
                every = trainer.check_val_every_n_epoch
                why = (f"it saves after validation, which runs every {every} epochs here and did not run in "
                       f"{trainer.current_epoch} epoch(s)" if every and every > trainer.current_epoch
                       else "none of its save points was reached")
                # --trainer.callbacks.X sets the last callback of the command line's list: Lightning's own
                # ModelCheckpoint (enable_checkpointing, none given) is not in it, and jsonargparse refused the advice
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
        # Lightning gives the loggers the module's and the data module's hyperparameters only: a W&B run (uploaded
        # without the config.yaml written beside it) could not say its seed, epochs, devices, strategy or precision
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
    # Lightning 2.6 asks torch 2.13's pytree an isinstance() that torch now deprecates: a FutureWarning in every
    # run (each rank) that no recipe can act on; Lightning's to change
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    # lines of Lightning's in every run that no recipe can act on: its advertisements (litlogger, litmodels), and
    # that the default logger is a CSVLogger when tensorboard is absent (the recipes say where their logs go)
    warnings.filterwarnings("ignore", message=r"Starting from v1\.9\.0, `tensorboardX` has been removed")
    # and two about our loaders that do not apply: streams and shard sets split rows between workers themselves
    # (their len() is exact), and predictions find each row's place without the loader's sample indices
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    warnings.filterwarnings("ignore", message=r"Couldn't infer the batch indices fetched from your dataloader")
    # and that a fit without --data.val_path has no validation batches: the data module's empty list says so on
    # purpose (an empty val file is a DataLoader of length zero, and Lightning still names it)
    warnings.filterwarnings("ignore", message=r"Total length of `list` across ranks is zero")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        rank_zero_log = logging.getLogger(name)
        if not any(isinstance(f, _NoLitLoggerTip) for f in rank_zero_log.filters):
            rank_zero_log.addFilter(_NoLitLoggerTip())
    # jsonargparse resolves a short class name (`--model=DLRMModule`, `--data=SyntheticCriteoDataModule`, as
    # LightningCLI's docs write them) among the subclasses imported so far: without these imports it refused the
    # library's own ("DLRMModule either not accessible or invalid"), and its hint named the same name
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


def export_main(argv: list[str]) -> int:
    """`lightning-rec export CHECKPOINT OUT [--fp16-tables]`."""
    from lightning_rec.checkpoint import export

    parser = HintingArgumentParser(prog="lightning-rec export",
                                   description="Write an unsharded model for inference: OUT/model.safetensors + "
                                               "OUT/config.json (load with lightning_rec.checkpoint.load_exported)")
    parser.add_argument("checkpoint", help="a checkpoint directory (sharded) or file (gathered), e.g. "
                                           "lightning_logs/version_0/checkpoints/last.ckpt")
    parser.add_argument("out", help="the directory to write")
    parser.add_argument("--fp16-tables", action="store_true", help="store embedding tables in float16 (half size)")
    # --fp16_tables (preprocess's options are underscored) is the same option; as a second spelling of it, argparse
    # refused the prefix `--fp16` as "ambiguous option: --fp16 could match --fp16-tables, --fp16_tables"
    args = parser.parse_args([re.sub(r"^--fp16_", "--fp16-", a) for a in argv])
    try:
        out = export(args.checkpoint, args.out, fp16_tables=args.fp16_tables)
    except ValueError as e:
        parser.exit(2, f"lightning-rec export: error: {e}\n")
    print(f"exported {args.checkpoint} -> {out}/model.safetensors, {out}/config.json", flush=True)
    return 0


def main() -> None:
    """Console entry point `lightning-rec`."""
    if sys.argv[1:2] == ["preprocess"]:  # not a Trainer subcommand: its own arguments
        from lightning_rec.data.preprocess import preprocess_main

        preprocess_main(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "export":
        sys.exit(export_main(sys.argv[2:]))
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command in ("fit", "validate", "test", "predict"):
        try:
            run_cli()
        except ValueError as e:  # a user error (a malformed row of a data file, an existing output file): its message
            # (predict said it in one line; fit on a file with a bad row gave a 45-line traceback ending in it)
            sys.exit(f"lightning-rec {command}: error: {e}")
    else:
        run_cli()
    from lightning_rec.strategy import close_process_groups

    close_process_groups()  # after a run that ended well (an error above leaves the groups alone)


if __name__ == "__main__":
    main()
