"""PipelineConfig's variants: semi_sync (tables one update stale, as TorchRec's TrainPipelineSemiSync) and prefetch.

semi_sync is checked against a few-line loop that does by hand what it promises: batch i+1's embeddings are looked
up after batch i's forward and before its backward, so batch i reads the tables as they were before batch i-1's
update."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from dist_utils import run_ranks
from test_pipeline import NUM_F, SMALL, Step, _loader, _take, _weights

from lightning_rec.data.synthetic import SyntheticCriteoDataModule
from lightning_rec.model_parallel import (
    DistributedModelParallel,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from lightning_rec.optim import CombinedOptimizer
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
