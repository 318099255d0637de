"""The FTRL-Proximal update rule on PyTorch tensors: the one statement of the rule in Python.

Used by the dense optimizer (:mod:`torchrec_ftrl.optim`) and the TBE's PyTorch backend
(:mod:`torchrec_ftrl.kernels.torch_backend`). Its twins are ``ftrl_element`` in
``kernels/csrc/ftrl_tbe_cpu.cpp`` and ``ftrl_update_store`` in ``kernels/triton_backward.py``, which
take their scalars from :meth:`~torchrec_ftrl.hyperparams.FTRLHyperparams.kernel_scalars`.

Per element, with w the weight, n = accum, z = linear, g the gradient summed over duplicates::

    n_new = n + g^2                                    # raw g, never the shrunk one
    sigma = (n_new^(-p) - n^(-p)) / lr
    z     = z + (g + 2 s w) - sigma w                  # old w
    q     = (beta + n_new^(-p)) / lr + L2              # L2 = 2*l2 (tensorflow) or l2 (mcmahan)
    w     = (l1 sign(z) - z) / q  if |z| > l1  else 0  # exactly 0.0
    n     = n_new

Source: McMahan et al. 2013, "Ad Click Prediction: a View from the Trenches", Algorithm 1, with
TensorFlow ``ApplyFtrlV2``'s l2 shrinkage and Keras' beta; ``docs/ftrl.md`` states it for users.
"""

from __future__ import annotations

from typing import Optional

import torch

from .hyperparams import FTRLHyperparams
from .state_dtype import store_state


def ftrl_rule(w: torch.Tensor, accum: torch.Tensor, linear: torch.Tensor, g: torch.Tensor,
              hp: FTRLHyperparams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return new ``(w, accum, linear)`` for touched elements, in the math dtype.

    Args:
        w: weights, any float dtype (read in the math dtype), the OLD values.
        accum: n; linear: z. fp32 or bf16 (fp32 math; a bf16 state upcasts exactly), or fp64 for
            fp64 math. g: gradient (summed over duplicates), any float dtype. All of one shape.
        hp: validated hyperparameters.

    The math runs in ``accum``'s dtype promoted with fp32 (fp32 for fp32 / bf16 / fp16 states,
    fp64 for fp64 states); the caller rounds the results into its storage
    (:func:`torchrec_ftrl.state_dtype.store_state`). ``p == -0.5`` takes the sqrt path, other powers ``pow``. Exact
    zeros under L1 come from a branch (``torch.where``), never from a clamp, so ``q == 0`` cannot
    produce NaN for zeroed elements. As in the spec, ``q == 0`` with ``|z| > l1`` (only possible with
    l2_shrinkage > 0, beta = l2 = 0, accum = g = 0) divides by zero and gives +-inf, like the float64
    reference.
    """
    math = torch.promote_types(accum.dtype, torch.float32)
    w = w.to(math)
    g = g.to(math)
    accum = accum.to(math)
    linear = linear.to(math)
    n_new = accum + g * g
    if hp.learning_rate_power == -0.5:
        pn_new, pn_old = n_new.sqrt(), accum.sqrt()
    else:
        pn_new, pn_old = n_new.pow(-hp.learning_rate_power), accum.pow(-hp.learning_rate_power)
    sigma = (pn_new - pn_old) / hp.learning_rate
    g_s = g + (2.0 * hp.l2_shrinkage) * w if hp.l2_shrinkage != 0.0 else g
    z = linear + g_s - sigma * w
    return _prox(z, pn_new, hp), n_new, z


def _prox(z: torch.Tensor, pn: torch.Tensor, hp: FTRLHyperparams) -> torch.Tensor:
    """``w = (l1 sign(z) - z) / q`` where ``|z| > l1``, else exactly 0; ``q = (beta + pn) / lr + L2``,
    ``pn = n^(-p)``."""
    q = (hp.beta + pn) / hp.learning_rate + hp.l2_effective
    keep = z.abs() > hp.l1_reg
    return torch.where(keep, (hp.l1_reg * z.sign() - z) / q, torch.zeros_like(z))


def ftrl_weight(accum: torch.Tensor, linear: torch.Tensor, hp: FTRLHyperparams) -> torch.Tensor:
    """The weight FTRL derives from its state: ``w = prox(z, n)``, the last two lines of the rule
    with ``n_new = accum``, ``z = linear``; in ``accum``'s dtype promoted with fp32 (a bf16 state
    upcasts exactly).

    Args:
        accum: n, any shape; linear: z, the same shape; fp32, bf16 or fp64.
        hp: validated hyperparameters.
    """
    math = torch.promote_types(accum.dtype, torch.float32)
    n = accum.to(math)
    pn = n.sqrt() if hp.learning_rate_power == -0.5 else n.pow(-hp.learning_rate_power)
    return _prox(linear.to(math), pn, hp)


def ftrl_update_rows_(weight: torch.Tensor, accum: torch.Tensor, linear: torch.Tensor,
                      rows: torch.Tensor, grad_rows: torch.Tensor, hp: FTRLHyperparams,
                      skip_nonfinite: bool = False, row_keys: Optional[torch.Tensor] = None,
                      step: Optional[int | torch.Tensor] = None) -> torch.Tensor:
    """In place: one FTRL update of each row in ``rows`` (distinct, int64 ``[U]``) of ``[R, D]`` tables.

    ``grad_rows`` ``[U, D]`` is the summed gradient of each row. With ``skip_nonfinite``, rows whose
    gradient holds NaN/Inf are left untouched. ``accum`` / ``linear`` are fp32 (fp64) or bf16: a bf16
    state is stored stochastically rounded (:func:`torchrec_ftrl.state_dtype.store_state`) with the
    hash of ``(row_keys[u], column, step, state)``: ``row_keys`` (int64 ``[U]``, the global row key
    of each row; default ``rows``) and ``step`` (int or int64 tensor) are then required. Returns a
    bool ``[U]`` mask of the rows updated.

    Raises:
        ValueError: a bf16 state without ``step``.
    """
    compact = torch.bfloat16 in (accum.dtype, linear.dtype)
    if compact and step is None:
        raise ValueError("ftrl_update_rows_ needs step= (the optimizer step) to round a bf16 state "
                         f"stochastically, got step=None with accum {accum.dtype}, linear {linear.dtype}")
    if row_keys is None:
        row_keys = rows
    ok = torch.isfinite(grad_rows).all(dim=1) if skip_nonfinite else None
    if ok is not None and not bool(ok.all()):
        rows, grad_rows, row_keys = rows[ok], grad_rows[ok], row_keys[ok]
    w_new, n_new, z_new = ftrl_rule(weight[rows], accum[rows], linear[rows], grad_rows, hp)
    weight[rows] = w_new.to(weight.dtype)
    if compact:
        col = torch.arange(grad_rows.shape[1], device=grad_rows.device)
        key = row_keys.to(torch.int64).unsqueeze(1)
        accum[rows] = store_state(n_new, accum.dtype, key, col, step, 0).to(accum.dtype)
        linear[rows] = store_state(z_new, linear.dtype, key, col, step, 1).to(linear.dtype)
    else:
        accum[rows] = n_new
        linear[rows] = z_new
    return ok if ok is not None else torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
