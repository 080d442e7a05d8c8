"""Our fused CPU table-batched embedding (`torch.ops.lightning_rec.tbe_*`, built from csrc/).

`NativeTableBatchedEmbeddingBags` is a drop-in for the part of fbgemm's `SplitTableBatchedEmbeddingBagsCodegen`
that `EmbeddingBagCollection` uses (same layouts, weight views and state names: checkpoints move between them).

Legend: T tables, F features, B batch, N ids, D dim of a table, total_D = sum over features of D.

    indices_N   [ f0 b0 ids | f0 b1 ids | ... | f0 b(B-1) | f1 b0 | ... | f(F-1) b(B-1) ]
    offsets     [0, ...,                                                         N]   (F*B + 1)
    output      [B, total_D]: feature f in columns D_offsets[f] : D_offsets[f + 1]

Optimizer semantics (all with L2 weight decay, `g += weight_decay * w`, as torch.optim does):
  sgd                   w -= lr * g
  adagrad               s += g^2;              w -= lr * g / (sqrt(s) + eps)            (torch Adagrad)
  rowwise_adagrad       s_row += mean_d(g^2);  w -= lr * g / (sqrt(s_row) + eps)        (fbgemm EXACT_ROWWISE_ADAGRAD,
                                                                                         its WeightDecayMode.L2)
  adam                  torch.optim.Adam on the touched rows: m, v per element, bias correction
                        with the module's step counter (state "step", one int64 per TBE, shared)
  partial_rowwise_adam  as adam, with v one value per row: v_row = b2 v_row + (1 - b2) mean_d(g^2)
Rows a batch does not touch are left alone (lazy, like SparseAdam and fbgemm); no LAMB or LARS-SGD on CPU."""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_rec._native import NATIVE_IMPORT_ERROR, native_kernel_available  # noqa: F401  (imported from here too)
from lightning_rec.errors import is_number
from lightning_rec.optim.config import EmbOptimType, FusedOptimizerConfig

_OPTIMIZER_IDS = {EmbOptimType.SGD: 0, EmbOptimType.ADAGRAD: 1, EmbOptimType.ROWWISE_ADAGRAD: 2, EmbOptimType.ADAM: 3,
                  EmbOptimType.PARTIAL_ROWWISE_ADAM: 4}
NATIVE_OPTIMIZERS = tuple(_OPTIMIZER_IDS)
_POOLING_IDS = {"sum": 0, "mean": 1}

# The "auto" rule: native beats fbgemm's CPU kernel for every optimizer it implements (benchmarks/embedding.py),
# so on CPU "auto" = native whenever the extension is built; LAMB / LARS stay with fbgemm (GPU).
def prefer_native(optimizer: EmbOptimType | str) -> bool:
    """The "auto" rule: use the native kernel on CPU for this optimizer (else fbgemm)."""
    return native_kernel_available() and EmbOptimType(str(optimizer).lower()) in _OPTIMIZER_IDS


def _fake_forward(placeholder, weights, weights_offsets, row_offsets, table_dims, feature_table, D_offsets, indices,
                  offsets, per_sample_weights, pooling_mode, total_D, momentum1, momentum2, step, optimizer, lr, eps,
                  beta1, beta2, weight_decay):
    B = (offsets.shape[0] - 1) // feature_table.shape[0]
    return weights.new_empty((B, total_D), dtype=torch.float32)


def _fake_backward_update(*args) -> None:
    return None


def _setup_context(ctx, inputs, output) -> None:
    # Held as attributes, not save_for_backward: the update writes weights and state in place.
    ctx.inputs = inputs


_PSW_INPUT = 9  # per_sample_weights' position among tbe_forward's inputs


def _backward(ctx, grad_BD: Tensor):
    (_, weights, weights_offsets, row_offsets, table_dims, feature_table, D_offsets, indices, offsets,
     per_sample_weights, pooling_mode, _, momentum1, momentum2, step, optimizer, lr, eps, beta1, beta2,
     weight_decay) = ctx.inputs
    grads: list[Tensor | None] = [None] * len(ctx.inputs)
    if per_sample_weights is not None and ctx.needs_input_grad[_PSW_INPUT]:
        # learned per-id weights train through this gradient, from the rows before the update below moves them
        grads[_PSW_INPUT] = per_sample_weights_grad(weights, weights_offsets, row_offsets, table_dims, feature_table,
                                                    D_offsets, indices, offsets, pooling_mode, grad_BD)
    torch.ops.lightning_rec.tbe_backward_update(
        weights, momentum1, momentum2, step, weights_offsets, row_offsets, table_dims, feature_table, D_offsets,
        indices, offsets, per_sample_weights, pooling_mode, grad_BD, optimizer, lr, eps, beta1, beta2, weight_decay,
    )
    return tuple(grads)


