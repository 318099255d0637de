"""The TBE's calls of the ops (:mod:`.ops`), the same for every backend (:class:`~.backend.Backend`).

Turns the tables' arrays (:class:`~.batch.TableArrays`), a batch (:class:`~.batch.TBEBatch`) and the
knobs (:class:`~torchrec_ftrl.hyperparams.FTRLHyperparams`, :mod:`.knobs`) into the ops' arguments and
reads the backend's :class:`~.capabilities.Capabilities` to choose which ops a step runs: a backend
that ``linearizes`` runs ``tbe_linearize`` in the training forward and hands its result to the
backward; a raw batch (``batch.unchecked_counter`` set: the backend has ``fused_check``) goes to the
kernels with its counter.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from ..hyperparams import FTRLHyperparams
from .backend import Backend
from .knobs import knob_args
from .pytorch.index_rows import per_sample_weight_grad  # noqa: F401  (the TBE's, on every backend)
from .batch import TableArrays, TBEBatch


class Linearized(NamedTuple):
    """What a training forward keeps for its backward: the offsets it read (repaired where the batch
    was raw) and the first four results of ``tbe_linearize`` ``(key, gofs, scale, tid)``."""

    offsets: torch.Tensor
    lin: tuple


def _arrays(arrays: TableArrays) -> tuple:
    return arrays.weights, arrays.accum, arrays.linear, bool(arrays.rowwise)


def _batch(batch: TBEBatch, offsets: torch.Tensor) -> tuple:
    return (batch.table_w_offset, batch.table_dim, batch.table_rows, batch.table_row_base,
            batch.feature_table, batch.bag_feature, batch.bag_out_offset, batch.indices, offsets,
            batch.per_sample_weights, int(batch.pooling_mode), int(batch.max_D), batch.table_dims,
            int(batch.total_rows))


def _cache(batch: TBEBatch) -> tuple:
    if batch.cache_locations is None:
        return None, None, None, None
    return batch.cache_locations, batch.cache_weights, batch.cache_states[0], batch.cache_states[1]


def _check_layout(backend: Backend, arrays: TableArrays, batch: TBEBatch) -> None:
    """Raise ``ValueError`` for a batch of the cached placement whose row layout the backend's
    kernels do not run cached (``Capabilities.cached_layouts``)."""
    if batch.cache_locations is None:
        return
    layout, cached = arrays.layout_key, backend.capabilities.cached_layouts
    if layout not in cached:
        raise ValueError(f"the {backend.name} FTRL kernels run the cached placement (fused_uvm_caching) "
                         f"with layouts {sorted(cached)} only, got ftrl_weights={layout[0]!r}, "
                         f"ftrl_accumulator={layout[1]!r}")


def _lookup(backend: Backend, arrays: TableArrays, batch: TBEBatch, offsets: torch.Tensor,
            out_dtype: torch.dtype, hp: FTRLHyperparams, row_keys: Optional[torch.Tensor]) -> torch.Tensor:
    """``tbe_forward``: a raw batch checked by the kernels into its counter; a checked one with a
    scratch ``warn``, which the kernels do not touch (the op takes one always, :mod:`.ops`)."""
    dev = arrays.linear.device
    warn = batch.unchecked_counter
    check = warn is not None
    if not check:
        warn = torch.empty(1, dtype=torch.int64, device=dev)
    return backend.ops.forward(hp, *_arrays(arrays), *_batch(batch, offsets), *knob_args(hp, dev),
                               int(batch.out_numel), out_dtype, warn, check, row_keys, *_cache(batch))


def forward(backend: Backend, arrays: TableArrays, batch: TBEBatch, out_dtype: torch.dtype,
            hp: FTRLHyperparams) -> torch.Tensor:
    """The pooled lookup: the flat output ``[batch.out_numel]`` in ``out_dtype`` (fp32 accumulation;
    derived weights are ``prox(linear, accum)`` with ``hp``). A raw batch's offsets are repaired
    first (``tbe_repair_offsets``) and its out-of-range indices read as row 0, both counted in
    ``batch.unchecked_counter``.

    Raises:
        ValueError: a cached batch in a layout the backend does not run cached.
    """
    _check_layout(backend, arrays, batch)
    offsets = batch.offsets
    if batch.unchecked_counter is not None:
        offsets = backend.ops.repair_offsets(offsets, batch.unchecked_counter, batch.indices.numel())
    return _lookup(backend, arrays, batch, offsets, out_dtype, hp, None)


def forward_train(backend: Backend, arrays: TableArrays, batch: TBEBatch, out_dtype: torch.dtype,
                  hp: FTRLHyperparams) -> tuple[torch.Tensor, Optional[Linearized]]:
    """The forward of a training step, whose backward follows: :func:`forward`'s output, and for a
    backend that ``linearizes`` the linearised batch (``tbe_linearize``, which also checks and
    repairs a raw batch in the same pass; the lookup then reads its checked row keys), else None."""
    if not backend.capabilities.linearizes:
        return forward(backend, arrays, batch, out_dtype, hp), None
    _check_layout(backend, arrays, batch)
    warn = batch.unchecked_counter
    fused = None
    if backend.ops.train_forward is not None and batch.cache_locations is None:
        fused = backend.ops.train_forward(hp, *_arrays(arrays), *_batch(batch, batch.offsets),
                                          *knob_args(hp, arrays.linear.device), int(batch.out_numel),
                                          out_dtype, warn)
    if fused is not None:
        out, lin = fused
    else:
        lin = backend.ops.linearize(*_batch(batch, batch.offsets), int(batch.out_numel), warn)
    offsets = batch.offsets if warn is None else lin[4]
    if fused is None:
        out = _lookup(backend, arrays, batch, offsets, out_dtype, hp, lin[0])
    return out, Linearized(offsets, tuple(lin[:4]))


def train_lookup(backend: Backend, arrays: TableArrays, batch: TBEBatch, out_dtype: torch.dtype,
                 hp: FTRLHyperparams, placeholder: torch.Tensor, nonfinite_rows: torch.Tensor,
                 iteration: torch.Tensor, hp_version: torch.Tensor,
                 hp_now: Callable[[], FTRLHyperparams]) -> Optional[torch.Tensor]:
    """A training step's lookup and its update as one autograd op of the backend
    (``OpTable.train_lookup``): :func:`forward_train`'s output, whose backward does what
    :func:`backward_update_` does and adds 1 to ``iteration``. The update uses the knobs of
    backward time: ``hp`` while ``hp_version`` (CPU int64 ``[1]``, counting the caller's changes of
    its knobs) keeps its forward value, else ``hp_now()``. None where the step is to run
    through :func:`forward_train` and :func:`backward_update_` instead: a backend without the op or
    not ready for the step, a cached batch, a bf16 state without ``batch.step``. Per-sample weights
    that need a gradient are the caller's to route to the other path."""
    op = backend.ops.train_lookup
    if (op is None or batch.cache_locations is not None
            or (batch.step is None and torch.bfloat16 in (arrays.accum.dtype, arrays.linear.dtype))):
        return None
    return op(hp, *_arrays(arrays), *_batch(batch, batch.offsets), *knob_args(hp, arrays.linear.device),
              int(batch.out_numel), out_dtype, batch.unchecked_counter, placeholder, nonfinite_rows,
              batch.step, iteration, hp_version, lambda: knob_args(hp_now(), arrays.linear.device))


