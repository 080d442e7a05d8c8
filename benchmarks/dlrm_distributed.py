"""DLRM training throughput: 2 ranks x 1 thread (gloo) per sharding type vs one process x 2 threads.

    python benchmarks/dlrm_distributed.py [--steps 20] [--rounds 3] [--types table_wise,row_wise,...]
    python benchmarks/dlrm_distributed.py --smoke [--pipeline]   # seconds: tiny tables, 2 steps, 1 round

`--types` entries may end in `@gloo` (e.g. `table_wise@gloo`): the same run with every collective
over gloo's TCP instead of shared memory (DistributedModelParallel(shared_memory=False)), the
transport before shm_transport.py, for a same-run comparison.

An entry may also end in `@noguard` (or `@gloo+noguard`): the same run with the collective guard
off (LIGHTNING_REC_COLLECTIVE_GUARD=0, lightning_rec/collective_guard.py), to measure what it costs.

`--types` may also name `planner` (the plan EmbeddingShardingPlanner picks for this model);
benchmarks/planner.py runs it that way to put measured step times next to its estimates.

Model: 13 dense features -> dense arch 512-256-64; 26 tables x 100,000 rows x dim 64, sum
pooling, one id per feature; over arch 512-512-256-1; fused row-wise Adagrad (lr 0.01) for the
embeddings, torch Adagrad for the dense layers. Distributed: batch 1024 per rank, the dense layers
in DDP, the tables sharded by DistributedModelParallel. One process: the unsharded model, batch
2048, 2 threads. Both run in this script one after the other, so the ratio compares like with like.
Per rank it prints the embedding bytes it holds (weights + optimizer state) and its peak RSS, and
rank 0 profiles a few table-wise steps (where the time goes).
Last line: {"benchmark": "dlrm_distributed", "results": [...], "ratios": {...}, "figures": {...}}.

    python benchmarks/dlrm_distributed.py --pipeline [--steps 30] [--rounds 5] [--types table_wise]

`--pipeline`: the same model at 2 ranks, batches from a real DataLoader (SyntheticCriteoDataModule,
26 x 100k ids, batch 1024 per rank, different data per rank), trained by the plain loop and by
TrainPipelineSparseDist in alternating rounds over the same sharded model (the modes alternate on
it). Rank 0 profiles one round of each mode (where the step's time goes). Ratio:
ratios.pipelined_vs_plain: median plain step time / median pipelined step time over every timed
step (the per-round ratios are printed too). Two bounds are printed beside it:
figures.overlap_bound_vs_plain (what the idle time of the plain step's thread allows on this
machine) and figures.offload_bound_vs_plain (from the profile: the step without its read and id
routing, what a free core per rank would allow). figures.read_ahead says where the pipeline's
feeder worked (PipelineConfig.read_ahead, `--read-ahead auto|thread|inline`; auto: inline when
the 2 ranks x 1 thread leave no core spare) and figures.read_ahead_why why. Pin the cores to
measure both cases of auto, on a quiet machine:

    taskset -c 0-3 python benchmarks/dlrm_distributed.py --pipeline --steps 30 --rounds 5 --types table_wise
    taskset -c 0,1 python benchmarks/dlrm_distributed.py --pipeline --steps 30 --rounds 5 --types table_wise

(the first: a free core per rank, read_ahead thread; the second: none spare, read_ahead inline).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dist_utils import free_port  # noqa: E402  (tests/dist_utils.py)

NUM_TABLES, ROWS, DIM, DENSE_IN = 26, 100_000, 64, 13
DENSE_ARCH, OVER_ARCH = [512, 256, 64], [512, 512, 256, 1]
TYPES = ["table_wise", "row_wise", "column_wise", "table_row_wise", "grid_shard", "data_parallel"]


def start_method(smoke: bool):
    """spawn; under --smoke, fork: the ranks start from this process with torch and lightning_rec imported once
    (spawn imports them again in every process, seconds each: most of a smoke run)."""
    if not smoke:
        return mp.get_context("spawn")
    import lightning_rec.model_parallel  # noqa: F401
    import lightning_rec.models.dlrm  # noqa: F401
    import lightning_rec.pipeline  # noqa: F401

    return mp.get_context("fork")


def build_model(device: str = "cpu", rows: int = ROWS):
    from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig
    from lightning_rec.optim import FusedOptimizerConfig

    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=DIM, feature_names=[f"f{i}"])
              for i in range(NUM_TABLES)]
    ebc = EmbeddingBagCollection(tables, device=device, optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.01))
    try:
        from lightning_rec.models.dlrm import DLRM
    except ImportError:  # pragma: no cover
        raise SystemExit("lightning_rec.models.dlrm is missing") from None
    torch.manual_seed(0)
    return DLRM(ebc, DENSE_IN, DENSE_ARCH, OVER_ARCH)


def make_batches(batch: int, count: int, seed: int, rows: int = ROWS):
    from lightning_rec.sparse import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    keys = [f"f{i}" for i in range(NUM_TABLES)]
    out = []
    for _ in range(count):
        dense = torch.rand(batch, DENSE_IN, generator=g)
        values = torch.randint(0, rows, (NUM_TABLES * batch,), generator=g)
        lengths = torch.ones(NUM_TABLES * batch, dtype=torch.long)
        labels = torch.randint(0, 2, (batch, 1), generator=g).float()
        out.append((dense, KeyedJaggedTensor.from_lengths_sync(keys, values, lengths), labels))
    return out


def train(model, optimizer, batches, steps: int, warmup: int) -> float:
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for i in range(warmup + steps):
        if i == warmup:
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
        dense, sparse, labels = batches[i % len(batches)]
        loss = loss_fn(model(dense, sparse), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return time.perf_counter() - start


def plan_for(kind: str, model, world_size: int, batch: int):
    from lightning_rec import model_parallel as mpar
    from lightning_rec.types import ShardingPlan

    if kind == "planner":  # the planner's own choice, for this model, batch and optimizer
        from lightning_rec.planner import EmbeddingShardingPlanner, Topology

        planner = EmbeddingShardingPlanner(Topology(world_size=world_size, compute_device="cpu"), batch_size=batch,
                                           optimizer="rowwise_adagrad", print_stats=False)
        return planner.plan(model)  # deterministic: every rank computes the same plan
    ebc = model.sparse_arch.embedding_bag_collection
    verbs = {
        "table_wise": lambda i: mpar.table_wise(rank=i % world_size),
        "row_wise": lambda i: mpar.row_wise(),
        "column_wise": lambda i: mpar.column_wise(ranks=list(range(world_size))),
        "table_row_wise": lambda i: mpar.table_row_wise(host_index=0),
        "grid_shard": lambda i: mpar.grid_shard(host_indexes=[0]),
        "data_parallel": lambda i: mpar.data_parallel(),
    }
    per_table = {f"t{i}": verbs[kind](i) for i in range(NUM_TABLES)}
    return ShardingPlan({"sparse_arch.embedding_bag_collection": mpar.construct_module_sharding_plan(
        ebc, per_table, world_size=world_size, local_size=world_size)})


def embedding_bytes(dmp) -> int:
    total = 0
    for m in dmp.sharded_modules().values():
        total += sum(w.numel() * w.element_size() for w in m.table_weights().values())
        for k in m.fused_kernels():
            total += sum(v.numel() * v.element_size() for s in k.optimizer_states() for v in s.values())
    return total


def rank_main(rank: int, world_size: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    from lightning_rec.model_parallel import DistributedModelParallel
    from lightning_rec.optim import CombinedOptimizer, dense_parameters

    batches = make_batches(args.batch, 4, seed=rank + 1, rows=args.rows)
    results = {}
    for kind in args.types:
        model = build_model("meta", args.rows)  # tables are built where their shards live, never whole
        dense = None if args.dense == "none" else args.dense
        sharding, _, options = kind.partition("@")  # "table_wise@gloo": embedding + DDP traffic over gloo TCP
        options = set(options.split("+"))  # "table_wise@gloo+noguard": and without the collective guard
        os.environ["LIGHTNING_REC_COLLECTIVE_GUARD"] = "0" if "noguard" in options else "1"
        plan = plan_for(sharding, model, world_size, args.batch)
        dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=120, dense=dense,
                                       shared_memory=False if "gloo" in options else None)
        # the dense optimizer holds the parameters autograd trains, not the fused tables (CombinedOptimizer
        # refuses those: their fused optimizer updates them inside backward)
        opt = CombinedOptimizer([("fused", dmp.fused_optimizer),
                                 ("dense", torch.optim.Adagrad(dense_parameters(dmp), lr=0.01))])
        seconds = train(dmp, opt, batches, args.steps, args.warmup)
        results[kind] = dict(seconds=seconds, emb_bytes=embedding_bytes(dmp))
        if kind == "table_wise" and args.profile_now:
            table = profile(dmp, opt, batches)  # every rank steps; rank 0's profile is printed
            if rank == 0:
                results["profile"] = table
        del dmp, model, opt
    results["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def profile(model, opt, batches) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        train(model, opt, batches, 5, 0)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)


def one_process_main(args, queue) -> None:
    torch.set_num_threads(2)
    model = build_model("cpu", args.rows)
    from lightning_rec.optim import combined_optimizer, dense_parameters

    opt = combined_optimizer(model, torch.optim.Adagrad(dense_parameters(model), lr=0.01))
    batches = make_batches(2 * args.batch, 4, seed=0, rows=args.rows)
    seconds = train(model, opt, batches, args.steps, args.warmup)
    emb = sum(w.numel() * 4 for w in model.sparse_arch.embedding_bag_collection.lookup.table_weights().values())
    emb += sum(v.numel() * 4 for k in model.sparse_arch.embedding_bag_collection.fused_kernels()
               for s in k.optimizer_states() for v in s.values())
    queue.put(dict(seconds=seconds, emb_bytes=emb, max_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def _collect(queue, procs, count: int) -> list:
    """Results from the children; stop (instead of waiting forever) when one dies without one."""
    import queue as queue_mod

    out = []
    while len(out) < count:
        try:
            out.append(queue.get(timeout=5))
        except queue_mod.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                codes = [p.exitcode for p in procs]
                raise SystemExit(f"a benchmark process died (exit codes {codes}); see stderr") from None
    return out


class TrainStep(torch.nn.Module):
    """batch -> (loss, logits): the form TrainPipelineSparseDist runs (and the plain loop here too)."""

    def __init__(self, dlrm) -> None:
        super().__init__()
        self.dlrm = dlrm

    def forward(self, batch):
        logits = self.dlrm(batch.dense_features, batch.sparse_features).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), batch.labels), logits


def pipeline_loader(rank: int, batch: int, batches: int, rows: int = ROWS):
    from lightning_rec.data.synthetic import SyntheticCriteoDataModule

    data = SyntheticCriteoDataModule(num_train_samples=batch * batches, num_val_samples=batch, batch_size=batch,
                                     num_embeddings_per_feature=rows, sparse_feature_names=[f"f{i}" for i in
                                                                                             range(NUM_TABLES)],
                                     seed=rank, shuffle=True)
    data.setup("fit")
    return data.train_dataloader()


def _timed_steps(step, steps: int, warmup: int, cpu: list | None = None) -> list[float]:
    """Seconds of each timed `step()` (end to end); `cpu` gets the main thread's CPU seconds of them."""
    ends = []
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            ends.append(time.perf_counter())
            cpu0 = time.thread_time()
        step()
        if i >= warmup:
            ends.append(time.perf_counter())
    if cpu is not None:
        cpu.append(time.thread_time() - cpu0)
    return [b - a for a, b in zip(ends, ends[1:])]


