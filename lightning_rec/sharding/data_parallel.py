"""Data-parallel tables: the fused optimizer's rule applied to a replica's summed gradient. Pure math.

A replicated table's gradient (summed over ranks) is applied with the fused kernels' rule, rate and state names, so
it trains like a fused one; updates are lazy (only rows some rank's batch names), as in the fused kernels.

    sgd              w -= lr * (g + wd * w)
    adagrad          s += g^2;               w -= lr * g / (sqrt(s) + eps)
    rowwise_adagrad  s_row += mean_d(g^2);   w -= lr * g / (sqrt(s_row) + eps)

The rule runs in float32 with float32 state for every table data_type, as in the fused kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_rec.optim.config import EmbOptimType, FusedOptimizerConfig

REPLICA_OPTIMIZERS = (EmbOptimType.SGD, EmbOptimType.ADAGRAD, EmbOptimType.ROWWISE_ADAGRAD)


def check_replica_optimizer(config: FusedOptimizerConfig, table: str) -> None:
    if EmbOptimType(config.optimizer) not in REPLICA_OPTIMIZERS:
        raise ValueError(
            f"table '{table}' is data_parallel with fused optimizer {config.optimizer}, which replicated tables do "
            f"not implement: use {', '.join(str(o) for o in REPLICA_OPTIMIZERS)}, or shard the table (table_wise, ...)"
        )


def new_state(config: FusedOptimizerConfig, weight_RD: Tensor) -> dict[str, Tensor]:
    opt = EmbOptimType(config.optimizer)
    if opt == EmbOptimType.ADAGRAD:
        return {"sum": torch.zeros_like(weight_RD, dtype=torch.float32)}
    if opt == EmbOptimType.ROWWISE_ADAGRAD:
        return {"sum": weight_RD.new_zeros(weight_RD.shape[0], dtype=torch.float32)}
    return {}


@torch.no_grad()
def apply_update(weight_RD: Tensor, grad_RD: Tensor, state: dict[str, Tensor], config: FusedOptimizerConfig,
                 lr: float, named_R: Tensor | None = None) -> None:
    """One step of the rows named (named_R != 0: how many ranks named each row); named_R None: the rows whose
    gradient is not zero, which is the same step when weight_decay is 0 (a zero gradient moves nothing then)."""
    named = (grad_RD != 0).any(dim=1) if named_R is None else named_R != 0
    rows_U = named.nonzero().squeeze(1)
    if rows_U.numel() == 0:
        return
    w_UD = weight_RD.index_select(0, rows_U).float()
    g_UD = grad_RD.index_select(0, rows_U).float()
    if config.weight_decay:
        g_UD = g_UD + config.weight_decay * w_UD
    opt = EmbOptimType(config.optimizer)
    if opt == EmbOptimType.SGD:
        step_UD = g_UD
    elif opt == EmbOptimType.ADAGRAD:
        s_UD = state["sum"].index_select(0, rows_U) + g_UD * g_UD
        state["sum"].index_copy_(0, rows_U, s_UD)
        step_UD = g_UD / (s_UD.sqrt() + config.eps)
    else:
        s_U = state["sum"].index_select(0, rows_U) + (g_UD * g_UD).mean(dim=1)
        state["sum"].index_copy_(0, rows_U, s_U)
        step_UD = g_UD / (s_U.sqrt() + config.eps).unsqueeze(1)
    weight_RD.index_copy_(0, rows_U, (w_UD - lr * step_UD).to(weight_RD.dtype))
