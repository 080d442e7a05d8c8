"""SASRec and HSTU with the item table row-wise sharded over 2 CPU ranks (gloo): they train, and the weights
trained there evaluate to the same test NDCG@10 (1e-5) in one unsharded process."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch

from lightning_rec.data.sequence import SequenceDataModule
from lightning_rec.models import HSTU, SASRec
from tests.dist_utils import run_ranks

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False)
MODELS = {"sasrec": (SASRec, {}), "hstu": (HSTU, {"attention_dim": 8, "value_dim": 8})}


def _log(folder: str, users: int = 30, items: int = 25) -> str:
    g = torch.Generator().manual_seed(0)
    rows = [f"{u},{int(torch.randint(items, (1,), generator=g))},5,{60 * j}\n" for u in range(users)
            for j in range(4 + u % 7)]
    with open(f"{folder}/ratings.csv", "w") as f:
        f.write("user,item,rating,timestamp\n" + "".join(rows))
    return folder


def _data(folder: str) -> SequenceDataModule:
    # eval batch of 7: the 30 users' shares per rank end in a short (or padded) batch
    return SequenceDataModule(folder, max_len=5, batch_size=6, eval_batch_size=7)


def _module(name: str, **kwargs):
    cls, extra = MODELS[name]
    L.seed_everything(3)
    return cls(embedding_dim=8, num_blocks=1, dropout=0.1, exclude_history=True, sparse_lr=0.1, **extra, **kwargs)


def _fit_row_wise(rank, world_size, name, folder, ckpt):
    from lightning_rec.planner import EmbeddingShardingPlanner, ParameterConstraints
    from lightning_rec.strategy import RecStrategy

    planner = EmbeddingShardingPlanner(constraints={"t_item": ParameterConstraints(sharding_types=["row_wise"])})
    module = _module(name)
    trainer = L.Trainer(strategy=RecStrategy(planner=planner), accelerator="cpu", devices=world_size, max_epochs=1,
                        num_sanity_val_steps=0, limit_val_batches=0, **QUIET)
    trainer.fit(module, _data(folder))
    plan = str(trainer.strategy.plan)
    (metrics,) = trainer.test(module, _data(folder), verbose=False)
    trainer.save_checkpoint(ckpt)
    return metrics, plan


@pytest.mark.parametrize("name", ["sasrec", "hstu"])
def test_row_wise_two_ranks_evaluate_like_one_process(tmp_path, name):
    folder, ckpt = _log(str(tmp_path)), str(tmp_path / "ckpt")
    (m0, plan), (m1, _) = run_ranks(_fit_row_wise, 2, name, folder, ckpt, timeout=240)
    assert m0 == m1 and "row_wise" in plan.lower().replace("-", "_"), plan
    from lightning_rec.checkpoint import full_state_dict, read_lightning_state

    hparams = read_lightning_state(ckpt)["hyper_parameters"]
    cls, extra = MODELS[name]
    module = cls(**{k: v for k, v in hparams.items() if not k.startswith("_")})
    module.load_state_dict(full_state_dict(ckpt), strict=False)
    (single,) = L.Trainer(accelerator="cpu", devices=1, **QUIET).test(module, _data(folder), verbose=False)
    for key in ("test_ndcg@10", "test_hit_rate@10", "test_mrr@10"):
        assert single[key] == pytest.approx(m0[key], abs=1e-5), (key, single, m0)


class _Record(L.Callback):
    """Each step's loss, the pipelines' routing counts, and the table (every item's row) and dense weights at the
    end of training."""

    def __init__(self) -> None:
        self.losses, self.stats, self.catalog, self.dense = [], [], None, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        self.stats = [dict(p.stats) for p in trainer.strategy._pipelines]
        self.catalog = pl_module.embed_catalog()  # every rank: the table may be sharded
        self.dense = {k: v.detach().clone() for k, v in pl_module.state_dict().items() if not k.startswith("items.")}


def _plain_then_pipelined(rank, world_size, folder):
    """SASRec (sampled softmax: negatives drawn in the data path) and HSTU (full softmax), item table row-wise, two
    epochs with validation mid-epoch and at its end, plain and pipelined."""
    from lightning_rec.planner import EmbeddingShardingPlanner, ParameterConstraints
    from lightning_rec.strategy import RecStrategy

    out = {}
    for name, loss in (("sasrec", "sampled_softmax"), ("hstu", "softmax")):
        for pipeline in (False, True):
            row_wise = {"t_item": ParameterConstraints(sharding_types=["row_wise"])}
            planner = EmbeddingShardingPlanner(constraints=row_wise)
            module, record = _module(name, loss=loss, num_negatives=6), _Record()
            trainer = L.Trainer(strategy=RecStrategy(planner=planner, pipeline=pipeline), accelerator="cpu",
                                devices=world_size, max_epochs=2, num_sanity_val_steps=0, val_check_interval=0.5,
                                callbacks=[record], **QUIET)
            trainer.fit(module, _data(folder))
            val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
            out[name, pipeline] = dict(losses=record.losses, stats=record.stats, catalog=record.catalog,
                                       dense=record.dense, val=val)
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_pipelined_fit_equals_plain_fit(tmp_path, world_size):
    """RecStrategy(pipeline=True): the lookup KJT (and the sampled softmax's negatives) come with the batch from
    SequenceDataModule's on_before_batch_transfer, so the feeder routes every step's ids but the first ahead of the
    step, and the run equals the plain one exactly (losses, validation, table, dense weights) on CPU."""
    folder = _log(str(tmp_path))
    results = [_plain_then_pipelined(0, 1, folder)] if world_size == 1 else run_ranks(
        _plain_then_pipelined, world_size, folder, timeout=240)
    for result in results:
        for name in ("sasrec", "hstu"):
            plain, piped = result[name, False], result[name, True]
            steps = len(plain["losses"])
            assert steps == 2 * (5 if world_size == 1 else 3) and piped["losses"] == plain["losses"], name
            assert piped["val"] == plain["val"] and "val_ndcg@10" in plain["val"], name
            assert torch.equal(piped["catalog"], plain["catalog"]), name
            assert all(torch.equal(piped["dense"][k], plain["dense"][k]) for k in plain["dense"]), name
            train, val = piped["stats"]  # the validation steps look nothing up (the catalog is embedded before them)
            assert train == {"routed_ahead": steps - 1, "routed_in_step": 1} and not any(val.values()), piped["stats"]


class _OwnHook(SequenceDataModule):
    def on_before_batch_transfer(self, batch, dataloader_idx):
        return batch  # replaces SequenceDataModule's, which adds the lookup


def test_pipeline_names_a_datamodule_hook_that_replaces_the_modules(tmp_path):
    """A datamodule whose on_before_batch_transfer leaves training batches without their lookup: the plain loop
    builds it in the step, a pipeline could only route it there, unpipelined; the step says so and names the fix.
    A hand-written TrainPipelineSparseDist loop calls model(batch), which a sequential module does not take."""
    from lightning_rec import TrainPipelineSparseDist
    from lightning_rec.strategy import RecStrategy

    data = _OwnHook(_log(str(tmp_path)), max_len=5, batch_size=6)
    trainer = L.Trainer(strategy=RecStrategy(pipeline=True), accelerator="cpu", devices=1, max_steps=1,
                        limit_val_batches=0, num_sanity_val_steps=0, **QUIET)
    with pytest.raises(ValueError, match=r"pipeline=True.*return model.prepare_batch\(batch\) from your") as e:
        trainer.fit(_module("sasrec"), data)
    assert "\n" not in str(e.value)
    model = _module("hstu", num_items=data.num_items, max_len=5)
    with TrainPipelineSparseDist(model, torch.optim.Adam(model.parameters()), "cpu") as pipeline:
        with pytest.raises(TypeError, match=r"^HSTU\(batch\): .*train it with Trainer.fit") as e:
            pipeline.progress(iter(data.train_dataloader()))
    assert "\n" not in str(e.value)
