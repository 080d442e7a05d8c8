"""`lightning-rec predict` writes one row per input row, in input order, equal to the model's forward on that row
(1 process, and 2 ranks with sharded tables); each data module reads only what the stage needs; a two-tower
recipe predicts each user's top unseen items; bad input gets a one-line error that names the fix."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch
from conftest import SHARED_DATA

from tests.dist_utils import run_ranks

CRITEO = SHARED_DATA / "criteo"
UNLABELLED = CRITEO / "criteo_kaggle_test_head1999_nolabel.tsv"
LABELLED = CRITEO / "criteo_kaggle_valid_sample.tsv"
ML100K = SHARED_DATA / "movielens" / "ml-100k"
needs_criteo = pytest.mark.skipif(not UNLABELLED.is_file(), reason="shared Criteo samples not present")
needs_ml100k = pytest.mark.skipif(not (ML100K / "u.data").is_file(), reason="shared ml-100k not present")
QUIET = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def _read(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".parquet":
        table = pq.read_table(path)
    else:
        table = pcsv.read_csv(path, parse_options=pcsv.ParseOptions(delimiter="\t" if path.suffix == ".tsv" else ","))
    return {name: table.column(name).to_numpy() for name in table.column_names}


# DLRM on Criteo ---------------------------------------------------------------------------------------------


def _criteo_args(root: Path, *extra: str) -> list[str]:
    return ["--config", "recipes/configs/dlrm_criteo_kaggle.yaml", f"--trainer.default_root_dir={root}",
            f"--data.init_args.cache_dir={root / 'cache'}", *QUIET, *extra]


@pytest.fixture(scope="module")
def criteo_ckpt(tmp_path_factory) -> Path:
    """A DLRM checkpoint after a few steps of the recipe (trained weights, not the initial ones)."""
    from lightning_rec.cli import run_cli

    if not UNLABELLED.is_file():
        pytest.skip("shared Criteo samples not present")
    root = tmp_path_factory.mktemp("criteo_fit")
    run_cli(["fit", *_criteo_args(root, f"--data.train_path={CRITEO / 'criteo_kaggle_train_sample.tsv'}",
                                  "--data.val_path=null", "--trainer.max_steps=6",
                                  "--trainer.enable_checkpointing=true", "--trainer.callbacks+=ModelCheckpoint",
                                  f"--trainer.callbacks.dirpath={root}", "--trainer.callbacks.filename=last")])
    return root / "last.ckpt"


def _forward(ckpt: Path, path: Path, root: Path) -> tuple[np.ndarray, np.ndarray]:
    """The unsharded module's probability of every row of `path`, in file order, and the file's labels."""
    from lightning_rec.data.criteo import CriteoDataset, build_criteo_cache
    from lightning_rec.models import DLRMModule

    module = DLRMModule.load_from_checkpoint(ckpt, map_location="cpu").eval()
    dataset = CriteoDataset(build_criteo_cache(path, root / "ref_cache")[0], module.hparams.num_embeddings_per_feature)
    batch = dataset[:]
    with torch.no_grad():
        return torch.sigmoid(module(batch.dense_features, batch.sparse_features)).numpy(), batch.labels.numpy()


@needs_criteo
@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_predict_writes_every_row_in_order_equal_to_forward(criteo_ckpt, tmp_path, suffix, capsys):
    from lightning_rec.cli import run_cli

    out = tmp_path / f"preds{suffix}"
    # the recipe's train and val paths stay set: predict reads only the predict path
    cli = run_cli(["predict", *_criteo_args(tmp_path), f"--ckpt_path={criteo_ckpt}",
                   f"--data.predict_path={UNLABELLED}", f"--predictions.output_path={out}"])
    assert f"predictions: 1999 rows written to {out}" in capsys.readouterr().out
    # the file has the rows: Lightning did not keep every batch's output too (it did by default, all of them)
    assert not cli.trainer.predict_loop.return_predictions and not cli.trainer.predict_loop.predictions
    got = _read(out)
    want, _ = _forward(criteo_ckpt, UNLABELLED, tmp_path)
    assert list(got) == ["row", "probability"]  # an unlabelled file: no label column
    np.testing.assert_array_equal(got["row"], np.arange(1999))
    np.testing.assert_allclose(got["probability"], want, rtol=0, atol=1e-6)  # fp32, same ops; CSV keeps 9 digits
    assert want.std() > 1e-3  # trained weights: the rows differ, so an order mix-up would show


@needs_criteo
def test_predict_on_a_labelled_file_keeps_the_labels_and_defaults_to_the_run_dir(criteo_ckpt, tmp_path, capsys):
    from lightning_rec.cli import run_cli

    args = ["predict", *_criteo_args(tmp_path), f"--ckpt_path={criteo_ckpt}", f"--data.predict_path={LABELLED}",
            "--data.batch_size=100"]
    run_cli(args)
    first = tmp_path / "predictions.csv"
    got = _read(first)
    want, labels = _forward(criteo_ckpt, LABELLED, tmp_path)
    assert list(got) == ["row", "probability", "label"]
    np.testing.assert_array_equal(got["label"], labels)
    np.testing.assert_allclose(got["probability"], want, rtol=0, atol=1e-6)
    # a default path never overwrites an earlier run's file; a --model option that the checkpoint's own
    # hyperparameters replace is named (Lightning replaced it without a word), and the output stays the checkpoint's
    with pytest.warns(UserWarning, match=r"--model.embedding_dim=4 is not used: --ckpt_path rebuilds the model "
                                         r"with the checkpoint's own hyperparameters \(embedding_dim=8\)") as said:
        run_cli([*args, "--model.init_args.embedding_dim=4"])
    # (and not Lightning's advice to add the fit's callbacks, which predict has no use for)
    assert not [w for w in said if "callbacks used to create the checkpoint" in str(w.message)]
    np.testing.assert_allclose(_read(tmp_path / "predictions_1.csv")["probability"], want, rtol=0, atol=1e-6)
    assert f"rows written to {tmp_path / 'predictions_1.csv'}" in capsys.readouterr().out
    assert _read(first)["row"].shape == (len(labels),)


def _predict_two_ranks(rank: int, world_size: int, ckpt: Path, root: Path, pipeline: bool,
                       predict_path: Path = UNLABELLED, *extra: str) -> int:
    from lightning_rec.cli import run_cli

    strategy = (["--trainer.strategy=lightning_rec.strategy.RecStrategy", "--trainer.strategy.pipeline=true"]
                if pipeline else ["--trainer.strategy=rec"])
    # 1999 rows, 2 ranks, batches of 999: rank 0 has 1000 rows (2 steps), rank 1 999 and an empty second batch
    # (its share padded with -1); rank 0's second batch must not be skipped, nor rank 1's empty one confuse the writer
    cli = run_cli(["predict", *_criteo_args(root, "--data.batch_size=999"), *strategy,
                   f"--trainer.devices={world_size}", f"--ckpt_path={ckpt}", f"--data.predict_path={predict_path}",
                   f"--predictions.output_path={root / 'preds.csv'}", *extra])
    rows = next(c.num_rows for c in cli.trainer.callbacks if hasattr(c, "written_path"))
    del cli
    # what `lightning-rec` does after a run that ended well: every group destroyed and collected while the
    # interpreter is whole (one left to the exit made gloo abort the process now and then, SIGABRT: 2 of 8 two-rank
    # CLI predicts said "terminate called without an active exception", and torchrun reported the job failed)
    import gc

    import torch.distributed as dist

    from lightning_rec.strategy import close_process_groups

    close_process_groups()
    assert not dist.is_initialized() and not [o for o in gc.get_objects() if isinstance(o, dist.ProcessGroup)]
    return rows


def _predict_two_ranks_in_pieces(rank: int, world_size: int, ckpt: Path, root: Path, pipeline: bool, chunk_bytes: int,
                                 spill_bytes: int, predict_path: Path = UNLABELLED,
                                 *extra: str) -> tuple[int, list[int], int]:
    """_predict_two_ranks with the writer's gather in pieces of `chunk_bytes` and its rows spilled to disk past
    `spill_bytes`: the rows, the pickled size of each object this rank handed to gather_object, and the most rows
    the writer held in memory at once."""
    import pickle

    import torch.distributed as dist

    from lightning_rec.predict import PredictionWriter

    sizes: list[int] = []
    gather_object = dist.gather_object
    peaks: list[int] = []
    epoch_end = PredictionWriter.on_predict_epoch_end

    def recording(obj, *args, **kwargs):
        sizes.append(len(pickle.dumps(obj)))
        return gather_object(obj, *args, **kwargs)

    def keeping_the_peak(self, *args):
        epoch_end(self, *args)
        peaks.append(self.held_rows_peak)

    PredictionWriter.gather_chunk_bytes, PredictionWriter.spill_bytes = chunk_bytes, spill_bytes
    PredictionWriter.on_predict_epoch_end = keeping_the_peak
    dist.gather_object = recording
    return _predict_two_ranks(rank, world_size, ckpt, root, pipeline, predict_path, *extra), sizes, peaks[0]


@needs_criteo
@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipelined"])
def test_predict_at_two_ranks_with_sharded_tables_writes_each_row_once_in_order(criteo_ckpt, tmp_path, pipeline):
    # pipelined: rows reach rank 0 in pieces of at most 4 KB per rank (~256 rows of 16 bytes), not one object the
    # size of a rank's share (on NCCL gather_object makes it one GPU tensor, W of them on rank 0), and each rank
    # spills its rows to disk past 4 KB (a batch of 999 rows: every batch)
    chunk = 4096 if pipeline else 64 << 20
    rows, sizes, _ = zip(*run_ranks(_predict_two_ranks_in_pieces, 2, criteo_ckpt, tmp_path, pipeline, chunk, chunk,
                                    timeout=180))
    assert rows == (1999, 1999)  # every rank returns once the file is whole
    assert max(sizes[1]) < chunk + 1024, sizes
    # rank 1 sends its rows: in one piece, or in ceil(999 / 256) = 4 (plus the columns it has, and rounds in which
    # rank 0 asks it for nothing)
    assert sum(s > 1024 for s in sizes[1]) == (4 if pipeline else 1), sizes
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no run file left
    got = _read(tmp_path / "preds.csv")
    want, _ = _forward(criteo_ckpt, UNLABELLED, tmp_path)
    np.testing.assert_array_equal(got["row"], np.arange(1999))
    np.testing.assert_allclose(got["probability"], want, rtol=0, atol=1e-6)  # one id per bag: same sums


def _predict_two_ranks_rank0_disk_full(rank: int, world_size: int, ckpt: Path, root: Path) -> str:
    """_predict_two_ranks where rank 0's disk fills after the first piece of the file: what each rank raised."""
    import errno

    from lightning_rec.predict import PredictionWriter
    from lightning_rec.predict_rows import TableWriter

    if rank == 0:
        write = TableWriter.write

        def filling(self, table):
            if self.num_rows:
                raise OSError(errno.ENOSPC, "No space left on device")
            write(self, table)

        TableWriter.write = filling
    PredictionWriter.gather_chunk_bytes = 4096  # pieces of ~256 rows: the disk fills with rows still to come
    try:
        _predict_two_ranks(rank, world_size, ckpt, root, False)
    except BaseException as e:  # noqa: BLE001 - the test reads it
        return f"{type(e).__name__}: {e}"
    return "no error"


