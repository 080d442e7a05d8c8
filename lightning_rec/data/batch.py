"""One training batch of a click-through-rate model: dense features, sparse ids, labels.

Shapes: B samples in the batch, F sparse features (26 for Criteo), 13 dense features.

    dense_features   [B, 13] float32   log(1 + max(x, 0)) of the integer counts, missing -> 0
    sparse_features  KeyedJaggedTensor, keys F, stride B, lengths key-major [F*B], int64 ids
    labels           [B] float32       0. / 1. (NaN for unlabelled data such as the Kaggle test file);
                     [B, T]            with several tasks: one column per task (NaN: no label for that task)
    row_ids          [B] int64 or None each row's place in its input, where the dataset knows it and no
                                       sampler index says it (an evaluation share of a preprocessed
                                       directory): how predictions at N ranks are put back in input order
    task_names       tuple[str] / None the tasks of labels' T columns (None: one click label)

Batches are built whole by the datasets (an Arrow/numpy slice per batch, never a per-sample
collate), so the DataLoader's collate function only passes them through (`passthrough_collate`).

Loaders (`make_batch_loader`, `make_stream_loader`) are `StatefulBatchLoader`s: Lightning saves
their position in every checkpoint, and a resumed run trains exactly the batches the interrupted
run would have trained next (mid-epoch too). Every data module builds its loaders here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_rec import _compat
from lightning_rec.comm import all_gather_object
from lightning_rec.data.elastic import ELASTIC_KEY, ElasticDistributedSampler
from lightning_rec.errors import is_int
from lightning_rec.sparse import KeyedJaggedTensor, move_or_explain

# torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13, at every loader construction
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


def parse_to(what: str, args: tuple, kwargs: dict) -> tuple[torch.device | None, torch.dtype | None, bool]:
    """A batch's `.to(...)` arguments, as torch.nn.Module.to takes them: (device, floating dtype, non_blocking).

    `batch.to(torch.float64)` passed the dtype on as a device: every tensor, the ids and lengths too, became float64.
    """
    try:
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{what}.to: {e}; it takes nn.Module.to's arguments: (device), (dtype), (device, dtype), "
                        f"non_blocking=") from None
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"{what}.to({dtype}): a batch converts its floating-point tensors only (dense features, "
                        f"labels, id weights), as nn.Module.to does; its ids keep their integer type: give a floating "
                        f"dtype, e.g. torch.float64")
    return device, dtype, non_blocking


def moved(x: Any, device: torch.device | None, dtype: torch.dtype | None, non_blocking: bool) -> Any:
    """`x` (a tensor, a KeyedJaggedTensor or None) on `device`, its floating-point values in `dtype`."""
    if x is None:
        return None
    if isinstance(x, KeyedJaggedTensor):
        return x.to(device, non_blocking=non_blocking, dtype=dtype)
    change: dict[str, Any] = {}
    if device is not None:
        change["device"] = device
    if dtype is not None and x.is_floating_point():
        change["dtype"] = dtype
    return x.to(**change, non_blocking=non_blocking) if change else x


@dataclass
class Batch:
    dense_features: Tensor
    sparse_features: KeyedJaggedTensor
    labels: Tensor
    row_ids: Tensor | None = None
    task_names: tuple[str, ...] | None = None

    # Lightning moves any object with a callable `.to` (its `_TransferableDataType` protocol) through
    # `move_data_to_device`, so this method is what `transfer_batch_to_device` calls by default.
    def to(self, *args: Any, **kwargs: Any) -> Batch:
        """A copy on a device and/or in a floating dtype, with torch.nn.Module.to's arguments: `to(device)`,
        `to(dtype)`, `to(device, dtype)`, `non_blocking=`. A dtype converts the floating-point tensors only (dense
        features, labels, the ids' weights); the ids keep their integer type."""
        device, dtype, non_blocking = parse_to("Batch", args, kwargs)
        return move_or_explain(f"Batch.to({str(device)!r})", device, lambda: Batch(
            dense_features=moved(self.dense_features, device, dtype, non_blocking),
            sparse_features=moved(self.sparse_features, device, dtype, non_blocking),
            labels=moved(self.labels, device, dtype, non_blocking),
            row_ids=self.row_ids,  # bookkeeping for the host (the prediction writer), never read on the device
            task_names=self.task_names,
        ))

    # The DataLoader's pin-memory thread calls `.pin_memory()` on objects that have one.
    def pin_memory(self) -> Batch:
        return move_or_explain("Batch.pin_memory()", None, lambda: Batch(
            dense_features=self.dense_features.pin_memory(),
            sparse_features=self.sparse_features.pin_memory(),
            labels=self.labels.pin_memory(),
            # (pinned too, though it stays on the host: a batch is "pinned" when every tensor in it is)
            row_ids=None if self.row_ids is None else self.row_ids.pin_memory(),
            task_names=self.task_names,
        ))

    def record_stream(self, stream: torch.Stream) -> None:
        """Keep the memory alive until `stream` is done with it (batches copied on a side stream)."""
        self.dense_features.record_stream(stream)
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)

    @property
    def batch_size(self) -> int:
        return self.labels.shape[0]

    def __len__(self) -> int:
        return self.labels.shape[0]


