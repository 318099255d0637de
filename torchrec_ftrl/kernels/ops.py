"""The FTRL TBE's registered operators, ``torch.ops.torchrec_ftrl.*``: their schemas and Meta (fake)
implementations, stated once here.

Every implementation implements these schemas: the compiled CPU kernel (``cpu/csrc/ftrl_tbe_cpu.cpp``,
``CPU``, loaded by :func:`torchrec_ftrl.kernels.cpu.backend.load_extension`), the Triton kernels
(``CUDA``, :mod:`.cuda.impls`) and the vectorised PyTorch implementation
(``CompositeExplicitAutograd``, :mod:`.pytorch.composite`: every device without a kernel of its own, e.g.
the CPU when the compiled kernel is not loaded). The Meta implementations run the metadata checks
(:mod:`.arg_checks`) and give shapes and dtypes only, so the ops run under fake tensors and
``torch.compile`` traces them without a graph break. The
TBE calls them through :mod:`.calls`; which optional arguments an implementation takes is declared in
its :class:`~.capabilities.Capabilities`, and one it does not take raises ``RuntimeError``.

Arguments, in this order:

* the tables' arrays by row layout (:class:`~.batch.TableArrays`) ``weights?, accum, linear,
  rowwise``: ``weights`` flat ``[total]`` fp32/fp16/bf16, or None for derived weights (``w =
  prox(linear, accum)`` computed where it is read); ``accum`` (n) and ``linear`` (z) fp32 or bf16,
  ``linear`` ``[total]``, ``accum`` ``[total]`` or, with ``rowwise``, ``[total_rows]`` (row ``r`` of
  table ``t`` at ``table_row_base[t] + r``);
* the batch (:class:`~.batch.TBEBatch`, int64 index tensors): ``table_w_offset, table_dim,
  table_rows, table_row_base, feature_table, bag_feature, bag_out_offset, indices, offsets,
  per_sample_weights?, pooling_mode, max_D, table_dims, total_rows`` (``table_dims`` and
  ``total_rows``: ``table_dim`` and the sum of ``table_rows`` as host integers, which a kernel
  specialises on without reading the device; the compiled CPU kernel recomputes ``table_row_base``
  and the row count from ``table_rows``);
* the knobs (:mod:`.knobs`): ``knobs`` fp32 ``[len(KNOBS)]`` on the tables' device,
  ``pow_half, has_shrink``, which must be :func:`.knobs.knob_flags`' of the knobs (the kernels
  specialise on them; the CPU and PyTorch implementations check them and raise ``ValueError``).

The argument contract (:mod:`.arg_checks`): every implementation checks its arguments before it
touches memory and raises ``RuntimeError`` (tensors on other devices, of other dtypes, not contiguous
1-D, of inconsistent lengths) or ``ValueError`` (bad values: table maps that disagree or leave
``linear``, ``max_D`` below a table's dim, bag outputs outside the output or ``grad_out``, map entries
out of range, knobs outside :class:`~torchrec_ftrl.hyperparams.FTRLHyperparams`' ranges), naming the
op, the argument and its value; the state is then unchanged. Every tensor is on one device (meta
only under fake tensors, where the metadata checks run). The values of ``indices`` and ``offsets``
are the bounds check's job (:mod:`torchrec_ftrl.tbe.bounds_check`), not the ops': where the ops are
told the batch is checked (``check`` False; ``warn`` None for ``tbe_linearize``), indices must lie
in their tables and offsets be valid, and with ``BoundsCheckMode.IGNORE`` a bad index or offset is
undefined behaviour (reads and writes outside the arrays). The same holds for ``cache_locations``
and the linearised batch (``lin_*``), which only the TBE makes.

Ops:

* ``tbe_forward(<arrays>, <batch>, <knobs>, out_numel, out_dtype, warn!, check, row_keys?,
  cache_locations?, cache_weights?, cache_accum?, cache_linear?) -> Tensor``: the flat pooled (SUM /
  MEAN) or sequence (NONE) output ``[out_numel]`` in ``out_dtype`` (fp32, fp16 or bf16), fp32
  accumulation; empty bags give zeros. ``offsets`` are valid. ``warn``: an int64 ``[1]`` counter.
  ``check`` (``fused_check``): indices are unchecked; one outside ``[0, rows)`` reads row 0 and is
  counted in ``warn``; without ``check`` no kernel reads or writes ``warn`` (the TBE then passes a
  scratch one). ``warn`` is not optional: Inductor (``torch.compile``'s default backend) cannot
  lower a mutating op that returns one tensor and mutates none (its mutated arguments all None).
  ``row_keys`` (``linearizes``): the checked row keys of :func:`tbe_linearize`, read instead of
  ``indices`` (``check`` then checks nothing). ``cache_*`` (``cached_placement``; all or none): rows
  with a cache slot (``cache_locations[i] >= 0``) are read from the HBM cache (:mod:`.batch`).
* ``tbe_linearize(<batch>, out_numel, warn?) -> (key, gofs, scale, tid, offsets)`` (``linearizes``):
  each index's row key ``table_row_base[t] + index`` (int32 when the tables have fewer than 2**31
  rows, else int64), its gradient offset (int32 / int64), its fp32 factor (per-sample weight and 1/L
  of MEAN; ``[1]`` when there is none), its table (int32); with ``warn``, the raw ``offsets`` are
  repaired (returned; otherwise the fifth result is empty) and bad offsets and indices counted.
* ``tbe_backward_update_(<arrays>!, <batch>, grad_out, <knobs>, nonfinite_rows!, step?, check,
  lin_key?, lin_gofs?, lin_scale?, lin_tid?, cache_locations?, cache_weights!?, cache_accum!?,
  cache_linear!?) -> ()``: sums the gradient (``grad_out`` flat ``[out_numel]``, fp32, fp16 or
  bf16) of every touched row and applies ONE FTRL update per row in place
  (:func:`torchrec_ftrl.rule.ftrl_update_rows_`'s rule for the layout); the overflow rule: a row
  whose summed fp32 gradient has a non-finite ``sum_d g_d^2`` (summed in fp32: a NaN/Inf gradient,
  or a finite one whose square overflows) is left unchanged and counted in ``nonfinite_rows``
  (int64 ``[1]``); a bf16 state
  is stored by stochastic rounding keyed by ``step`` (int64 ``[1]``; a bf16 state without it raises).
  ``offsets`` are valid; ``check``: an index outside its table is read as row 0 (not counted).
  ``lin_*`` (all or none): the first four results of :func:`tbe_linearize` for this batch. A bf16
  state without ``step`` raises ``ValueError``.
* ``tbe_count_invalid(table_rows, feature_table, bag_feature, indices, offsets) -> Tensor``: int64
  ``[1]``, the number of malformed offsets plus indices outside ``[0, rows)`` of their table (0 for a
  valid batch); reads only.
* ``tbe_repair_offsets(offsets, warn!, num_indices) -> Tensor``: FBGEMM's ``WARNING`` repair of raw
  offsets, ``cummax(clamp(offsets, 0, N))`` with the first entry 0 and the last ``N`` (``[0]`` for
  zero bags), the number of changed entries added to ``warn``.
"""

