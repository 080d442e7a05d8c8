"""A self-contained serving package: the whole model (DLRM / DCNv2, a multi-task ranker, or one tower of a two-tower
model) traced by `torch.export` over raw feature tensors and compiled by AOTInductor into one `.pt2` file. A server
loads it with torch and fbgemm_gpu alone (`torch._inductor.aoti_load_package`), without lightning_rec; its tables are
read by fbgemm's integer TBE kernel in the export's table type.

Inputs (named in the package's metadata, key "inputs", in call order): `dense_features` float32 [B, I] (a DLRM, a
multi-task ranker with dense inputs), `values` int64 [N] (the ids, feature by feature in the metadata's order, each
feature's B rows in turn), `lengths` int64 [F * B] (ids per feature and row, feature-major), and `weights` float32
[N] (one per id, in `values`' order) where the tables are weighted (metadata "weighted": true). Output: a DLRM's
logits [B]; a multi-task ranker's [B, T] (metadata "tasks": column t is task t's logit, or its value for a
regression task); a tower's embeddings [B, D].
An id outside its table, or a negative one, fails the request (RuntimeError); so do lengths that are not F * B
long (a feature missing) or lengths that do not add up to N. A model with managed-collision tables takes their
features' raw ids ("raw_ids": true in sparse_features): the id map travels in the package and an id without a row
reads the table's shared unknown row, as in the model's evaluation; a negative raw id fails the request (training
refuses it too).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_rec.managed_collision import ManagedCollisionEmbeddingBagCollection
from lightning_rec.serving.quant import QuantEmbeddingBagCollection, quantize_inference_model

PACKAGE_FORMAT = "lightning_rec.serving/1"


class KernelLookup(nn.Module):
    """A QuantEmbeddingBagCollection's lookup as one fbgemm op over plain buffers (what torch.export can trace):
    ids checked against their tables in torch, then `int_nbit_split_embedding_codegen_lookup_function`."""

    def __init__(self, collection: QuantEmbeddingBagCollection) -> None:
        super().__init__()
        tbe = collection.tbe
        for name in ("weights_host", "weights_placements", "weights_offsets", "weights_tys", "D_offsets"):
            self.register_buffer(name, getattr(tbe, name).clone())
        rows = {c.name: c.num_embeddings for c in collection.embedding_bag_configs()}
        self.register_buffer("rows_per_feature", torch.tensor(
            [rows[c.name] for c in collection.embedding_bag_configs() for _ in c.feature_names], dtype=torch.int64))
        self.num_features = len(collection.feature_names())
        self.kernel_args = dict(
            total_D=tbe.total_D, max_int2_D=tbe.max_int2_D, max_int4_D=tbe.max_int4_D, max_int8_D=tbe.max_int8_D,
            max_float16_D=tbe.max_float16_D, max_float32_D=tbe.max_float32_D, pooling_mode=int(tbe.pooling_mode),
            output_dtype=tbe.output_dtype, row_alignment=tbe.row_alignment, max_float8_D=tbe.max_float8_D,
            fp8_exponent_bits=tbe.fp8_exponent_bits, fp8_exponent_bias=tbe.fp8_exponent_bias)

    def forward(self, values: Tensor, lengths: Tensor, weights: Tensor | None = None) -> Tensor:
        per_feature = lengths.view(self.num_features, -1).sum(1)
        limit = self.rows_per_feature.repeat_interleave(per_feature, output_size=values.shape[0])
        torch._assert_async(((values >= 0) & (values < limit)).all(),
                            "an id is outside its table (negative, or not below the table's rows): see the "
                            "package's metadata for each feature's rows")
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
            dev_weights=self.weights_host, uvm_weights=torch.empty(0, dtype=torch.uint8),
            weights_placements=self.weights_placements, weights_offsets=self.weights_offsets,
            weights_tys=self.weights_tys, D_offsets=self.D_offsets, indices=values, offsets=offsets,
            indice_weights=weights, lxu_cache_weights=torch.empty(0, 0, dtype=torch.uint8),
            lxu_cache_locations=torch.empty(0, dtype=torch.int32), **self.kernel_args)


class RawIdRemap(nn.Module):
    """Raw ids -> rows through the managed-collision tables' id maps, read only (an id without a row reads its table's
    unknown row); features of other tables keep their ids. One segmented binary search over the maps laid end to
    end, a fixed number of halvings (what torch.export traces: no data-dependent shapes)."""

    def __init__(self, managed: ManagedCollisionEmbeddingBagCollection) -> None:
        super().__init__()
        modules = managed._managed_collision_collection.modules_by_table()
        ids, rows, start, end, unknown = [], [], [], [], []
        at = 0
        for c in managed._embedding_module.embedding_bag_configs():
            m = modules.get(c.name)
            table_ids, table_rows = m.id_map() if m is not None else (torch.zeros(0, dtype=torch.int64),) * 2
            ids.append(table_ids)
            rows.append(table_rows)
            for _ in c.feature_names:
                start.append(at)
                end.append(at + table_ids.numel())
                unknown.append(m.unknown_row if m is not None else -1)  # -1: no map, the id is the row
            at += table_ids.numel()
        self.register_buffer("ids", torch.cat(ids + [torch.full((1,), torch.iinfo(torch.int64).max)]))
        self.register_buffer("rows", torch.cat(rows + [torch.zeros(1, dtype=torch.int64)]))
        self.register_buffer("start", torch.tensor(start, dtype=torch.int64))
        self.register_buffer("end", torch.tensor(end, dtype=torch.int64))
        self.register_buffer("unknown", torch.tensor(unknown, dtype=torch.int64))
        self.tables = sorted(modules)
        self.halvings = max(e - s for s, e in zip(start, end)).bit_length() + 1 if start else 1

    def forward(self, values: Tensor, lengths: Tensor) -> Tensor:
        # a negative raw id would read the unknown row silently (a signed hash, most likely): refused as in training
        torch._assert_async((values >= 0).all(), "an id is negative: raw ids (features with raw_ids: true in the "
                            "package's metadata) and rows alike are non-negative")
        per_feature = lengths.view(self.start.shape[0], -1).sum(1)
        feature_N = torch.repeat_interleave(torch.arange(self.start.shape[0]), per_feature,
                                            output_size=values.shape[0])
        lo, hi = self.start[feature_N], self.end[feature_N]
        for _ in range(self.halvings):  # lower bound of each id in its table's sorted map
            mid = (lo + hi) // 2
            less = self.ids[mid] < values
            lo, hi = torch.where((lo < hi) & less, mid + 1, lo), torch.where((lo < hi) & ~less, mid, hi)
        found = (lo < self.end[feature_N]) & (self.ids[lo] == values)
        unknown = self.unknown[feature_N]
        return torch.where(unknown < 0, values, torch.where(found, self.rows[lo], unknown))


def _tables(collection: nn.Module) -> nn.Module:
    """The tables of a collection, inside a managed-collision one."""
    managed = isinstance(collection, ManagedCollisionEmbeddingBagCollection)
    return collection._embedding_module if managed else collection


class DLRMHead(nn.Module):
    """A DLRM / DLRM_DCN after its lookup: (dense_features [B, I], sparse_BFD) -> logits [B]."""

    def __init__(self, dlrm: nn.Module) -> None:
        super().__init__()
        self.dense_arch, self.inter_arch, self.over_arch = dlrm.dense_arch, dlrm.inter_arch, dlrm.over_arch

    def forward(self, dense_features: Tensor, sparse_BFD: Tensor) -> Tensor:
        return self.over_arch(self.inter_arch(self.dense_arch(dense_features), sparse_BFD)).squeeze(1)


class MultiTaskHead(nn.Module):
    """A MultiTaskNet after its lookup: (dense_features [B, I] or None, sparse_BFD) -> [B, T]."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        net.sparse_arch = None  # the package's KernelLookup holds the tables (net: a copy of the model's)
        self.net = net

    def forward(self, dense_features: Tensor | None, sparse_BFD: Tensor) -> Tensor:
        return self.net.from_pooled(dense_features, sparse_BFD)


