"""Fused embedding optimizers, and one optimizer object that steps fused sparse + torch.optim dense.

A fused optimizer updates embedding rows inside the lookup's backward (fbgemm TBE or our native
CPU kernel): no embedding gradient is materialised. What remains for `step()` is the dense part.
`CombinedOptimizer` is a real `torch.optim.Optimizer`, so Lightning and torch LR schedulers drive
both: a scheduler that writes `param_groups[i]["lr"]` of a fused group reaches the kernel at once.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from lightning_rec.errors import is_number
from lightning_rec.table_weight import FusedTableWeight, table_owner


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


# torch.optim classes with a fused twin of the same update (AdamW's decoupled decay has none: fused adam
# applies weight_decay as torch.optim.Adam does, to the gradient; it moves only the rows in the batch, which
# is SparseAdam's rule). RowWiseAdagrad (below) joins them once defined.
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

    Matches torch.optim where one exists: `sgd` = SGD(lr, weight_decay), `adagrad` =
    Adagrad(lr, eps, weight_decay) with initial_accumulator_value=0, `adam` = Adam(lr, betas, eps,
    weight_decay). `rowwise_adagrad` keeps one accumulator per row: the mean of the squared
    gradient over the row's columns. `partial_rowwise_adam` keeps Adam's first moment per element
    and its second moment per row.

    One update per lookup: the ids of one call are summed per row and the row is stepped once, as torch.optim
    on the dense table would. A collection called twice in a step (positives and negatives through one tower)
    updates twice, once from each call's gradient, as fbgemm and TorchRec do: the same for sgd without weight
    decay, but adagrad adds
    g1^2 + g2^2 rather than (g1 + g2)^2 and adam takes two steps (its step count too). Call it once on one
    batch holding both (their bags stacked per feature) for torch.optim's one step.

    optimizer: ours ("rowwise_adagrad"), fbgemm's / TorchRec's EmbOptimType names
    (EmbOptimType.EXACT_ROWWISE_ADAGRAD, "EXACT_SGD", "row_wise_adagrad") or the class torch.optim.SGD /
    Adagrad / Adam, with that class's defaults for what is not given (Adagrad's eps 1e-10, Adam's lr 1e-3, as
    apply_optimizer_in_backward; otherwise lr 0.01, eps 1e-8). A hyper-parameter
    the update would not use is refused, not ignored: momentum (lars_sgd's only), eta (lars_sgd's),
    betas (adam, partial_rowwise_adam, lamb). eps is taken by every optimizer (sgd and lars_sgd divide
    by nothing).
    """

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
        """A hyper-parameter this update has no use for was ignored, silently (SGD with momentum=0.9 trained
        as plain SGD): refused, naming an optimizer that has it."""
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

    Schedulers set `group["lr"]` after `optimizer.step()`; the next backward (where the fused update
    runs) must already use the new rate, so the write is pushed through instead of read at step().
    The other hyper-parameters (weight_decay, eps, betas; momentum, eta for lars_sgd) are shown as in a
    torch.optim group but are fixed when the tables are built: `FusedOptimizer.step` refuses a group
    where one was changed (or added), since the kernels would go on with the built value, silently.
    """

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
        # pickle's default for a dict subclass sets the items before the attributes: "lr" went through __setitem__
        # to kernels the group did not have yet (AttributeError '_kernels' in torch.load of an optimizer)
        return _rebuild_fused_group, (type(self), dict(self), dict(self.__dict__))


def _rebuild_fused_group(cls: type, items: dict[str, Any], attrs: dict[str, Any]) -> _FusedParamGroup:
    group = dict.__new__(cls)
    group.__dict__.update(attrs)
    dict.update(group, items)  # the kernels come with their own rate: nothing to push
    return group


def _is_wrapper_child(parent: torch.nn.Module, name: str) -> bool:
    """The child that a wrapper holds the user's model under: DistributedModelParallel's and DDP's (whose state
    dicts leave these names out; DistributedModelParallel.state_dict is its model's)."""
    from torch.nn.parallel import DistributedDataParallel

    return name == "_dmp_wrapped_module" or (name == "module" and isinstance(parent, DistributedDataParallel))


