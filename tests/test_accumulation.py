"""Gradient accumulation through fused tables: k micro-batches of B/k under `gather_fused_gradients` /
`DistributedModelParallel.no_sync()` / `Trainer(accumulate_grad_batches=k)` give the tables and optimizer state of
one step on the batch of B.

Tolerances: bitwise where every row's gradient terms add in the one-batch kernel's order (sum pooling, a feature per
table: the buffer adds micro-batch after micro-batch, as the kernel adds ids in position order); else 1e-6 relative
(mean pooling scales each term by 1/length, which the native kernel fuses into its sum with an FMA; a table read by
two features adds their terms feature-major in one batch, micro-batch-major here). Losses weight the outputs by
positive numbers: a row's gradient is then no near-cancelling sum, whose rounding Adagrad's first step (g / |g|)
would blow up in both runs alike."""

from __future__ import annotations

import contextlib
import copy

import lightning.pytorch as L
import pytest
import torch
from dist_utils import run_ranks
from test_model_parallel import PooledModel, _batch, _global_batch, _plan, _tables

from lightning_rec import lookup
from lightning_rec.data import SyntheticCriteoDataModule
from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from lightning_rec.model_parallel import DistributedModelParallel, construct_module_sharding_plan
from lightning_rec.optim import FusedOptimizer, FusedOptimizerConfig, gather_fused_gradients
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.types import ShardingPlan

CPU_OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam"]
FBGEMM_CPU = ["sgd", "adagrad", "rowwise_adagrad"]
GPU_OPTIMIZERS = CPU_OPTIMIZERS + ["lamb", "lars_sgd"]
K = 4


def _kjt(keys, rows, B, seed, weighted=False, max_len=4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(keys) * B,), generator=g)
    values = torch.cat([torch.randint(0, n, (int(lengths[f * B : (f + 1) * B].sum()),), generator=g)
                        for f, n in enumerate(rows)])
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=weights)


def _bags(kjt, lo, hi):
    """Samples lo:hi of every feature."""
    vals, lens, ws = [], [], []
    for jt in kjt.to_dict().values():
        off = jt.offsets()
        vals.append(jt.values()[off[lo] : off[hi]])
        lens.append(jt.lengths()[lo:hi])
        if jt.weights_or_none() is not None:
            ws.append(jt.weights()[off[lo] : off[hi]])
    return KeyedJaggedTensor.from_lengths_sync(kjt.keys(), torch.cat(vals), torch.cat(lens),
                                               weights=torch.cat(ws) if ws else None)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)) if b.numel() else 0.0


def _compare(one, accumulated, bitwise: bool, what: str) -> None:
    """Tables and fused optimizer state of the two collections: equal bitwise, or to 1e-6 relative."""
    pairs = [(k, one.state_dict()[k], v) for k, v in accumulated.state_dict().items()]
    s1, s2 = FusedOptimizer(one).state_dict()["state"], FusedOptimizer(accumulated).state_dict()["state"]
    pairs += [(k, s1[k], s2[k]) for k in s1]
    for key, a, b in pairs:
        if bitwise:
            assert torch.equal(a, b), f"{what}: {key} differs"
        else:
            assert _relative(b, a) <= 1e-6, f"{what}: {key} differs by {_relative(b, a):.3g} relative"


def _one_step_and_accumulated(make, keys, rows, B=16, weighted=False, sequence=False, device="cpu"):
    """(collection after one step on B samples, a copy after K micro-batches of B/K under gather_fused_gradients)."""
    torch.manual_seed(0)
    one = make()
    accumulated = copy.deepcopy(one)
    kjt = _kjt(keys, rows, B, seed=1, weighted=weighted).to(device)
    if sequence:
        out = one(kjt)
        w = {f: torch.rand(out[f].values().shape, generator=torch.Generator().manual_seed(i)).to(device) for i, f in
             enumerate(keys)}
        sum((out[f].values() * w[f]).sum() for f in keys).div(B).backward()
    else:
        out = one(kjt).values()  # a forward alone moves nothing: the update is in backward
        w = torch.rand(out.shape, generator=torch.Generator().manual_seed(2)).to(device)
        (out * w).sum().div(B).backward()
    b = B // K
    for m in range(K):
        part = _bags(kjt, m * b, (m + 1) * b)
        with gather_fused_gradients(accumulated) if m < K - 1 else contextlib.nullcontext():
            if sequence:
                out = accumulated(part)
                loss = 0
                for f in keys:
                    lengths = kjt[f].lengths()
                    start = int(lengths[: m * b].sum())
                    n = out[f].values().shape[0]
                    loss = loss + (out[f].values() * w[f][start : start + n]).sum()
            else:
                loss = (accumulated(part).values() * w[m * b : (m + 1) * b]).sum()
            loss.div(b).div(K).backward()  # a mean over the micro-batch, divided by K as Lightning does
    return one, accumulated