def passthrough_collate(batch: Batch) -> Batch:
    """collate_fn for datasets whose `__getitems__` already returns a whole `Batch`."""
    return batch


class PassEpoch:
    """The epoch of an IterableDataset's next pass (its shuffle order), in whichever process iterates it.

    The main process tells it (`set`: a loader's `set_epoch` before each pass); DataLoader workers read what it told
    through shared memory, persistent ones too. A count kept in each worker's own copy of the dataset (made when the
    workers started) drifted from the loader's: Lightning iterates a loader made anew each epoch
    (`reload_dataloaders_every_n_epochs`) twice at the epoch's start, so persistent workers trained epoch e + 1's
    order in epoch e. A pass nobody told (a DataLoader of the user's that never calls set_epoch) counts on from the
    last one, in each process, as before.
    """

    def __init__(self) -> None:
        self._told = torch.zeros(2, dtype=torch.int64).share_memory_()  # (epoch, times told): seen by the workers
        self._seen, self._next = 0, 0  # this process's: times told when it last looked, its next epoch

    def set(self, epoch: int) -> None:
        self._told[0] = int(epoch)
        self._told[1] += 1
        self._next = int(epoch)

    def take(self, resumed: int | None = None) -> int:
        """The epoch of the pass that starts now (`resumed`: a saved position's), counting on from it."""
        epoch, told = self._told.tolist()
        if told != self._seen:
            self._seen, self._next = told, epoch
        current = self._next if resumed is None else int(resumed)
        self._next = current + 1
        return current


# ------------------------------------------------------------------------------------------------
# loaders that resume mid-epoch


class EpochRandomSampler(RandomSampler):
    """A shuffled order drawn from (seed, epoch) alone, so that a resumed run draws the same one.

    (torch's RandomSampler draws each epoch from a generator that advances across epochs, which a
    new process cannot reproduce.) Lightning calls `set_epoch` every epoch; it is a RandomSampler,
    so Lightning swaps it for a shuffling DistributedSampler under DDP, as before.
    """

    def __init__(self, data_source: Sized, seed: int = 0) -> None:
        super().__init__(data_source)
        self.seed, self.epoch = int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch * 1_000_003)  # epoch 0: torch's order for seed
        yield from torch.randperm(len(self.data_source), generator=g).tolist()


@dataclass(frozen=True)
class _Passes:
    """A StatefulBatchLoader's count of its passes. Replaced, never changed in place: a shallow copy of the loader
    (one per Lightning loop that shares it) counts on alone, as its own attributes would."""

    number: int = 0  # the pass (epoch) the last iteration drew
    started: bool = False  # a pass has started (the next one counts one more)
    seen_epoch: int | None = None  # own_epochs: the sampler epoch the last pass saw
    pending: dict | None = None  # a loaded state, applied when the next pass starts
    history: dict | None = None  # of pass `history_pass`: batches read -> (the loader's state, finished)
    history_pass: int = 0


