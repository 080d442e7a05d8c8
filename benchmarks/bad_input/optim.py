"""Fused optimizer configs, optimizer state, and the kernels' updates against torch.optim."""

from __future__ import annotations

from .helpers import (
    T,
    _t,
    bag_cfg,
    check_ebc,
    ebc_weights,
    good_batch,
    kjt_lengths,
    make_ebc,
    seq_cfg,
    tables_of,
    unchanged,
)
from .registry import case, expect, simple

SMOKE = ("opt.name_adamw", "opt.lr_text_number", "opt.scheduler_sets_nan_lr",
         "kernel.native.rowwise_adagrad.duplicate_ids_parity", "more.sgd_weight_decay_vs_torch.native")


def optimizer_config_cases() -> None:
    """FusedOptimizerConfig names and hyper-parameters; optimizers a kernel lacks."""
    torch = _t()
    from lightning_rec import FusedOptimizerConfig

    F = FusedOptimizerConfig

    simple("opt.name_adamw", lambda: F("adamw"), ValueError, ["adamw", "rowwise_adagrad"])
    simple("opt.name_none", lambda: F(None), ValueError, ["None", "sgd"])
    simple("opt.name_enum_case", lambda: F("SGD"), ValueError, ["SGD"], ok=True, legit="names are case-insensitive")
    for name in ("sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam", "lamb", "lars_sgd"):
        simple(f"opt.{name}.lr_negative", lambda n=name: F(n, lr=-0.1), ValueError, ["lr", ">= 0"])
    simple("opt.lr_nan", lambda: F("sgd", lr=float("nan")), ValueError, ["lr", "finite"])
    simple("opt.lr_text_not_number", lambda: F("sgd", lr="fast"), ValueError, ["lr='fast'", "lr=0.01"])
    simple("opt.lr_text_number", lambda: _expect_lr(F("sgd", lr="0.5"), 0.5), ValueError, ["lr"], ok=True,
           legit="YAML gives numbers as text: '0.5' is 0.5")
    simple("opt.lr_bool", lambda: F("sgd", lr=True), ValueError, ["lr", "True"])
    simple("opt.lr_tensor", lambda: F("sgd", lr=torch.tensor(0.1)), ValueError, ["lr"], ok=True,
           legit="a 0-d tensor learning rate is a number")
    simple("opt.eps_negative", lambda: F("adagrad", eps=-1e-8), ValueError, ["eps", ">= 0"])
    simple("opt.eps_inf", lambda: F("adam", eps=float("inf")), ValueError, ["eps", "finite"])
    simple("opt.weight_decay_negative", lambda: F("adam", weight_decay=-0.01), ValueError, ["weight_decay"])
    simple("opt.beta1_one", lambda: F("adam", beta1=1.0), ValueError, ["beta1", "[0, 1)"])
    simple("opt.beta2_above_one", lambda: F("partial_rowwise_adam", beta2=1.5), ValueError, ["beta2"])
    simple("opt.momentum_negative", lambda: F("lars_sgd", momentum=-0.5), ValueError, ["momentum"])
    simple("opt.unknown_keyword", lambda: F("adam", bettas=(0.9, 0.99)), TypeError, ["bettas"])

    @case("opt.torch_style_betas", ok=True, legit="torch.optim.Adam's betas=(b1, b2) is accepted as beta1 / beta2")
    def _(ctx):
        c = F("adam", betas=(0.8, 0.99))
        expect((c.beta1, c.beta2) == (0.8, 0.99), f"betas=(0.8, 0.99) gave beta1={c.beta1}, beta2={c.beta2}")
    simple("opt.lamb_on_cpu", lambda: make_ebc(opt="lamb"), ValueError, ["lamb", "GPU"])
    simple("opt.lars_on_cpu_fbgemm", lambda: make_ebc(opt="lars_sgd", kernel="fbgemm"), ValueError, ["lars_sgd"])
    simple("opt.adam_on_fbgemm_cpu", lambda: make_ebc(opt="adam", kernel="fbgemm"), ValueError, ["adam", "native"])


