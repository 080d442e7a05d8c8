"""Message helpers: how an error shows the values it names. One place, so every refusal reads alike.

User errors raise ValueError (TypeError for a value of the wrong kind) and name the fix; these helpers format, and
`refuse_non_finite` is the one check every module's constructor shares. A leaf: imports nothing of lightning_rec."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any


def some(names: Sequence[str], shown: int = 5) -> str:
    """`['a', 'b', ...] (12 in all)`: the first few names, quoted, and how many there are."""
    head = ", ".join(f"'{n}'" for n in names[:shown])
    return f"[{head}]" if len(names) <= shown else f"[{head}, ...] ({len(names)} in all)"


def short_list(names: Sequence[str], shown: int = 8) -> str:
    """`a, b ... (12 in all)`: the first few names in sorted order, and how many there are."""
    names = sorted(names)
    return ", ".join(names[:shown]) + (f" ... ({len(names)} in all)" if len(names) > shown else "")


def short_repr(obj: Any, width: int = 80) -> str:
    """repr(obj), cut to `width` characters."""
    text = repr(obj)
    return text if len(text) <= width else text[: width - 3] + "..."


def plain(value: Any) -> str:
    """repr of an enum's value (`'row_wise'`, not `<ShardingType.ROW_WISE: 'row_wise'>`), else repr."""
    return repr(value.value) if isinstance(value, enum.Enum) else repr(value)


def is_int(value: Any) -> bool:
    """An int that is not a bool (True is an int to Python, never a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def refuse_non_finite(owner: str, arguments: Mapping[str, Any]) -> None:
    """Refuse a NaN or infinite float among a constructor's arguments, by name: a `<= 0` check lets NaN through, and
    one step with it writes NaN into every row the step touches."""
    bad = {k: v for k, v in arguments.items() if isinstance(v, float) and not math.isfinite(v)}
    if bad:
        raise ValueError(f"{owner}({', '.join(f'{k}={v!r}' for k, v in bad.items())}): give a finite number")


class NoTorchScript:
    """torch.jit.script of this class, of an instance, or of a module holding one, refused in one line:
    `torch.jit.script` calls `__prepare_scriptable__` first (TorchScript is deprecated by PyTorch)."""

    @classmethod
    def __prepare_scriptable__(cls):
        raise RuntimeError(f"torch.jit.script: lightning_rec's {cls.__name__} does not support TorchScript (deprecated "
                           f"by PyTorch): use torch.export or torch.compile, or torch.fx via "
                           f"lightning_rec.torchrec.fx.symbolic_trace")
