"""What a kernel backend of the FTRL TBE runs and supports, declared as data (see :mod:`.backend`)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from ..row_layout import RowLayout


@dataclasses.dataclass(frozen=True)
class OpTable:
    """The ops (:mod:`.ops`) as a backend runs them: one callable per op (the op by the dispatcher,
    or its implementation called directly), each taking that op's schema's arguments; ``forward``
    and ``backward_update_`` take the knobs' :class:`~torchrec_ftrl.hyperparams.FTRLHyperparams`
    first (the PyTorch implementation computes with them instead of reading the knob tensor back;
    the kernels read the tensor). ``train_forward`` (optional): a backend's fused training forward
    (``tbe_linearize`` then ``tbe_forward`` with its row keys; the arguments of ``forward`` up to
    ``out_dtype``, then ``warn``), returning ``(out, the five results of tbe_linearize)``, or None
    where the TBE is to call the two ops itself (while ``torch.compile`` traces). ``train_lookup``
    (optional): a backend's whole training lookup as one autograd op (the arguments of
    ``train_forward``, then the TBE's placeholder parameter, ``nonfinite_rows``, ``step``, ``iter``,
    its knobs' version counter and a callable giving the knob arguments of backward time),
    returning the output, whose backward updates the tables and adds 1 to ``iter``; or
    None where the TBE is to run the step through :mod:`.calls`' forward and backward."""

    forward: Callable
    linearize: Callable
    backward_update_: Callable
    count_invalid: Callable
    repair_offsets: Callable
    train_forward: Optional[Callable] = None
    train_lookup: Optional[Callable] = None


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend supports, as data (the TBE reads these, never a backend's name).

    Attributes:
        fused_check: its forward checks a raw batch itself (``check`` and ``warn`` of
            ``tbe_forward``, ``warn`` of ``tbe_linearize``): FBGEMM's ``WARNING`` (unless the per-sample
            weights need a gradient, which reads a checked batch) and ``FATAL`` (the TBE reads the
            count once after the forward and raises before any update).
        linearizes: has ``tbe_linearize``: a training forward linearises the batch once, looks up
            by its row keys and hands it to the backward.
        cached_placement: runs the ``MANAGED_CACHING`` (``fused_uvm_caching``) placement: batches
            whose rows may sit in the HBM cache (:mod:`torchrec_ftrl.tbe.cache`; the ``cache_*``
            arguments).
        graph_capture: a training step can be captured in a CUDA graph (no host sync, no host-side
            state per step).
        layouts: the ``(weights, accumulator)`` row layouts
            (:class:`torchrec_ftrl.row_layout.RowLayout`) its kernels implement.
        cached_layouts: those of them it implements under ``cached_placement``.
    """

    fused_check: bool = False
    linearizes: bool = False
    cached_placement: bool = False
    graph_capture: bool = False
    layouts: frozenset = frozenset({RowLayout().key})
    cached_layouts: frozenset = frozenset()
