"""`torchrec.metrics.ctr`: CTRMetric, the weighted mean label per task
(docs/metrics.md#porting-from-torchrec)."""

from lightning_rec.torchrec.metrics import CTRMetric  # noqa: F401

__all__ = ["CTRMetric"]
