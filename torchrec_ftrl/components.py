"""TorchX component for the CTR training job (``examples/train_ctr.py``).

    torchx run -s local_cwd torchrec_ftrl/components.py:train_ctr --nproc 2
    torchx run -s local_cwd torchrec_ftrl/components.py:train_ctr --nproc 2 -- \\
        --data ../shared/data/criteo/criteo_dac_combined.tsv --steps 300

It wraps ``torchx.components.dist.ddp`` (torchrun, one node by default); everything after ``--`` goes
to the script unchanged. Each process picks ``cuda:LOCAL_RANK`` with NCCL when CUDA is present and
CPU with gloo otherwise (see the script's ``--device``).
"""


import os
from typing import Dict, Optional

import torchx.specs as specs
from torchx.components import dist as dist_components

_SCRIPT = os.path.join("examples", "train_ctr.py")


def _default_script() -> str:
    """``examples/train_ctr.py`` relative to the working directory (what local_cwd runs in), else
    next to this package (torchx may load this file from a copy, so ``__file__`` is a fallback)."""
    if os.path.isfile(_SCRIPT):
        return _SCRIPT
    here = globals().get("__file__") or ""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(here))), _SCRIPT)


def train_ctr(
    *script_args: str,
    nproc: int = 2,
    nnodes: int = 1,
    gpu: int = -1,
    cpu: int = 2,
    memMB: int = 8192,
    script: str = "",
    image: str = "ghcr.io/pytorch/torchx:0.7.0",
    name: str = "train_ctr",
    env: Optional[Dict[str, str]] = None,
    max_retries: int = 0,
    rdzv_port: int = 29500,
) -> specs.AppDef:
    """DLRM CTR training with fused FTRL embedding tables under DistributedModelParallel.

    Args:
        script_args: flags for examples/train_ctr.py (pass them after ``--``)
        nproc: processes per node (one GPU each when CUDA is present)
        nnodes: number of nodes
        gpu: GPUs requested per node; -1 = nproc when CUDA is visible to the launcher, else 0
        cpu: CPUs requested per node (resource request; local schedulers ignore it)
        memMB: memory requested per node in MB
        script: path of the training script; default: examples/train_ctr.py of this checkout
        image: container image (image-based schedulers only)
        name: job name
        env: extra environment variables for the workers
        max_retries: restarts on failure
        rdzv_port: c10d rendezvous port (multi-node only)
    """
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"nproc and nnodes must be >= 1, got nproc={nproc}, nnodes={nnodes}")
    path = script or _default_script()
    if not script and not os.path.isfile(path):
        raise ValueError(f"training script {_SCRIPT!r} not found (run from the repository root, "
                         f"or pass --script PATH)")
    if gpu < 0:
        gpu = nproc if _cuda_visible() else 0
    return dist_components.ddp(
        *script_args,
        script=path,
        image=image,
        name=name,
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        j=f"{nnodes}x{nproc}",
        env=dict(env or {}),
        max_retries=max_retries,
        rdzv_port=rdzv_port,
    )


def _cuda_visible() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a launcher without torch requests no GPU
        return False
