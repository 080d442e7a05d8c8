"""A preprocessed Criteo directory's epoch begun at N ranks and continued at M (data/elastic.py through
CriteoShardDataset): a row-id audit over the epoch. Each row is named by its I1 (dense column 0 = log1p(I1)).

Every row the N-rank epoch would read is read once: none twice, and the only ones missed are the continued epoch's
remainder (fewer than M rows: each rank reads the same share; under drop_last also each rank's last partial batch,
fewer than M * B rows). The next epoch is an ordinary M-rank one."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
from dist_utils import run_ranks

from lightning_rec.data.batch import make_stream_loader
from lightning_rec.data.criteo.shards import CriteoShardDataset
from lightning_rec.data.criteo_parse import native_parser_available
from lightning_rec.data.preprocess import preprocess_criteo

pytestmark = pytest.mark.skipif(not native_parser_available(), reason="lightning_rec._C is not built")
B = 4


def _row(k: int) -> str:
    return "\t".join([str(k % 2), str(k)] + [str(j) for j in range(2, 14)] + [f"{j:08x}" for j in range(1, 27)]) + "\n"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("elastic")
    files, start = [], 0
    for j, n in enumerate([37, 20, 44]):  # a shard per input, of uneven sizes
        files.append(tmp / f"in{j}.tsv")
        files[-1].write_text("".join(_row(k) for k in range(start, start + n)))
        start += n
    preprocess_criteo([str(f) for f in files], tmp / "out", num_embeddings=10, rows_per_shard=1, progress=False)
    return tmp / "out"


def _loaders(directory, world, drop_last, **kw):
    return [make_stream_loader(CriteoShardDataset(directory, B, shuffle=True, seed=3, drop_last=drop_last, rank=r,
                                                  world_size=world, **kw), num_workers=0) for r in range(world)]


def _ids(batch) -> list[int]:
    return [round(float(x)) for x in batch.dense_features[:, 0].expm1()]


def _read(loader, batches=None) -> tuple[list[int], list]:
    """The rows of the loader's next `batches` batches (all: None), and the iterator (left open)."""
    it, rows = iter(loader), []
    for i, batch in enumerate(it):
        rows += _ids(batch)
        if batches is not None and i + 1 == batches:
            break
    return rows, it


def _epoch_rows(directory, world, drop_last, epoch=0) -> list[int]:
    """The rows an uninterrupted epoch reads at `world` ranks."""
    rows = []
    for loader in _loaders(directory, world, drop_last):
        loader.dataset.set_epoch(epoch)
        rows += [i for batch in loader.dataset for i in _ids(batch)]
    return rows


