"""Bad input never crashes, hangs or corrupts (single process): one case per item of the bad-input issue.

Each case asserts the exception type, the words the message must contain (what the user wrote and
the fix), and that nothing was updated. Multi-rank cases live in test_bad_input_distributed.py.

Inputs decided to be legitimate (not errors), with the reason:
- `FusedOptimizerConfig(lr="0.1")`: YAML and command lines give numbers as text; it is read as 0.1.
- `data_type="float16"` / `"fp16"` / `"float32"`: names as YAML writes them.
- A table named `items`, `keys` or `values`: any name without a dot is a table name.

Judged legitimate by benchmarks/bad_input_battery.py (each case checks the result against torch):
- int32 ids or lengths, strided (non-contiguous) views and slices of ids, keys given as a tuple: valid
  tensors and sequences, the same result.
- Ranks with different batch sizes, id dtypes or key orders, or an empty batch on one rank: each
  rank's KJT is valid on its own (TorchRec allows it); every rank's output equals the unsharded one.
- `construct_module_sharding_plan` with a table left out: a partial plan, as TorchRec's; the plan
  check of DistributedModelParallel names the missing table.
- AUC / BinnedAUC of NaN scores: NaN with a warning (the AUC is undefined), not an error.
- `validate_ids=False` with bad ids: the user opted out of the check (README); the kernels stay
  memory-safe.
"""

import math
import warnings

import pytest
import torch

from lightning_rec.batch_check import _find_problem_torch, find_problem
from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from lightning_rec.lookup import check_device_ready, choose_kernel
from lightning_rec.models.dlrm import DLRM
from lightning_rec.native_embedding import NativeTableBatchedEmbeddingBags
from lightning_rec.optim import FusedOptimizer, FusedOptimizerConfig, combined_optimizer
from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

KERNELS = ["native", "fbgemm"]


def ebc(kernel="native", weighted=False, rows=(20, 30), **kw):
    tables = [EmbeddingBagConfig(name="t_user", num_embeddings=rows[0], embedding_dim=4, feature_names=["user"]),
              EmbeddingBagConfig(name="t_item", num_embeddings=rows[1], embedding_dim=4, feature_names=["item"])]
    return EmbeddingBagCollection(tables, is_weighted=weighted, optimizer=FusedOptimizerConfig("sgd", lr=0.1),
                                  kernel=kernel, **kw)


def snapshot(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def assert_unchanged(module, before):
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed"


# KJTs --------------------------------------------------------------------------------------------------


def read_by_a_collection(kjt: KeyedJaggedTensor) -> None:
    """The KJT constructor only assigns (as TorchRec's): a collection's first look at the batch runs its checks."""
    ebc(weighted=kjt.weights_or_none() is not None)(kjt)


@pytest.mark.parametrize("offsets,words", [
    ([1, 3, 5], "offsets start at 1, not 0.*rebase"),
    ([10**12, 10**12 + 2, 10**12 + 4], "start at 1000000000000, not 0"),
    ([0, 3, 2], "never decrease"),
    ([0, 2, 3], "end at 3 but there are 4 values"),
])
def test_kjt_offsets_are_checked_when_a_collection_reads_them(offsets, words):
    kjt = KeyedJaggedTensor(["user"], torch.tensor([1, 2, 3, 4]), offsets=torch.tensor(offsets))
    with pytest.raises(ValueError, match=words):
        read_by_a_collection(kjt)
    with pytest.raises(ValueError, match=words):
        kjt.validate()


@pytest.mark.parametrize("kernel", KERNELS)
def test_unrebased_slice_reaches_no_kernel(kernel):
    """A KJT that skipped construction checks (as internal code may) is still refused before the kernel."""
    m = ebc(kernel)
    before = snapshot(m)
    kjt = KeyedJaggedTensor(["user", "item"], torch.tensor([1, 2, 3, 4]), offsets=torch.tensor([10**12] * 3),
                            _validate=False)
    with pytest.raises(ValueError, match="offsets must start at 0"):
        m(kjt).values().sum().backward()
    assert_unchanged(m, before)


def test_ids_and_weights_dtypes_name_the_fix():
    with pytest.raises(ValueError, match="ids must be integers.*values.long()"):
        read_by_a_collection(KeyedJaggedTensor(["user"], torch.tensor([True, False]), lengths=torch.tensor([1, 1])))
    with pytest.raises(ValueError, match="ids must be integers"):
        read_by_a_collection(KeyedJaggedTensor(["user"], torch.tensor([1.0, 2.0]), lengths=torch.tensor([1, 1])))
    with pytest.raises(ValueError, match="weights must be floating point.*weights.float()"):
        read_by_a_collection(KeyedJaggedTensor(["user"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]),
                                               weights=torch.tensor([1, 2])))
    with pytest.raises(ValueError, match="keys must be a list.*keys=\\['user'\\]"):
        read_by_a_collection(KeyedJaggedTensor("user", torch.tensor([1, 2]), lengths=torch.tensor([1, 1])))


