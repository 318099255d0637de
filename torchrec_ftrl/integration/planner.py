"""The planner for FTRL tables: FTRL's exact storage per compute kernel, no data-parallel options.

Stock TorchRec counts a shard's tensor storage as its weight bytes plus optimizer state
``weight bytes x _get_optimizer_multipler(cls)``, reading ``cls`` only from a tensor's in-backward
``_optimizer_classes`` (0 x for tables whose optimizer comes from a sharder's ``fused_params``, 1 x for
an unknown class), and sizes a ``fused_uvm_caching`` cache as ``cache_load_factor`` x the weight
bytes. The FTRL TBE stores something else (:mod:`torchrec_ftrl.tbe.placement`): weights plus 8 bytes of
state per element where the table lives (4 with bf16 ``accum`` and ``linear``: ``optimizer_state_dtypes``
/ ``state_dtype``), and for ``fused_uvm_caching`` an HBM cache of whole rows
(weight, ``accum`` and ``linear``) with FBGEMM's cache state. And stock TorchRec may plan a small
in-backward FTRL table data-parallel, where the table is a dense DDP parameter that FTRL never
trains, or on a key-value kernel. TorchRec's extension points are the enumerator and its estimator
list:

* :class:`FTRLStorageEstimator` is TorchRec's ``EmbeddingStorageEstimator`` whose FTRL shards get
  the bytes of :func:`ftrl_shard_storage` in place of TorchRec's tensor estimate (TorchRec's other
  storage, the input / output / pipeline buffers, is kept);
* :class:`FTRLEnumerator` is TorchRec's ``EmbeddingEnumerator`` that estimates storage with it and
  offers FTRL tables only the FTRL compute kernels and no data-parallel option;
* :func:`ftrl_planner` builds an ``EmbeddingShardingPlanner`` with that enumerator.

DMP's default planner (``plan=None``) takes no enumerator: the patch list (:mod:`.patches`) makes
``EmbeddingShardingPlanner`` build an :class:`FTRLEnumerator` by default.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Optional

from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm, EmbeddingLocation
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner import shard_estimators
from torchrec.distributed.planner.constants import BATCH_SIZE, UVM_CACHING_RATIO
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.utils import sharder_name
from torchrec.distributed.types import ShardingType, compute_storage_usage

from ..optim_type import is_ftrl
from ..tbe.placement import (CACHE_DIM_MULTIPLE, DEFAULT_LAYOUT, cache_bytes, cache_slots,
                         check_cache_options, table_bytes)
from ..row_layout import CACHED_LAYOUTS, LAYOUT_KEYS, RowLayout
from ..state_dtype import OPTIMIZER_STATE_DTYPES, STATE_DTYPE
from .compute_kernels import FTRL_COMPUTE_KERNELS

_FUSED = EmbeddingComputeKernel.FUSED.value
_UVM = EmbeddingComputeKernel.FUSED_UVM.value
_UVM_CACHING = EmbeddingComputeKernel.FUSED_UVM_CACHING.value
_ACCELERATORS = ("cuda", "mtia")   # compute devices whose tensors TorchRec counts in HBM


def ftrl_shard_storage(rows: int, cols: int, weight_bytes: int, compute_kernel: str, compute_device: str,
                       load_factor: float = UVM_CACHING_RATIO, lfu: bool = False,
                       cache_sets: int = 0, lock_lines: bool = False,
                       layout: RowLayout = DEFAULT_LAYOUT) -> tuple[int, int]:
    """``(hbm, ddr)`` bytes of one FTRL shard of ``rows x cols``: each row what ``layout`` stores
    (:meth:`~torchrec_ftrl.row_layout.RowLayout.bytes_per_row`, weights of ``weight_bytes`` bytes per
    element), and any cache, as :mod:`torchrec_ftrl.tbe.placement` sizes them (the cache holds the rows'
    arrays in their stored dtypes):

    * ``fused`` on CUDA: HBM ``table_bytes(DEVICE)``; any kernel on another compute device: DDR
      ``table_bytes(HOST)`` (TorchRec builds every CPU table in host memory);
    * ``fused_uvm``: DDR ``table_bytes(MANAGED)``, nothing in HBM;
    * ``fused_uvm_caching``: DDR ``table_bytes(MANAGED_CACHING)`` and HBM ``cache_bytes`` of
      ``cache_slots(rows, load_factor, cache_sets)`` slots in the weights' precision (the FTRL
      cache's precision), with LFU or LRU state. A TBE sizes one cache for all its tables, ``max_D``
      wide: per shard this is exact for a TBE of one shard, an upper bound (by less than one cache
      set per shard) for a TBE of several shards of one dim, and short of the TBE's cache when a
      narrower table shares a TBE with a wider one.

    Raises:
        ValueError: a compute kernel that is not an FTRL kernel, or a bad ``load_factor`` /
            ``cache_sets`` (:func:`torchrec_ftrl.tbe.placement.cache_slots`).
    """
    if compute_kernel not in FTRL_COMPUTE_KERNELS:
        raise ValueError(f"FTRL has no compute kernel {compute_kernel!r}; expected one of "
                         f"{list(FTRL_COMPUTE_KERNELS)}")
    if compute_device not in _ACCELERATORS:
        return 0, table_bytes(rows, cols, weight_bytes, EmbeddingLocation.HOST, layout)
    if compute_kernel == _FUSED:
        return table_bytes(rows, cols, weight_bytes, EmbeddingLocation.DEVICE, layout), 0
    if compute_kernel == _UVM:
        return 0, table_bytes(rows, cols, weight_bytes, EmbeddingLocation.MANAGED, layout)
    slots = cache_slots(rows, load_factor, cache_sets)
    return (cache_bytes(rows, cols, slots, lfu, cache_weight_bytes=weight_bytes, lock_lines=lock_lines,
                        layout=layout),
            table_bytes(rows, cols, weight_bytes, EmbeddingLocation.MANAGED_CACHING, layout))


def _sharder_entry(option, sharder_map):
    """What the estimator's map holds for the sharder of ``option``: the sharder itself (torchrec 1.6,
    keyed by sharder name) or its ``SharderData`` (1.7+, keyed by ``module_type_key``); None without a
    map."""
    if not sharder_map:
        return None
    key = getattr(option, "module_type_key", None)
    if key is None:
        key = sharder_name(type(option.module[1]))
    return sharder_map.get(key)


def _fused_params(option, sharder_map) -> dict:
    """The ``fused_params`` of the sharder planning ``option`` (empty if none)."""
    return getattr(_sharder_entry(option, sharder_map), "fused_params", None) or {}


def is_ftrl_option(option, sharder_map) -> bool:
    """Whether the table of ``option`` is trained by FTRL: its in-backward optimizer class, else its
    sharder's ``fused_params["optimizer"]``."""
    classes = getattr(option.tensor, "_optimizer_classes", None)
    if classes and classes[0] is not None:
        return is_ftrl(classes[0])
    return is_ftrl(_fused_params(option, sharder_map).get("optimizer"))


