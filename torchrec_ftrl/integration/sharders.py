"""Sharders for DistributedModelParallel with FTRL tables.

With ``import torchrec_ftrl`` done, TorchRec's stock sharders already route FTRL groups to our kernel
(:mod:`.routing`). These subclasses add what a sharder itself decides:

* when their ``fused_params`` select FTRL, the planner may pick only the FTRL compute kernels
  ``fused`` (tables in HBM / host memory), ``fused_uvm`` (unified memory) and ``fused_uvm_caching``
  (unified memory behind an HBM cache), never key-value / SSD / virtual-table kernels, and never plans
  a table data-parallel (a data-parallel table is a dense DDP parameter trained by whatever dense
  optimizer the user runs, so FTRL would silently not apply). For data-parallel FTRL, use a stock
  sharder with a manual plan and :class:`torchrec_ftrl.FTRL` as the dense optimizer.
* FTRL's state dtype may be given in FBGEMM's dict form (``"optimizer_state_dtypes": {"accum":
  SparseType.BF16, "linear": SparseType.BF16}``) or as ``"state_dtype"``: the constructor turns it
  into the hashable form TorchRec's table grouping needs (:func:`.compute_kernels.canonical_fused_params`),
  and :meth:`shard` does the same for the kwargs of in-backward FTRL tables
  (``apply_optimizer_in_backward(torchrec.optim.FTRL, ..., {"optimizer_state_dtypes": {...}})``).
* TorchRec groups a rank's ``fused``, ``fused_uvm`` and ``fused_uvm_caching`` tables of one sharding
  type into one kernel, while one FTRL TBE holds tables of one placement. When a CUDA plan gives the
  FTRL tables of one rank and sharding type different FTRL kernels, :meth:`shard` shards the module
  with TorchRec's ``use_one_tbe_per_table`` fused param (one TBE per table; the key never reaches a
  TBE), so every TBE holds one placement.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_sharding import USE_ONE_TBE_PER_TABLE
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ModuleSharder, ParameterSharding, ShardingType

from ..optim_type import is_ftrl
from ..state_dtype import OPTIMIZER_STATE_DTYPES, STATE_DTYPE, state_dtypes_from_options
from .compute_kernels import (FTRL_COMPUTE_KERNELS, canonical_fused_params, ftrl_only_key,
                              refuse_ftrl_keys_without_ftrl, tbe_kwargs_from_fused_params)

__all__ = ["FTRL_COMPUTE_KERNELS", "FTRLEmbeddingBagCollectionSharder", "FTRLEmbeddingCollectionSharder",
           "ftrl_keys_without_optimizer", "mixed_ftrl_placements", "refuse_misplaced_ftrl_keys",
           "sharders"]


def ftrl_keys_without_optimizer(fused_params: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The FTRL-only keys of ``fused_params`` (those of :func:`.compute_kernels.ftrl_only_key`:
    ``ftrl_*`` knobs and row-layout keys, FTRL's ``optimizer_state_dtypes``; and ``state_dtype``)
    with their values, when it names no ``"optimizer"`` (else ``{}``). A key whose value is ``None``
    or empty counts as not given."""
    fp = fused_params or {}
    if fp.get("optimizer") is not None:
        return {}
    return {k: v for k, v in fp.items() if isinstance(k, str) and v is not None
            and not (isinstance(v, (dict, frozenset, tuple)) and not v)
            and (ftrl_only_key(k, v) or k == STATE_DTYPE)}