def optimizer_state_cases() -> None:
    """Learning rates a scheduler writes; FusedOptimizer over the wrong module or state."""
    torch = _t()
    from lightning_rec import FusedOptimizer, FusedOptimizerConfig

    F = FusedOptimizerConfig

    @case("opt.scheduler_sets_nan_lr", ValueError, ["learning rate", "nan"])
    def _(ctx):
        ebc = make_ebc(lr=0.1)
        opt = FusedOptimizer(ebc)

        def next_step_uses_old_rate():  # the refused rate must not stay in the group nor reach the kernels
            lr = opt.param_groups[0]["lr"]
            expect(abs(lr - 0.1) < 1e-6, f"param group lr is {lr} after refusal")
            w0 = ebc_weights(ebc)["t_b"].clone()
            ebc(good_batch()).values().sum().backward()
            expect(torch.allclose(w0[0] - ebc_weights(ebc)["t_b"][0], torch.full((4,), 0.1)), "rate changed")
        ctx.after(next_step_uses_old_rate)
        opt.param_groups[0]["lr"] = float("nan")

    @case("opt.scheduler_sets_negative_lr", ValueError, ["learning rate", "-0.5"])
    def _(ctx):
        ebc = make_ebc()
        opt = FusedOptimizer(ebc)
        opt.param_groups[0]["lr"] = -0.5

    @case("opt.scheduler_sets_text_lr", ValueError, ["lr"], ok=True, legit="'0.2' is the number 0.2")
    def _(ctx):
        ebc = make_ebc(lr=0.1)
        opt = FusedOptimizer(ebc)
        opt.param_groups[0]["lr"] = "0.2"
        w0 = ebc_weights(ebc)["t_b"].clone()
        ebc(good_batch()).values().sum().backward()
        w1 = ebc_weights(ebc)["t_b"]
        expect(torch.allclose(w0[0] - w1[0], torch.full((4,), 0.2)), "fused SGD did not use lr 0.2")

    @case("opt.fused_optimizer_of_plain_module", ValueError, ["fused"])
    def _(ctx):
        FusedOptimizer(torch.nn.Linear(2, 2))

    @case("opt.load_state_from_other_tables", (ValueError, KeyError), ["t_"])
    def _(ctx):
        a = make_ebc(opt="adagrad")
        from lightning_rec import EmbeddingBagCollection
        b = EmbeddingBagCollection([bag_cfg("t_zz", 10, 4, ["a"])], optimizer=F("adagrad"))
        FusedOptimizer(b).load_state_dict(FusedOptimizer(a).state_dict())


def kernel_cases() -> None:
    """Each kernel's update on duplicate ids against torch.optim; bad ids at scale; fp16; mean."""
    torch = _t()
    from lightning_rec import FusedOptimizerConfig

    F = FusedOptimizerConfig

    # kernels: parity with torch.optim on duplicate ids (edge: one row twice in a bag and across bags)
    for kernel in ("native", "fbgemm"):
        for opt_name in (("sgd", "adagrad", "rowwise_adagrad") if kernel == "fbgemm"
                         else ("sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam")):
            @case(f"kernel.{kernel}.{opt_name}.duplicate_ids_parity")
            def _(ctx, kernel=kernel, opt_name=opt_name):
                _parity(kernel, opt_name)

    @case("kernel.native_int32_ids_near_int_max", ValueError, ["'a'", "t_a", "2147483647"])
    def _(ctx):
        ebc = make_ebc(kernel="native")
        ctx.after(unchanged(ebc, tables_of(ebc)))
        ebc(kjt_lengths(["a", "b"], T([2 ** 31 - 1, 2, 3, 0], torch.int32), [2, 1, 1, 0])).values().sum().backward()

    @case("kernel.fbgemm_bad_id_many_threads", ValueError, ["'b'", "t_b"])
    def _(ctx):
        torch.set_num_threads(max(torch.get_num_threads(), 16))
        ebc = make_ebc(kernel="fbgemm", opt="rowwise_adagrad")
        ctx.after(unchanged(ebc, tables_of(ebc)))
        ids = torch.randint(0, 6, (4000,))
        ids[3999] = 60
        ebc(kjt_lengths(["a", "b"], ids, [1000, 1000, 1000, 1000])).values().sum().backward()

    @case("kernel.native_bad_id_big_batch", ValueError, ["'a'", "t_a"])
    def _(ctx):
        ebc = make_ebc(kernel="native", opt="adam")
        ctx.after(unchanged(ebc, tables_of(ebc)))
        ids = torch.randint(0, 6, (40000,))
        ids[1234] = 10_000
        ebc(kjt_lengths(["a", "b"], ids, [10000] * 4)).values().sum().backward()

    @case("kernel.fp16_table_native_sgd")
    def _(ctx):
        from lightning_rec import EmbeddingBagCollection
        ebc = EmbeddingBagCollection([bag_cfg("t_a", 10, 4, ["a"], data_type="fp16"),
                                      bag_cfg("t_b", 6, 4, ["b"], data_type="fp16")],
                                     optimizer=F("sgd", lr=0.1), kernel="native")
        check_ebc(ebc, good_batch(), atol=1e-2)

    @case("kernel.weighted_mean_native_vs_fbgemm")
    def _(ctx):
        k = kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0], weights=T([0.5, 2.0, -1.0, 3.0]))
        for kernel in ("native", "fbgemm"):
            check_ebc(make_ebc(kernel=kernel, weighted=True, pooling="mean"), k, mean=True, weighted=True)


