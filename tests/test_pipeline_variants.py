"""PipelineConfig's variants: semi_sync (tables one update stale, as TorchRec's TrainPipelineSemiSync) and prefetch.

semi_sync is checked against a few-line loop that does by hand what it promises: batch i+1's embeddings are looked
up after batch i's forward and before its backward, so batch i reads the tables as they were before batch i-1's
update."""

from __future__ import annotations

import dataclasses

import lightning.pytorch as L
import pytest
import torch
from dist_utils import run_ranks
from test_pipeline import KEYS, NUM_F, SMALL, Step, _loader, _take, _weights

from lightning_rec.data.synthetic import SyntheticCriteoDataModule
from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.embedding_configs import DataType
from lightning_rec.model_parallel import (
    DistributedModelParallel,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from lightning_rec.models.dlrm import DLRM
from lightning_rec.optim import CombinedOptimizer, FusedOptimizerConfig
from lightning_rec.pipeline import PipelineConfig, TrainPipelineSparseDist
from lightning_rec.types import ShardingPlan


def _build(W: int):
    torch.manual_seed(0)
    model = Step()
    ebc = model.dlrm.sparse_arch.embedding_bag_collection
    # every kind of table: one rank's, split by rows, and a data-parallel replica (updated in the backward too)
    verbs = [table_wise(rank=0), row_wise(), data_parallel(), table_wise(rank=W - 1)]
    plan = ShardingPlan({"dlrm.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, {f"t{i}": verbs[i] for i in range(NUM_F)}, world_size=W, local_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)
    opt = CombinedOptimizer([("fused", dmp.fused_optimizer),
                             ("dense", torch.optim.Adagrad([p for p in dmp.parameters() if p.requires_grad], lr=0.02))])
    return dmp, opt


def _stale_reference(dmp, opt, batches, stale: bool) -> list[float]:
    """The plain loop; stale: batch i+1's lookup runs before batch i's backward (what semi_sync must equal)."""
    ebc = dmp.module.dlrm.sparse_arch.embedding_bag_collection
    ahead, lookup = {}, ebc.forward
    ebc.forward = lambda kjt: ahead.pop(id(kjt)) if id(kjt) in ahead else lookup(kjt)
    sums = []
    for i, batch in enumerate(batches):
        opt.zero_grad()
        loss, logits = dmp(batch)
        if stale and i + 1 < len(batches):
            kjt = batches[i + 1].sparse_features
            ahead[id(kjt)] = lookup(kjt)
        loss.backward()
        opt.step()
        sums.append(float(logits.detach().sum()))
    return sums


def _semi_sync_worker(rank, W, steps):
    batches = list(_take(_loader(rank, steps), steps))
    references = {}
    for stale in (True, False):
        dmp, opt = _build(W)
        references[stale] = (_stale_reference(dmp, opt, batches, stale), _weights(dmp))
    dmp, opt = _build(W)
    with TrainPipelineSparseDist(dmp, opt, "cpu", PipelineConfig(semi_sync=True)) as pipeline:
        it, sums = iter(batches), []
        while True:
            try:
                sums.append(float(pipeline.progress(it).detach().sum()))
            except StopIteration:
                break
        assert pipeline.stats == {"routed_ahead": steps - 1, "routed_in_step": 1}
    weights = _weights(dmp)
    # exact: the same ops in the same order on CPU (fp32), only the step they run in moves
    ref_sums, ref_weights = references[True]
    assert sums == ref_sums, (sums[:4], ref_sums[:4])
    assert not [k for k in ref_weights if not torch.equal(ref_weights[k], weights[k])]
    # and not the synchronous run: the lookups did read tables one update stale
    assert sums[0] == references[False][0][0] and sums[1] != references[False][0][1]
    # stopped mid-pass: the batch the last step took early comes back first, nothing lost
    dmp, opt = _build(W)
    pipeline, it = TrainPipelineSparseDist(dmp, opt, "cpu", PipelineConfig(semi_sync=True)), iter(batches)
    for _ in range(3):
        pipeline.progress(it)
    rest = list(pipeline.close()) + list(it)
    assert [torch.equal(b.dense_features, c.dense_features) for b, c in zip(rest, batches[3:])] == [True] * (steps - 3)
    assert len(rest) == steps - 3
    return len(sums)


@pytest.mark.parametrize("W", [1, 2])
def test_semi_sync_equals_the_loop_whose_lookups_are_one_update_stale(W):
    assert run_ranks(_semi_sync_worker, W, 8, timeout=120) == [8] * W


def test_prefetch_without_a_cuda_device_is_refused_by_the_config():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match=r"PipelineConfig\(prefetch=True\).*fused_uvm_caching.*needs a CUDA GPU"):
        PipelineConfig(prefetch=True)
    with pytest.raises(ValueError, match="prefetch"):
        PipelineConfig.of({"prefetch": True})


def test_prefetch_with_semi_sync_is_refused_by_the_config():
    with pytest.raises(ValueError, match=r"semi_sync=True, prefetch=True.*backward.*choose one"):
        PipelineConfig(semi_sync=True, prefetch=True)


class _TwoKernels(Step):
    """Step whose tables sit in two fbgemm kernels: t0, t1 in float32, t2, t3 in float16."""

    def __init__(self) -> None:
        super().__init__()
        tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=40 + 3 * i, embedding_dim=8, feature_names=[k],
                                     data_type=DataType.FP32 if i < 2 else DataType.FP16)
                  for i, k in enumerate(KEYS)]
        ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.05),
                                     kernel="fbgemm")
        self.dlrm = DLRM(ebc, 13, [16, 8], [16, 1])


