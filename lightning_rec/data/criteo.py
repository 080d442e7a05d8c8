"""Criteo click logs -> whole `Batch`es, through a memory-mapped Hugging Face Arrow cache.

Shapes: N rows (of a file or a parsed block), B rows in a batch, F = 26 sparse features (C1..C26),
13 dense features (I1..I13), L bytes of a block.

Layouts read (detected from the first lines, each overridable):

    train.txt / day_N   label \\t I1..I13 \\t C1..C26          40 fields, no header
    Kaggle test file    I1..I13 \\t C1..C26                    39 fields, no header, no label
    Kaggle train.csv    Id,Label,I1..I13,C1..C26              header, comma (test.csv: no Label)
    DeepCTR sample      label,I1..I13,C1..C26                 header, comma, ints may be "260.0"

How a file becomes batches:

    file --(blocks of ~64 MiB, cut at newlines)--> _parse_block --> Arrow record batch
         label [N] float32 (NaN: no label), dense [N, 13] float32 raw (NaN: missing),
         sparse [N, 26] int64 raw 32-bit hash (-1: missing)
    --(datasets.ArrowWriter)--> <cache_dir>/<file>-<key>.arrow --(Dataset.from_file: mmap)-->
    CriteoDataset.__getitems__(indices of one batch) --numpy gather--> _make_batch --> Batch

The cache keeps the raw values, so changing table sizes, the dense transform or the missing-id
policy needs no re-parse; `% num_embeddings` and `log(1 + max(x, 0))` are applied per batch.

Missing categorical values (`missing_categorical`):
    "reserved_id" (default)  id 0 of every table means "missing"; a present hash v maps to
                             1 + v % (num_embeddings - 1). Every bag holds exactly one id.
    "empty_bag"              a missing value is an empty bag (length 0, pooled to zeros);
                             a present hash v maps to v % num_embeddings.

Rows that are not clean Criteo rows:
    fewer fields than the layout   trailing empty fields were stripped: padded as missing
                                   (counted in ParseReport.num_padded_rows)
    more fields, a non-numeric I, a label other than 0/1, a C that is not 8 hex characters
        on_bad_row="error"  ValueError naming file and line
        on_bad_row="skip"   the row is dropped, counted (ParseReport.num_skipped_rows), the first
                            few logged with their line and reason; no column is ever shifted.
    blank lines             ignored (counted in ParseReport.num_blank_lines)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from lightning_rec.data.batch import Batch, passthrough_collate
from lightning_rec.sparse import KeyedJaggedTensor

log = logging.getLogger(__name__)

NUM_DENSE_FEATURES = 13
NUM_SPARSE_FEATURES = 26
DEFAULT_SPARSE_FEATURE_NAMES = [f"C{i}" for i in range(1, NUM_SPARSE_FEATURES + 1)]
MISSING_CATEGORICAL = ("reserved_id", "empty_bag")
# Bumped whenever the parser's output changes, so that old cache files are not reused.
_PARSER_VERSION = 1
_MAX_REPORTED_BAD_ROWS = 20

# hex digit value of every byte; 255 marks a byte that is not a hex digit
_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
_HEX_SHIFTS_8 = np.arange(28, -1, -4, dtype=np.int64)  # first character is the high nibble
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


def _read_head(path: str | os.PathLike, num_bytes: int = 1 << 20) -> bytes:
    with pa.input_stream(str(path), compression="detect") as stream:
        return stream.read(num_bytes)


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
    lines = [ln.rstrip(b"\r") for ln in lines if ln.strip()]
    first = lines[0].decode("utf-8", errors="replace")
    if separator is None:
        separator = "\t" if "\t" in first else ","
    if separator not in ("\t", ","):
        raise ValueError(f"separator must be '\\t' or ',' (or None to detect), got {separator!r}")
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
                f"{path}: rows have {max(counts)} fields, not 40 (label + I1..I13 + C1..C26) or 39 (no "
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
        if self.num_skipped_rows:
            first = "; ".join(f"line {ln}: {why}" for ln, why in self.skipped[:3])
            log.warning(
                "%s: skipped %d bad rows (on_bad_row='skip'), kept %d. First: %s",
                self.path, self.num_skipped_rows, self.num_rows, first,
            )


def iter_blocks(path: str | os.PathLike, block_bytes: int, skip_header: bool) -> Iterator[tuple[bytes, int]]:
    """Yield (whole lines ending in b"\\n", 1-based line number of the first) from a file.

    gzip/bz2/zstd files are read through Arrow's decompressing stream (detected from the suffix).
    """
    line = 1
    rest = b""
    with pa.input_stream(str(path), compression="detect") as stream:
        while True:
            chunk = stream.read(block_bytes)
            data = rest + chunk if rest else chunk
            if not chunk:
                if data:
                    # The last line may lack its newline (e.g. pytorch-fm's train.txt).
                    yield from _emit(data + b"\n", line, skip_header)
                return
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                rest = data
                continue
            block, rest = data[:cut], data[cut:]
            yield from _emit(block, line, skip_header)
            if skip_header and line == 1:
                skip_header = False
            line += block.count(b"\n")


def _emit(block: bytes, line: int, skip_header: bool) -> Iterator[tuple[bytes, int]]:
    if skip_header and line == 1:
        nl = block.index(b"\n") + 1
        block, line = block[nl:], 2
    if block:
        yield block, line


def _raise_or_record(
    problems: list[tuple[np.ndarray, object]], on_bad_row: str, path: str, report: ParseReport
) -> None:
    """problems: (line numbers, reason(i) for the i-th of them). Raise for the first line, or record."""
    if not problems:
        return
    if on_bad_row == "error":
        first_line, reason = min(
            (int(lines.min()), why(int(lines.argmin()))) for lines, why in problems if lines.size
        )
        raise ValueError(
            f"{path}:{first_line}: {reason}. Fix the file, or pass on_bad_row='skip' to drop such rows "
            f"(they are counted and logged, never shifted)"
        )
    for lines, why in problems:
        for i in range(min(lines.size, _MAX_REPORTED_BAD_ROWS - len(report.skipped))):
            report.skipped.append((int(lines[i]), why(i)))
    report.skipped.sort()


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
        nibbles = _HEX_LUT[data[offsets[rows, None] + np.arange(8)]]  # [n8, 8]
        not_hex = (nibbles == 255).any(axis=1)
        out_N[rows] = (nibbles.astype(np.int64) << _HEX_SHIFTS_8).sum(axis=1)
        out_N[rows[not_hex]] = -1
        bad_N[rows[not_hex]] = True
    return out_N, bad_N


def _parse_block(
    block: bytes, first_line: int, layout: CriteoLayout, path: str, on_bad_row: str, report: ParseReport
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Whole lines -> (label [N] float32, dense [N, 13] float32 raw, sparse [N, 26] int64 raw).

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
    sep_line = np.searchsorted(ends_incl, np.flatnonzero(buf_L == sep[0]))
    num_fields = np.bincount(sep_line, minlength=ends_incl.size) + 1
    blank = content_end == starts
    too_many = num_fields > layout.num_fields
    short = (num_fields < layout.num_fields) & ~blank
    keep = ~blank & ~too_many
    line_no = first_line + np.arange(ends_incl.size)
    report.num_blank_lines += int(blank.sum())

    problems: list[tuple[np.ndarray, object]] = []
    if too_many.any():
        many_lines, many_counts = line_no[too_many], num_fields[too_many]
        problems.append(
            (many_lines, lambda i: f"{many_counts[i]} fields, but this file's rows have {layout.num_fields}")
        )

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

    def note(col_bad: np.ndarray, what: str, col: pa.Array) -> None:
        if col_bad.any():
            rows = np.flatnonzero(col_bad)
            problems.append((rows_line[rows], lambda i: f"{what} {col[int(rows[i])].as_py()!r}"))
            bad_N[rows] = True

    label_N = np.full(n, np.nan, dtype=np.float32)
    if layout.label_field is not None and n:
        col = column(layout.label_field)
        values, bad = _strings_to_float(col)
        bad |= ~np.isin(values, (0.0, 1.0))  # also catches a missing label (NaN)
        note(bad, "label must be 0 or 1, got", col)
        label_N[:] = values
    dense_N13 = np.empty((n, NUM_DENSE_FEATURES), dtype=np.float32)
    for j, f in enumerate(layout.dense_fields):
        if n:
            col = column(f)
            values, bad = _strings_to_float(col)
            note(bad, f"I{j + 1} must be a number, got", col)
            dense_N13[:, j] = values
    sparse_NF = np.empty((n, NUM_SPARSE_FEATURES), dtype=np.int64)
    for j, f in enumerate(layout.sparse_fields):
        if n:
            col = column(f)
            values, bad = _decode_hex(col)
            note(bad, f"C{j + 1} must be 8 hex characters, got", col)
            sparse_NF[:, j] = values

    _raise_or_record(problems, on_bad_row, path, report)
    good = ~bad_N
    report.num_skipped_rows += int(too_many.sum()) + int(bad_N.sum())
    report.num_padded_rows += int((short_rows & good).sum())
    report.num_rows += int(good.sum())
    if not good.all():
        return label_N[good], dense_N13[good], sparse_NF[good]
    return label_N, dense_N13, sparse_NF


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
) -> Iterator[tuple[pa.Table, ParseReport]]:
    """Parse a Criteo file into Arrow tables (label, dense, sparse: raw values), one per block.

    The report is the same object every time, updated as blocks are parsed.
    """
    _check_on_bad_row(on_bad_row)
    layout = detect_layout(path, separator, has_header, has_label)
    report = ParseReport(path=str(path), layout=asdict(layout))
    for block, first_line in iter_blocks(path, block_bytes, skip_header=layout.has_header):
        label_N, dense_N13, sparse_NF = _parse_block(block, first_line, layout, str(path), on_bad_row, report)
        yield _to_table(label_N, dense_N13, sparse_NF), report


def _to_table(label_N: np.ndarray, dense_N13: np.ndarray, sparse_NF: np.ndarray) -> pa.Table:
    return pa.table(
        {
            "label": pa.array(label_N, pa.float32()),
            "dense": pa.FixedSizeListArray.from_arrays(pa.array(dense_N13.reshape(-1)), NUM_DENSE_FEATURES),
            "sparse": pa.FixedSizeListArray.from_arrays(pa.array(sparse_NF.reshape(-1)), NUM_SPARSE_FEATURES),
        }
    )


# ----------------------------------------------------------------------------------------------
# cache


def default_cache_dir() -> Path:
    import datasets.config

    return Path(datasets.config.HF_DATASETS_CACHE) / "lightning_rec" / "criteo"


def build_criteo_cache(
    path: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    separator: str | None = None,
    has_header: bool | None = None,
    has_label: bool | None = None,
    on_bad_row: str = "error",
    block_bytes: int = 64 << 20,
) -> tuple[Path, ParseReport]:
    """Parse `path` once into a memory-mappable Arrow file; later calls find it and return at once.

    The cache key covers the file (absolute path, size, mtime), the parse options and the parser
    version. The file is written under a temporary name and renamed, so ranks that build the same
    cache at once never read a half-written file.
    """
    from datasets.arrow_writer import ArrowWriter

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"Criteo file {path} does not exist: check train_path / val_path / test_path")
    stat = path.stat()
    key_src = json.dumps(
        [str(path.resolve()), stat.st_size, stat.st_mtime_ns, _PARSER_VERSION,
         separator, has_header, has_label, on_bad_row]
    )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    arrow_path = cache_dir / f"{path.name}-{key}.arrow"
    meta_path = cache_dir / f"{path.name}-{key}.json"
    if arrow_path.is_file() and meta_path.is_file():
        return arrow_path, ParseReport.from_json(meta_path.read_text())

    tmp = cache_dir / f".{arrow_path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    report = ParseReport(path=str(path))
    try:
        with ArrowWriter(features=_cache_features(), path=str(tmp)) as writer:
            tables = read_criteo(path, separator, has_header, has_label, on_bad_row, block_bytes)
            for table, block_report in tables:
                report = block_report
                if table.num_rows:
                    # one record batch per parsed block: few chunks, so a batch gather loops over few
                    writer.write_table(table, writer_batch_size=max(table.num_rows, 1))
            writer.finalize()
        if report.num_rows == 0:
            raise ValueError(
                f"{path} has no data rows ({report.num_skipped_rows} bad rows skipped, "
                f"{report.num_blank_lines} blank lines): expected Criteo rows (label, I1..I13, C1..C26)"
            )
        os.replace(tmp, arrow_path)
    finally:
        if tmp.exists():
            tmp.unlink()
    meta_tmp = meta_path.with_name(meta_path.name + f".{uuid.uuid4().hex[:8]}.tmp")
    meta_tmp.write_text(json.dumps(asdict(report)))
    os.replace(meta_tmp, meta_path)
    report.log_skips()
    return arrow_path, report


# ----------------------------------------------------------------------------------------------
# batches


def _resolve_num_embeddings(num_embeddings_per_feature: int | Sequence[int], num_features: int) -> list[int]:
    if isinstance(num_embeddings_per_feature, int):
        sizes = [num_embeddings_per_feature] * num_features
    else:
        sizes = [int(n) for n in num_embeddings_per_feature]
    if len(sizes) != num_features:
        raise ValueError(
            f"num_embeddings_per_feature has {len(sizes)} entries for {num_features} sparse features: "
            f"give one int for all, or one per feature"
        )
    if min(sizes) < 2:
        raise ValueError(f"num_embeddings_per_feature must be >= 2 for every feature, got {sizes}")
    return sizes


def make_criteo_batch(
    label_B: np.ndarray,
    dense_raw_B13: np.ndarray,
    sparse_raw_BF: np.ndarray,
    num_embeddings_F: np.ndarray,
    keys: Sequence[str],
    missing_categorical: str = "reserved_id",
) -> Batch:
    """Raw values of B rows -> Batch: log(1 + max(x, 0)) on dense, hashing into tables on sparse."""
    # fmax ignores NaN, so a missing count becomes log(1 + 0) = 0
    dense_B13 = np.log1p(np.fmax(dense_raw_B13, 0.0)).astype(np.float32, copy=False)
    sparse_FB = sparse_raw_BF.T
    present_FB = sparse_FB >= 0
    mod_F1 = num_embeddings_F[:, None]
    batch_size = label_B.shape[0]
    if missing_categorical == "reserved_id":
        ids_FB = np.where(present_FB, sparse_FB % (mod_F1 - 1) + 1, 0)
        values_N = ids_FB.reshape(-1)
        lengths_FB = np.ones(ids_FB.size, dtype=np.int64)
    else:
        values_N = (sparse_FB % mod_F1)[present_FB]  # boolean mask keeps [F, B] order: key-major
        lengths_FB = present_FB.reshape(-1).astype(np.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        list(keys), torch.from_numpy(np.ascontiguousarray(values_N, dtype=np.int64)),
        torch.from_numpy(lengths_FB), stride=batch_size,
    )
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(dense_B13)),
        sparse_features=kjt,
        labels=torch.from_numpy(np.ascontiguousarray(label_B, dtype=np.float32)),
    )


class CriteoDataset(Dataset):
    """Map-style dataset over a cached (memory-mapped) Criteo Arrow file; one item = one Batch.

    Use with `batch_sampler=BatchSampler(...)` and `collate_fn=passthrough_collate`: the DataLoader
    then calls `__getitems__(indices)` once per batch and the whole batch is gathered in numpy.
    """

    def __init__(
        self,
        arrow_path: str | os.PathLike,
        num_embeddings_per_feature: int | Sequence[int],
        sparse_feature_names: Sequence[str] | None = None,
        missing_categorical: str = "reserved_id",
    ) -> None:
        self.arrow_path = str(arrow_path)
        self.keys = list(sparse_feature_names or DEFAULT_SPARSE_FEATURE_NAMES)
        if len(self.keys) != NUM_SPARSE_FEATURES:
            raise ValueError(f"sparse_feature_names needs {NUM_SPARSE_FEATURES} names, got {len(self.keys)}")
        _check_missing_categorical(missing_categorical)
        self.missing_categorical = missing_categorical
        self.num_embeddings_F = np.asarray(
            _resolve_num_embeddings(num_embeddings_per_feature, NUM_SPARSE_FEATURES), dtype=np.int64
        )
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
        self._open()

    def _open(self) -> None:
        import datasets

        # Dataset.from_file memory-maps the file: pages are read on demand, shared between workers.
        self._hf = datasets.Dataset.from_file(self.arrow_path)
        chunks = []
        for rb in self._hf.data.table.to_batches():
            if rb.num_rows == 0:
                continue
            chunks.append(
                (
                    rb.column(0).to_numpy(zero_copy_only=True),
                    rb.column(1).flatten().to_numpy(zero_copy_only=True).reshape(-1, NUM_DENSE_FEATURES),
                    rb.column(2).flatten().to_numpy(zero_copy_only=True).reshape(-1, NUM_SPARSE_FEATURES),
                )
            )
        self._chunks = chunks
        self._starts = np.cumsum([0] + [c[0].shape[0] for c in chunks])

    def __getstate__(self) -> dict:
        # workers reopen the memory map instead of receiving pickled arrays
        state = dict(self.__dict__)
        state["_chunks"] = state["_hf"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _gather(self, idx_B: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(self._chunks) == 1:
            label, dense, sparse = self._chunks[0]
            return label[idx_B], dense[idx_B], sparse[idx_B]
        chunk_B = np.searchsorted(self._starts, idx_B, side="right") - 1
        out = (
            np.empty(idx_B.size, np.float32),
            np.empty((idx_B.size, NUM_DENSE_FEATURES), np.float32),
            np.empty((idx_B.size, NUM_SPARSE_FEATURES), np.int64),
        )
        # a loop over the file's blocks (each ~64 MiB of text), not over rows
        for c in np.unique(chunk_B):
            rows = np.flatnonzero(chunk_B == c)
            local = idx_B[rows] - self._starts[c]
            for dst, src in zip(out, self._chunks[c]):
                dst[rows] = src[local]
        return out

    def __getitems__(self, indices: Sequence[int]) -> Batch:
        idx_B = np.asarray(indices, dtype=np.int64)
        if idx_B.size and (idx_B.min() < 0 or idx_B.max() >= len(self)):
            raise IndexError(f"indices out of range for {len(self)} rows")
        label_B, dense_B13, sparse_BF = self._gather(idx_B)
        return make_criteo_batch(
            label_B, dense_B13, sparse_BF, self.num_embeddings_F, self.keys, self.missing_categorical
        )

    def __getitem__(self, index: int | Sequence[int] | slice) -> Batch:
        """A batch of the given rows (an int gives a batch of one)."""
        if isinstance(index, slice):
            return self.__getitems__(range(len(self))[index])
        if isinstance(index, (int, np.integer)):
            return self.__getitems__([int(index)])
        return self.__getitems__(index)


class CriteoIterableDataset(IterableDataset):
    """Streaming: parse the file block by block while iterating; nothing is cached.

    Blocks (each `block_bytes` of text) are dealt round-robin to (rank, worker) pairs, so every
    row is read by exactly one of them. With `shuffle`, rows are shuffled within each block (and
    the order differs per epoch); the block order stays the file order. Batches never cross a
    block boundary's remainder loss: leftover rows carry into the next block's batches.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        batch_size: int,
        num_embeddings_per_feature: int | Sequence[int],
        sparse_feature_names: Sequence[str] | None = None,
        missing_categorical: str = "reserved_id",
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        on_bad_row: str = "error",
        separator: str | None = None,
        has_header: bool | None = None,
        has_label: bool | None = None,
        block_bytes: int = 16 << 20,
    ) -> None:
        _check_on_bad_row(on_bad_row)
        _check_missing_categorical(missing_categorical)
        if not Path(path).is_file():
            raise ValueError(f"Criteo file {path} does not exist: check train_path / val_path / test_path")
        self.path = str(path)
        self.layout = detect_layout(path, separator, has_header, has_label)
        self.batch_size = batch_size
        self.num_embeddings_F = np.asarray(
            _resolve_num_embeddings(num_embeddings_per_feature, NUM_SPARSE_FEATURES), dtype=np.int64
        )
        self.keys = list(sparse_feature_names or DEFAULT_SPARSE_FEATURE_NAMES)
        self.missing_categorical = missing_categorical
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.on_bad_row, self.block_bytes = on_bad_row, block_bytes
        self._epoch = 0
        # The report of the latest pass made in this process (a worker's own rows, with workers).
        self.report = ParseReport(path=self.path, layout=asdict(self.layout))

    def _shard(self) -> tuple[int, int]:
        rank, world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return rank * num_workers + worker, world * num_workers

    def __iter__(self) -> Iterator[Batch]:
        shard, num_shards = self._shard()
        rng = np.random.default_rng([self.seed, self._epoch, shard])
        self._epoch += 1  # persistent workers and the main process keep counting epochs
        report = ParseReport(path=self.path, layout=asdict(self.layout))
        self.report = report
        pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        num_pending = 0
        blocks = iter_blocks(self.path, self.block_bytes, self.layout.has_header)
        for k, (block, first_line) in enumerate(blocks):
            if k % num_shards != shard:
                continue
            arrays = _parse_block(block, first_line, self.layout, self.path, self.on_bad_row, report)
            if self.shuffle:
                perm = rng.permutation(arrays[0].shape[0])
                arrays = tuple(a[perm] for a in arrays)
            pending.append(arrays)
            num_pending += arrays[0].shape[0]
            if num_pending < self.batch_size:
                continue
            label, dense, sparse = (np.concatenate(parts) for parts in zip(*pending))
            full = (num_pending // self.batch_size) * self.batch_size
            for s in range(0, full, self.batch_size):
                yield self._batch(label[s:s + self.batch_size], dense[s:s + self.batch_size],
                                  sparse[s:s + self.batch_size])
            pending = [(label[full:], dense[full:], sparse[full:])]
            num_pending -= full
        if num_pending and not self.drop_last:
            label, dense, sparse = (np.concatenate(parts) for parts in zip(*pending))
            yield self._batch(label, dense, sparse)
        report.log_skips()

    def _batch(self, label: np.ndarray, dense: np.ndarray, sparse: np.ndarray) -> Batch:
        return make_criteo_batch(
            label, dense, sparse, self.num_embeddings_F, self.keys, self.missing_categorical
        )


def make_batch_loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool,
    drop_last: bool,
    seed: int,
    num_workers: int,
    pin_memory: bool = False,
) -> DataLoader:
    """A DataLoader whose dataset builds whole batches from index lists (`__getitems__`).

    The indices come from a plain `BatchSampler`, which Lightning knows how to rebuild around a
    DistributedSampler under DDP; a `sampler=BatchSampler(...)` with `batch_size=None` would be
    replaced by a per-sample DistributedSampler and break.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if shuffle:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    else:
        sampler = SequentialSampler(dataset)
    return DataLoader(
        dataset,
        batch_sampler=BatchSampler(sampler, batch_size=batch_size, drop_last=drop_last),
        collate_fn=passthrough_collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )


# ----------------------------------------------------------------------------------------------
# LightningDataModule


class CriteoDataModule(pl.LightningDataModule):
    """Criteo click logs (Kaggle CSV, dac train.txt / day files, DeepCTR sample) as `Batch`es.

    Map-style (default): each file is parsed once into a memory-mapped Arrow cache under
    `cache_dir` (`prepare_data`, local rank 0), then read by index; shuffling is exact.
    `streaming=True`: files are parsed while iterating (no cache; for files too big to cache);
    shuffling is within blocks of `block_bytes`. See the module docstring for layouts, missing
    values and bad rows.
    """

    def __init__(
        self,
        train_path: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        predict_path: str | None = None,
        batch_size: int = 2048,
        val_batch_size: int | None = None,
        num_embeddings_per_feature: int | list[int] = 100_000,
        sparse_feature_names: list[str] | None = None,
        missing_categorical: str = "reserved_id",
        cache_dir: str | None = None,
        streaming: bool = False,
        num_workers: int = 0,
        pin_memory: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        on_bad_row: str = "error",
        separator: str | None = None,
        has_header: bool | None = None,
        has_label: bool | None = None,
        block_bytes: int = 64 << 20,
    ) -> None:
        super().__init__()
        _check_on_bad_row(on_bad_row)
        _check_missing_categorical(missing_categorical)
        self.save_hyperparameters()
        self.paths = {
            "train": train_path, "val": val_path, "test": test_path, "predict": predict_path or test_path
        }
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.num_embeddings_per_feature = _resolve_num_embeddings(
            num_embeddings_per_feature, NUM_SPARSE_FEATURES
        )
        self.sparse_feature_names = list(sparse_feature_names or DEFAULT_SPARSE_FEATURE_NAMES)
        if len(self.sparse_feature_names) != NUM_SPARSE_FEATURES:
            raise ValueError(
                f"sparse_feature_names needs {NUM_SPARSE_FEATURES} names, "
                f"got {len(self.sparse_feature_names)}"
            )
        self.num_dense_features = NUM_DENSE_FEATURES
        self.missing_categorical = missing_categorical
        self.cache_dir = cache_dir
        self.streaming = streaming
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.on_bad_row = on_bad_row
        self.layout_args = {"separator": separator, "has_header": has_header, "has_label": has_label}
        self.block_bytes = block_bytes
        self.datasets: dict[str, Dataset] = {}
        self.parse_reports: dict[str, ParseReport] = {}

    @property
    def num_skipped_rows(self) -> int:
        """Bad rows dropped under on_bad_row='skip', over all files parsed so far (map-style)."""
        return sum(r.num_skipped_rows for r in self.parse_reports.values())

    def _cache(self, split: str) -> Path:
        arrow_path, report = build_criteo_cache(
            self.paths[split], self.cache_dir, on_bad_row=self.on_bad_row, block_bytes=self.block_bytes,
            **self.layout_args,
        )
        self.parse_reports[split] = report
        return arrow_path

    def prepare_data(self) -> None:
        if self.streaming:
            return
        for split, path in self.paths.items():
            if path is not None:
                self._cache(split)

    def setup(self, stage: str | None = None) -> None:
        splits = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}
        for split in splits.get(stage, ("train", "val", "test", "predict")) if stage else self.paths:
            if self.paths[split] is None or split in self.datasets:
                continue
            if self.streaming:
                self.datasets[split] = CriteoIterableDataset(
                    self.paths[split], self.batch_size if split == "train" else self.val_batch_size,
                    self.num_embeddings_per_feature, self.sparse_feature_names, self.missing_categorical,
                    shuffle=self.shuffle and split == "train", seed=self.seed,
                    drop_last=self.drop_last and split == "train", on_bad_row=self.on_bad_row,
                    block_bytes=min(self.block_bytes, 16 << 20), **self.layout_args,
                )
            else:
                self.datasets[split] = CriteoDataset(
                    self._cache(split), self.num_embeddings_per_feature, self.sparse_feature_names,
                    self.missing_categorical,
                )

    def _loader(self, split: str) -> DataLoader:
        if self.paths[split] is None:
            raise ValueError(f"CriteoDataModule has no {split}_path: set it to use the {split} loop")
        if split not in self.datasets:
            raise ValueError(f"CriteoDataModule.setup() has not run for {split}: call setup() first")
        dataset = self.datasets[split]
        train = split == "train"
        if isinstance(dataset, IterableDataset):
            return DataLoader(
                dataset, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
                persistent_workers=self.num_workers > 0,
            )
        return make_batch_loader(
            dataset, self.batch_size if train else self.val_batch_size, shuffle=self.shuffle and train,
            drop_last=self.drop_last and train, seed=self.seed, num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader | list:
        # no val_path: an empty list tells Lightning there is no validation loop
        return self._loader("val") if self.paths["val"] is not None else []

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")
