"""Streaming reader for delimited CTR logs (raw Criteo TSV, Avazu CSV, anything a ColumnSpec describes).

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
from typing import Iterator, NamedTuple, Optional, Sequence, Union

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

    Raises:
        FileNotFoundError: a path that does not exist (at construction).
        ValueError: bad ``num_embeddings``, a header missing a named column, an empty file list.

    ``stats`` holds the :class:`ReadStats` of the latest (or running) pass.
    """

    def __init__(self, paths: Union[str, os.PathLike, Sequence], spec: ColumnSpec,
                 num_embeddings: Union[int, Sequence[int]], strict: bool = False) -> None:
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

    def __iter__(self) -> Iterator[Row]:
        self.stats = stats = ReadStats()
        r = self.resolved()
        spec = self.spec
        parse_dense = _parse_int if spec.dense_type == "int" else _parse_float
        transform = log_transform if spec.dense_transform == "log" else float
        to_id = hex_id if spec.categorical_encoding == "hex" else string_id
        cat_cols = list(zip(r.categorical, self.num_embeddings))
        for path in self.paths:
            with open(path, encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, start=1):
                    if spec.header and lineno == 1:
                        continue
                    line = line.rstrip("\r\n")
                    if not line:
                        stats.blank += 1
                        continue
                    stats.lines += 1
                    fields = line.split(spec.delimiter)
                    try:
                        if len(fields) != r.num_fields:
                            raise _Bad("field_count", f"expected {r.num_fields} fields, got {len(fields)}")
                        label = _parse_label(fields[r.label])
                        dense = []
                        for i in r.dense:
                            v = fields[i]
                            dense.append(transform(parse_dense(v, i)) if v else transform(0.0))
                        ids = []
                        for i, n in cat_cols:
                            v = fields[i]
                            if not v:
                                ids.append(-1)
                                continue
                            try:
                                ids.append(to_id(v, n))
                            except ValueError:
                                raise _Bad("categorical", f"field {i}: not a hex value: {v!r}") from None
                    except _Bad as bad:
                        where = f"{path}:{lineno}"
                        if self.strict:
                            raise MalformedRowError(f"{where}: malformed row ({bad.kind}): {bad.detail}") from None
                        stats.malformed += 1
                        stats.reasons[bad.kind] += 1
                        if len(stats.examples) < 5:
                            stats.examples.append(f"{where}: {bad.detail}")
                        continue
                    stats.valid += 1
                    yield Row(label, dense, ids)

    def count_valid(self) -> int:
        """Number of valid rows (one full pass; ``stats`` then holds that pass)."""
        return sum(1 for _ in self)


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