def option_row_layout(option, fused_params: dict) -> RowLayout:
    """What a row of the FTRL table of ``option`` stores: its sharder's ``fused_params``
    (``optimizer_state_dtypes`` / ``state_dtype``, ``ftrl_weights``, ``ftrl_accumulator``) with the
    state dtype overridden by its in-backward FTRL kwargs, as TorchRec merges them
    (``merge_fused_params``); :meth:`~torchrec_ftrl.row_layout.RowLayout.from_options` reads them.

    Raises:
        ValueError: an invalid state dtype, naming the table, the key and the value.
    """
    merged = dict(fused_params)
    # Only in-backward optimizers leave kwargs on a tensor, and an FTRL option's is FTRL (its class is
    # hidden from TorchRec's estimate while this runs: FTRLStorageEstimator.estimate).
    kwargs = getattr(option.tensor, "_optimizer_kwargs", None)
    if kwargs:
        in_backward = kwargs[0] or {}
        dtype_keys = (STATE_DTYPE, OPTIMIZER_STATE_DTYPES)
        if any(in_backward.get(k) is not None for k in dtype_keys):
            for k in dtype_keys:
                merged.pop(k, None)
            merged.update({k: v for k, v in in_backward.items() if k in dtype_keys})
        merged.update({k: in_backward[k] for k in LAYOUT_KEYS if in_backward.get(k) is not None})
    return RowLayout.from_options(merged, where=f"table {option.name!r} fused_params")


def _load_factor(option, fused_params: dict) -> float:
    """The cache load factor TorchRec plans ``option`` with: its ``cache_params.load_factor``, else the
    sharder's ``fused_params["cache_load_factor"]``, else ``UVM_CACHING_RATIO`` (TorchRec's chain in
    ``EmbeddingStorageEstimator.estimate``)."""
    return option.cache_load_factor or fused_params.get("cache_load_factor") or UVM_CACHING_RATIO


