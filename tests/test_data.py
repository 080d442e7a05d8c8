"""Criteo parsing (every shared sample, every bad-row case), batches, the data modules, synthetic data.

Real data is read from ../shared/data (never copied into the repo); those tests skip without it.
"""

from __future__ import annotations

import logging
import math
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA

from lightning_rec.data import (
    Batch,
    CriteoDataModule,
    CriteoDataset,
    CriteoIterableDataset,
    SyntheticCriteoDataModule,
    build_criteo_cache,
    detect_layout,
    read_criteo,
)
from lightning_rec.data.criteo_parse import resolve_parser
from lightning_rec.sparse import KeyedJaggedTensor

CRITEO = SHARED_DATA / "criteo"
needs_criteo = pytest.mark.skipif(not CRITEO.is_dir(), reason="shared Criteo samples not present")

# file, data rows, labelled, positives (None: not given by the data README), rows padded
CRITEO_FILES = [
    ("criteo_kaggle_train_sample.tsv", 4380, True, 962, 0),
    ("criteo_kaggle_valid_sample.tsv", 2055, True, 544, 0),
    ("criteo_kaggle_test_head1999_nolabel.tsv", 1999, False, None, 0),
    ("kaggle_csv_original/train.tiny.csv", 1999, True, None, 0),
    ("kaggle_csv_original/test.tiny.csv", 1999, False, None, 0),
    ("kaggle_csv_original/tr.rx.csv", 1999, True, None, 0),
    ("kaggle_csv_original/va.rx.csv", 1999, True, None, 0),
    ("kaggle_csv_original/tr.r100000.csv", 403, True, None, 0),
    ("kaggle_csv_original/va.r100000.csv", 58, True, None, 0),
    ("other/deepctr_criteo_sample.txt", 200, True, 49, 0),
    ("other/pytorch-fm_criteo_train_head1000_trailing-tabs-stripped.txt", 1000, True, None, 498),
]

# The first line of train.txt (README 1a), C22 and I12 empty.
FIRST_ROW_DENSE = [1, 1, 5, 0, 1382, 4, 15, 2, 181, 1, 2, math.nan, 2]
FIRST_ROW_SPARSE = (
    "68fd1e64 80e26c9b fb936136 7b4723c4 25c83c98 7e0ccccf de7995b8 1f89b562 a73ee510 a8cd5504 b2cb9c98 "
    "37c9c164 2824a5f6 1adce6ef 8ba8b39a 891b62e7 e5ba7672 f54016b9 21ddcdc9 b1252a9d 07b5194c - 3a171ecb "
    "c5c50484 e8b83407 9727dd16"
).split()
HEADER_FEATURES = ",".join([f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)])
FIRST_ROW_RAW = [-1 if h == "-" else int(h, 16) for h in FIRST_ROW_SPARSE]


def parse_all(path, **kwargs):
    """(label [N], dense raw [N, 13], sparse raw [N, 26], report) of a whole file."""
    tables, report = [], None
    for table, block_report in read_criteo(path, **kwargs):
        tables.append(table)
        report = block_report
    label = np.concatenate([t.column("label").to_numpy() for t in tables])
    dense = np.concatenate([t.column("dense").combine_chunks().flatten().to_numpy() for t in tables])
    sparse = np.concatenate([t.column("sparse").combine_chunks().flatten().to_numpy() for t in tables])
    return label, dense.reshape(-1, 13), sparse.reshape(-1, 26), report


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def good_row(label: int = 0, i1: str = "1", c1: str = "68fd1e64", sep: str = "\t") -> str:
    dense = [i1] + [str(k) for k in range(2, 14)]
    sparse = [c1] + [f"{k:08x}" for k in range(2, 27)]
    return sep.join([str(label)] + dense + sparse)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("criteo_cache")


# ----------------------------------------------------------------------------------------------
# every real file


@needs_criteo
@pytest.mark.parametrize("name, rows, labelled, positives, padded", CRITEO_FILES, ids=lambda v: str(v)[-24:])
def test_parses_every_shared_criteo_file(name, rows, labelled, positives, padded):
    label, dense, sparse, report = parse_all(CRITEO / name)
    assert report.num_rows == rows == label.shape[0] == dense.shape[0] == sparse.shape[0]
    assert report.num_skipped_rows == 0
    assert report.num_padded_rows == padded
    assert report.layout["has_label"] == labelled
    if labelled:
        assert set(np.unique(label)) <= {0.0, 1.0}
        if positives is not None:
            assert int(label.sum()) == positives
    else:
        assert np.isnan(label).all()
    assert (sparse >= -1).all() and (sparse < 2**32).all()
    assert (sparse == -1).any() and np.isnan(dense).any()  # every sample has missing values


@needs_criteo
def test_the_old_criteo_module_paths_name_the_packages_objects():
    """The Criteo readers became the package lightning_rec.data.criteo: the old modules re-export it, and the
    class paths recipes name (YAML class_path) still resolve."""
    import importlib

    from lightning_rec.data import criteo
    from lightning_rec.data.criteo import datamodule, parse, preprocess, shards, tables

    def resolve(dotted: str):
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)

    for dotted in ("lightning_rec.data.CriteoDataModule", "lightning_rec.data.criteo.CriteoDataModule"):
        assert resolve(dotted) is datamodule.CriteoDataModule
    assert resolve("lightning_rec.data.criteo_parse.read_criteo") is parse.read_criteo
    assert resolve("lightning_rec.data.criteo_parse._parse_block") is parse._parse_block
    assert resolve("lightning_rec.data.criteo_tables.TableBlocks") is tables.TableBlocks
    assert resolve("lightning_rec.data.criteo_shards.CriteoShardDataset") is shards.CriteoShardDataset
    assert resolve("lightning_rec.data.preprocess.preprocess_criteo") is preprocess.preprocess_criteo
    assert callable(resolve("lightning_rec.cli.preprocess_main"))  # the command line lives with the CLI
    # the cache keys and the shard format are as before
    assert (criteo._PARSER_VERSION, criteo.TABLE_SOURCE_VERSION) == (2, 1)
    assert shards.SHARD_FORMAT == "lightning_rec.criteo_shards/1"
    assert criteo._resolve_num_embeddings(3, 26) == [3] * 26


def test_first_row_known_values():
    label, dense, sparse, _ = parse_all(CRITEO / "criteo_kaggle_train_sample.tsv")
    assert label[0] == 0
    np.testing.assert_array_equal(dense[0], np.array(FIRST_ROW_DENSE, dtype=np.float32))
    assert sparse[0].tolist() == FIRST_ROW_RAW
    # README: train sample cardinalities of C1, C2, C9 (present values)
    for j, card in ((0, 122), (1, 318), (8, 2)):
        assert np.unique(sparse[:, j][sparse[:, j] >= 0]).size == card


@needs_criteo
def test_same_rows_in_every_layout():
    """Stripped tabs (padded), the Kaggle CSV (header, Id) and the dac TSV agree value for value."""
    tiny = parse_all(CRITEO / "kaggle_csv_original/train.tiny.csv")
    ragged = parse_all(CRITEO / "other/pytorch-fm_criteo_train_head1000_trailing-tabs-stripped.txt")
    for a, b in zip(tiny[:3], ragged[:3]):
        np.testing.assert_array_equal(a[:1000], b)
    test_csv = parse_all(CRITEO / "kaggle_csv_original/test.tiny.csv")
    test_tsv = parse_all(CRITEO / "criteo_kaggle_test_head1999_nolabel.tsv")
    for a, b in zip(test_csv[:3], test_tsv[:3]):
        np.testing.assert_array_equal(a, b)
    assert np.isnan(test_tsv[1][0, 0]) and test_tsv[1][0, 1] == 29 and test_tsv[2][0, 0] == 0x5A9ED9B0


@needs_criteo
def test_deepctr_float_integers_and_layout():
    path = CRITEO / "other/deepctr_criteo_sample.txt"
    layout = detect_layout(path)
    assert (layout.separator, layout.has_header, layout.has_label) == (",", True, True)
    label, dense, sparse, _ = parse_all(path)
    assert dense[0, 2] == 260.0 and dense[0, 4] == 17668.0 and dense[0, 1] == 3 and np.isnan(dense[0, 0])
    assert sparse[0, 0] == 0x05DB9164 and sparse[0, 18] == -1