class RankerServing(nn.Module):
    """(dense_features [B, I] when the model has dense inputs, values [N], lengths [F * B], weights [N] when its
    tables are weighted) -> `head`(dense_features, the pooled embeddings [B, F, D])."""

    def __init__(self, sparse_arch: nn.Module, head: nn.Module, dense: bool) -> None:
        super().__init__()
        collection = sparse_arch.embedding_bag_collection
        managed = isinstance(collection, ManagedCollisionEmbeddingBagCollection)
        self.remap = RawIdRemap(collection) if managed else None
        self.lookup, self.head, self.dense = KernelLookup(_tables(collection)), head, dense
        self.num_features, self.embedding_dim = sparse_arch.num_features, sparse_arch.embedding_dim

    def forward(self, *inputs: Tensor) -> Tensor:
        dense_features, sparse = (inputs[0], inputs[1:]) if self.dense else (None, inputs)
        if self.remap is not None:
            sparse = (self.remap(sparse[0], sparse[1]), *sparse[1:])
        sparse_BFD = self.lookup(*sparse).view(-1, self.num_features, self.embedding_dim)
        return self.head(dense_features, sparse_BFD)


class TowerServing(nn.Module):
    """(values [N], lengths [F * B], weights [N] when its tables are weighted) -> one tower's embeddings [B, D]
    (normalised for score="cosine")."""

    def __init__(self, tower: nn.Module, cosine: bool) -> None:
        super().__init__()
        managed = isinstance(tower.embedding_bag_collection, ManagedCollisionEmbeddingBagCollection)
        self.remap = RawIdRemap(tower.embedding_bag_collection) if managed else None
        collection = _tables(tower.embedding_bag_collection)
        self.lookup, self.mlp, self.cosine = KernelLookup(collection), tower.mlp, cosine
        self.skip: tuple[int, int] | None = None
        if tower.skip_feature is not None:
            start = 0
            for name, dim in zip(collection._output_names, collection._output_dims):
                if name == tower.skip_feature:
                    self.skip = (start, dim)
                start += dim

    def forward(self, *inputs: Tensor) -> Tensor:
        if self.remap is not None:
            inputs = (self.remap(inputs[0], inputs[1]), *inputs[1:])
        pooled_BD = self.lookup(*inputs)
        out_BD = self.mlp(pooled_BD)
        if self.skip is not None:
            out_BD = out_BD + pooled_BD.narrow(1, *self.skip)
        return torch.nn.functional.normalize(out_BD, dim=-1) if self.cosine else out_BD


