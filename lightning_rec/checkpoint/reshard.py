"""The pieces of one global tensor as DCP sees them, and the planners that hand DCP our own objects.

Saving writes this rank's rectangles straight from the kernels' memory; loading asks DCP for the rectangles this
rank's layout holds and copies them straight into the kernels: any world size, any plan, or the unsharded module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from lightning_rec.sharding.sharded_tensor import ShardedTensor


class Pieces:
    """Rectangles of a tensor of `global_shape` that this rank writes (save) or wants (load).

    pieces: [(offsets, sizes, tensor)], the tensor holding (or receiving) exactly that rectangle.
    DCP asks for its chunks (`__create_write_items__` / `__create_chunk_list__`) and for the tensor
    of one chunk (the planners' lookup below).
    """

    def __init__(self, global_shape: Sequence[int], pieces: Sequence[tuple[Sequence[int], Sequence[int], Tensor]]):
        self.global_shape = torch.Size(global_shape)
        self.pieces = [(torch.Size(o), torch.Size(s), t) for o, s, t in pieces]

    def size(self) -> torch.Size:
        return self.global_shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self.global_shape,
                ),
            )
            for offsets, sizes, t in self.pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=s) for o, s, _ in self.pieces]

    def chunk(self, offset: torch.Size) -> Tensor:
        for o, _, t in self.pieces:
            if o == offset:
                return t
        raise AssertionError(f"no piece at {tuple(offset)}")


def pieces_of(st: ShardedTensor) -> Pieces:
    return Pieces(st.global_shape, [(m.shard_offsets, m.shard_sizes, t) for m, t in st.local_shards])


def device_of(value: Any) -> str:
    if isinstance(value, Pieces):
        return next((t.device.type for _, _, t in value.pieces if t.device.type != "cpu"), "cpu")
    return value.device.type if isinstance(value, Tensor) else "cpu"


_NUMPY_DTYPES = {torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8}


def own_storage(t: Tensor) -> Tensor:
    """The same memory as a tensor whose storage is exactly its bytes.

    DCP's writer (torch 2.11-2.13) copies a tensor whose storage is larger than itself (a table view into a fused
    kernel's flat weights) and keeps every copy until the rank's file is written. Wrapped through numpy, the piece
    is written in place.
    """
    if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in _NUMPY_DTYPES:
        return t
    if t.untyped_storage().nbytes() == t.nbytes:
        return t
    return torch.from_numpy(t.detach().numpy())


def sendable(t: Tensor) -> Tensor:
    """A piece that pickles as its own bytes: a view into a fused kernel's flat weights would pickle the kernel's
    whole storage. Host memory is wrapped without a copy where it can be (`own_storage`), else copied."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.cpu()
    own = own_storage(t)
    return own if own.untyped_storage().nbytes() == own.nbytes else t.clone()


class SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            return own_storage(obj.chunk(index.offset))
        value = super().lookup_object(index)
        return own_storage(value) if isinstance(value, Tensor) else value


class LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's _init_state_dict rewrites the dict in place and turns objects it does not know into None
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(pieces)
        self.state_dict.update(pieces)  # our dicts are flat: flattening keeps their keys

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            return obj.chunk(index.offset)
        return super().lookup_tensor(index)
