"""`torchrec.modules.crossnet`: LowRankCrossNet (DCNv2's low-rank cross layers; TorchRec's W_kernels / V_kernels / bias
are our U.<l>.weight, V.<l>.weight, U.<l>.bias: DLRM.torchrec_names() maps them)."""

from lightning_rec.models.dlrm import LowRankCrossNet

__all__ = ["LowRankCrossNet"]
