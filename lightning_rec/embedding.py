"""Embedding configs and the unsharded collections: EmbeddingBagCollection, EmbeddingCollection.

Shapes: B batch, F features, N ids, D dims.

    KJT (features, any key order) --permute--> lookup kernels --> KeyedTensor [B, sum(D)]   (bags)
                                                              --> {feature: JaggedTensor [N_f, D]} (sequence)

With `optimizer=FusedOptimizerConfig(...)` the tables live in fused kernels that update rows inside backward;
with `optimizer=None` each is an ordinary parameter. Either way the state dict holds one `[rows, dim]` weight per
table under TorchRec's names, views into the kernel's storage (loading writes into the kernel)."""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_rec.batch_check import DeviceBoundsCheck, check_features, check_ids  # noqa: F401  (check_ids: old name)
from lightning_rec.embedding_configs import (  # noqa: F401  (their path until now)
    _TABLE_DTYPES,
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
    _table_dtype,
)
from lightning_rec.errors import NoTorchScript, some
from lightning_rec.lookup import GroupedLookup, join_outputs
from lightning_rec.optim.config import FusedOptimizerConfig
from lightning_rec.optim.fused_paths import fused_modules
from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from lightning_rec.sparse.checks import check_ids_contract, validate_kjt
from lightning_rec.sparse.variable_batch import expand_by_inverse_indices, is_variable_batch, padded_batch
from lightning_rec.table_weight import _TABLE_OWNERS, FusedTableWeight, _Tables, _TableWeight, table_owner  # noqa: F401


def dtype_cast_error(owner: str, dtype: torch.dtype) -> ValueError:
    """`.double()` / `.half()` / `.to(dtype)` of a module holding fused tables: refused (set the configs' data_type)."""
    # names the Lightning precision that converts to this dtype, and how to convert layers already converted back
    lightning = ("Lightning's precision='64-true' converts it: use '32-true', the tables have no float64 kernel"
                 if dtype == torch.float64 else
                 "Lightning's precision='bf16-true' / '16-true' converts it: use 'bf16-mixed'")
    return ValueError(
        f"{owner} tables keep their configured data_type; set data_type in the table configs instead of converting "
        f"the module to {dtype} ({lightning}). Layers converted before this refusal stay {dtype}: "
        f"model.float() converts them back"
    )


def collection_call(collection: nn.Module, features: KeyedJaggedTensor):
    """A collection's forward: its `_forward`. torch.fx.symbolic_trace records this call as one node (torch.fx.wrap
    below) instead of tracing into the collection, whose batch checks read the ids a traced value does not hold."""
    return collection._forward(features)


torch.fx.wrap("collection_call")


def refuse_dtype_cast(owner: str, fn) -> None:
    """Raise `dtype_cast_error` when `fn` (what nn.Module._apply applies) would change a float32 tensor's dtype."""
    try:
        dtype = fn(torch.empty(0)).dtype
    except (RuntimeError, AssertionError):  # a move this machine cannot make: the module's own _apply says so
        return
    if dtype != torch.float32:
        raise dtype_cast_error(owner, dtype)


