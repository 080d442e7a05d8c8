"""Predictions to a file: `PredictionWriter`, the callback that `lightning-rec predict` adds (docs/predict.md).

Shapes: R rows predicted (on this rank, or over every rank once gathered), K columns of a 2-D output.

`predict_step` returns a dict of columns whose first dim is the batch's rows (DLRMModule {"probability", "label"},
TwoTowerModule {"row", "user", "item", "score"}). Each row's place in the input is its "row" column when the step
gives one, else the index Lightning's predict loop records (map-style datasets), else the batch's `row_ids`
(order keys, renumbered 0..R-1), else its order in this rank's stream (one rank only). Rows are written once
each, in input order, in bounded memory (lightning_rec.predict_rows):

    rank r: rows --> memory, up to spill_bytes; then sorted runs on disk, next to the output file
                 --> its runs merged in row order, a chunk at a time
    rank 0: asks the ranks whose next rows it needs for a chunk each (gather_object, gather_chunk_bytes)
                 --> merges them in row order (a repeat once) --> writes them --> the file, renamed into place

Padding (index -1, or a repeated row) is dropped; a float column NaN in every row on every rank is left out."""
from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info

from lightning_rec import comm
from lightning_rec.predict_rows import (
    FORMATS,
    ROW,
    RunSpill,
    SortedMerge,
    TableWriter,
    promoted,
    suffix_of,
    write_table,
    written_columns,
)

__all__ = ["PredictionWriter", "default_output_path", "write_table"]


def _host(t: torch.Tensor) -> np.ndarray:
    """A column on the host, as numpy (bfloat16, which numpy lacks, as float32: exact)."""
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def default_output_path(root: str | os.PathLike) -> Path:
    """<root>/predictions.csv, or the first predictions_<n>.csv that does not exist yet."""
    root = Path(root)
    path, n = root / "predictions.csv", 0
    while path.exists():
        n += 1
        path = root / f"predictions_{n}.csv"
    return path


