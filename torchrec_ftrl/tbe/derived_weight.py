"""A derived-weights table's weights as a tensor: ``prox(linear, accum)`` on read, encoded on write.

A table whose row layout derives its weights (``ftrl_weights="derived"``,
:class:`torchrec_ftrl.row_layout.RowLayout`) has no weight array. :class:`DerivedWeight` stands in
for one wherever TorchRec and its users expect a ``[rows, D]`` weight tensor (the TBE's
``split_embedding_weights``, the sharded module's ``weight`` parameters and ``state_dict``): a
storage-less tensor of that shape (fp32, the tables' device) whose

* reads (any op that is not a write into it) compute the weights ``prox(z, n)`` of its rows in chunks
  of at most :data:`CHUNK_ROWS` rows where the op is a copy (``.cpu()``, ``.to()``, ``clone``), so a
  checkpoint save holds one chunk of fp32 weights on the device at a time; other ops see the
  whole range computed once;
* writes (``copy_``, ``uniform_``, ``fill_``, ``zero_``, any in-place op TorchRec's ``init_fn`` or a
  load applies) encode the new weights into ``linear``, :data:`CHUNK_ROWS` rows at a time, leaving
  rows whose weights do not change as they are (``FTRLTableBatchedEmbeddingBags.load_weights``:
  exact up to rounding where ``q(accum) > 0``, else the row starts at 0 with a one-time warning);
* row slices (``w[a:b]``, ``narrow(0, ...)``), ``detach`` and ``alias`` are views of the same rows;
  ``w[rows]`` reads and ``w[rows] = v`` writes only those rows. One row by an integer (``w[7]``,
  ``w[-1]``, ``select(0, i)``) is a :class:`DerivedRow`, a ``[D]`` view of that row: writes of the
  whole row (``w[7] = v``, ``w[7].copy_(v)``, ``w[7].zero_()``) land in the table. Other views (an
  element, a column, part of a row, a reshape, a ``split``) are :class:`ReadOnlyWeights`: readable,
  and a write into them raises ``RuntimeError`` rather than being lost, as does ``out=`` a
  ``DerivedWeight`` or a ``DerivedRow``.

Metadata queries (shape, dtype, device, ``is_pinned``) compute nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

aten = torch.ops.aten

# Rows computed at a time when a read copies the weights (to the host, another dtype or a clone):
# 65,536 rows of D = 128 are 32 MiB of fp32.
CHUNK_ROWS = 65536

_VIEWS = {aten.detach.default, aten.alias.default}
_COPIES = {aten._to_copy.default, aten.clone.default}
# In-place ops whose value at a row depends only on that row (and on the same row of a tensor
# argument of as many rows): applied chunk by chunk. Other in-place ops see the whole range.
_ROW_ALIGNED = {aten.copy_.default, aten.uniform_.default, aten.normal_.default, aten.fill_.Scalar,
                aten.fill_.Tensor, aten.zero_.default, aten.add_.Tensor, aten.add_.Scalar,
                aten.sub_.Tensor, aten.mul_.Tensor, aten.mul_.Scalar, aten.div_.Tensor,
                aten.clamp_.default}


class DerivedWeight(torch.Tensor):
    """Rows ``[row_start, row_start + rows)`` of table ``table`` of a derived-weights FTRL TBE, as an
    fp32 ``[rows, D]`` tensor without storage (see the module docstring).

    Args:
        tbe: the ``FTRLTableBatchedEmbeddingBags`` holding the table.
        table: the table's index in ``tbe``.
        row_start, rows: the row range (default: the whole table).
    """

    _tbe: Any
    _table: int
    _row_start: int

    @staticmethod
    def __new__(cls, tbe, table: int, row_start: int = 0, rows: int | None = None):
        total, dim = tbe.embedding_specs[table][:2]
        rows = total - row_start if rows is None else rows
        return torch.Tensor._make_wrapper_subclass(cls, (rows, dim), dtype=torch.float32,
                                                   device=tbe.linear_dev.device, requires_grad=False)

    def __init__(self, tbe, table: int, row_start: int = 0, rows: int | None = None) -> None:
        self._tbe, self._table, self._row_start = tbe, int(table), int(row_start)

    def __repr__(self) -> str:
        return (f"DerivedWeight(table={self._tbe.table_names[self._table]!r}, rows=[{self._row_start}, "
                f"{self._row_start + self.shape[0]}), dim={self.shape[1]})")

    def _view(self, start: int, rows: int) -> "DerivedWeight":
        return DerivedWeight(self._tbe, self._table, self._row_start + start, rows)

    def _rows(self, start: int = 0, rows: int | None = None) -> slice:
        rows = self.shape[0] - start if rows is None else rows
        return slice(self._row_start + start, self._row_start + start + rows)

    def materialize(self) -> torch.Tensor:
        """The weights of these rows as a plain fp32 ``[rows, D]`` tensor on the tables' device."""
        return self._tbe.derived_weights(self._table, self._rows())

    def _copy_to(self, **to: Any) -> torch.Tensor:
        """The weights copied with ``Tensor.to(**to)``, computed :data:`CHUNK_ROWS` rows at a time."""
        out = None
        for start in range(0, self.shape[0], CHUNK_ROWS):
            chunk = self._tbe.derived_weights(self._table, self._rows(start, min(CHUNK_ROWS, self.shape[0] - start)))
            chunk = chunk.to(**to, copy=True)
            if out is None:
                out = torch.empty((self.shape[0],) + tuple(chunk.shape[1:]), dtype=chunk.dtype,
                                  device=chunk.device)
            out[start:start + chunk.shape[0]] = chunk
        return out if out is not None else self.materialize().to(**to, copy=True)

    def assign(self, values: torch.Tensor) -> None:
        """Encode ``values`` (``[rows, D]``) as these rows' weights (see the module docstring). Rows
        whose values equal their weights now are left as they are: a checkpoint load that writes the
        weights after their ``linear`` and ``accum`` (or before: ``linear`` then overwrites the
        encoding) restores ``linear`` bit for bit."""
        values = values.to(device=self.device, dtype=torch.float32).expand(self.shape)
        for start in range(0, self.shape[0], CHUNK_ROWS):
            self._tbe.load_weights(self._table, values[start:start + CHUNK_ROWS],
                                   row_start=self._row_start + start, only_changed=True)

    def numpy(self, *, force: bool = False):
        """The weights as a NumPy array (computed on the host)."""
        return self._copy_to(device="cpu").numpy()

    def tolist(self):
        return self._copy_to(device="cpu").tolist()

    def _write(self, func, args: tuple, kwargs: dict) -> None:
        """Apply the in-place op ``func`` to the weights, :data:`CHUNK_ROWS` rows at a time: each
        chunk's weights are computed, changed by ``func`` (tensor arguments with one row per row of
        this tensor are sliced to the chunk) and encoded back (:meth:`assign`)."""
        rows = self.shape[0]
        args, kwargs = tree_map(_plain, (args, kwargs))
        if func not in _ROW_ALIGNED:
            values = self.materialize()
            func(values, *args, **kwargs)
            self.assign(values)
            return
        for start in range(0, rows, CHUNK_ROWS):
            stop = min(rows, start + CHUNK_ROWS)
            part = tree_map(lambda x: x[start:stop] if isinstance(x, torch.Tensor) and x.dim() == 2
                            and x.shape[0] == rows else x, (args, kwargs))
            chunk = self._view(start, stop - start)
            values = chunk.materialize()
            func(values, *part[0], **part[1])
            chunk.assign(values)

    def __deepcopy__(self, memo):
        """A deep copy is the plain fp32 tensor of its weights."""
        return self._copy_to()

    def __reduce_ex__(self, protocol):
        """Pickled (``torch.save``, a checkpoint writer) as the plain fp32 tensor of its weights."""
        return self._copy_to().__reduce_ex__(protocol)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = args[0] if args and isinstance(args[0], DerivedWeight) else None
        if me is not None:
            if func in _VIEWS:
                return me._view(0, me.shape[0])
            if func is aten.is_pinned.default:
                return False
            if func in (aten.slice.Tensor, aten.narrow.default):
                view = _row_view(me, func, args)
                if view is not None:
                    return view
            if func is aten.select.int and args[1] == 0:      # w[i]: the row, writable as a whole
                return DerivedRow(me._view(_row_number(me, args[2]), 1))
            if func in (aten.view.default, aten._unsafe_view.default, aten.reshape.default) and \
                    tuple(args[1]) == tuple(me.shape):
                return me._view(0, me.shape[0])
            if func in _COPIES and len(args) == 1:
                keep = {k: v for k, v in kwargs.items() if k in ("dtype", "device") and v is not None}
                if set(kwargs) <= {"dtype", "device", "layout", "memory_format", "pin_memory",
                                   "non_blocking"}:
                    return me._copy_to(**keep)
            rows = _row_index(me, func, args)
            if rows is not None and func is aten.index.Tensor:        # w[rows]
                return me._tbe.derived_weights(me._table, rows + me._row_start)
            if rows is not None and func is aten.index_put_.default and not (args[3:] and args[3]):
                values = _plain(args[2]).to(device=me.device, dtype=torch.float32)
                me._tbe.load_weights(me._table, values.expand(rows.numel(), me.shape[1]),
                                     row_ids=rows + me._row_start, only_changed=True)   # w[rows] = v
                return me
            if func._schema.arguments and func._schema.arguments[0].is_write:
                me._write(func, args[1:], kwargs)
                return me
        _refuse_out(func, kwargs)
        out = func(*tree_map(_plain, args), **tree_map(_plain, kwargs))
        if me is not None and _is_view(func):   # a view the table cannot hold: readable, not writable
            return tree_map(lambda x: ReadOnlyWeights(x, str(func)) if isinstance(x, torch.Tensor) else x, out)
        return out


