"""Every probe of a torch or Lightning version, and every private Lightning hook the library touches.

lightning_rec runs on torch 2.11-2.13 and Lightning 2.6.x: a feature newer than the oldest supported
release is detected here, by what the installed version offers, never assumed from a version string.
Each probe names the versions it covers; tests/test_compat.py pins what the pinned versions give.
Lightning itself is imported only inside the functions that need it (`import lightning_rec` stays light).
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch


def _takes(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


@functools.cache
def ddp_has_forward_sync_buffers() -> bool:
    """DistributedDataParallel(forward_sync_buffers=...): torch >= 2.13 (2.11 / 2.12: broadcast_buffers only)."""
    from torch.nn.parallel import DistributedDataParallel

    return _takes(DistributedDataParallel.__init__, "forward_sync_buffers")


@functools.cache
def compiler_disable_takes_reason() -> bool:
    """torch.compiler.disable(fn, reason=...): the reason shows in fullgraph's error (newer torch; absent in some)."""
    return _takes(torch.compiler.disable, "reason")


@functools.cache
def dynamo_capture_errors() -> tuple[type[BaseException], ...]:
    """What torch.compile(fullgraph=True) raises for a function it cannot capture whole or compile (graph breaks,
    data-dependent control flow, a backend failure): torch._dynamo.exc's base class, torch 2.11-2.13."""
    from torch._dynamo import exc

    return (exc.TorchDynamoException,)


@functools.cache
def distribute_tensor_takes_src_data_rank() -> bool:
    """distribute_tensor(..., src_data_rank=None) keeps each rank's own copy: torch >= 2.6."""
    from torch.distributed.tensor import distribute_tensor

    return _takes(distribute_tensor, "src_data_rank")


@functools.cache
def pytree_takes_flatten_with_keys() -> bool:
    """register_pytree_node(..., flatten_with_keys_fn=...): names the leaves in torch.export signatures."""
    from torch.utils import _pytree as pytree

    return _takes(pytree.register_pytree_node, "flatten_with_keys_fn")


@functools.cache
def ddp_keyword_defaults() -> dict[str, object]:
    """DistributedDataParallel.__init__'s arguments with a default, and those defaults (torch 2.11-2.13)."""
    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}


# torch DataLoader internals ------------------------------------------------------------------------------------


def forget_loader_iterator(loader) -> None:
    """A copied DataLoader starts its own iterator (persistent_workers keeps one in `DataLoader._iterator`,
    torch 2.11-2.13), not the original's workers."""
    loader._iterator = None


# Lightning 2.6.x private hooks ---------------------------------------------------------------------------------
# Each is looked up where it is used; where a Lightning lacks it, the accessor says so (None / False) and the
# caller keeps Lightning's own behaviour.


def sampler_resolution(trainer):
    """(resolve_sampler(dataloader, shuffle, mode=None), requires_distributed_sampler(dataloader)) of the trainer's
    data connector, which picks a loader's sampler before any strategy hook sees the loader (Lightning 2.6.x
    `_DataConnector._resolve_sampler`, `_requires_distributed_sampler`); None where a Lightning lacks them."""
    connector = getattr(trainer, "_data_connector", None)
    resolve = getattr(connector, "_resolve_sampler", None)
    requires = getattr(connector, "_requires_distributed_sampler", None)
    if not callable(resolve) or not callable(requires):
        return None
    return resolve, requires


def puts_in_distributed_sampler(trainer) -> bool:
    """Whether Lightning puts a DistributedSampler of its own (shuffling, in training) into a loader that holds none:
    use_distributed_sampler under a distributed strategy, DDP's subclasses at one device too (Lightning 2.6.x
    `_AcceleratorConnector.use_distributed_sampler`, `.is_distributed`); False where a Lightning lacks them."""
    connector = getattr(trainer, "_accelerator_connector", None)
    return bool(getattr(connector, "use_distributed_sampler", False) and getattr(connector, "is_distributed", False))


def restored_train_loader_states(trainer) -> list:
    """The training loaders' states a resuming fit loop will load (Lightning 2.6.x
    `_FitLoop._combined_loader_states_to_load`, loaded only after it sized the epoch from len(loader)); [] when it
    holds none or a Lightning lacks it."""
    loop = getattr(trainer, "fit_loop", None)
    states = getattr(loop, "_combined_loader_states_to_load", None)
    return list(states) if getattr(loop, "restarting", False) and isinstance(states, list) else []


