"""Criteo rows as tables (Parquet files, a folder of them, a `datasets` save_to_disk folder): the same batches as
the text file they hold, cached or streamed (sharded, resumed), bad rows named by file and row, and what a table
cannot be used for refused."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

from lightning_rec.data import CriteoDataModule

NAMES = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]


def _text_rows(n: int, seed: int = 0) -> str:
    """Criteo text rows with missing counts and ids, negative counts, labels 0/1."""
    g = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        dense = ["" if g.random() < 0.2 else str(int(g.integers(-2, 500))) for _ in range(13)]
        sparse = ["" if g.random() < 0.15 else f"{int(g.integers(0, 2**32)):08x}" for _ in range(26)]
        lines.append("\t".join([str(int(g.integers(0, 2)))] + dense + sparse))
    return "\n".join(lines) + "\n"


def _as_table(text_path: Path) -> pa.Table:
    """What pandas' / Arrow's readers make of the text: integer counts with nulls, hash strings."""
    return pacsv.read_csv(text_path, read_options=pacsv.ReadOptions(column_names=NAMES),
                          parse_options=pacsv.ParseOptions(delimiter="\t"),
                          convert_options=pacsv.ConvertOptions(
                              column_types={f"C{i}": pa.string() for i in range(1, 27)} | {"label": pa.int64()},
                              strings_can_be_null=True))


def _batches(path, cache: Path, **kwargs) -> list:
    path = str(path) if isinstance(path, (str, Path)) else path  # or a datasets object
    dm = CriteoDataModule(train_path=path, batch_size=64, shuffle=False, cache_dir=str(cache),
                          num_embeddings_per_feature=[1000 + 7 * f for f in range(26)], **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return [(b.labels, b.dense_features, b.sparse_features.values(), b.sparse_features.lengths())
            for b in dm.train_dataloader()]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for p, q in zip(a, b) for x, y in zip(p, q))


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("tables") / "train.txt"
    path.write_text(_text_rows(300))
    return path


@pytest.mark.parametrize("missing_categorical", ["reserved_id", "empty_bag"])
@pytest.mark.parametrize("form", ["parquet", "pieces", "hub_split", "saved_dataset", "dataset_object", "int_ids",
                                  "pandas_floats"])
def test_tables_give_the_text_files_batches(text, tmp_path, form, missing_categorical):
    table = _as_table(text)
    reference = _batches(text, tmp_path / "cache", missing_categorical=missing_categorical)
    source = tmp_path / "source"
    if form == "parquet":
        source = source.with_suffix(".parquet")
        pq.write_table(table, source, row_group_size=70)
    elif form == "pieces":  # files are read in name order, whatever order they were written in
        source.mkdir()
        for k in (2, 0, 1):
            pq.write_table(table.slice(100 * k, 100), source / f"part-{k}.parquet")
    elif form == "hub_split":  # the Hub's data/ folder holds every split: a pattern picks one
        source.mkdir()
        for k in (2, 0, 1):
            pq.write_table(table.slice(100 * k, 100), source / f"train-{k:05d}-of-00003.parquet")
        pq.write_table(table.slice(0, 10), source / "test-00000-of-00001.parquet")
        with pytest.raises(ValueError, match=r"holds the \.parquet files of several splits \(test, train\): pass "
                                             r"one split's files as a pattern, e.g. '.*/train-\*\.parquet'"):
            _batches(source, tmp_path / "cache")
        with pytest.raises(ValueError, match="several splits"):  # what the CLI asks before the Trainer starts
            CriteoDataModule(train_path=str(source), num_embeddings_per_feature=100).check_paths("fit")
        source = source / "train-*.parquet"
    elif form == "saved_dataset":
        import datasets

        datasets.Dataset(table).save_to_disk(str(source), max_shard_size="8KB")  # several .arrow files
        assert len(list(source.glob("*.arrow"))) > 1
    elif form == "dataset_object":  # in Python: written once as Parquet, pending index mappings applied
        import datasets

        rows = datasets.Dataset(table.append_column("row", pa.array(range(table.num_rows))))
        source = rows.shuffle(seed=1).sort("row")  # two index mappings: the rows in their order again
        assert source._indices is not None
        got = _batches(source, tmp_path / "cache", missing_categorical=missing_categorical)
        copies = [c for c in (tmp_path / "cache" / "hf_datasets").iterdir() if c.is_dir()]
        assert [c.name for c in copies] == [source._fingerprint] and (copies[0] / "data.parquet").is_file(), copies
        written = (copies[0] / "lightning_rec_complete").stat().st_mtime_ns
        assert _same(got, reference)
        again = rows.shuffle(seed=1).sort("row")  # the same Dataset built again: its copy is found, not rewritten
        assert _same(_batches(again, tmp_path / "cache", missing_categorical=missing_categorical), reference)
        assert (copies[0] / "lightning_rec_complete").stat().st_mtime_ns == written
        assert [c for c in (tmp_path / "cache" / "hf_datasets").iterdir() if c.is_dir()] == copies
    elif form == "int_ids":  # C columns already decoded to integers (null: missing)
        for j in range(26):
            col = table.column(f"C{j + 1}").to_pylist()
            table = table.set_column(14 + j, f"C{j + 1}",
                                     pa.array([None if v is None else int(v, 16) for v in col], pa.int64()))
        source = source.with_suffix(".parquet")
        pq.write_table(table, source)
    else:  # pandas: integer columns with missing values become float64 with NaN, an index column, "Label"
        df = table.to_pandas()
        for j in range(26):
            df[f"C{j + 1}"] = [float(int(v, 16)) if isinstance(v, str) else np.nan for v in df[f"C{j + 1}"]]
        df["label"] = df["label"].astype(bool)
        df = df.rename(columns={"label": "Label"})
        df.insert(0, "Id", np.arange(len(df)) + 10_000_000)
        source = source.with_suffix(".parquet")
        df.to_parquet(source)
    got = _batches(source, tmp_path / "cache", missing_categorical=missing_categorical)
    assert _same(got, reference)


def test_bad_table_rows_name_the_file_and_row_or_are_skipped_and_counted(text, tmp_path):
    table = _as_table(text)
    folder = tmp_path / "pieces"
    folder.mkdir()
    pq.write_table(table.slice(0, 150), folder / "a.parquet")
    labels = table.column("label").to_pylist()
    labels[150 + 5] = 2
    c3 = table.column("C3").to_pylist()
    c3[150 + 9] = "not-hex!"
    bad = table.set_column(0, "label", pa.array(labels, pa.int64())).set_column(16, "C3", pa.array(c3, pa.string()))
    bad = bad.slice(150)
    pq.write_table(bad, folder / "b.parquet")
    with pytest.raises(ValueError, match=r"b\.parquet, row 5: label must be 0 or 1, got 2\. .*on_bad_row='skip'"):
        _batches(folder, tmp_path / "cache")
    dm = CriteoDataModule(train_path=str(folder), batch_size=64, cache_dir=str(tmp_path / "cache"),
                          on_bad_row="skip", num_embeddings_per_feature=1000)
    dm.prepare_data()
    dm.setup("fit")
    report = dm.parse_reports["train"]
    assert (report.num_rows, report.num_skipped_rows) == (298, 2)
    assert [why for _, why in report.skipped] == [
        f"{folder / 'b.parquet'}, row 5: label must be 0 or 1, got 2",
        f"{folder / 'b.parquet'}, row 9: C3 must be 8 hex characters or an integer id in 0..2**63 - 1, got 'not-hex!'"]
    # a row bad in several columns names its first bad field, whichever thread converted which column first
    labels2, c26 = table.column("label").to_pylist(), table.column("C26").to_pylist()
    labels2[7], c26[7], c26[3] = 5, "nothex!!", "zzzzzzzz"
    twice = table.set_column(0, "label", pa.array(labels2)).set_column(39, "C26", pa.array(c26, pa.string()))
    pq.write_table(twice, tmp_path / "twice.parquet")
    for _ in range(3):
        with pytest.raises(ValueError, match=r"twice\.parquet, row 3: C26 must be .*'zzzzzzzz'"):
            _batches(tmp_path / "twice.parquet", tmp_path / "cache")
    pq.write_table(twice.slice(4), tmp_path / "twice.parquet")
    with pytest.raises(ValueError, match=r"twice\.parquet, row 3: label must be 0 or 1, got 5"):
        _batches(tmp_path / "twice.parquet", tmp_path / "cache")
    # integer ids below 0 and float ids that are not whole numbers are bad rows too
    for values, shown in (([-3] + [1] * 299, "-3"), ([0.5] + [1.0] * 299, "0.5"),
                          (pa.array([2**64 - 1] + [1] * 299, pa.uint64()), str(2**64 - 1))):
        f = tmp_path / f"ids_{len(shown)}.parquet"
        pq.write_table(table.set_column(14, "C1", pa.array(values)), f)
        with pytest.raises(ValueError, match=rf"row 0: C1 must be .* id in 0\.\.2\*\*63 - 1, got {shown}"):
            _batches(f, tmp_path / "cache")


@pytest.mark.parametrize("streaming", [False, True])
def test_a_table_of_no_rows_is_refused_streamed_or_not(text, tmp_path, streaming):
    """A 0-row Parquet file streamed trained on no batches, in silence (cached, it was refused)."""
    f = tmp_path / "empty.parquet"
    pq.write_table(_as_table(text).slice(0, 0), f)
    with pytest.raises(ValueError, match=r"empty\.parquet has no data rows: expected Criteo rows"):
        _batches(f, tmp_path / "cache", streaming=streaming)


def test_what_a_table_cannot_be_is_said(text, tmp_path):
    table = _as_table(text)
    f = tmp_path / "t.parquet"
    pq.write_table(table.drop_columns(["I7", "C20"]), f)
    with pytest.raises(ValueError, match=r"t\.parquet: the table has no column for \['I7', 'C20'\].*rename"):
        _batches(f, tmp_path / "cache")
    from lightning_rec.data import preprocess_criteo

    with pytest.raises(ValueError, match=r"t\.parquet: the table has no column for \['I7', 'C20'\]"):
        preprocess_criteo([str(f)], str(tmp_path / "shards"), num_embeddings=100)  # preprocess reads tables too
    pq.write_table(table, f)
    unlabelled = tmp_path / "test.parquet"
    pq.write_table(table.drop_columns(["label"]), unlabelled)
    with pytest.raises(ValueError, match=r"train_path .*test\.parquet has no label column"):
        _batches(unlabelled, tmp_path / "cache")
    listed = tmp_path / "listed.parquet"
    pq.write_table(table.set_column(1, "I1", pa.array([[1]] * table.num_rows)), listed)
    with pytest.raises(ValueError, match=r"column 'I1' \(I1\) is of type list<.*: int64>: must be a number.*cast"):
        _batches(listed, tmp_path / "cache")
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset(table)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match=r"holds the splits \['train'\].*pass one split's folder.*dict/train"):
        _batches(tmp_path / "dict", tmp_path / "cache")
    # the same as objects, in Python (they were "expected str, bytes or os.PathLike object, not DatasetDict")
    with pytest.raises(ValueError, match=r"train_path is a DatasetDict of the splits \['train'\]: pass one split, "
                                         r"e\.g\. ds\['train'\]"):
        _batches(datasets.DatasetDict({"train": datasets.Dataset(table)}), tmp_path / "cache")
    with pytest.raises(ValueError, match=r"train_path is an IterableDataset .*pass its files instead.*streaming=True"):
        _batches(datasets.Dataset(table).to_iterable_dataset(), tmp_path / "cache")
    # a table rewritten in place is read again (the cache key holds each file's size and time)
    before = _batches(f, tmp_path / "cache")
    pq.write_table(table.slice(0, 100), f)
    os.utime(f, ns=(1, 1))
    assert len(_batches(f, tmp_path / "cache")) == 2 and len(before) == 5


def test_a_dataset_objects_copy_is_written_once_and_whole(text, tmp_path, monkeypatch):
    """Ranks that build the same Dataset (Lightning's launcher runs the script once per rank) write one copy: the
    others wait for it. A write cut short leaves nothing that is read, and the next call writes the copy whole."""
    import threading
    import time

    import datasets

    from lightning_rec.data import hf_dataset

    ds = datasets.Dataset(_as_table(text))
    real, calls = hf_dataset.write_parquet, []

    def slow(value, path, **kwargs):
        calls.append(path)
        time.sleep(0.3)  # the other "ranks" arrive while this one writes
        return real(value, path, **kwargs)

    def copy_of(value) -> str:
        return hf_dataset.dataset_path(value, "train_path", tmp_path, "data.parquet")

    monkeypatch.setattr(hf_dataset, "write_parquet", slow)
    got: list[str] = []
    ranks = [threading.Thread(target=lambda: got.append(copy_of(ds))) for _ in range(3)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    assert len(calls) == 1 and len(got) == 3 and len(set(got)) == 1
    assert pq.read_table(Path(got[0]) / "data.parquet").equals(ds.data.table)

    def killed(value, path, **kwargs):
        real(value, path, **kwargs)
        raise KeyboardInterrupt  # after the data, before the copy is marked whole and moved into place

    part = ds.shuffle(seed=2).select(range(10))
    final = tmp_path / "hf_datasets" / part._fingerprint
    monkeypatch.setattr(hf_dataset, "write_parquet", killed)
    with pytest.raises(KeyboardInterrupt):
        copy_of(part)
    assert not final.exists() and not list((tmp_path / "hf_datasets").glob(".*"))  # nothing half-written is left
    final.mkdir()  # a folder without the mark (an older interrupted copy) is not read: it is replaced
    (final / "junk").write_text("x")
    # a copy being written when its run was killed (SIGKILL runs no finally): hidden, as large as the Dataset, and
    # kept for ever; the next writer of that Dataset (holding the lock a live writer would hold) removes it
    aside = tmp_path / "hf_datasets" / f".{part._fingerprint}-killed"
    aside.mkdir()
    (aside / "data.parquet").write_text("x")
    other = tmp_path / "hf_datasets" / ".0123456789abcdef-other"  # another Dataset's: its own writer's business
    other.mkdir()
    monkeypatch.setattr(hf_dataset, "write_parquet", real)
    assert copy_of(part) == str(final) and not (final / "junk").exists()
    assert not aside.exists() and other.exists()
    assert pq.read_table(final / "data.parquet").to_pylist() == part.to_list()  # shuffled, then its first 10


def _streamed(path, *, num_workers: int = 0, shuffle: bool = False, **kwargs):
    from lightning_rec.data.batch import make_stream_loader
    from lightning_rec.data.criteo import CriteoIterableDataset

    data = CriteoIterableDataset(str(path), batch_size=32, num_embeddings_per_feature=1000, shuffle=shuffle, seed=3,
                                 block_bytes=64 * 256, **kwargs)  # blocks of 64 rows (of text: 16 KiB)
    return make_stream_loader(data, num_workers=num_workers)


def _rows(batches) -> list[tuple]:
    """Each row's label, counts and ids, whatever batch it came in."""
    out = []
    for b in batches:
        ids_FB = b.sparse_features.values().view(26, len(b))
        out += [(float(b.labels[i]), *b.dense_features[i].tolist(), *ids_FB[:, i].tolist()) for i in range(len(b))]
    return out


@pytest.mark.parametrize("form", ["pieces", "saved_dataset"])
def test_tables_stream_like_their_text_shared_and_resumed(text, tmp_path, form):
    """streaming=True was refused for tables ("reads text files"): now a table streams in blocks of rows, read by
    index (Parquet row groups, or slices of a save_to_disk folder), with the text stream's sharing and resume."""
    import io

    import datasets

    table = _as_table(text)
    source = tmp_path / "source"
    if form == "pieces":  # row groups of 50 rows in files of 120: blocks of 64 rows cross both
        source.mkdir()
        for k, lo in enumerate(range(0, 300, 120)):
            pq.write_table(table.slice(lo, 120), source / f"part-{k}.parquet", row_group_size=50)
    else:
        datasets.Dataset(table).save_to_disk(str(source), max_shard_size="8KB")
    batches = lambda b: [(x.labels, x.dense_features, x.sparse_features.values()) for x in b]  # noqa: E731
    plain = batches(_streamed(text))
    assert _same(batches(_streamed(source)), plain)  # in order, unshuffled: the text stream's batches
    # two readers (workers; ranks share the same way): every row once
    both = _rows(_streamed(source, num_workers=2, shuffle=True))
    assert sorted(both) == sorted(_rows(_streamed(text)))
    # a pass stopped after 4 batches resumes at its block, from a state saved as a checkpoint holds it
    whole = batches(_streamed(source, shuffle=True))
    first = _streamed(source, shuffle=True)
    it = iter(first)
    for _ in range(4):
        next(it)
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)
    again = _streamed(source, shuffle=True)
    again.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    assert _same(batches(again), whole[4:])
    # a worker is handed the source, not its rows (a pickled Arrow table would carry them all)
    import pickle

    assert len(pickle.dumps(_streamed(source).dataset)) < 4000
    # the data module streams it too
    dm = CriteoDataModule(train_path=str(source), streaming=True, batch_size=64, num_embeddings_per_feature=100)
    dm.setup("fit")
    assert sum(len(b) for b in dm.train_dataloader()) == 300


