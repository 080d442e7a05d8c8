"""The map-style reader's cache: a file parsed once into a memory-mappable Arrow file of raw values.

    <cache_dir>/<file>-<key>.arrow   label [N] float32 (NaN: no label; label_columns: [N, T], NaN: missing),
                                     dense [N, 13] float32 raw (NaN: missing), sparse [N, 26] int64 raw 32-bit
                                     hash (-1: missing); one record batch per block
    <cache_dir>/<file>-<key>.json    the ParseReport

The key covers the file (path, size, mtime; every file of a table source), the parse options and the parser
version. Raw values are kept, so changing table sizes, the dense transform or the missing-id policy needs no re-parse.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa

from lightning_rec.data.criteo.layout import check_criteo_file
from lightning_rec.data.criteo.native import resolve_parser
from lightning_rec.data.criteo.parse import _PARSER_VERSION, read_criteo
from lightning_rec.data.criteo.report import ParseReport
from lightning_rec.data.criteo.schema import NUM_DENSE_FEATURES, NUM_SPARSE_FEATURES
from lightning_rec.data.criteo.tables import TABLE_SOURCE_VERSION, read_criteo_table, source_files, table_source_kind
from lightning_rec.data.labels import label_specs

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    import datasets.config

    return Path(datasets.config.HF_DATASETS_CACHE) / "lightning_rec" / "criteo"


def cache_features(num_tasks: int = 0):
    """The cache's columns, as `datasets` types (label [N, T] of `num_tasks` tasks, 0: one click label [N])."""
    from datasets import Features, List, Value

    return Features(
        {
            "label": List(Value("float32"), length=num_tasks) if num_tasks else Value("float32"),
            "dense": List(Value("float32"), length=NUM_DENSE_FEATURES),
            "sparse": List(Value("int64"), length=NUM_SPARSE_FEATURES),
        }
    )


def _writer_tag() -> str:
    """Who writes a temporary cache file: "<host>~<pid>" (a host name holds no "~"; dots are kept)."""
    return f"{socket.gethostname().replace('~', '-')}~{os.getpid()}"


_LEGACY_TMP_AGE_S = 24 * 3600  # "<pid>" names (no host) written before the host was part of the name


def _remove_abandoned_tmp(cache_dir: Path, prefix: str) -> None:
    """Remove `<prefix><host>~<pid>.<uuid>.tmp` files that a killed build left (hidden, GBs each, never reused).

    Only those provably abandoned: written on this host by a process that no longer runs (after a minute's grace), or,
    for names without a host, by a dead pid and untouched for a day."""
    host, now = socket.gethostname().replace("~", "-"), time.time()
    for tmp in cache_dir.glob(f"{glob.escape(prefix)}*.tmp"):
        writer = tmp.name[len(prefix):].split(".")
        if len(writer) < 3:
            continue
        tag = ".".join(writer[:-2])  # the host may hold dots
        name_host, _, pid = tag.rpartition("~")
        if not pid.isdigit() or (name_host and name_host != host) or _pid_alive(int(pid)):
            continue
        try:
            age = now - tmp.stat().st_mtime
            if age > (60 if name_host else _LEGACY_TMP_AGE_S):
                tmp.unlink()
                log.info("removed %s, left by a cache build that was killed (pid %s)", tmp, pid)
        except FileNotFoundError:  # another rank removed it first
            pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # alive, another user's; or no way to tell: keep the file
        return True
    return True


def _cache_key(path: Path, table_source: bool, separator, has_header, has_label, on_bad_row: str, parser: str,
               labels: list | None = None) -> str:
    if table_source:  # Parquet / a saved `datasets` folder: every file it reads is in the key
        files = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in source_files(path)]
        key_src = json.dumps([str(path.resolve()), files, "table", TABLE_SOURCE_VERSION, has_label, on_bad_row]
                             + ([labels] if labels else []))
    else:
        check_criteo_file(path)
        resolve_parser(parser)
        stat = path.stat()
        key_src = json.dumps(
            [str(path.resolve()), stat.st_size, stat.st_mtime_ns, _PARSER_VERSION,
             separator, has_header, has_label, on_bad_row] + ([labels] if labels else [])
        )
    return hashlib.sha256(key_src.encode()).hexdigest()[:16]


def build_criteo_cache(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                       separator: str | None = None, has_header: bool | None = None, has_label: bool | None = None,
                       on_bad_row: str = "error", block_bytes: int = 64 << 20, parser: str = "auto",
                       label_columns: list[str] | dict[str, str] | None = None,
                       label_masks: dict[str, str] | None = None) -> tuple[Path, ParseReport]:
    """Parse `path` once into a memory-mappable Arrow file; later calls find it and return at once.
    `label_columns` / `label_masks`: several labels (lightning_rec.data.labels), the label column [N, T].

    It is written under a temporary name and renamed: ranks that build it at once never read a half-written file."""
    path = Path(path)
    table_source = table_source_kind(path) is not None
    specs = label_specs(label_columns, label_masks) if label_columns is not None else []
    key = _cache_key(path, table_source, separator, has_header, has_label, on_bad_row, parser,
                     [asdict(s) for s in specs])
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    stem = "".join("_" if c in "*?[]" else c for c in path.name)  # a pattern's name: train-_.parquet
    arrow_path = cache_dir / f"{stem}-{key}.arrow"
    meta_path = cache_dir / f"{stem}-{key}.json"
    if arrow_path.is_file() and meta_path.is_file():
        return arrow_path, ParseReport.from_json(meta_path.read_text())

    _remove_abandoned_tmp(cache_dir, f".{arrow_path.name}.")
    _remove_abandoned_tmp(cache_dir, f"{meta_path.name}.")
    tables = (read_criteo_table(path, has_label, on_bad_row, label_specs=specs) if table_source else
              read_criteo(path, separator, has_header, has_label, on_bad_row, block_bytes, parser, label_columns,
                          label_masks))
    report = _write_arrow(tables, arrow_path, ParseReport(path=str(path)), len(specs))
    meta_tmp = meta_path.with_name(meta_path.name + f".{_writer_tag()}.{uuid.uuid4().hex[:8]}.tmp")
    meta_tmp.write_text(json.dumps(asdict(report)))
    os.replace(meta_tmp, meta_path)
    report.log_skips()
    return arrow_path, report


def _write_arrow(tables: Iterator[tuple[pa.Table, ParseReport]], arrow_path: Path, report: ParseReport,
                 num_tasks: int = 0) -> ParseReport:
    """Write the parsed tables under a temporary name, then rename it to `arrow_path`; the last report."""
    from datasets.arrow_writer import ArrowWriter

    tmp = arrow_path.with_name(f".{arrow_path.name}.{_writer_tag()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with ArrowWriter(features=cache_features(num_tasks), path=str(tmp)) as writer:
            for table, block_report in tables:
                report = block_report
                if table.num_rows:
                    # one record batch per parsed block: few chunks, so a batch gather loops over few
                    writer.write_table(table, writer_batch_size=max(table.num_rows, 1))
            writer.finalize()
        if report.num_rows == 0:
            raise ValueError(f"{report.path} has no data rows ({report.num_skipped_rows} bad rows skipped, "
                             f"{report.num_blank_lines} blank lines): expected Criteo rows (label, I1..I13, C1..C26)")
        os.replace(tmp, arrow_path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return report
