"""The `lightning_rec.torchrec` prefix: TorchRec's module paths re-export our modules, and the pieces a port of
TorchRec's examples reaches for (MLP, RandomRecDataset, sharders and quantized-comms names, torch's
_apply_optimizer_in_backward, state_dict_to_device / state_dict_gather, quantize_embeddings) behave as TorchRec's or
refuse in one line."""

from __future__ import annotations

import importlib
import logging
import pkgutil

import pytest
import torch
import torch.distributed as dist
from dist_utils import expect_error, run_ranks
from torch import nn

import lightning_rec
import lightning_rec.torchrec as torchrec


def _prefix_modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(torchrec.__path__, "lightning_rec.torchrec.")]


@pytest.mark.parametrize("name", _prefix_modules())
def test_every_prefix_module_re_exports_our_objects(name):
    """Each name of a prefix module is lightning_rec's own object (no second implementation), but for the adapters
    that take TorchRec's argument order over ours (MLP, the example two-tower model)."""
    module = importlib.import_module(name)
    adapters = {"lightning_rec.torchrec.modules.mlp", "lightning_rec.torchrec.models.two_tower",
                "lightning_rec.torchrec.inference.modules"}
    for attr in getattr(module, "__all__", []):
        value = getattr(module, attr)
        if name in adapters or not hasattr(value, "__qualname__"):  # constants: lists of names
            continue
        assert value.__module__.startswith("lightning_rec.") and not value.__module__.startswith(
            "lightning_rec.torchrec"), f"{name}.{attr} is defined in the prefix ({value.__module__})"


def test_import_torchrec_gives_subpackages_as_attributes():
    assert torchrec.distributed.DistributedModelParallel is lightning_rec.DistributedModelParallel
    assert torchrec.optim.RowWiseAdagrad is lightning_rec.RowWiseAdagrad
    assert torchrec.EmbeddingBagCollection is lightning_rec.EmbeddingBagCollection
    assert torchrec.quant.EmbeddingBagCollection is lightning_rec.serving.QuantEmbeddingBagCollection


def test_mlp_takes_torchrecs_arguments_and_computes_its_layers():
    from lightning_rec.torchrec.modules.mlp import MLP

    torch.manual_seed(0)
    x = torch.randn(5, 4)
    mlp = MLP(4, [8, 3], True, torch.relu, None, torch.float32, True)  # TorchRec's positional order
    linears = [m for m in mlp if isinstance(m, nn.Linear)]
    want = torch.relu(torch.relu(x @ linears[0].weight.t() + linears[0].bias) @ linears[1].weight.t() + linears[1].bias)
    torch.testing.assert_close(mlp(x), want)
    last_plain = MLP(in_size=4, layer_sizes=[8, 3], activation="sigmoid", activation_on_last=False, bias=False)
    linears = [m for m in last_plain if isinstance(m, nn.Linear)]
    assert all(m.bias is None for m in linears)
    torch.testing.assert_close(last_plain(x), torch.sigmoid(x @ linears[0].weight.t()) @ linears[1].weight.t())
    # a module class gives each layer its own module; a tensor function becomes a layer; a module instance is shared
    per_layer = MLP(4, [8, 3], activation=nn.PReLU)
    assert len({id(m) for m in per_layer if isinstance(m, nn.PReLU)}) == 2
    doubled = MLP(4, [3], activation=lambda t: t * 2)
    torch.testing.assert_close(doubled(x), 2 * doubled[0](x))
    assert MLP(4, [8], device="meta", dtype=torch.float64)[0].weight.dtype == torch.float64
    expect_error(ValueError, lambda: MLP(4, [8], activation="swish_layernorm"), "activation='swish_layernorm'",
                 "'relu', 'sigmoid'")


