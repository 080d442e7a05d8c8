"""CombinedOptimizer: the fused part and torch.optim dense optimizers stepped as one optimizer.

It is a real `torch.optim.Optimizer`, so Lightning and torch LR schedulers drive both: a scheduler that writes
`param_groups[i]["lr"]` of a fused group reaches the kernels at once."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from lightning_rec.optim.fused import FusedOptimizer, _refuse_torch_state_dict_api
from lightning_rec.optim.fused_paths import fused_modules
from lightning_rec.optim.param_groups import _FusedDefaults, _picklable_state
from lightning_rec.table_weight import FusedTableWeight


class _CombinedState(dict):
    """Read view of the children's per-parameter state (torch code iterates `optimizer.state`)."""


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped as one: typically FusedOptimizer (embeddings) + torch.optim (dense).

    `param_groups` are the children's own group dicts, so a scheduler on the combined optimizer drives each child,
    including the fused learning rate. `step(closure)` runs the closure once, then steps every child. The fused groups'
    other hyper-parameters are fixed: torch's OneCycleLR / CyclicLR need `cycle_momentum=False` here."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer | tuple[str, torch.optim.Optimizer]]) -> None:
        named = [(o if isinstance(o, tuple) else (f"{i}_{type(o).__name__.lower()}", o))
                 for i, o in enumerate(optimizers)]
        if not named:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        self.optimizers: list[tuple[str, torch.optim.Optimizer]] = named
        _leave_fused_tables_out_of_dense(named)
        super().__init__([g for _, o in named for g in o.param_groups], {})
        if any(holds_fused_optimizer(o) for _, o in named):
            self.defaults = _FusedDefaults(self.defaults)
        self._built = True

    def _sync_groups(self) -> None:
        # torch's load_state_dict replaces a child's group dicts; keep ours pointing at the live ones.
        self.__dict__["_groups"] = [g for _, o in self.optimizers for g in o.param_groups]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.__dict__["_groups"]

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        """BaseFinetuning, resuming, assigns the groups it saved: the ones it added join the dense child again."""

        if not self.__dict__.get("_built"):  # torch's __init__
            self.__dict__["_groups"] = groups
            return
        held = {id(p) for _, o in self.optimizers for g in o.param_groups for p in g["params"]}
        for group in groups:
            # a fused group is the fused optimizer's, never new (ranks hold other tables' groups)
            if group["params"] and not any(id(p) in held or isinstance(p, FusedTableWeight) for p in group["params"]):
                self.add_param_group(dict(group))
        self._sync_groups()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A new group joins the dense (torch.optim) child, which steps it (BaseFinetuning adds unfrozen layers so)."""
        if not self.__dict__.get("_built"):  # torch's __init__: the children's own groups
            super().add_param_group(param_group)
            return
        params = param_group.get("params")
        if not isinstance(params, set):  # (torch refuses a set, by its own message, below)
            params = [params] if isinstance(params, torch.Tensor) else list(params or [])
            param_group = {**param_group, "params": params}  # a generator, read once here, is kept as its list
        fused = {id(p): g["name"] for _, o in self.optimizers if isinstance(o, FusedOptimizer)
                 for g in o.param_groups for p in g["params"]}
        held = sorted({fused[id(p)] for p in params if id(p) in fused})
        if held and all(id(p) in fused for p in params):
            # a group of tables only, as if to give them another rate: the dense child would never step them
            raise ValueError(
                f"CombinedOptimizer.add_param_group: the group holds fused table weights (param group(s) "
                f"{', '.join(held)}), which their fused optimizer updates inside backward; a dense optimizer's group "
                f"would never step them. Their learning rate is their own group's 'lr' (optimizer.param_groups "
                f"entry named {held[0]!r}); add only the other parameters (lightning_rec.optim.dense_parameters)")
        if held:  # model.parameters(): the others join, the fused tables stay with their fused optimizer
            param_group = {**param_group, "params": [p for p in params if id(p) not in fused]}
            _say_left_out("CombinedOptimizer.add_param_group: the new group", held)
        dense = [(name, o) for name, o in self.optimizers if not isinstance(o, FusedOptimizer)]
        if len(dense) != 1:
            raise ValueError(
                f"CombinedOptimizer.add_param_group: a new param group (e.g. layers that BaseFinetuning unfroze) "
                f"joins the one dense optimizer, which steps it, but this one combines "
                f"{[name for name, _ in dense] or 'none'} besides its fused part: "
                + ("pass a dense optimizer (combined_optimizer(model, torch.optim.Adam(dense_parameters))) even if "
                   "it starts with the layers that are trainable then" if not dense else
                   "add the group to the child that should step it (optimizer.optimizers[i][1].add_param_group)"))
        dense[0][1].add_param_group(param_group)
        self._sync_groups()

    def __getstate__(self) -> dict[str, Any]:
        """All of it: torch's Optimizer pickles defaults, state and param_groups only (a copy had no children)."""
        return _picklable_state(self)

    @property
    def state(self) -> dict:  # type: ignore[override]
        _refuse_torch_state_dict_api(self)  # torch's first read there: said before it steps the optimizer at lr 0
        merged = _CombinedState()
        for _, o in getattr(self, "optimizers", []):
            merged.update(o.state)
        return merged

    @state.setter
    def state(self, value: Any) -> None:
        pass  # the children own their state

    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for _, o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        _refuse_torch_state_dict_api(self)
        return {name: o.state_dict() for name, o in self.optimizers}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:  # type: ignore[override]
        """strict=False: fused tables the state holds nothing for keep theirs; the dense parts load as torch.optim's."""
        _refuse_torch_state_dict_api(self)
        missing = [name for name, _ in self.optimizers if name not in state_dict]
        if missing:
            raise ValueError(f"the checkpoint has no optimizer state for {missing}; it has {list(state_dict)}")
        for name, o in self.optimizers:
            if isinstance(o, FusedOptimizer):
                o.load_state_dict(state_dict[name], strict=strict)
            else:
                o.load_state_dict(state_dict[name])
        self._sync_groups()

    def __repr__(self) -> str:
        return "CombinedOptimizer(" + ", ".join(f"{n}={type(o).__name__}" for n, o in self.optimizers) + ")"


