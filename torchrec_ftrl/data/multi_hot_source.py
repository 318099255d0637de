"""Rank-sharded batches from TorchRec's materialised multi-hot Criteo layout (see
:mod:`.multi_hot_layout`), built as :class:`BinarySource` builds the one-hot layout's: the same row
order, split, row-to-rank assignment, labels and dense values; only the sparse features differ.

Categorical: the bag of row ``i`` of feature ``f`` is the stored ``[multi_hot[f]]`` ids of member
``f`` of the ``.npz``, every bag full (the materialised layout has no missing value: a missing
one-hot value was stored as 0 and its bag is row 0's), as the KJTs of TorchRec's
``MultiHotCriteoIterDataPipe`` hold them. An id ``v >= num_embeddings[f]`` becomes ``v %
num_embeddings[f]``, as the one-hot layout's values do; the stored ids are already below the table
sizes they were materialised for, so with those sizes every id stays as stored.

TorchRec's ``MultiHotCriteoIterDataPipe`` itself is not used: it is not part of the torchrec package
(it lives in the DLRM example's folder), and it is an ``IterableDataset`` that walks the files once in
order (train: every file; val / test: halves of the first one), while the job's DataLoader workers
build any step's batch from the step alone (:meth:`BinarySource.train_batch`) and cycle over epochs.
It memory-maps the ``.npz`` members the way this class does (:func:`.multi_hot_layout.read_members`).
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from . import multi_hot_layout
from .batching import make_multi_hot_batch
from .binary_source import BinarySource


def _mmap_member(info) -> np.ndarray:
    """The ``[rows, h]`` member ``info`` memory-mapped read-only (empty for 0 rows)."""
    if info.rows == 0:
        return np.empty(info.shape, dtype=info.dtype)
    return np.memmap(info.path, dtype=info.dtype, mode="r", offset=info.offset, shape=info.shape)


class MultiHotBinarySource(BinarySource):
    """:class:`BinarySource` over a folder of ``PREFIX_{dense,labels}.npy`` /
    ``PREFIX_sparse_multi_hot.npz`` triplets (same arguments).

    Batches: ``Batch`` with ``dense_features [B, D]`` float32, a KJT whose bags of feature ``f`` hold
    ``multi_hot[f]`` int64 ids (values ``[B * sum(multi_hot)]``, key-major), ``labels [B]`` float32;
    :meth:`arrays` returns ``(labels, dense, values)`` with those values.

    Raises: as :class:`BinarySource`, with :func:`.multi_hot_layout.load_layout`'s errors; in a batch,
    a negative id raises ``BinaryLayoutError`` naming the ``.npz``, feature and row.
    """

    _load_layout = staticmethod(multi_hot_layout.load_layout)

    @property
    def multi_hot(self) -> Tuple[int, ...]:
        """Ids per bag of each feature (the ``.npz`` members' widths)."""
        return self.triplets[0].multi_hot

    @staticmethod
    def _mmap_sparse(t) -> Tuple[np.ndarray, ...]:
        return tuple(_mmap_member(s) for s in t.sparse)

    def _views(self, values: np.ndarray, b: int) -> List[np.ndarray]:
        """Feature ``f``'s ``[b, multi_hot[f]]`` block of the key-major ``values``."""
        ends = np.cumsum([b * h for h in self.multi_hot]).tolist()
        return [values[e - b * h:e].reshape(b, h) for e, h in zip(ends, self.multi_hot)]

    def _read_sparse(self, segments: List[tuple], b: int) -> np.ndarray:
        """The stored ids of the rows of ``segments``: int64 ``[b * sum(multi_hot)]``, key-major."""
        values = np.empty(b * sum(self.multi_hot), dtype=np.int64)
        for f, view in enumerate(self._views(values, b)):
            for lo, hi, t, local in segments:
                view[lo:hi] = self._mapped()[t][2][f][local]
        return values

    def _check_sparse(self, rows, file_of, values) -> None:
        for f, view in enumerate(self._views(values, rows.shape[0])):
            if view.size and view.min() < 0:
                bad = (view < 0).any(axis=1)
                self._raise_at(rows, file_of, bad, "sparse",
                               lambda i: f"negative id {int(view[i][view[i] < 0][0])} of feature {f} "
                                         f"(member {f}.npy)")

    def _ids(self, values: np.ndarray) -> np.ndarray:
        """``values`` with every id ``v >= num_embeddings[f]`` replaced by ``v % num_embeddings[f]``
        (in place)."""
        b = values.shape[0] // sum(self.multi_hot)
        for view, n in zip(self._views(values, b), self._ne.tolist()):
            if view.size and view.max() >= n:
                np.remainder(view, n, out=view)
        return values

    def _batch(self, rows: np.ndarray):
        labels, dense, values = self.arrays(rows)
        return make_multi_hot_batch(labels, dense, values, self.multi_hot, self.categorical_names)
