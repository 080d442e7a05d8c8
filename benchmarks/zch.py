"""Managed-collision (ZCH) tables vs modulo folding on Criteo: collisions, validation AUC, remapping cost.

    flock /tmp/lightning_rec_bench.lock .venv/bin/python benchmarks/zch.py [--seeds 0 1 2] [--epochs 3] [--ranks 2]
    .venv/bin/python benchmarks/zch.py --smoke      # seconds: 1,024 rows, one seed, one epoch

Data: the Criteo samples in $LIGHTNING_REC_SHARED_DATA/criteo (train: criteo_kaggle_train_sample.tsv, validation:
criteo_kaggle_valid_sample.tsv); without them, Zipf-distributed synthetic ids. Each table has --rows-fraction
(default 0.1: 10%) of its feature's distinct training ids as rows (at least 2). Modulo: `1 + v % (n - 1)` (row 0:
missing). ZCH: raw ids through an MCHManagedCollisionModule (zch_size = n, LFU, eviction every --interval steps, a
new id admitted at its --min-count-th lookup: one-off ids read the unknown row instead of taking a row). The same
DLRM (dim 16), fused row-wise Adagrad on the tables and Adam on the dense layers, trained for --epochs in the same
batch order. With --ranks N (> 1) the step cost is measured under DistributedModelParallel on N gloo ranks of one
thread each (tables row-wise, those under 4 rows a rank table-wise; ZCH: each rank keeps its row shards' id maps and
remaps after the id all-to-all), both arms in the same run, alternating rounds of --steps steps.

Collision rate (over the --epochs passes, missing values left out): the share of training lookups that read a row
more than one distinct id read during training (ZCH: the shared unknown row, or a row evicted and reused);
`id_collision_rate_*` counts distinct ids instead; `moment_collision_rate_*` is TorchRec's benchmark_zch count
(total - hits - inserts): the row read holds another id's training at that moment. `collision_rate_bound`: the
least lifetime rate any id map can reach with these table sizes (the most frequent ids own the rows from the start,
every other id shares the unknown row); `collision_rate_modulo_vs_bound` is the most that
`collision_rate_modulo_vs_zch` can be. Step cost: the median training step with ZCH over the one without,
alternating rounds, one process. The last line is one JSON object: {"benchmark": "zch", "results": [...], "ratios":
{"collision_rate_modulo_vs_zch", "id_collision_rate_modulo_vs_zch", "moment_collision_rate_modulo_vs_zch",
"collision_rate_modulo_vs_bound", "step_with_zch_vs_without"}, "figures": {"auc_zch_minus_modulo",
"auc_zch_minus_modulo_spread", "auc_modulo", "auc_zch", "collision_rate_modulo", "collision_rate_zch",
"collision_rate_bound", ...}}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.data.criteo.datasets import make_criteo_batch
from lightning_rec.data.criteo.parse import read_criteo
from lightning_rec.managed_collision import (
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    MCHManagedCollisionModule,
)
from lightning_rec.metrics import AUC
from lightning_rec.models.dlrm import DLRM
from lightning_rec.optim.config import FusedOptimizerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dist_utils import collect_rows, free_port  # noqa: E402  (tests/dist_utils.py)

KEYS = [f"C{i}" for i in range(1, 27)]
DIM = 16


def load(path: Path, rows: int | None):
    parts = [t for t, _ in read_criteo(path)]
    label = np.concatenate([t["label"].to_numpy() for t in parts])
    dense = np.concatenate([t["dense"].combine_chunks().flatten().to_numpy().reshape(-1, 13) for t in parts])
    sparse = np.concatenate([t["sparse"].combine_chunks().flatten().to_numpy().reshape(-1, 26) for t in parts])
    return label[:rows], dense[:rows].astype(np.float32), sparse[:rows].astype(np.int64)


def synthetic(rows: int, seed: int):
    g = np.random.default_rng(seed)
    sparse = (g.zipf(1.3, (rows, 26)) * 2_654_435_761) % (1 << 32)
    weight = g.normal(size=26)
    label = ((np.log(sparse % 97 + 1) @ weight + g.normal(size=rows)) > 0).astype(np.float32)
    return label, g.normal(size=(rows, 13)).astype(np.float32), sparse.astype(np.int64)


def batches(data, sizes: np.ndarray, batch: int, hash_ids: bool):
    label, dense, sparse = data
    return [make_criteo_batch(label[i:i + batch], dense[i:i + batch], sparse[i:i + batch], sizes, KEYS,
                              hash_ids=hash_ids) for i in range(0, len(label), batch)]


class _Remapped(nn.Module):
    """The MC collection where DLRM reads its EBC: KJT of raw ids -> KeyedTensor."""

    def __init__(self, mc: ManagedCollisionEmbeddingBagCollection) -> None:
        super().__init__()
        self.mc = mc
        self.embedding_bag_configs = mc._embedding_module.embedding_bag_configs
        self.feature_names = mc._embedding_module.feature_names

    def forward(self, features):
        return self.mc(features)[0]


def build(sizes: np.ndarray, zch: bool, seed: int, interval: int, min_count: int):
    torch.manual_seed(seed)
    tables = [EmbeddingBagConfig(name=f"t_{k}", num_embeddings=int(n), embedding_dim=DIM, feature_names=[k])
              for k, n in zip(KEYS, sizes)]
    ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.05))
    model = DLRM(ebc, 13, [32, DIM], [32, 1])
    if zch:
        mcc = ManagedCollisionCollection({t.name: MCHManagedCollisionModule(
            t.num_embeddings, eviction_policy="lfu", eviction_interval=interval, min_count_to_admit=min_count)
            for t in tables}, tables)
        model.sparse_arch.embedding_bag_collection = _Remapped(ManagedCollisionEmbeddingBagCollection(ebc, mcc))
    dense = [p for n, p in model.named_parameters() if "embedding_bag" not in n]
    return model, torch.optim.Adam(dense, lr=1e-3)


def step(model, opt, b) -> None:
    logits = model(b.dense_features, b.sparse_features).squeeze(-1)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, b.labels)
    opt.zero_grad()
    loss.backward()
    opt.step()


def auc(model, val) -> float:
    model.eval()
    metric = AUC()
    with torch.no_grad():
        for b in val:
            metric.update(model(b.dense_features, b.sparse_features).squeeze(-1), b.labels)
    model.train()
    return float(metric.compute())


def collision_rates(train, sizes: np.ndarray, zch: bool, interval: int, batch: int, min_count: int,
                    epochs: int) -> dict[str, float]:
    """Shares of training lookups (and of distinct ids) that collide, over `epochs` passes in training order.

    lifetime: the lookup reads a row that more than one distinct id read during the whole run (an evicted and reused
    row counts for both ids). moment (TorchRec's benchmark_zch count, total - hits - inserts): the row holds another
    id's training when it is read: modulo, another id read it at or before this step; ZCH, the shared unknown row
    (a reused row is re-initialised before its new id trains)."""
    mods = [MCHManagedCollisionModule(int(n), eviction_interval=interval, min_count_to_admit=min_count).train()
            for n in sizes]
    label, dense, sparse = train
    pairs = [[] for _ in KEYS]
    for e in range(epochs):
        for step, i in enumerate(range(0, len(label), batch), e * ((len(label) + batch - 1) // batch)):
            for f, m in enumerate(mods):
                raw = torch.from_numpy(sparse[i:i + batch, f])
                raw = raw[raw >= 0]
                rows = m(raw) if zch else 1 + raw % (int(sizes[f]) - 1)
                pairs[f].append(torch.stack([rows, raw, torch.full_like(raw, step)]))
    hit = moment = looked = shared_ids = ids = 0
    for f, p in enumerate(pairs):
        rows, raw, steps = torch.cat(p, dim=1)
        if not rows.numel():
            continue
        uniq = torch.unique(torch.stack([rows, raw]), dim=1)
        per_row = torch.bincount(uniq[0], minlength=int(sizes[f]))
        shared = per_row[rows] > 1
        hit, looked = hit + int(shared.sum()), looked + rows.numel()
        shared_ids, ids = shared_ids + torch.unique(raw[shared]).numel(), ids + torch.unique(raw).numel()
        if zch:
            moment += int((rows == mods[f].unknown_row).sum())
            continue
        # the step a row gets its second distinct id: from then on every read of it carries another id's training
        key, inverse = torch.unique(rows * (1 << 33) + raw, return_inverse=True)
        first = torch.full_like(key, 1 << 62).scatter_reduce_(0, inverse, steps, "amin")
        order = torch.argsort(first, stable=True)
        order = order[torch.argsort(key[order] >> 33, stable=True)]  # by row, then by first step
        per = torch.bincount(key >> 33, minlength=int(sizes[f]))
        start = torch.cumsum(per, 0) - per
        second = torch.where(per > 1, first[order][(start + 1).clamp(max=first.numel() - 1)], 1 << 62)
        moment += int((steps >= second[rows]).sum())
    return {"lifetime": hit / max(looked, 1), "ids": shared_ids / max(ids, 1), "moment": moment / max(looked, 1)}


def oracle_rate(train, sizes: np.ndarray) -> float:
    """The least lifetime collision rate any id map reaches: the n - 1 most frequent ids of each table own its rows
    from the start, never evicted, every other id on the unknown row (it knows the whole run in advance)."""
    shared = looked = 0
    for f, n in enumerate(sizes):
        col = train[2][:, f]
        counts = np.sort(np.unique(col[col >= 0], return_counts=True)[1])[::-1]
        shared, looked = shared + int(counts[int(n) - 1:].sum()), looked + int(counts.sum())
    return shared / max(looked, 1)


def rank_main(rank: int, port: int, args, sizes: np.ndarray, train, queue) -> None:
    """One rank of --ranks: the median step of each arm under DistributedModelParallel, alternating rounds."""
    import torch.distributed as dist

    from lightning_rec.model_parallel import (
        DistributedModelParallel,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from lightning_rec.types import ShardingPlan

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="managed-collision table")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    W, arms = args.ranks, ("modulo", "zch")
    runs = {}
    for arm in arms:
        model, _ = build(sizes, arm == "zch", 0, args.interval, args.min_count)
        path, ebc = next((n, m) for n, m in model.named_modules() if isinstance(m, EmbeddingBagCollection))
        layout = {c.name: row_wise() if c.num_embeddings >= 4 * W else table_wise(rank=i % W)
                  for i, c in enumerate(ebc.embedding_bag_configs())}
        plan = ShardingPlan({path: construct_module_sharding_plan(ebc, layout, world_size=W)})
        dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=300)
        dense = [p for n, p in dmp.module.named_parameters() if "embedding_bag" not in n]
        mine = batches(train, sizes, args.batch, arm == "modulo")[rank::W]
        runs[arm] = (dmp, torch.optim.Adam(dense, lr=1e-3), mine[: len(batches(train, sizes, args.batch, True)) // W])
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    at = 0
    for r in range(args.rounds + 1):  # round 0 warms up
        for arm in arms if r % 2 == 0 else arms[::-1]:
            dmp, opt, mine = runs[arm]
            t0 = time.perf_counter()
            for k in range(args.steps):
                step(dmp, opt, mine[(at + k) % len(mine)])
            if r:
                times[arm].append((time.perf_counter() - t0) / args.steps)
        at += args.steps
    queue.put([times] if rank == 0 else [])
    dist.barrier()
    dist.destroy_process_group()


def ranks_step_cost(args, sizes: np.ndarray, train) -> dict[str, float]:
    """arm -> median step seconds at --ranks ranks."""
    ctx = mp.get_context("fork" if args.smoke else "spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, args, sizes, train, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    (times,) = collect_rows(queue, procs)  # a rank that dies ends the run
    for p in procs:
        p.join()
    return {arm: statistics.median(t) for arm, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=1, help="> 1: the step cost at this many gloo ranks")
    parser.add_argument("--steps", type=int, default=10, help="--ranks: steps per timed round")
    parser.add_argument("--min-count", type=int, default=2,
                        help="min_count_to_admit: lookups a new id needs before it takes a row (1: at once)")
    parser.add_argument("--rows-fraction", type=float, default=0.1,
                        help="a table's rows: this share of its feature's distinct training ids (at least 2 rows)")
    parser.add_argument("--smoke", action="store_true", help="seconds: 1,024 rows, one seed, one epoch")
    args = parser.parse_args()
    if not args.rows_fraction > 0:  # NaN too
        parser.error(f"--rows-fraction {args.rows_fraction}: use a share > 0 (0.1: a tenth of the distinct ids)")
    warnings.filterwarnings("ignore", message="managed-collision table")  # churn on a small sample: expected
    rows = None
    if args.smoke:
        args.seeds, args.epochs, args.rounds, args.steps, rows = [0], 1, 1, 2, 1024
    root = Path(os.environ.get("LIGHTNING_REC_SHARED_DATA", "")) / "criteo"
    if (root / "criteo_kaggle_train_sample.tsv").exists():
        source = "criteo samples"
        train = load(root / "criteo_kaggle_train_sample.tsv", rows)
        val = load(root / "criteo_kaggle_valid_sample.tsv", rows)
    else:
        source = "synthetic zipf ids"
        train, val = synthetic(rows or 4096, 0), synthetic((rows or 4096) // 2, 1)
    distinct = np.array([len(np.unique(c[c >= 0])) for c in train[2].T])
    sizes = np.maximum(2, np.ceil(args.rows_fraction * distinct)).astype(np.int64)
    print(f"{source}: {len(train[0])} training rows, {int(distinct.sum())} distinct ids, {int(sizes.sum())} rows")
    rates = {arm: collision_rates(train, sizes, arm == "zch", args.interval, args.batch, args.min_count, args.epochs)
             for arm in ("modulo", "zch")}
    bound = oracle_rate(train, sizes)
    data = {arm: (batches(train, sizes, args.batch, arm == "modulo"), batches(val, sizes, 4096, arm == "modulo"))
            for arm in ("modulo", "zch")}
    aucs = {"modulo": [], "zch": []}
    times = {"modulo": [], "zch": []}
    for seed in args.seeds:
        models = {arm: build(sizes, arm == "zch", seed, args.interval, args.min_count) for arm in aucs}
        for _ in range(args.epochs):
            for i in range(len(data["modulo"][0])):
                for arm in aucs:  # alternating: the same moment of a busy machine for both
                    t0 = time.perf_counter()
                    step(*models[arm], data[arm][0][i])
                    times[arm].append(time.perf_counter() - t0)
        for arm in aucs:
            aucs[arm].append(auc(models[arm][0], data[arm][1]))
    diffs = [z - m for z, m in zip(aucs["zch"], aucs["modulo"])]
    step_s = {arm: statistics.median(t) for arm, t in times.items()}
    if args.ranks > 1:
        step_s = ranks_step_cost(args, sizes, train)
    results = [{"arm": arm, "collision_rate": rates[arm]["lifetime"], "id_collision_rate": rates[arm]["ids"],
                "collision_rate_moment": rates[arm]["moment"], "aucs": aucs[arm],
                "median_step_ms": step_s[arm] * 1e3} for arm in aucs]
    print(f"{'arm':<8}{'collide(lookups)':>18}{'collide(ids)':>14}{'AUC mean':>10}{'step ms':>9}")
    for r in results:
        print(f"{r['arm']:<8}{r['collision_rate']:>18.4f}{r['id_collision_rate']:>14.4f}"
              f"{statistics.mean(r['aucs']):>10.4f}{r['median_step_ms']:>9.2f}")
    ratios = {f"{name}_modulo_vs_zch": rates["modulo"][key] / max(rates["zch"][key], 1e-12) for name, key in
              (("collision_rate", "lifetime"), ("id_collision_rate", "ids"), ("moment_collision_rate", "moment"))}
    ratios |= {"collision_rate_modulo_vs_bound": rates["modulo"]["lifetime"] / max(bound, 1e-12),
              "step_with_zch_vs_without": step_s["zch"] / step_s["modulo"]}
    figures = {"auc_zch_minus_modulo": statistics.mean(diffs),
               "auc_zch_minus_modulo_spread": statistics.pstdev(diffs) if len(diffs) > 1 else 0.0,
               "auc_modulo": statistics.mean(aucs["modulo"]), "auc_zch": statistics.mean(aucs["zch"]),
               "collision_rate_modulo": rates["modulo"]["lifetime"], "collision_rate_zch": rates["zch"]["lifetime"],
               "collision_rate_bound": bound, "min_count_to_admit": args.min_count, "rows_fraction": args.rows_fraction,
               "seeds": len(args.seeds), "source": source, "step_ranks": args.ranks}
    print(json.dumps({"benchmark": "zch", "results": results, "ratios": ratios, "figures": figures}))


if __name__ == "__main__":
    main()
