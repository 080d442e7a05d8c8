"""Jagged (variable-length) sparse features: JaggedTensor, KeyedJaggedTensor, KeyedTensor.

`jagged_tensor` holds the two jagged types (layout drawn there), `keyed_tensor` the pooled output type, `checks` their
contracts (the constructors only assign; collections validate each batch), `compare` TorchRec's equality helpers and
dict-conversion modules, `pytree` their registration with torch.utils._pytree (torch.export, DDP, torch.func)."""

from lightning_rec._device import move_or_explain  # noqa: F401  (imported from here too)
from lightning_rec.sparse.checks import validate_keyed_jagged_tensor
from lightning_rec.sparse.compare import ComputeJTDictToKJT, ComputeKJTToJTDict, jt_is_equal, kjt_is_equal
from lightning_rec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor
from lightning_rec.sparse.keyed_tensor import KeyedTensor, permute_multi_embedding, regroup_kts
from lightning_rec.sparse.pytree import _register_pytree_nodes

_register_pytree_nodes()

__all__ = ["ComputeJTDictToKJT", "ComputeKJTToJTDict", "JaggedTensor", "KeyedJaggedTensor", "KeyedTensor",
           "jt_is_equal", "kjt_is_equal", "permute_multi_embedding", "regroup_kts", "validate_keyed_jagged_tensor"]
