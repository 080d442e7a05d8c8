"""`torchrec.metrics.throughput`: ThroughputMetric, samples per second over ranks
(docs/metrics.md#porting-from-torchrec)."""

from lightning_rec.torchrec.metrics import ThroughputMetric  # noqa: F401

__all__ = ["ThroughputMetric"]
