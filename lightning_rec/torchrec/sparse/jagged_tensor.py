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

# TorchRec's private names of the same regrouping, which its own tests call (TorchRec's fast and legacy paths)
_regroup_keyed_tensors = _fbgemm_permute_pooled_embs = regroup_kts

__all__ = ["ComputeJTDictToKJT", "ComputeKJTToJTDict", "JaggedTensor", "KeyedJaggedTensor", "KeyedTensor",
           "jt_is_equal", "kjt_is_equal", "permute_multi_embedding", "regroup_kts"]


def __getattr__(name: str):
    if name.startswith("_") and not name.startswith("__"):
        # an import of TorchRec's private helpers (its tests import several) works; a call says there is none here
        def private(*args, **kwargs):
            raise NotImplementedError(f"torchrec.sparse.jagged_tensor.{name} is a TorchRec-private helper that "
                                      f"lightning_rec does not provide: use the public names ({', '.join(__all__)})")

        return private
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