def test_a_bad_row_in_a_streamed_table_is_named_or_skipped(text, tmp_path):
    table = _as_table(text)
    labels = table.column("label").to_pylist()
    labels[200] = 7
    f = tmp_path / "bad.parquet"
    pq.write_table(table.set_column(0, "label", pa.array(labels)), f, row_group_size=100)
    with pytest.raises(ValueError, match=r"bad\.parquet, row 200: label must be 0 or 1, got 7"):
        list(_streamed(f))
    loader = _streamed(f, on_bad_row="skip")
    assert len(_rows(loader)) == 299 and loader.dataset.report.num_skipped_rows == 1


@pytest.mark.parametrize("streaming", [False, True])
def test_a_column_missing_in_every_row_reads_as_missing_values(tmp_path, streaming):
    """A column of None only (Arrow's null type: datasets.Dataset.from_dict / from_pandas of a sample where I12 or
    C22, Criteo's most-missing columns, is never set) was refused: "column 'I12' is of type null: must be a number";
    its text file, all empty fields there, read fine. Now it is missing in every row, as the text's empty fields."""
    import datasets

    lines = [[str(k % 2), str(k)] + [""] * 12 + [f"{k:08x}"] + [""] * 25 for k in range(20)]
    path = tmp_path / "rows.tsv"
    path.write_text("".join("\t".join(line) + "\n" for line in lines))
    ds = datasets.Dataset.from_dict({"label": [int(line[0]) for line in lines], "I1": [int(line[1]) for line in lines],
                                     **{f"I{j}": [None] * 20 for j in range(2, 14)},
                                     "C1": [line[14] for line in lines],
                                     **{f"C{j}": [None] * 20 for j in range(2, 27)}})
    assert pa.types.is_null(ds.data.table.schema.field("I12").type)
    assert _same(_batches(path, tmp_path / "c", streaming=streaming), _batches(ds, tmp_path / "c", streaming=streaming))