# ids and weights ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bad_id", [-1, 20, 10**15])
def test_out_of_range_ids_use_each_tables_own_size(kernel, bad_id):
    m = ebc(kernel, rows=(20, 300))
    before = snapshot(m)
    ok = KeyedJaggedTensor(["user", "item"], torch.tensor([3, 250]), lengths=torch.tensor([1, 1]))
    m(ok)  # 250 fits table t_item (300 rows) though not t_user
    bad = KeyedJaggedTensor(["user", "item"], torch.tensor([bad_id, 2]), lengths=torch.tensor([1, 1]))
    words = f"feature 'user' has id {bad_id} outside table 't_user' \\(valid ids 0..19\\)"
    with pytest.raises(ValueError, match=words):
        m(bad).values().sum().backward()
    assert_unchanged(m, before)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_with_feature_and_table(kernel, value):
    m = ebc(kernel, weighted=True)
    before = snapshot(m)
    kjt = KeyedJaggedTensor(["user", "item"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2]),
                            weights=torch.tensor([1.0, 0.5, value]))
    with pytest.raises(ValueError, match="feature 'item' has per-id weight .* table 't_item'.*validate_ids=False"):
        m(kjt).values().sum().backward()
    assert_unchanged(m, before)


def test_native_kernel_names_features_when_the_collection_does_not_check():
    m = ebc("native", validate_ids=False)
    before = snapshot(m)
    kjt = KeyedJaggedTensor(["user", "item"], torch.tensor([1, 99]), lengths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="feature 'item' has id 99 outside table 't_item'"):
        m(kjt).values().sum().backward()
    assert_unchanged(m, before)


