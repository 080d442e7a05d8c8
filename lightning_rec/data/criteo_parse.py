"""The old path of the Criteo text readers, now in `lightning_rec.data.criteo` (schema, layout, blocks, report,
native, parse): re-exported here."""

# ruff: noqa: F401, F403
from lightning_rec.data.criteo.blocks import *
from lightning_rec.data.criteo.layout import *
from lightning_rec.data.criteo.native import *
from lightning_rec.data.criteo.parse import *
from lightning_rec.data.criteo.parse import _PARSER_VERSION, _parse_block
from lightning_rec.data.criteo.report import *
from lightning_rec.data.criteo.schema import *