# an op of its own (opaque to torch.compile): its slices read sizes a traced backward cannot
@torch.library.custom_op("lightning_rec::tbe_per_sample_weights_grad", mutates_args=())
def per_sample_weights_grad(weights: Tensor, weights_offsets: Tensor, row_offsets: Tensor, table_dims: Tensor,
                            feature_table: Tensor, D_offsets: Tensor, indices: Tensor, offsets: Tensor,
                            pooling_mode: int, grad_BD: Tensor) -> Tensor:
    """d loss / d w_p = <gradient of id p's bag, id p's row> (over the bag's length for mean): [N], per feature."""
    F_ = feature_table.numel()
    B = (offsets.numel() - 1) // F_
    grad_N = torch.zeros(indices.numel(), dtype=torch.float32)
    grad_BD = grad_BD.float()
    for f in range(F_):
        offsets_f = offsets[f * B : (f + 1) * B + 1]
        start, end = int(offsets_f[0]), int(offsets_f[-1])
        if start == end:
            continue
        t = int(feature_table[f])
        D, w0, c0 = int(table_dims[t]), int(weights_offsets[t]), int(D_offsets[f])
        rows = int(row_offsets[t + 1] - row_offsets[t])
        lengths_B = offsets_f.diff()
        bag_n = torch.repeat_interleave(torch.arange(B), lengths_B, output_size=end - start)
        rows_nD = weights[w0 : w0 + rows * D].view(rows, D)[indices[start:end]].float()
        dot_n = (rows_nD * grad_BD[bag_n, c0 : c0 + D]).sum(1)
        if pooling_mode == _POOLING_IDS["mean"]:
            dot_n = dot_n / lengths_B[bag_n].to(torch.float32)
        grad_N[start:end] = dot_n
    return grad_N


@per_sample_weights_grad.register_fake
def _(weights, weights_offsets, row_offsets, table_dims, feature_table, D_offsets, indices, offsets, pooling_mode,
      grad_BD):
    return indices.new_empty(indices.shape, dtype=torch.float32)


def _fake_check_batch(rows_F, indices, offsets, weights):
    return rows_F.new_empty(5, dtype=torch.int64)


if native_kernel_available():
    torch.library.register_fake("lightning_rec::check_batch")(_fake_check_batch)
    torch.library.register_fake("lightning_rec::tbe_forward")(_fake_forward)
    torch.library.register_fake("lightning_rec::tbe_backward_update")(_fake_backward_update)
    torch.library.register_autograd("lightning_rec::tbe_forward", _backward, setup_context=_setup_context)


def _as_index_tensor(x: Tensor, name: str) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor of int64 ids, got {getattr(x, 'shape', type(x))}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor (int64 preferred), got {x.dtype}")
    if x.device.type != "cpu":
        raise ValueError(f"{name} is on {x.device}: the native kernel runs on CPU (use kernel='fbgemm' on GPU)")
    return x.to(torch.int64).contiguous()


