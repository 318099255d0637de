"""Triton (CUDA) implementation of the FTRL TBE's ops (:mod:`torchrec_ftrl.kernels.ops`): ``tbe_forward``,
``tbe_linearize``, ``tbe_backward_update_`` and ``tbe_repair_offsets``, with every optional argument
of their schemas (the fused bounds check, the linearised batch, the HBM cache of the UVM-caching
placement), for every row layout (:class:`~torchrec_ftrl.kernels.batch.TableArrays`) and fp32 or
bf16 states (the kernels specialise on each; a bf16 state is stored by stochastic rounding with the
step read from the ``step`` tensor on the device). Kernels: :mod:`.forward` and :mod:`.backward`, the rule
from :mod:`.rule_gen`.

The functions below are the ops' CUDA kernels (:mod:`.impls` registers them); :data:`OPS` calls
them directly in eager mode, so the dispatcher's Python cost stays off a small step's path, and the
ops while ``torch.compile`` traces. None synchronises with the host: every buffer is sized from
``indices.numel()`` and the number of unique rows never leaves the device. Under
``TRITON_INTERPRET=1`` the same code runs on CPU tensors (slowly), which is how CI tests it.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Optional

import torch
from triton.runtime.jit import JITFunction

from ...row_layout import CACHED_LAYOUTS, KERNEL_LAYOUTS
from ..capabilities import Capabilities, OpTable
from . import host
from .launch import DirectLauncher, direct
from ..batch import POOL_NONE, index_factors, row_alignment
from ..ops import linearized_like
from .backward import (linearize_kernel, offsets_repair_kernel,
                              segment_combine_kernel, segment_config, segment_mark_kernel,
                              segment_update_kernel)
from .forward import forward_config, tbe_forward_kernel

# Every row layout, uncached and under the cached placement.
CAPABILITIES = Capabilities(fused_check=True, linearizes=True, cached_placement=True, graph_capture=True,
                            layouts=KERNEL_LAYOUTS, cached_layouts=CACHED_LAYOUTS)

# Launch shape knobs (results do not depend on them beyond fp32 summation order; chosen by step-time
# sweeps on an H200 with benchmarks/bench_tbe_cuda.py --tune / --tune-forward):
# * fwd: per weight-row size in bytes (BLOCK_D times the element size), (elements per step, indices
#   per bag in flight, L2 eviction policy of the row loads); 16-bit weights keep at most 2 indices
#   per bag in flight.
# * seg: longest piece of a run summed by one backward program (longer runs are cut and their pieces
#   combined), an int or per BLOCK_D.
# * seg_launch: per BLOCK_D, (elements per step, gradient rows per segment in flight[, register cap
#   per thread]) of segment_update_kernel. The cap (Triton's ``maxnreg``; compiled CUDA launches
#   only, see _register_cap) raises the programs resident per SM of this latency-bound kernel; it
#   is set only where it spills no registers, measured for the stored /
#   element-wise layout (another layout takes a cap from its own "layouts" entry only).
# * layouts: per row layout other than the stored / element-wise one, keyed
#   "{weights}/{accumulator}/{accum dtype}/{linear dtype}" (e.g. "derived/rowwise/fp32/bf16"), its
#   own "fwd" (elements per step, eviction) and "seg_launch" (elements per step[, register cap])
#   entries, for every D; a layout not listed uses the tables above. The indices per bag stay
#   those of "fwd" (they set the order of the pooled sum), so a derived table keeps the bits of its
#   stored twin.
# * rows: per "{accumulator}/{accum dtype}/{linear dtype}" (the layout key without its weights),
#   the gradient rows per segment in flight of segment_update_kernel, in place of seg_launch's, for
#   every D. They set the order of a row's gradient sum, so the entry is shared by a derived table
#   and its stored twin, which keep the same bits.
# * combine_cp / combine_nb: cut candidates per combine program / pieces added per step.
# * linearize: (bags per program, indices per bag in flight, warps) of linearize_kernel.
# * block: positions per tile of segment_mark_kernel; repair_block: bags per program of the eval
#   forward's WARNING offsets repair; lookback: preceding tiles read at once by the decoupled
#   look-back of the mark kernel and of the offsets repair.
# For a size not listed, the nearest listed one serves. block, repair_block, lookback and the
# linearize bags are powers of two (Triton block sizes).
TUNING = {"fwd": {256: (1024, 4, ""), 512: (1024, 4, ""), 1024: (1024, 4, "")},
          "seg": {64: 64, 128: 128, 256: 128},
          "seg_launch": {32: (4096, 4), 64: (4096, 4, 40), 128: (4096, 4), 256: (4096, 4, 40),
                         512: (4096, 4)},
          "layouts": {"derived/elementwise/bf16/bf16": {"fwd": (512, "")},
                      "derived/rowwise/fp32/fp32": {"fwd": (512, ""), "seg_launch": (2048,)},
                      "derived/rowwise/bf16/bf16": {"fwd": (512, "evict_last"), "seg_launch": (2048,)}},
          "rows": {"rowwise/fp32/fp32": 2, "rowwise/bf16/bf16": 2},
          "combine_cp": 16, "combine_nb": 64, "linearize": (64, 8, 4), "block": 1024,
          "repair_block": 1024, "lookback": 32}


_nearest_memo: dict = {}   # (id(table), size) -> (table, entry); a replaced table gets a new id


def _nearest(table: dict, size: int):
    """The entry of ``table`` whose power-of-two key is nearest to ``size`` (the smaller on a tie).
    Memoised per table object (the training step asks several times); a table edited in place is
    read afresh only if it is replaced, as the tests' ``monkeypatch.setitem`` does."""
    memo = _nearest_memo.get((id(table), size))
    if memo is not None and memo[0] is table:
        return memo[1]
    entry = table[min(table, key=lambda b: (abs(math.log2(b) - math.log2(size)), b))]
    _nearest_memo[(id(table), size)] = (table, entry)
    return entry


