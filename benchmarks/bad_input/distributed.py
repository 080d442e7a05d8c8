"""Two ranks: DistributedModelParallel, the pipeline and Trainer(strategy='rec') given uneven,
bad or disagreeing inputs. Each rank_* function runs on every rank (pickled by reference: module level)."""

from __future__ import annotations

import contextlib
import io
import os
import warnings

from .helpers import T, _t, kjt_lengths, make_ebc
from .ranks import _dmp_of, _fast_guard, _outcome, _rank_batches, _threads, _verbs, raise_first_error, run_two_ranks
from .registry import case, expect, simple

SMOKE = ("dmp.gloo.negative_timeout",)


def rank_uneven_batches(rank, W, kind, shm):
    """Each rank's output must equal the unsharded module on its own batch; after one SGD step the
    gathered tables must equal the unsharded step on both batches."""
    _threads()
    torch = _t()
    ebc = make_ebc()
    ref = make_ebc()
    dmp = _dmp_of(ebc, _verbs(kind), W, shm)

    def go():
        k = _rank_batches(rank)
        out = dmp(k)
        expect(torch.allclose(out.values(), ref(k).values(), atol=1e-6), f"rank {rank} output differs from unsharded")
        return True
    return _outcome(go)


def rank_one_bad_id(rank, W, shm):
    _threads()
    _fast_guard()
    ebc = make_ebc()
    dmp = _dmp_of(ebc, _verbs("rw"), W, shm)

    def go():
        k = _rank_batches(0)
        if rank == 1:
            k = kjt_lengths(["a", "b"], [1, 2, 3, 99], [2, 1, 1, 0])
        dmp(k).values().sum().backward()
    return _outcome(go)


def rank_one_raises_then_barrier(rank, W, shm):
    _threads()
    _fast_guard()
    import torch.distributed as dist
    ebc = make_ebc()
    dmp = _dmp_of(ebc, _verbs("tw"), W, shm, timeout=60)

    def go():
        if rank == 1:
            try:
                raise RuntimeError("user code failed on rank 1")
            except RuntimeError:
                pass
            dist.barrier()
            return "rank 1 at its barrier"
        dmp(_rank_batches(0)).values().sum().backward()
    return _outcome(go)


def rank_one_exits(rank, W, shm):
    _threads()
    ebc = make_ebc()
    dmp = _dmp_of(ebc, _verbs("tw"), W, shm, timeout=60)
    if rank == 1:
        os._exit(3)

    def go():
        dmp(_rank_batches(0)).values().sum().backward()
    return _outcome(go)


def rank_different_plans(rank, W, shm):
    _threads()
    ebc = make_ebc()
    return _outcome(lambda: _dmp_of(ebc, _verbs("tw" if rank == 0 else "rw"), W, shm))


def rank_different_tables(rank, W, shm):
    _threads()
    ebc = make_ebc(rows=(10, 6) if rank == 0 else (10, 7))
    return _outcome(lambda: _dmp_of(ebc, _verbs("tw"), W, shm))


def rank_missing_feature(rank, W, shm):
    _threads()
    _fast_guard()
    ebc = make_ebc()
    dmp = _dmp_of(ebc, _verbs("tw"), W, shm)

    def go():
        k = _rank_batches(0) if rank == 0 else kjt_lengths(["a"], [1, 2], [1, 1])
        dmp(k).values().sum().backward()
    return _outcome(go)


def rank_extra_step(rank, W, shm):
    _threads()
    _fast_guard()
    import torch.distributed as dist
    dmp = _dmp_of(make_ebc(), _verbs("rw"), W, shm, timeout=60)

    def go():
        for _ in range(2 if rank == 0 else 1):
            dmp(_rank_batches(rank)).values().sum().backward()
        dist.barrier()
    return _outcome(go)


