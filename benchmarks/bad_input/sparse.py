"""KeyedJaggedTensor, JaggedTensor and KeyedTensor: construction, lookups, methods."""

from __future__ import annotations

from .helpers import KJT, KJT_read, T, _t, check_ebc, good_batch, kjt_lengths, make_ebc, read, tables_of, unchanged
from .registry import case, expect, simple

SMOKE = ("kjt.values_bool", "kjt.lengths_sum_too_small", "kjt.int32_ids_int64_lengths", "kjt.id_equal_to_rows",
         "kt.regroup_correct")


def kjt_construction_cases() -> None:
    """Ids, lengths, offsets, keys and weights refused when a collection reads the KJT (its constructor assigns)."""
    torch = _t()
    from lightning_rec import KeyedJaggedTensor

    simple("kjt.values_float64_with_offsets",
           lambda: KJT_read(["a"], T([1.0, 2.0], torch.float64), offsets=T([0, 2])), ValueError, ["integers", "long()"])
    simple("kjt.values_bool", lambda: KJT_read(["a"], T([True, False]), lengths=T([2])), ValueError, ["bool", "long()"])
    simple("kjt.values_complex", lambda: KJT_read(["a"], torch.tensor([1 + 0j]), lengths=T([1])), ValueError,
           ["integers"])
    simple("kjt.values_2d_matrix", lambda: KJT_read(["a"], T([[1, 2], [3, 4]]), lengths=T([2])), ValueError, ["1-d"])
    simple("kjt.values_scalar", lambda: KJT_read(["a"], T(3), lengths=T([1])), ValueError, ["values"])
    simple("kjt.lengths_float16", lambda: KJT_read(["a"], T([1, 2]), lengths=T([2.0], torch.float16)), ValueError,
           ["lengths", "integer"])
    simple("kjt.lengths_negative_sum_ok", lambda: KJT_read(["a", "b"], T([1, 2]), lengths=T([3, -1])), ValueError,
           ["lengths", ">= 0"])
    simple("kjt.lengths_matrix", lambda: KJT_read(["a", "b"], T([1, 2]), lengths=T([[1], [1]])), ValueError, ["1-d"])
    simple("kjt.lengths_three_for_two_keys", lambda: KJT_read(["a", "b"], T([1, 2, 3]), lengths=T([1, 1, 1])),
           ValueError,
           ["multiple", "key-major"])
    simple("kjt.lengths_sum_too_small", lambda: KJT_read(["a"], T([1, 2, 3, 4]), lengths=T([1, 2])), ValueError,
           ["add up", "4 values"])
    simple("kjt.offsets_start_at_two", lambda: KJT_read(["a"], T([5, 6, 7, 8]), offsets=T([2, 3, 4])), ValueError,
           ["start at 2", "rebase"])
    simple("kjt.offsets_go_down", lambda: KJT_read(["a", "b"], T([5, 6, 7]), offsets=T([0, 3, 1, 3, 3])), ValueError,
           ["never decrease"])
    simple("kjt.offsets_end_short", lambda: KJT_read(["a"], T([5, 6, 7]), offsets=T([0, 1, 2])), ValueError,
           ["end at 2", "3 values"])
    simple("kjt.offsets_float32", lambda: KJT_read(["a"], T([5, 6]), offsets=T([0.0, 2.0])), ValueError,
           ["offsets", "integer"])
    simple("kjt.offsets_empty", lambda: KJT_read(["a"], T([], torch.int64), offsets=T([], torch.int64)), ValueError,
           ["offsets"])
    simple("kjt.keys_one_string", lambda: kjt_lengths("user", [1], [1]), ValueError, ["keys=['user']"])
    simple("kjt.keys_repeated", lambda: kjt_lengths(["a", "a"], [1, 2], [1, 1]), ValueError, ["duplicate", "a"])
    simple("kjt.keys_are_ints", lambda: kjt_lengths([0, 1], [1, 2], [1, 1]), ValueError, ["str"])
    simple("kjt.keys_none", lambda: kjt_lengths(None, [1, 2], [1, 1]), ValueError, ["keys"])
    simple("kjt.weights_int64", lambda: read(kjt_lengths(["a"], [1, 2], [2], weights=T([1, 2]))), ValueError,
           ["floating", "weights.float()"])
    simple("kjt.weights_one_short", lambda: read(kjt_lengths(["a"], [1, 2], [2], weights=T([1.0]))), ValueError,
           ["one weight per id"])
    simple("kjt.weights_column_vector", lambda: read(kjt_lengths(["a"], [1, 2], [2], weights=T([[1.0], [2.0]]))),
           ValueError, ["weights"])
    simple("kjt.stride_disagrees_with_lengths",
           lambda: KJT_read(["a", "b"], T([1, 2, 3, 4]), lengths=T([1, 1, 1, 1]), stride=3), ValueError,
           ["stride 3", "one length per key per sample"])
    simple("kjt.vbe_strides_disagree_with_lengths",
           lambda: KJT_read(["a", "b"], T([1, 2, 3]), lengths=T([1, 1, 1]), stride_per_key_per_rank=[[1], [3]],
                            inverse_indices=(["a", "b"], T([[0, 0, 0], [0, 1, 2]]))), ValueError,
           ["stride_per_key_per_rank", "gives 4 bags", "3 lengths"])
    simple("kjt.vbe_without_inverse_indices",
           lambda: KJT_read(["a", "b"], T([1, 2, 3]), lengths=T([1, 1, 1]), stride_per_key_per_rank=[[1], [2]]),
           ValueError, ["variable batch", "inverse_indices"])
    simple("kjt.values_python_list", lambda: KeyedJaggedTensor.from_lengths_sync(["a"], [1, 2], T([2])),
           ValueError, ["values", "tensor"])
    simple("kjt.lengths_python_list", lambda: KJT_read(["a"], T([1, 2]), lengths=[2]), ValueError,
           ["lengths", "tensor"])


