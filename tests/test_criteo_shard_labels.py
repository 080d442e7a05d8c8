"""`lightning-rec preprocess --label_columns`: shards holding labels [n, T] by task (shard format /2), read back as
`Batch.labels` [B, T] with task names, the labels the text readers give; one-label directories unchanged (format /1);
an epoch continued at another world size carries the tasks' labels with its rows; the tasks a data module asks for
checked against the directory's."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from lightning_rec.cli import preprocess_main
from lightning_rec.data import CriteoDataModule
from lightning_rec.data.batch import make_stream_loader
from lightning_rec.data.criteo.shards import SHARD_FORMAT, SHARD_FORMAT_TASKS, CriteoShardDataset
from lightning_rec.data.criteo_parse import native_parser_available
from lightning_rec.data.preprocess import preprocess_criteo

pytestmark = pytest.mark.skipif(not native_parser_available(), reason="lightning_rec._C is not built")
TASKS = {"click": "click", "bought": "purchase == 1", "watch": "watch"}
FEATURES = [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]


def _row(k: int) -> str:
    """Row k: click k % 2, purchase empty when k % 5 == 0 (no label) else k % 3 == 0, watch k / 4; I1 = k."""
    purchase = "" if k % 5 == 0 else str(int(k % 3 == 0))
    return "\t".join([str(k % 2), purchase, str(k / 4), str(k), *map(str, range(2, 14)),
                      *(f"{j:08x}" for j in range(1, 27))]) + "\n"


def _labels(k: np.ndarray) -> np.ndarray:
    """What TASKS give row k: [click, bought, watch]."""
    bought = np.where(k % 5 == 0, np.nan, (k % 3 == 0).astype(float))
    return np.stack([k % 2, bought, k / 4], axis=1).astype(np.float32)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("shard_labels")
    (d / "a.tsv").write_text("".join(_row(k) for k in range(57)))
    (d / "b.tsv").write_text("".join(_row(k) for k in range(57, 100)))
    return d


def _rows(directory, **kw) -> tuple[np.ndarray, np.ndarray, set]:
    """(row ids [N] (I1), labels [N, T]) of every batch of a directory, and the batches' task names."""
    batches = list(CriteoShardDataset(directory, 16, **kw))
    ids = torch.cat([b.dense_features[:, 0] for b in batches]).expm1().round().long().numpy()
    return ids, torch.cat([b.labels for b in batches]).numpy(), {b.task_names for b in batches}


def test_shards_hold_the_tasks_labels_of_the_text_read(files, tmp_path):
    out = tmp_path / "out"
    manifest = preprocess_criteo([files / "a.tsv", files / "b.tsv"], out, num_embeddings=50, rows_per_shard=20,
                                 block_mb=1, progress=False, label_columns=TASKS)
    assert manifest["format"] == SHARD_FORMAT_TASKS and manifest["task_names"] == list(TASKS)
    assert all(s["tasks"] == 3 for s in manifest["shards"])
    ids, labels, names = _rows(out)
    assert sorted(ids) == list(range(100)) and names == {tuple(TASKS)}
    np.testing.assert_array_equal(labels, _labels(ids))  # NaN where bought has no label; watch real-valued
    # the same rows and labels as the text read (the cache path), row for row
    dm = CriteoDataModule(train_path=str(files / "a.tsv"), batch_size=57, shuffle=False, cache_dir=str(tmp_path / "c"),
                          num_embeddings_per_feature=50, label_columns=TASKS)
    dm.setup("fit")
    [text] = list(dm.train_dataloader())
    [batch] = list(CriteoShardDataset(out, 100))
    order = torch.from_numpy(np.argsort(batch.dense_features[:, 0].numpy(), kind="stable")[:57])  # rows 0..56
    np.testing.assert_array_equal(batch.labels[order].numpy(), text.labels.numpy())
    # log1p of the same count: the op's libm and the batch path's numpy may round the last bit differently
    torch.testing.assert_close(batch.dense_features[order], text.dense_features, rtol=1e-6, atol=0)
    again = preprocess_criteo([files / "a.tsv", files / "b.tsv"], out, num_embeddings=50, rows_per_shard=20,
                              block_mb=1, progress=False, label_columns=TASKS)  # resumed: every shard verified
    assert again["shards"] == manifest["shards"]


def _one_label_file(tmp_path):
    """30 rows of click, I1..I13, C1..C26."""
    path = tmp_path / "one.tsv"
    path.write_text("".join("\t".join([ln.split("\t")[0], *ln.split("\t")[3:]]) for ln in map(_row, range(30))))
    return path


def test_one_label_directories_keep_format_1(tmp_path):
    manifest = preprocess_criteo([_one_label_file(tmp_path)], tmp_path / "out", num_embeddings=50, progress=False)
    assert manifest["format"] == SHARD_FORMAT and "task_names" not in manifest and "labels" not in manifest
    assert "tasks" not in manifest["shards"][0] and "label_columns" not in manifest["options"]
    [batch] = list(CriteoShardDataset(tmp_path / "out", 64))
    assert batch.labels.shape == (30,) and batch.task_names is None
    assert np.load(tmp_path / "out" / "shard-000-00000.label.npy").shape == (30,)