@pytest.mark.parametrize("kernel,opt", [("native", o) for o in CPU_OPTIMIZERS] + [("fbgemm", o) for o in FBGEMM_CPU])
def test_accumulated_micro_batches_update_as_one_batch_bitwise(kernel, opt):
    """Sum pooling, one feature per table: every optimizer's tables and state equal one step's, bit for bit."""
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=n, embedding_dim=d, feature_names=[f"f{i}"])
              for i, (n, d) in enumerate([(50, 8), (30, 4), (40, 8)])]
    make = lambda: EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig(opt, lr=0.1), kernel=kernel)  # noqa: E731
    one, accumulated = _one_step_and_accumulated(make, ["f0", "f1", "f2"], [50, 30, 40])
    _compare(one, accumulated, bitwise=True, what=f"{kernel}/{opt}")


@pytest.mark.parametrize("kernel,opt", [("native", o) for o in CPU_OPTIMIZERS] + [("fbgemm", o) for o in FBGEMM_CPU])
@pytest.mark.parametrize("pooling,weighted", [("mean", False), ("sum", True), ("mean", True)])
def test_accumulated_micro_batches_update_as_one_batch(kernel, opt, pooling, weighted):
    """Mean pooling, per-id weights, a table two features read, weight decay: to 1e-6 relative."""
    tables = [EmbeddingBagConfig(name="t0", num_embeddings=50, embedding_dim=8, feature_names=["f0", "f2"],
                                 pooling=pooling),
              EmbeddingBagConfig(name="t1", num_embeddings=30, embedding_dim=4, feature_names=["f1"], pooling=pooling)]
    decay = 0.01 if kernel == "native" else 0.0  # fbgemm's CPU kernel has no weight decay (refused)
    config = FusedOptimizerConfig(opt, lr=0.1, weight_decay=decay)
    make = lambda: EmbeddingBagCollection(tables, optimizer=config, kernel=kernel, is_weighted=weighted)  # noqa: E731
    one, accumulated = _one_step_and_accumulated(make, ["f0", "f2", "f1"], [50, 50, 30], weighted=weighted)
    _compare(one, accumulated, bitwise=False, what=f"{kernel}/{opt}/{pooling}/weighted={weighted}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and fbgemm-gpu (CUDA build)")
@pytest.mark.parametrize("opt", GPU_OPTIMIZERS)
@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("mean", True)])
def test_cuda_accumulated_micro_batches_update_as_one_batch(opt, pooling, weighted):
    """fbgemm's CUDA kernels, all 7 of their optimizers: to 1e-6 relative (the buffer sums rows with index_add, the
    kernel in its own segment order)."""
    tables = [EmbeddingBagConfig(name="t0", num_embeddings=50, embedding_dim=8, feature_names=["f0", "f2"],
                                 pooling=pooling),
              EmbeddingBagConfig(name="t1", num_embeddings=30, embedding_dim=4, feature_names=["f1"], pooling=pooling)]
    config = FusedOptimizerConfig(opt, lr=0.1)
    make = lambda: EmbeddingBagCollection(tables, optimizer=config, is_weighted=weighted, device="cuda")  # noqa: E731
    one, accumulated = _one_step_and_accumulated(make, ["f0", "f2", "f1"], [50, 50, 30], weighted=weighted,
                                                 device="cuda")
    _compare(one, accumulated, bitwise=False, what=f"cuda/{opt}/{pooling}/weighted={weighted}")


@pytest.mark.parametrize("opt", FBGEMM_CPU)
def test_sequence_tables_accumulate_too(opt):
    tables = [EmbeddingConfig(name="t0", num_embeddings=40, embedding_dim=6, feature_names=["f0"]),
              EmbeddingConfig(name="t1", num_embeddings=20, embedding_dim=6, feature_names=["f1"])]
    make = lambda: EmbeddingCollection(tables, optimizer=FusedOptimizerConfig(opt, lr=0.1))  # noqa: E731
    one, accumulated = _one_step_and_accumulated(make, ["f0", "f1"], [40, 20], sequence=True)
    _compare(one, accumulated, bitwise=False, what=f"sequence/{opt}")


