"""Table configs and the embedding collections: construction, batches, state dicts."""

from __future__ import annotations

import warnings

from .helpers import (
    T,
    _t,
    bag_cfg,
    check_ebc,
    good_batch,
    kjt_lengths,
    make_ebc,
    make_ec,
    seq_cfg,
    tables_of,
    unchanged,
)
from .registry import case, expect, simple

SMOKE = ("cfg.rows_zero", "coll.two_tables_same_name", "coll.missing_feature_in_batch",
         "coll.keys_in_other_order", "more.dim_3_fbgemm_cpu")


def config_cases() -> None:
    """EmbeddingBagConfig / EmbeddingConfig arguments."""
    torch = _t()
    from lightning_rec import EmbeddingBagCollection, FusedOptimizerConfig

    simple("cfg.rows_zero", lambda: bag_cfg("t", 0, 4, ["f"]), ValueError, ["'t'", "num_embeddings"])
    simple("cfg.rows_float", lambda: bag_cfg("t", 10.0, 4, ["f"]), ValueError, ["'t'", "num_embeddings", "10.0"])
    simple("cfg.rows_numpy_int", lambda: bag_cfg("t", __import__("numpy").int64(10), 4, ["f"]), ValueError,
           ["num_embeddings"], ok=True, legit="a numpy integer is an integer")
    simple("cfg.dim_negative", lambda: bag_cfg("t", 10, -4, ["f"]), ValueError, ["'t'", "embedding_dim", "-4"])
    simple("cfg.dim_string", lambda: bag_cfg("t", 10, "8", ["f"]), ValueError,
           ["embedding_dim", "write embedding_dim=8"])
    simple("cfg.name_empty", lambda: bag_cfg("", 10, 4, ["f"]), ValueError, ["name"])
    simple("cfg.name_with_dot", lambda: bag_cfg("user.id", 10, 4, ["f"]), ValueError, ["'user.id'", "dots"])
    simple("cfg.name_none", lambda: bag_cfg(None, 10, 4, ["f"]), ValueError, ["name"])
    simple("cfg.feature_empty_string", lambda: bag_cfg("t", 10, 4, [""]), ValueError, ["'t'", "feature"])
    simple("cfg.feature_twice", lambda: bag_cfg("t", 10, 4, ["f", "f"]), ValueError, ["'t'", "twice"])
    simple("cfg.feature_names_tuple", lambda: bag_cfg("t", 10, 4, ("f", "g")), ValueError, ["feature"], ok=True,
           legit="a tuple of names is a sequence of names")
    simple("cfg.pooling_max", lambda: bag_cfg("t", 10, 4, ["f"], pooling="max"), ValueError,
           ["'t'", "max", "sum", "mean"])
    simple("cfg.pooling_none_on_bag", lambda: bag_cfg("t", 10, 4, ["f"], pooling="none"), ValueError,
           ["EmbeddingConfig"])
    simple("cfg.data_type_bfloat16", lambda: bag_cfg("t", 10, 4, ["f"], data_type=torch.bfloat16), ValueError,
           ["'t'", "float32", "float16"])
    simple("cfg.data_type_int8_name", lambda: bag_cfg("t", 10, 4, ["f"], data_type="int8"), ValueError,
           ["'int8'", "float32"])
    simple("cfg.init_min_above_max", lambda: make_table_init(0.5, -0.5), ValueError,
           ["weight_init_min", "weight_init_max"])
    simple("cfg.init_nan", lambda: make_table_init(float("nan"), 0.1), ValueError, ["weight_init_min", "nan"])
    simple("cfg.init_inf", lambda: make_table_init(-0.1, float("inf")), ValueError, ["weight_init_max", "inf"])
    simple("cfg.sequence_config_with_pooling", lambda: seq_cfg("t", 10, 4, ["f"], pooling="sum"), TypeError,
           ["pooling"])

    @case("cfg.rows_astronomical", (ValueError, MemoryError, RuntimeError), ["'t_huge'"], timeout=30)
    def _(ctx):
        EmbeddingBagCollection([bag_cfg("t_huge", 10 ** 13, 16, ["f"])], optimizer=FusedOptimizerConfig("sgd"))


