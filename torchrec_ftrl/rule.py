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

import torch

from .hyperparams import FTRLHyperparams


def ftrl_rule(w: torch.Tensor, accum: torch.Tensor, linear: torch.Tensor, g: torch.Tensor,
              hp: FTRLHyperparams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return new ``(w, accum, linear)`` for touched elements, in the states' dtype.

    Args:
        w: weights, any float dtype (read in the states' dtype), the OLD values.
        accum: n; linear: z. Both fp32, or fp64 for fp64 math. g: gradient (summed over duplicates),
            any float dtype. All of one shape.
        hp: validated hyperparameters.

    The math runs in ``accum``'s dtype. ``p == -0.5`` takes the sqrt path, other powers ``pow``. Exact
    zeros under L1 come from a branch (``torch.where``), never from a clamp, so ``q == 0`` cannot
    produce NaN for zeroed elements. As in the spec, ``q == 0`` with ``|z| > l1`` (only possible with
    l2_shrinkage > 0, beta = l2 = 0, accum = g = 0) divides by zero and gives +-inf, like the float64
    reference.
    """
    w = w.to(accum.dtype)
    g = g.to(accum.dtype)
    n_new = accum + g * g
    if hp.learning_rate_power == -0.5:
        pn_new, pn_old = n_new.sqrt(), accum.sqrt()
    else:
        pn_new, pn_old = n_new.pow(-hp.learning_rate_power), accum.pow(-hp.learning_rate_power)
    sigma = (pn_new - pn_old) / hp.learning_rate
    g_s = g + (2.0 * hp.l2_shrinkage) * w if hp.l2_shrinkage != 0.0 else g
    z = linear + g_s - sigma * w
    q = (hp.beta + pn_new) / hp.learning_rate + hp.l2_effective
    keep = z.abs() > hp.l1_reg
    w_new = torch.where(keep, (hp.l1_reg * z.sign() - z) / q, torch.zeros_like(z))
    return w_new, n_new, z


def ftrl_update_rows_(weight: torch.Tensor, accum: torch.Tensor, linear: torch.Tensor,
                      rows: torch.Tensor, grad_rows: torch.Tensor, hp: FTRLHyperparams,
                      skip_nonfinite: bool = False) -> torch.Tensor:
    """In place: one FTRL update of each row in ``rows`` (distinct, int64 ``[U]``) of ``[R, D]`` tables.

    ``grad_rows`` ``[U, D]`` is the summed gradient of each row. With ``skip_nonfinite``, rows whose
    gradient holds NaN/Inf are left untouched. Returns a bool ``[U]`` mask of the rows updated.
    """
    ok = torch.isfinite(grad_rows).all(dim=1) if skip_nonfinite else None
    if ok is not None and not bool(ok.all()):
        rows, grad_rows = rows[ok], grad_rows[ok]
    w_new, n_new, z_new = ftrl_rule(weight[rows], accum[rows], linear[rows], grad_rows, hp)
    weight[rows] = w_new.to(weight.dtype)
    accum[rows] = n_new
    linear[rows] = z_new
    return ok if ok is not None else torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
