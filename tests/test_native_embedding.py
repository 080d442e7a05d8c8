"""Native CPU table-batched embedding (csrc/embedding_cpu.cpp) against plain PyTorch and fbgemm.

Tolerances: the first forward and SGD weights agree to atol 1e-6 (fp32; sums of a few terms in a
different order). Adagrad, Adam and the row-wise optimizers divide by sqrt of small second moments,
which amplifies ulp-level differences in the gradient sum: atol 1e-5 after 10 steps.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_rec.native_embedding import (
    NativeTableBatchedEmbeddingBags,
    native_kernel_available,
    prefer_native,
)
from lightning_rec.optim import EmbOptimType, FusedOptimizerConfig

pytestmark = pytest.mark.skipif(not native_kernel_available(), reason="lightning_rec._C is not built")

# Two tables; table 0 is read by two features (shared table), table 1 by one.
SPECS = [(13, 8), (7, 4)]
FEATURE_TABLE = [0, 1, 0]
OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam"]


def make_batch(B: int, gen: torch.Generator, max_len: int = 5, weighted: bool = False, specs=SPECS, ft=FEATURE_TABLE):
    """Feature-major ids with duplicates (ids drawn from few rows) and empty bags (length 0)."""
    lengths = torch.randint(0, max_len + 1, (len(ft) * B,), generator=gen)
    lengths[::4] = 0  # some empty bags in every feature
    ids = []
    for f, t in enumerate(ft):
        n = int(lengths[f * B : (f + 1) * B].sum())
        ids.append(torch.randint(0, specs[t][0], (n,), generator=gen))
    indices = torch.cat(ids)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    psw = torch.rand(indices.numel(), generator=gen) + 0.5 if weighted else None
    return indices, offsets, psw


def reference_pooled(tables, indices, offsets, psw, mode, ft=FEATURE_TABLE):
    """Plain PyTorch: one F.embedding_bag per feature, concatenated [B, total_D]."""
    B = (offsets.numel() - 1) // len(ft)
    outs = []
    for f, t in enumerate(ft):
        off_f = offsets[f * B : (f + 1) * B + 1]
        ids = indices[off_f[0] : off_f[-1]]
        w = psw[off_f[0] : off_f[-1]] if psw is not None else None
        if mode == "mean" and w is not None:
            s = F.embedding_bag(ids, tables[t], off_f[:-1] - off_f[0], mode="sum", per_sample_weights=w)
            lengths = off_f.diff().clamp(min=1).unsqueeze(1).to(s.dtype)
            outs.append(s / lengths)
        else:
            outs.append(F.embedding_bag(ids, tables[t], off_f[:-1] - off_f[0], mode=mode, per_sample_weights=w))
    return torch.cat(outs, dim=1)


def reference_step(tables, states, step, grads, cfg: FusedOptimizerConfig):
    """Plain PyTorch lazy update of the rows that have a gradient (the semantics of the kernel)."""
    opt, lr, eps, wd, b1, b2 = cfg.optimizer, cfg.lr, cfg.eps, cfg.weight_decay, cfg.beta1, cfg.beta2
    for t, (w, g_dense) in enumerate(zip(tables, grads)):
        rows = g_dense.abs().sum(1).nonzero().flatten() if touched_rows[t] is None else touched_rows[t]
        g = g_dense[rows] + wd * w[rows]
        if opt == "sgd":
            w[rows] -= lr * g
        elif opt == "adagrad":
            states[t]["sum"][rows] += g * g
            w[rows] -= lr * g / (states[t]["sum"][rows].sqrt() + eps)
        elif opt == "rowwise_adagrad":
            states[t]["sum"][rows] += (g * g).mean(1)
            w[rows] -= lr * g / (states[t]["sum"][rows].sqrt() + eps).unsqueeze(1)
        else:
            m = states[t]["exp_avg"]
            v = states[t]["exp_avg_sq"]
            m[rows] = b1 * m[rows] + (1 - b1) * g
            if opt == "adam":
                v[rows] = b2 * v[rows] + (1 - b2) * g * g
                denom = v[rows].sqrt() / (1 - b2**step) ** 0.5 + eps
            else:
                v[rows] = b2 * v[rows] + (1 - b2) * (g * g).mean(1)
                denom = (v[rows].sqrt() / (1 - b2**step) ** 0.5 + eps).unsqueeze(1)
            w[rows] -= lr / (1 - b1**step) * m[rows] / denom


touched_rows: list = []


def run_parity(opt: str, mode: str, weighted: bool, wd: float, steps: int = 10):
    global touched_rows
    torch.manual_seed(0)  # the module's weight init
    gen = torch.Generator().manual_seed(0)
    cfg = FusedOptimizerConfig(opt, lr=0.05, eps=1e-6, weight_decay=wd)
    tbe = NativeTableBatchedEmbeddingBags(SPECS, FEATURE_TABLE, mode, cfg, weight_init=[(-0.5, 0.5)] * 2)
    tables = [w.detach().clone() for w in tbe.split_embedding_weights()]
    states = [{k: v.detach().clone() for k, v in s.items() if k != "step"} for s in tbe.get_optimizer_state()]
    B = 6
    for step in range(1, steps + 1):
        indices, offsets, psw = make_batch(B, gen, weighted=weighted)
        upstream = torch.randn(B, tbe.total_D, generator=gen)
        out = tbe(indices, offsets, psw)
        (out * upstream).sum().backward()
        # Reference: autograd through plain embedding_bag gives the dense gradient of each table.
        leaf = [t.clone().requires_grad_(True) for t in tables]
        ref_out = reference_pooled(leaf, indices, offsets, psw, mode)
        # Weights drift apart by a few ulps per step (see the module docstring): atol 1e-5.
        torch.testing.assert_close(out.detach(), ref_out.detach(), atol=1e-5, rtol=1e-5)
        (ref_out * upstream).sum().backward()
        touched_rows = [None] * len(tables)
        # A row counts as touched when any id names it (even with zero gradient), as in the kernel.
        B_ = (offsets.numel() - 1) // len(FEATURE_TABLE)
        for t in range(len(tables)):
            ids = [indices[offsets[f * B_] : offsets[(f + 1) * B_]] for f, tt in enumerate(FEATURE_TABLE) if tt == t]
            touched_rows[t] = torch.cat(ids).unique()
        reference_step(tables, states, step, [lf.grad for lf in leaf], cfg)
    return tbe, tables, states


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False), ("mean", True)])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_optimizer_parity_with_plain_pytorch(opt, mode, weighted, wd):
    tbe, tables, states = run_parity(opt, mode, weighted, wd)
    atol = 1e-6 if opt == "sgd" else 1e-5
    for t in range(len(SPECS)):
        torch.testing.assert_close(tbe.split_embedding_weights()[t], tables[t], atol=atol, rtol=1e-5)
        for k, v in states[t].items():
            torch.testing.assert_close(tbe.get_optimizer_state()[t][k], v, atol=atol, rtol=1e-5)
    if opt in ("adam", "partial_rowwise_adam"):
        assert int(tbe.get_optimizer_state()[0]["step"]) == 10


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "adam"])
def test_matches_torch_optim(opt):
    """torch.optim on a dense table, where every row is in every batch (so lazy == dense)."""
    rows, dim, B = 5, 4, 3
    cfg = FusedOptimizerConfig(opt, lr=0.03, eps=1e-7, weight_decay=0.02)
    tbe = NativeTableBatchedEmbeddingBags([(rows, dim)], [0], "sum", cfg)
    weight = torch.nn.Parameter(tbe.split_embedding_weights()[0].clone())
    kw = dict(lr=cfg.lr, weight_decay=cfg.weight_decay)
    ref_opt = {
        "sgd": lambda: torch.optim.SGD([weight], **kw),
        "adagrad": lambda: torch.optim.Adagrad([weight], eps=cfg.eps, **kw),
        "adam": lambda: torch.optim.Adam([weight], eps=cfg.eps, betas=(cfg.beta1, cfg.beta2), **kw),
    }[opt]()
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        indices = torch.cat([torch.arange(rows), torch.randint(0, rows, (4,), generator=gen)])  # all rows + dups
        offsets = torch.tensor([0, 3, 3, indices.numel()])
        upstream = torch.randn(B, dim, generator=gen)
        (tbe(indices, offsets) * upstream).sum().backward()
        ref_opt.zero_grad()
        (F.embedding_bag(indices, weight, offsets[:-1], mode="sum") * upstream).sum().backward()
        ref_opt.step()
    torch.testing.assert_close(tbe.split_embedding_weights()[0], weight.detach(), atol=2e-6, rtol=1e-5)
    state = ref_opt.state[weight]
    mine = tbe.get_optimizer_state()[0]
    if opt == "adagrad":
        torch.testing.assert_close(mine["sum"], state["sum"], atol=1e-6, rtol=1e-6)
    if opt == "adam":
        torch.testing.assert_close(mine["exp_avg"], state["exp_avg"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine["exp_avg_sq"], state["exp_avg_sq"], atol=1e-5, rtol=1e-5)
        assert int(mine["step"]) == int(state["step"]) == 10


fbgemm_training = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")


# fbgemm-gpu-cpu 1.8.0 goes wrong when two features share a table (EXACT_ADAGRAD updates drift from
# torch.optim, EXACT_ROWWISE_ADAGRAD raises "num of rows processed by adagrad: 0 does not match
# c_block size"), so parity with fbgemm uses one feature per table; sharing is covered by the
# plain PyTorch parity above.
FB_FEATURE_TABLE = [0, 1]


def make_fbgemm(opt: str, mode: str, cfg: FusedOptimizerConfig):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbOpt
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
        WeightDecayMode,
    )

    fb_opt = {"sgd": FbOpt.EXACT_SGD, "adagrad": FbOpt.EXACT_ADAGRAD, "rowwise_adagrad": FbOpt.EXACT_ROWWISE_ADAGRAD}
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in SPECS],
        feature_table_map=FB_FEATURE_TABLE,
        optimizer=fb_opt[opt],
        learning_rate=cfg.lr,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        weight_decay_mode=WeightDecayMode.L2 if cfg.weight_decay else WeightDecayMode.NONE,
        pooling_mode=PoolingMode.SUM if mode == "sum" else PoolingMode.MEAN,
    )


# Without weight decay only: fbgemm-gpu-cpu 1.8.0's EXACT_ROWWISE_ADAGRAD and EXACT_ADAGRAD ignore weight_decay on
# CPU (checked: with WeightDecayMode.L2 or DECOUPLE they apply w -= lr * g / (sqrt(s) + eps) alone),
# and its EXACT_SGD has none. Ours applies L2 decay as torch.optim does.
@pytest.mark.parametrize("opt,wd", [("sgd", 0.0), ("adagrad", 0.0), ("rowwise_adagrad", 0.0)])
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False)])
def test_parity_with_fbgemm(opt, wd, mode, weighted):
    """Same start, same batches: weights and state equal after 10 steps; state moves across."""
    cfg = FusedOptimizerConfig(opt, lr=0.05, eps=1e-6, weight_decay=wd)
    mine = NativeTableBatchedEmbeddingBags(SPECS, FB_FEATURE_TABLE, mode, cfg)
    fb = make_fbgemm(opt, mode, cfg)
    for a, b in zip(fb.split_embedding_weights(), mine.split_embedding_weights()):
        a.copy_(b)
    gen = torch.Generator().manual_seed(2)
    for _ in range(10):
        indices, offsets, psw = make_batch(6, gen, weighted=weighted, ft=FB_FEATURE_TABLE)
        upstream = torch.randn(6, mine.total_D, generator=gen)
        out_mine, out_fb = mine(indices, offsets, psw), fb(indices, offsets, psw)
        torch.testing.assert_close(out_mine.detach(), out_fb.detach(), atol=1e-6, rtol=1e-6)
        (out_mine * upstream).sum().backward()
        (out_fb * upstream).sum().backward()
    for t in range(len(SPECS)):
        mine_w, fb_w = mine.split_embedding_weights()[t], fb.split_embedding_weights()[t]
        torch.testing.assert_close(mine_w, fb_w, atol=1e-5, rtol=1e-5)
        fb_state = fb.get_optimizer_state()[t] if opt != "sgd" else {}  # fbgemm: [] for SGD
        my_state = mine.get_optimizer_state()[t]
        assert set(fb_state) == set(my_state)
        for k in fb_state:
            assert fb_state[k].shape == my_state[k].shape
            torch.testing.assert_close(my_state[k], fb_state[k], atol=1e-5, rtol=1e-5)


def test_checkpoint_moves_from_fbgemm_to_native():
    cfg = FusedOptimizerConfig("rowwise_adagrad", lr=0.05)
    fb = make_fbgemm("rowwise_adagrad", "sum", cfg)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        indices, offsets, _ = make_batch(4, gen, ft=FB_FEATURE_TABLE)
        fb(indices, offsets).sum().backward()
    mine = NativeTableBatchedEmbeddingBags(SPECS, FB_FEATURE_TABLE, "sum", cfg)
    for t in range(len(SPECS)):
        mine.split_embedding_weights()[t].copy_(fb.split_embedding_weights()[t])
        mine.get_optimizer_state()[t]["sum"].copy_(fb.get_optimizer_state()[t]["sum"])
    indices, offsets, _ = make_batch(4, gen, ft=FB_FEATURE_TABLE)
    mine(indices, offsets).sum().backward()
    fb(indices, offsets).sum().backward()
    for t in range(len(SPECS)):
        torch.testing.assert_close(
            mine.split_embedding_weights()[t], fb.split_embedding_weights()[t], atol=1e-6, rtol=1e-6
        )


def test_long_bags_and_threads_are_deterministic():
    """Pooling factors 0..300 with many duplicates; 1 and 2 threads give bitwise equal results."""
    specs, ft = [(50, 16), (1000, 32)], [0, 1, 1]
    results = []
    for threads in (1, 2):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            gen = torch.Generator().manual_seed(4)
            tbe = NativeTableBatchedEmbeddingBags(specs, ft, "sum", FusedOptimizerConfig("adam", lr=0.01))
            tbe.weights.copy_(torch.linspace(-1, 1, tbe.weights.numel()))
            outs = []
            for _ in range(3):
                indices, offsets, psw = make_batch(64, gen, max_len=300, weighted=True, specs=specs, ft=ft)
                out = tbe(indices, offsets, psw)
                outs.append(out.detach().clone())
                (out * out.detach()).sum().backward()
            leaf = [w.clone() for w in tbe.split_embedding_weights()]
            results.append((outs, leaf, tbe.momentum1.clone(), tbe.momentum2.clone()))
        finally:
            torch.set_num_threads(prev)
    (o1, w1, m1, v1), (o2, w2, m2, v2) = results
    for a, b in zip(o1 + w1 + [m1, v1], o2 + w2 + [m2, v2]):
        assert torch.equal(a, b)
    # and the long-bag forward agrees with plain PyTorch
    gen = torch.Generator().manual_seed(5)
    tbe = NativeTableBatchedEmbeddingBags(specs, ft, "mean", FusedOptimizerConfig("sgd"))
    indices, offsets, psw = make_batch(32, gen, max_len=300, weighted=True, specs=specs, ft=ft)
    ref = reference_pooled(tbe.split_embedding_weights(), indices, offsets, psw, "mean", ft=ft)
    torch.testing.assert_close(tbe(indices, offsets, psw).detach(), ref, atol=1e-5, rtol=1e-5)


def test_large_tables_initialise_on_every_thread_with_the_seeds_values(monkeypatch):
    """Tables over two init chunks draw in parallel (one generator per chunk, seeded from the global one): the
    same values for 1 and 2 threads and for the same torch.manual_seed, others for another seed, inside the
    table's bounds; small tables draw as plain uniform_ did."""
    from lightning_rec import native_embedding

    monkeypatch.setattr(native_embedding, "_INIT_CHUNK", 1000)
    specs, ft = [(2000, 8), (100, 4)], [0, 1]  # 16,000 elements: 16 chunks; 400: one plain draw

    def build(seed: int, threads: int) -> list[torch.Tensor]:
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            torch.manual_seed(seed)
            tbe = NativeTableBatchedEmbeddingBags(specs, ft, "sum", FusedOptimizerConfig("sgd"))
            return tbe.split_embedding_weights()
        finally:
            torch.set_num_threads(prev)

    one, two, other = build(0, 1), build(0, 2), build(1, 2)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    assert not torch.equal(one[0], other[0])
    bound = (1 / 2000) ** 0.5
    assert -bound <= float(one[0].min()) and float(one[0].max()) < bound and float(one[0].std()) > bound / 3
    assert len({tuple(one[0].view(-1)[i * 1000 : i * 1000 + 4].tolist()) for i in range(16)}) == 16  # no chunk repeats
    torch.manual_seed(0)
    torch.randint(0, 2**62, (1,))  # the big table's one draw from the global generator (its chunks' seed) ...
    small = torch.empty(400).uniform_(-0.1, 0.1)  # ... then the small table drew plainly, as before
    assert torch.equal(one[1].reshape(-1), small)


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_one_id_per_bag_wide_rows_and_broadcast_gradient(opt):
    """The benchmark's shape in small: one id per bag, dims that are multiples of 16 (the vectorised
    row-wise reductions), rows repeated within and across the features of a shared table, and the
    gradient of out.sum() (a broadcast, read through its strides). Matches plain PyTorch; 1 and 2
    threads give bitwise equal results."""
    specs, ft = [(40, 64), (30, 16), (500, 48)], [0, 1, 0, 2]
    cfg = FusedOptimizerConfig(opt, lr=0.05, eps=1e-6)
    B = 96
    results = []
    for threads in (1, 2):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            gen = torch.Generator().manual_seed(7)
            tbe = NativeTableBatchedEmbeddingBags(specs, ft, "sum", cfg, weight_init=[(-0.5, 0.5)] * 3)
            tbe.weights.copy_(torch.linspace(-1, 1, tbe.weights.numel()))
            tables = [w.detach().clone() for w in tbe.split_embedding_weights()]
            sums = [torch.zeros(r) for r, _ in specs]
            offsets = torch.arange(len(ft) * B + 1)
            for _ in range(3):
                indices = torch.cat([torch.randint(0, specs[t][0], (B,), generator=gen) for t in ft])
                out = tbe(indices, offsets)
                leaf = [t.clone().requires_grad_(True) for t in tables]
                ref = torch.cat([F.embedding_bag(indices[f * B : (f + 1) * B], leaf[t], torch.arange(B), mode="sum")
                                 for f, t in enumerate(ft)], dim=1)
                torch.testing.assert_close(out.detach(), ref.detach(), atol=1e-5, rtol=1e-5)
                out.sum().backward()
                if opt in ("sgd", "rowwise_adagrad"):  # checked against a plain step; the others by parity tests
                    ref.sum().backward()
                    with torch.no_grad():
                        for t, lf in enumerate(leaf):
                            ids = [indices[f * B : (f + 1) * B] for f, tt in enumerate(ft) if tt == t]
                            rows = torch.cat(ids).unique()
                            g = lf.grad[rows]
                            if opt == "sgd":
                                tables[t][rows] -= cfg.lr * g
                            else:
                                sums[t][rows] += (g * g).mean(1)
                                tables[t][rows] -= cfg.lr * g / (sums[t][rows].sqrt() + cfg.eps).unsqueeze(1)
                    for t in range(len(specs)):
                        torch.testing.assert_close(tbe.split_embedding_weights()[t], tables[t], atol=1e-5, rtol=1e-5)
                        if opt == "rowwise_adagrad":
                            torch.testing.assert_close(tbe.get_optimizer_state()[t]["sum"], sums[t],
                                                       atol=1e-6, rtol=1e-5)
                else:
                    tables = [w.detach().clone() for w in tbe.split_embedding_weights()]
            results.append((tbe.weights.clone(), tbe.momentum1.clone(), tbe.momentum2.clone()))
        finally:
            torch.set_num_threads(prev)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_output_has_grad_fn_and_eval_does_not_update():
    tbe = NativeTableBatchedEmbeddingBags(SPECS, FEATURE_TABLE, "sum", FusedOptimizerConfig("sgd", lr=0.1))
    indices, offsets, _ = make_batch(4, torch.Generator().manual_seed(6))
    dense = torch.nn.Linear(tbe.total_D, 1)
    out = tbe(indices, offsets)
    assert out.grad_fn is not None and out.shape == (4, tbe.total_D)
    before = tbe.weights.clone()
    dense(out).sum().backward()
    assert dense.weight.grad is not None and not torch.equal(before, tbe.weights)
    with torch.no_grad():
        assert tbe(indices, offsets).grad_fn is None


