"""Compiled CPU backend of the FTRL TBE: ``csrc/ftrl_tbe_cpu.cpp`` built at first use.

:func:`load_extension` compiles the C++ source with ``torch.utils.cpp_extension.load`` (``-O3``,
OpenMP through ATen's ``at::parallel_for``) into the default torch extensions directory
(``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), so later processes reuse the build.
It needs a C++17 compiler and ninja; :func:`torchrec_ftrl.kernels.backend.resolve_backend` falls back
to the PyTorch backend with a warning when this raises.

Implements :class:`~torchrec_ftrl.kernels.backend.Backend`. The C++ ``ftrl_element`` is the twin of
:func:`torchrec_ftrl.rule.ftrl_rule`, computed in fp32, from
:meth:`~torchrec_ftrl.hyperparams.FTRLHyperparams.kernel_scalars`. States are fp32 or bf16: a bf16
state loads exactly into fp32 and is stored with stochastic rounding by the uint32 twin of
:func:`torchrec_ftrl.state_dtype.sr_bits` (instantiations per state dtype; the fp32 ones unchanged).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import threading
from types import ModuleType

import torch

from typing import Any

from ..hyperparams import FTRLHyperparams
from .layout import TBEBatch
from .torch_backend import per_sample_weight_grad  # noqa: F401  (the Backend member, shared)

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "ftrl_tbe_cpu.cpp")
_lock = threading.Lock()
_ext: ModuleType | None = None


# -fno-math-errno / -fno-trapping-math let the FTRL loop over D vectorise (sqrt, the |z| > l1 select);
# they change no result. -ffp-contract=off keeps the rule's roundings (no FMA contraction).
_BASE_FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
               "-ffp-contract=off"]
# Vector ISA of the machine that builds (ATen's own CPU capability probe); part of the build's name,
# so a shared extensions directory never hands a build to a CPU that lacks its instructions.
_ISA_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c",
                         "-mprefer-vector-width=512"],
              "avx2": ["-mavx2", "-mfma", "-mf16c"]}


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


def load_extension(verbose: bool = False) -> ModuleType:
    """Build (first call per source version) or load the compiled kernel; returns the module.

    The module name carries a hash of the source and of its path, so an edited ``.cpp`` never loads
    a stale build, and two installs (a checkout and a wheel, two venvs) keep one build each instead
    of rebuilding each other's (the build records the source's absolute path).

    Raises:
        RuntimeError / OSError / ImportError: no compiler or ninja, or the build failed.
    """
    global _ext
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is None:
            from torch.utils.cpp_extension import load

            with open(_SOURCE, "rb") as f:
                digest = hashlib.sha1(f.read() + os.path.abspath(_SOURCE).encode()).hexdigest()[:10]
            isa = re.sub(r"[^a-z0-9]", "", torch.backends.cpu.get_cpu_capability().lower())
            with _interpreter_bin_first_on_path():
                _ext = load(name=f"torchrec_ftrl_tbe_cpu_{digest}_{isa}", sources=[_SOURCE],
                            extra_cflags=_BASE_FLAGS + _ISA_FLAGS.get(isa, []),
                            extra_ldflags=["-fopenmp"], verbose=verbose)
    return _ext


def _psw(batch: TBEBatch):
    p = batch.per_sample_weights
    return None if p is None else p.float().contiguous()


def fuses_bounds_check(mode: Any, needs_psw_grad: bool) -> bool:
    """Never: the TBE checks the batch (with :func:`count_invalid` as the FATAL fast path)."""
    return False


def count_invalid(table_rows: torch.Tensor, feature_table: torch.Tensor, bag_feature: torch.Tensor,
                  indices: torch.Tensor, offsets: torch.Tensor) -> int:
    """Number of problems in int64 ``offsets``/``indices`` (bad offsets, indices outside their table);
    0 when the batch is valid. Parallel, read-only: the FATAL bounds check's fast path."""
    return int(load_extension().count_invalid(table_rows, feature_table, bag_feature.contiguous(),
                                              indices.contiguous(), offsets.contiguous()))


def forward(weights: torch.Tensor, batch: TBEBatch, out_dtype: torch.dtype) -> torch.Tensor:
    """Pooled (SUM/MEAN) or sequence (NONE) lookup, fp32 accumulation.

    Returns:
        the flat output ``[batch.out_numel]`` in ``out_dtype``: bag ``k``'s ``D``-vector at
        ``batch.bag_out_offset[k]`` (index ``i`` at ``i * max_D`` for NONE); empty bags give zeros.
    """
    ext = load_extension()
    if batch.num_bags > 0 and batch.indices.numel() > 0:
        out = torch.empty(batch.out_numel, dtype=out_dtype, device=weights.device)
    else:
        out = torch.zeros(batch.out_numel, dtype=out_dtype, device=weights.device)
    ext.forward(weights, batch.table_w_offset, batch.table_dim, batch.feature_table,
                batch.bag_feature.contiguous(), batch.bag_out_offset.contiguous(),
                batch.indices.contiguous(), batch.offsets.contiguous(), _psw(batch),
                int(batch.pooling_mode), int(batch.max_D), out)
    return out


def forward_train(weights: torch.Tensor, batch: TBEBatch, out_dtype: torch.dtype) -> tuple[torch.Tensor, None]:
    """:func:`forward`; nothing is kept for the backward (context None)."""
    return forward(weights, batch, out_dtype), None


def backward_update_(weights: torch.Tensor, accum: torch.Tensor, linear: torch.Tensor,
                     batch: TBEBatch, ctx: Any, grad_out: torch.Tensor, hp: FTRLHyperparams,
                     nonfinite_rows: torch.Tensor) -> None:
    """In place: sum the gradient of every touched (table, row), then ONE FTRL update per row.

    Args:
        weights: flat ``[total]`` fp32/fp16/bf16. accum, linear: flat ``[total]`` fp32 or bf16 (n
            and z; bf16 ones stored by stochastic rounding with step ``batch.step``).
        grad_out: flat ``[batch.out_numel]`` gradient of the forward output (fp32/fp16/bf16).
        nonfinite_rows: int64 ``[1]``, incremented by the number of rows skipped because their summed
            gradient holds a NaN/Inf (those rows are left bit-for-bit unchanged).

    Raises:
        ValueError: a bf16 state and ``batch.step`` None.
    """
    if batch.indices.numel() == 0:
        return
    compact = torch.bfloat16 in (accum.dtype, linear.dtype)
    if compact and batch.step is None:
        raise ValueError("a bf16 optimizer state needs batch.step (the TBE's iter) for its "
                         "stochastic rounding, got None")
    step = int(batch.step) if compact else 0   # a CPU tensor: no device sync
    ext = load_extension()
    ext.backward_update(weights, accum, linear, batch.table_w_offset, batch.table_dim,
                        batch.table_rows, batch.feature_table, batch.bag_feature.contiguous(),
                        batch.bag_out_offset.contiguous(), batch.indices.contiguous(),
                        batch.offsets.contiguous(), _psw(batch), int(batch.pooling_mode),
                        int(batch.max_D), grad_out.contiguous(), *hp.kernel_scalars(), nonfinite_rows,
                        step)
