"""The FTRL TBE's arguments: the one parse of its constructor's (:func:`parse_tbe_args`, into
:class:`TBEArgs`) and the checks shared by its batches and hooks. Each check raises ``ValueError``
naming the argument and the value."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from ..fbgemm_enums import BoundsCheckMode, CacheAlgorithm, EmbeddingLocation, PoolingMode, SparseType
from ..hyperparams import FTRL_KWARGS, FTRLHyperparams, parse_options
from ..kernels.backend import Backend, resolve_backend
from ..row_layout import LAYOUT_KEYS, RowLayout, require_kernel_layout
from ..state_dtype import OPTIMIZER_STATE_DTYPES
from .placement import PLACEMENTS, check_cache_dims, check_cache_options
from .tables import TableGeometry

WHERE = "FTRLTableBatchedEmbeddingBags(...)"

_PRECISIONS = {SparseType.FP32: torch.float32, SparseType.FP16: torch.float16,
               SparseType.BF16: torch.bfloat16}


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


def parse_embedding_specs(embedding_specs) -> tuple[list[tuple[int, int]], Optional[EmbeddingLocation]]:
    """``([(rows, dim)], placement)`` of FBGEMM-style specs ``(rows, dim)`` or ``(rows, dim, location,
    compute_device)``; ``placement`` is the one unified-memory location of all tables (``MANAGED`` or
    ``MANAGED_CACHING``), or None for device / host memory.

    Raises:
        ValueError: no table, a malformed spec, rows or dim < 1, a location that is not a placement,
            or a unified-memory location mixed with others.
    """
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
    return rows_dims, (uvm_locations.pop() if uvm_locations else None)


def parse_feature_table_map(feature_table_map, T: int) -> list[int]:
    """The table of each feature (default one feature per table).

    Raises:
        ValueError: an empty map or an entry outside ``[0, T)``.
    """
    if feature_table_map is None:
        feature_table_map = list(range(T))
    feature_table_map = [int(t) for t in feature_table_map]
    bad = [t for t in feature_table_map if not 0 <= t < T]
    if not feature_table_map or bad:
        raise ValueError(f"feature_table_map entries must be table ids in [0, {T}), got "
                         f"{feature_table_map!r}")
    return feature_table_map


def check_placement(placement: Optional[EmbeddingLocation], device: torch.device, dims: list,
                     weights_precision: SparseType, cache_load_factor: float, cache_sets: int,
                     cache_algorithm: Any, prefetch_pipeline: bool, cache_precision: Any) -> None:
    """Checks of the tables' placement before anything is allocated.

    Raises:
        ValueError: unified memory without a CUDA device; for ``MANAGED_CACHING``, a cache option or
            a table dim the cache cannot hold, or a ``cache_precision`` other than
            ``weights_precision`` (each message names the argument and its value).
    """
    if placement is not None and device.type != "cuda":
        raise ValueError(f"embedding_specs location {placement.name} (unified memory) needs a CUDA "
                         f"device, got device={device}")
    if placement != EmbeddingLocation.MANAGED_CACHING:
        return
    check_cache_options(cache_load_factor, cache_sets, cache_algorithm, prefetch_pipeline,
                        where="FTRLTableBatchedEmbeddingBags")
    check_cache_dims(dims)
    if cache_precision is not None and _as_sparse_type("cache_precision", cache_precision) != weights_precision:
        raise ValueError(f"cache_precision must equal weights_precision ({weights_precision.name}) or "
                         f"be None: the FTRL cache holds rows in the weights' precision, got "
                         f"{cache_precision!r}")


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    """The ``MANAGED_CACHING`` cache's settings, as FBGEMM names them (checked where the placement is
    ``MANAGED_CACHING``; the other placements keep them unused, as FBGEMM does)."""

    load_factor: float
    sets: int
    algorithm: Any   # a CacheAlgorithm where checked
    reserved_memory: float
    prefetch_pipeline: bool
    gather_stats: bool


@dataclasses.dataclass(frozen=True)
class TBEArgs:
    """The constructor's arguments, parsed and checked once (see the TBE's docstring for each)."""

    geometry: TableGeometry
    placement: Optional[EmbeddingLocation]   # MANAGED / MANAGED_CACHING (unified memory), or None
    device: torch.device
    hp: FTRLHyperparams
    layout: RowLayout
    pooling_mode: PoolingMode
    bounds_check_mode: BoundsCheckMode
    weights_precision: SparseType
    output_dtype: SparseType
    backend: Backend
    deterministic: bool
    uvm_host_mapped: bool
    cache: CacheOptions

    @property
    def location(self) -> EmbeddingLocation:
        """Where the tables live: the unified-memory placement, else the device's memory."""
        if self.placement is not None:
            return self.placement
        return EmbeddingLocation.DEVICE if self.device.type == "cuda" else EmbeddingLocation.HOST

    @property
    def cached(self) -> bool:
        return self.placement == EmbeddingLocation.MANAGED_CACHING


