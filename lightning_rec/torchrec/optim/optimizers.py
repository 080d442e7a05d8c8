"""`torchrec.optim.optimizers`: in_backward_optimizer_filter (the parameters left to a dense optimizer)."""

from lightning_rec.optim import in_backward_optimizer_filter

__all__ = ["in_backward_optimizer_filter"]