def kjt_lookup_cases() -> None:
    """Batches a collection looks up: dtypes, views, empty bags, ids out of range."""
    torch = _t()

    @case("kjt.lengths_and_offsets_disagree", ValueError, ["lengths", "offsets"])
    def _(ctx):
        # both given and they describe different bags: one of the two would silently win
        kjt = KJT(["a", "b"], T([1, 2, 3]), lengths=T([1, 2]), offsets=T([0, 2, 3]))
        ebc = make_ebc()
        ebc(kjt)

    @case("kjt.noncontiguous_values_view", legit="a strided view of ids is a valid tensor: same ids, same result")
    def _(ctx):
        ids = (torch.arange(20) % 6)[::3][:4]  # a strided view: [0, 3, 0, 3]
        kjt = kjt_lengths(["a", "b"], ids, [2, 1, 1, 0])
        expect(not kjt.values().is_contiguous(), "setup: view should be non-contiguous")
        check_ebc(make_ebc(), kjt)

    @case("kjt.sliced_values_from_bigger_batch", legit="values[3:7] with matching lengths is a complete batch")
    def _(ctx):
        big = T([9, 9, 9, 1, 2, 3, 0, 9])
        check_ebc(make_ebc(), kjt_lengths(["a", "b"], big[3:7], [2, 1, 1, 0]))

    @case("kjt.int32_ids_int64_lengths", legit="TorchRec accepts int32 ids")
    def _(ctx):
        check_ebc(make_ebc(), kjt_lengths(["a", "b"], T([1, 2, 3, 0], torch.int32), [2, 1, 1, 0]))

    @case("kjt.int64_ids_int32_lengths", legit="int32 lengths are TorchRec's usual dtype")
    def _(ctx):
        check_ebc(make_ebc(), kjt_lengths(["a", "b"], T([1, 2, 3, 0]), T([2, 1, 1, 0], torch.int32)))

    @case("kjt.int8_ids", ValueError, ["int8"], ok=True, legit="int8 ids may be widened: the result must be right")
    def _(ctx):
        check_ebc(make_ebc(), kjt_lengths(["a", "b"], T([1, 2, 3, 0], torch.int8), [2, 1, 1, 0]))

    @case("kjt.uint8_ids", ValueError, ["uint8"], ok=True)
    def _(ctx):
        check_ebc(make_ebc(), kjt_lengths(["a", "b"], T([1, 2, 3, 0], torch.uint8), [2, 1, 1, 0]))

    @case("kjt.int16_lengths", ValueError, ["int16"], ok=True)
    def _(ctx):
        check_ebc(make_ebc(), kjt_lengths(["a", "b"], T([1, 2, 3, 0]), T([2, 1, 1, 0], torch.int16)))

    @case("kjt.batch_of_zero_samples", legit="an empty batch gives a [0, D] output")
    def _(ctx):
        out = make_ebc()(kjt_lengths(["a", "b"], T([], torch.int64), T([], torch.int64)))
        expect(tuple(out.values().shape) == (0, 8), f"shape {tuple(out.values().shape)}")

    @case("kjt.every_bag_empty", legit="empty bags pool to zeros")
    def _(ctx):
        out = check_ebc(make_ebc(), kjt_lengths(["a", "b"], T([], torch.int64), [0, 0, 0, 0]))
        expect(bool((out.values() == 0).all()), "empty bags not zero")

    @case("kjt.id_2_pow_40", ValueError, ["'a'", "t_a", "2^40" if False else "1099511627776"])
    def _(ctx):
        ebc = make_ebc()
        before = tables_of(ebc)
        ctx.after(unchanged(ebc, before))
        ebc(kjt_lengths(["a", "b"], T([1, 2 ** 40, 3, 0]), [2, 1, 1, 0])).values().sum().backward()

    @case("kjt.id_minus_one_second_feature", ValueError, ["'b'", "t_b", "-1"])
    def _(ctx):
        ebc = make_ebc()
        ctx.after(unchanged(ebc, tables_of(ebc)))
        ebc(kjt_lengths(["a", "b"], T([1, 2, 3, -1]), [2, 1, 1, 0])).values().sum().backward()

    @case("kjt.id_equal_to_rows", ValueError, ["'b'", "t_b", "6"])
    def _(ctx):
        ebc = make_ebc()
        ctx.after(unchanged(ebc, tables_of(ebc)))
        ebc(kjt_lengths(["a", "b"], T([1, 2, 3, 6]), [2, 1, 1, 0])).values().sum().backward()


