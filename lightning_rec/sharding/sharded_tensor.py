"""A table as this rank holds it: its pieces (shards) and where they sit in the global table.

    ShardedTensor(global_shape=(rows, dim), local_shards=[(ShardMetadata, tensor [rows_s, cols_s]), ...])

Any layout reads any rectangle it owns from the pieces that cover it (`read`), so a checkpoint does not
depend on the world size that wrote it; `merge([...])` combines per-rank ones, `full()` assembles the table.
It loads with torch.load's default weights_only=True (registered as a safe global below).

`dcp.save(dmp.state_dict())` refuses it (DCP would keep one rank's pickled copy): use lightning_rec.checkpoint."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_rec.types import ShardMetadata


@dataclass
class Shard:
    """One piece of a table as torch's / TorchRec's `ShardedTensor.local_shards()` gives it."""

    tensor: Tensor
    metadata: ShardMetadata

    def __iter__(self):
        # unpacks as the list's (metadata, tensor) pairs
        return iter((self.metadata, self.tensor))


class LocalShards(list):
    """`ShardedTensor.local_shards`: this rank's `(ShardMetadata, tensor)` pairs; callable as torch's method too."""

    def __call__(self) -> list[Shard]:
        return [Shard(t, m) for m, t in self]


@dataclass
class ShardedTensorMetadata:
    """`ShardedTensor.metadata()`, as torch's: every shard of the table (all ranks'), and its global size."""

    shards_metadata: list[ShardMetadata]
    size: torch.Size


@dataclass
class ShardedTensor:
    global_shape: tuple[int, int]
    local_shards: list[tuple[ShardMetadata, Tensor]] = field(default_factory=list)
    # every rank's shards (the plan's), for metadata(); None where only this rank's pieces are known (merge, by hand)
    shards_metadata: list[ShardMetadata] | None = None

    def __post_init__(self) -> None:
        self.local_shards = LocalShards(self.local_shards)

    # pickled with a plain list, as before LocalShards: checkpoints stay readable by older versions and back
    def __getstate__(self) -> dict:
        return {"global_shape": self.global_shape, "local_shards": list(self.local_shards),
                "shards_metadata": self.shards_metadata}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({"shards_metadata": None, **state})  # pickled before shards_metadata: None
        self.local_shards = LocalShards(self.local_shards)

    # torch's / TorchRec's ShardedTensor methods that ported code calls
    def metadata(self) -> ShardedTensorMetadata:
        """Every shard of the table, on every rank (`.shards_metadata`), and its global `.size`."""
        if self.shards_metadata is None:
            raise ValueError(f"{self!r} holds no layout of the other ranks' shards (it was built from pieces by "
                             f"hand): read its own pieces from .local_shards, or take metadata() from the sharded "
                             f"model's state_dict()")
        return ShardedTensorMetadata(list(self.shards_metadata), self.shape)

    def local_tensor(self) -> Tensor:
        """This rank's one piece of the table (torch's: only for exactly one local shard)."""
        if len(self.local_shards) != 1:
            raise ValueError(f"ShardedTensor.local_tensor() needs exactly one local shard, and this rank holds "
                             f"{len(self.local_shards)} of the {tuple(self.global_shape)} table: iterate "
                             f"`for shard in st.local_shards(): shard.tensor, shard.metadata.shard_offsets`")
        return self.local_shards[0][1]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.global_shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        """The global table's size, as torch's / TorchRec's `ShardedTensor.size()` (ported code calls it)."""
        return self.shape if dim is None else self.shape[dim]

    def __repr__(self) -> str:
        pieces = ", ".join(str(m) for m, _ in self.local_shards)
        return f"ShardedTensor(global_shape={tuple(self.global_shape)}, shards=[{pieces}])"

    @staticmethod
    def merge(parts: Sequence[ShardedTensor]) -> ShardedTensor:
        """The pieces of several ranks' checkpoints of one table, as one ShardedTensor."""
        shapes = {tuple(p.global_shape) for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"cannot merge pieces of tables with different shapes {sorted(shapes)}")
        seen, shards = set(), []
        for p in parts:
            for meta, t in p.local_shards:
                key = (meta.shard_offsets, meta.shard_sizes)
                if key not in seen:  # replicas (and repeated saves) count once
                    seen.add(key)
                    shards.append((meta, t))
        layout = parts[0].shards_metadata if parts else None
        return ShardedTensor(shapes.pop(), shards, layout if all(p.shards_metadata == layout for p in parts) else None)

    def read(self, row: int, col: int, rows: int, cols: int, what: str = "table") -> Tensor:
        """The rectangle [row:row+rows, col:col+cols] of the global table, from the pieces held."""
        out = None
        covered = torch.zeros(rows, cols, dtype=torch.bool)
        for meta, t in self.local_shards:
            (r0, c0), (nr, nc) = meta.shard_offsets, meta.shard_sizes
            a, b = max(row, r0), min(row + rows, r0 + nr)
            c, d = max(col, c0), min(col + cols, c0 + nc)
            if a >= b or c >= d:
                continue
            if out is None:
                out = t.new_empty(rows, cols)
            out[a - row : b - row, c - col : d - col] = t[a - r0 : b - r0, c - c0 : d - c0]
            covered[a - row : b - row, c - col : d - col] = True
        if rows and cols and not bool(covered.all()):
            raise ValueError(
                f"{what}: the pieces held {[str(m) for m, _ in self.local_shards]} do not cover rows "
                f"{row}:{row + rows} cols {col}:{col + cols} (a rank's state dict holds that rank's pieces): "
                f"combine every rank's with ShardedTensor.merge([...]) first (e.g. after "
                f"dist.all_gather_object), or save a full state dict"
            )
        return out if out is not None else torch.empty(rows, cols)

    def read_positions(self, first: int, n: int, what: str = "tensor") -> Tensor:
        """Positions [first, first+n) of a 1-D global tensor (a sharded id map's buffers), from the pieces held."""
        out, covered = None, torch.zeros(n, dtype=torch.bool)
        for meta, t in self.local_shards:
            (p0,), (m,) = meta.shard_offsets, meta.shard_sizes
            a, b = max(first, p0), min(first + n, p0 + m)
            if a < b:
                out = t.new_empty(n) if out is None else out
                out[a - first : b - first] = t[a - p0 : b - p0]
                covered[a - first : b - first] = True
        if n and not bool(covered.all()):
            raise ValueError(f"{what}: the pieces held {[str(m) for m, _ in self.local_shards]} do not cover positions "
                             f"{first}:{first + n}: combine every rank's with ShardedTensor.merge([...]) first, or "
                             f"load with lightning_rec.checkpoint.load_model")
        return out if out is not None else torch.empty(0)

    def full(self) -> Tensor:
        if len(self.global_shape) == 1:
            return self.read_positions(0, self.global_shape[0], what=f"ShardedTensor.full() of {self!r}")
        return self.read(0, 0, *self.global_shape, what=f"ShardedTensor.full() of a {tuple(self.global_shape)} table")

    # DCP's save hook, reached only through its default planner, which would keep one rank's pickled copy
    def __create_write_items__(self, fqn: str, obj: object) -> list:
        raise TypeError(
            f"torch.distributed.checkpoint.save cannot save {fqn}: it is a lightning_rec ShardedTensor (each rank "
            f"holds some of the table's rows), of which DCP's default planner would keep one rank's copy. Use "
            f"lightning_rec.checkpoint.save({{'state_dict': dmp.state_dict()}}, path, optimizers=[optimizer]), and "
            f"lightning_rec.checkpoint.load_model(dmp, path) / load_optimizer(optimizer, path) to load it (at any "
            f"world size and plan)")


# a state dict of sharded tables is tensors and metadata: torch.load's default weights_only=True reads it
torch.serialization.add_safe_globals([ShardedTensor])
