"""``torchrec_ftrl.rule``, the one statement of the FTRL update on tensors (used by the dense optimizer
and the TBE's PyTorch backend), in float64 against the float64 reference (tests/reference.py): the
argument and result order ``(w, accum, linear)``, and the row update's non-finite policy."""

import math

import numpy as np
import pytest
import torch

from reference import ftrl_reference_rows, ftrl_reference_step, reference_knobs
from torchrec_ftrl import FTRLHyperparams
from torchrec_ftrl.rule import ftrl_rule, ftrl_update_rows_

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