@needs_criteo
def test_rank_0_failing_to_write_stops_every_rank_and_leaves_no_file(criteo_ckpt, tmp_path):
    import time

    start = time.monotonic()
    said = run_ranks(_predict_two_ranks_rank0_disk_full, 2, criteo_ckpt, tmp_path, timeout=120)
    assert "No space left on device" in said[0], said
    assert "rank 0 could not write the predictions to" in said[1] and "no file was written" in said[1], said
    assert time.monotonic() - start < 60  # rank 1 was told at the next round; it did not wait out a timeout
    assert not (tmp_path / "preds.csv").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file, no run


@needs_criteo
@pytest.mark.parametrize("block_bytes", [32768, 1 << 20], ids=["blocks_dealt", "rows_dealt"])
def test_predict_at_two_ranks_from_a_text_stream_writes_each_row_once_in_order(criteo_ckpt, tmp_path, block_bytes):
    """A stream's rows carry an order key (Batch.row_ids); it was refused at 2 ranks before. Pipelined and plain
    read the same batches; the pipelined loop is the one with more between the loader and the writer."""
    rows = run_ranks(_predict_two_ranks, 2, criteo_ckpt, tmp_path, True, UNLABELLED, "--data.streaming=true",
                     f"--data.block_bytes={block_bytes}", timeout=180)
    assert rows == [1999, 1999]
    got = _read(tmp_path / "preds.csv")
    want, _ = _forward(criteo_ckpt, UNLABELLED, tmp_path)
    np.testing.assert_array_equal(got["row"], np.arange(1999))
    np.testing.assert_allclose(got["probability"], want, rtol=0, atol=1e-6)


