"""`torchrec.optim.rowwise_adagrad`: RowWiseAdagrad (as apply_optimizer_in_backward's class, the fused row-wise
Adagrad of the tables)."""

from lightning_rec.optim import RowWiseAdagrad

__all__ = ["RowWiseAdagrad"]