class FeatureRouter:
    """A KJT's features put into a collection's order, its per-id weights kept or dropped, the batch checked.

    Shared by the unsharded and the sharded collections; per input key order (cached) it knows the permutation and each
    feature's table size. The batch is checked as it arrives, before the permutation, so that a GPU batch moved from the
    host is checked on its host copy. Unread features and unused weights are dropped with a warning (once)."""

    def __init__(self, feature_names: Sequence[str], rows_F: Tensor, tables_F: Sequence[str], is_weighted: bool,
                 owner: str, sources: Sequence[str] | None = None) -> None:
        """sources: the input key each feature reads (a feature several tables read is one key, `feature@table`
        names apart, as feature_table_names gives); None: the feature names themselves."""
        self.feature_names = list(feature_names)
        self.sources = list(sources) if sources is not None else self.feature_names
        self.rows_F, self.tables_F = rows_F, list(tables_F)
        self.is_weighted = is_weighted
        self.owner = owner  # how errors name the collection
        self._by_feature: dict[str, tuple[int, str]] = {}  # input key -> (rows, table) it is checked against
        for f, r, t in zip(self.sources, rows_F.tolist(), self.tables_F):
            if f not in self._by_feature or r < self._by_feature[f][0]:  # a shared key: its smallest table
                self._by_feature[f] = (int(r), t)
        self._renamed = self.sources != self.feature_names
        self._cache: dict[tuple[str, ...], tuple[list[int] | None, Tensor | None, Tensor, list[str]]] = {}
        self._warned_weights = False
        self.device_check: DeviceBoundsCheck | None = None

    def _for_keys(self, features: KeyedJaggedTensor):
        keys = tuple(features.keys())
        cached = self._cache.get(keys)
        if cached is None:
            index = features.index_per_key()
            missing = [f for f in dict.fromkeys(self.sources) if f not in index]
            if missing:
                validate_kjt(features.host_copy() or features)  # a malformed batch is named as such first
                # the differences, a few of each: two whole lists of 26 names would hide them
                unexpected = [k for k in keys if k not in self._by_feature]
                read_by = ", ".join(f"'{f}' by table '{self._by_feature[f][1]}'" for f in missing[:5])
                extra = (f"; it has {some(unexpected)} that no table reads" if unexpected else
                         f"; it has {len(keys)} feature(s), all read")
                raise ValueError(f"the input has no feature(s) {some(missing)} that this {self.owner} reads ({read_by}"
                                 f"{', ...' if len(missing) > 5 else ''}){extra}: rename the features or the tables' "
                                 f"feature_names so they match")
            unread = [k for k in keys if k not in self._by_feature]
            if unread:
                warnings.warn(f"the input's feature(s) {unread} are read by no table of this {self.owner} and are "
                              f"ignored: add them to a table's feature_names, or leave them out of the batch",
                              stacklevel=4)
            rows_in = torch.tensor([self._by_feature.get(k, (-1, ""))[0] for k in keys], dtype=torch.int64)
            tables_in = [self._by_feature.get(k, (-1, "(none)"))[1] for k in keys]
            if list(keys) == self.feature_names:
                cached = (None, None, rows_in, tables_in)
            else:
                order = [index[f] for f in self.sources]  # a shared key repeated, once per table
                cached = (order, torch.tensor(order, dtype=torch.int32, device=features.device()), rows_in, tables_in)
            if not torch.compiler.is_exporting():  # tensors made while torch.export traces are its own, not values
                self._cache[keys] = cached
        return cached

    def __call__(self, features: KeyedJaggedTensor, validate_ids: bool = True) -> KeyedJaggedTensor:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"{self.owner} takes a KeyedJaggedTensor of ids, got a {type(features).__name__}: build "
                            f"one with KeyedJaggedTensor.from_lengths_sync(keys=..., values=..., lengths=...)")
        if not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
            # the KJT's own contract (its constructor only assigns); its values are read by check_features below
            validate_kjt(features, contents=not validate_ids)
            validate_kjt(features.host_copy() or features, contents=not validate_ids)  # a device batch: its host copy
        check_ids_contract(features)  # a KJT holds any values; a collection reads integer ids
        order, order_t, rows_in, tables_in = self._for_keys(features)
        if self.is_weighted and features.weights_or_none() is None:
            raise ValueError(f"this {self.owner} is weighted (is_weighted=True) but the input has no weights: "
                             f"build the KJT with weights=..., or set is_weighted=False")
        # torch.export traces symbolic ids that no check can read (as TorchRec's, unchecked)
        if validate_ids and not torch.compiler.is_exporting():
            if features.device().type != "cpu" and self.device_check is not None:
                self.device_check.before_lookup(features, rows_in, tables_in)  # raises for an earlier bad batch
            check_features(features, rows_in, tables_in, self.owner)
        if order is not None:
            if order_t.device != features.device():
                order_t = order_t.to(features.device())
                if not torch.compiler.is_exporting():
                    self._cache[tuple(features.keys())] = (order, order_t, rows_in, tables_in)
            features = features.permute(order, order_t)
        weights = features.weights_or_none()
        if not self.is_weighted and weights is not None:
            if not self._warned_weights:
                self._warned_weights = True
                warnings.warn(f"the input has per-id weights but this {self.owner} is unweighted, so they are "
                              f"ignored: build it with is_weighted=True to use them, or leave them out of the batch",
                              stacklevel=3)
            weights = None
        if self._renamed or weights is not features.weights_or_none():  # the kernels' names, the weights they read
            features = KeyedJaggedTensor(self.feature_names, features.values(), weights, lengths=features.lengths(),
                                         offsets=features.offsets_or_none(), stride=features.stride(),
                                         length_per_key=features._length_per_key, _validate=False)
        return features