@needs_criteo
def test_layout_detection():
    kaggle = detect_layout(CRITEO / "kaggle_csv_original/train.tiny.csv")
    assert (kaggle.separator, kaggle.has_header, kaggle.num_fields, kaggle.label_field) == (",", True, 41, 1)
    assert kaggle.dense_fields[0] == 2 and kaggle.sparse_fields[-1] == 40
    test = detect_layout(CRITEO / "kaggle_csv_original/test.tiny.csv")
    assert not test.has_label and test.num_fields == 40
    tsv = detect_layout(CRITEO / "criteo_kaggle_test_head1999_nolabel.tsv")
    assert (tsv.separator, tsv.has_header, tsv.has_label, tsv.num_fields) == ("\t", False, False, 39)
    with pytest.raises(ValueError, match="has_label=True"):
        detect_layout(CRITEO / "kaggle_csv_original/test.tiny.csv", has_label=True)


# ----------------------------------------------------------------------------------------------
# batches


@needs_criteo
def test_batch_transforms_and_table_sizes_need_no_recache(cache_dir):
    arrow, _ = build_criteo_cache(CRITEO / "criteo_kaggle_train_sample.tsv", cache_dir)
    again, _ = build_criteo_cache(CRITEO / "criteo_kaggle_train_sample.tsv", cache_dir)
    assert again == arrow
    sizes = [1000 + 7 * j for j in range(26)]
    batch = CriteoDataset(arrow, sizes)[[0, 1, 2]]
    assert isinstance(batch, Batch) and len(batch) == 3
    assert batch.dense_features.dtype == torch.float32 and batch.dense_features.shape == (3, 13)
    expected = np.log1p(np.fmax(np.array(FIRST_ROW_DENSE), 0)).astype(np.float32)
    np.testing.assert_allclose(batch.dense_features[0].numpy(), np.nan_to_num(expected), rtol=1e-6)
    kjt = batch.sparse_features
    assert kjt.keys() == [f"C{i}" for i in range(1, 27)] and kjt.stride() == 3
    assert torch.equal(kjt.lengths(), torch.ones(78, dtype=torch.int64))
    ids_FB = kjt.values().view(26, 3)
    want = [0 if v < 0 else 1 + v % (n - 1) for v, n in zip(FIRST_ROW_RAW, sizes)]  # reserved id 0
    assert ids_FB[:, 0].tolist() == want
    assert batch.labels.dtype == torch.float32 and batch.labels[0] == 0

    empty_bag = CriteoDataset(arrow, 50, missing_categorical="empty_bag")[[0]].sparse_features
    lengths = empty_bag.lengths().tolist()
    assert lengths == [0 if v < 0 else 1 for v in FIRST_ROW_RAW]
    assert empty_bag.values().tolist() == [v % 50 for v in FIRST_ROW_RAW if v >= 0]


@needs_criteo
def test_many_block_cache_gathers_like_one_block(tmp_path):
    """A big file caches as several record batches; a shuffled batch gathers across them."""
    path = CRITEO / "criteo_kaggle_train_sample.tsv"
    one = CriteoDataset(build_criteo_cache(path, tmp_path / "one")[0], 1000)
    many = CriteoDataset(build_criteo_cache(path, tmp_path / "many", block_bytes=50_000)[0], 1000)
    assert len(one._chunks) == 1 and len(many._chunks) > 10 and len(many) == len(one) == 4380
    idx = np.random.default_rng(0).permutation(4380)[:700]
    a, b = one[idx], pickle.loads(pickle.dumps(many))[idx]  # workers unpickle and re-map the file
    assert torch.equal(a.dense_features, b.dense_features) and torch.equal(a.labels, b.labels)
    assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    with pytest.raises(IndexError):
        one[[4380]]


@needs_criteo
def test_dense_negative_counts_clip_to_zero(cache_dir):
    arrow, _ = build_criteo_cache(CRITEO / "criteo_kaggle_valid_sample.tsv", cache_dir)
    batch = CriteoDataset(arrow, 100)[0]  # first row: I2 = -1, I3/I4 empty
    assert batch.dense_features[0, 1] == 0 and batch.dense_features[0, 2] == 0
    assert torch.isclose(batch.dense_features[0, 4], torch.tensor(math.log1p(1493.0)))


def test_torchrec_criteo_names_match_our_batches():
    """torchrec.datasets.criteo's constants: tables named from DEFAULT_CAT_NAMES read our data modules' batches."""
    from lightning_rec.data import (
        CAT_FEATURE_COUNT,
        DEFAULT_CAT_NAMES,
        DEFAULT_INT_NAMES,
        DEFAULT_LABEL_NAME,
        INT_FEATURE_COUNT,
    )

    assert (CAT_FEATURE_COUNT, INT_FEATURE_COUNT, DEFAULT_LABEL_NAME) == (26, 13, "label")
    assert len(DEFAULT_CAT_NAMES) == 26 and len(DEFAULT_INT_NAMES) == 13
    data = SyntheticCriteoDataModule(num_train_samples=8, num_val_samples=0, batch_size=4)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch.sparse_features.keys() == DEFAULT_CAT_NAMES
    assert batch.dense_features.shape[1] == len(DEFAULT_INT_NAMES)


def test_batch_to_and_len():
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.arange(3), torch.tensor([1, 0, 1, 1]))
    batch = Batch(torch.zeros(2, 13), kjt, torch.tensor([0.0, 1.0]))
    moved = batch.to("cpu", non_blocking=True)
    assert isinstance(moved, Batch) and len(moved) == 2 == moved.batch_size
    from lightning.fabric.utilities.apply_func import move_data_to_device

    assert isinstance(move_data_to_device(batch, torch.device("cpu")), Batch)
    if torch.cuda.is_available():
        pinned = batch.pin_memory()
        assert pinned.dense_features.is_pinned() and pinned.sparse_features.values().is_pinned()


# ----------------------------------------------------------------------------------------------
# data module


def epoch_stats(loader) -> tuple[int, float, float]:
    rows, positives, checksum = 0, 0.0, 0.0
    for batch in loader:
        assert isinstance(batch, Batch)
        rows += len(batch)
        positives += float(batch.labels.sum())
        checksum += float(batch.dense_features.double().sum())
    return rows, positives, checksum


@needs_criteo
@pytest.mark.parametrize("num_workers", [0, 2])
def test_datamodule_map_style(cache_dir, num_workers):
    dm = CriteoDataModule(
        train_path=str(CRITEO / "criteo_kaggle_train_sample.tsv"),
        val_path=str(CRITEO / "criteo_kaggle_valid_sample.tsv"),
        test_path=str(CRITEO / "criteo_kaggle_test_head1999_nolabel.tsv"),
        batch_size=1000, val_batch_size=4096, num_embeddings_per_feature=1000, cache_dir=str(cache_dir),
        num_workers=num_workers, seed=3,
    )
    dm.prepare_data()
    dm.setup("fit")
    rows, positives, checksum = epoch_stats(dm.train_dataloader())
    assert (rows, positives) == (4380, 962)
    _, _, checksum_again = epoch_stats(dm.train_dataloader())
    assert checksum == pytest.approx(checksum_again, rel=1e-9)  # shuffled, nothing lost or repeated
    assert epoch_stats(dm.val_dataloader())[:2] == (2055, 544)
    dm.setup("predict")
    batch = next(iter(dm.predict_dataloader()))
    assert torch.isnan(batch.labels).all() and len(batch) == 1999
    assert dm.num_skipped_rows == 0 and set(dm.parse_reports) >= {"train", "val", "predict"}


