"""Fused optimizer configs: which update runs inside the embedding backward, with which hyper-parameters.

The kernels (lookup, native_embedding) and the collections read these, so this module imports only leaves."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from lightning_rec.errors import is_number


class EmbOptimType(str, Enum):
    SGD = "sgd"
    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAM = "adam"
    PARTIAL_ROWWISE_ADAM = "partial_rowwise_adam"
    LAMB = "lamb"
    LARS_SGD = "lars_sgd"

    def __str__(self) -> str:
        return self.value


# fbgemm's CPU TBE implements only these; the rest assert "not supported in CPU mode".
FBGEMM_CPU_OPTIMIZERS = (EmbOptimType.SGD, EmbOptimType.ADAGRAD, EmbOptimType.ROWWISE_ADAGRAD)


# torch.optim classes with a fused twin of the same update (RowWiseAdagrad joins them in torchrec_compat)
_TORCH_OPTIMIZERS = {torch.optim.SGD: EmbOptimType.SGD, torch.optim.Adagrad: EmbOptimType.ADAGRAD,
                     torch.optim.Adam: EmbOptimType.ADAM, torch.optim.SparseAdam: EmbOptimType.ADAM}
_USES_BETAS = (EmbOptimType.ADAM, EmbOptimType.PARTIAL_ROWWISE_ADAM, EmbOptimType.LAMB)


def emb_optim_type(value: Any) -> EmbOptimType:
    """Ours, fbgemm's / TorchRec's (EmbOptimType.EXACT_ROWWISE_ADAGRAD, "exact_row_wise_adagrad", "EXACT_SGD")
    or a torch.optim class -> our EmbOptimType. fbgemm's non-exact variants name the same update (ours is exact)."""
    valid = ", ".join(o.value for o in EmbOptimType)
    if isinstance(value, type) and issubclass(value, torch.optim.Optimizer):
        if value in _TORCH_OPTIMIZERS:
            return _TORCH_OPTIMIZERS[value]
        raise ValueError(f"torch.optim.{value.__name__} has no fused version: use torch.optim.SGD, Adagrad or Adam, or "
                         f"one of {valid} (or leave the tables unfused, optimizer=None, and train them with it)")
    if isinstance(value, torch.optim.Optimizer):
        raise ValueError(f"fused optimizer {type(value).__name__}(...) is an optimizer built on parameters: pass its "
                         f"class and hyper-parameters, e.g. FusedOptimizerConfig(torch.optim.{type(value).__name__}, "
                         f"lr=0.01)")
    name = str(getattr(value, "value", value)).lower().replace("row_wise", "rowwise")
    name = name.removeprefix("exact_")
    try:
        return EmbOptimType(name)
    except ValueError:
        raise ValueError(f"unknown fused optimizer {value!r}: choose one of {valid} (fbgemm's / TorchRec's names, "
                         f"e.g. EXACT_ROWWISE_ADAGRAD, and torch.optim.SGD / Adagrad / Adam are taken too)") from None


def _torch_default(optimizer: Any, name: str, ours: float) -> float:
    """`name`'s default in a torch.optim class's signature (Adagrad's eps 1e-10, Adam's lr 1e-3); `ours` otherwise."""
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        param = inspect.signature(optimizer.__init__).parameters.get(name)
        if param is not None and isinstance(param.default, (int, float)) and not isinstance(param.default, bool):
            return float(param.default)
    return ours


# optimizers whose update divides by sqrt(state) + eps (a touched row with a zero gradient has state 0)
_DIVIDES_BY_EPS = (EmbOptimType.ADAGRAD, EmbOptimType.ROWWISE_ADAGRAD, EmbOptimType.ADAM,
                   EmbOptimType.PARTIAL_ROWWISE_ADAM, EmbOptimType.LAMB)