@pytest.mark.parametrize("threads", [2, 16])
def test_native_kernel_bad_input_raises_at_many_threads(threads):
    """The 16-core segfault: bad ids and offsets must be a ValueError at any thread count."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tbe = NativeTableBatchedEmbeddingBags([(10, 4), (7, 8)], [0, 1, 1], table_names=["a", "b"],
                                              feature_names=["x", "y", "z"])
        w0 = tbe.weights.clone()
        B = 64
        offsets = torch.arange(3 * B + 1)
        for bad in (-5, 7, 2**40):
            ids = torch.randint(0, 7, (3 * B,))
            ids[2 * B + 17] = bad
            with pytest.raises(ValueError, match=f"feature 'z' has id {bad} outside table 'b'"):
                tbe(ids, offsets).sum().backward()
        down = offsets.clone()
        down[100] = 3
        with pytest.raises(ValueError, match="non-decreasing.*after bag 99 of feature 'y'"):
            tbe(torch.zeros(3 * B, dtype=torch.int64), down)
        assert torch.equal(tbe.weights, w0)
    finally:
        torch.set_num_threads(old)


def test_check_op_matches_its_torch_reference():
    g = torch.Generator().manual_seed(0)
    rows_F = torch.tensor([5, 50, -1, 7])
    for trial in range(200):
        B = int(torch.randint(0, 5, (1,), generator=g))
        lengths = torch.randint(0, 3, (4 * B,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        N = int(offsets[-1])
        ids = torch.randint(-1, 60, (N,), generator=g) if trial % 3 else torch.randint(0, 5, (N,), generator=g)
        weights = torch.rand(N, generator=g)
        if N and trial % 4 == 0:
            weights[int(torch.randint(0, N, (1,), generator=g))] = float("nan")
        if trial % 7 == 0 and offsets.numel() > 2:
            offsets[1] = offsets[-1] + 1
        assert find_problem(rows_F, ids, offsets, weights) == _find_problem_torch(rows_F, ids, offsets, weights)


# configs ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,words", [
    (dict(num_embeddings="10"), "num_embeddings must be a positive integer, got '10': write num_embeddings=10"),
    (dict(embedding_dim=4.0), "embedding_dim must be a positive integer, got 4.0"),
    (dict(data_type="float65"), "data_type 'float65' is not supported: use torch.float32"),
    (dict(feature_names="user"), "feature_names must be a list.*feature_names=\\['user'\\]"),
    (dict(name="a.b"), "without dots"),
    (dict(weight_init_min="-0.1"), "weight_init_min must be a number"),
])
def test_config_errors_name_table_field_and_fix(kwargs, words):
    base = dict(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"])
    with pytest.raises(ValueError, match=words):
        EmbeddingBagConfig(**{**base, **kwargs})


@pytest.mark.parametrize("name", ["items", "keys", "values", "train", "to"])
def test_any_table_name_works(name):
    m = EmbeddingBagCollection([EmbeddingBagConfig(name=name, num_embeddings=5, embedding_dim=4, feature_names=["f"])],
                               optimizer=FusedOptimizerConfig("sgd"))
    assert list(m.state_dict()) == [f"embedding_bags.{name}.weight"]
    m.load_state_dict(m.state_dict())
    assert m(KeyedJaggedTensor(["f"], torch.tensor([1]), lengths=torch.tensor([1]))).values().shape == (1, 4)


def test_feature_read_by_two_tables_checks_its_ids_against_the_smaller():
    """A feature two tables read is served (outputs 'f@a', 'f@b', as TorchRec's): its ids are checked against the
    smaller table, which the error names; an output name that a feature already has is refused."""
    tables = [EmbeddingBagConfig(name="a", num_embeddings=5, embedding_dim=4, feature_names=["f"]),
              EmbeddingBagConfig(name="b", num_embeddings=50, embedding_dim=4, feature_names=["f"])]
    ebc = EmbeddingBagCollection(tables)
    assert ebc(KeyedJaggedTensor(["f"], torch.tensor([4]), lengths=torch.tensor([1]))).keys() == ["f@a", "f@b"]
    with pytest.raises(ValueError, match=r"'f'.*\b7\b.*'a'"):
        ebc(KeyedJaggedTensor(["f"], torch.tensor([7]), lengths=torch.tensor([1])))
    seq = [EmbeddingConfig(name="a", num_embeddings=5, embedding_dim=4, feature_names=["f"]),
           EmbeddingConfig(name="b", num_embeddings=5, embedding_dim=4, feature_names=["f", "f@a"])]
    with pytest.raises(ValueError, match="table 'b': feature 'f@a' gives the output name 'f@a', which another"):
        EmbeddingCollection(seq)


@pytest.mark.parametrize("field", ["lr", "eps", "weight_decay"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), "fast"])
def test_fused_optimizer_numbers_are_checked(field, value):
    with pytest.raises(ValueError, match=f"fused optimizer {field}"):
        FusedOptimizerConfig("sgd", **{field: value})
    assert FusedOptimizerConfig("sgd", lr="0.1").lr == 0.1  # text from YAML is read as a number


def test_fused_optimizer_takes_torch_optims_betas_too():
    assert FusedOptimizerConfig("adam", betas=(0.8, 0.99)) == FusedOptimizerConfig("adam", beta1=0.8, beta2=0.99)
    assert FusedOptimizerConfig("adam", betas=[0.9, 0.999]) == FusedOptimizerConfig("adam")
    with pytest.raises(ValueError, match=r"betas=\(0.9,\): give two numbers"):
        FusedOptimizerConfig("adam", betas=(0.9,))
    with pytest.raises(ValueError, match="disagree: give one of the two"):
        FusedOptimizerConfig("adam", betas=(0.8, 0.9), beta1=0.5)


def test_fused_optimizer_takes_fbgemm_torchrec_and_torch_optim_names():
    """fbgemm's / TorchRec's EmbOptimType names and torch.optim classes were 'unknown fused optimizer'."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbgemmOpt

    same = {
        "rowwise_adagrad": [FbgemmOpt.EXACT_ROWWISE_ADAGRAD, FbgemmOpt.ROWWISE_ADAGRAD, "EXACT_ROWWISE_ADAGRAD",
                            "exact_rowwise_adagrad", "exact_row_wise_adagrad"],
        "sgd": [FbgemmOpt.EXACT_SGD, "exact_sgd", "EXACT_SGD", torch.optim.SGD],
        "adagrad": [FbgemmOpt.EXACT_ADAGRAD, "exact_adagrad", torch.optim.Adagrad],
        "adam": [FbgemmOpt.ADAM, torch.optim.Adam, "Adam"],
        "partial_rowwise_adam": [FbgemmOpt.PARTIAL_ROWWISE_ADAM, "PARTIAL_ROWWISE_ADAM"],
        "lamb": [FbgemmOpt.LAMB], "lars_sgd": [FbgemmOpt.LARS_SGD, "LARS_SGD"],
    }
    for ours, names in same.items():
        for name in names:
            assert FusedOptimizerConfig(name, lr=0.1, eps=1e-8) == FusedOptimizerConfig(ours, lr=0.1), name
    # a torch.optim class brings its own defaults for what is not given, as apply_optimizer_in_backward does
    assert FusedOptimizerConfig(torch.optim.Adagrad).eps == 1e-10 and FusedOptimizerConfig(torch.optim.Adam).lr == 1e-3
    assert (FusedOptimizerConfig("adagrad").eps, FusedOptimizerConfig("adam").lr) == (1e-8, 0.01)
    with pytest.raises(ValueError, match="torch.optim.AdamW has no fused version"):
        FusedOptimizerConfig(torch.optim.AdamW)
    with pytest.raises(ValueError, match="unknown fused optimizer .*shampoo.*EXACT_ROWWISE_ADAGRAD"):
        FusedOptimizerConfig(FbgemmOpt.SHAMPOO)
    with pytest.raises(ValueError, match=r"pass its class and hyper-parameters, e.g. .*torch.optim.SGD"):
        FusedOptimizerConfig(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


def test_fused_optimizer_refuses_hyper_parameters_it_would_ignore():
    """SGD with momentum=0.9 trained as plain SGD, silently (and betas / eta outside the updates that use them)."""
    with pytest.raises(ValueError, match="fused sgd has no momentum .*'lars_sgd'.*torch.optim.SGD\\(momentum=0.9\\)"):
        FusedOptimizerConfig(torch.optim.SGD, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="fused rowwise_adagrad has no momentum"):
        FusedOptimizerConfig("rowwise_adagrad", momentum=0.5)
    with pytest.raises(ValueError, match="fused adagrad uses no betas .*adam, partial_rowwise_adam, lamb"):
        FusedOptimizerConfig(torch.optim.Adagrad, betas=(0.8, 0.99))
    with pytest.raises(ValueError, match="eta=0.01 is lars_sgd's trust coefficient; fused adam has none"):
        FusedOptimizerConfig("adam", eta=0.01)
    # what each update does use, and torch.optim.SGD's own default momentum=0, are taken
    assert FusedOptimizerConfig(torch.optim.SGD, lr=0.01, momentum=0) == FusedOptimizerConfig("sgd")
    lars = FusedOptimizerConfig("lars_sgd", momentum=0.5)
    assert (lars.momentum, lars.eta) == (0.5, 0.001) and FusedOptimizerConfig("lars_sgd").momentum == 0.9
    assert FusedOptimizerConfig("lamb", betas=(0.8, 0.99)).beta1 == 0.8


@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_learning_rate_from_a_scheduler_is_refused(kernel):
    m = ebc(kernel)
    opt = combined_optimizer(m, None)
    with pytest.raises(ValueError, match="fused learning rate nan for tables t_user, t_item must be a finite"):
        opt.param_groups[0]["lr"] = math.nan
    assert FusedOptimizer(m).param_groups[0]["lr"] == pytest.approx(0.1)


def test_nan_learning_rate_is_refused_for_replicated_tables_too():
    # a data_parallel table's group took a NaN rate (and wrote NaN into its rows) where a sharded one's refused it
    from lightning_rec.lookup import DenseKernel, LocalTable
    from lightning_rec.sharded_embedding import ReplicaKernel

    replica = ReplicaKernel(DenseKernel([LocalTable("t_dp", 10, 4, ("f",), "sum")], "sum", torch.device("cpu")),
                            FusedOptimizerConfig("rowwise_adagrad", lr=0.1), env=None)
    with pytest.raises(ValueError, match="fused learning rate nan for tables t_dp must be a finite number >= 0"):
        replica.set_learning_rate(math.nan)
    assert replica.get_learning_rate() == pytest.approx(0.1)


# warnings for input that is dropped ----------------------------------------------------------------------


def test_unread_features_and_unused_weights_warn_once():
    m = ebc()
    kjt = KeyedJaggedTensor(["user", "item", "extra"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]),
                            weights=torch.ones(3))
    with pytest.warns(UserWarning) as record:
        m(kjt)
    messages = " | ".join(str(w.message) for w in record)
    assert "['extra'] are read by no table" in messages and "is unweighted, so they are ignored" in messages
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(kjt)  # once only


# devices and kernels -----------------------------------------------------------------------------------


def test_cpu_only_kernel_on_gpu_and_gpu_only_optimizer_on_cpu_name_what_each_supports():
    with pytest.raises(ValueError, match="kernel='native' runs on CPU only: use kernel='fbgemm'"):
        choose_kernel("native", FusedOptimizerConfig("sgd"), torch.device("cuda"))
    with pytest.raises(ValueError, match="lamb is not available on CPU: CPU supports .*rowwise_adagrad"):
        choose_kernel("auto", FusedOptimizerConfig("lamb"), torch.device("cpu"))


def test_gpu_placement_on_a_cpu_run_is_refused():
    from lightning_rec.lookup import FusedKernel, LocalTable

    table = LocalTable("t", 10, 4, ("f",), "sum", compute_kernel="fused_uvm_caching")
    with pytest.raises(ValueError, match="'t': 'fused_uvm_caching'.*GPU unified memory.*compute_kernel 'fused'"):
        FusedKernel([table], "sum", FusedOptimizerConfig("sgd"), torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_batch_to_cuda_without_cuda_says_what_is_missing():
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1]), torch.tensor([1]))
    missing = "is a CPU build" if torch.version.cuda is None else "finds no CUDA device"
    with pytest.raises(ValueError, match=rf"KeyedJaggedTensor.to\('cuda'\) needs a CUDA GPU, but .*{missing}"):
        kjt.to("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_moves_to_cuda_and_pinning_without_cuda_are_one_line():
    """JaggedTensor / KeyedTensor / Batch .to('cuda'), KeyedJaggedTensor / Batch .pin_memory() and the collections'
    .to('cuda') / .cuda() raised torch's AssertionError / RuntimeError from inside the copy, naming neither the call
    nor the fix."""
    jt = JaggedTensor(torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    kt = KeyedTensor(["a"], [2], torch.zeros(2, 2))
    kjt = KeyedJaggedTensor(["f"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    tables = [EmbeddingConfig(name="t", num_embeddings=4, embedding_dim=4, feature_names=["f"])]
    from lightning_rec.data.batch import Batch

    batch = Batch(torch.zeros(2, 3), kjt, torch.zeros(2))  # the dense tensor moves first: torch's error came first
    calls = [(lambda: jt.to("cuda"), "JaggedTensor.to('cuda')", "keep it on the CPU"),
             (lambda: kt.to(torch.device("cuda", 0)), "KeyedTensor.to(", "keep it on the CPU"),
             (lambda: kjt.to("cuda"), "KeyedJaggedTensor.to('cuda')", "keep it on the CPU"),
             (lambda: kjt.pin_memory(), "KeyedJaggedTensor.pin_memory()", "pin_memory=False"),
             (lambda: ebc("auto").to("cuda"), "moving EmbeddingBagCollection", "keep it on the CPU"),
             (lambda: EmbeddingCollection(tables).cuda(), "moving EmbeddingCollection", "keep it on the CPU"),
             (lambda: batch.to("cuda"), "Batch.to('cuda')", "keep it on the CPU"),
             (lambda: batch.pin_memory(), "Batch.pin_memory()", "pin_memory=False")]
    for call, what, fix in calls:
        with pytest.raises(ValueError, match="^CUDA is not available: ") as info:
            call()
        assert what in str(info.value) and fix in str(info.value), str(info.value)
        assert info.value.__cause__ is None and info.value.__suppress_context__  # no torch traceback above it
    assert kjt.device().type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpu_tables_without_cuda_say_what_is_missing():
    if torch.version.cuda is None:  # CI's CPU build of torch
        missing = r"need a CUDA GPU, but this torch \(.*\) is a CPU build: install the CUDA"
    else:  # a CUDA build of torch on a machine without a GPU (or with none visible)
        missing = r"need a CUDA GPU, but torch .*\+cu.* finds no CUDA device: check that the GPU and its driver"
    with pytest.raises(ValueError, match=missing):
        check_device_ready(torch.device("cuda"))
    with pytest.raises(ValueError, match="need a CUDA GPU"):
        ebc("auto", device="cuda")


# models ------------------------------------------------------------------------------------------------


def test_dlrm_with_other_dense_width_names_the_setting():
    tables = [EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"])]
    model = DLRM(EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("sgd")), 10, [8, 4], [8, 1])
    kjt = KeyedJaggedTensor(["f"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="built for 10 dense features .* \\(2, 13\\).*dense_in_features=13"):
        model(torch.randn(2, 13), kjt)


def test_unlabelled_training_batch_is_refused_before_any_update():
    from lightning_rec.data.batch import Batch
    from lightning_rec.models.dlrm_module import DLRMModule

    module = DLRMModule(num_embeddings_per_feature=10, embedding_dim=4, sparse_feature_names=["a", "b"],
                        dense_in_features=3, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])
    module.configure_model()
    before = snapshot(module)
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3, 4]), lengths=torch.ones(4, dtype=torch.int64))
    batch = Batch(torch.randn(2, 3), kjt, torch.tensor([float("nan"), 1.0]))
    with pytest.raises(ValueError, match="labels must be click labels in \\[0, 1\\], found \\[nan\\]"):
        module.training_step(batch, 0)
    assert_unchanged(module, before)


def test_a_plan_bigger_than_the_gpu_is_explained_before_any_allocation():
    """DistributedModelParallel checks a plan against the device's memory first (the GPU path, on metadata)."""
    from lightning_rec.model_parallel import construct_module_sharding_plan, plan_device_bytes, row_wise, table_wise
    from lightning_rec.planner.fits import check_plan_fits
    from lightning_rec.types import ShardingPlan

    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=10_000_000, embedding_dim=128, feature_names=[f"f{i}"])
              for i in range(4)]
    class Stub(torch.nn.Module):  # the collection's metadata only: 20 GB of tables are not allocated here
        def embedding_bag_configs(self):
            return tables

        def fused_optimizer_config(self):
            return FusedOptimizerConfig("rowwise_adagrad")

    stub = Stub()
    verbs = {f"t{i}": table_wise(rank=0) for i in range(4)}
    plan = ShardingPlan({"": construct_module_sharding_plan(stub, verbs, world_size=2, local_size=2)})
    by_rank = plan_device_bytes(plan, {"": stub}, 2)
    assert sum(by_rank[0].values()) == 4 * 10_000_000 * (128 * 4 + 4) and by_rank[1] == {}
    words = "19.2 GiB .* on rank 0, whose GPU has 16.0 GiB.*'t0' 4.8 GiB.*fused_uvm_caching"
    with pytest.raises(ValueError, match=words):
        check_plan_fits(by_rank, 16 * 2**30)
    spread = ShardingPlan({"": construct_module_sharding_plan(stub, {f"t{i}": row_wise() for i in range(4)},
                                                              world_size=2, local_size=2)})
    check_plan_fits(plan_device_bytes(spread, {"": stub}, 2), 16 * 2**30)  # half each: fits
    # fbgemm pads rows to 4 columns on GPU: a dim-2 table holds twice the weights its dim says
    tables[:] = [EmbeddingBagConfig(name="t0", num_embeddings=1000, embedding_dim=2, feature_names=["f0"])]
    narrow = ShardingPlan({"": construct_module_sharding_plan(stub, {"t0": table_wise(rank=0)}, world_size=2)})
    assert plan_device_bytes(narrow, {"": stub}, 2)[0] == {"t0": 1000 * (4 * 4 + 4)}