@needs_criteo
@pytest.mark.parametrize("num_workers", [0, 2])
def test_datamodule_streaming_matches_cached(cache_dir, num_workers):
    kwargs = dict(
        train_path=str(CRITEO / "criteo_kaggle_train_sample.tsv"), batch_size=512, shuffle=False,
        num_embeddings_per_feature=777, cache_dir=str(cache_dir), block_bytes=100_000,
    )
    cached = CriteoDataModule(**kwargs)
    cached.setup("fit")
    streaming = CriteoDataModule(streaming=True, num_workers=num_workers, **kwargs)
    streaming.setup("fit")
    assert streaming.datasets["train"].__class__ is CriteoIterableDataset
    assert epoch_stats(streaming.train_dataloader()) == pytest.approx(epoch_stats(cached.train_dataloader()))
    if num_workers == 0:  # one reader: the same rows in the same batches as the cache
        a, b = next(iter(streaming.train_dataloader())), next(iter(cached.train_dataloader()))
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
        assert torch.equal(a.dense_features, b.dense_features)


def test_a_streaming_datamodule_parses_with_the_parser_it_was_given(tmp_path):
    """CriteoDataModule(parser=..., streaming=True) built its stream without the parser: "auto" read it."""
    path = write(tmp_path, "s.tsv", "".join(good_row(label=k % 2, i1=str(k)) + "\n" for k in range(20)))
    dm = CriteoDataModule(train_path=str(path), batch_size=8, num_embeddings_per_feature=10, streaming=True,
                          parser="python", block_bytes=1 << 30)
    dm.setup("fit")
    stream = dm.datasets["train"]
    assert stream.parser == "python" and stream.block_bytes == 16 << 20  # a streamed block is at most 16 MiB
    assert sum(len(b) for b in dm.train_dataloader()) == 20


def test_streaming_shuffle_and_drop_last(tmp_path):
    path = write(tmp_path, "s.tsv", "".join(good_row(label=k % 2, i1=str(k)) + "\n" for k in range(100)))
    ds = CriteoIterableDataset(path, batch_size=16, num_embeddings_per_feature=10, shuffle=True,
                               drop_last=True, block_bytes=2000)
    epoch1 = torch.cat([b.dense_features[:, 0] for b in ds])
    epoch2 = torch.cat([b.dense_features[:, 0] for b in ds])
    assert epoch1.numel() == 96 and not torch.equal(epoch1, epoch2)  # 100 // 16 full batches
    assert torch.unique(epoch1).numel() == 96


# ----------------------------------------------------------------------------------------------
# bad input


def test_stripped_trailing_fields_are_padded_crlf_and_blank_lines(tmp_path):
    full = good_row()
    stripped = "\t".join(full.split("\t")[:37])  # C24..C26 stripped
    # CRLF endings, a blank line, no final newline
    path = write(tmp_path, "r.tsv", f"{full}\r\n\r\n{stripped}\r\n{full}")
    label, dense, sparse, report = parse_all(path)
    assert (report.num_rows, report.num_padded_rows, report.num_blank_lines) == (3, 1, 1)
    assert sparse[1, 23:].tolist() == [-1, -1, -1] and sparse[1, 22] == 23
    assert sparse[2, 25] == 26 and sparse[0, 0] == 0x68FD1E64


@pytest.mark.parametrize("parser", ["python", "native"])
def test_a_carriage_return_inside_a_line_is_a_bad_row_naming_its_field(tmp_path, parser):
    """A "\\r\\r\\n" line (a file converted to CRLF twice) was an AssertionError in the reference parser (Arrow ends a
    row at a lone \\r: more rows than lines); the native op said "C26 must be 8 hex characters, got '...\\r'"."""
    if parser == "native" and resolve_parser("auto") != "native":
        pytest.skip("the native parser is not built")
    path = write(tmp_path, "cr.tsv", f"{good_row()}\r\n{good_row(1)}\r\r\n{good_row()}\r\n")
    with pytest.raises(ValueError, match=r"cr\.tsv:2: field 40 \(C26\) holds a carriage return .*sed"):
        parse_all(path, parser=parser)
    label, _, _, report = parse_all(path, parser=parser, on_bad_row="skip")
    assert (report.num_rows, report.num_skipped_rows) == (2, 1) and label.tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "bad_row, reason",
    [
        (good_row() + "\textra", "41 fields"),
        (good_row(i1="abc"), "I1 must be a number, got 'abc'"),
        (good_row(i1="nan"), "I1 must be a number"),
        (good_row(c1="zzzzzzzz"), "C1 must be 8 hex characters, got 'zzzzzzzz'"),
        (good_row(c1="abc"), "C1 must be 8 hex characters, got 'abc'"),
        (good_row(label=2), "label must be 0 or 1"),
    ],
)
def test_bad_row_error_names_file_and_line(tmp_path, bad_row, reason):
    path = write(tmp_path, "bad.tsv", "\n".join([good_row(), good_row(1), bad_row, good_row()]) + "\n")
    with pytest.raises(ValueError, match=rf"bad\.tsv:3: {reason}.*on_bad_row='skip'"):
        parse_all(path)
    with pytest.raises(ValueError, match=r"bad\.tsv:3:"):
        build_criteo_cache(path, tmp_path / "cache")
    with pytest.raises(ValueError, match=r"bad\.tsv:3:"):
        list(CriteoIterableDataset(path, batch_size=2, num_embeddings_per_feature=10))


def test_bad_rows_skipped_counted_and_logged(tmp_path, caplog):
    rows = [good_row(i1="10"), good_row(c1="xyz12345"), good_row() + "\t1\t2", good_row(i1="11"),
            good_row(i1="-"), good_row(label=1, i1="12")]
    path = write(tmp_path, "skip.tsv", "\n".join(rows) + "\n")
    label, dense, sparse, report = parse_all(path, on_bad_row="skip")
    assert report.num_skipped_rows == 3 and report.num_rows == 3
    assert [line for line, _ in report.skipped] == [2, 3, 5]
    assert dense[:, 0].tolist() == [10, 11, 12] and label.tolist() == [0, 0, 1]  # nothing shifted
    assert (sparse[:, 1] == 2).all()
    with caplog.at_level(logging.WARNING):
        dm = CriteoDataModule(
            train_path=str(path), on_bad_row="skip", cache_dir=str(tmp_path / "c"), batch_size=8
        )
        dm.setup("fit")
    assert dm.num_skipped_rows == 3 and dm.parse_reports["train"].skipped[0][0] == 2
    assert "skipped 3 bad rows" in caplog.text
    assert len(dm.datasets["train"]) == 3


