"""Criteo click-log files -> Arrow record batches of raw values: layout detection and the parsers.

Shapes: N rows (of a file or a parsed block), F = 26 sparse features, L bytes of a block.
See `lightning_rec.data.criteo` for the layouts read, the cache and how bad rows are handled;
this module is the part that reads bytes, whole blocks at a time, with one of two parsers that
give the same rows, values, reports and error messages:

    "native"  torch.ops.lightning_rec.parse_criteo (csrc/criteo_parse_cpu.cpp): one pass over the
              block's bytes, multi-threaded over line ranges; ~10x the reference (benchmarks/criteo_ingest.py)
    "python"  the reference: numpy line bookkeeping + Arrow's CSV reader + a vectorised hex decode,
              never a Python loop per row; used when the extension is not built, and in the tests
              as the parity reference for the native op
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import torch

log = logging.getLogger(__name__)

NUM_DENSE_FEATURES = 13
NUM_SPARSE_FEATURES = 26
DEFAULT_SPARSE_FEATURE_NAMES = [f"C{i}" for i in range(1, NUM_SPARSE_FEATURES + 1)]
# TorchRec's torchrec.datasets.criteo names, with the values our loaders use: the KJT keys of every Criteo
# and synthetic data module (TorchRec's loaders say cat_0..cat_25; tables built from these names read our
# batches, and a data module's sparse_feature_names=... gives other keys).
CAT_FEATURE_COUNT, INT_FEATURE_COUNT = NUM_SPARSE_FEATURES, NUM_DENSE_FEATURES
DEFAULT_CAT_NAMES = DEFAULT_SPARSE_FEATURE_NAMES
DEFAULT_INT_NAMES = [f"I{i}" for i in range(1, NUM_DENSE_FEATURES + 1)]
DEFAULT_LABEL_NAME = "label"
MISSING_CATEGORICAL = ("reserved_id", "empty_bag")
# Bumped whenever the parser's output changes, so that old cache files are not reused.
_PARSER_VERSION = 2  # 2: rows cut after a separator and non-ASCII bytes are bad rows
_MAX_REPORTED_BAD_ROWS = 20
PARSERS = ("auto", "native", "python")

# Row status codes of the native op (csrc/criteo_parse_cpu.cpp): kind | (field << 8).
_STATUS_OK, _STATUS_PADDED, _STATUS_BLANK = 0, 1, 2
_STATUS_TOO_MANY, _STATUS_LABEL, _STATUS_DENSE, _STATUS_SPARSE, _STATUS_NON_ASCII, _STATUS_CUT = 3, 4, 5, 6, 7, 8
# hash_mode of the native op: what the sparse output holds
HASH_RAW, HASH_RESERVED_ID, HASH_EMPTY_BAG = 0, 1, 2

try:
    import lightning_rec._C  # noqa: F401  (registers torch.ops.lightning_rec.*)

    _NATIVE_IMPORT_ERROR: Exception | None = None
except ImportError as e:  # not built: `pip install --no-build-isolation -e .` (make test does it)
    _NATIVE_IMPORT_ERROR = e


def native_parser_available() -> bool:
    """True when the C++ extension is built and `torch.ops.lightning_rec.parse_criteo` exists."""
    return _NATIVE_IMPORT_ERROR is None and hasattr(torch.ops.lightning_rec, "parse_criteo")


def _fake_parse_criteo(buf, separator, num_fields, label_field, dense_fields, sparse_fields, num_embeddings,
                       hash_mode, log_dense):
    # One row per line: the count depends on the bytes, so it is a dynamic size.
    n = torch.library.get_ctx().new_dynamic_size()
    return (
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
        raise ValueError(
            f"parser='native' needs the C++ extension, which failed to import ({_NATIVE_IMPORT_ERROR}): "
            f"build it with `pip install --no-build-isolation -e .`, or pass parser='python'"
        )
    if parser == "auto":
        return "native" if native_parser_available() else "python"
    return parser

# hex digit value of every byte; 255 marks a byte that is not a hex digit
_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
# What Arrow's string -> double cast accepts, minus nan/inf (checked separately); used only to
# find which values broke a cast, so that the error names a line.
_NUMBER_RE = r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$"


def _cache_features():
    from datasets import Features, List, Value

    return Features(
        {
            "label": Value("float32"),
            "dense": List(Value("float32"), length=NUM_DENSE_FEATURES),
            "sparse": List(Value("int64"), length=NUM_SPARSE_FEATURES),
        }
    )


# ----------------------------------------------------------------------------------------------
# layout


@dataclass
class CriteoLayout:
    """Where label, I1..I13 and C1..C26 sit in a row (field indices), and how rows are split."""

    separator: str
    has_header: bool
    has_label: bool
    num_fields: int
    label_field: int | None
    dense_fields: list[int]
    sparse_fields: list[int]


def layout_width(has_label: bool) -> int:
    """Fields in a headerless row: label (if any) + I1..I13 + C1..C26."""
    return int(has_label) + NUM_DENSE_FEATURES + NUM_SPARSE_FEATURES


_MAGIC = ((b"\x1f\x8b", "gzip", ".gz"), (b"BZh", "bz2", ".bz2"), (b"\x28\xb5\x2f\xfd", "zstd", ".zst"))
_warned_compression: set[str] = set()


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
    """gzip / bz2 / zstd from the file's first bytes (not its name), or None for plain text.

    A compressed file named like text (`day_0.tsv` holding gzip) is read through the decompressor,
    with a warning naming the rename that silences it.
    """
    with open(path, "rb") as f:
        magic = f.read(4)
    for prefix, name, suffix in _MAGIC:
        if magic.startswith(prefix):
            if not str(path).endswith(suffix) and str(path) not in _warned_compression:
                _warned_compression.add(str(path))
                log.warning(
                    "%s is %s-compressed although its name does not end in %s: reading it through %s "
                    "(rename it to %s%s to make this explicit)", path, name, suffix, name, path, suffix,
                )
            return name
    return None


def open_criteo_stream(path: str | os.PathLike):
    """A byte stream of the file's text, decompressed when its first bytes say so."""
    return pa.input_stream(str(path), compression=file_compression(path))


