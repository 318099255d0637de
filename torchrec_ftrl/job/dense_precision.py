"""``--dense-precision {fp32,tf32,bf16}``: the arithmetic of the dense part of a DLRM (bottom MLP,
interaction or DCN cross network, top MLP), for the CTR job and ``benchmarks/quality.py``.

* ``fp32``: float32 matmuls (on CUDA with TF32 switched off).
* ``tf32``: float32 tensors, CUDA matmuls on TF32 tensor cores (10-bit mantissa products, fp32
  accumulation and range); process-wide, set once by :func:`set_matmul_precision`. CUDA only.
* ``bf16``: ``torch.autocast(device_type, dtype=torch.bfloat16)`` around the dense part only
  (:func:`dense_autocast`): the matmuls run in bf16, parameters (master weights) stay fp32, the
  embedding lookup and its pooled outputs stay fp32 (the fused sparse optimizer sees fp32 gradients),
  and the logits are cast to fp32 before the loss.

No flag (``None``) means the device's default (:func:`resolve`): :data:`CPU_DEFAULT_DENSE_PRECISION`
on the CPU, :data:`CUDA_DEFAULT_DENSE_PRECISION` on CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import ContextManager, Optional

import torch

DENSE_PRECISIONS = ("fp32", "tf32", "bf16")
FLAG = "--dense-precision"
CPU_DEFAULT_DENSE_PRECISION = "fp32"    # TF32 is a CUDA tensor-core format
# On CUDA: bf16, the fastest of the three, whose AUC matched fp32's (docs/quality.md#dense-precision).
CUDA_DEFAULT_DENSE_PRECISION = "bf16"
HELP = (f"arithmetic of the dense part (bottom MLP, interaction / DCN, top MLP): fp32; tf32 (CUDA "
        f"TF32 matmuls); bf16 (autocast; embeddings, loss and master weights stay fp32). "
        f"default: {CPU_DEFAULT_DENSE_PRECISION} on the CPU and {CUDA_DEFAULT_DENSE_PRECISION} on "
        f"CUDA")


def add_flag(parser) -> None:
    """Add ``--dense-precision`` (choices :data:`DENSE_PRECISIONS`, default None: the device's) to
    ``parser`` (an ``argparse`` parser or argument group); its value is ``args.dense_precision``."""
    parser.add_argument(FLAG, choices=DENSE_PRECISIONS, default=None, help=HELP)


def resolve(flag_value: Optional[str], device_type: str) -> str:
    """The precision a run uses: ``flag_value``, or for None the default of ``device_type``
    (``"cuda"``: :data:`CUDA_DEFAULT_DENSE_PRECISION`; any other: :data:`CPU_DEFAULT_DENSE_PRECISION`).

    Raises:
        ValueError: ``flag_value`` not None and not in :data:`DENSE_PRECISIONS`.
    """
    if flag_value is None:
        return CUDA_DEFAULT_DENSE_PRECISION if device_type == "cuda" else CPU_DEFAULT_DENSE_PRECISION
    if flag_value not in DENSE_PRECISIONS:
        raise ValueError(f"{FLAG} must be one of {', '.join(DENSE_PRECISIONS)}, got {flag_value!r}")
    return flag_value


def unsupported_reason(precision: str, device: torch.device) -> Optional[str]:
    """Why ``device`` cannot run ``precision`` (one line naming the flag and the value), or None.

    ``tf32`` needs a CUDA device; ``bf16`` on CUDA needs ``torch.cuda.is_bf16_supported()`` on
    ``device`` (CPU autocast runs bf16 on every CPU).
    """
    device = torch.device(device)
    if precision == "tf32" and device.type != "cuda":
        return (f"{FLAG} tf32 needs a CUDA device (TF32 is a CUDA tensor-core format); this run is on "
                f"the {device.type.upper()}: use fp32 or bf16")
    if precision == "bf16" and device.type == "cuda" and not cuda_bf16_supported(device):
        return (f"{FLAG} bf16: {torch.cuda.get_device_name(device)} has no bf16 support "
                f"(torch.cuda.is_bf16_supported() is False): use fp32 or tf32")
    return None


def cuda_bf16_supported(device: torch.device, native: bool = False) -> bool:
    """``torch.cuda.is_bf16_supported()`` of the CUDA ``device`` (its index, else the current one);
    ``native``: bf16 in hardware only (``including_emulation=False``: compute capability 8.0 and
    later), not the emulation torch otherwise counts."""
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported(including_emulation=not native)


def resolve_on_device(flag_value: Optional[str], device: torch.device) -> str:
    """:func:`resolve` for a run on ``device``: ``flag_value`` as given; for None the device's
    default, where on CUDA :data:`CUDA_DEFAULT_DENSE_PRECISION` (bf16) needs native bf16
    (:func:`cuda_bf16_supported` ``native``) and a GPU without it defaults to fp32 (emulated bf16
    runs slower than fp32)."""
    device = torch.device(device)
    precision = resolve(flag_value, device.type)
    if (flag_value is None and precision == "bf16" and device.type == "cuda"
            and not cuda_bf16_supported(device, native=True)):
        return "fp32"
    return precision


def set_matmul_precision(precision: str, device_type: str) -> None:
    """Set the process-wide CUDA TF32 switches for ``precision`` (once, before training): on for
    ``tf32``, off for ``fp32`` and ``bf16`` (autocast runs the dense matmuls in bf16, and the fp32
    matmuls outside it stay fp32). Nothing on the CPU, whose fp32 matmuls are fp32 whatever the flag."""
    if device_type != "cuda":
        return
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def dense_autocast(precision: str, device_type: str) -> ContextManager:
    """The context the dense part runs in: ``torch.autocast(device_type, dtype=torch.bfloat16)`` for
    ``bf16``, else a no-op context (``fp32`` and ``tf32`` run the fp32 ops as they are)."""
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def dlrm_logits(dlrm: torch.nn.Module, dense: torch.Tensor, embed, precision: str,
                device_type: str) -> torch.Tensor:
    """The logits of a DLRM-shaped module (``dense_arch``, ``inter_arch(dense_features=,
    sparse_features=)``, ``over_arch``: TorchRec's ``DLRM`` / ``DLRM_DCN`` and the quality study's
    ``SparseDLRM``): ``embed()`` (the embedding lookup, outside autocast: its pooled outputs stay
    fp32), then :func:`dense_logits`. ``device_type`` is given, not read from ``dense``: TorchRec's
    train pipelines trace this forward with proxies.

    ``dense``: ``[B, dense_in]`` float32; ``embed``: a callable returning the pooled embeddings
    (``KeyedTensor`` or ``[B, F, D]``, whatever ``inter_arch`` takes). Returns ``[B]`` float32.
    """
    return dense_logits(dlrm, dense, embed(), precision, device_type)


def dense_logits(dlrm: torch.nn.Module, dense: torch.Tensor, embedded_sparse, precision: str,
                 device_type: str) -> torch.Tensor:
    """The dense part of a DLRM-shaped module (see :func:`dlrm_logits`) in TorchRec ``DLRM.forward``'s
    arithmetic: bottom MLP on ``dense`` (``[B, dense_in]`` float32), interaction with the pooled
    embeddings ``embedded_sparse``, top MLP, all under :func:`dense_autocast`. Returns ``[B]``
    float32 (bf16 logits are cast to float32, so the loss is computed in float32). A function of its
    arguments alone, so that ``torch.compile`` can capture it whole (``job.model.compile_dense``).
    """
    with dense_autocast(precision, device_type):
        embedded_dense = dlrm.dense_arch(dense)
        logits = dlrm.over_arch(dlrm.inter_arch(dense_features=embedded_dense,
                                                sparse_features=embedded_sparse))
    return logits.squeeze(-1).float()


def resolve_for_script(parser: argparse.ArgumentParser, flag_value: Optional[str],
                       device: torch.device) -> str:
    """:func:`resolve` and :func:`unsupported_reason` for a script's ``--dense-precision`` on
    ``device``: the precision, after :func:`set_matmul_precision`. A precision the device cannot run
    is ``parser.error`` (one line naming the flag and the value, exit status 2)."""
    device = torch.device(device)
    precision = resolve_on_device(flag_value, device)
    reason = unsupported_reason(precision, device)
    if reason is not None:
        parser.error(reason)
    set_matmul_precision(precision, device.type)
    return precision
