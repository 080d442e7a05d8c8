"""Does a concrete plan fit the GPUs it is put on? Checked before any table is allocated.

A plan written by hand (or for other GPUs) can put more tables on a rank than its device holds; the allocation would
then fail as a bare CUDA out-of-memory error halfway through sharding. This sums what each rank will hold in device
memory (weights, fused optimizer state, and for `fused_uvm_caching` its cache) from the plan's metadata alone, identical
on every rank, and explains what does not fit the way the planner does: the rank, the bytes, the largest tables there,
and what to change."""

from __future__ import annotations

from collections.abc import Mapping

from lightning_rec.lookup import pad_multiple, padded_dim
from lightning_rec.planner.estimate import optimizer_state_bytes_per_row
from lightning_rec.types import DEFAULT_CACHE_LOAD_FACTOR, ComputeKernel, ShardingType

# Room left for activations, the dense model, NCCL buffers and the caching allocator's slack.
DEVICE_HEADROOM = 0.85


def device_bytes_by_rank(plan_by_module: Mapping[str, Mapping], configs_by_module: Mapping[str, Mapping],
                         optimizers: Mapping[str, str], world_size: int) -> list[dict[str, int]]:
    """rank -> {table: device bytes} for every table a rank holds in device memory."""
    out: list[dict[str, int]] = [{} for _ in range(world_size)]
    for path, table_plans in plan_by_module.items():
        configs = configs_by_module[path]
        optimizer = optimizers.get(path, "sgd")
        for name, ps in table_plans.items():
            c = configs[name]
            elem = 2 if str(c.data_type).endswith("float16") else 4
            kernel = ComputeKernel(ps.compute_kernel)
            cache = ps.cache_load_factor if ps.cache_load_factor is not None else DEFAULT_CACHE_LOAD_FACTOR
            share = {ComputeKernel.FUSED_UVM: 0.0, ComputeKernel.FUSED_UVM_CACHING: cache}.get(kernel, 1.0)
            replica = ShardingType(ps.sharding_type) == ShardingType.DATA_PARALLEL
            if replica:
                pieces = [(r, c.num_embeddings, c.embedding_dim) for r in range(world_size)]
            else:
                pieces = [(s.placement, s.shard_sizes[0], s.shard_sizes[1]) for s in ps.shards]
            for rank, rows, cols in pieces:
                if replica:
                    # a plain tensor at its own width (lookup.DenseKernel) and its gradient, as the estimate prices it
                    per_row = cols * elem + optimizer_state_bytes_per_row(optimizer, cols) + cols * 4
                else:
                    cols = padded_dim(cols, pad_multiple("fbgemm"))  # GPU tables run on fbgemm: rows padded to 4
                    per_row = cols * elem + optimizer_state_bytes_per_row(optimizer, cols)
                label = f"{path}.{name}" if path else name
                out[rank][label] = out[rank].get(label, 0) + int(rows * per_row * share)
    return out


def check_plan_fits(by_rank: list[dict[str, int]], capacity_bytes: int) -> None:
    """ValueError naming the first rank whose tables exceed its device memory (with headroom)."""
    budget = int(capacity_bytes * DEVICE_HEADROOM)
    for rank, tables in enumerate(by_rank):
        total = sum(tables.values())
        if total <= budget:
            continue
        largest = sorted(tables.items(), key=lambda kv: -kv[1])[:3]
        listed = ", ".join(f"'{t}' {b / 2**30:.1f} GiB" for t, b in largest)
        raise ValueError(
            f"the plan puts {total / 2**30:.1f} GiB of embedding tables and optimizer state on rank {rank}, whose GPU "
            f"has {capacity_bytes / 2**30:.1f} GiB ({DEVICE_HEADROOM:.0%} usable for tables: "
            f"{budget / 2**30:.1f} GiB); the largest there: {listed}. Spread them over more ranks (row_wise / "
            f"table_row_wise), keep them in host memory with compute_kernel='fused_uvm_caching', or let "
            f"EmbeddingShardingPlanner(Topology(..., hbm_cap=...)) place them")
