"""TorchRec snippets ported by changing only their imports (torchrec.* -> lightning_rec), each against plain PyTorch.

The snippets follow TorchRec's "Introduction to TorchRec" and sharding tutorials and its DLRM example
(examples/golden_training/train_dlrm.py): configs and collections, KJT constructors, KeyedTensor
regrouping, apply_optimizer_in_backward, DLRM + DLRMTrain, the planner's collective_plan(module,
sharders, pg), DistributedModelParallel, KeyedOptimizerWrapper + CombinedOptimizer and
TrainPipelineSparseDist. What differs from TorchRec on purpose is in the README ("Coming from TorchRec").
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn

import lightning_rec as torchrec  # the port: `import torchrec` becomes this line
from lightning_rec import (
    DLRM,
    CombinedOptimizer,
    DistributedModelParallel,
    DLRMTrain,
    EmbeddingShardingPlanner,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedOptimizerWrapper,
    KeyedTensor,
    ParameterConstraints,
    ShardingType,
    Topology,
    TrainPipelineSparseDist,
    apply_optimizer_in_backward,
    in_backward_optimizer_filter,
)
from lightning_rec.data import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES, Batch

ATOL = 1e-6  # fp32 sums of a few rows: the kernels and torch add them in other orders


def _bag(weight: torch.Tensor, mode: str = "sum") -> nn.EmbeddingBag:
    return nn.EmbeddingBag.from_pretrained(weight.detach().clone(), freeze=False, mode=mode)


def test_intro_tutorial_lookup_and_keyed_tensors():
    ebc = torchrec.EmbeddingBagCollection(
        device="cpu",
        tables=[
            torchrec.EmbeddingBagConfig(name="product_table", embedding_dim=8, num_embeddings=64,
                                        feature_names=["product"], pooling=torchrec.PoolingType.SUM),
            torchrec.EmbeddingBagConfig(name="user_table", embedding_dim=4, num_embeddings=64,
                                        feature_names=["user"], pooling=torchrec.PoolingType.MEAN),
        ],
    )
    product_jt = JaggedTensor(values=torch.tensor([1, 2, 1, 5]), lengths=torch.tensor([3, 1]))
    user_jt = JaggedTensor(values=torch.tensor([2, 3, 4, 1]), lengths=torch.tensor([2, 2]))
    kjt = KeyedJaggedTensor.from_jt_dict({"product": product_jt, "user": user_jt})
    result = ebc(kjt)
    pooled = result.to_dict()
    product = _bag(ebc.embedding_bags["product_table"].weight)
    user = _bag(ebc.embedding_bags["user_table"].weight, mode="mean")
    torch.testing.assert_close(pooled["product"], product(product_jt.values(), product_jt.offsets()[:-1]),
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(pooled["user"], user(user_jt.values(), user_jt.offsets()[:-1]), atol=ATOL, rtol=0)
    # KeyedTensor.regroup: columns of several KeyedTensors by groups of keys (DLRM's interaction input)
    extra = KeyedTensor.from_tensor_list(["dense"], [torch.ones(2, 3)])
    both, users = KeyedTensor.regroup([result, extra], [["product", "dense"], ["user"]])
    torch.testing.assert_close(both, torch.cat([pooled["product"], torch.ones(2, 3)], dim=1))
    torch.testing.assert_close(users, pooled["user"])


def test_kjt_constructors_describe_the_same_batch():
    keys, values = ["f1", "f2"], torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    lengths = torch.tensor([2, 0, 1, 1, 1, 3])
    by_lengths = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
    by_offsets = KeyedJaggedTensor.from_offsets_sync(keys=keys, values=values,
                                                     offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8]))
    by_dict = KeyedJaggedTensor.from_jt_dict({
        "f1": JaggedTensor.from_dense([torch.tensor([0, 1]), torch.tensor([], dtype=torch.long), torch.tensor([2])]),
        "f2": JaggedTensor(values=torch.tensor([3, 4, 5, 6, 7]), lengths=torch.tensor([1, 1, 3])),
    })
    for kjt in (by_offsets, by_dict, KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)):
        assert kjt.keys() == keys and kjt.stride() == 3
        assert torch.equal(kjt.values(), values) and torch.equal(kjt.lengths(), lengths)
        assert kjt.length_per_key() == [3, 5] and kjt.offset_per_key() == [0, 3, 8]
    assert by_lengths["f2"].to_dense()[2].tolist() == [5, 6, 7]
    assert by_lengths.permute([1, 0]).keys() == ["f2", "f1"]
    f1, f2 = by_lengths.split([1, 1])
    assert f2.values().tolist() == [3, 4, 5, 6, 7] and f1.lengths().tolist() == [2, 0, 1]


def test_embedding_collection_gives_one_row_per_id():
    ec = torchrec.EmbeddingCollection(
        device="cpu",
        tables=[torchrec.EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
                torchrec.EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=10, feature_names=["f2"])])
    kjt = KeyedJaggedTensor(keys=["f1", "f2"], values=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]),
                            lengths=torch.tensor([2, 0, 1, 1, 1, 3]))
    out = ec(kjt)
    for name, table in (("f1", "t1"), ("f2", "t2")):
        assert torch.equal(out[name].values(), ec.embeddings[table].weight[kjt[name].values()])
        assert torch.equal(out[name].lengths(), kjt[name].lengths())


# DLRM: one rank without sharding, then the same model sharded over 2 ranks ---------------------------

CATS = DEFAULT_CAT_NAMES[:4]
LR = 0.1


def _batch(seed: int, batch_size: int = 4) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(CATS) * batch_size,), generator=g)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=g)
    return Batch(dense_features=torch.randn(batch_size, len(DEFAULT_INT_NAMES), generator=g),
                 sparse_features=KeyedJaggedTensor.from_lengths_sync(keys=CATS, values=values, lengths=lengths),
                 labels=torch.randint(0, 2, (batch_size,), generator=g).float())


def _dlrm_train(mean_pooled: tuple[str, ...] = ()) -> DLRMTrain:
    torch.manual_seed(0)
    tables = [torchrec.EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=40, feature_names=[f],
                                          pooling=torchrec.PoolingType.MEAN if f in mean_pooled else "sum")
              for f in CATS]
    return DLRMTrain(DLRM(
        embedding_bag_collection=torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("cpu")),
        dense_in_features=len(DEFAULT_INT_NAMES), dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1],
        dense_device=torch.device("cpu")))


def _reference_step(reference: DLRMTrain, world_size: int, step: int) -> None:
    """Plain PyTorch SGD over every rank's batch of `step`: the tables take the sum of the ranks' gradients (the
    fused update after the all-to-all), the dense layers their mean (DDP)."""
    with torch.no_grad():
        grads = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for rank in range(world_size):
        reference.zero_grad()
        reference(_batch(1000 * rank + step))[0].backward()
        for n, p in reference.named_parameters():
            grads[n] += p.grad if "embedding_bags" in n else p.grad / world_size
    with torch.no_grad():
        for n, p in reference.named_parameters():
            p -= LR * grads[n]


def test_dlrm_with_apply_optimizer_in_backward_on_one_process():
    model, reference = _dlrm_train(), _dlrm_train()
    apply_optimizer_in_backward(torch.optim.SGD, model.model.sparse_arch.parameters(), {"lr": LR})
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    optimizer = CombinedOptimizer([("fused", torchrec.FusedOptimizer(model)), ("dense", dense)])
    for step in range(3):
        optimizer.zero_grad()
        loss, (_, logits, labels) = model(_batch(step))
        loss.backward()
        optimizer.step()
    for step in range(3):
        _reference_step(reference, 1, step)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, atol=ATOL, rtol=0)


def _local_error(state: dict, reference: dict) -> float:
    """Largest difference between this rank's pieces of the state dict and the whole reference tensors."""
    err = 0.0
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            err = max(err, float((value - reference[key]).abs().max()))
            continue
        for meta, piece in value.local_shards:  # a ShardedTensor: this rank's rectangles of the table
            (r, c), (nr, nc) = meta.shard_offsets, meta.shard_sizes
            err = max(err, float((piece - reference[key][r : r + nr, c : c + nc]).abs().max()))
    return err


