"""`torchrec.metrics.auc`: AUCMetric, exact weighted ROC AUC per task
(docs/metrics.md#porting-from-torchrec)."""

from lightning_rec.torchrec.metrics import AUCMetric  # noqa: F401

__all__ = ["AUCMetric"]
