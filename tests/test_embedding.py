"""EmbeddingBagCollection / EmbeddingCollection against nn.EmbeddingBag + torch.optim references."""

import copy
import inspect

import pytest
import torch
from torch import nn

from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from lightning_rec.optim import (
    CombinedOptimizer,
    FusedOptimizer,
    FusedOptimizerConfig,
    RowWiseAdagrad,
    combined_optimizer,
    dense_parameters,
)
from lightning_rec.sparse import KeyedJaggedTensor

# fp32 everywhere; the kernels sum a bag's rows in another order than torch's embedding_bag and
# fbgemm aggregates duplicate-id gradients before the update, so agreement is to rounding only.
ATOL = 1e-5

TABLES = [
    EmbeddingBagConfig(name="t0", num_embeddings=50, embedding_dim=8, feature_names=["f0", "f2"]),
    EmbeddingBagConfig(name="t1", num_embeddings=30, embedding_dim=4, feature_names=["f1"]),
]


def random_kjt(keys, rows, B, max_len=4, weighted=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(keys) * B,), generator=g)
    parts = []
    for f, n in enumerate(rows):
        count = int(lengths[f * B : (f + 1) * B].sum())
        parts.append(torch.randint(0, n, (count,), generator=g))
    values = torch.cat(parts)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=weights)


def reference_bags(ebc, pooling):
    """One nn.EmbeddingBag per table, initialised from the collection's weights."""
    bags = {}
    for cfg in ebc.embedding_bag_configs():
        w = ebc.embedding_bags[cfg.name].weight.detach().clone()
        bags[cfg.name] = nn.EmbeddingBag(cfg.num_embeddings, cfg.embedding_dim, mode=pooling, _weight=w)
    return bags


def reference_forward(bags, configs, kjt, pooling):
    outs = []
    by_feature = {f: c.name for c in configs for f in c.feature_names}
    feature_order = [f for c in configs for f in c.feature_names]
    jts = kjt.to_dict()
    for f in feature_order:
        jt = jts[f]
        bag = bags[by_feature[f]]
        w = jt.weights_or_none()
        if w is not None and pooling == "mean":
            s = nn.functional.embedding_bag(jt.values(), bag.weight, jt.offsets()[:-1], mode="sum",
                                            per_sample_weights=w)
            outs.append(s / jt.lengths().clamp(min=1).unsqueeze(1))
        else:
            outs.append(bag(jt.values(), jt.offsets()[:-1], per_sample_weights=w))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_forward_matches_embedding_bag(pooling, weighted, fused):
    tables = [EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                                 feature_names=t.feature_names, pooling=pooling) for t in TABLES]
    opt = FusedOptimizerConfig("sgd", lr=0.1) if fused else None
    ebc = EmbeddingBagCollection(tables, is_weighted=weighted, optimizer=opt)
    # keys in another order than the tables: the collection permutes them itself
    kjt = random_kjt(["f2", "f1", "f0"], [50, 30, 50], B=7, weighted=weighted)
    kt = ebc(kjt)
    assert kt.keys() == ["f0", "f2", "f1"]
    expected = reference_forward(reference_bags(ebc, pooling), tables, kjt, pooling)
    torch.testing.assert_close(kt.values(), expected, atol=ATOL, rtol=0)


def rowwise_adagrad_reference(weight, grad, state, lr, eps):
    """fbgemm's EXACT_ROWWISE_ADAGRAD: one accumulator per row (mean of g^2 over the row)."""
    rows = grad.abs().sum(dim=1) > 0
    state[rows] += grad[rows].pow(2).mean(dim=1)
    weight[rows] -= lr * grad[rows] / (state[rows].sqrt() + eps).unsqueeze(1)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_fused_optimizer_matches_torch_optim(optimizer, pooling):
    lr, eps, steps = 0.05, 1e-8, 5
    tables = [EmbeddingBagConfig(name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim,
                                 feature_names=t.feature_names, pooling=pooling) for t in TABLES]
    ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig(optimizer, lr=lr, eps=eps), kernel="fbgemm")
    bags = reference_bags(ebc, pooling)
    params = [b.weight for b in bags.values()]
    ref_opt = {
        "sgd": lambda: torch.optim.SGD(params, lr=lr),
        "adagrad": lambda: torch.optim.Adagrad(params, lr=lr, eps=eps),
        "rowwise_adagrad": lambda: None,
    }[optimizer]()
    row_state = {name: torch.zeros(b.weight.shape[0]) for name, b in bags.items()}
    for step in range(steps):
        # duplicate ids within and across bags: a few hot rows
        kjt = random_kjt(["f0", "f1", "f2"], [5, 30, 5], B=6, seed=step)
        target = torch.randn(6, 20, generator=torch.Generator().manual_seed(100 + step))
        (ebc(kjt).values() * target).sum().backward()
        ref = reference_forward(bags, tables, kjt, pooling)
        (ref * target).sum().backward()
        with torch.no_grad():
            if ref_opt is not None:
                ref_opt.step()
            else:
                for name, b in bags.items():
                    rowwise_adagrad_reference(b.weight, b.weight.grad, row_state[name], lr, eps)
        for b in bags.values():
            b.weight.grad = None
    for name, b in bags.items():
        torch.testing.assert_close(ebc.embedding_bags[name].weight, b.weight, atol=ATOL, rtol=0)
    states = FusedOptimizer(ebc).table_states()
    if optimizer == "rowwise_adagrad":
        for name in bags:
            torch.testing.assert_close(states[name]["sum"], row_state[name], atol=ATOL, rtol=1e-5)
    if optimizer == "adagrad":
        for name, b in bags.items():
            torch.testing.assert_close(states[name]["sum"], ref_opt.state[b.weight]["sum"], atol=ATOL, rtol=1e-5)


def test_dense_kernel_trains_with_torch_optim():
    ebc = EmbeddingBagCollection(TABLES)  # no fused optimizer: plain parameters
    assert all(p.requires_grad for p in ebc.parameters())
    opt = torch.optim.SGD(ebc.parameters(), lr=0.1)
    before = ebc.embedding_bags["t1"].weight.detach().clone()
    kjt = random_kjt(["f0", "f1", "f2"], [50, 30, 50], B=4)
    ebc(kjt).values().sum().backward()
    opt.step()
    assert not torch.equal(before, ebc.embedding_bags["t1"].weight)


def test_embedding_collection_sequence_rows():
    ec = EmbeddingCollection([EmbeddingConfig(name="t", num_embeddings=20, embedding_dim=4, feature_names=["a", "b"])],
                             optimizer=FusedOptimizerConfig("sgd", lr=0.0))
    kjt = random_kjt(["b", "a"], [20, 20], B=3)
    out = ec(kjt)
    w = ec.embeddings["t"].weight
    for key in ("a", "b"):
        torch.testing.assert_close(out[key].values(), w[kjt[key].values()])
        assert torch.equal(out[key].lengths(), kjt[key].lengths())


def test_several_features_share_one_table():
    ebc = EmbeddingBagCollection(TABLES)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], torch.tensor([3, 0, 3]),
                                              torch.ones(3, dtype=torch.long))
    kt = ebc(kjt).to_dict()
    torch.testing.assert_close(kt["f0"], kt["f2"])


def test_state_dict_roundtrip_writes_into_kernel():
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.1)
    a = EmbeddingBagCollection(TABLES, optimizer=opt)
    b = EmbeddingBagCollection(TABLES, optimizer=opt)
    assert set(a.state_dict()) == {"embedding_bags.t0.weight", "embedding_bags.t1.weight"}
    b.load_state_dict(a.state_dict())
    kjt = random_kjt(["f0", "f1", "f2"], [50, 30, 50], B=5)
    torch.testing.assert_close(a(kjt).values(), b(kjt).values())


