"""Where an FTRL TBE keeps its rows (FBGEMM ``EmbeddingLocation``), and the bytes each placement costs.

* ``DEVICE`` (TorchRec compute kernel ``fused`` on CUDA) and ``HOST`` (``fused`` on CPU): weights,
  ``accum`` and ``linear`` in three flat buffers on the tables' device.
* ``MANAGED`` (``fused_uvm``): the same three buffers in unified memory (FBGEMM's
  ``new_unified_tensor``; host-mapped with ``uvm_host_mapped=True``), read and written in place by the
  same kernels. Host memory holds the table; the GPU reaches it over PCIe / NVLink-C2C.
* ``MANAGED_CACHING`` (``fused_uvm_caching``): the same three buffers in unified memory, and an HBM
  cache of whole rows: FBGEMM's weight cache (``lxu_cache_weights``, ``[slots, max_D]`` in the cache
  precision) managed by FBGEMM's cache ops (``linearize_cache_indices``, ``lru_cache_populate`` /
  ``lfu_cache_populate``, ``lxu_cache_lookup``, ``lxu_cache_flush``), and beside it a state cache
  (``accum`` and ``linear``, ``[slots, max_D]`` each in its state's dtype, fp32 or bf16; a row-wise
  ``accum`` ``[slots, 1]``) that follows every slot FBGEMM fills or evicts. A slot holds the arrays
  of the row layout only: with derived weights there is no weight cache (FBGEMM's ops place and
  evict rows of zero width, and the state cache moves ``linear`` and ``accum``). A cached row's weight and both states are updated in the cache and written back when
  evicted or flushed; a lookup the cache could not take (a batch with more unique rows than a cache
  set holds) reads and updates the unified-memory row in place.

The planner (:mod:`torchrec_ftrl.integration.planner`) and the TBE (:mod:`torchrec_ftrl.tbe`) both size
these buffers from the functions below, so the plan and the allocation agree.
"""

from __future__ import annotations

from typing import Any

from ..fbgemm_enums import CacheAlgorithm, EmbeddingLocation
from ..row_layout import RowLayout

# FBGEMM's cache associativity on CUDA (``DEFAULT_ASSOC`` of its training TBE): rows per cache set.
CACHE_ASSOC = 32
# What a row stores when nothing else is said: weight, accum and linear, fp32 states.
DEFAULT_LAYOUT = RowLayout()
# FBGEMM's cache ops move rows 4 elements at a time: a cached table's dim is a multiple of this.
CACHE_DIM_MULTIPLE = 4

PLACEMENTS = (EmbeddingLocation.DEVICE, EmbeddingLocation.HOST, EmbeddingLocation.MANAGED,
              EmbeddingLocation.MANAGED_CACHING)


