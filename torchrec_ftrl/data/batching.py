"""Rows -> torchrec ``Batch`` (dense ``[B, n_dense]`` float32, KJT sparse, labels ``[B]`` float32)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def make_batch(labels: np.ndarray, dense: np.ndarray, ids: np.ndarray, keys: Sequence[str]):
    """Build a ``torchrec.datasets.utils.Batch``.

    Args:
        labels: ``[B]`` 0/1.
        dense: ``[B, n_dense]`` float (already transformed); ``n_dense`` may be 0.
        ids: ``[B, F]`` int64 row ids, ``-1`` = missing (an empty bag for that sample and key).
        keys: the ``F`` feature names, in ``ids`` column order.

    Returns:
        ``Batch`` whose ``sparse_features`` is a KJT with ``keys``, int64 ``values`` and int32
        ``lengths`` of shape ``[F * B]`` (key-major: all samples of key 0, then key 1, ...), stride
        ``B`` and ``length_per_key`` / ``offset_per_key`` already set (as ``from_lengths_sync`` sets
        them).

    Raises:
        ValueError: shapes that disagree (naming them).
    """
    labels, dense, b = _labels_dense(labels, dense)
    ids = np.asarray(ids, dtype=np.int64)
    if dense.ndim != 2 or dense.shape[0] != b or ids.ndim != 2 or ids.shape[0] != b \
            or ids.shape[1] != len(keys):
        raise ValueError(f"make_batch shapes disagree: labels {labels.shape}, dense {dense.shape}, "
                         f"ids {ids.shape}, {len(keys)} keys")
    ids_t = np.ascontiguousarray(ids.T)  # [F, B], key-major like the KJT
    present = ids_t >= 0
    per_key = present.sum(axis=1).tolist()  # what KJT.sync() computes, here without a torch reduction
    return _assemble(labels, dense, keys, ids_t[present], present.reshape(-1).astype(np.int32), per_key)


def _labels_dense(labels, dense):
    """``(labels, dense float32, B)`` as arrays."""
    labels = np.asarray(labels)
    return labels, np.asarray(dense, dtype=np.float32), labels.shape[0]


def _assemble(labels: np.ndarray, dense: np.ndarray, keys: Sequence[str], values: np.ndarray,
              lengths: np.ndarray, per_key: list):
    """The ``Batch`` of checked arrays: KJT ``values`` / ``lengths`` (key-major), ``per_key`` ids
    per key."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(
        keys=list(keys),
        values=torch.from_numpy(values),
        lengths=torch.from_numpy(lengths),
        stride=labels.shape[0],
        length_per_key=per_key,
        offset_per_key=np.concatenate([[0], np.cumsum(per_key, dtype=np.int64)]).tolist(),
    )
    return Batch(dense_features=torch.from_numpy(dense),
                 sparse_features=kjt,
                 labels=torch.from_numpy(labels.astype(np.float32)))


def make_multi_hot_batch(labels: np.ndarray, dense: np.ndarray, values: np.ndarray,
                         multi_hot: Sequence[int], keys: Sequence[str]):
    """Build a ``torchrec.datasets.utils.Batch`` whose bags of feature ``f`` hold ``multi_hot[f]`` ids
    each (the KJT of TorchRec's ``MultiHotCriteoIterDataPipe._np_arrays_to_batch``, ids in int64).

    Args:
        labels: ``[B]`` 0/1. dense: ``[B, n_dense]`` float (already transformed).
        values: ``[B * sum(multi_hot)]`` int64 row ids, key-major: feature 0's ``[B, multi_hot[0]]``
            bags flattened, then feature 1's, ...
        multi_hot: ids per bag of each feature. keys: the feature names.

    Returns:
        ``Batch`` whose ``sparse_features`` KJT has int64 ``values`` (``values`` itself), int32
        ``lengths`` ``[F * B]``, stride ``B``, and ``length_per_key`` / ``offset_per_key`` set.

    Raises:
        ValueError: shapes that disagree (naming them).
    """
    labels, dense, b = _labels_dense(labels, dense)
    values = np.asarray(values, dtype=np.int64)
    per_key = [b * int(h) for h in multi_hot]
    if dense.ndim != 2 or dense.shape[0] != b or values.shape != (sum(per_key),) \
            or len(multi_hot) != len(keys):
        raise ValueError(f"make_multi_hot_batch shapes disagree: labels {labels.shape}, dense "
                         f"{dense.shape}, values {values.shape}, multi_hot {list(multi_hot)}, "
                         f"{len(keys)} keys")
    lengths = np.repeat(np.asarray(multi_hot, dtype=np.int32), b)
    return _assemble(labels, dense, keys, values, lengths, per_key)
