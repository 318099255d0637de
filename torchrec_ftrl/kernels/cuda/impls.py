"""The CUDA kernels of the registered ops ``torch.ops.torchrec_ftrl.*`` (:mod:`torchrec_ftrl.kernels.ops`): the Triton
implementations of :mod:`.backend` for ``tbe_forward``, ``tbe_linearize``,
``tbe_backward_update_`` and ``tbe_repair_offsets``, registered with ``torch.library.impl`` (an op
whose CPU kernel is C++ cannot be a ``triton_op``, whose function is its kernel on every device).
``tbe_count_invalid`` keeps its PyTorch implementation there.

Each registered kernel checks the op's arguments (:data:`..arg_checks.BY_OP`) and then runs the
unchecked implementation of :mod:`.backend`, which the TBE's eager steps call directly with the
arguments it built and checked itself (no check on the step's host path). Registered when
``torchrec_ftrl`` is imported; :mod:`.backend` (and Triton) is imported at the first call.
"""

from __future__ import annotations

import torch

from ..arg_checks import BY_OP
from ..ops import NAMESPACE

DISPATCH_KEY = "CUDA"
OPS_WITH_CUDA_KERNELS = ("tbe_forward", "tbe_linearize", "tbe_backward_update_", "tbe_repair_offsets")


def _kernel(name: str):
    check = BY_OP[name]

    def call(*args):
        from . import backend
        check(args)
        return getattr(backend, name)(*args)
    call.__name__ = name
    return call


for _name in OPS_WITH_CUDA_KERNELS:
    torch.library.impl(f"{NAMESPACE}::{_name}", DISPATCH_KEY, _kernel(_name))
