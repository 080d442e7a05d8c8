"""`torchrec.metrics`: RecTaskInfo and the metrics a port reads (NE, calibration, CTR, AUC, grouped AUC, AUPRC,
MSE, MAE, throughput) under TorchRec's class names, each with TorchRec's definition and one value per task
(docs/metrics.md#porting-from-torchrec). They are torchmetrics Metrics: built with `tasks=[RecTaskInfo(...)]` and
updated with (predictions [B, T], labels [B, T], weights=...), not TorchRec's RecMetric constructor."""

from lightning_rec.metrics import (  # noqa: F401
    RecTaskInfo,
    TaskAUC,
    TaskAUPRC,
    TaskCalibration,
    TaskCTR,
    TaskGAUC,
    TaskLogLoss,
    TaskMAE,
    TaskMetric,
    TaskMetrics,
    TaskMSE,
    TaskNE,
    TaskRMSE,
    Throughput,
)

AUCMetric, AUPRCMetric, CalibrationMetric, CTRMetric = TaskAUC, TaskAUPRC, TaskCalibration, TaskCTR
GAUCMetric = TaskGAUC
LogLossMetric, MAEMetric, MSEMetric, NEMetric, RMSEMetric = TaskLogLoss, TaskMAE, TaskMSE, TaskNE, TaskRMSE
RecMetric, RecMetricModule, ThroughputMetric = TaskMetric, TaskMetrics, Throughput

__all__ = ["AUCMetric", "AUPRCMetric", "CTRMetric", "CalibrationMetric", "GAUCMetric", "LogLossMetric", "MAEMetric",
           "MSEMetric", "NEMetric", "RMSEMetric", "RecMetric", "RecMetricModule", "RecTaskInfo", "ThroughputMetric"]
