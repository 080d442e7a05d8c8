"""`torchrec.distributed.fbgemm_qcomm_codec`: CommType, QCommsConfig, get_qcomm_codecs_registry. Accepted and not
applied: the embedding all-to-alls carry the tables' dtype (DistributedModelParallel says so in one info line)."""

from lightning_rec.sharding.sharders import CommType, QCommsConfig, get_qcomm_codecs_registry

__all__ = ["CommType", "QCommsConfig", "get_qcomm_codecs_registry"]
