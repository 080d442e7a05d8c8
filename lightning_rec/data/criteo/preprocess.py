"""`lightning-rec preprocess`: Criteo text (or tables) -> memory-mapped .npy shards, in bounded memory, resumable
(docs/criteo.md#the-full-kaggle-set-and-the-criteo-1tb-logs).

Shapes: n rows of a shard, F = 26 sparse features, 13 dense features.

    text --(blocks of --block_mb, cut at newlines)--> torch.ops.lightning_rec.parse_criteo
         (ids hashed into the tables, log(1 + max(x, 0)) dense, all in the op) --> rows of a shard
    --(>= --rows_per_shard rows: shuffled within the shard, seeded)--> <shard>.{label,dense,sparse}.npy
         (--label_columns: label [n, T], the tasks' labels as the readers derive them; shard format /2)
    --> <shard>.json (rows, sha256 of each file, the input byte range it came from)
    --> manifest.json when every input is done (CriteoDataModule reads the directory through it)

A table input is read in blocks of rows, its records' byte_start / byte_end counting blocks. A shard's files are
written under temporary names and renamed, its .json record last; the shard boundaries depend only on the input
bytes and --block_mb / --rows_per_shard, so a resumed run writes the same shards."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from lightning_rec.data.criteo.blocks import iter_line_blocks
from lightning_rec.data.criteo.layout import CriteoLayout, check_criteo_file, detect_layout
from lightning_rec.data.criteo.native import HASH_EMPTY_BAG, HASH_RESERVED_ID, parse_block_native, resolve_parser
from lightning_rec.data.criteo.report import ParseReport
from lightning_rec.data.criteo.schema import MISSING_CATEGORICAL, NUM_SPARSE_FEATURES, table_ids
from lightning_rec.data.criteo.shards import (
    ARRAYS,
    MANIFEST,
    SHARD_FORMAT,
    SHARD_FORMAT_TASKS,
    file_sha256,
    shard_files,
    verify_shard,
)
from lightning_rec.data.criteo.tables import TableBlocks, source_files, table_source_kind
from lightning_rec.data.labels import label_specs

log = logging.getLogger(__name__)
_INT32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------------------------
# options, vocabulary


def _resolve_sizes(num_embeddings: int | Sequence[int]) -> list[int]:
    sizes = [int(num_embeddings)] * NUM_SPARSE_FEATURES if isinstance(num_embeddings, int) else [
        int(n) for n in num_embeddings
    ]
    if len(sizes) != NUM_SPARSE_FEATURES:
        raise ValueError(f"--num_embeddings needs one int or {NUM_SPARSE_FEATURES} ints, got {len(sizes)}")
    if min(sizes) < 2 or max(sizes) > _INT32_MAX:
        raise ValueError(f"--num_embeddings must be within [2, 2^31 - 1] (ids are stored as int32), got {sizes}")
    return sizes


class _Vocabulary:
    """Per feature: hashed id -> kept id (0 for rare ids and missing values), from counted occurrences."""

    def __init__(self, sizes: Sequence[int], min_frequency: int) -> None:
        self.sizes, self.min_frequency = list(sizes), min_frequency
        self.counts = [torch.zeros(n, dtype=torch.int32) for n in sizes]
        self._since_clamp = 0

    def count(self, sparse_NF: np.ndarray) -> None:
        ids_FN = torch.from_numpy(sparse_NF).t()
        for f, counts in enumerate(self.counts):
            ids = ids_FN[f]
            ids = ids[ids >= 0]
            counts.index_add_(0, ids, torch.ones(ids.numel(), dtype=torch.int32))
        self._since_clamp += sparse_NF.shape[0]
        if self._since_clamp > 2**30:  # int32 counts: clamp long before a bucket could wrap
            for counts in self.counts:
                counts.clamp_(max=2**30)
            self._since_clamp = 0

    def finish(self) -> list[np.ndarray]:
        remaps = []
        for counts in self.counts:
            keep = counts >= self.min_frequency
            remap = torch.where(keep, torch.cumsum(keep, 0, dtype=torch.int32), 0).to(torch.int32)
            remaps.append(remap.numpy())
        self.counts = []
        return remaps


def _save_vocab(directory: Path, remaps: list[np.ndarray]) -> None:
    tmp = directory / "vocab.npz.tmp.npz"
    np.savez(tmp, **{f"C{j + 1}": r for j, r in enumerate(remaps)})
    os.replace(tmp, directory / "vocab.npz")


def _load_vocab(path: Path, sizes: Sequence[int]) -> list[np.ndarray]:
    with np.load(path) as z:
        remaps = [z[f"C{j + 1}"] for j in range(NUM_SPARSE_FEATURES)]
    got = [r.shape[0] for r in remaps]
    if got != list(sizes):
        raise ValueError(
            f"{path} was counted with --num_embeddings {got}, this run asks for {list(sizes)}: use the same"
        )
    return remaps


# ----------------------------------------------------------------------------------------------
# the run


@dataclass
class _Run:
    """What every input of one run is cut into shards with."""

    out: Path
    sizes: list[int]
    missing_categorical: str
    rows_per_shard: int
    seed: int
    shuffle_rows: bool
    on_bad_row: str
    block_bytes: int
    remaps: list[np.ndarray] | None = None  # --min_frequency / --vocab_from: hashed id -> kept id, per feature
    tasks: int = 0  # --label_columns: the label columns of a shard (0: one label [n])


def preprocess_criteo(inputs: Sequence[str | os.PathLike], output_dir: str | os.PathLike,
                      num_embeddings: int | Sequence[int] = 40_000_000, min_frequency: int = 0,
                      vocab_from: str | os.PathLike | None = None, missing_categorical: str = "reserved_id",
                      rows_per_shard: int = 1_000_000, block_mb: int = 8, shuffle_rows: bool | None = None,
                      seed: int = 0, on_bad_row: str = "error", separator: str | None = None,
                      has_header: bool | None = None, has_label: bool | None = None, verify: bool = True,
                      progress: bool = True, label_columns: list[str] | dict[str, str] | None = None,
                      label_masks: dict[str, str] | None = None) -> dict:
    """Convert Criteo text files (or tables) into a shard directory; returns the manifest. `label_columns` /
    `label_masks` (lightning_rec.data.labels): several labels, stored [n, T] by task."""
    _check_arguments(inputs, missing_categorical, on_bad_row, rows_per_shard, block_mb, min_frequency, vocab_from)
    specs = label_specs(label_columns, label_masks, "--label_columns") if label_columns is not None else []
    inputs = [str(p) for p in inputs]
    block_bytes = block_mb << 20
    # a table input (Parquet, a save_to_disk folder) is read in blocks of rows, about block_bytes of them
    tables = [TableBlocks(p, has_label, block_bytes // 256, specs) if table_source_kind(p) else None for p in inputs]
    if any(t is None for t in tables):
        resolve_parser("native")  # the op does the hashing; without it this would take days on the 1TB logs
    sizes = _resolve_sizes(num_embeddings)
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"--output_dir {out}: {'it' if out.is_file() else 'a folder above it'} is a file: give a "
                         f"directory (a new one, or an earlier run's to resume it)") from None
    layouts = [detect_layout(p, separator, has_header, has_label, specs) if t is None else None
               for p, t in zip(inputs, tables)]
    labelled = _labelled(inputs, layouts, tables)
    if shuffle_rows is None:
        # shuffling serves training; rows without labels are for predict, whose output follows the input order
        shuffle_rows = labelled
    options = dict(
        num_embeddings=sizes, min_frequency=min_frequency, vocab_from=str(vocab_from) if vocab_from else None,
        missing_categorical=missing_categorical, rows_per_shard=rows_per_shard, block_mb=block_mb,
        shuffle_rows=shuffle_rows, seed=seed, on_bad_row=on_bad_row,
    )
    if specs:  # (only then: a one-label run begun before these options existed resumes as the same run)
        options.update(json.loads(json.dumps(dict(label_columns=label_columns, label_masks=label_masks))))
    if vocab_from is not None:
        # the vocabulary itself, not only where it was (it may be rewritten there)
        options["vocab_sha256"] = file_sha256(Path(vocab_from) / "vocab.npz")
    sources = [_source(p, t) for p, t in zip(inputs, tables)]
    _check_same_run(out, options, sources)
    run = _Run(out, sizes, missing_categorical, rows_per_shard, seed, shuffle_rows, on_bad_row, block_bytes,
               tasks=len(specs))
    run.remaps = _remaps(run, inputs, layouts, tables, min_frequency, vocab_from, progress)
    shards, reports = _write_inputs(run, inputs, layouts, tables, sources, verify, progress)
    tasks = dict(task_names=[s.task for s in specs], labels=[asdict(s) for s in specs]) if specs else {}
    manifest = dict(format=SHARD_FORMAT_TASKS if specs else SHARD_FORMAT, **tasks, inputs=sources, options=options,
                    has_label=labelled,
                    missing_categorical=missing_categorical,
                    num_embeddings_per_feature=sizes if run.remaps is None else [int(r.max()) + 1 for r in run.remaps],
                    num_rows=int(sum(s["rows"] for s in shards)), shards=shards, reports=reports)
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST)
    return manifest


def _check_arguments(inputs: Sequence[str | os.PathLike], missing_categorical: str, on_bad_row: str,
                     rows_per_shard: int, block_mb: int, min_frequency: int, vocab_from) -> None:
    if not inputs:
        raise ValueError("--input needs at least one Criteo file (day_0 ... day_23, train.txt, train.csv)")
    for p in inputs:
        if not table_source_kind(p):
            check_criteo_file(p, "input", fix="check --input (a Criteo file: day_0.gz, train.txt, ...; or a table: "
                                              "a .parquet file, a folder or pattern of them, a save_to_disk folder)")
    if missing_categorical not in MISSING_CATEGORICAL:
        raise ValueError(f"--missing_categorical must be one of {MISSING_CATEGORICAL}, got {missing_categorical!r}")
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"--on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if rows_per_shard < 1 or block_mb < 1:
        raise ValueError(f"--rows_per_shard and --block_mb must be >= 1, got {rows_per_shard} and {block_mb}")
    if min_frequency < 0:
        raise ValueError(f"--min_frequency must be >= 0 (0: no threshold), got {min_frequency}")
    if vocab_from is not None and not (Path(vocab_from) / "vocab.npz").is_file():
        raise ValueError(f"--vocab_from {vocab_from} has no vocab.npz: point it at the --output_dir of the train "
                         f"split's preprocess run (which writes it when --min_frequency is set)")
    if (min_frequency or vocab_from) and missing_categorical != "reserved_id":
        raise ValueError("--min_frequency / --vocab_from map rare ids to id 0 with the missing values: "
                         "they need --missing_categorical reserved_id")


def _labelled(inputs: list[str], layouts: list[CriteoLayout | None], tables: list[TableBlocks | None]) -> bool:
    """Whether the inputs have a label column (all of them, or none)."""
    labelled = {lay.has_label if t is None else bool(t.specs) or t.columns["label"] is not None
                for lay, t in zip(layouts, tables)}
    if len(labelled) > 1:
        raise ValueError(f"some inputs have a label column and some do not ({inputs}): preprocess them separately")
    return labelled.pop()


def _remaps(run: _Run, inputs, layouts, tables, min_frequency: int, vocab_from, progress: bool
            ) -> list[np.ndarray] | None:
    """The vocabulary of --vocab_from, or of --min_frequency (counted once, kept in vocab.npz); None without."""
    if vocab_from is not None:
        return _load_vocab(Path(vocab_from) / "vocab.npz", run.sizes)
    if not min_frequency:
        return None
    if (run.out / "vocab.npz").is_file():
        return _load_vocab(run.out / "vocab.npz", run.sizes)
    remaps = _count_vocabulary(run, inputs, layouts, tables, min_frequency, progress)
    _save_vocab(run.out, remaps)
    return remaps


def _write_inputs(run: _Run, inputs, layouts, tables, sources: list[dict], verify: bool, progress: bool
                  ) -> tuple[list[dict], list[dict]]:
    """Every input's shards (those a run before verified as done, then the new ones) and its report."""
    shards: list[dict] = []
    reports: list[dict] = []
    bar = _Progress(sum(s["size"] for s in sources), "preprocess", progress)
    offsets = np.cumsum([0] + [s["size"] for s in sources])
    for idx, (path, layout, table) in enumerate(zip(inputs, layouts, tables)):
        done = _resume(run.out, idx, verify)
        shards += done
        report = ParseReport(path=path, layout=asdict(layout) if layout is not None else table.layout)
        advance = bar.raw_progress(int(offsets[idx]))
        if done:
            for key, value in done[-1]["report"].items():  # counts so far: the report covers the whole input
                setattr(report, key, value)
            log.info("%s: %d shards (%d rows) already done, resuming after byte %s", path, len(done),
                     sum(r["rows"] for r in done), done[-1]["byte_end"])
            if done[-1]["byte_end"] is None:  # this input was finished
                advance(sources[idx]["size"])
                reports.append(asdict(report))
                continue
        if table is not None:
            shards += _table_shards(run, idx, table, done, report, advance, sources[idx]["size"], bar)
        else:
            shards += _text_shards(run, idx, path, layout, done, report, advance, bar)
        report.log_skips()
        reports.append(asdict(report))
    bar.close()
    return shards, reports


