"""DLRM, DLRM-DCNv2 and DLRM-Projection (TorchRec's module layout; a TorchRec DLRM's state dict loads by its own names).

Shapes: B batch, F sparse features, D embedding dim (= the dense arch's last layer), I dense inputs.

    dense_BI  --dense_arch-->  dense_BD ----------------\
                                                         >-- interaction --> over_arch --> logits_BK
    KJT --sparse_arch (EmbeddingBagCollection)--> sparse_BFD

Dot interaction (DLRM): the pairwise dot products of the F+1 vectors (dense + each feature),
upper triangle without the diagonal, next to the dense vector: D + (F+1)F/2 features.
DCNv2 interaction: the F+1 vectors flattened, through low-rank cross layers
x_{l+1} = x_0 * (U_l (V_l x_l) + b_l) + x_l: (F+1)D features."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_rec.embedding import EmbeddingBagCollection
from lightning_rec.models import fused_interaction
from lightning_rec.sparse import KeyedJaggedTensor


class _Activation(nn.Module):
    """A tensor function (torch.relu, a lambda) as a layer."""

    def __init__(self, fn: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x)


def _activation(activation: Any) -> nn.Module:
    """One layer's activation: "relu" / "sigmoid" or torch's function, a module (shared), a module class or other
    zero-argument factory (one per layer), or any tensor function (TorchRec's MLP takes the same)."""
    named = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, torch.relu: nn.ReLU, torch.sigmoid: nn.Sigmoid}
    if isinstance(activation, str) or activation in named:
        if activation not in named:
            raise ValueError(f"activation={activation!r}: give 'relu', 'sigmoid', a module or a tensor function")
        return named[activation]()
    if isinstance(activation, nn.Module):
        return activation
    if isinstance(activation, type) and issubclass(activation, nn.Module):
        return activation()
    if not callable(activation):
        raise ValueError(f"activation={activation!r}: give 'relu', 'sigmoid', a module or a tensor function")
    try:
        made = activation()
    except TypeError:  # it takes the tensor: a tensor function
        return _Activation(activation)
    if not isinstance(made, nn.Module):
        raise ValueError(f"activation {activation!r} called with no argument gave a {type(made).__name__}, not a "
                         f"module: give a tensor function or a factory of modules")
    return made


class MLP(nn.Sequential):
    """Linear + activation (ReLU) per layer; the last layer without activation when `last_activation=False`.
    dropout > 0: on the input and after every hidden layer's activation (none after the last layer). `bias`,
    `activation` (see _activation), `device` and `dtype` as TorchRec's MLP; lightning_rec.torchrec.modules.mlp.MLP
    takes TorchRec's argument order."""

    def __init__(self, in_features: int, layer_sizes: Sequence[int], last_activation: bool = True,
                 dropout: float = 0.0, *, bias: bool = True, activation: Any = "relu",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        layers: list[nn.Module] = [nn.Dropout(dropout)] if dropout else []
        for i, out_features in enumerate(layer_sizes):
            last = i == len(layer_sizes) - 1
            layers.append(nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype))
            if last_activation or not last:
                layers.append(_activation(activation))
            if dropout and not last:
                layers.append(nn.Dropout(dropout))
            in_features = out_features
        super().__init__(*layers)


