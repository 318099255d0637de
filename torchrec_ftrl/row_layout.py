"""What one row of an FTRL table stores: the row-layout spec.

A row of a table of embedding dim ``D`` stores, by its :class:`RowLayout`:

* the **weight**, ``D`` values in the weights dtype (fp32 / fp16 / bf16), with ``weights="stored"``;
  nothing with ``weights="derived"``, where ``w = prox(linear, accum)`` is computed where it is used
  (:func:`torchrec_ftrl.rule.ftrl_prox`; McMahan et al. 2013, Algorithm 1);
* ``accum`` (n): ``D`` values with ``accumulator="elementwise"``, one with ``"rowwise"``
  (:func:`torchrec_ftrl.rule.ftrl_rule_rowwise`; as EXACT_ROWWISE_ADAGRAD's ``momentum1``);
* ``linear`` (z): ``D`` values.

Each state is fp32 or bf16 (:mod:`torchrec_ftrl.state_dtype`). This one description gives the state
names and shapes, the bytes per row that the planner and the placements count, and whether the TBE
kernels implement the layout (:func:`require_kernel_layout`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping

import torch

from .hyperparams import NOT_KNOBS
from .state_dtype import STATE_NAMES, parse_state_dtypes, state_dtypes_from_options

# The options keys of the layout (TBE kwargs, fused_params), besides optimizer_state_dtypes: the
# ftrl_* keys that are not knobs.
LAYOUT_KEYS = NOT_KNOBS
WEIGHTS = ("stored", "derived")
ACCUMULATORS = ("elementwise", "rowwise")
# (weights, accumulator) pairs the TBE kernels of every backend implement (HBM and host placements;
# each backend declares its own, and those under MANAGED_CACHING, in its Capabilities).
KERNEL_LAYOUTS = frozenset({(w, a) for w in WEIGHTS for a in ACCUMULATORS})
# Those the MANAGED_CACHING (fused_uvm_caching) HBM cache holds (torchrec_ftrl.tbe.cache.RowCache: each
# slot holds the layout's arrays of one row, no weight where derived, one accum value where row-wise).
CACHED_LAYOUTS = KERNEL_LAYOUTS


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """What one row of an FTRL table stores (see the module docstring).

    Attributes:
        weights: ``"stored"`` or ``"derived"``.
        accumulator: ``"elementwise"`` or ``"rowwise"``.
        accum_dtype, linear_dtype: ``torch.float32`` or ``torch.bfloat16``.

    Raises:
        ValueError: a value outside those, naming the field and the value.
    """

    weights: str = "stored"
    accumulator: str = "elementwise"
    accum_dtype: torch.dtype = torch.float32
    linear_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise ValueError(f"ftrl_weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.accumulator not in ACCUMULATORS:
            raise ValueError(f"ftrl_accumulator must be one of {ACCUMULATORS}, got {self.accumulator!r}")
        parse_state_dtypes({"accum": self.accum_dtype, "linear": self.linear_dtype})

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None, where: str = "options") -> "RowLayout":
        """The layout named by ``ftrl_weights``, ``ftrl_accumulator`` and the state dtype
        (``state_dtype`` or ``optimizer_state_dtypes``,
        :func:`~torchrec_ftrl.state_dtype.state_dtypes_from_options`) in ``options`` (TBE keywords,
        ``fused_params``); absent keys take the defaults. The one parse of these options: the
        result is passed on from there.

        Raises:
            ValueError: a bad value, naming ``where``, the key and the value.
        """
        options = options or {}
        dtypes = state_dtypes_from_options(options, where)
        try:
            weights, accumulator = options.get("ftrl_weights"), options.get("ftrl_accumulator")
            return cls(weights="stored" if weights is None else weights,
                       accumulator="elementwise" if accumulator is None else accumulator,
                       accum_dtype=dtypes["accum"], linear_dtype=dtypes["linear"])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @property
    def stores_weights(self) -> bool:
        """True when a row stores its weight (``weights="stored"``); False when it is derived."""
        return self.weights == "stored"

    @property
    def rowwise(self) -> bool:
        """True for one ``accum`` value per row (``accumulator="rowwise"``)."""
        return self.accumulator == "rowwise"

    @property
    def key(self) -> tuple[str, str]:
        """``(weights, accumulator)``, as :data:`KERNEL_LAYOUTS` and a backend's
        ``Capabilities.layouts`` list layouts."""
        return layout_key(self.stores_weights, self.rowwise)

    @property
    def state_dtypes(self) -> dict[str, torch.dtype]:
        """``{"accum": dtype, "linear": dtype}``."""
        return {"accum": self.accum_dtype, "linear": self.linear_dtype}

    def state_columns(self, name: str, dim: int) -> int:
        """Values of state ``name`` per row of a table of dim ``dim``: 1 for a row-wise ``accum``."""
        if name not in STATE_NAMES:
            raise ValueError(f"FTRL states are {STATE_NAMES}, got {name!r}")
        return 1 if (name == "accum" and self.rowwise) else int(dim)

    def state_bytes_per_row(self, dim: int) -> int:
        """Bytes of ``accum`` + ``linear`` per row of a table of dim ``dim``."""
        return sum(self.state_columns(name, dim) * _itemsize(self.state_dtypes[name]) for name in STATE_NAMES)

    def weight_bytes_per_row(self, dim: int, weight_bytes: int) -> int:
        """Bytes of the stored weight per row (``weight_bytes`` per value); 0 for derived weights."""
        return int(dim) * int(weight_bytes) if self.stores_weights else 0

    def bytes_per_row(self, dim: int, weight_bytes: int) -> int:
        """Bytes one row stores: weight (if stored) + ``accum`` + ``linear``."""
        return self.weight_bytes_per_row(dim, weight_bytes) + self.state_bytes_per_row(dim)

    def describe(self) -> str:
        """``"weights=stored, accumulator=elementwise, accum=fp32, linear=fp32"``, for messages."""
        names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
        return (f"weights={self.weights}, accumulator={self.accumulator}, "
                f"accum={names[self.accum_dtype]}, linear={names[self.linear_dtype]}")


def layout_key(stores_weights: bool, rowwise: bool) -> tuple[str, str]:
    """``(weights, accumulator)`` of the layout that stores or derives its weights and keeps a
    row-wise or element-wise ``accum`` (:attr:`RowLayout.key`)."""
    return ("stored" if stores_weights else "derived"), ("rowwise" if rowwise else "elementwise")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def require_kernel_layout(layout: RowLayout, where: str, capabilities=None, backend: str = "",
                          cached: bool = False) -> None:
    """Return when the TBE kernels implement ``layout``: those of every backend
    (:data:`KERNEL_LAYOUTS`), or, given ``capabilities``
    (:class:`torchrec_ftrl.kernels.capabilities.Capabilities`), those of ``backend``, under the
    ``MANAGED_CACHING`` placement when ``cached``.

    Raises:
        ValueError: otherwise, naming ``where``, the layout and what is implemented.
    """
    have = KERNEL_LAYOUTS if capabilities is None else (
        capabilities.cached_layouts if cached else capabilities.layouts)
    if layout.key in have:
        return
    what = "the FTRL TBE" if capabilities is None else (
        f"the {backend} backend" + (" under MANAGED_CACHING" if cached else ""))
    pairs = ", ".join(f"ftrl_weights={w!r} with ftrl_accumulator={a!r}" for w, a in sorted(have)) or "nothing"
    raise ValueError(f"{where}: {what} implements {pairs}; got ftrl_weights={layout.weights!r}, "
                     f"ftrl_accumulator={layout.accumulator!r}")


_warned_dropped = False


def warn_dropped_weights(count: int, table: str) -> None:
    """Once per process: a ``UserWarning`` that ``count`` non-zero weights of ``table`` were set to 0
    by a derived-weights table (no z gives them where ``q(n) == 0``)."""
    global _warned_dropped
    if _warned_dropped:
        return
    _warned_dropped = True
    warnings.warn(f"torchrec_ftrl: table {table!r} derives its weights from (linear, accum) and cannot hold "
                  f"{count} non-zero initial weight(s) where q(accum) = (ftrl_beta + accum^(-p)) / lr + L2 is "
                  f"0 (accum = 0, ftrl_beta = 0, no L2): those rows start at w = 0, as FTRL rows do at "
                  f"their first update; set ftrl_initial_accumulator_value > 0 or ftrl_beta > 0 to keep "
                  f"an initialisation (shown once per process)", UserWarning, stacklevel=3)