def test_the_buffer_holds_the_rows_touched_and_the_optimizer_step_applies_what_is_left():
    """Inside gather_fused_gradients nothing moves; the buffer is [unique rows, dim] (no table-sized gradient); a
    FusedOptimizer.step() with no backward outside applies it, once."""
    tables = [EmbeddingBagConfig(name="t0", num_embeddings=1000, embedding_dim=8, feature_names=["f0"])]
    ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("sgd", lr=0.1), kernel="native")
    before = ebc.state_dict()["embedding_bags.t0.weight"].clone()
    kjt = _kjt(["f0"], [1000], 8, seed=3)
    with gather_fused_gradients(ebc):
        ebc(kjt).values().sum().backward()
        ebc(kjt).values().sum().backward()
    kernel = ebc.fused_kernels()[0]
    assert torch.equal(ebc.state_dict()["embedding_bags.t0.weight"], before)
    unique = kjt.values().unique().numel()
    assert kernel.gathered_bytes() == unique * (8 * 4 + 8)  # gradients (fp32) and their ids (int64)
    FusedOptimizer(ebc).step()
    assert kernel.gathered_bytes() == 0
    moved = (ebc.state_dict()["embedding_bags.t0.weight"] != before).any(1).nonzero().flatten()
    assert torch.equal(moved, kjt.values().unique())


@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("mean", True), ("none", False)])
def test_the_compiled_buffer_holds_what_the_torch_one_does(monkeypatch, pooling, weighted):
    """csrc/gather_rows_cpu.cpp (CPU) and the torch ops (elsewhere) hold the same rows (first-seen order there, id
    order here) and sums: bit for bit where every term's scale is 1, else to 1e-6 relative (the C++ loop fuses
    scale * gradient into its sum, as the native kernel does)."""
    if pooling == "none":
        tables = [EmbeddingConfig(name=f"t{i}", num_embeddings=n, embedding_dim=6, feature_names=[f"f{i}"])
                  for i, n in enumerate([40, 20])]
        make = lambda: EmbeddingCollection(tables, optimizer=FusedOptimizerConfig("sgd", lr=0.1))  # noqa: E731
    else:
        tables = [EmbeddingBagConfig(name="t0", num_embeddings=40, embedding_dim=8, feature_names=["f0", "f1"],
                                     pooling=pooling)]
        make = lambda: EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("sgd", lr=0.1),  # noqa: E731
                                              is_weighted=weighted)
    held = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(lookup, "native_op", lambda name: None)
        torch.manual_seed(0)
        collection = make()
        with gather_fused_gradients(collection):
            for step in range(3):
                out = collection(_kjt(["f0", "f1"], [40, 20], 8, seed=step, weighted=weighted))
                values = [out[f].values() for f in ("f0", "f1")] if pooling == "none" else [out.values()]
                sum((v * torch.rand(v.shape, generator=torch.Generator().manual_seed(step))).sum()
                    for v in values).backward()
        held.append(collection.fused_kernels()[0]._gathered)
    assert held[0].keys() == held[1].keys()
    for t, (rows, grads) in held[0].items():
        order = rows.argsort()
        assert torch.equal(rows[order], held[1][t][0]), f"table {t}"
        if pooling == "mean":
            assert _relative(grads[order], held[1][t][1]) <= 1e-6, f"table {t}"
        else:
            assert torch.equal(grads[order], held[1][t][1]), f"table {t}"


def _joined(batches):
    """One batch of the batches' samples, in order (one lookup: one update)."""
    per = [b.to_dict() for b in batches]
    keys = batches[0].keys()
    weighted = batches[0].weights_or_none() is not None
    cat = lambda part: torch.cat([getattr(d[k], part)() for k in keys for d in per])  # noqa: E731
    return KeyedJaggedTensor.from_lengths_sync(keys, cat("values"), cat("lengths"),
                                               weights=cat("weights") if weighted else None)


def _sharded_worker(rank, W, kind, cases):
    return [_sharded_case(rank, W, kind, opt, weighted) for opt, weighted in cases]


