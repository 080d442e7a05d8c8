"""Criteo ingest: raw text -> training arrays (native op vs pyarrow + numpy vs `datasets` csv), and shards -> batches.

    flock /tmp/lightning_rec_bench.lock python benchmarks/criteo_ingest.py [--size 4GB] [--threads 2] [--rounds 3]

What it measures, on a Criteo-format text file that it generates (tab layout, label + I1..I13 + C1..C26,
the per-column missing rates, count distributions and id frequencies of ../shared/data's samples when
present; cached under --dir and reused):

    native      torch.ops.lightning_rec.parse_criteo over 8 MiB blocks: labels, log(1 + max(x, 0)) dense,
                ids hashed into tables (reserved id 0 + modulo): the arrays a training batch needs
    pyarrow     the reference parser (numpy line bookkeeping + Arrow's CSV reader + a vectorised hex decode)
                + the numpy hashing and log of make_criteo_batch: the same arrays
    datasets    `datasets.load_dataset("csv", ...)` + a batched `.map` hashing the hex strings with int(x, 16):
                what a user of Hugging Face datasets writes (on a --baseline_mb prefix: it is slow)

Each variant runs in its own process (its peak RSS is its own); native and pyarrow alternate over
--rounds on a --prefix_mb prefix and the medians count; native then parses the whole file once (the
headline rows/s and peak RSS) and a 1/8 prefix (peak RSS must not grow with the file).
Then: `lightning-rec preprocess` of the prefix (rows/s, peak RSS), reading its shards into training
batches (rows/s; 0 and 2 workers) against the one-process CPU DLRM step rate of
benchmarks/dlrm_distributed.py (same model, batch 2048, 2 threads, measured here), and the shard
format choice: the same rows as .npy (mmap) vs Arrow IPC (datasets' cache) vs parquet, read as batches.
Last line: {"benchmark": "criteo_ingest", ..., "figures": {"native_rows_per_s", "peak_rss_mb_4gb", ...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "criteo" / "criteo_kaggle_train_sample.tsv"
NUM_EMBEDDINGS = 40_000_000  # TorchRec's 1TB table size; the modulo costs the same for any size
GPU_SAMPLES_PER_S = (1.6e6, 2.4e6)  # DLRM step rates measured on an H100 (benchmarks/dlrm_gpu.py), for the report line


def peak_rss_mb() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child
    would report its parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------------------------
# the generated file


def _column_models(rng):
    """Per column: a sampler of text values with the samples' statistics (or Criteo-like defaults)."""
    if SHARED.is_file():
        rows = [ln.rstrip("\n").split("\t") for ln in SHARED.read_text().splitlines()]
        cols = list(zip(*[r + [""] * (40 - len(r)) for r in rows]))
    else:  # no shared data: log-normal counts, power-law ids, 20% / 10% missing
        n = 4000
        cols = [tuple(str(int(v)) for v in rng.integers(0, 2, n))]
        cols += [tuple("" if rng.random() < 0.2 else str(int(np.exp(rng.normal(1, 1.5)))) for _ in range(n))
                 for _ in range(13)]
        cols += [tuple("" if rng.random() < 0.1 else f"{int(v):08x}" for v in rng.zipf(1.3, n) * 2654435761 % 2**32)
                 for _ in range(26)]
    models = []
    for j, col in enumerate(cols):
        values = np.array(col, dtype=object)
        if j >= 14:  # ids: the sample's values by frequency, plus fresh ids at the sample's rate of new values
            uniq = len(set(col)) / len(col)
            models.append(("sparse", values, uniq))
        else:
            models.append(("plain", values, 0.0))
    return models


def _block_text(models, rng, rows: int) -> bytes:
    cols = []
    for kind, values, fresh in models:
        picked = values[rng.integers(0, len(values), rows)]
        if kind == "sparse":
            new = rng.random(rows) < fresh * 0.5
            new &= picked != ""
            picked[new] = [f"{int(v):08x}" for v in rng.integers(0, 2**32, int(new.sum()))]
        cols.append(picked)
    lines = ["\t".join(r) for r in zip(*cols)]
    return ("\n".join(lines) + "\n").encode()