def kjt_method_cases() -> None:
    """split, permute, concat, from_jt_dict, to_dict, __getitem__."""
    from lightning_rec import JaggedTensor, KeyedJaggedTensor

    @case("kjt.split_segments_too_many", ValueError, ["segments"])
    def _(ctx):
        good_batch().split([3])

    @case("kjt.split_negative_segment", ValueError, ["segments"])
    def _(ctx):
        good_batch().split([3, -1])

    @case("kjt.permute_index_out_of_range", ValueError, ["permute", "5"])
    def _(ctx):
        good_batch().permute([0, 5])

    @case("kjt.permute_negative_index", ValueError, ["permute", "-1"], ok=True,
          legit="a negative index may count from the end as in Python")
    def _(ctx):
        p = good_batch().permute([-1, 0])
        expect(p.keys() == ["b", "a"], f"keys {p.keys()}")
        expect(p.values().tolist() == [0, 1, 2, 3], f"values {p.values().tolist()}")

    @case("kjt.permute_reorders_correctly")
    def _(ctx):
        p = good_batch().permute([1, 0])
        expect(p.keys() == ["b", "a"] and p.lengths().tolist() == [1, 0, 2, 1] and p.values().tolist() == [0, 1, 2, 3],
               f"permute gave {p.keys()} {p.lengths().tolist()} {p.values().tolist()}")

    @case("kjt.concat_different_batch_sizes", ValueError, ["stride"])
    def _(ctx):
        KeyedJaggedTensor.concat([kjt_lengths(["a"], [1], [1]), kjt_lengths(["b"], [1, 2], [1, 1])])

    @case("kjt.concat_same_key_twice", ValueError, ["duplicate", "a"])
    def _(ctx):
        read(KeyedJaggedTensor.concat([kjt_lengths(["a"], [1], [1]), kjt_lengths(["a"], [2], [1])]))

    @case("kjt.concat_weighted_with_unweighted", ValueError, ["weight"])
    def _(ctx):
        KeyedJaggedTensor.concat([kjt_lengths(["a"], [1], [1], weights=T([1.0])), kjt_lengths(["b"], [2], [1])])

    # TorchRec's from_jt_dict: a variable batch; a collection reading it without inverse_indices refuses it
    @case("kjt.from_jt_dict_different_batch_sizes", ValueError,
          ["stride_per_key_per_rank [[1], [3]]", "inverse_indices"])
    def _(ctx):
        read(KeyedJaggedTensor.from_jt_dict({"a": JaggedTensor(T([1]), lengths=T([1])),
                                             "b": JaggedTensor(T([1, 2]), lengths=T([1, 0, 1]))}))

    @case("kjt.getitem_unknown_key", KeyError, ["'zz'", "'a'"])
    def _(ctx):
        good_batch()["zz"]

    @case("kjt.to_dict_round_trip_weights")
    def _(ctx):
        k = kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0], weights=T([0.5, 1.0, 2.0, 3.0]))
        d = k.to_dict()
        expect(d["b"].values().tolist() == [0] and d["b"].weights().tolist() == [3.0]
               and d["a"].lengths().tolist() == [2, 1] and d["a"].weights().tolist() == [0.5, 1.0, 2.0],
               "to_dict split the wrong ids or weights")
        back = KeyedJaggedTensor.from_jt_dict(d)
        expect(back.values().tolist() == [1, 2, 3, 0] and back.weights().tolist() == [0.5, 1.0, 2.0, 3.0],
               "from_jt_dict(to_dict()) changed the batch")

    @case("kjt.values_and_lengths_on_different_devices", ValueError, ["device"])
    def _(ctx):
        read(KJT(["a"], T([1, 2]).to("meta"), lengths=T([2])))


