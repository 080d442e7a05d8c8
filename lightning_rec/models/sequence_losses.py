"""Next-item losses of sequential models: full softmax over the catalog, and sampled softmax (in-batch + uniform
negatives with the logQ correction) for catalogs too big for a T x I logit matrix (docs/sequential.md#losses).

Shapes: T positions with a target, I items, C candidates (T in-batch targets, then U uniform draws), D dim."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

LOSSES = ("softmax", "sampled_softmax")


def full_softmax_loss(h_TD: Tensor, items_ID: Tensor, targets_T: Tensor, temperature: float = 1.0) -> Tensor:
    """Cross-entropy of each position's next item against every item of the catalog."""
    logits_TI = (h_TD.float() @ items_ID.float().t()) / temperature
    return F.cross_entropy(logits_TI, targets_T)


def candidate_log_q(item_counts_I: Tensor, candidates_C: Tensor, num_in_batch: int, num_uniform: int) -> Tensor:
    """log of each candidate's expected count among the C candidates: num_in_batch draws from the training
    frequency (the batch's targets) plus num_uniform uniform draws."""
    p_I = item_counts_I.double() / item_counts_I.sum().clamp(min=1)
    expected = num_in_batch * p_I[candidates_C] + num_uniform / item_counts_I.shape[0]
    return torch.log(expected.clamp(min=1e-12)).float()


def sampled_softmax_loss(h_TD: Tensor, cand_CD: Tensor, candidates_C: Tensor, targets_T: Tensor,
                         log_q_C: Tensor | None = None, temperature: float = 1.0) -> Tensor:
    """Cross-entropy of position t's next item (candidate t) against the other candidates: the batch's other targets
    and the uniform draws. A candidate that is the position's own item elsewhere (an accidental hit) is left out;
    log_q_C (None: no correction) is subtracted from every logit (the logQ correction)."""
    T = targets_T.shape[0]
    logits_TC = (h_TD.float() @ cand_CD.float().t()) / temperature
    if log_q_C is not None:
        logits_TC = logits_TC - log_q_C.unsqueeze(0)
    hit_TC = candidates_C.unsqueeze(0) == targets_T.unsqueeze(1)
    hit_TC[torch.arange(T, device=hit_TC.device), torch.arange(T, device=hit_TC.device)] = False
    return F.cross_entropy(logits_TC.masked_fill(hit_TC, float("-inf")), torch.arange(T, device=h_TD.device))
