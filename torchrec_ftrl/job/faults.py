"""Fault injection for reliability tests: ``TORCHREC_FTRL_FAULT=RANK:STEP[:PHASE]`` makes rank RANK die
with ``os._exit(1)`` (no cleanup, no exception handlers: like a killed process) at training step STEP.

PHASE is where in that step:

* ``step`` (default): right after the optimizer step, before any checkpoint of that step;
* ``checkpoint``: in the middle of writing that step's checkpoint, after this rank's DCP files are
  in ``<dir>/.tmp-step_N`` and before the folder is renamed to ``step_N`` (the write is not committed).

Unset or empty: no fault. Used by ``tests/test_reliability_job.py``.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

ENV = "TORCHREC_FTRL_FAULT"
PHASES = ("step", "checkpoint")


def parse(value: Optional[str]) -> Optional[tuple[int, int, str]]:
    """``"1:7"`` -> ``(1, 7, "step")``; ``None``/``""`` -> None.

    Raises:
        ValueError: naming the variable and value, unless it is ``RANK:STEP[:PHASE]`` with ints
            RANK >= 0, STEP >= 1 and PHASE in ``PHASES``.
    """
    if not value:
        return None
    parts = value.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        rank, step = int(parts[0]), int(parts[1])
        phase = parts[2] if len(parts) == 3 else "step"
        if rank < 0 or step < 1 or phase not in PHASES:
            raise ValueError
    except ValueError:
        raise ValueError(f"{ENV} must be RANK:STEP[:PHASE] with RANK >= 0, STEP >= 1 and PHASE in "
                         f"{PHASES}, got {value!r}") from None
    return rank, step, phase


def maybe_fail(rank: int, step: int, phase: str) -> None:
    """Exit this process with status 1 at once when ``TORCHREC_FTRL_FAULT`` names this point."""
    fault = parse(os.environ.get(ENV))
    if fault is not None and fault == (rank, step, phase):
        print(f"{ENV}: rank {rank} exits at step {step} ({phase})", file=sys.stderr, flush=True)
        os._exit(1)
