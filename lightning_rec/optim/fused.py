"""FusedOptimizer: the fused embedding updates of a model, seen as a torch optimizer; `merge_fused_state`.

The state dict keys state by table ("<module path>.<table>.<state>"), so it loads into any kernel and any grouping of
the same tables; a sharded model's pieces merge into whole tables for resharding."""

from __future__ import annotations

import re
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_rec.optim.fused_paths import fused_modules
from lightning_rec.optim.param_groups import _FIXED_KEYS, _FusedDefaults, _FusedParamGroup, _picklable_state

_SHARDED_COPY = (
    "the fused optimizer of a sharded model (DistributedModelParallel) cannot be pickled or deep-copied: its "
    "kernels are tied to this run's process groups. Save its state instead, torch.save(optimizer.state_dict(), f) "
    "(or lightning_rec.checkpoint.save for a checkpoint that loads at any world size), and load that into the "
    "optimizer of the model sharded again, optimizer.load_state_dict(torch.load(f))")


_TORCH_STATE_DICT_API = "torch.distributed.checkpoint.state_dict"


def _refuse_torch_state_dict_api(optimizer: torch.optim.Optimizer) -> None:
    """DCP's get/set_state_dict read optimizer state by parameter index: called from there, say what does it instead."""
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

    `step()` runs the closure and applies nothing (the rows were updated in backward) but the rows still gathered
    by `gather_fused_gradients` (gradient accumulation); one param group per fused kernel
    carries its "lr", starting at `FusedOptimizerConfig.lr`. The state dict keys state by `<module path>.<table>.<state
    name>`, so it loads into any kernel and any grouping of the same tables."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._tables: dict[str, tuple[Any, int]] = {}  # "<path>.<table>" -> (kernel, index in kernel)
        # "<path>.<local table>" -> ("<path>.<global table>", ShardMetadata or None: whole, global shape)
        self._pieces: dict[str, tuple[str, Any, tuple[int, int]]] = {}
        groups = []
        # sharded kernels hold the run's process groups, which neither pickle nor deepcopy can copy
        self._sharded = any(callable(getattr(m, "shard_of", None)) for _, m in fused_modules(model))
        for path, module in fused_modules(model):
            shard_of = getattr(module, "shard_of", None)
            # the collection's own table parameters, which BaseFinetuning maps to the model's names
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
                # a new optimizer starts at its configured rate (the kernel keeps the last scheduler's)
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
        # modules whose rows moved at a model load (sharded id maps): told when the state has loaded (weakly held)
        self._after_state_load = [weakref.ref(m) for m in model.modules()
                                  if callable(getattr(m, "optimizer_state_loaded", None))]

    def __getstate__(self) -> dict[str, Any]:
        """All of it: torch's Optimizer pickles defaults, state and param_groups only (a copy had no tables)."""
        if self.__dict__.get("_sharded"):
            raise TypeError(_SHARDED_COPY)
        return _picklable_state(self)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        # a weight_decay / eps / betas written into a group never reaches the kernels: refused at the next step
        for group in self.param_groups:
            if isinstance(group, _FusedParamGroup):
                group.check_fixed()
        out = closure() if closure is not None else None
        # rows gathered (gather_fused_gradients) that no backward outside applied: their one update now
        for kernel in {id(k): k for k, _ in self._tables.values()}.values():
            if callable(getattr(kernel, "apply_gathered", None)):
                kernel.apply_gathered()
        return out

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
        for ref in self.__dict__.get("_after_state_load", []):  # collective: rows moved since the model's load
            module = ref()
            if module is not None:
                module.optimizer_state_loaded()

    def global_table_names(self) -> list[str]:
        """Every table this optimizer updates, by its whole-table name ("<path>.<table>"), stateless ones too."""
        return list(dict.fromkeys(name for name, _, _ in self._pieces.values()))

    def global_state_pieces(self) -> dict[str, tuple[tuple[int, int], list[tuple[Any, torch.Tensor]]]]:
        """This rank's optimizer state under whole-table names, for resharding. "<path>.<table>.<state>" -> (global
        shape, [(ShardMetadata or None, state view)]); every rank's, merged by `merge_fused_state`, load into any
        world size, plan, or the unsharded model."""
        out: dict[str, tuple[tuple[int, int], list]] = {}
        for local, states in self.table_states().items():
            name, meta, shape = self._pieces[local]
            for key, value in states.items():
                out.setdefault(f"{name}.{key}", (shape, []))[1].append((meta, value))
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:  # type: ignore[override]
        """Shard-local state (saved by this layout) or whole-table state: each piece reads its rows and columns.
        strict=False: a table the state holds nothing for keeps its current state."""
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
                # a shard slices its rows out of the whole table's state: a larger table's would cover them too
                want = {0: (), 1: (rows,)}.get(whole.dim(), (rows, cols))
                if tuple(whole.shape) != want:
                    raise ValueError(f"fused optimizer state '{global_key}' has shape {tuple(whole.shape)} in the "
                                     f"checkpoint but {want} here, where table '{name}' is {rows} x {cols}: the "
                                     f"table sizes differ; build the table with the checkpoint's num_embeddings "
                                     f"and embedding_dim to load it, or start this optimizer afresh")
                value = _slice_state(whole, meta)
                if global_key + COLUMN_BLOCKS in saved and meta is not None:  # each column shard's own, kept
                    (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
                    offsets = saved[global_key + COLUMN_OFFSETS].tolist()
                    value = per_row_of_blocks(saved[global_key + COLUMN_BLOCKS][r : r + nr].unbind(1),
                                              column_overlaps(offsets, cols, c, nc))
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
                # the tables' own weight_decay / eps / betas win: the kernels were built with them
                if key not in ("name", "tables", "optimizer") and key not in _FIXED_KEYS:
                    group[key] = value

    def _check_same_optimizer(self, saved_groups: Sequence[Mapping[str, Any]]) -> None:
        """State saved by tables that trained with another fused optimizer is refused, naming both."""
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


# per-row state of a table split by columns, kept per column shard beside the whole-table mean: "<key>" + these
COLUMN_BLOCKS, COLUMN_OFFSETS = "@column_blocks", "@column_offsets"


def column_overlaps(offsets: Sequence[int], cols: int, c: int, nc: int) -> list[int]:
    """How many of the columns [c, c + nc) each column block holds (blocks start at `offsets`, the last ends at
    `cols`)."""
    ends = list(offsets[1:]) + [cols]
    return [max(0, min(b, c + nc) - max(a, c)) for a, b in zip(offsets, ends)]


def per_row_of_blocks(blocks: Sequence[torch.Tensor], overlaps: Sequence[int]) -> torch.Tensor:
    """A shard's per-row state from the column blocks' (each a mean over its columns, of g^2 summed or averaged over
    steps): the block's it lies in (its own, at the same plan), or the mean of those it overlaps weighted by overlap,
    which is the state those columns would have kept as one shard. A shard cut out of a block gets the block's."""
    held = [k for k, w in enumerate(overlaps) if w]
    if len(held) == 1:
        return blocks[held[0]].reshape(-1)
    acc = sum(blocks[k].reshape(-1).double() * overlaps[k] for k in held)
    return (acc / sum(overlaps[k] for k in held)).to(blocks[held[0]].dtype)


def merge_fused_state(per_rank: Sequence[dict[str, tuple[tuple[int, int], list]]],
                      column_blocks: bool = False) -> dict[str, torch.Tensor]:
    """Every rank's `FusedOptimizer.global_state_pieces()` -> whole-table state (CPU tensors). Per-element state is
    assembled exactly. Per-row state (row-wise Adagrad) of a table split by columns is the column shards' average
    weighted by width (the unsharded mean over all columns). Scalars are the same everywhere.

    column_blocks: also each column shard's own per-row state, under "<key>@column_blocks" ([rows, K]) with the
    shards' first columns under "<key>@column_offsets": `load_state_dict` gives a shard its own (an exact resume)."""
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
            offsets = sorted({meta.shard_offsets[1] for meta, _ in parts})
            blocks = torch.zeros(rows, len(offsets), dtype=first.dtype)
            for meta, t in parts:
                (r, c), nr = meta.shard_offsets, meta.shard_sizes[0]
                blocks[r : r + nr, offsets.index(c)] = t.detach().cpu()
            whole = per_row_of_blocks(blocks.unbind(1), column_overlaps(offsets, cols, 0, cols))
            if column_blocks and len(offsets) > 1:
                out[key + COLUMN_BLOCKS], out[key + COLUMN_OFFSETS] = blocks, torch.tensor(offsets)
        out[key] = whole
    return out
