"""What a kernel backend of the FTRL TBE supports, declared as data (see :mod:`.backend`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend supports, as data (the TBE reads these, never a backend's name).

    Attributes:
        cached_placement: runs the ``MANAGED_CACHING`` (``fused_uvm_caching``) placement: batches
            whose rows may sit in the HBM cache (:mod:`torchrec_ftrl.cache`).
        graph_capture: a training step can be captured in a CUDA graph (no host sync, no host-side
            state per step).
        repairs_offsets: has ``repair_offsets`` (the WARNING repair of offsets on the device).
        layouts: the ``(weights, accumulator)`` row layouts
            (:class:`torchrec_ftrl.row_layout.RowLayout`) its kernels implement.
        cached_layouts: those of them it implements under ``cached_placement``.
    """

    cached_placement: bool = False
    graph_capture: bool = False
    repairs_offsets: bool = False
    layouts: frozenset = frozenset({("stored", "elementwise")})
    cached_layouts: frozenset = frozenset()