def _expect_lr(cfg, lr):
    expect(cfg.lr == lr, f"lr {cfg.lr!r} != {lr}")


def _decay_parity(kernel: str, opt_name: str) -> None:
    """One fused step with weight_decay == torch.optim's step on the touched rows (L2: g + wd * w)."""
    torch = _t()
    from lightning_rec import EmbeddingBagCollection, FusedOptimizerConfig
    lr, wd, eps = 0.1, 0.5, 1e-8
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([bag_cfg("t_a", 10, 4, ["a"])], kernel=kernel,
                                 optimizer=FusedOptimizerConfig(opt_name, lr=lr, weight_decay=wd, eps=eps))
    w0 = ebc_weights(ebc)["t_a"].clone()
    ebc(kjt_lengths(["a"], [3, 3, 4], [2, 1])).values().sum().backward()
    got = ebc_weights(ebc)["t_a"]
    g = torch.zeros_like(w0)
    g[3], g[4] = 2.0, 1.0
    touched = g.abs().sum(1, keepdim=True) > 0
    g = torch.where(touched, g + wd * w0, g)
    if opt_name == "sgd":
        ref = w0 - lr * g
    elif opt_name == "adagrad":
        ref = w0 - lr * g / (g.abs() + eps)
    else:
        ref = w0 - lr * g / ((g * g).mean(1, keepdim=True).sqrt() + eps)
    ref = torch.where(touched, ref, w0)
    expect(torch.allclose(got, ref, atol=1e-5), f"{kernel} {opt_name} weight_decay={wd}: max |diff| "
           f"{float((got - ref).abs().max()):.3g} vs torch.optim")


def _parity(kernel: str, opt_name: str) -> None:
    """One fused step with duplicate ids == the same step by torch.optim on a plain nn.Parameter."""
    torch = _t()
    from lightning_rec import EmbeddingBagCollection, FusedOptimizerConfig
    lr, eps = 0.1, 1e-8
    torch.manual_seed(1)
    ebc = EmbeddingBagCollection([bag_cfg("t_a", 8, 4, ["a"])],
                                 optimizer=FusedOptimizerConfig(opt_name, lr=lr, eps=eps), kernel=kernel)
    w0 = ebc_weights(ebc)["t_a"].clone()
    k = kjt_lengths(["a"], [3, 3, 5, 3, 7], [3, 0, 2])  # row 3 three times, over two bags
    g_B = torch.randn(3, 4)
    (ebc(k).values() * g_B).sum().backward()
    got = ebc_weights(ebc)["t_a"]
    w = torch.nn.Parameter(w0.double().clone())
    rows = [[3, 3, 5], [], [3, 7]]
    pooled = torch.stack([w[r].sum(0) if r else torch.zeros(4, dtype=torch.float64) for r in rows])
    (pooled * g_B.double()).sum().backward()
    g = w.grad.clone()
    with torch.no_grad():
        if opt_name == "sgd":
            ref = w - lr * g
        elif opt_name == "adagrad":
            ref = w - lr * g / (g * g).sqrt().clamp_min(0).add(eps)
            ref = torch.where(g == 0, w, ref)
        elif opt_name == "rowwise_adagrad":
            acc = (g * g).mean(1, keepdim=True)
            ref = torch.where(g.abs().sum(1, keepdim=True) == 0, w, w - lr * g / (acc.sqrt() + eps))
        elif opt_name == "adam":
            m = 0.1 * g
            v = 0.001 * g * g
            ref = w - lr * (m / 0.1) / ((v / 0.001).sqrt() + eps)
            ref = torch.where(g.abs().sum(1, keepdim=True) == 0, w, ref)
        else:  # partial_rowwise_adam: second moment per row
            m = 0.1 * g
            v = 0.001 * (g * g).mean(1, keepdim=True)
            ref = w - lr * (m / 0.1) / ((v / 0.001).sqrt() + eps)
            ref = torch.where(g.abs().sum(1, keepdim=True) == 0, w, ref)
    expect(torch.allclose(got.double(), ref, atol=1e-4), f"{kernel} {opt_name}: max |diff| "
           f"{float((got.double() - ref).abs().max()):.3g} vs the torch reference")


