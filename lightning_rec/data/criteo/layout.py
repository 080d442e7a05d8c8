"""Criteo text files: how their bytes are opened and where the fields of a row sit.

Compression (gzip / bz2 / zstd) is read from the first bytes, not the name; a UTF-8 byte-order mark before the first row
is skipped. `detect_layout` finds the separator, a header and the label column from the first lines."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from lightning_rec.data.criteo.schema import NUM_DENSE_FEATURES, NUM_SPARSE_FEATURES
from lightning_rec.data.labels import LabelSpec, check_label_columns, source_columns

log = logging.getLogger(__name__)


@dataclass
class CriteoLayout:
    """Where label, I1..I13 and C1..C26 sit in a row (field indices), and how rows are split. With `label_specs`
    (several labels: `label_columns`), `label_columns` gives the field of each column the tasks read instead of
    `label_field`."""

    separator: str
    has_header: bool
    has_label: bool
    num_fields: int
    label_field: int | None
    dense_fields: list[int]
    sparse_fields: list[int]
    label_specs: list[LabelSpec] = field(default_factory=list)
    label_columns: dict[str, int] = field(default_factory=dict)


def layout_width(num_labels: int) -> int:
    """Fields in a headerless row: the label fields (0, 1 or more) + I1..I13 + C1..C26."""
    return int(num_labels) + NUM_DENSE_FEATURES + NUM_SPARSE_FEATURES


_MAGIC = ((b"\x1f\x8b", "gzip", ".gz"), (b"BZh", "bz2", ".bz2"), (b"\x28\xb5\x2f\xfd", "zstd", ".zst"))
_warned_compression: set[str] = set()
# a UTF-8 byte-order mark (Excel's "CSV UTF-8"): skipped at the start of the text, as "utf-8-sig" does
BOM = b"\xef\xbb\xbf"
_HEAD_BYTES = 1 << 20  # what layout detection reads
_SEPARATOR_NAMES = {"tab": "\t", "\\t": "\t", "comma": ","}


def check_criteo_file(path: str | os.PathLike, what: str = "Criteo file",
                      fix: str = "check train_path / val_path / test_path") -> None:
    """A clear ValueError for a path that is missing or a directory (naming the fix)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        raise ValueError(
            f"{what} {p} is a directory, not a file: pass one file (e.g. {os.path.join(p, 'train.txt')}); "
            f"to use a directory of day files, convert it once with `lightning-rec preprocess --input "
            f"{os.path.join(p, 'day_*')} --output_dir <dir>` and pass that output directory (a folder of .parquet "
            f"files, or one that datasets' save_to_disk wrote, is read as it is)"
        )
    if not os.path.isfile(p):
        raise ValueError(f"{what} {p} does not exist: {fix}")


def file_compression(path: str | os.PathLike) -> str | None:
    """gzip / bz2 / zstd from the file's first bytes (not its name; a misnamed one is warned about), or None."""
    with open(path, "rb") as f:
        magic = f.read(4)
    for prefix, name, suffix in _MAGIC:
        if magic.startswith(prefix):
            if not str(path).endswith(suffix) and str(path) not in _warned_compression:
                _warned_compression.add(str(path))
                log.warning("%s is %s-compressed although its name does not end in %s: reading it through %s "
                            "(rename it to %s%s to make this explicit)", path, name, suffix, name, path, suffix,)
            return name
    return None


def open_criteo_stream(path: str | os.PathLike):
    """A byte stream of the file's text, decompressed when its first bytes say so."""
    return pa.input_stream(str(path), compression=file_compression(path))


def unreadable(path, e: OSError) -> ValueError:
    """Arrow's decompressor says 'Truncated compressed stream' without naming the file."""
    return ValueError(f"{path}: cannot read it ({e}): a compressed file cut short (an interrupted download or "
                      f"copy?), or not the format its first bytes say: fetch or compress it again")


def _read_head(path: str | os.PathLike, num_bytes: int = _HEAD_BYTES) -> bytes:
    check_criteo_file(path)
    with open_criteo_stream(path) as stream:
        try:
            head = stream.read(num_bytes)
        except OSError as e:
            raise unreadable(path, e) from e
    return head[len(BOM):] if head.startswith(BOM) else head


def detect_layout(path: str | os.PathLike, separator: str | None = None, has_header: bool | None = None,
                  has_label: bool | None = None, label_specs: Sequence[LabelSpec] = ()) -> CriteoLayout:
    """Find separator, header and label column from the file's first lines (None = detect). `label_specs`: the tasks
    of several label columns, found by name in a header; a headerless file's leading fields are the columns they read,
    in order (lightning_rec.data.labels.source_columns: ["click", "purchase"] -> fields 1 and 2)."""
    head = _read_head(path)
    lines, numbers = _head_lines(path, head)
    first = lines[0].decode("utf-8", errors="replace")
    _refuse_quoted(path, first, lines[1].decode("utf-8", errors="replace") if len(lines) > 1 else "")
    separator = _separator(separator, first)
    names = [f.strip().lower() for f in first.split(separator)]
    if has_header is None:
        has_header = bool({"label", "i1", "c1", "id"} & set(names))
    if label_specs:
        return _task_layout(path, head, first, lines, numbers, separator, has_header, list(label_specs))
    if has_header:
        return _header_layout(path, head, names, separator, has_label)
    return _headerless_layout(path, lines, numbers, separator, has_label)


