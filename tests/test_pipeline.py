"""TrainPipelineSparseDist and RecStrategy(pipeline=True) on 2 CPU ranks: parity with the plain loop, bad input.

Parity is bitwise (torch.equal): the pipeline routes the same ids with the same ops, only earlier
and on another channel, and the step's arithmetic (lookup, output dist, dense, fused update) runs
in the same order as in the plain loop. Batches come from a real DataLoader (the synthetic data
module), different on each rank.
"""

from __future__ import annotations

import threading
import warnings

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from torch import nn

from lightning_rec.data.batch import Batch
from lightning_rec.data.synthetic import SyntheticCriteoDataModule
from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.model_parallel import DistributedModelParallel, construct_module_sharding_plan, row_wise, table_wise
from lightning_rec.models.dlrm import DLRM
from lightning_rec.optim import CombinedOptimizer, FusedOptimizerConfig
from lightning_rec.pipeline import PipelineConfig, TrainPipelineSparseDist, find_kjts, path_name
from lightning_rec.pipeline.channel import _Channel
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.types import ShardingPlan

NUM_F, ROWS, DIM, BATCH = 4, 40, 8, 16
KEYS = [f"C{i}" for i in range(1, NUM_F + 1)]


class Step(nn.Module):
    """model(batch) -> (loss, logits), as TrainPipelineSparseDist expects; Python around the embeddings."""

    def __init__(self, inside_kjt: bool = False, moves_batch: bool = False) -> None:
        super().__init__()
        tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=ROWS + 3 * i, embedding_dim=DIM,
                                     feature_names=[k]) for i, k in enumerate(KEYS)]
        ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.05))
        self.dlrm = DLRM(ebc, 13, [16, DIM], [16, 1])
        self.inside_kjt = inside_kjt
        self.moves_batch = moves_batch
        self.fail_at = -1
        self.calls = 0

    def forward(self, batch: Batch):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("boom in the user's forward")
        if self.moves_batch:  # a step that moves its batch itself, as with Lightning's training_step(dataloader_iter)
            batch = batch.to(batch.dense_features.device)
        kjt = batch.sparse_features
        if self.inside_kjt:  # a KJT the model builds itself: cannot be routed ahead
            kjt = KeyedJaggedTensor(kjt.keys(), kjt.values() % ROWS, lengths=kjt.lengths())
        dense = batch.dense_features * (2.0 if self.calls % 2 else 1.0)  # arbitrary Python around the embeddings
        logits = self.dlrm(dense, kjt).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum"), logits


def _loader(rank: int, batches: int, seed: int = 0, pin_memory: bool = False):
    data = SyntheticCriteoDataModule(num_train_samples=batches * BATCH, num_val_samples=BATCH, batch_size=BATCH,
                                     num_sparse_features=NUM_F, num_embeddings_per_feature=ROWS, num_signal_features=2,
                                     seed=seed + 7 * rank, shuffle=False, pin_memory=pin_memory)
    data.setup("fit")
    return data.train_dataloader()


def _plan(kind: str, model: Step, W: int) -> ShardingPlan | None:
    ebc = model.dlrm.sparse_arch.embedding_bag_collection
    if kind == "planner":
        from lightning_rec.planner import EmbeddingShardingPlanner, Topology

        planner = EmbeddingShardingPlanner(Topology(world_size=W, compute_device="cpu"), batch_size=BATCH,
                                           optimizer="rowwise_adagrad", print_stats=False)
        return planner.plan(model)
    verb = {"table_wise": lambda i: table_wise(rank=i % W), "row_wise": lambda i: row_wise()}[kind]
    return ShardingPlan({"dlrm.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, {f"t{i}": verb(i) for i in range(NUM_F)}, world_size=W, local_size=W)})


def _build(kind: str, W: int, inside_kjt: bool = False, device: str = "cpu"):
    torch.manual_seed(0)
    model = Step(inside_kjt)
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    dmp = DistributedModelParallel(model, plan=_plan(kind, model, W), device=device, timeout=30)
    opt = CombinedOptimizer([("fused", dmp.fused_optimizer),
                             ("dense", torch.optim.Adagrad([p for p in dmp.parameters() if p.requires_grad], lr=0.02))])
    return model, dmp, opt


def _plain_steps(dmp, opt, it, n: int | None = None) -> list[float]:
    losses = []
    for batch in it:
        opt.zero_grad()
        loss, _ = dmp(batch)
        loss.backward()
        opt.step()
        losses.append(float(loss))
        if n is not None and len(losses) == n:
            break
    return losses


def _pipelined_steps(pipeline, it, n: int | None = None) -> list[float]:
    losses = []
    while n is None or len(losses) < n:
        try:
            logits = pipeline.progress(it)
        except StopIteration:
            break
        losses.append(float(logits.detach().sum()))
    return losses


def _weights(dmp) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in dmp.state_dict().items():
        if hasattr(v, "local_shards"):
            for i, (_, t) in enumerate(v.local_shards):
                out[f"{k}#{i}"] = t.clone()
        else:
            out[k] = v.clone()
    return out


def _parity_worker(rank, W, kind, steps, device="cpu", feeder_collectives="auto", read_ahead="auto", sized=False):
    # plain: the loss each step and the weights at the end
    model, dmp, opt = _build(kind, W, device=device)
    plain_logit_sums = []
    cuda = device == "cuda"
    for batch in _take(_loader(rank, steps, pin_memory=cuda), steps):
        batch = batch.to(device)
        opt.zero_grad()
        loss, logits = dmp(batch)
        loss.backward()
        opt.step()
        plain_logit_sums.append(float(logits.detach().sum()))
    plain = _weights(dmp)
    del model, dmp, opt
    model, dmp, opt = _build(kind, W, device=device)
    pipeline = TrainPipelineSparseDist(dmp, opt, device, PipelineConfig(feeder_collectives=feeder_collectives,
                                                                         read_ahead=read_ahead))
    assert pipeline.read_ahead[0] == read_ahead or read_ahead == "auto", pipeline.read_ahead
    steps_done_at_read, readers = [], set()  # as each batch is read: the steps whose collection took its input by then

    def read(batches):
        for batch in batches:
            steps_done_at_read.append(sum(pipeline.stats.values()))
            readers.add(threading.current_thread().name)
            yield batch

    def source():  # a generator: no length, so the ranks agree before every batch whether all have one
        yield from read(_loader(rank, steps, pin_memory=cuda))

    loader = _loader(rank, steps, pin_memory=cuda)
    if sized:  # the loader's pass (its length known): the ranks agree on the length once, at the first batch
        loader.collate_fn = lambda rows, own=loader.collate_fn: next(read([own(rows)]))  # (noted as it is read)
    agreements = []
    agree = _Channel.agree
    _Channel.agree = lambda *a, **k: agreements.append(1) or agree(*a, **k)
    try:
        piped_logit_sums = _pipelined_steps(pipeline, iter(loader) if sized else source())
    finally:
        _Channel.agree = agree
    assert len(agreements) == (1 if sized else steps + 1), len(agreements)
    if pipeline.read_ahead[0] == "inline":  # batch k read only once step k-1 is done, by the step's own thread
        assert steps_done_at_read == list(range(steps + 1))[:len(steps_done_at_read)], steps_done_at_read
        assert readers == {threading.main_thread().name}, readers
    assert pipeline.stats == {"routed_ahead": steps - 1, "routed_in_step": 1}  # only the recording batch in-step
    pipeline.close()
    piped = _weights(dmp)
    assert plain.keys() == piped.keys()
    if not cuda:  # CPU: the same ops in the same order
        assert piped_logit_sums == plain_logit_sums, (piped_logit_sums[:5], plain_logit_sums[:5])
        bad = [k for k in plain if not torch.equal(plain[k], piped[k])]
        assert not bad, bad
    else:  # GPU: the same kernels, but cuBLAS / TBE may pick other reduction orders on other streams
        torch.testing.assert_close(torch.tensor(piped_logit_sums), torch.tensor(plain_logit_sums), rtol=1e-4,
                                   atol=1e-3)
        for k in plain:
            torch.testing.assert_close(piped[k], plain[k], rtol=1e-4, atol=1e-5, msg=k)
    return len(piped_logit_sums)


def _take(loader, n):
    for i, b in enumerate(loader):
        if i == n:
            return
        yield b


@pytest.mark.parametrize("kind,feeder_collectives,read_ahead,sized", [
    ("table_wise", "auto", "thread", False), ("row_wise", "auto", "inline", False), ("planner", "auto", "auto", False),
    ("row_wise", "in_step_order", "thread", False), ("table_wise", "auto", "inline", True),
    ("row_wise", "auto", "thread", True)])
def test_pipelined_matches_plain_bitwise_over_50_steps(kind, feeder_collectives, read_ahead, sized):
    """Either read-ahead mode (the feeder beside the step, or inline in the step's thread as it asks for the batch)
    trains what the plain loop trains: the same logits and tables, bit for bit. A loader whose length is known
    (sized) agrees on it once instead of before every batch (that agreement was ~3% of a 2-core step) and trains
    the same."""
    assert run_ranks(_parity_worker, 2, kind, 50, "cpu", feeder_collectives, read_ahead, sized,
                     timeout=240) == [50, 50]


def _one_rank_worker(rank, W, steps):
    import torch.distributed as dist

    calls = []
    for name in ("all_to_all_single", "all_reduce"):
        real = getattr(dist, name)
        setattr(dist, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    return _parity_worker(rank, W, "planner", steps), calls


def test_one_rank_pipeline_matches_plain_and_exchanges_nothing():
    """One device (Trainer(strategy="rec") on one GPU): ids, rows and the next-batch agreement stay on the rank;
    no collective, so no per-step host read of counts or flags on a GPU."""
    assert run_ranks(_one_rank_worker, 1, 12, timeout=120) == [(12, [])]


def _launch_order_worker(rank, W, feeder_collectives):
    import threading
    import time

    from lightning_rec.shm_transport import SharedMemoryGroup

    log = []  # every shared-memory collective this rank starts: (by the feeder thread?, tag)
    real = SharedMemoryGroup._write

    def logged(self, slot, pieces, op, tag):
        log.append((threading.current_thread().name == "lightning_rec-pipeline-feeder", tag))
        return real(self, slot, pieces, op, tag)

    SharedMemoryGroup._write = logged
    model, dmp, opt = _build("row_wise", W)
    assert dmp._transport is not None  # the collectives below go through shared memory

    def uneven(loader):  # rank 1 reads slowly, rank 0 computes slowly: the threads' timing differs by rank
        for b in loader:
            time.sleep(0.01 if rank == 1 else 0.0)
            yield b

    class Slow(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, batch):
            time.sleep(0.01 if rank == 0 else 0.0)
            return self.inner(batch)

    # a feeder thread (inline, auto's choice on 2 cores, runs every collective in the step's thread)
    config = PipelineConfig(feeder_collectives=feeder_collectives, read_ahead="thread")
    pipeline = TrainPipelineSparseDist(Slow(dmp), opt, "cpu", config)
    steps = len(_pipelined_steps(pipeline, iter(uneven(_loader(rank, 12)))))
    pipeline.close()
    SharedMemoryGroup._write = real
    return steps, log


def test_in_step_order_launches_both_threads_collectives_in_one_order_on_every_rank():
    """What NCCL asks of two communicators driven from two threads (feeder_collectives="auto" picks this on
    NCCL); shown here on the shared-memory transport, with ranks whose loader and step run at other speeds."""
    (steps0, log0), (steps1, log1) = run_ranks(_launch_order_worker, 2, "in_step_order", timeout=120)
    assert steps0 == steps1 == 12
    feeder = [tag for by_feeder, tag in log0 if by_feeder]
    assert feeder and len(feeder) < len(log0)  # both threads ran collectives ...
    assert log0 == log1  # ... in the same order on both ranks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and fbgemm-gpu (CUDA build)")
@pytest.mark.parametrize("feeder_collectives", ["auto", "in_step_order"])
def test_pipelined_matches_plain_nccl(feeder_collectives):
    """One rank per visible GPU: side-stream copies from pinned memory, input_dist on its own stream. "auto" is
    "concurrent" on one GPU and "in_step_order" on several: both orders run on one GPU too."""
    W = torch.cuda.device_count()
    assert run_ranks(_parity_worker, W, "table_wise", 50, "cuda", feeder_collectives, timeout=600,
                     backend="nccl") == [50] * W


def test_find_kjts_paths():
    kjt = KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1]), torch.tensor([1]))
    batch = {"x": (torch.zeros(1), Batch(torch.zeros(1, 1), kjt, torch.zeros(1)))}
    [(found, path)] = find_kjts(batch)
    assert found is kjt and path_name(path) == "batch['x'][1].sparse_features"
    with pytest.raises(ValueError, match="variant"):
        PipelineConfig(variant="semi_sync_typo")


