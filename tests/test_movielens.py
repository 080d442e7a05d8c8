"""MovieLensDataModule: GroupLens layouts, splits (RecBole RO / TO 8:1:1, leave-one-out, official ml-100k),
implicit feedback, whole batches, full-ranking users, and bad input. Real ml-100k is read from ../shared/data
(skips without it)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import SHARED_DATA

from lightning_rec.data import MovieLensDataModule, RankingBatch, RetrievalBatch, passthrough_collate, read_ratings
from lightning_rec.data.movielens import EvalShardSampler, loo_split, ro_split, to_split
from lightning_rec.metrics import RankingMetrics

ML100K = SHARED_DATA / "movielens" / "ml-100k"
needs_ml100k = pytest.mark.skipif(not (ML100K / "u.data").is_file(), reason="shared ml-100k not present")


@pytest.fixture(scope="module")
def ro():
    if not (ML100K / "u.data").is_file():
        pytest.skip("shared ml-100k not present")
    dm = MovieLensDataModule(str(ML100K), batch_size=512, eval_batch_size=128)
    dm.setup()
    return dm


def _pairs(dataset):
    return set(zip(dataset.user_N.tolist(), dataset.item_N.tolist()))


def _csr_rows(dataset, which):
    offsets, items = getattr(dataset, which)
    return {u: set(items[offsets[u]:offsets[u + 1]].tolist()) for u in range(offsets.numel() - 1)}


@needs_ml100k
def test_ro_811_split_follows_recboles_counts_per_user(ro):
    r = ro.report
    assert (r.layout, r.num_users, r.num_items, r.num_interactions) == ("ml-100k", 943, 1682, 100_000)
    users = torch.from_numpy(ro.ratings.with_format("numpy")[:]["user"])  # the HF datasets.Dataset
    per_user = torch.bincount(users, minlength=943)
    parts = torch.stack([torch.bincount(users[ro.part_N == p], minlength=943) for p in range(3)], 1)
    # RecBole: int(0.1 n) for validation and for test, the rest trains (every ml-100k user has >= 20)
    assert torch.equal(parts[:, 1], (per_user * 0.1).floor().long())
    assert torch.equal(parts[:, 2], (per_user * 0.1).floor().long())
    assert torch.equal(parts.sum(1), per_user)
    assert r.split_sizes == {"train": 80_808, "val": 9_596, "test": 9_596}
    again = ro_split(users, (0.8, 0.1, 0.1), seed=0)
    other = ro_split(users, (0.8, 0.1, 0.1), seed=1)
    assert torch.equal(again, ro.part_N) and not torch.equal(other, ro.part_N)  # seeded, random order


def _temporal_reference(user_N, time_N, split):
    """A per-user loop: each user's interactions sorted by (time, file position), then RecBole's counts."""
    part = [0] * len(user_N)
    for u in set(user_N):
        mine = sorted((t, n) for n, (v, t) in enumerate(zip(user_N, time_N)) if v == u)
        tot = len(mine)
        if split == "loo":
            held = [1, 2][-min(2, tot - 1):] if tot > 1 else []
        else:
            val = test = int(0.1 * tot)
            if tot - val - test > 1 and 0 < 0.1 * tot < 1:  # RecBole: an empty part takes one from training
                test += 1
                if tot - val - test > 1:
                    val += 1
            held = [1] * val + [2] * test
        for (_, n), p in zip(mine[tot - len(held):], held):
            part[n] = p
    return part


@pytest.mark.parametrize("split", ["to_811", "loo"])
def test_temporal_splits_hold_out_each_users_newest_interactions(split):
    g = np.random.default_rng(1)
    user_N = g.integers(0, 40, size=600)  # users with 1 to ~30 interactions; many equal timestamps
    time_N = g.integers(0, 25, size=600)
    fn = (lambda u, t: loo_split(u, t)) if split == "loo" else (lambda u, t: to_split(u, t, (0.8, 0.1, 0.1)))
    got = fn(torch.from_numpy(user_N), torch.from_numpy(time_N))
    assert got.tolist() == _temporal_reference(user_N.tolist(), time_N.tolist(), split)
    assert set(got.tolist()) == {0, 1, 2}


def test_temporal_splits_through_the_data_module(tmp_path):
    """Each user's test item is the newest, validation the one before; a repeat keeps its earliest copy;
    a file without timestamps has no time order to split by, and says so."""
    rows = [(1, 10, 300), (1, 11, 100), (1, 12, 200), (1, 13, 50),  # user 1: 13, 11 train; 12 val; 10 test
            (2, 10, 7), (2, 11, 5),                                  # two: 11 trains, 10 is the test item
            (3, 12, 1),                                              # one: trains only
            (4, 10, 9), (4, 11, 1), (4, 12, 2), (4, 10, 0)]          # 10 again, earlier: now the oldest
    path = _write(tmp_path / "log" / "ratings.csv",
                  "user,item,rating,timestamp\n" + "".join(f"{u},{i},1,{t}\n" for u, i, t in rows))
    dm = MovieLensDataModule(str(path.parent), split="loo", side_features=False)
    with pytest.warns(UserWarning, match="1 repeated"):
        dm.setup()

    def held(split):
        offsets, items = dm.datasets[split].target
        return {int(dm.user_ids[u]): [int(dm.item_ids[i]) for i in items[offsets[u]:offsets[u + 1]]]
                for u in range(dm.num_users)}

    assert held("test") == {1: [10], 2: [10], 3: [], 4: [12]}
    assert held("val") == {1: [12], 2: [], 3: [], 4: [11]}
    assert dm.report.split_sizes == {"train": 5, "val": 2, "test": 3}
    to = MovieLensDataModule(str(path.parent), split="to_811", side_features=False)
    with pytest.warns(UserWarning, match="1 repeated"):
        to.setup()
    assert to.report.split_sizes == {"train": 5, "val": 2, "test": 3}  # RecBole's rounding gives the same here
    untimed = _write(tmp_path / "untimed" / "ratings.csv", "user,item,rating\n1,2,5\n1,3,4\n1,4,5\n")
    with pytest.raises(ValueError, match=r"split='loo' orders .* by time.*no timestamp column.*split='ro_811'"):
        MovieLensDataModule(str(untimed.parent), split="loo").setup()
    MovieLensDataModule(str(untimed.parent), split="ro_811", side_features=False).setup()  # no time needed


def test_a_parquet_log_reads_like_its_csv(tmp_path):
    """Interactions kept as Parquet (a log's usual format) read as ratings.csv does; no rating column is implicit
    feedback; an Arrow timestamp column orders the temporal splits; bad columns are named."""
    import pyarrow.parquet as pq

    g = np.random.default_rng(3)
    rows = sorted({(int(u), int(i)) for u, i in zip(g.integers(1, 30, 400), g.integers(1, 80, 400))})
    time = g.integers(1_600_000_000, 1_600_100_000, len(rows))
    _write(tmp_path / "csv" / "ratings.csv", "userId,movieId,rating,timestamp\n"
           + "".join(f"{u},{i},1,{t}\n" for (u, i), t in zip(rows, time)))
    log = pa.table({"user": [u for u, _ in rows], "item": [i for _, i in rows],
                    "clicked_at": pa.array(time * 1000 + 250, pa.timestamp("ms"))})
    (tmp_path / "pq").mkdir()
    pq.write_table(log.rename_columns(["user", "item", "timestamp"]), tmp_path / "pq" / "ratings.parquet")
    a, b = (MovieLensDataModule(str(tmp_path / d), split="loo", side_features=False) for d in ("csv", "pq"))
    a.setup()
    b.setup()
    assert b.report.layout == "parquet" and b.report.num_interactions == len(rows)
    assert (a.user_ids == b.user_ids).all() and (a.item_ids == b.item_ids).all() and torch.equal(a.part_N, b.part_N)
    # data_dir may name the log itself: a file, or a pattern of a Hub dataset's pieces (read in name order)
    hub = tmp_path / "hub" / "data"
    hub.mkdir(parents=True)
    named = log.rename_columns(["user_id", "movie_id", "timestamp"])
    pq.write_table(named.slice(0, 150), hub / "train-00000-of-00002.parquet")
    pq.write_table(named.slice(150), hub / "train-00001-of-00002.parquet")
    for data_dir in (tmp_path / "pq" / "ratings.parquet", hub / "train-*.parquet"):
        c = MovieLensDataModule(str(data_dir), split="loo", side_features=False)
        c.setup()
        assert torch.equal(c.part_N, a.part_N) and (c.item_ids == a.item_ids).all(), data_dir
    for name, table, match in (
            ("no_time", log.drop_columns(["clicked_at"]), r"split='loo' orders .*no timestamp column"),
            ("list_ids", log.set_column(1, "item", pa.array([[i] for _, i in rows])), r"'item' is list.*: ids must"),
            ("null_item", log.set_column(1, "item", pa.array([None] + [i for _, i in rows[1:]], pa.int64())),
             r"row 0: item is null"),
            ("no_item", log.drop_columns(["item"]), r"no column for \['item_id'\].*name the columns")):
        (tmp_path / name).mkdir()
        pq.write_table(table, tmp_path / name / "ratings.parquet")
        with pytest.raises(ValueError, match=match):
            MovieLensDataModule(str(tmp_path / name), split="loo", side_features=False).setup()


def test_an_empty_field_is_a_missing_value_named_by_its_line(tmp_path):
    """An empty user field made every user id a float (1.0, 2.0, and a user NaN) and an empty rating was kept as an
    interaction rated NaN, both without a word; an empty id among string ids was the id "". Now each is refused,
    naming its line (blank lines counted, as an editor counts them) or its Parquet row."""
    import pyarrow.parquet as pq

    for name, text, match in (
            ("user", "user,item,rating,timestamp\n1,10,5,1\n,11,4,2\n2,12,5,3\n", r"ratings\.csv:3: no user id"),
            ("rating", "user,item,rating,timestamp\n1,10,5,1\n2,11,,2\n", r"ratings\.csv:3: no rating"),
            ("time", "user,item,rating,timestamp\n1,10,5,1\n2,11,4,\n", r"ratings\.csv:3: no timestamp"),
            ("blank_line", "1,10,5,1\n\n2,,4,2\n", r"ratings\.csv:3: no item id"),
            ("string_ids", "user,item,rating\nA1,B1,5\n  ,B2,4\n", r"ratings\.csv:3: no user id")):
        _write(tmp_path / name / "ratings.csv", text)
        with pytest.raises(ValueError, match=match):
            MovieLensDataModule(str(tmp_path / name), side_features=False).setup()
    (tmp_path / "pq").mkdir()
    log = pa.table({"user": ["A1", "", "A2"], "item": ["B1", "B2", "B3"]})
    pq.write_table(log, tmp_path / "pq" / "ratings.parquet")
    with pytest.raises(ValueError, match=r"row 1: user is empty"):
        MovieLensDataModule(str(tmp_path / "pq"), side_features=False).setup()
    # a NaN rating (not a null) was an interaction rated NaN, and min_rating dropped it without a word
    log = pa.table({"user": [1, 1, 2], "item": [1, 2, 1], "rating": pa.array([5.0, float("nan"), 4.0])})
    pq.write_table(log, tmp_path / "pq" / "ratings.parquet")
    for min_rating in (None, 4):
        with pytest.raises(ValueError, match=r"row 1: rating is NaN"):
            MovieLensDataModule(str(tmp_path / "pq"), side_features=False, min_rating=min_rating).setup()


def test_uint64_hashed_ids_above_int64_are_kept_as_the_datas_own_ids(tmp_path):
    """A Parquet log keyed by 64-bit hashes (uint64 >= 2**63) stopped with Arrow's "Integer value ... not in range";
    such a column is now read as string ids (exact), and one that fits int64 stays integers."""
    import pyarrow.parquet as pq

    big = np.array([2**63 + 5, 2**64 - 1, 2**63 + 5, 2**64 - 1, 7], np.uint64)
    log = pa.table({"user": pa.array(big), "item": pa.array(np.array([1, 2, 3, 1, 2], np.uint64))})
    (tmp_path / "pq").mkdir()
    pq.write_table(log, tmp_path / "pq" / "ratings.parquet")
    dm = MovieLensDataModule(str(tmp_path / "pq"), side_features=False)
    dm.setup()
    assert sorted(dm.user_ids.tolist()) == sorted(["7", str(2**63 + 5), str(2**64 - 1)])
    assert dm.item_ids.dtype == np.int64 and dm.item_ids.tolist() == [1, 2, 3]


def test_min_rating_on_an_implicit_feedback_log_says_there_is_no_rating(tmp_path):
    """min_rating=4 on a Parquet log without a rating column (every interaction 1.0) said only "no interactions left
    ... lower it"; at or below 1.0 it kept everything without a word either way."""
    import pyarrow.parquet as pq

    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"user": [1, 1, 2, 2], "item": [1, 2, 1, 3], "timestamp": [1, 2, 3, 4]}),
                   tmp_path / "pq" / "ratings.parquet")
    for min_rating in (4, 1):
        with pytest.raises(ValueError, match=rf"min_rating={min_rating}: .* has no rating column .*leave min_rating"):
            MovieLensDataModule(str(tmp_path / "pq"), side_features=False, min_rating=min_rating).setup()
    dm = MovieLensDataModule(str(tmp_path / "pq"), side_features=False, split="loo")  # the mark keeps the time
    dm.setup()
    assert dm.report.num_interactions == 4


