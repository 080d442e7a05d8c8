"""KeyedTensor: dense per-key blocks side by side, what an EmbeddingBagCollection returns."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_rec._device import move_or_explain
from lightning_rec.errors import NoTorchScript
from lightning_rec.sparse.checks import _no_key


# the metaclass: torch.fx records a construction from traced tensors as one node
class KeyedTensor(NoTorchScript, metaclass=torch.fx.ProxyableClassMeta):
    """Dense per-key blocks side by side: values [B, sum(D)] with keys and each key's width.

        keys = ["t1", "t2"], length_per_key = [2, 3]
        values = [[a a b b b],      (one row per sample)
                  [a a b b b]]
    """

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: Tensor,
                 key_dim: int = 1, offset_per_key: Sequence[int] | None = None,
                 index_per_key: dict[str, int] | None = None) -> None:
        self._keys = list(keys)
        self._length_per_key = list(length_per_key)
        # TorchRec's caches of what keys and widths give: checked, not trusted
        if offset_per_key is not None and [int(o) for o in offset_per_key] != [
                sum(self._length_per_key[:i]) for i in range(len(self._length_per_key) + 1)]:
            raise ValueError(f"KeyedTensor: offset_per_key {list(offset_per_key)} disagrees with the widths "
                             f"{self._length_per_key} of keys {self._keys}: leave it out (it is computed from them)")
        if index_per_key is not None and dict(index_per_key) != {k: i for i, k in enumerate(self._keys)}:
            raise ValueError(f"KeyedTensor: index_per_key {dict(index_per_key)} does not give each key its position "
                             f"in keys {self._keys}: leave it out (it is computed from the keys)")
        if len(self._keys) != len(self._length_per_key):
            raise ValueError(f"KeyedTensor: {len(self._keys)} keys but {len(self._length_per_key)} widths")
        if len(set(self._keys)) != len(self._keys):  # kt[key] / to_dict() would keep one of the two blocks
            dup = sorted({k for k in self._keys if self._keys.count(k) > 1})
            raise ValueError(f"KeyedTensor: duplicate keys {dup} in {self._keys}: give every block its own key")
        if any(n < 0 for n in self._length_per_key):
            raise ValueError(f"KeyedTensor: widths must be >= 0, got {self._length_per_key} for keys {self._keys}")
        if self._keys or values.numel():  # TorchRec's empty KeyedTensor([], [], torch.Tensor()) has no key dim
            if not -values.dim() <= key_dim < values.dim():
                raise ValueError(f"KeyedTensor: key_dim={key_dim} is not a dim of values of shape "
                                 f"{tuple(values.shape)} (1 for [B, sum of widths])")
            if values.shape[key_dim] != sum(self._length_per_key):
                raise ValueError(f"KeyedTensor: values have {values.shape[key_dim]} columns but the keys' widths add "
                                 f"up to {sum(self._length_per_key)}")
        self._values = values
        self._key_dim = key_dim
        self._offset_per_key: list[int] | None = None

    @classmethod
    def _of_collection(cls, keys: list[str], length_per_key: list[int], values_BD: Tensor) -> KeyedTensor:
        """A collection's output (keys and widths checked when it was built), with copies of the lists."""
        kt = cls.__new__(cls)
        kt._keys, kt._length_per_key, kt._values = list(keys), list(length_per_key), values_BD
        kt._key_dim, kt._offset_per_key = 1, None
        return kt

    @staticmethod
    def from_tensor_list(keys: Sequence[str], tensors: Sequence[Tensor], key_dim: int = 1,
                         cat_dim: int = 1) -> KeyedTensor:
        widths = [t.shape[key_dim] for t in tensors]
        other = {tuple(s for d, s in enumerate(t.shape) if d != key_dim % t.dim()) for t in tensors}
        if len(other) > 1:
            shapes = ", ".join(f"'{k}': {tuple(t.shape)}" for k, t in zip(keys, tensors))
            raise ValueError(f"KeyedTensor.from_tensor_list: the tensors differ outside key_dim={key_dim} (batch "
                             f"sizes?): {shapes}")
        return KeyedTensor(keys, widths, torch.cat(list(tensors), dim=cat_dim), key_dim)

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        if self._offset_per_key is None:
            acc, out = 0, [0]
            for n in self._length_per_key:
                acc += n
                out.append(acc)
            self._offset_per_key = out
        return self._offset_per_key

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def to_dict(self) -> dict[str, Tensor]:
        parts = torch.split(self._values, self._length_per_key, dim=self._key_dim)
        return dict(zip(self._keys, parts))

    def __getitem__(self, key: str) -> Tensor:
        if not isinstance(key, str) or key not in self._keys:
            _no_key("KeyedTensor", key, self._keys)
        i = self._keys.index(key)
        opk = self.offset_per_key()
        return self._values.narrow(self._key_dim, opk[i], opk[i + 1] - opk[i])

    @staticmethod
    def regroup(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> list[Tensor]:
        """Columns of several KeyedTensors gathered into one tensor per group of keys (`regroup_kts`)."""
        return regroup_kts(keyed_tensors, groups)

    @staticmethod
    def regroup_as_dict(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]],
                        keys: Sequence[str]) -> dict[str, Tensor]:
        """`regroup`, each group's tensor under its name: {keys[i]: columns of groups[i]} (TorchRec's)."""
        if len(groups) != len(keys):
            raise ValueError(f"regroup_as_dict: {len(groups)} groups but {len(keys)} keys: give one name per group")
        out = KeyedTensor.regroup(keyed_tensors, groups)
        return {key: out[i] for i, key in enumerate(keys)}  # by index: a traced list (torch.fx) is not iterable

    def device(self) -> torch.device:
        """TorchRec's: the values' device."""
        return self._values.device

    def record_stream(self, stream: torch.Stream) -> None:
        self._values.record_stream(stream)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedTensor:
        values = move_or_explain(f"KeyedTensor.to({str(device)!r})", device,
                                 lambda: self._values.to(device, non_blocking=non_blocking))
        return KeyedTensor(self._keys, self._length_per_key, values, self._key_dim)

    def __repr__(self) -> str:
        return str(self).rstrip("\n")

    def __str__(self) -> str:
        """TorchRec's: each key's block, row by row."""
        if not self._keys:
            return "KeyedTensor()\n"
        return "KeyedTensor({\n" + ",\n".join(f'    "{key}": {self[key].tolist()}' for key in self._keys) + "\n})\n"


