"""Criteo text -> blocks of whole lines, read in `block_bytes` steps: what the parsers take.

Three readers: `iter_blocks` (bytes, with the first line's number), `iter_blocks_resumable` (the same, with the position
to resume from; streaming uses it) and `iter_line_blocks` (one reused uint8 buffer and byte offsets; the native parser
and preprocess use it). Compressed files are read through Arrow's decompressing stream."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from lightning_rec.data.criteo.layout import BOM, file_compression, open_criteo_stream, unreadable


def iter_blocks(path: str | os.PathLike, block_bytes: int, skip_header: bool) -> Iterator[tuple[bytes, int]]:
    """Yield (whole lines ending in b"\\n", 1-based line number of the first) from a file. gzip/bz2/zstd files are
    read through Arrow's decompressing stream (detected from the first bytes)."""
    for block, line, _ in iter_blocks_resumable(path, block_bytes, skip_header):
        yield block, line


def iter_blocks_resumable(path: str | os.PathLike, block_bytes: int, skip_header: bool,
                          start: dict | None = None) -> Iterator[tuple[bytes, int, dict]]:
    """iter_blocks, each block with the reader's position before it (`start` resumes there). The position is {"read",
    "rest" (the cut line carried over), "line", "skip_header"}: reading on from it cuts the same blocks as the first
    pass. A compressed stream cannot seek: it is decompressed up to "read" (not parsed)."""
    read, rest, line = 0, b"", 1
    if start is not None:
        read, rest, line = int(start["read"]), bytes(start["rest"]), int(start["line"])
        skip_header = start["skip_header"]
    with open_criteo_stream(path) as stream:
        if read:
            if stream.seekable():
                stream.seek(read)
            else:
                left = read
                while left:
                    got = len(stream.read(min(left, block_bytes)))
                    if not got:
                        raise ValueError(f"{path} is shorter than the saved reading position ({read} bytes of text): "
                                         f"the file changed since the position was saved; start the epoch over")
                    left -= got
        if not read:  # the text's first bytes: a byte-order mark is skipped, anything else carried over
            try:
                rest = stream.read(len(BOM))
            except OSError as e:
                raise unreadable(path, e) from e
            read = len(rest)
            rest = b"" if rest == BOM else rest
        while True:
            position = {"read": read, "rest": rest, "line": line, "skip_header": skip_header}
            try:
                chunk = stream.read(block_bytes)
            except OSError as e:
                raise unreadable(path, e) from e
            read += len(chunk)
            data = rest + chunk if rest else chunk
            if not chunk:
                if data:
                    # The last line may lack its newline (e.g. pytorch-fm's train.txt).
                    for block, first in _emit(data + b"\n", line, skip_header):
                        yield block, first, position
                return
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                rest = data
                continue
            block, rest = data[:cut], data[cut:]
            for piece, first in _emit(block, line, skip_header):
                yield piece, first, position
            if skip_header and line == 1:
                skip_header = False
            line += block.count(b"\n")


def iter_line_blocks(path: str | os.PathLike, block_bytes: int, skip_header: bool, start_byte: int = 0,
                     progress=None) -> Iterator[tuple[np.ndarray, int]]:
    """Yield (whole lines ending in b"\\n" as a uint8 view, byte offset after them) from `start_byte` of the text.

    The native parser's reader: text is read into one reused buffer, so each view is valid only until the next. Offsets
    count the decompressed text. `skip_header` drops the first line when starting at byte 0; `progress(n)` is called
    with the bytes of the file itself read so far."""
    compression = file_compression(path)
    raw = pa.OSFile(str(path), "rb")
    stream = pa.CompressedInputStream(raw, compression) if compression else raw
    try:
        _seek(stream, raw, path, start_byte, block_bytes, compression)
        buf = np.empty(max(block_bytes, len(BOM)), dtype=np.uint8)
        filled, pos = _skip_bom(stream, buf, path) if start_byte == 0 else (0, start_byte)
        header = skip_header and start_byte == 0
        while True:
            if filled == buf.size:  # a line longer than the buffer: grow it
                buf = np.concatenate([buf, np.empty(buf.size, dtype=np.uint8)])
            got = _read_into(stream, buf, filled, path)
            if progress is not None:
                progress(raw.tell())
            if got == 0:
                if filled and not header:
                    yield _last_lines(buf, filled), pos + filled
                return  # (a header alone: no data rows)
            filled += got
            start = 0
            if header:
                nl = np.flatnonzero(buf[:filled] == 10)
                if nl.size == 0:
                    continue
                start = int(nl[0]) + 1
                header = False
            cut = _last_newline(buf, start, filled)
            if cut <= start:
                if start:
                    buf[: filled - start] = buf[start:filled]
                    pos, filled = pos + start, filled - start
                continue
            yield buf[start:cut], pos + cut
            rest = filled - cut
            buf[:rest] = buf[cut:filled]  # the cut line's start moves to the front (overlap-safe in numpy)
            pos, filled = pos + cut, rest
    finally:
        raw.close()


def _seek(stream, raw, path, start_byte: int, block_bytes: int, compression) -> None:
    """Position the stream at `start_byte` of the text: a seek in plain files, reading past it in compressed ones."""
    if start_byte and compression is None:
        raw.seek(start_byte)
        return
    left = start_byte
    while left:
        got = len(stream.read(min(left, block_bytes)))
        if got == 0:
            raise ValueError(f"{path} is shorter than byte {start_byte}: the file changed since it was read")
        left -= got


def _read_into(stream, buf: np.ndarray, filled: int, path) -> int:
    try:
        return stream.readinto(memoryview(buf)[filled:])
    except OSError as e:
        raise unreadable(path, e) from e


def _skip_bom(stream, buf: np.ndarray, path) -> tuple[int, int]:
    """(bytes kept in buf, text offset) after the first bytes: a byte-order mark is skipped (offsets count it)."""
    try:
        filled = stream.readinto(memoryview(buf)[:len(BOM)])
    except OSError as e:
        raise unreadable(path, e) from e
    return (0, len(BOM)) if bytes(buf[:filled]) == BOM else (filled, 0)


def _last_lines(buf: np.ndarray, filled: int) -> np.ndarray:
    """The text's last lines, given a newline if the file lacks its final one."""
    if buf[filled - 1] == 10:
        return buf[:filled]
    if filled == buf.size:
        buf = np.concatenate([buf, np.empty(1, dtype=np.uint8)])
    buf[filled] = 10
    return buf[:filled + 1]


def _last_newline(buf: np.ndarray, start: int, end: int) -> int:
    """1 + index of the last b"\\n" in buf[start:end], or `start` when there is none (looks back 64 KiB at a time)."""
    hi = end
    while hi > start:
        lo = max(start, hi - (1 << 16))
        hits = np.flatnonzero(buf[lo:hi] == 10)
        if hits.size:
            return lo + int(hits[-1]) + 1
        hi = lo
    return start


def _emit(block: bytes, line: int, skip_header: bool) -> Iterator[tuple[bytes, int]]:
    if skip_header and line == 1:
        nl = block.index(b"\n") + 1
        block, line = block[nl:], 2
    if block:
        yield block, line
