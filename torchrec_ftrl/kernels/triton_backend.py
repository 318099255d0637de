"""Triton (CUDA) backend of the FTRL TBE, registered as ``torch.library`` custom ops.

* ``torch.ops.torchrec_ftrl.triton_tbe_forward``: pooled lookup, see :mod:`.triton_forward`.
* ``torch.ops.torchrec_ftrl.triton_tbe_backward_update_``: fused backward + FTRL update in place
  (mutates weights, accum, linear, nonfinite_rows), see :mod:`.triton_backward`.

Both are ``torch.library.triton_op`` s, so ``torch.compile`` / ``torch.export`` see the Triton kernels
inside them. Neither synchronises with the host: every buffer is sized from ``indices.numel()`` and
the number of unique rows never leaves the device. Under ``TRITON_INTERPRET=1`` the same code runs on
CPU tensors (slowly), which is how CI tests it.

Module contract (:mod:`.backends`): ``forward(weights, batch, out_dtype)`` and
``backward_update_(weights, accum, linear, batch, grad_out, hp, nonfinite_rows)``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
from triton.runtime.jit import JITFunction

from ..hyperparams import FTRLHyperparams
from .layout import POOL_MEAN, POOL_NONE, TBEBatch
from .triton_backward import (boundary_update_kernel, linearize_kernel, window_config,
                              window_update_kernel)
from .triton_forward import forward_config, tbe_forward_kernel

# Launch shape knobs (elements per program step; CHUNK = sorted positions per backward window, None =
# derived from the tile). Benchmarks and tests may change them; the results do not depend on them
# beyond fp32 summation order.
TUNING = {"fwd_tile": 2048, "fwd_unroll": 4, "bwd_tile": 2048, "chunk": None, "boundary_nb": 16}

try:
    from torch.library import triton_op, wrap_triton
except ImportError:  # pragma: no cover - torch < 2.6
    triton_op = wrap_triton = None


def _k(kernel):
    """``wrap_triton(kernel)`` for compiled kernels (traceable); the plain kernel under the interpreter."""
    if wrap_triton is not None and isinstance(kernel, JITFunction):
        return wrap_triton(kernel)
    return kernel


def _block_d(max_d: int) -> int:
    return max(1, triton.next_power_of_2(int(max_d)))


def _vec_even(table_dims, block_d: int) -> tuple[int, bool]:
    """(largest power of two <= 16 dividing every D, every D == BLOCK_D); (1, False) if unknown."""
    if not table_dims:
        return 1, False
    g = 0
    for d in table_dims:
        g = math.gcd(g, int(d))
    vec = 1
    while vec < 16 and g % (vec * 2) == 0:
        vec *= 2
    return vec, all(int(d) == block_d for d in table_dims)


def _forward_impl(weights: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                  bag_feature: torch.Tensor, bag_out_offset: torch.Tensor,
                  feature_table: torch.Tensor, table_w_offset: torch.Tensor, table_dim: torch.Tensor,
                  per_sample_weights: Optional[torch.Tensor], pooling_mode: int, out_numel: int,
                  max_D: int, out_dtype: torch.dtype, vec: int, even_d: bool) -> torch.Tensor:
    out = torch.empty(out_numel, dtype=out_dtype, device=weights.device)
    num_bags = offsets.numel() - 1
    if num_bags <= 0 or out_numel == 0:
        return out.zero_()
    BLOCK_D = _block_d(max_D)
    bags, unroll, warps = forward_config(BLOCK_D, TUNING["fwd_tile"], TUNING["fwd_unroll"])
    has_psw = per_sample_weights is not None and pooling_mode != POOL_NONE
    psw = per_sample_weights if has_psw else out
    _k(tbe_forward_kernel)[(triton.cdiv(num_bags, bags),)](
        weights, out, indices, offsets, bag_feature, bag_out_offset, feature_table,
        table_w_offset, table_dim, psw, num_bags, max_D,
        POOL=pooling_mode, HAS_PSW=has_psw, BAGS=bags, UNROLL=unroll, BLOCK_D=BLOCK_D,
        VEC=vec, EVEN_D=even_d, num_warps=warps)
    return out


def _backward_impl(weights: torch.Tensor, accum: torch.Tensor, linear: torch.Tensor,
                   nonfinite_rows: torch.Tensor, grad: torch.Tensor, indices: torch.Tensor,
                   offsets: torch.Tensor, bag_feature: torch.Tensor, bag_out_offset: torch.Tensor,
                   feature_table: torch.Tensor, table_w_offset: torch.Tensor,
                   table_dim: torch.Tensor, table_rows: torch.Tensor,
                   per_sample_weights: Optional[torch.Tensor], pooling_mode: int, max_D: int,
                   total_rows: int, vec: int, even_d: bool, lr: float, neg_p: float, l1: float, l2_eff: float, beta: float,
                   shrink2: float) -> None:
    N = indices.numel()
    num_bags = offsets.numel() - 1
    if N == 0 or num_bags <= 0:
        return
    dev = weights.device
    BLOCK_D = _block_d(max_D)
    row_base = torch.cumsum(table_rows, 0) - table_rows
    key_dtype = torch.int32 if 0 <= total_rows < 2 ** 31 - 1 else torch.int64
    key = torch.empty(N, dtype=key_dtype, device=dev)
    gofs = torch.empty(N, dtype=torch.int64, device=dev)
    tid = torch.empty(N, dtype=torch.int32, device=dev)
    has_psw = per_sample_weights is not None and pooling_mode != POOL_NONE
    has_scale = has_psw or pooling_mode == POOL_MEAN
    scale = torch.empty(N if has_scale else 1, dtype=torch.float32, device=dev)
    psw = per_sample_weights if has_psw else scale
    bags, unroll = 64, 4
    _k(linearize_kernel)[(triton.cdiv(num_bags, bags),)](
        indices, offsets, bag_feature, bag_out_offset, feature_table, row_base, psw,
        key, gofs, scale, tid, num_bags, max_D,
        POOL=pooling_mode, HAS_PSW=has_psw, HAS_SCALE=has_scale, BAGS=bags, UNROLL=unroll,
        num_warps=4)

    sorted_key, perm = torch.sort(key, stable=True)

    chunk, warps = window_config(BLOCK_D, TUNING["bwd_tile"], TUNING["chunk"])
    nwin = triton.cdiv(N, chunk)
    part = torch.empty(2 * nwin * BLOCK_D, dtype=torch.float32, device=dev)
    pow_half = neg_p == 0.5
    has_shrink = shrink2 != 0.0
    libdev = isinstance(window_update_kernel, JITFunction)
    _k(window_update_kernel)[(nwin,)](
        sorted_key, perm, gofs, scale, tid, grad, weights, linear, accum,
        table_w_offset, table_dim, row_base, part, nonfinite_rows,
        N, lr, l1, l2_eff, beta, shrink2, neg_p,
        HAS_SCALE=has_scale, POW_HALF=pow_half, HAS_SHRINK=has_shrink, LIBDEVICE_POW=libdev,
        CHUNK=chunk, BLOCK_D=BLOCK_D, VEC=vec, EVEN_D=even_d, num_warps=warps)
    if nwin > 1:
        nb = TUNING["boundary_nb"]
        _k(boundary_update_kernel)[(nwin - 1,)](
            sorted_key, perm, tid, part, weights, linear, accum,
            table_w_offset, table_dim, row_base, nonfinite_rows,
            N, lr, l1, l2_eff, beta, shrink2, neg_p,
            POW_HALF=pow_half, HAS_SHRINK=has_shrink, LIBDEVICE_POW=libdev, CHUNK=chunk, NB=nb, BLOCK_D=BLOCK_D, VEC=vec, EVEN_D=even_d,
            num_warps=max(1, min(8, nb * BLOCK_D // 512)))


if triton_op is not None:
    _forward_op = triton_op("torchrec_ftrl::triton_tbe_forward", _forward_impl, mutates_args=())
    _backward_op = triton_op("torchrec_ftrl::triton_tbe_backward_update_", _backward_impl,
                             mutates_args=("weights", "accum", "linear", "nonfinite_rows"))
else:  # pragma: no cover
    _forward_op, _backward_op = _forward_impl, _backward_impl


def forward(weights: torch.Tensor, batch: TBEBatch, out_dtype: torch.dtype) -> torch.Tensor:
    """Pooled lookup. Returns the flat output ``[batch.out_numel]`` in ``out_dtype`` (fp32 accumulation)."""
    return _forward_op(weights, batch.indices, batch.offsets, batch.bag_feature,
                       batch.bag_out_offset, batch.feature_table, batch.table_w_offset,
                       batch.table_dim, batch.per_sample_weights, int(batch.pooling_mode),
                       int(batch.out_numel), int(batch.max_D), out_dtype,
                       *_vec_even(getattr(batch, "table_dims", None), _block_d(batch.max_D)))


def backward_update_(weights: torch.Tensor, accum: torch.Tensor, linear: torch.Tensor,
                     batch: TBEBatch, grad_out: torch.Tensor, hp: FTRLHyperparams,
                     nonfinite_rows: torch.Tensor) -> None:
    """Sum gradients per unique (table, row), then one FTRL update per touched row, in place.

    ``grad_out`` is the flat ``[batch.out_numel]`` output gradient (fp32/fp16/bf16). Rows whose summed
    gradient has NaN/Inf are skipped and counted in ``nonfinite_rows`` (int64 ``[1]``, device).
    """
    total_rows = getattr(batch, "total_rows", None)
    _backward_op(weights, accum, linear, nonfinite_rows, grad_out.reshape(-1).contiguous(),
                 batch.indices, batch.offsets, batch.bag_feature, batch.bag_out_offset,
                 batch.feature_table, batch.table_w_offset, batch.table_dim, batch.table_rows,
                 batch.per_sample_weights, int(batch.pooling_mode), int(batch.max_D),
                 -1 if total_rows is None else int(total_rows),
                 *_vec_even(getattr(batch, "table_dims", None), _block_d(batch.max_D)),
                 hp.learning_rate, -hp.learning_rate_power, hp.l1_reg, hp.l2_effective, hp.beta,
                 2.0 * hp.l2_shrinkage)
