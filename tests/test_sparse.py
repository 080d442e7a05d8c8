"""KeyedJaggedTensor / JaggedTensor / KeyedTensor: hand-drawn cases and a randomized reference."""

import pytest
import torch

from lightning_rec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor


def drawn():
    #        sample0  sample1  sample2
    #  f1    [1, 2]   []       [3]
    #  f2    [4]      [5, 6]   [7]
    return KeyedJaggedTensor.from_lengths_sync(
        ["f1", "f2"], torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([2, 0, 1, 1, 2, 1]),
        weights=torch.arange(7, dtype=torch.float32),
    )


def bags(kjt):
    """{key: [[ids of sample 0], ...]}: a plain-Python view to compare against."""
    return {k: [b.tolist() for b in jt.to_dense()] for k, jt in kjt.to_dict().items()}


def test_hand_drawn_layout():
    kjt = drawn()
    assert kjt.keys() == ["f1", "f2"] and kjt.stride() == 3
    assert kjt.length_per_key() == [3, 4] and kjt.offset_per_key() == [0, 3, 7]
    assert kjt.offsets().tolist() == [0, 2, 2, 3, 4, 6, 7]
    assert bags(kjt) == {"f1": [[1, 2], [], [3]], "f2": [[4], [5, 6], [7]]}
    assert kjt["f2"].weights().tolist() == [3, 4, 5, 6]
    assert kjt["f1"].to_padded_dense().tolist() == [[1, 2], [0, 0], [3, 0]]


def test_permute_split_concat():
    kjt = drawn()
    p = kjt.permute([1, 0])
    assert p.keys() == ["f2", "f1"] and bags(p) == {"f2": [[4], [5, 6], [7]], "f1": [[1, 2], [], [3]]}
    assert p.weights().tolist() == [3, 4, 5, 6, 0, 1, 2]
    dup = kjt.permute([1, 1])  # TorchRec allows a key twice (two tables reading one feature)
    assert dup.length_per_key() == [4, 4] and dup.values().tolist() == [4, 5, 6, 7, 4, 5, 6, 7]
    a, b = kjt.split([1, 1])
    assert bags(a) == {"f1": [[1, 2], [], [3]]} and bags(b) == {"f2": [[4], [5, 6], [7]]}
    back = KeyedJaggedTensor.concat([b, a])
    assert bags(back) == bags(p) and back.weights().tolist() == p.weights().tolist()
    # an empty KJT (no keys, no weights) adds nothing, next to weighted ones too
    padded = KeyedJaggedTensor.concat([KeyedJaggedTensor.empty(), b, a])
    assert bags(padded) == bags(p) and padded.weights().tolist() == p.weights().tolist()


@pytest.mark.parametrize("indices", [[1, 0], [0], [1], [1, 0, 1]])
def test_permute_learned_weights_gradient(indices):
    """Learned weights (requires_grad) through a subset or a repeat of keys: fbgemm's backward raised a shape error
    ([0]) or crashed the process ([1], [1, 0, 1]): an EmbeddingBagCollection fed a batch with other collections'
    keys too. The gradient is the sum over every place an id's weight went, zero where it went nowhere."""
    kjt = drawn()
    w = kjt.weights().clone().requires_grad_()
    learned = KeyedJaggedTensor(kjt.keys(), kjt.values(), w, lengths=kjt.lengths(), stride=kjt.stride())
    p = learned.permute(indices)
    plain = kjt.permute(indices)
    assert p.values().tolist() == plain.values().tolist() and p.lengths().tolist() == plain.lengths().tolist()
    assert p.weights().tolist() == plain.weights().tolist()
    scale = torch.arange(1.0, p.weights().numel() + 1)
    (p.weights() * scale).sum().backward()
    expected = torch.zeros(w.numel())
    at, opk = 0, kjt.offset_per_key()
    for i in indices:  # where each key's ids went, in order
        n = opk[i + 1] - opk[i]
        expected[opk[i] : opk[i + 1]] += scale[at : at + n]
        at += n
    assert w.grad.tolist() == expected.tolist()


