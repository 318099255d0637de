"""The tables of one FTRL TBE: their geometry, parsed once from the constructor's arguments, and where
each table's rows sit in the flat buffers.

Weights and both states live in flat 1-D buffers, table after table, row-major, no padding (FBGEMM's
``weights_offsets``): element ``weights_offsets[t] + r * dims[t] + d`` is row ``r``, column ``d`` of
table ``t``. A row-wise ``accum`` holds one value per row, row ``r`` of table ``t`` at
``row_base[t] + r``. Features map to tables by ``feature_table_map``; feature ``f``'s pooled vector
sits at columns ``[D_offsets[f], D_offsets[f + 1])`` of the ``[B, total_D]`` output.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import NamedTuple

import torch

from ..kernels.arg_checks import remember_values
from ..row_layout import RowLayout


class TableTensors(NamedTuple):
    """The geometry's facts as int64 device tensors, the form the kernels read (the TBE's
    non-persistent buffers of these names, prefixed with ``_``)."""

    table_w_offset: torch.Tensor   # [T] element offset of each table in the flat buffers
    table_dim: torch.Tensor        # [T] embedding dim of each table
    table_rows: torch.Tensor       # [T] rows of each table
    table_row_base: torch.Tensor   # [T] first global row key of each table
    feature_table: torch.Tensor    # [F] table of each feature
    feature_dim: torch.Tensor      # [F] embedding dim of each feature
    D_offsets: torch.Tensor        # [F + 1] first output column of each feature


@dataclasses.dataclass(frozen=True)
class TableGeometry:
    """Rows, dims, names and the feature map of a TBE's tables (Python ints; see the module
    docstring for the offsets derived from them)."""

    rows: tuple[int, ...]
    dims: tuple[int, ...]
    feature_table_map: tuple[int, ...]
    names: tuple[str, ...]

    @property
    def num_tables(self) -> int:
        return len(self.rows)

    @functools.cached_property
    def weights_offsets(self) -> list[int]:
        """Element offset of each table in the flat weight / state buffers."""
        return list(itertools.accumulate((r * d for r, d in zip(self.rows, self.dims)), initial=0))[:-1]

    @functools.cached_property
    def row_base(self) -> list[int]:
        """First global row key of each table (``cumsum(rows) - rows``)."""
        return list(itertools.accumulate(self.rows, initial=0))[:-1]

    @functools.cached_property
    def feature_dims(self) -> list[int]:
        return [self.dims[t] for t in self.feature_table_map]

    @functools.cached_property
    def D_offsets(self) -> list[int]:
        """First output column of each feature, and ``total_D`` last (FBGEMM's ``D_offsets``)."""
        return list(itertools.accumulate(self.feature_dims, initial=0))

    @property
    def total_D(self) -> int:
        return self.D_offsets[-1]

    @property
    def max_D(self) -> int:
        return max(self.dims)

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    @property
    def total_elements(self) -> int:
        """Elements of one ``[rows, D]`` array of every table: the weight and ``linear`` buffers."""
        return sum(r * d for r, d in zip(self.rows, self.dims))

    def tensors(self, device: torch.device) -> TableTensors:
        """These facts as int64 tensors on ``device``."""
        i64 = dict(dtype=torch.int64, device=device)
        facts = (self.weights_offsets, self.dims, self.rows, self.row_base, self.feature_table_map,
                 self.feature_dims, self.D_offsets)
        tensors = TableTensors(*(torch.tensor(values, **i64) for values in facts))
        for t, values in zip(tensors, facts):   # host facts: the ops' checks need not read them
            remember_values(t, values)
        return tensors

    def table_view(self, buf: torch.Tensor, t: int) -> torch.Tensor:
        """Table ``t``'s ``[rows, D]`` view of a flat weight or state buffer."""
        off, rows, dim = self.weights_offsets[t], self.rows[t], self.dims[t]
        return buf[off:off + rows * dim].view(rows, dim)

    def accum_view(self, accum: torch.Tensor, layout: RowLayout, t: int) -> torch.Tensor:
        """Table ``t``'s ``accum``: ``[rows, D]``, or ``[rows]`` for a row-wise accumulator."""
        if not layout.rowwise:
            return self.table_view(accum, t)
        base = self.row_base[t]
        return accum[base:base + self.rows[t]]

    def accum_rows(self, accum: torch.Tensor, layout: RowLayout, t: int,
                   rows: torch.Tensor | slice) -> torch.Tensor:
        """Table ``t``'s ``accum`` of ``rows``, broadcastable against their ``[k, D]`` ``linear``
        (``[k, 1]`` for a row-wise accumulator)."""
        n = self.accum_view(accum, layout, t)[rows]
        return n.unsqueeze(-1) if layout.rowwise else n
