"""`torchrec.models.dlrm`: DLRM, DLRM_DCN, DLRM_Projection, DLRMTrain and their archs (a TorchRec DLRM's state dict
loads by its own names: docs/torchrec.md#state-dicts)."""

from lightning_rec.models.dlrm import (  # noqa: F401
    DLRM,
    DLRM_DCN,
    DLRM_Projection,
    DLRMTrain,
    InteractionArch,
    InteractionDCNArch,
    InteractionProjectionArch,
    SparseArch,
)

__all__ = ["DLRM", "DLRM_DCN", "DLRM_Projection", "DLRMTrain", "InteractionArch", "InteractionDCNArch",
           "InteractionProjectionArch", "SparseArch"]
