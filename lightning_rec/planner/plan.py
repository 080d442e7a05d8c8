"""The planner: enumerate priced options per table -> propose combinations -> partition onto ranks.

A proposal picks one option per table; the partitioner places its pieces (estimate.py) under each rank's memory,
and its score is its slowest rank's estimated ms. Proposers, in order:

1. greedy: every table's cheapest option (least total work); while it does not fit, the tables
   holding the most of the short memory move to options that hold less (UVM, caching, finer
   splits); then, while it helps, the biggest contributor to the slowest rank moves to a finer split;
2. uniform: every table on one sharding type, where it has it;
3. grid search: every combination of the top options of the heaviest tables, around the best plan.

Everything is ordered by numbers and table/rank indexes, so the same inputs give the same plan."""

from __future__ import annotations

import operator
import pickle
import time
from collections.abc import Mapping

import numpy as np

from lightning_rec import comm
from lightning_rec.optim.config import emb_optim_type
from lightning_rec.planner.constraints import DEFAULT_MIN_PARTITION, ParameterConstraints
from lightning_rec.planner.estimate import (
    COMM,
    COMPUTE,
    DDR,
    HBM,
    UVM_KERNELS,
    CostModel,
    ShardingOption,
    TableSpec,
    enumerate_options,
)
from lightning_rec.planner.partition import _EPS, _Placement
from lightning_rec.planner.proposers import _Search
from lightning_rec.planner.stats import GB, PlanStats, RankStats, TableStats
from lightning_rec.planner.topology import Topology
from lightning_rec.sharding.layout import shard_layout
from lightning_rec.types import (
    ComputeKernel,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)

_DEFAULT_OPTIMIZER = "rowwise_adagrad"  # prices tables whose collection has no fused update of its own


class PlannerError(ValueError):
    """No plan fits: the message names the tables, what they need, the capacity, and the fix."""


def _element_size(dtype) -> int:
    size = getattr(dtype, "itemsize", None)
    if size is None:
        import torch

        size = torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 4
    return int(size)


def _is_pooled(cfg) -> bool:
    # EmbeddingBagConfig has `pooling` (sum / mean); EmbeddingConfig (sequence) has none
    return str(getattr(cfg, "pooling", "none")).lower().split(".")[-1] != "none"


def find_tables(module) -> list[tuple[str, list, bool | None]]:
    """(module path, configs, pooled) for each embedding collection in `module`. Accepts a model (any module with
    `embedding_bag_configs()` / `embedding_configs()` inside), one collection, or a list of configs (path "", pooled
    read from each config: None)."""
    if isinstance(module, (list, tuple)):
        return [("", list(module), None)] if module else []
    if hasattr(module, "named_modules"):
        found = []
        for path, m in module.named_modules():
            if callable(getattr(m, "embedding_bag_configs", None)):
                found.append((path, list(m.embedding_bag_configs()), True))
            elif callable(getattr(m, "embedding_configs", None)):
                found.append((path, list(m.embedding_configs()), False))
        return found
    raise ValueError(f"cannot plan for {type(module).__name__}: pass a model holding EmbeddingBagCollection / "
                     f"EmbeddingCollection modules, or a list of EmbeddingBagConfig")


# TorchRec's EmbeddingShardingPlanner positional order after the topology
_TORCHREC_POSITIONAL = ("batch_size", "enumerator", "storage_reservation", "proposer", "partitioner",
                        "performance_model", "stats", "constraints", "debug", "callbacks", "timeout_seconds")
# what each of TorchRec's pluggable components was for, and the knob that does it here
_TORCHREC_COMPONENTS = {
    "enumerator": "options come from constraints={table: ParameterConstraints(sharding_types=..., "
                  "compute_kernels=...)}",
    "storage_reservation": "reserve memory with reserved_fraction=... (TorchRec's "
                           "HeuristicalStorageReservation(percentage=...))",
    "proposer": "the greedy, uniform and grid-search proposers all run; bound the search with max_proposals=... "
                "and grid_search_limit=...",
    "partitioner": "the built-in partitioner balances the estimated time per rank",
    "performance_model": "plans are scored by the slowest rank's estimated time",
    "stats": "the plan's statistics print when print_stats=True and are in planner.stats",
    "callbacks": "edit the returned ShardingPlan instead; every rank checks it again",
    "timeout_seconds": "bound the search with max_proposals=... and grid_search_limit=...",
}