def refuse_misplaced_ftrl_keys(fused_params: Optional[dict[str, Any]], where: str = "fused_params",
                               tables_without_ftrl: Optional[list[str]] = None) -> None:
    """Refuse a sharder's ``fused_params`` whose FTRL-only keys would not apply: given with another
    ``"optimizer"`` (:func:`.compute_kernels.refuse_ftrl_keys_without_ftrl`), or, with no
    ``"optimizer"`` (:func:`ftrl_keys_without_optimizer`), for ``tables_without_ftrl``: the tables
    of the module being sharded that have no in-backward FTRL optimizer, which TorchRec builds with
    FBGEMM's default optimizer (EXACT_SGD). (In-backward FTRL tables take the sharder's keys: TorchRec
    merges them with the optimizer's kwargs.) None: checked when the module is sharded.

    Raises:
        ValueError: naming ``where``, the FTRL-only keys with their values and the tables, and saying
            to set ``"optimizer": EmbOptimType.FTRL``.
    """
    fp = fused_params or {}
    refuse_ftrl_keys_without_ftrl(fp, fp.get("optimizer"), where)
    found = ftrl_keys_without_optimizer(fp)
    if found and tables_without_ftrl:
        raise ValueError(
            f"{where} has the FTRL option(s) {found} but no \"optimizer\": the tables "
            f"{sorted(tables_without_ftrl)} would train with FBGEMM's default optimizer (EXACT_SGD) and "
            f"ignore them. Add \"optimizer\": EmbOptimType.FTRL (after import torchrec_ftrl), or give "
            f"these tables an in-backward optimizer, apply_optimizer_in_backward(torchrec_ftrl.FTRL, ...)")


def mixed_ftrl_placements(params: dict[str, ParameterSharding], ftrl_tables: set[str]) -> bool:
    """Whether two FTRL tables of ``params`` (table name -> its plan) with the same sharding type have
    shards on one rank under different compute kernels, i.e. would share a TorchRec group of more than
    one placement."""
    kernels_at: dict[tuple[str, int], set[str]] = defaultdict(set)
    for name, ps in params.items():
        if name in ftrl_tables:
            for rank in ps.ranks or ():
                kernels_at[(ps.sharding_type, rank)].add(ps.compute_kernel)
    return any(len(kernels) > 1 for kernels in kernels_at.values())


class _FTRLKernelFilter:
    def __init__(self, fused_params: Optional[dict[str, Any]] = None, *args: Any, **kwargs: Any) -> None:
        refuse_misplaced_ftrl_keys(fused_params)
        super().__init__(canonical_fused_params(fused_params), *args, **kwargs)

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

    def _ftrl_tables(self, module) -> set[str]:
        """Names of ``module``'s tables trained by FTRL: by their in-backward optimizer class, else by
        this sharder's ``fused_params``."""
        ftrl = set()
        for name, param in self.shardable_parameters(module).items():
            classes = getattr(param, "_optimizer_classes", None)
            in_backward = classes[0] if classes else None
            by_ftrl = is_ftrl(in_backward) if in_backward is not None else self._ftrl()
            if by_ftrl:
                ftrl.add(name)
        return ftrl

    def _in_backward_ftrl(self, module) -> set[str]:
        """Names of ``module``'s tables with an in-backward FTRL optimizer."""
        return {name for name, param in self.shardable_parameters(module).items()
                if getattr(param, "_optimizer_classes", None) and is_ftrl(param._optimizer_classes[0])}

    def _canonical_in_backward_kwargs(self, module) -> None:
        """Give every in-backward FTRL table's optimizer kwargs (``param._optimizer_kwargs``) its state
        dtype in the hashable fused_params form (:func:`.compute_kernels.canonical_fused_params`; a kwargs
        dict whose state dtype is already canonical is left as it is). The kwargs list is replaced by
        a new one; the dicts the caller passed are not modified.

        Raises:
            ValueError: an invalid state dtype, naming the table, the key and the value; an FTRL-only
                key (``ftrl_*``, FTRL's state dtypes) in a non-FTRL table's kwargs, naming the table,
                the key, its value and the optimizer class
                (:func:`.compute_kernels.refuse_ftrl_keys_without_ftrl`).
        """
        for name, param in self.shardable_parameters(module).items():
            classes = getattr(param, "_optimizer_classes", None)
            kwargs_list = getattr(param, "_optimizer_kwargs", None)
            if classes and kwargs_list:
                refuse_ftrl_keys_without_ftrl(kwargs_list[0], classes[0], f"table {name!r} in-backward kwargs")
            if not classes or not kwargs_list or not is_ftrl(classes[0]):
                continue
            kwargs = kwargs_list[0]
            if kwargs.get(STATE_DTYPE) is None and kwargs.get(OPTIMIZER_STATE_DTYPES) is None:
                continue
            where = f"table {name!r} in-backward FTRL kwargs"
            dtypes = state_dtypes_from_options(kwargs, where)
            # Both keys: the dense FTRL constructor has checked that they agree.
            canonical = canonical_fused_params({k: v for k, v in kwargs.items() if k != STATE_DTYPE}
                                               | {OPTIMIZER_STATE_DTYPES: dtypes}, where)
            canonical.setdefault(OPTIMIZER_STATE_DTYPES, frozenset())   # explicit fp32 overrides a sharder's
            if canonical != kwargs:
                param._optimizer_kwargs = [canonical, *kwargs_list[1:]]

    def shard(self, module, params: dict[str, ParameterSharding], env, device: Optional[torch.device] = None,
              module_fqn: Optional[str] = None):
        """TorchRec's ``shard``; on a CUDA ``device``, with ``use_one_tbe_per_table`` added to the
        fused_params when :func:`mixed_ftrl_placements` holds for this module's FTRL tables. In-backward
        FTRL tables' state dtypes are made hashable first (:meth:`_canonical_in_backward_kwargs`)."""
        self._canonical_in_backward_kwargs(module)
        refuse_misplaced_ftrl_keys(self._fused_params, "the sharder's fused_params",
                                   sorted(set(self.shardable_parameters(module)) - self._in_backward_ftrl(module)))
        if (device is None or torch.device(device).type != "cuda"
                or not mixed_ftrl_placements(params, self._ftrl_tables(module))):
            return super().shard(module, params, env, device, module_fqn)
        own = self._fused_params
        self._fused_params = {**(own or {}), USE_ONE_TBE_PER_TABLE: True}
        try:
            return super().shard(module, params, env, device, module_fqn)
        finally:
            self._fused_params = own


