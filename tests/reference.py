"""Float64 reference of FTRL-Proximal, transcribed line by line from ``docs/ftrl.md``.

This module is the single source of expected values in the tests. It is deliberately plain NumPy in
float64, element-wise, with the exact-zero branch written as a branch, and never calls the code it checks.

Per touched element (w weight, z = linear, n = accum, g summed gradient, alpha learning rate,
p learning-rate power, s l2 shrinkage, L2 = 2*l2 (tensorflow) or l2 (mcmahan))::

    n_new = n + g^2
    sigma = (n_new^(-p) - n^(-p)) / alpha
    g_s   = g + 2*s*w
    z     = z + g_s - sigma*w
    q     = (beta + n_new^(-p)) / alpha + L2
    w     = (l1*sign(z) - z) / q   if |z| > l1   else 0
    n     = n_new

The weight as a function of the state (derived weights): ``w = prox(z, n)``, the last two lines with
``n`` in place of ``n_new``. The row-wise accumulator (one ``n`` per row of D elements)::

    n_new = n + (1/D) * sum_d g_d^2
    sigma = (n_new^(-p) - n^(-p)) / alpha
    z_d   = z_d + g_d + 2*s*w_d - sigma*w_d
    w_d   = prox(z_d, n_new)
"""

from __future__ import annotations

import math

import numpy as np


def ftrl_reference_step(w, z, n, g, *, lr, lr_power=-0.5, l1=0.0, l2=0.0, beta=0.0,
                        l2_shrinkage=0.0, l2_convention="tensorflow"):
    """One FTRL step on every element of ``w`` (any shape, array-like). Returns float64 ``(w, z, n)``.

    ``w`` weight, ``z`` linear, ``n`` accum and ``g`` the (already duplicate-summed) gradient all share
    one shape; the outputs are new float64 arrays of that shape, the inputs are not modified.
    ``l2_convention`` is ``"tensorflow"`` (L2 = 2*l2) or ``"mcmahan"`` (L2 = l2).
    """
    if l2_convention not in ("tensorflow", "mcmahan"):
        raise ValueError(f"l2_convention must be 'tensorflow' or 'mcmahan', got {l2_convention!r}")
    shape = np.shape(w)
    w = np.array(w, dtype=np.float64).ravel()
    z = np.array(z, dtype=np.float64).ravel()
    n = np.array(n, dtype=np.float64).ravel()
    g = np.array(g, dtype=np.float64).ravel()
    if not (w.size == z.size == n.size == g.size):
        raise ValueError(f"w, z, n, g must have one shape, got sizes {w.size}, {z.size}, {n.size}, {g.size}")
    L2 = 2.0 * l2 if l2_convention == "tensorflow" else l2
    w_out = np.empty_like(w)
    for i in range(w.size):
        wi, zi, ni, gi = float(w[i]), float(z[i]), float(n[i]), float(g[i])
        n_new = ni + gi * gi                          # raw g, never the shrunk one
        pn_new = n_new ** (-lr_power)                 # n^(-p); 0**0 == 1 (p == 0: fixed rate)
        pn_old = ni ** (-lr_power)
        sigma = (pn_new - pn_old) / lr
        g_s = gi + 2.0 * l2_shrinkage * wi
        zi = zi + g_s - sigma * wi                    # OLD w
        q = np.float64((beta + pn_new) / lr + L2)  # IEEE division: q == 0 only when n_new == 0
        if abs(zi) > l1:
            with np.errstate(divide="ignore"):
                w_out[i] = (l1 * math.copysign(1.0, zi) - zi) / q
        else:
            w_out[i] = 0.0                            # exact zero, inside the branch
        z[i] = zi
        n[i] = n_new
    return w_out.reshape(shape), z.reshape(shape), n.reshape(shape)


def _l2_term(l2, l2_convention):
    if l2_convention not in ("tensorflow", "mcmahan"):
        raise ValueError(f"l2_convention must be 'tensorflow' or 'mcmahan', got {l2_convention!r}")
    return 2.0 * l2 if l2_convention == "tensorflow" else l2