class SparseArch(nn.Module):
    """KJT -> sparse_BFD: every feature's pooled embedding, all of one dim."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__()
        self.embedding_bag_collection = embedding_bag_collection
        # a ManagedCollisionEmbeddingBagCollection reads raw ids into the tables it holds
        tables = getattr(embedding_bag_collection, "_embedding_module", embedding_bag_collection)
        dims = {c.embedding_dim for c in tables.embedding_bag_configs()}
        if len(dims) != 1:
            raise ValueError(f"DLRM needs every table to have the same embedding_dim, got {sorted(dims)}: "
                             f"set one embedding_dim for all tables")
        self.embedding_dim = dims.pop()
        # TorchRec's name (subclasses of its DLRM read len(self.sparse_arch.sparse_feature_names)): the output's order
        self.sparse_feature_names: list[str] = list(tables.feature_names())
        self.num_features = len(self.sparse_feature_names)

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        pooled = self.embedding_bag_collection(features)
        if isinstance(pooled, tuple):  # a ManagedCollisionEmbeddingBagCollection: (pooled, remapped ids or None)
            pooled = pooled[0]
        pooled_BFxD = pooled.values()
        return pooled_BFxD.view(-1, self.num_features, self.embedding_dim)


def check_dense_width(model: str, expected: int, dense_features: Tensor) -> None:
    """A model's dense inputs must be the batch's dense columns, [B, expected]: none left unread."""
    if dense_features.dim() != 2 or dense_features.shape[1] != expected:
        raise ValueError(f"{model} was built for {expected} dense features but the batch has dense features of shape "
                         f"{tuple(dense_features.shape)}: build it with dense_in_features="
                         f"{dense_features.shape[-1]} (the data's dense columns), or fix the data")


class InteractionArch(nn.Module):
    """Pairwise dot products of dense and sparse vectors (upper triangle), next to the dense vector.

    fused: on CPU (float32 / float64, eager) one kernel computes only the pairs, forward and backward
    (benchmarks/interaction.py); False keeps the composed ops (bmm of all N x N products, then the triangle)."""

    def __init__(self, num_sparse_features: int, fused: bool = True) -> None:
        super().__init__()
        self.fused = fused
        n = num_sparse_features + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("triu_rows", rows, persistent=False)
        self.register_buffer("triu_cols", cols, persistent=False)

    def output_dim(self, embedding_dim: int) -> int:
        return embedding_dim + self.triu_rows.numel()

    def forward(self, dense_features: Tensor, sparse_features: Tensor) -> Tensor:
        # TorchRec's argument names (its DLRM.forward passes them by keyword): dense [B, D], sparse [B, F, D]
        dense_BD, sparse_BFD = dense_features, sparse_features
        if self.fused and fused_interaction.use_fused(dense_BD, sparse_BFD):
            return fused_interaction.dot_interaction(dense_BD, sparse_BFD)
        vectors_BND = torch.cat([dense_BD.unsqueeze(1), sparse_BFD], dim=1)
        dots_BNN = torch.bmm(vectors_BND, vectors_BND.transpose(1, 2))
        pairs_BP = dots_BNN[:, self.triu_rows, self.triu_cols]
        return torch.cat([dense_BD, pairs_BP], dim=1)


class LowRankCrossNet(nn.Module):
    """DCNv2's cross layers with a low-rank weight W = U V (U: [K, r], V: [r, K]).

    The composed ops (Linear with bias, mul, add): a one-pass epilogue did not beat them on CPU, where the two GEMMs
    take nearly all the time."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int = 1) -> None:
        super().__init__()
        if num_layers < 1 or low_rank < 1:
            raise ValueError(f"DCN needs num_layers >= 1 and low_rank >= 1, got {num_layers}, {low_rank}")
        self.V = nn.ModuleList(nn.Linear(in_features, low_rank, bias=False) for _ in range(num_layers))
        self.U = nn.ModuleList(nn.Linear(low_rank, in_features) for _ in range(num_layers))

    def forward(self, x0_BK: Tensor) -> Tensor:
        x_BK = x0_BK
        for V, U in zip(self.V, self.U):
            x_BK = x0_BK * U(V(x_BK)) + x_BK
        return x_BK


class InteractionDCNArch(nn.Module):
    def __init__(self, num_sparse_features: int, embedding_dim: int, num_layers: int, low_rank: int) -> None:
        super().__init__()
        self.in_features = (num_sparse_features + 1) * embedding_dim
        self.crossnet = LowRankCrossNet(self.in_features, num_layers, low_rank)

    def output_dim(self, embedding_dim: int) -> int:
        return self.in_features

    def forward(self, dense_features: Tensor, sparse_features: Tensor) -> Tensor:
        # TorchRec's argument names (its DLRM.forward passes them by keyword): dense [B, D], sparse [B, F, D]
        dense_BD, sparse_BFD = dense_features, sparse_features
        x0_BK = torch.cat([dense_BD.unsqueeze(1), sparse_BFD], dim=1).flatten(1)
        return self.crossnet(x0_BK)


class InteractionProjectionArch(nn.Module):
    """DLRM-Projection's interaction (TorchRec's): two MLP branches read the F+1 vectors flattened; the first's output
    is F1 vectors of dim D ([B, F1, D]), the second's a [B, D, F2] block; their F1 x F2 products, next to the dense
    vector: D + F1 F2 features."""

    def __init__(self, num_sparse_features: int, interaction_branch1: nn.Module,
                 interaction_branch2: nn.Module) -> None:
        super().__init__()
        self.F = num_sparse_features
        self.interaction_branch1 = interaction_branch1
        self.interaction_branch2 = interaction_branch2

    def output_dim(self, embedding_dim: int) -> int:
        projected = [[m for m in branch if isinstance(m, nn.Linear)][-1].out_features // embedding_dim
                     for branch in (self.interaction_branch1, self.interaction_branch2)]
        return embedding_dim + projected[0] * projected[1]

    def forward(self, dense_features: Tensor, sparse_features: Tensor) -> Tensor:
        # TorchRec's argument names (its DLRM.forward passes them by keyword): dense [B, D], sparse [B, F, D]
        dense_BD, sparse_BFD = dense_features, sparse_features
        B, D = dense_BD.shape
        x_BK = torch.cat([dense_BD.unsqueeze(1), sparse_BFD], dim=1).reshape(B, -1)
        # TorchRec's reshapes: the second branch's output is read as [B, D, F2] directly (no transpose)
        y_BF1D = self.interaction_branch1(x_BK).reshape(B, -1, D)
        z_BDF2 = self.interaction_branch2(x_BK).reshape(B, D, -1)
        return torch.cat([dense_BD, torch.bmm(y_BF1D, z_BDF2).reshape(B, -1)], dim=1)


