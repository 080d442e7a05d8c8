"""The old path of `lightning_rec.data.criteo.preprocess` (the `lightning-rec preprocess` command line is in
lightning_rec.cli.commands)."""

from lightning_rec.data.criteo.preprocess import *  # noqa: F401,F403
from lightning_rec.data.criteo.preprocess import preprocess_criteo  # noqa: F401
