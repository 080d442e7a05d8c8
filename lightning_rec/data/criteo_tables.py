"""The old path of the Criteo table readers, now `lightning_rec.data.criteo.tables`: re-exported here."""

# ruff: noqa: F401
from lightning_rec.data.criteo.tables import (
    TABLE_SOURCE_VERSION,
    TableBlocks,
    glob_files,
    read_criteo_table,
    source_files,
    table_has_label,
    table_layout,
    table_source_kind,
)
