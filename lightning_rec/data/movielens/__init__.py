"""MovieLens (GroupLens) ratings as implicit feedback for retrieval: training pairs and full-ranking users.

Shapes: N interactions of a split, B interactions in a batch, U users in an evaluation batch,
I items, R held-out items of an evaluation batch, X excluded (already seen) items of it.

Layouts read from `data_dir` (a GroupLens folder as unpacked; the separator and a header line are
detected from the first line, so a ratings file re-saved with a header or commas also reads; RecBole's
atomic files too, `<name>.inter` with `<name>.user` / `<name>.item`: its ml-100k gives the same ids,
split and features, except the release decade, read from the title's year there):

    ml-100k    u.data       user \\t item \\t rating \\t time     u.user  id|age|gender|occupation|zip
                                                                u.item  id|title|date|video date|url|19 genre flags
    ml-1m/10m  ratings.dat  user::item::rating::time            users.dat  id::gender::age::occupation::zip
                                                                movies.dat id::title (year)::Genre|Genre
    ml-20m/25m ratings.csv  userId,movieId,rating,timestamp      movies.csv movieId,title,genres
               (and ml-latest)
    your own   ratings.csv with a header (user,item[,rating][,timestamp]; no rating: implicit, 1.0; ids integers
               or strings: a column is read as integers when every id is one), or
               ratings.parquet  columns user, item[, rating][, timestamp] by name (as in a ratings.csv
               header; no rating: implicit, 1.0; timestamp: seconds or an Arrow timestamp); data_dir
               may also be such a .parquet file itself, or a pattern of them (a Hub dataset's
               data/train-*.parquet)

Text files are decoded as UTF-8, else latin-1 (ml-100k's u.item and ml-1m's movies.dat are
latin-1). Ratings are parsed by pyarrow into one Arrow table and kept as a Hugging Face
`datasets.Dataset` (`dm.ratings`); batches are numpy gathers from its columns (zero copy).

Implicit feedback: every rating is an interaction (`min_rating=None`, RecBole's ml-100k setting),
or only ratings >= `min_rating` (e.g. 4: "liked"); lower ratings are dropped before splitting, so
they are neither positives nor excluded at evaluation. A (user, item) pair rated twice (a log of
clicks saved as ratings.csv) is one interaction: repeats are dropped, counted and warned about.

Splits (`split=`):
    "ro_811"          RecBole's RO 8:1:1: per user, interactions in random order (seeded), the last
                      10% test, the 10% before validation (RecBole's rounding: int(0.1 n) each, and
                      at least one when 0.1 n < 1 and training keeps two)
    "to_811"          RecBole's TO 8:1:1: the same counts, each user's interactions in time order
                      (the newest 10% test, the 10% before them validation)
    "loo"             leave-one-out (RecBole's LS "valid_and_test"): each user's newest interaction is the
                      test item, the one before it validation; a user with two interactions gives only
                      a test item, one with one only trains
    "u1".."u5","ua","ub"  ml-100k's official splits: <split>.base trains, <split>.test is both the
                      validation and the test set (the official splits have no validation part)
    "given"           a log split already (Amazon Reviews'23's benchmark files, a Hub dataset's splits): data_dir
                      holds one file per split (.csv with a header, or .parquet), named by a word of its name:
                      train, valid / validation / val / dev, test (All_Beauty.train.csv, test.parquet,
                      train-00000-of-00002.parquet: several files of a split are read in name order); without a
                      validation file the test file is both, as in the official splits. In Python, a
                      `datasets.DatasetDict` of such splits. A pair repeated in a later split is dropped
                      there (its first copy kept), so no test target was seen in training. GroupLens side
                      files beside them (u.user / u.item, users.dat / movies.dat, movies.csv) are read.

Time order is the timestamp column's, ties in the file's order (a stable sort, as RecBole's); a
ratings file without timestamps has no temporal split. A repeated (user, item) pair keeps its
earliest copy under a temporal split (the first in the file otherwise).

Evaluation is full ranking: one sample per user, scored against every item; the held-out items of
the split are the targets and the items the user already has are excluded: training items for
validation, training + validation items for test (as RecBole does). Ids are re-indexed to 0..U-1
and 0..I-1 (`user_ids`, `item_ids` hold the raw ids: int64, or str for string ids); every item of the
ratings and item files has a row, so an item never seen in training is still ranked (`report` counts
those held-out pairs).

Features (KJT keys; side features on when `side_features=True` and the layout has them):
    user: user_id, and for ml-100k/1m age (7 buckets), gender, occupation, zip (first digit)
    item: item_id, genre (a bag: one id per genre), year (release decade)
Id 0 of every side feature is "missing".
"""

from lightning_rec.data.movielens.batches import FeatureTable, RankingBatch, RetrievalBatch
from lightning_rec.data.movielens.datamodule import MovieLensDataModule, MovieLensReport, default_cache_dir
from lightning_rec.data.movielens.datasets import EvalShardSampler, InteractionDataset, UserRankingDataset
from lightning_rec.data.movielens.read import detect_layout, given_split_files, parquet_ratings, read_ratings
from lightning_rec.data.movielens.splits import (
    GIVEN,
    OFFICIAL_SPLITS,
    SPLITS,
    TEMPORAL_SPLITS,
    _csr_by_user,  # noqa: F401  (benchmarks/ranking_eval.py)
    loo_split,
    ro_split,
    to_split,
)

__all__ = [
    "GIVEN",
    "OFFICIAL_SPLITS",
    "SPLITS",
    "TEMPORAL_SPLITS",
    "EvalShardSampler",
    "FeatureTable",
    "InteractionDataset",
    "MovieLensDataModule",
    "MovieLensReport",
    "RankingBatch",
    "RetrievalBatch",
    "UserRankingDataset",
    "default_cache_dir",
    "detect_layout",
    "given_split_files",
    "loo_split",
    "parquet_ratings",
    "read_ratings",
    "ro_split",
    "to_split",
]