def _refuse_out(func, kwargs: dict) -> None:
    """Raise ``RuntimeError`` when ``out=`` names a derived table's rows, which hold no array."""
    if any(isinstance(v, (DerivedWeight, DerivedRow)) for v in kwargs.values()):
        raise RuntimeError(f"{func}: out= a derived-weights table (DerivedWeight) is not supported; "
                           f"compute the result, then copy_ it into the table's rows")


def _row_number(me: DerivedWeight, index: int) -> int:
    """Row ``index`` of ``me`` (negative counts from the end) as an int in ``[0, rows)``.

    Raises:
        IndexError: ``index`` outside ``[-rows, rows)``, as ``Tensor.select`` words it.
    """
    rows = me.shape[0]
    if not -rows <= index < rows:
        raise IndexError(f"select(): index {index} out of range for tensor of size {tuple(me.shape)} "
                         f"at dimension 0")
    return int(index) % rows


class DerivedRow(torch.Tensor):
    """One row of a derived-weights table as an fp32 ``[D]`` tensor without storage (``w[i]`` of a
    :class:`DerivedWeight` ``w``): reads compute the row's weights; an in-place op on the whole row
    (``copy_``, ``fill_``, ``zero_``, ``add_``, ...) computes them, applies the op and encodes the
    result into the row (:meth:`DerivedWeight.assign`); ``detach`` / ``alias`` are the same row; any
    other view (an element, part of the row) is :class:`ReadOnlyWeights`.

    Args:
        row: the one-row :class:`DerivedWeight` (``[1, D]``) this row is.
    """

    _row: DerivedWeight

    @staticmethod
    def __new__(cls, row: DerivedWeight):
        return torch.Tensor._make_wrapper_subclass(cls, (row.shape[1],), dtype=torch.float32,
                                                   device=row.device, requires_grad=False)

    def __init__(self, row: DerivedWeight) -> None:
        self._row = row

    def __repr__(self) -> str:
        return f"DerivedRow({self._row!r})"

    def materialize(self) -> torch.Tensor:
        """The row's weights as a plain fp32 ``[D]`` tensor on the tables' device."""
        return self._row.materialize()[0]

    def numpy(self, *, force: bool = False):
        return self.materialize().cpu().numpy()

    def tolist(self):
        return self.materialize().tolist()

    def __deepcopy__(self, memo):
        return self.materialize().clone()

    def __reduce_ex__(self, protocol):
        return self.materialize().clone().__reduce_ex__(protocol)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = args[0] if args and isinstance(args[0], DerivedRow) else None
        if me is not None and func in _VIEWS:
            return DerivedRow(me._row)
        if me is not None and func._schema.arguments and func._schema.arguments[0].is_write:
            values = me._row.materialize()
            func(values[0], *tree_map(_plain, args[1:]), **tree_map(_plain, kwargs))
            me._row.assign(values)
            return me
        _refuse_out(func, kwargs)
        out = func(*tree_map(_plain, args), **tree_map(_plain, kwargs))
        if me is not None and _is_view(func):   # part of the row: readable, not writable
            return tree_map(lambda x: ReadOnlyWeights(x, str(func)) if isinstance(x, torch.Tensor) else x, out)
        return out


