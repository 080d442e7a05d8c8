"""One benchmark script, run against the library at two revisions: REV (old) and this working tree (new).

    python benchmarks/against.py REV [--rounds 3] -- benchmarks/embedding.py --rounds 1 --steps 10
    python benchmarks/against.py cdf5a74 --rounds 3 -- benchmarks/kjt_forward.py
    python benchmarks/against.py cdf5a74 --checkout /work/old -- benchmarks/checkpoint.py

Both sides run this working tree's script, so a change of measurement cannot pass for a change of speed; only
the library differs. REV is extracted (`git archive REV | tar -x`) into a cache directory keyed by its commit
and reused afterwards (or --checkout names an existing checkout of REV, used as it is). Its compiled extension
(lightning_rec/_C*.so) is copied from the working tree when REV's csrc/ and setup.py are identical to the
working tree's, else built there (`python setup.py build_ext --inplace`); --extension copy|build forces one.

Each run is a subprocess of the script with PYTHONPATH=<side root> and a fresh, empty temporary cwd; a probe
before the rounds checks that `lightning_rec` resolves to that side, and the script sees
LIGHTNING_REC_AGAINST_SIDE=old|new. Runs alternate (old, new, then new, old, ... : who goes first swaps each
pair) so that drift of a shared machine hits both sides alike. Each run's last stdout line is read as JSON;
every number in it (nested dicts and lists flattened into dotted keys) is tabulated with each side's median
and new/old. Whether higher or lower is better is the reader's call: keys are printed as the script names them.
Ends with one JSON line: {"benchmark": "against", "rev", "script", "ratios": {key: new/old}, "figures", ...}.
A run that fails (a refusal of the old library, say) is reported with its error; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

SIDES = ("old", "new")


def parse_args(argv: list[str]) -> argparse.Namespace:
    if "--" not in argv:
        sys.exit("usage: against.py REV [options] -- SCRIPT [script args]  (the '--' is required)")
    cut = argv.index("--")
    if cut + 1 >= len(argv):
        sys.exit("against.py: no benchmark script after '--'")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rev", help="the old side: any git revision (commit, tag, branch, HEAD~3)")
    p.add_argument("--rounds", type=int, default=3, help="pairs of runs (old+new), who goes first swapping")
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "lightning_rec_against",
                   help="where checkouts of REV are kept, one directory per commit (default: %(default)s)")
    p.add_argument("--checkout", type=Path, help="an existing checkout of REV to use as it is, instead of the cache")
    p.add_argument("--extension", choices=("auto", "copy", "build"), default="auto",
                   help="how REV's checkout gets lightning_rec/_C*.so when it has none (default: copy when "
                        "csrc/ and setup.py match the working tree, else build)")
    p.add_argument("--timeout", type=float, help="seconds one run may take")
    p.add_argument("--quiet", action="store_true", help="do not echo the script's output")
    args = p.parse_args(argv[:cut])
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.script, args.script_args = Path(argv[cut + 1]).resolve(), argv[cut + 2:]
    if not args.script.is_file():
        p.error(f"no benchmark script at {args.script}")
    return args


def git(root: Path, *cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True, **kw)


def resolve_rev(root: Path, rev: str) -> str:
    done = git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if done.returncode:
        sys.exit(f"against.py: {rev!r} is not a commit of {root}")
    return done.stdout.strip()


def extensions(root: Path) -> list[Path]:
    return sorted((root / "lightning_rec").glob("_C*.so"))


def extract(root: Path, sha: str, cache: Path) -> Path:
    """`git archive sha | tar -x` into cache/<sha>, once; reused while its marker file is there."""
    side = cache / sha
    if (side / ".against-complete").is_file():
        return side
    part = Path(tempfile.mkdtemp(prefix=f"{sha}.part-", dir=cache))
    archive = subprocess.Popen(["git", "-C", str(root), "archive", sha], stdout=subprocess.PIPE)
    tar = subprocess.run(["tar", "-x", "-C", str(part)], stdin=archive.stdout)
    archive.stdout.close()
    if archive.wait() or tar.returncode:
        shutil.rmtree(part, ignore_errors=True)
        sys.exit(f"against.py: could not extract {sha} into {cache}")
    shutil.rmtree(side, ignore_errors=True)  # an extraction cut short before its marker was written
    part.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    part.rename(side)
    (side / ".against-complete").write_text(sha + "\n")
    return side


def provide_extension(root: Path, side: Path, sha: str, mode: str) -> str:
    """Gives the old side a compiled extension that matches its own csrc/; says which."""
    if extensions(side):
        return f"reused {', '.join(p.name for p in extensions(side))} already in {side}"
    same = git(root, "diff", "--quiet", sha, "--", "csrc", "setup.py").returncode == 0
    if mode == "copy" or (mode == "auto" and same):
        if not extensions(root):
            return "none: the working tree has no compiled extension either (both sides run without it)"
        for so in extensions(root):
            tmp = side / "lightning_rec" / f".{so.name}.part"
            shutil.copy2(so, tmp)
            tmp.replace(side / "lightning_rec" / so.name)
        how = "identical" if same else "different (--extension copy)"
        return f"copied from the working tree (csrc/ and setup.py {how})"
    print(f"against.py: building the extension in {side} (csrc/ or setup.py differ from the working tree)",
          flush=True)
    log = side / "build_ext.log"
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=side, stdout=out,
                              stderr=subprocess.STDOUT)
    if done.returncode or not extensions(side):
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        sys.exit(f"against.py: building the extension of {sha} failed (log {log}):\n{tail}")
    return f"built in {side} (log {log})"


def prepare_old(root: Path, args: argparse.Namespace, sha: str) -> tuple[Path, str]:
    """The old side's root and how it got its extension; one process at a time per cache directory."""
    if args.checkout:
        side = args.checkout.resolve()
        head = git(side, "rev-parse", "HEAD")
        if head.returncode == 0 and head.stdout.strip() != sha:
            sys.exit(f"against.py: {side} is at {head.stdout.strip()[:12]}, not {args.rev} ({sha[:12]})")
        if not (side / "lightning_rec" / "__init__.py").is_file():
            sys.exit(f"against.py: {side} has no lightning_rec/ package")
        return side, provide_extension(root, side, sha, args.extension)
    args.cache.mkdir(parents=True, exist_ok=True)
    with (args.cache / f"{sha}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        side = extract(root, sha, args.cache)
        return side, provide_extension(root, side, sha, args.extension)


def side_env(name: str, side: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(side), *filter(None, [env.get("PYTHONPATH")])])
    env["LIGHTNING_REC_AGAINST_SIDE"] = name
    return env


