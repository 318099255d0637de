"""The dense ``torchrec_ftrl.FTRL`` optimizer against the float64 reference (docs/ftrl.md).

Tolerances: every per-step check feeds the reference the optimizer's own fp32 state from before the
step (exactly representable in float64), so only one step of fp32 rounding is allowed for:
``n`` within 4 ulp, ``z`` within 32 ulp of the sum of magnitudes that make it up, ``w`` within that
error divided by q plus 32 ulp of |w|. Where the reference is in the exact-zero branch with margin,
the optimizer's weight must be exactly +0.0.
"""

import copy

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from torch.overrides import TorchFunctionMode

from reference import ftrl_reference_rows, ftrl_reference_step, option_knobs as ref_knobs
from torchrec_ftrl import FTRL, FTRLHyperparams, ftrl

EPS32 = float(np.finfo(np.float32).eps)
LOW_EPS = {torch.float32: 0.0, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}

def npf(t):
    return t.detach().to(torch.float64).cpu().numpy().copy()


def tolerances(w0, z0, n0, g, knobs):
    """Per-element (tol_z, tol_w_over_q_factor) for one fp32 step, from magnitudes (float64)."""
    p = knobs.get("lr_power", -0.5)
    lr = knobs["lr"]
    s = knobs.get("l2_shrinkage", 0.0)
    n1 = n0 + g * g
    pn_new, pn_old = n1 ** (-p), n0 ** (-p)
    scale_z = np.abs(z0) + np.abs(g) + 2 * s * np.abs(w0) + (pn_new + pn_old) / lr * np.abs(w0)
    tol_z = 32 * EPS32 * scale_z
    L2 = knobs.get("l2", 0.0) * (2.0 if knobs.get("l2_convention", "tensorflow") == "tensorflow" else 1.0)
    q = (knobs.get("beta", 0.0) + pn_new) / lr + L2
    return tol_z, q


def assert_step_matches(before, after, g, knobs, w_dtype=torch.float32, rows=None):
    """``before``/``after`` = (w, z, n) float64 arrays of the optimizer's values; ``g`` float64 summed
    gradient of the touched elements. ``rows`` (optional): the touched row indices (others unchanged)."""
    w0, z0, n0 = before
    w1, z1, n1 = after
    if rows is not None:
        untouched = np.ones(w0.shape[0], dtype=bool)
        untouched[rows] = False
        for a, b in zip(before, after):
            assert np.array_equal(a[untouched], b[untouched]), "untouched rows changed"
        w0, z0, n0, w1, z1, n1 = (x[rows] for x in (w0, z0, n0, w1, z1, n1))
    wr, zr, nr = ftrl_reference_step(w0, z0, n0, g, **knobs)
    tol_z, q = tolerances(w0, z0, n0, g, knobs)
    np.testing.assert_array_less(np.abs(n1 - nr), 4 * EPS32 * nr + 1e-300, err_msg="accum")
    np.testing.assert_array_less(np.abs(z1 - zr), tol_z + 1e-300, err_msg="linear")
    over_q = np.divide(tol_z, q, out=np.zeros_like(tol_z), where=q > 0)  # q == 0: w must be exact
    tol_w = over_q + 32 * EPS32 * np.abs(wr) + LOW_EPS[w_dtype] * np.abs(wr) + 1e-300
    np.testing.assert_array_less(np.abs(w1 - wr), tol_w, err_msg="weight")  # NaN anywhere fails
    l1 = knobs.get("l1", 0.0)
    surely_zero = np.abs(zr) < l1 - tol_z
    assert (w1[surely_zero] == 0.0).all() and not np.signbit(w1[surely_zero]).any(), "not exact +0.0"


def state_arrays(opt, p, n0):
    st_ = opt.state.get(p, {})
    if "accum" not in st_:
        shape = tuple(p.shape)
        return npf(p), np.zeros(shape), np.full(shape, np.float64(np.float32(n0)))
    return npf(p), npf(st_["linear"]), npf(st_["accum"])


# ---------------------------------------------------------------------------------------------
# random shapes and knob values, both conventions

def _knob(lo, hi):
    return st.one_of(st.just(0.0), st.floats(lo, hi))


knob_sets = st.fixed_dictionaries({
    "lr": st.floats(1e-3, 2.0),
    "ftrl_learning_rate_power": st.one_of(st.just(-0.5), st.just(0.0), st.floats(-1.5, -1e-6),
                                          st.floats(-1e-6, 0.0).filter(lambda v: v == 0 or v <= -1.2e-38)),
    "ftrl_l1_reg": _knob(1e-4, 2.0),
    "ftrl_l2_reg": _knob(1e-4, 2.0),
    "ftrl_beta": _knob(1e-4, 2.0),
    "ftrl_l2_shrinkage": _knob(1e-4, 1.0),
    "ftrl_initial_accumulator_value": _knob(1e-3, 1.0),
    "ftrl_l2_convention": st.sampled_from(["tensorflow", "mcmahan"]),
})


