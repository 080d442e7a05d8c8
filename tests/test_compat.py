"""lightning_rec._compat: each torch probe and private Lightning accessor, pinned on the installed versions.

A Lightning or torch upgrade that moves one of these fails here, naming the accessor, instead of somewhere
inside a multi-rank fit (where the caller would quietly fall back to Lightning's own behaviour).
"""

from __future__ import annotations

import signal

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from lightning_rec import _compat


def _trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, **kwargs)


def test_torch_probes_on_the_installed_torch():
    assert torch.__version__.startswith("2.13")
    assert _compat.ddp_has_forward_sync_buffers()
    assert _compat.compiler_disable_takes_reason()
    assert _compat.distribute_tensor_takes_src_data_rank()
    assert _compat.pytree_takes_flatten_with_keys()
    assert all(issubclass(e, RuntimeError) for e in _compat.dynamo_capture_errors())
    defaults = _compat.ddp_keyword_defaults()
    assert defaults["process_group"] is None and defaults["gradient_as_bucket_view"] is False
    assert "module" not in defaults  # no default: not an argument a recipe can spell out at its default


def test_a_copied_loader_forgets_its_iterator():
    loader = DataLoader(list(range(4)), batch_size=2)
    assert "_iterator" in vars(loader)  # torch keeps the persistent workers' iterator there
    loader._iterator = object()
    _compat.forget_loader_iterator(loader)
    assert loader._iterator is None


def test_sampler_resolution_is_the_data_connectors():
    trainer = _trainer()
    resolve, requires = _compat.sampler_resolution(trainer)
    loader = DataLoader(list(range(4)), batch_size=2)
    assert isinstance(resolve(loader, False, mode=None), SequentialSampler)
    assert requires(loader) is False  # one device: no DistributedSampler

    def mine(dataloader, shuffle, mode=None):
        return resolve(dataloader, shuffle, mode)

    _compat.set_sampler_resolution(trainer, mine)
    assert _compat.sampler_resolution(trainer)[0] is mine
    assert _compat.sampler_resolution(object()) is None


def test_puts_in_distributed_sampler_under_a_distributed_strategy_at_one_device_too():
    assert not _compat.puts_in_distributed_sampler(_trainer())
    assert _compat.puts_in_distributed_sampler(_trainer(strategy="ddp"))  # one device: Lightning's sampler all the same
    assert not _compat.puts_in_distributed_sampler(_trainer(strategy="ddp", use_distributed_sampler=False))
    assert not _compat.puts_in_distributed_sampler(object())


def test_update_dataloader_and_the_predict_index_wrapper():
    from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
    from lightning.pytorch.trainer.states import RunningStage

    loader = DataLoader(list(range(6)), batch_size=2)
    again = _compat.update_dataloader(loader, SequentialSampler(range(3)), RunningStage.VALIDATING)
    assert [b.tolist() for b in again] == [[0, 1], [2]]
    batches = BatchSampler(SequentialSampler(range(4)), 2, False)
    assert _compat.is_index_batch_sampler(_IndexBatchSamplerWrapper(batches))
    assert not _compat.is_index_batch_sampler(batches)


def test_loop_accessors_inside_a_fit():
    seen = {}

    class Data(BoringDataModule):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            return batch

    class Look(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            combined = _compat.combined_loader(trainer.fit_loop)
            seen["train"] = (_compat.combined_mode(combined), list(combined.flattened))
            owner = _compat.batch_hook_owner(trainer, module)
            seen["owners"] = (owner("on_before_batch_transfer"), owner("transfer_batch_to_device"))

        def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
            seen["val"] = _compat.combined_mode(_compat.combined_loader(trainer.fit_loop.epoch_loop.val_loop))

    trainer = _trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=1, num_sanity_val_steps=0,
                       callbacks=[Look()])
    assert _compat.combined_loader(trainer.fit_loop) is None  # before the loop sets up
    data, module = Data(), BoringModel()
    trainer.fit(module, data)
    mode, flattened = seen["train"]
    assert mode == "max_size_cycle" and len(flattened) == 1 and isinstance(flattened[0], DataLoader)
    assert seen["val"] == "sequential"
    assert seen["owners"] == (data, module)
    assert _compat.batch_hook_owner(object(), module)("on_before_batch_transfer") is module


def test_wrapping_the_before_batch_transfer_runner():
    module = BoringModel()
    runner = module._on_before_batch_transfer
    assert runner(7, dataloader_idx=0) == 7
    _compat.wrap_before_batch_transfer(module, lambda run: lambda batch, dataloader_idx=0: ("mine", run(batch)))
    _compat.wrap_before_batch_transfer(module, lambda run: lambda batch, dataloader_idx=0: "second")  # kept first
    assert module._on_before_batch_transfer(7) == ("mine", 7)
    _compat.unwrap_before_batch_transfer(module)
    assert module._on_before_batch_transfer(7, dataloader_idx=0) == 7


