"""Dense FTRL-Proximal optimizer: ``torchrec_ftrl.FTRL`` (also registered as ``torchrec.optim.FTRL``).

The functional core is :func:`ftrl`; :class:`FTRL` is the ``torch.optim.Optimizer`` wrapper, shaped after
``torch/optim/adagrad.py``. It is the dense twin of the fused TBE optimizer and takes the same keyword
names, so one dict serves ``apply_optimizer_in_backward`` and ``fused_params``.
The update rule is stated once in :mod:`torchrec_ftrl.rule` and for users in ``docs/ftrl.md``
(McMahan et al. 2013, Algorithm 1; TensorFlow ``ApplyFtrlV2``).
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Iterable, Optional

import torch
from torch.optim.optimizer import Optimizer

from .hyperparams import LEARNING_RATE_KEYS, FTRLHyperparams, parse_options
from .optim_type import FTRL_VALUE
from .rule import ftrl_rule, ftrl_update_rows_

__all__ = ["FTRL", "ftrl", "state_dtype"]

_STATE_KEYS = ("accum", "linear")


def _check_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """Raise ``ValueError`` for a gradient this optimizer cannot apply (checked before any update)."""
    if p.is_complex() or not p.is_floating_point():
        raise ValueError(f"FTRL needs real floating-point parameters, got dtype {p.dtype}")
    if g.shape != p.shape:
        raise ValueError(f"gradient shape {tuple(g.shape)} != parameter shape {tuple(p.shape)}")
    if g.is_sparse:
        if g.sparse_dim() < 1:
            raise ValueError(f"sparse COO gradients need sparse_dim >= 1, got sparse_dim {g.sparse_dim()}")
    elif g.layout != torch.strided:
        raise ValueError(f"gradient layout {g.layout} is not supported (dense or sparse COO only)")


def state_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of a parameter's ``accum``/``linear`` and of its FTRL math: fp64 for fp64 parameters,
    else fp32 (fp16/bf16 states would overflow: accum grows without bound)."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _sparse_rows(g: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse COO gradient as (distinct rows int64 ``[U]``, summed row gradients ``[U, D]`` in the
    parameter's state dtype).

    Duplicate entries are summed (``coalesce``) in the state dtype. With ``sparse_dim > 1`` (e.g.
    ``zeros_like(p).to_sparse()`` from ``KeyedOptimizer.init_state``) a row is touched when any of its
    elements is listed; its unlisted elements get gradient 0.
    """
    g = g.to(state_dtype(p)).coalesce()
    idx, vals = g.indices(), g.values()
    d = p[0].numel() if p.dim() > 0 and p.shape[0] > 0 else 1
    if g.sparse_dim() == 1:
        return idx[0], vals.reshape(idx.shape[1], d)
    rows, inverse = torch.unique(idx[0], return_inverse=True)
    dense = torch.zeros((rows.numel(),) + tuple(p.shape[1:]), dtype=vals.dtype, device=vals.device)
    dense[(inverse,) + tuple(idx[1:])] = vals
    return rows, dense.reshape(rows.numel(), d)


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, -1]`` sharing storage (rows = dim 0; a 0-d/1-D tensor has 1-element rows)."""
    if t.dim() == 0:
        return t.view(1, 1)
    return t.view(t.shape[0], -1)


def ftrl(params: list[torch.Tensor], grads: list[torch.Tensor], accums: list[torch.Tensor],
         linears: list[torch.Tensor], state_steps: list[torch.Tensor], *, hp: FTRLHyperparams,
         skip_zero_grad_rows: bool = True) -> None:
    """Functional FTRL step, in place on ``params``, ``accums`` (n) and ``linears`` (z).

    Args:
        params: parameters, any real float dtype and shape (contiguous); updated in place.
        grads: one gradient per parameter, same shape: dense (strided) or sparse COO (``sparse_dim()
            >= 1``; row-sparse ``sparse_dim() == 1`` from ``nn.Embedding(sparse=True)``).
        accums, linears: tensors of the parameter's shape in :func:`state_dtype` (fp64 for fp64
            parameters, else fp32), updated in place; the math runs in that dtype.
        state_steps: scalar step counters, incremented by one each.
        hp: validated hyperparameters.
        skip_zero_grad_rows: for dense gradients, leave rows (slices along dim 0; single elements of a
            1-D parameter) whose gradient is all zero bit-for-bit untouched: row-sparse semantics, the
            twin of the fused TBE (default). False: every element is updated.

    Sparse COO gradients update only the rows they name, duplicate entries summed first
    (``coalesce``), then ONE update per row; with
    ``sparse_dim > 1`` a row is touched when any of its elements is listed.

    Raises:
        ValueError: for a complex/integer parameter, a gradient of another shape, or a sparse
            gradient that is not COO with ``sparse_dim >= 1``. All gradients are checked before
            anything is updated.
    """
    for p, g in zip(params, grads):
        _check_grad(p, g)
    for p, g, n, z, step in zip(params, grads, accums, linears, state_steps):
        step += 1
        if g.is_sparse:
            rows, values = _sparse_rows(g, p)
            ftrl_update_rows_(_rows_view(p.data), _rows_view(n), _rows_view(z), rows, values, hp)
        elif skip_zero_grad_rows:
            g2 = _rows_view(g)
            rows = (g2 != 0).any(dim=1).nonzero().squeeze(1)
            ftrl_update_rows_(_rows_view(p.data), _rows_view(n), _rows_view(z), rows, g2[rows], hp)
        else:
            w_new, n_new, z_new = ftrl_rule(p.data, n, z, g, hp)
            p.data.copy_(w_new)
            n.copy_(n_new)
            z.copy_(z_new)


class FTRL(Optimizer):
    r"""FTRL-Proximal (McMahan et al. 2013, Algorithm 1; TensorFlow ``ApplyFtrlV2``; ``docs/ftrl.md``).

    Per element, with w the parameter, z = ``linear``, n = ``accum``, g the gradient::

        n_new = n + g^2                                    # raw g, never the shrunk one
        sigma = (n_new^(-p) - n^(-p)) / lr
        z     = z + (g + 2 s w) - sigma w                  # old w
        q     = (beta + n_new^(-p)) / lr + L2              # L2 = 2*l2 (tensorflow) or l2 (mcmahan)
        w     = (l1 sign(z) - z) / q  if |z| > l1  else 0  # exactly 0.0
        n     = n_new

    Math and states are fp64 for fp64 parameters and fp32 for every other dtype (fp32/fp16/bf16).

    Args:
        params: parameters or parameter groups (a group may override any keyword below).
        lr (float): alpha > 0, default 0.01. ``learning_rate`` is accepted as an alias (fused_params
            spelling); giving both with different values raises.
        ftrl_learning_rate_power (float): p <= 0, default -0.5 (sqrt path); other values use ``pow``;
            0 is a fixed rate.
        ftrl_l1_reg, ftrl_l2_reg, ftrl_beta, ftrl_l2_shrinkage (float): >= 0, default 0.
        ftrl_initial_accumulator_value (float): n0 >= 0, default 0 (TensorFlow/Keras use 0.1).
        ftrl_l2_convention (str): "tensorflow" (default, L2 = 2*l2) or "mcmahan" (L2 = l2).
        skip_zero_grad_rows (bool): with dense gradients, leave rows (slices along dim 0; elements of
            a 1-D parameter) whose gradient is all zero bit-for-bit untouched, as the fused TBE leaves
            rows absent from the batch: the twin of the fused kernel for ``[rows, D]`` embedding
            tables (e.g. a data-parallel table's dense gradient). Default True: FTRL recomputes w from
            (z, n), so an update with a zero gradient would reset a never-touched row (to 0 when
            ``linear`` is 0). False updates every element, as ``torch.optim`` optimizers do.
        **fused_only: other keys of a ``fused_params`` dict (``optimizer``, ``eps``, ...) are ignored,
            as torchrec's ``RowWiseAdagrad`` does; an unknown ``ftrl_*`` key raises.

    Non-finite gradients are NOT filtered (as in ``torch.optim``; the update is element-wise): an
    element whose gradient is NaN or +-Inf gets a NaN/+Inf ``accum`` and a NaN/+-Inf ``linear``, and
    keeps them (``accum`` only grows), and its weight becomes 0.0 (``|linear| > l1`` is false for
    NaN), NaN, or +-Inf (``ftrl_learning_rate_power = 0``); every other element is updated
    normally. Check gradients (``torch.isfinite``) before :meth:`step` if they can be non-finite. The fused TBE instead skips rows with a non-finite summed
    gradient and counts them (``FTRLTableBatchedEmbeddingBags.nonfinite_grad_rows``).

    State per parameter: ``accum`` (n) and ``linear`` (z), shape of the parameter, fp64 for fp64
    parameters and fp32 otherwise (kept so by :meth:`load_state_dict`), and ``step`` (float32 scalar
    tensor). Sparse COO
    gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) update only their rows,
    duplicates summed first.

    Raises:
        ValueError: naming the knob and its value for an invalid hyperparameter (at construction, in
            :meth:`add_param_group`, :meth:`load_state_dict`, and at :meth:`step` if a group was edited),
            or for an unsupported gradient. A failing call modifies nothing.
    """

    emb_optim_value = FTRL_VALUE  # marks the class as FTRL for torchrec_ftrl.optim_type.is_ftrl

    def __init__(self, params: Iterable, lr: Optional[float] = None, *,
                 skip_zero_grad_rows: bool = True, **kwargs: Any) -> None:
        hp = parse_options({"lr": lr, **kwargs}, where="FTRL(...)")
        defaults = dict(lr=hp.learning_rate, skip_zero_grad_rows=bool(skip_zero_grad_rows),
                        **hp.to_kwargs())
        super().__init__(params, defaults)

    @staticmethod
    def _group_hp(group: dict) -> FTRLHyperparams:
        return parse_options(group, where="param group")

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["accum"] = torch.full(p.shape, group["ftrl_initial_accumulator_value"],
                                        dtype=state_dtype(p), device=p.device)
            state["linear"] = torch.zeros(p.shape, dtype=state_dtype(p), device=p.device)
        return state

    def add_param_group(self, param_group: dict) -> None:
        """Add a group; its knobs (defaults filled in) are validated BEFORE it is added.

        Raises:
            ValueError: naming the knob and value, or ``learning_rate`` given with ``lr``.
        """
        if "learning_rate" in param_group:
            param_group = dict(param_group)
            parse_options({k: param_group.get(k) for k in LEARNING_RATE_KEYS}, where="param group")
            alias = param_group.pop("learning_rate")
            param_group["lr"] = alias
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        self._group_hp(merged)
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict`; ``accum``/``linear`` keep their state dtype (:func:`state_dtype`)
        and, loaded in it, their bits (torch's loader would cast them to the parameter dtype).

        Raises:
            ValueError: an invalid knob in a saved param group, a saved per-parameter state that is
                not empty but lacks an ``accum``, ``linear`` or ``step`` tensor (e.g. another
                optimizer's state), a saved ``accum``/``linear`` whose shape differs from its
                parameter, or (from ``torch.optim``) other numbers of groups or parameters.
                Nothing is modified then.
        """
        saved_groups = state_dict["param_groups"]
        for g in saved_groups:
            self._group_hp(g)
        saved_state = state_dict["state"]
        id_map = {}
        if len(saved_groups) == len(self.param_groups):
            id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                              chain.from_iterable(g["params"] for g in self.param_groups)))
        for pid, p in id_map.items():
            saved = saved_state.get(pid, {})
            missing = [k for k in (*_STATE_KEYS, "step") if saved and not isinstance(saved.get(k), torch.Tensor)]
            if missing:
                raise ValueError(f"saved state of parameter {pid!r} lacks tensor(s) {missing} (has keys "
                                 f"{sorted(saved)}); FTRL state needs 'accum', 'linear' and 'step'")
            for key in _STATE_KEYS:
                v = saved.get(key)
                if isinstance(v, torch.Tensor) and v.shape != p.shape:
                    raise ValueError(f"saved {key} of shape {tuple(v.shape)} does not match parameter "
                                     f"shape {tuple(p.shape)}")
        super().load_state_dict(state_dict)
        for pid, p in id_map.items():
            for key in _STATE_KEYS:
                v = saved_state.get(pid, {}).get(key)
                if isinstance(v, torch.Tensor):
                    self.state[p][key] = v.detach().to(device=p.device, dtype=state_dtype(p), copy=True)

    @torch.no_grad()
    def step(self, closure=None):
        """One FTRL step over every parameter with a gradient.

        Raises:
            ValueError: an invalid knob in an (edited) param group or an unsupported gradient; all
                groups and gradients are checked before any parameter or state is modified.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hps = [self._group_hp(group) for group in self.param_groups]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    _check_grad(p, p.grad)
        for group, hp in zip(self.param_groups, hps):
            params, grads, accums, linears, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._init_state(p, group)
                params.append(p)
                grads.append(p.grad)
                accums.append(state["accum"])
                linears.append(state["linear"])
                steps.append(state["step"])
            ftrl(params, grads, accums, linears, steps, hp=hp,
                 skip_zero_grad_rows=group["skip_zero_grad_rows"])
        return loss