def _sharding_tutorial_worker(rank: int, world_size: int) -> float:
    """The sharding tutorial: per-table constraints, planner.collective_plan(module, sharders, pg), DMP(plan=)."""
    # a mean-pooled table among sum-pooled ones sits in a kernel of its own: outputs stay in the configs' order
    model, reference = _dlrm_train(mean_pooled=(CATS[1],)), _dlrm_train(mean_pooled=(CATS[1],))
    apply_optimizer_in_backward(torch.optim.SGD, model.model.sparse_arch.parameters(), {"lr": LR})
    types = [ShardingType.ROW_WISE, ShardingType.COLUMN_WISE, ShardingType.TABLE_WISE, ShardingType.DATA_PARALLEL]
    constraints = {f"t_{f}": ParameterConstraints(sharding_types=[st.value], min_partition=4)
                   for f, st in zip(CATS, types)}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device="cpu"),
                                       constraints=constraints, print_stats=False)
    plan = planner.collective_plan(model, [], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan)
    planned = plan.get_plan_for_module("model.sparse_arch.embedding_bag_collection")
    assert [planned[f"t_{f}"].sharding_type for f in CATS] == types
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    features = _batch(1000 * rank).sparse_features
    pooled = dmp.module.model.sparse_arch.embedding_bag_collection(features)
    expected = reference.model.sparse_arch.embedding_bag_collection(features)
    assert pooled.keys() == expected.keys() == CATS
    torch.testing.assert_close(pooled.values(), expected.values(), atol=ATOL, rtol=0)
    for step in range(2):
        optimizer.zero_grad()
        dmp(_batch(1000 * rank + step))[0].backward()
        optimizer.step()
        _reference_step(reference, world_size, step)
    return _local_error(dmp.state_dict(), reference.state_dict())


