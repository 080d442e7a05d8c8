"""The old path of the preprocessed-shard reader, now `lightning_rec.data.criteo.shards`: re-exported here."""

from lightning_rec.data.criteo.shards import *  # noqa: F401, F403