def test_error_names_the_first_bad_line_of_a_block(tmp_path):
    rows = [good_row(), good_row(c1="q0000000"), good_row() + "\tx"]  # a hex error before a field count error
    path = write(tmp_path, "two.tsv", "\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=r"two\.tsv:2: C1"):
        parse_all(path)


def test_comma_file_with_header_and_float_ints(tmp_path):
    header = "label," + HEADER_FEATURES
    path = write(tmp_path, "d.csv", header + "\n" + good_row(1, i1="260.0", sep=",") + "\n")
    label, dense, sparse, report = parse_all(path)
    assert label.tolist() == [1.0] and dense[0, 0] == 260.0 and sparse[0, 0] == 0x68FD1E64


@pytest.mark.parametrize("text, match", [("", "is empty"), ("\n\n", "is empty")])
def test_empty_file_is_a_clear_error(tmp_path, text, match):
    path = write(tmp_path, "empty.tsv", text)
    with pytest.raises(ValueError, match=match):
        build_criteo_cache(path, tmp_path)


def test_header_only_file_is_a_clear_error(tmp_path):
    header = "Id,Label," + HEADER_FEATURES
    path = write(tmp_path, "h.csv", header + "\n")
    with pytest.raises(ValueError, match="no data rows"):
        build_criteo_cache(path, tmp_path)


def test_a_killed_builds_temporary_files_are_removed_by_the_next_build(tmp_path):
    """A build killed mid-parse left its hidden `.<cache>.arrow.<pid>.<id>.tmp` (as large as the cache) for ever.
    The next build of that cache removes those provably abandoned: this host's, of a process that has ended; a live
    writer's (another rank building the same cache) and another host's are kept."""
    import os
    import socket
    import subprocess
    import sys

    from lightning_rec.data import criteo

    path = write(tmp_path, "d.csv", "label," + HEADER_FEATURES + "\n" + good_row(1, sep=",") + "\n")
    cache = tmp_path / "cache"
    arrow, _ = build_criteo_cache(path, cache)
    arrow.unlink()  # the next call builds again
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, host = int(ended.stdout), socket.gethostname().replace("~", "-")
    old = 1_000_000_000  # 2001: long before this build
    files = {  # name: removed?
        f".{arrow.name}.{host}~{dead}.0badc0de.tmp": True,
        f"{arrow.with_suffix('.json').name}.{host}~{dead}.0badc0de.tmp": True,  # its report's
        f".{arrow.name}.{dead}.1badc0de.tmp": True,  # written before the host was in the name: a day old
        f".{arrow.name}.{host}~{os.getpid()}.2badc0de.tmp": False,  # a live process is writing it
        f".{arrow.name}.another-host~{dead}.3badc0de.tmp": False,  # another host's pid says nothing here
        f".other.arrow.{host}~{dead}.4badc0de.tmp": False,  # another cache's: its own build removes it
    }
    for name in files:
        (cache / name).write_text("x")
        os.utime(cache / name, (old, old))
    recent = cache / f".{arrow.name}.{dead}.5badc0de.tmp"  # no host, touched just now: kept (a day's grace)
    recent.write_text("x")
    assert criteo._pid_alive(os.getpid()) and not criteo._pid_alive(dead)
    build_criteo_cache(path, cache)
    assert {name: not (cache / name).exists() for name in files} == files and recent.exists()
    assert not [f for f in cache.iterdir() if f.name.endswith(".tmp") and "badc0de" not in f.name]


def test_batch_to_a_dtype_converts_floating_tensors_only_as_module_to():
    """Batch.to(torch.float64) passed the dtype into the KJT: ids and lengths became float64 (a lookup then failed
    or read other rows). As nn.Module.to: dense features, labels and id weights convert; ids keep their type."""
    from lightning_rec.data import RankingBatch, RetrievalBatch

    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([3, 7, 9]), torch.tensor([1, 0, 2, 0]),
                                              weights=torch.tensor([0.5, 1.0, 2.0]))
    batch = Batch(torch.randn(2, 13), kjt, torch.tensor([0.0, 1.0]), row_ids=torch.tensor([4, 5]))
    for out in (batch.to(torch.float64), batch.to("cpu", torch.float64), batch.to(dtype=torch.float64),
                batch.to(device="cpu", dtype=torch.float64, non_blocking=True)):
        assert out.dense_features.dtype == out.labels.dtype == out.sparse_features.weights().dtype == torch.float64
        torch.testing.assert_close(out.dense_features, batch.dense_features.double())
        sparse = out.sparse_features
        assert sparse.values().dtype == torch.int64 and torch.equal(sparse.values(), kjt.values())
        assert torch.equal(sparse.lengths(), kjt.lengths()) and sparse.lengths().dtype == kjt.lengths().dtype
        assert out.row_ids.dtype == torch.int64
    same = batch.to("cpu", non_blocking=True)  # Lightning's call: nothing converts
    assert same.dense_features.dtype == torch.float32 and same.sparse_features is kjt
    with pytest.raises(TypeError, match=r"Batch.to\(torch.int32\): .*floating-point tensors only"):
        batch.to(torch.int32)
    with pytest.raises(ValueError, match=r"KeyedJaggedTensor.to\(torch.float64\): .*dtype=torch.float64\) converts "
                                         r"the weights only"):
        kjt.to(torch.float64)  # the dtype where the device goes (TorchRec's KJT.to(device, dtype=...) is the fix)
    assert kjt.to("cpu", dtype=torch.float16).weights().dtype == torch.float16  # TorchRec's: the weights
    ranking = RankingBatch(KeyedJaggedTensor.from_lengths_sync(["u"], torch.tensor([1]), torch.tensor([1])),
                           torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([3]), torch.tensor([0, 0]),
                           torch.tensor([], dtype=torch.long))
    assert all(t.dtype == torch.int64 for t in vars(ranking.to(torch.float64)).values() if isinstance(t, torch.Tensor))
    pairs = RetrievalBatch(ranking.user_features, ranking.user_features, torch.tensor([0]), torch.tensor([1]),
                           torch.tensor([-0.5]))
    pairs = pairs.to(torch.float64)
    assert pairs.item_log_q.dtype == torch.float64 and pairs.user_index.dtype == torch.int64


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="one per feature"):
        CriteoDataModule(num_embeddings_per_feature=[10] * 3)
    with pytest.raises(ValueError, match="on_bad_row"):
        CriteoDataModule(on_bad_row="ignore")
    with pytest.raises(ValueError, match="missing_categorical"):
        CriteoDataModule(missing_categorical="zero")
    with pytest.raises(ValueError, match="does not exist"):
        build_criteo_cache(tmp_path / "nope.tsv", tmp_path)
    path = write(tmp_path, "x.tsv", "1\t2\t3\n")
    with pytest.raises(ValueError, match="has_label"):
        detect_layout(path)


# ----------------------------------------------------------------------------------------------
# synthetic