def test_check_op_passes_opcheck():
    args = (torch.tensor([5, 9]), torch.tensor([1, 2, 8]), torch.tensor([0, 1, 2, 3, 3]), torch.rand(3))
    torch.library.opcheck(torch.ops.lightning_rec.check_batch.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_check_op_refuses_dtypes_it_cannot_read_with_its_own_message():
    """Not AT_DISPATCH's error (formatted by c10::str, which crashes builds with a private libstdc++:
    csrc/check_message.h)."""
    rows, ids, offsets = torch.tensor([5, 9]), torch.tensor([1, 2, 8]), torch.tensor([0, 1, 2, 3, 3])
    with pytest.raises(RuntimeError, match="indices and offsets must be int32 or int64, got Float and Long"):
        torch.ops.lightning_rec.check_batch(rows, ids.float(), offsets, None)
    with pytest.raises(RuntimeError, match="weights must be floating point, got Long"):
        torch.ops.lightning_rec.check_batch(rows, ids, offsets, torch.ones(3, dtype=torch.int64))
    assert torch.ops.lightning_rec.check_batch(rows, ids.int(), offsets.int(), torch.ones(3).double())[0] == 0


def test_planner_never_replicates_tables_whose_fused_optimizer_replicas_lack():
    """Fused Adam on one rank: the planner used to pick data_parallel, which DistributedModelParallel then refused."""
    from lightning_rec.planner import EmbeddingShardingPlanner, Topology

    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=50, embedding_dim=8, feature_names=[f"f{i}"])
              for i in range(3)]
    m = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("adam"))
    for world in (1, 2):
        plan = EmbeddingShardingPlanner(Topology(world_size=world, compute_device="cpu")).plan(m)
        kinds = {str(ps.sharding_type) for module_plan in plan.plan.values() for ps in module_plan.values()}
        assert "data_parallel" not in kinds, kinds