class DLRM(nn.Module):
    """DLRM: dense arch, embedding bags, dot interaction, over arch -> logits [B, over_arch_layer_sizes[-1]].

    Args:
        embedding_bag_collection: the sparse features' tables (all of one dim D).
        dense_in_features: I, the number of dense inputs.
        dense_arch_layer_sizes: MLP sizes for the dense inputs; the last must equal D.
        over_arch_layer_sizes: MLP sizes after the interaction; the last is the number of logits per sample.
        dense_device: where the dense layers are built (None: the default device); the tables stay where they are."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, dense_in_features: int,
                 dense_arch_layer_sizes: Sequence[int], over_arch_layer_sizes: Sequence[int],
                 dense_device: torch.device | str | None = None) -> None:
        super().__init__()
        self.sparse_arch = SparseArch(embedding_bag_collection)
        D = self.sparse_arch.embedding_dim
        if not dense_arch_layer_sizes or dense_arch_layer_sizes[-1] != D:
            raise ValueError(f"the dense arch's last layer ({list(dense_arch_layer_sizes)}) must equal the "
                             f"embedding_dim {D}: make them the same")
        if not over_arch_layer_sizes:
            raise ValueError("over_arch_layer_sizes is empty: give the over arch's layer sizes, the last one the "
                             "number of logits per sample (e.g. [512, 256, 1])")
        self.dense_arch = MLP(dense_in_features, dense_arch_layer_sizes)
        self.inter_arch = self._interaction(self.sparse_arch.num_features, D)
        self.over_arch = MLP(self.inter_arch.output_dim(D), over_arch_layer_sizes, last_activation=False)
        if dense_device is not None:
            for arch in (self.dense_arch, self.inter_arch, self.over_arch):
                arch.to(dense_device)
        self._register_load_state_dict_pre_hook(self._rename_torchrec_keys)

    def torchrec_names(self) -> dict[str, tuple[str, tuple[int, ...] | None]]:
        """TorchRec's name of each dense parameter -> (ours, our shape where TorchRec's differs; else None).

        TorchRec's DenseArch is `model._mlp.<i>._linear`, its OverArch `model.0._mlp.<i>._linear` then `model.1`,
        its LowRankCrossNet `W_kernels.<l>` [K, r], `V_kernels.<l>` [r, K], `bias.<l>` [K, 1]: our U.<l>.weight,
        V.<l>.weight and U.<l>.bias. The same layers and arithmetic, so a TorchRec DLRM's state dict loads as is."""
        names: dict[str, tuple[str, tuple[int, ...] | None]] = {}

        def linears(arch: nn.Sequential) -> list[int]:
            return [i for i, layer in enumerate(arch) if isinstance(layer, nn.Linear)]

        for i, at in enumerate(linears(self.dense_arch)):
            for p in ("weight", "bias"):
                names[f"dense_arch.model._mlp.{i}._linear.{p}"] = (f"dense_arch.{at}.{p}", None)
        *hidden, last = linears(self.over_arch)
        for i, at in enumerate(hidden):
            for p in ("weight", "bias"):
                names[f"over_arch.model.0._mlp.{i}._linear.{p}"] = (f"over_arch.{at}.{p}", None)
        for p in ("weight", "bias"):
            names[f"over_arch.model.1.{p}"] = (f"over_arch.{last}.{p}", None)
        for branch in ("interaction_branch1", "interaction_branch2"):
            arch = getattr(self.inter_arch, branch, None)
            for i, at in enumerate(linears(arch) if arch is not None else []):
                for p in ("weight", "bias"):
                    names[f"inter_arch.{branch}.model._mlp.{i}._linear.{p}"] = (f"inter_arch.{branch}.{at}.{p}", None)
        crossnet = getattr(self.inter_arch, "crossnet", None)
        if crossnet is not None:
            for layer, U in enumerate(crossnet.U):
                names[f"inter_arch.crossnet.W_kernels.{layer}"] = (f"inter_arch.crossnet.U.{layer}.weight", None)
                names[f"inter_arch.crossnet.V_kernels.{layer}"] = (f"inter_arch.crossnet.V.{layer}.weight", None)
                names[f"inter_arch.crossnet.bias.{layer}"] = (f"inter_arch.crossnet.U.{layer}.bias",
                                                              tuple(U.bias.shape))
        return names

    def _rename_torchrec_keys(self, state_dict, prefix, *args) -> None:
        # load_state_dict's pre-hook: TorchRec's dense names become ours
        for key in [k for k in state_dict if k.startswith((prefix + "interaction_branch1.",
                                                           prefix + "interaction_branch2."))]:
            if prefix + "inter_arch." + key[len(prefix):] in state_dict:
                state_dict.pop(key)
        for theirs, (ours, shape) in self.torchrec_names().items():
            if prefix + theirs in state_dict and prefix + ours not in state_dict:
                value = state_dict.pop(prefix + theirs)
                if shape is not None and value.numel() == torch.Size(shape).numel():
                    value = value.reshape(shape)  # else load_state_dict names the size mismatch
                state_dict[prefix + ours] = value

    def _interaction(self, num_features: int, embedding_dim: int) -> nn.Module:
        return InteractionArch(num_features)

    def forward(self, dense_features: Tensor, sparse_features: KeyedJaggedTensor) -> Tensor:
        check_dense_width("DLRM", self.dense_arch[0].in_features, dense_features)
        if isinstance(sparse_features, KeyedJaggedTensor) and dense_features.shape[0] != sparse_features.stride():
            raise ValueError(f"the batch has {dense_features.shape[0]} rows of dense features but "
                             f"{sparse_features.stride()} samples of sparse features (the KeyedJaggedTensor's stride): "
                             f"give both the same samples (a KJT's lengths hold stride() entries per key)")
        dense_BD = self.dense_arch(dense_features)
        sparse_BFD = self.sparse_arch(sparse_features)
        return self.over_arch(self.inter_arch(dense_BD, sparse_BFD))


