"""`torchrec.metrics.rec_metric`: RecMetric, the per-task metric base class
(docs/metrics.md#porting-from-torchrec)."""

from lightning_rec.torchrec.metrics import RecMetric  # noqa: F401

__all__ = ["RecMetric"]
