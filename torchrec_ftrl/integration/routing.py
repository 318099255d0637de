"""Routes FTRL groups to the FTRL kernels inside TorchRec's grouped lookups.

TorchRec has no kernel registry: ``GroupedPooledEmbeddingsLookup._create_embedding_kernel`` and
``GroupedEmbeddingsLookup._create_embedding_kernel`` are if/elif chains on the compute kernel, reached
from every sharding type (table-, row-, column-, table-row-, table-column-wise). The patches in
:mod:`.patches` wrap both with :func:`routed_create_embedding_kernel`:
a group whose ``fused_params["optimizer"]`` is FTRL and whose compute kernel is ``fused`` gets our
kernel; every other group goes to TorchRec unchanged. FTRL with any other compute kernel (dense, i.e.
data-parallel, UVM, UVM caching, key-value/SSD) is refused with a ``ValueError``, never run with
another optimizer.
"""

from __future__ import annotations

import functools
import inspect

from torchrec.distributed import embedding_lookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingType

from ..optim_type import is_ftrl
from .kernels import FTRLBatchedFusedEmbedding, FTRLBatchedFusedEmbeddingBag


def is_ftrl_group(config: GroupedEmbeddingConfig) -> bool:
    return is_ftrl((config.fused_params or {}).get("optimizer"))


def check_ftrl_group(config: GroupedEmbeddingConfig, sharding_type=None) -> None:
    """Raises ValueError unless every table of this FTRL group uses the ``fused`` compute kernel.

    Any other kernel would train the table with another optimizer or not at all: ``dense`` (a
    data-parallel table, a DDP parameter trained by the dense optimizer), UVM placements, key-value/SSD
    tables. The message names the table, its sharding type and its compute kernel.
    """
    st = getattr(sharding_type, "value", sharding_type)
    for table in config.embedding_tables:
        kernel = table.compute_kernel
        if kernel != EmbeddingComputeKernel.FUSED:
            if st is None and kernel == EmbeddingComputeKernel.DENSE:
                st = ShardingType.DATA_PARALLEL.value   # the one sharding type of the dense kernel
            raise ValueError(
                f"table {table.name!r} is trained by FTRL but planned with sharding type {st!r} and "
                f"compute kernel {getattr(kernel, 'value', kernel)!r}; FTRL runs only on compute kernel "
                f"'fused' (tables in device/host memory). Use torchrec_ftrl.sharders() and its planner, "
                f"or for a data-parallel table a stock sharder with the dense torchrec_ftrl.FTRL "
                f"(not apply_optimizer_in_backward / fused_params)")


def routed_create_embedding_kernel(original, kernel_cls: type):
    """``_create_embedding_kernel`` that builds ``kernel_cls`` for FTRL groups and calls ``original``
    for every other group."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _create_embedding_kernel(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        config = arguments["config"]
        if is_ftrl_group(config):
            check_ftrl_group(config, arguments.get("sharding_type"))
            extra = {k: arguments[k] for k in ("sharding_type", "env") if k in arguments}
            return kernel_cls(config=config, pg=arguments.get("pg"), device=arguments.get("device"),
                              **extra)
        if config.fused_params and any(k.startswith("ftrl_") for k in config.fused_params):
            # A non-FTRL group (e.g. an in-backward row-wise Adagrad table) inherited FTRL knobs from
            # a sharder's fused_params: FBGEMM's TBE would reject them.
            config.fused_params = {k: v for k, v in config.fused_params.items()
                                   if not k.startswith("ftrl_")}
        return original(self, *args, **kwargs)

    return _create_embedding_kernel


# (lookup class, FTRL kernel it builds): the pooled (EBC) and sequence (EC) grouped lookups.
ROUTES = ((embedding_lookup.GroupedPooledEmbeddingsLookup, FTRLBatchedFusedEmbeddingBag),
          (embedding_lookup.GroupedEmbeddingsLookup, FTRLBatchedFusedEmbedding))
