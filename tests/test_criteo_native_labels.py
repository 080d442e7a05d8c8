"""Several label columns (`label_columns`) through the native op: the same labels bit for bit, the same features,
reports and error messages as the Python reference parser, on real Criteo rows (skipped without ../shared/data) and on
written rows with missing, real-valued and bad labels."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA

from lightning_rec.data.criteo_parse import CriteoReadOptions, native_parser_available, read_criteo

CRITEO = SHARED_DATA / "criteo"
needs_criteo = pytest.mark.skipif(not CRITEO.is_dir(), reason="shared Criteo samples not present")
pytestmark = pytest.mark.skipif(not native_parser_available(), reason="lightning_rec._C is not built")
# real-valued labels as a user's file may spell them; the empty ones are missing labels
WATCH = ["2.5", "", "0", "-0", "1e-3", "0.1", "+.5", "7", "123456789012345678901", "0.30000000000000004", "1E2", "3."]
TASKS = [["click", "purchase", "watch"],  # the columns as they are
         ({"click": "click", "bought": "purchase == 1", "long": "watch > 0.1"}, {"long": "purchase"})]  # derived


def read(path, parser: str, tasks=TASKS[0], **kwargs):
    """(labels [N, T] float32, dense raw [N, 13], sparse raw [N, 26], report) of a whole file."""
    columns, masks = tasks if isinstance(tasks, tuple) else (tasks, None)
    blocks = list(read_criteo(path, parser=parser, label_columns=columns, label_masks=masks, **kwargs))
    flat = [np.concatenate([t.column(c).combine_chunks().flatten().to_numpy() for t, _ in blocks])
            for c in ("label", "dense", "sparse")]
    return flat[0].reshape(-1, len(columns)), flat[1].reshape(-1, 13), flat[2].reshape(-1, 26), blocks[-1][1]


def assert_same(ref, nat) -> None:
    """Labels and dense values bit for bit (NaN and -0.0 included), ids and reports equal."""
    np.testing.assert_array_equal(ref[0].view(np.uint32), nat[0].view(np.uint32))
    np.testing.assert_array_equal(ref[1].view(np.uint32), nat[1].view(np.uint32))
    np.testing.assert_array_equal(ref[2], nat[2])
    r, n = ref[3], nat[3]
    assert (r.num_rows, r.num_padded_rows, r.num_skipped_rows, r.num_blank_lines, r.skipped) == \
           (n.num_rows, n.num_padded_rows, n.num_skipped_rows, n.num_blank_lines, n.skipped)


def with_labels(lines: list[str], sep: str, seed: int) -> list[str]:
    """Each row's click label, then a purchase label (empty on ~30% of rows) and a real-valued watch label."""
    g = np.random.default_rng(seed)
    purchase = np.where(g.random(len(lines)) < 0.3, np.nan, (g.random(len(lines)) < 0.5).astype(float))
    watch = g.choice(WATCH, len(lines))
    return [sep.join([ln.split(sep, 1)[0], "" if math.isnan(p) else str(int(p)), w, ln.split(sep, 1)[1]])
            for ln, p, w in zip(lines, purchase, watch)]


@needs_criteo
@pytest.mark.parametrize("tasks", TASKS, ids=["columns", "derived"])
@pytest.mark.parametrize("name", ["criteo_kaggle_train_sample.tsv", "kaggle_csv_original/train.tiny.csv"])
def test_real_rows_give_the_same_labels_as_the_reference(tmp_path, name, tasks):
    text = (CRITEO / name).read_text().splitlines()
    if name.endswith(".csv"):  # a header: the label columns named in it, after Id
        header, rows = text[0].split(","), [ln.split(",", 1)[1] for ln in text[1:]]
        lines = [",".join(["Id", "click", "purchase", "watch", *header[2:]])]
        lines += [f"{k},{ln}" for k, ln in enumerate(with_labels(rows, ",", 1))]
    else:
        lines = with_labels(text, "\t", 0)
    path = tmp_path / ("x.csv" if name.endswith(".csv") else "x.tsv")
    path.write_text("\n".join(lines) + "\n")
    ref = read(path, "python", tasks)
    assert ref[3].num_rows == len(text) - name.endswith(".csv") and np.isnan(ref[0]).any()
    assert np.isin(ref[0][:, 0], (0, 1)).all() and (ref[0][:, 0] == 1).any()
    for block_bytes in (64 << 20, 100_000, 150):  # one block, many, lines longer than the read buffer
        assert_same(ref, read(path, "native", tasks, block_bytes=block_bytes))
    one = read_criteo(CRITEO / name, parser="native")  # the click column as the one-label read gives it
    click = np.concatenate([t.column("label").to_numpy() for t, _ in one])
    if isinstance(tasks, list):
        np.testing.assert_array_equal(ref[0][:, 0], click)


def features(i1: str = "1", i2: str = "2", c1: str = "68fd1e64") -> str:
    return "\t".join([i1, i2, *map(str, range(3, 14)), c1, *(f"{k:08x}" for k in range(2, 27))])


def row(labels: str, **kwargs) -> str:
    return labels + "\t" + features(**kwargs)


