"""Triton kernels of the UVM-caching placement's state cache (:mod:`torchrec_ftrl.tbe.cache`).

FBGEMM's cache ops move a cached row's weight between unified memory and ``lxu_cache_weights`` (a
derived-weights table has none: FBGEMM keeps its slots' bookkeeping only); the FTRL states of the
row must move with it. Rows are FBGEMM linear cache indices (``row_base[table] + index``; -1 marks an
empty slot), which are also the row keys of a row-wise ``accum`` (``[total_rows]``, one value per
row; its cache ``[slots, 1]``: ``ROWWISE``).

* :func:`state_cache_fill_kernel` runs after a populate: for every index that has a slot after the
  populate that held another row before it (a miss), the slot's owner (the first index to claim it
  in this populate) writes the evicted row's ``accum`` / ``linear`` back to the flat unified-memory
  buffers and loads the inserted row's. Its work follows the batch's misses, not the cache size.
* :func:`state_cache_follow_kernel` compares every slot's row in two snapshots and moves the states of
  each slot that changed: the flush (every slot against "empty").

The states move as stored: the state caches have the dtypes of the flat ``accum`` / ``linear``
buffers (fp32 or bf16; the kernels specialise on the pointers' dtype), so a row's bits are copied
unchanged and a bf16 state moves half the bytes of an fp32 one.

A populate evicts only rows outside the batch and inserts only rows of it, so a row never leaves one
slot and enters another in the same populate, and slots never race on a row.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_offset(row_table_ptr, table_w_offset_ptr, table_dim_ptr, row_base_ptr, row):
    """``(element offset, dim)`` of linear row ``row`` (a scalar) in the flat buffers."""
    t = tl.load(row_table_ptr + row)
    dim = tl.load(table_dim_ptr + t)
    return tl.load(table_w_offset_ptr + t) + (row - tl.load(row_base_ptr + t)) * dim, dim


@triton.jit
def _move_states(row_table_ptr, table_w_offset_ptr, table_dim_ptr, row_base_ptr, accum_ptr,
                 linear_ptr, cn_ptr, cz_ptr, slot, old, new, cache_stride, BLOCK_D: tl.constexpr,
                 ROWWISE: tl.constexpr):
    """Slot ``slot``: the states of row ``old`` (if >= 0) back to the flat buffers, then row
    ``new``'s (if >= 0) into the slot. One row at a time, 1-D over D (a 2-D ``[slots, D]`` form
    does not compile with Triton 3.6). ``ROWWISE``: ``accum`` is one value per row at the row key,
    cached at ``cn[slot]``."""
    cols = tl.arange(0, BLOCK_D)
    crow = slot * cache_stride + cols
    if old >= 0:
        _copy_row(row_table_ptr, table_w_offset_ptr, table_dim_ptr, row_base_ptr, accum_ptr,
                  linear_ptr, cn_ptr, cz_ptr, slot, crow, old, cols, False, ROWWISE)
    if new >= 0:
        _copy_row(row_table_ptr, table_w_offset_ptr, table_dim_ptr, row_base_ptr, accum_ptr,
                  linear_ptr, cn_ptr, cz_ptr, slot, crow, new, cols, True, ROWWISE)


@triton.jit
def _copy_row(row_table_ptr, table_w_offset_ptr, table_dim_ptr, row_base_ptr, accum_ptr, linear_ptr,
              cn_ptr, cz_ptr, slot, crow, row, cols, TO_CACHE: tl.constexpr, ROWWISE: tl.constexpr):
    """Copy linear row ``row``'s ``accum`` and ``linear`` between the flat buffers and cache slot
    ``slot`` (elements ``crow`` of the state caches): into the slot with ``TO_CACHE``, else out of
    it."""
    off, dim = _row_offset(row_table_ptr, table_w_offset_ptr, table_dim_ptr, row_base_ptr, row)
    cm = cols < dim
    if ROWWISE:
        n_flat, n_cache, n_mask = accum_ptr + row, cn_ptr + slot, None
    else:
        n_flat, n_cache, n_mask = accum_ptr + off + cols, cn_ptr + crow, cm
    z_flat, z_cache = linear_ptr + off + cols, cz_ptr + crow
    if TO_CACHE:
        tl.store(n_cache, tl.load(n_flat, mask=n_mask), mask=n_mask)
        tl.store(z_cache, tl.load(z_flat, mask=cm), mask=cm)
    else:
        tl.store(n_flat, tl.load(n_cache, mask=n_mask), mask=n_mask)
        tl.store(z_flat, tl.load(z_cache, mask=cm), mask=cm)


@triton.jit(do_not_specialize=["stamp", "num_indices"])
def state_cache_fill_kernel(
    key_ptr, after_ptr, snapshot_ptr, claim_ptr, stamp, accum_ptr, linear_ptr, cn_ptr, cz_ptr,
    row_table_ptr, table_w_offset_ptr, table_dim_ptr, row_base_ptr, num_indices, cache_stride,
    BLOCK_D: tl.constexpr, ROWWISE: tl.constexpr,
):
    """Index ``i`` (one per program): if its row ``key[i]`` has slot ``s = after[i] >= 0`` after
    the populate and the slot held another row before it (``snapshot[s] != key[i]``: the row
    missed), and this program is the first to write ``stamp`` (int64, new per populate) into
    ``claim[s]``, move the states of the slot's evicted row ``snapshot[s]`` out and of ``key[i]``
    in. A populate never moves a cached row of the batch, so a row that hit keeps its slot and
    finds itself in the snapshot."""
    i = tl.program_id(0).to(tl.int64)
    if i < num_indices:
        slot = tl.load(after_ptr + i).to(tl.int64)
        if slot >= 0:
            key = tl.load(key_ptr + i)
            old = tl.load(snapshot_ptr + slot)
            if old != key:
                if tl.atomic_xchg(claim_ptr + slot, stamp) != stamp:
                    _move_states(row_table_ptr, table_w_offset_ptr, table_dim_ptr, row_base_ptr,
                                 accum_ptr, linear_ptr, cn_ptr, cz_ptr, slot, old, key,
                                 cache_stride, BLOCK_D, ROWWISE)


@triton.jit
def state_cache_follow_kernel(
    old_ptr, new_ptr, accum_ptr, linear_ptr, cn_ptr, cz_ptr, row_table_ptr, table_w_offset_ptr,
    table_dim_ptr, row_base_ptr, slots, cache_stride,
    SLOTS: tl.constexpr, BLOCK_D: tl.constexpr, ROWWISE: tl.constexpr,
):
    """For slots ``s`` in this program's ``SLOTS``: if ``old[s] != new[s]``, store the cached states
    ``cn[s]``, ``cz[s]`` (row stride ``cache_stride``; ``cn[s]`` one value with ``ROWWISE``) to row
    ``old[s]`` of ``accum`` / ``linear`` when ``old[s] >= 0``, then load row ``new[s]``'s states into the slot when ``new[s] >= 0``.
    ``row_table`` (int32 ``[rows]``): table of each linear row; ``table_*`` / ``row_base``: the
    :mod:`torchrec_ftrl.kernels.batch` arrays."""
    first = tl.program_id(0).to(tl.int64) * SLOTS
    for k in range(SLOTS):
        s = first + k
        if s < slots:
            old = tl.load(old_ptr + s)
            new = tl.load(new_ptr + s)
            if old != new:
                _move_states(row_table_ptr, table_w_offset_ptr, table_dim_ptr, row_base_ptr,
                             accum_ptr, linear_ptr, cn_ptr, cz_ptr, s, old, new, cache_stride,
                             BLOCK_D, ROWWISE)


def follow_config(block_d: int) -> tuple[int, int]:
    """``(SLOTS, num_warps)`` of :func:`state_cache_follow_kernel`: slots per program, warps for rows
    of ``block_d`` elements."""
    return 16, max(1, min(4, block_d // 256))


def fill_warps(block_d: int) -> int:
    """Warps of :func:`state_cache_fill_kernel` for rows of ``block_d`` elements."""
    return max(1, min(4, block_d // 256))
