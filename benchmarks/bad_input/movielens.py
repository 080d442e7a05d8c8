"""MovieLens folders, rating files, splits and datasets objects."""

from __future__ import annotations

import warnings

from .helpers import DATA, write
from .registry import Skipped, case, expect, simple

SMOKE = ("ml.split_unknown", "ml.udata_bad_row", "ml.string_ids", "more.movielens_ml1m_colons")


def movielens_file_cases() -> None:
    """Folders and rating files MovieLensDataModule refuses or reads."""
    from lightning_rec import MovieLensDataModule

    # MovieLens
    @case("ml.empty_folder", (ValueError, FileNotFoundError), ["u.data", "ratings"])
    def _(ctx):
        (ctx.tmp / "ml").mkdir()
        MovieLensDataModule(str(ctx.tmp / "ml")).setup("fit")

    simple("ml.split_unknown", lambda: MovieLensDataModule("x", split="80/20"), ValueError, ["'80/20'", "ro_811"])
    simple("ml.negatives_two", lambda: MovieLensDataModule("x", num_negatives=2), ValueError, ["num_negatives=2"])
    simple("ml.min_rating_text", lambda: MovieLensDataModule("x", min_rating="4"), ValueError,
           ["min_rating='4'", "give a number"])
    simple("ml.batch_size_zero", lambda: MovieLensDataModule("x", batch_size=0), ValueError, ["batch_size"])

    @case("ml.udata_bad_row", ValueError, ["u.data", ":3"], timeout=40)
    def _(ctx):
        d = ctx.tmp / "ml-bad"
        write(d / "u.data", "1\t1\t5\t881250949\n2\t3\t4\t881250950\nx\ty\tz\tw\n")
        MovieLensDataModule(str(d), side_features=False).setup("fit")

    @case("ml.ratings_csv_missing_column", ValueError, ["ratings.csv", "movieId"], timeout=40)
    def _(ctx):
        d = ctx.tmp / "ml-csv"
        write(d / "ratings.csv", "userId,rating,timestamp\n1,5,1\n2,4,2\n")
        MovieLensDataModule(str(d), side_features=False).setup("fit")

    @case("ml.leave_one_out_without_timestamps", ValueError, ["split='loo'", "no timestamp", "ro_811"], timeout=40)
    def _(ctx):
        d = ctx.tmp / "ml-untimed"
        write(d / "ratings.csv", "user,item,rating\n1,2,5\n1,3,4\n1,4,5\n")
        MovieLensDataModule(str(d), split="loo", side_features=False).setup("fit")

    @case("ml.parquet_list_ids", ValueError, ["ratings.parquet", "'item'", "integers or strings"], timeout=40)
    def _(ctx):
        import pyarrow as pa
        import pyarrow.parquet as pq

        d = ctx.tmp / "ml-pq"
        d.mkdir()
        pq.write_table(pa.table({"user": [1, 1, 2], "item": [[1], [2], [1]]}), d / "ratings.parquet")
        MovieLensDataModule(str(d), side_features=False).setup("fit")

    @case("ml.string_ids", legit="shop logs name users and items by strings: kept as the data's own ids")
    def _(ctx):
        d = ctx.tmp / "ml-str"
        write(d / "ratings.csv", "user,item,rating\n" + "".join(f"u{u},B0{i:03d},1\n" for u in range(6)
                                                                 for i in range(u, u + 5)))
        dm = MovieLensDataModule(str(d), side_features=False)
        dm.setup("fit")
        expect(dm.user_ids.tolist() == [f"u{u}" for u in range(6)] and dm.report.num_interactions == 30,
               f"ids {dm.user_ids.tolist()}, {dm.report.num_interactions} interactions")


def movielens_split_cases() -> None:
    """DatasetDict objects, split='given' files, min_rating on the real data."""
    from lightning_rec import MovieLensDataModule

    @case("ml.dataset_dict_object", ValueError, ["data_dir", "DatasetDict", "pass one split"])
    def _(ctx):
        import datasets

        rows = datasets.Dataset.from_dict({"user": [1, 2], "item": [3, 4]})
        MovieLensDataModule(datasets.DatasetDict({"train": rows}))

    @case("ml.given_without_test_file", ValueError, ["split='given'", "train and a test file", "(no test file)"])
    def _(ctx):
        d = ctx.tmp / "given"
        write(d / "shop.train.csv", "user,item,rating\n1,2,5\n")
        write(d / "shop.valid.csv", "user,item,rating\n1,3,5\n")
        MovieLensDataModule(str(d), split="given", side_features=False).setup("fit")

    @case("ml.given_name_says_two_splits", ValueError, ["train_test.csv", "more than one split", "rename"])
    def _(ctx):
        d = ctx.tmp / "given2"
        write(d / "train_test.csv", "user,item,rating\n1,2,5\n")
        write(d / "test.csv", "user,item,rating\n1,3,5\n")
        MovieLensDataModule(str(d), split="given", side_features=False).setup("fit")

    @case("ml.given_holds_out_the_test_file", legit="split='given' holds out exactly the test file's new pairs")
    def _(ctx):
        d = ctx.tmp / "given3"
        trained = "".join(f"{u},{i},5\n" for u in range(4) for i in range(u, u + 4))
        write(d / "train.csv", "user,item,rating\n" + trained)
        write(d / "test.csv", "user,item,rating\n0,9,5\n1,1,5\n2,8,4\n")  # (1, 1) was trained on: dropped
        dm = MovieLensDataModule(str(d), split="given", side_features=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dm.setup("fit")
        offsets, items = dm.datasets["test"].target
        got = {(int(dm.user_ids[u]), int(dm.item_ids[i])) for u in range(dm.num_users)
               for i in items[offsets[u]:offsets[u + 1]].tolist()}
        expect(got == {(0, 9), (2, 8)}, f"held out {got}")

    @case("ml.min_rating_above_scale", ValueError, ["min_rating"], timeout=60)
    def _(ctx):
        src = DATA / "movielens" / "ml-100k"
        if not (src / "u.data").exists():
            raise Skipped(f"{src} is absent")
        MovieLensDataModule(str(src), min_rating=6, side_features=False).setup("fit")


def more_movielens_cases() -> None:
    """Second wave: ml-1m's '::' separator."""
    @case("more.movielens_ml1m_colons", timeout=40, legit="ml-1m's '::' separator")
    def _(ctx):
        from lightning_rec.data.movielens import read_ratings
        p = write(ctx.tmp / "ratings.dat", "1::10::5::978300760\n2::20::3::978302109\n")
        t = read_ratings(p)
        expect(t.column("item_id").to_pylist() == [10, 20] and t.column("rating").to_pylist() == [5.0, 3.0],
               f"ml-1m rows {t.to_pylist()}")


CASES = (movielens_file_cases, movielens_split_cases, more_movielens_cases)
