"""Triton (CUDA) backend of the FTRL TBE, registered as ``torch.library`` custom ops.

* ``torch.ops.torchrec_ftrl.triton_tbe_forward``: pooled lookup, see :mod:`.triton_forward` (mutates
  ``warn``, the bounds-check counter, when the fused WARNING check is on).
* ``torch.ops.torchrec_ftrl.triton_tbe_backward_update_``: fused backward + FTRL update in place
  (mutates weights, accum, linear, nonfinite_rows), see :mod:`.triton_backward`. Every row layout
  (:class:`~.layout.TableArrays`): ``weights`` None for derived weights, ``rowwise`` for a row-wise
  ``accum`` ``[total_rows]``; the forward op takes the same and computes a derived weight from
  ``linear`` and ``accum`` (:mod:`.triton_rule_gen`). ``accum`` /
  ``linear`` are fp32 or bf16 (the kernels specialise on each: the fp32 kernels are unchanged); a
  bf16 state is stored by stochastic rounding with the step read from the ``step`` tensor (the TBE's
  ``iter``) on the device.
* ``torch.ops.torchrec_ftrl.triton_tbe_backward_update_cached_``: the same for a batch whose rows may
  sit in the UVM-caching placement's HBM cache (:mod:`torchrec_ftrl.cache`; mutates the weight and
  state caches ``cache_accum`` / ``cache_linear`` too, each in its state's dtype). The forward op reads such a batch's rows from the cache where they have a slot.
  Every row layout: a derived-weights table's cache holds ``linear`` and ``accum`` only, a
  row-wise ``accum`` one value per slot.
* ``torch.ops.torchrec_ftrl.triton_tbe_linearize``: the training forward's linearize pass (row keys,
  gradient offsets, factors, tables; with the fused WARNING check also the offsets repair), mutates
  ``warn``.
* ``torch.ops.torchrec_ftrl.triton_repair_offsets``: the WARNING repair of offsets before an eval
  forward (mutates ``warn``).

The ops that run the rule take the knobs as one fp32 tensor (:func:`knob_tensor`) and their
compile-time flags (:func:`knob_flags`), so no kernel or launch names a knob.

All are ``torch.library.triton_op`` s, so ``torch.compile`` / ``torch.export`` see the Triton kernels
inside them. Neither synchronises with the host: every buffer is sized from ``indices.numel()`` and
the number of unique rows never leaves the device. Under ``TRITON_INTERPRET=1`` the same code runs on
CPU tensors (slowly), which is how CI tests it.

Implements :class:`~torchrec_ftrl.kernels.backend.Backend` (the module functions below the ops).
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from typing import Any, NamedTuple, Optional

import torch
from triton.runtime.jit import JITFunction

from ..fbgemm_enums import BoundsCheckMode
from ..hyperparams import FTRLHyperparams
from ..row_layout import CACHED_LAYOUTS, KERNEL_LAYOUTS
from .launch import DirectLauncher, direct
from .capabilities import Capabilities
from .layout import POOL_MEAN, POOL_NONE, TableArrays, TBEBatch
from .torch_backend import per_sample_weight_grad  # noqa: F401  (the Backend member, shared)
from .triton_backward import (linearize_kernel, offsets_repair_kernel,
                              segment_combine_kernel, segment_config, segment_mark_kernel,
                              segment_update_kernel)
from .triton_forward import forward_config, tbe_forward_kernel

# Every row layout, uncached and under the cached placement.
CAPABILITIES = Capabilities(cached_placement=True, graph_capture=True, repairs_offsets=True,
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
#   outside torch.compile only, see _register_cap) raises the programs resident per SM of this
#   latency-bound kernel; it is set only where it spills no registers, measured for the stored /
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
    """``(tile, rows, register cap)`` of :func:`.triton_backward.segment_update_kernel` for
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


try:
    from torch.library import triton_op, wrap_triton
except ImportError:  # pragma: no cover - torch < 2.6
    triton_op = wrap_triton = None


_eager = threading.local()   # .on: running an implementation directly, outside its custom op


def _k(kernel):
    """``wrap_triton(kernel)`` for compiled kernels inside the custom ops (traceable by
    torch.compile); in eager mode the kernel's :class:`~.launch.DirectLauncher` (the same compiled
    kernel, launched without ``JITFunction.run``'s per-call work); an interpreted kernel unchanged."""
    if not isinstance(kernel, JITFunction):
        return kernel
    if getattr(_eager, "on", False) or wrap_triton is None:
        return direct(kernel)
    return wrap_triton(kernel)


