"""DLRM training throughput: 2 ranks x 1 thread (gloo) per sharding type vs one process x 2 threads.

    python benchmarks/dlrm_distributed.py [--steps 20] [--rounds 3] [--types table_wise,row_wise,...]

`--types` entries may end in `@gloo` (e.g. `table_wise@gloo`): the same run with every collective
over gloo's TCP instead of shared memory (DistributedModelParallel(shared_memory=False)), the
transport before shm_transport.py, for a same-run comparison.

An entry may also end in `@noguard` (or `@gloo+noguard`): the same run with the collective guard
off (LIGHTNING_REC_COLLECTIVE_GUARD=0, lightning_rec/collective_guard.py), to measure what it costs.

`--types` may also name `planner` (the plan EmbeddingShardingPlanner picks for this model);
benchmarks/planner.py runs it that way to put measured step times next to its estimates.

Model (issue 4): 13 dense features -> dense arch 512-256-64; 26 tables x 100,000 rows x dim 64, sum
pooling, one id per feature; over arch 512-512-256-1; fused row-wise Adagrad (lr 0.01) for the
embeddings, torch Adagrad for the dense layers. Distributed: batch 1024 per rank, the dense layers
in DDP, the tables sharded by DistributedModelParallel. One process: the unsharded model, batch
2048, 2 threads. Both run in this script one after the other, so the ratio compares like with like.
Per rank it prints the embedding bytes it holds (weights + optimizer state) and its peak RSS, and
rank 0 profiles a few table-wise steps (where the time goes).
Last line: {"benchmark": "dlrm_distributed", "results": [...], "ratios": {...}, "figures": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NUM_TABLES, ROWS, DIM, DENSE_IN = 26, 100_000, 64, 13
DENSE_ARCH, OVER_ARCH = [512, 256, 64], [512, 512, 256, 1]
TYPES = ["table_wise", "row_wise", "column_wise", "table_row_wise", "grid_shard", "data_parallel"]


def build_model(device: str = "cpu"):
    from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig
    from lightning_rec.optim import FusedOptimizerConfig

    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f"f{i}"])
              for i in range(NUM_TABLES)]
    ebc = EmbeddingBagCollection(tables, device=device, optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.01))
    try:
        from lightning_rec.models.dlrm import DLRM
    except ImportError:  # pragma: no cover
        raise SystemExit("lightning_rec.models.dlrm is missing") from None
    torch.manual_seed(0)
    return DLRM(ebc, DENSE_IN, DENSE_ARCH, OVER_ARCH)


def make_batches(batch: int, count: int, seed: int):
    from lightning_rec.sparse import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    keys = [f"f{i}" for i in range(NUM_TABLES)]
    out = []
    for _ in range(count):
        dense = torch.rand(batch, DENSE_IN, generator=g)
        values = torch.randint(0, ROWS, (NUM_TABLES * batch,), generator=g)
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
    from lightning_rec.optim import CombinedOptimizer

    batches = make_batches(args.batch, 4, seed=rank + 1)
    results = {}
    for kind in args.types:
        model = build_model("meta")  # tables are built where their shards live, never whole
        dense = None if args.dense == "none" else args.dense
        sharding, _, options = kind.partition("@")  # "table_wise@gloo": embedding + DDP traffic over gloo TCP
        options = set(options.split("+"))  # "table_wise@gloo+noguard": and without the collective guard
        os.environ["LIGHTNING_REC_COLLECTIVE_GUARD"] = "0" if "noguard" in options else "1"
        plan = plan_for(sharding, model, world_size, args.batch)
        dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=120, dense=dense,
                                       shared_memory=False if "gloo" in options else None)
        opt = CombinedOptimizer([("fused", dmp.fused_optimizer),
                                 ("dense", torch.optim.Adagrad(dmp.parameters(), lr=0.01))])
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
    model = build_model("cpu")
    from lightning_rec.optim import combined_optimizer

    opt = combined_optimizer(model, torch.optim.Adagrad([p for p in model.parameters() if p.requires_grad], lr=0.01))
    batches = make_batches(2 * args.batch, 4, seed=0)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1024, help="per rank")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; figures are medians")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--dense", default="ddp", choices=["ddp", "fsdp", "none"],
                        help="none: dense layers not synchronised (diagnostic: the cost of DDP)")
    args = parser.parse_args()
    args.types = [t for t in args.types.split(",") if t]
    world_size = 2
    ctx = mp.get_context("spawn")

    # Rounds alternate the 2-rank run and the one-process run, and each figure is the median over
    # rounds: this VM's speed drifts by 10-20% between windows, and alternating puts both sides of
    # every ratio in the same windows. Only the first round profiles.
    rounds: list[tuple[dict, dict]] = []
    for i in range(args.rounds):
        args.profile_now = args.profile and i == 0
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
        rounds.append((per_rank, single))
        if args.rounds > 1:
            seconds = {k: max(per_rank[r][k]["seconds"] for r in per_rank) for k in args.types}
            print(f"round {i + 1}: one process {single['seconds']:.2f} s, " +
                  ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items()), flush=True)
    per_rank = {r: {k: dict(rounds[0][0][r][k], seconds=statistics.median(x[0][r][k]["seconds"] for x in rounds))
                    for k in args.types} | {"max_rss": max(x[0][r]["max_rss"] for x in rounds)}
                for r in rounds[0][0]}
    if "profile" in rounds[0][0].get(0, {}):
        per_rank[0]["profile"] = rounds[0][0][0]["profile"]
    single = dict(rounds[0][1], seconds=statistics.median(x[1]["seconds"] for x in rounds),
                  max_rss=max(x[1]["max_rss"] for x in rounds))

    global_batch = world_size * args.batch
    one = global_batch * args.steps / single["seconds"]
    rows, figures = [], {"one_process_samples_per_s": round(one, 1)}
    print(f"DLRM, 26 x 100k x 64 tables, global batch {global_batch}, {args.steps} timed steps, "
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
    for kind in args.types:  # the guard's cost: guarded over unguarded throughput, same run
        base, _, options = kind.partition("@")
        if "noguard" in options.split("+"):
            guarded = base + ("@" + options.replace("+noguard", "").replace("noguard", "")).rstrip("@")
            if guarded in args.types:
                ratios[f"{guarded}_guard_over_noguard"] = round(
                    figures[f"{guarded}_samples_per_s"] / figures[f"{kind}_samples_per_s"], 3)
    print(json.dumps({"benchmark": "dlrm_distributed", "results": rows, "ratios": ratios, "figures": figures}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
