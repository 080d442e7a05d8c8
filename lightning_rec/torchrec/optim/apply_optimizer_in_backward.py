"""`torchrec.optim.apply_optimizer_in_backward`: fuse an optimizer into the tables' backward."""

from lightning_rec.optim import apply_optimizer_in_backward

__all__ = ["apply_optimizer_in_backward"]