def _check_arguments(embedding_specs: Sequence[tuple[int, int]], feature_table_map: Sequence[int], pooling_mode: str,
                     optimizer: FusedOptimizerConfig, weights_precision: torch.dtype) -> None:
    """The TBE's arguments, refused before anything is allocated (the kernel built, the optimizer implemented)."""
    if not native_kernel_available():
        raise RuntimeError(
            "lightning_rec's native embedding kernel is not built (lightning_rec._C failed to import: "
            f"{NATIVE_IMPORT_ERROR}); run `pip install --no-build-isolation -e .` or use kernel='fbgemm'"
        )
    if optimizer.optimizer not in _OPTIMIZER_IDS:
        supported = ", ".join(o.value for o in NATIVE_OPTIMIZERS)
        raise ValueError(f"optimizer {optimizer.optimizer.value!r} is not implemented by the native CPU kernel: "
                         f"choose one of {supported} (LAMB and LARS-SGD run on GPU with fbgemm only)")
    if pooling_mode not in _POOLING_IDS:
        raise ValueError(f"pooling_mode must be 'sum' or 'mean', got {pooling_mode!r}")
    if weights_precision not in (torch.float32, torch.float16):
        raise ValueError(f"weights_precision must be torch.float32 or torch.float16, got {weights_precision}")
    T, F = len(embedding_specs), len(feature_table_map)
    if T == 0 or F == 0:
        raise ValueError("a TBE needs at least one table and one feature")
    for t, (rows, dim) in enumerate(embedding_specs):
        if rows <= 0 or dim <= 0:
            raise ValueError(f"table {t} has shape ({rows}, {dim}): rows and dim must be positive")
    for f, t in enumerate(feature_table_map):
        if not 0 <= t < T:
            raise ValueError(f"feature_table_map[{f}] = {t} names no table: there are {T} tables")