def _check_same_run(out: Path, options: dict, sources: list[dict]) -> None:
    """A directory holds one run: resuming with other inputs or options would mix rows."""
    run = out / "run.json"
    this = dict(options=options, inputs=sources)
    if run.is_file():
        before = json.loads(run.read_text())
        if before != this:
            differ = ["--vocab_from's vocab.npz" if k == "vocab_sha256" else f"--{k}"
                      for k in sorted(set(options) | set(before.get("options", {})))
                      if before.get("options", {}).get(k) != options.get(k)]
            if before.get("inputs") != sources:
                differ.insert(0, "--input (files, sizes or times)")
            raise ValueError(
                f"{out} holds a preprocess run with other inputs or options ({', '.join(differ)} differ; {run}): "
                f"pass a new --output_dir, or delete {out} to start over"
            )
        (out / MANIFEST).unlink(missing_ok=True)  # rewritten when this run finishes
        return
    if any(out.iterdir()):
        raise ValueError(f"--output_dir {out} is not empty and holds no preprocess run: pass an empty or new directory")
    run.write_text(json.dumps(this, indent=1))


def _resume(out: Path, idx: int, verify: bool) -> list[dict]:
    """The verified shards of input `idx` from an earlier run; everything after the first bad one is deleted."""
    records = []
    for p in sorted(out.glob(f"shard-{idx:03d}-*.json")):
        records.append(json.loads(p.read_text()))
    good: list[dict] = []
    for r in records:
        problem = verify_shard(out, r, checksum=verify) if len(good) == r["index"] else "a shard before it is missing"
        if problem is not None or (good and good[-1]["byte_end"] is None):
            log.warning("%s: redoing shard %s and the ones after it (%s)", out, r["name"], problem)
            break
        good.append(r)
    keep = {r["name"] for r in good}
    for p in out.glob(f"shard-{idx:03d}-*"):
        if p.name.split(".")[0] not in keep:
            p.unlink()
    return good