def test_read_ahead_auto_goes_inline_only_where_no_core_is_spare():
    """2 ranks x 1 thread on 2 cores: a feeder thread beside each step made pipeline=True 0.86x the plain loop (the
    step's thread was busy 94% of the step). auto runs it inline there, beside the step where a core is free."""
    from lightning_rec.pipeline.config import choose_read_ahead

    auto = PipelineConfig()
    assert choose_read_ahead(auto, 2, 1, 2, cuda=False)[0] == "inline"
    assert choose_read_ahead(auto, 1, 2, 2, cuda=False)[0] == "inline"  # one rank, torch's default: a thread a core
    assert choose_read_ahead(auto, 2, 1, 4, cuda=False)[0] == "thread"
    assert choose_read_ahead(auto, 8, 1, 2, cuda=True)[0] == "thread"  # the step computes on the GPU
    assert choose_read_ahead(PipelineConfig(feeder_collectives="concurrent"), 2, 1, 2, cuda=False)[0] == "thread"
    mode, why = choose_read_ahead(PipelineConfig(read_ahead="thread"), 2, 1, 2, cuda=False)
    assert mode == "thread" and "read_ahead='thread'" in why
    with pytest.raises(ValueError, match=r"read_ahead='fast'\): choose one of \('auto', 'thread', 'inline'\)"):
        PipelineConfig(read_ahead="fast")
    with pytest.raises(ValueError, match="never concurrently; drop one of the two"):
        PipelineConfig.of({"read_ahead": "inline", "feeder_collectives": "concurrent"})


# bad input and lifecycle (hand loop) -----------------------------------------------------------------


def _bad_input_worker(rank, W, feeder_collectives="auto"):
    out = {}
    config = PipelineConfig(feeder_collectives=feeder_collectives)
    # 1. a loader that ends mid-pipeline (3 batches, depth 2): every batch is drained, in order
    model, dmp, opt = _build("table_wise", W)
    pipeline = TrainPipelineSparseDist(dmp, opt, "cpu", PipelineConfig(depth=2, feeder_collectives=feeder_collectives))
    loader = _loader(rank, 3)
    expected = [b.labels.clone() for b in loader]
    seen = []
    pipeline_model_forward = model.forward

    def spy(batch):
        seen.append(batch.labels.clone())
        return pipeline_model_forward(batch)

    model.forward = spy
    out["drained"] = len(_pipelined_steps(pipeline, iter(loader)))
    out["in_order"] = all(torch.equal(a, b) for a, b in zip(seen, expected)) and len(seen) == 3
    model.forward = pipeline_model_forward
    # 2. an empty loader: StopIteration at once, no hang
    out["empty"] = len(_pipelined_steps(pipeline, iter([])))
    # 3. ranks whose loaders end at different steps: everyone stops with the shortest
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["uneven"] = len(_pipelined_steps(pipeline, iter(_loader(rank, 6 if rank == 0 else 4))))
    out["skip_warned"] = any("batches are skipped" in str(w.message) for w in caught)
    # 4. a batch whose features differ from the model's (rank 1's 3rd batch): ValueError on every rank
    batches = list(_loader(rank, 5))
    if rank == 1:
        b = batches[2]
        kjt = b.sparse_features
        renamed = KeyedJaggedTensor(["C1", "C2", "C3", "X9"], kjt.values(), lengths=kjt.lengths())
        batches[2] = Batch(b.dense_features, renamed, b.labels)
    try:
        _pipelined_steps(pipeline, iter(batches))
        out["bad_features"] = None
    except ValueError as e:
        out["bad_features"] = str(e)
    pipeline.close()
    # 5. an exception in the user's forward, raised on every rank: raised, not swallowed, no hang
    pipeline = TrainPipelineSparseDist(dmp, opt, "cpu", config)
    model.calls, model.fail_at = 0, 4
    try:
        _pipelined_steps(pipeline, iter(_loader(rank, 8)))
        out["forward_error"] = None
    except RuntimeError as e:
        out["forward_error"] = str(e)
    pipeline.close()
    model.fail_at = -1
    # ... and the model still trains, plain then pipelined again (a pipeline rebuilt over the same model)
    out["after"] = len(_plain_steps(dmp, opt, iter(_loader(rank, 2)))) + len(
        _pipelined_steps(TrainPipelineSparseDist(dmp, opt, "cpu", config), iter(_loader(rank, 3))))
    return out


@pytest.mark.parametrize("feeder_collectives", ["auto", "in_step_order"])
def test_bad_input_raises_on_every_rank_and_never_hangs(feeder_collectives):
    results = run_ranks(_bad_input_worker, 2, feeder_collectives, timeout=180, pg_timeout=60)
    for rank, out in enumerate(results):
        assert out["drained"] == 3 and out["in_order"]
        assert out["empty"] == 0
        assert out["uneven"] == 4 and out["skip_warned"] == (rank == 0)
        assert out["bad_features"] is not None and "X9" in out["bad_features"] or "rejected" in out["bad_features"]
        assert out["forward_error"] == "boom in the user's forward"
        assert out["after"] == 5
    assert "C4" in results[1]["bad_features"]  # the rank with the bad batch names the missing feature


