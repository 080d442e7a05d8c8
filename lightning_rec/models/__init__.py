"""Models: DLRM, DLRM-DCNv2, two-tower retrieval, SASRec and HSTU, and their LightningModules."""

from lightning_rec.models.dlrm import (
    DLRM,
    DLRM_DCN,
    MLP,
    DLRM_Projection,
    DLRMTrain,
    InteractionArch,
    InteractionDCNArch,
    InteractionProjectionArch,
    LowRankCrossNet,
)
from lightning_rec.models.dlrm_module import DLRMModule
from lightning_rec.models.sequential_module import HSTU, SASRec
from lightning_rec.models.two_tower import Tower, TwoTower
from lightning_rec.models.two_tower_module import TwoTowerModule

__all__ = ["DLRM", "DLRM_DCN", "DLRMModule", "HSTU", "SASRec",
           "DLRMTrain", "DLRM_Projection", "InteractionArch", "InteractionDCNArch",
           "InteractionProjectionArch", "LowRankCrossNet", "MLP", "Tower", "TwoTower", "TwoTowerModule"]
