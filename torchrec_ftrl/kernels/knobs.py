"""The knobs as the ops take them: one fp32 tensor and two compile-time flags.

Every op that runs the rule (:mod:`.ops`) takes ``knobs``, :meth:`FTRLHyperparams.kernel_scalars
<torchrec_ftrl.hyperparams.FTRLHyperparams.kernel_scalars>` as an fp32 ``[len(KNOBS)]`` tensor on the
tables' device in the order of :data:`torchrec_ftrl.rule_spec.KNOBS`, and ``pow_half, has_shrink``
(:func:`knob_flags`), so no op, kernel or launch names a knob: the Triton kernels read the tensor on
the device (:func:`.cuda.rule_gen.ftrl_knobs`), the compiled CPU kernel reads it into its
``FtrlHp``, and the PyTorch implementation reads its values back.
"""

from __future__ import annotations

import weakref

import torch

from ..hyperparams import FTRLHyperparams, KernelScalars
from .arg_checks import remember

_knob_tensors: dict = {}   # (id(hp), device) -> its knob tensor, dropped with hp


def knob_tensor(hp: FTRLHyperparams, device: torch.device) -> torch.Tensor:
    """``hp.kernel_scalars()`` as an fp32 ``[len(KNOBS)]`` tensor on ``device``. Built once per
    hyper-parameter object and device and kept while ``hp`` lives: a CUDA graph that captured a step
    reads it at every replay, so the TBE keeps each captured ``hp``. A new ``hp`` (e.g. a
    learning-rate schedule's) costs one asynchronous copy from pinned memory. Made under CUDA-graph
    capture (an ``hp`` no eager step used): fill kernels recorded in the graph, not cached. While
    ``torch.compile`` traces: a fresh constant of the graph."""
    values = hp.kernel_scalars()
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.float32, device=device)
    key = (id(hp), device)
    knobs = _knob_tensors.get(key)
    if knobs is None and capturing(device):
        # Recorded fill kernels: the tensor holds the knobs from each replay's fills on, so it is
        # not cached (an eager use of it before a replay would read it empty); stream order keeps
        # it intact until the captured kernels have read it, like any temporary of the graph.
        knobs = torch.empty(len(values), dtype=torch.float32, device=device)
        for i, v in enumerate(values):
            knobs[i].fill_(v)
        return knobs
    if knobs is None:
        if device.type == "cuda":     # a pinned source: the copy does not wait for the stream
            knobs = torch.tensor(values, dtype=torch.float32, pin_memory=True).to(device, non_blocking=True)
        else:
            knobs = torch.tensor(values, dtype=torch.float32, device=device)
        _knob_tensors[key] = knobs
        remember(knobs, knob_flags(hp))   # made from validated knobs: the ops' checks need not read it
        weakref.finalize(hp, _knob_tensors.pop, key, None)
    return knobs


def capturing(device: torch.device) -> bool:
    """Whether the current stream of CUDA ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def knob_flags(hp: FTRLHyperparams) -> tuple[bool, bool]:
    """``(pow_half, has_shrink)``: the compile-time flags of ``hp`` (learning-rate power -0.5: the
    sqrt path; a non-zero l2 shrinkage)."""
    scalars = hp.kernel_scalars()
    return scalars.neg_power == 0.5, scalars.shrink2 != 0.0


def knob_args(hp: FTRLHyperparams, device: torch.device) -> tuple[torch.Tensor, bool, bool]:
    """``(knobs, pow_half, has_shrink)``: the ops' three knob arguments for ``hp`` on ``device``."""
    return (knob_tensor(hp, device), *knob_flags(hp))


def hyperparams_of(knobs: torch.Tensor, pow_half: bool, has_shrink: bool) -> FTRLHyperparams:
    """The hyper-parameters of the ops' knob arguments, for the rule functions of
    :mod:`torchrec_ftrl.rule` (reads the tensor on the host).

    Raises:
        ValueError: a tensor that is not fp32 ``[len(KNOBS)]``, flags that disagree with its values
            (they must be :func:`knob_flags`'), or a knob :class:`FTRLHyperparams` refuses (e.g.
            ``lr <= 0``), naming it and its value.
    """
    n = len(KernelScalars._fields)
    if knobs.dtype != torch.float32 or tuple(knobs.shape) != (n,):
        raise ValueError(f"knobs must be an fp32 tensor of shape ({n},), got dtype={knobs.dtype}, "
                         f"shape={tuple(knobs.shape)}")
    hp = KernelScalars(*knobs.tolist()).to_hyperparams()
    if knob_flags(hp) != (bool(pow_half), bool(has_shrink)):
        raise ValueError(f"pow_half={pow_half} and has_shrink={has_shrink} disagree with the knobs "
                         f"{hp.kernel_scalars()}: give knob_flags of the knobs")
    return hp
