"""Random batches of a recommendation model's shape (TorchRec's `RandomRecDataset`, with its arguments).

Each batch: `batch_size` samples; per key, a bag of min..max ids (uniform count) drawn uniformly from the key's
hash size; `num_dense` standard-normal dense features; 0/1 labels. No signal is planted: for throughput runs and
smoke tests (SyntheticCriteoDataset is the one a model can learn from)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import IterableDataset

from lightning_rec.data.batch import Batch
from lightning_rec.sparse import KeyedJaggedTensor


def _per_key(name: str, one: int | None, many: Sequence[int] | None, default: int, keys: Sequence[str]) -> list[int]:
    if many is None:
        return [one if one else default] * len(keys)
    if len(many) != len(keys):
        raise ValueError(f"RandomRecDataset: {name} has {len(many)} entries for {len(keys)} keys: give one per key")
    return list(many)


class RandomRecDataset(IterableDataset):
    """Endless (or `num_batches`) random Batches; `num_generated_batches` of them made once and cycled (negative:
    a new one each time). `manual_seed` makes the draw repeatable."""

    def __init__(self, keys: Sequence[str], batch_size: int, hash_size: int | None = None,
                 hash_sizes: Sequence[int] | None = None, ids_per_feature: int | None = None,
                 ids_per_features: Sequence[int] | None = None, num_dense: int = 50, manual_seed: int | None = None,
                 num_batches: int | None = None, num_generated_batches: int = 10,
                 min_ids_per_feature: int | None = None, min_ids_per_features: Sequence[int] | None = None) -> None:
        super().__init__()
        self.keys = list(keys)
        self.batch_size = batch_size
        self.hash_sizes = _per_key("hash_sizes", hash_size, hash_sizes, 100, keys)
        self.ids_per_features = _per_key("ids_per_features", ids_per_feature, ids_per_features, 2, keys)
        if min_ids_per_feature is None:  # TorchRec's: a fixed count when only ids_per_feature is given
            min_ids_per_feature = ids_per_feature
        self.min_ids_per_features = _per_key("min_ids_per_features", min_ids_per_feature, min_ids_per_features, 0,
                                             keys)
        self.num_dense = num_dense
        self.num_batches = num_batches
        self.generator = torch.Generator().manual_seed(manual_seed) if manual_seed is not None else None
        self.num_generated_batches = num_generated_batches
        self._cached = [self._generate() for _ in range(max(num_generated_batches, 0))]

    def _generate(self) -> Batch:
        g, B = self.generator, self.batch_size
        lengths = [torch.randint(lo, hi + 1, (B,), dtype=torch.int32, generator=g)
                   for lo, hi in zip(self.min_ids_per_features, self.ids_per_features)]
        values = [torch.randint(0, n, (int(length.sum()),), generator=g) for n, length in zip(self.hash_sizes, lengths)]
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=self.keys, values=torch.cat(values),
                                                     lengths=torch.cat(lengths))
        return Batch(dense_features=torch.randn(B, self.num_dense, generator=g), sparse_features=sparse,
                     labels=torch.randint(0, 2, (B,), generator=g))

    def _batches(self) -> Iterator[Batch]:
        if self._cached:
            return itertools.cycle(self._cached)
        return (self._generate() for _ in itertools.count())

    def __iter__(self) -> Iterator[Batch]:
        return itertools.islice(self._batches(), self.num_batches)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("RandomRecDataset without num_batches is endless: it has no len()")
        return self.num_batches
