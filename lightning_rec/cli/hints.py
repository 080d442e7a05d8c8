"""What the command line's refusals leave out: the option, command, class or file that was meant.

argparse and jsonargparse refuse a misspelt option, a value of the wrong type or a missing file without saying what was
meant or where the value was set; `did_you_mean` adds those lines to the refusal. No top-level Lightning import:
`HintingArgumentParser` (preprocess, export) stays light."""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import os
import re

_ARGV: list[str] = []  # the command line being parsed


def remember_command_line(argv: list[str]) -> None:
    """Keep `argv` for `did_you_mean`: a refusal of a config file names the file it read."""
    global _ARGV
    _ARGV = argv


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


def _config_path(argv: list[str], i: int) -> str | None:
    """The config file that `argv[i]` names (`--config=FILE`, or `--config FILE` / `-c FILE`), else None."""
    arg = argv[i]
    if arg.startswith("--config="):
        return arg.partition("=")[2]
    return argv[i + 1] if arg in ("--config", "-c") and i + 1 < len(argv) else None


def _config_file_that_fails(argv: list[str]) -> str:
    """' in FILE: yaml's own words' for the first --config file of `argv` that is not YAML ('' when all are)."""
    import yaml

    for i in range(len(argv)):
        path = _config_path(argv, i)
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


def _config_keys(value, prefix: str = "") -> set[str]:
    """Every dotted key a config file sets (`trainer.max_epochs`, `model.embedding_dim`: init_args left out)."""
    if not isinstance(value, dict):
        return {prefix} if prefix else set()
    keys = {prefix} if prefix else set()
    for name, inner in value.items():
        name = str(name)
        keys |= _config_keys(inner, prefix if name == "init_args" else f"{prefix}.{name}".lstrip("."))
    return keys


def _where_set(key: str, argv: list[str]) -> str:
    """'in FILE' or 'on the command line (--KEY=...)': the last of `argv` that sets `key` ('' when none does)."""
    import yaml

    found = ""
    for i, arg in enumerate(argv):
        path = _config_path(argv, i)
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


_COMMANDS = "\n  (the commands are fit, validate, test, predict, preprocess and export)"
_RECIPE = "lightning-rec {} --config recipes/configs/dlrm_synthetic.yaml (or another of recipes/configs/)"


def _command_hint(message: str) -> str | None:
    """The command meant, or that a command / a recipe is missing; None when `message` is about neither."""
    command = re.search(r"invalid choice: '([^']*)' \(choose from 'fit'", message)
    if command:  # a misspelt command; main() runs two more than LightningCLI knows
        commands = ["fit", "validate", "test", "predict", "preprocess", "export"]
        meant = difflib.get_close_matches(command[1], commands, n=1)
        return (f"\n  did you mean {meant[0]} instead of {command[1]}?" if meant else "") + _COMMANDS
    if re.search(r'expected "subcommand" to be one of', message):  # `lightning-rec` alone: a command, and a recipe
        return _COMMANDS + ", e.g. " + _RECIPE.format("fit")
    no_recipe = re.search(r"the following arguments are required: (\w+)\.data, \w+\.model", message)
    if no_recipe:  # `lightning-rec fit` without --config
        return (f"\n  a recipe gives both: {_RECIPE.format(no_recipe[1])}; or name them, --model=DLRMModule "
                f"--data=SyntheticCriteoDataModule")
    return None


def _config_file_meant(message: str) -> str | None:
    """The config file meant when the one given does not exist ('' when none is close); None for other refusals."""
    missing = re.search(r'Parser key "config": File does not exist: \'([^\']*)\'', message)
    if not missing:
        return None
    # `--config recipes/configs/dlrm_synthetic`: the suffix left off, or a name misspelt
    folder, name = os.path.split(missing[1])
    there = [f for f in os.listdir(folder) if f.endswith((".yaml", ".yml", ".json"))] if os.path.isdir(folder) \
        else []
    meant = difflib.get_close_matches(name, there, n=1, cutoff=0.7)
    if not meant:
        return ""
    path = os.path.join(folder, meant[0])  # as typed, when under the working directory (jsonargparse's is absolute)
    shown = os.path.relpath(path) if path.startswith(os.path.join(os.getcwd(), "")) else path
    return f"\n  did you mean {shown}?"


def _misspelt_options(parser: argparse.ArgumentParser, message: str) -> list[tuple[str, str]]:
    """(given, meant) for options refused on the command line or as keys of a config file."""
    options = _option_names(parser)
    _, _, unrecognized = message.partition("unrecognized arguments:")
    hints = [(unknown, m) for unknown in re.findall(r"(--[\w.\-]+)", unrecognized)
             for m in difflib.get_close_matches(unknown, options, n=1)]
    keys = {o[2:] for o in options if o.startswith("--")}  # a config file's keys: trainer.max_epochs
    hints += [(unknown, m) for unknown in re.findall(r"does not accept option '([\w.\-]+)'", message)
              for m in difflib.get_close_matches(unknown, keys, n=1)]
    return hints


_CLASS_MODULES = {"trainer.logger": ["lightning.pytorch.loggers"],
                  "trainer.callbacks": ["lightning.pytorch.callbacks", "lightning_rec.predict"],
                  "trainer.strategy": ["lightning.pytorch.strategies", "lightning_rec.strategy"],
                  "optimizer": ["torch.optim"], "lr_scheduler": ["torch.optim.lr_scheduler"]}


