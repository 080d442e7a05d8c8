"""Runs the battery: cases in sequence in a worker process, classified; one line each, then the JSON line."""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from . import checkpoint, cli, criteo, distributed, embeddings, metrics, models, movielens, optim, planner, sparse
from .helpers import ROOT
from .registry import CASES, CLASSES, Case, Ctx, Hang, RemoteError, Silent, Skipped

BENCHMARKS = Path(__file__).resolve().parents[1]
# each area's case groups, registered in this order (the order the cases run in)
AREAS = (sparse, embeddings, optim, planner, metrics, criteo, movielens, models, cli, checkpoint, distributed)


def register_all() -> None:
    if CASES:
        return
    for area in AREAS:
        for group in area.CASES:
            group()


def smoke_names() -> list[str]:
    """A handful of cases per area (each area's SMOKE), in the order they run."""
    chosen = {name for area in AREAS for name in area.SMOKE}
    unknown = sorted(chosen - set(CASES))
    if unknown:
        raise SystemExit(f"SMOKE names no case: {unknown}")
    return [name for name in CASES if name in chosen]


# ==================================================================================================
# running: worker side

def classify(c: Case, fn) -> tuple[str, str]:
    ctx = Ctx()
    try:
        return _classify(c, fn, ctx)
    finally:
        shutil.rmtree(ctx.tmp, ignore_errors=True)  # after the after-checks, which may read its files


def _classify(c: Case, fn, ctx: Ctx) -> tuple[str, str]:
    exc = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(ctx)
    except Silent as e:
        return "silent", str(e)
    except Skipped as e:  # the real data it reads is absent (never counted as clear or correct)
        return "skipped", str(e)
    except Hang as e:
        return "hang", str(e)
    except RemoteError as e:
        if e.names == ["Silent"]:
            return "silent", str(e)
        exc = (e.names, str(e))
    except BaseException as e:  # noqa: BLE001 - classified
        exc = ([k.__name__ for k in type(e).__mro__], f"{type(e).__name__}: {e}")
    if exc is None:
        if c.error is not None and not c.ok:
            return "silent", f"no error: expected {_names(c.error)} naming {list(c.words)}"
        return "correct", ""
    names, msg = exc
    for check in ctx.afters:
        try:
            check()
        except Silent as e:
            return "silent", f"{e} (after: {msg})"
    expected = c.error if isinstance(c.error, tuple) else (c.error,) if c.error else ()
    type_ok = any(t.__name__ in names for t in expected)
    missing = [w for w in c.words if w.lower() not in msg.lower()]
    if type_ok and not missing:
        return "clear", msg
    if not c.error:
        why = "an error where a result was due"
    else:
        why = f"expected {_names(c.error)}" if not type_ok else f"message lacks {missing}"
    return "unclear", f"[{why}] {msg}"


def _names(error) -> str:
    if error is None:
        return "no error"
    return "/".join(t.__name__ for t in (error if isinstance(error, tuple) else (error,)))


def worker_main() -> None:
    threads = int(os.environ.get("BATTERY_THREADS", "2"))
    out = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(2, 1)  # noise from cases goes to the log, never into the result pipe
    os.close(devnull)
    import faulthandler
    faulthandler.enable()
    import torch
    torch.set_num_threads(threads)
    import lightning.pytorch  # noqa: F401  (imported once for every case)

    import lightning_rec  # noqa: F401
    register_all()
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        name = line.strip()
        if not name:
            continue
        c = CASES[name]
        torch.set_num_threads(threads)
        start = time.monotonic()
        try:
            cls, msg = classify(c, c.fn)
        except BaseException as e:  # noqa: BLE001
            cls, msg = "unclear", f"battery error: {e}\n{traceback.format_exc()}"
        out.write(json.dumps({"name": name, "class": cls, "seconds": round(time.monotonic() - start, 2),
                              "message": msg[:2000]}) + "\n")


# ==================================================================================================


# ==================================================================================================
# running: parent side

class Worker:
    def __init__(self, threads: int, log_path: Path) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   BATTERY_THREADS=str(threads), WANDB_MODE="offline", PYTHONFAULTHANDLER="1")
        self.log = open(log_path, "ab")
        code = (f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); sys.path.insert(0, {str(ROOT / 'tests')!r}); "
                "from bad_input.runner import worker_main; worker_main()")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, cwd=str(ROOT), env=env, start_new_session=True)
        self.buf = b""
        ready = self.read(180)
        if not ready or not json.loads(ready).get("ready"):
            self.kill()
            raise RuntimeError(f"the worker did not start; see {log_path}")

    def read(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([self.proc.stdout], [], [], left)
            if r:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    return None  # EOF: the worker died
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def run(self, name: str, timeout: float) -> dict | None:
        self.proc.stdin.write((name + "\n").encode())
        self.proc.stdin.flush()
        line = self.read(timeout)
        return json.loads(line) if line else None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the worker and the rank processes it started
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def _tail(path: Path, n: int = 600) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


def run_cases(names: list[str], threads: int, log: Path) -> list[dict]:
    """Each case in a worker process; a crash or hang kills that worker and a new one takes the next case."""
    results, worker = [], None
    for name in names:
        c = CASES[name]
        if worker is None:
            worker = Worker(threads, log)
        mark = log.stat().st_size if log.exists() else 0
        start = time.monotonic()
        r = worker.run(name, c.timeout)
        if r is None:
            died = not worker.alive()
            if not died:
                time.sleep(0.2)
                died = not worker.alive()
            code = worker.proc.poll()
            worker.kill()
            worker = None
            tail = log.read_bytes()[mark:][-800:].decode(errors="replace")
            r = {"name": name, "class": "crash" if died else "hang", "seconds": round(time.monotonic() - start, 2),
                 "message": (f"worker died (exit {code}): " if died else f"over {c.timeout} s: ") + tail}
        r["legit"] = c.legit
        results.append(r)
        msg = " ".join(r["message"].split())[:160]
        print(f"{r['name']:<58} {r['class']:<8} {r['seconds']:6.2f}s  {msg}", flush=True)
    if worker is not None:
        worker.kill()
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="A battery of bad and edge inputs across the public surface")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=None, help="run the cases whose name contains this")
    ap.add_argument("--smoke", action="store_true", help="a handful of cases per area (seconds)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--log", default=None, help="worker stderr (default: a temp file)")
    args = ap.parse_args(argv)
    register_all()
    names = smoke_names() if args.smoke else list(CASES)
    names = [n for n in names if args.only is None or args.only in n]
    if args.list:
        print("\n".join(names))
        return
    log = Path(args.log or tempfile.mkstemp(prefix="battery_worker_", suffix=".log")[1])
    t_all = time.monotonic()
    results = run_cases(names, args.threads, log)
    figures = {"cases": len(results), "threads": args.threads}
    for cls in CLASSES:
        figures[cls] = sum(r["class"] == cls for r in results)
    figures["seconds"] = round(time.monotonic() - t_all, 1)
    bad = [r["name"] for r in results if r["class"] not in ("clear", "correct", "skipped")]
    print(f"\n{figures['cases']} cases at {args.threads} threads: " +
          ", ".join(f"{figures[c]} {c}" for c in CLASSES) + f" ({figures['seconds']} s); not clear/correct: {bad}")
    print(json.dumps({"benchmark": "bad_input_battery", "results": results, "ratios": {}, "figures": figures}))
