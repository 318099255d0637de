"""The HBM row cache of the UVM-caching placement (``fused_uvm_caching``), built on FBGEMM's cache ops.

FBGEMM's ops keep the weights and the slots' bookkeeping: ``linearize_cache_indices`` (row keys), ``lru_cache_populate`` /
``lfu_cache_populate`` (insert the batch's missing rows into ``lxu_cache_weights``, writing evicted
rows back to unified memory), ``lxu_cache_lookup`` (each index's cache slot, -1 where a row could
not be cached), ``lxu_cache_flush`` and ``lxu_cache_locking_counter_decrement``. The FTRL states
follow (:mod:`torchrec_ftrl.kernels.cuda.cache`): after every populate, the slots that took a row
of the batch move the evicted row's ``accum`` / ``linear`` back to the unified-memory buffers and
load the inserted row's into the state cache (``lxu_cache_accum`` and ``lxu_cache_linear``, ``[slots,
S]`` each in its state's dtype, fp32 or bf16, the weight cache's row stride ``S``: a bf16 state
moves half the bytes, and a cached row is moved as stored, bit for bit); a flush writes every cached
row's states back. So a cached row's weight
and both states are updated in HBM and reach unified memory on eviction or :meth:`RowCache.flush`.

A slot holds exactly the arrays of the table's row layout (:class:`~torchrec_ftrl.row_layout.RowLayout`):
a row-wise ``accum`` is one value per slot (``lxu_cache_accum`` ``[slots, 1]``), and a derived-weights
table has no weight cache (``lxu_cache_weights`` ``[slots, 0]``): FBGEMM's populate is given rows of
zero width (``D_offsets`` all 0), so it places and evicts rows and copies nothing, and the Triton
kernels move ``linear`` and ``accum``. (FBGEMM 1.6's cache ops copy fp32 / fp16 rows only, so a bf16
``linear`` could not be its "weights".)

Every table of a cached TBE is cached (a TBE holds tables of one placement; ``torchrec_ftrl.sharders()``
plans accordingly), so the linear cache index of ``index`` in table ``t`` is ``row_base[t] + index``,
the TBE's own row key. Sizing:
:func:`torchrec_ftrl.tbe.placement.cache_slots` (FBGEMM's). CUDA only: FBGEMM has no CPU cache ops.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from ..fbgemm_enums import CacheAlgorithm
from .placement import CACHE_ASSOC, DEFAULT_LAYOUT, cache_slots, check_cache_dims, check_cache_options
from ..row_layout import RowLayout


def _triton_kernels():
    """``(launch.direct, the triton_cache module)``, imported at the first cached step: the cache
    runs on CUDA only, and ``import torchrec_ftrl`` needs no triton."""
    from ..kernels.cuda import cache as triton_cache
    from ..kernels.cuda.launch import direct
    return direct, triton_cache


# FBGEMM's cache statistics, in the order its ops fill them.
UVM_CACHE_STATS = ("num_calls", "num_requested_indices", "num_unique_indices", "num_unique_misses",
                   "num_conflict_unique_misses", "num_conflict_misses")


class RowCache(nn.Module):
    """The cache of one TBE's tables (all ``MANAGED_CACHING``).

    Args:
        rows: rows of each table. dims: D of each table (multiples of 4, FBGEMM's vector width).
        feature_table: table of each feature (FBGEMM's ``feature_table_map``).
        table_w_offset: int64 ``[T]`` element offset of each table in the flat buffers.
        weights_dtype: dtype of the weights and of their cache (FBGEMM's ``cache_precision``).
        load_factor: cache rows / table rows, in ``(0, 1]`` (used when ``cache_sets`` is 0).
        cache_sets: sets of :data:`~torchrec_ftrl.tbe.placement.CACHE_ASSOC` rows, or 0.
        algorithm: FBGEMM ``CacheAlgorithm.LRU`` or ``LFU``.
        lock_lines: keep the rows of a prefetched batch in the cache until its update
            (``prefetch_pipeline``; LRU only, FBGEMM's ``lock_cache_line``).
        reserved_memory: bytes of HBM to leave free; a cache that would not fit in the free HBM
            is shrunk to fit, as FBGEMM does.
        gather_stats: count :data:`UVM_CACHE_STATS` (FBGEMM's ``gather_uvm_cache_stats``).
        device: the CUDA device.
        layout: the tables' :class:`~torchrec_ftrl.row_layout.RowLayout` (derived weights: no weight
            cache; row-wise ``accum``: one value per slot; the state caches in the states' dtypes).

    Raises:
        ValueError: a dim not a multiple of 4, a bad ``load_factor`` / ``cache_sets`` /
            ``algorithm``, or ``lock_lines`` with LFU.
    """

    def __init__(self, rows: Sequence[int], dims: Sequence[int], feature_table: Sequence[int],
                 table_w_offset: torch.Tensor, weights_dtype: torch.dtype, load_factor: float,
                 cache_sets: int, algorithm: CacheAlgorithm, lock_lines: bool,
                 reserved_memory: float, gather_stats: bool, device: torch.device,
                 layout: RowLayout = DEFAULT_LAYOUT) -> None:
        super().__init__()
        state_dtypes = layout.state_dtypes
        check_cache_dims(dims)
        algorithm = check_cache_options(load_factor, cache_sets,
                                        algorithm, lock_lines)
        total = int(sum(rows))
        max_d = int(max(dims))
        slots = cache_slots(total, load_factor, cache_sets)
        slot_bytes = layout.bytes_per_row(max_d, torch.empty(0, dtype=weights_dtype).element_size())
        if device.type == "cuda" and cache_sets == 0:   # FBGEMM shrinks only a computed size
            free = (torch.cuda.get_device_properties(device).total_memory
                    - torch.cuda.memory_reserved(device) - int(reserved_memory))
            if free <= 0:
                raise ValueError(f"cache_reserved_memory={reserved_memory!r} leaves no free HBM for "
                                 f"the cache on {device}")
            if slots * slot_bytes > free:
                slots = max(1, free // slot_bytes // CACHE_ASSOC) * CACHE_ASSOC
        sets = slots // CACHE_ASSOC
        self.algorithm = algorithm
        self.lock_lines = bool(lock_lines)
        self.gather_stats = bool(gather_stats)
        self.total_rows = total
        self.max_D = max_d
        self.stored_weights = layout.stores_weights
        self.rowwise = layout.rowwise
        self.timestep = 1
        # True while the cache may hold rows updated since its last flush (set by the TBE after a
        # cached update): reads of the unified-memory copies flush first.
        self.written = False
        # Bumped by every change of which row a slot holds (populate, invalidate, reset): slots
        # looked up at one generation are still the rows' slots while it lasts.
        self.generation = 0
        row_base = [0]
        for r in rows:
            row_base.append(row_base[-1] + int(r))
        i64 = dict(dtype=torch.int64, device=device)
        buf = lambda name, t: self.register_buffer(name, t, persistent=False)  # noqa: E731
        # Per feature, for linearize_cache_indices; per table, for the populate / flush ops.
        buf("cache_hash_size_cumsum", torch.tensor([row_base[t] for t in feature_table] + [total], **i64))
        buf("table_hash_size_cumsum", torch.tensor(row_base, **i64))
        buf("cache_index_table_map", torch.repeat_interleave(
            torch.arange(len(rows), dtype=torch.int32, device=device),
            torch.tensor([int(r) for r in rows], device=device), output_size=total))
        buf("weights_offsets", table_w_offset.clone())
        # The rows' widths as FBGEMM's ops see them: 0 without a weight cache (nothing to copy).
        fbgemm_dims = dims if self.stored_weights else [0] * len(dims)
        buf("D_offsets", torch.tensor([0] + [int(sum(fbgemm_dims[:t + 1])) for t in range(len(dims))],
                                      dtype=torch.int32, device=device))
        buf("table_dim", torch.tensor([int(d) for d in dims], **i64))
        buf("lxu_cache_state", torch.full((sets, CACHE_ASSOC), -1, **i64))
        # Derived weights: an fp32 cache of zero-width rows, and a one-element fp32 stand-in for the
        # weights FBGEMM's ops take (fp32 / fp16 rows only; with zero-width rows nothing is read or
        # written).
        weights_cols, weights_dtype = (max_d, weights_dtype) if self.stored_weights else (0, torch.float32)
        buf("lxu_cache_weights", torch.zeros(slots, weights_cols, dtype=weights_dtype, device=device))
        buf("no_weights", torch.zeros(0 if self.stored_weights else 1, device=device))
        # The state caches, beside the weight cache (same row stride), each in its state's dtype.
        buf("lxu_cache_accum", torch.zeros(slots, layout.state_columns("accum", max_d),
                                           dtype=state_dtypes["accum"], device=device))
        buf("lxu_cache_linear", torch.zeros(slots, max_d, dtype=state_dtypes["linear"], device=device))
        buf("lxu_state", torch.zeros((total + 1,) if algorithm == CacheAlgorithm.LFU
                                     else (sets, CACHE_ASSOC), **i64))
        # The slots' rows before the last populate, and the populate that last claimed each slot.
        buf("lxu_cache_snapshot", torch.full((slots,), -1, **i64))
        buf("lxu_cache_claim", torch.zeros(slots, **i64))
        self._stamp = 0
        buf("lxu_cache_locking_counter", torch.zeros((sets, CACHE_ASSOC) if lock_lines else (0, 0),
                                                     dtype=torch.int32, device=device))
        buf("uvm_cache_stats", torch.zeros(len(UVM_CACHE_STATS), **i64))
        buf("local_uvm_cache_stats", torch.zeros(len(UVM_CACHE_STATS), dtype=torch.int32, device=device))

    @property
    def lxu_cache_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lxu_cache_accum, lxu_cache_linear)``: the state caches as the kernels take them
        (``TBEBatch.cache_states``)."""
        return self.lxu_cache_accum, self.lxu_cache_linear

    @property
    def slots(self) -> int:
        return self.lxu_cache_weights.shape[0]

    @property
    def row_stride(self) -> int:
        """Elements between consecutive slots of the ``[slots, D]`` caches (``lxu_cache_linear``,
        and ``lxu_cache_weights`` where the weights are stored)."""
        return self.lxu_cache_linear.stride(0)

    def _fbgemm_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """What FBGEMM's ops take as the tables' weights: ``weights``, or the zero-width stand-in of a
        derived-weights table."""
        return weights if self.stored_weights else self.no_weights

    def linearize(self, indices: torch.Tensor, offsets: torch.Tensor,
                  bags_per_feature: Optional[Sequence[int]] = None) -> torch.Tensor:
        """int64 ``[N]`` linear cache index (row key) of every index. ``bags_per_feature``: the bags
        of each feature for a variable-batch (VBE) batch, None for ``F * B`` bags."""
        if bags_per_feature is None:
            return torch.ops.fbgemm.linearize_cache_indices(self.cache_hash_size_cumsum, indices, offsets)
        b_offsets = [0]
        for b in bags_per_feature:
            b_offsets.append(b_offsets[-1] + int(b))
        b_offsets_t = torch.tensor(b_offsets, dtype=torch.int32).to(indices.device, non_blocking=True)
        return torch.ops.fbgemm.linearize_cache_indices(self.cache_hash_size_cumsum, indices, offsets,
                                                        b_offsets_t, max(bags_per_feature, default=0))

    def populate(self, linear: torch.Tensor, weights: torch.Tensor, accum: torch.Tensor,
                 linear_state: torch.Tensor) -> torch.Tensor:
        """Insert the rows of ``linear`` (int64 ``[N]``) into the cache, evicting (and writing back)
        others; the states follow. ``weights`` / ``accum`` / ``linear_state``: the flat buffers.
        Returns the int32 ``[N]`` cache slot of each index after the populate (-1: not cached):
        the one ``lxu_cache_lookup`` of the populate (the state moves compare the slots' rows
        before and after, so no lookup before it is needed)."""
        self.lxu_cache_snapshot.copy_(self.lxu_cache_state.view(-1))
        if self.algorithm == CacheAlgorithm.LRU:
            torch.ops.fbgemm.lru_cache_populate(
                self._fbgemm_weights(weights), self.table_hash_size_cumsum, self.total_rows, self.cache_index_table_map,
                self.weights_offsets, self.D_offsets, linear, self.lxu_cache_state,
                self.lxu_cache_weights, self.timestep, self.lxu_state, False, self.gather_stats,
                self.local_uvm_cache_stats, self.lock_lines,
                self.lxu_cache_locking_counter if self.lock_lines else None)
        else:
            torch.ops.fbgemm.lfu_cache_populate(
                self._fbgemm_weights(weights), self.table_hash_size_cumsum, self.total_rows, self.cache_index_table_map,
                self.weights_offsets, self.D_offsets, linear, self.lxu_cache_state,
                self.lxu_cache_weights, self.lxu_state, False)
        self.timestep += 1
        self.generation += 1
        after = self.lookup(linear)
        self._stamp += 1
        n = linear.numel()
        if n:
            direct, tc = _triton_kernels()
            block_d = 1 << max(0, self.max_D - 1).bit_length()
            direct(tc.state_cache_fill_kernel)[(n,)](
                linear, after, self.lxu_cache_snapshot, self.lxu_cache_claim, self._stamp,
                accum, linear_state, self.lxu_cache_accum, self.lxu_cache_linear,
                self.cache_index_table_map, self.weights_offsets, self.table_dim,
                self.table_hash_size_cumsum, n, self.row_stride, BLOCK_D=block_d,
                ROWWISE=self.rowwise, num_warps=tc.fill_warps(block_d))
        return after

    def lookup(self, linear: torch.Tensor, count: bool = True) -> torch.Tensor:
        """int32 ``[N]`` cache slot of each row of ``linear``, -1 where it is not cached; counted in
        the statistics with ``count``."""
        count = count and self.gather_stats
        loc = torch.ops.fbgemm.lxu_cache_lookup(linear, self.lxu_cache_state, self.total_rows,
                                                count, self.local_uvm_cache_stats)
        if count:
            self.uvm_cache_stats += self.local_uvm_cache_stats
            self.local_uvm_cache_stats.zero_()
        return loc

    def unlock(self, locations: torch.Tensor) -> None:
        """Release the lines a prefetch locked for the batch whose slots are ``locations``."""
        if self.lock_lines:
            torch.ops.fbgemm.lxu_cache_locking_counter_decrement(self.lxu_cache_locking_counter,
                                                                 locations)

    def flush(self, weights: torch.Tensor, accum: torch.Tensor, linear_state: torch.Tensor) -> None:
        """Write every cached row (weight and states) back to the flat buffers; the cache keeps them."""
        self.written = False
        if self.stored_weights:
            torch.ops.fbgemm.lxu_cache_flush(
                weights, self.table_hash_size_cumsum, self.cache_index_table_map, self.weights_offsets,
                self.D_offsets, int(self.D_offsets[-1]), self.lxu_cache_state, self.lxu_cache_weights,
                False)
        self._follow(self.lxu_cache_state, torch.full_like(self.lxu_cache_state, -1), accum,
                     linear_state)

    def reset(self) -> None:
        """Empty the cache without writing anything back (FBGEMM's ``reset_cache_states``) and
        release every locked line (call it between steps)."""
        self.lxu_cache_state.fill_(-1)
        self.lxu_state.zero_()
        self.lxu_cache_locking_counter.zero_()
        self.timestep = 1
        self.written = False
        self.generation += 1

    def invalidate(self, linear: torch.Tensor) -> None:
        """Drop the cached copies (weight and both states) of the rows ``linear`` (int64 ``[N]`` row
        keys, duplicates allowed) without writing them back: their slots become empty, so the next
        read of such a row, and its next populate, take the unified-memory copy. Locked lines stay
        counted (their batch's release still balances them). Rows not cached are ignored."""
        slots = self.lookup(linear, count=False).long()
        self.lxu_cache_state.view(-1).index_fill_(0, slots[slots >= 0], -1)
        self.generation += 1

    def reset_states(self, initial_accumulator_value: float) -> None:
        """accum := ``initial_accumulator_value``, linear := 0 for the cached rows too."""
        self.lxu_cache_accum.fill_(initial_accumulator_value)
        self.lxu_cache_linear.zero_()

    def _follow(self, before: torch.Tensor, after: torch.Tensor, accum: torch.Tensor,
                linear_state: torch.Tensor) -> None:
        direct, tc = _triton_kernels()
        block_d = 1 << max(0, self.max_D - 1).bit_length()
        per, warps = tc.follow_config(block_d)
        slots = before.numel()
        direct(tc.state_cache_follow_kernel)[(-(-slots // per),)](
            before, after, accum, linear_state, self.lxu_cache_accum, self.lxu_cache_linear,
            self.cache_index_table_map, self.weights_offsets, self.table_dim,
            self.table_hash_size_cumsum, slots, self.row_stride, SLOTS=per, BLOCK_D=block_d,
            ROWWISE=self.rowwise, num_warps=warps)
