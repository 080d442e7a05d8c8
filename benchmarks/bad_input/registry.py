"""The battery's cases: each declares what correct behaviour is (see benchmarks/bad_input_battery.py)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

CLASSES = ("clear", "correct", "unclear", "silent", "crash", "hang", "skipped")


@dataclass
class Case:
    name: str
    fn: object
    error: type | tuple | None = None
    words: tuple = ()
    ok: bool = False  # an error case whose input may also be accepted (then fn checks the result)
    timeout: float = 20.0
    legit: str = ""  # why a correct result is right, for inputs some would call bad


CASES: dict[str, Case] = {}


def case(name: str, error=None, words=(), ok: bool = False, timeout: float = 20.0, legit: str = ""):
    def deco(fn):
        assert name not in CASES, name
        CASES[name] = Case(name, fn, error, tuple(words), ok, timeout, legit)
        return fn
    return deco


def simple(name: str, thunk, error, words, **kw):
    """A one-call case: thunk() must raise `error` naming `words`."""
    case(name, error, words, **kw)(lambda ctx: thunk())


class Silent(AssertionError):
    """A check failed: a wrong result, or state changed by a refused input."""


class Skipped(Exception):
    """The case reads real data (../shared/data) that is absent here."""


class Hang(Exception):
    pass


class Crash(Exception):
    pass


class RemoteError(Exception):
    """An exception raised on a rank: its class names (MRO) and message."""

    def __init__(self, names, message):
        super().__init__(message)
        self.names = list(names)


def expect(cond, what: str) -> None:
    if not cond:
        raise Silent(what)


class Ctx:
    def __init__(self) -> None:
        self.afters = []
        self.tmp = Path(tempfile.mkdtemp(prefix="battery_"))

    def after(self, fn) -> None:
        self.afters.append(fn)