def _prefetch_pipeline(option, fused_params: dict) -> bool:
    """Whether ``option``'s cache locks prefetched lines: its ``cache_params.prefetch_pipeline``, else
    the sharder's ``fused_params["prefetch_pipeline"]``."""
    value = getattr(getattr(option, "cache_params", None), "prefetch_pipeline", None)
    return bool(fused_params.get("prefetch_pipeline") if value is None else value)


def _is_lfu(option, fused_params: dict) -> bool:
    """Whether ``option``'s cache is LFU: its ``cache_params.algorithm``, else the sharder's
    ``fused_params["cache_algorithm"]``, else FBGEMM's default LRU."""
    algorithm = getattr(getattr(option, "cache_params", None), "algorithm", None)
    if algorithm is None:
        algorithm = fused_params.get("cache_algorithm")
    return algorithm is not None and CacheAlgorithm(algorithm) == CacheAlgorithm.LFU


def _stock_tensor_storage(option, entry, compute_device: str, load_factor: float,
                          is_inference: bool) -> list[tuple[int, int]]:
    """``(hbm, ddr)`` bytes per shard that TorchRec's ``calculate_shard_storages`` counts for the tensor
    of ``option`` with no optimizer state: the sharder's storage usage of the tensor, HBM replaced by
    ``round(ddr x load_factor)`` for ``fused_uvm_caching``, split over the shards by
    ``_calculate_storage_specific_sizes`` (which adds the cache's auxiliary state). HBM counts only on
    an accelerator, as there. The rest of TorchRec's estimate (input / output / pipeline buffers) is
    not part of it."""
    tensor, kernel = option.tensor, option.compute_kernel
    if hasattr(entry, "storage_usage"):
        usage = entry.storage_usage(tensor, compute_device, kernel)
    else:
        usage = compute_storage_usage(tensor, compute_device, kernel, entry.storage_usage_type)
    hbm, ddr = usage.get("hbm", 0), usage.get("ddr", 0)
    cached = kernel == _UVM_CACHING
    if cached:
        hbm = round(ddr * load_factor)
    common = dict(shape=tensor.shape, shard_sizes=[shard.size for shard in option.shards],
                  sharding_type=option.sharding_type, optimizer_class=None, is_inference=is_inference)
    hbm_sizes = shard_estimators._calculate_storage_specific_sizes(
        storage=hbm, clf=load_factor if cached else None, **common)
    ddr_sizes = shard_estimators._calculate_storage_specific_sizes(storage=ddr, **common)
    if compute_device not in _ACCELERATORS:
        hbm_sizes = [0] * len(hbm_sizes)
    return list(zip(hbm_sizes, ddr_sizes))


class FTRLStorageEstimator(EmbeddingStorageEstimator):
    """``EmbeddingStorageEstimator`` whose FTRL shards get :func:`ftrl_shard_storage` in place of
    TorchRec's tensor estimate (weights, optimizer state, cache); TorchRec's input / output /
    pipeline buffers stay. Other tables get TorchRec's estimate unchanged. The cache of a
    ``fused_uvm_caching`` shard is sized with TorchRec's load factor (the option's
    ``cache_params.load_factor``, the sharder's ``cache_load_factor``, else ``UVM_CACHING_RATIO``),
    the sharder's ``cache_sets`` and the cache algorithm (LFU keeps an 8-byte counter per row).
    Constructor arguments: TorchRec's."""

    def estimate(self, sharding_options: list, *args: Any, **kwargs: Any) -> None:
        sharder_map = args[0] if args else next(iter(kwargs.values()), None)
        # Options with other kernels (data-parallel, key-value, ...) keep TorchRec's estimate: the
        # enumerator drops them for FTRL tables.
        ftrl_options = [so for so in sharding_options
                        if so.compute_kernel in FTRL_COMPUTE_KERNELS and is_ftrl_option(so, sharder_map)]
        # TorchRec's estimate with no optimizer class (0 x state); its tensor part is replaced below.
        saved = {}
        for so in ftrl_options:
            if id(so.tensor) not in saved:
                saved[id(so.tensor)] = (so.tensor, getattr(so.tensor, "_optimizer_classes", None))
                so.tensor._optimizer_classes = [None]
        try:
            super().estimate(sharding_options, *args, **kwargs)
            for so in ftrl_options:
                self._replace_tensor_storage(so, _sharder_entry(so, sharder_map))
        finally:
            for tensor, classes in saved.values():
                if classes is None:
                    del tensor._optimizer_classes
                else:
                    tensor._optimizer_classes = classes

    def _replace_tensor_storage(self, option, entry) -> None:
        """Each shard of ``option``: TorchRec's storage - TorchRec's tensor part + FTRL's bytes."""
        device = self._topology.compute_device
        fused_params = getattr(entry, "fused_params", None) or {}
        load_factor = _load_factor(option, fused_params)
        lfu = _is_lfu(option, fused_params)
        cache_sets = fused_params.get("cache_sets") or 0
        lock_lines = _prefetch_pipeline(option, fused_params)
        if option.compute_kernel == _UVM_CACHING:
            check_cache_options(load_factor, cache_sets,
                                CacheAlgorithm.LFU if lfu else CacheAlgorithm.LRU, lock_lines,
                                where=f"table {option.name!r}")
        stock = _stock_tensor_storage(option, entry, device, load_factor,
                                      getattr(self, "_is_inference", False))
        weight_bytes = option.tensor.element_size()
        layout = option_row_layout(option, fused_params)
        for shard, (stock_hbm, stock_ddr) in zip(option.shards, stock):
            hbm, ddr = ftrl_shard_storage(shard.size[0], shard.size[1], weight_bytes,
                                          option.compute_kernel, device, load_factor, lfu, cache_sets,
                                          lock_lines, layout)
            shard.storage.hbm += hbm - stock_hbm
            shard.storage.ddr += ddr - stock_ddr


