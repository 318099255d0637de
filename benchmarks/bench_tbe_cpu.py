"""CPU benchmark of one training step (forward + backward with the fused optimizer update) of a TBE.

Compares ``torchrec_ftrl.FTRLTableBatchedEmbeddingBags`` (compiled "cpp" backend and vectorised "torch"
backend) with FBGEMM's CPU TBE (``SplitTableBatchedEmbeddingBagsCodegen``, location HOST, compute device
CPU) under EXACT_ROWWISE_ADAGRAD, EXACT_ADAGRAD and EXACT_SGD, and with an eager baseline
(``nn.EmbeddingBag(sparse=True)`` per table + the dense ``torchrec_ftrl.FTRL`` optimizer on the sparse
gradients). Shape (default): T=8 tables, E=100000 rows each, D=64, B=2048, L=20 indices per bag (fixed
length), fp32 weights, SUM pooling; indices uniform or Zipf(1.15) (ranks scattered by a fixed random
permutation of the rows). Reports the median wall time in ms per step over ``--iters`` timed steps after
``--warmup`` steps, cycling through ``--batches`` pre-generated batches, and the ratio to ours (cpp).
All modules of one index distribution are built first and their steps interleaved round-robin, so that
a shared machine's changing background load hits every method alike.

``--profile K`` records K more steps of each method with ``torch.profiler`` (after the timed ones)
and reports each method's top operators by self CPU time, to see where a method's step goes.

Usage: python benchmarks/bench_tbe_cpu.py [--threads 2] [--iters 20] [--out results.md] [--json results.json]
       [--profile 5]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import time

import numpy as np
import torch
from torch import nn

import torchrec_ftrl
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.fbgemm_enums import EmbOptimType, PoolingMode

FTRL_KW = dict(learning_rate=0.05, ftrl_l1_reg=1e-4, ftrl_l2_reg=1e-4, ftrl_beta=1.0)


def make_batches(args, dist: str, n: int, seed: int = 0):
    """``n`` batches of (indices int64 [T*B*L], offsets int64 [T*B+1]), feature-major."""
    rng = np.random.default_rng(seed)
    T, E, B, L = args.T, args.E, args.B, args.L
    if dist == "zipf":
        p = np.arange(1, E + 1, dtype=np.float64) ** -args.zipf_a
        p /= p.sum()
        perms = [rng.permutation(E) for _ in range(T)]
    out = []
    for _ in range(n):
        parts = []
        for t in range(T):
            if dist == "uniform":
                parts.append(rng.integers(0, E, size=B * L))
            else:
                parts.append(perms[t][rng.choice(E, size=B * L, p=p)])
        idx = torch.from_numpy(np.concatenate(parts).astype(np.int64))
        off = torch.arange(0, T * B * L + 1, L, dtype=torch.int64)
        out.append((idx, off))
    return out


def _fbgemm_version() -> str:
    try:
        from importlib.metadata import version
        return version("fbgemm-gpu-cpu")
    except Exception:  # noqa: BLE001
        return "?"


def tbe_step(module, grad):
    def step(idx, off):
        out = module(idx, off)
        out.backward(grad)
    return step


def build_ours(args, backend, state_dtype=None):
    """Our TBE on ``backend``; ``state_dtype="bf16"`` stores accum and linear in bf16 (half the state
    bytes each update reads and writes)."""
    extra = {"optimizer_state_dtypes": {"accum": state_dtype, "linear": state_dtype}} if state_dtype else {}
    return FTRLTableBatchedEmbeddingBags([(args.E, args.D)] * args.T, backend=backend, **FTRL_KW, **extra)


def build_fbgemm(args, optim):
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(args.E, args.D, EmbeddingLocation.HOST, ComputeDevice.CPU)] * args.T,
        optimizer=optim, learning_rate=0.05, eps=1e-8, pooling_mode=PoolingMode.SUM,
        device=torch.device("cpu"))


def eager_step(args):
    embs = nn.ModuleList(nn.EmbeddingBag(args.E, args.D, mode="sum", sparse=True) for _ in range(args.T))
    opt = torchrec_ftrl.FTRL(embs.parameters(), lr=FTRL_KW["learning_rate"],
                             **{k: v for k, v in FTRL_KW.items() if k != "learning_rate"})
    T, B = args.T, args.B
    grad = torch.randn(B, T * args.D)

    def step(idx, off):
        n_per = idx.numel() // T
        outs = [embs[t](idx[t * n_per:(t + 1) * n_per], off[t * B:(t + 1) * B] - t * n_per)
                for t in range(T)]
        torch.cat(outs, dim=1).backward(grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return embs, step


def profile_steps(step, batches, k: int, top: int = 8) -> list:
    """``[(operator, self CPU ms per step, calls per step)]`` of the ``top`` operators of ``k`` steps
    under ``torch.profiler`` (CPU activity), by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(k):
            step(*batches[i % len(batches)])
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [(e.key, e.self_cpu_time_total / 1e3 / k, e.count / k) for e in events]


