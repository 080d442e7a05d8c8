"""What the GPU needs, checked on CPU: padded dims, one weighted-mean meaning, no host sync, torch 2.11 DDP.

fbgemm's CUDA TBE takes dims that are multiples of 4 only, its weighted MEAN pooling divides the
forward but not the gradient by the bag size, and the GPU step is bound by host time. Each fix is
device-independent code, so it is tested here by forcing the GPU's choice on CPU (fbgemm's CPU
kernel, padding to 4) against the unpadded module or a few-line autograd reference. The same
tests run on a GPU with `pytest -m gpu` (README, "Testing on a GPU").
"""

import inspect

import pytest
import torch
from test_embedding import random_kjt
from torch import nn

from lightning_rec import lookup
from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from lightning_rec.optim import FusedOptimizer, FusedOptimizerConfig
from lightning_rec.sparse import KeyedJaggedTensor

# fp32; the padded row-wise kernel scales the gradient by sqrt(P/D) and the rate by its inverse,
# which reorders roundings only (relative 1e-7 per step), so 5 steps agree to 1e-6.
ATOL = 1e-6


def _tables(dims, pooling="sum"):
    return [EmbeddingBagConfig(name=f"t{i}", num_embeddings=40, embedding_dim=d, feature_names=[f"f{i}"],
                               pooling=pooling) for i, d in enumerate(dims)]


def _train(ebc, kjts):
    outs = []
    for kjt in kjts:
        out = ebc(kjt).values()
        (out * torch.linspace(-1, 1, out.shape[1], device=out.device)).sum().backward()
        outs.append(out.detach())
    return outs


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_padded_dims_train_like_unpadded(optimizer):
    """fbgemm's TBE (CPU and CUDA alike) takes dims in multiples of 4; the native CPU kernel any dim.

    Without weight decay: fbgemm's L2 decay differs from torch.optim's (and the native kernel's) even
    unpadded (its Adagrad state accumulates g^2 without the decay term), so it is not compared here.
    """
    dims = [6, 3, 8, 2]
    opt = FusedOptimizerConfig(optimizer, lr=0.1)
    padded = EmbeddingBagCollection(_tables(dims), optimizer=opt, kernel="fbgemm")
    kernels = padded.lookup.fused_kernels()
    assert any(k._padded != k._dims for k in kernels)  # the padding is real
    plain = EmbeddingBagCollection(_tables(dims), optimizer=opt, kernel="native")
    plain.load_state_dict(padded.state_dict())
    # Outputs, weights and state dicts show the configured dims.
    assert {k: tuple(v.shape) for k, v in padded.state_dict().items()} == \
           {f"embedding_bags.t{i}.weight": (40, d) for i, d in enumerate(dims)}
    kjts = [random_kjt([f"f{i}" for i in range(4)], [40] * 4, B=6, seed=s) for s in range(5)]
    for a, b in zip(_train(padded, kjts), _train(plain, kjts)):
        assert a.shape == b.shape == (6, sum(dims))
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    for name, w in plain.state_dict().items():
        torch.testing.assert_close(padded.state_dict()[name], w, atol=ATOL, rtol=0)
    sp, sq = FusedOptimizer(padded).state_dict()["state"], FusedOptimizer(plain).state_dict()["state"]
    assert sp.keys() == sq.keys()
    for key in sq:
        torch.testing.assert_close(sp[key], sq[key], atol=ATOL, rtol=1e-5)
    # The padding stays zero and the learning rate reads as configured.
    for k in padded.lookup.fused_kernels():
        for w, d in zip(k.tbe.split_embedding_weights(), k._dims):
            assert not w[:, d:].any()
        assert k.get_learning_rate() == pytest.approx(0.1)


def test_padded_state_loads_both_ways():
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.1)
    padded = EmbeddingBagCollection(_tables([6, 5]), optimizer=opt, kernel="fbgemm")
    _train(padded, [random_kjt(["f0", "f1"], [40, 40], B=4, seed=1)])
    plain = EmbeddingBagCollection(_tables([6, 5]), optimizer=opt, kernel="native")
    plain.load_state_dict(padded.state_dict())
    FusedOptimizer(plain).load_state_dict(FusedOptimizer(padded).state_dict())
    kjt = random_kjt(["f0", "f1"], [40, 40], B=4, seed=2)
    torch.testing.assert_close(plain(kjt).values(), padded(kjt).values(), atol=ATOL, rtol=0)


def test_padded_sequence_table():
    cfg = [EmbeddingConfig(name="s", num_embeddings=30, embedding_dim=6, feature_names=["hist"])]
    ec = EmbeddingCollection(cfg, optimizer=FusedOptimizerConfig("sgd", lr=0.5), kernel="fbgemm")
    assert ec.lookup.fused_kernels()[0]._padded == [8]
    ref = ec.embeddings["s"].weight.detach().clone().requires_grad_()
    kjt = KeyedJaggedTensor.from_lengths_sync(["hist"], torch.tensor([1, 2, 2, 7]), torch.tensor([3, 1]))
    out = ec(kjt)["hist"].values()
    assert out.shape == (4, 6)
    torch.testing.assert_close(out, ref[kjt.values()], atol=0, rtol=0)
    out.pow(2).sum().backward()
    ref[kjt.values()].pow(2).sum().backward()
    torch.testing.assert_close(ec.embeddings["s"].weight, ref.detach() - 0.5 * ref.grad, atol=ATOL, rtol=0)


def test_padded_partial_rowwise_adam_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="multiples of 4.*adam / rowwise_adagrad"):
        lookup.FusedKernel([lookup.LocalTable("t", 10, 6, ("f",), "sum")], "sum",
                           FusedOptimizerConfig("partial_rowwise_adam"), torch.device("cpu"), "fbgemm")