def _inner(model: nn.Module) -> nn.Module:
    return getattr(model, "model", model)  # a LightningModule's network


def _tasks(model: nn.Module, net: nn.Module) -> list[dict]:
    names = getattr(model, "task_names", None) or [f"task_{t}" for t in range(net.num_tasks)]
    types = getattr(model, "task_types", None) or ["binary"] * net.num_tasks
    return [{"name": n, "type": k, "column": t} for t, (n, k) in enumerate(zip(names, types))]


def serving_module(model: nn.Module, tables: str = "fp32", tower: str | None = None) -> tuple[nn.Module, dict]:
    """The network of `model` (DLRMModule / DLRM / DLRM_DCN, MultiTaskModule / MultiTaskNet, or TwoTowerModule /
    TwoTower with tower="user" | "item") over raw feature tensors, its tables quantized to `tables`; and the metadata
    that describes its inputs and output."""
    net = _inner(model)
    is_two_tower = hasattr(net, "user_tower") and hasattr(net, "item_tower")
    if is_two_tower != (tower is not None):
        raise ValueError(f"tower={tower!r}: give tower='user' or 'item' for a two-tower model, and no tower for a "
                         f"ranker" if is_two_tower else f"tower={tower!r}: {type(net).__name__} has no towers")
    if tower is not None and tower not in ("user", "item"):
        raise ValueError(f"tower={tower!r}: give 'user' or 'item'")
    if not is_two_tower and not hasattr(net, "sparse_arch"):
        raise ValueError(f"{type(net).__name__} is neither a ranker (DLRM, DLRM_DCN, MultiTaskNet) nor a two-tower "
                         f"model: a package is built for those")
    net = quantize_inference_model(net, tables).eval()  # a copy: the serving modules below may take it apart
    meta: dict[str, Any] = {"format": PACKAGE_FORMAT, "model": type(_inner(model)).__name__, "tower": tower,
                            "tables": tables, "dense_features": None}
    if is_two_tower:
        part = getattr(net, f"{tower}_tower")
        module: nn.Module = TowerServing(part, net.score == "cosine")
        collection = part.embedding_bag_collection
        meta["output"] = f"{tower} embeddings float32 [B, {part.out_features}]"
    elif hasattr(net, "num_tasks"):
        dense = net.dense_arch is not None
        meta["dense_features"] = net.dense_arch[0].in_features if dense else None
        meta["tasks"] = _tasks(model, net)
        meta["output"] = (f"float32 [B, {net.num_tasks}]: column t is tasks[t]'s logit (binary; its sigmoid is the "
                          f"probability) or value (regression)")
        collection = net.sparse_arch.embedding_bag_collection
        module = RankerServing(net.sparse_arch, MultiTaskHead(net), dense)
    else:
        collection = net.sparse_arch.embedding_bag_collection
        module = RankerServing(net.sparse_arch, DLRMHead(net), dense=True)
        meta["dense_features"], meta["output"] = net.dense_arch[0].in_features, "logits float32 [B]"
    raw = set(module.remap.tables) if getattr(module, "remap", None) is not None else set()
    collection = _tables(collection)
    meta["weighted"] = bool(collection._is_weighted)
    meta["inputs"] = (["dense_features"] if meta["dense_features"] is not None else []) + ["values", "lengths"] + (
        ["weights"] if meta["weighted"] else [])
    rows = {c.name: c.num_embeddings for c in collection.embedding_bag_configs()}
    meta["sparse_features"] = [{"name": collection._sources[f], "rows": rows[c.name], "raw_ids": c.name in raw}
                               for c in collection.embedding_bag_configs() for f in c.feature_names]
    meta["layout"] = ("values int64 [N]: ids feature by feature (the order of sparse_features), each feature's B rows "
                      "in turn; lengths int64 [F * B]: ids per feature and row, feature-major" +
                      ("; weights float32 [N]: each id's weight, in values' order" if meta["weighted"] else ""))
    return module.eval(), meta


