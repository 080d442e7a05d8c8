"""Checkpoint save / load at 2 ranks: the gathered one-file format vs sharded DCP, same run.

    flock /tmp/lightning_rec_bench.lock python benchmarks/checkpoint.py [--rows 1000000] [--rounds 2]
    python benchmarks/checkpoint.py --smoke      # seconds: 1,000-row tables, one round

Model: 26 tables x `--rows` rows (1M: 6.7 GB of weights) x dim 64, fused row-wise
Adagrad, sharded table-wise over 2 ranks (13 tables each), 1 thread per rank. A few training
steps first, so the optimizer state is real.

    gathered   RecStrategy(checkpoint_format="gathered"), through the functions it calls
               (checkpoint.gathered_state_dict / gathered_optimizer_state / save_file / load_file):
               every table and its optimizer state gathered to rank 0 one at a time (the DMP's
               guarded gather_object), whole there, one torch.save file. Load: every rank maps the
               file (torch.load(mmap=True)) and copies out its pieces.
    dcp        lightning_rec.checkpoint.save / load_model / load_optimizer: each rank writes and
               reads its own pieces through torch.distributed.checkpoint.

The two alternate over `--rounds` rounds (medians). Per rank: save and load seconds, bytes written,
and peak extra RSS during the save / the load (a thread samples /proc/self/statm every 5 ms; extra
= above the RSS before the call). Ratios: DCP's largest per-rank peak extra RSS during save over
the gathered format's rank-0 one, and DCP's save seconds over the gathered format's.
Last line: {"benchmark": "checkpoint", "results": [...], "ratios": {...}, "figures": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # free_port, collect_rows: tests/dist_utils.py
from dist_utils import collect_rows, free_port  # noqa: E402

NUM_TABLES, DIM = 26, 64
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Peak RSS above the level at entry, sampled every 5 ms by a thread."""

    def __enter__(self):
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.extra = self.peak - self.base


def build(rows: int, world_size: int):
    from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig
    from lightning_rec.model_parallel import DistributedModelParallel, construct_module_sharding_plan, table_wise
    from lightning_rec.optim import FusedOptimizer, FusedOptimizerConfig
    from lightning_rec.types import ShardingPlan

    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=DIM, feature_names=[f"f{i}"])
              for i in range(NUM_TABLES)]
    # meta: the unsharded tables are never allocated; each rank builds only its shards
    ebc = EmbeddingBagCollection(tables, device="meta", optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.01))
    model = torch.nn.ModuleDict({"ebc": ebc})
    layout = {f"t{i}": table_wise(rank=i % world_size) for i in range(NUM_TABLES)}
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(ebc, layout, world_size=world_size,
                                                               local_size=world_size)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", dense=None, timeout=600)
    return model, dmp, FusedOptimizer(model)


def train_a_little(model, dmp, rows: int, rank: int) -> None:
    from lightning_rec.sparse import KeyedJaggedTensor

    g = torch.Generator().manual_seed(rank)
    keys = [f"f{i}" for i in range(NUM_TABLES)]
    for _ in range(3):
        values = torch.randint(0, rows, (NUM_TABLES * 256,), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, torch.ones(NUM_TABLES * 256, dtype=torch.long))
        dmp.module["ebc"](kjt).values().sum().backward()


def gathered_save(model, dmp, optimizer, path: str) -> None:
    """What RecStrategy(checkpoint_format="gathered") does: the same functions (one table at a time to rank 0,
    whole there, torch.save straight to a file)."""
    from lightning_rec import checkpoint

    state = checkpoint.gathered_state_dict(model.state_dict(), dmp)
    opt = checkpoint.gathered_optimizer_state(optimizer, dmp)
    if dist.get_rank() == 0:
        checkpoint.save_file({"state_dict": state, "optimizer_states": [opt]}, path)
    del state, opt
    dist.barrier()


def gathered_load(model, dmp, optimizer, path: str) -> None:
    from lightning_rec import checkpoint

    ckpt = checkpoint.load_file(path)  # memory-mapped: each rank pages in the pieces it copies
    model.load_state_dict(ckpt["state_dict"])
    optimizer.load_state_dict(ckpt["optimizer_states"][0])
    del ckpt
    dist.barrier()


def dcp_save(model, dmp, optimizer, path: str) -> None:
    from lightning_rec import checkpoint

    checkpoint.save({"state_dict": model.state_dict()}, path, optimizers=[optimizer])


def dcp_load(model, dmp, optimizer, path: str) -> None:
    from lightning_rec import checkpoint

    checkpoint.load_model(model, path)
    checkpoint.load_optimizer(optimizer, path, 0)
    dist.barrier()


def bytes_written(kind: str, path: str, rank: int) -> int:
    if kind == "gathered":
        return os.path.getsize(path) if rank == 0 else 0
    return os.path.getsize(Path(path) / f"__{rank}_0.distcp") + (
        sum(f.stat().st_size for f in Path(path).iterdir() if f.suffix != ".distcp") if rank == 0 else 0)


