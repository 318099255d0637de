"""The float64 reference (tests/reference.py) against values derived by hand from
docs/ftrl.md. Every expected number below is worked out in the comments, not computed by the
reference itself, so a transcription error in the reference fails here."""

import math

import numpy as np
import pytest

from reference import ftrl_reference_rows, ftrl_reference_step, option_knobs, reference_knobs
from torchrec_ftrl import FTRLHyperparams


def step(w, z, n, g, **kw):
    out = ftrl_reference_step(np.float64(w), np.float64(z), np.float64(n), np.float64(g), **kw)
    return tuple(float(x) for x in out)


def test_first_step_is_w_minus_lr_sign_g():
    # n0 = 0, beta = 0: n1 = g^2, sqrt(n1) = |g|, sigma = |g|/lr, z = g - |g| w / lr, q = |g|/lr,
    # w1 = -z/q = w0 - lr*sign(g), whatever |g|.
    for w0, g, lr in [(0.7, -0.3, 0.05), (0.7, 0.3, 0.05), (-1.25, 1e-6, 0.5), (0.0, 123.0, 2.0),
                      (3.0, -1e-20, 0.01)]:
        w1, z1, n1 = step(w0, 0.0, 0.0, g, lr=lr)
        assert w1 == pytest.approx(w0 - lr * math.copysign(1.0, g), rel=1e-12, abs=1e-12)
        assert n1 == g * g
        assert z1 == pytest.approx(g - abs(g) / lr * w0, rel=1e-12)


def test_first_step_hand_values():
    # w0=0.7 g=-0.3 lr=0.05: n=0.09, sigma=0.3/0.05=6, z=-0.3-6*0.7=-4.5, q=6, w=4.5/6=0.75
    w1, z1, n1 = step(0.7, 0.0, 0.0, -0.3, lr=0.05)
    assert (w1, z1, n1) == pytest.approx((0.75, -4.5, 0.09), rel=1e-13)


def test_second_step_hand_values():
    # from (w=0.75, z=-4.5, n=0.09), g=0.4, lr=0.05: n=0.25, sigma=(0.5-0.3)/0.05=4,
    # z=-4.5+0.4-4*0.75=-7.1, q=0.5/0.05=10, w=0.71
    w2, z2, n2 = step(0.75, -4.5, 0.09, 0.4, lr=0.05)
    assert (w2, z2, n2) == pytest.approx((0.71, -7.1, 0.25), rel=1e-13)


def test_initial_accumulator_keeps_fraction_of_initial_weight():
    # n0 = 0.5625 (=0.75^2), g = 1: n1 = 1.5625 (=1.25^2); beta = 0.75, lr = 0.5, w0 = 2:
    # sigma = (1.25-0.75)/0.5 = 1, z = 1 - 1*2 = -1, q = (0.75+1.25)/0.5 = 4, w1 = 1/4 = 0.25.
    # = w0 (sqrt n1 - sqrt n0)/(beta + sqrt n1) - lr g/(beta + sqrt n1) = 2*0.5/2 - 0.5/2.
    w1, z1, n1 = step(2.0, 0.0, 0.5625, 1.0, lr=0.5, beta=0.75)
    assert (w1, z1, n1) == (0.25, -1.0, 1.5625)  # all dyadic: exact
    # g -> tiny: only the kept fraction of w0 survives: 2 * (sqrt(n0+g^2)-0.75)/(0.75+...) -> ~0
    # with n0 = 1, beta = 0, g = 3 (n1 = 10): kept = (sqrt(10)-1)/sqrt(10) of w0, g term -lr*3/sqrt(10)
    w1, _, _ = step(1.0, 0.0, 1.0, 3.0, lr=0.1)
    s10 = math.sqrt(10.0)
    assert w1 == pytest.approx((s10 - 1.0) / s10 - 0.1 * 3.0 / s10, rel=1e-13)


