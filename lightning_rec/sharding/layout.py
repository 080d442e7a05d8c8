"""Where each piece of a table sits: sharding type + ranks -> list of ShardMetadata. Pure math.

Shared by the sharder and the planner, so both agree on every shard's size. Row-wise splits use TorchRec's block
rule: block = ceil(rows / n) rows per rank, owner = `row // block`; the last ranks may hold fewer rows, or none.

    row_wise over 3 ranks, 10 rows:      column_wise over 2 ranks, dim 8:
      rank 0: rows 0:4                     rank a: cols 0:4
      rank 1: rows 4:8                     rank b: cols 4:8
      rank 2: rows 8:10
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_rec.types import ShardingType, ShardMetadata


def row_block_size(num_rows: int, num_shards: int) -> int:
    """Rows per row-wise shard (the last shards may hold fewer)."""
    return max(1, -(-num_rows // num_shards))


def split_evenly(total: int, parts: int) -> list[int]:
    """`total` split into `parts` sizes that differ by at most one, larger first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def host_ranks(host_index: int, local_world_size: int, world_size: int) -> list[int]:
    ranks = list(range(host_index * local_world_size, (host_index + 1) * local_world_size))
    if host_index < 0 or ranks[-1] >= world_size:
        num_hosts = world_size // local_world_size
        raise ValueError(f"host_index={host_index} does not exist: world_size={world_size} with "
                         f"local_world_size={local_world_size} gives hosts 0..{num_hosts - 1}")
    return ranks


def _row_shards(rows: int, col_offset: int, cols: int, ranks: Sequence[int]) -> list[ShardMetadata]:
    block = row_block_size(rows, len(ranks))
    shards = []
    for i, rank in enumerate(ranks):
        start = min(i * block, rows)
        end = min(start + block, rows)
        shards.append(ShardMetadata((start, col_offset), (end - start, cols), rank))
    return shards


def _column_sizes(dim: int, parts: int, column_sizes: Sequence[int] | None, table: str) -> list[int]:
    if column_sizes is None:
        if parts > dim:
            raise ValueError(f"table '{table}' has dim {dim} but is split into {parts} column blocks: "
                             f"use fewer ranks for its column split, or table_wise")
        return split_evenly(dim, parts)
    sizes = list(column_sizes)
    if len(sizes) != parts or sum(sizes) != dim or min(sizes) <= 0:
        raise ValueError(
            f"table '{table}': column sizes {sizes} must be {parts} positive numbers adding up to its "
            f"dim {dim}: fix the column sizes (size_per_rank= in the plan verbs, column_sizes= here), or leave "
            f"them out to split the columns evenly"
        )
    return sizes


def shard_layout(table: str, num_rows: int, dim: int, sharding_type: ShardingType, world_size: int, *,
                 ranks: Sequence[int] | None = None, local_world_size: int | None = None,
                 host_indexes: Sequence[int] | None = None,
                 column_sizes: Sequence[int] | None = None) -> list[ShardMetadata]:
    """The shards of one table. `ranks` / `host_indexes` say where; defaults spread over everything.

    - table_wise: `ranks=[r]` (default rank 0)
    - row_wise: all ranks, or `ranks`
    - column_wise: one column block per entry of `ranks` (a rank may repeat)
    - table_row_wise / table_column_wise: the ranks of `host_indexes[0]`
    - grid_shard: one column block per host in `host_indexes`, each block row-wise over that host
    - data_parallel: a full replica on every rank
    """
    st = ShardingType(sharding_type)
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    lws = local_world_size or world_size
    if world_size % lws:
        raise ValueError(f"world_size={world_size} is not a multiple of local_world_size={lws}")
    for r in ranks or ():
        if not 0 <= r < world_size:
            raise ValueError(f"table '{table}' is placed on rank {r} but world_size={world_size}: "
                             f"use ranks in 0..{world_size - 1}")
    if st == ShardingType.DATA_PARALLEL:
        return [ShardMetadata((0, 0), (num_rows, dim), r) for r in range(world_size)]
    if st == ShardingType.TABLE_WISE:
        rank = (ranks or [0])[0]
        return [ShardMetadata((0, 0), (num_rows, dim), rank)]
    if st == ShardingType.ROW_WISE:
        owners = list(ranks) if ranks else list(range(world_size))
        _check_rows(table, num_rows, len(owners), st)
        return _row_shards(num_rows, 0, dim, owners)
    if st == ShardingType.COLUMN_WISE:
        owners = list(ranks) if ranks else list(range(world_size))
        sizes = _column_sizes(dim, len(owners), column_sizes, table)
        return _column_shards(num_rows, sizes, owners)
    hosts = list(host_indexes) if host_indexes else [0]
    if st == ShardingType.TABLE_ROW_WISE:
        owners = host_ranks(hosts[0], lws, world_size)
        _check_rows(table, num_rows, len(owners), st)
        return _row_shards(num_rows, 0, dim, owners)
    if st == ShardingType.TABLE_COLUMN_WISE:
        owners = host_ranks(hosts[0], lws, world_size)
        sizes = _column_sizes(dim, len(owners), column_sizes, table)
        return _column_shards(num_rows, sizes, owners)
    if st == ShardingType.GRID_SHARD:
        sizes = _column_sizes(dim, len(hosts), column_sizes, table)
        shards, col = [], 0
        for host, cols in zip(hosts, sizes):
            owners = host_ranks(host, lws, world_size)
            _check_rows(table, num_rows, len(owners), st)
            shards += _row_shards(num_rows, col, cols, owners)
            col += cols
        return shards
    raise AssertionError(f"unhandled sharding type {st}")


def _column_shards(num_rows: int, sizes: Sequence[int], owners: Sequence[int]) -> list[ShardMetadata]:
    shards, col = [], 0
    for rank, cols in zip(owners, sizes):
        shards.append(ShardMetadata((0, col), (num_rows, cols), rank))
        col += cols
    return shards


def _check_rows(table: str, num_rows: int, num_ranks: int, st: ShardingType) -> None:
    if num_rows < num_ranks:
        raise ValueError(f"table '{table}' has {num_rows} rows but {st} splits it over {num_ranks} ranks: "
                         f"use table_wise or data_parallel for tables this small")
