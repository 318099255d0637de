"""TorchRec embedding kernels that hold the fused FTRL TBE, as ``BatchedFusedEmbeddingBag`` /
``BatchedFusedEmbedding`` hold FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``.

They inherit TorchRec's fused-kernel behaviour (state_dict as ShardedTensors, ``fused_optimizer``,
``named_parameters`` with ``EmptyFusedOptimizer``, ``flush`` / ``purge`` of the TBE's cache) and only
replace the TBE they build. The TBE places its tables as TorchRec's own kernels do: on a CUDA device
where the tables' compute kernel says (``fused``: HBM, ``fused_uvm``: unified memory,
``fused_uvm_caching``: unified memory behind an HBM cache), elsewhere in host memory. The fused
optimizer exposes FTRL states under TensorFlow's slot names: ``{table}.accum`` and ``{table}.linear``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding,
    BaseBatchedEmbeddingBag,
    BatchedFusedEmbedding,
    BatchedFusedEmbeddingBag,
    EmbeddingFusedOptimizer,
)
from torchrec.distributed.embedding_types import (
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    compute_kernel_to_embedding_location,
)
from torchrec.distributed.planner.constants import UVM_CACHING_RATIO
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import DataType, data_type_to_sparse_type
from torchrec.optim.fused import EmptyFusedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..fbgemm_enums import BoundsCheckMode, CacheAlgorithm, PoolingMode, SparseType
from ..hyperparams import parse_options
from ..optim_type import is_ftrl
from ..tbe.placement import check_cache_options
from ..tbe.derived_weight import DerivedWeight
from ..row_layout import RowLayout, require_kernel_layout
from ..state_dtype import (OPTIMIZER_STATE_DTYPES, STATE_DTYPE, STATE_NAMES, hashable_state_dtypes,
                           state_dtypes_from_options)
from ..tbe import FTRLTableBatchedEmbeddingBags
from ..tbe.table_api import STEP_KEY

# The compute kernels an FTRL table may be planned with (values of EmbeddingComputeKernel): the FTRL
# TBE with its tables in device/host memory, in unified memory, or in unified memory behind an HBM
# cache. Dense (data-parallel) and key-value / SSD / virtual-table kernels are not FTRL kernels.
FTRL_COMPUTE_KERNELS = (EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.FUSED_UVM.value,
                        EmbeddingComputeKernel.FUSED_UVM_CACHING.value)

# fused_params keys passed to the TBE as given (when not None), besides learning_rate / lr and the
# ftrl_* knobs. The cache keys are those TorchRec's add_params_from_parameter_sharding copies from a
# table's CacheParams (algorithm, load_factor, reserved_memory, prefetch_pipeline; precision below) and
# FBGEMM's other cache keywords that a sharder's fused_params may carry.
_PASSED_THROUGH = ("output_dtype", "bounds_check_mode", "cache_load_factor", "cache_sets",
                   "cache_algorithm", "cache_reserved_memory", "prefetch_pipeline", "uvm_host_mapped",
                   "gather_uvm_cache_stats")


def canonical_fused_params(fused_params: Optional[dict[str, Any]],
                           where: str = "fused_params") -> Optional[dict[str, Any]]:
    """A copy of a sharder's ``fused_params`` whose FTRL state dtype is in the hashable form TorchRec's
    table grouping needs: ``optimizer_state_dtypes`` (FBGEMM's dict ``{"accum": SparseType.BF16,
    ...}``, a frozenset / tuple of pairs) or ``state_dtype`` (one dtype for both) becomes
    ``optimizer_state_dtypes = frozenset((state, SparseType.as_int()), ...)`` of the non-fp32 states
    (:func:`torchrec_ftrl.state_dtype.hashable_state_dtypes`); fp32 for both drops the key. ``None``
    stays ``None``; other keys are copied as they are, and so is the ``optimizer_state_dtypes`` of
    fused_params naming another ``optimizer`` (that optimizer's own states, FBGEMM's to read).

    Raises:
        ValueError: an invalid state name or dtype (naming ``where``, the key and the value), or both
            keys given.
    """
    if fused_params is None:
        return None
    fp = dict(fused_params)
    if fp.get(STATE_DTYPE) is not None and fp.get(OPTIMIZER_STATE_DTYPES) is not None:
        raise ValueError(f"{where} has both {STATE_DTYPE}={fp[STATE_DTYPE]!r} and {OPTIMIZER_STATE_DTYPES}="
                         f"{fp[OPTIMIZER_STATE_DTYPES]!r}; give one of them")
    if STATE_DTYPE not in fp and OPTIMIZER_STATE_DTYPES not in fp:
        return fp
    if fp.get(STATE_DTYPE) is None and fp.get("optimizer") is not None and not is_ftrl(fp["optimizer"]):
        return fp
    dtypes = state_dtypes_from_options(fp, where)
    fp.pop(STATE_DTYPE, None)
    fp.pop(OPTIMIZER_STATE_DTYPES, None)
    hashable = hashable_state_dtypes(dtypes, f"{where} {OPTIMIZER_STATE_DTYPES}")
    if hashable:
        fp[OPTIMIZER_STATE_DTYPES] = hashable
    return fp


def is_ftrl_state_dtypes(value: Any) -> bool:
    """Whether a fused_params ``optimizer_state_dtypes`` value names only FTRL's states (``accum``,
    ``linear``): the value a stock table sharing an FTRL sharder must not receive."""
    try:
        pairs = value.items() if isinstance(value, dict) else iter(value)
        return all(isinstance(pair, tuple) and len(pair) == 2 and pair[0] in STATE_NAMES for pair in pairs)
    except TypeError:
        return False


def ftrl_only_key(key: str, value: Any) -> bool:
    """Whether a fused_params entry is FTRL's alone: an ``ftrl_*`` knob or row-layout key
    (``ftrl_weights``, ``ftrl_accumulator``), or ``optimizer_state_dtypes`` naming only FTRL's
    states (``accum`` / ``linear``). A stock table's own state dtypes (other names) are FBGEMM's."""
    if key.startswith("ftrl_"):
        return True
    return key == OPTIMIZER_STATE_DTYPES and is_ftrl_state_dtypes(value)


def refuse_ftrl_keys_without_ftrl(options: Optional[dict[str, Any]], optimizer: Any, where: str) -> None:
    """Refuse FTRL-only options given with another optimizer: a non-FTRL table gets none of them
    (routing drops them, :mod:`.routing`), so the row layout, knobs or state dtype asked for would
    not apply. The FTRL-only keys are those of :func:`ftrl_only_key` and ``state_dtype`` (FTRL's
    one dtype for both states). ``optimizer`` ``None`` (not named) refuses nothing. A sharder whose
    ``fused_params`` name another optimizer may still shard in-backward FTRL tables: their FTRL
    options go in their own in-backward kwargs.

    Raises:
        ValueError: naming ``where``, the first such key, its value and ``optimizer``.
    """
    if optimizer is None or is_ftrl(optimizer):
        return
    for key, value in (options or {}).items():
        if not isinstance(key, str) or value is None or (isinstance(value, (dict, frozenset, tuple)) and not value):
            continue
        if ftrl_only_key(key, value) or key == STATE_DTYPE:
            name = getattr(optimizer, "__name__", None) or repr(optimizer)
            raise ValueError(f"{where}: {key}={value!r} is an FTRL option, but the optimizer is {name}; "
                             f"its tables would not get it. Use EmbOptimType.FTRL, give it in the kwargs "
                             f"of apply_optimizer_in_backward(torchrec_ftrl.FTRL, ...) for the FTRL "
                             f"tables, or remove {key!r}")


def _sparse_type(key: str, value: Any) -> SparseType:
    """``value`` (a ``SparseType`` or TorchRec ``DataType``) as a ``SparseType``.

    Raises:
        ValueError: anything else, naming ``key`` and the value.
    """
    if isinstance(value, DataType):
        return data_type_to_sparse_type(value)
    if isinstance(value, SparseType):
        return value
    raise ValueError(f"fused_params {key} must be a SparseType or DataType, got {value!r}")


def tbe_kwargs_from_fused_params(fused_params: Optional[dict[str, Any]],
                                 location: Optional[EmbeddingLocation] = None,
                                 weights_precision: Optional[SparseType] = None) -> dict[str, Any]:
    """Constructor kwargs of :class:`FTRLTableBatchedEmbeddingBags` from a TorchRec ``fused_params``.

    Keeps ``learning_rate`` (or ``lr``), the ``ftrl_*`` knobs, the row layout (``row_layout``: a
    :class:`~torchrec_ftrl.row_layout.RowLayout` of ``ftrl_weights``, ``ftrl_accumulator`` and the
    state dtype, ``state_dtype`` or ``optimizer_state_dtypes``, parsed once here), ``output_dtype``,
    ``bounds_check_mode``
    (default ``BoundsCheckMode.WARNING``, FBGEMM's default for stock tables and the TBE's own; a
    ``fused_params`` value, FATAL among them, is honoured) and the cache keys
    ``cache_load_factor``, ``cache_sets``, ``cache_algorithm``, ``cache_reserved_memory``,
    ``cache_precision`` (as a ``SparseType``), ``prefetch_pipeline``, ``uvm_host_mapped`` and
    ``gather_uvm_cache_stats``. Drops every other key, among them: ``optimizer`` (routing reads it);
    ``multipass_prefetch_config`` (FBGEMM splits a prefetch into passes to bound its memory; the
    same rows are cached); ``enforce_hbm`` when false or when the tables are not cached;
    ``stochastic_rounding``
    (the kernels round fp16 / bf16 weights to nearest); ``stats_reporter_config`` and the
    key-value / SSD keys (kernels FTRL does not run on); other optimizers' keys (``eps``, ...).

    Args:
        fused_params: a table group's (or a sharder's) ``fused_params``; ``None`` is empty.
        location: the ``EmbeddingLocation`` of the TBE's tables, when known (kernel construction).
        weights_precision: the tables' weight ``SparseType``, when known.

    Raises:
        ValueError: an unknown ``ftrl_*`` key (a misspelling would otherwise be ignored silently),
            an invalid state dtype or row layout (naming the key and value), a row layout the TBE
            kernels do not implement,
            ``lr`` and ``learning_rate`` that differ, or an invalid knob (naming it and its value);
            ``cache_precision`` that is not a ``SparseType`` / ``DataType``, or that differs from
            ``weights_precision`` for a ``MANAGED_CACHING`` TBE (its cache holds the weights in
            their own precision; FBGEMM would round cached rows to ``cache_precision``);
            ``enforce_hbm=True`` for a ``MANAGED_CACHING`` TBE (FBGEMM would keep the cached tables'
            backing store in HBM; the FTRL TBE keeps it in unified memory).
    """
    fp = dict(fused_params or {})
    kwargs: dict[str, Any] = parse_options(fp, where="fused_params").to_options()
    kwargs.update({k: fp[k] for k in _PASSED_THROUGH if k in fp and fp[k] is not None})
    kwargs["row_layout"] = RowLayout.from_options(fp, "fused_params")
    require_kernel_layout(kwargs["row_layout"], "fused_params")
    check_cache_options(kwargs.get("cache_load_factor", 0.2), kwargs.get("cache_sets", 0),
                        kwargs.get("cache_algorithm", CacheAlgorithm.LRU),
                        kwargs.get("prefetch_pipeline", False), where="fused_params")
    if fp.get("enforce_hbm") and location == EmbeddingLocation.MANAGED_CACHING:
        raise ValueError("fused_params enforce_hbm=True asks for the fused_uvm_caching tables' backing "
                         "store in HBM; the FTRL TBE keeps it in unified memory. Plan the tables on "
                         "'fused' for HBM, or leave enforce_hbm unset")
    if fp.get("cache_precision") is not None:
        kwargs["cache_precision"] = _cache_precision(fp["cache_precision"], location, weights_precision)
    # FBGEMM's default (WARNING: repair + count, no host sync) as for stock tables; also the TBE's
    # own default, set here so the kwargs say it (FATAL only when fused_params asks for it).
    kwargs.setdefault("bounds_check_mode", BoundsCheckMode.WARNING)
    return kwargs


def _cache_precision(value: Any, location: Optional[EmbeddingLocation],
                     weights_precision: Optional[SparseType]) -> SparseType:
    """``fused_params["cache_precision"]`` as a ``SparseType``, checked against the weights' precision
    for a ``MANAGED_CACHING`` TBE (other placements have no cache: FBGEMM ignores the key there).

    Raises:
        ValueError: not a ``SparseType`` / ``DataType``, or a caching TBE whose ``cache_precision``
            differs from ``weights_precision`` (naming both).
    """
    precision = _sparse_type("cache_precision", value)
    if (location == EmbeddingLocation.MANAGED_CACHING and weights_precision is not None
            and precision != weights_precision):
        raise ValueError(
            f"fused_params cache_precision={precision.name} differs from the tables' weights precision "
            f"{weights_precision.name}; the FTRL cache (fused_uvm_caching) keeps the weights in their "
            f"own precision. Leave cache_precision unset or set it to {weights_precision.name}")
    return precision


def tbe_placements(config: GroupedEmbeddingConfig,
                   device: Optional[torch.device]) -> list[tuple[EmbeddingLocation, ComputeDevice]]:
    """``(location, compute device)`` of each table of ``config``, as TorchRec's
    ``BatchedFusedEmbeddingBag`` chooses them: on a CUDA device the location of the table's compute
    kernel (``compute_kernel_to_embedding_location``: ``fused`` DEVICE, ``fused_uvm`` MANAGED,
    ``fused_uvm_caching`` MANAGED_CACHING); on any other device (or none) HOST on the CPU.

    Raises:
        ValueError: on a CUDA device, a compute kernel that has no embedding location.
    """
    if device is not None and torch.device(device).type == "cuda":
        return [(compute_kernel_to_embedding_location(t.compute_kernel), ComputeDevice.CUDA)
                for t in config.embedding_tables]
    return [(EmbeddingLocation.HOST, ComputeDevice.CPU) for _ in config.embedding_tables]


class FTRLEmbeddingFusedOptimizer(EmbeddingFusedOptimizer):
    """TorchRec's ``EmbeddingFusedOptimizer`` over the FTRL TBE, with the first state named ``accum``
    (TorchRec names a table's first state ``momentum1`` whatever the TBE calls it), and the TBE's
    step counter as each table's ``"{table}.step"``: the TBE's ``iter`` itself (int64 ``[1]``, a
    plain tensor, the same on every rank, which DCP saves once and every rank loads), so that the
    optimizer ``state_dict``, and a DCP checkpoint of it, carry the step that keys the stochastic
    rounding of bf16 states, and a load restores it. All the tables of one TBE share it; a load
    that gives them different steps leaves the TBE at the last one written."""

    def __init__(self, config: GroupedEmbeddingConfig, emb_module: FTRLTableBatchedEmbeddingBags,
                 pg: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__(config, emb_module, pg)
        for param, param_state in list(self.state.items()):
            renamed = {(k[: -len("momentum1")] + "accum" if k.endswith(".momentum1") else k): v
                       for k, v in param_state.items()}
            for table in {k.rpartition(".")[0] for k in renamed}:
                renamed[f"{table}.{STEP_KEY}"] = emb_module.iter
            self.state[param] = renamed

    @property
    def state(self):
        """The per-parameter FTRL states (views of ``accum`` / ``linear``), after writing the TBE's
        HBM cache back (``flush``) so the views hold every update. TorchRec reads ``.state`` for the
        optimizer ``state_dict`` (``CombinedOptimizer`` reads its sub-optimizers' ``.state``
        directly), so every such read sees the latest states.

        TorchRec itself flushes the lookups before a model ``state_dict`` (``_pre_state_dict_hook``
        of ``ShardedEmbeddingBagCollection`` / ``ShardedEmbeddingCollection``) and purges them
        (``reset_cache_states``) before a model ``load_state_dict`` (``_pre_load_state_dict_hook``).
        """
        emb = self.__dict__.get("_emb_module")
        if emb is not None:
            emb.flush()
        return self.__dict__["_ftrl_state"]

    @state.setter
    def state(self, value) -> None:
        self.__dict__["_ftrl_state"] = value

    def post_load_state_dict(self) -> None:
        """After a ``load_state_dict`` (TorchRec's ``KeyedOptimizer`` / ``CombinedOptimizer`` call this
        on every sub-optimizer): the loaded states went to the tables' unified memory, and reading
        ``.state`` for the load flushed the cache, so the cache is emptied (its rows hold the states
        from before the load)."""
        super().post_load_state_dict()
        self._emb_module.reset_cache_states()


def _build_tbe(kernel, config: GroupedEmbeddingConfig, device, pooling) -> FTRLTableBatchedEmbeddingBags:
    """The FTRL TBE of ``config``'s tables on this rank: FBGEMM 4-tuple specs ``(rows, dim, location,
    compute device)`` from :func:`tbe_placements`, the kwargs from :func:`tbe_kwargs_from_fused_params`;
    a ``MANAGED_CACHING`` TBE without ``cache_load_factor`` gets TorchRec's planner default
    ``UVM_CACHING_RATIO``, the load factor the plan was sized with.

    Raises:
        ValueError: invalid fused_params (see :func:`tbe_kwargs_from_fused_params`) or TBE arguments.
    """
    placements = tbe_placements(config, device)
    locations = {location for location, _ in placements}
    location = next(iter(locations)) if len(locations) == 1 else None
    weights_precision = data_type_to_sparse_type(config.data_type)
    kwargs = tbe_kwargs_from_fused_params(config.fused_params, location, weights_precision)
    if location == EmbeddingLocation.MANAGED_CACHING:
        kwargs.setdefault("cache_load_factor", UVM_CACHING_RATIO)
    return FTRLTableBatchedEmbeddingBags(
        embedding_specs=[(rows, dim, loc, compute) for rows, dim, (loc, compute)
                         in zip(kernel._local_rows, kernel._local_cols, placements)],
        feature_table_map=kernel._feature_table_map,
        pooling_mode=pooling,
        weights_precision=weights_precision,
        device=device,
        table_names=[t.name for t in config.embedding_tables],
        **kwargs,
    )


class _DerivedWeightParams:
    """The per-table weight parameters of a kernel whose TBE derives its weights: TorchRec slices the
    TBE's weight buffer into ``TableBatchedEmbeddingSlice`` parameters (the sharded module's
    ``weight`` parameters and ``state_dict``); a derived-weights TBE has none, so each table's
    parameter is a :class:`~torchrec_ftrl.tbe.derived_weight.DerivedWeight` (computed when read,
    encoded when written). A TBE that stores weights keeps TorchRec's slices."""

    @property
    def _param_per_table(self) -> dict[str, nn.Parameter]:
        tbe = self._modules.get("_emb_module")
        if tbe is None or tbe.row_layout.stores_weights:
            try:   # TorchRec's property (the fused kernels of torchrec 1.6-1.9)
                return super()._param_per_table
            except AttributeError:   # or what its __init__ assigned
                return self.__dict__.get("_stock_param_per_table", {})
        params: dict[str, nn.Parameter] = {}
        for t, table in enumerate(self._config.embedding_tables):
            if table.name in params:
                raise ValueError(f"table {table.name!r} has several shards in one FTRL kernel of this "
                                 f"rank; derived weights (ftrl_weights='derived') need one shard of a table "
                                 f"per kernel: plan its column-wise shards on different ranks, or use "
                                 f"ftrl_weights='stored'")
            weight = nn.Parameter(DerivedWeight(tbe, t), requires_grad=False)
            weight._in_backward_optimizers = [EmptyFusedOptimizer()]
            params[table.name] = weight
        return params

    @_param_per_table.setter
    def _param_per_table(self, value) -> None:
        self.__dict__["_stock_param_per_table"] = value


