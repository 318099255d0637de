"""The FTRL TBE's registered operators, ``torch.ops.torchrec_ftrl.*``: their schemas and Meta (fake)
implementations, stated once here.

Kernels attach by dispatch key: the compiled CPU kernel (``csrc/ftrl_tbe_cpu.cpp``, loaded by
:func:`torchrec_ftrl.kernels.cpp_backend.load_extension`) registers the ``CPU`` implementation of each.
The Meta implementations give shapes and dtypes only, so the ops run under fake tensors and
``torch.compile`` traces them without a graph break. Arguments follow the batch layout of
:mod:`torchrec_ftrl.kernels.layout` (int64 index tensors, flat buffers).

* ``tbe_forward(weights, table_w_offset, table_dim, feature_table, bag_feature, bag_out_offset,
  indices, offsets, per_sample_weights?, pooling_mode, max_D, out_numel, out_dtype) -> Tensor``: the
  flat pooled (SUM / MEAN) or sequence (NONE) output ``[out_numel]`` in ``out_dtype``, fp32
  accumulation; empty bags give zeros.
* ``tbe_count_invalid(table_rows, feature_table, bag_feature, indices, offsets) -> Tensor``: int64
  ``[1]``, the number of malformed offsets plus indices outside ``[0, rows)`` of their table (0 for a
  valid batch); reads only.
* ``tbe_backward_update_(weights!, accum!, linear!, table_w_offset, table_dim, table_rows,
  feature_table, bag_feature, bag_out_offset, indices, offsets, per_sample_weights?, pooling_mode,
  max_D, grad_out, lr, neg_power, l1, l2, beta, shrink2, nonfinite_rows!, step) -> ()``: sums the
  gradient of every touched row and applies ONE FTRL update per row in place (the scalars of
  :meth:`~torchrec_ftrl.hyperparams.FTRLHyperparams.kernel_scalars`); rows whose summed gradient
  holds a NaN/Inf are left unchanged and counted in ``nonfinite_rows`` (int64 ``[1]``); a bf16 state
  is stored by stochastic rounding keyed by ``step``.
"""

from __future__ import annotations

import torch

NAMESPACE = "torchrec_ftrl"

_BATCH = ("Tensor table_w_offset, Tensor table_dim, Tensor feature_table, Tensor bag_feature, "
          "Tensor bag_out_offset, Tensor indices, Tensor offsets, Tensor? per_sample_weights, "
          "int pooling_mode, int max_D")
SCHEMAS = {
    "tbe_forward": f"(Tensor weights, {_BATCH}, int out_numel, ScalarType out_dtype) -> Tensor",
    "tbe_count_invalid": ("(Tensor table_rows, Tensor feature_table, Tensor bag_feature, Tensor indices, "
                          "Tensor offsets) -> Tensor"),
    "tbe_backward_update_": (
        "(Tensor(a!) weights, Tensor(b!) accum, Tensor(c!) linear, Tensor table_w_offset, Tensor table_dim, "
        "Tensor table_rows, Tensor feature_table, Tensor bag_feature, Tensor bag_out_offset, Tensor indices, "
        "Tensor offsets, Tensor? per_sample_weights, int pooling_mode, int max_D, Tensor grad_out, "
        "float lr, float neg_power, float l1, float l2, float beta, float shrink2, "
        "Tensor(d!) nonfinite_rows, int step) -> ()"),
}

_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
for _name, _schema in SCHEMAS.items():
    _LIB.define(_name + _schema)


@torch.library.register_fake(f"{NAMESPACE}::tbe_forward")
def _tbe_forward_fake(weights, table_w_offset, table_dim, feature_table, bag_feature, bag_out_offset,
                      indices, offsets, per_sample_weights, pooling_mode, max_D, out_numel, out_dtype):
    return weights.new_empty(out_numel, dtype=out_dtype)


@torch.library.register_fake(f"{NAMESPACE}::tbe_count_invalid")
def _tbe_count_invalid_fake(table_rows, feature_table, bag_feature, indices, offsets):
    return indices.new_empty(1, dtype=torch.int64)


@torch.library.register_fake(f"{NAMESPACE}::tbe_backward_update_")
def _tbe_backward_update_fake(*args):
    return None

