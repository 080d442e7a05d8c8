"""Topology, ParameterConstraints, the planner and the sharding verbs."""

from __future__ import annotations

from .helpers import _t, bag_cfg, make_ebc, seq_cfg
from .registry import case, expect, simple

SMOKE = ("plan.topology_world_zero", "plan.constraints_unknown_sharding", "plan.nothing_fits_tiny_memory",
         "plan.verb_rank_beyond_world")


def planner_argument_cases() -> None:
    """Topology, ParameterConstraints and planner arguments."""
    from lightning_rec import EmbeddingShardingPlanner, ParameterConstraints, Topology

    simple("plan.topology_world_zero", lambda: Topology(world_size=0), ValueError, ["world_size", "0"])
    simple("plan.topology_world_float", lambda: Topology(world_size=2.0), ValueError, ["world_size"], ok=True,
           legit="2.0 ranks may be read as 2")
    simple("plan.topology_local_not_divisor", lambda: Topology(world_size=4, local_world_size=3), ValueError,
           ["local_world_size=3", "divide"])
    simple("plan.topology_device_tpu", lambda: Topology(world_size=2, compute_device="tpu"), ValueError,
           ["'tpu'", "cpu", "cuda"])
    simple("plan.topology_negative_bw", lambda: Topology(world_size=2, intra_host_bw=-1.0), ValueError,
           ["intra_host_bw"])
    simple("plan.topology_cuda_no_gpu", lambda: Topology(world_size=2, compute_device="cuda"), ValueError,
           ["hbm_cap"])
    simple("plan.constraints_unknown_sharding", lambda: ParameterConstraints(sharding_types=["diagonal"]),
           ValueError, ["diagonal", "row_wise"])
    simple("plan.constraints_unknown_kernel", lambda: ParameterConstraints(compute_kernels=["turbo"]),
           ValueError, ["turbo", "fused"])
    simple("plan.constraints_cache_factor_two", lambda: ParameterConstraints(cache_load_factor=2.0), ValueError,
           ["cache_load_factor"])
    simple("plan.constraints_min_partition_zero", lambda: ParameterConstraints(min_partition=0), ValueError,
           ["min_partition"])
    simple("plan.constraints_sharding_string", lambda: ParameterConstraints(sharding_types="row_wise"), ValueError,
           ["sharding"], ok=True, legit="one sharding type as a string is a list of one")
    simple("plan.planner_batch_zero", lambda: EmbeddingShardingPlanner(Topology(world_size=2), batch_size=0),
           ValueError, ["batch_size"])
    simple("plan.planner_constraint_dict", lambda: EmbeddingShardingPlanner(
        Topology(world_size=2), constraints={"t_a": {"sharding_types": ["row_wise"]}}), ValueError,
        ["'t_a'", "ParameterConstraints"])


def _ebc_big():
    from lightning_rec import EmbeddingBagCollection

    return EmbeddingBagCollection([bag_cfg("t_a", 1000, 16, ["a"]), bag_cfg("t_b", 600, 16, ["b"])])