def set_sampler_resolution(trainer, resolve) -> None:
    """This trainer's data connector picks samplers with `resolve` (see sampler_resolution; Lightning 2.6.x)."""
    trainer._data_connector._resolve_sampler = resolve


def update_dataloader(dataloader, sampler, mode):
    """The loader rebuilt with `sampler` (Lightning 2.6.x `lightning.pytorch.utilities.data._update_dataloader`:
    the loader's own arguments, re-instantiated; its class's extra __init__ arguments too)."""
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler, mode=mode)


def is_index_batch_sampler(batch_sampler) -> bool:
    """Is it the wrapper by which Lightning's predict loop records each batch's row indices (Lightning 2.6.x
    `lightning.pytorch.overrides.distributed._IndexBatchSamplerWrapper`, `seen_batch_indices`)? False where absent."""
    try:
        from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
    except ImportError:  # pragma: no cover - another Lightning
        return False
    return isinstance(batch_sampler, _IndexBatchSamplerWrapper)


def combined_loader(loop):
    """The CombinedLoader a loop iterates (Lightning 2.6.x `_FitLoop/_EvaluationLoop/_PredictionLoop._combined_loader`),
    None before the loop set it up or where a Lightning keeps it elsewhere."""
    return getattr(loop, "_combined_loader", None)


def combined_mode(combined) -> str:
    """A CombinedLoader's mode ("sequential", "max_size_cycle", ...; Lightning 2.6.x `CombinedLoader._mode`)."""
    return getattr(combined, "_mode", "sequential")


def batch_hook_owner(trainer, module):
    """`name -> the object whose batch hook (on_before_batch_transfer, transfer_batch_to_device,
    on_after_batch_transfer) Lightning runs`: the datamodule's or the module's, as Lightning 2.6.x's
    `_DataConnector._datahook_selector` picks; the module where a Lightning has no selector."""
    selector = getattr(getattr(trainer, "_data_connector", None), "_datahook_selector", None)
    if selector is None:
        return lambda name: module
    return selector.get_instance


def wrap_before_batch_transfer(module, wrap) -> None:
    """The loops' call of on_before_batch_transfer (Lightning 2.6.x `LightningModule._on_before_batch_transfer`, the
    hook runner the training, evaluation and prediction loops call on each batch) goes through `wrap(runner)` on
    this module; once (a second call keeps the first wrapper) until unwrap_before_batch_transfer."""
    if "_on_before_batch_transfer" in vars(module):
        return
    module._on_before_batch_transfer = wrap(module._on_before_batch_transfer)


def unwrap_before_batch_transfer(module) -> None:
    """Undo wrap_before_batch_transfer (Lightning 2.6.x)."""
    vars(module).pop("_on_before_batch_transfer", None)


def finetuning_restarting(callback) -> bool:
    """A BaseFinetuning callback that loaded its state and puts its param groups back in on_fit_start (Lightning
    2.6.x `BaseFinetuning._restarting`); False where a Lightning does not say."""
    return bool(getattr(callback, "_restarting", False))


def weight_averaging_callbacks() -> tuple[type, ...]:
    """The callbacks that average a copy of the module's parameters: StochasticWeightAveraging, and
    WeightAveraging (Lightning >= 2.6; absent before)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # pragma: no cover - older Lightning
        return (StochasticWeightAveraging,)
    return (WeightAveraging, StochasticWeightAveraging)


def take_over_sigterm(trainer, notifier) -> bool:
    """SIGTERM's handler becomes `notifier(signum, frame)` (Lightning 2.6.x: `_SignalConnector._sigterm_notifier_fn`,
    looked up on the instance when the handlers are registered, after the strategy's setup); False where absent."""
    connector = getattr(trainer, "_signal_connector", None)
    if not callable(getattr(connector, "_sigterm_notifier_fn", None)):
        return False
    connector._sigterm_notifier_fn = notifier
    return True


def take_over_sigterm_check(trainer, check) -> bool:
    """The training epoch loop's per-batch SIGTERM check becomes `check()` (Lightning 2.6.x
    `_TrainingEpochLoop._broadcast_sigterm_tensor`: a broadcast of rank 0's flag and a read-back every batch);
    False where absent."""
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if not callable(getattr(epoch_loop, "_broadcast_sigterm_tensor", None)):
        return False
    epoch_loop._broadcast_sigterm_tensor = check
    return True


