"""``x^e`` in Triton kernels: the lowering of the rule spec's ``pow`` (:mod:`torchrec_ftrl.rule_spec`) that
:mod:`.rule_gen` calls, libdevice's when compiled, exp2/log2 under ``TRITON_INTERPRET=1``
(which has no libdevice)."""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def pow_(x, e, LIBDEVICE_POW: tl.constexpr):
    """fp32 ``x^e`` of ``x >= 0``, ``e >= 0`` (``0^0 = 1``): ``libdevice.pow`` with ``LIBDEVICE_POW``,
    else ``exp2(e log2 x)`` with ``x = 0`` by a branch."""
    if LIBDEVICE_POW:
        return libdevice.pow(x, e)
    else:
        safe = tl.where(x > 0, x, 1.0)
        r = tl.exp2(e * tl.log2(safe))
        return tl.where(x > 0, r, tl.where(e > 0, 0.0, 1.0))
