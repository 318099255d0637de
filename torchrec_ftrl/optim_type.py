"""FTRL's identity: the ``EmbOptimType`` value and :func:`is_ftrl`. Imports nothing from the package.

fbgemm_gpu's ``EmbOptimType`` has no FTRL member (checked up to fbgemm_gpu 1.9.0) and is an
``@enum.unique`` Enum that cannot be subclassed. :func:`add_emb_optim_type` adds ``FTRL = "ftrl"``
through the enum internals (Python 3.10-3.13) and :func:`remove_emb_optim_type` takes it out again;
both are applied only through :mod:`torchrec_ftrl.integration.patches`. If fbgemm_gpu ships its own
member, that member is used and never removed.
"""

from __future__ import annotations

import enum

from fbgemm_gpu.split_embedding_configs import EmbOptimType

FTRL_VALUE = "ftrl"
FTRL_NAME = "FTRL"
# Class attribute that marks an optimizer class as FTRL (set on torchrec_ftrl.FTRL; subclasses inherit).
OPTIMIZER_CLASS_MARK = "emb_optim_value"


def _member() -> EmbOptimType | None:
    member = getattr(EmbOptimType, FTRL_NAME, None)
    return member if member is not None else EmbOptimType._value2member_map_.get(FTRL_VALUE)


def emb_optim_type() -> EmbOptimType:
    """``EmbOptimType.FTRL``: fbgemm_gpu's own member if it has one, else the one added on install.

    Raises:
        LookupError: fbgemm_gpu has no FTRL member and the integration is not installed
            (``torchrec_ftrl.integration.uninstall()`` was called).
    """
    member = _member()
    if member is None:
        raise LookupError("EmbOptimType.FTRL is not registered: call torchrec_ftrl.integration.install()")
    return member


def add_emb_optim_type() -> bool:
    """Add ``EmbOptimType.FTRL`` unless a member with that name or value exists. Returns True if added."""
    if _member() is not None:
        return False
    cls = EmbOptimType
    member = object.__new__(cls)
    member._name_ = FTRL_NAME
    member._value_ = FTRL_VALUE
    member.__objclass__ = cls
    if hasattr(member, "_sort_order_"):
        member._sort_order_ = len(cls._member_names_)
    type.__setattr__(cls, FTRL_NAME, member)
    cls._member_map_[FTRL_NAME] = member
    cls._value2member_map_[FTRL_VALUE] = member
    cls._member_names_.append(FTRL_NAME)
    return True


def remove_emb_optim_type() -> None:
    """Undo :func:`add_emb_optim_type` (only call it for a member that function added)."""
    cls: type[enum.Enum] = EmbOptimType
    cls._member_map_.pop(FTRL_NAME, None)
    cls._value2member_map_.pop(FTRL_VALUE, None)
    if FTRL_NAME in cls._member_names_:
        cls._member_names_.remove(FTRL_NAME)
    if FTRL_NAME in cls.__dict__:
        type.__delattr__(cls, FTRL_NAME)


def is_ftrl(optimizer) -> bool:
    """True for ``EmbOptimType.FTRL``, the string ``"ftrl"`` (any case), or an optimizer class marked
    FTRL (``torchrec_ftrl.FTRL`` and its subclasses carry ``emb_optim_value = "ftrl"``)."""
    if optimizer is None:
        return False
    if isinstance(optimizer, type):
        return getattr(optimizer, OPTIMIZER_CLASS_MARK, None) == FTRL_VALUE
    if isinstance(optimizer, str):
        return optimizer.lower() == FTRL_VALUE
    return getattr(optimizer, "value", None) == FTRL_VALUE
