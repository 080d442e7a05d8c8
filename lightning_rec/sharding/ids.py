"""Ids on their way to the shards: bucketize by owner, remap to local rows, reorder. Pure tensors.

Legend: F features, C copies, S shard features (all ranks), S_p those of rank p, B local batch,
B_r batch of source rank r, N ids, W world size.

Send side (`route_ids`), on every rank, for its own B samples:

    features  lengths_FB, values_N           (the collection's feature order)
        | one copy per column block, then each id to its row shard: owner = id // block
        v
    routed    lengths_SB  [S_0 features x B | S_1 features x B | ... ]   rank-major: the slice for
              values_N    [ids for rank 0   | ids for rank 1   | ... ]   rank p is what p receives
                          each id already remapped to its shard's local row (id - owner * block)
                          (a managed-collision table's raw id: owner = owner_of(id, row shards), sent
                          unchanged; its owner remaps it, sharded_managed_collision.py)

Receive side (`key_major_permutation`): rank p gets one such slice from every source r and
concatenates them source-major; its lookup wants key-major (one bag list per shard feature over
the concatenated batch B_0 + ... + B_{W-1}):

    source-major  [r0: s0 b.. | s1 b..] [r1: s0 b.. | s1 b..]
    key-major     [s0: r0 b.. r1 b.. ] [s1: r0 b.. r1 b.. ]

Learned weights' gradient goes the other way (`to_source_major`, then the reverse all-to-all). Tables that no
rank splits by rows take a fast path: routing is a key permutation, with no per-id arithmetic."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_rec.managed_collision.mch import owner_of
from lightning_rec.sharding.routing import Routing
from lightning_rec.sparse import KeyedJaggedTensor


@dataclass
class RoutedIds:
    lengths_SB: Tensor  # rank-major, [S * B]
    values_N: Tensor  # remapped to local rows, rank-major
    weights_N: Tensor | None
    ids_per_rank: list[int]  # N_p: how many ids go to each rank
    # row `order_N[i]` of the copies' ids travelled as routed id i (None on the fast path)
    order_N: Tensor | None
    copies: KeyedJaggedTensor | None  # the copies' ids before bucketizing (generic path)


class RouteTables:
    """Routing as tensors on one device, built once per collection (and device)."""

    def __init__(self, routing: Routing, device: torch.device) -> None:
        self.routing = routing
        self.num_sf = routing.num_routed
        self.sf_feature = routing.sf_feature_index()
        self.sf_feature_t = torch.tensor(self.sf_feature, dtype=torch.int32, device=device)
        self.copy_feature = routing.copy_feature_index
        self.copy_feature_t = torch.tensor(self.copy_feature, dtype=torch.int32, device=device)
        self.copy_block_C = torch.tensor(routing.copy_row_block, dtype=torch.long, device=device)
        self.copy_first_C = torch.tensor(routing.copy_first, dtype=torch.long, device=device)
        self.copy_shard_sf = torch.tensor(routing.copy_shard_sf, dtype=torch.long, device=device)
        # C: the copy's last row shard that holds rows (the block rule fills shards in order, empty ones last)
        ends = routing.copy_first[1:] + [len(routing.copy_shard_sf)]
        self.copy_last_owner_C = torch.tensor(
            [sum(sf >= 0 for sf in routing.copy_shard_sf[a:b]) - 1 for a, b in zip(routing.copy_first, ends)],
            dtype=torch.long, device=device)
        counts = routing.rank_sf_counts
        self.rank_of_sf = [p for p, n in enumerate(counts) for _ in range(n)]
        self.rank_sf_end = torch.tensor(counts, device=device).cumsum(0)
        # pooled and no table split by rows: routing is a key permutation (see top)
        self.fast = routing.pooled and not routing.row_split
        self.copy_shards_C = self.copy_last_owner_C + 1
        self.raw_C: Tensor | None = None  # C: the copy reads raw ids (managed collision), routed by value
        self.all_raw = False

    def route_raw_ids(self, tables: set[str]) -> None:
        """The copies of `tables` carry raw ids: each goes to the row shard `owner_of(id, row shards)` unchanged,
        and that owner remaps it to its rows (managed collision)."""
        table_of = {sf.feature_index: sf.table for sf in self.routing.shard_features}
        raw = [table_of[f] in tables for f in self.routing.copy_feature_index]
        self.raw_C = torch.tensor(raw, dtype=torch.bool, device=self.copy_block_C.device) if any(raw) else None
        self.all_raw = bool(raw) and all(raw)


def route_ids(features: KeyedJaggedTensor, tables: RouteTables) -> RoutedIds:
    """`features` in the collection's feature order -> ids grouped by destination rank (see top)."""
    one_rank = tables.routing.world_size == 1  # every id goes to rank 0: its count needs no host read
    if tables.fast:
        routed = features.permute(tables.sf_feature, tables.sf_feature_t)
        if one_rank:
            per_rank = [routed.values().numel()]
        else:
            per_rank = [0] * tables.routing.world_size
            for p, n in zip(tables.rank_of_sf, routed.length_per_key()):
                per_rank[p] += n
        return RoutedIds(routed.lengths(), routed.values(), routed.weights_or_none(), per_rank, None, None)
    copies = features.permute(tables.copy_feature, tables.copy_feature_t)
    B = features.stride()
    lengths_CB = copies.lengths()
    values_N = copies.values()
    N = values_N.numel()
    bag_N = torch.repeat_interleave(torch.arange(lengths_CB.numel(), device=values_N.device), lengths_CB,
                                    output_size=N)
    copy_N = torch.div(bag_N, max(B, 1), rounding_mode="floor")
    owner_N, local_N = _owners(tables, values_N, copy_N)
    sf_N = tables.copy_shard_sf[tables.copy_first_C[copy_N] + owner_N]
    key_N = sf_N * B + (bag_N - copy_N * B)
    key_sorted_N, order_N = torch.sort(key_N, stable=True)
    lengths_SB = torch.bincount(key_sorted_N, minlength=tables.num_sf * B)
    weights_N = copies.weights_or_none()
    if one_rank:
        per_rank = [N]
    elif tables.num_sf and B:
        # ids per rank: the end of each rank's keys in the sorted order (one host read)
        ends = torch.searchsorted(key_sorted_N, tables.rank_sf_end * B)
        per_rank = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    else:
        per_rank = [0] * tables.routing.world_size
    return RoutedIds(lengths_SB.to(lengths_CB.dtype), local_N[order_N],
                     None if weights_N is None else weights_N[order_N], per_rank, order_N, copies)