@settings(max_examples=60, deadline=None)
@given(kw=knob_sets, shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       steps=st.integers(1, 3), seed=st.integers(0, 2 ** 31 - 1), zero_frac=st.sampled_from([0.0, 0.3]))
def test_dense_matches_reference_random(kw, shape, steps, seed, zero_frac):
    # q == 0 with l2_shrinkage > 0 (beta = l2 = n = g = 0) is a division by zero in the spec itself
    degenerate = (kw["ftrl_l2_shrinkage"] > 0 and kw["ftrl_beta"] == 0 and kw["ftrl_l2_reg"] == 0
                  and kw["ftrl_initial_accumulator_value"] == 0)
    assume(not (degenerate and zero_frac > 0))
    rng = np.random.default_rng(seed)
    p = torch.nn.Parameter(torch.tensor(rng.normal(size=shape), dtype=torch.float32))
    opt = FTRL([p], skip_zero_grad_rows=False, **kw)   # element-wise: zero-gradient elements update too
    knobs = ref_knobs(kw)
    for _ in range(steps):
        g = rng.normal(scale=rng.choice([1e-3, 1.0, 30.0]), size=shape)
        g[rng.random(size=shape) < zero_frac] = 0.0
        p.grad = torch.tensor(g, dtype=torch.float32)
        g = npf(p.grad)
        before = state_arrays(opt, p, kw["ftrl_initial_accumulator_value"])
        opt.step()
        after = state_arrays(opt, p, None)
        assert_step_matches(before, after, g, knobs)
    assert opt.state[p]["step"].item() == steps


