"""How the FTRL TBE turns a forward's ``(indices, offsets, per_sample_weights, batch sizes)`` into the
:class:`~torchrec_ftrl.kernels.batch.TBEBatch` every backend reads: input checks, the bags' layout
(plain or VBE), the bounds check (:mod:`.bounds_check`), and what a CUDA graph capture refuses."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..fbgemm_enums import BoundsCheckMode, PoolingMode
from ..kernels.arg_checks import remember_bags
from ..kernels.backend import Backend
from ..kernels.batch import TBEBatch
from .args import _check_int_vector
from .bounds_check import BatchCheck, check_batch
from .tables import TableGeometry, TableTensors


def refuse_capture(backend: Backend, mode: BoundsCheckMode, cached: bool, bsfpr: Any) -> None:
    """Refuse, before any work, what a CUDA graph cannot replay.

    A captured training step (and a captured lookup of derived weights) replays its kernels with
    the learning rate and ``ftrl_*`` knobs of the capture (a device tensor of them, kept with the
    captured hyper-parameters), so the TBE's forward remembers them and its ``set_learning_rate`` and
    ``update_hyper_parameters`` warn after such a capture.

    Raises:
        RuntimeError: ``bounds_check_mode=FATAL`` (it reads its count on the host), the
            ``MANAGED_CACHING`` placement (FBGEMM's cache ops), a VBE batch (its layout is built on
            the host), or a backend without ``Capabilities.graph_capture``.
    """
    why = None
    if not backend.capabilities.graph_capture:
        why = f"backend={backend.name!r} (only 'triton' is capturable)"
    elif mode == BoundsCheckMode.FATAL:
        why = "bounds_check_mode=FATAL (it reads its count on the host once per forward; use WARNING or IGNORE)"
    elif cached:
        why = "the MANAGED_CACHING placement (fused_uvm_caching)"
    elif bsfpr is not None:
        why = "batch_size_per_feature_per_rank (VBE: the layout is built on the host)"
    if why is not None:
        raise RuntimeError(f"FTRLTableBatchedEmbeddingBags cannot be captured in a CUDA graph with {why}")


def _check_per_sample_weights(psw: Any, n: int, device: torch.device, pooling_mode: PoolingMode) -> None:
    if not isinstance(psw, torch.Tensor) or not psw.is_floating_point():
        raise ValueError(f"per_sample_weights must be a floating-point tensor, got "
                         f"{getattr(psw, 'dtype', type(psw))}")
    if psw.device != device:
        raise ValueError(f"per_sample_weights must be on {device}, got device={psw.device}")
    if tuple(psw.shape) != (n,):
        raise ValueError(f"per_sample_weights must have shape ({n},) like indices, got "
                         f"shape={tuple(psw.shape)}")
    if pooling_mode == PoolingMode.NONE:
        raise ValueError("per_sample_weights is not supported with pooling_mode=NONE")


def _parse_batch_sizes(bsfpr: Any, num_features: int, num_bags: int) -> list[list[int]]:
    """``batch_size_per_feature_per_rank`` as ``F`` lists of ``R`` ints.

    Raises:
        ValueError: not ``F`` lists of the same number of non-negative ints, or a total that is not
            the offsets' bag count.
    """
    try:
        sizes = [[int(b) for b in per_rank] for per_rank in bsfpr]
    except (TypeError, ValueError):
        raise ValueError(f"batch_size_per_feature_per_rank must be a list of {num_features} lists of "
                         f"ints, got {bsfpr!r}")
    R = len(sizes[0]) if sizes else 0
    if len(sizes) != num_features or R == 0 or any(len(s) != R for s in sizes) or any(
            b < 0 for s in sizes for b in s):
        raise ValueError(f"batch_size_per_feature_per_rank must be {num_features} lists of the same number "
                         f"of non-negative ints, got {bsfpr!r}")
    total = sum(sum(s) for s in sizes)
    if total != num_bags:
        raise ValueError(f"batch_size_per_feature_per_rank sums to {total} bags but offsets has "
                         f"{num_bags} bags (offsets.numel() - 1)")
    return sizes


class BatchBuilder:
    """The batches of one TBE's tables (``geometry``) pooled by ``pooling_mode``; keeps the layout of
    the last plain batch size (device tensors, never modified)."""

    def __init__(self, geometry: TableGeometry, pooling_mode: PoolingMode) -> None:
        self.geometry = geometry
        self.pooling_mode = pooling_mode
        self._plain: Optional[tuple] = None   # ((B, device), bag_feature, bag_out_offset)

    def build(self, indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor],
              bsfpr: Optional[Sequence[Sequence[int]]], tables: TableTensors, check: BatchCheck,
              step: Optional[torch.Tensor]) -> TBEBatch:
        """The checked batch (the TBE's forward arguments; ``tables``: its tables' device facts;
        ``check``: its bounds check; ``step``: its ``iter``).

        Raises:
            ValueError: a malformed argument, naming it and its value; under ``FATAL`` checked here,
                a bad offset or index.
        """
        dev = tables.table_rows.device
        for name, t in (("indices", indices), ("offsets", offsets)):
            _check_int_vector(name, t, dev)
        if offsets.numel() < 1:
            raise ValueError("offsets must have at least 1 element, got shape=(0,)")
        if per_sample_weights is not None:
            _check_per_sample_weights(per_sample_weights, indices.numel(), dev, self.pooling_mode)
        # The kernels index flat memory: strided views (e.g. a column of a 2-D tensor) are copied.
        offsets64, indices64 = offsets.long().contiguous(), indices.long().contiguous()
        bag_feature, bag_out_offset, out_numel = self._layout(bsfpr, offsets.numel() - 1, indices.numel(),
                                                              tables)
        needs_psw_grad = per_sample_weights is not None and per_sample_weights.requires_grad
        unchecked_counter = check.counter if check.by_kernels(needs_psw_grad) else None
        if unchecked_counter is None:
            indices64, offsets64 = check_batch(check.mode, tables.table_rows, tables.feature_table,
                                               self.geometry.names, bag_feature, indices64, offsets64,
                                               check.counter, check.backend.ops)
        g = self.geometry
        return TBEBatch(
            table_w_offset=tables.table_w_offset, table_dim=tables.table_dim, table_rows=tables.table_rows,
            feature_table=tables.feature_table, bag_feature=bag_feature, bag_out_offset=bag_out_offset,
            indices=indices64, offsets=offsets64,
            per_sample_weights=(per_sample_weights.detach().float().contiguous()
                                if per_sample_weights is not None else None),
            pooling_mode=int(self.pooling_mode), out_numel=out_numel, max_D=g.max_D,
            total_rows=g.total_rows, table_dims=g.dims, table_row_base=tables.table_row_base,
            unchecked_counter=unchecked_counter, step=step)

    def _layout(self, bsfpr, num_bags: int, N: int, tables: TableTensors) -> tuple:
        """``(bag_feature, bag_out_offset, out_numel)`` of a plain or VBE batch."""
        g = self.geometry
        F = len(g.feature_table_map)
        if bsfpr is not None:
            if self.pooling_mode == PoolingMode.NONE:
                raise ValueError("batch_size_per_feature_per_rank (VBE) needs pooling SUM or MEAN")
            return self._vbe_layout(_parse_batch_sizes(bsfpr, F, num_bags), tables.table_rows.device)
        if num_bags % F != 0:
            raise ValueError(f"offsets must have num_features * B + 1 = {F} * B + 1 elements, got "
                             f"{num_bags + 1}")
        B = num_bags // F
        bag_feature, bag_out_offset = self._plain_layout(B, tables)
        out_numel = N * g.max_D if self.pooling_mode == PoolingMode.NONE else B * g.total_D
        return bag_feature, bag_out_offset, out_numel

    def _plain_layout(self, B: int, tables: TableTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bag_feature, bag_out_offset)`` of ``F * B`` bags in the ``[B, total_D]`` output."""
        dev = tables.table_rows.device
        if self._plain is None or self._plain[0] != (B, dev):
            ar = torch.arange(B * len(self.geometry.feature_table_map), device=dev)
            bag_feature = ar // max(B, 1)
            bag_out_offset = (ar % max(B, 1)) * self.geometry.total_D + tables.D_offsets[bag_feature]
            g = self.geometry
            remember_bags(bag_feature, bag_out_offset, len(g.feature_table_map), g.feature_dims,
                          B * g.total_D)
            self._plain = ((B, dev), bag_feature, bag_out_offset)
        return self._plain[1], self._plain[2]

    def _vbe_layout(self, sizes: list[list[int]], dev: torch.device) -> tuple:
        """FBGEMM's VBE output: rank-major, then feature, then sample."""
        F, R = len(sizes), len(sizes[0])
        dims = self.geometry.feature_dims
        rank_feature_start, pos = {}, 0
        for r in range(R):
            for f in range(F):
                rank_feature_start[(r, f)] = pos
                pos += sizes[f][r] * dims[f]
        bag_f, bag_off = [], []
        for f in range(F):
            for r in range(R):
                base = rank_feature_start[(r, f)]
                bag_f.extend([f] * sizes[f][r])
                bag_off.extend(range(base, base + sizes[f][r] * dims[f], dims[f]))
        bag_feature = torch.tensor(bag_f, dtype=torch.int64).to(dev, non_blocking=True)
        bag_out_offset = torch.tensor(bag_off, dtype=torch.int64).to(dev, non_blocking=True)
        remember_bags(bag_feature, bag_out_offset, F, dims, pos)
        return bag_feature, bag_out_offset, pos
