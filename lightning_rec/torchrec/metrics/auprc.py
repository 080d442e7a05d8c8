"""`torchrec.metrics.auprc`: AUPRCMetric, area under the precision-recall curve per task
(docs/metrics.md#porting-from-torchrec)."""

from lightning_rec.torchrec.metrics import AUPRCMetric  # noqa: F401

__all__ = ["AUPRCMetric"]
