"""Triton kernels of the FTRL TBE backward: sum gradients per unique row, one FTRL update per row.

Pipeline (all on the device, fixed-size buffers of ``N = indices.numel()`` entries, no host sync):

1. :func:`linearize_kernel` (one program per block of bags) writes, for every index position, its
   linearised row id ``row_base[table] + index`` (the sort key), the element offset of its bag's
   gradient vector, its gradient factor (per-sample weight, 1/L for MEAN) and its table.
2. ``torch.sort(keys, stable=True)`` groups equal rows (stable, so the order inside a run, hence the
   summation order, is fixed).
3. :func:`window_update_kernel`: the sorted positions are cut into windows of ``CHUNK``. A program
   gathers its window's ``CHUNK`` gradient rows at once, sums each run of equal keys with a
   segmented scan, and applies the FTRL update to every run that starts and ends inside the window.
   The piece of a run that crosses a window edge is written to a scratch slot instead: slot ``2m``
   for the window's first run (it starts at the window start), slot ``2m + 1`` for its last run. Only
   one run per window can continue into the next window, so the slots never collide. A hot row thus
   costs ``len / CHUNK`` parallel window programs, not one long serial loop.
4. :func:`boundary_update_kernel`: one program per window edge ``b = m * CHUNK``. The program whose
   edge is the first one its run crosses adds the run's pieces in window order and applies the update.

Every sum has a fixed order (sorted position order, fixed scan/reduction trees), so the result is
bitwise reproducible run to run without atomics on values. The only atomic is the count of rows
skipped because their summed gradient has a NaN/Inf (``nonfinite_rows``), an integer.

The FTRL lines follow ``shared/docs/FTRL.md`` exactly: accum uses the raw gradient; ``sqrt`` (IEEE
round-to-nearest) when ``p == -0.5`` else ``pow``; ``z`` uses the OLD weight; the exact zero comes from
a branch; states are fp32 and the weight is stored in its own dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

_FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def linearize_kernel(
    indices_ptr, offsets_ptr, bag_feature_ptr, bag_out_ptr, feature_table_ptr, row_base_ptr,
    psw_ptr, key_ptr, gofs_ptr, scale_ptr, tid_ptr,
    num_bags, out_row_stride,
    POOL: tl.constexpr, HAS_PSW: tl.constexpr, HAS_SCALE: tl.constexpr,
    BAGS: tl.constexpr, UNROLL: tl.constexpr,
):
    pid = tl.program_id(0)
    bags = pid.to(tl.int64) * BAGS + tl.arange(0, BAGS)
    bmask = bags < num_bags
    start = tl.load(offsets_ptr + bags, mask=bmask, other=0)
    end = tl.load(offsets_ptr + bags + 1, mask=bmask, other=0)
    length = end - start
    feat = tl.load(bag_feature_ptr + bags, mask=bmask, other=0)
    tab = tl.load(feature_table_ptr + feat, mask=bmask, other=0)
    rbase = tl.load(row_base_ptr + tab, mask=bmask, other=0)
    oofs = tl.load(bag_out_ptr + bags, mask=bmask, other=0)
    inv_len = tl.div_rn(1.0, tl.maximum(length, 1).to(tl.float32))
    u = tl.arange(0, UNROLL)
    max_len = tl.max(length, axis=0)
    for j in range(0, max_len, UNROLL):
        jj = j + u
        lmask = jj[None, :] < length[:, None]
        pos = start[:, None] + jj[None, :]
        idx = tl.load(indices_ptr + pos, mask=lmask, other=0)
        tl.store(key_ptr + pos, (rbase[:, None] + idx).to(key_ptr.dtype.element_ty), mask=lmask)
        if POOL == 2:
            g = pos * out_row_stride
        else:
            g = oofs[:, None] + jj[None, :] * 0
        tl.store(gofs_ptr + pos, g, mask=lmask)
        tl.store(tid_ptr + pos, (tab[:, None] + jj[None, :] * 0).to(tl.int32), mask=lmask)
        if HAS_SCALE:
            if HAS_PSW:
                s = tl.load(psw_ptr + pos, mask=lmask, other=0.0)
                if POOL == 1:
                    s = s * inv_len[:, None]
            else:
                s = inv_len[:, None] + tl.zeros([BAGS, UNROLL], dtype=tl.float32)
            tl.store(scale_ptr + pos, s, mask=lmask)


@triton.jit
def _seg_add(av, af, bv, bf):
    # Segmented sum: a set flag on the right operand restarts the sum there.
    return tl.where(bf != 0, bv, av + bv), af | bf


@triton.jit
def _pow(x, e, LIBDEVICE_POW: tl.constexpr):
    # x >= 0, e = -p >= 0. libdevice pow when compiled; exp2/log2 under the interpreter (no libdevice).
    if LIBDEVICE_POW:
        return libdevice.pow(x, e)
    else:
        safe = tl.where(x > 0, x, 1.0)
        r = tl.exp2(e * tl.log2(safe))
        return tl.where(x > 0, r, tl.where(e > 0, 0.0, 1.0))


@triton.jit
def load_states(w_ptr, z_ptr, n_ptr, roff, m, cols):
    """Load ``(w fp32, z, n, offsets, mask)`` of the rows ``roff`` (element offsets ``[R]``), elements ``m``."""
    offs = roff[:, None] + cols[None, :]
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=m, other=0.0)
    n = tl.load(n_ptr + offs, mask=m, other=0.0)
    return w, z, n, offs, m


@triton.jit
def ftrl_update_store(w_ptr, z_ptr, n_ptr, nonfinite_ptr, w, z, n, offs, m, rmask, g,
                      lr, l1, l2_eff, beta, shrink2, neg_p,
                      POW_HALF: tl.constexpr, HAS_SHRINK: tl.constexpr, LIBDEVICE_POW: tl.constexpr):
    """One FTRL step (shared/docs/FTRL.md) of rows ``rmask`` ``[R]`` with summed gradients ``g``
    ``[R, BLOCK_D]`` and their loaded states; rows whose gradient has a NaN/Inf are not stored and
    are counted in ``nonfinite_ptr``."""
    bad_el = (tl.abs(g) <= _FLT_MAX) == 0
    row_bad = tl.max((bad_el & m).to(tl.int32), axis=1) > 0
    nbad = tl.sum((rmask & row_bad).to(tl.int64), axis=0)
    tl.atomic_add(nonfinite_ptr, nbad, mask=nbad > 0)
    sm = m & (row_bad == 0)[:, None]
    n_new = n + g * g
    if POW_HALF:
        pn_new = tl.sqrt_rn(n_new)
        pn_old = tl.sqrt_rn(n)
    else:
        pn_new = _pow(n_new, neg_p, LIBDEVICE_POW)
        pn_old = _pow(n, neg_p, LIBDEVICE_POW)
    sigma = tl.div_rn(pn_new - pn_old, lr)
    if HAS_SHRINK:
        gs = g + shrink2 * w
    else:
        gs = g
    z_new = (z + gs) - sigma * w
    q = tl.div_rn(beta + pn_new, lr) + l2_eff
    keep = tl.abs(z_new) > l1
    sgn = tl.where(z_new > 0, 1.0, -1.0)
    w_new = tl.where(keep, tl.div_rn(l1 * sgn - z_new, q), 0.0)
    tl.store(w_ptr + offs, w_new.to(w_ptr.dtype.element_ty), mask=sm)
    tl.store(z_ptr + offs, z_new, mask=sm)
    tl.store(n_ptr + offs, n_new, mask=sm)


@triton.jit
def window_update_kernel(
    sk_ptr, perm_ptr, gofs_ptr, scale_ptr, tid_ptr, grad_ptr,
    w_ptr, z_ptr, n_ptr, table_w_offset_ptr, table_dim_ptr, row_base_ptr, part_ptr, nonfinite_ptr,
    N, lr, l1, l2_eff, beta, shrink2, neg_p,
    HAS_SCALE: tl.constexpr, POW_HALF: tl.constexpr, HAS_SHRINK: tl.constexpr,
    LIBDEVICE_POW: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
    VEC: tl.constexpr, EVEN_D: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, CHUNK)
    p0 = m * CHUNK
    p = p0 + r
    valid = p < N
    k = tl.load(sk_ptr + p, mask=valid, other=-1)
    kprev = tl.load(sk_ptr + p - 1, mask=valid & (p > 0), other=-1)
    knext = tl.load(sk_ptr + p + 1, mask=(p + 1) < N, other=-1)
    run_start = (p == 0) | (k != kprev)
    run_end = (p == N - 1) | (k != knext)
    seg_start = (r == 0) | run_start
    seg_end = valid & ((r == CHUNK - 1) | run_end)

    orig = tl.load(perm_ptr + p, mask=valid, other=0)
    gofs = tl.multiple_of(tl.load(gofs_ptr + orig, mask=valid, other=0), VEC)
    cols = tl.arange(0, BLOCK_D)
    if EVEN_D:
        # Every table has D == BLOCK_D: row r of the flat layout starts at r * BLOCK_D.
        m2 = tl.broadcast_to(valid[:, None], [CHUNK, BLOCK_D])
    else:
        tid = tl.load(tid_ptr + orig, mask=valid, other=0)
        dim = tl.multiple_of(tl.load(table_dim_ptr + tid, mask=valid, other=VEC), VEC)
        m2 = valid[:, None] & ((cols // VEC)[None, :] < (dim // VEC)[:, None])
    g = tl.load(grad_ptr + gofs[:, None] + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    if HAS_SCALE:
        sc = tl.load(scale_ptr + orig, mask=valid, other=0.0)
        g = g * sc[:, None]
    k0 = tl.load(sk_ptr + p0)
    k0prev = tl.load(sk_ptr + p0 - 1, mask=p0 > 0, other=-1)
    first_starts_run = (p0 == 0) | (k0prev != k0)
    not_first = k != k0
    complete = seg_end & run_end & (not_first | first_starts_run)
    partial = seg_end & (complete == 0)
    # State loads depend only on the keys: issue them before the scan.
    if EVEN_D:
        roff = k.to(tl.int64) * BLOCK_D
    else:
        rbase = tl.load(row_base_ptr + tid, mask=complete, other=0)
        woff = tl.multiple_of(tl.load(table_w_offset_ptr + tid, mask=complete, other=0), VEC)
        roff = woff + (k - rbase) * dim
    w, z, n, offs, sm = load_states(w_ptr, z_ptr, n_ptr, roff, complete[:, None] & m2, cols)

    flags = tl.broadcast_to(seg_start.to(tl.int32)[:, None], [CHUNK, BLOCK_D])
    gsum, _ = tl.associative_scan((g, flags), 0, _seg_add)

    slot = 2 * m + not_first.to(tl.int64)
    tl.store(part_ptr + slot[:, None] * BLOCK_D + cols[None, :], gsum, mask=partial[:, None] & m2)
    ftrl_update_store(w_ptr, z_ptr, n_ptr, nonfinite_ptr, w, z, n, offs, sm, complete, gsum,
                      lr, l1, l2_eff, beta, shrink2, neg_p, POW_HALF, HAS_SHRINK, LIBDEVICE_POW)


@triton.jit
def boundary_update_kernel(
    sk_ptr, perm_ptr, tid_ptr, part_ptr,
    w_ptr, z_ptr, n_ptr, table_w_offset_ptr, table_dim_ptr, row_base_ptr, nonfinite_ptr,
    N, lr, l1, l2_eff, beta, shrink2, neg_p,
    POW_HALF: tl.constexpr, HAS_SHRINK: tl.constexpr, LIBDEVICE_POW: tl.constexpr,
    CHUNK: tl.constexpr, NB: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    mb = tl.program_id(0).to(tl.int64) + 1          # window edge b = mb * CHUNK, 0 < b < N
    b = mb * CHUNK
    kb = tl.load(sk_ptr + b)
    crosses = tl.load(sk_ptr + b - 1) == kb
    crossed_before = (mb > 1) & (tl.load(sk_ptr + b - CHUNK - 1, mask=mb > 1, other=-1) == kb)
    if crosses & (crossed_before == 0):
        cols = tl.arange(0, BLOCK_D)
        if EVEN_D:
            cmask = cols < BLOCK_D
            roff = kb.to(tl.int64) * BLOCK_D
        else:
            orig = tl.load(perm_ptr + b)
            tid = tl.load(tid_ptr + orig)
            dim = tl.multiple_of(tl.load(table_dim_ptr + tid), VEC)
            cmask = (cols // VEC) < (dim // VEC)
            rbase = tl.load(row_base_ptr + tid)
            woff = tl.multiple_of(tl.load(table_w_offset_ptr + tid), VEC)
            roff = woff + (kb - rbase) * dim
        whole_prev = tl.load(sk_ptr + b - CHUNK) == kb
        first_slot = 2 * (mb - 1) + (whole_prev == 0).to(tl.int64)
        acc = tl.load(part_ptr + first_slot * BLOCK_D + cols, mask=cmask, other=0.0)
        jj = tl.arange(0, NB)
        j0 = mb
        go = kb == kb
        while go:
            js = j0 + jj
            inb = js * CHUNK < N
            kj = tl.load(sk_ptr + js * CHUNK, mask=inb, other=-1)
            sel = inb & (kj == kb)
            tile = tl.load(part_ptr + (2 * js)[:, None] * BLOCK_D + cols[None, :],
                           mask=sel[:, None] & cmask[None, :], other=0.0)
            acc += tl.sum(tile, axis=0)
            go = tl.sum(sel.to(tl.int32), axis=0) == NB
            j0 += NB
        one = tl.arange(0, 1)
        rmask = one == 0
        w, z, n, offs, sm = load_states(w_ptr, z_ptr, n_ptr, roff + one * 0,
                                        rmask[:, None] & cmask[None, :], cols)
        ftrl_update_store(w_ptr, z_ptr, n_ptr, nonfinite_ptr, w, z, n, offs, sm, rmask, acc[None, :],
                          lr, l1, l2_eff, beta, shrink2, neg_p, POW_HALF, HAS_SHRINK, LIBDEVICE_POW)


def window_config(block_d: int, tile: int = 4096, chunk: int | None = None) -> tuple[int, int]:
    """``(CHUNK, num_warps)`` of the window kernel for a ``BLOCK_D``."""
    if chunk is None:
        chunk = max(8, min(128, tile // block_d))
    elems = chunk * block_d
    num_warps = max(1, min(16, elems // 256))
    num_warps = 1 << (num_warps.bit_length() - 1)
    return chunk, num_warps
