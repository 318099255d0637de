"""A rank's training batches, built off the training thread by ``torch.utils.data.DataLoader`` workers.

:func:`train_loader` yields exactly the batches ``source.train_batches(rank, world_size, batch_size,
start_step)`` yields, in the same order, whatever the number of workers:

* A source with ``train_batch(rank, world_size, batch_size, step)`` (:class:`SyntheticSource`,
  :class:`BinarySource`: a step's batch is a pure function of the step) is read as a map-style
  dataset indexed by step, with ``workers`` processes. The sampler is the steps in order and the
  DataLoader returns results in sampler order (``in_order``), so worker ``w`` builds steps ``w, w +
  workers, ...`` and the training thread receives them in step order.
* Any other source (:class:`FileSource`: a text stream whose row positions depend on every earlier
  line) is read as an iterable dataset by one worker process, which runs the source's own iterator.

``pin_memory=True`` pins each batch in the DataLoader's pinning thread (page-locked host memory, so
the host-to-device copy of TorchRec's train pipelines is asynchronous). ``workers=0`` builds and pins
the batches on the calling thread.

Workers are forked processes (the Linux default): they inherit the source (memory-mapped binary
arrays included) and use no CUDA. A worker's changes to the source (a :class:`FileSource`'s reader
statistics of a later pass, ``epoch``) stay in the worker.
"""

from __future__ import annotations

import itertools
from typing import Iterator

from torch.utils.data import DataLoader, Dataset, IterableDataset


class _Failed:
    """What a worker returns in place of a batch when building it raised: the exception itself, which
    the training thread raises as it was (DataLoader would otherwise re-raise it wrapped, with the
    worker's traceback in its message)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _raising(batches: Iterator) -> Iterator:
    for batch in batches:
        if isinstance(batch, _Failed):
            raise batch.error
        yield batch


class _StepBatches(Dataset):
    """Map-style: item ``step`` is ``source.train_batch(rank, world_size, batch_size, step)``."""

    def __init__(self, source, rank: int, world_size: int, batch_size: int) -> None:
        self.source, self.rank, self.world_size, self.batch_size = source, rank, world_size, batch_size

    def __getitem__(self, step: int):
        try:
            return self.source.train_batch(self.rank, self.world_size, self.batch_size, step)
        except Exception as e:  # noqa: BLE001 - raised again, unchanged, on the training thread
            return _Failed(e)


class _StreamBatches(IterableDataset):
    """Iterable: ``source.train_batches(rank, world_size, batch_size, start_step)`` (one worker)."""

    def __init__(self, source, rank: int, world_size: int, batch_size: int, start_step: int) -> None:
        self.args = (source, rank, world_size, batch_size, start_step)

    def __iter__(self):
        source, rank, world_size, batch_size, start_step = self.args
        try:
            yield from source.train_batches(rank, world_size, batch_size, start_step=start_step)
        except Exception as e:  # noqa: BLE001 - raised again, unchanged, on the training thread
            yield _Failed(e)


def _pinned(batches: Iterator) -> Iterator:
    for batch in batches:
        yield batch.pin_memory()


def train_loader(source, rank: int, world_size: int, batch_size: int, start_step: int,
                 num_steps: int, workers: int = 0, pin_memory: bool = False,
                 prefetch_factor: int = 4) -> Iterator:
    """The ``num_steps`` training batches of ``rank`` from step ``start_step`` on
    (``torchrec.datasets.utils.Batch`` on the CPU, pinned when ``pin_memory``).

    Args:
        source: a data source (:mod:`.sources`, :class:`BinarySource`).
        workers: DataLoader worker processes (0: on the calling thread). A source without
            ``train_batch`` uses one worker whenever ``workers > 0``.
        pin_memory: pin each batch (needs an accelerator; the job passes it on CUDA only).
        prefetch_factor: batches each worker builds ahead.

    Raises:
        ValueError: ``workers``, ``num_steps`` or ``start_step`` negative, or ``prefetch_factor < 1``.
        Whatever building a batch raises (e.g. ``MalformedRowError``), unchanged, when that batch is
        reached: in a worker too.
    """
    for name, value in (("workers", workers), ("num_steps", num_steps), ("start_step", start_step)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if prefetch_factor < 1:
        raise ValueError(f"prefetch_factor must be >= 1, got {prefetch_factor}")
    if workers == 0:
        batches = itertools.islice(
            source.train_batches(rank, world_size, batch_size, start_step=start_step), num_steps)
        return _pinned(batches) if pin_memory else batches
    if num_steps == 0:
        return iter(())
    common = dict(batch_size=None, pin_memory=pin_memory, prefetch_factor=prefetch_factor)
    if hasattr(source, "train_batch"):
        steps = range(start_step, start_step + num_steps)
        loader = DataLoader(_StepBatches(source, rank, world_size, batch_size), sampler=steps,
                            num_workers=min(workers, num_steps), **common)
        return _raising(iter(loader))
    loader = DataLoader(_StreamBatches(source, rank, world_size, batch_size, start_step),
                        num_workers=1, **common)
    return _raising(itertools.islice(iter(loader), num_steps))