def feature_table_names(tables: Sequence[BaseEmbeddingConfig]) -> tuple[list[BaseEmbeddingConfig], dict[str, str]]:
    """TorchRec's names for a feature several tables read: `feature@table`, one output (and kernel feature) per table.

    Returns the configs with their features so named (the same objects where none is shared) and, per name, the
    input key it reads."""
    readers = Counter(f for t in tables for f in t.feature_names)
    named, sources = [], {}
    for t in tables:
        names = [f"{f}@{t.name}" if readers[f] > 1 else f for f in t.feature_names]
        for name, f in zip(names, t.feature_names):
            if name in sources:
                raise ValueError(f"table '{t.name}': feature '{f}' gives the output name '{name}', which another "
                                 f"feature already has (a feature several tables read is named 'feature@table'): "
                                 f"rename one of them")
            sources[name] = f
        named.append(t if names == t.feature_names else dataclasses.replace(t, feature_names=names))
    return named, sources


def _whole_tables_from_pieces(module, state_dict, prefix, *args) -> None:
    """A sharded state dict (ShardedTensor pieces) loads into the unsharded collection when it is whole."""
    from lightning_rec.sharding.sharded_tensor import ShardedTensor

    head = f"{prefix}{module._weights_attr}."
    for key in [k for k in state_dict if k.startswith(head)]:
        value = state_dict[key]
        if not isinstance(value, ShardedTensor):
            continue
        try:
            state_dict[key] = value.full()
        except ValueError:
            raise ValueError(
                f"'{key}' holds only some pieces of the table {tuple(value.global_shape)} ({value}): one rank's "
                f"sharded state dict. An unsharded {type(module).__name__} needs whole tables: combine every "
                f"rank's state dict with ShardedTensor.merge([...]) per table first, or save with RecStrategy's "
                f"checkpoints and read them with lightning_rec.checkpoint.load_model(module, path)"
            ) from None


def _meta_tables_for_load(module, state_dict, prefix, local_metadata, *args) -> None:
    """Tables still on "meta" load a checkpoint with assign=True (materialised on its device), else refused."""
    if module._device.type != "meta":
        return
    head = f"{prefix}{module._weights_attr}."
    given = [v for k, v in state_dict.items() if k.startswith(head) and isinstance(v, Tensor) and not v.is_meta]
    if not given:
        return
    if not local_metadata.get("assign_to_params_buffers", False):  # torch would copy into meta: nothing loaded
        raise ValueError(f"{type(module).__name__}.load_state_dict: its tables are on 'meta' (built there) and would "
                         f"load nothing: materialise them first with model.to_empty(device='cpu'), or pass "
                         f"assign=True to load them onto the checkpoint's device")
    module._materialise(given[0].device)


def _read_frozen(collection: _EmbeddingCollectionBase) -> frozenset[str]:
    return frozenset(name for name, p in collection.table_parameters().items() if getattr(p, "frozen", False))


# id -> the collection, for _frozen_names, whose only argument (a graph constant) is an int
_LIVE_COLLECTIONS: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()


@torch.compiler.assume_constant_result
def _frozen_names(key: int) -> frozenset[str]:
    return _read_frozen(_LIVE_COLLECTIONS[key])