def test_large_outputs_reuse_buffers_only_when_nothing_holds_them():
    # Outputs of 1 MiB or more come from a pool of reused buffers (csrc/embedding_cpu.cpp): one that a
    # tensor, a view or autograd still holds must never be handed out again.
    specs, ft, B = [(50, 64), (40, 64)], [0, 1], 2048  # [2048, 128] floats = 1 MiB
    tbe = NativeTableBatchedEmbeddingBags(specs, ft, "sum", FusedOptimizerConfig("sgd", lr=0.1))
    gen = torch.Generator().manual_seed(11)

    def batch():
        return make_batch(B, gen, max_len=2, specs=specs, ft=ft)[:2]

    def expected(indices, offsets):
        return reference_pooled(tbe.split_embedding_weights(), indices, offsets, None, "sum", ft=ft)

    with torch.no_grad():
        b1, b2, b3 = batch(), batch(), batch()
        out1 = tbe(*b1)
        view1 = out1[:, 64:]
        ref1 = out1.clone()
        del out1  # the view still holds the buffer
        out2 = tbe(*b2)
        assert out2.untyped_storage().data_ptr() != view1.untyped_storage().data_ptr()
        torch.testing.assert_close(out2, expected(*b2))
        del out2  # nothing holds this buffer any more: the next output may reuse it
        out3 = tbe(*b3)
        torch.testing.assert_close(out3, expected(*b3))
        assert torch.equal(view1, ref1[:, 64:])
    for _ in range(3):  # training steps: the output held by the graph stays intact until its backward
        b = batch()
        out = tbe(*b)
        torch.testing.assert_close(out, expected(*b))
        held = out.detach().clone()
        other = tbe(*batch())
        assert torch.equal(out, held)
        (out.sum() + other.sum()).backward()