def test_planner_prices_each_collection_by_its_own_fused_optimizer():
    """Two collections, rowwise_adagrad and adam: the planner (and Trainer(strategy='rec')'s) planned both by the
    first one's update, replicated the small adam table, and DistributedModelParallel refused the plan."""
    from lightning_rec.planner import EmbeddingShardingPlanner, Topology

    def collection(name, optimizer):
        return EmbeddingBagCollection([EmbeddingBagConfig(name=name, num_embeddings=50, embedding_dim=8,
                                                          feature_names=[name])],
                                      optimizer=FusedOptimizerConfig(optimizer))

    model = torch.nn.ModuleDict({"users": collection("u", "rowwise_adagrad"), "goods": collection("i", "adam")})
    plan = EmbeddingShardingPlanner(Topology(world_size=2, compute_device="cpu")).plan(model)
    assert str(plan.plan["users"]["u"].sharding_type) == "data_parallel"  # small: replicated, as before
    assert str(plan.plan["goods"]["i"].sharding_type) != "data_parallel"


def test_a_reused_planner_does_not_keep_the_last_models_fused_optimizer():
    """A planner that planned an adam model went on pricing adam for the next model without a fused update of its
    own (or a list of configs), and never replicated its small tables."""
    from lightning_rec.planner import EmbeddingShardingPlanner, Topology

    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=64, feature_names=[f"f{i}"])
              for i, rows in enumerate([4, 100_000])]
    planner = EmbeddingShardingPlanner(Topology(world_size=2, compute_device="cpu"), print_stats=False)
    fresh = planner.plan(tables)
    assert str(fresh.plan[""]["t0"].sharding_type) == "data_parallel"
    planner.plan(EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("adam"), device=torch.device("meta")))
    assert planner.plan(tables) == fresh


