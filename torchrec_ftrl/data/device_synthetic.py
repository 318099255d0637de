"""Random multi-hot CTR batches drawn on the training device (no host work, no host-to-device copy):
the synthetic input of MLPerf-shaped runs, where a host-built batch of 65,536 x 214 ids would bound
the step rate.

Each bag of feature ``f`` holds exactly ``multi_hot[f]`` ids (MLPerf's fixed multi-hot sizes; TorchRec's
``RandomRecDataset`` with ``min_ids_per_features == ids_per_features``), drawn independently:

* ``uniform``: uniform over the table's rows, as ``RandomRecDataset`` draws them
  (``torch.randint(0, rows)``);
* ``zipf``: Zipf-like with exponent ``alpha`` over ``rows`` ranks, row ``r`` about ``(r + 1) ** -alpha``
  likely, by inverting the continuous power-law CDF on ``[1, rows + 1)``:
  ``x = (1 + u ((rows + 1) ** (1 - alpha) - 1)) ** (1 / (1 - alpha))`` (``x = (rows + 1) ** u`` for
  alpha = 1), ``row = floor(x) - 1``, ``u`` uniform in [0, 1) (float64).

Dense features are standard normal (``RandomRecDataset``'s ``torch.randn``) and labels 0 / 1 with
probability 1/2, so a model learns nothing from them: this input measures speed only. Every batch is
a function of ``(seed, split, batch index)`` (its own generator seeded from them), so a resumed run
draws the batches the uninterrupted one would.
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional, Sequence

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

DISTRIBUTIONS = ("uniform", "zipf")
NUM_DENSE = 13
_SPLIT_SEED = {"train": 0, "val": 1}


class DeviceSyntheticSource:
    """A job data source (``categorical_names``, ``dense_names``, ``num_embeddings``, ``stats()``,
    ``train_batches``, ``validation_batches``) whose batches are built on ``device``.

    Args:
        num_embeddings: rows of each table (one table per feature, features ``C1``..``Cn``).
        multi_hot: ids per bag of each feature (default 1 each).
        distribution: ``"uniform"`` or ``"zipf"``; ``alpha``: the Zipf exponent (> 0).
        seed: the seed every batch's generator is derived from.
        device: where batches are drawn and returned. ``val_batches``: validation batches per rank.

    Batches: ``torchrec.datasets.utils.Batch`` with ``dense_features [B, 13]`` float32, KJT
    ``sparse_features`` (values int64 ``[B * sum(multi_hot)]``, lengths int32, feature-major),
    ``labels [B]`` float32, all on ``device``.

    Raises:
        ValueError: empty or non-positive ``num_embeddings`` / ``multi_hot``, lists of different
            lengths, an unknown ``distribution`` or ``alpha <= 0``, ``val_batches < 1``.
    """

    on_device = True   # the loader must not pin or copy these batches

    def __init__(self, num_embeddings: Sequence[int], multi_hot: Optional[Sequence[int]] = None,
                 distribution: str = "uniform", alpha: float = 1.05, seed: int = 0,
                 device: torch.device | str = "cpu", val_batches: int = 4) -> None:
        rows = [int(n) for n in num_embeddings]
        hot = [1] * len(rows) if multi_hot is None else [int(m) for m in multi_hot]
        if not rows or min(rows) < 1:
            raise ValueError(f"num_embeddings must be a non-empty list of ints >= 1, got {num_embeddings!r}")
        if not hot or min(hot) < 1 or len(hot) != len(rows):
            raise ValueError(f"multi_hot must hold one int >= 1 per table ({len(rows)}), got {multi_hot!r}")
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0, got {alpha!r}")
        if val_batches < 1:
            raise ValueError(f"val_batches must be >= 1, got {val_batches}")
        self.rows, self.multi_hot = rows, hot
        self.distribution, self.alpha, self.seed = distribution, float(alpha), int(seed)
        self.device, self.val_batches = torch.device(device), int(val_batches)
        self._per_batch = {}   # batch size -> (row count of each id [n] float64, lengths [F * B] int32)

    @property
    def categorical_names(self) -> tuple:
        return tuple(f"C{i + 1}" for i in range(len(self.rows)))

    @property
    def dense_names(self) -> tuple:
        return tuple(f"I{i + 1}" for i in range(NUM_DENSE))

    @property
    def num_embeddings(self) -> list:
        return list(self.rows)

    def stats(self):
        return None

    def _layout(self, batch_size: int):
        if batch_size not in self._per_batch:
            counts = torch.tensor([m * batch_size for m in self.multi_hot], device=self.device)
            rows = torch.tensor(self.rows, dtype=torch.float64, device=self.device)
            lengths = torch.tensor(self.multi_hot, dtype=torch.int32, device=self.device)
            self._per_batch[batch_size] = (torch.repeat_interleave(rows, counts),
                                           torch.repeat_interleave(lengths, batch_size))
        return self._per_batch[batch_size]

    def batch(self, split: str, index: int, batch_size: int):
        """Batch ``index`` of ``split`` (``"train"`` / ``"val"``) with ``batch_size`` rows (a
        ``Batch`` whose ``to()`` orders the calling CUDA stream after the draw)."""

        gen = torch.Generator(device=self.device)
        gen.manual_seed((self.seed * 1_000_003 + index) * 2 + _SPLIT_SEED[split])
        rows, lengths = self._layout(batch_size)
        u = torch.rand(rows.shape, dtype=torch.float64, generator=gen, device=self.device)
        if self.distribution == "uniform":
            ids = torch.floor(u * rows)
        elif self.alpha == 1.0:
            ids = torch.floor(torch.pow(rows + 1.0, u)) - 1.0
        else:
            e = 1.0 - self.alpha
            ids = torch.floor(torch.pow(1.0 + u * (torch.pow(rows + 1.0, e) - 1.0), 1.0 / e)) - 1.0
        ids = torch.minimum(ids, rows - 1.0).clamp_(min=0.0).to(torch.int64)
        per_key = [m * batch_size for m in self.multi_hot]
        kjt = KeyedJaggedTensor(keys=list(self.categorical_names), values=ids, lengths=lengths,
                                stride=batch_size, length_per_key=per_key,
                                offset_per_key=list(itertools.accumulate(per_key, initial=0)))
        dense = torch.randn(batch_size, NUM_DENSE, generator=gen, device=self.device)
        labels = torch.randint(0, 2, (batch_size,), generator=gen, device=self.device).float()
        batch = DrawnBatch(dense_features=dense, sparse_features=kjt, labels=labels)
        if self.device.type == "cuda":
            batch.drawn = torch.cuda.Event()
            batch.drawn.record()
        return batch

    def train_batches(self, rank: int, world_size: int, batch_size: int,
                      start_step: int = 0) -> Iterator:
        """Training steps ``start_step``, ... of ``rank``: batch ``step * world_size + rank``."""
        for step in itertools.count(start_step):
            yield self.batch("train", step * world_size + rank, batch_size)

    def validation_batches(self, rank: int, world_size: int, batch_size: int) -> "_LazyBatches":
        """``val_batches`` ``(Batch, batch_size)`` pairs, each drawn when iterated (nothing held)."""
        return _LazyBatches(self, [i * world_size + rank for i in range(self.val_batches)], batch_size)


class DrawnBatch(Batch):
    """A ``Batch`` drawn on a CUDA stream: ``to()`` makes the calling stream wait for the draw.
    TorchRec's train pipeline calls ``to()`` on its copy stream and then orders its other streams
    after that one, so no stream reads the ids before they are drawn."""

    drawn = None   # the torch.cuda.Event recorded after the draw (None on the CPU)

    def to(self, device, non_blocking: bool = False):
        if self.drawn is not None and torch.device(device).type == "cuda":
            torch.cuda.current_stream(device).wait_event(self.drawn)
        return super().to(device, non_blocking=non_blocking)


class _LazyBatches:
    """A sequence of validation ``(Batch, n_real)`` pairs drawn on iteration."""

    def __init__(self, source: DeviceSyntheticSource, indices: list, batch_size: int) -> None:
        self._source, self._indices, self._batch_size = source, indices, batch_size

    def __len__(self) -> int:
        return len(self._indices)

    def __iter__(self):
        for i in self._indices:
            yield self._source.batch("val", i, self._batch_size), self._batch_size
