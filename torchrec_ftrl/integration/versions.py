"""Supported TorchRec versions: checked once, at ``import torchrec_ftrl``."""

from __future__ import annotations

import re

SUPPORTED_TORCHREC = ((1, 6), (1, 9))  # inclusive minor range: torchrec 1.6.x .. 1.9.x


def check_torchrec_version(version: str) -> None:
    """Raises ImportError naming the supported range unless ``version`` is torchrec 1.6.x-1.9.x."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    lo, hi = SUPPORTED_TORCHREC
    if m is None or not lo <= (int(m.group(1)), int(m.group(2))) <= hi:
        raise ImportError(
            f"torchrec_ftrl supports torchrec {lo[0]}.{lo[1]}.x to {hi[0]}.{hi[1]}.x (its kernel wrappers "
            f"and lookup routing depend on TorchRec internals), found torchrec {version!r}")
