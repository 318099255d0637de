"""CUDA benchmark of one TBE training step (forward + backward with the fused optimizer update).

Compares ``torchrec_ftrl.FTRLTableBatchedEmbeddingBags`` (Triton backend, fused FTRL) with FBGEMM's
CUDA TBE (``SplitTableBatchedEmbeddingBagsCodegen``, location DEVICE, compute CUDA) under ADAM (also
with row-wise bias correction: plain ADAM fails with fp16 weights in fbgemm_gpu 1.6.0),
EXACT_ROWWISE_ADAGRAD and EXACT_SGD, and with an eager baseline (``nn.EmbeddingBag(sparse=True)`` per
table + ``torchrec_ftrl.FTRL`` on the sparse gradients), side by side in one process.

Shapes: T=32 tables, E=100000 rows, B=8192, L=20 indices per bag (fixed), SUM pooling; D=128, 64,
256 in fp32 and D=128 with fp16 weights; indices uniform or Zipf(1.15) (ranks scattered by a random
permutation of each table's rows). Time: CUDA events around each step, median over ``--iters`` steps
after ``--warmup``, cycling through ``--batches`` batches. Achieved bandwidth uses the bytes-moved model
of ``benchmarks/README.md`` (``bytes_model`` below), against the measured device-to-device copy rate.

Usage: python benchmarks/bench_tbe_cuda.py [--out DIR] [--tune] [--tune-forward] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import time
import traceback

import torch
from torch import nn

import torchrec_ftrl
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.kernels import triton_backend
from torchrec_ftrl.fbgemm_enums import BoundsCheckMode, EmbOptimType, PoolingMode, SparseType

FTRL_KW = dict(learning_rate=0.05, ftrl_l1_reg=1e-4, ftrl_l2_reg=1e-4, ftrl_beta=1.0)
LABELS = {
    "ours": "torchrec_ftrl FTRL (Triton)",
    "ours_ignore": "torchrec_ftrl FTRL (Triton), bounds check IGNORE",
    "fbgemm_adam": "FBGEMM ADAM",
    "fbgemm_adam_rbc": "FBGEMM ADAM, row-wise bias correction",
    "fbgemm_rowwise_adagrad": "FBGEMM EXACT_ROWWISE_ADAGRAD",
    "fbgemm_sgd": "FBGEMM EXACT_SGD",
    "eager": "eager nn.EmbeddingBag(sparse=True) + FTRL",
}
FB_OPT = {"fbgemm_adam": "ADAM", "fbgemm_adam_rbc": "ADAM",
          "fbgemm_rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "fbgemm_sgd": "EXACT_SGD"}


def make_batches(T, E, B, L, dist, n, zipf_a=1.15, seed=0):
    """``n`` batches (indices int64 [T*B*L], offsets int64 [T*B+1]) on the GPU, feature-major."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    if dist == "zipf":
        p = torch.arange(1, E + 1, dtype=torch.float64, device="cuda") ** -zipf_a
        p = (p / p.sum()).float()
        perms = torch.stack([torch.randperm(E, device="cuda", generator=g) for _ in range(T)])
    for _ in range(n):
        if dist == "uniform":
            idx = torch.randint(0, E, (T, B * L), device="cuda", generator=g)
        else:
            ranks = torch.multinomial(p, T * B * L, replacement=True, generator=g).view(T, B * L)
            idx = torch.gather(perms, 1, ranks)
        off = torch.arange(0, T * B * L + 1, L, dtype=torch.int64, device="cuda")
        out.append((idx.reshape(-1).contiguous(), off))
    return out


def time_steps(step, batches, warmup, iters):
    for i in range(warmup):
        step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i in range(iters):
        idx, off = batches[i % len(batches)]
        evs[i][0].record()
        step(idx, off)
        evs[i][1].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in evs)


def copy_bandwidth():
    n = 1 << 29  # 2 GiB of fp32
    a = torch.empty(n, device="cuda").uniform_()
    b = torch.empty_like(a)
    ms = time_steps(lambda *_: b.copy_(a), [(None, None)], 3, 20)
    del a, b
    return 2 * 4 * n / (ms * 1e-3)


HBM_SPEC = 4.8e12   # H200 HBM3e bandwidth by NVIDIA's spec, bytes/s


