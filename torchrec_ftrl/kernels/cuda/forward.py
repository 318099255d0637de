"""Triton kernel of the FTRL TBE forward: multi-table pooled lookup (SUM / MEAN / NONE).

One program owns ``BAGS`` consecutive bags and walks their indices ``UNROLL`` at a time, so
``BAGS * UNROLL`` independent row loads (each ``BLOCK_D`` wide, masked to the table's D) are in flight
per step. Rows are read in the weights' dtype and accumulated in fp32; the pooled vector is written
once, in the output dtype, at ``bag_out_offset[bag]`` (which covers the plain and the VBE layouts).
``PoolingMode.NONE`` writes each looked-up row at ``position * out_row_stride`` instead.
With ``KEYS`` the index array holds the linearised row keys of :func:`.backward.linearize_kernel`
(``row_base[table] + index``, already bounds-checked) instead of raw indices: the training forward,
which linearises once for the forward and the backward.
With ``CHECK`` (the fused ``BoundsCheckMode.WARNING``) an index outside ``[0, rows of its table)`` is
read as row 0 and counted (one integer atomic add per program) into ``warn_ptr``. ``WEVICT`` is the
L2 eviction policy of the row loads ("" or "evict_last", which helps small D on an H200).
With ``CACHED`` (the UVM-caching placement) each index position also has a cache slot (``loc``, -1
for none): a row held by the HBM cache is read from ``cache + slot * cache_stride``, any other from
the table in unified memory.
With ``DERIVED`` (the row layout without a weight buffer, :mod:`torchrec_ftrl.row_layout`) each
looked-up element's weight is ``prox(z, n)`` of its ``linear`` (``z_ptr``) and ``accum`` (``n_ptr``),
computed in fp32 registers by :func:`.rule_gen.ftrl_prox`, the function the update stores a
weight with (so a derived table reads the bits a stored table holds for the same fp32 state);
``w_ptr`` is then unused. With ``ROWWISE`` too, ``accum`` holds one ``n`` per row, at the row key
``row_base[table] + index``, loaded once per looked-up row, and the row's ``lr / q`` is computed once
(:func:`.rule_gen.ftrl_row_rate`, :func:`.rule_gen.ftrl_prox_rowwise`, as the update
does).
With ``CACHED`` and ``DERIVED``, ``w_ptr`` / ``cache_ptr`` are the ``linear`` buffer and its cache
and ``cache_n_ptr`` the ``accum`` cache (row stride ``cache_stride``; one value per slot with
``ROWWISE``): a row held by the cache reads ``z`` and ``n`` there.

Layout contract: :mod:`torchrec_ftrl.kernels.batch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..codegen import ensure_triton_module
from ..batch import POOL_MEAN, POOL_NONE

ensure_triton_module()     # the generated module below (codegen.py: a build product)
from .rule_gen import (ftrl_knobs, ftrl_power, ftrl_prox, ftrl_prox_rowwise,  # noqa: E402
                              ftrl_row_rate)

# The pooling modes as the kernels compare them (layout.POOL_*; Triton reads only constexpr globals).
MEAN = tl.constexpr(POOL_MEAN)
NONE = tl.constexpr(POOL_NONE)
# Elements per vector of a row load: 4 is 16 bytes of an fp32 row and 8 bytes of a 2-byte one (bf16
# state, fp16 weights), so the rows of a step share the fp32 gradient and output rows' register
# layout. At Triton's default (16-byte vectors, 8 elements of a 2-byte row) a 2-byte row takes a
# layout of its own, which the kernel converts through shared memory at every step.
ROW_VEC = tl.constexpr(4)


@triton.jit
def row_columns(BLOCK_D: tl.constexpr):
    """int32 ``[BLOCK_D]``: the columns ``0 .. BLOCK_D - 1`` of a row, hinted ``ROW_VEC`` contiguous."""
    return tl.max_contiguous(tl.arange(0, BLOCK_D), ROW_VEC)


@triton.jit
def bag_table(bag_feature_ptr, feature_table_ptr, bags, bmask):
    """The table of each bag ``bags`` (mask ``bmask``): ``feature_table[bag_feature[bag]]``."""
    feat = tl.load(bag_feature_ptr + bags, mask=bmask, other=0)
    return tl.load(feature_table_ptr + feat, mask=bmask, other=0)


@triton.jit
def load_bags(offsets_ptr, bag_feature_ptr, feature_table_ptr, num_bags, BAGS: tl.constexpr):
    """This program's ``BAGS`` consecutive bags: ids, mask, first index position, length, table."""
    bags = tl.program_id(0).to(tl.int64) * BAGS + tl.arange(0, BAGS)
    bmask = bags < num_bags
    start = tl.load(offsets_ptr + bags, mask=bmask, other=0)
    end = tl.load(offsets_ptr + bags + 1, mask=bmask, other=0)
    return bags, bmask, start, end - start, bag_table(bag_feature_ptr, feature_table_ptr, bags, bmask)