def test_jagged_tensor_refuses_lengths_and_offsets_that_disagree():
    """JaggedTensor(lengths=[1, 2], offsets=[0, 2, 3]) was taken: to_dense split by the lengths, to_padded_dense placed
    ids by the offsets (one at position -1, written to the last column)."""
    values = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="lengths and offsets were both given and describe different bags"):
        JaggedTensor(values=values, lengths=torch.tensor([1, 2]), offsets=torch.tensor([0, 2, 3])).validate()
    both = JaggedTensor(values=values, lengths=torch.tensor([2, 1]), offsets=torch.tensor([0, 2, 3]))
    assert both.to_padded_dense().tolist() == [[1, 2], [3, 0]]


def test_from_offsets_and_jt_dict_agree():
    kjt = drawn()
    other = KeyedJaggedTensor.from_offsets_sync(kjt.keys(), kjt.values(), kjt.offsets(), weights=kjt.weights())
    assert bags(other) == bags(kjt)
    again = KeyedJaggedTensor.from_jt_dict(kjt.to_dict())
    assert bags(again) == bags(kjt) and again.weights().tolist() == kjt.weights().tolist()


def test_randomized_against_python_reference():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        F_, B = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(0, 7, (1,), generator=g))
        keys = [f"k{i}" for i in range(F_)]
        ref = {k: [torch.randint(0, 100, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(B)] for k in keys}
        lengths = torch.tensor([len(b) for k in keys for b in ref[k]], dtype=torch.long)
        values = torch.tensor([v for k in keys for b in ref[k] for v in b], dtype=torch.long)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)
        assert bags(kjt) == ref
        order = torch.randperm(F_, generator=g).tolist()
        assert bags(kjt.permute(order)) == {keys[i]: ref[keys[i]] for i in order}


def test_disagreeing_keys_lengths_values_raise_at_validation():
    """The constructor only assigns (as TorchRec's); validate() is what a collection runs on every batch it is given."""
    with pytest.raises(ValueError, match="lengths add up to 3 but there are 4 values"):
        KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2])).validate()
    with pytest.raises(ValueError, match="not a multiple of the 2 keys"):
        KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1])).validate()
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1]), torch.tensor([2, -1])).validate()
    with pytest.raises(ValueError, match="weights of shape \\(2,\\) for 3 values"):
        KeyedJaggedTensor(["a"], torch.tensor([1, 2, 3]), torch.ones(2), torch.tensor([3])).validate()
    with pytest.raises(ValueError, match="duplicate keys"):
        KeyedJaggedTensor.from_lengths_sync(["a", "a"], torch.tensor([1, 2]), torch.tensor([1, 1])).validate()
    # a KJT holds values of any dtype (TorchRec's); integer ids are the collections' contract (tests/test_bad_input.py)
    KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1.0]), torch.tensor([1])).validate()


def test_length_and_offset_per_key_that_disagree_with_the_lengths_raise():
    """They are trusted once given (to_dict, permute and the collections slice ids by them): a stale list gave
    feature 'a' the ids of 'b' and a collection's output changed without a word."""
    values, lengths = torch.tensor([1, 2, 3]), torch.tensor([1, 0, 1, 1])  # a: [1], b: [2, 3]
    with pytest.raises(ValueError, match=r"length_per_key \[2, 1\] disagrees .* \[1, 2\]"):
        KeyedJaggedTensor(["a", "b"], values, lengths=lengths, length_per_key=[2, 1]).validate()
    with pytest.raises(ValueError, match=r"offset_per_key \[0, 2, 3\] disagrees .* \[0, 1, 3\]"):
        KeyedJaggedTensor(["a", "b"], values, lengths=lengths, offset_per_key=[0, 2, 3]).validate()
    with pytest.raises(ValueError, match="length_per_key has 1 entries for the 2 keys"):
        KeyedJaggedTensor(["a", "b"], values, lengths=lengths, length_per_key=[3]).validate()
    with pytest.raises(ValueError, match="7th positional argument is stride_per_key_per_rank"):
        # TorchRec's positional order
        KeyedJaggedTensor(["a", "b"], values, None, lengths, None, None, [[2], [2]]).validate()
    ok = KeyedJaggedTensor(["a", "b"], values, lengths=lengths, length_per_key=[1, 2], offset_per_key=[0, 1, 3])
    assert bags(ok) == {"a": [[1], []], "b": [[2], [3]]}


