"""The planner: options, cost model, partitioning, stats, and the errors that explain."""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
import torch
import torch.nn as nn

from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingConfig
from lightning_rec.planner import (
    GB,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    PlannerError,
    PlanStats,
    TableStats,
    Topology,
)
from lightning_rec.planner.estimate import optimizer_state_bytes_per_row
from lightning_rec.sharding.layout import shard_layout
from lightning_rec.types import ComputeKernel, ShardingPlan, ShardingType

DLRM_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
             11938,
             155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]  # fmt: skip
DLRM_POOLING = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]


def dlrm_tables() -> tuple[list[EmbeddingBagConfig], dict[str, ParameterConstraints]]:
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=r, embedding_dim=128) for i, r in enumerate(DLRM_ROWS)
    ]
    constraints = {f"t{i}": ParameterConstraints(pooling_factors=p) for i, p in enumerate(DLRM_POOLING)}
    return tables, constraints


def dlrm_planner(topology: Topology, **kw) -> EmbeddingShardingPlanner:
    _, constraints = dlrm_tables()
    kw.setdefault("print_stats", False)
    return EmbeddingShardingPlanner(topology, constraints, batch_size=8192, optimizer="rowwise_adagrad", **kw)


def small_tables(n: int = 6) -> list[EmbeddingBagConfig]:
    rows = [4, 100, 5000, 20000, 300000, 2000000]
    return [EmbeddingBagConfig(name=f"s{i}", num_embeddings=rows[i % 6], embedding_dim=64) for i in range(n)]


def cpu(world_size: int = 2, ddr_cap: int = 8 * GB) -> Topology:
    return Topology(world_size=world_size, compute_device="cpu", ddr_cap=ddr_cap)


