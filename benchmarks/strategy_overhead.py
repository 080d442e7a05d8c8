"""What Lightning costs: Trainer(strategy="rec") vs a hand loop over the same DistributedModelParallel model.

    flock /tmp/lightning_rec_bench.lock python benchmarks/strategy_overhead.py [--steps 20] [--rounds 3]
    python benchmarks/strategy_overhead.py --smoke      # seconds: 1,000-row tables, batch 64, 2 steps, one round

The model is benchmarks/dlrm_distributed.py's DLRM (26 tables x 100,000 rows x dim 64, fused
row-wise Adagrad, dense Adagrad, batch 1024 per rank), sharded table-wise over 2 ranks (1 thread
each, gloo + shared memory), dense layers in DDP. Both variants get the same pre-built batches:

    loop      DistributedModelParallel(model) + CombinedOptimizer; forward, BCE, backward, step
    trainer   the same model in a LightningModule, Trainer(strategy=RecStrategy(plan=the same
              plan)), max_steps, no logger / checkpoints / progress bar (what a tuned run turns off)

Timing starts after `--warmup` steps on both (a barrier first) and ends after `--steps` more;
set-up (sharding, DDP) and the end of training (Lightning's epoch-end hooks, teardown) are outside
it: the figure is the cost per step. The variants alternate over `--rounds` rounds; the figure is
the median over rounds of steps/s, and ratios.trainer_vs_loop = trainer steps/s / loop steps/s.
Last line: {"benchmark": "strategy_overhead", "results": [...], "ratios": {...}, "figures": {...}}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # free_port, collect_rows: tests/dist_utils.py
import dlrm_distributed as bench  # noqa: E402  (the model, batches and plan of the distributed benchmark)
from dist_utils import collect_rows, free_port  # noqa: E402

BATCH = 1024


def run_loop(batches, steps: int, warmup: int, world_size: int, rows: int, batch: int) -> float:
    from lightning_rec.model_parallel import DistributedModelParallel
    from lightning_rec.optim import combined_optimizer, dense_parameters

    model = bench.build_model(rows=rows)
    plan = bench.plan_for("table_wise", model, world_size, batch)
    dmp = DistributedModelParallel(model, plan=plan, device="cpu")
    optimizer = combined_optimizer(dmp.module, torch.optim.Adagrad(dense_parameters(dmp.module), lr=0.01))
    seconds = bench.train(dmp, optimizer, batches, steps, warmup)
    del dmp, optimizer, model
    gc.collect()
    return seconds


def run_trainer(batches, steps: int, warmup: int, world_size: int, rows: int, batch: int) -> float:
    import lightning.pytorch as L

    from lightning_rec.optim import combined_optimizer, dense_parameters
    from lightning_rec.strategy import RecStrategy
    from lightning_rec.types import ShardingPlan

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = bench.build_model(rows=rows)
            self.loss_fn = torch.nn.BCEWithLogitsLoss()

        def training_step(self, batch, batch_idx):
            dense, sparse, labels = batch
            return self.loss_fn(self.model(dense, sparse), labels)

        def configure_optimizers(self):
            return combined_optimizer(self.model, torch.optim.Adagrad(dense_parameters(self.model), lr=0.01))

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == warmup:
                dist.barrier()
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == warmup + steps - 1:  # the last timed step, as the loop's clock stops after it
                self.seconds = time.perf_counter() - self.start

    module = Module()
    inner = bench.plan_for("table_wise", module.model, world_size, batch).plan
    plan = ShardingPlan({f"model.{path}": p for path, p in inner.items()})
    clock = Clock()
    data = torch.utils.data.DataLoader([batches[i % len(batches)] for i in range(steps + warmup)], batch_size=None)
    trainer = L.Trainer(strategy=RecStrategy(plan=plan), accelerator="cpu", devices=world_size,
                        max_steps=steps + warmup, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[clock])
    trainer.fit(module, data)
    del trainer, module
    gc.collect()
    return clock.seconds


def rank_main(rank: int, world_size: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=600))
    batches = bench.make_batches(args.batch, 4, seed=rank, rows=args.rows)
    out = []
    for r in range(args.rounds):
        order = ["loop", "trainer"] if r % 2 == 0 else ["trainer", "loop"]
        for kind in order:
            run = run_loop if kind == "loop" else run_trainer
            seconds = run(batches, args.steps, args.warmup, world_size, args.rows, args.batch)
            out.append({"round": r, "variant": kind, "rank": rank, "seconds": seconds,
                        "steps_per_s": args.steps / seconds})
    queue.put(out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=bench.ROWS, help="rows per table")
    parser.add_argument("--batch", type=int, default=BATCH, help="per rank")
    parser.add_argument("--smoke", action="store_true", help="seconds: 1,000-row tables, batch 64, 2 steps, one round")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.batch, args.steps, args.warmup, args.rounds = 1000, 64, 2, 1, 1
    world_size = 2
    if args.smoke:  # fork: the ranks start with torch and lightning_rec imported once (spawn: seconds a rank)
        import lightning.pytorch  # noqa: F401

        import lightning_rec.model_parallel  # noqa: F401
        import lightning_rec.models.dlrm  # noqa: F401
        import lightning_rec.strategy  # noqa: F401
    ctx = mp.get_context("fork" if args.smoke else "spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    rows = collect_rows(queue, procs)
    for p in procs:
        p.join()

    def per_round(kind):  # a step takes as long as the slowest rank
        rounds = {}
        for row in rows:
            if row["variant"] == kind:
                rounds[row["round"]] = max(rounds.get(row["round"], 0.0), row["seconds"])
        return [args.steps / s for _, s in sorted(rounds.items())]

    loop, trainer = per_round("loop"), per_round("trainer")
    ratios_by_round = [t / lo for t, lo in zip(trainer, loop)]
    print(f"strategy_overhead: DLRM 26 x {args.rows:,} x 64, batch {args.batch} per rank, {world_size} ranks, "
          f"table-wise; {args.steps} timed steps after {args.warmup}; {args.rounds} rounds, alternating")
    print(f"{'round':>5} {'loop steps/s':>13} {'trainer steps/s':>16} {'trainer/loop':>13}")
    for i, (lo, t, q) in enumerate(zip(loop, trainer, ratios_by_round)):
        print(f"{i:>5} {lo:>13.3f} {t:>16.3f} {q:>13.3f}")
    results = [{"variant": "loop", "steps_per_s": statistics.median(loop), "per_round": loop},
               {"variant": "trainer", "steps_per_s": statistics.median(trainer), "per_round": trainer}]
    ratios = {"trainer_vs_loop": statistics.median(ratios_by_round)}
    figures = {"loop_steps_per_s": statistics.median(loop), "trainer_steps_per_s": statistics.median(trainer),
               "batch_per_rank": args.batch, "world_size": world_size, "steps": args.steps, "rounds": args.rounds}
    print(f"median trainer/loop: {ratios['trainer_vs_loop']:.3f}")
    print(json.dumps({"benchmark": "strategy_overhead", "results": results, "ratios": ratios, "figures": figures}))


if __name__ == "__main__":
    main()