def _rebuild_worker(rank, W):
    """Pipelines built, thrown away and rebuilt over one model, alternating with the plain loop, against the
    plain loop alone: same weights, bitwise. Where the feeders work (read_ahead) is said once, on rank 0."""
    import logging

    said = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("lightning_rec.pipeline").addHandler(handler)
    logging.getLogger("lightning_rec.pipeline").setLevel(logging.INFO)
    loader_batches = list(_loader(rank, 24))
    model, dmp, opt = _build("row_wise", W)
    _plain_steps(dmp, opt, iter(loader_batches))
    plain = _weights(dmp)
    del model, dmp, opt
    model, dmp, opt = _build("row_wise", W)
    it = iter(loader_batches)
    first = TrainPipelineSparseDist(dmp, opt, "cpu")
    _pipelined_steps(first, it, 8)  # 8 steps; the feeder has read ahead 1 batch: the rest go back in order
    first.close()
    rest = loader_batches[8:]
    _plain_steps(dmp, opt, iter(rest[:6]))
    second = TrainPipelineSparseDist(dmp, opt, "cpu")
    _pipelined_steps(second, iter(rest[6:]))
    del second  # thrown away without close: the next pipeline still builds (a new channel)
    piped = _weights(dmp)
    same_weights = all(torch.equal(plain[k], piped[k]) for k in plain)
    # forward only (evaluation): the model in eval mode, no optimizer; the same outputs as a plain forward
    dmp.eval()
    model.calls = 0
    with torch.no_grad():
        expected = [dmp(b)[1] for b in loader_batches[:5]]
    model.calls = 0  # Step's forward doubles the dense input on odd calls
    with TrainPipelineSparseDist(dmp, None, "cpu") as evaluation:
        got = [evaluation.progress(it) for it in [iter(loader_batches[:5])] for _ in range(5)]
    same_outputs = all(torch.equal(a, b) and not b.requires_grad for a, b in zip(expected, got))
    said = [m for m in said if "read-ahead" in m]
    return same_weights, same_outputs, _weights(dmp).keys() == plain.keys(), len(said), said[:1]


def test_pipelines_rebuilt_and_alternating_with_plain_loop_match_plain():
    (*ok0, n0, said), (*ok1, n1, _) = run_ranks(_rebuild_worker, 2, timeout=180)
    assert ok0 == ok1 == [True, True, True]
    assert (n0, n1) == (1, 0) and said[0].startswith("lightning_rec pipeline: read-ahead "), (n0, n1, said)