# ==================================================================================================


def more_optimizer_cases() -> None:
    """Second wave: lr=0, eps=0, weight decay against torch.optim."""
    torch = _t()
    from lightning_rec import FusedOptimizerConfig

    @case("more.lr_zero_changes_nothing", legit="lr=0 is a frozen table")
    def _(ctx):
        for kernel, opt in (("native", "adam"), ("fbgemm", "rowwise_adagrad"), ("native", "sgd")):
            ebc = make_ebc(opt=opt, lr=0.0, kernel=kernel)
            before = tables_of(ebc)
            ebc(good_batch()).values().sum().backward()
            unchanged(ebc, before, f"{kernel} {opt} lr=0")()

    for opt_name in ("adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam"):
        @case(f"more.{opt_name}_eps_zero_zero_gradient", ValueError, ["eps", opt_name], ok=True,
              legit="eps=0 is allowed if a row with zero gradient stays finite")
        def _(ctx, opt_name=opt_name):
            for kernel in (("native", "fbgemm") if opt_name in ("adagrad", "rowwise_adagrad") else ("native",)):
                from lightning_rec import EmbeddingBagCollection as EBC
                ebc = EBC([bag_cfg("t_a", 10, 4, ["a"])], optimizer=FusedOptimizerConfig(opt_name, lr=0.1, eps=0.0),
                          kernel=kernel)
                # row 3 is looked up but its bag's output is multiplied by 0: a zero gradient
                (ebc(kjt_lengths(["a"], [3, 4], [1, 1])).values() * T([[0.0], [1.0]])).sum().backward()
                w = ebc_weights(ebc)["t_a"]
                expect(bool(torch.isfinite(w).all()), f"{kernel} {opt_name} eps=0: NaN rows after a zero gradient")

    for kernel in ("native", "fbgemm", "auto"):
        for opt_name in ("sgd", "adagrad", "rowwise_adagrad"):
            @case(f"more.{opt_name}_weight_decay_vs_torch.{kernel}", ValueError, ["weight_decay", "native"], ok=True,
                  legit="weight decay as torch.optim applies it (L2 on the rows a batch touches)")
            def _(ctx, kernel=kernel, opt_name=opt_name):
                _decay_parity(kernel, opt_name)

    @case("more.ec_sgd_weight_decay", ValueError, ["weight_decay", "GPU"], ok=True)
    def _(ctx):
        from lightning_rec import EmbeddingCollection as EC
        ec = EC([seq_cfg("t_a", 10, 4, ["a"])], optimizer=FusedOptimizerConfig("sgd", lr=0.1, weight_decay=0.5))
        w0 = {k: v.clone() for k, v in ec.state_dict().items()}["embeddings.t_a.weight"]
        ec(kjt_lengths(["a"], [3], [1]))["a"].values().sum().backward()
        w1 = ec.state_dict()["embeddings.t_a.weight"]
        expect(torch.allclose(w1[3], w0[3] - 0.1 * (1 + 0.5 * w0[3]), atol=1e-6), "EC SGD ignored weight_decay")


CASES = (optimizer_config_cases, optimizer_state_cases, kernel_cases, more_optimizer_cases)