def _string_id_log(n_users: int = 40, n_items: int = 60, seed: int = 5) -> list[tuple[str, str, int]]:
    """A log named the way shops name things: user ids like "A3SG..." and items that are ASINs or ISBN-like digits."""
    g = np.random.default_rng(seed)
    users = [f"A{k:05X}Q" for k in g.choice(2**20, n_users, replace=False)]
    items = [f"B0{k:08d}" if k % 3 else f"{k:010d}" for k in g.choice(10**8, n_items, replace=False)]
    pairs = sorted({(users[u], items[i]) for u, i in zip(g.integers(0, n_users, 900), g.integers(0, n_items, 900))})
    return [(u, i, int(t)) for (u, i), t in zip(pairs, g.integers(1_600_000_000, 1_600_900_000, len(pairs)))]


def test_string_ids_are_kept_as_the_datas_own_ids(tmp_path):
    """A log keyed by strings was refused ("cannot parse the ratings": integer ids only); now ids are read as text
    and kept as integers only when every one is. ISBN-like digits beside ASINs stay strings, with a word."""
    import pyarrow.parquet as pq

    log = _string_id_log()
    _write(tmp_path / "csv" / "ratings.csv", "user,item,rating,timestamp\n"
           + "".join(f"{u},{i},1,{t}\n" for u, i, t in log))
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"user": [u for u, _, _ in log], "item": [i for _, i, _ in log],
                             "timestamp": [t for _, _, t in log]}), tmp_path / "pq" / "ratings.parquet")
    a = MovieLensDataModule(str(tmp_path / "csv"), split="loo", side_features=False)
    with pytest.warns(UserWarning, match=r"\d+ of \d+ item ids are not integers \(the first, 'B0\d+', on line \d+\)"):
        a.setup()
    b = MovieLensDataModule(str(tmp_path / "pq"), split="loo", side_features=False)
    b.setup()
    assert a.user_ids.dtype.kind == a.item_ids.dtype.kind == "U"
    assert a.user_ids.tolist() == sorted({u for u, _, _ in log})
    assert a.item_ids.tolist() == sorted({i for _, i, _ in log})
    assert (a.user_ids == b.user_ids).all() and (a.item_ids == b.item_ids).all() and torch.equal(a.part_N, b.part_N)
    assert a.item_titles == a.item_ids.tolist()  # no title file: the id names the item
    # every test item is its user's newest interaction, found through the string ids
    newest = {}
    for u, i, t in log:
        newest[u] = max(newest.get(u, (0, "")), (t, i))
    offsets, items = a.datasets["test"].target
    got = {a.user_ids[u]: a.item_ids[items[offsets[u]]] for u in range(a.num_users) if offsets[u + 1] > offsets[u]}
    assert got == {u: i for u, (t, i) in newest.items() if sum(v == u for v, _, _ in log) > 1}
    # integers in a headed file stay integers; a damaged row among them is a string id, said with its line
    _write(tmp_path / "ints" / "ratings.csv", "user,item,rating\n1,10,5\n2,11,4\n2,12,5\n")
    ints = MovieLensDataModule(str(tmp_path / "ints"), side_features=False)
    ints.setup()
    assert ints.user_ids.dtype == np.int64 and ints.item_ids.tolist() == [10, 11, 12]
    _write(tmp_path / "damaged" / "ratings.csv", "user,item,rating\n1,10,5\n2,1l,4\n2,12,5\n")
    with pytest.warns(UserWarning, match=r"1 of 3 item ids are not integers \(the first, '1l', on line 3\).*fix them"):
        MovieLensDataModule(str(tmp_path / "damaged"), side_features=False).setup()