@pytest.mark.parametrize("kernel", ["fbgemm", "native"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_weighted_mean_is_sum_of_w_e_over_count_in_forward_and_backward(kernel, optimizer):
    """The issue's example: bags {1, 2, 3 with weights .5, 2, 1} and {2 with weight 3}; reference: autograd."""
    cfg = [EmbeddingBagConfig(name="t", num_embeddings=5, embedding_dim=4, feature_names=["f"], pooling="mean")]
    ebc = EmbeddingBagCollection(cfg, is_weighted=True, optimizer=FusedOptimizerConfig(optimizer, lr=1.0),
                                 kernel=kernel)
    ref = nn.Parameter(ebc.embedding_bags["t"].weight.detach().clone())
    ref_opt = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rowwise_adagrad": torch.optim.SGD}[optimizer]
    ref_opt = ref_opt([ref], lr=1.0)
    for _ in range(3):
        kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2, 3, 2]), torch.tensor([3, 1]),
                                                  weights=torch.tensor([0.5, 2.0, 1.0, 3.0]))
        out = ebc(kjt).values()
        ref_out = torch.stack([(torch.tensor([0.5, 2.0, 1.0])[:, None] * ref[[1, 2, 3]]).sum(0) / 3,
                               3.0 * ref[2] / 1])
        torch.testing.assert_close(out, ref_out.detach(), atol=1e-6, rtol=1e-6)
        grad = torch.arange(8.0).view(2, 4)
        (out * grad).sum().backward()
        ref_opt.zero_grad()
        (ref_out * grad).sum().backward()
        if optimizer == "rowwise_adagrad":  # s_row += mean_d(g^2); w -= lr * g / (sqrt(s_row) + eps)
            state = ref_opt.state.setdefault("s", torch.zeros(5))
            with torch.no_grad():
                state += ref.grad.pow(2).mean(1)
                ref -= ref.grad / (state.sqrt() + 1e-8)[:, None]
        else:
            ref_opt.step()
        torch.testing.assert_close(ebc.embedding_bags["t"].weight.detach(), ref.detach(), atol=1e-5, rtol=0)


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records every tensor read back to Python (`.item()`, `.tolist()`, `bool()`, `int()`) made by our code."""

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self):
        super().__init__()
        self.sites = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            caller = inspect.stack()[1]
            if "lightning_rec" in caller.filename and "/tests/" not in caller.filename:
                self.sites.append(f"{caller.filename}:{caller.lineno} {func.__name__}")
        return func(*args, **(kwargs or {}))


def test_fixed_size_batch_path_reads_nothing_back(monkeypatch):
    """The collection's step on a batch already in kernel order reads no tensor back to the host.

    On GPU every such read is a stream sync. With the batch checked on its host copy (as `.to("cuda")`
    keeps it), our part of the step has none: the reads of our code are recorded here on CPU, with the
    host-copy check stubbed out as it would be for a device batch. (fbgemm's own reads of its CPU
    iteration counter are not device reads and are not counted.)
    """
    ebc = EmbeddingBagCollection(_tables([8, 8]), optimizer=FusedOptimizerConfig("rowwise_adagrad"), kernel="fbgemm")
    kjt = KeyedJaggedTensor(["f1", "f0"], torch.randint(0, 40, (16,)), lengths=torch.ones(16, dtype=torch.int64))
    monkeypatch.setattr("lightning_rec.embedding.check_features", lambda *a, **k: None)
    ebc(kjt)  # warm the caches (permutation, host-side tables)
    with _HostReads() as reads:
        for _ in range(3):
            fresh = KeyedJaggedTensor(["f1", "f0"], torch.randint(0, 40, (16,)),
                                      lengths=torch.ones(16, dtype=torch.int64), _validate=False)
            ebc(fresh).values().sum().backward()
    assert reads.sites == []


def test_ddp_arguments_are_feature_detected(monkeypatch):
    """torch 2.11's DDP has no forward_sync_buffers: DistributedModelParallel must not pass it there, and
    turns the per-forward buffer broadcast off the old way (tests/test_model_parallel.py checks it for real)."""
    from torch.nn.parallel import DistributedDataParallel

    from lightning_rec import model_parallel

    seen = {}

    class DDP211(DistributedDataParallel):
        def __init__(self, module, device_ids=None, process_group=None, gradient_as_bucket_view=False):
            seen["kwargs"] = dict(device_ids=device_ids, gradient_as_bucket_view=gradient_as_bucket_view)
            nn.Module.__init__(self)

    assert "forward_sync_buffers" not in inspect.signature(DDP211.__init__).parameters
    monkeypatch.setattr("torch.nn.parallel.DistributedDataParallel", DDP211)
    # the probe is cached per process (an earlier test in this worker may have asked the real DDP): ask it afresh
    from lightning_rec._compat import ddp_has_forward_sync_buffers

    monkeypatch.setattr(model_parallel, "ddp_has_forward_sync_buffers", ddp_has_forward_sync_buffers.__wrapped__)
    ddp = model_parallel.DistributedModelParallel._wrap_dense(nn.Linear(2, 2), "ddp", torch.device("cpu"), None, {})
    assert seen["kwargs"]["gradient_as_bucket_view"] is True
    assert ddp.broadcast_buffers is False  # synced at construction, not before every forward


def test_device_bounds_check_reports_every_bad_lookup_from_its_block(monkeypatch):
    """The lazy check of GPU-built batches (batch_check.DeviceBoundsCheck), run here on fbgemm's CPU kernel in
    the mode the GPU path uses (BoundsCheckMode.WARNING: fbgemm zeroes its counter at each call, counts the bad
    ids and reads them as row 0). Each lookup counts into its own slot; a block of copy_every lookups is read
    back at once; a later call raises naming the tables, the features and the lookup, once per bad batch (a
    second bad batch with the same count too: comparing with the last count seen missed it); a block is never
    overwritten unread. Two kernels (one table each), as a collection groups tables by dim and optimizer."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from lightning_rec.batch_check import DeviceBoundsCheck

    monkeypatch.setattr(DeviceBoundsCheck, "copy_every", 4)
    kernels = {t: SplitTableBatchedEmbeddingBagsCodegen([(rows, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                                                        bounds_check_mode=BoundsCheckMode.WARNING, device="cpu")
               for t, rows in (("users", 10), ("items", 20))}
    check = DeviceBoundsCheck(torch.tensor([10, 20]), ["users", "items"], "EmbeddingBagCollection",
                              [(tbe, [t]) for t, tbe in kernels.items()], ["user", "item"])

    def step(item_id: int, before: bool = True) -> None:
        kjt = KeyedJaggedTensor(["user", "item"], torch.tensor([1, item_id]), lengths=torch.tensor([1, 1]),
                                _validate=False)
        if before:
            check.before_lookup()
        for tbe, ids in zip(kernels.values(), kjt.values().split(1)):  # views: fbgemm writes through
            tbe(ids, torch.tensor([0, 1]))
        check.after_lookup()

    for _ in range(2 * DeviceBoundsCheck.SLOTS * 4):  # more blocks than the ring has
        step(3)
    step(25)  # lookup 33: trains, reading row 0
    for _ in range(3):  # lookups 34-36: the block is read back after 36
        step(3)
    said = (r"GPU batch had 1 id\(s\) outside their table in table\(s\) 'items' of EmbeddingBagCollection, read "
            r"by feature\(s\) 'item': the batch of lookup {} of this EmbeddingBagCollection \(its latest: {}\)"
            r".*\.to\('cuda'\)")
    with pytest.raises(ValueError, match=said.format(33, 36)):
        step(3)
    for _ in range(7):  # reported once (lookups 37-43: the call that raised looked nothing up)
        step(3)
    step(25)  # lookup 44, the last of its block: the same count again is a new bad batch, reported too
    with pytest.raises(ValueError, match=said.format(44, 44)):
        step(3)
    # nobody asks (no before_lookup) while the ring goes round: the block holding a bad lookup is read before its
    # slot is reused, so the count is never lost
    for i in range(DeviceBoundsCheck.SLOTS * 4 + 3):  # lookups 45-63, the bad one 46
        step(25 if i == 1 else 3, before=False)
    with pytest.raises(ValueError, match=r"lookup 46 of .*\(its latest: 64\)"):
        step(3, before=False)  # lookup 64 ends a block that reuses 45-48's slot


def test_device_bounds_check_of_a_kernel_with_several_tables_names_the_feature_from_the_batch_of_the_call(monkeypatch):
    """fbgemm counts the bad ids of a kernel's tables together (a collection puts every table of one dim and
    optimizer in one kernel), so the count alone says "one or more of these tables". When it is read back, the
    batch of that call is checked on the host (a sync on the error path only): a data pipeline's bad ids recur, and
    then the error names the feature, table and id exactly, and that batch is not looked up."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from lightning_rec.batch_check import DeviceBoundsCheck

    monkeypatch.setattr(DeviceBoundsCheck, "copy_every", 2)
    tbe = SplitTableBatchedEmbeddingBagsCodegen([(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU),
                                                 (20, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                                                bounds_check_mode=BoundsCheckMode.WARNING, device="cpu")
    rows_F, tables_F = torch.tensor([10, 20]), ["users", "items"]
    check = DeviceBoundsCheck(rows_F, tables_F, "EmbeddingBagCollection", [(tbe, tables_F)], ["user", "item"])

    def batch(item_id: int) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(["user", "item"], torch.tensor([1, item_id]), lengths=torch.tensor([1, 1]))

    def step(kjt: KeyedJaggedTensor) -> None:
        check.before_lookup(kjt, rows_F, tables_F)
        tbe(kjt.values(), kjt.offsets())
        check.after_lookup()

    step(batch(25))  # lookup 1: counted, read as row 0
    step(batch(3))  # lookup 2 ends the block
    kernel = (r"1 id\(s\) outside their table in one or more of the 2 table\(s\) 'users', 'items' \(one fbgemm "
              r"kernel, one count\) of EmbeddingBagCollection, read by feature\(s\) 'user', 'item': the batch of "
              r"lookup 1 ")
    with pytest.raises(ValueError, match=kernel + r".*The batch of this call is fine \(not looked up\)\.$"):
        step(batch(3))
    step(batch(21))  # lookup 3
    step(batch(3))  # lookup 4 ends the block
    before = tbe.split_embedding_weights()[1].clone()
    with pytest.raises(ValueError, match=r"lookup 3 .*The batch of this call has the problem too \(not looked up\): "
                                         r"feature 'item' has id 30 outside table 'items' \(valid ids 0..19\)"):
        step(batch(30))
    assert torch.equal(tbe.split_embedding_weights()[1], before)


def test_device_id_guard_reads_bad_ids_as_row_0_and_names_the_feature():
    """The sharded collections' check of GPU batches never on the host (batch_check.DeviceIdGuard), run here on
    CPU tensors: ids outside their table (and negative ones) are read as row 0 before routing (row-wise routing
    would send them to another shard's rows, or past its tables), counted per feature on the device, and a later
    call raises naming the feature, its table and the lookup; an empty batch goes through."""
    from lightning_rec.batch_check import DeviceIdGuard

    guard = DeviceIdGuard(torch.tensor([10, 20]), ["users", "items"], ["user", "item"],
                          "sharded EmbeddingBagCollection", torch.device("cpu"), copy_every=4)

    def kjt(user_ids, item_ids):
        return KeyedJaggedTensor(["user", "item"], torch.tensor(user_ids + item_ids),
                                 lengths=torch.tensor([1] * len(user_ids) + [1] * len(item_ids)), _validate=False)

    assert guard(kjt([1, 2], [3, 4])).values().tolist() == [1, 2, 3, 4]  # lookup 1
    assert guard(kjt([1, -1], [25, 19])).values().tolist() == [1, 0, 0, 19]  # lookup 2: a bad id in each
    empty = KeyedJaggedTensor(["user", "item"], torch.empty(0, dtype=torch.int64),
                              lengths=torch.empty(0, dtype=torch.int64), _validate=False)
    assert guard(empty).values().numel() == 0  # lookup 3
    guard(kjt([1, 2], [3, 4]))  # lookup 4: the block is read back
    said = (r"GPU batch had ids outside their tables \(feature 'user': 1 id\(s\) outside table 'users' \(valid "
            r"ids 0\.\.9\); feature 'item': 1 id\(s\) outside table 'items' \(valid ids 0\.\.19\)\) of sharded "
            r"EmbeddingBagCollection: the batch of lookup 2 .*\(its latest: 4\)")
    with pytest.raises(ValueError, match=said):
        guard(kjt([1, 2], [3, 4]))
    for _ in range(6):  # reported once (lookups 5-10)
        guard(kjt([1, 2], [3, 4]))
    guard(kjt([1, 2], [3, 20]))  # lookup 11
    guard(kjt([1, 2], [3, 4]))  # lookup 12
    with pytest.raises(ValueError, match=r"\(feature 'item': 1 id\(s\) outside table 'items' \(valid ids 0\.\.19\)\)"
                                         r" of sharded EmbeddingBagCollection: the batch of lookup 11"):
        guard(kjt([1, 2], [3, 4]))


# On a GPU (`pytest -m gpu`; skipped elsewhere) ---------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and fbgemm-gpu (CUDA build)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_cuda_collection_matches_cpu(optimizer, pooling, weighted):
    """Any dim (6 and 3 are padded on the GPU), every pooling, weighted mean included: GPU vs the CPU module."""
    dims = [8, 6, 3]
    opt = FusedOptimizerConfig(optimizer, lr=0.05)
    cpu = EmbeddingBagCollection(_tables(dims, pooling), is_weighted=weighted, optimizer=opt, kernel="native")
    gpu = EmbeddingBagCollection(_tables(dims, pooling), is_weighted=weighted, optimizer=opt, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    for seed in range(5):
        kjt = random_kjt(["f0", "f1", "f2"], [40] * 3, B=16, weighted=weighted, seed=seed)
        a, b = cpu(kjt).values(), gpu(kjt.to("cuda")).values()
        torch.testing.assert_close(b.cpu(), a.detach(), atol=1e-5, rtol=1e-5)
        grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(seed))
        (a * grad).sum().backward()
        (b * grad.cuda()).sum().backward()
    for name, w in cpu.state_dict().items():
        torch.testing.assert_close(gpu.state_dict()[name].cpu(), w, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_cuda_bad_ids_from_the_host_are_refused_before_any_update():
    gpu = EmbeddingBagCollection(_tables([8, 6]), optimizer=FusedOptimizerConfig("sgd"), device="cuda")
    before = {k: v.clone() for k, v in gpu.state_dict().items()}
    kjt = KeyedJaggedTensor(["f0", "f1"], torch.tensor([1, 40]), lengths=torch.tensor([1, 1])).to("cuda")
    with pytest.raises(ValueError, match="feature 'f1' has id 40 outside table 't1'"):
        gpu(kjt).values().sum().backward()
    for k, v in gpu.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.gpu
@needs_cuda
def test_cuda_bad_ids_built_on_the_device_are_reported_on_a_later_call():
    gpu = EmbeddingBagCollection(_tables([8, 8]), optimizer=FusedOptimizerConfig("sgd"), device="cuda")
    lengths = torch.ones(4, dtype=torch.int64, device="cuda")
    good = KeyedJaggedTensor(["f0", "f1"], torch.tensor([1, 2, 3, 4], device="cuda"), lengths=lengths)
    from lightning_rec.batch_check import DeviceBoundsCheck

    def bad() -> KeyedJaggedTensor:  # a new one each time: fbgemm rewrites a looked-up batch's bad ids to 0 in place
        return KeyedJaggedTensor(["f0", "f1"], torch.tensor([1, 2, 3, 99], device="cuda"), lengths=lengths)

    gpu(bad()).values().sum().backward()  # lookup 1, no sync: fbgemm reads row 0 and counts the bad id
    for _ in range(DeviceBoundsCheck.copy_every - 1):  # the rest of its block: read back after the block's last
        gpu(good)
    torch.cuda.synchronize()
    # both tables have dim 8: one fbgemm kernel, whose count covers both; the batch of the raising call is checked
    named = (r"1 id\(s\) outside their table in one or more of the 2 table\(s\) 't0', 't1' \(one fbgemm kernel, "
             r"one count\) of EmbeddingBagCollection, read by feature\(s\) 'f0', 'f1': the batch of lookup 1 of this "
             r"EmbeddingBagCollection")
    with pytest.raises(ValueError, match=named + ".*never on the host.*The batch of this call is fine"):
        gpu(good)
    gpu(bad())  # a later bad batch: named exactly by the call that reads its block back, if that batch is bad too
    for _ in range(DeviceBoundsCheck.copy_every - 1):
        gpu(good)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"lookup 33 .*has the problem too .*'f1' has id 99 outside table 't1'"):
        gpu(bad())
    for _ in range(2 * DeviceBoundsCheck.copy_every):  # reported once; good batches go on
        gpu(good)


@pytest.mark.gpu
@needs_cuda
def test_cuda_device_id_guard_copies_a_block_after_rows_written_on_another_stream():
    """A pipeline routes its first batch on the step's stream and later ones on its feeder's: the block's copy to
    the host waits for every stream that wrote one of its rows (here the bad row on a side stream, busy first)."""
    from lightning_rec.batch_check import DeviceIdGuard

    guard = DeviceIdGuard(torch.tensor([10, 20]), ["users", "items"], ["user", "item"],
                          "sharded EmbeddingBagCollection", torch.device("cuda"), copy_every=4)

    def kjt(item_id):
        return KeyedJaggedTensor(["user", "item"], torch.tensor([1, item_id], device="cuda"),
                                 lengths=torch.tensor([1, 1], device="cuda"), _validate=False)

    bad = kjt(25)  # built first: a copy from pageable host memory would wait for the stream it runs on
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keeps the side stream busy: a copy that did not wait would read a zero
        guard(bad)  # lookup 1, its row written on the side stream (nothing here waits for it on the host)
    for _ in range(3):  # lookups 2-4 on the default stream; the block is copied after lookup 4
        guard(kjt(3))
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"feature 'item': 1 id\(s\) outside table 'items'.* lookup 1 "):
        guard(kjt(3))


@pytest.mark.gpu
@needs_cuda
def test_cuda_checkpoint_loads_on_cpu_and_back():
    gpu = EmbeddingBagCollection(_tables([8, 6]), optimizer=FusedOptimizerConfig("rowwise_adagrad"), device="cuda")
    _train(gpu, [random_kjt(["f0", "f1"], [40, 40], B=4, seed=1).to("cuda")])
    cpu = EmbeddingBagCollection(_tables([8, 6]), optimizer=FusedOptimizerConfig("rowwise_adagrad"))
    cpu.load_state_dict({k: v.cpu() for k, v in gpu.state_dict().items()})
    FusedOptimizer(cpu).load_state_dict(FusedOptimizer(gpu).state_dict())
    back = EmbeddingBagCollection(_tables([8, 6]), optimizer=FusedOptimizerConfig("rowwise_adagrad"), device="cuda")
    back.load_state_dict(cpu.state_dict())
    FusedOptimizer(back).load_state_dict(FusedOptimizer(cpu).state_dict())
    kjt = random_kjt(["f0", "f1"], [40, 40], B=4, seed=2)
    torch.testing.assert_close(back(kjt.to("cuda")).values().cpu(), cpu(kjt).values(), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_cuda_fp16_tables_and_sequence_dim_6():
    cfg = [EmbeddingConfig(name="s", num_embeddings=30, embedding_dim=6, feature_names=["hist"], data_type="float16")]
    ec = EmbeddingCollection(cfg, optimizer=FusedOptimizerConfig("rowwise_adagrad"), device="cuda")
    kjt = KeyedJaggedTensor.from_lengths_sync(["hist"], torch.tensor([1, 2, 2, 7]), torch.tensor([3, 1])).to("cuda")
    out = ec(kjt)["hist"].values()
    assert out.shape == (4, 6)
    out.float().sum().backward()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("optimizer", ["partial_rowwise_adam", "lamb", "lars_sgd"])
def test_cuda_gpu_only_and_adam_variants_train(optimizer):
    """The fused optimizers beyond the CPU parity set: partial row-wise Adam matches the CPU kernel (dims in
    multiples of 4); LAMB and LARS (GPU only) lower a least-squares loss, finite, and round-trip their state."""
    dims = [8, 4, 12]
    opt = FusedOptimizerConfig(optimizer, lr=0.01)
    gpu = EmbeddingBagCollection(_tables(dims), optimizer=opt, device="cuda")
    kjts = [random_kjt(["f0", "f1", "f2"], [40] * 3, B=16, seed=s) for s in range(20)]
    if optimizer == "partial_rowwise_adam":
        cpu = EmbeddingBagCollection(_tables(dims), optimizer=opt, kernel="native")
        gpu.load_state_dict(cpu.state_dict())
        _train(cpu, kjts[:5])
        _train(gpu, [k.to("cuda") for k in kjts[:5]])
        for name, w in cpu.state_dict().items():
            torch.testing.assert_close(gpu.state_dict()[name].cpu(), w, atol=1e-5, rtol=1e-4)
        return
    losses = []
    fixed = kjts[0].to("cuda")  # one batch again and again: its loss falls step by step (20 different batches'
    for _ in range(20):  # losses are noise around a slow LARS descent: that failed once under pytest -n 8)
        out = gpu(fixed).values()  # pull every pooled embedding towards 1: a loss any working optimizer lowers
        loss = ((out - 1.0) ** 2).mean()
        loss.backward()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    again = EmbeddingBagCollection(_tables(dims), optimizer=opt, device="cuda")
    again.load_state_dict(gpu.state_dict())
    FusedOptimizer(again).load_state_dict(FusedOptimizer(gpu).state_dict())
    kjt = kjts[0].to("cuda")
    torch.testing.assert_close(again(kjt).values(), gpu(kjt).values())


def _planner_uvm_worker(rank, W):
    """A planner told the GPU is small places the big table in host memory (UVM, with a device cache)."""
    from lightning_rec.model_parallel import DistributedModelParallel
    from lightning_rec.planner import EmbeddingShardingPlanner, Topology

    tables = [EmbeddingBagConfig(name="big", num_embeddings=2_000_000, embedding_dim=64, feature_names=["f0"]),
              EmbeddingBagConfig(name="small", num_embeddings=1000, embedding_dim=8, feature_names=["f1"])]
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.05)

    def build(hbm_cap):
        torch.manual_seed(0)
        model = nn.ModuleDict({"ebc": EmbeddingBagCollection(tables, optimizer=opt, device="meta")})
        planner = EmbeddingShardingPlanner(Topology(world_size=W, compute_device="cuda", hbm_cap=hbm_cap),
                                           batch_size=64, optimizer="rowwise_adagrad", print_stats=False)
        plan = planner.plan(model)
        return model, DistributedModelParallel(model, plan=plan, device=torch.device("cuda", rank), dense=None), plan

    _, short, plan = build(hbm_cap=256 * 2**20)  # 256 MiB: the 512 MB table cannot live there
    kernels = {name: p.compute_kernel for name, p in plan.plan["ebc"].items()}
    assert kernels["big"] in ("fused_uvm", "fused_uvm_caching"), kernels
    _, roomy, plan = build(hbm_cap=None)  # the device's own memory: everything fits
    assert {p.compute_kernel for p in plan.plan["ebc"].values()} == {"fused"}, plan
    full = {k: v.full() if hasattr(v, "full") else v for k, v in roomy.module["ebc"].state_dict().items()}
    short.module["ebc"].load_state_dict(full)
    for seed in range(3):
        kjt = random_kjt(["f0", "f1"], [2_000_000, 1000], B=64, seed=seed).to(torch.device("cuda", rank))
        a, b = roomy.module["ebc"](kjt).values(), short.module["ebc"](kjt).values()
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
        a.sum().backward()
        b.sum().backward()

    # trained rows sit in fbgemm's device cache (fused_uvm_caching) until evicted: the state dict flushes them
    def whole(dmp):
        return {k: v.full() if hasattr(v, "full") else v for k, v in dmp.module["ebc"].state_dict().items()}

    for k, v in whole(roomy).items():
        torch.testing.assert_close(whole(short)[k].to(v.device), v, atol=1e-6, rtol=1e-5, msg=k)
    # a load after training replaces cached rows too (else the next lookup reads the stale cache)
    _, fresh, _ = build(hbm_cap=None)
    short.module["ebc"].load_state_dict(whole(fresh))
    kjt = random_kjt(["f0", "f1"], [2_000_000, 1000], B=64, seed=0).to(torch.device("cuda", rank))
    torch.testing.assert_close(short.module["ebc"](kjt).values(), fresh.module["ebc"](kjt).values(),
                               atol=1e-6, rtol=1e-5)
    return kernels


@pytest.mark.gpu
@needs_cuda
def test_cuda_planner_chooses_uvm_when_hbm_is_short_and_it_matches_hbm():
    from dist_utils import run_ranks

    kernels = run_ranks(_planner_uvm_worker, 1, timeout=300, backend="nccl")[0]
    assert kernels["big"].startswith("fused_uvm")



def _cache_share_worker(rank, W):
    """The fused_uvm_caching kernel's device cache holds the share of rows the plan priced."""
    from lightning_rec.model_parallel import DistributedModelParallel
    from lightning_rec.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    tables = [EmbeddingBagConfig(name="big", num_embeddings=2_000_000, embedding_dim=64, feature_names=["f0"])]
    cached = {}
    for factor in (0.05, None):
        model = nn.ModuleDict({"ebc": EmbeddingBagCollection(
            tables, optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.05), device="meta")})
        constraints = {"big": ParameterConstraints(compute_kernels=["fused_uvm_caching"], cache_load_factor=factor)}
        planner = EmbeddingShardingPlanner(Topology(world_size=W, compute_device="cuda", hbm_cap=256 * 2**20),
                                           batch_size=64, constraints=constraints, print_stats=False)
        dmp = DistributedModelParallel(model, plan=planner.plan(model), device=torch.device("cuda", rank), dense=None)
        # the sharded tables' empty parameters too (a CPU one made DDP refuse the model at 2+ GPUs)
        assert {p.device.type for p in dmp.parameters()} == {"cuda"}, [p.device for p in dmp.parameters()]
        cached[factor] = sum(k.tbe.lxu_cache_weights.shape[0] for k in dmp.module["ebc"].fused_kernels())
    return cached


@pytest.mark.gpu
@needs_cuda
def test_cuda_cache_load_factor_sizes_the_kernels_cache():
    """ParameterConstraints(cache_load_factor=0.05) only changed the planner's estimate: fbgemm built its default 20%
    cache (4x the device memory priced). The plan now carries the factor to the kernel."""
    from dist_utils import run_ranks

    cached = run_ranks(_cache_share_worker, 1, timeout=300, backend="nccl")[0]
    assert 0.9 * 0.05 * 2_000_000 <= cached[0.05] <= 1.1 * 0.05 * 2_000_000, cached
    assert 0.9 * 0.2 * 2_000_000 <= cached[None] <= 1.1 * 0.2 * 2_000_000, cached


def _trainer_gpu_worker(rank, W, tmp, accelerator="gpu", embedding_device="cpu"):
    import lightning.pytorch as L

    from lightning_rec import DLRMModule
    from lightning_rec import checkpoint as ckpt
    from lightning_rec.data.synthetic import SyntheticCriteoDataModule

    small = dict(num_embeddings_per_feature=100, embedding_dim=6, dense_arch_layer_sizes=[16, 6],
                 over_arch_layer_sizes=[16, 1], sparse_lr=0.05, dense_lr=0.02,
                 sparse_feature_names=[f"C{i}" for i in range(1, 5)], embedding_device=embedding_device)
    L.seed_everything(0)
    data = SyntheticCriteoDataModule(num_train_samples=4096, num_val_samples=1024, num_test_samples=1024,
                                     batch_size=128, num_sparse_features=4, num_embeddings_per_feature=100,
                                     num_signal_features=2, pin_memory=accelerator == "gpu")
    module = DLRMModule(**small)
    trainer = L.Trainer(strategy="rec", accelerator=accelerator, devices=1, max_epochs=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, data)
    val = trainer.validate(module, data, verbose=False)[0]
    test = trainer.test(module, data, verbose=False)[0]
    trainer.save_checkpoint(f"{tmp}/gpu.ckpt")
    out = ckpt.export(f"{tmp}/gpu.ckpt", f"{tmp}/export")
    cpu = ckpt.load_exported(out)  # a plain CPU module: the GPU checkpoint loads on CPU
    data.setup("validate")
    batch = next(iter(data.val_dataloader()))
    device = module.device
    with torch.no_grad():
        on_gpu = module(batch.dense_features.to(device), batch.sparse_features.to(device)).cpu()
        on_cpu = cpu(batch.dense_features, batch.sparse_features)
    return val, test, (on_gpu - on_cpu).abs().max().item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("embedding_device", ["cpu", "meta"])  # meta: each shard drawn on the GPU
def test_cuda_trainer_fit_validate_test_and_checkpoint_to_cpu(tmp_path, embedding_device):
    from dist_utils import run_ranks

    val, test, diff = run_ranks(_trainer_gpu_worker, 1, str(tmp_path), timeout=300, backend="nccl",
                                embedding_device=embedding_device)[0]
    assert val["val_auc"] > 0.6 and test["test_auc"] > 0.6, (val, test)  # the planted signal is learnt
    assert diff < 1e-4, diff  # GPU logits vs the exported CPU module's (TF32 off by default in torch)


@pytest.mark.gpu
@needs_cuda
def test_cuda_recipe_runs_with_accelerator_gpu(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "lightning_rec.cli", "fit", "--config",
                           "recipes/configs/dlrm_synthetic.yaml", "--trainer.accelerator=gpu",
                           "--trainer.max_epochs=1", f"--trainer.default_root_dir={tmp_path}",
                           "--trainer.logger=false", "--trainer.enable_progress_bar=false"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "final validation" in done.stdout, done.stdout[-2000:]


# GPU-only code paths, their device-independent decisions checked here -------------------------------------


class _FbgemmStateApi:
    """fbgemm 1.6-1.8's TBE state API (get_optimizer_state / split_optimizer_states / iter [1] int64), as its
    source defines it for Adam (names exp_avg / exp_avg_sq, no step) and LARS-SGD (get_optimizer_state raises
    NotImplementedError): fbgemm's CPU build refuses to construct these optimizers, so the mapping is checked
    on this stand-in here and on the real kernel by the `gpu` tests below."""

    def __init__(self, opt):
        self.opt = opt
        self.iter = torch.zeros(1, dtype=torch.int64)
        self.m1 = torch.zeros(5, 4)

    def get_optimizer_state(self):
        if self.opt == "lars_sgd":
            raise NotImplementedError("Getting optimizer state lars_sgd is not implmeneted")
        return [{"exp_avg": self.m1, "exp_avg_sq": self.m1.clone()}]

    def split_optimizer_states(self):
        return [[self.m1]]


def test_fbgemm_adam_state_has_the_native_kernels_names_and_step():
    """GPU Adam state (fbgemm) and CPU Adam state (native) had different names: `.to('cuda')` of a CPU Adam
    collection raised KeyError 'step', a GPU checkpoint missed 'step' on CPU, and a resumed GPU run restarted
    Adam's bias correction. Now both kernels name the same states, step included (a view of fbgemm's iter)."""
    from lightning_rec.optim import EmbOptimType

    api = _FbgemmStateApi("adam")
    states = lookup.fbgemm_optimizer_states(api, EmbOptimType.ADAM)
    native = EmbeddingBagCollection(_tables([4]), optimizer=FusedOptimizerConfig("adam"), kernel="native")
    assert set(states[0]) == set(native.fused_kernels()[0].optimizer_states()[0]) == {"exp_avg", "exp_avg_sq", "step"}
    assert states[0]["step"].shape == native.fused_kernels()[0].optimizer_states()[0]["step"].shape == ()
    states[0]["step"].fill_(7)  # a checkpoint's step lands in fbgemm's counter
    assert api.iter.tolist() == [7]


def test_fbgemm_lars_state_comes_from_split_states():
    from lightning_rec.optim import EmbOptimType

    api = _FbgemmStateApi("lars_sgd")
    states = lookup.fbgemm_optimizer_states(api, EmbOptimType.LARS_SGD)
    assert list(states[0]) == ["momentum_buffer"] and states[0]["momentum_buffer"] is api.m1


def test_bare_cuda_device_gets_the_current_index():
    """DistributedModelParallel(device='cuda') keeps the current device's index (torch.device('cuda') is not
    torch.device('cuda:0'), the device its tensors report)."""
    from lightning_rec.model_parallel import with_cuda_index

    assert with_cuda_index(torch.device("cuda"), lambda: 3) == torch.device("cuda", 3)
    assert with_cuda_index(torch.device("cuda", 1), lambda: 3) == torch.device("cuda", 1)
    assert with_cuda_index(torch.device("cpu"), lambda: 3) == torch.device("cpu")


def test_nccl_barrier_names_its_device():
    from lightning_rec.comm import barrier_device_ids

    assert barrier_device_ids("nccl", lambda: 2) == {"device_ids": [2]}
    assert barrier_device_ids("gloo", lambda: 2) == {}


def _adam_pair(device_b="cpu"):
    opt = FusedOptimizerConfig("adam", lr=0.05)
    # "auto": the native kernel on CPU, fbgemm's once moved (an explicit kernel="native" is refused on GPU)
    a = EmbeddingBagCollection(_tables([8, 6]), optimizer=opt)
    b = EmbeddingBagCollection(_tables([8, 6]), optimizer=opt)
    assert a._lookup.kernels[0].kernel == "native"
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.gpu
@needs_cuda
def test_cuda_adam_collection_moves_to_the_gpu_and_back_with_its_state():
    """A CPU Adam collection (native kernel) trained 3 steps, moved to the GPU (fbgemm), trained 2 more: the same
    as 5 steps on CPU, step counter included (bias correction goes on, not over); and back to CPU."""
    ref, moved = _adam_pair()
    kjts = [random_kjt(["f0", "f1"], [40, 40], B=8, seed=s) for s in range(5)]
    _train(ref, kjts[:3])
    _train(moved, kjts[:3])
    moved.to("cuda")  # was KeyError: 'step'
    assert int(moved.fused_kernels()[0].optimizer_states()[0]["step"]) == 3
    _train(ref, kjts[3:])
    _train(moved, [k.to("cuda") for k in kjts[3:]])
    for name, w in ref.state_dict().items():
        torch.testing.assert_close(moved.state_dict()[name].cpu(), w, atol=1e-5, rtol=1e-4)
    moved.to("cpu")
    assert int(moved.fused_kernels()[0].optimizer_states()[0]["step"]) == 5


@pytest.mark.gpu
@needs_cuda
def test_cuda_adam_checkpoint_resumes_bias_correction_on_cpu_and_gpu():
    """GPU Adam state saved after 3 steps loads on CPU (it needs 'step') and into a fresh GPU collection; both
    then train like the uninterrupted GPU run."""
    opt = FusedOptimizerConfig("adam", lr=0.05)
    gpu = EmbeddingBagCollection(_tables([8, 12]), optimizer=opt, device="cuda")
    kjts = [random_kjt(["f0", "f1"], [40, 40], B=8, seed=s) for s in range(5)]
    _train(gpu, [k.to("cuda") for k in kjts[:3]])
    weights, state = gpu.state_dict(), FusedOptimizer(gpu).state_dict()
    assert int(state["state"]["t0.step"]) == 3
    cpu = EmbeddingBagCollection(_tables([8, 12]), optimizer=opt, kernel="native")
    again = EmbeddingBagCollection(_tables([8, 12]), optimizer=opt, device="cuda")
    for m in (cpu, again):
        m.load_state_dict({k: v.to(m.device) for k, v in weights.items()})
        FusedOptimizer(m).load_state_dict(state)
    _train(gpu, [k.to("cuda") for k in kjts[3:]])
    _train(cpu, kjts[3:])
    _train(again, [k.to("cuda") for k in kjts[3:]])
    for name, w in gpu.state_dict().items():
        torch.testing.assert_close(cpu.state_dict()[name], w.cpu(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(again.state_dict()[name], w, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_cuda_lars_state_dict():
    """fbgemm's get_optimizer_state raises NotImplementedError for LARS-SGD: its state comes from the split states."""
    gpu = EmbeddingBagCollection(_tables([8]), optimizer=FusedOptimizerConfig("lars_sgd", lr=0.01), device="cuda")
    _train(gpu, [random_kjt(["f0"], [40], B=8, seed=0).to("cuda")])
    state = FusedOptimizer(gpu).state_dict()["state"]
    assert set(state) == {"t0.momentum_buffer"} and state["t0.momentum_buffer"].abs().sum() > 0


def _dmp_bare_cuda_worker(rank, W):
    from lightning_rec.model_parallel import DistributedModelParallel

    torch.cuda.set_device(0)  # a rank that left the current device alone: DMP makes its own device current
    model = nn.ModuleDict({"ebc": EmbeddingBagCollection(_tables([8, 6]), optimizer=FusedOptimizerConfig("sgd"),
                                                         device="meta"), "dense": nn.Linear(4, 1)})
    dmp = DistributedModelParallel(model, device="cuda", dense="ddp")
    kjt = random_kjt(["f0", "f1"], [40, 40], B=4, seed=rank).to(dmp._device)
    out = dmp.module["ebc"](kjt).values()
    out.sum().backward()
    return str(dmp._device), torch.cuda.current_device()


@pytest.mark.gpu
@needs_cuda
def test_cuda_dmp_with_a_bare_cuda_device():
    from dist_utils import run_ranks

    device, current = run_ranks(_dmp_bare_cuda_worker, 1, timeout=300, backend="nccl")[0]
    assert device == "cuda:0" and current == 0


def _empty_batch_worker(rank, W, device_type="cuda"):
    """A batch of 0 rows (evaluation padding) through every sharding type on CUDA: zero-size tensors to fbgemm's
    CUDA kernels and NCCL's all-to-all, in evaluation and through a training backward; then a real batch."""
    from test_model_parallel import KEYS, PooledModel, _batch, _plan
    from test_model_parallel import _tables as mp_tables

    from lightning_rec.model_parallel import DistributedModelParallel, construct_module_sharding_plan
    from lightning_rec.types import ShardingPlan

    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device(device_type)
    done = []
    for kind in ["table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "grid_shard",
                 "data_parallel", "mixed"]:
        for weighted, pooling in [(False, "sum"), (True, "mean")]:
            torch.manual_seed(0)
            model = PooledModel(EmbeddingBagCollection(mp_tables(pooling), is_weighted=weighted, device=device,
                                                       optimizer=FusedOptimizerConfig("adagrad", lr=0.1)))
            plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, _plan(kind, W, W), local_size=W,
                                                                       world_size=W)})
            dmp = DistributedModelParallel(model, plan=plan, device=device, timeout=60)
            empty = KeyedJaggedTensor.from_lengths_sync(
                KEYS, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
                weights=torch.empty(0) if weighted else None).to(device)
            with torch.no_grad():
                assert dmp(empty).shape == (0, 3)
            out = dmp(empty)
            out.sum().backward()  # nothing to update, nothing to fail
            dmp(_batch(rank, 0, weighted).to(device)).sum().backward()
            if device_type == "cuda":
                torch.cuda.synchronize()
            done.append(f"{kind}/{pooling}")
    return done


@pytest.mark.gpu
@needs_cuda
def test_cuda_zero_row_batch_through_every_sharding_type():
    from dist_utils import run_ranks

    W = torch.cuda.device_count()
    done = run_ranks(_empty_batch_worker, W, timeout=500, backend="nccl")
    assert len(done[0]) == 16


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("optimizer", ["adam", "partial_rowwise_adam"])
def test_cuda_evaluation_lookups_do_not_advance_adams_step(optimizer):
    """fbgemm counts Adam's step per forward: evaluation lookups (no backward) between updates must not change
    the bias correction. GPU with 3 no-grad lookups after every update vs the CPU kernel without them."""
    opt = FusedOptimizerConfig(optimizer, lr=0.05)
    cpu = EmbeddingBagCollection(_tables([8, 12]), optimizer=opt, kernel="native")
    gpu = EmbeddingBagCollection(_tables([8, 12]), optimizer=opt, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    for s in range(4):
        kjt = random_kjt(["f0", "f1"], [40, 40], B=8, seed=s)
        _train(cpu, [kjt])
        _train(gpu, [kjt.to("cuda")])
        gpu.eval()
        with torch.no_grad():
            for _ in range(3):
                gpu(kjt.to("cuda"))
        gpu.train()
    assert int(FusedOptimizer(gpu).state_dict()["state"]["t0.step"]) == 4
    for name, w in cpu.state_dict().items():
        torch.testing.assert_close(gpu.state_dict()[name].cpu(), w, atol=1e-5, rtol=1e-4)


def _device_guard_worker(rank, W):
    """Row-wise and table-wise plans, one GPU: a batch built on the GPU with an id past its table and a negative
    one trains as if they were 0, and a later call raises naming the feature."""
    from test_model_parallel import KEYS, ROWS_F, PooledModel, _plan
    from test_model_parallel import _tables as mp_tables

    from lightning_rec.batch_check import DeviceIdGuard
    from lightning_rec.model_parallel import DistributedModelParallel, construct_module_sharding_plan
    from lightning_rec.types import ShardingPlan

    device = torch.device("cuda", rank)
    said = []
    for kind in ["row_wise", "table_wise"]:
        torch.manual_seed(0)
        model = PooledModel(EmbeddingBagCollection(mp_tables("sum"), device=device,
                                                   optimizer=FusedOptimizerConfig("sgd", lr=0.1)))
        plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, _plan(kind, W, W), local_size=W,
                                                                   world_size=W)})
        dmp = DistributedModelParallel(model, plan=plan, device=device, timeout=60)
        lengths = torch.ones(len(KEYS) * 2, dtype=torch.int64, device=device)
        bad = KeyedJaggedTensor(KEYS, torch.tensor([1, 2, 3, ROWS_F[1], 4, 5, -1, 2], device=device),
                                lengths=lengths)  # built on the GPU: no host copy to check
        zero = KeyedJaggedTensor(KEYS, torch.tensor([1, 2, 3, 0, 4, 5, 0, 2], device=device), lengths=lengths)
        with torch.no_grad():
            torch.testing.assert_close(dmp(bad), dmp(zero))  # lookups 1 and 2
            for _ in range(DeviceIdGuard.copy_every - 2):
                dmp(zero)
        torch.cuda.synchronize()
        with pytest.raises(Exception, match=r"feature 'f1': 1 id\(s\) outside table 't0'.*; feature 'f3': 1 id\(s\)"
                                            r".*lookup 1 ") as caught:
            dmp(zero)
        said.append(str(caught.value))
    return said


@pytest.mark.gpu
@needs_cuda
def test_cuda_sharded_collections_read_bad_ids_of_gpu_built_batches_as_row_0_and_name_them():
    from dist_utils import run_ranks

    said = run_ranks(_device_guard_worker, 1, timeout=300, backend="nccl")[0]
    assert len(said) == 2, said


@pytest.mark.gpu
@needs_cuda
def test_cuda_torch_export_of_collections_matches_eager():
    """Every collection on GPU runs on fbgemm's TBE, whose forward torch.export could not trace (a host read of its step
    counter): an EmbeddingBagCollection (padded dims, weighted mean) and a fused EmbeddingCollection export and match
    eager on the GPU."""
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.1)
    kjt = random_kjt(["f0", "f1"], [40, 40], B=8, seed=0).to("cuda")
    kjt = KeyedJaggedTensor(kjt.keys(), kjt.values(), lengths=kjt.lengths(),
                            weights=torch.rand(kjt.values().numel(), device="cuda"))
    ebc = EmbeddingBagCollection(_tables([6, 12], pooling="mean"), is_weighted=True, optimizer=opt, device="cuda")
    ec = EmbeddingCollection([EmbeddingConfig(name="s", num_embeddings=40, embedding_dim=6,
                                              feature_names=["f0", "f1"])], optimizer=opt, device="cuda")
    torch.testing.assert_close(torch.export.export(ebc, (kjt,)).module()(kjt).values(), ebc(kjt).values())
    exported, eager = torch.export.export(ec, (kjt,)).module()(kjt), ec(kjt)
    for f in ("f0", "f1"):
        torch.testing.assert_close(exported[f].values(), eager[f].values())