def test_state_layout_learning_rate_and_fp16():
    shapes = {
        "sgd": {},
        "adagrad": {"sum": (13, 8)},
        "rowwise_adagrad": {"sum": (13,)},
        "adam": {"exp_avg": (13, 8), "exp_avg_sq": (13, 8), "step": ()},
        "partial_rowwise_adam": {"exp_avg": (13, 8), "exp_avg_sq": (13,), "step": ()},
    }
    for opt, want in shapes.items():
        tbe = NativeTableBatchedEmbeddingBags(SPECS, FEATURE_TABLE, "sum", FusedOptimizerConfig(opt))
        assert {k: tuple(v.shape) for k, v in tbe.get_optimizer_state()[0].items()} == want
        assert prefer_native(opt)
    tbe.set_learning_rate(0.5)
    assert tbe.get_learning_rate() == 0.5
    views = tbe.split_embedding_weights()
    views[1].fill_(0.25)  # writable views into the flat weights
    assert torch.all(tbe.split_embedding_weights()[1] == 0.25)
    for t, (rows, _) in enumerate(SPECS):
        w = NativeTableBatchedEmbeddingBags(SPECS, FEATURE_TABLE, "sum").split_embedding_weights()[t]
        assert w.abs().max() <= (1 / rows) ** 0.5
    half = NativeTableBatchedEmbeddingBags(SPECS, FEATURE_TABLE, "sum", FusedOptimizerConfig("rowwise_adagrad"),
                                           weights_precision=torch.float16)
    indices, offsets, psw = make_batch(5, torch.Generator().manual_seed(7), weighted=True)
    ref = reference_pooled([w.float() for w in half.split_embedding_weights()], indices, offsets, psw, "sum")
    out = half(indices, offsets, psw)
    torch.testing.assert_close(out.detach(), ref, atol=1e-3, rtol=1e-3)
    before = half.weights.clone()
    out.sum().backward()
    assert half.weights.dtype == torch.float16 and not torch.equal(before, half.weights)