# A UTF-8 byte-order mark, which editors on Windows (and Excel's "CSV UTF-8") put before the first row: the
# readers skip it at the start of the text, as Python's "utf-8-sig" does (it is no field's byte).
BOM = b"\xef\xbb\xbf"


_HEAD_BYTES = 1 << 20  # what layout detection reads


def _read_head(path: str | os.PathLike, num_bytes: int = _HEAD_BYTES) -> bytes:
    check_criteo_file(path)
    with open_criteo_stream(path) as stream:
        try:
            head = stream.read(num_bytes)
        except OSError as e:
            raise _unreadable(path, e) from e
    return head[len(BOM):] if head.startswith(BOM) else head


_SEPARATOR_NAMES = {"tab": "\t", "\\t": "\t", "comma": ","}


def detect_layout(
    path: str | os.PathLike,
    separator: str | None = None,
    has_header: bool | None = None,
    has_label: bool | None = None,
) -> CriteoLayout:
    """Find separator, header and label column from the file's first lines (None = detect)."""
    head = _read_head(path)
    if not head.strip():
        raise ValueError(f"{path} is empty: expected Criteo rows (label, I1..I13, C1..C26)")
    lines = head.split(b"\n")
    if len(lines) > 1:
        lines = lines[:-1]  # the last piece may be cut in the middle
    numbers = [i + 1 for i, ln in enumerate(lines) if ln.strip()]  # 1-based line of each non-blank line
    lines = [ln.rstrip(b"\r") for ln in lines if ln.strip()]
    if b"\0" in head:
        nul_line = head[: head.index(b"\0")].count(b"\n") + 1
        raise ValueError(
            f"{path}:{nul_line} holds NUL bytes: it is not a Criteo text file (a binary or a compressed format this "
            f"reader does not detect; gzip, bz2 and zstd are read as they are): decompress or convert it to text first"
        )
    first = lines[0].decode("utf-8", errors="replace")
    quoted = [ln for ln in (first, lines[1].decode("utf-8", errors="replace") if len(lines) > 1 else "")
              if ln.startswith('"') and ('","' in ln or '"\t"' in ln)]  # the header, or the rows only
    if quoted:
        raise ValueError(
            f"{path}: its fields are quoted (line {quoted[0][:40]!r}...): Criteo rows are read without quote "
            f"handling, so every value would be refused. Remove the quotes first, e.g. "
            f"`sed 's/\"//g' {path} > {path}.unquoted` (Criteo values never hold quotes, commas or tabs)"
        )
    # the words `lightning-rec preprocess --separator` takes, and a backslash-t typed on a command line or in YAML
    separator = _SEPARATOR_NAMES.get(separator, separator) if isinstance(separator, str) else separator
    if separator is None:
        separator = "\t" if "\t" in first else ","
    if separator not in ("\t", ","):
        raise ValueError(f"separator must be '\\t' or ',' (or the words 'tab' / 'comma', or None to detect), got "
                         f"{separator!r}")
    names = [f.strip().lower() for f in first.split(separator)]
    if has_header is None:
        has_header = bool({"label", "i1", "c1", "id"} & set(names))

    if has_header:
        index = {name: i for i, name in enumerate(names)}
        missing = [f"I{i}" for i in range(1, 14) if f"i{i}" not in index]
        missing += [f"C{i}" for i in range(1, 27) if f"c{i}" not in index]
        if missing:
            raise ValueError(
                f"{path}: the header lacks columns {missing}: a Criteo header names label (optional), "
                f"I1..I13 and C1..C26; pass has_header=False if the first line is data"
            )
        after = head.lstrip().split(b"\n", 1)[1:]  # what follows the header line
        if not (after and after[0].strip()) and len(head) < _HEAD_BYTES - len(BOM):  # the whole file: no row
            # (cached it was refused after a parse; streamed, it trained on no batches in silence)
            raise ValueError(f"{path} has no data rows (a header only): expected Criteo rows (label, I1..I13, "
                             f"C1..C26)")
        label_field = index.get("label")
        if has_label is True and label_field is None:
            raise ValueError(f"{path}: has_label=True but the header has no 'label' column")
        if has_label is False:
            label_field = None
        return CriteoLayout(
            separator=separator,
            has_header=True,
            has_label=label_field is not None,
            num_fields=len(names),
            label_field=label_field,
            dense_fields=[index[f"i{i}"] for i in range(1, 14)],
            sparse_fields=[index[f"c{i}"] for i in range(1, 27)],
        )

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
    return CriteoLayout(
        separator=separator,
        has_header=False,
        has_label=has_label,
        num_fields=layout_width(has_label),
        label_field=0 if has_label else None,
        dense_fields=list(range(offset, offset + NUM_DENSE_FEATURES)),
        sparse_fields=list(range(offset + NUM_DENSE_FEATURES, layout_width(has_label))),
    )


