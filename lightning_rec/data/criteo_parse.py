"""The old path of the Criteo text readers, now in `lightning_rec.data.criteo` (schema, layout, blocks, report,
native, parse): re-exported here."""

# ruff: noqa: F401
from lightning_rec.data.criteo.blocks import iter_blocks, iter_blocks_resumable, iter_line_blocks
from lightning_rec.data.criteo.layout import (
    BOM,
    CriteoLayout,
    check_criteo_file,
    detect_layout,
    file_compression,
    layout_width,
    open_criteo_stream,
)
from lightning_rec.data.criteo.native import (
    HASH_EMPTY_BAG,
    HASH_RAW,
    HASH_RESERVED_ID,
    PARSERS,
    native_parser_available,
    parse_block_native,
    resolve_parser,
)
from lightning_rec.data.criteo.parse import _PARSER_VERSION, _parse_block, parse_block, read_criteo
from lightning_rec.data.criteo.report import ParseReport, field_name, minus_one_label_fix
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
    table_ids,
)
