"""`torchrec.optim.keyed`: KeyedOptimizerWrapper and CombinedOptimizer."""

from lightning_rec.optim import CombinedOptimizer, KeyedOptimizerWrapper

__all__ = ["CombinedOptimizer", "KeyedOptimizerWrapper"]