def _recorded_prefetch_build(W: int, log: list, monkeypatch_cuda: bool = True):
    """The model with t2 and t3 row-wise (routed ids differ from the batch's) in a kernel that stands for a
    fused_uvm_caching one on CPU: its TBE is marked in prefetch mode, and records its prefetches, lookups and
    backwards (in `log`: (what, kernel, indices, offsets))."""
    import lightning_rec.pipeline.config as config_module

    if monkeypatch_cuda:  # the stage's order and choice of tables, without a CUDA device
        config_module.no_cuda_error = lambda *args: None
    torch.manual_seed(0)
    model = _TwoKernels()
    ebc = model.dlrm.sparse_arch.embedding_bag_collection
    plan = ShardingPlan({"dlrm.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, {"t0": table_wise(rank=0), "t1": table_wise(rank=W - 1), "t2": row_wise(), "t3": row_wise()},
        world_size=W, local_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)
    opt = CombinedOptimizer([("fused", dmp.fused_optimizer),
                             ("dense", torch.optim.Adagrad([p for p in dmp.parameters() if p.requires_grad], lr=0.02))])
    sharded = dmp.module.dlrm.sparse_arch.embedding_bag_collection
    kernels = sharded._lookup.fused_kernels()
    for name, kernel in zip(("fp32", "fp16"), kernels):
        _recording_stand_in(sharded, kernel, name, log, cached=name == "fp16")
    return dmp, opt, kernels


def _recording_stand_in(sharded, kernel, name: str, log: list, cached: bool) -> None:
    """`kernel`'s TBE records its prefetches, lookups and backwards in `log`; cached: it stands for a
    fused_uvm_caching kernel (its TBE marked in prefetch mode, its tables so planned on every rank)."""
    tbe = kernel.tbe
    tbe.register_forward_pre_hook(lambda m, args: log.append(("lookup", name, args[0].clone(), args[1].clone())))
    tbe.register_forward_hook(lambda m, args, out: (out.register_hook(
        lambda g: log.append(("backward", name, None, None))) if out.requires_grad else None, None)[1])
    tbe.prefetch = lambda indices, offsets, forward_stream=None: log.append(
        ("prefetch", name, indices.clone(), offsets.clone()))
    if cached:
        tbe.prefetch_pipeline = True  # (a real one: tbe_enable_prefetch_pipeline)
        kernel.caching = True
        wanted = {sharded.shard_of(t.name)[0] for t in kernel.tables}
        kernel.tables = [dataclasses.replace(t, compute_kernel="fused_uvm_caching") for t in kernel.tables]
        pieces = sharded.routing.pieces
        for r, tables in enumerate(sharded.routing.rank_tables):  # the plan, as every rank knows it
            tables[:] = [dataclasses.replace(t, compute_kernel="fused_uvm_caching")
                         if pieces.get((r, t.name), (t.name,))[0] in wanted else t for t in tables]


def _check_prefetch_order(log: list, name: str, steps: int) -> int:
    """batch 0 records the plan in its step; batches 1.. are prefetched after the step before's forward, before its
    backward, with the very ids and offsets their lookup then reads. Returns the number of prefetches."""
    cached = [(what, i, o) for what, kernel, i, o in log if kernel == name]
    expected = ["lookup"] + ["prefetch", "backward", "lookup"] * (steps - 1) + ["backward"]
    assert [w for w, _, _ in cached] == expected, [w for w, _, _ in cached]
    lookups = [(i, o) for w, i, o in cached if w == "lookup"]
    prefetches = [(i, o) for w, i, o in cached if w == "prefetch"]
    for (pi, po), (li, lo) in zip(prefetches, lookups[1:]):
        assert torch.equal(pi, li) and torch.equal(po, lo)
    return len(prefetches)


def _prefetch_order_worker(rank, W, steps):
    import lightning_rec.lookup as lookup_module

    forgotten, unlocked = [], []
    lookup_module.tbe_forget_prefetches = lambda tbe: forgotten.append(tbe)
    lookup_module.tbe_unlock_lookup = lambda tbe: unlocked.append(tbe)
    batches, log = list(_take(_loader(rank, steps), steps)), []
    dmp, opt, kernels = _recorded_prefetch_build(W, log)
    assert dmp.module.dlrm.sparse_arch.embedding_bag_collection.cached_tables() == ["t2", "t3"]
    with TrainPipelineSparseDist(dmp, opt, "cpu", PipelineConfig(prefetch=True)) as pipeline:
        it = iter(batches)
        while True:
            try:
                pipeline.progress(it)
            except StopIteration:
                break
    prefetches = _check_prefetch_order(log, "fp16", steps)
    assert not [w for w, name, _, _ in log if name == "fp32" and w == "prefetch"]  # only the caching kernel
    assert not forgotten and not kernels[1]._prefetched  # every prefetch was taken by its lookup
    # a lookup without a backward (evaluation) unlocks the cache lines it locked, on the caching kernel only
    assert not unlocked
    with torch.no_grad():
        dmp(batches[0])
    assert unlocked == [kernels[1].tbe]
    # stopped mid-pass: the batch prefetched for the next step comes back; a lookup of another batch first finds the
    # prefetch not its own: forgotten (fbgemm's forward would read its cache locations as its own otherwise)
    log.clear()
    dmp, opt, kernels = _recorded_prefetch_build(W, log)
    pipeline, it = TrainPipelineSparseDist(dmp, opt, "cpu", PipelineConfig(prefetch=True)), iter(batches)
    for _ in range(3):
        pipeline.progress(it)
    assert len(kernels[1]._prefetched) == 1
    rest = list(pipeline.close()) + list(it)
    _plain_step(dmp, opt, rest[1])
    assert forgotten == [kernels[1].tbe] and not kernels[1]._prefetched
    return prefetches


def _plain_step(dmp, opt, batch) -> None:
    opt.zero_grad()
    loss, _ = dmp(batch)
    loss.backward()
    opt.step()


@pytest.mark.parametrize("W", [1, 2])
def test_prefetch_fills_caching_kernels_with_the_next_batch_before_this_ones_backward(W):
    """The prefetch stage (PipelineConfig(prefetch=True)) on CPU with a recording stand-in for fbgemm's prefetch: it
    is called for batch i+1 after batch i's forward and before its backward, on the caching kernel only, with the
    ids and offsets batch i+1's lookup reads (after the id all-to-all); a prefetch whose batch never comes, dropped."""
    assert run_ranks(_prefetch_order_worker, W, 6, timeout=120) == [5] * W


def _no_caching_worker(rank, W):
    import lightning_rec.pipeline.config as config_module

    config_module.no_cuda_error = lambda *args: None
    dmp, opt = _build(W)
    with pytest.raises(ValueError, match=r"prefetch=True\): the plan puts no table .*'dlrm.sparse_arch.embedding_bag_"
                                         r"collection'.*'fused_uvm_caching'.*leave prefetch out.*compute_kernels"):
        TrainPipelineSparseDist(dmp, opt, "cpu", PipelineConfig(prefetch=True))
    return True


def test_prefetch_without_a_caching_table_in_the_plan_is_refused():
    assert run_ranks(_no_caching_worker, 1) == [True]


class _StaleLookups(L.Callback):
    """The plain Lightning loop made one update stale by hand: batch i+1's lookup runs before batch i's backward."""

    def __init__(self, batches) -> None:
        self.batches, self.ahead, self.lookup, self.index = batches, None, None, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.index = batch_idx
        if self.lookup is None:
            ebc = pl_module.model.sparse_arch.embedding_bag_collection
            self.lookup = ebc.forward
            ebc.forward = self._forward

    def _forward(self, kjt):
        ahead, self.ahead = self.ahead, None
        return self.lookup(kjt) if ahead is None else ahead

    def on_before_backward(self, trainer, pl_module, loss):
        if self.index + 1 < len(self.batches):
            self.ahead = self.lookup(self.batches[self.index + 1].sparse_features)


class _Losses(L.Callback):
    def __init__(self, losses: list) -> None:
        self.losses = losses

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _lightning_semi_sync_worker(rank, W):
    from lightning_rec import DLRMModule
    from lightning_rec.strategy import RecStrategy

    def data():
        return SyntheticCriteoDataModule(num_train_samples=6 * 64, num_val_samples=64, batch_size=64,
                                         num_sparse_features=NUM_F, num_embeddings_per_feature=64,
                                         num_signal_features=2, shuffle=False)

    reference_data = data()
    reference_data.setup("fit")
    batches = list(reference_data.train_dataloader())
    results = {}
    for mode in ("plain", "stale_by_hand", "semi_sync"):
        L.seed_everything(0)
        module, losses = DLRMModule(**SMALL), []

        callbacks = [_Losses(losses)] + ([_StaleLookups(batches)] if mode == "stale_by_hand" else [])
        pipeline = PipelineConfig(semi_sync=True) if mode == "semi_sync" else False
        trainer = L.Trainer(strategy=RecStrategy(pipeline=pipeline), accelerator="cpu", devices=W, max_epochs=1,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, limit_val_batches=0, callbacks=callbacks)
        trainer.fit(module, data())
        results[mode] = (losses, _weights(module.model))
    return results


def test_semi_sync_in_the_lightning_loop_equals_the_plain_loop_made_stale_by_hand():
    (results,) = run_ranks(_lightning_semi_sync_worker, 1, timeout=180)
    (plain, _), (stale, stale_weights), (semi, semi_weights) = (results[m] for m in ("plain", "stale_by_hand",
                                                                                      "semi_sync"))
    assert len(semi) == 6 and semi == stale  # exact: fp32 on CPU, the same ops in the same order
    assert not [k for k in stale_weights if not torch.equal(stale_weights[k], semi_weights[k])]
    assert semi[0] == plain[0] and semi[1] != plain[1]  # batch 1 on: the lookups read tables one update stale


class _StandInCache(L.Callback):
    """Once the strategy has sharded the model: its one fused kernel records, standing for a fused_uvm_caching one."""

    def __init__(self, records: list) -> None:
        self.records = records

    def on_fit_start(self, trainer, pl_module):
        sharded = pl_module.model.sparse_arch.embedding_bag_collection
        (kernel,) = sharded._lookup.fused_kernels()
        _recording_stand_in(sharded, kernel, "cached", self.records, cached=True)


def _lightning_prefetch_worker(rank, W):
    import lightning_rec.pipeline.config as config_module
    from lightning_rec import DLRMModule
    from lightning_rec.strategy import RecStrategy

    config_module.no_cuda_error = lambda *args: None  # the order, without a CUDA device
    L.seed_everything(0)
    log = []
    data = SyntheticCriteoDataModule(num_train_samples=6 * 64, num_val_samples=64, batch_size=64,
                                     num_sparse_features=NUM_F, num_embeddings_per_feature=64, num_signal_features=2,
                                     shuffle=False, seed=3 * rank)
    trainer = L.Trainer(strategy=RecStrategy(pipeline=PipelineConfig(prefetch=True)), accelerator="cpu", devices=W,
                        max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, limit_val_batches=0, callbacks=[_StandInCache(log)])
    trainer.fit(DLRMModule(**SMALL, embedding_kernel="fbgemm"), data)
    return _check_prefetch_order(log, "cached", 3)  # 6 batches over 2 ranks


def test_prefetch_in_the_lightning_loop_fills_the_cache_with_the_next_batch_before_this_ones_backward():
    """RecStrategy(pipeline=PipelineConfig(prefetch=True)): the training step prefetches the next batch between its
    forward and its backward (automatic optimization), with the ids its lookup reads after the id all-to-all."""
    assert run_ranks(_lightning_prefetch_worker, 2, timeout=180) == [2, 2]


# On a GPU (`pytest -m gpu`): fbgemm's row cache, prefetched and not -----------------------------------------------

CACHED_ROWS, CACHED_BATCH = 4000, 512


class _CachedStep(Step):
    """Step over 4 tables of 4,000 rows, every one fused_uvm_caching with a cache of 20% of its rows."""

    def __init__(self) -> None:
        super().__init__()
        tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=CACHED_ROWS, embedding_dim=8, feature_names=[k])
                  for i, k in enumerate(KEYS)]
        ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.05))
        self.dlrm = DLRM(ebc, 13, [16, 8], [16, 1])


