"""Evaluation at 2 ranks scores every row of the split exactly once: metrics equal the 1-rank run's.

Map-style (a DistributedSampler would repeat a row to even the shares), preprocessed shards (training
drops the rows that do not split evenly), streaming (ranks' streams end at different batches), plain and
pipelined, in validate, test and fit's validation. Tolerances: the row count and the label sum are exact
(sums of integers); log loss and AUC are computed from the same rows' predictions, which differ only by
the dense layers' float summation order in batches of another size (rtol 1e-6 / atol 1e-6).
"""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as L
import numpy as np
import pytest
from conftest import SHARED_DATA

from lightning_rec import CriteoDataModule, DLRMModule
from lightning_rec.strategy import RecStrategy
from tests.dist_utils import run_ranks

SMALL = dict(num_embeddings_per_feature=64, embedding_dim=8, dense_arch_layer_sizes=[16, 8],
             over_arch_layer_sizes=[16, 1], sparse_lr=0.0, dense_lr=0.0)  # lr 0: fit's validation sees the init
ROWS = 301  # odd: 151 + 150 rows at 2 ranks


def write_criteo_tsv(path, rows: int, seed: int = 0) -> str:
    """Labelled Criteo rows (label, I1..I13, C1..C26), some values missing."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(rows):
        ints = [str(v) if v >= 0 else "" for v in rng.integers(-3, 50, 13)]
        cats = [f"{v:08x}" if v % 7 else "" for v in rng.integers(0, 40, 26)]
        lines.append("\t".join([str(int(rng.random() < 0.3))] + ints + cats))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


class CountingDLRM(DLRMModule):
    """Keeps this rank's metric states of the last evaluation (rows seen, clicks) before they are reset."""

    empty_steps = 0

    def validation_step(self, batch, batch_idx):
        self.empty_steps += len(batch) == 0
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        self.empty_steps += len(batch) == 0
        return super().test_step(batch, batch_idx)

    def _keep(self, metrics) -> None:
        ctr = metrics.metrics["ctr"]  # one task: its states are [1]
        self.seen = {"rows": int(ctr.labelled[0]), "clicks": float(ctr.ctr_num[0]), "empty_steps": self.empty_steps}

    def on_validation_epoch_end(self) -> None:
        self._keep(self.val_metrics)
        super().on_validation_epoch_end()

    def on_test_epoch_end(self) -> None:
        self._keep(self.test_metrics)
        super().on_test_epoch_end()


def _every_sharding_type(module, world_size: int):
    """A plan that gives the 26 tables every sharding type in turn (each sees the empty batches)."""
    from lightning_rec.model_parallel import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_row_wise,
        table_wise,
    )
    from lightning_rec.types import ShardingPlan

    path = "model.sparse_arch.embedding_bag_collection"
    ebc = module.get_submodule(path)
    verbs = [row_wise(), column_wise([0, 1]), table_wise(0), table_wise(1), data_parallel(), table_row_wise(0)]
    names = [c.name for c in ebc.embedding_bag_configs()]
    return ShardingPlan({path: construct_module_sharding_plan(ebc, {n: verbs[i % len(verbs)] for i, n in
                                                                    enumerate(names)}, world_size=world_size)})


def _evaluate(rank, world_size, how: str, data_kwargs: dict, pipeline: bool = False, every_type: bool = False):

    L.seed_everything(0)
    data = CriteoDataModule(num_embeddings_per_feature=64, parser="python", **data_kwargs)
    module = CountingDLRM(**SMALL)
    plan = _every_sharding_type(module, world_size) if every_type and world_size > 1 else None
    trainer = L.Trainer(strategy=RecStrategy(pipeline=pipeline, plan=plan), accelerator="cpu", devices=world_size,
                        max_epochs=1, limit_train_batches=2, num_sanity_val_steps=0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "fit":
            trainer.fit(module, data)
        else:
            getattr(trainer, how)(module, data)
    prefix = "test_" if how == "test" else "val_"
    metrics = {k[len(prefix):]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix)}
    skipped = sum("batches are skipped" in str(w.message) for w in caught)
    return {"metrics": metrics, "seen": module.seen, "skipped": skipped}


