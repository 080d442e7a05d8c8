"""TorchRec's sharder objects, taken so that TorchRec code reads here (`DistributedModelParallel(sharders=[...])`).

DistributedModelParallel shards every EmbeddingBagCollection / EmbeddingCollection itself, so a sharder carries
nothing we need: its `fused_params` are refused (the fused update is set on the collection), and its quantized-comms
registry is accepted and not applied: the embedding all-to-alls carry the lookups' float32 output."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from lightning_rec.errors import short_repr

QCOMMS_NOT_APPLIED = ("quantized comms (qcomm_codecs_registry) are not applied: the embedding all-to-alls carry the "
                      "lookups' float32 output")


@enum.unique
class CommType(enum.Enum):
    """TorchRec's comm precisions (`torchrec.distributed.fbgemm_qcomm_codec.CommType`)."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"
    MX4 = "mx4"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass
class QCommsConfig:
    """TorchRec's quantized-comms settings, kept as given (see the module doc: not applied)."""

    forward_precision: CommType = CommType.FP32
    backward_precision: CommType = CommType.FP32
    forward_loss_scale: float | None = None
    backward_loss_scale: float | None = None
    fp8_quantize_dim: int | None = None
    fp8_quantize_dim_bwd: int | None = None
    fp8_bwd_uses_143: bool | None = False
    mx4_quantize_dim: int | None = None
    mx4_quantize_dim_bwd: int | None = None
    mx4_rounding_mode: Any = None


# TorchRec's CommOp names: the keys of its codecs registry
COMM_OPS = ("pooled_embeddings_all_to_all", "pooled_embeddings_reduce_scatter", "sequence_embeddings_all_to_all")


def get_qcomm_codecs_registry(qcomms_config: QCommsConfig, comm_ops: Any = None,
                              device: Any = None) -> dict[str, QCommsConfig] | None:
    """TorchRec's registry, one entry per comm op holding the config (None for no config, as TorchRec's)."""
    if qcomms_config is None:
        return None
    ops = COMM_OPS if comm_ops is None else [getattr(op, "value", op) for op in comm_ops]
    return {op: qcomms_config for op in ops}


class _Sharder:
    """TorchRec's `ModuleSharder` arguments: fused_params (refused unless empty) and qcomm_codecs_registry."""

    module_name = ""

    def __init__(self, fused_params: Mapping[str, Any] | None = None,
                 qcomm_codecs_registry: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if fused_params:
            raise ValueError(f"{type(self).__name__}(fused_params={short_repr(fused_params)}): the fused update is "
                             f"set on the collection here: EmbeddingBagCollection(..., optimizer="
                             f"FusedOptimizerConfig(...)) or apply_optimizer_in_backward(...) before sharding")
        unknown = sorted(k for k, v in kwargs.items() if v is not None)
        if unknown:
            raise ValueError(f"{type(self).__name__} takes fused_params and qcomm_codecs_registry here, not "
                             f"{unknown}: sharding types are chosen with ParameterConstraints(sharding_types=...)")
        self.fused_params = dict(fused_params or {})
        self.qcomm_codecs_registry = qcomm_codecs_registry

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class EmbeddingBagCollectionSharder(_Sharder):
    module_name = "EmbeddingBagCollection"


class EmbeddingCollectionSharder(_Sharder):
    module_name = "EmbeddingCollection"


SHARDERS = (EmbeddingBagCollectionSharder, EmbeddingCollectionSharder)
