"""The planner's storage estimate for FTRL tables: optimizer state = 2 x the weight's size.

Stock torchrec reads the optimizer only from a tensor's in-backward ``_optimizer_classes`` and counts
1 x for any class it does not know (and 0 x when the optimizer comes from sharder ``fused_params``), so
it undercounts FTRL's two full-size states (``accum`` and ``linear``). ``install_planner_storage``
(run by ``import torchrec_ftrl``) wraps torchrec's ``_get_optimizer_multipler`` and
``calculate_shard_storages`` so both DMP's default planner (``plan=None``) and an explicitly built
``EmbeddingShardingPlanner`` count 2 x for FTRL tables, whether FTRL comes from
``apply_optimizer_in_backward`` or from a sharder's ``fused_params``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Optional

from torchrec.distributed.planner import shard_estimators

from ..registration import is_ftrl

FTRL_STATE_MULTIPLIER = 2.0
_MARK = "_torchrec_ftrl_storage"


def _wrap_multiplier() -> None:
    original = shard_estimators._get_optimizer_multipler
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def _get_optimizer_multipler(optimizer_class, shape):
        if optimizer_class is not None and is_ftrl(optimizer_class):
            return FTRL_STATE_MULTIPLIER
        return original(optimizer_class, shape)

    setattr(_get_optimizer_multipler, _MARK, True)
    shard_estimators._get_optimizer_multipler = _get_optimizer_multipler


def _wrap_shard_storages() -> None:
    original = shard_estimators.calculate_shard_storages
    if getattr(original, _MARK, False):
        return
    signature = inspect.signature(original)
    sharder_arg = next(iter(signature.parameters))  # "sharder" (1.6) or "sharder_data" (1.7+)

    @functools.wraps(original)
    def calculate_shard_storages(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        tensor = arguments["tensor"]
        fused = getattr(arguments[sharder_arg], "fused_params", None) or {}
        classes = getattr(tensor, "_optimizer_classes", None)
        if (classes is None or classes[0] is None) and is_ftrl(fused.get("optimizer")):
            from ..optim import FTRL
            had = hasattr(tensor, "_optimizer_classes")
            tensor._optimizer_classes = [FTRL]  # seen only by this estimate
            try:
                return original(*args, **kwargs)
            finally:
                if had:
                    tensor._optimizer_classes = classes
                else:
                    del tensor._optimizer_classes
        return original(*args, **kwargs)

    setattr(calculate_shard_storages, _MARK, True)
    shard_estimators.calculate_shard_storages = calculate_shard_storages


def install_planner_storage() -> None:
    """Idempotent."""
    _wrap_multiplier()
    _wrap_shard_storages()


def ftrl_planner(topology, constraints: Optional[dict] = None, **kwargs: Any):
    """An ``EmbeddingShardingPlanner`` for ``topology`` whose storage estimate counts FTRL state 2 x.

    A thin convenience: after ``import torchrec_ftrl`` every planner does; this one just makes the
    dependency explicit for code that builds its planner by hand.
    """
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    install_planner_storage()
    return EmbeddingShardingPlanner(topology=topology, constraints=constraints, **kwargs)
