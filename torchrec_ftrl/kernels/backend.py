"""The kernel-backend contract of the FTRL TBE, and the choice of backend.

Backends: ``"triton"`` (CUDA tensors; :mod:`.triton_backend`), ``"cpp"`` (compiled CPU kernel;
:mod:`.cpp_backend`), ``"torch"`` (vectorised PyTorch, any device; :mod:`.torch_backend`). Each is a
module that satisfies :class:`Backend`; the TBE (:mod:`torchrec_ftrl.tbe`) talks to it only through
these members and never branches on a backend's name.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from ..hyperparams import FTRLHyperparams
from .capabilities import Capabilities
from .layout import TableArrays, TBEBatch

BACKENDS = ("triton", "cpp", "torch")
_warned = False



@runtime_checkable
class Backend(Protocol):
    """What a backend module provides. Tensors are on the tables' device; the tables' flat arrays
    (:class:`~.layout.TableArrays`, by the row layout: a weight buffer or derived weights, an
    element-wise or row-wise ``accum``; each state fp32 or bf16, :mod:`torchrec_ftrl.state_dtype`)
    as in :mod:`.layout`; ``hp`` the validated knobs (derived weights are ``prox(linear, accum)``
    with them, :func:`torchrec_ftrl.rule.ftrl_prox`).

    * ``fuses_bounds_check(mode, needs_psw_grad)``: True when the backend checks a raw batch itself
      for this FBGEMM ``BoundsCheckMode`` (the TBE then skips its own check and passes the counter
      ``batch.unchecked_counter``); False to get a checked batch. A fused FATAL check counts into
      the TBE's scratch counter, which the TBE reads once after the forward (and raises).
    * ``count_invalid(table_rows, feature_table, bag_feature, indices, offsets)``: number of bad
      offsets and indices (0 for a valid batch) for the FATAL check's fast path, or None when the
      backend has no such kernel.
    * ``forward(arrays, batch, out_dtype, hp)``: the pooled lookup, flat ``[batch.out_numel]``.
    * ``forward_train(arrays, batch, out_dtype, hp) -> (out, ctx)``: the forward of a training step;
      ``ctx`` is backend-owned (e.g. the linearised batch) and handed back to the two calls below.
    * ``per_sample_weight_grad(arrays, batch, ctx, grad_out, hp)``: ``[N]`` fp32 gradient of the
      per-sample weights, read before the update.
    * ``backward_update_(arrays, batch, ctx, grad_out, hp, nonfinite_rows)``: sum the gradient per
      touched row, ONE FTRL update per row in place; rows whose summed gradient holds a NaN/Inf are
      skipped and counted in ``nonfinite_rows`` (int64 ``[1]``). ``ctx`` may be None (no training
      forward ran). The math is fp32 whatever the state dtypes; a bf16 state is stored with
      ``state_dtype.round_bf16_stochastic`` by ``sr_bits(row key, column, batch.step, state)`` (row
      key ``table_row_base[t] + row``; column 0 for a row-wise ``accum``; state 0 accum, 1 linear),
      bit for bit the same on every backend for the same fp32 value; a bf16 state without
      ``batch.step`` raises ``ValueError``.

    * ``CAPABILITIES``: what the backend supports beyond the members above (:class:`Capabilities`),
      among it the row layouts its kernels implement.
    * ``repair_offsets(offsets, num_indices, counter)``, where ``CAPABILITIES.repairs_offsets``: the
      WARNING repair of raw offsets on the device, the repaired entries added to ``counter`` (the
      TBE's own check uses it, e.g. for cached batches).
    """

    CAPABILITIES: "Capabilities"

    def fuses_bounds_check(self, mode: Any, needs_psw_grad: bool) -> bool: ...

    def count_invalid(self, table_rows: torch.Tensor, feature_table: torch.Tensor,
                      bag_feature: torch.Tensor, indices: torch.Tensor,
                      offsets: torch.Tensor) -> Optional[int]: ...

    def forward(self, arrays: TableArrays, batch: TBEBatch, out_dtype: torch.dtype,
                hp: FTRLHyperparams) -> torch.Tensor: ...

    def forward_train(self, arrays: TableArrays, batch: TBEBatch, out_dtype: torch.dtype,
                      hp: FTRLHyperparams) -> tuple[torch.Tensor, Any]: ...

    def per_sample_weight_grad(self, arrays: TableArrays, batch: TBEBatch, ctx: Any,
                               grad_out: torch.Tensor, hp: FTRLHyperparams) -> torch.Tensor: ...

    def backward_update_(self, arrays: TableArrays, batch: TBEBatch, ctx: Any, grad_out: torch.Tensor,
                         hp: FTRLHyperparams, nonfinite_rows: torch.Tensor) -> None: ...


def _load(name: str) -> Backend:
    module = importlib.import_module(f".{name}_backend", __package__)
    if not isinstance(module, Backend):
        missing = [m for m in ("CAPABILITIES", "fuses_bounds_check", "count_invalid", "forward",
                               "forward_train", "per_sample_weight_grad", "backward_update_")
                   if not hasattr(module, m)]
        raise TypeError(f"backend module {module.__name__} does not implement Backend: missing {missing}")
    return module


def resolve_backend(name: str | None, device: torch.device) -> tuple[str, Backend]:
    """Return ``(name, backend)``. ``None`` picks triton on CUDA, cpp elsewhere, falling back to torch
    with a one-time warning when the CPU kernel cannot be compiled.

    Raises:
        ValueError: unknown backend name, or triton asked for a non-CUDA device.
    """
    global _warned
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {name!r}")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend='triton' needs a CUDA device (or TRITON_INTERPRET=1), "
                         f"got device={device}")
    if name is None and device.type == "cuda":
        name = "triton"
    if name is None:
        try:
            backend = _load("cpp")
            backend.load_extension()
            return "cpp", backend
        except Exception as exc:  # no compiler, no ninja, build error
            if not _warned:
                warnings.warn(f"torchrec_ftrl: compiled CPU FTRL kernel unavailable ({exc}); "
                              "using the vectorised PyTorch path", RuntimeWarning, stacklevel=3)
                _warned = True
            return "torch", _load("torch")
    backend = _load(name)
    if name == "cpp":
        backend.load_extension()
    return name, backend