def test_l1_exact_zero_and_soft_threshold():
    # first-step case: z = -4.5, q = 6
    w1, z1, _ = step(0.7, 0.0, 0.0, -0.3, lr=0.05, l1=5.0)
    assert z1 == pytest.approx(-4.5, rel=1e-13)
    assert w1 == 0.0 and not math.copysign(1.0, w1) < 0  # +0.0 exactly
    w1, _, _ = step(0.7, 0.0, 0.0, -0.3, lr=0.05, l1=4.5 * (1 + 1e-12))  # |z| <= l1 -> 0
    assert w1 == 0.0
    w1, _, _ = step(0.7, 0.0, 0.0, -0.3, lr=0.05, l1=4.4)
    assert w1 == pytest.approx((4.5 - 4.4) / 6.0, rel=1e-9)   # (l1*sign(z) - z)/q = (-4.4+4.5)/6


def test_tiny_linear_not_truncated():
    # p = 0 (fixed rate): n^0 = 1, sigma = 0, z = g, q = (beta+1)/lr; w = -(z - l1 sign z)/q
    w1, z1, _ = step(0.0, 0.0, 0.0, 1e-30, lr=0.5, lr_power=0.0, l1=1e-31)
    assert z1 == 1e-30
    assert w1 == pytest.approx(-(1e-30 - 1e-31) * 0.5, rel=1e-12)


@pytest.mark.parametrize("conv,factor", [("tensorflow", 2.0), ("mcmahan", 1.0)])
def test_l2_convention_factor(conv, factor):
    # first-step case, l2 = 1: q = 6 + factor*1; z = -4.5
    w1, _, _ = step(0.7, 0.0, 0.0, -0.3, lr=0.05, l2=1.0, l2_convention=conv)
    assert w1 == pytest.approx(4.5 / (6.0 + factor), rel=1e-13)


def test_beta():
    # first-step case with beta = 0.3: q = (0.3 + 0.3)/0.05 = 12 -> w = 4.5/12 = 0.375
    w1, _, _ = step(0.7, 0.0, 0.0, -0.3, lr=0.05, beta=0.3)
    assert w1 == pytest.approx(0.375, rel=1e-13)


def test_l2_shrinkage_uses_raw_g_for_accum():
    # s = 0.5: g_s = -0.3 + 2*0.5*0.7 = 0.4; z = 0.4 - 6*0.7 = -3.8; q = 6 (from raw n = 0.09)
    w1, z1, n1 = step(0.7, 0.0, 0.0, -0.3, lr=0.05, l2_shrinkage=0.5)
    assert n1 == pytest.approx(0.09, rel=1e-15)           # raw g^2, not 0.4^2 = 0.16
    assert z1 == pytest.approx(-3.8, rel=1e-13)
    assert w1 == pytest.approx(3.8 / 6.0, rel=1e-13)


@pytest.mark.parametrize("p,expected", [
    # p = 0: sigma = 0, z = -0.3, q = 1/0.05 = 20, w = 0.015
    (0.0, (0.015, -0.3)),
    # p = -1: n1^1 = 0.09, sigma = 1.8, z = -0.3 - 1.26 = -1.56, q = 1.8, w = 1.56/1.8
    (-1.0, (1.56 / 1.8, -1.56)),
    # p = -0.25: n1^0.25 = sqrt(0.3), sigma = sqrt(0.3)/0.05, z = -0.3 - 0.7*sigma, w = -z/(sqrt(.3)/.05)
    (-0.25, (0.3 / (math.sqrt(0.3) / 0.05) + 0.7, -0.3 - 0.7 * math.sqrt(0.3) / 0.05)),
])
def test_learning_rate_power(p, expected):
    w1, z1, _ = step(0.7, 0.0, 0.0, -0.3, lr=0.05, lr_power=p)
    assert (w1, z1) == pytest.approx(expected, rel=1e-12)


def test_q_zero_gives_zero_not_nan():
    # beta = 0, l2 = 0, n = 0, g = 0: q = 0, z = 0, |z| > l1 is false -> w = 0 (no 0/0)
    w1, z1, n1 = step(0.7, 0.0, 0.0, 0.0, lr=0.05)
    assert (w1, z1, n1) == (0.0, 0.0, 0.0)


