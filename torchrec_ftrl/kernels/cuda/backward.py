"""Triton kernels of the FTRL TBE backward: sum gradients per unique row, one FTRL update per row.

Pipeline (all on the device, buffers sized from ``N = indices.numel()``, no host sync). The integer
arguments that change from batch to batch (``N``, tile counts) are not specialised
(``do_not_specialize``): Triton would otherwise compile a variant for each of their divisibility
classes, seconds of compile inside a training run whenever a new class first appears.

1. :func:`linearize_kernel` (one program per block of bags) writes, for every index position, its
   linearised row id ``row_base[table] + index`` (the sort key), the element offset of its bag's
   gradient vector, its gradient factor (per-sample weight, 1/L for MEAN) and its table. With the
   fused WARNING bounds check an index outside ``[0, rows)`` is read as row 0 (and counted, when it
   runs in the training forward: ``tbe_linearize`` (``calls.forward_train``) linearises once, the lookup reads
   the checked row keys and the backward reuses them). There it also repairs the raw offsets first
   (clamp + running max over all bags, one pass with decoupled look-back across programs) and writes
   them out for the lookup.
2. A stable sort of the keys (``backend._sort_positions``: FBGEMM's radix sort over the row
   bits, or ``torch.sort``) gives the positions in row order; stable, so the order inside a run,
   hence the summation order, is fixed.
3. :func:`segment_mark_kernel` gathers the keys into sorted order and cuts the sorted positions into
   *segments*: a segment starts at every run start (``key[i] != key[i-1]``) and, inside runs longer
   than ``SEG``, at every position ``i`` that is a multiple of ``SEG`` with ``key[i - SEG] == key[i]``.
   So short runs are one segment, and a long run is cut into pieces of at most ``2 * SEG - 1``
   entries (its first piece) and ``SEG`` (the others). The kernel also gathers each sorted entry's
   gradient offset, factor and table into sorted order, so later loads need no ``perm`` round trip,
   and compacts the segment starts into a dense array in the same pass (a single-pass prefix sum of
   the start flags with decoupled look-back, Merrill & Garland, "Single-pass Parallel Prefix Scan
   with Decoupled Look-back", NVIDIA 2016); their number stays on the device.
4. :func:`segment_update_kernel`: a program takes ``G`` consecutive segments and sums each one's
   gradient rows in sorted order (``R`` rows per segment in flight). The gradient offsets of the
   first ``R`` entries load with the segment's keys, so the first gradient rows are in flight
   together with the row's weight and states. A segment that is a whole run gets its FTRL update
   right there; a piece of a long run writes its partial sum to a scratch slot: ``2 * (s // SEG)``
   when it starts at a multiple ``s`` of ``SEG``, ``2 * (s // SEG) + 1`` for a run's first piece
   starting elsewhere (at most one run's first piece starts in one ``SEG`` window, so slots never
   collide).
5. :func:`segment_combine_kernel`: for every run cut into pieces, the program that owns the run's
   first cut adds the pieces in position order and applies the update.

Every sum has a fixed order (sorted positions, fixed reduction trees), so results are bitwise
reproducible run to run without atomics on values. The only atomics are on integers: rows skipped
because their summed gradient has a NaN/Inf (``nonfinite_rows``), bounds-check warnings, and the
tile tickets and published counts / maxima of the single-pass scans in the mark kernel and the
offsets repair (exact whatever the order).

The FTRL arithmetic and the stochastic-rounding hash are the generated functions of
:mod:`.rule_gen` (``rule_spec.py``'s ``FAST`` form: rearranged for speed, not bitwise equal to
the CPU kernel; both agree with the float64 reference within the tests' tolerances): the math is
fp32 and the weight is stored in its own dtype. A state is fp32 or bf16 (constexprs ``N_BF16`` /
``Z_BF16``; with both False the kernels are the fp32 ones): a bf16 state loads exactly into fp32 and
is stored with stochastic rounding, :func:`store_state` (keyed by the row key, the column, the step
read from the TBE's ``iter`` buffer on the device, and the state), so a CUDA-graph replay rounds
with its own step. The new weight is :func:`.rule_gen.ftrl_prox`, the function the forward
uses for derived weights.

Row layouts (:mod:`torchrec_ftrl.row_layout`), compile-time flags of the update kernels (with both
False the kernels are the stored / element-wise ones): ``DERIVED`` (no weight buffer: the old
weight is ``prox(z, n)`` of the loaded state, and only ``n`` and ``z`` are stored) and ``ROWWISE``
(``accum`` holds one ``n`` per row at the row key ``row_base[table] + row``, the sort key itself;
``n`` grows by the mean of ``g^2`` over the row, :func:`torchrec_ftrl.rule.ftrl_rule_rowwise`; a
row is one tile, so the mean is one ``tl.sum`` over its columns, taken where the row's full
gradient sum is: in the update kernel for a whole run, in the combine kernel for a run cut into
pieces). The cached placement (``CACHED``) takes every layout: a cached row's states (and stored
weight) are read and written in the HBM caches, a row-wise ``n`` at one value per slot.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .forward import MEAN, NONE, bag_table, load_bags, row_columns   # generates the next one
from .rule_gen import (ftrl_knobs, ftrl_update, round_bf16_sr, sr_bits, sr_row, sr_seed,
                              sr_top_bits)

_FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def publish_and_look_back(status_ptr, t, own, LOOKBACK: tl.constexpr, MAX: tl.constexpr):
    """One tile's step of a single-pass scan with decoupled look-back (Merrill & Garland, "Single-pass
    Parallel Prefix Scan with Decoupled Look-back", NVIDIA 2016).

    Tile ``t`` (tiles numbered in the order their programs started, so a tile only waits for tiles
    that are running) with its own value ``own`` (int64 scalar, >= 0): publishes ``own``, adds the
    values of tiles ``t-1, t-2, ...`` (``LOOKBACK`` at a time, waiting where one has not published
    yet) down to the first that published its inclusive value, publishes its own inclusive value and
    returns the exclusive one: the sum of tiles ``0..t-1``, or their max with ``MAX`` (0 for tile 0).
    ``status[t]`` (int64, zeroed before the launch): 0 not ready, ``v << 2 | 1`` own value ``v``,
    ``v << 2 | 2`` inclusive value ``v``.
    """
    prefix = own * 0
    if t == 0:
        tl.atomic_xchg(status_ptr, (own << 2) | 2)
    else:
        tl.atomic_xchg(status_ptr + t, (own << 2) | 1)
        lane = tl.arange(0, LOOKBACK)
        j = t - 1
        go = t > 0
        while go:
            w = j - lane                                          # tiles j, j-1, ...
            st = tl.atomic_add(status_ptr + w, 0, mask=w >= 0, sem="relaxed")
            st = tl.where(w >= 0, st, 2)                          # before tile 0: inclusive 0
            stop_wait = tl.min(tl.where(st == 0, lane, LOOKBACK), axis=0)
            stop_pre = tl.min(tl.where((st & 3) == 2, lane, LOOKBACK), axis=0)
            found = stop_pre < stop_wait
            upto = tl.where(found, stop_pre + 1, stop_wait)       # lanes taken in this pass
            vals = tl.where(lane < upto, st >> 2, 0)
            if MAX:
                prefix = tl.maximum(prefix, tl.max(vals, axis=0))
            else:
                prefix += tl.sum(vals, axis=0)
            j -= upto
            go = found == 0
        if MAX:
            incl = tl.maximum(prefix, own)
        else:
            incl = prefix + own
        tl.atomic_xchg(status_ptr + t, (incl << 2) | 2)
    return prefix


@triton.jit(do_not_specialize=["num_indices"])
def repair_offsets_tile(offsets_ptr, fixed_ptr, ws_ptr, num_bags, num_indices, BAGS: tl.constexpr,
                        LOOKBACK: tl.constexpr):
    """One tile of the ``BoundsCheckMode.WARNING`` offsets repair, in one pass over all tiles:
    ``fixed = cummax(clamp(offsets, 0, N))`` with ``fixed[0] = 0`` and ``fixed[num_bags] = N``
    (``N = num_indices``), FBGEMM's repair; the running max crosses tiles by decoupled look-back
    (:func:`publish_and_look_back`).

    The tile (``BAGS`` bags) comes from the ticket ``ws[0]``; ``ws[1:]`` (int64, zeroed with the
    ticket) hold the tiles' statuses. Writes ``fixed[bag]`` for its bags (and ``fixed[num_bags]``
    in the tile of the last bag; ``fixed[0]`` alone when ``num_bags == 0``). Returns
    ``(bags, bmask, start, end, nfix)``: the tile's bag ids ``[BAGS]``, which exist, their repaired
    start and end offsets, and the number of entries of ``offsets`` it changed (int64).
    """
    t = tl.atomic_add(ws_ptr, 1).to(tl.int64)                # tiles in start order
    bags = t * BAGS + tl.arange(0, BAGS)
    bmask = bags < num_bags
    raw = tl.load(offsets_ptr + bags, mask=bmask | (bags == 0), other=0)
    v = tl.where(bmask, tl.minimum(tl.maximum(raw, 0), num_indices), 0)
    prefix = publish_and_look_back(ws_ptr + 1, t, tl.max(v, axis=0).to(tl.int64), LOOKBACK, True)
    run = tl.maximum(tl.associative_scan(v, 0, _max_combine), prefix)   # cummax to each bag
    start = tl.where(bags == 0, 0, run)
    is_last = bags == num_bags - 1
    raw_next = tl.load(offsets_ptr + bags + 1, mask=bmask, other=0)
    nxt = tl.minimum(tl.maximum(raw_next, 0), num_indices)
    end = tl.where(is_last, num_indices, tl.maximum(run, nxt))
    only = (bags == 0) & (num_bags == 0)                          # offsets == [x]: fixed [0]
    tl.store(fixed_ptr + bags, start, mask=bmask | only)
    tl.store(fixed_ptr + bags + 1, end, mask=bmask & is_last)
    changed = ((bmask | only) & (start != raw)).to(tl.int64) + \
        (is_last & (raw_next != num_indices)).to(tl.int64)
    return bags, bmask, start, end, tl.sum(changed, axis=0)


@triton.jit(do_not_specialize=["num_indices"])
def linearize_kernel(
    indices_ptr, offsets_ptr, bag_feature_ptr, bag_out_ptr, feature_table_ptr, row_base_ptr,
    table_rows_ptr, psw_ptr, key_ptr, gofs_ptr, scale_ptr, tid_ptr, warn_ptr, fixed_ptr, ws_ptr,
    num_bags, num_indices, out_row_stride,
    POOL: tl.constexpr, HAS_PSW: tl.constexpr, HAS_SCALE: tl.constexpr, CHECK: tl.constexpr,
    COUNT: tl.constexpr, HAS_TID: tl.constexpr, BAGS: tl.constexpr, UNROLL: tl.constexpr,
    REPAIR: tl.constexpr, LOOKBACK: tl.constexpr,
):
    if REPAIR:
        # WARNING repair of the offsets fused in (the same tile step as offsets_repair_kernel):
        # the repaired offsets go to fixed_ptr for the lookup, changes counted with bad indices.
        bags, bmask, start, end, nfix = repair_offsets_tile(offsets_ptr, fixed_ptr, ws_ptr,
                                                            num_bags, num_indices, BAGS, LOOKBACK)
        length = end - start
        tab = bag_table(bag_feature_ptr, feature_table_ptr, bags, bmask)
    else:
        bags, bmask, start, length, tab = load_bags(offsets_ptr, bag_feature_ptr, feature_table_ptr,
                                                    num_bags, BAGS)
        nfix = 0                                                  # offsets already repaired
    rbase = tl.load(row_base_ptr + tab, mask=bmask, other=0)
    if CHECK:
        trows = tl.load(table_rows_ptr + tab, mask=bmask, other=0)
    oofs = tl.load(bag_out_ptr + bags, mask=bmask, other=0)
    inv_len = tl.div_rn(1.0, tl.maximum(length, 1).to(tl.float32))
    u = tl.arange(0, UNROLL)
    max_len = tl.max(length, axis=0)
    nbad = tl.zeros([BAGS, UNROLL], dtype=tl.int32)
    for j in range(0, max_len, UNROLL):
        jj = j + u
        lmask = jj[None, :] < length[:, None]
        pos = start[:, None] + jj[None, :]
        idx = tl.load(indices_ptr + pos, mask=lmask, other=0)
        if CHECK:
            bad = lmask & ((idx < 0) | (idx >= trows[:, None]))
            idx = tl.where(bad, 0, idx)
            if COUNT:
                nbad += bad.to(tl.int32)
        tl.store(key_ptr + pos, (rbase[:, None] + idx).to(key_ptr.dtype.element_ty), mask=lmask)
        if POOL == NONE:
            g = pos * out_row_stride
        else:
            g = oofs[:, None] + jj[None, :] * 0
        tl.store(gofs_ptr + pos, g.to(gofs_ptr.dtype.element_ty), mask=lmask)
        if HAS_TID:
            tl.store(tid_ptr + pos, (tab[:, None] + jj[None, :] * 0).to(tl.int32), mask=lmask)
        if HAS_SCALE:
            if HAS_PSW:
                s = tl.load(psw_ptr + pos, mask=lmask, other=0.0)
                if POOL == MEAN:
                    s = s * inv_len[:, None]
            else:
                s = inv_len[:, None] + tl.zeros([BAGS, UNROLL], dtype=tl.float32)
            tl.store(scale_ptr + pos, s, mask=lmask)
    if CHECK and COUNT:
        total_bad = tl.sum(tl.sum(nbad, axis=1).to(tl.int64), axis=0) + nfix
        tl.atomic_add(warn_ptr, total_bad, mask=total_bad > 0)


@triton.jit(do_not_specialize=["N", "num_tiles"])
def segment_mark_kernel(key_ptr, perm_ptr, gofs_ptr, scale_ptr, tid_ptr, loc_ptr, sk_ptr, sgofs_ptr,
                        sscale_ptr, stid_ptr, sloc_ptr, seg_ptr, ws_ptr, N, num_tiles,
                        SEG: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_TID: tl.constexpr,
                        CACHED: tl.constexpr, BLOCK: tl.constexpr, LOOKBACK: tl.constexpr):
    """Gather the entries into sorted order, flag segment starts and compact them into ``seg`` in
    one pass (a single-pass scan with decoupled look-back).

    ``perm`` ``[N]`` (int32 or int64): the positions that sort ``key`` stably. Writes the sorted keys
    ``sk[p] = key[perm[p]]`` and each sorted entry's gradient offset, factor, table and (``CACHED``)
    cache slot. ``ws`` (int64
    ``[num_tiles + 2]``, zeroed): ``ws[0]`` hands out tiles in the order programs start, so a tile
    only ever waits for tiles that are already running; ``ws[1 + t]`` is tile ``t``'s status, 0 (not
    ready), ``count << 2 | 1`` (its own starts) or ``prefix << 2 | 2`` (starts up to and including
    it); ``ws[num_tiles + 1]`` receives the number of segments.
    """
    t = tl.atomic_add(ws_ptr, 1).to(tl.int64)          # tile, in start order
    lane = tl.arange(0, BLOCK)
    p = t * BLOCK + lane
    valid = p < N
    orig = tl.load(perm_ptr + p, mask=valid, other=0)
    k = tl.load(key_ptr + orig, mask=valid, other=0)
    tl.store(sk_ptr + p, k, mask=valid)
    # Key of entry p - 1: the neighbour lane's, the preceding tile's last entry for lane 0.
    edge = valid & (lane == 0) & (p > 0)
    k_edge = tl.load(key_ptr + tl.load(perm_ptr + p - 1, mask=edge, other=0), mask=edge, other=0)
    kp = tl.where(lane == 0, k_edge, tl.gather(k, tl.maximum(lane - 1, 0), 0))
    # Key of entry p - SEG, needed at the multiples of SEG only (a few per tile): from memory.
    cand = valid & ((p % SEG) == 0) & (p >= SEG)
    ks = tl.load(key_ptr + tl.load(perm_ptr + p - SEG, mask=cand, other=0), mask=cand, other=0)
    flag = valid & ((p == 0) | (k != kp) | (cand & (k == ks)))
    tl.store(sgofs_ptr + p, tl.load(gofs_ptr + orig, mask=valid, other=0), mask=valid)
    if HAS_SCALE:
        tl.store(sscale_ptr + p, tl.load(scale_ptr + orig, mask=valid, other=0.0), mask=valid)
    if HAS_TID:
        tl.store(stid_ptr + p, tl.load(tid_ptr + orig, mask=valid, other=0), mask=valid)
    if CACHED:
        tl.store(sloc_ptr + p, tl.load(loc_ptr + orig, mask=valid, other=-1), mask=valid)
    f = flag.to(tl.int64)
    prefix = publish_and_look_back(ws_ptr + 1, t, tl.sum(f, axis=0), LOOKBACK, False)
    cum = prefix + tl.cumsum(f, axis=0)                      # inclusive, global
    tl.store(seg_ptr + cum - 1, p.to(seg_ptr.dtype.element_ty), mask=flag)
    last = valid & (p == N - 1)
    tl.store(seg_ptr + cum, (p + 1).to(seg_ptr.dtype.element_ty), mask=last)   # sentinel = N
    tl.store(ws_ptr + num_tiles + 1 + p * 0, cum, mask=last)                    # segment count


@triton.jit
def row_pointers(w_ptr, n_ptr, z_ptr, roff, key, cw_ptr, cn_ptr, cz_ptr, loc, cache_stride, cols,
                 CACHED: tl.constexpr, ROWWISE: tl.constexpr):
    """Pointer blocks ``[R, BLOCK_D]`` to the weight, accum and linear of the rows at element offsets
    ``roff`` ``[R]`` of the three flat buffers; with ``ROWWISE`` the accum pointers are ``[R]``, at
    the row keys ``key`` (one value per row). With ``CACHED``, a row whose cache slot ``loc`` ``[R]``
    is >= 0 is addressed in the HBM caches instead (weight, accum, linear caches ``cw``, ``cn``,
    ``cz``, row ``slot`` at ``slot * cache_stride``; a ``ROWWISE`` accum at ``cn[slot]``)."""
    offs = roff[:, None] + cols[None, :]
    if CACHED and ROWWISE:
        hit = loc >= 0
        coffs = (loc.to(tl.int64) * cache_stride)[:, None] + cols[None, :]
        return (tl.where(hit[:, None], cw_ptr + coffs, w_ptr + offs),
                tl.where(hit, cn_ptr + loc.to(tl.int64), n_ptr + key.to(tl.int64)),
                tl.where(hit[:, None], cz_ptr + coffs, z_ptr + offs))
    elif CACHED:
        hit = (loc >= 0)[:, None]
        coffs = (loc.to(tl.int64) * cache_stride)[:, None] + cols[None, :]
        return (tl.where(hit, cw_ptr + coffs, w_ptr + offs), tl.where(hit, cn_ptr + coffs, n_ptr + offs),
                tl.where(hit, cz_ptr + coffs, z_ptr + offs))
    elif ROWWISE:
        return w_ptr + offs, n_ptr + key.to(tl.int64), z_ptr + offs
    else:
        return w_ptr + offs, n_ptr + offs, z_ptr + offs


@triton.jit
def load_states(wp, np_, zp, m, rmask, DERIVED: tl.constexpr, ROWWISE: tl.constexpr):
    """Load ``(w, n (accum), z (linear))`` in fp32 at the pointer blocks of :func:`row_pointers`,
    elements ``m`` (rows ``rmask`` for a ``ROWWISE`` accum, ``[R]``; bf16 states upcast exactly; fp32
    ones as stored). With ``DERIVED`` there is no weight to load: ``w`` is zeros (a placeholder;
    :func:`ftrl_update_store` derives the weight)."""
    if DERIVED:
        w = tl.zeros(zp.shape, dtype=tl.float32)
    else:
        w = tl.load(wp, mask=m, other=0.0).to(tl.float32)
    z = tl.load(zp, mask=m, other=0.0).to(tl.float32)
    if ROWWISE:
        n = tl.load(np_, mask=rmask, other=0.0).to(tl.float32)
    else:
        n = tl.load(np_, mask=m, other=0.0).to(tl.float32)
    return w, n, z


@triton.jit
def sr_row_hash(key, step_ptr, STATE: tl.constexpr):
    """uint32 ``[R]``: the row hash of the stochastic rounding (:func:`.rule_gen.sr_row`) of
    row keys ``key`` (int32/int64 ``[R]``) at the step ``step_ptr[0]`` (int64, the TBE's ``iter``)."""
    return sr_row(sr_seed(tl.load(step_ptr), STATE), key)


@triton.jit
def store_state(ptr, x, m, key, cols, step_ptr, STATE: tl.constexpr, BF16: tl.constexpr):
    """Store fp32 ``x`` ``[R, BLOCK_D]`` (elements ``m``) at ``ptr``: as is for an fp32 state; for a
    bf16 one stochastically rounded by ``sr_bits(key[r], cols[c], step_ptr[0], STATE)``."""
    if BF16:
        bits = sr_bits(sr_row_hash(key, step_ptr, STATE)[:, None], cols[None, :])
        tl.store(ptr, round_bf16_sr(x, bits), mask=m, cache_modifier=".cs")
    else:
        tl.store(ptr, x, mask=m, cache_modifier=".cs")


@triton.jit
def store_row_state(ptr, x, rm, key, step_ptr, STATE: tl.constexpr, BF16: tl.constexpr):
    """Store fp32 ``x`` ``[R]`` (one value per row, rows ``rm``) at the pointers ``ptr`` ``[R]``: as
    is for an fp32 state; for a bf16 one stochastically rounded by ``sr_bits(key[r], 0, step_ptr[0],
    STATE)`` (column 0)."""
    if BF16:
        bits = sr_top_bits(sr_row_hash(key, step_ptr, STATE))
        tl.store(ptr, round_bf16_sr(x, bits), mask=rm, cache_modifier=".cs")
    else:
        tl.store(ptr, x, mask=rm, cache_modifier=".cs")


@triton.jit
def ftrl_update_store(wp, np_, zp, nonfinite_ptr, w, n, z, m, rmask, g, dimf,
                      knobs_ptr, key, cols, step_ptr, POW_HALF: tl.constexpr,
                      HAS_SHRINK: tl.constexpr, LIBDEVICE_POW: tl.constexpr, N_BF16: tl.constexpr, Z_BF16: tl.constexpr, DERIVED: tl.constexpr,
                      ROWWISE: tl.constexpr):
    """One FTRL step (:func:`.rule_gen.ftrl_update`) of rows ``rmask`` ``[R]`` with summed
    gradients ``g`` ``[R, BLOCK_D]`` and their loaded states (fp32, :func:`load_states`), stored;
    rows whose fp32 ``sum_d g_d^2`` is not finite (a NaN/Inf gradient, or a finite one whose square
    overflows) are not stored and are counted in ``nonfinite_ptr``.
    ``N_BF16`` / ``Z_BF16``: accum / linear stored in bf16 (:func:`store_state`, row keys ``key``
    ``[R]``, columns ``cols``, step at ``step_ptr``). ``DERIVED``: no weight buffer; only ``n`` and
    ``z`` are stored. ``ROWWISE``: ``n`` is ``[R]``, one per row (``dimf``: fp32, ``[R]`` or scalar,
    the table's D), stored once per row (:func:`store_row_state`, column 0)."""
    # The overflow rule: a row whose fp32 sum of g^2 is not finite (a NaN/Inf gradient, or finite
    # ones whose squares overflow) is skipped.
    g2 = tl.sum(tl.where(m, g * g, 0.0), axis=1)
    row_bad = (g2 <= _FLT_MAX) == 0
    nbad = tl.sum((rmask & row_bad).to(tl.int64), axis=0)
    tl.atomic_add(nonfinite_ptr, nbad, mask=nbad > 0)
    sm = m & (row_bad == 0)[:, None]
    w_new, n_new, z_new = ftrl_update(w, n, z, g, m, dimf, ftrl_knobs(knobs_ptr), POW_HALF, HAS_SHRINK,
                                      DERIVED, ROWWISE, LIBDEVICE_POW)
    # Streaming stores (.cs): the rows are not read again in this step; keeps L2 for the gradients.
    if not DERIVED:
        tl.store(wp, w_new.to(wp.dtype.element_ty), mask=sm, cache_modifier=".cs")
    store_state(zp, z_new, sm, key, cols, step_ptr, 1, Z_BF16)
    if ROWWISE:
        store_row_state(np_, n_new, rmask & (row_bad == 0), key, step_ptr, 0, N_BF16)
    else:
        store_state(np_, n_new, sm, key, cols, step_ptr, 0, N_BF16)


@triton.jit
def load_entries(sgofs_ptr, sscale_ptr, pos, lm, HAS_SCALE: tl.constexpr):
    """Gradient offsets and factors of the sorted entries ``pos`` (mask ``lm``); the factors are the
    offsets themselves (unused) without ``HAS_SCALE``."""
    go = tl.load(sgofs_ptr + pos, mask=lm, other=0)
    if HAS_SCALE:
        sc = tl.load(sscale_ptr + pos, mask=lm, other=0.0)
    else:
        sc = go
    return go, sc


@triton.jit
def sum_gradient_rows(grad_ptr, go, sc, lm, m3c, cols, HAS_SCALE: tl.constexpr, VEC: tl.constexpr):
    """fp32 ``[G, BLOCK_D]``: per segment, the sum over its entries ``lm`` ``[G, R]`` of the gradient
    rows at element offsets ``go`` (times their factors ``sc`` with ``HAS_SCALE``), columns ``m3c``."""
    go = (go // VEC) * VEC          # VEC divides every offset: tells the compiler, no-op
    g = tl.load(grad_ptr + go[:, :, None] + cols[None, None, :],
                mask=lm[:, :, None] & m3c, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g * sc[:, :, None]
    return tl.sum(g, axis=1)


@triton.jit(do_not_specialize=["N"])
def segment_update_kernel(
    seg_ptr, count_ptr, sk_ptr, sgofs_ptr, sscale_ptr, stid_ptr, sloc_ptr, grad_ptr,
    w_ptr, n_ptr, z_ptr, cw_ptr, cn_ptr, cz_ptr, table_w_offset_ptr, table_dim_ptr, row_base_ptr,
    part_ptr, nonfinite_ptr, step_ptr, knobs_ptr, N, cache_stride,
    SEG: tl.constexpr, HAS_SCALE: tl.constexpr, POW_HALF: tl.constexpr, HAS_SHRINK: tl.constexpr,
    LIBDEVICE_POW: tl.constexpr, G: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr,
    VEC: tl.constexpr, EVEN_D: tl.constexpr, CACHED: tl.constexpr, N_BF16: tl.constexpr,
    Z_BF16: tl.constexpr, DERIVED: tl.constexpr, ROWWISE: tl.constexpr,
):
    j0 = tl.program_id(0).to(tl.int64) * G
    count = tl.load(count_ptr).to(tl.int64)          # number of segments (device-side)
    if j0 < count:
        j = j0 + tl.arange(0, G)
        valid = j < count
        s = tl.load(seg_ptr + j, mask=valid, other=0).to(tl.int64)
        e = tl.load(seg_ptr + j + 1, mask=valid, other=0).to(tl.int64)
        key = tl.load(sk_ptr + s, mask=valid, other=0)
        kprev = tl.load(sk_ptr + s - 1, mask=valid & (s > 0), other=0)
        knext = tl.load(sk_ptr + e, mask=valid & (e < N), other=0)
        head = (s == 0) | (kprev != key)
        tail = (e >= N) | (knext != key)
        complete = valid & head & tail
        partial = valid & (complete == 0)
        length = tl.where(valid, e - s, 0)
        # The first R entries' gradient offsets / factors depend only on the bounds: loaded with
        # the keys, so their gradient rows go out together with the row states.
        u = tl.arange(0, R)
        lm0 = u[None, :] < length[:, None]                                   # [G, R]
        go0, sc0 = load_entries(sgofs_ptr, sscale_ptr, s[:, None] + u[None, :], lm0, HAS_SCALE)
        cols = row_columns(BLOCK_D)
        if EVEN_D:
            # Every table has D == BLOCK_D: row r of the flat layout starts at r * BLOCK_D.
            m2 = tl.broadcast_to(valid[:, None], [G, BLOCK_D])
            roff = key.to(tl.int64) * BLOCK_D
            dimf = tl.zeros([G], dtype=tl.float32) + BLOCK_D
        else:
            tid = tl.load(stid_ptr + s, mask=valid, other=0)
            dim = tl.multiple_of(tl.load(table_dim_ptr + tid, mask=valid, other=VEC), VEC)
            m2 = valid[:, None] & ((cols // VEC)[None, :] < (dim // VEC)[:, None])
            rbase = tl.load(row_base_ptr + tid, mask=valid, other=0)
            woff = tl.multiple_of(tl.load(table_w_offset_ptr + tid, mask=valid, other=0), VEC)
            roff = woff + (key - rbase) * dim
            dimf = dim.to(tl.float32)
        if CACHED:
            loc = tl.load(sloc_ptr + s, mask=valid, other=-1)
        else:
            loc = s
        wp, np_, zp = row_pointers(w_ptr, n_ptr, z_ptr, roff, key, cw_ptr, cn_ptr, cz_ptr, loc,
                                   cache_stride, cols, CACHED, ROWWISE)
        # State loads depend only on the row: issue them before the gradient gather.
        sm = complete[:, None] & m2
        w, n, z = load_states(wp, np_, zp, sm, complete, DERIVED, ROWWISE)
        m3c = m2[:, None, :]
        acc = sum_gradient_rows(grad_ptr, go0, sc0, lm0, m3c, cols, HAS_SCALE, VEC)
        # Entries past the first R (pieces of long runs), R at a time in sorted order.
        max_len = tl.max(length, axis=0)
        for t in range(R, max_len, R):
            tt = t + u
            lm = tt[None, :] < length[:, None]                                   # [G, R]
            pos = s[:, None] + tt[None, :]
            go, sc = load_entries(sgofs_ptr, sscale_ptr, pos, lm, HAS_SCALE)
            acc += sum_gradient_rows(grad_ptr, go, sc, lm, m3c, cols, HAS_SCALE, VEC)
        slot = 2 * (s // SEG) + ((s % SEG) != 0).to(tl.int64)
        tl.store(part_ptr + slot[:, None] * BLOCK_D + cols[None, :], acc, mask=partial[:, None] & m2)
        ftrl_update_store(wp, np_, zp, nonfinite_ptr, w, n, z, sm, complete, acc, dimf,
                          knobs_ptr, key, cols, step_ptr, POW_HALF, HAS_SHRINK, LIBDEVICE_POW,
                          N_BF16, Z_BF16, DERIVED, ROWWISE)


@triton.jit(do_not_specialize=["N"])
def segment_combine_kernel(
    sk_ptr, stid_ptr, sloc_ptr, part_ptr,
    w_ptr, n_ptr, z_ptr, cw_ptr, cn_ptr, cz_ptr, table_w_offset_ptr, table_dim_ptr, row_base_ptr,
    nonfinite_ptr, step_ptr, knobs_ptr, N, cache_stride,
    SEG: tl.constexpr, CP: tl.constexpr, NB: tl.constexpr, POW_HALF: tl.constexpr,
    HAS_SHRINK: tl.constexpr, LIBDEVICE_POW: tl.constexpr, BLOCK_D: tl.constexpr,
    VEC: tl.constexpr, EVEN_D: tl.constexpr, CACHED: tl.constexpr, N_BF16: tl.constexpr,
    Z_BF16: tl.constexpr, DERIVED: tl.constexpr, ROWWISE: tl.constexpr,
):
    # Candidates: the CP multiples p = m * SEG (m >= 1) of this program. p is the FIRST cut of a
    # run iff key[p - SEG] == key[p] (p is a cut) and p - SEG is not a cut.
    ar = tl.arange(0, CP)
    mm = tl.program_id(0).to(tl.int64) * CP + 1 + ar
    pc = mm * SEG
    inb = pc < N
    kc = tl.load(sk_ptr + pc, mask=inb, other=0)
    is_cut = inb & (tl.load(sk_ptr + pc - SEG, mask=inb, other=0) == kc)
    prev_cut = (pc >= 2 * SEG) & (tl.load(sk_ptr + pc - 2 * SEG, mask=inb & (pc >= 2 * SEG),
                                          other=0) == kc)
    first = is_cut & (prev_cut == 0)
    nfirst = tl.sum(first.to(tl.int32), axis=0)
    if nfirst > 0:
        cols = row_columns(BLOCK_D)
        jj = tl.arange(0, NB)
        todo = first
        for _ in range(nfirst):  # one run per first cut, lowest candidate first
            c = tl.min(tl.where(todo, ar, CP), axis=0)
            sel_c = ar == c
            todo = todo & (sel_c == 0)
            if c < CP:
                p1 = tl.sum(tl.where(sel_c, pc, 0), axis=0)
                kb = tl.sum(tl.where(sel_c, kc, 0), axis=0)
                one = tl.arange(0, 1)
                if EVEN_D:
                    cmask = cols < BLOCK_D
                    roff = kb.to(tl.int64) * BLOCK_D
                    dimf = tl.zeros([1], dtype=tl.float32) + BLOCK_D
                else:
                    tid = tl.load(stid_ptr + p1)
                    dim = tl.multiple_of(tl.load(table_dim_ptr + tid), VEC)
                    cmask = (cols // VEC) < (dim // VEC)
                    rbase = tl.load(row_base_ptr + tid)
                    woff = tl.multiple_of(tl.load(table_w_offset_ptr + tid), VEC)
                    roff = woff + (kb - rbase) * dim
                    dimf = (dim + one * 0).to(tl.float32)
                rmask = one == 0
                if CACHED:
                    loc = tl.load(sloc_ptr + p1 + one * 0)
                else:
                    loc = one
                wp, np_, zp = row_pointers(w_ptr, n_ptr, z_ptr, roff + one * 0, kb + one * 0, cw_ptr,
                                           cn_ptr, cz_ptr, loc, cache_stride, cols, CACHED, ROWWISE)
                # States first: they depend only on the row.
                sm = rmask[:, None] & cmask[None, :]
                w, n, z = load_states(wp, np_, zp, sm, rmask, DERIVED, ROWWISE)
                # The run's first piece starts at p1 - SEG (slot 2(m-1)) or inside (p1-2SEG, p1-SEG)
                # (slot 2(m-2)+1).
                m1 = p1 // SEG
                head_mult = (p1 == SEG) | (tl.load(sk_ptr + p1 - SEG - 1, mask=p1 > SEG, other=0) != kb)
                head_slot = tl.where(head_mult, 2 * (m1 - 1), 2 * (m1 - 2) + 1)
                acc = tl.load(part_ptr + head_slot * BLOCK_D + cols, mask=cmask, other=0.0)
                j0 = m1
                go = m1 > 0
                while go:
                    js = j0 + jj
                    jin = js * SEG < N
                    kj = tl.load(sk_ptr + js * SEG, mask=jin, other=0)
                    selj = jin & (kj == kb)
                    tile = tl.load(part_ptr + (2 * js)[:, None] * BLOCK_D + cols[None, :],
                                   mask=selj[:, None] & cmask[None, :], other=0.0)
                    acc += tl.sum(tile, axis=0)
                    go = tl.sum(selj.to(tl.int32), axis=0) == NB
                    j0 += NB
                ftrl_update_store(wp, np_, zp, nonfinite_ptr, w, n, z, sm, rmask,
                                  acc[None, :], dimf, knobs_ptr, kb + one * 0, cols, step_ptr,
                                  POW_HALF, HAS_SHRINK, LIBDEVICE_POW, N_BF16, Z_BF16, DERIVED,
                                  ROWWISE)


@triton.jit
def offsets_repair_kernel(offsets_ptr, fixed_ptr, warn_ptr, ws_ptr, num_bags, num_indices,
                          BAGS: tl.constexpr, LOOKBACK: tl.constexpr):
    """WARNING repair of ``offsets`` (``[num_bags + 1]``) before an eval forward, one tile of
    ``BAGS`` bags per program (:func:`repair_offsets_tile`); the changed entries are added to
    ``warn``."""
    _, _, _, _, nfix = repair_offsets_tile(offsets_ptr, fixed_ptr, ws_ptr, num_bags, num_indices,
                                           BAGS, LOOKBACK)
    tl.atomic_add(warn_ptr, nfix, mask=nfix > 0)


def segment_config(block_d: int, tile: int = 2048, rows: int = 2) -> tuple[int, int, int]:
    """``(G, R, num_warps)`` of :func:`segment_update_kernel` for a ``BLOCK_D``: ``G`` segments per
    program, ``R`` gradient rows per segment in flight, about ``tile`` elements per step."""
    rows = max(1, min(rows, max(1, tile // block_d)))
    g = max(1, tile // (rows * block_d))
    g = 1 << (g.bit_length() - 1)
    elems = g * rows * block_d
    num_warps = max(1, min(8, elems // 512))
    num_warps = 1 << (num_warps.bit_length() - 1)
    return g, rows, num_warps