def test_variable_batch_per_key_is_held_and_checked_against_the_lengths():
    """TorchRec's VBE arguments were an unexpected-keyword TypeError, then refused where keys have their own batch
    sizes; now a variable batch is held (each key its bags, tests/test_variable_batch.py reads it through the
    collections) and its strides are checked against its lengths by validate()."""
    values, lengths = torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1])
    for kwargs in (dict(stride_per_key_per_rank=[[1], [2]]), dict(stride_per_key=[1, 2]),
                   dict(stride_per_key_per_rank=[[1, 0], [1, 1]])):
        kjt = KeyedJaggedTensor(["a", "b"], values, lengths=lengths, **kwargs).validate()
        assert kjt.variable_stride_per_key() and kjt.stride_per_key() == [1, 2] and kjt.stride() == 2
        assert bags(kjt) == {"a": [[1]], "b": [[2], [3]]}
    with pytest.raises(ValueError, match=r"gives 4 bags .* but there are 3 lengths"):
        KeyedJaggedTensor(["a", "b"], values, lengths=lengths, stride_per_key_per_rank=[[1], [3]]).validate()
    with pytest.raises(ValueError, match="inverse_indices must be bag positions in 0..1"):  # taken: see the end
        KeyedJaggedTensor.from_lengths_sync(["a", "b"], values, torch.tensor([1, 0, 1, 1]),
                                            inverse_indices=(["a", "b"], torch.full((2, 2), 2))).validate()
    with pytest.raises(ValueError, match="index_per_key"):
        KeyedJaggedTensor(["a", "b"], values, lengths=torch.tensor([1, 0, 1, 1]),
                          index_per_key={"b": 0, "a": 1}).validate()
    same = KeyedJaggedTensor.from_offsets_sync(["a", "b"], values, torch.tensor([0, 1, 1, 2, 3]),
                                               stride_per_key_per_rank=[[2], [2]])
    kjt = KeyedJaggedTensor(["a", "b"], values, lengths=torch.tensor([1, 0, 1, 1]), stride_per_key=[2, 2],
                            index_per_key={"a": 0, "b": 1}, jt_dict=None, stride_per_key_per_rank=[])
    assert bags(same) == bags(kjt) == {"a": [[1], []], "b": [[2], [3]]} and kjt.stride() == 2
    assert kjt.stride_per_key_per_rank() == [] and kjt.inverse_indices_or_none() is None


def test_empty():
    e = KeyedJaggedTensor.empty()
    assert e.keys() == [] and e.stride() == 0 and e.length_per_key() == []
    no_ids = torch.empty(0, dtype=torch.long)
    z = KeyedJaggedTensor.from_lengths_sync(["a", "b"], no_ids, no_ids)
    assert z.stride() == 0 and z.length_per_key() == [0, 0]
    assert KeyedJaggedTensor.empty_like(drawn()).length_per_key() == [0, 0]


def test_to_and_pin_keep_metadata():
    kjt = drawn().to("cpu", non_blocking=True)
    assert kjt.length_per_key() == [3, 4]
    assert kjt.to("cpu") is kjt  # nothing moves: itself, as Tensor.to (the pipeline knows a batch's KJT by identity)
    assert kjt.to(torch.device("cpu")) is kjt
    if torch.cuda.is_available():
        assert bags(kjt.pin_memory()) == bags(kjt)


def test_keyed_tensor():
    a, b = torch.randn(4, 2), torch.randn(4, 3)
    kt = KeyedTensor.from_tensor_list(["a", "b"], [a, b])
    assert kt.length_per_key() == [2, 3] and kt.offset_per_key() == [0, 2, 5]
    torch.testing.assert_close(kt["b"], b)
    torch.testing.assert_close(kt.to_dict()["a"], a)
    other = KeyedTensor.from_tensor_list(["c"], [torch.ones(4, 1)])
    g1, g2 = KeyedTensor.regroup([kt, other], [["c", "a"], ["b"]])
    torch.testing.assert_close(g1, torch.cat([torch.ones(4, 1), a], dim=1))
    torch.testing.assert_close(g2, b)
    with pytest.raises(ValueError, match="columns"):
        KeyedTensor(["a"], [3], torch.randn(4, 2))


def test_jagged_tensor():
    jt = JaggedTensor.from_dense([torch.tensor([1, 2]), torch.tensor([], dtype=torch.long), torch.tensor([3])])
    assert jt.lengths().tolist() == [2, 0, 1] and jt.offsets().tolist() == [0, 2, 2, 3]
    with pytest.raises(ValueError, match="lengths add up"):
        JaggedTensor(values=torch.tensor([1]), lengths=torch.tensor([2])).validate()