def _is_view(func) -> bool:
    """Whether ``func`` returns a view of its first argument (its schema aliases it)."""
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


class ReadOnlyWeights(torch.Tensor):
    """A view of a :class:`DerivedWeight` that the table cannot hold (a column, an element, a
    reshape, a transpose): its values are the weights, computed; writes into it raise
    ``RuntimeError`` instead of being lost (write whole rows: ``w[rows] = v``, ``w[a:b].copy_(v)``)."""

    _value: torch.Tensor
    _origin: str

    @staticmethod
    def __new__(cls, value: torch.Tensor, origin: str):
        return torch.Tensor._make_wrapper_subclass(cls, value.shape, strides=value.stride(),
                                                   dtype=value.dtype, device=value.device)

    def __init__(self, value: torch.Tensor, origin: str) -> None:
        self._value, self._origin = value, origin

    def __repr__(self) -> str:
        return f"ReadOnlyWeights({self._value!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        writes = [a for a, arg in zip(args, func._schema.arguments) if arg.is_write] + \
            [v for k, v in kwargs.items() if k == "out"]
        if any(isinstance(w, ReadOnlyWeights) for w in writes):
            origin = next(w._origin for w in writes if isinstance(w, ReadOnlyWeights))
            raise RuntimeError(
                f"{func} writes into a view ({origin}) of a derived-weights table, which holds no "
                f"weight array: the write would not reach the table. Write whole rows instead: "
                f"w[rows] = values or w[a:b].copy_(values)")
        unwrap = lambda x: x._value if isinstance(x, ReadOnlyWeights) else x  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if _is_view(func) and args and isinstance(args[0], ReadOnlyWeights):
            return tree_map(lambda x: ReadOnlyWeights(x, args[0]._origin) if isinstance(x, torch.Tensor)
                            else x, out)
        return out

    def numpy(self, *, force: bool = False):
        return self._value.detach().cpu().numpy()

    def tolist(self):
        return self._value.tolist()


