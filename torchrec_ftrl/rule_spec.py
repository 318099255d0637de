"""The FTRL-Proximal rule, its knob scalars and the stochastic-rounding hash, stated once for the kernels.

:mod:`torchrec_ftrl.kernels.codegen` (``python -m torchrec_ftrl.kernels.codegen --write``) turns
this module into the inline functions of the compiled CPU kernel (``kernels/cpu/csrc/ftrl_rule_gen.h``,
included by ``ftrl_tbe_cpu.cpp``) and the ``@triton.jit`` functions of the Triton kernels
(``kernels/cuda/rule_gen.py``). The header is committed (``tests/test_codegen.py`` fails when it differs
from what this module generates); the Triton module is a build product, written at install and at
import (:func:`torchrec_ftrl.kernels.codegen.ensure_triton_module`). Imports nothing, so any layer may read it.

The statement (``docs/ftrl.md``; McMahan et al. 2013, "Ad Click Prediction: a View from the Trenches",
Algorithm 1, with TensorFlow ``ApplyFtrlV2``'s l2 shrinkage and Keras' beta; the row-wise accumulator
as FBGEMM's EXACT_ROWWISE_ADAGRAD keeps its ``momentum1``; the hash is lowbias32 by C. Wellons, public
domain):

* :data:`KNOBS`: the fp32 scalars every kernel computes with, each named once, with its meaning and
  how it follows from :class:`~torchrec_ftrl.hyperparams.FTRLHyperparams`. The generator makes the
  C++ ``FtrlHp`` struct (the layout of the ops' knob tensor, :mod:`torchrec_ftrl.kernels.knobs`) from it;
  :meth:`FTRLHyperparams.kernel_scalars` reads it.
* :data:`CONSTANTS`: the hash's uint32 constants (also read by :mod:`torchrec_ftrl.state_dtype`).
* :data:`SHARED`, :data:`IEEE` and :data:`FAST`: functions, each a list of statements in a tiny
  expression form (below). The C++ kernel is generated from ``SHARED + IEEE``, the Triton kernels from
  ``SHARED + FAST``. Two forms because the backends compute the rule differently today and each must
  keep its bits: ``IEEE`` is the rule as ``docs/ftrl.md`` writes it, every division IEEE (the form of
  the torch oracle); ``FAST`` is the same value in exact arithmetic, rearranged for the GPU (one
  hardware division per element, sigma without the cancellation of ``sqrt(n_new) - sqrt(n)``, ``q``'s
  L2 term by one explicit fused multiply-add so that every kernel rounds it alike). The hash, the
  stochastic rounding and ``n^(-p)`` are ``SHARED``: one statement for both backends.

The torch form, :mod:`torchrec_ftrl.rule` and :mod:`torchrec_ftrl.state_dtype`, stays hand-written on
purpose: it is the independent transcription (fp32 and float64) that the tests compare the generated
kernels with, bit for bit where the forms agree, so a mistake in this module or in the generator fails
a test instead of reaching every backend at once.

**The expression form.** A function is a :class:`Fn`: its parameters (``"x: u32"``; no type is
``f32``; ``&z`` is an in-out parameter, C++ only; a ``const`` type is a compile-time constant: a
``tl.constexpr`` in Triton), its compile-time ``flags`` (``if FLAG:`` in the body: ``if constexpr``
in C++, a ``tl.constexpr`` branch in Triton) and a body of Python-syntax statements: ``name = expr``
(``name: type = expr`` for a non-fp32 local), ``if FLAG:`` / ``else:`` and ``return``. Expressions
use ``+ - * /`` (``/`` is C++'s IEEE division and Triton's ``/``), the bit operators, comparisons,
the knobs, the constants, calls of functions defined before, and these intrinsics: ``sqrt``, ``pow``
(Triton: libdevice, or exp2/log2 under the interpreter: the ``LIBDEVICE_POW`` flag), ``abs``,
``copysign``, ``where(c, a, b)``, ``fma(a, b, c)`` (one rounding), ``div_rn`` (IEEE division),
``fdiv`` (the GPU's approximate division; Triton only), ``u32`` / ``i64`` (integer casts),
``f32_bits`` (the bit pattern), ``bf16_from_bits`` (bf16 from its 16 bits), ``row_sum(x, m)`` and
``per_row(x)`` (a row block's masked sum over its columns, and ``x[:, None]``; Triton only). Operands
are evaluated in the written order and never reassociated; each backend keeps every operation as
written (no contraction into an FMA: the C++ build has ``-ffp-contract=off``).

**Adding a knob** ``ftrl_foo``: validate it in :mod:`torchrec_ftrl.hyperparams` (``FTRL_KWARGS`` and
``__post_init__``), add ``Knob("foo", ..., lambda hp: hp.foo)`` to :data:`KNOBS` and use ``foo`` in the
statements here; run ``python -m torchrec_ftrl.kernels.codegen --write`` (and rebuild the CPU kernel).
``kernel_scalars``, the C++ struct and the Triton kernels follow: the ops take the knobs as one fp32
tensor (:func:`torchrec_ftrl.kernels.knobs.knob_tensor`), which the C++ kernel reads into its struct and the Triton
kernels into one tuple by the
generated ``ftrl_knobs`` and passed whole to the generated functions, which name only the knobs they
use.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple


class Knob(NamedTuple):
    """One fp32 scalar of the kernels: its name in every backend, its meaning, and its value for an
    ``FTRLHyperparams`` (``of_hparams(hp) -> float``)."""

    name: str
    meaning: str
    of_hparams: Callable[[Any], float]


KNOBS = (
    Knob("lr", "alpha > 0, the learning rate", lambda hp: hp.learning_rate),
    Knob("neg_power", "-p >= 0 (the pow path only)", lambda hp: -hp.learning_rate_power),
    Knob("l1", "lambda1", lambda hp: hp.l1_reg),
    Knob("l2", "the L2 term of q: 2 lambda2 (tensorflow) or lambda2 (mcmahan)", lambda hp: hp.l2_effective),
    Knob("beta", "beta", lambda hp: hp.beta),
    Knob("shrink2", "2 s, the l2 shrinkage factor of w in g_s", lambda hp: 2.0 * hp.l2_shrinkage),
)

# uint32 constants of the (row key, column, step, state) hash: lowbias32's multipliers and the golden
# ratio of the seed and of the Weyl sequence over a row's columns (torchrec_ftrl.state_dtype.sr_bits).
CONSTANTS = {
    "HASH_MUL1": 0x7FEB352D,
    "HASH_MUL2": 0x846CA68B,
    "HASH_GOLDEN": 0x9E3779B9,
}


class Fn(NamedTuple):
    """One function of the rule (the expression form: the module docstring)."""

    name: str
    params: str
    returns: str
    body: str
    doc: str
    flags: tuple = ()


SHARED = (
    Fn("ftrl_power", "n", "f32", flags=("POW_HALF",), doc="""