def bytes_model(method, N, U, T, B, D, wbytes):
    """Compulsory bytes of one step (benchmarks/README.md). Returns (fwd, bwd) bytes.

    Forward: the N indices once (8 B each), each of the U unique rows' weight once, the T*B pooled
    fp32 outputs written. Backward: the T*B fp32 output gradients read once; per unique row its
    weight read again and written, and its optimizer state read and written."""
    fwd = N * 8 + U * D * wbytes + T * B * D * 4
    state = {"ours": 16 * D, "ours_ignore": 16 * D, "fbgemm_adam": 16 * D, "eager": 16 * D,
             "fbgemm_adam_rbc": 16 * D + 8, "fbgemm_rowwise_adagrad": 8, "fbgemm_sgd": 0}[method]
    bwd = T * B * D * 4 + U * (2 * D * wbytes + state)
    return fwd, bwd


def build_ours(T, E, D, precision, bounds=BoundsCheckMode.WARNING):
    return FTRLTableBatchedEmbeddingBags([(E, D)] * T, device="cuda", weights_precision=precision,
                                         bounds_check_mode=bounds, **FTRL_KW)


def build_fbgemm(T, E, D, precision, method):
    """FBGEMM's CUDA TBE for ``method`` (a key of ``FB_OPT``). ``fbgemm_adam_rbc``: ADAM with
    ``use_rowwise_bias_correction`` (a per-row fp32 step counter, read and written with each row): in
    fbgemm_gpu 1.6.0 plain ADAM fails with fp16 weights (``row_counter_dev`` expected Float, found
    Half), this variant runs, so it stands in for ADAM on the fp16 rows."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen, UserEnabledConfigDefinition)
    extra = {}
    if method == "fbgemm_adam_rbc":
        extra["extra_optimizer_config"] = UserEnabledConfigDefinition(use_rowwise_bias_correction=True)
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(E, D, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)] * T,
        optimizer=getattr(EmbOptimType, FB_OPT[method]), learning_rate=0.05, eps=1e-8,
        weights_precision=precision, output_dtype=SparseType.FP32,
        pooling_mode=PoolingMode.SUM, device=torch.device("cuda"), **extra)


def tbe_step(module, grad):
    def step(idx, off):
        module(idx, off).backward(grad)
    return step


def eager_step(T, E, D, B):
    embs = nn.ModuleList(nn.EmbeddingBag(E, D, mode="sum", sparse=True) for _ in range(T)).cuda()
    opt = torchrec_ftrl.FTRL(embs.parameters(), lr=FTRL_KW["learning_rate"],
                             **{k: v for k, v in FTRL_KW.items() if k != "learning_rate"})
    grad = torch.randn(B, T * D, device="cuda")

    def step(idx, off):
        n_per = idx.numel() // T
        outs = [embs[t](idx[t * n_per:(t + 1) * n_per], off[t * B:(t + 1) * B] - t * n_per)
                for t in range(T)]
        torch.cat(outs, dim=1).backward(grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return embs, step


def tune(T, E, B, L, batches_by_dist, log):
    """Small sweep of the backward launch knobs at D=128 fp32 (uniform + Zipf step time summed);
    keeps the fastest setting of each group."""
    grad = torch.randn(B, T * 128, device="cuda")
    m = build_ours(T, E, 128, SparseType.FP32)

    def step_ms():
        return sum(time_steps(tbe_step(m, grad), b, 3, 15) for b in batches_by_dist.values())

    best = {}
    step_ms()  # first timing after building a module runs slow: discard one
    launch = dict(triton_backend.TUNING["seg_launch"])
    for seg_tile, seg_rows in ((2048, 4), (1024, 4), (2048, 8), (4096, 4)):
        triton_backend.TUNING["seg_launch"] = {**launch, 128: (seg_tile, seg_rows)}
        ms = step_ms()
        log(f"  tune seg_launch[128]=({seg_tile}, {seg_rows}): uniform+zipf steps {ms:.3f} ms")
        if ms < best.get("seg_launch", (1e9,))[0]:
            best["seg_launch"] = (ms, dict(seg_launch={**launch, 128: (seg_tile, seg_rows)}))
    triton_backend.TUNING.update(best["seg_launch"][1])
    for seg in (32, 64, 128):
        triton_backend.TUNING.update(seg=seg)
        ms = step_ms()
        log(f"  tune seg={seg}: uniform+zipf steps {ms:.3f} ms")
        if ms < best.get("seg", (1e9,))[0]:
            best["seg"] = (ms, dict(seg=seg))
    triton_backend.TUNING.update(best["seg"][1])
    del m
    log(f"  chosen TUNING {triton_backend.TUNING}")


def tune_forward(T, E, B, L, batches_by_dist, log):
    """Sweep of the training forward's launch table ``TUNING["fwd"]`` (elements per step, indices
    per bag in flight, eviction policy) per weight row size: forward-only time (``forward_train``:
    linearise + lookup by row keys), uniform + Zipf summed. Logs the three fastest settings of each
    row size; the table is not changed."""
    base = dict(triton_backend.TUNING["fwd"])
    for D, prec in ((64, SparseType.FP32), (128, SparseType.FP32), (256, SparseType.FP32),
                    (128, SparseType.FP16)):
        m = build_ours(T, E, D, prec)
        wbytes = 2 if prec == SparseType.FP16 else 4
        row = triton_backend._block_d(D) * wbytes
        lists = [[(m._make_batch(i, o, None, None), None) for i, o in b] for b in batches_by_dist.values()]

        def fwd(batch, _):
            return triton_backend.forward_train(m.weights_dev, batch, torch.float32)[0]

        res = []
        for tile, unroll, ev in itertools.product((1024, 2048, 4096), (1, 2, 4), ("", "evict_last")):
            if wbytes < 4 and unroll > 2:
                continue  # capped at 2 by the backend
            triton_backend.TUNING["fwd"] = {**base, row: (tile, unroll, ev)}
            res.append((sum(time_steps(fwd, bl, 3, 20) for bl in lists), (tile, unroll, ev)))
        triton_backend.TUNING["fwd"] = base
        res.sort()
        log(f"  tune forward D={D} {prec.name} (row {row} B): " +
            " | ".join(f"{c} {ms:.3f} ms" for ms, c in res[:3]) + f"; current {base.get(row)}")
        del m


def profile_step(step, batches, log):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(3):
            step(*batches[i % len(batches)])
        torch.cuda.synchronize()
    log("kernel times of 3 steps of ours:\n" + prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


def device_ms(step, batches, n=3):
    """Kernel (device) time per step: the sum of the CUDA kernel, memcpy and memset times that
    torch.profiler records over ``n`` steps, divided by ``n`` (no host time, no launch gaps)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            step(*batches[i % len(batches)])
        torch.cuda.synchronize()
    total = sum(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                for e in prof.key_averages() if not e.key.startswith("ProfilerStep"))
    return total / n / 1e3


