"""Criteo text -> Arrow tables of raw values, block by block, with one of two parsers that give the same rows,
values, reports and error messages:

    "native"  torch.ops.lightning_rec.parse_criteo (`lightning_rec.data.criteo.native`)
    "python"  the reference here (numpy line bookkeeping, Arrow's CSV reader, a vectorised hex decode), used when
              the extension is not built

Shapes: N rows of a block, F = 26 sparse features, L bytes of a block."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from lightning_rec.data.criteo.blocks import iter_blocks, iter_line_blocks
from lightning_rec.data.criteo.layout import CriteoLayout, detect_layout
from lightning_rec.data.criteo.native import parse_block_native, resolve_parser
from lightning_rec.data.criteo.report import (
    ParseReport,
    cut_reason,
    non_ascii_reason,
    raise_or_record,
    stray_cr_reason,
    too_many_reason,
)
from lightning_rec.data.criteo.schema import NUM_DENSE_FEATURES, NUM_SPARSE_FEATURES, check_on_bad_row
from lightning_rec.data.labels import LabelSpec, label_matrix, label_specs

# Bumped whenever the parser's output changes, so that old cache files are not reused.
_PARSER_VERSION = 2  # 2: rows cut after a separator and non-ASCII bytes are bad rows

# hex digit value of every byte; 255 marks a byte that is not a hex digit
_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
# what Arrow's string -> double cast accepts, minus nan/inf: finds which values broke a cast
_NUMBER_RE = r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$"


def strings_to_float(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Arrow strings (null = empty) -> float64 [N] with NaN for missing, and a bad-value mask [N]."""
    null_N = col.is_null().to_numpy(zero_copy_only=False)
    try:
        values = pc.cast(col, pa.float64())
        bad_N = np.zeros(len(col), dtype=bool)
    except pa.ArrowInvalid:
        ok = pc.fill_null(pc.match_substring_regex(col, _NUMBER_RE), True)
        bad_N = ~ok.to_numpy(zero_copy_only=False)
        values = pc.cast(pc.if_else(ok, col, pa.scalar(None, pa.string())), pa.float64())
    values_N = values.to_numpy(zero_copy_only=False)
    bad_N |= ~np.isfinite(values_N) & ~null_N  # "nan" / "inf" are not counts
    if bad_N.any():
        values_N = np.where(bad_N, np.nan, values_N)
    return values_N, bad_N


def decode_hex(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """8-hex-character strings -> int64 [N] (-1 = missing) and a bad-value mask [N], vectorized.

    Reads the Arrow string buffers directly: offsets give each value's start, the 8 bytes are gathered as an [n, 8]
    array, a 256-entry table turns bytes into nibbles."""
    n = len(col)
    _, offsets_buf, data_buf = col.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32, count=n + 1, offset=col.offset * 4)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    lengths_N = np.diff(offsets)
    valid_N = col.is_valid().to_numpy(zero_copy_only=False)
    present_N = valid_N & (lengths_N > 0)
    out_N = np.full(n, -1, dtype=np.int64)
    bad_N = present_N & (lengths_N != 8)
    rows = np.flatnonzero(present_N & (lengths_N == 8))
    if rows.size:
        if int(offsets[n] - offsets[0]) == 8 * rows.size:
            # every other value is empty, so the 8-character ones lie back to back: no gather (3x faster)
            chars = data[offsets[0]:offsets[n]].reshape(-1, 8)
        else:
            chars = data[offsets[rows, None] + np.arange(8)]  # [n8, 8]
        nibbles = _HEX_LUT[chars]
        not_hex = (nibbles == 255).any(axis=1)
        # two nibbles -> a byte, four bytes -> the big-endian 32-bit value the 8 characters spell
        packed = np.ascontiguousarray((nibbles[:, 0::2] << 4) | nibbles[:, 1::2])
        out_N[rows] = packed.view(">u4").reshape(-1)
        out_N[rows[not_hex]] = -1
        bad_N[rows[not_hex]] = True
    return out_N, bad_N


