"""The jagged types accept and give what TorchRec's do (issue: a TorchRec user's code runs unchanged).

A KJT is a general jagged container (float scores, dense sequences); integer ids are the contract of the collections
that read them. TorchRec's own unit tests run in tests/torchrec_upstream/; these pin each behaviour in a few lines."""

import pytest
import torch
from torch import nn

from lightning_rec import EmbeddingBagCollection
from lightning_rec.embedding_configs import EmbeddingBagConfig
from lightning_rec.fx import symbolic_trace
from lightning_rec.sparse import (
    ComputeJTDictToKJT,
    ComputeKJTToJTDict,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    jt_is_equal,
    kjt_is_equal,
    regroup_kts,
    validate_keyed_jagged_tensor,
)


def ebc():
    return EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
                                                      feature_names=["a"])])


def test_float_values_are_a_kjt_but_not_a_collections_ids():
    scores = KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([0.5, 1.5, 2.5]), torch.tensor([2, 1]))
    validate_keyed_jagged_tensor(scores)
    assert scores["a"].to_dense()[0].tolist() == [0.5, 1.5]
    with pytest.raises(ValueError, match=r"ids must be integers \(int64 or int32\), got values of torch.float32"):
        ebc()(scores)
    with pytest.raises(ValueError, match="values must be 1-d ids, got shape \\(3, 2\\)"):
        ebc()(KeyedJaggedTensor(["a"], torch.zeros(3, 2, dtype=torch.long), lengths=torch.tensor([2, 1])))


def test_two_d_values_with_weights_per_row_or_per_entry():
    values = torch.arange(12.0).view(4, 3)
    for weights in (torch.ones(4), torch.ones(4, 3)):
        kjt = KeyedJaggedTensor.from_offsets_sync(["a", "b"], values, torch.tensor([0, 1, 1, 3, 4]), weights=weights)
        kjt.validate()
        assert kjt["b"].values().shape == (3, 3) and kjt["b"].weights().shape[0] == 3
    with pytest.raises(ValueError, match="weights size must equal to values size, but got 5 and 12"):
        KeyedJaggedTensor(["a"], values, torch.ones(5), lengths=torch.tensor([4])).validate()


def test_values_past_the_lengths_belong_to_no_bag():
    jt = JaggedTensor(values=torch.arange(4) + 1, lengths=torch.tensor([1, 0, 2]))
    assert jt.to_padded_dense().tolist() == [[1, 0], [0, 0], [2, 3]]


def test_no_bag_lengths_and_no_lengths_at_all():
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([]), lengths=torch.tensor([[], []]), length_per_key=[0, 0])
    assert kjt["a"].lengths().numel() == 0 and kjt["a"].offsets().numel() == 0
    KeyedJaggedTensor(["a"], torch.tensor([]), lengths=torch.tensor([])).validate()  # empty float lengths
    neither = KeyedJaggedTensor(["a"], torch.tensor([1, 2]))  # assigned, as TorchRec's; refused when validated
    with pytest.raises(ValueError, match="lengths and offsets cannot be both empty"):
        neither.validate()
    with pytest.raises(AssertionError, match="lengths must be of integer type"):  # TorchRec's constructor assert
        JaggedTensor(values=torch.ones(2), lengths=torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="offsets must be of integer type"):  # and a ValueError, as ours
        KeyedJaggedTensor(["a"], torch.ones(2), offsets=torch.tensor([0.0, 2.0]))


def test_empty_and_printed_forms_are_torchrecs():
    empty = JaggedTensor.empty()
    assert empty.offsets().dtype == torch.int32 and empty.offsets().numel() == 0
    jt = JaggedTensor(values=torch.tensor([1.0, 2.0, 3.0]), lengths=torch.tensor([1, 0, 2]))
    assert str(jt) == "JaggedTensor({\n    [[1.0], [], [2.0, 3.0]]\n})\n"
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 0, 0, 2]))
    assert str(kjt) == 'KeyedJaggedTensor({\n    "a": [[1], []],\n    "b": [[], [2, 3]]\n})\n'
    kt = KeyedTensor.from_tensor_list(["key"], [torch.tensor([[1.0]])])
    assert str(kt) == 'KeyedTensor({\n    "key": [[1.0]]\n})\n' and repr(kt) == str(kt).rstrip("\n")
    assert str(KeyedTensor([], [], torch.Tensor())) == "KeyedTensor()\n"


