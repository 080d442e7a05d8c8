"""Criteo click logs -> whole `Batch`es, from text files, tables or `lightning-rec preprocess` shards (docs/criteo.md:
the layouts read, bad rows, the table ids).

A file is cut into blocks of whole lines (`blocks`), parsed into raw values (`parse`; `native` is the C++ op), kept in a
memory-mapped Arrow cache (`cache`) or streamed, and made into batches (`datasets`), where dense values become log(1 +
max(x, 0)) and hashes become table ids. `preprocess` writes .npy shards, which `shards` reads."""

# ruff: noqa: F401  (the package's names, and the old module's private ones that tests and scripts use)
from lightning_rec.data.criteo.blocks import iter_blocks, iter_blocks_resumable, iter_line_blocks
from lightning_rec.data.criteo.cache import (
    _pid_alive,
    build_criteo_cache,
    default_cache_dir,
)
from lightning_rec.data.criteo.datamodule import CriteoDataModule
from lightning_rec.data.criteo.datasets import CriteoDataset, CriteoIterableDataset, make_criteo_batch
from lightning_rec.data.criteo.layout import (
    CriteoLayout,
    check_criteo_file,
    detect_layout,
    file_compression,
    open_criteo_stream,
)
from lightning_rec.data.criteo.native import (
    HASH_EMPTY_BAG,
    HASH_RAW,
    HASH_RESERVED_ID,
    native_parser_available,
    parse_block_native,
    resolve_parser,
)
from lightning_rec.data.criteo.parse import (
    _PARSER_VERSION,
    CriteoReadOptions,
    parse_block,
    read_criteo,
)
from lightning_rec.data.criteo.preprocess import preprocess_criteo
from lightning_rec.data.criteo.report import ParseReport
from lightning_rec.data.criteo.schema import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    DEFAULT_INT_NAMES,
    DEFAULT_LABEL_NAME,
    DEFAULT_SPARSE_FEATURE_NAMES,
    INT_FEATURE_COUNT,
    MISSING_CATEGORICAL,
    NUM_DENSE_FEATURES,
    NUM_SPARSE_FEATURES,
    check_missing_categorical,
    check_on_bad_row,
    feature_names,
    resolve_num_embeddings,
    table_ids,
)
from lightning_rec.data.criteo.shards import CriteoShardDataset, dist_rank_world, is_shard_dir, load_manifest
from lightning_rec.data.criteo.tables import (
    TABLE_SOURCE_VERSION,
    TableBlocks,
    read_criteo_table,
    source_files,
    table_has_label,
    table_source_kind,
)

_resolve_num_embeddings = resolve_num_embeddings  # the old module's name