def _model_named_modules(module: torch.nn.Module, prefix: str = "", seen: set | None = None):
    """named_modules() under the model's own names: wrappers add no path component."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    yield prefix, module
    for name, child in module.named_children():
        if child is None:
            continue
        path = prefix if _is_wrapper_child(module, name) else (f"{prefix}.{name}" if prefix else name)
        yield from _model_named_modules(child, path, seen)


def fused_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) for every module in `model` that owns fused embedding kernels.

    Paths are the model's own (its state_dict's), also when `model` is a DistributedModelParallel (with DDP
    inside): the fused state is saved under them, and a checkpoint written from
    `combined_optimizer(dmp, ...)` named every table `_dmp_wrapped_module.module.<path>`, which the
    unsharded model (and a DistributedModelParallel with dense=None or "fsdp") could not load.
    """
    return [(path, m) for path, m in _model_named_modules(model) if _has_fused_update(m)]


def _has_fused_update(module: torch.nn.Module) -> bool:
    if not callable(getattr(module, "fused_kernels", None)):
        return False
    if module.fused_kernels():
        return True
    # A sharded collection none of whose shards is on this rank (a table_wise table on another rank): every rank
    # still keeps its fused optimizer, so that every rank's optimizer has the same parts and its checkpoint the same
    # collectives (this rank's had no fused part; its save skipped a gather that the others waited in).
    config = getattr(module, "fused_optimizer_config", None)
    return callable(getattr(module, "shard_of", None)) and callable(config) and config() is not None


class _FusedDefaults(dict):
    """A fused (or combined) optimizer's `defaults`: torch's OneCycleLR / CyclicLR, whose cycle_momentum=True (their
    default) asks them for "momentum" or "betas", are told why there is none and what to pass.

    Only the learning rate of a fused group follows a scheduler; its betas are fixed when the tables are built
    (and sgd / adagrad have no momentum at all). torch said "optimizer must support momentum or beta1 with
    `cycle_momentum` option enabled", naming neither. Other readers (Lightning's LearningRateMonitor) get False."""

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
    """An optimizer's attributes for pickle / deepcopy, less the `step` that an LR scheduler puts on the instance
    (a wrapper of the original's step: a copy keeping it stepped the original; pickle cannot write it)."""
    return {k: v for k, v in optimizer.__dict__.items() if k != "step"}


_SHARDED_COPY = (
    "the fused optimizer of a sharded model (DistributedModelParallel) cannot be pickled or deep-copied: its "
    "kernels are tied to this run's process groups. Save its state instead, torch.save(optimizer.state_dict(), f) "
    "(or lightning_rec.checkpoint.save for a checkpoint that loads at any world size), and load that into the "
    "optimizer of the model sharded again, optimizer.load_state_dict(torch.load(f))")


_TORCH_STATE_DICT_API = "torch.distributed.checkpoint.state_dict"


