"""Data sources for distributed training: every rank gets the same number of equal-size batches.

DMP's pooled all-to-all needs the same batch size on every rank and every rank must run the same
number of steps, so training batches are always full (``batch_size`` rows; the stream cycles over
epochs) and validation batches are padded to ``batch_size`` with a count of real rows.

* :class:`FileSource`: rows of a :class:`CTRFileReader`; training row ``t`` (``t``-th non-validation
  row) goes to rank ``t % world_size``; validation rows ``v`` to rank ``v % world_size``. Every rank
  parses every file (row positions, hence the split and the rank of a row, depend on the valid-row
  counts of all earlier lines) and keeps its rows, chunk by chunk (``CTRFileReader.iter_chunks``).
* :class:`SyntheticSource`: :class:`SyntheticCTR`; training step ``s`` of rank ``r`` is batch
  ``s * world_size + r``; validation batch ``i`` of rank ``r`` is batch ``i * world_size + r``.
"""

from __future__ import annotations

import math
from typing import Iterator, List, Optional, Tuple

import numpy as np

from .batching import make_batch
from .reader import CTRFileReader, NoUsableRowsError, RowChunk
from .split import Split
from .synthetic import SyntheticCTR


def _check_rank(rank: int, world_size: int, batch_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


class _Schema:
    """The columns of a source: ``dense_names``, ``categorical_names`` and ``num_embeddings`` of the
    object in its attribute named ``_schema_of`` (the file reader, or the synthetic generator)."""

    _schema_of = ""

    @property
    def dense_names(self) -> tuple:
        return getattr(self, self._schema_of).dense_names

    @property
    def categorical_names(self) -> tuple:
        return getattr(self, self._schema_of).categorical_names

    @property
    def num_embeddings(self) -> list:
        return list(getattr(self, self._schema_of).num_embeddings)


class FileSource(_Schema):
    """Args:
        reader: the :class:`CTRFileReader`.
        split: a :class:`Split` (``none`` leaves validation empty).
        max_val_rows: keep at most this many validation rows (``None`` = all).
    """

    _schema_of = "reader"

    def __init__(self, reader: CTRFileReader, split: Split, max_val_rows: Optional[int] = None):
        self.reader = reader
        self.split = split
        self.max_val_rows = max_val_rows
        self._n: Optional[int] = reader.count_valid() if split.needs_count else None
        self.epoch = 0
        self.pass_stats = reader.stats if split.needs_count else None

    def stats(self):
        """:class:`ReadStats` of the latest complete pass over the files (``None`` before one)."""
        return self.pass_stats

    def _chunks(self, want_validation: bool) -> Iterator[RowChunk]:
        """The training (or validation) rows of one pass, as chunks in row order."""
        i0 = 0
        for chunk in self.reader.iter_chunks():
            n = chunk.num_rows
            i = np.arange(i0, i0 + n, dtype=np.int64)  # row positions among the valid rows
            i0 += n
            val = np.broadcast_to(np.asarray(self.split.is_validation(i, self._n), dtype=bool), (n,))
            yield chunk.take(np.flatnonzero(val == want_validation))
        self.pass_stats = self.reader.stats

    def _to_batch(self, rows: RowChunk) -> object:
        return make_batch(rows.labels, rows.dense.astype(np.float32), rows.ids, self.categorical_names)

    def train_batches(self, rank: int, world_size: int, batch_size: int,
                      start_step: int = 0) -> Iterator:
        """Endless full batches for ``rank``, cycling over the file(s); ``start_step`` batches are
        skipped (resume). ``self.epoch`` counts completed passes.

        Raises:
            ValueError: bad rank/batch size, or fewer training rows than ``world_size`` (nothing to
                give some rank).
        """
        _check_rank(rank, world_size, batch_size)
        buf: List[RowChunk] = []  # this rank's rows not yet in a batch
        buffered = 0
        step = 0
        self.epoch = 0
        while True:
            seen = 0
            for chunk in self._chunks(False):
                t = np.arange(seen, seen + chunk.num_rows, dtype=np.int64)  # training row positions
                seen += chunk.num_rows
                mine = chunk.take(np.flatnonzero(t % world_size == rank))
                if not mine.num_rows:
                    continue
                buf.append(mine)
                buffered += mine.num_rows
                while buffered >= batch_size:
                    rows = RowChunk.concat(buf)
                    if step >= start_step:
                        yield self._to_batch(rows.take(slice(0, batch_size)))
                    step += 1
                    rest = rows.take(slice(batch_size, None))
                    buf, buffered = ([rest] if rest.num_rows else []), rest.num_rows
            if seen < world_size:
                raise NoUsableRowsError(f"only {seen} training rows for world_size={world_size}; "
                                        f"reader: {self.reader.stats.summary()}")
            self.epoch += 1

    def validation_batches(self, rank: int, world_size: int,
                           batch_size: int) -> List[Tuple[object, int]]:
        """``[(Batch, n_real)]``, the same count on every rank; pad rows repeat the first one.

        Raises:
            NoUsableRowsError: an empty validation split (a ValueError).
        """
        _check_rank(rank, world_size, batch_size)
        chunks = [c for c in self._chunks(True) if c.num_rows]
        rows = RowChunk.concat(chunks) if chunks else None
        if rows is not None and self.max_val_rows is not None:
            rows = rows.take(slice(0, self.max_val_rows))
        if rows is None or not rows.num_rows:
            raise NoUsableRowsError(_no_validation_rows(self.reader, self.split))
        total = rows.num_rows
        mine = rows.take(slice(rank, None, world_size))
        n_batches = math.ceil(math.ceil(total / world_size) / batch_size)
        out = []
        for i in range(n_batches):
            chunk = mine.take(slice(i * batch_size, (i + 1) * batch_size))
            n_real = chunk.num_rows
            pad = np.zeros(batch_size - n_real, dtype=np.int64)  # pad rows repeat row 0
            out.append((self._to_batch(RowChunk.concat([chunk, rows.take(pad)])), n_real))
        return out


def _no_validation_rows(reader: CTRFileReader, split: Split) -> str:
    """Why a text source has no validation row: no row at all, no valid row, or a split too coarse."""
    st, files = reader.stats, ", ".join(reader.paths)
    if st.valid == 0 and st.malformed == 0:
        return f"{files}: no data rows (empty file)"
    if st.malformed > st.valid:
        return (f"{files}: the validation split --split {split} is empty; reader: {st.summary()}; "
                f"most rows are malformed, so the file's layout is probably not the --data-format "
                f"given (a preset or a JSON column spec)")
    return f"{files}: the validation split --split {split} is empty; reader: {st.summary()}"


class SyntheticSource(_Schema):
    """Args: ``gen`` (:class:`SyntheticCTR`), ``val_batches`` (validation batches per rank)."""

    _schema_of = "gen"

    def __init__(self, gen: SyntheticCTR, val_batches: int = 4):
        if val_batches < 1:
            raise ValueError(f"val_batches must be >= 1, got {val_batches}")
        self.gen = gen
        self.val_batches = val_batches
        self.epoch = 0

    def stats(self):
        return None

    def train_batches(self, rank: int, world_size: int, batch_size: int,
                      start_step: int = 0) -> Iterator:
        _check_rank(rank, world_size, batch_size)
        step = start_step
        while True:
            yield self.train_batch(rank, world_size, batch_size, step)
            step += 1

    def train_batch(self, rank: int, world_size: int, batch_size: int, step: int):
        """Training step ``step`` of ``rank`` (synthetic batch ``step * world_size + rank``): the
        batch :meth:`train_batches` yields at that step.

        Raises:
            ValueError: bad rank, batch size or step.
        """
        _check_rank(rank, world_size, batch_size)
        return self.gen.batch("train", step * world_size + rank, batch_size)

    def validation_batches(self, rank: int, world_size: int,
                           batch_size: int) -> List[Tuple[object, int]]:
        _check_rank(rank, world_size, batch_size)
        return [(self.gen.batch("val", i * world_size + rank, batch_size), batch_size)
                for i in range(self.val_batches)]
