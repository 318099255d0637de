"""The ops' argument contract (:mod:`.ops`), stated once and checked before any kernel reads or
writes memory: by the registered CUDA kernels (:mod:`.cuda.impls`, before the Triton implementation
runs) and the PyTorch implementation (:mod:`.pytorch.composite`), and by the Meta (fake)
implementations (metadata only). The compiled CPU kernel checks the same contract in C++. The TBE's
eager steps on CUDA call the Triton implementation directly with arguments it built and checked
itself (its batch, its bounds check, its maps and knobs), so a step pays no check on the host.

Two kinds of checks, O(T + bags) (``T = table_rows.numel()``, ``bags = bag_feature.numel()``):

* **metadata** (attributes only, no device read; they raise ``RuntimeError``): every tensor on the
  device of ``linear`` (of ``table_rows`` / ``offsets`` for the ops without arrays), its dtype, 1-D
  and contiguous, the lengths (``table_*`` ``[T]``, ``len(table_dims) == T``, ``offsets``
  ``[bags + 1]``, ``bag_out_offset`` ``[bags]``, ``per_sample_weights`` fp32 ``[N]``, ``weights`` and an
  element-wise ``accum`` as long as ``linear``, a row-wise ``accum`` ``[total_rows]``, ``knobs`` fp32
  ``[len(KNOBS)]``, counters int64 ``[1]``), ``pooling_mode``, ``max_D >= max(table_dims)`` (``>= 1``
  with tables), ``out_numel >= 0``, the output a ``NONE`` batch addresses (``N * max_D``), and the
  shapes of the linearised batch and of the cache;
* **values** (a device read; they raise ``ValueError``): ``table_dim == table_dims``, each table inside
  ``linear`` (``table_w_offset[t] + table_rows[t] * table_dim[t] <= linear.numel()``),
  ``table_row_base`` the prefix sum of ``table_rows`` (summing to ``total_rows``), ``feature_table`` in
  ``[0, T)``, ``bag_feature`` in ``[0, feature_table.numel())``, each pooled bag's output
  (``bag_out_offset[b] + D``) inside the output (``grad_out`` for the update), and the knobs
  (:class:`~torchrec_ftrl.hyperparams.FTRLHyperparams`' ranges, flags that agree).

The values of ``indices`` (and of ``cache_locations`` and the linearised batch) are not checked here:
they are the bounds check's job (:mod:`torchrec_ftrl.tbe.bounds_check`). So are those of ``offsets``
on devices other than the CPU; on the CPU, where reading them costs no synchronisation, ``offsets``
must run from 0 to N without decreasing (:func:`check_offset_values`), as the compiled CPU kernel
requires too.

On the CPU the values are read at every call. On other devices a read would synchronise with the
host, so each tensor's values are read once per ``(tensor, tensor._version)`` and what was found is
remembered (:func:`remember`, a weak registry): the TBE registers its own tensors where it builds
them from checked host facts (the knob tensor, the tables' maps, a batch's bags), so a training step
reads nothing. While ``torch.compile`` traces, during CUDA-graph capture and for fake or meta
tensors only the metadata checks run.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from ..hyperparams import KernelScalars
from .batch import POOL_MEAN, POOL_NONE, POOL_SUM, row_alignment

I64, F32 = (torch.int64,), (torch.float32,)
STATES = (torch.float32, torch.bfloat16)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
POOLING_MODES = (POOL_SUM, POOL_MEAN, POOL_NONE)
N_KNOBS = len(KernelScalars._fields)
# Device types whose values are read once per tensor version (remembered); others at every call.
REMEMBERING_DEVICE_TYPES = {"cuda"}

_facts: dict = {}   # id(tensor) -> (weakref to it, its _version when checked, what was found)
_good_tables: dict = {}            # table facts found consistent -> feature dims (bounded)


# ------------------------------------------------------------------------------------ the registry

def remember(t: torch.Tensor, facts: Any) -> None:
    """Record ``facts`` about the values of ``t`` as they are now (``t._version``): the value checks
    use them instead of reading ``t`` until ``t`` is modified in place. For tensors made from
    checked host facts; a no-op while ``torch.compile`` traces and for tensor subclasses."""
    if type(t) is torch.Tensor and not t.is_inference() and not torch.compiler.is_compiling():
        key = id(t)
        _facts[key] = (weakref.ref(t, lambda ref, key=key: _forget(key, ref)), t._version, facts)


def _forget(key: int, ref) -> None:
    """Drop the entry of a tensor that died (unless its id holds a newer tensor's entry)."""
    entry = _facts.get(key)
    if entry is not None and entry[0] is ref:
        del _facts[key]


def recalled(t: torch.Tensor) -> Any:
    """What :func:`remember` recorded about ``t``, or None (none, or ``t`` changed since)."""
    if t.is_inference():   # no version counter: never remembered
        return None
    entry = _facts.get(id(t))
    if entry is None or entry[0]() is not t or entry[1] != t._version:
        return None
    return entry[2]


def remember_values(t: torch.Tensor, values) -> None:
    """Record the values of a small index tensor (a table map) given as a host sequence."""
    remember(t, tuple(int(v) for v in values))


def remember_bags(bag_feature: torch.Tensor, bag_out_offset: torch.Tensor, features: int,
                  feature_dims, out_end: int) -> None:
    """Record a batch's bag layout built on the host: ``bag_feature`` in ``[0, features)`` and every
    bag's output ``[bag_out_offset[b], bag_out_offset[b] + feature_dims[bag_feature[b]])`` inside
    ``[0, out_end)``."""
    remember(bag_feature, ("bags", 0, features - 1))
    if bag_feature.is_inference():
        return
    remember(bag_out_offset, (weakref.ref(bag_feature), bag_feature._version, tuple(feature_dims), 0,
                              int(out_end), 0, row_alignment(feature_dims)))


# ------------------------------------------------------------------------------- metadata checks

def _what(t) -> str:
    return (f"dtype={t.dtype}, shape={tuple(t.shape)}, device={t.device}, "
            f"contiguous={t.is_contiguous()}")


def vec(op: str, name: str, t, dev: torch.device, dtypes: tuple, numel: Optional[int] = None,
        basis: str = "") -> None:
    """``t`` a contiguous 1-D tensor on ``dev`` (the device of ``linear``, or of ``table_rows`` /
    ``offsets`` for the ops without arrays) of one of ``dtypes`` (of ``numel`` elements; ``basis``:
    where that length comes from, for the message).

    Raises:
        RuntimeError: otherwise, naming the op, ``name`` and what ``t`` is.
    """
    if not isinstance(t, torch.Tensor):
        raise RuntimeError(f"torchrec_ftrl::{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.device != dev:
        raise RuntimeError(f"torchrec_ftrl::{op}: {name} is on {t.device}, but every tensor argument must "
                           f"be on one device, {dev} (the device of linear, or of table_rows / offsets "
                           "for the ops without arrays)")
    if (t.dtype not in dtypes or t.dim() != 1 or not t.is_contiguous()
            or (numel is not None and t.numel() != numel)):
        want = f"[{numel}]{basis and f' ({basis})'}" if numel is not None else "1-D"
        raise RuntimeError(f"torchrec_ftrl::{op}: {name} must be a contiguous {want} tensor of "
                           f"{'/'.join(str(d) for d in dtypes)} on {dev}, got {_what(t)}")


def _fail(op: str, msg: str, exc=RuntimeError):
    raise exc(f"torchrec_ftrl::{op}: {msg}")


def check_batch_meta(op: str, batch: tuple, dev: torch.device) -> None:
    """The ``<batch>`` arguments (:mod:`.ops`, 14 of them) on ``dev``."""
    (table_w_offset, table_dim, table_rows, table_row_base, feature_table, bag_feature, bag_out_offset,
     indices, offsets, psw, pooling_mode, max_D, table_dims, total_rows) = batch
    vec(op, "table_rows", table_rows, dev, I64)
    T = table_rows.numel()
    for name, t in (("table_w_offset", table_w_offset), ("table_dim", table_dim),
                    ("table_row_base", table_row_base)):
        vec(op, name, t, dev, I64, T, "one per table_rows entry")
    vec(op, "feature_table", feature_table, dev, I64)
    vec(op, "bag_feature", bag_feature, dev, I64)
    bags = bag_feature.numel()
    vec(op, "bag_out_offset", bag_out_offset, dev, I64, bags, "one per bag_feature entry")
    vec(op, "indices", indices, dev, I64)
    vec(op, "offsets", offsets, dev, I64, bags + 1, "bag_feature.numel() + 1")
    if psw is not None:
        vec(op, "per_sample_weights", psw, dev, F32, indices.numel(), "one per index")
    if int(pooling_mode) not in POOLING_MODES:
        _fail(op, f"pooling_mode must be one of {POOLING_MODES} (SUM, MEAN, NONE), got {pooling_mode}",
              ValueError)
    if psw is not None and int(pooling_mode) == POOL_NONE:
        _fail(op, "per_sample_weights weight pooled bags (SUM, MEAN); pooling_mode NONE takes none",
              ValueError)
    if len(table_dims) != T:
        _fail(op, f"table_dims must have {T} entries (one per table), got {len(table_dims)}")
    if (T and (min(table_dims) < 1 or max_D != max(table_dims))) or max_D < 0:
        _fail(op, f"max_D must be the largest table dim, and the dims >= 1, got max_D={max_D}, "
                  f"table_dims={list(table_dims)}", ValueError)
    if total_rows < 0:
        _fail(op, f"total_rows must be >= 0, got {total_rows}", ValueError)


def check_out_meta(op: str, name: str, out_numel: int, batch: tuple) -> None:
    """``out_numel`` (the elements of the output or of ``grad_out``, called ``name``) >= 0, and for
    ``NONE`` pooling the ``N * max_D`` elements the kernels address."""
    indices, pooling_mode, max_D = batch[7], int(batch[10]), int(batch[11])
    if out_numel < 0:
        _fail(op, f"{name} must be >= 0, got {out_numel}", ValueError)
    if pooling_mode == POOL_NONE and out_numel < indices.numel() * max_D:
        _fail(op, f"{name} must be >= N * max_D = {indices.numel()} * {max_D} for pooling NONE, got "
                  f"{out_numel}", ValueError)


def check_arrays_meta(op: str, weights, accum, linear, rowwise: bool, total_rows: int) -> torch.device:
    """The ``<arrays>`` arguments; returns their device (``linear``'s), every tensor's device."""
    if not isinstance(linear, torch.Tensor):
        _fail(op, f"linear must be a tensor, got {type(linear).__name__}")
    dev = linear.device
    vec(op, "linear", linear, dev, STATES)
    vec(op, "accum", accum, dev, STATES, total_rows if rowwise else linear.numel(),
        "total_rows: one per row" if rowwise else "as many as linear")
    if weights is not None:
        vec(op, "weights", weights, dev, FLOATS, linear.numel(), "as many as linear")
    return dev


def check_knobs_meta(op: str, knobs, dev: torch.device) -> None:
    vec(op, "knobs", knobs, dev, F32, N_KNOBS)


def check_counter(op: str, name: str, t, dev: torch.device) -> None:
    """An int64 ``[1]`` counter or step on ``dev``."""
    vec(op, name, t, dev, I64, 1)


def check_cache_meta(op: str, weights, accum, linear, rowwise: bool, max_D: int, N: int,
                     cache_locations, cache_weights, cache_accum, cache_linear) -> bool:
    """The ``cache_*`` arguments: all or none; ``cache_locations`` int32 ``[N]``; the caches 2-D of
    one slot count and one row stride, rows of at least ``max_D`` (``1`` for a row-wise accum;
    unused weights of a derived table: any), in their arrays' dtypes. Returns whether given."""
    cache = dict(cache_locations=cache_locations, cache_weights=cache_weights, cache_accum=cache_accum,
                 cache_linear=cache_linear)
    given = [name for name, value in cache.items() if value is not None]
    if given and len(given) != len(cache):
        _fail(op, f"{sorted(cache)} go together (all or none), got only {given}", ValueError)
    if not given:
        return False
    dev = linear.device
    vec(op, "cache_locations", cache_locations, dev, (torch.int32,), N)
    if not isinstance(cache_linear, torch.Tensor) or cache_linear.dim() != 2:
        _fail(op, f"cache_linear must be a [slots, >= max_D] tensor, got {getattr(cache_linear, 'shape', None)}")
    slots, stride = cache_linear.shape[0], cache_linear.stride(0)
    parts = [("cache_linear", cache_linear, linear, max_D, stride),   # name, cache, array, width, stride
             ("cache_accum", cache_accum, accum, 1 if rowwise else max_D, 1 if rowwise else stride)]
    if weights is not None:
        parts.append(("cache_weights", cache_weights, weights, max_D, stride))
    for name, c, array, width, row_stride in parts:
        if (not isinstance(c, torch.Tensor) or c.device != dev or c.dtype != array.dtype or c.dim() != 2
                or c.shape[0] != slots or c.shape[1] < width or c.stride(0) != row_stride
                or c.stride(1) != 1):
            _fail(op, f"{name} must be a [{slots}, >= {width}] tensor of {array.dtype} on {dev} with row "
                      f"stride {row_stride} (the slots and row stride of cache_linear; a row-wise "
                      f"accum's is 1), got {_what(c) if isinstance(c, torch.Tensor) else type(c).__name__}")
    return True


def check_linearized_meta(op: str, lin: tuple, N: int, dev: torch.device) -> bool:
    """``lin_key, lin_gofs, lin_scale, lin_tid`` (``tbe_linearize``'s first four results): all or
    none, with its dtypes and lengths. Returns whether given."""
    names = ("lin_key", "lin_gofs", "lin_scale", "lin_tid")
    given = [n for n, t in zip(names, lin) if t is not None]
    if given and len(given) != 4:
        _fail(op, f"{list(names)} go together (all or none), got only {given}", ValueError)
    if not given:
        return False
    key, gofs, scale, tid = lin
    vec(op, "lin_key", key, dev, (torch.int32, torch.int64), N)
    vec(op, "lin_gofs", gofs, dev, (torch.int32, torch.int64), N)
    vec(op, "lin_scale", scale, dev, F32)
    if scale.numel() not in (1, N):
        _fail(op, f"lin_scale must have 1 or N = {N} elements, got {scale.numel()}")
    vec(op, "lin_tid", tid, dev, (torch.int32,), N)
    return True


# ---------------------------------------------------------------------------------- value checks

def wants_values(t: torch.Tensor) -> bool:
    """Whether the value checks run for tensors like ``t``: not while ``torch.compile`` traces, not
    during CUDA-graph capture, not for fake / meta tensors (or other tensor subclasses)."""
    if type(t) is not torch.Tensor or t.device.type == "meta" or torch.compiler.is_compiling():
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _remembering(t: torch.Tensor) -> bool:
    """Whether ``t``'s values are remembered (its device's are, and it has a version counter: not an
    inference tensor)."""
    return t.device.type in REMEMBERING_DEVICE_TYPES and not t.is_inference()


def small_values(t: torch.Tensor) -> tuple:
    """The values of a small index tensor (a table map) as a tuple of ints: read (at every call on
    the CPU; once per tensor version elsewhere, then remembered)."""
    if not _remembering(t):
        return tuple(t.tolist())
    values = recalled(t)
    if values is None:
        values = tuple(t.tolist())
        remember(t, values)
    return values


def _table_problem(woff, dims, rows, base, table_dims, total_rows: int, linear_numel) -> Optional[str]:
    """What is wrong with the tables' maps (their values as tuples), or None."""
    if dims != tuple(int(d) for d in table_dims):
        return f"table_dim must equal table_dims, got table_dim={list(dims)}, table_dims={list(table_dims)}"
    if any(r < 0 for r in rows):
        return f"table_rows must be >= 0, got {list(rows)}"
    prefix = [0] * len(rows)
    for t in range(1, len(rows)):
        prefix[t] = prefix[t - 1] + rows[t - 1]
    if list(base) != prefix or sum(rows) != total_rows:
        return (f"table_row_base must be the prefix sum of table_rows {list(rows)} and total_rows their "
                f"sum, got table_row_base={list(base)}, total_rows={total_rows}")
    for t, (w, r, d) in enumerate(zip(woff, rows, dims)):
        if w < 0 or (linear_numel is not None and w + r * d > linear_numel):
            return (f"table {t} must lie inside linear ({linear_numel} elements), got "
                    f"table_w_offset={w}, table_rows={r}, table_dim={d}")
    vec = row_alignment(dims)
    for t, w in enumerate(woff):
        if w % vec:
            return (f"table_w_offset[{t}]={w} must be a multiple of {vec} (the largest power of two "
                    f"<= 16 dividing every table dim: the kernels' vector width)")
    return None


def check_table_values(op: str, batch: tuple, linear_numel: Optional[int]) -> tuple:
    """The tables' maps against each other, ``table_dims``, ``total_rows`` and ``linear``
    (``linear_numel``; None: not checked), and ``feature_table`` in ``[0, T)``. Returns the dim of
    each feature (a tuple).

    Raises:
        ValueError: naming the op, the map and its values.
    """
    woff, dims, rows, base, ft = (small_values(t) for t in batch[:5])
    key = (woff, dims, rows, base, ft, tuple(batch[12]), int(batch[11]), int(batch[13]), linear_numel)
    feature_dims = _good_tables.get(key)
    if feature_dims is not None:
        return feature_dims
    problem = _table_problem(woff, dims, rows, base, batch[12], int(batch[13]), linear_numel)
    if problem is not None:
        _fail(op, problem, ValueError)
    if any(not 0 <= f < len(rows) for f in ft):
        _fail(op, f"feature_table entries must be in [0, {len(rows)}), got {list(ft)}", ValueError)
    feature_dims = tuple(dims[f] for f in ft)
    if len(_good_tables) > 256:
        _good_tables.clear()
    _good_tables[key] = feature_dims
    return feature_dims


def _read_ints(*scalars: torch.Tensor) -> list:
    """0-d integer tensors as Python ints, in one read."""
    return torch.stack(scalars).tolist()


def check_bag_values(op: str, bag_feature: torch.Tensor, bag_out_offset: torch.Tensor, features: int,
                     feature_dims: Optional[tuple], out_size: int, out_name: str) -> None:
    """``bag_feature`` in ``[0, features)``; with ``feature_dims`` (pooled bags) every bag's output
    ``[bag_out_offset[b], bag_out_offset[b] + D)`` inside ``[0, out_size)`` (``out_name``).

    Raises:
        ValueError: naming the op, the argument and the bad value.
    """
    if bag_feature.numel() == 0:
        return
    keep = _remembering(bag_feature)
    facts = recalled(bag_feature) if keep else None
    if facts is None:
        facts = ("bags", *_read_ints(*torch.aminmax(bag_feature)))
        if keep:
            remember(bag_feature, facts)
    if facts[1] < 0 or facts[2] >= features:
        _fail(op, f"bag_feature entries must be in [0, {features}) (feature_table.numel()), got min "
                  f"{facts[1]}, max {facts[2]}", ValueError)
    if feature_dims is not None:
        _check_bag_outputs(op, bag_feature, bag_out_offset, feature_dims, out_size, out_name)


def _check_bag_outputs(op: str, bag_feature, bag_out_offset, feature_dims: tuple, out_size: int,
                       out_name: str) -> None:
    keep = _remembering(bag_out_offset) and _remembering(bag_feature)
    facts = recalled(bag_out_offset) if keep else None
    if (facts is None or facts[0]() is not bag_feature or facts[1] != bag_feature._version
            or facts[2] != feature_dims):
        dims = torch.tensor(feature_dims, dtype=torch.int64, device=bag_out_offset.device)[bag_feature]
        # offsets past the output clamped first, so offset + D cannot overflow int64
        vec = row_alignment(feature_dims)
        lo, end, odd = _read_ints(bag_out_offset.min(), (bag_out_offset.clamp(max=out_size + 1) + dims).max(),
                                  (bag_out_offset % vec).max())
        facts = (weakref.ref(bag_feature), bag_feature._version if keep else 0, feature_dims, lo, end, odd, vec)
        if keep:
            remember(bag_out_offset, facts)
    if facts[3] < 0 or facts[4] > out_size:
        _fail(op, f"every pooled bag's output [bag_out_offset[b], bag_out_offset[b] + D) must lie in "
                  f"[0, {out_name}={out_size}), got bag_out_offset min {facts[3]}, largest end "
                  f"{facts[4]}", ValueError)
    if facts[5]:
        _fail(op, f"every bag_out_offset must be a multiple of {facts[6]} (the largest power of two <= 16 "
                  "dividing every feature's dim: the kernels' vector width)", ValueError)


def knob_facts(knobs: torch.Tensor) -> tuple[bool, bool]:
    """``(pow_half, has_shrink)`` of a knob tensor's values (read on the host).

    Raises:
        ValueError: a knob :class:`~torchrec_ftrl.hyperparams.FTRLHyperparams` refuses (not finite,
            ``lr <= 0``, ...), naming it and its value.
    """
    scalars = KernelScalars(*knobs.tolist()).to_hyperparams().kernel_scalars()
    return scalars.neg_power == 0.5, scalars.shrink2 != 0.0


def check_knob_values(op: str, knobs: torch.Tensor, pow_half: bool, has_shrink: bool) -> None:
    """The knobs in :class:`~torchrec_ftrl.hyperparams.FTRLHyperparams`' ranges, and the flags
    theirs (:func:`.knobs.knob_flags`).

    Raises:
        ValueError: naming the op, the knob and its value, or the flags.
    """
    keep = _remembering(knobs)
    facts = recalled(knobs) if keep else None
    if facts is None:
        try:
            facts = knob_facts(knobs)
        except ValueError as exc:
            _fail(op, f"knobs {knobs.tolist()}: {exc}", ValueError)
        if keep:
            remember(knobs, facts)
    if facts != (bool(pow_half), bool(has_shrink)):
        _fail(op, f"pow_half={pow_half} and has_shrink={has_shrink} disagree with the knobs "
                  f"{knobs.tolist()} (give knob_flags of the knobs)", ValueError)


def check_offset_values(op: str, offsets: torch.Tensor, N: int) -> None:
    """On devices whose values are read at every call (the CPU): ``offsets`` from 0 to ``N``, never
    decreasing. Elsewhere they are the bounds check's (a read per batch would synchronise).

    Raises:
        ValueError: naming the op, ``offsets`` and the first bad entry.
    """
    if _remembering(offsets) or offsets.numel() <= 1:   # zero bags read nothing (WARNING repairs to [0])
        return
    steps_down = offsets[1:] < offsets[:-1]
    if int(offsets[0]) != 0 or int(offsets[-1]) != N or bool(steps_down.any()):
        bad = int(steps_down.nonzero()[0, 0]) + 1 if bool(steps_down.any()) else None
        _fail(op, f"offsets must run from 0 to N={N} without decreasing, got offsets[0]={int(offsets[0])}, "
                  f"offsets[-1]={int(offsets[-1])}"
                  f"{'' if bad is None else f', offsets[{bad}]={int(offsets[bad])} < offsets[{bad - 1}]'}",
              ValueError)


def check_batch_values(op: str, batch: tuple, linear_numel: Optional[int], out_size: int,
                       out_name: str, raw_offsets: bool = False) -> None:
    """The value checks of a batch (:func:`check_table_values`, :func:`check_bag_values`, and
    :func:`check_offset_values` unless ``raw_offsets``: the op checks and repairs them itself, its
    ``warn`` / ``check``)."""
    if not raw_offsets:
        check_offset_values(op, batch[8], batch[7].numel())
    feature_dims = check_table_values(op, batch, linear_numel)
    pooled = int(batch[10]) != POOL_NONE
    check_bag_values(op, batch[5], batch[6], batch[4].numel(), feature_dims if pooled else None,
                     out_size, out_name)


# ------------------------------------------------------------------------------------ by op

def check_forward(args: tuple, values: bool = True) -> None:
    """``tbe_forward``'s arguments, in its schema's order (:mod:`.ops`); ``values``: also the value
    checks (where :func:`wants_values`)."""
    op = "tbe_forward"
    weights, accum, linear, rowwise, batch = args[0], args[1], args[2], args[3], args[4:18]
    knobs, pow_half, has_shrink, out_numel, out_dtype, warn, check, row_keys, *cache = args[18:]
    dev = check_arrays_meta(op, weights, accum, linear, rowwise, int(batch[13]))
    check_batch_meta(op, batch, dev)
    check_knobs_meta(op, knobs, dev)
    if out_dtype not in FLOATS:
        _fail(op, f"out_dtype must be one of {FLOATS}, got {out_dtype}", ValueError)
    check_out_meta(op, "out_numel", int(out_numel), batch)
    check_counter(op, "warn", warn, dev)
    N = batch[7].numel()
    if row_keys is not None:
        vec(op, "row_keys", row_keys, dev, (torch.int32, torch.int64), N)
    check_cache_meta(op, weights, accum, linear, rowwise, int(batch[11]), N, *cache)
    if values and wants_values(linear):
        check_knob_values(op, knobs, pow_half, has_shrink)
        check_batch_values(op, batch, linear.numel(), int(out_numel), "out_numel", bool(check))


def check_backward(args: tuple, values: bool = True) -> None:
    """``tbe_backward_update_``'s arguments, in its schema's order (:mod:`.ops`): as
    :func:`check_forward`, with ``grad_out`` (fp32/fp16/bf16, contiguous 1-D) covering the output
    the batch addresses; a bf16 state without ``step`` raises ``ValueError``."""
    op = "tbe_backward_update_"
    weights, accum, linear, rowwise, batch = args[0], args[1], args[2], args[3], args[4:18]
    grad_out, knobs, pow_half, has_shrink, nonfinite_rows, step, check, *rest = args[18:]
    dev = check_arrays_meta(op, weights, accum, linear, rowwise, int(batch[13]))
    check_batch_meta(op, batch, dev)
    vec(op, "grad_out", grad_out, dev, FLOATS)
    check_knobs_meta(op, knobs, dev)
    check_counter(op, "nonfinite_rows", nonfinite_rows, dev)
    if step is not None:
        check_counter(op, "step", step, dev)
    elif torch.bfloat16 in (accum.dtype, linear.dtype):
        _fail(op, "a bf16 optimizer state needs step (the TBE's iter) for its stochastic rounding, got "
                  "None", ValueError)
    check_out_meta(op, "grad_out.numel()", grad_out.numel(), batch)
    N = batch[7].numel()
    check_linearized_meta(op, tuple(rest[:4]), N, dev)
    check_cache_meta(op, weights, accum, linear, rowwise, int(batch[11]), N, *rest[4:])
    if values and wants_values(linear):
        check_knob_values(op, knobs, pow_half, has_shrink)
        check_batch_values(op, batch, linear.numel(), grad_out.numel(), "grad_out.numel()", bool(check))


def check_linearize(args: tuple, values: bool = True) -> None:
    """``tbe_linearize``'s arguments, in its schema's order (:mod:`.ops`)."""
    op = "tbe_linearize"
    batch, out_numel, warn = args[:14], int(args[14]), args[15]
    if not isinstance(batch[2], torch.Tensor):
        _fail(op, f"table_rows must be a tensor, got {type(batch[2]).__name__}")
    dev = batch[2].device
    check_batch_meta(op, batch, dev)
    check_out_meta(op, "out_numel", out_numel, batch)
    if warn is not None:
        check_counter(op, "warn", warn, dev)
    if values and wants_values(batch[2]):
        check_batch_values(op, batch, None, out_numel, "out_numel", warn is not None)


def check_count_invalid(table_rows, feature_table, bag_feature, indices, offsets, values: bool = True) -> None:
    """``tbe_count_invalid``'s arguments: int64 1-D on one device, ``offsets`` ``[bags + 1]`` (or
    empty: counted as one problem);
    values: ``table_rows >= 0``, ``feature_table`` in ``[0, T)``, ``bag_feature`` in
    ``[0, feature_table.numel())``."""
    op = "tbe_count_invalid"
    if not isinstance(table_rows, torch.Tensor):
        _fail(op, f"table_rows must be a tensor, got {type(table_rows).__name__}")
    dev = table_rows.device
    for name, t in (("table_rows", table_rows), ("feature_table", feature_table),
                    ("bag_feature", bag_feature), ("indices", indices)):
        vec(op, name, t, dev, I64)
    bags = bag_feature.numel()
    vec(op, "offsets", offsets, dev, I64, bags + 1 if offsets.numel() else 0,
        "bag_feature.numel() + 1")
    if values and wants_values(table_rows):
        rows, ft = small_values(table_rows), small_values(feature_table)
        if any(r < 0 for r in rows) or any(not 0 <= f < len(rows) for f in ft):
            _fail(op, f"table_rows must be >= 0 and feature_table entries in [0, {len(rows)}), got "
                      f"table_rows={list(rows)}, feature_table={list(ft)}", ValueError)
        check_bag_values(op, bag_feature, bag_feature, len(ft), None, 0, "")


def check_repair_offsets(offsets, warn, num_indices: int) -> None:
    """``tbe_repair_offsets``' arguments: ``offsets`` int64 1-D, ``warn`` int64 ``[1]`` on its
    device, ``num_indices >= 0``."""
    op = "tbe_repair_offsets"
    if not isinstance(offsets, torch.Tensor):
        _fail(op, f"offsets must be a tensor, got {type(offsets).__name__}")
    vec(op, "offsets", offsets, offsets.device, I64)
    check_counter(op, "warn", warn, offsets.device)
    if int(num_indices) < 0:
        _fail(op, f"num_indices must be >= 0, got {num_indices}", ValueError)


def _check_repair_args(args: tuple) -> None:
    check_repair_offsets(*args)


# The check of each op's arguments (in its schema's order), for the implementations that check at
# their registration (:mod:`.cuda.impls`).
BY_OP = {"tbe_forward": check_forward, "tbe_linearize": check_linearize,
         "tbe_backward_update_": check_backward, "tbe_repair_offsets": _check_repair_args}
