"""Dense FTRL-Proximal optimizer: ``torchrec_ftrl.FTRL`` (also registered as ``torchrec.optim.FTRL``).

The functional core is :func:`ftrl`; :class:`FTRL` is the ``torch.optim.Optimizer`` wrapper, shaped after
``torch/optim/adagrad.py``. It is the dense twin of the fused TBE optimizer and takes the same keyword
names, so one dict serves ``apply_optimizer_in_backward`` and ``fused_params``.
The update rule is stated once in :mod:`torchrec_ftrl.rule` and for users in ``docs/ftrl.md``
(McMahan et al. 2013, Algorithm 1; TensorFlow ``ApplyFtrlV2``).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch.optim.optimizer import Optimizer

from .hyperparams import LEARNING_RATE_KEYS, FTRLHyperparams, parse_options
from .optim_type import FTRL_VALUE
from .rule import ftrl_rule, ftrl_update_rows_
from .state_dtype import DTYPE_NAMES, STATE_NAMES, parse_one_state_dtype, parse_state_dtypes, store_state

__all__ = ["FTRL", "ftrl", "state_dtype"]

# The dense optimizer's state_dtype is kept in param groups by its name (DTYPE_NAMES), so a state_dict
# stays plain data: fp32 (the default; fp64 state for fp64 parameters) or bf16.
_STORAGE = {"fp32": None, "bf16": torch.bfloat16}


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
    """The dtype of a parameter's FTRL math, and of its ``accum``/``linear`` under the default
    ``state_dtype="fp32"``: fp64 for fp64 parameters, else fp32 (fp16 states would overflow: accum
    grows without bound). With ``state_dtype="bf16"`` the states are stored in bf16 and the math is
    this dtype (fp32)."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _dense_state_dtype_option(state_dtype_value: Any, optimizer_state_dtypes: Any, where: str) -> str:
    """The one state dtype of a dense FTRL group from its ``state_dtype`` and/or a ``fused_params``-style
    ``optimizer_state_dtypes`` (any form :func:`torchrec_ftrl.state_dtype.parse_state_dtypes` takes).

    Raises:
        ValueError: an invalid value; ``optimizer_state_dtypes`` with different dtypes for ``accum``
            and ``linear`` (the dense optimizer stores both in one dtype); both given and different.
    """
    name = parse_one_state_dtype(state_dtype_value, f"{where} state_dtype")
    if optimizer_state_dtypes is None:
        return name
    per_state = parse_state_dtypes(optimizer_state_dtypes, f"{where} optimizer_state_dtypes")
    names = {DTYPE_NAMES[d] for d in per_state.values()}
    if len(names) != 1:
        raise ValueError(f"{where} optimizer_state_dtypes={optimizer_state_dtypes!r} gives accum and linear "
                         f"different dtypes; the dense FTRL stores both in one dtype: pass state_dtype")
    (from_dict,) = names
    if state_dtype_value is not None and from_dict != name:
        raise ValueError(f"{where} has state_dtype={state_dtype_value!r} and optimizer_state_dtypes="
                         f"{optimizer_state_dtypes!r}, which differ; give one of them")
    return from_dict


