"""The job's FTRL regularisation flags are per-example values, scaled by the batch size.

* the flag -> ``fused_params`` scaling, recomputed here from the rule in the flag help;
* a float64 transcription of the update rule of docs/ftrl.md: with the scaled knobs, feeding the
  gradients times ``c = 1 / S`` gives the same weights (and state times ``c`` / ``c^2``) as feeding
  the per-example-sum gradients with the flag values, for several learning-rate powers, both l2
  conventions, shrinkage and an initial accumulator; with unscaled knobs it does not;
* bad values are argparse errors naming the flag and the value.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from torchrec_ftrl.job import cli

FTRL_KEYS = ("learning_rate", "ftrl_l1_reg", "ftrl_l2_reg", "ftrl_beta", "ftrl_l2_shrinkage",
             "ftrl_initial_accumulator_value")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def expected_knobs(lr, l1, l2, beta, shrink, acc, p, s):
    """The documented rule, written out independently of the code."""
    return {"learning_rate": lr * s ** (1 + 2 * p), "ftrl_l1_reg": l1 / s, "ftrl_l2_reg": l2 / s,
            "ftrl_beta": beta * s ** (2 * p), "ftrl_l2_shrinkage": shrink / s,
            "ftrl_initial_accumulator_value": acc / s ** 2}


FLAGS = ["--sparse-lr", "0.2", "--ftrl-l1", "0.5", "--ftrl-l2", "0.25", "--ftrl-beta", "2",
         "--ftrl-l2-shrinkage", "0.125", "--ftrl-initial-accumulator", "0.1"]


@pytest.mark.parametrize("batch,p", [(256, -0.5), (1000, -0.5), (65536, -0.5), (512, -0.25), (300, 0.0)])
def test_per_example_flags_are_scaled_by_the_batch_size(batch, p):
    a = cli.parse_args([*FLAGS, "--batch-size", str(batch), "--ftrl-lr-power", str(p)])
    assert a.ftrl_reg_scale == "per_example"
    got = cli.ftrl_fused_knobs(a)
    want = expected_knobs(0.2, 0.5, 0.25, 2.0, 0.125, 0.1, p, batch)
    assert set(got) == set(FTRL_KEYS)
    for k in FTRL_KEYS:
        assert got[k] == pytest.approx(want[k], rel=1e-12), k
    if p == -0.5:  # the classic schedule: the learning rate is not scaled, beta is divided by S
        assert got["learning_rate"] == 0.2 and got["ftrl_beta"] == pytest.approx(2.0 / batch, rel=1e-15)


def test_world_size_multiplies_the_examples_per_gradient(monkeypatch):
    # TorchRec divides the sharded embedding gradients by the world size (gradient division on by
    # default), so S is the global batch.
    from torchrec.distributed.comm_ops import get_gradient_division, set_gradient_division

    a = cli.parse_args([*FLAGS, "--batch-size", "512"])
    assert cli.ftrl_fused_knobs(a, world_size=4)["ftrl_l1_reg"] == pytest.approx(0.5 / 2048, rel=1e-15)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.examples_per_row_gradient(512) == 1024
    assert cli.ftrl_fused_knobs(a)["ftrl_l1_reg"] == pytest.approx(0.5 / 1024, rel=1e-15)
    was = get_gradient_division()
    try:
        set_gradient_division(False)  # then the ranks' gradients are summed: S is the rank's batch
        assert cli.examples_per_row_gradient(512) == 512
    finally:
        set_gradient_division(was)


def test_raw_scale_passes_the_flags_unchanged():
    a = cli.parse_args([*FLAGS, "--batch-size", "4096", "--ftrl-reg-scale", "raw"])
    assert cli.ftrl_fused_knobs(a) == expected_knobs(0.2, 0.5, 0.25, 2.0, 0.125, 0.1, -0.5, 1)


def test_defaults_and_fused_params():
    a = cli.parse_args(["--batch-size", "1024"])
    assert (a.ftrl_l1, a.ftrl_l2, a.ftrl_beta, a.sparse_lr) == (0.1, 0.0, 1.0, 0.05)
    import torchrec_ftrl  # noqa: F401
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    if getattr(EmbOptimType, "FTRL", None) is None:
        pytest.skip("EmbOptimType.FTRL not registered")
    fp = cli.sparse_fused_params(a)
    assert fp["optimizer"] is EmbOptimType.FTRL
    assert fp["learning_rate"] == 0.05 and fp["ftrl_learning_rate_power"] == -0.5
    assert fp["ftrl_l1_reg"] == pytest.approx(0.1 / 1024, rel=1e-15)
    assert fp["ftrl_beta"] == pytest.approx(1.0 / 1024, rel=1e-15)
    assert fp["ftrl_l2_reg"] == 0.0 and fp["ftrl_l2_shrinkage"] == 0.0
    assert fp["ftrl_initial_accumulator_value"] == 0.0 and fp["ftrl_l2_convention"] == "tensorflow"
    # row-wise Adagrad is not rescaled
    a = cli.parse_args(["--batch-size", "1024", "--sparse-optimizer", "rowwise_adagrad"])
    assert cli.sparse_fused_params(a) == {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                          "learning_rate": 0.05, "eps": 1e-8}


# ----------------------------------------------------------------------------- float64 invariance
def ftrl64(w, z, n, g, *, learning_rate, ftrl_l1_reg, ftrl_l2_reg, ftrl_beta, ftrl_l2_shrinkage,
           ftrl_learning_rate_power, l2_convention):
    """One step of docs/ftrl.md's rule, element-wise, in float64 (transcribed, not imported)."""
    a, l1, b, s, p = learning_rate, ftrl_l1_reg, ftrl_beta, ftrl_l2_shrinkage, ftrl_learning_rate_power
    L2 = 2.0 * ftrl_l2_reg if l2_convention == "tensorflow" else ftrl_l2_reg
    pw = (lambda x: np.sqrt(x)) if p == -0.5 else (lambda x: np.power(x, -p))
    n_new = n + g * g
    sigma = (pw(n_new) - pw(n)) / a
    g_s = g + 2.0 * s * w
    z = z + g_s - sigma * w
    q = (b + pw(n_new)) / a + L2
    w = np.where(np.abs(z) > l1, (l1 * np.sign(z) - z) / np.where(np.abs(z) > l1, q, 1.0), 0.0)
    return w, z, n_new


