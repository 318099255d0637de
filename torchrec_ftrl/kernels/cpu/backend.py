"""Compiled CPU backend of the FTRL TBE: the ``CPU`` kernels of the registered ops
``torch.ops.torchrec_ftrl.*`` (:mod:`torchrec_ftrl.kernels.ops`), from ``csrc/ftrl_tbe_cpu.cpp``.

:func:`load_extension` loads the library variant for this CPU's vector ISA that ``setup.py`` built
when the package was installed (:mod:`.build`). In a source checkout without such a build (or
for another torch version) it builds that variant once with ``torch.utils.cpp_extension.load`` into
the torch extensions directory (``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), saying
so on stderr; later processes reuse the build. That needs a C++17 compiler and ninja;
:func:`torchrec_ftrl.kernels.backend.resolve_backend` falls back to the PyTorch backend with a warning
when it raises.

Its :data:`OPS` are the ops by the dispatcher, for every row layout (stored or derived weights,
element-wise or row-wise ``accum``; template flags of the kernels); the kernels take no fused
check, linearised batch or cache (:data:`CAPABILITIES`). Its rule and
stochastic-rounding hash are ``csrc/ftrl_rule_gen.h``, generated from :mod:`torchrec_ftrl.rule_spec` (the ``IEEE``
form: the operations of :func:`torchrec_ftrl.rule.ftrl_rule`, :func:`~torchrec_ftrl.rule.ftrl_rule_rowwise`
and :func:`~torchrec_ftrl.rule.ftrl_prox` in their order, in fp32), computed from
:meth:`~torchrec_ftrl.hyperparams.FTRLHyperparams.kernel_scalars`. States are fp32 or bf16: a bf16
state loads exactly into fp32 and is stored with stochastic rounding with the bits of
:func:`torchrec_ftrl.state_dtype.sr_bits` (instantiations per state dtype; the fp32 ones unchanged).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import sys
import threading

import torch

from ...row_layout import KERNEL_LAYOUTS
from . import build
from .. import ops  # noqa: F401  (ops: the schemas the library implements)
from ..capabilities import Capabilities, OpTable

CAPABILITIES = Capabilities(layouts=KERNEL_LAYOUTS)

_lock = threading.Lock()
_library: str | None = None


@contextlib.contextmanager
def _interpreter_bin_first_on_path():
    """Build with the ninja installed beside this Python (the ``ninja`` dependency) whatever ``PATH``
    says: two ninja versions read each other's build log as stale, so processes that found different
    ninjas would rebuild the shared extension in turn."""
    bindir = os.path.dirname(sys.executable)
    old = os.environ.get("PATH", "")
    if os.path.isfile(os.path.join(bindir, "ninja")):
        os.environ["PATH"] = bindir + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _prebuilt(isa: str) -> str | None:
    """Path of the library variant ``setup.py`` built for ``isa`` and this torch, or None."""
    stem = build.library_name(isa, torch.__version__)
    kernels_dir = os.path.dirname(os.path.dirname(build.SOURCE))
    found = sorted(glob.glob(os.path.join(kernels_dir, stem + ".*")))
    return found[0] if found else None


def _build_at_first_use(isa: str) -> str:
    """Build (first call per source version) the ``isa`` variant into the torch extensions directory,
    load it, and return its path. The build's name carries a hash of the source and one of its path,
    so an edited source or header never loads a stale build and two checkouts keep one build each."""
    from torch.utils.cpp_extension import load

    digest = build.source_digest() + hashlib.sha1(build.SOURCE.encode()).hexdigest()[:6]
    print(f"torchrec_ftrl: no prebuilt CPU kernel for this install (torch {torch.__version__}, {isa}); "
          "building it once (one to two minutes; later runs reuse it)", file=sys.stderr, flush=True)
    name = f"torchrec_ftrl_tbe_cpu_{digest}_{isa}"
    with _interpreter_bin_first_on_path():
        path = load(name=name, sources=[build.SOURCE],
                    extra_cflags=build.BASE_FLAGS + build.ISA_FLAGS[isa],
                    extra_ldflags=build.LINK_FLAGS, is_python_module=False)
    return path or name     # torch versions that load without returning the path


def load_extension() -> str:
    """Load the CPU kernels of ``torch.ops.torchrec_ftrl.*`` once per process; returns the library's
    path.

    Raises:
        RuntimeError / OSError / ImportError: no prebuilt variant and no compiler or ninja, or the
            build failed.
    """
    global _library
    if _library is not None:
        return _library
    with _lock:
        if _library is None:
            isa = build.isa_variant(torch.backends.cpu.get_cpu_capability())
            path = _prebuilt(isa)
            if path is not None:
                torch.ops.load_library(path)
            else:
                path = _build_at_first_use(isa)
            _library = path
    return _library


def _dispatched(name: str, takes_hp: bool = False):
    """The op ``name`` by the dispatcher, its compiled CPU kernel loaded first. ``takes_hp``: the
    :class:`~torchrec_ftrl.kernels.capabilities.OpTable` entry takes the hyper-parameters first
    (unused: the kernel reads the knob tensor)."""
    op = getattr(torch.ops.torchrec_ftrl, name).default

    def call(*args):
        if _library is None:
            load_extension()
        return op(*args[1:] if takes_hp else args)
    call.__name__ = name
    return call


# The compiled CPU kernels: forward, backward update and count; the offsets repair is the ops'
# PyTorch implementation; there is no tbe_linearize (CAPABILITIES.linearizes is False).
OPS = OpTable(forward=_dispatched("tbe_forward", True), linearize=_dispatched("tbe_linearize"),
              backward_update_=_dispatched("tbe_backward_update_", True),
              count_invalid=_dispatched("tbe_count_invalid"),
              repair_offsets=_dispatched("tbe_repair_offsets"))
