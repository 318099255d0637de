"""The FTRL weight as a function of the state, ``w = prox(z, n)``, as Triton functions.

One statement for every Triton kernel that computes a weight: the update
(:func:`.triton_backward.ftrl_update_store`) computes the new stored weight with it, and the
forward (:func:`.triton_forward.tbe_forward_kernel`) and the update compute a derived weight (the
row layout without a weight buffer, :mod:`torchrec_ftrl.row_layout`) with it. Being the same code
after inlining, a derived weight has the bits of the weight a stored table holds for the same fp32
``(z, n)`` and knobs.

The arithmetic is rearranged for speed, with the value of :func:`torchrec_ftrl.rule.ftrl_prox` in
exact arithmetic (``docs/ftrl.md``; McMahan et al. 2013, Algorithm 1)::

    w = (l1 sign(z) - z) lr / (beta + n^(-p) + L2 lr)   if |z| > l1,   else 0

one hardware division (<= 2 ulp) per element, ``n^(-p)`` by the hardware square root for
``p = -0.5``, ``pow`` otherwise, and ``beta + n^(-p) + L2 lr`` with one fused multiply-add
(``tl.fma``), so that every kernel rounds it alike whatever the compiler contracts. A row-wise
accum shares ``q`` over the row: :func:`ftrl_row_rate` divides once per row and
:func:`ftrl_prox_rowwise` multiplies per element.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _pow(x, e, LIBDEVICE_POW: tl.constexpr):
    # x >= 0, e = -p >= 0. libdevice pow when compiled; exp2/log2 under the interpreter (no libdevice).
    if LIBDEVICE_POW:
        return libdevice.pow(x, e)
    else:
        safe = tl.where(x > 0, x, 1.0)
        r = tl.exp2(e * tl.log2(safe))
        return tl.where(x > 0, r, tl.where(e > 0, 0.0, 1.0))


@triton.jit
def ftrl_power(n, neg_p, POW_HALF: tl.constexpr, LIBDEVICE_POW: tl.constexpr):
    """fp32 ``n^(-p)`` of ``n >= 0`` (any shape; ``neg_p = -p >= 0``): ``tl.sqrt`` with ``POW_HALF``
    (p = -0.5), else ``pow`` (libdevice's when ``LIBDEVICE_POW``, exp2/log2 under the interpreter)."""
    if POW_HALF:
        return tl.sqrt(n)
    else:
        return _pow(n, neg_p, LIBDEVICE_POW)


@triton.jit
def ftrl_prox(z, pn, lr, l1, l2_eff, beta):
    """fp32 weight ``prox(z, n)`` of ``z`` (linear) given ``pn = n^(-p)`` (:func:`ftrl_power`;
    broadcastable against ``z``, e.g. ``[R, 1]`` for a row-wise accum), the knobs as fp32 scalars
    (``l2_eff`` the L2 term of the convention). ``|z| <= l1`` gives exactly 0.0 (a branch, never
    ``0/0``); ``beta + pn + L2 lr == 0`` with ``|z| > l1`` gives +-inf, like the division by
    ``q == 0`` of the rule."""
    # The L2 term by one explicit fused multiply-add: a separate product would be contracted into
    # the add where the compiler sees both in one basic block and rounded twice where it hoisted the
    # (loop-invariant) product, so two kernels would round q differently.
    bp = beta + pn
    qd = tl.fma(tl.broadcast_to(l2_eff, bp.shape), tl.broadcast_to(lr, bp.shape), bp)
    keep = tl.abs(z) > l1
    sgn = tl.where(z > 0, 1.0, -1.0)
    num = (l1 * sgn - z) * lr
    return tl.where(keep, tl.where(qd > 0, tl.fdiv(num, tl.where(qd > 0, qd, 1.0)), num * float("inf")),
                    0.0)


@triton.jit
def ftrl_row_rate(pn, lr, l2_eff, beta):
    """fp32 ``lr / q`` of rows with one ``pn = n^(-p)`` each (a row-wise accum; any shape), ``q = beta
    + pn + L2 lr`` by the fused multiply-add of :func:`ftrl_prox`, divided once per row (IEEE): so
    every element of the row takes one multiply, :func:`ftrl_prox_rowwise`. ``q == 0`` gives +inf."""
    qd = tl.fma(tl.broadcast_to(l2_eff, pn.shape), tl.broadcast_to(lr, pn.shape), beta + pn)
    return tl.div_rn(tl.broadcast_to(lr, pn.shape), qd)


@triton.jit
def ftrl_prox_rowwise(z, rate, l1):
    """fp32 weight ``prox(z, n)`` of ``z`` whose row's ``rate = lr / q`` (:func:`ftrl_row_rate`,
    broadcastable against ``z``) is shared: ``(l1 sign(z) - z) rate`` where ``|z| > l1``, else exactly
    0.0; ``rate`` +inf (q == 0) gives +-inf. The forward and the update of a row-wise accum both read
    and store weights with it, so a derived row-wise table reads the bits a stored one holds."""
    keep = tl.abs(z) > l1
    sgn = tl.where(z > 0, 1.0, -1.0)
    return tl.where(keep, (l1 * sgn - z) * rate, 0.0)