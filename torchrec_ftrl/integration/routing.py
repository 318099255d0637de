"""Routes FTRL groups to the FTRL kernels inside TorchRec's grouped lookups.

TorchRec has no kernel registry: ``GroupedPooledEmbeddingsLookup._create_embedding_kernel`` and
``GroupedEmbeddingsLookup._create_embedding_kernel`` are if/elif chains on the compute kernel, reached
from every sharding type (table-, row-, column-, table-row-, table-column-wise). The patches in
:mod:`.patches` wrap both with :func:`routed_create_embedding_kernel`: a group whose
``fused_params["optimizer"]`` is FTRL gets our kernel when its tables use the compute kernels
``fused``, ``fused_uvm`` or ``fused_uvm_caching`` (which TorchRec folds into one ``fused`` group);
every other group goes to TorchRec unchanged, less any FTRL-only fused_params it inherited from a
shared sharder (``ftrl_*`` knobs, FTRL's ``optimizer_state_dtypes``). FTRL with any other compute kernel (dense, i.e.
data-parallel; key-value, SSD or DRAM virtual tables) is refused with a ``ValueError``, never run with
another optimizer.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
from torchrec.distributed import embedding_lookup
from torchrec.distributed.embedding_types import (
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    compute_kernel_to_embedding_location,
)
from torchrec.distributed.types import ShardingType

from ..optim_type import is_ftrl
from .compute_kernels import (FTRL_COMPUTE_KERNELS, FTRLBatchedFusedEmbedding, FTRLBatchedFusedEmbeddingBag,
                              ftrl_only_key)

_FTRL_KERNEL_NAMES = ", ".join(repr(k) for k in FTRL_COMPUTE_KERNELS)


def is_ftrl_group(config: GroupedEmbeddingConfig) -> bool:
    return is_ftrl((config.fused_params or {}).get("optimizer"))


def _kernel_name(kernel) -> str:
    return getattr(kernel, "value", kernel)


def check_ftrl_group(config: GroupedEmbeddingConfig, sharding_type=None,
                     device: Optional[torch.device] = None) -> None:
    """Raises ValueError unless this FTRL group can run on one FTRL TBE.

    Every table must use one of the compute kernels ``fused``, ``fused_uvm`` or
    ``fused_uvm_caching``. Any other kernel would train the table with another optimizer or not at
    all: ``dense`` (a data-parallel table, a DDP parameter trained by the dense optimizer),
    ``key_value`` and the SSD / DRAM virtual-table kernels (FBGEMM's SSD TBE). The message names the
    table, its sharding type and its compute kernel.

    On a CUDA ``device`` the tables must also share one placement (one FTRL TBE holds one
    ``EmbeddingLocation``), while TorchRec groups a rank's ``fused``, ``fused_uvm`` and
    ``fused_uvm_caching`` tables into one group; the message names each table's kernel.
    :func:`torchrec_ftrl.sharders` avoids such groups (see :mod:`.sharders`).
    """
    st = getattr(sharding_type, "value", sharding_type)
    for table in config.embedding_tables:
        kernel = _kernel_name(table.compute_kernel)
        if kernel not in FTRL_COMPUTE_KERNELS:
            if st is None and kernel == EmbeddingComputeKernel.DENSE.value:
                st = ShardingType.DATA_PARALLEL.value   # the one sharding type of the dense kernel
            raise ValueError(
                f"table {table.name!r} is trained by FTRL but planned with sharding type {st!r} and "
                f"compute kernel {kernel!r}; FTRL runs only on the compute kernels {_FTRL_KERNEL_NAMES} "
                f"(tables in device/host memory, in unified memory, or in unified memory behind an HBM "
                f"cache). Use torchrec_ftrl.sharders() and its planner, or for a data-parallel table a "
                f"stock sharder with the dense torchrec_ftrl.FTRL (not apply_optimizer_in_backward / "
                f"fused_params)")
    if device is not None and torch.device(device).type == "cuda":
        _check_one_placement(config, st)


def _check_one_placement(config: GroupedEmbeddingConfig, sharding_type) -> None:
    """Raises ValueError when the tables of ``config`` have compute kernels of different placements."""
    locations = {compute_kernel_to_embedding_location(EmbeddingComputeKernel(_kernel_name(t.compute_kernel)))
                 for t in config.embedding_tables}
    if len(locations) > 1:
        kernels = {t.name: _kernel_name(t.compute_kernel) for t in config.embedding_tables}
        raise ValueError(
            f"FTRL tables {kernels} (table: compute kernel) share one TorchRec group (sharding type "
            f"{sharding_type!r}), but one FTRL TBE holds tables of one placement. Shard with "
            f"torchrec_ftrl.sharders() (it then builds one TBE per table), pass "
            f"fused_params={{'use_one_tbe_per_table': True}}, or plan these tables with one compute "
            f"kernel (ParameterConstraints(compute_kernels=[...]))")


def _mark_prefetch(lookup, config: GroupedEmbeddingConfig) -> None:
    """Sets ``lookup._need_prefetch`` for a group with a ``fused_uvm_caching`` table, as TorchRec's
    ``GroupedEmbeddingsLookup._create_embedding_kernel`` does (its ``prefetch`` returns early
    otherwise); the pooled lookup decides per group in ``prefetch`` and has no such attribute."""
    if hasattr(lookup, "_need_prefetch") and any(
            _kernel_name(t.compute_kernel) == EmbeddingComputeKernel.FUSED_UVM_CACHING.value
            for t in config.embedding_tables):
        lookup._need_prefetch = True


def routed_create_embedding_kernel(original, kernel_cls: type):
    """``_create_embedding_kernel`` that builds ``kernel_cls`` for FTRL groups and calls ``original``
    for every other group."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _create_embedding_kernel(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        config = arguments["config"]
        if is_ftrl_group(config):
            check_ftrl_group(config, arguments.get("sharding_type"), arguments.get("device"))
            _mark_prefetch(self, config)
            extra = {k: arguments[k] for k in ("sharding_type", "env") if k in arguments}
            return kernel_cls(config=config, pg=arguments.get("pg"), device=arguments.get("device"),
                              **extra)
        if config.fused_params and any(ftrl_only_key(k, v) for k, v in config.fused_params.items()):
            # A non-FTRL group (e.g. an in-backward row-wise Adagrad table) inherited FTRL knobs or
            # FTRL's state dtypes from a sharder's fused_params: FBGEMM's TBE would reject them
            # (it asserts optimizer_state_dtypes is None for its other optimizers).
            config.fused_params = {k: v for k, v in config.fused_params.items()
                                   if not ftrl_only_key(k, v)}
        return original(self, *args, **kwargs)

    return _create_embedding_kernel


# (lookup class, FTRL kernel it builds): the pooled (EBC) and sequence (EC) grouped lookups.
ROUTES = ((embedding_lookup.GroupedPooledEmbeddingsLookup, FTRLBatchedFusedEmbeddingBag),
          (embedding_lookup.GroupedEmbeddingsLookup, FTRLBatchedFusedEmbedding))