def _owners(tables: RouteTables, values_N: Tensor, copy_N: Tensor) -> tuple[Tensor, Tensor]:
    """Each id's row shard among its copy's and its id there: rows by block, raw ids (managed collision) by value
    (remapped by their owner)."""
    if tables.all_raw:
        return owner_of(values_N, tables.copy_shards_C[copy_N]), values_N
    block_N = tables.copy_block_C[copy_N]
    # an unchecked id outside its table stays among its copy's own shards, where the owner's kernel refuses it
    owner_N = torch.div(values_N, block_N, rounding_mode="floor").clamp_(min=0)
    owner_N = torch.minimum(owner_N, tables.copy_last_owner_C[copy_N])
    local_N = values_N - owner_N * block_N
    if tables.raw_C is not None:
        raw_N = tables.raw_C[copy_N]
        owner_N = torch.where(raw_N, owner_of(values_N, tables.copy_shards_C[copy_N]), owner_N)
        local_N = torch.where(raw_N, values_N, local_N)
    return owner_N, local_N


def key_major_permutation(num_keys: int, batch_per_source: Sequence[int], device: torch.device) -> Tensor:
    """Bag permutation source-major -> key-major (see top): out bag i is source-major bag perm[i]."""
    B_r = torch.tensor(list(batch_per_source), dtype=torch.long, device=device)
    start_r = torch.cumsum(B_r * num_keys, 0) - B_r * num_keys
    # within the key-major row of key s: sources in order, each its B_r bags at start_r + s*B_r + b
    base_B = torch.repeat_interleave(start_r, B_r) + _arange_per_segment(B_r)
    stride_B = torch.repeat_interleave(B_r, B_r)
    keys = torch.arange(num_keys, device=device).unsqueeze(1)
    return (base_B.unsqueeze(0) + keys * stride_B.unsqueeze(0)).reshape(-1).to(torch.int32)


def _arange_per_segment(sizes: Tensor) -> Tensor:
    """[0..sizes[0]-1, 0..sizes[1]-1, ...]"""
    total = int(sizes.sum())
    starts = torch.cumsum(sizes, 0) - sizes
    return torch.arange(total, device=sizes.device) - torch.repeat_interleave(starts, sizes, output_size=total)


def to_key_major(perm: Tensor, lengths: Tensor, values: Tensor, weights: Tensor | None,
                 with_positions: bool = False) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Apply `perm` (from key_major_permutation) to bags; also where each key-major id came from."""
    N = values.numel()
    if N == 0 or perm.numel() == 0:
        lengths_km = lengths[perm.long()] if perm.numel() else lengths
        pos = torch.empty(0, dtype=torch.long, device=values.device) if with_positions else None
        return lengths_km, values, weights, pos
    lengths_km, values_km, weights_km = torch.ops.fbgemm.permute_1D_sparse_data(perm, lengths, values, weights, N)
    pos = None
    if with_positions:
        src = torch.arange(N, device=values.device)
        _, pos, _ = torch.ops.fbgemm.permute_1D_sparse_data(perm, lengths, src, None, N)
    return lengths_km, values_km, weights_km, pos


def to_source_major(perm: Tensor, lengths_src: Tensor, grad_km: Tensor) -> Tensor:
    """Per-id values in key-major order (after `to_key_major(perm, lengths_src, ...)`) back to source-major."""
    N = grad_km.numel()
    if N == 0 or perm.numel() == 0:
        return grad_km
    # pos[i]: the source-major place of key-major id i (what to_key_major's with_positions returns)
    src = torch.arange(N, device=grad_km.device)
    _, pos, _ = torch.ops.fbgemm.permute_1D_sparse_data(perm, lengths_src, src, None, N)
    out = torch.empty_like(grad_km)
    out[pos] = grad_km
    return out