fp32 n^(-p) of an accum value n >= 0: sqrt for p = -0.5 (POW_HALF), pow(n, -p) otherwise.""", body="""
if POW_HALF:
    return sqrt(n)
else:
    return pow(n, neg_power)
"""),
    Fn("lowbias32", "x: u32", "u32", doc="""
lowbias32 (C. Wellons) of a uint32: wrapping multiplies, logical shifts.""", body="""
x = x ^ (x >> 16)
x = x * HASH_MUL1
x = x ^ (x >> 15)
x = x * HASH_MUL2
x = x ^ (x >> 16)
return x
"""),
    Fn("sr_seed", "step: u64, state: const u32", "u32", doc="""
The hash of (optimizer step mod 2^32, state: 0 accum, 1 linear), the seed of sr_row.""", body="""
return lowbias32(u32(step) * HASH_GOLDEN + u32(state))
"""),
    Fn("sr_row", "seed: u32, row_key: u64", "u32", doc="""
The hash of a row: sr_seed's seed mixed with both halves of the row key (global row id >= 0).""", body="""
k: i64 = i64(row_key)
return lowbias32(seed ^ u32(k) ^ u32(k >> 32))
"""),
    Fn("sr_top_bits", "h: u32", "u32", doc="""
The 16 random bits of a hash: its top half (column 0's bits of a row hash).""", body="""
return h >> 16
"""),
    Fn("sr_bits", "row_hash: u32, col: u32", "u32", doc="""
The 16 random bits of column col of a row: the row hash stepped by the golden ratio per column (a
Weyl sequence), so the row's columns round with stratified bits.""", body="""
return sr_top_bits(row_hash + u32(col) * HASH_GOLDEN)
"""),
    Fn("round_bf16_sr", "x, bits: u32", "u16", doc="""
fp32 x to bf16 (its 16 bits) stochastically rounded by the random bits (< 2^16): add them to the bit
pattern and truncate, so x rounds away from zero with probability dropped / 2^16 (unbiased). An Inf
plus bits truncates back to itself; a NaN gets its quiet bit, then truncates (stays a NaN).""", body="""
u: u32 = f32_bits(x)
nan: bool = (u & 0x7FFFFFFF) > 0x7F800000
r: u32 = where(nan, u | 0x00400000, u + bits)
return bf16_from_bits(r >> 16)
"""),
)

IEEE = (
    Fn("ftrl_prox", "z, pn", "f32", doc="""
THE weight of a state: prox(z, n) = (l1 sign(z) - z) / q if |z| > l1 else exactly 0.0, with
q = (beta + n^(-p)) / lr + L2, given pn = ftrl_power(n). The stored layout's update writes it as the
new weight; a derived layout computes it on every read, so both see the same bits. The zero is a
select, never a clamp (|z| <= l1 gives 0.0 whatever the candidate, NaN/Inf if q == 0).""", body="""
q = (beta + pn) / lr + l2
cand = (copysign(l1, z) - z) / q
return where(abs(z) > l1, cand, 0.0)
"""),
    Fn("ftrl_step", "w, g, &z, pn_old, pn_new", "f32", flags=("DERIVED",), doc="""
The z and w steps of one element whose accum goes from n to n_new (pn_old = n^(-p), pn_new =
n_new^(-p): per element, or the row's with a row-wise accum). w is the OLD weight (DERIVED: none is
stored; it is prox of the old state). Updates z in place; returns the new weight.""", body="""
if DERIVED:
    w = ftrl_prox(z, pn_old)
sigma = (pn_new - pn_old) / lr
g_s = g + shrink2 * w
z = z + g_s - sigma * w
return ftrl_prox(z, pn_new)
"""),
    Fn("ftrl_element", "w, g, &z, &n", "f32", flags=("POW_HALF", "DERIVED"), doc="""
THE FTRL-Proximal update of one element with an element-wise accum (torchrec_ftrl/rule.py's
ftrl_rule): g is the gradient summed over the row's duplicates; accum uses the raw gradient. Updates
z (linear) and n (accum) in place; returns the new weight.""", body="""
n_new = n + g * g
pn_new = ftrl_power(n_new)
pn_old = ftrl_power(n)
n = n_new
return ftrl_step(w, g, z, pn_old, pn_new)
"""),
    Fn("ftrl_row_accum", "n, sum_g2, dim", "f32", doc="""
The new row-wise accum of a row of dim elements whose squared gradients sum to sum_g2:
n + mean_d(g_d^2) (torchrec_ftrl/rule.py's ftrl_rule_rowwise).""", body="""
return n + sum_g2 / dim
"""),
)

FAST = (
    Fn("ftrl_prox", "z, pn", "f32", doc="""
fp32 weight prox(z, n) of z given pn = n^(-p) (broadcastable against z, e.g. [R, 1] for a row-wise
accum): (l1 sign(z) - z) lr / (beta + pn + L2 lr) where |z| > l1, else exactly 0.0 (a branch, never
0/0); one hardware division; beta + pn + L2 lr == 0 with |z| > l1 gives +-inf, like the division by
q == 0 of the rule. The L2 term is one explicit fused multiply-add: a separate product would be
contracted into the add where the compiler sees both in one basic block and rounded twice where it
hoisted the (loop-invariant) product, so two kernels would round q differently.""", body="""
bp = beta + pn
qd = fma(l2, lr, bp)
keep = abs(z) > l1
sgn = where(z > 0, 1.0, -1.0)
num = (l1 * sgn - z) * lr
return where(keep, where(qd > 0, fdiv(num, where(qd > 0, qd, 1.0)), num * INF), 0.0)
"""),
    Fn("ftrl_row_rate", "pn", "f32", doc="""
fp32 lr / q of rows with one pn = n^(-p) each (a row-wise accum; any shape), q = beta + pn + L2 lr by
the fused multiply-add of ftrl_prox, divided once per row (IEEE), so every element of the row takes
one multiply (ftrl_prox_rowwise). q == 0 gives +inf.""", body="""
qd = fma(l2, lr, beta + pn)
return div_rn(lr, qd)
"""),
    Fn("ftrl_prox_rowwise", "z, rate", "f32", doc="""
fp32 weight prox(z, n) of z whose row's rate = lr / q (ftrl_row_rate, broadcastable against z) is
shared: (l1 sign(z) - z) rate where |z| > l1, else exactly 0.0; rate +inf (q == 0) gives +-inf. The
forward and the update of a row-wise accum both read and store weights with it.""", body="""
keep = abs(z) > l1
sgn = where(z > 0, 1.0, -1.0)
return where(keep, (l1 * sgn - z) * rate, 0.0)
"""),
    Fn("ftrl_update", "w, n, z, g, m, dimf", "(f32, f32, f32)",
       flags=("POW_HALF", "HAS_SHRINK", "DERIVED", "ROWWISE"), doc="""
One FTRL step of a block of rows [R, BLOCK_D] (columns m): returns (w_new, n_new, z_new) in fp32 from
the OLD w, n, z and the summed gradient g. DERIVED: w is not stored; the old weight is prox of the old
state. ROWWISE: n is [R], one per row, and grows by the mean of g^2 over the row's dimf columns; every
element of the row shares its sigma and q. With p = -0.5, sigma = g^2 / (sqrt(n_new) + sqrt(n)) / lr:
the value of (sqrt(n_new) - sqrt(n)) / lr without its cancellation (exact to a few ulp for a row with
a large accum and a small gradient), by the hardware sqrt and division (<= 2 ulp each: the IEEE
sequences make the update kernel instruction-bound).""", body="""
g2 = g * g
if ROWWISE:
    g2 = div_rn(row_sum(g2, m), dimf)
n_new = n + g2
inv_lr = 1.0 / lr
pn_new = ftrl_power(n_new)
pn = ftrl_power(n)
if POW_HALF:
    den = pn_new + pn
    sigma = where(den > 0, fdiv(g2, where(den > 0, den, 1.0)), 0.0) * inv_lr
else:
    sigma = (pn_new - pn) * inv_lr
if ROWWISE:
    sigma = per_row(sigma)
    if DERIVED:
        w = ftrl_prox_rowwise(z, per_row(ftrl_row_rate(pn)))
elif DERIVED:
    w = ftrl_prox(z, pn)
if HAS_SHRINK:
    gs = g + shrink2 * w
else:
    gs = g
z_new = (z + gs) - sigma * w
if ROWWISE:
    w_new = ftrl_prox_rowwise(z_new, per_row(ftrl_row_rate(pn_new)))
else:
    w_new = ftrl_prox(z_new, pn_new)
return w_new, n_new, z_new
"""),
)