def test_scheduler_reaches_fused_learning_rate():
    ebc = EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("sgd", lr=0.1))
    dense = nn.Linear(3, 1)
    opt = combined_optimizer(ebc, torch.optim.SGD(dense.parameters(), lr=0.1))
    assert isinstance(opt, CombinedOptimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    sched.step()
    assert ebc.fused_kernels()[0].get_learning_rate() == pytest.approx(0.05)
    assert opt.param_groups[1]["lr"] == pytest.approx(0.05)
    state = opt.state_dict()
    sched.step()
    opt.load_state_dict(state)  # restores lr 0.05 in both parts
    assert ebc.fused_kernels()[0].get_learning_rate() == pytest.approx(0.05)


@pytest.mark.parametrize("key, value", [("weight_decay", 0.1), ("eps", 1e-3), ("betas", (0.8, 0.999))])
def test_a_fused_hyperparameter_written_into_its_group_is_refused_at_step(key, value):
    """Only lr reaches the kernels: a weight_decay / eps / betas written into a fused group (a weight-decay
    schedule, OneCycleLR's cycle_momentum) did nothing, silently; now the next step says so, naming the fix."""
    ebc = EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("adam", lr=0.1))
    opt = combined_optimizer(ebc, torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1))
    fused = opt.param_groups[0]
    assert (fused["weight_decay"], fused["eps"], fused["betas"]) == (0.0, 1e-8, (0.9, 0.999))  # shown, as torch's
    state = opt.state_dict()
    opt.step()
    fused[key] = value
    with pytest.raises(ValueError, match=rf"'fused0' \(tables t0, t1\) has {key}=.*fixed when the tables were built "
                                         rf"\(FusedOptimizerConfig\('adam', {key}=\.\.\.\)\)"):
        opt.step()
    fused[key] = (0.9, 0.999) if key == "betas" else {"weight_decay": 0.0, "eps": 1e-8}[key]
    opt.step()
    state["fused"]["param_groups"][0][key] = value  # a checkpoint from a run built otherwise: the tables' own win
    opt.load_state_dict(state)
    opt.step()
    fused["momentum"] = 0.9  # a key adam has none of
    with pytest.raises(ValueError, match=r"has momentum=0.9, but fused adam has no momentum: .*cycle_momentum=False"):
        opt.step()


@pytest.mark.parametrize("other", ["adagrad", "sgd", "adam"])
def test_fused_state_of_another_optimizer_is_refused_naming_both(other):
    """FusedOptimizer.load_state_dict (Lightning's resume without strategy='rec'): rowwise_adagrad's per-row 'sum'
    into adagrad tables said "the table sizes differ", into sgd tables it loaded, silently."""
    saved = FusedOptimizer(EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("rowwise_adagrad")))
    saved = saved.state_dict()
    fused = FusedOptimizer(EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig(other)))
    with pytest.raises(ValueError, match=rf"saved by tables trained with rowwise_adagrad .* these train with {other}: "
                                         rf"build the tables with FusedOptimizerConfig\('rowwise_adagrad'"):
        fused.load_state_dict(saved)


def test_a_dense_optimizer_over_every_parameter_leaves_the_fused_weights_out():
    """torch.optim.Adam(model.parameters()) beside the fused tables: combined_optimizer raised torch's "some
    parameters appear in more than one parameter group", then refused it; TorchRec's examples write it, so the
    fused weights now leave the dense groups (tests/test_torchrec_collections.py trains it against the fix's)."""
    ebc = EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("sgd"))
    model = nn.ModuleDict({"ebc": ebc, "dense": nn.Linear(3, 1)})
    dense = torch.optim.Adam(model.parameters())
    combined_optimizer(model, dense)
    assert [p for g in dense.param_groups for p in g["params"]] == list(model["dense"].parameters())
    combined_optimizer(model, torch.optim.Adam(dense_parameters(model)))  # the parameters it trains, as before


def test_out_of_range_and_negative_ids_name_feature_and_table():
    ebc = EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("sgd", lr=1.0))
    before = ebc.embedding_bags["t1"].weight.detach().clone()
    for bad in (30, -1):
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], torch.tensor([1, bad, 2]),
                                                  torch.ones(3, dtype=torch.long))
        with pytest.raises(ValueError, match=r"feature 'f1' has id .* outside table 't1'"):
            ebc(kjt).values().sum().backward()
    assert torch.equal(before, ebc.embedding_bags["t1"].weight)  # nothing was updated


def test_missing_feature_lists_what_exists():
    ebc = EmbeddingBagCollection(TABLES)
    kjt = random_kjt(["f0", "f1"], [50, 30], B=2)
    with pytest.raises(ValueError, match=r"no feature\(s\) \['f2'\].*rename"):
        ebc(kjt)


def test_feature_name_mismatch_names_the_differences_not_both_lists():
    """26 Criteo tables fed keys under another spelling listed all 26 names twice (and 26 'read by' pairs): now the
    first few missing and unexpected names, and how many in all."""
    names = [f"C{i}" for i in range(1, 27)]
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=f"t_{n}", embedding_dim=2, num_embeddings=5,
                                                     feature_names=[n]) for n in names])
    keys = names[:20] + [f"cat_{i}" for i in range(20, 26)]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys, torch.zeros(26, dtype=torch.long), torch.ones(26, dtype=torch.long))
    with pytest.raises(ValueError) as e:
        ebc(kjt)
    said = str(e.value)
    assert said.startswith("the input has no feature(s) ['C21', 'C22', 'C23', 'C24', 'C25', ...] (6 in all) that "
                           "this EmbeddingBagCollection reads ('C21' by table 't_C21',"), said
    assert "it has ['cat_20', 'cat_21', 'cat_22', 'cat_23', 'cat_24', ...] (6 in all) that no table reads" in said
    assert "rename the features or the tables' feature_names" in said
    assert "'C1'" not in said and "C26" not in said and len(said) < 500, said


def test_gpu_only_optimizer_on_cpu_lists_cpu_choices():
    with pytest.raises(ValueError, match=r"lamb is not available on CPU: CPU supports sgd, adagrad, rowwise_adagrad"):
        EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("lamb"), kernel="fbgemm")
    # sequence tables run on fbgemm on CPU: it said "CPU supports ..., adam" beside "adam is not available on CPU"
    sequence = [EmbeddingConfig(name="s", num_embeddings=10, embedding_dim=4, feature_names=["f"])]
    with pytest.raises(ValueError, match=r"adam is not available for sequence tables \(EmbeddingCollection\) on CPU, "
                                         r"which run on fbgemm's CPU kernel: use sgd, adagrad, rowwise_adagrad,"):
        EmbeddingCollection(sequence, optimizer=FusedOptimizerConfig("adam"))


def test_unknown_optimizer_lists_valid_names():
    with pytest.raises(ValueError, match="unknown fused optimizer 'adamw'.*rowwise_adagrad"):
        FusedOptimizerConfig("adamw")


@pytest.mark.parametrize("fused", [False, True])
def test_empty_batch_and_all_empty_features_train(fused):
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.1) if fused else None
    ebc = EmbeddingBagCollection(TABLES, optimizer=opt)
    empty_batch = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], torch.empty(0, dtype=torch.long),
                                                      torch.empty(0, dtype=torch.long))
    out = ebc(empty_batch).values()
    assert out.shape == (0, 20)
    out.sum().backward()
    all_empty = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], torch.empty(0, dtype=torch.long),
                                                    torch.zeros(12, dtype=torch.long))
    out = ebc(all_empty).values()
    assert out.shape == (4, 20) and out.abs().sum() == 0
    out.sum().backward()


def test_config_errors_name_the_table():
    with pytest.raises(ValueError, match="table 'x'"):
        EmbeddingBagConfig(name="x", num_embeddings=0, embedding_dim=4)
    with pytest.raises(ValueError, match="unknown pooling"):
        EmbeddingBagConfig(name="x", num_embeddings=4, embedding_dim=4, pooling="max")
    with pytest.raises(ValueError, match="unique"):
        EmbeddingBagCollection([TABLES[0], TABLES[0]])


@pytest.mark.parametrize("kernel", ["fbgemm", "auto"])
def test_fp16_tables_train(kernel):
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=8, feature_names=["f"],
                            data_type=torch.float16)],
        optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.1), kernel=kernel)
    assert ebc.embedding_bags["t"].weight.dtype == torch.float16
    before = ebc.embedding_bags["t"].weight.detach().clone()
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2]), torch.tensor([1, 1]))
    ebc(kjt).values().float().sum().backward()
    changed = (ebc.embedding_bags["t"].weight != before).any(dim=1)
    assert changed.tolist() == [False, True, True] + [False] * 7  # exactly the looked-up rows moved


