"""How RecStrategy's loops read their DataLoaders when every rank must run every step.

Every step runs embedding collectives, so a rank with one more batch than the others (a stream whose blocks
do not split evenly, an IterableDataset of any kind) would wait in its all-to-all for peers that finished
the epoch. So, per loader of a loop (process_dataloader; collective where it agrees, every rank processes its
loaders in one order):

- a loader two loops share gets a copy per loop (each loop's state on it is its own);
- evaluation keeps each rank's own rows (no DistributedSampler repeats), and predict deals fewer rows than
  ranks without Lightning's assertion;
- the ranks agree on the epoch's length: training the fewest batches of any rank, evaluation the most (a rank
  that ran out steps on with empty batches, `padding_for`, that weigh nothing);
- before each batch the ranks agree that all of them have one (`iter_together`, or the pipeline's feeder):
  in training the first rank to run out ends the epoch for all, in evaluation the others pad until all ran out.

The pipeline's batch hooks (the module's or datamodule's three batch hooks, run by the feeder thread) are
here too.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.data import sized_len
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import extract_batch_size
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, default_collate

from lightning_rec import _compat, comm
from lightning_rec.data.batch import Batch
from lightning_rec.pipeline.batch import move_to_device
from lightning_rec.pipeline.lightning import LoopState, base_loader_class, loop_state, set_loop_state


def own_loader_of_this_loop(loader: DataLoader, training: bool) -> DataLoader:
    """A loader that training and evaluation share: a shallow copy for this loop, so that each loop's state on it
    is its own (the validation loop's replaced the training loop's, and pipelined, ended its epochs early)."""
    state = loop_state(loader)
    if state is not None and state.training is not None and state.training != training:
        loader = loader_copy(loader)
    return loader


def loader_copy(loader: DataLoader) -> DataLoader:
    """The same dataset, sampler and settings (no DataLoader.__init__), without the other loop's state."""
    loader = copy.copy(loader)
    set_loop_state(loader, None)
    _compat.forget_loader_iterator(loader)  # persistent_workers: workers of its own, not the other loop's
    return loader


def padding_for(loader: object, training: bool):
    """Evaluation: what a rank whose data ran out steps with while others still have batches (the dataset's
    `empty_batch`, a batch of 0 rows that the metrics do not see), so every row is scored. Training: None
    (the first rank to run out ends the epoch for all)."""
    if training:
        return None
    dataset = getattr(loader, "dataset", None)
    pad = getattr(dataset, "empty_batch", None)
    if not callable(pad):
        pad = _empty_batch_of_whole_batches(loader, dataset) or _empty_collated_batch(loader)
    if pad is None:
        return None
    batch_sampler = getattr(loader, "batch_sampler", None)
    if _compat.is_index_batch_sampler(batch_sampler):
        # predict: the loop reads each step's row indices from what the batch sampler gave; a padding step has none
        made = pad

        def pad():
            batch_sampler.seen_batch_indices.append([])
            return made()
    return pad


def _empty_batch_of_whole_batches(loader: object, dataset: Any):
    """A map-style dataset that builds whole batches (`__getitems__`, under a plain DataLoader): the loader's batch
    of no rows, tried once here (one that fails would fail on the rank that ran out, mid-pass)."""
    getitems = getattr(dataset, "__getitems__", None)
    if not callable(getitems) or getattr(loader, "batch_sampler", None) is None:
        return None

    def pad():
        return loader.collate_fn(getitems([]))

    try:
        pad()
    except Exception:  # noqa: BLE001 - no empty batch (torch's Subset over a per-row dataset): rows dealt as Lightning
        return None
    return pad


def _empty_collated_batch(loader: object):
    """A per-row map-style dataset under torch's default_collate: its first row collated, every tensor cut to 0
    rows (a batch of the usual structure and no rows). None where a leaf is not a tensor of that one row
    (strings, a collate of one's own): the rows are dealt as Lightning deals them."""
    dataset = getattr(loader, "dataset", None)
    if getattr(loader, "collate_fn", None) is not default_collate or dataset is None \
            or isinstance(dataset, IterableDataset):
        return None
    try:
        if len(dataset) == 0:
            return None
        one = default_collate([dataset[0]])
    except Exception:  # noqa: BLE001 - a row that cannot be read or collated alone: no padding
        return None
    if not _one_row(one):
        return None

    def pad():
        return apply_to_collection(one, torch.Tensor, lambda t: t[:0])

    return pad


