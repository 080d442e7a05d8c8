"""TorchRec's managed-collision collections: raw ids remapped per table, then looked up in an EBC / EC."""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_rec.comm import all_gather_object, distributed
from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.embedding_configs import BaseEmbeddingConfig
from lightning_rec.managed_collision.mch import _NO_ID, MCHManagedCollisionModule, TableGroup, _gather, remap_tables
from lightning_rec.sparse import KeyedJaggedTensor


class ManagedCollisionCollection(nn.Module):
    """One MCHManagedCollisionModule per table: forward(KJT of raw ids) -> KJT of rows (TorchRec's name).

    Each table's features are remapped together (one profile per table and step). Features of tables without a
    module pass through unchanged. Under DistributedModelParallel a sharded table's map is split with its rows and
    remapped on the owners after the id all-to-all (sharded_managed_collision.py): its ids pass through here raw.
    A data-parallel table's map stays whole: with `process_group` set (the sharded collection's group), a training
    step profiles every rank's distinct ids and counts, gathered in one collective, so the map stays the same on
    every rank and equal to one module fed the global batch."""

    def __init__(self, managed_collision_modules: Mapping[str, MCHManagedCollisionModule],
                 embedding_configs: Sequence[BaseEmbeddingConfig]) -> None:
        super().__init__()
        by_name = {c.name: c for c in embedding_configs}
        for table, module in managed_collision_modules.items():
            if table not in by_name:
                raise ValueError(f"ManagedCollisionCollection: no embedding config named '{table}' for its "
                                 f"managed-collision module (tables: {sorted(by_name)})")
            rows = by_name[table].num_embeddings
            if module.output_size() > rows:
                raise ValueError(f"ManagedCollisionCollection: table '{table}' has {rows} rows but its module hands "
                                 f"out zch_size={module.output_size()}: use zch_size <= {rows} (or a larger table)")
            if module._name is None:
                module._name = table
        self._managed_collision_modules = nn.ModuleDict(dict(managed_collision_modules))
        self._embedding_configs = list(embedding_configs)
        self._table_features = {c.name: list(c.feature_names) for c in embedding_configs
                                if c.name in managed_collision_modules}
        self.remap_on_owners(frozenset())
        self._group: TableGroup | None = None  # the tables remapped here, gathered once
        self.process_group: Any = None
        self.device: torch.device | None = None  # the group's device (NCCL: the rank's GPU)

    def remap_on_owners(self, tables: frozenset[str]) -> None:
        """These tables are sharded: remapped by their owners, after the id all-to-all (not here)."""
        self._owner_tables = tables
        self._local_tables = {t: f for t, f in self._table_features.items() if t not in tables}

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        tables = self._local_tables
        if not tables:  # every table remaps on its owners: the batch goes on as it is (the pipeline routed it)
            return features
        keys = features.keys()
        index = {k: i for i, k in enumerate(keys)}
        offsets = features.offset_per_key()
        modules = self._managed_collision_modules
        values = features.values()
        out = values.clone()
        maps = [modules[t] for t in tables]
        spans = [[(offsets[index[f]], offsets[index[f] + 1]) for f in names if f in index] for names in tables.values()]
        profile = None
        if self.training:
            if values.numel() and bool(((values < 0) | (values == _NO_ID)).any()):  # one host read for all tables
                for m, s in zip(maps, spans):
                    m.check_ids(_gather(values, s))  # names the table (ids of other features may be rows)
            profile = self._profile_input(list(tables), spans, values)
        if self._group is None or self._group.modules != maps:
            self._group = TableGroup(maps)
        remap_tables(self._group, values, out, spans, profile, self.training)
        return KeyedJaggedTensor(keys, out, features.weights_or_none(), lengths=features.lengths(),
                                 offsets=features.offsets_or_none(), stride=features.stride(),
                                 length_per_key=features.length_per_key(), offset_per_key=offsets, _validate=False)

    def _profile_input(self, tables: list[str], spans: list[list[tuple[int, int]]], values: Tensor
                       ) -> tuple[Tensor, Tensor | None, list[list[tuple[int, int]]]]:
        """What each table profiles (remap_tables' `profile`): its ids (the spans it remaps), or under a process
        group every rank's distinct ids and counts, gathered in one collective."""
        pg = self.process_group
        if pg is None or not distributed() or dist.get_world_size(pg) == 1:
            return values, None, spans
        counted = self._batch_counts({t: _gather(values, s) for t, s in zip(tables, spans)}, pg)
        sizes = [u.numel() for u, _ in counted.values()]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return (torch.cat([u for u, _ in counted.values()]), torch.cat([c for _, c in counted.values()]),
                [[(a, a + n)] for a, n in zip(starts, sizes)])

    def _batch_counts(self, ids: Mapping[str, Tensor], pg) -> dict[str, tuple[Tensor, Tensor]]:
        """table -> (distinct ids, counts) of this step, every rank's."""
        local = {t: torch.unique(v, return_counts=True) for t, v in ids.items()}
        every = all_gather_object({t: (u.cpu(), c.cpu()) for t, (u, c) in local.items()}, group=pg,
                                  device=self.device, tag="managed-collision ids")
        out = {}
        for t, (u, _) in local.items():
            uniq, inverse = torch.unique(torch.cat([r[t][0] for r in every]), return_inverse=True)
            counts = torch.zeros_like(uniq).scatter_add_(0, inverse, torch.cat([r[t][1] for r in every]))
            out[t] = (uniq.to(u.device), counts.to(u.device))
        return out

    def steps(self) -> dict[str, int]:
        """table -> its step of the tables remapped here."""
        return {t: self._managed_collision_modules[t]._now() for t in self._local_tables}

    def modules_by_table(self) -> dict[str, MCHManagedCollisionModule]:
        return dict(self._managed_collision_modules.items())

    def take_reused_rows(self) -> dict[str, Tensor]:
        out = {}
        for table in self._local_tables:  # the owner tables' rows are re-drawn on the owners, in the lookup
            rows = self._managed_collision_modules[table].take_reused_rows()
            if rows is not None:
                out[table] = rows
        return out

    def metrics(self) -> dict[str, float]:
        """`mc/<table>/<metric>` for every table (see MCHManagedCollisionModule.metrics)."""
        return {f"mc/{t}/{k}": v for t, m in self._managed_collision_modules.items() for k, v in m.metrics().items()}


