#!/usr/bin/env python3
"""Weak-scaling benchmark: a DMP model of large sparse tables (fixed batch per GPU), FTRL vs FBGEMM ADAM.

Launch one process per GPU with torchx, e.g. for 2 GPUs:

    torchx run -s local_cwd dist.ddp -j 1x2 --gpu 2 --script benchmarks/bench_scaling.py -- \\
        --optimizer ftrl --sharding row_wise --out outputs/scaling

Each process builds an ``EmbeddingBagCollection`` of ``--tables`` tables (``--rows`` x ``--dim``, fp32),
sharded by DMP with the given sharding type (``row_wise`` or ``table_row_wise``) and the fused optimizer
(``ftrl``: torchrec_ftrl's fused FTRL; ``adam``: FBGEMM's fused ADAM, the same 2 x D state). Batches of
``--batch-size`` samples per GPU, ``--pooling`` uniform random ids per bag, are made on the device
before timing, so the step time is the sparse model's forward (with its input/output all-to-alls),
backward and fused update. Rank 0 writes ``{out}/{optimizer}_{sharding}_g{world}.json``: median step
time (ms, CUDA events, after warm-up) and examples/s over all GPUs. Works for any number of GPUs (and on
CPU with gloo, for a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--optimizer", choices=("ftrl", "adam"), default="ftrl")
    p.add_argument("--sharding", choices=("row_wise", "table_row_wise", "table_wise"), default="row_wise",
                   help="the planner offers row_wise and table_row_wise only on CUDA")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8192, help="samples per GPU per step")
    p.add_argument("--pooling", type=int, default=20, help="ids per bag")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="outputs/scaling")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    import torchrec_ftrl
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    names = [f"t{i}" for i in range(args.tables)]
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=n, embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"f{i}"])
        for i, n in enumerate(names)], device=torch.device("meta"))
    optim = EmbOptimType.FTRL if args.optimizer == "ftrl" else EmbOptimType.ADAM
    fused = {"optimizer": optim, "learning_rate": 0.01}
    if args.optimizer == "ftrl":
        fused.update(ftrl_l1_reg=1e-4, ftrl_beta=1.0)
    sharders = torchrec_ftrl.sharders(fused)
    topology = Topology(world_size=world, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                        compute_device=device.type)
    constraints = {n: ParameterConstraints(sharding_types=[args.sharding], compute_kernels=["fused"])
                   for n in names}
    plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
        ebc, sharders, dist.GroupMember.WORLD)
    model = DistributedModelParallel(ebc, device=device, sharders=sharders, plan=plan)

    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    n_ids = args.tables * args.batch_size * args.pooling
    batches = [KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(args.tables)],
        values=torch.randint(0, args.rows, (n_ids,), device=device, generator=gen),
        lengths=torch.full((args.tables * args.batch_size,), args.pooling, dtype=torch.int64, device=device))
        for _ in range(3)]

    def step(kjt):
        out = model(kjt).values()
        out.sum().backward()

    times = []
    for it in range(args.warmup + args.steps):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(batches[it % len(batches)])
        if cuda:
            torch.cuda.synchronize()
        t = torch.tensor([time.perf_counter() - t0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends
        if it >= args.warmup:
            times.append(float(t) * 1e3)
    ms = statistics.median(times)
    result = dict(optimizer=args.optimizer, sharding=args.sharding, world_size=world,
                  device=torch.cuda.get_device_name(device) if cuda else "cpu",
                  tables=args.tables, rows=args.rows, dim=args.dim, batch_size_per_gpu=args.batch_size,
                  pooling=args.pooling, steps=args.steps, step_ms_median=ms,
                  step_ms_min=min(times), examples_per_s=args.batch_size * world / (ms / 1e3),
                  torch=torch.__version__)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{args.optimizer}_{args.sharding}_g{world}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(result, fh, indent=1)
        os.replace(path + ".tmp", path)
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