def run64(knobs, grads, w0, p, conv):
    """Steps of ``grads`` (a list of [rows, D] arrays; all-zero rows are untouched) from ``w0``."""
    w, z = w0.copy(), np.zeros_like(w0)
    n = np.full_like(w0, knobs["ftrl_initial_accumulator_value"])
    kw = {k: knobs[k] for k in FTRL_KEYS if k != "ftrl_initial_accumulator_value"}
    for g in grads:
        touched = np.any(g != 0, axis=1)
        w1, z1, n1 = ftrl64(w, z, n, g, ftrl_learning_rate_power=p, l2_convention=conv, **kw)
        w[touched], z[touched], n[touched] = w1[touched], z1[touched], n1[touched]
    return w, z, n


def _grads(seed, steps=12, rows=40, dim=8):
    rng = np.random.default_rng(seed)
    out = []
    scale = rng.choice([0.005, 0.5, 20.0], size=(rows, 1))  # rows below, near and above l1
    for _ in range(steps):
        g = rng.normal(size=(rows, dim)) * scale * rng.choice([0.5, 2.0])
        g[rng.random(rows) < 0.4] = 0.0      # rows this step does not touch
        out.append(g)
    return out


@pytest.mark.parametrize("p", [-0.5, -0.25, 0.0, -1.0])
@pytest.mark.parametrize("conv", ["tensorflow", "mcmahan"])
@pytest.mark.parametrize("s", [7.0, 4096.0])
def test_scaled_knobs_make_the_update_invariant_to_the_gradient_scale(p, conv, s):
    per_example = dict(lr=0.05, l1=0.3, l2=0.02, beta=0.5, shrink=0.01, acc=0.1)
    rng = np.random.default_rng(int(s) + int(100 * -p))
    w0 = rng.normal(scale=0.1, size=(40, 8))
    grads = _grads(int(s))
    base = expected_knobs(**per_example, p=p, s=1.0)          # the flag values themselves
    scaled = expected_knobs(**per_example, p=p, s=s)
    w_ref, z_ref, n_ref = run64(base, grads, w0, p, conv)     # per-example-sum gradients
    w, z, n = run64(scaled, [g / s for g in grads], w0, p, conv)  # what the kernel sees: mean over S
    assert np.count_nonzero(w_ref == 0) > 0 and np.count_nonzero(w_ref) > 0  # both branches taken
    np.testing.assert_allclose(w, w_ref, rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(w == 0, w_ref == 0)
    np.testing.assert_allclose(z * s, z_ref, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(n * s * s, n_ref, rtol=1e-9, atol=1e-12)
    # the job's own mapping gives those knobs ...
    a = cli.parse_args(["--sparse-lr", "0.05", "--ftrl-l1", "0.3", "--ftrl-l2", "0.02", "--ftrl-beta", "0.5",
                        "--ftrl-l2-shrinkage", "0.01", "--ftrl-initial-accumulator", "0.1",
                        "--ftrl-lr-power", str(p), "--batch-size", str(int(s))])
    w_job, _, _ = run64(cli.ftrl_fused_knobs(a), [g / s for g in grads], w0, p, conv)
    np.testing.assert_allclose(w_job, w_ref, rtol=1e-9, atol=1e-12)
    # ... and passing the flag values unscaled to mean gradients is a different optimizer.
    w_raw, _, _ = run64(base, [g / s for g in grads], w0, p, conv)
    assert not np.allclose(w_raw, w_ref, rtol=1e-3, atol=1e-6)


# ----------------------------------------------------------------------------- bad values
@pytest.mark.parametrize("flag,value", [
    ("--ftrl-l1", "-0.1"), ("--ftrl-l2", "-1"), ("--ftrl-beta", "-2"), ("--ftrl-l2-shrinkage", "-0.5"),
    ("--ftrl-initial-accumulator", "-1"), ("--ftrl-lr-power", "0.5"), ("--sparse-lr", "0"),
    ("--sparse-lr", "-0.05"), ("--ftrl-l1", "nan"), ("--ftrl-l2", "inf"), ("--adagrad-eps", "-1e-8"),
])
def test_bad_values_are_argparse_errors(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args([f"{flag}={value}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error:" in err and flag in err and repr(float(value)) in err, err


def test_scaled_value_outside_fp32_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["--ftrl-l1", "1e-36", "--batch-size", "1024"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--ftrl-l1 1e-36" in err and "ftrl_l1_reg" in err and "1024" in err, err
    with pytest.raises(SystemExit):
        cli.parse_args(["--ftrl-reg-scale", "bogus"])
    assert "--ftrl-reg-scale" in capsys.readouterr().err
    # the same value is fine unscaled, and a bad l1 is still checked with rowwise_adagrad
    assert cli.parse_args(["--ftrl-l1", "1e-36", "--ftrl-reg-scale", "raw"]).ftrl_l1 == 1e-36
    with pytest.raises(SystemExit):
        cli.parse_args(["--ftrl-l1", "-1", "--sparse-optimizer", "rowwise_adagrad"])
    assert math.isfinite(cli.parse_args([]).ftrl_l1)