FBGEMM_OPTIMIZERS = {"fbgemm_rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                     "fbgemm_adagrad": EmbOptimType.EXACT_ADAGRAD, "fbgemm_sgd": EmbOptimType.EXACT_SGD}
LABELS = {"cpp": "torchrec_ftrl FTRL, cpp backend", "torch": "torchrec_ftrl FTRL, torch backend",
          "cpp_bf16": "torchrec_ftrl FTRL, cpp backend, bf16 state",
          "fbgemm_rowwise_adagrad": "FBGEMM CPU TBE EXACT_ROWWISE_ADAGRAD",
          "fbgemm_adagrad": "FBGEMM CPU TBE EXACT_ADAGRAD", "fbgemm_sgd": "FBGEMM CPU TBE EXACT_SGD",
          "eager": "nn.EmbeddingBag(sparse=True) x T + torchrec_ftrl.FTRL"}


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=8)
    ap.add_argument("--E", type=int, default=100_000)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--B", type=int, default=2048)
    ap.add_argument("--L", type=int, default=20)
    ap.add_argument("--zipf-a", type=float, default=1.15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--dists", default="uniform,zipf")
    ap.add_argument("--methods", default="cpp,torch,fbgemm_rowwise_adagrad,fbgemm_adagrad,fbgemm_sgd,eager",
                    help="of cpp, cpp_bf16 (bf16 FTRL state), torch, fbgemm_rowwise_adagrad, "
                         "fbgemm_adagrad, fbgemm_sgd, eager")
    ap.add_argument("--out", default=None, help="also write the markdown table to this file")
    ap.add_argument("--json", default=None, help="also write the results (machine, date, ms) as JSON")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="profile K more steps of each method (top operators by self CPU time)")
    return ap


def build_method(args, m):
    """``(module, step)`` of method ``m`` (a key of ``LABELS``) at the flags' shape; ``step(idx,
    off)`` runs one training step. Exits on an unknown method."""
    grad = torch.randn(args.B, args.T * args.D)
    if m in ("cpp", "torch", "cpp_bf16"):
        mod = build_ours(args, m.split("_")[0], "bf16" if m.endswith("bf16") else None)
        return mod, tbe_step(mod, grad)
    if m in FBGEMM_OPTIMIZERS:
        mod = build_fbgemm(args, FBGEMM_OPTIMIZERS[m])
        return mod, tbe_step(mod, grad)
    if m == "eager":
        return eager_step(args)
    raise SystemExit(f"unknown method {m!r}")


def time_round_robin(methods, steps, batches, iters, slow):
    """``({method: [wall ms]}, {method: [process CPU ms]})`` of ``iters`` rounds, each timing one
    step (``steps[method]``) of every one of ``methods`` in a rotating order, so that all methods
    see the same background load on a shared machine; a method of ``slow`` (``{method: n}``) is
    timed in the first ``n`` rounds only."""
    wall = {m: [] for m in methods}
    cpus = {m: [] for m in methods}
    for it in range(iters):
        idx, off = batches[it % len(batches)]
        order = methods[it % len(methods):] + methods[:it % len(methods)]
        for m in order:
            if it >= slow.get(m, iters):
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            steps[m](idx, off)
            wall[m].append((time.perf_counter() - t0) * 1e3)
            cpus[m].append((time.process_time() - c0) * 1e3)
    return wall, cpus