def _inside_kjt_worker(rank, W):
    model, dmp, opt = _build("table_wise", W, inside_kjt=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipeline = TrainPipelineSparseDist(dmp, opt, "cpu")
        losses = _pipelined_steps(pipeline, iter(_loader(rank, 6)))
    said = [str(w.message) for w in caught if "cannot route their ids ahead" in str(w.message)]
    return len(losses), said, pipeline.stats


def test_kjt_built_inside_the_model_says_so_once_and_runs_plain():
    for n, said, stats in run_ranks(_inside_kjt_worker, 2, timeout=120):
        assert n == 6 and len(said) == 1
        assert "dlrm.sparse_arch.embedding_bag_collection" in said[0] and "not part of the batch" in said[0]
        assert stats == {"routed_ahead": 0, "routed_in_step": 6}


# Lightning: RecStrategy(pipeline=True) ---------------------------------------------------------------


SMALL = dict(num_embeddings_per_feature=64, embedding_dim=8, dense_arch_layer_sizes=[16, 8],
             over_arch_layer_sizes=[16, 1], sparse_lr=0.05, dense_lr=0.02, sparse_feature_names=KEYS)


def _lightning_worker(rank, W, tmp):
    from lightning_rec import DLRMModule
    from lightning_rec.strategy import RecStrategy

    class Hooked(DLRMModule):
        """Batch hooks that change the batch (a new KJT object, scaled dense features) and count their calls."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hook_calls = {"before": 0, "transfer": 0, "after": 0}

        def on_before_batch_transfer(self, batch, dataloader_idx):
            self.hook_calls["before"] += 1
            kjt = batch.sparse_features
            return Batch(batch.dense_features, KeyedJaggedTensor(kjt.keys(), kjt.values(), lengths=kjt.lengths()),
                         batch.labels)

        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            self.hook_calls["transfer"] += 1
            return super().transfer_batch_to_device(batch, device, dataloader_idx)

        def on_after_batch_transfer(self, batch, dataloader_idx):
            self.hook_calls["after"] += 1
            return Batch(batch.dense_features * 0.5, batch.sparse_features, batch.labels)

    results = {}
    for mode in ("plain", "pipelined", "plain_again"):
        L.seed_everything(0)
        data = SyntheticCriteoDataModule(num_train_samples=1024, num_val_samples=256, batch_size=64,
                                         num_sparse_features=NUM_F, num_embeddings_per_feature=64,
                                         num_signal_features=2)
        module = Hooked(**SMALL)
        losses = []

        stats = []

        class Losses(L.Callback):
            def __init__(self, losses, stats):
                self.losses, self.stats = losses, stats

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.losses.append(float(outputs["loss"]))

            def on_train_end(self, trainer, pl_module):
                self.stats.extend(dict(p.stats) for p in trainer.strategy._pipelines)

        strategy = RecStrategy(pipeline=(mode == "pipelined"))
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=W, max_epochs=2, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            gradient_clip_val=0.5, val_check_interval=0.5, callbacks=[Losses(losses, stats)])
        trainer.fit(module, data)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        trainer.save_checkpoint(f"{tmp}/{mode}.ckpt")
        test = trainer.validate(module, data, verbose=False)[0]  # again, after fit: a new (forward-only) pipeline
        results[mode] = dict(losses=losses, metrics=metrics, val=test, weights=_weights(module.model),
                             stats=stats, hook_calls=dict(module.hook_calls))
    return results


def test_rec_strategy_pipeline_matches_plain_fit(tmp_path):
    for rank_result in run_ranks(_lightning_worker, 2, str(tmp_path), timeout=300):
        plain, piped = rank_result["plain"], rank_result["pipelined"]
        assert len(plain["losses"]) == 16 and piped["losses"] == plain["losses"]
        same = [k for k in plain["metrics"] if not k.startswith("mem/")]  # peak memory differs run to run
        assert {k: piped["metrics"][k] for k in same} == {k: plain["metrics"][k] for k in same}
        assert piped["val"] == plain["val"]
        assert all(torch.equal(plain["weights"][k], piped["weights"][k]) for k in plain["weights"])
        assert rank_result["plain_again"]["losses"] == plain["losses"]
        # the batch hooks ran once per batch in both modes (pipelined: in the feeder, before routing):
        # 16 training batches, sanity check 2, 4 validations x 2, validate() 2
        assert piped["hook_calls"] == plain["hook_calls"] and plain["hook_calls"]["before"] == 16 + 2 + 4 * 2 + 2
        assert set(plain["hook_calls"].values()) == {plain["hook_calls"]["before"]}
        assert plain["stats"] == [] and len(piped["stats"]) == 2  # the train and the val loader's pipelines
        val, train = piped["stats"]  # the sanity check builds the val loader's first
        assert train == {"routed_ahead": 15, "routed_in_step": 1}  # 16 steps: only the recording batch in-step
        assert val == {"routed_ahead": 9, "routed_in_step": 1}  # sanity check (2) + 4 validations of 2 batches
    from lightning_rec.checkpoint import full_state_dict  # sharded checkpoints (directories), tables whole

    state = {m: full_state_dict(tmp_path / f"{m}.ckpt") for m in ("plain", "pipelined")}
    assert all(torch.equal(state["plain"][k], state["pipelined"][k]) for k in state["plain"])


def _lightning_bad_input_worker(rank, W):
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_rec import DLRMModule
    from lightning_rec.data.batch import passthrough_collate
    from lightning_rec.strategy import RecStrategy

    class Uneven(IterableDataset):  # rank 0 has 6 batches, rank 1 has 4; `bad_at`: a batch with a renamed feature
        def __init__(self, data, bad_at):
            self.data, self.bad_at = data, bad_at

        def __iter__(self):
            for i in range(6 if rank == 0 else 4):
                b = self.data.__getitems__(list(range(i * 32, (i + 1) * 32)))
                if i == self.bad_at and rank == 0:
                    kjt = b.sparse_features
                    b = Batch(b.dense_features, KeyedJaggedTensor(["C1", "C2", "C3", "C9"], kjt.values(),
                                                                  lengths=kjt.lengths()), b.labels)
                yield b

    out = {}
    for bad_at in (-1, 2):
        class UnevenData(SyntheticCriteoDataModule):
            bad_at = -1

            def train_dataloader(self):
                return DataLoader(Uneven(self.make_split("train"), self.bad_at), batch_size=None,
                                  collate_fn=passthrough_collate)

        UnevenData.bad_at = bad_at
        L.seed_everything(0)
        data = UnevenData(num_train_samples=256, num_val_samples=64, batch_size=32, num_sparse_features=NUM_F,
                          num_embeddings_per_feature=64, num_signal_features=2)
        trainer = L.Trainer(strategy=RecStrategy(pipeline=True), accelerator="cpu", devices=W, max_epochs=2,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, num_sanity_val_steps=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                trainer.fit(DLRMModule(**SMALL), data)
                out[bad_at] = trainer.global_step
            except ValueError as e:
                out[bad_at] = str(e)
        out[f"skipped{bad_at}"] = sum("batches are skipped" in str(w.message) for w in caught)
    return out


def test_rec_strategy_pipeline_uneven_ranks_and_bad_batch():
    results = run_ranks(_lightning_bad_input_worker, 2, timeout=240, pg_timeout=60)
    for rank, out in enumerate(results):
        assert out[-1] == 8  # 4 steps per epoch on both ranks (the shorter loader), 2 epochs
        assert out["skipped-1"] == (2 if rank == 0 else 0)  # rank 0 says it skipped, once per epoch
        assert isinstance(out[2], str)  # the bad batch: a ValueError on every rank, nothing hangs
    assert "C4" in results[0][2] and "C9" in results[0][2]


class TwoTower(nn.Module):
    """Two collections fed from a dict batch, one of them twice: found at run time, no tracing."""

    def __init__(self) -> None:
        super().__init__()
        opt = FusedOptimizerConfig("adagrad", lr=0.1)
        user = EmbeddingBagConfig(name="u", num_embeddings=30, embedding_dim=8, feature_names=["uid"])
        item = EmbeddingBagConfig(name="i", num_embeddings=50, embedding_dim=8, feature_names=["iid", "cat"])
        self.user = EmbeddingBagCollection([user], optimizer=opt)
        self.item = EmbeddingBagCollection([item], optimizer=opt)
        self.proj = nn.Linear(8, 8)

    def forward(self, batch: dict):
        u = self.proj(self.user(batch["user"]).values())
        pos = self.item(batch["items"][0]).values().view(-1, 2, 8).sum(1)
        neg = self.item(batch["items"][1]).values().view(-1, 2, 8).sum(1)  # the same collection again
        logits = torch.cat([(u * pos).sum(1), (u * neg).sum(1)])
        labels = torch.cat([torch.ones(len(u)), torch.zeros(len(u))])
        return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum"), logits


def _two_tower_batches(rank: int, n: int) -> list[dict]:
    g = torch.Generator().manual_seed(rank)
    B = 6 + rank

    def kjt(keys, rows):
        lengths = torch.randint(1, 3, (len(keys) * B,), generator=g)
        return KeyedJaggedTensor.from_lengths_sync(keys, torch.randint(0, rows, (int(lengths.sum()),), generator=g),
                                                   lengths)

    return [{"user": kjt(["uid"], 30), "items": (kjt(["iid", "cat"], 50), kjt(["iid", "cat"], 50))}
            for _ in range(n)]


def _two_tower_worker(rank, W):
    batches = _two_tower_batches(rank, 12)
    runs = []
    for pipelined in (False, True):
        torch.manual_seed(0)
        dmp = DistributedModelParallel(TwoTower(), device="cpu", timeout=30)  # the planner's plan
        opt = CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", torch.optim.SGD(
            [p for p in dmp.parameters() if p.requires_grad], lr=0.05))])
        if pipelined:
            pipeline = TrainPipelineSparseDist(dmp, opt, "cpu")
            outputs = [pipeline.progress(it) for it in [iter(batches)] for _ in batches]
            stats = pipeline.stats
        else:
            outputs = []
            for b in batches:
                opt.zero_grad()
                loss, logits = dmp(b)
                loss.backward()
                opt.step()
                outputs.append(logits)
        runs.append((outputs, _weights(dmp)))
    (plain_out, plain_w), (piped_out, piped_w) = runs
    same = all(torch.equal(a, b) for a, b in zip(plain_out, piped_out))
    same = same and all(torch.equal(plain_w[k], piped_w[k]) for k in plain_w)
    return same, stats


def test_dict_batch_two_collections_one_called_twice():
    for same, stats in run_ranks(_two_tower_worker, 2, timeout=120):
        assert same
        assert stats == {"routed_ahead": 3 * 11, "routed_in_step": 3}  # 3 inputs per batch; the first in-step


# a rank that dies mid-pipeline is named, on either transport ------------------------------------------


def _dead_in_loader_worker(rank, W, shared_memory, slow_s, feeder_collectives="auto"):
    import os
    import time

    torch.manual_seed(0)
    model = Step()
    dmp = DistributedModelParallel(model, plan=_plan("table_wise", model, W), device="cpu", timeout=30,
                                   shared_memory=shared_memory)
    opt = CombinedOptimizer([("fused", dmp.fused_optimizer),
                             ("dense", torch.optim.Adagrad([p for p in dmp.parameters() if p.requires_grad], lr=0.02))])

    def batches():
        for i, b in enumerate(_loader(rank, 8)):
            if i == 3 and rank == 1:
                time.sleep(slow_s)  # rank 0's step waits for its next batch; only its feeder is in a collective
                os._exit(0)  # gone without a word, in the feeder thread
            yield b

    start = time.monotonic()
    pipeline = TrainPipelineSparseDist(dmp, opt, "cpu", PipelineConfig(feeder_collectives=feeder_collectives))
    try:
        _pipelined_steps(pipeline, batches())
    except Exception as e:  # noqa: BLE001 - what rank 0 sees, and how long it took
        return type(e).__name__, str(e), time.monotonic() - start
    return "", "", time.monotonic() - start


@pytest.mark.parametrize("shared_memory,slow_s,feeder_collectives", [
    (False, 0.0, "auto"), (True, 0.0, "auto"), (False, 2.0, "auto"), (True, 2.0, "auto"),
    (False, 0.0, "in_step_order"), (True, 2.0, "in_step_order")],
    ids=["gloo", "shm", "gloo-feeder-only", "shm-feeder-only", "gloo-in-step-order", "shm-feeder-only-in-step-order"])
def test_rank_dying_in_its_loader_is_named_not_waited_for(shared_memory, slow_s, feeder_collectives):
    kind, text, seconds = run_ranks(_dead_in_loader_worker, 2, shared_memory, slow_s, feeder_collectives,
                                    timeout=90, allow_missing=True)[0]
    assert kind, "rank 0 trained on without its peer"
    assert seconds < 15, (seconds, text)
    if slow_s:  # only the feeder waits in a collective: its own guard finds the dead rank and names it
        assert kind == "PeerExited" and "pipeline" in text, text
        assert "rank 1 exited" in text or "rank(s) [1] exited" in text, text
    else:  # the step's collectives may notice first: the embedding exchange or DDP's gradient all-reduce,
        # each naming the rank (gloo alone says "Connection closed by peer" / "Connection reset by peer")
        assert "rank 1 exited" in text or "rank(s) [1] exited" in text, text


def test_torchrecs_execute_all_batches_argument():
    """TorchRec's TrainPipelineSparseDist(..., execute_all_batches=True) is what this pipeline does; False is
    refused (it was a TypeError)."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 1)

        def forward(self, x):
            loss = self.linear(x).sum()
            return loss, loss.detach()

    model = Model()
    with pytest.raises(ValueError, match="always runs every batch"):
        TrainPipelineSparseDist(model, None, "cpu", execute_all_batches=False)
    with TrainPipelineSparseDist(model, torch.optim.SGD(model.parameters(), lr=0.1), "cpu",
                                 execute_all_batches=True) as pipeline:
        batches = iter([torch.ones(3, 2), torch.ones(1, 2)])
        assert len([pipeline.progress(batches) for _ in range(2)]) == 2
        with pytest.raises(StopIteration):
            pipeline.progress(batches)


def _reload_worker(rank, W):
    import threading

    import torch.distributed.distributed_c10d as c10d

    from lightning_rec import DLRMModule
    from lightning_rec.pipeline.lightning import loop_state
    from lightning_rec.strategy import RecStrategy

    class Count(L.Callback):
        def __init__(self):
            self.feeders, self.pipelines = [], []

        def on_train_epoch_end(self, trainer, pl_module):
            self.feeders.append(sum(t.name == "lightning_rec-pipeline-feeder" and t.is_alive()
                                    for t in threading.enumerate()))
            self.pipelines.append(len(trainer.strategy._pipelines))

        def on_validation_end(self, trainer, pl_module):  # both val loaders ran pipelined
            loaders = trainer.fit_loop.epoch_loop.val_loop._combined_loader.flattened
            pipelines = [loop_state(dl).pipeline for dl in loaders]
            self.val_pipelined = [not p.closed and p.stats["routed_ahead"] > 0 for p in pipelines]

    class TwoValLoaders(SyntheticCriteoDataModule):
        def val_dataloader(self):
            return [self._loader("val"), self._loader("val")]

    class Module(DLRMModule):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            super().validation_step(batch, batch_idx)

    out = {}
    for epochs in (2, 6):
        L.seed_everything(0)
        data = TwoValLoaders(num_train_samples=512, num_val_samples=128, batch_size=64, num_sparse_features=NUM_F,
                             num_embeddings_per_feature=64, num_signal_features=2)
        count = Count()
        groups = len(c10d._world.pg_map)
        trainer = L.Trainer(strategy=RecStrategy(pipeline=True), accelerator="cpu", devices=W, max_epochs=epochs,
                            reload_dataloaders_every_n_epochs=1, limit_train_batches=2, limit_val_batches=2,
                            num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, callbacks=[count])
        trainer.fit(Module(**SMALL), data)
        out[epochs] = dict(groups=len(c10d._world.pg_map) - groups, feeders=count.feeders,
                           pipelines=count.pipelines, val_pipelined=count.val_pipelined)
    return out


def test_reloaded_dataloaders_reuse_the_pipelines_channels():
    """reload_dataloaders_every_n_epochs=1: every reloaded loader got a new pipeline, each with a process group
    (and a shared-memory group) of its own and a feeder thread left waiting, none given back before the run
    ended: 26 process groups after 12 epochs. Now a replaced loader's pipeline is closed and its channels
    reused, and the feeder threads alive stay as many."""
    out = run_ranks(_reload_worker, 1, timeout=180)[0]
    assert out[6]["groups"] == out[2]["groups"], out  # the same channels, however many epochs
    # a loop still holds the loader it replaces while the new one is set up: one stale pipeline per loop at most
    assert len(set(out[6]["feeders"][1:])) == 1 and len(set(out[6]["pipelines"][1:])) == 1, out
    assert out[6]["val_pipelined"] == [True, True], out


def _moved_batch_worker(rank, W):
    torch.manual_seed(0)
    dmp = DistributedModelParallel(Step(moves_batch=True), device="cpu", timeout=30)
    opt = CombinedOptimizer([("fused", dmp.fused_optimizer),
                             ("dense", torch.optim.SGD([p for p in dmp.parameters() if p.requires_grad], lr=0.02))])
    with warnings.catch_warnings(record=True) as caught, TrainPipelineSparseDist(dmp, opt, "cpu") as pipeline:
        warnings.simplefilter("always")
        _pipelined_steps(pipeline, iter(_loader(rank, 6)))
        return pipeline.stats, [str(w.message) for w in caught if "pipeline" in str(w.message)]


def test_a_step_that_moves_its_batch_to_the_device_it_is_on_stays_pipelined():
    """`batch.to(device)` in the step (Lightning's training_step(dataloader_iter) leaves the move to the user) gave
    a new KeyedJaggedTensor on the device it was already on: the pipeline no longer recognised it, warned that
    the collection "was called with a KeyedJaggedTensor that is not part of the batch" and routed every batch
    in the step. KeyedJaggedTensor.to now returns itself when nothing moves, as Tensor.to does."""
    stats, said = run_ranks(_moved_batch_worker, 1, timeout=120)[0]
    assert stats == {"routed_ahead": 5, "routed_in_step": 1} and said == []


def _new_pass_worker(rank, W):
    from lightning_rec import DLRMModule
    from lightning_rec.pipeline.lightning import loop_state
    from lightning_rec.strategy import RecStrategy

    seen = []  # per pass: was the previous pass's feeder thread still running when the loader's __iter__ ran?

    class Data(SyntheticCriteoDataModule):
        def val_dataloader(self):
            loader = super().val_dataloader()

            class Watching(type(loader)):
                def __iter__(self):
                    feeder = getattr(getattr(loop_state(self), "pipeline", None), "feeder", None)
                    seen.append(feeder is not None and feeder._thread.is_alive())
                    return super().__iter__()

            loader.__class__ = Watching
            return loader

    L.seed_everything(0)
    data = Data(num_train_samples=256, num_val_samples=512, batch_size=64, num_sparse_features=NUM_F,
                num_embeddings_per_feature=64, num_signal_features=2)
    trainer = L.Trainer(strategy=RecStrategy(pipeline=True), accelerator="cpu", devices=W, max_epochs=3,
                        limit_train_batches=2, limit_val_batches=2, num_sanity_val_steps=0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(DLRMModule(**SMALL), data)
    return seen


def test_a_new_pass_stops_the_last_passs_feeder_before_the_loader_restarts():
    """A pass cut short (limit_val_batches) leaves its feeder reading ahead from the loader's iterator; the next pass
    called the loader's __iter__ first, which with persistent_workers resets that same iterator while the old
    feeder may still be inside next() on it. The old feeder is now stopped before the loader restarts."""
    seen = run_ranks(_new_pass_worker, 1, timeout=120)[0]
    assert len(seen) == 3 and not any(seen), seen


def _learned_weights_batches(rank: int, n: int) -> list[KeyedJaggedTensor]:
    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(10 * s + rank)
        lengths = torch.randint(0, 4, (3,), generator=g)
        w = torch.rand(int(lengths.sum()), generator=g).requires_grad_(rank == 0 and s == 2)
        out.append(KeyedJaggedTensor.from_lengths_sync(["a"], torch.randint(0, 20, (int(lengths.sum()),), generator=g),
                                                       lengths, weights=w))
    return out


class _WeightedStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=20, embedding_dim=4,
                                                              feature_names=["a"])], is_weighted=True,
                                          optimizer=FusedOptimizerConfig("sgd", lr=0.1))

    def forward(self, kjt):
        y = self.ebc(kjt).values().sum()
        return y, y.detach()


