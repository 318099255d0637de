"""FTRL-Proximal hyperparameters: names, defaults, validation and the one options parser.

One options mapping serves every entry point: the dense optimizer (``torchrec_ftrl.FTRL``, what
``apply_optimizer_in_backward`` takes), the fused TBE's keyword arguments, TorchRec ``fused_params``
and ``update_hyper_parameters``: ``lr`` or ``learning_rate`` plus the ``ftrl_*`` knobs below, all
parsed by :func:`parse_options`. Validation follows ``docs/ftrl.md``: ``learning_rate > 0``;
``ftrl_learning_rate_power <= 0``; ``ftrl_l1_reg, ftrl_l2_reg, ftrl_beta, ftrl_l2_shrinkage,
ftrl_initial_accumulator_value >= 0``; all finite; and, because every kernel computes in fp32, each is
0 or a normal fp32 magnitude (1.2e-38 .. 3.4e38).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping, NamedTuple, Optional

from .rule_spec import KNOBS

L2_CONVENTIONS = ("tensorflow", "mcmahan")
DEFAULT_LEARNING_RATE = 0.01
LEARNING_RATE_KEYS = ("lr", "learning_rate")

# Keyword name -> dataclass field. These are the names accepted in fused_params and by FTRL(...).
FTRL_KWARGS = {
    "ftrl_learning_rate_power": "learning_rate_power",
    "ftrl_l1_reg": "l1_reg",
    "ftrl_l2_reg": "l2_reg",
    "ftrl_beta": "beta",
    "ftrl_l2_shrinkage": "l2_shrinkage",
    "ftrl_initial_accumulator_value": "initial_accumulator_value",
    "ftrl_l2_convention": "l2_convention",
}


# ftrl_* options keys that are not knobs: the row layout's (torchrec_ftrl.row_layout.LAYOUT_KEYS, which
# parses them); parse_options leaves them to it unless strict.
NOT_KNOBS = ("ftrl_weights", "ftrl_accumulator")

# Every knob is used as an fp32 scalar by the kernels: a non-zero value that is not a normal fp32 number
# would silently become 0 or inf there (e.g. ftrl_learning_rate_power = -1e-300 turns into 0 and changes
# 0^(-p) from 0 to 1), so it is rejected instead.
_FP32_MAX = 3.4028234663852886e38
_FP32_MIN_NORMAL = 1.1754943508222875e-38


def _check_number(name: str, value: Any, *, nonneg: bool = False, positive: bool = False,
                  nonpos: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and not v > 0:
        raise ValueError(f"{name} must be > 0 (FTRL divides by it), got {value!r}")
    if nonneg and not v >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    if nonpos and not v <= 0:
        raise ValueError(f"{name} must be <= 0, got {value!r}")
    if v != 0.0 and not _FP32_MIN_NORMAL <= abs(v) <= _FP32_MAX:
        raise ValueError(f"{name} must be 0 or have magnitude in [{_FP32_MIN_NORMAL!r}, {_FP32_MAX!r}] "
                         f"(the kernels compute in fp32), got {value!r}")
    return v


@dataclasses.dataclass(frozen=True)
class FTRLHyperparams:
    """Validated FTRL-Proximal knobs (McMahan et al. 2013, Alg. 1; TensorFlow ``ApplyFtrlV2``).

    Attributes:
        learning_rate: alpha, > 0.
        learning_rate_power: p, <= 0 (-0.5 is the classic FTRL schedule, 0 a fixed rate).
        l1_reg: lambda1 >= 0; weights with |linear| <= lambda1 are exactly 0.0.
        l2_reg: lambda2 >= 0, applied as 2*lambda2 ("tensorflow") or lambda2 ("mcmahan").
        beta: >= 0, added to accum^(-p) in the denominator.
        l2_shrinkage: s >= 0, TensorFlow's shrinkage (g_s = g + 2*s*w), not used for accum.
        initial_accumulator_value: n0 >= 0, the value accum starts at.
        l2_convention: "tensorflow" (default) or "mcmahan".

    Raises:
        ValueError: naming the knob and its value, when any constraint above fails.
    """

    learning_rate: float
    learning_rate_power: float = -0.5
    l1_reg: float = 0.0
    l2_reg: float = 0.0
    beta: float = 0.0
    l2_shrinkage: float = 0.0
    initial_accumulator_value: float = 0.0
    l2_convention: str = "tensorflow"

    def __post_init__(self) -> None:
        _check_number("learning_rate (lr)", self.learning_rate, positive=True)
        _check_number("ftrl_learning_rate_power", self.learning_rate_power, nonpos=True)
        for kw, field in FTRL_KWARGS.items():
            if field not in ("learning_rate_power", "l2_convention"):
                _check_number(kw, getattr(self, field), nonneg=True)
        if self.l2_convention not in L2_CONVENTIONS:
            raise ValueError(
                f"ftrl_l2_convention must be one of {L2_CONVENTIONS}, got {self.l2_convention!r}")
        for f in dataclasses.fields(self):
            if f.name != "l2_convention":
                object.__setattr__(self, f.name, float(getattr(self, f.name)))
        self._cache_kernel_scalars()

    def _cache_kernel_scalars(self) -> None:
        # computed once per object: the kernels read them on every training step
        object.__setattr__(self, "_kernel_scalars", KernelScalars(*(k.of_hparams(self) for k in KNOBS)))

    def __getstate__(self) -> dict:
        """Pickled without the cached scalars (recomputed on load, from the knobs as defined then)."""
        state = dict(self.__dict__)
        state.pop("_kernel_scalars", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._cache_kernel_scalars()

    @property
    def l2_effective(self) -> float:
        """The L2 term added to the denominator q: 2*l2_reg (tensorflow) or l2_reg (mcmahan)."""
        return 2.0 * self.l2_reg if self.l2_convention == "tensorflow" else self.l2_reg

    def to_kwargs(self) -> dict:
        """The ``ftrl_*`` keyword form (no learning rate), e.g. for ``fused_params``."""
        return {kw: getattr(self, field) for kw, field in FTRL_KWARGS.items()}

    def to_options(self) -> dict:
        """The full options form: ``learning_rate`` and every ``ftrl_*`` knob."""
        return {"learning_rate": self.learning_rate, **self.to_kwargs()}

    def with_learning_rate(self, lr: float) -> "FTRLHyperparams":
        return dataclasses.replace(self, learning_rate=lr)

    def kernel_scalars(self) -> "KernelScalars":
        """The fp32 scalars the compiled CPU and Triton kernels compute with (see :class:`KernelScalars`)."""
        return self._kernel_scalars


class KernelScalars(NamedTuple("_KernelScalars", [(knob.name, float) for knob in KNOBS])):
    """Derived scalars of the rule, in the order the C++ (``FtrlHp``) and Triton kernels take them:
    :data:`torchrec_ftrl.rule_spec.KNOBS` (names, meanings, values)."""

    __slots__ = ()

    def to_hyperparams(self) -> FTRLHyperparams:
        """The knobs these scalars are of, for the rule functions of :mod:`torchrec_ftrl.rule` (which
        compute bit for bit the same from either): the L2 term as ``l2_convention="mcmahan"``
        (``l2_effective == l2``), ``initial_accumulator_value`` 0 (the scalars do not carry it).

        Raises:
            ValueError: a scalar :class:`FTRLHyperparams` refuses, naming its knob and value.
        """
        return FTRLHyperparams(learning_rate=self.lr, learning_rate_power=-self.neg_power,
                               l1_reg=self.l1, l2_reg=self.l2, beta=self.beta,
                               l2_shrinkage=self.shrink2 / 2.0, l2_convention="mcmahan")


def parse_options(options: Optional[Mapping[str, Any]], *, base: Optional[FTRLHyperparams] = None,
                  strict: bool = False, where: str = "options") -> FTRLHyperparams:
    """Validated knobs from an options mapping (optimizer kwargs, TBE kwargs, ``fused_params``).

    Args:
        options: ``lr`` or ``learning_rate`` and ``ftrl_*`` keys; ``None`` is empty.
        base: knobs that keys absent from ``options`` keep (default: the documented defaults).
        strict: every key must be a learning-rate or ``ftrl_*`` key (``update_hyper_parameters``).
            Otherwise other keys are ignored (a ``fused_params`` dict carries ``optimizer``, ``eps``,
            ``output_dtype``, the row layout's ``ftrl_weights`` / ``ftrl_accumulator``, ...), but an
            unknown ``ftrl_*`` key still raises.
        where: what ``options`` is, for messages (e.g. ``"fused_params"``).

    Raises:
        ValueError: ``lr`` and ``learning_rate`` given with different values, an unknown key (see
            ``strict``; the message lists the accepted keys: the knobs, and the row layout's
            ``ftrl_weights`` / ``ftrl_accumulator`` unless ``strict``), or an invalid value (naming the
            knob and the value).
    """
    opts = dict(options or {})
    given = {k: opts[k] for k in LEARNING_RATE_KEYS if k in opts and opts[k] is not None}
    if len(given) == 2 and given["lr"] != given["learning_rate"]:
        raise ValueError(f"{where} has lr={given['lr']!r} and learning_rate={given['learning_rate']!r}; "
                         "give one of them")
    unknown = sorted(k for k in opts if k not in LEARNING_RATE_KEYS and k not in FTRL_KWARGS
                     and (strict or (isinstance(k, str) and k.startswith("ftrl_") and k not in NOT_KNOBS)))
    if unknown:
        accepted = sorted(FTRL_KWARGS) + ([] if strict else sorted(NOT_KNOBS))
        layout = (f" (the row layout's {sorted(NOT_KNOBS)} are fixed when the table is built, not "
                  f"{where} keys)" if strict and set(unknown) & set(NOT_KNOBS) else "")
        raise ValueError(f"unknown FTRL key(s) {unknown} in {where}; expected lr, learning_rate or "
                         f"some of {accepted}{layout}")
    fields = dataclasses.asdict(base) if base is not None else {"learning_rate": DEFAULT_LEARNING_RATE}
    if given:
        fields["learning_rate"] = next(iter(given.values()))
    fields.update({FTRL_KWARGS[k]: v for k, v in opts.items() if k in FTRL_KWARGS})
    return FTRLHyperparams(**fields)