def _call(op, impl, *args):
    """``op`` (the registered custom op) while ``torch.compile`` traces, so its graph holds the Triton
    kernels; in eager mode ``impl`` itself: the same kernels without the dispatcher and
    ``wrap_triton``'s per-call Python cost (a large share of a small step's host time)."""
    if op is impl or torch.compiler.is_compiling():
        return op(*args)
    _eager.on = True
    try:
        return impl(*args)
    finally:
        _eager.on = False


def _register_cap(launcher, maxnreg: Optional[int], dev: torch.device) -> dict:
    """Launch options that cap the registers per thread at ``maxnreg`` for ``launcher`` (what
    :func:`_k` gave for the kernel): only a compiled kernel launched directly (eager mode) on an
    NVIDIA GPU ``dev`` takes them. Not an interpreted kernel, not other devices or ROCm, and not a
    ``wrap_triton`` wrapper (torch.compile), whose launches take no ``maxnreg``: those run uncapped."""
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
    g = 0
    for d in table_dims:
        g = math.gcd(g, int(d))
    vec = 1
    while vec < 16 and g % (vec * 2) == 0:
        vec *= 2
    return vec, all(int(d) == block_d for d in table_dims)


_knob_tensors: dict = {}   # (id(hp), device) -> the knob tensor; an entry leaves with its hp


def knob_tensor(hp: FTRLHyperparams, device: torch.device) -> torch.Tensor:
    """The kernels' one knob argument: ``hp.kernel_scalars()`` (:data:`.rule_spec.KNOBS` order) as
    an fp32 ``[len(KNOBS)]`` tensor on ``device``, read on the device by
    :func:`.triton_rule_gen.ftrl_knobs`. Built once per hyper-parameter object and device and kept
    while ``hp`` lives: a CUDA graph that captured a step reads it at every replay, so the TBE keeps
    each captured ``hp``. A new ``hp`` (e.g. a learning-rate schedule's) costs one asynchronous copy
    from pinned memory. Made under CUDA-graph capture (an ``hp`` no eager step used): fill kernels
    recorded in the graph, not cached. While ``torch.compile`` traces: a fresh constant of the
    graph."""
    values = hp.kernel_scalars()
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.float32, device=device)
    key = (id(hp), device)
    knobs = _knob_tensors.get(key)
    if knobs is None and _capturing(device):
        # Recorded fill kernels: the tensor holds the knobs from each replay's fills on, so it is
        # not cached (an eager use of it before a replay would read it empty); stream order keeps
        # it intact until the captured kernels have read it, like any temporary of the graph.
        knobs = torch.empty(len(values), dtype=torch.float32, device=device)
        for i, v in enumerate(values):
            knobs[i].fill_(v)
        return knobs
    if knobs is None:
        if device.type == "cuda":     # a pinned source: the copy does not wait for the stream
            knobs = torch.tensor(values, dtype=torch.float32, pin_memory=True).to(device, non_blocking=True)
        else:
            knobs = torch.tensor(values, dtype=torch.float32, device=device)
        _knob_tensors[key] = knobs
        weakref.finalize(hp, _knob_tensors.pop, key, None)
    return knobs


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of CUDA ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def knob_flags(hp: FTRLHyperparams) -> tuple[bool, bool]:
    """``(pow_half, has_shrink)``: the kernels' compile-time flags of ``hp`` (learning-rate power
    -0.5: the sqrt path; a non-zero l2 shrinkage)."""
    scalars = hp.kernel_scalars()
    return scalars.neg_power == 0.5, scalars.shrink2 != 0.0


