"""Property (hypothesis) tests of the dense ``torchrec_ftrl.FTRL`` under bad input: hyperparameters,
gradients, corrupt or mismatched ``load_state_dict`` input, and non-finite gradients.

Every failing call must raise ``ValueError`` naming the argument and leave parameters, states and
param groups bitwise unchanged (snapshot before, compare after). Validity of a knob is decided here
from ``docs/ftrl.md`` (lr > 0, power <= 0, others >= 0, finite, 0 or a normal fp32 magnitude),
and finite updates are checked against the float64 reference (``tests/reference.py``).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import bits
from knob_rules import ANY_VALUE, assert_valid_or_named_error, valid_knob
from reference import ftrl_reference_step, option_knobs
from torchrec_ftrl import FTRL

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------------------------------ helpers
KNOBS = ("lr", "ftrl_learning_rate_power", "ftrl_l1_reg", "ftrl_l2_reg", "ftrl_beta",
         "ftrl_l2_shrinkage", "ftrl_initial_accumulator_value")


def _snapshot(opt: FTRL):
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    state = {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                     for k, v in s.items()} for p, s in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return params, state, groups


def _assert_unchanged(before, after):
    (p0, s0, g0), (p1, s1, g1) = before, after
    assert len(p0) == len(p1) and all(torch.equal(bits(a), bits(b)) for a, b in zip(p0, p1))
    assert s0.keys() == s1.keys()
    for pid in s0:
        assert s0[pid].keys() == s1[pid].keys()
        for k in s0[pid]:
            a, b = s0[pid][k], s1[pid][k]
            assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), k
    assert repr(g0) == repr(g1)


def _trained(seed=0, **kw):
    """An optimizer over two parameters ([5, 3] fp32 and [4] fp16) after two steps."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.rand(5, 3, generator=g) - 0.5),
          torch.nn.Parameter((torch.rand(4, generator=g) - 0.5).half())]
    opt = FTRL(ps, lr=0.1, ftrl_l1_reg=0.01, ftrl_beta=0.5, **kw)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()
    return opt, ps


# ---------------------------------------------------------------------------------- hyperparameters
@SETTINGS
@given(knobs=st.dictionaries(st.sampled_from(KNOBS), ANY_VALUE, min_size=1, max_size=3))
def test_constructor_knobs_valid_or_clear_error(knobs):
    p = torch.nn.Parameter(torch.zeros(2))
    default_lr = "lr" in knobs and knobs["lr"] is None     # FTRL(lr=None): the documented default
    rules = {k: v for k, v in knobs.items() if not (k == "lr" and default_lr)}
    opt = assert_valid_or_named_error(lambda **kw: FTRL([p], **({"lr": None} if default_lr else {}), **kw),
                                      rules)
    if opt is not None:
        assert opt.param_groups[0]["lr"] == float(rules.get("lr", 0.01))


@SETTINGS
@given(knob=st.sampled_from(KNOBS), value=ANY_VALUE, where=st.sampled_from(["step", "add_param_group"]))
def test_edited_group_or_new_group_with_bad_knob_changes_nothing(knob, value, where):
    opt, ps = _trained()
    for p in ps:
        p.grad = torch.ones_like(p)
    before = _snapshot(opt)
    if where == "step":
        opt.param_groups[0][knob] = value
        if valid_knob(knob, value):
            opt.step()
            return
        with pytest.raises(ValueError, match=knob.replace("lr", "learning_rate") if knob == "lr" else knob):
            opt.step()
        opt.param_groups[0][knob] = before[2][0][knob]          # undo the edit before comparing
    else:
        extra = torch.nn.Parameter(torch.zeros(3))
        if valid_knob(knob, value):
            opt.add_param_group({"params": [extra], knob: value})
            return
        with pytest.raises(ValueError, match="learning_rate" if knob == "lr" else knob):
            opt.add_param_group({"params": [extra], knob: value})
    _assert_unchanged(before, _snapshot(opt))


# ---------------------------------------------------------------------------------------- gradients
BAD_GRADS = {
    "shape": (lambda p: torch.ones(p.shape[0] + 1, *p.shape[1:], dtype=p.dtype), "gradient shape"),
    "csr_layout": (lambda p: torch.ones(p.shape[0], 2, dtype=p.dtype).to_sparse_csr()
                   if p.dim() == 1 else torch.ones(p.shape, dtype=p.dtype).to_sparse_csr(), "layout"),
    "sparse_dim0": (lambda p: torch.sparse_coo_tensor(torch.zeros(0, 1, dtype=torch.long),
                                                      torch.ones(1, *p.shape), p.shape).to(p.dtype),
                    "sparse_dim"),
    "sparse_shape": (lambda p: torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, *p.shape[1:]),
                                                       (p.shape[0] + 2, *p.shape[1:])).to(p.dtype),
                     "gradient shape"),
}


