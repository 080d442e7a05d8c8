"""MovieLens' datasets: whole batches from index lists (`__getitems__`), and the sampler that shards evaluation users
over ranks without repeating any."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler

from lightning_rec.data.movielens.batches import FeatureTable, RankingBatch, RetrievalBatch, _gather_csr


class InteractionDataset(Dataset):
    """Training (user, item) pairs; one item of the loader = one RetrievalBatch (`__getitems__`). With
    `num_negatives=1` each pair gets one item drawn uniformly among the items the user has not seen (BPR)."""

    def __init__(self, user_N: Tensor, item_N: Tensor, users: FeatureTable, items: FeatureTable, num_items: int,
                 num_negatives: int, seed: int, epoch_in_seed: bool = False) -> None:
        self.user_N, self.item_N = user_N, item_N
        # unshuffled, the epoch (in shared memory, for loader workers) varies the negatives (_batch_generator)
        self.epoch_in_seed = epoch_in_seed
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.users, self.items, self.num_items = users, items, num_items
        counts_I = torch.bincount(item_N, minlength=num_items).double()
        # an item absent from training has frequency 0; clamp so log q stays finite (it is never in a batch)
        self.log_q_I = torch.log(counts_I.clamp(min=1) / max(item_N.shape[0], 1)).float()
        self.num_negatives = num_negatives
        self._pairs_sorted = torch.unique(user_N * num_items + item_N)  # sorted; each seen (user, item) once
        self._seed_key = (seed + 7).to_bytes(8, "little", signed=True)
        if num_negatives:
            seen_U = torch.bincount(self._pairs_sorted // num_items)
            full = int((seen_U >= num_items).sum())
            if full:
                warnings.warn(f"{full} training users interacted with every one of the {num_items} items: BPR has "
                              f"no unseen item to draw as their negative, so their pairs train against a seen one. "
                              f"Drop those users, or use loss='softmax' (num_negatives=0)", UserWarning, stacklevel=2)

    def __len__(self) -> int:
        return self.user_N.shape[0]

    def set_epoch(self, epoch: int) -> None:
        """The pass the loader starts (StatefulBatchLoader calls it with the fit loop's epoch)."""
        self._epoch[0] = int(epoch)

    def _batch_generator(self, idx_B: Tensor) -> torch.Generator:
        """A generator seeded by the batch itself (its pair indices and the module's seed), so that a batch draws the
        same negatives wherever and whenever it is drawn (a resumed run, a loader worker). Without shuffling
        (`epoch_in_seed`) the epoch is part of the seed, so each epoch's negatives differ."""
        data = idx_B.numpy().tobytes()
        if self.epoch_in_seed:
            data += int(self._epoch[0]).to_bytes(8, "little", signed=True)
        digest = hashlib.blake2b(data, digest_size=8, key=self._seed_key).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))

    def _seen(self, user_B: Tensor, item_B: Tensor) -> Tensor:
        key_B = user_B * self.num_items + item_B
        pos = torch.searchsorted(self._pairs_sorted, key_B).clamp(max=self._pairs_sorted.numel() - 1)
        return self._pairs_sorted[pos] == key_B

    def _unseen_item(self, user: int, gen: torch.Generator) -> int:
        """An item drawn uniformly among those `user` has not seen, exactly (any item if it has seen all)."""
        lo, hi = torch.searchsorted(self._pairs_sorted, torch.tensor([user, user + 1]) * self.num_items).tolist()
        seen = self._pairs_sorted[lo:hi] - user * self.num_items  # sorted
        if seen.numel() >= self.num_items:
            return int(torch.randint(self.num_items, (1,), generator=gen))  # none unseen (warned at construction)
        r = torch.randint(self.num_items - seen.numel(), (1,), generator=gen)
        # the r-th unseen item is r plus the seen items at or below it: seen[j] - j counts the unseen below seen[j]
        return int(r + torch.searchsorted(seen - torch.arange(seen.numel()), r, right=True))

    def _negatives(self, user_B: Tensor, idx_B: Tensor) -> Tensor:
        gen = self._batch_generator(idx_B)
        neg_B = torch.randint(self.num_items, user_B.shape, generator=gen)
        for _ in range(10):  # redraw the ones the user has (few: ml-100k users hold ~6% of items)
            seen_B = self._seen(user_B, neg_B)
            if not bool(seen_B.any()):
                return neg_B
            neg_B = torch.where(seen_B, torch.randint(self.num_items, user_B.shape, generator=gen), neg_B)
        # still seen after 10 draws: drawn among the unseen items exactly (uniform over them)
        for j in self._seen(user_B, neg_B).nonzero().flatten().tolist():
            neg_B[j] = self._unseen_item(int(user_B[j]), gen)
        return neg_B

    def __getitems__(self, indices: Sequence[int]) -> RetrievalBatch:
        idx_B = torch.as_tensor(indices, dtype=torch.int64)
        user_B, item_B = self.user_N[idx_B], self.item_N[idx_B]
        batch = RetrievalBatch(self.users.kjt(user_B), self.items.kjt(item_B), user_B, item_B, self.log_q_I[item_B])
        if self.num_negatives:
            neg_B = self._negatives(user_B, idx_B)
            batch.neg_item_features, batch.neg_item_index = self.items.kjt(neg_B), neg_B
        return batch

    def __getitem__(self, index):
        return self.__getitems__([index] if isinstance(index, int) else index)


class UserRankingDataset(Dataset):
    """One sample per user to rank; index -1 is padding (dropped: see `EvalShardSampler`)."""

    def __init__(self, users_U: Tensor, users: FeatureTable, target: tuple[Tensor, Tensor],
                 exclude: tuple[Tensor, Tensor]) -> None:
        self.users_U, self.users = users_U, users
        self.target, self.exclude = target, exclude

    def __len__(self) -> int:
        return self.users_U.shape[0]

    def __getitems__(self, indices: Sequence[int]) -> RankingBatch:
        idx_U = torch.as_tensor(indices, dtype=torch.int64)
        user_U = self.users_U[idx_U[idx_U >= 0]]
        t_len, t_items = _gather_csr(*self.target, user_U)
        x_len, x_items = _gather_csr(*self.exclude, user_U)
        zero = torch.zeros(1, dtype=torch.int64)
        return RankingBatch(self.users.kjt(user_U), user_U, torch.cat([zero, t_len.cumsum(0)]), t_items,
                            torch.cat([zero, x_len.cumsum(0)]), x_items)

    def __getitem__(self, index):
        return self.__getitems__([index] if isinstance(index, int) else index)


class EvalShardSampler(DistributedSampler):
    """Every user once over all ranks (not DistributedSampler's repeats): rank r takes users r, r + W, ...; shorter
    shares are padded with -1, which the dataset drops, so every rank runs the same number of batches."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)

    def __iter__(self):
        n, w = len(self.dataset), self.num_replicas
        mine = list(range(self.rank, n, w))
        return iter(mine + [-1] * (self.num_samples - len(mine)))

    def __len__(self) -> int:
        return self.num_samples
