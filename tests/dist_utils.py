"""One helper to run a function on N CPU ranks (gloo) from a test: `run_ranks(fn, world_size, *args)`.
(The benchmarks in benchmarks/ that spawn ranks themselves use `free_port` and `collect_rows` from here.)

Each rank runs `fn(rank, world_size, *args)` in its own process with the process group already
initialised, and its return value (or its exception, with traceback) comes back through a file.
Processes come from a forkserver that has torch, lightning and lightning_rec imported once, so a run starts
in well under a second instead of re-importing torch per rank. A run that exceeds `timeout`
seconds is killed and fails the test (a broken collective never hangs the suite).
`fn` must be a module-level function of an importable module (it is pickled by reference).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import socket
import tempfile
import time
import traceback
from datetime import timedelta

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # lightning too: most ranks run a Trainer, and importing it costs each rank ~2 s of a 2-core machine; pandas
        # (pyarrow's to_numpy imports it) and native_embedding (its custom ops) cost each data / model rank ~1 s more
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "fbgemm_gpu", "lightning.pytorch", "pandas",
                                     "lightning_rec.model_parallel", "lightning_rec.strategy", "lightning_rec.models",
                                     "lightning_rec.native_embedding", "lightning_rec.data"])
    return _CTX


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collect_rows(queue, procs) -> list:
    """Every rank's rows (each rank puts one list on `queue`); a rank that dies ends the run with its exit code."""
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


class RankFailed(AssertionError):
    pass


def _worker(fn, rank, world_size, port, out_path, pg_timeout, backend, args, kwargs):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a rank's own children (DataLoader workers) fork, as under torchrun or Lightning's launcher: a forkserver
    # child would inherit "forkserver" and start a fresh server importing torch again (~4 s per loader)
    mp.set_start_method("fork", force=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(kwargs.pop("_local_world_size", world_size)))
    result: tuple
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        try:
            dist.init_process_group(backend, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout))
        except Exception as e:  # noqa: BLE001
            if "EADDRINUSE" not in str(e):
                raise
            # the port free_port found was taken by another process before rank 0 listened on it (another test
            # worker, another job): run_ranks starts the ranks again on a new port (fn has not run)
            result = ("port_taken", str(e), type(e).__name__)
        else:
            result = ("ok", fn(rank, world_size, *args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - reported to the parent with its traceback
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", type(e).__name__)
    with open(out_path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(out_path + ".tmp", out_path)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    os._exit(0)  # skip atexit/gloo teardown that can stall when a peer is gone


def run_ranks(fn, world_size: int, *args, timeout: float = 90.0, pg_timeout: float = 60.0,
              allow_missing: bool = False, local_world_size: int | None = None, backend: str = "gloo",
              **kwargs) -> list:
    """Per-rank return values of fn(rank, world_size, *args, **kwargs). Raises RankFailed on any error.

    allow_missing: a rank that exits without a result (a test that kills a rank) gives None.
    """
    for attempt in range(3):
        try:
            return _run_ranks_once(fn, world_size, args, kwargs, timeout, pg_timeout, allow_missing,
                                   local_world_size, backend)
        except _PortTaken:
            if attempt == 2:
                raise RankFailed("rank 0 found its port taken three times (EADDRINUSE)") from None
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    pass


def _run_ranks_once(fn, world_size, args, kwargs, timeout, pg_timeout, allow_missing, local_world_size, backend):
    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world_size)]
        if local_world_size is not None:
            kwargs["_local_world_size"] = local_world_size
        procs = [ctx.Process(target=_worker,
                             args=(fn, r, world_size, port, paths[r], pg_timeout, backend, args, dict(kwargs)))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        rank0_read = False
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if not rank0_read and not procs[0].is_alive() and os.path.exists(paths[0]):
                rank0_read = True
                with open(paths[0], "rb") as f:
                    if pickle.load(f)[0] == "port_taken":  # the others wait for a rank 0 that never listens
                        for p in procs:
                            p.kill()
                            p.join()
                        raise _PortTaken
            procs[0].join(0.05) if procs[0].is_alive() else time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join()
        results, errors = [], []
        for r, path in enumerate(paths):
            if not os.path.exists(path):
                if r in hung:
                    errors.append(f"rank {r}: still running after {timeout} s (killed)")
                elif not allow_missing:
                    errors.append(f"rank {r}: exited (code {procs[r].exitcode}) without a result")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, *payload = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r}: {payload[0]}")
                results.append(None)
            else:
                results.append(payload[0])
        if errors:
            raise RankFailed("\n".join(errors))
        return results


def expect_error(exc_type: type[BaseException], fn, *words: str) -> str:
    """Run fn(); it must raise exc_type whose message names every one of `words`. Returns the message."""
    try:
        fn()
    except exc_type as e:
        text = str(e)
        missing = [w for w in words if w not in text]
        assert not missing, f"{missing} not in: {text}"
        return text
    raise AssertionError(f"no {exc_type.__name__} (expected one naming {words})")
