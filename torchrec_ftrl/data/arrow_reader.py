"""The arrow parser of :class:`~.reader.CTRFileReader`: pyarrow's C++ CSV parser on byte chunks.

Per file, :func:`~.line_chunks.iter_byte_chunks` cuts the bytes at line ends (8 MiB chunks by
default) and :func:`~.line_chunks.index_lines` gives every line of a chunk its byte range, so line
numbers, blank lines and field counts follow the per-line reader's universal newlines exactly. One
``pyarrow.csv.read_csv`` per chunk (no quoting, no escapes, one null per empty field, every used
column as binary) splits the lines with the right field count into columns; lines with another count
are skipped by its ``invalid_row_handler``. :mod:`.columns` decodes each column with numpy /
pyarrow.compute and marks the values it cannot settle exactly. Every line that is not settled there
(wrong field count, a value outside the simple forms, a malformed value) goes through
:class:`~.reader.LineParser` on its own text, so valid rows, ids, dense bits, labels, ``ReadStats``
(counts, reasons, the first examples) and ``--strict`` messages equal the per-line parser's.

Whole chunks go to the per-line code when pyarrow cannot take them (a chunk starting with a UTF-8
byte-order mark, which pyarrow would drop; a skipped line with invalid UTF-8, which pyarrow's
handler cannot decode) or when pyarrow's row counts disagree with the line index (a safety net).
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from . import columns
from .line_chunks import LineIndex, field_counts, index_lines, iter_byte_chunks
from .line_parser import RowChunk, _Bad, parse_lines, record_bad, rows_to_chunks

_BOM = b"\xef\xbb\xbf"


class _Plan:
    """What to ask pyarrow for and how to decode it, for one resolved spec."""

    def __init__(self, reader) -> None:
        r = reader.resolved()
        spec = reader.spec
        self.r = r
        self.delimiter = spec.delimiter
        self.names = [f"c{i}" for i in range(r.num_fields)]
        self.used = sorted({r.label, *r.dense, *r.categorical})
        self.int_dense = spec.dense_type == "int"
        self.log = spec.dense_transform == "log"
        self.hex = spec.categorical_encoding == "hex"
        self.num_embeddings = list(reader.num_embeddings)
        self.convert = pacsv.ConvertOptions(
            include_columns=[self.names[i] for i in self.used],
            column_types={self.names[i]: pa.binary() for i in self.used},
            null_values=[""], strings_can_be_null=True, quoted_strings_can_be_null=True)

    def read(self, buf: bytes) -> Tuple[pa.Table, int]:
        """``(table, lines skipped for their field count)``; raises ``pa.ArrowInvalid``."""
        skipped = [0]

        def handler(row) -> str:
            skipped[0] += 1
            return "skip"

        table = pacsv.read_csv(
            pa.py_buffer(buf),
            read_options=pacsv.ReadOptions(column_names=self.names, use_threads=False,
                                           block_size=len(buf) + 1),
            parse_options=pacsv.ParseOptions(delimiter=self.delimiter, quote_char=False,
                                             double_quote=False, escape_char=False,
                                             newlines_in_values=False, ignore_empty_lines=True,
                                             invalid_row_handler=handler),
            convert_options=self.convert)
        return table, skipped[0]

    def decode(self, table: pa.Table) -> Tuple[RowChunk, np.ndarray]:
        """``(rows, ok)``: the decoded rows of ``table`` and bool ``[n]``, False where a row must go
        through the per-line parser (its values in ``rows`` are then meaningless)."""
        r = self.r

        def col(i: int) -> pa.Array:
            return table.column(self.names[i]).combine_chunks()

        n = table.num_rows
        labels, ok = columns.decode_label(col(r.label))
        dense = np.empty((n, len(r.dense)))
        for j, i in enumerate(r.dense):
            x, good = (columns.decode_int if self.int_dense else columns.decode_float)(col(i))
            dense[:, j] = columns.log1p_exact(x) if self.log else x
            ok &= good
        ids = np.empty((n, len(r.categorical)), dtype=np.int64)
        for j, (i, ne) in enumerate(zip(r.categorical, self.num_embeddings)):
            v, good = (columns.decode_hex if self.hex else columns.decode_string)(col(i), ne)
            ids[:, j] = v
            ok &= good
        return RowChunk(labels, dense, ids), ok


def iter_arrow_chunks(reader, stats, chunk_bytes: int) -> Iterator[RowChunk]:
    """The valid rows of ``reader.paths`` (a :class:`~.reader.CTRFileReader`) as chunks, counting
    lines in ``stats`` (a :class:`~.reader.ReadStats`). Raises :class:`~.reader.MalformedRowError`
    under ``reader.strict``, after yielding the rows before that line."""
    plan = _Plan(reader)
    parser = reader.line_parser()
    for path in reader.paths:
        with open(path, "rb") as f:
            bom = f.read(3) == _BOM
        if bom:  # pyarrow drops a leading BOM; the per-line reader keeps it in the first field
            with open(path, encoding="utf-8", errors="replace") as f:
                first = 1
                if reader.spec.header:
                    next(f, None)
                    first = 2
                yield from rows_to_chunks(parse_lines(f, path, first, parser, stats, reader.strict),
                                          reader.spec.num_dense, reader.spec.num_categorical)
            continue
        lineno = 1
        for k, buf in enumerate(iter_byte_chunks(path, chunk_bytes)):
            if k == 0 and reader.spec.header:  # line 1 of every file is its header
                buf = buf[_first_line_end(buf):]
                lineno = 2
            if not buf:
                continue
            n_lines = yield from _chunk_rows(plan, parser, buf, path, lineno, stats, reader.strict)
            lineno += n_lines


def _first_line_end(buf: bytes) -> int:
    """Offset just past the first line end of ``buf`` (``len(buf)`` without one)."""
    ends = [i for i in (buf.find(b"\n"), buf.find(b"\r")) if i >= 0]
    if not ends:
        return len(buf)
    i = min(ends)
    return i + 2 if buf[i:i + 2] == b"\r\n" else i + 1


def _per_line(parser, buf: bytes, lines: LineIndex, path: str, lineno: int, stats,
              strict: bool) -> Iterator[RowChunk]:
    """The per-line parser on one chunk (its lines decoded one by one, as the text reader does)."""
    text = (buf[s:e].decode("utf-8", errors="replace")
            for s, e in zip(lines.start.tolist(), lines.end.tolist()))
    r = parser.r
    yield from rows_to_chunks(parse_lines(text, path, lineno, parser, stats, strict),
                              len(r.dense), len(r.categorical))


def _bad_utf8_in_skipped_line(buf: bytes, plan: _Plan) -> bool:
    """Whether the chunk has invalid UTF-8 and a non-blank line of the wrong field count."""
    if buf.isascii():
        return False
    try:
        buf.decode("utf-8")
        return False
    except UnicodeDecodeError:
        pass
    lines = index_lines(buf)
    counted = field_counts(buf, lines, plan.delimiter.encode("ascii"))
    return bool((~lines.blank & (counted != plan.r.num_fields)).any())


class _ChunkLines:
    """The lines of one chunk: ``count``, ``blank`` (bool ``[count]``) and the byte index, built on
    first use of :attr:`index`.

    Without "\r" the lines are the "\n"-separated pieces: they are counted, and the byte index is
    built only if pyarrow's rows do not account for every line (blank lines, wrong field counts) or
    some line needs its text; ``blank`` is all False until :meth:`use_index_blank`.
    """

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self._index = None if buf.find(b"\r") < 0 else index_lines(buf)
        if self._index is None:
            self.count = buf.count(b"\n") + (not buf.endswith(b"\n"))
            self.blank = np.zeros(self.count, dtype=bool)  # until pyarrow's row count says otherwise
        else:
            self.count = len(self._index.start)
            self.blank = self._index.blank
        self.n_text = self.count - int(self.blank.sum())  # non-blank lines

    @property
    def index(self) -> LineIndex:
        if self._index is None:
            self._index = index_lines(self.buf)
        return self._index

    def use_index_blank(self) -> None:
        """Take ``blank`` (and ``n_text``) from the byte index."""
        self.blank = self.index.blank
        self.n_text = self.count - int(self.blank.sum())

    def text(self, li: int) -> str:
        """Line ``li`` of the chunk, decoded as the per-line reader decodes it."""
        index = self.index
        return self.buf[index.start[li]:index.end[li]].decode("utf-8", errors="replace")


def _chunk_rows(plan: _Plan, parser, buf: bytes, path: str, lineno: int, stats,
                strict: bool):
    """Yield the valid rows of one chunk whose first line is line ``lineno`` of ``path``; return
    the chunk's line count."""
    lines = _ChunkLines(buf)
    split = _arrow_split(plan, lines)
    if split is None:
        yield from _per_line(parser, buf, lines.index, path, lineno, stats, strict)
        return lines.count
    table, arrow_line, wrong = split
    rows, ok = plan.decode(table)
    row_line = np.flatnonzero(arrow_line)  # chunk line of each arrow row
    keep, bad = _reparse(parser, plan.delimiter, lines, rows, ok, row_line, wrong, path, lineno)
    yield from _count_and_keep(rows, keep, bad, row_line, lines, path, lineno, stats, strict)
    return lines.count