def backward_update_(backend: Backend, arrays: TableArrays, batch: TBEBatch, ctx: Optional[Linearized],
                     grad_out: torch.Tensor, hp: FTRLHyperparams, nonfinite_rows: torch.Tensor) -> None:
    """Sum the gradient (``grad_out`` flat ``[batch.out_numel]``, fp32/fp16/bf16) per touched row,
    then ONE FTRL update per row in place (``tbe_backward_update_``); rows whose summed gradient
    holds a NaN/Inf are skipped and counted in ``nonfinite_rows`` (int64 ``[1]``). ``ctx``: what
    :func:`forward_train` returned (None: no training forward ran; a raw batch's repairs are then
    not counted again). A bf16 state is stored by stochastic rounding with step ``batch.step``.

    Raises:
        ValueError: a bf16 state and ``batch.step`` None; a cached batch in a layout the backend
            does not run cached.
    """
    _check_layout(backend, arrays, batch)
    if batch.step is None and torch.bfloat16 in (arrays.accum.dtype, arrays.linear.dtype):
        raise ValueError("a bf16 optimizer state needs batch.step (the TBE's iter) for its "
                         "stochastic rounding, got None")
    raw = batch.unchecked_counter is not None
    if ctx is None:
        offsets, lin = batch.offsets, (None,) * 4
        if raw:   # repaired again, counted in a scratch counter (the forward counted them)
            offsets = backend.ops.repair_offsets(offsets, torch.zeros_like(batch.unchecked_counter),
                                                 batch.indices.numel())
    else:
        offsets, lin = ctx
    backend.ops.backward_update_(hp, *_arrays(arrays), *_batch(batch, offsets), grad_out,
                                 *knob_args(hp, arrays.linear.device), nonfinite_rows, batch.step, raw,
                                 *lin, *_cache(batch))