@needs_criteo
def test_predict_at_two_ranks_from_a_preprocessed_directory_writes_each_row_once_in_order(criteo_ckpt, tmp_path):
    """A shard directory's rows carry their place (Batch.row_ids); it was refused at 2 ranks before."""
    from lightning_rec.data.criteo_shards import CriteoShardDataset
    from lightning_rec.data.preprocess import preprocess_criteo
    from lightning_rec.models import DLRMModule

    shards = tmp_path / "shards"  # 700 + 700 + 599 rows: rank 1's share starts inside the first shard
    preprocess_criteo([UNLABELLED], shards, num_embeddings=1000, rows_per_shard=700, shuffle_rows=False,
                      progress=False)
    # each rank's share is one block of rows (0..999, 1000..1998): rank 0 writes its own before it needs any of
    # rank 1's, which it holds a piece of at a time; batches of 100, runs spilled past 4 KB (300 rows)
    (rows0, _, peak0), (rows1, _, peak1) = run_ranks(_predict_two_ranks_in_pieces, 2, criteo_ckpt, tmp_path, False,
                                                     4096, 4096, shards, "--data.batch_size=100", timeout=180)
    assert rows0 == rows1 == 1999
    assert peak0 <= 2 * 256 and peak1 <= 300, (peak0, peak1)  # it held all 1999 rows on rank 0 before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    got = _read(tmp_path / "preds.csv")
    module = DLRMModule.load_from_checkpoint(criteo_ckpt, map_location="cpu").eval()
    with torch.no_grad():  # the unsharded module over the directory in its own order, one process
        want = np.concatenate([torch.sigmoid(module(b.dense_features, b.sparse_features)).numpy()
                               for b in CriteoShardDataset(shards, 512, rank=0, world_size=1)])
    np.testing.assert_array_equal(got["row"], np.arange(1999))
    np.testing.assert_allclose(got["probability"], want, rtol=0, atol=1e-6)