def _refuse_torch_state_dict_api(optimizer: torch.optim.Optimizer) -> None:
    """torch's get_state_dict / get_optimizer_state_dict / set_state_dict (torch.distributed.checkpoint.state_dict)
    read an optimizer's state dict as torch.optim's, state by parameter index, and map the indices to parameter
    names: a combined optimizer's (by part) met KeyError: 'state', a fused one's (by table) KeyError on a table's
    name. Called from there, the optimizer says what saves and loads it instead. Its caller is looked up a few frames
    up (the method itself, torch's no_grad wrapper, a CombinedOptimizer's child call)."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return
        if frame.f_globals.get("__name__") == _TORCH_STATE_DICT_API:
            raise ValueError(
                f"torch.distributed.checkpoint.state_dict (get_state_dict, get_optimizer_state_dict, set_state_dict) "
                f"cannot read a {type(optimizer).__name__}: it keys optimizer state by parameter, and the fused "
                f"tables' state is per table (and sharded). Save with lightning_rec.checkpoint.save({{'state_dict': "
                f"dmp.state_dict()}}, path, optimizers=[optimizer], module=dmp) on every rank and load with "
                f"checkpoint.load_model(dmp, path) and checkpoint.load_optimizer(optimizer, path, module=dmp) (any "
                f"world size or plan; Trainer(strategy='rec') does both), or keep optimizer.state_dict() / "
                f"load_state_dict(...) in memory")
        frame = frame.f_back


class FusedOptimizer(torch.optim.Optimizer):
    """The fused embedding updates of a model, seen as an optimizer.

    `step()` applies nothing (the rows were updated in backward) but runs the closure; one param
    group per fused kernel carries its "lr", which starts at the kernel's configured rate
    (`FusedOptimizerConfig.lr`) as a torch.optim optimizer starts at its `lr`. The state dict keys optimizer state by
    `<module path>.<table>.<state name>`, so it loads into any kernel (fbgemm or native) and any
    grouping of the same tables.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._tables: dict[str, tuple[Any, int]] = {}  # "<path>.<table>" -> (kernel, index in kernel)
        # "<path>.<local table>" -> ("<path>.<global table>", ShardMetadata or None: whole, global shape)
        self._pieces: dict[str, tuple[str, Any, tuple[int, int]]] = {}
        groups = []
        # sharded kernels hold the run's process groups, which neither pickle nor deepcopy can copy
        self._sharded = any(callable(getattr(m, "shard_of", None)) for _, m in fused_modules(model))
        for path, module in fused_modules(model):
            shard_of = getattr(module, "shard_of", None)
            # The collection's own table parameters (unsharded: the same storage as the kernel's views; sharded: one
            # empty parameter per table): optimizer param groups that hold the model's parameters, as Lightning's
            # BaseFinetuning maps them to names (KeyError on the kernel's views at every epoch start). A sharded
            # table's pieces share its parameter, which a torch optimizer holds once.
            own = module.table_parameters() if hasattr(module, "table_parameters") else {}
            prefix = f"{path}." if path else ""
            if not module.fused_kernels():  # no shard here: a group without tables, at the configured rate
                config = module.fused_optimizer_config()
                groups.append(_FusedParamGroup([], config, params=[], lr=config.lr, name=f"{prefix}fused0",
                                               optimizer=str(config.optimizer), tables=[]))
            held: set[int] = set()
            for i, kernel in enumerate(module.fused_kernels()):
                params = []
                for j, (table, w) in enumerate(zip(kernel.tables, kernel.split_embedding_weights())):
                    self._tables[prefix + table.name] = (kernel, j)
                    whole = (table.name, None, (table.num_embeddings, table.embedding_dim))
                    name, meta, shape = shard_of(table.name) if shard_of is not None else whole
                    self._pieces[prefix + table.name] = (prefix + name, meta, shape)
                    p = own.get(name, w)
                    if id(p) not in held:
                        held.add(id(p))
                        params.append(p)
                config = kernel.optimizer_config
                # a new optimizer starts at its configured rate, as torch.optim's do: the kernel keeps the rate
                # the last scheduler wrote (a second fit, or Tuner.lr_find's sweep, began from that one while
                # the dense part started afresh)
                kernel.set_learning_rate(config.lr)
                groups.append(_FusedParamGroup(
                    [kernel], config,
                    params=params,
                    lr=config.lr,
                    name=f"{prefix}fused{i}",
                    optimizer=str(config.optimizer),
                    tables=[t.name for t in kernel.tables],
                ))
        if not groups:
            raise ValueError("the model has no fused embedding tables: build its EmbeddingBagCollection with "
                             "optimizer=FusedOptimizerConfig(...), or use a plain torch.optim optimizer")
        super().__init__(groups, {})
        self.defaults = _FusedDefaults(self.defaults)

    def __getstate__(self) -> dict[str, Any]:
        """All of it: torch's Optimizer pickles defaults, state and param_groups only, and the copy (deepcopy,
        torch.save(optimizer)) had no tables: its state_dict() raised AttributeError '_tables'."""
        if self.__dict__.get("_sharded"):
            raise TypeError(_SHARDED_COPY)
        return _picklable_state(self)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        # a weight_decay / eps / betas written into a group (a scheduler, a user) never reached the kernels: said
        # here, at the first step after the write, not ignored for the whole run
        for group in self.param_groups:
            if isinstance(group, _FusedParamGroup):
                group.check_fixed()
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: fused tables never hold a gradient."""

    def table_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """"<path>.<table>" -> {state name: tensor view into the kernel}."""
        out = {}
        states_by_kernel: dict[int, list[dict[str, torch.Tensor]]] = {}
        for name, (kernel, j) in self._tables.items():
            states = states_by_kernel.setdefault(id(kernel), kernel.optimizer_states())
            out[name] = states[j]
        return out

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        _refuse_torch_state_dict_api(self)
        state = {f"{table}.{key}": value for table, states in self.table_states().items()
                 for key, value in states.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def state_loaded(self) -> None:
        """The state views were written in place: fbgemm kernels re-read their step (FusedKernel.state_loaded)."""
        for kernel, _ in self._tables.values():
            if callable(getattr(kernel, "state_loaded", None)):
                kernel.state_loaded()

    def global_table_names(self) -> list[str]:
        """Every table this optimizer updates, by its whole-table name ("<path>.<table>"), stateless ones too."""
        return list(dict.fromkeys(name for name, _, _ in self._pieces.values()))

    def global_state_pieces(self) -> dict[str, tuple[tuple[int, int], list[tuple[Any, torch.Tensor]]]]:
        """This rank's optimizer state under whole-table names, for resharding.

        "<path>.<table>.<state>" -> (the table's global shape, [(ShardMetadata or None, state view)]).
        Gather every rank's pieces and `merge_fused_state` them into a state dict that loads into
        any world size, plan, or the unsharded model (RecStrategy's checkpoints do this).
        """
        out: dict[str, tuple[tuple[int, int], list]] = {}
        for local, states in self.table_states().items():
            name, meta, shape = self._pieces[local]
            for key, value in states.items():
                out.setdefault(f"{name}.{key}", (shape, []))[1].append((meta, value))
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:  # type: ignore[override]
        """Shard-local state (saved by this layout), or whole-table state (`merge_fused_state`, an unsharded
        model): each piece reads its rows and columns.

        strict=False: a table the state holds nothing for (one added to the model since the save) keeps its
        current state, as `module.load_state_dict(..., strict=False)` leaves its weights; the others load."""
        _refuse_torch_state_dict_api(self)
        saved = state_dict.get("state", {})
        self._check_same_optimizer(state_dict.get("param_groups", []))
        expected = {f"{table}.{key}": (table, key, value) for table, states in self.table_states().items()
                    for key, value in states.items()}
        if not strict:  # only tables with no entry at all: a table saved with other state names, or as another
            # layout's pieces ("<table>@r<row>c<col>"), is still named
            held = {re.sub(r"@r\d+c\d+$", "", k.rsplit(".", 1)[0]) for k in saved}
            expected = {k: v for k, v in expected.items()
                        if re.sub(r"@r\d+c\d+$", "", v[0]) in held or self._pieces[v[0]][0] in held}
        missing = []
        for local_key, (local, key, _) in expected.items():
            if local_key not in saved and f"{self._pieces[local][0]}.{key}" not in saved:
                missing.append(local_key)
        if missing:
            # a piece's name, "<table>@r<row>c<col>": state saved by one rank of a sharded model holds its pieces only
            pieces = sorted({k.rsplit(".", 1)[0] for k in saved if re.search(r"@r\d+c\d+$", k.rsplit(".", 1)[0])})
            if pieces:
                raise ValueError(
                    f"the fused optimizer state has no entry for {missing[:5]}{' ...' if len(missing) > 5 else ''}: it "
                    f"was saved by one rank of a model sharded otherwise (it holds pieces {pieces[:3]}), and one "
                    f"rank's optimizer.state_dict() loads only into the same world size and plan. To load at any "
                    f"world size or plan, save with lightning_rec.checkpoint.save(..., optimizers=[optimizer]) and "
                    f"load with checkpoint.load_optimizer(optimizer, path, module=model) (Trainer(strategy='rec') "
                    f"does), or merge every rank's FusedOptimizer.global_state_pieces() with merge_fused_state")
            raise ValueError(
                f"the fused optimizer state has no entry for {missing[:5]}{' ...' if len(missing) > 5 else ''}: "
                f"the checkpoint was saved with other tables or another fused optimizer (a table added to the model "
                f"since: optimizer.load_state_dict(state, strict=False) starts its state afresh and loads the others)"
            )
        for local_key, (local, key, tensor) in expected.items():
            name, meta, (rows, cols) = self._pieces[local]
            global_key = f"{name}.{key}"
            if local_key in saved and local_key != global_key:  # a piece's own state, saved by this layout
                value = saved[local_key]
            else:
                whole = saved[global_key]
                # a shard slices its rows out of the whole table's state: that of a larger table covered them too,
                # and rows 0:32 of a 100-row table's state loaded into a 64-row one without a word
                want = {0: (), 1: (rows,)}.get(whole.dim(), (rows, cols))
                if tuple(whole.shape) != want:
                    raise ValueError(f"fused optimizer state '{global_key}' has shape {tuple(whole.shape)} in the "
                                     f"checkpoint but {want} here, where table '{name}' is {rows} x {cols}: the "
                                     f"table sizes differ; build the table with the checkpoint's num_embeddings "
                                     f"and embedding_dim to load it, or start this optimizer afresh")
                value = _slice_state(whole, meta)
            if value.shape != tensor.shape:
                why = ("the table sizes differ" if self._pieces[local][1] is None else "this piece of the table "
                       "has other rows or columns here: it was saved at another world size or plan, which one rank's "
                       "optimizer.state_dict() cannot follow; lightning_rec.checkpoint.save / load_optimizer can")
                raise ValueError(f"fused optimizer state '{local_key}' has shape {tuple(value.shape)} in the "
                                 f"checkpoint but {tuple(tensor.shape)} here: {why}")
            tensor.copy_(value)
        self.state_loaded()
        self.load_param_groups({g["name"]: g for g in state_dict.get("param_groups", [])})

    def load_param_groups(self, saved_by_name: Mapping[str, Mapping[str, Any]]) -> None:
        """The saved groups' values (the learning rate a scheduler reached) into the groups of the same name."""
        for group in self.param_groups:
            for key, value in saved_by_name.get(group["name"], {}).items():
                # the tables' own weight_decay / eps / betas win: they were built with them (a resume with another
                # weight_decay is a choice), and the kernels cannot take the saved ones
                if key not in ("name", "tables", "optimizer") and key not in _FIXED_KEYS:
                    group[key] = value


    def _check_same_optimizer(self, saved_groups: Sequence[Mapping[str, Any]]) -> None:
        """State saved by tables that trained with another fused optimizer is refused, naming both: rowwise_adagrad's
        per-row "sum" into adagrad said "the table sizes differ", and into sgd (no state) it loaded, silently."""
        def by_table(groups) -> dict[str, str]:
            out = {}
            for g in groups:
                if "optimizer" in g and isinstance(g.get("name"), str):
                    prefix = g["name"][: g["name"].rfind("fused")]  # "<path>." of the group's collection
                    out.update({prefix + t: str(g["optimizer"]) for t in g.get("tables", [])})
            return out

        theirs, ours = by_table(saved_groups), by_table(self.param_groups)
        other = sorted(t for t in ours if t in theirs and theirs[t] != ours[t])
        if other:
            t = other[0]
            raise ValueError(
                f"the fused optimizer state was saved by tables trained with {theirs[t]} (table '{t}', {len(other)} "
                f"table(s) like it), but these train with {ours[t]}: build the tables with "
                f"FusedOptimizerConfig('{theirs[t]}', ...) (DLRMModule(sparse_optimizer='{theirs[t]}')) to resume "
                f"from it, or load only the model's weights (model.load_state_dict) and start this optimizer afresh")


def _slice_state(whole: torch.Tensor, meta: Any) -> torch.Tensor:
    """The part of a whole-table state that a shard holds: [rows, cols] per element, [rows] per row."""
    if meta is None or whole.dim() == 0:
        return whole
    (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
    if whole.dim() == 1:
        return whole[r : r + nr]
    return whole[r : r + nr, c : c + nc]


def merge_fused_state(per_rank: Sequence[dict[str, tuple[tuple[int, int], list]]]) -> dict[str, torch.Tensor]:
    """Every rank's `FusedOptimizer.global_state_pieces()` -> whole-table state (CPU tensors).

    Per-element state ([rows, cols]: Adagrad's sum, Adam's moments) is assembled exactly. Per-row
    state ([rows]: row-wise Adagrad) of a table split by columns exists once per column shard,
    each over its own columns; the whole table's is their average weighted by width, which is what
    the unsharded optimizer keeps (the mean over all columns) when the shards saw the same rows.
    Scalars (Adam's step) are the same on every piece.
    """
    merged: dict[str, tuple[tuple[int, int], list]] = {}
    for pieces in per_rank:
        for key, (shape, parts) in pieces.items():
            merged.setdefault(key, (shape, []))[1].extend(parts)
    out = {}
    for key, ((rows, cols), parts) in merged.items():
        meta0, first = parts[0]
        if meta0 is None or first.dim() == 0:  # a replica (whole, equal on every rank) or a scalar
            out[key] = first.detach().cpu().clone()
            continue
        if first.dim() == 2:
            whole = torch.zeros(rows, cols, dtype=first.dtype)
            for meta, t in parts:
                (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
                whole[r : r + nr, c : c + nc] = t.detach().cpu()
        else:
            acc = torch.zeros(rows, dtype=torch.float64)
            width = torch.zeros(rows, dtype=torch.float64)
            for meta, t in parts:
                (r, _), (nr, nc) = meta.shard_offsets, meta.shard_sizes
                acc[r : r + nr] += t.detach().cpu().double() * nc
                width[r : r + nr] += nc
            whole = (acc / width.clamp(min=1)).to(first.dtype)
        out[key] = whole
    return out


class _CombinedState(dict):
    """Read view of the children's per-parameter state (torch code iterates `optimizer.state`)."""


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped as one: typically FusedOptimizer (embeddings) + torch.optim (dense).

    `param_groups` are the children's own group dicts, so a scheduler on the combined optimizer
    drives each child, including the fused learning rate. `step(closure)` runs the closure once,
    then steps every child. The fused groups' other hyper-parameters are fixed (a write is refused at the next
    step): torch's OneCycleLR / CyclicLR need `cycle_momentum=False` here (theirs says "optimizer must support
    momentum or beta1").
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer | tuple[str, torch.optim.Optimizer]]) -> None:
        named = [(o if isinstance(o, tuple) else (f"{i}_{type(o).__name__.lower()}", o))
                 for i, o in enumerate(optimizers)]
        if not named:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        self.optimizers: list[tuple[str, torch.optim.Optimizer]] = named
        _refuse_fused_tables_in_dense(named)
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
        """Lightning's BaseFinetuning, resuming, assigns the groups it saved (the ones it added included) before the
        optimizer state loads: the added ones join the dense child (add_param_group), as when they were first added,
        and the list stays the children's live groups (whose "lr" reaches the fused kernels)."""

        if not self.__dict__.get("_built"):  # torch's __init__
            self.__dict__["_groups"] = groups
            return
        held = {id(p) for _, o in self.optimizers for g in o.param_groups for p in g["params"]}
        for group in groups:
            # a fused group is the fused optimizer's, never new: BaseFinetuning saves rank 0's groups, and another
            # rank holds pieces of other tables (their groups hold other table parameters)
            if group["params"] and not any(id(p) in held or isinstance(p, FusedTableWeight) for p in group["params"]):
                self.add_param_group(dict(group))
        self._sync_groups()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A new group joins the dense (torch.optim) child, which steps it.

        Lightning's BaseFinetuning.unfreeze_and_add_param_group adds the layers it unfreezes so; torch's
        add_param_group put the group in this optimizer's list only, which no child steps: the layers got gradients
        and never moved."""
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
        if held:
            # the dense child took them and never stepped them (no gradient), silently: e.g. a group meant to give
            # the tables another learning rate
            raise ValueError(
                f"CombinedOptimizer.add_param_group: the group holds fused table weights (param group(s) "
                f"{', '.join(held)}), which their fused optimizer updates inside backward; a dense optimizer's group "
                f"would never step them. Their learning rate is their own group's 'lr' (optimizer.param_groups "
                f"entry named {held[0]!r}); add only the other parameters (lightning_rec.optim.dense_parameters)")
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
        """All of it: torch's Optimizer pickles defaults, state and param_groups only, and a deep copy had no
        children (KeyError '_groups' at its first use)."""
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
        """strict=False: the fused part's tables that the state holds nothing for keep theirs
        (`FusedOptimizer.load_state_dict`); the dense parts load as torch.optim's do."""
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


def _refuse_fused_tables_in_dense(named: Sequence[tuple[str, torch.optim.Optimizer]]) -> None:
    """A dense optimizer built over model.parameters() holds the fused tables' weights too (which never get a
    gradient): torch said only "some parameters appear in more than one parameter group"."""
    # a sharded group holds one parameter per table, not per piece: its params do not pair with its tables' names
    fused = {id(p): f"{g['name']}: {g['tables'][i]}" if len(g["params"]) == len(g["tables"]) else g["name"]
             for _, o in named if isinstance(o, FusedOptimizer) for g in o.param_groups
             for i, p in enumerate(g["params"])}
    for name, o in named:
        if isinstance(o, FusedOptimizer):
            continue
        held = [fused[id(p)] for g in o.param_groups for p in g["params"] if id(p) in fused]
        if held:
            raise ValueError(
                f"the {type(o).__name__} optimizer '{name}' holds fused table weights ({', '.join(held[:3])}"
                f"{' ...' if len(held) > 3 else ''}), which the fused optimizer updates inside backward (they never "
                f"get a gradient): build it over the other parameters, "
                f"{type(o).__name__}(lightning_rec.optim.dense_parameters(model), ...) (those that require a "
                f"gradient), not model.parameters()")


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


# TorchRec's ways in: apply_optimizer_in_backward, KeyedOptimizerWrapper, in_backward_optimizer_filter ----------

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

    Equivalent to building the collections with `optimizer=FusedOptimizerConfig(...)`: every collection
    whose tables are in `params` gets that fused update (torch.optim.SGD, Adagrad or Adam with their
    defaults, or a fused optimizer by name such as "rowwise_adagrad"). One update per collection:
    `params` must hold all of a collection's tables. As in every fused (sparse) update, only the rows a
    batch reads move: weight_decay decays those rows, and Adam takes torch.optim.Adam's step on them, lazily as
    torch.optim.SparseAdam does (whose eps, though, sits before the bias correction); torch.optim.Adam decays,
    and moves by momentum, every row at every step. Call it before building optimizers or
    DistributedModelParallel over the model: the collection's table parameters are made anew (their
    values kept). Dense parameters are refused: train them with a torch.optim optimizer
    (CombinedOptimizer / combined_optimizer).
    """

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


def in_backward_optimizer_filter(named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                                 include: bool = False) -> Iterable[tuple[str, torch.nn.Parameter]]:
    """TorchRec's filter: (name, parameter) pairs without a fused update (include=True: only those with one).

    Fused tables never require a gradient (their rows are updated inside backward): that is the test.
    """
    for name, p in named_parameters:
        if (not p.requires_grad) == include:
            yield name, p


class KeyedOptimizerWrapper(torch.optim.Optimizer):
    """TorchRec's `KeyedOptimizerWrapper(dict(model.named_parameters()), lambda params: torch.optim.SGD(params, ...))`.

    The factory's optimizer over the parameters that train through autograd: fused tables (which
    never hold a gradient) are left out, so that e.g. Adagrad keeps no state for them. `params` maps
    names to those parameters. state_dict is the inner optimizer's (torch's format, by index).
    Combine it with the fused part: `CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", it)])`.
    """

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

    state_sum += mean(g^2 over the row's columns); w -= lr * g / (sqrt(state_sum) + eps). It is the
    fused "rowwise_adagrad" update, so `apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(),
    {"lr": 0.05})` fuses it into the tables (TorchRec's golden DLRM example does that), and it trains
    unfused tables or other 2-d weights directly. 1-d parameters keep one accumulator per element.
    """

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


# the dense layers' optimizers, by the name the modules' dense_optimizer argument takes
DENSE_OPTIMIZERS = {
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}