def _arrow_split(plan: _Plan, lines: _ChunkLines) -> Optional[Tuple[pa.Table, np.ndarray, np.ndarray]]:
    """``(table, arrow_line, wrong)``: pyarrow's rows of the chunk, bool per chunk line whether the
    line is one of them, and bool per line whether it is non-blank with the wrong field count. None
    where pyarrow does not take the chunk (a leading BOM, which it would drop; a skipped line with
    invalid UTF-8, which its invalid_row_handler cannot decode) or its rows disagree with the index."""
    buf = lines.buf
    if buf.startswith(_BOM) or _bad_utf8_in_skipped_line(buf, plan):
        return None
    try:
        table, skipped = plan.read(buf)
    except pa.ArrowInvalid:  # e.g. invalid UTF-8 in a line of the wrong field count
        return None
    if skipped == 0 and table.num_rows == lines.n_text:
        return table, ~lines.blank, np.zeros(lines.count, dtype=bool)  # every non-blank line is a row
    lines.use_index_blank()
    counted = field_counts(buf, lines.index, plan.delimiter.encode("ascii"))
    arrow_line = ~lines.blank & (counted == plan.r.num_fields)
    wrong = ~lines.blank & ~arrow_line
    if table.num_rows != int(arrow_line.sum()) or skipped != int(wrong.sum()):
        return None  # pyarrow's lines disagree with the index: not expected, but be exact
    return table, arrow_line, wrong