def _check_exact(one: list, two: list, rows: int) -> None:
    ref = one[0]
    assert ref["seen"]["rows"] == rows
    assert sum(r["seen"]["rows"] for r in two) == rows  # every row once over the ranks
    assert sum(r["seen"]["clicks"] for r in two) == ref["seen"]["clicks"]
    assert all(r["skipped"] == 0 for r in two)
    for r in two:
        got, want = r["metrics"], ref["metrics"]
        assert got["ctr"] == pytest.approx(want["ctr"], rel=1e-12, abs=0)  # the same clicks over the same rows
        assert got["ctr"] == pytest.approx(ref["seen"]["clicks"] / rows, rel=1e-12)
        assert got["logloss"] == pytest.approx(want["logloss"], rel=1e-6)
        assert got["auc"] == pytest.approx(want["auc"], abs=1e-6)
        if "loss" in want:  # val_loss: the mean over rows (it was a batch-weighted mean with a truncated count)
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)


def _both(how: str, data_kwargs: dict, pipeline: bool = False, every_type: bool = False):
    one = run_ranks(_evaluate, 1, how, data_kwargs, False, timeout=120)
    two = run_ranks(_evaluate, 2, how, data_kwargs, pipeline, every_type, timeout=120)
    return one, two


def test_map_style_validate_and_fit_score_every_row_once(tmp_path):
    path = write_criteo_tsv(tmp_path / "val.tsv", ROWS)
    kw = dict(val_path=path, batch_size=32, cache_dir=str(tmp_path / "cache"))
    one, two = _both("validate", kw)
    _check_exact(one, two, ROWS)
    # fit's validation loop too (lr 0: the weights stay the initial ones the 1-rank validate saw)
    fit = run_ranks(_evaluate, 2, "fit", {**kw, "train_path": path}, timeout=120)
    _check_exact(one, fit, ROWS)


def test_shards_test_scores_every_row_once(tmp_path):
    from lightning_rec.data.preprocess import preprocess_criteo

    path = write_criteo_tsv(tmp_path / "val.tsv", ROWS)
    # rank 0 reads 150 rows (3 batches of 50), rank 1 151 (4 batches): rank 0 steps once with an empty batch
    # (training drops rank 1's extra row, so that the shares are equal)
    manifest = preprocess_criteo([path], tmp_path / "shards", num_embeddings=64, shuffle_rows=False, progress=False)
    assert [s["rows"] for s in manifest["shards"]] == [ROWS]
    # every sharding type (row-, column-, table-wise, data parallel, table-row-wise) takes the empty batch
    one, two = _both("test", dict(test_path=str(tmp_path / "shards"), batch_size=50), every_type=True)
    _check_exact(one, two, ROWS)
    assert [r["seen"]["empty_steps"] for r in two] == [1, 0]  # a batch of 0 rows went through the sharded model


@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipelined"])
def test_streaming_validate_scores_every_row_once(tmp_path, pipeline):
    path = write_criteo_tsv(tmp_path / "val.tsv", ROWS)
    # 5 blocks of ~8 KB dealt to the ranks (3 and 2): the streams end at different batches
    one, two = _both("validate", dict(val_path=path, batch_size=16, streaming=True, block_bytes=8000), pipeline,
                     every_type=pipeline)
    _check_exact(one, two, ROWS)
    assert sum(r["seen"]["empty_steps"] for r in two) > 0  # the rank whose stream ended first stepped on


def test_kaggle_sample_validate_is_exact_at_two_ranks(tmp_path):
    """The user's report: the Kaggle validation sample (2055 rows) at 2 ranks scored 2056 rows."""
    path = SHARED_DATA / "criteo" / "criteo_kaggle_valid_sample.tsv"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    kw = dict(val_path=str(path), batch_size=256, cache_dir=str(tmp_path / "cache"))
    one, two = _both("validate", kw)
    rows = one[0]["seen"]["rows"]
    assert rows == 2055 and math.isclose(one[0]["metrics"]["ctr"], 544 / 2055, rel_tol=1e-9)
    _check_exact(one, two, rows)