def test_an_epoch_continued_at_another_world_size_carries_each_rows_labels(files, tmp_path):
    out = tmp_path / "out"
    preprocess_criteo([files / "a.tsv", files / "b.tsv"], out, num_embeddings=50, rows_per_shard=1, progress=False,
                      label_columns=TASKS)

    def loaders(world):
        return [make_stream_loader(CriteoShardDataset(out, 4, shuffle=True, seed=3, rank=r, world_size=world),
                                   num_workers=0) for r in range(world)]

    seen = []
    before = loaders(4)
    for loader in before:  # 2 steps at 4 ranks
        it = iter(loader)
        seen += [next(it) for _ in range(2)]
    states = [loader.state_dict() for loader in before]
    for loader in loaders(2):
        loader.load_state_dict({"ranks": states})
        seen += list(loader)
    ids = torch.cat([b.dense_features[:, 0] for b in seen]).expm1().round().long().numpy()
    assert len(set(ids)) == len(ids) > 90 and all(b.task_names == tuple(TASKS) for b in seen)
    np.testing.assert_array_equal(torch.cat([b.labels for b in seen]).numpy(), _labels(ids))


def test_data_module_trains_on_task_shards_and_checks_the_tasks(files, tmp_path):
    import lightning.pytorch as pl

    from lightning_rec.models import MultiTaskModule

    out = tmp_path / "out"
    preprocess_criteo([files / "a.tsv"], out, num_embeddings=50, progress=False, label_columns=TASKS)
    dm = CriteoDataModule(train_path=str(out), batch_size=16, num_embeddings_per_feature=50, label_columns=TASKS)
    model = MultiTaskModule(task_names=list(TASKS), task_types=["binary", "binary", "regression"],
                            num_embeddings_per_feature={f"C{i}": 50 for i in range(1, 27)}, embedding_dim=4,
                            dense_in_features=13, dense_arch_layer_sizes=[4])
    trainer = pl.Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(model, dm)
    assert trainer.global_step == 3
    for columns, match in [(None, r"preprocessed with label_columns=\{'click': 'click', 'bought': 'purchase == 1', "
                                  r"'watch': 'watch'\} \(tasks \['click', 'bought', 'watch'\]\) and holds those labels "
                                  r"only: pass the same label_columns="),
                           (["click", "purchase"], "preprocessed with label_columns=")]:
        with pytest.raises(ValueError, match=match):
            CriteoDataModule(train_path=str(out), num_embeddings_per_feature=50, label_columns=columns).setup("fit")
    one = tmp_path / "one"
    preprocess_criteo([_one_label_file(tmp_path)], one, num_embeddings=50, progress=False)
    with pytest.raises(ValueError, match="is preprocessed with one label column: preprocess the files again with "
                                         "--label_columns"):
        CriteoDataModule(train_path=str(one), num_embeddings_per_feature=50, label_columns=TASKS).setup("fit")


def test_cli_label_columns_and_misspelt_columns(files, tmp_path, capsys):
    header = tmp_path / "h.tsv"
    header.write_text("\t".join(["click", "purchase", "watch", *FEATURES]) + "\n" + "".join(map(_row, range(40))))
    manifest = preprocess_main(["--input", str(header), "--output_dir", str(tmp_path / "o1"), "--num_embeddings", "50",
                                "--no_progress", "--label_columns", "click", "watch"])
    assert manifest["task_names"] == ["click", "watch"]
    assert "--data.label_columns='[\"click\", \"watch\"]'" in capsys.readouterr().out
    manifest = preprocess_main(["--input", str(header), "--output_dir", str(tmp_path / "o2"), "--num_embeddings", "50",
                                "--no_progress", "--label_columns", json.dumps(TASKS),
                                "--label_masks", '{"watch": "I2"}'])
    ids, labels, _ = _rows(tmp_path / "o2")
    np.testing.assert_array_equal(labels, _labels(ids))
    assert manifest["options"]["label_masks"] == {"watch": "I2"}
    for args, match in [(["--label_columns", "click", "purchases"],
                         r"reads column 'purchases', which is not there \(did you mean 'purchase'\?\): its columns "
                         r"are \['click', 'purchase', 'watch', 'I1'"),
                        (["--label_columns", "{click"], r"--label_columns \{click: give a JSON mapping"),
                        (["--label_columns", "click", "--label_masks", "I2"], "--label_masks I2: give a JSON mapping")]:
        with pytest.raises(SystemExit):
            preprocess_main(["--input", str(header), "--output_dir", str(tmp_path / "o3"), "--num_embeddings", "50",
                             "--no_progress", *args])
        assert re.search(match, capsys.readouterr().err)
    with pytest.raises(ValueError, match=r"rows have 42 fields, not 43 \(the 4 label columns"):
        preprocess_criteo([files / "a.tsv"], tmp_path / "o4", num_embeddings=50, progress=False,
                          label_columns=[*TASKS, "view"])


def test_a_table_input_gives_the_labels_of_its_text(tmp_path):
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    header = tmp_path / "h.tsv"
    header.write_text("\t".join(["click", "purchase", "watch", *FEATURES]) + "\n" + "".join(map(_row, range(40))))
    hex_columns = pacsv.ConvertOptions(column_types={f"C{i}": pa.string() for i in range(1, 27)})
    table = pacsv.read_csv(header, parse_options=pacsv.ParseOptions(delimiter="\t"), convert_options=hex_columns)
    pq.write_table(table, tmp_path / "h.parquet")
    manifests = [preprocess_criteo([path], tmp_path / path.suffix[1:], num_embeddings=50, progress=False,
                                   label_columns=TASKS) for path in (header, tmp_path / "h.parquet")]
    assert manifests[0]["has_label"] and manifests[1]["has_label"]
    (ids_t, labels_t, _), (ids_p, labels_p, _) = _rows(tmp_path / "tsv"), _rows(tmp_path / "parquet")
    np.testing.assert_array_equal(labels_t, _labels(ids_t))
    np.testing.assert_array_equal(labels_p, _labels(ids_p))
