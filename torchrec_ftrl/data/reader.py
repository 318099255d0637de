"""Streaming reader for delimited CTR logs (raw Criteo TSV, Avazu CSV, anything a ColumnSpec describes).

Two parsers give the same rows, ids, dense values, labels, :class:`ReadStats` and ``strict`` errors:
``"python"``, one line at a time through :class:`LineParser` (the readable specification of the rules
below), and ``"arrow"`` (:mod:`.arrow_reader`: pyarrow's C++ CSV parser on byte chunks, vectorised
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

import collections
import dataclasses
import math
import os
import warnings
from typing import Iterator, NamedTuple, Optional, Sequence, Union

import numpy as np

from .hashing import hex_id, log_transform, string_id
from .spec import ColumnSpec, ResolvedSpec


class NoUsableRowsError(ValueError):
    """A split of the data has no valid row, usually because the file's layout is not --data-format."""


class MalformedRowError(ValueError):
    """A malformed line under ``strict=True``; the message is ``"{path}:{line}: {reason}"``."""


class Row(NamedTuple):
    label: int
    dense: list
    ids: list


@dataclasses.dataclass
class ReadStats:
    """Counts of one pass over the files. ``examples`` keeps the first few ``path:line: reason``."""

    lines: int = 0
    valid: int = 0
    malformed: int = 0
    blank: int = 0
    reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    examples: list = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        s = f"{self.valid} valid rows, {self.malformed} malformed rows skipped"
        if self.malformed:
            s += " (" + ", ".join(f"{k}: {v}" for k, v in sorted(self.reasons.items())) + ")"
            s += "; first: " + " | ".join(self.examples[:3])
        return s

    def to_dict(self) -> dict:
        return {"lines": self.lines, "valid": self.valid, "malformed": self.malformed,
                "blank": self.blank, "reasons": dict(self.reasons), "examples": list(self.examples)}


class _Bad(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


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


class RowChunk(NamedTuple):
    """Consecutive valid rows: ``labels`` int64 ``[n]`` (0/1), ``dense`` float64 ``[n, n_dense]``
    (transformed), ``ids`` int64 ``[n, n_categorical]`` (-1 = missing)."""

    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.labels.shape[0])

    def take(self, index) -> "RowChunk":
        """The rows at ``index`` (int array or slice), as a new chunk."""
        return RowChunk(self.labels[index], self.dense[index], self.ids[index])

    @staticmethod
    def concat(chunks: Sequence["RowChunk"]) -> "RowChunk":
        """Rows of ``chunks`` one after the other (at least one chunk)."""
        if len(chunks) == 1:
            return chunks[0]
        return RowChunk(np.concatenate([c.labels for c in chunks]),
                        np.concatenate([c.dense for c in chunks]),
                        np.concatenate([c.ids for c in chunks]))


def rows_to_chunks(rows: Iterator[Row], n_dense: int, n_cat: int,
                   size: int = 16384) -> Iterator[RowChunk]:
    """Group :class:`Row` s into :class:`RowChunk` s of ``size`` rows (the last may be shorter)."""
    buf: list = []

    def flush() -> RowChunk:
        labels = np.fromiter((r.label for r in buf), dtype=np.int64, count=len(buf))
        dense = np.asarray([r.dense for r in buf], dtype=np.float64).reshape(len(buf), n_dense)
        ids = np.asarray([r.ids for r in buf], dtype=np.int64).reshape(len(buf), n_cat)
        return RowChunk(labels, dense, ids)

    try:
        for row in rows:
            buf.append(row)
            if len(buf) == size:
                yield flush()
                buf = []
    except MalformedRowError:
        if buf:  # (strict) the rows before the malformed line first, as the per-line reader yields them
            yield flush()
        raise
    if buf:
        yield flush()


class LineParser:
    """The per-line rules: one line's fields -> :class:`Row`, or :class:`_Bad` naming what is wrong.

    Checks in this order, the first failure being the reason: field count (``field_count``), label
    (``label``), dense fields in spec order (``dense``), categorical fields in spec order
    (``categorical``)."""

    def __init__(self, r: ResolvedSpec, spec: ColumnSpec, num_embeddings: Sequence[int]) -> None:
        self.r = r
        self.delimiter = spec.delimiter
        self.parse_dense = _parse_int if spec.dense_type == "int" else _parse_float
        self.transform = log_transform if spec.dense_transform == "log" else float
        self.to_id = hex_id if spec.categorical_encoding == "hex" else string_id
        self.cat_cols = list(zip(r.categorical, num_embeddings))

    def parse(self, fields: Sequence[str]) -> Row:
        """Raises :class:`_Bad` (kind, detail) for a malformed row."""
        r, transform, parse_dense = self.r, self.transform, self.parse_dense
        if len(fields) != r.num_fields:
            raise _Bad("field_count", f"expected {r.num_fields} fields, got {len(fields)}")
        label = _parse_label(fields[r.label])
        dense = []
        for i in r.dense:
            v = fields[i]
            dense.append(transform(parse_dense(v, i)) if v else transform(0.0))
        ids = []
        for i, n in self.cat_cols:
            v = fields[i]
            if not v:
                ids.append(-1)
                continue
            try:
                ids.append(self.to_id(v, n))
            except ValueError:
                raise _Bad("categorical", f"field {i}: not a hex value: {v!r}") from None
        return Row(label, dense, ids)


def record_bad(stats: ReadStats, strict: bool, path: str, lineno: int, bad: "_Bad") -> None:
    """Count one malformed line in ``stats``; under ``strict`` raise :class:`MalformedRowError`
    (``"{path}:{lineno}: malformed row ({kind}): {detail}"``) instead."""
    where = f"{path}:{lineno}"
    if strict:
        raise MalformedRowError(f"{where}: malformed row ({bad.kind}): {bad.detail}") from None
    stats.malformed += 1
    stats.reasons[bad.kind] += 1
    if len(stats.examples) < 5:
        stats.examples.append(f"{where}: {bad.detail}")


def parse_lines(lines, path: str, first_lineno: int, parser: LineParser, stats: ReadStats,
                strict: bool) -> Iterator[Row]:
    """The valid :class:`Row` s of ``lines`` (text lines, line end included or not; line
    ``first_lineno`` first), counting blank, valid and malformed lines in ``stats``."""
    delimiter = parser.delimiter
    for lineno, line in enumerate(lines, start=first_lineno):
        line = line.rstrip("\r\n")
        if not line:
            stats.blank += 1
            continue
        stats.lines += 1
        try:
            row = parser.parse(line.split(delimiter))
        except _Bad as bad:
            record_bad(stats, strict, path, lineno, bad)
            continue
        stats.valid += 1
        yield row


def _parse_label(v: str) -> int:
    if v in ("0", "1"):
        return int(v)
    try:
        x = float(v)
    except ValueError:
        raise _Bad("label", f"label must be 0 or 1, got {v!r}") from None
    if x == 0.0 or x == 1.0:
        return int(x)
    raise _Bad("label", f"label must be 0 or 1, got {v!r}")


def _parse_int(v: str, i: int) -> float:
    try:
        if "_" in v:
            raise ValueError
        return float(int(v))
    except ValueError:
        raise _Bad("dense", f"field {i}: not an integer: {v!r}") from None


def _parse_float(v: str, i: int) -> float:
    try:
        x = float(v)
    except ValueError:
        raise _Bad("dense", f"field {i}: not a number: {v!r}") from None
    if not math.isfinite(x):
        raise _Bad("dense", f"field {i}: not finite: {v!r}")
    return x
