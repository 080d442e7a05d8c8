"""Metrics on torchmetrics, synced across ranks: click-through (ctr.py) and top-K ranking (ranking.py)."""

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
from lightning_rec.metrics.ranking import (
    MRR,
    NDCG,
    RANKING_METRICS,
    HitRate,
    Precision,
    RankingMetrics,
    Recall,
)

__all__ = [
    "AUC", "CTR", "MRR", "NDCG", "RANKING_METRICS", "BinnedAUC", "HitRate", "LogLoss", "NormalizedEntropy", "Precision",
    "RankingMetrics", "Recall", "RecMetricCollection", "binary_entropy", "exact_auc"]
