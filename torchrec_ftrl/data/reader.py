"""Streaming reader for delimited CTR logs (raw Criteo TSV, Avazu CSV, anything a ColumnSpec describes).

Two parsers give the same rows, ids, dense values, labels, :class:`ReadStats` and ``strict`` errors:
``"python"``, one line at a time through :class:`~.line_parser.LineParser` (the readable
specification of the rules below), and ``"arrow"`` (:mod:`.arrow_reader`: pyarrow's C++ CSV parser on byte chunks, vectorised
field checks, and :class:`LineParser` again for the rows those checks do not settle). ``"auto"`` (the
default) takes arrow when pyarrow imports and the delimiter is one ASCII character, else the per-line
parser (with a one-time warning when pyarrow is missing).

Each valid line becomes a :class:`Row`: ``label`` (0/1), ``dense`` (floats after the spec's transform;
a missing dense value is 0 before the transform) and ``ids`` (one row id per categorical column,
``-1`` for a missing value, otherwise in ``[0, num_embeddings[f])``). Malformed lines (wrong field
count, bad label, non-numeric / non-integer dense value, non-hex categorical under hex encoding) are
counted in :class:`ReadStats` and skipped, or with ``strict=True`` raise :class:`MalformedRowError`
naming file and line. Blank lines are ignored.
"""

from __future__ import annotations

import os
import warnings
from typing import Iterator, Optional, Sequence, Union

from .line_parser import (LineParser, MalformedRowError, NoUsableRowsError, ReadStats, Row,  # noqa: F401
                          RowChunk, _Bad, parse_lines, record_bad, rows_to_chunks)
from .spec import ColumnSpec, ResolvedSpec

PARSERS = ("auto", "arrow", "python")
_warned_no_arrow = False


def arrow_unsupported(spec: ColumnSpec) -> Optional[str]:
    """Why the arrow parser cannot read ``spec`` (``None`` when it can): it splits on one ASCII byte."""
    d = spec.delimiter
    if len(d) != 1 or not d.isascii() or d in "\r\n":
        return f"delimiter {d!r} is not one ASCII character other than CR/LF"
    return None


def arrow_importable() -> bool:
    """Whether pyarrow (with its csv and compute modules) imports."""
    try:
        import pyarrow  # noqa: F401
        import pyarrow.compute  # noqa: F401
        import pyarrow.csv  # noqa: F401
    except ImportError:
        return False
    return True


def _choose_engine(parser: str, spec: ColumnSpec) -> str:
    global _warned_no_arrow
    if parser not in PARSERS:
        raise ValueError(f"parser must be one of {PARSERS}, got {parser!r}")
    if parser == "python":
        return "python"
    why = arrow_unsupported(spec)
    if why is not None:
        if parser == "arrow":
            raise ValueError(f"the arrow parser cannot read this column spec: {why}")
        return "python"
    if not arrow_importable():
        if parser == "arrow":
            raise ImportError("parser='arrow' needs pyarrow (pip install -r requirements.txt)")
        if not _warned_no_arrow:
            _warned_no_arrow = True
            warnings.warn("pyarrow is not importable: CTRFileReader parses text files line by line in "
                          "Python (about 10x slower); install the pinned pyarrow for the fast parser",
                          RuntimeWarning, stacklevel=3)
        return "python"
    return "arrow"


def _normalize_num_embeddings(num_embeddings: Union[int, Sequence[int]], n: int) -> list:
    if isinstance(num_embeddings, int) and not isinstance(num_embeddings, bool):
        ne = [num_embeddings] * n
    else:
        ne = list(num_embeddings)
        if len(ne) != n:
            raise ValueError(f"num_embeddings has {len(ne)} entries for {n} categorical columns")
    for v in ne:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"num_embeddings entries must be ints >= 1, got {v!r}")
    return ne


