"""benchmarks/against.py: one benchmark script run against the library at REV and at the working tree."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
AGAINST = REPO / "benchmarks" / "against.py"

# The side is told apart twice: by where `lightning_rec` was imported from, and by the variable the tool sets.
DUMMY = f"""
import json, os
import lightning_rec
print(lightning_rec.__file__)
own = lightning_rec.__file__.startswith({str(REPO / "lightning_rec")!r})
if os.environ["LIGHTNING_REC_AGAINST_SIDE"] == "old" and os.environ.get("DUMMY_FAIL_OLD"):
    raise SystemExit("the old library refuses this")
print(json.dumps({{"benchmark": "dummy", "figures": {{"n": 3, "tree": 2 if own else 1}},
                  "results": [{{"variant": "a", "x": 1.5}}, {{"variant": "b", "x": 2}}], "flag": True}}))
"""


def _git_toplevel() -> bool:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    return done.returncode == 0 and Path(done.stdout.strip()).resolve() == REPO


pytestmark = pytest.mark.skipif(not _git_toplevel(), reason="needs the repository's git history")


def _against(tmp_path, *extra, env=None):
    script = tmp_path / "dummy.py"
    script.write_text(DUMMY)
    cmd = [sys.executable, str(AGAINST), "HEAD", "--rounds", "2", "--cache", str(tmp_path / "cache"), *extra,
           "--", str(script)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def test_against_head_runs_both_sides_alternately(tmp_path):
    done = _against(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout.splitlines()
    report = json.loads(out[-1])
    assert report["benchmark"] == "against" and report["rev"] == "HEAD" and report["failures"] == []
    old_root = Path(report["sides"]["old"]["root"])
    assert old_root.parent == tmp_path / "cache"
    assert report["sides"]["new"]["root"] == str(REPO)
    # each run printed its own side's lightning_rec (the echoed stdout), old then new, then new then old
    printed = [(line.split("]")[0][1:], line.split("] ", 1)[1]) for line in out if line.endswith("__init__.py")
               and line.startswith("[")]
    assert [label for label, _ in printed] == ["old 1/2", "new 1/2", "new 2/2", "old 2/2"]
    for label, path in printed:
        side_root = old_root if label.startswith("old") else REPO
        assert Path(path) == side_root / "lightning_rec" / "__init__.py"
    # every number, flattened (bools left out; a list of named dicts keyed by the names); new/old per key
    assert report["ratios"] == {"figures.n": 1.0, "figures.tree": 2.0, "results.a.x": 1.0, "results.b.x": 1.0}
    assert report["figures"]["figures.tree"] == {"old": 1.0, "new": 2.0, "old_runs": [1.0, 1.0],
                                                 "new_runs": [2.0, 2.0]}
    assert any(line.startswith("figures.tree") and "2.000" in line for line in out)
    # a second call reuses the checkout in the cache
    again = _against(tmp_path)
    assert again.returncode == 0 and json.loads(again.stdout.splitlines()[-1])["sides"]["old"]["root"] == str(old_root)


def test_against_reports_a_side_that_fails(tmp_path):
    done = _against(tmp_path, "--quiet", env={**os.environ, "DUMMY_FAIL_OLD": "1"})
    assert done.returncode == 1
    report = json.loads(done.stdout.splitlines()[-1])
    assert [(f["side"], f["round"]) for f in report["failures"]] == [("old", 1), ("old", 2)]
    assert "the old library refuses this" in report["failures"][0]["stderr_tail"]
    assert report["ratios"] == {} and report["figures"]["figures.tree"] == {"new": 2.0, "new_runs": [2.0, 2.0]}


def test_flatten_keys_lists_of_dicts_by_their_names():
    sys.path.insert(0, str(AGAINST.parent))
    try:
        from against import flatten
    finally:
        sys.path.remove(str(AGAINST.parent))
    results = [{"variant": "ours", "optimizer": "sgd", "x": 1}, {"variant": "native", "optimizer": "sgd", "x": 2},
               {"variant": "native", "optimizer": "sgd", "threads": 1, "x": 3}]
    assert flatten({"results": results, "per_run": [0.5, 0.7], "ok": True, "name": "x", "nan": float("nan")}) == {
        "results.ours/sgd.x": 1.0, "results.native/sgd.x": 2.0, "results.native/sgd~2.threads": 1.0,
        "results.native/sgd~2.x": 3.0, "per_run.0": 0.5, "per_run.1": 0.7}