def _predict(rank, world_size, data_kwargs: dict):
    L.seed_everything(0)
    data = CriteoDataModule(num_embeddings_per_feature=64, parser="python", **data_kwargs)
    trainer = L.Trainer(strategy=RecStrategy(), accelerator="cpu", devices=world_size, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    predictions = trainer.predict(CountingDLRM(**SMALL), data)
    return sorted(float(p) for batch in predictions for p in batch["probability"])  # predict_step: a dict of columns


@pytest.mark.parametrize("kind", ["map_style", "streaming"])
def test_predict_gives_every_row_once(tmp_path, kind):
    path = write_criteo_tsv(tmp_path / "rows.tsv", ROWS)
    kw = dict(predict_path=path, batch_size=32, cache_dir=str(tmp_path / "cache"))
    if kind == "streaming":
        kw.update(streaming=True, block_bytes=8000)
    one = run_ranks(_predict, 1, kw, timeout=120)[0]
    two = run_ranks(_predict, 2, kw, timeout=120)
    assert len(one) == ROWS and sum(len(r) for r in two) == ROWS  # no row repeated, none left out
    np.testing.assert_allclose(sorted(two[0] + two[1]), one, atol=1e-6)  # the same rows' probabilities


def test_shard_shares_cover_every_row_once_with_equal_batch_counts(tmp_path):
    """One process: each rank's `every_row` share, at 2-5 ranks, over several shards (no communication)."""
    from lightning_rec.data.criteo_shards import CriteoShardDataset, rank_segments

    for shard_rows in ([301], [100, 7, 0, 55], [3, 1]):
        for world in (2, 3, 5):
            covered = sorted((i, row) for r in range(world) for i, lo, hi in rank_segments(shard_rows, r, world, True)
                             for row in range(lo, hi))
            assert covered == [(i, row) for i, n in enumerate(shard_rows) for row in range(n)]
    path = write_criteo_tsv(tmp_path / "rows.tsv", ROWS)
    from lightning_rec.data.preprocess import preprocess_criteo

    preprocess_criteo([path], tmp_path / "shards", num_embeddings=64, shuffle_rows=False, progress=False)
    whole = [b.dense_features for b in CriteoShardDataset(tmp_path / "shards", 7, rank=0, world_size=1)]
    for world in (2, 3, 5):
        shares = [list(CriteoShardDataset(tmp_path / "shards", 7, rank=r, world_size=world, every_row=True))
                  for r in range(world)]
        assert len({len(s) for s in shares}) == 1  # every rank steps the same number of times
        dense = np.concatenate([b.dense_features.numpy() for s in shares for b in s])
        np.testing.assert_array_equal(dense, np.concatenate([d.numpy() for d in whole]))  # rank order = file order


def _evaluate_synthetic(rank, world_size):
    from lightning_rec import SyntheticCriteoDataModule

    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_samples=64, num_val_samples=ROWS, batch_size=32,
                                     num_embeddings_per_feature=64)
    module = CountingDLRM(**SMALL)
    trainer = L.Trainer(strategy=RecStrategy(), accelerator="cpu", devices=world_size, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(module, data, verbose=False)
    metrics = {k[4:]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    return {"metrics": metrics, "seen": module.seen, "skipped": 0}


def test_synthetic_validate_scores_every_row_once():
    one = run_ranks(_evaluate_synthetic, 1, timeout=120)
    two = run_ranks(_evaluate_synthetic, 2, timeout=120)
    _check_exact(one, two, ROWS)


def _plain_loader_evaluate(rank, world_size, out_dir, pipeline: bool):
    """validate, test and predict over a plain DataLoader of 33 rows in batches of 16 (Lightning's samplers deal the
    ranks 17 and 16 rows: 2 batches and 1)."""
    from torch.utils.data import DataLoader

    from lightning_rec import SyntheticCriteoDataModule
    from lightning_rec.data.batch import passthrough_collate
    from lightning_rec.predict import PredictionWriter

    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_samples=8, num_val_samples=33, num_embeddings_per_feature=64)
    data.setup("fit")
    loader = DataLoader(data.datasets["val"], batch_size=16, collate_fn=passthrough_collate)
    module = CountingDLRM(**SMALL)
    plan = _every_sharding_type(module, world_size) if world_size > 1 else None
    writer = PredictionWriter(f"{out_dir}/predictions_{world_size}.csv", overwrite=True)
    trainer = L.Trainer(strategy=RecStrategy(plan=plan, pipeline=pipeline), accelerator="cpu", devices=world_size,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=[writer])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(module, loader, verbose=False)
        validated = {"metrics": {k[4:]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")},
                     "seen": dict(module.seen)}
        trainer.test(module, loader, verbose=False)
        tested = {"metrics": {k[5:]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test_")},
                  "seen": dict(module.seen)}
        trainer.predict(module, loader, return_predictions=False)
    skipped = sum("batches are skipped" in str(w.message) for w in caught)
    return [{**validated, "skipped": skipped}, {**tested, "skipped": skipped}], str(writer.written_path)


@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipelined"])
def test_plain_dataloader_with_uneven_shares_evaluates_and_predicts_every_row_once(tmp_path, pipeline):
    """A plain (sized) DataLoader of 33 rows at 2 ranks: validate / test counted a row twice (torch's DistributedSampler
    repeats one to even the shares: 34 rows in every metric), and predict wrote 32 rows (the rank with one batch fewer
    ended the pass for all). Now the ranks' shares are 17 and 16 rows, the shorter steps once with an empty batch."""
    import pandas as pd

    (one, one_file), = run_ranks(_plain_loader_evaluate, 1, str(tmp_path), False, timeout=120)
    two = run_ranks(_plain_loader_evaluate, 2, str(tmp_path), pipeline, timeout=120)
    for stage in range(2):  # validate, test
        _check_exact([one[stage]], [r[stage] for r, _ in two], 33)
    assert [r[0]["seen"]["empty_steps"] for r, _ in two] == [0, 1]  # rank 1's second step: no rows
    want, got = pd.read_csv(one_file), pd.read_csv(two[0][1])
    assert list(got["row"]) == list(range(33))  # every row once, in order
    np.testing.assert_allclose(got["probability"], want["probability"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got["label"], want["label"])


def test_a_padding_batch_is_offered_only_where_the_dataset_makes_an_empty_one():
    """A rank whose share ran out steps with the loader's batch of no rows; a dataset that cannot make one (torch's
    Subset over a per-row dataset hands default_collate an empty list) would have failed on that rank mid-pass, its
    peers waiting: it keeps Lightning's sampler (no padding) instead."""
    import torch
    from torch.utils.data import DataLoader, Subset, TensorDataset

    from lightning_rec import SyntheticCriteoDataModule
    from lightning_rec._strategy.loaders import padding_for
    from lightning_rec.data.batch import passthrough_collate

    per_row = DataLoader(Subset(TensorDataset(torch.arange(5.0)), range(5)), batch_size=2)
    (empty,) = padding_for(per_row, training=False)()  # its first row cut to 0 rows, never default_collate([])
    assert empty.shape == (0,) and empty.dtype == torch.float32
    own_collate = DataLoader(Subset(TensorDataset(torch.arange(5.0)), range(5)), batch_size=2,
                             collate_fn=lambda rows: torch.stack([r[0] for r in rows]))
    assert padding_for(own_collate, training=False) is None
    strings = DataLoader([("a", 1.0), ("b", 2.0)], batch_size=2)  # a list of str: no row of it to cut
    assert padding_for(strings, training=False) is None
    data = SyntheticCriteoDataModule(num_train_samples=8, num_val_samples=33, num_embeddings_per_feature=64)
    data.setup("fit")
    whole = DataLoader(Subset(data.datasets["val"], range(33)), batch_size=16, collate_fn=passthrough_collate)
    assert len(padding_for(whole, training=False)()) == 0  # a Batch of no rows
    assert padding_for(whole, training=True) is None  # training: the first rank to run out ends the epoch for all


class _PerRowModule(L.LightningModule):
    """A fused table and a linear layer over a TensorDataset's (x, y) rows; keeps the rows its steps saw."""

    def __init__(self):
        super().__init__()
        import torch

        from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
        from lightning_rec.metrics import CTR

        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=40, embedding_dim=4,
                                                              feature_names=["f"])],
                                          optimizer=FusedOptimizerConfig("sgd", lr=0.1))
        self.linear = torch.nn.Linear(2, 1)
        self.ctr, self.seen = CTR(), []

    def _score(self, x):
        import torch

        from lightning_rec import KeyedJaggedTensor

        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=x[:, 0].long() % 40,
                                                  lengths=torch.ones(len(x), dtype=torch.long))
        return self.linear(x).squeeze(-1) + self.ebc(kjt).values().sum(1)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.seen += x[:, 0].long().tolist()
        self.ctr.update(self._score(x), y)
        self.log("val_ctr", self.ctr)

    def predict_step(self, batch, batch_idx):
        return {"score": self._score(batch[0])}


