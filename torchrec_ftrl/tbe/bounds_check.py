"""The FTRL TBE's input check, FBGEMM's ``bounds_check_indices`` by ``BoundsCheckMode``, stated once.

A batch is ``indices`` / ``offsets`` (int64, FBGEMM's layout: bag ``k`` holds
``indices[offsets[k]:offsets[k+1]]``) with ``bag_feature`` (``[num_bags]`` feature of each bag);
``table_rows`` ``[T]`` and ``feature_table`` ``[F]`` locate each index's table. Modes:

* ``FATAL``: a valid batch passes unchanged after one count (the backend's ``tbe_count_invalid``:
  the compiled CPU kernel's parallel count, else a count by torch ops on the device; read once);
  otherwise ``ValueError`` names the first bad offset or index and its table, before anything
  changes.
* ``WARNING``: FBGEMM's repair, with no host sync: offsets become ``cummax(clamp(offsets, 0, N))``
  with the first 0 and the last ``N``; an index outside its table reads row 0; the number of
  repaired entries is added to a counter.
* ``IGNORE`` / ``NONE``: the batch is trusted: an index outside its table or an offset outside
  ``[0, N]`` (or decreasing) is undefined behaviour (the kernels read and write outside their arrays).

Backends that fuse the check into their kernels (``Capabilities.fused_check``,
:mod:`torchrec_ftrl.kernels.capabilities`) get the raw batch instead (:meth:`BatchCheck.by_kernels`); under
``FATAL`` the TBE then reads their count once after the forward (:func:`raise_if_counted`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from ..fbgemm_enums import BoundsCheckMode
from ..kernels.backend import Backend


class BatchCheck(NamedTuple):
    """How a forward's batch is checked: the ``mode``, where repairs (``WARNING``) or the kernels'
    count (``FATAL``) go (int64 ``[1]``), the ``backend`` (whose kernels may check a raw batch), and
    whether the batch is ``cached`` (``MANAGED_CACHING``: FBGEMM's populate reads the indices before
    any kernel, so the batch is checked first)."""

    mode: BoundsCheckMode
    counter: torch.Tensor
    backend: Backend
    cached: bool

    def by_kernels(self, needs_psw_grad: bool) -> bool:
        """Whether the kernels check the raw batch (``Capabilities.fused_check``): ``FATAL``, and
        ``WARNING`` unless the per-sample weights' gradient (which reads a checked batch) is needed."""
        fused = self.mode == BoundsCheckMode.FATAL or (self.mode == BoundsCheckMode.WARNING and not needs_psw_grad)
        return fused and not self.cached and self.backend.capabilities.fused_check


def _raise_first_problem(table_rows, feature_table, table_names: Sequence[str], bag_feature, indices,
                         offsets) -> None:
    """Raise ``ValueError`` naming the first bad offset or index of a batch; return when there is none."""
    N = indices.numel()
    lengths = offsets[1:] - offsets[:-1]
    if int(offsets[0]) != 0 or bool((lengths < 0).any()) or int(offsets[-1]) != N:
        raise ValueError(
            f"offsets must start at 0, be non-decreasing and end at indices.numel()={N}; got "
            f"offsets[0]={int(offsets[0])}, offsets[-1]={int(offsets[-1])}, "
            f"{int((lengths < 0).sum())} decreasing step(s)")
    idx_bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=indices.device), lengths)
    rows = table_rows[feature_table[bag_feature[idx_bag]]]
    bad = (indices < 0) | (indices >= rows)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        feature = int(bag_feature[idx_bag[i]])
        raise ValueError(f"indices[{i}]={int(indices[i])} out of range [0, {int(rows[i])}) of "
                         f"table {table_names[int(feature_table[feature])]!r} (feature {feature}); "
                         f"{int(bad.sum())} bad index(es)")


def repair(table_rows, feature_table, bag_feature, indices, offsets, counter: torch.Tensor,
           ops) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``WARNING`` repair (see the module docstring): ``(indices, offsets)`` repaired, the number
    of repaired entries added to ``counter`` (int64 ``[1]``), no host sync. The offsets by the
    backend's ``tbe_repair_offsets`` (``ops``: its :class:`~torchrec_ftrl.kernels.capabilities.OpTable`)."""
    N = indices.numel()
    fixed_off = ops.repair_offsets(offsets, counter, N)
    lens = fixed_off[1:] - fixed_off[:-1]
    idx_bag = torch.repeat_interleave(torch.arange(lens.numel(), device=indices.device), lens,
                                      output_size=N)
    rows = table_rows[feature_table[bag_feature[idx_bag]]]
    bad = (indices < 0) | (indices >= rows)
    counter += bad.sum()
    return torch.where(bad, torch.zeros_like(indices), indices), fixed_off


def check_batch(mode: BoundsCheckMode, table_rows: torch.Tensor, feature_table: torch.Tensor,
                table_names: Sequence[str], bag_feature: torch.Tensor, indices: torch.Tensor,
                offsets: torch.Tensor, counter: Optional[torch.Tensor],
                ops) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a batch by ``mode``; returns ``(indices, offsets)`` (repaired under ``WARNING``, counted
    in ``counter``), the inputs themselves otherwise.

    Raises:
        ValueError: ``FATAL`` and a bad offset or index (naming the first, its table and feature).
    """
    if mode in (BoundsCheckMode.IGNORE, BoundsCheckMode.NONE):
        return indices, offsets
    if mode != BoundsCheckMode.FATAL:
        return repair(table_rows, feature_table, bag_feature, indices, offsets, counter, ops)
    if offsets.numel() > 0:   # the backend's tbe_count_invalid, read once (the one host sync)
        if int(ops.count_invalid(table_rows, feature_table, bag_feature, indices, offsets)) == 0:
            return indices, offsets
    _raise_first_problem(table_rows, feature_table, table_names, bag_feature, indices, offsets)
    return indices, offsets


def raise_if_counted(count: torch.Tensor, table_names: Sequence[str], batch) -> None:
    """After a forward whose kernels ran the ``FATAL`` check of the raw ``batch``
    (:class:`~torchrec_ftrl.kernels.batch.TBEBatch`), counting into ``count`` (int64 ``[1]``): the
    check's one host sync. A non-zero count is zeroed and raised as the check's ``ValueError``,
    naming the first bad offset or index (found on the raw batch), before any update has run.

    Raises:
        ValueError: the count is not zero.
    """
    if int(count) == 0:
        return
    count.zero_()
    _raise_first_problem(batch.table_rows, batch.feature_table, table_names, batch.bag_feature,
                         batch.indices, batch.offsets)
    raise ValueError("the FATAL bounds check counted bad offsets or indices in this batch")
