"""Sequence encoders over jagged histories: SASRec's causal self-attention blocks and HSTU's pointwise aggregated
attention (docs/sequential.md). Both take [T, D] inputs (item embeddings + positions) and the batch's lengths and
return [T, D]; position t's output encodes the history up to and including t.

Shapes: T positions (sum of lengths), B sequences, D model dim, H heads, N the longest history (max_len)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_rec.models.jagged_attention import causal_softmax_attend, jagged_attention


def positions_from_end(lengths_B: Tensor) -> Tensor:
    """Each position's distance from its sequence's last (most recent = 0): training and evaluation histories both
    end at their newest item, so the same distance means the same recency in either."""
    total = int(lengths_B.sum())
    ends_B = torch.cumsum(lengths_B, 0)
    return torch.repeat_interleave(ends_B, lengths_B, output_size=total) - 1 - torch.arange(total,
                                                                                           device=lengths_B.device)


class SASRecBlock(nn.Module):
    """Pre-norm causal multi-head self-attention, then a pointwise two-layer feed-forward (SASRec's block)."""

    def __init__(self, dim: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"SASRec embedding_dim={dim} is not divisible by num_heads={num_heads}: choose them so")
        self.num_heads = num_heads
        self.norm_attn, self.norm_ffn = nn.LayerNorm(dim, eps=1e-8), nn.LayerNorm(dim, eps=1e-8)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(dim, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x_TD: Tensor, lengths_B: Tensor, bucketed: bool = True) -> Tensor:
        T, D = x_TD.shape
        q, k, v = self.qkv(self.norm_attn(x_TD)).view(T, 3, self.num_heads, D // self.num_heads).unbind(1)
        attn = jagged_attention(q, k, v, lengths_B, causal_softmax_attend, bucketed=bucketed).reshape(T, D)
        x_TD = x_TD + self.dropout(self.out(attn))
        return x_TD + self.dropout(self.ffn(self.norm_ffn(x_TD)))


class SASRecEncoder(nn.Module):
    def __init__(self, dim: int, num_blocks: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SASRecBlock(dim, num_heads, dropout) for _ in range(num_blocks))
        self.norm = nn.LayerNorm(dim, eps=1e-8)

    def forward(self, x_TD: Tensor, lengths_B: Tensor, timestamps_T: Tensor | None = None,
                bucketed: bool = True) -> Tensor:
        for block in self.blocks:
            x_TD = block(x_TD, lengths_B, bucketed)
        return self.norm(x_TD)


def time_bucket(dt: Tensor, num_buckets: int) -> Tensor:
    """HSTU's log-scale bucket of a time gap in seconds: floor(ln(max(|dt|, 1)) / 0.301), at most num_buckets."""
    return (torch.log(dt.abs().clamp(min=1).double()) / 0.301).long().clamp(0, num_buckets)


class HSTUAttend:
    """One bucket of HSTU's attention: SiLU(q k^T + relative position bias + relative time bias) / N, causal, times v.
    The query at i compares the time of the action after it (its own for the newest) with each key's time."""

    def __init__(self, pos_w: Tensor, ts_w: Tensor, max_len: int, num_buckets: int) -> None:
        self.pos_w, self.ts_w, self.max_len, self.num_buckets = pos_w, ts_w, max_len, num_buckets

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, times_bL: Tensor, lengths_bL: Tensor) -> Tensor:
        L, N = q.shape[2], self.max_len
        i = torch.arange(L, device=q.device)
        scores_bHLL = q @ k.transpose(-1, -2)
        rel = (N - 1 + i.unsqueeze(0) - i.unsqueeze(1)).clamp(min=0)  # [i, j] -> pos_w[N - 1 + j - i]
        # the time of the query's next action: its own where it is its sequence's newest (no future time is read)
        last_b = (lengths_bL[:, 0] - 1).clamp(min=0)
        nxt_bL = torch.minimum(i.unsqueeze(0) + 1, last_b.unsqueeze(1)).clamp(max=L - 1)
        next_t = times_bL.gather(1, nxt_bL)
        buckets = time_bucket(next_t.unsqueeze(2) - times_bL.unsqueeze(1), self.num_buckets)
        scores_bHLL = scores_bHLL + (self.pos_w[rel] + self.ts_w[buckets]).unsqueeze(1).to(scores_bHLL.dtype)
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        weights = F.silu(scores_bHLL) / N
        return weights.masked_fill(~causal, 0.0) @ v


class HSTUBlock(nn.Module):
    """HSTU's layer: U, V, Q, K = SiLU(f1(LayerNorm(x))); A(x) V pointwise; x + f2(LayerNorm(A(x) V) * U)."""

    def __init__(self, dim: int, num_heads: int, dqk: int, dv: int, max_len: int, num_buckets: int,
                 dropout: float) -> None:
        super().__init__()
        self.num_heads, self.dqk, self.dv, self.max_len, self.num_buckets = num_heads, dqk, dv, max_len, num_buckets
        self.uvqk = nn.Linear(dim, num_heads * (2 * dv + 2 * dqk))
        self.out = nn.Linear(num_heads * dv, dim)
        self.norm_in, self.norm_attn = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(num_heads * dv, eps=1e-6)
        self.pos_w = nn.Parameter(torch.empty(2 * max_len - 1).normal_(std=0.02))
        self.ts_w = nn.Parameter(torch.empty(num_buckets + 1).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x_TD: Tensor, lengths_B: Tensor, timestamps_T: Tensor, bucketed: bool = True) -> Tensor:
        T, H = x_TD.shape[0], self.num_heads
        u, v, q, k = torch.split(F.silu(self.uvqk(self.norm_in(x_TD))),
                                 [H * self.dv, H * self.dv, H * self.dqk, H * self.dqk], dim=1)
        lengths_T = torch.repeat_interleave(lengths_B, lengths_B, output_size=T)
        attend = HSTUAttend(self.pos_w, self.ts_w, self.max_len, self.num_buckets)
        attn = jagged_attention(q.view(T, H, self.dqk), k.view(T, H, self.dqk), v.view(T, H, self.dv), lengths_B,
                                attend, extras=(timestamps_T, lengths_T), bucketed=bucketed)
        return x_TD + self.out(self.dropout(u * self.norm_attn(attn.reshape(T, H * self.dv))))


class HSTUEncoder(nn.Module):
    def __init__(self, dim: int, num_blocks: int, num_heads: int, dqk: int, dv: int, max_len: int,
                 num_buckets: int, dropout: float) -> None:
        super().__init__()
        if max_len < 1:
            raise ValueError(f"HSTU max_len={max_len}: give the longest history the model sees (>= 1)")
        self.blocks = nn.ModuleList(HSTUBlock(dim, num_heads, dqk, dv, max_len, num_buckets, dropout)
                                    for _ in range(num_blocks))

    def forward(self, x_TD: Tensor, lengths_B: Tensor, timestamps_T: Tensor, bucketed: bool = True) -> Tensor:
        if lengths_B.numel() and int(lengths_B.max()) > self.blocks[0].max_len:
            raise ValueError(f"HSTU got a history of {int(lengths_B.max())} items, longer than its max_len "
                             f"{self.blocks[0].max_len}: set the model's max_len to the data module's")
        for block in self.blocks:
            x_TD = block(x_TD, lengths_B, timestamps_T, bucketed)
        return x_TD


def scale_inputs(emb_TD: Tensor) -> Tensor:
    """SASRec's and HSTU's input scaling of item embeddings, by sqrt(D), before positions are added."""
    return emb_TD * math.sqrt(emb_TD.shape[-1])
