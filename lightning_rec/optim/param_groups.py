"""What an LR scheduler (and pickle) sees of a fused optimizer: its param groups and its `defaults`.

A fused group's "lr" is pushed to the kernels as it is written; its other hyper-parameters are fixed when the tables are
built, and a write to one is refused at the next step."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from lightning_rec.optim.config import _USES_BETAS, EmbOptimType, FusedOptimizerConfig


def _fused_hyperparameters(config: FusedOptimizerConfig) -> dict[str, Any]:
    """The hyper-parameters a fused update applies besides lr, under torch.optim's group keys."""
    out: dict[str, Any] = {"weight_decay": config.weight_decay, "eps": config.eps}
    if config.optimizer in _USES_BETAS:
        out["betas"] = (config.beta1, config.beta2)
    if config.optimizer == EmbOptimType.LARS_SGD:
        out.update(momentum=config.momentum, eta=config.eta)
    return out


# group keys a torch.optim scheduler (OneCycleLR's / CyclicLR's cycle_momentum) or a user may write
_FIXED_KEYS = ("weight_decay", "eps", "betas", "momentum", "eta")


class _FusedParamGroup(dict):
    """A param group whose "lr" is the fused kernels' learning rate: writing it reaches them at once.

    Schedulers set `group["lr"]` after `optimizer.step()`, and the next backward (where the update runs) must use it.
    The other hyper-parameters are shown as in a torch.optim group but fixed when the tables are built:
    `FusedOptimizer.step` refuses a group where one was changed."""

    def __init__(self, kernels: Sequence[Any], config: FusedOptimizerConfig, **values: Any) -> None:
        fixed = _fused_hyperparameters(config)
        super().__init__(**values, **fixed)
        self._kernels = list(kernels)
        self._fixed = fixed
        self._config = config

    def check_fixed(self) -> None:
        """A ValueError naming the key and the fix when a fixed hyper-parameter was written."""
        for key in _FIXED_KEYS:
            ours = self._fixed.get(key)
            value = self.get(key)
            same = (tuple(value) == ours) if key == "betas" and isinstance(value, (tuple, list)) else value == ours
            if same:
                continue
            opt = self._config.optimizer
            if key not in self._fixed:
                held = (f"fused {opt} has no {key}" + (": a scheduler with cycle_momentum (OneCycleLR, CyclicLR) "
                        "wrote it; pass cycle_momentum=False" if key in ("momentum", "betas") else ""))
            else:
                held = (f"the fused kernels apply {key}={ours}, fixed when the tables were built "
                        f"(FusedOptimizerConfig('{opt.value}', {key}=...)); only 'lr' follows a write during training")
                if key in ("momentum", "betas"):
                    held += " (a scheduler with cycle_momentum, OneCycleLR's or CyclicLR's default, writes it: pass "
                    held += "cycle_momentum=False)"
            raise ValueError(
                f"fused param group '{self.get('name')}' (tables {', '.join(self.get('tables', [])) or 'none here'}) "
                f"has {key}={value!r}, but {held}. Build the tables with the value you want, or leave them unfused "
                f"(optimizer=None) and train them with a torch.optim optimizer whose {key} you can change")

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "lr":  # the kernels refuse a NaN or negative rate first: the group keeps the rate they use
            try:
                rate = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"fused learning rate param_group['lr'] = {value!r} is not a number") from None
            for kernel in self._kernels:
                kernel.set_learning_rate(rate)
        super().__setitem__(key, value)

    def __reduce__(self):
        # pickle sets a dict subclass's items before its attributes: "lr" must not reach kernels not there yet
        return _rebuild_fused_group, (type(self), dict(self), dict(self.__dict__))


def _rebuild_fused_group(cls: type, items: dict[str, Any], attrs: dict[str, Any]) -> _FusedParamGroup:
    group = dict.__new__(cls)
    group.__dict__.update(attrs)
    dict.update(group, items)  # the kernels come with their own rate: nothing to push
    return group


# pickled param groups name these two by optim's old module path: kept, so that old files load
_FusedParamGroup.__module__ = _rebuild_fused_group.__module__ = "lightning_rec.optim"


class _FusedDefaults(dict):
    """A fused (or combined) optimizer's `defaults`: OneCycleLR / CyclicLR (cycle_momentum=True) asking for "momentum"
    or "betas" are told why there is none (fixed when tables are built) and what to pass; other readers get False."""

    def __contains__(self, key: object) -> bool:
        found = dict.__contains__(self, key)
        if key in ("momentum", "betas") and not found:
            caller = sys._getframe(1)
            if caller.f_globals.get("__name__") == "torch.optim.lr_scheduler":
                scheduler = type(caller.f_locals.get("self")).__name__
                raise ValueError(
                    f"{scheduler}(cycle_momentum=True), its default, cycles every param group's momentum (Adam's "
                    f"beta1), but this optimizer steps fused embedding tables, whose hyper-parameters are fixed when "
                    f"they are built (FusedOptimizerConfig); only their lr follows a scheduler: pass "
                    f"{scheduler}(..., cycle_momentum=False) (the learning rate still cycles, the tables' too)")
        return found


def _picklable_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's attributes for pickle / deepcopy, less the `step` wrapper an LR scheduler puts on it."""
    return {k: v for k, v in optimizer.__dict__.items() if k != "step"}
