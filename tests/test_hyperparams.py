"""FTRLHyperparams: defaults, validation (docs/ftrl.md), the options parser, keyword mapping, kernel scalars."""

import math

import numpy as np
import pytest

from torchrec_ftrl import FTRLHyperparams
from torchrec_ftrl.hyperparams import DEFAULT_LEARNING_RATE, FTRL_KWARGS, KernelScalars, parse_options


def test_defaults():
    hp = FTRLHyperparams(0.1)
    assert (hp.learning_rate_power, hp.l1_reg, hp.l2_reg, hp.beta, hp.l2_shrinkage,
            hp.initial_accumulator_value, hp.l2_convention) == (-0.5, 0.0, 0.0, 0.0, 0.0, 0.0, "tensorflow")


def test_legal_edges():
    hp = FTRLHyperparams(1e-12, learning_rate_power=0.0, l1_reg=0.0)  # p = 0 is a fixed rate: legal
    assert hp.learning_rate_power == 0.0
    hp = FTRLHyperparams(3.4e38, learning_rate_power=-1.2e-38, beta=1.2e-38)  # fp32 normal range: legal
    assert hp.beta == 1.2e-38
    hp = FTRLHyperparams(np.float32(0.5), l1_reg=np.float64(1.0), beta=2)  # numpy and int accepted
    assert isinstance(hp.learning_rate, float) and isinstance(hp.beta, float) and hp.beta == 2.0


@pytest.mark.parametrize("conv,expected", [("tensorflow", 3.0), ("mcmahan", 1.5)])
def test_l2_effective(conv, expected):
    assert FTRLHyperparams(0.1, l2_reg=1.5, l2_convention=conv).l2_effective == expected


@pytest.mark.parametrize("field,kw", [(f, k) for k, f in FTRL_KWARGS.items()
                                      if f not in ("learning_rate_power", "l2_convention")])
@pytest.mark.parametrize("value", [-1e-9, -1.0, math.nan, math.inf, "0.1", None, True, 1e-39, 3.5e38])
def test_nonneg_knobs_rejected(field, kw, value):
    with pytest.raises(ValueError, match=kw) as ei:
        FTRLHyperparams(0.1, **{field: value})
    assert repr(value) in str(ei.value)


@pytest.mark.parametrize("value", [1e-9, 0.5, math.nan, -math.inf, -1e-300, -1e-40])
def test_power_rejected(value):
    with pytest.raises(ValueError, match="ftrl_learning_rate_power"):
        FTRLHyperparams(0.1, learning_rate_power=value)


@pytest.mark.parametrize("value", [0.0, -0.1, math.nan, math.inf, 1e-300, 1e39])
def test_learning_rate_rejected(value):
    with pytest.raises(ValueError, match="learning_rate") as ei:
        FTRLHyperparams(value)
    assert repr(value) in str(ei.value)


def test_convention_rejected():
    with pytest.raises(ValueError, match="ftrl_l2_convention.*'keras'"):
        FTRLHyperparams(0.1, l2_convention="keras")


KW = dict(ftrl_learning_rate_power=-0.25, ftrl_l1_reg=1.0, ftrl_l2_reg=2.0, ftrl_beta=3.0,
          ftrl_l2_shrinkage=4.0, ftrl_initial_accumulator_value=5.0, ftrl_l2_convention="mcmahan")


def test_parse_options_round_trip_and_unknown_keys():
    hp = parse_options({"learning_rate": 0.5, **KW, "optimizer": object(), "eps": 1e-8})
    assert hp.to_kwargs() == KW and hp.learning_rate == 0.5
    assert hp.to_options() == {"learning_rate": 0.5, **KW}
    assert parse_options(hp.to_options()) == hp
    assert hp.with_learning_rate(0.25).learning_rate == 0.25 and hp.learning_rate == 0.5
    with pytest.raises(ValueError, match="ftrl_l1"):
        parse_options({"learning_rate": 0.5, "ftrl_l1": 1.0})