class _EmbeddingCollectionBase(NoTorchScript, nn.Module):
    """What both collections share: configs, feature routing, id checks, weights in the state dict."""

    _weights_attr = "embedding_bags"

    def __init__(self, tables: Sequence[BaseEmbeddingConfig], device: torch.device | str | None,
                 optimizer: FusedOptimizerConfig | None, kernel: str, validate_ids: bool,
                 is_weighted: bool) -> None:
        super().__init__()
        if not tables:
            raise ValueError(f"{type(self).__name__} needs at least one table config")
        config_type = EmbeddingConfig if isinstance(self, EmbeddingCollection) else EmbeddingBagConfig
        for t in tables:
            if not isinstance(t, BaseEmbeddingConfig):
                raise ValueError(f"{type(self).__name__} takes {config_type.__name__} tables, got a "
                                 f"{type(t).__name__}: write {config_type.__name__}(name=..., num_embeddings=..., "
                                 f"embedding_dim=..., feature_names=[...])")
        if isinstance(optimizer, bool) and isinstance(self, EmbeddingCollection):
            # TorchRec's EmbeddingCollection(tables, device, need_indices): its third argument is optimizer here
            raise ValueError(f"EmbeddingCollection(tables, device, {optimizer}): the third argument is optimizer here "
                             f"(TorchRec's need_indices): pass need_indices={optimizer} by keyword")
        if optimizer is not None and not isinstance(optimizer, FusedOptimizerConfig):
            raise ValueError(f"optimizer={optimizer!r}: pass a FusedOptimizerConfig (e.g. "
                             f"FusedOptimizerConfig('rowwise_adagrad', lr=0.01)), or None for plain parameters")
        if torch.device(device or torch.get_default_device()).type not in ("cpu", "cuda", "meta"):  # meta: no memory
            raise ValueError(f"{type(self).__name__}(device={str(device)!r}): tables live on 'cpu' or 'cuda' "
                             f"('meta' to plan a model without allocating it)")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, got {names}")
        self._configs = list(tables)
        # the kernels' configs: a feature several tables read is named `feature@table` (TorchRec's output names)
        self._routed_configs, self._sources = feature_table_names(self._configs)
        # default: torch's default device, so that `with torch.device("meta"):` builds on meta as TorchRec's
        self._device = torch.device(device) if device is not None else torch.get_default_device()
        self._optimizer = optimizer
        self._kernel = kernel
        self.validate_ids = validate_ids
        self._is_weighted = is_weighted
        self._warned_replicas = False
        _LIVE_COLLECTIONS[id(self)] = self  # frozen_tables' way in while torch.compile traces
        try:
            self._build_lookup(self._device)
        except (RuntimeError, MemoryError) as e:
            if "alloc" not in str(e).lower() and not isinstance(e, MemoryError):
                raise
            # the allocator's message gives bytes, not which table asked for them
            sizes = ", ".join(f"'{t.name}' {t.num_embeddings} x {t.embedding_dim}" for t in
                              sorted(tables, key=lambda t: -t.num_embeddings * t.embedding_dim)[:4])
            raise ValueError(f"{type(self).__name__}: the tables do not fit in {self._device} memory ({sizes} rows x "
                             f"dims): lower num_embeddings (hash ids into fewer rows), or shard the tables over "
                             f"ranks with DistributedModelParallel ({type(e).__name__}: {str(e)[:200]})") from e
        if self._device.type != "meta":  # on "meta", DistributedModelParallel applies it to each shard it draws
            self._apply_init_fns()
        self.register_load_state_dict_pre_hook(_whole_tables_from_pieces)
        self.register_load_state_dict_pre_hook(_meta_tables_for_load)

    @torch.no_grad()
    def _apply_init_fns(self) -> None:
        """Each config's init_fn on its table's weight (a view of the kernel's rows: written in place)."""
        params = self.table_parameters()
        for c in self._configs:
            if c.init_fn is not None:
                c.init_fn(params[c.name])
        self._lookup.weights_written()

    def _build_lookup(self, device: torch.device) -> None:
        # host-side metadata (row counts, orders) stays on the host under any default device (`with torch.device`)
        with torch.device("cpu"):
            self._build_lookup_on(device)

    def _build_lookup_on(self, device: torch.device) -> None:
        lookup = GroupedLookup([c.local_table() for c in self._routed_configs], self._optimizer, device, self._kernel,
                               weighted=self._is_weighted)
        # the lookup is kept out of the module tree: the state dict shows tables that view the kernel's storage
        object.__setattr__(self, "_lookup", lookup)
        weights = _Tables()
        table_weights = lookup.table_weights()
        for c in self._configs:  # the configs' order (TorchRec's), not the kernels'
            w = table_weights[c.name]
            param = w if isinstance(w, nn.Parameter) else FusedTableWeight(w, requires_grad=False)
            self._own(param, c.name)
            weights[c.name] = _TableWeight(param)
        setattr(self, self._weights_attr, weights)
        by_feature = {f: c for c in self._routed_configs for f in c.feature_names}
        self._feature_names = lookup.feature_names  # the kernels' order: tables grouped by pooling and data type
        # outputs in the configs' order, as TorchRec's, whatever the kernels' grouping
        self._output_names = [f for c in self._routed_configs for f in c.feature_names]
        self._output_dims = [by_feature[f].embedding_dim for f in self._output_names]
        self._column_order = None
        if self._output_names != self._feature_names:
            start, at = 0, {}
            for f in self._feature_names:
                at[f] = start
                start += by_feature[f].embedding_dim
            self._column_order = torch.cat([torch.arange(at[f], at[f] + by_feature[f].embedding_dim)
                                            for f in self._output_names]).to(device)
        self._router = FeatureRouter(
            self._feature_names, torch.tensor([by_feature[f].num_embeddings for f in self._feature_names]),
            [by_feature[f].name for f in self._feature_names], self._is_weighted, type(self).__name__,
            sources=[self._sources[f] for f in self._feature_names])
        checked = self._lookup.bounds_checked()
        if device.type == "cuda" and checked:
            self._router.device_check = DeviceBoundsCheck(self._router.rows_F, self._router.tables_F,
                                                          type(self).__name__, checked, self._feature_names)

    def _own(self, param: nn.Parameter, name: str) -> None:
        self.__dict__.pop("_frozen_seen", None)  # another parameter: frozen_tables reads the flags again
        _TABLE_OWNERS[id(param)] = (weakref.ref(self), name)
        weakref.finalize(param, _TABLE_OWNERS.pop, id(param), None)  # gone with the parameter, not kept forever

    def __setstate__(self, state: dict) -> None:
        # deepcopy / pickle: point the copy's table parameters at its own kernels' storage again, and register them
        super().__setstate__(state)
        _LIVE_COLLECTIONS[id(self)] = self
        if "_sources" not in state:  # pickled before shared features: every feature is its own input key
            self._routed_configs, self._sources = list(self._configs), {f: f for f in self._feature_names}
            self._router.sources, self._router._renamed = self._router.feature_names, False
        table_weights = self._lookup.table_weights()
        tables = getattr(self, self._weights_attr)
        for name, param in self.table_parameters().items():
            if param is not table_weights[name]:  # dense kernels hold the parameter itself
                if not isinstance(param, FusedTableWeight):  # pickle rebuilds a plain Parameter (frozen kept)
                    frozen = getattr(param, "frozen", False)
                    param = FusedTableWeight(table_weights[name], requires_grad=False)
                    param.frozen = frozen
                    tables[name].weight = param
                torch._C.TensorBase.data.__set__(param, table_weights[name])  # re-pointed, not copied
            self._own(param, name)

    # ---------------------------------------------------------------------------------------

    @property
    def lookup(self) -> GroupedLookup:
        return self._lookup

    @property
    def device(self) -> torch.device:
        return self._device

    def feature_names(self) -> list[str]:
        """The outputs' names in order: each table's features, in the order of the configs (`feature@table` for a
        feature several tables read, as TorchRec's)."""
        return list(self._output_names)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def fused_optimizer_config(self) -> FusedOptimizerConfig | None:
        return self._optimizer

    def fused_kernels(self) -> list:
        """The kernels that update their tables inside backward (for FusedOptimizer)."""
        return self._lookup.fused_kernels()

    def table_parameters(self) -> dict[str, nn.Parameter]:
        """table name -> its weight parameter (a view into the kernel's storage)."""
        tables = getattr(self, self._weights_attr)
        return {name: tables[name].weight for name in tables}

    def frozen_tables(self) -> frozenset[str]:
        """Fused tables whose weights were set to requires_grad=False: their kernels do no update."""
        seen = self.__dict__.get("_frozen_seen")
        if seen is None or seen[0] != FusedTableWeight.freeze_changes:
            if torch.compiler.is_compiling():
                # torch.compile cannot read a Parameter subclass's attribute: a graph constant (recompiled on freeze)
                frozen = _frozen_names(id(self))
            else:
                frozen = _read_frozen(self)
            self.__dict__["_frozen_seen"] = seen = (FusedTableWeight.freeze_changes, frozen)
        return seen[1]

    def use_fused_optimizer(self, optimizer: FusedOptimizerConfig) -> None:
        """Train the tables with this fused update from now on (build optimizers over the model after this call)."""
        if not isinstance(optimizer, FusedOptimizerConfig):
            raise ValueError(f"use_fused_optimizer takes a FusedOptimizerConfig, got {type(optimizer).__name__}")
        weights = {n: w.detach().clone() for n, w in self._lookup.table_weights().items()}
        self._optimizer = optimizer
        self._build_lookup(self._device)
        self._lookup.train(self.training)
        with torch.no_grad():
            for name, w in self._lookup.table_weights().items():
                w.copy_(weights[name])
        self._lookup.weights_written()

    def _after_lookup(self, features: KeyedJaggedTensor) -> None:
        """GPU batches never on the host: start the lazy copy of fbgemm's bad-id count (no sync)."""
        check = self._router.device_check
        if check is not None and self.validate_ids and features.host_copy() is None:
            check.after_lookup()

    def _route(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Features reordered into the kernels' order (a no-op when they already are), ids checked."""
        if not self._warned_replicas and self._optimizer is not None and self.training and torch.is_grad_enabled():
            self._warn_if_replicated()
        return self._router(features, self.validate_ids)

    def _meta_batch(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Tables on "meta" take a batch on "meta" (outputs shaped as TorchRec's); any other batch is refused."""
        if not (isinstance(features, KeyedJaggedTensor) and features.values().is_meta):
            raise ValueError(f"this {type(self).__name__} was built on device='meta': its tables hold no values until "
                             f"model.to_empty(device='cpu') materialises them (then reset_parameters() or "
                             f"load_state_dict(...)), or DistributedModelParallel(model) / Trainer(strategy='rec') "
                             f"shards them (each shard drawn where it lives)")
        self._router._for_keys(features)  # the features it reads are there
        return features

    def _warn_if_replicated(self) -> None:
        # a fused update trains inside backward, unseen by DDP / FSDP: unsharded copies on N ranks drift apart
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._warned_replicas = True
            warnings.warn(
                f"{type(self).__name__} (tables {[t.name for t in self._configs][:4]}...) trains unsharded in a run "
                f"of {dist.get_world_size()} ranks: its fused optimizer updates this rank's copy only, so the ranks' "
                f"tables drift apart (DDP averages no gradient of theirs). Shard it: Trainer(strategy='rec') "
                f"(--trainer.strategy=rec) or DistributedModelParallel(model)", stacklevel=4)

    # device moves: rebuild the kernels where they now live -----------------------------------

    def _apply(self, fn, recurse: bool = True):
        on_meta = self._device.type == "meta"
        # .to(...) / .cuda() / a parent's: without CUDA, one line instead of torch's AssertionError
        try:
            probe = fn(torch.empty(0, device=self._device))
        except NotImplementedError:
            if on_meta:  # .to(device) of "meta": no values to move; the strategy draws each shard where it lives
                return self
            raise
        except (RuntimeError, AssertionError) as e:
            from lightning_rec._device import no_cuda_error

            error = no_cuda_error(f"moving {type(self).__name__} to the GPU (.to('cuda') / .cuda())",
                                  f"or keep it on the CPU (device='cpu', accelerator='cpu'). torch said: {e}")
            if error is None:
                raise
            raise error from None
        if on_meta:
            if probe.device.type != "meta":  # to_empty(device=...): the tables materialised there
                self._materialise(probe.device)
            return self
        if probe.dtype != torch.float32:
            raise dtype_cast_error(type(self).__name__, probe.dtype)
        if probe.device != self._device:
            self._move_to(probe.device)
        return self

    def _move_to(self, device: torch.device) -> None:
        old = self._lookup
        weights = {n: w.detach().to(device) for n, w in old.table_weights().items()}
        states = [s for k in old.fused_kernels() for s in k.optimizer_states()]
        lr = [k.get_learning_rate() for k in old.fused_kernels()]
        self._device = device
        self._build_lookup(device)
        with torch.no_grad():
            for name, w in self._lookup.table_weights().items():
                w.copy_(weights[name])
            new_states = [s for k in self._lookup.fused_kernels() for s in k.optimizer_states()]
            for new, saved in zip(new_states, states):
                for key, value in saved.items():
                    new[key].copy_(value)
        for kernel, rate in zip(self._lookup.fused_kernels(), lr):
            kernel.set_learning_rate(rate)

    def _materialise(self, device: torch.device) -> None:
        """Tables built on "meta" built again on `device`, drawn as at construction (init_fn included), frozen kept."""
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"{type(self).__name__}.to_empty(device={str(device)!r}): tables live on 'cpu' or 'cuda'")
        off = [n for n, p in self.table_parameters().items()
               if (p.frozen if isinstance(p, FusedTableWeight) else not p.requires_grad)]
        self._device = device
        self._build_lookup(device)
        self._lookup.train(self.training)
        self._apply_init_fns()
        params = self.table_parameters()
        for name in off:
            params[name].requires_grad_(False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """TorchRec's: each table drawn again, by its config's init_fn or uniform in its init range (a no-op on
        "meta"). The fused optimizer's state is kept."""
        if self._device.type == "meta":
            return
        params = self.table_parameters()
        for c in self._configs:
            if c.init_fn is not None:
                c.init_fn(params[c.name])
            else:
                params[c.name].uniform_(*c.local_table().init_range())
        self._lookup.weights_written()

    def train(self, mode: bool = True):
        super().train(mode)
        self._lookup.train(mode)
        return self


class EmbeddingBagCollection(_EmbeddingCollectionBase):
    """Pooled embeddings for many features: KJT -> KeyedTensor [B, sum of each feature's dim].

    Args:
        tables: one EmbeddingBagConfig per table; several features may read one table, and several tables one
            feature (outputs `feature@table`).
        is_weighted: use the KJT's per-id weights (weighted sum / mean).
        device: where the tables live ("cpu", "cuda", or "meta": no values until `to_empty` or sharding); None:
            torch's default device (`with torch.device("meta"):` builds on meta).
        optimizer: a FusedOptimizerConfig to update rows inside backward; None: parameters trained by torch.optim.
        kernel: "auto" | "fbgemm" | "native" | "dense" (see lookup.choose_kernel).
        validate_ids: check every id against its table's rows (ValueError naming both)."""

    def __init__(self, tables: Sequence[EmbeddingBagConfig], is_weighted: bool = False,
                 device: torch.device | str | None = None, optimizer: FusedOptimizerConfig | None = None,
                 kernel: str = "auto", validate_ids: bool = True) -> None:
        for t in tables:
            if isinstance(t, BaseEmbeddingConfig) and not isinstance(t, EmbeddingBagConfig):
                raise ValueError(f"EmbeddingBagCollection takes EmbeddingBagConfig tables, got {type(t).__name__} "
                                 f"for '{t.name}': use EmbeddingCollection for sequence tables")
        super().__init__(tables, device, optimizer, kernel, validate_ids, is_weighted)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._configs)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return collection_call(self, features)  # one node in a torch.fx trace

    def _forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if self._device.type == "meta":
            B = self._meta_batch(features).stride()
            return KeyedTensor._of_collection(self._output_names, self._output_dims,
                                              torch.empty(B, sum(self._output_dims), device="meta"))
        inverse = features.inverse_indices_or_none() if isinstance(features, KeyedJaggedTensor) else None
        if is_variable_batch(features):  # keys' own bag counts: looked up once each, expanded below
            features = padded_batch(features, type(self).__name__, contents=not self.validate_ids)
        features = self._route(features)  # kernel order, batch checked
        # one [B, D_group] per kernel group; frozen tables do no update
        pooled = self._lookup.forward(features, checked=self.validate_ids, frozen=self.frozen_tables())
        self._after_lookup(features)
        pooled_BD = join_outputs(pooled, dim=1)
        if self._column_order is not None:  # kernel groups -> the configs' order
            pooled_BD = pooled_BD.index_select(1, self._column_order)
        if inverse is not None:
            pooled_BD = expand_by_inverse_indices(pooled_BD, [self._sources[f] for f in self._output_names],
                                                  self._output_dims, inverse)
        return KeyedTensor._of_collection(self._output_names, self._output_dims, pooled_BD)


def sequence_output(rows_ND: Tensor, lengths_B: Tensor, ids_N: Tensor | None) -> JaggedTensor:
    """One feature's rows as a JaggedTensor; with need_indices, its ids ride as the weights (TorchRec's layout)."""
    jt = JaggedTensor(values=rows_ND, lengths=lengths_B)
    jt._weights = ids_N
    return jt


class EmbeddingCollection(_EmbeddingCollectionBase):
    """Sequence embeddings: KJT -> {feature: JaggedTensor with values [N_f, D]} (one row per id)."""

    _weights_attr = "embeddings"

    def __init__(self, tables: Sequence[EmbeddingConfig], device: torch.device | str | None = None,
                 optimizer: FusedOptimizerConfig | None = None, kernel: str = "auto",
                 validate_ids: bool = True, *, need_indices: bool = False) -> None:
        """need_indices: TorchRec's; each output JaggedTensor also carries its feature's ids, as its weights."""
        for t in tables:
            if isinstance(t, EmbeddingBagConfig):
                raise ValueError(f"EmbeddingCollection takes EmbeddingConfig tables, got EmbeddingBagConfig "
                                 f"for '{t.name}': use EmbeddingBagCollection for pooled tables")
        if not isinstance(need_indices, bool):
            raise ValueError(f"EmbeddingCollection(need_indices={need_indices!r}): pass True or False")
        super().__init__(tables, device, optimizer, kernel, validate_ids, is_weighted=False)
        self._need_indices = need_indices

    def need_indices(self) -> bool:
        """TorchRec's: whether each output JaggedTensor carries its feature's ids as its weights."""
        return self.__dict__.get("_need_indices", False)  # a collection pickled before the flag existed: False

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return list(self._configs)

    def embedding_dim(self) -> int:
        """TorchRec's: the tables' one embedding_dim (TorchRec requires one; tables here may differ)."""
        dims = {c.name: c.embedding_dim for c in self._configs}
        if len(set(dims.values())) != 1:
            raise ValueError(f"embedding_dim(): the tables have different dims {dims}; read each table's from "
                             f"embedding_configs()")
        return next(iter(dims.values()))

    def embedding_names_by_table(self) -> list[list[str]]:
        """TorchRec's: each table's output names, its features (`feature@table` for one several tables read)."""
        return [list(c.feature_names) for c in self._routed_configs]

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        return collection_call(self, features)  # one node in a torch.fx trace

    def _forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        if isinstance(features, KeyedJaggedTensor) and (features.inverse_indices_or_none() is not None
                                                        or features.variable_stride_per_key()):
            raise ValueError("EmbeddingCollection: the input has inverse_indices (TorchRec's deduplicated batch), "
                             "which expand pooled outputs only: give a sequence collection every sample's bags (build "
                             "the KJT without inverse_indices), as TorchRec's EmbeddingCollection takes")
        if self._device.type == "meta":
            return self._meta_forward(self._meta_batch(features))
        features = self._route(features)
        # one [N_group, D] per kernel group; frozen tables do no update
        values = self._lookup.forward(features, checked=self.validate_ids, frozen=self.frozen_tables())
        self._after_lookup(features)
        values_ND = values[0] if len(values) == 1 else None
        out: dict[str, JaggedTensor] = {}
        lpk = features.length_per_key()
        sizes = [len(g_features) for g_features in
                 ([f for t in g for f in t.feature_names] for g in self._lookup.groups)]
        k = 0
        for group_values, n in zip(values if values_ND is None else [values_ND], sizes):
            for part, name in zip(torch.split(group_values, lpk[k : k + n]), self._feature_names[k : k + n]):
                jt = features[name]
                out[name] = sequence_output(part, jt.lengths(), jt.values() if self.need_indices() else None)
            k += n
        return {name: out[name] for name in self._output_names}  # the configs' order

    def _meta_forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        out = {}
        for name, dim in zip(self._output_names, self._output_dims):
            jt = features[self._sources[name]]
            out[name] = sequence_output(torch.empty(jt.values().shape[0], dim, device="meta"), jt.lengths(),
                                        jt.values() if self.need_indices() else None)
        return out


def fused_table_modules(module: torch.nn.Module) -> list[str]:
    """Paths of the embedding collections (unsharded or sharded) inside `module` that train with a fused optimizer."""
    unsharded = [name for name, m in module.named_modules()
                 if isinstance(m, _EmbeddingCollectionBase) and m.fused_optimizer_config() is not None]
    return unsharded or [name for name, _ in fused_modules(module)]
