"""`lightning-rec`: the recipe command line (LightningCLI).

    lightning-rec fit --config recipes/configs/dlrm_synthetic.yaml [--trainer.max_steps=200]
    lightning-rec fit --config recipes/configs/dlrm_criteo_kaggle.yaml \
        --data.train_path=train.tsv --data.val_path=valid.tsv
    lightning-rec preprocess --input day_0.gz ... --output_dir shards/train   (lightning_rec/data/criteo/preprocess.py)

Model and data are chosen by class path in the YAML (`model.class_path`, `data.class_path`), so a
recipe can swap either without code. After `fit`, the final validation metrics are printed.

    lightning-rec export CHECKPOINT OUT [--fp16-tables]

writes an unsharded model for inference (OUT/model.safetensors + OUT/config.json) from a sharded
checkpoint directory or an old one-file checkpoint; `lightning_rec.checkpoint.load_exported(OUT)`
rebuilds it on one CPU process (see checkpoint.py).

hints.py repairs the parsers' refusals, recipe.py holds RecCLI (ckpt_path.py: its --ckpt_path), commands.py the
entry point and the two commands it runs itself.
"""

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
