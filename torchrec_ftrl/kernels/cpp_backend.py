"""Compiled CPU backend of the FTRL TBE: the ``CPU`` kernels of the registered ops
``torch.ops.torchrec_ftrl.*`` (:mod:`.ops`), from ``csrc/ftrl_tbe_cpu.cpp``.

:func:`load_extension` loads the library variant for this CPU's vector ISA that ``setup.py`` built
when the package was installed (:mod:`.cpu_build`). In a source checkout without such a build (or
for another torch version) it builds that variant once with ``torch.utils.cpp_extension.load`` into
the torch extensions directory (``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), saying
so on stderr; later processes reuse the build. That needs a C++17 compiler and ninja;
:func:`torchrec_ftrl.kernels.backend.resolve_backend` falls back to the PyTorch backend with a warning
when it raises.

Implements :class:`~torchrec_ftrl.kernels.backend.Backend` for every row layout (stored or derived
weights, element-wise or row-wise ``accum``; template flags of the kernels). Its rule and
stochastic-rounding hash are ``csrc/ftrl_rule_gen.h``, generated from :mod:`.rule_spec` (the ``IEEE``
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

from typing import Any

from ..hyperparams import FTRLHyperparams
from ..row_layout import KERNEL_LAYOUTS
from . import cpu_build, ops  # noqa: F401  (ops: the schemas the library implements)
from .capabilities import Capabilities
from .layout import TableArrays, TBEBatch
from .torch_backend import per_sample_weight_grad  # noqa: F401  (the Backend member, shared)

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
    stem = cpu_build.library_name(isa, torch.__version__)
    kernels_dir = os.path.dirname(os.path.dirname(cpu_build.SOURCE))
    found = sorted(glob.glob(os.path.join(kernels_dir, stem + ".*")))
    return found[0] if found else None


def _build_at_first_use(isa: str) -> str:
    """Build (first call per source version) the ``isa`` variant into the torch extensions directory,
    load it, and return its path. The build's name carries a hash of the source and one of its path,
    so an edited source or header never loads a stale build and two checkouts keep one build each."""
    from torch.utils.cpp_extension import load

    digest = cpu_build.source_digest() + hashlib.sha1(cpu_build.SOURCE.encode()).hexdigest()[:6]
    print(f"torchrec_ftrl: no prebuilt CPU kernel for this install (torch {torch.__version__}, {isa}); "
          "building it once (one to two minutes; later runs reuse it)", file=sys.stderr, flush=True)
    name = f"torchrec_ftrl_tbe_cpu_{digest}_{isa}"
    with _interpreter_bin_first_on_path():
        path = load(name=name, sources=[cpu_build.SOURCE],
                    extra_cflags=cpu_build.BASE_FLAGS + cpu_build.ISA_FLAGS[isa],
                    extra_ldflags=cpu_build.LINK_FLAGS, is_python_module=False)
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
            isa = cpu_build.isa_variant(torch.backends.cpu.get_cpu_capability())
            path = _prebuilt(isa)
            if path is not None:
                torch.ops.load_library(path)
            else:
                path = _build_at_first_use(isa)
            _library = path
    return _library


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
    load_extension()
    return int(torch.ops.torchrec_ftrl.tbe_count_invalid(table_rows, feature_table, bag_feature.contiguous(),
                                                         indices.contiguous(), offsets.contiguous()))


def _arrays(arrays: TableArrays) -> tuple:
    """The ``weights?, accum, linear, rowwise`` arguments of the ops (:mod:`.ops`)."""
    return arrays.weights, arrays.accum, arrays.linear, bool(arrays.rowwise)


def forward(arrays: TableArrays, batch: TBEBatch, out_dtype: torch.dtype,
            hp: FTRLHyperparams) -> torch.Tensor:
    """Pooled (SUM/MEAN) or sequence (NONE) lookup, fp32 accumulation, of stored weights or of
    weights derived as ``prox(linear, accum)`` with ``hp`` in fp32 (the bits the update of a stored
    layout writes).

    Returns:
        the flat output ``[batch.out_numel]`` in ``out_dtype``: bag ``k``'s ``D``-vector at
        ``batch.bag_out_offset[k]`` (index ``i`` at ``i * max_D`` for NONE); empty bags give zeros.
    """
    load_extension()
    return torch.ops.torchrec_ftrl.tbe_forward(
        *_arrays(arrays), batch.table_w_offset, batch.table_dim, batch.feature_table,
        batch.bag_feature.contiguous(), batch.bag_out_offset.contiguous(), batch.indices.contiguous(),
        batch.offsets.contiguous(), _psw(batch), int(batch.pooling_mode), int(batch.max_D),
        batch.table_row_base.contiguous(), *hp.kernel_scalars(), int(batch.out_numel), out_dtype)


def forward_train(arrays: TableArrays, batch: TBEBatch, out_dtype: torch.dtype,
                  hp: FTRLHyperparams) -> tuple[torch.Tensor, None]:
    """:func:`forward`; nothing is kept for the backward (context None)."""
    return forward(arrays, batch, out_dtype, hp), None


def backward_update_(arrays: TableArrays, batch: TBEBatch, ctx: Any, grad_out: torch.Tensor,
                     hp: FTRLHyperparams, nonfinite_rows: torch.Tensor) -> None:
    """In place: sum the gradient of every touched (table, row), then ONE FTRL update per row.

    Args:
        arrays: every row layout (:class:`~.layout.TableArrays`): weights flat ``[total]``
            fp32/fp16/bf16, or None (derived: only n and z are written); linear (z) flat ``[total]``
            and accum (n) flat ``[total]`` or row-wise ``[batch.total_rows]``, each fp32 or bf16
            (bf16 ones stored by stochastic rounding with step ``batch.step``).
        grad_out: flat ``[batch.out_numel]`` gradient of the forward output (fp32/fp16/bf16).
        nonfinite_rows: int64 ``[1]``, incremented by the number of rows skipped because their summed
            gradient holds a NaN/Inf (those rows are left bit-for-bit unchanged).

    Raises:
        ValueError: a bf16 state and ``batch.step`` None.
    """
    if batch.indices.numel() == 0:
        return
    compact = torch.bfloat16 in (arrays.accum.dtype, arrays.linear.dtype)
    if compact and batch.step is None:
        raise ValueError("a bf16 optimizer state needs batch.step (the TBE's iter) for its "
                         "stochastic rounding, got None")
    step = int(batch.step) if compact else 0   # a CPU tensor: no device sync
    load_extension()
    torch.ops.torchrec_ftrl.tbe_backward_update_(
        *_arrays(arrays), batch.table_w_offset, batch.table_dim, batch.table_rows,
        batch.feature_table, batch.bag_feature.contiguous(), batch.bag_out_offset.contiguous(),
        batch.indices.contiguous(), batch.offsets.contiguous(), _psw(batch), int(batch.pooling_mode),
        int(batch.max_D), grad_out.contiguous(), *hp.kernel_scalars(), nonfinite_rows, step)
