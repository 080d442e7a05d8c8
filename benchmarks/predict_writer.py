"""PredictionWriter's row path on one rank: peak memory and time to write R prediction rows (DLRM's columns:
probability f32, label f32 all NaN, row i64; batches of 8192), against holding every row and sorting at the end
(what the writer did before it spilled runs and wrote in chunks). Each round runs each way in its own process
(peak RSS is per process), alternating; medians. The last line is one JSON object: {"benchmark": "predict_writer",
"results": [...], "ratios": {"peak_rss_spilled_vs_in_memory", "speed_spilled_vs_in_memory"}, "figures": {"rows",
"<way>_seconds", "<way>_peak_rss_mb", "<way>_file_mb"}}.

    .venv/bin/python benchmarks/predict_writer.py [--rows 40000000] [--rounds 3]
    .venv/bin/python benchmarks/predict_writer.py --smoke      # seconds: 50,000 rows, one round, in this process
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BATCH = 8192


def _batches(rows: int):
    p = np.random.default_rng(0).random(BATCH, dtype=np.float32)
    for lo in range(0, rows, BATCH):
        n = min(BATCH, rows - lo)
        yield {"probability": p[:n].copy(), "label": np.full(n, np.nan, np.float32),
               "row": np.arange(lo, lo + n, dtype=np.int64)}


def _run(mode: str, rows: int) -> dict:
    from lightning_rec.predict import PredictionWriter
    from lightning_rec.predict_rows import ROW, RunSpill, TableWriter, concat, take, write_table, written_columns

    out = Path(tempfile.mkdtemp()) / "p.csv"
    start = time.perf_counter()
    if mode == "in_memory":  # every row held, sorted once, written in one piece
        table = concat(list(_batches(rows)))
        _, first = np.unique(table[ROW], return_index=True)
        write_table(take(table, first), out)
    else:
        directory = out.parent / "runs"
        spill = RunSpill(PredictionWriter.spill_bytes, lambda: (directory.mkdir(), directory)[1])
        for batch in _batches(rows):
            spill.add(batch)
        writer = TableWriter(out, written_columns(spill.columns, spill.all_nan))
        for table in spill.stream(PredictionWriter.gather_chunk_bytes):
            writer.write(table)
        writer.close()
        spill.close()
    seconds = time.perf_counter() - start
    file_mb = out.stat().st_size / 2**20
    shutil.rmtree(out.parent)
    return {"seconds": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "file_mb": file_mb}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=40_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=["in_memory", "spilled"])
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: 50,000 rows, one round, both ways in this process (one peak RSS)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_run(args.child, args.rows)))
        return
    if args.smoke:
        args.rows, args.rounds = 50_000, 1
    got: dict[str, list[dict]] = {"in_memory": [], "spilled": []}
    results = []
    for r in range(args.rounds):
        for mode in (("in_memory", "spilled") if r % 2 == 0 else ("spilled", "in_memory")):
            if args.smoke:
                got[mode].append(_run(mode, args.rows))
            else:
                done = subprocess.run([sys.executable, __file__, "--child", mode, "--rows", str(args.rows)],
                                      capture_output=True, text=True, check=True)
                got[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r} {mode:9s} {got[mode][-1]}", flush=True)
            results.append({"round": r, "way": mode, **got[mode][-1]})
    med = {m: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for m, runs in got.items()}
    figures = {"rows": args.rows, **{f"{m}_{k}": v for m, values in med.items() for k, v in values.items()}}
    print(json.dumps({"benchmark": "predict_writer", "results": results,
                      "ratios": {"peak_rss_spilled_vs_in_memory": med["spilled"]["peak_rss_mb"]
                                 / med["in_memory"]["peak_rss_mb"],
                                 "speed_spilled_vs_in_memory": med["in_memory"]["seconds"]
                                 / med["spilled"]["seconds"]},
                      "figures": figures}))


if __name__ == "__main__":
    main()