class StatefulBatchLoader(StatefulDataLoader):
    """A torchdata StatefulDataLoader whose saved position is the training step's, not the fetcher's.

    Lightning saves a training loader's `state_dict()` in every checkpoint and gives it back through
    `load_state_dict()` on resume (its stateful-dataloader support); torchdata's StatefulDataLoader
    makes the state (sampler position, IterableDataset state or a fast-forward count, worker states).
    Two things are added here:

    - The position: a fetcher that reads ahead of the step (Lightning's, for loaders without a
      length; a pipeline) would otherwise save a position past batches that were never trained.
      The loader keeps its state after each of the last batches it yielded, and `state_dict()`
      returns the one after `consumed_batches()` batches of this pass (RecStrategy sets that
      callable to the fit loop's count); without it, the state after every batch yielded.
    - The check: the state carries a fingerprint (dataset, its size, batch size, sampler, ranks,
      workers). A state from another dataset or batch size is not applied: a warning, and the
      interrupted epoch starts over from its first batch (Lightning still counts the steps it had
      taken in that epoch, so the epoch ends that many batches early). Never a silent misalignment.

    The iterator starts lazily, at its first batch: after Lightning's `set_epoch`, so a resumed
    epoch skips into its own order. A dataset with `set_epoch(epoch)` (a stream that shuffles by
    epoch) is told the pass number, which the state also keeps.
    """

    _HISTORY = 64  # states kept: more than any fetcher or pipeline reads ahead

    consumed_batches: Callable[[], int] | None = None
    fit_epoch: Callable[[], int] | None = None
    own_epochs: bool = False
    # collectives, set by follow_fit_loop on a stream's training loader under a plain multi-rank strategy: does every
    # rank have a batch at this point of the pass; every rank's saved position (each rank reads its own share of a
    # stream, and Lightning's checkpoint holds rank 0's alone)
    ranks_have_a_batch: Callable[[bool], bool] | None = None
    gather_states: Callable[[dict], list] | None = None
    _passes: _Passes = _Passes()

    def __iter__(self):  # type: ignore[override]
        return _Pass(self._resumable_batches(), self._batches_of_next_pass())

    def _batches_of_next_pass(self) -> int | None:
        """The batches the next pass gives, where the loader knows them: a map-style dataset's length, less the
        batches a resumed pass took already (None: a stream, or a pass continued at another world size)."""
        if isinstance(self.dataset, torch.utils.data.IterableDataset) or self.ranks_have_a_batch is not None:
            return None
        total, pending = _length(self), self._passes.pending
        if total is None or pending is None or pending["finished"] or pending["batches"] == total:
            return total
        return None if pending.get("elsewhere") is not None else total - pending["batches"]

    def _next_own_epoch(self) -> None:
        """Outside Lightning: a pass whose sampler epoch nobody set since the last pass draws the next epoch's
        order (as torch's RandomSampler reshuffles every pass); an epoch the user set (torch's
        `sampler.set_epoch(e)` convention) is kept."""
        sampler = self.sampler
        epoch = getattr(sampler, "epoch", None)
        if not callable(getattr(sampler, "set_epoch", None)) or not isinstance(epoch, int):
            return
        seen = self._passes.seen_epoch
        if seen is not None and epoch == seen:
            sampler.set_epoch(epoch + 1)
            epoch += 1
        self._passes = replace(self._passes, seen_epoch=epoch)

    def _resumable_batches(self) -> Iterator[Any]:
        pending = self._passes.pending
        # The pass (epoch) number: one more at every new iteration (Lightning stops a sized loader after
        # its last batch without reaching StopIteration, so the count moves at the start, not the end).
        pass_index = self._passes.number + (1 if self._passes.started else 0)
        self._passes = replace(self._passes, pending=None)
        if self.fit_epoch is not None:
            # in a fit, the pass is the fit loop's epoch, the one Lightning gives samplers' set_epoch. Counted here, a
            # loader made anew for an epoch (Trainer(reload_dataloaders_every_n_epochs=...)), which Lightning also
            # iterates twice at that epoch's start, drew epoch 0's and 1's orders in every epoch: a dataset that
            # shuffles by pass (a stream, a preprocessed directory) trained the same order epoch after epoch
            pass_index = self.fit_epoch()
        count = 0
        if pending is not None:
            pass_index, count = self._start_resumed_pass(pending)
        self._passes = replace(self._passes, started=True, number=pass_index)
        if pending is not None:
            # A reader that starts before Lightning's set_epoch (a pipeline's feeder thread, on resume)
            # must still draw the resumed epoch's order: the sampler gets it from the saved pass.
            for sampler in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
                if callable(getattr(sampler, "set_epoch", None)):
                    sampler.set_epoch(pass_index)
            # a hand loop numbers its own passes from here: the next pass, seeing this epoch, draws the next
            # one (unrecorded, it took this epoch as one the user set, and the epoch after the resumed one
            # repeated the resumed epoch's order)
            self._passes = replace(self._passes, seen_epoch=getattr(self.sampler, "epoch", None))
        elif self.own_epochs:
            self._next_own_epoch()
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(pass_index)
        base = self._iterator_of_pass(pass_index)
        history: dict[int, tuple[dict, bool]] = {count: (super().state_dict(), False)}
        self._passes = replace(self._passes, history=history, history_pass=pass_index)
        while True:
            try:
                batch, have = next(base), True
            except StopIteration:
                batch, have = None, False
            if have and self.ranks_have_a_batch is not None and not self.ranks_have_a_batch(True):
                # another rank's share ran out: the pass ends here on every rank (the state before this batch, marked
                # finished: a checkpoint taken now resumes at the next epoch, as the uninterrupted run goes on)
                warnings.warn(f"rank {torch.distributed.get_rank()}: the rest of this epoch's batches are skipped: "
                              f"another rank's share of the stream ran out first, and DDP needs every rank in every "
                              f"step, so each epoch ends at the shortest share (as DistributedSampler(drop_last=True) "
                              f"evens a sized loader). A stream's shares differ by up to a block (block_bytes)",
                              stacklevel=2)
                history[count] = (history[count][0], True)
                return
            if not have:
                if self.ranks_have_a_batch is not None:
                    self.ranks_have_a_batch(False)  # the others learn that this rank's share ran out
                history[count] = (super().state_dict(), True)
                return
            count += 1
            history[count] = (super().state_dict(), False)
            history.pop(count - self._HISTORY, None)
            yield batch

    def _start_resumed_pass(self, pending: dict) -> tuple[int, int]:
        """(the pass, the batches already taken in it) of a loaded position; the loader or its sampler set there."""
        pass_index = pending["pass"]
        elastic, own = pending.get("elsewhere"), pending.get(ELASTIC_KEY)
        if elastic is None and isinstance(own, dict) and own.get("continue_here"):
            elastic = {**own, "ranks": [own]}  # a stream's continued epoch resumes as one at this world size too
        if elastic is not None:  # saved at another world size: the sampler (or dataset) deals the rows no rank read
            if not self._elastic_source().continue_epoch(pass_index, elastic, pending["batches"], self.batch_size):
                return pass_index + 1, 0
            return pass_index, pending["batches"]
        if pending["finished"] or (pending["batches"] and pending["batches"] == _length(self)):
            return pass_index + 1, 0  # saved at the end of a pass (or after its last batch): this is the next one
        super().load_state_dict(pending["base"])
        return pass_index, pending["batches"]

    def _iterator_of_pass(self, pass_index: int):
        """torch's iterator draws its workers' base seed from `self.generator`, by default the global one: the global
        stream moved once per pass, so a run resumed mid-epoch (one iterator more than the uninterrupted run made)
        drew other dropout masks after restoring the checkpoint's RNG state. Without a generator of the user's, the
        seed comes from one of the run's seed and the pass (the feeder thread may make the iterator: the global
        generator is not touched from there)."""
        if self.generator is not None:
            return super().__iter__()
        self.generator = torch.Generator().manual_seed((torch.initial_seed() * 1_000_003 + pass_index) % 2**63)
        try:
            return super().__iter__()
        finally:
            self.generator = None

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        state = self._own_state()
        if self.gather_states is None:
            return state
        # under a plain strategy only rank 0 writes the checkpoint: it holds every rank's position, each rank
        # resumes from its own (from rank 0's, rank 1 restarted its share's epoch while the loop counted on)
        return {"pass": state["pass"], "fingerprint": state["fingerprint"], "ranks": self.gather_states(state)}

    def _own_state(self) -> dict[str, Any]:
        history = self._passes.history
        if not history:
            return {"pass": self._passes.number, "batches": 0, "finished": False, "base": {},
                    "fingerprint": self.fingerprint()}
        wanted = self.consumed_batches() if self.consumed_batches is not None else None
        latest = max(history)
        if wanted is None or wanted not in history:
            wanted = latest
        base, finished = history[wanted]
        state = {"pass": self._passes.history_pass, "batches": wanted, "finished": finished, "base": base,
                 "fingerprint": self.fingerprint()}
        source = self._elastic_source()
        if source is not None:  # what a run at another world size continues from
            state[ELASTIC_KEY] = source.elastic_state(state["pass"], wanted, self.batch_size, finished,
                                                      loader_state=base)
        return state

    def _elastic_source(self) -> Any:
        """What deals the epoch's rows over the ranks and can continue one begun at another world size
        (data/elastic.py): an ElasticDistributedSampler, or a dataset that deals its own rows; else None."""
        if isinstance(self.sampler, ElasticDistributedSampler):
            return self.sampler
        return self.dataset if callable(getattr(self.dataset, "continue_epoch", None)) else None

    def load_state_dict(self, state: dict[str, Any]) -> None:  # type: ignore[override]
        if isinstance(state, dict) and "ranks" in state:  # every rank's (gather_states): this rank's own
            dist, sampler = torch.distributed, self.sampler
            if isinstance(sampler, ElasticDistributedSampler):  # the trainer's ranks, which it deals to
                rank, world = sampler.rank, sampler.num_replicas
            elif callable(getattr(self.dataset, "rank_world", None)):  # a dataset that deals its rows itself
                rank, world = self.dataset.rank_world()
            elif dist.is_available() and dist.is_initialized():
                rank, world = dist.get_rank(), dist.get_world_size()
            else:
                rank, world = 0, 1
            if len(state["ranks"]) != world:
                self._load_from_other_ranks(state["ranks"], len(state["ranks"]), world)
                return
            state = state["ranks"][rank]
        mine = self.fingerprint()
        theirs = state.get("fingerprint") if isinstance(state, dict) else None
        if theirs is not None and theirs.get("dataset_id") is None:  # saved before this dataset had an id to record
            theirs = {**theirs, "dataset_id": mine.get("dataset_id")}
        if theirs != mine:
            differ = sorted(k for k in set(mine) | set(theirs or {}) if (theirs or {}).get(k) != mine.get(k))
            if set(differ) <= {"sampler_num_replicas", "sampler_rank"}:  # the same rows, dealt to other ranks
                self._load_from_other_ranks([state], theirs["sampler_num_replicas"], mine["sampler_num_replicas"])
                return
            warnings.warn(
                f"the checkpoint's dataloader state does not belong to this loader ({', '.join(differ)} differ: "
                f"saved {({k: (theirs or {}).get(k) for k in differ})}, now {({k: mine.get(k) for k in differ})}): "
                f"the interrupted epoch starts over from its first batch instead of resuming mid-epoch",
                stacklevel=2,
            )
            number = int(state.get("pass", 0)) if isinstance(state, dict) else 0
            self._passes = replace(self._passes, pending=None, number=number)
            return
        self._passes = replace(self._passes, pending=state, number=state["pass"])

    def _load_from_other_ranks(self, states: list, saved: int, world: int) -> None:
        """A position saved at `saved` ranks (`states`: each saved rank's, or the first one's), loaded at `world`: the
        rest of the interrupted epoch dealt over this run's ranks when the states and the loader allow, else the
        epoch over. The source reads the first rank's record, with every rank's under "ranks" (a stream's readers)."""
        state = states[0]
        number = int(state.get("pass", 0)) if isinstance(state, dict) else 0
        records = [s.get(ELASTIC_KEY) if isinstance(s, dict) else None for s in states]
        elastic = {**records[0], "ranks": records} if all(isinstance(r, dict) for r in records) else None
        why, source = None, self._elastic_source()
        if source is None:
            why = ("this loader cannot deal the rest of an epoch over other ranks (a map-style dataset's "
                   "DistributedSampler, a preprocessed directory and a Criteo stream can)")
        elif not isinstance(elastic, dict):
            why = ("the state was saved by an older version of lightning_rec, which did not record the rows its "
                   "ranks had read")
        else:
            mine, theirs = self.fingerprint(), dict(state.get("fingerprint") or {})
            # a rank's share (a dataset's length when it deals its rows itself) depends on the ranks
            same = ("sampler_num_replicas", "sampler_rank") + (("num_samples",) if source is self.dataset else ())
            theirs.update({k: mine.get(k) for k in same})
            differ = sorted(k for k in set(mine) | set(theirs) if theirs.get(k) != mine.get(k))
            if differ:
                why = (f"it does not belong to this loader ({', '.join(differ)} differ: saved "
                       f"{({k: theirs.get(k) for k in differ})}, now {({k: mine.get(k) for k in differ})})")
        if why is not None:
            warnings.warn(f"the checkpoint's dataloader state was saved by {saved} ranks, this run has {world}, and "
                          f"{why}: the interrupted epoch starts over from its first batch instead of continuing "
                          f"over the rows not yet read", stacklevel=3)
            self._passes = replace(self._passes, pending=None, number=number)
            return
        pending = {"pass": number, "batches": int(state["batches"]), "finished": bool(state["finished"]),
                   "elsewhere": elastic}
        self._passes = replace(self._passes, pending=pending, number=number)
        # now, not at the first batch: Lightning sizes the epoch from len(loader) before iterating
        source.continue_epoch(number, elastic, pending["batches"], self.batch_size)
        if world < saved:  # fewer ranks: the same steps read fewer rows, which users rarely expect
            from lightning.pytorch.utilities import rank_zero_info

            keep = (f"; Trainer(accumulate_grad_batches={saved // world}) keeps the global batch of {saved} ranks"
                    if saved % world == 0 else "")
            rank_zero_info(f"the interrupted epoch, saved at {saved} ranks, goes on at {world}: a step now reads "
                           f"{world}/{saved} of the rows a step read before{keep} (docs/checkpoints.md)")

    def fingerprint(self) -> dict[str, Any]:
        """What a saved position is only valid for."""
        dataset, sampler = self.dataset, self.sampler
        out: dict[str, Any] = {
            "dataset": type(dataset).__name__,
            "dataset_id": getattr(dataset, "fingerprint", None),
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "num_workers": self.num_workers,
            "sampler": type(sampler).__name__,
        }
        try:
            out["num_samples"] = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            out["num_samples"] = None
        out["sampler"] = getattr(sampler, "fingerprint_name", out["sampler"])
        for attr in ("num_replicas", "rank", "shuffle", "seed"):
            if hasattr(sampler, attr):
                out[f"sampler_{attr}"] = getattr(sampler, attr)
        return out