@SETTINGS
@given(kind=st.sampled_from(sorted(BAD_GRADS)), which=st.integers(0, 1), seed=st.integers(0, 2 ** 16))
def test_functional_ftrl_bad_gradient_changes_nothing(kind, which, seed):
    """``ftrl()`` (what ``step`` calls) checks every gradient before touching any tensor."""
    from torchrec_ftrl.optim import ftrl
    opt, ps = _trained(seed)
    make, match = BAD_GRADS[kind]
    grads = [torch.ones_like(p) for p in ps]
    if kind == "csr_layout" and ps[which].dim() == 1:
        which = 0
    grads[which] = make(ps[which])
    st_ = [opt.state[p] for p in ps]
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=match):
        ftrl([p.data for p in ps], grads, [s["accum"] for s in st_], [s["linear"] for s in st_],
             [s["step"] for s in st_], hp=FTRL._group_hp(opt.param_groups[0]))
    _assert_unchanged(before, _snapshot(opt))


@SETTINGS
@given(which=st.integers(0, 1), seed=st.integers(0, 2 ** 16))
def test_step_with_bad_sparse_gradient_changes_nothing(which, seed):
    opt, ps = _trained(seed)
    for p in ps:
        p.grad = torch.ones_like(p)
    ps[which].grad = BAD_GRADS["sparse_dim0"][0](ps[which])
    before = _snapshot(opt)
    with pytest.raises(ValueError, match="sparse_dim"):
        opt.step()
    _assert_unchanged(before, _snapshot(opt))


def test_integer_parameter_is_rejected_before_anything_changes():
    opt, ps = _trained()
    q = torch.zeros(3, dtype=torch.int64)
    opt.add_param_group({"params": [q]})
    q.grad = torch.ones(3, dtype=torch.int64)
    for p in ps:
        p.grad = torch.ones_like(p)
    before = _snapshot(opt)
    with pytest.raises(ValueError, match="real floating-point parameters, got dtype torch.int64"):
        opt.step()
    _assert_unchanged(before, _snapshot(opt))


# ------------------------------------------------------------------------------ load_state_dict
def _corruptions():
    def set_state(pid, key, value):
        def f(sd):
            sd["state"][pid][key] = value
        return f

    def drop(pid, key):
        def f(sd):
            del sd["state"][pid][key]
        return f

    def group(key, value):
        def f(sd):
            sd["param_groups"][0][key] = value
        return f

    def other_opt(sd):
        p = torch.nn.Parameter(torch.zeros(5, 3))
        q = torch.nn.Parameter(torch.zeros(4))
        a = torch.optim.Adagrad([p, q], lr=0.1)
        p.grad, q.grad = torch.ones(5, 3), torch.ones(4)
        a.step()
        sd.clear()
        sd.update(a.state_dict())

    def two_groups(sd):
        g = copy.deepcopy(sd["param_groups"][0])
        sd["param_groups"][0]["params"] = [0]
        g["params"] = [1]
        sd["param_groups"].append(g)

    def more_params(sd):
        sd["param_groups"][0]["params"].append(2)

    return {
        "accum_shape": (set_state(0, "accum", torch.zeros(3, 5)), "saved accum of shape"),
        "linear_shape": (set_state(1, "linear", torch.zeros(5)), "saved linear of shape"),
        "accum_missing": (drop(0, "accum"), "lacks tensor"),
        "linear_missing": (drop(1, "linear"), "lacks tensor"),
        "step_missing": (drop(0, "step"), "lacks tensor"),
        "accum_not_tensor": (set_state(0, "accum", [[0.0] * 3] * 5), "lacks tensor"),
        "adagrad_state": (other_opt, "lacks tensor"),
        "negative_lr": (group("lr", -1.0), "learning_rate"),
        "nan_l1": (group("ftrl_l1_reg", float("nan")), "ftrl_l1_reg"),
        "positive_power": (group("ftrl_learning_rate_power", 0.5), "ftrl_learning_rate_power"),
        "bad_convention": (group("ftrl_l2_convention", "keras"), "ftrl_l2_convention"),
        "unknown_ftrl_key": (group("ftrl_l3_reg", 0.1), r"unknown FTRL key.*ftrl_l3_reg"),
        "two_groups": (two_groups, "number of parameter groups"),
        "more_params": (more_params, "size"),
    }


