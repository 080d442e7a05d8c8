"""TorchRec's example two-tower model (its examples/retrieval/modules/two_tower.py: `TwoTower(embedding_bag_collection,
layer_sizes, device)` and `TwoTowerTrainTask`), over our collection and MLP.

TorchRec ships this model in its examples, not in the `torchrec` package; the example file itself ports by its import
prefix. lightning_rec's own `TwoTower` (lightning_rec.models) takes a collection per tower, scores by dot or cosine
and trains with in-batch softmax or BPR (docs/movielens.md)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_rec.embedding import EmbeddingBagCollection
from lightning_rec.sparse import KeyedJaggedTensor
from lightning_rec.torchrec.modules.mlp import MLP


class TwoTower(nn.Module):
    """One collection of two tables (query first, candidate second, of one dim), an MLP per tower:
    `forward(kjt)` -> (query_BD, candidate_BD)."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, layer_sizes: Sequence[int],
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        if len(configs) != 2 or configs[0].embedding_dim != configs[1].embedding_dim:
            raise ValueError(f"TwoTower takes a collection of two tables of one embedding dim (query, candidate); "
                             f"got {[(c.name, c.embedding_dim) for c in configs]}: build the collection so")
        dim = configs[0].embedding_dim
        self._feature_names_query = list(configs[0].feature_names)
        self._candidate_feature_names = list(configs[1].feature_names)
        self.ebc = embedding_bag_collection
        self.query_proj = MLP(in_size=dim, layer_sizes=list(layer_sizes), device=device)
        self.candidate_proj = MLP(in_size=dim, layer_sizes=list(layer_sizes), device=device)

    def forward(self, kjt: KeyedJaggedTensor) -> tuple[Tensor, Tensor]:
        pooled = self.ebc(kjt)
        query = self.query_proj(torch.cat([pooled[f] for f in self._feature_names_query], dim=1))
        candidate = self.candidate_proj(torch.cat([pooled[f] for f in self._candidate_feature_names], dim=1))
        return query, candidate


class TwoTowerTrainTask(nn.Module):
    """`task(batch)` -> (loss, (loss, logits, labels)), all but loss detached: BCE-with-logits of the towers' dot."""

    def __init__(self, two_tower: TwoTower) -> None:
        super().__init__()
        self.two_tower = two_tower
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        query, candidate = self.two_tower(batch.sparse_features)
        logits = (query * candidate).sum(dim=1).squeeze()
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


__all__ = ["TwoTower", "TwoTowerTrainTask"]
