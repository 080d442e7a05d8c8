"""Bytes and milliseconds per shard, and the priced options the planner chooses from.

A table's options are (sharding type, compute kernel, column blocks); their shards come from `shard_layout`, as the
sharder's do. Shards are grouped into *pieces*, the unit the partitioner places:

    kind "fixed": data_parallel, row_wise      one piece, one slot per rank (placement is decided)
    kind "rank":  table_wise, column_wise      one piece per shard; the partitioner picks its rank
    kind "host":  table_row_wise / _column_wise, grid_shard
                                               one piece per host-sized group of shards; the
                                               partitioner picks the host, slot = local rank

Each slot carries four numbers: HBM bytes, DDR bytes, compute ms, communication ms.
Legend: B batch per rank, W world size, L ranks per host, S samples a shard serves, p ids per sample."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lightning_rec.lookup import pad_multiple, padded_dim
from lightning_rec.optim.config import EmbOptimType
from lightning_rec.planner.constraints import (
    DEFAULT_CACHE_LOAD_FACTOR,
    DEFAULT_MIN_PARTITION,
    ParameterConstraints,
)
from lightning_rec.planner.topology import Topology
from lightning_rec.sharding.data_parallel import REPLICA_OPTIMIZERS
from lightning_rec.sharding.layout import shard_layout
from lightning_rec.types import SEQUENCE_SHARDING_TYPES, ComputeKernel, ShardingType

HBM, DDR, COMPUTE, COMM = 0, 1, 2, 3  # slot columns
CACHE_LINE = 64  # a row gather moves at least one cache line / memory sector
OUTPUT_BYTES = 4  # pooled / sequence outputs and their gradients are fp32
ID_BYTES = 8  # int64 ids
ROW_SPLIT = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE, ShardingType.GRID_SHARD)
UVM_KERNELS = (ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING)


def optimizer_state_bytes_per_row(optimizer: str, cols: int) -> int:
    """fp32 state the optimizer keeps per row of `cols` columns."""
    floats = {"sgd": 0, "adagrad": cols, "rowwise_adagrad": 1, "adam": 2 * cols, "partial_rowwise_adam": cols + 1,
              "lamb": 2 * cols,
              "lars_sgd": cols}
    try:
        return 4 * floats[str(optimizer)]
    except KeyError:
        raise ValueError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(floats)}") from None


def cache_hit_rate(cache_load_factor: float) -> float:
    # Recommendation ids are Zipf-skewed: a cache of 20% of the rows serves ~85% of lookups.
    return cache_load_factor**0.1


@dataclass
class TableSpec:
    """One table as the planner sees it (from an EmbeddingBagConfig / EmbeddingConfig)."""

    index: int
    path: str  # module path of its collection
    name: str
    rows: int
    dim: int
    elem_bytes: int
    pooled: bool
    num_features: int
    pooling_factors: list[float]  # per feature
    is_weighted: bool
    constraints: ParameterConstraints
    # the CPU kernel its collection resolves to (fbgemm pads rows to 4 columns); None: the "auto" rule's
    cpu_kernel: str | None = None

    @property
    def ids_per_sample(self) -> float:
        return float(sum(self.pooling_factors))

    @property
    def key(self) -> str:
        return f"{self.path}.{self.name}" if self.path else self.name


@dataclass
class ShardingOption:
    spec: TableSpec
    sharding_type: ShardingType
    kernel: ComputeKernel
    kind: str  # "fixed" | "rank" | "host"
    pieces: list[np.ndarray]  # each [slots, 4]: HBM, DDR, compute ms, comm ms
    column_sizes: list[int] | None = None
    num_blocks: int = 1
    totals: np.ndarray = field(init=False)  # [4] summed over every slot of every piece
    max_piece_ms: float = field(init=False)  # the slowest slot of any piece
    max_piece_bytes: np.ndarray = field(init=False)  # [2] the largest slot's HBM, DDR
    # per piece, precomputed for the partitioner's Python loops: slowest slot ms, largest slot bytes
    piece_ms: list[float] = field(init=False)
    piece_bytes: list[tuple[float, float]] = field(init=False)

    def __post_init__(self) -> None:
        stacked = np.concatenate(self.pieces, axis=0)
        self.totals = stacked.sum(axis=0)
        self.max_piece_ms = float((stacked[:, COMPUTE] + stacked[:, COMM]).max())
        self.max_piece_bytes = stacked[:, :2].max(axis=0)
        self.piece_ms = [float((p[:, COMPUTE] + p[:, COMM]).max()) for p in self.pieces]
        self.piece_bytes = [(float(p[:, HBM].max()), float(p[:, DDR].max())) for p in self.pieces]

    @property
    def total_ms(self) -> float:
        return float(self.totals[COMPUTE] + self.totals[COMM])

    @property
    def total_bytes(self) -> float:
        return float(self.totals[HBM] + self.totals[DDR])

    def describe(self) -> str:
        blocks = f" x{self.num_blocks}" if self.num_blocks > 1 else ""
        return f"{self.sharding_type}{blocks} ({self.kernel})"


@dataclass
class CostModel:
    """Prices shards for one topology, batch size, optimizer."""

    topology: Topology
    batch_size: int  # per rank
    optimizer: str = "rowwise_adagrad"
    # RecStrategy(pipeline=...) / TrainPipelineSparseDist: False (plain loop), True (depth 1) or the depth K
    pipelined: bool | int = True

    @property
    def live_batches(self) -> int:
        """Batches whose routed ids a rank holds at once: the step's own; pipelined with depth K, also the K routed
        ahead and the one Lightning's loop takes ahead (a hand loop holds one fewer: counted anyway)."""
        if self.pipelined is False or self.pipelined is None or self.pipelined == 0:
            return 1
        depth = 1 if self.pipelined is True else int(self.pipelined)
        return 2 + depth

    def _a2a_ms(self, nbytes: float) -> float:
        """One rank's all-to-all of `nbytes` spread over all ranks (other hosts' share at the inter-host rate)."""
        t = self.topology
        W, L = t.world_size, t.local_world_size
        if W == 1:
            return 0.0
        local, remote = (L - 1) / W, (W - L) / W
        return 1e3 * nbytes * (local / t.intra_host_bw + remote / t.inter_host_bw)

    def _lookup_bw(self, spec: TableSpec, kernel: ComputeKernel) -> float:
        t = self.topology
        if t.compute_device == "cpu":
            return t.ddr_mem_bw
        if kernel == ComputeKernel.FUSED_UVM:
            return t.pcie_bw
        if kernel == ComputeKernel.FUSED_UVM_CACHING:
            hit = cache_hit_rate(self.cache_load_factor(spec))
            return 1.0 / (hit / t.hbm_mem_bw + (1 - hit) / t.pcie_bw)
        return t.hbm_mem_bw

    @staticmethod
    def cache_load_factor(spec: TableSpec) -> float:
        clf = spec.constraints.cache_load_factor
        return DEFAULT_CACHE_LOAD_FACTOR if clf is None else clf

    def stored_cols(self, spec: TableSpec, cols: int) -> int:
        """Columns a shard's rows take in memory: fbgemm's kernel pads them to a multiple of 4 (lookup.py)."""
        if self.topology.compute_device == "cuda":
            return padded_dim(cols, pad_multiple("fbgemm"))
        kernel = spec.cpu_kernel or ("native" if spec.pooled else "fbgemm")
        return padded_dim(cols, pad_multiple(kernel))

    def shard_cost(self, spec: TableSpec, st: ShardingType, kernel: ComputeKernel, rows: int,
                   cols: int) -> tuple[float, float, float, float]:
        """(HBM bytes, DDR bytes, compute ms, comm ms) of one shard of `rows` x `cols`."""
        t = self.topology
        W, L = t.world_size, t.local_world_size
        dp = st == ShardingType.DATA_PARALLEL
        samples = self.batch_size if dp else self.batch_size * W
        frac = rows / spec.rows if st in ROW_SPLIT else 1.0
        p = spec.ids_per_sample
        ids = samples * p * frac
        out_bytes = OUTPUT_BYTES * cols * (samples * spec.num_features if spec.pooled else ids)
        in_bytes = (
            0.0 if dp else ids * (ID_BYTES + (4 if spec.is_weighted else 0)) + 4 * samples * spec.num_features
        )
        opt_row = optimizer_state_bytes_per_row(self.optimizer, cols)

        # storage: rows as the kernel allocates them (only the fused kernels pad; replicas are plain tensors)
        stored = cols if kernel == ComputeKernel.DENSE else self.stored_cols(spec, cols)
        weights = rows * stored * spec.elem_bytes
        state = rows * optimizer_state_bytes_per_row(self.optimizer, stored)
        if kernel == ComputeKernel.DENSE:
            state += rows * cols * 4  # the dense gradient autograd materialises
        io = in_bytes * self.live_batches + 2 * out_bytes  # output + its gradient
        if t.compute_device == "cpu" and W == L > 1 and not dp:
            # ranks of one host exchange through /dev/shm: two slots of the largest exchange a rank sends
            io += 2 * (W - 1) / W * max(in_bytes, out_bytes)
        if t.compute_device == "cpu":
            hbm, ddr = 0.0, weights + state + io
        elif kernel in UVM_KERNELS:
            hbm, ddr = io, weights + state
            if kernel == ComputeKernel.FUSED_UVM_CACHING:
                hbm += math.ceil(self.cache_load_factor(spec) * rows) * stored * spec.elem_bytes
        else:
            hbm, ddr = weights + state + io, 0.0

        # compute: bytes the lookup and the update move, over the memory they live in
        gather = max(cols * spec.elem_bytes, CACHE_LINE)
        fwd = ids * gather + out_bytes
        if kernel == ComputeKernel.DENSE:
            # autograd scatters into a dense gradient, then torch.optim steps every row
            bwd = ids * cols * 4 + rows * cols * 4 + 2 * weights + 3 * state
        else:  # fused: read the gradient, read + write the row and its optimizer state
            bwd = ids * (cols * OUTPUT_BYTES + 2 * gather + 2 * opt_row)
        compute_ms = 1e3 * (fwd + bwd) / self._lookup_bw(spec, kernel)

        # communication: ids in, outputs out, output gradients back
        if W == 1:
            comm_ms = 0.0
        elif dp:  # ring all-reduce of the full gradient
            bw = t.inter_host_bw if t.num_hosts > 1 else t.intra_host_bw
            comm_ms = 1e3 * 2 * (W - 1) / W * rows * cols * 4 / bw
        elif st in ROW_SPLIT and spec.pooled:
            group = W if st == ShardingType.ROW_WISE else L
            if st == ShardingType.ROW_WISE:  # reduce-scatter of partial sums over all ranks
                out_ms = self._a2a_ms(out_bytes)
            else:  # reduce-scatter inside the host, then the host's result to every rank
                out_ms = 1e3 * out_bytes * (group - 1) / group / t.intra_host_bw
                out_ms += self._a2a_ms(out_bytes / group)
            comm_ms = self._a2a_ms(in_bytes) + 2 * out_ms
        else:
            comm_ms = self._a2a_ms(in_bytes) + 2 * self._a2a_ms(out_bytes)
        return hbm, ddr, compute_ms, comm_ms