def _configs(collection: nn.Module) -> dict[str, Any]:
    get = getattr(collection, "embedding_bag_configs", None) or collection.embedding_configs
    return {c.name: c for c in get()}


def _draw(config, n: int, seed_text: str, init_range: tuple[float, float] | None = None) -> Tensor:
    """n fresh rows of a table, the same on every rank for the same text (a column-wise piece takes its columns)."""
    seed = int.from_bytes(hashlib.sha256(seed_text.encode()).digest()[:8], "little") & (2**63 - 1)
    out = torch.empty(n, config.embedding_dim)
    if config.init_fn is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            config.init_fn(out)
        return out
    low, high = init_range or config.local_table().init_range()
    return out.uniform_(low, high, generator=torch.Generator().manual_seed(seed))


def _pieces(collection: nn.Module) -> list[tuple[str, int, int, Tensor]]:
    """(table, first row, first column, [rows, cols] weight view) for every piece this process holds."""
    if not hasattr(collection, "local_shards"):  # unsharded
        return [(t, 0, 0, w) for t, w in collection.lookup.table_weights().items()]
    out = [(t, *meta.shard_offsets, w) for t, shards in collection.local_shards().items() for meta, w in shards]
    return out + [(t, 0, 0, w) for t, w in collection.replica_weights().items()]


def _state_offset(collection: nn.Module, local_name: str) -> tuple[str, int]:
    if not hasattr(collection, "shard_of"):
        return local_name, 0
    table, meta, _ = collection.shard_of(local_name)
    return table, (meta.shard_offsets[0] if meta is not None else 0)