def rank_empty_batch(rank, W, shm):
    _threads()
    torch = _t()
    ebc, ref = make_ebc(), make_ebc()
    dmp = _dmp_of(ebc, _verbs("rw"), W, shm)

    def go():
        k = _rank_batches(0) if rank == 0 else kjt_lengths(["a", "b"], T([], torch.int64), T([], torch.int64))
        out = dmp(k)
        expect(torch.allclose(out.values(), ref(k).values()), f"rank {rank} output wrong")
        out.values().sum().backward()
        return tuple(out.values().shape)
    return _outcome(go)


def rank_nan_weight(rank, W, shm):
    _threads()
    _fast_guard()
    dmp = _dmp_of(make_ebc(weighted=True), _verbs("tw"), W, shm)

    def go():
        w = T([1.0, 1.0, 1.0, float("nan") if rank == 1 else 1.0])
        dmp(kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0], weights=w)).values().sum().backward()
    return _outcome(go)


def rank_bad_timeout(rank, W, shm):
    _threads()
    from lightning_rec import DistributedModelParallel, ShardingPlan, construct_module_sharding_plan
    ebc = make_ebc()
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, _verbs("tw"), world_size=W)})
    return _outcome(lambda: DistributedModelParallel(ebc, plan=plan, device="cpu", timeout=-1, shared_memory=shm))


def rank_plan_rank_out_of_world(rank, W, shm):
    _threads()
    from lightning_rec import table_wise
    return _outcome(lambda: _dmp_of(make_ebc(), {"t_a": table_wise(rank=0), "t_b": table_wise(rank=3)}, W, shm))


def rank_pipeline_bad_model_output(rank, W, shm):
    _threads()
    torch = _t()
    from lightning_rec import TrainPipelineSparseDist
    from lightning_rec.data import Batch

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = make_ebc()

        def forward(self, batch):
            return self.ebc(batch.sparse_features).values().sum()  # not (loss, output)

    from lightning_rec import DistributedModelParallel, ShardingPlan, construct_module_sharding_plan
    m = M()
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(m.ebc, _verbs("tw"), world_size=W)})
    dmp = DistributedModelParallel(m, plan=plan, device="cpu", timeout=20, shared_memory=shm, dense=None)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    batches = [Batch(dense_features=torch.zeros(2, 1), sparse_features=_rank_batches(0), labels=torch.zeros(2))] * 2

    def go():
        with TrainPipelineSparseDist(dmp, opt, "cpu") as p:
            it = iter(batches)
            p.progress(it)
    return _outcome(go)


