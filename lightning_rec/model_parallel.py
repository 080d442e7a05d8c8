"""DistributedModelParallel: embedding tables sharded over ranks, dense layers data parallel.

    model = DLRM(EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("rowwise_adagrad")), ...)
    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        model.sparse_arch.embedding_bag_collection,
        {"t0": table_wise(rank=0), "t1": row_wise(), "t2": column_wise(ranks=[0, 1]), "t3": data_parallel()},
    )})
    print(plan)
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", dense="ddp")
    opt = CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", torch.optim.Adagrad(dmp.parameters()))])

Every EmbeddingBagCollection / EmbeddingCollection inside `module` is swapped for its sharded
version (sharded_embedding.py); what remains (the dense layers) is wrapped in DDP or FSDP2. The
plan verbs (sharding/plan_verbs.py, importable from here) mirror TorchRec's; each becomes concrete
shards once the table's size and the world size are known (`construct_module_sharding_plan`). With
no plan, the planner decides (lightning_rec.planner), or every table goes table-wise, largest first
onto the least loaded rank, if the planner is absent.

Every plan is checked on every rank from metadata alone (plan_checks.py) before any collective
starts, so a bad plan raises the same ValueError everywhere instead of a hang.
Embedding traffic gets its own process group with a timeout (`timeout=` seconds), so a rank that
dies mid-step makes the others raise a clear error.

Loss scaling: fused tables (and replicas) are updated with the SUM of every rank's gradient, i.e.
as if trained on the concatenated global batch with loss = sum of the per-rank losses; DDP
averages dense gradients over ranks (divide by world size relative to that sum). Use a per-rank
loss that is a sum over samples, or scale the fused learning rate, to make the two agree.
"""

from __future__ import annotations

import gc
import logging
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from lightning_rec import comm
from lightning_rec._compat import ddp_has_forward_sync_buffers
from lightning_rec._device import with_cuda_index  # noqa: F401  (imported from here too)
from lightning_rec.collective_guard import CollectiveGuard, CollectiveMismatch, named_failure_allreduce_hook
from lightning_rec.dense_compile import compile_dense as _compile_dense
from lightning_rec.dense_compile import compile_options
from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingCollection, refuse_dtype_cast
from lightning_rec.errors import short_repr
from lightning_rec.optim import adopt_torch_in_backward, gather_fused_gradients
from lightning_rec.optim.fused import FusedOptimizer
from lightning_rec.plan_checks import check_same_everywhere, validate_module_plan
from lightning_rec.planner.fits import check_plan_fits
from lightning_rec.sharded_embedding import ShardingEnv, _ShardedCollectionBase, shard_collection
from lightning_rec.sharded_managed_collision import shard_managed_collision
from lightning_rec.sharding.plan_verbs import (  # noqa: F401  (the plan verbs are imported from here too)
    ShardingSpec,
    collection_configs,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_column_wise,
    table_row_wise,
    table_wise,
)
from lightning_rec.sharding.sharders import QCOMMS_NOT_APPLIED, SHARDERS
from lightning_rec.shm_transport import SharedMemoryGroup, ddp_comm_hook
from lightning_rec.types import EmbeddingModuleShardingPlan, ShardingPlan

DEFAULT_TIMEOUT_S = 300.0  # a peer still computing after 5 minutes is stuck; a mismatch is named in seconds


def find_collections(module: nn.Module) -> dict[str, nn.Module]:
    """module path -> every EmbeddingBagCollection / EmbeddingCollection in `module` (outermost only)."""
    found: dict[str, nn.Module] = {}
    for path, m in module.named_modules():
        if any(path == p or path.startswith(p + ".") for p in found if p) or ("" in found):
            continue
        if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection)):
            found[path] = m
    return found



def default_plan(collections: Mapping[str, nn.Module], world_size: int) -> ShardingPlan:
    """Every table table-wise: largest first, each onto the rank with the fewest bytes so far."""
    load = [0] * world_size
    items = [(path, c) for path, m in collections.items() for c in collection_configs(m)]
    items.sort(key=lambda pc: -pc[1].num_embeddings * pc[1].embedding_dim)
    plan = ShardingPlan()
    for path, c in items:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        load[rank] += c.num_embeddings * c.embedding_dim
        plan.plan.setdefault(path, EmbeddingModuleShardingPlan())[c.name] = table_wise(rank)(
            c.name, c.num_embeddings, c.embedding_dim, world_size)
    for path in collections:  # keep the model's table order when printed
        module_plan = plan.plan[path]
        plan.plan[path] = EmbeddingModuleShardingPlan(
            {c.name: module_plan[c.name] for c in collection_configs(collections[path])})
    return plan


