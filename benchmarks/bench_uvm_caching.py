"""CUDA benchmark of FTRL tables larger than the HBM cache: ``fused_uvm_caching`` (and ``fused_uvm``).

One TBE training step (forward + backward with the fused optimizer update) of ours
(``FTRLTableBatchedEmbeddingBags``, fp32 state and bf16 state) and FBGEMM's
``SplitTableBatchedEmbeddingBagsCodegen`` under ADAM and EXACT_ROWWISE_ADAGRAD, side by side in one
process, each under the same placements: all in HBM (``DEVICE``), unified memory (``MANAGED``, ours
only) and unified memory with an HBM cache (``MANAGED_CACHING``, LRU) at cache load factors 0.05, 0.2
and 1.0.

Shape: T=2 tables of E=10M rows x D=128, fp32, B=16384, L=20 indices per bag, SUM pooling; ids
uniform or Zipf(1.1) (ranks scattered by a random permutation of each table's rows). Every step gets
a fresh batch (``--warmup + --iters`` distinct batches, made before timing), so the cache never holds
a replayed working set. Time: CUDA events around each step, median. Cache hit rate: 1 - unique
misses / unique indices, from FBGEMM's cache statistics over the timed steps (``gather_uvm_cache_stats``).
Miss traffic: each unique miss moves one row in (the weight and, for ours, accum + linear at the
cache row: 2 x D fp32 or 2 x D bf16, ``row_bytes``; FBGEMM caches only the weight) and, once the
cache is full, one evicted row out. PCIe is full duplex, so the rows in are reported against the
pinned host-to-device copy rate and the rows out against the device-to-host rate, both measured
here. ``--profile`` adds the kernel-time breakdown of one cached step of ours, fp32 and bf16 state
(Zipf, load factor 0.2).

Usage: python benchmarks/bench_uvm_caching.py [--out DIR] [--quick] [--methods M,...]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics

import torch

from bench_tbe_cuda import FTRL_KW, time_steps
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.fbgemm_enums import (BoundsCheckMode, CacheAlgorithm, ComputeDevice, EmbeddingLocation,
                                        EmbOptimType, PoolingMode, SparseType)
from torchrec_ftrl.state_dtype import parse_state_dtypes, state_bytes_per_element

METHODS = ("ours", "ours_bf16", "fbgemm_adam", "fbgemm_rowwise_adagrad")
LABELS = {"ours": "torchrec_ftrl FTRL", "ours_bf16": "torchrec_ftrl FTRL, bf16 state",
          "fbgemm_adam": "FBGEMM ADAM", "fbgemm_rowwise_adagrad": "FBGEMM EXACT_ROWWISE_ADAGRAD"}
# Ours: the TBE's optimizer_state_dtypes of each method.
OURS_STATE_DTYPES = {"ours": None, "ours_bf16": {"accum": SparseType.BF16, "linear": SparseType.BF16}}
# Cached state bytes per weight element that a miss moves with the row: ours' accum + linear in their
# dtypes (8 fp32, 4 bf16; the state cache rows beside the weight's); FBGEMM caches only the weight.
CACHED_STATE_BYTES = {**{m: state_bytes_per_element(parse_state_dtypes(sd))
                         for m, sd in OURS_STATE_DTYPES.items()},
                      "fbgemm_adam": 0, "fbgemm_rowwise_adagrad": 0}


def row_bytes(method, D, weight_bytes=4):
    """Bytes per row a cache miss moves each way: the weight and the cached optimizer state
    (ours, D=128 fp32 weights: 1,536 B with fp32 state, 1,024 B with bf16 state; FBGEMM: 512 B)."""
    return D * (weight_bytes + CACHED_STATE_BYTES[method])


def fresh_batches(T, E, B, L, dist, n, zipf_a=1.1, seed=0):
    """``n`` distinct batches on the GPU (indices int64 [T*B*L], offsets int64 [T*B+1])."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if dist == "zipf":
        cdf = torch.cumsum(torch.arange(1, E + 1, dtype=torch.float64, device="cuda") ** -zipf_a, 0)
        cdf /= cdf[-1].clone()
        perms = torch.stack([torch.randperm(E, device="cuda", generator=g) for _ in range(T)])
    out = []
    for _ in range(n):
        if dist == "uniform":
            idx = torch.randint(0, E, (T, B * L), device="cuda", generator=g)
        else:
            u = torch.rand(T * B * L, device="cuda", generator=g, dtype=torch.float64)
            ranks = torch.searchsorted(cdf, u).clamp_(max=E - 1).view(T, B * L)
            idx = torch.gather(perms, 1, ranks)
        off = torch.arange(0, T * B * L + 1, L, dtype=torch.int64, device="cuda")
        out.append((idx.reshape(-1).contiguous(), off))
    return out


def pcie_bandwidth():
    """(host-to-device, device-to-host) pinned copy rates, bytes/s (1 GiB each way)."""
    n = 1 << 28
    host = torch.empty(n, dtype=torch.float32, pin_memory=True).uniform_()
    dev = torch.empty(n, dtype=torch.float32, device="cuda")
    h2d = time_steps(lambda *_: dev.copy_(host, non_blocking=True), [(None, None)], 2, 10)
    d2h = time_steps(lambda *_: host.copy_(dev, non_blocking=True), [(None, None)], 2, 10)
    del host, dev
    return 4 * n / (h2d * 1e-3), 4 * n / (d2h * 1e-3)


