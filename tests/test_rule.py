"""``torchrec_ftrl.rule``, the one statement of the FTRL update on tensors (used by the dense optimizer
and the TBE's PyTorch backend), in float64 against the float64 reference (tests/reference.py): the
argument and result order ``(w, accum, linear)``, and the row update's non-finite policy."""

import math

import numpy as np
import pytest
import torch

from reference import (ftrl_reference_rows, ftrl_reference_step, ftrl_reference_step_rowwise,
                       ftrl_reference_weight, reference_knobs)
from torchrec_ftrl import FTRLHyperparams
from torchrec_ftrl.rule import ftrl_prox, ftrl_rule, ftrl_rule_rowwise, ftrl_update_rows_

HPS = [FTRLHyperparams(0.1), FTRLHyperparams(0.05, l1_reg=0.02, l2_reg=0.1, beta=0.5),
       FTRLHyperparams(0.3, learning_rate_power=-0.3, l2_shrinkage=0.2, l2_convention="mcmahan"),
       FTRLHyperparams(0.2, learning_rate_power=0.0, l1_reg=0.5, initial_accumulator_value=0.1)]


@pytest.mark.parametrize("hp", HPS, ids=range(len(HPS)))
def test_rule_matches_reference_in_float64(hp):
    rng = np.random.default_rng(0)
    w, n, z, g = (rng.normal(size=(6, 5)), rng.uniform(0, 2, (6, 5)), rng.normal(size=(6, 5)),
                  rng.normal(size=(6, 5)))
    g[0] = 0.0                                            # touched elements with a zero gradient
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    w1, n1, z1 = ftrl_rule(t(w), t(n), t(z), t(g), hp)    # (w, accum, linear) in and out
    wr, zr, nr = ftrl_reference_step(w, z, n, g, **reference_knobs(hp))
    assert w1.dtype == n1.dtype == z1.dtype == torch.float64
    np.testing.assert_allclose(n1.numpy(), nr, rtol=1e-14)
    np.testing.assert_allclose(z1.numpy(), zr, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(w1.numpy(), wr, rtol=1e-12, atol=1e-12)
    zero = wr == 0.0
    assert (w1.numpy()[zero] == 0.0).all() and not np.signbit(w1.numpy()[zero]).any()


@pytest.mark.parametrize("hp", HPS, ids=range(len(HPS)))
def test_weight_from_state_is_the_reference_step_with_zero_gradient(hp):
    """ftrl_prox(z, n) is the weight a step with g = 0 leaves (no shrinkage: z and n unchanged),
    in float64, and in fp32 for fp32 and bf16 states."""
    rng = np.random.default_rng(1)
    n, z = rng.uniform(0, 2, (6, 5)), rng.normal(size=(6, 5))
    z[0, :2] = hp.l1_reg                                  # |z| == l1: exactly 0
    knobs = {**reference_knobs(hp), "l2_shrinkage": 0.0}
    wr, zr, nr = ftrl_reference_step(rng.normal(size=(6, 5)), z, n, np.zeros((6, 5)), **knobs)
    assert np.array_equal(zr, z) and np.array_equal(nr, n)
    w64 = ftrl_prox(torch.tensor(z), torch.tensor(n), hp)
    assert w64.dtype == torch.float64
    np.testing.assert_allclose(w64.numpy(), wr, rtol=1e-12, atol=1e-15)
    assert (w64[0, :2] == 0).all()
    for dtype in (torch.float32, torch.bfloat16):
        nt, zt = torch.tensor(n).to(dtype), torch.tensor(z).to(dtype)
        w = ftrl_prox(zt, nt, hp)
        assert w.dtype == torch.float32
        wr, _, _ = ftrl_reference_step(np.zeros((6, 5)), zt.double().numpy(), nt.double().numpy(),
                                       np.zeros((6, 5)), **knobs)
        np.testing.assert_allclose(w.double().numpy(), wr, rtol=2e-6, atol=1e-7)


def test_rule_computes_in_the_states_dtype():
    hp = HPS[1]
    w = torch.tensor([0.5, -0.25], dtype=torch.float16)
    g = torch.tensor([0.125, 1.0], dtype=torch.bfloat16)
    w1, n1, z1 = ftrl_rule(w, torch.zeros(2), torch.zeros(2), g, hp)
    assert w1.dtype == n1.dtype == z1.dtype == torch.float32
    wr, zr, nr = ftrl_reference_step(w.double().numpy(), np.zeros(2), np.zeros(2), g.double().numpy(),
                                     **reference_knobs(hp))
    np.testing.assert_allclose(w1.double().numpy(), wr, rtol=1e-6)


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_update_rows_in_place(skip_nonfinite):
    hp = HPS[1]
    rng = np.random.default_rng(1)
    W, N, Z = rng.normal(size=(8, 3)), rng.uniform(0, 1, (8, 3)), rng.normal(size=(8, 3))
    weight, accum, linear = (torch.tensor(a, dtype=torch.float64) for a in (W, N, Z))
    rows = torch.tensor([6, 1, 3])
    grads = torch.tensor(rng.normal(size=(3, 3)))
    if skip_nonfinite:
        grads[1, 2] = math.nan                            # row 1 skipped, bits unchanged
    ok = ftrl_update_rows_(weight, accum, linear, rows, grads, hp, skip_nonfinite=skip_nonfinite)
    assert ok.tolist() == ([True, False, True] if skip_nonfinite else [True, True, True])
    kept = rows[ok].numpy()
    wr, zr, nr = ftrl_reference_rows(W, Z, N, kept, grads[ok].numpy(), **reference_knobs(hp))
    np.testing.assert_allclose(weight.numpy(), wr, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(accum.numpy(), nr, rtol=1e-14)
    np.testing.assert_allclose(linear.numpy(), zr, rtol=1e-12, atol=1e-12)
    untouched = np.setdiff1d(np.arange(8), kept)
    for now, before in ((weight, W), (accum, N), (linear, Z)):
        assert np.array_equal(now.numpy()[untouched], before[untouched])


@pytest.mark.parametrize("hp", HPS, ids=range(len(HPS)))
def test_prox_is_the_weight_of_the_state(hp):
    """ftrl_prox(z, n) against the float64 reference, and equal, bit for bit in fp32, to the weight the
    element rule stores: the basis of the derived-weights layout."""
    rng = np.random.default_rng(2)
    z, n = rng.normal(size=(7, 5)), rng.uniform(0, 2, (7, 5))
    z[0, :2] = 0.0
    n[1] = 0.0
    w = ftrl_prox(torch.tensor(z), torch.tensor(n), hp)
    np.testing.assert_allclose(w.numpy(), ftrl_reference_weight(z, n, **reference_knobs(hp)), rtol=1e-12,
                               atol=1e-300)
    w0, n0, z0, g = (torch.tensor(a, dtype=torch.float32) for a in
                     (rng.normal(size=(7, 5)), rng.uniform(0, 2, (7, 5)), rng.normal(size=(7, 5)),
                      rng.normal(size=(7, 5))))
    w1, n1, z1 = ftrl_rule(w0, n0, z0, g, hp)
    assert torch.equal(w1.view(torch.int32), ftrl_prox(z1, n1, hp).view(torch.int32))


@pytest.mark.parametrize("hp", HPS, ids=range(len(HPS)))
def test_rowwise_rule_matches_reference(hp):
    rng = np.random.default_rng(3)
    w, z, g = rng.normal(size=(4, 6)), rng.normal(size=(4, 6)), rng.normal(size=(4, 6))
    n = rng.uniform(0, 2, 4)
    g[1] = 0.0                                              # a touched row with a zero gradient
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    w1, n1, z1 = ftrl_rule_rowwise(t(w), t(n), t(z), t(g), hp)
    wr, zr, nr = ftrl_reference_step_rowwise(w, z, n, g, **reference_knobs(hp))
    assert n1.shape == (4,) and w1.shape == z1.shape == (4, 6)
    np.testing.assert_allclose(n1.numpy(), nr, rtol=1e-14)
    np.testing.assert_allclose(z1.numpy(), zr, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(w1.numpy(), wr, rtol=1e-12, atol=1e-12)
    # fp32 math from bf16 / fp32 states, within fp32 rounding of the float64 values
    w2, n2, z2 = ftrl_rule_rowwise(t(w).float(), t(n).bfloat16(), t(z).float(), t(g).float(), hp)
    assert w2.dtype == n2.dtype == torch.float32
    wb, zb, nb = ftrl_reference_step_rowwise(w, z, t(n).bfloat16().double().numpy(), g, **reference_knobs(hp))
    np.testing.assert_allclose(w2.double().numpy(), wb, rtol=1e-5, atol=1e-6)


def test_rowwise_accumulator_is_the_mean_of_squares():
    """One row, D = 4, g = (1, 2, 3, 4), n = 0.5: n_new = 0.5 + 30 / 4 = 8.0 (by hand)."""
    hp = FTRLHyperparams(1.0)
    _, n1, _ = ftrl_rule_rowwise(torch.zeros(1, 4, dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64),
                                 torch.zeros(1, 4, dtype=torch.float64),
                                 torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64), hp)
    assert n1.tolist() == [8.0]