def _per_row_evaluate(rank, world_size, out: str):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_rec import PredictionWriter

    x = torch.stack([torch.arange(33.0), torch.linspace(-1, 1, 33)], 1)
    loader = DataLoader(TensorDataset(x, (torch.arange(33) % 3 == 0).float()), batch_size=4)
    module = _PerRowModule()
    trainer = L.Trainer(strategy=RecStrategy(), accelerator="cpu", devices=world_size, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[PredictionWriter(out, overwrite=True)])
    (validated,) = trainer.validate(module, loader, verbose=False)
    trainer.predict(module, loader, return_predictions=False)
    return {"seen": module.seen, "ctr": validated["val_ctr"]}


def test_a_per_row_dataset_at_two_ranks_is_validated_and_predicted_every_row_once(tmp_path):
    """A TensorDataset of 33 rows (default_collate) at 2 ranks: validate counted row 0 twice (Lightning's
    DistributedSampler repeats it to even the shares: CTR 12/34 where the data's is 11/33), and predict wrote 32 of the
    33 rows (the rank with a batch fewer ended the pass for all). Now the shorter share steps on with the first row cut
    to 0 rows: every row once in both."""
    import pandas as pd

    out = str(tmp_path / "p.csv")
    ranks = run_ranks(_per_row_evaluate, 2, out, timeout=120)
    assert sorted(sum((r["seen"] for r in ranks), [])) == list(range(33))
    assert all(r["ctr"] == pytest.approx(11 / 33, abs=1e-12) for r in ranks)
    assert list(pd.read_csv(out)["row"]) == list(range(33))