def run_plain(dmp, opt, loader, steps: int, warmup: int, cpu: list | None = None) -> list[float]:
    """The plain loop over `loader` (the loader read in the step)."""
    it = iter(loader)

    def step() -> None:
        batch = next(it)
        opt.zero_grad()
        loss, _ = dmp(batch)
        loss.backward()
        opt.step()

    return _timed_steps(step, steps, warmup, cpu)


def pipeline_config(args):
    from lightning_rec.pipeline import PipelineConfig

    return PipelineConfig(read_ahead=args.read_ahead)


def run_pipelined(pipeline, loader, steps: int, warmup: int) -> list[float]:
    it = iter(loader)
    return _timed_steps(lambda: pipeline.progress(it), steps, warmup)


def pipeline_rank_main(rank: int, world_size: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    from lightning_rec.model_parallel import DistributedModelParallel
    from lightning_rec.optim import CombinedOptimizer, dense_parameters
    from lightning_rec.pipeline import TrainPipelineSparseDist

    kind = args.types[0]
    dlrm = build_model("meta", args.rows)
    model = TrainStep(dlrm)
    plan = plan_for(kind, dlrm, world_size, args.batch)
    plan.plan = {f"dlrm.{k}": v for k, v in plan.plan.items()}
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=120)
    opt = CombinedOptimizer([("fused", dmp.fused_optimizer),
                             ("dense", torch.optim.Adagrad(dense_parameters(dmp), lr=0.01))])
    loader = pipeline_loader(rank, args.batch, args.warmup + args.steps + 2, args.rows)
    times: dict[str, list[list[float]]] = {"plain": [], "pipelined": []}  # per round, per step
    plain_cpu: list[float] = []  # the plain loop's main-thread CPU seconds per round
    profiles, read_ahead = {}, None
    for r in range(args.rounds):
        for mode in ("plain", "pipelined") if r % 2 == 0 else ("pipelined", "plain"):
            if mode == "plain":
                seconds = run_plain(dmp, opt, loader, args.steps, args.warmup, plain_cpu)
            else:  # a new pipeline each round: built, used, thrown away over the same model
                with TrainPipelineSparseDist(dmp, opt, "cpu", pipeline_config(args)) as pipeline:
                    seconds = run_pipelined(pipeline, loader, args.steps, args.warmup)
                    read_ahead = pipeline.read_ahead
            times[mode].append(seconds)
    if args.profile:  # one instrumented round of each: where the loader and the id routing ran
        for mode in ("plain", "pipelined"):
            profiles[mode] = timeline_round(dmp, opt, loader, mode, args.steps, pipeline_config(args))
    queue.put((rank, dict(times=times, profiles=profiles, plain_cpu=plain_cpu, read_ahead=read_ahead,
                          max_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)))
    dist.barrier()
    dist.destroy_process_group()