class EmbeddingShardingPlanner:
    """Decides, for every embedding table, its sharding type, compute kernel and ranks.

    planner = EmbeddingShardingPlanner(Topology(world_size=8, compute_device="cuda", hbm_cap=80 * GB),
                                       constraints={"t0": ParameterConstraints(pooling_factors=[20])},
                                       batch_size=8192)
    plan = planner.plan(model)          # ShardingPlan; planner.stats holds the PlanStats

    Arguments take TorchRec's positional order (its pluggable components refused by name). `optimizer` prices the
    tables' optimizer state and decides which sharding types apply; left out, each collection's own update."""

    def __init__(self, topology: Topology | None = None, *args, batch_size: int | None = None,
                 constraints: Mapping[str, ParameterConstraints] | None = None, optimizer=None,
                 pipelined: bool | int = True, reserved_fraction: float = 0.15, max_shard_fraction: float = 0.125,
                 max_proposals: int = 200, grid_search_limit: int = 64, print_stats: bool = True, debug: bool = True,
                 **torchrec_components):
        batch_size, constraints, debug = _read_positional(args, batch_size, constraints, debug, torchrec_components)
        _refuse_components(torchrec_components)
        # debug: TorchRec's switch for a more detailed stats log; the stats here are detailed already
        self.debug = debug
        # what was left to the defaults: RecStrategy(planner=...) fills them with the run's own
        self._defaulted = {name for name, value in (("topology", topology), ("batch_size", batch_size))
                           if value is None}
        batch_size = 512 if batch_size is None else batch_size  # TorchRec's default BATCH_SIZE
        batch_size = _check_sizes(batch_size, reserved_fraction, max_shard_fraction)
        self.topology = topology if topology is not None else _default_topology()
        self.constraints = _check_constraints(constraints)
        # None: the fused optimizer of the module being planned (plan()), else row-wise Adagrad.
        self._optimizer_given = optimizer is not None
        self._cost_args = (batch_size, pipelined)
        self._set_optimizer(optimizer if optimizer is not None else _DEFAULT_OPTIMIZER)
        self.reserved_fraction = reserved_fraction
        self.max_shard_fraction = max_shard_fraction
        self.max_proposals = max_proposals
        self.grid_search_limit = grid_search_limit
        self.print_stats = print_stats
        self._stats: PlanStats | None = None

    @property
    def stats(self) -> PlanStats:
        if self._stats is None:
            raise ValueError("planner.stats is read before a plan was made (none yet, or the last plan() raised): "
                             "call planner.plan(model) first")
        return self._stats

    @property
    def capacity(self) -> np.ndarray:
        """Bytes per rank the tables may use: (HBM, DDR) after the reserved share."""
        t = self.topology
        return np.array([t.hbm_cap, t.ddr_cap], dtype=np.float64) * (1 - self.reserved_fraction)

    # --- input --------------------------------------------------------------------------------
    def _specs(self, module) -> list[TableSpec]:
        specs: list[TableSpec] = []
        names: set[str] = set()
        collections = dict(module.named_modules()) if hasattr(module, "named_modules") else {}
        weighted = {path for path, m in collections.items()
                    if callable(getattr(m, "is_weighted", None)) and m.is_weighted()}
        for path, configs, pooled in find_tables(module):
            in_module: set[str] = set()
            for cfg in configs:
                name = cfg.name
                if name in in_module:
                    raise ValueError(
                        f"table '{name}' appears twice in '{path or '<root>'}': give each table a unique name"
                    )
                in_module.add(name)
                names.add(name)
                c = self.constraints.get(name) or ParameterConstraints()
                c.validate_for(name)
                c.check_batch_size(name, self._cost_args[0])
                features = list(getattr(cfg, "feature_names", None) or [name])
                c.check_features(name, features)
                pfs = c.pooling_factors
                if len(pfs) == 1:
                    pfs = pfs * len(features)
                elif len(pfs) != len(features):
                    raise ValueError(f"table '{name}' has {len(features)} features but {len(pfs)} pooling factors: "
                                     f"give one per feature, or one for all")
                if cfg.num_embeddings <= 0 or cfg.embedding_dim <= 0:
                    raise ValueError(f"table '{name}' has {cfg.num_embeddings} rows x dim {cfg.embedding_dim}: "
                                     "both must be positive")
                specs.append(
                    TableSpec(
                        index=len(specs),
                        path=path,
                        name=name,
                        rows=int(cfg.num_embeddings),
                        dim=int(cfg.embedding_dim),
                        elem_bytes=_element_size(getattr(cfg, "data_type", None) or 4),
                        pooled=_is_pooled(cfg) if pooled is None else pooled,
                        num_features=len(features),
                        pooling_factors=pfs,
                        # a weighted collection's ids carry weights whatever the constraints say (as TorchRec reads it)
                        is_weighted=c.is_weighted or path in weighted,
                        constraints=c,
                        cpu_kernel=_cpu_kernel(collections.get(path), cfg),
                    )
                )
        unknown = sorted(set(self.constraints) - names)
        if unknown:
            raise ValueError(f"constraints name table(s) {unknown} that the model does not have; its tables are "
                             f"{sorted(names)}: fix the names")
        if not specs:
            raise ValueError("found no embedding tables to plan: pass a model holding EmbeddingBagCollection / "
                             "EmbeddingCollection modules, or a non-empty list of table configs")
        return specs

    def _options(self, specs: list[TableSpec]) -> list[list[ShardingOption]]:
        caps = self.capacity
        options = []
        for spec in specs:
            opts, reasons = enumerate_options(spec, self._cost(spec), tuple(caps * self.max_shard_fraction))
            if not opts:
                why = "; ".join(_grouped(reasons)) or "no sharding type allowed"
                raise PlannerError(f"table '{spec.key}' has no sharding option on {self.topology.describe()}: {why}. "
                                   f"Fix: widen ParameterConstraints(sharding_types=..., compute_kernels=...) for it")
            fits_cluster = [o for o in opts if (o.totals[:2] <= caps * self.topology.world_size + _EPS).all()]
            fit = [o for o in fits_cluster if (o.max_piece_bytes <= caps + _EPS).all()]
            replicated = all(o.sharding_type == ShardingType.DATA_PARALLEL for o in opts)
            if not fit and (fits_cluster or replicated):
                # the cluster would hold the table, but no allowed sharding cuts it into shards that fit one rank
                raise PlannerError(self._shard_too_big_message(spec, opts, replicated))
            if not fit:
                raise PlannerError(self._too_big_for_cluster_message(spec, opts))
            # cheapest total work first; the enumeration order breaks ties
            options.append(sorted(opts, key=lambda o: (round(o.total_ms, 12), o.total_bytes)))
        return options

    def _too_big_for_cluster_message(self, spec: TableSpec, opts: list[ShardingOption]) -> str:
        cluster = self.capacity * self.topology.world_size
        # the option closest to fitting, not the one of fewest bytes
        closest = min(opts, key=lambda o: (float(np.maximum(o.totals[:2] - cluster, 0).sum()), o.total_bytes,
                                           o.describe()))
        needs = (f"its closest option, {closest.describe()}, needs {self._mem(closest.totals)} but "
                 f"{self.topology.world_size} ranks hold {self._mem(cluster)} for tables")
        if closest.kernel in UVM_KERNELS and closest.totals[DDR] <= cluster[DDR]:
            return (f"table '{spec.key}' ({spec.rows} rows x dim {spec.dim}) does not fit the cluster's device memory: "
                    f"{needs}. Its rows fit in host memory; what does not fit is device memory for its batch buffers "
                    f"(the ids and embeddings of a batch, batch_size={self.cost.batch_size} per rank, and "
                    f"fused_uvm_caching's cache; more ranks do not shrink them). Fix: give each rank more device "
                    f"memory (hbm_cap), or plan a smaller batch_size.")
        return (f"table '{spec.key}' ({spec.rows} rows x dim {spec.dim}) is larger than the whole cluster: {needs}. "
                f"{_fixes(self.topology)}")

    def _mem(self, pair) -> str:
        # CPU ranks have no HBM: "HBM 0 bytes + DDR 1.23 MB" on every figure was noise
        return _mem(pair) if self.topology.compute_device == "cuda" else f"DDR {_gb(pair[1])}"

    def _shard_too_big_message(self, spec: TableSpec, opts: list[ShardingOption], replicated: bool) -> str:
        caps = self.capacity
        least = min(opts, key=lambda o: (float(o.max_piece_bytes.sum()), o.describe()))
        how = (
            "data_parallel copies the whole table to every rank, so more ranks do not help: allow a sharded type "
            "for it (ParameterConstraints(sharding_types=['table_wise', 'row_wise', 'column_wise']))"
            if replicated
            else "allow a finer split for it (ParameterConstraints(sharding_types=[..., 'row_wise', 'column_wise']), "
            "whose shards shrink as ranks are added)"
        )
        W = self.topology.world_size
        min_cols = spec.constraints.min_partition or min(spec.dim, DEFAULT_MIN_PARTITION)
        if not replicated and least.sharding_type in _COLUMN_SPLITS and spec.dim // min_cols < W:
            # column_wise is allowed already: the block width holds it
            how = (f"column blocks are at least min_partition={min_cols} columns, so dim {spec.dim} makes at most "
                   f"{spec.dim // min_cols} of them on {W} ranks: lower it (ParameterConstraints(min_partition="
                   f"{max(1, spec.dim // W)})) for more, narrower blocks, or {how}")
        return (
            f"table '{spec.key}' ({spec.rows} rows x dim {spec.dim}) has no allowed sharding whose shards fit one "
            f"rank: its smallest, {least.describe()}, puts {self._mem(least.max_piece_bytes)} on a rank, but a rank "
            f"holds {self._mem(caps)} for tables (reserved_fraction={self.reserved_fraction}). Fix: {how}, give each "
            f"rank more memory (hbm_cap / ddr_cap), a smaller embedding_dim, or hash ids into fewer rows (lower "
            f"num_embeddings)."
        )

    # --- planning -----------------------------------------------------------------------------
    def _set_optimizer(self, optimizer) -> None:
        # a FusedOptimizerConfig, or any name FusedOptimizerConfig takes (ours, fbgemm's / TorchRec's, torch.optim's)
        self.optimizer = str(emb_optim_type(getattr(optimizer, "optimizer", optimizer)))
        self.cost = CostModel(self.topology, self._cost_args[0], self.optimizer, self._cost_args[1])
        self._module_costs: dict[str, CostModel] = {}  # collection path -> its own update's (plan() sets them)

    def _collection_costs(self, module) -> None:
        """Each collection's tables are priced, and their sharding types chosen, by its own fused update."""
        self._module_costs = {}
        if self._optimizer_given or not hasattr(module, "named_modules"):
            return
        costs: dict[str, CostModel] = {}
        for path, m in module.named_modules():
            config = m.fused_optimizer_config() if callable(getattr(m, "fused_optimizer_config", None)) else None
            if config is not None:
                name = str(emb_optim_type(config.optimizer))
                if name not in costs:
                    costs[name] = CostModel(self.topology, self._cost_args[0], name, self._cost_args[1])
                self._module_costs[path] = costs[name]

    def _cost(self, spec: TableSpec) -> CostModel:
        return self._module_costs.get(spec.path, self.cost)

    def plan(self, module, sharders=None) -> ShardingPlan:
        """Plan every table of `module` (a model, a collection, or a list of configs); `sharders` is ignored."""
        del sharders
        start = time.perf_counter()
        self._stats = None  # a failed plan() left the previous model's stats readable, as if they were this one's
        if not self._optimizer_given:
            fused = [m.fused_optimizer_config() for m in _modules(module)
                     if callable(getattr(m, "fused_optimizer_config", None)) and m.fused_optimizer_config() is not None]
            # the collections' own update decides state bytes and which sharding types apply; none: the default
            self._set_optimizer(fused[0] if fused else _DEFAULT_OPTIMIZER)
        self._collection_costs(module)
        specs = self._specs(module)
        options = self._options(specs)
        search = _Search(options, self.topology, self.capacity, self.max_proposals)
        search.greedy()
        search.uniform()
        search.grid(self.grid_search_limit)
        if search.best is None:
            raise PlannerError(self._failure_message(specs, options, search))
        _, choice, proposer = search.best
        placement = search.cache[choice]
        chosen = [opts[j] for opts, j in zip(options, choice)]
        plan = self._build_plan(chosen, placement)
        self._stats = self._make_stats(
            chosen, placement, plan, len(search.cache), proposer, time.perf_counter() - start
        )
        if self.print_stats:
            print(self._stats)
        return plan

    def collective_plan(self, module, sharders=None, pg=None) -> ShardingPlan:
        """Plan on rank 0 and broadcast: every rank holds the same plan (or error); TorchRec's argument order."""
        import torch.distributed as dist

        if isinstance(sharders, dist.ProcessGroup) and pg is None:  # collective_plan(module, pg): one order fits all
            sharders, pg = None, sharders
        if isinstance(pg, int) and pg == getattr(dist.GroupMember, "NON_GROUP_MEMBER", None):
            # what dist.new_group(ranks) returns on a rank outside `ranks`: "got a int" named no cause
            raise ValueError(f"collective_plan(module, sharders, pg): rank {dist.get_rank()} is not in pg "
                             f"(dist.new_group returns a placeholder on the ranks it leaves out): call collective_plan "
                             f"on pg's ranks only")
        if pg is not None and not isinstance(pg, dist.ProcessGroup):
            raise ValueError(f"collective_plan(module, sharders, pg): pg must be a torch.distributed ProcessGroup "
                             f"(or None for the world), got a {type(pg).__name__}: pass pg=dist.GroupMember.WORLD "
                             f"or a group from dist.new_group")
        if not (dist.is_available() and dist.is_initialized()):
            return self.plan(module, sharders)
        group_size = dist.get_world_size(pg)
        if group_size != self.topology.world_size:
            raise ValueError(f"Topology(world_size={self.topology.world_size}) but the process group has {group_size} "
                             f"ranks: plan with Topology(world_size={group_size}, ...)")
        src = dist.get_global_rank(pg, 0) if pg is not None else 0
        payload: list = [None]
        own_error, self._stats = None, None  # on every rank: an error below leaves no earlier plan's stats
        if dist.get_rank() == src:
            try:
                payload = [(self.plan(module, sharders), self._stats)]
            except Exception as e:  # every rank raises rank 0's error instead of hanging
                own_error, payload = e, [e]
                try:
                    pickle.dumps(e)
                except Exception:  # its own error was lost to "Can't pickle ...", the peers' to a closed connection
                    payload = [RuntimeError(f"planning on rank {src} failed: {type(e).__name__}: {e}")]
        payload = [comm.broadcast_object(payload[0], group=pg)]  # from the group's first rank, `src`
        if own_error is not None:
            raise own_error
        if isinstance(payload[0], Exception):
            raise payload[0]
        plan, self._stats = payload[0]
        return plan

    def _build_plan(self, chosen: list[ShardingOption], placement: _Placement) -> ShardingPlan:
        t = self.topology
        W, L = t.world_size, t.local_world_size
        out = ShardingPlan()
        for o, where in zip(chosen, placement.where):
            spec, st = o.spec, o.sharding_type
            kwargs: dict = {"local_world_size": L}
            if st == ShardingType.TABLE_WISE or st == ShardingType.COLUMN_WISE:
                kwargs["ranks"] = list(where)
            elif st in (ShardingType.TABLE_ROW_WISE, ShardingType.TABLE_COLUMN_WISE, ShardingType.GRID_SHARD):
                kwargs["host_indexes"] = list(where)
            shards = shard_layout(spec.name, spec.rows, spec.dim, st, W, **kwargs)
            # the cache share the estimate priced goes with the plan to the kernel (None: fbgemm's default)
            cache = spec.constraints.cache_load_factor if o.kernel == ComputeKernel.FUSED_UVM_CACHING else None
            ps = ParameterSharding(st, o.kernel, ranks=[s.placement for s in shards], shards=shards,
                                   cache_load_factor=cache)
            out.plan.setdefault(spec.path, EmbeddingModuleShardingPlan())[spec.name] = ps
        return out

    def _make_stats(self, chosen, placement: _Placement, plan: ShardingPlan, proposals: int, proposer: str,
                    seconds: float) -> PlanStats:
        caps = self.capacity
        shards: list[dict[str, int]] = [{} for _ in range(self.topology.world_size)]
        tables = []
        for o in chosen:
            ps = plan.plan[o.spec.path][o.spec.name]
            for s in ps.shards:
                d = shards[s.placement]
                d[str(o.sharding_type)] = d.get(str(o.sharding_type), 0) + 1
            tables.append(
                TableStats(o.spec.path, o.spec.name, str(o.sharding_type), str(o.kernel), sorted(set(ps.ranks)),
                           float(o.totals[HBM]), float(o.totals[DDR]), o.total_ms)
            )
        ranks = [
            RankStats(r, float(row[HBM]), float(caps[HBM]), float(row[DDR]), float(caps[DDR]), float(row[COMPUTE]),
                      float(row[COMM]), shards[r])
            for r, row in enumerate(placement.load)
        ]
        return PlanStats(self.topology.describe(), ranks, tables, proposals, proposer, seconds)

    def _failure_message(self, specs, options, search: _Search) -> str:
        caps = self.capacity
        t = self.topology
        choice, placement = search.last_failure
        failed = placement.failed
        shown = sorted(failed, key=lambda ti: (-options[ti][choice[ti]].total_bytes, ti))[:_MAX_FAILED_LISTED]
        lines = [
            f"no plan fits {len(specs)} table(s) on {t.describe()}; per rank, tables may use {self._mem(caps)} "
            f"(reserved_fraction={self.reserved_fraction}). {len(failed)} table(s) could not be placed"
            + (f"; the {len(shown)} largest:" if len(shown) < len(failed) else ":")
        ]
        for ti in shown:
            o = options[ti][choice[ti]]
            smallest = min(options[ti], key=lambda x: (x.total_bytes, x.describe()))
            lines.append(
                f"  '{specs[ti].key}' ({specs[ti].rows} rows x dim {specs[ti].dim}): {o.describe()} needs "
                f"{self._mem(o.totals)} in all, {self._mem(o.max_piece_bytes)} on its largest shard; its smallest "
                f"option {smallest.describe()} needs {self._mem(smallest.totals)}"
            )
        if len(shown) < len(failed):  # hundreds of alike lines buried the totals and the fix (49 KB for 500 tables)
            rest = sum(options[ti][choice[ti]].total_bytes for ti in failed if ti not in shown)
            lines.append(f"  ... and {len(failed) - len(shown)} more, needing {_gb(rest)} together")
        need = np.sum([options[i][j].totals[:2] for i, j in enumerate(choice)], axis=0)
        least = sum(min(o.total_bytes for o in opts) for opts in options)
        lines.append(
            f"All tables together need {self._mem(need)} as last proposed, and {_gb(least)} at the least (each "
            f"table on its smallest option); the cluster holds {self._mem(caps * t.world_size)}."
        )
        lines.append(_fixes(t))
        return "\n".join(lines)


