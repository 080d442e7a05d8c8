"""`lightning-rec preprocess` and the shard loader: same rows as the cache path, resume, vocabulary, ranks.

Real data is read from ../shared/data (never copied into the repo); those tests skip without it.
"""

from __future__ import annotations

import gzip
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA

import lightning_rec.data.criteo.preprocess as pre
from lightning_rec.cli import preprocess_main
from lightning_rec.data import CriteoDataModule, CriteoDataset, build_criteo_cache
from lightning_rec.data.criteo_parse import native_parser_available
from lightning_rec.data.criteo_shards import CriteoShardDataset, load_manifest, rank_segments
from lightning_rec.data.preprocess import preprocess_criteo

CRITEO = SHARED_DATA / "criteo"
TRAIN = CRITEO / "criteo_kaggle_train_sample.tsv"
RAGGED = CRITEO / "other/pytorch-fm_criteo_train_head1000_trailing-tabs-stripped.txt"
pytestmark = [
    pytest.mark.skipif(not CRITEO.is_dir(), reason="shared Criteo samples not present"),
    pytest.mark.skipif(not native_parser_available(), reason="lightning_rec._C is not built"),
]
SIZES = [500 + 11 * j for j in range(26)]


def run(tmp_path: Path, name: str, inputs=(TRAIN, RAGGED), **kw) -> tuple[Path, dict]:
    out = tmp_path / name
    kw = {"num_embeddings": SIZES, "rows_per_shard": 1000, "block_mb": 1, "progress": False, **kw}
    return out, preprocess_criteo([str(p) for p in inputs], out, **kw)


def all_rows(directory, **kw):
    ds = CriteoShardDataset(directory, 256, **kw)
    batches = list(ds)
    return (torch.cat([b.labels for b in batches]), torch.cat([b.dense_features for b in batches]),
            torch.cat([b.sparse_features.values().view(26, -1) for b in batches], dim=1))


def test_shards_hold_the_rows_of_the_cache_path(tmp_path):
    """Unshuffled shards read in order == CriteoDataset (Arrow cache) batches of the same files."""
    out, manifest = run(tmp_path, "s", shuffle_rows=False)
    assert manifest["num_rows"] == 4380 + 1000 and manifest["num_embeddings_per_feature"] == SIZES
    assert [r["num_padded_rows"] for r in manifest["reports"]] == [0, 498]
    label, dense, ids_FN = all_rows(out)
    want = [CriteoDataset(build_criteo_cache(p, tmp_path / "cache")[0], SIZES)[:] for p in (TRAIN, RAGGED)]
    assert torch.equal(label, torch.cat([b.labels for b in want]))
    torch.testing.assert_close(dense, torch.cat([b.dense_features for b in want]), rtol=1e-6, atol=0)
    assert torch.equal(ids_FN, torch.cat([b.sparse_features.values().view(26, -1) for b in want], dim=1))


def test_shuffled_shards_hold_the_same_rows(tmp_path):
    a, _ = run(tmp_path, "a", shuffle_rows=False)
    b, manifest = run(tmp_path, "b", seed=3)
    la, da, _ = all_rows(a)
    lb, db, _ = all_rows(b)
    assert not torch.equal(da, db)  # shuffled within shards
    assert la.sum() == lb.sum() and torch.allclose(da.double().sum(0), db.double().sum(0))
    assert len(manifest["shards"]) > 2


def test_unlabelled_inputs_keep_their_order_for_predict(tmp_path):
    """Rows without labels are for predict, whose output follows the directory's order: not shuffled unless asked.
    Predicting from a shuffled directory says that its row column is not the input file's line order."""
    unlabelled = CRITEO / "criteo_kaggle_test_head1999_nolabel.tsv"
    out, manifest = run(tmp_path, "test", inputs=(unlabelled,))
    assert manifest["options"]["shuffle_rows"] is False
    _, dense, _ = all_rows(out)
    want = CriteoDataset(build_criteo_cache(unlabelled, tmp_path / "cache")[0], SIZES)[:]
    torch.testing.assert_close(dense, want.dense_features, rtol=1e-6, atol=0)
    shuffled, manifest = run(tmp_path, "train", inputs=(TRAIN,))
    assert manifest["options"]["shuffle_rows"] is True
    dm = CriteoDataModule(predict_path=str(shuffled), num_embeddings_per_feature=SIZES)
    with pytest.warns(UserWarning, match="shuffled the rows within each shard.*--no_shuffle_rows"):
        dm.setup("predict")