def _auc(scores, labels) -> float:
    """Exact AUC by the rank statistic, ties averaged (numpy)."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels)
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2)[inverse]
    pos = labels.sum()
    return float((ranks[labels == 1].sum() - pos * (pos + 1) / 2) / (pos * (len(labels) - pos)))


def test_synthetic_deterministic_and_splits_differ():
    a = SyntheticCriteoDataModule(num_train_samples=2000, num_val_samples=500, seed=5)
    b = SyntheticCriteoDataModule(num_train_samples=2000, num_val_samples=500, seed=5)
    c = SyntheticCriteoDataModule(num_train_samples=2000, num_val_samples=500, seed=6)
    for dm in (a, b, c):
        dm.setup("fit")
    ta, tb, tc = (dm.datasets["train"] for dm in (a, b, c))
    assert torch.equal(ta.ids_NFL, tb.ids_NFL) and torch.equal(ta.labels_N, tb.labels_N)
    assert not torch.equal(ta.ids_NFL, tc.ids_NFL)
    assert not torch.equal(ta.ids_NFL[:500], a.datasets["val"].ids_NFL)
    batch_a, batch_b = next(iter(a.train_dataloader())), next(iter(b.train_dataloader()))
    assert torch.equal(batch_a.sparse_features.values(), batch_b.sparse_features.values())


def test_synthetic_planted_signal_is_learnable():
    dm = SyntheticCriteoDataModule(num_train_samples=50_000, num_val_samples=10_000, seed=0)
    dm.setup("fit")
    train, val = dm.datasets["train"], dm.datasets["val"]
    assert 0.2 < float(train.labels_N.mean()) < 0.3
    assert _auc(val.logits, val.labels_N) > 0.8  # the Bayes AUC
    # per-id click rates counted on train (what an embedding table can learn) rank val samples
    score = torch.zeros(len(val), dtype=torch.float64)
    for f in range(dm.num_signal_features):
        n = dm.num_embeddings_per_feature[f]
        ids = train.ids_NFL[:, f, 0]
        clicks = torch.bincount(ids, weights=train.labels_N.double(), minlength=n)
        rate = (clicks + 2.5) / (torch.bincount(ids, minlength=n) + 10.0)
        score += torch.logit(rate[val.ids_NFL[:, f, 0]])
    assert _auc(score, val.labels_N) > 0.65
    noise = torch.zeros(len(val))
    for f in range(dm.num_signal_features, 26):  # features without signal predict nothing
        n = dm.num_embeddings_per_feature[f]
        ids = train.ids_NFL[:, f, 0]
        clicks = torch.bincount(ids, weights=train.labels_N.double(), minlength=n)
        rate = (clicks + 2.5) / (torch.bincount(ids, minlength=n) + 10.0)
        noise += torch.logit(rate[val.ids_NFL[:, f, 0]])
    assert abs(_auc(noise, val.labels_N) - 0.5) < 0.05


def test_synthetic_multi_hot_variable_lengths():
    sizes = [50 + j for j in range(26)]
    dm = SyntheticCriteoDataModule(
        num_train_samples=300, num_val_samples=0, batch_size=64, ids_per_feature=[1, 3] * 13,
        variable_length=True, num_embeddings_per_feature=sizes,
    )
    dm.setup("fit")
    assert dm.val_dataloader() == []
    batches = list(dm.train_dataloader())
    assert [len(b) for b in batches] == [64, 64, 64, 64, 44]
    kjt = batches[0].sparse_features
    lengths_FB = kjt.lengths().view(26, 64)
    assert int(lengths_FB.sum()) == kjt.values().numel()
    assert (lengths_FB == 0).any() and int(lengths_FB[1].max()) <= 6 and int(lengths_FB[0].max()) <= 2
    per_key = kjt.values().split(lengths_FB.sum(1).tolist())
    assert all(v.numel() == 0 or (int(v.max()) < n and int(v.min()) >= 0) for v, n in zip(per_key, sizes))
    # a bag's ids come from that sample's row: sample 7, feature C2, against the raw tensors
    ds = dm.datasets["train"]
    assert batches[0].dense_features.shape == (64, 13) and batches[0].labels.shape == (64,)
    single = ds[[7]].sparse_features
    n = int(ds.lengths_NF[7, 1])
    offsets = single.offsets().tolist()
    assert single.values()[offsets[1]:offsets[2]].tolist() == ds.ids_NFL[7, 1, :n].tolist()


def test_synthetic_workers_and_bad_args():
    dm = SyntheticCriteoDataModule(num_train_samples=1000, num_val_samples=100, batch_size=100, num_workers=2)
    dm.setup("fit")
    assert sum(len(b) for b in dm.train_dataloader()) == 1000
    with pytest.raises(ValueError, match="ids_per_feature"):
        SyntheticCriteoDataModule(ids_per_feature=[1, 2])
    with pytest.raises(ValueError, match="num_test_samples=0"):
        dm._loader("test")


def test_streaming_small_file_splits_rows_evenly_between_readers(tmp_path):
    # one block, two readers: dealt row by row, 50 rows each (dealt by blocks, one reader would get all)
    from torch.utils.data import DataLoader

    from lightning_rec.data.batch import passthrough_collate

    path = write(tmp_path, "s.tsv", "".join(good_row(label=k % 2, i1=str(k)) + "\n" for k in range(100)))
    ds = CriteoIterableDataset(path, batch_size=16, num_embeddings_per_feature=10)
    loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=passthrough_collate)
    sizes = [len(b) for b in loader]
    rows = torch.cat([b.dense_features[:, 0] for b in DataLoader(ds, batch_size=None, num_workers=2,
                                                                  collate_fn=passthrough_collate)])
    assert sorted(sizes) == sorted([16, 16, 16, 2] * 2)  # 50 rows per reader
    assert torch.unique(rows).numel() == 100 and rows.numel() == 100


def test_streamed_blocks_go_to_ranks_alike_at_any_worker_count(tmp_path, monkeypatch):
    """10 blocks, 2 ranks x 2 workers: dealt rank-major, rank 0 read 6 blocks and rank 1 4 (in training both stop at
    the shorter share: a fifth of the file never trained on), and a rank's rows changed with num_workers."""
    from torch.utils.data import DataLoader

    import lightning_rec.data.criteo.datasets as criteo_module  # where the stream looks dist_rank_world up
    from lightning_rec.data.batch import passthrough_collate

    path = write(tmp_path, "s.tsv", "".join(good_row(label=k % 2, i1=str(k)) + "\n" for k in range(500)))
    block_bytes = path.stat().st_size // 10 + 1

    def rows_of(rank: int, num_workers: int) -> list[int]:
        # what a process group of 2 ranks gives (workers keep what the main process saw)
        monkeypatch.setattr(criteo_module, "dist_rank_world", lambda: (rank, 2))
        ds = CriteoIterableDataset(path, batch_size=16, num_embeddings_per_feature=10, block_bytes=block_bytes)
        loader = DataLoader(ds, batch_size=None, num_workers=num_workers, collate_fn=passthrough_collate)
        return sorted(torch.cat([b.dense_features[:, 0] for b in loader]).expm1().round().long().tolist())

    two_workers = [rows_of(rank, 2) for rank in (0, 1)]
    assert sorted(two_workers[0] + two_workers[1]) == list(range(500))
    assert abs(len(two_workers[0]) - len(two_workers[1])) <= 51  # one block at most
    assert [rows_of(rank, 0) for rank in (0, 1)] == two_workers


@pytest.mark.parametrize(("reload", "num_workers"), [(0, 0), (1, 0), (1, 2)])
def test_a_stream_reloaded_every_epoch_still_draws_each_epochs_order(tmp_path, reload, num_workers):
    """Trainer(reload_dataloaders_every_n_epochs=1) makes a new loader each epoch, whose pass count started at 0: a
    shuffled stream (and a preprocessed directory: both shuffle by pass) trained epoch 0's order every epoch.
    With (persistent) workers, each counted its own passes, and Lightning iterates a loader made anew twice at its
    epoch's start: epoch e trained epoch e + 1's order."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from lightning_rec.data.batch import passthrough_collate

    class Rows(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.rows: list[list[int]] = []

        def on_train_epoch_start(self):
            self.rows.append([])

        def training_step(self, batch, batch_idx):
            self.rows[-1] += batch.dense_features[:, 0].expm1().round().long().tolist()
            return self.w.square().sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    path = write(tmp_path, "s.tsv", "".join(good_row(label=k % 2, i1=str(k)) + "\n" for k in range(64)))
    data = CriteoDataModule(train_path=str(path), batch_size=8, num_embeddings_per_feature=10, streaming=True,
                            num_workers=num_workers)
    module = Rows()
    L.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False,
              reload_dataloaders_every_n_epochs=reload).fit(module, data)
    assert all(sorted(rows) == list(range(64)) for rows in module.rows)
    assert module.rows[0] != module.rows[1] != module.rows[2]
    stream = data.datasets["train"]
    want = []
    for epoch in range(3):
        stream.set_epoch(epoch)  # (workers that are not persistent: each pass's start from the told epoch)
        loader = DataLoader(stream, batch_size=None, num_workers=num_workers, collate_fn=passthrough_collate)
        want.append([int(r) for b in loader for r in b.dense_features[:, 0].expm1().round()])
    assert module.rows == want


def _hand_loop_rows(rank: int, world_size: int, path: str, cache: str) -> list[list[tuple]]:
    """Two passes of a Criteo training loader, outside a Trainer: each row as its dense features."""
    dm = CriteoDataModule(train_path=path, batch_size=16, cache_dir=cache, seed=1)
    dm.setup("fit")
    loader = dm.train_dataloader()
    return [[tuple(r) for b in loader for r in b.dense_features.tolist()] for _ in range(2)]


def test_training_loaders_outside_a_trainer_shard_by_rank_and_reshuffle_every_pass(tmp_path):
    """A hand-written loop (TrainPipelineSparseDist, DistributedModelParallel without Lightning): at 2 ranks every
    rank read every row of a map-style file (the ranks trained on copies; streams and shard sets were dealt by
    rank already), and each pass drew the first pass's order again. (The synthetic module is left per rank: its
    rows come from its seed, which a hand loop sets per rank.)"""
    from tests.dist_utils import run_ranks

    path = str(write(tmp_path, "rows.tsv", "\n".join(good_row(n % 2, i1=str(n)) for n in range(96)) + "\n"))
    build_criteo_cache(path, tmp_path / "cache")  # once, before the ranks read it
    alone = _hand_loop_rows(0, 1, path, str(tmp_path / "cache"))
    assert sorted(alone[0]) == sorted(alone[1]) and alone[0] != alone[1] and len(set(alone[0])) == 96
    ranks = run_ranks(_hand_loop_rows, 2, path, str(tmp_path / "cache"), timeout=60)
    for pass_ in range(2):
        a, b = ranks[0][pass_], ranks[1][pass_]
        assert len(a) == len(b) == 48 and not set(a) & set(b) and sorted(a + b) == sorted(alone[0])
    assert ranks[0][0] != ranks[0][1]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_datasets_dataset_of_no_rows_is_refused_naming_the_argument(tmp_path, streaming, monkeypatch):
    # it was written to the cache as it was: then refused naming that copy (MovieLens: "no interactions left in
    # <cache>/hf_datasets/<hash>/ratings.parquet") or, streamed, a fit of no batches that said nothing
    datasets = pytest.importorskip("datasets")
    from lightning_rec.data import MovieLensDataModule

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    columns = {"label": [0], **{f"I{i}": [1] for i in range(1, 14)}, **{f"C{i}": ["0a1b2c3d"] for i in range(1, 27)}}
    empty = datasets.Dataset.from_dict(columns).filter(lambda row: row["label"] == 1)
    with pytest.raises(ValueError, match=r"CriteoDataModule train_path is a Dataset of 0 rows \(columns \['label', "
                                         r"'I1'.*\]\): pass one that holds rows"):
        CriteoDataModule(train_path=empty, cache_dir=str(tmp_path / "cache"), streaming=streaming)
    log = datasets.Dataset.from_dict({"user": [1, 2], "item": [3, 4]}).select([])
    with pytest.raises(ValueError, match=r"MovieLensDataModule data_dir is a Dataset of 0 rows"):
        MovieLensDataModule(log)
    assert not list(tmp_path.rglob("*.parquet"))  # nothing written


def test_a_datasets_dataset_with_a_transform_is_refused_not_copied_without_it(tmp_path, monkeypatch):
    # with_transform runs as rows are read; the copy (written from the Arrow table) held the rows without it, so
    # MovieLensDataModule trained on user ids 0.. where the user's Dataset showed 100..
    datasets = pytest.importorskip("datasets")
    from lightning_rec.data import MovieLensDataModule

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    log = datasets.Dataset.from_dict({"user": [0, 1, 2, 3] * 3, "item": list(range(12))})
    moved = log.with_transform(lambda rows: {"user": [u + 100 for u in rows["user"]], "item": rows["item"]})
    assert moved[0]["user"] == 100  # what the user sees
    with pytest.raises(ValueError, match=r"data_dir is a Dataset with a transform .*ds\.map\(transform, batched="):
        MovieLensDataModule(moved)
    with pytest.raises(ValueError, match=r"data_dir\['test'\] is a Dataset with a transform"):
        MovieLensDataModule(datasets.DatasetDict(train=log, test=moved), split="given")
    mapped = log.map(lambda rows: {"user": [u + 100 for u in rows["user"]]}, batched=True)  # the way said
    dm = MovieLensDataModule(mapped, side_features=False)
    dm.setup()
    assert sorted(dm.user_ids.tolist()) == [100, 101, 102, 103]


def _trainer_samplers(rank: int, world_size: int, tmp: str, use_distributed_sampler: bool) -> list:
    """Each data module's training sampler after a 1-step fit under a 2-rank Trainer: (kind, seed, indices)."""
    import lightning.pytorch as L

    from lightning_rec.data import MovieLensDataModule

    class Step(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            return self.w.square().sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    L.seed_everything(5)  # not the data modules' seeds (3)
    modules = [CriteoDataModule(train_path=f"{tmp}/rows.tsv", batch_size=8, cache_dir=f"{tmp}/cache", seed=3),
               SyntheticCriteoDataModule(num_train_samples=40, num_val_samples=0, batch_size=8, seed=3,
                                         num_embeddings_per_feature=[10] * 26),
               MovieLensDataModule(f"{tmp}/ml", batch_size=8, seed=3, side_features=False)]
    out = []
    for dm in modules:
        trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=world_size, max_epochs=1, limit_train_batches=1,
                            limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, use_distributed_sampler=use_distributed_sampler)
        trainer.fit(Step(), dm)
        sampler = trainer.train_dataloader.batch_sampler.sampler
        out.append((type(sampler).__name__, getattr(sampler, "seed", None), list(sampler), len(dm.datasets["train"])))
    return out