_COLUMN_SPLITS = (ShardingType.COLUMN_WISE, ShardingType.TABLE_COLUMN_WISE, ShardingType.GRID_SHARD)
_MAX_FAILED_LISTED = 10  # tables named one per line in a "no plan fits" message; the rest are counted


def _read_positional(args: tuple, batch_size, constraints, debug, torchrec_components: dict) -> tuple:
    """(batch_size, constraints, debug) from the positional arguments after the topology, in TorchRec's order, or
    as this planner's earlier form (topology, constraints: a mapping). TorchRec's components join
    `torchrec_components`."""
    if args and isinstance(args[0], Mapping):
        if len(args) > 1 or constraints is not None:
            raise ValueError("EmbeddingShardingPlanner(topology, constraints, ...): pass the rest by keyword "
                             "(batch_size=..., optimizer=...)")
        return batch_size, args[0], debug
    if len(args) > len(_TORCHREC_POSITIONAL):
        raise ValueError(f"EmbeddingShardingPlanner takes at most {len(_TORCHREC_POSITIONAL) + 1} positional arguments "
                         f"(TorchRec's: topology, {', '.join(_TORCHREC_POSITIONAL)}), got {len(args) + 1}")
    given = dict(batch_size=batch_size, constraints=constraints, debug=debug)
    for name, value in zip(_TORCHREC_POSITIONAL, args):
        if name in given:
            if name != "debug" and given[name] is not None:
                raise ValueError(f"EmbeddingShardingPlanner got {name} twice (by position and by keyword)")
            given[name] = value
        else:
            torchrec_components[name] = value
    return given["batch_size"], given["constraints"], given["debug"]