def collection_build_cases() -> None:
    """Collections built from the wrong tables, kernels, devices, optimizers, names."""
    torch = _t()
    from lightning_rec import EmbeddingBagCollection, EmbeddingCollection, FusedOptimizerConfig

    simple("coll.no_tables", lambda: EmbeddingBagCollection([]), ValueError, ["at least one table"])
    simple("coll.two_tables_same_name",
           lambda: EmbeddingBagCollection([bag_cfg("t", 5, 4, ["f"]), bag_cfg("t", 5, 4, ["g"])]), ValueError,
           ["unique", "t"])
    @case("coll.feature_read_by_two_tables", legit="TorchRec serves a feature several tables read: one output per "
          "table, named 'feature@table'")
    def _(ctx):
        ebc = EmbeddingBagCollection([bag_cfg("t1", 5, 4, ["f"]), bag_cfg("t2", 9, 8, ["f"])])
        w = {k.split(".")[-2]: v.clone() for k, v in ebc.state_dict().items()}
        kt = ebc(kjt_lengths(["f"], [1, 4, 2], [2, 1]))
        expect(kt.keys() == ["f@t1", "f@t2"], f"keys {kt.keys()}")
        for t in ("t1", "t2"):
            ref = torch.nn.functional.embedding_bag(T([1, 4, 2]), w[t], T([0, 2]), mode="sum")
            expect(torch.allclose(kt[f"f@{t}"], ref, atol=1e-6), f"f@{t} differs from its table's sum")

    @case("coll.ec_feature_read_by_two_tables", legit="TorchRec serves a feature several tables read: one output "
          "per table, named 'feature@table'")
    def _(ctx):
        ec = EmbeddingCollection([seq_cfg("t1", 5, 4, ["f"]), seq_cfg("t2", 9, 4, ["f"])])
        w = {k.split(".")[-2]: v.clone() for k, v in ec.state_dict().items()}
        out = ec(kjt_lengths(["f"], [1, 4, 2], [2, 1]))
        expect(list(out) == ["f@t1", "f@t2"], f"keys {list(out)}")
        for t in ("t1", "t2"):
            expect(torch.equal(out[f"f@{t}"].values(), w[t][T([1, 4, 2])]), f"f@{t} rows wrong")
    def built_on_meta():
        with torch.device("meta"):
            return EmbeddingBagCollection([bag_cfg("t1", 5, 4, ["f"])])

    simple("coll.meta_context_used_before_to_empty", lambda: built_on_meta()(kjt_lengths(["f"], [1], [1])),
           ValueError, ["meta", "to_empty", "DistributedModelParallel"])
    simple("coll.meta_tables_load_without_assign", lambda: built_on_meta().load_state_dict(
        EmbeddingBagCollection([bag_cfg("t1", 5, 4, ["f"])]).state_dict()), ValueError,
           ["meta", "to_empty", "assign=True"])
    simple("coll.shared_feature_id_beyond_smaller_table", lambda: EmbeddingBagCollection(
        [bag_cfg("t1", 5, 4, ["f"]), bag_cfg("t2", 9, 4, ["f"])])(kjt_lengths(["f"], [7], [1])), ValueError,
           ["'f'", "7", "'t1'"])
    simple("coll.ebc_given_sequence_config", lambda: EmbeddingBagCollection([seq_cfg("t", 5, 4, ["f"])]), ValueError,
           ["EmbeddingCollection", "'t'"])
    simple("coll.ec_given_bag_config", lambda: EmbeddingCollection([bag_cfg("t", 5, 4, ["f"])]), ValueError,
           ["EmbeddingBagCollection", "'t'"])
    simple("coll.ebc_given_dict_not_config",
           lambda: EmbeddingBagCollection([{"name": "t", "num_embeddings": 5, "embedding_dim": 4}]), ValueError,
           ["EmbeddingBagConfig"])
    simple("coll.kernel_unknown", lambda: make_ebc(kernel="cuda_fast"), ValueError, ["cuda_fast", "native", "fbgemm"])
    simple("coll.device_cuda_without_gpu", lambda: make_ebc(device="cuda"), ValueError, ["cuda"], ok=False)
    simple("coll.device_mps", lambda: make_ebc(device="mps"), ValueError, ["mps", "cpu"])

    @case("coll.device_meta_plans_without_memory", legit="device='meta' builds tables without allocating them, "
          "to plan a model bigger than this machine (tests/test_bad_input_distributed.py does)")
    def _(ctx):
        from lightning_rec import EmbeddingShardingPlanner, Topology
        ebc = EmbeddingBagCollection([bag_cfg("t_big", 10 ** 9, 128, ["f"])], device="meta",
                                     optimizer=FusedOptimizerConfig("rowwise_adagrad"))
        plan = EmbeddingShardingPlanner(Topology(world_size=64, local_world_size=8, ddr_cap=1 << 40),
                                        print_stats=False).plan(ebc)
        expect("t_big" in plan.plan[""], f"plan {plan}")
    simple("coll.optimizer_as_string", lambda: make_ebc_opt("adam"), ValueError, ["FusedOptimizerConfig"])
    simple("coll.optimizer_torch_class", lambda: make_ebc_opt(torch.optim.Adam), ValueError, ["FusedOptimizerConfig"])
    simple("coll.ec_on_native_kernel", lambda: EmbeddingCollection(
        [seq_cfg("t1", 5, 4, ["f"]), seq_cfg("t2", 5, 6, ["g"])], optimizer=FusedOptimizerConfig("sgd"),
        kernel="native"), ValueError, ["native", "kernel='fbgemm'"])

    @case("coll.ec_dims_differ_auto", legit="sequence tables of different dims in one collection are allowed")
    def _(ctx):
        ec = EmbeddingCollection([seq_cfg("t1", 5, 4, ["f"]), seq_cfg("t2", 5, 6, ["g"])],
                                 optimizer=FusedOptimizerConfig("sgd"))
        w = {k.split(".")[-2]: v.clone() for k, v in ec.state_dict().items()}
        out = ec(kjt_lengths(["f", "g"], [1, 4, 2], [2, 0, 1, 0]))
        expect(torch.equal(out["g"].values(), w["t2"][T([2])]) and torch.equal(out["f"].values(), w["t1"][T([1, 4])]),
               "sequence rows of mixed dims wrong")

    for bad in ("training", "forward", "type", "_modules", "keys", "state_dict", "cuda"):
        @case(f"coll.table_named_{bad}", legit="any name without dots is a valid table name (TorchRec allows it)")
        def _(ctx, bad=bad):
            ebc = EmbeddingBagCollection([bag_cfg(bad, 10, 4, ["x"]), bag_cfg("t_b", 6, 4, ["b"])],
                                         optimizer=FusedOptimizerConfig("sgd", lr=0.1))
            check_ebc(ebc, kjt_lengths(["x", "b"], [1, 2, 3, 0], [2, 1, 1, 0]))
            expect(ebc.training, "the module's training flag was overwritten")
            sd = ebc.state_dict()
            expect(f"embedding_bags.{bad}.weight" in sd, f"state dict keys {list(sd)}")