def test_random_rec_dataset_is_torchrecs_batch_shape():
    from lightning_rec.torchrec.datasets.random import RandomRecDataset

    keys = ["a", "b", "c"]
    ds = RandomRecDataset(keys=keys, batch_size=8, hash_sizes=[5, 10, 20], ids_per_features=[1, 3, 2], num_dense=4,
                          manual_seed=1, num_batches=3, min_ids_per_features=[1, 0, 2])
    batches = list(ds)
    assert len(batches) == len(ds) == 3
    for batch in batches:
        kjt = batch.sparse_features
        assert kjt.keys() == keys and kjt.stride() == 8 and batch.dense_features.shape == (8, 4)
        assert set(batch.labels.tolist()) <= {0, 1}
        for key, n, lo, hi in zip(keys, [5, 10, 20], [1, 0, 2], [1, 3, 2]):
            jt = kjt[key]
            assert int(jt.values().max()) < n and lo <= int(jt.lengths().min()) and int(jt.lengths().max()) <= hi
    again = list(RandomRecDataset(keys=keys, batch_size=8, hash_sizes=[5, 10, 20], ids_per_features=[1, 3, 2],
                                  num_dense=4, manual_seed=1, num_batches=3, min_ids_per_features=[1, 0, 2]))
    assert torch.equal(again[2].sparse_features.values(), batches[2].sparse_features.values())
    # TorchRec's: ids_per_feature alone is an exact count; the cached batches cycle
    fixed = RandomRecDataset(keys=keys, batch_size=4, hash_size=7, ids_per_feature=2, num_generated_batches=2)
    first, _, third = [b for b, _ in zip(fixed, range(3))]
    assert (first.sparse_features.lengths() == 2).all() and third is first
    expect_error(ValueError, lambda: RandomRecDataset(keys=keys, batch_size=2, hash_sizes=[1]), "hash_sizes has 1",
                 "3 keys")


def test_sharders_and_quantized_comms_are_taken(caplog):
    from lightning_rec.torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from lightning_rec.torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
    from lightning_rec.torchrec.distributed.model_parallel import DistributedModelParallel

    registry = get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType.FP16,
                                                      backward_precision=CommType.BF16))
    assert registry and all(c.forward_precision == CommType.FP16 for c in registry.values())
    assert get_qcomm_codecs_registry(None) is None
    ebc = lightning_rec.EmbeddingBagCollection([lightning_rec.EmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])])
    with caplog.at_level(logging.INFO, logger="lightning_rec.model_parallel"):
        # taken: what stops this one process is the missing process group, as with no sharders
        expect_error(ValueError, lambda: DistributedModelParallel(
            ebc, sharders=[EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)]), "init_process_group")
    assert [r.getMessage() for r in caplog.records] == [
        "DistributedModelParallel: quantized comms (qcomm_codecs_registry) are not applied: the embedding all-to-alls "
        "carry the lookups' float32 output"]
    expect_error(ValueError, lambda: EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1}),
                 "fused_params=", "FusedOptimizerConfig(", "apply_optimizer_in_backward")


def test_quantize_embeddings_names_what_it_quantizes():
    from lightning_rec.torchrec import inference

    # the quantized tables themselves: tests/test_serving.py
    expect_error(ValueError, lambda: inference.modules.quantize_embeddings(nn.Linear(2, 2), dtype=torch.qint8,
                                                                           inplace=True),
                 "no EmbeddingBagCollection to quantize")
    expect_error(ValueError, lambda: inference.modules.quantize_embeddings(nn.Linear(2, 2), dtype=torch.bfloat16),
                 "torch.qint8, torch.quint4x2, torch.half or torch.float")


def test_local_rank_and_size_read_torchrun_env(monkeypatch):
    from lightning_rec.torchrec.distributed import get_local_rank, get_local_size

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert (get_local_size(8), get_local_rank(8, 5)) == (8, 5)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert (get_local_size(8), get_local_rank(8, 5)) == (4, 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert get_local_rank() == 3


def _tables(n: int = 3) -> list:
    return [lightning_rec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=12 + i,
                                             feature_names=[f"f{i}"]) for i in range(n)]


def _kjt(seed: int, n: int = 3, batch: int = 4) -> lightning_rec.KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (n * batch,), generator=g)
    return lightning_rec.KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(n)], values=torch.randint(0, 12, (int(lengths.sum()),), generator=g),
        lengths=lengths)