def _refuse_components(torchrec_components: Mapping[str, object]) -> None:
    """TorchRec's pluggable pieces: each refused with the knob that does its job (None, its default, is fine)."""
    for name, value in torchrec_components.items():
        if name not in _TORCHREC_COMPONENTS:
            raise TypeError(f"EmbeddingShardingPlanner() got an unexpected keyword argument '{name}'")
        if value is not None:
            raise ValueError(f"EmbeddingShardingPlanner({name}=...) is TorchRec's; lightning_rec's planner has no such "
                             f"slot: {_TORCHREC_COMPONENTS[name]}")


def _check_sizes(batch_size, reserved_fraction: float, max_shard_fraction: float) -> int:
    """The planner's numbers, refused when out of range; the batch size as an int."""
    try:
        batch_size = operator.index(batch_size)
    except TypeError:
        raise ValueError(f"planner batch_size={batch_size!r} must be an int (the batch size per rank); constraints go "
                         f"in constraints={{table: ParameterConstraints(...)}}") from None
    if batch_size <= 0:
        raise ValueError(f"planner batch_size={batch_size} must be the positive batch size per rank")
    if not 0 <= reserved_fraction < 1:
        raise ValueError(f"planner reserved_fraction={reserved_fraction} must be in [0, 1): the share of each rank's "
                         f"memory kept for dense layers and activations")
    if not 0 < max_shard_fraction <= 1:
        raise ValueError(f"planner max_shard_fraction={max_shard_fraction} must be in (0, 1]")
    return batch_size