def check_complete(plan: ShardingPlan, tables, world_size: int, local_world_size: int | None = None) -> None:
    """Every table is in the plan, its shards are exactly what shard_layout builds and tile the table."""
    module_plan = plan.plan[""]
    assert sorted(module_plan) == sorted(t.name for t in tables)
    for t in tables:
        ps = module_plan[t.name]
        if ps.sharding_type == ShardingType.DATA_PARALLEL:
            assert len(ps.shards) == world_size
            continue
        area = sum(s.shard_sizes[0] * s.shard_sizes[1] for s in ps.shards)
        assert area == t.num_embeddings * t.embedding_dim, t.name
        assert all(0 <= s.placement < world_size for s in ps.shards)
        kw: dict = {"local_world_size": local_world_size}
        if ps.sharding_type in (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE):
            kw["ranks"] = ps.ranks
        if ps.sharding_type in (
            ShardingType.TABLE_ROW_WISE,
            ShardingType.TABLE_COLUMN_WISE,
            ShardingType.GRID_SHARD,
        ):
            kw["host_indexes"] = sorted(
                {s.placement // local_world_size: 0 for s in ps.shards},
                key=lambda h: [s.placement // local_world_size for s in ps.shards].index(h),
            )
        assert ps.shards == shard_layout(
            t.name, t.num_embeddings, t.embedding_dim, ps.sharding_type, world_size, **kw
        )


# --- topology and constraints ---------------------------------------------------------------------


def test_topology_defaults_read_the_machine_and_are_overridable():
    t = Topology(world_size=4, compute_device="cpu")
    assert t.hbm_cap == 0 and t.ddr_cap > 0 and t.local_world_size == 4 and t.num_hosts == 1
    t = Topology(
        world_size=16,
        compute_device="cuda",
        local_world_size=8,
        hbm_cap=80 * GB,
        ddr_cap=256 * GB,
        inter_host_bw=25e9,
    )
    assert (t.num_hosts, t.hbm_cap, t.inter_host_bw) == (2, 80 * GB, 25e9)


def test_topology_takes_torchrecs_positional_order():
    """TorchRec's Topology(world_size, compute_device, hbm_cap, ddr_cap, local_world_size): hbm_cap third was read as
    local_world_size here ("local_world_size=85899345920 must be positive and divide world_size=8")."""
    t = Topology(8, "cuda", 80 * GB, 512 * GB, 4)
    assert (t.world_size, t.compute_device, t.hbm_cap, t.ddr_cap) == (8, "cuda", 80 * GB, 512 * GB)
    assert t.local_world_size == 4 and t.num_hosts == 2


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(world_size=0), "world_size"),
        (dict(world_size=2, ddr_cap=0), "ddr_cap"),
        (dict(world_size=2, compute_device="cuda", hbm_cap=0, ddr_cap=GB), "hbm_cap"),
        (dict(world_size=4, local_world_size=3), "local_world_size"),
        (dict(world_size=2, compute_device="tpu"), "'cpu' or 'cuda'"),
        (dict(world_size=2, hbm_cap=GB), "no device memory"),
    ],
)
def test_bad_topology_names_the_fix(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Topology(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when no GPU is visible")
def test_cuda_topology_without_gpu_asks_for_hbm_cap():
    with pytest.raises(ValueError, match="hbm_cap="):
        Topology(world_size=2, compute_device="cuda")


def test_bad_constraints():
    with pytest.raises(ValueError, match="choose from"):
        ParameterConstraints(sharding_types=["diagonal"])
    with pytest.raises(ValueError, match="cache_load_factor"):
        ParameterConstraints(cache_load_factor=0.0)
    with pytest.raises(ValueError, match="leave it out"):
        ParameterConstraints(compute_kernels=[])


def test_a_misspelt_sharding_type_or_kernel_names_the_one_meant():
    with pytest.raises(ValueError, match=r"unknown sharding type 'rowwise' \(did you mean 'row_wise'\?\)"):
        ParameterConstraints(sharding_types=["table_wise", "rowwise"])
    with pytest.raises(ValueError, match=r"'Fused-UVM' \(did you mean 'fused_uvm'\?\)"):
        ParameterConstraints(compute_kernels=["Fused-UVM"])


def test_pooling_factor_given_as_text_is_one_figure():
    """pooling_factors="12" (as YAML or a command line may give it) was iterated: two features of 1.0 and 2.0."""
    assert ParameterConstraints(pooling_factors="12").pooling_factors == [12.0]
    with pytest.raises(ValueError, match="pooling_factors='many'"):
        ParameterConstraints(pooling_factors="many")


@pytest.mark.parametrize("pf", [0.0, -2.0, float("inf")])  # inf was taken: every option priced at inf ms
def test_pooling_factor_not_positive_names_the_table(pf):
    planner = EmbeddingShardingPlanner(
        cpu(), {"s1": ParameterConstraints(pooling_factors=pf)}, print_stats=False
    )
    with pytest.raises(ValueError, match=r"table 's1'.*pooling factor.*pooling_factors="):
        planner.plan(small_tables())


def test_constraints_for_unknown_table():
    planner = EmbeddingShardingPlanner(cpu(), {"nope": ParameterConstraints()}, print_stats=False)
    with pytest.raises(ValueError, match=r"\['nope'\].*fix the names"):
        planner.plan(small_tables())


def test_optimizer_state_per_row():
    assert [
        optimizer_state_bytes_per_row(o, 64)
        for o in ("sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam")
    ] == [0, 256, 4, 512, 260]


def test_planner_takes_the_optimizer_names_fused_optimizer_config_takes():
    """EmbeddingShardingPlanner(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD), TorchRec's, planned nothing: a
    ValueError from inside ('exact_row_wise_adagrad' is not a valid EmbOptimType)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbgemmOpt

    want = EmbeddingShardingPlanner(cpu(), optimizer="rowwise_adagrad", print_stats=False).plan(small_tables())
    for name in (FbgemmOpt.EXACT_ROWWISE_ADAGRAD, "EXACT_ROWWISE_ADAGRAD"):
        planner = EmbeddingShardingPlanner(cpu(), optimizer=name, print_stats=False)
        assert planner.optimizer == "rowwise_adagrad"
        assert str(planner.plan(small_tables())) == str(want)
    assert EmbeddingShardingPlanner(cpu(), optimizer=torch.optim.Adam, print_stats=False).optimizer == "adam"


# --- options and errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "constraint, words",
    [
        (
            ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["dense"]),
            "dense kernel is for data_parallel",
        ),
        (ParameterConstraints(compute_kernels=["fused_uvm"]), "compute_device='cuda'"),
        (ParameterConstraints(sharding_types=["row_wise"]), "4 rows cannot be split over 8 ranks"),
    ],
)
def test_constraints_that_allow_no_option(constraint, words):
    planner = EmbeddingShardingPlanner(cpu(8), {"s0": constraint}, print_stats=False)
    with pytest.raises(PlannerError, match=rf"table 's0' has no sharding option.*{words}.*Fix: widen"):
        planner.plan(small_tables())


def test_table_larger_than_the_cluster():
    tables = small_tables() + [EmbeddingBagConfig(name="huge", num_embeddings=10**9, embedding_dim=256)]
    with pytest.raises(PlannerError, match=r"table 'huge'.*larger than the whole cluster.*GB.*more ranks"):
        EmbeddingShardingPlanner(cpu(2, ddr_cap=64 * GB), print_stats=False).plan(tables)


def test_a_gpu_too_small_for_a_batch_says_so_not_that_the_table_is_larger_than_the_cluster():
    """1 MB of HBM per rank and 512 GB of host memory: 'table t0 is larger than the whole cluster: it needs 19.24 GB
    (table_wise (fused): HBM 19.24 GB)' and 'let tables live in host memory', while its fused_uvm option lacked
    only device memory for a batch's ids and embeddings."""
    tables, _ = dlrm_tables()
    topo = Topology(world_size=2, compute_device="cuda", hbm_cap=2**20, ddr_cap=512 * GB)
    with pytest.raises(PlannerError) as err:
        dlrm_planner(topo).plan(tables)
    msg = str(err.value)
    assert "does not fit the cluster's device memory: its closest option, table_wise (fused_uvm)" in msg, msg
    assert "batch_size=8192" in msg and "hbm_cap" in msg, msg
    assert "larger than the whole cluster" not in msg and "live in host memory" not in msg, msg


def test_a_data_parallel_table_larger_than_one_rank_does_not_ask_for_more_ranks():
    """Each rank holds a whole copy of a data_parallel table: more ranks never make it fit (the message said so, as
    'larger than the whole cluster'). It names the per-rank shortfall and the sharded types instead."""
    tables = [EmbeddingBagConfig(name="big", num_embeddings=4000, embedding_dim=64)]  # ~2 MB on one rank
    only_dp = {"big": ParameterConstraints(sharding_types=["data_parallel"])}
    with pytest.raises(PlannerError) as err:
        EmbeddingShardingPlanner(cpu(4, ddr_cap=1_600_000), only_dp, print_stats=False).plan(tables)
    msg = str(err.value)
    assert "table 'big'" in msg and "fit one rank" in msg and "more ranks do not help" in msg, msg
    assert "whole cluster" not in msg and "world_size >" not in msg, msg
    assert "sharding_types=['table_wise', 'row_wise', 'column_wise']" in msg, msg
    # table-wise, in a cluster that holds it but on ranks that each hold less: a finer split is the fix
    only_tw = {"big": ParameterConstraints(sharding_types=["table_wise"])}
    with pytest.raises(PlannerError, match=r"table 'big'.*fit one rank.*table_wise.*finer split.*row_wise"):
        EmbeddingShardingPlanner(cpu(4, ddr_cap=1_600_000), only_tw, print_stats=False).plan(tables)
    assert "ddr 1.5 MB per rank" in Topology(world_size=4, ddr_cap=1_600_000).describe()  # not "0.0 GB"


def test_table_column_wise_with_one_rank_per_host_names_the_cause():
    """It said 'dim 64 over 1 local ranks gives blocks under min_partition 32' (one 64-column block is not under 32)."""
    tables = [EmbeddingBagConfig(name="t", num_embeddings=100, embedding_dim=64)]
    only = {"t": ParameterConstraints(sharding_types=["table_column_wise"])}
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=8 * GB, local_world_size=1)
    with pytest.raises(PlannerError) as err:
        EmbeddingShardingPlanner(topology, only, print_stats=False).plan(tables)
    msg = str(err.value)
    assert "needs 2+ ranks per host" in msg and "under min_partition" not in msg, msg


def test_no_option_message_leads_with_the_reason_not_kernels_nobody_asked_for():
    """A 1-row table forced row_wise said 'row_wise (dense): the dense kernel is for data_parallel only; row_wise
    (fused_uvm): UVM kernels need compute_device='cuda'; ...' before the cause; a dim-20 table forced column_wise
    said 'min_partition=20: lower it' when the user had set no min_partition (the default is min(dim, 32))."""
    tables = [EmbeddingBagConfig(name="one", num_embeddings=1, embedding_dim=8),
              EmbeddingBagConfig(name="narrow", num_embeddings=100, embedding_dim=20)]

    def message(constraints, topology=None) -> str:
        with pytest.raises(PlannerError) as err:
            EmbeddingShardingPlanner(topology or cpu(4), constraints, print_stats=False).plan(tables)
        return str(err.value)

    msg = message({"one": ParameterConstraints(sharding_types=["row_wise"])})
    assert "per rank: row_wise: 1 rows cannot be split over 4 ranks. Fix" in msg, msg
    assert "dense" not in msg and "UVM" not in msg, msg
    msg = message({"narrow": ParameterConstraints(sharding_types=["column_wise"])})
    assert "min_partition is not set: the default is min(dim, 32) = 20" in msg, msg
    assert "ParameterConstraints(min_partition=10)" in msg, msg
    msg = message({"narrow": ParameterConstraints(sharding_types=["column_wise"], min_partition=12)})
    assert "min_partition=12; lower it with ParameterConstraints(min_partition=10)" in msg, msg
    two_hosts = Topology(world_size=4, local_world_size=2, compute_device="cpu", ddr_cap=8 * GB)
    msg = message({"narrow": ParameterConstraints(sharding_types=["grid_shard"])}, two_hosts)
    assert "grid_shard: dim 20 makes no 2+ column blocks of >= 20 columns over 2 hosts" in msg, msg
    msg = message({"narrow": ParameterConstraints(sharding_types=["grid_shard"])})
    assert "grid_shard: splits columns over hosts, and there is 1" in msg, msg
    # kernels the user did ask for are still named when they are what excludes the table
    msg = message({"one": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused_uvm"])})
    assert "UVM kernels need compute_device='cuda'" in msg, msg


def test_no_option_message_says_a_reason_once_for_the_sharding_types_it_excludes():
    """compute_kernels=['fused_uvm'] with enforce_hbm=True said 'table_wise (fused_uvm): enforce_hbm=True keeps the
    table in device memory; row_wise (fused_uvm): enforce_hbm=True keeps ...' six times over."""
    gpus = Topology(world_size=2, compute_device="cuda", hbm_cap=8 * GB, ddr_cap=8 * GB)
    c = {"s2": ParameterConstraints(compute_kernels=["fused_uvm"], enforce_hbm=True)}
    with pytest.raises(PlannerError) as err:
        EmbeddingShardingPlanner(gpus, c, print_stats=False).plan(small_tables())
    msg = str(err.value)
    assert msg.count("enforce_hbm=True keeps") == 1, msg
    assert "table_wise, row_wise, column_wise, table_row_wise, table_column_wise, grid_shard (fused_uvm): " \
           "enforce_hbm=True keeps the table in device memory" in msg, msg
    assert "data_parallel (fused_uvm): data_parallel runs the dense kernel only" in msg, msg


def test_planner_error_is_a_value_error():
    assert issubclass(PlannerError, ValueError)


def test_stats_before_plan():
    with pytest.raises(ValueError, match="call planner.plan"):
        _ = EmbeddingShardingPlanner(cpu()).stats


def test_printed_stats_show_small_memory_in_units_that_show_it():
    """The recipes' 26 tables of 1000 x 16 (2.9 MB a rank) printed "0.00/0.00  0.00/10.01" in GB columns on CPU: the
    memory column said nothing, and the HBM column (0 of 0 on a CPU rank) was noise."""
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=1000, embedding_dim=16) for i in range(4)]
    planner = EmbeddingShardingPlanner(cpu(2, ddr_cap=8 * GB), print_stats=False)
    planner.plan(tables)
    text = str(planner.stats)
    assert "HBM" not in text.splitlines()[1] and "0.00/" not in text, text
    assert "KB/6.8 GB" in text, text  # used in KB, the cap (8 GB less the reserved 15%) in GB
    cuda = Topology(world_size=2, compute_device="cuda", hbm_cap=16 * GB, ddr_cap=64 * GB)
    planner = EmbeddingShardingPlanner(cuda, print_stats=False)
    planner.plan(tables)
    assert "HBM used/cap" in str(planner.stats) and "KB/13.6 GB" in str(planner.stats), str(planner.stats)


# --- plans ----------------------------------------------------------------------------------------


def test_small_tables_on_cpu_pick_by_size():
    tables = small_tables()
    planner = EmbeddingShardingPlanner(cpu(2), print_stats=False)
    plan = planner.plan(tables)
    check_complete(plan, tables, 2)
    kinds = {n: ps.sharding_type for n, ps in plan.plan[""].items()}
    assert kinds["s0"] == ShardingType.DATA_PARALLEL  # 4 rows: all-reducing them costs nothing
    assert kinds["s5"] != ShardingType.DATA_PARALLEL  # 2M rows: an all-reduce of 0.5 GB per step
    for ps in plan.plan[""].values():
        want = ComputeKernel.DENSE if ps.sharding_type == ShardingType.DATA_PARALLEL else ComputeKernel.FUSED
        assert ps.compute_kernel == want  # CPU: no UVM kernels


def test_dlrm_on_8_ranks_of_80gb_fits_splits_and_balances():
    tables, _ = dlrm_tables()
    planner = dlrm_planner(Topology(world_size=8, compute_device="cuda", hbm_cap=80 * GB, ddr_cap=512 * GB))
    plan = planner.plan(tables)
    check_complete(plan, tables, 8)
    for t in tables:
        ps = plan.plan[""][t.name]
        if t.num_embeddings == 40_000_000:
            assert len({s.placement for s in ps.shards}) > 1, f"{t.name}: {ps}"
        assert ps.compute_kernel in (ComputeKernel.FUSED, ComputeKernel.DENSE)  # 80 GB is plenty: no UVM
    stats = planner.stats
    assert stats.max_ms <= 1.10 * stats.mean_ms, str(stats)
    assert all(r.hbm_used <= r.hbm_cap for r in stats.ranks)


def test_dlrm_on_2_ranks_of_24gb_fits_by_uvm():
    tables, _ = dlrm_tables()
    planner = dlrm_planner(Topology(world_size=2, compute_device="cuda", hbm_cap=24 * GB, ddr_cap=256 * GB))
    plan = planner.plan(tables)
    check_complete(plan, tables, 2)
    kernels = [plan.plan[""][f"t{i}"].compute_kernel for i, r in enumerate(DLRM_ROWS) if r == 40_000_000]
    # five 20 GB tables, 41 GB of HBM: at most one of them in device memory, the rest in host memory
    assert sum(k in (ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING) for k in kernels) >= 4, kernels
    assert all(r.hbm_used <= r.hbm_cap and r.ddr_used <= r.ddr_cap for r in planner.stats.ranks)


def test_a_small_cluster_is_explained_in_units_that_show_the_numbers():
    tables = [EmbeddingBagConfig(name="t0", num_embeddings=1000, embedding_dim=8)]  # 32,000 bytes of weights
    with pytest.raises(PlannerError) as err:
        EmbeddingShardingPlanner(cpu(2, ddr_cap=8 * 1024), print_stats=False).plan(tables)
    msg = str(err.value)
    assert "0.00 GB" not in msg and "KB" in msg, msg  # "needs 0.00 GB, holds 0.00 GB" said nothing
    assert "DDR 13.60 KB for tables" in msg, msg  # the cluster: 2 ranks x 8 KB, less the reserved 15%
    assert "HBM" not in msg, msg  # a CPU rank has none: "HBM 0 bytes + " before every figure was noise


def test_many_tables_that_do_not_fit_are_counted_not_listed_one_per_line():
    """500 tables on 2 small ranks: the message listed all 226 that found no room, alike lines over 49 KB, with
    the totals and the fix after them. It names the 10 largest and counts the rest."""
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=10_000, embedding_dim=64) for i in range(500)]
    with pytest.raises(PlannerError) as err:
        EmbeddingShardingPlanner(cpu(2, ddr_cap=400 * 1024**2), print_stats=False).plan(tables)
    msg = str(err.value)
    lines = msg.splitlines()
    assert len(lines) < 20 and len(msg) < 4000, msg
    failed = int(lines[0].split(" table(s) could not be placed")[0].split()[-1])
    assert failed > 10 and "; the 10 largest:" in lines[0], lines[0]
    assert sum(line.startswith("  't") for line in lines) == 10, msg
    assert f"  ... and {failed - 10} more, needing " in msg, msg
    assert "All tables together need" in msg and "Fix: more ranks" in msg, msg


