"""Jagged (variable-length) sparse features: JaggedTensor, KeyedJaggedTensor, KeyedTensor.

`jagged_tensor` holds the two jagged types (layout drawn there), `keyed_tensor` the pooled output type, `checks` their
contracts (the constructors only assign; collections validate each batch), `pytree` their registration with
torch.utils._pytree (torch.export, DDP, torch.func)."""

from lightning_rec._device import move_or_explain  # noqa: F401  (imported from here too)
from lightning_rec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor
from lightning_rec.sparse.keyed_tensor import KeyedTensor
from lightning_rec.sparse.pytree import _register_pytree_nodes

_register_pytree_nodes()

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor"]
