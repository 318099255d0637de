"""The FTRL-Proximal update rule on PyTorch tensors: the one statement of the rule in Python.

Used by the dense optimizer (:mod:`torchrec_ftrl.optim`) and the TBE's PyTorch backend
(:mod:`torchrec_ftrl.kernels.pytorch.rows`). The kernels' rule is generated from
``rule_spec.py`` (its ``IEEE`` form for the C++ kernel, ``FAST`` for Triton); this module is
written independently of it, the oracle the tests compare the kernels with.

Per element, with w the weight, n = accum, z = linear, g the gradient summed over duplicates, the
rule of :class:`torchrec_ftrl.FTRL`'s docstring and ``docs/ftrl.md`` (:func:`ftrl_rule`).

The weight is a function of the state: after every update ``w == prox(z, n)``, with
``prox(z, n) = (l1 sign(z) - z) / q(n) if |z| > l1 else 0`` and ``q(n) = (beta + n^(-p)) / lr + L2``
(:func:`ftrl_prox`), so a row can keep only ``(z, n)`` and compute ``w`` where it is used (the
"derived weights" row layout). The row-wise accumulator keeps one ``n`` per row
(:func:`ftrl_rule_rowwise`)::

    n_new = n + mean_d(g_d^2)                          # one n per row
    sigma = (n_new^(-p) - n^(-p)) / lr
    z_d   = z_d + (g_d + 2 s w_d) - sigma w_d
    w_d   = prox(z_d, n_new)

Source: McMahan et al. 2013, "Ad Click Prediction: a View from the Trenches", Algorithm 1 (which
keeps only z and n per coordinate and computes w on use), with TensorFlow ``ApplyFtrlV2``'s l2
shrinkage and Keras' beta; the row-wise accumulator as FBGEMM's EXACT_ROWWISE_ADAGRAD keeps its
``momentum1`` (the mean of g^2 over the row); ``docs/ftrl.md`` states both for users.
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
    w, g, accum, linear = w.to(math), g.to(math), accum.to(math), linear.to(math)
    n_new = accum + g * g
    z = _linear_step(w, accum, n_new, linear, g, hp)
    return ftrl_prox(z, n_new, hp), n_new, z


def _power(n: torch.Tensor, hp: FTRLHyperparams) -> torch.Tensor:
    """``n^(-p)``: ``sqrt`` for ``p == -0.5``, ``pow`` otherwise. On the CPU an fp32 ``sqrt`` is taken
    in fp64 and rounded once, the correctly rounded result (IEEE ``sqrtf``, as the compiled CPU
    kernel computes it; torch's fp32 CPU ``sqrt`` is not correctly rounded for every input; CUDA's is)."""
    if hp.learning_rate_power != -0.5:
        return n.pow(-hp.learning_rate_power)
    if n.dtype == torch.float32 and n.device.type == "cpu":
        return n.double().sqrt().to(n.dtype)
    return n.sqrt()


def _linear_step(w: torch.Tensor, accum: torch.Tensor, n_new: torch.Tensor, linear: torch.Tensor,
                 g: torch.Tensor, hp: FTRLHyperparams) -> torch.Tensor:
    """The new ``z``: ``z + (g + 2 s w) - sigma w`` with ``sigma = (n_new^(-p) - n^(-p)) / lr``
    (``accum`` / ``n_new`` broadcast against ``w``: per element or ``[U, 1]`` per row)."""
    sigma = (_power(n_new, hp) - _power(accum, hp)) / hp.learning_rate
    g_s = g + (2.0 * hp.l2_shrinkage) * w if hp.l2_shrinkage != 0.0 else g
    return linear + g_s - sigma * w


def ftrl_prox(linear: torch.Tensor, accum: torch.Tensor, hp: FTRLHyperparams) -> torch.Tensor:
    """The weight FTRL-Proximal keeps implicitly: ``prox(z, n)``, in the math dtype of ``accum``.

    ``w = (l1 sign(z) - z) / q`` where ``|z| > l1``, else exactly 0.0, with
    ``q = (beta + n^(-p)) / lr + L2``. ``linear`` (z) ``[..., D]``; ``accum`` (n) of the same shape,
    or ``[..., 1]`` for a row-wise accumulator. After every update of the rule the stored weight
    equals this of the stored state (bit for bit in the same dtype: it is the same arithmetic).
    ``q == 0`` with ``|z| > l1`` gives +-inf, as :func:`ftrl_rule` does.
    """
    math = torch.promote_types(accum.dtype, torch.float32)
    z, n = linear.to(math), accum.to(math)
    q = (hp.beta + _power(n, hp)) / hp.learning_rate + hp.l2_effective
    keep = z.abs() > hp.l1_reg
    return torch.where(keep, (hp.l1_reg * z.sign() - z) / q, torch.zeros_like(z))


def ftrl_encode(weights: torch.Tensor, accum: torch.Tensor,
                hp: FTRLHyperparams) -> tuple[torch.Tensor, int]:
    """The ``linear`` (z) with ``ftrl_prox(z, accum) == weights``: the inverse of :func:`ftrl_prox`.

    ``z = -(q w + l1 sign(w))`` with ``q = (beta + n^(-p)) / lr + L2``: a weight ``w != 0`` needs
    ``|z| > l1``, which this gives, and ``(l1 sign(z) - z) / q`` returns ``w`` up to the rounding of
    the two operations (a few ulps in fp32); ``w == 0`` gives ``z = 0``. Where ``q == 0`` (``n = 0``,
    ``beta = 0``, no L2 term) no z gives a non-zero weight: those elements get ``z = 0`` (``w = 0``).

    Args:
        weights: ``[..., D]`` any float dtype. accum: n, ``[..., D]`` or ``[..., 1]`` (row-wise).

    Returns:
        ``(z, dropped)``: z fp32 (fp64 for an fp64 ``accum``) of ``weights``' shape, and the number of
        non-zero weights set to 0 because ``q == 0`` there.
    """
    math = torch.promote_types(accum.dtype, torch.float32)
    w, n = weights.to(math), accum.to(math)
    q = ((hp.beta + _power(n, hp)) / hp.learning_rate + hp.l2_effective).expand_as(w)
    lost = (q == 0) & (w != 0)
    z = torch.where((q == 0) | (w == 0), torch.zeros_like(w), -(q * w + hp.l1_reg * w.sign()))
    return z, int(lost.sum())


def _sum_last(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dim in one fixed pairwise order (halves added element by element,
    an odd last column carried), so an eager call and a compiled graph (whose reductions Inductor
    orders its own way) give the same bits."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        head = x[..., :h] + x[..., h:2 * h]
        x = torch.cat([head, x[..., 2 * h:]], dim=-1) if x.shape[-1] % 2 else head
    return x[..., 0]


def ftrl_rule_rowwise(w: torch.Tensor, accum: torch.Tensor, linear: torch.Tensor, g: torch.Tensor,
                      hp: FTRLHyperparams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return new ``(w, accum, linear)`` of touched rows with a row-wise accumulator, in the math dtype.

    Args:
        w, linear, g: ``[U, D]`` old weights, z and summed gradients (as :func:`ftrl_rule`).
        accum: ``[U]``, one n per row (fp32 or bf16: fp32 math; fp64: fp64 math).

    ``n_new = n + mean_d(g_d^2)`` (the mean over the row's D elements of the raw gradient squared,
    summed pairwise in a fixed order: :func:`_sum_last`),
    then every element of the row takes the element rule's ``z`` and ``w`` steps with the row's
    ``sigma`` and ``q``. Returns ``w`` and ``linear`` ``[U, D]``, ``accum`` ``[U]``.
    """
    math = torch.promote_types(accum.dtype, torch.float32)
    w, g, accum, linear = w.to(math), g.to(math), accum.to(math), linear.to(math)
    n_new = accum + _sum_last(g * g) / g.shape[-1]
    z = _linear_step(w, accum.unsqueeze(-1), n_new.unsqueeze(-1), linear, g, hp)
    return ftrl_prox(z, n_new.unsqueeze(-1), hp), n_new, z