def plan_device_bytes(plan: ShardingPlan, collections: Mapping[str, nn.Module], world_size: int) -> list[dict]:
    """rank -> {table: bytes in device memory} for a concrete plan (see planner/fits.py)."""
    from lightning_rec.planner.fits import device_bytes_by_rank

    configs = {p: {c.name: c for c in collection_configs(m)} for p, m in collections.items()}
    optimizers = {p: str(m.fused_optimizer_config().optimizer) for p, m in collections.items()
                  if m.fused_optimizer_config() is not None}
    return device_bytes_by_rank({p: plan.plan[p] for p in collections}, configs, optimizers, world_size)


def _planner_plan(module: nn.Module, world_size: int, local_world_size: int, device: torch.device,
                  pg) -> ShardingPlan | None:
    try:
        from lightning_rec.planner import EmbeddingShardingPlanner, Topology
    except ImportError:
        return None
    topology = Topology(world_size=world_size, compute_device=device.type, local_world_size=local_world_size)
    return EmbeddingShardingPlanner(topology).collective_plan(module, pg=pg)


# DistributedModelParallel ----------------------------------------------------------------------


def _check_sharders(sharders) -> None:
    """TorchRec's sharders=[EmbeddingBagCollectionSharder(...)] carry nothing we need (sharding/sharders.py): taken,
    their quantized comms named once as not applied; anything else is refused."""
    if sharders is None:
        return
    foreign = [s for s in sharders if not isinstance(s, SHARDERS)]
    if foreign:
        raise ValueError(
            f"DistributedModelParallel(sharders={short_repr(foreign)}): no sharders are needed here, every "
            f"EmbeddingBagCollection / EmbeddingCollection is sharded by DistributedModelParallel itself. Drop "
            f"sharders=; choose sharding types per table with plan= (construct_module_sharding_plan) or "
            f"EmbeddingShardingPlanner(constraints={{table: ParameterConstraints(sharding_types=[...])}}), and the "
            f"fused optimizer (a sharder's fused_params) with EmbeddingBagCollection(optimizer="
            f"FusedOptimizerConfig(...))")
    if any(s.qcomm_codecs_registry for s in sharders):
        logging.getLogger(__name__).info("DistributedModelParallel: %s", QCOMMS_NOT_APPLIED)


def _check_arguments(plan: ShardingPlan | None, dense: str | None, timeout: float | timedelta, timeout_setting: str,
                     *, sharders, env) -> float:
    """DistributedModelParallel's arguments, refused before anything is built; the timeout in seconds."""
    if env is not None:  # TorchRec's ShardingEnv.from_process_group(pg): the group is all it carries for us
        raise ValueError(f"DistributedModelParallel(env={short_repr(env)}): pass the process group itself, "
                         f"pg=<group> (TorchRec's env=ShardingEnv.from_process_group(pg)); leave both out to "
                         f"shard over the world")
    _check_sharders(sharders)
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("DistributedModelParallel needs torch.distributed: call "
                         "torch.distributed.init_process_group(backend='gloo' or 'nccl') on every rank first")
    if dense not in ("ddp", "fsdp", None):
        raise ValueError(f"dense={dense!r}: use 'ddp', 'fsdp' or None")
    if plan is not None and not isinstance(plan, ShardingPlan):  # a dict failed on `plan.plan`, unexplained
        raise ValueError(f"DistributedModelParallel(plan=...) takes a ShardingPlan, got a {type(plan).__name__}: "
                         f"build it with ShardingPlan({{module_path: construct_module_sharding_plan(collection, "
                         f"{{table: row_wise(), ...}})}}) (module_path as in model.named_modules(), '' for a "
                         f"collection passed alone)")
    timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not (math.isfinite(timeout_s) and timeout_s > 0):  # gloo would abort on its own assertion
        raise ValueError(f"{timeout_setting.replace('...', repr(timeout))}: the timeout is the seconds a rank "
                         f"waits for a slow peer; give a number > 0 (default {DEFAULT_TIMEOUT_S})")
    return timeout_s


