"""Managed-collision id maps sharded with their tables: each rank keeps the map of the row shards it holds.

Legend: Z zch_size, C candidate slots, k row shards of a table, o_j the first row of row shard j.

    forward   raw ids --(id all-to-all, routed by value: owner_of(id, k), sharding/ids.py)--> owner of shard j
              owner: profile (counts, admission, eviction every eviction_interval) and remap to its rows, then the
              lookup; rows handed to a new id are re-drawn there (weights and fused optimizer state)

Row shard j manages rows [o_j, min(o_j + rows_j, Z) - 1) and reads unknown ids from the row after them: every owner
has its own unknown row. Its map is an MCHManagedCollisionModule of its own (zch_size = min(o_j + rows_j, Z) - o_j);
the pieces of one row shard in several column blocks (column-wise, grid) keep equal maps (they see the same ids).

State: under the unsharded module's keys, the row-indexed buffers (`_row_ids`, counters, ...: [Z - 1]) are
ShardedTensors whose piece j covers positions [o_j, ...) (the owner's rows; an owner's unknown row reads as free),
the candidates ([C]) split evenly over the row shards. Loading at another world size or plan reads pieces by position
(DCP), then `state_loaded` re-homes: every (id, counters, row content) whose owner changed under the new layout moves
to its owner, which gives it a free row (one gather of the moving entries). The unsharded module loads the same
checkpoint (it rebuilds its map from the rows' ids)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lightning_rec.comm import all_gather_object, distributed
from lightning_rec.managed_collision.collection import _ManagedCollisionBase, reinit_rows, zero_optimizer_rows
from lightning_rec.managed_collision.mch import (
    _FREE,
    _NO_ID,
    KeySpans,
    MCHManagedCollisionModule,
    TableGroup,
    _gather,
    owner_of,
    remap_tables,
)
from lightning_rec.sharded_embedding import ShardingEnv, _ShardedCollectionBase
from lightning_rec.sharding.layout import split_evenly
from lightning_rec.sharding.sharded_tensor import ShardedTensor
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.types import ShardingType, ShardMetadata

_ROW_BUFFERS = {"_row_ids": _FREE, "_counts": 0, "_last_seen": -1, "_reused": False, "_sorted_ids": _NO_ID,
                "_sorted_rows": 0}
_CAND_BUFFERS = {"_cand_ids": _NO_ID, "_cand_counts": 0, "_cand_last": 0}


@dataclass
class _Owner:
    """Row shard `shard` of a table on this rank: its map and where its state sits in the global buffers."""

    shard: int
    first_row: int  # o_j: the map's row r is the table's row o_j + r
    module: MCHManagedCollisionModule
    rows_at: tuple[int, int]  # (first position, length) in the row-indexed buffers
    cands_at: tuple[int, int]  # (first position, length) in the candidate buffers
    keys: list[int] = field(default_factory=list)  # routed keys of every piece of this row shard here
    profile_keys: list[int] = field(default_factory=list)  # those of one piece (the copies carry the same ids)
    export: dict[str, Tensor] = field(default_factory=dict)  # the state as saved: row-indexed and candidate pieces
    sends_map: bool = True  # holds the first column block of its row shard (re-homing sends its entries)


def _row_shards(collection: _ShardedCollectionBase, table: str) -> list[tuple[int, int]]:
    """(first row, rows) of each non-empty row shard of `table`, by row (those of its first column block)."""
    shards = collection.routing.table_shardings[table].shards
    col = min(s.shard_offsets[1] for s in shards)
    return sorted((s.shard_offsets[0], s.shard_sizes[0]) for s in shards
                  if s.shard_offsets[1] == col and s.shard_sizes[0] > 0)


class _Clock:
    """Training steps counted once for tables that step together (a sharded collection's)."""

    __slots__ = ("ticks",)

    def __init__(self) -> None:
        self.ticks = 0


class ShardedMCHModule(nn.Module):
    """One table's id map, split with its rows: the maps of this rank's row shards (see the module docstring).

    It stands where the table's MCHManagedCollisionModule stood (the same state-dict keys) and offers its
    accessors: `metrics()`, `id_map()` (this rank's ids and their table rows), `open_slots()`."""

    def __init__(self, full: MCHManagedCollisionModule, table: str, collection: _ShardedCollectionBase,
                 env: ShardingEnv) -> None:
        super().__init__()
        self._table, self._env = table, env
        object.__setattr__(self, "_collection", collection)  # not a child: its state is the collection's own
        zch, cands = full.output_size(), full._cand_ids.numel()
        self._zch_size, self._cand_size = zch, cands
        shards = _row_shards(collection, table)
        self._num_shards = k = len(shards)
        for j, (o, n) in enumerate(shards):
            if min(o + n, zch) - o < 2:
                raise ValueError(f"managed-collision table '{table}' (zch_size={zch}) is split into {k} row shards and "
                                 f"row shard {j} (rows {o}:{o + n}) holds {max(0, min(o + n, zch) - o)} of its rows: "
                                 f"each row shard manages its own ids and needs 2 rows at least (one for unknown "
                                 f"ids): use zch_size = num_embeddings ({collection._global_shape(table)[0]}) or "
                                 f"fewer row shards")
        if cands < k:
            raise ValueError(f"managed-collision table '{table}': max_candidates={cands} is below its {k} row shards: "
                             f"each shard keeps candidates of its own; use max_candidates >= {k}")
        sizes = split_evenly(cands, k)
        starts = [sum(sizes[:j]) for j in range(k)]
        self.register_buffer("_step", full._step.detach().clone().to(env.device))
        self._clock, self._step_base = _Clock(), int(full._step)  # the step, counted on the host
        self.register_buffer("_evictions_total", torch.zeros((), dtype=torch.int64, device=env.device))
        mine = self._pieces_here(shards)
        self._owners: list[_Owner] = []
        for j in sorted(mine):
            o, n = shards[j]
            z = min(o + n, zch) - o
            module = MCHManagedCollisionModule(
                z, env.device, full._eviction_policy, full._eviction_interval, full._min_count, full._churn_warning,
                name=table, max_candidates=sizes[j])
            owner = _Owner(j, o, module, (o, min(z, zch - 1 - o)), (starts[j], sizes[j]))
            for _, keys in mine[j]:
                owner.keys += keys
            owner.profile_keys = mine[j][0][1]
            owner.sends_map = mine[j][0][0] == min(s.shard_offsets[1] for s in collection.routing.table_shardings[
                table].shards)
            owner.export = {name: torch.full((owner.rows_at[1],), fill, dtype=getattr(full, name).dtype,
                                             device=env.device) for name, fill in _ROW_BUFFERS.items()}
            owner.export.update({name: torch.full((sizes[j],), fill, dtype=getattr(full, name).dtype,
                                                  device=env.device) for name, fill in _CAND_BUFFERS.items()})
            self._owners.append(owner)
        self._layout = {j: (o, min(min(o + n, zch) - o, zch - 1 - o)) for j, (o, n) in enumerate(shards)}
        self._cand_layout = {j: (starts[j], sizes[j]) for j in range(k)}
        self._positional(full.state_dict())

    def _pieces_here(self, shards: list[tuple[int, int]]) -> dict[int, list[tuple[int, list[int]]]]:
        """Row shard -> [(column offset, its routed key indices)] of the pieces of this table on this rank."""
        routing, rank = self._collection.routing, self._env.rank
        first = {o: j for j, (o, _) in enumerate(shards)}
        names = routing.local_feature_names(rank)
        out: dict[int, list[tuple[int, list[int]]]] = {}
        for sf in routing.shard_features[routing.rank_slice(rank)]:
            if sf.table != self._table:
                continue
            (r, c) = sf.shard.shard_offsets
            pieces = out.setdefault(first[r], [])
            if not pieces or pieces[-1][0] != c:
                pieces.append((c, []))
            pieces[-1][1].append(names.index(sf.name))
        return {j: sorted(p) for j, p in out.items()}

    # -- state ----------------------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self._step_base + self._clock.ticks

    def _set_step(self, step: int) -> None:
        self._step_base = step - self._clock.ticks

    def share_clock(self, clock: _Clock) -> None:
        """Counts its steps on `clock`, which advances with the other tables' of its collection."""
        step, self._clock = self.step, clock
        self._set_step(step)

    def _positional(self, state: dict) -> None:
        """Each owner's pieces of full (row-indexed / candidate) buffers, by position."""
        for owner in self._owners:
            for name, t in owner.export.items():
                a, n = owner.rows_at if name in _ROW_BUFFERS else owner.cands_at
                t.copy_(state[name][a:a + n])
        self._step.copy_(state["_step"])
        self._set_step(int(self._step))

    @torch.no_grad()
    def _sync_export(self) -> None:
        """Each owner's map into its saved pieces (row positions of the table; the unknown row reads as free)."""
        for owner in self._owners:
            m, e, n = owner.module, owner.export, owner.module.output_size() - 1
            for name, fill in _ROW_BUFFERS.items():
                e[name].fill_(fill)
            for name in ("_row_ids", "_counts", "_last_seen", "_reused"):
                e[name][:n] = getattr(m, name)
            ids, rows = m.id_map()
            e["_sorted_ids"][: ids.numel()], e["_sorted_rows"][: ids.numel()] = ids, rows + owner.first_row
            for name in _CAND_BUFFERS:
                e[name].copy_(getattr(m, name))

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        self._sync_export()
        for name in list(_ROW_BUFFERS) + list(_CAND_BUFFERS):
            rows = name in _ROW_BUFFERS
            layout = self._layout if rows else self._cand_layout
            every = [ShardMetadata((a,), (n,), -1) for a, n in layout.values()]
            mine = [(ShardMetadata(((o.rows_at if rows else o.cands_at)[0],),
                                   ((o.rows_at if rows else o.cands_at)[1],), self._env.rank), o.export[name])
                    for o in self._owners]
            size = self._zch_size - 1 if rows else self._cand_size
            destination[prefix + name] = ShardedTensor((size,), mine, every)
        self._step.fill_(self.step)
        destination[prefix + "_step"] = self._step if keep_vars else self._step.detach()
        total = sum(int(o.module._evictions_total) for o in self._owners)
        destination[prefix + "_evictions_total"] = self._evictions_total.fill_(total)

    @torch.no_grad()
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        names = list(_ROW_BUFFERS) + list(_CAND_BUFFERS) + ["_step", "_evictions_total"]
        absent = [prefix + n for n in names if prefix + n not in state_dict]
        missing_keys.extend(absent)
        if absent:
            return
        saved = state_dict[prefix + "_row_ids"]
        if tuple(saved.shape) != (self._zch_size - 1,):
            error_msgs.append(f"managed-collision table '{self._table}': the checkpoint's id map has "
                              f"{saved.shape[0] + 1} rows (zch_size), this module {self._zch_size}: build it with "
                              f"zch_size={saved.shape[0] + 1} to load it")
            return
        for owner in self._owners:
            for name, t in owner.export.items():
                a, n = owner.rows_at if name in _ROW_BUFFERS else owner.cands_at
                t.copy_(_read(state_dict[prefix + name], a, n, f"'{prefix + name}'"))
        self._step.copy_(state_dict[prefix + "_step"])
        self._set_step(int(self._step))

    @torch.no_grad()
    def state_loaded(self) -> None:
        """Collective: the loaded pieces become the owners' maps, and every id whose owner changed (another world
        size or plan) moves to it with its counters and row content. Idempotent for the maps; the record of which ids
        moved (optimizer_state_loaded reads it) is the last call's: one call per load."""
        leaving, content = [], []
        self._moved_out, self._moved_in = [], []  # what the optimizer state's load then moves the same way
        self._set_step(int(self._step))  # a DCP load writes the buffer in place
        for owner in self._owners:
            m, e = owner.module, owner.export
            n = m.output_size() - 1
            for name in ("_row_ids", "_counts", "_last_seen", "_reused"):
                getattr(m, name).copy_(e[name][:n])
            m._step.copy_(self._step)
            m._pending_rows = []
            waiting = e["_cand_ids"] != _NO_ID
            m.set_candidates(*(e[c][waiting] for c in _CAND_BUFFERS))
            m.weights_written()
            extra = e["_row_ids"][n:]  # the position of this owner's unknown row: an id there moves
            rows, ids, counts, last, reused = m.entries()
            away = owner_of(ids, self._num_shards) != owner.shard
            if extra.numel() and int(extra[0]) != _FREE:
                ids, rows = torch.cat([ids[away], extra[:1]]), torch.cat([rows[away], rows.new_tensor([n])])
                counts = torch.cat([counts[away], e["_counts"][n:n + 1]])
                last = torch.cat([last[away], e["_last_seen"][n:n + 1]])
                reused = torch.cat([reused[away], e["_reused"][n:n + 1]])
            else:
                ids, rows, counts, last, reused = ids[away], rows[away], counts[away], last[away], reused[away]
            kept = owner_of(m.candidates()[0], self._num_shards) == owner.shard
            if owner.sends_map:  # one holder per row shard: its column replicas hold the same map
                leaving.append((ids.cpu(), counts.cpu(), last.cpu(), reused.cpu(),
                                *(t[~kept].cpu() for t in m.candidates())))
            content += [(c0, ids.cpu(), w[rows.to(w.device)].cpu()) for c0, w in self._views(owner)]
            self._moved_out.append((owner.first_row, ids.cpu(), rows.cpu()))
            m.release(rows[rows < n])
            m.set_candidates(*(t[kept] for t in m.candidates()))
        every = all_gather_object((leaving, content), group=self._env.pg, device=self._env.device,
                                  tag="managed-collision id maps") if distributed() else [(leaving, content)]
        self._adopt(every)
        self._sync_export()

    def _adopt(self, every: list) -> None:
        """Each owner takes the moving ids that route to it, with their counters and row content."""
        if not any(entries for entries, _ in every):
            return
        moving = [torch.cat(parts) for parts in zip(*[e for entries, _ in every for e in entries])]
        ids, counts, last, reused, cand_ids, cand_counts, cand_last = moving
        rows_of = {}  # column offset -> (ids, rows of content)
        for _, content in every:
            for c0, cids, rows in content:
                old = rows_of.get(c0)
                rows_of[c0] = (cids, rows) if old is None else (torch.cat([old[0], cids]), torch.cat([old[1], rows]))
        dropped = 0
        for owner in self._owners:
            m, dev = owner.module, owner.module._row_ids.device
            here = owner_of(ids, self._num_shards) == owner.shard
            order, rows = m.adopt(*(t[here].to(dev) for t in (ids, counts, last, reused)))
            dropped += int(here.sum()) - order.numel()
            taken = ids[here][order.cpu()]
            for c0, w in self._views(owner) if taken.numel() else []:
                cids, content = rows_of[c0]  # each moving id's row, from the piece of this column block
                sorted_ids, index = torch.sort(cids)
                w[rows.to(w.device)] = content[index[torch.searchsorted(sorted_ids, taken)]].to(w)
            if rows.numel():
                zero_optimizer_rows(self._collection, {self._table: rows + owner.first_row})
                self._moved_in.append((owner.first_row, taken, rows.cpu()))
            c_here = owner_of(cand_ids, self._num_shards) == owner.shard
            mine = m.candidates()
            m.set_candidates(*(torch.cat([a.to(dev), b[c_here].to(dev)])
                               for a, b in zip(mine, (cand_ids, cand_counts, cand_last))))
        self._collection.weights_written()
        if dropped:
            warnings.warn(f"managed-collision table '{self._table}': {dropped} id(s) of the loaded map found no free "
                          f"row on their owner under this layout and were left out (they start again as new ids): "
                          f"a larger zch_size keeps them", stacklevel=3)

    @torch.no_grad()
    def optimizer_state_loaded(self) -> None:
        """Collective, after the fused optimizer state loaded by row position: the state rows of the ids that moved
        at the model's load move with them (load_model, then load_optimizer)."""
        moved_out, moved_in = self.__dict__.pop("_moved_out", []), self.__dict__.pop("_moved_in", [])
        sent = [(first, c0, name, ids, v[rows.to(v.device)].cpu()) for first, ids, rows in moved_out
                for first_row, c0, states in self._state_pieces() if first_row == first
                for name, v in states.items()]
        every = all_gather_object(sent, group=self._env.pg, device=self._env.device,
                                  tag="managed-collision optimizer rows") if distributed() else [sent]
        by_key: dict[tuple[int, str], list] = {}
        for part in every:
            for _, c0, name, ids, values in part:
                by_key.setdefault((c0, name), []).append((ids, values))
        for first, taken, rows in moved_in:
            for first_row, c0, states in self._state_pieces():
                for name, v in states.items() if first_row == first else ():
                    got = by_key.get((c0, name))
                    if got is None:
                        continue
                    ids, values = torch.cat([g[0] for g in got]), torch.cat([g[1] for g in got])
                    sorted_ids, index = torch.sort(ids)
                    at = torch.searchsorted(sorted_ids, taken).clamp_(max=max(ids.numel() - 1, 0))
                    ok = sorted_ids[at] == taken if ids.numel() else torch.zeros_like(taken, dtype=torch.bool)
                    v[rows[ok].to(v.device)] = values[index[at[ok]]].to(v)

    def _state_pieces(self) -> list[tuple[int, int, dict[str, Tensor]]]:
        """(first row, column offset, per-row fused optimizer state views) of this table's pieces here."""
        out = []
        for kernel in self._collection.fused_kernels():
            for t, state in zip(kernel.tables, kernel.optimizer_states()):
                table, meta, _ = self._collection.shard_of(t.name)
                if table == self._table and meta is not None:
                    per_row = {k: v for k, v in state.items() if v.dim() >= 1 and v.shape[0] == t.num_embeddings}
                    out.append((meta.shard_offsets[0], meta.shard_offsets[1], per_row))
        return out

    def _views(self, owner: _Owner) -> list[tuple[int, Tensor]]:
        """(column offset, [rows, cols] weight view) of this rank's pieces of the owner's row shard."""
        return [(meta.shard_offsets[1], w) for meta, w in self._collection.local_shards().get(self._table, [])
                if meta.shard_offsets[0] == owner.first_row]

    # -- the owner's step ---------------------------------------------------------------------------------------
    def check_ids(self, values: Tensor, offsets: list[int]) -> None:
        """The raw ids this rank's owners profile (when the collection did not check them before the all-to-all)."""
        for owner in self._owners:
            owner.module.check_ids(_gather(values, [(offsets[i], offsets[i + 1]) for i in owner.profile_keys]))

    def fresh_rows(self, owner: _Owner) -> tuple[str, Tensor, int, str, int]:
        """The rows `owner` handed to a new id since the last call, to re-draw: (table, table rows, step, seed name,
        first row of their row shard)."""
        reused, o = owner.module.take_reused_rows(), owner.first_row
        seed = self._table if o == 0 else f"{self._table}@{o}"
        return self._table, reused + o if o else reused, owner.module._now(), seed, o

    # -- what the unsharded module offers -------------------------------------------------------------------------
    def output_size(self) -> int:
        return self._zch_size

    def take_reused_rows(self) -> None:
        return None  # re-drawn on the owners, in the lookup

    def id_map(self) -> tuple[Tensor, Tensor]:
        """(raw ids, their table rows) that this rank's row shards hold, sorted by id."""
        parts = [(ids, rows + o.first_row) for o in self._owners for ids, rows in [o.module.id_map()]]
        if not parts:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
        ids, order = torch.sort(torch.cat([p[0] for p in parts]))
        return ids, torch.cat([p[1] for p in parts])[order]

    def open_slots(self) -> Tensor:
        return sum((o.module.open_slots() for o in self._owners), torch.zeros((), dtype=torch.int64))

    def metrics(self) -> dict[str, float]:
        """This rank's row shards together: fill ratio, evictions at the last run, share of reused-row lookups."""
        if not self._owners:
            return {"fill_ratio": 0.0, "evictions_per_interval": 0.0, "reused_row_lookup_share": 0.0}
        ms = [o.module for o in self._owners]
        managed = sum(m._row_ids.numel() for m in ms)
        counts = [m._host.take_lookups() for m in ms]
        reused, lookups = sum(c[0] for c in counts), sum(c[1] for c in counts)
        out = {"fill_ratio": sum(float((m._row_ids != _FREE).sum()) for m in ms) / managed,
               "evictions_per_interval": float(sum(m._host.last_evictions for m in ms)),
               "reused_row_lookup_share": float(reused) / lookups if lookups else 0.0}
        return out


def _read(value, first: int, n: int, what: str) -> Tensor:
    """Positions [first, first + n) of a 1-D tensor, or of a 1-D ShardedTensor from the pieces it holds."""
    return value.read_positions(first, n, what) if isinstance(value, ShardedTensor) else value[first:first + n]


class _OwnerRemap:
    """The sharded collection's remap after the id all-to-all: every owner table's raw ids -> this rank's rows."""

    def __init__(self, tables: list[ShardedMCHModule], collection: _ShardedCollectionBase) -> None:
        self.tables, self.collection, self.clock = tables, collection, _Clock()
        for t in tables:
            t.share_clock(self.clock)
        self.owners = [(t, o) for t in tables for o in t._owners]
        owners = [o for _, o in self.owners]
        self.group = TableGroup([o.module for o in owners])
        self.spans = KeySpans([o.keys for o in owners])  # the routed keys each owner remaps
        profile_keys = [o.profile_keys for o in owners]  # and profiles (one piece per row shard)
        # no column-wise copies: the profile is the remap
        self.profile_spans = self.spans if self.spans.keys == profile_keys else KeySpans(profile_keys)

    def __call__(self, routed: KeyedJaggedTensor) -> KeyedJaggedTensor:
        values, lengths, K, B = routed.values(), routed.lengths(), len(routed.keys()), routed.stride()
        # the keys' lengths as they are (their offsets in C++: no host sum of them here)
        key_lengths = lengths.view(K, B) if lengths.numel() == K * B else \
            torch.tensor(routed.length_per_key()).view(K, 1)
        out = values.clone()
        training = self.tables[0].training
        modules = self.group.modules
        if modules and modules[0].training != training:
            for m in modules:
                m.training = training
        if training:  # every rank, past the batch check: the step its owners' maps are at
            self.clock.ticks += 1
            if not self.collection.validate_ids:  # else checked on every rank before the all-to-all
                for t in self.tables:
                    t.check_ids(values, routed.offset_per_key())
        profile = (values, None, self.profile_spans) if training else None
        handed = remap_tables(self.group, values, out, self.spans, profile, training, key_lengths=key_lengths)
        fresh = [t.fresh_rows(o) for t, o in self.owners if o.module._pending_rows] if handed else []
        while fresh:  # one re-draw for all tables (a table twice here: in a call of its own)
            now, seen, later = [], set(), []
            for f in fresh:
                (later if f[0] in seen else now).append(f)
                seen.add(f[0])
            reinit_rows(self.collection, {f[0]: f[1] for f in now}, {f[0]: f[2] for f in now},
                        seed_names={f[0]: f[3] for f in now}, first_rows={f[0]: f[4] for f in now})
            fresh = later
        return KeyedJaggedTensor(routed.keys(), out, routed.weights_or_none(), lengths=lengths,
                                 offsets=routed.offsets_or_none(), stride=B,
                                 length_per_key=routed.length_per_key_or_none(),
                                 offset_per_key=routed.offset_per_key_or_none(), _validate=False)


def shard_managed_collision(model: nn.Module, env: ShardingEnv) -> None:
    """Collective: every managed-collision collection whose tables DistributedModelParallel sharded keeps, per
    rank, the maps of the row shards it holds (their state moved there from the unsharded maps); tables planned
    data-parallel keep the replicated map."""
    for mc in [m for m in model.modules() if isinstance(m, _ManagedCollisionBase)]:
        collection = mc._embedding_module
        if not isinstance(collection, _ShardedCollectionBase):
            continue
        mcc = mc._managed_collision_collection
        shardings = collection.routing.table_shardings
        tables = [t for t in mcc._table_features if shardings[t].sharding_type != ShardingType.DATA_PARALLEL]
        if not tables:
            continue
        if mc._return_remapped_features:
            raise ValueError(f"{type(mc).__name__}(return_remapped_features=True) under DistributedModelParallel: "
                             f"the rows of tables {tables} are chosen on the ranks that own them, after the id "
                             f"all-to-all, so this rank never sees them: build it with return_remapped_features=False "
                             f"(or plan those tables data_parallel)")
        modules = mcc._managed_collision_modules
        sharded = []
        for t in tables:
            sharded.append(ShardedMCHModule(modules[t], t, collection, env))
            modules[t] = sharded[-1]
        mcc.remap_on_owners(frozenset(tables))
        collection.remap_on_owners(frozenset(tables), _OwnerRemap(sharded, collection))
        for s in sharded:
            s.state_loaded()
        mc.register_load_state_dict_post_hook(_LoadedHook(sharded))


class _LoadedHook:
    """After load_state_dict has read a managed-collision collection and its table: the maps re-home (collective)."""

    def __init__(self, tables: list[ShardedMCHModule]) -> None:
        self.tables = tables

    def __call__(self, module: nn.Module, incompatible_keys) -> None:
        for t in self.tables:
            t.state_loaded()