def _torch_in_backward_worker(rank: int, world_size: int) -> tuple[float, float]:
    """torch's _apply_optimizer_in_backward (what TorchRec's examples call) gives the tables their fused update at
    DistributedModelParallel: the sharded model trains as plain SGD on the unsharded tables, summed over ranks."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    from lightning_rec.torchrec.distributed.model_parallel import DistributedModelParallel
    from lightning_rec.torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from lightning_rec.torchrec.inference.state_dict_transform import state_dict_gather, state_dict_to_device
    from lightning_rec.types import ShardingPlan

    torch.manual_seed(0)
    ebc = lightning_rec.EmbeddingBagCollection(_tables())
    reference = {k: v.clone() for k, v in ebc.state_dict().items()}
    _apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.5})
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, {"t0": row_wise(), "t1": table_wise(rank=0),
                                                                  "t2": table_wise(rank=world_size - 1)})})
    dmp = DistributedModelParallel(ebc, plan=plan, device=torch.device("cpu"))
    dmp(_kjt(rank)).values().sum().backward()
    ref = lightning_rec.EmbeddingBagCollection(_tables())
    ref.load_state_dict(reference)
    for r in range(world_size):
        ref(_kjt(r)).values().sum().backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    target = lightning_rec.EmbeddingBagCollection(_tables()).state_dict()
    state_dict_gather(state_dict_to_device(dmp.state_dict(), None, torch.device("cpu")), target)
    moved = max(float((ref.state_dict()[k] - v).abs().max()) for k, v in reference.items())
    if rank != 0:  # the tables went to rank 0
        return 0.0, moved
    return max(float((target[k] - v).abs().max()) for k, v in ref.state_dict().items()), moved


@pytest.mark.parametrize("world_size", [1, 2])
def test_torchs_apply_optimizer_in_backward_fuses_and_state_dict_gather_rebuilds_the_tables(world_size):
    for err, moved in run_ranks(_torch_in_backward_worker, world_size, timeout=90):
        assert moved > 0.1 and err < 1e-6


def test_torchs_apply_optimizer_in_backward_with_two_settings_is_refused():
    from torch.distributed.optim import _apply_optimizer_in_backward

    from lightning_rec.optim import adopt_torch_in_backward

    ebc = lightning_rec.EmbeddingBagCollection(_tables(2))
    params = list(ebc.parameters())
    _apply_optimizer_in_backward(torch.optim.SGD, params[:1], {"lr": 0.5})
    assert not adopt_torch_in_backward(ebc)  # one table without: not taken (DMP names the missing fused update)
    _apply_optimizer_in_backward(torch.optim.SGD, params[1:], {"lr": 0.1})
    expect_error(ValueError, lambda: adopt_torch_in_backward(ebc), "2 different optimizer settings",
                 "one fused update")
    assert not dist.is_initialized()


def test_torchrecs_example_two_tower_signature():
    from lightning_rec.torchrec.datasets.random import RandomRecDataset
    from lightning_rec.torchrec.models.two_tower import TwoTower, TwoTowerTrainTask

    tables = [lightning_rec.EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=20, feature_names=[f])
              for f in ("userId", "movieId")]
    model = TwoTower(embedding_bag_collection=lightning_rec.EmbeddingBagCollection(tables), layer_sizes=[16, 8],
                     device=None)
    batch = next(iter(RandomRecDataset(keys=["userId", "movieId"], batch_size=6, hash_size=20, ids_per_feature=1,
                                       num_dense=0)))
    loss, (_, logits, labels) = TwoTowerTrainTask(model)(batch)
    pooled = model.ebc(batch.sparse_features)
    query, candidate = model.query_proj(pooled["userId"]), model.candidate_proj(pooled["movieId"])
    torch.testing.assert_close(logits, (query * candidate).sum(1))
    torch.testing.assert_close(loss, nn.functional.binary_cross_entropy_with_logits(logits, labels.float()))
    expect_error(ValueError, lambda: TwoTower(lightning_rec.EmbeddingBagCollection(tables[:1]), [8]),
                 "two tables of one embedding dim")
