"""The old path of the Criteo table readers, now `lightning_rec.data.criteo.tables`: re-exported here."""

from lightning_rec.data.criteo.tables import *  # noqa: F401, F403