def test_a_log_with_its_own_column_names_says_which_is_which(tmp_path):
    """A shop's review log ("user_id,parent_asin,rating,timestamp,helpful_vote") was refused ("the header has no
    column for ['item_id']"), with no way to name the item column: `columns=` names it, for CSV and Parquet."""
    import pyarrow.parquet as pq

    log = _string_id_log()
    _write(tmp_path / "csv" / "ratings.csv", "user_id,parent_asin,rating,timestamp,helpful_vote\n"
           + "".join(f"{u},{i},5,{t},0\n" for u, i, t in log))
    with pytest.raises(ValueError, match=r"no column for \['item_id'\].*columns=\{'user': \.\.\., 'item'"):
        MovieLensDataModule(str(tmp_path / "csv"), side_features=False).setup()
    a = MovieLensDataModule(str(tmp_path / "csv"), split="loo", side_features=False, columns={"item": "parent_asin"})
    with pytest.warns(UserWarning, match="ids are not integers"):
        a.setup()
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"reviewer": [u for u, _, _ in log], "user": [0] * len(log),  # "user": not the user
                             "asin": [i for _, i, _ in log], "stars": [5.0] * len(log),
                             "time": [t for _, _, t in log]}), tmp_path / "pq" / "ratings.parquet")
    b = MovieLensDataModule(str(tmp_path / "pq"), split="loo", side_features=False, min_rating=4,
                            columns={"user": "reviewer", "item": "asin", "rating": "stars", "timestamp": "time"})
    b.setup()
    assert (a.user_ids == b.user_ids).all() and (a.item_ids == b.item_ids).all() and torch.equal(a.part_N, b.part_N)
    with pytest.raises(ValueError, match=r"'product' is not one of user, item, rating, timestamp"):
        MovieLensDataModule(str(tmp_path / "pq"), columns={"product": "asin"})


def test_a_datasets_dataset_is_read_as_its_parquet_copy(tmp_path, monkeypatch):
    """In Python, a `datasets.Dataset` of interactions (what `load_dataset` gives) is data_dir: it was "expected str,
    bytes or os.PathLike object, not Dataset". It is written once as ratings.parquet, named by its fingerprint (a
    filtered Dataset is another copy), and the hyperparameters hold that folder's path."""
    import datasets
    import pyarrow.parquet as pq

    from lightning_rec.data.movielens import datamodule

    monkeypatch.setattr(datamodule, "default_cache_dir", lambda: tmp_path / "cache")
    log = _string_id_log()
    table = pa.table({"reviewer": [u for u, _, _ in log], "asin": [i for _, i, _ in log],
                      "stars": [float(1 + t % 5) for _, _, t in log], "time": [t for _, _, t in log]})
    (tmp_path / "pq").mkdir()
    pq.write_table(table, tmp_path / "pq" / "ratings.parquet")
    columns = {"user": "reviewer", "item": "asin", "rating": "stars", "timestamp": "time"}
    ds = datasets.Dataset(table).shuffle(seed=3)  # an index mapping, applied in the copy
    for min_rating, given in ((None, ds), (None, ds), (3, ds.filter(lambda r: r["stars"] >= 3))):
        a = MovieLensDataModule(str(tmp_path / "pq"), split="loo", side_features=False, columns=columns,
                                min_rating=min_rating)
        b = MovieLensDataModule(given, split="loo", side_features=False, columns=columns, min_rating=min_rating)
        assert isinstance(b.hparams["data_dir"], str) and (Path(b.hparams["data_dir"]) / "ratings.parquet").is_file()
        a.setup()
        b.setup()
        assert (a.user_ids == b.user_ids).all() and (a.item_ids == b.item_ids).all()
        assert a.report.num_interactions == b.report.num_interactions
        for split in ("train", "val", "test"):
            assert len(a.datasets[split]) == len(b.datasets[split])
        assert [x.tolist() for x in a.datasets["test"].target] == [x.tolist() for x in b.datasets["test"].target]
    copies = [c for c in (tmp_path / "cache" / "hf_datasets").iterdir() if c.is_dir()]
    assert len(copies) == 2  # ds once, the filtered Dataset once
    with pytest.raises(ValueError, match=r"data_dir is a DatasetDict of the splits \['train'\]: pass one split, "
                                         r"e.g. ds\['train'\]"):
        MovieLensDataModule(datasets.DatasetDict({"train": ds}))
    # it named CriteoDataModule's streaming=True, an argument MovieLensDataModule does not have (a TypeError if tried)
    with pytest.raises(ValueError, match=r"data_dir is an IterableDataset .*pass its files instead \(a Parquet file, "
                                         r"folder or pattern such as 'data/train-\*\.parquet'\), or load it") as e:
        MovieLensDataModule(ds.to_iterable_dataset())
    assert "streaming=True to read" not in str(e.value)


