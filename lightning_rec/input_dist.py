"""Stage 1 of the sharded data path: ids travel to the ranks that own their rows.

Legend: W world size, B local batch, B_r batch of source rank r, S_p shard features of rank p,
N_p ids sent to rank p.

    features (B samples, this rank)
      | route_ids (sharding/ids.py): bucketize, remap, group by destination
      v
    all-to-all #1  counts   [W, 5]  (B, N_p, flags, L_p, step) to every rank p: tiny, equal splits
    all-to-all #2  payload  per p: lengths [L_p = S_p x B] + ids [N_p]  (int64, one buffer)
    all-to-all #3  weights  per p: [N_p]          (weighted collections only; runs with #2)
      | to_key_major (sharding/ids.py)
      v
    local KJT: this rank's shard features over the concatenated batch B_0 + ... + B_{W-1}

A variable batch (TorchRec's VBE, sparse/variable_batch.py) sends each shard feature's own bags only: its S_p bag
counts, then their L_p lengths; the owner pads the lengths back to S_p x B (sharding/variable_batch.py).

The counts exchange doubles as the agreement point: a rank whose batch failed validation sends an
error flag instead of data, every rank sees it before any payload moves, and all raise ValueError
(nobody hangs). Ranks at different steps (DistributedModelParallel's; shared memory: in the exchange's header)
raise CollectiveMismatch there too. The flags word also says whether a rank's per-id weights require a
gradient (learned weights, e.g. TorchRec's PositionWeightedModule): every rank sees every rank's flag, so all
decide alike whether the weights' backward runs. Only then does this stage have a backward:

    all-to-all #4  weight gradients  owner p -> source r: [N_r] per id p received from r  (backward)

Every rank takes part: one whose own weights need no gradient still returns those it received and
drops what comes back; one that holds no shard ties the weights to its (empty) output so its backward
reaches the exchange (sharded_embedding.py). Ids carry no gradient; without learned weights there is
no backward and no extra collective.

Ranks of one CPU host use shared memory instead (shm_transport.py): #1-#3 become one exchange,
since there a piece carries its own sizes ([B, N_p, flags] first, then lengths, ids, weights).
The embedding exchanges call torch.distributed here, in output_dist.py and shm_transport.py; their errors come
from comm.collective_error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_rec.collective_guard import GuardedWork, guard_of, step_mismatch
from lightning_rec.comm import collective_error
from lightning_rec.sharding.ids import (
    RoutedIds,
    RouteTables,
    key_major_permutation,
    route_ids,
    to_key_major,
    to_source_major,
)
from lightning_rec.sharding.variable_batch import pad_lengths, shard_strides, trim_lengths
from lightning_rec.shm_transport import SharedMemoryGroup, Writer
from lightning_rec.sparse import KeyedJaggedTensor


class BatchRejected(ValueError):
    """Another rank's batch failed validation; this rank stops before any payload moves."""


# the flags word of the counts exchange (shared memory: the third int64 of each piece's head)
REJECTED = 1  # this rank's batch failed validation: no payload follows
WEIGHT_GRAD = 2  # this rank's per-id weights require a gradient
VARIABLE_BATCH = 4  # this rank's batch is a variable one: its shard features' bag counts precede their lengths
FROZEN_SHIFT = 8  # bits from here: the key of the rank's frozen tables (0: none frozen), which every rank compares


class FrozenTablesDisagree(ValueError):
    """The ranks froze different tables of one sharded collection (raised on every rank, before any payload)."""

    def __init__(self, keys: list[int]) -> None:
        super().__init__(f"frozen-table keys per rank: {keys}")
        self.keys = keys


@dataclass
class DistContext:
    """What the way back needs to know about this step's exchange."""

    batch: int  # this rank's B
    batch_per_source: list[int]  # B_r
    ids_per_source: list[int]  # N_r: ids received from each source
    routed: RoutedIds | None  # what this rank sent (sequence outputs come back in this order)
    positions_N: Tensor | None = None  # sequence: source-major position of each key-major id
    lengths_FB: Tensor | None = None  # this rank's input lengths, feature order (mean pooling)
    weights_grad: bool = False  # some rank's weights require a gradient: every rank runs the weights' backward
    # some rank's batch is a variable one: per source r, its bags of each shard feature of this rank; and this rank's
    # bags per feature (collection order). The pooled all-to-all then sends each feature's own rows only
    strides_per_source: list[list[int]] | None = None
    strides_F: list[int] | None = None


