"""The FTRL-Proximal update rule on PyTorch tensors (fp32 math), used by the dense optimizer and by the
TBE's vectorised PyTorch fallback. The compiled CPU and Triton kernels implement the same lines.

Source: McMahan et al. 2013, "Ad Click Prediction: a View from the Trenches", Algorithm 1, with
TensorFlow ``ApplyFtrlV2``'s l2 shrinkage and Keras' beta; see ``shared/docs/FTRL.md``.
"""

from __future__ import annotations

import torch

from ..hyperparams import FTRLHyperparams


def ftrl_rule(w: torch.Tensor, linear: torch.Tensor, accum: torch.Tensor, g: torch.Tensor,
              hp: FTRLHyperparams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return new ``(w, linear, accum)``, all fp32, for touched elements.

    Args:
        w: weights, any float dtype (read as fp32), the OLD values.
        linear: z, fp32. accum: n, fp32. g: gradient (summed over duplicates), any float dtype.
        hp: validated hyperparameters.

    ``p == -0.5`` takes the sqrt path, other powers ``pow``. Exact zeros under L1 come from a branch
    (``torch.where``), never from a clamp, so ``q == 0`` cannot produce NaN for zeroed elements.
    As in the spec, ``q == 0`` with ``|z| > l1`` (only possible with l2_shrinkage > 0, beta = l2 = 0,
    accum = g = 0) divides by zero and gives +-inf, like the float64 reference.
    """
    w = w.float()
    g = g.float()
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
    return w_new, z, n_new


def ftrl_update_rows_(weight: torch.Tensor, linear: torch.Tensor, accum: torch.Tensor,
                      rows: torch.Tensor, grad_rows: torch.Tensor, hp: FTRLHyperparams,
                      skip_nonfinite: bool = False) -> torch.Tensor:
    """In place: one FTRL update of each row in ``rows`` (distinct, int64 ``[U]``) of ``[R, D]`` tables.

    ``grad_rows`` ``[U, D]`` is the summed gradient of each row. With ``skip_nonfinite``, rows whose
    gradient holds NaN/Inf are left untouched. Returns a bool ``[U]`` mask of the rows updated.
    """
    ok = torch.isfinite(grad_rows).all(dim=1) if skip_nonfinite else None
    if ok is not None and not bool(ok.all()):
        rows, grad_rows = rows[ok], grad_rows[ok]
    w_new, z_new, n_new = ftrl_rule(weight[rows], linear[rows], accum[rows], grad_rows, hp)
    weight[rows] = w_new.to(weight.dtype)
    linear[rows] = z_new
    accum[rows] = n_new
    return ok if ok is not None else torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
