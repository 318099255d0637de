"""Atomic DCP checkpoints: ``torch.distributed.checkpoint`` of ``{"model": model.state_dict(),
"optim": optimizer.state_dict()}`` into ``<root>/.tmp-step_XXXXXXXX``, then rank 0 writes
``meta.json`` and renames the folder to ``<root>/step_XXXXXXXX`` and updates ``<root>/latest``
(write + ``os.replace``). A crash leaves at most a ``.tmp-*`` folder, never a half checkpoint.
:func:`load` is all or nothing too. DCP reads pickled metadata: a checkpoint folder is code, so
resume only from folders you trust.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .. import checkpoint
from . import faults


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def save(root: str, step: int, model, optimizer, meta: dict, keep: int = 2,
         extra: Optional[dict] = None) -> str:
    """Collective: every rank calls it. Returns the final folder. Keeps the newest ``keep``.
    ``extra``: more (replicated, identical on every rank) tensors, saved under ``"extra"``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = step_dir(root, step)
    tmp = os.path.join(root, f".tmp-step_{step:08d}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    if extra:
        state["extra"] = extra
    dcp.save(state, checkpoint_id=tmp)
    faults.maybe_fail(rank, step, "checkpoint")
    _barrier()
    if rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "step": step}, f)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        latest_tmp = os.path.join(root, ".latest.tmp")
        with open(latest_tmp, "w") as f:
            f.write(os.path.basename(final) + "\n")
        os.replace(latest_tmp, os.path.join(root, "latest"))
        olds = sorted(d for d in os.listdir(root) if d.startswith("step_"))
        for d in olds[:-keep] if keep > 0 else []:
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    _barrier()
    return final


def resolve(resume: str, root: Optional[str]) -> str:
    """The folder to resume from: ``resume`` itself, or (``"latest"``) the one named by
    ``<root>/latest``.

    Raises:
        FileNotFoundError: no checkpoint there (naming the path).
    """
    if resume != "latest":
        path = resume
    else:
        pointer = os.path.join(root or "", "latest")
        if not os.path.isfile(pointer):
            raise FileNotFoundError(f"--resume: no checkpoint in {root!r} (missing {pointer!r})")
        with open(pointer) as f:
            path = os.path.join(root, f.read().strip())
    if not os.path.isfile(os.path.join(path, "meta.json")):
        raise FileNotFoundError(f"--resume: {path!r} is not a complete checkpoint (no meta.json)")
    return path


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this job (corrupt files, other tables or sizes, another
    FTRL state dtype)."""


def read_meta(path: str) -> dict:
    """``meta.json`` of the checkpoint folder ``path`` (every rank reads it; it is small)."""
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def saved_ftrl_state_dtype(meta: dict) -> str:
    """The FTRL state dtype a checkpoint's run trained with: its saved ``--ftrl-state-dtype``
    (``meta["args"]["ftrl_state_dtype"]``); ``"fp32"`` for checkpoints written before the flag existed
    (their states are fp32)."""
    return (meta.get("args") or {}).get("ftrl_state_dtype") or "fp32"


def check_ftrl_state_dtype(path: str, meta: dict, state_dtype: str, sparse_optimizer: str) -> None:
    """Refuse to resume an FTRL run with another ``--ftrl-state-dtype`` than the checkpoint's: its
    ``accum`` / ``linear`` are stored in that dtype, and DCP would convert them silently on load
    (rounding fp32 state to bf16, or resuming bf16 state as if it had been fp32 all along).

    Raises:
        CheckpointError: naming ``path``, both dtypes and the flag to pass.
    """
    if sparse_optimizer != "ftrl" or (meta.get("args") or {}).get("sparse_optimizer", "ftrl") != "ftrl":
        return
    saved = saved_ftrl_state_dtype(meta)
    if saved != state_dtype:
        raise CheckpointError(
            f"--resume: checkpoint {path!r} holds FTRL state in {saved} (--ftrl-state-dtype {saved}) but "
            f"this run asks for --ftrl-state-dtype {state_dtype}; resume with --ftrl-state-dtype {saved} "
            f"(the state dtype cannot change within a run)")


def _first_failure(e: BaseException) -> str:
    """One line for a DCP ``CheckpointException``: the first failing rank's exception."""
    failures = getattr(e, "failures", None) or {}
    for rank, (exc, _) in sorted(failures.items()):
        return f"rank {rank}: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return f"{type(e).__name__}: {e}"


def load(path: str, model, optimizer, extra: Optional[dict] = None) -> dict:
    """Collective: load model and optimizer state (and ``extra``, same keys/shapes as saved), all or
    nothing (:func:`torchrec_ftrl.checkpoint.load_dcp`: staged, every FTRL value checked, then
    copied; the staging holds the model's and optimizer's local state a second time during the
    load); returns ``meta.json`` (with ``step``). The FTRL tables' step counters come back with the
    optimizer state. A checkpoint folder is code (DCP reads pickled metadata): resume only from
    folders you trust.

    Raises:
        CheckpointError: naming ``path`` and the first failure, when DCP cannot load it (a truncated
            or corrupt file, or a checkpoint of other tables/sizes) or an FTRL value is refused (NaN,
            Inf, a negative ``accum`` or step); the model, optimizer and ``extra`` are unchanged.
    """
    try:
        checkpoint.load_dcp(model, optimizer, path, extra=extra)
    except ValueError as e:
        raise CheckpointError(f"--resume: cannot load checkpoint {path!r}: {e}") from e
    except (Exception, dcp.api.CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"--resume: cannot load checkpoint {path!r} (corrupt, or saved by a job "
                              f"with other tables/sizes): {_first_failure(e)}") from e
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)
