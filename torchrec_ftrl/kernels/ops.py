"""The FTRL TBE's registered operators, ``torch.ops.torchrec_ftrl.*``: their schemas and Meta (fake)
implementations, stated once here.

Kernels attach by dispatch key: the compiled CPU kernel (``csrc/ftrl_tbe_cpu.cpp``, loaded by
:func:`torchrec_ftrl.kernels.cpp_backend.load_extension`) registers the ``CPU`` implementation of each;
the vectorised PyTorch backend is the ``CompositeExplicitAutograd`` implementation of each
(:mod:`.composite`), which runs on every device without a kernel of its own (e.g. the CPU when the
compiled kernel is not loaded).
The Meta implementations give shapes and dtypes only, so the ops run under fake tensors and
``torch.compile`` traces them without a graph break. Arguments follow the batch layout of
:mod:`torchrec_ftrl.kernels.layout` (int64 index tensors, flat buffers).

Every op that reads the tables takes their arrays by row layout (:class:`~.layout.TableArrays`) as
``weights?, accum, linear, rowwise``: ``weights`` flat ``[total]`` fp32/fp16/bf16, or None for
derived weights (``w = prox(linear, accum)`` computed where it is read, from the knobs); ``accum`` (n)
and ``linear`` (z) fp32 or bf16, ``linear`` ``[total]``, ``accum`` ``[total]`` or, with
``rowwise``, ``[total_rows]`` (row ``r`` of table ``t`` at ``table_row_base[t] + r``). The knobs are
the scalars of :meth:`~torchrec_ftrl.hyperparams.FTRLHyperparams.kernel_scalars`, one ``float`` each in
the order of :data:`.rule_spec.KNOBS` (``lr, neg_power, l1, l2, beta, shrink2``).

* ``tbe_forward(weights?, accum, linear, rowwise, table_w_offset, table_dim, feature_table,
  bag_feature, bag_out_offset, indices, offsets, per_sample_weights?, pooling_mode, max_D,
  table_row_base, <knobs>, out_numel, out_dtype) -> Tensor``: the flat pooled (SUM / MEAN) or
  sequence (NONE) output ``[out_numel]`` in ``out_dtype`` (fp32, fp16 or bf16), fp32 accumulation;
  empty bags give zeros. Reads the weights, or derives them (``shrink2`` unused).
* ``tbe_count_invalid(table_rows, feature_table, bag_feature, indices, offsets) -> Tensor``: int64
  ``[1]``, the number of malformed offsets plus indices outside ``[0, rows)`` of their table (0 for a
  valid batch); reads only.
* ``tbe_backward_update_(weights!?, accum!, linear!, rowwise, table_w_offset, table_dim, table_rows,
  feature_table, bag_feature, bag_out_offset, indices, offsets, per_sample_weights?, pooling_mode,
  max_D, grad_out, <knobs>, nonfinite_rows!, step) -> ()``: sums the gradient (``grad_out`` flat
  ``[out_numel]``, fp32, fp16 or bf16) of every touched row and applies ONE FTRL update per row in
  place (:func:`torchrec_ftrl.rule.ftrl_update_rows_`'s rule for the layout); rows whose summed gradient holds a NaN/Inf are left unchanged and counted
  in ``nonfinite_rows`` (int64 ``[1]``); a bf16 state is stored by stochastic rounding keyed by
  ``step``.
"""

from __future__ import annotations

import torch

from .rule_spec import KNOBS

NAMESPACE = "torchrec_ftrl"

_BATCH = ("Tensor table_w_offset, Tensor table_dim, Tensor feature_table, Tensor bag_feature, "
          "Tensor bag_out_offset, Tensor indices, Tensor offsets, Tensor? per_sample_weights, "
          "int pooling_mode, int max_D")
_KNOBS = ", ".join(f"float {k.name}" for k in KNOBS)
SCHEMAS = {
    "tbe_forward": (f"(Tensor? weights, Tensor accum, Tensor linear, bool rowwise, {_BATCH}, "
                    f"Tensor table_row_base, {_KNOBS}, int out_numel, ScalarType out_dtype) -> Tensor"),
    "tbe_count_invalid": ("(Tensor table_rows, Tensor feature_table, Tensor bag_feature, Tensor indices, "
                          "Tensor offsets) -> Tensor"),
    "tbe_backward_update_": (
        "(Tensor(a!)? weights, Tensor(b!) accum, Tensor(c!) linear, bool rowwise, Tensor table_w_offset, "
        "Tensor table_dim, Tensor table_rows, Tensor feature_table, Tensor bag_feature, "
        "Tensor bag_out_offset, Tensor indices, Tensor offsets, Tensor? per_sample_weights, "
        f"int pooling_mode, int max_D, Tensor grad_out, {_KNOBS}, Tensor(d!) nonfinite_rows, "
        "int step) -> ()"),
}

_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
for _name, _schema in SCHEMAS.items():
    _LIB.define(_name + _schema)


@torch.library.register_fake(f"{NAMESPACE}::tbe_forward")
def _tbe_forward_fake(weights, accum, linear, *args):
    out_numel, out_dtype = args[-2:]
    return linear.new_empty(out_numel, dtype=out_dtype)


@torch.library.register_fake(f"{NAMESPACE}::tbe_count_invalid")
def _tbe_count_invalid_fake(table_rows, feature_table, bag_feature, indices, offsets):
    return indices.new_empty(1, dtype=torch.int64)


@torch.library.register_fake(f"{NAMESPACE}::tbe_backward_update_")
def _tbe_backward_update_fake(*args):
    return None

