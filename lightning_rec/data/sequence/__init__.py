"""Users' histories as jagged sequences for sequential recommendation (docs/sequential.md)."""

from lightning_rec.data.sequence.datamodule import SequenceDataModule, SequenceReport
from lightning_rec.data.sequence.histories import (
    ITEM_KEY,
    SequenceBatch,
    SequenceEvalDataset,
    SequenceTrainDataset,
    loo_lengths,
    user_histories,
)

__all__ = ["ITEM_KEY", "SequenceBatch", "SequenceDataModule", "SequenceEvalDataset", "SequenceReport",
           "SequenceTrainDataset", "loo_lengths", "user_histories"]
