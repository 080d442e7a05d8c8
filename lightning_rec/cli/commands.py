"""The commands `main` runs itself: `lightning-rec preprocess` (Criteo text -> shards) and `lightning-rec export`.

`main` is the console entry point: fit / validate / test / predict go to the recipe CLI (`run_cli`)."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Sequence

import torch

from lightning_rec.cli.hints import HintingArgumentParser  # a misspelt option names the one meant
from lightning_rec.cli.recipe import run_cli


def export_main(argv: list[str]) -> int:
    """`lightning-rec export CHECKPOINT OUT [--tables int8|int4|fp16|fp32] [--overwrite] [--package] ...`."""
    from lightning_rec.checkpoint import export

    parser = HintingArgumentParser(prog="lightning-rec export",
                                   description="Write an unsharded model for inference: OUT/model.safetensors + "
                                               "OUT/config.json (load with lightning_rec.checkpoint.load_exported)")
    parser.add_argument("checkpoint", help="a checkpoint directory (sharded) or file (gathered), e.g. "
                                           "runs/dlrm_synthetic/checkpoints/last.ckpt")
    parser.add_argument("out", help="the directory to write (a new or empty one, unless --overwrite)")
    parser.add_argument("--tables", choices=("fp32", "fp16", "int8", "int4"), default=None,
                        help="how embedding tables are stored: fp32 (default), fp16, or row-wise quantized int8 / "
                             "int4 (a scale and bias per row, served by fbgemm's integer kernel)")
    parser.add_argument("--fp16-tables", action="store_true", help="the same as --tables fp16")
    parser.add_argument("--overwrite", action="store_true", help="replace what an earlier export wrote in OUT")
    parser.add_argument("--class", dest="module_class", default=None,
                        help="the LightningModule class expected, e.g. lightning_rec.models.DLRMModule (refused if "
                             "the checkpoint is another model's)")
    parser.add_argument("--package", action="store_true",
                        help="also OUT/model.pt2 (OUT/user_tower.pt2 + item_tower.pt2 for a two-tower model): the "
                             "model compiled by AOTInductor, served by torch and fbgemm_gpu without lightning_rec")
    parser.add_argument("--retrieval", action="store_true",
                        help="a two-tower / MF model: also OUT/retrieval/ with the catalogue's FAISS index "
                             "(items.faiss), the user tower package (user_tower.pt2) and retrieval.json")
    parser.add_argument("--index", choices=("flat", "ivf", "hnsw"), default="flat",
                        help="--retrieval's index: flat (exact), ivf or hnsw (approximate, for big catalogues)")
    parser.add_argument("--data-dir", default=None,
                        help="--retrieval's data directory (default: the one the checkpoint trained on)")
    parser.add_argument("--datamodule", default="lightning_rec.data.MovieLensDataModule",
                        help="--retrieval's data module class, built from the checkpoint's data hyper-parameters: "
                             "any with item_catalog(rows) and num_items (default: MovieLensDataModule)")
    # --fp16_tables (preprocess's spelling) is the same option, rewritten so that the prefix --fp16 stays unambiguous
    args = parser.parse_args([re.sub(r"^--fp16_", "--fp16-", a) for a in argv])
    try:
        out = export(args.checkpoint, args.out, fp16_tables=args.fp16_tables, tables=args.tables,
                     overwrite=args.overwrite, module_class=args.module_class, package=args.package)
        if args.retrieval:
            _export_retrieval(args, out)
    except ValueError as e:
        parser.exit(2, f"lightning-rec export: error: {e}\n")
    packages = "".join(f", {p}" for p in sorted(out.rglob("*.pt2")) if args.package or args.retrieval)
    print(f"exported {args.checkpoint} -> {out}/model.safetensors, {out}/config.json{packages}", flush=True)
    return 0


def _export_retrieval(args, out) -> None:
    """OUT/retrieval: the catalogue through the exported item tower into a FAISS index, and the user tower package.
    The catalogue is the items of the data module the checkpoint trained with (`--datamodule`, built from the
    checkpoint's data hyper-parameters): its `item_catalog(rows)` gives the item tower's features of those rows."""
    import importlib
    import inspect

    from lightning_rec.checkpoint import lightning_checkpoint, load_exported
    from lightning_rec.serving.retrieval import export_retrieval

    module = load_exported(out)
    if not hasattr(module, "embed_catalog"):
        raise ValueError(f"--retrieval is for two-tower / matrix-factorisation models (TwoTowerModule), not "
                         f"{type(module).__name__}")
    mod_name, _, cls_name = args.datamodule.rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod_name), cls_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"--datamodule {args.datamodule}: no such class ({e}): give a data module's dotted path, "
                         f"e.g. lightning_rec.data.MovieLensDataModule") from e
    if not callable(getattr(cls, "item_catalog", None)):
        raise ValueError(f"--datamodule {args.datamodule} has no item_catalog(rows): --retrieval reads the "
                         f"catalogue's item features from it (and num_items); give a data module that has both")
    data = dict(lightning_checkpoint(args.checkpoint).get("datamodule_hyper_parameters") or {})
    if args.data_dir:
        data["data_dir"] = args.data_dir
    if "data_dir" in inspect.signature(cls).parameters and not data.get("data_dir"):
        raise ValueError("--retrieval needs the catalogue's data: give --data-dir DIR (the data module's directory)")
    dm = cls(**{k: v for k, v in data.items() if not str(k).startswith("_")})
    dm.setup("fit")
    tables = args.tables or ("fp16" if args.fp16_tables else "fp32")
    export_retrieval(module, dm, out / "retrieval", index=args.index, tables=tables, overwrite=args.overwrite)


def _preprocess_parser() -> HintingArgumentParser:
    from lightning_rec.data.criteo.schema import MISSING_CATEGORICAL

    parser = HintingArgumentParser(
        prog="lightning-rec preprocess",
        description="Convert Criteo text (day files, Kaggle train.txt / train.csv; .gz read as is) or tables (Parquet, "
        "a save_to_disk folder) into memory-mapped .npy shards for CriteoDataModule. Resumable: rerun the same "
        "command after an interruption.",
    )
    parser.add_argument("--input", nargs="+", required=True,
                        help="Criteo files, in order (e.g. day_0 ... day_22), or tables (a .parquet file, a folder or "
                             "quoted pattern of them: 'data/train-*.parquet', a save_to_disk folder)")
    parser.add_argument("--output_dir", required=True, help="where the shards and manifest.json go (one per split)")
    parser.add_argument("--num_embeddings", default="40000000",
                        help="rows per table: one int (4e7 reads as 40000000), or 26 comma-separated ints (default "
                             "40000000, TorchRec's)")
    parser.add_argument("--min_frequency", type=int, default=0,
                        help="ids seen fewer times map to id 0 (0: no threshold; the DLRM reference uses 3); writes "
                             "OUTPUT_DIR/vocab.npz, 4 bytes per table row (26 x 10M rows: 1.04 GB)")
    parser.add_argument("--vocab_from", default=None, help="reuse the vocabulary of a train --output_dir (val/test)")
    parser.add_argument("--missing_categorical", default="reserved_id", choices=MISSING_CATEGORICAL)
    parser.add_argument("--rows_per_shard", type=int, default=1_000_000,
                        help="a shard closes at the first --block_mb block that brings it to at least this many rows "
                             "(so a shard holds this many up to one block more); memory is about 3 x 160 bytes x "
                             "this (default 1000000)")
    parser.add_argument("--block_mb", type=int, default=8, help="text read and parsed at a time (MiB)")
    parser.add_argument("--no_shuffle_rows", action="store_true",
                        help="keep the file order inside each shard (unlabelled inputs, which are for predict, "
                             "always keep it: predictions follow the directory's row order)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--on_bad_row", default="error", choices=("error", "skip"))
    parser.add_argument("--separator", default=None, choices=("tab", "comma"), help="default: detected")
    parser.add_argument("--label_columns", nargs="+", default=None,
                        help="several labels, stored [n, T] by task: columns (--label_columns click purchase; a "
                             "header names them, else they are a row's leading fields), or a JSON mapping task -> "
                             "column or 'column OP value' ('{\"bought\": \"purchase == 1\"}'); docs/multitask.md")
    parser.add_argument("--label_masks", default=None,
                        help="JSON mapping task -> a column whose 0 / empty rows have no label for it")
    parser.add_argument("--threads", type=int, default=None, help="parser threads (default: torch's, all cores)")
    parser.add_argument("--no_verify", action="store_true",
                        help="on resume, check finished shards by row count only (skip the sha256)")
    parser.add_argument("--no_progress", action="store_true")
    return parser


def _count(text: str) -> int:
    """An int written as one (`40000000`) or with an exponent (`4e7`, the integer it means); else ValueError."""
    try:
        return int(text)
    except ValueError:
        number = float(text)
        if not number.is_integer():  # 1.5, 1e-3, nan, inf
            raise
        return int(number)


def _label_options(columns: list[str] | None, masks: str | None) -> tuple:
    """--label_columns (column names, or one JSON mapping) and --label_masks (JSON) as preprocess_criteo takes them."""
    def mapping(text: str, option: str) -> dict:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"{option} {text}: give a JSON mapping, e.g. '{{\"bought\": \"purchase == 1\"}}'")
        return value

    if columns is not None and len(columns) == 1 and columns[0].lstrip().startswith("{"):
        columns = mapping(columns[0], "--label_columns")
    return columns, None if masks is None else mapping(masks, "--label_masks")


def preprocess_main(argv: Sequence[str] | None = None) -> dict:
    """`lightning-rec preprocess ...`: parse arguments, run, print where the shards are and how to train on them."""
    from lightning_rec.data.criteo.preprocess import preprocess_criteo

    parser = _preprocess_parser()
    # `--output-dir`: the dashed spelling (export's style) is the same option
    argv = [re.sub(r"^--[\w-]+", lambda m: m[0][:2] + m[0][2:].replace("-", "_"), a) for a in
            (sys.argv[1:] if argv is None else argv)]
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        sizes = [_count(x) for x in args.num_embeddings.split(",")]
    except ValueError:
        parser.exit(2, f"lightning-rec preprocess: error: --num_embeddings {args.num_embeddings}: give rows per table "
                       f"as one int (e.g. 40000000 or 4e7), or 26 comma-separated ints\n")
    try:
        label_columns, label_masks = _label_options(args.label_columns, args.label_masks)
    except ValueError as e:
        parser.exit(2, f"lightning-rec preprocess: error: {e}\n")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    try:
        manifest = preprocess_criteo(
            args.input, args.output_dir, num_embeddings=sizes[0] if len(sizes) == 1 else sizes,
            min_frequency=args.min_frequency, vocab_from=args.vocab_from,
            missing_categorical=args.missing_categorical, rows_per_shard=args.rows_per_shard,
            block_mb=args.block_mb, shuffle_rows=False if args.no_shuffle_rows else None, seed=args.seed,
            on_bad_row=args.on_bad_row, separator={"tab": "\t", "comma": ","}.get(args.separator),
            verify=not args.no_verify, progress=not args.no_progress, label_columns=label_columns,
            label_masks=label_masks,
        )
    except ValueError as e:  # the input's or the options' fault, said in one line (as argparse's own errors)
        parser.exit(2, f"lightning-rec preprocess: error: {e}\n")
    _print_next_step(manifest, args, time.perf_counter() - t0)
    return manifest


def _print_next_step(manifest: dict, args, seconds: float) -> None:
    """What was written, and the options that train, evaluate or predict on it."""
    skipped = sum(r["num_skipped_rows"] for r in manifest["reports"])
    print(f"{manifest['num_rows']:,} rows in {len(manifest['shards'])} shards under {args.output_dir} "
          f"({seconds:.1f} s this run, {skipped} bad rows skipped)")
    sizes_out = manifest["num_embeddings_per_feature"]
    shown = sizes_out[0] if len(set(sizes_out)) == 1 else f"'{sizes_out}'"
    sizes_args = f"--data.num_embeddings_per_feature={shown} --model.num_embeddings_per_feature={shown}"
    for option in ("label_columns", "label_masks"):  # the data module asks for the tasks the directory holds
        if manifest["options"].get(option):
            sizes_args += f" --data.{option}='{json.dumps(manifest['options'][option])}'"
    if not manifest["has_label"]:
        print(f"predict on it with:\n  --data.predict_path={args.output_dir} {sizes_args}")
    elif args.vocab_from:  # a split preprocessed with the train split's vocabulary: validation or test
        print(f"evaluate on it with:\n  --data.val_path={args.output_dir} (or --data.test_path=) {sizes_args}")
    else:
        print(f"train on it with:\n  --data.train_path={args.output_dir} {sizes_args}")
        if args.min_frequency:  # a text val_path would be hashed, not mapped through this vocabulary: refused at fit
            print(f"and validate on a split preprocessed with its vocabulary (--vocab_from {args.output_dir}) as "
                  f"--data.val_path=DIR, or --data.val_path=null")


def main() -> None:
    """Console entry point `lightning-rec`."""
    if sys.argv[1:2] == ["preprocess"]:  # not a Trainer subcommand: its own arguments
        preprocess_main(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "export":
        sys.exit(export_main(sys.argv[2:]))
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command in ("fit", "validate", "test", "predict"):
        try:
            run_cli()
        except ValueError as e:  # a user error (a malformed row of a data file, an existing output file): its message
            # (predict said it in one line; fit on a file with a bad row gave a 45-line traceback ending in it)
            sys.exit(f"lightning-rec {command}: error: {e}")
    else:
        run_cli()
    from lightning_rec.strategy import close_process_groups

    close_process_groups()  # after a run that ended well (an error above leaves the groups alone)

