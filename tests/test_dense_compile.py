"""compile_dense: torch.compile on the dense layers (embedding lookups outside the graphs) trains as eager does.

Compiling costs seconds on CPU, so one worker runs both checks (a hand loop and a short Trainer run) once, on
torch.compile's "aot_eager" backend: Dynamo captures each dense module whole and AOTAutograd traces its forward
and backward (the graphs a GPU's Inductor would compile), without generating kernels. Inductor's own kernels
(fused, reassociated sums) need a looser tolerance; the GPU's figures are in docs/pipeline.md."""

from __future__ import annotations

import warnings

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from test_pipeline import DIM, KEYS, NUM_F, ROWS, SMALL, _loader, _take, _weights
from torch import nn

from lightning_rec.data.synthetic import SyntheticCriteoDataModule
from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_rec.model_parallel import DistributedModelParallel
from lightning_rec.models.dlrm import DLRM
from lightning_rec.optim import CombinedOptimizer, FusedOptimizerConfig

AOT = {"backend": "aot_eager"}


class _Branchy(nn.Module):
    """Data-dependent control flow: a Python `if` on a tensor's value (no whole graph can hold it)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale if x.sum() > 0 else x * (2 * self.scale)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[k])
                  for i, k in enumerate(KEYS)]
        ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.05))
        self.dlrm = DLRM(ebc, 13, [16, DIM], [16, 1])
        self.gate = _Branchy()

    def forward(self, batch):
        logits = self.gate(self.dlrm(batch.dense_features, batch.sparse_features)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum"), logits


def _hand_loop(batches, compile_dense):
    torch.manual_seed(0)
    dmp = DistributedModelParallel(_Model(), device="cpu", compile_dense=compile_dense)
    opt = CombinedOptimizer([("fused", dmp.fused_optimizer),
                             ("dense", torch.optim.Adagrad([p for p in dmp.parameters() if p.requires_grad], lr=0.02))])
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches:
            opt.zero_grad()
            loss, _ = dmp(batch)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    said = [str(w.message) for w in caught if "compile_dense" in str(w.message)]
    return torch.stack(losses), _weights(dmp), dmp.compiled_dense, said


def _fit(compile_dense, pipeline: bool):
    from lightning_rec import DLRMModule
    from lightning_rec.strategy import RecStrategy

    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_samples=256, num_val_samples=64, batch_size=64,
                                     num_sparse_features=NUM_F, num_embeddings_per_feature=64, num_signal_features=2)
    module = DLRMModule(**SMALL)
    losses = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].detach())

    strategy = RecStrategy(compile_dense=compile_dense, pipeline=pipeline)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, callbacks=[Losses()])
    trainer.fit(module, data)
    return torch.stack(losses), _weights(module.model), trainer.strategy.dmp.compiled_dense


def _compile_worker(rank, W):
    batches = list(_take(_loader(rank, 6), 6))
    eager, compiled = _hand_loop(batches, False), _hand_loop(batches, AOT)
    # compiled and pipelined against the plain eager loop (pipelined equals plain exactly: test_pipeline.py)
    fit_eager, fit_compiled = _fit(False, pipeline=False), _fit(AOT, pipeline=True)
    return eager, compiled, fit_eager, fit_compiled


def test_compiled_dense_layers_train_as_eager_and_a_branchy_one_falls_back_with_one_warning():
    (eager, compiled, fit_eager, fit_compiled), = run_ranks(_compile_worker, 1, timeout=240)
    losses, weights, names, said = compiled
    assert eager[2] == [] and names == ["dlrm.dense_arch", "dlrm.over_arch", "gate"]
    # the branchy module: one warning over 6 steps, naming it; it ran eagerly, the MLPs compiled
    assert len(said) == 1 and "'gate' (_Branchy)" in said[0] and eager[3] == []
    # fp32; the same ATen ops, traced (AOTAutograd's decompositions may regroup an addmm): 1e-6 relative
    torch.testing.assert_close(losses, eager[0], rtol=1e-6, atol=1e-6)
    for k in eager[1]:
        torch.testing.assert_close(weights[k], eager[1][k], rtol=1e-6, atol=1e-6, msg=k)
    # the Trainer's loop: RecStrategy(compile_dense=...) compiles DLRMModule's MLPs (the interaction has no weights)
    assert fit_compiled[2] == ["model.dense_arch", "model.over_arch"] and fit_eager[2] == []
    assert len(fit_compiled[0]) == 4
    torch.testing.assert_close(fit_compiled[0], fit_eager[0], rtol=1e-6, atol=1e-6)
    for k in fit_eager[1]:
        torch.testing.assert_close(fit_compiled[1][k], fit_eager[1][k], rtol=1e-6, atol=1e-6, msg=k)


def test_cuda_graphs_without_a_cuda_device_and_bad_compile_arguments_are_refused_at_the_constructor():
    from lightning_rec.strategy import RecStrategy

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match=r"RecStrategy\(cuda_graphs=True\).*needs a CUDA GPU"):
        RecStrategy(cuda_graphs=True)
    with pytest.raises(ValueError, match="leave fullgraph out"):
        RecStrategy(compile_dense={"fullgraph": False})
    with pytest.raises(ValueError, match="use True, False, or a dict"):
        RecStrategy(compile_dense="yes")
