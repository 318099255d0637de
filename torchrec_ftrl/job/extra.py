"""The CTR job's own dependencies: the ``[job]`` extra of the package.

``pip install torchrec-ftrl`` installs the optimizer (torch, plus torchrec and fbgemm_gpu installed
beside it); the job also needs the packages below, ``pip install 'torchrec-ftrl[job]'``.
"""

from __future__ import annotations

import importlib.util
import sys

# Import name -> what it does for the job.
JOB_MODULES = {
    "pyarrow": "the CSV/TSV reader",
    "torchx": "the launcher (torchrec_ftrl/components.py)",
    "torchmetrics": "validation AUC",
    "matplotlib": "the loss plot",
    "tqdm": "the progress bar",
}


def missing_job_modules() -> list[str]:
    """Import names of :data:`JOB_MODULES` that are not installed, in that order."""
    return [name for name in JOB_MODULES if importlib.util.find_spec(name) is None]


def require_job_extra() -> None:
    """End the process with one line ``train_ctr: error: ...`` and exit status 2 when a module of
    the ``[job]`` extra is missing; return otherwise."""
    missing = missing_job_modules()
    if missing:
        print(f"train_ctr: error: the CTR job needs the [job] extra, missing {', '.join(missing)}: "
              "pip install 'torchrec-ftrl[job]'", file=sys.stderr, flush=True)
        sys.exit(2)