def rank_trainer_uneven_loaders(rank, W, pipeline=False):
    """Trainer(strategy='rec') at 2 ranks, rank 1's loader 2 batches shorter: the epoch ends together."""
    _threads()
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from lightning_rec import DLRMModule
    from lightning_rec.data import Batch
    torch = _t()

    class DM(L.LightningDataModule):
        def train_dataloader(self):
            n = 6 if rank == 0 else 4
            g = torch.Generator().manual_seed(rank)
            batches = []
            for _ in range(n):
                k = kjt_lengths(["c1", "c2"], torch.randint(0, 20, (16,), generator=g), [1] * 16)
                batches.append(Batch(torch.rand(8, 3, generator=g), k, (torch.rand(8, generator=g) > 0.5).float()))
            return DataLoader(batches, batch_size=None)

    m = DLRMModule(num_embeddings_per_feature=20, embedding_dim=4, sparse_feature_names=["c1", "c2"],
                   dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[8, 1], dense_in_features=3)

    def go():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                from lightning_rec import RecStrategy
                trainer = L.Trainer(strategy=RecStrategy(pipeline=pipeline), accelerator="cpu", devices=W,
                                    max_epochs=1, logger=False,
                                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
                trainer.fit(m, DM())
        return trainer.global_step
    return _outcome(go)


def rank_trainer_uneven_pipelined(rank, W):
    """The same with RecStrategy(pipeline=True): the feeder keeps the ranks stepping together."""
    return rank_trainer_uneven_loaders(rank, W, pipeline=True)


def rank_mixed_id_dtypes(rank, W, kind, shm):
    """Rank 0 sends int64 ids, rank 1 int32 (and keys in another order): outputs equal the unsharded module."""
    _threads()
    torch = _t()
    ebc, ref = make_ebc(), make_ebc()
    dmp = _dmp_of(ebc, _verbs(kind), W, shm)

    def go():
        if rank == 0:
            k = kjt_lengths(["a", "b"], T([1, 2, 3, 0]), [2, 1, 1, 0])
        else:
            k = kjt_lengths(["b", "a"], T([5, 9, 4, 4], torch.int32), T([1, 0, 2, 1], torch.int32))
        out = dmp(k)
        r = ref(k)
        for key in ("a", "b"):
            expect(torch.allclose(out[key], r[key], atol=1e-6), f"rank {rank}: feature {key} differs from unsharded")
        return True
    return _outcome(go)


def rank_trainer_rank_raises(rank, W):
    """Rank 1's training_step raises at step 2: rank 0 must hear of it within seconds, not wait 300 s."""
    _threads()
    _fast_guard()
    import lightning.pytorch as L

    from lightning_rec import DLRMModule, SyntheticCriteoDataModule

    class Raises(DLRMModule):
        def training_step(self, batch, batch_idx):
            if rank == 1 and batch_idx == 2:
                raise RuntimeError("rank 1's training_step failed (user code)")
            return super().training_step(batch, batch_idx)

    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_samples=1024, num_val_samples=128, batch_size=64,
                                     num_embeddings_per_feature=32)
    m = Raises(num_embeddings_per_feature=32, embedding_dim=4, dense_arch_layer_sizes=[8, 4],
               over_arch_layer_sizes=[8, 1])

    def go():
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            trainer = L.Trainer(strategy="rec", accelerator="cpu", devices=W, max_epochs=1, logger=False,
                                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                                num_sanity_val_steps=0, limit_val_batches=0)
            trainer.fit(m, data)
    out = _outcome(go)
    if rank == 1:
        os._exit(0)  # as a crashed rank would: gone without a goodbye
    return out


def rank_trainer_planner_impossible(rank, W):
    _threads()
    import lightning.pytorch as L

    from lightning_rec import DLRMModule, EmbeddingShardingPlanner, RecStrategy, SyntheticCriteoDataModule, Topology
    data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=64, batch_size=64,
                                     num_embeddings_per_feature=1000)
    m = DLRMModule(num_embeddings_per_feature=1000, embedding_dim=8, dense_arch_layer_sizes=[8],
                   over_arch_layer_sizes=[8, 1])
    planner = EmbeddingShardingPlanner(Topology(world_size=W, ddr_cap=10_000), print_stats=False)

    def go():
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            trainer = L.Trainer(strategy=RecStrategy(planner=planner), accelerator="cpu", devices=W, max_steps=1,
                                logger=False, enable_progress_bar=False, enable_model_summary=False,
                                enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0)
            trainer.fit(m, data)
    return _outcome(go)


def dmp_rank_cases() -> None:
    """Per transport (gloo, shared memory): uneven batches, a bad id, a failing or missing rank."""
    for shm in (False, True):
        tag = "shm" if shm else "gloo"

        for kind in ("tw", "rw", "cw"):
            @case(f"dmp.{tag}.{kind}.different_batch_sizes_per_rank", timeout=60,
                  legit="ranks may have different batch sizes (TorchRec's variable stride across ranks)")
            def _(ctx, shm=shm, kind=kind):
                raise_first_error(run_two_ranks(rank_uneven_batches, kind, shm))

        @case(f"dmp.{tag}.rank1_bad_id", ValueError, ["'b'", "t_b", "99"], timeout=60)
        def _(ctx, shm=shm):
            out = run_two_ranks(rank_one_bad_id, shm)
            raise_first_error(out, need_all=True, max_s=15)

        @case(f"dmp.{tag}.rank1_raises_then_barrier", Exception, ["rank 1", "barrier"], timeout=60)
        def _(ctx, shm=shm):
            out = run_two_ranks(rank_one_raises_then_barrier, shm)
            raise_first_error(out, max_s=20)

        @case(f"dmp.{tag}.rank1_exits", Exception, ["rank 1"], timeout=60)
        def _(ctx, shm=shm):
            out = run_two_ranks(rank_one_exits, shm)
            raise_first_error(out, max_s=20)

        @case(f"dmp.{tag}.different_plans", ValueError, ["t_a"], timeout=60)
        def _(ctx, shm=shm):
            raise_first_error(run_two_ranks(rank_different_plans, shm), need_all=True)

        @case(f"dmp.{tag}.rank1_missing_feature", ValueError, ["'b'"], timeout=60)
        def _(ctx, shm=shm):
            raise_first_error(run_two_ranks(rank_missing_feature, shm), need_all=True, max_s=15)

        @case(f"dmp.{tag}.rank0_extra_step", Exception, ["rank"], timeout=60)
        def _(ctx, shm=shm):
            raise_first_error(run_two_ranks(rank_extra_step, shm), max_s=20)

        @case(f"dmp.{tag}.rank1_nan_weight", ValueError, ["'b'", "t_b", "nan"], timeout=60)
        def _(ctx, shm=shm):
            raise_first_error(run_two_ranks(rank_nan_weight, shm), need_all=True, max_s=15)


