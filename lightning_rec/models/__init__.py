"""Models: DLRM, DLRM-DCNv2, two-tower retrieval, and their LightningModules."""

from lightning_rec.models.dlrm import (
    DLRM,
    DLRM_DCN,
    MLP,
    DLRMTrain,
    InteractionArch,
    InteractionDCNArch,
    LowRankCrossNet,
)
from lightning_rec.models.dlrm_module import DLRMModule
from lightning_rec.models.two_tower import Tower, TwoTower
from lightning_rec.models.two_tower_module import TwoTowerModule

__all__ = ["DLRM", "DLRM_DCN", "DLRMModule", "DLRMTrain", "InteractionArch", "InteractionDCNArch", "LowRankCrossNet",
           "MLP", "Tower", "TwoTower", "TwoTowerModule"]
