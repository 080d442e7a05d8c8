"""Top-K ranking metrics on torchmetrics: NDCG@K, Recall@K, Precision@K, MRR@K, HitRate@K (definitions, the
ways in, and how they differ from torchmetrics: docs/movielens.md#evaluation).

Shapes: U users in one update (one batch of users), I items in the catalogue, C candidates per
user, K the largest cutoff asked for, R held-out (relevant) items of the batch, X excluded ones.

    target_offsets_U1 = [0, 2, 2, 5]    user 0: target_items[0:2], user 1: none, user 2: [2:5]

The full-ranking and candidate forms are reduced at once to each user's top K, so nothing larger than one batch
of users x items exists. States are float64 sums per (metric, cutoff 1..max(ks)) and user counts, whatever ks and
empty_target_action say (a MetricCollection shares equal states), reduced with "sum" over ranks."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

from lightning_rec.errors import is_int

RANKING_METRICS = ("ndcg", "recall", "precision", "mrr", "hit_rate")
EMPTY_TARGET_ACTIONS = ("skip", "neg", "pos", "error")  # torchmetrics' values, with its meaning


class _Unset:
    """top_k's default, told apart from torchmetrics' top_k=None (every item: no cutoff here, refused)."""

    def __repr__(self) -> str:
        return "unset"


UNSET = _Unset()


def _cutoffs(ks: int | Sequence[int] | None, top_k: int | None | _Unset,
             default: int | Sequence[int]) -> tuple[int, ...]:
    """`ks`, or torchmetrics' `top_k` (RetrievalNormalizedDCG(top_k=10)): one name for the cutoffs."""
    if top_k is None:
        raise ValueError("top_k=None is torchmetrics' 'every item of each list', which is no cutoff here: give "
                         "top_k=K (the length of the longest list ranks them all) or ks=[...]")
    if not isinstance(top_k, _Unset):
        if ks is not None:
            raise ValueError(f"ks={ks!r} and top_k={top_k!r}: give one of them (top_k is torchmetrics' name for one "
                             f"cutoff, ks takes one or a list)")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"top_k={top_k!r}: give an int >= 1 (every item ranked is not a cutoff here: use the "
                             f"largest list length)")
        ks = top_k
    return _as_ks(default if ks is None else ks)


def _as_ks(ks: int | Sequence[int]) -> tuple[int, ...]:
    ks_t = tuple(ks) if isinstance(ks, (list, tuple, range, set, frozenset)) else (ks,)
    if not ks_t or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in ks_t):
        raise ValueError(f"ks={ks!r}: give one cutoff or a list of them, each an int >= 1 (e.g. ks=[10, 20])")
    return tuple(sorted(set(ks_t)))


def _rows_of(offsets_U1: Tensor, num_users: int, name: str) -> Tensor:
    """CSR offsets -> the row (user) of every entry: [0, 2, 2, 5] -> [0, 0, 2, 2, 2]."""
    offsets_U1 = offsets_U1.reshape(-1).long()
    if offsets_U1.numel() != num_users + 1:
        raise ValueError(f"{name} has {offsets_U1.numel()} entries for {num_users} users: give U + 1 offsets "
                         f"starting at 0 (user u's items are items[offsets[u]:offsets[u+1]])")
    lengths_U = offsets_U1.diff()
    if int(offsets_U1[0]) != 0 or bool((lengths_U < 0).any()):
        raise ValueError(f"{name} must start at 0 and never decrease, got {offsets_U1.tolist()[:8]}...")
    return torch.repeat_interleave(torch.arange(num_users, device=offsets_U1.device), lengths_U)


def _check_items(items: Tensor, num_items: int, name: str) -> Tensor:
    items = items.reshape(-1).long()
    if items.numel() and (int(items.min()) < 0 or int(items.max()) >= num_items):
        bad = items[(items < 0) | (items >= num_items)][:5].tolist()
        raise ValueError(f"{name} holds item ids {bad} outside the {num_items} scored items (0..{num_items - 1}): "
                         f"score every item of the catalogue (an item never seen in training still needs a row)")
    return items