def _one_row(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dim() >= 1 and x.shape[0] == 1
    if isinstance(x, (list, tuple)):
        return all(_one_row(v) for v in x)
    if isinstance(x, dict):
        return all(_one_row(v) for v in x.values())
    return False


def without_repeated_rows(loader: DataLoader, stage: Any) -> DataLoader:
    """Evaluation, several ranks: the loader without the rows torch's DistributedSampler (which Lightning puts into
    evaluation loaders) repeats to even the ranks' shares, which were scored twice. Each rank keeps its share's own
    rows, in the sampler's order; a rank whose share is a batch shorter steps on with an empty batch."""
    sampler = loader.sampler
    if (type(sampler) not in (DistributedSampler, DistributedSamplerWrapper) or sampler.drop_last
            or type(loader.batch_sampler) is not BatchSampler):
        return loader  # a sampler of the user's own kind (or one that drops rows): theirs to keep
    rows = len(sampler.dataset)
    if rows % sampler.num_replicas == 0:
        return loader  # nothing repeated
    if padding_for(loader, training=False) is None:
        return loader  # no empty batch to step with: the repeated row keeps the ranks' batch counts equal
    return _compat.update_dataloader(loader, _OwnRowsOnly(sampler, rows), stage)


def deal_fewer_rows_than_ranks(trainer: Any, world_size: int, rank: int) -> None:
    """predict with fewer rows than ranks: Lightning's prediction sampler asserts on the rank that gets no row. Such
    a loader gets the same deal without the assertion (rank r: rows r, r+W, ...), the rank with no row stepping
    with an empty batch; where none can be made the run is refused naming the fix. Lightning chooses the sampler
    before any strategy hook sees the loader: its resolution is wrapped, on this trainer only."""
    hooks = _compat.sampler_resolution(trainer)
    if hooks is None or getattr(hooks[0], "_rec_fewer_rows", False):
        return  # another Lightning: its own sampler deal (and message) stays
    resolve, requires_distributed_sampler = hooks

    def resolve_sampler(dataloader, shuffle, mode=None):
        dataset = getattr(dataloader, "dataset", None)
        rows = sized_len(dataset) if dataset is not None else None
        if (mode != RunningStage.PREDICTING or rows is None or not 0 < rows < world_size
                or not requires_distributed_sampler(dataloader)):
            return resolve(dataloader, shuffle, mode)
        if padding_for(dataloader, training=False) is None:
            raise ValueError(f"trainer.predict: the predict dataloader has {rows} row(s) for {world_size} "
                             f"ranks, so rank(s) {list(range(rows, world_size))} get none, and an empty "
                             f"batch to step with cannot be made for this loader (a collate_fn of your own). Give "
                             f"its dataset an `empty_batch()` method returning a batch of 0 rows, give it at least "
                             f"{world_size} rows, or predict on fewer devices (Trainer(devices={rows}))")
        return _RowsOfThisRank(dataloader.sampler, world_size, rank)

    resolve_sampler._rec_fewer_rows = True
    _compat.set_sampler_resolution(trainer, resolve_sampler)


def agree_evaluation_length(loader: DataLoader, pad, device: torch.device) -> int | None:
    """Evaluation, several ranks (collective): the most batches of any rank's sized loader, when that is more than
    this rank's own and every rank can pad; the loader then says that length. Lightning stops a sized loader at
    its len() on each rank: a rank with one batch fewer ended the pass for all, and predict lost rows."""
    own = sized_len(loader)
    rows = comm.agree([0 if own is None else own, int(pad is not None)], device=device,
                      tag="the ranks' evaluation lengths")
    most, all_can_pad = max(n for n, _ in rows), all(can for _, can in rows)
    if own is None or most <= own or not all_can_pad:
        return None  # (without padding, the rank with more batches says which it skips: iter_together)
    return most


def agree_training_length(loader: DataLoader, rank: int, device: torch.device) -> int | None:
    """Training, several ranks (collective): the fewest batches of any rank's sized loader, when that is fewer than
    this rank's own; the loader then says that length, so that every rank's loop counts the same epoch (with its
    own, a rank with more batches validated at another batch and ran one more advance, whose collective paired
    with another one elsewhere)."""
    own = sized_len(loader)
    rows = comm.agree([-1 if own is None else own], device=device, tag="the ranks' training lengths")
    fewest = min((n for (n,) in rows if n >= 0), default=None)
    if own is None or fewest >= own:
        return None
    warnings.warn(f"rank {rank}: the rest of this epoch's batches are skipped: this rank's training "
                  f"dataloader has {own} batches, another rank's {fewest}, and sharded embeddings need every "
                  f"rank in every step, so every epoch takes {fewest} on every rank. Give every rank the same "
                  f"number of batches (e.g. drop_last, or an even split) to use them all", stacklevel=3)
    return fewest


def track_loader_position(loader: object, batches_this_epoch) -> None:
    if hasattr(loader, "consumed_batches"):
        # Lightning fetches a batch ahead of the step; the loader's saved position is the step's
        loader.consumed_batches = batches_this_epoch


class _OwnRowsOnly(torch.utils.data.Sampler):
    """A DistributedSampler's indices for its rank without the repeated ones it pads a shorter share with (the last
    index of every rank whose share is one row short): rank r keeps len(range(r, rows, W)) indices, its share's own."""

    def __init__(self, sampler: torch.utils.data.DistributedSampler, rows: int) -> None:
        self.sampler = sampler
        self.num_samples = len(range(sampler.rank, rows, sampler.num_replicas))

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:  # Lightning calls it on the loader's sampler each epoch
        self.sampler.set_epoch(epoch)


class _RowsOfThisRank(torch.utils.data.Sampler):
    """Lightning's prediction deal (rank r: the sampler's rows r, r+W, ...), without its assertion that every rank
    gets one: a rank with none steps with an empty batch."""

    def __init__(self, sampler: torch.utils.data.Sampler, world_size: int, rank: int) -> None:
        self.sampler, self.world_size, self.rank = sampler, world_size, rank

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.rank, None, self.world_size)

    def __len__(self) -> int:
        return len(range(self.rank, len(self.sampler), self.world_size))


