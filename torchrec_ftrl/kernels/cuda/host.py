"""The eager CUDA training step launched from C++: ``csrc/ftrl_tbe_cuda_host.cpp``.

A training step of the Triton backend runs five kernels (``linearize_kernel`` and
``tbe_forward_kernel`` in the forward; ``segment_mark_kernel``, ``segment_update_kernel`` and
``segment_combine_kernel`` after a sort in the backward) and a dozen buffer allocations. In Python
each launch costs tens of microseconds of host time; the C++ ops ``torch.ops.torchrec_ftrl_host``
allocate with ATen and launch Triton's compiled kernels with the CUDA driver's ``cuLaunchKernel`` on
the current stream. ``train_lookup`` is the whole training lookup as one autograd op registered in
C++ (its Autograd kernel a C++ autograd function): Python calls it once per step, and its backward
(``train_backward``, then the TBE's ``iter += 1``) runs without Python. A backward that meets an
unregistered variant, or follows a change of the TBE's knobs since its forward (e.g. a learning
rate set by ``zero_grad``), calls the Python op ``torchrec_ftrl_host_py::backward_fallback``, which
runs the Python path (with the knobs of backward time) and registers the variant. ``train_forward`` and ``train_backward`` are also ops of their own,
which the TBE's Python autograd node calls where the one op is off (:data:`LOOKUP_OP`).

The kernels stay Triton's: the Python path (:mod:`.backend`) compiles and launches them on the
first step of a configuration, and :func:`recorded` registers each compiled kernel it launched
(its ``CUfunction``, threads, shared memory, how each argument is passed) under a *plan* (the
step's static configuration: every constexpr, :func:`plan_id`) and the facts Triton specialises
the launch's arguments on (:func:`signature_of`, the same rule as the C++ ``signature_of``). A later
step whose variants are all registered runs in C++; one that meets an unregistered variant (a new
alignment of a user tensor, an integer class) launches nothing there and runs in Python, which
registers it. A compiled kernel that needs what ``cuLaunchKernel`` alone does not give (Triton's
scratch memory, clusters, PDL) is registered as Python-only.

The C++ source needs only torch's headers (the driver is opened with ``dlopen``); it is built once
per source version and torch version at first use on a CUDA machine
(``torch.utils.cpp_extension.load``, about a minute), saying so on stderr. Where it cannot be built
or loaded, or with ``TORCHREC_FTRL_HOST_PATH=0``, every step runs in Python.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import os
import sys
import threading
import warnings
from typing import Iterator, Optional

import torch
from triton import knobs as triton_knobs

from . import launch

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "ftrl_tbe_cuda_host.cpp")
# The C++ roles (its enum Role), by the Triton kernel each launches.
ROLE_NAMES = ("linearize_kernel", "tbe_forward_kernel", "segment_mark_kernel", "segment_update_kernel",
              "segment_combine_kernel")
ENABLED = os.environ.get("TORCHREC_FTRL_HOST_PATH", "1") != "0"
# False: a training lookup runs as two C++ calls under a Python autograd node instead of the one
# autograd op train_lookup (benchmarks/bench_host.py measures what the op saves).
LOOKUP_OP = True
# Steps by path: "cpp_forward", "python_forward", "cpp_backward", "python_backward".
STATS: collections.Counter = collections.Counter()

_DTYPE_CODES = {torch.float32: "f", torch.float16: "h", torch.bfloat16: "b", torch.int32: "i",
                torch.int64: "l", torch.uint8: "u", torch.bool: "o"}
_I32 = 2 ** 31
_lock = threading.Lock()
_ops = None          # torch.ops.torchrec_ftrl_host once loaded; False: unavailable
_plans: dict = {}    # static configuration -> plan id
_plan_numbers = itertools.count()   # never reset: a plan id names one configuration for the process
_generation = 0      # counts clear()s: a plan made before one is stale
_kept: dict = {}     # id -> each registered compiled kernel, alive while its CUfunction is used


def _build() -> None:
    from torch.utils.cpp_extension import load

    with open(SOURCE, "rb") as f:
        digest = hashlib.sha1(f.read() + SOURCE.encode()).hexdigest()[:10]
    tag = "".join(c if c.isalnum() else "_" for c in torch.__version__)
    print("torchrec_ftrl: loading the CUDA host path (built at first use, about a minute; later runs "
          "reuse the build)", file=sys.stderr, flush=True)
    load(name=f"torchrec_ftrl_cuda_host_{digest}_{tag}", sources=[SOURCE],
         extra_cflags=["-O2", "-std=c++17"], is_python_module=False)


def load():
    """``torch.ops.torchrec_ftrl_host``, building the library at first use; None where it cannot be
    built or loaded (the reason on stderr once)."""
    global _ops
    if _ops is None:
        with _lock:
            if _ops is None:
                try:
                    if not hasattr(torch.ops.torchrec_ftrl_host, "train_forward"):
                        _build()
                    _ops = torch.ops.torchrec_ftrl_host
                except Exception as exc:   # no compiler, no ninja, a build error
                    print(f"torchrec_ftrl: the CUDA host path is unavailable ({exc}); steps launch "
                          "from Python", file=sys.stderr, flush=True)
                    _ops = False
    return _ops or None


def stats() -> collections.Counter:
    """:data:`STATS` with the backward steps of C++ training lookups (counted in C++) added to
    ``cpp_backward``."""
    out = collections.Counter(STATS)
    if _ops:
        out["cpp_backward"] += int(_ops.counts()[0])
    return out


def _no_launch_hook() -> bool:
    hook = triton_knobs.runtime.launch_enter_hook     # None, a function or a chain of them
    return hook is None or not getattr(hook, "calls", True)


def ready(device: torch.device) -> bool:
    """Whether steps on ``device`` may run in C++: an NVIDIA CUDA device (the library opens
    ``libcuda``; not ROCm), the host path enabled, compiled kernels launched directly
    (:data:`.launch.ENABLED`), no Triton launch hook set (a profiler's: C++ launches would skip
    it), the library loaded, not while ``torch.compile`` traces."""
    return (device.type == "cuda" and ENABLED and launch.ENABLED and torch.version.hip is None
            and _no_launch_hook() and not torch.compiler.is_compiling()
            and load() is not None)


def plan_id(key: tuple) -> int:
    """The plan number of a static configuration ``key`` (hashable: everything the kernels'
    constexprs and launch options depend on). Numbers are not reused after :func:`clear`: a
    training lookup's backward made before it must not find another configuration's kernels."""
    plan = _plans.get(key)
    if plan is None:
        with _lock:
            plan = _plans.get(key)
            if plan is None:
                plan = _plans[key] = next(_plan_numbers)
    return plan


def generation() -> int:
    """The number of :func:`clear` calls so far: a plan made under another number is stale."""
    return _generation


def clear() -> None:
    """Forget every plan and registered variant: steps register their kernels afresh (after an
    in-place edit of :data:`.backend.TUNING`'s nested entries; a replaced entry makes new plans by
    itself)."""
    global _generation
    with _lock:
        _plans.clear()
        _generation += 1
        if _ops:
            _ops.clear_variants()


def signature_of(args: tuple) -> Optional[str]:
    """The facts Triton specialises ``args`` on, two characters each: a tensor's dtype and whether
    its address is a multiple of 16 (``A`` / ``U``); an integer's width (``I`` int32, ``J``
    int64) and value class (``1``, ``D`` a multiple of 16, ``N`` other). None for another kind."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            code = _DTYPE_CODES.get(a.dtype)
            if code is None:
                return None
            out.append(code + ("A" if a.data_ptr() % 16 == 0 else "U"))
        elif type(a) is int:
            out.append(("I" if -_I32 <= a < _I32 else "J") + ("1" if a == 1 else "D" if a % 16 == 0 else "N"))
        else:
            return None
    return "".join(out)


