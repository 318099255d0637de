"""Sharders for DistributedModelParallel with FTRL tables.

With ``import torchrec_ftrl`` done, TorchRec's stock sharders already route FTRL groups to our kernel
(:mod:`.routing`). These subclasses add what a sharder itself decides: when
their ``fused_params`` select FTRL, the planner may only pick the ``fused`` compute kernel and never
plans a table data-parallel (a data-parallel table is a dense DDP parameter trained by whatever dense
optimizer the user runs, so FTRL would silently not apply). For data-parallel FTRL, use a stock sharder
with a manual plan and :class:`torchrec_ftrl.FTRL` as the dense optimizer.
"""

from __future__ import annotations

from typing import Any, Optional

from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ModuleSharder, ShardingType

from ..optim_type import is_ftrl
from .kernels import tbe_kwargs_from_fused_params

FTRL_COMPUTE_KERNELS = (EmbeddingComputeKernel.FUSED.value,)


class _FTRLKernelFilter:
    def _ftrl(self) -> bool:
        return is_ftrl((self.fused_params or {}).get("optimizer"))

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = super().sharding_types(compute_device_type)
        if self._ftrl():
            types = [t for t in types if t != ShardingType.DATA_PARALLEL.value]
        return types

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        kernels = super().compute_kernels(sharding_type, compute_device_type)
        if self._ftrl():
            kernels = [k for k in kernels if k in FTRL_COMPUTE_KERNELS]
        return kernels


class FTRLEmbeddingBagCollectionSharder(_FTRLKernelFilter, EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` whose FTRL tables use the fused FTRL TBE."""


class FTRLEmbeddingCollectionSharder(_FTRLKernelFilter, EmbeddingCollectionSharder):
    """``EmbeddingCollectionSharder`` whose FTRL tables use the fused FTRL TBE (PoolingMode.NONE)."""


def sharders(fused_params: Optional[dict[str, Any]] = None) -> list[ModuleSharder]:
    """The sharders to pass to ``DistributedModelParallel(sharders=...)``: EBC and EC.

    Args:
        fused_params: default for every table these sharders shard, e.g.
            ``{"optimizer": EmbOptimType.FTRL, "learning_rate": 0.05, "ftrl_l1_reg": 1e-3}``. Tables
            with an in-backward optimizer (``apply_optimizer_in_backward``) use theirs instead.

    Raises:
        ValueError: invalid FTRL knobs (checked here, before any process builds a kernel).
    """
    fp = dict(fused_params) if fused_params else None
    if fp and is_ftrl(fp.get("optimizer")):
        tbe_kwargs_from_fused_params(fp)   # validates the knobs
    return [FTRLEmbeddingBagCollectionSharder(fused_params=fp and dict(fp)),
            FTRLEmbeddingCollectionSharder(fused_params=fp and dict(fp))]
