"""How the FTRL TBE turns ``(indices, offsets, per_sample_weights, batch sizes)`` into the
:class:`~torchrec_ftrl.kernels.layout.TBEBatch` every backend reads: input checks, the bags'
layout (plain or VBE), the bounds check, and what a CUDA graph capture refuses. A mixin of
:class:`torchrec_ftrl.tbe.FTRLTableBatchedEmbeddingBags`, reading its tables' buffers."""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from .bounds_check import check_batch
from .fbgemm_enums import BoundsCheckMode, PoolingMode
from .kernels.layout import TBEBatch
from .tbe_args import _check_int_vector


class BatchMixin:
    """The batch of a forward (see the module docstring)."""

    def _check_capturable(self, bsfpr) -> None:
        """Refuse, before any work, what a CUDA graph cannot replay.

        A captured training step (and a captured lookup of derived weights) replays its kernels
        with the learning rate and ``ftrl_*`` knobs of the capture (a device tensor of them, kept
        with the captured hyper-parameters), so the forward remembers them and
        :meth:`set_learning_rate` and :meth:`update_hyper_parameters` warn after such a capture.

        Raises:
            RuntimeError: ``bounds_check_mode=FATAL`` (it reads its count on the host), the
                ``MANAGED_CACHING`` placement (FBGEMM's cache ops), a VBE batch (its layout is built
                on the host), or a backend other than ``"triton"``.
        """
        why = None
        if not self._backend.capabilities.graph_capture:
            why = f"backend={self.backend!r} (only 'triton' is capturable)"
        elif self.bounds_check_mode == BoundsCheckMode.FATAL:
            why = ("bounds_check_mode=FATAL (it reads its count on the host once per forward; use "
                   "WARNING or IGNORE)")
        elif self.cache is not None:
            why = "the MANAGED_CACHING placement (fused_uvm_caching)"
        elif bsfpr is not None:
            why = "batch_size_per_feature_per_rank (VBE: the layout is built on the host)"
        if why is not None:
            raise RuntimeError(f"FTRLTableBatchedEmbeddingBags cannot be captured in a CUDA graph with {why}")

    def _warn_if_captured(self) -> None:
        if self._captured_hps and self._hp != self._captured_hps[-1]:   # the latest capture
            warnings.warn("FTRL hyper-parameters changed after a CUDA graph captured this TBE's step: "
                          "graphs captured before replay the old values (the learning rate and ftrl_* "
                          "knobs of their capture); capture the step again", stacklevel=3)

    def _make_batch(self, indices, offsets, per_sample_weights, bsfpr,
                    warn_counter: Optional[torch.Tensor] = None) -> TBEBatch:
        """The checked batch (``warn_counter``: where WARNING repairs are counted, default
        ``bounds_check_warning``)."""
        dev = self.linear_dev.device
        F = len(self.feature_table_map)
        for name, t in (("indices", indices), ("offsets", offsets)):
            _check_int_vector(name, t, dev)
        if offsets.numel() < 1:
            raise ValueError("offsets must have at least 1 element, got shape=(0,)")
        N, num_bags = indices.numel(), offsets.numel() - 1
        if per_sample_weights is not None:
            if not isinstance(per_sample_weights, torch.Tensor) or not per_sample_weights.is_floating_point():
                raise ValueError(f"per_sample_weights must be a floating-point tensor, got "
                                 f"{getattr(per_sample_weights, 'dtype', type(per_sample_weights))}")
            if per_sample_weights.device != dev:
                raise ValueError(f"per_sample_weights must be on {dev}, got device={per_sample_weights.device}")
            if tuple(per_sample_weights.shape) != (N,):
                raise ValueError(f"per_sample_weights must have shape ({N},) like indices, got "
                                 f"shape={tuple(per_sample_weights.shape)}")
            if self.pooling_mode == PoolingMode.NONE:
                raise ValueError("per_sample_weights is not supported with pooling_mode=NONE")
        # The kernels index flat memory: strided views (e.g. a column of a 2-D tensor) are copied.
        offsets64 = offsets.long().contiguous()
        indices64 = indices.long().contiguous()
        if bsfpr is not None:
            if self.pooling_mode == PoolingMode.NONE:
                raise ValueError("batch_size_per_feature_per_rank (VBE) needs pooling SUM or MEAN")
            bag_feature, bag_out_offset, out_numel = self._vbe_layout(bsfpr, num_bags)
        else:
            if num_bags % F != 0:
                raise ValueError(f"offsets must have num_features * B + 1 = {F} * B + 1 elements, got "
                                 f"{offsets.numel()}")
            B = num_bags // F
            bag_feature, bag_out_offset = self._plain_layout(B)
            out_numel = N * self.max_D if self.pooling_mode == PoolingMode.NONE else B * self.total_D
        needs_psw_grad = per_sample_weights is not None and per_sample_weights.requires_grad
        unchecked_counter = None
        fatal = self.bounds_check_mode == BoundsCheckMode.FATAL
        counter = (self._fatal_count if fatal else self.bounds_check_warning) \
            if warn_counter is None else warn_counter
        # A cached batch is checked here: FBGEMM's populate reads the indices before any kernel.
        # The kernels check a raw batch (Capabilities.fused_check): FATAL, and WARNING unless the
        # per-sample weights' gradient (which reads a checked batch) is needed.
        fused = fatal or (self.bounds_check_mode == BoundsCheckMode.WARNING and not needs_psw_grad)
        if self.cache is None and fused and self._backend.capabilities.fused_check:
            unchecked_counter = counter   # the backend checks and counts
        else:
            indices64, offsets64 = self._bounds_check(indices64, offsets64, bag_feature, counter)
        return TBEBatch(
            table_w_offset=self._table_w_offset, table_dim=self._table_dim,
            table_rows=self._table_rows, feature_table=self._feature_table,
            bag_feature=bag_feature, bag_out_offset=bag_out_offset, indices=indices64,
            offsets=offsets64,
            per_sample_weights=(per_sample_weights.detach().float().contiguous()
                                if per_sample_weights is not None else None),
            pooling_mode=int(self.pooling_mode), out_numel=out_numel, max_D=self.max_D,
            total_rows=self._total_rows, table_dims=self._table_dims,
            table_row_base=self._table_row_base, unchecked_counter=unchecked_counter,
            step=self.iter)

    def _plain_layout(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(bag_feature, bag_out_offset)`` of ``F * B`` bags in the ``[B, total_D]`` output; the
        last batch size's pair is kept (device tensors, never modified)."""
        dev = self.linear_dev.device
        if self._plain_layout_cache is None or self._plain_layout_cache[0] != (B, dev):
            ar = torch.arange(B * len(self.feature_table_map), device=dev)
            bag_feature = ar // max(B, 1)
            bag_out_offset = (ar % max(B, 1)) * self.total_D + self._D_offsets[bag_feature]
            self._plain_layout_cache = ((B, dev), bag_feature, bag_out_offset)
        return self._plain_layout_cache[1], self._plain_layout_cache[2]

    def _vbe_layout(self, bsfpr, num_bags):
        F = len(self.feature_table_map)
        try:
            sizes = [[int(b) for b in per_rank] for per_rank in bsfpr]
        except (TypeError, ValueError):
            raise ValueError(f"batch_size_per_feature_per_rank must be a list of {F} lists of ints, got "
                             f"{bsfpr!r}")
        R = len(sizes[0]) if sizes else 0
        if len(sizes) != F or R == 0 or any(len(s) != R for s in sizes) or any(b < 0 for s in sizes for b in s):
            raise ValueError(f"batch_size_per_feature_per_rank must be {F} lists of the same number of "
                             f"non-negative ints, got {bsfpr!r}")
        total = sum(sum(s) for s in sizes)
        if total != num_bags:
            raise ValueError(f"batch_size_per_feature_per_rank sums to {total} bags but offsets has "
                             f"{num_bags} bags (offsets.numel() - 1)")
        dims = [self.D_offsets[f + 1] - self.D_offsets[f] for f in range(F)]
        # FBGEMM VBE output: rank-major, then feature, then sample.
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
        dev = self.linear_dev.device
        return (torch.tensor(bag_f, dtype=torch.int64).to(dev, non_blocking=True),
                torch.tensor(bag_off, dtype=torch.int64).to(dev, non_blocking=True), pos)

    def _raise_if_counted(self, batch: TBEBatch) -> None:
        """After a forward whose kernels ran the FATAL check (counting into ``_fatal_count``): the
        check's one host sync. A non-zero count raises the check's ``ValueError`` (found again on
        the raw batch, to name the first bad offset or index) before any update has run."""
        if int(self._fatal_count) == 0:
            return
        self._fatal_count.zero_()
        self._bounds_check(batch.indices, batch.offsets, batch.bag_feature, None)
        raise ValueError("the FATAL bounds check counted bad offsets or indices in this batch")

    def _bounds_check(self, indices, offsets, bag_feature, counter):
        return check_batch(self.bounds_check_mode, self._table_rows, self._feature_table, self.table_names,
                           bag_feature, indices, offsets, counter, self._backend.ops)
