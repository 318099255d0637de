"""Routes FTRL groups to the FTRL kernels inside TorchRec's grouped lookups.

TorchRec has no kernel registry: ``GroupedPooledEmbeddingsLookup._create_embedding_kernel`` and
``GroupedEmbeddingsLookup._create_embedding_kernel`` are if/elif chains on the compute kernel, reached
from every sharding type (table-, row-, column-, table-row-, table-column-wise). We wrap both once:
a group whose ``fused_params["optimizer"]`` is FTRL and whose compute kernel is ``fused`` gets our
kernel; every other group goes to TorchRec unchanged. FTRL with any other compute kernel (UVM, UVM
caching, key-value/SSD) is refused with a ``ValueError``, never run with another optimizer.
"""

from __future__ import annotations

import functools
import inspect

from torchrec.distributed import embedding_lookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig

from ..registration import is_ftrl
from .kernels import FTRLBatchedFusedEmbedding, FTRLBatchedFusedEmbeddingBag

_MARK = "_torchrec_ftrl_routed"


def is_ftrl_group(config: GroupedEmbeddingConfig) -> bool:
    return is_ftrl((config.fused_params or {}).get("optimizer"))


def check_ftrl_group(config: GroupedEmbeddingConfig) -> None:
    """Raises ValueError unless every table of this FTRL group uses the ``fused`` compute kernel."""
    for table in config.embedding_tables:
        kernel = table.compute_kernel
        if kernel != EmbeddingComputeKernel.FUSED:
            raise ValueError(
                f"table {table.name!r}: FTRL supports compute_kernel 'fused' (tables in device/host "
                f"memory) only, got {getattr(kernel, 'value', kernel)!r}; UVM caching, key-value/SSD "
                f"tables and quantized inference are not supported by torchrec_ftrl")


def _route(cls: type, kernel_cls: type) -> None:
    original = cls._create_embedding_kernel
    if getattr(original, _MARK, False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _create_embedding_kernel(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        config = arguments["config"]
        if is_ftrl_group(config) and config.compute_kernel != EmbeddingComputeKernel.DENSE:
            check_ftrl_group(config)
            extra = {k: arguments[k] for k in ("sharding_type", "env") if k in arguments}
            return kernel_cls(config=config, pg=arguments.get("pg"), device=arguments.get("device"),
                              **extra)
        if config.fused_params and any(k.startswith("ftrl_") for k in config.fused_params):
            # A non-FTRL group (e.g. an in-backward row-wise Adagrad table) inherited FTRL knobs from
            # a sharder's fused_params: FBGEMM's TBE would reject them.
            config.fused_params = {k: v for k, v in config.fused_params.items()
                                   if not k.startswith("ftrl_")}
        return original(self, *args, **kwargs)

    setattr(_create_embedding_kernel, _MARK, True)
    cls._create_embedding_kernel = _create_embedding_kernel


def install_lookup_routing() -> None:
    """Idempotent."""
    _route(embedding_lookup.GroupedPooledEmbeddingsLookup, FTRLBatchedFusedEmbeddingBag)
    _route(embedding_lookup.GroupedEmbeddingsLookup, FTRLBatchedFusedEmbedding)