class Timeline:
    """Seconds per (thread, stage): the main thread's are the step's critical path; the feeder's run beside it."""

    def __init__(self) -> None:
        import threading

        self.main = threading.main_thread()
        self.seconds: dict[tuple[str, str], float] = {}

    def add(self, stage: str, seconds: float) -> None:
        import threading

        key = ("main" if threading.current_thread() is self.main else "feeder", stage)
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds

    def timed(self, stage: str, fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(stage, time.perf_counter() - t)

        return run


class TimedLoader:
    """The loader, its iterators' __next__ timed (in whichever thread reads them)."""

    def __init__(self, loader, timeline: Timeline) -> None:
        self.loader, self.timeline = loader, timeline

    def __iter__(self):
        it = iter(self.loader)
        timed = self.timeline.timed("read batch (DataLoader)", it.__next__)

        class _It:
            def __iter__(self):
                return self

            def __next__(self):
                return timed()

        return _It()


def timeline_round(dmp, opt, loader, mode: str, steps: int, config) -> dict[str, float]:
    """ms per step by (thread, stage), one instrumented round: where the loader and the routing ran."""
    from lightning_rec.pipeline import TrainPipelineSparseDist
    from lightning_rec.sharded_embedding import _ShardedCollectionBase

    timeline = Timeline()
    sharded = [m for m in dmp.modules() if isinstance(m, _ShardedCollectionBase)]
    for m in sharded:  # instance attributes shadow the methods for this round only
        m.route = timeline.timed("id routing (input_dist)", type(m).route.__get__(m))
        m.input_dist = timeline.timed("input_dist call in the step (routes, or takes the routed batch)",
                                      type(m).input_dist.__get__(m))
    timed_loader = TimedLoader(loader, timeline)
    total = Timeline()
    try:
        if mode == "plain":
            seconds = sum(run_plain(dmp, opt, timed_loader, steps, 0))
        else:
            with TrainPipelineSparseDist(dmp, opt, "cpu", config) as pipeline:
                seconds = sum(run_pipelined(pipeline, timed_loader, steps, 0))
    finally:
        for m in sharded:
            del m.route, m.input_dist
    del total
    out = {f"{thread}: {stage}": 1e3 * v / steps for (thread, stage), v in sorted(timeline.seconds.items())}
    out["main: whole step"] = 1e3 * seconds / steps
    return out


def pipeline_main(args) -> None:
    world_size = 2
    load_before = os.getloadavg()[0]
    ctx = start_method(args.smoke)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=pipeline_rank_main, args=(r, world_size, port, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    per_rank = dict(_collect(queue, procs, len(procs)))
    for p in procs:
        p.join()
    global_batch = world_size * args.batch
    rounds = len(per_rank[0]["times"]["plain"])
    # a step ends on both ranks at about the same time (they meet in its collectives): the slower rank's
    steps = {m: [[max(per_rank[r]["times"][m][i][j] for r in per_rank) for j in range(args.steps)]
                 for i in range(rounds)] for m in ("plain", "pipelined")}
    sps = {m: [global_batch * len(v) / sum(v) for v in per_round] for m, per_round in steps.items()}
    ratio_per_round = [p / q for p, q in zip(sps["pipelined"], sps["plain"])]
    # The figure: median step time over every timed step of each mode. A shared machine's load can swing 3x
    # within a minute; medians of many short, interleaved samples are what survives that.
    median_step = {m: statistics.median(t for per_round in v for t in per_round) for m, v in steps.items()}
    print(f"DLRM 26 x {args.rows:,} x 64, 2 ranks ({args.types[0]}), batch {args.batch}/rank from a DataLoader "
          f"(SyntheticCriteoDataModule), {args.steps} timed steps, {rounds} alternating rounds")
    read_ahead, why = per_rank[0]["read_ahead"]
    print(f"pipeline read-ahead: {read_ahead} ({why})")
    print(f"{'round':<8}{'plain samples/s':>18}{'pipelined samples/s':>22}{'ratio':>8}")
    for i in range(rounds):
        print(f"{i + 1:<8}{sps['plain'][i]:>18.0f}{sps['pipelined'][i]:>22.0f}{ratio_per_round[i]:>8.3f}")
    print(f"{'median':<8}{statistics.median(sps['plain']):>18.0f}{statistics.median(sps['pipelined']):>22.0f}"
          f"{statistics.median(ratio_per_round):>8.3f}   (of the rounds)")
    med = {m: global_batch / median_step[m] for m in median_step}
    ratio = median_step["plain"] / median_step["pipelined"]
    print(f"{'step':<8}{med['plain']:>18.0f}{med['pipelined']:>22.0f}{ratio:>8.3f}   (median step time over "
          f"{rounds * args.steps} steps per mode: the figure)")
    # What a pipeline can gain here at most: the feeder only helps where the step's thread leaves its
    # core idle (waiting for a peer, in a sleep). Busy = the plain loop's main-thread CPU time over its
    # wall time, per rank per round; with every core busy, moving work to another thread saves nothing.
    busy = statistics.median(per_rank[r]["plain_cpu"][i] / sum(per_rank[r]["times"]["plain"][i])
                             for r in per_rank for i in range(rounds))
    print(f"plain loop: the step's thread is busy {100 * busy:.1f}% of the step (its CPU time / wall time, median "
          f"over ranks and rounds): overlapping can gain at most {1 / busy:.3f}x on this machine")
    profiles = per_rank[0].get("profiles", {})
    if profiles:
        print("\ntimeline, rank 0, ms per step (one instrumented round each; main = the step's critical path"
              + ("; inline: the feeder's stages too, run while the step's thread waits)" if read_ahead == "inline"
                 else ")"))
        stages = sorted({k for p in profiles.values() for k in p})
        print(f"{'thread: stage':<80}{'plain':>9}{'pipelined':>11}")
        for k in stages:
            cells = "".join(f"{profiles[m].get(k, 0.0):>{w}.2f}" for m, w in (("plain", 9), ("pipelined", 11)))
            print(f"{k:<80}{cells}")
    offload_bound = None
    if "plain" in profiles:  # with a free core per rank: the work a feeder can take off the step, at most
        plain = profiles["plain"]
        movable = plain.get("main: read batch (DataLoader)", 0.0) + plain.get("main: id routing (input_dist)", 0.0)
        offload_bound = plain["main: whole step"] / (plain["main: whole step"] - movable)
        print(f"with an idle core per rank, moving the read ({plain.get('main: read batch (DataLoader)', 0.0):.2f} ms) "
              f"and the id routing ({plain.get('main: id routing (input_dist)', 0.0):.2f} ms) off a "
              f"{plain['main: whole step']:.1f} ms step gains at most {offload_bound:.3f}x")
    rows = [dict(run=f"2_ranks_{args.types[0]}_{m}", samples_per_s=round(med[m], 1)) for m in ("plain", "pipelined")]
    figures = {"plain_samples_per_s": round(med["plain"], 1), "pipelined_samples_per_s": round(med["pipelined"], 1),
               "read_ahead": read_ahead, "read_ahead_why": why, "usable_cores": len(os.sched_getaffinity(0)),
               "median_of_round_ratios": round(statistics.median(ratio_per_round), 3),
               "plain_step_thread_busy_fraction": round(busy, 4), "overlap_bound_vs_plain": round(1 / busy, 3),
               **({"offload_bound_vs_plain": round(offload_bound, 3)} if offload_bound else {}),
               # a shared machine: with more runnable threads than cores, the pipelined run's second thread
               # also gets a larger share of the CPU, which a dedicated machine would not give
               "load_avg_1min_before": round(load_before, 2), "load_avg_1min_after": round(os.getloadavg()[0], 2),
               "plain_median_step_ms": round(1e3 * median_step["plain"], 2),
               "pipelined_median_step_ms": round(1e3 * median_step["pipelined"], 2),
               **{f"timeline_ms_per_step.{m}.{k}": round(v, 2) for m, p in profiles.items() for k, v in p.items()},
               "peak_rss_mb_per_rank": round(max(per_rank[r]["max_rss"] for r in per_rank) / 2**20, 1)}
    print(json.dumps({"benchmark": "dlrm_distributed", "results": rows,
                      "ratios": {"pipelined_vs_plain": round(ratio, 3)}, "figures": figures}))
    sys.stdout.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1024, help="per rank")
    parser.add_argument("--rows", type=int, default=ROWS, help="rows per table")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; figures are medians")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--dense", default="ddp", choices=["ddp", "fsdp", "none"],
                        help="none: dense layers not synchronised (diagnostic: the cost of DDP)")
    parser.add_argument("--pipeline", action="store_true",
                        help="plain loop vs TrainPipelineSparseDist, batches from a DataLoader (first of --types)")
    parser.add_argument("--read-ahead", default="auto", choices=["auto", "thread", "inline"],
                        help="--pipeline: PipelineConfig(read_ahead=...), where the feeder works")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: 1,000-row tables, batch 64, 2 steps, 1 round (the same code path)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.batch, args.steps, args.warmup, args.rounds = 1000, 64, 2, 1, 1
    args.types = [t for t in args.types.split(",") if t]
    return args