def test_shape_preserved_and_inputs_untouched():
    w = np.full((2, 3), 0.7)
    z = np.zeros((2, 3))
    n = np.zeros((2, 3))
    g = np.full((2, 3), -0.3)
    w1, z1, n1 = ftrl_reference_step(w, z, n, g, lr=0.05)
    assert w1.shape == z1.shape == n1.shape == (2, 3)
    np.testing.assert_allclose(w1, 0.75, rtol=1e-13)
    assert (w == 0.7).all() and (z == 0).all() and (n == 0).all()


def test_rows_duplicates_summed_once():
    # rows 1 gets -0.1 and -0.2 -> summed -0.3 -> the first-step hand case (w=0.75, z=-4.5, n=0.09);
    # rows 0 and 2 are untouched.
    W = np.array([[1.0, -2.0], [0.7, 0.7], [3.0, 4.0]])
    Z = np.zeros((3, 2))
    N = np.zeros((3, 2))
    w, z, n = ftrl_reference_rows(W, Z, N, [1, 1], [[-0.1, -0.1], [-0.2, -0.2]], lr=0.05)
    np.testing.assert_allclose(w[1], 0.75, rtol=1e-13)
    np.testing.assert_allclose(z[1], -4.5, rtol=1e-13)
    np.testing.assert_allclose(n[1], 0.09, rtol=1e-13)
    assert (w[[0, 2]] == W[[0, 2]]).all() and (z[[0, 2]] == 0).all() and (n[[0, 2]] == 0).all()
    # sequential application: -0.1 gives (w=0.75, z=-1.5, n=0.01); then -0.2 gives n=0.05,
    # sigma=(sqrt(.05)-.1)/.05, z=-1.5-0.2-sigma*0.75, w=-z/(sqrt(.05)/.05) ~= 0.7947: a different answer
    sig = (math.sqrt(0.05) - 0.1) / 0.05
    w_seq = (1.5 + 0.2 + sig * 0.75) / (math.sqrt(0.05) / 0.05)
    assert abs(w[1, 0] - w_seq) > 0.04


def test_rows_empty():
    W = np.ones((3, 2))
    w, z, n = ftrl_reference_rows(W, np.zeros((3, 2)), np.zeros((3, 2)), [], np.zeros((0, 2)), lr=0.1)
    assert (w == 1).all() and (z == 0).all() and (n == 0).all()


def test_reference_knobs_mapping():
    hp = FTRLHyperparams(0.5, learning_rate_power=-0.3, l1_reg=1.0, l2_reg=2.0, beta=3.0,
                         l2_shrinkage=4.0, initial_accumulator_value=5.0, l2_convention="mcmahan")
    assert reference_knobs(hp) == dict(lr=0.5, lr_power=-0.3, l1=1.0, l2=2.0, beta=3.0,
                                       l2_shrinkage=4.0, l2_convention="mcmahan")


def test_option_knobs_mapping():
    # both learning-rate spellings; n0 is the accum input, not a step keyword; other keys are ignored
    opts = dict(ftrl_learning_rate_power=-0.3, ftrl_l1_reg=1.0, ftrl_l2_reg=2.0, ftrl_beta=3.0,
                ftrl_l2_shrinkage=4.0, ftrl_initial_accumulator_value=5.0, ftrl_l2_convention="mcmahan",
                optimizer="ftrl")
    expected = dict(lr=0.5, lr_power=-0.3, l1=1.0, l2=2.0, beta=3.0, l2_shrinkage=4.0,
                    l2_convention="mcmahan")
    assert option_knobs({"lr": 0.5, **opts}) == expected
    assert option_knobs({"learning_rate": 0.5, **opts}) == expected


def test_unknown_convention_rejected():
    with pytest.raises(ValueError, match="l2_convention"):
        ftrl_reference_step(0.0, 0.0, 0.0, 1.0, lr=0.1, l2_convention="keras")
