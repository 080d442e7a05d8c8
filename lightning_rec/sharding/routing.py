"""Where every feature's ids go, and where every shard's output lands: one collection's routing.

Legend: F features (the collection's output order), C copies, S shard features (all ranks, rank by rank), W world
size, D dims. Pure metadata, identical on every rank (from the plan and the configs only).

Every sharding type is a grid of column blocks x row blocks of a table:

    table_wise        1 block  x 1 row shard,  on one rank
    column_wise       k blocks x 1 row shard   (table_column_wise: the k ranks of one host)
    row_wise          1 block  x n row shards  (table_row_wise: n = the ranks of one host)
    grid_shard        k blocks x n row shards  (each column block row-wise over one host)
    data_parallel     a replica on every rank: its ids never travel

so one routing serves them all:

    feature f --(one copy per column block)--> copy --(row block of each id)--> shard feature
      ids of f                                  ids of f      id // block           on its rank,
                                                                                    id - owner*block

and on the way back a shard feature's pooled [B, cols] lands in its feature's output columns (row shards of one
block add up). Row shards follow `layout.row_block_size`, so an id's owner is one integer division."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_rec.lookup import LocalTable, group_tables
from lightning_rec.sharding.layout import row_block_size
from lightning_rec.types import ParameterSharding, ShardingType, ShardMetadata


@dataclass(frozen=True)
class ShardFeature:
    """One feature's ids as one shard sees them."""

    feature: str
    feature_index: int  # in the collection's output order
    table: str
    shard: ShardMetadata
    local_table: str  # name of the shard's LocalTable (and of its optimizer state)
    name: str  # the key this shard feature has in the owning rank's lookup

    @property
    def rank(self) -> int:
        return self.shard.placement

    @property
    def cols(self) -> int:
        return self.shard.shard_sizes[1]


@dataclass
class Routing:
    """Everything the data path needs to know about one sharded collection (see module docstring)."""

    world_size: int
    feature_names: list[str]  # output order
    feature_dims: list[int]
    pooled: bool
    mean_features: list[bool]  # pooled features whose table pools with mean (divided after the sum)
    rank_tables: list[list[LocalTable]]  # per rank: its shards, in lookup (group-major) order
    shard_features: list[ShardFeature]  # S, rank by rank, each rank in its lookup order
    rank_sf_counts: list[int]  # S_p per rank
    rank_dims: list[int]  # D_p per rank: width of its pooled lookup output
    dp_tables: list[LocalTable]  # data-parallel replicas, in lookup order
    dp_feature_index: list[int]  # output index of each data-parallel feature, lookup order
    copy_feature_index: list[int]  # C: the feature each copy reads
    copy_cols: list[tuple[int, int]]  # C: (col_offset, cols) of each copy's column block
    copy_row_block: list[int]  # C: rows per row shard (the table's rows when not split)
    copy_first: list[int]  # C: index into copy_shard_sf of the copy's first row shard
    copy_shard_sf: list[int]  # per (copy, row shard): global shard feature index, -1 when empty
    row_split: bool  # some table is split by rows: ids are bucketized, outputs summed
    table_shardings: dict[str, ParameterSharding] = field(default_factory=dict)
    pieces: dict[tuple[int, str], tuple[str, ShardMetadata]] = field(default_factory=dict)  # (rank, local) -> piece

    @property
    def num_routed(self) -> int:
        return len(self.shard_features)

    def rank_slice(self, rank: int) -> slice:
        start = sum(self.rank_sf_counts[:rank])
        return slice(start, start + self.rank_sf_counts[rank])

    def local_feature_names(self, rank: int) -> list[str]:
        return [sf.name for sf in self.shard_features[self.rank_slice(rank)]]

    def sf_feature_index(self) -> list[int]:
        """Per shard feature, the feature it reads (used when no table is split by rows)."""
        return [sf.feature_index for sf in self.shard_features]

    def output_columns(self) -> Tensor:
        """[D_all] where each column of [every rank's pooled output | data-parallel output] goes in [D]."""
        starts = [0]
        for d in self.feature_dims:
            starts.append(starts[-1] + d)
        cols: list[Tensor] = []
        for sf in self.shard_features:
            c0 = starts[sf.feature_index] + sf.shard.shard_offsets[1]
            cols.append(torch.arange(c0, c0 + sf.cols))
        for f in self.dp_feature_index:
            cols.append(torch.arange(starts[f], starts[f] + self.feature_dims[f]))
        return torch.cat(cols) if cols else torch.empty(0, dtype=torch.long)

    def max_dim(self) -> int:
        return max([sf.cols for sf in self.shard_features] + [0])


