"""TrainPipelineSparseDist: the next batch is read, copied and routed while this one computes
(docs/pipeline.md: what runs where, agreement between ranks, the GPU streams, the NCCL launch order)."""

from __future__ import annotations

from lightning_rec.pipeline.batch import find_kjts, move_to_device, path_name
from lightning_rec.pipeline.config import PipelineConfig
from lightning_rec.pipeline.lightning import base_loader_class, wrap_loader
from lightning_rec.pipeline.train_pipeline import InputPipeline, TrainPipelineSparseDist

__all__ = ["InputPipeline", "PipelineConfig", "TrainPipelineSparseDist", "base_loader_class", "find_kjts",
           "move_to_device", "path_name", "wrap_loader"]
