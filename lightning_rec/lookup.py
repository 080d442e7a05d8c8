"""Embedding lookups over a set of local tables, grouped into as few kernels as possible.

Shapes: F features, B batch, N ids, D dims, T tables.

Used by the unsharded collections (every table is local) and by the sharded ones (the local
tables are this rank's shards). Two compute kernels:

- fused: one table-batched kernel per group (fbgemm TBE, or our native CPU kernel once built)
  whose backward applies the optimizer to the rows it touched; no weight gradient exists.
- dense: one ordinary `nn.Parameter` per table and `F.embedding_bag` per feature; autograd
  produces the gradient and a torch.optim optimizer (or DDP) steps it.

Tables are grouped by what a kernel must share (pooling; data type); several features may read
one table. A lookup expects its features in `feature_names` order (group-major) and returns
their pooled embeddings side by side in that order: pooled_BD with D = sum of the features' dims.
Each table's weights are exposed as `weights[name]`: a view into the kernel's storage, so writes
through it (checkpoint loading, resharding) land in the kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_rec.optim import FBGEMM_CPU_OPTIMIZERS, EmbOptimType, FusedOptimizerConfig
from lightning_rec.sparse import KeyedJaggedTensor

KERNELS = ("auto", "fbgemm", "native", "dense")
NATIVE_POOLINGS = ("sum", "mean")


@dataclass(frozen=True)
class LocalTable:
    """One table (or shard) as a kernel sees it."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooling: str  # "sum" | "mean" | "none"
    data_type: torch.dtype = torch.float32
    weight_init: tuple[float, float] | None = None  # uniform range; None: +-sqrt(1/rows)
    # Where a fused table lives on GPU (a plan's compute kernel): "fused" in device memory,
    # "fused_uvm" in host memory through unified memory, "fused_uvm_caching" in host memory with a
    # device cache. On CPU every table is in host memory already, so all three are the same.
    compute_kernel: str = "fused"

    def init_range(self) -> tuple[float, float]:
        if self.weight_init is not None:
            return self.weight_init
        bound = math.sqrt(1.0 / max(self.num_embeddings, 1))
        return (-bound, bound)


# fbgemm is imported lazily so that configs and KJTs work where only the dense kernel is wanted.
def _fbgemm():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbOpt
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return dict(
        TBE=SplitTableBatchedEmbeddingBagsCodegen, ComputeDevice=ComputeDevice,
        EmbeddingLocation=EmbeddingLocation, PoolingMode=PoolingMode, BoundsCheckMode=BoundsCheckMode,
        FbOpt=FbOpt, SparseType=SparseType,
    )


_FBGEMM_OPTIMIZER_NAMES = {
    EmbOptimType.SGD: "EXACT_SGD",
    EmbOptimType.ADAGRAD: "EXACT_ADAGRAD",
    EmbOptimType.ROWWISE_ADAGRAD: "EXACT_ROWWISE_ADAGRAD",
    EmbOptimType.ADAM: "ADAM",
    EmbOptimType.PARTIAL_ROWWISE_ADAM: "PARTIAL_ROWWISE_ADAM",
    EmbOptimType.LAMB: "LAMB",
    EmbOptimType.LARS_SGD: "LARS_SGD",
}


def _native_module():
    try:
        from lightning_rec import native_embedding
    except ImportError:
        return None
    return native_embedding if native_embedding.native_kernel_available() else None


def _native_supports(native, opt: EmbOptimType) -> bool:
    return native is not None and opt in native.NATIVE_OPTIMIZERS


def cpu_supported_optimizers() -> list[EmbOptimType]:
    native = _native_module()
    if native is None:
        return list(FBGEMM_CPU_OPTIMIZERS)
    return [o for o in EmbOptimType if o in FBGEMM_CPU_OPTIMIZERS or _native_supports(native, o)]