def _learned_weights_in_batch_worker(rank, W):
    torch.manual_seed(0)
    model = _WeightedStep()
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, {"t": row_wise()}, world_size=W,
                                                               local_size=W)})
    dmp = DistributedModelParallel(model, plan=plan, device="cpu", timeout=30)
    pipeline = TrainPipelineSparseDist(dmp, None, "cpu")
    try:
        _pipelined_steps(pipeline, iter(_learned_weights_batches(rank, 4)))
        return None
    except ValueError as e:
        return str(e)
    finally:
        pipeline.close()


def test_learned_weights_in_the_batch_are_refused_on_every_rank():
    """Batch weights that require a gradient (rank 0's 3rd batch) were routed ahead under no_grad: the plain loop
    gives them a gradient, the pipeline silently none. Now every rank raises, naming the fix."""
    texts = run_ranks(_learned_weights_in_batch_worker, 2, timeout=120)
    assert "require a gradient" in texts[0] and "inside the model's forward" in texts[0]
    assert "rank(s) [0]" in texts[1]


def _scores_a_catalogue_worker(rank, W):
    from lightning_rec import DLRMModule
    from lightning_rec.strategy import RecStrategy

    class Catalogue(DLRMModule):
        """Embeds ids of its own at each validation's start, as TwoTowerModule embeds its item catalogue."""

        def on_validation_epoch_start(self):
            super().on_validation_epoch_start()
            ids = torch.arange(NUM_F * 3) % 64
            kjt = KeyedJaggedTensor.from_lengths_sync(KEYS, ids, torch.ones(NUM_F * 3, dtype=torch.int64))
            with torch.no_grad():
                self.model.sparse_arch.embedding_bag_collection(kjt)

    class Stats(L.Callback):
        def on_train_end(self, trainer, pl_module):
            loader = trainer.fit_loop._combined_loader.flattened[0]
            self.train = [dict(p.stats) for p in trainer.strategy._pipelines if p.loader is loader]

    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=64, batch_size=64,
                                     num_sparse_features=NUM_F, num_embeddings_per_feature=64, num_signal_features=2)
    stats = Stats()
    trainer = L.Trainer(strategy=RecStrategy(pipeline=True), accelerator="cpu", devices=W, max_epochs=1,
                        val_check_interval=1, limit_val_batches=1, num_sanity_val_steps=0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[stats])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Catalogue(**SMALL), data)
    return [str(w.message) for w in caught if "cannot route their ids ahead" in str(w.message)], stats.train


def test_a_validation_between_the_first_steps_leaves_the_training_pipeline_alone():
    """Lightning's loop takes a batch ahead, so the training pipeline's recording (which KJT of the batch each
    collection reads) stayed open until the third batch was taken; a validation after the first step
    (val_check_interval=1) that embedded ids of its own (TwoTowerModule's item catalogue) was charged to it:
    a warning that the collection "was called with a KeyedJaggedTensor that is not part of the batch", and its
    calls counted as training inputs routed in the step. The recording now ends with the step."""
    said, train = run_ranks(_scores_a_catalogue_worker, 1, timeout=120)[0]
    assert said == [] and train == [{"routed_ahead": 3, "routed_in_step": 1}], (said, train)


