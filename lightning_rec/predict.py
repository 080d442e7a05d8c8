"""Predictions to a file: `PredictionWriter`, the callback that `lightning-rec predict` adds.

Shapes: R rows predicted (on this rank, or over every rank once gathered), K columns of a 2-D output.

What a module's `predict_step` returns: a dict of columns, each a tensor whose first dim is the batch's
rows, e.g. DLRMModule {"probability": p_B, "label": y_B} and TwoTowerModule {"row": u_U, "user": id_U,
"item": id_UK, "score": s_UK}. Each row's place in the input is its "row" column when the step gives
one, else the index Lightning's predict loop records for it (map-style datasets), else the batch's
`row_ids` (order keys from a preprocessed directory or a text stream; rows are numbered 0..R-1 in that
order), else its order in this rank's stream (one rank only). Rows are written once each, in input order:

    rank 0: rows r0 --\
    rank 1: rows r1 ---> gather to rank 0 (gather_object, 64 MB pieces) --> sort by row (a repeat once)
                                                                             --> one file, renamed into place

(The data modules' evaluation loaders give every rank the same number of steps, which sharded tables
need, by padding a shorter share with the index -1, which the dataset drops (lightning_rec.data.batch.
EvalDistributedSampler): the -1 indices are dropped here too. A sampler that pads with repeated rows
instead, torch's DistributedSampler, also gives each row once: repeats are dropped.)

File formats, chosen by the output path's suffix:
    .csv / .tsv   a header, then one line per row; a [R, K] column becomes K columns name_1..name_K
    .parquet      one column per output; a [R, K] column is a list column (fixed size K)
A float column that is NaN in every row (the label of an unlabelled file) is left out.

The output path defaults to <trainer.default_root_dir>/predictions.csv; when that file exists, the
next free predictions_1.csv, predictions_2.csv, ... is taken (a default never overwrites a run).
A path the user gives that exists is refused unless `overwrite=True`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter

FORMATS = {".csv": ",", ".tsv": "\t", ".parquet": None}
ROW = "row"


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"prediction output {path}: unknown format {suffix or '(no suffix)'!r}; end the path in "
                         f"{', '.join(FORMATS)}")
    return suffix


def default_output_path(root: str | os.PathLike) -> Path:
    """<root>/predictions.csv, or the first predictions_<n>.csv that does not exist yet."""
    root = Path(root)
    path, n = root / "predictions.csv", 0
    while path.exists():
        n += 1
        path = root / f"predictions_{n}.csv"
    return path


class PredictionWriter(BasePredictionWriter):
    """Writes what `predict_step` returns to one file: one row per input row, in input order (see the module doc).

    Args:
        output_path: a .csv, .tsv or .parquet file; None: <trainer.default_root_dir>/predictions.csv (or the
            next free predictions_<n>.csv).
        overwrite: replace an existing output_path (otherwise an existing file is refused before predicting).

    After the run, `written_path` is the file written and `num_rows` its rows (every rank knows them).
    """

    # the most bytes of rows one rank sends rank 0 at a time (see _gather_to_rank_zero)
    gather_chunk_bytes: int = 64 << 20

    def __init__(self, output_path: str | None = None, overwrite: bool = False) -> None:
        super().__init__(write_interval="batch")
        self.output_path = output_path
        self.overwrite = overwrite
        self.written_path: Path | None = None
        self.num_rows: int | None = None
        self._parts: list[dict[str, np.ndarray]] = []
        self._path: Path | None = None
        if output_path is not None:
            _suffix(Path(output_path))

    # before predicting: where to write, checked on every rank (each raises the same error) -------------------

    def resolve_path(self, trainer: pl.Trainer) -> Path:
        if self.output_path is None:
            return default_output_path(trainer.default_root_dir)
        path = Path(self.output_path)
        _suffix(path)
        if path.is_dir():
            raise ValueError(f"prediction output {path} is a directory: give a file path ending in "
                             f"{', '.join(FORMATS)}")
        if path.exists() and not self.overwrite:
            raise ValueError(f"prediction output {path} exists: give another path, or overwrite=True "
                             f"(lightning-rec predict: --predictions.overwrite=true) to replace it")
        return path

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "predict":
            self._path = self.resolve_path(trainer)

    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._parts = []
        self._stream_rows = 0
        self._renumber = False

    # every batch: this rank's rows, on the host ----------------------------------------------------------

    def write_on_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prediction: Any,
                           batch_indices: Sequence[int] | None, batch: Any, batch_idx: int,
                           dataloader_idx: int) -> None:
        if isinstance(prediction, torch.Tensor):
            prediction = {"prediction": prediction}
        if not isinstance(prediction, dict) or not prediction:
            raise ValueError(f"{type(pl_module).__name__}.predict_step returned {type(prediction).__name__}: "
                             f"PredictionWriter writes a tensor or a dict of tensors (one row per sample)")
        columns = {k: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
                   for k, v in prediction.items()}
        rows = {k: v.shape[0] if v.ndim else None for k, v in columns.items()}
        num = next(iter(rows.values()))
        if any(n != num for n in rows.values()) or num is None or any(v.ndim > 2 for v in columns.values()):
            shapes = {k: tuple(v.shape) for k, v in columns.items()}
            raise ValueError(f"{type(pl_module).__name__}.predict_step returned columns of shapes {shapes}: each "
                             f"must be [rows] or [rows, K] with the same rows")
        if ROW not in columns:
            if batch_indices:  # a map-style loader: Lightning recorded the indices of the batch
                indices = [i for i in batch_indices if i != -1]  # -1: a share's padding, no row
                if len(indices) != num:
                    raise ValueError(f"predict_step returned {num} rows for a batch of {len(indices)} samples: "
                                     f"return one row per sample, or a 'row' column with each row's input index")
                columns[ROW] = np.asarray(indices, dtype=np.int64)
            elif getattr(batch, "row_ids", None) is not None:  # a dataset that knows each row's order key
                if len(batch.row_ids) != num:
                    raise ValueError(f"predict_step returned {num} rows for a batch of {len(batch.row_ids)} samples: "
                                     f"return one row per sample, or a 'row' column with each row's input index")
                columns[ROW] = batch.row_ids.cpu().numpy().astype(np.int64)
                self._renumber = True  # order keys (a stream's may skip numbers): rows 0..R-1 once sorted
            elif trainer.world_size > 1:
                raise ValueError("predictions at more than one rank need each row's place in the input, and this "
                                 "predict dataloader gives neither sample indices nor Batch.row_ids (an iterable "
                                 "dataset of your own?): predict on one device (--trainer.devices=1), or give "
                                 "each batch its rows' order in row_ids")
            else:  # one rank, an iterable dataset: its own order is the input order
                columns[ROW] = np.arange(self._stream_rows, self._stream_rows + num, dtype=np.int64)
        self._stream_rows += num
        self._parts.append(columns)

    # at the end: gather, order, write ------------------------------------------------------------------------

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        local = _concat(self._parts)
        self._parts = []
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            table = self._gather_to_rank_zero(local, trainer.strategy.root_device)
        else:
            table = local
        count = torch.zeros(1, dtype=torch.int64)
        renumber = self._renumber
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            flag = torch.tensor([int(renumber)], device=trainer.strategy.root_device)
            dist.all_reduce(flag)  # a rank whose share was empty saw no row_ids; the others did
            renumber = bool(flag.item())
        if trainer.is_global_zero:
            table = _in_input_order(table or {})
            if renumber and table:
                table[ROW] = np.arange(len(table[ROW]), dtype=np.int64)
            write_table(table, self._path)
            count[0] = len(table[ROW]) if table else 0
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            # every rank learns what was written (and waits for it: the file is whole when predict returns)
            count = count.to(trainer.strategy.root_device)
            dist.broadcast(count, src=0)
        self.written_path, self.num_rows = self._path, int(count[0])

    def _gather_to_rank_zero(self, local: dict[str, np.ndarray], device: torch.device) -> dict | None:
        """Every rank's rows on rank 0 (plus the padding repeats), None elsewhere: in pieces of at most
        `gather_chunk_bytes` per rank, so a large predict set never needs one object the size of a rank's share
        (gather_object pickles it into one tensor, on the GPU under NCCL, W of them at once on rank 0)."""
        row_bytes = sum(v.itemsize * (v.shape[1] if v.ndim == 2 else 1) for v in local.values()) or 1
        rows = len(local[ROW]) if local else 0
        per_piece = max(1, self.gather_chunk_bytes // row_bytes)
        pieces = torch.tensor([-(-rows // per_piece)], device=device)
        dist.all_reduce(pieces, op=dist.ReduceOp.MAX)  # every rank takes part in each gather, even with no rows
        is_zero = dist.get_rank() == 0
        received: list[dict[str, np.ndarray]] = []
        for i in range(int(pieces.item())):
            piece = {k: v[i * per_piece:(i + 1) * per_piece] for k, v in local.items()} if local else {}
            gathered: list | None = [None] * dist.get_world_size() if is_zero else None
            dist.gather_object(piece if piece and len(piece[ROW]) else None, gathered, dst=0)
            if gathered is not None:
                received.extend(t for t in gathered if t)
        return _concat(received) if is_zero else None


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if not parts:
        return {}
    keys = list(parts[0])
    return {k: np.concatenate([p[k] for p in parts]) for k in keys}


def _in_input_order(table: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rows sorted by their input index, each once (a padding repeat is the same row, predicted the same)."""
    if not table:
        return table
    _, first = np.unique(table[ROW], return_index=True)  # sorted unique rows, the first occurrence of each
    ordered = {ROW: table[ROW][first]}
    ordered.update((k, v[first]) for k, v in table.items() if k != ROW)
    return ordered