def example_inputs(meta: dict, batch: int = 4, seed: int = 0,
                   raw_ids: dict[str, Sequence[int]] | None = None) -> tuple[Tensor, ...]:
    """Random inputs of the package's layout (ids within each table), in the order of meta["inputs"]. `raw_ids`:
    feature -> the raw ids its values are drawn from (features with "raw_ids": true; ids within the table read the
    unknown row unless the map holds them)."""
    g = torch.Generator().manual_seed(seed)
    features = meta["sparse_features"]
    raw = {name: torch.as_tensor(ids, dtype=torch.int64) for name, ids in (raw_ids or {}).items()}
    lengths = torch.randint(0, 3, (len(features), batch), generator=g)
    values = torch.cat([raw[f["name"]][torch.randint(0, raw[f["name"]].numel(), (int(n),), generator=g)]
                        if f["name"] in raw else torch.randint(0, f["rows"], (int(n),), generator=g)
                        for f, n in zip(features, lengths.sum(1))])
    given = {"values": values, "lengths": lengths.flatten()}
    if meta.get("weighted"):
        given["weights"] = torch.rand(len(values), generator=g)
    if meta["dense_features"] is not None:
        given["dense_features"] = torch.randn(batch, meta["dense_features"], generator=g)
    return tuple(given[name] for name in meta.get("inputs", ["dense_features", "values", "lengths"]))


def export_program(module: nn.Module, meta: dict) -> torch.export.ExportedProgram:
    """`module` (of `serving_module`) traced by torch.export over its raw inputs, the batch and the ids dynamic."""
    batch = torch.export.Dim("batch", min=1, max=1 << 24)
    ids = torch.export.Dim("ids", min=0, max=1 << 40)
    shapes = {"dense_features": {0: batch}, "values": {0: ids}, "lengths": {0: len(meta["sparse_features"]) * batch},
              "weights": {0: ids}}
    return torch.export.export(module, example_inputs(meta, batch=4), strict=False,
                               dynamic_shapes={"inputs": tuple(shapes[name] for name in meta["inputs"])})


def export_package(model: nn.Module, path: str | os.PathLike, tables: str = "fp32", tower: str | None = None,
                   overwrite: bool = False) -> Path:
    """Write `path` (a `.pt2` file): `model` exported with torch.export over raw feature tensors (a dynamic batch)
    and compiled by AOTInductor for CPU. Load it with `torch._inductor.aoti_load_package(path)` (and
    `import fbgemm_gpu`); `loaded.get_metadata()["inputs"]` is the JSON of `serving_module`'s metadata."""
    path = Path(path)
    if path.suffix != ".pt2":
        raise ValueError(f"{path}: a package's file name ends in .pt2 (torch's package format)")
    if path.exists() and not overwrite:
        raise ValueError(f"{path} exists: give a new path, or overwrite=True (--overwrite) to replace it")
    module, meta = serving_module(model, tables, tower)
    program = export_program(module, meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial.pt2")
    torch._inductor.aoti_compile_and_package(
        program, package_path=str(tmp), inductor_configs={"aot_inductor.metadata": {"inputs": json.dumps(meta)}})
    shutil.move(tmp, path)  # whole or not at all: an interrupted compile leaves no package at `path`
    return path