def host_floor_ms(step, batches, n=50):
    """Host time per step when the GPU work is negligible (call with tiny batches): the least a step
    can take on this machine, whatever the kernels."""
    for i in range(5):
        step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        step(*batches[i % len(batches)])
    host = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    return host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=32)
    ap.add_argument("--E", type=int, default=100_000)
    ap.add_argument("--B", type=int, default=8192)
    ap.add_argument("--L", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--tune", action="store_true", help="sweep the backward launch knobs first")
    ap.add_argument("--tune-forward", action="store_true",
                    help="sweep the forward launch table, log the fastest settings, then exit")
    ap.add_argument("--profile", action="store_true", help="kernel time table of ours, first shape")
    ap.add_argument("--quick", action="store_true", help="first shape only")
    ap.add_argument("--no-eager", action="store_true", help="skip the (slow) eager baseline")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    T, E, B, L = args.T, args.E, args.B, args.L
    N = T * B * L
    lines_log = []

    def log(s):
        print(s, flush=True)
        lines_log.append(s)

    props = torch.cuda.get_device_properties(0)
    bw_copy = copy_bandwidth()
    log(f"device {props.name}, torch {torch.__version__}, copy bandwidth {bw_copy / 1e12:.2f} TB/s")
    keys = torch.randint(0, T * E, (N,), device="cuda", dtype=torch.int32)
    sort_ms = time_steps(lambda *_: torch.sort(keys, stable=True), [(None, None)], 3, 20)
    log(f"torch.sort of {N} int32 keys (stable, with indices): {sort_ms:.3f} ms")
    del keys
    shapes = [(128, SparseType.FP32), (64, SparseType.FP32), (256, SparseType.FP32), (128, SparseType.FP16)]
    if args.quick:
        shapes = shapes[:1]
    results = []
    batches_cache = {}
    row_profiled = False
    if args.tune or args.tune_forward:
        for dist in ("uniform", "zipf"):
            batches_cache[dist] = make_batches(T, E, B, L, dist, args.batches)
    if args.tune_forward:
        tune_forward(T, E, B, L, batches_cache, log)
        return
    if args.tune:
        tune(T, E, B, L, batches_cache, log)
    tiny = make_batches(T, E, 64, L, "zipf", args.batches)
    tiny_grad = torch.randn(64, T * 64, device="cuda")
    host_floor = {}
    for m in ("ours", "fbgemm_adam", "fbgemm_sgd"):
        mod = build_ours(T, E, 64, SparseType.FP32) if m == "ours" else \
            build_fbgemm(T, E, 64, SparseType.FP32, m)
        host_floor[m] = host_floor_ms(tbe_step(mod, tiny_grad), tiny)
        del mod
    log("host time per step with B=64 (GPU work negligible), D=64: " +
        ", ".join(f"{LABELS[m]} {v:.3f} ms" for m, v in host_floor.items()))
    del tiny, tiny_grad
    for D, prec in shapes:
        for dist in ("uniform", "zipf"):
            batches = batches_cache.get(dist) or make_batches(T, E, B, L, dist, args.batches)
            batches_cache[dist] = batches
            U = statistics.mean(
                float(torch.unique(i.view(T, -1) + torch.arange(T, device="cuda")[:, None] * E).numel())
                for i, _ in batches)
            wbytes = 2 if prec == SparseType.FP16 else 4
            methods = ["ours", "ours_ignore", "fbgemm_adam", "fbgemm_adam_rbc", "fbgemm_rowwise_adagrad",
                       "fbgemm_sgd"]
            if D == 128 and prec == SparseType.FP32 and not args.no_eager:
                methods.append("eager")
            row = dict(D=D, precision=prec.name, wbytes=wbytes, dist=dist, unique_rows=U, lookups=N,
                       ms={}, fwd_ms={}, device_ms={})
            log(f"[D={D} {prec.name} {dist}] N={N} lookups, U={U:.0f} unique rows")
            for m in methods:
                try:
                    grad = torch.randn(B, T * D, device="cuda")
                    if m.startswith("ours"):
                        mod = build_ours(T, E, D, prec, BoundsCheckMode.IGNORE if m == "ours_ignore"
                                         else BoundsCheckMode.WARNING)
                        step = tbe_step(mod, grad)
                    elif m in FB_OPT:
                        mod = build_fbgemm(T, E, D, prec, m)
                        step = tbe_step(mod, grad)
                    else:
                        mod, step = eager_step(T, E, D, B)
                    iters = args.iters if m != "eager" else 3
                    ms = time_steps(step, batches, args.warmup if m != "eager" else 1, iters)
                    with torch.no_grad():
                        fwd_ms = time_steps(lambda i, o: mod(i, o) if m != "eager" else None,
                                            batches, 2, 10) if m != "eager" else float("nan")
                    row["ms"][m], row["fwd_ms"][m] = ms, fwd_ms
                    fb, bb = bytes_model(m, N, U, T, B, D, wbytes)
                    log(f"  {m:24s} step {ms:8.3f} ms  fwd {fwd_ms:7.3f} ms  "
                        f"model {(fb + bb) / 1e9:.2f} GB -> {(fb + bb) / (ms * 1e-3) / 1e12:.2f} TB/s")
                    if m == "ours":
                        row["device_ms"][m] = device_ms(step, batches)
                        log(f"  {m:24s} kernel time {row['device_ms'][m]:.3f} ms per step")
                    if args.profile and m == "ours" and D == 128 and prec == SparseType.FP32:
                        profile_step(step, batches, log)
                        row_profiled = True
                    del mod, step
                except Exception as exc:  # keep the other methods running
                    log(f"  {m} FAILED: {exc!r}")
                    traceback.print_exc()
                gc.collect()
                torch.cuda.empty_cache()
            results.append(row)

    # ------------------------------------------------------------------ markdown
    md = [f"One training step (fwd + bwd + fused optimizer update), {props.name}, torch {torch.__version__}; "
          f"T={T}, E={E}, B={B}, L={L}, SUM pooling; median of {args.iters} steps (eager: 3) by CUDA "
          f"events. Measured copy bandwidth {bw_copy / 1e12:.2f} TB/s. BW = compulsory bytes "
          f"(benchmarks/README.md) / step time. Ours uses bounds_check_mode=WARNING (FBGEMM's default) "
          f"unless marked IGNORE.", "",
          "| D | weights | indices | unique rows | method | ms / step | fwd ms | vs FBGEMM ADAM | BW TB/s | % of copy BW | % of 4.8 TB/s |",
          "|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in results:
        adam = row["ms"].get("fbgemm_adam")
        for m, ms in row["ms"].items():
            fb, bb = bytes_model(m, N, row["unique_rows"], T, B, row["D"], row["wbytes"])
            bw = (fb + bb) / (ms * 1e-3)
            md.append(f"| {row['D']} | {row['precision']} | {row['dist']} | {row['unique_rows']:.0f} | "
                      f"{LABELS[m]} | {ms:.3f} | {row['fwd_ms'][m]:.3f} | "
                      f"{f'{adam / ms:.2f}x' if adam else '–'} | {bw / 1e12:.2f} | "
                      f"{100 * bw / bw_copy:.0f}% | {100 * bw / HBM_SPEC:.0f}% |")
    md.append("")
    md.append("Ours (WARNING): step time against kernel time (device time summed by torch.profiler; "
              "a step above it waits on the host). Host time per step with B=64, where the GPU work "
              "is negligible: " + ", ".join(f"{LABELS[m]} {v:.3f} ms" for m, v in host_floor.items())
              + ".")
    md.append("")
    md.append("| D | weights | indices | ms / step | kernel ms / step | BW by kernel time | % of copy BW | % of 4.8 TB/s |")
    md.append("|---:|---|---|---:|---:|---:|---:|---:|")
    for row in results:
        if "ours" in row["device_ms"]:
            fb, bb = bytes_model("ours", N, row["unique_rows"], T, B, row["D"], row["wbytes"])
            kbw = (fb + bb) / (row["device_ms"]["ours"] * 1e-3)
            md.append(f"| {row['D']} | {row['precision']} | {row['dist']} | {row['ms']['ours']:.3f} | "
                      f"{row['device_ms']['ours']:.3f} | {kbw / 1e12:.2f} TB/s | "
                      f"{100 * kbw / bw_copy:.0f}% | {100 * kbw / HBM_SPEC:.0f}% |")
    md.append("")
    md.append("Speed-up of ours (WARNING) over each baseline (baseline ms / ours ms):")
    md.append("")
    md.append("| D | weights | indices | vs ADAM | vs ADAM, row-wise bias corr. | vs ROWWISE_ADAGRAD | "
              "vs SGD | vs eager |")
    md.append("|---:|---|---|---:|---:|---:|---:|---:|")
    for row in results:
        o = row["ms"].get("ours")
        cell = lambda k: f"{row['ms'][k] / o:.2f}x" if o and k in row["ms"] else "-"  # noqa: E731
        md.append(f"| {row['D']} | {row['precision']} | {row['dist']} | {cell('fbgemm_adam')} | "
                  f"{cell('fbgemm_adam_rbc')} | {cell('fbgemm_rowwise_adagrad')} | {cell('fbgemm_sgd')} | "
                  f"{cell('eager')} |")
    text = "\n".join(md)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_tbe_cuda.md"), "w") as f:
        f.write(text + "\n\n```\n" + "\n".join(lines_log) + "\n```\n")
    with open(os.path.join(args.out, "bench_tbe_cuda.json"), "w") as f:
        json.dump(dict(copy_bw=bw_copy, host_floor_ms=host_floor, tuning=triton_backend.TUNING,
                       results=results), f, indent=1)


if __name__ == "__main__":
    main()