def build(method, T, E, D, location, load_factor):
    specs = [(E, D, location, ComputeDevice.CUDA)] * T
    cache = dict(cache_load_factor=load_factor, cache_algorithm=CacheAlgorithm.LRU,
                 gather_uvm_cache_stats=location == EmbeddingLocation.MANAGED_CACHING)
    if method in OURS_STATE_DTYPES:
        # WARNING: TorchRec's default for fused tables (FATAL checks on the host, one sync per step).
        m = FTRLTableBatchedEmbeddingBags(specs, device="cuda", bounds_check_mode=BoundsCheckMode.WARNING,
                                          optimizer_state_dtypes=OURS_STATE_DTYPES[method], **FTRL_KW, **cache)
    else:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import \
            SplitTableBatchedEmbeddingBagsCodegen
        opt = {"fbgemm_adam": EmbOptimType.ADAM,
               "fbgemm_rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[method]
        m = SplitTableBatchedEmbeddingBagsCodegen(
            specs, optimizer=opt, learning_rate=0.05, eps=1e-8, weights_precision=SparseType.FP32,
            output_dtype=SparseType.FP32, pooling_mode=PoolingMode.SUM, device=torch.device("cuda"),
            cache_precision=SparseType.FP32, **cache)
    return m


def reset_stats(m):
    if hasattr(m, "cache") and m.cache is not None:
        m.cache.uvm_cache_stats.zero_()
    elif hasattr(m, "reset_uvm_cache_stats"):
        m.reset_uvm_cache_stats()


def hit_rate(m):
    stats = m.get_uvm_cache_stats() if hasattr(m, "get_uvm_cache_stats") else None
    if stats is None or stats.numel() < 4 or int(stats[2]) == 0:
        return None, 0
    stats = stats.cpu()
    return 1.0 - int(stats[3]) / int(stats[2]), int(stats[3])


def kernel_breakdown(step, batches, top=12):
    """``[(kernel name, ms per step)]`` of the ``top`` kernels over the given steps."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for b in batches:
            step(*b)
        torch.cuda.synchronize()
    rows = [(e.key[:80], getattr(e, "device_time_total", 0) / 1e3 / len(batches))
            for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def measure(method, location, lf, batches, T, E, D, B, warmup, iters, profile_steps=0):
    m = build(method, T, E, D, location, lf)
    grad = torch.randn(B, T * D, device="cuda")

    def step(idx, off):
        m(idx, off).backward(grad)
    for i in range(warmup):
        step(*batches[i])
    torch.cuda.synchronize()
    cached = location == EmbeddingLocation.MANAGED_CACHING
    if cached:
        reset_stats(m)
    times = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step(*batches[warmup + i])
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    ms = statistics.median(x.elapsed_time(y) for x, y in times)
    hr, misses = hit_rate(m) if cached else (None, 0)
    row = dict(method=method, label=LABELS[method], location=location.name,
               load_factor=lf if cached else None, ms=ms,
               hit_rate=hr, unique_misses_per_step=misses / iters if misses else None)
    if profile_steps:
        row["kernels_ms_per_step"] = kernel_breakdown(step, batches[:profile_steps])
    del m
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="E=1M rows, fewer steps (a smoke run)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--profile", action="store_true",
                    help="kernel-time breakdown of one cached step of ours and ours_bf16 (Zipf, load factor 0.2)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    args = ap.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        ap.error(f"--methods: {bad or methods} not in {', '.join(METHODS)}")
    T, E, D, B, L = 2, (1_000_000 if args.quick else 10_000_000), 128, 16384, 20
    out_dir = args.out or "."
    os.makedirs(out_dir, exist_ok=True)
    rows = []

    def log(row):   # printed and written as it comes: a run cut short keeps what it measured
        print(json.dumps(row), flush=True)
        rows.append(row)
        with open(os.path.join(out_dir, "uvm_caching.json"), "w") as f:
            json.dump(dict(shape=dict(T=T, E=E, D=D, B=B, L=L, precision="fp32", algorithm="LRU"), methods=methods,
                           h2d_GBps=h2d / 1e9, d2h_GBps=d2h / 1e9,
                           device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    h2d, d2h = pcie_bandwidth()   # before log() is called: it writes both
    print(json.dumps(dict(h2d_GBps=h2d / 1e9, d2h_GBps=d2h / 1e9,
                          device=torch.cuda.get_device_name())), flush=True)
    n = args.warmup + args.iters
    for dist in ("zipf", "uniform"):
        batches = fresh_batches(T, E, B, L, dist, n)
        for method in methods:
            placements = [(EmbeddingLocation.DEVICE, None)]
            if method in OURS_STATE_DTYPES:
                placements.append((EmbeddingLocation.MANAGED, None))
            placements += [(EmbeddingLocation.MANAGED_CACHING, lf) for lf in (0.05, 0.2, 1.0)]
            for location, lf in placements:
                try:
                    prof = 3 if (args.profile and method in OURS_STATE_DTYPES and dist == "zipf" and lf == 0.2) \
                        else 0
                    row = measure(method, location, lf, batches, T, E, D, B, args.warmup, args.iters,
                                  prof)
                except Exception as exc:  # noqa: BLE001 - a failed baseline is reported, not fatal
                    row = dict(method=method, location=location.name, load_factor=lf,
                               error=f"{type(exc).__name__}: {exc}"[:300])
                row["dist"] = dist
                if row.get("unique_misses_per_step"):
                    row["row_bytes"] = row_bytes(method, D)
                    rate = row["unique_misses_per_step"] * row["row_bytes"] / (row["ms"] * 1e-3)
                    row["rows_in_share_of_h2d"] = rate / h2d
                    row["rows_out_share_of_d2h"] = rate / d2h   # an upper bound: once the cache is full
                log(row)
        del batches
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