def collection_batch_cases() -> None:
    """Batches whose features do not match the tables."""
    torch = _t()

    @case("coll.missing_feature_in_batch", ValueError, ["'b'", "t_b"])
    def _(ctx):
        make_ebc()(kjt_lengths(["a"], [1, 2], [1, 1]))

    @case("coll.extra_feature_warns_result_right",
          legit="a feature no table reads is dropped with a warning (README 'Bad input')")
    def _(ctx):
        ebc = make_ebc()
        k = kjt_lengths(["a", "zzz", "b"], [1, 2, 5, 3, 0], [1, 1, 1, 0, 1, 1])
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = ebc(k)
        expect(any("zzz" in str(x.message) for x in w), "no warning naming the unread feature 'zzz'")
        ref = ebc(kjt_lengths(["a", "b"], [1, 2, 3, 0], [1, 1, 1, 1]))
        expect(torch.equal(out.values(), ref.values()), "dropping the extra feature changed the output")

    @case("coll.weights_to_unweighted_warns", legit="weights given to an unweighted collection: warning, ignored")
    def _(ctx):
        ebc = make_ebc()
        k = kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0], weights=T([9.0, 9.0, 9.0, 9.0]))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = ebc(k)
        expect(any("weight" in str(x.message).lower() for x in w), "no warning about ignored weights")
        ref = ebc(good_batch())
        expect(torch.equal(out.values(), ref.values()), "weights were used by an unweighted collection")

    @case("coll.weighted_without_weights", ValueError, ["weight"])
    def _(ctx):
        make_ebc(weighted=True)(good_batch())

    @case("coll.keys_in_other_order", legit="KJT key order need not match table order")
    def _(ctx):
        ebc = make_ebc(dims=(4, 3))
        out = check_ebc(ebc, kjt_lengths(["b", "a"], [0, 1, 2, 3], [1, 0, 2, 1]))
        expect(out.keys() == ["a", "b"] or out.keys() == ["b", "a"], f"keys {out.keys()}")

    @case("coll.mean_pooling_with_empty_bag")
    def _(ctx):
        for kernel in ("native", "fbgemm"):
            check_ebc(make_ebc(pooling="mean", kernel=kernel), good_batch(), mean=True)