def _two_train_loaders_worker(rank, W):
    from lightning_rec import DLRMModule
    from lightning_rec.strategy import RecStrategy

    class TwoLoaders(DLRMModule):
        """Trains on a batch of each of two loaders; its batch hook sees (and scales) the batch that holds both."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hook_saw = []

        def on_after_batch_transfer(self, batch, dataloader_idx):
            self.hook_saw.append(sorted(batch) if isinstance(batch, dict) else type(batch).__name__)
            return {k: Batch(b.dense_features * 0.5, b.sparse_features, b.labels) for k, b in batch.items()}

        def training_step(self, batch, batch_idx):
            return self._loss(batch["clicks"])[0] + self._loss(batch["more"])[0]

    class Data(SyntheticCriteoDataModule):
        def train_dataloader(self):
            return {"clicks": super().train_dataloader(), "more": super().train_dataloader()}

    class Stats(L.Callback):
        def on_train_end(self, trainer, pl_module):
            self.seen = [dict(p.stats) for p in trainer.strategy._pipelines]

    out = {}
    for pipeline in (False, True):
        L.seed_everything(0)
        stats = Stats()
        data = Data(num_train_samples=128, num_val_samples=64, batch_size=64, num_sparse_features=NUM_F,
                    num_embeddings_per_feature=64, num_signal_features=2)
        module = TwoLoaders(**SMALL)
        # (a feeder thread: inline, the batch Lightning takes ahead of the first step would route in its step)
        trainer = L.Trainer(strategy=RecStrategy(pipeline=pipeline and {"read_ahead": "thread"}), accelerator="cpu",
                            devices=W, max_epochs=1, limit_val_batches=0, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, callbacks=[stats])
        trainer.fit(module, data)
        out[pipeline] = module.hook_saw, _weights(module.model), stats.seen
    return out


def test_two_training_loaders_run_the_batch_hooks_once_on_the_batch_that_holds_both():
    """Training on a dict of two loaders (Lightning combines their batches into one), the feeder ran each loader's
    batch through the batch hooks, and the loop ran them again on the combined batch: on_after_batch_transfer
    was called 3 times a step, with the wrong batch twice, and its change applied twice (other losses and weights
    than the plain loop's). The loop now runs them once, on the combined batch, as in the plain loop."""
    out = run_ranks(_two_train_loaders_worker, 1, timeout=120)[0]
    (plain_saw, plain_w, _), (piped_saw, piped_w, stats) = out[False], out[True]
    assert plain_saw == piped_saw == [["clicks", "more"]] * 2, piped_saw
    assert all(torch.equal(plain_w[k], piped_w[k]) for k in plain_w)
    assert stats == [{"routed_ahead": 1, "routed_in_step": 1}] * 2  # each loader's ids are still routed ahead


class _DenseFirst(Step):
    """Its first step trains the dense part alone (a warm-up): no sharded collection is called."""

    def forward(self, batch: Batch):
        if self.calls == 0:
            self.calls += 1
            logits = self.dlrm.dense_arch(batch.dense_features).sum(1)
            return F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum"), logits
        return super().forward(batch)


def _dense_first_worker(rank, W):
    torch.manual_seed(0)
    dmp = DistributedModelParallel(_DenseFirst(), device="cpu", timeout=30)
    opt = CombinedOptimizer([("fused", dmp.fused_optimizer),
                             ("dense", torch.optim.SGD([p for p in dmp.parameters() if p.requires_grad], lr=0.02))])
    with TrainPipelineSparseDist(dmp, opt, "cpu") as pipeline:
        passes = []
        for _ in range(2):
            before = pipeline.stats["routed_ahead"]
            _pipelined_steps(pipeline, iter(_loader(rank, 4)))
            passes.append(pipeline.stats["routed_ahead"] - before)
        return passes


def test_a_first_step_without_embeddings_does_not_leave_every_later_pass_unpipelined():
    """The pipeline learns from its first step which KJT of the batch each collection reads. A first step that
    called no collection (a dense warm-up) left an empty plan for good: every batch of every later pass was routed
    in the step, without a word. A pass whose recording saw no collection now records again on the next pass."""
    assert run_ranks(_dense_first_worker, 1, timeout=120)[0] == [2, 4]


def _one_loader_for_both_worker(rank, W, pipeline):
    from lightning_rec import DLRMModule
    from lightning_rec.strategy import RecStrategy

    class SameLoader(SyntheticCriteoDataModule):
        def train_dataloader(self):
            if not hasattr(self, "loader"):
                self.loader = super().train_dataloader()
            return self.loader

        def val_dataloader(self):
            return self.train_dataloader()

    L.seed_everything(0)
    data = SameLoader(num_train_samples=256, num_val_samples=64, batch_size=64, num_sparse_features=NUM_F,
                      num_embeddings_per_feature=64, num_signal_features=2)
    module = DLRMModule(**SMALL)
    trainer = L.Trainer(strategy=RecStrategy(pipeline=pipeline), accelerator="cpu", devices=W, max_epochs=2,
                        val_check_interval=2, limit_val_batches=1, use_distributed_sampler=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, data)
    return trainer.global_step, _weights(module.model)


def test_one_loader_object_for_training_and_validation_trains_every_batch():
    """The same DataLoader object as train and val loader (train_dataloaders=dl, val_dataloaders=dl): each loop's
    wrapper kept its state on the loader, so the validation loop's replaced the training loop's, and pipelined
    the validation passes stopped the training pass's feeder: epochs ended early, 6 steps of 8 (14 of 24 in 3
    epochs), silently. Each loop now gets a copy of the loader of its own."""
    (plain_steps, plain_w), = run_ranks(_one_loader_for_both_worker, 1, False, timeout=120)
    (piped_steps, piped_w), = run_ranks(_one_loader_for_both_worker, 1, True, timeout=120)
    assert plain_steps == piped_steps == 8
    assert all(torch.equal(plain_w[k], piped_w[k]) for k in plain_w)


def _three_batches_a_step_worker(rank, W):
    from lightning_rec import DLRMModule
    from lightning_rec.strategy import RecStrategy

    class ThreeAStep(DLRMModule):
        def training_step(self, dataloader_iter):
            batches = [next(dataloader_iter)[0] for _ in range(3)]  # (batch, batch_idx, dataloader_idx)
            return sum(self._loss(b)[0] for b in batches)

    class Stats(L.Callback):
        def on_train_end(self, trainer, pl_module):
            self.seen = [dict(p.stats) for p in trainer.strategy._pipelines]

    out = {}
    for pipeline in (False, True):
        L.seed_everything(0)
        stats = Stats()
        data = SyntheticCriteoDataModule(num_train_samples=576, num_val_samples=64, batch_size=64,
                                         num_sparse_features=NUM_F, num_embeddings_per_feature=64,
                                         num_signal_features=2)
        module = ThreeAStep(**SMALL)
        # (a feeder thread: inline, the batch Lightning takes ahead of the first step would route in its step)
        trainer = L.Trainer(strategy=RecStrategy(pipeline=pipeline and {"read_ahead": "thread"}), accelerator="cpu",
                            devices=W, max_epochs=1, limit_val_batches=0, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, callbacks=[stats])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, data)
        said = [str(w.message) for w in caught if "cannot route their ids ahead" in str(w.message)]
        out[pipeline] = trainer.global_step, _weights(module.model), stats.seen, said
    return out


def test_a_step_that_takes_three_batches_is_pipelined():
    """training_step(dataloader_iter) taking 3 batches before its forward: the pipeline's recording ended when the
    third was taken, before any forward had shown which KJT each collection reads, and the first batch was let go
    before its forward: nothing was routed ahead in any pass, silently. Now the recording ends with the step, a
    batch taken while it runs routes in the step, and the step's batches stay registered until it ends."""
    out = run_ranks(_three_batches_a_step_worker, 1, timeout=120)[0]
    (plain_steps, plain_w, _, _), (piped_steps, piped_w, stats, said) = out[False], out[True]
    assert plain_steps == piped_steps == 3 and said == []
    assert all(torch.equal(plain_w[k], piped_w[k]) for k in plain_w)
    assert stats == [{"routed_ahead": 7, "routed_in_step": 2}], stats  # the first step's first two in the step


def test_find_kjts_reads_a_batch_class_with_slots():
    """A batch class with __slots__ (attrs' @define makes one) has no __dict__: its KJT was not found, so the
    collection was called "with a KeyedJaggedTensor that is not part of the batch (computed inside the model, or
    replaced by a batch hook)", which it was not, and it was never pipelined."""

    class SlotsBatch:
        __slots__ = ("dense", "sparse")

        def __init__(self, dense, sparse):
            self.dense, self.sparse = dense, sparse

    kjt = KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1]), torch.tensor([1]))
    [(found, path)] = find_kjts({"b": SlotsBatch(torch.zeros(1, 1), kjt)})
    assert found is kjt and path_name(path) == "batch['b'].sparse"


