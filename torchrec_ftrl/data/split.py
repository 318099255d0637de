"""Train/validation split of a row stream, by row position (0-based index among valid rows)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class Split:
    """``every:k`` (row i is validation when ``i % k == k - 1``, i.e. every k-th row), ``tail:f``
    (the last ``ceil(f * n)`` rows are validation; needs the row count ``n``) or ``none``.

    Raises:
        ValueError: ``k < 2``, ``f`` outside (0, 1), or an unknown mode (naming the text).
    """

    mode: str
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.mode == "every":
            if int(self.value) != self.value or self.value < 2:
                raise ValueError(f"split every:k needs an integer k >= 2, got {self.value!r}")
        elif self.mode == "tail":
            if not 0.0 < self.value < 1.0:
                raise ValueError(f"split tail:f needs 0 < f < 1, got {self.value!r}")
        elif self.mode != "none":
            raise ValueError(f"split mode must be 'every', 'tail' or 'none', got {self.mode!r}")

    def __str__(self) -> str:
        """The flag form: ``every:10``, ``tail:0.1``, ``none``."""
        if self.mode == "none":
            return "none"
        return f"{self.mode}:{int(self.value) if self.mode == 'every' else self.value:g}"

    @classmethod
    def parse(cls, text: str) -> "Split":
        """``"every:10"``, ``"tail:0.1"`` or ``"none"``."""
        if text == "none":
            return cls("none")
        mode, sep, val = text.partition(":")
        if not sep:
            raise ValueError(f"a split looks like 'every:10', 'tail:0.1' or 'none', got {text!r}")
        try:
            num = float(val)
        except ValueError:
            raise ValueError(f"the split's value must be a number, got {text!r}") from None
        return cls(mode, num)

    @property
    def needs_count(self) -> bool:
        return self.mode == "tail"

    def first_validation_index(self, n: int) -> int:
        """For ``tail``: index of the first validation row among ``n`` rows."""
        return n - math.ceil(self.value * n)

    def counts(self, n: int) -> Tuple[int, int]:
        """``(training rows, validation rows)`` among ``n`` rows (the counts ``is_validation`` gives)."""
        if self.mode == "every":
            n_val = n // int(self.value)
        elif self.mode == "tail":
            n_val = n - self.first_validation_index(n)
        else:
            n_val = 0
        return n - n_val, n_val

    def train_index(self, t: np.ndarray, n: int) -> np.ndarray:
        """Row positions (int64, same shape) of training rows ``t`` (0-based among the training rows
        of ``n`` rows, each ``< counts(n)[0]``): the ``t``-th row ``i`` with ``not is_validation(i, n)``."""
        t = np.asarray(t, dtype=np.int64)
        if self.mode == "every":
            k = int(self.value)
            return (t // (k - 1)) * k + t % (k - 1)
        return t  # tail: training rows come first; none: every row

    def validation_index(self, v: np.ndarray, n: int) -> np.ndarray:
        """Row positions (int64, same shape) of validation rows ``v`` (0-based among the validation
        rows of ``n`` rows, each ``< counts(n)[1]``)."""
        v = np.asarray(v, dtype=np.int64)
        if self.mode == "every":
            k = int(self.value)
            return v * k + (k - 1)
        if self.mode == "tail":
            return v + self.first_validation_index(n)
        if v.size:
            raise ValueError("split 'none' has no validation rows")
        return v

    def is_validation(self, i: int, n: Optional[int] = None) -> bool:
        if self.mode == "every":
            k = int(self.value)
            return i % k == k - 1
        if self.mode == "tail":
            if n is None:
                raise ValueError("a tail split needs the row count n")
            return i >= self.first_validation_index(n)
        return False
