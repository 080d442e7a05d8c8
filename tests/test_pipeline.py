"""TrainPipelineSparseDist and RecStrategy(pipeline=True) on 2 CPU ranks: parity with the plain loop, bad input.

Parity is bitwise (torch.equal): the pipeline routes the same ids with the same ops, only earlier
and on another channel, and the step's arithmetic (lookup, output dist, dense, fused update) runs
in the same order as in the plain loop. Batches come from a real DataLoader (the synthetic data
module), different on each rank.
"""

from __future__ import annotations

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
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.types import ShardingPlan

NUM_F, ROWS, DIM, BATCH = 4, 40, 8, 16
KEYS = [f"C{i}" for i in range(1, NUM_F + 1)]


class Step(nn.Module):
    """model(batch) -> (loss, logits), as TrainPipelineSparseDist expects; Python around the embeddings."""

    def __init__(self, inside_kjt: bool = False) -> None:
        super().__init__()
        tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=ROWS + 3 * i, embedding_dim=DIM,
                                     feature_names=[k]) for i, k in enumerate(KEYS)]
        ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.05))
        self.dlrm = DLRM(ebc, 13, [16, DIM], [16, 1])
        self.inside_kjt = inside_kjt
        self.fail_at = -1
        self.calls = 0

    def forward(self, batch: Batch):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("boom in the user's forward")
        kjt = batch.sparse_features
        if self.inside_kjt:  # a KJT the model builds itself: cannot be routed ahead
            kjt = KeyedJaggedTensor(kjt.keys(), kjt.values() % ROWS, lengths=kjt.lengths())
        dense = batch.dense_features * (2.0 if self.calls % 2 else 1.0)  # arbitrary Python around the embeddings
        logits = self.dlrm(dense, kjt).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum"), logits


def _loader(rank: int, batches: int, seed: int = 0):
    data = SyntheticCriteoDataModule(num_train_samples=batches * BATCH, num_val_samples=BATCH, batch_size=BATCH,
                                     num_sparse_features=NUM_F, num_embeddings_per_feature=ROWS, num_signal_features=2,
                                     seed=seed + 7 * rank, shuffle=False)
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


def _build(kind: str, W: int, inside_kjt: bool = False):
    torch.manual_seed(0)
    model = Step(inside_kjt)
    dmp = DistributedModelParallel(model, plan=_plan(kind, model, W), device="cpu", timeout=30)
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


def _parity_worker(rank, W, kind, steps):
    # plain: the loss each step and the weights at the end
    model, dmp, opt = _build(kind, W)
    plain_logit_sums = []
    for batch in _take(_loader(rank, steps), steps):
        opt.zero_grad()
        loss, logits = dmp(batch)
        loss.backward()
        opt.step()
        plain_logit_sums.append(float(logits.detach().sum()))
    plain = _weights(dmp)
    del model, dmp, opt
    model, dmp, opt = _build(kind, W)
    pipeline = TrainPipelineSparseDist(dmp, opt, "cpu")
    piped_logit_sums = _pipelined_steps(pipeline, iter(_loader(rank, steps)))
    pipeline.close()
    piped = _weights(dmp)
    assert piped_logit_sums == plain_logit_sums, (piped_logit_sums[:5], plain_logit_sums[:5])
    assert plain.keys() == piped.keys()
    bad = [k for k in plain if not torch.equal(plain[k], piped[k])]
    assert not bad, bad
    return len(piped_logit_sums)


def _take(loader, n):
    for i, b in enumerate(loader):
        if i == n:
            return
        yield b


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "planner"])
def test_pipelined_matches_plain_bitwise_over_50_steps(kind):
    assert run_ranks(_parity_worker, 2, kind, 50, timeout=240) == [50, 50]


def test_find_kjts_paths():
    kjt = KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1]), torch.tensor([1]))
    batch = {"x": (torch.zeros(1), Batch(torch.zeros(1, 1), kjt, torch.zeros(1)))}
    [(found, path)] = find_kjts(batch)
    assert found is kjt and path_name(path) == "batch['x'][1].sparse_features"
    with pytest.raises(ValueError, match="variant"):
        PipelineConfig(variant="semi_sync_typo")
