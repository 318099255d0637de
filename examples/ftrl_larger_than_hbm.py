#!/usr/bin/env python3
"""FTRL tables larger than the GPU's HBM: planned onto ``fused_uvm_caching`` and trained with DMP.

Four FTRL tables of 4M rows x 128 (fp32 weights plus 2 x D fp32 FTRL state: 24.6 GB in all) on one
GPU whose planner ``Topology`` is given ``--hbm-gib`` of HBM (default 4). TorchRec's planner, with
this project's storage estimate, cannot fit them in HBM and places them on ``fused_uvm_caching``:
the tables and their state in unified (host) memory, an HBM cache of whole rows (weight, accum,
linear). The script prints the plan, trains ``--steps`` steps of Zipf-distributed ids through
``DistributedModelParallel``, and prints the loss, the cache hit rate and the time per step.

Run on a CUDA machine:  python examples/ftrl_larger_than_hbm.py [--hbm-gib 4] [--steps 100]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torchrec
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import Topology
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec_ftrl
from torchrec_ftrl.fbgemm_enums import EmbOptimType


class Model(torch.nn.Module):
    def __init__(self, tables, device):
        super().__init__()
        self.ebc = torchrec.EmbeddingBagCollection(tables=tables, device=device)
        self.head = torch.nn.Linear(sum(t.embedding_dim for t in tables), 1, device="cuda")

    def forward(self, kjt):
        return self.head(self.ebc(kjt).values()).squeeze(1)


def batch(names, rows, B, L, gen):
    """A KJT of ``B`` bags of ``L`` Zipf(1.1)-ranked ids per feature, and random labels."""
    # Zipf-like ranks (Pareto tail, exponent 1.1): rank = u^(-1/0.1) - 1, folded into the table.
    ids = [(torch.rand(B * L, device="cuda", generator=gen).pow(-10.0).clamp(max=2.0**62).long() - 1)
           % rows for _ in names]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=names, values=torch.cat(ids), lengths=torch.full((B * len(names),), L, device="cuda"))
    return kjt, torch.randint(0, 2, (B,), device="cuda", generator=gen).float()


def tbes(optimizer, prefix=""):
    """``(name, TBE)`` behind DMP's fused optimizer (a CombinedOptimizer, one entry per TBE)."""
    if hasattr(optimizer, "_emb_module"):
        yield prefix, optimizer._emb_module
    for name, sub in getattr(optimizer, "_optims", ()):
        yield from tbes(sub, f"{prefix}.{name}" if prefix else name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hbm-gib", type=float, default=4.0)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=8192)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    names = [f"t{i}" for i in range(args.tables)]
    tables = [torchrec.EmbeddingBagConfig(name=n, feature_names=[n], num_embeddings=args.rows,
                                          embedding_dim=128) for n in names]
    fused = {"optimizer": EmbOptimType.FTRL, "learning_rate": 0.05, "ftrl_l1_reg": 1e-4,
             "ftrl_l2_reg": 1e-4, "ftrl_beta": 1.0, "cache_load_factor": 0.2,
             "gather_uvm_cache_stats": True}
    sharders = torchrec_ftrl.sharders(fused)
    topology = Topology(world_size=1, compute_device="cuda", hbm_cap=int(args.hbm_gib * 2**30))
    model = Model(tables, torch.device("meta"))
    plan = torchrec_ftrl.ftrl_planner(topology, batch_size=args.batch_size).collective_plan(
        model, sharders, dist.GroupMember.WORLD)
    print(plan)
    dmp = DistributedModelParallel(model, device=torch.device("cuda"), plan=plan, sharders=sharders)
    dense = torch.optim.Adam([p for n, p in dmp.named_parameters() if "head" in n], lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(0)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    t0 = None
    for step in range(args.steps):
        if step == 10:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        kjt, y = batch(names, args.rows, args.batch_size, 20, gen)
        loss = loss_fn(dmp(kjt), y)
        dense.zero_grad()
        loss.backward()
        dense.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t0) / max(1, args.steps - 10) * 1e3
    for name, tbe in tbes(dmp.fused_optimizer):
        if isinstance(tbe, torchrec_ftrl.FTRLTableBatchedEmbeddingBags) and tbe.cache is not None:
            stats = tbe.get_uvm_cache_stats()
            hit = 1.0 - int(stats[3]) / max(1, int(stats[2]))
            print(f"{name}: {tbe.embedding_specs[0][2].name}, {tbe.cache.slots} cache rows for "
                  f"{tbe.cache.total_rows} table rows, unique-row hit rate {hit:.3f}")
    print(f"{per_step:.2f} ms per step (batch {args.batch_size}, {args.tables} tables x {args.rows} x 128)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
