"""Kernels of the fused FTRL TBE: the PyTorch update rule, the compiled CPU kernel, Triton CUDA kernels.

Importing the package registers the ops ``torch.ops.torchrec_ftrl.*`` (:mod:`.ops`) with their
PyTorch fallback (:mod:`.composite`), so they run on every device before any backend loads."""

from . import composite, ops  # noqa: F401  (registrations)
