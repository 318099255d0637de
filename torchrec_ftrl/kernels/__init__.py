"""Kernels of the fused FTRL TBE, by job. On top, what the TBE reads: :mod:`.ops` (the op schemas
``torch.ops.torchrec_ftrl.*`` and their Meta implementations), :mod:`.calls` (the TBE's calls of
them), :mod:`.capabilities` and :mod:`.backend` (what each backend supports; the choice of one),
:mod:`.knobs` (the knob tensor) and :mod:`.batch` (the batch layout every kernel reads). Below:

* :mod:`.codegen`: generates the rule of the C++ and Triton kernels from :mod:`torchrec_ftrl.rule_spec`;
* :mod:`.cpu`: the compiled C++ kernel (sources, build, loader), the ops' ``CPU`` implementation;
* :mod:`.cuda`: the Triton kernels (forward, backward, cache, launch), the ops' ``CUDA`` implementation;
* :mod:`.pytorch`: the ops' ``CompositeExplicitAutograd`` implementation, by torch ops.

Importing the package registers the ops with their PyTorch and CUDA implementations, so they run on
every device before any backend loads (Triton itself is imported at the first CUDA call); the
compiled CPU kernel registers when it is loaded (:func:`.cpu.backend.load_extension`).
"""

from . import ops  # noqa: F401  (the schemas first: the implementations register against them)
from .cuda import impls as _cuda_impls  # noqa: F401
from .pytorch import composite as _composite  # noqa: F401