def _check_constraints(constraints: Mapping[str, ParameterConstraints] | None) -> dict[str, ParameterConstraints]:
    out = dict(constraints or {})
    for name, c in out.items():
        if not isinstance(c, ParameterConstraints):
            raise ValueError(f"constraints['{name}'] is a {type(c).__name__}: pass ParameterConstraints(...)")
    return out


def _grouped(reasons: list[str]) -> list[str]:
    """"table_wise (fused_uvm): X; row_wise (fused_uvm): X; ..." as "table_wise, row_wise, ... (fused_uvm): X"."""
    groups: dict[tuple[str, str], list[str]] = {}
    for r in reasons:
        head, sep, why = r.partition(": ")
        st, _, kernel = head.partition(" (")
        if not sep or not kernel.endswith(")") or " " in st:
            groups.setdefault((r, ""), [])
            continue
        groups.setdefault((f"({kernel}: {why}", "kernel"), []).append(st)
    return [f"{', '.join(types)} {text}" if kind else text for (text, kind), types in groups.items()]


def _gb(nbytes: float) -> str:
    """Bytes in GB, or in MB / KB / bytes below 1 GB (a small cluster's "needs 0.00 GB, holds 0.00 GB" said nothing)."""
    for unit, scale in (("GB", GB), ("MB", 1024**2), ("KB", 1024)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} bytes"


