"""``FTRLTableBatchedEmbeddingBags``: a table-batched embedding (TBE) module with a fused FTRL optimizer.

Forward does the multi-table lookup + pooling; backward sums gradients per touched (table, row) and
applies one FTRL-Proximal update per row in place, never materialising a weight gradient. The API is
shaped after FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` so TorchRec's kernel wrappers and
``EmbeddingFusedOptimizer`` can hold it. The update rule: :mod:`torchrec_ftrl.rule` (``docs/ftrl.md``).
The kernels are reached only through the ops' calls of :mod:`torchrec_ftrl.kernels.calls`.

The module holds the buffers and the public API; its collaborators, each given what it needs:
:func:`.args.parse_tbe_args` (the constructor's arguments, parsed once), :class:`.batch.BatchBuilder`
(a forward's checked batch), :class:`.cached_lookup.CachedLookup` (the ``MANAGED_CACHING`` steps, on
:class:`.cache.RowCache`) and :class:`.table_api.TableStates` (the table API's work on the buffers).
"""

from __future__ import annotations

import functools
import uuid as _uuid
import warnings
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..fbgemm_enums import BoundsCheckMode, CacheAlgorithm, ComputeDevice, PoolingMode, SparseType
from ..hyperparams import DEFAULT_LEARNING_RATE, FTRLHyperparams, parse_options
from ..kernels import calls
from ..kernels.batch import TableArrays, TBEBatch
from ..optim_type import emb_optim_type
from ..row_layout import RowLayout, warn_dropped_weights
from ..state_dtype import describe, state_sparse_types
from .args import _PRECISIONS, TBEArgs, parse_tbe_args
from .batch import BatchBuilder, refuse_capture
from .bounds_check import BatchCheck, raise_if_counted
from .cache import UVM_CACHE_STATS, RowCache
from .cached_lookup import CachedLookup, release as release_lines
from .derived_weight import CHUNK_ROWS, DerivedWeight
from .table_api import COUNTER, FTRLOptimizerState, TableStates, check_loaded
from .tables import TableTensors

__all__ = ["FTRLTableBatchedEmbeddingBags"]


def on_tables_device(method):
    """Run a TBE method with the tables' CUDA device current, as FBGEMM's ops run under a device
    guard: Triton launches (and the direct launchers' keys) go to the current device, so tables on
    ``cuda:1`` in a process whose current device is ``cuda:0`` would launch on the wrong one. A
    no-op on the CPU, under ``torch.compile`` (Inductor's code guards its own launches) and when the
    device is already current."""
    @functools.wraps(method)
    def on_device(self, *args, **kwargs):
        dev = self.linear_dev.device
        if (dev.type != "cuda" or torch.compiler.is_compiling()
                or dev.index == torch.cuda.current_device()):
            return method(self, *args, **kwargs)
        with torch.cuda.device(dev):
            return method(self, *args, **kwargs)
    return on_device


# FBGEMM TBE attributes TorchRec reaches on some TBEs, with why the FTRL TBE has none (an
# AttributeError naming the reason; ``hasattr`` stays False, as TorchRec's guards expect). See
# docs/managed-collision.md, "TBE hooks TorchRec calls".
_KV_ONLY = ("a key-value / SSD TBE hook (TorchRec calls it only on key-value kernels, and FTRL "
            "tables are refused there at DMP construction)")
_QUANT_ONLY = ("a quantized (INT8 / INT4 inference) TBE hook; the FTRL TBE trains fp32, fp16 or "
               "bf16 weights")
