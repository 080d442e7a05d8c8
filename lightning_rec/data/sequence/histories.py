"""Each user's history in time order, its leave-one-out split, and the jagged batches cut from it (docs/sequential.md).

Shapes: N interactions, U users, B users of a batch, T input positions of a batch (sum of its lengths).

    offsets_U1 = [0, 3, 8]    user 0's history is items[0:3] (oldest first), user 1's items[3:8]"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lightning_rec.data.batch import moved, parse_to
from lightning_rec.sparse import KeyedJaggedTensor, move_or_explain

ITEM_KEY = "item_id"  # the KJT key of a batch's item ids


def user_histories(user_N: np.ndarray, time_N: np.ndarray, num_users: int) -> tuple[np.ndarray, np.ndarray]:
    """(order_N, offsets_U1): the interactions grouped by user, each user's in time order. Ties keep the log's own
    order (a stable sort), and a log whose timestamps go backwards is read in time order, not file order."""
    order_N = np.lexsort((time_N, user_N))  # lexsort is stable: equal (user, time) keep their file order
    counts_U = np.bincount(user_N, minlength=num_users)
    return order_N, np.concatenate([[0], np.cumsum(counts_U)]).astype(np.int64)


def loo_lengths(offsets_U1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Leave-one-out per user (the SASRec and HSTU papers'): (train_len_U, evaluated_U). A user of n >= 3
    interactions trains on the first n - 2, is validated on item n - 2 and tested on the last; a user of 2
    trains on both and is not evaluated; a user of 1 has no target at all (train_len 0: skipped)."""
    n_U = np.diff(offsets_U1)
    evaluated_U = n_U >= 3
    train_len_U = np.where(evaluated_U, n_U - 2, np.where(n_U == 2, 2, 0))
    return train_len_U, evaluated_U


def ranges(start_B: Tensor, length_B: Tensor) -> Tensor:
    """start_B[b] + 0..length_B[b]-1 for every b, concatenated: the positions of B slices of one flat array."""
    total = int(length_B.sum())
    first_B = torch.cumsum(length_B, 0) - length_B
    within = torch.arange(total) - torch.repeat_interleave(first_B, length_B, output_size=total)
    return torch.repeat_interleave(start_B, length_B, output_size=total) + within


@dataclass
class SequenceBatch:
    """B users' histories as one jagged batch (never padded): `items` holds each user's input item ids, oldest first,
    under the key "item_id"; `timestamps` the time of each of them.

    Training: `targets` has one entry per input position, the next item of the history there (causal).
    Evaluation: `targets` has one entry per user, the held-out item after its history; `exclude_offsets` /
    `exclude_items` (CSR) are the user's whole history before it (what `exclude_history` leaves out of the ranking).

        lengths = [2, 3], items = [a b | c d e]   training targets = [b c' | d e f] (each position's next item)"""

    user_index: Tensor  # [B]
    items: KeyedJaggedTensor  # one key, "item_id": values [T], lengths [B]
    timestamps: Tensor  # [T] int64
    targets: Tensor  # [T] in training, [B] in evaluation
    exclude_offsets: Tensor | None = None  # [B + 1]
    exclude_items: Tensor | None = None  # [X]
    # training: the model's item-table lookup of the step and its scored candidates, added in the data path
    # (SequenceDataModule.on_before_batch_transfer calls the model's prepare_batch: a pipeline routes them ahead)
    lookup: KeyedJaggedTensor | None = None
    candidates: Tensor | None = None  # [C]

    @property
    def lengths(self) -> Tensor:
        return self.items.lengths()

    @property
    def item_ids(self) -> Tensor:
        return self.items.values()

    def to(self, *args, **kwargs) -> SequenceBatch:
        """nn.Module.to's arguments; a dtype changes nothing here (ids, times and offsets keep their integer type)."""
        device, _, non_blocking = parse_to("SequenceBatch", args, kwargs)
        return move_or_explain(f"SequenceBatch.to({str(device)!r})", device, lambda: SequenceBatch(
            *(moved(getattr(self, f), device, None, non_blocking) for f in self.__dataclass_fields__)))

    def pin_memory(self) -> SequenceBatch:
        return move_or_explain("SequenceBatch.pin_memory()", None, lambda: SequenceBatch(
            *(None if (x := getattr(self, f)) is None else x.pin_memory() for f in self.__dataclass_fields__)))

    def __len__(self) -> int:
        return self.user_index.shape[0]


