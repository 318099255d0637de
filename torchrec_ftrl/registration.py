"""Registers FTRL into stock fbgemm_gpu and torchrec, idempotently and only what is missing.

On ``import torchrec_ftrl``:

* ``EmbOptimType.FTRL`` (value ``"ftrl"``) is added to fbgemm_gpu's enum, unless fbgemm_gpu already has
  its own member, which is then used as is (our kernel still serves it).
* ``torchrec.optim.FTRL`` points at :class:`torchrec_ftrl.FTRL`, and torchrec's optimizer-class <->
  ``EmbOptimType`` maps learn the pair, so ``apply_optimizer_in_backward(torchrec.optim.FTRL, ...)`` works.
* TorchRec's grouped lookups build :class:`~torchrec_ftrl.distributed.kernels.FTRLBatchedFusedEmbeddingBag`
  (or the sequence twin) for groups whose ``fused_params["optimizer"]`` is FTRL; FBGEMM's TBE never
  receives FTRL. See :mod:`torchrec_ftrl.distributed.lookup`.
* The planner counts FTRL state as 2 x the weight size (:mod:`torchrec_ftrl.planner`).
"""

from __future__ import annotations

import enum

from fbgemm_gpu.split_embedding_configs import EmbOptimType

FTRL_VALUE = "ftrl"
_done = False


def _add_enum_member(cls: type[enum.Enum], name: str, value: str) -> enum.Enum:
    """Add a member to a closed Enum through its internals (works on Python 3.10-3.13)."""
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = cls
    if hasattr(member, "_sort_order_"):
        member._sort_order_ = len(cls._member_names_)
    type.__setattr__(cls, name, member)
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)
    return member


def ftrl_emb_optim_type() -> EmbOptimType:
    """``EmbOptimType.FTRL``: fbgemm_gpu's own member if it has one, else ours (registered on import)."""
    member = getattr(EmbOptimType, "FTRL", None)
    if member is None:
        member = EmbOptimType._value2member_map_.get(FTRL_VALUE)
    if member is None:
        member = _add_enum_member(EmbOptimType, "FTRL", FTRL_VALUE)
    return member


def is_ftrl(optimizer) -> bool:
    """True for ``EmbOptimType.FTRL``, the string ``"ftrl"`` or the :class:`torchrec_ftrl.FTRL` class."""
    from .optim import FTRL
    if optimizer is None:
        return False
    if isinstance(optimizer, type):
        return issubclass(optimizer, FTRL)
    if isinstance(optimizer, str):
        return optimizer.lower() == FTRL_VALUE
    return getattr(optimizer, "value", None) == FTRL_VALUE


def register() -> None:
    """Idempotent: run once per process by ``import torchrec_ftrl``."""
    global _done
    if _done:
        return
    import torchrec.optim as trec_optim
    from torchrec.distributed import utils as dist_utils

    from .optim import FTRL
    ftrl_type = ftrl_emb_optim_type()
    if getattr(trec_optim, "FTRL", None) is None:
        trec_optim.FTRL = FTRL
    cls_to_type = getattr(dist_utils, "_OPTIMIZER_CLASS_TO_EMB_OPT_TYPE", None)
    if cls_to_type is not None:
        cls_to_type.setdefault(trec_optim.FTRL, ftrl_type)
        cls_to_type.setdefault(FTRL, ftrl_type)
    type_to_cls = getattr(dist_utils, "_EMB_OPT_TYPE_TO_OPTIMIZER_CLASS", None)
    if type_to_cls is not None:
        type_to_cls.setdefault(ftrl_type, trec_optim.FTRL)

    from .distributed.lookup import install_lookup_routing
    from .planner.storage import install_planner_storage
    install_lookup_routing()
    install_planner_storage()
    _done = True