class _Done:
    """What a synchronous (shared-memory) exchange returns where the process group returns a Work."""

    def wait(self) -> bool:
        return True


def all_to_all(pg, out: Tensor, inp: Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
               what: str, timeout_s: float | None, async_op: bool = False, host_reads: bool = False):
    """`pg`: a process group, or a SharedMemoryGroup (same-host CPU ranks; synchronous).

    A guarded group (collective_guard.py) numbers the call and waits through its guard, so a peer at
    another collective is named within seconds. `host_reads`: the host reads the result right away
    (NCCL then waits on the host too, and so can watch its peers).
    """
    try:
        if isinstance(pg, SharedMemoryGroup):
            pg.all_to_all_single(out, inp, out_splits, in_splits, tag=what)
            return _Done() if async_op else None
        guard = guard_of(pg)
        if guard is None:
            return dist.all_to_all_single(out, inp, out_splits, in_splits, group=pg, async_op=async_op)
        k = guard.begin()
        work = GuardedWork(dist.all_to_all_single(out, inp, out_splits, in_splits, group=pg, async_op=True),
                           guard, what, k, host_reads or not async_op)
    except RuntimeError as e:
        raise collective_error(what, e, timeout_s, pg) from e
    if async_op:
        return work
    work.wait()
    return None


def wait(work, what: str, timeout_s: float | None) -> None:
    try:
        work.wait()
    except RuntimeError as e:
        raise collective_error(what, e, timeout_s, getattr(getattr(work, "guard", None), "pg", None)) from e


def _pack(parts: list[Tensor]):
    """A Writer fill: the parts' bytes back to back."""

    def fill(u8: Tensor) -> None:
        at = 0
        for t in parts:
            n = t.numel() * t.element_size()
            u8[at : at + n].view(t.dtype).copy_(t)
            at += n

    return fill


class _WeightsBackward(torch.autograd.Function):
    """Forward: the received weights, as they came (with the ids). Backward: their gradient goes back to the
    ranks that sent them, in the order each sent them (`sent`'s)."""

    @staticmethod
    def forward(ctx, weights_km: Tensor, sent: Tensor, a2a: KJTAllToAll, perm: Tensor | None, lengths_src: Tensor,
                N_src: list[int], ids_per_rank: list[int]) -> Tensor:
        ctx.a2a, ctx.perm, ctx.lengths_src, ctx.N_src, ctx.ids_per_rank = a2a, perm, lengths_src, N_src, ids_per_rank
        return weights_km.clone()

    @staticmethod
    def backward(ctx, grad_km: Tensor):
        grad_km = grad_km.float().contiguous()
        grad_src = to_source_major(ctx.perm, ctx.lengths_src, grad_km) if ctx.perm is not None else grad_km
        return None, ctx.a2a.send_weights_grad(grad_src, ctx.N_src, ctx.ids_per_rank), None, None, None, None, None


