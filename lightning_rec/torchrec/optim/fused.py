"""`torchrec.optim.fused`: FusedOptimizer (the tables' update, stepped inside their backward)."""

from lightning_rec.optim import FusedOptimizer

__all__ = ["FusedOptimizer"]
