"""The sharded collections: ShardedEmbeddingBagCollection and ShardedEmbeddingCollection.

Legend: B local batch, F features, S_p this rank's shard features, D dims, W world size.

    forward(features)                                   this rank's B samples, any key order
      input_dist   ids travel to the ranks that own their rows (input_dist.py); replicated
                   (data-parallel) features stay here
      lookup       this rank's shards in as few fused kernels as possible (GroupedLookup), and
                   the replicas (dense kernel, gradient summed over ranks then the fused rule)
      output_dist  embeddings travel back (output_dist.py) and land in the unsharded layout:
                   KeyedTensor [B, sum(D)] (bags) / {feature: JaggedTensor [N_f, D]} (sequence)

Each rank's output covers its own samples, exactly what the unsharded collection returns for them. The pure
routing lives in `sharding/`. The state dict has the unsharded collection's keys: a sharded table's entry is a
`ShardedTensor`, a replicated one's a plain tensor; `load_state_dict` takes either, from any world size and layout.
Shard-local names (`<table>@r<row>c<col>`, the table's own when whole) name each piece's kernel table."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_rec.batch_check import RAW_ID_ROWS, DeviceIdGuard
from lightning_rec.embedding import (
    EmbeddingBagCollection,
    EmbeddingCollection,
    FeatureRouter,
    collection_call,
    expand_by_inverse_indices,
    feature_table_names,
    refuse_dtype_cast,
    sequence_output,
)
from lightning_rec.input_dist import DistContext, FrozenTablesDisagree, KJTAllToAll
from lightning_rec.lookup import DenseKernel, GroupedLookup, join_outputs, plain_lookup
from lightning_rec.optim.config import FusedOptimizerConfig, check_fused_lr
from lightning_rec.output_dist import PooledAllToAll, SequenceAllToAll, VariableBatchPooledAllToAll, all_reduce_sum_
from lightning_rec.sharding import data_parallel
from lightning_rec.sharding.embeddings import (
    OutputColumns,
    assemble_pooled,
    assemble_sequence,
    divide_means,
    inverse_permutation,
    pad_rows,
)
from lightning_rec.sharding.ids import RouteTables
from lightning_rec.sharding.routing import Routing, build_routing
from lightning_rec.sharding.sharded_tensor import ShardedTensor
from lightning_rec.sharding.variable_batch import VariableLayout, assemble_variable, rank_blocks
from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from lightning_rec.sparse.variable_batch import is_variable_batch, padded_batch, strides_of
from lightning_rec.table_weight import FusedTableWeight, _Tables
from lightning_rec.types import SEQUENCE_SHARDING_TYPES, ShardingType

torch.fx.wrap("collection_call")  # a sharded collection is one node of a torch.fx trace too (embedding.py)


@dataclass
class ShardingEnv:
    """Where a sharded module runs: its process group (embedding traffic only), rank, device."""

    pg: object
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float | None = None
    transport: object | None = None  # SharedMemoryGroup when every rank shares this host's memory (CPU)
    step: int = 0  # DistributedModelParallel's step (its forward calls): every embedding exchange of a step carries it

    @property
    def comm(self):
        """What the embedding collectives go through: the shared-memory transport, else the process group."""
        return self.transport if self.transport is not None else self.pg

    def __reduce_ex__(self, protocol):
        # deepcopy / pickle of a sharded model: torch's own error names only the ProcessGroup
        if self.pg is None:
            return super().__reduce_ex__(protocol)
        raise TypeError(
            "a sharded model (DistributedModelParallel, or a LightningModule under Trainer(strategy='rec')) cannot be "
            "deep-copied or pickled: its embedding collections are tied to this run's process group. Save it with "
            "dmp.state_dict() / lightning_rec.checkpoint.save; for EMA / weight averaging, average the dense layers "
            "(torch.optim.swa_utils.AveragedModel(dmp.module.<dense layers>)) or copy the model before sharding it")


@dataclass
class ShardedBatch:
    routed: KeyedJaggedTensor | None  # this rank's shard features over every rank's samples
    replicated: KeyedJaggedTensor | None  # data-parallel features of this rank's samples
    ctx: DistContext
    features: KeyedJaggedTensor  # this rank's input in feature order (sequence outputs need its lengths)
    inverse: tuple[list[str], Tensor] | None = None  # TorchRec's inverse_indices: the output is expanded by them


@dataclass
class ShardedLookupOut:
    owned: Tensor  # pooled [B_0+...+B_{W-1}, D_p] or rows [N_local, Dmax] (source-major)
    replicated: list[Tensor]  # per replica kernel group
    batch: ShardedBatch


class ReplicaKernel:
    """A data-parallel group of tables: dense weights, gradient summed over ranks, fused rule in backward. Quacks
    like lookup.FusedKernel for FusedOptimizer. Each call looks up through leaves of its own that view the weights,
    so its backward applies the rule once per call, as a fused kernel's does."""

    def __init__(self, kernel: DenseKernel, optimizer: FusedOptimizerConfig, env: ShardingEnv) -> None:
        self.kernel = kernel
        self.tables = kernel.tables
        self.optimizer_config = optimizer
        self._lr = optimizer.lr
        self._env = env
        for t in self.tables:
            data_parallel.check_replica_optimizer(optimizer, t.name)
        self._states = [data_parallel.new_state(optimizer, w.detach()) for w in kernel.weights]
        # gradient accumulation (optim.gather_fused_gradients): table -> (summed local gradient, rows named or None)
        self.gathering = False
        self._gathered: dict[int, tuple[Tensor, Tensor | None]] = {}

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        """This call's lookup: pooled_BD (bags) or values_ND (sequence); its backward updates the rows it named."""
        # an FP16 replica is looked up through a float32 copy, as the fused kernels give and take rows
        leaves = [(w.detach() if w.dtype == torch.float32 else w.detach().float()).requires_grad_(
            w.requires_grad and torch.is_grad_enabled()) for w in self.kernel.weights]
        if any(leaf.requires_grad for leaf in leaves):
            # with weight_decay every row the call names is stepped (decayed), as in the fused kernels
            named = self._named_rows(features) if self.optimizer_config.weight_decay else [None] * len(leaves)
            for t, (leaf, named_R) in enumerate(zip(leaves, named)):
                if leaf.requires_grad:
                    leaf.register_post_accumulate_grad_hook(self._hook(t, named_R, self.gathering))
        return plain_lookup(features, leaves, self.kernel.feature_table, self.kernel.pooling)

    def _named_rows(self, features: KeyedJaggedTensor) -> list[Tensor]:
        """Per table [rows]: 1 where this rank's call names the row."""
        named = [torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) for w in self.kernel.weights]
        for t, jt in zip(self.kernel.feature_table, features.to_dict().values()):
            named[t].index_fill_(0, jt.values(), 1.0)
        return named

    def _hook(self, t: int, named_R: Tensor | None, gather: bool):
        def update(leaf: Tensor) -> None:
            grad, named = leaf.grad, named_R
            leaf.grad = None
            held = self._gathered.pop(t, None)
            if held is not None:  # the local gradients gathered so far: summed before the one all-reduce
                grad = held[0] + grad
                named = None if named is None else torch.maximum(held[1], named)
            if gather:
                self._gathered[t] = (grad, named)
            else:
                self._update(t, grad, named)

        return update

    def _update(self, t: int, grad: Tensor, named_R: Tensor | None) -> None:
        named = None
        if named_R is None:
            all_reduce_sum_(self._env.comm, grad, self._env.timeout_s)
        else:  # the rows any rank named travel with the gradient: one collective
            both = torch.cat([grad, named_R.to(grad.dtype).unsqueeze(1)], dim=1)
            all_reduce_sum_(self._env.comm, both, self._env.timeout_s)
            grad, named = both[:, :-1], both[:, -1]
        # .data: the other calls' leaves view these weights, and their backward may still come
        data_parallel.apply_update(self.kernel.weights[t].data, grad, self._states[t], self.optimizer_config,
                                   self._lr, named)

    def apply_gathered(self) -> None:
        """The one update of the gathered gradients (a collective: every rank gathered the same micro-batches)."""
        held, self._gathered = self._gathered, {}
        for t, (grad, named) in sorted(held.items()):
            self._update(t, grad, named)

    def gathered_bytes(self) -> int:
        """A replicated table gathers its whole gradient (its backward makes one per call anyway)."""
        return sum(g.numel() * g.element_size() for g, _ in self._gathered.values())

    def split_embedding_weights(self) -> list[Tensor]:
        return list(self.kernel.weights)

    def optimizer_states(self) -> list[dict[str, Tensor]]:
        return self._states

    def set_learning_rate(self, lr: float) -> None:
        # checked as the fused kernels' rate is: a NaN from a scheduler would write NaN into the replicated tables
        self._lr = check_fused_lr(lr, [t.name for t in self.tables])

    def get_learning_rate(self) -> float:
        return self._lr