def test_torchrec_accessors():
    """TorchRec's accessors that TorchRec users call, with its semantics (its docstrings' examples)."""
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    weights = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    offsets = torch.tensor([0, 2, 2, 3, 4, 5, 8])
    jt = JaggedTensor(values=values, weights=weights, offsets=offsets)
    for got, want in zip(jt.to_dense_weights(), [[0.1, 0.2], [], [0.3], [0.4], [0.5], [0.6, 0.7, 0.8]]):
        torch.testing.assert_close(got, torch.tensor(want))
    torch.testing.assert_close(jt.to_padded_dense_weights(desired_length=2, padding_value=1.0), torch.tensor(
        [[0.1, 0.2], [1.0, 1.0], [0.3, 1.0], [0.4, 1.0], [0.5, 1.0], [0.6, 0.7]]))
    assert torch.equal(jt.offsets_or_none(), offsets) and jt.lengths_or_none() is None  # built from offsets
    assert jt.lengths().tolist() == [2, 0, 1, 1, 1, 3] and jt.lengths_or_none().tolist() == [2, 0, 1, 1, 1, 3]
    unweighted = JaggedTensor(values=values, lengths=torch.tensor([2, 0, 1, 1, 1, 3]))
    assert unweighted.to_dense_weights() is None and unweighted.to_padded_dense_weights() is None
    assert unweighted.offsets_or_none() is None  # not computed yet
    unweighted.offsets()
    assert unweighted.offsets_or_none().tolist() == offsets.tolist()

    kjt = drawn()  # 2 keys, stride 3
    assert kjt.stride_per_key() == [3, 3] and kjt.variable_stride_per_key() is False
    lazy = KeyedJaggedTensor(["f1", "f2"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 0, 2, 0]))
    assert lazy.length_per_key_or_none() is None and lazy.offset_per_key_or_none() is None
    assert lazy.offset_per_key() == [0, 1, 3]
    assert lazy.length_per_key_or_none() == [1, 2] and lazy.offset_per_key_or_none() == [0, 1, 3]
    assert lazy.lengths_or_none().tolist() == [1, 0, 2, 0]

    a, b, c = torch.randn(4, 2), torch.randn(4, 3), torch.randn(4, 1)
    kt1, kt2 = KeyedTensor.from_tensor_list(["a", "b"], [a, b]), KeyedTensor.from_tensor_list(["c"], [c])
    grouped = KeyedTensor.regroup_as_dict([kt1, kt2], [["c", "a"], ["b"]], ["user", "item"])
    assert list(grouped) == ["user", "item"]
    torch.testing.assert_close(grouped["user"], torch.cat([c, a], dim=1))
    torch.testing.assert_close(grouped["item"], b)
    with pytest.raises(ValueError, match="one name per group"):
        KeyedTensor.regroup_as_dict([kt1], [["a"], ["b"]], ["x"])


class _BagsOfKJT(torch.nn.Module):
    """Plain PyTorch over a KJT's tensors, returning a KeyedTensor: what torch.export must carry in and out."""

    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(10, 3, mode="sum")

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        pooled_FB_D = self.bag(kjt.values(), kjt.offsets()[:-1], per_sample_weights=kjt.weights())
        f1, f2 = pooled_FB_D.chunk(2)
        return KeyedTensor(["f1", "f2"], [3, 3], torch.cat([f1, f2], dim=1))


