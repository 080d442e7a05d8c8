"""Imports point down the layers of docs/design.md, function-level imports included; no module imports one above it.

A module's floor is the first prefix of FLOORS that its dotted name starts with; importing a module on a
higher floor fails here, naming both. Within a floor, imports may go either way but never round in a cycle.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "lightning_rec"

FLOORS = [  # lowest first
    ("types", "errors", "fqn", "_compat", "_device", "_native", "table_weight", "sharding.sharded_tensor", "metrics"),
    ("collective_guard", "shm_transport", "comm"),
    ("sparse",),
    ("data",),
    ("optim.config", "optim.fused_paths", "native_embedding", "batch_check", "lookup"),
    ("embedding_configs", "embedding"),
    ("optim",),
    ("managed_collision",),
    ("sharding", "planner"),
    ("input_dist", "output_dist", "sharded_embedding", "sharded_managed_collision"),
    ("model_parallel", "plan_verbs", "plan_checks", "dense_compile"),
    ("pipeline",),
    ("serving",),
    ("checkpoint",),
    ("strategy", "_strategy"),
    ("models",),
    ("predict", "predict_rows", "cli", "fx"),
    ("torchrec",),  # TorchRec's module paths: re-exports over everything below
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _floor(name: str) -> int:
    best = None
    for i, prefixes in enumerate(FLOORS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"lightning_rec.{name} has no floor in tests/test_layering.py: add it to FLOORS"
    return best[0]


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that `name` imports, at any depth of the file (TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
                   for b in node.body for n in ast.walk(b)}
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(["lightning_rec"] + here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            if not t.startswith("lightning_rec."):
                continue
            t = t[len("lightning_rec."):]
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name and not (is_pkg and t.startswith(name + ".")):
                found.add(t)
    return found


MODULES = _modules()
GRAPH = {m: _imports(m, p, MODULES) for m, p in MODULES.items() if m}  # the root package re-exports all


def test_no_import_points_up():
    upward = [f"lightning_rec.{m} (floor {_floor(m)}) imports lightning_rec.{t} (floor {_floor(t)})"
              for m, targets in sorted(GRAPH.items()) for t in sorted(targets) if t and _floor(t) > _floor(m)]
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_no_import_cycles():
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("name", ["types", "errors", "fqn", "_compat", "_device", "_native", "table_weight"])
def test_leaves_import_nothing_of_ours(name):
    assert all(_floor(t) == 0 for t in GRAPH[name]), GRAPH[name]


def test_modules_and_functions_stay_small():
    """docs/design.md: a module holds one concept (at most 850 lines), a function does one thing (at most 80 lines,
    from its first decorator to its last line)."""
    big = [f"{p.relative_to(ROOT.parent)}: {n} lines" for p in MODULES.values()
           if (n := len(p.read_text().splitlines())) > 850]
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                if node.end_lineno - start + 1 > 80:
                    long.append(f"{path.relative_to(ROOT.parent)}:{start} {node.name}: {node.end_lineno - start + 1}")
    assert not big and not long, "\n".join(["modules over 850 lines:", *big, "functions over 80 lines:", *long])