class _Tie(torch.autograd.Function):
    """`out` as it is; `t` gets a zero gradient when `out` gets one (puts `t`'s backward in the graph)."""

    @staticmethod
    def forward(ctx, out: Tensor, t: Tensor) -> Tensor:
        ctx.shape, ctx.dtype = t.shape, t.dtype
        return out.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, grad.new_zeros(ctx.shape, dtype=ctx.dtype)


def _tie(out: Tensor, t: Tensor) -> Tensor:
    return _Tie.apply(out, t)


class ShardedTableWeight(FusedTableWeight):
    """A sharded table's parameter: empty (shape (0,): nothing moves the table through it), yet `numel()` is the whole
    table's, as ModelSummary counts the unsharded model."""

    def numel(self) -> int:  # type: ignore[override]
        return self.__dict__.get("table_numel", 0)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # values viewed into this empty parameter: vector_to_parameters stepping by numel()
        if func is Tensor.view_as and len(args) == 2 and args[1] is not args[0] and isinstance(args[1], cls) and \
                args[0].numel() != 0:
            raise ValueError(
                f"{args[0].numel()} values viewed as a sharded table's parameter, which holds none (shape (0,); its "
                f"values are the ranks' shards) though numel() counts the whole table ({args[1].numel()}, for "
                f"ModelSummary). torch.nn.utils.vector_to_parameters over a sharded model steps by numel(): pass the "
                f"dense parameters only, to it and to parameters_to_vector: [p for p in model.parameters() if "
                f"p.requires_grad] (tables read requires_grad=False); tables load with dmp.load_state_dict(...)")
        return nn.Parameter.__torch_function__(func, types, args, kwargs or {})  # torch's: subclass off in results

    def __deepcopy__(self, memo):
        copied = super().__deepcopy__(memo)
        copied.__dict__["table_numel"] = self.numel()
        return copied


