"""The old path of the preprocessed-shard reader, now `lightning_rec.data.criteo.shards`: re-exported here."""

# ruff: noqa: F401
from lightning_rec.data.criteo.shards import (
    ARRAYS,
    MANIFEST,
    SHARD_FORMAT,
    CriteoShardDataset,
    dist_rank_world,
    file_sha256,
    is_shard_dir,
    load_manifest,
    rank_segments,
    shard_files,
    verify_shard,
)
