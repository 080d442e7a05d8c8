"""Bad rows: what parsing a file did (`ParseReport`), the reason given for each kind of bad row, and what
`on_bad_row` does with them (raise for the first, or count and record the first few)."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

import numpy as np

from lightning_rec.data.criteo.layout import CriteoLayout

log = logging.getLogger(__name__)
MAX_REPORTED_BAD_ROWS = 20


@dataclass
class ParseReport:
    """What parsing one file did. `skipped` holds the first few (line, reason) of dropped rows."""

    path: str
    num_rows: int = 0
    num_padded_rows: int = 0
    num_skipped_rows: int = 0
    num_blank_lines: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)
    layout: dict | None = None

    @staticmethod
    def from_json(text: str) -> ParseReport:
        d = json.loads(text)
        d["skipped"] = [tuple(s) for s in d["skipped"]]
        return ParseReport(**d)

    def log_skips(self) -> None:
        """Warn once at the end of parsing about rows dropped or padded (never silent)."""
        if self.num_skipped_rows:
            first = "; ".join(f"line {ln}: {why}" for ln, why in self.skipped[:3])
            log.warning("%s: skipped %d bad rows (on_bad_row='skip'), kept %d. First: %s",
                        self.path, self.num_skipped_rows, self.num_rows, first)
        if self.num_padded_rows:
            log.warning("%s: %d of %d rows had fewer fields than the layout and were padded with missing values "
                        "(trailing empty fields stripped, as in some copies of train.txt); a row cut after a separator "
                        "is refused instead", self.path, self.num_padded_rows, self.num_rows,)


def minus_one_label_fix(reason: str, what: str) -> str | None:
    """The fix for a label of -1 (-1/1 labels: skipping bad rows would drop every negative); None for other reasons."""
    if not re.fullmatch(r"label must be 0 or 1, got '?-1(\.0*)?'?", reason.split(": ")[-1]):
        return None
    how = ("ds.map(lambda r: {'label': int(r['label'] > 0)}), or the label column as label > 0"
           if what == "table" else "sed 's/^-1/0/' FILE > NEW")
    return (f"The {what}'s labels look like -1/1: map -1 to 0 first ({how}); on_bad_row='skip' would drop every "
            f"negative row")


def raise_or_record(problems: list[tuple[np.ndarray, object, int]], on_bad_row: str, path: str,
                    report: ParseReport) -> None:
    """problems: (line numbers, reason(i) for the i-th of them, rank). Raise for the first line, or record. rank
    orders the faults of one line (the native op reports the same one): a non-ASCII byte (-3), too many fields (-2),
    a cut row (-1), else the field position of the first bad field; for one field read twice (a label column that is
    a feature too), the problem listed first, in both modes."""
    if not problems:
        return
    if on_bad_row == "error":
        first_line, _, _, reason = min(
            (int(lines.min()), rank, order, why(int(lines.argmin())))
            for order, (lines, why, rank) in enumerate(problems) if lines.size
        )
        raise ValueError(f"{path}:{first_line}: {reason}. " + (minus_one_label_fix(reason, "file") or (
            "Fix the file, or pass on_bad_row='skip' to drop such rows (they are counted and logged, never shifted)")))
    # one reason per line (the first by rank), the first few lines of the block
    seen: dict[int, tuple[int, str]] = {}
    for lines, why, rank in problems:
        for i in np.argsort(lines, kind="stable")[:MAX_REPORTED_BAD_ROWS]:
            line = int(lines[i])
            if line not in seen or rank < seen[line][0]:
                seen[line] = (rank, why(int(i)))
    for line in sorted(seen)[: max(0, MAX_REPORTED_BAD_ROWS - len(report.skipped))]:
        report.skipped.append((line, seen[line][1]))
    report.skipped.sort()


def field_name(layout: CriteoLayout, k: int) -> str:
    """What field k (0-based) of a row holds: label, I1..I13, C1..C26, or an unused column."""
    if k == layout.label_field:
        return "label"
    if k in layout.label_columns.values():
        return f"label {next(c for c, f in layout.label_columns.items() if f == k)!r}"
    if k in layout.dense_fields:
        return f"I{layout.dense_fields.index(k) + 1}"
    if k in layout.sparse_fields:
        return f"C{layout.sparse_fields.index(k) + 1}"
    return f"column {k + 1}"


def non_ascii_reason(layout: CriteoLayout, k: int, byte: int) -> str:
    return (
        f"field {k + 1} ({field_name(layout, k)}) holds the non-ASCII byte 0x{byte:02x}: Criteo files are ASCII "
        f"text, so the file is corrupt here (or not a Criteo file)"
    )


def stray_cr_reason(layout: CriteoLayout, k: int) -> str:
    return (
        f"field {k + 1} ({field_name(layout, k)}) holds a carriage return (\\r) that does not end the line (a file "
        f"converted to CRLF twice?): remove the extra \\r (e.g. `sed -i 's/\\r*$//' FILE`)"
    )


def cut_reason(layout: CriteoLayout, count: int) -> str:
    return (
        f"{count} of {layout.num_fields} fields and the row ends in a separator: it was cut short "
        f"(a truncated file?), not stripped of empty trailing fields"
    )


def too_many_reason(layout: CriteoLayout, count: int) -> str:
    return f"{count} fields, but this file's rows have {layout.num_fields}"