@pytest.mark.parametrize("kernel,config", [("fbgemm", EmbeddingBagConfig), ("native", EmbeddingBagConfig),
                                           ("auto", EmbeddingConfig)])  # sequence tables: fbgemm
def test_fp16_tables_give_fp32_rows_and_take_an_fp32_gradient(kernel, config):
    # fbgemm's output (and so the gradient its update takes) was fp16 for fp16 tables, the native kernel's fp32: a
    # small gradient (a mean loss over a big batch) is subnormal in fp16 and kept a few bits (this step was 5-10%
    # off), and at 2 ranks an fp16 table's rows beside an fp32 table's broke the output all-to-all ("shape '[2, 4]'
    # is invalid for input of size 4"). Now fp32 out of every fused kernel, as TorchRec's fused kernels.
    table = config(name="t", num_embeddings=8, embedding_dim=4, feature_names=["f"], data_type=torch.float16)
    collection = (EmbeddingBagCollection if config is EmbeddingBagConfig else EmbeddingCollection)(
        [table], optimizer=FusedOptimizerConfig("sgd", lr=1000.0), kernel=kernel)
    collection.load_state_dict({k: torch.zeros(8, 4, dtype=torch.float16) for k in collection.state_dict()})
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.arange(8), torch.ones(8, dtype=torch.long))
    out = collection(kjt)
    out = out.values() if config is EmbeddingBagConfig else out["f"].values()
    assert out.dtype == torch.float32
    grad = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)) * 3e-7
    (out * grad).sum().backward()
    step = next(iter(collection.state_dict().values())).float()
    # exact up to the fp16 storage of a step near 3e-4 (relative 2^-11) and fbgemm's stochastic rounding there
    assert ((step + 1000.0 * grad).norm() / (1000.0 * grad).norm()).item() < 2e-3


@pytest.mark.parametrize("kernel", ["fbgemm", "native"])
def test_one_update_per_call_as_documented(kernel):
    # FusedOptimizerConfig / README: one call sums a row's ids and steps it once (torch.optim on the dense table);
    # two calls in a step update twice, as fbgemm and TorchRec do. Adagrad's state shows which: g = 1 per id.
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=2, feature_names=["i"])],
                                 optimizer=FusedOptimizerConfig("adagrad", lr=0.1), kernel=kernel)
    row1 = KeyedJaggedTensor.from_lengths_sync(["i"], torch.tensor([1]), torch.tensor([1]))
    twice = KeyedJaggedTensor.from_lengths_sync(["i"], torch.tensor([1, 1]), torch.tensor([1, 1]))
    ebc(twice).values().sum().backward()  # one call, row 1 twice: (1 + 1)^2
    assert ebc.fused_kernels()[0].optimizer_states()[0]["sum"][1].tolist() == [4.0, 4.0]
    (ebc(row1).values().sum() + ebc(row1).values().sum()).backward()  # two calls: 1^2 + 1^2
    assert ebc.fused_kernels()[0].optimizer_states()[0]["sum"][1].tolist() == [6.0, 6.0]


@pytest.mark.parametrize("kernel", ["fbgemm", "native"])
@pytest.mark.parametrize("weighted", [False, True])
def test_inference_mode_lookup_equals_no_grad_and_updates_nothing(kernel, weighted):
    # Lightning validates and predicts under torch.inference_mode (Trainer(inference_mode=True), its default):
    # fbgemm's CPU lookup is registered for autograd only, and raised "Could not run
    # 'fbgemm::split_embedding_codegen_lookup_rowwise_adagrad_function_pt2' with arguments from the 'CPU' backend"
    ebc = EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.5), kernel=kernel,
                                 is_weighted=weighted)
    before = copy.deepcopy(ebc.state_dict())
    with torch.no_grad():
        want = ebc(random_kjt(["f0", "f1", "f2"], [50, 30, 50], B=5, weighted=weighted)).values()
    with torch.inference_mode():  # the batch built inside too, as in a serving loop
        got = ebc(random_kjt(["f0", "f1", "f2"], [50, 30, 50], B=5, weighted=weighted)).values()
    assert torch.equal(got, want) and not got.requires_grad
    torch.testing.assert_close(ebc.state_dict(), before, atol=0, rtol=0)
    assert all(s.eq(0).all() for k in ebc.fused_kernels() for t in k.optimizer_states() for s in t.values())


def test_out_of_range_id_found_in_fixed_and_jagged_batches():
    ebc = EmbeddingBagCollection(TABLES)
    ones = torch.ones(6, dtype=torch.long)  # every feature has 2 ids: the fixed-size fast path
    fixed = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], torch.tensor([1, 2, 3, 4, 5, 50]), ones)
    with pytest.raises(ValueError, match=r"feature 'f2' has id 50 outside table 't0'"):
        ebc(fixed)
    jagged = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], torch.tensor([1, 2, 30, 5]),
                                                 torch.tensor([2, 0, 1, 0, 1, 0]))
    with pytest.raises(ValueError, match=r"feature 'f1' has id 30 outside table 't1'"):
        ebc(jagged)


def test_kernel_choices_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="fused optimizer would be ignored"):
        EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("sgd"), kernel="dense")
    with pytest.raises(ValueError, match="fuses an optimizer"):
        EmbeddingBagCollection(TABLES, kernel="fbgemm")
    with pytest.raises(ValueError, match="unknown embedding kernel 'cuda'"):
        EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("sgd"), kernel="cuda")


def test_adagrad_weight_decay_matches_the_l2_step_on_touched_rows():
    """The step is torch.optim's L2 (g + wd * w) on the rows the batch touches: G += g^2, w -= lr * g / (sqrt(G) + eps).
    Two steps: Adagrad's first moves every touched element by lr * sign(g) whatever the decay, so one step could not
    tell decay from none (fbgemm's CPU kernel, which ignores it, passed; it is refused now, test_bad_input.py)."""
    lr, wd, eps = 0.1, 0.5, 1e-8
    torch.manual_seed(0)
    table = EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["a"])
    ebc = EmbeddingBagCollection([table], optimizer=FusedOptimizerConfig("adagrad", lr=lr, weight_decay=wd, eps=eps))
    w = ebc.state_dict()["embedding_bags.t.weight"].clone()
    kjt = KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([3, 3, 4]), torch.tensor([2, 1]))
    G = torch.zeros_like(w)
    for _ in range(2):
        ebc(kjt).values().sum().backward()
        g = torch.zeros_like(w)
        g[3], g[4] = 2.0, 1.0  # id 3 twice in one bag
        touched = (g != 0).any(1, keepdim=True)
        g = torch.where(touched, g + wd * w, g)
        G = G + g * g
        w = torch.where(touched, w - lr * g / (G.sqrt() + eps), w)
    torch.testing.assert_close(ebc.state_dict()["embedding_bags.t.weight"], w, atol=1e-6, rtol=0)


# TorchRec's ways in: apply_optimizer_in_backward, KeyedOptimizerWrapper ----------------------------


