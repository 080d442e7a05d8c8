"""A Criteo stream's epoch (`CriteoDataModule(streaming=True)`, text or Parquet) begun at N ranks and continued at M
(data/criteo/stream_elastic.py): row-id audits over the epoch. Each row is named by its I1 (dense column 0 =
log1p(I1)).

Every row of the file is read once over the epoch: none twice, and the only ones missed are the continued epoch's
remainder (fewer than M rows: each rank reads the same share; under drop_last also each rank's last partial batch,
fewer than M * B rows). The next epoch is an ordinary M-rank one. A stream once restarted such an epoch with a
warning: its position is each rank's own place in its share of the file, and the checkpoint's loader state handed the
loader rank 0's alone."""

from __future__ import annotations

import itertools
import os
import warnings
from pathlib import Path

import pytest
from conftest import SHARED_DATA
from dist_utils import run_ranks

from lightning_rec.data.batch import make_stream_loader
from lightning_rec.data.criteo import CriteoIterableDataset

B = 4
ROWS = 203
CRITEO = SHARED_DATA / "criteo"


def _row(k: int) -> str:
    return "\t".join([str(k % 2), str(k)] + [str(j) for j in range(2, 14)] + [f"{j:08x}" for j in range(1, 27)]) + "\n"


@pytest.fixture(scope="module")
def tsv(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "train.tsv"
    path.write_text("".join(_row(k) for k in range(ROWS)))
    return path


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
    """The same rows as a Parquet table: a table streams in blocks of block_bytes // 256 rows."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    k = np.arange(ROWS)
    columns = {"label": k % 2, "I1": k.astype(np.float32)}
    columns |= {f"I{j}": np.full(ROWS, j, np.float32) for j in range(2, 14)}
    columns |= {f"C{j}": np.full(ROWS, j, np.int64) for j in range(1, 27)}
    path = tmp_path_factory.mktemp("stream_table") / "train.parquet"
    pq.write_table(pa.table(columns), path)
    return path


def _loaders(path, world, drop_last, block_bytes, num_workers=0):
    return [make_stream_loader(CriteoIterableDataset(path, B, 10, shuffle=True, seed=3, drop_last=drop_last,
                                                     block_bytes=block_bytes, rank=r, world_size=world),
                               num_workers=num_workers) for r in range(world)]


def _ids(batch) -> list[int]:
    return [round(float(x)) for x in batch.dense_features[:, 0].expm1()]


def _read(loader, batches=None) -> list[int]:
    return [i for batch in itertools.islice(iter(loader), batches) for i in _ids(batch)]


def _epoch_rows(path, world, drop_last, block_bytes, epoch) -> list[int]:
    rows = []
    for loader in _loaders(path, world, drop_last, block_bytes):
        loader.dataset.set_epoch(epoch)
        rows += [i for batch in loader.dataset for i in _ids(batch)]
    return rows


# 1 << 20: the file is one block, its rows dealt row by row; 600 bytes: 25 blocks, dealt whole
@pytest.mark.parametrize("block_bytes", [1 << 20, 600])
@pytest.mark.parametrize("N,M,steps", [(4, 2, 3), (2, 3, 5), (3, 1, 4)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("source", ["tsv", "parquet"])
def test_an_epoch_begun_at_n_ranks_reads_every_row_once_at_m(request, source, N, M, steps, drop_last, block_bytes):
    tsv = request.getfixturevalue(source)
    before, read = _loaders(tsv, N, drop_last, block_bytes), []
    for loader in before:
        read += _read(loader, steps)
    assert len(read) == N * steps * B
    states = [loader.state_dict() for loader in before]
    after = _loaders(tsv, M, drop_last, block_bytes)
    lengths = set()
    for loader in after:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "starts over" warning
            loader.load_state_dict({"ranks": states})
        rows = _read(loader)
        lengths.add(len(rows))
        read += rows
    assert len(lengths) == 1  # the same share on every rank: they step together to its end
    assert len(read) == len(set(read)), "a row read twice"
    missed = ROWS - len(read)
    assert set(read) <= set(range(ROWS)) and 0 <= missed < (M * B if drop_last else M), missed
    nxt = []  # the next epoch: an ordinary one at M ranks
    for loader in after:
        nxt += _read(loader)
    assert sorted(nxt) == sorted(_epoch_rows(tsv, M, drop_last, block_bytes, epoch=1))


def test_the_saved_readers_share_the_blocks_they_all_parse(tsv, monkeypatch):
    """Rows dealt one by one (fewer than 2 blocks per reader): each of the 4 saved readers parses every block. A rank
    of the continued epoch replays all 4 in step and parses each block of the rest once, not 4 times."""
    from lightning_rec.data.criteo import datasets as criteo_datasets  # where the stream looks parse_block up

    block_bytes = tsv.stat().st_size // 6
    blocks = -(-tsv.stat().st_size // block_bytes)
    assert blocks < 2 * 4
    before = _loaders(tsv, 4, False, block_bytes)
    for loader in before:
        _read(loader, 3)
    states = [loader.state_dict() for loader in before]
    parse = criteo_datasets.parse_block
    calls = []
    monkeypatch.setattr(criteo_datasets, "parse_block", lambda *a, **k: calls.append(1) or parse(*a, **k))
    for loader in _loaders(tsv, 2, False, block_bytes):
        loader.load_state_dict({"ranks": states})
        calls.clear()
        _read(loader)
        assert 0 < len(calls) <= blocks, (len(calls), blocks)


def test_workers_save_and_continue_with_their_own_readers(tsv):
    """2 ranks x 2 DataLoader workers (4 readers) -> 3 ranks x 2 workers, the file in blocks dealt whole."""
    before, read = _loaders(tsv, 2, False, 600, num_workers=2), []
    its = [iter(loader) for loader in before]
    for it in its:
        read += [i for batch in itertools.islice(it, 5) for i in _ids(batch)]
    states = [loader.state_dict() for loader in before]
    assert [len(s["elastic"]["readers"]) for s in states] == [2, 2]
    del its
    for loader in _loaders(tsv, 3, False, 600, num_workers=2):
        loader.load_state_dict({"ranks": states})
        read += _read(loader)
    assert len(read) == len(set(read)) and ROWS - len(read) < 3


def test_a_continued_epoch_checkpointed_again_continues_at_a_third_world_size(tsv):
    """4 -> 2 mid-epoch, then 2 -> 3 and 2 -> 2 mid-way through the continued epoch: still every row once."""
    first, read = _loaders(tsv, 4, False, 600), []
    for loader in first:
        read += _read(loader, 2)
    second = _loaders(tsv, 2, False, 600)
    states = [loader.state_dict() for loader in first]
    for loader in second:
        loader.load_state_dict({"ranks": states})
        read += _read(loader, 3)  # 3 steps of the continued epoch (the loop counts 2 + 3)
    states = [loader.state_dict() for loader in second]
    assert states[0]["elastic"]["rows_consumed"] == 2 * 3 * B
    for world in (3, 2):
        rest = list(read)
        for loader in _loaders(tsv, world, False, 600):
            loader.load_state_dict({"ranks": states} if world != 2 else states[loader.dataset.rank_world()[0]])
            rest += _read(loader)
        assert len(rest) == len(set(rest)) and ROWS - len(rest) < world, (world, ROWS - len(rest))


def test_an_old_state_a_changed_file_or_block_size_starts_the_epoch_over_with_a_warning(tsv, tmp_path):
    before = _loaders(tsv, 2, False, 600)
    for loader in before:
        _read(loader, 2)
    states = [loader.state_dict() for loader in before]
    old = [{k: v for k, v in s.items() if k != "elastic"} for s in states]  # a version before stream elastic resume
    grown = tmp_path / "train.tsv"
    grown.write_text(tsv.read_text() + _row(ROWS))  # another file: one row more
    for saved, path, block_bytes, words in ((old, tsv, 600, "saved by 2 ranks, this run has 3, and the state was saved "
                                                             "by an older version"),
                                            (states, grown, 600, r"does not belong to this loader \(dataset_id"),
                                            (states, tsv, 700, "read in blocks of 600 bytes")):
        loader = _loaders(path, 3, False, block_bytes)[0]
        with pytest.warns(UserWarning, match=words):
            loader.load_state_dict({"ranks": saved})
        loader.dataset.set_epoch(0)
        plain = [i for batch in _loaders(path, 3, False, block_bytes)[0].dataset for i in _ids(batch)]
        assert _read(loader) == plain  # rank 0's whole share of the epoch, from its first batch


def test_a_state_whose_readers_repeat_starts_the_epoch_over_with_a_warning(tsv):
    """Rank 0's state twice (ranks' states put together by hand, or from two runs) was an AssertionError."""
    before = _loaders(tsv, 2, False, 600)
    for loader in before:
        _read(loader, 2)
    state = before[0].state_dict()
    after = _loaders(tsv, 3, False, 600)[0]
    with pytest.warns(UserWarning, match=r"not each of its 2 readers once .* starts over from its first batch"):
        after.load_state_dict({"ranks": [state, state]})
        rows = _read(after)
    assert rows and len(rows) == len(set(rows))


def test_an_old_state_at_the_same_world_size_resumes_exactly(tsv):
    """A state of the format before (no elastic record): at the same world size each rank resumes from its own
    position, as before; rank 0's alone (a plain checkpoint) at another world size warns and starts over."""
    before = _loaders(tsv, 2, False, 600)
    its = [iter(loader) for loader in before]
    for it in its:
        list(itertools.islice(it, 3))
    states = [{k: v for k, v in loader.state_dict().items() if k != "elastic"} for loader in before]
    rest = [[i for batch in it for i in _ids(batch)] for it in its]
    again = _loaders(tsv, 2, False, 600)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for loader in again:
            loader.load_state_dict({"ranks": states})
    assert [_read(loader) for loader in again] == rest
    other = _loaders(tsv, 3, False, 600)[0]
    other.load_state_dict(states[0])
    with pytest.warns(UserWarning, match="belongs to another file, batch size or split"):
        assert len(_read(other)) > 0