def test_given_splits_train_validate_and_test_on_the_logs_own_files(tmp_path, monkeypatch):
    """split="given": a log split already (Amazon Reviews'23's benchmark files, a Hub dataset's DatasetDict) trains,
    validates and tests on its own files: they were read as one log and split again, or refused."""
    import datasets

    from lightning_rec.data.movielens import datamodule

    monkeypatch.setattr(datamodule, "default_cache_dir", lambda: tmp_path / "cache")
    log = _string_id_log()
    by_user: dict[str, list] = {}
    for u, i, t in log:
        by_user.setdefault(u, []).append((u, i, t))
    parts = {0: [], 1: [], 2: []}
    for rows in by_user.values():  # each user's last row tests, the one before validates (when there are three)
        rows.sort(key=lambda r: r[2])
        for k, r in enumerate(rows):
            parts[2 if k == len(rows) - 1 else 1 if k == len(rows) - 2 and len(rows) > 2 else 0].append(r)
    parts[2].append(parts[0][0])  # a test pair seen in training: dropped from the test split, with a word
    folder = tmp_path / "All_Beauty"
    for p, name in ((0, "train"), (1, "valid"), (2, "test")):
        _write(folder / f"All_Beauty.{name}.csv", "user_id,parent_asin,rating,timestamp\n"
               + "".join(f"{u},{i},5.0,{t}\n" for u, i, t in parts[p]))
    _write(folder / "meta_All_Beauty.csv", "parent_asin,title\n")  # no split word: left alone
    columns = {"item": "parent_asin"}
    dm = MovieLensDataModule(str(folder), split="given", side_features=False, columns=columns)
    with pytest.warns(UserWarning, match="1 repeated"):
        dm.setup()
    ids = {(str(dm.user_ids[u]), str(dm.item_ids[i])) for u, i in zip(dm.ratings["user"], dm.ratings["item"])}
    assert ids == {(u, i) for u, i, _ in log}
    held = {}
    for split, p in (("val", 1), ("test", 2)):
        offsets, items = dm.datasets[split].target
        held[split] = {(str(dm.user_ids[u]), str(dm.item_ids[x])) for u in range(dm.num_users)
                       for x in items[offsets[u]:offsets[u + 1]].tolist()}
        assert held[split] == {(u, i) for u, i, _ in parts[p]} - {(u, i) for u, i, _ in parts[0]}
    assert dm.report.split_sizes == {"train": len(parts[0]), "val": len(parts[1]), "test": len(parts[2]) - 1}
    # the same splits as a DatasetDict (a Hub dataset's), and without a validation file: validation = test
    table = {p: pa.table({"user_id": [u for u, _, _ in parts[p]], "parent_asin": [i for _, i, _ in parts[p]],
                          "timestamp": [t for _, _, t in parts[p]]}) for p in parts}
    splits = datasets.DatasetDict({"train": datasets.Dataset(table[0]), "validation": datasets.Dataset(table[1]),
                                   "test": datasets.Dataset(table[2])})
    same = MovieLensDataModule(splits, split="given", side_features=False, columns=columns)
    with pytest.warns(UserWarning, match="1 repeated"):
        same.setup()
    assert (same.user_ids == dm.user_ids).all() and torch.equal(same.part_N, dm.part_N)
    no_val = MovieLensDataModule(datasets.DatasetDict({"train": splits["train"], "test": splits["test"]}),
                                 split="given", side_features=False, columns=columns)
    with pytest.warns(UserWarning, match="1 repeated"):
        no_val.setup()
    assert [x.tolist() for x in no_val.datasets["val"].target] == [x.tolist() for x in no_val.datasets["test"].target]
    # what given splits cannot be is said
    with pytest.raises(ValueError, match=r"DatasetDict of the splits \['train', 'validation', 'test'\]: pass one "
                                         r"split, e\.g\. ds\['train'\], or split='given'"):
        MovieLensDataModule(splits)
    with pytest.raises(ValueError, match=r"its splits \['extra'\] are none of"):
        MovieLensDataModule(datasets.DatasetDict({"train": splits["train"], "extra": splits["test"]}), split="given")
    # GroupLens side files beside the split files are read: the split files of loo give loo's module
    ml = _generated_ml100k(tmp_path / "ml")
    loo = MovieLensDataModule(str(ml), split="loo")
    loo.setup()
    table = loo.ratings.data.table
    for p, name in ((0, "train"), (1, "valid"), (2, "test")):
        rows = table.take(pa.array(np.nonzero(loo.part_N.numpy() == p)[0]))
        _write(tmp_path / "ml_given" / f"ml.{name}.csv", "user,item,rating,timestamp\n" + "".join(
            f"{u},{i},{r},{int(t)}\n" for u, i, r, t in zip(*(rows.column(c).to_pylist() for c in
                                                              ("user_id", "item_id", "rating", "timestamp")))))
    for side in ("u.user", "u.item"):
        (tmp_path / "ml_given" / side).write_bytes((ml / side).read_bytes())
    given = MovieLensDataModule(str(tmp_path / "ml_given"), split="given")
    given.setup()
    for split in ("val", "test"):  # the same held-out and excluded items per user (rows are in another order)
        for a, b in zip((*given.datasets[split].target, *given.datasets[split].exclude),
                        (*loo.datasets[split].target, *loo.datasets[split].exclude)):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), split
    for kind in ("user_features", "item_features"):
        a, b = getattr(given, kind), getattr(loo, kind)
        assert a.keys == b.keys and len(a.keys) > 1 and a.num_embeddings == b.num_embeddings, kind
        rows = torch.arange(len(given.user_ids if kind == "user_features" else given.item_ids))
        assert torch.equal(a.kjt(rows).values(), b.kjt(rows).values()), kind
    assert given.item_titles == loo.item_titles and given.item_titles[0] == "Item 1 (1995)"
    (folder / "All_Beauty.test.csv").unlink()
    with pytest.raises(ValueError, match=r"split='given' needs a train and a test file in .*All_Beauty.*\(no test "
                                         r"file\)"):
        MovieLensDataModule(str(folder), split="given", columns=columns).setup()
    _write(folder / "train_test.csv", "user_id,parent_asin,rating\n")
    with pytest.raises(ValueError, match=r"train_test\.csv: its name says more than one split"):
        MovieLensDataModule(str(folder), split="given", columns=columns).setup()


def test_recbole_atomic_files_with_string_ids_join_their_item_file(tmp_path):
    """RecBole's Amazon sets key users and items by strings in .inter and .item: the side file was read with
    int(item_id) and failed ("invalid literal for int() with base 10: 'B00A'")."""
    _write(tmp_path / "amz" / "amz.inter", "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
           + "".join(f"A{u}X\tB00{i}\t5.0\t{1600000000 + 10 * u + k}\n" for u in range(4)
                     for k, i in enumerate("ABCD"[u % 2:])))
    _write(tmp_path / "amz" / "amz.item", "item_id:token\ttitle:token_seq\tcategories:token_seq\n"
           "B00A\tA kettle\tHome Kitchen\nB00B\tA lamp\tHome\nB00E\tNever rated\tGarden\n")
    dm = MovieLensDataModule(str(tmp_path / "amz"), split="loo")
    dm.setup()
    assert dm.report.layout == "recbole" and dm.user_ids.tolist() == ["A0X", "A1X", "A2X", "A3X"]
    assert dm.item_ids.tolist() == ["B00A", "B00B", "B00C", "B00D", "B00E"]  # the item file's own items too
    assert dm.item_titles == ["A kettle", "A lamp", "B00C", "B00D", "Never rated"]
    genre = dm.item_catalog().to_dict()["genre"]
    assert genre.lengths().tolist() == [2, 1, 0, 0, 1]  # categories as the genre bag


