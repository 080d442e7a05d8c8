"""`torchrec.datasets.random`: RandomRecDataset."""

from lightning_rec.data.random import RandomRecDataset

__all__ = ["RandomRecDataset"]
