"""`torchrec.sparse.jagged_tensor`: JaggedTensor, KeyedJaggedTensor, KeyedTensor and their helpers."""

from lightning_rec.sparse import (
    ComputeJTDictToKJT,
    ComputeKJTToJTDict,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    jt_is_equal,
    kjt_is_equal,
    permute_multi_embedding,
    regroup_kts,
)

__all__ = ["ComputeJTDictToKJT", "ComputeKJTToJTDict", "JaggedTensor", "KeyedJaggedTensor", "KeyedTensor",
           "jt_is_equal", "kjt_is_equal", "permute_multi_embedding", "regroup_kts"]


def _private(name: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"torchrec.sparse.jagged_tensor.{name} is a TorchRec-private helper, not in "
                                  f"lightning_rec: use regroup_kts / KeyedTensor.regroup")

    return refuse


# TorchRec-private regroup helpers its own tests import (as references): importable, refused when called
_regroup_keyed_tensors = _private("_regroup_keyed_tensors")
_fbgemm_permute_pooled_embs = _private("_fbgemm_permute_pooled_embs")
_kt_regroup_arguments = _private("_kt_regroup_arguments")
