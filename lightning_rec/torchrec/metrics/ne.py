"""`torchrec.metrics.ne`: NEMetric, normalized entropy per task
(docs/metrics.md#porting-from-torchrec)."""

from lightning_rec.torchrec.metrics import NEMetric  # noqa: F401

__all__ = ["NEMetric"]