class _RowTargets:
    """Where each table's rows live in this process: its weight pieces (first row, first column, [rows, cols] view)
    and its fused optimizer state rows (first row, per-row view), and its config's init range, looked up once."""

    def __init__(self, collection: nn.Module) -> None:
        self.configs = _configs(collection)
        self.ranges = {t: c.local_table().init_range() for t, c in self.configs.items()}
        self.weights: dict[str, list[tuple[int, int, Tensor]]] = {}
        for table, r0, c0, w in _pieces(collection):
            self.weights.setdefault(table, []).append((r0, c0, w))
        self.states: dict[str, list[tuple[int, Tensor]]] = {}
        kernels = collection.fused_kernels()
        for kernel in kernels:
            for t, state in zip(kernel.tables, kernel.optimizer_states()):
                table, r0 = _state_offset(collection, t.name)
                self.states.setdefault(table, []).extend(
                    (r0, v) for v in state.values() if v.dim() >= 1 and v.shape[0] == t.num_embeddings)
        # a row cache is written back when the views are taken (split_embedding_weights): taken at every call then
        self.caching = any(getattr(k, "caching", False) for k in kernels)


# views stay valid while their kernels live: loads write them in place; the unsharded collection's moves build a new
# lookup (a new key here); a sharded collection keeps its kernels for life (resharding builds another collection)
_TARGETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _row_targets(collection: nn.Module) -> _RowTargets:
    key = collection if hasattr(collection, "local_shards") else collection.lookup
    targets = _TARGETS.get(key)
    if targets is None:
        targets = _RowTargets(collection)
        if not targets.caching:
            _TARGETS[key] = targets
    return targets


def _in_piece(rows: Tensor, r0: int, n: int, shard: int | None, whole: int) -> tuple[Tensor | None, Tensor] | None:
    """(which of `rows` fall in the piece of table rows [r0, r0 + n) (None: all), their piece rows), or None when
    none can. `shard`: the first row of the row shard all the rows come from (None: unknown); `whole`: table rows."""
    if shard is not None:
        return (None, rows - r0 if r0 else rows) if r0 == shard else None
    if r0 == 0 and n >= whole:
        return None, rows
    mine = (rows >= r0) & (rows < r0 + n)
    return mine, rows[mine] - r0


@torch.no_grad()
def reinit_rows(collection: nn.Module, reused: Mapping[str, Tensor], steps: Mapping[str, int] | None = None,
                seed_names: Mapping[str, str] | None = None, first_rows: Mapping[str, int] | None = None) -> None:
    """Draws the reused rows' weights again (init_fn or the init range, seeded by table (or its `seed_names`
    entry) and step: every rank and layout draws the same values) and zeroes their fused optimizer state; sharded
    collections write the pieces they hold. `first_rows`: table -> the first row of the one row shard its rows
    lie in (a sharded owner's), whose pieces alone are written."""
    if not reused:
        return
    targets, names, steps, shards = _row_targets(collection), seed_names or {}, steps or {}, first_rows or {}
    for table, rows in reused.items():
        fresh = _draw(targets.configs[table], rows.numel(), f"{names.get(table, table)}:{steps.get(table, 0)}",
                      targets.ranges[table])
        shard, whole = shards.get(table), targets.configs[table].num_embeddings
        for r0, c0, w in targets.weights.get(table, ()):
            piece = _in_piece(rows, r0, w.shape[0], shard, whole)
            if piece is not None:
                mine, local = piece
                values = fresh if mine is None else fresh[mine]
                if c0 or w.shape[1] != values.shape[1]:
                    values = values[:, c0:c0 + w.shape[1]]
                w.index_copy_(0, local.to(w.device), values.to(w))
        _zero_state_rows(targets, table, rows, shard)
    _written(collection)


def _zero_state_rows(targets: _RowTargets, table: str, rows: Tensor, shard: int | None) -> None:
    whole = targets.configs[table].num_embeddings
    for r0, v in targets.states.get(table, ()):
        piece = _in_piece(rows, r0, v.shape[0], shard, whole)
        if piece is not None:
            v.index_fill_(0, piece[1].to(v.device), 0)


def _written(collection: nn.Module) -> None:
    (collection if hasattr(collection, "local_shards") else collection.lookup).weights_written()


@torch.no_grad()
def zero_optimizer_rows(collection: nn.Module, rows_by_table: Mapping[str, Tensor]) -> None:
    """Zeroes the fused optimizer state of these table rows in the pieces this process holds."""
    targets = _row_targets(collection)
    for table, rows in rows_by_table.items():
        _zero_state_rows(targets, table, rows, None)
    _written(collection)