@pytest.mark.parametrize("cls, kwargs, reference_cls", [
    (torch.optim.SGD, {"lr": 0.1}, torch.optim.SGD),
    (torch.optim.Adagrad, {"lr": 0.1}, torch.optim.Adagrad),
    # a fused Adam moves only the rows in the batch: torch.optim.SparseAdam's rule (Adam would move every row
    # whose moments are non-zero)
    (torch.optim.Adam, {"lr": 0.01}, torch.optim.SparseAdam),
    (RowWiseAdagrad, {"lr": 0.1}, RowWiseAdagrad),  # TorchRec's, as a plain optimizer: its eps is 1e-10
])
def test_apply_optimizer_in_backward_trains_as_the_torch_optimizer(cls, kwargs, reference_cls):
    """TorchRec's apply_optimizer_in_backward(cls, ebc.parameters(), kwargs): the class's update, its defaults too
    (Adagrad's eps is 1e-10), fused into backward; every row against nn.EmbeddingBag + torch.optim."""
    from lightning_rec.optim import apply_optimizer_in_backward

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(TABLES)  # plain parameters, as TorchRec's collections are built
    bags = reference_bags(ebc, "sum")
    for bag in bags.values():
        bag.sparse = reference_cls is torch.optim.SparseAdam
    apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)
    assert ebc.fused_optimizer_config().optimizer == {"SGD": "sgd", "Adagrad": "adagrad", "Adam": "adam",
                                                      "RowWiseAdagrad": "rowwise_adagrad"}[cls.__name__]
    assert all(not p.requires_grad for p in ebc.parameters())  # fused: no gradient is kept
    reference = reference_cls([p for b in bags.values() for p in b.parameters()], **kwargs)
    for step in range(3):
        kjt = random_kjt(["f0", "f1", "f2"], [50, 30, 50], B=5, seed=step)
        (ebc(kjt).values() ** 2).sum().backward()
        reference.zero_grad()
        (reference_forward(bags, TABLES, kjt, "sum") ** 2).sum().backward()
        reference.step()
    # Adam divides by sqrt(v) of a few squared gradients: the summation-order rounding is scaled up by it
    atol = 1e-4 if cls is torch.optim.Adam else ATOL
    for name, bag in bags.items():
        torch.testing.assert_close(ebc.embedding_bags[name].weight, bag.weight, atol=atol, rtol=0)


def test_apply_optimizer_in_backward_refuses_what_it_cannot_fuse():
    from lightning_rec.optim import apply_optimizer_in_backward

    ebc = EmbeddingBagCollection(TABLES)
    with pytest.raises(ValueError, match=r"got tables \['t0'\] .* but not \['t1'\]"):
        apply_optimizer_in_backward(torch.optim.SGD, [ebc.embedding_bags["t0"].weight], {"lr": 0.1})
    with pytest.raises(ValueError, match="not a table of an unsharded EmbeddingBagCollection"):
        apply_optimizer_in_backward(torch.optim.SGD, nn.Linear(2, 2).parameters(), {"lr": 0.1})
    with pytest.raises(ValueError, match="has no momentum"):
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.1, "momentum": 0.9})
    with pytest.raises(ValueError, match="torch.optim.SGD, torch.optim.Adagrad and torch.optim.Adam"):
        apply_optimizer_in_backward(torch.optim.RMSprop, ebc.parameters(), {"lr": 0.1})
    if "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters:  # torch 2.6+
        # AdamW's decay, asked of Adam, trained as Adam's L2 decay without a word
        with pytest.raises(ValueError, match="has no decoupled_weight_decay; leave it at False"):
            apply_optimizer_in_backward(torch.optim.Adam, ebc.parameters(),
                                        {"lr": 0.1, "weight_decay": 0.01, "decoupled_weight_decay": True})
    apply_optimizer_in_backward("rowwise_adagrad", ebc.parameters(), {"lr": 0.2})  # our fused names work too
    assert ebc.fused_optimizer_config() == FusedOptimizerConfig("rowwise_adagrad", lr=0.2)


def test_keyed_optimizer_wrapper_steps_the_dense_parameters_only():
    """KeyedOptimizerWrapper(dict(model.named_parameters()), factory): fused tables are left out (no Adagrad state
    for them), the dense layers step as the factory's optimizer would."""
    from lightning_rec.optim import KeyedOptimizerWrapper, in_backward_optimizer_filter

    torch.manual_seed(0)
    model = nn.ModuleDict({"ebc": EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("sgd", lr=0.1)),
                           "dense": nn.Linear(20, 1)})
    reference = nn.Linear(20, 1)
    reference.load_state_dict(model["dense"].state_dict())
    wrapped = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda ps: torch.optim.Adagrad(ps, lr=0.1))
    assert sorted(wrapped.params) == ["dense.bias", "dense.weight"]
    assert [n for n, _ in in_backward_optimizer_filter(model.named_parameters())] == ["dense.weight", "dense.bias"]
    combined = CombinedOptimizer([("fused", FusedOptimizer(model)), ("dense", wrapped)])
    ref_opt = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    for step in range(2):
        x = model["ebc"](random_kjt(["f0", "f1", "f2"], [50, 30, 50], B=4, seed=step)).values().detach()
        combined.zero_grad()
        model["dense"](x).sum().backward()
        combined.step()
        ref_opt.zero_grad()
        reference(x).sum().backward()
        ref_opt.step()
    torch.testing.assert_close(model["dense"].weight, reference.weight)
    assert len(combined.state) == 2  # Adagrad's sum for the two dense parameters, none for the tables


@pytest.mark.parametrize("fused", [False, True])
def test_outputs_and_state_dict_follow_the_configs_order(fused):
    """Tables of other poolings or data types sit in other kernels; the outputs still come in the configs' order
    (TorchRec's), so that values() read by position holds each feature where the configs put it."""
    tables = [EmbeddingBagConfig(name="a", num_embeddings=10, embedding_dim=4, feature_names=["fa"], pooling="mean"),
              EmbeddingBagConfig(name="b", num_embeddings=10, embedding_dim=8, feature_names=["fb", "fb2"]),
              EmbeddingBagConfig(name="c", num_embeddings=10, embedding_dim=4, feature_names=["fc"], pooling="mean"),
              EmbeddingBagConfig(name="d", num_embeddings=10, embedding_dim=4, feature_names=["fd"])]
    ebc = EmbeddingBagCollection(tables, optimizer=FusedOptimizerConfig("sgd", lr=0.1) if fused else None)
    kjt = random_kjt(["fd", "fc", "fb2", "fb", "fa"], [10] * 5, B=3)
    kt = ebc(kjt)
    assert kt.keys() == ebc.feature_names() == ["fa", "fb", "fb2", "fc", "fd"]
    assert kt.length_per_key() == [4, 8, 8, 4, 4]
    expected = torch.cat([reference_forward(reference_bags(ebc, c.pooling.value), [c], kjt, c.pooling.value)
                          for c in tables], dim=1)
    torch.testing.assert_close(kt.values(), expected, atol=ATOL, rtol=0)
    assert list(ebc.state_dict()) == [f"embedding_bags.{t}.weight" for t in "abcd"]
    ec = EmbeddingCollection([EmbeddingConfig(name="s", num_embeddings=10, embedding_dim=4, feature_names=["fs"]),
                              EmbeddingConfig(name="w", num_embeddings=10, embedding_dim=8, feature_names=["fw"]),
                              EmbeddingConfig(name="x", num_embeddings=10, embedding_dim=4, feature_names=["fx"])])
    assert list(ec(random_kjt(["fs", "fw", "fx"], [10] * 3, B=2))) == ["fs", "fw", "fx"]


def test_torchrec_data_type_names():
    from lightning_rec import DataType

    fp16 = EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, data_type=DataType.FP16)
    assert fp16.data_type == torch.float16
    assert EmbeddingConfig(name="s", num_embeddings=10, embedding_dim=4, data_type=DataType.FP32).data_type == \
        torch.float32


def test_the_table_owner_registry_forgets_collections_that_are_gone():
    # apply_optimizer_in_backward finds a table's collection by its parameter's id; every collection built (a
    # notebook, a sweep, kernels rebuilt on a device move) left its entries behind for the life of the process
    import gc

    from lightning_rec import embedding

    def build():
        return EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{i}", num_embeddings=4, embedding_dim=4,
                                                          feature_names=[f"f{i}"]) for i in range(3)])

    kept = build()
    gc.collect()
    before = len(embedding._TABLE_OWNERS)
    for _ in range(5):
        build()
    gc.collect()
    assert len(embedding._TABLE_OWNERS) == before
    assert embedding.table_owner(kept.embedding_bags["t1"].weight) == (kept, "t1")