def test_multi_step_trajectory_matches_float64():
    """Ten steps, compared with a float64 trajectory run independently from the same start."""
    rng = np.random.default_rng(1)
    kw = dict(lr=0.1, ftrl_l1_reg=0.05, ftrl_l2_reg=0.1, ftrl_beta=0.5, ftrl_l2_shrinkage=0.01,
              ftrl_initial_accumulator_value=0.1)
    w0 = rng.normal(size=(6, 5)).astype(np.float32)
    p = torch.nn.Parameter(torch.tensor(w0))
    opt = FTRL([p], **kw)
    w, z, n = w0.astype(np.float64), np.zeros((6, 5)), np.full((6, 5), np.float64(np.float32(0.1)))
    for _ in range(10):
        g = rng.normal(size=(6, 5)).astype(np.float32)
        p.grad = torch.tensor(g)
        opt.step()
        w, z, n = ftrl_reference_step(w, z, n, g.astype(np.float64), **ref_knobs(kw))
    np.testing.assert_allclose(npf(opt.state[p]["accum"]), n, rtol=1e-5)
    np.testing.assert_allclose(npf(opt.state[p]["linear"]), z, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(npf(p), w, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# sqrt path vs pow path

class _Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.add(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _run(power, steps=3, seed=0, record=False):
    rng = np.random.default_rng(seed)
    p = torch.nn.Parameter(torch.tensor(rng.normal(size=(4, 3)), dtype=torch.float32))
    opt = FTRL([p], lr=0.2, ftrl_learning_rate_power=power, ftrl_l1_reg=0.01)
    calls = _Calls()
    for _ in range(steps):
        p.grad = torch.tensor(rng.normal(size=(4, 3)), dtype=torch.float32)
        if record:
            with calls:
                opt.step()
        else:
            opt.step()
    return p.detach().clone(), calls.names


def test_sqrt_path_for_minus_half_pow_otherwise():
    _, names = _run(-0.5, record=True)
    assert "sqrt" in names and "pow" not in names
    _, names = _run(-0.5000001, record=True)
    assert "pow" in names and "sqrt" not in names


def test_sqrt_and_pow_paths_agree_near_minus_half():
    a, _ = _run(-0.5)
    b, _ = _run(-0.5000001)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("power", [-0.5, -0.5000001, -0.3, 0.0, -1.0, -2.0])
def test_powers_match_reference(power):
    rng = np.random.default_rng(7)
    kw = dict(lr=0.3, ftrl_learning_rate_power=power, ftrl_beta=0.1, ftrl_initial_accumulator_value=0.2)
    p = torch.nn.Parameter(torch.tensor(rng.normal(size=(5, 4)), dtype=torch.float32))
    opt = FTRL([p], **kw)
    for _ in range(3):
        p.grad = torch.tensor(rng.normal(size=(5, 4)), dtype=torch.float32)
        before = state_arrays(opt, p, 0.2)
        opt.step()
        assert_step_matches(before, state_arrays(opt, p, None), npf(p.grad), ref_knobs(kw))


# ---------------------------------------------------------------------------------------------
# each knob alone non-zero: the result matches that knob and is far from the same value on any other

SOLO = {"ftrl_l1_reg": 0.3, "ftrl_l2_reg": 0.7, "ftrl_beta": 0.5, "ftrl_l2_shrinkage": 0.2,
        "ftrl_initial_accumulator_value": 0.25}


def _solo_run(kw):
    rng = np.random.default_rng(3)
    w0 = rng.normal(size=(8, 4)).astype(np.float32)
    gs = [rng.normal(size=(8, 4)).astype(np.float32) for _ in range(2)]
    p = torch.nn.Parameter(torch.tensor(w0))
    opt = FTRL([p], **kw)
    for g in gs:
        p.grad = torch.tensor(g)
        opt.step()
    return w0, gs, npf(p), npf(opt.state[p]["linear"]), npf(opt.state[p]["accum"])


def _ref_run(w0, gs, kw):
    n0 = np.float64(np.float32(kw.get("ftrl_initial_accumulator_value", 0.0)))
    w, z, n = w0.astype(np.float64), np.zeros(w0.shape), np.full(w0.shape, n0)
    for g in gs:
        w, z, n = ftrl_reference_step(w, z, n, g.astype(np.float64), **ref_knobs(kw))
    return w, z, n


@pytest.mark.parametrize("knob", sorted(SOLO))
def test_each_knob_alone(knob):
    kw = {"lr": 0.1, knob: SOLO[knob]}
    w0, gs, w, z, n = _solo_run(kw)
    wr, zr, nr = _ref_run(w0, gs, kw)
    np.testing.assert_allclose(w, wr, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(z, zr, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(n, nr, rtol=1e-6)
    for other in SOLO:
        if other != knob:
            wo, zo, no = _ref_run(w0, gs, {"lr": 0.1, other: SOLO[knob]})
            gap = max(np.abs(wo - w).max(), np.abs(zo - z).max(), np.abs(no - n).max())
            assert gap > 1e-3, f"{knob} indistinguishable from {other}"


# ---------------------------------------------------------------------------------------------
# exact zeros, zero gradients, numerical traps

def test_exact_zeros_under_l1():
    rng = np.random.default_rng(5)
    p = torch.nn.Parameter(torch.tensor(rng.normal(size=(50, 4)), dtype=torch.float32))
    opt = FTRL([p], lr=0.1, ftrl_l1_reg=1.0)
    p.grad = torch.tensor(rng.normal(scale=0.3, size=(50, 4)), dtype=torch.float32)
    before = state_arrays(opt, p, 0.0)
    opt.step()
    w = p.detach()
    _, zr, _ = ftrl_reference_step(*before, npf(p.grad), lr=0.1, l1=1.0)
    inside = np.abs(zr) < 0.99
    assert inside.sum() > 20 and (~inside).sum() > 5  # both branches exercised
    assert (w[torch.tensor(inside)] == 0.0).all()
    assert not torch.signbit(w[torch.tensor(inside)]).any()
    assert (w[torch.tensor(np.abs(zr) > 1.01)] != 0.0).all()


def test_tiny_linear_is_not_truncated():
    # p = 0: z = g; w = -(z - l1 sign z) * lr / (1 + beta); g = 1e-30 is a normal fp32
    p = torch.nn.Parameter(torch.zeros(3))
    opt = FTRL([p], lr=0.5, ftrl_learning_rate_power=0.0, ftrl_l1_reg=1e-31)
    p.grad = torch.tensor([1e-30, -1e-30, 1e-32])
    opt.step()
    w = npf(p)
    assert w[0] < 0 < w[1] and w[2] == 0.0
    np.testing.assert_allclose(w[:2], [-(1e-30 - 1e-31) * 0.5, (1e-30 - 1e-31) * 0.5], rtol=1e-5)


def test_q_zero_gives_no_nan():
    # beta = 0, l2 = 0, n0 = 0, g = 0 -> q = 0, z = 0 -> w exactly 0, no NaN (dense and row paths)
    for skip in (False, True):
        p = torch.nn.Parameter(torch.tensor([[0.5, -0.25], [1.0, 2.0]]))
        opt = FTRL([p], lr=0.1, skip_zero_grad_rows=skip)
        p.grad = torch.tensor([[0.0, 0.0], [0.0, 0.5]])
        opt.step()
        w = p.detach()
        assert torch.isfinite(w).all() and torch.isfinite(opt.state[p]["linear"]).all()
        if skip:
            assert torch.equal(w[0], torch.tensor([0.5, -0.25]))  # untouched row kept
        else:
            assert torch.equal(w[0], torch.zeros(2))
        assert w[1, 0] == 0.0  # touched element with g = 0 in a touched row
        np.testing.assert_allclose(w[1, 1].item(), 2.0 - 0.1, rtol=1e-6)  # w - lr*sign(g)


def test_accum_uses_raw_gradient_with_shrinkage():
    # dyadic values: n + g^2 is exact in fp32; the shrunk gradient g + 2 s w would give another value
    w0 = torch.tensor([0.5, -1.0, 2.0, 0.25])
    g = torch.tensor([0.5, 0.25, -1.5, 0.0])
    p = torch.nn.Parameter(w0.clone())
    opt = FTRL([p], lr=0.5, ftrl_l2_shrinkage=0.75, ftrl_initial_accumulator_value=0.25,
               skip_zero_grad_rows=False)
    p.grad = g.clone()
    opt.step()
    assert torch.equal(opt.state[p]["accum"], 0.25 + g * g)
    gs = g + 2 * 0.75 * w0
    assert not torch.equal(0.25 + gs * gs, 0.25 + g * g)
    before = (w0.double().numpy(), np.zeros(4), np.full(4, 0.25))
    assert_step_matches(before, state_arrays(opt, p, None), g.double().numpy(),
                        dict(lr=0.5, l2_shrinkage=0.75))


def test_zero_gradient_on_touched_element_several_steps():
    rng = np.random.default_rng(11)
    kw = dict(lr=0.2, ftrl_l1_reg=0.02, ftrl_l2_shrinkage=0.1, ftrl_beta=0.1)
    p = torch.nn.Parameter(torch.tensor(rng.normal(size=(6, 3)), dtype=torch.float32))
    opt = FTRL([p], skip_zero_grad_rows=False, **kw)
    for k in range(5):
        g = rng.normal(size=(6, 3)).astype(np.float32)
        if k > 0:
            g[rng.random(size=(6, 3)) < 0.5] = 0.0
        p.grad = torch.tensor(g)
        before = state_arrays(opt, p, 0.0)
        opt.step()
        assert_step_matches(before, state_arrays(opt, p, None), g.astype(np.float64), ref_knobs(kw))


# ---------------------------------------------------------------------------------------------
# sparse gradients, duplicates, skip_zero_grad_rows twin

KW_SPARSE = dict(lr=0.15, ftrl_l1_reg=0.01, ftrl_l2_reg=0.05, ftrl_beta=0.2,
                 ftrl_initial_accumulator_value=0.1)


def _emb_pair(rows=12, dim=4, seed=0):
    torch.manual_seed(seed)
    sp = torch.nn.Embedding(rows, dim, sparse=True)
    de = torch.nn.Embedding(rows, dim, sparse=False)
    de.weight.data.copy_(sp.weight.data)
    return sp, de


@pytest.mark.parametrize("ids", [[3, 7, 1], [3, 3, 7, 3, 1, 7]])
def test_sparse_embedding_matches_reference_and_dense_twin(ids):
    sp, de = _emb_pair()
    o_sp = FTRL(sp.parameters(), **KW_SPARSE)
    o_de = FTRL(de.parameters(), skip_zero_grad_rows=True, **KW_SPARSE)
    rng = np.random.default_rng(2)
    idx = torch.tensor(ids)
    for _ in range(3):
        c = torch.tensor(rng.normal(size=(len(ids), 4)), dtype=torch.float32)
        before = state_arrays(o_sp, sp.weight, 0.1)
        for m, o in ((sp, o_sp), (de, o_de)):
            o.zero_grad()
            (m(idx) * c).sum().backward()
            o.step()
        assert sp.weight.grad.is_sparse and not de.weight.grad.is_sparse
        W, Z, N = ftrl_reference_rows(*before, ids, c.double().numpy(), **ref_knobs(KW_SPARSE))
        after = state_arrays(o_sp, sp.weight, None)
        uniq = sorted(set(ids))
        gsum = np.zeros((12, 4))
        np.add.at(gsum, ids, c.double().numpy())
        assert_step_matches(before, after, gsum[uniq], ref_knobs(KW_SPARSE), rows=uniq)
        # the dense twin with skip_zero_grad_rows: same rows, same values
        twin = state_arrays(o_de, de.weight, None)
        for a, b in zip(after, twin):
            if len(set(ids)) == len(ids):
                assert np.array_equal(a, b)
            else:  # duplicate sums may be added in another order
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(after[0], W, rtol=1e-5, atol=1e-6)


def test_duplicates_summed_not_sequential():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(5, 3, sparse=True)
    opt = FTRL(emb.parameters(), lr=0.1)
    ids = [2, 2, 2]
    c = torch.tensor([[0.5, -0.2, 0.1], [0.3, -0.4, 0.2], [-0.1, -0.3, 0.9]])
    before = state_arrays(opt, emb.weight, 0.0)
    (emb(torch.tensor(ids)) * c).sum().backward()
    opt.step()
    w = npf(emb.weight)
    summed, _, _ = ftrl_reference_rows(*before, ids, c.double().numpy(), lr=0.1)
    seq = before
    for i in range(3):
        seq = ftrl_reference_rows(*seq, [2], c[i:i + 1].double().numpy(), lr=0.1)
    np.testing.assert_allclose(w, summed, rtol=1e-6, atol=1e-7)
    assert np.abs(w[2] - seq[0][2]).max() > 1e-2  # the sequential version would fail the line above
    assert np.array_equal(w[[0, 1, 3, 4]], before[0][[0, 1, 3, 4]])


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_sparse_embedding_bag(mode):
    torch.manual_seed(1)
    bag = torch.nn.EmbeddingBag(10, 3, mode=mode, sparse=True)
    opt = FTRL(bag.parameters(), **KW_SPARSE)
    ids = torch.tensor([1, 4, 4, 9, 1, 2])
    offsets = torch.tensor([0, 3, 3, 5])   # bags [1,4,4], [], [9,1], [2]
    c = torch.tensor([[1.0, -2.0, 0.5], [3.0, 3.0, 3.0], [-0.5, 0.25, 1.0], [0.2, 0.1, -0.3]])
    before = state_arrays(opt, bag.weight, 0.1)
    (bag(ids, offsets) * c).sum().backward()
    opt.step()
    # hand gradient: each id in bag b gets c_b (sum) or c_b / len_b (mean); the empty bag gives nothing
    bags = [[1, 4, 4], [], [9, 1], [2]]
    row_ids, row_g = [], []
    for b, members in enumerate(bags):
        for r in members:
            row_ids.append(r)
            row_g.append(c[b].double().numpy() / (len(members) if mode == "mean" else 1))
    gsum = np.zeros((10, 3))
    np.add.at(gsum, row_ids, np.array(row_g))
    uniq = sorted(set(row_ids))
    assert_step_matches(before, state_arrays(opt, bag.weight, None), gsum[uniq], ref_knobs(KW_SPARSE),
                        rows=uniq)


def test_empty_sparse_gradient_touches_nothing():
    emb = torch.nn.Embedding(4, 2, sparse=True)
    w0 = emb.weight.detach().clone()
    opt = FTRL(emb.parameters(), lr=0.1)
    emb.weight.grad = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 2),
                                              (4, 2), check_invariants=True)
    opt.step()
    assert torch.equal(emb.weight.detach(), w0)
    assert torch.equal(opt.state[emb.weight]["accum"], torch.zeros(4, 2))


def test_skip_zero_grad_rows_is_the_default_on_1d_and_false_updates_all():
    p = torch.nn.Parameter(torch.tensor([0.5, -0.5, 2.0]))
    q = torch.nn.Parameter(torch.tensor([0.5, -0.5, 2.0]))
    o1 = FTRL([p], lr=0.1)
    o2 = FTRL([q], lr=0.1, skip_zero_grad_rows=False)
    assert o1.param_groups[0]["skip_zero_grad_rows"] is True
    for t in (p, q):
        t.grad = torch.tensor([0.0, 1.0, 0.0])
    o1.step()
    o2.step()
    assert p[0].item() == 0.5 and p[2].item() == 2.0            # untouched
    assert q[0].item() == 0.0 and q[2].item() == 0.0            # FTRL recomputes w from z = 0
    np.testing.assert_allclose([p[1].item(), q[1].item()], [-0.6, -0.6], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# low-precision parameters, fp32 state

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sparse", [False, True])
def test_low_precision_params_fp32_state(dtype, sparse):
    torch.manual_seed(4)
    emb = torch.nn.Embedding(8, 4, sparse=sparse).to(dtype)
    kw = dict(lr=0.1, ftrl_l1_reg=0.01, ftrl_initial_accumulator_value=0.1)
    opt = FTRL(emb.parameters(), skip_zero_grad_rows=False, **kw)
    ids = [0, 5, 5, 2]
    rng = np.random.default_rng(0)
    for _ in range(2):
        c = torch.tensor(rng.normal(size=(4, 4)), dtype=dtype)
        before = state_arrays(opt, emb.weight, 0.1)
        opt.zero_grad()
        (emb(torch.tensor(ids)) * c).float().sum().backward()
        gsum = np.zeros((8, 4))
        np.add.at(gsum, ids, c.double().numpy())
        opt.step()
        assert emb.weight.dtype == dtype
        assert opt.state[emb.weight]["accum"].dtype == torch.float32
        assert opt.state[emb.weight]["linear"].dtype == torch.float32
        after = state_arrays(opt, emb.weight, None)
        if sparse:
            assert_step_matches(before, after, gsum[[0, 2, 5]], ref_knobs(kw), w_dtype=dtype,
                                rows=[0, 2, 5])
        else:  # the dense gradient is summed by autograd in `dtype`: take it as given
            assert_step_matches(before, after, npf(emb.weight.grad), ref_knobs(kw), w_dtype=dtype)


def test_fp16_accum_does_not_overflow():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = FTRL([p], lr=0.1)
    p.grad = torch.tensor([300.0, -300.0, 60000.0], dtype=torch.float16)
    opt.step()
    acc = opt.state[p]["accum"]
    assert acc.dtype == torch.float32
    assert acc.tolist() == [90000.0, 90000.0, float(np.float32(60000.0) ** 2)]  # > fp16 max 65504
    assert torch.isfinite(p).all()


# ---------------------------------------------------------------------------------------------
# state_dict round trip

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_state_dict_round_trip_bitwise(dtype):
    rng = np.random.default_rng(9)
    kw = dict(lr=0.05, ftrl_l1_reg=0.02, ftrl_beta=0.3, ftrl_l2_convention="mcmahan", ftrl_l2_reg=0.1)
    a = torch.nn.Parameter(torch.tensor(rng.normal(size=(5, 3))).to(dtype))
    oa = FTRL([a], **kw)
    grads = [torch.tensor(rng.normal(size=(5, 3))).to(dtype) for _ in range(6)]
    for g in grads[:3]:
        a.grad = g.clone()
        oa.step()
    sd = copy.deepcopy(oa.state_dict())
    b = torch.nn.Parameter(a.detach().clone())
    ob = FTRL([b], lr=1.0)  # knobs come from the state dict
    ob.load_state_dict(sd)
    assert ob.param_groups[0]["ftrl_l2_convention"] == "mcmahan" and ob.param_groups[0]["lr"] == 0.05
    for k in ("accum", "linear", "step"):
        assert ob.state[b][k].dtype == oa.state[a][k].dtype == torch.float32
        assert torch.equal(ob.state[b][k], oa.state[a][k])
    for g in grads[3:]:
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b)
    for k in ("accum", "linear", "step"):
        assert torch.equal(ob.state[b][k], oa.state[a][k])


def test_load_state_dict_rejects_bad_shape_and_knob():
    a = torch.nn.Parameter(torch.ones(2, 3))
    oa = FTRL([a], lr=0.1)
    a.grad = torch.ones(2, 3)
    oa.step()
    sd = copy.deepcopy(oa.state_dict())
    b = torch.nn.Parameter(torch.ones(3, 2))
    ob = FTRL([b], lr=0.1)
    with pytest.raises(ValueError, match="accum"):
        ob.load_state_dict(sd)
    assert len(ob.state) == 0
    sd["param_groups"][0]["ftrl_l1_reg"] = -1.0
    c = torch.nn.Parameter(torch.ones(2, 3))
    oc = FTRL([c], lr=0.1)
    with pytest.raises(ValueError, match="ftrl_l1_reg"):
        oc.load_state_dict(sd)
    assert len(oc.state) == 0 and oc.param_groups[0]["ftrl_l1_reg"] == 0.0


# ---------------------------------------------------------------------------------------------
# validation

INVALID = [
    ("lr", 0.0), ("lr", -0.1), ("lr", float("nan")), ("lr", float("inf")),
    ("ftrl_learning_rate_power", 0.1), ("ftrl_learning_rate_power", float("nan")),
    ("ftrl_learning_rate_power", float("-inf")),
] + [(k, v) for k in ("ftrl_l1_reg", "ftrl_l2_reg", "ftrl_beta", "ftrl_l2_shrinkage",
                      "ftrl_initial_accumulator_value")
     for v in (-1e-3, float("nan"), float("inf"))] + [
    ("ftrl_l2_convention", "keras"), ("ftrl_l2_convention", "TensorFlow"),
    # not representable as a normal fp32 (the kernels' precision): would silently become 0 or inf
    ("lr", 1e-300), ("lr", 1e39), ("ftrl_learning_rate_power", -1e-300), ("ftrl_beta", 1e300),
    ("ftrl_l1_reg", 1e-45),
]


@pytest.mark.parametrize("key,value", INVALID)
def test_invalid_knob_raises_naming_it(key, value):
    kw = {"lr": 0.1, key: value}
    name = "lr" if key == "lr" else key
    with pytest.raises(ValueError, match=name) as ei:
        FTRL([torch.nn.Parameter(torch.ones(2))], **kw)
    assert repr(value) in str(ei.value)


@pytest.mark.parametrize("key", ["ftrl_l1", "ftrl_learning_rate", "ftrl_lambda2", "ftrl_l2_regularization"])
def test_misspelled_ftrl_key_raises(key):
    with pytest.raises(ValueError, match=key):
        FTRL([torch.nn.Parameter(torch.ones(2))], lr=0.1, **{key: 0.1})


def test_learning_rate_alias():
    p = torch.nn.Parameter(torch.ones(2))
    assert FTRL([p], learning_rate=0.3).param_groups[0]["lr"] == 0.3
    with pytest.raises(ValueError, match="learning_rate"):
        FTRL([p], lr=0.1, learning_rate=0.2)


def test_unknown_fused_only_keys_ignored():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    rng = np.random.default_rng(0)
    w0 = torch.tensor(rng.normal(size=(4, 2)), dtype=torch.float32)
    g = torch.tensor(rng.normal(size=(4, 2)), dtype=torch.float32)
    out = []
    for extra in ({}, {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "eps": 1e-8,
                       "weight_decay": 0.5, "momentum": 0.9, "stochastic_rounding": True}):
        p = torch.nn.Parameter(w0.clone())
        opt = FTRL([p], lr=0.1, ftrl_l1_reg=0.01, **extra)
        p.grad = g.clone()
        opt.step()
        out.append(p.detach())
    assert torch.equal(out[0], out[1])


def test_invalid_param_group_not_added():
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = FTRL([p], lr=0.1)
    for bad in ({"ftrl_beta": -1.0}, {"lr": 0.0}, {"ftrl_betta": 1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            opt.add_param_group({"params": [q], **bad})
        assert len(opt.param_groups) == 1


def test_failing_step_modifies_nothing():
    p = torch.nn.Parameter(torch.ones(3, 2))
    c = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))
    opt = FTRL([p, c], lr=0.1)
    p.grad = torch.ones(3, 2)
    c.grad = torch.ones(2, dtype=torch.complex64)
    with pytest.raises(ValueError, match="complex64"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3, 2)) and len(opt.state) == 0
    c.grad = None
    opt.param_groups[0]["ftrl_l2_reg"] = float("nan")  # edited group, caught at step
    with pytest.raises(ValueError, match="ftrl_l2_reg"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3, 2)) and len(opt.state) == 0


def test_element_sparse_gradient_touches_listed_rows():
    # sparse_dim 2 (as KeyedOptimizer.init_state makes): rows with any listed element are touched,
    # their unlisted elements take g = 0
    w0 = torch.tensor([[0.5, -1.0, 2.0], [1.0, 1.0, 1.0], [-0.5, 0.25, 3.0], [2.0, -2.0, 0.5]])
    p = torch.nn.Parameter(w0.clone())
    opt = FTRL([p], lr=0.1, ftrl_initial_accumulator_value=0.1)
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 1, 3, 1], [0, 2, 1, 0]]),
                                     torch.tensor([0.5, -0.3, 0.2, 0.25]), (4, 3), check_invariants=True)
    before = state_arrays(opt, p, 0.1)
    opt.step()
    g = np.array([[0.75, 0.0, -0.3], [0.0, 0.2, 0.0]])
    assert_step_matches(before, state_arrays(opt, p, None), g, dict(lr=0.1), rows=[1, 3])