class FTRLEmbeddingBagCollectionSharder(_FTRLKernelFilter, EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` whose FTRL tables use the fused FTRL TBE."""


class FTRLEmbeddingCollectionSharder(_FTRLKernelFilter, EmbeddingCollectionSharder):
    """``EmbeddingCollectionSharder`` whose FTRL tables use the fused FTRL TBE (PoolingMode.NONE)."""


def sharders(fused_params: Optional[dict[str, Any]] = None) -> list[ModuleSharder]:
    """The sharders to pass to ``DistributedModelParallel(sharders=...)``: EBC and EC.

    Args:
        fused_params: default for every table these sharders shard, e.g.
            ``{"optimizer": EmbOptimType.FTRL, "learning_rate": 0.05, "ftrl_l1_reg": 1e-3}``, plus
            optional cache keys for ``fused_uvm_caching`` tables (``cache_load_factor``,
            ``cache_algorithm``, ``prefetch_pipeline``, ...) and FTRL's state dtype:
            ``"optimizer_state_dtypes"`` in FBGEMM's dict form ``{"accum": SparseType.BF16,
            "linear": SparseType.BF16}`` (or the hashable frozenset of ``(state,
            SparseType.as_int())`` pairs), or ``"state_dtype"`` for both states; the sharders hold it
            as ``optimizer_state_dtypes = frozenset(...)`` of the non-fp32 states (key dropped when
            both are fp32), which TorchRec can group tables by. Tables with an in-backward optimizer
            (``apply_optimizer_in_backward``) use theirs instead. Stock (non-FTRL) tables sharing
            these sharders never receive FTRL's ``optimizer_state_dtypes`` (see :mod:`.routing`).

    Raises:
        ValueError: invalid FTRL knobs, cache keys or state dtypes, or FTRL-only keys (``ftrl_*``
            knobs and row-layout keys, FTRL's state dtypes) with another ``"optimizer"``, which would
            not apply (:func:`refuse_misplaced_ftrl_keys`); checked here, before any process builds a
            kernel, naming the keys and their values. With no ``"optimizer"`` they are refused when a
            module is sharded, for its tables without an in-backward FTRL optimizer.
    """
    refuse_misplaced_ftrl_keys(fused_params)
    fp = canonical_fused_params(dict(fused_params)) if fused_params else None
    if fp and is_ftrl(fp.get("optimizer")):
        tbe_kwargs_from_fused_params(fp)   # validates the knobs
    return [FTRLEmbeddingBagCollectionSharder(fused_params=fp and dict(fp)),
            FTRLEmbeddingCollectionSharder(fused_params=fp and dict(fp))]
