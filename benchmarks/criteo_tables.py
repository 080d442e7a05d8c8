"""Criteo tables -> the training cache: a Parquet file and a `datasets` save_to_disk folder against the text file of
the same rows (the native parser and the Python reference), alternating rounds, medians.

    flock /tmp/lightning_rec_bench.lock python benchmarks/criteo_tables.py [--rows 1000000] [--rounds 3]
    python benchmarks/criteo_tables.py --smoke      # seconds: 2,000 rows (or the sample's), one round

The rows are ../shared/data's Kaggle train sample repeated (a generated tab file without it). Every round builds
each cache from scratch (`build_criteo_cache` into a new directory: the one-time conversion a user waits for),
and checks the caches hold the same rows; then one streaming pass of each (batches of 2048, one process: what
an epoch costs without a cache). Last line: {"benchmark": "criteo_tables", "results": [...], "ratios":
{"parquet_vs_text_native", "parquet_vs_text_python", ...}, "figures": {"<source>_rows_per_s", ...}}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT.parent / "shared" / "data" / "criteo" / "criteo_kaggle_train_sample.tsv"
NAMES = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]


def _sample_text(rows: int) -> str:
    if SAMPLE.is_file():
        return SAMPLE.read_text()
    g = np.random.default_rng(0)  # the layout without the shared data: 20% missing counts, 15% missing ids
    lines = []
    for _ in range(min(rows, 5000)):
        dense = ["" if g.random() < 0.2 else str(int(g.integers(0, 500))) for _ in range(13)]
        sparse = ["" if g.random() < 0.15 else f"{int(g.integers(0, 2**32)):08x}" for _ in range(26)]
        lines.append("\t".join([str(int(g.integers(0, 2)))] + dense + sparse))
    return "\n".join(lines) + "\n"


def make_sources(directory: Path, rows: int) -> dict[str, Path]:
    import datasets

    text = _sample_text(rows)
    per = text.count("\n")
    tsv = directory / "rows.tsv"
    with open(tsv, "w") as f:
        for _ in range(-(-rows // per)):
            f.write(text)
    hashes = {f"C{i}": pa.string() for i in range(1, 27)}
    table = pacsv.read_csv(tsv, read_options=pacsv.ReadOptions(column_names=NAMES),
                           parse_options=pacsv.ParseOptions(delimiter="\t"),
                           convert_options=pacsv.ConvertOptions(column_types=hashes, strings_can_be_null=True))
    pq.write_table(table, directory / "rows.parquet")
    # row groups of 1000 rows (some writers' choice): a block spans hundreds of them
    pq.write_table(table, directory / "small_groups.parquet", row_group_size=1000)
    datasets.Dataset(table).save_to_disk(str(directory / "saved"))
    return {"text_native": tsv, "text_python": tsv, "parquet": directory / "rows.parquet",
            "parquet_small_groups": directory / "small_groups.parquet", "saved_dataset": directory / "saved"}


def build(source: Path, parser: str, cache: Path) -> tuple[float, int, Path]:
    from lightning_rec.data.criteo import build_criteo_cache

    start = time.perf_counter()
    arrow, report = build_criteo_cache(source, cache_dir=cache, parser=parser)
    return time.perf_counter() - start, report.num_rows, arrow


def _arrays(arrow: Path) -> list[np.ndarray]:
    import datasets

    table = datasets.Dataset.from_file(str(arrow)).data.table.combine_chunks()
    return [table.column("label").to_numpy(), table.column("dense").combine_chunks().flatten().to_numpy(),
            table.column("sparse").combine_chunks().flatten().to_numpy()]


def stream(source: Path, parser: str) -> tuple[float, int]:
    """One pass of the streaming loader (batches of 2048, one process): what every epoch costs without a cache."""
    from lightning_rec.data.criteo import CriteoIterableDataset

    data = CriteoIterableDataset(str(source), batch_size=2048, num_embeddings_per_feature=100_000, parser=parser)
    start = time.perf_counter()
    rows = sum(len(batch) for batch in data)
    return time.perf_counter() - start, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="seconds: 2,000 rows (or the sample's), one round")
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.rounds = 2000, 1
    import datasets

    datasets.disable_progress_bars()
    work = Path(tempfile.mkdtemp(prefix="criteo_tables_"))
    try:
        sources = make_sources(work, args.rows)
        seconds: dict[str, list[float]] = {name: [] for name in sources}
        rows = {}
        for r in range(args.rounds):
            order = list(sources) if r % 2 == 0 else list(reversed(sources))  # alternate: the VM drifts
            arrows = {}
            for name in order:
                parser = "python" if name == "text_python" else "auto"
                dt, n, arrows[name] = build(sources[name], parser, work / f"cache_{r}_{name}")
                seconds[name].append(dt)
                rows[name] = n
            first = _arrays(arrows["text_native"])
            for name, arrow in arrows.items():  # the same rows whatever the source (NaN: a missing count)
                assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(_arrays(arrow), first)), name
            for name in sources:
                shutil.rmtree(work / f"cache_{r}_{name}", ignore_errors=True)
        streamed: dict[str, list[float]] = {name: [] for name in sources}
        for r in range(args.rounds):
            for name in (list(sources) if r % 2 == 0 else list(reversed(sources))):
                dt, n = stream(sources[name], "python" if name == "text_python" else "auto")
                assert n == rows[name], (name, n)
                streamed[name].append(dt)
        figures = {f"{name}_rows_per_s": round(rows[name] / statistics.median(s)) for name, s in seconds.items()}
        figures |= {f"{name}_stream_rows_per_s": round(rows[name] / statistics.median(s))
                    for name, s in streamed.items()}
        print(f"{'source':<22}{'rows':>10}{'cache s':>10}{'cache rows/s':>14}{'stream rows/s':>15}")
        for name, s in seconds.items():
            print(f"{name:<22}{rows[name]:>10}{statistics.median(s):>10.2f}{figures[f'{name}_rows_per_s']:>14,}"
                  f"{figures[f'{name}_stream_rows_per_s']:>15,}")
        ratios = {"parquet_vs_text_native": round(figures["parquet_rows_per_s"] / figures["text_native_rows_per_s"], 3),
                  "parquet_vs_text_python": round(figures["parquet_rows_per_s"] / figures["text_python_rows_per_s"], 3),
                  "saved_dataset_vs_parquet": round(figures["saved_dataset_rows_per_s"]
                                                    / figures["parquet_rows_per_s"], 3),
                  "parquet_stream_vs_text_stream": round(figures["parquet_stream_rows_per_s"]
                                                         / figures["text_native_stream_rows_per_s"], 3)}
        results = [{"source": name, "rows": rows[name], "cache_s": statistics.median(s),
                    "stream_s": statistics.median(streamed[name])} for name, s in seconds.items()]
        print(json.dumps({"benchmark": "criteo_tables", "results": results, "ratios": ratios,
                          "figures": {**figures, "rows": rows["parquet"], "rounds": args.rounds}}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
