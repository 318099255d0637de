"""Vectorised PyTorch implementation of the FTRL TBE forward and fused backward + update.

The fallback where the compiled CPU kernel cannot be built, and the readable statement of what the
compiled and Triton kernels compute, run by the ops' PyTorch implementation (:mod:`.composite`,
``backend="torch"``). The per-sample-weight gradient here serves every backend.
"""

from __future__ import annotations

import dataclasses

import torch

from ..hyperparams import FTRLHyperparams
from ..rule import ftrl_prox, ftrl_update_rows_
from .layout import POOL_NONE, TableArrays, TBEBatch


def gather_index_rows(buf: torch.Tensor, batch: TBEBatch, base: torch.Tensor):
    """Rows ``buf[base[i] : base[i] + D_i]`` of every index ``i`` as fp32 ``[N, max_D]``, zero-padded
    beyond the index's table dim D_i; also returns the ``[N, max_D]`` validity mask and the column ids."""
    col = torch.arange(batch.max_D, device=buf.device)
    mask = col.unsqueeze(0) < batch.table_dim[batch.index_table()].unsqueeze(1)
    src = (base.unsqueeze(1) + col).masked_fill(~mask, 0)
    return buf[src].float() * mask, mask, col


def index_weight_rows(arrays: TableArrays, batch: TBEBatch, hp: FTRLHyperparams):
    """Weight row of every index as fp32 ``[N, max_D]`` (zero-padded beyond its table's D): read from
    the weight buffer, or ``prox(linear, accum)`` for derived weights. Also returns the validity mask
    and the column ids."""
    base = batch.index_row_offset()
    if not arrays.derived:
        return gather_index_rows(arrays.weights, batch, base)
    z, mask, col = gather_index_rows(arrays.linear, batch, base)
    if arrays.rowwise:
        t = batch.index_table()
        n = arrays.accum[batch.table_row_base[t] + batch.indices].float().unsqueeze(1)
    else:
        n, _, _ = gather_index_rows(arrays.accum, batch, base)
    return ftrl_prox(z, n, hp).float() * mask, mask, col


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


def index_gradients(grad_out: torch.Tensor, batch: TBEBatch) -> torch.Tensor:
    """``[N, max_D]`` fp32 gradient of each index's row (zero-padded beyond its table's D)."""
    g, _, _ = gather_index_rows(grad_out, batch, batch.index_out_offset())
    scale = batch.index_scale()
    return g * scale.unsqueeze(1) if scale is not None else g


def per_sample_weight_grad(arrays: TableArrays, batch: TBEBatch, grad_out: torch.Tensor,
                           hp: FTRLHyperparams) -> torch.Tensor:
    """``[N]`` fp32: d loss / d psw[i] = <grad of its bag (/L for MEAN), weight row before the update>.
    Needs a checked batch (``batch.unchecked_counter`` None)."""
    g = index_gradients(grad_out, dataclasses.replace(batch, per_sample_weights=None))  # [N, max_D]
    w, _, _ = index_weight_rows(arrays, batch, hp)
    if batch.cache_locations is not None:   # rows held by the cache are read there
        loc = batch.cache_locations.long()
        hit = loc >= 0
        valid = (torch.arange(batch.max_D, device=w.device)
                 < batch.table_dim[batch.index_table()[hit]].unsqueeze(1))
        w[hit] = _cached_weight_rows(arrays, batch, loc[hit], hp) * valid
    return (g * w).sum(1)


def _cached_weight_rows(arrays: TableArrays, batch: TBEBatch, slots: torch.Tensor,
                        hp: FTRLHyperparams) -> torch.Tensor:
    """fp32 ``[k, max_D]`` weight rows the cache holds at ``slots`` (int64 ``[k]``): the weight
    cache's, or for derived weights ``prox`` of the cached ``linear`` and ``accum`` (one value per
    slot when row-wise)."""
    if not arrays.derived:
        return batch.cache_weights[slots, :batch.max_D].float()
    accum_cache, linear_cache = batch.cache_states[0], batch.cache_states[1]
    n = accum_cache[slots, :1 if arrays.rowwise else batch.max_D]
    return ftrl_prox(linear_cache[slots, :batch.max_D], n, hp).float()


def backward_update_(arrays: TableArrays, batch: TBEBatch, grad_out: torch.Tensor,
                     hp: FTRLHyperparams, nonfinite_rows: torch.Tensor) -> None:
    """Sum gradients per unique (table, row), then one FTRL update per touched row, in place.

    Rows whose summed gradient has NaN/Inf are skipped and counted in ``nonfinite_rows`` (int64 [1]).
    Every row layout of :class:`~.layout.TableArrays` (:func:`torchrec_ftrl.rule.ftrl_update_rows_`).
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