def probe(name: str, side: Path) -> str:
    """Where `lightning_rec` comes from for this side, run as the benchmark will be; exits unless it is `side`."""
    code = "import lightning_rec; print(lightning_rec.__file__)"
    with tempfile.TemporaryDirectory(prefix="against-cwd-") as cwd:
        done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=side_env(name, side), capture_output=True,
                              text=True)
    found = done.stdout.strip()
    if done.returncode or Path(found).resolve() != (side / "lightning_rec" / "__init__.py").resolve():
        sys.exit(f"against.py: on the {name} side lightning_rec should come from {side}, "
                 f"got {found or done.stderr.strip()[-500:]}")
    return found


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_once(name: str, side: Path, args: argparse.Namespace, label: str) -> dict:
    """One run of the script; its last stdout line as a dict, or {"error": ...} with the tail of stderr."""
    cmd = [sys.executable, str(args.script), *args.script_args]
    with tempfile.TemporaryDirectory(prefix="against-cwd-") as cwd, tempfile.TemporaryFile("w+") as err:
        # its own process group, so that a timeout or Ctrl-C also ends the processes it started (ranks, children)
        proc = subprocess.Popen(cmd, cwd=cwd, env=side_env(name, side), stdout=subprocess.PIPE, stderr=err,
                                text=True, start_new_session=True)
        timed_out = threading.Event()
        timer = threading.Timer(args.timeout, lambda: (timed_out.set(), _kill_group(proc))) if args.timeout else None
        lines = []
        try:
            if timer:
                timer.start()
            for line in proc.stdout:
                lines.append(line)
                if not args.quiet:
                    print(f"[{label}] {line}", end="", flush=True)
            rc = proc.wait()
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            if timer:
                timer.cancel()
        if timed_out.is_set():
            rc = f"{rc} (killed after --timeout {args.timeout} s)"
        err.seek(0)
        stderr = err.read()
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    if rc != 0:
        return {"error": f"exit status {rc}", "stderr": stderr[-3000:]}
    try:
        result = json.loads(last)
    except json.JSONDecodeError:
        return {"error": f"last line is not JSON: {last[:300]!r}", "stderr": stderr[-3000:]}
    if not isinstance(result, dict):
        return {"error": f"last line is JSON but not an object: {last[:300]!r}", "stderr": ""}
    return {"result": result}