def _kernels_for(spec: TableSpec, st: ShardingType, topology: Topology) -> tuple[list, list[str]]:
    """Kernels that apply to this table and sharding type, and why the others do not."""
    c = spec.constraints
    allowed = c.compute_kernels or list(ComputeKernel)
    kernels, reasons = [], []
    for k in allowed:
        if st == ShardingType.DATA_PARALLEL and k != ComputeKernel.DENSE:
            reasons.append(f"{st} ({k}): data_parallel runs the dense kernel only")
        elif st != ShardingType.DATA_PARALLEL and k == ComputeKernel.DENSE:
            reasons.append(f"{st} ({k}): the dense kernel is for data_parallel only")
        elif k in UVM_KERNELS and topology.compute_device != "cuda":
            reasons.append(f"{st} ({k}): UVM kernels need compute_device='cuda'")
        elif k in UVM_KERNELS and c.enforce_hbm:
            reasons.append(f"{st} ({k}): enforce_hbm=True keeps the table in device memory")
        else:
            kernels.append(k)
    if kernels and c.compute_kernels is None:
        # the user chose no kernels: the ones that do not apply would hide the reason that matters
        reasons = []
    return kernels, reasons


def _min_partition_fix(spec: TableSpec, min_cols: int, at_most: int) -> str:
    given = spec.constraints.min_partition is not None
    now = f"min_partition={min_cols}" if given else (
        f"min_partition is not set: the default is min(dim, {DEFAULT_MIN_PARTITION}) = {min_cols}")
    return f"{now}; lower it with ParameterConstraints(min_partition={at_most}) or less" if at_most > 0 else now


