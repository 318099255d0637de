"""How the CTR job reports a bad input: one line ``train_ctr: error: MESSAGE`` on stderr and exit
status 2, for flags (argparse), the whole configuration (``validate``) and data or checkpoints found
bad while running (``train.main``)."""

from __future__ import annotations

import sys
from typing import NoReturn

PROG = "train_ctr"
PREFIX = f"{PROG}: error: "
EXIT_STATUS = 2


class JobConfigError(ValueError):
    """A configuration the job cannot run; the message names the flag(s) and value(s)."""


def exit_with_error(message: str) -> NoReturn:
    """Print ``train_ctr: error: MESSAGE`` (newlines folded into one line) on stderr and exit with
    status 2 (``SystemExit``)."""
    one_line = " ".join(str(message).split())
    print(f"{PREFIX}{one_line}", file=sys.stderr, flush=True)
    sys.exit(EXIT_STATUS)
