"""Byte chunks of a text file cut at line ends, and the index of the lines of one chunk.

Line ends are those of Python's universal newlines (``open(path, newline=None)``, what the per-line
reader iterates): ``"\\r\\n"``, a lone ``"\\r"`` or ``"\\n"``. The arrow parser gets one chunk at a
time, and this index gives each of the chunk's lines its byte range, so line numbers, blank lines and
field counts never depend on pyarrow's own row numbering.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import numpy as np

DEFAULT_CHUNK_BYTES = 8 << 20


def iter_byte_chunks(path: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """Consecutive pieces of the file that concatenate to its bytes; every piece but the last ends
    right after a line end (never between the ``"\\r"`` and ``"\\n"`` of one ``"\\r\\n"``). A line
    longer than ``chunk_bytes`` makes its piece longer. An empty file gives no piece.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    carry = b""
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            if not block:
                if carry:
                    yield carry
                return
            buf = carry + block if carry else block
            cut = _last_cut(buf)
            if cut == 0:
                carry = buf
                continue
            yield buf[:cut]
            carry = buf[cut:]


def _last_cut(buf: bytes) -> int:
    """Offset just past the last line end of ``buf`` that is complete whatever bytes follow; 0 if none."""
    nl = buf.rfind(b"\n")
    cr = buf.rfind(b"\r")
    if cr > nl and cr < len(buf) - 1:
        return cr + 1  # a lone "\r": the byte after it is not "\n"
    return nl + 1  # (a "\r" as the last byte may be the first half of "\r\n": cut before it)


class LineIndex(NamedTuple):
    """Byte ranges of the lines of one chunk: ``start`` / ``end`` (int64 ``[L]``, ``end`` excludes
    the line end). A chunk that does not end with a line end has its tail as a last line."""

    start: np.ndarray
    end: np.ndarray

    @property
    def blank(self) -> np.ndarray:
        """bool ``[L]``: the line is empty."""
        return self.start == self.end


def index_lines(buf: bytes) -> LineIndex:
    """The :class:`LineIndex` of ``buf`` (universal newlines)."""
    b = np.frombuffer(buf, dtype=np.uint8)
    nl = b == 10
    if buf.find(b"\r") < 0:
        last = np.flatnonzero(nl)  # last byte of each line end
        first = last  # first byte of each line end
    else:
        cr = b == 13
        crlf = np.zeros(len(b), dtype=bool)  # "\n" bytes preceded by "\r"
        crlf[1:] = nl[1:] & cr[:-1]
        lone_cr = cr.copy()
        lone_cr[:-1] &= ~nl[1:]
        last = np.flatnonzero(nl | lone_cr)
        first = last - crlf[last]
    start = np.empty(len(last), dtype=np.int64)
    if len(last):
        start[0] = 0
        start[1:] = last[:-1] + 1
    end = first.astype(np.int64)
    tail = int(last[-1]) + 1 if len(last) else 0
    if tail < len(b):
        start = np.append(start, tail)
        end = np.append(end, len(b))
    return LineIndex(start, end)


def field_counts(buf: bytes, lines: LineIndex, delimiter: bytes) -> np.ndarray:
    """int64 ``[L]``: fields per line, ``str.split(delimiter)`` 's count (delimiters + 1; a blank
    line counts 1). ``delimiter`` is one ASCII byte."""
    d = np.flatnonzero(np.frombuffer(buf, dtype=np.uint8) == delimiter[0])
    return np.searchsorted(d, lines.end) - np.searchsorted(d, lines.start) + 1