def dmp_plan_cases() -> None:
    """Tables, timeouts and plans the ranks disagree on; the pipeline; uneven loaders."""
    @case("dmp.gloo.different_table_sizes", ValueError, ["t_b", "6", "7"], timeout=60)
    def _(ctx):
        raise_first_error(run_two_ranks(rank_different_tables, False), need_all=True)

    @case("dmp.shm.empty_batch_on_one_rank", ValueError, ["batch"], ok=True, timeout=60,
          legit="a rank with no samples this step is a valid (if odd) step: [0, D] out")
    def _(ctx):
        raise_first_error(run_two_ranks(rank_empty_batch, True))

    @case("dmp.gloo.negative_timeout", ValueError, ["timeout"], timeout=60)
    def _(ctx):
        raise_first_error(run_two_ranks(rank_bad_timeout, False))

    @case("dmp.gloo.plan_rank_out_of_world", ValueError, ["t_b", "3"], timeout=60)
    def _(ctx):
        raise_first_error(run_two_ranks(rank_plan_rank_out_of_world, False))

    @case("pipeline.model_returns_scalar", (ValueError, TypeError), ["(loss, output)"], timeout=60)
    def _(ctx):
        raise_first_error(run_two_ranks(rank_pipeline_bad_model_output, True))

    @case("trainer.rec_loaders_end_at_different_steps", timeout=120,
          legit="README: the epoch ends for all ranks when one runs out, with a warning")
    def _(ctx):
        steps = raise_first_error(run_two_ranks(rank_trainer_uneven_loaders, timeout=110))
        # Lightning's distributed sampler splits each rank's list again: 3 and 2 batches; both stop at 2
        expect(steps[0] == steps[1] == 2, f"global steps {steps}")

    @case("trainer.rec_pipelined_loaders_end_at_different_steps", timeout=120,
          legit="README: the pipeline's feeder keeps the ranks stepping together")
    def _(ctx):
        steps = raise_first_error(run_two_ranks(rank_trainer_uneven_pipelined, timeout=110))
        expect(steps[0] == steps[1] == 2, f"global steps {steps}")


def more_dmp_cases() -> None:
    """Second wave: int32 ids and another key order on one rank."""
    for kind in ("tw", "rw", "cw"):
        @case(f"dmp.shm.{kind}.int32_ids_and_other_key_order_on_one_rank", timeout=60,
              legit="each rank's KJT is valid on its own: id dtype and key order may differ between ranks")
        def _(ctx, kind=kind):
            raise_first_error(run_two_ranks(rank_mixed_id_dtypes, kind, True))

    @case("dmp.gloo.rw.int32_ids_and_other_key_order_on_one_rank", timeout=60,
          legit="each rank's KJT is valid on its own")
    def _(ctx):
        raise_first_error(run_two_ranks(rank_mixed_id_dtypes, "rw", False))