# ---------------------------------------------------------------------------------------------
# param groups, functional API, KeyedOptimizerWrapper

def test_param_groups_with_different_knobs():
    rng = np.random.default_rng(6)
    a = torch.nn.Parameter(torch.tensor(rng.normal(size=(4, 3)), dtype=torch.float32))
    b = torch.nn.Parameter(torch.tensor(rng.normal(size=(5,)), dtype=torch.float32))
    g_kw = [dict(lr=0.1, ftrl_l1_reg=0.05),
            dict(lr=0.3, ftrl_l2_reg=0.5, ftrl_l2_convention="mcmahan", ftrl_learning_rate_power=-0.7,
                 ftrl_initial_accumulator_value=0.5)]
    opt = FTRL([{"params": [a]}, {"params": [b], **{k: v for k, v in g_kw[1].items()}}], **g_kw[0])
    for _ in range(2):
        a.grad = torch.tensor(rng.normal(size=(4, 3)), dtype=torch.float32)
        b.grad = torch.tensor(rng.normal(size=(5,)), dtype=torch.float32)
        before = [state_arrays(opt, a, 0.0), state_arrays(opt, b, 0.5)]
        opt.step()
        # group 1 inherits the constructor's ftrl_l1_reg (torch param-group semantics)
        for t, bf, kw in zip((a, b), before, (g_kw[0], {**g_kw[0], **g_kw[1]})):
            assert_step_matches(bf, state_arrays(opt, t, None), npf(t.grad), ref_knobs(kw))