def rank_main(rank: int, world_size: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=1800))
    model, dmp, optimizer = build(args.rows, world_size)
    train_a_little(model, dmp, args.rows, rank)
    ops = {"gathered": (gathered_save, gathered_load), "dcp": (dcp_save, dcp_load)}
    formats = args.formats.split(",")
    out = []
    for r in range(args.rounds):
        order = formats if r % 2 == 0 else formats[::-1]
        for kind in order:
            path = os.path.join(args.dir, f"{kind}.ckpt")
            save, load = ops[kind]
            dist.barrier()
            t0 = time.perf_counter()
            with PeakRSS() as save_mem:
                save(model, dmp, optimizer, path)
            save_s = time.perf_counter() - t0
            written = bytes_written(kind, path, rank)
            dist.barrier()
            t0 = time.perf_counter()
            with PeakRSS() as load_mem:
                load(model, dmp, optimizer, path)
            load_s = time.perf_counter() - t0
            out.append({"round": r, "format": kind, "rank": rank, "save_s": save_s, "load_s": load_s,
                        "bytes_written": written, "save_peak_extra_rss": save_mem.extra,
                        "load_peak_extra_rss": load_mem.extra, "rss_before_save": save_mem.base})
            dist.barrier()
            if rank == 0:
                p = Path(path)
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            dist.barrier()
    queue.put(out)
    dist.destroy_process_group()


def _ratio(a: float, b: float) -> float | None:
    """a / b; None where b is 0 (tiny tables: a load that grows the RSS by less than a page)."""
    return a / b if b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per table (1M: 6.7 GB of weights)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--formats", default="gathered,dcp",
                        help="which to run; 'dcp' alone for sizes where gathering to rank 0 does not fit in memory")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--smoke", action="store_true", help="seconds: 1,000-row tables, one round")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.rounds = 1000, 1
    world_size = 2
    tmp = tempfile.mkdtemp(prefix="lr_ckpt_bench_", dir=args.dir)
    args.dir = tmp
    if args.smoke:  # fork: the ranks start with torch and lightning_rec imported once (spawn: seconds a rank)
        import lightning_rec.checkpoint  # noqa: F401
        import lightning_rec.model_parallel  # noqa: F401
    ctx = mp.get_context("fork" if args.smoke else "spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    rows = []
    try:
        rows = collect_rows(queue, procs)
    finally:
        for p in procs:
            p.join()
        shutil.rmtree(tmp, ignore_errors=True)
    weights_gb = NUM_TABLES * args.rows * DIM * 4 / 1e9

    def med(kind, key, rank=None, agg=max):
        per_round = {}
        for row in rows:
            if row["format"] == kind and (rank is None or row["rank"] == rank):
                per_round.setdefault(row["round"], []).append(row[key])
        return statistics.median(agg(v) for v in per_round.values())

    print(f"checkpoint: 26 tables x {args.rows:,} rows x dim {DIM} ({weights_gb:.2f} GB of weights), row-wise "
          f"Adagrad, table-wise over {world_size} ranks; medians of {args.rounds} rounds")
    print(f"{'format':<9} {'rank':>4} {'save s':>8} {'load s':>8} {'MB written':>11} {'save +RSS MB':>13} "
          f"{'load +RSS MB':>13}")
    results = []
    formats = args.formats.split(",")
    for kind in formats:
        for rank in range(world_size):
            r = {"format": kind, "rank": rank,
                 "save_s": med(kind, "save_s", rank), "load_s": med(kind, "load_s", rank),
                 "bytes_written": med(kind, "bytes_written", rank),
                 "save_peak_extra_rss": med(kind, "save_peak_extra_rss", rank),
                 "load_peak_extra_rss": med(kind, "load_peak_extra_rss", rank)}
            results.append(r)
            print(f"{kind:<9} {rank:>4} {r['save_s']:>8.2f} {r['load_s']:>8.2f} {r['bytes_written'] / 1e6:>11.1f} "
                  f"{r['save_peak_extra_rss'] / 1e6:>13.1f} {r['load_peak_extra_rss'] / 1e6:>13.1f}")
    # a save takes as long as its slowest rank: the per-round max over ranks, then the median
    figures = {"rows": args.rows, "weights_gb": weights_gb, "world_size": world_size, "rounds": args.rounds}
    for kind in formats:
        figures[f"{kind}_save_s"] = med(kind, "save_s")
        figures[f"{kind}_load_s"] = med(kind, "load_s")
        figures[f"{kind}_max_rank_save_peak_extra_rss"] = med(kind, "save_peak_extra_rss")
        figures[f"{kind}_max_rank_load_peak_extra_rss"] = med(kind, "load_peak_extra_rss")
        figures[f"{kind}_rank0_save_peak_extra_rss"] = med(kind, "save_peak_extra_rss", rank=0)
    ratios = {}
    if "gathered" in formats and "dcp" in formats:
        ratios = {
            # DCP's largest per-rank peak over the gathered format's rank 0 (the rank that gathers)
            "dcp_vs_gathered_peak_rss": _ratio(figures["dcp_max_rank_save_peak_extra_rss"],
                                               figures["gathered_rank0_save_peak_extra_rss"]),
            "dcp_vs_gathered_save_s": _ratio(figures["dcp_save_s"], figures["gathered_save_s"]),
            "dcp_vs_gathered_load_s": _ratio(figures["dcp_load_s"], figures["gathered_load_s"]),
            "dcp_vs_gathered_load_peak_rss": _ratio(figures["dcp_max_rank_load_peak_extra_rss"],
                                                    figures["gathered_max_rank_load_peak_extra_rss"]),
        }
    print("ratios: " + "  ".join(f"{k}={v:.3f}" if v is not None else f"{k}=-" for k, v in ratios.items()))
    print(json.dumps({"benchmark": "checkpoint", "results": results, "ratios": ratios, "figures": figures}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
