"""Planner benchmark: planning time, placement quality on the MLPerf DLRM-DCNv2 tables, and
(when DistributedModelParallel exists) measured step time next to the planner's estimate.

    .venv/bin/python benchmarks/planner.py            # all sections
    .venv/bin/python benchmarks/planner.py --quick    # planning time on 26 and 200 tables only
    .venv/bin/python benchmarks/planner.py --smoke    # seconds: every section, one planning case, tiny measured run

Prints readable tables, then as its last line one JSON object:
{"benchmark": "planner", "results": [...], "ratios": {...}, "figures": {...}}
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from lightning_rec.embedding import EmbeddingBagConfig
from lightning_rec.planner import GB, EmbeddingShardingPlanner, ParameterConstraints, PlannerError, Topology

DLRM_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
             11938,
             155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]  # fmt: skip
DLRM_POOLING = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]


def dlrm_tables():
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=r, embedding_dim=128) for i, r in enumerate(DLRM_ROWS)
    ]
    constraints = {f"t{i}": ParameterConstraints(pooling_factors=p) for i, p in enumerate(DLRM_POOLING)}
    return tables, constraints


def synthetic_tables(n: int, seed: int = 0):
    """Rows log-uniform 10..20M, dims 32..256, 1-30 ids per sample: a production-like mix."""
    rng = random.Random(seed)
    tables, constraints = [], {}
    for i in range(n):
        rows = int(10 ** rng.uniform(1, 7.3))
        tables.append(
            EmbeddingBagConfig(
                name=f"t{i}", num_embeddings=rows, embedding_dim=rng.choice([32, 64, 128, 256])
            )
        )
        constraints[f"t{i}"] = ParameterConstraints(pooling_factors=round(rng.uniform(1, 30), 1))
    return tables, constraints


def gpu_topology(world_size: int, hbm_gb: int = 80, ddr_gb: int = 512) -> Topology:
    return Topology(
        world_size=world_size,
        compute_device="cuda",
        local_world_size=min(8, world_size),
        hbm_cap=hbm_gb * GB,
        ddr_cap=ddr_gb * GB,
    )


def planning_time(quick: bool, smoke: bool = False) -> list[dict]:
    rows = []
    cases = [(26, 8), (26, 64), (200, 8), (200, 64), (1000, 8), (1000, 64)]
    if quick or smoke:
        cases = cases[:1] if smoke else cases[:4]
    for n, world in cases:
        tables, constraints = dlrm_tables() if n == 26 else synthetic_tables(n)
        planner = EmbeddingShardingPlanner(
            gpu_topology(world), constraints, batch_size=8192, print_stats=False
        )
        start = time.perf_counter()
        planner.plan(tables)
        seconds = time.perf_counter() - start
        s = planner.stats
        rows.append(
            {
                "section": "planning_time",
                "tables": n,
                "ranks": world,
                "seconds": round(seconds, 3),
                "proposals": s.proposals,
                "kept": s.proposer,
                "max_over_mean": round(s.imbalance, 4),
            }
        )
    print(f"{'tables':>6} {'ranks':>5} {'seconds':>8} {'proposals':>9} {'max/mean':>8}  kept")
    for r in rows:
        print(
            f"{r['tables']:>6} {r['ranks']:>5} {r['seconds']:>8.3f} {r['proposals']:>9} "
            f"{r['max_over_mean']:>8.4f}  {r['kept']}"
        )
    return rows


def dlrm_quality() -> list[dict]:
    tables, constraints = dlrm_tables()
    out = []
    for world, hbm, ddr in [(8, 80, 512), (2, 24, 256), (2, 24, 24)]:
        planner = EmbeddingShardingPlanner(
            gpu_topology(world, hbm, ddr), constraints, batch_size=8192, print_stats=False
        )
        row = {"section": "dlrm_placement", "ranks": world, "hbm_gb": hbm, "ddr_gb": ddr}
        try:
            plan = planner.plan(tables)
        except PlannerError as e:
            row.update(fits=False, error=str(e).splitlines()[0])
            print(f"\nDLRM on {world} x {hbm} GB HBM, {ddr} GB DDR: does not fit, and says why:\n{e}")
            out.append(row)
            continue
        big = [t.name for t in tables if t.num_embeddings == 40_000_000]
        mp = plan.plan[""]
        row.update(
            fits=True,
            max_over_mean=round(planner.stats.imbalance, 4),
            big_tables_split=all(len({s.placement for s in mp[n].shards}) > 1 for n in big),
            big_tables=", ".join(f"{n}: {mp[n].sharding_type} {mp[n].compute_kernel}" for n in big),
        )
        print(f"\nDLRM on {world} x {hbm} GB HBM, {ddr} GB DDR:")
        print(planner.stats)
        print("40M-row tables:", row["big_tables"])
        out.append(row)
    return out


CPU_DLRM_ROWS, CPU_DLRM_DIM = 100_000, 64  # the 2-rank CPU DLRM (dlrm_distributed.py)
CPU_DLRM_BATCH = 1024  # per rank
SMOKE_DLRM_BATCH = 64  # per rank, dlrm_distributed.py --smoke's (1,000-row tables, 2 steps)
FORCED = ["table_wise", "row_wise", "column_wise", "table_row_wise", "grid_shard", "data_parallel"]


def cpu_dlrm_plans() -> list[tuple[str, float]]:
    """(name, estimated ms of the slowest rank) for the planner's own choice and for every table
    forced onto each sharding type, for the 2-rank CPU DLRM of benchmarks/dlrm_distributed.py."""
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=CPU_DLRM_ROWS, embedding_dim=CPU_DLRM_DIM,
                                 feature_names=[f"f{i}"]) for i in range(26)]
    topology = Topology(world_size=2, compute_device="cpu")
    plans = []
    for forced in [None, *FORCED]:
        constraints = {t.name: ParameterConstraints(sharding_types=[forced] if forced else None) for t in tables}
        planner = EmbeddingShardingPlanner(topology, constraints, batch_size=CPU_DLRM_BATCH,
                                           optimizer="rowwise_adagrad", print_stats=False)
        try:
            planner.plan(tables)
        except PlannerError:  # a type the planner never proposes here (grid needs 2+ hosts): measured only
            plans.append((forced, None))
            continue
        plans.append((forced or "planner", planner.stats.max_ms))
    return plans


def measured_vs_estimate(steps: int, smoke: bool = False) -> list[dict]:
    """The 2-rank CPU DLRM trained under the planner's plan and under each forced sharding type
    (benchmarks/dlrm_distributed.py, one run), measured ms per step next to the planner's estimate.
    smoke: the planner's plan and table-wise only, on dlrm_distributed.py's tiny smoke model."""
    estimates = cpu_dlrm_plans()[:2] if smoke else cpu_dlrm_plans()
    script = Path(__file__).with_name("dlrm_distributed.py")
    kinds = ",".join(name for name, _ in estimates)
    batch = SMOKE_DLRM_BATCH if smoke else CPU_DLRM_BATCH
    out = subprocess.run([sys.executable, str(script), "--types", kinds, "--no-profile", "--steps", str(steps),
                          *(["--smoke"] if smoke else [])], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{script.name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    figures = json.loads(out.stdout.strip().splitlines()[-1])["figures"]
    global_batch = 2 * batch
    rows = []
    for name, est_ms in estimates:
        sps = figures[f"{name}_samples_per_s"]
        rows.append({"section": "measured_vs_estimate", "plan": name,
                     "estimated_ms": None if est_ms is None else round(est_ms, 3),
                     "measured_ms": round(1000 * global_batch / sps, 3), "samples_per_s": sps})
    print(f"\n2-rank CPU DLRM (26 x {1000 if smoke else CPU_DLRM_ROWS} x {CPU_DLRM_DIM}, batch {batch} per rank, "
          f"{steps} steps each, one run):")
    print(f"{'plan':>15} {'estimated ms':>13} {'measured ms':>12} {'samples/s':>10}")
    for r in rows:
        est = "-" if r["estimated_ms"] is None else f"{r['estimated_ms']:.2f}"
        print(f"{r['plan']:>15} {est:>13} {r['measured_ms']:>12.2f} {r['samples_per_s']:>10.0f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="planning time on 26 and 200 tables only")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per plan in the measured section")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: one planning case, and the measured section on a tiny model, 2 plans, 2 steps")
    args = parser.parse_args()
    if args.smoke:
        args.quick, args.steps = False, 2
    results = planning_time(args.quick, args.smoke)
    figures = {f"seconds_{r['tables']}_tables_{r['ranks']}_ranks": r["seconds"] for r in results}
    ratios: dict = {}
    if not args.quick:
        quality = dlrm_quality()
        results += quality
        ratios["dlrm_8x80gb_max_over_mean"] = quality[0].get("max_over_mean")
        figures["dlrm_8x80gb_fits"] = quality[0]["fits"]
        figures["dlrm_8x80gb_40m_tables_split"] = quality[0].get("big_tables_split")
        figures["dlrm_2x24gb_fits_by_uvm"] = quality[1]["fits"]
        figures["dlrm_2x24gb_small_ddr_fails_with_explanation"] = not quality[2]["fits"]
        measured = measured_vs_estimate(args.steps, args.smoke)
        results += measured
        by_plan = {r["plan"]: r for r in measured}
        fastest = min(r["measured_ms"] for r in measured)
        # the planner's choice within 10% of the fastest measured option (ratio <= 1.10)
        ratios["cpu_dlrm_planner_measured_over_fastest"] = round(by_plan["planner"]["measured_ms"] / fastest, 4)
        ratios["cpu_dlrm_planner_estimate_over_best_forced_estimate"] = round(
            by_plan["planner"]["estimated_ms"]
            / min(r["estimated_ms"] for r in measured if r["plan"] != "planner" and r["estimated_ms"] is not None), 4)
        print(f"planner's plan measured / fastest measured: {ratios['cpu_dlrm_planner_measured_over_fastest']:.3f}")
    print(json.dumps({"benchmark": "planner", "results": results, "ratios": ratios, "figures": figures}))


if __name__ == "__main__":
    main()