from __future__ import annotations

import torch

from . import arg_checks
from .batch import index_factors

NAMESPACE = "torchrec_ftrl"

_ARRAYS = "Tensor? weights, Tensor accum, Tensor linear, bool rowwise"
_ARRAYS_MUT = "Tensor(a!)? weights, Tensor(b!) accum, Tensor(c!) linear, bool rowwise"
_BATCH = ("Tensor table_w_offset, Tensor table_dim, Tensor table_rows, Tensor table_row_base, "
          "Tensor feature_table, Tensor bag_feature, Tensor bag_out_offset, Tensor indices, "
          "Tensor offsets, Tensor? per_sample_weights, int pooling_mode, int max_D, int[] table_dims, "
          "int total_rows")
_KNOBS = "Tensor knobs, bool pow_half, bool has_shrink"
SCHEMAS = {
    "tbe_forward": (f"({_ARRAYS}, {_BATCH}, {_KNOBS}, int out_numel, ScalarType out_dtype, "
                    "Tensor(d!) warn, bool check, Tensor? row_keys, Tensor? cache_locations, "
                    "Tensor? cache_weights, Tensor? cache_accum, Tensor? cache_linear) -> Tensor"),
    "tbe_linearize": (f"({_BATCH}, int out_numel, Tensor(d!)? warn) "
                      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"),
    "tbe_backward_update_": (
        f"({_ARRAYS_MUT}, {_BATCH}, Tensor grad_out, {_KNOBS}, Tensor(d!) nonfinite_rows, Tensor? step, "
        "bool check, Tensor? lin_key, Tensor? lin_gofs, Tensor? lin_scale, Tensor? lin_tid, "
        "Tensor? cache_locations, Tensor(e!)? cache_weights, Tensor(f!)? cache_accum, "
        "Tensor(g!)? cache_linear) -> ()"),
    "tbe_count_invalid": ("(Tensor table_rows, Tensor feature_table, Tensor bag_feature, Tensor indices, "
                          "Tensor offsets) -> Tensor"),
    "tbe_repair_offsets": "(Tensor offsets, Tensor(a!) warn, int num_indices) -> Tensor",
}
# Positions in the argument lists (the implementations unpack the batch by these).
N_ARRAYS, N_BATCH, N_KNOBS = 4, 14, 3


_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
for _name, _schema in SCHEMAS.items():
    _LIB.define(_name + _schema)


def linearized_like(indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights, pooling_mode: int,
                    total_rows: int, out_numel: int, repair: bool) -> tuple:
    """Uninitialised results of ``tbe_linearize`` (shapes and dtypes: see the module docstring)."""
    N, dev, i32_max = indices.numel(), indices.device, 2 ** 31 - 1
    has_scale = index_factors(per_sample_weights, pooling_mode)[1]
    return (torch.empty(N, dtype=torch.int32 if 0 <= total_rows < i32_max else torch.int64, device=dev),
            torch.empty(N, dtype=torch.int32 if out_numel < i32_max else torch.int64, device=dev),
            torch.empty(N if has_scale else 1, dtype=torch.float32, device=dev),
            torch.empty(N, dtype=torch.int32, device=dev),
            torch.empty(offsets.numel() if repair else 0, dtype=offsets.dtype, device=dev))


# The fake implementations run the ops' metadata checks (:mod:`.arg_checks`: one device for every
# tensor, dtypes, lengths), so fake mode and torch.compile refuse what the kernels refuse.

@torch.library.register_fake(f"{NAMESPACE}::tbe_forward")
def _tbe_forward_fake(*args):
    arg_checks.check_forward(args, values=False)
    out_numel, out_dtype = args[N_ARRAYS + N_BATCH + N_KNOBS:N_ARRAYS + N_BATCH + N_KNOBS + 2]
    return args[2].new_empty(out_numel, dtype=out_dtype)


@torch.library.register_fake(f"{NAMESPACE}::tbe_linearize")
def _tbe_linearize_fake(*args):
    arg_checks.check_linearize(args, values=False)
    (_, _, _, _, _, _, _, indices, offsets, psw, pooling_mode, _, _, total_rows, out_numel, warn) = args
    return linearized_like(indices, offsets, psw, pooling_mode, total_rows, out_numel, warn is not None)


@torch.library.register_fake(f"{NAMESPACE}::tbe_backward_update_")
def _tbe_backward_update_fake(*args):
    arg_checks.check_backward(args, values=False)


@torch.library.register_fake(f"{NAMESPACE}::tbe_count_invalid")
def _tbe_count_invalid_fake(table_rows, feature_table, bag_feature, indices, offsets):
    arg_checks.check_count_invalid(table_rows, feature_table, bag_feature, indices, offsets, values=False)
    return indices.new_empty(1, dtype=torch.int64)


@torch.library.register_fake(f"{NAMESPACE}::tbe_repair_offsets")
def _tbe_repair_offsets_fake(offsets, warn, num_indices):
    arg_checks.check_repair_offsets(offsets, warn, num_indices)
    return torch.empty_like(offsets)
