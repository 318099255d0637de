"""The kernel backends of the FTRL TBE, as data, and the choice of one.

A backend is a :class:`Backend` record: how it runs the ops (:class:`~.capabilities.OpTable`, every
entry with its op's schema, :mod:`.ops`) and what it supports (:class:`~.capabilities.Capabilities`).
The TBE reaches the kernels only through :mod:`.calls`, which turns its batch into the ops' arguments
the same way for every backend and reads the capabilities, never a backend's name.

* ``"triton"`` (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``, eager only: a compiled
  graph calls the ops, whose CPU kernels are the others): :mod:`.cuda.backend`.
* ``"cpp"`` (CPU): the ops by the dispatcher, whose CPU kernels are the compiled
  ``cpu/csrc/ftrl_tbe_cpu.cpp`` (:mod:`.cpu.backend`).
* ``"torch"`` (any device): the ops' vectorised PyTorch implementation, called directly
  (:mod:`.pytorch.composite`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import warnings

import torch

from .capabilities import Capabilities, OpTable

BACKENDS = ("triton", "cpp", "torch")
_MODULES = {"triton": "cuda.backend", "cpp": "cpu.backend", "torch": "pytorch.composite"}
_warned = False


@dataclasses.dataclass(frozen=True)
class Backend:
    """A kernel backend: its name (for messages), its ops and its capabilities."""

    name: str
    ops: OpTable
    capabilities: Capabilities


def _load(name: str) -> Backend:
    module = importlib.import_module(f".{_MODULES[name]}", __package__)
    if name == "cpp":
        module.load_extension()
    return Backend(name, module.OPS, module.CAPABILITIES)


def resolve_backend(name: str | None, device: torch.device) -> Backend:
    """The backend ``name`` for tables on ``device``. ``None`` picks triton on CUDA, cpp elsewhere,
    falling back to torch with a one-time warning when the CPU kernel cannot be compiled.

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
            return _load("cpp")
        except Exception as exc:  # no compiler, no ninja, build error
            if not _warned:
                warnings.warn(f"torchrec_ftrl: compiled CPU FTRL kernel unavailable ({exc}); "
                              "using the vectorised PyTorch path", RuntimeWarning, stacklevel=3)
                _warned = True
            return _load("torch")
    return _load(name)
