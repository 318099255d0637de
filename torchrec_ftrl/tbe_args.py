"""Checks of the FTRL TBE's arguments, shared by its constructor, its batches and its hooks: each
raises ``ValueError`` naming the argument and the value."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .fbgemm_enums import SparseType

_PRECISIONS = {SparseType.FP32: torch.float32, SparseType.FP16: torch.float16,
               SparseType.BF16: torch.bfloat16}


def _short(values: list) -> str:
    return repr(values) if len(values) <= 12 else f"{values[:12]!r}... ({len(values)} values)"


def _as_sparse_type(name: str, value: Any) -> SparseType:
    if isinstance(value, torch.dtype):
        for k, v in _PRECISIONS.items():
            if v == value:
                return k
    if isinstance(value, SparseType) and value in _PRECISIONS:
        return value
    raise ValueError(f"{name} must be SparseType.FP32, FP16 or BF16 (or the torch dtype), got {value!r}")


def _enum_member(name: str, enum_cls, value: Any, allowed: Sequence) -> Any:
    """``enum_cls(value)`` when it is one of ``allowed``; else ``ValueError`` naming ``name``, the
    allowed members and the value."""
    try:
        member = enum_cls(value)
    except ValueError:
        member = None
    if member not in allowed:
        names = ", ".join(m.name for m in allowed)
        raise ValueError(f"{name} must be {enum_cls.__name__} {names}, got {value!r}")
    return member


def _check_int_vector(name: str, t: Any, device: torch.device, cpu_too: bool = False) -> None:
    """Raises ValueError, naming ``name`` and the value, unless ``t`` is a 1-D int32/int64 tensor on
    ``device`` (or, with ``cpu_too``, on the CPU)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got dtype={t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape={tuple(t.shape)}")
    if cpu_too and t.device.type != "cpu" and t.device != device:
        raise ValueError(f"{name} must be on the CPU or on {device} (the tables' device), got "
                         f"device={t.device}")
    if not cpu_too and t.device != device:
        raise ValueError(f"{name} must be on {device} (the tables' device), got device={t.device}")
