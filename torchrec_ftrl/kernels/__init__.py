"""Kernels of the fused FTRL TBE: the PyTorch update rule, the compiled CPU kernel, Triton CUDA kernels.

Importing the package registers the ops ``torch.ops.torchrec_ftrl.*`` (:mod:`.ops`: schemas and Meta
implementations). Their PyTorch fallback (:mod:`.composite`) registers when ``torchrec_ftrl`` is
imported (it needs :mod:`torchrec_ftrl.hyperparams`, which reads :mod:`.rule_spec` from here), so
the ops run on every device before any backend loads."""

from . import ops  # noqa: F401  (registrations)