def test_missing_fbgemm_names_the_pair_to_install():
    """A GPU user's `pip install -e .` installs no kernels: without fbgemm-gpu, import says what to add."""
    import subprocess
    import sys

    code = "import sys; sys.modules['fbgemm_gpu'] = None\nimport lightning_rec.sparse"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "lightning_rec needs fbgemm-gpu built for the installed torch" in done.stderr, done.stderr[-2000:]
    assert "pip install 'lightning_rec[cpu]'" in done.stderr and "1.6.0 for 2.11" in done.stderr, done.stderr[-2000:]


# Found by benchmarks/bad_input_battery.py (inputs tried independently of the cases above) ----------


@pytest.mark.parametrize("make,words", [
    (lambda k: k.permute([-1, 0]), r"permute: indices \[-1\] are not key positions: use 0..1"),  # was a segfault
    (lambda k: k.permute([0, 5]), r"permute: indices \[5\]"),
    (lambda k: k.split([3, -1]), r"segments \[3, -1\] must be >= 0"),
])
def test_kjt_methods_check_their_arguments(make, words):
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3, 0]), lengths=torch.tensor([2, 1, 1, 0]))
    with pytest.raises(ValueError, match=words):
        make(kjt)


@pytest.mark.parametrize("kwargs,words", [
    (dict(lengths=torch.tensor([1, 2]), offsets=torch.tensor([0, 2, 3])), "lengths and offsets were both given"),
    (dict(values=torch.tensor([1, 2, 3], dtype=torch.int8), lengths=torch.tensor([1, 2])),
     r"ids must be integers \(int64 or int32\), got values of torch.int8: convert them with values.long\(\)"),
    (dict(lengths=torch.tensor([1, 2], dtype=torch.int16)), r"lengths must be int32 or int64, got torch.int16"),
    (dict(values=[1, 2, 3], lengths=torch.tensor([1, 2])), r"values must be a torch.Tensor, got list"),
    (dict(lengths=[1, 2]), r"lengths must be a torch.Tensor, got list"),
    (dict(keys=None), "keys must be a list of feature names, got None"),
    (dict(values=torch.tensor([1, 2, 3], device="meta"), lengths=torch.tensor([1, 2])),
     "values on meta, lengths on cpu: put them on one device"),
])
def test_kjt_read_by_a_collection_refuses_what_no_kernel_reads(kwargs, words):
    args = {"keys": ["a", "b"], "values": torch.tensor([1, 2, 3]), **kwargs}
    with pytest.raises(ValueError, match=words):
        read_by_a_collection(KeyedJaggedTensor(**args))


def test_from_jt_dict_of_different_batch_sizes_is_a_variable_batch_a_collection_needs_inverse_indices_for():
    """from_jt_dict refused features of different batch sizes; TorchRec's builds a variable batch (VBE) of them. A
    collection reading it without inverse_indices cannot expand its outputs: it names the strides and the fix."""
    from lightning_rec.sparse import JaggedTensor

    kjt = KeyedJaggedTensor.from_jt_dict({"a": JaggedTensor(torch.tensor([1]), lengths=torch.tensor([1])),
                                          "b": JaggedTensor(torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1]))})
    assert kjt.variable_stride_per_key() and kjt.stride_per_key_per_rank() == [[1], [3]] and kjt.stride() == 3
    with pytest.raises(ValueError, match=r"variable batch \(stride_per_key_per_rank \[\[1\], \[3\]\]\) without "
                                         r"inverse_indices.*build it with inverse_indices="):
        read_by_a_collection(kjt)


@pytest.mark.parametrize("args,words", [
    ((["a", "a"], [2, 3], torch.zeros(3, 5)), r"duplicate keys \['a'\]"),
    ((["a", "b"], [-1, 6], torch.zeros(3, 5)), "widths must be >= 0"),
    ((["a"], [5], torch.zeros(3, 5), 2), "key_dim=2 is not a dim"),
])
def test_keyed_tensor_refuses_ambiguous_blocks(args, words):
    from lightning_rec.sparse import KeyedTensor

    with pytest.raises(ValueError, match=words):
        KeyedTensor(*args)


def test_keyed_tensor_from_list_names_the_mismatched_block():
    from lightning_rec.sparse import KeyedTensor

    with pytest.raises(ValueError, match=r"differ outside key_dim=1.*'b': \(4, 2\)"):
        KeyedTensor.from_tensor_list(["a", "b"], [torch.zeros(3, 2), torch.zeros(4, 2)])


