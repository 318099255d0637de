"""Kernels of the fused FTRL TBE: the PyTorch update rule, the compiled CPU kernel, Triton CUDA kernels.

Importing the package registers the ops ``torch.ops.torchrec_ftrl.*`` (:mod:`.ops`: schemas and Meta
implementations). Their PyTorch fallback (:mod:`.composite`) and their CUDA implementations by the
Triton backend (:mod:`.cuda_impls`) register when ``torchrec_ftrl`` is imported (they need
:mod:`torchrec_ftrl.hyperparams`, which reads :mod:`.rule_spec` from here), so the ops run on every
device before any backend loads; the compiled CPU kernel registers when it is loaded."""

from . import ops  # noqa: F401  (registrations)
