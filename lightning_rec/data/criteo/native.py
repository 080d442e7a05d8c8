"""The native parser: `torch.ops.lightning_rec.parse_criteo` (csrc/criteo_parse_cpu.cpp) on whole lines.

One pass over a block's bytes, multi-threaded over line ranges; ~10x the Python reference (benchmarks/criteo_ingest.py),
with the same rows, values, reports and error messages."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from lightning_rec._native import NATIVE_IMPORT_ERROR, native_parser_available
from lightning_rec.data.criteo.layout import CriteoLayout
from lightning_rec.data.criteo.report import (
    MAX_REPORTED_BAD_ROWS,
    ParseReport,
    cut_reason,
    non_ascii_reason,
    raise_or_record,
    stray_cr_reason,
    too_many_reason,
)
from lightning_rec.data.criteo.schema import NUM_DENSE_FEATURES, NUM_SPARSE_FEATURES
from lightning_rec.data.labels import label_matrix

PARSERS = ("auto", "native", "python")
# Row status codes of the native op (csrc/criteo_parse_cpu.cpp): kind | (field << 8).
_STATUS_OK, _STATUS_PADDED, _STATUS_BLANK = 0, 1, 2
_STATUS_TOO_MANY, _STATUS_LABEL, _STATUS_DENSE, _STATUS_SPARSE, _STATUS_NON_ASCII, _STATUS_CUT = 3, 4, 5, 6, 7, 8
_STATUS_LABEL_COLUMN = 9  # field << 8 is then the column's index in label_columns
# hash_mode of the native op: what the sparse output holds
HASH_RAW, HASH_RESERVED_ID, HASH_EMPTY_BAG = 0, 1, 2

def _fake_parse_criteo(buf, separator, num_fields, label_field, dense_fields, sparse_fields, num_embeddings,
                       hash_mode, log_dense, label_columns=()):
    # One row per line: the count depends on the bytes, so it is a dynamic size.
    n = torch.library.get_ctx().new_dynamic_size()
    return (
        buf.new_empty((n, len(label_columns)), dtype=torch.float64) if label_columns else
        buf.new_empty((n,), dtype=torch.float32),
        buf.new_empty((n, NUM_DENSE_FEATURES), dtype=torch.float32),
        buf.new_empty((n, NUM_SPARSE_FEATURES), dtype=torch.int64),
        buf.new_empty((n,), dtype=torch.int32),
    )


if native_parser_available():
    torch.library.register_fake("lightning_rec::parse_criteo")(_fake_parse_criteo)


def resolve_parser(parser: str) -> str:
    """"auto" -> "native" when the extension is built, else "python"; checks the name."""
    if parser not in PARSERS:
        raise ValueError(f"parser must be one of {PARSERS}, got {parser!r}")
    if parser == "native" and not native_parser_available():
        raise ValueError(f"parser='native' needs the C++ extension, which failed to import ({NATIVE_IMPORT_ERROR}): "
                         f"build it with `pip install --no-build-isolation -e .`, or pass parser='python'")
    if parser == "auto":
        return "native" if native_parser_available() else "python"
    return parser


def _native_args(layout: CriteoLayout) -> tuple:
    return (
        ord(layout.separator), layout.num_fields, -1 if layout.label_field is None else layout.label_field,
        list(layout.dense_fields), list(layout.sparse_fields),
    )


def parse_block_native(block: bytes | np.ndarray, first_line: int, layout: CriteoLayout, path: str, on_bad_row: str,
                       report: ParseReport, hash_mode: int = HASH_RAW, num_embeddings: Sequence[int] = (),
                       log_dense: bool = False,
                       lines_out: list[int] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The native op on whole lines; the same rows, values, report and errors as `_parse_block`.

    With the defaults the output is the reference's (raw values). `hash_mode` / `log_dense` make the op also do what
    `make_criteo_batch` does per batch (table ids, log(1 + max(x, 0))), for preprocessing. `lines_out[0]` is advanced by
    the block's line count (so it holds the next block's first line). With several labels (`layout.label_specs`) the
    label is [N, T], the tasks' labels derived from the op's numbers by the reference's `label_matrix`."""
    if isinstance(block, np.ndarray):
        buf_L = torch.from_numpy(block)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a bytes block is read-only; the op never writes to it
            buf_L = torch.frombuffer(block, dtype=torch.uint8) if len(block) else torch.empty(0, dtype=torch.uint8)
    label_N, dense_N13, sparse_NF, status_N = torch.ops.lightning_rec.parse_criteo(
        buf_L, *_native_args(layout), list(num_embeddings), hash_mode, log_dense, list(layout.label_columns.values())
    )
    status = status_N.numpy()
    if lines_out is not None:
        lines_out[0] += status.shape[0]
    kind = status & 0xFF
    good = kind <= _STATUS_PADDED
    report.num_blank_lines += int((kind == _STATUS_BLANK).sum())
    bad = ~good & (kind != _STATUS_BLANK)
    if bad.any():
        _native_problems(block, first_line, layout, path, on_bad_row, report, status, bad)
        report.num_skipped_rows += int(bad.sum())
    report.num_padded_rows += int((kind == _STATUS_PADDED).sum())
    report.num_rows += int(good.sum())
    label, dense, sparse = label_N.numpy(), dense_N13.numpy(), sparse_NF.numpy()
    if not good.all():
        label, dense, sparse = label[good], dense[good], sparse[good]
    if layout.label_specs:
        column = dict(zip(layout.label_columns, label.T))  # column name -> its numbers [N] float64, NaN: empty
        label = label_matrix(layout.label_specs, column.__getitem__).numpy()
    return label, dense, sparse


