"""`torchrec.datasets.utils`: the Batch of dense features, sparse features (a KJT) and labels."""

from lightning_rec.data.batch import Batch

__all__ = ["Batch"]