def _parse(block, first_line: int, layout: CriteoLayout, path: str, report: ParseReport, run: _Run,
           lines: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A text block -> label, log(1 + max(x, 0)) dense and int32 table ids (through the vocabulary, if any)."""
    if run.remaps is None:
        mode = HASH_RESERVED_ID if run.missing_categorical == "reserved_id" else HASH_EMPTY_BAG
        label, dense, sparse = parse_block_native(block, first_line, layout, path, run.on_bad_row, report,
                                                  hash_mode=mode, num_embeddings=run.sizes, log_dense=True,
                                                  lines_out=lines)
        return label, dense, sparse.astype(np.int32)
    label, dense, hashed = parse_block_native(block, first_line, layout, path, run.on_bad_row, report,
                                              hash_mode=HASH_EMPTY_BAG, num_embeddings=run.sizes, log_dense=True,
                                              lines_out=lines)
    ids = np.zeros(hashed.shape, dtype=np.int32)
    for f, remap in enumerate(run.remaps):  # a loop over 26 features, each a vectorised gather
        col = hashed[:, f]
        present = col >= 0
        ids[present, f] = remap[col[present]]
    return label, dense, ids


def _source(path: str, table: TableBlocks | None) -> dict:
    """What run.json records of an input, so that a resumed run knows it is the same one."""
    if table is None:
        return dict(path=str(Path(path).resolve()), size=os.path.getsize(path), mtime_ns=os.stat(path).st_mtime_ns)
    files = source_files(path)
    return dict(path=str(Path(path).resolve()), size=sum(f.stat().st_size for f in files),
                mtime_ns=max(f.stat().st_mtime_ns for f in files), files=len(files), rows=table.num_rows)


def _hashed(sparse_raw: np.ndarray, sizes: Sequence[int], remaps, missing_categorical: str) -> np.ndarray:
    """Raw 32-bit ids [n, F] (-1: missing) -> table ids int32, as the native op hashes text (`table_ids`), or
    through the vocabulary of --min_frequency (0: rare or missing)."""
    mod_1F = np.asarray(sizes, dtype=np.int64)[None, :]
    if remaps is None:
        return table_ids(sparse_raw, mod_1F, missing_categorical).astype(np.int32)
    hashed = table_ids(sparse_raw, mod_1F, "empty_bag")
    ids = np.zeros(hashed.shape, dtype=np.int32)
    for f, remap in enumerate(remaps):
        present = hashed[:, f] >= 0
        ids[present, f] = remap[hashed[present, f]]
    return ids


def _text_shards(run: _Run, idx: int, path: str, layout: CriteoLayout, done: list[dict], report: ParseReport,
                 progress, bar: _Progress) -> list[dict]:
    """A text input's shards, from where the good shards of an earlier run ended (byte_end, line_end)."""
    start_byte = done[-1]["byte_end"] if done else 0
    start_line = done[-1]["line_end"] if done else 1
    if start_byte == 0 and layout.has_header:
        start_line = 2
    k, shards, pending, pending_rows = len(done), [], [], 0
    shard_start, shard_line = start_byte, start_line
    lines = [start_line]
    for block, byte_end in iter_line_blocks(path, run.block_bytes, layout.has_header, start_byte, progress):
        label, dense, sparse = _parse(block, lines[0], layout, path, report, run, lines)
        bar.rows(label.shape[0])
        pending.append((label, dense, sparse))
        pending_rows += label.shape[0]
        if pending_rows >= run.rows_per_shard:  # lines[0]: the next block's first line
            shards.append(_write_shard(run, idx, k, pending,
                                       (shard_start, byte_end), (shard_line, lines[0]), report))
            k, pending, pending_rows, shard_start, shard_line = k + 1, [], 0, byte_end, lines[0]
    if pending_rows or (k == 0 and not done):
        shards.append(_write_shard(run, idx, k, pending, (shard_start, None),
                                   (shard_line, None), report))
    return shards


def _table_shards(run: _Run, idx: int, table: TableBlocks, done: list[dict], report: ParseReport, progress,
                  size: int, bar: _Progress) -> list[dict]:
    """A table input's shards; its records' byte_start / byte_end count the table's blocks (line_*: its rows)."""
    start = done[-1]["byte_end"] if done else 0
    k, shards, pending, pending_rows, shard_start = len(done), [], [], 0, start
    for b in range(start, table.num_blocks):
        label, dense_raw, sparse_raw = table.read(b, run.on_bad_row, report)
        dense = np.log1p(np.fmax(dense_raw, 0.0)).astype(np.float32)  # as the op's log_dense
        pending.append((label, dense, _hashed(sparse_raw, run.sizes, run.remaps, run.missing_categorical)))
        pending_rows += label.shape[0]
        bar.rows(label.shape[0])
        progress(size * (b + 1) // max(table.num_blocks, 1))
        if pending_rows >= run.rows_per_shard:
            shards.append(_write_shard(run, idx, k, pending, (shard_start, b + 1),
                                       (shard_start * table.block_rows, (b + 1) * table.block_rows), report))
            k, pending, pending_rows, shard_start = k + 1, [], 0, b + 1
    if pending_rows or (k == 0 and not done):
        shards.append(_write_shard(run, idx, k, pending, (shard_start, None),
                                   (shard_start * table.block_rows, None), report))
    return shards


def _count_vocabulary(run: _Run, inputs, layouts, tables, min_frequency: int, progress: bool) -> list[np.ndarray]:
    vocab = _Vocabulary(run.sizes, min_frequency)
    sizes_b = [_source(p, t)["size"] for p, t in zip(inputs, tables)]
    bar = _Progress(sum(sizes_b), "count ids", progress)
    for idx, (path, layout) in enumerate(zip(inputs, layouts)):
        report = ParseReport(path=path)
        if tables[idx] is not None:
            for b in range(tables[idx].num_blocks):
                raw = tables[idx].read(b, run.on_bad_row, report)[2]
                vocab.count(table_ids(raw, np.asarray(run.sizes, dtype=np.int64)[None, :], "empty_bag"))
                bar.rows(raw.shape[0])
                bar.raw_progress(sum(sizes_b[:idx]))(sizes_b[idx] * (b + 1) // tables[idx].num_blocks)
            continue
        lines = [2 if layout.has_header else 1]
        for block, _ in iter_line_blocks(path, run.block_bytes, layout.has_header, 0,
                                         bar.raw_progress(sum(sizes_b[:idx]))):
            _, _, hashed = parse_block_native(block, lines[0], layout, path, run.on_bad_row, report,
                                              hash_mode=HASH_EMPTY_BAG, num_embeddings=run.sizes, lines_out=lines)
            vocab.count(hashed)
            bar.rows(hashed.shape[0])
    bar.close()
    return vocab.finish()


def _write_shard(run: _Run, idx: int, k: int, parts, byte_range, line_range, report: ParseReport) -> dict:
    name, out = f"shard-{idx:03d}-{k:05d}", run.out
    if parts:
        arrays = [np.concatenate(a) if len(a) > 1 else a[0] for a in zip(*parts)]
    else:
        arrays = [np.zeros((0,) if c is None else (0, c), d) for d, c in ARRAYS.values()]
        arrays[0] = arrays[0].reshape(0, run.tasks) if run.tasks else arrays[0]
    if run.shuffle_rows and arrays[0].shape[0] > 1:
        perm = np.random.default_rng([run.seed, idx, k]).permutation(arrays[0].shape[0])
        arrays = [a[perm] for a in arrays]
    record = dict(name=name, input=idx, index=k, rows=int(arrays[0].shape[0]), byte_start=byte_range[0],
                  byte_end=byte_range[1], line_start=line_range[0], line_end=line_range[1], sha256={},
                  report=dict(num_rows=report.num_rows, num_padded_rows=report.num_padded_rows,
                              num_skipped_rows=report.num_skipped_rows, num_blank_lines=report.num_blank_lines,
                              skipped=report.skipped))
    if run.tasks:
        record["tasks"] = run.tasks
    for (array_name, path), arr in zip(shard_files(out, name).items(), arrays):
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(arr, dtype=ARRAYS[array_name][0]))
        record["sha256"][array_name] = file_sha256(tmp)
        os.replace(tmp, path)
    tmp = out / f"{name}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / f"{name}.json")  # the record last: a shard without one is redone
    return record


class _Progress:
    """A tqdm bar over the inputs' bytes (rate and ETA) with rows and rows/s; silent when progress=False."""

    def __init__(self, total_bytes: int, what: str, enabled: bool) -> None:
        self._bar = None
        self._rows = 0
        self._t0 = time.perf_counter()
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=what,
                             smoothing=0.1)

    def raw_progress(self, offset: int):
        """progress(bytes of this input read so far), for an input starting `offset` bytes into the total."""

        def update(raw_pos: int) -> None:
            if self._bar is not None:
                self._bar.n = offset + raw_pos
                rate = self._rows / max(time.perf_counter() - self._t0, 1e-9)
                self._bar.set_postfix_str(f"{self._rows:,} rows, {rate:,.0f} rows/s", refresh=False)
                self._bar.refresh()

        return update

    def rows(self, n: int) -> None:
        self._rows += n

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