def kjt_weight_cases() -> None:
    """Weights a weighted collection refuses or casts."""
    torch = _t()

    @case("kjt.weights_nan_weighted_ebc", ValueError, ["'a'", "t_a", "nan"])
    def _(ctx):
        ebc = make_ebc(weighted=True)
        ctx.after(unchanged(ebc, tables_of(ebc)))
        k = kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0], weights=T([1.0, float("nan"), 1.0, 1.0]))
        ebc(k).values().sum().backward()

    @case("kjt.weights_neg_inf_second_feature", ValueError, ["'b'", "t_b", "inf"])
    def _(ctx):
        ebc = make_ebc(weighted=True, opt="adagrad")
        ctx.after(unchanged(ebc, tables_of(ebc)))
        k = kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0], weights=T([1.0, 1.0, 1.0, -float("inf")]))
        ebc(k).values().sum().backward()

    @case("kjt.weights_float64_weighted_ebc", ValueError, ["float64"], ok=True,
          legit="double weights may be cast: the result must equal the float32 reference")
    def _(ctx):
        k = kjt_lengths(["a", "b"], [1, 2, 3, 0], [2, 1, 1, 0], weights=T([0.5, 2.0, 1.0, -1.0], torch.float64))
        check_ebc(make_ebc(weighted=True), k, weighted=True)


