"""Runs a function in N gloo processes (torch.multiprocessing.spawn) for the DMP tests."""

from __future__ import annotations

import datetime
import os
import socket

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_type() -> str:
    """``cuda`` when FTRL_TEST_DEVICE=cuda (NCCL, one GPU per process), else ``cpu`` (gloo)."""
    return os.environ.get("FTRL_TEST_DEVICE", "cpu")


def _entry(rank: int, world_size: int, port: int, fn, args) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    if device_type() == "cuda":
        import torch
        torch.cuda.set_device(rank)
    # A stuck rendezvous or collective fails after 10 minutes instead of torch's default 30.
    dist.init_process_group("nccl" if device_type() == "cuda" else "gloo", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(minutes=10))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; re-raises a worker's error."""
    mp.spawn(_entry, args=(world_size, _free_port(), fn, args), nprocs=world_size, join=True)