@pytest.mark.parametrize("kernel", ["fbgemm", "native"])
def test_deepcopy_of_a_fused_collection_keeps_its_parameters_on_its_kernels(kernel):
    """copy.deepcopy (an EMA / AveragedModel copy): the copy's state_dict follows the copy's training, a
    load_state_dict into it reaches its kernels, and the original is untouched. Its parameters were clones
    (nn.Parameter's deepcopy), frozen at the copy's weights."""
    import copy

    from lightning_rec.optim import apply_optimizer_in_backward

    ebc = EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("sgd", lr=0.1), kernel=kernel)
    before = {n: p.detach().clone() for n, p in ebc.table_parameters().items()}
    twin = copy.deepcopy(ebc)
    kjt = random_kjt(["f0", "f1", "f2"], [50, 30, 50], B=4)
    twin(kjt).values().sum().backward()
    moved = twin.lookup.table_weights()
    for name, param in twin.table_parameters().items():
        assert torch.equal(param, moved[name])  # the state dict shows what the copy trained
        assert torch.equal(ebc.table_parameters()[name], before[name])  # the original did not move
    assert not torch.equal(moved["t0"], before["t0"])
    twin.load_state_dict(ebc.state_dict())
    assert torch.equal(twin(kjt).values(), ebc(kjt).values())
    # the copy's tables are its own to fuse anew (TorchRec's apply_optimizer_in_backward finds their owner)
    plain = copy.deepcopy(EmbeddingBagCollection(TABLES))
    apply_optimizer_in_backward(torch.optim.SGD, plain.parameters(), {"lr": 0.1})
    assert plain.fused_optimizer_config().optimizer.value == "sgd"


@pytest.mark.parametrize("optimizer", [None, FusedOptimizerConfig("sgd", lr=0.1)])
def test_load_state_dict_with_assign_reaches_the_kernel(optimizer):
    """load_state_dict(sd, assign=True) (meta-init flows, Lightning's and HF's loaders) replaced the table parameter
    with the loaded tensor: state_dict() showed it, forward kept reading the kernel's old rows."""
    ebc = EmbeddingBagCollection(TABLES, optimizer=optimizer)
    kjt = random_kjt(["f0", "f1", "f2"], [50, 30, 50], B=4)
    source = EmbeddingBagCollection(TABLES, optimizer=optimizer)
    ebc.load_state_dict(source.state_dict(), assign=True)
    torch.testing.assert_close(ebc(kjt).values(), source(kjt).values(), atol=0, rtol=0)
    for name, param in ebc.table_parameters().items():
        assert torch.equal(param, ebc.lookup.table_weights()[name])


@pytest.mark.parametrize("collection", ["ebc", "ec"])
def test_torch_export_of_a_collection_matches_eager(collection):
    """torch.export of an EmbeddingBagCollection / EmbeddingCollection taking a KJT (TorchRec's export path) stopped at
    the id check ('Could not guard on data-dependent expression'); the exported program matches eager, and eager
    still refuses an id out of range. Exported first: tensors the export made were kept for later eager calls,
    which then failed the same way."""
    torch.manual_seed(0)
    if collection == "ebc":
        model = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
                                                                  feature_names=["a", "b"])],
                                       optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.1))
    else:
        model = EmbeddingCollection(tables=[EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10,
                                                            feature_names=["a", "b"])])
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3, 4, 0]), lengths=torch.tensor([2, 1, 0, 2]))
    program = torch.export.export(model, (kjt,))
    eager = model(kjt)
    exported = program.module()(kjt)
    if collection == "ebc":
        assert exported.keys() == ["a", "b"]
        torch.testing.assert_close(exported.values(), eager.values())
    else:
        assert list(exported) == ["a", "b"]
        for k in eager:
            torch.testing.assert_close(exported[k].values(), eager[k].values())
            assert torch.equal(exported[k].lengths(), eager[k].lengths())
    bad = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3, 4, 10]), lengths=torch.tensor([2, 1, 0, 2]))
    with pytest.raises(ValueError, match="out of range"):
        model(bad)


def test_torchrec_embedding_collection_accessors():
    """TorchRec's EmbeddingCollection.embedding_dim() / embedding_names_by_table() and config.num_features() were
    missing (AttributeError)."""
    tables = [EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["a", "b"]),
              EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=5, feature_names=["c"])]
    ec = EmbeddingCollection(tables=tables)
    assert ec.embedding_dim() == 4
    assert ec.embedding_names_by_table() == [["a", "b"], ["c"]] == [c.feature_names for c in tables]
    assert [c.num_features() for c in tables] == [2, 1]
    assert EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=3, feature_names=["x"]).num_features() == 1
    mixed = EmbeddingCollection(tables=[tables[0], EmbeddingConfig(name="t3", embedding_dim=8, num_embeddings=5,
                                                                   feature_names=["d"])])
    with pytest.raises(ValueError, match="different dims"):
        mixed.embedding_dim()


@pytest.mark.parametrize("optimizer,kernel", [(None, "auto"), ("sgd", "fbgemm"), ("sgd", "native")])
def test_fp16_tables_look_up_under_bf16_autocast(optimizer, kernel):
    """Lightning's precision="bf16-mixed" runs the step under CPU autocast to bfloat16, whose torch.cat refuses
    float16 inputs: FP16 tables unfused (or with fbgemm's kernel beside an FP32 table) failed with "Unexpected
    floating ScalarType in at::autocast::prioritize". The outputs are those without autocast."""
    tables = [EmbeddingBagConfig(name="t0", num_embeddings=50, embedding_dim=8, feature_names=["f0", "f2"],
                                 data_type=torch.float16),
              EmbeddingBagConfig(name="t1", num_embeddings=30, embedding_dim=4, feature_names=["f1"])]
    fused = FusedOptimizerConfig(optimizer, lr=0.1) if optimizer else None
    for configs in (tables, [tables[0]]):
        ebc = EmbeddingBagCollection(configs, optimizer=fused, kernel=kernel)
        kjt = random_kjt(["f0", "f2", "f1"][: 3 if len(configs) == 2 else 2], [50, 50, 30], B=4)
        plain = ebc(kjt).values()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = ebc(kjt).values()
        assert mixed.dtype == plain.dtype
        torch.testing.assert_close(mixed, plain)


# freezing fused tables (fine-tuning) ---------------------------------------------------------------------------


def _freeze_setup(kernel: str, optimizer: str):
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=10, embedding_dim=4, feature_names=[f"f{i}"])
              for i in range(2)]
    ebc = EmbeddingBagCollection(tables, is_weighted=True, optimizer=FusedOptimizerConfig(optimizer, lr=0.1),
                                 kernel=kernel)
    ref = EmbeddingBagCollection(tables, is_weighted=True)  # plain parameters, the same weights
    ref.load_state_dict(ebc.state_dict())
    dense, ref_dense = nn.Linear(8, 1), nn.Linear(8, 1)
    ref_dense.load_state_dict(dense.state_dict())
    return ebc, ref, dense, ref_dense


def _freeze_batch(step: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 3, (6,), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.randint(0, 10, (int(lengths.sum()),), generator=g),
                                               lengths, weights=torch.rand(int(lengths.sum()), generator=g))


def _table_state(ebc) -> list[torch.Tensor]:
    return ([w.detach().clone() for w in ebc.state_dict().values()]
            + [v.clone() for k in ebc.fused_kernels() for st in k.optimizer_states() for v in st.values()])


@pytest.mark.parametrize("how", ["requires_grad_", "BaseFinetuning", "attribute"])
@pytest.mark.parametrize("kernel,optimizer", [("native", "adam"), ("native", "rowwise_adagrad"),
                                              ("fbgemm", "rowwise_adagrad"), ("fbgemm", "sgd")])
