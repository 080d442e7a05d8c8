"""`torchrec.fx`: torch.fx tracing with lightning_rec's jagged types and collections as leaves."""

from lightning_rec.fx import Tracer, symbolic_trace

__all__ = ["Tracer", "symbolic_trace"]