@pytest.mark.parametrize("N,M,steps", [(4, 2, 2), (2, 3, 3), (3, 1, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_an_epoch_begun_at_n_ranks_reads_every_row_once_at_m(shards, N, M, steps, drop_last):
    epoch_rows = _epoch_rows(shards, N, drop_last)
    assert len(set(epoch_rows)) == len(epoch_rows)
    before = _loaders(shards, N, drop_last)
    read = []
    for loader in before:
        read += _read(loader, steps)[0]
    states = [loader.state_dict() for loader in before]
    after = _loaders(shards, M, drop_last)
    for loader in after:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "starts over" warning
            loader.load_state_dict({"ranks": states})
        rows, _ = _read(loader)
        read += rows
        assert len(loader) >= steps + -(-len(rows) // B)  # Lightning sizes the epoch from it
    assert len(read) == len(set(read)), "a row read twice"
    assert set(read) <= set(epoch_rows)
    missed = set(epoch_rows) - set(read)
    assert len(missed) < (M * B if drop_last else M), (len(missed), M)
    # the next epoch: an ordinary one at M ranks
    nxt = []
    for loader in after:
        nxt += _read(loader)[0]
    assert sorted(nxt) == sorted(_epoch_rows(shards, M, drop_last, epoch=1))


def test_a_continued_epoch_checkpointed_again_continues_at_a_third_world_size(shards):
    """4 -> 2 mid-epoch, then 2 -> 3 mid-way through the continued epoch: still every row once."""
    epoch_rows = _epoch_rows(shards, 4, False)
    first, read = _loaders(shards, 4, False), []
    for loader in first:
        read += _read(loader, 1)[0]
    second = _loaders(shards, 2, False)
    states = [loader.state_dict() for loader in first]
    for loader in second:
        loader.load_state_dict({"ranks": states})
        read += _read(loader, 3)[0]  # 1 step counted before, 2 of the continued epoch
    states = [loader.state_dict() for loader in second]
    assert states[0]["elastic"]["order_world"] == 4
    for loader in _loaders(shards, 3, False):
        loader.load_state_dict({"ranks": states})
        read += _read(loader)[0]
    assert len(read) == len(set(read)) and set(read) <= set(epoch_rows)
    assert len(set(epoch_rows) - set(read)) < 2 + 3


def test_a_changed_shard_set_or_an_old_state_starts_the_epoch_over_with_a_warning(shards, tmp_path):
    before = _loaders(shards, 2, False)
    for loader in before:
        _read(loader, 1)
    states = [loader.state_dict() for loader in before]
    old = [{k: v for k, v in s.items() if k != "elastic"} for s in states]
    for saved, words in ((old, "older version"), (states, "does not belong")):
        other = _loaders(shards, 3, False)[0]
        if words == "does not belong":
            other.dataset.manifest = {**other.dataset.manifest, "shards": other.dataset.manifest["shards"][:2]}
        with pytest.warns(UserWarning, match=words):
            other.load_state_dict({"ranks": saved})
        assert len(_read(other)[0]) > 0


def test_a_same_world_state_saved_before_shards_had_an_id_resumes_exactly(shards):
    """A shard directory's loader state from before its dataset recorded an id (fingerprint dataset_id None, no
    elastic record): at the same world size it resumes where it was, without a warning. The new id once read as
    "dataset_id differ" and restarted the epoch."""
    import warnings

    first = _loaders(shards, 2, False)
    open_iters = [_read(loader, 1)[1] for loader in first]
    states = [loader.state_dict() for loader in first]
    rest = [[i for batch in it for i in _ids(batch)] for it in open_iters]
    old = [{**{k: v for k, v in s.items() if k != "elastic"}, "fingerprint": {**s["fingerprint"], "dataset_id": None}}
           for s in states]
    again = _loaders(shards, 2, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for loader in again:
            loader.load_state_dict({"ranks": old})
    assert [_read(loader)[0] for loader in again] == rest


# a real fit: SIGKILL at 4 ranks mid-epoch, resumed at 2 -------------------------------------------------------


def _fit_rank(rank, world_size, root, directory, kill_at, resume):
    from test_elastic_resume import fit_criteo_rows

    return fit_criteo_rows(rank, world_size, root, kill_at, resume, _ids, train_path=str(directory), batch_size=B)


def test_sigkill_mid_epoch_at_4_ranks_resumed_at_2_trains_every_row_of_the_epoch_once(shards, tmp_path):
    """Killed at step 3 of 6 (the last checkpoint: step 2), resumed at 2 ranks through Trainer(strategy='rec')."""
    root = str(tmp_path)
    assert run_ranks(_fit_rank, 4, root, str(shards), 3, False, timeout=120, allow_missing=True) == [None] * 4
    run_ranks(_fit_rank, 2, root, str(shards), None, True, timeout=120)
    rows: list[int] = []
    for name in sorted(os.listdir(root)):
        if name.startswith("rows."):
            for line in Path(root, name).read_text().splitlines():
                step, *ids = map(int, line.split())
                if name.startswith("rows.b") or step < 2:  # the killed run's steps after its last checkpoint redo
                    rows += ids
    epoch_rows = _epoch_rows(shards, 4, False)
    assert len(rows) == len(set(rows)), "a row trained twice"
    assert set(rows) <= set(epoch_rows) and len(set(epoch_rows) - set(rows)) < 2
