"""Multi-task rankers over the sharded sparse part of DLRM: a shared bottom, MMoE or PLE, then one tower per task.

    shared_bottom  one MLP over the input, every tower reads it
    mmoe           num_experts MLPs over the input; task t reads softmax(gate_t(x)) . experts(x)   (Ma et al. 2018)
    ple            num_levels CGC layers of shared and per-task experts; task t's gate mixes its own experts and
                   the shared ones, a shared gate mixes them all for the next level                 (Tang et al. 2020)

MMoE is one CGC layer with no task experts. The input is the sparse features' pooled embeddings [B, F D] beside
the dense arch's output (when there are dense features). With `esmm`, task 1's output is the logit of
p(task 0) * p(task 1 | task 0), learnt on every row (Ma et al. 2018, ESMM)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_rec.embedding import EmbeddingBagCollection
from lightning_rec.models.dlrm import MLP, SparseArch, check_dense_width
from lightning_rec.sparse import KeyedJaggedTensor

MIXES = ("shared_bottom", "mmoe", "ple")


def _mix(gate_BE: Tensor, experts_BEH: Tensor) -> Tensor:
    return (torch.softmax(gate_BE, dim=-1).unsqueeze(-1) * experts_BEH).sum(1)


class CGCLayer(nn.Module):
    """One PLE level: shared experts and each task's own; inputs and outputs are the T tasks' then the shared one
    (the shared one only where `last` is False)."""

    def __init__(self, in_features: int, num_tasks: int, num_shared: int, num_per_task: int,
                 expert_layer_sizes: Sequence[int], last: bool) -> None:
        super().__init__()
        self.shared = nn.ModuleList(MLP(in_features, expert_layer_sizes) for _ in range(num_shared))
        self.per_task = nn.ModuleList(nn.ModuleList(MLP(in_features, expert_layer_sizes) for _ in range(num_per_task))
                                      for _ in range(num_tasks))
        self.task_gates = nn.ModuleList(nn.Linear(in_features, num_per_task + num_shared) for _ in range(num_tasks))
        self.shared_gate = None if last else nn.Linear(in_features, num_tasks * num_per_task + num_shared)

    def forward(self, inputs: list[Tensor]) -> list[Tensor]:
        shared_BSH = torch.stack([e(inputs[-1]) for e in self.shared], 1)
        own = [torch.stack([e(inputs[t]) for e in experts], 1) if len(experts) else shared_BSH[:, :0]
               for t, experts in enumerate(self.per_task)]
        outs = [_mix(gate(inputs[t]), torch.cat([own[t], shared_BSH], 1)) for t, gate in enumerate(self.task_gates)]
        if self.shared_gate is not None:
            outs.append(_mix(self.shared_gate(inputs[-1]), torch.cat([*own, shared_BSH], 1)))
        return outs


def esmm_logit(first_B: Tensor, second_B: Tensor) -> Tensor:
    """logit(sigmoid(a) * sigmoid(b)), from log-probabilities (no underflow for small products)."""
    log_p = (F.logsigmoid(first_B) + F.logsigmoid(second_B)).clamp(max=-1e-7)
    # log(1 - p) = log1mexp(log p): log(-expm1(x)) near 0, log1p(-exp(x)) below -ln 2
    log_q = torch.where(log_p > -0.6931, torch.log(-torch.expm1(log_p)), torch.log1p(-torch.exp(log_p)))
    return log_p - log_q


class MultiTaskNet(nn.Module):
    """Sparse (and dense) features -> [B, T] outputs: logits of binary tasks, values of regression tasks.

    Args:
        embedding_bag_collection: the sparse features' tables (all of one dim D).
        dense_in_features: the number of dense inputs (0: none).
        dense_arch_layer_sizes: the dense inputs' MLP (dense_in_features > 0).
        num_tasks: T.
        mix: "shared_bottom", "mmoe" or "ple".
        expert_layer_sizes: each expert's MLP (the shared bottom's, for shared_bottom).
        num_experts: MMoE's experts.
        num_shared_experts, num_task_experts, num_levels: PLE's shared experts, experts per task, CGC levels.
        tower_layer_sizes: each task tower's hidden sizes (a last layer of 1 is added).
        esmm: task 1's output is the logit of p(task 0) p(task 1 | task 0)."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection, dense_in_features: int,
                 dense_arch_layer_sizes: Sequence[int], num_tasks: int, mix: str, expert_layer_sizes: Sequence[int],
                 num_experts: int = 4, num_shared_experts: int = 2, num_task_experts: int = 1, num_levels: int = 2,
                 tower_layer_sizes: Sequence[int] = (32,), esmm: bool = False) -> None:
        super().__init__()
        if mix not in MIXES:
            raise ValueError(f"unknown mix {mix!r}: choose one of {', '.join(MIXES)}")
        self.sparse_arch = SparseArch(embedding_bag_collection)
        self.dense_in_features = dense_in_features
        self.dense_arch = MLP(dense_in_features, dense_arch_layer_sizes) if dense_in_features > 0 else None
        in_features = self.sparse_arch.num_features * self.sparse_arch.embedding_dim
        in_features += dense_arch_layer_sizes[-1] if self.dense_arch is not None else 0
        self.mix, self.num_tasks, self.esmm = mix, num_tasks, esmm
        hidden = expert_layer_sizes[-1]
        self.bottom = MLP(in_features, expert_layer_sizes) if mix == "shared_bottom" else None
        levels = [] if mix == "shared_bottom" else [
            CGCLayer(in_features, num_tasks, num_experts, 0, expert_layer_sizes, last=True)] if mix == "mmoe" else [
            CGCLayer(in_features if lvl == 0 else hidden, num_tasks, num_shared_experts, num_task_experts,
                     expert_layer_sizes, last=lvl == num_levels - 1) for lvl in range(num_levels)]
        self.levels = nn.ModuleList(levels)
        self.towers = nn.ModuleList(MLP(hidden, [*tower_layer_sizes, 1], last_activation=False)
                                    for _ in range(num_tasks))

    def forward(self, dense_features: Tensor, sparse_features: KeyedJaggedTensor) -> Tensor:
        check_dense_width("MultiTaskNet", self.dense_in_features, dense_features)  # Criteo's 13 were once dropped
        return self.from_pooled(dense_features, self.sparse_arch(sparse_features))

    def from_pooled(self, dense_features: Tensor, sparse_BFD: Tensor) -> Tensor:
        """[B, T] from the features' pooled embeddings (a serving package's own lookup gives them)."""
        x_BK = sparse_BFD.flatten(1)
        if self.dense_arch is not None:
            x_BK = torch.cat([self.dense_arch(dense_features), x_BK], dim=1)
        if self.bottom is not None:
            per_task = [self.bottom(x_BK)] * self.num_tasks
        else:
            per_task = [x_BK] * (self.num_tasks + 1)
            for level in self.levels:
                per_task = level(per_task)
        out_BT = torch.cat([tower(h) for tower, h in zip(self.towers, per_task)], dim=1)
        if self.esmm:
            out_BT = torch.cat([out_BT[:, :1], esmm_logit(out_BT[:, 0], out_BT[:, 1]).unsqueeze(1), out_BT[:, 2:]], 1)
        return out_BT