CORRUPTIONS = _corruptions()


@SETTINGS
@given(kind=st.sampled_from(sorted(CORRUPTIONS)), seed=st.integers(0, 2 ** 16))
def test_corrupt_state_dict_raises_and_changes_nothing(kind, seed):
    src, _ = _trained(seed)
    sd = copy.deepcopy(src.state_dict())
    corrupt, match = CORRUPTIONS[kind]
    corrupt(sd)
    dst, _ = _trained(seed + 1)
    before = _snapshot(dst)
    with pytest.raises(ValueError, match=match):
        dst.load_state_dict(sd)
    _assert_unchanged(before, _snapshot(dst))


def test_valid_state_dict_still_loads_after_a_failed_load():
    src, _ = _trained(3)
    dst, _ = _trained(4)
    bad = copy.deepcopy(src.state_dict())
    del bad["state"][0]["accum"]
    with pytest.raises(ValueError):
        dst.load_state_dict(bad)
    dst.load_state_dict(src.state_dict())
    for p_src, p_dst in zip(src.state, dst.state):
        for k in ("accum", "linear"):
            assert torch.equal(bits(src.state[p_src][k]), bits(dst.state[p_dst][k]))


# ---------------------------------------------------------------------------- non-finite gradients
MODERATE = st.fixed_dictionaries({
    "lr": st.sampled_from([0.01, 0.1, 0.5]),
    "ftrl_learning_rate_power": st.sampled_from([-0.5, -0.3, 0.0]),
    "ftrl_l1_reg": st.sampled_from([0.0, 0.01]),
    "ftrl_l2_reg": st.sampled_from([0.0, 0.05]),
    "ftrl_beta": st.sampled_from([0.0, 1.0]),
    "ftrl_l2_shrinkage": st.sampled_from([0.0, 0.1]),
    "ftrl_initial_accumulator_value": st.sampled_from([0.0, 0.1]),
})


@SETTINGS
@given(knobs=MODERATE, rows=st.integers(1, 6), dim=st.integers(1, 4), seed=st.integers(0, 2 ** 16),
       bad=st.sampled_from([math.nan, math.inf, -math.inf]),
       mode=st.sampled_from(["dense", "dense_skip_zero_rows", "sparse_rows"]))
def test_nonfinite_gradient_policy(knobs, rows, dim, seed, bad, mode):
    """Documented in ``FTRL``: non-finite gradient elements poison only their own element (accum and
    linear non-finite, weight 0 or non-finite); every other element follows the float64 reference."""
    rng = np.random.default_rng(seed)
    w0 = rng.uniform(-0.5, 0.5, (rows, dim)).astype(np.float32)
    g = rng.normal(size=(rows, dim)).astype(np.float32)
    mask = rng.random((rows, dim)) < 0.3
    mask.flat[rng.integers(mask.size)] = True
    g[mask] = bad
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = FTRL([p], skip_zero_grad_rows=(mode == "dense_skip_zero_rows"), **knobs)
    if mode == "sparse_rows":
        idx = torch.arange(rows).unsqueeze(0)
        p.grad = torch.sparse_coo_tensor(idx, torch.from_numpy(g), (rows, dim))
    else:
        p.grad = torch.from_numpy(g)
    opt.step()
    n0 = knobs["ftrl_initial_accumulator_value"]
    gf = np.where(mask, 0.0, g)
    w_ref, z_ref, n_ref = ftrl_reference_step(w0, np.zeros_like(w0), np.full_like(w0, n0), gf,
                                              **option_knobs(knobs))
    w, z, n = p.detach().numpy(), opt.state[p]["linear"].numpy(), opt.state[p]["accum"].numpy()
    assert not np.isfinite(n[mask]).any() and not np.isfinite(z[mask]).any()
    assert ((w[mask] == 0) | ~np.isfinite(w[mask])).all()
    ok = ~mask
    np.testing.assert_allclose(n[ok], n_ref[ok], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(z[ok], z_ref[ok], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(w[ok], w_ref[ok], rtol=1e-4, atol=1e-5)
