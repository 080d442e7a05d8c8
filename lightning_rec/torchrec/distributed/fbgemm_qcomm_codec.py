"""`torchrec.distributed.fbgemm_qcomm_codec`: CommType, QCommsConfig, get_qcomm_codecs_registry. Accepted and not
applied: the embedding all-to-alls carry the lookups' float32 output (DistributedModelParallel logs it once)."""

from lightning_rec.sharding.sharders import CommType, QCommsConfig, get_qcomm_codecs_registry

__all__ = ["CommType", "QCommsConfig", "get_qcomm_codecs_registry"]
