"""Kernel warm-up before the first timed step (``--kernel-warmup``).

A TBE's first training lookups in a process cost more than the later ones: the FTRL TBE's Triton
kernels are compiled (or loaded from Triton's on-disk cache), and FBGEMM's TBE (row-wise Adagrad)
makes its first CUDA calls. Without a warm-up this happens inside the first training steps.
:func:`warm_up` runs every TBE of the sharded model (FTRL's and FBGEMM's) once, forward and
backward, on a throw-away batch of the training batch's shape whose ids stay among the first
:data:`WARMUP_ROWS` rows of each table, and then puts back those rows' weights and optimizer states
(copies taken before), the TBE's step counters (``iter``; FBGEMM's ``iter_cpu`` and ``step`` too)
and empties an HBM cache (``fused_uvm_caching``): afterwards the tables are bit for bit what they
were, and the kernels the training steps launch have run once. The dense model and the dense
optimizer are not involved.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

from torchrec_ftrl.integration.compute_kernels import tbes_of_type
from torchrec_ftrl.tbe import FTRLTableBatchedEmbeddingBags

WARMUP_ROWS = 64


_COUNTERS = ("iter", "iter_cpu", "step")   # FTRL's TBE has iter; FBGEMM's has all three


def enabled(mode: str, device: torch.device) -> bool:
    """``--kernel-warmup``: ``on``, ``off``, or ``auto`` (on with CUDA, where kernels load)."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def model_tbes(model: torch.nn.Module) -> list:
    """The TBEs :func:`warm_up` runs: the FTRL TBEs of ``model``, then FBGEMM's training TBEs."""
    return [*tbes_of_type(model, FTRLTableBatchedEmbeddingBags),
            *tbes_of_type(model, SplitTableBatchedEmbeddingBagsCodegen)]


def _device(tbe) -> torch.device:
    """The device of ``tbe``'s lookups (FBGEMM's TBE names it ``current_device``: a device, or in
    some fbgemm_gpu versions a CUDA device index)."""
    if isinstance(tbe, FTRLTableBatchedEmbeddingBags):
        return tbe.linear_dev.device
    return torch.device(tbe.current_device)


def _warm_batch(tbe, batch_size: int, bag_size: int, gen: torch.Generator):
    """``(indices, offsets)``: ``batch_size`` bags of ``bag_size`` ids per feature of ``tbe``, ids
    below ``min(rows, WARMUP_ROWS)`` of each feature's table."""
    device = _device(tbe)
    ids = []
    for t in tbe.feature_table_map:
        high = min(tbe.embedding_specs[t][0], WARMUP_ROWS)
        ids.append(torch.randint(0, high, (batch_size * bag_size,), generator=gen))
    indices = torch.cat(ids).to(device)
    offsets = torch.arange(0, len(tbe.feature_table_map) * batch_size + 1, dtype=torch.int64) * bag_size
    return indices, offsets.to(device)


@torch.no_grad()
def _snapshot(tbe) -> list:
    """Copies of the first rows of every table's weights and optimizer states, and of the step
    counters."""
    rows = [min(spec[0], WARMUP_ROWS) for spec in tbe.embedding_specs]
    weights = [w[:k].clone() for w, k in zip(tbe.split_embedding_weights(), rows)]
    states = [[s[:k].clone() for s in table] for table, k in zip(tbe.split_optimizer_states(), rows)]
    counters = {n: getattr(tbe, n) for n in _COUNTERS if hasattr(tbe, n)}
    return [weights, states, {n: c.clone() if torch.is_tensor(c) else c for n, c in counters.items()}]


@torch.no_grad()
def _restore(tbe, snap: list) -> None:
    """Put back what :func:`_snapshot` copied. An HBM cache holds warmed-up rows: it is flushed
    (written back) and emptied first, and only then are the originals written, so no later flush
    can write a warmed-up row over them."""
    weights, states, counters = snap
    tbe.flush()
    tbe.reset_cache_states()
    for w, saved in zip(tbe.split_embedding_weights(), weights):
        w[:saved.shape[0]].copy_(saved)
    for table, saved in zip(tbe.split_optimizer_states(), states):
        for s, k in zip(table, saved):
            s[:k.shape[0]].copy_(k)
    for name, value in counters.items():
        if torch.is_tensor(value):
            getattr(tbe, name).copy_(value)
        else:
            setattr(tbe, name, value)


def warm_up(model: torch.nn.Module, batch_size: int, multi_hot: Optional[Sequence[int]] = None,
            seed: int = 0) -> int:
    """Run each TBE of ``model`` (:func:`model_tbes`) once on a throw-away batch of ``batch_size``
    bags per feature (bag size: the mean of ``multi_hot`` rounded up, else 1) and restore it (module
    docstring). The global random state is not used. Returns the number of TBEs warmed."""
    gen = torch.Generator().manual_seed(seed)
    bag = -(-sum(multi_hot) // len(multi_hot)) if multi_hot else 1   # the mean bag, rounded up
    tbes = model_tbes(model)
    for tbe in tbes:
        snap = _snapshot(tbe)
        try:
            indices, offsets = _warm_batch(tbe, batch_size, bag, gen)
            with torch.enable_grad():
                out = tbe(indices, offsets)
                out.backward(torch.randn(out.shape, generator=gen).to(out.device, out.dtype) * 1e-3)
        finally:
            _restore(tbe, snap)
    if any(_device(tbe).type == "cuda" for tbe in tbes):
        torch.cuda.synchronize()
    return len(tbes)