def _default_device(device: torch.device | str | None) -> torch.device:
    """The given device (cuda with its index), else cuda:LOCAL_RANK when CUDA is there, else cpu; made current."""
    if device is None:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = with_cuda_index(torch.device(device), torch.cuda.current_device,
                             f"DistributedModelParallel(device={str(device)!r})")
    if device.type == "cuda":
        # NCCL's object collectives (the planner's broadcast, checkpoint gathers) stage through the current
        # device: a rank left at cuda:0 would meet rank 0 there
        torch.cuda.set_device(device)
    return device


def _other_paths(module: nn.Module, collections: Mapping[str, nn.Module]) -> dict[str, list[str]]:
    """Collection path -> the other paths that hold the same collection (one tower's tables shared by another).

    named_modules lists a shared collection once, and only that path was swapped; the others kept the unsharded
    collection, which trained a copy of its own beside the sharded one. Every path now holds the one sharded
    collection (planned under its first path)."""
    return {path: [p for p, x in module.named_modules(remove_duplicate=False) if x is m and p != path]
            for path, m in collections.items()}


def _resolve_plan(module: nn.Module, plan: ShardingPlan | None, collections: Mapping[str, nn.Module],
                  aliases: Mapping[str, list[str]], world_size: int, local_world_size: int, device: torch.device,
                  pg) -> ShardingPlan:
    """The plan every collection is sharded by (the given one, else the planner's; default_plan's for collections
    it leaves out), checked on every rank from metadata alone."""
    first_path = {alias: path for path, others in aliases.items() for alias in others}
    if plan is not None and any(p in first_path for p in plan.plan):
        named = [p for p in plan.plan if p in first_path and first_path[p] in plan.plan]
        if named:
            raise ValueError(f"the plan names one collection twice, at {named[0]!r} and {first_path[named[0]]!r} "
                             f"(both paths hold the same module): keep one entry")
        plan = ShardingPlan({first_path.get(p, p): v for p, v in plan.plan.items()})
    already = [p for p, m in module.named_modules() if isinstance(m, _ShardedCollectionBase)]
    if already:
        raise ValueError(f"the model's embedding collection(s) {already} are sharded already, by an earlier "
                         f"DistributedModelParallel: keep using that one (its .module is this model), or build a "
                         f"new model (a checkpoint of this one loads into it at any world size and plan)")
    if plan is None and collections:
        plan = _planner_plan(module, world_size, local_world_size, device, pg)
    plan = plan or ShardingPlan()
    missing = {p: m for p, m in collections.items() if p not in plan.plan}
    if missing:
        plan = ShardingPlan({**plan.plan, **default_plan(missing, world_size).plan})
    for path in plan.plan:
        if path not in collections:
            raise ValueError(f"the plan names module '{path}', which is not an embedding collection in the model; "
                             f"its collections are {sorted(collections)}: fix the module path")
    for path, m in collections.items():
        validate_module_plan(path, m, plan.plan[path], world_size, device)
    if device.type == "cuda":  # a plan bigger than the GPU: the planner's kind of explanation, not a CUDA OOM
        check_plan_fits(plan_device_bytes(plan, collections, world_size),
                        torch.cuda.get_device_properties(device).total_memory)
    return plan


def _set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, new)