def choose_kernel(kernel: str, optimizer: FusedOptimizerConfig, device: torch.device,
                  pooling: str = "sum") -> str:
    """Resolve "auto" to "fbgemm" or "native"; refuse combinations that cannot run."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown embedding kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
    opt = EmbOptimType(optimizer.optimizer)
    if device.type != "cpu":
        if kernel == "native":
            raise ValueError("kernel='native' runs on CPU only: use kernel='fbgemm' (or 'auto') on GPU")
        return "fbgemm"
    native = _native_module()
    if kernel == "native":
        if native is None:
            raise ValueError(
                "kernel='native' needs the C++ extension lightning_rec._C, which is not built: "
                "run `make test` or `pip install --no-build-isolation -e .` to build it, or use kernel='fbgemm'"
            )
        if not _native_supports(native, opt):
            raise ValueError(f"the native CPU kernel does not implement {opt}: use one of "
                             f"{', '.join(str(o) for o in EmbOptimType if _native_supports(native, o))}")
        if pooling not in NATIVE_POOLINGS:
            raise ValueError(f"the native CPU kernel pools with sum or mean only: use kernel='fbgemm' for "
                             f"pooling {pooling!r} (sequence tables)")
        return "native"
    if kernel == "auto" and pooling in NATIVE_POOLINGS and _native_supports(native, opt) and (
        native.prefer_native(opt) or opt not in FBGEMM_CPU_OPTIMIZERS
    ):
        return "native"
    if opt not in FBGEMM_CPU_OPTIMIZERS:
        supported = ", ".join(str(o) for o in cpu_supported_optimizers())
        raise ValueError(
            f"fused optimizer {opt} is not available on CPU: CPU supports {supported}; "
            f"{opt} runs on GPU (device='cuda')"
        )
    return "fbgemm"


def _location(fb: dict, table: LocalTable, on_cpu: bool):
    where = fb["EmbeddingLocation"]
    if on_cpu:
        return where.HOST
    locations = {"fused": where.DEVICE, "fused_uvm": where.MANAGED, "fused_uvm_caching": where.MANAGED_CACHING}
    if table.compute_kernel not in locations:
        raise ValueError(f"table '{table.name}': compute kernel {table.compute_kernel!r} is not a fused kernel: "
                         f"use one of {', '.join(locations)}")
    return locations[table.compute_kernel]


def _make_fbgemm_tbe(tables: Sequence[LocalTable], feature_table_map: list[int], pooling: str,
                     optimizer: FusedOptimizerConfig, device: torch.device) -> nn.Module:
    fb = _fbgemm()
    on_cpu = device.type == "cpu"
    compute = fb["ComputeDevice"].CPU if on_cpu else fb["ComputeDevice"].CUDA
    specs = [(t.num_embeddings, t.embedding_dim, _location(fb, t, on_cpu), compute) for t in tables]
    pooling_mode = {"sum": fb["PoolingMode"].SUM, "mean": fb["PoolingMode"].MEAN,
                    "none": fb["PoolingMode"].NONE}[pooling]
    precision = {torch.float32: fb["SparseType"].FP32, torch.float16: fb["SparseType"].FP16}
    dtype = tables[0].data_type
    if dtype not in precision:
        raise ValueError(f"table data_type {dtype} is not supported: use torch.float32 or torch.float16")
    opt = EmbOptimType(optimizer.optimizer)
    kwargs = {}
    if optimizer.weight_decay:
        from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

        # L2 adds weight_decay * w to the gradient before the update, as torch.optim does.
        kwargs.update(weight_decay=optimizer.weight_decay, weight_decay_mode=WeightDecayMode.L2)
    tbe = fb["TBE"](
        specs,
        feature_table_map=feature_table_map,
        optimizer=getattr(fb["FbOpt"], _FBGEMM_OPTIMIZER_NAMES[opt]),
        learning_rate=optimizer.lr,
        eps=optimizer.eps,
        beta1=optimizer.beta1,
        beta2=optimizer.beta2,
        momentum=optimizer.momentum,
        eta=optimizer.eta,
        weights_precision=precision[dtype],
        output_dtype=precision[dtype],
        pooling_mode=pooling_mode,
        # Ids are checked (with feature and table names) before the kernel; see check_ids.
        bounds_check_mode=fb["BoundsCheckMode"].NONE,
        device=device,
        table_names=[t.name for t in tables],
        **kwargs,
    )
    return tbe


class FusedKernel(nn.Module):
    """One table-batched kernel with the optimizer fused into backward."""

    def __init__(self, tables: Sequence[LocalTable], pooling: str, optimizer: FusedOptimizerConfig,
                 device: torch.device, kernel: str = "auto") -> None:
        super().__init__()
        self.tables = list(tables)
        self.pooling = pooling
        self.optimizer_config = optimizer
        self.kernel = choose_kernel(kernel, optimizer, device, pooling)
        feature_table_map = [i for i, t in enumerate(tables) for _ in t.feature_names]
        if self.kernel == "native":
            native = _native_module()
            self.tbe = native.NativeTableBatchedEmbeddingBags(
                [(t.num_embeddings, t.embedding_dim) for t in tables], feature_table_map, pooling,
                optimizer, table_names=[t.name for t in tables],
                weight_init=[t.init_range() for t in tables], weights_precision=tables[0].data_type,
            )
        else:
            self.tbe = _make_fbgemm_tbe(tables, feature_table_map, pooling, optimizer, device)
            with torch.no_grad():
                for t, w in zip(tables, self.tbe.split_embedding_weights()):
                    w.uniform_(*t.init_range())

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        weights_N = features.weights_or_none()
        if weights_N is not None and weights_N.dtype != torch.float32:
            weights_N = weights_N.float()
        return self.tbe(features.values(), features.offsets(), per_sample_weights=weights_N)

    def split_embedding_weights(self) -> list[Tensor]:
        return list(self.tbe.split_embedding_weights())

    def optimizer_states(self) -> list[dict[str, Tensor]]:
        """Per table, the optimizer's state by name (views into the kernel's storage)."""
        states = [dict(s) for s in self.tbe.get_optimizer_state()]
        # Stateless optimizers (SGD) come back as an empty list rather than one {} per table.
        return states if states else [{} for _ in self.tables]

    def set_learning_rate(self, lr: float) -> None:
        self.tbe.set_learning_rate(lr)

    def get_learning_rate(self) -> float:
        return float(self.tbe.get_learning_rate())


class DenseKernel(nn.Module):
    """Per-table parameters, autograd gradients: for data-parallel tables and torch.optim users."""

    def __init__(self, tables: Sequence[LocalTable], pooling: str, device: torch.device) -> None:
        super().__init__()
        self.tables = list(tables)
        self.pooling = pooling
        self.weights = nn.ParameterList()
        for t in tables:
            w = torch.empty(t.num_embeddings, t.embedding_dim, dtype=t.data_type, device=device)
            nn.init.uniform_(w, *t.init_range())
            self.weights.append(nn.Parameter(w))
        self._feature_table = [i for i, t in enumerate(tables) for _ in t.feature_names]

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        outs = []
        # One call per feature (not per id): per-key lengths are cached on the KJT, so no sync.
        for t, jt in zip(self._feature_table, features.to_dict().values()):
            table = self.weights[t]
            if self.pooling == "none":
                outs.append(F.embedding(jt.values(), table))
                continue
            w = jt.weights_or_none()
            w = None if w is None else w.to(table.dtype)
            bag_offsets = jt.offsets()[:-1]
            if self.pooling == "mean" and w is not None:
                # torch's embedding_bag takes per-id weights only with sum; mean = sum / ids in bag.
                summed = F.embedding_bag(jt.values(), table, bag_offsets, mode="sum", per_sample_weights=w)
                outs.append(summed / jt.lengths().clamp(min=1).unsqueeze(1).to(table.dtype))
            else:
                outs.append(F.embedding_bag(jt.values(), table, bag_offsets, mode=self.pooling,
                                            per_sample_weights=w))
        return torch.cat(outs, dim=0 if self.pooling == "none" else 1)

    def split_embedding_weights(self) -> list[Tensor]:
        return [w for w in self.weights]


def group_tables(tables: Sequence[LocalTable]) -> list[list[LocalTable]]:
    """Tables that can share one kernel, in order of first appearance."""
    groups: dict[tuple, list[LocalTable]] = {}
    for t in tables:
        # Sequence kernels need one dim per kernel; pooled kernels mix dims freely.
        key = (t.pooling, t.data_type, t.embedding_dim if t.pooling == "none" else None)
        groups.setdefault(key, []).append(t)
    return list(groups.values())


class GroupedLookup(nn.Module):
    """This process's tables, grouped into kernels. forward: KJT in `feature_names` order."""

    def __init__(self, tables: Sequence[LocalTable], optimizer: FusedOptimizerConfig | None,
                 device: torch.device | str | None = None, kernel: str = "auto") -> None:
        super().__init__()
        device = torch.device(device or "cpu")
        if optimizer is None and kernel not in ("auto", "dense"):
            raise ValueError(f"kernel={kernel!r} fuses an optimizer: pass optimizer=FusedOptimizerConfig(...) "
                             f"or use kernel='dense'")
        if optimizer is not None and kernel == "dense":
            raise ValueError("kernel='dense' trains tables with a torch.optim optimizer, so the fused optimizer "
                             "would be ignored: drop optimizer=..., or use kernel='auto' to fuse it")
        self.groups = group_tables(tables)
        self.kernels = nn.ModuleList()
        for group in self.groups:
            if optimizer is None or kernel == "dense":
                self.kernels.append(DenseKernel(group, group[0].pooling, device))
            else:
                self.kernels.append(FusedKernel(group, group[0].pooling, optimizer, device, kernel))
        self.tables = [t for g in self.groups for t in g]
        self.feature_names = [f for t in self.tables for f in t.feature_names]
        self.feature_dims = [t.embedding_dim for t in self.tables for _ in t.feature_names]
        self._group_sizes = [sum(len(t.feature_names) for t in g) for g in self.groups]

    @property
    def is_fused(self) -> bool:
        return any(isinstance(k, FusedKernel) for k in self.kernels)

    def forward(self, features: KeyedJaggedTensor) -> list[Tensor]:
        """One output per kernel group: pooled_BD (features side by side) or values_ND (sequence)."""
        assert features.keys() == self.feature_names, (features.keys(), self.feature_names)
        parts = features.split(self._group_sizes) if len(self.kernels) > 1 else [features]
        return [kernel(part) for kernel, part in zip(self.kernels, parts)]

    def table_weights(self) -> dict[str, Tensor]:
        """table name -> [rows, dim] view into the kernel's storage."""
        return {t.name: w for k in self.kernels for t, w in zip(k.tables, k.split_embedding_weights())}

    def fused_kernels(self) -> list[FusedKernel]:
        return [k for k in self.kernels if isinstance(k, FusedKernel)]
