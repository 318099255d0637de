"""``FTRLTableBatchedEmbeddingBags``: a table-batched embedding (TBE) module with a fused FTRL optimizer.

Forward does the multi-table lookup + pooling; backward sums gradients per touched (table, row) and
applies one FTRL-Proximal update per row in place, never materialising a weight gradient. The API is
shaped after FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` so TorchRec's kernel wrappers and
``EmbeddingFusedOptimizer`` can hold it. The update rule: :mod:`torchrec_ftrl.rule` (``docs/ftrl.md``).
The kernels are reached only through the :class:`~torchrec_ftrl.kernels.backend.Backend` contract.
Placements (HBM / host, unified memory, unified memory behind an HBM cache): :mod:`torchrec_ftrl.placement`;
the cache: :mod:`torchrec_ftrl.cache`.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid as _uuid
import warnings
from typing import Any, Optional, Sequence

import torch
from torch import nn

from .bounds_check import check_batch
from .cache import UVM_CACHE_STATS, RowCache
from .fbgemm_enums import (BoundsCheckMode, CacheAlgorithm, ComputeDevice, EmbeddingLocation,
                           PoolingMode, SparseType)
from .hyperparams import DEFAULT_LEARNING_RATE, FTRLHyperparams, parse_options
from .kernels.backend import resolve_backend
from .kernels.layout import TableArrays, TBEBatch
from .optim_type import emb_optim_type
from .placement import PLACEMENTS, check_cache_dims, check_cache_options
from .row_layout import RowLayout, require_kernel_layout, warn_dropped_weights
from .derived_weight import DerivedWeight
from .rule import ftrl_encode, ftrl_prox
from .state_dtype import describe, state_sparse_types

__all__ = ["FTRLTableBatchedEmbeddingBags"]

_PRECISIONS = {SparseType.FP32: torch.float32, SparseType.FP16: torch.float16,
               SparseType.BF16: torch.bfloat16}


# FBGEMM TBE attributes TorchRec reaches on some TBEs, with why the FTRL TBE has none (an
# AttributeError naming the reason; ``hasattr`` stays False, as TorchRec's guards expect). See
# docs/managed-collision.md, "TBE hooks TorchRec calls".
_KV_ONLY = ("a key-value / SSD TBE hook (TorchRec calls it only on key-value kernels, and FTRL "
            "tables are refused there at DMP construction)")
_QUANT_ONLY = ("a quantized (INT8 / INT4 inference) TBE hook; the FTRL TBE trains fp32, fp16 or "
               "bf16 weights")
_CACHE_NAMES = ("the fused_uvm_caching cache of the FTRL TBE is `tbe.cache` (torchrec_ftrl.cache."
                "RowCache: lxu_cache_weights, lxu_cache_states, lxu_cache_state); it is not exposed "
                "under FBGEMM's TBE names so that TorchRec's memory stashing (stash_emo_cache) skips "
                "this TBE: that stash frees only the weight cache and rebuilds FBGEMM's prefetch "
                "bookkeeping, which this TBE does not keep")
_NOT_FTRL_HOOKS = {
    "momentum1_dev": "FTRL keeps no momentum; its states are accum_dev (n, the sum of squared "
                     "gradients) and linear_dev (z), see split_optimizer_states()",
    "momentum2_dev": "FTRL keeps no momentum; its states are accum_dev (n) and linear_dev (z)",
    **{name: _CACHE_NAMES for name in ("lxu_cache_weights", "lxu_cache_state", "lxu_cache_locations",
                                       "lxu_cache_locations_list", "lxu_cache_locking_counter",
                                       "timesteps_prefetched")},
    **{name: _KV_ONLY for name in ("create_rocksdb_hard_link_snapshot",
                                   "get_named_split_embedding_weights_snapshot",
                                   "direct_write_embedding", "enrichment_query_id", "tbe_unique_id")},
    **{name: _QUANT_ONLY for name in ("split_embedding_weights_with_scale_bias",
                                      "int8_emb_row_dim_offset", "assign_embedding_weights",
                                      "initialize_weights")},
}


class _FTRLOptimizerState(dict):
    """One table's ``{"accum": ..., "linear": ...}``. A missing key (e.g. row-wise Adagrad's ``"sum"``,
    which TorchRec's ``sync_hash_zch_weights`` reads) raises a ``KeyError`` naming FTRL's states."""

    def __missing__(self, key):
        raise KeyError(f"{key!r}: the FTRL optimizer state of a table has 'accum' and 'linear' only "
                       f"(FTRL recomputes the weight from both, so one state alone cannot be synced "
                       f"or averaged)")


def _short(values: list) -> str:
    return repr(values) if len(values) <= 12 else f"{values[:12]!r}... ({len(values)} values)"


def _as_sparse_type(name: str, value: Any) -> SparseType:
    if isinstance(value, torch.dtype):
        for k, v in _PRECISIONS.items():
            if v == value:
                return k
    if isinstance(value, SparseType) and value in _PRECISIONS:
        return value
    raise ValueError(f"{name} must be SparseType.FP32, FP16 or BF16 (or the torch dtype), got {value!r}")


def _enum_member(name: str, enum_cls, value: Any, allowed: Sequence) -> Any:
    """``enum_cls(value)`` when it is one of ``allowed``; else ``ValueError`` naming ``name``, the
    allowed members and the value."""
    try:
        member = enum_cls(value)
    except ValueError:
        member = None
    if member not in allowed:
        names = ", ".join(m.name for m in allowed)
        raise ValueError(f"{name} must be {enum_cls.__name__} {names}, got {value!r}")
    return member


def _check_int_vector(name: str, t: Any, device: torch.device, cpu_too: bool = False) -> None:
    """Raises ValueError, naming ``name`` and the value, unless ``t`` is a 1-D int32/int64 tensor on
    ``device`` (or, with ``cpu_too``, on the CPU)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got dtype={t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape={tuple(t.shape)}")
    if cpu_too and t.device.type != "cpu" and t.device != device:
        raise ValueError(f"{name} must be on the CPU or on {device} (the tables' device), got "
                         f"device={t.device}")
    if not cpu_too and t.device != device:
        raise ValueError(f"{name} must be on {device} (the tables' device), got device={t.device}")


def _allocate(numel: int, dtype: torch.dtype, device: torch.device, unified: bool,
              host_mapped: bool) -> torch.Tensor:
    """An uninitialised flat buffer on ``device``, or in unified memory (FBGEMM's
    ``new_unified_tensor``: managed memory, or host-mapped with ``host_mapped``)."""
    if not unified:
        return torch.empty(numel, dtype=dtype, device=device)
    like = torch.zeros(1, dtype=dtype, device=device)
    return torch.ops.fbgemm.new_unified_tensor(like, [numel], host_mapped)


def _flush_before_state_dict(module, prefix, keep_vars) -> None:
    module.flush()


def _empty_cache_after_load(module, incompatible_keys) -> None:
    # The loaded tables replace what the cache held: drop it without writing back.
    module.reset_cache_states()


class _FTRLLookupFunction(torch.autograd.Function):
    """Autograd glue: forward = pooled lookup; backward = FTRL update in place (no weight grad)."""

    @staticmethod
    def forward(ctx, placeholder, module, batch, per_sample_weights, train, cache_keys):  # noqa: D401
        ctx.module, ctx.batch, ctx.cache_keys = module, batch, cache_keys
        ctx.psw_needs_grad = per_sample_weights is not None and per_sample_weights.requires_grad
        backend, out_dtype = module._backend, module._output_torch_dtype
        if not train:
            ctx.backend_ctx = None
            return backend.forward(module.table_arrays, batch, out_dtype, module._hp)
        out, ctx.backend_ctx = backend.forward_train(module.table_arrays, batch, out_dtype, module._hp)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        module, batch, bctx = ctx.module, ctx.batch, ctx.backend_ctx
        if ctx.cache_keys is not None:
            batch = module._relocate_cached_rows(batch, *ctx.cache_keys)
        grad_out = grad_out.contiguous().reshape(-1)
        backend = module._backend
        arrays = module.table_arrays
        grad_psw = (backend.per_sample_weight_grad(arrays, batch, bctx, grad_out, module._hp)
                    if ctx.psw_needs_grad else None)
        backend.backward_update_(arrays, batch, bctx, grad_out, module._hp, module.nonfinite_grad_rows)
        if ctx.cache_keys is not None:
            module._after_cached_update(*ctx.cache_keys)
        module.iter += 1
        return None, None, None, grad_psw, None, None


class FTRLTableBatchedEmbeddingBags(nn.Module):
    r"""Table-batched embedding bags trained by fused FTRL-Proximal.

    Args:
        embedding_specs: one ``(rows, dim)`` per table, or FBGEMM's ``(rows, dim, location,
            compute_device)`` (compute device ignored). Location (:mod:`torchrec_ftrl.placement`),
            one for all tables: ``DEVICE`` / ``HOST`` (default): the tables live on ``device``;
            ``MANAGED`` (``fused_uvm``): in unified memory; ``MANAGED_CACHING``
            (``fused_uvm_caching``): in unified memory with an HBM cache of whole rows. Both UVM
            placements need a CUDA ``device``; caching needs dims that are multiples of 4. Any
            ``dim >= 1`` otherwise.
        feature_table_map: table of each feature (several features may share a table); default one
            feature per table.
        pooling_mode: FBGEMM ``PoolingMode`` SUM, MEAN or NONE (NONE needs one dim for all tables).
        weights_precision: ``SparseType`` FP32, FP16 or BF16 for the weights.
        output_dtype: ``SparseType`` FP32, FP16 or BF16 of the forward output.
        learning_rate, ftrl_*: the FTRL knobs, named and validated as in :class:`torchrec_ftrl.FTRL`.
        bounds_check_mode: FBGEMM ``BoundsCheckMode``. FATAL (default) raises ``ValueError`` for an
            index out of ``[0, rows)`` or malformed offsets before anything changes (on CUDA this is one
            host sync per forward); WARNING replaces bad indices by 0 and clamps offsets as FBGEMM does,
            counting them in ``bounds_check_warning`` with no host sync; IGNORE trusts the input: an
            index out of range, or offsets that are not non-decreasing from 0 to ``indices.numel()``,
            is undefined behaviour (the kernels may read or write outside the tables), as in FBGEMM.
        device: where weights and states live (default CPU).
        backend: ``"triton"`` (CUDA default), ``"cpp"`` (CPU default, compiled at first use), ``"torch"``.
        table_names: optional names (for messages and export).
        deterministic: request bitwise-reproducible backward (the CPU kernels always are).
        cache_load_factor, cache_sets, cache_algorithm, cache_reserved_memory, cache_precision,
            prefetch_pipeline, gather_uvm_cache_stats: the ``MANAGED_CACHING`` cache, as in FBGEMM:
            ``cache_sets`` sets of 32 rows (0: ``ceil(rows x cache_load_factor / 32)``), LRU or
            LFU, HBM bytes to leave free, the weight cache's precision (the weights' own; None
            means that), lines of a prefetched batch locked until its update (LRU only), and
            :meth:`get_uvm_cache_stats` counting. Ignored by the other placements.
        uvm_host_mapped: UVM placements allocate host-mapped memory instead of managed memory.
        optimizer_state_dtypes: the storage dtype of each FTRL state, FBGEMM's keyword with FTRL's
            state names: ``{"accum": SparseType.BF16, "linear": SparseType.BF16}`` (either state
            alone, ``torch.dtype`` values, or TorchRec's hashable frozenset of ``(state,
            SparseType.as_int())`` pairs; :func:`torchrec_ftrl.state_dtype.parse_state_dtypes`).
            None (default): fp32 both. Only fp32 and bf16 (fp16 is refused: ``accum`` overflows
            it). The buffers ``accum_dev`` / ``linear_dev`` (and the ``MANAGED_CACHING`` state cache)
            hold that dtype; the update loads them exactly into fp32, computes in fp32 and stores a
            bf16 state with stochastic rounding by the hash ``sr_bits(row key, column, iter,
            state)`` (:mod:`torchrec_ftrl.state_dtype`; ``iter`` read on the device, so CUDA-graph
            replays round with fresh steps), the same bits on every backend for the same fp32
            value. ``initial_accumulator_value`` and :meth:`reset_optimizer_state` round to nearest.
            Exposed as ``optimizer_state_dtypes`` (``{"accum": SparseType, "linear": SparseType}``).
        ftrl_weights, ftrl_accumulator: the row layout (:class:`torchrec_ftrl.row_layout.RowLayout`,
            exposed as ``row_layout``): ``"stored"`` / ``"derived"`` weights and an
            ``"elementwise"`` / ``"rowwise"`` ``accum`` (defaults ``"stored"``, ``"elementwise"``).
            Derived weights: no weight buffer (``weights_dev`` is empty); every lookup computes
            ``w = prox(linear, accum)`` (McMahan et al. 2013, Algorithm 1), so a learning-rate or
            knob change applies to every row's weight at once. A row-wise ``accum`` holds one n per
            row (``accum_dev`` ``[total rows]``). ``MANAGED_CACHING`` takes the default layout only;
            a layout the backend does not implement raises ``ValueError``.

    Forward (``indices``, ``offsets`` int32/int64 1-D, FBGEMM layout, feature-major bags):
        returns ``[B, sum(D_f)]`` for SUM/MEAN, ``[N, D]`` for NONE, or FBGEMM's flat VBE output
        (ranks, then features, then samples) when ``batch_size_per_feature_per_rank`` is given.

    NaN/Inf policy: a touched row whose summed gradient has a NaN or Inf is skipped (weight, accum
    and linear bit-for-bit unchanged) and counted in ``nonfinite_grad_rows``; other rows update.

    CUDA graphs: with the Triton backend no kernel of a step waits on the host, so a training step
    (forward and backward) whose ``indices`` / ``offsets`` keep their shapes can be captured with
    ``torch.cuda.graph`` after one eager warm-up step, and replayed after copying each new batch into
    the captured input tensors; replays are bitwise equal to eager steps. A replay uses the learning
    rate and ``ftrl_*`` knobs of its capture. ``bounds_check_mode=FATAL``, ``MANAGED_CACHING`` and
    VBE batches are refused (``RuntimeError``) under capture. See ``docs/performance.md``.

    ``MANAGED_CACHING``: each forward populates the cache with its batch's rows (or takes the batch
    :meth:`prefetch` brought in), reads every row where it is (cache or unified memory), and the
    update reaches each row where it is now: at the forward's slots, or, when a populate (a
    prefetch), an invalidation or a reset came in between, at slots looked up again. Results are
    bitwise those of the ``DEVICE`` placement. Reads of the full tables
    (:meth:`split_embedding_weights`, :meth:`split_optimizer_states`, ``state_dict``) flush the
    cache; ``load_state_dict`` empties it.

    Raises:
        ValueError: bad constructor arguments or inputs, naming the argument and the value. Nothing
            is modified by a call that raises.
    """

    def __init__(
        self,
        embedding_specs: Sequence[Sequence[Any]],
        feature_table_map: Optional[Sequence[int]] = None,
        pooling_mode: PoolingMode = PoolingMode.SUM,
        weights_precision: SparseType = SparseType.FP32,
        output_dtype: SparseType = SparseType.FP32,
        learning_rate: float = DEFAULT_LEARNING_RATE,
        ftrl_learning_rate_power: float = -0.5,
        ftrl_l1_reg: float = 0.0,
        ftrl_l2_reg: float = 0.0,
        ftrl_beta: float = 0.0,
        ftrl_l2_shrinkage: float = 0.0,
        ftrl_initial_accumulator_value: float = 0.0,
        ftrl_l2_convention: str = "tensorflow",
        bounds_check_mode: BoundsCheckMode = BoundsCheckMode.FATAL,
        device: Optional[torch.device | str] = None,
        backend: Optional[str] = None,
        table_names: Optional[Sequence[str]] = None,
        deterministic: bool = False,
        cache_load_factor: float = 0.2,
        cache_sets: int = 0,
        cache_algorithm: CacheAlgorithm = CacheAlgorithm.LRU,
        cache_reserved_memory: float = 0.0,
        cache_precision: Optional[SparseType] = None,
        prefetch_pipeline: bool = False,
        gather_uvm_cache_stats: bool = False,
        uvm_host_mapped: bool = False,
        optimizer_state_dtypes: Any = None,
        ftrl_weights: str = "stored",
        ftrl_accumulator: str = "elementwise",
    ) -> None:
        super().__init__()
        self._hp = parse_options(dict(
            learning_rate=learning_rate, ftrl_learning_rate_power=ftrl_learning_rate_power,
            ftrl_l1_reg=ftrl_l1_reg, ftrl_l2_reg=ftrl_l2_reg, ftrl_beta=ftrl_beta,
            ftrl_l2_shrinkage=ftrl_l2_shrinkage,
            ftrl_initial_accumulator_value=ftrl_initial_accumulator_value,
            ftrl_l2_convention=ftrl_l2_convention), where="FTRLTableBatchedEmbeddingBags(...)")
        where = "FTRLTableBatchedEmbeddingBags(...)"
        self.row_layout = RowLayout.from_options(dict(
            ftrl_weights=ftrl_weights, ftrl_accumulator=ftrl_accumulator,
            optimizer_state_dtypes=optimizer_state_dtypes), where)
        self._state_dtypes = self.row_layout.state_dtypes
        self.optimizer_state_dtypes = state_sparse_types(self._state_dtypes)
        if not embedding_specs:
            raise ValueError("embedding_specs must name at least one table, got []")
        rows_dims, locations = [], set()
        for t, spec in enumerate(embedding_specs):
            if not isinstance(spec, (tuple, list)) or len(spec) not in (2, 4):
                raise ValueError(f"embedding_specs[{t}] must be (rows, dim) or (rows, dim, location, "
                                 f"compute_device), got {spec!r}")
            rows, dim = spec[0], spec[1]
            if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
                raise ValueError(f"embedding_specs[{t}] rows must be an int >= 1, got {rows!r}")
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                raise ValueError(f"embedding_specs[{t}] dim must be an int >= 1, got {dim!r}")
            rows_dims.append((rows, dim))
            if len(spec) == 4:
                if not isinstance(spec[2], EmbeddingLocation):
                    raise ValueError(f"embedding_specs[{t}] location must be an EmbeddingLocation, "
                                     f"got {spec[2]!r}")
                locations.add(spec[2])
        uvm_locations = locations & {EmbeddingLocation.MANAGED, EmbeddingLocation.MANAGED_CACHING}
        if not locations <= set(PLACEMENTS) or (uvm_locations and len(locations) > 1):
            raise ValueError(f"embedding_specs locations must be one of DEVICE/HOST, MANAGED or "
                             f"MANAGED_CACHING for all tables, got {sorted(x.name for x in locations)}")
        T = len(rows_dims)
        if feature_table_map is None:
            feature_table_map = list(range(T))
        feature_table_map = [int(t) for t in feature_table_map]
        bad = [t for t in feature_table_map if not 0 <= t < T]
        if not feature_table_map or bad:
            raise ValueError(f"feature_table_map entries must be table ids in [0, {T}), got "
                             f"{feature_table_map!r}")
        pooling_mode = _enum_member("pooling_mode", PoolingMode, pooling_mode,
                                    (PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE))
        if pooling_mode == PoolingMode.NONE and len({d for _, d in rows_dims}) != 1:
            raise ValueError(f"pooling_mode=NONE needs one dim for all tables, got dims "
                             f"{[d for _, d in rows_dims]}")
        bounds_check_mode = _enum_member("bounds_check_mode", BoundsCheckMode, bounds_check_mode,
                                         (BoundsCheckMode.FATAL, BoundsCheckMode.WARNING,
                                          BoundsCheckMode.IGNORE, BoundsCheckMode.NONE))
        if table_names is not None and len(table_names) != T:
            raise ValueError(f"table_names must have {T} names, got {list(table_names)!r}")

        device = torch.device(device) if device is not None else torch.device("cpu")
        placement = uvm_locations.pop() if uvm_locations else None
        if placement is not None and device.type != "cuda":
            raise ValueError(f"embedding_specs location {placement.name} (unified memory) needs a CUDA "
                             f"device, got device={device}")
        if placement == EmbeddingLocation.MANAGED_CACHING:   # before anything is allocated
            check_cache_options(cache_load_factor, cache_sets,
                                cache_algorithm, prefetch_pipeline, where="FTRLTableBatchedEmbeddingBags")
            check_cache_dims([d for _, d in rows_dims])
        self.weights_precision = _as_sparse_type("weights_precision", weights_precision)
        if placement == EmbeddingLocation.MANAGED_CACHING and cache_precision is not None and \
                _as_sparse_type("cache_precision", cache_precision) != self.weights_precision:
            raise ValueError(f"cache_precision must equal weights_precision "
                             f"({self.weights_precision.name}) or be None: the FTRL cache holds rows "
                             f"in the weights' precision, got {cache_precision!r}")
        self.output_dtype = _as_sparse_type("output_dtype", output_dtype)
        self._output_torch_dtype = _PRECISIONS[self.output_dtype]
        self.pooling_mode = pooling_mode
        self.bounds_check_mode = bounds_check_mode
        self.feature_table_map = feature_table_map
        self.table_names = list(table_names) if table_names is not None else [f"t{t}" for t in range(T)]
        self.deterministic = bool(deterministic)
        location = placement if placement is not None else (
            EmbeddingLocation.DEVICE if device.type == "cuda" else EmbeddingLocation.HOST)
        compute = ComputeDevice.CUDA if device.type == "cuda" else ComputeDevice.CPU
        self.embedding_specs = [(r, d, location, compute) for r, d in rows_dims]
        self._total_rows = sum(r for r, _ in rows_dims)
        self._table_dims = tuple(d for _, d in rows_dims)
        self.backend, self._backend = resolve_backend(backend, device)
        if placement == EmbeddingLocation.MANAGED_CACHING and not self._backend.CAPABILITIES.cached_placement:
            raise ValueError(f"embedding_specs location MANAGED_CACHING runs on the triton backend, "
                             f"got backend={backend!r}")
        require_kernel_layout(self.row_layout, where, self._backend.CAPABILITIES, self.backend,
                              cached=placement == EmbeddingLocation.MANAGED_CACHING)

        sizes = [r * d for r, d in rows_dims]
        offs = [0]
        for s in sizes[:-1]:
            offs.append(offs[-1] + s)
        self.weights_physical_offsets = offs
        self.weights_offsets = offs
        dims_f = [rows_dims[t][1] for t in feature_table_map]
        self.D_offsets = [0]
        for d in dims_f:
            self.D_offsets.append(self.D_offsets[-1] + d)
        self.total_D = self.D_offsets[-1]
        self.max_D = max(d for _, d in rows_dims)

        i64 = dict(dtype=torch.int64, device=device)
        self.register_buffer("_table_w_offset", torch.tensor(offs, **i64), persistent=False)
        self.register_buffer("_table_dim", torch.tensor([d for _, d in rows_dims], **i64), persistent=False)
        self.register_buffer("_table_rows", torch.tensor([r for r, _ in rows_dims], **i64), persistent=False)
        self.register_buffer("_table_row_base", torch.tensor(
            [sum(r for r, _ in rows_dims[:t]) for t in range(T)], **i64), persistent=False)
        self.register_buffer("_feature_table", torch.tensor(feature_table_map, **i64), persistent=False)
        self._plain_layout_cache = None   # ((B, device), bag_feature, bag_out_offset) of the last batch
        self._captured_hp: Optional[FTRLHyperparams] = None   # knobs a CUDA graph captured (see forward)
        self.register_buffer("_feature_dim", torch.tensor(dims_f, **i64), persistent=False)
        self.register_buffer("_D_offsets", torch.tensor(self.D_offsets, **i64), persistent=False)
        total = sum(sizes)
        wdtype = _PRECISIONS[self.weights_precision]
        # Under the UVM placements these buffers are in unified memory (FBGEMM's weights_uvm).
        alloc = functools.partial(_allocate, device=device, unified=placement is not None,
                                  host_mapped=bool(uvm_host_mapped))
        layout = self.row_layout
        self.register_buffer("weights_dev", alloc(total if layout.weights == "stored" else 0, wdtype))
        accum_numel = self._total_rows if layout.accumulator == "rowwise" else total
        self.register_buffer("accum_dev", alloc(accum_numel, self._state_dtypes["accum"]).fill_(
            self._hp.initial_accumulator_value))
        self.register_buffer("linear_dev", alloc(total, self._state_dtypes["linear"]).zero_())
        self.prefetch_pipeline = bool(prefetch_pipeline)
        self._prefetched: list[tuple[torch.Tensor, torch.Tensor]] = []   # (keys, slots) per batch
        self._prefetch_stream = None
        self.cache: Optional[RowCache] = None
        if placement == EmbeddingLocation.MANAGED_CACHING:
            self.cache = RowCache(
                [r for r, _ in rows_dims], [d for _, d in rows_dims], feature_table_map,
                self._table_w_offset, wdtype, cache_load_factor, cache_sets, cache_algorithm,
                prefetch_pipeline, cache_reserved_memory, gather_uvm_cache_stats, device,
                state_dtypes=self._state_dtypes)
            self.cache.reset_states(self._hp.initial_accumulator_value)
            self.register_state_dict_pre_hook(_flush_before_state_dict)
            self.register_load_state_dict_post_hook(_empty_cache_after_load)
        self.register_buffer("bounds_check_warning", torch.zeros(1, **i64))
        # What a fused FATAL check counts (read once per forward; zero while batches are valid).
        self.register_buffer("_fatal_count", torch.zeros(1, **i64), persistent=False)
        self.register_buffer("nonfinite_grad_rows", torch.zeros(1, **i64))
        self.register_buffer("iter", torch.zeros(1, **i64))
        # Makes the output require grad so backward (the fused update) runs, as in FBGEMM.
        self.placeholder_autograd_tensor = nn.Parameter(torch.zeros(0, device=device))
        self._init_uniform(-0.01, 0.01, warn=False)   # FBGEMM's default initialisation

    # ------------------------------------------------------------------ attributes TorchRec reads
    @property
    def weights_host(self) -> torch.Tensor:
        return self.weights_dev

    @property
    def weights_uvm(self) -> torch.Tensor:
        return self.weights_dev

    @property
    def weights(self) -> torch.Tensor:
        return self.weights_dev

    @property
    def table_arrays(self) -> TableArrays:
        """The flat arrays the kernels read and update, by :attr:`row_layout`."""
        return TableArrays(self.weights_dev if self.row_layout.weights == "stored" else None,
                           self.accum_dev, self.linear_dev, self.row_layout.accumulator == "rowwise")

    @property
    def optimizer(self):
        """``EmbOptimType.FTRL``."""
        return emb_optim_type()

    @property
    def hyperparams(self) -> FTRLHyperparams:
        return self._hp

    @property
    def learning_rate(self) -> float:
        return self._hp.learning_rate

    # ------------------------------------------------------------------ forward
    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor] = None,
                feature_requires_grad: Optional[torch.Tensor] = None,
                batch_size_per_feature_per_rank: Optional[Sequence[Sequence[int]]] = None,
                **unused: Any) -> torch.Tensor:
        """Pooled (or sequence) lookup; see the class docstring for shapes. ``feature_requires_grad``
        is accepted for FBGEMM compatibility and ignored (every feature's table is trained)."""
        capturing = self.linear_dev.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing:
            self._check_capturable(batch_size_per_feature_per_rank)
        batch = self._make_batch(indices, offsets, per_sample_weights, batch_size_per_feature_per_rank)
        cache_keys, release = None, None
        train = torch.is_grad_enabled() and self.placeholder_autograd_tensor.requires_grad
        if capturing and train:
            self._captured_hp = self._hp     # the knobs the captured update will replay
        if self.cache is not None:
            batch, keys, locked = self._cached_batch(batch, batch_size_per_feature_per_rank)
            gen = self.cache.generation         # the slots in batch are valid while it lasts
            if train and self.training:
                cache_keys = (keys, locked, gen)    # the update releases the lines
            else:                                   # no update is expected: released after the lookup
                cache_keys, release = ((keys, [], gen) if train else None), locked
        out = _FTRLLookupFunction.apply(self.placeholder_autograd_tensor, self, batch, per_sample_weights,
                                        train, cache_keys)
        if batch.unchecked_counter is self._fatal_count:
            self._raise_if_counted(batch)
        if release is not None:
            self._release(release)
        if self.pooling_mode == PoolingMode.NONE:
            return out.view(-1, self.max_D)
        if batch_size_per_feature_per_rank is not None:
            return out
        return out.view(-1, self.total_D)

    def _check_capturable(self, bsfpr) -> None:
        """Refuse, before any work, what a CUDA graph cannot replay.

        A captured training step replays its kernels with the learning rate and ``ftrl_*`` knobs of
        the capture (they are kernel arguments), so the forward remembers them and
        :meth:`set_learning_rate` and :meth:`update_hyper_parameters` warn after such a capture.

        Raises:
            RuntimeError: ``bounds_check_mode=FATAL`` (it reads its count on the host), the
                ``MANAGED_CACHING`` placement (FBGEMM's cache ops), a VBE batch (its layout is built
                on the host), or a backend other than ``"triton"``.
        """
        why = None
        if not self._backend.CAPABILITIES.graph_capture:
            why = f"backend={self.backend!r} (only 'triton' is capturable)"
        elif self.bounds_check_mode == BoundsCheckMode.FATAL:
            why = ("bounds_check_mode=FATAL (it reads its count on the host once per forward; use "
                   "WARNING or IGNORE)")
        elif self.cache is not None:
            why = "the MANAGED_CACHING placement (fused_uvm_caching)"
        elif bsfpr is not None:
            why = "batch_size_per_feature_per_rank (VBE: the layout is built on the host)"
        if why is not None:
            raise RuntimeError(f"FTRLTableBatchedEmbeddingBags cannot be captured in a CUDA graph with {why}")

    def _warn_if_captured(self) -> None:
        if self._captured_hp is not None and self._hp != self._captured_hp:
            warnings.warn("FTRL hyper-parameters changed after a CUDA graph captured this TBE's step: "
                          "graphs captured before replay the old values (learning rate and ftrl_* "
                          "knobs are kernel arguments); capture the step again", stacklevel=3)

    def _make_batch(self, indices, offsets, per_sample_weights, bsfpr,
                    warn_counter: Optional[torch.Tensor] = None) -> TBEBatch:
        """The checked batch (``warn_counter``: where WARNING repairs are counted, default
        ``bounds_check_warning``)."""
        dev = self.linear_dev.device
        F = len(self.feature_table_map)
        for name, t in (("indices", indices), ("offsets", offsets)):
            _check_int_vector(name, t, dev)
        if offsets.numel() < 1:
            raise ValueError("offsets must have at least 1 element, got shape=(0,)")
        N, num_bags = indices.numel(), offsets.numel() - 1
        if per_sample_weights is not None:
            if not isinstance(per_sample_weights, torch.Tensor) or not per_sample_weights.is_floating_point():
                raise ValueError(f"per_sample_weights must be a floating-point tensor, got "
                                 f"{getattr(per_sample_weights, 'dtype', type(per_sample_weights))}")
            if per_sample_weights.device != dev:
                raise ValueError(f"per_sample_weights must be on {dev}, got device={per_sample_weights.device}")
            if tuple(per_sample_weights.shape) != (N,):
                raise ValueError(f"per_sample_weights must have shape ({N},) like indices, got "
                                 f"shape={tuple(per_sample_weights.shape)}")
            if self.pooling_mode == PoolingMode.NONE:
                raise ValueError("per_sample_weights is not supported with pooling_mode=NONE")
        # The kernels index flat memory: strided views (e.g. a column of a 2-D tensor) are copied.
        offsets64 = offsets.long().contiguous()
        indices64 = indices.long().contiguous()
        if bsfpr is not None:
            if self.pooling_mode == PoolingMode.NONE:
                raise ValueError("batch_size_per_feature_per_rank (VBE) needs pooling SUM or MEAN")
            bag_feature, bag_out_offset, out_numel = self._vbe_layout(bsfpr, num_bags)
        else:
            if num_bags % F != 0:
                raise ValueError(f"offsets must have num_features * B + 1 = {F} * B + 1 elements, got "
                                 f"{offsets.numel()}")
            B = num_bags // F
            bag_feature, bag_out_offset = self._plain_layout(B)
            out_numel = N * self.max_D if self.pooling_mode == PoolingMode.NONE else B * self.total_D
        needs_psw_grad = per_sample_weights is not None and per_sample_weights.requires_grad
        unchecked_counter = None
        fatal = self.bounds_check_mode == BoundsCheckMode.FATAL
        counter = (self._fatal_count if fatal else self.bounds_check_warning) \
            if warn_counter is None else warn_counter
        # A cached batch is checked here: FBGEMM's populate reads the indices before any kernel.
        if self.cache is None and self._backend.fuses_bounds_check(self.bounds_check_mode,
                                                                    needs_psw_grad):
            unchecked_counter = counter   # the backend checks and counts
        else:
            indices64, offsets64 = self._bounds_check(indices64, offsets64, bag_feature, counter)
        return TBEBatch(
            table_w_offset=self._table_w_offset, table_dim=self._table_dim,
            table_rows=self._table_rows, feature_table=self._feature_table,
            bag_feature=bag_feature, bag_out_offset=bag_out_offset, indices=indices64,
            offsets=offsets64,
            per_sample_weights=(per_sample_weights.detach().float().contiguous()
                                if per_sample_weights is not None else None),
            pooling_mode=int(self.pooling_mode), out_numel=out_numel, max_D=self.max_D,
            total_rows=self._total_rows, table_dims=self._table_dims,
            table_row_base=self._table_row_base, unchecked_counter=unchecked_counter,
            step=self.iter)

    # ------------------------------------------------------------------ the UVM-caching placement
    def _cached_batch(self, batch: TBEBatch, bsfpr) -> tuple[TBEBatch, torch.Tensor, list]:
        """``batch`` with its rows' cache slots, the row keys, and the slot tensors whose lines
        populates locked for it (``prefetch_pipeline``; released after its update).

        Without a prefetched batch, the cache is populated for this one. With one, the oldest is
        taken (its populate brought this batch's rows in) and this batch's rows are looked up, so a
        prefetched batch that is not this one (a prefetch left over from a training loop) costs
        cache hits, never a wrong row. A VBE batch is populated again: TorchRec's pooled lookup
        prefetches it without its batch sizes, so the prefetch cached other rows."""
        bags = self._bags_per_feature(bsfpr)
        keys = self.cache.linearize(batch.indices, batch.offsets, bags)
        populate = functools.partial(self.cache.populate, keys, self.weights_dev, self.accum_dev,
                                     self.linear_dev)
        if self._prefetched:
            _, prefetched = self._prefetched.pop(0)
            if self._prefetch_stream is not None:
                torch.cuda.current_stream().wait_stream(self._prefetch_stream)
            if bsfpr is None:
                slots, locked = self.cache.lookup(keys), [prefetched]
            else:
                slots = populate()
                locked = [prefetched, slots]
        else:
            slots = populate()
            locked = [slots]
        return dataclasses.replace(batch, cache_locations=slots,
                                   cache_weights=self.cache.lxu_cache_weights,
                                   cache_states=self.cache.lxu_cache_states), keys, locked

    @staticmethod
    def _bags_per_feature(bsfpr) -> Optional[list[int]]:
        return [sum(int(b) for b in per_rank) for per_rank in bsfpr] if bsfpr is not None else None

    def _relocate_cached_rows(self, batch: TBEBatch, keys: torch.Tensor, locked: list,
                              generation: int) -> TBEBatch:
        """The batch for its update, with each row's slot where it is now. Unchanged when no
        populate, invalidation or reset was issued since the forward looked the rows up (cache
        ``generation``): the forward's slots still hold. Otherwise the prefetch of a later batch is
        waited for and the rows are looked up again (a row may have been evicted, and written back,
        or cached since the forward)."""
        if self.cache.generation == generation:
            return batch
        if self._prefetch_stream is not None:
            torch.cuda.current_stream().wait_stream(self._prefetch_stream)
        return dataclasses.replace(batch, cache_locations=self.cache.lookup(keys, count=False))

    def _after_cached_update(self, keys: torch.Tensor, locked: list, generation: int) -> None:
        """After a cached batch's update: release its lines, and make the prefetch stream wait for
        the update (a later prefetch must not copy a row into the cache while it is updated)."""
        self._release(locked)
        if self._prefetch_stream is not None:
            self._prefetch_stream.wait_stream(torch.cuda.current_stream())

    def _release(self, locked: list) -> None:
        for slots in locked:
            self.cache.unlock(slots)

    def prefetch(self, indices: torch.Tensor, offsets: torch.Tensor,
                 forward_stream: Optional[torch.cuda.Stream] = None,
                 batch_size_per_feature_per_rank: Optional[Sequence[Sequence[int]]] = None) -> None:
        """Bring a batch's rows into the HBM cache ahead of its :meth:`forward` (FBGEMM's
        ``prefetch``; TorchRec's ``PrefetchTrainPipelineSparseDist`` calls it on its prefetch
        stream). Each forward takes the oldest prefetched batch. With ``prefetch_pipeline=True``
        the batch's lines stay locked until its update. A no-op for the other placements.

        The prefetch only warms the cache: out-of-range indices are read as row 0 here (the forward
        checks its batch by ``bounds_check_mode``), and a batch whose bag count does not fit the
        features (a VBE batch given without its batch sizes) is skipped.

        Raises:
            ValueError: ``forward_stream`` (a prefetch on its own stream, overlapping the forward of
                the batch before) without ``prefetch_pipeline=True``, which keeps that batch's rows
                from being evicted under it; indices / offsets that are not 1-D int tensors on the
                tables' device.
        """
        if self.cache is None:
            return
        if forward_stream is not None and not self.prefetch_pipeline:
            raise ValueError("prefetch(forward_stream=...) overlaps the previous batch's forward and "
                             "needs prefetch_pipeline=True (LRU line locking); got "
                             "prefetch_pipeline=False")
        if forward_stream is not None and self._prefetch_stream is None:
            self._prefetch_stream = torch.cuda.current_stream()
        F = len(self.feature_table_map)
        if batch_size_per_feature_per_rank is None and (offsets.numel() - 1) % F != 0:
            return
        mode, self.bounds_check_mode = self.bounds_check_mode, BoundsCheckMode.WARNING
        try:
            batch = self._make_batch(indices, offsets, None, batch_size_per_feature_per_rank,
                                     warn_counter=torch.zeros_like(self.bounds_check_warning))
        finally:
            self.bounds_check_mode = mode
        keys = self.cache.linearize(batch.indices, batch.offsets,
                                    self._bags_per_feature(batch_size_per_feature_per_rank))
        slots = self.cache.populate(keys, self.weights_dev, self.accum_dev, self.linear_dev)
        if forward_stream is not None:
            keys.record_stream(forward_stream)
            slots.record_stream(forward_stream)
        self._prefetched.append((keys, slots))

    def get_uvm_cache_stats(self) -> torch.Tensor:
        """int64 ``[6]`` cumulative FBGEMM cache statistics (``torchrec_ftrl.cache.UVM_CACHE_STATS``:
        calls, requested indices, unique indices, unique misses, conflict unique misses, conflict
        misses), counted when ``gather_uvm_cache_stats=True``; zeros otherwise or uncached."""
        if self.cache is None:
            return torch.zeros(len(UVM_CACHE_STATS), dtype=torch.int64)
        return self.cache.uvm_cache_stats.clone()

    def _plain_layout(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bag_feature, bag_out_offset)`` of ``F * B`` bags in the ``[B, total_D]`` output; the
        last batch size's pair is kept (device tensors, never modified)."""
        dev = self.linear_dev.device
        if self._plain_layout_cache is None or self._plain_layout_cache[0] != (B, dev):
            ar = torch.arange(B * len(self.feature_table_map), device=dev)
            bag_feature = ar // max(B, 1)
            bag_out_offset = (ar % max(B, 1)) * self.total_D + self._D_offsets[bag_feature]
            self._plain_layout_cache = ((B, dev), bag_feature, bag_out_offset)
        return self._plain_layout_cache[1], self._plain_layout_cache[2]

    def _vbe_layout(self, bsfpr, num_bags):
        F = len(self.feature_table_map)
        try:
            sizes = [[int(b) for b in per_rank] for per_rank in bsfpr]
        except (TypeError, ValueError):
            raise ValueError(f"batch_size_per_feature_per_rank must be a list of {F} lists of ints, got "
                             f"{bsfpr!r}")
        R = len(sizes[0]) if sizes else 0
        if len(sizes) != F or R == 0 or any(len(s) != R for s in sizes) or any(b < 0 for s in sizes for b in s):
            raise ValueError(f"batch_size_per_feature_per_rank must be {F} lists of the same number of "
                             f"non-negative ints, got {bsfpr!r}")
        total = sum(sum(s) for s in sizes)
        if total != num_bags:
            raise ValueError(f"batch_size_per_feature_per_rank sums to {total} bags but offsets has "
                             f"{num_bags} bags (offsets.numel() - 1)")
        dims = [self.D_offsets[f + 1] - self.D_offsets[f] for f in range(F)]
        # FBGEMM VBE output: rank-major, then feature, then sample.
        rank_feature_start, pos = {}, 0
        for r in range(R):
            for f in range(F):
                rank_feature_start[(r, f)] = pos
                pos += sizes[f][r] * dims[f]
        bag_f, bag_off = [], []
        for f in range(F):
            for r in range(R):
                base = rank_feature_start[(r, f)]
                bag_f.extend([f] * sizes[f][r])
                bag_off.extend(range(base, base + sizes[f][r] * dims[f], dims[f]))
        dev = self.linear_dev.device
        return (torch.tensor(bag_f, dtype=torch.int64).to(dev, non_blocking=True),
                torch.tensor(bag_off, dtype=torch.int64).to(dev, non_blocking=True), pos)

    def _raise_if_counted(self, batch: TBEBatch) -> None:
        """After a forward whose kernels ran the FATAL check (counting into ``_fatal_count``): the
        check's one host sync. A non-zero count raises the check's ``ValueError`` (found again on
        the raw batch, to name the first bad offset or index) before any update has run."""
        if int(self._fatal_count) == 0:
            return
        self._fatal_count.zero_()
        self._bounds_check(batch.indices, batch.offsets, batch.bag_feature, None)
        raise ValueError("the FATAL bounds check counted bad offsets or indices in this batch")

    def _bounds_check(self, indices, offsets, bag_feature, counter):
        return check_batch(self.bounds_check_mode, self._table_rows, self._feature_table, self.table_names,
                           bag_feature, indices, offsets, counter, self._backend)

    # ------------------------------------------------------------------ FBGEMM-shaped API
    def _table_view(self, buf: torch.Tensor, t: int) -> torch.Tensor:
        rows, dim = self.embedding_specs[t][:2]
        off = self.weights_physical_offsets[t]
        return buf[off:off + rows * dim].view(rows, dim)

    def _accum_view(self, t: int) -> torch.Tensor:
        """Table ``t``'s ``accum``: ``[rows, D]``, or ``[rows]`` for a row-wise accumulator."""
        if self.row_layout.accumulator == "elementwise":
            return self._table_view(self.accum_dev, t)
        base = int(self._table_row_base[t])
        return self.accum_dev[base:base + self.embedding_specs[t][0]]

    def split_embedding_weights(self) -> list[torch.Tensor]:
        """Per-table ``[rows, D]`` weights, in table order (the HBM cache is flushed first): views (not
        copies) of the weight buffer when the row layout stores weights; with derived weights,
        :class:`~torchrec_ftrl.derived_weight.DerivedWeight` tensors, which compute
        ``prox(linear, accum)`` when read and encode what is written into them (:meth:`load_weights`)."""
        self.flush()
        T = len(self.embedding_specs)
        if self.row_layout.weights == "stored":
            return [self._table_view(self.weights_dev, t) for t in range(T)]
        return [DerivedWeight(self, t) for t in range(T)]

    @torch.no_grad()
    def derived_weights(self, t: int, rows: Optional[torch.Tensor | slice] = None) -> torch.Tensor:
        """fp32 ``[len(rows), D]`` (``rows``: int64 row ids or a slice; default every row) weights
        ``prox(linear, accum)`` of table ``t`` with the knobs of now (:func:`torchrec_ftrl.rule.ftrl_prox`): the weights the
        kernels use with derived weights. For a table that stores weights they equal the stored
        ones wherever training wrote them (bitwise for fp32 weights and states)."""
        z, n = self._table_view(self.linear_dev, t), self._accum_view(t)
        if rows is not None:
            z, n = z[rows], n[rows]
        if self.row_layout.accumulator == "rowwise":
            n = n.unsqueeze(-1)
        return ftrl_prox(z, n, self._hp).float()

    def split_optimizer_states(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-table ``(accum, linear)`` views (not copies) in their stored dtypes (fp32, or bf16 per
        ``optimizer_state_dtypes``): ``linear`` ``[rows, D]``; ``accum`` ``[rows, D]``, or ``[rows]``
        with a row-wise accumulator (1-D, as TorchRec classifies row-wise state). The HBM cache is
        flushed first."""
        self.flush()
        return [(self._accum_view(t), self._table_view(self.linear_dev, t))
                for t in range(len(self.embedding_specs))]

    def get_optimizer_state(self, *args: Any, **kwargs: Any) -> list[dict[str, torch.Tensor]]:
        """Per-table ``{"accum": [rows, D] or [rows], "linear": [rows, D]}`` views in the stored dtypes
        (``optimizer_state_dtypes``; TensorFlow slot names; see :meth:`split_optimizer_states`)."""
        return [_FTRLOptimizerState(accum=a, linear=z) for a, z in self.split_optimizer_states()]

    def get_learning_rate(self) -> float:
        return self._hp.learning_rate

    def set_learning_rate(self, lr: float) -> None:
        """Raises ValueError (nothing changed) unless ``lr`` is finite and > 0."""
        self._hp = self._hp.with_learning_rate(lr)
        self._warn_if_captured()

    def set_optimizer_step(self, step: int) -> None:
        self.iter.fill_(int(step))

    def update_hyper_parameters(self, params_dict: dict[str, Any]) -> None:
        """Update ``lr``/``learning_rate`` and ``ftrl_*`` knobs atomically: all are validated first.

        Raises:
            ValueError: an unknown key, ``ftrl_initial_accumulator_value`` (it only applies when the
                states are created), or an invalid value; nothing is changed then.
        """
        if "ftrl_initial_accumulator_value" in params_dict:
            raise ValueError("ftrl_initial_accumulator_value only applies when states are created; "
                             "use reset_optimizer_state() after constructing with the new value")
        self._hp = parse_options(params_dict, base=self._hp, strict=True, where="update_hyper_parameters")
        self._warn_if_captured()

    def reset_optimizer_state(self) -> None:
        """accum := initial_accumulator_value (rounded to nearest in a bf16 accum), linear := 0."""
        self.accum_dev.fill_(self._hp.initial_accumulator_value)
        self.linear_dev.zero_()
        if self.cache is not None:
            self.cache.reset_states(self._hp.initial_accumulator_value)

    def flush(self) -> None:
        """Write the HBM cache's rows (weights and states) back to unified memory; they stay cached.
        A no-op for the other placements."""
        if self.cache is not None:
            self.cache.flush(self.weights_dev, self.accum_dev, self.linear_dev)

    def reset_cache_states(self) -> None:
        """Empty the HBM cache without writing it back, and forget prefetched batches (after a
        load has replaced the tables). A no-op for the other placements."""
        if self.cache is not None:
            self.cache.reset()
            self._prefetched.clear()

    def init_embedding_weights_uniform(self, min_val: float, max_val: float) -> None:
        """Weights uniform in ``[min_val, max_val]``; with derived weights, encoded into ``linear``
        (:meth:`load_weights`, which warns once where they cannot be held)."""
        self._init_uniform(min_val, max_val, warn=True)

    @torch.no_grad()
    def _init_uniform(self, min_val: float, max_val: float, warn: bool) -> None:
        if self.row_layout.weights == "stored":
            for w in self.split_embedding_weights():
                w.uniform_(min_val, max_val)
            self.reset_cache_states()
            return
        for t, (rows, dim, *_) in enumerate(self.embedding_specs):
            w = torch.empty(rows, dim, device=self.linear_dev.device).uniform_(min_val, max_val)
            self.load_weights(t, w, warn=warn)

    @torch.no_grad()
    def load_weights(self, t: int, weights: torch.Tensor, warn: bool = True, row_start: int = 0,
                     only_changed: bool = False, row_ids: Optional[torch.Tensor] = None) -> None:
        """Set the weights of table ``t``'s rows ``[row_start, row_start + len(weights))`` (or the int64
        row ids ``row_ids``, ``[k]``) to ``weights`` (``[k, D]``, any float dtype; default the whole
        table).

        A stored-weights table copies them. A derived-weights table keeps ``accum`` and sets
        ``linear`` to the z with ``prox(z, accum) = w`` (:func:`torchrec_ftrl.rule.ftrl_encode`):
        exact up to rounding where ``q(accum) > 0`` (``accum > 0``, ``ftrl_beta > 0`` or an L2 term);
        where ``q == 0`` no z gives a non-zero w, so those rows start at w = 0 (what FTRL does at a
        row's first touch anyway) and, with ``warn``, a one-time ``UserWarning`` says how many non-zero
        weights were dropped. With ``only_changed``, rows whose weights equal ``prox(linear, accum)``
        already keep their ``linear`` bit for bit (a checkpoint load that writes the weights after
        the states restores the states). (The constructor's FBGEMM-style uniform initialisation loads without
        the warning: a derived table with ``accum = 0`` and ``ftrl_beta = 0`` starts at w = 0.)

        Raises:
            ValueError: ``t`` not a table of this TBE, or ``weights`` not ``[k, D]`` within the table.
        """
        T = len(self.embedding_specs)
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < T:
            raise ValueError(f"load_weights: t must be a table id in [0, {T}), got {t!r}")
        rows, dim = self.embedding_specs[t][:2]
        k = weights.shape[0] if isinstance(weights, torch.Tensor) and weights.dim() == 2 else -1
        if k < 0 or weights.shape[1] != dim or not 0 <= row_start <= rows - k:
            shape = list(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise ValueError(f"load_weights: weights of table {self.table_names[t]!r} must be "
                             f"[{rows}, {dim}] (or [k, {dim}] with row_start + k <= {rows}), got {shape} "
                             f"at row_start={row_start}")
        rows_written = slice(row_start, row_start + k)
        if row_ids is not None:
            rows_written = row_ids.to(device=self.linear_dev.device, dtype=torch.int64)
            if rows_written.shape != (k,) or bool(((rows_written < 0) | (rows_written >= rows)).any()):
                raise ValueError(f"load_weights: row_ids must be {k} row ids of table "
                                 f"{self.table_names[t]!r} in [0, {rows}), got {_short(row_ids.tolist())}")
        if self.row_layout.weights == "stored":
            self.flush()
            self._table_view(self.weights_dev, t)[rows_written].copy_(weights)
            self.reset_cache_states()
            return
        n = self._accum_view(t)[rows_written]
        n = n.unsqueeze(-1) if self.row_layout.accumulator == "rowwise" else n
        weights = weights.to(self.linear_dev.device)
        z, dropped = ftrl_encode(weights, n, self._hp)
        table_linear = self._table_view(self.linear_dev, t)
        if only_changed:
            linear = table_linear[rows_written]
            same = (ftrl_prox(linear, n, self._hp) == weights).all(dim=1, keepdim=True)
            z = torch.where(same, linear.to(z.dtype), z)
        table_linear[rows_written] = z.to(table_linear.dtype)
        if dropped and warn:
            warn_dropped_weights(dropped, self.table_names[t])

    # ------------------------------------------------------------------ hooks TorchRec calls
    # (the list, and what each does: docs/managed-collision.md, "TBE hooks TorchRec calls")
    @torch.no_grad()
    def reset_embedding_weight_momentum(self, pruned_indices: torch.Tensor,
                                        pruned_indices_offsets: torch.Tensor,
                                        logical_table_ids: torch.Tensor,
                                        buffer_ids: torch.Tensor) -> None:
        """Start rows afresh: FBGEMM's ``reset_embedding_weight_momentum``, called by TorchRec's
        managed collision at every eviction (``ShardedManagedCollisionEmbedding(Bag)Collection``,
        ``_evict``) and by ITEP's pruning (``torchrec/modules/itep_modules.py``).

        Segment ``k`` (``k < buffer_ids.numel()``) is the rows
        ``pruned_indices[pruned_indices_offsets[b] : pruned_indices_offsets[b + 1]]``, ``b =
        buffer_ids[k]``, of logical table ``f = logical_table_ids[k]``. As in FBGEMM, whose
        ``D_offsets`` / ``weights_offsets`` / ``cache_hash_size_cumsum`` it indexes, a logical table
        is a feature: the rows are those of table ``feature_table_map[f]`` (ITEP passes each table's
        first feature; managed collision passes the table's position in its group, the same thing
        when each table of the TBE has one feature). Each such row gets FTRL's starting point,
        ``w = prox(z = 0) = 0``: weight 0, ``accum`` = ``initial_accumulator_value`` (n0), ``linear``
        0 (FBGEMM zeroes the weight and ``momentum1``, and only for row-wise Adagrad). Every other
        row keeps its bits. Under ``MANAGED_CACHING`` the rows' cached copies (weight and both
        states) are dropped without write-back, so the reset values in unified memory, and
        whatever the caller writes there next through the weight views (TorchRec's managed
        collision re-initialises evicted rows with the table's ``init_fn``), are what the next
        lookup reads. Duplicate rows are fine. No segment, or only empty ones, changes nothing, as
        in FBGEMM.

        Args:
            pruned_indices: int64 (or int32) ``[N]``, row indices within their tables.
            pruned_indices_offsets: int64 (or int32) ``[S + 1]``, non-decreasing, within ``[0, N]``:
                segment ``b`` of ``pruned_indices`` is ``[offsets[b], offsets[b + 1])``.
            logical_table_ids: int32 (or int64) ``[K]``, the logical table (feature) of each reset,
                in ``[0, len(feature_table_map))``.
            buffer_ids: int32 (or int64) ``[K]``, the segment of each reset, in ``[0, S)``.
            Each on the CPU or on the tables' device (FBGEMM moves them to its device). The
            arguments are checked on the host (a few syncs per call when they are on the device).

        Raises:
            ValueError: an argument that is not a 1-D int32/int64 tensor on the CPU or the tables'
                device; ``logical_table_ids`` and ``buffer_ids`` of different lengths; malformed
                offsets; a logical table or segment id out of range; an index outside its table.
                The message names the argument and the value; nothing is changed.
        """
        segments = self._reset_segments(pruned_indices, pruned_indices_offsets, logical_table_ids,
                                        buffer_ids)
        if not segments:
            return
        if self.cache is not None:
            self.cache.invalidate(torch.cat([self._table_row_base[t] + rows for t, rows in segments]))
        n0 = self._hp.initial_accumulator_value
        for t, rows in segments:
            if self.row_layout.weights == "stored":
                self._table_view(self.weights_dev, t).index_fill_(0, rows, 0.0)
            self._accum_view(t).index_fill_(0, rows, n0)
            self._table_view(self.linear_dev, t).index_fill_(0, rows, 0.0)

    def _reset_segments(self, pruned_indices, pruned_indices_offsets, logical_table_ids,
                        buffer_ids) -> list[tuple[int, torch.Tensor]]:
        """``(table, int64 rows on the tables' device)`` of each non-empty reset segment, after
        checking every argument (see :meth:`reset_embedding_weight_momentum`)."""
        where = "reset_embedding_weight_momentum"
        dev = self.linear_dev.device
        args = dict(pruned_indices=pruned_indices, pruned_indices_offsets=pruned_indices_offsets,
                    logical_table_ids=logical_table_ids, buffer_ids=buffer_ids)
        for name, t in args.items():
            _check_int_vector(f"{where}: {name}", t, dev, cpu_too=True)
        tables, bufs = logical_table_ids.tolist(), buffer_ids.tolist()
        if len(tables) != len(bufs):
            raise ValueError(f"{where}: logical_table_ids and buffer_ids must have one entry per reset, "
                             f"got {len(tables)} and {len(bufs)} entries")
        if not tables:
            return []
        offs, N = pruned_indices_offsets.tolist(), pruned_indices.numel()
        if not offs or offs[0] < 0 or offs[-1] > N or any(b < a for a, b in zip(offs, offs[1:])):
            raise ValueError(f"{where}: pruned_indices_offsets must be non-decreasing within [0, "
                             f"pruned_indices.numel()={N}], got {_short(offs)}")
        F = len(self.feature_table_map)
        for k, (f, b) in enumerate(zip(tables, bufs)):
            if not 0 <= f < F:
                raise ValueError(f"{where}: logical_table_ids[{k}]={f} is not a logical table "
                                 f"(feature) of this TBE, [0, {F})")
            if not 0 <= b < len(offs) - 1:
                raise ValueError(f"{where}: buffer_ids[{k}]={b} is not a segment of "
                                 f"pruned_indices_offsets ({len(offs)} offsets: [0, {len(offs) - 1}))")
        indices = pruned_indices.to(dev).long()
        segments = []
        for k, (f, b) in enumerate(zip(tables, bufs)):
            lo, hi, t = offs[b], offs[b + 1], self.feature_table_map[f]
            if hi == lo:
                continue
            rows, n_rows = indices[lo:hi], self.embedding_specs[t][0]
            bad = (rows < 0) | (rows >= n_rows)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"{where}: pruned_indices[{lo + i}]={int(rows[i])} (segment "
                                 f"buffer_ids[{k}]={b}) is out of range [0, {n_rows}) of table "
                                 f"{self.table_names[t]!r} (logical table {f}); {int(bad.sum())} bad "
                                 f"index(es)")
            segments.append((t, rows))
        return segments

    @property
    def uuid(self) -> str:
        """A random ``str(uuid.uuid4())`` naming this TBE, fixed for its lifetime (FBGEMM's ``uuid``;
        TorchRec's raw-id tracker names its consumers by it)."""
        value = self.__dict__.get("_uuid")
        if value is None:
            value = self.__dict__["_uuid"] = str(_uuid.uuid4())
        return value

    def reset_uvm_cache_stats(self) -> None:
        """Zero the statistics :meth:`get_uvm_cache_stats` returns (FBGEMM's
        ``reset_uvm_cache_stats``). A no-op for the other placements."""
        if self.cache is not None:
            self.cache.uvm_cache_stats.zero_()
            self.cache.local_uvm_cache_stats.zero_()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            why = _NOT_FTRL_HOOKS.get(name)
            if why is None:
                raise
            raise AttributeError(f"FTRLTableBatchedEmbeddingBags has no {name!r}: {why}") from None

    def extra_repr(self) -> str:
        return (f"tables={[(r, d) for r, d, *_ in self.embedding_specs]}, pooling={self.pooling_mode.name}, "
                f"precision={self.weights_precision.name}, states=({describe(self._state_dtypes)}), "
                f"backend={self.backend}, hp={self._hp}")