def test_equality_helpers_and_dict_modules():
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 0, 0, 2]))
    same = KeyedJaggedTensor.from_offsets_sync(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1, 1, 3]))
    assert kjt_is_equal(kjt, same) and not kjt_is_equal(kjt, kjt.permute([1, 0])) and not kjt_is_equal(kjt, "x")
    jts = ComputeKJTToJTDict()(kjt)
    assert jt_is_equal(jts["b"], JaggedTensor(torch.tensor([2, 3]), offsets=torch.tensor([0, 0, 2])))
    assert kjt_is_equal(ComputeJTDictToKJT()(jts), kjt)


def test_regroup_kts_and_the_fx_flatten_spec_order():
    from torch.fx._pytree import tree_flatten_spec
    from torch.utils import _pytree as pytree

    kt1 = KeyedTensor.from_tensor_list(["x", "y"], [torch.ones(2, 1), 2 * torch.ones(2, 2)])
    kt2 = KeyedTensor.from_tensor_list(["z"], [3 * torch.ones(2, 1)])
    out = regroup_kts([kt1, kt2], [["z", "x"], ["y", "x"]])
    assert out[0][0].tolist() == [3, 1] and out[1][0].tolist() == [2, 2, 1]
    grad = torch.ones(2, 3, requires_grad=True)  # a key in two groups gets both gradients; a skipped key none
    (regroup_kts([KeyedTensor(["x", "y"], [1, 2], grad)], [["x"], ["x"]])[0] * 3).sum().backward()
    assert grad.grad[0].tolist() == [3, 0, 0]
    meta = KeyedTensor(["x", "y"], [1, 2], torch.empty(2, 3, device="meta"))
    assert regroup_kts([meta], [["y", "x"]])[0].shape == (2, 3)
    _, spec = pytree.tree_flatten(kt1)
    swapped = KeyedTensor.from_tensor_list(["y", "x"], [2 * torch.ones(2, 2), torch.ones(2, 1)])
    assert tree_flatten_spec(swapped, spec)[0][0].tolist() == [1, 2, 2]  # put back in the spec's key order


def test_symbolic_trace_keeps_collections_and_jagged_types_as_leaves():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = ebc()

        def forward(self, values, lengths):
            kjt = KeyedJaggedTensor(["a"], values, lengths=lengths)
            return self.ebc(kjt).values()

    model = Model()
    gm = symbolic_trace(model)
    assert "KeyedJaggedTensor" in gm.code and "self.ebc" in gm.code
    values, lengths = torch.tensor([1, 2, 3]), torch.tensor([2, 1])
    assert torch.equal(gm(values, lengths), model(values, lengths))
    traced = torch.fx.symbolic_trace(JaggedTensor.from_dense_lengths)
    jt = traced(torch.tensor([[1, 2], [3, 4]]), torch.tensor([1, 2]))
    assert jt.values().tolist() == [1, 3, 4]
    regroup = torch.fx.symbolic_trace(lambda kts: KeyedTensor.regroup(kts, [["x"]]))
    kt = KeyedTensor.from_tensor_list(["x"], [torch.ones(2, 1)])
    assert torch.equal(regroup([kt])[0], torch.ones(2, 1))


def test_torchs_own_symbolic_trace_records_each_collection_as_one_call():
    """torch.fx.symbolic_trace (torch's, not lightning_rec.fx's) traced into a collection and stopped at its batch
    check ('takes a KeyedJaggedTensor of ids, got a Proxy'). A collection's forward is now one wrapped call, so the
    traced module runs the collections eagerly and gives the eager model's outputs."""
    from lightning_rec import EmbeddingCollection
    from lightning_rec.embedding_configs import EmbeddingConfig

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = ebc()
            self.ec = EmbeddingCollection([EmbeddingConfig(name="s", embedding_dim=3, num_embeddings=10,
                                                           feature_names=["a"])])

        def forward(self, features: KeyedJaggedTensor, values, lengths):
            own = KeyedJaggedTensor(["a"], values, lengths=lengths)
            return self.ebc(features).values() + self.ebc(own).values(), self.ec(features)["a"].values()

    model = Model()
    gm = torch.fx.symbolic_trace(model)
    assert gm.code.count("collection_call(") == 3
    kjt = KeyedJaggedTensor(["a"], torch.tensor([1, 2, 9]), lengths=torch.tensor([2, 1]))
    args = (kjt, torch.tensor([3, 4, 5]), torch.tensor([1, 2]))
    for got, want in zip(gm(*args), model(*args)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("make", [lambda: KeyedJaggedTensor, lambda: JaggedTensor.empty(), ebc,
                                  lambda: ComputeKJTToJTDict()])
def test_torchscript_is_refused_in_one_line(make):
    with pytest.raises(RuntimeError, match="does not support TorchScript .deprecated by PyTorch.: use torch.export"):
        torch.jit.script(make())
