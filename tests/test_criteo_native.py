"""The native Criteo op (torch.ops.lightning_rec.parse_criteo) against the Python reference parser.

Every shared Criteo file, both layouts, the ragged-row and float-integer files: same rows, labels,
dense values, ids and reports. Every bad-input case: the same error (file:line and field) or the same
counted skip from both parsers. Real data is read from ../shared/data; those tests skip without it.
"""

from __future__ import annotations

import gzip
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA

from lightning_rec.data import CriteoDataModule, CriteoIterableDataset, build_criteo_cache, make_criteo_batch
from lightning_rec.data.criteo_parse import (
    HASH_EMPTY_BAG,
    HASH_RESERVED_ID,
    ParseReport,
    detect_layout,
    iter_blocks,
    native_parser_available,
    parse_block_native,
    read_criteo,
)

CRITEO = SHARED_DATA / "criteo"
needs_criteo = pytest.mark.skipif(not CRITEO.is_dir(), reason="shared Criteo samples not present")
pytestmark = pytest.mark.skipif(not native_parser_available(), reason="lightning_rec._C is not built")
SHARED_FILES = sorted(p.relative_to(CRITEO).as_posix() for p in CRITEO.rglob("*") if p.is_file()) if CRITEO.is_dir() else []  # noqa: E501
PARSERS = ["native", "python"]
HEADER_FEATURES = ",".join([f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)])


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


def good_row(label: int = 0, i1: str = "1", c1: str = "68fd1e64", sep: str = "\t") -> str:
    dense = [i1] + [str(k) for k in range(2, 14)]
    sparse = [c1] + [f"{k:08x}" for k in range(2, 27)]
    return sep.join([str(label)] + dense + sparse)


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def report_counts(r: ParseReport) -> tuple:
    return r.num_rows, r.num_padded_rows, r.num_skipped_rows, r.num_blank_lines, r.skipped


# ----------------------------------------------------------------------------------------------
# the op itself


def _op_args(buf: bytes, **kw):
    t = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    return (t, 9, 40, 0, list(range(1, 14)), list(range(14, 40)), kw.get("sizes", []), kw.get("mode", 0),
            kw.get("log", False))


