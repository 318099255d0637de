"""TorchRec's ``ModelDeltaTrackerTrec`` (``torchrec/distributed/model_tracker``) with FTRL tables.

Its modes ``MOMENTUM_LAST``, ``MOMENTUM_DIFF`` and ``ROWWISE_ADAGRAD`` read row-wise Adagrad's state:
the TBE's ``momentum1_dev`` or ``split_optimizer_states()[t][0]`` as one value per row, and
``get_latest`` asserts FBGEMM's TBE class (torchrec 1.8.0, 1.9.2). FTRL keeps two per-element states
and no momentum, so a model with FTRL tables is refused in those modes when the tracker is built;
``ID_ONLY`` and ``EMBEDDING`` read ids and weights only and work as for any table.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

from .compute_kernels import ftrl_tbes

OPTIMIZER_STATE_MODES = ("momentum_last", "momentum_diff", "rowwise_adagrad")


def check_tracking_mode(model, mode) -> None:
    """Raises ValueError, naming the mode, when ``mode`` (a ``TrackingMode``) reads an optimizer
    state and ``model`` holds FTRL tables."""
    value = getattr(mode, "value", mode)
    if value in OPTIMIZER_STATE_MODES and ftrl_tbes(model):
        raise ValueError(
            f"ModelDeltaTracker mode {value!r} reads row-wise Adagrad's per-row optimizer state, but the "
            f"model holds FTRL tables (states 'accum' and 'linear', per element, no momentum); use "
            f"TrackingMode.ID_ONLY or TrackingMode.EMBEDDING")


def ftrl_tracker_init(original: Callable[..., None]) -> Callable[..., None]:
    """``ModelDeltaTrackerTrec.__init__`` preceded by :func:`check_tracking_mode`."""

    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        check_tracking_mode(bound.arguments["model"], bound.arguments["mode"])
        original(self, *args, **kwargs)
    return __init__