class _FreezeSwitch(nn.Module):
    """A sharded table's entry among the module's parameters: an empty ShardedTableWeight that freezing reaches."""

    def __init__(self, frozen: bool, table_numel: int, device: torch.device) -> None:
        super().__init__()
        # on the module's device: DDP refuses parameters on two device types, empty ones included
        self.weight = ShardedTableWeight(torch.empty(0, device=device), requires_grad=False)
        self.weight.__dict__["table_numel"] = table_numel
        self.weight.frozen = frozen

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        pass

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        pass


def _configs(module) -> list:
    if isinstance(module, EmbeddingBagCollection):
        return module.embedding_bag_configs()
    return module.embedding_configs()


class _ShardedCollectionBase(nn.Module):
    _weights_attr = "embedding_bags"
    _pooled = True

    def __init__(self, module: EmbeddingBagCollection | EmbeddingCollection, table_plans, env: ShardingEnv) -> None:
        super().__init__()
        optimizer = module.fused_optimizer_config()
        if optimizer is None:
            raise ValueError(
                f"{type(module).__name__} has no fused optimizer: DistributedModelParallel shards fused tables; "
                f"build it with optimizer=FusedOptimizerConfig(...), or (TorchRec's way) call "
                f"apply_optimizer_in_backward(torch.optim.SGD, collection.parameters(), {{'lr': 0.01}}) before "
                f"DistributedModelParallel"
            )
        self._configs = list(_configs(module))
        self._feature_names = module.feature_names()
        self._optimizer = optimizer
        self._is_weighted = module.is_weighted()
        self.validate_ids = module.validate_ids
        self._env = env
        # a feature several tables read is one input key, routed as `feature@table` per table (the outputs' names)
        routed, self._sources = feature_table_names(self._configs)
        self.routing: Routing = build_routing(routed, self._feature_names, table_plans, env.world_size, self._pooled)
        rank, device = env.rank, env.device
        kernel = getattr(module, "_kernel", "auto")
        mine = self.routing.rank_tables[rank]
        # kernels are kept out of the module tree: DDP / FSDP never see the shards or replicas
        object.__setattr__(self, "_lookup", GroupedLookup(mine, optimizer, device, kernel) if mine else None)
        replicas = GroupedLookup(self.routing.dp_tables, None, device, "dense") if self.routing.dp_tables else None
        object.__setattr__(self, "_replicas", replicas)
        self._replica_kernels = [ReplicaKernel(k, optimizer, env) for k in replicas.kernels] if replicas else []
        self._copy_weights(module.lookup.table_weights())
        # one empty parameter per table, for freezing and the fused optimizer's param groups
        frozen = module.frozen_tables() if hasattr(module, "frozen_tables") else frozenset()
        switches = _Tables()
        for c in self._configs:
            switches[c.name] = _FreezeSwitch(c.name in frozen, c.num_embeddings * c.embedding_dim, device)
        setattr(self, self._weights_attr, switches)
        self._set_frozen(frozen)

        self._routed_configs = routed
        self._build_router(frozenset())
        self._dp_features = self.routing.dp_feature_index
        self._dp_features_t = torch.tensor(self._dp_features, dtype=torch.int32, device=device)
        self._routed = self.routing.num_routed > 0
        self._ids_a2a = KJTAllToAll(RouteTables(self.routing, device), env.comm, rank, device, env.timeout_s)

    def _build_router(self, raw_tables: frozenset[str]) -> None:
        """The batch check and feature order; ids of `raw_tables` are raw (any non-negative int64 below 2**63-1)."""
        by_feature = {f: c for c in self._routed_configs for f in c.feature_names}
        rows = [RAW_ID_ROWS if by_feature[f].name in raw_tables else by_feature[f].num_embeddings
                for f in self._feature_names]
        self._router = FeatureRouter(
            self._feature_names, torch.tensor(rows), [by_feature[f].name for f in self._feature_names],
            self._is_weighted, f"sharded {self._kind()}", sources=[self._sources[f] for f in self._feature_names])
        # GPU batches never on the host: ids checked on the device before routing, reported lazily (batch_check.py)
        self._device_guard = DeviceIdGuard(self._router.rows_F, self._router.tables_F, self._feature_names,
                                           f"sharded {self._kind()}", self._env.device) \
            if self._env.device.type == "cuda" else None

    # managed collision: raw ids remapped by the rank that owns their rows, after the id all-to-all
    _owner_remap = None

    def remap_on_owners(self, tables: frozenset[str], remap) -> None:
        """Ids of `tables` travel raw, routed by value (sharding/ids.py), and `remap(routed KJT) -> KJT` turns them
        into this rank's rows before its lookup (sharded_managed_collision.py)."""
        self._build_router(tables)
        self._ids_a2a.tables.route_raw_ids(set(tables))
        self._owner_remap = remap

    # the data path ------------------------------------------------------------------------------

    # pipeline/feeder.py sets it while a pipeline runs: a batch it routed ahead comes back from it
    _input_source = None
    # and this one: an output a semi-synchronous pipeline computed ahead (before the last batch's update) comes back
    _output_source = None

    def _ahead(self, features: KeyedJaggedTensor):
        source = self._output_source
        return None if source is None else source(self, features)

    def input_dist(self, features: KeyedJaggedTensor) -> ShardedBatch:
        source = self._input_source
        if source is not None:
            ready = source(self, features)
            if ready is not None:
                return ready
        return self.route(features, self._ids_a2a)

    def route(self, features: KeyedJaggedTensor, ids_a2a: KJTAllToAll, ahead: bool = False,
              step: int = 0) -> ShardedBatch:
        """input_dist through `ids_a2a` (the pipeline's own channel); `ahead`: the feeder routes it outside autograd,
        its exchange carrying `step` (the pipeline's) instead of DistributedModelParallel's."""
        inverse = features.inverse_indices_or_none() if isinstance(features, KeyedJaggedTensor) else None
        strides, error = None, None
        if inverse is not None or is_variable_batch(features):
            features, strides, error = self._variable_batch(features)
        ordered, error = self._validate(features) if error is None else (None, error)
        self.frozen_tables()  # brings _frozen_key and _frozen_error up to date
        if error is None:
            error = self._frozen_error  # raised on every rank in the exchange below, not on this rank alone
        if ahead and error is None and self._is_weighted and features.weights_or_none() is not None \
                and features.weights().requires_grad:
            # routed outside autograd their gradient would be lost: an error every rank raises after the exchange
            error = (f"the batch's KeyedJaggedTensor for sharded {self._kind()} (features {self._feature_names}) "
                     f"has per-id weights that require a gradient (learned weights), but the pipeline routes "
                     f"batches ahead of their step, outside autograd, so those weights would not train: compute "
                     f"learned weights inside the model's forward (that collection then routes in the step, and "
                     f"they train), or pass weights.detach() in the batch")
        try:  # all ranks agree first (on their batches and on which tables are frozen)
            routed, ctx = ids_a2a(ordered, error, weighted=self._is_weighted, frozen_key=self._frozen_key,
                                  strides_F=strides, step=step if ahead else self._env.step)
        except FrozenTablesDisagree as e:
            raise ValueError(self._frozen_disagree_message(e.keys)) from None
        replicated = None
        if self._dp_features:
            replicated = ordered.permute(self._dp_features, self._dp_features_t)
        ctx.lengths_FB = ordered.lengths_FB()
        return ShardedBatch(routed, replicated, ctx, ordered, inverse)

    def _variable_batch(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor | None, list[int] | None,
                                                                    str | None]:
        """A batch with inverse_indices (TorchRec's VBE when keys have their own bag counts) -> (the batch padded to
        one stride, its bags per feature in collection order or None when uniform, the error every rank raises)."""
        if not self._pooled:
            return None, None, (f"sharded {self._kind()}: the input has inverse_indices or per-key batch sizes "
                                f"(TorchRec's VBE), which expand pooled outputs only: give a sequence collection every "
                                f"sample's bags (build the KJT without inverse_indices), as TorchRec's takes")
        if not is_variable_batch(features):
            return features, None, None
        try:
            strides = strides_of(features, self._feature_names) if all(
                f in features.keys() for f in self._feature_names) else None
            return padded_batch(features, f"sharded {self._kind()}", contents=not self.validate_ids), strides, None
        except ValueError as e:
            return None, None, str(e)

    @property
    def env(self) -> ShardingEnv:
        return self._env

    def ids_all_to_all(self, comm) -> KJTAllToAll:
        """This collection's id all-to-all over another channel `comm` (a process group or SharedMemoryGroup)."""
        return KJTAllToAll(self._ids_a2a.tables, comm, self._env.rank, self._env.device, self._env.timeout_s,
                           backward_pg=self._env.comm)

    # freezing (fine-tuning) ------------------------------------------------------------------------

    def requires_grad_(self, requires_grad: bool = True) -> _ShardedCollectionBase:
        """False freezes every table (no fused update, optimizer state kept); True resumes. Call it on every rank."""
        super().requires_grad_(requires_grad)  # the freeze parameters
        self._set_frozen(frozenset() if requires_grad else frozenset(c.name for c in self._configs))
        return self

    def frozen_tables(self) -> frozenset[str]:
        """Tables that do no update (set to requires_grad=False)."""
        switches = self._modules[self._weights_attr]
        # set through the parameters (BaseFinetuning, LightningModule.freeze / unfreeze): read when any flag moved
        if self.__dict__.get("_switches_seen") != FusedTableWeight.freeze_changes:
            self.__dict__["_switches_seen"] = FusedTableWeight.freeze_changes
            frozen = frozenset(name for name in switches if switches[name].weight.frozen)
            if frozen != self._frozen:
                self._set_frozen(frozen)
        return self._frozen

    def _set_frozen(self, frozen: frozenset[str]) -> None:
        self._frozen = frozenset(frozen)
        # what the id all-to-all's counts carry so that every rank checks that all froze the same tables
        digest = hashlib.blake2b("\0".join(sorted(frozen)).encode(), digest_size=6).digest()
        self._frozen_key = (int.from_bytes(digest, "little") | 1) if frozen else 0
        # the kernels know their pieces by shard-local names; every rank skips the same updates
        self._frozen_local = frozenset(t.name for t in (self._lookup.tables if self._lookup is not None else [])
                                       if self.shard_of(t.name)[0] in self._frozen)
        self._frozen_error = self._frozen_split()
        if self._replicas is not None:
            # replicas train by autograd: a frozen one gets no gradient, no hook, no all-reduce, on every rank
            for t, w in zip(self._replicas.tables, self._replicas.table_weights().values()):
                w.requires_grad_(t.name not in self._frozen)

    def _frozen_split(self) -> str | None:
        """Why this rank cannot freeze these tables (a kernel holds frozen and unfrozen pieces): every rank raises."""
        for kernel in self._lookup.fused_kernels() if self._lookup is not None and self._frozen_local else []:
            pieces = [t.name for t in kernel.tables]
            held = [n for n in pieces if n in self._frozen_local]
            if held and len(held) != len(pieces):
                frozen = sorted({self.shard_of(n)[0] for n in held})
                other = sorted({self.shard_of(n)[0] for n in pieces if n not in held})
                return (f"sharded {self._kind()}: tables {frozen} are frozen (requires_grad=False) but on rank "
                        f"{self._env.rank} their pieces share one fused kernel with pieces of {other}, which are not: "
                        f"freeze all of {frozen + other} together, or put the tables to freeze in an "
                        f"EmbeddingBagCollection / EmbeddingCollection of their own")
        return None

    def _frozen_disagree_message(self, keys: list[int]) -> str:
        groups: dict[int, list[int]] = {}
        for r, k in enumerate(keys):
            groups.setdefault(k, []).append(r)
        mine = sorted(self._frozen)
        return (f"the ranks froze different tables of sharded {self._kind()} (features {self._feature_names}): "
                f"the ranks that agree are {sorted(groups.values())}, and this rank ({self._env.rank}) has "
                f"{mine if mine else 'no table'} frozen. One rank alone skipping a table's update would leave "
                f"its pieces behind the others' (or the others waiting in a replica's gradient all-reduce): freeze "
                f"and unfreeze on every rank alike (requires_grad_, LightningModule.freeze() / unfreeze(), "
                f"BaseFinetuning in code that every rank runs, not under `if rank == 0`)")

    def lookup(self, batch: ShardedBatch) -> ShardedLookupOut:
        # The routed ids come from batches every rank checked in input_dist (unless validate_ids=False).
        self.frozen_tables()  # brings _frozen_local up to date
        routed = batch.routed
        if self._owner_remap is not None and routed is not None:
            routed = self._owner_remap(routed)  # raw ids -> this rank's rows (profiled first in training)
        owned = (self._lookup(routed, checked=self.validate_ids, frozen=self._frozen_local)
                 if self._lookup is not None else [])
        if batch.ctx.weights_grad and self._lookup is None:
            # no shard here reads the learned weights: tie them to the output, so this rank joins the backward
            owned = [_tie(self._join_owned(owned, batch), batch.routed.weights())]
        replicated = self._replica_lookup(batch.replicated) if self._replicas is not None else []
        return ShardedLookupOut(self._join_owned(owned, batch), replicated, batch)

    def _replica_lookup(self, features: KeyedJaggedTensor) -> list[Tensor]:
        """One output per replica group, as GroupedLookup's; each group's backward applies its fused rule."""
        assert features.keys() == self._replicas.feature_names, (features.keys(), self._replicas.feature_names)
        parts = features.split(self._replicas._group_sizes) if len(self._replica_kernels) > 1 else [features]
        return [k.forward(part) for k, part in zip(self._replica_kernels, parts)]

    # validation: every rank checks its own batch, input_dist makes them agree ------------------------

    def _validate(self, features: KeyedJaggedTensor) -> tuple[KeyedJaggedTensor | None, str | None]:
        try:
            return self._route(features), None
        except ValueError as e:
            return None, str(e)

    def _route(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        ordered = self._router(features, self.validate_ids)
        if self.validate_ids and self._device_guard is not None and features.host_copy() is None:
            ordered = self._device_guard(ordered)  # on the device, no sync: bad ids read row 0, counted, reported
        return ordered

    def _kind(self) -> str:
        return "EmbeddingBagCollection" if self._pooled else "EmbeddingCollection"

    def _apply(self, fn, recurse: bool = True):
        # a dtype cast would convert the dense layers but not the tables (their kernels keep their data_type)
        refuse_dtype_cast(f"sharded {self._kind()}", fn)
        return super()._apply(fn, recurse)

    # what the collections share with the unsharded ones ---------------------------------------------

    def feature_names(self) -> list[str]:
        return list(self._feature_names)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def fused_optimizer_config(self) -> FusedOptimizerConfig:
        return self._optimizer

    def cached_tables(self) -> list[str]:
        """The tables the plan puts in fused_uvm_caching (on any rank: the same list on every rank)."""
        pieces = self.routing.pieces
        return sorted({pieces.get((r, t.name), (t.name,))[0] for r, ts in enumerate(self.routing.rank_tables)
                       for t in ts if t.compute_kernel == "fused_uvm_caching"})

    def use_prefetch_pipeline(self) -> None:
        """This rank's kernels with fused_uvm_caching shards in prefetch mode (PipelineConfig(prefetch=True))."""
        for kernel in self._lookup.fused_kernels() if self._lookup is not None and self._owner_remap is None else []:
            if kernel.caching:
                kernel.use_prefetch_pipeline()

    def prefetch(self, batch: ShardedBatch, forward_stream=None) -> None:
        """The pipeline's prefetch stage: `batch`'s rows of this rank's fused_uvm_caching shards into their caches
        ahead of its lookup. Not where ids are remapped on their owners (managed collision): those lookups fill their
        caches themselves."""
        if self._lookup is not None and self._owner_remap is None and batch.routed is not None:
            self._lookup.prefetch(batch.routed, forward_stream)

    def fused_kernels(self) -> list:
        """This rank's fused kernels and replica groups (for FusedOptimizer); names are shard-local."""
        own = self._lookup.fused_kernels() if self._lookup is not None else []
        return own + self._replica_kernels

    def table_parameters(self) -> dict[str, nn.Parameter]:
        """table name -> its empty parameter, which carries the table's freeze and stands for it in param groups."""
        switches = self._modules[self._weights_attr]
        return {name: switches[name].weight for name in switches}

    def table_weights(self) -> dict[str, Tensor]:
        """Shard-local table name -> [rows, cols] view of this rank's piece (replicas: the whole table)."""
        out = dict(self._lookup.table_weights()) if self._lookup is not None else {}
        if self._replicas is not None:
            out.update(self._replicas.table_weights())
        return out

    def replica_weights(self) -> dict[str, Tensor]:
        """Data-parallel table name -> this rank's whole copy (the same on every rank)."""
        return dict(self._replicas.table_weights()) if self._replicas is not None else {}

    def shard_of(self, local_name: str) -> tuple[str, object, tuple[int, int]]:
        """A shard-local table name -> (global table, ShardMetadata or None for a replica, global shape)."""
        piece = self.routing.pieces.get((self._env.rank, local_name))
        if piece is None:  # a data-parallel replica: the whole table under its own name
            return local_name, None, self._global_shape(local_name)
        table, meta = piece
        return table, meta, self._global_shape(table)

    def local_shards(self) -> dict[str, list[tuple]]:
        """table -> [(ShardMetadata, [rows, cols] view), ...] for the pieces on this rank."""
        weights = self.table_weights()
        out: dict[str, list[tuple]] = {}
        for local in self.routing.rank_tables[self._env.rank]:
            table, meta = self.routing.pieces[(self._env.rank, local.name)]
            out.setdefault(table, []).append((meta, weights[local.name]))
        return out

    def _pieces(self) -> list[tuple[str, object, Tensor]]:
        """(table, ShardMetadata or None for a replica, weight view) for everything this rank holds."""
        out = []
        for table, shards in self.local_shards().items():
            out += [(table, meta, w) for meta, w in shards]
        if self._replicas is not None:
            out += [(t.name, None, w) for t, w in zip(self._replicas.tables,
                                                       self._replicas.table_weights().values())]
        return out

    @torch.no_grad()
    def _copy_weights(self, full: dict[str, Tensor]) -> None:
        if any(w.is_meta for w in full.values()):
            return  # a collection built on device="meta": the shards keep their own initialisation
        for table, meta, w in self._pieces():
            if meta is None:
                w.copy_(full[table])
            else:
                (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
                w.copy_(full[table][r : r + nr, c : c + nc])

    # state dict ------------------------------------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        shapes = {c.name: (c.num_embeddings, c.embedding_dim) for c in self._configs}
        pieces: dict[str, list] = {}
        for table, meta, w in self._pieces():
            value = w if keep_vars else w.detach()
            if meta is None:
                destination[f"{prefix}{self._weights_attr}.{table}.weight"] = value
            else:
                pieces.setdefault(table, []).append((meta, value))
        for c in self._configs:
            # every sharded table has an entry on every rank, holding none of its pieces when elsewhere
            if self.routing.table_shardings[c.name].sharding_type != ShardingType.DATA_PARALLEL:
                destination[f"{prefix}{self._weights_attr}.{c.name}.weight"] = ShardedTensor(
                    shapes[c.name], pieces.get(c.name, []), list(self.routing.table_shardings[c.name].shards))

    @torch.no_grad()
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        head = f"{prefix}{self._weights_attr}."
        known = {f"{head}{c.name}.weight" for c in self._configs}
        for key in state_dict:
            if key.startswith(head) and key not in known:
                unexpected_keys.append(key)
        for table, meta, w in self._pieces():
            key = f"{head}{table}.weight"
            if key not in state_dict:
                if key not in missing_keys:
                    missing_keys.append(key)
                continue
            value = state_dict[key]
            (r, c), (nr, nc) = (meta.shard_offsets, meta.shard_sizes) if meta is not None else ((0, 0), w.shape)
            try:
                # a ShardedTensor of a larger table covers this one's rectangles too: the shapes must match
                if tuple(value.shape) != tuple(self._global_shape(table)):
                    raise ValueError(f"'{key}' has shape {tuple(value.shape)} in the checkpoint but the table is "
                                     f"{tuple(self._global_shape(table))}: the table sizes differ; build the table "
                                     f"with the checkpoint's num_embeddings and embedding_dim to load it")
                if isinstance(value, ShardedTensor):
                    piece = value.read(r, c, nr, nc, what=f"table '{table}'")
                else:
                    piece = value[r : r + nr, c : c + nc]
                w.copy_(piece)
            except ValueError as e:
                error_msgs.append(str(e))
        self.weights_written()

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Draw every piece this rank holds from its own generator, seeded by (seed, table, piece offsets). For
        collections built on "meta": with one `seed` on every rank (rank 0's), a replica is the same everywhere, and
        no two tables or row blocks start as copies of each other."""
        init = {c.name: c.local_table().init_range() for c in self._configs}
        init_fns = {c.name: c.init_fn for c in self._configs}
        for table, meta, w in self._pieces():
            (r, c) = meta.shard_offsets if meta is not None else (0, 0)
            digest = hashlib.sha256(f"{seed}:{table}:{r}:{c}".encode()).digest()
            piece_seed = int.from_bytes(digest[:8], "little") & (2**63 - 1)
            if init_fns[table] is not None:
                # the config's init_fn on this piece, under the piece's own seed (replicas agree across ranks)
                with torch.random.fork_rng(devices=[w.device] if w.device.type == "cuda" else []):
                    torch.manual_seed(piece_seed)
                    init_fns[table](w)
                continue
            g = torch.Generator().manual_seed(piece_seed)
            rows_per_chunk = max(1, (1 << 22) // max(1, w.shape[1]))  # a bounded host buffer for huge tables
            for r0 in range(0, w.shape[0], rows_per_chunk):
                chunk = torch.empty(min(rows_per_chunk, w.shape[0] - r0), w.shape[1], dtype=torch.float32)
                w[r0 : r0 + chunk.shape[0]].copy_(chunk.uniform_(*init[table], generator=g))
        self.weights_written()

    def weights_written(self) -> None:
        """The table views were written in place (load_state_dict, a DCP load): row caches start empty."""
        if self._lookup is not None:
            self._lookup.weights_written()

    def _global_shape(self, table: str) -> tuple[int, int]:
        c = next(c for c in self._configs if c.name == table)
        return (c.num_embeddings, c.embedding_dim)

    def _join_owned(self, owned: Sequence[Tensor], batch: ShardedBatch) -> Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        lines = [f"rank {self._env.rank}/{self._env.world_size}"]
        for name, ps in self.routing.table_shardings.items():
            lines.append(f"{name}: {ps}")
        return "\n".join(lines)


class ShardedEmbeddingBagCollection(_ShardedCollectionBase):
    """EmbeddingBagCollection with its tables spread over ranks: KJT -> KeyedTensor [B, sum(D)]."""

    _weights_attr = "embedding_bags"
    _pooled = True

    def __init__(self, module: EmbeddingBagCollection, table_plans, env: ShardingEnv) -> None:
        super().__init__(module, table_plans, env)
        self._dims = [c for c in self.routing.feature_dims]
        self._columns = OutputColumns(self.routing, env.device)
        self._pooled_a2a = PooledAllToAll(env.comm, env.rank, self.routing.rank_dims, env.timeout_s)
        self._variable_a2a = VariableBatchPooledAllToAll(env.comm, env.rank, rank_blocks(self.routing), env.timeout_s)
        self._variable_layout = VariableLayout(self.routing)

    def embedding_bag_configs(self):
        return list(self._configs)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        ahead = self._ahead(features)
        return collection_call(self, features) if ahead is None else ahead  # one node in a torch.fx trace

    def _forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        batch = self.input_dist(features)  # ids travel to the ranks that own their rows
        pooled = self.lookup(batch)  # this rank's shards (fused kernels) and replicas
        return self.output_dist(pooled)  # pooled embeddings travel back: [B, sum(D)], this rank's samples

    def _join_owned(self, owned: Sequence[Tensor], batch: ShardedBatch) -> Tensor:
        if not owned:
            return torch.zeros(sum(batch.ctx.batch_per_source), 0, device=self._env.device)
        return join_outputs(owned, dim=1)

    def output_dist(self, out: ShardedLookupOut) -> KeyedTensor:
        ctx = out.batch.ctx
        dp_BD = None
        if out.replicated:
            dp_BD = join_outputs(out.replicated, dim=1)
        if ctx.strides_per_source is not None and self._env.world_size > 1:
            return self._variable_output(out, dp_BD)
        placed_BD = self._pooled_a2a.placed(out.owned, dp_BD, ctx, self._columns)
        if placed_BD is not None:  # shared memory: columns land in place as they arrive
            pooled_BD = divide_means(placed_BD, self._columns, ctx.lengths_FB)
        else:
            received = self._pooled_a2a(out.owned, ctx)
            pooled_BD = assemble_pooled(received, ctx.batch, dp_BD, self._columns, ctx.lengths_FB)
        if out.batch.inverse is not None:  # each sample's rows of the full batch
            keys = [self._sources[f] for f in self._feature_names]  # a shared feature's outputs read its one key
            pooled_BD = expand_by_inverse_indices(pooled_BD, keys, self._dims, out.batch.inverse)
        return KeyedTensor._of_collection(self._feature_names, self._dims, pooled_BD)

    def _variable_output(self, out: ShardedLookupOut, dp_BD: Tensor | None) -> KeyedTensor:
        """Some rank's batch is a variable one: each feature's own rows come back and land expanded to the full
        batch (sharding/variable_batch.py)."""
        ctx, inverse = out.batch.ctx, out.batch.inverse
        received = self._variable_a2a(out.owned, ctx)
        if inverse is None:  # this rank's batch is an ordinary one: each sample reads its own bag
            rows_F = [torch.arange(ctx.batch, device=received.device)] * len(self._feature_names)
        else:
            at = {k: i for i, k in enumerate(inverse[0])}
            rows_F = [inverse[1][at[self._sources[f]]].to(received.device).long() for f in self._feature_names]
        pooled_BD = assemble_variable(received, dp_BD, self._variable_layout, ctx.strides_F, ctx.lengths_FB, rows_F)
        return KeyedTensor._of_collection(self._feature_names, self._dims, pooled_BD)


class ShardedEmbeddingCollection(_ShardedCollectionBase):
    """EmbeddingCollection with its tables spread over ranks: KJT -> {feature: JaggedTensor [N_f, D]}."""

    _weights_attr = "embeddings"
    _pooled = False

    def __init__(self, module: EmbeddingCollection, table_plans, env: ShardingEnv) -> None:
        super().__init__(module, table_plans, env)
        self._width = self.routing.max_dim()
        self._rows_a2a = SequenceAllToAll(env.comm, env.rank, env.timeout_s)
        self._routed_features = sorted(set(self.routing.copy_feature_index))
        self._need_indices = module.need_indices()

    def embedding_configs(self):
        return list(self._configs)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        ahead = self._ahead(features)
        return collection_call(self, features) if ahead is None else ahead  # one node in a torch.fx trace

    def _forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        batch = self.input_dist(features)  # ids travel to the ranks that own their rows
        rows = self.lookup(batch)  # one row per id: this rank's shards and replicas
        return self.output_dist(rows)  # rows travel back, in each feature's id order

    def _join_owned(self, owned: Sequence[Tensor], batch: ShardedBatch) -> Tensor:
        if not owned:
            return torch.zeros(0, self._width, device=self._env.device)
        rows_ND = pad_rows(owned, self._width)  # key-major
        pos_N = batch.ctx.positions_N
        return rows_ND.index_select(0, inverse_permutation(pos_N)) if pos_N.numel() else rows_ND

    def output_dist(self, out: ShardedLookupOut) -> dict[str, JaggedTensor]:
        ctx = out.batch.ctx
        features = out.batch.features
        rows: dict[int, Tensor] = {}
        if self._routed:
            received = self._rows_a2a(out.owned, ctx)
            copies = ctx.routed.copies
            routed_rows = assemble_sequence(received, ctx.routed.order_N, self.routing, copies.length_per_key())
            rows.update(zip(self._routed_features, routed_rows))
        if out.replicated:
            dp_rows = out.replicated[0] if len(out.replicated) == 1 else None
            parts = [dp_rows] if dp_rows is not None else out.replicated
            lpk = out.batch.replicated.length_per_key()
            sizes = [len(g) for g in self._replica_group_features()]
            k = 0
            for group_rows, n in zip(parts, sizes):
                for f, r in zip(self._dp_features[k : k + n], torch.split(group_rows, lpk[k : k + n])):
                    rows[f] = r
                k += n
        ids = features.to_dict() if self._need_indices else None  # this rank's ids, each feature's in its order
        return {name: sequence_output(rows[i], features.lengths_FB()[i], None if ids is None else ids[name].values())
                for i, name in enumerate(self._feature_names)}

    def need_indices(self) -> bool:
        return self._need_indices

    def _replica_group_features(self) -> list[list[str]]:
        return [[f for t in g for f in t.feature_names] for g in self._replicas.groups]


def shard_collection(module, table_plans, env: ShardingEnv) -> _ShardedCollectionBase:
    if isinstance(module, EmbeddingBagCollection):
        return ShardedEmbeddingBagCollection(module, table_plans, env)
    if isinstance(module, EmbeddingCollection):
        for name, ps in table_plans.items():
            if ps.sharding_type not in SEQUENCE_SHARDING_TYPES:
                raise ValueError(
                    f"table '{name}' of an EmbeddingCollection is planned {ps.sharding_type}: sequence tables take "
                    f"{', '.join(str(t) for t in SEQUENCE_SHARDING_TYPES)}"
                )
        return ShardedEmbeddingCollection(module, table_plans, env)
    raise AssertionError(type(module))
