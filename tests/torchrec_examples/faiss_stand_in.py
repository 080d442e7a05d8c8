"""An exact stand-in for the two faiss indexes the retrieval example builds (faiss is not a dependency here).

`install()` puts modules `faiss`, `faiss.contrib` and `faiss.contrib.torch_utils` into sys.modules, with
`IndexFlatL2` and `IndexIVFPQ` (train checks the vectors, add keeps them, search is exact L2 over them), so the
example's training, state-dict gathering and item-embedding steps run unchanged. A real faiss, when installed, wins."""

from __future__ import annotations

import importlib.util
import sys
import types

import torch


class IndexFlatL2:
    def __init__(self, d: int) -> None:
        self.d = d


class IndexIVFPQ:
    def __init__(self, quantizer, d: int, nlist: int, m: int, nbits: int) -> None:
        self.d, self.nprobe, self.is_trained = d, 1, False
        self.vectors = torch.empty(0, d)

    def train(self, x: torch.Tensor) -> None:
        assert x.dim() == 2 and x.shape[1] == self.d, f"train: vectors of shape {tuple(x.shape)} for d={self.d}"
        self.is_trained = True

    def add(self, x: torch.Tensor) -> None:
        assert self.is_trained, "add before train"
        self.vectors = torch.cat([self.vectors, x.detach().float()])

    @property
    def ntotal(self) -> int:
        return len(self.vectors)

    def search(self, x: torch.Tensor, k: int, distances=None, labels=None):
        d = torch.cdist(x.float(), self.vectors) ** 2
        dist_k, idx_k = d.topk(k, dim=1, largest=False)
        if distances is not None:
            distances.copy_(dist_k)
            labels.copy_(idx_k)
        return dist_k, idx_k


def install() -> None:
    if "faiss" in sys.modules or importlib.util.find_spec("faiss") is not None:
        import faiss

        if not hasattr(faiss, "GpuIndexIVFPQ"):  # faiss-cpu: the example names it in an annotation only
            faiss.GpuIndexIVFPQ = faiss.IndexIVFPQ
        return
    faiss = types.ModuleType("faiss")
    faiss.IndexFlatL2, faiss.IndexIVFPQ, faiss.METRIC_L2 = IndexFlatL2, IndexIVFPQ, 1
    faiss.GpuIndexIVFPQ = IndexIVFPQ  # named in a type annotation only: CPU runs build IndexIVFPQ
    contrib = types.ModuleType("faiss.contrib")
    torch_utils = types.ModuleType("faiss.contrib.torch_utils")
    faiss.contrib, contrib.torch_utils = contrib, torch_utils
    sys.modules.update({"faiss": faiss, "faiss.contrib": contrib, "faiss.contrib.torch_utils": torch_utils})