# each stage reads only its own paths ------------------------------------------------------------------------


@needs_criteo
def test_each_stage_checks_only_its_paths(tmp_path):
    from lightning_rec.data import CriteoDataModule

    missing = str(tmp_path / "nope.tsv")
    dm = CriteoDataModule(train_path=missing, val_path=missing, predict_path=str(UNLABELLED),
                          cache_dir=str(tmp_path / "cache"), batch_size=512)
    dm.setup("predict")  # the missing train/val files are not read
    assert set(dm.datasets) == {"predict"} and len(dm.datasets["predict"]) == 1999
    with pytest.raises(ValueError, match="nope.tsv"):
        dm.setup("fit")
    with pytest.raises(ValueError, match=r"no predict_path, which predict needs: set --data.predict_path"):
        CriteoDataModule(train_path=str(LABELLED)).setup("predict")
    with pytest.raises(ValueError, match=r"no val_path, which validate needs: set --data.val_path"):
        CriteoDataModule(train_path=str(LABELLED)).setup("validate")


# bad input: one line, naming the fix ------------------------------------------------------------------------


def _main(monkeypatch, *args: str) -> str:
    """`lightning-rec ARGS` in this process: the message it exits with (sys.exit prints it, no traceback)."""
    from lightning_rec.cli import main

    monkeypatch.setattr(sys, "argv", ["lightning-rec", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert isinstance(exit_.value.code, str), exit_.value.code  # a message, not a status from a deeper error
    return exit_.value.code


@needs_criteo
def test_predict_errors_name_the_fix(tmp_path, monkeypatch, capsys):
    from lightning_rec.cli import run_cli

    base = ["predict", *_criteo_args(tmp_path)]
    message = _main(monkeypatch, *base)  # the recipe names no predict_path (nor test_path)
    assert message.startswith("lightning-rec predict: error: CriteoDataModule has no predict_path")
    assert "--data.predict_path=FILE" in message
    out = tmp_path / "taken.csv"
    out.write_text("keep me\n")
    message = _main(monkeypatch, *base, f"--data.predict_path={UNLABELLED}", f"--predictions.output_path={out}")
    assert f"prediction output {out} exists" in message and "--predictions.overwrite=true" in message
    assert out.read_text() == "keep me\n"  # refused before predicting: nothing lost
    message = _main(monkeypatch, *base, f"--data.predict_path={UNLABELLED}",
                    f"--predictions.output_path={tmp_path / 'p.json'}")
    assert "unknown format '.json'" in message and ".parquet" in message
    message = _main(monkeypatch, *base, f"--data.predict_path={UNLABELLED}", f"--ckpt_path={tmp_path / 'nope.ckpt'}")
    assert message == (f"lightning-rec predict: error: --ckpt_path {tmp_path / 'nope.ckpt'} does not exist: check "
                       f"the path (a fit writes its checkpoints where ModelCheckpoint's dirpath says)")
    run_cli([*base, f"--data.predict_path={UNLABELLED}", f"--predictions.output_path={out}",
             "--predictions.overwrite=true"])
    assert f"predictions: 1999 rows written to {out}" in capsys.readouterr().out
    assert _read(out)["row"].shape == (1999,)


# two-tower: each user's top unseen items --------------------------------------------------------------------


def _two_tower_args(root: Path, *extra: str) -> list[str]:
    return ["--config", "recipes/configs/matrix_factorization_movielens.yaml", f"--data.init_args.data_dir={ML100K}",
            f"--trainer.default_root_dir={root}", *QUIET, *extra]


@pytest.fixture(scope="module")
def two_tower_ckpt(tmp_path_factory) -> Path:
    from lightning_rec.cli import run_cli

    if not (ML100K / "u.data").is_file():
        pytest.skip("shared ml-100k not present")
    root = tmp_path_factory.mktemp("two_tower_fit")
    run_cli(["fit", *_two_tower_args(root, "--trainer.max_epochs=1", "--trainer.limit_train_batches=4",
                                     "--trainer.limit_val_batches=0", "--trainer.enable_checkpointing=true",
                                     "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={root}",
                                     "--trainer.callbacks.every_n_train_steps=4", "--trainer.callbacks.filename=last")])
    return root / "last.ckpt"


@needs_ml100k
def test_two_tower_predict_writes_each_users_top_unseen_items(two_tower_ckpt, tmp_path):
    from lightning_rec.cli import run_cli

    out = tmp_path / "top.parquet"
    cli = run_cli(["predict", *_two_tower_args(tmp_path), f"--ckpt_path={two_tower_ckpt}",
                   "--model.init_args.predict_top_k=5", f"--predictions.output_path={out}"])
    got = pq.read_table(out).to_pydict()
    dm, module = cli.datamodule, cli.model
    assert list(got) == ["row", "user", "item", "score"]
    assert got["row"] == list(range(dm.num_users)) and got["user"] == dm.user_ids.tolist()
    # the reference: every user against every item, the items it saw in training and validation excluded
    test = dm.datasets["test"][list(range(dm.num_users))]
    with torch.no_grad():
        scores = module.model.user_embeddings(test.user_features) @ module.model.item_embeddings(dm.item_catalog()).t()
    rows = torch.repeat_interleave(torch.arange(dm.num_users), test.exclude_offsets.diff())
    scores[rows, test.exclude_items] = float("-inf")
    top = torch.topk(scores, 5, dim=1)
    np.testing.assert_allclose(np.array(got["score"]), top.values.numpy(), rtol=1e-5, atol=1e-5)
    assert np.array(got["item"]).tolist() == dm.item_ids[top.indices.numpy()].tolist()
    # no recommended item is one the user has seen
    seen = {(int(u), int(i)) for u, i in zip(rows, test.exclude_items)}
    index_of = {int(v): j for j, v in enumerate(dm.item_ids)}
    assert not [(u, i) for u, items in enumerate(got["item"]) for i in items if (u, index_of[i]) in seen]


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_two_tower_predict_names_users_and_items_by_their_string_ids(tmp_path, suffix):
    """A log keyed by strings (shop user ids, ASINs): predictions name the data's own ids, not positions."""
    import lightning.pytorch as L

    from lightning_rec import PredictionWriter
    from lightning_rec.data import MovieLensDataModule
    from lightning_rec.models import TwoTowerModule
    from tests.test_movielens import _string_id_log

    log = _string_id_log()
    folder = tmp_path / "shop"
    folder.mkdir()
    (folder / "ratings.csv").write_text("user,item,rating,timestamp\n" + "".join(f"{u},{i},1,{t}\n" for u, i, t in log))
    dm = MovieLensDataModule(str(folder), split="loo", side_features=False, batch_size=64, eval_batch_size=16)
    module = TwoTowerModule(embedding_dim=8, ks=[5], predict_top_k=3)
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
              default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="ids are not integers"):
        L.Trainer(max_epochs=1, enable_checkpointing=False, **kw).fit(module, dm)
    out = tmp_path / f"top{suffix}"
    L.Trainer(callbacks=[PredictionWriter(str(out))], **kw).predict(module, dm, return_predictions=False)
    got = pq.read_table(out).to_pydict() if suffix == ".parquet" else {k: v.tolist() for k, v in _read(out).items()}
    assert got["user"] == dm.user_ids.tolist()
    items = got["item"] if suffix == ".parquet" else [list(t) for t in zip(*(got[f"item_{k}"] for k in (1, 2, 3)))]
    assert all(len(row) == 3 for row in items) and set(sum(items, [])) <= set(dm.item_ids.tolist())
    module.eval()
    test = dm.datasets["test"][list(range(dm.num_users))]
    with torch.no_grad():
        scores = module.model.user_embeddings(test.user_features) @ module.model.item_embeddings(dm.item_catalog()).t()
    rows = torch.repeat_interleave(torch.arange(dm.num_users), test.exclude_offsets.diff())
    scores[rows, test.exclude_items] = float("-inf")
    assert items == dm.item_ids[torch.topk(scores, 3, dim=1).indices.numpy()].tolist()


def _two_tower_two_ranks(rank: int, world_size: int, ckpt: Path, root: Path) -> None:
    from lightning_rec.cli import run_cli

    run_cli(["predict", *_two_tower_args(root), "--trainer.strategy=rec", f"--trainer.devices={world_size}",
             f"--ckpt_path={ckpt}", f"--predictions.output_path={root / 'top2.csv'}",
             "--model.init_args.predict_top_k=3"])


@needs_ml100k
def test_two_tower_predict_at_two_ranks_equals_one_process(two_tower_ckpt, tmp_path):
    from lightning_rec.cli import run_cli

    run_cli(["predict", *_two_tower_args(tmp_path), f"--ckpt_path={two_tower_ckpt}",
             f"--predictions.output_path={tmp_path / 'top1.csv'}", "--model.init_args.predict_top_k=3"])
    run_ranks(_two_tower_two_ranks, 2, two_tower_ckpt, tmp_path, timeout=180)
    one, two = _read(tmp_path / "top1.csv"), _read(tmp_path / "top2.csv")
    assert list(two) == ["row", "user", "item_1", "item_2", "item_3", "score_1", "score_2", "score_3"]
    np.testing.assert_array_equal(two["row"], one["row"])
    for k in ("user", "item_1", "item_2", "item_3"):
        np.testing.assert_array_equal(two[k], one[k], err_msg=k)
    np.testing.assert_allclose(two["score_1"], one["score_1"], rtol=1e-5, atol=1e-6)


# the writer's own rules, without a Trainer ------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".parquet"])
def test_rows_come_out_once_in_input_order_and_an_all_nan_column_is_left_out(tmp_path, suffix):
    from lightning_rec.predict_rows import RunSpill, SortedMerge, TableWriter, written_columns

    # two ranks' rows, each in its own order, with the padding repeats of a distributed sampler (rows 0 and 1 twice)
    ranks = [np.array([0, 2, 4, 0]), np.array([3, 1, 1])]
    spills = [RunSpill(16, lambda r=r: Path(tmp_path / f"rank{r}").resolve()) for r in range(2)]
    for rank, rows in enumerate(ranks):
        (tmp_path / f"rank{rank}").mkdir()
        for lo in range(0, len(rows), 2):  # batches of 2 rows, spilled past 16 bytes: one run per batch
            row = rows[lo:lo + 2]
            spills[rank].add({"row": row, "p": row * 0.5, "label": np.full(len(row), np.nan),
                              "item": np.stack([row * 10, row * 10 + 1], axis=1),
                              # string ids (a shop's users), of another width in each batch: spilled, merged, written
                              "user": np.array([f"u{'x' * int(r)}" for r in row])})
    assert [s.num_runs for s in spills] == [2, 2]
    writer = TableWriter(tmp_path / f"out{suffix}", written_columns(spills[0].columns, spills[0].all_nan))
    merge, streams = SortedMerge(2), [s.stream(64) for s in spills]
    while not merge.done:
        for r in merge.needs():
            merge.feed(r, next(streams[r], None))
        writer.write(merge.pop())
    writer.close()
    for s in spills:
        s.close()
    assert [p.name for p in tmp_path.iterdir()] == [f"out{suffix}"]  # runs removed, the file renamed into place
    got = _read(tmp_path / f"out{suffix}")
    if suffix == ".parquet":
        assert list(got) == ["row", "p", "item", "user"]
        assert [list(x) for x in got["item"]] == [[r * 10, r * 10 + 1] for r in range(5)]
    else:
        assert list(got) == ["row", "p", "item_1", "item_2", "user"]
        np.testing.assert_array_equal(got["item_2"], np.arange(5) * 10 + 1)
    assert [str(u) for u in got["user"]] == [f"u{'x' * r}" for r in range(5)]
    np.testing.assert_array_equal(got["row"], np.arange(5))
    np.testing.assert_array_equal(got["p"], np.arange(5) * 0.5)


@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
def test_string_ids_holding_a_separator_or_a_quote_are_quoted(tmp_path, suffix):
    """An id such as "Smith, J" (a log's CSV reads quoted ids) made pyarrow's writer refuse the batch ("CSV values may
    not contain structural characters"): predict failed after every row was computed. A batch without such ids is
    written as before, unquoted."""
    from lightning_rec.predict_rows import write_table

    users = np.array(["Smith, J", 'say "hi"', "tab\there", "line\nbreak", "plain"])
    write_table({"row": np.arange(5), "user": users, "item": np.array([["a,b", "c"]] * 5)}, tmp_path / f"q{suffix}")
    got = _read(tmp_path / f"q{suffix}")
    assert [str(u) for u in got["user"]] == users.tolist() and set(map(str, got["item_1"])) == {"a,b"}
    write_table({"row": np.arange(2), "user": np.array(["A1", "B2"])}, tmp_path / f"plain{suffix}")
    sep = "," if suffix == ".csv" else "\t"
    assert (tmp_path / f"plain{suffix}").read_text() == f"row{sep}user\n0{sep}A1\n1{sep}B2\n"


def test_merge_of_spilled_runs_equals_a_sort_and_holds_a_chunk_per_stream(tmp_path):
    """Random shares (sorted or not, repeats within and across ranks, an empty one), spilled in runs and merged
    rank by rank: the rows of np.unique, each with its first copy's values, holding at most a chunk per stream."""
    from lightning_rec.predict_rows import RunSpill, SortedMerge

    rng = np.random.default_rng(0)
    for trial in range(20):
        ranks = int(rng.integers(1, 5))
        shares = [rng.integers(0, 300, size=int(rng.integers(0, 400))) for _ in range(ranks)]
        if trial % 2:
            shares = [np.sort(s) for s in shares]  # in input order, as a sampler gives them
        spills = []
        for r, share in enumerate(shares):
            directory = tmp_path / f"t{trial}r{r}"
            spill = RunSpill(int(rng.integers(16, 2000)), lambda d=directory: (d.mkdir(), d)[1])
            for lo in range(0, len(share), 37):
                rows = share[lo:lo + 37].astype(np.int64)
                spill.add({"row": rows, "v": rows * 2 + r, "w": np.stack([rows, -rows], 1).astype(np.float32)})
            spills.append(spill)
        chunk_bytes = int(rng.integers(16, 3000))
        merge, streams = SortedMerge(ranks), [s.stream(chunk_bytes) for s in spills]
        out = []
        while not merge.done:
            for r in merge.needs():
                merge.feed(r, next(streams[r], None))
            out.append(merge.pop())
        got = {k: np.concatenate([t[k] for t in out if t]) for k in ("row", "v", "w")} if any(out) else None
        every = np.concatenate(shares)
        want_rows = np.unique(every)
        if got is None:
            assert len(want_rows) == 0
            continue
        np.testing.assert_array_equal(got["row"], want_rows)
        np.testing.assert_array_equal(got["w"][:, 1], -want_rows.astype(np.float32))
        # the first copy: the lowest rank that has the row (a rank's copies of one row are alike)
        owner = np.array([min(r for r, s in enumerate(shares) if row in s) for row in want_rows])
        np.testing.assert_array_equal(got["v"], want_rows * 2 + owner)
        per_row = 8 + 8 + 8
        assert merge.held_rows_peak <= ranks * max(1, chunk_bytes // per_row)
        for s in spills:
            s.close()
        assert not any(tmp_path.glob(f"t{trial}r*/*"))


def test_a_failed_predict_leaves_no_run_and_no_partial_file(tmp_path, caplog):
    import logging

    import lightning.pytorch as L

    from lightning_rec.predict import PredictionWriter

    class Failing(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def predict_step(self, batch, batch_idx):
            if batch_idx == 5:
                raise RuntimeError("the model failed at batch 5")
            return {"score": self.layer(batch[0]).squeeze(1)}

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(80, 1)), batch_size=10)
    writer = PredictionWriter(str(tmp_path / "out" / "p.csv"))
    writer.spill_bytes = 64  # every batch is a run on disk
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, callbacks=[writer],
                        default_root_dir=tmp_path)
    with pytest.raises(RuntimeError, match="failed at batch 5"):
        trainer.predict(Failing(), data)
    assert list((tmp_path / "out").iterdir()) == []  # the runs of batches 0-4 removed, no temporary file
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, callbacks=[writer],
                        default_root_dir=tmp_path)
    module = Failing()
    module.predict_step = lambda batch, batch_idx: {"score": batch[0].squeeze(1)}
    caplog.set_level(logging.INFO)
    trainer.predict(module, data)
    # Lightning kept the outputs too (its default): the writer says how not to
    assert [r for r in caplog.records if "trainer.predict(..., return_predictions=False) does not" in r.getMessage()]
    assert writer.num_rows == 80 and writer.held_rows_peak == 10  # spilled each batch
    got = _read(tmp_path / "out" / "p.csv")["score"].astype(np.float32)  # float32 written in its shortest form
    np.testing.assert_array_equal(got, data.dataset.tensors[0][:, 0].numpy())
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["p.csv"]


