"""The PyTorch implementation of the registered ops ``torch.ops.torchrec_ftrl.*``
(:mod:`torchrec_ftrl.kernels.ops`): their ``CompositeExplicitAutograd`` kernels, which run on every device
without a kernel of its own, and the backend ``"torch"`` (:data:`OPS`, which calls them directly on every
device; :data:`CAPABILITIES`).

The dispatcher prefers a kernel registered for the tensors' own device key (the compiled CPU kernels of
:mod:`torchrec_ftrl.kernels.cpu.backend` once loaded: forward, backward update and count; the Triton
kernels of :mod:`torchrec_ftrl.kernels.cuda.impls` on CUDA: all but the count) and the Meta (fake)
implementations of :mod:`torchrec_ftrl.kernels.ops` under fake tensors, so these run where neither exists:
every op on a CPU without the compiled kernel, ``tbe_repair_offsets`` (and ``tbe_linearize``, which raises
here) on every CPU, and ``tbe_count_invalid`` on CUDA. ``CompositeExplicitAutograd`` rather than
``CompositeImplicitAutograd`` because the ops keep their fake implementations and mutate their inputs: an
implicit composite would be traced through (its data-dependent ``torch.unique`` and host reads break fake
tensors), and ``torch.library.register_fake`` refuses an op that has one.

Each implementation rebuilds the arrays (:class:`~torchrec_ftrl.kernels.batch.TableArrays`) and the batch
(:class:`~torchrec_ftrl.kernels.batch.TBEBatch`) from the op's arguments and runs :mod:`.rows`'s
vectorised code on them with the knobs' hyper-parameters: :data:`OPS` is handed them by the TBE's calls
(no tensor is read back, so ``backend="torch"`` traces under ``torch.compile``), a registered kernel reads
them from the knob tensor (:func:`torchrec_ftrl.kernels.knobs.hyperparams_of`, a host read). It takes no
fused check, linearised batch or cache (``tbe_linearize`` raises; :data:`CAPABILITIES`).
"""

from __future__ import annotations

import torch

from ...hyperparams import FTRLHyperparams
from ...row_layout import KERNEL_LAYOUTS
from . import rows
from .. import arg_checks
from ..capabilities import Capabilities, OpTable
from .index_rows import count_invalid, repair_offsets
from ..knobs import hyperparams_of
from ..batch import TableArrays, TBEBatch
from ..ops import N_BATCH, NAMESPACE

DISPATCH_KEY = "CompositeExplicitAutograd"
CAPABILITIES = Capabilities(layouts=KERNEL_LAYOUTS)


def batch_of(args: tuple, out_numel: int, step=None) -> TBEBatch:
    """The :class:`~torchrec_ftrl.kernels.batch.TBEBatch` of an op's batch arguments
    (:data:`torchrec_ftrl.kernels.ops.N_BATCH` of them, in the schema's order)."""
    (table_w_offset, table_dim, table_rows, table_row_base, feature_table, bag_feature, bag_out_offset,
     indices, offsets, per_sample_weights, pooling_mode, max_D, table_dims, total_rows) = args
    return TBEBatch(
        table_w_offset=table_w_offset, table_dim=table_dim, table_rows=table_rows,
        feature_table=feature_table, bag_feature=bag_feature, bag_out_offset=bag_out_offset,
        indices=indices, offsets=offsets, per_sample_weights=per_sample_weights,
        pooling_mode=int(pooling_mode), out_numel=int(out_numel), max_D=int(max_D),
        total_rows=int(total_rows), table_dims=tuple(table_dims), table_row_base=table_row_base,
        step=step)


def _refuse(op: str, check: bool = False, **optional) -> None:
    """Raise ``RuntimeError`` for the arguments of the schema this implementation does not take."""
    given = [name for name, value in optional.items() if value is not None] + (["check"] if check else [])
    if given:
        raise RuntimeError(f"torchrec_ftrl::{op}: the PyTorch implementation does not take {given} "
                           "(the fused bounds check, the linearised batch and the HBM cache are the "
                           "Triton kernels')")


def _forward(hp: FTRLHyperparams, *args):
    """``tbe_forward`` with the knobs' hyper-parameters ``hp`` (:data:`OPS`): the arguments checked
    (:func:`..arg_checks.check_forward`), then :func:`_forward_checked`."""
    arg_checks.check_forward(args)
    return _forward_checked(hp, *args)