def _leave_fused_tables_out_of_dense(named: Sequence[tuple[str, torch.optim.Optimizer]]) -> None:
    """A dense optimizer built over model.parameters() (TorchRec's examples) holds the fused tables' weights too: they
    leave its groups and state (their fused optimizer updates them inside backward, they never get a gradient)."""
    # a sharded group holds one parameter per table, not per piece: its params do not pair with its tables' names
    fused = {id(p): f"{g['name']}: {g['tables'][i]}" if len(g["params"]) == len(g["tables"]) else g["name"]
             for _, o in named if isinstance(o, FusedOptimizer) for g in o.param_groups
             for i, p in enumerate(g["params"])}
    for name, o in named:
        if isinstance(o, FusedOptimizer):
            continue
        held = []
        for group in o.param_groups:
            out = [p for p in group["params"] if id(p) in fused]
            if out:
                held += [fused[id(p)] for p in out]
                group["params"] = [p for p in group["params"] if id(p) not in fused]
                for p in out:
                    o.state.pop(p, None)  # e.g. Adagrad's sum, made at construction for every parameter
        if held:
            _say_left_out(f"the {type(o).__name__} optimizer '{name}'", held)


def _say_left_out(what: str, held: Sequence[str]) -> None:
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(f"{what} holds fused table weights ({', '.join(held[:3])}{' ...' if len(held) > 3 else ''}): left "
                   f"out of it, since their fused optimizer updates them inside backward; it steps the other "
                   f"parameters")


def combined_optimizer(model: torch.nn.Module, dense: torch.optim.Optimizer | None) -> torch.optim.Optimizer:
    """The model's fused embedding updates + a dense optimizer, as one optimizer for Lightning."""
    parts: list[tuple[str, torch.optim.Optimizer]] = []
    if fused_modules(model):
        parts.append(("fused", FusedOptimizer(model)))
    if dense is not None:
        parts.append(("dense", dense))
    if not parts:
        raise ValueError("nothing to optimize: the model has no fused tables and no dense optimizer was given")
    return CombinedOptimizer(parts)


def holds_fused_optimizer(optimizer: Any) -> bool:
    """Whether `optimizer` is, or combines, a FusedOptimizer (a LightningOptimizer is looked through)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    if isinstance(optimizer, FusedOptimizer):
        return True
    return isinstance(optimizer, CombinedOptimizer) and any(holds_fused_optimizer(o) for _, o in optimizer.optimizers)


def dense_parameters(model: torch.nn.Module) -> Iterable[torch.nn.Parameter]:
    """Parameters trained by autograd (fused tables are excluded: they need no torch.optim)."""
    return [p for p in model.parameters() if p.requires_grad]