def test_dlrm_on_2_ranks_of_24gb_without_host_memory_explains():
    tables, _ = dlrm_tables()
    planner = dlrm_planner(Topology(world_size=2, compute_device="cuda", hbm_cap=24 * GB, ddr_cap=24 * GB))
    with pytest.raises(PlannerError) as err:
        planner.plan(tables)
    msg = str(err.value)
    assert "'t0' (40000000 rows x dim 128)" in msg  # names the table ...
    assert "GB" in msg and "HBM 20.40 GB + DDR 20.40 GB" in msg  # ... what it needs, the capacity
    for knob in ("more ranks", "fused_uvm", "embedding_dim", "num_embeddings"):
        assert knob in msg


def test_enforce_hbm_keeps_tables_out_of_uvm():
    tables, constraints = dlrm_tables()
    constraints = {
        k: ParameterConstraints(pooling_factors=c.pooling_factors, enforce_hbm=True)
        for k, c in constraints.items()
    }
    topo = Topology(world_size=2, compute_device="cuda", hbm_cap=24 * GB, ddr_cap=256 * GB)
    with pytest.raises(PlannerError, match="could not be placed"):
        EmbeddingShardingPlanner(topo, constraints, batch_size=8192, print_stats=False).plan(tables)


def test_multi_host_plans_use_host_level_types_when_asked():
    tables = [EmbeddingBagConfig(name=f"g{i}", num_embeddings=1_000_000, embedding_dim=128) for i in range(4)]
    c = {
        "g0": ParameterConstraints(sharding_types=["table_row_wise"]),
        "g1": ParameterConstraints(sharding_types=["grid_shard"]),
        "g2": ParameterConstraints(sharding_types=["table_column_wise"], min_partition=16),
        "g3": ParameterConstraints(sharding_types=["column_wise"], min_partition=64),
    }
    topo = Topology(world_size=8, local_world_size=4, compute_device="cuda", hbm_cap=16 * GB, ddr_cap=64 * GB)
    plan = EmbeddingShardingPlanner(topo, c, print_stats=False).plan(tables)
    check_complete(plan, tables, 8, local_world_size=4)
    mp = plan.plan[""]
    assert [mp[f"g{i}"].sharding_type for i in range(4)] == [
        ShardingType.TABLE_ROW_WISE,
        ShardingType.GRID_SHARD,
        ShardingType.TABLE_COLUMN_WISE,
        ShardingType.COLUMN_WISE,
    ]
    assert {s.placement // 4 for s in mp["g0"].shards} in ({0}, {1})
    assert min(s.shard_sizes[1] for s in mp["g3"].shards) >= 64


def test_plans_are_deterministic():
    tables, _ = dlrm_tables()
    topo = Topology(world_size=8, compute_device="cuda", hbm_cap=80 * GB, ddr_cap=512 * GB)
    assert dlrm_planner(topo).plan(tables) == dlrm_planner(topo).plan(tables)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.sparse = nn.Module()
        self.sparse.ebc = EmbeddingBagCollection(tables=small_tables(3))
        self.dense = nn.Linear(4, 4)


def test_plan_a_model_by_module_path_and_print_stats_once(capsys):
    from lightning_rec.embedding import EmbeddingCollection

    model = _Model()
    model.seq = EmbeddingCollection(tables=[EmbeddingConfig(name="q", num_embeddings=1000, embedding_dim=16)])
    planner = EmbeddingShardingPlanner(cpu(2))
    plan = planner.plan(model)
    assert sorted(plan.plan) == ["seq", "sparse.ebc"]
    assert sorted(plan.plan["sparse.ebc"]) == ["s0", "s1", "s2"] and list(plan.plan["seq"]) == ["q"]
    out = capsys.readouterr().out
    assert out.count("planner:") == 1 and "compute ms" in out
    stats = planner.stats
    assert isinstance(stats, PlanStats) and [r.rank for r in stats.ranks] == [0, 1]
    columns, rows = stats.rank_rows()
    assert columns[0] == "rank" and len(rows) == 2 and len(rows[0]) == len(columns)
    assert stats.to_dict()["imbalance"] >= 1.0 and len(stats.tables) == 4


def test_collective_plan_broadcasts_from_rank_0():
    import torch.distributed as dist

    tables = small_tables()
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1
        )
        try:
            planner = EmbeddingShardingPlanner(cpu(1), print_stats=False)
            plan = planner.collective_plan(tables)
            assert plan == EmbeddingShardingPlanner(cpu(1), print_stats=False).plan(tables)
            assert planner.stats.ranks
            bad = EmbeddingShardingPlanner(
                cpu(1), {"s0": ParameterConstraints(compute_kernels=["fused_uvm"])}
            )
            with pytest.raises(PlannerError, match="s0"):
                bad.collective_plan(tables)
            with pytest.raises(ValueError, match=r"process group has 1 ranks.*world_size=1"):
                EmbeddingShardingPlanner(cpu(2)).collective_plan(tables)
        finally:
            dist.destroy_process_group()


