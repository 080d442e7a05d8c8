"""Same-host CPU collectives through shared memory; gloo only sets the group up (docs/distributed.md).

Each rank writes its bytes once into its own /dev/shm region (not through gloo's TCP), all ranks pass one barrier,
and each copies out its part. Legend: W ranks in the group, k the exchange counter (the same on every rank), slot k % 2.

    rank r, exchange k:
      write   its pieces -> own region, slot k%2; header[k%2] = (generation, op, ok, size, call-site
              tag, (start, end) of the piece for each destination)
      barrier csrc/shm_barrier.cpp: counters in shared memory (release / acquire); honours the
              group's timeout and notices a dead peer (/proc) within ~50 ms
      read    every peer's header (the same decision on every rank); copy peer p's bytes for r out

Double buffering makes one barrier per exchange enough (slot k%2 is written again after barrier k+1). A region too
small is replaced by a larger file (generation + 1), mapped by peers in the same exchange; without room in /dev/shm
that exchange goes through the process group. Headers carry op, sizes and call site: disagreeing ranks raise
CollectiveMismatch."""

from __future__ import annotations

import importlib.util
import math
import mmap
import os
import socket
import sys
import uuid
import warnings
import weakref
import zlib

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_rec.collective_guard import (
    CollectiveGuard,
    CollectiveMismatch,
    CollectiveTimeout,
    PeerExited,
    step_mismatch,
)

__all__ = ["CollectiveMismatch", "SharedMemoryGroup", "Writer", "ddp_comm_hook"]

SHM_DIR = "/dev/shm"
_ALIGN = 64
_OP_ALL_TO_ALL, _OP_ALL_REDUCE, _OP_EXCHANGE = 1, 2, 3
# header fields; step: the caller's (DistributedModelParallel's step); spans: (start, end) bytes per destination
_GEN, _OP, _OK, _SIZE, _TAG, _STEP, _SPANS = 0, 1, 2, 3, 4, 5, 6
_TAG_NAMES: dict[int, str] = {}  # what each call site calls its collective (the same code runs on every rank)
# a rank's header file, int64: [0] its barrier counter (a cache line of its own), [8] its pid, [16:] the slots'
_ARRIVE, _PID, _SLOTS = 0, 8, 16
_INITIAL_BYTES = 1 << 20