def follow_fit_loop(loader: StatefulDataLoader, trainer: Any) -> StatefulDataLoader:
    """Make `loader`'s saved position the fit loop's step, under any strategy; returns `loader`.

    A data module calls it on its training loader with its `trainer` (None outside a Trainer). Lightning
    reads a batch ahead of the step for a loader without a length, so without this a checkpoint of a
    plain (not `strategy="rec"`) run would resume one batch past the last one trained.
    """
    if trainer is not None and isinstance(loader, StatefulBatchLoader):
        progress = trainer.fit_loop.epoch_loop.batch_progress
        loader.consumed_batches = lambda: int(progress.current.processed)
        epochs = trainer.fit_loop.epoch_progress  # the epoch Lightning gives samplers' set_epoch
        loader.fit_epoch = lambda: int(epochs.current.processed)
        restored = _compat.restored_train_loader_states(trainer)
        if len(restored) == 1 and loader._elastic_source() is not None:
            # Lightning sizes the epoch from len(loader) before it loads the position: an epoch continued from
            # another world size may be longer than a whole one here (Lightning loads it again, and warns then)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loader.load_state_dict(restored[0])
        if trainer.world_size > 1 and _length(loader) is None:
            strategy = trainer.strategy
            if not getattr(strategy, "steps_ranks_together", False):  # (RecStrategy does both itself)
                # A stream's ranks' shares differ: under plain DDP the rank with batches left waited in its gradient
                # all-reduce for one that had gone on to the next epoch, until gloo / NCCL failed. The ranks agree
                # before each batch (a one-number all-reduce) that all have one; the first to run out ends the epoch.
                loader.ranks_have_a_batch = lambda have: strategy.reduce_boolean_decision(have, all=True)
                loader.gather_states = all_gather_object  # (Lightning builds a checkpoint on every rank)
    elif isinstance(loader, StatefulBatchLoader):
        # a hand-written loop: no Lightning to call the sampler's set_epoch, so each pass numbers itself
        # (a shuffled loader drew the same order every epoch, unlike torch's RandomSampler)
        loader.own_epochs = True
    return loader