def planner_plan_cases() -> None:
    """Plans the planner cannot make, and says why."""
    torch = _t()
    from lightning_rec import EmbeddingShardingPlanner, ParameterConstraints, PlannerError, Topology

    @case("plan.constraint_for_unknown_table", ValueError, ["t_zz", "t_a"])
    def _(ctx):
        EmbeddingShardingPlanner(Topology(world_size=2), constraints={"t_zz": ParameterConstraints(
            sharding_types=["row_wise"])}, print_stats=False).plan(_ebc_big())

    @case("plan.constraints_pooling_negative", ValueError, ["t_a", "pooling factor"])
    def _(ctx):
        EmbeddingShardingPlanner(Topology(world_size=2), constraints={"t_a": ParameterConstraints(
            pooling_factors=-1.0)}, print_stats=False).plan(_ebc_big())

    @case("plan.nothing_fits_tiny_memory", PlannerError, ["t_a", "ddr_cap"])
    def _(ctx):
        EmbeddingShardingPlanner(Topology(world_size=2, ddr_cap=1000), print_stats=False).plan(_ebc_big())

    @case("plan.column_wise_min_partition_above_dim", (PlannerError, ValueError), ["t_a", "min_partition"])
    def _(ctx):
        EmbeddingShardingPlanner(Topology(world_size=2), constraints={"t_a": ParameterConstraints(
            sharding_types=["column_wise"], min_partition=64)}, print_stats=False).plan(_ebc_big())

    @case("plan.no_sharding_types_allowed", (PlannerError, ValueError), ["sharding type=[]", "leave it out"])
    def _(ctx):
        EmbeddingShardingPlanner(Topology(world_size=2), constraints={"t_a": ParameterConstraints(
            sharding_types=[])}, print_stats=False).plan(_ebc_big())

    @case("plan.module_without_tables", (PlannerError, ValueError), ["EmbeddingBagCollection"])
    def _(ctx):
        EmbeddingShardingPlanner(Topology(world_size=2), print_stats=False).plan(torch.nn.Linear(3, 3))


def sharding_type_cases() -> None:
    """Sequence tables' sharding types, and plans written with the sharding verbs."""
    from lightning_rec import (
        EmbeddingCollection,
        EmbeddingShardingPlanner,
        ParameterConstraints,
        PlannerError,
        Topology,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )

    @case("plan.sequence_tables_two_hosts_only_valid_types")
    def _(ctx):
        from lightning_rec.types import SEQUENCE_SHARDING_TYPES
        ec = EmbeddingCollection([seq_cfg(f"t{i}", 50_000, 32, [f"f{i}"]) for i in range(6)])
        plan = EmbeddingShardingPlanner(Topology(world_size=8, local_world_size=4), print_stats=False).plan(ec)
        types = {str(ps.sharding_type) for mp in plan.plan.values() for ps in mp.values()}
        allowed = {str(t) for t in SEQUENCE_SHARDING_TYPES}
        expect(types <= allowed, f"planner gave sequence tables {types - allowed}")

    @case("plan.ec_forced_grid", (PlannerError, ValueError), ["grid", "t0"])
    def _(ctx):
        ec = EmbeddingCollection([seq_cfg("t0", 5000, 32, ["f0"])])
        EmbeddingShardingPlanner(Topology(world_size=4, local_world_size=2), constraints={
            "t0": ParameterConstraints(sharding_types=["grid_shard"])}, print_stats=False).plan(ec)

    @case("plan.verb_rank_beyond_world", ValueError, ["t_a", "rank 5"])
    def _(ctx):
        ebc = make_ebc()
        construct_module_sharding_plan(ebc, {"t_a": table_wise(rank=5), "t_b": table_wise(rank=0)}, world_size=2)

    @case("plan.verb_for_unknown_table", ValueError, ["t_zz"])
    def _(ctx):
        construct_module_sharding_plan(make_ebc(), {"t_a": row_wise(), "t_b": row_wise(), "t_zz": row_wise()},
                                       world_size=2)

    @case("plan.verb_missing_table", ValueError, ["t_b", "no entry"],
          legit="construct_module_sharding_plan builds partial plans as TorchRec's does; the plan check that "
          "DistributedModelParallel runs names the missing table")
    def _(ctx):
        from lightning_rec.model_parallel import validate_module_plan
        ebc = make_ebc()
        plan = construct_module_sharding_plan(ebc, {"t_a": row_wise()}, world_size=2)
        validate_module_plan("", ebc, plan, 2)

    @case("plan.verb_not_a_verb", ValueError, ["t_a"])
    def _(ctx):
        construct_module_sharding_plan(make_ebc(), {"t_a": "row_wise", "t_b": row_wise()}, world_size=2)


CASES = (planner_argument_cases, planner_plan_cases, sharding_type_cases)