def write_table(table: dict[str, np.ndarray], path: Path) -> None:
    """Write `table` (columns of equal rows) to `path` (.csv, .tsv or .parquet): all or nothing (a temporary
    file renamed into place)."""
    import pyarrow as pa

    suffix = _suffix(path)
    columns: dict[str, Any] = {}
    for name, values in table.items():
        if values.dtype.kind == "f" and values.size and np.isnan(values).all():
            continue  # e.g. the label column of an unlabelled file
        if values.ndim == 2 and suffix == ".parquet":
            flat = pa.array(values.reshape(-1))
            columns[name] = pa.FixedSizeListArray.from_arrays(flat, values.shape[1])
        elif values.ndim == 2:
            columns.update((f"{name}_{j + 1}", pa.array(values[:, j])) for j in range(values.shape[1]))
        else:
            columns[name] = pa.array(values)
    arrow = pa.table(columns) if columns else pa.table({ROW: pa.array([], pa.int64())})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            pq.write_table(arrow, tmp)
        else:
            import pyarrow.csv as pcsv

            sep = FORMATS[suffix]
            with pa.OSFile(str(tmp), "wb") as sink:  # the header unquoted too (pyarrow quotes it always)
                sink.write((sep.join(arrow.column_names) + "\n").encode())
                pcsv.write_csv(arrow, sink, pcsv.WriteOptions(include_header=False, delimiter=sep,
                                                              quoting_style="none"))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