def worker_options(owner: str, num_workers: int, pin_memory: bool = False, prefetch_factor: int | None = None,
                   persistent_workers: bool | None = None) -> dict[str, Any]:
    """The DataLoader worker arguments a data module (`owner`, named in errors) passes to its loaders, checked.

    Called at construction: a bad value was a bare "num_workers must be >= 0" (or torch's own message) only once
    the first loader was built, without the data module's name. `persistent_workers=None` keeps the workers
    between epochs whenever there are any (the loaders resume mid-epoch from them).
    """
    if not is_int(num_workers) or num_workers < 0:
        raise ValueError(f"{owner} num_workers={num_workers!r}: give 0 (load in the main process) or a number of "
                         f"worker processes")
    if prefetch_factor is not None:
        if not is_int(prefetch_factor) or prefetch_factor < 1:
            raise ValueError(f"{owner} prefetch_factor={prefetch_factor!r}: give the number of batches each worker "
                             f"loads ahead (>= 1), or None for torch's default (2)")
        if num_workers == 0:
            raise ValueError(f"{owner} prefetch_factor={prefetch_factor} needs worker processes: set num_workers "
                             f"> 0, or leave prefetch_factor=None")
    if persistent_workers is None:
        persistent_workers = num_workers > 0
    elif persistent_workers and num_workers == 0:
        raise ValueError(f"{owner} persistent_workers=True needs worker processes: set num_workers > 0, or leave "
                         f"persistent_workers=None")
    return {"num_workers": num_workers, "pin_memory": pin_memory, "prefetch_factor": prefetch_factor,
            "persistent_workers": bool(persistent_workers)}