def _one_loader_twice_worker(rank, W, pipeline):
    from lightning_rec import DLRMModule
    from lightning_rec.strategy import RecStrategy

    class TwoViews(SyntheticCriteoDataModule):
        def train_dataloader(self):
            loader = super().train_dataloader()
            return {"a": loader, "b": loader}

    class Module(DLRMModule):
        def training_step(self, batch, batch_idx):
            return self._loss(batch["a"])[0] + self._loss(batch["b"])[0]

    L.seed_everything(0)
    data = TwoViews(num_train_samples=256, num_val_samples=64, batch_size=64, num_sparse_features=NUM_F,
                    num_embeddings_per_feature=64, num_signal_features=2)
    module = Module(**SMALL)
    trainer = L.Trainer(strategy=RecStrategy(pipeline=pipeline), accelerator="cpu", devices=W, max_epochs=1,
                        limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(module, data)
    return trainer.global_step, _weights(module.model)


def test_one_loader_object_twice_in_a_training_dict_trains_every_batch():
    """{"a": loader, "b": loader}: the loop iterates the one object twice at once; pipelined at 2 ranks, each pass
    stopped the other's feeder, and every epoch ended at once: 0 steps trained, silently. Each entry now gets a copy
    of its own."""
    plain, piped = (run_ranks(_one_loader_twice_worker, 2, pipeline, timeout=120) for pipeline in (False, True))
    for (plain_steps, plain_w), (piped_steps, piped_w) in zip(plain, piped):
        assert plain_steps == piped_steps == 2
        assert all(torch.equal(plain_w[k], piped_w[k]) for k in plain_w)


def _train_eval_train_worker(rank, W):
    train, held_out = list(_loader(rank, 6)), list(_loader(rank, 2, seed=50))
    runs = []
    for pipelined in (False, True):
        model, dmp, opt = _build("row_wise", W)
        trained = []
        forward = model.forward

        def spy(batch, forward=forward, trained=trained, model=model):
            if model.training:
                trained.append(batch.labels.clone())
            return forward(batch)

        model.forward = spy
        it = iter(train)
        if pipelined:  # one pipeline for both, as its docstring allows: model.eval() runs the forward only
            pipeline = TrainPipelineSparseDist(dmp, opt, "cpu")
            _pipelined_steps(pipeline, it, 2)
            dmp.eval()
            _pipelined_steps(pipeline, iter(held_out))
            dmp.train()
            _pipelined_steps(pipeline, it)
            pipeline.close()
        else:
            _plain_steps(dmp, opt, it, 2)
            dmp.eval()
            with torch.no_grad():
                [dmp(b) for b in held_out]
            dmp.train()
            _plain_steps(dmp, opt, it)
        runs.append((trained, _weights(dmp)))
    (plain_seen, plain_w), (piped_seen, piped_w) = runs
    return (len(plain_seen), len(piped_seen), all(torch.equal(a, b) for a, b in zip(plain_seen, piped_seen)),
            all(torch.equal(plain_w[k], piped_w[k]) for k in plain_w))


def test_an_evaluation_pass_between_training_steps_skips_no_training_batch():
    """One TrainPipelineSparseDist for training and, between its steps, an evaluation over another iterator: the
    switch stopped the training pass's feeder and dropped the batch it had read ahead, so every evaluation cost
    one training batch, silently (5 of 6 trained). Its batches read ahead now come first when that iterator is
    given again."""
    assert run_ranks(_train_eval_train_worker, 1, timeout=120)[0] == (6, 6, True, True)


class _SkipsEmbeddings(Step):
    """Skips the sharded collections on some steps (the same on every rank): a dense-only step."""

    def __init__(self, skip_at: tuple[int, ...]) -> None:
        super().__init__()
        self.skip_at = skip_at

    def forward(self, batch: Batch):
        if self.calls + 1 in self.skip_at:
            self.calls += 1
            dense = self.dlrm.dense_arch(batch.dense_features)  # every dense parameter is used (DDP)
            sparse = dense.new_zeros(dense.shape[0], NUM_F, DIM)
            logits = self.dlrm.over_arch(self.dlrm.inter_arch(dense, sparse)).squeeze(1)
            return F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum"), logits
        return super().forward(batch)


def _skips_embeddings_worker(rank, W):
    runs = []
    for pipelined in (False, True):
        torch.manual_seed(0)
        model = _SkipsEmbeddings(skip_at=(1, 4))  # the pass's first step and a later one
        dmp = DistributedModelParallel(model, plan=_plan("row_wise", model, W), device="cpu", timeout=30)
        opt = CombinedOptimizer([("fused", dmp.fused_optimizer),
                                 ("dense", torch.optim.SGD([p for p in dmp.parameters() if p.requires_grad], lr=0.02))])
        it = iter(_loader(rank, 6))
        if pipelined:
            with TrainPipelineSparseDist(dmp, opt, "cpu") as pipeline:
                losses = _pipelined_steps(pipeline, it)
                stats = pipeline.stats
        else:
            losses, stats = [], None
            for batch in it:
                opt.zero_grad()
                loss, logits = dmp(batch)
                loss.backward()
                opt.step()
                losses.append(float(logits.detach().sum()))
        runs.append((losses, _weights(dmp), stats))
    (plain, plain_w, _), (piped, piped_w, stats) = runs
    return plain == piped, all(torch.equal(plain_w[k], piped_w[k]) for k in plain_w), stats


def test_a_step_without_embeddings_first_in_a_pass_leaves_it_pipelined_from_the_next_step():
    """A pass whose first step called no sharded collection (its forward skipped the embeddings for that batch) ran
    the whole pass unpipelined, silently (routed_ahead 0 of 6): the recording step saw nothing and the empty plan
    was final. Now the next step that calls a collection records, and the batches after it are routed ahead; a
    later step that skips the embeddings changes nothing. Bitwise the plain loop's losses and weights."""
    for same_losses, same_weights, stats in run_ranks(_skips_embeddings_worker, 2, timeout=120):
        assert same_losses and same_weights
        assert stats == {"routed_ahead": 3, "routed_in_step": 1}, stats


THREAD = PipelineConfig(read_ahead="thread")  # a feeder that reads ahead (inline reads nothing ahead to hand back)


def _read_ahead_handed_back_worker(rank, W):
    import itertools

    batches = list(_loader(rank, 10))
    runs = []
    for pipelined in (False, True):
        model, dmp, opt = _build("row_wise", W)
        trained = []
        forward = model.forward

        def spy(batch, forward=forward, trained=trained):
            trained.append(batch.labels.clone())
            return forward(batch)

        model.forward = spy
        it = iter(batches)
        if not pipelined:
            _plain_steps(dmp, opt, it)
            runs.append((trained, _weights(dmp), None))
            continue
        first = TrainPipelineSparseDist(dmp, opt, "cpu", THREAD)
        _pipelined_steps(first, it, 3)
        kept = first.close()  # the batch it read ahead: the plain loop takes it first
        returned = len(kept)
        _plain_steps(dmp, opt, itertools.chain(kept, it), 2)
        second = TrainPipelineSparseDist(dmp, opt, "cpu", THREAD)
        _pipelined_steps(second, it, 2)
        second.close()  # closed mid-pass: the next pipeline over this iterator starts with what it read ahead
        with TrainPipelineSparseDist(dmp, opt, "cpu", THREAD) as third:
            _pipelined_steps(third, it)
        with warnings.catch_warnings(record=True) as caught:  # a plain loop that skips a kept batch hears of it
            warnings.simplefilter("always")
            other = iter(_loader(rank, 4, seed=9))
            with TrainPipelineSparseDist(dmp, opt, "cpu", THREAD) as fourth:
                _pipelined_steps(fourth, other, 1)
            _plain_steps(dmp, opt, other, 2)
            fifth = TrainPipelineSparseDist(dmp, opt, "cpu", THREAD)  # let go mid-pass, no close(): drops its batch
            _pipelined_steps(fifth, iter(_loader(rank, 4, seed=11)), 1)
            del fifth
        said = [str(w.message) for w in caught if "read ahead" in str(w.message)]
        runs.append((trained[:10], _weights(dmp), (returned, said)))
    (plain_seen, _, _), (piped_seen, _, (returned, said)) = runs
    return (len(plain_seen), len(piped_seen), all(torch.equal(a, b) for a, b in zip(plain_seen, piped_seen)),
            returned, len(said), all("itertools.chain(pipeline.close(), it)" in w for w in said),
            "let go mid-pass, dropping 1 batch(es)" in said[-1])


def test_a_closed_or_dropped_pipeline_hands_back_the_batch_it_read_ahead():
    """A pipeline closed mid-pass (or let go) dropped the batch its feeder had read ahead, silently: a user
    alternating pipelined and plain steps over one iterator trained 8 of 10 batches. close() now returns the batches
    read ahead (the plain loop takes them first), and a pipeline over the same model given the same iterator starts
    with them; a plain training step while some are still kept says so once, naming the fix, and a pipeline let go
    mid-pass without close() says what it dropped."""
    for result in run_ranks(_read_ahead_handed_back_worker, 2, timeout=120):
        assert result == (10, 10, True, 1, 2, True, True), result


class _CountingSource:
    """An iterator over `batches` that says when its n-th batch has been read (by the feeder thread)."""

    def __init__(self, batches, n: int) -> None:
        import threading

        self.it, self.read, self.n, self.reached = iter(batches), 0, n, threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.it)
        self.read += 1
        if self.read >= self.n:
            self.reached.set()
        return batch


