"""A battery of bad and edge inputs across the public surface: every case a clear error or a correct result.

    flock /tmp/lightning_rec_bench.lock .venv/bin/python benchmarks/bad_input_battery.py --threads 2
    flock /tmp/lightning_rec_bench.lock .venv/bin/python benchmarks/bad_input_battery.py --threads 16
    .venv/bin/python benchmarks/bad_input_battery.py --only kjt.      # the cases whose name contains "kjt."
    .venv/bin/python benchmarks/bad_input_battery.py --smoke          # a handful of cases per area (seconds)

Written from the README and the public API as a new user would try it, independently of
tests/test_bad_input*.py. Each case declares what correct behaviour is:

- `error=(ExceptionType, [words])`: the call must raise that type (or a subclass) and the message must
  contain every word (case-insensitive): the feature / table / file:line / argument the user wrote and
  the fix. `ctx.after(check)` registers a check that nothing was lost (weights, optimizer state, files),
  run after the error.
- no `error`: the case runs to the end and checks the result itself (`expect(...)`, against a plain
  torch reference where there is one). `ok=True` on an error case: a correct result is accepted too
  (inputs a library may either accept or refuse; the case then checks the result).

Classes: clear (the expected error with the words), unclear (an error of another type, or without
the words), correct (no error, the check passed), silent (no error where one was due, a failed
check, or state changed by a refused input), crash (the worker process died), hang (over the case's
time limit). Cases run in sequence in a worker process (torch imported once); a crash or hang
kills that worker and a new one takes the next case. Two-rank cases spawn their ranks with real
torch.distributed (tests/dist_utils.py) inside the case. Prints a table, then one JSON line (json.dumps in
benchmarks/bad_input/runner.py): {"benchmark": "bad_input_battery", "results": [...], "figures": {class counts}}.

The cases live in benchmarks/bad_input/, one module per area (sparse, embeddings, optim, planner,
metrics, criteo, movielens, models, cli, checkpoint, distributed); bad_input/runner.py runs them.

Output: one line per case (name, class, seconds, the first 160 characters of the message), then,
LAST, one JSON line {"benchmark": "bad_input_battery", "results": [...], "ratios": {}, "figures": {...}}
(figures: cases, threads, seconds and the count of each class).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bad_input/ beside this file, however it is run
from bad_input.runner import main  # noqa: E402

if __name__ == "__main__":
    main()