def make_train_loader(dataset: Dataset, batch_size: int, shuffle: bool, drop_last: bool, seed: int,
                      num_workers: int, pin_memory: bool, trainer: Any,
                      shard_outside_trainer: bool = True, prefetch_factor: int | None = None,
                      persistent_workers: bool | None = None) -> StatefulBatchLoader:
    """A data module's training loader (`make_batch_loader` + `follow_fit_loop`); `trainer` is None outside one.

    Under a distributed strategy (at any device count, one too) the loader holds a DistributedSampler of the
    trainer's ranks, shuffled as `shuffle` says and seeded by `seed`, which Lightning keeps: Lightning's own, put
    in otherwise, always shuffles and is seeded by seed_everything, so `shuffle=False` and the data module's `seed`
    were lost. Under `Trainer(use_distributed_sampler=False)` it shards nothing (every rank reads every row, as
    Lightning leaves a loader then). Outside a Trainer (a hand-written loop) it shards in a process group of 2+
    ranks when `shard_outside_trainer`.
    """
    if trainer is None:
        shard: bool | tuple[int, int] = shard_outside_trainer
    else:  # the trainer's ranks (a Trainer of one device in a process group another program made: every row)
        shard = (trainer.world_size, trainer.global_rank) if _compat.puts_in_distributed_sampler(trainer) else False
    loader = make_batch_loader(dataset, batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed,
                               num_workers=num_workers, pin_memory=pin_memory, shard_by_rank=shard,
                               prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)
    return follow_fit_loop(loader, trainer)