@pytest.mark.parametrize("lo,hi,words", [
    (0.5, -0.5, "weight_init_min=0.5 is above weight_init_max=-0.5"),
    (float("nan"), 0.1, "weight_init_min must be a number \\(finite\\)"),
])
def test_init_range_is_checked_in_the_config(lo, hi, words):
    with pytest.raises(ValueError, match=words):
        EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, weight_init_min=lo, weight_init_max=hi)


@pytest.mark.parametrize("make,words", [
    (lambda t: EmbeddingBagCollection([{"name": "t"}]), "takes EmbeddingBagConfig tables, got a dict"),
    (lambda t: EmbeddingBagCollection(t, optimizer="adam"), "optimizer='adam': pass a FusedOptimizerConfig"),
    (lambda t: EmbeddingBagCollection(t, device="mps"), "device='mps'.*'cpu' or 'cuda'"),
    (lambda t: EmbeddingBagCollection([EmbeddingBagConfig(name="t_huge", num_embeddings=10**13, embedding_dim=16)],
                                      optimizer=FusedOptimizerConfig("sgd")), "'t_huge' 10000000000000 x 16.*shard"),
])
def test_collection_arguments_are_checked(make, words):
    tables = [EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4)]
    with pytest.raises(ValueError, match=words):
        make(tables)


def test_collection_given_a_tensor_says_it_takes_a_kjt():
    with pytest.raises(TypeError, match="takes a KeyedJaggedTensor of ids, got a Tensor"):
        ebc()(torch.tensor([[1, 2]]))


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_refused_learning_rate_stays_out_of_the_param_group(kernel):
    module = ebc(kernel)
    opt = FusedOptimizer(module)
    with pytest.raises(ValueError, match="fused learning rate nan"):
        opt.param_groups[0]["lr"] = float("nan")
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # what the kernels still use (and a checkpoint would save)


def test_auc_of_nan_scores_is_nan_not_a_number_that_looks_valid():
    from lightning_rec.metrics import AUC

    auc = AUC()
    auc.update(torch.tensor([0.1, float("nan"), 0.3, 0.9]), torch.tensor([0, 1, 0, 1]))
    with pytest.warns(UserWarning, match=r"predictions are NaN \(task 'task': 1 of them"):
        assert math.isnan(float(auc.compute()))  # NaN sorts as the top score: it was 1.0


def test_ratings_files_are_read_by_column_name_and_bad_rows_name_their_line(tmp_path):
    from lightning_rec.data.movielens import read_ratings

    (tmp_path / "ratings.csv").write_text("userId,rating,timestamp\n1,5,1\n2,4,2\n")
    with pytest.raises(ValueError, match=r"ratings.csv:1: the header .* no column for \['item_id'\]"):
        read_ratings(tmp_path / "ratings.csv")  # rating was read as the item, silently
    (tmp_path / "ratings.csv").write_text("movieId,userId,rating\n10,1,5\n20,2,4\n")  # another column order
    table = read_ratings(tmp_path / "ratings.csv")
    assert table.column("item_id").to_pylist() == [10, 20] and table.column("user_id").to_pylist() == [1, 2]
    (tmp_path / "u.data").write_text("1\t1\t5\t881250949\n2\t3\t4\t881250950\nx\ty\tz\tw\n")
    with pytest.raises(ValueError, match=r"u.data:3: cannot parse"):
        read_ratings(tmp_path / "u.data")


def test_a_truncated_gzip_file_is_named(tmp_path):
    import gzip

    from lightning_rec.data.criteo_parse import read_criteo

    row = "0\t" + "\t".join(str(i) for i in range(13)) + "\t" + "\t".join(f"{i:08x}" for i in range(26)) + "\n"
    data = gzip.compress((row * 400).encode())
    (tmp_path / "day.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="day.gz: cannot read it .*cut short"):
        list(read_criteo(tmp_path / "day.gz"))


def test_damaged_checkpoint_index_is_named(tmp_path):
    from lightning_rec import checkpoint

    module = ebc()
    checkpoint.save({"state_dict": module.state_dict()}, tmp_path / "ck")
    (tmp_path / "ck" / ".metadata").write_bytes((tmp_path / "ck" / ".metadata").read_bytes()[:20])
    before = snapshot(module)
    with pytest.raises(ValueError, match="checkpoint .*ck is damaged: its index .*.metadata cannot be read"):
        checkpoint.load_model(module, tmp_path / "ck")
    assert_unchanged(module, before)


@pytest.mark.parametrize("make,words", [
    (lambda: __import__("lightning_rec.strategy").strategy.RecStrategy(embedding_timeout=-5),
     "embedding_timeout=-5.*> 0"),
    (lambda: __import__("lightning_rec.strategy").strategy.RecStrategy(plan={"t": "row_wise"}),
     "takes a ShardingPlan, got a dict"),
    (lambda: __import__("lightning_rec.data").data.CriteoDataModule(batch_size=0), "batch_size=0"),
    (lambda: __import__("lightning_rec.data").data.MovieLensDataModule("x", batch_size=0), "batch_size=0"),
    (lambda: __import__("lightning_rec.metrics").metrics.NDCG(ks=2.5), "ks=2.5"),
    (lambda: __import__("lightning_rec.models").models.DLRMModule(sparse_lr=-1, num_embeddings_per_feature=4),
     "DLRMModule\\(sparse_optimizer='rowwise_adagrad', sparse_lr=-1.*>= 0"),
])
def test_module_arguments_are_checked(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_labels_of_another_shape_are_refused_before_any_update():
    from lightning_rec.data.batch import Batch
    from lightning_rec.models.dlrm_module import DLRMModule

    module = DLRMModule(num_embeddings_per_feature=10, embedding_dim=4, sparse_feature_names=["a", "b"],
                        dense_in_features=3, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3, 4]), lengths=torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"labels of shape \(3,\) for a batch of 2 samples"):
        module.training_step(Batch(torch.randn(2, 3), kjt, torch.zeros(3)), 0)