def _cached_batches(n: int) -> list:
    """Host batches (pinned) of 0-3 ids per bag: ~3,000 ids a batch against 3,200 cache slots in 100 sets of 32, so
    that rows miss, are evicted and come back (the cases fbgemm's prefetch pipeline must keep consistent)."""
    from lightning_rec.data.batch import Batch
    from lightning_rec.sparse import KeyedJaggedTensor

    g, out = torch.Generator().manual_seed(1), []
    for _ in range(n):
        lengths = torch.randint(0, 4, (NUM_F * CACHED_BATCH,), generator=g)
        ids = torch.randint(0, CACHED_ROWS, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor(KEYS, ids, lengths=lengths, stride=CACHED_BATCH)
        dense, labels = torch.rand(CACHED_BATCH, 13, generator=g), torch.randint(0, 2, (CACHED_BATCH,), generator=g)
        out.append(Batch(dense, kjt, labels.float()).pin_memory())
    return out


def _cached_run(batches, prefetch: bool):
    from lightning_rec.types import ComputeKernel

    torch.manual_seed(0)
    model = _CachedStep()
    ebc = model.dlrm.sparse_arch.embedding_bag_collection
    path = "dlrm.sparse_arch.embedding_bag_collection"
    plan = ShardingPlan({path: construct_module_sharding_plan(
        ebc, {f"t{i}": table_wise(rank=0, compute_kernel=ComputeKernel.FUSED_UVM_CACHING) for i in range(NUM_F)},
        world_size=1, local_size=1)})
    for sharding in plan.plan[path].values():
        sharding.cache_load_factor = 0.2
    device = f"cuda:{torch.cuda.current_device()}"
    dmp = DistributedModelParallel(model, plan=plan, device=device, timeout=60)
    opt = CombinedOptimizer([("fused", dmp.fused_optimizer),
                             ("dense", torch.optim.Adagrad([p for p in dmp.parameters() if p.requires_grad], lr=0.02))])
    (kernel,) = dmp.module.dlrm.sparse_arch.embedding_bag_collection._lookup.fused_kernels()
    assert kernel.caching and kernel.tbe.lxu_cache_weights.numel() > 0
    calls, real = [], kernel.tbe.prefetch
    kernel.tbe.prefetch = lambda indices, offsets, forward_stream=None: (
        calls.append(forward_stream is not None), real(indices, offsets, forward_stream=forward_stream))[1]
    sums = []
    with TrainPipelineSparseDist(dmp, opt, device, PipelineConfig(prefetch=prefetch)) as pipeline:
        it = iter(batches)
        while True:
            try:
                sums.append(pipeline.progress(it).detach().sum())
            except StopIteration:
                break
    assert kernel.tbe.prefetch_pipeline == prefetch and not kernel._prefetched
    return torch.stack(sums).cpu(), _weights(dmp), calls


def _uvm_parity_worker(rank, W, steps):
    batches = _cached_batches(steps)
    none_sums, none_weights, none_calls = _cached_run(batches, prefetch=False)
    sums, weights, calls = _cached_run(batches, prefetch=True)
    assert none_calls == [] and calls == [True] * (steps - 1)  # batches 1.. prefetched, on the side stream
    # the same rows and arithmetic, read from the cache or from host memory; fbgemm's backward with the prefetch
    # pipeline sums each row's gradients over unique cache locations, an order that may differ in the last bit
    torch.testing.assert_close(sums, none_sums, atol=1e-6, rtol=1e-6)
    for k in none_weights:
        torch.testing.assert_close(weights[k].cpu(), none_weights[k].cpu(), atol=1e-6, rtol=1e-6, msg=k)
    return steps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and fbgemm-gpu (CUDA build)")
def test_prefetch_trains_what_the_pipeline_without_it_trains_with_a_uvm_cache_of_20_percent():
    """PipelineConfig(prefetch=True) on fused_uvm_caching tables (load factor 0.2, misses and evictions every step)
    trains what the pipeline without the prefetch stage trains over 30 steps, to 1e-6."""
    assert run_ranks(_uvm_parity_worker, 1, 30, timeout=300, backend="nccl") == [30]
