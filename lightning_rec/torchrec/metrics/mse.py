"""`torchrec.metrics.mse`: MSEMetric and RMSEMetric, squared error per regression task
(docs/metrics.md#porting-from-torchrec)."""

from lightning_rec.torchrec.metrics import MSEMetric, RMSEMetric  # noqa: F401

__all__ = ["MSEMetric", "RMSEMetric"]