def test_two_predict_dataloaders_are_refused_by_the_writer_and_returned_apart_without_it(tmp_path):
    # each loader numbers its rows from 0: the writer took the second loader's rows for repeats of the first's and
    # wrote one file of the first's 33 rows (rows of either loader), the second's 20 lost without a word
    import lightning.pytorch as L

    from lightning_rec.data import SyntheticCriteoDataModule
    from lightning_rec.data.batch import make_eval_loader
    from lightning_rec.models import DLRMModule
    from lightning_rec.predict import PredictionWriter

    dm = SyntheticCriteoDataModule(num_train_samples=1, num_val_samples=20, num_test_samples=33, num_sparse_features=2,
                                   num_embeddings_per_feature=10, num_signal_features=1)
    dm.setup("fit"), dm.setup("test")
    loaders = [make_eval_loader(dm.datasets[split], 16, num_workers=0) for split in ("test", "val")]
    module = DLRMModule(num_embeddings_per_feature=10, embedding_dim=4, sparse_feature_names=["C1", "C2"],
                        dense_arch_layer_sizes=[4], over_arch_layer_sizes=[1])
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"given 2 dataloaders: predict each in its own trainer.predict call"):
        L.Trainer(callbacks=[PredictionWriter(str(tmp_path / "p.csv"))], **kw).predict(module, loaders)
    assert list(tmp_path.iterdir()) == []
    # without the writer, Lightning returns each loader's outputs (DLRMModule.predict_step takes dataloader_idx, which
    # Lightning asks for with more than one loader)
    got = L.Trainer(**kw).predict(module, loaders)
    assert [sum(len(b["probability"]) for b in outs) for outs in got] == [33, 20]


