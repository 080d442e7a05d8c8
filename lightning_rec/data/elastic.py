"""An epoch begun at N ranks, finished at M (docs/checkpoints.md#resume-at-another-world-size).

torch's DistributedSampler deals position p of the epoch's permutation (padded to a multiple of the ranks, or cut
to one under drop_last) to rank p % W, and a rank's batch k holds its local rows k*B .. (k+1)*B - 1: after s steps
the W ranks have read exactly positions [0, min(s*B, share) * W). A checkpoint records that count
(`rows_consumed`); a run at M ranks deals the permutation's positions from there over its M ranks, the same way.

A source of an epoch's rows (this sampler, or an IterableDataset that deals its own rows, as the preprocessed Criteo
shards) takes part through two methods: `elastic_state(epoch, batches, batch_size, finished, loader_state)`, what a
checkpoint records (`loader_state`: the loader's own state at that point, where a stream finds its readers' places),
and `continue_epoch(epoch, elastic, lead_batches, batch_size)`, which continues that epoch here (False: it was over;
`elastic`: the first saved rank's record, with every saved rank's under "ranks").
Both order the epoch's rows so that W ranks after s steps have read a prefix of them, and deal the rest with `deal`
(a Criteo stream deals its rest the same way, its order made of its readers' rests: criteo/stream_elastic.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler

# what a checkpoint's loader state holds, from the format that can continue an epoch at another world size on
ELASTIC_KEY = "elastic"


class ElasticDistributedSampler(DistributedSampler):
    """torch's DistributedSampler (the same order and deal, the same checkpoints), which can also continue an epoch
    that other ranks began: `resume(epoch, start, lead_batches, batch_size)` makes epoch `epoch` the permutation's
    positions `start`.. dealt over this sampler's ranks (padded by repeating the first of them, or cut to a multiple
    of the ranks under drop_last, as torch does a whole epoch). `len()` covers the `lead_batches` the loop counted
    before the resume and what is left: Lightning sizes the epoch from it."""

    fingerprint_name = "DistributedSampler"  # a checkpoint of torch's sampler resumes in this one and back
    _resume: tuple[int, int, int, int] | None = None  # (epoch, start, lead_batches, batch_size)

    def resume(self, epoch: int, start: int, lead_batches: int, batch_size: int) -> None:
        self._resume = (int(epoch), min(int(start), len(self.dataset)), int(lead_batches), int(batch_size))

    def _resumed(self) -> tuple[int, int, int]:
        """(start, lead_batches, batch_size) of the current epoch: zeros unless it continues another world size's."""
        if self._resume is not None and self._resume[0] == self.epoch:
            return self._resume[1:]
        return 0, 0, 0

    def share(self) -> int:
        """This rank's rows of the current epoch (of what is left of it, in a resumed one)."""
        start = self._resumed()[0]
        left = len(self.dataset) - start
        return left // self.num_replicas if self.drop_last else math.ceil(left / self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        start = self._resumed()[0]
        if not start:
            return super().__iter__()
        if self.shuffle:  # torch's permutation of the epoch
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=g)[start:].tolist()
        else:
            order = list(range(start, len(self.dataset)))
        return iter(deal(order, self.rank, self.num_replicas, self.share()))

    def __len__(self) -> int:
        start, lead_batches, batch_size = self._resumed()
        if not start:
            return self.num_samples
        # at least the steps counted plus the batches left (the rows are what is left): Lightning keeps this length
        # for the epochs after, so it is never less than a whole epoch's
        return max(self.num_samples, lead_batches * batch_size + self.share())

    def elastic_state(self, epoch: int, batches: int, batch_size: int, finished: bool,
                      loader_state: dict | None = None) -> dict:
        """What a loader's checkpoint records for a run at another world size after `batches` of epoch `epoch` (this
        sampler's own; `finished`: the epoch is over)."""
        consumed = len(self.dataset) if finished else self.rows_consumed(batches, batch_size)
        return {"world_size": self.num_replicas, "rows_consumed": consumed}

    def continue_epoch(self, epoch: int, elastic: dict, lead_batches: int, batch_size: int) -> bool:
        """Epoch `epoch` from `elastic` (elastic_state of another world size); False: that epoch was over."""
        if elastic["rows_consumed"] >= len(self.dataset):
            return False
        self.resume(epoch, elastic["rows_consumed"], lead_batches, batch_size)
        return True

    def rows_consumed(self, batches: int, batch_size: int) -> int:
        """Positions of the current epoch's permutation that all ranks have read after `batches` batches each (the
        loop's count); the dataset's length once this rank's share has no batch left (the rest, a drop_last
        remainder, is read by no rank this epoch)."""
        start, lead_batches, _ = self._resumed()
        share = self.share()
        read = (batches - lead_batches) * batch_size
        if read >= share or (self.drop_last and read + batch_size > share):
            return len(self.dataset)
        return min(start + read * self.num_replicas, len(self.dataset))


def deal(order: list, rank: int, world: int, share: int) -> list:
    """Rank `rank`'s positions of `order` dealt over `world` ranks, `share` each: position p to rank p % world, as
    torch's DistributedSampler deals; fewer than share * world positions are padded with the first ones again."""
    total = share * world
    if len(order) < total:
        order = list(order) + (list(order) * math.ceil((total - len(order)) / len(order)))[:total - len(order)]
    return order[rank:total:world]