@contextlib.contextmanager
def empty_batch_logs_weigh_nothing(module: Any, batch: Any):
    """While the step runs on a batch of 0 rows (padding), a non-finite value it logs (the mean loss over no rows
    is NaN) is logged as 0: its weight is 0, but Lightning's weighted mean multiplies, and NaN x 0 is NaN."""
    if not _is_empty(batch) or module is None or "log" in vars(module):
        yield
        return
    log = module.log

    def weightless_log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            value = torch.zeros_like(value)
        return log(name, value, *args, **kwargs)

    vars(module)["log"] = weightless_log  # log_dict logs through self.log too
    try:
        yield
    finally:
        vars(module).pop("log", None)


def _is_empty(batch: Any) -> bool:
    if isinstance(batch, Batch):  # the usual batch, sized without Lightning's walk of it (~10 us a step)
        return batch.labels.shape[0] == 0
    try:
        with warnings.catch_warnings():  # its "ambiguous collection" note is for self.log's callers, said there
            warnings.simplefilter("ignore")
            return batch is not None and extract_batch_size(batch) == 0
    except Exception:  # noqa: BLE001 - a batch Lightning cannot size: the step logs as it is
        return False


# Stepping together ----------------------------------------------------------------------------------------------

def step_together(loader: DataLoader, state: LoopState, all_have_a_batch) -> None:
    """Before each batch the ranks agree that all have one (`all_have_a_batch(have, index, last)`)."""
    state.iterate, state.all_have_a_batch = iter_together, all_have_a_batch
    set_loop_state(loader, state)


_SKIPPED = ("rank {rank}: the rest of this epoch's batches are skipped: another rank's dataloader ran out first, and "
            "sharded embeddings need every rank in every step. Give every rank the same number of batches (e.g. "
            "drop_last, or an even split) to use them all")
_PAD_HINT = (" (in evaluation, a dataset with an `empty_batch()` method (a batch of 0 rows) lets a rank that ran out "
             "step on with empty batches instead, so that every row is scored)")