# ----------------------------------------------------------------------------------------------
# parsing


@dataclass
class ParseReport:
    """What parsing one file did. `skipped` holds the first few (line, reason) of dropped rows."""

    path: str
    num_rows: int = 0
    num_padded_rows: int = 0
    num_skipped_rows: int = 0
    num_blank_lines: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)
    layout: dict | None = None

    @staticmethod
    def from_json(text: str) -> ParseReport:
        d = json.loads(text)
        d["skipped"] = [tuple(s) for s in d["skipped"]]
        return ParseReport(**d)

    def log_skips(self) -> None:
        """Warn once at the end of parsing about rows dropped or padded (never silent)."""
        if self.num_skipped_rows:
            first = "; ".join(f"line {ln}: {why}" for ln, why in self.skipped[:3])
            log.warning(
                "%s: skipped %d bad rows (on_bad_row='skip'), kept %d. First: %s",
                self.path, self.num_skipped_rows, self.num_rows, first,
            )
        if self.num_padded_rows:
            log.warning(
                "%s: %d of %d rows had fewer fields than the layout and were padded with missing values "
                "(trailing empty fields stripped, as in some copies of train.txt); a row cut after a separator "
                "is refused instead", self.path, self.num_padded_rows, self.num_rows,
            )


def iter_blocks(path: str | os.PathLike, block_bytes: int, skip_header: bool) -> Iterator[tuple[bytes, int]]:
    """Yield (whole lines ending in b"\\n", 1-based line number of the first) from a file.

    gzip/bz2/zstd files are read through Arrow's decompressing stream (detected from the first bytes).
    """
    for block, line, _ in iter_blocks_resumable(path, block_bytes, skip_header):
        yield block, line


def _unreadable(path, e: OSError) -> ValueError:
    """Arrow's decompressor says 'Truncated compressed stream' without naming the file."""
    return ValueError(f"{path}: cannot read it ({e}): a compressed file cut short (an interrupted download or "
                      f"copy?), or not the format its first bytes say: fetch or compress it again")


def iter_blocks_resumable(path: str | os.PathLike, block_bytes: int, skip_header: bool,
                          start: dict | None = None) -> Iterator[tuple[bytes, int, dict]]:
    """iter_blocks, each block with the reader's position before it (`start` resumes there).

    The position is {"read": bytes of text read, "rest": the cut line carried over, "line", "skip_header"}:
    reading on from it gives this block and every later one exactly as the first pass cut them (the
    text is read in the same `block_bytes` steps). An uncompressed file seeks to "read"; a compressed
    stream cannot seek and is decompressed up to it (not parsed).
    """
    read, rest, line = 0, b"", 1
    if start is not None:
        read, rest, line = int(start["read"]), bytes(start["rest"]), int(start["line"])
        skip_header = start["skip_header"]
    with open_criteo_stream(path) as stream:
        if read:
            if stream.seekable():
                stream.seek(read)
            else:
                left = read
                while left:
                    got = len(stream.read(min(left, block_bytes)))
                    if not got:
                        raise ValueError(f"{path} is shorter than the saved reading position ({read} bytes of text): "
                                         f"the file changed since the position was saved; start the epoch over")
                    left -= got
        if not read:  # the text's first bytes: a byte-order mark is skipped, anything else carried over
            try:
                rest = stream.read(len(BOM))
            except OSError as e:
                raise _unreadable(path, e) from e
            read = len(rest)
            rest = b"" if rest == BOM else rest
        while True:
            position = {"read": read, "rest": rest, "line": line, "skip_header": skip_header}
            try:
                chunk = stream.read(block_bytes)
            except OSError as e:
                raise _unreadable(path, e) from e
            read += len(chunk)
            data = rest + chunk if rest else chunk
            if not chunk:
                if data:
                    # The last line may lack its newline (e.g. pytorch-fm's train.txt).
                    for block, first in _emit(data + b"\n", line, skip_header):
                        yield block, first, position
                return
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                rest = data
                continue
            block, rest = data[:cut], data[cut:]
            for piece, first in _emit(block, line, skip_header):
                yield piece, first, position
            if skip_header and line == 1:
                skip_header = False
            line += block.count(b"\n")