def _labels(items: list) -> list[str]:
    """Keys for a list's items: a list of dicts is keyed by each dict's string values ("ours", or
    "native/sgd" where one is not unique; a repeat gets "~2"), so that a reordered list still pairs up."""
    if not items or not all(isinstance(item, dict) for item in items):
        return [str(i) for i in range(len(items))]
    texts = [[v for v in item.values() if isinstance(v, str)] for item in items]
    firsts = [t[0] if t else "" for t in texts]
    names = firsts if "" not in firsts and len(set(firsts)) == len(firsts) else ["/".join(t) for t in texts]
    if "" in names:
        return [str(i) for i in range(len(items))]
    seen: dict[str, int] = {}
    labels = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if seen[name] == 1 else f"{name}~{seen[name]}")
    return labels


def flatten(obj, prefix: str = "") -> dict[str, float]:
    """Every finite number in a JSON value (bools excluded) under a dotted key."""
    if isinstance(obj, bool):
        return {}
    if isinstance(obj, (int, float)):
        return {prefix: float(obj)} if math.isfinite(obj) else {}
    if isinstance(obj, dict):
        pairs = obj.items()
    elif isinstance(obj, list):
        pairs = zip(_labels(obj), obj)
    else:
        return {}
    flat = {}
    for key, value in pairs:
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def run_rounds(args: argparse.Namespace, roots: dict[str, Path]) -> tuple[dict, list]:
    """Alternating runs: old, new, then new, old, ...; every number of each side's runs, and the failures."""
    values: dict[str, dict[str, list[float]]] = {}
    failures = []
    for r in range(args.rounds):
        for name in SIDES if r % 2 == 0 else SIDES[::-1]:
            label = f"{name} {r + 1}/{args.rounds}"
            out = run_once(name, roots[name], args, label)
            if "error" in out:
                print(f"against.py: the {label} run failed: {out['error']}\n{out['stderr']}", flush=True)
                failures.append({"side": name, "round": r + 1, "error": out["error"],
                                 "stderr_tail": out["stderr"][-1000:]})
                continue
            for key, value in flatten(out["result"]).items():
                values.setdefault(key, {s: [] for s in SIDES})[name].append(value)
    return values, failures


def summarise(values: dict) -> tuple[dict, dict]:
    """Each key's per-side median and runs, and new/old where both sides have it (and old is not 0)."""
    figures, ratios = {}, {}
    for key, by_side in values.items():
        fig = {s: statistics.median(v) for s, v in by_side.items() if v}
        fig.update({f"{s}_runs": v for s, v in by_side.items() if len(v) > 1})
        if "old" in fig and "new" in fig and fig["old"] != 0:
            ratios[key] = fig["new"] / fig["old"]
        figures[key] = fig
    return figures, ratios


def print_table(values: dict, figures: dict, ratios: dict) -> None:
    width = max([len(k) for k in figures] + [6])
    print(f"\n{'figure':<{width}}  {'old (median)':>14}  {'new (median)':>14}  {'new/old':>8}  {'runs':>5}")
    for key, fig in figures.items():
        cells = [f"{fig[s]:>14.6g}" if s in fig else f"{'-':>14}" for s in SIDES]
        ratio = f"{ratios[key]:>8.3f}" if key in ratios else f"{'-':>8}"
        runs = "/".join(str(len(values[key][s])) for s in SIDES)
        print(f"{key:<{width}}  {cells[0]}  {cells[1]}  {ratio}  {runs:>5}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    root = Path(__file__).resolve().parents[1]  # the new side: the tree this file belongs to
    sha = resolve_rev(root, args.rev)
    old, extension = prepare_old(root, args, sha)
    roots = {"old": old, "new": root}
    imports = {name: probe(name, side) for name, side in roots.items()}
    try:
        script = str(args.script.relative_to(root))
    except ValueError:
        script = str(args.script)
    print(f"against.py: {script} {' '.join(args.script_args)}".rstrip())
    print(f"  old = {args.rev} ({sha[:12]}): lightning_rec from {imports['old']}; extension {extension}")
    print(f"  new = working tree: lightning_rec from {imports['new']}", flush=True)
    values, failures = run_rounds(args, roots)
    figures, ratios = summarise(values)
    print_table(values, figures, ratios)
    for f in failures:
        print(f"FAILED: {f['side']} side, round {f['round']}: {f['error']}")
    print(json.dumps({"benchmark": "against", "rev": args.rev, "rev_commit": sha, "script": script,
                      "script_args": args.script_args, "rounds": args.rounds, "ratios": ratios, "figures": figures,
                      "sides": {n: {"root": str(roots[n]), "lightning_rec": imports[n]} for n in SIDES},
                      "extension": extension, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
