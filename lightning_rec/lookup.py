"""Embedding lookups over a set of local tables, grouped into as few kernels as possible.

Shapes: F features, B batch, N ids, D dims, T tables.

Used by the unsharded collections and by the sharded ones (the local tables are this rank's shards).
Two compute kernels: fused (one table-batched kernel per group, fbgemm TBE or our native CPU kernel, whose
backward applies the optimizer to the rows it touched: no weight gradient exists) and dense (an
`nn.Parameter` per table, `F.embedding_bag` per feature, stepped by a torch.optim optimizer).

Tables are grouped by what a kernel must share (pooling, data type). A lookup takes its features in `feature_names`
order (group-major) and returns pooled_BD, D = sum of the features' dims. A table's weights are views into the kernel's
storage, so writes through them (checkpoint loading) land in the kernel."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_rec._compat import (
    compiler_disable_takes_reason,
    tbe_enable_prefetch_pipeline,
    tbe_forget_prefetches,
    tbe_prefetch,
    tbe_prefetch_takes_stream,
    tbe_unlock_lookup,
)
from lightning_rec._device import check_device_ready, cuda_missing, no_cuda_error  # noqa: F401  (imported from here too)
from lightning_rec._native import native_op
from lightning_rec.optim.config import FBGEMM_CPU_OPTIMIZERS, EmbOptimType, FusedOptimizerConfig, check_fused_lr
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.types import DEFAULT_CACHE_LOAD_FACTOR

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
    # on GPU: "fused" device memory, "fused_uvm" host memory (unified), "fused_uvm_caching" host + device cache
    compute_kernel: str = "fused"
    cache_load_factor: float | None = None  # fused_uvm_caching: its cache's share of rows (None: fbgemm's 20%)

    def init_range(self) -> tuple[float, float]:
        if self.weight_init is not None:
            return self.weight_init
        bound = math.sqrt(1.0 / max(self.num_embeddings, 1))
        return (-bound, bound)


def join_outputs(parts: Sequence[Tensor], dim: int) -> Tensor:
    """torch.cat of kernel outputs, by plain type promotion also under autocast (whose bf16 path refuses FP16 rows)."""
    if len(parts) == 1:
        return parts[0]
    device_type = parts[0].device.type
    if torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):
            return torch.cat(parts, dim=dim)
    return torch.cat(parts, dim=dim)


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

    return dict(TBE=SplitTableBatchedEmbeddingBagsCodegen, ComputeDevice=ComputeDevice,
                EmbeddingLocation=EmbeddingLocation, PoolingMode=PoolingMode, BoundsCheckMode=BoundsCheckMode,
                FbOpt=FbOpt, SparseType=SparseType)


_FBGEMM_OPTIMIZER_NAMES = {EmbOptimType.SGD: "EXACT_SGD", EmbOptimType.ADAGRAD: "EXACT_ADAGRAD",
                           EmbOptimType.ROWWISE_ADAGRAD: "EXACT_ROWWISE_ADAGRAD", EmbOptimType.ADAM: "ADAM",
                           EmbOptimType.PARTIAL_ROWWISE_ADAM: "PARTIAL_ROWWISE_ADAM", EmbOptimType.LAMB: "LAMB",
                           EmbOptimType.LARS_SGD: "LARS_SGD"}


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
    if optimizer.weight_decay and opt in _FBGEMM_CPU_NO_DECAY:
        # fbgemm's CPU kernels leave out the decay term whatever WeightDecayMode (tests/test_native_embedding.py)
        fix = ("use kernel='native' (or 'auto')" if pooling in NATIVE_POOLINGS else
               "sequence tables (EmbeddingCollection) run on fbgemm on CPU, which has no weight decay: train them on "
               "GPU (device='cuda') to decay them")
        raise ValueError(f"fbgemm's CPU kernel ignores weight_decay={optimizer.weight_decay} for fused optimizer "
                         f"{opt}: {fix}, or weight_decay=0")
    if opt not in FBGEMM_CPU_OPTIMIZERS and pooling not in NATIVE_POOLINGS:
        # the native kernel pools: sequence tables have fbgemm's CPU optimizers only
        raise ValueError(f"fused optimizer {opt} is not available for sequence tables (EmbeddingCollection) on CPU, "
                         f"which run on fbgemm's CPU kernel: use {', '.join(str(o) for o in FBGEMM_CPU_OPTIMIZERS)}, "
                         f"or train on GPU (device='cuda')")
    if opt not in FBGEMM_CPU_OPTIMIZERS:
        supported = ", ".join(str(o) for o in cpu_supported_optimizers())
        if kernel == "fbgemm" and opt in cpu_supported_optimizers():
            raise ValueError(f"fbgemm's CPU kernel does not implement fused optimizer {opt}: use kernel='native' "
                             f"(or 'auto'), which does on CPU; kernel='fbgemm' runs {opt} on GPU (device='cuda')")
        raise ValueError(f"fused optimizer {opt} is not available on CPU: CPU supports {supported}; "
                         f"{opt} runs on GPU (device='cuda')")
    return "fbgemm"


_FBGEMM_CPU_NO_DECAY = (EmbOptimType.SGD, EmbOptimType.ADAGRAD, EmbOptimType.ROWWISE_ADAGRAD)


def _location(fb: dict, table: LocalTable, on_cpu: bool):
    where = fb["EmbeddingLocation"]
    if on_cpu:
        return where.HOST
    locations = {"fused": where.DEVICE, "fused_uvm": where.MANAGED, "fused_uvm_caching": where.MANAGED_CACHING}
    if table.compute_kernel not in locations:
        raise ValueError(f"table '{table.name}': compute kernel {table.compute_kernel!r} is not a fused kernel: "
                         f"use one of {', '.join(locations)}")
    return locations[table.compute_kernel]


def tbe_cache_load_factor(tables: Sequence[LocalTable]) -> float | None:
    """The load factor of a TBE's one row cache: its fused_uvm_caching tables' factors weighted by rows, so that the
    cache holds the rows the plan priced. None: no table asked for one (fbgemm's default)."""
    caching = [t for t in tables if t.compute_kernel == "fused_uvm_caching"]
    if all(t.cache_load_factor is None for t in caching):
        return None
    rows = sum(t.num_embeddings for t in caching)
    wanted = sum(t.num_embeddings * (DEFAULT_CACHE_LOAD_FACTOR if t.cache_load_factor is None else t.cache_load_factor)
                 for t in caching)
    return wanted / max(rows, 1)


def _make_fbgemm_tbe(tables: Sequence[LocalTable], feature_table_map: list[int], pooling: str,
                     optimizer: FusedOptimizerConfig, device: torch.device, dims: Sequence[int],
                     grad_scale: float = 1.0) -> nn.Module:
    fb = _fbgemm()
    on_cpu = device.type == "cpu"
    compute = fb["ComputeDevice"].CPU if on_cpu else fb["ComputeDevice"].CUDA
    specs = [(t.num_embeddings, d, _location(fb, t, on_cpu), compute) for t, d in zip(tables, dims)]
    pooling_mode = {"sum": fb["PoolingMode"].SUM, "mean": fb["PoolingMode"].MEAN,
                    "none": fb["PoolingMode"].NONE}[pooling]
    precision = {torch.float32: fb["SparseType"].FP32, torch.float16: fb["SparseType"].FP16}
    dtype = tables[0].data_type
    if dtype not in precision:
        raise ValueError(f"table data_type {dtype} is not supported: use torch.float32 or torch.float16")
    opt = EmbOptimType(optimizer.optimizer)
    kwargs = {}
    cache = tbe_cache_load_factor(tables)
    if cache is not None and not on_cpu:
        kwargs["cache_load_factor"] = cache
    if optimizer.weight_decay:
        # this module has it in fbgemm 1.6-1.8 (fbgemm_gpu.tbe.config, where 1.7+ define it, is absent in 1.6)
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

        # L2: weight_decay * w added to the gradient, as torch.optim; scaled with a scaled gradient (padding)
        kwargs.update(weight_decay=optimizer.weight_decay * grad_scale, weight_decay_mode=WeightDecayMode.L2)
    tbe = fb["TBE"](
        specs,
        feature_table_map=feature_table_map,
        optimizer=getattr(fb["FbOpt"], _FBGEMM_OPTIMIZER_NAMES[opt]),
        learning_rate=optimizer.lr / grad_scale,
        eps=optimizer.eps,
        beta1=optimizer.beta1,
        beta2=optimizer.beta2,
        # LARS's own (None for the other updates, which have neither): fbgemm's defaults then
        **{k: v for k, v in (("momentum", optimizer.momentum), ("eta", optimizer.eta)) if v is not None},
        weights_precision=precision[dtype],
        # fp32 rows out of fp16 tables, as the native kernel and TorchRec's (an fp32 gradient, one wire dtype)
        output_dtype=fb["SparseType"].FP32,
        pooling_mode=pooling_mode,
        # CPU batches are checked before the kernel; on GPU fbgemm counts bad ids on the device (batch_check.py)
        bounds_check_mode=fb["BoundsCheckMode"].NONE if on_cpu else fb["BoundsCheckMode"].WARNING,
        device=device,
        table_names=[t.name for t in tables],
        **kwargs,
    )
    return tbe


# fbgemm's state names where fbgemm's get_optimizer_state has none (LARS-SGD: NotImplementedError in 1.6-1.8)
_FBGEMM_SPLIT_STATE_NAMES = {EmbOptimType.LARS_SGD: ("momentum_buffer",)}
# optimizers whose bias correction counts steps: fbgemm's count is `tbe.iter`, the native kernel's "step"
_STEP_OPTIMIZERS = (EmbOptimType.ADAM, EmbOptimType.PARTIAL_ROWWISE_ADAM, EmbOptimType.LAMB)
_GATHER_POOLING = {"sum": 0, "mean": 1, "none": 2}  # gather_rows' pooling_mode


def fbgemm_optimizer_states(tbe: nn.Module, opt: EmbOptimType) -> list[dict[str, Tensor]]:
    """Per table, an fbgemm TBE's optimizer state under the names the native kernel uses (views), so state saved
    on GPU loads on CPU and back: Adam / LAMB add fbgemm's shared step counter `iter` as "step" (a 0-dim view)."""
    if opt in _FBGEMM_SPLIT_STATE_NAMES:
        names = _FBGEMM_SPLIT_STATE_NAMES[opt]
        return [dict(zip(names, per_table)) for per_table in tbe.split_optimizer_states()]
    states = [dict(s) for s in tbe.get_optimizer_state()]
    if opt in _STEP_OPTIMIZERS:
        step = tbe.iter.view(())  # one counter per kernel, shared by its tables (as the native "step")
        states = [{**s, "step": step} for s in states]
    return states


def pad_multiple(kernel: str) -> int:
    """Dims a fused kernel can take are multiples of this: fbgemm's TBE (CPU and CUDA) needs 4."""
    return 4 if kernel == "fbgemm" else 1


def padded_dim(dim: int, multiple: int) -> int:
    return -(-dim // multiple) * multiple


def padding_grad_scale(tables: Sequence[LocalTable], optimizer: FusedOptimizerConfig | None,
                       multiple: int) -> float:
    """The gradient scale that keeps a padded row-wise Adagrad table exact (1.0: none needed).

    Row-wise Adagrad keeps one accumulator per row, s += mean over the row's columns of g^2. A table of dim D padded to
    P columns (zero gradient in the P - D padding) would add only D/P of that. Scaling the gradient by c = sqrt(P/D)
    restores s exactly; the kernel's learning rate lr/c and weight decay wd*c then give the same step w -= lr * (g +
    wd*w) / (sqrt(s) + eps). The scale depends on D, so tables are grouped by it (one learning rate per kernel)."""
    if optimizer is None or EmbOptimType(optimizer.optimizer) != EmbOptimType.ROWWISE_ADAGRAD or multiple == 1:
        return 1.0
    dim = tables[0].embedding_dim  # a kernel's tables share the scale (group_tables)
    return math.sqrt(padded_dim(dim, multiple) / dim)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by `scale` (padded row-wise tables, see above)."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


class _GatherRows(torch.autograd.Function):
    """`out` as it is; its gradient goes into the kernel's buffer of rows (FusedKernel.add_row_gradients), and
    `apply` (the first lookup outside gather_fused_gradients) runs the one update from the buffer."""

    @staticmethod
    def forward(ctx, out: Tensor, anchor: Tensor, kernel: FusedKernel, features: KeyedJaggedTensor,
                apply: bool) -> Tensor:
        ctx.kernel, ctx.features, ctx.update = kernel, features, apply
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.kernel.add_row_gradients(ctx.features, grad)
        if ctx.update:
            ctx.kernel.apply_gathered()
        return grad, None, None, None, None


def _tbe_lookup(tbe, values_N: Tensor, offsets: Tensor, weights_N: Tensor | None) -> Tensor:
    if torch.is_inference_mode_enabled() and values_N.device.type == "cpu":
        # fbgemm's CPU build registers its lookup under Autograd keys only, which inference mode skips
        with torch.inference_mode(False), torch.no_grad():
            return tbe(values_N, offsets, per_sample_weights=weights_N)
    return tbe(values_N, offsets, per_sample_weights=weights_N)


_FBGEMM_EAGER_REASON = (
    "lightning_rec: fbgemm's fused embedding kernel trains outside the compiled graph (its forward reads a step "
    "counter on the host, and the update runs in its backward): use torch.compile(model) without fullgraph=True "
    "(one graph break per kernel), or, on CPU, the native kernel (EmbeddingBagCollection(..., kernel='native'), or "
    "'auto'), which compiles whole; without grad (evaluation) fbgemm collections compile whole too")


def _outside_compile(fn):
    """fn run eagerly under torch.compile, the reason named in fullgraph's error (`reason=` where this torch has it)."""
    if compiler_disable_takes_reason():
        return torch.compiler.disable(fn, reason=_FBGEMM_EAGER_REASON)
    return torch.compiler.disable(fn)


class FusedKernel(nn.Module):
    """One table-batched kernel with the optimizer fused into backward.

    Dims the kernel cannot take (fbgemm on GPU: multiples of 4) are padded inside it: the padding columns are zero,
    never reach the output, get no gradient, and are cut from the weight and state views, so outputs, gradients, state
    dicts and checkpoints show the configured dims. Weighted mean pooling on fbgemm runs as a sum divided by the bag's
    id count afterwards (through autograd): fbgemm's weighted MEAN divides the forward by L but not the gradient."""

    def __init__(self, tables: Sequence[LocalTable], pooling: str, optimizer: FusedOptimizerConfig,
                 device: torch.device, kernel: str = "auto", weighted: bool = False) -> None:
        super().__init__()
        self.tables = list(tables)
        self.pooling = pooling
        self.optimizer_config = optimizer
        placed = {t.name: t.compute_kernel for t in tables if t.compute_kernel != "fused"}
        if placed and device.type == "cpu":
            raise ValueError(f"tables {placed} are planned in GPU unified memory, but this run is on CPU, where every "
                             f"table is in host memory already: plan them with compute_kernel 'fused' (the planner "
                             f"does for CPU topologies), or run on GPU")
        odd = {t.name: t.embedding_dim for t in tables if t.embedding_dim % pad_multiple("fbgemm")}
        on_fbgemm = kernel == "fbgemm" or device.type != "cpu"
        if odd and on_fbgemm and EmbOptimType(optimizer.optimizer) == EmbOptimType.PARTIAL_ROWWISE_ADAM:
            raise ValueError(f"tables {odd} have dims that fbgemm's {device.type} kernel cannot take with "
                             f"partial_rowwise_adam (padding would change its per-row moment): use dims that are "
                             f"multiples of {pad_multiple('fbgemm')} for these tables, or the adam / rowwise_adagrad "
                             f"optimizer")
        self.kernel = choose_kernel(kernel, optimizer, device, pooling)
        multiple = pad_multiple(self.kernel)
        feature_table_map = [i for i, t in enumerate(tables) for _ in t.feature_names]
        self._feature_table = feature_table_map
        self._dims = [t.embedding_dim for t in tables]
        self._grad_scale = 1.0
        self._mean_after = False
        if self.kernel == "native":
            native = _native_module()
            self.tbe = native.NativeTableBatchedEmbeddingBags(
                [(t.num_embeddings, t.embedding_dim) for t in tables], feature_table_map, pooling,
                optimizer, table_names=[t.name for t in tables],
                feature_names=[f for t in tables for f in t.feature_names],
                weight_init=[t.init_range() for t in tables], weights_precision=tables[0].data_type,
            )
            self._padded = self._dims
        else:
            self._padded = [padded_dim(d, multiple) for d in self._dims]
            self._grad_scale = padding_grad_scale(tables, optimizer, multiple)
            self._mean_after = pooling == "mean" and weighted
            tbe_pooling = "sum" if self._mean_after else pooling
            self.tbe = _make_fbgemm_tbe(tables, feature_table_map, tbe_pooling, optimizer, device, self._padded,
                                        self._grad_scale)
            with torch.no_grad():
                for t, w in zip(tables, self.tbe.split_embedding_weights()):
                    w.zero_()  # padding columns stay zero
                    w[:, : t.embedding_dim].uniform_(*t.init_range())
        self.gathering = False
        self._gathered: dict[int, tuple[Tensor, Tensor]] = {}  # table -> (unique rows [U], their gradients [U, D])
        # the pipeline's prefetch stage (fused_uvm_caching): the ids of the lookups prefetched ahead, oldest first
        # (held: their storage is not reused while fbgemm holds their cache locations), and whether the last lookup
        # filled the cache itself, on its own stream (the next prefetch waits for it)
        self.caching = any(t.compute_kernel == "fused_uvm_caching" for t in tables)
        self._prefetching = False
        self._prefetched: deque[tuple[Tensor, int]] = deque()
        self._filled_in_lookup = True
        dims_F = [self._dims[t] for t in feature_table_map]
        self._gather_layout = (torch.tensor(feature_table_map, dtype=torch.int64),
                               torch.tensor([0, *itertools.accumulate(dims_F)], dtype=torch.int64))
        self._counts_steps = (self.kernel != "native" and EmbOptimType(optimizer.optimizer) in _STEP_OPTIMIZERS
                              and isinstance(getattr(self.tbe, "iter_cpu", None), Tensor))
        self._keep_cols: Tensor | None = None
        if self._padded != self._dims and pooling != "none":
            keep, col = [], 0
            for t in feature_table_map:
                keep += range(col, col + self._dims[t])
                col += self._padded[t]
            self._keep_cols = torch.tensor(keep, dtype=torch.int64, device=device)
        if self._mean_after:
            dims_F = torch.tensor([self._dims[t] for t in feature_table_map], dtype=torch.int64, device=device)
            self.register_buffer("_dims_F", dims_F, persistent=False)
            self._total_D = sum(self._dims[t] for t in feature_table_map)

    def forward(self, features: KeyedJaggedTensor, checked: bool = False, frozen: bool = False) -> Tensor:
        """frozen: the tables' weights were set to requires_grad=False (fine-tuning): no update, no state change.
        While `gathering` (optim.gather_fused_gradients) the backward adds the rows' gradients to a buffer of the
        rows touched instead of updating; the next backward outside applies buffer and its own in one update."""
        if not frozen and (self.gathering or self._gathered) and torch.is_grad_enabled():
            out = self.forward(features, checked, frozen=True)  # no update; per-id weights still get their gradient
            return _GatherRows.apply(out, out.new_zeros(0).requires_grad_(), self, features, not self.gathering)
        if not frozen:
            return self._pooled(features, checked)
        # no graph, no update; per-id weights that require grad get theirs through a plain lookup added as zero
        with torch.no_grad():
            out = self._pooled(features, checked)
        weights_N = features.weights_or_none()
        if weights_N is not None and weights_N.requires_grad and torch.is_grad_enabled():
            plain = plain_lookup(features, self.split_embedding_weights(), self._feature_table, self.pooling)
            out = out + (plain - plain.detach()).to(out.dtype)
        return out

    @_outside_compile
    def _tbe_eager(self, values_N: Tensor, offsets: Tensor, weights_N: Tensor | None) -> Tensor:
        return self._tbe_call(values_N, offsets, weights_N)

    def _tbe_call(self, values_N: Tensor, offsets: Tensor, weights_N: Tensor | None) -> Tensor:
        self._filled_in_lookup = not (self._prefetched and self._take_prefetch(values_N, offsets))
        out = _tbe_lookup(self.tbe, values_N, offsets, weights_N)
        if self._prefetching and not out.requires_grad:
            tbe_unlock_lookup(self.tbe)  # no backward will unlock its cache lines
        return out

    def use_prefetch_pipeline(self) -> None:
        """fused_uvm_caching: the row cache in fbgemm's prefetch-pipeline mode (PipelineConfig(prefetch=True))."""
        if self.kernel == "fbgemm" and not self._prefetching:
            tbe_enable_prefetch_pipeline(self.tbe)
        self._prefetching = True

    def prefetch(self, features: KeyedJaggedTensor, forward_stream: torch.cuda.Stream | None) -> None:
        """The rows of a later lookup of `features` into the cache now, on the current stream (forward_stream: the
        lookup's, when another). That lookup then reads their cache locations (fbgemm's forward takes them in order)."""
        values_N, offsets = features.values(), features.offsets()
        if forward_stream is not None and self._filled_in_lookup:
            torch.cuda.current_stream().wait_stream(forward_stream)  # the lookup's own cache fill comes first
        if forward_stream is not None and not tbe_prefetch_takes_stream(self.tbe):
            forward_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(forward_stream):  # this fbgemm cannot sync a side stream: on the lookup's
                tbe_prefetch(self.tbe, values_N, offsets, None)
        else:
            tbe_prefetch(self.tbe, values_N, offsets, forward_stream)
        self._prefetched.append((values_N, offsets.numel()))
        self._filled_in_lookup = False

    def _take_prefetch(self, values_N: Tensor, offsets: Tensor) -> bool:
        """The lookup of the batch prefetched first takes its prefetch (True); any other lookup (that batch was
        dropped, or evaluation came between) finds the prefetches forgotten, and fills the cache itself."""
        held, bags = self._prefetched[0]
        if held.data_ptr() == values_N.data_ptr() and held.numel() == values_N.numel() and bags == offsets.numel():
            self._prefetched.popleft()
            return True
        self._forget_prefetches()
        return False

    def _forget_prefetches(self) -> None:
        if self._prefetched:
            tbe_forget_prefetches(self.tbe)
            self._prefetched.clear()

    def _pooled(self, features: KeyedJaggedTensor, checked: bool) -> Tensor:
        weights_N = features.weights_or_none()
        if weights_N is not None and weights_N.dtype != torch.float32:
            weights_N = weights_N.float()
        if self.kernel == "native":
            # checked: the collection checked this batch (batch_check.py); else the kernel checks it itself.
            return self.tbe(features.values(), features.offsets(), per_sample_weights=weights_N, _checked=checked)
        if torch.compiler.is_exporting() or (torch.compiler.is_compiling() and not torch.is_grad_enabled()):
            # fbgemm's forward reads its step counter on the host, which export cannot trace: torch's lookup, no update
            return plain_lookup(features, self.split_embedding_weights(), self._feature_table, self.pooling,
                                fp32_out=True)
        if torch.compiler.is_compiling():
            # training: fbgemm's backward cannot be traced: a graph break (fullgraph=True stops with the reason)
            out = self._tbe_eager(features.values(), features.offsets(), weights_N)
        else:
            out = self._tbe_call(features.values(), features.offsets(), weights_N)
        if self._counts_steps and not out.requires_grad:
            # fbgemm advances Adam's / LAMB's step at every forward: taken back without a backward
            self.tbe.iter.sub_(1)
            self.tbe.iter_cpu.sub_(1)
        if self._grad_scale != 1.0:
            out = _ScaleGrad.apply(out, self._grad_scale)
        if self._keep_cols is not None:
            out = out.index_select(1, self._keep_cols)  # padding columns out; their gradient is zero
        elif self._padded != self._dims:  # sequence: one dim per kernel
            out = out[:, : self._dims[0]]
        if self._mean_after:
            count_BF = features.lengths_FB().t().clamp(min=1).to(out.dtype)
            out = out / torch.repeat_interleave(count_BF, self._dims_F, dim=1, output_size=self._total_D)
        return out

    def add_row_gradients(self, features: KeyedJaggedTensor, grad: Tensor) -> None:
        """The gradient of one lookup's output, per table row it read, summed into the buffer of unique rows (each
        row's terms in position order, as the kernel sums them: scale = weight / bag length, then scale * gradient).
        On CPU one C++ pass (csrc/gather_rows_cpu.cpp: new rows appended, no sort); elsewhere torch below."""
        grad = grad.detach().float()
        gather = native_op("gather_rows") if grad.device.type == "cpu" else None
        if gather is None:
            return self._add_row_gradients_torch(features, grad)
        weights_N = features.weights_or_none()
        held = [self._gathered.get(t) for t in range(len(self.tables))]
        rows, grads = gather(
            [h[0] if h else torch.empty(0, dtype=torch.int64) for h in held],
            [h[1] if h else grad.new_empty(0, d) for h, d in zip(held, self._dims)],
            self._gather_layout[0], self._gather_layout[1], features.values().to(torch.int64),
            features.offsets().to(torch.int64), None if weights_N is None else weights_N.detach().float(),
            _GATHER_POOLING[self.pooling], grad)
        self._gathered = {t: (r, g) for t, (r, g) in enumerate(zip(rows, grads)) if r.numel()}

    def _add_row_gradients_torch(self, features: KeyedJaggedTensor, grad: Tensor) -> None:
        """add_row_gradients with torch ops (rows kept in id order; the same sums)."""
        pos, col, bags = 0, 0, 0
        per_table: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        weights_N = features.weights_or_none()
        for t, n, B in zip(self._feature_table, features.length_per_key(), features.stride_per_key()):
            ids, D = features.values()[pos : pos + n], self._dims[t]
            if self.pooling == "none":  # values_ND: one output row per id
                g = grad[pos : pos + n]
            else:
                lengths = features.lengths()[bags : bags + B]
                bag_N = torch.repeat_interleave(torch.arange(B, device=grad.device), lengths, output_size=n)
                g, col = grad[bag_N, col : col + D], col + D
                scale = None if weights_N is None else weights_N[pos : pos + n].detach().float()
                if self.pooling == "mean":
                    count_N = lengths[bag_N].to(torch.float32)
                    scale = 1.0 / count_N if scale is None else scale / count_N
                if scale is not None:
                    g = scale.unsqueeze(1) * g
            pos, bags = pos + n, bags + B
            held = per_table.setdefault(t, ([], []))
            held[0].append(ids.to(torch.int64))
            held[1].append(g)
        for t, (ids, grads) in per_table.items():
            old_rows, old_UD = self._gathered.get(t, (ids[0][:0], grads[0][:0]))
            rows_U, where_N = torch.unique(torch.cat([old_rows, *ids]), return_inverse=True)
            acc_UD = old_UD.new_zeros(rows_U.numel(), old_UD.shape[1])
            acc_UD[where_N[: old_rows.numel()]] = old_UD  # the rows held so far (unique): copied, not added
            # index_add_ adds in position order (index_put_'s accumulation, faster, does not on many rows)
            self._gathered[t] = (rows_U, acc_UD.index_add_(0, where_N[old_rows.numel() :], torch.cat(grads)))

    def gathered_bytes(self) -> int:
        """What the buffer holds now: the rows' gradients (float32) and their ids."""
        return sum(r.numel() * r.element_size() + g.numel() * g.element_size() for r, g in self._gathered.values())

    def apply_gathered(self) -> None:
        """One update from the buffer, as from one batch that read each buffered row once with its summed gradient
        (a bag of one id per row): the optimizer runs once for all the gathered lookups."""
        held = {t: rg for t, rg in sorted(self._gathered.items()) if rg[0].numel()}
        self._gathered = {}
        if not held:
            return
        device = next(iter(held.values()))[0].device
        B = max(rows.numel() for rows, _ in held.values())
        pooled = self.pooling != "none"
        if pooled:  # bags past a table's rows are empty: the native update never reads their gradient rows
            width = sum(self._dims[t] for t in self._feature_table)
            grad = (torch.empty if self.kernel == "native" else torch.zeros)(B, width, device=device)
        names, lengths, values, seq, col = [], [], [], [], 0
        for t, table in enumerate(self.tables):
            for i, name in enumerate(table.feature_names):  # the table's first feature reads its rows
                rows, g = held.get(t, (None, None)) if i == 0 else (None, None)
                n = 0 if rows is None else rows.numel()
                names.append(name)
                lengths.append(torch.cat([torch.ones(n, dtype=torch.int64, device=device),
                                          torch.zeros(B - n, dtype=torch.int64, device=device)]))
                if rows is not None:
                    values.append(rows)
                    if pooled:
                        grad[:n, col : col + self._dims[t]] = g
                    else:
                        seq.append(g)
                col += self._dims[t]
        batch = KeyedJaggedTensor(keys=names, values=torch.cat(values), lengths=torch.cat(lengths), stride=B)
        if not pooled:
            grad = torch.cat(seq)
        if self.kernel == "native":  # the update alone: a lookup's output here would go unused
            self.tbe.update_rows(batch.values(), batch.offsets(), grad)
            return
        with torch.enable_grad():
            out = self._pooled(batch, checked=True)
            torch.autograd.backward(out, grad.to(out.dtype))

    def _has_cache(self) -> bool:
        """fbgemm keeps a device cache of rows (fused_uvm_caching tables): trained rows live there until evicted."""
        cache = getattr(self.tbe, "lxu_cache_weights", None) if self.kernel != "native" else None
        return isinstance(cache, Tensor) and cache.numel() > 0

    def split_embedding_weights(self) -> list[Tensor]:
        """Views of the tables; with a row cache, its rows are written back first, so the views are current."""
        if self._has_cache():
            self.tbe.flush()
        weights = list(self.tbe.split_embedding_weights())
        if self._padded == self._dims:
            return weights
        return [w[:, :d] for w, d in zip(weights, self._dims)]

    def optimizer_states(self) -> list[dict[str, Tensor]]:
        """Per table, the optimizer's state by name (views into the kernel's storage)."""
        if self.kernel == "native":
            states = [dict(s) for s in self.tbe.get_optimizer_state()]
        else:
            states = fbgemm_optimizer_states(self.tbe, EmbOptimType(self.optimizer_config.optimizer))
        states = states if states else [{} for _ in self.tables]
        if self._padded != self._dims:
            states = [{k: (v[:, :d] if v.dim() == 2 else v) for k, v in st.items()}
                      for st, d in zip(states, self._dims)]
        return states

    def weights_written(self) -> None:
        """The table views were written (a checkpoint load): cached rows are stale, so the cache starts empty (and
        prefetched cache locations with it)."""
        if self._has_cache():
            self._forget_prefetches()
            self.tbe.reset_cache_states()

    def state_loaded(self) -> None:
        """The state views were written: fbgemm (1.6-1.8) re-reads its step counter while `iter_cpu` is 0."""
        iter_cpu = getattr(self.tbe, "iter_cpu", None)
        if self.kernel != "native" and isinstance(iter_cpu, Tensor):
            iter_cpu.zero_()

    def set_learning_rate(self, lr: float) -> None:
        lr = check_fused_lr(lr, [t.name for t in self.tables])
        self.tbe.set_learning_rate(lr / self._grad_scale)

    def get_learning_rate(self) -> float:
        return float(self.tbe.get_learning_rate()) * self._grad_scale

    def bounds_checked(self) -> list[tuple[nn.Module, list[str]]]:
        """fbgemm's TBE (GPU) with the kernel's tables: its device-side bad-id counter feeds the lazy named error."""
        counter = getattr(self.tbe, "bounds_check_warning", None) if self.kernel != "native" else None
        if not isinstance(counter, Tensor) or counter.device.type != "cuda":
            return []
        return [(self.tbe, [t.name for t in self.tables])]


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
        self.feature_table = [i for i, t in enumerate(tables) for _ in t.feature_names]

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        return plain_lookup(features, list(self.weights), self.feature_table, self.pooling)

    def split_embedding_weights(self) -> list[Tensor]:
        return [w for w in self.weights]


def plain_lookup(features: KeyedJaggedTensor, tables: Sequence[Tensor], feature_table: Sequence[int],
                 pooling: str, fp32_out: bool = False) -> Tensor:
    """Per-table lookups with torch's ops: features side by side (pooled) or stacked (pooling 'none'). fp32_out: rows
    of fp16 tables are read as fp32 before pooling, as the fused kernels pool."""
    outs = []
    # One call per feature (not per id): per-key lengths are cached on the KJT, so no sync.
    for t, jt in zip(feature_table, features.to_dict().values()):
        table = tables[t]
        ids = jt.values()
        if fp32_out and table.dtype != torch.float32:
            table = F.embedding(ids, table).float()  # this feature's rows, each read once: pooled below by position
            ids = torch.arange(table.shape[0], device=table.device)
        if pooling == "none":
            outs.append(F.embedding(ids, table))
            continue
        w = jt.weights_or_none()
        if w is not None:
            w = w.to(table.dtype)
            # torch.export cannot read the slices' sizes: one weight per id, as the KJT was checked to hold
            torch._check(w.shape[0] == ids.shape[0])
        bag_offsets = jt.offsets()[:-1]
        if pooling == "mean" and w is not None:
            # torch's embedding_bag takes per-id weights only with sum; mean = sum / ids in bag.
            summed = F.embedding_bag(ids, table, bag_offsets, mode="sum", per_sample_weights=w)
            outs.append(summed / jt.lengths().clamp(min=1).unsqueeze(1).to(table.dtype))
        else:
            outs.append(F.embedding_bag(ids, table, bag_offsets, mode=pooling, per_sample_weights=w))
    return join_outputs(outs, dim=0 if pooling == "none" else 1)


def group_tables(tables: Sequence[LocalTable], optimizer: FusedOptimizerConfig | None = None,
                 device: torch.device | None = None, kernel: str = "auto") -> list[list[LocalTable]]:
    """Tables that can share one kernel, in order of first appearance."""
    groups: dict[tuple, list[LocalTable]] = {}
    for t in tables:
        # sequence kernels need one dim; padded row-wise tables one gradient scale (padding_grad_scale)
        scale = 1.0
        if optimizer is not None:
            resolved = choose_kernel(kernel, optimizer, device, t.pooling)
            scale = padding_grad_scale([t], optimizer, pad_multiple(resolved))
        key = (t.pooling, t.data_type, t.embedding_dim if t.pooling == "none" else None, scale)
        groups.setdefault(key, []).append(t)
    return list(groups.values())


class GroupedLookup(nn.Module):
    """This process's tables, grouped into kernels. forward: KJT in `feature_names` order."""

    def __init__(self, tables: Sequence[LocalTable], optimizer: FusedOptimizerConfig | None,
                 device: torch.device | str | None = None, kernel: str = "auto", weighted: bool = False) -> None:
        super().__init__()
        device = torch.device(device or "cpu")
        check_device_ready(device)
        if optimizer is None and kernel not in ("auto", "dense"):
            raise ValueError(f"kernel={kernel!r} fuses an optimizer: pass optimizer=FusedOptimizerConfig(...) "
                             f"or use kernel='dense'")
        if optimizer is not None and kernel == "dense":
            raise ValueError("kernel='dense' trains tables with a torch.optim optimizer, so the fused optimizer "
                             "would be ignored: drop optimizer=..., or use kernel='auto' to fuse it")
        fused = optimizer is not None and kernel != "dense"
        self.groups = group_tables(tables, optimizer if fused else None, device if fused else None, kernel)
        self.kernels = nn.ModuleList()
        for group in self.groups:
            if not fused:
                self.kernels.append(DenseKernel(group, group[0].pooling, device))
            else:
                self.kernels.append(FusedKernel(group, group[0].pooling, optimizer, device, kernel, weighted))
        self.tables = [t for g in self.groups for t in g]
        self.feature_names = [f for t in self.tables for f in t.feature_names]
        self.feature_dims = [t.embedding_dim for t in self.tables for _ in t.feature_names]
        self._group_sizes = [sum(len(t.feature_names) for t in g) for g in self.groups]

    def forward(self, features: KeyedJaggedTensor, checked: bool = False,
                frozen: frozenset[str] = frozenset()) -> list[Tensor]:
        """One output per kernel group: pooled_BD (features side by side) or values_ND (sequence).

        checked: the batch passed batch_check already (the native kernel then skips its own check).
        frozen: names of fused tables whose weights were set to requires_grad=False (no update in backward)."""
        assert features.keys() == self.feature_names, (features.keys(), self.feature_names)
        parts = features.split(self._group_sizes) if len(self.kernels) > 1 else [features]
        # .forward, not __call__: kernels are internal, and hooks cost a host-bound GPU step
        return [kernel.forward(part, checked, self._frozen(kernel, frozen)) if isinstance(kernel, FusedKernel)
                else kernel.forward(part) for kernel, part in zip(self.kernels, parts)]

    @staticmethod
    def _frozen(kernel: FusedKernel, frozen: frozenset[str]) -> bool:
        if not frozen:
            return False
        names = [t.name for t in kernel.tables]
        held = [n for n in names if n in frozen]
        if held and len(held) != len(names):
            # one kernel updates all its tables in one backward: refused rather than half-frozen
            raise ValueError(
                f"tables {held} are frozen (requires_grad=False) but share one fused kernel with "
                f"{[n for n in names if n not in frozen]}, which are not: freeze all of {names} together, or put "
                f"the tables to freeze in an EmbeddingBagCollection / EmbeddingCollection of their own")
        return bool(held)

    def table_weights(self) -> dict[str, Tensor]:
        """table name -> [rows, dim] view into the kernel's storage."""
        return {t.name: w for k in self.kernels for t, w in zip(k.tables, k.split_embedding_weights())}

    def fused_kernels(self) -> list[FusedKernel]:
        return [k for k in self.kernels if isinstance(k, FusedKernel)]

    def prefetch(self, features: KeyedJaggedTensor, forward_stream: torch.cuda.Stream | None) -> None:
        """The pipeline's prefetch stage: the rows of a later forward(features) into the caches of the kernels with
        fused_uvm_caching tables (features split by kernel as forward splits them)."""
        if not any(isinstance(k, FusedKernel) and k.caching for k in self.kernels):
            return
        parts = features.split(self._group_sizes) if len(self.kernels) > 1 else [features]
        for kernel, part in zip(self.kernels, parts):
            if isinstance(kernel, FusedKernel) and kernel.caching:
                kernel.prefetch(part, forward_stream)

    def bounds_checked(self) -> list[tuple[nn.Module, list[str]]]:
        return [c for k in self.fused_kernels() for c in k.bounds_checked()]

    def weights_written(self) -> None:
        """Call after writing through `table_weights()` views (see FusedKernel.weights_written)."""
        for k in self.fused_kernels():
            k.weights_written()
