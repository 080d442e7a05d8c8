"""The compiled extension `lightning_rec._C` (csrc/), loaded once: its ops register under torch.ops.lightning_rec."""

from __future__ import annotations

import torch

try:
    import lightning_rec._C  # noqa: F401  (registers torch.ops.lightning_rec.*)

    NATIVE_IMPORT_ERROR: Exception | None = None
except ImportError as e:  # not built: `pip install --no-build-isolation -e .` (make test does it)
    NATIVE_IMPORT_ERROR = e


def native_kernel_available() -> bool:
    """True when the C++ extension is built and its CPU kernels are registered."""
    return NATIVE_IMPORT_ERROR is None


def native_parser_available() -> bool:
    """True when the C++ extension is built and `torch.ops.lightning_rec.parse_criteo` exists."""
    return NATIVE_IMPORT_ERROR is None and hasattr(torch.ops.lightning_rec, "parse_criteo")


def native_op(name: str):
    """torch.ops.lightning_rec.<name>, or None without the compiled extension."""
    return getattr(torch.ops.lightning_rec, name) if NATIVE_IMPORT_ERROR is None else None
