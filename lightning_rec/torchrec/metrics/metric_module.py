"""`torchrec.metrics.metric_module`: RecMetricModule, every task's metrics updated and computed together
(docs/metrics.md#porting-from-torchrec)."""

from lightning_rec.torchrec.metrics import RecMetricModule  # noqa: F401

__all__ = ["RecMetricModule"]