def ftrl_reference_weight(z, n, *, lr, lr_power=-0.5, l1=0.0, l2=0.0, beta=0.0, l2_shrinkage=0.0,
                          l2_convention="tensorflow"):
    """The weight of the state ``(z, n)``: ``(l1*sign(z) - z) / q`` with ``q = (beta + n^(-p)) / alpha + L2``
    where ``|z| > l1``, else 0; float64, element-wise (``n`` broadcast against ``z``, e.g. ``[rows, 1]``).
    ``l2_shrinkage`` is accepted (same keywords as :func:`ftrl_reference_step`) and unused."""
    L2 = _l2_term(l2, l2_convention)
    z = np.array(z, dtype=np.float64)
    n = np.broadcast_to(np.array(n, dtype=np.float64), z.shape)
    w = np.empty_like(z)
    for i in np.ndindex(z.shape):
        zi = float(z[i])
        q = np.float64((beta + float(n[i]) ** (-lr_power)) / lr + L2)
        if abs(zi) > l1:
            with np.errstate(divide="ignore"):
                w[i] = (l1 * math.copysign(1.0, zi) - zi) / q
        else:
            w[i] = 0.0
    return w


def ftrl_reference_step_rowwise(w, z, n, g, *, lr, lr_power=-0.5, l1=0.0, l2=0.0, beta=0.0,
                                l2_shrinkage=0.0, l2_convention="tensorflow"):
    """One FTRL step of rows with a row-wise accumulator: ``w``, ``z``, ``g`` ``[U, D]``, ``n`` ``[U]``.
    Returns float64 ``(w, z, n)`` (``n`` ``[U]``); the inputs are not modified."""
    w = np.array(w, dtype=np.float64)
    z = np.array(z, dtype=np.float64, copy=True)
    n = np.array(n, dtype=np.float64, copy=True)
    g = np.array(g, dtype=np.float64)
    U, D = w.shape
    for r in range(U):
        n_new = float(n[r]) + sum(float(x) * float(x) for x in g[r]) / D
        sigma = (n_new ** (-lr_power) - float(n[r]) ** (-lr_power)) / lr
        for d in range(D):
            z[r, d] = z[r, d] + g[r, d] + 2.0 * l2_shrinkage * w[r, d] - sigma * w[r, d]   # OLD w
        n[r] = n_new
    w_out = ftrl_reference_weight(z, n[:, None], lr=lr, lr_power=lr_power, l1=l1, l2=l2, beta=beta,
                                  l2_convention=l2_convention)
    return w_out, z, n


def ftrl_reference_rows(weight, linear, accum, row_ids, row_grads, **knobs):
    """Sparse (row-wise) FTRL on a ``[rows, D]`` table, float64.

    ``row_ids`` ``[K]`` may repeat: gradients ``row_grads`` ``[K, D]`` of the same row are summed first
    (in float64), then ONE update per distinct row; rows not named are copied unchanged.
    ``knobs`` are :func:`ftrl_reference_step`'s keywords. Returns float64 ``(w, z, n)``, ``[rows, D]``.
    """
    W = np.array(weight, dtype=np.float64, copy=True)
    Z = np.array(linear, dtype=np.float64, copy=True)
    N = np.array(accum, dtype=np.float64, copy=True)
    row_ids = np.asarray(row_ids, dtype=np.int64).ravel()
    row_grads = np.asarray(row_grads, dtype=np.float64).reshape((len(row_ids),) + W.shape[1:])
    summed = {}
    for r, gr in zip(row_ids.tolist(), row_grads):
        summed[r] = summed[r] + gr if r in summed else gr.copy()
    for r, gr in summed.items():
        W[r], Z[r], N[r] = ftrl_reference_step(W[r], Z[r], N[r], gr, **knobs)
    return W, Z, N


def reference_knobs(hp) -> dict:
    """Map an ``FTRLHyperparams`` to ``ftrl_reference_step`` keywords."""
    return dict(lr=hp.learning_rate, lr_power=hp.learning_rate_power, l1=hp.l1_reg, l2=hp.l2_reg,
                beta=hp.beta, l2_shrinkage=hp.l2_shrinkage, l2_convention=hp.l2_convention)


# FTRL option keywords (``torchrec_ftrl.FTRL(...)``, TBE and fused_params spelling) -> reference keywords.
_OPTION_KNOBS = {"lr": "lr", "learning_rate": "lr", "ftrl_learning_rate_power": "lr_power",
                 "ftrl_l1_reg": "l1", "ftrl_l2_reg": "l2", "ftrl_beta": "beta",
                 "ftrl_l2_shrinkage": "l2_shrinkage", "ftrl_l2_convention": "l2_convention"}


def option_knobs(options: dict) -> dict:
    """Map FTRL option keywords (``lr`` / ``learning_rate``, ``ftrl_*``) to ``ftrl_reference_step``
    keywords. ``ftrl_initial_accumulator_value`` is not a step keyword (it is the accum input ``n``);
    other keys are ignored."""
    return {_OPTION_KNOBS[k]: v for k, v in options.items() if k in _OPTION_KNOBS}