# a real fit: SIGKILL at 4 ranks mid-epoch, resumed at 2 -------------------------------------------------------


def _fit_rank(rank, world_size, root, path, kill_at, resume):
    from test_elastic_resume import fit_criteo_rows

    return fit_criteo_rows(rank, world_size, root, kill_at, resume, _ids, train_path=str(path), batch_size=B,
                           streaming=True, block_bytes=600)


def test_sigkill_mid_epoch_at_4_ranks_resumed_at_2_trains_every_row_of_the_epoch_once(tsv, tmp_path):
    """Killed at step 5 (the last checkpoint: step 4), resumed at 2 ranks through Trainer(strategy='rec')."""
    root = str(tmp_path)
    assert run_ranks(_fit_rank, 4, root, str(tsv), 5, False, timeout=120, allow_missing=True) == [None] * 4
    steps = run_ranks(_fit_rank, 2, root, str(tsv), None, True, timeout=120)
    rows: list[int] = []
    for name in sorted(os.listdir(root)):
        if name.startswith("rows."):
            for line in Path(root, name).read_text().splitlines():
                step, *ids = map(int, line.split())
                if name.startswith("rows.b") or step < 4:  # the killed run's steps after its last checkpoint redo
                    rows += ids
    assert len(rows) == len(set(rows)), "a row trained twice"
    assert set(rows) <= set(range(ROWS)) and ROWS - len(rows) < 2
    assert steps[0] == 4 + -(-((ROWS - 4 * 4 * B) // 2) // B)


@pytest.mark.skipif(not CRITEO.is_dir(), reason="shared Criteo samples not present")
def test_the_shared_criteo_sample_streamed_at_4_ranks_goes_on_at_2(tmp_path):
    """The Kaggle sample through CriteoDataModule(streaming=True) (one 16 MiB block: rows dealt one by one), labels
    and dense rows as the audit's key: every row of the file once over the epoch."""
    from lightning_rec import CriteoDataModule

    def loaders(world):
        out = []
        for r in range(world):
            dm = CriteoDataModule(train_path=str(CRITEO / "criteo_kaggle_train_sample.tsv"), batch_size=64,
                                  num_embeddings_per_feature=64, streaming=True)
            dm.setup("fit")
            dm.datasets["train"]._rank, dm.datasets["train"]._world = r, world
            out.append(make_stream_loader(dm.datasets["train"], num_workers=0))
        return out

    def keys(batches):
        return [tuple(row) for b in batches for row in b.dense_features.tolist()]

    seen = []
    before = loaders(4)
    for loader in before:
        seen += keys(itertools.islice(iter(loader), 5))
    states = [loader.state_dict() for loader in before]
    for loader in loaders(2):
        loader.load_state_dict({"ranks": states})
        seen += keys(iter(loader))
    whole = keys(iter(loaders(1)[0]))
    assert sorted(seen) == sorted(whole)  # 4380 rows: 4 * 5 * 64 read before, 1550 after on each of 2 ranks