def test_predict_under_bf16_mixed_writes_float32_probabilities(tmp_path):
    # the step's output was bfloat16, which has no numpy type: "TypeError: Got unsupported ScalarType BFloat16"
    import lightning.pytorch as L

    from lightning_rec.data import SyntheticCriteoDataModule
    from lightning_rec.models import DLRMModule
    from lightning_rec.predict import PredictionWriter

    dm = SyntheticCriteoDataModule(num_train_samples=1, num_val_samples=0, num_test_samples=21, val_batch_size=8,
                                   num_sparse_features=2, num_embeddings_per_feature=10, num_signal_features=1)
    module = DLRMModule(num_embeddings_per_feature=10, embedding_dim=4, sparse_feature_names=["C1", "C2"],
                        dense_arch_layer_sizes=[4], over_arch_layer_sizes=[1])
    writer = PredictionWriter(str(tmp_path / "p.parquet"))
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, precision="bf16-mixed",
                        callbacks=[writer])
    returned = torch.cat([b["probability"] for b in trainer.predict(module, dm)])
    got = _read(tmp_path / "p.parquet")
    np.testing.assert_array_equal(got["row"], np.arange(21))
    assert returned.dtype == torch.float32 and got["probability"].dtype == np.float32
    np.testing.assert_array_equal(got["probability"], returned.numpy())
    want = []
    for lo in range(0, 21, 8):  # the loader's batches (a bfloat16 GEMM may round another batch size otherwise)
        batch = dm.datasets["test"].__getitems__(list(range(lo, min(lo + 8, 21))))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the bfloat16 logit, sigmoid in float32
            want.append(torch.sigmoid(module(batch.dense_features, batch.sparse_features).float()))
    want = torch.cat(want)
    torch.testing.assert_close(returned, want, atol=0, rtol=0)
    assert len(set(returned.tolist())) > 10  # not rounded onto a few bfloat16 values


