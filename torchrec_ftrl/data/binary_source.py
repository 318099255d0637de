"""Rank-sharded batches from TorchRec's binary Criteo layout (see :mod:`.npy_layout`).

The triplets of the folder, in natural prefix order, form one table of ``n`` rows (row ``i`` is the
``i``-th row of the concatenation). The :class:`Split` picks the validation rows by position, as for
text files. Every array is memory-mapped once with TorchRec's
``BinaryCriteoUtils.load_npy_range(..., mmap_mode=True)``; a batch copies only its own rows.

* Labels: the stored 0/1 values (float32 in the batch).
* Dense (``dense="text"``, the default): the text reader's ``log(1 + max(x, 0))`` of the integer
  value ``x``, recovered from ``tsv_to_npys``'s ``d = log(x - m + 2)`` as ``x = round(exp(d)) - c``
  with ``c = 2 - m``, the stored code of ``x = 0``. ``m`` (the file's smallest value) is not stored,
  so ``c`` is found per file from its first :data:`ZERO_CODE_ROWS` rows: the value most columns
  have as their minimum (every Criteo integer column except I2 holds zeros or missing values, which
  ``tsv_to_npys`` stores as ``x = 0``; I2's minimum is negative). ``dense="stored"``: the stored
  values unchanged (what TorchRec's own DLRM example trains on).
* Categorical: a stored value ``v > 0`` becomes row id ``v % num_embeddings[f]``, the same id the
  text reader gives the hex string (``int(hex, 16) % num_embeddings``); ``v == 0`` is
  ``tsv_to_npys``'s encoding of an empty field and becomes a missing value (an empty bag), as an
  empty field is in the text reader.

Row to rank (every rank gets the same number of full batches, endlessly): training rows, in order,
are one stream cycling over epochs (stream position ``p`` is training row ``p % n_train``); global
batch ``j`` is positions ``[j * B, (j + 1) * B)`` and step ``s`` of rank ``r`` is global batch
``s * world_size + r``. So each rank reads runs of ``B`` consecutive training rows (its share only),
the ranks of one step hold consecutive data, and ``start_step`` needs no reading. Validation rows are
assigned as :class:`FileSource` assigns them: validation row ``v`` to rank ``v % world_size``, padded
batches with a count of real rows.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from .batching import make_batch
from .npy_layout import BinaryLayoutError, Triplet, load_layout
from .reader import NoUsableRowsError, _normalize_num_embeddings
from .split import Split

DENSE_MODES = ("text", "stored")
ZERO_CODE_ROWS = 65536
_LUT_SIZE = 1 << 16
# tsv_to_npys stores log(k), 2 <= k = x - m + 2 <= 2**32, in float32 (bounds widened by 1e-6 relative)
_STORED_RANGE = (np.float32(np.log(2.0) * (1 - 1e-6)), np.float32(np.log(2.0 ** 32) * (1 + 1e-6)))
_LOG1P = np.log1p(np.arange(_LUT_SIZE, dtype=np.float64)).astype(np.float32)  # [x] -> log(1 + x)


@dataclasses.dataclass
class BinaryStats:
    """Counts of a binary folder: ``files`` (triplets), ``rows``, ``train_rows``, ``validation_rows``
    (after ``max_val_rows``), ``dense`` (the dense mode)."""

    folder: str
    files: int
    rows: int
    train_rows: int
    validation_rows: int
    dense: str

    def summary(self) -> str:
        return (f"{self.rows} rows in {self.files} binary triplet(s) of {self.folder}: "
                f"{self.train_rows} training, {self.validation_rows} validation; dense: {self.dense}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_rank(rank: int, world_size: int, batch_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


def _mmap(info) -> np.ndarray:
    """The whole ``[rows, C]`` array of ``info`` (an ``NpyInfo``), memory-mapped read-only with
    TorchRec's reader (an empty array for 0 rows, which that reader refuses)."""
    from torchrec.datasets.criteo import BinaryCriteoUtils

    if info.rows == 0:
        return np.empty(info.shape, dtype=info.dtype)
    return BinaryCriteoUtils.load_npy_range(info.path, 0, info.rows, mmap_mode=True)