@dataclass(frozen=True)
class FusedOptimizerConfig:
    """The update applied inside the embedding backward.

    Matches torch.optim where one exists: `sgd` = SGD(lr, weight_decay), `adagrad` = Adagrad(lr, eps, weight_decay) with
    initial_accumulator_value=0, `adam` = Adam(lr, betas, eps, weight_decay). `rowwise_adagrad` keeps one accumulator
    per row: the mean of the squared gradient over the row's columns. `partial_rowwise_adam` keeps Adam's first moment
    per element and its second moment per row.

    One update per lookup's backward: a collection called twice in a step updates twice (docs/embeddings.md).

    optimizer: ours ("rowwise_adagrad"), fbgemm's / TorchRec's EmbOptimType names ("EXACT_SGD") or the class
    torch.optim.SGD / Adagrad / Adam, with that class's defaults for what is not given (otherwise lr 0.01, eps 1e-8). A
    hyper-parameter the update would not use is refused: momentum and eta (lars_sgd's), betas (adam,
    partial_rowwise_adam, lamb). eps is taken by every optimizer."""

    optimizer: EmbOptimType | str = EmbOptimType.ROWWISE_ADAGRAD
    lr: float | None = None  # None: 0.01, or the torch.optim class's own default (Adam 1e-3)
    eps: float | None = None  # None: 1e-8, or the torch.optim class's own default (Adagrad 1e-10)
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    momentum: float | None = None  # LARS (default 0.9 there); no other fused update has one
    eta: float | None = None  # LARS trust coefficient (default 0.001 there)
    # torch.optim.Adam's spelling, for beta1 / beta2 (fbgemm's and TorchRec's): init-only, not a field
    betas: dataclasses.InitVar[tuple[float, float] | None] = None

    def __post_init__(self, betas: tuple[float, float] | None = None) -> None:
        if betas is not None:
            pair = tuple(betas) if isinstance(betas, (tuple, list)) else ()
            if len(pair) != 2:
                raise ValueError(f"fused optimizer betas={betas!r}: give two numbers, e.g. betas=(0.9, 0.999) (or "
                                 f"beta1=0.9, beta2=0.999)")
            if (self.beta1, self.beta2) != (0.9, 0.999) and (self.beta1, self.beta2) != pair:
                raise ValueError(f"fused optimizer betas={betas!r} and beta1={self.beta1}, beta2={self.beta2} "
                                 f"disagree: give one of the two")
            object.__setattr__(self, "beta1", pair[0])
            object.__setattr__(self, "beta2", pair[1])
        for name, ours in (("lr", 0.01), ("eps", 1e-8)):
            if getattr(self, name) is None:  # a torch.optim class brings its own defaults, as in torch
                object.__setattr__(self, name, _torch_default(self.optimizer, name, ours))
        object.__setattr__(self, "optimizer", emb_optim_type(self.optimizer))
        for name in ("lr", "eps", "weight_decay", "beta1", "beta2", "momentum", "eta"):
            value = getattr(self, name)
            if value is None and name in ("momentum", "eta"):
                continue
            if isinstance(value, str):
                try:
                    value = float(value)  # YAML and CLI values arrive as text: "0.1", "1e-3"
                except ValueError:
                    raise ValueError(f"fused optimizer {name}={value!r} is not a number: write e.g. "
                                     f"{name}=0.01") from None
                object.__setattr__(self, name, value)
            if not is_number(value):
                raise ValueError(f"fused optimizer {name} must be a finite number, got {value!r}: a NaN or infinite "
                                 f"value would write NaN into every row the next batch touches")
            if value < 0:
                raise ValueError(f"fused optimizer {name} must be >= 0, got {value}")
        if self.eps == 0 and self.optimizer in _DIVIDES_BY_EPS:
            raise ValueError(f"fused optimizer {self.optimizer} needs eps > 0, got eps=0: a row whose gradient is 0 "
                             f"in a batch would be updated by 0 / 0 = NaN. Use a small eps, e.g. eps=1e-8")
        if not (self.beta1 < 1 and self.beta2 < 1):
            raise ValueError(f"fused optimizer betas must be in [0, 1), got beta1={self.beta1}, beta2={self.beta2}")
        self._refuse_unused()

    def _refuse_unused(self) -> None:
        """A hyper-parameter this update has no use for is refused, naming an optimizer that has it."""
        opt = self.optimizer
        if opt == EmbOptimType.LARS_SGD:
            object.__setattr__(self, "momentum", 0.9 if self.momentum is None else self.momentum)
            object.__setattr__(self, "eta", 0.001 if self.eta is None else self.eta)
        else:
            if self.momentum:
                raise ValueError(f"fused {opt} has no momentum (momentum={self.momentum} would be ignored): use "
                                 f"optimizer='lars_sgd' (SGD with momentum and a layer-wise trust ratio), 'adam' or "
                                 f"'rowwise_adagrad', or leave these tables unfused (optimizer=None) and train them "
                                 f"with torch.optim.SGD(momentum={self.momentum})")
            object.__setattr__(self, "momentum", None)  # momentum=0 is torch.optim.SGD's default: no momentum
            if self.eta is not None:
                raise ValueError(f"eta={self.eta} is lars_sgd's trust coefficient; fused {opt} has none: leave it "
                                 f"out, or use optimizer='lars_sgd'")
        if opt not in _USES_BETAS and (self.beta1, self.beta2) != (0.9, 0.999):
            raise ValueError(f"fused {opt} uses no betas (beta1={self.beta1}, beta2={self.beta2} would be ignored): "
                             f"they belong to {', '.join(o.value for o in _USES_BETAS)}; leave them out or use one "
                             f"of those")


def check_fused_lr(lr: Any, tables: Sequence[str]) -> float:
    """A fused learning rate as a float, or a ValueError naming the tables (every kernel, sharded or replicated)."""
    if not is_number(lr) or lr < 0:
        raise ValueError(f"fused learning rate {lr!r} for tables {', '.join(tables)} must be a finite number >= 0: a "
                         f"NaN or infinite rate would write NaN into every row the next batch touches")
    return float(lr)


# the dense layers' optimizers, by the name the modules' dense_optimizer argument takes
DENSE_OPTIMIZERS = {"adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
                    "sgd": torch.optim.SGD}