def test_writer_refuses_an_unknown_format_or_an_existing_file(tmp_path):
    from lightning_rec import PredictionWriter

    with pytest.raises(ValueError, match=r"unknown format '.txt'.*\.csv, \.tsv, \.parquet"):
        PredictionWriter(str(tmp_path / "p.txt"))
    (tmp_path / "p.csv").write_text("x\n")
    trainer = type("T", (), {"default_root_dir": str(tmp_path)})()
    with pytest.raises(ValueError, match="exists: give another path, or overwrite=True"):
        PredictionWriter(str(tmp_path / "p.csv")).resolve_path(trainer)
    assert PredictionWriter(str(tmp_path / "p.csv"), overwrite=True).resolve_path(trainer) == tmp_path / "p.csv"
    (tmp_path / "predictions.csv").write_text("x\n")
    assert PredictionWriter().resolve_path(trainer) == tmp_path / "predictions_1.csv"
    # a directory that cannot be made is found before predicting (it was found writing the file, after it)
    (tmp_path / "a_file").write_text("x\n")
    with pytest.raises(ValueError, match=r"p.csv: cannot write in .*a_file \(it is a file\): give a path in a "
                                         r"directory you can write \(--predictions.output_path"):
        PredictionWriter(str(tmp_path / "a_file" / "p.csv")).resolve_path(trainer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "p.csv", "predictions.csv"]  # no probe left