def take_over_slurm_requeue(trainer, handler):
    """SLURM's requeue signal's handler (auto_requeue) becomes `handler(signum, frame)`; returns Lightning's own,
    bound (Lightning 2.6.x `_SignalConnector._slurm_sigusr_handler_fn`: saves a checkpoint, then requeues from rank
    0). None (and nothing replaced) where absent."""
    connector = getattr(trainer, "_signal_connector", None)
    own = vars(type(connector)).get("_slurm_sigusr_handler_fn") if connector is not None else None
    if not callable(own):
        return None
    connector._slurm_sigusr_handler_fn = handler
    return own.__get__(connector)


def note_sigterm(trainer) -> bool:
    """Set what Lightning's loops read as `trainer.received_sigterm` (Lightning 2.6.x
    `_SignalConnector.received_sigterm`); False where the trainer has no signal connector."""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None:
        return False
    connector.received_sigterm = True
    return True


def persistent_iterator_reset(source, before_reset) -> bool:
    """Run `before_reset(source)` before `iter(loader)` resets `source`, a DataLoader iterator with persistent workers
    (torch's private `_BaseDataLoaderIter._reset`, torch 2.11-2.13); False, doing nothing, for other iterators."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    if not isinstance(source, _BaseDataLoaderIter) or not getattr(source, "_persistent_workers", False):
        return False
    reset, it = type(source)._reset, weakref.ref(source)  # weakly: the iterator must not hold itself alive
    source._reset = lambda *args, **kwargs: (before_reset(it()), reset(it(), *args, **kwargs))[1]
    return True


def dataloader_batches_left(source) -> int | None:
    """The batches `source`, an iterator of a map-style DataLoader, has yet to give (its length less those it gave:
    torch's private `_BaseDataLoaderIter._num_yielded` and `_dataset_kind`, torch 2.11-2.13); None for other iterators
    (an iterable dataset's length is only its own claim)."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter, _DatasetKind

    if not isinstance(source, _BaseDataLoaderIter) or getattr(source, "_dataset_kind", None) != _DatasetKind.Map:
        return None
    try:
        return max(len(source) - int(source._num_yielded), 0)
    except (TypeError, AttributeError):  # a sampler without a length
        return None


def default_store():
    """The default process group's c10d Store (torch's private `_get_default_store`, torch 2.11-2.13), or None."""
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the caller does without
        return None


def validate_also_after(trainer, also) -> bool:
    """The fit's training loop also validates after a batch where `also()` is true (Lightning 2.6.x
    `_TrainingEpochLoop._should_check_val_fx(data_fetcher)`, asked after every batch); False where absent."""
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    own = getattr(epoch_loop, "_should_check_val_fx", None)
    if not callable(own):
        return False
    epoch_loop._should_check_val_fx = lambda data_fetcher: own(data_fetcher) or also()
    return True


def is_last_batch_of_epoch(trainer) -> bool:
    """Whether the fit's batch just run was its epoch's last (Lightning 2.6.x `batch_progress.is_last_batch`)."""
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    return bool(getattr(getattr(epoch_loop, "batch_progress", None), "is_last_batch", False))


def wandb_init_arguments(logger) -> dict:
    """The arguments WandbLogger gives wandb.init (Lightning 2.6.x `WandbLogger._wandb_init`, before its run starts);
    {} where absent. (It passes anonymous=None, which wandb >= 0.19 reports at every start as having no effect.)"""
    arguments = getattr(logger, "_wandb_init", None)
    return arguments if isinstance(arguments, dict) else {}


# fbgemm's TBE cache in prefetch-pipeline mode (fbgemm-gpu 1.6-1.8, split_table_batched_embeddings_ops_training):
# what its constructor sets up for prefetch_pipeline=True, and the per-lookup lists its forward pops: touched here only.
_PREFETCH_PIPELINE_PARTS = ("prefetch", "lxu_cache_state", "lock_cache_line", "use_uniq_cache_locations_bwd",
                            "_init_uvm_cache_counter", "_sync_stream_post_backward",
                            "_update_cache_counter_and_locations", "placeholder_autograd_tensor",
                            "timesteps_prefetched", "lxu_cache_locations_list", "cache_algorithm")


@functools.cache
def _prefetch_takes_stream(fn) -> bool:
    return _takes(fn, "forward_stream")


def tbe_prefetch_takes_stream(tbe) -> bool:
    """tbe.prefetch(indices, offsets, forward_stream=...): fbgemm-gpu >= 0.7 (1.6-1.8 have it). With it the prefetch
    may run on a side stream: fbgemm records its cache locations for the lookup's stream and syncs the two streams
    around the backward; without it the caller runs the prefetch on the lookup's stream."""
    fn = tbe.prefetch
    return _prefetch_takes_stream(getattr(fn, "__func__", fn))


def tbe_prefetch(tbe, indices, offsets, forward_stream) -> None:
    """The TBE's cache prefetch of one lookup's ids (forward_stream: the stream its lookup will run on, or None)."""
    if forward_stream is not None:
        tbe.prefetch(indices, offsets, forward_stream=forward_stream)
    else:
        tbe.prefetch(indices, offsets)


def tbe_enable_prefetch_pipeline(tbe) -> None:
    """Put a built fbgemm TBE's row cache in the mode its constructor's prefetch_pipeline=True gives (fbgemm-gpu
    1.6-1.8): cache lines locked from prefetch to backward, each backward's cache locations looked up again after
    the next batch's prefetch, and fbgemm's two stream hooks around the backward. Raises ValueError naming the parts
    this fbgemm lacks."""
    if getattr(tbe, "prefetch_pipeline", False):
        return
    missing = [p for p in _PREFETCH_PIPELINE_PARTS if not hasattr(tbe, p)]
    if missing:
        import fbgemm_gpu

        raise ValueError(f"PipelineConfig(prefetch=True): fbgemm-gpu {getattr(fbgemm_gpu, '__version__', '?')}'s "
                         f"TBE lacks {missing}, which its prefetch pipeline needs (checked on fbgemm-gpu 1.6-1.8): "
                         f"install one of those, or leave prefetch out")
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm

    if tbe.cache_algorithm != CacheAlgorithm.LRU:  # fbgemm's prefetch pipeline locks LRU cache lines only
        raise ValueError(f"PipelineConfig(prefetch=True): fbgemm's prefetch pipeline needs its LRU cache, and this "
                         f"TBE's cache is {tbe.cache_algorithm}: leave prefetch out")
    tbe.prefetch_pipeline = tbe.lock_cache_line = tbe.use_uniq_cache_locations_bwd = True
    tbe._init_uvm_cache_counter(tbe.lxu_cache_state.shape[0], persistent=True)  # the locking counter per cache line
    # as fbgemm's constructor: the prefetch stream waits for the backward, the backward for the prefetch
    tbe.placeholder_autograd_tensor.register_hook(tbe._sync_stream_post_backward)
    tbe.register_full_backward_pre_hook(tbe._update_cache_counter_and_locations)


def tbe_forget_prefetches(tbe) -> None:
    """Drop the prefetches a TBE holds for lookups that will not come (a batch dropped after its prefetch): its next
    lookup would read their cache locations as its own. Their cache lines are unlocked; that lookup fills its own."""
    stream = getattr(tbe, "prefetch_stream", None)
    if stream is not None:
        torch.cuda.current_stream().wait_stream(stream)
    if getattr(tbe, "lock_cache_line", False):
        for locations in tbe.lxu_cache_locations_list:
            torch.ops.fbgemm.lxu_cache_locking_counter_decrement(tbe.lxu_cache_locking_counter, locations)
    tbe.lxu_cache_locations_list.clear()
    tbe.timesteps_prefetched.clear()


def tbe_unlock_lookup(tbe) -> None:
    """A lookup that has no backward (evaluation, frozen tables) on a TBE in prefetch-pipeline mode: unlock the cache
    lines it locked, as fbgemm's backward pre-hook does; else they stay locked (never evicted) for good."""
    if getattr(tbe, "lock_cache_line", False) and getattr(tbe, "lxu_cache_locations", None) is not None:
        torch.ops.fbgemm.lxu_cache_locking_counter_decrement(tbe.lxu_cache_locking_counter, tbe.lxu_cache_locations)
