"""A batch's per-index rows by torch ops, shared by every backend: the gathers of the vectorised
PyTorch implementation (:mod:`.rows`), the gradient of trainable per-sample weights (which
the TBE computes with torch ops on every backend, before the update), and the input check's count and
offsets repair of the ops' PyTorch implementation (:mod:`.composite`; FBGEMM's
``bounds_check_indices``, :mod:`torchrec_ftrl.tbe.bounds_check`). Layout: :mod:`torchrec_ftrl.kernels.batch`.
"""

from __future__ import annotations

import dataclasses

import torch

from ...hyperparams import FTRLHyperparams
from ...rule import ftrl_prox
from ..batch import TableArrays, TBEBatch


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


def count_invalid(table_rows: torch.Tensor, feature_table: torch.Tensor, bag_feature: torch.Tensor,
                  indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """int64 ``[]`` on the device: bad offsets (first not 0, a decreasing step, last not
    ``indices.numel()``) plus indices outside their table, 0 for a valid batch; no host sync."""
    N = indices.numel()
    num_bags = offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]
    bad = (offsets[0] != 0).long() + (lengths < 0).sum() + (offsets[-1] != N).long()
    if N == 0 or num_bags <= 0:
        return bad + N
    bag = torch.searchsorted(offsets, torch.arange(N, device=indices.device), right=True) - 1
    rows = table_rows[feature_table[bag_feature[bag.clamp_(0, num_bags - 1)]]]
    return bad + ((indices < 0) | (indices >= rows)).sum()


def repair_offsets(offsets: torch.Tensor, num_indices: int) -> torch.Tensor:
    """FBGEMM's ``WARNING`` repair of raw offsets by torch ops (:mod:`torchrec_ftrl.tbe.bounds_check`): a
    new tensor ``cummax(clamp(offsets, 0, N))`` with the first entry 0 and the last ``N``; ``[0]`` for
    zero bags."""
    fixed = torch.cummax(offsets.clamp(0, num_indices), 0).values
    if fixed.numel() <= 1:
        return fixed.new_zeros(1)
    return torch.cat([fixed.new_zeros(1), fixed[1:-1], fixed.new_full((1,), num_indices)])