def _check_flat(preds_N: Tensor, target_N: Tensor, indexes_N: Tensor) -> None:
    if indexes_N.dtype.is_floating_point or indexes_N.dtype == torch.bool or indexes_N.is_complex():
        raise ValueError(f"indexes must be integer ids (whose list each entry belongs to, as in torchmetrics' "
                         f"retrieval metrics), got {indexes_N.dtype}; a bool mask of [U, C] candidates goes as mask=")
    if not (preds_N.shape == target_N.shape == indexes_N.shape):
        raise ValueError(f"update(preds, target, indexes) takes three tensors of one shape (one entry per user and "
                         f"candidate), got {tuple(preds_N.shape)}, {tuple(target_N.shape)}, {tuple(indexes_N.shape)}")
    if target_N.dtype != torch.bool and bool(((target_N != 0) & (target_N != 1)).any()):
        raise ValueError("target must be 0/1 relevance (graded ratings: binarize them first, e.g. "
                         "`target = rating >= 4`; entries to leave out: ignore_index=their value)")


def _padded_by_query(preds_N: Tensor, target_N: Tensor, indexes_N: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """torchmetrics' flat retrieval form -> [U, C] candidate lists padded to the longest, and their mask.

        indexes_N = [7, 3, 7, 3, 3]       preds_UC = [[p1, p3, p4],     (user 3: entries 1, 3, 4)
        preds_N   = [p0 .. p4]                        [p0, p2, -- ]]    (user 7: entries 0, 2)"""
    preds_N, target_N, indexes_N = preds_N.reshape(-1), target_N.reshape(-1), indexes_N.reshape(-1)
    order_N = torch.argsort(indexes_N, stable=True)
    _, count_U = torch.unique_consecutive(indexes_N[order_N], return_counts=True)
    num_users, N = count_U.numel(), indexes_N.numel()
    C = int(count_U.max()) if num_users else 0
    user_N = torch.repeat_interleave(torch.arange(num_users, device=preds_N.device), count_U)
    slot_N = torch.arange(N, device=preds_N.device) - (count_U.cumsum(0) - count_U)[user_N]
    preds_UC = preds_N.new_zeros(num_users, C)
    target_UC = target_N.new_zeros(num_users, C)
    mask_UC = torch.zeros(num_users, C, dtype=torch.bool, device=preds_N.device)
    preds_UC[user_N, slot_N] = preds_N[order_N]
    target_UC[user_N, slot_N] = target_N[order_N]
    mask_UC[user_N, slot_N] = True
    return preds_UC, target_UC, mask_UC


class RankingMetrics(Metric):
    """NDCG, Recall, Precision, MRR and HitRate at several cutoffs, from one top-K per user batch.

    Args:
        ks: the cutoffs, e.g. [10, 20]; the top max(ks) items are taken once for all of them.
        top_k: torchmetrics' name for one cutoff (`NDCG(top_k=10)` = `NDCG(ks=10)`).
        metrics: a subset of ("ndcg", "recall", "precision", "mrr", "hit_rate").
        prefix: put before each name in `compute()`'s dict ("val_" -> "val_ndcg@10").
        empty_target_action: what a user with no relevant item counts for, as in torchmetrics: "skip" (left
            out; our default), "neg" (0; torchmetrics' default), "pos" (1) or "error" (compute() raises).
        ignore_index: as in torchmetrics, a target value whose entries are left out (e.g. -100 for padding).
        adaptive_k, aggregation: torchmetrics' arguments, taken at their defaults only (False, "mean").

    `compute()` returns {"ndcg@10": tensor, ...}, ready for `LightningModule.log_dict`."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, ks: int | Sequence[int] | None = None, metrics: Sequence[str] = RANKING_METRICS,
                 prefix: str = "", top_k: int | None | _Unset = UNSET, empty_target_action: str = "skip",
                 ignore_index: int | None = None, adaptive_k: bool = False, aggregation: str = "mean",
                 **kwargs) -> None:
        # torchmetrics' retrieval arguments: ignore_index is honoured, the two others refused
        if adaptive_k:
            raise ValueError("adaptive_k=True (Precision@k over min(k, the user's candidates)) is not computed here: "
                             "Precision@k divides by k (torchmetrics' adaptive_k=False); give candidate lists of at "
                             "least k items, or read Recall@k / HitRate@k")
        if aggregation != "mean":
            raise ValueError(f"aggregation={aggregation!r}: the metrics here are means over users (torchmetrics' "
                             f"aggregation='mean'), kept as sums synced over ranks; for a median or another "
                             f"aggregate use torchmetrics.retrieval")
        if ignore_index is not None and not is_int(ignore_index):
            raise ValueError(f"ignore_index={ignore_index!r}: give the int target value to leave out (e.g. -100), "
                             f"or None")
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.ks = _cutoffs(ks, top_k, default=(10,))
        if empty_target_action not in EMPTY_TARGET_ACTIONS:
            raise ValueError(f"empty_target_action={empty_target_action!r}: choose one of "
                             f"{', '.join(map(repr, EMPTY_TARGET_ACTIONS))} (what a user with no relevant item counts "
                             f"for, as in torchmetrics)")
        self.empty_target_action = empty_target_action
        if isinstance(metrics, str):
            metrics = (metrics,)
        unknown = [m for m in metrics if m not in RANKING_METRICS]
        if unknown or not metrics:
            raise ValueError(f"unknown ranking metrics {unknown or metrics!r}: choose from {list(RANKING_METRICS)}")
        self.metric_names = tuple(dict.fromkeys(metrics))
        self.prefix = prefix
        self._warned_short = False
        # the same states whatever ks and empty_target_action say: a MetricCollection shares equal states
        shape = (len(RANKING_METRICS), self.max_k)
        self.add_state("sums", default=torch.zeros(shape, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("evaluated_users", default=torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("empty_users", default=torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("nan_scores", default=torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        # the flat form's entries, kept until compute (a user's list may span updates), all float64 (torchmetrics'
        # empty placeholder's dtype): an id as its high and low 32 bits, exact in float64
        for name in ("flat_preds", "flat_target", "flat_indexes", "flat_indexes_low"):
            self.add_state(name, default=[], dist_reduce_fx="cat")
        self._dtype = torch.float64

    @property
    def max_k(self) -> int:
        return self.ks[-1]

    @property
    def num_users(self) -> Tensor:
        """The users the means are over: those with a relevant item, and under "neg" / "pos" those without."""
        counted = self.empty_target_action in ("neg", "pos")
        return self.evaluated_users + self.empty_users if counted else self.evaluated_users

    @property
    def skipped_users(self) -> Tensor:
        """Users without a relevant item left out of the means ("skip"; "error" raises for them)."""
        return self.empty_users if self.empty_target_action in ("skip", "error") else torch.zeros_like(self.empty_users)

    # ways in -----------------------------------------------------------------------------------

    def update(self, preds: Tensor | None = None, target: Tensor | None = None, indexes: Tensor | None = None, *,
               mask: Tensor | None = None, target_offsets: Tensor | None = None, target_items: Tensor | None = None,
               exclude_offsets: Tensor | None = None, exclude_items: Tensor | None = None,
               hits: Tensor | None = None, num_relevant: Tensor | None = None) -> None:
        """Candidate lists: `update(preds_UC, target_UC, mask=mask_UC)`; torchmetrics' flat form: `update(preds_N,
        target_N, indexes_N)`. The other keywords are what `update_full` and `update_topk` pass (every way in goes
        through `update`, which torchmetrics wraps)."""
        if hits is not None:
            self._update_topk(hits, num_relevant)
        elif target_offsets is not None:
            self._update_full(preds, target_offsets, target_items, exclude_offsets, exclude_items)
        elif indexes is not None:
            if mask is not None:
                raise ValueError("update(preds, target, indexes) takes no mask: leave out the entries to skip")
            if preds is None or target is None:
                raise ValueError("update(preds, target, indexes) needs all three, one entry per user and candidate")
            if self.ignore_index is not None and preds.shape == target.shape == indexes.shape:
                kept = target != self.ignore_index  # torchmetrics drops these entries before anything else
                preds, target, indexes = preds[kept], target[kept], indexes[kept]
            _check_flat(preds, target, indexes)
            if indexes.numel():  # (an empty batch has no user: nothing to count)
                self.flat_preds.append(preds.detach().reshape(-1).double())
                self.flat_target.append((target.reshape(-1) != 0).double())
                indexes = indexes.reshape(-1).long()
                self.flat_indexes.append((indexes >> 32).double())
                self.flat_indexes_low.append((indexes & 0xFFFFFFFF).double())
        else:
            self._update_candidates(preds, target, mask)

    def update_full(self, scores_UI: Tensor, target_offsets: Tensor, target_items: Tensor,
                    exclude_offsets: Tensor | None = None, exclude_items: Tensor | None = None) -> None:
        """Full ranking of a batch of users against every item; a user's `exclude_items` are pushed to -inf."""
        self.update(scores_UI, target_offsets=target_offsets, target_items=target_items,
                    exclude_offsets=exclude_offsets, exclude_items=exclude_items)

    def update_topk(self, hits_UK: Tensor, num_relevant_U: Tensor) -> None:
        """The reduced form: hits_UK[u, j] = is the item user u ranks j-th relevant (j < K; rows may be
        shorter than max(ks): missing ranks count as misses), and each user's number of relevant items."""
        self.update(hits=hits_UK, num_relevant=num_relevant_U)

    def _update_candidates(self, preds: Tensor, target: Tensor, mask: Tensor | None) -> None:
        if preds is None or target is None:
            raise ValueError("update(preds, target) needs both: [U, C] scores and 0/1 relevance of the candidates")
        if preds.dim() == 1:
            preds, target = preds.unsqueeze(0), target.reshape(1, -1)
            mask = None if mask is None else mask.reshape(1, -1)
        if preds.dim() != 2 or target.shape != preds.shape or (mask is not None and mask.shape != preds.shape):
            raise ValueError(f"update(preds, target, mask) takes [U, C] tensors of one shape (a row of candidates "
                             f"per user), got preds {tuple(preds.shape)}, target {tuple(target.shape)}"
                             + ("" if mask is None else f", mask {tuple(mask.shape)}"))
        if self.ignore_index is not None and target.dtype != torch.bool:
            ignored = target == self.ignore_index  # no candidate at all: masked out, as padding is
            mask = ~ignored if mask is None else mask.bool() & ~ignored
            target = target.masked_fill(ignored, 0)
        if target.dtype != torch.bool:
            if bool(((target != 0) & (target != 1)).any()):
                raise ValueError("target must be 0/1 relevance (graded ratings: binarize them first, e.g. "
                                 "`target = rating >= 4`; entries to leave out: ignore_index=their value)")
            target = target != 0
        scores = preds.detach().float()
        if mask is not None:
            mask = mask.bool()
            scores = scores.masked_fill(~mask, float("-inf"))
            target = target & mask
        self._update_ranked(scores, target)

    def _update_full(self, scores_UI: Tensor, target_offsets: Tensor, target_items: Tensor,
                     exclude_offsets: Tensor | None, exclude_items: Tensor | None) -> None:
        if scores_UI is None or target_items is None:
            raise ValueError("full ranking needs scores [U, I], target_offsets [U + 1] and target_items")
        if scores_UI.dim() != 2:
            raise ValueError(f"scores must be [users, items], got shape {tuple(scores_UI.shape)}")
        num_users, num_items = scores_UI.shape
        target_items = _check_items(target_items, num_items, "target_items")
        rows_R = _rows_of(target_offsets, num_users, "target_offsets")
        if rows_R.numel() != target_items.numel():
            raise ValueError(f"target_offsets end at {rows_R.numel()} but there are {target_items.numel()} "
                             f"target_items: the last offset must equal the number of items")
        target_UI = torch.zeros(num_users, num_items, dtype=torch.bool, device=scores_UI.device)
        target_UI[rows_R, target_items] = True
        scores_UI = scores_UI.detach().float()
        if exclude_items is not None:
            if exclude_offsets is None:
                raise ValueError("exclude_items needs exclude_offsets (U + 1 CSR offsets)")
            exclude_items = _check_items(exclude_items, num_items, "exclude_items")
            rows_X = _rows_of(exclude_offsets, num_users, "exclude_offsets")
            if rows_X.numel() != exclude_items.numel():
                raise ValueError(f"exclude_offsets end at {rows_X.numel()} but there are {exclude_items.numel()} "
                                 f"exclude_items: the last offset must equal the number of items")
            # a held-out item is never excluded, even if it was also seen in training (as RecBole does)
            keep_X = ~target_UI[rows_X, exclude_items]
            scores_UI = scores_UI.index_put((rows_X[keep_X], exclude_items[keep_X]),
                                            torch.tensor(float("-inf"), device=scores_UI.device))
        self._update_ranked(scores_UI, target_UI)

    def _update_ranked(self, scores_UC: Tensor, target_UC: Tensor) -> None:
        num_candidates = scores_UC.shape[1]
        k = min(self.max_k, num_candidates)
        if k < self.max_k and not self._warned_short:
            self._warned_short = True
            warnings.warn(f"K={self.max_k} is larger than the {num_candidates} items ranked per user: every item is "
                          f"in the top {self.max_k} (Recall@K is then 1 for every user, Precision@K still divides "
                          f"by K as in torchmetrics); use ks <= {num_candidates} for meaningful values",
                          UserWarning, stacklevel=3)
        # topk ranks NaN first: here it ranks last and is never a hit (counted on the device, said at compute)
        nan_UC = torch.isnan(scores_UC)
        self.nan_scores += nan_UC.sum()
        scores_UC = scores_UC.masked_fill(nan_UC, float("-inf"))
        top_UK = torch.topk(scores_UC, k, dim=1, sorted=True).indices
        hits_UK = target_UC.gather(1, top_UK) & ~nan_UC.gather(1, top_UK)
        self._update_topk(hits_UK, target_UC.sum(1))

    def _update_topk(self, hits_UK: Tensor, num_relevant_U: Tensor | None) -> None:
        if num_relevant_U is None or hits_UK.dim() != 2 or num_relevant_U.reshape(-1).numel() != hits_UK.shape[0]:
            raise ValueError(f"update_topk takes hits [U, K] and num_relevant [U], got {tuple(hits_UK.shape)} and "
                             f"{tuple(num_relevant_U.shape)}")
        num_relevant_U = num_relevant_U.reshape(-1).to(torch.float64)
        has_target_U = num_relevant_U > 0
        self.empty_users += (~has_target_U).sum()  # what they count for is empty_target_action's, at compute
        hits_UK, num_relevant_U = hits_UK[has_target_U].to(torch.float64), num_relevant_U[has_target_U]
        self.evaluated_users += hits_UK.shape[0]
        K = self.max_k
        if hits_UK.shape[1] < K:
            hits_UK = torch.nn.functional.pad(hits_UK, (0, K - hits_UK.shape[1]))
        hits_UK = hits_UK[:, :K]
        device = hits_UK.device
        rank_K = torch.arange(1, K + 1, device=device, dtype=torch.float64)
        discount_K = 1.0 / torch.log2(rank_K + 1)
        cum_hits_UK = hits_UK.cumsum(1)
        dcg_UK = (hits_UK * discount_K).cumsum(1)
        first_UK = hits_UK * (cum_hits_UK == 1)  # the first relevant rank only
        reciprocal_UK = (first_UK / rank_K).cumsum(1)
        ideal_K = discount_K.cumsum(0)  # IDCG@k of a user with n relevant: ideal_K[min(n, k) - 1]

        # every cutoff k = 1..K (column k - 1); compute() reads the asked ones
        n_ideal_UK = torch.minimum(num_relevant_U.unsqueeze(1), rank_K).long() - 1
        per_user = {"ndcg": dcg_UK / ideal_K[n_ideal_UK], "recall": cum_hits_UK / num_relevant_U.unsqueeze(1),
                    "precision": cum_hits_UK / rank_K, "mrr": reciprocal_UK,
                    "hit_rate": (cum_hits_UK > 0).to(torch.float64)}
        self.sums += torch.stack([per_user[m].sum(0) for m in RANKING_METRICS]).to(self.sums.device)

    # way out ------------------------------------------------------------------------------------

    def compute(self) -> dict[str, Tensor]:
        sums, evaluated, empty = self.sums, int(self.evaluated_users), int(self.empty_users)
        nan_scores = int(self.nan_scores)
        if len(self.flat_indexes):  # every rank's entries (synced by "cat"), grouped per user once, here
            flat = RankingMetrics(ks=self.ks)
            indexes = (dim_zero_cat(self.flat_indexes).long() << 32) | dim_zero_cat(self.flat_indexes_low).long()
            if indexes.numel():
                flat._update_candidates(*_padded_by_query(dim_zero_cat(self.flat_preds).float(),
                                                          dim_zero_cat(self.flat_target).bool(), indexes))
            sums = sums + flat.sums.to(sums.device)
            evaluated, empty = evaluated + int(flat.evaluated_users), empty + int(flat.empty_users)
            nan_scores = nan_scores + int(flat.nan_scores)  # said as in the other forms
        if nan_scores:
            warnings.warn(f"{nan_scores} of the scores are NaN: ranked last and never counted as found; "
                          f"check the model for divergence", UserWarning, stacklevel=2)
        if empty and self.empty_target_action == "error":
            raise ValueError(f"{empty} users have no relevant (held-out) item and empty_target_action='error': "
                             f"pass empty_target_action='skip' to leave them out, 'neg' to count them as 0 "
                             f"(torchmetrics' default) or 'pos' as 1, or evaluate only users with a held-out item")
        num_users, skipped = evaluated, empty
        if self.empty_target_action in ("neg", "pos"):  # such a user counts, as 0 or 1 for every metric and k
            num_users, skipped = evaluated + empty, 0
            if self.empty_target_action == "pos":
                sums = sums + empty
        if num_users == 0:
            warnings.warn(f"no user with a held-out item was evaluated ({skipped} skipped): "
                          f"ranking metrics are NaN", UserWarning, stacklevel=2)
        means = sums / num_users if num_users else torch.full_like(sums, float("nan"))
        out = {}
        for name in self.metric_names:
            row = RANKING_METRICS.index(name)
            for k in self.ks:
                out[f"{self.prefix}{name}@{k}"] = means[row, k - 1]
        return out


class _OneRankingMetric(RankingMetrics):
    """One metric: compute() gives a tensor for a single k, a dict {"ndcg@10": ...} for several."""

    _name = ""

    def __init__(self, ks: int | Sequence[int] | None = None, top_k: int | None | _Unset = UNSET, **kwargs) -> None:
        super().__init__(ks=_cutoffs(ks, top_k, default=10), metrics=(self._name,), **kwargs)

    def compute(self) -> Tensor | dict[str, Tensor]:
        out = super().compute()
        return next(iter(out.values())) if len(self.ks) == 1 else out


class NDCG(_OneRankingMetric):
    """Normalized discounted cumulative gain at k (binary relevance)."""

    _name = "ndcg"


class Recall(_OneRankingMetric):
    """Share of a user's held-out items found in the top k."""

    _name = "recall"


class Precision(_OneRankingMetric):
    """Share of the top k that is relevant (denominator k)."""

    _name = "precision"


class MRR(_OneRankingMetric):
    """Reciprocal rank of the first relevant item within the top k (0 if none)."""

    _name = "mrr"


class HitRate(_OneRankingMetric):
    """Share of users with at least one relevant item in the top k."""

    _name = "hit_rate"