def test_unsupported_optimizer_lists_supported():
    with pytest.raises(ValueError, match="sgd, adagrad, rowwise_adagrad, adam, partial_rowwise_adam"):
        NativeTableBatchedEmbeddingBags(SPECS, FEATURE_TABLE, "sum", FusedOptimizerConfig("lamb"))
    assert not prefer_native(EmbOptimType.LAMB)


# ---- bad input: a clear error and nothing written --------------------------------------------


def bad_input_tbe():
    tbe = NativeTableBatchedEmbeddingBags(SPECS, FEATURE_TABLE, "sum", FusedOptimizerConfig("adam", lr=0.1),
                                          feature_names=["user", "item", "user_hist"], table_names=["users", "items"])
    return tbe, tbe.weights.clone(), tbe.momentum1.clone()


@pytest.mark.parametrize(
    "bad_id,feature,table", [(13, "user_hist", "users"), (-1, "item", "items"), (7, "item", "items")]
)
def test_out_of_range_ids_name_feature_and_table(bad_id, feature, table):
    tbe, w0, m0 = bad_input_tbe()
    indices = torch.tensor([0, 1, 2, 3, 4, 5])
    offsets = torch.tensor([0, 1, 2, 3, 4, 5, 6])  # B = 2
    indices[5 if feature == "user_hist" else 3] = bad_id
    with pytest.raises(ValueError, match=f"feature '{feature}'.*table '{table}'"):
        tbe(indices, offsets).sum().backward()
    assert torch.equal(tbe.weights, w0) and torch.equal(tbe.momentum1, m0) and int(tbe.step) == 0


