"""The batch layout every FTRL TBE kernel (PyTorch, compiled CPU, Triton) reads.

Weights and both FTRL states live in flat 1-D buffers, table after table, row-major, no padding:
element ``table_w_offset[t] + r * table_dim[t] + d`` is row ``r``, column ``d`` of table ``t``.
With the UVM-caching placement (:mod:`torchrec_ftrl.tbe.placement`) an HBM cache holds some rows:
``cache_locations[i]`` is the slot of index ``i``'s row (-1: read and update the flat buffers), whose
weight is ``cache_weights[slot, :D]`` and whose states are ``cache_states[0 or 1][slot, :D]`` (a
row-wise ``accum`` at ``cache_states[0][slot, 0]``; derived weights have no weight cache).
``accum`` and ``linear`` (and their caches) are fp32 or bf16 (:mod:`torchrec_ftrl.state_dtype`).
The row layout (:class:`torchrec_ftrl.row_layout.RowLayout`) decides which arrays exist
(:class:`TableArrays`): with derived weights there is no weight buffer and every kernel reads a row's
weight as ``prox(linear, accum)``; with a row-wise accumulator ``accum`` holds one value per row, row
``r`` of table ``t`` at ``table_row_base[t] + r``.

Indices and offsets follow FBGEMM's TBE convention: bag ``k`` (``0 <= k < num_bags``) holds
``indices[offsets[k]:offsets[k+1]]``; bags are feature-major (all bags of feature 0 first). Each bag
knows its feature (``bag_feature``) and where its pooled ``D``-vector goes in the flat output
(``bag_out_offset``, in elements). This one pair of arrays covers the plain ``[B, total_D]`` layout and
FBGEMM's variable-batch (VBE) layout alike. With ``PoolingMode.NONE`` index ``i`` is written at
``i * D`` instead and ``bag_out_offset`` is unused.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..fbgemm_enums import PoolingMode
from ..row_layout import layout_key

# FBGEMM's PoolingMode values, as the kernels take them (the C++ kernel's kPool* constants equal these).
POOL_SUM, POOL_MEAN, POOL_NONE = (int(PoolingMode.SUM), int(PoolingMode.MEAN), int(PoolingMode.NONE))


def row_alignment(table_dims) -> int:
    """The largest power of two <= 16 dividing every dim of ``table_dims``: the
    Triton kernels read and write rows in vectors of this many elements, so every table's element
    offset (``table_w_offset``) and every pooled bag's output offset (``bag_out_offset``) is a
    multiple of it (the TBE's are: sums of rows x dims)."""
    g = 0
    for d in table_dims:
        g = math.gcd(g, int(d))
    vec = 1
    while vec < 16 and g % (vec * 2) == 0:
        vec *= 2
    return vec


def index_factors(per_sample_weights, pooling_mode: int) -> tuple[bool, bool]:
    """``(has_psw, has_scale)``: whether the indices of a batch carry per-sample weights, and a
    gradient factor at all (per-sample weight and/or the 1/L of MEAN pooling)."""
    has_psw = per_sample_weights is not None and pooling_mode != POOL_NONE
    return has_psw, has_psw or pooling_mode == POOL_MEAN


@dataclasses.dataclass(frozen=True)
class TableArrays:
    """The flat arrays of a TBE's tables, as every backend reads and updates them.

    Attributes:
        weights: ``[total]`` in the weights' dtype (fp32 / fp16 / bf16) when the layout stores
            weights; None when they are derived (``w = prox(linear, accum)``,
            :func:`torchrec_ftrl.rule.ftrl_prox`).
        accum: n, fp32 or bf16: ``[total]`` (element-wise, same offsets as the weights) or
            ``[total_rows]`` (row-wise: row ``r`` of table ``t`` at ``table_row_base[t] + r``).
        linear: z, fp32 or bf16, ``[total]``.
        rowwise: True for a row-wise ``accum``.
    """

    weights: torch.Tensor | None
    accum: torch.Tensor
    linear: torch.Tensor
    rowwise: bool = False

    @property
    def derived(self) -> bool:
        """True when the weights are derived from ``(linear, accum)``."""
        return self.weights is None

    @property
    def layout_key(self) -> tuple[str, str]:
        """``(ftrl_weights, ftrl_accumulator)`` of these arrays, as
        :data:`torchrec_ftrl.row_layout.KERNEL_LAYOUTS` lists layouts."""
        return layout_key(not self.derived, self.rowwise)


@dataclasses.dataclass
class TBEBatch:
    """One batch as every backend reads it. Every tensor is int64 on the weights' device unless stated.

    Attributes:
        table_w_offset: ``[T]`` element offset of each table in the flat buffers.
        table_dim: ``[T]`` embedding dim D of each table.
        table_rows: ``[T]`` rows of each table.
        feature_table: ``[F]`` table of each feature.
        bag_feature: ``[num_bags]`` feature of each bag.
        bag_out_offset: ``[num_bags]`` element offset of each bag's output vector.
        indices: ``[N]`` row ids.
        offsets: ``[num_bags + 1]``.
        per_sample_weights: ``[N]`` fp32 or None.
        pooling_mode: POOL_SUM, POOL_MEAN or POOL_NONE.
        out_numel: elements in the flat output.
        max_D: largest D (Python int).
        total_rows: rows of all tables together (Python int).
        table_dims: ``table_dim`` as a Python tuple (lets a backend specialise without reading the
            device).
        table_row_base: ``[T]`` first linearised row id of each table (``cumsum(rows) - rows``).
        unchecked_counter: None when ``indices`` and ``offsets`` are checked (and, under WARNING,
            repaired). Otherwise the int64 ``[1]`` WARNING counter: the batch is raw, and the backend
            (whose ``Capabilities.fused_check`` asked for it) repairs the offsets, reads an index outside
            ``[0, rows)`` as row 0 and adds the number of such repairs here, once per forward.
        cache_locations: int32 ``[N]`` cache slot of each index's row (-1: not cached), or None.
        cache_weights: ``[slots, S]`` weight cache in the weights' dtype (``S >= max_D``; ``[slots,
            0]`` for derived weights), or None.
        cache_states: the accum and linear caches, ``cache_states[0]`` / ``cache_states[1]``, each
            ``[slots, S]`` (same row stride ``S``; a row-wise accum ``[slots, 1]``) in its state's
            dtype: a ``[2, slots, S]`` tensor or a pair of tensors; or None.
        step: int64 ``[1]``, the optimizer step the update's stochastic rounding of bf16 states
            hashes (the TBE's ``iter`` buffer itself, read by the update before its increment), or
            None (then the states must be fp32).
    """

    table_w_offset: torch.Tensor
    table_dim: torch.Tensor
    table_rows: torch.Tensor
    feature_table: torch.Tensor
    bag_feature: torch.Tensor
    bag_out_offset: torch.Tensor
    indices: torch.Tensor
    offsets: torch.Tensor
    per_sample_weights: torch.Tensor | None
    pooling_mode: int
    out_numel: int
    max_D: int
    total_rows: int
    table_dims: tuple
    table_row_base: torch.Tensor
    unchecked_counter: torch.Tensor | None = None
    cache_locations: torch.Tensor | None = None
    cache_weights: torch.Tensor | None = None
    cache_states: torch.Tensor | tuple | None = None
    step: torch.Tensor | None = None
    _index_bag: torch.Tensor | None = dataclasses.field(default=None, init=False, repr=False,
                                                        compare=False)

    @property
    def num_bags(self) -> int:
        return self.offsets.numel() - 1

    def index_bag(self) -> torch.Tensor:
        """``[N]`` bag of each index (int64); computed once per batch."""
        if self._index_bag is None:
            lengths = self.offsets[1:] - self.offsets[:-1]
            self._index_bag = torch.repeat_interleave(
                torch.arange(self.num_bags, device=self.offsets.device), lengths,
                output_size=self.indices.numel())
        return self._index_bag

    def index_out_offset(self) -> torch.Tensor:
        """``[N]`` element offset in the flat output (or grad) of each index's bag vector."""
        if self.pooling_mode == POOL_NONE:
            return torch.arange(self.indices.numel(), device=self.indices.device) * self.max_D
        return self.bag_out_offset[self.index_bag()]

    def index_scale(self) -> torch.Tensor | None:
        """``[N]`` fp32 factor of each index's gradient: per-sample weight and 1/L for MEAN, or None."""
        scale = self.per_sample_weights.float() if self.per_sample_weights is not None else None
        if self.pooling_mode == POOL_MEAN:
            lengths = (self.offsets[1:] - self.offsets[:-1])[self.index_bag()].float()
            inv = 1.0 / lengths
            scale = inv if scale is None else scale * inv
        return scale

    def index_table(self) -> torch.Tensor:
        """``[N]`` table of each index."""
        return self.feature_table[self.bag_feature[self.index_bag()]]

    def index_row_offset(self) -> torch.Tensor:
        """``[N]`` element offset of each index's row in the flat weight buffer."""
        t = self.index_table()
        return self.table_w_offset[t] + self.indices * self.table_dim[t]