@needs_ml100k
def test_leave_one_out_on_ml100k_holds_out_each_users_two_newest(ro):
    dm = MovieLensDataModule(str(ML100K), split="loo", side_features=False)
    dm.setup()
    assert dm.report.split_sizes == {"train": 98_114, "val": 943, "test": 943}
    cols = dm.ratings.with_format("numpy")[:]
    user, time, part = cols["user"], cols["timestamp"], dm.part_N.numpy()
    newest_U = np.full(943, -1)
    np.maximum.at(newest_U, user, time)
    assert (time[part == 2] == newest_U[user[part == 2]]).all()  # every test item is its user's newest
    assert (time[part == 1] <= newest_U[user[part == 1]]).all()
    before_U = np.full(943, -1)
    np.maximum.at(before_U, user[part == 0], time[part == 0])
    assert (before_U[user[part == 1]] <= time[part == 1]).all()  # nothing training is newer than validation


@needs_ml100k
def test_training_batches_are_whole_with_user_and_item_features(ro):
    loader = ro.train_dataloader()
    assert loader.collate_fn is passthrough_collate  # built whole by the dataset, no per-sample collate
    batch = next(iter(loader))
    assert isinstance(batch, RetrievalBatch) and len(batch) == 512
    assert batch.user_features.keys() == ["user_id", "age", "gender", "occupation", "zip"]
    assert batch.item_features.keys() == ["item_id", "year", "genre"]
    assert batch.user_features.stride() == batch.item_features.stride() == 512
    # u.user line 1: "1|24|M|technician|85711"; u.item line 1: Toy Story, 1995, Animation|Children's|Comedy
    ds = ro.datasets["train"]
    first = ds.__getitems__([int((ds.user_N == 0).nonzero()[0])])
    feats = {k: v.values().tolist() for k, v in first.user_features.to_dict().items()}
    assert feats["user_id"] == [0] and feats["age"] == [2]  # 18-24
    toy = ds.__getitems__([int((ds.item_N == 0).nonzero()[0])]).item_features.to_dict()
    assert toy["genre"].values().tolist() == [4, 5, 6]  # u.genre ids 3, 4, 5 (+1: 0 is "missing")
    assert ro.item_titles[0] == "Toy Story (1995)"
    # logQ: the log of each item's share of training pairs
    counts = torch.bincount(ds.item_N, minlength=1682).double()
    torch.testing.assert_close(batch.item_log_q, torch.log(counts[batch.item_index] / ds.item_N.numel()).float())
    # every training pair appears once per epoch, in whole batches
    seen = torch.cat([b.user_index * 1682 + b.item_index for b in loader])
    assert seen.numel() == len(ds) and seen.unique().numel() == len(ds)


@needs_ml100k
def test_ranking_batches_hold_targets_and_seen_items(ro):
    train = _pairs(ro.datasets["train"])
    val, test = ro.datasets["val"], ro.datasets["test"]
    val_targets, val_seen = _csr_rows(val, "target"), _csr_rows(val, "exclude")
    test_targets, test_seen = _csr_rows(test, "target"), _csr_rows(test, "exclude")
    for u in (0, 100, 942):
        train_u = {i for (uu, i) in train if uu == u}
        assert val_seen[u] == train_u  # validation excludes training items
        assert test_seen[u] == train_u | val_targets[u]  # test excludes training + validation items (RecBole)
        assert not (test_targets[u] & test_seen[u]) and not (val_targets[u] & train_u)
    batch = next(iter(ro.val_dataloader()))
    assert isinstance(batch, RankingBatch) and len(batch) == 128
    assert batch.target_offsets[-1] == batch.target_items.numel()


@needs_ml100k
def test_official_split_u1_and_min_rating_threshold():
    dm = MovieLensDataModule(str(ML100K), split="u1", num_negatives=1)
    dm.setup()
    assert dm.report.split_sizes == {"train": 80_000, "val": 20_000, "test": 20_000}
    base = np.loadtxt(ML100K / "u1.base", dtype=np.int64)
    assert len(_pairs(dm.datasets["train"])) == base.shape[0]
    # users absent from u1.test are counted, and the metric skips them (no division by zero)
    assert dm.report.users_without_heldout["test"] == 943 - np.unique(np.loadtxt(ML100K / "u1.test")[:, 0]).size
    metric = RankingMetrics(ks=[10])
    for b in dm.test_dataloader():
        metric.update_full(torch.randn(len(b), dm.num_items), b.target_offsets, b.target_items,
                           b.exclude_offsets, b.exclude_items)
    assert int(metric.skipped_users) == dm.report.users_without_heldout["test"]
    # test items that no training pair has are kept (they still get a row and are ranked), and counted
    assert dm.report.heldout_items_unseen_in_train["test"] > 0
    # BPR negatives are never one of the user's training items
    batch = next(iter(dm.train_dataloader()))
    pairs = _pairs(dm.datasets["train"])
    assert not any((u, i) in pairs for u, i in zip(batch.user_index.tolist(), batch.neg_item_index.tolist()))
    liked = MovieLensDataModule(str(ML100K), min_rating=4)
    liked.setup()
    assert liked.report.num_interactions == 34_174 + 21_201 and liked.report.num_ratings == 100_000


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_read_ratings_detects_separator_and_header(tmp_path):
    rows = [(1, 10, 4.0, 100), (2, 20, 3.5, 200), (1, 30, 5.0, 300)]
    layouts = {
        "u.data": "".join(f"{u}\t{i}\t{r:g}\t{t}\n" for u, i, r, t in rows),  # ml-100k
        "ratings.dat": "".join(f"{u}::{i}::{r:g}::{t}\n" for u, i, r, t in rows),  # ml-1m / ml-10m
        "ratings.csv": "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in rows),
        "semi.txt": "user;item;rating\n" + "".join(f"{u};{i};{r}\n" for u, i, r, _ in rows),  # header, 3 fields
    }
    for name, text in layouts.items():
        table = read_ratings(_write(tmp_path / name, text))
        assert table.column("user_id").to_pylist() == [1, 2, 1], name
        assert table.column("item_id").to_pylist() == [10, 20, 30], name
        assert table.column("rating").to_pylist() == [4.0, 3.5, 5.0], name
        assert table.column("timestamp").type == pa.int64(), name
    # a log's fractional timestamps (were refused: "conversion error to int64"), kept as whole seconds
    table = read_ratings(_write(tmp_path / "log" / "ratings.csv", "user,item,rating,timestamp\n1,2,1,1700000000.75\n"
                                                                "1,3,1,1700000001\n"))
    assert table.column("timestamp").to_pylist() == [1700000000, 1700000001]
    # a byte order mark (Excel's "CSV UTF-8") before the header: its first name was "\xef\xbb\xbfuser", no user column
    bom = _write(tmp_path / "bom" / "ratings.csv", b"\xef\xbb\xbfuser,item,rating\r\n1,10,4\r\n2,20,3.5\r\n")
    assert read_ratings(bom).column("user_id").to_pylist() == [1, 2]
    with pytest.raises(ValueError, match=r"bad\.csv.*cannot parse"):
        read_ratings(_write(tmp_path / "bad.csv", "1,2,3,4\n1,x,3,4\n"))
    with pytest.raises(ValueError, match="separator"):
        read_ratings(_write(tmp_path / "one.txt", "1\n2\n"))
    with pytest.raises(ValueError, match="is a directory"):
        read_ratings(tmp_path)