def _misspelt_classes(message: str) -> list[tuple[str, str]]:
    """(given, meant) for class names refused: in a dotted class_path, or short (`--model=DLRMModul`)."""
    hints = []
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
        names = {n.lower(): n for module in _CLASS_MODULES[named[1]] for n in _public_names(module) if n[:1].isupper()}
        given = "+=" if named[1] == "trainer.callbacks" else "="  # callbacks are added to the recipe's list
        hints += [(named[2], f"{names[m]} (--{named[1]}{given}{names[m]})")
                  for m in difflib.get_close_matches(named[2].lower(), list(names), n=1)]
    return hints


def _misspelt_choice(message: str) -> list[tuple[str, str]]:
    """(given, meant) for a value outside a Literal (`--trainer.precision=bf16-mix`)."""
    literal = re.search(r"Parser key \"([\w.]+)\":[\s\S]*?Expected a typing\.Literal\[[\s\S]*Given value: (\S+)\n?$",
                        message)
    if not literal:
        return []
    allowed = [v for values in re.findall(r"Literal\[([^\]]*)\]", message)
               for v in re.findall(r"'([^']*)'|(\d+)", values) for v in v if v]
    return [(literal[2], f"{m} (--{literal[1]}={m})")
            for m in difflib.get_close_matches(literal[2], list(dict.fromkeys(allowed)), n=1)]


def _misspelt_init_args(message: str) -> list[tuple[str, str]]:
    """(given, meant) for init arguments a class_path does not accept (`embeding_dim`)."""
    hints = []
    for class_path, unknown in dict.fromkeys(
            re.findall(r"class_path '([\w.]+)':\s*Option '(\w+)' is not accepted", message)):
        hints += [(unknown, f"{m} (an argument of {class_path})")
                  for m in difflib.get_close_matches(unknown, _init_arg_names(class_path), n=1)]
    return hints


def _required_init_args(message: str) -> str:
    """How to give a class's required arguments (--trainer.logger=CSVLogger: its save_dir has no default)."""
    said = ""
    for key, class_path, required in dict.fromkeys(re.findall(
            r"Parser key \"([\w.]+)\":[\s\S]*?class_path '([\w.]+)':\s*the following arguments are required: "
            r"([\w, ]+)", message)):
        for argument in required.split(", "):
            where = " (a folder: the run's is --trainer.default_root_dir)" if argument == "save_dir" else ""
            said += (f"\n  {class_path.rpartition('.')[2]} needs {argument}: add --{key}.{argument}=...{where}, or "
                     f"{argument}: under {key}.init_args in the config file")
    return said


def _strategy_options_hint(message: str) -> str:
    """--trainer.strategy=rec --trainer.strategy.pipeline=true: a registered name takes no options."""
    nested = re.search(r"Parser key \"trainer.strategy\":[\s\S]*dot import path string: (\w+)[\s\S]*"
                       r"NestedArg\(key='(\w+)'", message)
    if not nested:
        return ""
    return (f"\n  a strategy with options is named by its class: --trainer.strategy=RecStrategy "
            f"--trainer.strategy.{nested[2]}=... (the short name '{nested[1]}' takes none)")


def _where_refused_value_is_set(message: str) -> str:
    """For a refused value (`max_epochs: two`), where it was set (jsonargparse names only the key)."""
    keys = re.findall(r'Parser key "([\w.]+)":', message)
    if not keys or not re.search(r"Expected a <class '\w+'>(\. Got value|\n[\s\S]*Given value)", message):
        return ""
    key = ".".join(keys[:2]) if len(keys) > 1 and keys[0] in ("model", "data") else keys[0]
    where = _where_set(key, _ARGV)
    return f"\n  {key} is set {where}" if where.startswith("in ") else ""  # (the command line's is on screen)


def did_you_mean(parser: argparse.ArgumentParser, message: str) -> str:
    """The close spellings of the options `message` refuses, as lines to add to it ('' when none)."""
    if "Problems parsing config" in message:  # yaml's error says "<unicode string>", line 3: not which file
        return _config_file_that_fails(_ARGV)
    for whole in (_command_hint, _config_file_meant):  # refusals that are said in full by one hint
        said = whole(message)
        if said is not None:
            return said
    hints = [*_misspelt_options(parser, message), *_misspelt_classes(message), *_misspelt_choice(message),
             *_misspelt_init_args(message)]
    said = "".join(f"\n  did you mean {meant} instead of {unknown}?" for unknown, meant in hints)
    return said + _required_init_args(message) + _strategy_options_hint(message) + _where_refused_value_is_set(message)


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
    """A class's own refusal of its arguments inside jsonargparse's report of an instantiation ('' when none)."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ValueError) and not str(cause).startswith(_JSONARGPARSE_WORDS):
            return str(cause)
        cause = cause.__cause__ or cause.__context__
    # at any depth (a planner's constraint refuses three Unions down)
    _, listed, rest = str(error).partition("\nErrors:\n")
    entries = re.findall(r"^\s*- (.*)$", rest, re.MULTILINE) if listed else []
    return next((entry for entry in entries if not entry.startswith(_JSONARGPARSE_WORDS)), "")


def _warn_options_a_later_config_sets(argv: list[str]) -> None:
    # jsonargparse applies arguments in order: an option before --config is set again by the file, silently
    import yaml
    from lightning.pytorch.utilities import rank_zero_warn

    options: list[tuple[int, str]] = []
    for i, arg in enumerate(argv):
        config = _config_path(argv, i)
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
    """argparse's parser for `preprocess` and `export`, whose refusal of a misspelt option names the one meant."""

    def error(self, message: str):
        return super().error(message + did_you_mean(self, message))

