"""docs/ftrl.md's hyperparameter constraints, stated independently of torchrec_ftrl.hyperparams, a pool
of good and bad values for property tests, and the check that a constructor takes exactly the valid
ones (shared by the reliability suites)."""

from __future__ import annotations

import math

import pytest
from hypothesis import strategies as st

FP32_MAX, FP32_MIN_NORMAL = 3.4028234663852886e38, 1.1754943508222875e-38

ANY_VALUE = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.sampled_from([0.0, -0.0, 1e-40, -1e-40, 1e39, -1e39, 1e-300, 0.5, -0.5, 1, -1, 2, -2, True,
                     False, "0.1", None, 3 + 0j]),
)


def valid_knob(knob: str, v) -> bool:
    """lr > 0, power <= 0, the rest >= 0; a real finite number, 0 or of normal fp32 magnitude."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    v = float(v)
    if not math.isfinite(v) or (v != 0.0 and not FP32_MIN_NORMAL <= abs(v) <= FP32_MAX):
        return False
    if knob in ("lr", "learning_rate"):
        return v > 0
    if knob == "ftrl_learning_rate_power":
        return v <= 0
    return v >= 0


def message_name(knob: str) -> str:
    """How an error message names ``knob`` (the learning rate under both spellings)."""
    return "learning_rate (lr)" if knob in ("lr", "learning_rate") else knob


def assert_valid_or_named_error(build, knobs: dict):
    """``build(**knobs)`` succeeds (and is returned) when every knob is valid; otherwise it raises a
    ``ValueError`` naming one of the bad knobs (None is returned)."""
    bad = [k for k, v in knobs.items() if not valid_knob(k, v)]
    if not bad:
        return build(**knobs)
    with pytest.raises(ValueError) as e:
        build(**knobs)
    assert any(message_name(k) in str(e.value) for k in bad), str(e.value)
    return None