def test_frozen_fused_tables_stay_bitwise_unchanged_while_the_dense_part_trains(kernel, optimizer, how):
    """Freezing a fused collection (ebc.requires_grad_(False), Lightning's BaseFinetuning.freeze, or
    `p.requires_grad = False` on its weights) changed nothing: the fused kernels kept updating the tables inside
    backward. Now a frozen collection's tables and optimizer state stay bitwise unchanged, the per-id weights still
    get their gradient, the dense layer trains as with a plain frozen collection, and unfreezing resumes updates."""
    from lightning.pytorch.callbacks import BaseFinetuning

    if kernel == "native":
        pytest.importorskip("lightning_rec._C")
    ebc, ref, dense, ref_dense = _freeze_setup(kernel, optimizer)
    if how == "requires_grad_":
        ebc.requires_grad_(False)
    elif how == "BaseFinetuning":
        BaseFinetuning.freeze(nn.ModuleList([ebc]))
    else:
        for p in ebc.parameters():
            p.requires_grad = False
    ref.requires_grad_(False)
    before = _table_state(ebc)
    opt, ref_opt = torch.optim.SGD(dense.parameters(), lr=0.1), torch.optim.SGD(ref_dense.parameters(), lr=0.1)
    for step in range(3):
        kjt, ref_kjt = _freeze_batch(step), _freeze_batch(step)
        kjt.weights().requires_grad_(True)
        ref_kjt.weights().requires_grad_(True)
        dense(ebc(kjt).values()).square().sum().backward()
        ref_dense(ref(ref_kjt).values()).square().sum().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        torch.testing.assert_close(kjt.weights().grad, ref_kjt.weights().grad)
    after = _table_state(ebc)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    torch.testing.assert_close(dense.weight, ref_dense.weight)
    assert not torch.equal(dense.weight, nn.Linear(8, 1).weight)  # it trained
    ebc.requires_grad_(True)  # unfreeze (LightningModule.unfreeze / BaseFinetuning.make_trainable set it True)
    assert ebc.frozen_tables() == frozenset()
    ebc(_freeze_batch(5)).values().sum().backward()
    assert not torch.equal(before[0], _table_state(ebc)[0])


def test_freezing_some_tables_of_one_fused_kernel_is_refused():
    """Tables of one fused kernel update together: freezing one of them is refused with the fix, not half-done."""
    ebc, *_ = _freeze_setup("fbgemm", "sgd")
    ebc.embedding_bags["t0"].weight.requires_grad = False
    with pytest.raises(ValueError, match=r"freeze all of \['t0', 't1'\] together"):
        ebc(_freeze_batch(0))


def test_a_frozen_fused_collection_stays_frozen_through_deepcopy_and_pickle():
    """nn.Parameter's deepcopy rebuilds a parameter from data and requires_grad only: a copied frozen collection
    trained again. Copies (deepcopy, torch.save / torch.load of the module) keep the freeze."""
    import io

    pytest.importorskip("lightning_rec._C")
    ebc, *_ = _freeze_setup("native", "adam")  # fbgemm's TBE module itself does not pickle (a local function)
    ebc.requires_grad_(False)
    buffer = io.BytesIO()
    torch.save(ebc, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(ebc), torch.load(buffer, weights_only=False)):
        assert copied.frozen_tables() == {"t0", "t1"}
        before = _table_state(copied)
        out = copied(_freeze_batch(0)).values()
        assert not out.requires_grad  # as a frozen plain collection's: no backward, so no update
        assert all(torch.equal(a, b) for a, b in zip(before, _table_state(copied)))


def test_base_finetuning_freezes_then_unfreezes_fused_tables_under_a_trainer(tmp_path):
    """Lightning's BaseFinetuning with combined_optimizer: a KeyError (a tensor) at the first epoch start, as the fused
    optimizer's param groups held the kernel's views, not the model's parameters; and freezing did not hold the
    tables. Now epoch 0 (frozen) leaves the tables bitwise unchanged and epoch 1 (unfrozen) trains them."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BaseFinetuning

    class Tower(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.ebc, _, self.dense, _ = _freeze_setup("fbgemm", "rowwise_adagrad")
            self.snapshots = []

        def on_train_epoch_start(self):
            self.snapshots.append(_table_state(self.ebc))

        def training_step(self, batch, batch_idx):
            return self.dense(self.ebc(batch).values()).square().sum()

        def configure_optimizers(self):
            return combined_optimizer(self, torch.optim.SGD(self.dense.parameters(), lr=0.1))

    class Finetune(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.ebc)

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.ebc, optimizer)

    model = Tower()
    loader = torch.utils.data.DataLoader([_freeze_batch(i) for i in range(3)], batch_size=None)
    pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
               callbacks=[Finetune()]).fit(model, loader)
    frozen, unfrozen, end = *model.snapshots, _table_state(model.ebc)
    assert all(torch.equal(a, b) for a, b in zip(frozen, unfrozen))
    assert not torch.equal(unfrozen[0], end[0]) and model.ebc.frozen_tables() == frozenset()


def test_base_finetuning_unfreezes_dense_layers_beside_fused_tables(tmp_path):
    """BaseFinetuning.unfreeze_and_add_param_group with combined_optimizer: torch's add_param_group put the new group
    in the combined optimizer's list, which no child steps, so the unfrozen layer got gradients and never moved. Now
    the group joins the dense optimizer, the run matches plain torch.optim.SGD over plain tables, and a checkpoint
    of it resumes with the group and its state."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BaseFinetuning

    class Tower(pl.LightningModule):
        def __init__(self, fused: bool):
            super().__init__()
            ebc, ref, self.dense, _ = _freeze_setup("fbgemm", "sgd")
            self.ebc = ebc if fused else ref
            self.head = nn.Linear(1, 1)
            self.fused = fused

        def training_step(self, batch, batch_idx):
            return self.head(self.dense(self.ebc(batch).values())).square().sum()

        def configure_optimizers(self):
            if not self.fused:
                return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)
            return combined_optimizer(self, torch.optim.SGD(self.dense.parameters(), lr=0.1))

    class Finetune(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.head)

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.head, optimizer, lr=0.1, initial_denom_lr=1.0)

    def fit(model, max_epochs, ckpt_path=None):
        loader = torch.utils.data.DataLoader([_freeze_batch(i) for i in range(3)], batch_size=None)
        trainer = pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=tmp_path, callbacks=[Finetune()])
        trainer.fit(model, loader, ckpt_path=ckpt_path)
        return trainer

    fused, plain = Tower(True), Tower(False)
    trainer = fit(fused, 2)
    fit(plain, 2)
    assert not torch.equal(fused.head.weight, Tower(True).head.weight)
    for a, b in [(fused.head, plain.head), (fused.dense, plain.dense)]:
        torch.testing.assert_close(a.weight, b.weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(fused.ebc.state_dict(), plain.ebc.state_dict(), atol=1e-6, rtol=0)

    # resuming: BaseFinetuning assigns the saved groups (the added one included) before the optimizer state loads,
    # which then found the dense optimizer one group short ("a different number of parameter groups")
    trainer.save_checkpoint(tmp_path / "finetuned.ckpt")
    saved = trainer.optimizers[0].state_dict()["dense"]
    resumed = Tower(True)
    dense = fit(resumed, 2, ckpt_path=tmp_path / "finetuned.ckpt").optimizers[0].optimizers[1][1]
    assert len(dense.param_groups) == 2 and dense.param_groups[1]["params"] == list(resumed.head.parameters())
    torch.testing.assert_close(dense.state_dict(), saved, atol=0, rtol=0)


def test_combined_optimizer_takes_assigned_groups_as_base_finetuning_restores_them():
    """BaseFinetuning, resuming, assigns optimizer.param_groups the groups it saved on rank 0. The groups it had added
    join the dense optimizer; a fused group holding tables this rank has no piece of (rank 0's) is no new group (it
    was added to the dense optimizer, which then failed to load its own state)."""
    ebc, other, dense, _ = _freeze_setup("native", "sgd")
    other.use_fused_optimizer(FusedOptimizerConfig("sgd", lr=0.1))  # tables of another rank's groups, say
    head = nn.Linear(1, 1)
    opt = combined_optimizer(nn.ModuleDict(dict(ebc=ebc, dense=dense)), torch.optim.SGD(dense.parameters(), lr=0.1))
    saved = [dict(g) for g in opt.param_groups]
    opt.param_groups = saved + [{**saved[-1], "params": list(other.parameters())},
                                {**saved[-1], "params": list(head.parameters()), "lr": 0.5}]
    sgd = opt.optimizers[1][1]
    assert [g["params"] for g in sgd.param_groups] == [list(dense.parameters()), list(head.parameters())]
    assert sgd.param_groups[1]["lr"] == 0.5 and opt.param_groups == opt.optimizers[0][1].param_groups + sgd.param_groups


def test_combined_optimizer_survives_deepcopy_and_torch_save_with_its_model():
    """copy.deepcopy((model, optimizer)) and torch.save((model, optimizer)): torch's Optimizer pickles only defaults,
    state and param_groups, so the copy had no parts (KeyError '_groups' at its first use), and torch.load of a
    fused group raised AttributeError '_kernels'. Now the copy trains its copied model exactly as the original
    trains the original (an LR scheduler's step wrapper left behind: it stepped the original), and its fused lr
    reaches the copy's kernels only."""
    import io

    ebc = EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("adagrad", lr=0.1))
    model = nn.ModuleDict({"ebc": ebc, "dense": nn.Linear(20, 1)})
    opt = combined_optimizer(model, torch.optim.Adam(dense_parameters(model), lr=0.01))

    def step(m, o, seed):
        kjt = random_kjt(["f0", "f1", "f2"], [50, 30, 50], B=4, seed=seed)
        m["dense"](m["ebc"](kjt).values()).sum().backward()
        o.step()
        o.zero_grad()

    torch.optim.lr_scheduler.StepLR(opt, 1)  # it puts a wrapper of opt.step on the instance: a copy stepped opt
    step(model, opt, 0)
    buf = io.BytesIO()
    torch.save((model, opt), buf)
    buf.seek(0)
    for m2, o2 in [copy.deepcopy((model, opt)), torch.load(buf, weights_only=False)]:
        o2.param_groups[0]["lr"] = 0.05
        assert m2["ebc"].fused_kernels()[0].get_learning_rate() == 0.05
        assert ebc.fused_kernels()[0].get_learning_rate() == 0.1
        o2.param_groups[0]["lr"] = 0.1
        step(m2, o2, 1)
        assert o2.state_dict()["fused"]["state"].keys() == opt.state_dict()["fused"]["state"].keys()
    step(model, opt, 1)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(m2.state_dict()[name], value)
    for key, value in opt.state_dict()["fused"]["state"].items():
        torch.testing.assert_close(o2.state_dict()["fused"]["state"][key], value)
    from lightning_rec.optim import KeyedOptimizerWrapper  # TorchRec's dense part: it lost its inner optimizer

    keyed = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda ps: torch.optim.SGD(ps, lr=0.3))
    assert copy.deepcopy(keyed).state_dict()["param_groups"][0]["lr"] == 0.3