def two_rank_trainer_cases() -> None:
    """Trainer(strategy='rec'): a rank that raises, a plan that cannot fit."""
    @case("trainer.rank1_raises_in_training_step", Exception, ["rank 1"], timeout=120)
    def _(ctx):
        out = run_two_ranks(rank_trainer_rank_raises, timeout=110)
        r0 = out[0]
        expect(r0 is not None and r0[0] == "error", f"rank 0 went on without an error: {r0}")
        raise_first_error([r0], max_s=60)

    @case("trainer.planner_cannot_fit", ValueError, ["t_C", "ddr_cap"], timeout=120)
    def _(ctx):
        raise_first_error(run_two_ranks(rank_trainer_planner_impossible, timeout=110), need_all=True)


def _tower_dmp(W, shm):
    """model(kjt) -> (loss, output) over make_ebc(), sharded; the user's forward raises at call `fail_at`."""
    torch = _t()
    from lightning_rec import DistributedModelParallel, ShardingPlan, construct_module_sharding_plan

    class Tower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc, self.dense, self.fail_at, self.calls = make_ebc(), torch.nn.Linear(8, 1), -1, 0

        def forward(self, kjt):
            self.calls += 1
            if self.calls == self.fail_at:
                raise KeyError("the user's forward, before the embeddings")
            out = self.dense(self.ebc(kjt).values()).sum()
            return out, out.detach()

    m = Tower()
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(m.ebc, _verbs("rw"), world_size=W)})
    dmp = DistributedModelParallel(m, plan=plan, device="cpu", timeout=20, shared_memory=shm)
    return m, dmp, torch.optim.SGD([p for p in dmp.parameters() if p.requires_grad], lr=0.1)


def rank_step_raised_went_on(rank, W, shm, pipelined, read_ahead="thread", sized=False):
    """Rank 1's third step raises before the embeddings; its hand-written loop catches it and goes on.
    sized: the batches come from a DataLoader with a length (the ranks agree on it once, not before each batch)."""
    _threads()
    _fast_guard()
    m, dmp, opt = _tower_dmp(W, shm)
    m.fail_at = 3 if rank == 1 else -1
    batches = [_rank_batches(0) for _ in range(5)]

    def go():
        from lightning_rec import PipelineConfig, TrainPipelineSparseDist
        config = PipelineConfig(read_ahead=read_ahead)
        source = _t().utils.data.DataLoader(batches, batch_size=None, collate_fn=_same) if sized else batches
        pipeline, it = (TrainPipelineSparseDist(dmp, opt, "cpu", config), iter(source)) if pipelined else (None, None)
        for b in batches:
            try:
                if pipelined:
                    pipeline.progress(it)
                else:
                    opt.zero_grad()
                    dmp(b)[0].backward()
                    opt.step()
            except KeyError:
                pass
    return _outcome(go)


def _same(batch):
    return batch


def rank_loader_gives_none(rank, W, sized=False):
    """A collate_fn that returns None for a bad batch: rank 1's batch 2. sized: from a DataLoader with a length."""
    _threads()
    if sized:
        _fast_guard()
    _, dmp, opt = _tower_dmp(W, None)
    batches = [_rank_batches(0) for _ in range(5)]
    if rank == 1:
        batches[2] = None

    def go():
        from lightning_rec import TrainPipelineSparseDist
        with TrainPipelineSparseDist(dmp, opt, "cpu") as p:
            it = iter(_t().utils.data.DataLoader(batches, batch_size=None, collate_fn=_same) if sized else batches)
            while True:
                try:
                    p.progress(it)
                except StopIteration:
                    return
    return _outcome(go)


