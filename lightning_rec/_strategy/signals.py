"""SIGTERM (a preempted job) and SLURM's requeue signal, several ranks: every rank acts on them at one batch.

Lightning's handlers run a collective inside the signal handler (the SIGTERM broadcast; the requeue handler's
checkpoint save), paired with whatever collective the other ranks are in: a hang or a CollectiveMismatch. And
a rank signalled alone stopped alone. Here the handler only notes the signal; the note rides on the agreement
every batch already makes (RecStrategy._all_have_a_batch, or the pipeline's), and at the batch that carried
it every rank sets `trainer.received_sigterm` (Lightning's loops then raise SIGTERMException after that step
on every rank: the callbacks' on_exception, e.g. OnExceptionCheckpoint's save, is a collective all reach) or
runs Lightning's requeue handler at the next training batch's start.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from typing import Any

from torch.utils.data import DataLoader

from lightning_rec import _compat

SIGTERM_BIT, REQUEUE_BIT = 1, 2  # a rank's signals, as the bits its agreement row carries


class SignalTakeover:
    """RecStrategy's signal handlers and what the ranks agreed on (one per strategy; reset at every setup)."""

    def __init__(self, trainer: Any = None, rank: int = 0, launcher: Any = None) -> None:
        self.sigterm_pending = False  # this rank got a SIGTERM the ranks have not agreed on yet
        self.stop_told = False
        self.requeue: tuple | None = None  # SLURM auto-requeue: (Lightning's handler, the signal noted or None)
        self.requeue_state = ""  # "" -> "due" (agreed, runs at the next training batch) -> "done"
        self.trainer, self.rank, self.launcher = trainer, rank, launcher

    @classmethod
    def take_over(cls, trainer: Any, world_size: int, rank: int, launcher: Any) -> SignalTakeover:
        """Lightning's SIGTERM notifier (registered after setup, until teardown) and its SLURM requeue handler
        replaced by a new takeover's (several ranks; one rank keeps Lightning's own)."""
        self = cls(trainer, rank, launcher)
        if world_size <= 1:
            return self
        if _compat.take_over_sigterm(trainer, self.on_sigterm):
            # Lightning's epoch loop also broadcasts rank 0's flag before every batch and reads it back (on GPU a
            # host sync per step); every rank's flag is set at the same batch here, so each reads its own
            _compat.take_over_sigterm_check(trainer, functools.partial(_raise_agreed_sigterm, trainer))
        own = _compat.take_over_slurm_requeue(trainer, self.on_requeue_signal)
        if own is not None:
            self.requeue = (own, None)  # Lightning's own, run at a batch (run_due_requeue)
        return self

    def on_sigterm(self, signum: Any, _frame: Any) -> None:
        """The SIGTERM handler: notes it, and passes it on to the ranks this process launched (as Lightning's does).
        No collective, no print (a signal handler interrupts the main thread anywhere, in a write to stderr too)."""
        if self.sigterm_pending:
            return
        self.sigterm_pending = True
        with contextlib.suppress(OSError):
            os.write(2, f"lightning_rec (rank {self.rank}): received SIGTERM ({int(signum)}); every rank stops "
                        f"after the step that takes the next batch\n".encode())
        if self.launcher is not None:
            self.launcher.kill(signum)

    def on_requeue_signal(self, signum: Any, _frame: Any) -> None:
        """SLURM's requeue signal (auto_requeue): noted; Lightning's handler runs at a batch every rank agrees on."""
        if self.requeue is None or self.requeue[1] is not None or self.requeue_state:
            return
        self.requeue = (self.requeue[0], signum)
        with contextlib.suppress(OSError):
            os.write(2, f"lightning_rec (rank {self.rank}): received the requeue signal ({int(signum)}); "
                        f"every rank saves the checkpoint at its next training batch, then rank 0 requeues the "
                        f"job\n".encode())

    def requested(self) -> int:
        """This rank's signals not yet acted on, as bits (SIGTERM_BIT, REQUEUE_BIT)."""
        requeue = self.requeue is not None and self.requeue[1] is not None and not self.requeue_state
        return (SIGTERM_BIT if self.sigterm_pending else 0) | (REQUEUE_BIT if requeue else 0)

    def agreed(self, ranks: dict[int, int]) -> None:
        """Every rank calls this at the same batch: the one whose agreement carried the signals ({rank: bits})."""
        if any(bits & REQUEUE_BIT for bits in ranks.values()) and not self.requeue_state:
            self.requeue_state = "due"  # at the next training batch's start, on every rank
        signalled = sorted(r for r, bits in ranks.items() if bits & SIGTERM_BIT)
        if not signalled or self.stop_told:
            return
        self.stop_told = True
        if not _compat.note_sigterm(self.trainer):  # what Lightning's loops read (trainer.received_sigterm)
            return
        if self.rank == 0:
            print(f"lightning_rec: SIGTERM received by rank(s) {signalled}: every rank stops after this step "
                  f"(Lightning's SIGTERMException: callbacks' on_exception run, e.g. OnExceptionCheckpoint saves a "
                  f"checkpoint)", file=sys.stderr, flush=True)

    def run_due_requeue(self) -> None:
        """At a training batch's start (before its collectives): Lightning's requeue handler, once agreed."""
        if self.requeue_state == "due" and self.requeue is not None:
            self.requeue_state = "done"
            handler, signum = self.requeue
            handler(signum if signum is not None else signal.SIGUSR1, None)


def _raise_agreed_sigterm(trainer: Any) -> None:
    """Lightning's per-batch SIGTERM check without its broadcast: every rank's flag is set at the same batch."""
    if getattr(trainer, "received_sigterm", False):
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        raise SIGTERMException()


class _IgnoreSigterm:
    """A DataLoader's worker_init_fn: the worker ignores a SIGTERM that does not come from its rank, then runs the
    loader's own worker_init_fn (if any).

    A preempted job's SIGTERM reaches every process of the job, the loader workers too, and torch's workers die of
    it at once: the rank's next batch failed instead of the step it was to stop after. The rank stops its workers
    itself, by SIGTERM too where they do not end; told apart by the sender, which a thread waiting on the blocked
    signal sees (sigwaitinfo; where there is none, the worker keeps torch's behaviour)."""

    def __init__(self, own: Any) -> None:
        self.own = own

    def __call__(self, worker_id: int) -> None:
        if hasattr(signal, "sigwaitinfo") and threading.current_thread() is threading.main_thread():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started from here on inherit it
            threading.Thread(target=_end_on_the_ranks_sigterm, name="lightning_rec: SIGTERM from the rank",
                             daemon=True).start()
        if self.own is not None:
            self.own(worker_id)


def _end_on_the_ranks_sigterm() -> None:
    rank = os.getppid()
    while True:
        sent = signal.sigwaitinfo({signal.SIGTERM})
        if sent.si_pid == rank or os.getppid() != rank:
            os._exit(128 + signal.SIGTERM)  # as a SIGTERM'd process's status reads to a shell


def workers_outlive_sigterm(loader: object) -> None:
    """The loader's workers survive a SIGTERM that is not their rank's (_IgnoreSigterm)."""
    if not isinstance(loader, DataLoader) or loader.num_workers <= 0 or isinstance(loader.worker_init_fn,
                                                                                    _IgnoreSigterm):
        return
    loader.worker_init_fn = _IgnoreSigterm(loader.worker_init_fn)
