"""TorchRec glue: sharders that route FTRL tables to the fused FTRL TBE (work in progress)."""

from __future__ import annotations

from typing import Any, Optional


def sharders(fused_params: Optional[dict[str, Any]] = None) -> list:
    """The sharders to pass to ``DistributedModelParallel(sharders=...)`` (EBC and EC).

    ``fused_params`` (e.g. ``{"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1, "ftrl_l1_reg":
    1e-3}``) is the default for every table the sharders shard.
    """
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    fp = dict(fused_params) if fused_params else None
    return [EmbeddingBagCollectionSharder(fused_params=fp), EmbeddingCollectionSharder(fused_params=fp)]