def _head_lines(path, head: bytes) -> tuple[list[bytes], list[int]]:
    """The non-blank whole lines of the file's head (no "\\r") and their 1-based line numbers."""
    if not head.strip():
        raise ValueError(f"{path} is empty: expected Criteo rows (label, I1..I13, C1..C26)")
    lines = head.split(b"\n")
    if len(lines) > 1:
        lines = lines[:-1]  # the last piece may be cut in the middle
    numbers = [i + 1 for i, ln in enumerate(lines) if ln.strip()]
    lines = [ln.rstrip(b"\r") for ln in lines if ln.strip()]
    if b"\0" in head:
        nul_line = head[: head.index(b"\0")].count(b"\n") + 1
        raise ValueError(
            f"{path}:{nul_line} holds NUL bytes: it is not a Criteo text file (a binary or a compressed format this "
            f"reader does not detect; gzip, bz2 and zstd are read as they are): decompress or convert it to text first"
        )
    return lines, numbers


def _refuse_quoted(path, first: str, second: str) -> None:
    quoted = [ln for ln in (first, second)
              if ln.startswith('"') and ('","' in ln or '"\t"' in ln)]  # the header, or the rows only
    if quoted:
        raise ValueError(
            f"{path}: its fields are quoted (line {quoted[0][:40]!r}...): Criteo rows are read without quote "
            f"handling, so every value would be refused. Remove the quotes first, e.g. "
            f"`sed 's/\"//g' {path} > {path}.unquoted` (Criteo values never hold quotes, commas or tabs)"
        )


def _separator(separator: str | None, first: str) -> str:
    # the words `lightning-rec preprocess --separator` takes, and a backslash-t typed on a command line or in YAML
    separator = _SEPARATOR_NAMES.get(separator, separator) if isinstance(separator, str) else separator
    if separator is None:
        separator = "\t" if "\t" in first else ","
    if separator not in ("\t", ","):
        raise ValueError(f"separator must be '\\t' or ',' (or the words 'tab' / 'comma', or None to detect), got "
                         f"{separator!r}")
    return separator


def _task_layout(path, head: bytes, first: str, lines: list[bytes], numbers: list[int], separator: str,
                 has_header: bool, specs: list[LabelSpec]) -> CriteoLayout:
    """The layout of a file with several label columns: named in its header, or its leading fields."""
    if has_header:
        header = [f.strip() for f in first.split(separator)]
        check_label_columns(specs, header, f"{path} (its header)")
        layout = _header_layout(path, head, [h.lower() for h in header], separator, False)
        columns = {c: header.index(c) for c in source_columns(specs)}
    else:
        columns = {c: k for k, c in enumerate(source_columns(specs))}
        width = layout_width(len(columns))
        counts = [ln.count(separator.encode()) + 1 for ln in lines]
        if width not in counts:
            raise ValueError(f"{path}:{numbers[0]}: rows have {max(counts)} fields, not {width} (the {len(columns)} "
                             f"label columns {list(columns)} that label_columns reads, then I1..I13 and C1..C26): a "
                             f"header-less file's leading fields are its label columns, in that order; check the "
                             f"separator (got {separator!r}) and label_columns")
        layout = _headerless_layout(path, lines, numbers, separator, False)
        layout = CriteoLayout(separator, False, False, width, None, [k + len(columns) for k in layout.dense_fields],
                              [k + len(columns) for k in layout.sparse_fields])
    layout.has_label, layout.label_specs, layout.label_columns = True, specs, columns
    return layout


def _header_layout(path, head: bytes, names: list[str], separator: str, has_label: bool | None) -> CriteoLayout:
    index = {name: i for i, name in enumerate(names)}
    missing = [f"I{i}" for i in range(1, 14) if f"i{i}" not in index]
    missing += [f"C{i}" for i in range(1, 27) if f"c{i}" not in index]
    if missing:
        raise ValueError(f"{path}: the header lacks columns {missing}: a Criteo header names label (optional), "
                         f"I1..I13 and C1..C26; pass has_header=False if the first line is data")
    after = head.lstrip().split(b"\n", 1)[1:]  # what follows the header line
    if not (after and after[0].strip()) and len(head) < _HEAD_BYTES - len(BOM):  # the whole file: no row
        raise ValueError(f"{path} has no data rows (a header only): expected Criteo rows (label, I1..I13, "
                         f"C1..C26)")
    label_field = index.get("label")
    if has_label is True and label_field is None:
        raise ValueError(f"{path}: has_label=True but the header has no 'label' column")
    if has_label is False:
        label_field = None
    return CriteoLayout(separator=separator, has_header=True, has_label=label_field is not None, num_fields=len(names),
                        label_field=label_field, dense_fields=[index[f"i{i}"] for i in range(1, 14)],
                        sparse_fields=[index[f"c{i}"] for i in range(1, 27)])


def _headerless_layout(path, lines: list[bytes], numbers: list[int], separator: str,
                       has_label: bool | None) -> CriteoLayout:
    if has_label is None:
        counts = [ln.count(separator.encode()) + 1 for ln in lines]
        n40, n39 = counts.count(40), counts.count(39)
        if n40 == 0 and n39 == 0:
            raise ValueError(
                f"{path}:{numbers[0]}: rows have {max(counts)} fields, not 40 (label + I1..I13 + C1..C26) or 39 (no "
                f"label): check the separator (got {separator!r}) or pass has_label=True/False"
            )
        # The majority decides: a stripped row of a labelled file can have 39 fields too.
        has_label = n40 >= n39
    offset = 1 if has_label else 0
    return CriteoLayout(separator=separator, has_header=False, has_label=has_label, num_fields=layout_width(offset),
                        label_field=0 if has_label else None,
                        dense_fields=list(range(offset, offset + NUM_DENSE_FEATURES)),
                        sparse_fields=list(range(offset + NUM_DENSE_FEATURES, layout_width(offset))))