def regroup_kts(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> list[Tensor]:
    """TorchRec's: the columns of the keys of each group, gathered from several KeyedTensors into one tensor per group
    (a key may appear in several groups; one node when torch.fx traces it)."""
    blocks: dict[str, Tensor] = {}
    holders: dict[str, list[int]] = {}
    for i, kt in enumerate(keyed_tensors):
        blocks.update(kt.to_dict())
        for k in kt.keys():
            holders.setdefault(k, []).append(i)
    out = []
    for group in groups:
        missing = [k for k in group if k not in blocks]
        if missing:
            raise KeyError(f"regroup: keys {missing} are in none of the KeyedTensors ({list(blocks)})")
        shared = {k: holders[k] for k in group if len({id(keyed_tensors[i]) for i in holders[k]}) > 1}
        if shared:
            # TorchRec takes the last KeyedTensor's block: two towers' 'country' blocks would become one
            raise ValueError(f"regroup: keys {shared} are in several of the KeyedTensors (at those positions), so "
                             f"which block is meant is ambiguous: give the features distinct names (the tables' "
                             f"feature_names, and the batch's keys), or regroup each KeyedTensor on its own")
        if not group:  # TorchRec's: an empty group is a tensor of no columns (torch.cat refuses an empty list)
            first = keyed_tensors[0]
            out.append(first.values().narrow(first.key_dim(), 0, 0))
            continue
        out.append(torch.cat([blocks[k] for k in group], dim=keyed_tensors[0].key_dim()))
    return out


permute_multi_embedding = regroup_kts  # TorchRec's name of the same regrouping (its fbgemm kernel)
torch.fx.wrap("regroup_kts")