def test_functional_ftrl():
    hp = FTRLHyperparams(0.05, l1_reg=0.1)
    w = torch.tensor([0.7, 0.7, -1.0])
    n, z, step = torch.zeros(3), torch.zeros(3), torch.tensor(0.0)
    ftrl([w], [torch.tensor([-0.3, -0.3, 0.0])], [n], [z], [step], hp=hp, skip_zero_grad_rows=False)
    # first-step hand case: z = -4.5, q = 6 -> w = (-0.1 + 4.5)/6; g = 0 element: z = 0 -> w = 0
    np.testing.assert_allclose(w.tolist(), [4.4 / 6, 4.4 / 6, 0.0], rtol=1e-6)
    assert step.item() == 1.0
    # the default (row-sparse): the zero-gradient element keeps weight, accum and linear
    w, n, z = torch.tensor([0.7, 0.7, -1.0]), torch.zeros(3), torch.zeros(3)
    ftrl([w], [torch.tensor([-0.3, -0.3, 0.0])], [n], [z], [step], hp=hp)
    np.testing.assert_allclose(w.tolist(), [4.4 / 6, 4.4 / 6, -1.0], rtol=1e-6)
    assert n.tolist()[2] == 0.0 and z.tolist()[2] == 0.0 and step.item() == 2.0