@triton.jit
def row_offsets(idx, woff, rbase, dim, KEYS: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Flat offset of each looked-up row ``[BAGS, UNROLL]`` in the tables' buffer: ``idx`` a raw
    index of its bag's table (offset ``woff``, ``dim`` wide), or with ``KEYS`` a linearised row key
    (``rbase`` + index); ``EVEN_D``: every table has D == BLOCK_D."""
    if KEYS:
        if EVEN_D:
            roff = idx.to(tl.int64) * BLOCK_D
        else:
            roff = woff[:, None] + (idx.to(tl.int64) - rbase[:, None]) * dim[:, None]
    elif EVEN_D:
        roff = woff[:, None] + idx * BLOCK_D
    else:
        roff = woff[:, None] + idx * dim[:, None]
    return roff


@triton.jit
def store_pooled(out_ptr, bag_out_ptr, acc, bags, bmask, length, cols, cmask2, POOL: tl.constexpr,
                 VEC: tl.constexpr):
    """Write each bag's fp32 sum ``acc`` ``[BAGS, BLOCK_D]`` at ``bag_out_offset[bag]`` in the output
    dtype; MEAN divides by the bag's length (IEEE), an empty bag gives zeros."""
    if POOL == MEAN:
        lf = tl.maximum(length, 1).to(tl.float32)
        acc = tl.where(length[:, None] > 0, tl.div_rn(acc, lf[:, None]), 0.0)
    oofs = tl.multiple_of(tl.load(bag_out_ptr + bags, mask=bmask, other=0), VEC)
    tl.store(out_ptr + oofs[:, None] + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=cmask2)


@triton.jit
def derived_rows(z_ptr, n_ptr, rowp, roff, idx, rbase, loc, cache_n_ptr, cache_stride, cols, m3, lmask,
                 knobs, WEVICT: tl.constexpr, KEYS: tl.constexpr,
                 CACHED: tl.constexpr, ROWWISE: tl.constexpr, POW_HALF: tl.constexpr,
                 LIBDEVICE_POW: tl.constexpr):
    """fp32 ``[BAGS, UNROLL, BLOCK_D]`` derived weights ``prox(z, n)`` of the looked-up rows (mask
    ``m3``; ``lmask`` per row): ``z`` from ``linear`` at the row offsets ``roff`` (cached: from
    ``rowp``, the row in the cache or in unified memory); ``n`` per element beside it, or with
    ``ROWWISE`` one per row at its key (``idx`` with ``KEYS``, else ``rbase + idx``), from the
    ``accum`` cache at slot ``loc`` where cached."""
    offs = roff[:, :, None] + cols[None, None, :]
    if CACHED:  # rowp: the z row, in the cache or in unified memory
        z = tl.load(rowp[:, :, None] + cols[None, None, :], mask=m3, other=0.0,
                    eviction_policy=WEVICT).to(tl.float32)
    else:
        z = tl.load(z_ptr + offs, mask=m3, other=0.0, eviction_policy=WEVICT).to(tl.float32)
    if ROWWISE:  # one n per row, at its row key
        if KEYS:
            nkey = idx.to(tl.int64)
        else:
            nkey = rbase[:, None] + idx
        if CACHED:
            nptr = tl.where(loc >= 0, cache_n_ptr + loc.to(tl.int64), n_ptr + nkey)
        else:
            nptr = n_ptr + nkey
        n = tl.load(nptr, mask=lmask, other=0.0).to(tl.float32)
        rate = ftrl_row_rate(ftrl_power(n, knobs, POW_HALF, LIBDEVICE_POW), knobs)
        rows = ftrl_prox_rowwise(z, rate[:, :, None], knobs)
    else:
        if CACHED:
            nrow = tl.where(loc >= 0, cache_n_ptr + loc.to(tl.int64) * cache_stride, n_ptr + roff)
            nptr = nrow[:, :, None] + cols[None, None, :]
        else:
            nptr = n_ptr + offs
        n = tl.load(nptr, mask=m3, other=0.0, eviction_policy=WEVICT).to(tl.float32)
        rows = ftrl_prox(z, ftrl_power(n, knobs, POW_HALF, LIBDEVICE_POW), knobs)
    return rows


@triton.jit
def tbe_forward_kernel(
    w_ptr, out_ptr, indices_ptr, offsets_ptr, bag_feature_ptr, bag_out_ptr, feature_table_ptr,
    table_w_offset_ptr, table_dim_ptr, table_rows_ptr, row_base_ptr, psw_ptr, warn_ptr,
    loc_ptr, cache_ptr, cache_n_ptr, z_ptr, n_ptr, knobs_ptr, num_bags, out_row_stride, cache_stride,
    POOL: tl.constexpr, HAS_PSW: tl.constexpr, CHECK: tl.constexpr, KEYS: tl.constexpr,
    BAGS: tl.constexpr, UNROLL: tl.constexpr, BLOCK_D: tl.constexpr,
    VEC: tl.constexpr, EVEN_D: tl.constexpr, WEVICT: tl.constexpr, CACHED: tl.constexpr,
    DERIVED: tl.constexpr, ROWWISE: tl.constexpr, POW_HALF: tl.constexpr, LIBDEVICE_POW: tl.constexpr,
):
    bags, bmask, start, length, tab = load_bags(offsets_ptr, bag_feature_ptr, feature_table_ptr,
                                                num_bags, BAGS)
    # VEC divides every table's D (host-checked): lets loads/stores use 16-byte vectors.
    woff = tl.multiple_of(tl.load(table_w_offset_ptr + tab, mask=bmask, other=0), VEC)
    dim = tl.multiple_of(tl.load(table_dim_ptr + tab, mask=bmask, other=VEC), VEC)
    if CHECK:
        trows = tl.load(table_rows_ptr + tab, mask=bmask, other=0)
    if (KEYS and not EVEN_D) or (DERIVED and ROWWISE and not KEYS):
        rbase = tl.load(row_base_ptr + tab, mask=bmask, other=0)
    else:
        rbase = woff   # unused placeholder
    if DERIVED:
        knobs = ftrl_knobs(knobs_ptr)
    nbad = tl.zeros([BAGS, UNROLL], dtype=tl.int32)

    cols = row_columns(BLOCK_D)
    u = tl.arange(0, UNROLL)
    if EVEN_D:  # no column mask: keeps the mask constant along D so loads vectorise
        cmask2 = tl.broadcast_to(bmask[:, None], [BAGS, BLOCK_D])
    else:
        cmask2 = bmask[:, None] & ((cols // VEC)[None, :] < (dim // VEC)[:, None])
    cmask3 = cmask2[:, None, :]
    max_len = tl.max(length, axis=0)
    acc = tl.zeros([BAGS, BLOCK_D], dtype=tl.float32)
    # Indices of step j + UNROLL are loaded while the rows of step j are in flight.
    lmask_n = u[None, :] < length[:, None]
    idx_n = tl.load(indices_ptr + start[:, None] + u[None, :], mask=lmask_n, other=0)
    for j in range(0, max_len, UNROLL):
        jj = j + u
        lmask = lmask_n
        idx = idx_n
        pos = start[:, None] + jj[None, :]                                     # [BAGS, UNROLL]
        lmask_n = (jj + UNROLL)[None, :] < length[:, None]
        idx_n = tl.load(indices_ptr + pos + UNROLL, mask=lmask_n, other=0)
        if CHECK:  # fused WARNING bounds check: an index outside [0, rows) reads row 0, counted
            bad = lmask & ((idx < 0) | (idx >= trows[:, None]))
            idx = tl.where(bad, 0, idx)
            nbad += bad.to(tl.int32)
        roff = row_offsets(idx, woff, rbase, dim, KEYS, EVEN_D, BLOCK_D)
        m3 = lmask[:, :, None] & cmask3
        if CACHED:
            loc = tl.load(loc_ptr + pos, mask=lmask, other=-1)
            rowp = tl.where(loc >= 0, cache_ptr + loc.to(tl.int64) * cache_stride, w_ptr + roff)
        else:
            loc = idx   # unused placeholder
            rowp = w_ptr + roff
        if DERIVED:
            rows = derived_rows(z_ptr, n_ptr, rowp, roff, idx, rbase, loc, cache_n_ptr, cache_stride,
                                cols, m3, lmask, knobs, WEVICT, KEYS, CACHED, ROWWISE, POW_HALF,
                                LIBDEVICE_POW)
        else:
            rows = tl.load(rowp[:, :, None] + cols[None, None, :], mask=m3, other=0.0,
                           eviction_policy=WEVICT)
            rows = rows.to(tl.float32)
        if HAS_PSW:
            psw = tl.load(psw_ptr + pos, mask=lmask, other=0.0)
            rows = rows * psw[:, :, None]
        if POOL == NONE:
            tl.store(out_ptr + pos[:, :, None] * out_row_stride + cols[None, None, :],
                     rows.to(out_ptr.dtype.element_ty), mask=m3)
        else:
            acc += tl.sum(rows, axis=1)
    if CHECK:
        total_bad = tl.sum(tl.sum(nbad, axis=1).to(tl.int64), axis=0)
        tl.atomic_add(warn_ptr, total_bad, mask=total_bad > 0)
    if POOL != NONE:
        store_pooled(out_ptr, bag_out_ptr, acc, bags, bmask, length, cols, cmask2, POOL, VEC)


def forward_config(block_d: int, tile: int = 2048, unroll: int = 4) -> tuple[int, int, int]:
    """``(BAGS, UNROLL, num_warps)`` for a ``BLOCK_D``: about ``tile`` elements per step."""
    unroll = max(1, min(unroll, max(1, tile // block_d)))
    bags = max(1, tile // (unroll * block_d))
    elems = bags * unroll * block_d
    num_warps = max(1, min(16, elems // 512))
    num_warps = 1 << (num_warps.bit_length() - 1)
    return bags, unroll, num_warps