def kinds_of(kernel, compiled, nargs: int) -> Optional[str]:
    """How each of the ``nargs`` positional arguments of ``compiled`` (a Triton ``CompiledKernel``
    of ``kernel``) is passed: ``P`` pointer, ``i`` int32, ``l`` int64, ``x`` not passed (a
    constexpr); None where ``cuLaunchKernel`` alone cannot launch it."""
    md = compiled.metadata
    if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "global_scratch_size", 0)
            or getattr(md, "profile_scratch_size", 0) or getattr(md, "launch_pdl", False)
            or getattr(md, "launch_cooperative_grid", False)):
        return None
    sig, names = compiled.src.signature, kernel.arg_names
    if any(sig.get(name, "constexpr") != "constexpr" for name in names[nargs:]):
        return None
    kinds = {"i32": "i", "i64": "l", "constexpr": "x"}
    out = []
    for name in names[:nargs]:
        ty = sig[name]
        kind = "P" if ty.startswith("*") else kinds.get(ty)
        if kind is None:
            return None
        out.append(kind)
    return "".join(out)


def _register(plan: int, records: list) -> None:
    ops = load()
    for kernel, compiled, args, device in records:
        name = getattr(kernel, "__name__", None)
        if name not in ROLE_NAMES:
            continue
        sig = signature_of(args)
        if sig is None:
            continue
        kinds = kinds_of(kernel, compiled, len(args)) if compiled is not None else None
        if kinds is None:
            ops.register_variant(plan, ROLE_NAMES.index(name), device, sig, 0, 0, 0, "")
            continue
        compiled._init_handles()
        _kept[id(compiled)] = compiled   # once, however often it registers
        ops.register_variant(plan, ROLE_NAMES.index(name), device, sig, int(compiled.function),
                             32 * int(compiled.metadata.num_warps), int(compiled.metadata.shared), kinds)


@contextlib.contextmanager
def recorded(plan: Optional[int]) -> Iterator[None]:
    """Run the block (a step on the Python path); with a ``plan``, register the kernels it launched
    (on this thread) under it once the block completes. A registration that fails turns the host
    path off for the process, with a warning: the step itself has completed."""
    global ENABLED
    if plan is None:
        yield
        return
    with launch.recording() as records:
        yield
    try:
        _register(plan, records)
    except Exception as exc:   # a Triton whose compiled kernels this module cannot read
        ENABLED = False
        warnings.warn(f"torchrec_ftrl: the CUDA host path is off ({exc!r}); steps launch from Python",
                      RuntimeWarning, stacklevel=3)