def test_batches_of_other_dtypes_are_widened_and_other_shapes_refused(tmp_path):
    from lightning_rec.predict_rows import RunSpill, TableWriter, written_columns

    spill = RunSpill(1 << 20, lambda: tmp_path)
    spill.add({"row": np.arange(2), "p": np.array([0.25, 0.5], np.float32)})
    spill.add({"row": np.arange(2, 4), "p": np.array([1 / 3, 0.75], np.float64)})  # a float64 batch after float32
    writer = TableWriter(tmp_path / "p.parquet", written_columns(spill.columns, spill.all_nan))
    for table in spill.stream(1 << 20):
        writer.write(table)
    writer.close()
    np.testing.assert_array_equal(_read(tmp_path / "p.parquet")["p"], [0.25, 0.5, 1 / 3, 0.75])  # none narrowed
    spill = RunSpill(1 << 20, lambda: tmp_path)
    spill.add({"row": np.arange(2), "item": np.zeros((2, 5))})
    with pytest.raises(ValueError, match=r"column 'item' of shape \[rows, 3\] after \[rows, 5\]: return the same "
                                         r"shape per row in every batch \(pad a shorter top-K list"):
        spill.add({"row": np.arange(2, 4), "item": np.zeros((2, 3))})
    with pytest.raises(ValueError, match=r"the columns \['row', 'score'\] after \['item', 'row'\]: return the same"):
        spill.add({"row": np.arange(2, 4), "score": np.zeros(2)})


def test_a_full_disk_while_spilling_names_the_fix_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    from lightning_rec.predict_rows import RunSpill

    directory = tmp_path / "runs"
    spill = RunSpill(16, lambda: (directory.mkdir(), directory)[1])
    spill.add({"row": np.arange(4)})  # the first run is written
    real_save = np.save

    def full(path, *args, **kwargs):
        real_save(path, *args, **kwargs)  # a part of the run is on disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "save", full)
    with pytest.raises(OSError, match=r"written to disk beside the output file, and writing .*runs failed \(No space "
                                      r"left on device\): free space there, or write the predictions to another disk "
                                      r"\(--predictions.output_path\)"):
        spill.add({"row": np.arange(4, 8)})
    spill.close()
    assert not directory.exists()
