"""The per-line rules of the CTR text readers: one line's fields -> a row, or the reason it is malformed.

:class:`LineParser` is the readable specification every text parser follows (the per-line parser of
:mod:`.reader` uses it for every line, :mod:`.arrow_reader` for the lines its vectorised checks do not
settle); :class:`ReadStats` counts valid and malformed lines; :class:`RowChunk` holds consecutive
valid rows as arrays.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Iterator, NamedTuple, Sequence

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