class _Pass(Iterator):
    """One pass of a StatefulBatchLoader: its batches, and how many are left where the loader knows
    (`batches_left()`: a pipeline's ranks then agree on the pass's length once instead of before every batch)."""

    def __init__(self, batches: Iterator[Any], total: int | None) -> None:
        self._batches, self._total, self._given = batches, total, 0

    def __next__(self) -> Any:
        batch = next(self._batches)
        self._given += 1
        return batch

    def batches_left(self) -> int | None:
        return None if self._total is None else max(self._total - self._given, 0)

    def close(self) -> None:
        self._batches.close()


def _length(loader: StatefulDataLoader) -> int | None:
    try:
        return len(loader)
    except TypeError:  # an IterableDataset without a length
        return None


def make_batch_loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool,
    drop_last: bool,
    seed: int,
    num_workers: int,
    pin_memory: bool = False,
    shard_by_rank: bool | tuple[int, int] = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool | None = None,
) -> StatefulBatchLoader:
    """A resumable loader whose dataset builds whole batches from index lists (`__getitems__`).

    Automatic batching (`batch_size` + `sampler`): PyTorch's fetcher hands each batch's index list
    to `__getitems__`, and under DDP Lightning rebuilds the loader with a DistributedSampler and
    the same batch_size. (A loader built from `batch_sampler=BatchSampler(...)` is rebuilt by
    Lightning without its batch size: every batch would hold one sample.)

    `shard_by_rank` (the data modules' training loaders outside a Trainer: a hand-written loop): in a
    process group of W > 1 ranks, each rank reads its 1/W of the rows through a DistributedSampler, as
    Lightning would arrange; without it every rank read every row, and the ranks trained on copies. A pair
    (world size, rank): a DistributedSampler of those ranks (a Trainer's), one rank too.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    workers = worker_options("make_batch_loader", num_workers, pin_memory, prefetch_factor, persistent_workers)
    sampler = EpochRandomSampler(dataset, seed=seed) if shuffle else SequentialSampler(dataset)
    dist = torch.distributed
    if shard_by_rank is True and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        shard_by_rank = (dist.get_world_size(), dist.get_rank())
    if isinstance(shard_by_rank, tuple):
        sampler = ElasticDistributedSampler(dataset, *shard_by_rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return StatefulBatchLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        collate_fn=passthrough_collate,
        **workers,
    )


class EvalDistributedSampler(DistributedSampler):
    """Evaluation at W ranks: every row exactly once over all ranks, every rank the same number of batches.

    Rank r takes rows r, r + W, r + 2W, ...; a share one row shorter is padded with -1 at its end,
    which the dataset drops (`CriteoDataset.__getitems__`), so that share's last batch is one row short
    (empty when batch_size is 1). torch's DistributedSampler, which Lightning puts into evaluation loaders
    otherwise, pads with repeated rows instead: they would be scored twice. It is a DistributedSampler,
    so Lightning keeps it. In prediction, `batch_indices` hold -1 where a share was padded.
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)

    def __iter__(self) -> Iterator[int]:
        mine = list(range(self.rank, len(self.dataset), self.num_replicas))
        return iter(mine + [-1] * (self.num_samples - len(mine)))

    def __len__(self) -> int:
        return self.num_samples