def _sharded_case(rank, W, kind, opt, weighted):
    torch.manual_seed(0)
    config = FusedOptimizerConfig(opt, lr=0.1)
    pooling = "mean" if weighted else "sum"
    model = PooledModel(EmbeddingBagCollection(_tables(pooling), is_weighted=weighted, optimizer=config))
    reference = PooledModel(EmbeddingBagCollection(_tables(pooling), is_weighted=weighted, optimizer=config))
    reference.load_state_dict(model.state_dict())
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, _plan(kind, W, W), local_size=W,
                                                               world_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, timeout=30)
    every = []
    for m in range(K):  # micro-batch m: _batch(r, m) on rank r; the reference sees every rank's, in one batch
        g = torch.Generator().manual_seed(m)
        grads = [torch.rand(3 + r, 3, generator=g) for r in range(W)]
        with dmp.no_sync() if m < K - 1 else contextlib.nullcontext():
            (dmp(_batch(rank, m, weighted)) * grads[rank]).sum().backward()
        every.append(torch.cat(grads))
    (reference(_joined([_global_batch(W, m, weighted) for m in range(K)])) * torch.cat(every)).sum().backward()
    what = f"{kind}/{opt}/weighted={weighted}"
    state = dmp.state_dict()
    for key, full in reference.state_dict().items():
        if "embedding_bags" in key:
            pieces = state[key].local_shards() if hasattr(state[key], "local_shards") else []
            for shard in pieces:
                (r, c), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                diff = _relative(shard.tensor, full[r : r + nr, c : c + nc])
                assert diff <= 1e-6, f"{what}: {key} rows {r}:{r + nr} cols {c}:{c + nc} differ by {diff:.3g}"
            if not hasattr(state[key], "local_shards"):
                assert _relative(state[key], full) <= 1e-6, f"{what}: {key} differs by {_relative(state[key], full)}"
    for (name, p), (_, q) in zip(dmp.module.dense.named_parameters(), reference.dense.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad / W, atol=1e-5, rtol=0, msg=f"{what} dense grad {name}")
    ours = dmp.fused_optimizer.global_state_pieces()
    theirs = FusedOptimizer(reference).state_dict()["state"]
    for key, (_, pieces) in ours.items():
        for meta, value in pieces:
            full = theirs[key]
            if meta is not None and value.dim() == 2:
                (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
                full = full[r : r + nr, c : c + nc]
            elif meta is not None and value.dim() == 1:
                full = full[meta.shard_offsets[0] : meta.shard_offsets[0] + meta.shard_sizes[0]]
            torch.testing.assert_close(value, full, atol=1e-5, rtol=1e-6, msg=f"{what} state {key}")
    return what


@pytest.mark.parametrize("kind", ["row_wise", "table_wise", "column_wise", "data_parallel"])
def test_sharded_no_sync_accumulates_as_one_batch(kind):
    """2 ranks: K micro-batches under dmp.no_sync() (the last outside) = one step of the unsharded model on every
    rank's micro-batches together, for tables, optimizer state and the dense gradients."""
    cases = [("sgd", False), ("adagrad", True), ("rowwise_adagrad", False), ("adam", True),
             ("partial_rowwise_adam", False)]
    if kind == "column_wise":  # a column split keeps row-wise state per column block, by design
        cases = [c for c in cases if c[0] in ("sgd", "adagrad", "adam")]
    if kind == "data_parallel":
        cases = [c for c in cases if c[0] in ("sgd", "adagrad", "rowwise_adagrad")]
    done = run_ranks(_sharded_worker, 2, kind, cases, timeout=120)
    assert len(done[0]) == len(cases)


class _Module(L.LightningModule):
    """Two fused tables and a dense layer; the loss is a mean over the batch (Lightning divides it by k)."""

    def __init__(self, optimizer: str = "rowwise_adagrad", manual: int = 0, loss_scale: float = 1.0):
        super().__init__()
        self.manual = manual
        self.loss_scale = loss_scale
        self.ebc = EmbeddingBagCollection(
            [EmbeddingBagConfig(name=f"t{i}", num_embeddings=64, embedding_dim=4, feature_names=[f"C{i + 1}"])
             for i in range(2)], optimizer=FusedOptimizerConfig(optimizer, lr=0.1))
        self.dense = torch.nn.Linear(13 + 8, 1)
        self.automatic_optimization = not manual

    def _loss(self, batch):
        pooled = self.ebc(batch.sparse_features).values()
        logits = self.dense(torch.cat([batch.dense_features, pooled], 1)).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels) * self.loss_scale

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return self._loss(batch)
        # every `manual` batches a step; the batches before, forward and backward, under block_backward_sync
        opt, last = self.optimizers(), (batch_idx + 1) % self.manual == 0
        with contextlib.nullcontext() if last else self.trainer.strategy.block_backward_sync():
            loss = self._loss(batch)
            self.manual_backward(loss / self.manual)
        if last:
            opt.step()
            opt.zero_grad()
        return loss

    def configure_optimizers(self):
        from lightning_rec.optim import combined_optimizer, dense_parameters

        return combined_optimizer(self, torch.optim.SGD(dense_parameters(self), lr=0.1))