def _status_field(layout: CriteoLayout, kind: int, k: int) -> int | None:
    """The field (0-based, in the line) that a label / dense / sparse status names; None for another status."""
    if kind == _STATUS_LABEL:
        return layout.label_field
    if kind == _STATUS_LABEL_COLUMN:
        return list(layout.label_columns.values())[k]
    if kind == _STATUS_DENSE:
        return layout.dense_fields[k]
    return layout.sparse_fields[k] if kind == _STATUS_SPARSE else None


def _native_problems(block, first_line: int, layout: CriteoLayout, path: str, on_bad_row: str, report: ParseReport,
                     status: np.ndarray, bad: np.ndarray) -> None:
    """Reasons for the bad rows the op flagged (error path only: the line's bytes are looked at again)."""
    buf_L = block if isinstance(block, np.ndarray) else np.frombuffer(block, dtype=np.uint8)
    ends = np.flatnonzero(buf_L == 10)
    bad_idx = np.flatnonzero(bad)[:1 if on_bad_row == "error" else MAX_REPORTED_BAD_ROWS]
    lines, reasons = [], []
    for i in bad_idx:  # a few rows at most, on the error path
        start = int(ends[i - 1]) + 1 if i > 0 else 0
        text = bytes(buf_L[start:int(ends[i])])
        if text.endswith(b"\r"):
            text = text[:-1]
        lines.append(first_line + int(i))
        reasons.append(_row_reason(layout, text.split(layout.separator.encode()), int(status[i])))
    raise_or_record([(np.asarray(lines), lambda j: reasons[j], 0)], on_bad_row, path, report)


def _row_reason(layout: CriteoLayout, fields: list[bytes], status: int) -> str:
    """The reference parser's words for a row the op gave `status`."""
    kind, k = status & 0xFF, status >> 8

    def value(field: int) -> str | None:
        v = fields[field].decode("utf-8", "backslashreplace") if field < len(fields) else ""
        return v if v else None

    if kind == _STATUS_NON_ASCII:
        return non_ascii_reason(layout, k, next(b for b in fields[k] if b >= 128))
    if kind == _STATUS_TOO_MANY:
        return too_many_reason(layout, k)
    if kind == _STATUS_CUT:
        return cut_reason(layout, k)
    if (field := _status_field(layout, kind, k)) is not None and field < len(fields) and b"\r" in fields[field]:
        return stray_cr_reason(layout, field)  # a "\r\r\n" line: the reference parser's words for it
    if kind == _STATUS_LABEL:
        return f"label must be 0 or 1, got {value(layout.label_field)!r}"
    if kind == _STATUS_LABEL_COLUMN:
        column = list(layout.label_columns)[k]
        return f"label column {column!r} must be a number, got {value(layout.label_columns[column])!r}"
    if kind == _STATUS_DENSE:
        return f"I{k + 1} must be a number, got {value(layout.dense_fields[k])!r}"
    if kind == _STATUS_SPARSE:
        return f"C{k + 1} must be 8 hex characters, got {value(layout.sparse_fields[k])!r}"
    raise AssertionError(f"unknown parse_criteo status {status}")  # pragma: no cover