def test_torchrec_compute_kernel_name():
    from lightning_rec import EmbeddingComputeKernel

    c = ParameterConstraints(compute_kernels=[EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.DENSE])
    assert c.compute_kernels == [ComputeKernel.FUSED, ComputeKernel.DENSE]


def test_collective_plan_takes_torchrecs_argument_order():
    """TorchRec's tutorials call planner.collective_plan(module, sharders, pg): pg third, sharders ignored."""
    import torch.distributed as dist

    tables = small_tables()
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            expected = EmbeddingShardingPlanner(cpu(1), print_stats=False).plan(tables)
            planner = EmbeddingShardingPlanner(cpu(1), print_stats=False)
            assert planner.collective_plan(tables, [], dist.GroupMember.WORLD) == expected
            assert planner.collective_plan(tables, None, pg=dist.group.WORLD) == expected
            assert planner.collective_plan(tables, dist.group.WORLD) == expected  # (module, pg) still works
            with pytest.raises(ValueError, match="pg must be a torch.distributed ProcessGroup"):
                planner.collective_plan(tables, None, "world")
        finally:
            dist.destroy_process_group()


def _two_rank_worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        # rank 1 is given a different batch size: it must still end with rank 0's plan
        planner = EmbeddingShardingPlanner(cpu(2), batch_size=512 if rank == 0 else 7, print_stats=rank == 0)
        plan = planner.collective_plan(small_tables())
        torch.save({"plan": str(plan), "max_ms": planner.stats.max_ms}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_collective_plan_gives_every_rank_rank_0s_plan():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_two_rank_worker, args=(os.path.join(d, "store"), os.path.join(d, "out")), nprocs=2)
        got = [torch.load(os.path.join(d, f"out.{r}")) for r in range(2)]
    assert got[0] == got[1]
    assert got[0]["plan"] == str(EmbeddingShardingPlanner(cpu(2), print_stats=False).plan(small_tables()))


def _spec(rows=1000, dim=64, pf=2.0, clf=None):
    from lightning_rec.planner.estimate import TableSpec

    c = ParameterConstraints(pooling_factors=pf, cache_load_factor=clf)
    return TableSpec(0, "", "t", rows, dim, 4, True, 1, [pf], False, c)