def _mem(pair) -> str:
    return f"HBM {_gb(pair[0])} + DDR {_gb(pair[1])}"


def _fixes(t: Topology) -> str:
    uvm = (
        "let tables live in host memory (allow the fused_uvm / fused_uvm_caching kernels, drop enforce_hbm, "
        "raise ddr_cap)"
        if t.compute_device == "cuda"
        else "give each rank more host memory (ddr_cap; UVM kernels need compute_device='cuda')"
    )
    return (
        f"Fix: more ranks (world_size > {t.world_size}), {uvm}, a smaller embedding_dim, or hash ids into "
        f"fewer rows (lower num_embeddings / the hash size limit); reserved_fraction also frees memory."
    )


def _default_topology() -> Topology:
    import torch
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    local = torch.cuda.device_count() if device == "cuda" else world
    local = local if local and world % local == 0 else world
    return Topology(world_size=world, compute_device=device, local_world_size=min(local, world))


def _cpu_kernel(collection, cfg) -> str | None:
    """The kernel `collection` runs `cfg`'s table with on CPU, or None where it does not say."""
    kernel, optimizer = getattr(collection, "_kernel", None), getattr(collection, "_optimizer", None)
    if kernel == "dense":
        return "dense"
    if kernel is None or optimizer is None:
        return None
    import torch

    from lightning_rec.lookup import choose_kernel

    try:
        return choose_kernel(kernel, optimizer, torch.device("cpu"), cfg.pooling_name())
    except ValueError:  # a kernel that cannot run: DistributedModelParallel refuses it, naming the fix
        return None


def _modules(module) -> list:
    """The module and its submodules (a list of configs has none)."""
    return list(module.modules()) if hasattr(module, "modules") else []
