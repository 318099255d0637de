"""One training step of the CTR job, two ways (``--pipeline``):

* ``sparse_dist``: TorchRec's ``TrainPipelineSparseDist``. Each ``progress`` call trains batch ``i``
  (forward, backward with the fused embedding update, optimizer step) while batch ``i + 1``'s sparse
  input all-to-all (input dist) and batch ``i + 2``'s host-to-device copy are in flight (on their own
  CUDA streams on a GPU; in order on the CPU).
* ``none``: the plain loop (next batch, copy, forward, backward, optimizer step), one batch at a time.

Both train the same batches in the same order with the same arithmetic (the input dist of a later
batch only moves its ids, so it does not see the embedding update of the batch being trained); on
the CPU the tests check that their checkpoints are bitwise equal. Both call ``on_batch(kjt)`` with
each training batch's CPU ``KeyedJaggedTensor`` once that batch's step is done (the pipeline reads up
to two batches ahead; calling it at read time would count batches of later steps in a checkpoint's
state). The plain loop uses the ``record_function`` labels of TorchRec's pipelines
(``## next_batch ##``, ``## copy_batch_to_gpu ##``, ``## zero_grad ##``, ``## forward ##``,
``## backward ##``, ``## optimizer ##``), so a profile reads the same for both.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from typing import Callable, Iterator

import torch
from torch.autograd.profiler import record_function

from .profile import TRACKER_LABEL

PIPELINES = ("sparse_dist", "none")


class PlainLoop:
    """``--pipeline none``: one batch per :meth:`step`, nothing in flight between steps."""

    def __init__(self, model: torch.nn.Module, optimizer, device: torch.device, batches: Iterator,
                 on_batch: Callable) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self._batches, self._on_batch = batches, on_batch

    def fill(self) -> None:
        """Before the first step: nothing (the plain loop reads each batch in its step)."""

    def step(self) -> torch.Tensor:
        """Train the next batch; returns its loss (0-d float32, detached, on the device).

        Raises:
            StopIteration: the batches are exhausted.
        """
        with record_function("## next_batch ##"):
            batch = next(self._batches)
        with record_function("## copy_batch_to_gpu ##"):
            dev_batch = batch.to(self.device)
        with record_function("## zero_grad ##"):
            self.optimizer.zero_grad()
        with record_function("## forward ##"):
            loss, _ = self.model(dev_batch)
        with record_function("## backward ##"):
            loss.backward()
        with record_function("## optimizer ##"):
            self.optimizer.step()
        with record_function(TRACKER_LABEL):
            self._on_batch(batch.sparse_features)
        return loss.detach()

    @contextlib.contextmanager
    def paused(self) -> Iterator[torch.nn.Module]:
        """``with loop.paused() as model:`` the model, for a forward outside the loop (validation)."""
        yield self.model


class SparseDistLoop:
    """``--pipeline sparse_dist``: ``TrainPipelineSparseDist(model, optimizer, device,
    execute_all_batches=True)`` over ``batches`` (pinned by the caller on a GPU, so that the
    pipeline's host-to-device copy is asynchronous); one ``progress`` per :meth:`step`."""

    def __init__(self, model: torch.nn.Module, optimizer, device: torch.device, batches: Iterator,
                 on_batch: Callable) -> None:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        self._pending = collections.deque()  # CPU KJTs of the batches read but not yet trained
        self._on_batch = on_batch

        def read():
            for batch in batches:
                self._pending.append(batch.sparse_features)
                yield batch

        self._batches = read()
        self.pipeline = TrainPipelineSparseDist(model, optimizer, device, execute_all_batches=True)

    def fill(self) -> None:
        """Before the first step: the pipeline's ``fill_pipeline`` (its first ``progress`` does it
        otherwise): the first two batches read and copied to the device, the sharded modules'
        forward rewritten (TorchRec traces the model with ``torch.fx``) and the first batch's input
        dist. The batches and their order do not change."""
        self.pipeline.fill_pipeline(self._batches)

    def step(self) -> torch.Tensor:
        """Train the next batch; returns its loss (0-d float32, detached, on the device).

        Raises:
            StopIteration: every batch has been trained (``progress`` found the pipeline empty).
        """
        loss, _, _ = self.pipeline.progress(self._batches)
        with record_function(TRACKER_LABEL):
            self._on_batch(self._pending.popleft())
        return loss

    @contextlib.contextmanager
    def paused(self) -> Iterator[torch.nn.Module]:
        """``with loop.paused() as model:`` the model with its sharded modules' own forward back
        (``pipeline.detach()``), for a forward outside the pipeline (validation); on exit
        ``pipeline.attach()`` rewrites it again for the batches in flight, which stay in the
        pipeline (TorchRec's detach / attach of a pipeline mid-training)."""
        model = self.pipeline.detach()
        try:
            yield model
        finally:
            self.pipeline.attach(model)


def make(kind: str, model: torch.nn.Module, optimizer, device: torch.device, batches: Iterator,
         num_batches: int, on_batch: Callable):
    """The loop named ``kind`` (one of :data:`PIPELINES`) over the first ``num_batches`` of
    ``batches`` (``torchrec.datasets.utils.Batch`` on the CPU); ``model(batch)`` returns ``(loss,
    output)``.

    Raises:
        ValueError: ``kind`` not in :data:`PIPELINES`, or ``num_batches < 0``.
    """
    if kind not in PIPELINES:
        raise ValueError(f"pipeline must be one of {PIPELINES}, got {kind!r}")
    if num_batches < 0:
        raise ValueError(f"num_batches must be >= 0, got {num_batches}")
    cls = SparseDistLoop if kind == "sparse_dist" else PlainLoop
    return cls(model, optimizer, device, itertools.islice(batches, num_batches), on_batch)
