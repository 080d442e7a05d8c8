"""What the multi-rank benchmarks share: a free port, and collecting the ranks' rows without waiting forever."""

from __future__ import annotations

import queue as queue_module
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collect_rows(queue, procs) -> list:
    """Every rank's rows (each rank puts one list); a rank that dies ends the run with its exit code."""
    rows, done = [], 0
    while done < len(procs):
        try:
            rows += queue.get(timeout=5)
            done += 1
        except queue_module.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"rank(s) died: {dead} (rank, exit code); see the traceback above") from None
    return rows
