"""`torchrec.metrics.mae`: MAEMetric, absolute error per regression task
(docs/metrics.md#porting-from-torchrec)."""

from lightning_rec.torchrec.metrics import MAEMetric  # noqa: F401

__all__ = ["MAEMetric"]