def tuning_key(derived: bool, rowwise: bool, accum: torch.Tensor, linear: torch.Tensor) -> str:
    """The key of a row layout in ``TUNING["layouts"]``, e.g. ``"derived/rowwise/fp32/bf16"``."""
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    return (f"{'derived' if derived else 'stored'}/{'rowwise' if rowwise else 'elementwise'}/"
            f"{name.get(accum.dtype, accum.dtype)}/{name.get(linear.dtype, linear.dtype)}")


def _layout_tuning(key: str, entry: str):
    """``TUNING["layouts"][key][entry]``, or None where the layout has no entry of its own."""
    return TUNING["layouts"].get(key, {}).get(entry)


def _forward_tuning(block_d: int, weight_bytes: int, key: str = "") -> tuple[int, int, str]:
    """``(tile, unroll, eviction policy)`` of the forward for rows of ``block_d`` weights of
    ``weight_bytes`` bytes (4 for derived weights: their stored twin holds fp32 weights), in the row
    layout ``key`` (:func:`tuning_key`). ``unroll`` (the indices of a bag summed together, so the
    order of the pooled sum) is always the stored table's; a layout's own entry sets the tile and
    the eviction only, so every layout pools in the same order as its stored twin."""
    tile, unroll, evict = _nearest(TUNING["fwd"], block_d * weight_bytes)
    unroll = max(1, min(min(unroll, 2) if weight_bytes < 4 else unroll, max(1, tile // block_d)))
    own = _layout_tuning(key, "fwd")
    if own is not None:
        tile, evict = max(int(own[0]), unroll * block_d), own[1]
    return tile, unroll, evict


def _update_tuning(block_d: int, key: str, lean: bool) -> tuple[int, int, Optional[int]]:
    """``(tile, rows, register cap)`` of :func:`.backward.segment_update_kernel` for
    ``block_d`` in the row layout ``key``. ``rows`` (gradient rows summed together, so the order of a
    row's gradient sum) is ``TUNING["rows"]``'s for the layout's accumulator and dtypes, else the
    stored / element-wise table's: the same for a derived table and its stored twin. A layout's own
    entry ``(tile[, cap])`` sets the tile and the cap. The stored table's cap applies to the stored /
    element-wise layout only (``lean``: any other)."""
    launch = _nearest(TUNING["seg_launch"], block_d)
    tile = int(launch[0])
    rows = int(TUNING["rows"].get(key.split("/", 1)[-1], launch[1]))
    rows = max(1, min(rows, max(1, tile // block_d)))   # as segment_config clamps it
    own = _layout_tuning(key, "seg_launch")
    if own is not None:
        return max(int(own[0]), rows * block_d), rows, (int(own[1]) if len(own) > 1 else None)
    return tile, rows, (int(launch[2]) if len(launch) > 2 and not lean else None)


def _k(kernel):
    """The kernel's :class:`~.launch.DirectLauncher` (the compiled kernel, launched without
    ``JITFunction.run``'s per-call work); an interpreted kernel unchanged."""
    return direct(kernel) if isinstance(kernel, JITFunction) else kernel


def _register_cap(launcher, maxnreg: Optional[int], dev: torch.device) -> dict:
    """Launch options that cap the registers per thread at ``maxnreg`` for ``launcher`` (what
    :func:`_k` gave for the kernel): only a compiled kernel on an NVIDIA GPU ``dev`` takes them, not
    an interpreted kernel, other devices or ROCm (those run uncapped)."""
    nvidia = dev.type == "cuda" and torch.version.hip is None
    if maxnreg and isinstance(launcher, (JITFunction, DirectLauncher)) and nvidia:
        return {"maxnreg": int(maxnreg)}
    return {}


def _block_d(max_d: int) -> int:
    """The power of two >= ``max_d`` (at least 1). Plain integer arithmetic here and in
    :func:`_cdiv`: ``triton.next_power_of_2`` / ``triton.cdiv`` are JIT-callable objects whose Python
    calls cost microseconds, a dozen times per training step."""
    return 1 << max(0, int(max_d) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=64)
def _vec_even(table_dims, block_d: int) -> tuple[int, bool]:
    """(largest power of two <= 16 dividing every D, every D == BLOCK_D); (1, False) if unknown."""
    if not table_dims:
        return 1, False
    return row_alignment(table_dims), all(int(d) == block_d for d in table_dims)


def tbe_forward(weights, accum, linear, rowwise, table_w_offset, table_dim, table_rows, table_row_base,
                feature_table, bag_feature, bag_out_offset, indices, offsets, per_sample_weights,
                pooling_mode, max_D, table_dims, total_rows, knobs, pow_half, has_shrink, out_numel,
                out_dtype, warn, check, row_keys, cache_locations, cache_weights, cache_accum,
                cache_linear) -> torch.Tensor:
    """``tbe_forward`` (:mod:`torchrec_ftrl.kernels.ops`): the pooled lookup of :func:`.forward.tbe_forward_kernel`.
    A cached batch (``cache_locations``) reads its cached rows from ``cache_weights``, or for derived
    weights from ``cache_linear`` and ``cache_accum``. With ``check`` (and no ``row_keys``) bad
    indices read row 0 and are counted in ``warn``.

    Unchecked: the registered op (:mod:`.impls`) checks its arguments first (:mod:`..arg_checks`);
    the TBE's eager calls (:data:`OPS`) pass the arguments it built and checked itself.
    """
    # a sequence (NONE) row of a table narrower than max_D leaves its padding unwritten: zeros
    padded = pooling_mode == POOL_NONE and any(int(d) != max_D for d in table_dims)
    out = (torch.zeros if padded else torch.empty)(out_numel, dtype=out_dtype, device=linear.device)
    num_bags = offsets.numel() - 1
    if num_bags <= 0 or out_numel == 0:
        return out.zero_()
    BLOCK_D = _block_d(max_D)
    vec, even_d = _vec_even(tuple(table_dims), BLOCK_D)
    derived = weights is None
    tile, unroll, evict = _forward_tuning(BLOCK_D, 4 if derived else weights.element_size(),
                                          tuning_key(derived, rowwise, accum, linear))
    bags, unroll, warps = forward_config(BLOCK_D, tile, unroll)
    has_psw = index_factors(per_sample_weights, pooling_mode)[0]
    psw = per_sample_weights if has_psw else out
    use_keys = row_keys is not None
    cached = cache_locations is not None
    # derived: the linear buffer and its cache stand where the weights and their cache are
    w = linear if derived else weights
    cw = (cache_linear if derived else cache_weights) if cached else w
    cn = cache_accum if cached and derived else cw   # read by a derived lookup only
    _k(tbe_forward_kernel)[(_cdiv(num_bags, bags),)](
        w, out, row_keys if use_keys else indices, offsets, bag_feature, bag_out_offset,
        feature_table, table_w_offset, table_dim, table_rows, table_row_base, psw,
        warn, cache_locations if cached else offsets, cw, cn, linear,
        accum, knobs, num_bags, max_D, cw.stride(0) if cached else 0,
        POOL=pooling_mode, HAS_PSW=has_psw, CHECK=bool(check) and not use_keys, KEYS=use_keys,
        BAGS=bags, UNROLL=unroll, BLOCK_D=BLOCK_D, VEC=vec, EVEN_D=even_d, WEVICT=evict,
        CACHED=cached, DERIVED=derived, ROWWISE=derived and rowwise, POW_HALF=pow_half,
        LIBDEVICE_POW=isinstance(tbe_forward_kernel, JITFunction), num_warps=warps)
    return out


def tbe_linearize(table_w_offset, table_dim, table_rows, table_row_base, feature_table, bag_feature,
                  bag_out_offset, indices, offsets, per_sample_weights, pooling_mode, max_D, table_dims,
                  total_rows, out_numel, warn) -> tuple:
    """``tbe_linearize`` (:mod:`torchrec_ftrl.kernels.ops`): :func:`.backward.linearize_kernel`; with ``warn``
    the raw offsets are repaired and bad offsets and indices counted.

    Unchecked: the registered op (:mod:`.impls`) checks its arguments first (:mod:`..arg_checks`);
    the TBE's eager calls (:data:`OPS`) pass the arguments it built and checked itself.
    """
    even_d = _vec_even(tuple(table_dims), _block_d(max_D))[1]
    return _linearize(indices, offsets, bag_feature, bag_out_offset, feature_table, table_row_base,
                      table_rows, warn, warn is not None, True, per_sample_weights, pooling_mode,
                      max_D, total_rows, out_numel, even_d)


def _linearize(indices, offsets, bag_feature, bag_out_offset, feature_table, row_base, table_rows,
               warn, check: bool, count: bool, per_sample_weights, pooling_mode: int, max_D: int,
               total_rows: int, out_numel: int, even_d: bool) -> tuple:
    """``(key, gofs, scale, tid, fixed)`` (:func:`torchrec_ftrl.kernels.ops.linearized_like`); ``check``: bad indices
    read as row 0, and with ``count`` the raw offsets are repaired into ``fixed`` and the repairs
    counted in ``warn``."""
    repair = check and count
    N, num_bags, dev = indices.numel(), offsets.numel() - 1, indices.device
    key, gofs, scale, tid, fixed = linearized_like(indices, offsets, per_sample_weights, pooling_mode,
                                                   total_rows, out_numel, repair)
    if not repair and (N == 0 or num_bags <= 0):
        return key, gofs, scale, tid, fixed
    has_psw, has_scale = index_factors(per_sample_weights, pooling_mode)
    psw = per_sample_weights if has_psw else scale
    bags, unroll, warps = TUNING["linearize"]
    tiles = _cdiv(max(1, num_bags), bags)      # zero bags: one tile still repairs offsets[0]
    # repair: tile tickets and statuses of the look-back over the offsets' running max (without
    # it, both pointers are unused placeholders)
    ws = torch.zeros(tiles + 1, dtype=torch.int64, device=dev) if repair else offsets
    _k(linearize_kernel)[(tiles,)](
        indices, offsets, bag_feature, bag_out_offset, feature_table, row_base, table_rows, psw,
        key, gofs, scale, tid, offsets if warn is None else warn, fixed if repair else offsets, ws,
        num_bags, N, max_D, POOL=pooling_mode, HAS_PSW=has_psw, HAS_SCALE=has_scale, CHECK=check,
        COUNT=check and count, HAS_TID=not even_d, BAGS=bags, UNROLL=unroll, REPAIR=repair,
        LOOKBACK=int(TUNING["lookback"]), num_warps=warps)
    return key, gofs, scale, tid, fixed


_fbgemm_sort_devices: dict[str, bool] = {}   # device type -> FBGEMM's sort op is built for it


def _fbgemm_sort(n_keys: int, device_type: str) -> bool:
    """Whether ``n_keys`` row keys on ``device_type`` sort by FBGEMM's op (:func:`_sort_positions`)."""
    return n_keys < 2 ** 31 - 1 and _fbgemm_sort_devices.get(device_type, True)


def _sort_positions(key: torch.Tensor, total_rows: int) -> torch.Tensor:
    """The positions (int32 or int64 ``[N]``) that sort the row keys ``key`` stably.

    FBGEMM's ``get_unique_indices_with_inverse`` where it runs: a stable CUB radix sort over only the
    bits of ``total_rows - 1`` (22 bits for 3.2M rows: 3 passes) with int32 positions, against
    ``torch.sort``'s 4 passes over all 32 bits with int64 positions (0.244 against 0.296 ms for 5.2M
    Zipf keys on an H200). ``torch.sort(stable=True)``, the same positions, where that op is not built
    for the device, for more than 2**31 - 2 keys, and for traced keys (FBGEMM registers no fake
    implementation of the op; traced tensors are fake or functional, not plain tensors).
    Keys outside ``[0, total_rows)`` (only with the bounds check off, undefined behaviour there) sort
    by their low bits, among the rows they alias.
    """
    dev = key.device.type
    if (0 < total_rows and _fbgemm_sort(key.numel(), dev) and type(key) is torch.Tensor
            and not torch.compiler.is_compiling()):
        try:
            return torch.ops.fbgemm.get_unique_indices_with_inverse(key, total_rows - 1, False, True)[3]
        except (AttributeError, NotImplementedError):   # no such op / no kernel for this device
            _fbgemm_sort_devices[dev] = False
    return torch.sort(key, stable=True)[1]


def tbe_backward_update_(weights, accum, linear, rowwise, table_w_offset, table_dim, table_rows,
                         table_row_base, feature_table, bag_feature, bag_out_offset, indices, offsets,
                         per_sample_weights, pooling_mode, max_D, table_dims, total_rows, grad_out,
                         knobs, pow_half, has_shrink, nonfinite_rows, step, check, lin_key, lin_gofs,
                         lin_scale, lin_tid, cache_locations, cache_weights, cache_accum,
                         cache_linear) -> None:
    """``tbe_backward_update_`` (:mod:`torchrec_ftrl.kernels.ops`): the fused backward + update, every row layout,
    uncached or with the HBM cache (``cache_locations`` int32 ``[N]``, the weight cache ``[slots, S]``
    (``[slots, 0]``, unused, for derived weights) and the state caches ``[slots, S]`` each
    (``cache_accum`` ``[slots, 1]`` when ``rowwise``), one row stride ``S``, in the dtypes of
    ``accum`` / ``linear``).

    Unchecked: the registered op (:mod:`.impls`) checks its arguments first (:mod:`..arg_checks`;
    a bf16 state needs ``step``); the TBE's eager calls (:data:`OPS`) pass the arguments it built
    and checked itself.
    """
    if step is None:
        step = table_row_base   # int64 placeholder (read-only): fp32 kernels never read it
    lin = (lin_key, lin_gofs, lin_scale, lin_tid)
    cached = cache_locations is not None
    cache = (cache_weights, (cache_accum, cache_linear)) if cached else None
    _backward_kernels(weights, accum, linear, nonfinite_rows, grad_out.reshape(-1).contiguous(), indices,
                      offsets, bag_feature, bag_out_offset, feature_table, table_w_offset, table_dim,
                      table_rows, table_row_base, check, lin,
                      per_sample_weights, pooling_mode, max_D, int(total_rows),
                      _vec_even(tuple(table_dims), _block_d(max_D)), (knobs, pow_half, has_shrink), step,
                      cache_locations, cache, rowwise)


def _mark_segments(key, gofs, scale, tid, cache_locations, total_rows: int, SEG: int, has_scale: bool,
                   even_d: bool):
    """The linearised batch sorted by row key (``perm``: :func:`_sort_positions`) and cut into
    segments by :func:`.backward.segment_mark_kernel`: run starts, plus cuts every ``SEG``
    positions inside long runs, compacted on the device in the same pass. Returns ``(sorted_key,
    sgofs, sscale, stid, sloc, seg, count)``: the sorted arrays (``sloc`` the cache slots, or
    ``tid`` when uncached), the segment starts, and the segment count as a device tensor ``[1]``."""
    N, dev = key.numel(), key.device
    BLOCK = int(TUNING["block"])
    perm = _sort_positions(key, total_rows)
    sorted_key, sgofs, sscale, stid = (torch.empty_like(t) for t in (key, gofs, scale, tid))
    cached = cache_locations is not None
    sloc = torch.empty_like(cache_locations) if cached else tid
    seg = torch.empty(N + 1, dtype=torch.int32 if N < 2 ** 31 - 1 else torch.int64, device=dev)
    tiles = _cdiv(N, BLOCK)
    ws = torch.zeros(tiles + 2, dtype=torch.int64, device=dev)   # tile tickets, statuses, count
    _k(segment_mark_kernel)[(tiles,)](
        key, perm, gofs, scale, tid, cache_locations if cached else tid, sorted_key, sgofs, sscale,
        stid, sloc, seg, ws, N, tiles, SEG=SEG, HAS_SCALE=has_scale, HAS_TID=not even_d,
        CACHED=cached, BLOCK=BLOCK, LOOKBACK=int(TUNING["lookback"]), num_warps=4)
    return sorted_key, sgofs, sscale, stid, sloc, seg, ws[tiles + 1:]


def _backward_kernels(weights, accum, linear, nonfinite_rows, grad, indices, offsets, bag_feature,
                      bag_out_offset, feature_table, table_w_offset, table_dim, table_rows, row_base,
                      check, lin, per_sample_weights, pooling_mode, max_D, total_rows, vec_even, knob3,
                      step, cache_locations, cache, rowwise) -> None:
    """The kernels of :func:`tbe_backward_update_`: ``lin`` the linearised batch (or four None),
    ``vec_even`` :func:`_vec_even`'s pair, ``knob3`` ``(knobs, pow_half, has_shrink)``, ``cache``
    ``(cache_weights, (cache_accum, cache_linear))`` or None."""
    N = indices.numel()
    num_bags = offsets.numel() - 1
    if N == 0 or num_bags <= 0:
        return
    dev = linear.device
    derived = weights is None
    (vec, even_d), (knobs, pow_half, has_shrink) = vec_even, knob3
    BLOCK_D = _block_d(max_D)
    seg = TUNING["seg"]
    SEG = max(1, int(_nearest(seg, BLOCK_D) if isinstance(seg, dict) else seg))
    has_scale = index_factors(per_sample_weights, pooling_mode)[1]
    if lin[0] is None:
        # Not linearised by the training forward: do it here (offsets repaired by then). Bad
        # indices were counted by the forward already (count=False: the counter is not touched).
        lin = _linearize(indices, offsets, bag_feature, bag_out_offset, feature_table, row_base,
                         table_rows, nonfinite_rows, check, False, per_sample_weights, pooling_mode,
                         max_D, total_rows, grad.numel(), even_d)
    lin_key, lin_gofs, lin_scale, lin_tid = lin[:4]
    cached = cache_locations is not None
    sorted_key, sgofs, sscale, stid, sloc, seg, count = _mark_segments(
        lin_key, lin_gofs, lin_scale, lin_tid, cache_locations, total_rows, SEG, has_scale, even_d)

    nmult = _cdiv(N, SEG) - 1            # multiples m * SEG, m >= 1, inside [0, N)
    part = torch.empty(max(1, 2 * (nmult + 1)) * BLOCK_D, dtype=torch.float32, device=dev)
    bound = N if total_rows < 0 else min(N, total_rows + N // SEG)
    tile, rows, cap = _update_tuning(BLOCK_D, tuning_key(derived, rowwise, accum, linear),
                                     derived or rowwise)
    G, R, warps = segment_config(BLOCK_D, tile, rows)
    libdev = isinstance(segment_update_kernel, JITFunction)
    update = _k(segment_update_kernel)
    # The caches: weights [slots, S], accum [slots, S] ([slots, 1] row-wise), linear [slots, S], one
    # row stride S. Uncached, a read-only placeholder, never dereferenced.
    cw, cn, cz = (cache[0], cache[1][0], cache[1][1]) if cached else (grad, grad, grad)
    cache_stride = cz.stride(0) if cached else 0
    n_bf16, z_bf16 = accum.dtype == torch.bfloat16, linear.dtype == torch.bfloat16
    if derived:
        weights = cw = grad     # read-only placeholders, never dereferenced
    update[(_cdiv(bound, G),)](
        seg, count, sorted_key, sgofs, sscale, stid, sloc, grad, weights, accum, linear, cw, cn, cz,
        table_w_offset, table_dim, row_base, part, nonfinite_rows, step, knobs,
        N, cache_stride,
        SEG=SEG, HAS_SCALE=has_scale, POW_HALF=pow_half, HAS_SHRINK=has_shrink,
        LIBDEVICE_POW=libdev, G=G, R=R, BLOCK_D=BLOCK_D, VEC=vec, EVEN_D=even_d,
        CACHED=cached, N_BF16=n_bf16, Z_BF16=z_bf16, DERIVED=derived, ROWWISE=rowwise,
        num_warps=warps,
        **_register_cap(update, cap, dev))
    if nmult > 0:
        cp = int(TUNING["combine_cp"])
        _k(segment_combine_kernel)[(_cdiv(nmult, cp),)](
            sorted_key, stid, sloc, part, weights, accum, linear, cw, cn, cz,
            table_w_offset, table_dim, row_base, nonfinite_rows, step, knobs,
            N, cache_stride,
            SEG=SEG, CP=cp, NB=int(TUNING["combine_nb"]), POW_HALF=pow_half,
            HAS_SHRINK=has_shrink, LIBDEVICE_POW=libdev, BLOCK_D=BLOCK_D, VEC=vec, EVEN_D=even_d,
            CACHED=cached, N_BF16=n_bf16, Z_BF16=z_bf16, DERIVED=derived, ROWWISE=rowwise,
            num_warps=max(1, min(4, int(TUNING["combine_nb"]) * BLOCK_D // 1024)))


def tbe_repair_offsets(offsets: torch.Tensor, warn: torch.Tensor, num_indices: int) -> torch.Tensor:
    """``tbe_repair_offsets`` (:mod:`torchrec_ftrl.kernels.ops`): one pass over tiles of
    ``TUNING["repair_block"]`` bags (:func:`.backward.offsets_repair_kernel`), no host sync.

    Unchecked: the registered op (:mod:`.impls`) checks its arguments first (:mod:`..arg_checks`);
    the TBE's eager calls (:data:`OPS`) pass the arguments it built and checked itself.
    """
    n = offsets.numel()
    fixed = torch.empty_like(offsets)
    if n == 0:
        return fixed
    bags = int(TUNING["repair_block"])
    tiles = _cdiv(max(1, n - 1), bags)
    ws = torch.zeros(tiles + 1, dtype=torch.int64, device=offsets.device)  # ticket, statuses
    _k(offsets_repair_kernel)[(tiles,)](offsets, fixed, warn, ws, n - 1, int(num_indices), BAGS=bags,
                                        LOOKBACK=int(TUNING["lookback"]), num_warps=4)
    return fixed


IMPLEMENTATIONS = (tbe_forward, tbe_linearize, tbe_backward_update_, tbe_repair_offsets)


class _HostPlan:
    """A training step's static configuration for the C++ host path (:mod:`.host`): its plan
    number and the launch geometry the C++ step computes its grids and buffers from, by the same
    tuning functions as the Python path."""

    __slots__ = ("id", "generation", "padded", "has_scale", "lin_bags", "fwd_bags", "seg", "block",
                 "block_d", "update_g", "combine_cp", "fbgemm_sort", "tuning")

    def __init__(self, key: tuple, weights, accum, linear, rowwise: bool, pooling_mode: int, max_D: int,
                 table_dims: tuple, total_rows: int, has_psw: bool) -> None:
        self.id, self.generation = host.plan_id(key), host.generation()
        self.tuning = tuple(TUNING.values())   # kept alive: their ids in the key stay theirs
        derived = weights is None
        block_d = _block_d(max_D)
        layout = tuning_key(derived, rowwise, accum, linear)
        tile, unroll, _ = _forward_tuning(block_d, 4 if derived else weights.element_size(), layout)
        self.fwd_bags = forward_config(block_d, tile, unroll)[0]
        self.lin_bags = int(TUNING["linearize"][0])
        self.padded = pooling_mode == POOL_NONE and any(int(d) != max_D for d in table_dims)
        self.has_scale = index_factors(True if has_psw else None, pooling_mode)[1]
        seg = TUNING["seg"]
        self.seg = max(1, int(_nearest(seg, block_d) if isinstance(seg, dict) else seg))
        self.block, self.block_d = int(TUNING["block"]), block_d
        tile, rows, _ = _update_tuning(block_d, layout, derived or rowwise)
        self.update_g = segment_config(block_d, tile, rows)[0]
        self.combine_cp = int(TUNING["combine_cp"])
        self.fbgemm_sort = total_rows > 0 and hasattr(torch.ops.fbgemm, "get_unique_indices_with_inverse")


_host_plans: dict = {}
_COMPILED = isinstance(tbe_forward_kernel, JITFunction)   # not interpreted: the host path may run


def _host_plan(direction: str, weights, accum, linear, rowwise, pooling_mode, max_D, table_dims,
               total_rows, has_psw, flags: tuple) -> _HostPlan:
    # TUNING's entries by identity: a replaced entry (as the tests' monkeypatch.setitem does) makes a
    # new plan; after an entry is edited in place, host.clear() makes every plan anew
    key = (direction, None if weights is None else weights.dtype, accum.dtype, linear.dtype, rowwise,
           pooling_mode, max_D, tuple(table_dims), total_rows, has_psw, flags,
           tuple(map(id, TUNING.values())))
    plan = _host_plans.get(key)
    if plan is None or plan.generation != host.generation():
        plan = _host_plans[key] = _HostPlan(key, weights, accum, linear, rowwise, pooling_mode, max_D,
                                            tuple(table_dims), total_rows, has_psw)
    return plan


def train_forward(weights, accum, linear, rowwise, table_w_offset, table_dim, table_rows, table_row_base,
                  feature_table, bag_feature, bag_out_offset, indices, offsets, per_sample_weights,
                  pooling_mode, max_D, table_dims, total_rows, knobs, pow_half, has_shrink, out_numel,
                  out_dtype, warn) -> tuple:
    """The forward of an eager training step: ``tbe_linearize`` then ``tbe_forward`` with its row
    keys, in one C++ call where the host path has the step's kernels (:mod:`.host`), else in
    Python (registering its kernels for the next steps). Returns ``(out, linearized)`` with
    ``linearized`` the five results of ``tbe_linearize``. Unchecked, as :func:`tbe_forward`."""
    has_psw = per_sample_weights is not None and pooling_mode != POOL_NONE
    plan = None
    if (_COMPILED and indices.numel() > 0 and offsets.numel() > 1 and out_numel > 0
            and host.ready(linear.device)):
        plan = _host_plan("fwd", weights, accum, linear, rowwise, pooling_mode, max_D, table_dims,
                          total_rows, has_psw, (warn is not None, pow_half))
        rc, res = host.load().train_forward(
            plan.id, weights, accum, linear, table_w_offset, table_dim, table_rows, table_row_base,
            feature_table, bag_feature, bag_out_offset, indices, offsets,
            per_sample_weights if has_psw else None, knobs, warn, max_D, total_rows, out_numel,
            out_dtype, plan.padded, plan.has_scale, plan.lin_bags, plan.fwd_bags)
        if rc == 0:
            host.STATS["cpp_forward"] += 1
            return res[0], tuple(res[1:])
        plan = plan if rc == 1 else None
    host.STATS["python_forward"] += 1
    batch = (table_w_offset, table_dim, table_rows, table_row_base, feature_table, bag_feature,
             bag_out_offset)
    with host.recorded(None if plan is None else plan.id):
        lin = tbe_linearize(*batch, indices, offsets, per_sample_weights, pooling_mode, max_D, table_dims,
                            total_rows, out_numel, warn)
        # the lookup reads the checked row keys: its own check is off and its warn unused (without
        # a counter, table_row_base stands there, as in the C++ step)
        out = tbe_forward(weights, accum, linear, rowwise, *batch, indices,
                          offsets if warn is None else lin[4], per_sample_weights, pooling_mode, max_D,
                          table_dims, total_rows, knobs, pow_half, has_shrink, out_numel, out_dtype,
                          table_row_base if warn is None else warn, False, lin[0], None, None, None, None)
    return out, lin


def _backward_update_eager(*args) -> None:
    """:func:`tbe_backward_update_` of an eager step: in one C++ call where the host path has the
    step's kernels (a linearised, uncached batch; :mod:`.host`), else in Python (registering its
    kernels for the next steps)."""
    (weights, accum, linear, rowwise, table_w_offset, table_dim, _, table_row_base, _, _, _, indices,
     offsets, psw, pooling_mode, max_D, table_dims, total_rows, grad_out, knobs, pow_half, has_shrink,
     nonfinite_rows, step, _, key, gofs, scale, tid, cache_locations) = args[:30]
    plan = None
    if (_COMPILED and key is not None and cache_locations is None and indices.numel() > 0
            and offsets.numel() > 1 and host.ready(linear.device)):
        has_psw = psw is not None and pooling_mode != POOL_NONE
        plan = _host_plan("bwd", weights, accum, linear, rowwise, pooling_mode, max_D, table_dims,
                          total_rows, has_psw, (pow_half, has_shrink))
        rc = host.load().train_backward(
            plan.id, weights, accum, linear, table_w_offset, table_dim, table_row_base, grad_out, knobs,
            nonfinite_rows, step, key, gofs, scale, tid, total_rows, plan.seg, plan.block, plan.block_d,
            plan.update_g, plan.combine_cp,
            plan.fbgemm_sort and _fbgemm_sort(key.numel(), "cuda"))
        if rc == 0:
            host.STATS["cpp_backward"] += 1
            return
        plan = plan if rc == 1 else None
    host.STATS["python_backward"] += 1
    with host.recorded(None if plan is None else plan.id):
        tbe_backward_update_(*args)


# The Python arguments of each C++ training lookup's backward, for the Python path where a backward
# variant is not registered (:func:`_backward_fallback`); an entry lives while its autograd node
# holds its token (read, not popped: a retained graph's node may run its backward again).
_fallbacks = torch.utils.weak.WeakTensorKeyDictionary()


def train_lookup(weights, accum, linear, rowwise, table_w_offset, table_dim, table_rows, table_row_base,
                 feature_table, bag_feature, bag_out_offset, indices, offsets, per_sample_weights,
                 pooling_mode, max_D, table_dims, total_rows, knobs, pow_half, has_shrink, out_numel,
                 out_dtype, warn, placeholder, nonfinite_rows, step, iteration, hp_version,
                 knobs_now) -> Optional[torch.Tensor]:
    """A whole eager training lookup as one C++ autograd op (``torchrec_ftrl_host::train_lookup``):
    the forward of :func:`train_forward`; its backward :func:`_backward_update_eager`'s C++ call and
    ``iteration += 1``, with no Python in the backward; where ``hp_version`` (CPU int64 ``[1]``)
    changed since the forward, the backward runs through Python with ``knobs_now()`` (the knob
    arguments of backward time), as the TBE's Python path reads them. Returns the output (its
    ``grad_fn`` that node), or None where the step is to run through Python (the host path off or not ready, a
    forward variant not registered yet): nothing was launched then."""
    if not (_COMPILED and host.LOOKUP_OP and indices.numel() > 0 and offsets.numel() > 1
            and out_numel > 0 and host.ready(linear.device)):
        return None
    has_psw = per_sample_weights is not None and pooling_mode != POOL_NONE
    fplan = _host_plan("fwd", weights, accum, linear, rowwise, pooling_mode, max_D, table_dims,
                       total_rows, has_psw, (warn is not None, pow_half))
    bplan = _host_plan("bwd", weights, accum, linear, rowwise, pooling_mode, max_D, table_dims,
                       total_rows, has_psw, (pow_half, has_shrink))
    sort = bplan.fbgemm_sort and _fbgemm_sort(indices.numel(), "cuda")
    token = torch.empty(0)
    out = host.load().train_lookup(
        placeholder, token, hp_version, fplan.id, bplan.id, weights, accum, linear, table_w_offset,
        table_dim, table_rows, table_row_base, feature_table, bag_feature, bag_out_offset, indices, offsets,
        per_sample_weights if has_psw else None, knobs, warn, max_D, total_rows, out_numel, out_dtype,
        fplan.padded, fplan.has_scale, fplan.lin_bags, fplan.fwd_bags, nonfinite_rows, step, iteration,
        [bplan.seg, bplan.block, bplan.block_d, bplan.update_g, bplan.combine_cp, int(sort)])
    if out.numel() == 0:
        return None
    host.STATS["cpp_forward"] += 1
    _fallbacks[token] = (weights, accum, linear, rowwise, table_w_offset, table_dim, table_rows,
                         table_row_base, feature_table, bag_feature, bag_out_offset, indices, offsets,
                         per_sample_weights, pooling_mode, max_D, table_dims, total_rows, knobs, pow_half,
                         has_shrink, nonfinite_rows, step, warn is not None, knobs_now)
    return out


def _backward_fallback(token, grad_out, key, gofs, scale, tid, fixed, knobs_changed) -> None:
    """``torchrec_ftrl_host_py::backward_fallback``: a C++ training lookup's backward whose
    variants are not all registered, or whose knobs changed since its forward (``knobs_changed``:
    it takes the knobs of now), through :func:`_backward_update_eager` (the Python path, which
    registers the variants); the forward's repaired offsets ``fixed`` stand in for a raw batch's."""
    (weights, accum, linear, rowwise, table_w_offset, table_dim, table_rows, table_row_base, feature_table,
     bag_feature, bag_out_offset, indices, offsets, psw, pooling_mode, max_D, table_dims, total_rows, knobs,
     pow_half, has_shrink, nonfinite_rows, step, raw, knobs_now) = _fallbacks[token]
    if knobs_changed:   # since the forward: the update takes the knobs of now
        knobs, pow_half, has_shrink = knobs_now()
    _backward_update_eager(weights, accum, linear, rowwise, table_w_offset, table_dim, table_rows,
                           table_row_base, feature_table, bag_feature, bag_out_offset, indices,
                           fixed if raw else offsets, psw, pooling_mode, max_D, table_dims, total_rows,
                           grad_out, knobs, pow_half, has_shrink, nonfinite_rows, step, raw, key, gofs,
                           scale, tid, None, None, None, None)


def _define_backward_fallback() -> Optional[torch.library.Library]:
    """Register ``torchrec_ftrl_host_py::backward_fallback`` once per process (a re-import of this
    module finds it; the kernel calls the module's current :func:`_backward_fallback`)."""
    if hasattr(torch.ops.torchrec_ftrl_host_py, "backward_fallback"):
        return None
    lib = torch.library.Library("torchrec_ftrl_host_py", "DEF")
    lib.define("backward_fallback(Tensor token, Tensor grad_out, Tensor key, Tensor gofs, Tensor scale, "
               "Tensor tid, Tensor fixed, bool knobs_changed) -> ()")
    lib.impl("backward_fallback", lambda *args: sys.modules[__name__]._backward_fallback(*args), "CUDA")
    return lib


# kept for the process (a re-import runs in the same globals): the C++ backward holds the op
_fallback_lib = globals().get("_fallback_lib") or _define_backward_fallback()


def _eager_or_dispatched(impl, takes_hp: bool = False, eager=None):
    """``eager`` (default ``impl`` itself) in eager mode (no dispatcher on the step's path), the
    registered op ``impl`` while ``torch.compile`` traces (its fake implementation traces; the graph
    calls the op, whose CUDA kernel is ``impl``, :mod:`.impls`). ``takes_hp``: the
    :class:`~torchrec_ftrl.kernels.capabilities.OpTable` entry takes the hyper-parameters first
    (unused: the kernels read the knob tensor)."""
    op = getattr(torch.ops.torchrec_ftrl, impl.__name__).default
    eager = impl if eager is None else eager

    def call(*args):
        args = args[1:] if takes_hp else args
        return op(*args) if torch.compiler.is_compiling() else eager(*args)
    call.__name__ = impl.__name__
    return call


def _train_forward_entry(hp, *args):
    """:attr:`OpTable.train_forward`: :func:`train_forward` in eager mode; None while
    ``torch.compile`` traces (the TBE then calls ``tbe_linearize`` and ``tbe_forward``)."""
    return None if torch.compiler.is_compiling() else train_forward(*args)


def _train_lookup_entry(hp, *args):
    """:attr:`OpTable.train_lookup`: :func:`train_lookup` in eager mode; None while
    ``torch.compile`` traces."""
    return None if torch.compiler.is_compiling() else train_lookup(*args)


OPS = OpTable(forward=_eager_or_dispatched(tbe_forward, True),
              linearize=_eager_or_dispatched(tbe_linearize),
              backward_update_=_eager_or_dispatched(tbe_backward_update_, True, _backward_update_eager),
              count_invalid=torch.ops.torchrec_ftrl.tbe_count_invalid.default,
              repair_offsets=_eager_or_dispatched(tbe_repair_offsets),
              train_forward=_train_forward_entry,
              train_lookup=_train_lookup_entry)