def iter_line_blocks(
    path: str | os.PathLike, block_bytes: int, skip_header: bool, start_byte: int = 0, progress=None
) -> Iterator[tuple[np.ndarray, int]]:
    """Yield (whole lines ending in b"\\n" as a uint8 view, byte offset after them) from `start_byte` of the text.

    The native parser's reader: text is read straight into one reused buffer (no copy or count per
    block; the parser counts lines), so each view is valid only until the next one is asked for.
    Offsets count the decompressed text (a compressed file is decompressed up to `start_byte`, since
    streams cannot seek). `skip_header` drops the first line when starting at byte 0. `progress(n)`
    is called with the bytes of the file itself read so far.
    """
    compression = file_compression(path)
    raw = pa.OSFile(str(path), "rb")
    stream = pa.CompressedInputStream(raw, compression) if compression else raw
    try:
        if start_byte and compression is None:
            raw.seek(start_byte)
        else:
            left = start_byte
            while left:
                got = len(stream.read(min(left, block_bytes)))
                if got == 0:
                    raise ValueError(f"{path} is shorter than byte {start_byte}: the file changed since it was read")
                left -= got
        buf = np.empty(max(block_bytes, len(BOM)), dtype=np.uint8)
        filled, pos = 0, start_byte
        header = skip_header and start_byte == 0
        if start_byte == 0:  # a byte-order mark before the first row is skipped (offsets still count it)
            try:
                filled = stream.readinto(memoryview(buf)[:len(BOM)])
            except OSError as e:
                raise _unreadable(path, e) from e
            if bytes(buf[:filled]) == BOM:
                filled, pos = 0, len(BOM)
        while True:
            if filled == buf.size:  # a line longer than the buffer: grow it
                buf = np.concatenate([buf, np.empty(buf.size, dtype=np.uint8)])
            try:
                got = stream.readinto(memoryview(buf)[filled:])
            except OSError as e:
                raise _unreadable(path, e) from e
            if progress is not None:
                progress(raw.tell())
            if got == 0:
                if filled and header:
                    return  # a header without data rows
                if filled:  # the last line may lack its newline
                    if buf[filled - 1] != 10:
                        if filled == buf.size:
                            buf = np.concatenate([buf, np.empty(1, dtype=np.uint8)])
                        buf[filled] = 10
                        yield buf[:filled + 1], pos + filled
                    else:
                        yield buf[:filled], pos + filled
                return
            filled += got
            start = 0
            if header:
                nl = np.flatnonzero(buf[:filled] == 10)
                if nl.size == 0:
                    continue
                start = int(nl[0]) + 1
                header = False
            cut = _last_newline(buf, start, filled)
            if cut <= start:
                if start:
                    buf[: filled - start] = buf[start:filled]
                    pos, filled = pos + start, filled - start
                continue
            yield buf[start:cut], pos + cut
            rest = filled - cut
            buf[:rest] = buf[cut:filled]  # the cut line's start moves to the front (overlap-safe in numpy)
            pos, filled = pos + cut, rest
    finally:
        raw.close()


def _last_newline(buf: np.ndarray, start: int, end: int) -> int:
    """1 + index of the last b"\\n" in buf[start:end], or `start` when there is none (looks back 64 KiB at a time)."""
    hi = end
    while hi > start:
        lo = max(start, hi - (1 << 16))
        hits = np.flatnonzero(buf[lo:hi] == 10)
        if hits.size:
            return lo + int(hits[-1]) + 1
        hi = lo
    return start


def _emit(block: bytes, line: int, skip_header: bool) -> Iterator[tuple[bytes, int]]:
    if skip_header and line == 1:
        nl = block.index(b"\n") + 1
        block, line = block[nl:], 2
    if block:
        yield block, line