class DistributedModelParallel(nn.Module):
    """Shards every embedding collection in `module` by `plan`; wraps the dense rest in DDP or FSDP2.

    Args:
        module: any model holding EmbeddingBagCollection / EmbeddingCollection (built with a fused
            optimizer), or one collection.
        plan: a ShardingPlan (module path -> table -> ParameterSharding); None: the planner's.
        device: where shards and dense layers live; default cuda:LOCAL_RANK when CUDA is there, else cpu.
            Embedding traffic uses NCCL on cuda, gloo on cpu.
        dense: "ddp" | "fsdp" (FSDP2 fully_shard) | None (leave the dense layers alone).
        pg: the process group to shard over (default: the world).
        timeout: seconds an embedding collective may wait for a peer before raising (default 300). A peer
            that is alive but at another collective (a rank that caught an error and went on), or that
            exited, is named within seconds instead (collective_guard.py); the timeout is for a peer
            that is still computing.
        timeout_setting: how error messages name the timeout setting; wrappers that build this
            module pass their own (RecStrategy: "RecStrategy(embedding_timeout=...)").
        sharders: TorchRec's argument, taken so that its code reads here: None or TorchRec's
            EmbeddingBagCollectionSharder / EmbeddingCollectionSharder (sharding/sharders.py), which carry
            nothing more. Every collection is sharded without one: sharding types per table come from the
            plan (or the planner's ParameterConstraints), the fused optimizer from the collection's config.
        env: TorchRec's argument (ShardingEnv.from_process_group(pg)); None only: pass the group as pg=.
        init_data_parallel: TorchRec's argument; False is dense=None (the dense layers left unwrapped; wrap
            them later with `init_data_parallel()`, as in TorchRec, or `wrap_dense("ddp" | "fsdp")`).
        local_world_size: ranks per host (host-level types); default $LOCAL_WORLD_SIZE or the world.
        ddp_kwargs: extra DistributedDataParallel arguments.
        shared_memory: CPU only. None (default): when every rank shares this host's /dev/shm, the
            embedding all-to-alls and DDP's gradient all-reduce move bytes through shared memory
            (shm_transport.py; gloo carries only a barrier), else through gloo. False: always gloo
            (e.g. to register your own DDP comm hook). True: shared memory or a ValueError.
        compile_dense: True (or a dict of torch.compile arguments) compiles the dense layers, the largest
            submodules with no collection inside, each whole and in place; the embedding lookups stay outside
            the graphs. One that cannot be captured whole runs eagerly, named in one warning (dense_compile.py).
        cuda_graphs: CUDA only: the compiled dense layers replay as CUDA graphs (compile_dense with
            torch.compile's mode="reduce-overhead"; one graph per batch shape).
    """

    def __init__(self, module: nn.Module, plan: ShardingPlan | None = None, device: torch.device | str | None = None,
                 dense: str | None = "ddp", *, pg=None, timeout: float | timedelta = DEFAULT_TIMEOUT_S,
                 local_world_size: int | None = None, ddp_kwargs: dict | None = None,
                 shared_memory: bool | None = None,
                 timeout_setting: str = "DistributedModelParallel(timeout=...)", sharders=None, env=None,
                 init_data_parallel: bool = True, compile_dense: bool | dict = False,
                 cuda_graphs: bool = False) -> None:
        super().__init__()
        compile_with = compile_options(compile_dense, "DistributedModelParallel", cuda_graphs)
        if not init_data_parallel:  # TorchRec's: the dense layers are left unwrapped
            dense = None
        self._timeout_s = _check_arguments(plan, dense, timeout, timeout_setting, sharders=sharders, env=env)
        pg = pg if pg is not None else dist.group.WORLD
        world_size, rank = dist.get_world_size(pg), dist.get_rank(pg)
        device = _default_device(device)
        local_world_size = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))

        collections = find_collections(module)
        for m in collections.values():  # before the plan: adopting makes the table parameters anew
            adopt_torch_in_backward(m)
        aliases = _other_paths(module, collections)
        plan = _resolve_plan(module, plan, collections, aliases, world_size, local_world_size, device, pg)
        self.plan = plan

        # Embedding traffic gets its own group: its own timeout, and no interleaving with DDP's.
        ranks = dist.get_process_group_ranks(pg)
        self._emb_pg = dist.new_group(ranks=ranks, backend="nccl" if device.type == "cuda" else "gloo",
                                      timeout=timedelta(seconds=self._timeout_s))
        # every embedding collective (and the strategy's own) waits through this guard: a peer at another
        # collective, or gone, is named within seconds; the timeout is for a peer still computing
        self._guard = CollectiveGuard(self._emb_pg, "embedding", self._timeout_s, timeout_setting)
        # before any table is built, and before the transport (collective only where shared_memory allows it: ranks
        # given different settings paired its set-up with this check's all-gather, "Connection closed by peer")
        check_same_everywhere(collections, plan, self._guard, device,
                              extra=[f"DistributedModelParallel(shared_memory={shared_memory!r})"])
        self._guard.remember_peers()  # every rank has published its pid before that collective
        self._transport = self._shared_memory_transport(shared_memory, device, world_size, timeout_setting)
        # a checkpoint's DCP exchanges (checkpoint.save(dmp=...)) get a group of their own with the same timeout,
        # gloo (they are small pickled plans): a peer that stops mid-save times out there, and the embedding group
        # stays sound for the guarded agreement after it, whose verdict names that peer. Built here, with every rank
        # present (built at a save, a stopped peer would hold it up with an unnamed error)
        self._checkpoint_pg = (dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=self._timeout_s))
                               if world_size > 1 else None)
        env = ShardingEnv(self._emb_pg, rank, world_size, device, self._timeout_s, self._transport)
        self._env = env
        module = self._shard_collections(module, collections, aliases, env)
        shard_managed_collision(module, env)  # id maps split with their rows (collective)
        _materialise_meta_layers(module, device)
        module.to(device)
        self._sharded_paths = list(collections)
        self._device = device
        self._pg, self.world_size, self._local_world_size = pg, world_size, local_world_size
        object.__setattr__(self, "_unwrapped", module)
        self._dmp_wrapped_module, self.dense = module, None
        # the dense layers compiled (their names), each whole; the collections outside the graphs
        self.compiled_dense: list[str] = []
        if compile_with is not None:
            self.compiled_dense = _compile_dense(module, compile_with)
        if dense is not None:
            self.wrap_dense(dense, ddp_kwargs)
        self._fused_optimizer: FusedOptimizer | None = None
        self._control_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # step_together

    def transport(self) -> str:
        """One line: how this model's ranks exchange embeddings (and DDP's gradients), within and across hosts."""
        W, L = self.world_size, self._local_world_size
        H = W // L if W % L == 0 else None
        if W == 1:
            return "lightning_rec transport: 1 rank, no exchanges"
        if self._transport is not None:
            how = "shared memory (/dev/shm; gloo only sets it up)" + (
                f": the {H} hosts share one /dev/shm" if H != 1 else "")
        elif self._device.type == "cuda":
            how = "NCCL (NVLink / PCIe within a host, the network across hosts)"
        else:  # one group for all: shared memory only when every rank maps every other's /dev/shm
            how = "gloo over TCP (the ranks do not all share one /dev/shm: other hosts, or shared_memory=False)"
        return (f"lightning_rec transport: {W} ranks on {H or '?'} host(s) of {L}: embedding "
                f"all-to-alls and DDP's gradients through {how}; checkpoint plans through gloo")

    def _shared_memory_transport(self, shared_memory: bool | None, device: torch.device, world_size: int,
                                 timeout_setting: str) -> SharedMemoryGroup | None:
        """Collective on CPU (unless shared_memory=False): the embedding group's shared-memory transport, or None."""
        if device.type != "cpu" or shared_memory is False or world_size == 1:
            return None
        transport = SharedMemoryGroup.create(self._emb_pg, self._timeout_s)
        if transport is None:
            if shared_memory:
                raise ValueError("shared_memory=True, but the ranks cannot map each other's /dev/shm files (other "
                                 "hosts, or no /dev/shm): leave shared_memory=None to use gloo there")
            return None
        transport.timeout_setting = timeout_setting
        transport.guard = self._guard if self._guard.enabled else None
        return transport

    def _shard_collections(self, module: nn.Module, collections: Mapping[str, nn.Module],
                           aliases: Mapping[str, list[str]], env: ShardingEnv) -> nn.Module:
        """Collective: every collection swapped for its sharded version at each of its paths; the model back."""
        init_seed = self._agree_init_seed(collections, env.device)
        for path, m in collections.items():
            built_on_meta = any(w.is_meta for w in m.lookup.table_weights().values())
            sharded = shard_collection(m, self.plan.plan[path], env)
            if built_on_meta:  # values drawn now: the same replicas everywhere, no two pieces alike
                sharded.init_weights(init_seed)
            else:
                self._broadcast_replicas(sharded, env.device)
            if path:
                for p in [path] + aliases[path]:
                    _set_submodule(module, p, sharded)
            else:
                module = sharded
        return module


    def groups_alive(self) -> bool:
        """False once torch.distributed.destroy_process_group() has destroyed the groups these shards talk over."""
        if not (dist.is_available() and dist.is_initialized()):
            return False
        try:
            dist.get_backend(self._emb_pg)  # a destroyed group is no longer in torch's map of groups
        except ValueError:
            return False
        return True

    def _agree_init_seed(self, collections: Mapping[str, nn.Module], device: torch.device) -> int:
        """Collective (when a collection was built on "meta"): rank 0's draw from its global RNG, on every rank.

        Ranks seeded alike would otherwise draw the same values for different tables (rank 0's first table
        = rank 1's first table), and ranks seeded apart would start data-parallel replicas apart for good.
        """
        if not any(w.is_meta for m in collections.values() for w in m.lookup.table_weights().values()):
            return 0
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        if dist.get_world_size(self._emb_pg) > 1:
            dev = device if self._guard.nccl else torch.device("cpu")
            seed = seed.to(dev)
            k = self._guard.begin()
            work = dist.broadcast(seed, src=dist.get_global_rank(self._emb_pg, 0), group=self._emb_pg, async_op=True)
            self._guard.wait_work(work, "initial values of tables built on 'meta' (seed)", k)
        return int(seed)

    @torch.no_grad()
    def _broadcast_replicas(self, sharded: _ShardedCollectionBase, device: torch.device) -> None:
        """Collective: data-parallel replicas take rank 0's values, as DDP does for dense layers.

        Each rank copies its replicas from its own unsharded model; ranks seeded apart would otherwise
        train different copies of one table for good (every rank applies the same summed update).
        """
        if dist.get_world_size(self._emb_pg) == 1:
            return
        src = dist.get_global_rank(self._emb_pg, 0)
        for name, w in sharded.replica_weights().items():
            k = self._guard.begin()
            work = dist.broadcast(w.data, src=src, group=self._emb_pg, async_op=True)
            self._guard.wait_work(work, f"data-parallel table '{name}' from rank 0", k)

    def wrap_dense(self, dense: str, ddp_kwargs: dict | None = None) -> None:
        """(Re)wrap the dense layers for a new training run ("ddp" | "fsdp"): a model sharded with dense=None
        (evaluation) that goes on to train, or another fit over this model. DDP gets a new wrapper, as
        Lightning gives a plain model one per fit; the old one is dropped first, so that its gradient hooks
        go with it. FSDP's sharding is in place and stays."""
        if self.dense is not None and self.dense != dense:
            raise ValueError(f"the dense layers are wrapped with {self.dense!r} already, not {dense!r}")
        if self.dense == "fsdp":
            return
        if self._dmp_wrapped_module is not self._unwrapped:
            self._dmp_wrapped_module = self._unwrapped
            gc.collect()  # the old DDP and its reducer (whose autograd hooks are on these parameters) are freed now
        self._dmp_wrapped_module = self._wrap_dense(self._unwrapped, dense, self._device, self._pg, ddp_kwargs or {},
                                                    self._transport, self._guard)
        self.dense = dense if self._dmp_wrapped_module is not self._unwrapped or dense == "fsdp" else None

    def compile_dense_layers(self, compile_dense: bool | dict = True, cuda_graphs: bool = False) -> list[str]:
        """As the constructor's compile_dense / cuda_graphs, later (a model sharded by an earlier run); the names of
        the dense layers compiled now (none where they were compiled already)."""
        options = compile_options(compile_dense, "DistributedModelParallel", cuda_graphs)
        names = _compile_dense(self._unwrapped, options) if options is not None else []
        self.compiled_dense += names
        return names

    def init_data_parallel(self) -> None:
        """TorchRec's: wrap the dense layers in DDP now (after DistributedModelParallel(init_data_parallel=False));
        nothing when they are wrapped already."""
        if self.dense is None:
            self.wrap_dense("ddp")

    @staticmethod
    def _wrap_dense(module: nn.Module, dense: str | None, device: torch.device, pg, ddp_kwargs: dict,
                    transport: SharedMemoryGroup | None = None, guard: CollectiveGuard | None = None) -> nn.Module:
        if dense is None or not any(p.requires_grad for p in module.parameters()):
            return module
        if dense == "ddp" and dist.is_initialized() and dist.get_world_size(pg) == 1:
            return module  # one rank: DDP would copy every gradient into its buckets to average it with nobody
        if dense == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [device.index] if device.type == "cuda" else None
            # TorchRec's defaults: buffers are synced once at construction, not re-broadcast every step
            # (a collective per forward); gradients share DDP's buckets.
            kwargs = dict(gradient_as_bucket_view=True)
            new_ddp = ddp_has_forward_sync_buffers()
            if new_ddp:  # torch >= 2.13
                kwargs["forward_sync_buffers"] = False
            kwargs.update(ddp_kwargs)
            ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=pg, **kwargs)
            if not new_ddp and "broadcast_buffers" not in ddp_kwargs:
                # torch 2.11 / 2.12: broadcast_buffers=False would skip the construction sync too, so keep
                # the default for __init__ and turn the per-forward broadcast off after it (DDP reads the
                # attribute at every forward).
                ddp.broadcast_buffers = False
            if transport is not None:  # gradient buckets averaged through shared memory, not gloo's TCP
                ddp.register_comm_hook(None, ddp_comm_hook(transport))
            elif guard is not None and guard.enabled and not guard.nccl:  # gloo: a dead peer is named
                ddp.register_comm_hook(None, named_failure_allreduce_hook(guard, pg))
            return ddp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(pg),))
        for child in _dense_children(module):
            fully_shard(child, mesh=mesh)
        return module

    # the model -------------------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The model with its collections sharded (without the DDP wrapper)."""
        return self._unwrapped

    def _apply(self, fn, recurse: bool = True):
        # checked before anything converts: the sharded collections refuse a dtype cast too, but only after the
        # dense layers that come before them in the model had been converted
        refuse_dtype_cast("DistributedModelParallel: its sharded", fn)
        return super()._apply(fn, recurse)

    def forward(self, *args, **kwargs):
        # a step: its embedding exchanges carry the number (no collective of their own), so that a rank whose step
        # raised before them and went on meets the others' previous step with CollectiveMismatch on every rank
        self._env.step += 1
        if self._transport is not None:
            self._transport.step = self._env.step
        return self._dmp_wrapped_module(*args, **kwargs)

    # Parameters and buffers under the model's own names, as TorchRec's DistributedModelParallel (and this
    # module's state_dict) name them: without these, the wrappers' '_dmp_wrapped_module.' (and DDP's 'module.')
    # came first, so that names from dmp.named_parameters() matched neither dmp.state_dict() nor the unsharded
    # model. named_modules() keeps the wrappers, as TorchRec's does.

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):  # type: ignore[override]
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True):  # type: ignore[override]
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def _fqn_modifiers(self) -> dict[str, str]:
        """For torch.distributed.checkpoint.state_dict (get_optimizer_state_dict(dmp, optimizer)), which finds each
        name's module attribute by attribute from here: the names above start under self.module."""
        return {name: "_unwrapped" for name, _ in self.module.named_children()}

    def sharded_modules(self) -> dict[str, _ShardedCollectionBase]:
        return {p: (self.module.get_submodule(p) if p else self.module) for p in self._sharded_paths}

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        """The fused embedding updates (and replicas) of this rank, as an optimizer (state per shard)."""
        if self._fused_optimizer is None:
            self._fused_optimizer = FusedOptimizer(self.module)
        return self._fused_optimizer

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation, as DDP's no_sync: inside, backward neither syncs the dense gradients (DDP, FSDP2)
        nor updates the fused tables (each kernel gathers its rows' gradients: optim.gather_fused_gradients). The
        first backward outside syncs the dense gradients and applies what the tables gathered with its own in one
        fused update, as one batch of all the micro-batches would; `fused_optimizer.step()` applies what is left."""
        from torch.nn.parallel import DistributedDataParallel

        wrapped = self._dmp_wrapped_module
        with ExitStack() as stack:
            if isinstance(wrapped, DistributedDataParallel):
                stack.enter_context(wrapped.no_sync())
            for m in wrapped.modules():  # FSDP2's own switch
                if callable(getattr(m, "set_requires_gradient_sync", None)):
                    m.set_requires_gradient_sync(False, recurse=False)
                    stack.callback(m.set_requires_gradient_sync, True, recurse=False)
            stack.enter_context(gather_fused_gradients(self.module))
            yield

    # collectives of the training loop, through the embedding group's guard ---------------------------

    def step_together(self, have: bool, batch_index: int, last: bool = False, stop: int = 0) -> bool:
        """Collective: does every rank have batch `batch_index` of this epoch? (False ends it for all.)

        last: this rank's batch is its loader's last (a sized loader, which Lightning does not ask
        again): `self.last_batch_agreed` then tells every rank that the epoch ends after this batch.
        stop: the signals this rank was sent, as bits (RecStrategy: 1 a SIGTERM, 2 SLURM's requeue signal):
        `self.stop_agreed` then maps each rank that was sent one to its bits, on every rank, so that all of them act
        at this batch (the bits ride on this reduction: no collective of their own).

        Every rank reports (has a batch, its index): ranks at different indexes (one consumed a batch
        the others did not) raise CollectiveMismatch on every rank, naming each rank's index, before
        their batches are mixed in one step. One tiny all-reduce, through shared memory when the
        tables use it.
        """
        nccl = self._guard.nccl  # NCCL: on a side stream, so that neither the all-reduce nor its read-back waits
        triples = comm.agree([int(have) + int(have and last), batch_index, int(stop)], self._emb_pg, self._transport,
                             device=self._device if nccl else None, stream=self._control_stream if nccl else None,
                             tag="ranks step together")
        indexes = [i for _, i, _ in triples]
        if len(set(indexes)) > 1:
            ranks = dist.get_process_group_ranks(self._emb_pg)
            where = ", ".join(f"rank {ranks[r]} at batch {i}" for r, i in enumerate(indexes))
            raise CollectiveMismatch(
                f"ranks are at different batches of the epoch ({where}): one rank skipped or consumed a batch "
                f"the others did not (a training_step that calls next(dataloader_iter) on some ranks only?). "
                f"Every rank must run every step")
        self.last_batch_agreed = any(h == 2 for h, _, _ in triples)  # 2: a rank's last batch (see `last`)
        self.any_batch_agreed = any(h for h, _, _ in triples)  # evaluation steps on while any rank has data
        self.stop_agreed = {dist.get_global_rank(self._emb_pg, r): s for r, (_, _, s) in enumerate(triples) if s}
        return all(h for h, _, _ in triples)

    def gather_object(self, obj, dst: int | None = 0) -> list | None:
        """Collective: every rank's picklable `obj`, in rank order, on group rank `dst`; None elsewhere.

        As torch.distributed.gather_object (dst=None: all_gather_object), but through the embedding
        group's guard: a rank that is elsewhere is named within seconds, and the wait is bounded by
        this module's timeout. Host memory: the pickle and one padded buffer on every rank, and the
        world's buffers on `dst`; checkpoints send one table at a time (checkpoint.gathered_state_dict).
        """
        return comm.gather_object(obj, dst, self._emb_pg, self._device)

    def all_gather_object(self, obj) -> list:
        """Collective: every rank's picklable `obj`, in rank order, on every rank (guarded: see gather_object)."""
        return self.gather_object(obj, dst=None)

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        """The model's state dict under its own names; sharded tables as ShardedTensor (global shape + pieces)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Full tensors or ShardedTensors from any world size; each rank reads the pieces it owns."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


@torch.no_grad()
def _materialise_meta_layers(module: nn.Module, device: torch.device) -> None:
    """Dense layers built on "meta" (TorchRec's `with torch.device("meta")`): made on `device` and drawn by their own
    reset_parameters(), as TorchRec's DistributedModelParallel does; DDP then gives every rank rank 0's values."""
    for path, m in module.named_modules():
        tensors = list(m._parameters.values()) + list(m._buffers.values())
        if not any(t is not None and t.is_meta for t in tensors):
            continue
        if not callable(getattr(m, "reset_parameters", None)):
            raise ValueError(f"'{path or '<root>'}' ({type(m).__name__}) has parameters on 'meta' and no "
                             f"reset_parameters() to draw them: give it one, or materialise it before "
                             f"DistributedModelParallel (model.{path or '<root>'}.to_empty(device=...) and initialise "
                             f"it)")
        m.to_empty(device=device, recurse=False)
        m.reset_parameters()


def _dense_children(module: nn.Module) -> list[nn.Module]:
    """The largest submodules with parameters and no sharded collection inside (FSDP2 units)."""
    out = []
    for child in module.children():
        if isinstance(child, _ShardedCollectionBase):
            continue
        holds_sharded = any(isinstance(m, _ShardedCollectionBase) for m in child.modules())
        if holds_sharded:
            out += _dense_children(child)
        elif any(True for _ in child.parameters()):
            out.append(child)
    if any(True for _ in module.parameters(recurse=False)):
        raise ValueError(f"{type(module).__name__} holds parameters next to an embedding collection: move them into "
                         f"a submodule so FSDP can shard them, or use dense='ddp'")
    return out