def collection_input_cases() -> None:
    """Sequence lookups, inputs that are not a KJT, state dicts, validate_ids=False."""
    torch = _t()

    @case("coll.ec_keys_reordered_values_right")
    def _(ctx):
        ec = make_ec()
        w = {k.split(".")[-2]: v.clone() for k, v in ec.state_dict().items()}
        out = ec(kjt_lengths(["b", "a"], [5, 1, 2, 3], [1, 0, 2, 1]))
        expect(torch.equal(out["b"].values(), w["t_b"][T([5])]), "EC feature b rows wrong")
        expect(torch.equal(out["a"].values(), w["t_a"][T([1, 2, 3])]), "EC feature a rows wrong")

    @case("coll.ec_out_of_range", ValueError, ["'a'", "t_a", "10"])
    def _(ctx):
        ec = make_ec()
        ctx.after(unchanged(ec, tables_of(ec)))
        for v in ec(kjt_lengths(["a", "b"], [10, 1], [1, 0, 1, 0])).values():
            v.values().sum().backward()

    @case("coll.forward_given_dense_tensor", (TypeError, ValueError), ["KeyedJaggedTensor"])
    def _(ctx):
        make_ebc()(torch.tensor([[1, 2]]))

    @case("coll.forward_given_dict", (TypeError, ValueError), ["KeyedJaggedTensor"])
    def _(ctx):
        make_ebc()({"a": T([1]), "b": T([2])})

    @case("coll.load_state_dict_wrong_shape", RuntimeError, ["t_a", "size mismatch"])
    def _(ctx):
        ebc = make_ebc()
        ctx.after(unchanged(ebc, tables_of(ebc)))
        sd = ebc.state_dict()
        sd["embedding_bags.t_a.weight"] = torch.zeros(11, 4)
        ebc.load_state_dict(sd)

    @case("coll.load_state_dict_nan_rows", ValueError, ["t_a", "nan"], ok=True,
          legit="loading weights is the user's choice; a NaN table then gives NaN outputs, not a corrupt other table")
    def _(ctx):
        ebc = make_ebc()
        sd = ebc.state_dict()
        sd["embedding_bags.t_a.weight"] = torch.full((10, 4), float("nan"))
        ebc.load_state_dict(sd)
        out = ebc(good_batch()).values()
        expect(bool(out[:, :4].isnan().all()) and bool(out[:, 4:].isfinite().all()), "NaN did not stay in t_a")

    @case("coll.validate_ids_off_out_of_range_is_memory_safe", ValueError, ["t_a"], ok=True, timeout=30,
          legit="validate_ids=False: the user opted out; the kernels must stay memory-safe (README)")
    def _(ctx):
        for kernel in ("native", "fbgemm"):
            ebc = make_ebc(kernel=kernel, validate_ids=False)
            ebc(kjt_lengths(["a", "b"], [1, 10 ** 9, 3, -5], [2, 1, 1, 0])).values().sum().backward()


def make_table_init(lo, hi):
    from lightning_rec import EmbeddingBagCollection
    return EmbeddingBagCollection([bag_cfg("t", 10, 4, ["f"], weight_init_min=lo, weight_init_max=hi)])