def jagged_and_keyed_tensor_cases() -> None:
    """JaggedTensor and KeyedTensor."""
    torch = _t()
    from lightning_rec import JaggedTensor, KeyedJaggedTensor, KeyedTensor

    # JaggedTensor
    simple("jt.neither_lengths_nor_offsets", lambda: JaggedTensor(T([1, 2])), ValueError, ["lengths", "offsets"])

    def batch_of(jt):  # a JaggedTensor's checks run where it joins a batch (its constructor assigns)
        return KeyedJaggedTensor.from_jt_dict({"a": jt})

    simple("jt.offsets_start_at_one", lambda: batch_of(JaggedTensor(T([1, 2, 3]), offsets=T([1, 2, 3]))), ValueError,
           ["start at 1"])
    simple("jt.weights_too_long",
           lambda: batch_of(JaggedTensor(T([1, 2]), weights=T([1.0, 1.0, 1.0]), lengths=T([2]))),
           ValueError, ["one weight per id"])
    simple("jt.lengths_negative", lambda: batch_of(JaggedTensor(T([1, 2]), lengths=T([3, -1]))), ValueError,
           [">= 0"])

    @case("jt.to_padded_dense_negative_length", ValueError, ["desired_length"])
    def _(ctx):
        JaggedTensor(T([1, 2, 3]), lengths=T([2, 1])).to_padded_dense(desired_length=-1)

    @case("jt.to_padded_dense_truncates")
    def _(ctx):
        out = JaggedTensor(T([1, 2, 3]), lengths=T([2, 1])).to_padded_dense(desired_length=1)
        expect(out.tolist() == [[1], [3]], f"to_padded_dense(1) = {out.tolist()}")

    @case("jt.to_dense_and_from_dense")
    def _(ctx):
        jt = JaggedTensor.from_dense([T([1, 2]), T([], torch.int64), T([7])])
        expect(jt.lengths().tolist() == [2, 0, 1] and [t.tolist() for t in jt.to_dense()] == [[1, 2], [], [7]],
               "from_dense/to_dense round trip")

    # KeyedTensor
    simple("kt.widths_do_not_add_up", lambda: KeyedTensor(["a", "b"], [2, 2], torch.zeros(3, 5)), ValueError,
           ["5 columns", "4"])
    simple("kt.more_keys_than_widths", lambda: KeyedTensor(["a", "b"], [5], torch.zeros(3, 5)), ValueError,
           ["2 keys", "1 widths"])
    simple("kt.key_dim_out_of_range", lambda: KeyedTensor(["a"], [5], torch.zeros(3, 5), key_dim=2), ValueError,
           ["key_dim"])
    simple("kt.duplicate_keys", lambda: KeyedTensor(["a", "a"], [2, 3], torch.zeros(3, 5)), ValueError,
           ["duplicate", "a"])
    simple("kt.negative_width", lambda: KeyedTensor(["a", "b"], [-1, 6], torch.zeros(3, 5)), ValueError,
           ["-1"])

    @case("kt.getitem_unknown", KeyError, ["'c'", "'a'"])
    def _(ctx):
        KeyedTensor(["a", "b"], [2, 3], torch.zeros(3, 5))["c"]

    @case("kt.regroup_unknown_key", KeyError, ["'zz'"])
    def _(ctx):
        KeyedTensor.regroup([KeyedTensor(["a"], [2], torch.zeros(3, 2))], [["a", "zz"]])

    @case("kt.from_tensor_list_batch_mismatch", ValueError, ["'b'", "batch"])
    def _(ctx):
        KeyedTensor.from_tensor_list(["a", "b"], [torch.zeros(3, 2), torch.zeros(4, 2)])

    @case("kt.regroup_correct")
    def _(ctx):
        kt1 = KeyedTensor(["a", "b"], [1, 2], T([[1.0, 2.0, 3.0]]))
        kt2 = KeyedTensor(["c"], [1], T([[4.0]]))
        g = KeyedTensor.regroup([kt1, kt2], [["c", "a"], ["b"]])
        expect(g[0].tolist() == [[4.0, 1.0]] and g[1].tolist() == [[2.0, 3.0]], f"regroup gave {g}")


def more_sparse_cases() -> None:
    """Second wave: sizes at the edges of the integer types, devices, key sequences."""
    torch = _t()
    from lightning_rec import KeyedJaggedTensor

    simple("more.lengths_huge_few_values", lambda: KJT_read(["a"], T([1, 2]), lengths=T([2 ** 40])), ValueError,
           ["add up to 1099511627776", "2 values"])
    simple("more.offsets_int32_huge_end", lambda: KJT_read(["a"], T([1, 2]), offsets=T([0, 2 ** 31 - 1], torch.int32)),
           ValueError, ["end at 2147483647"])
    simple("more.kjt_to_cuda_without_gpu", lambda: good_batch().to("cuda"), ValueError, ["needs a CUDA GPU"])

    @case("more.keys_as_tuple", legit="any sequence of names is keys")
    def _(ctx):
        check_ebc(make_ebc(), KeyedJaggedTensor.from_lengths_sync(("a", "b"), T([1, 2, 3, 0]), T([2, 1, 1, 0])))


CASES = (kjt_construction_cases, kjt_lookup_cases, kjt_method_cases, kjt_weight_cases,
         jagged_and_keyed_tensor_cases, more_sparse_cases)
