"""The CUDA implementations of the registered ops ``torch.ops.torchrec_ftrl.tbe_forward`` and
``tbe_backward_update_`` (:mod:`.ops`): the Triton backend (:mod:`.triton_backend`), through
:func:`.composite.implementations`, so an op called on CUDA tensors runs the Triton kernels that
``backend="triton"`` runs. ``tbe_count_invalid`` keeps its composite implementation there (torch ops).

Registered when ``torchrec_ftrl`` is imported; :mod:`.triton_backend` itself is imported at the
first call.

The TBE does not call these: ``FTRLTableBatchedEmbeddingBags`` calls the Triton backend's own ops,
which also fuse the bounds check and keep the linearised batch from the forward for the backward.
"""

from __future__ import annotations

import torch

from .composite import implementations
from .ops import NAMESPACE

DISPATCH_KEY = "CUDA"


def _triton_backend():
    from . import triton_backend
    return triton_backend


tbe_forward, _, tbe_backward_update_ = implementations(_triton_backend)

for _impl in (tbe_forward, tbe_backward_update_):
    torch.library.impl(f"{NAMESPACE}::{_impl.__name__}", DISPATCH_KEY, _impl)
