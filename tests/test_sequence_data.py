"""SequenceDataModule: histories in time order (ties stable, backwards timestamps sorted), leave-one-out, truncation to
max_len (the most recent kept), jagged batches with causal targets, and bad input."""

import pytest
from conftest import SHARED_DATA

from lightning_rec.data.sequence import SequenceDataModule

ML100K = SHARED_DATA / "movielens" / "ml-100k"


def _log(tmp_path, rows):
    """rows: (user, item, timestamp) in file order -> a folder with ratings.csv."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "ratings.csv").write_text("user,item,rating,timestamp\n" +
                                          "".join(f"{u},{i},5,{t}\n" for u, i, t in rows))
    return tmp_path


def _dm(tmp_path, rows, **kw):
    dm = SequenceDataModule(str(_log(tmp_path, rows)), **kw)
    dm.setup()
    return dm


def _history(dm, split, user_row):
    ds = dm.datasets[split]
    b = ds.__getitems__([int((ds.users_E == user_row).nonzero())])
    return [dm.item_ids[i].item() for i in b.item_ids], dm.item_ids[b.targets[0]].item()


def test_leave_one_out_time_order_and_causal_targets(tmp_path):
    # user 1: items 10..15 at times given out of order; user 2: 4 items
    rows = [(1, 13, 30), (1, 10, 0), (1, 12, 20), (1, 11, 10), (1, 15, 50), (1, 14, 40),
            (2, 20, 5), (2, 21, 6), (2, 22, 7), (2, 23, 8)]
    dm = _dm(tmp_path, rows)
    u1 = list(dm.user_ids).index(1)
    assert _history(dm, "val", u1) == ([10, 11, 12, 13], 14)  # validation = second-to-last
    assert _history(dm, "test", u1) == ([10, 11, 12, 13, 14], 15)  # test = last, validation item in its history
    train = dm.datasets["train"]
    b = train.__getitems__(list(range(len(train))))
    assert b.lengths.tolist() == [3, 1]  # 4 training items -> 3 causal inputs; 2 -> 1
    ids = [int(dm.item_ids[i]) for i in b.item_ids]
    tgt = [int(dm.item_ids[i]) for i in b.targets]
    assert ids == [10, 11, 12, 20] and tgt == [11, 12, 13, 21]  # every next item of the history
    assert b.timestamps.tolist() == [0, 10, 20, 5]


def test_tied_timestamps_keep_log_order(tmp_path):
    rows = [(1, 5, 100), (1, 3, 100), (1, 9, 100), (1, 1, 100), (1, 7, 200)]
    dm = _dm(tmp_path, rows)
    assert _history(dm, "test", 0) == ([5, 3, 9, 1], 7)
    assert dm.report.timestamps_tied == 3


def test_max_len_keeps_most_recent(tmp_path):
    rows = [(1, i, i) for i in range(20)]
    dm = _dm(tmp_path, rows, max_len=4)
    assert _history(dm, "test", 0) == ([15, 16, 17, 18], 19)
    b = dm.datasets["test"].__getitems__([0])
    assert b.exclude_items.numel() == 19  # the exclusions are the whole history, not only the kept part
    t = dm.datasets["train"].__getitems__([0])
    assert [int(dm.item_ids[i]) for i in t.item_ids] == [13, 14, 15, 16]  # 18 training items, last 4 + 1 kept
    assert [int(dm.item_ids[i]) for i in t.targets] == [14, 15, 16, 17]
    assert dm.report.users_truncated == 1


def test_users_with_one_interaction_skipped_and_counted(tmp_path):
    rows = [(1, 1, 0), (2, 1, 0), (2, 2, 1), (3, 1, 0), (3, 2, 1), (3, 3, 2)]
    dm = _dm(tmp_path, rows)
    assert dm.report.users_skipped == 1 and dm.report.users_not_evaluated == 1
    # user 2 trains on both items; user 3's training part is one item (no next item in it): evaluated only
    assert dm.datasets["train"].users_S.tolist() == [1]
    assert len(dm.datasets["val"]) == len(dm.datasets["test"]) == 1


def test_heldout_item_never_seen_in_training_is_counted_and_ranked(tmp_path):
    rows = [(1, 1, 0), (1, 2, 1), (1, 3, 2), (1, 99, 3), (2, 3, 0), (2, 1, 1), (2, 2, 2)]
    dm = _dm(tmp_path, rows)
    assert dm.report.heldout_items_unseen_in_train == {"val": 0, "test": 1}
    assert dm.num_items == 4  # its row exists: the catalog ranks it
    assert _history(dm, "test", 0) == ([1, 2, 3], 99)


def test_empty_batch(tmp_path):
    dm = _dm(tmp_path, [(1, i, i) for i in range(5)])
    for split in ("train", "val", "test"):
        b = dm.datasets[split].__getitems__([-1])  # an evaluation rank's padding only
        assert len(b) == 0 and b.items.values().numel() == 0 and b.lengths.tolist() == []


@pytest.mark.parametrize("max_len", [0, -3, 2.5])
def test_max_len_not_positive_refused(tmp_path, max_len):
    with pytest.raises(ValueError, match="max_len"):
        SequenceDataModule(str(_log(tmp_path, [(1, 1, 0)])), max_len=max_len)


def test_loaders_yield_jagged_batches(tmp_path):
    rows = [(u, i, i) for u in range(6) for i in range(3 + u * 5)]
    dm = _dm(tmp_path, rows, batch_size=3, eval_batch_size=4, max_len=8)
    lengths = [b.lengths.tolist() for b in dm.train_dataloader()]
    assert sum(len(x) for x in lengths) == 5  # user 0 (3 items) has one training item: no target
    for b in dm.train_dataloader():
        assert b.item_ids.numel() == int(b.lengths.sum()) == b.targets.numel()  # no padding anywhere
    b = next(iter(dm.val_dataloader()))
    assert b.targets.numel() == len(b) == 4


@pytest.mark.skipif(not (ML100K / "u.data").is_file(), reason="shared ml-100k not present")
def test_ml100k():
    dm = SequenceDataModule(str(ML100K), max_len=50)
    dm.setup()
    r = dm.report
    assert (r.num_users, r.num_items, r.num_interactions, r.users_skipped) == (943, 1682, 100_000, 0)
    b = dm.datasets["test"].__getitems__(list(range(943)))
    assert int(b.lengths.max()) == 50 and int(b.lengths.min()) >= 19  # every ml-100k user rated >= 20
    assert int(b.exclude_offsets[-1]) == 100_000 - 943  # each user's whole history before its test item


def test_parquet_log_and_datasets_dataset_read_as_the_csv(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [(7, "b", 30), (7, "a", 10), (7, "c", 20), (9, "a", 5), (9, "c", 6), (9, "b", 7)]
    cols = {"user": [r[0] for r in rows], "item": [r[1] for r in rows], "timestamp": [r[2] for r in rows]}
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table(cols), tmp_path / "pq" / "ratings.parquet")
    for source in (str(tmp_path / "pq"), datasets.Dataset.from_dict(cols)):
        dm = SequenceDataModule(source, max_len=5)
        dm.setup()
        assert [_history(dm, "test", u) for u in (0, 1)] == [(["a", "c"], "b"), (["a", "c"], "b")]


def test_ml1m_ratings_dat_read_in_time_order(tmp_path):
    """ml-1m's ratings.dat (UserID::MovieID::Rating::Timestamp, no header; the file as GroupLens ships it, as
    recipes/configs/*_ml1m.yaml read it): histories in time order, not file order, ties in file order."""
    root = tmp_path / "ml-1m"
    root.mkdir()
    lines = ["1::1193::5::978300760", "1::661::3::978302109", "1::914::3::978301968", "1::3408::4::978300275",
             "2::1357::5::978298709", "2::3068::4::978299000", "2::1537::4::978299620", "2::647::3::978299351",
             "2::2194::4::978299297", "3::3421::4::978298147"]  # user 3 has one rating: skipped
    (root / "ratings.dat").write_text("\n".join(lines) + "\n", encoding="latin-1")
    dm = SequenceDataModule(str(root), max_len=200, min_rating=None)
    dm.setup()
    r = dm.report
    assert (r.layout, r.num_users, r.num_items, r.num_interactions, r.users_skipped) == ("ml-1m", 3, 10, 10, 1)
    assert _history(dm, "test", 0) == ([3408, 1193, 914], 661)
    assert _history(dm, "val", 1) == ([1357, 3068, 2194], 647)  # 978299297 < 978299351: 2194 before 647
    assert _history(dm, "test", 1) == ([1357, 3068, 2194, 647], 1537)