def test_kjt_jt_kt_are_pytree_nodes_and_export():
    """As TorchRec's, the three are pytree nodes: torch.export of a model taking a KJT (and returning a KeyedTensor)
    refused it ('Unsupported input type <class KeyedJaggedTensor>'); now it runs and matches eager."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    kjt = drawn()
    leaves, spec = tree_flatten(kjt)
    assert [t for t in leaves if t is not None] == [kjt.values(), kjt.weights(), kjt.lengths()]
    back = tree_unflatten(leaves, spec)
    assert back.keys() == kjt.keys() and back.stride() == 3 and bags(back) == bags(kjt)
    jt = JaggedTensor(values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
    jt_back = tree_unflatten(*tree_flatten(jt))
    assert [b.tolist() for b in jt_back.to_dense()] == [[1, 2], [3]] and jt_back.weights_or_none() is None
    kt = KeyedTensor(["a", "b"], [1, 2], torch.randn(4, 3))
    kt_back = tree_unflatten(*tree_flatten(kt))
    assert kt_back.keys() == ["a", "b"] and kt_back.length_per_key() == [1, 2]
    torch.testing.assert_close(kt_back["b"], kt["b"])

    model = _BagsOfKJT()
    eager = model(kjt)
    exported = torch.export.export(model, (kjt,)).module()(kjt)
    assert exported.keys() == ["f1", "f2"]
    torch.testing.assert_close(exported.values(), eager.values())
    compiled = torch.compile(model, backend="eager", fullgraph=True)(kjt)
    torch.testing.assert_close(compiled.values(), eager.values())


def test_torchrec_methods_a_port_calls():
    """TorchRec's JaggedTensor.from_dense_lengths, .device() on all three (a method there: kjt.device() raised
    "'torch.device' object is not callable" here), KJT.unsync / lengths_offset_per_key / flatten_lengths and
    record_stream were missing; each against a few lines of plain Python."""
    padded = torch.tensor([[1, 2, 0], [0, 0, 0], [3, 4, 5]])
    lengths = torch.tensor([2, 0, 3])
    weights = padded.float() / 10
    jt = JaggedTensor.from_dense_lengths(padded, lengths, weights)
    want = [row[:n].tolist() for row, n in zip(padded, lengths.tolist())]
    assert [b.tolist() for b in jt.to_dense()] == want == [[1, 2], [], [3, 4, 5]]
    torch.testing.assert_close(jt.weights(), torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]))
    assert JaggedTensor.from_dense_lengths(padded, lengths).weights_or_none() is None
    torch.testing.assert_close(jt.to_padded_dense(3), padded)  # the round trip
    with pytest.raises(ValueError, match="within 0..3"):
        JaggedTensor.from_dense_lengths(padded, torch.tensor([2, 0, 4]))

    kjt, kt = drawn(), KeyedTensor(["a"], [2], torch.randn(3, 2))
    assert jt.device() == kjt.device() == kt.device() == torch.device("cpu")
    assert kjt.lengths_offset_per_key() == [0, 3, 6]  # key k's lengths: lengths()[3k : 3k + 3]
    for k, key in enumerate(kjt.keys()):
        lo, hi = kjt.lengths_offset_per_key()[k : k + 2]
        assert torch.equal(kjt.lengths()[lo:hi], kjt[key].lengths())
    assert kjt.flatten_lengths().lengths().dim() == 1 and bags(kjt.flatten_lengths()) == bags(kjt)
    assert kjt.length_per_key_or_none() == [3, 4]
    assert kjt.unsync() is kjt and kjt.length_per_key_or_none() is None and kjt.offset_per_key_or_none() is None
    assert kjt.length_per_key() == [3, 4]  # computed again when asked


def test_torchrec_argument_names_of_empty_and_concat():
    """KeyedJaggedTensor.empty(..., weights_dtype=, lengths_dtype=) and concat(kjt_list=...), TorchRec's keywords,
    were 'unexpected keyword argument'."""
    for cls in (JaggedTensor, KeyedJaggedTensor):
        e = cls.empty(is_weighted=True, values_dtype=torch.int32, weights_dtype=torch.float16,
                      lengths_dtype=torch.int32)
        assert (e.values().dtype, e.weights().dtype, e.lengths().dtype) == (torch.int32, torch.float16, torch.int32)
        assert cls.empty().values().dtype == torch.int64 and cls.empty().weights_or_none() is None
    both = KeyedJaggedTensor.concat(kjt_list=drawn().split([1, 1]))
    assert both.keys() == ["f1", "f2"] and bags(both) == bags(drawn())


def test_keyed_tensor_takes_torchrecs_caches_checked_and_regroups_an_empty_group():
    """TorchRec's KeyedTensor(..., offset_per_key=, index_per_key=) was an unexpected-keyword TypeError; an empty
    group in regroup was torch.cat's "expected a non-empty list of Tensors" (TorchRec gives a [B, 0] tensor)."""
    values = torch.arange(6.0).view(2, 3)
    kt = KeyedTensor(["a", "b"], [1, 2], values, offset_per_key=[0, 1, 3], index_per_key={"a": 0, "b": 1})
    torch.testing.assert_close(kt["b"], values[:, 1:])
    with pytest.raises(ValueError, match=r"offset_per_key \[0, 2, 3\] disagrees with the widths \[1, 2\]"):
        KeyedTensor(["a", "b"], [1, 2], values, offset_per_key=[0, 2, 3])
    with pytest.raises(ValueError, match="index_per_key"):
        KeyedTensor(["a", "b"], [1, 2], values, index_per_key={"b": 0, "a": 1})
    empty, b = KeyedTensor.regroup([kt], [[], ["b"]])
    assert empty.shape == (2, 0)
    torch.testing.assert_close(b, values[:, 1:])