def _shard_suffix(shard: ShardMetadata, whole: bool) -> str:
    return "" if whole else f"@r{shard.shard_offsets[0]}c{shard.shard_offsets[1]}"


def _fused_kernel(kernel) -> str:
    """The plan's kernel for a sharded (fused) table; "dense" only makes sense for data parallel."""
    kernel = str(kernel)
    return kernel if kernel.startswith("fused") else "fused"


def _check_local_names(per_rank: Sequence[Sequence[LocalTable]], replicas: Sequence[LocalTable]) -> None:
    """A piece is named '<table>@r<row>c<col>': a table or feature already named so is refused, on every rank."""
    for rank, tables in enumerate(per_rank):
        for kind, names in (("table", [t.name for t in list(tables) + list(replicas)]),
                            ("feature", [f for t in list(tables) + list(replicas) for f in t.feature_names])):
            clash = sorted({n for n in names if names.count(n) > 1})
            if clash:
                raise ValueError(f"{kind} name(s) {clash} on rank {rank} are both a {kind} of the collection and the "
                                 f"name of a sharded piece ('<name>@r<row>c<col>'): rename the {kind}(s) (without "
                                 f"'@r..c..' at the end)")


def build_routing(configs: Sequence, feature_names: Sequence[str], table_plans: Mapping[str, ParameterSharding],
                  world_size: int, pooled: bool) -> Routing:
    """The routing of one collection, from its table configs, output order and validated `table_plans`."""
    by_feature = {f: c for c in configs for f in c.feature_names}
    f_index = {f: i for i, f in enumerate(feature_names)}
    dims = [by_feature[f].embedding_dim for f in feature_names]
    mean = [pooled and str(by_feature[f].pooling_name()) == "mean" for f in feature_names]
    pooling = "sum" if pooled else "none"  # mean = sum / bag length, applied after the reduction

    placed = _place_pieces(configs, table_plans, f_index, pooling, world_size)
    _check_local_names(placed.per_rank, placed.dp_tables)
    rank_tables = [[t for g in group_tables(ts) for t in g] for ts in placed.per_rank]
    shard_features: list[ShardFeature] = []
    counts, rank_dims = [], []
    for rank, tables in enumerate(rank_tables):
        sfs = [placed.shard_features[(n, rank)] for t in tables for n in t.feature_names]
        shard_features += sfs
        counts.append(len(sfs))
        rank_dims.append(sum(sf.cols for sf in sfs))
    global_index = {(sf.name, sf.rank): i for i, sf in enumerate(shard_features)}

    dp_groups = [t for g in group_tables(placed.dp_tables) for t in g]
    dp_feature_index = [f_index[f] for t in dp_groups for f in t.feature_names]
    return Routing(world_size=world_size, feature_names=list(feature_names), feature_dims=dims, pooled=pooled,
                   mean_features=mean, rank_tables=rank_tables, shard_features=shard_features, rank_sf_counts=counts,
                   rank_dims=rank_dims, dp_tables=dp_groups, dp_feature_index=dp_feature_index,
                   **_copy_plan(feature_names, by_feature, placed.blocks, table_plans, global_index),
                   table_shardings={c.name: table_plans[c.name] for c in configs}, pieces=placed.pieces)