def test_compressed_ratings_files_are_read_like_the_criteo_reader_reads_them(tmp_path):
    # ratings.csv.gz (and u.data.gz, bz2): was "holds no GroupLens ratings file", not a word about compression
    import bz2
    import gzip

    text = "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},4,{u * 10 + i}\n" for u in range(1, 6)
                                                         for i in range(1, 6))
    plain = read_ratings(_write(tmp_path / "plain" / "ratings.csv", text))
    gz = _write(tmp_path / "gz" / "ratings.csv.gz", gzip.compress(text.encode()))
    assert read_ratings(gz).equals(plain)
    assert read_ratings(_write(tmp_path / "bz" / "ratings.csv.bz2", bz2.compress(text.encode()))).equals(plain)
    dm = MovieLensDataModule(str(gz.parent), side_features=False, batch_size=4)
    dm.setup("fit")
    assert dm.report.layout == "ml-20m" and dm.report.num_ratings == 25
    _write(tmp_path / "ml100k" / "u.data.gz", gzip.compress(b"1\t1\t5\t1\n1\t2\t4\t2\n2\t1\t4\t3\n"))
    assert read_ratings(tmp_path / "ml100k" / "u.data.gz").column("item_id").to_pylist() == [1, 2, 1]
    for part in ("train", "test"):  # split="given": its files compressed too (were left out as not logs)
        _write(tmp_path / "given" / f"log.{part}.csv.gz", gzip.compress(text.encode()))
    dm = MovieLensDataModule(str(tmp_path / "given"), split="given", side_features=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # every test pair was seen in training (the same rows): said and dropped
        dm.setup("fit")
    assert dm.report.num_ratings == 50
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match=r"optionally compressed \(\.gz"):
        MovieLensDataModule(str(tmp_path / "none"), side_features=False).setup("fit")


def _tiny_ml100k(root: Path) -> Path:
    # 3 users, 4 items; item 4 is rated only by user 3 and u.item is latin-1 (a byte that is not UTF-8)
    _write(root / "u.data", "1\t1\t5\t1\n1\t2\t4\t2\n1\t3\t3\t3\n2\t1\t4\t4\n2\t2\t2\t5\n3\t4\t5\t6\n3\t1\t1\t7\n")
    _write(root / "u.user", "1|24|M|technician|85711\n2|53|F|other|94043\n3|23|M|writer|32067\n")
    flags = "|".join(["0"] * 18)
    _write(root / "u.item", ("1|Toy Story (1995)|01-Jan-1995||http://x|1|" + flags + "\n"
                             "2|GoldenEye (1995)|01-Jan-1995||http://x|0|" + flags + "\n"
                             "3|Caf\xe9 au lait (1993)|01-Jan-1993||http://x|0|" + flags + "\n"
                             "4|Unseen (1998)|01-Jan-1998||http://x|0|" + flags + "\n").encode("latin-1"))
    return root


def test_latin1_item_file_other_layouts_and_bad_folders(tmp_path):
    dm = MovieLensDataModule(str(_tiny_ml100k(tmp_path / "ml-100k")), batch_size=4)
    dm.setup()
    assert dm.item_titles[2] == "Café au lait (1993)"  # latin-1 decoded
    assert dm.num_users == 3 and dm.num_items == 4
    # ml-1m layout: '::' files, movies.dat in latin-1, genres by name
    root = tmp_path / "ml-1m"
    _write(root / "ratings.dat", "1::10::5::1\n1::20::4::2\n2::10::3::3\n2::30::4::4\n")
    _write(root / "users.dat", "1::F::1::10::48067\n2::M::56::16::70072\n")
    _write(root / "movies.dat", "10::Toy Story (1995)::Animation|Children's\n20::Jumanji (1995)::Adventure\n"
                                "30::Caf\xe9 (1996)::Drama\n".encode("latin-1"))
    dm1 = MovieLensDataModule(str(root))
    dm1.setup()
    assert dm1.report.layout == "ml-1m" and dm1.item_titles == ["Toy Story (1995)", "Jumanji (1995)", "Café (1996)"]
    assert set(dm1.user_num_embeddings) == {"user_id", "age", "gender", "occupation", "zip"}
    assert dm1.item_catalog().to_dict()["genre"].lengths().tolist() == [2, 1, 1]
    # ml-20m/25m layout: ratings.csv with a header, movies.csv quoted
    root = tmp_path / "ml-25m"
    _write(root / "ratings.csv", "userId,movieId,rating,timestamp\n1,1,4.0,1\n1,2,3.5,2\n2,1,5.0,3\n")
    _write(root / "movies.csv",
           'movieId,title,genres\n1,"Toy Story, The (1995)",Animation|Comedy\n2,Heat (1995),Action\n')
    dm25 = MovieLensDataModule(str(root))
    dm25.setup()
    assert dm25.report.layout == "ml-20m" and dm25.item_titles[0] == "Toy Story, The (1995)"
    assert set(dm25.user_num_embeddings) == {"user_id"}  # no user file in these layouts
    # a ratings file alone: side features cannot be read, and it is said (they were dropped silently)
    _write(tmp_path / "ratings_only" / "ratings.dat", "1::10::5::1\n1::20::4::2\n2::10::3::3\n2::30::4::4\n")
    with pytest.warns(UserWarning, match="has no user or item file"):
        MovieLensDataModule(str(tmp_path / "ratings_only")).setup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MovieLensDataModule(str(tmp_path / "ratings_only"), side_features=False).setup()
    assert not [w for w in caught if "no user or item file" in str(w.message)]
    with pytest.raises(ValueError, match="no GroupLens ratings file"):
        MovieLensDataModule(str(_write(tmp_path / "empty" / "README", "x").parent)).setup()
    # a user's own file: the messages say how to name it (a file as data_dir was told to "download GroupLens")
    own = _write(tmp_path / "own" / "interactions.csv", "user,item,rating,timestamp\n1,2,1,0\n")
    for where in (own, own.parent):
        with pytest.raises(ValueError, match=r"<folder>/ratings.csv with the header user,item\[,rating\]"):
            MovieLensDataModule(str(where)).setup()
    with pytest.raises(ValueError, match="not a folder"):
        MovieLensDataModule(str(tmp_path / "missing")).setup()
    with pytest.raises(ValueError, match="unknown split"):
        MovieLensDataModule(str(tmp_path), split="u9")
    with pytest.raises(ValueError, match="official splits.*ro_811"):
        MovieLensDataModule(str(root), split="u1").setup()
    with pytest.raises(ValueError, match="min_rating=6"):
        MovieLensDataModule(str(root), min_rating=6).setup()
    with pytest.raises(ValueError, match="setup"):
        _ = MovieLensDataModule(str(root)).item_num_embeddings


def test_eval_shards_cover_every_user_once_with_equal_batches():
    class Users(torch.utils.data.Dataset):
        def __len__(self):
            return 943

    for world in (2, 3, 4):
        shards = [list(EvalShardSampler(Users(), world, r)) for r in range(world)]
        assert len({len(s) for s in shards}) == 1  # the same number of samples (so of batches) on every rank
        real = sorted(i for s in shards for i in s if i >= 0)
        assert real == list(range(943))  # each user once: no repeated user to count twice