def _library_dirs() -> tuple[str, ...]:
    """lightning_rec's, torch's and Lightning's folders (found without importing Lightning)."""
    dirs = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__))]
    for name in ("lightning", "pytorch_lightning", "lightning_fabric"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            dirs.append(os.path.dirname(os.path.abspath(spec.origin)))
    return tuple(d.rstrip(os.sep) + os.sep for d in dirs)


def _user_stacklevel() -> int:
    """The `stacklevel` (for the caller's warning) of the first frame outside lightning_rec, torch and Lightning."""
    frame, level, library = sys._getframe(1), 1, _library_dirs()
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(library):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _starts(splits: list[int], row_bytes: int) -> list[int]:
    out, at = [], 0
    for n in splits:
        out.append(at)
        at += n * row_bytes
    return out


def _bytes(t: Tensor) -> Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class Writer:
    """A send that writes itself: `fill(u8)` fills a uint8 view of exactly `nbytes` bytes."""

    __slots__ = ("nbytes", "fill")

    def __init__(self, nbytes: int, fill) -> None:
        self.nbytes, self.fill = nbytes, fill

    def write(self, u8: Tensor) -> None:
        self.fill(u8)


def _layout(pieces: list) -> list[int]:
    """(start, end) in bytes of each piece written back to back from 64-byte aligned starts."""
    spans, at = [], 0
    for piece in pieces:
        n = 0 if piece is None else _nbytes(piece)
        spans += [at, at + n]
        at = _align(at + n)
    return spans


def _tag_id(tag: str) -> int:
    tag_id = zlib.crc32(tag.encode())
    _TAG_NAMES[tag_id] = tag
    return tag_id


def _signature(sizes: list[int]) -> int:
    h = 0
    for n in sizes:
        h = (h * 1_000_003 + n) % (2**61 - 1)
    return h


def _nbytes(piece: Tensor | Writer) -> int:
    return piece.nbytes if isinstance(piece, Writer) else piece.numel() * piece.element_size()


def _materialize(piece: Tensor | Writer) -> Tensor:
    if isinstance(piece, Writer):
        u8 = torch.empty(piece.nbytes, dtype=torch.uint8)
        piece.write(u8)
        return u8
    return _bytes(piece)


class _Region:
    """A mapped /dev/shm file as a uint8 tensor (the mmap stays alive as long as the tensor)."""

    def __init__(self, path: str, nbytes: int, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, nbytes)  # reserve now: ENOSPC here, never SIGBUS on a later write
            self._mmap = mmap.mmap(fd, nbytes)
        except OSError:
            if create:  # a file we could not fill is nobody's: no name left behind in /dev/shm
                SharedMemoryGroup._unlink(path)
            raise
        finally:
            os.close(fd)
        self.path, self.nbytes = path, nbytes
        self.u8 = torch.frombuffer(self._mmap, dtype=torch.uint8)


class SharedMemoryGroup:
    """all_to_all_single / all_reduce for ranks of `pg` that share a host, through /dev/shm. `create(pg)` (collective)
    returns None when the ranks cannot share memory: callers then keep using the process group."""

    shrink_after = 512  # exchanges in a row using under a quarter of a region before it is replaced by a smaller one

    def __init__(self, pg, session: str, timeout_s: float | None) -> None:
        self.pg, self.session, self.timeout_s = pg, session, timeout_s
        self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
        W = self.world_size
        self._header_len = _SPANS + 2 * W
        # headers: own, [2 slots, header_len] int64, fixed for the group's life
        self._headers = _Region(self._path("h", self.rank, 0), self._header_bytes(), create=True)
        self._header, self._arrive = self._header_views(self._headers)
        self._headers.u8.view(torch.int64)[_PID] = os.getpid()
        self._arrivals: list[Tensor] = []  # every rank's counter (own included), for the barrier
        self._pids: list[int] = []  # peers' pids when this process can see them (/proc): dead peers fail fast
        self._gen = 0
        self._data = _Region(self._path("d", self.rank, 0), 2 * _INITIAL_BYTES, create=True)
        self._k = 0
        self._unlink_after: list[tuple[str, int]] = []  # (path, exchange after whose barrier peers have it)
        self._finalizer = weakref.finalize(self, _unlink_all, self._unlink_after)
        self._peer_headers: dict[int, Tensor] = {}
        self._peer_arrive: dict[int, Tensor] = {}
        self._peer_pid: dict[int, int] = {}
        self._peer_data: dict[int, tuple[int, _Region]] = {}  # rank -> (generation, region)
        self.disabled = False
        self.fallbacks = 0  # exchanges that went through the process group (/dev/shm had no room for one)
        self._no_room_from: int | None = None  # the smallest slot size /dev/shm refused: not tried again
        self._small_run, self._small_peak = 0, 0  # exchanges in a row under a quarter of a slot, their largest
        # set by DistributedModelParallel: past its grace, the barrier asks where the peers are (collective_guard.py)
        self.guard: CollectiveGuard | None = None
        self.timeout_setting = "DistributedModelParallel(timeout=...)"  # how messages name timeout_s
        self._tag = ""
        self.step = 0  # DistributedModelParallel's step, carried by every exchange: ranks at different steps raise

    # set-up ------------------------------------------------------------------------------------

    def _header_bytes(self) -> int:
        return (_SLOTS + 2 * self._header_len) * 8

    def _header_views(self, region: _Region) -> tuple[Tensor, Tensor]:
        flat = region.u8.view(torch.int64)
        return flat[_SLOTS:].view(2, self._header_len), flat[_ARRIVE : _ARRIVE + 1]

    def _path(self, kind: str, rank: int, gen: int) -> str:
        return os.path.join(SHM_DIR, f"lightning_rec-{self.session}-{kind}{rank}-g{gen}")

    @classmethod
    def create(cls, pg, timeout_s: float | None = None) -> SharedMemoryGroup | None:
        """Collective: every rank of `pg` calls it; all get a group, or all get None."""
        rank, W = dist.get_rank(pg), dist.get_world_size(pg)
        box = [f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:10]}" if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
        group, ok = None, 1
        try:
            group = cls(pg, box[0], timeout_s)
            group._header[:, _GEN] = -1  # "mapped and alive": peers check it below
        except OSError:
            ok = 0
        flag = torch.tensor([ok], dtype=torch.int32)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=pg)
            if flag.item():
                try:  # can every rank see every other rank's region? (same host and the same /dev/shm)
                    for p in range(W):
                        if p != rank:
                            group._open_peer_headers(p)
                            if int(group._peer_headers[p][0, _GEN]) != -1:
                                ok = 0
                except OSError:
                    ok = 0
                flag.fill_(ok)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=pg)  # also: every peer has mapped our files
        finally:  # a peer that died (or Ctrl-C) in between left this rank's names in /dev/shm for good
            if group is not None:
                group._unlink(group._headers.path)
                group._unlink(group._data.path)
        if group is not None:
            group._header[:, _GEN] = 0
            if flag.item():
                group._arrivals = [group._arrive if p == rank else group._peer_arrive[p] for p in range(W)]
                pids = [os.getpid() if p == rank else group._peer_pid[p] for p in range(W)]
                group._pids = pids if all(os.path.exists(f"/proc/{pid}") for pid in pids) else []
        dist.barrier(group=pg)
        return group if flag.item() else None

    def _open_peer_headers(self, p: int) -> None:
        region = _Region(self._path("h", p, 0), self._header_bytes(), create=False)
        self._peer_headers[p], arrive = self._header_views(region)
        self._peer_arrive[p] = arrive
        self._peer_pid[p] = int(region.u8.view(torch.int64)[_PID])
        self._peer_data[p] = (0, _Region(self._path("d", p, 0), 2 * _INITIAL_BYTES, create=False))

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    # collectives ---------------------------------------------------------------------------------

    def all_to_all_single(self, out: Tensor, inp: Tensor, out_splits: list[int] | None = None,
                          in_splits: list[int] | None = None, tag: str = "all_to_all_single") -> None:
        """As dist.all_to_all_single (splits in rows of dim 0; None: equal), synchronous."""
        W = self.world_size
        in_row = math.prod(inp.shape[1:]) * inp.element_size()
        out_row = math.prod(out.shape[1:]) * out.element_size()
        in_splits = in_splits if in_splits is not None else [inp.shape[0] // W] * W
        out_splits = out_splits if out_splits is not None else [out.shape[0] // W] * W
        # as torch.distributed checks: splits that do not add up to the tensor's rows would leave rows unwritten
        for what, t, splits in (("in", inp, in_splits), ("out", out, out_splits)):
            if len(splits) != W or sum(splits) != t.shape[0]:
                raise ValueError(f"shared-memory all_to_all_single on rank {self.rank}: {what}_splits {list(splits)} "
                                 f"must be {W} row counts (one per rank) adding up to the {what} tensor's "
                                 f"{t.shape[0]} rows")
        if in_row != out_row:
            raise ValueError(f"shared-memory all_to_all_single on rank {self.rank}: an input row is {in_row} bytes, "
                             f"an output row {out_row}: give inp and out the same dtype and row shape")
        src = _bytes(inp.contiguous())
        if self.disabled:
            return self._fallback_a2a(out, inp, out_splits, in_splits)
        # what goes to peers, in rank order; this rank's own rows go straight from inp to out
        send = [(p, lo, lo + n * in_row) for p, lo, n in zip(range(W), _starts(in_splits, in_row), in_splits)]
        slot = self._k % 2
        ok = self._write(slot, [None if p == self.rank else src[lo:hi] for p, lo, hi in send], _OP_ALL_TO_ALL, tag)
        peers = self._after_barrier(slot, _OP_ALL_TO_ALL)
        if peers is None or not ok:
            return self._fallback_a2a(out, inp, out_splits, in_splits)
        if not out.is_contiguous():  # received bytes land in a contiguous buffer, then in out's layout
            staged = torch.empty(out.shape, dtype=out.dtype)
            self._read_a2a(staged, src, send, peers, out_splits, out_row)
            out.copy_(staged)
            return
        self._read_a2a(out, src, send, peers, out_splits, out_row)

    def _read_a2a(self, out: Tensor, src: Tensor, send: list, peers: dict, out_splits: list[int], out_row: int) -> None:
        dst = _bytes(out)
        at = 0
        for p in range(self.world_size):
            n = out_splits[p] * out_row
            if p == self.rank:
                _, lo, hi = send[p]
                if hi - lo != n:
                    raise RuntimeError(f"shared-memory all-to-all: rank {p} sends {hi - lo} bytes to itself but "
                                       f"expects {n}: its in_splits and out_splits disagree on its own rows")
                dst[at : at + n].copy_(src[lo:hi])
            else:
                header, base, region = peers[p]
                lo, hi = header[_SPANS + 2 * self.rank], header[_SPANS + 2 * self.rank + 1]
                if hi - lo != n:
                    raise RuntimeError(f"shared-memory all-to-all: rank {p} sent {hi - lo} bytes to rank {self.rank}, "
                                       f"which expected {n}: the ranks disagree on the split sizes")
                dst[at : at + n].copy_(region.u8[base + lo : base + hi])
            at += n

    def exchange(self, sends: list[Tensor | Writer], tag: str = "exchange") -> list[Tensor]:
        """All-to-all of sizes only the senders know: sends[p] goes to rank p; returns what each rank sent here. A
        send is a tensor or a Writer (fills shared memory itself). Received pieces are uint8 tensors; a peer's is a
        view into its shared memory, valid until this rank's next collective on the group: consume it before."""
        W = self.world_size
        if len(sends) != W:
            raise ValueError(f"exchange takes one send per rank ({W}), got {len(sends)}")
        if self.disabled:
            return self._fallback_exchange(sends)
        slot = self._k % 2
        ok = self._write(slot, [None if p == self.rank else piece for p, piece in enumerate(sends)], _OP_EXCHANGE, tag)
        peers = self._after_barrier(slot, _OP_EXCHANGE)
        if peers is None or not ok:
            return self._fallback_exchange(sends)
        out = []
        for p in range(W):
            if p == self.rank:
                out.append(_materialize(sends[p]))
            else:
                header, base, region = peers[p]
                lo, hi = header[_SPANS + 2 * self.rank], header[_SPANS + 2 * self.rank + 1]
                out.append(region.u8[base + lo : base + hi])
        return out

    def all_reduce_sum_(self, tensor: Tensor, tag: str = "all_reduce") -> Tensor:
        """In place: the sum over ranks, added in rank order (bitwise the same on every rank)."""
        self.all_reduce_sum_many_([tensor], tag)
        return tensor

    def all_reduce_sum_many_(self, tensors: list[Tensor], tag: str = "all_reduce") -> None:
        """all_reduce_sum_ of several tensors in one exchange (one barrier): DDP's buckets of a step."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        if self.disabled:
            return self._fallback_all_reduce(tensors)
        slot = self._k % 2
        ok = self._write(slot, tensors, _OP_ALL_REDUCE, tag)
        peers = self._after_barrier(slot, _OP_ALL_REDUCE)
        if peers is None or not ok:
            return self._fallback_all_reduce(tensors)
        bases = []
        for p in range(self.world_size):
            if p == self.rank:
                bases.append((self._data, slot * (self._data.nbytes // 2)))
            else:
                _, base, region = peers[p]
                bases.append((region, base))
        for t, n, at in zip(tensors, sizes, _layout(tensors)[::2]):  # the same layout on every rank
            # every rank adds the same bytes in the same order: bitwise equal results everywhere
            parts = [region.u8[base + at : base + at + n].view(t.dtype).view(t.shape) for region, base in bases]
            t.copy_(parts[0])
            for part in parts[1:]:
                t.add_(part)

    # the protocol ----------------------------------------------------------------------------------

    def _write(self, slot: int, pieces: list[Tensor | Writer | None], op: int, tag: str) -> bool:
        """Pieces into this rank's slot, each at a 64-byte aligned start (viewable as any dtype), then the header: op,
        total size, and each piece's (start, end). None: nothing."""
        spans = _layout(pieces)
        at = _align(spans[-1]) if spans else 0
        cap = self._data.nbytes // 2
        ok = 1
        if at > cap:
            ok = 0
            for size in dict.fromkeys((max(at, 2 * cap), at)):  # doubled; without room for that, what this needs
                if self._no_room_from is None or size < self._no_room_from:
                    ok = self._grow(size)
                    if ok:
                        break
        elif 4 * at < cap and cap > _INITIAL_BYTES:
            self._small_run, self._small_peak = self._small_run + 1, max(self._small_peak, at)
            if self._small_run >= self.shrink_after:
                self._small_run = 0
                self._grow(max(2 * self._small_peak, _INITIAL_BYTES), shrink=True)  # no room: the old one stays
                self._small_peak = 0
        else:
            self._small_run, self._small_peak = 0, 0
        if ok:
            base = slot * (self._data.nbytes // 2)
            for piece, lo, hi in zip(pieces, spans[::2], spans[1::2]):
                if piece is None or hi == lo:
                    continue
                dst = self._data.u8[base + lo : base + hi]
                if isinstance(piece, Writer):
                    piece.write(dst)
                else:
                    dst.view(piece.dtype).view(piece.shape).copy_(piece)  # copy_ takes any strides: one pass
        sizes = [hi - lo for lo, hi in zip(spans[::2], spans[1::2])]
        self._tag = tag
        fields = [self._gen, op, ok, sum(sizes), _tag_id(tag), self.step]  # _GEN, _OP, _OK, _SIZE, _TAG, _STEP
        # all-reduce: the count and a signature of the sizes; all-to-all / exchange: (start, end) per rank
        fields += [len(sizes), _signature(sizes)] if op == _OP_ALL_REDUCE else spans
        self._header[slot, : len(fields)] = torch.tensor(fields, dtype=torch.int64)  # one write
        return bool(ok)

    def _grow(self, per_slot: int, shrink: bool = False) -> int:
        """A new region of `per_slot` bytes a slot (the next generation): larger for a write that does not fit, or
        (shrink) smaller after a run of small ones. 0: /dev/shm had no room for it."""
        try:
            region = _Region(self._path("d", self.rank, self._gen + 1), 2 * per_slot, create=True)
        except OSError as e:
            if shrink:
                return 0
            if self._no_room_from is None:  # once: every larger exchange after it falls back too
                warnings.warn(f"/dev/shm has no room for {2 * per_slot / 2**20:.0f} MB ({e}); lightning_rec sends "
                              f"exchanges this large through the process group (slower), smaller ones on through "
                              f"shared memory. Fix: a larger /dev/shm (docker run --shm-size=...)",
                              stacklevel=_user_stacklevel())
            self._no_room_from = min(per_slot, self._no_room_from or per_slot)
            return 0
        self._gen += 1
        self._data = region
        self._unlink_after.append((region.path, self._k + 1))
        return 1

    def _after_barrier(self, slot: int, op: int) -> dict | None:
        """Barrier, then every peer's (header, slot base, region); None: someone could not write (fall back)."""
        self._barrier()
        k = self._k
        self._k += 1
        for path, _ in [u for u in self._unlink_after if u[1] <= k]:
            self._unlink(path)
        self._unlink_after[:] = [u for u in self._unlink_after if u[1] > k]  # in place: the finalizer holds it
        # headers as Python ints, one read each (not an indexed tensor read per field)
        own = self._header[slot].tolist()
        headers = {p: h[slot].tolist() for p, h in self._peer_headers.items()}
        for p, header in headers.items():
            # all-reduce: the same byte sizes (exact total, count, and a signature of the list) everywhere
            same = header[_OP] == op and header[_TAG] == own[_TAG] and (op != _OP_ALL_REDUCE or (
                header[_SIZE] == own[_SIZE] and header[_SPANS : _SPANS + 2] == own[_SPANS : _SPANS + 2]))
            if not same:
                mine, theirs = _TAG_NAMES.get(own[_TAG], "?"), _TAG_NAMES.get(header[_TAG], "?")
                raise CollectiveMismatch(
                    f"shared-memory collective mismatch at exchange {k}: rank {self.rank} ran '{mine}' "
                    f"({own[_SIZE]} bytes), rank {p} ran '{theirs}' ({header[_SIZE]} bytes). Every rank "
                    f"must run the same collectives with the same sizes in the same order (do all ranks have the "
                    f"same number of batches? a rank-dependent branch in the model?)")
        if any(h[_STEP] != own[_STEP] for h in headers.values()):  # the same collective, of another step
            raise step_mismatch(_TAG_NAMES.get(own[_TAG], "?"),
                                [own[_STEP] if p == self.rank else headers[p][_STEP] for p in range(self.world_size)])
        # every peer's region first, also when this exchange falls back: a grown one is unlinked after the next barrier
        peers = {}
        for p, header in headers.items():
            gen = header[_GEN]
            if gen != self._peer_data[p][0]:
                path = self._path("d", p, gen)
                self._peer_data[p] = (gen, _Region(path, os.path.getsize(path), create=False))
            region = self._peer_data[p][1]
            peers[p] = (header, slot * (region.nbytes // 2), region)
        if not (own[_OK] and all(h[_OK] for h in headers.values())):
            # someone had no room: this exchange goes through the process group, the next that fits through shm
            self.fallbacks += 1
            return None
        return peers

    def _barrier(self) -> None:
        if _native_barrier() is None:
            dist.barrier(group=self.pg)  # no compiled extension: gloo carries the signal (slower, same result)
            return
        if self.guard is not None:
            # the barrier is re-entrant: wait the grace, then in slices, the guard comparing where the peers are
            k = self.guard.begin()
            if not self._barrier_for(self.guard.grace_s):
                self.guard.wait_until(self._barrier_for, self._tag, k, graced=True)
            return
        timeout = self.timeout_s if self.timeout_s is not None else 0.0
        code = _native_barrier()(self._arrivals, self.rank, self._k + 1, self._pids, timeout)
        if code >= 0:
            peer, dead = divmod(code, 2)
            why = "exited" if dead else f"did not reach it within {self.timeout_s} s (set {self.timeout_setting})"
            raise RuntimeError(f"shared-memory exchange {self._k}: rank {peer} {why} (rank {self.rank} waited)")

    def _barrier_for(self, seconds: float) -> bool:
        code = _native_barrier()(self._arrivals, self.rank, self._k + 1, self._pids, max(seconds, 1e-3))
        if code >= 0 and code % 2:
            raise PeerExited(f"'{self._tag}' (shared-memory exchange {self._k}) on rank {self.rank}: rank "
                             f"{code // 2} exited (its process is gone): see its log for the cause")
        return code < 0

    def _fallback_a2a(self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=self.pg)

    def _fallback_exchange(self, sends: list[Tensor | Writer]) -> list[Tensor]:
        pieces = [_materialize(piece) for piece in sends]
        counts_send = torch.tensor([p.numel() for p in pieces], dtype=torch.int64)
        counts_recv = torch.empty_like(counts_send)
        dist.all_to_all_single(counts_recv, counts_send, group=self.pg)
        sizes = counts_recv.tolist()
        recv = torch.empty(sum(sizes), dtype=torch.uint8)
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
        dist.all_to_all_single(recv, send, sizes, counts_send.tolist(), group=self.pg)
        return list(recv.split(sizes))

    def _fallback_all_reduce(self, tensors: list[Tensor]) -> None:
        for t in tensors:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.pg)

    def close(self) -> None:
        """Unlink the names still in /dev/shm (at most the newest region's); also runs at exit and on GC."""
        self._finalizer()


def _unlink_all(pending: list[tuple[str, int]]) -> None:
    for path, _ in pending:
        SharedMemoryGroup._unlink(path)
    pending.clear()


def _native_barrier():
    """torch.ops.lightning_rec.shm_barrier, or None without the compiled extension."""
    from lightning_rec._native import native_op  # the extension loads on first use: import lightning_rec stays light

    return native_op("shm_barrier")


def ddp_comm_hook(group: SharedMemoryGroup):
    """A DDP comm hook averaging the gradient buckets through `group` (register_comm_hook(None, hook)): it holds the
    buckets and reduces them all at the last one, in one exchange (one barrier per step)."""
    pending: list[tuple[Tensor, torch.futures.Future]] = []

    def hook(_state, bucket):  # unannotated: DDP compares annotations as objects, and this module defers them
        fut = torch.futures.Future()
        pending.append((bucket.buffer(), fut))
        if not bucket.is_last():
            return fut
        buffers = [buf for buf, _ in pending]
        waiting = list(pending)
        pending.clear()
        try:
            group.all_reduce_sum_many_(buffers, tag="DDP gradient all-reduce")
        except (CollectiveMismatch, CollectiveTimeout, PeerExited):
            raise  # the guard's messages name the ranks and the setting already
        except RuntimeError as e:
            raise RuntimeError(f"DDP gradient all-reduce failed on rank {group.rank}: a peer rank exited or did not "
                               f"answer within the timeout ({group.timeout_s} s; set {group.timeout_setting}). "
                               f"Cause: {e}") from e
        for buf, f in waiting:
            buf.div_(group.world_size)
            f.set_result(buf)
        return fut

    return hook