@pytest.mark.parametrize(
    "offsets,match",
    [
        ([0, 2, 1, 3, 4, 5, 6], "non-decreasing"),
        ([0, 1, 2, 3, 4, 5, 5], "end at the number of ids"),
        ([1, 1, 2, 3, 4, 5, 6], "start at 0"),
        ([0, 1, 2, 3, 4, 6], "F \\* B \\+ 1"),
    ],
)
def test_bad_offsets(offsets, match):
    tbe, w0, _ = bad_input_tbe()
    with pytest.raises(ValueError, match=match):
        tbe(torch.arange(6), torch.tensor(offsets))
    assert torch.equal(tbe.weights, w0)


@pytest.mark.parametrize(
    "indices,offsets,match",
    [
        ([0, 1, 2, 3, 4, 13], [0, 1, 2, 3, 4, 5, 6], r"id 13 at position 5 \(feature #2, sample 1\) is out of range "
                                                      r"for table #0 with 13 rows \(features: user, item, user_hist\)"),
        ([0, 1, 2, 3, 4, 5], [0, 2, 1, 3, 4, 5, 6], r"offsets\[2\] = 1 < offsets\[1\] = 2 \(feature #0\)"),
        ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 5], r"end at the number of ids \(6\), got 0 and 5"),
    ],
)
def test_the_kernels_own_checks_format_their_values(indices, offsets, match):
    """The C++ kernel's checks (inputs that skip the Python pass: _checked=True) raise with their values. Built with
    lightning_rec::message, not c10::str's ostringstream, which segfaults in builds with a private libstdc++
    (csrc/check_message.h)."""
    tbe, w0, _ = bad_input_tbe()
    with pytest.raises(ValueError, match=match):
        tbe(torch.tensor(indices), torch.tensor(offsets), _checked=True).sum().backward()
    assert torch.equal(tbe.weights, w0)