def _forward_checked(hp: FTRLHyperparams, weights, accum, linear, rowwise, *rest):
    batch_args, (_, _, _, out_numel, out_dtype, _, check, row_keys, *cache) = rest[:N_BATCH], rest[N_BATCH:]
    _refuse("tbe_forward", check, row_keys=row_keys, cache_locations=cache[0],
            cache_weights=cache[1], cache_accum=cache[2], cache_linear=cache[3])
    return rows.forward(TableArrays(weights, accum, linear, rowwise),
                                 batch_of(batch_args, out_numel), out_dtype, hp)


def _backward_update_(hp: FTRLHyperparams, *args):
    """``tbe_backward_update_`` with the knobs' hyper-parameters ``hp`` (:data:`OPS`): the arguments
    checked (:func:`..arg_checks.check_backward`), then :func:`_backward_update_checked`."""
    arg_checks.check_backward(args)
    _backward_update_checked(hp, *args)


def _backward_update_checked(hp: FTRLHyperparams, weights, accum, linear, rowwise, *rest):
    batch_args, (grad_out, _, _, _, nonfinite_rows, step, check, *lin_cache) = (rest[:N_BATCH],
                                                                                rest[N_BATCH:])
    names = ("lin_key", "lin_gofs", "lin_scale", "lin_tid", "cache_locations", "cache_weights",
             "cache_accum", "cache_linear")
    _refuse("tbe_backward_update_", check, **dict(zip(names, lin_cache)))
    rows.backward_update_(TableArrays(weights, accum, linear, rowwise),
                                   batch_of(batch_args, grad_out.numel(), step), grad_out, hp,
                                   nonfinite_rows)


def _knobs_of(args: tuple) -> FTRLHyperparams:
    """The hyper-parameters of the ``(knobs, pow_half, has_shrink)`` arguments after the batch."""
    return hyperparams_of(*args[4 + N_BATCH:4 + N_BATCH + 3])


def tbe_forward(*args):
    """``tbe_forward`` (:mod:`torchrec_ftrl.kernels.ops`)."""
    arg_checks.check_forward(args)
    return _forward_checked(_knobs_of(args), *args)


def tbe_linearize(*args):
    """``tbe_linearize`` (:mod:`torchrec_ftrl.kernels.ops`): not implemented here (``Capabilities.linearizes``
    False)."""
    raise RuntimeError("torchrec_ftrl::tbe_linearize: the PyTorch implementation keeps no linearised "
                       "batch (the Triton kernels' tbe_linearize runs on CUDA devices)")


def tbe_backward_update_(*args):
    """``tbe_backward_update_`` (:mod:`torchrec_ftrl.kernels.ops`)."""
    arg_checks.check_backward(args)
    hp = hyperparams_of(*args[4 + N_BATCH + 1:4 + N_BATCH + 4])   # after grad_out
    _backward_update_checked(hp, *args)


def tbe_count_invalid(table_rows, feature_table, bag_feature, indices, offsets):
    """``tbe_count_invalid`` (:mod:`torchrec_ftrl.kernels.ops`): int64 ``[1]``, by
    :func:`.index_rows.count_invalid` (0 for a valid batch, like the compiled kernel; a malformed batch
    may count differently, never 0); empty ``offsets`` count as one problem.

    Raises:
        RuntimeError, ValueError: arguments that break the ops' contract (:mod:`..arg_checks`).
    """
    arg_checks.check_count_invalid(table_rows, feature_table, bag_feature, indices, offsets)
    if offsets.numel() == 0:
        return torch.ones(1, dtype=torch.int64, device=indices.device)
    return count_invalid(table_rows, feature_table, bag_feature, indices, offsets).reshape(1)


def tbe_repair_offsets(offsets, warn, num_indices):
    """``tbe_repair_offsets`` (:mod:`torchrec_ftrl.kernels.ops`), by :func:`.index_rows.repair_offsets`; empty
    ``offsets`` give an empty result."""
    arg_checks.check_repair_offsets(offsets, warn, num_indices)
    if offsets.numel() == 0:
        return torch.empty_like(offsets)
    fixed = repair_offsets(offsets, int(num_indices))
    warn += (fixed != offsets).sum()
    return fixed


OPS = OpTable(forward=_forward, linearize=tbe_linearize, backward_update_=_backward_update_,
              count_invalid=tbe_count_invalid, repair_offsets=tbe_repair_offsets)
for _impl in (tbe_forward, tbe_linearize, tbe_backward_update_, tbe_count_invalid, tbe_repair_offsets):
    torch.library.impl(f"{NAMESPACE}::{_impl.__name__}", DISPATCH_KEY, _impl)