@pytest.mark.parametrize("opt", ["adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam"])
def test_eps_zero_is_refused_where_a_zero_gradient_would_divide_0_by_0(opt):
    with pytest.raises(ValueError, match=f"fused optimizer {opt} needs eps > 0.*0 / 0 = NaN"):
        FusedOptimizerConfig(opt, eps=0.0)
    FusedOptimizerConfig("sgd", eps=0.0)  # SGD does not divide


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise_adagrad"])
def test_fbgemm_cpu_weight_decay_that_it_would_ignore_is_refused(opt):
    """fbgemm-gpu-cpu's EXACT_SGD / EXACT_ADAGRAD / EXACT_ROWWISE_ADAGRAD leave weight_decay out: the tables trained
    as if it were 0 (adagrad was let through, and named as the fix for sequence tables)."""
    cfg = FusedOptimizerConfig(opt, weight_decay=0.5)
    tables = [EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4)]
    with pytest.raises(ValueError, match=f"ignores weight_decay=0.5 for fused optimizer {opt}: use kernel='native'"):
        EmbeddingBagCollection(tables, optimizer=cfg, kernel="fbgemm")
    with pytest.raises(ValueError, match=r"sequence tables .* no weight decay: train them on GPU .* or weight_decay=0"):
        EmbeddingCollection([EmbeddingConfig(name="t", num_embeddings=10, embedding_dim=4)], optimizer=cfg)
    EmbeddingBagCollection(tables, optimizer=cfg)  # auto: the native kernel, which applies it


def test_binned_auc_of_nan_scores_is_nan():
    from lightning_rec.metrics import BinnedAUC

    auc = BinnedAUC(num_thresholds=100, from_logits=False)
    auc.update(torch.tensor([0.1, float("nan"), 0.3, 0.9]), torch.tensor([0, 1, 0, 1]))
    with pytest.warns(UserWarning, match=r"predictions are NaN \(task 'task': 1 of them"):
        assert math.isnan(float(auc.compute()))  # NaN fell in the top bin: it was 1.0


def test_criteo_layout_errors_name_the_line(tmp_path):
    from lightning_rec.data.criteo_parse import read_criteo

    row = "0\t" + "\t".join(str(i) for i in range(13)) + "\t" + "\t".join(f"{i:08x}" for i in range(26)) + "\n"
    (tmp_path / "nul.tsv").write_bytes((row + row.replace("\t3\t", "\t\0\t", 1)).encode())
    with pytest.raises(ValueError, match="nul.tsv:2 holds NUL bytes"):
        list(read_criteo(tmp_path / "nul.tsv"))
    (tmp_path / "wide.tsv").write_text("\n0\t" + "1" * 1000 + "\n")
    with pytest.raises(ValueError, match="wide.tsv:2: rows have 2 fields"):
        list(read_criteo(tmp_path / "wide.tsv"))
    header = "Id,Label," + ",".join(f"I{i}" for i in range(1, 14)) + "," + ",".join(f"C{i}" for i in range(1, 27))
    quoted = ",".join(f'"{v}"' for v in ["1", "0"] + [str(i) for i in range(13)] + [f"{i:08x}" for i in range(26)])
    (tmp_path / "q.csv").write_text(header + "\n" + quoted + "\n")  # header plain, rows quoted
    with pytest.raises(ValueError, match="q.csv: its fields are quoted.*sed"):
        list(read_criteo(tmp_path / "q.csv"))


def test_preprocess_vocab_from_without_vocabulary_is_refused_before_writing(tmp_path):
    from lightning_rec.data.criteo_parse import native_parser_available
    from lightning_rec.data.preprocess import preprocess_criteo

    if not native_parser_available():
        pytest.skip("preprocess needs the native parser")
    row = "0\t" + "\t".join(str(i) for i in range(13)) + "\t" + "\t".join(f"{i:08x}" for i in range(26)) + "\n"
    (tmp_path / "val.tsv").write_text(row * 4)
    with pytest.raises(ValueError, match="--vocab_from .*train has no vocab.npz: point it at the --output_dir"):
        preprocess_criteo([tmp_path / "val.tsv"], tmp_path / "out", num_embeddings=100, vocab_from=tmp_path / "train")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("make", [
    lambda: __import__("lightning_rec.models").models.TwoTowerModule(temperature=float("nan")),
    lambda: __import__("lightning_rec.models").models.TwoTowerModule(tower_dropout=float("nan")),
    lambda: __import__("lightning_rec.models").models.TwoTowerModule(embedding_l2=float("inf")),
    lambda: __import__("lightning_rec.models").models.DLRMModule(num_embeddings_per_feature=4, dense_lr=float("nan")),
    lambda: __import__("lightning_rec.models").models.DLRMModule(num_embeddings_per_feature=4,
                                                                 dense_weight_decay=float("nan")),
])
def test_a_non_finite_float_argument_of_a_module_is_refused_by_name(make):
    # temperature=nan passed the `<= 0` check; one step then wrote NaN into the user rows through the fused update
    with pytest.raises(ValueError, match=r"Module\((temperature|tower_dropout|embedding_l2|dense_lr|dense_weight_decay)"
                                         r"=(nan|inf)\): give a finite number"):
        make()