_CACHE_NAMES = ("the fused_uvm_caching cache of the FTRL TBE is `tbe.cache` (torchrec_ftrl.tbe.cache."
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


# The slot each persistent tensor of the TBE holds: what a load may put there
# (:func:`.table_api.value_problem`; the placeholder parameter is a float like the weights).
_LOADED_SLOTS = {"weights_dev": "weight", "accum_dev": "accum", "linear_dev": "linear",
                 "bounds_check_warning": COUNTER, "nonfinite_grad_rows": COUNTER, "iter": COUNTER}


class _FTRLLookupFunction(torch.autograd.Function):
    """Autograd glue: forward = pooled lookup; backward = FTRL update in place (no weight grad).
    ``cache_keys``: ``(keys, locked slots, cache generation)`` of a cached training batch, or None."""

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
            keys, _, generation = ctx.cache_keys
            batch = module._cached.relocate(module.cache, batch, keys, generation)
        grad_out = grad_out.contiguous().reshape(-1)
        arrays = module.table_arrays
        grad_psw = (calls.per_sample_weight_grad(arrays, batch, grad_out, module._hp)
                    if ctx.psw_needs_grad else None)
        calls.backward_update_(module._backend, arrays, batch, ctx.linearized, grad_out, module._hp,
                               module.nonfinite_grad_rows)
        if ctx.cache_keys is not None:
            module._cached.after_update(module.cache, ctx.cache_keys[1])
        module.iter.add_(1)   # in place: no nn.Module.__setattr__ per step
        return None, None, None, grad_psw, None, None


class FTRLTableBatchedEmbeddingBags(nn.Module):
    r"""Table-batched embedding bags trained by fused FTRL-Proximal.

    Args:
        embedding_specs: one ``(rows, dim)`` per table, or FBGEMM's ``(rows, dim, location,
            compute_device)`` (compute device ignored). Location (:mod:`torchrec_ftrl.tbe.placement`),
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
        bounds_check_mode: FBGEMM ``BoundsCheckMode``. WARNING (default, as FBGEMM's
            ``SplitTableBatchedEmbeddingBagsCodegen``) reads an index out of ``[0, rows)`` as row 0
            and repairs malformed offsets as FBGEMM does, counting them in ``bounds_check_warning``,
            with no host sync; FATAL raises ``ValueError`` for such a batch before anything changes,
            at the cost of reading its count on the host once per forward (on CUDA the host waits for
            the forward's kernels: a stall every step; refused under CUDA graph capture); IGNORE
            trusts the input: an index out of range, or offsets that are not non-decreasing from 0 to
            ``indices.numel()``, is undefined behaviour (the kernels may read or write outside the
            tables), as in FBGEMM.
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
            ``"elementwise"`` / ``"rowwise"`` ``accum`` (None: ``"stored"``, ``"elementwise"``).
            Derived weights: no weight buffer (``weights_dev`` is empty); every lookup computes
            ``w = prox(linear, accum)`` (McMahan et al. 2013, Algorithm 1), so a learning-rate or
            knob change applies to every row's weight at once. A row-wise ``accum`` holds one n per
            row (``accum_dev`` ``[total rows]``). Under ``MANAGED_CACHING`` a cache slot holds the
            layout's arrays of one row (no weight where derived, one ``accum`` value where
            row-wise; :mod:`torchrec_ftrl.tbe.cache`). A layout the backend does not implement (its
            ``Capabilities``) raises ``ValueError``.
        row_layout: the row layout as a :class:`~torchrec_ftrl.row_layout.RowLayout` (parsed
            already, e.g. from ``fused_params``), instead of ``ftrl_weights``, ``ftrl_accumulator``
            and ``optimizer_state_dtypes``.

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

    ``load_state_dict`` is all or nothing: it checks every entry (shape, dtype, finite values,
    ``accum`` >= 0, counters >= 0) before it copies any, and raises ``ValueError`` naming the key.

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
        bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
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
        ftrl_weights: Optional[str] = None,
        ftrl_accumulator: Optional[str] = None,
        row_layout: Optional[RowLayout] = None,
    ) -> None:
        super().__init__()
        # Every argument, by its keyword, parsed and checked before anything is allocated.
        args = parse_tbe_args({k: v for k, v in locals().items() if k not in ("self", "__class__")})
        self._take_args(args)
        self._register_tables(args)
        self._register_counters(args.device)
        self.cache: Optional[RowCache] = None   # the MANAGED_CACHING placement's HBM cache
        self._cached = CachedLookup()           # its steps and prefetched batches
        if args.cached:
            self._init_cache(args)
        # Makes the output require grad so backward (the fused update) runs, as in FBGEMM.
        self.placeholder_autograd_tensor = nn.Parameter(torch.zeros(0, device=args.device))
        self._init_uniform(-0.01, 0.01, warn=False)   # FBGEMM's default initialisation

    def _take_args(self, args: TBEArgs) -> None:
        """The parsed arguments as the attributes FBGEMM's TBE has (TorchRec reads them), and the
        collaborators built from them."""
        g = args.geometry
        self._geometry, self._hp, self._backend = g, args.hp, args.backend
        # counts _set_hp's changes (CPU int64 [1]): a C++ training lookup's backward compares it
        # with its forward's to update with the knobs of backward time, as the Python path does
        self._hp_version = torch.zeros(1, dtype=torch.int64)
        self.row_layout = args.layout
        self.optimizer_state_dtypes = state_sparse_types(args.layout.state_dtypes)
        self.weights_precision, self.output_dtype = args.weights_precision, args.output_dtype
        self._output_torch_dtype = _PRECISIONS[args.output_dtype]
        self.pooling_mode, self.bounds_check_mode = args.pooling_mode, args.bounds_check_mode
        self.feature_table_map = list(g.feature_table_map)
        self.table_names = list(g.names)
        self.deterministic = args.deterministic
        compute = ComputeDevice.CUDA if args.device.type == "cuda" else ComputeDevice.CPU
        self.embedding_specs = [(r, d, args.location, compute) for r, d in zip(g.rows, g.dims)]
        self.weights_physical_offsets = self.weights_offsets = g.weights_offsets
        self.D_offsets, self.total_D, self.max_D = g.D_offsets, g.total_D, g.max_D
        self.backend = args.backend.name
        self.prefetch_pipeline = args.cache.prefetch_pipeline
        self._batches = BatchBuilder(g, args.pooling_mode)
        self._states = TableStates(g, args.layout)
        # the knobs each CUDA graph captured reads (kept alive: see kernels.knobs.knob_tensor)
        self._captured_hps: list[FTRLHyperparams] = []

    def _init_cache(self, args: TBEArgs) -> None:
        """The HBM cache of the ``MANAGED_CACHING`` placement (:class:`RowCache`, rows of the row
        layout's arrays), empty, and the hook that flushes it before a ``state_dict`` (a load
        empties it: :meth:`_load_from_state_dict`)."""
        g, c = args.geometry, args.cache
        self.cache = RowCache(list(g.rows), list(g.dims), list(g.feature_table_map), self._table_w_offset,
                              _PRECISIONS[args.weights_precision], c.load_factor, c.sets, c.algorithm,
                              c.prefetch_pipeline, c.reserved_memory, c.gather_stats, args.device,
                              layout=args.layout)
        self.cache.reset_states(self._hp.initial_accumulator_value)
        self.register_state_dict_pre_hook(_flush_before_state_dict)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, all or nothing (:meth:`_load_from_state_dict`).

        Raises:
            ValueError: a key missing under ``strict``, or a bad entry, naming the key and the
                problem; nothing changed then.
        """
        self.__dict__["_load_strict"] = bool(strict)
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            self.__dict__.pop("_load_strict", None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        """The load of this TBE's entries, all or nothing: every entry for its parameter and
        persistent buffers is checked first (:func:`.table_api.check_loaded`: each key present
        under ``strict``; a tensor of the buffer's shape, not meta, of a dtype that casts; weights,
        ``accum`` and ``linear`` finite in the buffer's dtype, ``accum`` >= 0; the counters
        ``iter``, ``bounds_check_warning``, ``nonfinite_grad_rows`` integers >= 0). Then the HBM
        cache's updated rows are written back, the entries copied (``nn.Module``'s load) and the
        cache emptied: its rows held the values from before the load. Reached from a parent
        module's load, a state dict with none of the TBE's keys loads nothing (torch reports them
        missing) and one with some of them raises.

        Raises:
            ValueError: naming the key and the problem; no buffer and no cached row changed then.
        """
        own = {name: t for name, t in [*self._parameters.items(), *self._buffers.items()]
               if t is not None and name not in self._non_persistent_buffers_set}
        if not check_loaded(own, _LOADED_SLOTS, state_dict, prefix, self.__dict__.get("_load_strict"),
                            frozenset(self._modules), bool(local_metadata.get("assign_to_params_buffers"))):
            missing_keys.extend(prefix + name for name in own)
            return
        self._flush_written()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self.reset_cache_states()

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

    def _register_tables(self, args: TBEArgs) -> None:
        """The tables' facts on the device (:class:`~.tables.TableTensors`, non-persistent buffers
        ``_table_w_offset``, ...), and the weights and states by :attr:`row_layout` (in unified
        memory under the UVM placements, FBGEMM's ``weights_uvm``)."""
        g, layout, device = args.geometry, args.layout, args.device
        for name, t in zip(TableTensors._fields, g.tensors(device)):
            self.register_buffer("_" + name, t, persistent=False)

        def alloc(numel: int, dtype: torch.dtype) -> torch.Tensor:
            return _allocate(numel, dtype, device, args.placement is not None, args.uvm_host_mapped)

        total = g.total_elements
        self.register_buffer("weights_dev", alloc(total if layout.stores_weights else 0,
                                                  _PRECISIONS[args.weights_precision]))
        self.register_buffer("accum_dev", alloc(g.total_rows if layout.rowwise else total,
                                                layout.accum_dtype).fill_(self._hp.initial_accumulator_value))
        self.register_buffer("linear_dev", alloc(total, layout.linear_dtype).zero_())

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
        return TableArrays(self.weights_dev if self.row_layout.stores_weights else None,
                           self.accum_dev, self.linear_dev, self.row_layout.rowwise)

    @property
    def _flat_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(weights_dev, accum_dev, linear_dev)``, as the cache's populate and flush move rows."""
        return self.weights_dev, self.accum_dev, self.linear_dev

    @property
    def _table_tensors(self) -> TableTensors:
        return TableTensors(*(self._buffers["_" + name] for name in TableTensors._fields))

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
    @on_tables_device
    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor] = None,
                feature_requires_grad: Optional[torch.Tensor] = None,
                batch_size_per_feature_per_rank: Optional[Sequence[Sequence[int]]] = None,
                **unused: Any) -> torch.Tensor:
        """Pooled (or sequence) lookup; see the class docstring for shapes. ``feature_requires_grad``
        is accepted for FBGEMM compatibility and ignored (every feature's table is trained)."""
        bsfpr = batch_size_per_feature_per_rank
        capturing = (self.linear_dev.is_cuda and not torch.compiler.is_compiling()
                     and torch.cuda.is_current_stream_capturing())
        if capturing:
            refuse_capture(self._backend, self.bounds_check_mode, self.cache is not None, bsfpr)
        batch = self._make_batch(indices, offsets, per_sample_weights, bsfpr)
        train = torch.is_grad_enabled() and self.placeholder_autograd_tensor.requires_grad
        if capturing and (train or not self.row_layout.stores_weights):
            # the knobs the captured kernels will replay, kept alive; the latest capture's last
            self._captured_hps = [hp for hp in self._captured_hps if hp is not self._hp] + [self._hp]
        cache_keys, release = None, None
        if self.cache is not None:
            batch, cache_keys, release = self._cached_batch(batch, bsfpr, train)
        out = None
        if (train and cache_keys is None and not torch.compiler.is_compiling()
                and not torch.is_inference_mode_enabled()
                and not (per_sample_weights is not None and per_sample_weights.requires_grad)):
            out = calls.train_lookup(self._backend, self.table_arrays, batch, self._output_torch_dtype,
                                     self._hp, self.placeholder_autograd_tensor, self.nonfinite_grad_rows,
                                     self.iter, self._hp_version, self._current_hp)
        if out is None:
            out = _FTRLLookupFunction.apply(self.placeholder_autograd_tensor, self, batch,
                                            per_sample_weights, train, cache_keys)
        if self.bounds_check_mode == BoundsCheckMode.FATAL and batch.unchecked_counter is not None:
            raise_if_counted(self._fatal_count, self.table_names, batch)
        if release is not None:
            release_lines(self.cache, release)
        if self.pooling_mode == PoolingMode.NONE:
            return out.view(-1, self.max_D)
        return out if bsfpr is not None else out.view(-1, self.total_D)

    def _make_batch(self, indices, offsets, per_sample_weights, bsfpr,
                    mode: Optional[BoundsCheckMode] = None,
                    counter: Optional[torch.Tensor] = None) -> TBEBatch:
        """The checked batch of a forward's arguments (:class:`~.batch.BatchBuilder`), by ``mode``
        (default :attr:`bounds_check_mode`) counting into ``counter`` (default
        ``bounds_check_warning``; under FATAL the kernels' count ``_fatal_count``)."""
        mode = self.bounds_check_mode if mode is None else mode
        if counter is None:
            counter = self._fatal_count if mode == BoundsCheckMode.FATAL else self.bounds_check_warning
        check = BatchCheck(mode, counter, self._backend, self.cache is not None)
        return self._batches.build(indices, offsets, per_sample_weights, bsfpr, self._table_tensors, check,
                                   self.iter)

    def _cached_batch(self, batch: TBEBatch, bsfpr, train: bool) -> tuple[TBEBatch, Optional[tuple], Optional[list]]:
        """A cached placement's batch with its slots, what its update needs (``(keys, locked,
        generation)``, or None without one) and the lines to release after the lookup (None when
        the update releases them)."""
        batch, keys, locked = self._cached.batch(self.cache, batch, bsfpr, self._flat_buffers)
        generation = self.cache.generation   # the slots in batch are valid while it lasts
        if train and self.training:
            return batch, (keys, locked, generation), None   # the update releases the lines
        return batch, ((keys, [], generation) if train else None), locked

    # ------------------------------------------------------------------ the MANAGED_CACHING placement
    @on_tables_device
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
        self._cached.use_stream(forward_stream, self.prefetch_pipeline)
        bsfpr = batch_size_per_feature_per_rank
        if bsfpr is None and (offsets.numel() - 1) % len(self.feature_table_map) != 0:
            return
        batch = self._make_batch(indices, offsets, None, bsfpr, BoundsCheckMode.WARNING,
                                 torch.zeros_like(self.bounds_check_warning))
        self._cached.prefetch(self.cache, batch, bsfpr, self._flat_buffers, forward_stream)

    def get_uvm_cache_stats(self) -> torch.Tensor:
        """int64 ``[6]`` cumulative FBGEMM cache statistics (``torchrec_ftrl.tbe.cache.UVM_CACHE_STATS``:
        calls, requested indices, unique indices, unique misses, conflict unique misses, conflict
        misses), counted when ``gather_uvm_cache_stats=True``; zeros otherwise or uncached."""
        if self.cache is None:
            return torch.zeros(len(UVM_CACHE_STATS), dtype=torch.int64)
        return self.cache.uvm_cache_stats.clone()

    def reset_uvm_cache_stats(self) -> None:
        """Zero the statistics :meth:`get_uvm_cache_stats` returns (FBGEMM's
        ``reset_uvm_cache_stats``). A no-op for the other placements."""
        if self.cache is not None:
            self.cache.uvm_cache_stats.zero_()
            self.cache.local_uvm_cache_stats.zero_()

    @on_tables_device
    def flush(self) -> None:
        """Write the HBM cache's rows (weights and states) back to unified memory; they stay cached.
        A no-op for the other placements."""
        if self.cache is not None:
            self.cache.flush(*self._flat_buffers)

    def _flush_written(self) -> None:
        """:meth:`flush` when the HBM cache holds rows updated since its last flush."""
        if self.cache is not None and self.cache.written:
            self.flush()

    def reset_cache_states(self) -> None:
        """Empty the HBM cache without writing it back, and forget prefetched batches (after a
        load has replaced the tables). A no-op for the other placements."""
        if self.cache is not None:
            self._cached.reset(self.cache)

    # ------------------------------------------------------------------ FBGEMM's table API
    def split_embedding_weights(self) -> list[torch.Tensor]:
        """Per-table ``[rows, D]`` weights, in table order (the HBM cache is flushed first): views (not
        copies) of the weight buffer when the row layout stores weights; with derived weights,
        :class:`~torchrec_ftrl.tbe.derived_weight.DerivedWeight` tensors, which compute
        ``prox(linear, accum)`` when read and encode what is written into them (:meth:`load_weights`)."""
        self.flush()
        T = self._geometry.num_tables
        if self.row_layout.stores_weights:
            return [self._geometry.table_view(self.weights_dev, t) for t in range(T)]
        return [DerivedWeight(self, t) for t in range(T)]

    @torch.no_grad()
    def derived_weights(self, t: int, rows: Optional[torch.Tensor | slice] = None) -> torch.Tensor:
        """fp32 ``[len(rows), D]`` (``rows``: int64 row ids or a slice; default every row) weights
        ``prox(linear, accum)`` of table ``t`` with the knobs of now
        (:func:`torchrec_ftrl.rule.ftrl_prox`): the weights the kernels use with derived weights.
        For a table that stores weights they equal the stored ones wherever training wrote them
        (bitwise for fp32 weights and states). Under ``MANAGED_CACHING`` the HBM cache is flushed
        first if an update wrote it since."""
        self._flush_written()
        return self._states.prox(self.accum_dev, self.linear_dev, self._hp, t,
                                 slice(None) if rows is None else rows)

    def split_optimizer_states(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-table ``(accum, linear)`` views (not copies) in their stored dtypes (fp32, or bf16 per
        ``optimizer_state_dtypes``): ``linear`` ``[rows, D]``; ``accum`` ``[rows, D]``, or ``[rows]``
        with a row-wise accumulator (1-D, as TorchRec classifies row-wise state). The HBM cache is
        flushed first."""
        self.flush()
        return self._states.optimizer_states(self.accum_dev, self.linear_dev)

    def get_optimizer_state(self, *args: Any, **kwargs: Any) -> list[dict[str, torch.Tensor]]:
        """Per-table ``{"accum": [rows, D] or [rows], "linear": [rows, D]}`` views in the stored dtypes
        (``optimizer_state_dtypes``; TensorFlow slot names; see :meth:`split_optimizer_states`)."""
        return [FTRLOptimizerState(accum=a, linear=z) for a, z in self.split_optimizer_states()]

    def get_learning_rate(self) -> float:
        return self._hp.learning_rate

    def set_learning_rate(self, lr: float) -> None:
        """Raises ValueError (nothing changed) unless ``lr`` is finite and > 0."""
        self._set_hp(self._hp.with_learning_rate(lr))

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
        self._set_hp(parse_options(params_dict, base=self._hp, strict=True, where="update_hyper_parameters"))

    def _current_hp(self) -> FTRLHyperparams:
        return self._hp

    def _set_hp(self, hp: FTRLHyperparams) -> None:
        """Take ``hp`` unless it equals the current knobs: the object, and with it the kernels' knob
        tensor, is kept (TorchRec's fused optimizer sets the learning rate at every step). Warns
        when a CUDA graph captured this TBE's step with other knobs."""
        if hp == self._hp:
            return
        self._hp = hp
        self._hp_version.add_(1)
        if self._captured_hps and hp != self._captured_hps[-1]:   # the latest capture
            warnings.warn("FTRL hyper-parameters changed after a CUDA graph captured this TBE's step: "
                          "graphs captured before replay the old values (the learning rate and ftrl_* "
                          "knobs of their capture); capture the step again", stacklevel=3)

    def reset_optimizer_state(self) -> None:
        """accum := initial_accumulator_value (rounded to nearest in a bf16 accum), linear := 0."""
        self.accum_dev.fill_(self._hp.initial_accumulator_value)
        self.linear_dev.zero_()
        if self.cache is not None:
            self.cache.reset_states(self._hp.initial_accumulator_value)

    def init_embedding_weights_uniform(self, min_val: float, max_val: float) -> None:
        """Weights uniform in ``[min_val, max_val]``; with derived weights, encoded into ``linear``
        (:meth:`load_weights`, which warns once where they cannot be held)."""
        self._init_uniform(min_val, max_val, warn=True)

    @torch.no_grad()
    def _init_uniform(self, min_val: float, max_val: float, warn: bool) -> None:
        if self.row_layout.stores_weights:
            for w in self.split_embedding_weights():
                w.uniform_(min_val, max_val)
            self.reset_cache_states()
            return
        for t, (rows, dim) in enumerate(zip(self._geometry.rows, self._geometry.dims)):
            for start in range(0, rows, CHUNK_ROWS):
                w = torch.empty(min(CHUNK_ROWS, rows - start), dim, device=self.linear_dev.device)
                self.load_weights(t, w.uniform_(min_val, max_val), warn=warn, row_start=start)

    @torch.no_grad()
    def load_weights(self, t: int, weights: torch.Tensor, warn: bool = True, row_start: int = 0,
                     only_changed: bool = False, row_ids: Optional[torch.Tensor] = None) -> None:
        """Set the weights of table ``t``'s rows ``[row_start, row_start + len(weights))`` (or the int64
        row ids ``row_ids``, ``[k]``) to ``weights`` (``[k, D]``, any float dtype; default the whole
        table).

        Under ``MANAGED_CACHING`` the HBM cache is written back first and emptied after (the cached
        copies of the rows written are stale). A stored-weights table copies them. A
        derived-weights table keeps ``accum`` and sets
        ``linear`` to the z with ``prox(z, accum) = w`` (:func:`torchrec_ftrl.rule.ftrl_encode`):
        exact up to rounding where ``q(accum) > 0`` (``accum > 0``, ``ftrl_beta > 0`` or an L2 term;
        with ``ftrl_l1_reg > 0`` a weight small beside ``l1 / q`` keeps fewer bits, and a bf16
        ``linear`` keeps bf16's precision);
        where ``q == 0`` no z gives a non-zero w, so those rows start at w = 0 (what FTRL does at a
        row's first touch anyway) and, with ``warn``, a one-time ``UserWarning`` says how many non-zero
        weights were dropped. With ``only_changed``, rows whose weights equal ``prox(linear, accum)``
        already keep their ``linear`` bit for bit (a checkpoint load that writes the weights after
        the states restores the states). (The constructor's FBGEMM-style uniform initialisation loads without
        the warning: a derived table with ``accum = 0`` and ``ftrl_beta = 0`` starts at w = 0.)

        Raises:
            ValueError: ``t`` not a table of this TBE; ``weights`` not a floating-point ``[k, D]``
                tensor, finite in the weights' dtype (fp32 where derived); ``row_start`` not an int
                with the rows inside the table; ``row_ids`` not ``k`` int32/int64 row ids of the
                table. Nothing is changed then.
        """
        dtype = self.weights_dev.dtype if self.row_layout.stores_weights else torch.float32
        rows_written = self._states.check_load(t, weights, row_start, row_ids, self.linear_dev.device, dtype)
        if self.row_layout.stores_weights:
            self.flush()
            self._geometry.table_view(self.weights_dev, t)[rows_written] = weights.to(
                device=self.weights_dev.device, dtype=self.weights_dev.dtype)
            self.reset_cache_states()
            return
        self._flush_written()   # the cached rows' accum, and linear for only_changed
        dropped = self._states.encode(self.accum_dev, self.linear_dev, self._hp, t, rows_written, weights,
                                      only_changed)
        self.reset_cache_states()   # the cached copies of the rows written are stale
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
        segments = self._states.reset_segments(pruned_indices, pruned_indices_offsets, logical_table_ids,
                                               buffer_ids, self.linear_dev.device)
        if not segments:
            return
        if self.cache is not None:
            self.cache.invalidate(torch.cat([self._table_row_base[t] + rows for t, rows in segments]))
        self._states.reset_rows(self.weights_dev if self.row_layout.stores_weights else None,
                                self.accum_dev, self.linear_dev, self._hp.initial_accumulator_value,
                                segments)

    @property
    def uuid(self) -> str:
        """A random ``str(uuid.uuid4())`` naming this TBE, fixed for its lifetime (FBGEMM's ``uuid``;
        TorchRec's raw-id tracker names its consumers by it)."""
        value = self.__dict__.get("_uuid")
        if value is None:
            value = self.__dict__["_uuid"] = str(_uuid.uuid4())
        return value

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
                f"precision={self.weights_precision.name}, states=({describe(self.row_layout.state_dtypes)}), "
                f"backend={self.backend}, hp={self._hp}")