def test_membership_and_positional_reads_of_kjt_and_kt_say_what_they_take():
    """`"f1" in kjt` (and `"t1" in kt`) raised KeyError "no key 0 in this KeyedJaggedTensor": Python fell back to
    kjt[0], kjt[1], ... as it does for `for x in kjt`, and the message read as a missing feature. Membership now
    answers by key; a position is a TypeError naming .keys() / .to_dict()."""
    kjt = KeyedJaggedTensor.from_lengths_sync(["f1", "f2"], torch.tensor([1, 2, 3]), torch.tensor([1, 0, 1, 1]))
    kt = KeyedTensor.from_tensor_list(["t1"], [torch.ones(2, 3)])
    assert "f1" in kjt and "f3" not in kjt and 0 not in kjt
    assert "t1" in kt and "t2" not in kt
    for obj, name in ((kjt, "KeyedJaggedTensor"), (kt, "KeyedTensor")):
        with pytest.raises(TypeError, match=rf"{name} is indexed by key name .* got 0: iterate over .keys\(\)"):
            list(obj)
        with pytest.raises(KeyError, match="no key 'zz'"):
            obj["zz"]
    assert torch.equal(kjt["f2"].values(), torch.tensor([2, 3])) and kt["t1"].shape == (2, 3)


def test_regroup_refuses_a_key_that_two_keyed_tensors_hold():
    """Two collections reading a feature of one name (a user and an item tower's 'country'): regroup /
    regroup_as_dict took the last KeyedTensor's block without a word, one tower's embedding in the other's group.
    Now a ValueError names the key and the positions; a shared key no group asks for, and one KeyedTensor passed
    twice, still regroup."""
    users = KeyedTensor.from_tensor_list(["uid", "country"], [torch.ones(2, 1), torch.full((2, 2), 2.0)])
    items = KeyedTensor.from_tensor_list(["country", "iid"], [torch.full((2, 2), 3.0), torch.full((2, 1), 4.0)])
    with pytest.raises(ValueError, match=r"keys \{'country': \[0, 1\]\} are in several .* distinct names"):
        KeyedTensor.regroup_as_dict([users, items], [["uid", "country"], ["iid"]], ["user", "item"])
    got = KeyedTensor.regroup([users, items], [["uid"], ["iid"]])
    assert torch.equal(got[0], torch.ones(2, 1)) and torch.equal(got[1], torch.full((2, 1), 4.0))
    assert KeyedTensor.regroup([users, users], [["country"]])[0].shape == (2, 2)


def test_jagged_tensor_to_a_dtype_of_embedding_values_names_the_values_not_ids():
    """jt.to(torch.float16) on an EmbeddingCollection's output (float embeddings) said the JaggedTensor 'holds integer
    ids and lengths', which it does not; the refusal now names the embedding values and how to convert them."""
    rows = JaggedTensor(values=torch.ones(3, 4), lengths=torch.tensor([2, 1]))
    with pytest.raises(ValueError, match=r"moves devices only .*\(values=jt.values\(\).to\(torch.float16\)"):
        rows.to(torch.float16)
    with pytest.raises(ValueError, match="holds integer ids"):
        JaggedTensor(values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1])).to(torch.float16)


def test_permute_takes_torchrecs_indices_tensor_of_any_int_type_and_refuses_one_that_disagrees():
    """kjt.permute(indices, torch.tensor(indices)) (an int64 tensor) failed in fbgemm with "expected scalar type Int
    but found Long"; and an indices_tensor that disagreed with indices relabelled the features silently (keys
    ['b', 'a'] over a's and b's ids). Now any integer tensor works, and a disagreeing one is refused."""
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 0, 1, 1]))
    swapped = kjt.permute([1, 0], torch.tensor([1, 0]))
    assert swapped.keys() == ["b", "a"] and torch.equal(swapped.values(), torch.tensor([2, 3, 1]))
    with pytest.raises(ValueError, match=r"indices_tensor \[0, 1\] is not indices \[1, 0\]"):
        kjt.permute([1, 0], torch.tensor([0, 1], dtype=torch.int32))