def test_csrc_checks_go_through_check_message():
    """Every C++ check builds its message with csrc/check_message.h (see there): a TORCH_CHECK with formatted values
    crashes builds with a private libstdc++ instead of raising."""
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    for path in sorted(csrc.glob("*.c*")):
        text = path.read_text()
        assert not re.search(r"\bTORCH_CHECK\w*\(", text), f"{path.name}: use LR_CHECK / LR_CHECK_VALUE"
        if "LR_CHECK" in text:
            assert '#include "check_message.h"' in text, path.name


def test_bad_per_sample_weights_and_dtypes():
    tbe, w0, _ = bad_input_tbe()
    indices, offsets = torch.arange(6), torch.arange(7)
    with pytest.raises(ValueError, match="one weight per id"):
        tbe(indices, offsets, torch.ones(5))
    with pytest.raises(ValueError, match="floating point"):
        tbe(indices, offsets, torch.ones(6, dtype=torch.int64))
    with pytest.raises(ValueError, match="integer tensor"):
        tbe(indices.float(), offsets)
    assert torch.equal(tbe.weights, w0)
    # Convertible inputs are converted: int32 ids, non-contiguous ids, float64 weights.
    ref = tbe(indices, offsets, torch.ones(6)).detach()
    strided = torch.stack([indices, indices], 1)[:, 0]
    assert not strided.is_contiguous()
    with torch.no_grad():
        torch.testing.assert_close(tbe(strided.int(), offsets.int(), torch.ones(6, dtype=torch.float64)), ref)