class _ManagedCollisionBase(nn.Module):
    def __init__(self, collection: nn.Module, managed_collision_collection: ManagedCollisionCollection,
                 return_remapped_features: bool) -> None:
        super().__init__()
        configs = _configs(collection)
        for table in managed_collision_collection._table_features:
            if table not in configs:
                raise ValueError(f"{type(self).__name__}: the managed-collision table '{table}' is not one of the "
                                 f"collection's tables {sorted(configs)}")
        self._managed_collision_collection = managed_collision_collection
        self._return_remapped_features = return_remapped_features

    def _remap(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        mcc = self._managed_collision_collection
        env = getattr(self._embedding_module, "env", None)  # sharded by DistributedModelParallel: its group
        if env is not None and mcc.process_group is None:
            mcc.process_group, mcc.device = env.pg, env.device
        remapped = mcc(features)
        reused = mcc.take_reused_rows()
        if reused:
            reinit_rows(self._embedding_module, reused, mcc.steps())
        return remapped

    def metrics(self) -> dict[str, float]:
        """Per table: fill ratio, evictions per interval, share of lookups reading an evicted-then-reused row."""
        return self._managed_collision_collection.metrics()


class ManagedCollisionEmbeddingBagCollection(_ManagedCollisionBase):
    """An EmbeddingBagCollection read through a ManagedCollisionCollection (TorchRec's name):
    forward(KJT of raw ids) -> (KeyedTensor, remapped KJT or None)."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection,
                 managed_collision_collection: ManagedCollisionCollection,
                 return_remapped_features: bool = False) -> None:
        super().__init__(embedding_bag_collection, managed_collision_collection, return_remapped_features)
        self._embedding_module = embedding_bag_collection

    def forward(self, features: KeyedJaggedTensor):
        remapped = self._remap(features)
        return self._embedding_module(remapped), (remapped if self._return_remapped_features else None)


class ManagedCollisionEmbeddingCollection(_ManagedCollisionBase):
    """An EmbeddingCollection read through a ManagedCollisionCollection (TorchRec's name):
    forward(KJT of raw ids) -> (dict of JaggedTensor, remapped KJT or None)."""

    def __init__(self, embedding_collection: EmbeddingCollection,
                 managed_collision_collection: ManagedCollisionCollection,
                 return_remapped_features: bool = False) -> None:
        super().__init__(embedding_collection, managed_collision_collection, return_remapped_features)
        self._embedding_module = embedding_collection

    def forward(self, features: KeyedJaggedTensor):
        remapped = self._remap(features)
        return self._embedding_module(remapped), (remapped if self._return_remapped_features else None)


_MCH_ARGS = ("eviction_policy", "eviction_interval", "min_count_to_admit", "churn_warning", "max_candidates")


def check_managed_collision(arguments: Mapping[str, Any]) -> None:
    """A model's `managed_collision={...}`, when the model is made: MCHManagedCollisionModule arguments only, and values
    its own checks take (before any table is drawn)."""
    unknown = sorted(set(arguments) - set(_MCH_ARGS))
    if unknown:
        raise ValueError(f"managed_collision={dict(arguments)}: {unknown} are not MCHManagedCollisionModule "
                         f"arguments: give any of {', '.join(_MCH_ARGS)}")
    MCHManagedCollisionModule(2, **arguments)


def managed_collision_tables(ebc: EmbeddingBagCollection, arguments: Mapping[str, Any],
                             tables: Sequence[str] | None = None) -> ManagedCollisionEmbeddingBagCollection:
    """`ebc` read through one MCHManagedCollisionModule per table (those named in `tables`; None: every one), as big
    as the table, built with `arguments`; the other tables' features keep their ids."""
    check_managed_collision(arguments)
    configs = ebc.embedding_bag_configs()
    modules = {c.name: MCHManagedCollisionModule(c.num_embeddings, **arguments) for c in configs
               if tables is None or c.name in tables}
    return ManagedCollisionEmbeddingBagCollection(ebc, ManagedCollisionCollection(modules, configs))
