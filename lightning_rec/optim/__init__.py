"""Fused embedding optimizers, and one optimizer object that steps fused sparse + torch.optim dense.

A fused optimizer updates embedding rows inside the lookup's backward; `CombinedOptimizer` is a real
`torch.optim.Optimizer`, so schedulers drive both parts (a fused group's "lr" reaches the kernel at once).

    config            EmbOptimType, FusedOptimizerConfig, check_fused_lr (read by the kernels and collections)
    fused_paths       fused_modules: the modules that own fused kernels, under the model's own paths;
                      gather_fused_gradients: gradient accumulation through them
    param_groups      the fused param groups and defaults that LR schedulers (and pickle) see
    fused             FusedOptimizer, merge_fused_state
    combined          CombinedOptimizer, combined_optimizer, dense_parameters
    torchrec_compat   apply_optimizer_in_backward, KeyedOptimizerWrapper, RowWiseAdagrad, ...

Names are imported on first use: the kernels import `optim.config` and must not pull in the modules above them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_SUBMODULES = {
    "config": ("EmbOptimType", "FBGEMM_CPU_OPTIMIZERS", "FusedOptimizerConfig", "check_fused_lr", "emb_optim_type",
               "DENSE_OPTIMIZERS", "_TORCH_OPTIMIZERS", "_USES_BETAS", "_DIVIDES_BY_EPS", "_torch_default"),
    "fused_paths": ("fused_modules", "gather_fused_gradients", "apply_gathered", "_model_named_modules",
                    "_has_fused_update"),
    "param_groups": ("_FIXED_KEYS", "_FusedParamGroup", "_rebuild_fused_group", "_FusedDefaults",
                     "_fused_hyperparameters", "_picklable_state"),
    "fused": ("FusedOptimizer", "merge_fused_state", "column_overlaps", "per_row_of_blocks", "COLUMN_BLOCKS",
              "COLUMN_OFFSETS", "_SHARDED_COPY", "_TORCH_STATE_DICT_API", "_refuse_torch_state_dict_api",
              "_slice_state"),
    "combined": ("CombinedOptimizer", "combined_optimizer", "dense_parameters", "holds_fused_optimizer",
                 "_CombinedState", "_leave_fused_tables_out_of_dense"),
    "torchrec_compat": ("adopt_torch_in_backward", "apply_optimizer_in_backward",
                        "in_backward_optimizer_filter", "KeyedOptimizerWrapper",
                        "RowWiseAdagrad", "_TORCH_ONLY_DEFAULTS", "_fused_config_for"),
}
_EXPORTS = {name: module for module, names in _SUBMODULES.items() for name in names}

__all__ = sorted(name for name in _EXPORTS if not name.startswith("_"))


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # static tools see the names as if imported eagerly
    from lightning_rec.optim.combined import (  # noqa: F401
        CombinedOptimizer,
        combined_optimizer,
        dense_parameters,
        holds_fused_optimizer,
    )
    from lightning_rec.optim.config import (  # noqa: F401
        DENSE_OPTIMIZERS,
        FBGEMM_CPU_OPTIMIZERS,
        EmbOptimType,
        FusedOptimizerConfig,
        check_fused_lr,
        emb_optim_type,
    )
    from lightning_rec.optim.fused import FusedOptimizer, merge_fused_state  # noqa: F401
    from lightning_rec.optim.fused_paths import apply_gathered, fused_modules, gather_fused_gradients  # noqa: F401
    from lightning_rec.optim.torchrec_compat import (  # noqa: F401
        KeyedOptimizerWrapper,
        RowWiseAdagrad,
        adopt_torch_in_backward,
        apply_optimizer_in_backward,
        in_backward_optimizer_filter,
    )
