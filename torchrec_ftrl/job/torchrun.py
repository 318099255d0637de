"""``python -m torchrec_ftrl.job.torchrun [TORCHRUN FLAGS] -m torchrec_ftrl.job [JOB FLAGS]``: torchrun
(``torch.distributed.run``, the same flags and the same launch) as the job's torchx component runs
it, except for how a failed worker ends it.

torchrun ends a failed run by raising ``ChildFailedError`` out of its ``main``, which prints a
Python traceback and a box of the failures (about 50 lines) below the worker's own output. Here the
launcher exits with the first failed worker's exit status instead. A worker that exited with status
2 has printed its one ``train_ctr: error: ...`` line, so nothing is added; any other failure (a
Python traceback, a signal) adds one line ``train_ctr: worker rank R (pid P) failed with exit status
S`` naming the error file torchrun records, if any.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from .errors import EXIT_STATUS, PROG


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Run torchrun with ``argv`` (default ``sys.argv[1:]``); exit with the first failed worker's
    status (1 for a signal), silently for status 2 (see the module docstring)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        status = failure.exitcode
        if status != EXIT_STATUS:
            where = f"; error file {failure.error_file}" if failure.error_file != "<N/A>" else ""
            print(f"{PROG}: worker rank {rank} (pid {failure.pid}) failed with exit status {status}"
                  f"{where}", file=sys.stderr, flush=True)
        sys.exit(status if 0 < status < 256 else 1)


if __name__ == "__main__":
    main()