def _fewer_rows_than_ranks(rank, world_size, out: str):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_rec import PredictionWriter

    x = torch.tensor([[7.0, 0.5]])
    dataset = TensorDataset(x, torch.ones(1))
    module = _PerRowModule()
    trainer = L.Trainer(strategy=RecStrategy(), accelerator="cpu", devices=world_size, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[PredictionWriter(out, overwrite=True)])
    trainer.predict(module, DataLoader(dataset, batch_size=4), return_predictions=False)
    own_collate = DataLoader(dataset, batch_size=4, collate_fn=lambda rows: (torch.stack([r[0] for r in rows]),))
    trainer = L.Trainer(strategy=RecStrategy(), accelerator="cpu", devices=world_size, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    try:
        trainer.predict(module, own_collate, return_predictions=False)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return module.seen, refused


def test_predict_with_fewer_rows_than_ranks_writes_them_or_names_the_fix(tmp_path):
    """trainer.predict over 1 row at 2 ranks failed with a bare AssertionError from Lightning's prediction sampler
    (the rank with no row). Now that rank steps with an empty batch and the row is written once; where no empty batch
    can be made (a collate_fn of one's own) every rank refuses with a ValueError naming the fixes."""
    import pandas as pd

    out = str(tmp_path / "p.csv")
    ranks = run_ranks(_fewer_rows_than_ranks, 2, out, timeout=120)
    assert list(pd.read_csv(out)["row"]) == [0]
    for _, refused in ranks:
        assert "1 row(s) for 2 ranks" in refused and "empty_batch()" in refused and "devices=1" in refused, refused
