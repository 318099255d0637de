"""Dense FTRL-Proximal optimizer: ``torchrec_ftrl.FTRL`` (also registered as ``torchrec.optim.FTRL``).

The functional core is :func:`ftrl`; :class:`FTRL` is the ``torch.optim.Optimizer`` wrapper, shaped after
``torch/optim/adagrad.py``. It is the dense twin of the fused TBE optimizer and takes the same keyword
names, so one dict serves ``apply_optimizer_in_backward`` and ``fused_params``.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch.optim.optimizer import Optimizer

from .hyperparams import FTRLHyperparams, FTRL_KWARGS
from .kernels.ftrl_rule import ftrl_rule, ftrl_update_rows_

__all__ = ["FTRL", "ftrl"]


def ftrl(params: list[torch.Tensor], grads: list[torch.Tensor], accums: list[torch.Tensor],
         linears: list[torch.Tensor], state_steps: list[torch.Tensor], *, hp: FTRLHyperparams,
         skip_zero_grad_rows: bool = False) -> None:
    """Functional FTRL step, in place on ``params``, ``accums`` (n) and ``linears`` (z).

    Dense gradients update every element (or, with ``skip_zero_grad_rows`` and a 2-D parameter, only
    rows whose gradient is not all zero). Sparse COO gradients ``[rows, D]`` update only the rows they
    name, duplicate entries summed first. See :class:`FTRL` for the math.
    """
    for p, g, n, z, step in zip(params, grads, accums, linears, state_steps):
        step += 1
        if g.is_sparse:
            if g.sparse_dim() != 1:
                raise ValueError(f"sparse gradients must have sparse_dim 1 (row-sparse), got {g.sparse_dim()}")
            g = g.coalesce()
            rows, values = g.indices()[0], g.values()
            ftrl_update_rows_(p.data.view(p.shape[0], -1), z.view(p.shape[0], -1),
                              n.view(p.shape[0], -1), rows, values.reshape(rows.numel(), -1), hp)
        elif skip_zero_grad_rows and p.dim() == 2:
            rows = (g != 0).any(dim=1).nonzero().squeeze(1)
            ftrl_update_rows_(p.data, z, n, rows, g[rows], hp)
        else:
            w_new, z_new, n_new = ftrl_rule(p.data, z, n, g, hp)
            p.data.copy_(w_new)
            z.copy_(z_new)
            n.copy_(n_new)


class FTRL(Optimizer):
    r"""FTRL-Proximal (McMahan et al. 2013, Algorithm 1; TensorFlow ``ApplyFtrlV2``).

    Per element, with w the parameter, z = ``linear``, n = ``accum``, g the gradient::

        n_new = n + g^2
        sigma = (n_new^(-p) - n^(-p)) / lr
        z     = z + (g + 2 s w) - sigma w                 # old w
        q     = (beta + n_new^(-p)) / lr + L2              # L2 = 2*l2 (tensorflow) or l2 (mcmahan)
        w     = (l1 sign(z) - z) / q  if |z| > l1  else 0
        n     = n_new

    Args:
        params: parameters or parameter groups.
        lr (float): alpha > 0. ``learning_rate`` is accepted as an alias (fused_params spelling).
        ftrl_learning_rate_power (float): p <= 0, default -0.5 (sqrt path); other values use ``pow``.
        ftrl_l1_reg, ftrl_l2_reg, ftrl_beta, ftrl_l2_shrinkage (float): >= 0, default 0.
        ftrl_initial_accumulator_value (float): n0 >= 0, default 0 (TensorFlow/Keras use 0.1).
        ftrl_l2_convention (str): "tensorflow" (default) or "mcmahan".
        skip_zero_grad_rows (bool): for 2-D parameters with dense gradients, leave rows whose gradient
            is all zero untouched, as the fused TBE leaves untouched rows: the exact twin of the fused
            kernel. Default False (every element is updated, as ``torch.optim`` optimizers do).
        **fused_only: other keys of a ``fused_params`` dict (``optimizer``, ``eps``, ...) are ignored,
            as torchrec's ``RowWiseAdagrad`` does; an unknown ``ftrl_*`` key raises.

    State per parameter: ``accum`` and ``linear`` (shape of the parameter, fp32 whatever its dtype) and
    ``step`` (float32 scalar tensor). Sparse COO gradients (``nn.Embedding(sparse=True)``) update only
    their rows.

    Raises:
        ValueError: naming the knob and its value for an invalid hyperparameter.
    """

    def __init__(self, params: Iterable, lr: Optional[float] = None, *,
                 skip_zero_grad_rows: bool = False, **kwargs: Any) -> None:
        if "learning_rate" in kwargs:
            alias = kwargs.pop("learning_rate")
            if lr is None:
                lr = alias
        if lr is None:
            lr = 0.01
        hp = FTRLHyperparams.from_kwargs(lr, kwargs)
        defaults = dict(lr=hp.learning_rate, skip_zero_grad_rows=bool(skip_zero_grad_rows),
                        **hp.to_kwargs())
        super().__init__(params, defaults)

    @staticmethod
    def _group_hp(group: dict) -> FTRLHyperparams:
        return FTRLHyperparams.from_kwargs(group["lr"], {k: group[k] for k in FTRL_KWARGS})

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["accum"] = torch.full(p.shape, group["ftrl_initial_accumulator_value"],
                                        dtype=torch.float32, device=p.device)
            state["linear"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return state

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._group_hp(self.param_groups[-1])  # validate per-group overrides

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hp = self._group_hp(group)
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