def parse_row_layout(options: dict[str, Any]) -> RowLayout:
    """The TBE's row layout: ``row_layout`` (a :class:`RowLayout`, parsed already) or the layout
    named by ``ftrl_weights``, ``ftrl_accumulator`` and ``optimizer_state_dtypes`` (None: the
    defaults).

    Raises:
        ValueError: a bad value, or ``row_layout`` beside one of the other three.
    """
    layout = options.get("row_layout")
    if layout is None:
        return RowLayout.from_options(options, WHERE)
    given = [k for k in (*LAYOUT_KEYS, OPTIMIZER_STATE_DTYPES) if options.get(k) is not None]
    if not isinstance(layout, RowLayout) or given:
        raise ValueError(f"{WHERE}: row_layout must be a RowLayout, given instead of ftrl_weights, "
                         f"ftrl_accumulator and optimizer_state_dtypes; got row_layout={layout!r} "
                         f"with {given or 'none of them'}")
    return layout


def _parse_tables(options: dict[str, Any]) -> tuple[TableGeometry, Optional[EmbeddingLocation], PoolingMode,
                                                    BoundsCheckMode]:
    """The tables' geometry, their unified-memory placement (or None), and the pooling and
    bounds-check modes, checked in this order: specs, feature map, modes, names."""
    rows_dims, placement = parse_embedding_specs(options["embedding_specs"])
    T = len(rows_dims)
    feature_table_map = parse_feature_table_map(options["feature_table_map"], T)
    pooling_mode, bounds_check_mode = _parse_modes(options, [d for _, d in rows_dims])
    names = options["table_names"]
    if names is not None and len(names) != T:
        raise ValueError(f"table_names must have {T} names, got {list(names)!r}")
    names = tuple(names) if names is not None else tuple(f"t{t}" for t in range(T))
    geometry = TableGeometry(tuple(r for r, _ in rows_dims), tuple(d for _, d in rows_dims),
                             tuple(feature_table_map), names)
    return geometry, placement, pooling_mode, bounds_check_mode


def _parse_modes(options: dict[str, Any], dims: Sequence[int]) -> tuple[PoolingMode, BoundsCheckMode]:
    pooling_mode = _enum_member("pooling_mode", PoolingMode, options["pooling_mode"],
                                (PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE))
    if pooling_mode == PoolingMode.NONE and len(set(dims)) != 1:
        raise ValueError(f"pooling_mode=NONE needs one dim for all tables, got dims {list(dims)}")
    bounds_check_mode = _enum_member("bounds_check_mode", BoundsCheckMode, options["bounds_check_mode"],
                                     (BoundsCheckMode.FATAL, BoundsCheckMode.WARNING,
                                      BoundsCheckMode.IGNORE, BoundsCheckMode.NONE))
    return pooling_mode, bounds_check_mode


def _parse_cache(options: dict[str, Any], placement, device, dims, weights_precision) -> CacheOptions:
    check_placement(placement, device, list(dims), weights_precision, options["cache_load_factor"],
                    options["cache_sets"], options["cache_algorithm"], options["prefetch_pipeline"],
                    options["cache_precision"])
    algorithm = options["cache_algorithm"]
    if placement == EmbeddingLocation.MANAGED_CACHING:
        algorithm = CacheAlgorithm(algorithm)
    return CacheOptions(options["cache_load_factor"], options["cache_sets"], algorithm,
                        options["cache_reserved_memory"], bool(options["prefetch_pipeline"]),
                        bool(options["gather_uvm_cache_stats"]))


def _parse_backend(name: Optional[str], device: torch.device, layout: RowLayout, cached: bool) -> Backend:
    backend = resolve_backend(name, device)
    if cached and not backend.capabilities.cached_placement:
        raise ValueError(f"embedding_specs location MANAGED_CACHING runs on the triton backend, "
                         f"got backend={name!r}")
    require_kernel_layout(layout, WHERE, backend.capabilities, backend.name, cached=cached)
    return backend


def parse_tbe_args(options: dict[str, Any]) -> TBEArgs:
    """The TBE's constructor arguments (its keyword names, every one present) parsed and checked.

    Raises:
        ValueError: a bad argument, naming it and its value (nothing is allocated before this returns).
    """
    hp = parse_options({k: options[k] for k in ("learning_rate", *FTRL_KWARGS)}, where=WHERE)
    layout = parse_row_layout(options)
    geometry, placement, pooling_mode, bounds_check_mode = _parse_tables(options)
    device = torch.device(options["device"]) if options["device"] is not None else torch.device("cpu")
    weights_precision = _as_sparse_type("weights_precision", options["weights_precision"])
    cache = _parse_cache(options, placement, device, geometry.dims, weights_precision)
    output_dtype = _as_sparse_type("output_dtype", options["output_dtype"])
    backend = _parse_backend(options["backend"], device, layout, placement == EmbeddingLocation.MANAGED_CACHING)
    return TBEArgs(geometry, placement, device, hp, layout, pooling_mode, bounds_check_mode,
                   weights_precision, output_dtype, backend, bool(options["deterministic"]),
                   bool(options["uvm_host_mapped"]), cache)