class FTRLBatchedFusedEmbeddingBag(_DerivedWeightParams, BatchedFusedEmbeddingBag):
    """Pooled (EmbeddingBagCollection) kernel: one FTRL TBE for a group of FTRL tables on this rank."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, sharding_type: Optional[ShardingType] = None,
                 env: Optional[ShardingEnv] = None) -> None:
        BaseBatchedEmbeddingBag.__init__(self, config, pg, device, sharding_type)
        self._emb_module = _build_tbe(self, config, device, self._pooling)
        self._optim = FTRLEmbeddingFusedOptimizer(config, self._emb_module, pg)
        self.init_parameters()

    def forward(self, features: KeyedJaggedTensor, vbe_output: Optional[torch.Tensor] = None,
                vbe_output_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
        weights = features.weights_or_none()
        if weights is not None and not torch.is_floating_point(weights):
            weights = None
        kwargs: dict[str, Any] = {}
        if features.variable_stride_per_key():
            kwargs["batch_size_per_feature_per_rank"] = features.stride_per_key_per_rank()
        out = self._emb_module(indices=features.values(), offsets=features.offsets(),
                               per_sample_weights=weights, **kwargs)
        if vbe_output is not None:
            raise ValueError("vbe_output (a preallocated VBE output) is not supported by the FTRL kernel")
        return out


class FTRLBatchedFusedEmbedding(_DerivedWeightParams, BatchedFusedEmbedding):
    """Sequence (EmbeddingCollection) kernel: the FTRL TBE with ``PoolingMode.NONE``."""

    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, env: Optional[ShardingEnv] = None,
                 **_: Any) -> None:
        BaseBatchedEmbedding.__init__(self, config, pg, device)
        self._emb_module = _build_tbe(self, config, device, PoolingMode.NONE)
        self._optim = FTRLEmbeddingFusedOptimizer(config, self._emb_module, pg)
        self.init_parameters()


def tbes_of_type(module: torch.nn.Module, cls: type) -> list:
    """The modules of type ``cls`` (a TBE class) inside ``module``, in module order (the same order on
    every replica), not searched below a match. A sharded module's lookups are searched too: TorchRec
    does not register ``_lookups`` as children."""
    found: dict[int, torch.nn.Module] = {}

    def visit(m: torch.nn.Module) -> None:
        if isinstance(m, cls):
            found.setdefault(id(m), m)
            return
        for child in [*(getattr(m, "_lookups", None) or []), *m.children()]:
            visit(child)
    visit(module)
    return list(found.values())


def ftrl_tbes(module: torch.nn.Module) -> list[FTRLTableBatchedEmbeddingBags]:
    """The FTRL TBEs inside ``module`` (:func:`tbes_of_type`)."""
    return tbes_of_type(module, FTRLTableBatchedEmbeddingBags)