def _sparse_rows(g: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse COO gradient as (distinct rows int64 ``[U]``, summed row gradients ``[U, D]`` in the
    parameter's math dtype, :func:`state_dtype`).

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


def _check_states(p: torch.Tensor, accum: torch.Tensor, linear: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``accum`` and ``linear`` are in :func:`state_dtype` or (for a
    non-fp64 parameter) bf16."""
    allowed = (state_dtype(p),) if p.dtype == torch.float64 else (torch.float32, torch.bfloat16)
    for name, t in (("accum", accum), ("linear", linear)):
        if t.dtype not in allowed:
            raise ValueError(f"FTRL {name} of a {p.dtype} parameter must be {' or '.join(map(str, allowed))}, "
                             f"got {t.dtype}")


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, -1]`` sharing storage (rows = dim 0; a 0-d/1-D tensor has 1-element rows)."""
    if t.dim() == 0:
        return t.view(1, 1)
    return t.view(t.shape[0], -1)


def _update_rows_compact_(weight: torch.Tensor, accum: torch.Tensor, linear: torch.Tensor,
                          rows: torch.Tensor, grad_rows: torch.Tensor, hp: FTRLHyperparams,
                          math: torch.dtype, step: torch.Tensor) -> None:
    """In place: one FTRL update of ``rows`` (distinct, int64 ``[U]``) of ``[R, D]`` views whose
    ``accum`` and/or ``linear`` are bf16. The states are read (exact upcast) into ``math`` (fp32), the
    rule runs there, and each bf16 state is stored by :func:`torchrec_ftrl.state_dtype.store_state`
    (stochastic rounding seeded by row key = the row index, col = the column ``0..D-1``, ``step`` (int64
    scalar, the step before this update) and state 0 accum / 1 linear); an fp32 state is stored as
    computed."""
    w_new, n_new, z_new = ftrl_rule(weight[rows], accum[rows].to(math), linear[rows].to(math),
                                    grad_rows, hp)
    row_key = rows.unsqueeze(1)
    col = torch.arange(weight.shape[1], dtype=torch.int64, device=weight.device).unsqueeze(0)
    weight[rows] = w_new.to(weight.dtype)
    for target, value, state in ((accum, n_new, 0), (linear, z_new, 1)):
        target[rows] = (store_state(value, target.dtype, row_key, col, step, state)
                        if target.dtype == torch.bfloat16 else value.to(target.dtype))


def ftrl(params: list[torch.Tensor], grads: list[torch.Tensor], accums: list[torch.Tensor],
         linears: list[torch.Tensor], state_steps: list[torch.Tensor], *, hp: FTRLHyperparams,
         skip_zero_grad_rows: bool = True) -> None:
    """Functional FTRL step, in place on ``params``, ``accums`` (n) and ``linears`` (z).

    Args:
        params: parameters, any real float dtype and shape (contiguous); updated in place.
        grads: one gradient per parameter, same shape: dense (strided) or sparse COO (``sparse_dim()
            >= 1``; row-sparse ``sparse_dim() == 1`` from ``nn.Embedding(sparse=True)``).
        accums, linears: tensors of the parameter's shape, updated in place, in :func:`state_dtype`
            (fp64 for fp64 parameters, else fp32: the math runs in that dtype) or, for a non-fp64
            parameter, bf16 (compact state): then the math runs in fp32 on the exact upcast and the
            new value is stored with stochastic rounding
            (:func:`torchrec_ftrl.state_dtype.store_state`), seeded by row key = the row index along
            dim 0 (for a 1-D parameter the element index; a 0-d parameter is row 0), col = the
            flattened column within the row (0 for 1-D / 0-d), step = the parameter's step before
            this update, and state 0 (accum) / 1 (linear). Bitwise reproducible.
        state_steps: scalar step counters, incremented by one each.
        hp: validated hyperparameters.
        skip_zero_grad_rows: for dense gradients, leave rows (slices along dim 0; single elements of a
            1-D parameter) whose gradient is all zero bit-for-bit untouched: row-sparse semantics, the
            twin of the fused TBE (default). False: every element is updated.

    Sparse COO gradients update only the rows they name, duplicate entries summed first
    (``coalesce``), then ONE update per row; with
    ``sparse_dim > 1`` a row is touched when any of its elements is listed.

    Raises:
        ValueError: for a complex/integer parameter, a gradient of another shape, a sparse
            gradient that is not COO with ``sparse_dim >= 1``, or a state of another dtype than the
            above (a bf16 state of an fp64 parameter among them). All gradients and states are
            checked before anything is updated.
    """
    for p, g, n, z in zip(params, grads, accums, linears):
        _check_grad(p, g)
        _check_states(p, n, z)
    for p, g, n, z, step in zip(params, grads, accums, linears, state_steps):
        if torch.bfloat16 in (n.dtype, z.dtype):
            before = step.to(torch.int64)
            step += 1
            if g.is_sparse:
                rows, values = _sparse_rows(g, p)
            else:
                g2 = _rows_view(g)
                rows = (g2 != 0).any(dim=1).nonzero().squeeze(1) if skip_zero_grad_rows else \
                    torch.arange(g2.shape[0], device=g2.device)
                values = g2[rows]
            _update_rows_compact_(_rows_view(p.data), _rows_view(n), _rows_view(z), rows,
                                  values.to(state_dtype(p)), hp, state_dtype(p), before)
            continue
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

    Math is fp64 for fp64 parameters and fp32 for every other dtype (fp32/fp16/bf16); the states are
    stored in that dtype (``state_dtype="fp32"``, the default) or in bf16 (``state_dtype="bf16"``).

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
        state_dtype: storage dtype of ``accum`` and ``linear`` (per group): ``None`` / ``"fp32"`` /
            ``torch.float32`` / ``SparseType.FP32`` (default: fp32, and fp64 for fp64 parameters), or
            ``"bf16"`` / ``torch.bfloat16`` / ``SparseType.BF16``: bf16 states (half the bytes), read
            exactly into fp32, updated in fp32 and stored with stochastic rounding
            (:mod:`torchrec_ftrl.state_dtype`; seeded by row index along dim 0, column within the
            row, the state's step before the update, and the state: bitwise reproducible). bf16 is
            refused for fp64 parameters (their state and math stay fp64). Kept in the group as the
            string ``"fp32"`` or ``"bf16"``. Under ``apply_optimizer_in_backward`` it becomes the
            fused TBE's ``optimizer_state_dtypes`` (both states).
        optimizer_state_dtypes: the ``fused_params`` spelling (any form
            :func:`torchrec_ftrl.state_dtype.parse_state_dtypes` takes), accepted when it gives
            ``accum`` and ``linear`` one dtype, so one dict serves both; with ``state_dtype`` too, the
            two must agree.
        **fused_only: other keys of a ``fused_params`` dict (``optimizer``, ``eps``, ...) are ignored,
            as torchrec's ``RowWiseAdagrad`` does; an unknown ``ftrl_*`` key raises.

    Non-finite gradients are NOT filtered (as in ``torch.optim``; the update is element-wise): an
    element whose gradient is NaN or +-Inf gets a NaN/+Inf ``accum`` and a NaN/+-Inf ``linear``, and
    keeps them (``accum`` only grows), and its weight becomes 0.0 (``|linear| > l1`` is false for
    NaN), NaN, or +-Inf (``ftrl_learning_rate_power = 0``); every other element is updated
    normally. Check gradients (``torch.isfinite``) before :meth:`step` if they can be non-finite. The fused TBE instead skips rows with a non-finite summed
    gradient and counts them (``FTRLTableBatchedEmbeddingBags.nonfinite_grad_rows``).

    State per parameter: ``accum`` (n) and ``linear`` (z), shape of the parameter, in the group's
    state dtype: fp64 for fp64 parameters and fp32 otherwise, or bf16 (``ftrl_initial_accumulator_value``
    rounded to the nearest bf16); kept so by :meth:`load_state_dict`; and ``step`` (float32 scalar
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
                 skip_zero_grad_rows: bool = True, state_dtype: Any = None,
                 optimizer_state_dtypes: Any = None, **kwargs: Any) -> None:
        hp = parse_options({"lr": lr, **kwargs}, where="FTRL(...)")
        name = _dense_state_dtype_option(state_dtype, optimizer_state_dtypes, "FTRL(...)")
        defaults = dict(lr=hp.learning_rate, skip_zero_grad_rows=bool(skip_zero_grad_rows),
                        state_dtype=name, **hp.to_kwargs())
        super().__init__(params, defaults)

    @staticmethod
    def _group_hp(group: dict) -> FTRLHyperparams:
        return parse_options(group, where="param group")

    @staticmethod
    def _group_state_dtype(group: dict, where: str = "param group") -> str:
        """The group's canonical state dtype name, checked against its parameters.

        Raises:
            ValueError: an invalid ``state_dtype``, or ``"bf16"`` for a group with an fp64 parameter.
        """
        name = parse_one_state_dtype(group.get("state_dtype"), f"{where} state_dtype")
        if name == "bf16":
            for i, p in enumerate(group.get("params", ())):
                if isinstance(p, torch.Tensor) and p.dtype == torch.float64:
                    raise ValueError(f"{where} state_dtype='bf16' but parameter {i} is torch.float64; "
                                     f"fp64 parameters keep fp64 state and math (use state_dtype='fp32')")
        return name

    @staticmethod
    def _storage_dtype(p: torch.Tensor, name: str) -> torch.dtype:
        return _STORAGE[name] or state_dtype(p)

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if len(state) == 0:
            dtype = self._storage_dtype(p, group["state_dtype"])
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["accum"] = torch.full(p.shape, group["ftrl_initial_accumulator_value"],
                                        dtype=dtype, device=p.device)
            state["linear"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
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
        if "state_dtype" in param_group or "optimizer_state_dtypes" in param_group:
            param_group = dict(param_group)
            param_group["state_dtype"] = _dense_state_dtype_option(
                param_group.get("state_dtype"), param_group.pop("optimizer_state_dtypes", None),
                "param group")
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        self._group_hp(merged)
        params = param_group["params"]
        if not isinstance(params, set):   # torch.optim raises TypeError for a set
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group = {**param_group, "params": params}
            self._group_state_dtype({**merged, "params": params})
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict`; ``accum``/``linear`` keep their state dtype and, loaded in it, their
        bits (torch's loader would cast them to the parameter dtype).

        The state dtype is part of the optimizer's configuration and is never converted on load: each
        saved group's ``state_dtype`` (``"fp32"`` when the saved group has none, as in state dicts
        written before the knob existed) must equal this optimizer's group's, and a bf16 group's saved
        ``accum`` / ``linear`` must be bf16 tensors. fp32 groups load any float tensor into their
        state dtype (fp32, fp64 for fp64 parameters), as before. To move a run to another state dtype,
        build the optimizer with the new ``state_dtype`` and set ``state[p]["accum"]`` /
        ``["linear"]`` yourself.

        Raises:
            ValueError: an invalid knob in a saved param group, a saved per-parameter state that is
                not empty but lacks an ``accum``, ``linear`` or ``step`` tensor (e.g. another
                optimizer's state), a saved ``accum``/``linear`` whose shape differs from its
                parameter, a saved group ``state_dtype`` other than this optimizer's (naming the
                group and both), a bf16 group's saved state that is not bf16, or (from
                ``torch.optim``) other numbers of groups or parameters. Nothing is modified then.
        """
        saved_groups = [{**g, "state_dtype": parse_one_state_dtype(g.get("state_dtype"),
                                                                     f"saved param group {i} state_dtype")}
                        for i, g in enumerate(state_dict["param_groups"])]
        for g in saved_groups:
            self._group_hp(g)
        saved_state = state_dict["state"]
        id_map, name_of = {}, {}
        if len(saved_groups) == len(self.param_groups):
            for i, (saved_g, own_g) in enumerate(zip(saved_groups, self.param_groups)):
                if saved_g["state_dtype"] != own_g["state_dtype"]:
                    raise ValueError(
                        f"saved param group {i} has state_dtype={saved_g['state_dtype']!r} but this "
                        f"optimizer's group {i} has state_dtype={own_g['state_dtype']!r}; FTRL does not "
                        f"convert its state on load: build it with state_dtype={saved_g['state_dtype']!r}")
                for pid, p in zip(saved_g["params"], own_g["params"]):
                    id_map[pid], name_of[pid] = p, saved_g["state_dtype"]
        for pid, p in id_map.items():
            saved = saved_state.get(pid, {})
            missing = [k for k in (*STATE_NAMES, "step") if saved and not isinstance(saved.get(k), torch.Tensor)]
            if missing:
                raise ValueError(f"saved state of parameter {pid!r} lacks tensor(s) {missing} (has keys "
                                 f"{sorted(saved)}); FTRL state needs 'accum', 'linear' and 'step'")
            for key in STATE_NAMES:
                v = saved.get(key)
                if isinstance(v, torch.Tensor) and v.shape != p.shape:
                    raise ValueError(f"saved {key} of shape {tuple(v.shape)} does not match parameter "
                                     f"shape {tuple(p.shape)}")
                if isinstance(v, torch.Tensor) and name_of[pid] == "bf16" and v.dtype != torch.bfloat16:
                    raise ValueError(f"saved {key} of parameter {pid!r} is {v.dtype} but its group has "
                                     f"state_dtype='bf16'; FTRL does not convert its state on load")
        super().load_state_dict({**state_dict, "param_groups": saved_groups})
        for pid, p in id_map.items():
            dtype = self._storage_dtype(p, name_of[pid])
            for key in STATE_NAMES:
                v = saved_state.get(pid, {}).get(key)
                if isinstance(v, torch.Tensor):
                    self.state[p][key] = v.detach().to(device=p.device, dtype=dtype, copy=True)

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
        for i, group in enumerate(self.param_groups):
            group["state_dtype"] = self._group_state_dtype(group, f"param group {i}")
            for p in group["params"]:
                if p.grad is not None:
                    _check_grad(p, p.grad)
                    state = self.state.get(p)
                    want = self._storage_dtype(p, group["state_dtype"])
                    for key in STATE_NAMES:
                        have = state.get(key) if state else None
                        if isinstance(have, torch.Tensor) and have.dtype != want:
                            raise ValueError(
                                f"param group {i} has state_dtype={group['state_dtype']!r} but a parameter's "
                                f"{key} is {have.dtype}: the state dtype cannot change once the state "
                                f"exists (build a new FTRL)")
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