def _forward_impl(weights: Optional[torch.Tensor], linear: torch.Tensor, accum: torch.Tensor,
                  rowwise: bool, indices: torch.Tensor, offsets: torch.Tensor,
                  bag_feature: torch.Tensor, bag_out_offset: torch.Tensor,
                  feature_table: torch.Tensor, table_w_offset: torch.Tensor, table_dim: torch.Tensor,
                  table_rows: torch.Tensor, row_base: torch.Tensor, warn: torch.Tensor, check: bool,
                  keys: Optional[torch.Tensor],
                  per_sample_weights: Optional[torch.Tensor], pooling_mode: int, out_numel: int,
                  max_D: int, out_dtype: torch.dtype, vec: int, even_d: bool,
                  cache_locations: Optional[torch.Tensor],
                  cache_weights: Optional[torch.Tensor], cache_accum: Optional[torch.Tensor],
                  cache_linear: Optional[torch.Tensor], knobs: torch.Tensor,
                  pow_half: bool) -> torch.Tensor:
    """The pooled lookup of :func:`.triton_forward.tbe_forward_kernel`. ``weights`` None: derived
    weights, ``prox(linear, accum)`` with the knobs (:func:`knob_tensor`; ``pow_half``: the
    learning-rate power is -0.5);
    ``rowwise``: ``accum`` holds one value per row. A cached batch (``cache_locations``) reads its
    cached rows from ``cache_weights``, or for derived weights from ``cache_linear`` and
    ``cache_accum``."""
    out = torch.empty(out_numel, dtype=out_dtype, device=linear.device)
    num_bags = offsets.numel() - 1
    if num_bags <= 0 or out_numel == 0:
        return out.zero_()
    BLOCK_D = _block_d(max_D)
    derived = weights is None
    tile, unroll, evict = _forward_tuning(BLOCK_D, 4 if derived else weights.element_size(),
                                          tuning_key(derived, rowwise, accum, linear))
    bags, unroll, warps = forward_config(BLOCK_D, tile, unroll)
    has_psw = _has_scale(per_sample_weights, pooling_mode)[0]
    psw = per_sample_weights if has_psw else out
    use_keys = keys is not None
    cached = cache_locations is not None and cache_weights is not None
    # derived: the linear buffer and its cache stand where the weights and their cache are
    w = linear if derived else weights
    cw = (cache_linear if derived else cache_weights) if cached else w
    cn = cache_accum if cached and derived else cw   # read by a derived lookup only
    _k(tbe_forward_kernel)[(_cdiv(num_bags, bags),)](
        w, out, keys if use_keys else indices, offsets, bag_feature, bag_out_offset,
        feature_table, table_w_offset, table_dim, table_rows, row_base, psw, warn,
        cache_locations if cached else offsets, cw, cn, linear, accum, knobs,
        num_bags, max_D, cw.stride(0) if cached else 0,
        POOL=pooling_mode, HAS_PSW=has_psw, CHECK=check and not use_keys, KEYS=use_keys, BAGS=bags,
        UNROLL=unroll, BLOCK_D=BLOCK_D, VEC=vec, EVEN_D=even_d, WEVICT=evict,
        CACHED=cached, DERIVED=derived, ROWWISE=derived and rowwise, POW_HALF=pow_half,
        LIBDEVICE_POW=isinstance(tbe_forward_kernel, JITFunction), num_warps=warps)
    return out


def _has_scale(per_sample_weights: Optional[torch.Tensor], pooling_mode: int) -> tuple[bool, bool]:
    """``(has_psw, has_scale)``: whether the entries carry per-sample weights, and a factor at all
    (per-sample weight and/or the 1/L of MEAN pooling)."""
    has_psw = per_sample_weights is not None and pooling_mode != POOL_NONE
    return has_psw, has_psw or pooling_mode == POOL_MEAN


