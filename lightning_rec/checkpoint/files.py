"""Files on disk: the commit that swaps a finished save in under its name, and the one-file format's writer and
reader (torch.save's zip, memory-mapped on load)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import shutil
import sys
import time
import uuid
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.serialization import config as serialization_config

from lightning_rec.checkpoint.format import partial_name
from lightning_rec.checkpoint.paths import REMOTE_SHARDED, is_local_path, local_path


def sees(directory: Path, wait_s: float = 2.0) -> bool:
    """Whether this process sees `directory`, which another rank just created (a network file system may show it a
    moment late: listing its parent asks the server again)."""
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError):
            if directory.name in os.listdir(directory.parent):
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def remove_stale(stale: Path) -> None:
    """A killed save's leftover, a directory (sharded format) or a file (gathered): either format's next save of that
    name removes both kinds."""
    if stale.is_dir() and not stale.is_symlink():
        shutil.rmtree(stale, ignore_errors=True)
    else:
        stale.unlink(missing_ok=True)


def remove_stale_partials(path: Path) -> None:
    for stale in path.parent.glob(f".{path.name}.partial-*"):
        remove_stale(stale)


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the OS or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc without it (glibc < 2.28, musl)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def commit(partial: Path, path: Path) -> None:
    """`partial` under the name `path`, replacing what is there."""
    if not (path.exists() or path.is_symlink()):
        os.replace(partial, path)
        return
    # swapped in one step, `path` is always one whole checkpoint (two renames killed between them left none)
    if exchange(partial, path):
        old = partial  # now holds the previous checkpoint
    else:
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(path, old)
        os.replace(partial, path)
    remove_stale(old)


def save_file(checkpoint: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write a gathered checkpoint (one process): torch.save straight into a temporary file, fsync, rename.

    Nothing is buffered in memory (Lightning's default writer first serialises the whole checkpoint
    into a BytesIO, then copies it out: twice the model on rank 0), and a save killed midway leaves
    the previous file whole (the next save of that name removes the leftover).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(path)
    tmp = partial_name(path, uuid.uuid4().hex[:12])
    try:
        with _no_crc32():
            torch.save(checkpoint, str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if path.is_dir() and not path.is_symlink():
            commit(tmp, path)  # a sharded checkpoint of that name: os.replace cannot put a file over a directory
        else:
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _no_crc32():
    """torch.save without the zip records' CRC32 (a switch every supported torch has): torch.load never checks
    it, and computing it costs more than the write itself. Completeness is what the rename guarantees."""
    before = serialization_config.save.compute_crc32
    serialization_config.save.compute_crc32 = False
    try:
        yield
    finally:
        serialization_config.save.compute_crc32 = before


def _load_remote_file(path: str) -> dict[str, Any]:
    """A one-file checkpoint at a URL, written through Lightning's CheckpointIO (fsspec): read so."""
    from lightning.fabric.utilities.cloud_io import get_filesystem

    try:
        fs = get_filesystem(path)
    except (ImportError, ValueError) as e:  # fsspec's backend for the scheme is not installed, or not known
        raise ValueError(f"checkpoint {path}: {e}. A one-file checkpoint is read from a URL through fsspec, which "
                         f"needs that package; {REMOTE_SHARDED}") from e
    if not fs.exists(str(path)):
        raise ValueError(f"checkpoint {path} does not exist: check the URL")
    if fs.isdir(str(path)):  # fsspec opened the directory as a file: IsADirectoryError
        raise ValueError(f"checkpoint {path} is a directory at a URL: {REMOTE_SHARDED}")
    with fs.open(str(path), "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=False)


def load_file(path: str | os.PathLike) -> dict[str, Any]:
    """A gathered (one-file) checkpoint, with a clear error when the file is cut short.

    The file is memory-mapped (torch.save's zip format): its tensors are read from disk only where
    a rank copies from them, so each rank pages in the pieces it keeps, not the whole model. Files
    in torch's legacy format (not a zip) are read whole.
    """
    path = local_path(path)
    if not is_local_path(path):
        return _load_remote_file(path)
    if not os.path.exists(path):  # not a damaged file: there is none (a typo, or a fit that saved nothing)
        raise ValueError(f"checkpoint {path} does not exist: check the path (a fit writes its checkpoints where "
                         f"ModelCheckpoint's dirpath says, by default <default_root_dir>/.../checkpoints)")
    try:
        mmap = zipfile.is_zipfile(path)
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as e:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        raise ValueError(f"checkpoint file {path} ({size} bytes) is incomplete or damaged and cannot be read ({e}): "
                         f"it was probably cut short by an interrupted save or copy (a full disk); copy it again from "
                         f"where it was written, or use an earlier checkpoint") from e


# what torch.load raises on a file cut short (Lightning's readers call it themselves)
UNREADABLE = (RuntimeError, OSError, EOFError, pickle.UnpicklingError)


def check_readable(path: Any) -> None:
    """After another reader (Lightning's) failed on a local one-file checkpoint: load_file's error when the file is cut
    short or damaged; nothing when it reads (that reader's own error stands)."""
    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
        load_file(path)