_ENUMERATOR_SIGNATURE = inspect.signature(EmbeddingEnumerator.__init__)


def _not_for_ftrl(option, sharder_map) -> bool:
    """Whether ``option`` cannot train its table by FTRL: data-parallel, a compute kernel other than
    the FTRL kernels (key-value, SSD / DRAM virtual tables, ...), or ``fused_uvm_caching`` with a shard
    whose dim is not a multiple of 4 or a row layout the HBM cache does not hold
    (:data:`torchrec_ftrl.row_layout.CACHED_LAYOUTS`): the FTRL TBE refuses those."""
    if option.sharding_type == ShardingType.DATA_PARALLEL.value:
        return True
    if option.compute_kernel not in FTRL_COMPUTE_KERNELS:
        return True
    if option.compute_kernel != _UVM_CACHING:
        return False
    layout = option_row_layout(option, _fused_params(option, sharder_map))
    return (layout.weights, layout.accumulator) not in CACHED_LAYOUTS or any(
        shard.size[1] % CACHE_DIM_MULTIPLE for shard in option.shards)


class FTRLEnumerator(EmbeddingEnumerator):
    """``EmbeddingEnumerator`` for models with FTRL tables: TorchRec's estimators with the storage
    estimator replaced by :class:`FTRLStorageEstimator`, and for an FTRL table (in backward or by
    ``fused_params``) only options with an FTRL compute kernel (``fused``, ``fused_uvm``,
    ``fused_uvm_caching``; the last with shard dims that are multiples of 4 and a row layout the
    cache holds) and no
    ``data_parallel`` option. A table left with no option makes the planner raise, naming it.
    Constructor arguments: TorchRec's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        given = _ENUMERATOR_SIGNATURE.bind(self, *args, **kwargs).arguments
        self._estimators = [
            FTRLStorageEstimator(topology=given["topology"], constraints=given.get("constraints"))
            if type(e) is EmbeddingStorageEstimator else e for e in self._estimators]

    def enumerate(self, module, sharders) -> list:
        options = super().enumerate(module, sharders)
        sharder_map = getattr(self, "_sharder_data_map", None) or getattr(self, "_sharder_map", None)
        kept = [so for so in options
                if not (is_ftrl_option(so, sharder_map) and _not_for_ftrl(so, sharder_map))]
        if len(kept) != len(options):
            options[:] = kept
            if getattr(self, "_last_stored_search_space", None) is not None:
                self._last_stored_search_space = copy.deepcopy(kept)
        return options


def ftrl_planner(topology, constraints: Optional[dict] = None, batch_size: Optional[int] = None,
                 **kwargs: Any):
    """An ``EmbeddingShardingPlanner`` for ``topology`` whose enumerator is :class:`FTRLEnumerator`
    (storage by :class:`FTRLStorageEstimator`, performance by TorchRec's ``EmbeddingPerfEstimator``;
    FTRL tables get only FTRL compute kernels and no data-parallel option).

    Args:
        topology: the planner ``Topology``. constraints: ``ParameterConstraints`` per table.
        batch_size: per-rank batch size (TorchRec's default if None).
        kwargs: other ``EmbeddingShardingPlanner`` arguments (``storage_reservation``, ...).
    """
    batch_size = BATCH_SIZE if batch_size is None else batch_size
    enumerator = FTRLEnumerator(topology=topology, batch_size=batch_size, constraints=constraints)
    return EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, enumerator=enumerator,
                                    constraints=constraints, **kwargs)