def _run_dying_mid_shard(tmp_path: Path, monkeypatch, at: int, name: str, **kw) -> None:
    """A run that dies in its `at`-th shard: that shard's files are written, its record is not."""
    real_write, calls = pre._write_shard, {"n": 0}

    def dying_write(*args, **kwargs):
        calls["n"] += 1
        record = real_write(*args, **kwargs)
        if calls["n"] == at:
            (tmp_path / name / f"{record['name']}.json").unlink()
            raise KeyboardInterrupt
        return record

    monkeypatch.setattr(pre, "_write_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, name, **kw)
    monkeypatch.setattr(pre, "_write_shard", real_write)


def test_interrupted_run_resumes_without_lost_or_duplicated_rows(tmp_path, monkeypatch, caplog):
    ref_dir, ref = run(tmp_path, "ref")
    _run_dying_mid_shard(tmp_path, monkeypatch, 3, "run")  # dies in the 3rd shard: its files, no record
    assert not (tmp_path / "run" / "manifest.json").exists()
    with pytest.raises(ValueError, match="still being written or was interrupted"):
        load_manifest(tmp_path / "run")
    # a finished shard whose file was damaged since is redone too
    first = json.loads((tmp_path / "run" / "shard-000-00001.json").read_text())
    with open(tmp_path / "run" / f"{first['name']}.dense.npy", "r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01")
    with caplog.at_level(logging.WARNING):
        _, resumed = run(tmp_path, "run")
    assert "does not match its sha256" in caplog.text
    assert [(s["name"], s["rows"], s["sha256"]) for s in resumed["shards"]] == [
        (s["name"], s["rows"], s["sha256"]) for s in ref["shards"]
    ]
    assert resumed["reports"] == ref["reports"] and resumed["num_rows"] == ref["num_rows"]
    _, again = run(tmp_path, "run")  # a finished run: nothing to do, same manifest
    assert again["shards"] == resumed["shards"]
    with pytest.raises(ValueError, match="other inputs or options"):
        run(tmp_path, "run", seed=9)


def test_gzip_input_and_resume_inside_it(tmp_path, monkeypatch):
    gz = tmp_path / "day_0.gz"
    gz.write_bytes(gzip.compress(TRAIN.read_bytes()))
    ref_dir, ref = run(tmp_path, "plain", inputs=(TRAIN,), block_mb=1, rows_per_shard=1)
    real_write, calls = pre._write_shard, {"n": 0}

    def dying_write(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_write(*args, **kwargs)

    monkeypatch.setattr(pre, "_write_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "gz", inputs=(gz,), block_mb=1, rows_per_shard=1)
    monkeypatch.setattr(pre, "_write_shard", real_write)
    _, got = run(tmp_path, "gz", inputs=(gz,), block_mb=1, rows_per_shard=1)
    assert [s["sha256"] for s in got["shards"]] == [s["sha256"] for s in ref["shards"]]


def test_min_frequency_vocabulary(tmp_path):
    out, manifest = run(tmp_path, "v", inputs=(TRAIN,), min_frequency=3, shuffle_rows=False, num_embeddings=2**20)
    _, _, ids_FN = all_rows(out)
    raw = CriteoDataset(build_criteo_cache(TRAIN, tmp_path / "cache")[0], 2**20, missing_categorical="empty_bag")
    hashed_FN = torch.full((26, 4380), -1, dtype=torch.int64)
    batch = raw[:]
    lengths = batch.sparse_features.lengths().view(26, -1).bool()
    hashed_FN[lengths] = batch.sparse_features.values()
    for f in range(26):
        values, counts = np.unique(hashed_FN[f][hashed_FN[f] >= 0].numpy(), return_counts=True)
        kept = values[counts >= 3]
        want = np.zeros(4380, dtype=np.int64)
        col = hashed_FN[f].numpy()
        hit = np.isin(col, kept)
        want[hit] = np.searchsorted(kept, col[hit]) + 1  # frequent ids 1..V in id order; rare and missing 0
        assert np.array_equal(ids_FN[f].numpy(), want), f
        assert manifest["num_embeddings_per_feature"][f] == kept.size + 1
    # val data reuses train's vocabulary: same ids for the same values
    val_dir, val = run(tmp_path, "val", inputs=(TRAIN,), vocab_from=out, shuffle_rows=False, num_embeddings=2**20)
    assert val["num_embeddings_per_feature"] == manifest["num_embeddings_per_feature"]
    assert torch.equal(all_rows(val_dir)[2], ids_FN)


def test_a_val_run_rerun_after_its_vocabulary_changed_is_refused(tmp_path):
    """The train split preprocessed again with another --min_frequency, then the val command run again: its
    finished shards were kept and its manifest took the new vocabulary's table sizes over the old ids (ids up to
    2130 in a table of 285 rows), in silence."""
    kw = dict(inputs=(TRAIN,), num_embeddings=5000)
    train, _ = run(tmp_path, "train", min_frequency=1, **kw)
    run(tmp_path, "val", vocab_from=train, **kw)
    shutil.rmtree(train)
    run(tmp_path, "train", min_frequency=3, **kw)
    with pytest.raises(ValueError, match=r"val holds a preprocess run with other inputs or options \(--vocab_from's "
                                         r"vocab\.npz differ;"):
        run(tmp_path, "val", vocab_from=train, **kw)
    with pytest.raises(ValueError, match=r"other inputs or options \(--min_frequency, --seed differ;"):
        run(tmp_path, "train", min_frequency=2, seed=1, **kw)


def _as_parquet_pieces(text: Path, folder: Path, pieces: int = 3) -> Path:
    """The text file's rows as Parquet pieces (hash strings, counts with gaps), as a Hub dataset holds them."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    names = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    table = pacsv.read_csv(text, read_options=pacsv.ReadOptions(column_names=names),
                           parse_options=pacsv.ParseOptions(delimiter="\t"),
                           convert_options=pacsv.ConvertOptions(column_types={n: pa.string() for n in names[14:]},
                                                                strings_can_be_null=True))
    folder.mkdir()
    step = -(-table.num_rows // pieces)
    for k in range(pieces):
        pq.write_table(table.slice(k * step, step), folder / f"train-{k:05d}-of-{pieces:05d}.parquet",
                       row_group_size=700)
    return folder


@pytest.mark.parametrize("min_frequency", [0, 2])
def test_a_table_preprocesses_to_the_rows_of_its_text(tmp_path, monkeypatch, min_frequency):
    """preprocess refused tables ("reads Criteo text files"): a Parquet source now gives the shards' rows of its
    text, through the vocabulary of --min_frequency too, and an interrupted run resumes at its block."""
    pieces = _as_parquet_pieces(TRAIN, tmp_path / "pq")
    kw = dict(shuffle_rows=False, min_frequency=min_frequency, block_mb=1)
    text_dir, text_manifest = run(tmp_path, "text", inputs=(TRAIN,), **kw)
    _run_dying_mid_shard(tmp_path, monkeypatch, 2, "table", inputs=(pieces / "train-*.parquet",), **kw)
    table_dir, manifest = run(tmp_path, "table", inputs=(pieces / "train-*.parquet",), **kw)
    assert manifest["num_rows"] == text_manifest["num_rows"] == 4380 and len(manifest["shards"]) == 2  # blocks of 4096
    assert manifest["num_embeddings_per_feature"] == text_manifest["num_embeddings_per_feature"]
    for a, b in zip(all_rows(table_dir), all_rows(text_dir)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_ranks_read_equal_disjoint_shares():
    rows = [1000, 7, 333, 1]
    for world in (1, 2, 3, 4):
        shares = [rank_segments(rows, r, world) for r in range(world)]
        totals = {sum(hi - lo for _, lo, hi in s) for s in shares}
        assert len(totals) == 1
        covered = sorted((i, j) for s in shares for i, lo, hi in s for j in range(lo, hi))
        assert len(covered) == len(set(covered)) and sum(rows) - len(covered) < world * len(rows)


def test_rows_an_epoch_leaves_out_come_first_in_the_next(tmp_path):
    """Training on a preprocessed directory left the same rows out every epoch: drop_last's remainder and, at N ranks,
    a longer share's rows past the shortest share. However many epochs, they were never trained on. Each epoch now
    starts where the one before stopped, in the rank's share (a cycle), and resumes as exactly as before."""
    files, start = [], 0
    for j, n in enumerate([37, 20, 44]):  # a shard per input
        files.append(tmp_path / f"in{j}.tsv")
        files[-1].write_text("".join(_row(k) for k in range(start, start + n)))
        start += n
    out = tmp_path / "out"
    preprocess_criteo([str(f) for f in files], out, num_embeddings=10, rows_per_shard=1, progress=False)

    def batches_of(ds) -> list[list[int]]:
        return [[round(float(x)) for x in b.dense_features[:, 0].expm1()] for b in ds]

    for world, drop_last in ((1, True), (2, True), (2, False)):
        for rank in range(world):
            share = sum(batches_of(CriteoShardDataset(out, 8, rank=rank, world_size=world, every_row=True)), [])
            ds = CriteoShardDataset(out, 8, shuffle=True, drop_last=drop_last, rank=rank, world_size=world)
            epochs = []
            for epoch in range(2):
                ds.set_epoch(epoch)
                epochs.append(batches_of(ds))
            rows = [sum(batches, []) for batches in epochs]
            assert len(set(rows[0])) == len(rows[0]) == len(rows[1]) <= len(share)
            assert set(rows[0]) | set(rows[1]) == set(share), (world, drop_last, rank)
            again = CriteoShardDataset(out, 8, shuffle=True, drop_last=drop_last, rank=rank, world_size=world)
            again.resume_from(epoch=1, batches_done=3)
            assert batches_of(again) == epochs[1][3:]


def _row(k: int) -> str:
    """A clean Criteo text row whose I1 is k (a row's name after log1p: expm1 of dense column 0)."""
    return "\t".join([str(k % 2), str(k)] + [str(j) for j in range(2, 14)] + [f"{j:08x}" for j in range(1, 27)]) + "\n"


def _rank_reader(rank: int, world_size: int, directory: str) -> tuple[int, int, float]:
    """Each rank iterates its share (rank and world size found from the process group)."""
    import torch.distributed as dist

    ds = CriteoShardDataset(directory, 128, shuffle=True)
    batches = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1))
    rows = torch.tensor([sum(len(b) for b in batches)])
    dist.all_reduce(rows)  # every rank reached the same collective: no rank finished early
    return len(batches), int(rows), float(sum(b.dense_features.double().sum() for b in batches))


def _stream_reader(rank: int, world_size: int, path: str) -> tuple[int]:
    from lightning_rec.data import CriteoIterableDataset

    ds = CriteoIterableDataset(path, batch_size=100, num_embeddings_per_feature=10)
    return (sum(len(b) for b in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1)),)


