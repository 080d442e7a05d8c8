"""`torchrec.optim`: the fused optimizers' ways in (apply_optimizer_in_backward), KeyedOptimizerWrapper,
CombinedOptimizer, FusedOptimizer and RowWiseAdagrad (docs/torchrec.md#sharded-tables-train-fused)."""

from lightning_rec.optim import (  # noqa: F401
    CombinedOptimizer,
    FusedOptimizer,
    KeyedOptimizerWrapper,
    RowWiseAdagrad,
    apply_optimizer_in_backward,
    in_backward_optimizer_filter,
)

__all__ = ["CombinedOptimizer", "FusedOptimizer", "KeyedOptimizerWrapper", "RowWiseAdagrad",
           "apply_optimizer_in_backward", "in_backward_optimizer_filter"]