@dataclass
class _Lines:
    """Where the lines of a block are, one entry per line (the block ends with a newline)."""

    buf_L: np.ndarray
    starts: np.ndarray
    ends: np.ndarray  # the newline of each line
    content_end: np.ndarray  # before a "\r\n" pair, not between its bytes
    sep_pos: np.ndarray
    num_fields: np.ndarray
    blank: np.ndarray
    line_no: np.ndarray

    @staticmethod
    def of(block: bytes, first_line: int, sep: int) -> _Lines:
        buf_L = np.frombuffer(block, dtype=np.uint8)
        ends = np.flatnonzero(buf_L == 10)
        starts = np.empty_like(ends)
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
        has_cr = (ends > starts) & (buf_L[ends - 1] == 13)
        content_end = ends - has_cr
        sep_pos = np.flatnonzero(buf_L == sep)
        num_fields = np.bincount(np.searchsorted(ends, sep_pos), minlength=ends.size) + 1
        return _Lines(buf_L, starts, ends, content_end, sep_pos, num_fields, content_end == starts,
                      first_line + np.arange(ends.size))

    def marked(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The lines holding the byte positions `pos`, the first such byte of each, and its field (0-based)."""
        lines_with, first_idx = np.unique(np.searchsorted(self.ends, pos), return_index=True)
        first = pos[first_idx]
        field_k = np.searchsorted(self.sep_pos, first) - np.searchsorted(self.sep_pos, self.starts[lines_with])
        return lines_with, first, field_k


def _unreadable_rows(lines: _Lines, layout: CriteoLayout, problems: list) -> np.ndarray:
    """Rows Arrow must not see, their reasons added to `problems`: a byte >= 0x80 (Arrow refuses the block as
    invalid UTF-8), or a carriage return inside a line (Arrow ends a row there; the native op keeps it in the field)."""
    buf_L = lines.buf_L
    bad = np.zeros(lines.ends.size, dtype=bool)
    high_pos = np.flatnonzero(buf_L >= 128)
    if high_pos.size:
        rows, pos, field_k = lines.marked(high_pos)
        bad[rows] = True
        problems.append((lines.line_no[rows],
                         lambda i: non_ascii_reason(layout, int(field_k[i]), int(buf_L[pos[i]])), -3))
    cr_pos = np.flatnonzero(buf_L == 13)
    cr_pos = cr_pos[buf_L[np.minimum(cr_pos + 1, buf_L.size - 1)] != 10]
    if cr_pos.size:
        rows, _, cr_field = lines.marked(cr_pos)
        new = ~bad[rows]  # a line with a non-ASCII byte is named by that
        rows, cr_field = rows[new], cr_field[new]
        bad[rows] = True
        problems.append((lines.line_no[rows], lambda i: stray_cr_reason(layout, int(cr_field[i])), -3))
    return bad


def _field_count_faults(lines: _Lines, layout: CriteoLayout, unreadable: np.ndarray,
                        problems: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows with too many fields, rows cut short (fewer fields, ending in a separator: a truncated file), and short
    rows that end in a value (trailing empty fields stripped: padded as missing)."""
    too_many = (lines.num_fields > layout.num_fields) & ~unreadable
    short = (lines.num_fields < layout.num_fields) & ~lines.blank & ~unreadable
    last_byte = lines.buf_L[np.maximum(lines.content_end - 1, 0)]
    cut = short & (last_byte == ord(layout.separator))
    short &= ~cut
    if too_many.any():
        many_lines, many_counts = lines.line_no[too_many], lines.num_fields[too_many]
        problems.append((many_lines, lambda i: too_many_reason(layout, int(many_counts[i])), -2))
    if cut.any():
        cut_lines, cut_counts = lines.line_no[cut], lines.num_fields[cut]
        problems.append((cut_lines, lambda i: cut_reason(layout, int(cut_counts[i])), -1))
    return too_many, cut, short


def _clean_bytes(lines: _Lines, layout: CriteoLayout, keep: np.ndarray, short: np.ndarray) -> np.ndarray:
    """What Arrow reads: the kept rows only, each short one padded with separators to the layout's field count."""
    if not short.any() and keep.all():
        return lines.buf_L
    pad = np.where(short, layout.num_fields - lines.num_fields, 0)
    padded_L = np.insert(lines.buf_L, np.repeat(lines.content_end, pad), ord(layout.separator)) if short.any() \
        else lines.buf_L
    if keep.all():
        return padded_L
    return padded_L[np.repeat(keep, lines.ends - lines.starts + 1 + pad)]


def _read_fields(clean: np.ndarray, layout: CriteoLayout, num_rows: int) -> Callable[[int], pa.Array]:
    """Arrow's CSV reader over rows of exactly `num_fields` fields, every used field as strings: field -> column."""
    names = [f"f{i}" for i in range(layout.num_fields)]
    used = [layout.label_field] if layout.label_field is not None else []
    used += list(layout.label_columns.values())
    used = list(dict.fromkeys(used + layout.dense_fields + layout.sparse_fields))  # a mask may be a feature too
    table = pacsv.read_csv(
        pa.BufferReader(pa.py_buffer(clean)),
        read_options=pacsv.ReadOptions(column_names=names, use_threads=True),
        parse_options=pacsv.ParseOptions(
            delimiter=layout.separator, quote_char=False, double_quote=False, escape_char=False,
            newlines_in_values=False, ignore_empty_lines=False,
        ),
        convert_options=pacsv.ConvertOptions(include_columns=[names[i] for i in used],
                                             column_types={names[i]: pa.string() for i in used}, null_values=[""],
                                             strings_can_be_null=True),
    ).combine_chunks()
    assert table.num_rows == num_rows, (table.num_rows, num_rows)
    return lambda i: table.column(names[i]).chunk(0)


def _convert_rows(clean: np.ndarray, rows_line: np.ndarray, layout: CriteoLayout, problems: list):
    """The kept rows -> label [N] float32 ([N, T] of the tasks of `layout.label_specs`: NaN where missing), dense
    [N, 13] float32 raw, sparse [N, 26] int64 raw, and a mask of the rows that hold a bad value (their reasons added
    to `problems`)."""
    n = int(rows_line.size)
    label_N = np.full((n, len(layout.label_specs)) if layout.label_specs else n, np.nan, dtype=np.float32)
    dense_N13 = np.empty((n, NUM_DENSE_FEATURES), dtype=np.float32)
    sparse_NF = np.empty((n, NUM_SPARSE_FEATURES), dtype=np.int64)
    bad_N = np.zeros(n, dtype=bool)
    if not n:
        return label_N, dense_N13, sparse_NF, bad_N
    column = _read_fields(clean, layout, n)

    def convert(field_k: int, decode, what: str, is_label: bool = False) -> np.ndarray:
        col = column(field_k)
        values, bad = decode(col)
        if is_label:
            bad |= ~np.isin(values, (0.0, 1.0))  # also catches a missing label (NaN)
        if bad.any():
            rows = np.flatnonzero(bad)
            problems.append((rows_line[rows], lambda i: f"{what} {col[int(rows[i])].as_py()!r}", field_k))
            bad_N[rows] = True
        return values

    if layout.label_field is not None:
        label_N[:] = convert(layout.label_field, strings_to_float, "label must be 0 or 1, got", is_label=True)
    if layout.label_specs:  # several labels: any number, empty = missing (NaN), derived by the tasks' rules
        values = {c: convert(f, strings_to_float, f"label column {c!r} must be a number, got")
                  for c, f in layout.label_columns.items()}
        label_N[:] = label_matrix(layout.label_specs, values.__getitem__).numpy()
    for j, f in enumerate(layout.dense_fields):
        dense_N13[:, j] = convert(f, strings_to_float, f"I{j + 1} must be a number, got")
    for j, f in enumerate(layout.sparse_fields):
        sparse_NF[:, j] = convert(f, decode_hex, f"C{j + 1} must be 8 hex characters, got")
    return label_N, dense_N13, sparse_NF, bad_N


def _parse_block(block: bytes, first_line: int, layout: CriteoLayout, path: str, on_bad_row: str,
                 report: ParseReport) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference parser. Whole lines -> (label [N] float32, dense [N, 13] float32 raw, sparse [N, 26] int64 raw),
    every row checked in numpy before Arrow's CSV reader sees it."""
    lines = _Lines.of(block, first_line, ord(layout.separator))
    problems: list[tuple[np.ndarray, object, int]] = []
    unreadable = _unreadable_rows(lines, layout, problems)
    too_many, cut, short = _field_count_faults(lines, layout, unreadable, problems)
    keep = ~lines.blank & ~too_many & ~unreadable & ~cut
    report.num_blank_lines += int(lines.blank.sum())
    rows_line, short_rows = lines.line_no[keep], short[keep]
    label_N, dense_N13, sparse_NF, bad_N = _convert_rows(_clean_bytes(lines, layout, keep, short), rows_line,
                                                         layout, problems)
    raise_or_record(problems, on_bad_row, path, report)
    good = ~bad_N
    report.num_skipped_rows += int(too_many.sum()) + int(unreadable.sum()) + int(cut.sum()) + int(bad_N.sum())
    report.num_padded_rows += int((short_rows & good).sum())
    report.num_rows += int(good.sum())
    if not good.all():
        return label_N[good], dense_N13[good], sparse_NF[good]
    return label_N, dense_N13, sparse_NF


def parse_block(block: bytes, first_line: int, layout: CriteoLayout, path: str, on_bad_row: str, report: ParseReport,
                parser: str = "auto") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Whole lines -> (label [N], dense [N, 13] raw, sparse [N, 26] raw) with `parser` (see the module doc)."""
    if resolve_parser(parser) == "native":
        return parse_block_native(block, first_line, layout, path, on_bad_row, report)
    return _parse_block(block, first_line, layout, path, on_bad_row, report)


@dataclass
class CriteoReadOptions:
    """How a Criteo text file is read (the readers' and data modules' keyword arguments): its layout (None:
    detected), what a bad row does, the bytes parsed at a time, and the parser (resolved)."""

    separator: str | None = None
    has_header: bool | None = None
    has_label: bool | None = None
    on_bad_row: str = "error"
    block_bytes: int = 64 << 20
    parser: str = "auto"
    label_columns: list[str] | dict[str, str] | None = None
    label_masks: dict[str, str] | None = None

    def __post_init__(self) -> None:
        check_on_bad_row(self.on_bad_row)
        self.specs: list[LabelSpec] = []
        if self.label_columns is not None:
            self.specs = label_specs(self.label_columns, self.label_masks)
        self.parser = resolve_parser(self.parser)

    def layout(self, path: str | os.PathLike) -> CriteoLayout:
        return detect_layout(path, self.separator, self.has_header, self.has_label, self.specs)

    @property
    def task_names(self) -> tuple[str, ...] | None:
        """The tasks of the labels' columns (None: one click label)."""
        return tuple(s.task for s in self.specs) if self.specs else None

    def kwargs(self, **changes) -> dict:
        """The options as keyword arguments, with `changes`."""
        return {**asdict(self), **changes}


def read_criteo(path: str | os.PathLike, separator: str | None = None, has_header: bool | None = None,
                has_label: bool | None = None, on_bad_row: str = "error", block_bytes: int = 64 << 20,
                parser: str = "auto", label_columns: list[str] | dict[str, str] | None = None,
                label_masks: dict[str, str] | None = None) -> Iterator[tuple[pa.Table, ParseReport]]:
    """Parse a Criteo file into Arrow tables (label, dense, sparse: raw values), one per block, with one report
    updated as blocks are parsed. `parser`: "auto" (native when built), "native" or "python" (the reference).
    `label_columns` (lightning_rec.data.labels): several labels, the label column [N, T] of the tasks."""
    options = CriteoReadOptions(separator, has_header, has_label, on_bad_row, block_bytes, parser, label_columns,
                                label_masks)
    layout = options.layout(path)
    report = ParseReport(path=str(path), layout=asdict(layout))
    if options.parser == "native":
        lines = [2 if layout.has_header else 1]
        for block, _ in iter_line_blocks(path, block_bytes, skip_header=layout.has_header):
            arrays = parse_block_native(block, lines[0], layout, str(path), on_bad_row, report, lines_out=lines)
            yield to_table(*arrays), report
        return
    for block, first_line in iter_blocks(path, block_bytes, skip_header=layout.has_header):
        arrays = parse_block(block, first_line, layout, str(path), on_bad_row, report, options.parser)
        yield to_table(*arrays), report


def to_table(label_N: np.ndarray, dense_N13: np.ndarray, sparse_NF: np.ndarray) -> pa.Table:
    return pa.table(
        {
            "label": pa.array(label_N, pa.float32()) if label_N.ndim == 1 else  # [N, T]: several tasks
            pa.FixedSizeListArray.from_arrays(pa.array(label_N.reshape(-1), pa.float32()), label_N.shape[1]),
            "dense": pa.FixedSizeListArray.from_arrays(pa.array(dense_N13.reshape(-1)), NUM_DENSE_FEATURES),
            "sparse": pa.FixedSizeListArray.from_arrays(pa.array(sparse_NF.reshape(-1)), NUM_SPARSE_FEATURES),
        }
    )