def _fit(tmp_path, batch_size, accumulate, optimizer="rowwise_adagrad", train=64, manual=0, loss_scale=1.0, **kw):
    data = SyntheticCriteoDataModule(num_train_samples=train, num_val_samples=0, batch_size=batch_size,
                                     num_sparse_features=2, num_embeddings_per_feature=64, shuffle=False,
                                     num_signal_features=2)
    L.seed_everything(0, verbose=False)
    module = _Module(optimizer, manual, loss_scale)
    trainer_kw = dict(accelerator="cpu", devices=1, strategy="rec", max_epochs=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      limit_val_batches=0, default_root_dir=tmp_path, accumulate_grad_batches=accumulate)
    L.Trainer(**{**trainer_kw, **kw}).fit(module, data)
    return module


def _same_training(one, accumulated, what: str) -> None:
    for name, w in one.ebc.table_weights().items():
        diff = _relative(accumulated.ebc.table_weights()[name], w)
        assert diff <= 1e-6, f"{what}: table {name} differs by {diff:.3g}"
    s1, s2 = FusedOptimizer(one).state_dict()["state"], FusedOptimizer(accumulated).state_dict()["state"]
    for key in s1:
        assert _relative(s2[key], s1[key]) <= 1e-6, f"{what}: {key} differs by {_relative(s2[key], s1[key]):.3g}"
    for (name, p), (_, q) in zip(one.dense.named_parameters(), accumulated.dense.named_parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=f"{what}: dense {name}")


@pytest.mark.parametrize("optimizer,kw", [("rowwise_adagrad", {}), ("adam", {"gradient_clip_val": 0.01}),
                                          ("adagrad", {"strategy": None})])
def test_trainer_accumulate_grad_batches_steps_the_tables_once(tmp_path, optimizer, kw):
    """Trainer(strategy='rec', accumulate_grad_batches=4) on batches of 16 = batch_size 64 unaccumulated: tables,
    fused optimizer state and dense layers after one epoch (one step), with a mean loss: Lightning's loss / 4 over
    4 means of 16 is the mean of 64. With gradient clipping the dense layers clip their accumulated gradient, as
    with one batch. strategy=None: RecStrategy(pipeline=True)."""
    from lightning_rec.strategy import RecStrategy

    if "strategy" in kw:
        kw = {"strategy": RecStrategy(pipeline=True)}
    one = _fit(tmp_path, 64, 1, optimizer, **kw)
    if "strategy" in kw:
        kw = {"strategy": RecStrategy(pipeline=True)}
    accumulated = _fit(tmp_path, 16, 4, optimizer, **kw)
    _same_training(one, accumulated, f"{optimizer} {kw}")


def test_more_micro_batches_than_the_epoch_has_step_at_the_epochs_end(tmp_path):
    """k = 8 over an epoch of 3 batches: Lightning steps at the epoch's last batch, so the 3 micro-batches update the
    tables once, as one batch of their 48 samples would, from Lightning's gradient: each loss divided by 8 (not 3),
    so 3/8 of the mean's."""
    one = _fit(tmp_path, 48, 1, train=48, loss_scale=3 / 8)
    accumulated = _fit(tmp_path, 16, 8, train=48)
    assert accumulated.trainer.global_step == 1
    _same_training(one, accumulated, "k=8 over 3 batches")


def test_manual_optimization_with_accumulate_grad_batches_is_refused(tmp_path):
    """Lightning's own refusal: manual optimization accumulates by hand (micro-batches under
    `with self.trainer.strategy.block_backward_sync():` gather the tables' gradients; the step's applies them)."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="accumulate_grad_batches"):
        _fit(tmp_path, 16, 2, manual=2)


def test_manual_optimization_accumulates_under_block_backward_sync(tmp_path):
    """The documented way by hand: micro-batches under self.trainer.strategy.block_backward_sync(), the last outside,
    then the step: as one batch, without the manual-accumulation warning."""
    import warnings

    one = _fit(tmp_path, 64, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accumulated = _fit(tmp_path, 16, 1, manual=4)
    assert not [w for w in caught if "second backward" in str(w.message)]
    _same_training(one, accumulated, "manual, block_backward_sync")