def iter_together(loader: DataLoader, state: LoopState):
    """The loader's batches, each agreed on by every rank first (LoopState.iterate of a loader stepping together)."""
    batches = base_loader_class(type(loader)).__iter__(loader)
    if not comm.distributed():
        yield from batches  # the loader went on to a run without ranks
        return
    try:  # a sized loader's last batch is known: Lightning does not ask such a loader for one more
        length = len(loader)
    except TypeError:
        length = None
    skipped = _SKIPPED.format(rank=dist.get_rank())
    pad = state.pad
    if pad is None and (not length or state.evaluating):
        skipped += _PAD_HINT
    index, exhausted = 0, False
    while True:
        batch, have = None, False
        if not exhausted:
            try:
                batch, have = next(batches), True
            except StopIteration:
                exhausted = True
        last = length is not None and index == length - 1
        all_have, someones_last, any_has = state.all_have_a_batch(have, index, last)
        if not all_have:
            if pad is None or not any_has:
                if have:  # the rest is not read: parsing it could keep the others waiting
                    warnings.warn(skipped, stacklevel=2)
                return
            if not have:  # evaluation: this rank's data ran out, another's has not: an empty batch keeps it stepping
                batch = pad()
        index += 1
        yield batch
        if someones_last:
            # a rank's sized loader gave its last batch (it is not asked again): the epoch ends here for every rank
            if not last:
                warnings.warn(skipped, stacklevel=2)
            return


# The pipeline's batch hooks --------------------------------------------------------------------------------------
#
# Lightning runs on_before_batch_transfer, transfer_batch_to_device and on_after_batch_transfer on each batch just
# before its step. Pipelined, the feeder thread runs the same three, in that order, once per batch, ahead of the
# step, and routes the ids of the batch they return; the loop's own calls then see a batch the pipeline owns and
# pass it through. Called directly, not through the Trainer's hook runner, which records the running hook on the
# module (`_current_fx_name`, read by self.log in the step running meanwhile). A loop that combines several loaders'
# batches into one (training on a dict of loaders) gives the hooks that combined batch: there the feeder only
# copies each loader's batch, and the loop runs the hooks.


def batch_hooks_for(trainer: Any, module: Any, device: torch.device, loader: DataLoader):
    """batch -> the batch the step gets: the three batch hooks, for the feeder thread."""
    owner = _compat.batch_hook_owner(trainer, module)
    index: list = []

    def hook(name: str):
        return getattr(owner(name), name)

    def transfer(batch: Any) -> Any:
        if not index:  # which dataloader of its loop: the hooks' dataloader_idx
            index.extend([_dataloader_index(trainer, loader), _in_a_combined_batch(trainer, loader)])
        i, combined = index
        if combined:  # the loop runs the hooks on its batch of every loader (which no pipeline owns)
            return move_to_device(batch, device)
        batch = hook("on_before_batch_transfer")(batch, i)
        batch = hook("transfer_batch_to_device")(batch, device, i)
        return hook("on_after_batch_transfer")(batch, i)

    return transfer


def skip_hooks_for_pipelined_batches(module: Any, pipelined: Callable[[Any], bool]) -> None:
    """The loops' on_before_batch_transfer passes through a batch a pipeline owns (its feeder ran the hooks)."""
    def wrap(hooks):
        def on_before_batch_transfer(batch: Any, dataloader_idx: int = 0) -> Any:
            if pipelined(batch):
                return batch  # the feeder ran it (and the other two) already
            return hooks(batch, dataloader_idx=dataloader_idx)

        return on_before_batch_transfer

    _compat.wrap_before_batch_transfer(module, wrap)  # this run only: teardown unwraps it


def _loops(trainer: Any) -> tuple:
    return (trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop,
            trainer.predict_loop)


def held_loaders(trainer: Any) -> set[int]:
    """The ids of the loaders the trainer's loops hold now."""
    return {id(dl) for loop in _loops(trainer)
            for dl in (getattr(_compat.combined_loader(loop), "flattened", None) or [])}


def _in_a_combined_batch(trainer: Any, loader: object) -> bool:
    """Is `loader` one of several whose batches its loop combines into one (training on a dict / list of loaders,
    CombinedLoader's modes other than "sequential")? Lightning's batch hooks then get that combined batch."""
    for loop in _loops(trainer):
        combined = _compat.combined_loader(loop)
        if combined is not None and any(dl is loader for dl in combined.flattened):
            return _compat.combined_mode(combined) != "sequential" and combined.iterables is not loader
    return False


def _dataloader_index(trainer: Any, loader: object) -> int:
    """`loader`'s dataloader_idx in its loop (0 for training, as Lightning passes; 0 when not found)."""
    if trainer.training:
        return 0
    for loop in _loops(trainer)[1:]:
        for i, dl in enumerate(getattr(_compat.combined_loader(loop), "flattened", None) or []):
            if dl is loader:
                return i
    return 0
