"""The PyTorch fallback of the registered ops ``torch.ops.torchrec_ftrl.*`` (:mod:`.ops`): their
``CompositeExplicitAutograd`` implementations, on any device that has no kernel of its own.

The dispatcher prefers a kernel registered for the tensors' own device key (the compiled CPU kernel of
:mod:`.cpp_backend` once loaded, the Triton kernels of :mod:`.cuda_impls` on CUDA) and the Meta (fake)
implementations of :mod:`.ops` under fake tensors, so these run where neither exists: e.g. on the CPU
when the compiled kernel is not loaded (it failed to build), and ``tbe_count_invalid`` on CUDA.
``CompositeExplicitAutograd`` rather than ``CompositeImplicitAutograd`` because the ops keep their
fake implementations and mutate their inputs: an implicit composite would
be traced through (its data-dependent ``torch.unique`` and host reads break fake tensors), and
``torch.library.register_fake`` refuses an op that has one.

Each implementation rebuilds the arrays (:class:`~.layout.TableArrays`), the batch
(:class:`~.layout.TBEBatch`) and the knobs (:meth:`~torchrec_ftrl.hyperparams.KernelScalars.to_hyperparams`)
from the op's arguments and calls a backend module on them (:func:`implementations`): here the
vectorised PyTorch backend (:mod:`.torch_backend`), so it computes bit for bit what
``backend="torch"`` computes, and in :mod:`.cuda_impls` the Triton backend. ``tbe_count_invalid`` is
:func:`torchrec_ftrl.bounds_check.count_invalid` (0 for a valid batch, like the compiled kernel; a
malformed batch may count differently, never 0).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..bounds_check import count_invalid
from ..hyperparams import KernelScalars
from . import torch_backend
from .backend import Backend
from .layout import TableArrays, TBEBatch
from .ops import NAMESPACE

DISPATCH_KEY = "CompositeExplicitAutograd"


def _batch(table_w_offset, table_dim, table_rows, feature_table, bag_feature, bag_out_offset, indices,
           offsets, per_sample_weights, pooling_mode, max_D, table_row_base, out_numel,
           step=None) -> TBEBatch:
    """The :class:`~.layout.TBEBatch` of an op's batch arguments. ``table_rows`` None (the forward
    has no such argument and reads no row count) leaves ``table_rows`` and ``total_rows`` None."""
    return TBEBatch(
        table_w_offset=table_w_offset, table_dim=table_dim, table_rows=table_rows,
        feature_table=feature_table, bag_feature=bag_feature, bag_out_offset=bag_out_offset,
        indices=indices, offsets=offsets, per_sample_weights=per_sample_weights,
        pooling_mode=int(pooling_mode), out_numel=int(out_numel), max_D=int(max_D),
        total_rows=None if table_rows is None else int(table_rows.sum()),
        table_dims=tuple(table_dim.tolist()), table_row_base=table_row_base,
        step=None if step is None else torch.full((1,), step, dtype=torch.int64, device=indices.device))


def implementations(backend: Callable[[], Backend]) -> tuple:
    """``(tbe_forward, tbe_count_invalid, tbe_backward_update_)``: the ops' implementations (schemas
    and shapes: :mod:`.ops`) by the backend module ``backend()`` returns (called at each op call, so
    a backend can be imported at its first use). ``tbe_count_invalid`` does not use the backend.

    The two that take knobs raise ``ValueError`` for a knob
    :class:`~torchrec_ftrl.hyperparams.FTRLHyperparams` refuses (e.g. ``lr <= 0``), before anything
    is written.
    """
    # The knobs are the len(KNOBS) floats in the middle of both schemas, taken as one tuple here.
    def tbe_forward(weights, accum, linear, rowwise, table_w_offset, table_dim, feature_table,
                    bag_feature, bag_out_offset, indices, offsets, per_sample_weights, pooling_mode,
                    max_D, table_row_base, *knobs_out_numel_dtype):
        *knobs, out_numel, out_dtype = knobs_out_numel_dtype
        batch = _batch(table_w_offset, table_dim, None, feature_table, bag_feature, bag_out_offset,
                       indices, offsets, per_sample_weights, pooling_mode, max_D, table_row_base,
                       out_numel)
        hp = KernelScalars(*knobs).to_hyperparams()
        return backend().forward(TableArrays(weights, accum, linear, rowwise), batch, out_dtype, hp)

    def tbe_backward_update_(weights, accum, linear, rowwise, table_w_offset, table_dim, table_rows,
                             feature_table, bag_feature, bag_out_offset, indices, offsets,
                             per_sample_weights, pooling_mode, max_D, grad_out, *knobs_nonfinite_step):
        *knobs, nonfinite_rows, step = knobs_nonfinite_step
        # the table row bases cumsum(table_rows) - table_rows (TBEBatch)
        table_row_base = torch.cumsum(table_rows, 0) - table_rows
        batch = _batch(table_w_offset, table_dim, table_rows, feature_table, bag_feature,
                       bag_out_offset, indices, offsets, per_sample_weights, pooling_mode, max_D,
                       table_row_base, grad_out.numel(), step)
        hp = KernelScalars(*knobs).to_hyperparams()
        backend().backward_update_(TableArrays(weights, accum, linear, rowwise), batch, None, grad_out,
                                   hp, nonfinite_rows)

    return tbe_forward, tbe_count_invalid, tbe_backward_update_


def tbe_count_invalid(table_rows, feature_table, bag_feature, indices, offsets):
    """``tbe_count_invalid`` (:mod:`.ops`): int64 ``[1]``, by :func:`torchrec_ftrl.bounds_check.count_invalid`;
    empty ``offsets`` (no ``offsets[0]``) count as one problem, as in the compiled kernel."""
    if offsets.numel() == 0:
        return torch.ones(1, dtype=torch.int64, device=indices.device)
    return count_invalid(table_rows, feature_table, bag_feature, indices, offsets).reshape(1)


tbe_forward, _, tbe_backward_update_ = implementations(lambda: torch_backend)
for _impl in (tbe_forward, tbe_count_invalid, tbe_backward_update_):
    torch.library.impl(f"{NAMESPACE}::{_impl.__name__}", DISPATCH_KEY, _impl)
