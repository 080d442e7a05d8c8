"""Several labels per row: the columns a data module reads as named tasks, NaN where a label is missing.

`label_columns` is a list of column names (each a task of that name, its values as they are: 0/1 or real-valued) or a
mapping task -> "column" or "column OP value" (OP one of >=, >, <=, <, ==, !=: a binary task derived from a column,
e.g. {"liked": "rating >= 4", "loved": "rating == 5"}; == and != also compare text: "marital == Never married").
`label_masks` maps a task to a column whose 0 / null rows have no label for that task. A missing label (NaN in the
column, a null, or masked) stays NaN: the model leaves it out of that task's loss and metrics, never reads it as 0."""

from __future__ import annotations

import difflib
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq, "!=": operator.ne}
_RULE = re.compile(r"^\s*([^<>=!]+?)\s*(>=|<=|==|!=|>|<)\s*(.+?)\s*$")


@dataclass(frozen=True)
class LabelSpec:
    task: str
    column: str
    op: str | None = None  # a comparison making a binary label, or None: the column's values
    threshold: float | str | None = None  # a str: == / != compare the column's text (stripped)
    mask: str | None = None


def label_specs(label_columns: Sequence[str] | Mapping[str, str], label_masks: Mapping[str, str] | None = None,
                where: str = "label_columns") -> list[LabelSpec]:
    """The tasks `label_columns` names, in order (checked here: at the data module's construction)."""
    if isinstance(label_columns, str) or not label_columns:
        raise ValueError(f"{where}={label_columns!r}: give a list of label columns (['click', 'purchase']) or a "
                         f"mapping task -> column or 'column OP number' ({{'liked': 'rating >= 4'}})")
    rules = dict(label_columns) if isinstance(label_columns, Mapping) else {c: c for c in label_columns}
    if len(rules) != len(list(label_columns)):
        raise ValueError(f"{where}={list(label_columns)!r} names a task twice: give each task once")
    masks = dict(label_masks or {})
    unknown = sorted(set(masks) - set(rules))
    if unknown:
        raise ValueError(f"label_masks names tasks {unknown} that label_columns does not ({list(rules)}): use the "
                         f"task names of label_columns")
    specs = []
    for task, rule in rules.items():
        match = _RULE.match(str(rule))
        if match:
            column, op, number = match.groups()
            try:
                threshold = float(number)
            except ValueError:
                if op not in ("==", "!="):
                    raise ValueError(f"{where}: task {task!r} = {rule!r}: {number!r} is not a number") from None
                threshold = number.strip("'\"")
            specs.append(LabelSpec(str(task), column, op, threshold, masks.get(task)))
        elif any(c in str(rule) for c in "<>=!"):
            raise ValueError(f"{where}: task {task!r} = {rule!r}: write a derived label as 'column OP number' with OP "
                             f"one of {', '.join(_OPS)} (e.g. 'rating >= 4')")
        else:
            specs.append(LabelSpec(str(task), str(rule).strip(), mask=masks.get(task)))
    return specs


def source_columns(specs: Sequence[LabelSpec]) -> list[str]:
    """The columns the tasks read, each once, in order: their label columns, then their mask columns."""
    return list(dict.fromkeys([s.column for s in specs] + [s.mask for s in specs if s.mask is not None]))


def check_label_columns(specs: Sequence[LabelSpec], available: Sequence[str], where: str) -> None:
    """Every column the tasks read exists; else one line naming it, the nearest name and the columns there are."""
    for spec in specs:
        for column in (spec.column, spec.mask):
            if column is not None and column not in available:
                near = difflib.get_close_matches(column, list(available), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ValueError(f"{where}: task {spec.task!r} reads column {column!r}, which is not there{hint}: "
                                 f"its columns are {list(available)}; fix label_columns / label_masks")


def label_matrix(specs: Sequence[LabelSpec], column: Callable[[str], np.ndarray]) -> Tensor:
    """[N, T] float32 labels, one column per task, NaN where missing (`column(name)`: a column's values, nulls NaN)."""
    out = []
    for spec in specs:
        raw_N = column(spec.column)
        if isinstance(spec.threshold, str):  # a text column compared to a value
            missing_N = np.array([v is None for v in raw_N], dtype=bool)
            values_N = _OPS[spec.op](np.array([str(v).strip() for v in raw_N]), spec.threshold).astype(np.float64)
        else:
            values_N = np.asarray(raw_N, dtype=np.float64)
            missing_N = np.isnan(values_N)
        if spec.op is not None and not isinstance(spec.threshold, str):
            values_N = _OPS[spec.op](values_N, spec.threshold).astype(np.float64)
        if spec.mask is not None:
            mask_N = np.asarray(column(spec.mask), dtype=np.float64)
            missing_N |= np.isnan(mask_N) | (mask_N == 0)
        out.append(np.where(missing_N, np.nan, values_N).astype(np.float32))
    return torch.from_numpy(np.stack(out, axis=1)) if out else torch.zeros(0, 0)