def test_parse_options_learning_rate_spellings_and_default():
    assert DEFAULT_LEARNING_RATE == 0.01
    assert parse_options(None) == parse_options({}) == FTRLHyperparams(0.01)
    assert parse_options({"lr": 0.3}).learning_rate == 0.3
    assert parse_options({"learning_rate": 0.3}).learning_rate == 0.3
    assert parse_options({"lr": 0.3, "learning_rate": 0.3}).learning_rate == 0.3   # same value: fine
    assert parse_options({"lr": None, "learning_rate": 0.2}).learning_rate == 0.2
    with pytest.raises(ValueError, match=r"fused_params has lr=0\.1 and learning_rate=0\.2"):
        parse_options({"lr": 0.1, "learning_rate": 0.2}, where="fused_params")
    with pytest.raises(ValueError, match=r"learning_rate \(lr\).*-1\.0"):
        parse_options({"lr": -1.0})


def test_parse_options_base_and_strict():
    base = parse_options({"lr": 0.5, **KW})
    hp = parse_options({"ftrl_l1_reg": 0.25}, base=base)
    assert hp.l1_reg == 0.25 and hp.learning_rate == 0.5 and hp.beta == 3.0 and hp.l2_convention == "mcmahan"
    assert parse_options({"lr": 0.1}, base=base).to_kwargs() == KW
    # strict (update_hyper_parameters): any key that is not a knob raises, naming it and the place
    with pytest.raises(ValueError, match=r"unknown FTRL key.*'eps'.*update_hyper_parameters"):
        parse_options({"lr": 0.1, "eps": 1e-8}, base=base, strict=True, where="update_hyper_parameters")
    assert parse_options({"lr": 0.1, "eps": 1e-8}, base=base).learning_rate == 0.1   # not strict: ignored
    with pytest.raises(ValueError, match="ftrl_l2_convention"):
        parse_options({"ftrl_l2_convention": "keras"}, base=base)


@pytest.mark.parametrize("conv,l2", [("tensorflow", 3.0), ("mcmahan", 1.5)])
def test_kernel_scalars(conv, l2):
    hp = FTRLHyperparams(0.2, learning_rate_power=-0.3, l1_reg=0.5, l2_reg=1.5, beta=0.75,
                         l2_shrinkage=0.125, l2_convention=conv)
    ks = hp.kernel_scalars()
    assert isinstance(ks, KernelScalars)
    # the C++ / Triton argument order: lr, -p, l1, L2 of q, beta, 2 * shrinkage
    assert tuple(ks) == (0.2, 0.3, 0.5, l2, 0.75, 0.25)
    assert ks._fields == ("lr", "neg_power", "l1", "l2", "beta", "shrink2")


def test_kernel_scalars_to_hyperparams():
    """The knobs of the scalars (the PyTorch fallback of the ops computes with them): every value the
    rule reads, with the scalars' L2 term as the "mcmahan" L2."""
    hp = KernelScalars(lr=0.2, neg_power=0.3, l1=0.5, l2=3.0, beta=0.75, shrink2=0.25).to_hyperparams()
    assert (hp.learning_rate, hp.learning_rate_power, hp.l1_reg, hp.l2_effective, hp.beta,
            hp.l2_shrinkage) == (0.2, -0.3, 0.5, 3.0, 0.75, 0.125)
    with pytest.raises(ValueError, match=r"learning_rate \(lr\) must be > 0 .*got -0.2"):
        KernelScalars(-0.2, 0.5, 0.0, 0.0, 0.0, 0.0).to_hyperparams()


def test_pickles_carry_the_knobs_not_the_cached_kernel_scalars():
    """The kernel scalars are recomputed on load (from the knobs as the loading code defines them),
    also for a pickle written before they were cached on the object."""
    import pickle
    hp = FTRLHyperparams(learning_rate=0.5, l2_reg=0.25, l2_shrinkage=0.125)
    assert "_kernel_scalars" not in hp.__getstate__()
    loaded = pickle.loads(pickle.dumps(hp))
    assert loaded == hp and tuple(loaded.kernel_scalars()) == (0.5, 0.5, 0.0, 0.5, 0.0, 0.25)
    old = FTRLHyperparams.__new__(FTRLHyperparams)
    old.__setstate__({k: v for k, v in hp.__dict__.items() if k != "_kernel_scalars"})
    assert tuple(old.kernel_scalars()) == (0.5, 0.5, 0.0, 0.5, 0.0, 0.25)
