"""Serving: row-wise quantized tables (fbgemm's integer kernel) against a few lines of torch on the dequantized rows,
quantized exports (`lightning-rec export --tables`), and the bad input they refuse."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_rec import checkpoint as ckpt
from lightning_rec.embedding import EmbeddingBagCollection
from lightning_rec.embedding_configs import EmbeddingBagConfig
from lightning_rec.models import DLRMModule
from lightning_rec.serving import QuantEmbeddingBagCollection, dequantize_rows, quantize_inference_model
from lightning_rec.sparse import KeyedJaggedTensor

NAMES = ["s0", "s1", "s2"]
SMALL = dict(num_embeddings_per_feature=40, embedding_dim=8, sparse_feature_names=NAMES, dense_in_features=4,
             dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1])
EBC = "model.sparse_arch.embedding_bag_collection"


def _tables(pooling: str = "sum") -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="t0", num_embeddings=50, embedding_dim=16, feature_names=["a", "b"],
                               pooling=pooling),
            EmbeddingBagConfig(name="t1", num_embeddings=30, embedding_dim=8, feature_names=["c", "a"],
                               pooling=pooling)]


def _kjt(B: int = 6, seed: int = 0) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (3 * B,), generator=g)
    values = torch.randint(0, 30, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(["c", "a", "b"], values, lengths)


def _reference(qebc: QuantEmbeddingBagCollection, kjt: KeyedJaggedTensor, mean: bool) -> torch.Tensor:
    """torch's embedding_bag over the dequantized rows, feature by feature in the outputs' order."""
    rows = {t: dequantize_rows(d, s, qebc.data_type) for t, (d, s) in qebc.quantized_tables().items()}
    per_key = kjt.to_dict()
    outs = []
    for c in qebc.embedding_bag_configs():
        for f in c.feature_names:
            jt = per_key[f]
            outs.append(torch.nn.functional.embedding_bag(jt.values(), rows[c.name], jt.offsets()[:-1],
                                                          mode="mean" if mean else "sum", include_last_offset=False))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("data_type", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_quantized_lookup_equals_torch_on_the_dequantized_rows(data_type, pooling):
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables(pooling))
    qebc = QuantEmbeddingBagCollection.from_float(ebc, data_type)
    kjt = _kjt()
    out = qebc(kjt)
    assert out.keys() == ebc(kjt).keys() == ["a@t0", "b", "c", "a@t1"]
    torch.testing.assert_close(out.values(), _reference(qebc, kjt, pooling == "mean"), atol=1e-5, rtol=1e-5)
    # and near the float tables: the rounding of one row-wise step
    tol = {"fp32": 1e-6, "fp16": 1e-3, "int8": 1e-2, "int4": 0.1}[data_type]
    torch.testing.assert_close(out.values(), ebc(kjt).values(), atol=tol, rtol=0)


def test_row_layout_is_fbgemms_scale_and_bias_per_row():
    torch.manual_seed(0)
    weight = torch.randn(5, 8)
    q = QuantEmbeddingBagCollection.from_float(
        EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=5, embedding_dim=8, feature_names=["f"])]),
        "int8")
    q.load_quantized({"t": (torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(weight)[:, :8], torch.cat(
        [weight.min(1, keepdim=True)[0] * 0 + (weight.max(1)[0] - weight.min(1)[0])[:, None] / 255,
         weight.min(1, keepdim=True)[0]], dim=1).half().view(torch.uint8))})
    data, scale_bias = q.quantized_tables()["t"]
    assert data.shape == (5, 8) and scale_bias.shape == (5, 4)  # uint8 rows, float16 scale then bias
    torch.testing.assert_close(dequantize_rows(data, scale_bias, "int8"), weight, atol=0.02, rtol=0)


def test_quantize_inference_model_keeps_the_model_and_replaces_the_tables():
    torch.manual_seed(0)
    module = DLRMModule(**SMALL).eval()
    dense, kjt = torch.randn(6, 4), KeyedJaggedTensor.from_lengths_sync(
        NAMES, torch.randint(0, 40, (18,)), torch.ones(18, dtype=torch.long))
    quant = quantize_inference_model(module, "int8")
    assert isinstance(quant.get_submodule(EBC), QuantEmbeddingBagCollection)
    assert isinstance(module.get_submodule(EBC), EmbeddingBagCollection)  # not in place: the float model stays
    with torch.no_grad():
        torch.testing.assert_close(quant(dense, kjt), module(dense, kjt), atol=2e-2, rtol=0)


def test_torchrec_quantize_embeddings_is_quantize_inference_model():
    from lightning_rec.torchrec.inference.modules import quantize_embeddings
    from lightning_rec.torchrec.quant import EmbeddingBagCollection as QuantEBC

    module = DLRMModule(**SMALL)
    quant = quantize_embeddings(module, dtype=torch.qint8, inplace=False)
    assert isinstance(quant.get_submodule(EBC), QuantEBC) and quant.get_submodule(EBC).data_type == "int8"
    assert quantize_embeddings(module, dtype=torch.quint4x2).get_submodule(EBC).data_type == "int4"


# export ---------------------------------------------------------------------------------------------------------


def _checkpoint(tmp_path, cls: str = "lightning_rec.models.dlrm_module.DLRMModule", **kw):
    torch.manual_seed(0)
    dim = kw.get("embedding_dim", 8)
    module = DLRMModule(**{**SMALL, "dense_arch_layer_sizes": [16, dim], **kw})
    f = tmp_path / "one.ckpt"
    ckpt.save_file({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                    "lightning_rec": {"module_class": cls}}, f)
    return f, module


@pytest.mark.parametrize("data_type", ["int8", "int4"])
def test_quantized_export_loads_the_stored_rows_and_is_smaller(tmp_path, data_type):
    f, module = _checkpoint(tmp_path, embedding_dim=16)
    full = ckpt.export(f, tmp_path / "fp32")
    out = ckpt.export(f, tmp_path / data_type, tables=data_type)
    assert json.loads((out / "config.json").read_text())["tables"] == data_type
    loaded = ckpt.load_exported(out)
    assert isinstance(loaded.get_submodule(EBC), QuantEmbeddingBagCollection) and not loaded.training
    lengths = torch.randint(0, 3, (24,))
    dense, kjt = torch.randn(8, 4), KeyedJaggedTensor.from_lengths_sync(
        NAMES, torch.randint(0, 40, (int(lengths.sum()),)), lengths)
    with torch.no_grad():  # the rows stored are the rows quantize_inference_model makes of the float model
        assert torch.equal(loaded(dense, kjt), quantize_inference_model(module, data_type).eval()(dense, kjt))
    table_bytes = 3 * 40 * 16 * 4
    stored = loaded.get_submodule(EBC).table_bytes()
    assert stored == 3 * 40 * (16 * (8 if data_type == "int8" else 4) // 8 + 4)
    saved = (full / "model.safetensors").stat().st_size - (out / "model.safetensors").stat().st_size
    assert saved >= table_bytes - stored - 1024  # the file holds the quantized rows, not the float ones


def test_cli_tables_option_and_fp16_alias(tmp_path, capsys):
    from lightning_rec.cli import export_main

    f, _ = _checkpoint(tmp_path)
    export_main([str(f), str(tmp_path / "q"), "--tables", "int8"])
    assert json.loads((tmp_path / "q" / "config.json").read_text())["tables"] == "int8"
    export_main([str(f), str(tmp_path / "h"), "--fp16-tables"])
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["tables"] == "fp16" and config["fp16_tables"] is True
    assert ckpt.load_exported(tmp_path / "h").get_submodule(EBC).table_parameters()["t_s0"].dtype == torch.float32


def test_an_existing_export_path_is_refused_unless_overwrite(tmp_path, capsys):
    from lightning_rec.cli import export_main

    f, _ = _checkpoint(tmp_path)
    out = ckpt.export(f, tmp_path / "out")
    with pytest.raises(SystemExit):
        export_main([str(f), str(out), "--tables", "int4"])
    err = capsys.readouterr().err
    assert f"{out} exists and is not empty" in err and "--overwrite" in err
    assert json.loads((out / "config.json").read_text())["tables"] == "fp32"  # nothing lost
    export_main([str(f), str(out), "--tables", "int4", "--overwrite"])
    assert json.loads((out / "config.json").read_text())["tables"] == "int4"


def test_int4_with_a_dim_the_kernel_cannot_take_names_it_and_the_dims_it_can(tmp_path):
    f, _ = _checkpoint(tmp_path, embedding_dim=12)
    with pytest.raises(ValueError, match=r"int4 tables need an embedding dim that is a multiple of 8.*dim 12.*"
                                         r"use dims 8, 16, 24.*store these tables as fp32 or fp16 or int8"):
        ckpt.export(f, tmp_path / "out", tables="int4")
    assert not (tmp_path / "out").exists()
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=12,
                                                     feature_names=["f"])])
    with pytest.raises(ValueError, match="multiple of 8"):
        QuantEmbeddingBagCollection.from_float(ebc, "int4")


def test_a_checkpoint_of_another_model_class_is_refused(tmp_path, capsys):
    from lightning_rec.cli import export_main

    f, _ = _checkpoint(tmp_path)
    with pytest.raises(ValueError, match="is a checkpoint of lightning_rec.models.dlrm_module.DLRMModule, not of "
                                         "lightning_rec.models.TwoTowerModule"):
        ckpt.export(f, tmp_path / "out", module_class="lightning_rec.models.TwoTowerModule")
    ckpt.export(f, tmp_path / "out", module_class=DLRMModule)  # the class re-exported elsewhere is the same one
    with pytest.raises(SystemExit):
        export_main([str(f), str(tmp_path / "o2"), "--class", "lightning_rec.models.TwoTowerModule"])
    assert "not of lightning_rec.models.TwoTowerModule" in capsys.readouterr().err


def test_an_id_beyond_the_table_raises():
    ebc = EmbeddingBagCollection(_tables())
    qebc = QuantEmbeddingBagCollection.from_float(ebc, "int8")
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], torch.tensor([1, 2, 40]), torch.ones(3, dtype=int))
    with pytest.raises(RuntimeError):  # "c" reads t1, 30 rows
        qebc(kjt)
    missing = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([1, 2]), torch.ones(2, dtype=int))
    with pytest.raises(ValueError, match=r"no feature\(s\) \['c'\]"):
        qebc(missing)


def test_retrieval_of_a_dlrm_is_refused(tmp_path, capsys):
    from lightning_rec.cli import export_main

    f, _ = _checkpoint(tmp_path)
    with pytest.raises(SystemExit):
        export_main([str(f), str(tmp_path / "out"), "--retrieval"])
    assert "--retrieval is for two-tower / matrix-factorisation models (TwoTowerModule), not DLRMModule" in \
        capsys.readouterr().err


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_the_package_network_equals_the_quantized_model(interaction):
    # what export_package compiles, eagerly (the compiled package: tests/test_serving_package.py)
    from lightning_rec.serving.package import example_inputs, serving_module

    torch.manual_seed(0)
    extra = dict(dcn_num_layers=2, dcn_low_rank_dim=4) if interaction == "dcn" else {}
    module = DLRMModule(**SMALL, interaction=interaction, **extra).eval()
    net, meta = serving_module(module, "int4")
    dense, values, lengths = example_inputs(meta, batch=64, seed=3)
    kjt = KeyedJaggedTensor.from_lengths_sync(NAMES, values, lengths)
    with torch.no_grad():
        torch.testing.assert_close(net(dense, values, lengths), quantize_inference_model(module, "int4")(dense, kjt),
                                   atol=1e-6, rtol=1e-6)