def test_empty_batches():
    tbe, w0, _ = bad_input_tbe()
    out = tbe(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))  # B = 0
    assert out.shape == (0, tbe.total_D)
    out.sum().backward()
    out = tbe(torch.zeros(0, dtype=torch.int64), torch.zeros(3 * 4 + 1, dtype=torch.int64))  # B = 4, all bags empty
    assert out.shape == (4, tbe.total_D) and torch.all(out == 0)
    out.sum().backward()
    assert torch.equal(tbe.weights, w0)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_per_sample_weights_that_require_grad_get_their_gradient(mode):
    # Learned per-id weights (TorchRec's PositionWeightedModule) got no gradient from the native kernel (None),
    # while fbgemm and the dense kernel give one: they trained on GPU and stayed put on CPU, silently.
    torch.manual_seed(0)
    tbe = NativeTableBatchedEmbeddingBags(SPECS, FEATURE_TABLE, mode, FusedOptimizerConfig("adam", lr=0.5))
    indices, offsets, psw = make_batch(4, torch.Generator().manual_seed(3), weighted=True)
    psw.requires_grad_(True)
    leaf = [w.detach().clone().requires_grad_(True) for w in tbe.split_embedding_weights()]  # before the update
    upstream = torch.randn(4, tbe.total_D, generator=torch.Generator().manual_seed(4))
    (tbe(indices, offsets, psw) * upstream).sum().backward()
    psw_ref = psw.detach().clone().requires_grad_(True)
    (reference_pooled(leaf, indices, offsets, psw_ref, mode) * upstream).sum().backward()
    # fp32, each a dot product of <= 8 terms: atol 1e-6. The reference reads the rows as the forward did.
    torch.testing.assert_close(psw.grad, psw_ref.grad, atol=1e-6, rtol=1e-6)
    assert not torch.equal(tbe.split_embedding_weights()[0], leaf[0])  # and the rows were still updated
    # an op of its own with a fake kernel, so that torch.compile traces the backward without a graph break
    meta = (tbe.weights_offsets, tbe.row_offsets, tbe.table_dims, tbe.feature_table, tbe.D_offsets)
    torch.library.opcheck(torch.ops.lightning_rec.tbe_per_sample_weights_grad.default,
                          (tbe.weights, *meta, indices, offsets, 1 if mode == "mean" else 0, upstream))


