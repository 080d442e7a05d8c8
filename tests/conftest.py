"""Shared test fixtures: where ../shared/data lives, and quiet, offline runs."""

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# ../shared/data beside the checkout; a copy of the checkout elsewhere (.ci/torch-range) names it
SHARED_DATA = Path(os.environ.get("LIGHTNING_REC_SHARED_DATA", REPO.parent / "shared" / "data"))

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture
def shared_data() -> Path:
    """../shared/data, or skip: the licences forbid copying it into the repo."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA}")
    return SHARED_DATA


# W&B is installed by the project's own files; a machine that lacks it (the lent GPU machine has no
# network to install it) skips the tests that log to it instead of failing them.
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs wandb (pip install wandb)")