def _linearize_impl(indices: torch.Tensor, offsets: torch.Tensor, bag_feature: torch.Tensor,
                    bag_out_offset: torch.Tensor, feature_table: torch.Tensor,
                    row_base: torch.Tensor, table_rows: torch.Tensor, warn: torch.Tensor,
                    check: bool, count: bool, repair: bool,
                    per_sample_weights: Optional[torch.Tensor], pooling_mode: int, max_D: int,
                    total_rows: int, out_numel: int, even_d: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(key, gofs, scale, tid, fixed)``; ``fixed`` is the repaired offsets with ``repair`` (the
    fused WARNING repair; ``offsets`` as given are raw), else empty."""
    N = indices.numel()
    num_bags = offsets.numel() - 1
    dev = indices.device
    i32_max = 2 ** 31 - 1
    key_dtype = torch.int32 if 0 <= total_rows < i32_max else torch.int64
    key = torch.empty(N, dtype=key_dtype, device=dev)
    gofs = torch.empty(N, dtype=torch.int32 if out_numel < i32_max else torch.int64, device=dev)
    tid = torch.empty(1 if even_d else N, dtype=torch.int32, device=dev)  # table per index
    has_psw, has_scale = _has_scale(per_sample_weights, pooling_mode)
    scale = torch.empty(N if has_scale else 1, dtype=torch.float32, device=dev)
    fixed = torch.empty(num_bags + 1 if repair else 0, dtype=offsets.dtype, device=dev)
    if not repair and (N == 0 or num_bags <= 0):
        return key, gofs, scale, tid, fixed
    psw = per_sample_weights if has_psw else scale
    bags, unroll, warps = TUNING["linearize"]
    tiles = _cdiv(max(1, num_bags), bags)      # zero bags: one tile still repairs offsets[0]
    # repair: tile tickets and statuses of the look-back over the offsets' running max (without
    # it, both pointers are unused placeholders)
    ws = torch.zeros(tiles + 1, dtype=torch.int64, device=dev) if repair else offsets
    _k(linearize_kernel)[(tiles,)](
        indices, offsets, bag_feature, bag_out_offset, feature_table, row_base, table_rows, psw,
        key, gofs, scale, tid, warn, fixed if repair else offsets, ws, num_bags, N, max_D,
        POOL=pooling_mode, HAS_PSW=has_psw, HAS_SCALE=has_scale, CHECK=check or repair,
        COUNT=(check or repair) and count, HAS_TID=not even_d, BAGS=bags, UNROLL=unroll,
        REPAIR=repair, LOOKBACK=int(TUNING["lookback"]), num_warps=warps)
    return key, gofs, scale, tid, fixed


_fbgemm_sort_devices: dict[str, bool] = {}   # device type -> FBGEMM's sort op is built for it


def _sort_positions(key: torch.Tensor, total_rows: int) -> torch.Tensor:
    """The positions (int32 or int64 ``[N]``) that sort the row keys ``key`` stably.

    FBGEMM's ``get_unique_indices_with_inverse`` where it runs: a stable CUB radix sort over only the
    bits of ``total_rows - 1`` (22 bits for 3.2M rows: 3 passes) with int32 positions, against
    ``torch.sort``'s 4 passes over all 32 bits with int64 positions (0.244 against 0.296 ms for 5.2M
    Zipf keys on an H200). ``torch.sort(stable=True)``, the same positions, where that op is not built
    for the device, for more than 2**31 - 2 keys, and while ``torch.compile`` traces (FBGEMM registers
    no fake implementation of the op; traced tensors are fake or functional, not plain tensors).
    Keys outside ``[0, total_rows)`` (only with the bounds check off, undefined behaviour there) sort
    by their low bits, among the rows they alias.
    """
    dev = key.device.type
    if (0 < total_rows and key.numel() < 2 ** 31 - 1 and type(key) is torch.Tensor
            and _fbgemm_sort_devices.get(dev, True) and not torch.compiler.is_compiling()):
        try:
            return torch.ops.fbgemm.get_unique_indices_with_inverse(key, total_rows - 1, False, True)[3]
        except (AttributeError, NotImplementedError):   # no such op / no kernel for this device
            _fbgemm_sort_devices[dev] = False
    return torch.sort(key, stable=True)[1]


def _backward_impl(weights: Optional[torch.Tensor], accum: torch.Tensor, linear: torch.Tensor,
                   nonfinite_rows: torch.Tensor, rowwise: bool, grad: torch.Tensor,
                   indices: torch.Tensor,
                   offsets: torch.Tensor, bag_feature: torch.Tensor, bag_out_offset: torch.Tensor,
                   feature_table: torch.Tensor, table_w_offset: torch.Tensor,
                   table_dim: torch.Tensor, table_rows: torch.Tensor, row_base: torch.Tensor,
                   check: bool, lin_key: Optional[torch.Tensor], lin_gofs: Optional[torch.Tensor],
                   lin_scale: Optional[torch.Tensor], lin_tid: Optional[torch.Tensor],
                   per_sample_weights: Optional[torch.Tensor], pooling_mode: int, max_D: int,
                   total_rows: int, vec: int, even_d: bool, knobs: torch.Tensor, pow_half: bool,
                   has_shrink: bool, step: torch.Tensor) -> None:
    """The fused backward + update of an uncached batch, every row layout: ``weights`` None for
    derived weights; ``rowwise``: ``accum`` ``[total_rows]``, one value per row. ``knobs``:
    :func:`knob_tensor`; ``pow_half`` / ``has_shrink``: the learning-rate power is -0.5 / the l2
    shrinkage is not 0 (the kernels' flags)."""
    _backward_kernels(weights, accum, linear, nonfinite_rows, grad, indices, offsets, bag_feature,
                      bag_out_offset, feature_table, table_w_offset, table_dim, table_rows, row_base,
                      check, lin_key, lin_gofs, lin_scale, lin_tid, per_sample_weights, pooling_mode,
                      max_D, total_rows, vec, even_d, knobs, pow_half, has_shrink, step,
                      rowwise=rowwise)


def _backward_cached_impl(weights: Optional[torch.Tensor], accum: torch.Tensor, linear: torch.Tensor,
                          nonfinite_rows: torch.Tensor, rowwise: bool, cache_weights: torch.Tensor,
                          cache_accum: torch.Tensor, cache_linear: torch.Tensor,
                          cache_locations: torch.Tensor,
                          grad: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                          bag_feature: torch.Tensor, bag_out_offset: torch.Tensor,
                          feature_table: torch.Tensor, table_w_offset: torch.Tensor,
                          table_dim: torch.Tensor, table_rows: torch.Tensor, row_base: torch.Tensor,
                          check: bool, lin_key: Optional[torch.Tensor],
                          lin_gofs: Optional[torch.Tensor], lin_scale: Optional[torch.Tensor],
                          lin_tid: Optional[torch.Tensor], per_sample_weights: Optional[torch.Tensor],
                          pooling_mode: int, max_D: int, total_rows: int, vec: int, even_d: bool,
                          knobs: torch.Tensor, pow_half: bool, has_shrink: bool,
                          step: torch.Tensor) -> None:
    """:func:`_backward_impl` of a batch whose rows may sit in the HBM cache (``cache_locations``
    int32 ``[N]``, the weight cache ``[slots, S]`` (``[slots, 0]``, unused, for derived weights) and
    the state caches ``[slots, S]`` each (``cache_accum`` ``[slots, 1]`` when ``rowwise``), one row
    stride ``S``, in the dtypes of ``accum`` / ``linear``)."""
    _backward_kernels(weights, accum, linear, nonfinite_rows, grad, indices, offsets, bag_feature,
                      bag_out_offset, feature_table, table_w_offset, table_dim, table_rows, row_base,
                      check, lin_key, lin_gofs, lin_scale, lin_tid, per_sample_weights, pooling_mode,
                      max_D, total_rows, vec, even_d, knobs, pow_half, has_shrink, step,
                      cache_locations, cache_weights, (cache_accum, cache_linear), rowwise)


def _mark_segments(key, gofs, scale, tid, cache_locations, total_rows: int, SEG: int, has_scale: bool,
                   even_d: bool):
    """The linearised batch sorted by row key (``perm``: :func:`_sort_positions`) and cut into
    segments by :func:`.triton_backward.segment_mark_kernel`: run starts, plus cuts every ``SEG``
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
                      check, lin_key, lin_gofs, lin_scale, lin_tid, per_sample_weights, pooling_mode,
                      max_D, total_rows, vec, even_d, knobs, pow_half, has_shrink, step,
                      cache_locations=None, cache_weights=None, cache_states=None,
                      rowwise=False) -> None:
    N = indices.numel()
    num_bags = offsets.numel() - 1
    if N == 0 or num_bags <= 0:
        return
    dev = linear.device
    derived = weights is None
    BLOCK_D = _block_d(max_D)
    seg = TUNING["seg"]
    SEG = max(1, int(_nearest(seg, BLOCK_D) if isinstance(seg, dict) else seg))
    has_scale = _has_scale(per_sample_weights, pooling_mode)[1]
    if lin_key is None or lin_gofs is None or lin_scale is None or lin_tid is None:
        # Not linearised by the training forward: do it here (offsets repaired by then). Bad
        # indices were counted by the forward already (count=False: the counter is not touched).
        lin_key, lin_gofs, lin_scale, lin_tid, _ = _linearize_impl(
            indices, offsets, bag_feature, bag_out_offset, feature_table, row_base, table_rows,
            nonfinite_rows, check, False, False, per_sample_weights, pooling_mode, max_D,
            total_rows, grad.numel(), even_d)
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
    # row stride S. Uncached, a read-only placeholder: passing a mutated tensor twice would alias
    # it under torch.compile.
    cw, cn, cz = (cache_weights, cache_states[0], cache_states[1]) if cached else (grad, grad, grad)
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


def _repair_offsets_impl(offsets: torch.Tensor, warn: torch.Tensor, num_indices: int) -> torch.Tensor:
    n = offsets.numel()
    fixed = torch.empty_like(offsets)
    if n == 0:
        return fixed
    bags = int(TUNING["repair_block"])
    tiles = _cdiv(max(1, n - 1), bags)
    ws = torch.zeros(tiles + 1, dtype=torch.int64, device=offsets.device)  # ticket, statuses
    _k(offsets_repair_kernel)[(tiles,)](offsets, fixed, warn, ws, n - 1, num_indices, BAGS=bags,
                                        LOOKBACK=int(TUNING["lookback"]), num_warps=4)
    return fixed


if triton_op is not None:
    _forward_op = triton_op("torchrec_ftrl::triton_tbe_forward", _forward_impl, mutates_args=("warn",))
    _linearize_op = triton_op("torchrec_ftrl::triton_tbe_linearize", _linearize_impl,
                              mutates_args=("warn",))
    _backward_op = triton_op("torchrec_ftrl::triton_tbe_backward_update_", _backward_impl,
                             mutates_args=("weights", "accum", "linear", "nonfinite_rows"))
    _backward_cached_op = triton_op("torchrec_ftrl::triton_tbe_backward_update_cached_",
                                    _backward_cached_impl,
                                    mutates_args=("weights", "accum", "linear", "nonfinite_rows",
                                                  "cache_weights", "cache_accum", "cache_linear"))
    _repair_offsets_op = triton_op("torchrec_ftrl::triton_repair_offsets", _repair_offsets_impl,
                                   mutates_args=("warn",))
else:  # pragma: no cover
    _forward_op, _backward_op, _repair_offsets_op = _forward_impl, _backward_impl, _repair_offsets_impl
    _backward_cached_op = _backward_cached_impl
    _linearize_op = _linearize_impl


class TritonContext(NamedTuple):
    """What a training forward keeps for its backward: the offsets it read (repaired by the fused
    WARNING check where the batch was raw) and the linearised batch ``(key, gofs, scale, tid)``."""

    offsets: torch.Tensor
    linearized: tuple


def fuses_bounds_check(mode: Any, needs_psw_grad: bool) -> bool:
    """The kernels check a raw batch themselves (no host sync): WARNING, except when the per-sample
    weights need a gradient (that gradient, :func:`per_sample_weight_grad`, reads a checked batch),
    and FATAL (the TBE reads the count once after the forward and raises before any update)."""
    return (mode == BoundsCheckMode.WARNING and not needs_psw_grad) or mode == BoundsCheckMode.FATAL


def count_invalid(table_rows, feature_table, bag_feature, indices, offsets) -> Optional[int]:
    """No fast FATAL check here: the TBE's own check runs."""
    return None


def _warn_counter(batch: TBEBatch) -> tuple[bool, torch.Tensor]:
    """``(check, counter)``: whether the fused WARNING check runs, and its int64 counter (an empty
    placeholder when it does not)."""
    counter = batch.unchecked_counter
    return counter is not None, counter if counter is not None else batch.indices.new_empty(0)


def _batch_shape(batch: TBEBatch) -> tuple[Optional[int], int, bool]:
    """``(total_rows, vec, even_d)``: the host-side facts the kernels are specialised on
    (``total_rows`` None for a batch without row counts, which only a lookup reads)."""
    vec, even_d = _vec_even(batch.table_dims, _block_d(batch.max_D))
    return None if batch.total_rows is None else int(batch.total_rows), vec, even_d


def _lookup(arrays: TableArrays, batch: TBEBatch, offsets: torch.Tensor, out_dtype: torch.dtype,
            keys: Optional[torch.Tensor], counter: tuple, shape: tuple,
            hp: FTRLHyperparams) -> torch.Tensor:
    """The pooled lookup over ``offsets`` (checked or repaired); ``counter`` / ``shape``:
    :func:`_warn_counter` / :func:`_batch_shape` of the batch. A batch without row counts
    (``table_rows`` None: the ``tbe_forward`` op's) is a checked one, whose lookup reads none."""
    check, warn = counter
    _, vec, even_d = shape
    table_rows = batch.table_dim if batch.table_rows is None else batch.table_rows   # unread if None
    return _call(_forward_op, _forward_impl, arrays.weights, arrays.linear, arrays.accum,
                 arrays.rowwise, batch.indices, offsets,
                 batch.bag_feature, batch.bag_out_offset, batch.feature_table, batch.table_w_offset,
                 batch.table_dim, table_rows, batch.table_row_base, warn, check, keys,
                 batch.per_sample_weights, int(batch.pooling_mode), int(batch.out_numel),
                 int(batch.max_D), out_dtype, vec, even_d, batch.cache_locations, batch.cache_weights,
                 *(batch.cache_states if batch.cache_states is not None else (None, None)),
                 knob_tensor(hp, batch.indices.device), *knob_flags(hp)[:1])


def _checked_offsets(batch: TBEBatch, warn: Optional[torch.Tensor]) -> torch.Tensor:
    """``batch.offsets``, repaired (and the repairs counted in ``warn``) if the batch is raw."""
    if batch.unchecked_counter is None:
        return batch.offsets
    return repair_offsets(batch.offsets, batch.indices.numel(), warn)


def _check_layout(arrays: TableArrays, batch: TBEBatch) -> None:
    """Return when the kernels implement ``arrays``' row layout for a ``batch`` of the cached
    placement (``CAPABILITIES.cached_layouts``; uncached, every layout).

    Raises:
        ValueError: a layout outside ``CAPABILITIES.cached_layouts`` with a cached batch
            (``batch.cache_locations`` set, the ``fused_uvm_caching`` placement).
    """
    layout = arrays.layout_key
    if batch.cache_locations is not None and layout not in CAPABILITIES.cached_layouts:
        raise ValueError(f"the Triton FTRL kernels run the cached placement (fused_uvm_caching) with "
                         f"layouts {sorted(CAPABILITIES.cached_layouts)} only, got "
                         f"ftrl_weights={layout[0]!r}, ftrl_accumulator={layout[1]!r}")


def forward(arrays: TableArrays, batch: TBEBatch, out_dtype: torch.dtype,
            hp: FTRLHyperparams) -> torch.Tensor:
    """Pooled lookup. Returns the flat output ``[batch.out_numel]`` in ``out_dtype`` (fp32 accumulation).
    For a raw batch (the fused WARNING check), the offsets are repaired first and out-of-range
    indices are read as row 0; both are counted in ``batch.unchecked_counter``. Derived weights
    (``arrays.weights`` None) are ``prox(linear, accum)`` with ``hp``, computed per looked-up element.

    Raises:
        ValueError: a layout outside ``CAPABILITIES.cached_layouts`` with a cached batch
            (:func:`_check_layout`).
    """
    _check_layout(arrays, batch)
    counter = _warn_counter(batch)
    offsets = _checked_offsets(batch, counter[1])
    return _lookup(arrays, batch, offsets, out_dtype, None, counter, _batch_shape(batch), hp)


def forward_train(arrays: TableArrays, batch: TBEBatch, out_dtype: torch.dtype,
                  hp: FTRLHyperparams) -> tuple[torch.Tensor, TritonContext]:
    """The forward of a training step (its backward follows): same output as :func:`forward`.

    Linearises the batch first (:func:`.triton_backward.linearize_kernel`: each index's row key
    ``row_base[table] + index``, with the fused WARNING bounds check and its count, its gradient
    offset, factor and table; raw offsets repaired in the same pass) and returns it in the context
    for :func:`backward_update_`; the lookup then reads the checked row keys (32-bit when the tables
    have fewer than 2**31 rows) instead of checking every index again.
    """
    _check_layout(arrays, batch)
    counter, shape = _warn_counter(batch), _batch_shape(batch)
    (check, warn), (total_rows, _, even_d) = counter, shape
    lin = _call(_linearize_op, _linearize_impl, batch.indices, batch.offsets, batch.bag_feature,
                batch.bag_out_offset, batch.feature_table, batch.table_row_base, batch.table_rows,
                warn, check, True, check, batch.per_sample_weights, int(batch.pooling_mode),
                int(batch.max_D), total_rows, int(batch.out_numel), even_d)
    offsets = lin[4] if check else batch.offsets
    out = _lookup(arrays, batch, offsets, out_dtype, lin[0], counter, shape, hp)
    return out, TritonContext(offsets, tuple(lin[:4]))


def backward_update_(arrays: TableArrays, batch: TBEBatch, ctx: Optional[TritonContext],
                     grad_out: torch.Tensor, hp: FTRLHyperparams, nonfinite_rows: torch.Tensor) -> None:
    """Sum gradients per unique (table, row), then one FTRL update per touched row, in place.

    ``grad_out`` is the flat ``[batch.out_numel]`` output gradient (fp32/fp16/bf16). Rows whose summed
    gradient has NaN/Inf are skipped and counted in ``nonfinite_rows`` (int64 ``[1]``, device). Reuses
    the linearised batch of ``ctx`` (from :func:`forward_train`); without it the batch is linearised
    here, and a raw batch's repairs are not counted again (its forward counted them).
    ``accum`` / ``linear`` fp32 or bf16; a bf16 state is stored with stochastic rounding by the step
    ``batch.step`` (int64 ``[1]``, read on the device). Every row layout of ``arrays``: derived
    weights (the old weight ``prox(linear, accum)``; only ``accum`` and ``linear`` are written), a
    row-wise ``accum`` (``[total_rows]``: ``n += mean_d(g_d^2)`` once per row, a bf16 one rounded
    with column 0), uncached and cached.

    Raises:
        ValueError: a bf16 state and ``batch.step`` None; a layout outside
            ``CAPABILITIES.cached_layouts`` with a cached batch.
    """
    _check_layout(arrays, batch)
    weights, accum, linear = arrays.weights, arrays.accum, arrays.linear
    step = batch.step
    if step is None:
        if accum.dtype == torch.bfloat16 or linear.dtype == torch.bfloat16:
            raise ValueError("a bf16 optimizer state needs batch.step (the TBE's iter) for its "
                             "stochastic rounding, got None")
        step = batch.table_row_base   # int64 placeholder (read-only): fp32 kernels never read it
    if ctx is None:
        # No training forward ran: linearise here. A raw batch's repairs were counted by its forward,
        # so this repair counts into a scratch counter.
        raw = batch.unchecked_counter is not None
        offsets = _checked_offsets(batch, torch.zeros_like(batch.unchecked_counter) if raw else None)
        lin = (None,) * 4
    else:
        offsets, lin = ctx
    total_rows, vec, even_d = _batch_shape(batch)
    args = (grad_out.reshape(-1).contiguous(), batch.indices, offsets, batch.bag_feature,
            batch.bag_out_offset, batch.feature_table, batch.table_w_offset, batch.table_dim,
            batch.table_rows, batch.table_row_base, batch.unchecked_counter is not None, *lin,
            batch.per_sample_weights, int(batch.pooling_mode), int(batch.max_D), total_rows,
            vec, even_d, knob_tensor(hp, linear.device), *knob_flags(hp), step)
    if batch.cache_locations is None:
        _call(_backward_op, _backward_impl, weights, accum, linear, nonfinite_rows, arrays.rowwise,
              *args)
    else:
        _call(_backward_cached_op, _backward_cached_impl, weights, accum, linear, nonfinite_rows,
              arrays.rowwise, batch.cache_weights, batch.cache_states[0], batch.cache_states[1],
              batch.cache_locations, *args)


def repair_offsets(offsets: torch.Tensor, num_indices: int, warn: torch.Tensor) -> torch.Tensor:
    """Device-side ``BoundsCheckMode.WARNING`` repair of FBGEMM-layout offsets, no host sync.

    Args:
        offsets: int64 (or int32) ``[num_bags + 1]`` on the device.
        num_indices: ``indices.numel()`` (N).
        warn: int64 ``[1]`` counter; the number of entries changed is added to it.

    Returns a new tensor like ``offsets``: ``cummax(clamp(offsets, 0, N))`` with the first entry 0
    and the last N; with zero bags (one entry) ``[0]``. The same repair as the PyTorch path of
    ``FTRLTableBatchedEmbeddingBags``; one pass over tiles of ``TUNING["repair_block"]`` bags.
    """
    return _call(_repair_offsets_op, _repair_offsets_impl, offsets, warn, int(num_indices))