def test_two_ranks_read_their_own_share(tmp_path):
    from dist_utils import run_ranks

    out, manifest = run(tmp_path, "r")
    (n0, total, s0), (n1, _, s1) = run_ranks(_rank_reader, 2, str(out), timeout=120)
    assert n0 == n1 and manifest["num_rows"] - len(manifest["shards"]) * 2 < total <= manifest["num_rows"]
    # the streaming reader deals blocks to (rank, worker) pairs the same way
    (t0,), (t1,) = run_ranks(_stream_reader, 2, str(TRAIN), timeout=120)
    assert t0 + t1 == 4380 and abs(t0 - t1) <= 1
    whole = sum(float(b.dense_features.double().sum()) for b in CriteoShardDataset(out, 4096))
    assert s0 != s1 and abs((s0 + s1) - whole) < 100  # disjoint halves; a few rows of the odd shards left out


def test_loader_workers_ranks_and_shuffle(tmp_path):
    out, manifest = run(tmp_path, "l")
    base = torch.cat([b.dense_features for b in CriteoShardDataset(out, 300)])
    for world in (2, 3):
        parts = [torch.cat([b.dense_features for b in CriteoShardDataset(out, 300, rank=r, world_size=world)])
                 for r in range(world)]
        assert len({p.shape[0] for p in parts}) == 1
        got = torch.cat(parts).double().sum(0)
        assert torch.allclose(got, base[: base.shape[0]].double().sum(0), atol=200)  # < #shards rows dropped
    ds = CriteoShardDataset(out, 300, shuffle=True, seed=1)
    # persistent workers count epochs (CriteoDataModule's loaders are persistent when num_workers > 0)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    e1 = torch.cat([b.dense_features for b in loader])
    e2_batches = [b.dense_features for b in loader]
    e2 = torch.cat(e2_batches)
    assert len(loader) == len(ds) == -(-manifest["num_rows"] // 300)
    assert e1.shape == base.shape and not torch.equal(e1, e2)
    assert torch.allclose(e1.double().sum(0), base.double().sum(0))
    # mid-epoch resume: epoch 1 without its first 5 batches == the rest of epoch 1
    again = CriteoShardDataset(out, 300, shuffle=True, seed=1)
    again.resume_from(epoch=1, batches_done=5)
    assert torch.equal(torch.cat([b.dense_features for b in again]), torch.cat(e2_batches[5:]))


def test_datamodule_trains_on_a_shard_directory(tmp_path):
    import lightning.pytorch as pl

    from lightning_rec.models import DLRMModule

    out, manifest = run(tmp_path, "t", num_embeddings=64)
    val, _ = run(tmp_path, "v", inputs=(CRITEO / "criteo_kaggle_valid_sample.tsv",), num_embeddings=64)
    dm = CriteoDataModule(train_path=str(out), val_path=str(val), batch_size=256, num_embeddings_per_feature=64,
                          num_workers=1)
    model = DLRMModule(num_embeddings_per_feature=64, embedding_dim=8, dense_arch_layer_sizes=[16, 8],
                       over_arch_layer_sizes=[16, 1])
    trainer = pl.Trainer(max_steps=5, limit_val_batches=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(model, dm)
    assert trainer.global_step == 5
    (metrics,) = trainer.validate(model, dm, verbose=False)
    assert np.isfinite(metrics["val_loss"])
    with pytest.raises(ValueError, match=r"preprocessed for num_embeddings_per_feature=\[64.*set the data and model"):
        CriteoDataModule(train_path=str(out), num_embeddings_per_feature=100).setup("fit")


def test_splits_whose_ids_map_values_to_other_rows_are_refused(tmp_path):
    """Training on a directory and validating on a text file: ids through a --min_frequency vocabulary there and
    hashed here, or the directory's reserved_id against an empty_bag data module (which the directory ignored),
    put the same value in other table rows in training and validation, in silence."""
    text = str(CRITEO / "criteo_kaggle_valid_sample.tsv")
    vocab, manifest = run(tmp_path, "vocab", inputs=(TRAIN,), min_frequency=3, num_embeddings=1000)
    sizes = manifest["num_embeddings_per_feature"]
    with pytest.raises(ValueError, match=r"train_path .*vocab holds ids through a vocabulary .* val_path .*valid_sample"
                                         r"\.tsv are hashed: .* --vocab_from <the train split's directory>"):
        CriteoDataModule(train_path=str(vocab), val_path=text, num_embeddings_per_feature=sizes).setup("fit")
    hashed, _ = run(tmp_path, "hashed", inputs=(TRAIN,), num_embeddings=64)
    with pytest.raises(ValueError, match=r"hashed holds ids of --missing_categorical reserved_id, but val_path .* is "
                                         r"hashed with empty_bag: .* Set data.missing_categorical=reserved_id"):
        CriteoDataModule(train_path=str(hashed), val_path=text, num_embeddings_per_feature=64,
                         missing_categorical="empty_bag").setup("fit")
    # what agrees: a directory alone (it keeps its own), text hashed as the directory, the vocabulary's val split
    CriteoDataModule(train_path=str(hashed), num_embeddings_per_feature=64,
                     missing_categorical="empty_bag").setup("fit")
    CriteoDataModule(train_path=str(hashed), val_path=text, num_embeddings_per_feature=64,
                     cache_dir=str(tmp_path / "cache")).setup("fit")
    val, _ = run(tmp_path, "val", inputs=(text,), vocab_from=vocab, num_embeddings=1000)
    CriteoDataModule(train_path=str(vocab), val_path=str(val), num_embeddings_per_feature=sizes).setup("fit")


def test_preprocess_errors_and_cli(tmp_path, capsys):
    with pytest.raises(ValueError, match="is a directory"):
        preprocess_criteo([str(tmp_path)], tmp_path / "o")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty and holds no preprocess run"):
        preprocess_criteo([str(TRAIN)], tmp_path / "full")
    with pytest.raises(ValueError, match="reserved_id"):
        preprocess_criteo([str(TRAIN)], tmp_path / "o", min_frequency=2, missing_categorical="empty_bag")
    with pytest.raises(ValueError, match="one int or 26"):
        preprocess_criteo([str(TRAIN)], tmp_path / "o", num_embeddings=[5, 5])
    unl = tmp_path / "unl"
    preprocess_criteo([str(CRITEO / "criteo_kaggle_test_head1999_nolabel.tsv")], unl, num_embeddings=10,
                      progress=False)
    with pytest.raises(ValueError, match="has no label column"):
        CriteoDataModule(train_path=str(unl), num_embeddings_per_feature=10).setup("fit")
    manifest = preprocess_main(["--input", str(TRAIN), "--output_dir", str(tmp_path / "cli"), "--num_embeddings",
                                "1000", "--no_progress"])
    printed = capsys.readouterr().out
    assert "4,380 rows in 1 shards" in printed and "--data.num_embeddings_per_feature=1000" in printed
    assert f"train on it with:\n  --data.train_path={tmp_path / 'cli'}" in printed
    assert manifest["num_rows"] == 4380
    # a split preprocessed with the train split's vocabulary is evaluated, an unlabelled one predicted on
    preprocess_main(["--input", str(TRAIN), "--output_dir", str(tmp_path / "cli_train"), "--num_embeddings", "1000",
                     "--min_frequency", "2", "--no_progress"])
    assert f"validate on a split preprocessed with its vocabulary (--vocab_from {tmp_path / 'cli_train'})" in \
        capsys.readouterr().out
    preprocess_main(["--input", str(CRITEO / "criteo_kaggle_valid_sample.tsv"), "--output_dir",
                     str(tmp_path / "cli_val"), "--num_embeddings", "1000", "--vocab_from", str(tmp_path / "cli_train"),
                     "--no_progress"])
    assert f"evaluate on it with:\n  --data.val_path={tmp_path / 'cli_val'}" in capsys.readouterr().out
    preprocess_main(["--input", str(CRITEO / "criteo_kaggle_test_head1999_nolabel.tsv"), "--output_dir",
                     str(tmp_path / "cli_test"), "--num_embeddings", "1000", "--no_progress"])
    assert f"predict on it with:\n  --data.predict_path={tmp_path / 'cli_test'}" in capsys.readouterr().out
    # a bad input is one line naming the option, as argparse's own errors
    with pytest.raises(SystemExit) as e:
        preprocess_main(["--input", "nope.gz", "--output_dir", str(tmp_path / "x"), "--no_progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "input nope.gz does not exist: check --input" in err, err
    shutil.rmtree(tmp_path / "cli")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shard_loader_resumes_mid_epoch_at_the_next_batch(tmp_path, monkeypatch, caplog, num_workers):
    """The shard loader is stateful (torchdata, through make_stream_loader): a new loader given the saved
    state yields exactly the batches the uninterrupted one would have yielded next, without reading the
    batches before them (torchdata fast-forwarded through them, warning "naively fast-forwarding")."""
    out, _ = run(tmp_path, "t", num_embeddings=64)

    def loader():
        dm = CriteoDataModule(train_path=str(out), batch_size=128, num_embeddings_per_feature=64, shuffle=True,
                              num_workers=num_workers)
        dm.setup("fit")
        return dm.train_dataloader()

    whole = [b.labels.clone() for b in loader()]
    assert len(whole) >= 6
    first = loader()
    it = iter(first)
    for _ in range(3):  # odd: with 2 workers, one has yielded a batch more than the other
        next(it)
    state = first.state_dict()
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    built = []
    make_batch = CriteoShardDataset.make_batch
    monkeypatch.setattr(CriteoShardDataset, "make_batch", lambda self, *a: built.append(1) or make_batch(self, *a))
    with caplog.at_level(logging.WARNING):
        rest = [b.labels for b in resumed]
    assert len(rest) == len(whole) - 3
    assert all(torch.equal(a, b) for a, b in zip(rest, whole[3:]))
    assert "fast-forwarding" not in caplog.text
    if num_workers == 0:  # (workers build theirs in other processes)
        assert len(built) == len(rest)


def test_dashed_option_spellings_are_taken(tmp_path):
    # `--output-dir` (export's options are dashed: --fp16-tables) was refused as "the following arguments are required:
    # --output_dir", with --output-dir right there on the command line
    manifest = preprocess_main(["--input", str(RAGGED), "--output-dir", str(tmp_path / "out"), "--num-embeddings", "50",
                                "--no-progress"])
    assert (tmp_path / "out" / "manifest.json").is_file() and manifest["num_embeddings_per_feature"] == [50] * 26