def nonfinite_free_rows(grad_rows: torch.Tensor) -> torch.Tensor:
    """The overflow rule: bool ``[U]``, True for the rows of ``grad_rows`` ``[U, D]`` whose
    ``sum_d g_d^2``, summed in fp32 (fp64 for fp64 gradients), is finite. False covers a NaN or Inf
    gradient and finite gradients whose squares overflow (e.g. 1e20 in fp32): the update of such a
    row would store a non-finite state, so the TBE's kernels skip it and count it."""
    g = grad_rows.to(torch.promote_types(grad_rows.dtype, torch.float32))
    return torch.isfinite((g * g).sum(dim=1))


def ftrl_update_rows_(weight: Optional[torch.Tensor], accum: torch.Tensor, linear: torch.Tensor,
                      rows: torch.Tensor, grad_rows: torch.Tensor, hp: FTRLHyperparams,
                      skip_nonfinite: bool = False, row_keys: Optional[torch.Tensor] = None,
                      step: Optional[int | torch.Tensor] = None) -> torch.Tensor:
    """In place: one FTRL update of each row in ``rows`` (distinct, int64 ``[U]``) of ``[R, D]`` tables.

    Every row layout (:class:`torchrec_ftrl.row_layout.RowLayout`): ``weight`` ``[R, D]``, or None
    for derived weights (the old weight is then ``prox(linear, accum)``, :func:`ftrl_prox`);
    ``accum`` ``[R, D]`` (element-wise, :func:`ftrl_rule`) or ``[R]`` (row-wise,
    :func:`ftrl_rule_rowwise`); ``linear`` ``[R, D]``.

    ``grad_rows`` ``[U, D]`` is the summed gradient of each row. With ``skip_nonfinite``, rows whose
    ``sum_d g_d^2`` is not finite (:func:`nonfinite_free_rows`) are left untouched. ``accum`` /
    ``linear`` are fp32 (fp64) or bf16: a bf16 state is stored stochastically rounded
    (:func:`torchrec_ftrl.state_dtype.store_state`) with the hash of ``(row_keys[u], column, step, state)`` (column 0 for a row-wise ``accum``): ``row_keys``
    (int64 ``[U]``, the global row key of each row; default ``rows``) and ``step`` (int or int64
    tensor) are then required. Returns a bool ``[U]`` mask of the rows updated.

    Raises:
        ValueError: a bf16 state without ``step``.
    """
    compact = torch.bfloat16 in (accum.dtype, linear.dtype)
    if compact and step is None:
        raise ValueError("ftrl_update_rows_ needs step= (the optimizer step) to round a bf16 state "
                         f"stochastically, got step=None with accum {accum.dtype}, linear {linear.dtype}")
    if row_keys is None:
        row_keys = rows
    ok = nonfinite_free_rows(grad_rows) if skip_nonfinite else None
    if ok is not None and not bool(ok.all()):
        rows, grad_rows, row_keys = rows[ok], grad_rows[ok], row_keys[ok]
    rowwise = accum.dim() == 1
    n_old, z_old = accum[rows], linear[rows]
    w_old = weight[rows] if weight is not None else ftrl_prox(
        z_old, n_old.unsqueeze(-1) if rowwise else n_old, hp)
    rule = ftrl_rule_rowwise if rowwise else ftrl_rule
    w_new, n_new, z_new = rule(w_old, n_old, z_old, grad_rows, hp)
    if weight is not None:
        weight[rows] = w_new.to(weight.dtype)
    if compact:
        col = torch.arange(grad_rows.shape[1], device=grad_rows.device)
        key = row_keys.to(torch.int64).unsqueeze(1)
        n_key, n_col = (key.squeeze(1), torch.zeros_like(row_keys)) if rowwise else (key, col)
        accum[rows] = store_state(n_new, accum.dtype, n_key, n_col, step, 0).to(accum.dtype)
        linear[rows] = store_state(z_new, linear.dtype, key, col, step, 1).to(linear.dtype)
    else:
        accum[rows] = n_new.to(accum.dtype)
        linear[rows] = z_new.to(linear.dtype)
    return ok if ok is not None else torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