def cache_slots(cached_rows: int, load_factor: float, cache_sets: int = 0) -> int:
    """Rows the HBM cache holds for ``cached_rows`` rows: FBGEMM's sizing, ``cache_sets`` sets of
    :data:`CACHE_ASSOC` rows, ``cache_sets = ceil(cached_rows * load_factor / CACHE_ASSOC)`` (at least
    1) unless given.

    Raises:
        ValueError: see :func:`check_cache_options`.
    """
    check_cache_options(load_factor, cache_sets)
    if cache_sets == 0:
        cache_sets = max(1, (int(cached_rows * float(load_factor)) + CACHE_ASSOC - 1) // CACHE_ASSOC)
    return cache_sets * CACHE_ASSOC


def check_cache_options(load_factor: Any = 0.2, cache_sets: Any = 0,
                        algorithm: Any = CacheAlgorithm.LRU, prefetch_pipeline: Any = False,
                        where: str = "") -> CacheAlgorithm:
    """Validate the ``MANAGED_CACHING`` cache settings; returns the ``CacheAlgorithm``. The load
    factor only counts (and is only checked) when ``cache_sets`` is 0, as in FBGEMM.

    Raises:
        ValueError: ``cache_sets`` not an int >= 0, ``load_factor`` not a number in ``(0, 1]``,
            ``algorithm`` not LRU / LFU, or ``prefetch_pipeline`` with LFU (FBGEMM locks cache lines
            for LRU only); the message names the setting, its value and ``where`` it came from.
    """
    at = f" ({where})" if where else ""
    if isinstance(cache_sets, bool) or not isinstance(cache_sets, int) or cache_sets < 0:
        raise ValueError(f"cache_sets must be an int >= 0, got {cache_sets!r}{at}")
    if cache_sets == 0 and (isinstance(load_factor, bool) or not isinstance(load_factor, (int, float))
                            or not 0.0 < float(load_factor) <= 1.0):
        raise ValueError(f"cache_load_factor must be a number in (0, 1], got {load_factor!r}{at}")
    try:
        algorithm = CacheAlgorithm(algorithm)
    except ValueError:
        raise ValueError(f"cache_algorithm must be CacheAlgorithm.LRU or LFU, got {algorithm!r}{at}")
    if prefetch_pipeline and algorithm != CacheAlgorithm.LRU:
        raise ValueError(f"prefetch_pipeline=True needs cache_algorithm=CacheAlgorithm.LRU (FBGEMM "
                         f"locks cache lines only for LRU), got {algorithm!r}{at}")
    return algorithm


def check_cache_dims(dims) -> None:
    """Raises ValueError unless every dim is a multiple of :data:`CACHE_DIM_MULTIPLE` (FBGEMM's cache
    ops move rows that many elements at a time), naming the dims."""
    if any(int(d) % CACHE_DIM_MULTIPLE for d in dims):
        raise ValueError(f"MANAGED_CACHING (fused_uvm_caching) needs every table dim to be a multiple "
                         f"of {CACHE_DIM_MULTIPLE} (FBGEMM's cache ops move rows {CACHE_DIM_MULTIPLE} "
                         f"elements at a time), got dims {[int(d) for d in dims]}")


def table_bytes(rows: int, dim: int, weight_bytes: int, location: EmbeddingLocation,
                layout: RowLayout = DEFAULT_LAYOUT) -> int:
    """Bytes of one table's weights and FTRL state where the table itself lives (every placement: the
    device for ``DEVICE`` / ``HOST``, unified host memory for ``MANAGED`` and ``MANAGED_CACHING``):
    ``rows`` rows of what ``layout`` stores (:meth:`RowLayout.bytes_per_row`; 1,536 bytes at D = 128
    with fp32 weights and states). The cache is :func:`cache_bytes`."""
    return rows * layout.bytes_per_row(dim, weight_bytes)


def cache_bytes(cached_rows: int, max_dim: int, slots: int, lfu: bool = False,
                cache_weight_bytes: int = 4, lock_lines: bool = False,
                layout: RowLayout = DEFAULT_LAYOUT) -> int:
    """HBM bytes of a ``MANAGED_CACHING`` TBE's cache: ``slots`` rows of what ``layout`` stores at
    ``max_dim`` (weights of ``cache_weight_bytes`` each: the cache precision; the states in their
    dtypes), FBGEMM's
    per-slot state (``lxu_cache_state`` int64 and, for LRU, ``lru_state`` int64), the state cache's
    per-slot int64 snapshot and claim stamp, with ``lock_lines`` (``prefetch_pipeline``) FBGEMM's
    int32 locking counter, and per-row arrays (``cache_index_table_map`` int32; for LFU, the
    ``lfu_state`` int64 counters of every row). A TBE sizes one cache for all its tables, at the
    largest dim ``max_dim``."""
    per_slot = (layout.bytes_per_row(max_dim, cache_weight_bytes) + 24 + (0 if lfu else 8)
                + (4 if lock_lines else 0))
    per_row = 4 + (8 if lfu else 0)
    return slots * per_slot + cached_rows * per_row