@pytest.mark.parametrize("scheduler", ["OneCycleLR", "CyclicLR"])
def test_cycle_momentum_over_fused_tables_is_refused_naming_cycle_momentum_false(scheduler):
    """OneCycleLR / CyclicLR built in Python over a combined (or fused) optimizer: their default cycle_momentum=True
    said torch's "optimizer must support momentum or beta1", though the dense part was an Adam. Now the refusal
    names the fused tables and cycle_momentum=False, with which the learning rate cycles, the tables' too."""
    ebc = EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("adam", lr=0.1))
    opt = combined_optimizer(ebc, torch.optim.Adam(nn.Linear(3, 1).parameters(), lr=0.1))
    lr_scheduler = torch.optim.lr_scheduler
    make = {"OneCycleLR": lambda o, **kw: lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=4, **kw),
            "CyclicLR": lambda o, **kw: lr_scheduler.CyclicLR(o, 0.01, 0.2, step_size_up=2, **kw)}[scheduler]
    for optimizer in (opt, FusedOptimizer(ebc)):
        with pytest.raises(ValueError, match=rf"^{scheduler}\(cycle_momentum=True\), its default, .* fused embedding "
                                             rf"tables, .* pass {scheduler}\(\.\.\., cycle_momentum=False\)"):
            make(optimizer)
    sched = make(opt, cycle_momentum=False)
    opt.step()
    sched.step()
    assert ebc.fused_kernels()[0].get_learning_rate() == opt.param_groups[0]["lr"] == opt.param_groups[1]["lr"]
    assert "betas" not in opt.defaults  # other readers (LearningRateMonitor's log_momentum) are answered