class NativeTableBatchedEmbeddingBags(nn.Module):
    """Pooled lookups over T tables in one op, with the optimizer fused into the backward (CPU).

    Mirrors fbgemm's `SplitTableBatchedEmbeddingBagsCodegen` (HOST / CPU): `forward(indices, offsets,
    per_sample_weights)`, `split_embedding_weights()`, `get_optimizer_state()`, `set_learning_rate()`,
    `get_learning_rate()`."""

    def __init__(self, embedding_specs: Sequence[tuple[int, int]], feature_table_map: Sequence[int],
                 pooling_mode: str = "sum", optimizer: FusedOptimizerConfig | None = None,
                 feature_names: Sequence[str] | None = None, table_names: Sequence[str] | None = None,
                 weights_precision: torch.dtype = torch.float32,
                 weight_init: Sequence[tuple[float, float]] | None = None) -> None:
        super().__init__()
        optimizer = optimizer if optimizer is not None else FusedOptimizerConfig()
        _check_arguments(embedding_specs, feature_table_map, pooling_mode, optimizer, weights_precision)
        T, F = len(embedding_specs), len(feature_table_map)
        self.table_names = list(table_names) if table_names is not None else [f"t{t}" for t in range(T)]
        self.feature_names = list(feature_names) if feature_names is not None else [f"f{f}" for f in range(F)]
        if len(self.table_names) != T or len(self.feature_names) != F:
            raise ValueError(f"got {len(self.table_names)} table names for {T} tables and "
                             f"{len(self.feature_names)} feature names for {F} features")
        if weight_init is not None and len(weight_init) != T:
            raise ValueError(f"weight_init has {len(weight_init)} ranges for {T} tables")

        self.embedding_specs = [(int(r), int(d)) for r, d in embedding_specs]
        self.feature_table_map = [int(t) for t in feature_table_map]
        self.pooling_mode = pooling_mode
        self.optimizer = optimizer.optimizer
        self.optimizer_config = optimizer
        self._lr = float(optimizer.lr)
        self._register_offsets()
        self._register_weights_and_state(weights_precision, weight_init)
        # Gives the output a grad_fn so that loss.backward() reaches the fused update (as in fbgemm).
        self.placeholder_autograd_tensor = nn.Parameter(torch.zeros(0, dtype=torch.float32))

    def _register_offsets(self) -> None:
        """Where each table starts in the flat weights and rows, and each feature in the pooled output."""
        rows_T = [r for r, _ in self.embedding_specs]
        dims_T = [d for _, d in self.embedding_specs]
        sizes_T = [r * d for r, d in self.embedding_specs]
        self.weights_offsets_list = [0] + list(_cumsum(sizes_T))[:-1]
        self.row_offsets_list = [0] + list(_cumsum(rows_T))
        self.D_offsets_list = [0] + list(_cumsum(dims_T[t] for t in self.feature_table_map))
        self.total_D = self.D_offsets_list[-1]
        meta = dict(weights_offsets=self.weights_offsets_list, row_offsets=self.row_offsets_list, table_dims=dims_T,
                    feature_table=self.feature_table_map, D_offsets=self.D_offsets_list)
        for name, values in meta.items():
            self.register_buffer(name, torch.tensor(values, dtype=torch.int64), persistent=False)
        self.rows_F = torch.tensor([rows_T[t] for t in self.feature_table_map], dtype=torch.int64)  # batch checks

    def _register_weights_and_state(self, weights_precision: torch.dtype,
                                    weight_init: Sequence[tuple[float, float]] | None) -> None:
        """The flat weights, drawn per table, and the optimizer's zeroed state."""
        weights = _empty_huge(sum(r * d for r, d in self.embedding_specs), weights_precision)
        for t, (rows, dim) in enumerate(self.embedding_specs):
            low, high = weight_init[t] if weight_init is not None else (-math.sqrt(1 / rows), math.sqrt(1 / rows))
            o = self.weights_offsets_list[t]
            _uniform_(weights[o : o + rows * dim], low, high)
        self.register_buffer("weights", weights)
        total_rows = self.row_offsets_list[-1]
        m1 = {"adagrad": weights.numel(), "rowwise_adagrad": total_rows, "adam": weights.numel(),
              "partial_rowwise_adam": weights.numel()}.get(self.optimizer.value, 0)
        m2 = {"adam": weights.numel(), "partial_rowwise_adam": total_rows}.get(self.optimizer.value, 0)
        self.register_buffer("momentum1", _empty_huge(m1, torch.float32).zero_())
        self.register_buffer("momentum2", _empty_huge(m2, torch.float32).zero_())
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))

    # ---- fbgemm-compatible handles -------------------------------------------------------------

    def split_embedding_weights(self) -> list[Tensor]:
        """One writable [rows, dim] view per table into the flat weights."""
        return [
            self.weights[o : o + r * d].view(r, d)
            for o, (r, d) in zip(self.weights_offsets_list, self.embedding_specs)
        ]

    def get_optimizer_state(self) -> list[dict[str, Tensor]]:
        """Per table, views into the state, under fbgemm's names (adam adds the shared "step")."""
        out = []
        for t, (rows, dim) in enumerate(self.embedding_specs):
            o, r0 = self.weights_offsets_list[t], self.row_offsets_list[t]
            per_elem = lambda m: m[o : o + rows * dim].view(rows, dim)  # noqa: B023
            per_row = lambda m: m[r0 : r0 + rows]  # noqa: B023
            opt = self.optimizer
            if opt == EmbOptimType.SGD:
                out.append({})
            elif opt == EmbOptimType.ADAGRAD:
                out.append({"sum": per_elem(self.momentum1)})
            elif opt == EmbOptimType.ROWWISE_ADAGRAD:
                out.append({"sum": per_row(self.momentum1)})
            elif opt == EmbOptimType.ADAM:
                out.append({"exp_avg": per_elem(self.momentum1), "exp_avg_sq": per_elem(self.momentum2),
                            "step": self.step})
            else:
                out.append({"exp_avg": per_elem(self.momentum1), "exp_avg_sq": per_row(self.momentum2),
                            "step": self.step})
        return out

    def set_learning_rate(self, lr: float) -> None:
        if not is_number(lr) or lr < 0:
            raise ValueError(f"fused learning rate {lr!r} for tables {', '.join(self.table_names)} must be a finite "
                             f"number >= 0: a NaN or infinite rate would write NaN into every row it touches")
        self._lr = float(lr)

    def get_learning_rate(self) -> float:
        return self._lr

    # ---- lookup --------------------------------------------------------------------------------

    def forward(self, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None = None,
                _checked: bool = False) -> Tensor:
        """Pooled embeddings [B, total_D]; with grad enabled, backward updates the rows (in eval mode too, as fbgemm).
        The batch is checked first (batch_check.py) unless `_checked=True` (the collections checked it already)."""
        indices_N = _as_index_tensor(indices, "indices")
        offsets = _as_index_tensor(offsets, "offsets")
        F = len(self.feature_table_map)
        if offsets.numel() == 0 or (offsets.numel() - 1) % F != 0:
            raise ValueError(f"offsets has {offsets.numel()} entries: expected F * B + 1 with F = {F} features "
                             f"({', '.join(self.feature_names)})")
        if per_sample_weights is not None:
            if torch.compiler.is_compiling():
                # torch.compile cannot read the slices' sizes: the KJT holds one weight per id
                torch._check(per_sample_weights.numel() == indices_N.numel())
            elif per_sample_weights.dim() != 1 or per_sample_weights.numel() != indices_N.numel():
                raise ValueError(f"per_sample_weights has shape {tuple(per_sample_weights.shape)} but there are "
                                 f"{indices_N.numel()} ids: give one weight per id")
            if not per_sample_weights.dtype.is_floating_point:
                raise ValueError(f"per_sample_weights must be floating point, got {per_sample_weights.dtype}")
            per_sample_weights = per_sample_weights.to(torch.float32).contiguous()
        if not _checked:
            from lightning_rec.batch_check import OK, describe, find_problem

            problem = find_problem(self.rows_F, indices_N, offsets, per_sample_weights)
            if problem[0] != OK:
                raise ValueError(describe(problem, self.feature_names,
                                          [self.table_names[t] for t in self.feature_table_map],
                                          self.rows_F.tolist(), per_sample_weights, "TBE"))
        cfg = self.optimizer_config
        try:
            return torch.ops.lightning_rec.tbe_forward(
                self.placeholder_autograd_tensor, self.weights, self.weights_offsets, self.row_offsets,
                self.table_dims, self.feature_table, self.D_offsets, indices_N, offsets, per_sample_weights,
                _POOLING_IDS[self.pooling_mode], self.total_D, self.momentum1, self.momentum2, self.step,
                _OPTIMIZER_IDS[self.optimizer], self._lr, cfg.eps, cfg.beta1, cfg.beta2, cfg.weight_decay,
            )
        except ValueError as e:  # only for inputs that bypassed the check above (_checked=True)
            raise ValueError(f"{e} (features: {', '.join(self.feature_names)})") from None

    def update_rows(self, indices: Tensor, offsets: Tensor, grad_BD: Tensor) -> None:
        """The fused update a backward with output gradient `grad_BD` makes, without the lookup before it (checked
        int64 ids, no per-id weights): gradient accumulation's one update (lookup.FusedKernel.apply_gathered)."""
        cfg = self.optimizer_config
        torch.ops.lightning_rec.tbe_backward_update(
            self.weights, self.momentum1, self.momentum2, self.step, self.weights_offsets, self.row_offsets,
            self.table_dims, self.feature_table, self.D_offsets, indices, offsets, None,
            _POOLING_IDS[self.pooling_mode], grad_BD.float().contiguous(), _OPTIMIZER_IDS[self.optimizer], self._lr,
            cfg.eps, cfg.beta1, cfg.beta2, cfg.weight_decay,
        )

    def extra_repr(self) -> str:
        return (f"tables={len(self.embedding_specs)}, features={len(self.feature_table_map)}, "
                f"pooling={self.pooling_mode}, optimizer={self.optimizer.value}, lr={self._lr}")


