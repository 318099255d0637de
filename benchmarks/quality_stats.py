"""Paired differences over seeds, their 95% confidence intervals, and equivalence verdicts.

The interval is the paired t-interval over seeds: with ``d_i = variant_i - reference_i`` for the ``n``
seeds, ``mean(d) +/- t_{0.975, n-1} * sd(d) / sqrt(n)`` (``sd`` with ``n - 1`` degrees of freedom),
from ``scipy.stats.ttest_rel(...).confidence_interval``. Verdicts (issue #35): a variant is
*equivalent* when the interval lies inside ``[-margin, +margin]`` at every batch size studied,
*worse* when it lies entirely below ``-margin`` at any, *better* when it lies entirely above
``+margin`` at every one, and *inconclusive* otherwise (add seeds before concluding).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

AUC_MARGIN = 0.001        # AUC
ZERO_SHARE_MARGIN = 0.01  # share of exactly-zero weights: 1 point


@dataclass(frozen=True)
class PairedInterval:
    """Mean paired difference ``mean`` of ``n`` seeds and its 95% interval ``[lo, hi]``."""

    mean: float
    lo: float
    hi: float
    n: int

    def to_dict(self) -> dict:
        return asdict(self)


def paired_interval(variant: Sequence[float], reference: Sequence[float],
                    confidence: float = 0.95) -> PairedInterval:
    """The paired t-interval of ``mean(variant - reference)`` (same seed order in both).

    With every difference equal (zero spread) the interval is that difference; with one seed it is
    ``(-inf, +inf)`` (no spread can be estimated).

    Raises:
        ValueError: the sequences differ in length or are empty.
    """
    from scipy import stats

    if len(variant) != len(reference) or not variant:
        raise ValueError(f"variant and reference need the same non-zero number of seeds, got "
                         f"{len(variant)} and {len(reference)}")
    d = [float(a) - float(b) for a, b in zip(variant, reference)]
    n, mean = len(d), math.fsum(d) / len(d)
    if n == 1:
        return PairedInterval(mean, -math.inf, math.inf, 1)
    if max(d) == min(d):
        return PairedInterval(mean, mean, mean, n)
    ci = stats.ttest_rel(variant, reference).confidence_interval(confidence_level=confidence)
    return PairedInterval(mean, float(ci.low), float(ci.high), n)


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> PairedInterval:
    """The t-interval of the mean of ``values`` (``scipy.stats.t.interval`` with the standard error
    ``sd / sqrt(n)``); one value or zero spread: as :func:`paired_interval` against zeros."""
    return paired_interval(list(values), [0.0] * len(values), confidence)


def verdict(intervals: Iterable[PairedInterval], margin: float) -> str:
    """``equivalent`` / ``worse`` / ``better`` / ``inconclusive`` for a variant's intervals, one per
    batch size studied (see the module docstring). No interval at all: ``inconclusive``."""
    ivs = list(intervals)
    if not ivs:
        return "inconclusive"
    if any(iv.hi < -margin for iv in ivs):
        return "worse"
    if all(-margin <= iv.lo and iv.hi <= margin for iv in ivs):
        return "equivalent"
    if all(iv.lo > margin for iv in ivs):
        return "better"
    return "inconclusive"