def test_shard_cost_counts_weights_state_and_buffers():
    from lightning_rec.planner.estimate import CostModel

    B, rows, dim, pf = 100, 1000, 64, 2.0
    cost = CostModel(cpu(2), batch_size=B, optimizer="rowwise_adagrad", pipelined=True)
    hbm, ddr, compute, comm = cost.shard_cost(
        _spec(rows, dim, pf), ShardingType.TABLE_WISE, ComputeKernel.FUSED, rows, dim
    )
    ids = B * 2 * pf  # the table-wise shard serves both ranks' samples
    inputs = ids * 8 + 4 * B * 2  # int64 ids + int32 lengths
    outputs = B * 2 * dim * 4  # fp32 pooled output
    assert hbm == 0  # CPU: everything in host memory
    shm = 2 * outputs / 2  # the shared-memory transport's two slots of what goes to the other rank
    # pipelined (depth 1): the step's routed ids, the next batch's, and the one Lightning's loop takes ahead
    assert ddr == rows * dim * 4 + rows * 4 + 3 * inputs + 2 * outputs + shm
    plain = CostModel(cpu(2), batch_size=B, optimizer="rowwise_adagrad", pipelined=False)
    deeper = CostModel(cpu(2), batch_size=B, optimizer="rowwise_adagrad", pipelined=2)
    for model, live in ((plain, 1), (deeper, 4)):
        got = model.shard_cost(_spec(rows, dim, pf), ShardingType.TABLE_WISE, ComputeKernel.FUSED, rows, dim)[1]
        assert got == rows * dim * 4 + rows * 4 + live * inputs + 2 * outputs + shm
    assert compute > 0 and comm > 0
    hotter = cost.shard_cost(
        _spec(rows, dim, 4 * pf), ShardingType.TABLE_WISE, ComputeKernel.FUSED, rows, dim
    )
    assert hotter[2] > compute and hotter[3] > comm  # more ids per sample: more lookup, more ids moved
    adam = CostModel(cpu(2), batch_size=B, optimizer="adam")
    assert (
        adam.shard_cost(_spec(rows, dim, pf), ShardingType.TABLE_WISE, ComputeKernel.FUSED, rows, dim)[1]
        > ddr
    )


def test_storage_is_priced_at_the_width_the_kernel_allocates():
    """fbgemm pads rows to a multiple of 4 columns (every GPU table; sequence tables on CPU): a dim-6 sequence table
    allocated 43% more than its plan said, a dim-1 table on GPU 4 times as much."""
    import dataclasses

    from lightning_rec.embedding import EmbeddingCollection
    from lightning_rec.optim import FusedOptimizerConfig
    from lightning_rec.planner.estimate import CostModel

    rows, dim, st = 1000, 6, ShardingType.TABLE_WISE
    seq = EmbeddingCollection(tables=[EmbeddingConfig(name="t", num_embeddings=rows, embedding_dim=dim)],
                              optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.1))
    tbe = seq.fused_kernels()[0].tbe
    allocated = sum(t.untyped_storage().nbytes() for t in (tbe.weights_host, tbe.momentum1_host))
    cost = CostModel(cpu(1), batch_size=8, optimizer="rowwise_adagrad", pipelined=False)
    spec = dataclasses.replace(_spec(rows, dim), pooled=False)

    def storage(cost, spec, kernel=ComputeKernel.FUSED, memory=1):  # less the batch buffers (a 0-row shard's)
        shard = cost.shard_cost(spec, st, kernel, rows, spec.dim)[memory]
        return shard - cost.shard_cost(spec, st, kernel, 0, spec.dim)[memory]

    assert storage(cost, spec) == allocated == rows * 8 * 4 + rows * 4
    assert storage(cost, _spec(rows, dim)) == rows * dim * 4 + rows * 4  # CPU bags: the native kernel, unpadded
    gpu = CostModel(Topology(world_size=1, compute_device="cuda", hbm_cap=8 * GB, ddr_cap=8 * GB), batch_size=8)
    assert storage(gpu, _spec(rows, 1), memory=0) == rows * 4 * 4 + rows * 4
    assert storage(gpu, _spec(rows, 1), ComputeKernel.FUSED_UVM) == rows * 4 * 4 + rows * 4


def test_uvm_caching_puts_its_cache_in_device_memory():
    from lightning_rec.planner.estimate import CostModel

    topo = Topology(world_size=2, compute_device="cuda", hbm_cap=8 * GB, ddr_cap=64 * GB)
    cost = CostModel(topo, batch_size=64)
    st, rows, dim = ShardingType.TABLE_WISE, 10**6, 64
    fused = cost.shard_cost(_spec(rows, dim), st, ComputeKernel.FUSED, rows, dim)
    uvm = cost.shard_cost(_spec(rows, dim), st, ComputeKernel.FUSED_UVM, rows, dim)
    small = cost.shard_cost(_spec(rows, dim, clf=0.1), st, ComputeKernel.FUSED_UVM_CACHING, rows, dim)
    big = cost.shard_cost(_spec(rows, dim, clf=0.5), st, ComputeKernel.FUSED_UVM_CACHING, rows, dim)
    assert fused[1] == 0 and uvm[1] == small[1] == fused[0] - uvm[0]  # the table moves to host memory
    assert uvm[0] < small[0] < big[0] < fused[0]
    assert fused[2] < big[2] < small[2] < uvm[2]  # lookups through PCIe are slower; a cache helps


def test_planner_takes_torchrecs_positional_order_and_refuses_its_components_by_name():
    """TorchRec's EmbeddingShardingPlanner(topology, batch_size, enumerator, ..., constraints, debug): a ported
    EmbeddingShardingPlanner(topo, 8192) was TypeError "'int' object is not iterable" (read as constraints), debug=
    and proposer= plain TypeErrors."""
    only = {"s0": ParameterConstraints(pooling_factors=3)}
    p = EmbeddingShardingPlanner(cpu(), 8192, None, None, None, None, None, None, only, False)
    assert p._cost_args[0] == 8192 and p.constraints == only and p.debug is False
    p = EmbeddingShardingPlanner(cpu(), only, batch_size=64)  # this planner's own earlier form still works
    assert p._cost_args[0] == 64 and p.constraints == only
    assert EmbeddingShardingPlanner(cpu(), debug=True, print_stats=False).debug is True
    with pytest.raises(ValueError, match=r"proposer=\.\.\.\) is TorchRec's.*max_proposals"):
        EmbeddingShardingPlanner(cpu(), 64, proposer=object())
    with pytest.raises(ValueError, match=r"enumerator=.*ParameterConstraints\(sharding_types"):
        EmbeddingShardingPlanner(cpu(), 64, object())
    with pytest.raises(ValueError, match="batch_size twice"):
        EmbeddingShardingPlanner(cpu(), 64, batch_size=32)