def test_keyed_optimizer_wrapper_round_trip():
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    rng = np.random.default_rng(8)
    kw = dict(lr=0.1, ftrl_l1_reg=0.01, ftrl_beta=1.0)

    def build():
        torch.manual_seed(0)
        m = torch.nn.ModuleDict({"emb": torch.nn.Embedding(6, 3, sparse=True), "lin": torch.nn.Linear(3, 1)})
        ko = KeyedOptimizerWrapper(dict(m.named_parameters()), lambda ps: FTRL(ps, skip_zero_grad_rows=True,
                                                                               **kw))
        return m, ko

    def train(m, ko, ids, y):
        ko.zero_grad()
        out = m["lin"](m["emb"](ids)).squeeze(-1)
        ((out - y) ** 2).sum().backward()
        ko.step()

    batches = [(torch.tensor(rng.integers(0, 6, size=4)), torch.tensor(rng.normal(size=4), dtype=torch.float32))
               for _ in range(5)]
    m1, k1 = build()
    w_emb0 = m1["emb"].weight.detach().clone()
    k1.init_state({"emb.weight"})
    assert torch.equal(m1["emb"].weight.detach(), w_emb0)  # empty sparse grad: rows untouched
    for ids, y in batches[:2]:
        train(m1, k1, ids, y)
    sd = k1.state_dict()
    assert set(sd["state"]) == {"emb.weight", "lin.weight", "lin.bias"}
    assert set(sd["state"]["emb.weight"]) == {"accum", "linear", "step"}
    sd = copy.deepcopy(sd)
    m2, k2 = build()
    m2.load_state_dict(m1.state_dict())
    k2.init_state({"emb.weight"})
    k2.load_state_dict(sd)
    for ids, y in batches[2:]:
        train(m1, k1, ids, y)
        train(m2, k2, ids, y)
    for (n1, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(p1, p2), n1
    s1, s2 = k1.state_dict()["state"], k2.state_dict()["state"]
    for name in s1:
        for k in ("accum", "linear", "step"):
            assert torch.equal(s1[name][k], s2[name][k])


def test_apply_optimizer_in_backward_with_fused_kwargs():
    """One kwargs dict (fused_params spelling, fused-only keys included) drives the in-backward path."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    kwargs = {"learning_rate": 0.1, "ftrl_l1_reg": 0.01, "ftrl_initial_accumulator_value": 0.1,
              "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD}
    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 3, sparse=True)
    apply_optimizer_in_backward(FTRL, emb.parameters(), kwargs)
    before = (npf(emb.weight), np.zeros((6, 3)), np.full((6, 3), np.float64(np.float32(0.1))))
    c = torch.tensor([[1.0, -0.5, 0.25], [0.5, 0.5, -1.0]])
    (emb(torch.tensor([4, 1])) * c).sum().backward()   # the update happens inside backward
    (opt,) = emb.weight._in_backward_optimizers
    after = state_arrays(opt, emb.weight, None)
    assert_step_matches(before, after, c.double().numpy()[[1, 0]], dict(lr=0.1, l1=0.01), rows=[1, 4])


def test_embedding_table_rows_absent_from_the_batch_keep_their_bits():
    """The default on a ``[rows, D]`` table with a dense gradient (a data-parallel table): rows that
    no lookup touched keep weight, accum and linear bit for bit; touched rows match float64."""
    torch.manual_seed(2)
    emb = torch.nn.Embedding(10, 3)                     # dense gradient
    kw = dict(lr=0.2, ftrl_l1_reg=0.01, ftrl_beta=0.5, ftrl_l2_shrinkage=0.05)
    opt = FTRL(emb.parameters(), **kw)
    ids = torch.tensor([1, 4, 4, 7])
    c = torch.tensor(np.random.default_rng(3).normal(size=(4, 3)), dtype=torch.float32)
    w0 = emb.weight.detach().clone()
    (emb(ids) * c).sum().backward()
    opt.step()
    untouched = [r for r in range(10) if r not in (1, 4, 7)]
    assert torch.equal(emb.weight.detach()[untouched], w0[untouched])
    assert torch.equal(opt.state[emb.weight]["accum"][untouched], torch.zeros(len(untouched), 3))
    assert torch.equal(opt.state[emb.weight]["linear"][untouched], torch.zeros(len(untouched), 3))
    g = np.zeros((10, 3))
    np.add.at(g, ids.numpy(), c.double().numpy())
    w, z, n = ftrl_reference_step(w0.double().numpy()[[1, 4, 7]], np.zeros((3, 3)), np.zeros((3, 3)),
                                  g[[1, 4, 7]], **ref_knobs(kw))
    np.testing.assert_allclose(npf(emb.weight)[[1, 4, 7]], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(npf(opt.state[emb.weight]["linear"])[[1, 4, 7]], z, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(npf(opt.state[emb.weight]["accum"])[[1, 4, 7]], n, rtol=1e-6)


@pytest.mark.parametrize("sparse", [False, True])
def test_fp64_parameters_keep_fp64_state_and_math(sparse):
    """fp64 parameters: accum/linear are fp64 and the step matches the float64 reference to fp64
    precision (an fp32 computation misses by ~1e-7 relative)."""
    rng = np.random.default_rng(5)
    emb = torch.nn.Embedding(6, 4, sparse=sparse).double()
    kw = dict(lr=0.3, ftrl_l1_reg=1e-3, ftrl_l2_reg=0.02, ftrl_beta=0.7, ftrl_l2_shrinkage=0.01,
              ftrl_initial_accumulator_value=0.1)
    opt = FTRL(emb.parameters(), **kw)
    ids = [0, 3, 3, 5]
    w, z, n = emb.weight.detach().numpy().copy(), np.zeros((6, 4)), np.full((6, 4), 0.1)
    for _ in range(3):
        c = rng.normal(size=(4, 4))
        opt.zero_grad()
        (emb(torch.tensor(ids)) * torch.tensor(c)).sum().backward()
        opt.step()
        g = np.zeros((6, 4))
        np.add.at(g, ids, c)
        rows = [0, 3, 5]
        w[rows], z[rows], n[rows] = ftrl_reference_step(w[rows], z[rows], n[rows], g[rows], **ref_knobs(kw))
    state = opt.state[emb.weight]
    assert state["accum"].dtype == torch.float64 and state["linear"].dtype == torch.float64
    np.testing.assert_allclose(emb.weight.detach().numpy(), w, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(state["linear"].numpy(), z, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(state["accum"].numpy(), n, rtol=1e-12, atol=1e-15)
    # a state dict round trip keeps fp64
    opt2 = FTRL(emb.parameters(), **kw)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[emb.weight]["accum"].dtype == torch.float64
    assert torch.equal(opt2.state[emb.weight]["linear"], state["linear"])
