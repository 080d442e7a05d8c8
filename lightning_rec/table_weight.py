"""An embedding table's weight parameter, and which collection owns it.

A table's parameter is a view into its kernel's storage (fused tables) or the kernel's own parameter (dense): the
classes here keep that view honest (no rebinding, loads copy in place, freezing gates the kernel's update), and the
registry maps a parameter back to its collection for apply_optimizer_in_backward, which gets parameters only."""

from __future__ import annotations

import weakref
from typing import ClassVar

import torch
from torch import Tensor, nn

# id(table parameter) -> (its collection, table name), for apply_optimizer_in_backward (by id: a weakref on the
# parameter would make it unpicklable; table_owner checks identity)
_TABLE_OWNERS: dict[int, tuple[weakref.ref, str]] = {}


def table_owner(param: Tensor) -> tuple[nn.Module, str] | None:
    """The unsharded collection and table name whose weight `param` is, or None."""
    entry = _TABLE_OWNERS.get(id(param))
    owner = entry[0]() if entry is not None else None
    if owner is None or owner.table_parameters().get(entry[1]) is not param:
        return None
    return owner, entry[1]


class _Tables(nn.ModuleDict):
    """table name -> its weight holder. Any table name works, `items` and `keys` included (nn.ModuleDict refuses
    its own attribute names): entries go straight into _modules, which is all state dicts and lookups read."""

    def __setitem__(self, key: str, module: nn.Module) -> None:
        self._modules[key] = module


class FusedTableWeight(nn.Parameter):
    """A fused table's weight: a view of the kernel's storage, updated inside backward, never given a gradient.
    `requires_grad` reads False (torch.optim and DDP leave it alone); setting it False freezes the table (no update,
    state kept), True resumes. `frozen` tells which."""

    # moves at every freeze or unfreeze: a collection reads its tables' flags again only then (not every forward)
    freeze_changes: ClassVar[int] = 0

    @property
    def frozen(self) -> bool:
        return self.__dict__.get("frozen", False)  # in the instance dict: pickle keeps it with the parameter

    @frozen.setter
    def frozen(self, value: bool) -> None:
        self.__dict__["frozen"] = bool(value)
        FusedTableWeight.freeze_changes += 1

    @property
    def requires_grad(self) -> bool:
        return torch._C.TensorBase.requires_grad.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.frozen = not value

    def requires_grad_(self, requires_grad: bool = True) -> FusedTableWeight:
        self.frozen = not requires_grad
        return self

    def __deepcopy__(self, memo):
        # nn.Parameter's deepcopy builds a new parameter from data and requires_grad only: carry the freeze over
        copied = super().__deepcopy__(memo)
        copied.frozen = self.frozen
        return copied

    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """Written in place: the kernel reads the rows this parameter views, so `weight.data = x` must not rebind it."""
        own = torch._C.TensorBase.data.__get__(self)
        if not isinstance(value, torch.Tensor) or value.shape != own.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            held = ("holds none of the table's values (they are the ranks' shards): load them with "
                    "dmp.load_state_dict(...) or lightning_rec.checkpoint.load_model" if own.numel() == 0 and
                    getattr(self, "table_numel", 0) else
                    f"is a view of the kernel's rows (shape {tuple(own.shape)}): write values of that shape, "
                    f"weight.data.copy_(...) or the collection's load_state_dict")
            raise ValueError(f"{type(self).__name__}.data = a tensor of shape {shape}: this embedding table's "
                             f"parameter {held}; rebinding it would leave the kernel training the old rows")
        with torch.no_grad():
            own.copy_(value)


class _TableWeight(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs) -> None:
        # the weight views the kernel's storage: assign=True would swap in a tensor the kernel never reads
        local_metadata = {**local_metadata, "assign_to_params_buffers": False}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)