def test_constraints_take_torchrecs_fields_in_its_order_and_refuse_what_would_change_the_plan():
    """ParameterConstraints(num_poolings=, batch_sizes=, cache_params=, stochastic_rounding=, bounds_check_mode=) were
    plain TypeErrors, and a positional ParameterConstraints(types, kernels, 16) set pooling_factors, where TorchRec
    sets min_partition."""
    assert ParameterConstraints(["table_wise"], ["fused"], 16).min_partition == 16
    same = ParameterConstraints(num_poolings=[1.0, 1.0], batch_sizes=[64, 64], enforce_hbm=None, pooling_factors=[2, 3],
                                cache_params={"load_factor": 0.3})
    assert same.cache_load_factor == 0.3 and same.enforce_hbm is False
    tables = [EmbeddingBagConfig(name="s0", num_embeddings=100, embedding_dim=8, feature_names=["a", "b"])]
    EmbeddingShardingPlanner(cpu(), {"s0": same}, batch_size=64, print_stats=False).plan(tables)
    with pytest.raises(ValueError, match=r"'s0'.*feature_names=\['b', 'a'\].*\['a', 'b'\]"):
        EmbeddingShardingPlanner(cpu(), {"s0": ParameterConstraints(feature_names=["b", "a"])}).plan(tables)
    in_order = {"s0": ParameterConstraints(feature_names=["a", "b"])}
    EmbeddingShardingPlanner(cpu(), in_order, print_stats=False).plan(tables)
    with pytest.raises(ValueError, match=r"'s0'.*batch_sizes=\[64, 32\].*batch_size=64"):
        EmbeddingShardingPlanner(cpu(), {"s0": ParameterConstraints(batch_sizes=[64, 32])}, batch_size=64).plan(tables)
    for kwargs, words in [(dict(num_poolings=[2.0]), "one pooled embedding per feature"),
                          (dict(stochastic_rounding=False), "stochastic_rounding=False is not a setting"),
                          (dict(bounds_check_mode="NONE"), "ids are always checked"),
                          (dict(cache_params={"load_factor": 0.2, "algorithm": "LFU"}), "cache_params sets algorithm"),
                          (dict(pooling_factors=[1, 2], batch_sizes=[8, 8, 8]), "give one per feature"),
                          (dict(output_dtype="FP16"), "output_dtype='FP16' is not a setting"),
                          (dict(key_value_params={}), "SSD")]:
        with pytest.raises(ValueError, match=words):
            ParameterConstraints(**kwargs)


def test_a_weighted_collection_is_priced_with_its_weights():
    """A weighted EmbeddingBagCollection's ids carry 4 more bytes each; the planner priced them unweighted unless
    ParameterConstraints(is_weighted=True) said it again."""
    def cost(weighted: bool, constraints=None) -> TableStats:
        ebc = EmbeddingBagCollection(tables=small_tables(1), is_weighted=weighted, device=torch.device("meta"))
        constraints = {"s0": ParameterConstraints(sharding_types=["table_wise"], **(constraints or {}))}
        planner = EmbeddingShardingPlanner(cpu(2), constraints, print_stats=False)
        planner.plan(ebc)
        return planner.stats.tables[0]

    assert cost(True).ms > cost(False).ms and cost(True).ddr_bytes > cost(False).ddr_bytes
    assert cost(True) == cost(False, {"is_weighted": True})


def test_a_cache_load_factor_goes_with_the_plan_to_the_kernel_and_the_fit_check():
    """ParameterConstraints(cache_load_factor=0.05) changed the planner's estimate only: the plan did not carry it, so
    fbgemm built its default 20% cache (4x the device memory priced) and DistributedModelParallel's fit check, which
    assumed 20% too, could refuse the plan the planner had made. Now the plan carries it to both."""
    from lightning_rec.lookup import LocalTable, tbe_cache_load_factor
    from lightning_rec.model_parallel import plan_device_bytes
    from lightning_rec.types import ParameterSharding

    tables = [EmbeddingBagConfig(name="big", num_embeddings=2_000_000, embedding_dim=64, feature_names=["f0"])]
    model = nn.ModuleDict({"ebc": EmbeddingBagCollection(tables, device="meta")})
    caching = ParameterConstraints(compute_kernels=["fused_uvm_caching"], cache_load_factor=0.05)
    planner = EmbeddingShardingPlanner(Topology(world_size=2, compute_device="cuda", hbm_cap=256 * 2**20),
                                       batch_size=64, constraints={"big": caching}, print_stats=False)
    plan = planner.plan(model)
    ps = plan.plan["ebc"]["big"]
    assert ps.compute_kernel == "fused_uvm_caching" and ps.cache_load_factor == 0.05, ps
    assert "cache 5%" in str(ps) and ps.cache_params.load_factor == 0.05
    held = plan_device_bytes(plan, {"ebc": model["ebc"]}, 2)
    table_bytes = sum(s.shard_sizes[0] * s.shard_sizes[1] for s in ps.shards) * 4  # fp32, no fused optimizer state
    assert sum(sum(r.values()) for r in held) == pytest.approx(0.05 * table_bytes, rel=0.01)
    # one fbgemm TBE has one cache: its factor is the rows-weighted one of the tables that asked
    local = [LocalTable("a", 1000, 8, ("a",), "sum", compute_kernel="fused_uvm_caching", cache_load_factor=0.05),
             LocalTable("b", 3000, 8, ("b",), "sum", compute_kernel="fused_uvm_caching"),
             LocalTable("c", 5000, 8, ("c",), "sum")]
    assert tbe_cache_load_factor(local) == pytest.approx((1000 * 0.05 + 3000 * 0.2) / 4000)
    assert tbe_cache_load_factor(local[1:]) is None  # fbgemm's default
    with pytest.raises(ValueError, match="only compute_kernel 'fused_uvm_caching' has a cache"):
        ParameterSharding("table_wise", "fused", [0], cache_load_factor=0.05)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        ParameterSharding("table_wise", "fused_uvm_caching", [0], cache_load_factor=1.5)


def test_a_collection_on_fbgemm_cpu_is_priced_at_its_padded_width():
    """EmbeddingBagCollection(kernel="fbgemm") on CPU pads rows to 4 columns, but the planner priced the native
    kernel's unpadded rows: a dim-2 table took 20 MB where the plan said 12 MB. Now the collection's kernel is read."""
    from lightning_rec.optim import FusedOptimizerConfig

    rows = 100_000
    tables = [EmbeddingBagConfig(name="t", num_embeddings=rows, embedding_dim=2, feature_names=["f"])]
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.1)
    planned = {}
    for kernel in ("fbgemm", "native", "dense"):
        ebc = EmbeddingBagCollection(tables, optimizer=None if kernel == "dense" else opt, kernel=kernel)
        planner = EmbeddingShardingPlanner(cpu(1), batch_size=8, pipelined=False, print_stats=False,
                                           constraints={"t": ParameterConstraints(sharding_types=["table_wise"])})
        planner.plan(ebc)
        planned[kernel] = planner.stats.tables[0].ddr_bytes
        if kernel != "dense":
            tbe_bytes = sum(b.numel() * b.element_size() for k in ebc.fused_kernels()
                            for b in [*k.buffers(), *k.parameters()] if b.numel() >= rows)  # rows and their state
            assert planned[kernel] >= tbe_bytes, (kernel, planned[kernel], tbe_bytes)
    assert planned["fbgemm"] - planned["native"] == rows * 2 * 4  # two padding columns of fp32


