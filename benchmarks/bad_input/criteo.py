"""Criteo files (text, gzip, Parquet, datasets objects) and CriteoDataModule's arguments."""

from __future__ import annotations

import contextlib
import gzip
import io
import warnings
from pathlib import Path

from .helpers import DATA, CLIError, criteo_row, criteo_text, parse_all, torch_isfinite, write
from .registry import Skipped, case, expect, simple

SMOKE = ("criteo.empty_file", "criteo.label_two", "criteo.crlf_lines", "criteo.dm_batch_size_zero",
         "more.criteo_nul_bytes")


def criteo_text_cases() -> None:
    """Text rows the parser refuses or reads the same: columns, bytes, line ends, gzip."""
    @case("criteo.empty_file", ValueError, ["empty.tsv", "empty"])
    def _(ctx):
        parse_all(write(ctx.tmp / "empty.tsv", ""))

    @case("criteo.thirty_columns", ValueError, ["cols.tsv", ":3"])
    def _(ctx):
        text = criteo_text(2) + criteo_row(cats=[f"{i:08x}" for i in range(30)]) + "\n"
        parse_all(write(ctx.tmp / "cols.tsv", text))

    @case("criteo.non_hex_category", ValueError, ["nonhex.tsv", ":2", "C3"])
    def _(ctx):
        cats = [f"{i + 1:08x}" for i in range(26)]
        cats[2] = "zz!top"
        parse_all(write(ctx.tmp / "nonhex.tsv", criteo_text(1) + criteo_row(cats=cats) + "\n"))

    @case("criteo.dense_text", ValueError, ["dtext.tsv", ":1", "I4"])
    def _(ctx):
        dense = [str(i) for i in range(13)]
        dense[3] = "abc"
        parse_all(write(ctx.tmp / "dtext.tsv", criteo_row(dense=dense) + "\n" + criteo_text(1)))

    @case("criteo.label_two", ValueError, ["lab.tsv", ":2", "label"])
    def _(ctx):
        parse_all(write(ctx.tmp / "lab.tsv", criteo_text(1) + criteo_row(label="2") + "\n"))

    @case("criteo.crlf_lines", legit="Windows line ends are the same rows")
    def _(ctx):
        table, rep = parse_all(write(ctx.tmp / "crlf.tsv", criteo_text(5).replace("\n", "\r\n")))
        ref, _ = parse_all(write(ctx.tmp / "lf.tsv", criteo_text(5)))
        expect(table.num_rows == 5 and table.equals(ref), "CRLF rows differ from LF rows")

    @case("criteo.gz_file", legit=".gz is read as is (README)")
    def _(ctx):
        p = ctx.tmp / "rows.tsv.gz"
        p.write_bytes(gzip.compress(criteo_text(7).encode()))
        table, _ = parse_all(p)
        ref, _ = parse_all(write(ctx.tmp / "rows.tsv", criteo_text(7)))
        expect(table.equals(ref), "gz rows differ")

    @case("criteo.gz_truncated", (ValueError, OSError, EOFError), ["cut.tsv.gz"])
    def _(ctx):
        data = gzip.compress(criteo_text(400).encode())
        p = ctx.tmp / "cut.tsv.gz"
        p.write_bytes(data[: len(data) // 2])
        parse_all(p)

    @case("criteo.bad_byte_skip_mode_keeps_rest", legit="on_bad_row='skip': the row is counted and skipped, "
          "the rest kept, with a warning")
    def _(ctx):
        text = criteo_text(3).encode() + criteo_row(cats=["\xff\xfe"] + [f"{i:08x}" for i in range(25)]).encode(
            "latin-1") + b"\n" + criteo_text(2).encode()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            table, rep = parse_all(write(ctx.tmp / "byte.tsv", text), on_bad_row="skip")
        expect(table.num_rows == 5, f"{table.num_rows} rows kept, expected 5")
        expect(rep.num_skipped_rows == 1, f"skipped {rep.num_skipped_rows}")

    @case("criteo.bad_byte_error_mode", ValueError, ["byte.tsv", ":4"])
    def _(ctx):
        text = criteo_text(3).encode() + b"0\t\xff" + b"\t1" * 38 + b"\n"
        parse_all(write(ctx.tmp / "byte.tsv", text))


def criteo_parquet(path: Path, n: int = 20, change=None) -> Path:
    """Criteo rows as a Parquet table (int counts, hash strings), `change(table)` applied first."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {"label": pa.array([i % 2 for i in range(n)])}
    cols |= {f"I{j + 1}": pa.array([j] * n) for j in range(13)}
    cols |= {f"C{j + 1}": pa.array([f"{j + 1:08x}"] * n) for j in range(26)}
    table = pa.table(cols)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(change(table) if change else table, path)
    return path


def criteo_table_module(path: Path, ctx, **kw):
    from lightning_rec import CriteoDataModule

    path = str(path) if isinstance(path, Path) else path  # or a datasets.Dataset
    dm = CriteoDataModule(train_path=path, batch_size=8, cache_dir=str(ctx.tmp / "c"),
                          num_embeddings_per_feature=100, **kw)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def criteo_dataset(ctx, n: int = 20):
    import datasets
    import pyarrow.parquet as pq

    return datasets.Dataset(pq.read_table(criteo_parquet(ctx.tmp / "dataset.parquet", n)))


def criteo_table_cases() -> None:
    """Parquet tables: bad rows name the file and row, the same rows as text."""
    @case("criteo.parquet_label_two", ValueError, ["lab.parquet", "row 3", "label", "on_bad_row"])
    def _(ctx):
        import pyarrow as pa

        labels = pa.array([0, 1, 0, 2] + [0] * 16)
        criteo_table_module(criteo_parquet(ctx.tmp / "lab.parquet", change=lambda t: t.set_column(0, "label", labels)),
                            ctx)

    @case("criteo.parquet_missing_columns", ValueError, ["cols.parquet", "'C26'", "rename"])
    def _(ctx):
        criteo_table_module(criteo_parquet(ctx.tmp / "cols.parquet", change=lambda t: t.drop_columns(["C26"])), ctx)

    @case("criteo.parquet_streaming_bad_row", ValueError, ["stream.parquet", "row 17", "label", "on_bad_row"])
    def _(ctx):
        import pyarrow as pa

        labels = pa.array([0] * 17 + [3] + [1] * 2)
        dm = criteo_table_module(criteo_parquet(ctx.tmp / "stream.parquet",
                                                change=lambda t: t.set_column(0, "label", labels)), ctx, streaming=True)
        list(dm.train_dataloader())

    @case("criteo.parquet_negative_id", ValueError, ["neg.parquet", "row 0", "C1", "-5"])
    def _(ctx):
        import pyarrow as pa

        ids = pa.array([-5] + [1] * 19)
        criteo_table_module(criteo_parquet(ctx.tmp / "neg.parquet", change=lambda t: t.set_column(14, "C1", ids)), ctx)

    @case("criteo.parquet_same_as_text", legit="a table holds the same rows as the text file")
    def _(ctx):
        text = criteo_table_module(write(ctx.tmp / "rows.tsv", criteo_text(20)), ctx)
        table = criteo_table_module(criteo_parquet(ctx.tmp / "rows.parquet"), ctx)
        a, b = (next(iter(m.train_dataloader())) for m in (text, table))
        expect(a.labels.tolist() == b.labels.tolist() and a.sparse_features.values().tolist()
               == b.sparse_features.values().tolist(), "the Parquet rows differ from the text rows")


def criteo_file_cases() -> None:
    """Paths that are not files, a header alone, dense values, short last lines."""
    @case("criteo.directory_as_file", ValueError, ["directory"])
    def _(ctx):
        (ctx.tmp / "dir.tsv").mkdir()
        parse_all(ctx.tmp / "dir.tsv")

    @case("criteo.missing_file", (ValueError, FileNotFoundError), ["nope.tsv"])
    def _(ctx):
        parse_all(ctx.tmp / "nope.tsv")

    @case("criteo.kaggle_header_only", ValueError, ["hdr.csv"], ok=True,
          legit="a header without rows is an empty split: zero rows")
    def _(ctx):
        hdr = "Id,Label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))
        table, rep = parse_all(write(ctx.tmp / "hdr.csv", hdr + "\n"))
        expect(table is None or table.num_rows == 0, "rows from a header-only file")

    @case("criteo.negative_dense_values_stay_finite",
          legit="Criteo's dense columns hold -1/-2: the transform must stay finite")
    def _(ctx):
        from lightning_rec.data.criteo import CriteoDataset, build_criteo_cache
        dense = ["-2", "-1", "0", "1e12"] + [str(i) for i in range(9)]
        p = write(ctx.tmp / "neg.tsv", "".join(criteo_row(label=str(i % 2), dense=dense) + "\n" for i in range(4)))
        arrow, _ = build_criteo_cache(p, cache_dir=ctx.tmp / "cache")
        ds = CriteoDataset(arrow, 100)
        b = ds.__getitems__([0, 1, 2, 3])
        expect(bool(torch_isfinite(b.dense_features)), f"dense features {b.dense_features[0].tolist()}")

    @case("criteo.short_last_line_warns", legit="a short last row (no trailing separator): padded with missing "
          "values, counted and warned (criteo.py: trailing empty fields stripped, as in some copies of train.txt)")
    def _(ctx):
        text = criteo_text(3) + "1\t1\t2\t3"
        import logging
        records = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = records.append
        logger = logging.getLogger("lightning_rec")
        logger.addHandler(handler)
        try:
            table, rep = parse_all(write(ctx.tmp / "cut.tsv", text), on_bad_row="skip")
            rep.log_skips()  # what the data modules call at the end of a file
        finally:
            logger.removeHandler(handler)
        expect((table.num_rows, rep.num_skipped_rows) == (3, 1) or (table.num_rows, rep.num_padded_rows) == (4, 1),
               f"{table.num_rows} rows, report {rep}")
        expect(any("cut.tsv" in r.getMessage() for r in records), "no logged warning naming the cut file")

    @case("criteo.last_line_cut_after_tab", ValueError, ["cutab.tsv", ":4"])
    def _(ctx):
        parse_all(write(ctx.tmp / "cutab.tsv", criteo_text(3) + "1\t1\t2\t"))


def criteo_datamodule_cases() -> None:
    """CriteoDataModule's arguments, files without labels, the real sample."""
    from lightning_rec import CriteoDataModule

    simple("criteo.dm_on_bad_row_drop", lambda: CriteoDataModule(on_bad_row="drop"), ValueError, ["'drop'", "skip"])
    simple("criteo.dm_missing_categorical_bad", lambda: CriteoDataModule(missing_categorical="zero"), ValueError,
           ["'zero'", "reserved_id"])
    simple("criteo.dm_25_table_sizes", lambda: CriteoDataModule(num_embeddings_per_feature=[10] * 25), ValueError,
           ["26", "25"])
    simple("criteo.dm_parser_unknown", lambda: CriteoDataModule(parser="rust"), ValueError, ["'rust'", "native"])
    simple("criteo.dm_batch_size_zero", lambda: CriteoDataModule(batch_size=0), ValueError, ["batch_size"])
    simple("criteo.dm_table_size_zero", lambda: CriteoDataModule(num_embeddings_per_feature=0), ValueError,
           ["num_embeddings"])

    @case("criteo.dm_unlabelled_train_file", ValueError, ["label", "train"], timeout=40)
    def _(ctx):
        p = write(ctx.tmp / "test_nolabel.tsv", "".join(criteo_row(label=None) + "\n" for _ in range(8)))
        dm = CriteoDataModule(train_path=str(p), batch_size=4, cache_dir=str(ctx.tmp / "c"),
                              num_embeddings_per_feature=100)
        dm.setup("fit")
        next(iter(dm.train_dataloader()))

    @case("criteo.dm_train_path_missing", (ValueError, FileNotFoundError), ["missing.tsv"], timeout=40)
    def _(ctx):
        dm = CriteoDataModule(train_path=str(ctx.tmp / "missing.tsv"), batch_size=4, cache_dir=str(ctx.tmp / "c"))
        dm.prepare_data()
        dm.setup("fit")

    @case("criteo.real_sample_streaming_equals_cached", timeout=60)
    def _(ctx):
        src = DATA / "criteo" / "criteo_kaggle_valid_sample.tsv"
        if not src.exists():
            raise Skipped(f"{src} is absent")
        lines = src.read_text().splitlines(keepends=True)[:300]
        p = write(ctx.tmp / "s.tsv", "".join(lines))
        out = []
        for streaming in (False, True):
            dm = CriteoDataModule(train_path=str(p), batch_size=64, cache_dir=str(ctx.tmp / "c"), streaming=streaming,
                                  shuffle=False, num_embeddings_per_feature=1000)
            dm.prepare_data()
            dm.setup("fit")
            out.append(sum(int(b.labels.numel()) for b in dm.train_dataloader()))
        expect(out[0] == out[1] == 300, f"rows cached / streaming {out}")


def criteo_dataset_cases() -> None:
    """A Hub data folder, DatasetDict / IterableDataset / Dataset objects."""
    from lightning_rec import CriteoDataModule

    @case("criteo.parquet_hub_data_folder", ValueError, ["several splits", "train-*.parquet"])
    def _(ctx):
        d = ctx.tmp / "data"
        for name in ("train-00000-of-00001.parquet", "test-00000-of-00001.parquet"):
            criteo_parquet(d / name)
        criteo_table_module(d, ctx)
    @case("criteo.dataset_dict_object", ValueError, ["DatasetDict", "pass one split", "ds['train']"])
    def _(ctx):
        import datasets

        CriteoDataModule(train_path=datasets.DatasetDict({"train": criteo_dataset(ctx), "test": criteo_dataset(ctx)}))

    @case("criteo.iterable_dataset_object", ValueError, ["IterableDataset", "pass its files", "streaming=True"])
    def _(ctx):
        CriteoDataModule(train_path=criteo_dataset(ctx).to_iterable_dataset())

    @case("criteo.dataset_object_bad_label", ValueError, ["data.parquet", "row 3", "label", "on_bad_row"])
    def _(ctx):
        ds = criteo_dataset(ctx)
        criteo_table_module(ds.map(lambda r, i: {"label": 2 if i == 3 else r["label"]}, with_indices=True), ctx)

    @case("criteo.dataset_object_same_as_text", legit="a datasets.Dataset gives the rows of its text file")
    def _(ctx):
        text = criteo_table_module(write(ctx.tmp / "rows.tsv", criteo_text(20)), ctx)
        rows = criteo_dataset(ctx).add_column("row", list(range(20)))
        table = criteo_table_module(rows.shuffle(seed=0).sort("row"), ctx)  # two index mappings: the same order
        a, b = (next(iter(m.train_dataloader())) for m in (text, table))
        expect(a.labels.tolist() == b.labels.tolist() and a.sparse_features.values().tolist()
               == b.sparse_features.values().tolist(), "the Dataset's rows differ from the text rows")


def more_criteo_cases() -> None:
    """Second wave: binary junk, NUL bytes, a 10 MB line, a BOM, float labels, quotes."""
    # files
    @case("more.criteo_binary_file", ValueError, ["junk.bin"])
    def _(ctx):
        import random
        rnd = random.Random(0)
        parse_all(write(ctx.tmp / "junk.bin", bytes(rnd.randrange(256) for _ in range(5000))))

    @case("more.criteo_nul_bytes", ValueError, ["nul.tsv", ":2"])
    def _(ctx):
        second = criteo_row().replace("\t3\t", "\t\x00\t", 1)
        parse_all(write(ctx.tmp / "nul.tsv", (criteo_text(1) + second + "\n").encode()))

    @case("more.criteo_one_10mb_line", ValueError, ["long.tsv", ":1"], timeout=30)
    def _(ctx):
        parse_all(write(ctx.tmp / "long.tsv", "0\t" + "1" * (10 << 20) + "\n"))

    @case("more.criteo_bom_first_line", ValueError, ["bom.tsv"], ok=True,
          legit="a UTF-8 byte-order mark before the first row may be skipped: same rows")
    def _(ctx):
        table, _ = parse_all(write(ctx.tmp / "bom.tsv", b"\xef\xbb\xbf" + criteo_text(3).encode()))
        ref, _ = parse_all(write(ctx.tmp / "ref.tsv", criteo_text(3)))
        expect(table.equals(ref), "rows after a BOM differ")

    @case("more.criteo_label_float_text", ValueError, ["lf.tsv", "label"], ok=True,
          legit="'1.0' is the label 1")
    def _(ctx):
        table, _ = parse_all(write(ctx.tmp / "lf.tsv", criteo_row(label="1.0") + "\n" + criteo_row(label="0.0") + "\n"))
        ref, _ = parse_all(write(ctx.tmp / "ref.tsv", criteo_row(label="1") + "\n" + criteo_row(label="0") + "\n"))
        expect(table.equals(ref), "labels '1.0'/'0.0' read differently from 1/0")

    @case("more.criteo_kaggle_quoted_csv", ValueError, ["q.csv", "quoted", "sed"], ok=True,
          legit="quoted rows may be read as unquoted (same rows), or refused with the fix (the project's choice)")
    def _(ctx):
        hdr = "Id,Label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))
        row = ",".join(f'"{x}"' for x in ["10000000", "1"] + [str(i) for i in range(13)] +
                       [f"{i + 1:08x}" for i in range(26)])
        table, _ = parse_all(write(ctx.tmp / "q.csv", hdr + "\n" + row + "\n"))
        plain = ",".join(["10000000", "1"] + [str(i) for i in range(13)] + [f"{i + 1:08x}" for i in range(26)])
        ref, _ = parse_all(write(ctx.tmp / "p.csv", hdr + "\n" + plain + "\n"))
        expect(table.equals(ref), "quoted Kaggle CSV rows differ from unquoted")


def preprocess_cases() -> None:
    """`lightning-rec preprocess`: a missing vocabulary; its shards train."""
    @case("more.preprocess_vocab_from_missing", CLIError, ["--vocab_from", "nowhere_vocab", "vocab.npz"])
    def _(ctx):
        from lightning_rec.cli import preprocess_main
        p = write(ctx.tmp / "d.tsv", criteo_text(10))
        ctx.after(lambda: expect(not (ctx.tmp / "o").exists(), "a refused run left an output directory"))
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                preprocess_main(["--input", str(p), "--output_dir", str(ctx.tmp / "o"), "--num_embeddings", "100",
                                 "--vocab_from", str(ctx.tmp / "nowhere_vocab")])
            except SystemExit as e:  # the command's one-line error, as the user sees it
                raise CLIError(err.getvalue() or f"exit {e.code}") from None

    @case("more.preprocess_then_train_shapes", timeout=60, legit="preprocess -> CriteoDataModule on the directory")
    def _(ctx):
        from lightning_rec import CriteoDataModule
        from lightning_rec.cli import preprocess_main
        p = write(ctx.tmp / "d.tsv", criteo_text(50))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            preprocess_main(["--input", str(p), "--output_dir", str(ctx.tmp / "o"), "--num_embeddings", "100"])
        dm = CriteoDataModule(train_path=str(ctx.tmp / "o"), batch_size=16, num_embeddings_per_feature=100)
        dm.setup("fit")
        n = sum(int(b.labels.numel()) for b in dm.train_dataloader())
        expect(n == 50, f"{n} rows from 50")

    def preprocessed(ctx) -> Path:
        from lightning_rec.cli import preprocess_main
        p = write(ctx.tmp / "d.tsv", criteo_text(50))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            preprocess_main(["--input", str(p), "--output_dir", str(ctx.tmp / "o"), "--num_embeddings", "100"])
        return ctx.tmp / "o"

    def read_all(directory: Path) -> int:
        from lightning_rec import CriteoDataModule
        dm = CriteoDataModule(train_path=str(directory), batch_size=16, num_embeddings_per_feature=100)
        dm.setup("fit")
        return sum(int(b.labels.numel()) for b in dm.train_dataloader())

    @case("more.preprocess_shard_npy_cut_short", ValueError, [".dense.npy", "damaged or incomplete",
                                                             "rerun the `lightning-rec preprocess`"], timeout=60)
    def _(ctx):
        out = preprocessed(ctx)
        npy = next(out.glob("*.dense.npy"))
        npy.write_bytes(npy.read_bytes()[: npy.stat().st_size // 2])  # a partial copy
        read_all(out)

    @case("more.preprocess_manifest_cut_short", ValueError, ["manifest.json", "damaged or incomplete",
                                                            "rerun the `lightning-rec preprocess`"], timeout=60)
    def _(ctx):
        out = preprocessed(ctx)
        (out / "manifest.json").write_text((out / "manifest.json").read_text()[:100])
        read_all(out)


CASES = (criteo_text_cases, criteo_table_cases, criteo_file_cases, criteo_datamodule_cases, criteo_dataset_cases,
         more_criteo_cases, preprocess_cases)