def test_permute_of_bfloat16_weights():
    """Per-id weights in bfloat16 (computed under precision='bf16-mixed' autocast) failed every collection's forward
    in fbgemm's permute: '"permute_2D_indices_weights_kernel_3" not implemented for BFloat16'. They now permute (a
    reorder, a subset, a repeat) as float32 weights do, keeping their dtype."""
    weights = torch.tensor([0.5, 1.0, 2.0])
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 0, 1, 1]),
                                              weights=weights.to(torch.bfloat16))
    fp32 = KeyedJaggedTensor.from_lengths_sync(["a", "b"], kjt.values(), kjt.lengths(), weights=weights)
    for order in ([1, 0], [1], [1, 1]):
        got, want = kjt.permute(order), fp32.permute(order)
        assert got.weights().dtype == torch.bfloat16 and torch.equal(got.weights().float(), want.weights())
        assert torch.equal(got.values(), want.values()) and torch.equal(got.lengths(), want.lengths())


def test_inverse_indices_expand_a_deduplicated_batch_as_torchrecs_collections_do():
    """kjt.inverse_indices() was missing and KeyedJaggedTensor(..., inverse_indices=(keys, tensor)) refused. Now it
    is held (inverse_indices(), inverse_indices_or_none(); kept by to / permute / split) and an EmbeddingBagCollection
    expands each feature's deduplicated bags to the full batch by it, as TorchRec's: the same output as the full
    batch. EmbeddingCollection refuses it by name (TorchRec's takes every sample's bags)."""
    from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

    t0 = EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=3, feature_names=["a"])
    t1 = EmbeddingBagConfig(name="t1", num_embeddings=10, embedding_dim=2, feature_names=["b"], pooling="mean")
    ebc = EmbeddingBagCollection([t0, t1])
    inverse = (["b", "a"], torch.tensor([[0, 1, 0, 1], [1, 1, 0, 0]]))  # 2 distinct bags per key, 4 samples
    dedup = KeyedJaggedTensor.from_lengths_sync(["b", "a"], torch.tensor([1, 2, 3, 4, 5]),
                                                torch.tensor([1, 2, 1, 1]), inverse_indices=inverse)
    full = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([5, 5, 4, 4, 1, 2, 3, 1, 2, 3]),
                                               torch.tensor([1, 1, 1, 1, 1, 2, 1, 2]))
    assert dedup.inverse_indices() is inverse[1] or torch.equal(dedup.inverse_indices()[1], inverse[1])
    for kjt in (dedup, dedup.to("cpu"), dedup.permute([1, 0]), *dedup.split([1, 1])):
        assert torch.equal(kjt.inverse_indices()[1], inverse[1])
    expected = ebc(full).values()
    assert expected.shape == (4, 5)
    torch.testing.assert_close(ebc(dedup).values(), expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="has no inverse indices"):
        full.inverse_indices()
    assert full.inverse_indices_or_none() is None
    ec = EmbeddingCollection([EmbeddingConfig(name="t", num_embeddings=10, embedding_dim=2, feature_names=["a", "b"])])
    with pytest.raises(ValueError, match="inverse_indices .* expand pooled outputs only"):
        ec(dedup)


def test_a_collection_validates_each_batch_it_is_given():
    """The KJT constructor only assigns; the collection's first look at a batch runs the KJT's checks (its shapes;
    its values through the id check, which reads them anyway; on a device batch, the host copy it was moved from),
    so a malformed batch still fails before any lookup, with the KJT's own message naming the fix."""
    from lightning_rec import EmbeddingBagCollection, EmbeddingBagConfig

    table = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["a"])
    for validate_ids in (True, False):
        ebc = EmbeddingBagCollection([table], validate_ids=validate_ids)
        for lengths, words in (([1, 2], "lengths add up to 3 but there are 4 values"), ([5, -1], "must be >= 0")):
            bad = KeyedJaggedTensor(["a"], torch.tensor([1, 2, 3, 4]), lengths=torch.tensor(lengths))
            with pytest.raises(ValueError, match=words):
                ebc(bad)
    good = KeyedJaggedTensor(["a"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2]))
    ebc(good)
    assert good.validate()._unchecked is None  # checked in full once: later validate() calls return at once