def test_torchrec_topology_fields_are_accepted_or_refused_by_name():
    """Topology(bwd_compute_multiplier=...) and TorchRec's other fields were a TypeError naming no fix, and its
    bandwidths (bytes per millisecond there, per second here) were taken 1000 times too slow, silently."""
    cuda = dict(world_size=2, compute_device="cuda", hbm_cap=GB, ddr_cap=GB)
    t = Topology(**cuda, hbm_to_ddr_mem_bw=20e9)  # TorchRec's name for the link UVM lookups cross
    assert t.pcie_bw == 20e9 and Topology(**cuda, pcie_bw=20e9).pcie_bw == 20e9
    assert dataclasses.replace(Topology(**cuda), pcie_bw=10e9).pcie_bw == 10e9
    with pytest.raises(ValueError, match="same link; pass one of them"):
        Topology(**cuda, hbm_to_ddr_mem_bw=20e9, pcie_bw=10e9)
    for name, value in (("bwd_compute_multiplier", 2.0), ("custom_topology_data", {"ddr_cap": [GB, 2 * GB]}),
                        ("weighted_feature_bwd_compute_multiplier", 1.0), ("uneven_sharding_perf_multiplier", 1.0),
                        ("generalized_comms_bandwidths", object())):
        with pytest.raises(ValueError, match=rf"Topology\({name}=.*is TorchRec's.*leave it out"):
            Topology(**cuda, **{name: value})
    torchrec_bytes_per_ms = {"hbm_mem_bw": 897 * GB / 1000, "ddr_mem_bw": 51 * GB / 1000,
                             "hbm_to_ddr_mem_bw": 32 * GB / 1000, "intra_host_bw": 600 * GB / 1000,
                             "inter_host_bw": 12.5 * GB / 1000}
    for name, value in torchrec_bytes_per_ms.items():
        with pytest.raises(ValueError, match=rf"Topology {name}=.*bytes per second.*multiply a TorchRec figure"):
            Topology(**cuda, **{name: value})
        Topology(**cuda, **{name: value * 1000})  # the same figure in bytes per second
    assert Topology(world_size=2, intra_host_bw=8e8).intra_host_bw == 8e8  # CPU ranks over a slow host's gloo


def test_a_plan_for_many_ranks_prints_one_short_line_per_table():
    """print(plan) at 64 ranks made a 2,300-character line per row_wise table (the strategy prints it at setup);
    now a table of many shards prints their count, ranks, the first two and the last."""
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=64_000 * (i + 1), embedding_dim=64) for i in range(2)]
    planner = EmbeddingShardingPlanner(Topology(world_size=64, local_world_size=8, ddr_cap=64 * GB), print_stats=False,
                                       constraints={t.name: ParameterConstraints(sharding_types=["row_wise"])
                                                    for t in tables})
    plan = planner.plan(tables)
    lines = str(plan).splitlines()
    assert len(lines) == 3 and max(len(line) for line in lines) < 160, lines
    assert "t0  row_wise (fused) -> 64 shards on ranks 0-63: rank 0: rows 0:1000 cols 0:64; rank 1: rows 1000:2000 " \
           "cols 0:64; ...; rank 63: rows 63000:64000 cols 0:64" in lines[1], lines[1]
    assert len(plan.plan[""]["t0"].shards) == 64  # all of them are there to read
    few = EmbeddingShardingPlanner(cpu(2), print_stats=False).plan(tables)
    assert "..." not in str(few)  # two ranks: every shard, as before


def _subgroup_plan(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    pg = dist.new_group([1])  # every rank creates it; rank 1 plans for it, broadcasting from itself (not rank 0)
    planner = EmbeddingShardingPlanner(Topology(world_size=1), batch_size=64, print_stats=False)
    out = {"unpicklable": _unpicklable_error(rank, world_size)}
    if rank == 0:
        with pytest.raises(ValueError, match="rank 0 is not in pg.*call collective_plan on pg's ranks only"):
            planner.collective_plan(small_tables(), None, pg)
        return out
    return out | {"plan": str(planner.collective_plan(small_tables(), None, pg)), "ms": planner.stats.max_ms}


class _Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("configs unreadable")
        self.hook = lambda: None  # a local function: pickle refuses it


class _Unreadable(nn.Module):
    def embedding_bag_configs(self):
        raise _Unpicklable()


def _unpicklable_error(rank: int, world_size: int) -> str:
    with pytest.raises(Exception) as err:
        EmbeddingShardingPlanner(Topology(world_size=2), print_stats=False).collective_plan(_Unreadable())
    return repr(err.value)


def test_collective_plan_on_a_subgroup_plans_on_its_ranks():
    """collective_plan(model, None, pg) for a group of rank 1 plans there; on rank 0, outside the group,
    dist.new_group's placeholder was refused as 'pg must be a ProcessGroup, got a int'."""
    from dist_utils import run_ranks

    got = run_ranks(_subgroup_plan, 2)
    alone = EmbeddingShardingPlanner(Topology(world_size=1), batch_size=64, print_stats=False).plan(small_tables())
    assert "plan" not in got[0] and got[1]["plan"] == str(alone), got
    # rank 0's planning error held a local function: rank 0 raised "Can't pickle local object" in the broadcast and
    # rank 1 "Connection closed by peer", neither naming the error; rank 1 now gets its type and message
    assert [g["unpicklable"] for g in got] == ["_Unpicklable('configs unreadable')",
                                               "RuntimeError('planning on rank 0 failed: _Unpicklable: configs "
                                               "unreadable')"], got


def _shared_memory_held(rank: int, world_size: int) -> dict:
    from lightning_rec import DistributedModelParallel, KeyedJaggedTensor
    from lightning_rec.optim import FusedOptimizerConfig

    B, F, rows = 4096, 4, 1000  # 2 MB of embeddings a table: more than the transport's first 1 MB slots
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=64, feature_names=[f"f{i}"])
              for i in range(F)]
    model = nn.ModuleDict({"ebc": EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("sgd", lr=0.1))})
    # a CPU run on a GPU machine too (the shared-memory transport is the CPU path; forked ranks cannot use CUDA)
    planner = EmbeddingShardingPlanner(Topology(world_size=2, compute_device="cpu"), batch_size=B, pipelined=False,
                                       print_stats=False, constraints={
                                           t.name: ParameterConstraints(sharding_types=["table_wise"]) for t in tables})
    dmp = DistributedModelParallel(model, plan=planner.collective_plan(model), device="cpu", dense=None)
    ids = torch.randint(0, rows, (F * B,), generator=torch.Generator().manual_seed(rank))
    kjt = KeyedJaggedTensor.from_lengths_sync([f"f{i}" for i in range(F)], ids, torch.ones(F * B, dtype=torch.long))
    dmp.module["ebc"](kjt).values().sum().backward()
    held = dmp._transport._data.nbytes  # this rank's /dev/shm region: two slots
    planned = planner.stats.ranks[rank].ddr_used - planner.stats.ranks[rank].shards["table_wise"] * rows * 64 * 4
    return {"held": held, "planned_batch_bytes": planned}


def test_the_shared_memory_transport_is_in_the_planned_memory():
    """On one CPU host the embeddings travel through each rank's /dev/shm region (two slots of what it sends), which
    the planner left out: 4 MB a rank here, beside the 8.2 MB of batch buffers it counted. Now they are priced too."""
    from dist_utils import run_ranks

    for got in run_ranks(_shared_memory_held, 2):
        # the region, the ids, the outputs and their gradients: what was priced covers what the run holds
        assert got["held"] == 4 * 2**20 and got["planned_batch_bytes"] >= got["held"] + 2 * 4096 * 2 * 2 * 64 * 4, got