def make_ebc_opt(optimizer):
    from lightning_rec import EmbeddingBagCollection
    return EmbeddingBagCollection([bag_cfg("t", 10, 4, ["f"])], optimizer=optimizer)


def more_table_cases() -> None:
    """Second wave: the smallest tables, odd dims."""
    from lightning_rec import EmbeddingBagCollection, FusedOptimizerConfig

    @case("more.one_row_one_dim_tables", legit="num_embeddings=1 and embedding_dim=1 are valid sizes")
    def _(ctx):
        for kernel in ("native", "fbgemm"):
            ebc = EmbeddingBagCollection([bag_cfg("t_a", 1, 1, ["a"]), bag_cfg("t_b", 1, 1, ["b"])],
                                         optimizer=FusedOptimizerConfig("rowwise_adagrad"), kernel=kernel)
            check_ebc(ebc, kjt_lengths(["a", "b"], [0, 0, 0], [2, 0, 1, 0]))

    @case("more.dim_3_fbgemm_cpu", legit="any dim on CPU")
    def _(ctx):
        check_ebc(make_ebc(kernel="fbgemm", dims=(3, 5), opt="adagrad"), good_batch())


def managed_collision_cases() -> None:
    """Managed-collision (ZCH) id maps: arguments, raw ids, checkpoints with and without a map."""
    torch = _t()
    from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig, FusedOptimizerConfig
    from lightning_rec.managed_collision import (
        ManagedCollisionCollection,
        ManagedCollisionEmbeddingBagCollection,
        MCHManagedCollisionModule,
    )
    from lightning_rec.sparse import KeyedJaggedTensor

    def tables(rows=8):
        return [EmbeddingBagConfig(name="t", num_embeddings=rows, embedding_dim=4, feature_names=["f"])]

    def mc_ebc(**kw):
        ebc = EmbeddingBagCollection(tables(), optimizer=FusedOptimizerConfig("rowwise_adagrad", lr=0.1))
        return ManagedCollisionEmbeddingBagCollection(
            ebc, ManagedCollisionCollection({"t": MCHManagedCollisionModule(8, **kw)}, tables()))

    def raw(ids):
        return KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor(ids), torch.tensor([len(ids), 0]))

    simple("mc.zch_size_zero", lambda: MCHManagedCollisionModule(0), ValueError, ["zch_size"])
    simple("mc.eviction_interval_zero", lambda: MCHManagedCollisionModule(4, eviction_interval=0), ValueError,
           ["eviction_interval"])
    simple("mc.zch_size_over_table", lambda: ManagedCollisionCollection({"t": MCHManagedCollisionModule(9)},
                                                                        tables()), ValueError, ["zch_size <= 8"])

    @case("mc.negative_raw_ids", ValueError, ["negative ids"])
    def _(ctx):
        m = mc_ebc().train()
        m(raw([2**40, 7]))
        ctx.after(unchanged(m, m.state_dict(), "id map and table"))
        m(raw([3, -5]))

    @case("mc.checkpoint_with_map_into_table_without", RuntimeError, ["_managed_collision_collection"])
    def _(ctx):
        m = mc_ebc()
        m._embedding_module.load_state_dict(m.state_dict())

    @case("mc.checkpoint_without_map_into_table_with", RuntimeError, ["_row_ids"])
    def _(ctx):
        m = mc_ebc()
        m.load_state_dict({"_embedding_module." + k: v for k, v in m._embedding_module.state_dict().items()})

    @case("mc.every_id_new_every_batch", ok=True)
    def _(ctx):
        m = mc_ebc(eviction_policy="lru", eviction_interval=1).train()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(6):
                m(raw([1000 * step + i for i in range(8)]))
        expect(any("evict" in str(w.message) for w in caught), "a table that churns warns with its eviction rate")
        ids, rows = m._managed_collision_collection._managed_collision_modules["t"].id_map()
        expect(ids.numel() == rows.unique().numel(), "every id in the map has a row of its own")


CASES = (config_cases, collection_build_cases, collection_batch_cases, collection_input_cases, more_table_cases,
         managed_collision_cases)
