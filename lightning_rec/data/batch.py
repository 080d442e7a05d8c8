"""One training batch of a click-through-rate model: dense features, sparse ids, labels.

Shapes: B samples in the batch, F sparse features (26 for Criteo), 13 dense features.

    dense_features   [B, 13] float32   log(1 + max(x, 0)) of the integer counts, missing -> 0
    sparse_features  KeyedJaggedTensor, keys F, stride B, lengths key-major [F*B], int64 ids
    labels           [B] float32       0. / 1. (NaN for unlabelled data such as the Kaggle test file)

Batches are built whole by the datasets (an Arrow/numpy slice per batch, never a per-sample
collate), so the DataLoader's collate function only passes them through (`passthrough_collate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_rec.sparse import KeyedJaggedTensor


@dataclass
class Batch:
    dense_features: Tensor
    sparse_features: KeyedJaggedTensor
    labels: Tensor

    # Lightning moves any object with a callable `.to` (its `_TransferableDataType` protocol) through
    # `move_data_to_device`, so this method is what `transfer_batch_to_device` calls by default.
    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            dense_features=self.dense_features.to(device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
        )

    # The DataLoader's pin-memory thread calls `.pin_memory()` on objects that have one.
    def pin_memory(self) -> Batch:
        return Batch(
            dense_features=self.dense_features.pin_memory(),
            sparse_features=self.sparse_features.pin_memory(),
            labels=self.labels.pin_memory(),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        """Keep the memory alive until `stream` is done with it (batches copied on a side stream)."""
        self.dense_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)

    @property
    def batch_size(self) -> int:
        return self.labels.shape[0]

    def __len__(self) -> int:
        return self.labels.shape[0]


def passthrough_collate(batch: Batch) -> Batch:
    """collate_fn for datasets whose `__getitems__` already returns a whole `Batch`."""
    return batch