def test_finetuning_restarting_and_weight_averaging():
    from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging, WeightAveraging

    finetuning = BaseFinetuning()
    assert not _compat.finetuning_restarting(finetuning)
    finetuning.load_state_dict({"internal_optimizer_metadata": {}})
    assert _compat.finetuning_restarting(finetuning)
    assert set(_compat.weight_averaging_callbacks()) == {WeightAveraging, StochasticWeightAveraging}


def test_signal_takeover_reaches_the_handlers_lightning_registers():
    trainer = _trainer()
    calls = []

    def notifier(signum, frame):
        calls.append(("sigterm", signum))

    assert _compat.take_over_sigterm(trainer, notifier)
    connector = trainer._signal_connector
    before = signal.getsignal(signal.SIGTERM)
    connector.register_signal_handlers()
    try:
        assert notifier in signal.getsignal(signal.SIGTERM).signal_handlers
    finally:
        connector.teardown()
    assert signal.getsignal(signal.SIGTERM) == before

    check = object()
    assert _compat.take_over_sigterm_check(trainer, check)
    assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor is check

    own = _compat.take_over_slurm_requeue(trainer, notifier)
    assert own.__func__ is type(connector)._slurm_sigusr_handler_fn and own.__self__ is connector
    assert connector._slurm_sigusr_handler_fn is notifier

    assert not trainer.received_sigterm
    assert _compat.note_sigterm(trainer) and trainer.received_sigterm
    assert not _compat.take_over_sigterm(object(), notifier) and not _compat.note_sigterm(object())
    assert _compat.take_over_slurm_requeue(object(), notifier) is None


def test_a_persistent_iterator_runs_the_hook_before_its_reset():
    """The pipeline stops its feeder before `iter(loader)` resets a persistent-workers iterator (torch's private
    _BaseDataLoaderIter._reset); other iterators are left alone."""
    from torch.utils.data import DataLoader

    from lightning_rec._compat import default_store, persistent_iterator_reset

    calls = []
    loader = DataLoader(list(range(4)), batch_size=2, num_workers=1, persistent_workers=True)
    it = iter(loader)
    assert persistent_iterator_reset(it, lambda source: calls.append(source is it))
    assert list(iter(loader)) and calls == [True]  # the same iterator, reset for a new pass
    assert not persistent_iterator_reset(iter([1, 2]), lambda source: None)
    assert default_store() is None  # no process group here


def test_validating_after_a_batch_and_the_last_batch_flag():
    seen = []

    class Seeing(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            assert _compat.validate_also_after(trainer, lambda: trainer.global_step == 3)

        def on_train_batch_end(self, trainer, *args):
            seen.append(_compat.is_last_batch_of_epoch(trainer))

        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                seen.append(("validated", trainer.global_step))

    trainer = _trainer(max_steps=4, limit_train_batches=4, limit_val_batches=1, val_check_interval=4,
                       num_sanity_val_steps=0, callbacks=[Seeing()])
    trainer.fit(BoringModel(), BoringDataModule())
    assert seen == [False, False, False, ("validated", 3), True, ("validated", 4)], seen


def test_the_wandb_loggers_init_arguments():
    from lightning.pytorch.loggers import WandbLogger

    arguments = _compat.wandb_init_arguments(WandbLogger(project="p", offline=True))
    assert arguments["project"] == "p" and arguments["anonymous"] is None  # what wandb says has no effect


def test_fbgemm_prefetch_pipeline_parts_on_the_installed_fbgemm():
    """The parts of fbgemm's TBE that PipelineConfig(prefetch=True) switches on after construction (fbgemm-gpu-cpu
    1.8.0 ships the same Python module as the CUDA wheel): prefetch takes forward_stream, and the switch sets what
    fbgemm's constructor sets for prefetch_pipeline=True (a locking counter per cache line, two backward hooks)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen([(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)])
    assert _compat.tbe_prefetch_takes_stream(tbe)
    assert not tbe.prefetch_pipeline and not tbe._backward_pre_hooks
    _compat.tbe_enable_prefetch_pipeline(tbe)
    assert tbe.prefetch_pipeline and tbe.lock_cache_line and tbe.use_uniq_cache_locations_bwd
    assert tbe.lxu_cache_locking_counter.shape == (tbe.lxu_cache_state.shape[0], 32)
    assert "lxu_cache_locking_counter" in tbe.state_dict()
    assert len(tbe._backward_pre_hooks) == 1 and tbe.placeholder_autograd_tensor._backward_hooks
    _compat.tbe_enable_prefetch_pipeline(tbe)  # once only
    assert len(tbe._backward_pre_hooks) == 1
    # the lock counter's op (CUDA kernels only) is fbgemm's; forgetting empties the lists fbgemm's forward pops
    assert torch.ops.fbgemm.lxu_cache_locking_counter_decrement.default is not None
    tbe.lxu_cache_locations_list.append(torch.zeros(0, dtype=torch.int32))
    tbe.timesteps_prefetched.append(2)
    tbe.lock_cache_line = False
    _compat.tbe_forget_prefetches(tbe)
    assert tbe.lxu_cache_locations_list == [] and tbe.timesteps_prefetched == []