class PredictionWriter(BasePredictionWriter):
    """Writes what `predict_step` returns to one file: one row per input row, in input order.
    One input per `trainer.predict` call: a list of predict dataloaders is refused (their rows' numbers collide).

    Args:
        output_path: a .csv, .tsv or .parquet file; None: <trainer.default_root_dir>/predictions.csv (or the
            next free predictions_<n>.csv).
        overwrite: replace an existing output_path (otherwise an existing file is refused before predicting).

    After the run: `written_path`, `num_rows` (every rank knows them) and `held_rows_peak` (this rank's)."""

    # the most bytes of rows a rank keeps in memory before it writes them, sorted, to a run file on disk
    spill_bytes: int = 256 << 20
    # the most bytes of rows one rank sends rank 0 at a time (and that rank 0 holds per rank while merging)
    gather_chunk_bytes: int = 64 << 20

    def __init__(self, output_path: str | None = None, overwrite: bool = False) -> None:
        super().__init__(write_interval="batch")
        self.output_path = output_path
        self.overwrite = overwrite
        self.written_path: Path | None = None
        self.num_rows: int | None = None
        self.held_rows_peak = 0
        self._spill: RunSpill | None = None
        self._writer: TableWriter | None = None
        self._path: Path | None = None
        if output_path is not None:
            suffix_of(Path(output_path))

    # before predicting: where to write, checked on every rank (each raises the same error) -------------------

    def resolve_path(self, trainer: pl.Trainer) -> Path:
        path = self._resolve(trainer)
        try:  # a directory that cannot take the file (nor this rank's spilled rows) is found now, not after predict
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.probe-"):
                pass
        except OSError as e:
            why = "it is a file" if path.parent.is_file() else e.strerror or e
            raise ValueError(f"prediction output {path}: cannot write in {path.parent} ({why}): give "
                             f"a path in a directory you can write (--predictions.output_path; each rank also "
                             f"keeps its spilled rows there)") from e
        return path

    def _resolve(self, trainer: pl.Trainer) -> Path:
        if self.output_path is None:
            return default_output_path(trainer.default_root_dir)
        path = Path(self.output_path)
        suffix_of(path)
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
        self._close()
        loaders = trainer.predict_loop.num_dataloaders
        if loaders > 1:
            # every loader numbers its rows from 0: the merge would take one's rows for repeats of another's
            raise ValueError(f"PredictionWriter writes one input's rows to one file, in its order, but trainer.predict "
                             f"was given {loaders} dataloaders: predict each in its own trainer.predict call, with its "
                             f"own output_path")
        path, rank = self._path, trainer.global_rank

        def spill_dir() -> Path:  # this rank's runs, beside the output (where the space for the file is)
            directory = path.parent / f".{path.name}.rows-{uuid.uuid4().hex[:8]}-rank{rank}"
            directory.mkdir(parents=True)
            return directory

        self._spill = RunSpill(self.spill_bytes, spill_dir)
        if trainer.predict_loop.return_predictions:
            rank_zero_info(f"PredictionWriter writes every row to {path}; trainer.predict also keeps every batch's "
                           f"output in memory to return it: trainer.predict(..., return_predictions=False) does not")
        self.held_rows_peak = 0
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
        columns = {k: _host(v) if isinstance(v, torch.Tensor) else np.asarray(v) for k, v in prediction.items()}
        rows = {k: v.shape[0] if v.ndim else None for k, v in columns.items()}
        num = next(iter(rows.values()))
        if any(n != num for n in rows.values()) or num is None or any(v.ndim > 2 for v in columns.values()):
            shapes = {k: tuple(v.shape) for k, v in columns.items()}
            raise ValueError(f"{type(pl_module).__name__}.predict_step returned columns of shapes {shapes}: each "
                             f"must be [rows] or [rows, K] with the same rows")
        if ROW not in columns:
            if num == 0:  # a step with no rows (a rank whose share ran out steps with an empty batch)
                columns[ROW] = np.zeros(0, dtype=np.int64)
            elif batch_indices:  # a map-style loader: Lightning recorded the indices of the batch
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
        self._spill.add(columns)

    # at the end: merge in row order, write ----------------------------------------------------------------

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        spill, self._spill = self._spill, None
        distributed = trainer.world_size > 1 and dist.is_available() and dist.is_initialized()
        try:
            local = spill.stream(self.gather_chunk_bytes)
            shape = (spill.columns, spill.all_nan, self._renumber)
            if distributed:  # rank 0 learns every rank's columns (a rank whose share was empty has none)
                shapes = comm.gather_object(shape)
                written, merge_peak = self._merge_ranks(local, trainer.strategy.root_device, shapes)
            else:
                written, merge_peak = self._write_alone(local, [shape])
            self.held_rows_peak = max(spill.held_rows_peak, merge_peak)
        finally:
            spill.close()
        self.written_path, self.num_rows = self._path, written

    def _open_writer(self, shapes: list) -> TableWriter:
        given = [s for s in shapes if s[0]]
        columns = promoted([s[0] for s in given]) if given else {}
        all_nan = {k: all(s[1].get(k, True) for s in given) for k in columns}
        renumber = any(s[2] for s in shapes)  # a rank whose share was empty saw no row_ids; the others did
        return TableWriter(self._path, written_columns(columns, all_nan), renumber=renumber)

    def _close_writer(self) -> int:
        writer, self._writer = self._writer, None
        try:
            writer.close()
        except BaseException:
            writer.abort()
            raise
        return writer.num_rows

    def _write_alone(self, local: Iterator[dict[str, np.ndarray]], shapes: list) -> tuple[int, int]:
        self._writer = self._open_writer(shapes)
        for table in local:  # one rank: its stream is in row order already
            self._writer.write(table)
        return self._close_writer(), 0

    def _merge_ranks(self, local: Iterator[dict[str, np.ndarray]], device: torch.device,
                     shapes: list | None) -> tuple[int, int]:
        """Rank 0 writes every rank's rows in row order, holding at most a chunk per rank: each round it tells the
        ranks whose rows it needs next (a broadcast flag per rank) to send a chunk. The last round tells every rank
        the rows written, or that rank 0 failed (every rank raises then). Returns (rows, rank 0's merge peak)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        merge = SortedMerge(world) if rank == 0 else None
        failure: BaseException | None = None
        if merge is not None:
            try:
                self._writer = self._open_writer(shapes)
            except Exception as e:  # noqa: BLE001 - told to every rank below, then raised here
                failure = e
        DONE, FAILED, ROWS = world, world + 1, world + 2  # flags past the per-rank asks
        while True:
            flags = torch.zeros(world + 3, dtype=torch.int64)
            if merge is not None:
                if failure is None and merge.done:
                    try:
                        flags[ROWS] = self._close_writer()
                    except Exception as e:  # noqa: BLE001
                        failure = e
                if failure is not None:
                    flags[FAILED] = 1
                elif merge.done:
                    flags[DONE] = 1
                else:
                    flags[merge.needs()] = 1
            flags = flags.to(device)
            dist.broadcast(flags, src=0)
            flags = flags.cpu()
            if flags[FAILED]:
                if failure is not None:
                    raise failure
                raise RuntimeError(f"rank 0 could not write the predictions to {self._path} (its error says why): "
                                   f"rank {rank} stopped with it, and no file was written")
            if flags[DONE]:
                return int(flags[ROWS]), merge.held_rows_peak if merge is not None else 0
            chunk = next(local, None) if flags[rank] else None
            got: list | None = [None] * world if merge is not None else None
            if flags[1:world].any():  # only rank 0 asked: no gather
                got = comm.gather_object(chunk if rank else None)
            if merge is not None:
                try:
                    for r in range(world):
                        if flags[r]:
                            merge.feed(r, chunk if r == 0 else got[r])
                    self._writer.write(merge.pop())
                except Exception as e:  # noqa: BLE001 - told to every rank at the next round
                    failure = e

    # a predict that fails leaves neither runs nor a partial file ---------------------------------------------

    def _close(self) -> None:
        if self._spill is not None:
            self._spill.close()
            self._spill = None
        if self._writer is not None:
            self._writer.abort()
            self._writer = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()