def test_column_splits_use_every_rank_of_a_cluster_of_3_or_6():
    """Column blocks came in powers of two only: on 3 ranks a table that fits in 3 blocks of 32 columns (and no 2) was
    refused, and on 6 ranks (3 hosts of 2) column_wise and grid_shard left a third of the cluster out."""
    big = EmbeddingBagConfig(name="big", num_embeddings=4_000_000, embedding_dim=96, feature_names=["f"])
    only_columns = {"big": ParameterConstraints(sharding_types=["column_wise"])}
    plan = EmbeddingShardingPlanner(Topology(world_size=3, ddr_cap=int(0.75 * GB)), batch_size=64,
                                    constraints=only_columns, print_stats=False).plan([big])
    check_complete(plan, [big], 3)
    assert sorted(s.placement for s in plan.plan[""]["big"].shards) == [0, 1, 2]
    for st, blocks in (("column_wise", 6), ("grid_shard", 3)):  # 3 hosts: grid's column blocks go one per host
        constraints = {"big": ParameterConstraints(sharding_types=[st], min_partition=16)}
        six = EmbeddingShardingPlanner(Topology(world_size=6, local_world_size=2, ddr_cap=int(0.4 * GB)),
                                       batch_size=64, print_stats=False, constraints=constraints).plan([big])
        check_complete(six, [big], 6, local_world_size=2)
        shards = six.plan[""]["big"].shards
        assert len({s.shard_offsets[1] for s in shards}) == blocks and len({s.placement for s in shards}) == 6, shards
    # too big even so: the message names the block width that holds the split, not "allow ... 'column_wise'"
    with pytest.raises(PlannerError, match=r"smallest, column_wise x3 .*min_partition=32 columns, so dim 96 makes at "
                                           r"most 3 of them on 6 ranks: lower it \(ParameterConstraints\(min_partitio"
                                           r"n=16\)\)"):
        EmbeddingShardingPlanner(Topology(world_size=6, local_world_size=2, ddr_cap=int(0.4 * GB)), batch_size=64,
                                 constraints=only_columns, print_stats=False).plan([big])


def test_a_replica_is_priced_at_its_own_width():
    """data_parallel tables are plain tensors (no fbgemm kernel, so no padding to 4 columns), but the planner priced a
    dim-1 replica on GPU, or on CPU beside kernel='fbgemm', at 4 columns: 4 times its weights and gradient."""
    from lightning_rec.planner.estimate import CostModel

    rows, st, dense = 1000, ShardingType.DATA_PARALLEL, ComputeKernel.DENSE
    gpu = CostModel(Topology(world_size=2, compute_device="cuda", hbm_cap=8 * GB, ddr_cap=8 * GB), batch_size=8)
    on_fbgemm = dataclasses.replace(_spec(rows, 1), cpu_kernel="fbgemm")
    for cost, memory in ((gpu, 0), (CostModel(cpu(2), batch_size=8), 1)):
        table, empty = (cost.shard_cost(on_fbgemm, st, dense, n, 1)[memory] for n in (rows, 0))
        assert table - empty == rows * 1 * 4 + rows * 4 + rows * 1 * 4  # weights, row-wise state, the dense gradient


def test_torchrecs_use_virtual_table_is_accepted_off_and_refused_on():
    """TorchRec's ParameterConstraints(use_virtual_table=False) (its default, written out) was a TypeError."""
    assert ParameterConstraints(use_virtual_table=False, pooling_factors=2.0).pooling_factors == [2.0]
    with pytest.raises(ValueError, match="use_virtual_table=True is not a setting here: virtual .*leave it out"):
        ParameterConstraints(use_virtual_table=True)


def test_a_table_too_big_for_the_shard_share_stays_in_device_memory_where_it_fits():
    """A 51 GB table on 3 GPUs of 40 GB: its fused shards (17 GB a rank) were dropped as over the per-shard share
    (max_shard_fraction) while its UVM ones were not, so it went to host memory behind a cache, 4 times slower by the
    planner's own estimate. The share now only picks among options of the same kernel."""
    big = [EmbeddingBagConfig(name="big", num_embeddings=100_000_000, embedding_dim=128, feature_names=["f"])]
    planner = EmbeddingShardingPlanner(Topology(world_size=3, compute_device="cuda", hbm_cap=40 * GB,
                                                ddr_cap=256 * GB), batch_size=4096, print_stats=False)
    ps = planner.plan(big).plan[""]["big"]
    assert ps.compute_kernel == ComputeKernel.FUSED and len(ps.shards) == 3, ps
    assert all(r.hbm_used <= r.hbm_cap for r in planner.stats.ranks)



def test_stats_after_a_failed_plan_are_not_the_previous_plans():
    """planner.plan(a) then a planner.plan(b) that raised left a's stats in planner.stats, read as b's."""
    planner = EmbeddingShardingPlanner(cpu(2), print_stats=False)
    planner.plan(small_tables())
    assert planner.stats.tables
    too_big = [EmbeddingBagConfig(name="huge", num_embeddings=10**9, embedding_dim=128)]
    with pytest.raises(PlannerError):
        planner.plan(too_big)
    with pytest.raises(ValueError, match="last plan\\(\\) raised"):
        _ = planner.stats


def test_the_gpu_fit_check_prices_replicas_as_the_planner_does():
    """planner/fits.py (DistributedModelParallel's check of a plan against the GPU) padded a data_parallel replica's
    rows to 4 columns, where the planner (and the replica, a plain tensor) does not: a dim-1 replica counted 20 bytes
    a row there against 12 in the plan, so a plan the planner made for that GPU was refused as too big. Now both
    price it alike: what the planner places fits, and what it cannot place does not."""
    from lightning_rec.model_parallel import plan_device_bytes
    from lightning_rec.optim import FusedOptimizerConfig
    from lightning_rec.planner.fits import check_plan_fits

    rows = 10_000_000
    tables = [EmbeddingBagConfig(name="t", num_embeddings=rows, embedding_dim=1, feature_names=["f"])]
    ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("rowwise_adagrad"), device="meta")
    model = torch.nn.ModuleDict({"ebc": ebc})
    constraints = {"t": ParameterConstraints(sharding_types=["data_parallel"])}

    def plan(hbm_cap):
        topology = Topology(world_size=2, compute_device="cuda", hbm_cap=hbm_cap)
        return EmbeddingShardingPlanner(topology, batch_size=8, constraints=constraints, optimizer="rowwise_adagrad",
                                        print_stats=False).plan(model)

    cap = 160 * 2**20  # 136 MiB for tables: the replica's 120 MB (weights, row-wise state, gradient) fit
    by_rank = plan_device_bytes(plan(cap), {"ebc": ebc}, 2)
    assert by_rank[0] == {"ebc.t": rows * (4 + 4 + 4)}
    check_plan_fits(by_rank, cap)
    small = 120 * 2**20  # 102 MiB for tables: neither places it
    with pytest.raises(ValueError):
        plan(small)
    with pytest.raises(ValueError, match="on rank 0"):
        check_plan_fits(by_rank, small)
