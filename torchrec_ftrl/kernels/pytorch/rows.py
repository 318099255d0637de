"""Vectorised PyTorch implementation of the FTRL TBE forward and fused backward + update.

The fallback where the compiled CPU kernel cannot be built, and the readable statement of what the
compiled and Triton kernels compute, run by the ops' PyTorch implementation (:mod:`.composite`,
``backend="torch"``); the batch's per-index rows by torch ops are :mod:`.index_rows`.
"""

from __future__ import annotations

import torch

from ...hyperparams import FTRLHyperparams
from ...rule import ftrl_update_rows_
from .index_rows import index_gradients, index_weight_rows
from ..batch import POOL_NONE, TableArrays, TBEBatch


def forward(arrays: TableArrays, batch: TBEBatch, out_dtype: torch.dtype,
            hp: FTRLHyperparams) -> torch.Tensor:
    """Pooled lookup. Returns the flat output ``[batch.out_numel]`` in ``out_dtype`` (fp32 accumulation)."""
    out = torch.zeros(batch.out_numel, dtype=torch.float32, device=arrays.linear.device)
    if batch.indices.numel():
        rows, mask, col = index_weight_rows(arrays, batch, hp)
        scale = batch.index_scale() if batch.pooling_mode != POOL_NONE else None  # psw, 1/L (MEAN)
        if scale is not None:
            rows = rows * scale.unsqueeze(1)
        dst = (batch.index_out_offset().unsqueeze(1) + col).masked_fill(~mask, 0)
        out.index_put_((dst[mask],), rows[mask], accumulate=True)
    return out.to(out_dtype)


def backward_update_(arrays: TableArrays, batch: TBEBatch, grad_out: torch.Tensor,
                     hp: FTRLHyperparams, nonfinite_rows: torch.Tensor) -> None:
    """Sum gradients per unique (table, row), then one FTRL update per touched row, in place.

    Rows whose summed gradient's ``sum_d g_d^2`` (fp32) is not finite (a NaN/Inf gradient, or finite
    ones whose squares overflow: :func:`torchrec_ftrl.rule.nonfinite_free_rows`) are skipped and
    counted in ``nonfinite_rows`` (int64 [1]).
    Every row layout of :class:`~torchrec_ftrl.kernels.batch.TableArrays`
    (:func:`torchrec_ftrl.rule.ftrl_update_rows_`).
    ``accum`` / ``linear`` fp32 or bf16: the math is fp32, a bf16 state is stored by
    :func:`torchrec_ftrl.state_dtype.store_state` with row key ``table_row_base[t] + row`` and step
    ``batch.step`` (read as a tensor: no host sync on a device).

    Raises:
        ValueError: a bf16 state and ``batch.step`` None.
    """
    if batch.indices.numel() == 0:
        return
    g = index_gradients(grad_out, batch)
    tables = batch.index_table()
    for t in torch.unique(tables).tolist():
        sel = tables == t
        D = int(batch.table_dim[t])
        rows_all = batch.indices[sel]
        uniq, inverse = torch.unique(rows_all, return_inverse=True)
        summed = torch.zeros(uniq.numel(), D, dtype=torch.float32, device=g.device)
        summed.index_add_(0, inverse, g[sel][:, :D])
        start = int(batch.table_w_offset[t])
        R = int(batch.table_rows[t])
        view = lambda buf: buf[start:start + R * D].view(R, D)  # noqa: E731
        base = int(batch.table_row_base[t])
        accum = arrays.accum[base:base + R] if arrays.rowwise else view(arrays.accum)
        weights = view(arrays.weights) if not arrays.derived else None
        ok = ftrl_update_rows_(weights, accum, view(arrays.linear), uniq, summed, hp,
                               skip_nonfinite=True, row_keys=uniq + batch.table_row_base[t],
                               step=batch.step)
        nonfinite_rows += (~ok).sum()

