"""`lightning-rec`: the recipe command line (LightningCLI): fit / validate / test / predict --config <recipe>,
preprocess (Criteo text to shards) and export (an unsharded model for inference). docs/criteo.md, docs/predict.md.

hints.py repairs the parsers' refusals, recipe.py holds RecCLI (ckpt_path.py: its --ckpt_path; run_summary.py: what a
fit leaves and says at its end), commands.py the entry point and the two commands it runs itself."""
from lightning_rec.cli.commands import export_main, main, preprocess_main
from lightning_rec.cli.hints import (  # noqa: F401  (the names lightning_rec/cli.py had)
    _JSONARGPARSE_WORDS,
    HintingArgumentParser,
    _config_file_that_fails,
    _config_keys,
    _init_arg_names,
    _option_names,
    _public_names,
    _raised_in_lightning,
    _warn_options_a_later_config_sets,
    _where_set,
    constructor_refusal,
    did_you_mean,
    strategy_hint,
)
from lightning_rec.cli.recipe import (  # noqa: F401
    RecArgumentParser,
    RecCLI,
    _LoggedConfig,
    _NoLitLoggerTip,
    _strategy_class,
    run_cli,
)

__all__ = ["HintingArgumentParser", "RecArgumentParser", "RecCLI", "constructor_refusal", "did_you_mean",
           "export_main", "main", "preprocess_main", "run_cli", "strategy_hint"]
