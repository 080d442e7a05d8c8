"""MovieLens as labelled rows (`label_columns`): each rating a `Batch` row, user and item features as sparse
features, one label column per task (e.g. liked = rating >= 4), for rankers such as MultiTaskModule."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_rec.data.batch import Batch
from lightning_rec.data.movielens.batches import FeatureTable
from lightning_rec.sparse import KeyedJaggedTensor


class LabelledRowsDataset(Dataset):
    """Rows (user, item, labels [N, T]) -> one Batch per index list; index -1 (evaluation padding) is dropped."""

    def __init__(self, user_N: Tensor, item_N: Tensor, labels_NT: Tensor, task_names: Sequence[str],
                 users: FeatureTable, items: FeatureTable) -> None:
        self.user_N, self.item_N, self.labels_NT = user_N, item_N, labels_NT
        self.task_names = tuple(task_names)
        self.users, self.items = users, items

    def __len__(self) -> int:
        return self.user_N.shape[0]

    def __getitems__(self, indices: Sequence[int]) -> Batch:
        idx_B = torch.as_tensor(indices, dtype=torch.int64)
        idx_B = idx_B[idx_B >= 0]
        user_kjt, item_kjt = self.users.kjt(self.user_N[idx_B]), self.items.kjt(self.item_N[idx_B])
        B = idx_B.shape[0]
        sparse = KeyedJaggedTensor.from_lengths_sync(
            user_kjt.keys() + item_kjt.keys(), torch.cat([user_kjt.values(), item_kjt.values()]),
            torch.cat([user_kjt.lengths(), item_kjt.lengths()]), stride=B)
        return Batch(dense_features=torch.zeros(B, 0), sparse_features=sparse, labels=self.labels_NT[idx_B],
                     task_names=self.task_names)

    def __getitem__(self, index):
        return self.__getitems__([index] if isinstance(index, int) else index)
