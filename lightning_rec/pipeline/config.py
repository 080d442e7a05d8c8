"""PipelineConfig: how far ahead the pipeline works, and which stages it runs there (a field, not subclasses)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_rec._device import no_cuda_error

_STAGES_AHEAD = {"sparse_dist": ("read", "copy", "input_dist")}


FEEDER_COLLECTIVES = ("auto", "concurrent", "in_step_order")


@dataclass(frozen=True)
class PipelineConfig:
    """depth: batches routed ahead of the step (1: batch i+1 while i computes). variant: the stages run ahead.

    feeder_collectives: when the feeder runs its collectives: "concurrent" (as soon as a batch is read), "in_step_order"
    (only while the step's thread waits for that batch, so every rank launches both threads' collectives in one order,
    as NCCL needs), or "auto": in_step_order on NCCL with more than one rank.

    semi_sync: batch i+1's lookup and embedding all-to-all run before batch i's backward, as TorchRec's
    TrainPipelineSemiSync: batch i reads the tables as they were before batch i-1's update (one update stale).
    prefetch: an extra stage that prefetches the next batch's rows of fused_uvm_caching tables into their device
    cache (a CUDA device only)."""

    depth: int = 1
    variant: str = "sparse_dist"
    feeder_collectives: str = "auto"
    semi_sync: bool = False
    prefetch: bool = False

    def __post_init__(self) -> None:
        if self.variant not in _STAGES_AHEAD:
            raise ValueError(f"PipelineConfig(variant={self.variant!r}): choose one of {sorted(_STAGES_AHEAD)}")
        if self.feeder_collectives not in FEEDER_COLLECTIVES:
            raise ValueError(f"PipelineConfig(feeder_collectives={self.feeder_collectives!r}): choose one of "
                             f"{FEEDER_COLLECTIVES}")
        if int(self.depth) < 1:
            raise ValueError(f"PipelineConfig(depth={self.depth}): use depth >= 1 (batches routed ahead)")
        if self.prefetch:
            error = no_cuda_error("PipelineConfig(prefetch=True) (it fills fused_uvm_caching tables' device cache)",
                                  "tables on the CPU have no cache to prefetch into: leave prefetch out")
            if error is not None:
                raise error

    @classmethod
    def of(cls, value: bool | int | dict | PipelineConfig | None) -> PipelineConfig | None:
        """What RecStrategy(pipeline=...) and recipes accept: False/None (off), True, a depth, a dict."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, PipelineConfig):
            return value
        if isinstance(value, int):
            return cls(depth=value)
        if isinstance(value, dict):
            return cls(**value)
        raise ValueError(f"pipeline={value!r}: use True/False, a depth (int), a dict of PipelineConfig fields, "
                         f"or a PipelineConfig")