def make_eval_loader(dataset: Dataset, batch_size: int, num_workers: int, pin_memory: bool = False,
                     prefetch_factor: int | None = None, persistent_workers: bool | None = None
                     ) -> StatefulBatchLoader:
    """`make_batch_loader` for validation / test / prediction: in order, every row once at any world size.

    Under torch.distributed (W > 1) the sampler is an `EvalDistributedSampler`: the dataset's
    `__getitems__` must drop the index -1 (padding). Every rank passes the whole split: the loader deals its
    rows to the ranks itself, under `Trainer(use_distributed_sampler=False)` too (a split already cut per rank
    would be cut again, and rows left out).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    workers = worker_options("make_eval_loader", num_workers, pin_memory, prefetch_factor, persistent_workers)
    sampler: Sampler = SequentialSampler(dataset)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        sampler = EvalDistributedSampler(dataset, dist.get_world_size(), dist.get_rank())
    return StatefulBatchLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=False,
                               collate_fn=passthrough_collate, **workers)


def make_stream_loader(dataset: IterableDataset, num_workers: int, pin_memory: bool = False,
                       prefetch_factor: int | None = None, persistent_workers: bool | None = None
                       ) -> StatefulBatchLoader:
    """A resumable loader over an IterableDataset that yields whole batches."""
    workers = worker_options("make_stream_loader", num_workers, pin_memory, prefetch_factor, persistent_workers)
    return StatefulBatchLoader(dataset, batch_size=None, **workers)
