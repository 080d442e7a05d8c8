"""`torchrec.metrics.calibration`: CalibrationMetric, predicted over observed positives per task
(docs/metrics.md#porting-from-torchrec)."""

from lightning_rec.torchrec.metrics import CalibrationMetric  # noqa: F401

__all__ = ["CalibrationMetric"]