@pytest.mark.parametrize("use_distributed_sampler", [True, False])
def test_training_loaders_under_a_2_rank_trainer_take_the_data_modules_seed(tmp_path, use_distributed_sampler):
    """Criteo and synthetic at 2 ranks: Lightning's DistributedSampler, seeded by seed_everything, set the shuffle
    order, not the data module's `seed` (MovieLens had its own). Trainer(use_distributed_sampler=False): MovieLens
    still sharded itself, where a user expects the whole loader on every rank, as Lightning leaves it."""
    from torch.utils.data import DistributedSampler

    from tests.dist_utils import run_ranks

    path = write(tmp_path, "rows.tsv", "\n".join(good_row(n % 2, i1=str(n)) for n in range(40)) + "\n")
    build_criteo_cache(str(path), tmp_path / "cache")
    (tmp_path / "ml").mkdir()
    write(tmp_path / "ml", "ratings.csv", "userId,movieId,rating,timestamp\n"
          + "".join(f"{u},{i},4,{u * 100 + i}\n" for u in range(8) for i in range(u % 3, 12, 2)))
    ranks = run_ranks(_trainer_samplers, 2, str(tmp_path), use_distributed_sampler, timeout=240)
    for rank, samplers in enumerate(ranks):
        for kind, seed, indices, rows in samplers:
            if use_distributed_sampler:
                want = DistributedSampler(range(rows), num_replicas=2, rank=rank, shuffle=True, seed=3)
                assert (kind, seed, indices) == ("ElasticDistributedSampler", 3, list(want))  # torch's deal
            else:
                assert kind == "EpochRandomSampler" and sorted(indices) == list(range(rows))


def _plain_ddp_stream_fit(rank: int, world_size: int, path: str, block_bytes: int, root: str, max_steps: int,
                          ckpt: str | None) -> tuple:
    """A plain DDP fit (a dense model, 2 epochs) over a stream whose ranks' shares differ, checkpointed at step 15."""
    import warnings

    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Dense(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(13, 1)
            self.rows: list[list[int]] = [[]]

        def on_train_epoch_start(self):
            self.rows.append([])

        def training_step(self, batch, batch_idx):
            self.rows[-1] += batch.dense_features[:, 0].expm1().round().long().tolist()
            return self.lin(batch.dense_features).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = CriteoDataModule(train_path=path, batch_size=16, num_embeddings_per_feature=10, streaming=True,
                            block_bytes=block_bytes)
    module = Dense()
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=world_size, max_epochs=2, max_steps=max_steps,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=15, save_top_k=-1)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data, ckpt_path=ckpt)
    said = [str(w.message) for w in caught if "batches are skipped" in str(w.message)]
    return trainer.global_step, [rows for rows in module.rows if rows], said, module.lin.weight.detach()


