"""Models: DLRM, DLRM-DCNv2, and their LightningModule."""

from lightning_rec.models.dlrm import DLRM, DLRM_DCN, MLP, InteractionArch, InteractionDCNArch, LowRankCrossNet
from lightning_rec.models.dlrm_module import DLRMModule

__all__ = ["DLRM", "DLRM_DCN", "DLRMModule", "InteractionArch", "InteractionDCNArch", "LowRankCrossNet", "MLP"]