def _block_counts(n: int, dim: int, min_cols: int) -> list[int]:
    """Column blocks to try over `n` ranks (or hosts): 2, 4, 8, ..., `n`, and the most blocks of `min_cols` columns."""
    counts, k = {n, dim // min_cols}, 2
    while k <= n:
        counts.add(k)
        k *= 2
    return sorted(k for k in counts if 2 <= k <= n and dim // k >= min_cols)


def _layouts(spec: TableSpec, st: ShardingType, t: Topology) -> tuple[list, list[str]]:
    """(num_blocks, column_sizes, shards) per layout of this sharding type, and why none fit."""
    W, L, H = t.world_size, t.local_world_size, t.num_hosts
    min_cols = spec.constraints.min_partition or min(spec.dim, DEFAULT_MIN_PARTITION)
    name, rows, dim = spec.name, spec.rows, spec.dim
    user_only = spec.constraints.sharding_types is not None
    if st in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE) and rows < (
        W if st == ShardingType.ROW_WISE else L
    ):
        return [], [f"{st}: {rows} rows cannot be split over {W if st == ShardingType.ROW_WISE else L} ranks"]
    if st == ShardingType.DATA_PARALLEL:
        return [(1, None, shard_layout(name, rows, dim, st, W))], []
    if st == ShardingType.TABLE_WISE:
        return [(1, None, shard_layout(name, rows, dim, st, W))], []
    if st == ShardingType.ROW_WISE:
        if W == 1 and not user_only:
            return [], [f"{st}: one rank, same as table_wise"]
        return [(1, None, shard_layout(name, rows, dim, st, W))], []
    if st == ShardingType.TABLE_ROW_WISE:
        if H == 1 and not user_only:
            return [], [f"{st}: one host, same as row_wise"]
        return [(1, None, shard_layout(name, rows, dim, st, W, local_world_size=L))], []
    if st == ShardingType.COLUMN_WISE:
        return _column_wise_layouts(spec, st, t, min_cols)
    if st == ShardingType.TABLE_COLUMN_WISE:
        return _table_column_wise_layouts(spec, st, t, min_cols, user_only)
    if st == ShardingType.GRID_SHARD:
        return _grid_layouts(spec, st, t, min_cols)
    raise AssertionError(f"unhandled sharding type {st}")


def _column_wise_layouts(spec: TableSpec, st: ShardingType, t: Topology, min_cols: int) -> tuple[list, list[str]]:
    W, name, rows, dim = t.world_size, spec.name, spec.rows, spec.dim
    out = []
    for k in _block_counts(W, dim, min_cols):
        shards = shard_layout(name, rows, dim, st, W, ranks=[0] * k)
        # sequence tables run on fbgemm, whose column blocks must be multiples of 4 (model_parallel.py)
        if spec.pooled or dim % 4 or not any(s.shard_sizes[1] % 4 for s in shards):
            out.append((k, None, shards))
    return out, [] if out else [
        f"{st}: dim {dim} makes no 2+ column blocks of >= {min_cols} columns over {W} ranks "
        f"({_min_partition_fix(spec, min_cols, dim // 2)})"
    ]


def _table_column_wise_layouts(spec: TableSpec, st: ShardingType, t: Topology, min_cols: int,
                               user_only: bool) -> tuple[list, list[str]]:
    W, L, H = t.world_size, t.local_world_size, t.num_hosts
    name, rows, dim = spec.name, spec.rows, spec.dim
    if H == 1 and not user_only:
        return [], [f"{st}: one host, same as column_wise"]
    if L < 2:  # one block per host would be table_wise; "blocks under min_partition" named the wrong cause
        return [], [f"{st}: splits columns over the ranks of a host, and a host has {L} rank "
                    f"(local_world_size={L}): needs 2+ ranks per host (else use table_wise or column_wise)"]
    if dim // L < min_cols:
        return [], [f"{st}: dim {dim} over {L} local ranks gives blocks under {min_cols} columns "
                    f"({_min_partition_fix(spec, min_cols, dim // L)})"]
    return [(L, None, shard_layout(name, rows, dim, st, W, local_world_size=L))], []


def _grid_layouts(spec: TableSpec, st: ShardingType, t: Topology, min_cols: int) -> tuple[list, list[str]]:
    W, L, H = t.world_size, t.local_world_size, t.num_hosts
    name, rows, dim = spec.name, spec.rows, spec.dim
    out = []
    if rows < L:
        return [], [f"{st}: {rows} rows cannot be split over the {L} ranks of a host"]
    for k in _block_counts(H, dim, min_cols):
        shards = shard_layout(name, rows, dim, st, W, local_world_size=L, host_indexes=list(range(k)))
        out.append((k, None, shards))
    if out:
        return out, []
    if H < 2:
        return [], [f"{st}: splits columns over hosts, and there is {H} (world_size {W} / local_world_size {L}): "
                    f"needs 2+ hosts (else use row_wise or table_row_wise)"]
    return [], [f"{st}: dim {dim} makes no 2+ column blocks of >= {min_cols} columns over {H} hosts "
                f"({_min_partition_fix(spec, min_cols, dim // 2)})"]


def enumerate_options(spec: TableSpec, cost: CostModel,
                      max_shard_bytes: tuple[float, float]) -> tuple[list[ShardingOption], list[str]]:
    """Every priced option for one table, and why each excluded one was excluded (a shard over `max_shard_bytes`,
    when others exist: it would leave the partitioner nothing to balance)."""
    t = cost.topology
    L = t.local_world_size
    options: list[ShardingOption] = []
    reasons: list[str] = []
    for st in spec.constraints.sharding_types or list(ShardingType):
        if not spec.pooled and st not in SEQUENCE_SHARDING_TYPES:
            # DistributedModelParallel refuses these for an EmbeddingCollection: never propose them
            reasons.append(f"{st}: sequence (EmbeddingCollection) tables take "
                           f"{', '.join(str(s) for s in SEQUENCE_SHARDING_TYPES)}")
            continue
        if st == ShardingType.DATA_PARALLEL and EmbOptimType(str(cost.optimizer)) not in REPLICA_OPTIMIZERS:
            # replicas update with their own rule (sharding/data_parallel.py), which has these optimizers only
            reasons.append(f"{st}: replicated tables do not implement fused {cost.optimizer} (they take "
                           f"{', '.join(str(o) for o in REPLICA_OPTIMIZERS)})")
            continue
        kernels, why = _kernels_for(spec, st, t)
        reasons += why
        if not kernels:
            continue
        layouts, why = _layouts(spec, st, t)
        reasons += why
        for num_blocks, column_sizes, shards in layouts:
            for kernel in kernels:
                priced: dict[tuple[int, int], tuple] = {}  # shards of one option repeat few shapes
                slots = []
                for s in shards:
                    shape = s.shard_sizes
                    if shape not in priced:
                        priced[shape] = cost.shard_cost(spec, st, kernel, *shape)
                    slots.append(priced[shape])
                arr = np.asarray(slots, dtype=np.float64)
                if st in (ShardingType.DATA_PARALLEL, ShardingType.ROW_WISE):
                    kind, pieces = "fixed", [_by_rank(arr, shards, t.world_size)]
                elif st in (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE):
                    kind, pieces = "rank", [arr[i : i + 1] for i in range(len(shards))]
                else:  # host-level: groups of L consecutive shards, slot = local rank
                    kind = "host"
                    pieces = [
                        _by_rank(arr[i : i + L], shards[i : i + L], L, base=shards[i].placement)
                        for i in range(0, len(shards), L)
                    ]
                options.append(ShardingOption(spec, st, kernel, kind, pieces, column_sizes, num_blocks=num_blocks))
    # per kernel: a table too big for max_shard_bytes in device memory keeps its fused shards when they fit
    over = {id(o) for o in options
            if o.max_piece_bytes[0] > max_shard_bytes[0] or o.max_piece_bytes[1] > max_shard_bytes[1]}
    within = {o.kernel for o in options if id(o) not in over}
    kept = [o for o in options if id(o) not in over or o.kernel not in within]
    if len(kept) < len(options):
        reasons.append(f"{len(options) - len(kept)} option(s) with one shard over the per-shard memory share")
        options = kept
    return options, reasons


def _by_rank(arr: np.ndarray, shards, n: int, base: int = 0) -> np.ndarray:
    out = np.zeros((n, 4))
    np.add.at(out, np.fromiter((s.placement - base for s in shards), dtype=np.int64, count=len(shards)), arr)
    return out