class BinarySource:
    """Args:
        folder: a folder of ``PREFIX_{dense,sparse,labels}.npy`` triplets.
        num_embeddings: table size per categorical column (one int for all, or one per column).
        split: a :class:`Split` (``none`` leaves validation empty).
        max_val_rows: keep at most this many validation rows (the first ones; ``None`` = all).

    Raises (at construction, before any data is read; each message names the file):
        FileNotFoundError: no such folder, no triplet in it, or a triplet missing an array.
        BinaryLayoutError: a wrong dtype or shape, differing row counts, a truncated file, column
            counts that differ between triplets, or a ``num_embeddings`` list of the wrong length.
        NoUsableRowsError: the folder holds no row at all.

    Values are checked in each batch as it is built: a label other than 0/1, a negative categorical
    value or a non-finite dense value raises :class:`BinaryLayoutError` naming file and row; so do,
    under ``dense="text"``, a dense value outside ``[log 2, log 2**32]`` (not ``tsv_to_npys``'s) and
    a file whose code of ``x = 0`` is not the minimum of most columns.
    """

    def __init__(self, folder: Union[str, os.PathLike], num_embeddings: Union[int, Sequence[int]],
                 split: Split, max_val_rows: Optional[int] = None, dense: str = "text") -> None:
        if dense not in DENSE_MODES:
            raise ValueError(f"dense must be one of {DENSE_MODES}, got {dense!r}")
        self.dense_mode = dense
        self.folder = os.fspath(folder)
        self.triplets: List[Triplet] = self._load_layout(self.folder)
        first = self.triplets[0]
        self.dense_names = tuple(f"I{i + 1}" for i in range(first.num_dense))
        self.categorical_names = tuple(f"C{i + 1}" for i in range(first.num_sparse))
        try:
            ne = _normalize_num_embeddings(num_embeddings, first.num_sparse)
        except ValueError as e:
            raise BinaryLayoutError(f"{first.path_of('sparse')}: {e}") from None
        self._ne = np.asarray(ne, dtype=np.int64)
        rows = [t.rows for t in self.triplets]
        self._starts = np.cumsum([0] + rows, dtype=np.int64)  # [files + 1] first global row of each
        self.num_rows = int(self._starts[-1])
        if self.num_rows == 0:
            raise NoUsableRowsError(f"{self.folder}: the binary triplets hold no row")
        self.split = split
        self.max_val_rows = max_val_rows
        self.n_train, n_val = split.counts(self.num_rows)
        self.n_val = n_val if max_val_rows is None else min(n_val, max(int(max_val_rows), 0))
        self._arrays: Optional[List[Tuple[np.ndarray, np.ndarray, np.ndarray]]] = None
        self._zero_code: List[Optional[int]] = [None] * len(self.triplets)
        self.epoch = 0

    _load_layout = staticmethod(load_layout)   # folder -> checked triplets

    # ----------------------------------------------------------------- the FileSource interface

    @property
    def num_embeddings(self) -> list:
        return [int(x) for x in self._ne]

    def num_train_rows(self) -> int:
        """Training rows of one epoch."""
        return self.n_train

    def stats(self) -> BinaryStats:
        return BinaryStats(self.folder, len(self.triplets), self.num_rows, self.n_train, self.n_val,
                           self.dense_mode)

    def train_batches(self, rank: int, world_size: int, batch_size: int,
                      start_step: int = 0) -> Iterator:
        """Endless full batches for ``rank``: step ``s`` is global batch ``s * world_size + rank``
        (see the module docstring); steps before ``start_step`` are skipped without reading.
        ``self.epoch`` is the number of complete passes over the training rows that the global
        stream has made up to the latest batch yielded.

        Raises:
            ValueError: bad rank or batch size.
            NoUsableRowsError: no training row (e.g. every row is validation).
        """
        _check_rank(rank, world_size, batch_size)
        self._check_train()
        step = int(start_step)
        rows_per_step = world_size * batch_size
        self.epoch = step * rows_per_step // self.n_train
        while True:
            batch = self.train_batch(rank, world_size, batch_size, step)
            step += 1
            self.epoch = step * rows_per_step // self.n_train
            yield batch

    def train_batch(self, rank: int, world_size: int, batch_size: int, step: int):
        """Training step ``step`` of ``rank``: the batch :meth:`train_batches` yields at that step (a
        pure function of its arguments, so data-loader workers can build steps in any order).

        Raises:
            ValueError: bad rank, batch size or step.
            NoUsableRowsError: no training row.
        """
        _check_rank(rank, world_size, batch_size)
        self._check_train()
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        first = (int(step) * world_size + rank) * batch_size
        t = (first + np.arange(batch_size, dtype=np.int64)) % self.n_train
        return self._batch(self.split.train_index(t, self.num_rows))

    def _check_train(self) -> None:
        if self.n_train < 1:
            raise NoUsableRowsError(f"{self.folder}: no training rows under --split {self.split}")

    def validation_batches(self, rank: int, world_size: int,
                           batch_size: int) -> List[Tuple[object, int]]:
        """``[(Batch, n_real)]``, the same count on every rank: validation row ``v`` (``v <
        max_val_rows``) goes to rank ``v % world_size``; pad rows repeat validation row 0.

        Raises:
            NoUsableRowsError: an empty validation split (a ValueError).
        """
        _check_rank(rank, world_size, batch_size)
        if self.n_val < 1:
            raise NoUsableRowsError(f"{self.folder}: the validation split --split {self.split} is "
                                    f"empty; binary data: "
                                    f"{self.stats().summary()}")
        mine = np.arange(rank, self.n_val, world_size, dtype=np.int64)
        n_batches = math.ceil(math.ceil(self.n_val / world_size) / batch_size)
        out = []
        for i in range(n_batches):
            chunk = mine[i * batch_size:(i + 1) * batch_size]
            n_real = len(chunk)
            v = np.concatenate([chunk, np.zeros(batch_size - n_real, dtype=np.int64)])
            out.append((self._batch(self.split.validation_index(v, self.num_rows)), n_real))
        return out

    # ----------------------------------------------------------------------------- batch building

    def _mapped(self) -> List[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``(labels, dense, sparse)`` memory maps per triplet (opened at first use, so that a
        source can be built and checked without mapping anything)."""
        if self._arrays is None:
            self._arrays = [(_mmap(t.labels), _mmap(t.dense), self._mmap_sparse(t))
                            for t in self.triplets]
        return self._arrays

    @staticmethod
    def _mmap_sparse(t: Triplet):
        return _mmap(t.sparse)

    def arrays(self, rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(labels [B] int64, dense [B, D] float32, ids [B, F] int64 (-1 = missing))`` of the global
        rows ``rows`` (int64 ``[B]``, any order), as the batches hold them.

        Raises:
            BinaryLayoutError: a label other than 0/1, a negative categorical value, a non-finite
                dense value or (``dense="text"``) one outside ``tsv_to_npys``'s range, naming file
                and row; see also :meth:`zero_code`.
        """
        rows = np.asarray(rows, dtype=np.int64)
        b = rows.shape[0]
        labels = np.empty((b, 1), dtype=np.int64)
        dense = np.empty((b, self.triplets[0].num_dense), dtype=np.float32)
        file_of = np.searchsorted(self._starts, rows, side="right") - 1
        segments = self._segments(rows, file_of)
        for lo, hi, f, local in segments:
            lab_mm, dense_mm, _ = self._mapped()[f]
            labels[lo:hi] = lab_mm[local]
            dense[lo:hi] = dense_mm[local]
        raw = self._read_sparse(segments, b)
        labels = labels.reshape(b)
        self._check_values(rows, file_of, labels, dense, raw)
        if self.dense_mode == "text":
            for lo, hi, f, _ in segments:
                dense[lo:hi] = self._text_dense(dense[lo:hi], self.zero_code(f))
        return labels, dense, self._ids(raw)

    def _segments(self, rows: np.ndarray, file_of: np.ndarray) -> List[tuple]:
        """``[(lo, hi, f, local)]``: one per run ``rows[lo:hi]`` of rows in triplet ``f``; ``local``
        their rows in that triplet (a slice when consecutive, so one slice copy per array)."""
        b = rows.shape[0]
        consecutive = np.diff(rows) == 1
        bounds = [0, *(np.flatnonzero(file_of[1:] != file_of[:-1]) + 1).tolist(), b]
        out = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            f = int(file_of[lo])
            local = rows[lo:hi] - self._starts[f]
            if consecutive[lo:hi - 1].all():
                local = slice(int(local[0]), int(local[0]) + hi - lo)
            out.append((lo, hi, f, local))
        return out

    def _read_sparse(self, segments: List[tuple], b: int) -> np.ndarray:
        """The stored categorical values ``[b, F]`` int64 of the rows of ``segments``."""
        raw = np.empty((b, self.triplets[0].num_sparse), dtype=np.int64)
        for lo, hi, f, local in segments:
            raw[lo:hi] = self._mapped()[f][2][local]
        return raw

    def _ids(self, raw: np.ndarray) -> np.ndarray:
        """Row ids ``[B, F]`` (``-1`` = missing) of the stored values (module docstring)."""
        ids = raw % self._ne
        ids[raw == 0] = -1
        return ids

    def zero_code(self, f: int) -> int:
        """``c = 2 - m`` of triplet ``f``: the integer ``round(exp(d))`` that ``x = 0`` is stored as
        (found once, from the file's first :data:`ZERO_CODE_ROWS` rows; see the module docstring).

        Raises:
            BinaryLayoutError: no value is the minimum of more than half of the columns, or a
                non-finite value in those rows.
        """
        if self._zero_code[f] is None:
            t = self.triplets[f]
            if t.num_dense == 0 or t.rows == 0:
                self._zero_code[f] = 2
            else:
                head = self._mapped()[f][1][:ZERO_CODE_ROWS]
                finite = np.isfinite(head).all(axis=1)
                if not finite.all():
                    raise BinaryLayoutError(f"{t.dense.path}: row {int(np.argmax(~finite))}: "
                                            f"non-finite dense value")
                col_min = np.rint(np.exp(head.min(axis=0).astype(np.float64))).astype(np.int64)
                values, counts = np.unique(col_min, return_counts=True)
                if counts.max() * 2 <= t.num_dense:
                    raise BinaryLayoutError(
                        f"{t.dense.path}: cannot find the stored code of x = 0 (column minima of the "
                        f"first {len(head)} rows: {col_min.tolist()}); use the stored dense values "
                        f"(--binary-dense stored)")
                self._zero_code[f] = int(values[np.argmax(counts)])
        return self._zero_code[f]

    @staticmethod
    def _text_dense(d: np.ndarray, code: int) -> np.ndarray:
        """``log(1 + max(x, 0))`` (float32) of ``x = round(exp(d)) - code``; exact through a table
        for ``x < 65536``, float64 math above."""
        x = np.rint(np.exp(d)).astype(np.int64) - code
        np.maximum(x, 0, out=x)
        big = x >= _LUT_SIZE
        out = _LOG1P[np.minimum(x, _LUT_SIZE - 1)]
        if big.any():
            out[big] = np.log1p(x[big].astype(np.float64))
        return out

    def _check_sparse(self, rows, file_of, raw) -> None:
        bad = (raw < 0).any(axis=1)
        if bad.any():
            self._raise_at(rows, file_of, bad, "sparse",
                           lambda i: f"negative categorical value {int(raw[i][raw[i] < 0][0])}")

    def _check_values(self, rows, file_of, labels, dense, raw) -> None:
        bad = (labels != 0) & (labels != 1)
        if bad.any():
            self._raise_at(rows, file_of, bad, "labels", lambda i: f"label {labels[i]}, expected 0 or 1")
        self._check_sparse(rows, file_of, raw)
        if not np.isfinite(dense).all():
            bad = ~np.isfinite(dense).all(axis=1)
            self._raise_at(rows, file_of, bad, "dense", lambda i: "non-finite dense value")
        lo, hi = _STORED_RANGE
        if self.dense_mode == "text" and dense.size and (dense.min() < lo or dense.max() > hi):
            out = (dense < lo) | (dense > hi)
            self._raise_at(rows, file_of, out.any(axis=1), "dense", lambda i: (
                f"dense value {float(dense[i][out[i]][0])!r} is not a log(x - m + 2) of tsv_to_npys "
                f"(range [log 2, log 2**32]); use the stored dense values (--binary-dense stored)"))

    def _raise_at(self, rows, file_of, bad, kind, what) -> None:
        i = int(np.argmax(bad))
        f = int(file_of[i])
        path = self.triplets[f].path_of(kind)
        raise BinaryLayoutError(f"{path}: row {int(rows[i] - self._starts[f])}: {what(i)}")

    def _batch(self, rows: np.ndarray):
        labels, dense, ids = self.arrays(rows)
        return make_batch(labels, dense, ids, self.categorical_names)
