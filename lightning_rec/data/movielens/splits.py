"""The splits of MovieLens' interactions into train (0), validation (1) and test (2): their names, and RecBole's
RO / TO ratio splits and leave-one-out (docs/movielens.md)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

OFFICIAL_SPLITS = ("u1", "u2", "u3", "u4", "u5", "ua", "ub")  # ml-100k's own files
TEMPORAL_SPLITS = ("to_811", "loo")  # each user's interactions in time order
GIVEN = "given"  # the log's own split files (train / validation / test)
SPLITS = ("ro_811", *TEMPORAL_SPLITS, *OFFICIAL_SPLITS, GIVEN)
# a word of a file's name -> the part it holds (0 train, 1 validation, 2 test), for split="given"
_SPLIT_WORDS = {"train": 0, "training": 0, "valid": 1, "validation": 1, "val": 1, "dev": 1, "test": 2}


def ro_split(user_N: Tensor, ratios: Sequence[float], seed: int) -> Tensor:
    """RecBole's RO split: per user, random order, ratio counts -> part of each interaction (0, 1, 2)."""
    g = torch.Generator().manual_seed(seed)
    return _ratio_parts(user_N, ratios, torch.randperm(user_N.shape[0], generator=g))


def to_split(user_N: Tensor, time_N: Tensor, ratios: Sequence[float]) -> Tensor:
    """RecBole's TO split: per user, time order (ties: file order), ratio counts -> part (0, 1, 2)."""
    return _ratio_parts(user_N, ratios, torch.sort(time_N, stable=True).indices)


def loo_split(user_N: Tensor, time_N: Tensor) -> Tensor:
    """Leave-one-out (RecBole's LS "valid_and_test"): per user in time order, the last interaction is
    test (2), the one before validation (1), the rest train (0); a user leaves out at most n - 1."""
    order_N, pos_N, count_N = _grouped(user_N, torch.sort(time_N, stable=True).indices)
    left_out_N = torch.clamp(count_N - 1, max=2)
    part_sorted = torch.where(pos_N >= count_N - left_out_N, pos_N - count_N + 3, 0)
    part_N = torch.empty_like(part_sorted)
    part_N[order_N] = part_sorted
    return part_N


def _grouped(user_N: Tensor, within_N: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Interactions grouped by user in `within_N`'s order: (order_N, position in its user, its user's count)."""
    order_N = within_N[torch.sort(user_N[within_N], stable=True).indices]
    _, counts_U = torch.unique_consecutive(user_N[order_N], return_counts=True)
    starts_U = torch.cumsum(counts_U, 0) - counts_U
    pos_N = torch.arange(user_N.shape[0]) - torch.repeat_interleave(starts_U, counts_U)
    return order_N, pos_N, torch.repeat_interleave(counts_U, counts_U)


def _ratio_parts(user_N: Tensor, ratios: Sequence[float], within_N: Tensor) -> Tensor:
    """Per user, in `within_N`'s order, RecBole's ratio counts: the first int-rounded share trains, and so on."""
    order_N, pos_in_user, _ = _grouped(user_N, within_N)
    _, counts_U = torch.unique_consecutive(user_N[order_N], return_counts=True)
    tot_U = counts_U.double()
    cnt_UP = torch.stack([torch.floor(tot_U * r) for r in ratios], 1)  # int(ratio * tot), as RecBole
    cnt_UP[:, 0] = tot_U - cnt_UP[:, 1:].sum(1)
    for p in range(len(ratios) - 1, 0, -1):  # RecBole: a part that rounds to 0 gets one from training
        bump = (cnt_UP[:, 0] > 1) & (tot_U * ratios[p] > 0) & (tot_U * ratios[p] < 1)
        cnt_UP[bump, p] += 1
        cnt_UP[bump, 0] -= 1
    ends_NP = torch.repeat_interleave(cnt_UP.cumsum(1), counts_U, dim=0)
    part_sorted = (pos_in_user.unsqueeze(1).double() >= ends_NP).sum(1)
    part_N = torch.empty(user_N.shape[0], dtype=torch.int64)
    part_N[order_N] = part_sorted
    return part_N


def _csr_by_user(user_N: Tensor, item_N: Tensor, num_users: int) -> tuple[Tensor, Tensor]:
    order = torch.argsort(user_N * (item_N.max() + 1 if item_N.numel() else 1) + item_N)
    counts = torch.bincount(user_N, minlength=num_users)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    return offsets, item_N[order]