def minus_one_label_fix(reason: str, what: str) -> str | None:
    """The fix for a label of -1: the data is labelled -1/1 (libsvm style), and on_bad_row='skip', the fix offered for
    a bad row, dropped every negative row (training on clicks alone, AUC undefined). None for any other reason."""
    if not re.fullmatch(r"label must be 0 or 1, got '?-1(\.0*)?'?", reason.split(": ")[-1]):
        return None
    how = ("ds.map(lambda r: {'label': int(r['label'] > 0)}), or the label column as label > 0"
           if what == "table" else "sed 's/^-1/0/' FILE > NEW")
    return (f"The {what}'s labels look like -1/1: map -1 to 0 first ({how}); on_bad_row='skip' would drop every "
            f"negative row")


def _raise_or_record(
    problems: list[tuple[np.ndarray, object, int]], on_bad_row: str, path: str, report: ParseReport
) -> None:
    """problems: (line numbers, reason(i) for the i-th of them, rank). Raise for the first line, or record.

    rank orders the faults of one line (the native op reports the same one): a non-ASCII byte (-3),
    too many fields (-2), a cut row (-1), else the field position of the first bad field.
    """
    if not problems:
        return
    if on_bad_row == "error":
        first_line, _, reason = min(
            (int(lines.min()), rank, why(int(lines.argmin()))) for lines, why, rank in problems if lines.size
        )
        raise ValueError(f"{path}:{first_line}: {reason}. " + (minus_one_label_fix(reason, "file") or (
            "Fix the file, or pass on_bad_row='skip' to drop such rows (they are counted and logged, never shifted)")))
    # one reason per line (the first by rank), the first few lines of the block
    seen: dict[int, tuple[int, str]] = {}
    for lines, why, rank in problems:
        for i in np.argsort(lines, kind="stable")[:_MAX_REPORTED_BAD_ROWS]:
            line = int(lines[i])
            if line not in seen or rank < seen[line][0]:
                seen[line] = (rank, why(int(i)))
    for line in sorted(seen)[: max(0, _MAX_REPORTED_BAD_ROWS - len(report.skipped))]:
        report.skipped.append((line, seen[line][1]))
    report.skipped.sort()


def field_name(layout: CriteoLayout, k: int) -> str:
    """What field k (0-based) of a row holds: label, I1..I13, C1..C26, or an unused column."""
    if k == layout.label_field:
        return "label"
    if k in layout.dense_fields:
        return f"I{layout.dense_fields.index(k) + 1}"
    if k in layout.sparse_fields:
        return f"C{layout.sparse_fields.index(k) + 1}"
    return f"column {k + 1}"


def _non_ascii_reason(layout: CriteoLayout, k: int, byte: int) -> str:
    return (
        f"field {k + 1} ({field_name(layout, k)}) holds the non-ASCII byte 0x{byte:02x}: Criteo files are ASCII "
        f"text, so the file is corrupt here (or not a Criteo file)"
    )


def _stray_cr_reason(layout: CriteoLayout, k: int) -> str:
    return (
        f"field {k + 1} ({field_name(layout, k)}) holds a carriage return (\\r) that does not end the line (a file "
        f"converted to CRLF twice?): remove the extra \\r (e.g. `sed -i 's/\\r*$//' FILE`)"
    )


def _cut_reason(layout: CriteoLayout, count: int) -> str:
    return (
        f"{count} of {layout.num_fields} fields and the row ends in a separator: it was cut short "
        f"(a truncated file?), not stripped of empty trailing fields"
    )


def _too_many_reason(layout: CriteoLayout, count: int) -> str:
    return f"{count} fields, but this file's rows have {layout.num_fields}"