class KJTAllToAll:
    """Sends each rank the ids its shards own; returns this rank's key-major local KJT."""

    def __init__(self, tables: RouteTables, pg, rank: int, device: torch.device,
                 timeout_s: float | None = None, backward_pg=None) -> None:
        self.tables = tables
        self.routing = tables.routing
        self.pg = pg
        # the weights' backward runs in the step's backward, beside the output dist's: on the model's channel even
        # when a pipeline routed the ids over its own
        self.backward_pg = pg if backward_pg is None else backward_pg
        self.rank = rank
        self.world_size = self.routing.world_size
        self.device = device
        self.timeout_s = timeout_s
        self.local_keys = self.routing.local_feature_names(rank)
        self._perm_cache: dict[tuple[int, ...], Tensor] = {}

    def __call__(self, features: KeyedJaggedTensor | None, error: str | None = None,
                 weighted: bool = False, frozen_key: int = 0,
                 strides_F: list[int] | None = None, step: int = 0) -> tuple[KeyedJaggedTensor, DistContext]:
        """`frozen_key`: which tables this rank has frozen (0: none); ranks that disagree all raise
        FrozenTablesDisagree before any payload moves (one rank alone skipping its update would diverge silently,
        one alone skipping a replica's gradient all-reduce would leave the others waiting). `strides_F`: a variable
        batch's bags per feature (collection order; `features` is it padded): each shard feature's lengths travel
        trimmed to its bags, after their count (ctx.strides_per_source, which the pooled all-to-all trims rows by).
        `step`: the caller's step (DistributedModelParallel's; routed ahead by a pipeline, the batches its steps
        claimed, or 0 on shared memory, whose step exchanges carry DMP's), compared in the counts exchange (shared
        memory: in the transport's header)."""
        routed = None if error is not None else route_ids(features, self.tables)
        B = features.stride() if routed is not None else 0
        # learned weights: requires_grad can be True under no_grad too (an unpermuted leaf), with no backward to come
        grad = (weighted and routed is not None and routed.weights_N is not None and routed.weights_N.requires_grad
                and torch.is_grad_enabled())
        if self.world_size == 1:
            exchange = self._exchange_self
        else:
            exchange = self._exchange_shm if isinstance(self.pg, SharedMemoryGroup) else self._exchange_pg
        strides_S = shard_strides(self.routing, strides_F) if strides_F is not None and routed is not None else None
        flags = (WEIGHT_GRAD if grad else 0) | (VARIABLE_BATCH if strides_S is not None else 0) | \
            (frozen_key << FROZEN_SHIFT)
        B_src, N_src, lengths_src, values_src, recv_w, bad, flags_src, strides_src = exchange(
            routed, B, weighted, flags, strides_S, step)
        if bad:
            if error is not None:
                raise ValueError(error)
            raise BatchRejected(
                f"rank(s) {bad} rejected their batch before the embedding all-to-all (see the error on those "
                f"ranks); this rank stopped too, nothing was sent or updated"
            )
        keys = [f >> FROZEN_SHIFT for f in flags_src]
        if any(k != keys[0] for k in keys):
            raise FrozenTablesDisagree(keys)
        grad_ranks = [r for r, f in enumerate(flags_src) if f & WEIGHT_GRAD]
        S_me, variable = self.routing.rank_sf_counts[self.rank], None
        if any(f & VARIABLE_BATCH for f in flags_src):  # every rank saw the same flags
            variable = [s if s is not None else [b] * S_me for s, b in zip(strides_src, B_src)]
        sequence = not self.routing.pooled
        if self.world_size == 1:  # one source: source-major is key-major, and each id stays where it is
            lengths_km, values_km, weights_km = lengths_src, values_src, recv_w
            pos = torch.arange(values_src.numel(), device=values_src.device) if sequence else None
            perm = None
        else:
            perm = self._permutation(self.routing.rank_sf_counts[self.rank], B_src)
            lengths_km, values_km, weights_km, pos = to_key_major(perm, lengths_src, values_src, recv_w, sequence)
        if grad_ranks:  # every rank: the same list came to all
            weights_km = self._with_weights_backward(routed, weights_km, perm, lengths_src, N_src)
        local = KeyedJaggedTensor(self.local_keys, values_km, weights_km, lengths=lengths_km,
                                  stride=sum(B_src), _validate=False)
        ctx = DistContext(batch=B, batch_per_source=B_src, ids_per_source=N_src, routed=routed,
                          positions_N=pos, weights_grad=bool(grad_ranks), strides_per_source=variable,
                          strides_F=None if variable is None else strides_F or [B] * len(self.routing.feature_names))
        return local, ctx

    def _with_weights_backward(self, routed: RoutedIds, weights_km: Tensor, perm: Tensor, lengths_src: Tensor,
                               N_src: list[int]) -> Tensor:
        """`weights_km` whose gradient goes back to the ranks that sent the weights (all-to-all #4)."""
        sent = routed.weights_N
        if sent is None or not sent.requires_grad:
            # this rank's weights train nothing, but the others wait for it in the backward exchange
            sent = torch.zeros(sum(routed.ids_per_rank), device=weights_km.device, requires_grad=True)
        return _WeightsBackward.apply(weights_km, sent.float(), self, perm, lengths_src, N_src,
                                      list(routed.ids_per_rank))

    def send_weights_grad(self, grad_src: Tensor, N_src: list[int], ids_per_rank: list[int]) -> Tensor:
        """Backward all-to-all #4: [N_r] to each source r -> this rank's [sum N_p], in the order it sent them."""
        what = "id weights gradient all-to-all (backward)"
        pg = self.backward_pg
        if isinstance(pg, SharedMemoryGroup):
            try:
                received = pg.exchange(list(grad_src.split(N_src)), tag=what)
            except RuntimeError as e:
                raise collective_error(what, e, self.timeout_s, pg) from e
            return torch.cat([raw.view(torch.float32) for raw in received])
        out = grad_src.new_empty(sum(ids_per_rank))
        work = all_to_all(pg, out, grad_src, ids_per_rank, N_src, what, self.timeout_s, async_op=True)
        wait(work, what, self.timeout_s)
        return out

    def _exchange_self(self, routed: RoutedIds | None, B: int, weighted: bool, flags: int, strides_S=None,
                       step: int = 0):
        """One rank: what the exchange would return, without a collective or a host read (on a GPU each step's
        counts read made the host wait for the device: no launch ahead of the kernels). The weights keep their
        autograd (no all-to-all between them and the lookup), so a gradient needs no agreement."""
        if routed is None:
            return None, None, None, None, None, [self.rank], [flags], [None]
        values = routed.values_N.long()
        recv_w = None
        if weighted:
            recv_w = routed.weights_N.float() if routed.weights_N is not None else \
                torch.ones(values.numel(), device=values.device)
        return [B], [values.numel()], routed.lengths_SB.long(), values, recv_w, [], [flags & ~WEIGHT_GRAD], [strides_S]

    def _exchange_pg(self, routed: RoutedIds | None, B: int, weighted: bool, flags: int, strides_S=None,
                       step: int = 0):
        """Through the process group: counts first (they size the receive buffers), then the payload."""
        W, S = self.world_size, self.routing.rank_sf_counts
        counts_send = torch.tensor([[0, 0, 0, 0, step]] * W, dtype=torch.long)  # B, N_p, flags, L_p, step
        if routed is None:
            counts_send[:, 2] = REJECTED
        else:
            lengths, heads, n_lengths = self._lengths_to_send(routed, B, strides_S)
            counts_send[:, 0] = B
            counts_send[:, 1] = torch.tensor(routed.ids_per_rank)
            counts_send[:, 3] = torch.tensor(n_lengths)
            if flags:  # zeros otherwise, as made
                counts_send[:, 2] = flags
        counts_send = counts_send.to(self.device)
        counts_recv = torch.empty_like(counts_send)
        all_to_all(self.pg, counts_recv, counts_send, None, None, "id counts all-to-all", self.timeout_s,
                   host_reads=True)
        counts = counts_recv.tolist()  # the one host read of the exchange: split sizes for #2 and #3
        if any(c[4] != step for c in counts):
            raise step_mismatch("id counts all-to-all", [c[4] for c in counts])
        bad = [r for r, c in enumerate(counts) if c[2] & REJECTED]
        if bad:
            return None, None, None, None, None, bad, [], []
        flags_src = [c[2] for c in counts]
        if any(f >> FROZEN_SHIFT != flags_src[0] >> FROZEN_SHIFT for f in flags_src):  # no payload: every rank raises
            return None, None, None, None, None, [], flags_src, []
        B_src = [c[0] for c in counts]
        N_src = [c[1] for c in counts]

        # payload: per destination p, (a variable batch: its shard features' bag counts) its lengths then its ids
        values = routed.values_N.long()
        pieces, l0, v0 = [], 0, 0
        for p in range(W):
            pieces += [heads[p], lengths[l0 : l0 + n_lengths[p]], values[v0 : v0 + routed.ids_per_rank[p]]]
            l0 += n_lengths[p]
            v0 += routed.ids_per_rank[p]
        send = torch.cat(pieces)
        in_splits = [heads[p].numel() + n_lengths[p] + routed.ids_per_rank[p] for p in range(W)]
        S_me = S[self.rank]
        head_src = [S_me if f & VARIABLE_BATCH else 0 for f in flags_src]
        out_splits = [h + c[3] + c[1] for h, c in zip(head_src, counts)]
        recv = send.new_empty(sum(out_splits))
        payload = all_to_all(self.pg, recv, send, out_splits, in_splits, "id all-to-all", self.timeout_s,
                             async_op=True)
        recv_w = None
        if weighted:
            weights = routed.weights_N.detach() if routed.weights_N is not None else None  # #4 is their backward
            if weights is None:
                weights = torch.ones(values.numel(), device=values.device)
            recv_w = weights.new_empty(sum(N_src))
            w_work = all_to_all(self.pg, recv_w, weights.float().contiguous(), N_src, routed.ids_per_rank,
                                "id weights all-to-all", self.timeout_s, async_op=True)
            wait(w_work, "id weights all-to-all", self.timeout_s)
        wait(payload, "id all-to-all", self.timeout_s)

        lengths_src, values_src, strides_src = [], [], []
        for part, b, h, c in zip(recv.split(out_splits), B_src, head_src, counts):
            strides_src.append(part[:h].tolist() if h else None)
            got = part[h : h + c[3]]
            lengths_src.append(pad_lengths(got, strides_src[-1], b) if h else got)
            values_src.append(part[h + c[3] :])
        return B_src, N_src, torch.cat(lengths_src), torch.cat(values_src), recv_w, [], flags_src, strides_src

    def _lengths_to_send(self, routed: RoutedIds, B: int, strides_S: list[int] | None):
        """(lengths, per destination p the bag counts sent before them, per p the number of lengths): a variable
        batch sends each shard feature's own bags only, after their counts."""
        W, S = self.world_size, self.routing.rank_sf_counts
        lengths = routed.lengths_SB.long()
        if strides_S is None:
            return lengths, [lengths[:0]] * W, [S[p] * B for p in range(W)]
        counts = torch.tensor(strides_S, dtype=torch.long, device=lengths.device)
        firsts = [sum(S[:p]) for p in range(W + 1)]
        return (trim_lengths(lengths, strides_S, B), list(counts.split(S)),
                [sum(strides_S[firsts[p] : firsts[p + 1]]) for p in range(W)])

    def _exchange_shm(self, routed: RoutedIds | None, B: int, weighted: bool, flags: int, strides_S=None,
                       step: int = 0):
        """Through shared memory: one exchange, each piece saying its own sizes (no counts round).

        Piece for rank p, int64: [B, N_p, flags], (a variable batch: bag counts [S_p]), lengths [S_p x B, or the
        counts' sum], ids [N_p]; then float32 weights [N_p] when weighted. A rank whose batch failed sends
        [0, 0, REJECTED] alone, and every rank sees that flag in the piece addressed to it.
        """
        W = self.world_size
        sends = []
        if routed is None:
            sends = [torch.tensor([0, 0, REJECTED], dtype=torch.long)] * W
        else:
            lengths, heads, n_lengths = self._lengths_to_send(routed, B, strides_S)
            values = routed.values_N.long()
            weights = None
            if weighted:
                weights = routed.weights_N.detach().float() if routed.weights_N is not None else \
                    torch.ones(values.numel())
            l0, v0 = 0, 0
            for p in range(W):
                n_l, n_v = n_lengths[p], routed.ids_per_rank[p]
                head = torch.tensor([B, n_v, flags], dtype=torch.long)
                parts = [head, heads[p], lengths[l0 : l0 + n_l], values[v0 : v0 + n_v]]
                if weights is not None:
                    parts.append(weights[v0 : v0 + n_v])
                sends.append(Writer(sum(t.numel() * t.element_size() for t in parts), _pack(parts)))
                l0, v0 = l0 + n_l, v0 + n_v
        try:
            received = self.pg.exchange(sends, tag="id all-to-all")
        except RuntimeError as e:
            raise collective_error("id all-to-all", e, self.timeout_s, self.pg) from e
        heads = [raw[:24].view(torch.long).tolist() for raw in received]
        bad = [r for r, h in enumerate(heads) if h[2] & REJECTED]
        if bad:
            return None, None, None, None, None, bad, [], []
        flags_src = [h[2] for h in heads]
        S_me = self.routing.rank_sf_counts[self.rank]
        B_src, N_src = [h[0] for h in heads], [h[1] for h in heads]
        lengths_src, values_src, weights_src, strides_src = [], [], [], []
        for raw, b, n, f in zip(received, B_src, N_src, flags_src):
            h = S_me if f & VARIABLE_BATCH else 0
            strides = raw[24 : 8 * (3 + h)].view(torch.long).tolist() if h else None
            n_l = sum(strides) if h else S_me * b
            ints = raw[: 8 * (3 + h + n_l + n)].view(torch.long)
            got = ints[3 + h : 3 + h + n_l]
            lengths_src.append(pad_lengths(got, strides, b) if h else got)
            values_src.append(ints[3 + h + n_l :])
            strides_src.append(strides)
            if weighted:
                weights_src.append(raw[8 * (3 + h + n_l + n) :].view(torch.float32))
        recv_w = torch.cat(weights_src) if weighted else None  # cat: copies out of shared memory
        return B_src, N_src, torch.cat(lengths_src), torch.cat(values_src), recv_w, [], flags_src, strides_src

    def _permutation(self, num_keys: int, batch_per_source: list[int]) -> Tensor:
        key = tuple(batch_per_source)
        perm = self._perm_cache.get(key)
        if perm is None:
            if len(self._perm_cache) > 64:  # batch sizes rarely vary; keep the cache small when they do
                self._perm_cache.clear()
            perm = key_major_permutation(num_keys, batch_per_source, self.device)
            self._perm_cache[key] = perm
        return perm