def pipeline_step_cases() -> None:
    """Hand-written loops over the pipeline or DistributedModelParallel: a rank that goes on, a None batch, a loss
    that is a float, a device without CUDA."""
    for shm, pipelined, tag in ((False, False, "dmp.gloo"), (None, False, "dmp.shm"), (None, True, "pipeline.shm")):
        @case(f"{tag}.rank1_step_raised_and_went_on", Exception, ["rank 0 at step 3, rank 1 at step 4", "went on"],
              timeout=60)
        def _(ctx, shm=shm, pipelined=pipelined):
            raise_first_error(run_two_ranks(rank_step_raised_went_on, shm, pipelined), need_all=True, max_s=15)

    @case("pipeline.gloo.rank1_step_raised_and_went_on", Exception, ["rank 0 at step 3, rank 1 at step 2", "went on"],
          timeout=60)
    def _(ctx):  # over a process group: the id exchange of the next batch carries the steps that reached theirs
        raise_first_error(run_two_ranks(rank_step_raised_went_on, False, True), need_all=True, max_s=15)

    # inline read-ahead (the default where the ranks leave no core spare): rank 1's feeder waits for the next batch's
    # agreement while rank 0 waits in the step's all-to-all; the guard names both waits and the fix, not the steps
    for shm, tag in ((None, "shm"), (False, "gloo")):
        @case(f"pipeline.{tag}.inline.rank1_step_raised_and_went_on", Exception,
              ["every rank has a batch", "pooled embedding all-to-all", "goes on"], timeout=60)
        def _(ctx, shm=shm):
            raise_first_error(run_two_ranks(rank_step_raised_went_on, shm, True, "inline"), need_all=True, max_s=15)

    # a loader with a length: no agreement before each batch. A feeder thread's id exchange names the steps that
    # parted; inline, the guard names rank 1's id exchange against rank 0's embedding exchange
    for shm, tag in ((None, "shm"), (False, "gloo")):
        for read_ahead, words in (("thread", ["went on"]), ("inline", ["pooled embedding all-to-all", "goes on"])):
            @case(f"pipeline.{tag}.{read_ahead}.sized.rank1_step_raised_and_went_on", Exception, words, timeout=60)
            def _(ctx, shm=shm, read_ahead=read_ahead):
                raise_first_error(run_two_ranks(rank_step_raised_went_on, shm, True, read_ahead, True), need_all=True,
                                  max_s=15)

    @case("pipeline.loader_gives_none_on_rank1", RuntimeError, ["rank(s) [1]", "batch 2"], timeout=60)
    def _(ctx):
        out = run_two_ranks(rank_loader_gives_none)
        expect(out[1] is not None and out[1][0] == "error" and "gave None as batch 2" in out[1][2],
               f"rank 1 did not name its None batch: {out[1]}")
        raise_first_error(out, need_all=True)

    # a loader with a length: no agreement names rank 1 to the others; rank 1 raises alone, and rank 0, waiting in
    # batch 2's exchange, hears that rank 1 left (as in the plain loop)
    @case("pipeline.sized.loader_gives_none_on_rank1", Exception, ["rank 1", "exited"], timeout=60)
    def _(ctx):
        out = run_two_ranks(rank_loader_gives_none, True)
        expect(out[1] is not None and out[1][0] == "error" and "gave None as batch 2" in out[1][2],
               f"rank 1 did not name its None batch: {out[1]}")
        raise_first_error([out[0]], need_all=True, max_s=15)

    def loss_item():
        torch = _t()
        from lightning_rec import TrainPipelineSparseDist

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(2, 1)

            def forward(self, x):
                loss = self.linear(x).sum()
                return loss.item(), loss.detach()

        m = M()
        with TrainPipelineSparseDist(m, torch.optim.SGD(m.parameters(), lr=0.1), "cpu") as p:
            p.progress(iter([torch.ones(3, 2)]))

    simple("pipeline.loss_is_a_float", loss_item, TypeError, ["loss", "must be a tensor", "loss.item()"])

    @case("pipeline.device_cuda_without_cuda", ValueError, ["CUDA is not available",
                                                            "TrainPipelineSparseDist(device='cuda')"], ok=True,
          legit="a machine with CUDA builds the pipeline")
    def _(ctx):
        torch = _t()
        from lightning_rec import TrainPipelineSparseDist
        TrainPipelineSparseDist(torch.nn.Linear(2, 1), None, "cuda").close()


CASES = (dmp_rank_cases, dmp_plan_cases, more_dmp_cases, two_rank_trainer_cases, pipeline_step_cases)