def _generated_ml100k(root: Path, users: int = 30, items: int = 40) -> Path:
    g = np.random.default_rng(0)
    rows = [(u, i, int(g.integers(1, 6)), 10 * u + i) for u in range(1, users + 1)
            for i in sorted(g.choice(np.arange(1, items + 1), size=12, replace=False).tolist())]
    _write(root / "u.data", "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows))
    _write(root / "u.user", "".join(f"{u}|{20 + u}|{'MF'[u % 2]}|other|{10000 + u}\n" for u in range(1, users + 1)))
    flags = "|".join(["0"] * 18)
    _write(root / "u.item", "".join(f"{i}|Item {i} (1995)|01-Jan-1995||http://x|{flags}|0\n"
                                    for i in range(1, items + 1)))
    return root


def test_bpr_loader_resumes_mid_epoch_with_the_same_negatives(tmp_path):
    """The negatives of a batch depend on the batch, not on how many batches this process drew before."""
    import itertools

    root = _generated_ml100k(tmp_path / "ml-100k")

    def loader():
        dm = MovieLensDataModule(str(root), batch_size=16, num_negatives=1, seed=3)
        dm.setup("fit")
        return dm.train_dataloader()

    def triples(batches):
        return [torch.stack([b.user_index, b.item_index, b.neg_item_index]) for b in batches]

    first = loader()
    first.sampler.set_epoch(1)
    everything = triples(first)
    it = iter(first)
    triples(itertools.islice(it, 5))  # read 5, of which the step "consumed" 3 (a fetcher read ahead)
    first.consumed_batches = lambda: 3
    state = first.state_dict()
    fresh = loader()
    fresh.load_state_dict(state)
    fresh.sampler.set_epoch(1)
    rest = triples(fresh)
    assert len(everything) > 5 and len(rest) == len(everything) - 3
    assert all(torch.equal(a, b) for a, b in zip(rest, everything[3:]))
    again = loader()  # and a new pass over the same epoch draws the same negatives
    again.sampler.set_epoch(1)
    assert all(torch.equal(a, b) for a, b in zip(triples(again), everything))


def test_repeated_pairs_are_one_interaction_so_no_test_target_was_seen_in_training(tmp_path):
    """A click log saved as ratings.csv: repeats of a pair went to training and test alike (8 of 20 test targets
    were training pairs on this file), each scored as a find."""
    g = np.random.default_rng(0)
    rows = [(u, int(i), 100 * u + k) for u in range(1, 21) for k, i in enumerate(g.integers(1, 30, size=15))]
    path = _write(tmp_path / "clicks" / "ratings.csv",
                  "user,item,rating,timestamp\n" + "".join(f"{u},{i},1,{t}\n" for u, i, t in rows))
    dm = MovieLensDataModule(str(path.parent), side_features=False)
    with pytest.warns(UserWarning, match=r"\d+ repeated \(user, item\) rows dropped"):
        dm.setup()
    distinct = {(u, i) for u, i, _ in rows}
    assert dm.report.duplicates_dropped == len(rows) - len(distinct) > 0
    assert dm.report.num_interactions == len(distinct) == len(dm.ratings)
    train = dm.datasets["train"]
    seen = set(zip(train.user_N.tolist(), train.item_N.tolist()))
    for split in ("val", "test"):
        offsets, items = dm.datasets[split].target
        held_out = [(u, i) for u in range(dm.num_users) for i in items[offsets[u]:offsets[u + 1]].tolist()]
        assert held_out and not seen.intersection(held_out), split


def test_an_empty_validation_split_is_said_at_setup_with_its_cause(tmp_path):
    """Users with 2 interactions each: RO 8:1:1 holds out no validation item, which showed only as NaN metrics."""
    path = _write(tmp_path / "two" / "u.data", "".join(f"{u}\t{i}\t5\t0\n" for u in range(1, 6) for i in (u, u + 1)))
    dm = MovieLensDataModule(str(path.parent), side_features=False)
    with pytest.warns(UserWarning, match=r"the val split is empty.*from 3 \(validation\).*at most 2"):
        dm.setup()
    assert dm.report.split_sizes == {"val": 0, "test": 5, "train": 5}


def test_recbole_atomic_files_read_like_the_grouplens_folder(tmp_path):
    """RecBole's ml-100k download (ml-100k.inter/.user/.item) was refused: "holds no GroupLens ratings file"."""
    grouplens = _generated_ml100k(tmp_path / "ml-100k", users=12, items=20)
    rows = [line.split("\t") for line in (grouplens / "u.data").read_text().splitlines()]
    recbole = tmp_path / "recbole"
    _write(recbole / "ml-100k.inter", "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
           + "".join("\t".join(r) + "\n" for r in rows))
    _write(recbole / "ml-100k.user", "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
           + "".join(f"{u}\t{20 + u}\t{'MF'[u % 2]}\tother\t{10000 + u}\n" for u in range(1, 13)))
    _write(recbole / "ml-100k.item", "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
           + "".join(f"{i}\tItem {i}\t1995\tDrama Comedy\n" for i in range(1, 21)))
    a, b = MovieLensDataModule(str(grouplens)), MovieLensDataModule(str(recbole))
    a.setup()
    b.setup()
    assert b.report.layout == "recbole" and b.report.num_interactions == len(rows)
    assert (a.user_ids == b.user_ids).all() and (a.item_ids == b.item_ids).all() and torch.equal(a.part_N, b.part_N)
    assert a.user_num_embeddings == b.user_num_embeddings
    ua, ub = a.user_catalog().to_dict(), b.user_catalog().to_dict()
    for feature in ("age", "gender", "zip"):
        assert torch.equal(ua[feature].values(), ub[feature].values()), feature
    items = b.item_catalog().to_dict()
    assert items["genre"].lengths().tolist() == [2] * 20 and b.item_titles[0] == "Item 1"
    _write(recbole / "other.inter", "user_id:token\titem_id:token\n")
    with pytest.raises(ValueError, match="several RecBole .inter files"):
        MovieLensDataModule(str(recbole)).setup()


def test_two_columns_naming_the_same_field_are_refused_naming_columns(tmp_path):
    """A log with both user and userId (or item and itemId) read the first one as the user, silently."""
    import pyarrow.parquet as pq

    csv = _write(tmp_path / "r.csv", "user,userId,item,rating\n1,10,5,4\n2,20,6,3\n")
    with pytest.raises(ValueError, match=r"r\.csv:1: columns 'user', 'userId' both name the user: say which one, "
                                         r"columns=\{'user': 'user'\}"):
        read_ratings(csv)
    assert read_ratings(csv, columns={"user": "userId"}).column("user_id").to_pylist() == [10, 20]
    pq.write_table(pa.table({"itemId": [5, 6], "user": [1, 2], "item": [7, 8]}), tmp_path / "r.parquet")
    with pytest.raises(ValueError, match=r"columns 'itemId', 'item' both name the item: say which one"):
        read_ratings(tmp_path / "r.parquet")
    assert read_ratings(tmp_path / "r.parquet", columns={"item": "item"}).column("item_id").to_pylist() == [7, 8]


@pytest.mark.parametrize("min_rating", ["4", float("nan"), True])
def test_a_min_rating_that_is_not_a_number_is_refused_at_construction(tmp_path, min_rating):
    # "4" (as a YAML or a Python caller may give it) failed at setup with numpy's UFuncTypeError, never naming it
    csv = _write(tmp_path / "ratings.csv", "user,item,rating\n1,5,4\n2,6,3\n")
    with pytest.raises(ValueError, match=rf"MovieLensDataModule min_rating={min_rating!r}: give a number \(ratings "
                                         rf">= it are kept\), or None"):
        MovieLensDataModule(str(csv.parent), min_rating=min_rating)
    MovieLensDataModule(str(csv.parent), min_rating=4)  # an int is a number


def _interactions(pairs: list[tuple[int, int]], num_users: int, num_items: int, num_negatives: int = 1):
    from lightning_rec.data.movielens import FeatureTable, InteractionDataset

    user_N, item_N = torch.tensor(pairs).t()
    users = FeatureTable({"user_id": (torch.arange(num_users), num_users)}, {})
    items = FeatureTable({"item_id": (torch.arange(num_items), num_items)}, {})
    return InteractionDataset(user_N, item_N, users, items, num_items, num_negatives, seed=0)


def test_bpr_negatives_are_never_seen_items_even_for_a_user_who_has_seen_almost_all():
    """After 10 redraws a user who had seen 199 of 200 items kept a seen item as its negative (~95% of its pairs),
    silently; now the rest is drawn among its unseen items exactly."""
    pairs = [(0, i) for i in range(199)] + [(1, 199), (1, 3), (1, 7)]
    ds = _interactions(pairs, 2, 200)
    batch = ds.__getitems__(list(range(len(pairs))))
    assert batch.neg_item_index[:199].tolist() == [199] * 199  # user 0's one unseen item
    assert not {3, 7, 199} & set(batch.neg_item_index[199:].tolist())
    assert torch.equal(ds.__getitems__(list(range(len(pairs)))).neg_item_index, batch.neg_item_index)  # reproducible
    # a user with several unseen items draws each of them, never a seen one
    ds = _interactions([(0, i) for i in range(195)] + [(1, 0)], 2, 200)
    negs = set(ds.__getitems__(list(range(195))).neg_item_index.tolist())
    assert negs == {195, 196, 197, 198, 199}


def test_bpr_warns_when_a_user_has_seen_every_item():
    with pytest.warns(UserWarning, match=r"1 training users interacted with every one of the 4 items: BPR has no "
                                         r"unseen item"):
        _interactions([(0, i) for i in range(4)] + [(1, 0)], 2, 4)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*interacted with every")
        _interactions([(0, i) for i in range(4)] + [(1, 0)], 2, 4, num_negatives=0)


def test_a_csv_log_without_a_rating_column_is_implicit_feedback_as_a_parquet_log(tmp_path):
    """`user,item[,timestamp]` (an implicit log: clicks, plays) was refused as "cannot find the separator of
    'user,item'", or "no column for ['rating']" with a timestamp, where the same log as Parquet (or a datasets.Dataset)
    read as implicit feedback; now the CSV reads the same, every interaction 1.0."""
    import pyarrow.parquet as pq

    rows = [(u, (u * 3 + j) % 9, 100 + k) for k, (u, j) in enumerate((u, j) for u in range(6) for j in range(5))]
    _write(tmp_path / "uit" / "ratings.csv", "user,item,timestamp\n" + "".join(f"{u},{i},{t}\n" for u, i, t in rows))
    _write(tmp_path / "ui" / "ratings.csv", "user\titem\n" + "".join(f"{u}\t{i}\n" for u, i, _ in rows))
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"user": [r[0] for r in rows], "item": [r[1] for r in rows],
                             "timestamp": [r[2] for r in rows]}), tmp_path / "pq" / "ratings.parquet")
    for name, split in (("uit", "loo"), ("ui", "ro_811")):
        csv, parquet = (MovieLensDataModule(str(tmp_path / d), split=split, side_features=False)
                        for d in (name, "pq"))
        csv.setup()
        parquet.setup()
        assert (csv.user_ids == parquet.user_ids).all() and (csv.item_ids == parquet.item_ids).all()
        assert torch.equal(csv.part_N, parquet.part_N) and csv.ratings["rating"] == [1.0] * len(rows)
    with pytest.raises(ValueError, match="has no rating column"):
        MovieLensDataModule(str(tmp_path / "ui"), min_rating=4, side_features=False).setup()
    with pytest.raises(ValueError, match="has no timestamp column"):
        MovieLensDataModule(str(tmp_path / "ui"), split="loo", side_features=False).setup()
    _write(tmp_path / "bare" / "ratings.csv", "".join(f"{u},{i}\n" for u, i, _ in rows))  # no header: no names
    with pytest.raises(ValueError, match=r"2 fields separated by ','.*start the file with a header line"):
        MovieLensDataModule(str(tmp_path / "bare"), side_features=False).setup()


