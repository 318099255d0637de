"""Planner support: FTRL optimizer state counts 2 x the weight size."""

from .storage import FTRL_STATE_MULTIPLIER, ftrl_planner, install_planner_storage  # noqa: F401
