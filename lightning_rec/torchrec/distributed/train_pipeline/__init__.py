"""`torchrec.distributed.train_pipeline`: TrainPipelineSparseDist."""

from lightning_rec.pipeline import TrainPipelineSparseDist

__all__ = ["TrainPipelineSparseDist"]
