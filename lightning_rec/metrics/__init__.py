"""Metrics on torchmetrics, synced across ranks: per task with TorchRec's definitions (tasks.py, multitask.py:
docs/metrics.md), the same over one click label under their one-label names (ctr.py) and top-K ranking
(ranking.py)."""

from lightning_rec.metrics.ctr import (
    AUC,
    CTR,
    BinnedAUC,
    LogLoss,
    NormalizedEntropy,
    RecMetricCollection,
    binary_entropy,
    exact_auc,
)
from lightning_rec.metrics.multitask import TaskMetrics, WindowedTaskMetric, WindowedTaskMetrics
from lightning_rec.metrics.ranking import (
    MRR,
    NDCG,
    RANKING_METRICS,
    HitRate,
    Precision,
    RankingMetrics,
    Recall,
)
from lightning_rec.metrics.tasks import (
    TASK_METRICS,
    RecTaskInfo,
    TaskAUC,
    TaskAUPRC,
    TaskBinnedAUC,
    TaskCalibration,
    TaskCalibrationCurve,
    TaskCTR,
    TaskGAUC,
    TaskLogLoss,
    TaskMAE,
    TaskMetric,
    TaskMSE,
    TaskNE,
    TaskRMSE,
    Throughput,
    weighted_auc,
    weighted_auprc,
)

__all__ = [
    "AUC", "CTR", "MRR", "NDCG", "RANKING_METRICS", "BinnedAUC", "HitRate", "LogLoss", "NormalizedEntropy", "Precision",
    "RankingMetrics", "Recall", "RecMetricCollection", "binary_entropy", "exact_auc",
    "TASK_METRICS", "RecTaskInfo", "TaskAUC", "TaskAUPRC", "TaskBinnedAUC", "TaskCalibration", "TaskCalibrationCurve",
    "TaskCTR", "TaskGAUC",
    "TaskLogLoss", "TaskMAE", "TaskMetric", "TaskMSE", "TaskNE", "TaskRMSE", "Throughput", "TaskMetrics",
    "WindowedTaskMetric", "WindowedTaskMetrics", "weighted_auc", "weighted_auprc"]
