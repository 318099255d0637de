"""TorchX component for the CTR training job (the module ``torchrec_ftrl.job``).

    torchx run -s local_cwd torchrec_ftrl/components.py:train_ctr --nproc 2
    torchx run -s local_cwd torchrec_ftrl/components.py:train_ctr --nproc 2 -- \\
        --data DATA/criteo/criteo_dac_combined.tsv --steps 300

From an installed wheel, in any directory, name this file by its installed path:

    torchx run -s local_cwd "$(python -c 'import torchrec_ftrl.components as c; print(c.__file__)')":train_ctr --nproc 2

It wraps ``torchx.components.dist.ddp`` (torchrun, one node by default) and launches
``python -m torchrec_ftrl.job.torchrun ... -m torchrec_ftrl.job``, so it needs only the installed
package, not a checkout; everything after ``--`` goes to the job unchanged. That module is torchrun
with one difference: a worker that fails ends the launch with its exit status, without torchrun's
``ChildFailedError`` traceback (``torchrec_ftrl/job/torchrun.py``). Each process picks ``cuda:LOCAL_RANK`` with NCCL
when CUDA is present and CPU with gloo otherwise (see the job's ``--device``).
"""


from typing import Dict, Optional

import torchx.specs as specs
from torchx.components import dist as dist_components

_MODULE = "torchrec_ftrl.job"
_LAUNCHER = "python -m torchrec_ftrl.job.torchrun"
_ROLE = "train_ctr"


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
        script_args: flags for the job (python -m torchrec_ftrl.job; pass them after ``--``)
        nproc: processes per node (one GPU each when CUDA is present)
        nnodes: number of nodes
        gpu: GPUs requested per node; -1 = nproc when CUDA is visible to the launcher, else 0
        cpu: CPUs requested per node (resource request; local schedulers ignore it)
        memMB: memory requested per node in MB
        script: path of a custom training script to run instead; default: the installed module torchrec_ftrl.job
        image: container image (image-based schedulers only)
        name: job name
        env: extra environment variables for the workers (``LOGLEVEL`` defaults to ``ERROR``:
            torchrun's log without its warnings)
        max_retries: restarts on failure
        rdzv_port: c10d rendezvous port (multi-node only)
    """
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"nproc and nnodes must be >= 1, got nproc={nproc}, nnodes={nnodes}")
    if gpu < 0:
        gpu = nproc if _cuda_visible() else 0
    entry = {"script": script} if script else {"m": _MODULE}
    app = dist_components.ddp(
        *script_args,
        **entry,
        image=image,
        name=name,
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        j=f"{nnodes}x{nproc}",
        env={"LOGLEVEL": "ERROR", **(env or {})},   # torchrun's warnings off unless asked for
        max_retries=max_retries,
        rdzv_port=rdzv_port,
    )
    for role in app.roles:   # ddp's command is "torchrun ARGS" under bash -c
        if not role.args[-1].startswith("torchrun "):
            raise RuntimeError(f"torchx's ddp command does not start with torchrun: {role.args[-1]!r}")
        role.args[-1] = _LAUNCHER + role.args[-1][len("torchrun"):]
    if not script:
        # ddp names the role after the module's last part ("job"); keep the job's name (log prefixes
        # "train_ctr/0", as when it was launched as a script).
        for role in app.roles:
            role.name = _ROLE
    return app


def _cuda_visible() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a launcher without torch requests no GPU
        return False
