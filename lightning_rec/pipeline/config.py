"""PipelineConfig: how far ahead the pipeline works, and which stages it runs there (a field, not subclasses)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_rec._device import no_cuda_error

_STAGES_AHEAD = {"sparse_dist": ("read", "copy", "input_dist")}


FEEDER_COLLECTIVES = ("auto", "concurrent", "in_step_order")
READ_AHEAD = ("auto", "thread", "inline")


@dataclass(frozen=True)
class PipelineConfig:
    """depth: batches routed ahead of the step (1: batch i+1 while i computes). variant: the stages run ahead.

    feeder_collectives: when the feeder runs its collectives: "concurrent" (as soon as a batch is read), "in_step_order"
    (only while the step's thread waits for that batch, so every rank launches both threads' collectives in one order,
    as NCCL needs), or "auto": in_step_order on NCCL with more than one rank.

    semi_sync: batch i+1's lookup and embedding all-to-all run before batch i's backward, as TorchRec's
    TrainPipelineSemiSync: batch i reads the tables as they were before batch i-1's update (one update stale).
    prefetch: an extra stage: once batch i's forward has run, batch i+1's routed ids fill the device caches of the
    fused_uvm_caching tables (fbgemm's prefetch, on a side stream) while batch i's backward runs, so that batch
    i+1's lookup finds its rows cached (a CUDA device only).
    read_ahead: where the feeder's work (read, copy, id routing) runs: "thread" (beside the step, on a core of its
    own), "inline" (while the step's thread waits for that batch: no second runnable thread, which on a core the step
    keeps busy would slow the step down), or "auto": inline where this host's ranks leave no core spare (on CPU, ranks
    on the host x torch.get_num_threads() >= the cores this process may use), else thread (see choose_read_ahead)."""

    depth: int = 1
    variant: str = "sparse_dist"
    feeder_collectives: str = "auto"
    semi_sync: bool = False
    prefetch: bool = False
    read_ahead: str = "auto"

    def __post_init__(self) -> None:
        if self.variant not in _STAGES_AHEAD:
            raise ValueError(f"PipelineConfig(variant={self.variant!r}): choose one of {sorted(_STAGES_AHEAD)}")
        if self.feeder_collectives not in FEEDER_COLLECTIVES:
            raise ValueError(f"PipelineConfig(feeder_collectives={self.feeder_collectives!r}): choose one of "
                             f"{FEEDER_COLLECTIVES}")
        if self.read_ahead not in READ_AHEAD:
            raise ValueError(f"PipelineConfig(read_ahead={self.read_ahead!r}): choose one of {READ_AHEAD}")
        if self.read_ahead == "inline" and self.feeder_collectives == "concurrent":
            raise ValueError("PipelineConfig(read_ahead='inline', feeder_collectives='concurrent'): inline read-ahead "
                             "runs the feeder's collectives while the step waits for the batch, never concurrently; "
                             "drop one of the two")
        if int(self.depth) < 1:
            raise ValueError(f"PipelineConfig(depth={self.depth}): use depth >= 1 (batches routed ahead)")
        if self.prefetch and self.semi_sync:
            raise ValueError("PipelineConfig(semi_sync=True, prefetch=True): a semi-synchronous step looks batch i+1 "
                             "up before batch i's backward, and fbgemm's prefetch pipeline needs batch i's backward "
                             "before batch i+1's lookup (it refreshes batch i's cache locations there): choose one")
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


def choose_read_ahead(config: PipelineConfig, ranks_on_host: int, threads: int, cores: int,
                      cuda: bool) -> tuple[str, str]:
    """(the read-ahead mode, why): the config's, or auto's choice (the same inputs on every rank of a host)."""
    if config.read_ahead != "auto":
        return config.read_ahead, f"PipelineConfig(read_ahead={config.read_ahead!r})"
    if config.feeder_collectives == "concurrent":
        return "thread", "PipelineConfig(feeder_collectives='concurrent') runs the feeder beside the step"
    if cuda:
        return "thread", "the step computes on the GPU, its host thread leaves the core time to spare"
    busy = f"{ranks_on_host} rank(s) on this host x {threads} thread(s) each"
    if ranks_on_host * threads >= cores:
        return "inline", (f"{busy} keep all {cores} usable core(s) busy: a feeder thread would slow the step down; "
                          f"PipelineConfig(read_ahead='thread') overlaps it anyway")
    return "thread", f"{busy} leave {cores - ranks_on_host * threads} of {cores} usable core(s) free for the feeder"