# (a row, the reason it is refused); each row is preceded and followed by good ones
BAD_ROWS = [
    (row("0\tyes\t1"), "label column 'purchase' must be a number, got 'yes'"),
    (row("0\t1\tnan"), "label column 'watch' must be a number, got 'nan'"),  # NaN is an empty field, not "nan"
    (row("0\t1\t-inf"), "label column 'watch' must be a number, got '-inf'"),
    (row("0\t1\t1x"), "label column 'watch' must be a number, got '1x'"),
    (row("0\t1\t 1"), "label column 'watch' must be a number, got ' 1'"),
    (row("0\t1\t1e"), "label column 'watch' must be a number, got '1e'"),
    (row("0\tyes\t1", i1="abc"), "label column 'purchase' must be a number"),  # the first bad field
    (row("0\t1\t2", c1="xyz"), "C1 must be 8 hex characters, got 'xyz'"),
    (row("0\t1\t2\r"), r"field 3 \(label 'watch'\) holds a carriage return"),
    (row("0\t1\t2\xe9"), r"field 3 \(label 'watch'\) holds the non-ASCII byte 0xc3"),
    (row("0\t1\t2") + "\t5", "43 fields, but this file's rows have 42"),
    ("0\t1\t", r"3 of 42 fields and the row ends in a separator"),
]


@pytest.mark.parametrize("tasks", TASKS, ids=["columns", "derived"])
@pytest.mark.parametrize("bad, reason", BAD_ROWS, ids=[r[:40] for _, r in BAD_ROWS])
def test_bad_label_fields_are_named_alike_by_both_parsers(tmp_path, tasks, bad, reason):
    path = tmp_path / "bad.tsv"
    path.write_bytes(("\n".join([row("1\t\t0.5"), row("0\t1\t"), bad, row("1\t0\t3")]) + "\n").encode())
    errors = {}
    for parser in ("python", "native"):
        with pytest.raises(ValueError) as e:
            read(path, parser, tasks)
        errors[parser] = str(e.value)
    assert errors["python"] == errors["native"]
    assert re.match(rf"\S*bad\.tsv:3: {reason}", errors["python"]), errors["python"]
    ref, nat = (read(path, parser, tasks, on_bad_row="skip") for parser in ("python", "native"))
    assert_same(ref, nat)
    assert (ref[3].num_rows, ref[3].num_skipped_rows) == (3, 1) and ref[3].skipped[0][0] == 3


def test_missing_real_valued_and_padded_labels_and_a_mask_that_is_a_feature(tmp_path):
    """Label columns after the features (a header names them): a row stripped of trailing empty fields has no label
    for them (NaN, padded), never 0. A mask column that is also a feature (I2) is read as both; a bad value there is
    named as the label column in both parsers and both on_bad_row modes."""
    header = "\t".join(["I1", *(f"I{k}" for k in range(2, 14)), *(f"C{k}" for k in range(1, 27)), "click", "watch"])
    body = [features() + "\t1\t0.25", features() + "\t0", features(i2="0") + "\t\t-4.5",
            features() + "\t1\t1e30", features(i2="") + "\t0\t"]
    path = tmp_path / "end.tsv"
    path.write_text(header + "\n" + "\n".join(body) + "\n")
    tasks = ({"click": "click", "watch": "watch", "heavy": "watch >= 0.25"}, {"watch": "I2"})
    ref, nat = read(path, "python", tasks), read(path, "native", tasks)
    assert_same(ref, nat)
    nan = float("nan")
    expected = [[1, 0.25, 1], [0, nan, nan], [nan, nan, 0], [1, 1e30, 1], [0, nan, nan]]  # I2 0 or empty: masked
    np.testing.assert_array_equal(ref[0], np.array(expected, dtype=np.float32))
    assert ref[3].num_padded_rows == 1
    bad = tmp_path / "bad_mask.tsv"
    bad.write_text(header + "\n" + features() + "\t1\t1\n" + features(i2="x") + "\t1\t1\n")
    for on_bad_row in ("error", "skip"):
        reasons = []
        for parser in ("python", "native"):
            if on_bad_row == "error":
                with pytest.raises(ValueError, match=r"bad_mask\.tsv:3: label column 'I2' must be a number, got 'x'"):
                    read(bad, parser, tasks)
            else:
                reasons.append(read(bad, parser, tasks, on_bad_row="skip")[3].skipped)
    assert reasons[0] == reasons[1] == [(3, "label column 'I2' must be a number, got 'x'")]


def test_auto_reads_several_labels_with_the_native_op_and_the_op_checks_its_arguments():
    assert CriteoReadOptions(label_columns=["click", "purchase"]).parser == "native"
    assert CriteoReadOptions(label_columns=["click", "purchase"], parser="python").parser == "python"
    text = "".join(row(f"{k % 2}\t{k}\t{k / 4}") + "\n" for k in range(5)).encode()
    buf = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    args = (buf, 9, 42, -1, list(range(3, 16)), list(range(16, 42)), [], 0, False)
    torch.library.opcheck(torch.ops.lightning_rec.parse_criteo.default, (*args, [0, 1, 2]))
    label, *_ = torch.ops.lightning_rec.parse_criteo(*args, [2, 0])
    assert label.dtype == torch.float64 and label.tolist() == [[k / 4, k % 2] for k in range(5)]
    with pytest.raises(RuntimeError, match="label_field or label_columns, not both"):
        torch.ops.lightning_rec.parse_criteo(buf, 9, 42, 0, *args[4:], [1, 2])
    with pytest.raises(RuntimeError, match="label column field 3 out of range or used twice"):
        torch.ops.lightning_rec.parse_criteo(*args, [3, 3])