def test_a_stream_under_plain_ddp_ends_each_epoch_when_a_ranks_share_runs_out(tmp_path):
    """Trainer(strategy="ddp") over a stream whose ranks' shares differ (5 blocks: 3 to one rank, 2 to the other):
    the rank with more batches waited in DDP's gradient all-reduce for a rank that had gone on to the next epoch
    (its steps paired with the other's next-epoch ones), until gloo's "Connection closed by peer". The ranks now
    agree before each batch that all have one, as DistributedSampler(drop_last=True) evens a sized loader. And a
    run resumed mid-epoch read rank 0's stream position on every rank (Lightning's checkpoint holds rank 0's
    loader state): rank 1 started its share over while the loop counted on. Each rank's is kept now."""
    from tests.dist_utils import run_ranks

    path = write(tmp_path, "rows.tsv", "".join(good_row(k % 2, i1=str(k)) + "\n" for k in range(500)))
    args = (str(path), path.stat().st_size // 5 + 1, str(tmp_path / "ckpt"))
    whole = run_ranks(_plain_ddp_stream_fit, 2, *args, -1, None, timeout=240, pg_timeout=60)
    (steps0, rows0, said0, _), (steps1, rows1, said1, _) = whole
    assert steps0 == steps1 == 2 * -(-len(rows1[0]) // 16)  # the shorter share's batches, every epoch, both ranks
    for epoch in range(2):
        assert not set(rows0[epoch]) & set(rows1[epoch])
        assert 300 < len(rows0[epoch] + rows1[epoch]) < 500  # the longer share's extra block is left out
    assert sorted((len(said0), len(said1))) == [0, 2] and "strategy='rec'" not in (said0 + said1)[0]
    assert steps0 > 16
    run_ranks(_plain_ddp_stream_fit, 2, *args, 16, None, timeout=240, pg_timeout=60)  # stopped after step 16
    resumed = run_ranks(_plain_ddp_stream_fit, 2, *args, -1, str(tmp_path / "ckpt" / "epoch=1-step=15.ckpt"),
                        timeout=240, pg_timeout=60)
    for rank in range(2):
        assert resumed[rank][0] == whole[rank][0]
        assert resumed[rank][1][0] == whole[rank][1][1][-len(resumed[rank][1][0]):]  # the rest of epoch 1's rows
        assert torch.equal(resumed[rank][3], whole[rank][3])


@pytest.mark.parametrize("streaming", [False, True])
def test_a_header_without_rows_is_refused_streamed_or_not(tmp_path, streaming):
    """A Kaggle-style CSV holding its header only: streamed, it trained on no batches in silence (cached: refused)."""
    header = "Id,Label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))
    path = write(tmp_path, "train.csv", header + "\n\n")
    dm = CriteoDataModule(train_path=str(path), cache_dir=str(tmp_path / "cache"), streaming=streaming, batch_size=4)
    with pytest.raises(ValueError, match=r"train\.csv has no data rows \(a header only\)"):
        dm.prepare_data()
        dm.setup("fit")
    # one row after it, without a final newline: read
    row = ",".join(["7", "1"] + ["2"] * 13 + ["68fd1e64"] * 26)
    path = write(tmp_path, "one.csv", header + "\n" + row)
    dm = CriteoDataModule(train_path=str(path), cache_dir=str(tmp_path / "cache"), streaming=streaming, batch_size=4)
    dm.prepare_data()
    dm.setup("fit")
    assert [len(b) for b in dm.train_dataloader()] == [1]


def test_data_modules_take_dataloader_worker_arguments_and_check_them_at_construction(tmp_path):
    # prefetch_factor / persistent_workers were a TypeError (no such argument); num_workers=-1 was refused only when
    # the first loader was built, as "num_workers must be >= 0", without the data module's name
    from lightning_rec.data import MovieLensDataModule

    (tmp_path / "ml").mkdir()
    (tmp_path / "ml" / "ratings.csv").write_text("user,item,rating\n" + "".join(
        f"{u},{i},1\n" for u in range(6) for i in range(6)))
    csv = tmp_path / "c.tsv"
    row = "1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["0a1b2c3d"] * 26) + "\n"
    csv.write_text(row * 8)
    makers = {
        "SyntheticCriteoDataModule": lambda **kw: SyntheticCriteoDataModule(
            num_train_samples=64, num_val_samples=16, batch_size=8, num_embeddings_per_feature=10, **kw),
        "CriteoDataModule": lambda **kw: CriteoDataModule(train_path=str(csv), val_path=str(csv), batch_size=4,
                                                          num_embeddings_per_feature=10,
                                                          cache_dir=str(tmp_path / "cache"), **kw),
        "MovieLensDataModule": lambda **kw: MovieLensDataModule(str(tmp_path / "ml"), side_features=False,
                                                                batch_size=4, **kw),
    }
    for name, make in makers.items():
        dm = make(num_workers=1, prefetch_factor=3, persistent_workers=False)
        dm.prepare_data()
        dm.setup("fit")
        for loader in (dm.train_dataloader(), dm.val_dataloader()):
            assert (loader.prefetch_factor, loader.persistent_workers) == (3, False), name
        dm.num_workers, dm.prefetch_factor, dm.persistent_workers = 2, None, None  # set after construction: followed
        assert (dm.train_dataloader().num_workers, dm.train_dataloader().persistent_workers) == (2, True), name
        with pytest.raises(ValueError, match=rf"{name} num_workers=-1: give 0"):
            make(num_workers=-1)
        with pytest.raises(ValueError, match=rf"{name} prefetch_factor=2 needs worker processes: set num_workers"):
            make(prefetch_factor=2)
        with pytest.raises(ValueError, match=rf"{name} persistent_workers=True needs worker processes"):
            make(persistent_workers=True)


def _dataset_rows_at_rank(rank: int, world_size: int, root: str, seed: int | None) -> object:
    """Each rank builds its own Dataset, as each process of a Lightning run does, from its own numpy random state;
    the rows of a hand-written loop's first pass (dense I1 = the row's number), or the error."""
    import datasets

    from lightning_rec.data import MovieLensDataModule
    from lightning_rec.data.movielens import datamodule

    datamodule.default_cache_dir = lambda: Path(root) / "movielens"  # (this rank's process only)

    np.random.seed(100 + rank)  # two separately started processes: numpy's random state differs
    rows = [good_row(k % 2, i1=str(k)).split("\t") for k in range(64)]
    ds = datasets.Dataset.from_dict({"label": [int(r[0]) for r in rows],
                                     **{f"I{j}": [int(r[j]) for r in rows] for j in range(1, 14)},
                                     **{f"C{j}": [r[13 + j] for r in rows] for j in range(1, 27)}})
    ds = ds.shuffle(seed=seed)
    out = []
    for make in (lambda: CriteoDataModule(train_path=ds, batch_size=8, num_embeddings_per_feature=10,
                                          cache_dir=root, shuffle=False),
                 lambda: MovieLensDataModule(ds.rename_columns({"I1": "user", "I2": "item"}), side_features=False)):
        try:
            dm = make()
            dm.setup("fit")
            loader = dm.train_dataloader()
            out.append(sorted(int(r) for b in loader for r in b.dense_features[:, 0].expm1().round())
                       if isinstance(dm, CriteoDataModule) else len(dm.datasets["train"]))
        except ValueError as e:
            out.append(str(e))
    return out


def test_a_dataset_shuffled_without_a_seed_on_each_rank_is_refused_not_read_in_two_orders(tmp_path):
    """CriteoDataModule(train_path=ds.shuffle()) at 2 ranks: each process shuffled with its own numpy state, wrote its
    own copy, and read its share of another order: 16 of 64 rows trained twice and 16 never, in silence (MovieLens
    split each rank's order apart, so one rank's test interactions were another's training). Now setup compares the
    ranks' rows and says to seed the shuffle; seeded, each row is read once."""
    from tests.dist_utils import run_ranks

    unseeded = run_ranks(_dataset_rows_at_rank, 2, str(tmp_path / "a"), None, timeout=120)
    for rank_out in unseeded:
        assert all(isinstance(said, str) and "on rank 1 holds other rows" in said and "shuffle(seed=0)" in said
                   for said in rank_out), rank_out
    (rows0, users0), (rows1, users1) = run_ranks(_dataset_rows_at_rank, 2, str(tmp_path / "b"), 3, timeout=120)
    assert sorted(rows0 + rows1) == list(range(64)) and len(rows0) == len(rows1) == 32
    assert users0 == users1


@pytest.mark.parametrize("parser", ["native", "python"])
def test_a_minus_one_label_says_to_map_it_not_to_skip_every_negative_row(tmp_path, parser):
    """A -1/1-labelled file (libsvm style) was "label must be 0 or 1, got '-1'. Fix the file, or pass
    on_bad_row='skip'": skipping dropped every negative row, training on clicks alone. It now names the mapping; a
    table says the same; other bad labels keep the skip fix."""
    import datasets

    path = write(tmp_path, "pm.tsv", "\n".join(good_row(1).replace("1", "-1", 1) if k == 1 else good_row(1)
                                               for k in range(3)) + "\n")
    with pytest.raises(ValueError, match=r"pm\.tsv:2: label must be 0 or 1, got '-1'\. The file's labels look like "
                                         r"-1/1: map -1 to 0 first \(sed 's/\^-1/0/'.*would drop every negative row"):
        build_criteo_cache(str(path), tmp_path / "cache", parser=parser)
    rows = [good_row(0).split("\t") for _ in range(2)]
    ds = datasets.Dataset.from_dict({"label": [1, -1], **{f"I{j}": [int(r[j]) for r in rows] for j in range(1, 14)},
                                     **{f"C{j}": [r[13 + j] for r in rows] for j in range(1, 27)}})
    with pytest.raises(ValueError, match=r"row 1: label must be 0 or 1, got -1\. The table's labels look like -1/1"):
        CriteoDataModule(train_path=ds, cache_dir=str(tmp_path / "c")).prepare_data()
    write(tmp_path, "two.tsv", good_row(1).replace("1", "2", 1) + "\n")
    with pytest.raises(ValueError, match=r"got '2'\. Fix the file, or pass on_bad_row='skip'"):
        build_criteo_cache(str(tmp_path / "two.tsv"), tmp_path / "cache", parser=parser)


def test_the_separator_takes_the_words_preprocess_takes(tmp_path):
    """`lightning-rec preprocess --separator tab` takes the words, but the readers (`--data.separator` of the fit
    recipes, CriteoDataModule, read_criteo) took only the character: 'tab' was refused, and a backslash-t typed on a
    command line or in YAML (two characters) too. Both read now, as the tab itself does."""
    row = "1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["0a1b2c3d"] * 26) + "\n"
    path = tmp_path / "day.tsv"
    path.write_text(row * 4)
    for sep in ("tab", "\\t", "\t"):
        assert detect_layout(path, separator=sep).separator == "\t"
    comma = tmp_path / "day.csv"
    comma.write_text(row.replace("\t", ",") * 4)
    assert detect_layout(comma, separator="comma").separator == ","
    label, dense, sparse, _ = parse_all(path, separator="tab")
    assert label.tolist() == [1] * 4 and dense.tolist() == [[1] * 13] * 4 and (sparse == 0x0A1B2C3D).all()
    with pytest.raises(ValueError, match="'tab' / 'comma'"):
        detect_layout(path, separator=";")


def test_the_synthetic_test_loop_without_test_rows_says_it_scores_the_validation_split():
    """`lightning-rec test` of the synthetic recipe (num_test_samples=0) printed test_auc etc. of the validation rows
    without a word; now it says so once, naming num_test_samples. With test rows of its own, nothing is said."""
    import warnings

    data = SyntheticCriteoDataModule(num_train_samples=64, num_val_samples=64, batch_size=32,
                                     num_embeddings_per_feature=16)
    data.setup("test")
    with pytest.warns(UserWarning, match="num_test_samples=0, so the test loop scores the validation split"):
        data.test_dataloader()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*scores the validation split")
        data.test_dataloader()  # once
        data.predict_dataloader()  # predict has no metrics to mislabel
        own = SyntheticCriteoDataModule(num_train_samples=64, num_val_samples=64, num_test_samples=64, batch_size=32,
                                        num_embeddings_per_feature=16)
        own.setup("test")
        own.test_dataloader()


class _RowOrder(__import__("lightning.pytorch").pytorch.LightningModule):
    """Records the rows each training epoch reads, by their first dense feature (the row's number); its tables give
    strategy="rec" something to shard."""

    def __init__(self):
        from lightning_rec.data.criteo.schema import feature_names
        from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig
        from lightning_rec.optim import FusedOptimizerConfig

        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=f"t_{f}", num_embeddings=10, embedding_dim=2,
                                                              feature_names=[f]) for f in feature_names(None)],
                                          optimizer=FusedOptimizerConfig("sgd", lr=0.0))
        self.rows: list[list[int]] = []

    def on_train_epoch_start(self):
        self.rows.append([])

    def training_step(self, batch, batch_idx):
        self.rows[-1] += batch.dense_features[:, 0].expm1().round().long().tolist()
        return self.w.square().sum() + self.ebc(batch.sparse_features).values().sum() * 0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("strategy", ["rec", "ddp"])
