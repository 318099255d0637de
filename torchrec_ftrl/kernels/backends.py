"""Choice of kernel backend for the FTRL TBE: "triton" (CUDA tensors), "cpp" (compiled CPU kernel),
"torch" (vectorised PyTorch, any device). Each backend module exposes
``forward(weights, batch, out_dtype)`` and
``backward_update_(weights, accum, linear, batch, grad_out, hp, nonfinite_rows)``; optionally
``forward_train(weights, batch, out_dtype)``, the forward of a step whose backward follows (it may
leave precomputed backward inputs on ``batch``).
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

import torch

BACKENDS = ("triton", "cpp", "torch")
_warned = False


def _load(name: str) -> ModuleType:
    return importlib.import_module(f".{name}_backend", __package__)


def resolve_backend(name: str | None, device: torch.device) -> tuple[str, ModuleType]:
    """Return ``(name, module)``. ``None`` picks triton on CUDA, cpp elsewhere, falling back to torch
    with a one-time warning when the CPU kernel cannot be compiled.

    Raises:
        ValueError: unknown backend name, or triton asked for a non-CUDA device.
    """
    global _warned
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {name!r}")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend='triton' needs a CUDA device (or TRITON_INTERPRET=1), "
                         f"got device={device}")
    if name is None and device.type == "cuda":
        name = "triton"
    if name is None:
        try:
            mod = _load("cpp")
            mod.load_extension()
            return "cpp", mod
        except Exception as exc:  # no compiler, no ninja, build error
            if not _warned:
                warnings.warn(f"torchrec_ftrl: compiled CPU FTRL kernel unavailable ({exc}); "
                              "using the vectorised PyTorch path", RuntimeWarning, stacklevel=3)
                _warned = True
            return "torch", _load("torch")
    mod = _load(name)
    if name == "cpp":
        mod.load_extension()
    return name, mod