def test_opcheck_schema_fake_kernel_and_tracing():
    rows = "".join(good_row(label=k % 2, i1=str(k)) + "\n" for k in range(5)).encode()
    hashed = ({"sizes": [7] * 26, "mode": HASH_RESERVED_ID, "log": True}, {"sizes": [5] * 26, "mode": HASH_EMPTY_BAG})
    for kw in ({}, *hashed):
        torch.library.opcheck(torch.ops.lightning_rec.parse_criteo.default, _op_args(rows, **kw))
    # rows with missing values give NaN, which the traced-vs-eager comparison does not accept as equal
    ragged = (good_row() + "\n\n" + "\t".join(good_row().split("\t")[:30]) + "\n").encode()
    torch.library.opcheck(torch.ops.lightning_rec.parse_criteo.default, _op_args(ragged),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_op_refuses_bad_arguments():
    args = list(_op_args((good_row() + "\n").encode()))
    with pytest.raises(RuntimeError, match="end with a newline"):
        torch.ops.lightning_rec.parse_criteo(torch.frombuffer(bytearray(b"1\t2"), dtype=torch.uint8), *args[1:])
    with pytest.raises(RuntimeError, match="26 sizes"):
        torch.ops.lightning_rec.parse_criteo(*args[:6], [5], 1, False)
    with pytest.raises(RuntimeError, match="used twice"):
        torch.ops.lightning_rec.parse_criteo(args[0], 9, 40, 1, *args[4:])


def _random_rows(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    lines = []
    for k in range(n):
        dense = [("" if rng.random() < 0.2 else str(int(rng.integers(-2, 10**5)))) for _ in range(13)]
        sparse = [("" if rng.random() < 0.1 else f"{int(rng.integers(0, 2**32)):08x}") for _ in range(26)]
        lines.append("\t".join([str(k % 2)] + dense + sparse))
    return "\n".join(lines) + "\n"


def test_threads_and_line_ranges_give_the_same_rows(tmp_path):
    """Over 2 MiB (several line ranges per thread); 1, 2 and 7 threads give the same arrays, in order."""
    text = _random_rows(2000, 0)
    text = text * (1 + (3 << 20) // len(text))
    layout = detect_layout(write(tmp_path, "r.tsv", text[:100_000]))
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 7):
            torch.set_num_threads(n)
            outs.append(parse_block_native(text.encode(), 1, layout, "r.tsv", "error", ParseReport(path="r")))
    finally:
        torch.set_num_threads(threads)
    assert outs[0][0].shape[0] == text.count("\n")
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)
    ref = parse_all(write(tmp_path, "r.tsv", text), parser="python")
    for a, b in zip(outs[0], ref[:3]):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------------------------
# parity on every shared file


@needs_criteo
@pytest.mark.parametrize("name", SHARED_FILES, ids=lambda v: v[-28:])
def test_same_rows_as_reference_on_every_shared_file(name):
    if not name.endswith((".tsv", ".csv", ".txt")):
        pytest.skip("not a Criteo file")
    for block_bytes in (64 << 20, 100_000):  # one block, and many (rows split across blocks)
        ref = parse_all(CRITEO / name, parser="python", block_bytes=block_bytes)
        nat = parse_all(CRITEO / name, parser="native", block_bytes=block_bytes)
        for a, b in zip(ref[:3], nat[:3]):
            np.testing.assert_array_equal(a, b)  # NaN == NaN here: missing values agree too
        assert report_counts(ref[3]) == report_counts(nat[3]) and ref[3].num_rows > 0
    tiny = parse_all(CRITEO / name, parser="native", block_bytes=150)  # lines longer than the read buffer
    for a, b in zip(ref[:3], tiny[:3]):
        np.testing.assert_array_equal(a, b)


@needs_criteo
@pytest.mark.parametrize("missing", ["reserved_id", "empty_bag"])
def test_hashing_and_log_in_the_op_match_the_batch_path(missing):
    """hash_mode / log_dense (what preprocess uses) == make_criteo_batch on the raw values."""
    path = CRITEO / "other/pytorch-fm_criteo_train_head1000_trailing-tabs-stripped.txt"
    layout = detect_layout(path)
    sizes = [1000 + 37 * j for j in range(26)]
    block, first = b"".join(b for b, _ in iter_blocks(path, 64 << 20, False)), 1
    label, dense_raw, sparse_raw = parse_block_native(block, first, layout, str(path), "error", ParseReport(path=""))
    mode = HASH_RESERVED_ID if missing == "reserved_id" else HASH_EMPTY_BAG
    _, dense_log, ids = parse_block_native(block, first, layout, str(path), "error", ParseReport(path=""),
                                           hash_mode=mode, num_embeddings=sizes, log_dense=True)
    batch = make_criteo_batch(label, dense_raw, sparse_raw, np.asarray(sizes), [f"C{i}" for i in range(1, 27)], missing)
    # log1p of the same float32 count; libm and numpy may round the last bit differently
    torch.testing.assert_close(torch.from_numpy(dense_log), batch.dense_features, rtol=1e-6, atol=0)
    ids_FB = torch.from_numpy(ids).t()
    values = ids_FB.reshape(-1) if missing == "reserved_id" else ids_FB[ids_FB >= 0]
    assert torch.equal(values, batch.sparse_features.values())


# ----------------------------------------------------------------------------------------------
# bad input: the same error (file:line:field) or counted skip from both parsers


BAD_ROWS = [
    (good_row() + "\textra", "41 fields"),
    (good_row(i1="abc"), "I1 must be a number, got 'abc'"),
    (good_row(i1="1x"), "I1 must be a number, got '1x'"),
    (good_row(i1="inf"), "I1 must be a number"),
    (good_row(c1="zzzzzzzz"), "C1 must be 8 hex characters, got 'zzzzzzzz'"),
    (good_row(c1="68fd1e6"), "C1 must be 8 hex characters, got '68fd1e6'"),  # a value cut short
    (good_row(c1="68fd1e64a"), "C1 must be 8 hex characters"),
    (good_row(label=2), "label must be 0 or 1, got '2'"),
    ("\t".join(good_row().split("\t")[:20]) + "\t", r"21 of 40 fields and the row ends in a separator: it was cut"),
    (good_row(c1="68fd\xe91e6"), r"field 15 \(C1\) holds the non-ASCII byte 0xc3"),
]


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("bad_row, reason", BAD_ROWS, ids=[r for _, r in BAD_ROWS])
def test_bad_row_error_names_file_line_and_field(tmp_path, parser, bad_row, reason):
    path = write(tmp_path, "bad.tsv", "\n".join([good_row(), good_row(1), bad_row, good_row()]) + "\n")
    with pytest.raises(ValueError, match=rf"bad\.tsv:3: {reason}.*on_bad_row='skip'"):
        parse_all(path, parser=parser)
    label, dense, sparse, report = parse_all(path, parser=parser, on_bad_row="skip")
    assert (report.num_rows, report.num_skipped_rows) == (3, 1) and report.skipped[0][0] == 3
    assert label.tolist() == [0, 1, 0]


@pytest.mark.parametrize("parser", PARSERS)
def test_non_utf8_byte_skip_mode_keeps_the_rest_of_the_file(tmp_path, parser, caplog):
    """A bad byte never aborts the file in skip mode (pyarrow alone refuses the whole block)."""
    rows = [good_row(i1=str(k)).encode() for k in range(6)]
    rows[2] = rows[2].replace(b"68fd1e64", b"68\xff\xfe1e64")
    rows[4] = b"\xc0" + rows[4]
    path = write(tmp_path, "latin.tsv", b"\n".join(rows) + b"\n")
    with pytest.raises(ValueError, match=r"latin\.tsv:3: field 15 \(C1\) holds the non-ASCII byte 0xff"):
        parse_all(path, parser=parser)
    with caplog.at_level(logging.WARNING):
        label, dense, sparse, report = parse_all(path, parser=parser, on_bad_row="skip")
        report.log_skips()
    assert dense[:, 0].tolist() == [0, 1, 3, 5] and report.num_skipped_rows == 2
    assert [ln for ln, _ in report.skipped] == [3, 5] and "label" in report.skipped[1][1]
    assert "skipped 2 bad rows" in caplog.text


def test_a_non_ascii_byte_and_a_stray_cr_in_one_block_are_named_alike_by_both_parsers(tmp_path):
    """The reference named a non-ASCII row by the byte of a stray carriage return further down the same block
    (0x0d, not 0xe9): its reason read a variable that the stray-CR check had since reassigned."""
    rows = [good_row(i1=str(k)).encode() for k in range(4)]
    rows[1] = rows[1].replace(b"\t1\t", b"\t1\xe9\t", 1)
    rows[2] = rows[2].replace(b"\t2\t", b"\t2\r\t", 1)
    path = write(tmp_path, "both.tsv", b"\n".join(rows) + b"\n")
    reports = {parser: parse_all(path, parser=parser, on_bad_row="skip")[3].skipped for parser in PARSERS}
    assert reports["python"] == reports["native"], reports
    assert [line for line, _ in reports["python"]] == [2, 3] and "byte 0xe9" in reports["python"][0][1]
    assert "carriage return" in reports["python"][1][1]


@pytest.mark.parametrize("parser", PARSERS)
def test_truncated_last_line(tmp_path, parser):
    """A file cut at a tab is refused (or skipped, counted); a file cut mid-value names the value."""
    cut_at_tab = "\t".join(good_row().split("\t")[:25]) + "\t"
    path = write(tmp_path, "cut.tsv", good_row() + "\n" + good_row() + "\n" + cut_at_tab)  # no final newline
    with pytest.raises(ValueError, match=r"cut\.tsv:3: 26 of 40 fields and the row ends in a separator"):
        parse_all(path, parser=parser)
    *_, report = parse_all(path, parser=parser, on_bad_row="skip")
    assert (report.num_rows, report.num_skipped_rows, report.num_padded_rows) == (2, 1, 0)
    mid_value = good_row()[:-3]  # C26 "0000001a" -> "00000"
    path = write(tmp_path, "mid.tsv", good_row() + "\n" + mid_value)
    with pytest.raises(ValueError, match=r"mid\.tsv:2: C26 must be 8 hex characters, got '00000'"):
        parse_all(path, parser=parser)


@pytest.mark.parametrize("parser", PARSERS)
def test_padded_rows_are_counted_and_warned(tmp_path, parser, caplog):
    stripped = "\t".join(good_row().split("\t")[:37])  # trailing empty C24..C26 stripped
    path = write(tmp_path, "p.tsv", f"{good_row()}\r\n{stripped}\r\n\r\n{good_row(1, i1='7.0')}")
    with caplog.at_level(logging.WARNING):
        label, dense, sparse, report = parse_all(path, parser=parser)
        report.log_skips()
    assert (report.num_rows, report.num_padded_rows, report.num_blank_lines) == (3, 1, 1)
    assert sparse[1, 23:].tolist() == [-1, -1, -1] and dense[2, 0] == 7.0 and label.tolist() == [0, 0, 1]
    assert "1 of 3 rows had fewer fields" in caplog.text


@pytest.mark.parametrize("parser", PARSERS)
def test_gzip_named_as_text_is_detected_and_read(tmp_path, parser, caplog):
    text = "".join(good_row(i1=str(k)) + "\n" for k in range(50))
    path = write(tmp_path, "day_0.tsv", gzip.compress(text.encode()))
    with caplog.at_level(logging.WARNING):
        label, dense, *_ = parse_all(path, parser=parser)
    assert dense[:, 0].tolist() == list(range(50))
    assert "gzip-compressed" in caplog.text and "day_0.tsv.gz" in caplog.text


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("header", [False, True])
def test_byte_order_mark_before_the_first_row_is_skipped(tmp_path, parser, header):
    """Excel's "CSV UTF-8" and Windows editors write one; the rows after it are the file's rows."""
    text = (HEADER_FEATURES.replace(",", "\t") + "\n" if header else "")
    text = ("label\t" if header else "") + text + "".join(good_row(label=k % 2, i1=str(k)) + "\n" for k in range(40))
    plain = write(tmp_path, "plain.tsv", text)
    for bommed in (write(tmp_path, "bom.tsv", b"\xef\xbb\xbf" + text.encode()),
                   write(tmp_path, "bom.tsv.gz", gzip.compress(b"\xef\xbb\xbf" + text.encode()))):
        for want, got in zip(parse_all(plain, parser=parser)[:3], parse_all(bommed, parser=parser)[:3]):
            np.testing.assert_array_equal(got, want)
        rows = [b for b in CriteoIterableDataset(bommed, batch_size=16, num_embeddings_per_feature=10)]  # streamed
        assert torch.cat([b.dense_features for b in rows]).shape[0] == 40
    assert torch.equal(torch.cat([b.labels for b in rows]), torch.tensor([k % 2 for k in range(40)], dtype=torch.float))


def test_directory_quoted_csv_and_binary_files_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"is a directory, not a file.*lightning-rec preprocess"):
        build_criteo_cache(tmp_path, tmp_path / "c")
    with pytest.raises(ValueError, match="is a directory"):
        CriteoIterableDataset(tmp_path, batch_size=2, num_embeddings_per_feature=10)
    quoted = '"Id","Label",' + ",".join(f'"{h}"' for h in HEADER_FEATURES.split(",")) + "\n"
    quoted += ",".join(f'"{v}"' for v in ["1"] + good_row(sep=",").split(",")) + "\n"
    path = write(tmp_path, "train.csv", quoted)
    with pytest.raises(ValueError, match=r"train\.csv: its fields are quoted.*sed"):
        parse_all(path)
    path = write(tmp_path, "x.tsv", b"PK\x03\x04\x00\x00binary")
    with pytest.raises(ValueError, match="NUL bytes: it is not a Criteo text file"):
        parse_all(path)


@needs_criteo
def test_unlabelled_file_for_training_is_an_error(tmp_path):
    unlabelled = str(CRITEO / "criteo_kaggle_test_head1999_nolabel.tsv")
    labelled = str(CRITEO / "criteo_kaggle_train_sample.tsv")
    for kwargs in ({"train_path": unlabelled}, {"train_path": labelled, "val_path": unlabelled}):
        dm = CriteoDataModule(cache_dir=str(tmp_path), num_embeddings_per_feature=100, **kwargs)
        with pytest.raises(ValueError, match=r"has no label column.*predict_path"):
            dm.prepare_data()
        with pytest.raises(ValueError, match=r"has no label column"):
            dm.setup("fit")
    dm = CriteoDataModule(test_path=unlabelled, cache_dir=str(tmp_path), num_embeddings_per_feature=100)
    dm.setup("predict")  # unlabelled is fine for predict
    assert torch.isnan(next(iter(dm.predict_dataloader())).labels).all()
    dm.setup("test")
    with pytest.raises(ValueError, match="test_path .* has no label column"):
        dm.test_dataloader()