def run_dist(args, dist, methods, slow):
    """Every method on ``dist`` ids: all built and warmed up first, then timed round-robin
    (``time_round_robin``) and, with ``--profile``, profiled. Returns ``({method: median wall
    ms}, {method: median CPU ms}, {method: top operators})``; prints each method's line."""
    batches = make_batches(args, dist, args.batches)
    uniq = np.mean([float(torch.unique(i[: i.numel() // args.T]).numel()) for i, _ in batches])
    print(f"[{dist}] unique rows per table per batch ~ {uniq:.0f} of {args.B * args.L} lookups", flush=True)
    steps, keep = {}, []
    for m in methods:
        mod, steps[m] = build_method(args, m)
        keep.append(mod)
        for i in range(args.warmup):
            steps[m](*batches[i % len(batches)])
    wall, cpus = time_round_robin(methods, steps, batches, args.iters, slow)
    profiles = {m: profile_steps(steps[m], batches, args.profile) for m in (methods if args.profile else ())}
    res = {m: statistics.median(wall[m]) for m in methods}
    cpu = {m: statistics.median(cpus[m]) for m in methods}
    for m in methods:
        print(f"  {m:24s} {res[m]:9.2f} ms/step wall {cpu[m]:9.2f} ms/step CPU "
              f"({len(wall[m])} steps)", flush=True)
    del keep, steps
    gc.collect()
    return res, cpu, profiles


def markdown(args, methods, dists, res, cpu, profiles, slow, date, machine) -> str:
    """The report: the run's caption, one line per method (per distribution: wall ms, ratio to
    ours (cpp), CPU ms), then each profiled method's top operators."""
    lines = [f"Measured {date} on {machine}.", "",
             f"Fwd+bwd(+fused update) step, T={args.T}, E={args.E}, D={args.D}, B={args.B}, L={args.L}, fp32, "
             f"SUM pooling, {args.threads} threads, {platform.processor() or platform.machine()}, "
             f"torch {torch.__version__}, fbgemm_gpu {_fbgemm_version()}; median of {args.iters} steps (torch "
             f"backend: {slow['torch']}, eager: {slow['eager']}) after {args.warmup} warm-up, methods "
             "interleaved round-robin.", "",
             f"Load average at the end: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs. "
             "CPU ms = process CPU time (all threads) per step.", "",
             "| method | " + " | ".join(f"{d} wall ms | {d} / ours | {d} CPU ms" for d in dists) + " |",
             "|---|" + "---:|---:|---:|" * len(dists)]
    for m in methods:
        cells = []
        for d in dists:
            ref = res.get((d, "cpp"))
            v = res[(d, m)]
            cells += [f"{v:.2f}", f"{v / ref:.2f}x" if ref else "-", f"{cpu[(d, m)]:.2f}"]
        lines.append(f"| {LABELS[m]} | " + " | ".join(cells) + " |")
    for (d, m), top in profiles.items():
        lines += ["", f"Top operators by self CPU time, {LABELS[m]}, {d} ({args.profile} steps, ms per step):",
                  "", "| operator | self CPU ms | calls per step |", "|---|---:|---:|"]
        lines += [f"| `{name}` | {ms:.2f} | {calls:g} |" for name, ms, calls in top]
    return "\n".join(lines)


def write_json(path, args, methods, dists, res, cpu, profiles, date, machine) -> None:
    """The results as JSON at ``path``: machine, date, versions, flags, median wall and CPU ms and
    the ratio to ours per distribution and method, and the profiles' top operators."""
    with open(path, "w") as f:
        json.dump({"date": date, "machine": machine, "torch": torch.__version__,
                   "fbgemm_gpu": _fbgemm_version(), "args": vars(args),
                   "load_avg_1min_at_end": os.getloadavg()[0],
                   "median_wall_ms": {d: {m: res[(d, m)] for m in methods} for d in dists},
                   "median_cpu_ms": {d: {m: cpu[(d, m)] for m in methods} for d in dists},
                   "ratio_to_ours": {d: {m: res[(d, m)] / res[(d, "cpp")] for m in methods}
                                     for d in dists if (d, "cpp") in res},
                   "profile_top_ops": {f"{d}/{m}": top for (d, m), top in profiles.items()}},
                  f, indent=1)


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    dists = args.dists.split(",")
    res: dict[tuple[str, str], float] = {}
    cpu: dict[tuple[str, str], float] = {}
    profiles: dict[tuple[str, str], list] = {}
    slow = {"torch": max(3, args.iters // 4), "eager": max(3, args.iters // 2)}
    for dist in dists:
        wall_d, cpu_d, prof_d = run_dist(args, dist, methods, slow)
        res.update({(dist, m): v for m, v in wall_d.items()})
        cpu.update({(dist, m): v for m, v in cpu_d.items()})
        profiles.update({(dist, m): v for m, v in prof_d.items()})

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
               f"{platform.platform()}")
    table = markdown(args, methods, dists, res, cpu, profiles, slow, date, machine)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    if args.json:
        write_json(args.json, args, methods, dists, res, cpu, profiles, date, machine)

if __name__ == "__main__":
    main()