def _reparse(parser, delim: str, lines: _ChunkLines, rows: RowChunk, ok: np.ndarray,
             row_line: np.ndarray, wrong: np.ndarray, path: str,
             lineno: int) -> Tuple[np.ndarray, List[Tuple[int, _Bad]]]:
    """Put through the per-line parser the lines the decoders did not settle: the rows with ``ok``
    False (their values in ``rows`` replaced by the parser's) and the lines of the wrong field count
    (each must fail). Returns ``(keep, bad)``: bool per row of ``rows``, False for a malformed one,
    and ``(chunk line, reason)`` of every malformed line, in line order.

    Raises:
        AssertionError: a line of the wrong field count parsed.
    """
    bad: List[Tuple[int, _Bad]] = []
    keep = np.ones(rows.num_rows, dtype=bool)
    for j in np.flatnonzero(~ok).tolist():
        li = int(row_line[j])
        try:
            row = parser.parse(lines.text(li).split(delim))
        except _Bad as b:
            bad.append((li, b))
            keep[j] = False
            continue
        rows.labels[j] = row.label
        rows.dense[j] = row.dense
        rows.ids[j] = row.ids
    for li in np.flatnonzero(wrong).tolist():
        try:
            parser.parse(lines.text(li).split(delim))
        except _Bad as b:
            bad.append((li, b))
            continue
        raise AssertionError(f"{path}:{lineno + li}: a line of the wrong field count parsed")
    bad.sort(key=lambda x: x[0])
    return keep, bad


def _count_and_keep(rows: RowChunk, keep: np.ndarray, bad: List[Tuple[int, _Bad]],
                    row_line: np.ndarray, lines: _ChunkLines, path: str, lineno: int, stats,
                    strict: bool) -> Iterator[RowChunk]:
    """Count the chunk's lines in ``stats``, record its malformed lines and yield its kept rows;
    under ``strict`` with a malformed line, yield the kept rows before it, then raise there (as
    :func:`~.line_parser.record_bad` does)."""
    blank = lines.blank
    if strict and bad:
        m = bad[0][0]
        before = keep & (row_line < m)
        stats.lines += int((~blank[:m + 1]).sum())
        stats.blank += int(blank[:m].sum())
        stats.valid += int(before.sum())
        if before.any():
            yield rows.take(np.flatnonzero(before))
        record_bad(stats, True, path, lineno + m, bad[0][1])
    stats.lines += lines.n_text
    stats.blank += lines.count - lines.n_text
    for li, b in bad:
        record_bad(stats, False, path, lineno + li, b)
    n_valid = int(keep.sum())
    stats.valid += n_valid
    if n_valid:
        yield rows if n_valid == rows.num_rows else rows.take(np.flatnonzero(keep))
