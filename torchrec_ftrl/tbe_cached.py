"""The ``MANAGED_CACHING`` (``fused_uvm_caching``) placement of the FTRL TBE: populating the HBM
cache for a batch (or taking a prefetched one), finding each row again for the update, and
FBGEMM's ``prefetch`` / ``get_uvm_cache_stats``. A mixin of
:class:`torchrec_ftrl.tbe.FTRLTableBatchedEmbeddingBags`; the cache itself is
:class:`torchrec_ftrl.cache.RowCache`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import torch

from .cache import UVM_CACHE_STATS
from .fbgemm_enums import BoundsCheckMode
from .kernels.layout import TBEBatch


class CachedLookupMixin:
    """The cached placement's steps of a forward and its update (see the module docstring)."""

    def _cached_batch(self, batch: TBEBatch, bsfpr) -> tuple[TBEBatch, torch.Tensor, list]:
        """``batch`` with its rows' cache slots, the row keys, and the slot tensors whose lines
        populates locked for it (``prefetch_pipeline``; released after its update).

        Without a prefetched batch, the cache is populated for this one. With one, the oldest is
        taken (its populate brought this batch's rows in) and this batch's rows are looked up, so a
        prefetched batch that is not this one (a prefetch left over from a training loop) costs
        cache hits, never a wrong row. A VBE batch is populated again: TorchRec's pooled lookup
        prefetches it without its batch sizes, so the prefetch cached other rows."""
        bags = self._bags_per_feature(bsfpr)
        keys = self.cache.linearize(batch.indices, batch.offsets, bags)
        populate = functools.partial(self.cache.populate, keys, self.weights_dev, self.accum_dev,
                                     self.linear_dev)
        if self._prefetched:
            _, prefetched = self._prefetched.pop(0)
            if self._prefetch_stream is not None:
                torch.cuda.current_stream().wait_stream(self._prefetch_stream)
            if bsfpr is None:
                slots, locked = self.cache.lookup(keys), [prefetched]
            else:
                slots = populate()
                locked = [prefetched, slots]
        else:
            slots = populate()
            locked = [slots]
        return dataclasses.replace(batch, cache_locations=slots,
                                   cache_weights=self.cache.lxu_cache_weights,
                                   cache_states=self.cache.lxu_cache_states), keys, locked

    @staticmethod
    def _bags_per_feature(bsfpr) -> Optional[list[int]]:
        return [sum(int(b) for b in per_rank) for per_rank in bsfpr] if bsfpr is not None else None

    def _relocate_cached_rows(self, batch: TBEBatch, keys: torch.Tensor, locked: list,
                              generation: int) -> TBEBatch:
        """The batch for its update, with each row's slot where it is now. Unchanged when no
        populate, invalidation or reset was issued since the forward looked the rows up (cache
        ``generation``): the forward's slots still hold. Otherwise the prefetch of a later batch is
        waited for and the rows are looked up again (a row may have been evicted, and written back,
        or cached since the forward)."""
        if self.cache.generation == generation:
            return batch
        if self._prefetch_stream is not None:
            torch.cuda.current_stream().wait_stream(self._prefetch_stream)
        return dataclasses.replace(batch, cache_locations=self.cache.lookup(keys, count=False))

    def _after_cached_update(self, keys: torch.Tensor, locked: list, generation: int) -> None:
        """After a cached batch's update: release its lines, and make the prefetch stream wait for
        the update (a later prefetch must not copy a row into the cache while it is updated)."""
        self.cache.written = True
        self._release(locked)
        if self._prefetch_stream is not None:
            self._prefetch_stream.wait_stream(torch.cuda.current_stream())

    def _release(self, locked: list) -> None:
        for slots in locked:
            self.cache.unlock(slots)

    def prefetch(self, indices: torch.Tensor, offsets: torch.Tensor,
                 forward_stream: Optional[torch.cuda.Stream] = None,
                 batch_size_per_feature_per_rank: Optional[Sequence[Sequence[int]]] = None) -> None:
        """Bring a batch's rows into the HBM cache ahead of its :meth:`forward` (FBGEMM's
        ``prefetch``; TorchRec's ``PrefetchTrainPipelineSparseDist`` calls it on its prefetch
        stream). Each forward takes the oldest prefetched batch. With ``prefetch_pipeline=True``
        the batch's lines stay locked until its update. A no-op for the other placements.

        The prefetch only warms the cache: out-of-range indices are read as row 0 here (the forward
        checks its batch by ``bounds_check_mode``), and a batch whose bag count does not fit the
        features (a VBE batch given without its batch sizes) is skipped.

        Raises:
            ValueError: ``forward_stream`` (a prefetch on its own stream, overlapping the forward of
                the batch before) without ``prefetch_pipeline=True``, which keeps that batch's rows
                from being evicted under it; indices / offsets that are not 1-D int tensors on the
                tables' device.
        """
        if self.cache is None:
            return
        if forward_stream is not None and not self.prefetch_pipeline:
            raise ValueError("prefetch(forward_stream=...) overlaps the previous batch's forward and "
                             "needs prefetch_pipeline=True (LRU line locking); got "
                             "prefetch_pipeline=False")
        if forward_stream is not None and self._prefetch_stream is None:
            self._prefetch_stream = torch.cuda.current_stream()
        F = len(self.feature_table_map)
        if batch_size_per_feature_per_rank is None and (offsets.numel() - 1) % F != 0:
            return
        mode, self.bounds_check_mode = self.bounds_check_mode, BoundsCheckMode.WARNING
        try:
            batch = self._make_batch(indices, offsets, None, batch_size_per_feature_per_rank,
                                     warn_counter=torch.zeros_like(self.bounds_check_warning))
        finally:
            self.bounds_check_mode = mode
        keys = self.cache.linearize(batch.indices, batch.offsets,
                                    self._bags_per_feature(batch_size_per_feature_per_rank))
        slots = self.cache.populate(keys, self.weights_dev, self.accum_dev, self.linear_dev)
        if forward_stream is not None:
            keys.record_stream(forward_stream)
            slots.record_stream(forward_stream)
        self._prefetched.append((keys, slots))

    def get_uvm_cache_stats(self) -> torch.Tensor:
        """int64 ``[6]`` cumulative FBGEMM cache statistics (``torchrec_ftrl.cache.UVM_CACHE_STATS``:
        calls, requested indices, unique indices, unique misses, conflict unique misses, conflict
        misses), counted when ``gather_uvm_cache_stats=True``; zeros otherwise or uncached."""
        if self.cache is None:
            return torch.zeros(len(UVM_CACHE_STATS), dtype=torch.int64)
        return self.cache.uvm_cache_stats.clone()
