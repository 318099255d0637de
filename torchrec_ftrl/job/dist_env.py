"""Process group and device: torchrun/torchx env (RANK, WORLD_SIZE, LOCAL_RANK) or one local process."""

from __future__ import annotations

import dataclasses
import os
import socket

import torch
import torch.distributed as dist


@dataclasses.dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(device_choice: str = "auto") -> DistEnv:
    """Initialise the default process group: NCCL with ``cuda:LOCAL_RANK`` when CUDA is chosen (auto:
    present), else gloo on CPU. Without torchrun's env it starts a one-process group on localhost.
    NCCL's communicator is formed here (``init_process_group``'s ``device_id``), not at the first
    collective, which would otherwise be inside the first training step.

    Raises:
        RuntimeError: ``device_choice == "cuda"`` without CUDA.
    """
    use_cuda = torch.cuda.is_available() if device_choice == "auto" else device_choice == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for but torch.cuda.is_available() is False")
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=device if use_cuda else None)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def shutdown(clean: bool = True) -> None:
    """Destroy the process group. After a clean run, first wait for every rank (rank 0 may still be
    writing outputs): a rank that tears down gloo while a peer is still connected can abort."""
    if dist.is_initialized():
        if clean and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
