"""The planner for FTRL tables: FTRL state in the storage estimate, and no data-parallel options.

Stock TorchRec counts optimizer state as ``weight bytes x _get_optimizer_multipler(cls)``, reading
``cls`` only from a tensor's in-backward ``_optimizer_classes``: 0 x for tables whose optimizer comes
from a sharder's ``fused_params`` and 1 x for an unknown class, so it undercounts FTRL. And it may plan
a small in-backward FTRL table data-parallel, where the table is a dense DDP parameter that FTRL never
trains. TorchRec's extension points are the enumerator and its estimator list:

* :class:`FTRLStorageEstimator` is TorchRec's ``EmbeddingStorageEstimator`` with the FTRL state
  counted exactly;
* :class:`FTRLEnumerator` is TorchRec's ``EmbeddingEnumerator`` that estimates storage with it and
  offers no data-parallel option for FTRL tables;
* :func:`ftrl_planner` builds an ``EmbeddingShardingPlanner`` with that enumerator.

DMP's default planner (``plan=None``) takes no enumerator: the patch list (:mod:`.patches`) makes
``EmbeddingShardingPlanner`` build an :class:`FTRLEnumerator` by default.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Optional

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.constants import BATCH_SIZE, UVM_CACHING_RATIO
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.utils import sharder_name
from torchrec.distributed.types import ShardingType

from ..optim_type import is_ftrl

STATE_BYTES_PER_ELEMENT = 8   # accum + linear, fp32 each, whatever the weight dtype

_DDR_KERNELS = (EmbeddingComputeKernel.FUSED_UVM.value,)
_CACHED_KERNELS = (EmbeddingComputeKernel.FUSED_UVM_CACHING.value,)


def _fused_params(option, sharder_map) -> dict:
    """The ``fused_params`` of the sharder planning ``option`` (torchrec 1.6: a sharder map keyed by
    sharder name; 1.7+: a ``SharderData`` map keyed by ``module_type_key``)."""
    if not sharder_map:
        return {}
    key = getattr(option, "module_type_key", None)
    if key is None:
        key = sharder_name(type(option.module[1]))
    return getattr(sharder_map.get(key), "fused_params", None) or {}


def is_ftrl_option(option, sharder_map) -> bool:
    """Whether the table of ``option`` is trained by FTRL: its in-backward optimizer class, else its
    sharder's ``fused_params["optimizer"]``."""
    classes = getattr(option.tensor, "_optimizer_classes", None)
    if classes and classes[0] is not None:
        return is_ftrl(classes[0])
    return is_ftrl(_fused_params(option, sharder_map).get("optimizer"))


class FTRLStorageEstimator(EmbeddingStorageEstimator):
    """``EmbeddingStorageEstimator`` that counts an FTRL shard's state as 8 bytes per element (accum and
    linear, fp32) where its weights live: HBM for ``fused`` on CUDA, DDR for ``fused`` on CPU and for
    ``fused_uvm``, DDR plus the cached share in HBM for ``fused_uvm_caching``. Other tables get
    TorchRec's estimate unchanged. Constructor arguments: TorchRec's."""

    def estimate(self, sharding_options: list, *args: Any, **kwargs: Any) -> None:
        sharder_map = args[0] if args else next(iter(kwargs.values()), None)
        ftrl_options = [so for so in sharding_options if is_ftrl_option(so, sharder_map)]
        # Stock estimate of the weights alone (no optimizer class: 0 x), then the exact FTRL state.
        saved = {}
        for so in ftrl_options:
            if id(so.tensor) not in saved:
                saved[id(so.tensor)] = (so.tensor, getattr(so.tensor, "_optimizer_classes", None))
                so.tensor._optimizer_classes = [None]
        try:
            super().estimate(sharding_options, *args, **kwargs)
        finally:
            for tensor, classes in saved.values():
                if classes is None:
                    del tensor._optimizer_classes
                else:
                    tensor._optimizer_classes = classes
        device = self._topology.compute_device
        for so in ftrl_options:
            kernel = so.compute_kernel
            ratio = so.cache_load_factor or _fused_params(so, sharder_map).get("cache_load_factor") \
                or UVM_CACHING_RATIO
            for shard in so.shards:
                state = STATE_BYTES_PER_ELEMENT * shard.size[0] * shard.size[1]
                if kernel in _CACHED_KERNELS:
                    shard.storage.ddr += state
                    shard.storage.hbm += round(state * ratio)
                elif kernel in _DDR_KERNELS or device not in ("cuda", "mtia"):
                    shard.storage.ddr += state
                else:
                    shard.storage.hbm += state


_ENUMERATOR_SIGNATURE = inspect.signature(EmbeddingEnumerator.__init__)


class FTRLEnumerator(EmbeddingEnumerator):
    """``EmbeddingEnumerator`` for models with FTRL tables: TorchRec's estimators with the storage
    estimator replaced by :class:`FTRLStorageEstimator`, and no ``data_parallel`` sharding option for
    an FTRL table (in backward or by ``fused_params``). A table left with no option makes the planner
    raise, naming it. Constructor arguments: TorchRec's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        given = _ENUMERATOR_SIGNATURE.bind(self, *args, **kwargs).arguments
        self._estimators = [
            FTRLStorageEstimator(topology=given["topology"], constraints=given.get("constraints"))
            if type(e) is EmbeddingStorageEstimator else e for e in self._estimators]

    def enumerate(self, module, sharders) -> list:
        options = super().enumerate(module, sharders)
        sharder_map = getattr(self, "_sharder_data_map", None) or getattr(self, "_sharder_map", None)
        dp = ShardingType.DATA_PARALLEL.value
        kept = [so for so in options if not (so.sharding_type == dp and is_ftrl_option(so, sharder_map))]
        if len(kept) != len(options):
            options[:] = kept
            if getattr(self, "_last_stored_search_space", None) is not None:
                self._last_stored_search_space = copy.deepcopy(kept)
        return options


def ftrl_planner(topology, constraints: Optional[dict] = None, batch_size: Optional[int] = None,
                 **kwargs: Any):
    """An ``EmbeddingShardingPlanner`` for ``topology`` whose enumerator is :class:`FTRLEnumerator`
    (storage by :class:`FTRLStorageEstimator`, performance by TorchRec's ``EmbeddingPerfEstimator``;
    no data-parallel option for FTRL tables).

    Args:
        topology: the planner ``Topology``. constraints: ``ParameterConstraints`` per table.
        batch_size: per-rank batch size (TorchRec's default if None).
        kwargs: other ``EmbeddingShardingPlanner`` arguments (``storage_reservation``, ...).
    """
    batch_size = BATCH_SIZE if batch_size is None else batch_size
    enumerator = FTRLEnumerator(topology=topology, batch_size=batch_size, constraints=constraints)
    return EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, enumerator=enumerator,
                                    constraints=constraints, **kwargs)
