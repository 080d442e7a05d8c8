"""TorchRec's managed-collision collections: raw ids remapped per table, then looked up in an EBC / EC."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingCollection
from lightning_rec.embedding_configs import BaseEmbeddingConfig
from lightning_rec.managed_collision.mch import MCHManagedCollisionModule
from lightning_rec.sparse import KeyedJaggedTensor


class ManagedCollisionCollection(nn.Module):
    """One MCHManagedCollisionModule per table: forward(KJT of raw ids) -> KJT of rows (TorchRec's name).

    Each table's features are remapped together (one profile per table and step). Features of tables without a
    module pass through unchanged."""

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

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        keys = features.keys()
        index = {k: i for i, k in enumerate(keys)}
        offsets = features.offset_per_key()
        values = features.values()
        out = values.clone()
        for table, names in self._table_features.items():
            spans = [(offsets[index[f]], offsets[index[f] + 1]) for f in names if f in index]
            if not spans:
                continue
            pieces = [values[a:b] for a, b in spans]
            rows = self._managed_collision_modules[table](torch.cat(pieces) if len(pieces) > 1 else pieces[0])
            at = 0
            for a, b in spans:
                out[a:b] = rows[at:at + b - a]
                at += b - a
        return KeyedJaggedTensor(keys, out, features.weights_or_none(), lengths=features.lengths(),
                                 offsets=features.offsets_or_none(), stride=features.stride(),
                                 length_per_key=features.length_per_key(), offset_per_key=offsets, _validate=False)

    def modules_by_table(self) -> dict[str, MCHManagedCollisionModule]:
        return dict(self._managed_collision_modules.items())

    def take_reused_rows(self) -> dict[str, Tensor]:
        out = {}
        for table, module in self._managed_collision_modules.items():
            rows = module.take_reused_rows()
            if rows is not None:
                out[table] = rows
        return out

    def metrics(self) -> dict[str, float]:
        """`mc/<table>/<metric>` for every table (see MCHManagedCollisionModule.metrics)."""
        return {f"mc/{t}/{k}": v for t, m in self._managed_collision_modules.items() for k, v in m.metrics().items()}


@torch.no_grad()
def reinit_rows(collection: EmbeddingBagCollection | EmbeddingCollection, reused: Mapping[str, Tensor]) -> None:
    """Draws the reused rows' weights again (init_fn or the init range) and zeroes their fused optimizer state."""
    if not reused:
        return
    params = collection.table_parameters()
    configs = {c.name: c for c in collection._configs}
    for table, rows in reused.items():
        c, w = configs[table], params[table]
        fresh = torch.empty(rows.numel(), w.shape[1], dtype=w.dtype, device=w.device)
        if c.init_fn is not None:
            c.init_fn(fresh)
        else:
            fresh.uniform_(*c.local_table().init_range())
        w[rows.to(w.device)] = fresh
    for kernel in collection.lookup.fused_kernels():
        for t, state in zip(kernel.tables, kernel.optimizer_states()):
            if t.name in reused:
                for v in state.values():
                    if v.dim() >= 1 and v.shape[0] == t.num_embeddings:
                        v[reused[t.name].to(v.device)] = 0
    collection.lookup.weights_written()


class _ManagedCollisionBase(nn.Module):
    def __init__(self, collection: nn.Module, managed_collision_collection: ManagedCollisionCollection,
                 return_remapped_features: bool) -> None:
        super().__init__()
        configs = {c.name: c for c in collection._configs}
        for table in managed_collision_collection._table_features:
            if table not in configs:
                raise ValueError(f"{type(self).__name__}: the managed-collision table '{table}' is not one of the "
                                 f"collection's tables {sorted(configs)}")
        self._managed_collision_collection = managed_collision_collection
        self._return_remapped_features = return_remapped_features

    def _remap(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        remapped = self._managed_collision_collection(features)
        reinit_rows(self._embedding_module, self._managed_collision_collection.take_reused_rows())
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