def _torchrec_dlrm_state(tables: dict[str, torch.Tensor], dense: list[int], over: list[int], dense_in: int,
                         dcn: tuple[int, int] | None, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A state dict with TorchRec's DLRM / DLRM_DCN names and shapes (torchrec/models/dlrm.py, modules/mlp.py,
    modules/crossnet.py), random values."""
    state = {f"sparse_arch.embedding_bag_collection.embedding_bags.{t}.weight": w for t, w in tables.items()}
    sizes = [dense_in, *dense]
    for i in range(len(dense)):
        state[f"dense_arch.model._mlp.{i}._linear.weight"] = torch.randn(sizes[i + 1], sizes[i], generator=g) * 0.3
        state[f"dense_arch.model._mlp.{i}._linear.bias"] = torch.randn(sizes[i + 1], generator=g) * 0.1
    F, D = len(tables), dense[-1]
    if dcn is None:
        over_in = D + (F + 1) * F // 2
    else:
        over_in = (F + 1) * D
        for layer in range(dcn[0]):
            state[f"inter_arch.crossnet.W_kernels.{layer}"] = torch.randn(over_in, dcn[1], generator=g) * 0.2
            state[f"inter_arch.crossnet.V_kernels.{layer}"] = torch.randn(dcn[1], over_in, generator=g) * 0.2
            state[f"inter_arch.crossnet.bias.{layer}"] = torch.randn(over_in, 1, generator=g) * 0.1
    sizes = [over_in, *over]
    for i in range(len(over) - 1):
        state[f"over_arch.model.0._mlp.{i}._linear.weight"] = torch.randn(sizes[i + 1], sizes[i], generator=g) * 0.3
        state[f"over_arch.model.0._mlp.{i}._linear.bias"] = torch.randn(sizes[i + 1], generator=g) * 0.1
    state["over_arch.model.1.weight"] = torch.randn(over[-1], over[-2], generator=g) * 0.3
    state["over_arch.model.1.bias"] = torch.randn(over[-1], generator=g) * 0.1
    return state


def _torchrec_dlrm_forward(state: dict[str, torch.Tensor], dense_x: torch.Tensor, pooled_BFD: torch.Tensor,
                           dcn_layers: int | None) -> torch.Tensor:
    """TorchRec's DLRM forward in a few lines, read from its state dict: DenseArch (ReLU after every layer),
    InteractionArch (dense + upper-triangle dots) or InteractionDCNArch (LowRankCrossNet over [dense, sparse]),
    OverArch (ReLU layers, then the logit layer)."""
    def mlp(x, name, n):
        for i in range(n):
            x = torch.relu(x @ state[f"{name}._mlp.{i}._linear.weight"].t() + state[f"{name}._mlp.{i}._linear.bias"])
        return x

    dense_BD = mlp(dense_x, "dense_arch.model", sum(k.startswith("dense_arch.") and k.endswith("weight")
                                                    for k in state))
    vectors_BND = torch.cat([dense_BD.unsqueeze(1), pooled_BFD], dim=1)
    if dcn_layers is None:
        rows, cols = torch.triu_indices(vectors_BND.shape[1], vectors_BND.shape[1], offset=1)
        inter = torch.cat([dense_BD, torch.bmm(vectors_BND, vectors_BND.transpose(1, 2))[:, rows, cols]], dim=1)
    else:
        x0 = vectors_BND.reshape(len(dense_x), -1).unsqueeze(2)
        x = x0
        for layer in range(dcn_layers):
            w = state[f"inter_arch.crossnet.W_kernels.{layer}"] @ (state[f"inter_arch.crossnet.V_kernels.{layer}"] @ x)
            x = x0 * (w + state[f"inter_arch.crossnet.bias.{layer}"]) + x
        inter = x.squeeze(2)
    hidden = sum(k.startswith("over_arch.model.0.") and k.endswith("weight") for k in state)
    logit_layer = state["over_arch.model.1.weight"], state["over_arch.model.1.bias"]
    return mlp(inter, "over_arch.model.0", hidden) @ logit_layer[0].t() + logit_layer[1]


def test_a_torchrec_dlrm_state_dict_loads_by_its_own_names_and_predicts_the_same():
    from lightning_rec.models import DLRM_DCN

    g = torch.Generator().manual_seed(0)
    names = ["f1", "f2", "f3"]
    tables = {f"t_{f}": torch.randn(20, 8, generator=g) for f in names}
    dense_x = torch.randn(5, 4, generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=names, values=torch.randint(0, 20, (15,), generator=g),
                                              lengths=torch.ones(15, dtype=torch.int64))
    pooled_BFD = torch.stack([tables[f"t_{f}"][kjt[f].values()] for f in names], dim=1)
    for dcn in (None, (2, 3)):
        ebc = torchrec.EmbeddingBagCollection([torchrec.EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8,
                                                                           num_embeddings=20, feature_names=[f])
                                               for f in names])
        args = dict(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8],
                    over_arch_layer_sizes=[12, 6, 1])
        model = DLRM(**args) if dcn is None else DLRM_DCN(**args, dcn_num_layers=dcn[0], dcn_low_rank_dim=dcn[1])
        state = _torchrec_dlrm_state(tables, [16, 8], [12, 6, 1], 4, dcn, g)
        model.load_state_dict(state)  # strict: every TorchRec name found its place, and no parameter was left
        want = _torchrec_dlrm_forward(state, dense_x, pooled_BFD, None if dcn is None else dcn[0])
        with torch.no_grad():
            torch.testing.assert_close(model(dense_x, kjt), want, rtol=1e-5, atol=1e-5)
        # inside DLRMTrain (TorchRec's `model.` prefix) too, and our own names still load
        train = DLRMTrain(model)
        train.load_state_dict({f"model.{k}": v for k, v in state.items()})
        model.load_state_dict(model.state_dict())


def test_torchrecs_dlrm_projection_ports_with_its_state_dict():
    """`from torchrec.models.dlrm import DLRM_Projection` had no counterpart. Its state dict (each interaction branch
    twice: top-level and inside inter_arch, as TorchRec registers it) loads, and the forward is TorchRec's:
    branch outputs read as [B, F1, D] and [B, D, F2], their products next to the dense vector."""
    from lightning_rec import DLRM_Projection

    g = torch.Generator().manual_seed(0)
    names, D = ["f1", "f2", "f3"], 4
    tables = {f"t_{f}": torch.randn(20, D, generator=g) for f in names}
    dense_x = torch.randn(5, 6, generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=names, values=torch.randint(0, 20, (15,), generator=g),
                                              lengths=torch.ones(15, dtype=torch.int64))
    pooled_BFD = torch.stack([tables[f"t_{f}"][kjt[f].values()] for f in names], dim=1)
    ebc = torchrec.EmbeddingBagCollection([torchrec.EmbeddingBagConfig(name=f"t_{f}", embedding_dim=D,
                                                                       num_embeddings=20, feature_names=[f])
                                           for f in names])
    model = DLRM_Projection(embedding_bag_collection=ebc, dense_in_features=6, dense_arch_layer_sizes=[8, D],
                            over_arch_layer_sizes=[5, 1], interaction_branch1_layer_sizes=[10, 2 * D],
                            interaction_branch2_layer_sizes=[3 * D], dense_device=None)
    state = _torchrec_dlrm_state(tables, [8, D], [5, 1], 6, None, g)  # dense and over arch; the over arch's input:
    K = (len(names) + 1) * D
    state["over_arch.model.0._mlp.0._linear.weight"] = torch.randn(5, D + 2 * 3, generator=g) * 0.3  # D + F1 F2
    branches = {"interaction_branch1": [K, 10, 2 * D], "interaction_branch2": [K, 3 * D]}
    for branch, sizes in branches.items():
        for i in range(len(sizes) - 1):
            w = torch.randn(sizes[i + 1], sizes[i], generator=g) * 0.3
            b = torch.randn(sizes[i + 1], generator=g) * 0.1
            for at in (branch, f"inter_arch.{branch}"):
                state[f"{at}.model._mlp.{i}._linear.weight"], state[f"{at}.model._mlp.{i}._linear.bias"] = w, b
    model.load_state_dict(state)  # strict

    def mlp(x, name, n):
        for i in range(n):
            x = torch.relu(x @ state[f"{name}._mlp.{i}._linear.weight"].t() + state[f"{name}._mlp.{i}._linear.bias"])
        return x

    B = len(dense_x)
    dense_BD = mlp(dense_x, "dense_arch.model", 2)
    x = torch.cat([dense_BD.unsqueeze(1), pooled_BFD], dim=1).reshape(B, -1)
    y = mlp(x, "interaction_branch1.model", 2).reshape(B, -1, D)
    z = mlp(x, "interaction_branch2.model", 1).reshape(B, D, -1)
    inter = torch.cat([dense_BD, torch.bmm(y, z).reshape(B, -1)], dim=1)
    want = mlp(inter, "over_arch.model.0", 1) @ state["over_arch.model.1.weight"].t() + state["over_arch.model.1.bias"]
    with torch.no_grad():
        torch.testing.assert_close(model(dense_x, kjt), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"interaction_branch2_layer_sizes=\[6\] must end in a multiple of the "
                                         r"embedding_dim 4"):
        DLRM_Projection(ebc, 6, [8, D], [5, 1], [2 * D], [6])


def test_sharding_tutorial_on_two_ranks_trains_as_plain_pytorch():
    for error in run_ranks(_sharding_tutorial_worker, 2, timeout=120):
        assert error < 1e-6


def _golden_training_worker(rank: int, world_size: int) -> tuple[list[float], list[float], float]:
    """examples/golden_training/train_dlrm.py: DLRMTrain + apply_optimizer_in_backward + DMP (the planner's plan)
    + KeyedOptimizerWrapper + TrainPipelineSparseDist; then the state dict loads back into an unsharded model."""
    model, reference = _dlrm_train(), _dlrm_train()
    apply_optimizer_in_backward(torch.optim.SGD, model.model.sparse_arch.parameters(), {"lr": LR})
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"))
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    optimizer = CombinedOptimizer([("fused", dmp.fused_optimizer), ("dense", dense)])
    losses = []
    with TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu")) as pipeline:
        batches = iter([_batch(1000 * rank + step) for step in range(3)])
        while True:
            try:
                loss, _, _ = pipeline.progress(batches)
            except StopIteration:
                break
            losses.append(float(loss))
    reference_losses = []
    for step in range(3):  # the loss each step saw: the reference before that step's update
        reference_losses.append(float(reference(_batch(1000 * rank + step))[0]))
        _reference_step(reference, world_size, step)
    return losses, reference_losses, _local_error(dmp.state_dict(), reference.state_dict())


def test_dlrm_golden_training_on_two_ranks_trains_as_plain_pytorch():
    for losses, reference_losses, error in run_ranks(_golden_training_worker, 2, timeout=120):
        assert len(losses) == 3
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), atol=1e-6, rtol=0)
        assert error < 1e-6


def test_parameter_sharding_takes_torchrecs_sharding_spec_and_names_shards_when_read():
    """ParameterSharding(..., sharding_spec=EnumerableShardingSpec([...])), TorchRec's form of a hand-written entry,
    was TypeError 'unexpected keyword argument'; reading ps.sharding_spec was a bare AttributeError."""
    from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

    from lightning_rec.types import ParameterSharding, ShardMetadata

    spec = EnumerableShardingSpec([TorchShardMetadata([0, 0], [5, 4], "rank:0/cuda:0"),
                                   TorchShardMetadata([5, 0], [5, 4], "rank:1/cuda:1")])
    ps = ParameterSharding("row_wise", "fused", [0, 1], sharding_spec=spec)
    assert ps.shards == [ShardMetadata((0, 0), (5, 4), 0), ShardMetadata((5, 0), (5, 4), 1)]
    with pytest.raises(AttributeError, match=r"shards are in \.shards"):
        ps.sharding_spec  # noqa: B018
    with pytest.raises(ValueError, match="both shards and sharding_spec"):
        ParameterSharding("row_wise", shards=ps.shards, sharding_spec=spec)


def test_parameter_sharding_takes_torchrecs_other_fields_at_their_defaults():
    """TorchRec's ParameterSharding(..., cache_params=None, enforce_hbm=None, ...) was TypeError 'unexpected keyword
    argument', and reading ps.cache_params an AttributeError; a value is refused naming what does its job here."""
    from lightning_rec.types import ParameterSharding

    fields = ("cache_params", "enforce_hbm", "stochastic_rounding", "bounds_check_mode", "output_dtype",
              "key_value_params")
    ps = ParameterSharding("table_wise", "fused", [0], None, None, *[None] * len(fields))
    assert ps == ParameterSharding("table_wise", "fused", [0]) and all(getattr(ps, f) is None for f in fields)
    with pytest.raises(ValueError, match=r"ParameterSharding\(enforce_hbm=True\) is TorchRec's.*compute_kernel"):
        ParameterSharding("table_wise", "fused", [0], enforce_hbm=True)
    # the cache's load_factor is honoured (the kernel's cache holds that share of rows); its other settings are not
    ps = ParameterSharding("table_wise", "fused_uvm_caching", [0], cache_params={"load_factor": 0.5})
    assert ps.cache_load_factor == 0.5 and ps.cache_params.load_factor == 0.5
    with pytest.raises(ValueError, match=r"cache_params sets algorithm: only its load_factor is honoured"):
        ParameterSharding("table_wise", "fused_uvm_caching", [0], cache_params={"algorithm": "lfu"})


def test_sharded_tensor_local_shards_is_also_torchrecs_method():
    """Ported `st.local_shards()[0].tensor` failed with "'list' object is not callable" (ours was only a list of
    (ShardMetadata, tensor)); both spellings now read the same pieces, and checkpoints pickle as before."""
    import io
    import pickle

    from lightning_rec.sharding.sharded_tensor import ShardedTensor
    from lightning_rec.types import ShardMetadata

    top, bottom = torch.arange(6.0).reshape(3, 2), torch.arange(6.0, 10.0).reshape(2, 2)
    pieces = [(ShardMetadata((0, 0), (3, 2), 0), top), (ShardMetadata((3, 0), (2, 2), 1), bottom)]
    st = ShardedTensor((5, 2), pieces)
    shards = st.local_shards()  # TorchRec / torch.distributed._shard
    assert [s.tensor for s in shards] == [top, bottom] and shards[0].tensor is top
    assert [s.metadata.shard_offsets for s in shards] == [(0, 0), (3, 0)]
    assert [m.placement for m, _ in st.local_shards] == [0, 1]  # ours: a list of pairs
    assert [m.placement for m, _ in st.local_shards()] == [0, 1]  # a Shard unpacks as the pair (code written to both)
    assert torch.equal(st.full(), torch.arange(10.0).reshape(5, 2))
    assert st.size() == torch.Size([5, 2]) and st.size(0) == 5  # torch's method too (was an AttributeError)
    old = ShardedTensor.__new__(ShardedTensor)  # a checkpoint written before: a plain list in the object
    old.__dict__.update(global_shape=(5, 2), local_shards=list(pieces))
    buf = io.BytesIO()
    torch.save({"new": st, "old": old}, buf)
    assert b"LocalShards" not in buf.getvalue() and b"LocalShards" not in pickle.dumps(st)  # same format as before
    buf.seek(0)
    for value in torch.load(buf, weights_only=True).values():
        assert torch.equal(value.local_shards()[1].tensor, bottom)


def _sharded_tensor_metadata_worker(rank: int, world_size: int):
    import io

    from lightning_rec.sharding.sharded_tensor import ShardedTensor

    model = _dlrm_train()
    apply_optimizer_in_backward(torch.optim.SGD, model.model.sparse_arch.parameters(), {"lr": LR})
    types = [ShardingType.ROW_WISE, ShardingType.COLUMN_WISE, ShardingType.TABLE_WISE, ShardingType.DATA_PARALLEL]
    constraints = {f"t_{f}": ParameterConstraints(sharding_types=[st.value], min_partition=4)
                   for f, st in zip(CATS, types)}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device="cpu"),
                                       constraints=constraints, print_stats=False)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"),
                                   plan=planner.collective_plan(model, [], dist.GroupMember.WORLD))
    out = {}
    for key, st in dmp.state_dict().items():
        if not isinstance(st, ShardedTensor):
            continue
        md = st.metadata()  # torch's / TorchRec's: every rank's shards and the global size
        out[key.split(".")[-2]] = ([(m.shard_offsets, m.shard_sizes, m.placement) for m in md.shards_metadata],
                                   tuple(md.size))
        mine = [m for m in md.shards_metadata if m.placement == rank]
        assert [m for m, _ in st.local_shards] == mine
        if len(mine) == 1:
            assert st.local_tensor() is st.local_shards()[0].tensor
        else:  # torch raises NotImplementedError; ours names the way that reads any number of pieces
            with pytest.raises(ValueError, match=rf"holds {len(mine)} of the .* table: iterate .*local_shards\(\)"):
                st.local_tensor()
        buf = io.BytesIO()
        torch.save(st, buf)  # the layout travels with it, and torch.load's weights_only=True still reads it
        buf.seek(0)
        assert torch.load(buf, weights_only=True).metadata().shards_metadata == md.shards_metadata
    return out


def test_sharded_tensor_metadata_and_local_tensor_are_torchs():
    """`st.metadata().shards_metadata` and `st.local_tensor()` on a table of dmp.state_dict(), as TorchRec code calls
    them on torch's ShardedTensor, raised AttributeError: now every rank sees the whole layout (all ranks' shards,
    their ranks, the global size), and local_tensor() gives a rank's one piece."""
    layouts = run_ranks(_sharded_tensor_metadata_worker, 2, timeout=120)
    assert layouts[0] == layouts[1] and len(layouts[0]) == 3  # the replicated table has no ShardedTensor
    for shards, (rows, dim) in layouts[0].values():
        assert sum(nr * nc for _, (nr, nc), _ in shards) == rows * dim  # the shards tile the table