@pytest.mark.parametrize("kernel", ["fbgemm", "native"])
def test_assigning_a_fused_tables_data_reaches_its_kernel(kernel):
    """`weight.data = pretrained` (and torch.nn.utils.vector_to_parameters, which assigns so) rebound the parameter:
    it showed the new rows while forward and the fused update went on with the old ones, silently. Now the rows
    are written into the kernel (forward equals an nn.EmbeddingBag holding them), and a wrong shape is refused."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    ebc = EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("sgd", lr=0.1), kernel=kernel)
    pretrained = torch.randn(50, 8)
    ebc.embedding_bags["t0"].weight.data = pretrained
    kjt = random_kjt(["f0", "f1", "f2"], [50, 30, 50], B=4)
    f0 = kjt["f0"]
    ref = nn.functional.embedding_bag(f0.values(), pretrained, f0.offsets()[:-1], mode="sum")
    torch.testing.assert_close(ebc(kjt)["f0"], ref)
    vec = parameters_to_vector(ebc.parameters())
    vector_to_parameters(torch.zeros_like(vec), ebc.parameters())
    assert not ebc(kjt).values().any() and not ebc.state_dict()["embedding_bags.t1.weight"].any()
    with pytest.raises(ValueError, match=r"shape \(30, 8\): .* view of the kernel's rows \(shape \(30, 4\)\)"):
        ebc.embedding_bags["t1"].weight.data = torch.zeros(30, 8)


def test_a_group_of_fused_table_weights_added_to_a_combined_optimizer_is_refused():
    """optimizer.add_param_group({"params": ebc.parameters(), "lr": 0.5}) (to give the tables another rate) joined the
    dense child, which never stepped them: nothing changed, silently. Now refused, naming the fused group's lr; a
    group of new dense layers (a generator too) still joins the dense child and trains."""
    ebc = EmbeddingBagCollection(TABLES, optimizer=FusedOptimizerConfig("sgd", lr=0.1))
    opt = combined_optimizer(ebc, torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"holds fused table weights \(param group\(s\) fused0\).*'lr' .*'fused0'"):
        opt.add_param_group({"params": ebc.parameters(), "lr": 0.5})
    extra = nn.Linear(2, 1)
    opt.add_param_group({"params": extra.parameters(), "lr": 0.5})
    extra(torch.ones(1, 2)).sum().backward()
    before = extra.weight.detach().clone()
    opt.step()
    torch.testing.assert_close(extra.weight.detach(), before - 0.5)


@pytest.mark.parametrize("case", ["fbgemm_bags", "fused_sequence", "dense_weighted"])
def test_torch_export_of_fbgemm_and_weighted_collections_matches_eager(case):
    """torch.export stopped inside fbgemm's TBE forward ('get value out of a tracing tensor with aten.item': it reads
    its step counter on the host), so no fbgemm collection exported: a fused EmbeddingCollection on CPU,
    kernel='fbgemm', every collection on GPU; and a weighted EmbeddingBagCollection on any kernel that slices per
    feature failed with 'Could not guard on data-dependent expression'. Now they export, equal to eager (fp16 tables
    pooled in fp32, as the kernel pools), and the program takes another batch size under Dim.AUTO."""
    torch.manual_seed(0)
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.1)
    weights = torch.tensor([0.5, 1.0, 2.0, 3.0, 0.25, 1.5])
    kjt = KeyedJaggedTensor(["a", "b", "c"], torch.tensor([1, 2, 3, 4, 0, 7]),
                            lengths=torch.tensor([2, 1, 0, 2, 0, 1]), weights=weights)
    other = KeyedJaggedTensor(["a", "b", "c"], torch.tensor([1, 2, 3, 4, 0, 7, 5]),
                              lengths=torch.tensor([2, 1, 1, 0, 1, 0, 0, 2, 0]), weights=torch.rand(7))
    if case == "fused_sequence":
        model = EmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=3, num_embeddings=10,
                                                     feature_names=["a", "b"]),
                                     EmbeddingConfig(name="u", embedding_dim=3, num_embeddings=8,
                                                     feature_names=["c"])], optimizer=opt)
    else:
        fbgemm = case == "fbgemm_bags"
        model = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="t", embedding_dim=3, num_embeddings=10, feature_names=["a", "b"],
                                pooling="mean", data_type=torch.float16 if fbgemm else torch.float32),
             EmbeddingBagConfig(name="u", embedding_dim=5, num_embeddings=8, feature_names=["c"])],
            is_weighted=True, optimizer=opt if fbgemm else None, kernel="fbgemm" if fbgemm else "auto")
    auto = {0: torch.export.Dim.AUTO}
    program = torch.export.export(model, (kjt,), dynamic_shapes={"features": [auto, auto, auto, None, None, None]})
    for batch in (kjt, other):
        eager, exported = model(batch), program.module()(batch)
        if case == "fused_sequence":
            assert list(exported) == list(eager)
            for k in eager:
                torch.testing.assert_close(exported[k].values(), eager[k].values(), atol=0, rtol=0)
        else:
            assert exported.keys() == eager.keys()
            torch.testing.assert_close(exported.values(), eager.values(), atol=0, rtol=0)  # same rows, same order


def test_a_double_cast_of_a_model_holding_a_collection_names_32_true_and_the_way_back():
    """model.double() (Lightning's precision='64-true') of a model with dense layers before its collection: the
    refusal suggested 'bf16-mixed', and the layers converted before it stayed float64 without a word (the next
    forward failed on mixed dtypes). Now it names '32-true' and model.float(), which restores a working model."""
    model = nn.Sequential(nn.Linear(2, 2), EmbeddingBagCollection(TABLES))
    with pytest.raises(ValueError, match=r"'64-true' converts it: use '32-true'.*stay torch.float64: model.float\(\)"):
        model.double()
    assert model[0].weight.dtype == torch.float64
    model.float()
    assert model[0].weight.dtype == torch.float32
    with pytest.raises(ValueError, match="use 'bf16-mixed'"):
        model.half()


@pytest.mark.parametrize("kernel", ["dense", "native", "fbgemm"])
def test_torchrec_init_fn_initialises_the_tables_rows(kernel):
    """EmbeddingBagConfig(..., init_fn=partial(nn.init.normal_, std=...)) (TorchRec's field) was a TypeError. Now it
    is called on the table's weight in place (the kernel's rows: forward reads them; fbgemm's padded dim 3 too),
    tables without one keep the uniform draw, and a value that is not a function is refused."""
    import functools

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="t0", num_embeddings=50, embedding_dim=3, feature_names=["f0"],
                                 init_fn=functools.partial(nn.init.constant_, val=0.25)),
              EmbeddingBagConfig(name="t1", num_embeddings=30, embedding_dim=4, feature_names=["f1"])]
    opt = None if kernel == "dense" else FusedOptimizerConfig("rowwise_adagrad", lr=0.1)
    ebc = EmbeddingBagCollection(tables, optimizer=opt, kernel=kernel)
    assert torch.equal(ebc.state_dict()["embedding_bags.t0.weight"], torch.full((50, 3), 0.25))
    assert ebc.state_dict()["embedding_bags.t1.weight"].std() > 0.05  # uniform in +-sqrt(1/30)
    kjt = KeyedJaggedTensor(["f0", "f1"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 0, 0, 1]))
    torch.testing.assert_close(ebc(kjt)["f0"], torch.tensor([[0.5] * 3, [0.0] * 3]))
    with pytest.raises(ValueError, match="init_fn must be a function of the weight"):
        EmbeddingBagConfig(name="t", num_embeddings=3, embedding_dim=2, init_fn=0.1)


def test_torchrecs_positional_need_indices_names_the_keyword():
    """EmbeddingCollection(tables, None, True), TorchRec's positional need_indices, was refused as 'optimizer=True:
    pass a FusedOptimizerConfig', naming nothing the user wrote. Now it names need_indices=True."""
    tables = [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["a"])]
    with pytest.raises(ValueError, match=r"third argument is optimizer here \(TorchRec's need_indices\): pass "
                                         r"need_indices=True by keyword"):
        EmbeddingCollection(tables, None, True)
    assert EmbeddingCollection(tables, None, need_indices=True).need_indices()


@pytest.mark.parametrize("kernel", ["dense", "native", "fbgemm"])
def test_torch_compile_fullgraph_trains_as_eager_and_still_checks_ids(kernel):
    """torch.compile(model, fullgraph=True) of a model holding a collection stopped at the id check's host read
    ('Could not guard on data-dependent expression', batch_check.py), then at the table's freeze flag, and for fbgemm
    at its step counter's .item(). Now the dense and native kernels compile whole and train as eager (the ids still
    checked, inside the graph, with the eager ValueError); fbgemm's training lookup refuses fullgraph naming
    fullgraph=False, which (graph breaks) trains as eager, and without grad fbgemm compiles whole too."""
    opt = None if kernel == "dense" else FusedOptimizerConfig("rowwise_adagrad", lr=0.1)
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="t0", num_embeddings=50, embedding_dim=8, feature_names=["f0"]),
              EmbeddingBagConfig(name="t1", num_embeddings=30, embedding_dim=4, feature_names=["f1"], pooling="mean")]
    eager = nn.Sequential(EmbeddingBagCollection(tables, optimizer=opt, kernel=kernel, is_weighted=True))
    model = copy.deepcopy(eager)  # a copy: its freeze flags are read again (while tracing) at its first forward
    compiled = torch.compile(model, fullgraph=kernel != "fbgemm")
    for seed in range(2):
        kjt = random_kjt(["f1", "f0"], [30, 50], B=4, weighted=True, seed=seed)  # the other order: a permute
        a, b = eager(kjt).values(), compiled(kjt).values()
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
        (a * a).sum().backward()
        (b * b).sum().backward()
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=ATOL, rtol=0)
    bad = KeyedJaggedTensor(["f0", "f1"], torch.tensor([1, 30]), lengths=torch.tensor([1, 0, 0, 1]),
                            weights=torch.ones(2))
    with pytest.raises(ValueError, match="feature 'f1' has id 30 outside table 't1'"):
        compiled(bad)
    torch._dynamo.reset()  # compiled code is cached per function: the fullgraph=False one would run again
    whole = torch.compile(model, fullgraph=True)
    if kernel == "fbgemm":
        with pytest.raises(Exception, match="without fullgraph=True"):
            whole(kjt)
    with torch.no_grad():
        torch.testing.assert_close(whole(kjt).values(), eager(kjt).values(), atol=ATOL, rtol=0)
    torch._dynamo.reset()


def test_torchrec_config_fields_need_pos_and_pruning_are_taken_or_refused_by_name():
    """TorchRec's BaseEmbeddingConfig fields need_pos, num_embeddings_post_pruning, input_dim, total_num_buckets,
    use_virtual_table and virtual_table_eviction_policy were unexpected-keyword TypeErrors. Their defaults are taken
    now (need_pos either way: learned weights train under every sharding type here); another value is refused by
    name, saying what to do."""
    kw = dict(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"])
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(**kw, need_pos=True, num_embeddings_post_pruning=None,
                                                     input_dim=None, total_num_buckets=None, use_virtual_table=False,
                                                     virtual_table_eviction_policy=None)], is_weighted=True)
    kjt = KeyedJaggedTensor(["f"], torch.tensor([1, 2]), lengths=torch.tensor([2]), weights=torch.tensor([1.0, 2.0]))
    assert ebc(kjt).values().shape == (1, 4)
    assert EmbeddingConfig(**kw, num_embeddings_post_pruning=10).num_embeddings == 10
    for field, value, words in [("num_embeddings_post_pruning", 5, "row pruning for quantized inference.*"
                                 "num_embeddings=5"), ("use_virtual_table", True, "virtual .* not supported"),
                                ("total_num_buckets", 4, "bucketized"), ("input_dim", 3, "input_dim=3 is not"),
                                ("need_pos", "yes", "need_pos must be True or False")]:
        with pytest.raises(ValueError, match=words):
            EmbeddingConfig(**kw, **{field: value})
