"""Deterministic synthetic Criteo-like click log with a planted signal (the job's no-data default).

Parameters (per seed): each categorical feature ``f`` has a vocabulary of ``V_f`` distinct values,
placed at fixed distinct row ids in ``[0, num_embeddings[f])``, and a hidden effect per value
(Gaussian, larger for the first features, 0 for the last ones). Each dense feature is a log-normal
count with a hidden weight. A sample draws values with a heavy head (value rank ``k = floor(V *
u**2.5)``, u uniform), drops some of them (missing), and gets ``label ~ Bernoulli(sigmoid(logit))``
with ``logit = bias + sum_f effect_f[value_f] + sum_j w_j * (log1p(count_j) - mu_j)``. The dense
features are ``log1p(count)`` (the same transform as real Criteo), so a model can reach an AUC well
above 0.5; ``logits(...)`` exposes the true logit for checks.

Every batch is a pure function of ``(seed, split, index, batch_size)``: numpy ``Generator`` seeded
with ``SeedSequence([seed, split_code, index, batch_size])``.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

from .batching import make_batch

_SPLIT_CODES = {"train": 1, "val": 2}


class SyntheticCTR:
    """Args:
        num_embeddings: table size per categorical feature (an int for all 26, or a list).
        num_dense: number of dense features (13 like Criteo).
        num_categorical: number of categorical features (26 like Criteo) when ``num_embeddings``
            is an int.
        seed: parameter and sample seed.
        vocab: distinct values per feature (capped at the table size).
        signal: scale of the planted effects (0 gives labels independent of the features).

    Raises:
        ValueError: a table size < 1, ``num_categorical < 1``, ``num_dense < 0``, ``vocab < 1``.
    """

    def __init__(self, num_embeddings: Union[int, Sequence[int]] = 10_000, num_dense: int = 13,
                 num_categorical: int = 26, seed: int = 0, vocab: int = 2_000,
                 signal: float = 1.0) -> None:
        if isinstance(num_embeddings, int):
            if num_categorical < 1:
                raise ValueError(f"num_categorical must be >= 1, got {num_categorical}")
            num_embeddings = [num_embeddings] * num_categorical
        self.num_embeddings = [int(n) for n in num_embeddings]
        if any(n < 1 for n in self.num_embeddings):
            raise ValueError(f"num_embeddings entries must be >= 1, got {self.num_embeddings}")
        if num_dense < 0:
            raise ValueError(f"num_dense must be >= 0, got {num_dense}")
        if vocab < 1:
            raise ValueError(f"vocab must be >= 1, got {vocab}")
        self.seed = int(seed)
        self.num_dense = int(num_dense)
        f = len(self.num_embeddings)
        self.dense_names = tuple(f"I{i + 1}" for i in range(num_dense))
        self.categorical_names = tuple(f"C{i + 1}" for i in range(f))
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0]))
        self._vocab_ids, self._effects = [], []
        for i, n in enumerate(self.num_embeddings):
            v = min(vocab, n)
            self._vocab_ids.append(np.sort(rng.choice(n, size=v, replace=False)).astype(np.int64))
            scale = signal * (0.8 if i < f // 3 else 0.4 if i < 2 * f // 3 else 0.0)
            self._effects.append(rng.normal(0.0, 1.0, size=v) * scale)
        self._missing = np.where(np.arange(f) >= f - 6, 0.3, 0.02)
        self._mu = rng.uniform(0.5, 4.0, size=num_dense)
        self._w = rng.normal(0.0, 0.4 * signal, size=num_dense)
        self._bias = -1.8

    def _draw(self, split: str, index: int, batch_size: int):
        if split not in _SPLIT_CODES:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if index < 0 or batch_size < 1:
            raise ValueError(f"need index >= 0 and batch_size >= 1, got {index}, {batch_size}")
        rng = np.random.default_rng(
            np.random.SeedSequence([self.seed, _SPLIT_CODES[split], int(index), int(batch_size)]))
        b, f = batch_size, len(self.num_embeddings)
        counts = np.floor(np.exp(rng.normal(self._mu, 1.2, size=(b, self.num_dense))))
        dense = np.log1p(counts)
        logit = self._bias + (dense - self._mu) @ self._w
        ids = np.empty((b, f), dtype=np.int64)
        missing = rng.random((b, f)) < self._missing
        for j in range(f):
            v = len(self._vocab_ids[j])
            k = np.minimum((v * rng.random(b) ** 2.5).astype(np.int64), v - 1)
            ids[:, j] = np.where(missing[:, j], -1, self._vocab_ids[j][k])
            logit = logit + np.where(missing[:, j], 0.0, self._effects[j][k])
        labels = (rng.random(b) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
        return labels, dense.astype(np.float32), ids, logit

    def batch(self, split: str, index: int, batch_size: int):
        """The ``index``-th batch of ``split`` (``"train"`` or ``"val"``) as a torchrec ``Batch``."""
        labels, dense, ids, _ = self._draw(split, index, batch_size)
        return make_batch(labels, dense, ids, self.categorical_names)

    def arrays(self, split: str, index: int, batch_size: int):
        """``(labels [B] int64, dense [B, num_dense] float32, ids [B, F] int64 (-1 missing),
        true_logit [B] float64)`` of the same batch as ``batch(split, index, batch_size)``."""
        return self._draw(split, index, batch_size)