def test_a_nan_count_in_a_float_column_is_missing_as_a_null_is(text, tmp_path):
    """I columns as numpy floats (Dataset.from_dict of arrays, Polars): NaN is their missing value, as it is the
    cache's, but it was a bad row ("I1 must be a number, got nan"), and on_bad_row='skip', which the error offered,
    dropped every row with a missing count. Now it reads as the text's empty field; an infinite count is still bad."""
    import datasets

    table = _as_table(text)
    floats = {name: (table.column(name).cast(pa.float64()).to_numpy(zero_copy_only=False)
                     if name.startswith("I") else table.column(name).to_pylist()) for name in table.column_names}
    assert np.isnan(floats["I1"]).any()
    ds = datasets.Dataset.from_dict(floats)
    assert not ds.data.table.column("I1").null_count  # NaN values, not nulls
    assert _same(_batches(text, tmp_path / "c"), _batches(ds, tmp_path / "c"))
    floats["I2"] = np.where(np.arange(len(floats["I2"])) == 4, np.inf, floats["I2"])
    with pytest.raises(ValueError, match=r"row 4: I2 must be a number.*got inf"):
        _batches(datasets.Dataset.from_dict(floats), tmp_path / "c")


def test_a_headerless_criteo_file_read_as_headed_says_its_first_row_became_the_names(text, tmp_path):
    """load_dataset("csv", data_files="train.txt", sep="\\t") takes the first row as column names ('0', '1', '1.1',
    'Unnamed: 12', '68fd1e64', ...): the error said to rename the columns, which then dropped that row in silence. It
    now says the names are a row, and to pass the file itself or read it with column names."""
    import datasets

    ds = datasets.load_dataset("csv", data_files=str(text), sep="\t", split="train", cache_dir=str(tmp_path / "hf"))
    with pytest.raises(ValueError, match=r"are a Criteo row: the file had no header line.*Pass the file itself"):
        _batches(ds, tmp_path / "c")
    with pytest.raises(ValueError, match=r"no column for \['I1'.*rename its columns"):  # other names: as before
        _batches(ds.rename_columns({name: f"x{k}" for k, name in enumerate(ds.column_names)}), tmp_path / "c")


def test_count_columns_of_strings_read_an_empty_string_as_missing_as_the_text_does(text, tmp_path):
    """Every column as strings (load_dataset("csv") with string features, pandas' dtype=str, keep_default_na=False):
    an empty I field was a bad row ("I1 must be a number, got ''"), though the text's empty field is missing and a C
    column's "" was already; on_bad_row='skip' then dropped every row with a missing count. Now "" is missing."""
    import datasets

    lines = [line.split("\t") for line in text.read_text().splitlines()]
    assert any(line[1] == "" for line in lines)
    ds = datasets.Dataset.from_dict({name: [line[k] for line in lines] for k, name in enumerate(NAMES)})
    assert _same(_batches(text, tmp_path / "c"), _batches(ds, tmp_path / "c"))