_HUGE_PAGE = 2 << 20


_INIT_CHUNK = 1 << 22  # elements per generator in _uniform_


def _uniform_(flat_N: Tensor, low: float, high: float) -> None:
    """flat_N.uniform_(low, high) on every thread (torch's CPU uniform_ uses one), the same values for any number
    of threads: a large table is drawn in fixed chunks, each from a generator seeded from one draw of the global
    one (so torch.manual_seed still decides every value); small tables (under two chunks) draw as before."""
    n = flat_N.numel()
    if n < 2 * _INIT_CHUNK:
        flat_N.uniform_(low, high)
        return
    from concurrent.futures import ThreadPoolExecutor

    seed = int(torch.randint(0, 2**62, (1,)))

    def fill(i: int) -> None:  # ATen releases the GIL inside uniform_: the chunks fill in parallel
        g = torch.Generator().manual_seed(seed + i)
        flat_N[i * _INIT_CHUNK : (i + 1) * _INIT_CHUNK].uniform_(low, high, generator=g)

    with ThreadPoolExecutor(max_workers=torch.get_num_threads()) as pool:
        list(pool.map(fill, range((n + _INIT_CHUNK - 1) // _INIT_CHUNK)))


def _empty_huge(numel: int, dtype: torch.dtype) -> Tensor:
    """An uninitialised tensor the kernel may back with transparent huge pages (fewer TLB misses); else torch.empty."""
    t = torch.empty(numel, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes < 2 * _HUGE_PAGE or _LIBC is None:
        return t
    start = (t.data_ptr() + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    end = (t.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end > start:
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    return t


def _load_libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


_MADV_HUGEPAGE = 14
_LIBC = _load_libc()


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total
