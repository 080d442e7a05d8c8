"""`torchrec.metrics.gauc`: GAUCMetric, AUC per group averaged over groups
(docs/metrics.md#porting-from-torchrec)."""

from lightning_rec.torchrec.metrics import GAUCMetric  # noqa: F401

__all__ = ["GAUCMetric"]