def _one_round(args, ctx, world_size: int) -> tuple[dict, dict]:
    """The 2-rank run (every --types entry), then the one-process run: (per-rank results, one-process result)."""
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    per_rank = dict(_collect(queue, procs, len(procs)))
    for p in procs:
        p.join()

    single_q = ctx.Queue()
    p = ctx.Process(target=one_process_main, args=(args, single_q))
    p.start()
    single = _collect(single_q, [p], 1)[0]
    p.join()
    return per_rank, single


def _medians(args, rounds: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Per rank and the one process: seconds as the median over rounds, the peak RSS as the max."""
    per_rank = {r: {k: dict(rounds[0][0][r][k], seconds=statistics.median(x[0][r][k]["seconds"] for x in rounds))
                    for k in args.types} | {"max_rss": max(x[0][r]["max_rss"] for x in rounds)}
                for r in rounds[0][0]}
    if "profile" in rounds[0][0].get(0, {}):
        per_rank[0]["profile"] = rounds[0][0][0]["profile"]
    single = dict(rounds[0][1], seconds=statistics.median(x[1]["seconds"] for x in rounds),
                  max_rss=max(x[1]["max_rss"] for x in rounds))
    return per_rank, single


def _guard_ratios(args, figures: dict) -> dict:
    """The guard's cost: guarded over unguarded throughput, same run (entries ending in @noguard)."""
    ratios = {}
    for kind in args.types:
        base, _, options = kind.partition("@")
        if "noguard" in options.split("+"):
            guarded = base + ("@" + options.replace("+noguard", "").replace("noguard", "")).rstrip("@")
            if guarded in args.types:
                ratios[f"{guarded}_guard_over_noguard"] = round(
                    figures[f"{guarded}_samples_per_s"] / figures[f"{kind}_samples_per_s"], 3)
    return ratios


def report(args, per_rank: dict, single: dict, world_size: int) -> None:
    """The table, the profile, then the JSON line."""
    global_batch = world_size * args.batch
    one = global_batch * args.steps / single["seconds"]
    rows, figures = [], {"one_process_samples_per_s": round(one, 1)}
    print(f"DLRM, 26 x {args.rows:,} x 64 tables, global batch {global_batch}, {args.steps} timed steps, "
          f"median of {args.rounds} alternating rounds")
    print(f"{'run':<28}{'samples/s':>12}{'vs 1 proc':>11}{'emb MB/rank':>13}{'peak RSS MB/rank':>18}")
    print(f"{'one process x 2 threads':<28}{one:>12.0f}{1.0:>11.2f}{single['emb_bytes'] / 2**20:>13.1f}"
          f"{single['max_rss'] / 2**20:>18.0f}")
    rows.append(dict(run="one_process", samples_per_s=round(one, 1), emb_mb=single["emb_bytes"] / 2**20))
    for kind in args.types:
        seconds = max(per_rank[r][kind]["seconds"] for r in per_rank)
        sps = global_batch * args.steps / seconds
        emb = max(per_rank[r][kind]["emb_bytes"] for r in per_rank) / 2**20
        rss = max(per_rank[r]["max_rss"] for r in per_rank) / 2**20
        print(f"{'2 ranks ' + kind:<28}{sps:>12.0f}{sps / one:>11.2f}{emb:>13.1f}{rss:>18.0f}")
        figures[f"{kind}_samples_per_s"] = round(sps, 1)
        rows.append(dict(run=f"2_ranks_{kind}", samples_per_s=round(sps, 1), emb_mb_per_rank=round(emb, 1),
                         vs_one_process=round(sps / one, 3)))
    figures["one_process_emb_mb"] = round(single["emb_bytes"] / 2**20, 1)
    figures["two_rank_peak_rss_mb"] = round(max(per_rank[r]["max_rss"] for r in per_rank) / 2**20, 1)
    figures["one_process_peak_rss_mb"] = round(single["max_rss"] / 2**20, 1)
    if "profile" in per_rank.get(0, {}):
        print("\nrank 0, table-wise, 5 steps (self CPU time):")
        print(per_rank[0]["profile"])
    ratios = {}
    if "table_wise" in args.types:
        ratios["two_rank_vs_one_process"] = round(figures["table_wise_samples_per_s"] / one, 3)
    ratios.update(_guard_ratios(args, figures))
    print(json.dumps({"benchmark": "dlrm_distributed", "results": rows, "ratios": ratios, "figures": figures}))
    sys.stdout.flush()


def main() -> None:
    args = parse_args()
    if args.pipeline:
        pipeline_main(args)
        return
    world_size = 2
    ctx = start_method(args.smoke)
    # Rounds alternate the 2-rank run and the one-process run, and each figure is the median over
    # rounds: a VM's speed drifts by 10-20% between windows, and alternating puts both sides of
    # every ratio in the same windows. Only the first round profiles.
    rounds: list[tuple[dict, dict]] = []
    for i in range(args.rounds):
        args.profile_now = args.profile and i == 0
        per_rank, single = _one_round(args, ctx, world_size)
        rounds.append((per_rank, single))
        if args.rounds > 1:
            seconds = {k: max(per_rank[r][k]["seconds"] for r in per_rank) for k in args.types}
            print(f"round {i + 1}: one process {single['seconds']:.2f} s, " +
                  ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items()), flush=True)
    report(args, *_medians(args, rounds), world_size)


if __name__ == "__main__":
    main()
