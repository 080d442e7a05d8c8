"""TorchRec's ways in: apply_optimizer_in_backward, in_backward_optimizer_filter, KeyedOptimizerWrapper and
RowWiseAdagrad."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from lightning_rec.optim.config import _TORCH_OPTIMIZERS, EmbOptimType, FusedOptimizerConfig
from lightning_rec.optim.param_groups import _picklable_state
from lightning_rec.table_weight import table_owner

# arguments whose torch default the fused update matches; any other value would train differently
_TORCH_ONLY_DEFAULTS = {"momentum": 0, "dampening": 0, "nesterov": False, "lr_decay": 0,
                        "initial_accumulator_value": 0, "amsgrad": False, "maximize": False,
                        "decoupled_weight_decay": False}  # Adam's AdamW switch (torch 2.6+): the fused decay is L2


def _fused_config_for(optimizer_class: Any, optimizer_kwargs: dict[str, Any]) -> FusedOptimizerConfig:
    """torch.optim.SGD / Adagrad / Adam (their defaults included), an EmbOptimType or a name -> the fused config."""
    kwargs = dict(optimizer_kwargs or {})
    if isinstance(optimizer_class, FusedOptimizerConfig):
        if kwargs:
            return dataclasses.replace(optimizer_class, **kwargs)
        return optimizer_class
    if isinstance(optimizer_class, (str, EmbOptimType)):
        return FusedOptimizerConfig(optimizer_class, **kwargs)
    if optimizer_class not in _TORCH_OPTIMIZERS:
        name = getattr(optimizer_class, "__name__", repr(optimizer_class))
        raise ValueError(f"apply_optimizer_in_backward({name}, ...): the fused tables implement torch.optim.SGD, "
                         f"torch.optim.Adagrad and torch.optim.Adam (SparseAdam), or a fused optimizer by name: "
                         f"pass e.g. apply_optimizer_in_backward('rowwise_adagrad', params, {{'lr': 0.01}}) (names: "
                         f"{', '.join(o.value for o in EmbOptimType)})")
    accepted = inspect.signature(optimizer_class.__init__).parameters
    unknown = sorted(k for k in kwargs if k not in accepted or k in ("self", "params"))
    if unknown:
        raise ValueError(f"apply_optimizer_in_backward({optimizer_class.__name__}, ...): {optimizer_class.__name__} "
                         f"takes no argument(s) {unknown}")
    for key, expected in _TORCH_ONLY_DEFAULTS.items():
        if key in kwargs and kwargs[key] != expected:
            raise ValueError(f"apply_optimizer_in_backward({optimizer_class.__name__}, ..., {{'{key}': "
                             f"{kwargs[key]!r}}}): the fused update has no {key}; leave it at {expected!r}, or train "
                             f"the tables unfused (a plain torch.optim optimizer over an unsharded collection)")
    # what is left out takes the class's own default (Adagrad's eps 1e-10): FusedOptimizerConfig does that
    config = {k: kwargs[k] for k in ("lr", "eps", "weight_decay", "betas") if k in kwargs}
    return FusedOptimizerConfig(optimizer_class, **config)


def apply_optimizer_in_backward(optimizer_class: Any, params: Iterable[torch.nn.Parameter],
                                optimizer_kwargs: dict[str, Any] | None = None) -> None:
    """TorchRec's way to fuse an optimizer into the embedding backward, on our collections.

        apply_optimizer_in_backward(torch.optim.Adagrad, model.sparse_arch.parameters(), {"lr": 0.05})
        dmp = DistributedModelParallel(model, ...)        # the tables are sharded with that update

    As building the collections with `optimizer=FusedOptimizerConfig(...)`: every collection whose tables are all in
    `params` gets that update (docs/torchrec.md#sharded-tables-train-fused). Call it before building optimizers or
    DistributedModelParallel (the table parameters are made anew). Dense parameters are refused."""

    config = _fused_config_for(optimizer_class, optimizer_kwargs or {})
    owners: dict[int, tuple[Any, set[str]]] = {}
    for p in params:
        found = table_owner(p)
        if found is None:
            raise ValueError(f"apply_optimizer_in_backward got a parameter of shape {tuple(p.shape)} that is not a "
                             f"table of an unsharded EmbeddingBagCollection / EmbeddingCollection: pass the "
                             f"collections' parameters only (e.g. model.sparse_arch.parameters()), before "
                             f"DistributedModelParallel; dense layers train with a torch.optim optimizer")
        owner, table = found
        owners.setdefault(id(owner), (owner, set()))[1].add(table)
    for owner, tables in owners.values():
        missing = sorted(set(owner.table_parameters()) - tables)
        if missing:
            raise ValueError(f"apply_optimizer_in_backward got tables {sorted(tables)} of a "
                             f"{type(owner).__name__} but not {missing}: a collection has one fused update for all "
                             f"its tables; pass all its parameters (collection.parameters()), or put the tables "
                             f"that train differently in a collection of their own")
    for owner, _ in owners.values():
        owner.use_fused_optimizer(config)


def adopt_torch_in_backward(collection: Any) -> bool:
    """A collection without a fused update whose tables all carry one `torch.distributed.optim.
    _apply_optimizer_in_backward` optimizer (TorchRec's examples call torch's, whose per-parameter hooks a fused table
    never fires) takes it as its fused update, as TorchRec's sharders read it. True when it did."""
    if collection.fused_optimizer_config() is not None:
        return False
    marks = {id(p): (getattr(p, "_optimizer_classes", None), getattr(p, "_optimizer_kwargs", None))
             for p in collection.table_parameters().values()}
    if not marks or any(classes is None for classes, _ in marks.values()):
        return False
    found = {(tuple(c), repr(k)) for c, k in marks.values()}
    classes, kwargs = next(iter(marks.values()))
    if len(found) > 1 or len(classes) != 1:
        raise ValueError(f"{type(collection).__name__}: torch's _apply_optimizer_in_backward gave its tables "
                         f"{len(found)} different optimizer settings ({len(classes)} optimizer(s) on a table): a "
                         f"collection has one fused update; apply one optimizer to all of collection.parameters()")
    apply_optimizer_in_backward(classes[0], collection.parameters(), kwargs[0])
    return True


def in_backward_optimizer_filter(named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                                 include: bool = False) -> Iterable[tuple[str, torch.nn.Parameter]]:
    """TorchRec's filter: (name, parameter) pairs without a fused update (include=True: only those with one)."""
    for name, p in named_parameters:
        if (not p.requires_grad) == include:
            yield name, p


class KeyedOptimizerWrapper(torch.optim.Optimizer):
    """TorchRec's `KeyedOptimizerWrapper(dict(model.named_parameters()), lambda params: torch.optim.SGD(params, ...))`.

    The factory's optimizer over the parameters that train through autograd (fused tables left out); state_dict is
    the inner optimizer's. Combine it: `CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", it)])`."""

    def __init__(self, params: Mapping[str, torch.Tensor],
                 optim_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        if not isinstance(params, Mapping):
            raise ValueError(f"KeyedOptimizerWrapper takes a dict of name -> parameter, got a "
                             f"{type(params).__name__}: pass dict(model.named_parameters())")
        self.params = {name: p for name, p in params.items() if p.requires_grad}
        if not self.params:
            raise ValueError("KeyedOptimizerWrapper: none of the parameters trains through autograd (fused tables "
                             "are updated in backward): use dmp.fused_optimizer for those")
        self._optimizer = optim_factory(list(self.params.values()))
        super().__init__(self._optimizer.param_groups, {})
        self.param_groups = self._optimizer.param_groups

    def __getstate__(self) -> dict[str, Any]:
        return _picklable_state(self)  # torch's keeps param_groups only: a copy lost its inner optimizer

    @property
    def state(self) -> dict:  # type: ignore[override]
        return self._optimizer.state if hasattr(self, "_optimizer") else {}

    @state.setter
    def state(self, value: Any) -> None:
        pass  # the inner optimizer owns its state

    def step(self, closure=None):  # type: ignore[override]
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self._optimizer.load_state_dict(state_dict)
        self.param_groups = self._optimizer.param_groups

    def __repr__(self) -> str:
        return f"KeyedOptimizerWrapper({self._optimizer!r})"


class RowWiseAdagrad(torch.optim.Optimizer):
    """TorchRec's row-wise Adagrad as a plain torch optimizer: one accumulator per row of each 2-d parameter.
    state_sum += mean(g^2 over the row's columns); w -= lr * g / (sqrt(state_sum) + eps): the fused "rowwise_adagrad"
    update, so apply_optimizer_in_backward fuses it into tables. 1-d parameters keep one accumulator per element."""

    def __init__(self, params, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> None:
        for name, value in (("lr", lr), ("lr_decay", lr_decay), ("weight_decay", weight_decay),
                            ("initial_accumulator_value", initial_accumulator_value), ("eps", eps)):
            if not value >= 0:
                raise ValueError(f"RowWiseAdagrad {name}={value!r} must be >= 0")
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad if not group["weight_decay"] else p.grad.add(p, alpha=group["weight_decay"])
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    rows = p.shape[:1] if p.dim() > 1 else p.shape
                    state["sum"] = torch.full(rows, group["initial_accumulator_value"], dtype=p.dtype,
                                              device=p.device)
                state["step"] += 1
                clr = group["lr"] / (1 + (state["step"] - 1) * group["lr_decay"])
                if p.dim() > 1:
                    state["sum"].add_(grad.pow(2).flatten(1).mean(dim=1))
                    std = state["sum"].sqrt().add_(group["eps"]).view(-1, *([1] * (p.dim() - 1)))
                else:
                    state["sum"].add_(grad.pow(2))
                    std = state["sum"].sqrt().add_(group["eps"])
                p.addcdiv_(grad, std, value=-clr)
        return loss


_TORCH_OPTIMIZERS[RowWiseAdagrad] = EmbOptimType.ROWWISE_ADAGRAD  # its eps default (1e-10) comes with it