class DLRM_DCN(DLRM):
    """DLRM with DCNv2 low-rank cross layers as the interaction (MLPerf's DLRM-DCNv2)."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, dense_in_features: int,
                 dense_arch_layer_sizes: Sequence[int], over_arch_layer_sizes: Sequence[int],
                 dcn_num_layers: int = 3, dcn_low_rank_dim: int = 64,
                 dense_device: torch.device | str | None = None) -> None:
        self._dcn = (dcn_num_layers, dcn_low_rank_dim)
        super().__init__(embedding_bag_collection, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes,
                         dense_device)

    def _interaction(self, num_features: int, embedding_dim: int) -> nn.Module:
        return InteractionDCNArch(num_features, embedding_dim, *self._dcn)


class DLRM_Projection(DLRM):
    """DLRM with a projection interaction (TorchRec's DLRM_Projection): two MLP branches over the F+1 vectors.

    interaction_branch{1,2}_layer_sizes: each branch's MLP sizes, each last a multiple of D (F1 D, F2 D: F1 x F2)."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, dense_in_features: int,
                 dense_arch_layer_sizes: Sequence[int], over_arch_layer_sizes: Sequence[int],
                 interaction_branch1_layer_sizes: Sequence[int], interaction_branch2_layer_sizes: Sequence[int],
                 dense_device: torch.device | str | None = None) -> None:
        self._branches = (list(interaction_branch1_layer_sizes), list(interaction_branch2_layer_sizes))
        super().__init__(embedding_bag_collection, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes,
                         dense_device)

    def _interaction(self, num_features: int, embedding_dim: int) -> nn.Module:
        for name, sizes in zip(("interaction_branch1_layer_sizes", "interaction_branch2_layer_sizes"), self._branches):
            if not sizes or sizes[-1] % embedding_dim:
                raise ValueError(f"{name}={sizes} must end in a multiple of the embedding_dim {embedding_dim} (the "
                                 f"branch's output is read as vectors of that dim): e.g. {2 * embedding_dim}")
        in_features = (num_features + 1) * embedding_dim
        return InteractionProjectionArch(num_features, MLP(in_features, self._branches[0]),
                                         MLP(in_features, self._branches[1]))


class DLRMTrain(nn.Module):
    """TorchRec's training wrapper: `model(batch)` -> (loss, (loss, logits, labels)), all but loss detached. The loss
    is BCE-with-logits (batch mean), the pair TrainPipelineSparseDist expects; `batch` has dense_features,
    sparse_features and labels."""

    def __init__(self, dlrm_module: DLRM) -> None:
        super().__init__()
        self.model = dlrm_module
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        logits_B = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        labels_B = batch.labels.to(logits_B.dtype)  # integer click labels are fine: BCE needs floats
        loss = self.loss_fn(logits_B, labels_B)
        return loss, (loss.detach(), logits_B.detach(), labels_B.detach())