def _kjt(values_T: Tensor, lengths_B: Tensor, input_ids: Tensor | None) -> KeyedJaggedTensor:
    """input_ids: the raw id of each item row (hash_ids=False), or None (the rows themselves)."""
    values_T = values_T if input_ids is None else input_ids[values_T]
    return KeyedJaggedTensor.from_lengths_sync([ITEM_KEY], values_T, lengths_B, stride=lengths_B.shape[0])


class SequenceTrainDataset(torch.utils.data.Dataset):
    """One sample per user with a training target; `__getitems__` builds a whole `SequenceBatch`: the last
    max_len + 1 items of the user's training part, inputs all but the last, targets all but the first."""

    def __init__(self, items_N: Tensor, times_N: Tensor, start_U: Tensor, train_len_U: Tensor, max_len: int,
                 input_ids: Tensor | None = None) -> None:
        self.input_ids = input_ids
        self.users_S = torch.nonzero(train_len_U >= 2).flatten()
        self.items_N, self.times_N, self.max_len = items_N, times_N, max_len
        self.end_S = start_U[self.users_S] + train_len_U[self.users_S]  # exclusive
        self.take_S = train_len_U[self.users_S].clamp(max=max_len + 1)  # the most recent max_len + 1 kept

    def __len__(self) -> int:
        return self.users_S.shape[0]

    def __getitems__(self, indices) -> SequenceBatch:
        idx_B = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        idx_B = idx_B[idx_B >= 0]
        end_B, take_B = self.end_S[idx_B], self.take_S[idx_B]
        inputs_T = ranges(end_B - take_B, take_B - 1)
        return SequenceBatch(self.users_S[idx_B], _kjt(self.items_N[inputs_T], take_B - 1, self.input_ids),
                             self.times_N[inputs_T], self.items_N[inputs_T + 1])

    def __getitem__(self, index):
        return self.__getitems__([index] if isinstance(index, int) else index)


class SequenceEvalDataset(torch.utils.data.Dataset):
    """One sample per evaluated user: the history before its held-out item (the last max_len of it) and the item;
    index -1 is padding (dropped, see `make_eval_loader`)."""

    def __init__(self, items_N: Tensor, times_N: Tensor, start_U: Tensor, target_at_U: Tensor, users_E: Tensor,
                 max_len: int, input_ids: Tensor | None = None) -> None:
        self.users_E, self.items_N, self.times_N, self.input_ids = users_E, items_N, times_N, input_ids
        self.start_E, self.target_at_E = start_U[users_E], target_at_U[users_E]
        self.max_len = max_len

    def __len__(self) -> int:
        return self.users_E.shape[0]

    def __getitems__(self, indices) -> SequenceBatch:
        idx_B = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        idx_B = idx_B[idx_B >= 0]
        start_B, at_B = self.start_E[idx_B], self.target_at_E[idx_B]
        history_B = at_B - start_B
        take_B = history_B.clamp(max=self.max_len)
        inputs_T = ranges(at_B - take_B, take_B)
        zero = torch.zeros(1, dtype=torch.int64)
        return SequenceBatch(self.users_E[idx_B], _kjt(self.items_N[inputs_T], take_B, self.input_ids),
                             self.times_N[inputs_T], self.items_N[at_B], torch.cat([zero, history_B.cumsum(0)]),
                             self.items_N[ranges(start_B, history_B)])

    def __getitem__(self, index):
        return self.__getitems__([index] if isinstance(index, int) else index)
