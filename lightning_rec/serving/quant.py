"""Row-wise quantized tables for inference: fbgemm's integer TBE kernel (`IntNBitTableBatchedEmbeddingBagsCodegen`)
behind TorchRec's names, `QuantEmbeddingBagCollection` and `quantize_inference_model`.

A table of R rows x D is stored as fbgemm lays it out: `data` uint8 [R, D * bits / 8] (int4: two ids' values a byte,
low nibble first) and, for int8 / int4, `scale_bias` uint8 [R, 4], the row's float16 scale then float16 bias
(value = q * scale + bias). fp16 / fp32 tables have no scale_bias.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from lightning_rec.embedding import EmbeddingBagCollection, EmbeddingCollection, feature_table_names
from lightning_rec.embedding_configs import EmbeddingBagConfig, PoolingType
from lightning_rec.sparse import KeyedJaggedTensor, KeyedTensor

TABLE_TYPES = ("fp32", "fp16", "int8", "int4")
# the integer kernel reads whole 4-byte words of a row: dims a multiple of these (fbgemm's SparseType.align_size)
DIM_MULTIPLE = {"fp32": 1, "fp16": 2, "int8": 4, "int4": 8}
_BITS = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4}


def _sparse_type(data_type: str):
    from fbgemm_gpu.split_embedding_configs import SparseType

    return {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "int8": SparseType.INT8,
            "int4": SparseType.INT4}[data_type]


def check_table_type(data_type: str, tables: Sequence[EmbeddingBagConfig] | Mapping[str, int]) -> None:
    """ValueError naming an unknown type, or a table whose dim the type's kernel cannot take (and the dims it can).
    tables: configs, or dims by table name."""
    if data_type not in TABLE_TYPES:
        raise ValueError(f"tables={data_type!r}: give one of {', '.join(TABLE_TYPES)}")
    dims = tables if isinstance(tables, Mapping) else {t.name: t.embedding_dim for t in tables}
    multiple = DIM_MULTIPLE[data_type]
    bad = [f"'{name}' (dim {d})" for name, d in dims.items() if d % multiple]
    if bad:
        fits = [k for k, m in DIM_MULTIPLE.items() if all(d % m == 0 for d in dims.values())]
        raise ValueError(f"{data_type} tables need an embedding dim that is a multiple of {multiple} (fbgemm's integer "
                         f"kernel), but table {', '.join(bad)} is not: use dims {multiple}, {2 * multiple}, "
                         f"{3 * multiple}, ..., or store these tables as {' or '.join(fits)}")


def quantize_rows(weight: Tensor, data_type: str) -> tuple[Tensor, Tensor | None]:
    """One float table -> (data, scale_bias) in the kernel's layout (see the module's docstring)."""
    weight = weight.detach().float().cpu().contiguous()
    if data_type in ("fp32", "fp16"):
        return weight.to(torch.float32 if data_type == "fp32" else torch.float16).view(torch.uint8), None
    if data_type == "int8":  # fbgemm writes float32 scale and bias after the row; the kernel reads float16 before it
        fused = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(weight)
        return fused[:, :-8].contiguous(), fused[:, -8:].contiguous().view(torch.float32).half().view(torch.uint8)
    fused = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(weight, _BITS[data_type])
    return fused[:, :-4].contiguous(), fused[:, -4:].contiguous()


def dequantize_rows(data: Tensor, scale_bias: Tensor | None, data_type: str) -> Tensor:
    """The float rows a quantized table stands for (a few lines of torch: the reference the kernel is checked
    against)."""
    if data_type in ("fp32", "fp16"):
        return data.view(torch.float32 if data_type == "fp32" else torch.float16).float()
    if data_type == "int8":
        q = data.float()
    else:  # two values a byte, low nibble first
        q = torch.stack([data & 0x0F, data >> 4], dim=-1).flatten(-2).float()
    scale, bias = scale_bias.view(torch.float16).float().unbind(-1)
    return q * scale[:, None] + bias[:, None]


def stored_bytes(tables: Mapping[str, tuple[Tensor, Tensor | None]]) -> int:
    return sum(d.numel() * d.element_size() + (0 if s is None else s.numel() * s.element_size())
               for d, s in tables.values())


class QuantEmbeddingBagCollection(nn.Module):
    """Pooled lookups from row-wise quantized tables (TorchRec's `torchrec.quant.EmbeddingBagCollection`): KJT ->
    KeyedTensor as `EmbeddingBagCollection`, through fbgemm's integer TBE kernel (CPU or CUDA).

    Args:
        tables: the EmbeddingBagConfigs (one pooling for all: sum or mean).
        data_type: "int8" | "int4" | "fp16" | "fp32".
        weights: per table name, (data, scale_bias) from `quantize_rows` (None: zeros, to fill by
            `load_quantized`).
        device: "cpu" (or a CUDA device).

    An id outside its table raises (RuntimeError from the kernel's bounds check), as in training.
    """

    def __init__(self, tables: Sequence[EmbeddingBagConfig], data_type: str = "int8",
                 weights: Mapping[str, tuple[Tensor, Tensor | None]] | None = None, is_weighted: bool = False,
                 device: torch.device | str = "cpu") -> None:
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

        super().__init__()
        tables = list(tables)
        check_table_type(data_type, tables)
        poolings = {t.pooling for t in tables}
        if len(poolings) != 1:
            raise ValueError(f"QuantEmbeddingBagCollection takes tables of one pooling, got "
                             f"{sorted(p.value for p in poolings)}: quantize sum and mean tables in two collections")
        self._configs, self._sources = tables, feature_table_names(tables)[1]
        routed = feature_table_names(tables)[0]
        self.data_type, self._is_weighted = data_type, is_weighted
        self._output_names = [f for c in routed for f in c.feature_names]
        self._output_dims = [c.embedding_dim for c in routed for _ in c.feature_names]
        self.num_embeddings = {t.name: t.num_embeddings for t in tables}
        device = torch.device(device)
        location = EmbeddingLocation.HOST if device.type == "cpu" else EmbeddingLocation.DEVICE
        self.tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(t.name, t.num_embeddings, t.embedding_dim, _sparse_type(data_type), location)
                             for t in tables],
            feature_table_map=[i for i, c in enumerate(routed) for _ in c.feature_names],
            pooling_mode=PoolingMode.MEAN if poolings.pop() == PoolingType.MEAN else PoolingMode.SUM,
            device=device, output_dtype=_sparse_type("fp32"), bounds_check_mode=BoundsCheckMode.FATAL)
        self.tbe.initialize_weights()
        if weights is not None:
            self.load_quantized(weights)

    @classmethod
    def from_float(cls, collection: EmbeddingBagCollection, data_type: str = "int8") -> QuantEmbeddingBagCollection:
        """TorchRec's `QuantEmbeddingBagCollection.from_float`: a trained collection's tables, quantized."""
        tables = collection.embedding_bag_configs()
        check_table_type(data_type, tables)
        weights = collection.table_parameters()
        return cls(tables, data_type, {t.name: quantize_rows(weights[t.name], data_type) for t in tables},
                   is_weighted=collection._is_weighted, device="cpu")

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._configs)

    def feature_names(self) -> list[str]:
        return list(self._output_names)

    @torch.no_grad()
    def load_quantized(self, weights: Mapping[str, tuple[Tensor, Tensor | None]]) -> None:
        """Write each table's (data, scale_bias) into the kernel's rows."""
        missing = [t.name for t in self._configs if t.name not in weights]
        if missing:
            raise ValueError(f"no quantized rows for table(s) {missing}: give every table's (data, scale_bias)")
        self.tbe.assign_embedding_weights([weights[t.name] for t in self._configs])

    def quantized_tables(self) -> dict[str, tuple[Tensor, Tensor | None]]:
        """Per table, (data, scale_bias) as stored (copies of the kernel's rows)."""
        out = {}
        for t, (data, scale_bias) in zip(self._configs, self.tbe.split_embedding_weights()):
            out[t.name] = (data.clone(), None if scale_bias is None else scale_bias.clone())
        return out

    def table_bytes(self) -> int:
        """Bytes the tables take stored (data + scale_bias), without the kernel's row padding."""
        return sum(t.num_embeddings * (t.embedding_dim * _BITS[self.data_type] // 8 +
                                       (4 if self.data_type.startswith("int") else 0)) for t in self._configs)

    def lookup(self, values: Tensor, lengths: Tensor, weights: Tensor | None = None) -> Tensor:
        """[B, sum of dims] from ids in the output features' order (feature-major, B lengths each)."""
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.to(values.dtype))
        return self.tbe(values, offsets, weights)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        keys = features.keys()
        missing = sorted({self._sources[f] for f in self._output_names} - set(keys))
        if missing:
            raise ValueError(f"the KeyedJaggedTensor has no feature(s) {missing} (it has {keys}): give every feature "
                             f"the tables read (an empty one as zero lengths)")
        kjt = features.permute([keys.index(self._sources[f]) for f in self._output_names])
        weights = kjt.weights_or_none() if self._is_weighted else None
        pooled_BD = self.lookup(kjt.values().long(), kjt.lengths().long(), weights)
        return KeyedTensor._of_collection(self._output_names, self._output_dims, pooled_BD)


def quantize_inference_model(model: nn.Module, data_type: str = "int8", inplace: bool = False) -> nn.Module:
    """TorchRec's `quantize_inference_model`: every EmbeddingBagCollection of `model` replaced by its
    QuantEmbeddingBagCollection (`data_type` "int8" | "int4" | "fp16" | "fp32"), the rest kept as is, in eval mode.

    inplace=False works on a deep copy. Sequence tables (EmbeddingCollection) are refused: no integer kernel here.
    """
    import copy

    if data_type not in TABLE_TYPES:
        raise ValueError(f"quantize_inference_model: data_type={data_type!r}: give one of {', '.join(TABLE_TYPES)}")
    if not inplace:
        model = copy.deepcopy(model)
    found = 0
    for name, child in list(model.named_modules()):
        if isinstance(child, EmbeddingCollection):
            raise ValueError(f"quantize_inference_model: {name or 'the model'} is an EmbeddingCollection (sequence "
                             f"tables): only pooled tables (EmbeddingBagCollection) are quantized")
        if isinstance(child, EmbeddingBagCollection):
            quant = QuantEmbeddingBagCollection.from_float(child, data_type)
            parent_name, _, attr = name.rpartition(".")
            if not name:
                return quant.eval()
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, quant)
            found += 1
    if not found:
        raise ValueError("quantize_inference_model: the model has no EmbeddingBagCollection to quantize")
    return model.eval()


def _table_key(key: str) -> bool:
    return ".embedding_bags." in key and key.endswith(".weight")


def quantize_state(state: Mapping[str, Tensor], data_type: str) -> dict[str, Tensor]:
    """A model's state dict with its pooled tables stored as `data_type`: `KEY` (fp32), `KEY` in float16 (fp16), or
    `KEY.qdata` + `KEY.qscale_bias` (int8 / int4) for each table KEY (`...embedding_bags.NAME.weight`)."""
    check_table_type(data_type, {k: v.shape[-1] for k, v in state.items() if _table_key(k) and v.dim() == 2})
    out = {}
    for k, v in state.items():
        v = v.detach().cpu().contiguous()
        if not (_table_key(k) and v.is_floating_point()) or data_type == "fp32":
            out[k] = v
        elif data_type == "fp16":
            out[k] = v.half()
        else:
            out[f"{k}.qdata"], out[f"{k}.qscale_bias"] = quantize_rows(v, data_type)
    return out


def load_quantized_state(module: nn.Module, tensors: Mapping[str, Tensor], data_type: str) -> nn.Module:
    """`module` (float, as built) with the dense weights of `tensors` and its pooled tables replaced by
    QuantEmbeddingBagCollections holding the stored rows (what `quantize_state` wrote)."""
    dense = {k: v for k, v in tensors.items() if not k.endswith((".qdata", ".qscale_bias"))}
    result = module.load_state_dict(dense, strict=False)
    tables = {k.removesuffix(".qdata") for k in tensors if k.endswith(".qdata")}
    missing = sorted(set(result.missing_keys) - tables)
    unexpected = sorted(result.unexpected_keys)
    if missing or unexpected:
        raise ValueError(f"the export does not fit {type(module).__name__}: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}: load it into the class its config.json names")
    quantize_inference_model(module, data_type, inplace=True)
    for name, child in module.named_modules():
        if isinstance(child, QuantEmbeddingBagCollection):
            keys = {t.name: f"{name}.embedding_bags.{t.name}.weight" for t in child.embedding_bag_configs()}
            absent = [k for k in keys.values() if f"{k}.qdata" not in tensors]
            if absent:
                raise ValueError(f"the export has no quantized rows for {absent[:5]}: export the checkpoint again")
            child.load_quantized({t: (tensors[f"{k}.qdata"], tensors[f"{k}.qscale_bias"]) for t, k in keys.items()})
    return module