# ---- operator registration ------------------------------------------------------------------


def op_args(tbe, indices, offsets, psw):
    cfg = tbe.optimizer_config
    meta = (tbe.weights_offsets, tbe.row_offsets, tbe.table_dims, tbe.feature_table, tbe.D_offsets)
    return meta, (cfg.eps, cfg.beta1, cfg.beta2, cfg.weight_decay)


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_opcheck(opt):
    tbe = NativeTableBatchedEmbeddingBags(SPECS, FEATURE_TABLE, "mean", FusedOptimizerConfig(opt, lr=0.01))
    indices, offsets, psw = make_batch(3, torch.Generator().manual_seed(8), weighted=True)
    meta, (eps, b1, b2, wd) = op_args(tbe, indices, offsets, psw)
    opt_id = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2, "adam": 3, "partial_rowwise_adam": 4}[opt]
    placeholder = torch.zeros(0, requires_grad=True)
    fwd_args = (placeholder, tbe.weights, *meta, indices, offsets, psw, 1, tbe.total_D, tbe.momentum1,
                tbe.momentum2, tbe.step, opt_id, 0.01, eps, b1, b2, wd)
    torch.library.opcheck(torch.ops.lightning_rec.tbe_forward.default, fwd_args)
    B = (offsets.numel() - 1) // len(FEATURE_TABLE)
    bwd_args = (tbe.weights, tbe.momentum1, tbe.momentum2, tbe.step, *meta, indices, offsets, psw, 1,
                torch.randn(B, tbe.total_D), opt_id, 0.01, eps, b1, b2, wd)
    torch.library.opcheck(torch.ops.lightning_rec.tbe_backward_update.default, bwd_args,
                          test_utils=("test_schema", "test_faketensor"))
