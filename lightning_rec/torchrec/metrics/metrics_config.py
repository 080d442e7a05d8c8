"""`torchrec.metrics.metrics_config`: RecTaskInfo, a task's name and its label, prediction and weight columns
(docs/metrics.md#porting-from-torchrec)."""

from lightning_rec.torchrec.metrics import RecTaskInfo  # noqa: F401

__all__ = ["RecTaskInfo"]