@dataclass
class _Placed:
    """Every sharded table's pieces, by the rank that holds them, and the replicated tables."""

    per_rank: list[list[LocalTable]]  # rank -> its pieces, in the collection's table order
    shard_features: dict[tuple[str, int], ShardFeature]  # (piece's feature name, rank) -> the feature's piece
    pieces: dict[tuple[int, str], tuple[str, ShardMetadata]]  # (rank, piece name) -> (table, shard)
    dp_tables: list[LocalTable]
    blocks: dict[str, list[tuple[int, int, list[ShardMetadata]]]]  # table -> (first col, cols, row shards) per block


def _place_pieces(configs: Sequence, table_plans: Mapping[str, ParameterSharding], f_index: Mapping[str, int],
                  pooling: str, world_size: int) -> _Placed:
    placed = _Placed([[] for _ in range(world_size)], {}, {}, [], {})
    for cfg in configs:
        ps = table_plans[cfg.name]
        init = cfg.local_table().init_range()
        if ps.sharding_type == ShardingType.DATA_PARALLEL:
            placed.dp_tables.append(LocalTable(cfg.name, cfg.num_embeddings, cfg.embedding_dim,
                                               tuple(cfg.feature_names), pooling, cfg.data_type, init))
            continue
        whole = len(ps.shards) == 1
        by_col: dict[int, list[ShardMetadata]] = {}
        for s in ps.shards:
            by_col.setdefault(s.shard_offsets[1], []).append(s)
        placed.blocks[cfg.name] = [(c, v[0].shard_sizes[1], sorted(v, key=lambda s: s.shard_offsets[0]))
                                   for c, v in sorted(by_col.items())]
        for s in ps.shards:
            if s.shard_sizes[0] == 0:
                continue  # a trailing row shard the block rule left empty: no id ever goes there
            suffix = _shard_suffix(s, whole)
            names = tuple(f"{f}{suffix}" for f in cfg.feature_names)
            table = LocalTable(f"{cfg.name}{suffix}", s.shard_sizes[0], s.shard_sizes[1], names, pooling,
                               cfg.data_type, init, _fused_kernel(ps.compute_kernel), ps.cache_load_factor)
            placed.per_rank[s.placement].append(table)
            placed.pieces[(s.placement, table.name)] = (cfg.name, s)
            for f, n in zip(cfg.feature_names, names):
                placed.shard_features[(n, s.placement)] = ShardFeature(f, f_index[f], cfg.name, s, table.name, n)
    return placed


def _copy_plan(feature_names: Sequence[str], by_feature: Mapping[str, Any],
               blocks: Mapping[str, list[tuple[int, int, list[ShardMetadata]]]],
               table_plans: Mapping[str, ParameterSharding], global_index: Mapping[tuple[str, int], int]) -> dict:
    """Routing's copy_* fields: where each sharded feature's column blocks come back from (in output order)."""
    copy_feature, copy_cols, copy_block, copy_first, copy_sf = [], [], [], [], []
    row_split = False
    f_index = {f: i for i, f in enumerate(feature_names)}
    for f in feature_names:
        cfg = by_feature[f]
        if cfg.name not in blocks:
            continue
        whole = len(table_plans[cfg.name].shards) == 1
        for col, cols, row_shards in blocks[cfg.name]:
            copy_feature.append(f_index[f])
            copy_cols.append((col, cols))
            copy_block.append(row_block_size(cfg.num_embeddings, len(row_shards)))
            copy_first.append(len(copy_sf))
            row_split |= len(row_shards) > 1
            for s in row_shards:
                key = (f"{f}{_shard_suffix(s, whole)}", s.placement)
                copy_sf.append(global_index[key] if s.shard_sizes[0] else -1)
    return dict(copy_feature_index=copy_feature, copy_cols=copy_cols, copy_row_block=copy_block,
                copy_first=copy_first, copy_shard_sf=copy_sf, row_split=row_split)