def test_bpr_negatives_differ_between_epochs_without_shuffling_too(tmp_path):
    """A batch's negatives are seeded by the batch: unshuffled (shuffle=False), every epoch has the same batches, so
    each pair met the same negative in every epoch, for the whole run. The epoch is now part of their seed there (a
    shuffled run keeps its negatives); a new loader draws the same epochs' negatives again."""
    _write(tmp_path / "ml" / "ratings.csv", "user,item,rating,timestamp\n"
           + "".join(f"{u},{i},4,{u * 100 + i}\n" for u in range(12) for i in range(u % 4, 40, 3)))

    def passes(shuffle: bool) -> list[torch.Tensor]:
        dm = MovieLensDataModule(str(tmp_path / "ml"), batch_size=16, num_negatives=1, shuffle=shuffle,
                                 side_features=False)
        dm.setup("fit")
        loader = dm.train_dataloader()  # outside a Trainer each pass is the next epoch
        return [torch.cat([b.neg_item_index for b in loader]) for _ in range(3)]

    fixed = passes(shuffle=False)
    assert not torch.equal(fixed[0], fixed[1]) and not torch.equal(fixed[1], fixed[2])
    assert all(torch.equal(a, b) for a, b in zip(fixed, passes(shuffle=False)))  # reproducible


def test_a_nan_timestamp_in_a_parquet_log_is_named_not_an_arrow_cast_error(tmp_path):
    """A float timestamp column holding NaN (numpy's missing value) failed in Arrow's cast, "Float value nan was
    truncated converting to int64", naming neither the file nor the column; nulls there were already named."""
    import pyarrow.parquet as pq

    time = np.arange(30, dtype=np.float64)
    time[3] = np.nan
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"user": [u // 5 for u in range(30)], "item": [u % 7 for u in range(30)],
                             "timestamp": time}), tmp_path / "pq" / "ratings.parquet")
    with pytest.raises(ValueError, match=r"ratings\.parquet: column 'timestamp' \(double, 1 NaN\): a timestamp is"):
        MovieLensDataModule(str(tmp_path / "pq"), split="loo", side_features=False).setup()


def test_a_headerless_log_read_as_headed_says_its_first_row_became_the_names(tmp_path, monkeypatch):
    """load_dataset("csv", data_files="u.data", sep="\\t") takes u.data's first rating as the column names ('196',
    '242', ...): the error said to map them, columns={'user': '196', ...}, which then dropped that rating in silence.
    It now says the names are a row and to read the file with column names."""
    import datasets

    from lightning_rec.data.movielens import datamodule

    monkeypatch.setattr(datamodule, "default_cache_dir", lambda: tmp_path / "cache")
    rows = [(u, i, 4, 100 + k) for k, (u, i) in enumerate((u, i) for u in range(1, 5) for i in range(1, 6))]
    path = _write(tmp_path / "u.data", "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows))
    ds = datasets.load_dataset("csv", data_files=str(path), sep="\t", split="train", cache_dir=str(tmp_path / "hf"))
    assert ds.column_names[0] == "1" and len(ds) == len(rows) - 1
    with pytest.raises(ValueError, match=r"column names \['1', '1.1', '4', '100'\] are numbers: the log had no "
                                         r"header line.*column_names=\['user', 'item', 'rating', 'timestamp'\]"):
        MovieLensDataModule(ds, side_features=False).setup()