def _have(path: Path, size: int) -> bool:
    """A generated file of about `size` bytes is there (the last line is never cut, so a little less)."""
    return path.is_file() and path.stat().st_size >= size - (1 << 20)


def generate(path: Path, size: int, seed: int = 0) -> Path:
    if _have(path, size):
        return path
    rng = np.random.default_rng(seed)
    models = _column_models(rng)
    block_rows = min(100_000, max(1000, size // (8 * 220)))  # ~220 bytes a row; a small file: small blocks
    blocks = [_block_text(models, rng, block_rows) for _ in range(8)]  # ~22 MB each at most, cycled with a shift
    tmp = path.with_suffix(".tmp")
    written, k = 0, 0
    with open(tmp, "wb") as f:
        while written < size:
            b = blocks[k % len(blocks)]
            cut = b.index(b"\n", (k * 7919) % (len(b) // 2)) + 1  # rotate the block so no two copies align
            piece = b[cut:] + b[:cut]
            piece = piece[: size - written]
            if len(piece) < len(b):
                piece = piece[: piece.rfind(b"\n") + 1] or b""
                if not piece:
                    break
            f.write(piece)
            written += len(piece)
            k += 1
    os.replace(tmp, path)
    return path


def prefix_file(src: Path, mb: int) -> Path:
    dst = src.with_name(f"{src.stem}.prefix{mb}mb.tsv")
    if not dst.is_file():
        with open(src, "rb") as f:
            data = f.read(mb << 20)
        dst.write_bytes(data[: data.rfind(b"\n") + 1])
    return dst


# ----------------------------------------------------------------------------------------------
# variants (each in its own process)


def run_native(path: str) -> dict:
    from lightning_rec.data.criteo_parse import (
        HASH_RESERVED_ID,
        ParseReport,
        detect_layout,
        iter_line_blocks,
        parse_block_native,
    )

    layout = detect_layout(path)
    report = ParseReport(path=path)
    sizes = [NUM_EMBEDDINGS] * 26
    t0 = time.perf_counter()
    rows, lines = 0, [1]
    for block, _ in iter_line_blocks(path, 8 << 20, layout.has_header):  # 8 MiB: outputs reuse heap memory
        label, dense, ids = parse_block_native(block, lines[0], layout, path, "error", report, lines_out=lines,
                                               hash_mode=HASH_RESERVED_ID, num_embeddings=sizes, log_dense=True)
        rows += label.shape[0]
    return dict(rows=rows, seconds=time.perf_counter() - t0)


def run_pyarrow(path: str) -> dict:
    from lightning_rec.data.criteo_parse import ParseReport, _parse_block, detect_layout, iter_blocks

    layout = detect_layout(path)
    report = ParseReport(path=path)
    mod_F1 = np.full((26, 1), NUM_EMBEDDINGS, dtype=np.int64)
    t0 = time.perf_counter()
    rows = 0
    for block, first in iter_blocks(path, 32 << 20, layout.has_header):
        label, dense_raw, sparse_raw = _parse_block(block, first, layout, path, "error", report)
        # the arrays make_criteo_batch builds from the raw values
        np.log1p(np.fmax(dense_raw, 0.0)).astype(np.float32, copy=False)
        sparse_FN = sparse_raw.T
        np.where(sparse_FN >= 0, sparse_FN % (mod_F1 - 1) + 1, 0)
        rows += label.shape[0]
    return dict(rows=rows, seconds=time.perf_counter() - t0)


def run_datasets(path: str, cache_dir: str) -> dict:
    import shutil

    import datasets

    datasets.disable_progress_bars()
    shutil.rmtree(cache_dir, ignore_errors=True)  # a cached build or map would be timed as free
    names = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    t0 = time.perf_counter()
    ds = datasets.load_dataset("csv", data_files=path, delimiter="\t", header=None, column_names=names,
                               cache_dir=cache_dir, split="train",
                               features=datasets.Features({n: datasets.Value("string" if n[0] == "C" else "float64")
                                                           for n in names}))

    def to_arrays(batch):
        out = {"label": batch["label"],
               "dense": [[np.log1p(max(x, 0)) if x is not None else 0.0 for x in row]
                         for row in zip(*[batch[f"I{i}"] for i in range(1, 14)])]}
        out["sparse"] = [[0 if v is None else 1 + int(v, 16) % (NUM_EMBEDDINGS - 1) for v in row]
                         for row in zip(*[batch[f"C{i}"] for i in range(1, 27)])]
        return out

    ds = ds.map(to_arrays, batched=True, batch_size=10_000, remove_columns=names[1:], load_from_cache_file=False)
    seconds, rows = time.perf_counter() - t0, len(ds)
    del ds
    shutil.rmtree(cache_dir, ignore_errors=True)
    return dict(rows=rows, seconds=seconds)


def run_preprocess(path: str, out: str) -> dict:
    import shutil

    from lightning_rec.data.preprocess import preprocess_criteo

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    manifest = preprocess_criteo([path], out, num_embeddings=NUM_EMBEDDINGS, progress=False)
    return dict(rows=manifest["num_rows"], seconds=time.perf_counter() - t0)


def run_load(directory: str, workers: int, batch: int) -> dict:
    import torch

    from lightning_rec.data.criteo_shards import CriteoShardDataset

    ds = CriteoShardDataset(directory, batch, shuffle=True)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0,
                                         prefetch_factor=4 if workers else None)
    list(loader)  # warm: page cache, worker start
    t0 = time.perf_counter()
    rows = sum(len(b) for b in loader)
    return dict(rows=rows, seconds=time.perf_counter() - t0)


def run_formats(directory: str, batch: int, rounds: int) -> dict:
    """The same rows as .npy (mmap) / Arrow IPC (datasets) / parquet, read as consecutive batches."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lightning_rec.data.criteo_shards import CriteoShardDataset, load_manifest, shard_files

    ds = CriteoShardDataset(directory, batch)
    name = load_manifest(directory)["shards"][0]["name"]
    label, dense, sparse = (np.load(p) for p in shard_files(directory, name).values())
    n = label.shape[0]
    table = pa.table({"label": label,
                      "dense": pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1)), 13),
                      "sparse": pa.FixedSizeListArray.from_arrays(pa.array(sparse.reshape(-1)), 26)})
    arrow_path, parquet_path = Path(directory) / "bench.arrow", Path(directory) / "bench.parquet"
    with pa.OSFile(str(arrow_path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=64 * batch)  # datasets' cache format: an Arrow stream file
    pq.write_table(table, parquet_path, row_group_size=64 * batch)
    mm = [np.load(p, mmap_mode="r") for p in shard_files(directory, name).values()]

    def npy(make):
        for lo in range(0, n, batch):
            arrays = [np.array(a[lo:lo + batch]) for a in mm]
            if make:
                ds.make_batch(*arrays)

    def arrow(make):
        t = datasets.Dataset.from_file(str(arrow_path)).data.table
        for lo in range(0, n, batch):
            s = t.slice(lo, batch).combine_chunks()
            arrays = (s.column(0).to_numpy(), s.column(1).chunk(0).flatten().to_numpy().reshape(-1, 13),
                      s.column(2).chunk(0).flatten().to_numpy().reshape(-1, 26).copy())
            if make:
                ds.make_batch(*arrays)

    def parquet(make):
        for rb in pq.ParquetFile(parquet_path).iter_batches(batch_size=batch):
            arrays = (rb.column(0).to_numpy(), rb.column(1).flatten().to_numpy().reshape(-1, 13),
                      rb.column(2).flatten().to_numpy().reshape(-1, 26).copy())
            if make:
                ds.make_batch(*arrays)

    fns = {"npy": npy, "arrow_ipc": arrow, "parquet": parquet}
    times = {f"{k}{suffix}": [] for k in fns for suffix in ("", "_arrays_only")}
    for _ in range(rounds):  # alternating
        for k, fn in fns.items():
            for suffix, make in (("", True), ("_arrays_only", False)):
                t0 = time.perf_counter()
                fn(make)
                times[k + suffix].append(time.perf_counter() - t0)
    sizes = {"npy": sum(p.stat().st_size for p in shard_files(directory, name).values()),
             "arrow_ipc": arrow_path.stat().st_size, "parquet": parquet_path.stat().st_size}
    arrow_path.unlink()
    parquet_path.unlink()
    return {k: dict(rows_per_s=n / statistics.median(v), mb=sizes[k.replace("_arrays_only", "")] / 2**20)
            for k, v in times.items()}


def run_dlrm(steps: int, rows: int = 0) -> dict:
    """The one-process CPU DLRM step of benchmarks/dlrm_distributed.py (rows: per table, 0: its size)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import dlrm_distributed as dd

    from lightning_rec.optim import combined_optimizer, dense_parameters

    torch.set_num_threads(2)
    rows = rows or dd.ROWS
    model = dd.build_model("cpu", rows)
    opt = combined_optimizer(model, torch.optim.Adagrad(dense_parameters(model), lr=0.01))
    batches = dd.make_batches(2048, 4, seed=0, rows=rows)
    seconds = dd.train(model, opt, batches, steps, 3)
    return dict(rows=2048 * steps, seconds=seconds)


def child_result(kind: str, threads: int, path: str, out: str, workers: int, steps: int, rows: int = 0) -> dict:
    """One variant, and this process's peak RSS."""
    import torch

    torch.set_num_threads(threads)
    runs = {
        "native": lambda: run_native(path),
        "pyarrow": lambda: run_pyarrow(path),
        "datasets": lambda: run_datasets(path, out),
        "preprocess": lambda: run_preprocess(path, out),
        "load": lambda: run_load(out, workers, 2048),
        "formats": lambda: run_formats(out, 2048, 3),
        "dlrm": lambda: run_dlrm(steps, rows),
    }
    if kind not in runs:
        raise SystemExit(f"unknown child {kind}")
    r = runs[kind]()
    r["peak_rss_mb"] = peak_rss_mb()
    return r


def child(args) -> None:
    r = child_result(args.child, args.threads, args.path, args.out, args.workers, args.steps)
    print("RESULT " + json.dumps(r), flush=True)


IN_PROCESS = False  # --smoke: every variant in this process (a process each costs seconds; the peak RSS is shared)


def spawn(kind: str, threads: int, path: str = "", out: str = "", workers: int = 0, steps: int = 0,
          rows: int = 0) -> dict:
    if IN_PROCESS:
        r = child_result(kind, threads, path, out, workers, steps, rows)
    else:
        cmd = [sys.executable, __file__, "--child", kind, "--threads", str(threads), "--path", path, "--out", out,
               "--workers", str(workers), "--steps", str(steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"{kind} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        r = json.loads(lines[0][7:])
    if "rows" in r:
        r["rows_per_s"] = r["rows"] / r["seconds"]
    return r


def parse_size(text: str) -> int:
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    for u, m in units.items():
        if text.upper().endswith(u):
            return int(float(text[:-2]) * m)
    return int(text)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="4GB", help="generated file size (4GB: the headline figure)")
    parser.add_argument("--dir", default="/tmp/lightning_rec_criteo_ingest", help="where the generated files go")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix_mb", type=int, default=256, help="file for the alternating rounds and preprocess")
    parser.add_argument("--baseline_mb", type=int, default=32, help="file for the datasets csv path (slow)")
    parser.add_argument("--dlrm_steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: a 2 MB file in a temporary --dir, one round, 1,000-row DLRM tables, "
                             "every variant in this process")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--path", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dlrm_rows = 0
    if args.smoke:
        args.size, args.rounds, args.prefix_mb, args.baseline_mb, args.dlrm_steps = "2MB", 1, 1, 1, 2
        args.dlrm_rows = 1000
    return args


def make_files(args, work: Path) -> dict[str, Path]:
    """The generated file (once; reused) and its prefixes: the rounds', 1/8, and the baseline's."""
    size = parse_size(args.size)
    t0 = time.perf_counter()
    big = work / f"criteo_{args.size}.tsv"
    if not _have(big, size) and IN_PROCESS:
        generate(big, size)
    elif not _have(big, size):  # generated in a child: this process stays small
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
                        f"import criteo_ingest as c; from pathlib import Path; c.generate(Path({str(big)!r}), {size})"],
                       check=True)
    print(f"generated {big} ({big.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s", flush=True)
    prefix_mb = min(args.prefix_mb, size >> 20)
    return {"big": big, "prefix": prefix_file(big, prefix_mb), "eighth": prefix_file(big, max(1, (size >> 20) // 8)),
            "small": prefix_file(big, min(args.baseline_mb, prefix_mb))}


def run_variants(args, files: dict[str, Path], work: Path) -> dict:
    """Every measurement, each in its own process (in this one under --smoke)."""
    T = args.threads
    rounds = {"native": [], "pyarrow": []}
    for _ in range(args.rounds):  # alternating: the machine drifts 10-30% between minutes
        for kind in rounds:
            rounds[kind].append(spawn(kind, T, str(files["prefix"])))
    shards = str(work / "shards")
    return {
        "med": {k: statistics.median(r["rows_per_s"] for r in v) for k, v in rounds.items()},
        "rss": {k: max(r["peak_rss_mb"] for r in v) for k, v in rounds.items()},
        "ds_run": spawn("datasets", T, str(files["small"]), str(work / "hf_cache")),
        "nat_small": spawn("native", T, str(files["small"])),
        "full": spawn("native", T, str(files["big"])),
        "part": spawn("native", T, str(files["eighth"])),
        "pre": spawn("preprocess", T, str(files["prefix"]), shards),
        "load0": spawn("load", 1, out=shards, workers=0),  # one loading process, as a worker runs
        "load2": spawn("load", T, out=shards, workers=2),
        "formats": spawn("formats", 1, out=shards),
        "dlrm": spawn("dlrm", T, steps=args.dlrm_steps, rows=args.dlrm_rows),
    }


def _row(variant: str, run: dict, path: Path | None = None, **extra) -> dict:
    file_mb = {} if path is None else {"file_mb": path.stat().st_size >> 20}
    return dict(variant=variant, **file_mb, **extra, rows_per_s=round(run["rows_per_s"]),
                peak_rss_mb=round(run["peak_rss_mb"]))


def results_of(files: dict[str, Path], prefix_mb: int, runs: dict) -> list[dict]:
    med, rss, formats = runs["med"], runs["rss"], runs["formats"]
    results = [
        dict(variant="native", file_mb=prefix_mb, rows_per_s=round(med["native"]), peak_rss_mb=round(rss["native"])),
        dict(variant="pyarrow+numpy", file_mb=prefix_mb, rows_per_s=round(med["pyarrow"]),
             peak_rss_mb=round(rss["pyarrow"])),
        _row("native", runs["nat_small"], files["small"]),
        _row("datasets csv + map", runs["ds_run"], files["small"]),
        _row("native (whole file)", runs["full"], files["big"], rows=runs["full"]["rows"]),
        _row("native (1/8 file)", runs["part"], files["eighth"]),
        dict(_row("preprocess -> .npy shards", runs["pre"]), file_mb=prefix_mb),
        _row("shards -> batches, 1 process", runs["load0"]),
        _row("shards -> batches, 2 workers -> main", runs["load2"]),
        _row("DLRM step, 1 process CPU", runs["dlrm"]),
    ]
    for k in ("npy", "arrow_ipc", "parquet"):
        results.append(dict(variant=f"shard_format {k} -> batches", rows_per_s=round(formats[k]["rows_per_s"]),
                            mb_on_disk=round(formats[k]["mb"], 1)))
        results.append(dict(variant=f"shard_format {k} -> arrays only",
                            rows_per_s=round(formats[k + "_arrays_only"]["rows_per_s"]),
                            mb_on_disk=round(formats[k]["mb"], 1)))
    return results


def ratios_of(runs: dict) -> dict:
    med, formats = runs["med"], runs["formats"]
    load_best = max(runs["load0"]["rows_per_s"], runs["load2"]["rows_per_s"])
    return {
        "native_vs_pyarrow": round(med["native"] / med["pyarrow"], 2),
        "native_vs_datasets": round(runs["nat_small"]["rows_per_s"] / runs["ds_run"]["rows_per_s"], 2),
        "load_vs_dlrm_cpu_step": round(load_best / runs["dlrm"]["rows_per_s"], 2),
        "load_vs_gpu_dlrm_low": round(load_best / GPU_SAMPLES_PER_S[0], 3),
        "npy_vs_arrow_ipc": round(formats["npy"]["rows_per_s"] / formats["arrow_ipc"]["rows_per_s"], 2),
        "npy_vs_parquet": round(formats["npy"]["rows_per_s"] / formats["parquet"]["rows_per_s"], 2),
        "npy_vs_arrow_ipc_arrays_only": round(formats["npy_arrays_only"]["rows_per_s"]
                                              / formats["arrow_ipc_arrays_only"]["rows_per_s"], 2),
        "npy_vs_parquet_arrays_only": round(formats["npy_arrays_only"]["rows_per_s"]
                                            / formats["parquet_arrays_only"]["rows_per_s"], 2),
    }


def report(args, files: dict[str, Path], runs: dict) -> None:
    prefix_mb = min(args.prefix_mb, parse_size(args.size) >> 20)
    results = results_of(files, prefix_mb, runs)
    print(f"\n{'variant':34s} {'file MB':>8s} {'rows/s':>12s} {'peak RSS MB':>12s}")
    for r in results:
        extra = f"  ({r['mb_on_disk']} MB on disk)" if "mb_on_disk" in r else ""
        print(f"{r['variant']:34s} {str(r.get('file_mb', '')):>8s} {r['rows_per_s']:>12,d} "
              f"{str(r.get('peak_rss_mb', '')):>12s}{extra}")
    ratios = ratios_of(runs)
    load_best = max(runs["load0"]["rows_per_s"], runs["load2"]["rows_per_s"])
    gb = files["big"].stat().st_size / 2**30
    figures = {
        "native_rows_per_s": round(runs["full"]["rows_per_s"]),
        "native_rows_per_s_prefix_median": round(runs["med"]["native"]),
        "pyarrow_rows_per_s": round(runs["med"]["pyarrow"]),
        "datasets_rows_per_s": round(runs["ds_run"]["rows_per_s"]),
        "peak_rss_mb_4gb": round(runs["full"]["peak_rss_mb"]),
        "peak_rss_mb_eighth": round(runs["part"]["peak_rss_mb"]),
        "file_gib": round(gb, 2),
        "preprocess_rows_per_s": round(runs["pre"]["rows_per_s"]),
        "preprocess_peak_rss_mb": round(runs["pre"]["peak_rss_mb"]),
        "load_rows_per_s": round(load_best),
        "dlrm_cpu_samples_per_s": round(runs["dlrm"]["rows_per_s"]),
        "threads": args.threads,
    }
    print(f"\nnative {ratios['native_vs_pyarrow']}x pyarrow+numpy, {ratios['native_vs_datasets']}x datasets; "
          f"peak RSS {figures['peak_rss_mb_4gb']} MB for {gb:.2f} GiB vs {figures['peak_rss_mb_eighth']} MB for 1/8; "
          f"shards -> batches {ratios['load_vs_dlrm_cpu_step']}x the CPU DLRM step, "
          f"{load_best / GPU_SAMPLES_PER_S[0]:.2f}-{load_best / GPU_SAMPLES_PER_S[1]:.2f}x the GPU step "
          f"(1.6-2.4M samples/s) per loading process")
    print(json.dumps({"benchmark": "criteo_ingest", "results": results, "ratios": ratios, "figures": figures}))


def main() -> None:
    global IN_PROCESS
    args = parse_args()
    if args.child:
        return child(args)
    IN_PROCESS = args.smoke
    work = Path(tempfile.mkdtemp(prefix="criteo_ingest_smoke_")) if args.smoke else Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        files = make_files(args, work)
        report(args, files, run_variants(args, files, work))
    finally:
        if args.smoke:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