def _strings_to_float(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
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


def _decode_hex(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """8-hex-character strings -> int64 [N] (-1 = missing) and a bad-value mask [N], vectorized.

    Reads the Arrow string buffers directly: offsets give each value's start, the 8 bytes are
    gathered as an [n, 8] array, a 256-entry table turns bytes into nibbles.
    """
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


def _parse_block(
    block: bytes, first_line: int, layout: CriteoLayout, path: str, on_bad_row: str, report: ParseReport
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference parser. Whole lines -> (label [N] float32, dense [N, 13] float32 raw, sparse [N, 26] int64 raw).

    Line bookkeeping is done in numpy before Arrow's CSV reader sees the bytes, so that every row
    handed to Arrow has exactly `num_fields` fields and its file line number is known.
    """
    sep = layout.separator.encode()
    buf_L = np.frombuffer(block, dtype=np.uint8)
    ends_incl = np.flatnonzero(buf_L == 10)  # newline of every line (the block ends with one)
    starts = np.empty_like(ends_incl)
    starts[0] = 0
    starts[1:] = ends_incl[:-1] + 1
    has_cr = (ends_incl > starts) & (buf_L[ends_incl - 1] == 13)
    content_end = ends_incl - has_cr  # pad before a "\r\n" pair, not between its bytes
    sep_pos = np.flatnonzero(buf_L == sep[0])
    sep_line = np.searchsorted(ends_incl, sep_pos)
    num_fields = np.bincount(sep_line, minlength=ends_incl.size) + 1
    blank = content_end == starts
    line_no = first_line + np.arange(ends_incl.size)
    problems: list[tuple[np.ndarray, object, int]] = []

    # Arrow would refuse the whole block ("invalid UTF8"); Criteo text is ASCII, so any byte >= 0x80
    # is corruption: the row is bad, the others are read.
    non_ascii = np.zeros(ends_incl.size, dtype=bool)
    high_pos = np.flatnonzero(buf_L >= 128)
    if high_pos.size:
        high_line = np.searchsorted(ends_incl, high_pos)
        lines_with, first_idx = np.unique(high_line, return_index=True)
        pos = high_pos[first_idx]
        field_k = np.searchsorted(sep_pos, pos) - np.searchsorted(sep_pos, starts[lines_with])
        non_ascii[lines_with] = True
        problems.append((line_no[lines_with],
                         lambda i: _non_ascii_reason(layout, int(field_k[i]), int(buf_L[pos[i]])), -3))
    # A carriage return that does not end its line ("\r\r\n": a file converted to CRLF twice) ends a row for Arrow,
    # which then read more rows than the block has lines (an AssertionError); the native op reads it as part of
    # the field. The row is bad, named by the field that holds it
    stray_cr = np.zeros(ends_incl.size, dtype=bool)
    cr_pos = np.flatnonzero(buf_L == 13)
    cr_pos = cr_pos[buf_L[np.minimum(cr_pos + 1, buf_L.size - 1)] != 10]
    if cr_pos.size:
        cr_line = np.searchsorted(ends_incl, cr_pos)
        lines_with, first_idx = np.unique(cr_line, return_index=True)
        lines_with, first_idx = lines_with[~non_ascii[lines_with]], first_idx[~non_ascii[lines_with]]
        pos = cr_pos[first_idx]
        cr_field = np.searchsorted(sep_pos, pos) - np.searchsorted(sep_pos, starts[lines_with])
        stray_cr[lines_with] = True
        problems.append((line_no[lines_with], lambda i: _stray_cr_reason(layout, int(cr_field[i])), -3))
    non_ascii |= stray_cr  # dropped before Arrow, as a non-ASCII row
    too_many = (num_fields > layout.num_fields) & ~non_ascii
    short = (num_fields < layout.num_fields) & ~blank & ~non_ascii
    last_byte = buf_L[np.maximum(content_end - 1, 0)]
    cut = short & (last_byte == sep[0])
    short &= ~cut
    keep = ~blank & ~too_many & ~non_ascii & ~cut
    report.num_blank_lines += int(blank.sum())
    if too_many.any():
        many_lines, many_counts = line_no[too_many], num_fields[too_many]
        problems.append((many_lines, lambda i: _too_many_reason(layout, int(many_counts[i])), -2))
    if cut.any():
        cut_lines, cut_counts = line_no[cut], num_fields[cut]
        problems.append((cut_lines, lambda i: _cut_reason(layout, int(cut_counts[i])), -1))

    if short.any() or not keep.all():
        pad = np.where(short, layout.num_fields - num_fields, 0)
        padded_L = np.insert(buf_L, np.repeat(content_end, pad), sep[0]) if short.any() else buf_L
        keep_L = np.repeat(keep, ends_incl - starts + 1 + pad)
        clean = padded_L[keep_L] if not keep.all() else padded_L
    else:
        clean = buf_L
    rows_line = line_no[keep]
    short_rows = short[keep]

    names = [f"f{i}" for i in range(layout.num_fields)]
    used = [layout.label_field] if layout.label_field is not None else []
    used += layout.dense_fields + layout.sparse_fields
    if rows_line.size:
        table = pacsv.read_csv(
            pa.BufferReader(pa.py_buffer(clean)),
            read_options=pacsv.ReadOptions(column_names=names, use_threads=True),
            parse_options=pacsv.ParseOptions(
                delimiter=layout.separator, quote_char=False, double_quote=False, escape_char=False,
                newlines_in_values=False, ignore_empty_lines=False,
            ),
            convert_options=pacsv.ConvertOptions(
                include_columns=[names[i] for i in used],
                column_types={names[i]: pa.string() for i in used},
                null_values=[""],
                strings_can_be_null=True,
            ),
        ).combine_chunks()
        assert table.num_rows == rows_line.size, (table.num_rows, rows_line.size)
        column = lambda i: table.column(names[i]).chunk(0)  # noqa: E731
    n = int(rows_line.size)
    bad_N = np.zeros(n, dtype=bool)

    def note(col_bad: np.ndarray, what: str, col: pa.Array, field_k: int) -> None:
        if col_bad.any():
            rows = np.flatnonzero(col_bad)
            problems.append((rows_line[rows], lambda i: f"{what} {col[int(rows[i])].as_py()!r}", field_k))
            bad_N[rows] = True

    label_N = np.full(n, np.nan, dtype=np.float32)
    if layout.label_field is not None and n:
        col = column(layout.label_field)
        values, bad = _strings_to_float(col)
        bad |= ~np.isin(values, (0.0, 1.0))  # also catches a missing label (NaN)
        note(bad, "label must be 0 or 1, got", col, layout.label_field)
        label_N[:] = values
    dense_N13 = np.empty((n, NUM_DENSE_FEATURES), dtype=np.float32)
    for j, f in enumerate(layout.dense_fields):
        if n:
            col = column(f)
            values, bad = _strings_to_float(col)
            note(bad, f"I{j + 1} must be a number, got", col, f)
            dense_N13[:, j] = values
    sparse_NF = np.empty((n, NUM_SPARSE_FEATURES), dtype=np.int64)
    for j, f in enumerate(layout.sparse_fields):
        if n:
            col = column(f)
            values, bad = _decode_hex(col)
            note(bad, f"C{j + 1} must be 8 hex characters, got", col, f)
            sparse_NF[:, j] = values

    _raise_or_record(problems, on_bad_row, path, report)
    good = ~bad_N
    report.num_skipped_rows += int(too_many.sum()) + int(non_ascii.sum()) + int(cut.sum()) + int(bad_N.sum())
    report.num_padded_rows += int((short_rows & good).sum())
    report.num_rows += int(good.sum())
    if not good.all():
        return label_N[good], dense_N13[good], sparse_NF[good]
    return label_N, dense_N13, sparse_NF


def _native_args(layout: CriteoLayout) -> tuple:
    return (
        ord(layout.separator), layout.num_fields, -1 if layout.label_field is None else layout.label_field,
        list(layout.dense_fields), list(layout.sparse_fields),
    )


def parse_block_native(
    block: bytes | np.ndarray,
    first_line: int,
    layout: CriteoLayout,
    path: str,
    on_bad_row: str,
    report: ParseReport,
    hash_mode: int = HASH_RAW,
    num_embeddings: Sequence[int] = (),
    log_dense: bool = False,
    lines_out: list[int] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The native op on whole lines; the same rows, values, report and errors as `_parse_block`.

    With the defaults the output is the reference's (raw values). `hash_mode` / `log_dense` make the
    op also do what `make_criteo_batch` does per batch (table ids, log(1 + max(x, 0))), for preprocessing.
    `lines_out[0]` is advanced by the block's line count (so it holds the next block's first line).
    """
    if isinstance(block, np.ndarray):
        buf_L = torch.from_numpy(block)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a bytes block is read-only; the op never writes to it
            buf_L = torch.frombuffer(block, dtype=torch.uint8) if len(block) else torch.empty(0, dtype=torch.uint8)
    label_N, dense_N13, sparse_NF, status_N = torch.ops.lightning_rec.parse_criteo(
        buf_L, *_native_args(layout), list(num_embeddings), hash_mode, log_dense
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
        return label[good], dense[good], sparse[good]
    return label, dense, sparse


def _status_field(layout: CriteoLayout, kind: int, k: int) -> int | None:
    """The field (0-based, in the line) that a label / dense / sparse status names; None for another status."""
    if kind == _STATUS_LABEL:
        return layout.label_field
    if kind == _STATUS_DENSE:
        return layout.dense_fields[k]
    return layout.sparse_fields[k] if kind == _STATUS_SPARSE else None


def _native_problems(
    block, first_line: int, layout: CriteoLayout, path: str, on_bad_row: str, report: ParseReport,
    status: np.ndarray, bad: np.ndarray,
) -> None:
    """Reasons for the bad rows the op flagged (error path only: the line's bytes are looked at again)."""
    buf_L = block if isinstance(block, np.ndarray) else np.frombuffer(block, dtype=np.uint8)
    ends = np.flatnonzero(buf_L == 10)
    bad_idx = np.flatnonzero(bad)
    if on_bad_row == "error":
        bad_idx = bad_idx[:1]
    else:
        bad_idx = bad_idx[:_MAX_REPORTED_BAD_ROWS]
    sep = layout.separator.encode()
    lines, reasons = [], []
    for i in bad_idx:  # a few rows at most, on the error path
        start = int(ends[i - 1]) + 1 if i > 0 else 0
        text = bytes(buf_L[start:int(ends[i])])
        if text.endswith(b"\r"):
            text = text[:-1]
        fields = text.split(sep)
        kind, k = int(status[i]) & 0xFF, int(status[i]) >> 8

        def value(field: int, fields: list[bytes] = fields) -> str | None:
            v = fields[field].decode("utf-8", "backslashreplace") if field < len(fields) else ""
            return v if v else None

        if kind == _STATUS_NON_ASCII:
            byte = next(b for b in fields[k] if b >= 128)
            reason = _non_ascii_reason(layout, k, byte)
        elif kind == _STATUS_TOO_MANY:
            reason = _too_many_reason(layout, k)
        elif kind == _STATUS_CUT:
            reason = _cut_reason(layout, k)
        elif (field := _status_field(layout, kind, k)) is not None and field < len(fields) and b"\r" in fields[field]:
            reason = _stray_cr_reason(layout, field)  # a "\r\r\n" line: the reference parser's words for it
        elif kind == _STATUS_LABEL:
            reason = f"label must be 0 or 1, got {value(layout.label_field)!r}"
        elif kind == _STATUS_DENSE:
            reason = f"I{k + 1} must be a number, got {value(layout.dense_fields[k])!r}"
        elif kind == _STATUS_SPARSE:
            reason = f"C{k + 1} must be 8 hex characters, got {value(layout.sparse_fields[k])!r}"
        else:  # pragma: no cover
            raise AssertionError(f"unknown parse_criteo status {int(status[i])}")
        lines.append(first_line + int(i))
        reasons.append(reason)
    _raise_or_record([(np.asarray(lines), lambda j: reasons[j], 0)], on_bad_row, path, report)


def parse_block(
    block: bytes, first_line: int, layout: CriteoLayout, path: str, on_bad_row: str, report: ParseReport,
    parser: str = "auto",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Whole lines -> (label [N], dense [N, 13] raw, sparse [N, 26] raw) with `parser` (see the module doc)."""
    if resolve_parser(parser) == "native":
        return parse_block_native(block, first_line, layout, path, on_bad_row, report)
    return _parse_block(block, first_line, layout, path, on_bad_row, report)


def table_ids(raw: np.ndarray, num_embeddings: np.ndarray, missing_categorical: str) -> np.ndarray:
    """Raw 32-bit hashes (-1: missing) -> table rows, `num_embeddings` broadcast against `raw`: reserved_id
    1 + v % (n - 1) (0: missing), empty_bag v % n (-1: missing). The native op's hash modes compute the same."""
    present = raw >= 0
    if missing_categorical == "reserved_id":
        return np.where(present, raw % (num_embeddings - 1) + 1, 0)
    return np.where(present, raw % num_embeddings, -1)


def _check_missing_categorical(missing_categorical: str) -> None:
    if missing_categorical not in MISSING_CATEGORICAL:
        raise ValueError(
            f"missing_categorical must be one of {MISSING_CATEGORICAL}, got {missing_categorical!r}"
        )


def _check_on_bad_row(on_bad_row: str) -> None:
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")


def read_criteo(
    path: str | os.PathLike,
    separator: str | None = None,
    has_header: bool | None = None,
    has_label: bool | None = None,
    on_bad_row: str = "error",
    block_bytes: int = 64 << 20,
    parser: str = "auto",
) -> Iterator[tuple[pa.Table, ParseReport]]:
    """Parse a Criteo file into Arrow tables (label, dense, sparse: raw values), one per block.

    The report is the same object every time, updated as blocks are parsed. `parser`: "auto"
    (native when built), "native" or "python" (the reference); both give the same tables.
    """
    _check_on_bad_row(on_bad_row)
    parser = resolve_parser(parser)
    layout = detect_layout(path, separator, has_header, has_label)
    report = ParseReport(path=str(path), layout=asdict(layout))
    if parser == "native":
        lines = [2 if layout.has_header else 1]
        for block, _ in iter_line_blocks(path, block_bytes, skip_header=layout.has_header):
            arrays = parse_block_native(block, lines[0], layout, str(path), on_bad_row, report, lines_out=lines)
            yield _to_table(*arrays), report
        return
    for block, first_line in iter_blocks(path, block_bytes, skip_header=layout.has_header):
        label_N, dense_N13, sparse_NF = parse_block(block, first_line, layout, str(path), on_bad_row, report, parser)
        yield _to_table(label_N, dense_N13, sparse_NF), report


def _to_table(label_N: np.ndarray, dense_N13: np.ndarray, sparse_NF: np.ndarray) -> pa.Table:
    return pa.table(
        {
            "label": pa.array(label_N, pa.float32()),
            "dense": pa.FixedSizeListArray.from_arrays(pa.array(dense_N13.reshape(-1)), NUM_DENSE_FEATURES),
            "sparse": pa.FixedSizeListArray.from_arrays(pa.array(sparse_NF.reshape(-1)), NUM_SPARSE_FEATURES),
        }
    )


