"""The ``MANAGED_CACHING`` (``fused_uvm_caching``) placement's steps of the FTRL TBE: populating the HBM
cache for a batch (or taking a prefetched one), finding each row again for the update, and FBGEMM's
``prefetch``. The cache itself is :class:`~.cache.RowCache`, the TBE's ``cache``, which every step is
given."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from ..kernels.batch import TBEBatch
from .cache import RowCache

# The flat buffers a populate or flush moves rows between: (weights, accum, linear).
FlatBuffers = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def bags_per_feature(bsfpr: Optional[Sequence[Sequence[int]]]) -> Optional[list[int]]:
    """Bags of each feature of a VBE batch (``batch_size_per_feature_per_rank``), or None."""
    return [sum(int(b) for b in per_rank) for per_rank in bsfpr] if bsfpr is not None else None


class CachedLookup:
    """The cached steps of one TBE's lookups (see the module docstring), with the batches prefetched
    ahead of their forward.

    Attributes:
        prefetched: ``(keys, slots)`` of each batch :meth:`prefetch` brought in, oldest first.
        prefetch_stream: the stream prefetches overlap the forward on, once one did.
        forward_cache_work: an event recorded after the latest forward's cache lookup or populate
            while prefetches run on their own stream (the next prefetch waits for it: the cache's
            bookkeeping takes one lookup or populate at a time); None otherwise.
    """

    def __init__(self) -> None:
        self.prefetched: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.prefetch_stream: Optional[torch.cuda.Stream] = None
        self.forward_cache_work: Optional[torch.cuda.Event] = None

    def batch(self, cache: RowCache, batch: TBEBatch, bsfpr,
              buffers: FlatBuffers) -> tuple[TBEBatch, torch.Tensor, list]:
        """``batch`` with its rows' cache slots, the row keys, and the slot tensors whose lines
        populates locked for it (``prefetch_pipeline``; released after its update).

        Without a prefetched batch, the cache is populated for this one. With one, the oldest is
        taken (its populate brought this batch's rows in) and this batch's rows are looked up, so a
        prefetched batch that is not this one (a prefetch left over from a training loop) costs
        cache hits, never a wrong row. A VBE batch is populated again: TorchRec's pooled lookup
        prefetches it without its batch sizes, so the prefetch cached other rows."""
        keys = cache.linearize(batch.indices, batch.offsets, bags_per_feature(bsfpr))
        if self.prefetched:
            _, prefetched = self.prefetched.pop(0)
            self._wait_for_prefetch()
            if self.prefetch_stream is not None:
                # made on the prefetch stream, used from here on by this one (TorchRec passes
                # prefetch a forward_stream of its own, not the stream the forward runs on)
                prefetched.record_stream(torch.cuda.current_stream())
            if bsfpr is None:
                slots, locked = cache.lookup(keys), [prefetched]
            else:
                slots = cache.populate(keys, *buffers)
                locked = [prefetched, slots]
        else:
            slots = cache.populate(keys, *buffers)
            locked = [slots]
        if self.prefetch_stream is not None:
            self.forward_cache_work = torch.cuda.Event()
            self.forward_cache_work.record()
        return dataclasses.replace(batch, cache_locations=slots, cache_weights=cache.lxu_cache_weights,
                                   cache_states=cache.lxu_cache_states), keys, locked

    def _wait_for_prefetch(self) -> None:
        if self.prefetch_stream is not None:
            torch.cuda.current_stream().wait_stream(self.prefetch_stream)

    def relocate(self, cache: RowCache, batch: TBEBatch, keys: torch.Tensor, generation: int) -> TBEBatch:
        """The batch for its update, with each row's slot where it is now. Unchanged when no
        populate, invalidation or reset was issued since the forward looked the rows up (cache
        ``generation``): the forward's slots still hold. Otherwise the prefetch of a later batch is
        waited for and the rows are looked up again (a row may have been evicted, and written back,
        or cached since the forward)."""
        if cache.generation == generation:
            return batch
        self._wait_for_prefetch()
        return dataclasses.replace(batch, cache_locations=cache.lookup(keys, count=False))

    def after_update(self, cache: RowCache, locked: list) -> None:
        """After a cached batch's update: release its lines, and make the prefetch stream wait for
        the update (a later prefetch must not copy a row into the cache while it is updated)."""
        cache.written = True
        release(cache, locked)
        if self.prefetch_stream is not None:
            self.prefetch_stream.wait_stream(torch.cuda.current_stream())

    def use_stream(self, forward_stream: Optional[torch.cuda.Stream], prefetch_pipeline: bool) -> None:
        """Before a prefetch: with ``forward_stream`` (the prefetch overlaps the forward of the batch
        before), prefetches run on the current stream from now on.

        Raises:
            ValueError: ``forward_stream`` without ``prefetch_pipeline``, which keeps the batch
                before's rows from being evicted under it.
        """
        if forward_stream is None:
            return
        if not prefetch_pipeline:
            raise ValueError("prefetch(forward_stream=...) overlaps the previous batch's forward and "
                             "needs prefetch_pipeline=True (LRU line locking); got "
                             "prefetch_pipeline=False")
        if self.prefetch_stream is None:
            self.prefetch_stream = torch.cuda.current_stream()

    def prefetch(self, cache: RowCache, batch: TBEBatch, bsfpr, buffers: FlatBuffers,
                 forward_stream: Optional[torch.cuda.Stream]) -> None:
        """Bring the rows of ``batch`` into the cache ahead of its forward (see the TBE's
        :meth:`prefetch`; :meth:`use_stream` first). On its own stream it first waits for the
        latest forward's cache work (:attr:`forward_cache_work`), not for the rest of that forward."""
        if self.forward_cache_work is not None:
            torch.cuda.current_stream().wait_event(self.forward_cache_work)
            self.forward_cache_work = None
        keys = cache.linearize(batch.indices, batch.offsets, bags_per_feature(bsfpr))
        slots = cache.populate(keys, *buffers)
        if forward_stream is not None:
            keys.record_stream(forward_stream)
            slots.record_stream(forward_stream)
        self.prefetched.append((keys, slots))

    def reset(self, cache: RowCache) -> None:
        """Empty the cache without writing it back and forget prefetched batches. With prefetches on
        their own stream, the reset waits for them and the next one waits for the reset."""
        self._wait_for_prefetch()
        cache.reset()
        self.prefetched.clear()
        self.forward_cache_work = None
        if self.prefetch_stream is not None:
            self.prefetch_stream.wait_stream(torch.cuda.current_stream())


def release(cache: RowCache, locked: list) -> None:
    """Unlock the cache lines of each slot tensor in ``locked``."""
    for slots in locked:
        cache.unlock(slots)