def test_the_data_modules_order_is_the_order_trained_under_a_distributed_strategy_on_one_device(tmp_path, strategy):
    """--data.shuffle=false under strategy=rec on one device trained a shuffled order: Lightning puts a shuffling
    DistributedSampler of its own into the training loader of any distributed strategy, at one device too. And with
    shuffle=True the order came from seed_everything's seed, not the data module's `seed`."""
    import lightning.pytorch as L

    import lightning_rec.strategy  # noqa: F401  (registers strategy="rec")

    path = write(tmp_path, "rows.tsv", "".join(good_row(label=k % 2, i1=str(k)) + "\n" for k in range(48)))

    def trained(**kw) -> list[list[int]]:
        data = CriteoDataModule(train_path=str(path), batch_size=8, num_embeddings_per_feature=10,
                                cache_dir=str(tmp_path / "cache"), **kw)
        module = _RowOrder()
        L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False).fit(module, data)
        return module.rows

    assert trained(shuffle=False) == [list(range(48))] * 2
    L.seed_everything(5)
    first = trained(shuffle=True, seed=1)
    L.seed_everything(6)
    assert trained(shuffle=True, seed=1) == first and sorted(first[0]) == list(range(48)) and first[0] != first[1]


def _preprocessed(tmp_path: Path, rows: int = 40) -> tuple[Path, list[str]]:
    """A small preprocess run: (its output directory, the command line that wrote it)."""
    from lightning_rec.data.criteo_parse import native_parser_available

    if not native_parser_available():
        pytest.skip("preprocess needs the native parser")
    path = write(tmp_path, "rows.tsv", "".join(good_row(label=k % 2, i1=str(k)) + "\n" for k in range(rows)))
    argv = ["--input", str(path), "--output_dir", str(tmp_path / "shards"), "--num_embeddings", "1e3",
            "--no_shuffle_rows", "--no_progress"]
    return tmp_path / "shards", argv


def _shard_rows(directory: Path) -> list[int]:
    from lightning_rec.data.criteo_shards import CriteoShardDataset

    return [int(r) for b in CriteoShardDataset(directory, 8) for r in b.dense_features[:, 0].expm1().round()]


@pytest.mark.parametrize("damage", ["npy", "manifest"])
def test_a_shard_directory_cut_short_names_the_file_and_rerunning_preprocess_mends_it(tmp_path, capsys, damage):
    # a shard .npy cut short gave numpy's "mmap length is greater than file size" (the manifest holds each shard's
    # row count), a manifest.json cut short a raw JSONDecodeError
    from lightning_rec.cli import preprocess_main

    out, argv = _preprocessed(tmp_path)
    manifest = preprocess_main(argv)  # (--num_embeddings 1e3: the integer it means)
    assert manifest["num_embeddings_per_feature"] == [1000] * 26 and _shard_rows(out) == list(range(40))
    damaged = out / "manifest.json" if damage == "manifest" else out / f"{manifest['shards'][0]['name']}.dense.npy"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    said = (rf"{damaged} is damaged or incomplete" if damage == "manifest" else
            rf"{out}: shard {manifest['shards'][0]['name']} is damaged or incomplete: {damaged.name} is not a readable")
    with pytest.raises(ValueError, match=re.escape(said).replace("\\ ", " ") + r".*rerun the `lightning-rec "
                                         r"preprocess` command that wrote it .*or copy the directory again"):
        _shard_rows(out)
    preprocess_main(argv)  # the advice: the same command redoes what is damaged
    assert _shard_rows(out) == list(range(40))
    capsys.readouterr()


@pytest.mark.parametrize("option,value,said", [
    ("--num_embeddings", "1.5", "--num_embeddings 1.5: give rows per table as one int (e.g. 40000000 or 4e7)"),
    ("--num_embeddings", "ten", "--num_embeddings ten: give rows per table as one int"),
    ("--output_dir", "a_file", "--output_dir {tmp_path}/a_file: it is a file: give a directory"),
    ("--output_dir", "a_file/sub", "--output_dir {tmp_path}/a_file/sub: a folder above it is a file"),
])
def test_preprocess_refuses_a_bad_option_in_one_line_naming_it(tmp_path, capsys, option, value, said):
    # --num_embeddings 1e7 printed a traceback (`invalid literal for int()`), an --output_dir naming a file a
    # FileExistsError traceback
    from lightning_rec.cli import preprocess_main

    _, argv = _preprocessed(tmp_path)
    (tmp_path / "a_file").write_text("x")
    argv[argv.index(option) + 1] = str(tmp_path / value) if option == "--output_dir" else value
    with pytest.raises(SystemExit) as refused:
        preprocess_main(argv)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1 and said.format(tmp_path=tmp_path) in err, err