def _in_step_order_read_ahead_worker(rank, W):
    import itertools

    batches = list(_loader(rank, 8))
    model, dmp, opt = _build("row_wise", W)
    trained = []
    forward = model.forward

    def spy(batch):
        trained.append(batch.labels.clone())
        return forward(batch)

    model.forward = spy
    source = _CountingSource(batches, 3)
    config = PipelineConfig(feeder_collectives="in_step_order", read_ahead="thread")  # (inline reads nothing ahead)
    pipeline = TrainPipelineSparseDist(dmp, opt, "cpu", config)
    _pipelined_steps(pipeline, source, 2)
    assert source.reached.wait(30)  # the feeder has read batch 2 (its turn comes when a step asks for it)
    kept = pipeline.close()
    _plain_steps(dmp, opt, itertools.chain(kept, source))
    return len(trained), all(torch.equal(a, b.labels) for a, b in zip(trained, batches))


def test_in_step_order_close_hands_back_the_batch_read_before_its_turn():
    """feeder_collectives="in_step_order" (the default on NCCL at several ranks) reads and copies the next batch before
    its turn; a close() before that turn dropped it, silently (7 of 8 trained, pipelined then plain).
    It is handed back with the others read ahead."""
    assert run_ranks(_in_step_order_read_ahead_worker, 2, timeout=120) == [(8, True)] * 2


class _UnevenStream(torch.utils.data.IterableDataset):
    """Whole batches, of unknown count: rank 0 has 2, rank 1 has 3 (no empty batch to pad with)."""

    def __iter__(self):
        rank = torch.distributed.get_rank()
        yield from _loader(rank, 2 + rank)


def _uneven_stream_validate_worker(rank, W, pipeline):
    from lightning_rec import DLRMModule
    from lightning_rec.strategy import RecStrategy

    L.seed_everything(0)
    trainer = L.Trainer(strategy=RecStrategy(pipeline=pipeline), accelerator="cpu", devices=W, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(DLRMModule(**{**SMALL, "num_embeddings_per_feature": ROWS}),
                         torch.utils.data.DataLoader(_UnevenStream(), batch_size=None), verbose=False)
    return [str(w.message) for w in caught if "batches are skipped" in str(w.message)]


def test_pipelined_evaluation_that_skips_a_ranks_batches_names_the_evaluation_fix():
    """Evaluating over loaders of uneven length without an empty batch to pad with, the rank with more batches skips
    them. Plain, its warning named the evaluation fix (a dataset with `empty_batch()` scores every row); pipelined it
    gave only the training advice (drop_last, an even split), which loses rows in evaluation. Both now say it."""
    for pipeline in (False, True):
        said = run_ranks(_uneven_stream_validate_worker, 2, pipeline, timeout=120)
        assert said[0] == [] and len(said[1]) == 1 and "empty_batch()" in said[1][0], (pipeline, said)


def _persistent_workers_epochs_worker(rank, W):
    batches = list(_loader(rank, 6))
    loader = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=2, persistent_workers=True)
    runs = []
    for pipelined in (False, True):
        model, dmp, opt = _build("row_wise", W)
        trained = []
        forward = model.forward

        def spy(batch, forward=forward, trained=trained):
            trained.append(batch.labels.clone())
            return forward(batch)

        model.forward = spy
        pipeline = TrainPipelineSparseDist(dmp, opt, "cpu") if pipelined else None
        per_epoch = []
        for epoch in range(3):
            it = iter(loader)  # persistent workers: the same iterator object, reset
            n = 4 if epoch == 1 else None  # the middle epoch cut short
            per_epoch.append(len(_pipelined_steps(pipeline, it, n) if pipelined else _plain_steps(dmp, opt, it, n)))
        if pipeline is not None:
            pipeline.close()
        runs.append((per_epoch, trained, _weights(dmp)))
    (plain_n, plain_seen, plain_w), (piped_n, piped_seen, piped_w) = runs
    return (plain_n, piped_n, len(plain_seen) == len(piped_seen)
            and all(torch.equal(a, b) for a, b in zip(plain_seen, piped_seen)),
            all(torch.equal(plain_w[k], piped_w[k]) for k in plain_w))


def test_a_persistent_workers_loader_iterated_each_epoch_trains_every_epoch():
    """torch's DataLoader(persistent_workers=True) gives the same iterator object to every `iter(loader)`, reset.
    TrainPipelineSparseDist took it for the pass it had finished: epochs 2 and 3 trained 0 batches, silently; after an
    epoch cut short the reset ran under the feeder's reads (KeyError inside torch's iterator). Now the feeder stops
    before the reset and the next step starts a new pass: the plain loop's batches and weights, bitwise."""
    for plain_n, piped_n, same_batches, same_weights in run_ranks(_persistent_workers_epochs_worker, 2, timeout=180):
        assert plain_n == piped_n == [6, 4, 6] and same_batches and same_weights, (plain_n, piped_n)


def _loader_itself_worker(rank, W):
    loader, held_out = _loader(rank, 4), list(_loader(rank, 2, seed=50))
    runs = []
    for pipelined in (False, True):
        model, dmp, opt = _build("row_wise", W)
        trained = []
        forward = model.forward

        def spy(batch, forward=forward, trained=trained, model=model):
            if model.training:
                trained.append(batch.labels.clone())
            return forward(batch)

        model.forward = spy
        if pipelined:  # the DataLoader itself, not iter(dataloader): its epochs one after another
            pipeline = TrainPipelineSparseDist(dmp, opt, "cpu")
            _pipelined_steps(pipeline, loader, 2)
            dmp.eval()
            _pipelined_steps(pipeline, held_out)  # an evaluation between training steps
            dmp.train()
            _pipelined_steps(pipeline, loader)  # the rest of epoch 1
            _pipelined_steps(pipeline, loader)  # epoch 2
            pipeline.close()
        else:
            it = iter(loader)
            _plain_steps(dmp, opt, it, 2)
            dmp.eval()
            with torch.no_grad():
                [dmp(b) for b in held_out]
            dmp.train()
            _plain_steps(dmp, opt, it)
            _plain_steps(dmp, opt, iter(loader))
        runs.append((trained, _weights(dmp)))
    (plain_seen, plain_w), (piped_seen, piped_w) = runs
    return (len(plain_seen), len(piped_seen), all(torch.equal(a, b) for a, b in zip(plain_seen, piped_seen)),
            all(torch.equal(plain_w[k], piped_w[k]) for k in plain_w))


def test_progress_given_the_dataloader_itself_runs_its_epochs_one_after_another():
    """pipeline.progress(dataloader) (TorchRec passes iter(dataloader)) was taken as one pass for good: the second
    epoch trained 0 batches, and after an evaluation pass the epoch restarted from its first batch (7 steps where the
    plain loop takes 8, 3 of them on a batch trained before). Now the loader's passes run one after another, as
    `for batch in dataloader` each epoch: bitwise the plain loop."""
    assert run_ranks(_loader_itself_worker, 2, timeout=120) == [(8, 8, True, True)] * 2


def test_a_loss_that_is_not_a_tensor_and_a_device_without_cuda_are_named():
    """`return loss.item(), output` failed inside progress() with sum()'s TypeError; `TrainPipelineSparseDist(model,
    optimizer, "cuda")` on a CPU-only torch with torch's "Torch not compiled with CUDA enabled"."""

    class ReturnsAFloat(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 1)

        def forward(self, x):
            loss = self.linear(x).sum()
            return loss.item(), loss.detach()

    model = ReturnsAFloat()
    with TrainPipelineSparseDist(model, torch.optim.SGD(model.parameters(), lr=0.1), "cpu") as pipeline:
        with pytest.raises(TypeError, match=r"must be a tensor, but ReturnsAFloat returned a float .*not loss.item"):
            pipeline.progress(iter([torch.ones(3, 2)]))
    if torch.cuda.is_available():
        return
    with pytest.raises(ValueError, match=r"^CUDA is not available: TrainPipelineSparseDist\(device='cuda'\) needs a "
                                         r"CUDA GPU, but .*; or give the device the model's tables are on"):
        TrainPipelineSparseDist(model, None, "cuda")


def test_a_script_that_ends_with_its_pipeline_open_says_nothing(tmp_path):
    # a script's last pipeline, never closed, was collected at exit and warned that it "was let go mid-pass,
    # dropping 1 batch(es)": nothing runs after the script to take them
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dist_utils import free_port

    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\n"
        "import torch.distributed as dist\n"
        f"os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='{free_port()}')\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "from test_pipeline import _build, _loader, _pipelined_steps\n"
        "from lightning_rec import TrainPipelineSparseDist\n"
        "model, dmp, opt = _build('row_wise', 1)\n"
        "pipeline = TrainPipelineSparseDist(dmp, opt, 'cpu')\n"
        "_pipelined_steps(pipeline, iter(_loader(0, 4)), 1)\n"
        "print('stepped', flush=True)\n")
    here = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here)])})
    assert done.returncode == 0 and "stepped" in done.stdout, done.stderr[-2000:]
    assert "let go mid-pass" not in done.stderr, done.stderr[-2000:]
