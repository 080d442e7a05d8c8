"""Models: DLRM, DLRM-DCNv2, multi-task (MMoE / PLE), two-tower retrieval, SASRec and HSTU, their LightningModules."""

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
from lightning_rec.models.multitask import MultiTaskNet
from lightning_rec.models.multitask_module import MultiTaskModule
from lightning_rec.models.sequential_module import HSTU, SASRec
from lightning_rec.models.two_tower import Tower, TwoTower
from lightning_rec.models.two_tower_module import TwoTowerModule

__all__ = ["DLRM", "DLRM_DCN", "DLRMModule", "DLRMTrain", "DLRM_Projection", "HSTU", "InteractionArch",
           "InteractionDCNArch", "InteractionProjectionArch", "LowRankCrossNet", "MLP", "MultiTaskModule",
           "MultiTaskNet", "SASRec", "Tower", "TwoTower", "TwoTowerModule"]
