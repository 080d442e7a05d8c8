"""Two-tower retrieval (TorchRec's TwoTower idea): a user tower and an item tower, scored by a dot product.

Shapes: B pairs in a batch, I items in the catalogue, D the towers' output dim.

    user KJT --user EmbeddingBagCollection--> pooled [B, sum D_f] --MLP--> user_BD  \\
                                                                                      > score = <u, v> (/ temperature)
    item KJT --item EmbeddingBagCollection--> pooled [B, sum D_f] --MLP--> item_BD  /

`score="cosine"` normalises both vectors first. The towers' tables shard like any other under strategy="rec". With
no MLP and id features only, the model is matrix factorisation (BPR-MF with `loss="bpr"`).

Losses on a batch of positive pairs:

    softmax  in-batch sampled softmax: every other item of the batch is a negative for a user;
             logits_BB = s(u_b, v_j) - log q_j (logQ correction: q_j the chance that item j is in a
             batch, its training frequency; Yi et al., RecSys 2019), an item that is the same as the
             positive (an accidental hit) is masked, cross-entropy on the diagonal
    bpr      -log sigmoid(s(u, v_pos) - s(u, v_neg)) with one sampled negative per pair (Rendle 2009)"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_rec.embedding import EmbeddingBagCollection
from lightning_rec.models.dlrm import MLP
from lightning_rec.sparse import KeyedJaggedTensor

SCORES = ("dot", "cosine")
LOSSES = ("softmax", "bpr")


class Tower(nn.Module):
    """KJT -> pooled embeddings of every feature, concatenated -> MLP (none when layer_sizes is empty). The
    collection may be a ManagedCollisionEmbeddingBagCollection: raw ids read through its id maps.

    `skip_feature` (e.g. "user_id") adds that feature's embedding to the MLP's output (docs/movielens.md#the-model):
    out_BD = emb_id_BD + MLP(concat(every feature)). `dropout` acts on the MLP's input and between its layers."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, layer_sizes: Sequence[int] = (),
                 skip_feature: str | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        self.embedding_bag_collection = embedding_bag_collection
        tables = getattr(embedding_bag_collection, "_embedding_module", embedding_bag_collection)  # managed: its tables
        dims = {f: c.embedding_dim for c in tables.embedding_bag_configs() for f in c.feature_names}
        in_features = sum(dims.values())
        layer_sizes = list(layer_sizes)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.mlp: nn.Module = (MLP(in_features, layer_sizes, last_activation=False, dropout=dropout)
                               if layer_sizes else nn.Identity())
        self.out_features = layer_sizes[-1] if layer_sizes else in_features
        self.skip_feature = skip_feature
        if skip_feature is not None:
            if skip_feature not in dims:
                raise ValueError(f"skip_feature {skip_feature!r} is not a feature of the tower's collection: choose "
                                 f"one of {', '.join(dims)}")
            if not layer_sizes:
                raise ValueError(f"skip_feature {skip_feature!r} adds the id embedding to an MLP's output, but the "
                                 f"tower has no MLP: give layer sizes ending in {dims[skip_feature]}, or no skip")
            if dims[skip_feature] != self.out_features:
                raise ValueError(f"skip_feature {skip_feature!r} has dim {dims[skip_feature]} but the MLP ends in "
                                 f"{self.out_features}: make the last layer size {dims[skip_feature]}")

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        pooled = self.embedding_bag_collection(features)  # fused TBE (sharded under "rec")
        if isinstance(pooled, tuple):  # a ManagedCollisionEmbeddingBagCollection: (pooled, remapped ids or None)
            pooled = pooled[0]
        out_BD = self.mlp(pooled.values())
        if self.skip_feature is not None:
            out_BD = out_BD + pooled[self.skip_feature]
        return out_BD


class TwoTower(nn.Module):
    """User tower + item tower; `forward(user_kjt, item_kjt)` -> (user_BD, item_BD), ready to score."""

    def __init__(self, user_embedding_bag_collection: EmbeddingBagCollection,
                 item_embedding_bag_collection: EmbeddingBagCollection, user_layer_sizes: Sequence[int] = (),
                 item_layer_sizes: Sequence[int] = (), score: str = "dot", user_skip_feature: str | None = None,
                 item_skip_feature: str | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"unknown score {score!r}: choose one of {', '.join(SCORES)}")
        self.user_tower = Tower(user_embedding_bag_collection, user_layer_sizes, user_skip_feature, dropout)
        self.item_tower = Tower(item_embedding_bag_collection, item_layer_sizes, item_skip_feature, dropout)
        if self.user_tower.out_features != self.item_tower.out_features:
            raise ValueError(f"the towers must end in the same dim to be scored: user tower gives "
                             f"{self.user_tower.out_features}, item tower {self.item_tower.out_features}; make the "
                             f"last layer sizes (or the embedding dims of towers without MLP) equal")
        self.score = score

    def _finish(self, x_BD: Tensor) -> Tensor:
        return F.normalize(x_BD, dim=-1) if self.score == "cosine" else x_BD

    def user_embeddings(self, user_features: KeyedJaggedTensor) -> Tensor:
        return self._finish(self.user_tower(user_features))

    def item_embeddings(self, item_features: KeyedJaggedTensor) -> Tensor:
        return self._finish(self.item_tower(item_features))

    def forward(self, user_features: KeyedJaggedTensor, item_features: KeyedJaggedTensor) -> tuple[Tensor, Tensor]:
        return self.user_embeddings(user_features), self.item_embeddings(item_features)


def in_batch_softmax_loss(user_BD: Tensor, item_BD: Tensor, item_index_B: Tensor,
                          item_log_q_B: Tensor | None = None, temperature: float = 1.0) -> Tensor:
    """Sampled softmax over the batch's items, logQ-corrected, accidental hits masked (see module doc)."""
    logits_BB = (user_BD / temperature) @ item_BD.t()  # dividing [B, D] is cheaper than [B, B]
    if item_log_q_B is not None:
        logits_BB = logits_BB - item_log_q_B.unsqueeze(0)  # an item seen often is a negative often: discount it
    # an item that is the positive itself elsewhere in the batch is no negative (an accidental hit)
    same_item_BB = item_index_B.unsqueeze(0) == item_index_B.unsqueeze(1)
    same_item_BB.fill_diagonal_(False)
    # the dtype's lowest finite value: -inf gives NaN gradients, -1e9 does not fit float16
    logits_BB = logits_BB.masked_fill(same_item_BB, torch.finfo(logits_BB.dtype).min)
    return F.cross_entropy(logits_BB, torch.arange(logits_BB.shape[0], device=logits_BB.device))


def bpr_loss(user_BD: Tensor, pos_BD: Tensor, neg_BD: Tensor, temperature: float = 1.0) -> Tensor:
    diff_B = ((user_BD * pos_BD).sum(-1) - (user_BD * neg_BD).sum(-1)) / temperature
    return -F.logsigmoid(diff_B).mean()
