"""``FTRLTableBatchedEmbeddingBags``: a table-batched embedding (TBE) module with a fused FTRL optimizer.

Forward does the multi-table lookup + pooling; backward sums gradients per touched (table, row) and
applies one FTRL-Proximal update per row in place, never materialising a weight gradient. The API is
shaped after FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` so TorchRec's kernel wrappers and
``EmbeddingFusedOptimizer`` can hold it. The update rule: :mod:`torchrec_ftrl.rule` (``docs/ftrl.md``).
The kernels are reached only through the ops' calls of :mod:`torchrec_ftrl.kernels.calls`.
Placements (HBM / host, unified memory, unified memory behind an HBM cache): :mod:`torchrec_ftrl.placement`;
the cache: :mod:`torchrec_ftrl.cache`.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
from torch import nn

from .cache import RowCache
from .fbgemm_enums import (BoundsCheckMode, CacheAlgorithm, ComputeDevice, EmbeddingLocation,
                           PoolingMode, SparseType)
from .hyperparams import DEFAULT_LEARNING_RATE, FTRLHyperparams, parse_options
from .kernels import calls
from .kernels.backend import resolve_backend
from .kernels.layout import TableArrays
from .optim_type import emb_optim_type
from .row_layout import RowLayout, require_kernel_layout
from .state_dtype import describe, state_sparse_types
from .tbe_args import (_PRECISIONS, _as_sparse_type, _enum_member, check_placement,
                       parse_embedding_specs, parse_feature_table_map)
from .tbe_batch import BatchMixin
from .tbe_cached import CachedLookupMixin
from .tbe_tables import TableAPIMixin

__all__ = ["FTRLTableBatchedEmbeddingBags"]


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


def _allocate(numel: int, dtype: torch.dtype, device: torch.device, unified: bool,
              host_mapped: bool) -> torch.Tensor:
    """An uninitialised flat buffer on ``device``, or in unified memory (FBGEMM's
    ``new_unified_tensor``: managed memory, or host-mapped with ``host_mapped``). An empty buffer
    (a derived table's weights) is a plain device tensor: CUDA allocates no unified memory of 0 bytes."""
    if not unified or numel == 0:
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
            ctx.linearized = None
            return calls.forward(backend, module.table_arrays, batch, out_dtype, module._hp)
        out, ctx.linearized = calls.forward_train(backend, module.table_arrays, batch, out_dtype, module._hp)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        module, batch = ctx.module, ctx.batch
        if ctx.cache_keys is not None:
            batch = module._relocate_cached_rows(batch, *ctx.cache_keys)
        grad_out = grad_out.contiguous().reshape(-1)
        arrays = module.table_arrays
        grad_psw = (calls.per_sample_weight_grad(arrays, batch, grad_out, module._hp)
                    if ctx.psw_needs_grad else None)
        calls.backward_update_(module._backend, arrays, batch, ctx.linearized, grad_out, module._hp,
                               module.nonfinite_grad_rows)
        if ctx.cache_keys is not None:
            module._after_cached_update(*ctx.cache_keys)
        module.iter.add_(1)   # in place: no nn.Module.__setattr__ per step
        return None, None, None, grad_psw, None, None


class FTRLTableBatchedEmbeddingBags(BatchMixin, CachedLookupMixin, TableAPIMixin, nn.Module):
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
            row (``accum_dev`` ``[total rows]``). Under ``MANAGED_CACHING`` a cache slot holds the
            layout's arrays of one row (no weight where derived, one ``accum`` value where
            row-wise; :mod:`torchrec_ftrl.cache`). A layout the backend does not implement (its
            ``Capabilities``) raises ``ValueError``.

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
        rows_dims, placement = parse_embedding_specs(embedding_specs)
        T = len(rows_dims)
        feature_table_map = parse_feature_table_map(feature_table_map, T)
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
        self.weights_precision = _as_sparse_type("weights_precision", weights_precision)
        check_placement(placement, device, [d for _, d in rows_dims], self.weights_precision,
                         cache_load_factor, cache_sets, cache_algorithm, prefetch_pipeline, cache_precision)
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
        self._backend = resolve_backend(backend, device)
        self.backend = self._backend.name
        if placement == EmbeddingLocation.MANAGED_CACHING and not self._backend.capabilities.cached_placement:
            raise ValueError(f"embedding_specs location MANAGED_CACHING runs on the triton backend, "
                             f"got backend={backend!r}")
        require_kernel_layout(self.row_layout, where, self._backend.capabilities, self.backend,
                              cached=placement == EmbeddingLocation.MANAGED_CACHING)

        self._register_tables(rows_dims, feature_table_map, device, placement, bool(uvm_host_mapped))
        self._plain_layout_cache = None   # ((B, device), bag_feature, bag_out_offset) of the last batch
        # the knobs each CUDA graph captured reads (kept alive: see kernels.knobs.knob_tensor)
        self._captured_hps: list[FTRLHyperparams] = []
        self.prefetch_pipeline = bool(prefetch_pipeline)
        self._prefetched: list[tuple[torch.Tensor, torch.Tensor]] = []   # (keys, slots) per batch
        self._prefetch_stream = None
        self.cache: Optional[RowCache] = None
        if placement == EmbeddingLocation.MANAGED_CACHING:
            self._init_cache(rows_dims, feature_table_map, device, cache_load_factor, cache_sets,
                             cache_algorithm, prefetch_pipeline, cache_reserved_memory,
                             gather_uvm_cache_stats)
        self._register_counters(device)
        # Makes the output require grad so backward (the fused update) runs, as in FBGEMM.
        self.placeholder_autograd_tensor = nn.Parameter(torch.zeros(0, device=device))
        self._init_uniform(-0.01, 0.01, warn=False)   # FBGEMM's default initialisation

    def _init_cache(self, rows_dims: list, feature_table_map: list, device: torch.device,
                    cache_load_factor: float, cache_sets: int, cache_algorithm: CacheAlgorithm,
                    prefetch_pipeline: bool, cache_reserved_memory: float,
                    gather_uvm_cache_stats: bool) -> None:
        """The HBM cache of the ``MANAGED_CACHING`` placement (:class:`RowCache`, rows of the row
        layout's arrays), empty, and the hooks that flush it before a ``state_dict`` and empty it
        after a load."""
        self.cache = RowCache(
            [r for r, _ in rows_dims], [d for _, d in rows_dims], feature_table_map,
            self._table_w_offset, _PRECISIONS[self.weights_precision], cache_load_factor, cache_sets,
            cache_algorithm, prefetch_pipeline, cache_reserved_memory, gather_uvm_cache_stats, device,
            layout=self.row_layout)
        self.cache.reset_states(self._hp.initial_accumulator_value)
        self.register_state_dict_pre_hook(_flush_before_state_dict)
        self.register_load_state_dict_post_hook(_empty_cache_after_load)

    def _register_counters(self, device: torch.device) -> None:
        """int64 ``[1]`` counters: ``bounds_check_warning`` (WARNING repairs), ``nonfinite_grad_rows``
        (rows skipped for a NaN/Inf gradient), ``iter`` (the step, which keys bf16 stochastic
        rounding) and the non-persistent ``_fatal_count`` (what a fused FATAL check counts, read
        once per forward; zero while batches are valid)."""
        i64 = dict(dtype=torch.int64, device=device)
        self.register_buffer("bounds_check_warning", torch.zeros(1, **i64))
        self.register_buffer("_fatal_count", torch.zeros(1, **i64), persistent=False)
        self.register_buffer("nonfinite_grad_rows", torch.zeros(1, **i64))
        self.register_buffer("iter", torch.zeros(1, **i64))

    def _register_tables(self, rows_dims: list, feature_table_map: list, device: torch.device,
                         placement: Optional[EmbeddingLocation], uvm_host_mapped: bool) -> None:
        """The offsets of the flat buffers (FBGEMM's ``weights_offsets``, ``D_offsets``), the tables'
        facts on the device, and the weights and states by :attr:`row_layout` (in unified memory under
        the UVM placements, FBGEMM's ``weights_uvm``)."""
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

        T = len(rows_dims)
        i64 = dict(dtype=torch.int64, device=device)
        self.register_buffer("_table_w_offset", torch.tensor(offs, **i64), persistent=False)
        self.register_buffer("_table_dim", torch.tensor([d for _, d in rows_dims], **i64), persistent=False)
        self.register_buffer("_table_rows", torch.tensor([r for r, _ in rows_dims], **i64), persistent=False)
        self.register_buffer("_table_row_base", torch.tensor(
            [sum(r for r, _ in rows_dims[:t]) for t in range(T)], **i64), persistent=False)
        self.register_buffer("_feature_table", torch.tensor(feature_table_map, **i64), persistent=False)
        self.register_buffer("_feature_dim", torch.tensor(dims_f, **i64), persistent=False)
        self.register_buffer("_D_offsets", torch.tensor(self.D_offsets, **i64), persistent=False)
        total = sum(sizes)
        wdtype = _PRECISIONS[self.weights_precision]
        # Under the UVM placements these buffers are in unified memory (FBGEMM's weights_uvm).
        alloc = functools.partial(_allocate, device=device, unified=placement is not None,
                                  host_mapped=uvm_host_mapped)
        layout = self.row_layout
        self.register_buffer("weights_dev", alloc(total if layout.weights == "stored" else 0, wdtype))
        accum_numel = self._total_rows if layout.accumulator == "rowwise" else total
        self.register_buffer("accum_dev", alloc(accum_numel, self._state_dtypes["accum"]).fill_(
            self._hp.initial_accumulator_value))
        self.register_buffer("linear_dev", alloc(total, self._state_dtypes["linear"]).zero_())

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
        capturing = (self.linear_dev.is_cuda and not torch.compiler.is_compiling()
                     and torch.cuda.is_current_stream_capturing())
        if capturing:
            self._check_capturable(batch_size_per_feature_per_rank)
        batch = self._make_batch(indices, offsets, per_sample_weights, batch_size_per_feature_per_rank)
        cache_keys, release = None, None
        train = torch.is_grad_enabled() and self.placeholder_autograd_tensor.requires_grad
        if capturing and (train or self.row_layout.weights == "derived"):
            # the knobs the captured kernels will replay, kept alive; the latest capture's last
            self._captured_hps = [hp for hp in self._captured_hps if hp is not self._hp] + [self._hp]
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

    # The batch (tbe_batch.BatchMixin), the UVM-caching placement (tbe_cached.CachedLookupMixin)
    # and FBGEMM's table API and the hooks TorchRec calls (tbe_tables.TableAPIMixin).

    def __getattr__(self, name: str) -> Any:
        buffers = self.__dict__.get("_buffers")    # the arrays, read several times per step
        if buffers is not None and name in buffers:
            return buffers[name]
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
