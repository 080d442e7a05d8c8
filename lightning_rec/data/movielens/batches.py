"""The batches of MovieLens: training pairs (`RetrievalBatch`), users to rank (`RankingBatch`), and the per-row
categorical features both are built from (`FeatureTable`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_rec.data.batch import moved, parse_to
from lightning_rec.sparse import KeyedJaggedTensor, move_or_explain


@dataclass
class RetrievalBatch:
    """Training pairs: B (user, item) interactions, and optionally one sampled negative item each (BPR). item_log_q_B:
    log P(an in-batch item is this item), its training frequency, for the logQ correction."""

    user_features: KeyedJaggedTensor
    item_features: KeyedJaggedTensor
    user_index: Tensor  # [B] int64
    item_index: Tensor  # [B] int64
    item_log_q: Tensor  # [B] float32
    neg_item_features: KeyedJaggedTensor | None = None
    neg_item_index: Tensor | None = None

    def to(self, *args, **kwargs) -> RetrievalBatch:
        """nn.Module.to's arguments: a dtype converts item_log_q only (the floating tensor); ids keep their type."""
        device, dtype, non_blocking = parse_to("RetrievalBatch", args, kwargs)
        return move_or_explain(f"RetrievalBatch.to({str(device)!r})", device, lambda: RetrievalBatch(
            *(moved(getattr(self, f), device, dtype, non_blocking) for f in self.__dataclass_fields__)))

    def pin_memory(self) -> RetrievalBatch:
        return move_or_explain("RetrievalBatch.pin_memory()", None, lambda: RetrievalBatch(
            *(None if (x := getattr(self, f)) is None else x.pin_memory() for f in self.__dataclass_fields__)))

    def __len__(self) -> int:
        return self.user_index.shape[0]


@dataclass
class RankingBatch:
    """U users to rank against every item: targets (held out) and exclusions (seen) as CSR.

        target_offsets = [0, 2, 2, 5]: user 0's targets are target_items[0:2], user 1 has none
    """

    user_features: KeyedJaggedTensor
    user_index: Tensor  # [U]
    target_offsets: Tensor  # [U + 1]
    target_items: Tensor  # [R]
    exclude_offsets: Tensor  # [U + 1]
    exclude_items: Tensor  # [X]

    def to(self, *args, **kwargs) -> RankingBatch:
        """nn.Module.to's arguments; a dtype changes nothing here (ids and offsets keep their integer type)."""
        device, dtype, non_blocking = parse_to("RankingBatch", args, kwargs)
        return move_or_explain(f"RankingBatch.to({str(device)!r})", device, lambda: RankingBatch(
            *(moved(getattr(self, f), device, dtype, non_blocking) for f in self.__dataclass_fields__)))

    def pin_memory(self) -> RankingBatch:
        return move_or_explain("RankingBatch.pin_memory()", None, lambda: RankingBatch(
            *(getattr(self, f).pin_memory() for f in self.__dataclass_fields__)))

    def __len__(self) -> int:
        return self.user_index.shape[0]


def _gather_csr(offsets_N1: Tensor, values: Tensor, rows_B: Tensor) -> tuple[Tensor, Tensor]:
    """Rows of a CSR matrix, whole: (lengths_B, values of rows_B concatenated in order)."""
    starts_B = offsets_N1[rows_B]
    lengths_B = offsets_N1[rows_B + 1] - starts_B
    total = int(lengths_B.sum())
    if total == 0:
        return lengths_B, values[:0]
    # position of each output value: its row's start + its rank inside the row
    row_start_out_B = torch.cumsum(lengths_B, 0) - lengths_B
    within = torch.arange(total) - torch.repeat_interleave(row_start_out_B, lengths_B, output_size=total)
    return lengths_B, values[torch.repeat_interleave(starts_B, lengths_B, output_size=total) + within]


class FeatureTable:
    """Per-row categorical features of users or items: single ids [N, F1] and bags (CSR); -> KJT."""

    def __init__(self, single: dict[str, tuple[Tensor, int]], bags: dict[str, tuple[Tensor, Tensor, int]]) -> None:
        self.single = single  # name -> (ids_N, num_embeddings)
        self.bags = bags  # name -> (offsets_N1, values, num_embeddings)
        self.keys = list(single) + list(bags)
        self._single_NF = torch.stack([ids for ids, _ in single.values()], dim=1) if single else None

    @property
    def num_embeddings(self) -> dict[str, int]:
        return {**{k: n for k, (_, n) in self.single.items()}, **{k: n for k, (_, _, n) in self.bags.items()}}

    def kjt(self, rows_B: Tensor) -> KeyedJaggedTensor:
        B = rows_B.shape[0]
        values, lengths = [], []
        if self._single_NF is not None:
            values.append(self._single_NF[rows_B].t().reshape(-1))  # key-major
            lengths.append(torch.ones(B * len(self.single), dtype=torch.int64))
        for offsets, bag_values, _ in self.bags.values():
            lengths_B, values_B = _gather_csr(offsets, bag_values, rows_B)
            values.append(values_B)
            lengths.append(lengths_B)
        return KeyedJaggedTensor.from_lengths_sync(self.keys, torch.cat(values), torch.cat(lengths), stride=B)