def _row_index(me: DerivedWeight, func, args) -> torch.Tensor | None:
    """For ``w[rows]`` / ``w[rows] = v`` (``aten.index`` / ``index_put_`` with one int64 or bool
    index on dim 0), the int64 rows (within ``me``); else None."""
    if func not in (aten.index.Tensor, aten.index_put_.default) or len(args) < 2:
        return None
    index = args[1]
    if len(index) != 1 or index[0] is None or isinstance(index[0], DerivedWeight) or index[0].dim() != 1:
        return None
    rows = index[0]
    if rows.dtype == torch.bool:
        return rows.nonzero().flatten() if rows.numel() == me.shape[0] else None
    if rows.dtype not in (torch.int64, torch.int32):
        return None
    rows = rows.to(device=me.device, dtype=torch.int64)
    bad = (rows < -me.shape[0]) | (rows >= me.shape[0])
    if bool(bad.any()):
        raise IndexError(f"index {int(rows[bad][0])} is out of bounds for dimension 0 with size {me.shape[0]}")
    return torch.where(rows < 0, rows + me.shape[0], rows)


def _plain(x: Any) -> Any:
    return x.materialize() if isinstance(x, (DerivedWeight, DerivedRow)) else x


def _row_view(me: DerivedWeight, func, args) -> DerivedWeight | None:
    """A view of a range of rows for ``slice(dim 0, step 1)`` / ``narrow(0, ...)``, else None."""
    rows = me.shape[0]
    if func is aten.narrow.default:
        _, dim, start, length = args
        return me._view(int(start) % max(rows, 1), int(length)) if dim == 0 else None
    dim = args[1] if len(args) > 1 else 0
    start = args[2] if len(args) > 2 and args[2] is not None else 0
    end = args[3] if len(args) > 3 and args[3] is not None else rows
    step = args[4] if len(args) > 4 else 1
    if dim != 0 or step != 1:
        return None
    start = max(0, min(rows, start + rows if start < 0 else start))
    end = max(start, min(rows, end + rows if end < 0 else end))
    return me._view(start, end - start)