class CTRFileReader:
    """Iterate the :class:`Row` s of one or more files, in file order then line order.

    Args:
        paths: one path or a list of paths (each with a header line when ``spec.header``).
        spec: the :class:`ColumnSpec` (e.g. ``CRITEO_SPEC``).
        num_embeddings: table size per categorical column (one int for all, or one per column);
            ids are hashed into ``[0, num_embeddings)``.
        strict: raise :class:`MalformedRowError` at the first malformed line instead of skipping it.
        parser: ``"auto"``, ``"arrow"`` or ``"python"`` (see the module docstring); ``engine`` says
            which one runs.
        chunk_bytes: bytes per chunk of the arrow parser (a longer line makes its chunk longer).

    Raises:
        FileNotFoundError: a path that does not exist (at construction).
        ValueError: bad ``num_embeddings``, a header missing a named column, an empty file list, an
            unknown ``parser``, or ``parser="arrow"`` with a delimiter it cannot split on.
        ImportError: ``parser="arrow"`` without pyarrow.

    ``stats`` holds the :class:`ReadStats` of the latest (or running) pass.
    """

    def __init__(self, paths: Union[str, os.PathLike, Sequence], spec: ColumnSpec,
                 num_embeddings: Union[int, Sequence[int]], strict: bool = False,
                 parser: str = "auto", chunk_bytes: int = 8 << 20) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [os.fspath(p) for p in paths]
        if not self.paths:
            raise ValueError("CTRFileReader needs at least one data file, got []")
        for p in self.paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"CTR data file not found: {p!r}")
        self.spec = spec
        self.num_embeddings = _normalize_num_embeddings(num_embeddings, spec.num_categorical)
        self.strict = bool(strict)
        self.stats = ReadStats()
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.chunk_bytes = int(chunk_bytes)
        self._engine = _choose_engine(parser, spec)
        self._resolved: Optional[ResolvedSpec] = None
        self.resolved()  # read the header now, so a bad spec fails early

    def resolved(self) -> ResolvedSpec:
        """The spec resolved against the first file's header (or without a header)."""
        if self._resolved is None:
            header = None
            if self.spec.header:
                with open(self.paths[0], encoding="utf-8", errors="replace") as f:
                    header = f.readline().rstrip("\r\n").split(self.spec.delimiter)
            self._resolved = self.spec.resolve(header)
        return self._resolved

    @property
    def dense_names(self) -> tuple:
        return self.resolved().dense_names

    @property
    def categorical_names(self) -> tuple:
        return self.resolved().categorical_names

    @property
    def engine(self) -> str:
        """The parser this reader uses: ``"arrow"`` or ``"python"`` (see ``parser``)."""
        return self._engine

    def __iter__(self) -> Iterator[Row]:
        if self._engine == "python":
            yield from self._iter_python()
            return
        for chunk in self.iter_chunks():
            dense, ids = chunk.dense.tolist(), chunk.ids.tolist()
            for label, d, i in zip(chunk.labels.tolist(), dense, ids):
                yield Row(label, d, i)

    def iter_chunks(self) -> Iterator[RowChunk]:
        """The same rows as ``iter(self)``, as :class:`RowChunk` s (at most a few ten thousand rows
        each, in order). ``stats`` is updated chunk by chunk; ``strict`` raises after yielding the
        rows before the malformed line."""
        if self._engine == "python":
            yield from rows_to_chunks(self._iter_python(), self.spec.num_dense, self.spec.num_categorical)
            return
        from .arrow_reader import iter_arrow_chunks
        self.stats = ReadStats()
        yield from iter_arrow_chunks(self, self.stats, self.chunk_bytes)

    def line_parser(self) -> "LineParser":
        """The per-line rules for this reader's spec (the specification both parsers follow)."""
        return LineParser(self.resolved(), self.spec, self.num_embeddings)

    def _iter_python(self) -> Iterator[Row]:
        """The per-line parser: every line through :class:`LineParser` (the readable specification)."""
        self.stats = stats = ReadStats()
        parser = self.line_parser()
        for path in self.paths:
            with open(path, encoding="utf-8", errors="replace") as f:
                first = 1
                if self.spec.header:
                    next(f, None)
                    first = 2
                yield from parse_lines(f, path, first, parser, stats, self.strict)

    def count_valid(self) -> int:
        """Number of valid rows (one full pass; ``stats`` then holds that pass)."""
        return sum(c.num_rows for c in self.iter_chunks())


