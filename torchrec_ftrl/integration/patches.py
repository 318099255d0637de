"""Every change this package makes to TorchRec / FBGEMM objects, in one list, with the versions each was
verified on. :func:`install` applies them (idempotent; ``import torchrec_ftrl`` calls it) and
:func:`uninstall` reverses them in reverse order, leaving the stock objects as they were.

Where TorchRec has an extension point, the package uses it instead of a patch: sharders are
subclasses (:mod:`.sharders`), the planner's storage estimate is an estimator class
and enumerator (:mod:`.planner`), the fused optimizer and kernels are subclasses
(:mod:`.compute_kernels`). The patches below cover what has none.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torchrec
import torchrec.optim as trec_optim
from torchrec.distributed import embeddingbag, model_parallel, utils as dist_utils
from torchrec.distributed.planner import planners

from .. import optim_type
from ..optim import FTRL
from .planner import FTRLEnumerator
from .delta_tracker import ftrl_tracker_init
from .replica_sync import ftrl_dmp_collection_init, ftrl_dmp_collection_sync
from .resharding import ftrl_update_shards
from .routing import ROUTES, routed_create_embedding_kernel
from .versions import check_torchrec_version

VERIFIED = "torchrec 1.6.1, 1.8.0 and 1.9.2; fbgemm_gpu 1.6.0 (CUDA) and fbgemm-gpu-cpu 1.8.0"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One change to a TorchRec/FBGEMM object: ``apply()`` makes it and returns the function that
    undoes it."""

    target: str
    change: str
    apply: Callable[[], Callable[[], None]]
    verified: str = VERIFIED


def _set_attr(obj, name: str, value) -> Callable[[], None]:
    """``setattr(obj, name, value)``; the undo restores the old value (or deletes a new attribute)."""
    had = name in vars(obj)
    old = vars(obj).get(name)
    setattr(obj, name, value)

    def undo() -> None:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)
    return undo


def _set_item(mapping: dict, key, value) -> Callable[[], None]:
    """``mapping.setdefault(key, value)``; the undo removes the key only if this call added it."""
    if key in mapping:
        return lambda: None
    mapping[key] = value
    return lambda: mapping.pop(key, None)


def _enum_member() -> Callable[[], None]:
    added = optim_type.add_emb_optim_type()
    return optim_type.remove_emb_optim_type if added else (lambda: None)


def _optimizer_class() -> Callable[[], None]:
    if getattr(trec_optim, "FTRL", None) is not None:
        return lambda: None
    return _set_attr(trec_optim, "FTRL", FTRL)


def _class_type_maps() -> Callable[[], None]:
    member = optim_type.emb_optim_type()
    undos = []
    cls_to_type = getattr(dist_utils, "_OPTIMIZER_CLASS_TO_EMB_OPT_TYPE", None)
    if cls_to_type is not None:
        undos += [_set_item(cls_to_type, trec_optim.FTRL, member), _set_item(cls_to_type, FTRL, member)]
    type_to_cls = getattr(dist_utils, "_EMB_OPT_TYPE_TO_OPTIMIZER_CLASS", None)
    if type_to_cls is not None:
        undos.append(_set_item(type_to_cls, member, trec_optim.FTRL))
    return lambda: [undo() for undo in reversed(undos)]


def _route(lookup_cls, kernel_cls) -> Callable[[], Callable[[], None]]:
    def apply() -> Callable[[], None]:
        original = lookup_cls._create_embedding_kernel
        return _set_attr(lookup_cls, "_create_embedding_kernel",
                         routed_create_embedding_kernel(original, kernel_cls))
    return apply


def _default_enumerator() -> Callable[[], None]:
    return _set_attr(planners, "EmbeddingEnumerator", FTRLEnumerator)


def _update_shards() -> Callable[[], None]:
    cls = embeddingbag.ShardedEmbeddingBagCollection
    original = getattr(cls, "update_shards", None)
    if original is None:   # a torchrec without dynamic sharding
        return lambda: None
    return _set_attr(cls, "update_shards", ftrl_update_shards(original))


def _dmp_collection() -> Callable[[], None]:
    cls = getattr(model_parallel, "DMPCollection", None)
    if cls is None:   # a torchrec without 2D parallel
        return lambda: None
    undos = [_set_attr(cls, "__init__", ftrl_dmp_collection_init(cls.__init__)),
             _set_attr(cls, "sync", ftrl_dmp_collection_sync(cls.sync))]
    return lambda: [undo() for undo in reversed(undos)]


def _delta_tracker() -> Callable[[], None]:
    try:
        from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec as tracker
    except ImportError:   # a torchrec without the model tracker
        return lambda: None
    return _set_attr(tracker, "__init__", ftrl_tracker_init(tracker.__init__))


PATCHES: tuple[Patch, ...] = (
    Patch("fbgemm_gpu.split_embedding_configs.EmbOptimType",
          "adds the member FTRL = 'ftrl' unless fbgemm_gpu has one", _enum_member),
    Patch("torchrec.optim.FTRL", "set to torchrec_ftrl.FTRL unless torchrec has one", _optimizer_class),
    Patch("torchrec.distributed.utils._OPTIMIZER_CLASS_TO_EMB_OPT_TYPE / _EMB_OPT_TYPE_TO_OPTIMIZER_CLASS",
          "learn the pair FTRL class <-> EmbOptimType.FTRL (apply_optimizer_in_backward)", _class_type_maps),
    *(Patch(f"torchrec.distributed.embedding_lookup.{lookup.__name__}._create_embedding_kernel",
            f"builds {kernel.__name__} for groups whose fused_params optimizer is FTRL; other groups "
            "unchanged", _route(lookup, kernel)) for lookup, kernel in ROUTES),
    Patch("torchrec.distributed.planner.planners.EmbeddingEnumerator",
          "EmbeddingShardingPlanner's default enumerator (DMP's default planner) is FTRLEnumerator",
          _default_enumerator),
    Patch("torchrec.distributed.embeddingbag.ShardedEmbeddingBagCollection.update_shards",
          "(DistributedModelParallel.reshard) a module with FTRL tables checks the new plan first, then "
          "carries every weight and optimizer state by name (resharding.py); other modules unchanged",
          _update_shards),
    Patch("torchrec.distributed.model_parallel.DMPCollection.__init__ / sync",
          "(2D parallel) a model with FTRL tables is refused at construction where its replicas cannot be "
          "synced; sync() then averages every FTRL state and derives the weights (replica_sync.py)",
          _dmp_collection),
    Patch("torchrec.distributed.model_tracker.model_delta_tracker.ModelDeltaTrackerTrec.__init__",
          "refuses the optimizer-state tracking modes for a model with FTRL tables (delta_tracker.py)",
          _delta_tracker),
)

_undo: list[Callable[[], None]] = []


def installed() -> bool:
    return bool(_undo)


def install() -> None:
    """Apply every patch of :data:`PATCHES` once (idempotent).

    Raises:
        ImportError: the installed torchrec is outside the supported range (nothing is applied).
    """
    if _undo:
        return
    check_torchrec_version(getattr(torchrec, "__version__", ""))
    try:
        for patch in PATCHES:
            _undo.append(patch.apply())
    except BaseException:
        uninstall()
        raise


def uninstall() -> None:
    """Undo every applied patch, in reverse order (idempotent)."""
    while _undo:
        _undo.pop()()
