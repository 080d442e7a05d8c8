"""Where a checkpoint may live: a local or mounted path, or a file:// URL naming one. Other URLs are refused
(naming the fix) by the calls that write or read directories; the one-file format reads them through fsspec."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse


def is_local_path(path: str | os.PathLike) -> bool:
    """A path on this machine's file system (not a URL such as s3://...)."""
    return "://" not in str(path)


def local_path(path: Any) -> Any:
    """A file:// URL as the local path it names (Path() would make 'file:/tmp/x' of it); anything else as given."""
    if isinstance(path, (str, os.PathLike)) and str(path).startswith("file://"):
        parsed = urlparse(str(path))
        if parsed.netloc in ("", "localhost"):
            return unquote(parsed.path)
    return path


REMOTE_SHARDED = ("a sharded checkpoint (a directory, checkpoint_format='dcp') is read by every rank from a local or "
                  "mounted file system, not from a URL: copy the directory to a local or mounted path (aws s3 cp "
                  "--recursive, gsutil -m cp -r, ...) and give that path; only the one-file format "
                  "(RecStrategy(checkpoint_format='gathered')) is read straight from a URL, through fsspec")


def readable_path(path: str | os.PathLike) -> Path:
    """A path the readers can open: a file:// URL's local path; any other URL refused, naming the fix (Path()
    mangled 's3://b/x' into 's3:/b/x' and said it did not exist)."""
    path = local_path(path)
    if not is_local_path(path):
        raise ValueError(f"checkpoint {path} is a URL, and lightning_rec.checkpoint reads checkpoints from a local or "
                         f"mounted file system: copy it there (a sharded checkpoint is a directory: aws s3 cp "
                         f"--recursive, gsutil -m cp -r, ...) and give that path. Trainer(strategy='rec') resumes from "
                         f"a one-file checkpoint (checkpoint_format='gathered') at a URL too, through fsspec")
    return Path(path)


def refuse_url(path: str | os.PathLike) -> None:
    """Every rank writes its pieces with local file calls: an s3:// path would become a local directory named `s3:`.
    Refused on every rank, before any collective. A file:// URL names a local path: written there."""
    if not is_local_path(local_path(path)):
        head = str(path).split("://")[0]
        raise ValueError(f"checkpoint {path} is a URL, but sharded checkpoints are written by every rank to a local or "
                         f"mounted file system (it would have gone to a local directory named '{head}:'): give "
                         f"ModelCheckpoint(dirpath=...) a local or mounted path (copy it to {head}:// after), or use "
                         f"RecStrategy(checkpoint_format='gathered'), one file written through Lightning's "
                         f"CheckpointIO (fsspec: s3://, gs://, ...)")


def refuse_resolved_file_url(dirpath: str | os.PathLike) -> None:
    """ModelCheckpoint(dirpath="file:///data/ckpt"): Lightning (2.6) resolves a dirpath it takes for local with
    os.path.realpath, which reads "file:" as a directory name (<cwd>/file:/data/ckpt). Refused before training."""
    parts = Path(dirpath).parts
    if is_local_path(dirpath) and "file:" in parts:
        at = parts.index("file:")
        meant = Path("/", *parts[at + 1:])
        raise ValueError(f"ModelCheckpoint(dirpath=...) was given as a file:// URL, which Lightning resolves against "
                         f"the working directory: its checkpoints would go to {dirpath}, not {meant}. Give the path "
                         f"itself: ModelCheckpoint(dirpath={str(meant)!r})")
