"""Kernel warm-up before the first timed step (``--kernel-warmup``).

The FTRL TBE's Triton kernels are compiled (or loaded from Triton's on-disk cache) the first time a
process launches them, which without a warm-up happens inside the first training steps. :func:`warm_up`
runs every FTRL TBE of the sharded model once, forward and backward, on a throw-away batch of the
training batch's shape whose ids stay among the first :data:`WARMUP_ROWS` rows of each table, and
then puts back those rows' weights and ``accum`` / ``linear`` states (copies taken before),
the TBE's step counter, and empties an HBM cache (``fused_uvm_caching``): afterwards the tables are bit
for bit what they were, and the kernels the training steps launch are compiled. The dense model and
the dense optimizer are not involved.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from torchrec_ftrl.integration.compute_kernels import ftrl_tbes

WARMUP_ROWS = 64


def enabled(mode: str, sparse_optimizer: str, device: torch.device) -> bool:
    """``--kernel-warmup``: ``on``, ``off``, or ``auto`` (on for FTRL on CUDA, where Triton compiles)."""
    if mode == "auto":
        return sparse_optimizer == "ftrl" and device.type == "cuda"
    return mode == "on" and sparse_optimizer == "ftrl"


def _warm_batch(tbe, batch_size: int, bag_size: int, gen: torch.Generator):
    """``(indices, offsets)``: ``batch_size`` bags of ``bag_size`` ids per feature of ``tbe``, ids
    below ``min(rows, WARMUP_ROWS)`` of each feature's table."""
    device = tbe.linear_dev.device
    ids = []
    for t in tbe.feature_table_map:
        high = min(tbe.embedding_specs[t][0], WARMUP_ROWS)
        ids.append(torch.randint(0, high, (batch_size * bag_size,), generator=gen))
    indices = torch.cat(ids).to(device)
    offsets = torch.arange(0, len(tbe.feature_table_map) * batch_size + 1, dtype=torch.int64) * bag_size
    return indices, offsets.to(device)


@torch.no_grad()
def _snapshot(tbe) -> list:
    """Copies of the first rows of every table's weights and states, and of the step counter."""
    rows = [min(spec[0], WARMUP_ROWS) for spec in tbe.embedding_specs]
    weights = [w[:k].clone() for w, k in zip(tbe.split_embedding_weights(), rows)]
    states = [(a[:k].clone(), z[:k].clone()) for (a, z), k in zip(tbe.split_optimizer_states(), rows)]
    return [weights, states, tbe.iter.clone()]


@torch.no_grad()
def _restore(tbe, snap: list) -> None:
    """Put back what :func:`_snapshot` copied. An HBM cache holds warmed-up rows: both views flush
    it (each flush writes every cached row back), then it is emptied, and only then are the
    originals written, so no later flush can write a warmed-up row over them."""
    weights, states, step = snap
    views = tbe.split_embedding_weights(), tbe.split_optimizer_states()
    tbe.reset_cache_states()
    for w, saved in zip(views[0], weights):
        w[:saved.shape[0]].copy_(saved)
    for (a, z), (sa, sz) in zip(views[1], states):
        a[:sa.shape[0]].copy_(sa)
        z[:sz.shape[0]].copy_(sz)
    tbe.iter.copy_(step)


def warm_up(model: torch.nn.Module, batch_size: int, multi_hot: Optional[Sequence[int]] = None,
            seed: int = 0) -> int:
    """Run each FTRL TBE of ``model`` once on a throw-away batch of ``batch_size`` bags per feature
    (bag size: the mean of ``multi_hot`` rounded up, else 1) and restore it (module docstring). The global
    random state is not used. Returns the number of TBEs warmed."""
    gen = torch.Generator().manual_seed(seed)
    bag = -(-sum(multi_hot) // len(multi_hot)) if multi_hot else 1   # the mean bag, rounded up
    tbes = ftrl_tbes(model)
    for tbe in tbes:
        snap = _snapshot(tbe)
        try:
            indices, offsets = _warm_batch(tbe, batch_size, bag, gen)
            with torch.enable_grad():
                out = tbe(indices, offsets)
                out.backward(torch.randn(out.shape, generator=gen).to(out.device, out.dtype) * 1e-3)
        finally:
            _restore(tbe, snap)
    if tbes and tbes[0].linear_dev.is_cuda:
        torch.cuda.synchronize()
    return len(tbes)
