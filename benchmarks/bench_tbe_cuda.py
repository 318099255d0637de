"""CUDA benchmark of one TBE training step (forward + backward with the fused optimizer update).

Compares ``torchrec_ftrl.FTRLTableBatchedEmbeddingBags`` (Triton backend, fused FTRL; fp32 state and
bf16 state, ``optimizer_state_dtypes``) with FBGEMM's CUDA TBE (``SplitTableBatchedEmbeddingBagsCodegen``,
location DEVICE, compute CUDA) under EXACT_ROWWISE_ADAGRAD, ADAM (also with row-wise bias correction:
plain ADAM fails with fp16 weights in fbgemm_gpu 1.6.0) and EXACT_SGD, and with an eager baseline
(``nn.EmbeddingBag(sparse=True)`` per table + ``torchrec_ftrl.FTRL`` on the sparse gradients), side by
side in one process; ``--methods`` picks a subset.

Shapes: T=32 tables, E=100000 rows, B=8192, L=20 indices per bag (fixed), SUM pooling; D=128, 64,
256 in fp32 and D=128 with fp16 weights; indices uniform or Zipf(1.15) (ranks scattered by a random
permutation of each table's rows). Time: CUDA events around each step, median over ``--iters`` steps
after ``--warmup``, cycling through ``--batches`` batches. Achieved bandwidth uses the bytes-moved model
of ``benchmarks/README.md`` (``bytes_model`` below), against the measured device-to-device copy rate.

``--suite production``: tables of 2M and 10M rows (``production_shapes()``: T=8 x E=2M at
D=64/128/256 fp32 and D=128 fp16, T=2 x E=10M and T=2 x E=2M at D=128 fp32; B=16384, L=20 and 80;
uniform, Zipf(1.05) and Zipf(1.2) ids). Each method's TBE is built alone and freed before the next
(a shape whose estimated peak memory exceeds the free memory is skipped, with the reason logged);
besides step and kernel time it reports the run-length histogram of the batch (the share of unique
rows looked up once, 2-3, 4-31 and >= 32 times) and the kernel time per unique row. Writes
``DIR/bench_tbe_cuda_production.md`` / ``.json``.

``--layouts``: every row layout of ours (``LAYOUT_METHODS``: stored or derived weights x
element-wise or row-wise ``accum`` x fp32 or bf16 state, :class:`torchrec_ftrl.row_layout.RowLayout`)
beside FBGEMM's EXACT_ROWWISE_ADAGRAD, ADAM and EXACT_SGD, on the chosen suite's shapes (``--quick``,
``--shapes``): step time, kernel time (torch.profiler) and, for ours, the update kernels' time, each
beside its physical floor, the compulsory bytes (``bytes_model``: a layout's bytes per row from its
``RowLayout``; a derived-weights forward reads ``z`` and ``n`` instead of the weight) over the copy
bandwidth measured in the run. Writes ``DIR/bench_tbe_cuda_layouts.md`` / ``.json``.

Usage: python benchmarks/bench_tbe_cuda.py [--suite default|production] [--methods M,...] [--out DIR]
       [--tune] [--tune-forward] [--quick] [--layouts]
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
from torchrec_ftrl.kernels import calls
from torchrec_ftrl.kernels.cuda import backend as triton_backend
from torchrec_ftrl.kernels.cuda import host
from torchrec_ftrl.row_layout import ACCUMULATORS, WEIGHTS, RowLayout
from torchrec_ftrl.fbgemm_enums import BoundsCheckMode, ComputeDevice, EmbOptimType, PoolingMode, SparseType
from torchrec_ftrl.state_dtype import parse_state_dtypes, state_bytes_per_element as _state_bytes

FTRL_KW = dict(learning_rate=0.05, ftrl_l1_reg=1e-4, ftrl_l2_reg=1e-4, ftrl_beta=1.0)
LABELS = {
    "ours": "torchrec_ftrl FTRL (Triton)",
    "ours_bf16": "torchrec_ftrl FTRL (Triton), bf16 state",
    "ours_ignore": "torchrec_ftrl FTRL (Triton), bounds check IGNORE",
    "fbgemm_adam": "FBGEMM ADAM",
    "fbgemm_adam_rbc": "FBGEMM ADAM, row-wise bias correction",
    "fbgemm_rowwise_adagrad": "FBGEMM EXACT_ROWWISE_ADAGRAD",
    "fbgemm_sgd": "FBGEMM EXACT_SGD",
    "eager": "eager nn.EmbeddingBag(sparse=True) + FTRL",
}
FB_OPT = {"fbgemm_adam": "ADAM", "fbgemm_adam_rbc": "ADAM",
          "fbgemm_rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "fbgemm_sgd": "EXACT_SGD"}
BF16_STATE = {"accum": SparseType.BF16, "linear": SparseType.BF16}
# Ours: the TBE's optimizer_state_dtypes and bounds_check_mode of each method.
OURS = {"ours": (None, BoundsCheckMode.WARNING), "ours_bf16": (BF16_STATE, BoundsCheckMode.WARNING),
        "ours_ignore": (None, BoundsCheckMode.IGNORE)}
# Optimizer state of each method: (bytes per weight element, bytes per row). Ours from its state
# dtypes (accum + linear: 8 fp32, 4 bf16); the eager baseline's FTRL and ADAM's m + v are fp32; ADAM
# rbc adds a per-row fp32 step counter; row-wise Adagrad keeps one fp32 per row; SGD none.
STATE_BYTES = {**{m: (_state_bytes(parse_state_dtypes(sd)), 0) for m, (sd, _) in OURS.items()},
               "eager": (8, 0), "fbgemm_adam": (8, 0), "fbgemm_adam_rbc": (8, 4),
               "fbgemm_rowwise_adagrad": (0, 4), "fbgemm_sgd": (0, 0)}
DEFAULT_METHODS = ("ours", "ours_bf16", "ours_ignore", "fbgemm_rowwise_adagrad", "fbgemm_adam", "fbgemm_adam_rbc",
                   "fbgemm_sgd", "eager")
HOST_FLOOR_METHODS = ("ours", "ours_bf16", "fbgemm_adam", "fbgemm_sgd")
# --layouts: ours in every row layout, "ours_{weights}_{accumulator}_{fp32|bf16}" (both states in that
# dtype; bounds_check_mode WARNING), and the baselines beside them, EXACT_ROWWISE_ADAGRAD first.
LAYOUT_METHODS = {f"ours_{w}_{a}_{name}": RowLayout(w, a, dt, dt)
                  for w in WEIGHTS for a in ACCUMULATORS
                  for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
LAYOUT_BASELINES = ("fbgemm_rowwise_adagrad", "fbgemm_adam", "fbgemm_sgd")


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


def mean_unique_rows(batches, T, E):
    """Mean over ``batches`` (``make_batches``' form, feature-major over ``T`` tables of ``E`` rows)
    of the unique (table, row) pairs a batch looks up."""
    return statistics.mean(
        float(torch.unique(idx.view(T, -1) + torch.arange(T, device="cuda")[:, None] * E).numel())
        for idx, _ in batches)


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
    weight read again and written, and its optimizer state read and written (``state_bytes_per_row``:
    the method's own state bytes, e.g. ours with bf16 state half of ours with fp32 state)."""
    fwd = N * 8 + U * forward_row_bytes(method, D, wbytes) + T * B * D * 4
    bwd = T * B * D * 4 + 2 * U * row_bytes(method, D, wbytes)   # weight and state read + written
    return fwd, bwd


def row_bytes(method, D, wbytes):
    """Bytes one row of ``method`` stores: its weight (none for derived weights, ``LAYOUT_METHODS``)
    and its optimizer state (``state_bytes_per_row``)."""
    layout = LAYOUT_METHODS.get(method)
    if layout is not None:
        return layout.bytes_per_row(D, wbytes)
    return D * wbytes + state_bytes_per_row(method, D)


def forward_row_bytes(method, D, wbytes):
    """Bytes the forward reads per unique row: the weight, or with derived weights the ``z`` and
    ``n`` it computes the weight from."""
    layout = LAYOUT_METHODS.get(method)
    if layout is not None and layout.weights == "derived":
        return layout.state_bytes_per_row(D)
    return D * wbytes


def update_bytes(method, U, T, B, D, wbytes):
    """Compulsory bytes of the fused update alone (ours' segment_update / segment_combine kernels):
    each of the ``U`` unique rows' stored arrays read and written, and the ``T * B`` fp32 output
    gradients (``D`` each) read once. The update gathers one gradient row per lookup, but lookups of
    one bag share its row, so re-reads past the first can hit L2 and are not compulsory."""
    return 2 * U * row_bytes(method, D, wbytes) + T * B * D * 4


def state_bytes_per_element(method):
    """Optimizer state bytes per weight element of ``method`` (``STATE_BYTES``)."""
    return STATE_BYTES[method][0]


def state_bytes_per_row(method, D):
    """Optimizer state bytes per row of ``method`` at dim ``D`` (``STATE_BYTES``): e.g. FTRL with fp32
    state 8*D, with bf16 state 4*D, row-wise Adagrad 4, SGD 0."""
    if method in LAYOUT_METHODS:
        return LAYOUT_METHODS[method].state_bytes_per_row(D)
    per_element, per_row = STATE_BYTES[method]
    return per_element * D + per_row


def build_ours(T, E, D, precision, method="ours", location=None, **kw):
    """Our TBE for ``method`` (a key of ``OURS``: its state dtypes and bounds check mode; or of
    ``LAYOUT_METHODS``: its row layout, bounds check WARNING): ``T``
    tables of ``E`` x ``D`` on the GPU, or under ``location`` (an ``EmbeddingLocation``, e.g.
    ``MANAGED_CACHING`` with the ``cache_*`` keywords in ``kw``). Other constructor keywords in
    ``kw`` (e.g. ``bounds_check_mode``) override the method's."""
    if method in LAYOUT_METHODS:
        layout = LAYOUT_METHODS[method]
        state_dtypes, bounds = layout.state_dtypes, BoundsCheckMode.WARNING
        if (layout.weights, layout.accumulator) != ("stored", "elementwise"):
            kw = dict(ftrl_weights=layout.weights, ftrl_accumulator=layout.accumulator, **kw)
    else:
        state_dtypes, bounds = OURS[method]
    specs = [(E, D)] * T if location is None else [(E, D, location, ComputeDevice.CUDA)] * T
    kw = {"bounds_check_mode": bounds, "optimizer_state_dtypes": state_dtypes, **kw}
    return FTRLTableBatchedEmbeddingBags(specs, device="cuda", weights_precision=precision,
                                         **FTRL_KW, **kw)


def build_fbgemm(T, E, D, precision, method, location=None, **cache):
    """FBGEMM's CUDA TBE for ``method`` (a key of ``FB_OPT``), in HBM or under ``location`` with the
    ``cache_*`` keywords in ``cache`` (its cache in ``precision`` too). ``fbgemm_adam_rbc``: ADAM with
    ``use_rowwise_bias_correction`` (a per-row fp32 step counter, read and written with each row): in
    fbgemm_gpu 1.6.0 plain ADAM fails with fp16 weights (``row_counter_dev`` expected Float, found
    Half), this variant runs, so it stands in for ADAM on the fp16 rows."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen, UserEnabledConfigDefinition)
    extra = dict(cache, cache_precision=precision) if cache else {}
    if method == "fbgemm_adam_rbc":
        extra["extra_optimizer_config"] = UserEnabledConfigDefinition(use_rowwise_bias_correction=True)
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(E, D, location or EmbeddingLocation.DEVICE, ComputeDevice.CUDA)] * T,
        optimizer=getattr(EmbOptimType, FB_OPT[method]), learning_rate=0.05, eps=1e-8,
        weights_precision=precision, output_dtype=SparseType.FP32,
        pooling_mode=PoolingMode.SUM, device=torch.device("cuda"), **extra)


def build_method(T, E, D, precision, method):
    """The TBE of ``method`` in HBM: ours (``build_ours``) for a key of ``OURS`` or
    ``LAYOUT_METHODS``, else FBGEMM's (``build_fbgemm``)."""
    if method in OURS or method in LAYOUT_METHODS:
        return build_ours(T, E, D, precision, method)
    return build_fbgemm(T, E, D, precision, method)


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
    per bag in flight, eviction policy) per weight row size: forward-only time (``calls.forward_train``:
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
            return calls.forward_train(m._backend, m.table_arrays, batch, torch.float32, m.hyperparams)[0]

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


# --tune-layouts: the launch settings swept per lean row layout (segment_update_kernel's elements per
# step; then the forward's (elements per step, eviction)), one group after the other. The indices per
# bag in flight are the stored table's; the gradient rows in flight are swept with the elements per
# step (TUNING["rows"], shared by the layout's stored twin), except for fp32 element-wise state,
# whose twin is the default layout (tuned by --tune), see triton_backend.TUNING's comment.
LAYOUT_SEG_GRID = ((4096,), (1024,), (2048,), (8192,))
LAYOUT_ROWS_GRID = (4, 2, 1)
LAYOUT_FWD_GRID = ((1024, ""), (512, ""), (2048, ""), (4096, ""), (512, "evict_last"))
TUNE_LAYOUT_METHODS = ("ours_derived_elementwise_fp32", "ours_derived_elementwise_bf16",
                       "ours_derived_rowwise_fp32", "ours_derived_rowwise_bf16")


def _layout_grid(with_rows: bool) -> list:
    """``(group, setting)`` pairs swept for one layout: ``("seg_launch", (tile,))`` or, with rows,
    ``("seg_launch", ((tile,), rows))``, then ``("fwd", (tile, eviction))``."""
    seg = ([(cfg, rows) for rows in LAYOUT_ROWS_GRID for cfg in LAYOUT_SEG_GRID] if with_rows
           else list(LAYOUT_SEG_GRID))
    return [("seg_launch", cfg) for cfg in seg] + [("fwd", cfg) for cfg in LAYOUT_FWD_GRID]


def tune_layouts(args, log) -> dict:
    """Sweep of the lean layouts' own launch entries (``TUNING["layouts"]``, and ``TUNING["rows"]``
    for a row-wise accum) on the production shape T8 x 2M x 128 fp32, B=16384, L=20: step time
    (CUDA events, median), uniform + Zipf(1.05) ids summed. Keeps each layout's fastest entries in
    ``TUNING`` (so a ``--layouts`` run after it in the same process measures them) and returns
    ``{layout key: {"fwd": ..., "seg_launch": ..., "rows": ..., "sweep": [...]}}``."""
    T, E, D, B, L = 8, 2_000_000, 128, 16384, 20
    lists = [production_batches(T, E, B, L, None, 2, seed=0), production_batches(T, E, B, L, 1.05, 2, seed=1)]
    grad = torch.randn(B, T * D, device="cuda")
    tuning = triton_backend.TUNING
    chosen = {}
    wanted = args.tune_methods.split(",") if args.tune_methods else args.method_list
    for m in [m for m in wanted if m in TUNE_LAYOUT_METHODS] or TUNE_LAYOUT_METHODS:
        gc.collect()
        torch.cuda.empty_cache()
        mod = build_ours(T, E, D, SparseType.FP32, m)
        arr = mod.table_arrays
        key = triton_backend.tuning_key(arr.weights is None, arr.rowwise, arr.accum, arr.linear)
        twin = key.split("/", 1)[1]
        with_rows = twin != "elementwise/fp32/fp32"
        step = tbe_step(mod, grad)
        own = tuning["layouts"].setdefault(key, {})
        sweep, best = [], {}

        def step_ms(step=step):
            return sum(time_steps(step, bl, 2, 8) for bl in lists)

        def apply(group, cfg, with_rows=with_rows):
            if group == "seg_launch" and with_rows:
                cfg, tuning["rows"][twin] = cfg
            own[group] = cfg
            host.clear()   # entries edited in place: the C++ host path's plans start afresh

        step_ms()   # compile + first timing after building a module: discarded
        for group, cfg in _layout_grid(with_rows):
            if group == "fwd" and "seg_launch" in best:
                apply("seg_launch", best.pop("seg_launch")[1])
            apply(group, cfg)
            try:
                ms = step_ms()
            except Exception as exc:  # noqa: BLE001 - e.g. out of resources: reported, skipped
                log(f"  {key} {group}={cfg}: FAILED {type(exc).__name__}: {str(exc)[:120]}")
                continue
            best[group] = min(best.get(group, (ms, cfg)), (ms, cfg), key=lambda r: r[0])
            sweep.append(dict(group=group, cfg=list(cfg), ms=ms))
            log(f"  {key} {group}={cfg}: uniform+zipf steps {ms:.3f} ms")
        apply("fwd", best["fwd"][1])
        chosen[key] = dict(fwd=list(own["fwd"]), seg_launch=list(own["seg_launch"]),
                           rows=tuning["rows"].get(twin), sweep=sweep)
        log(f"  chosen {key}: fwd {own['fwd']}, seg_launch {own['seg_launch']}, "
            f"rows {tuning['rows'].get(twin)}")
        del mod, step, arr
    return chosen


def kernel_ms_per_step(step, batches, top=12):
    """``[(kernel name, ms per step)]`` of the ``top`` CUDA kernels (torch.profiler) over one step
    of each of ``batches`` (``step(*batch)``)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for b in batches:
            step(*b)
        torch.cuda.synchronize()
    rows = [(e.key[:80], getattr(e, "device_time_total", 0) / 1e3 / len(batches)) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def profile_step(step, batches, log, method="ours"):
    rows = kernel_ms_per_step(step, [batches[i % len(batches)] for i in range(3)], top=18)
    log(f"kernel times per step of {method} (3 steps):\n"
        + "\n".join(f"  {ms:8.3f} ms  {name}" for name, ms in rows))


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


HOST_FLOOR_LINE = "host time per step with B=64 (GPU work negligible), D=64: "


def measure_host_floor(T, E, L, methods, n_batches):
    """``{method: host ms per step}`` (``host_floor_ms``) of each of ``HOST_FLOOR_METHODS`` among
    ``methods``: ``T`` tables of ``E`` x 64 fp32, ``n_batches`` Zipf batches of B=64 bags of ``L``
    ids."""
    tiny = make_batches(T, E, 64, L, "zipf", n_batches)
    tiny_grad = torch.randn(64, T * 64, device="cuda")
    host_floor = {}
    for m in (m for m in HOST_FLOOR_METHODS if m in methods):
        mod = build_method(T, E, 64, SparseType.FP32, m)
        host_floor[m] = host_floor_ms(tbe_step(mod, tiny_grad), tiny)
        del mod
    return host_floor


def host_floor_text(host_floor):
    """``host_floor`` (``measure_host_floor``) as "LABEL x.xxx ms, ..."."""
    return ", ".join(f"{LABELS[m]} {v:.3f} ms" for m, v in host_floor.items())


# ======================================================================== --suite production

PROD_B = 16384                       # bags per table per step
PROD_METHODS = ("ours", "ours_bf16", "fbgemm_rowwise_adagrad", "fbgemm_adam", "fbgemm_sgd")
RUN_BINS = ((1, 1, "1"), (2, 3, "2-3"), (4, 31, "4-31"), (32, None, ">=32"))
# Per-lookup device scratch of one training step (row keys, sort keys and positions, sorted copies
# of offsets / factors / tables, segment starts, CUB's temporary storage; FBGEMM's backward keeps
# int64 linear indices, their sorted copy and run infos): a generous bound for the estimate.
WORKSPACE_PER_LOOKUP = 128
MEMORY_MARGIN = 2 << 30              # bytes left free beyond the estimate (allocator slack, context)


def production_shapes():
    """The production suite: a list of tables, each ``dict(name, T, E, D, precision, wbytes, B,
    workloads)``; ``workloads`` is a list of ``dict(name, L, dist, zipf_a)`` run against the same
    tables (each method's TBE is built once per table). Axes: D 64/128/256 and fp32/fp16 at T=8 x
    E=2M; E 2M vs 10M at T=2 (same T, so N and U compare directly); L 20 vs 80; uniform, Zipf(1.05)
    and Zipf(1.2) ids."""
    M = 1_000_000

    def table(T, E, D, precision, loads):
        wl = [dict(name=f"L{L}_" + ("uniform" if a is None else f"zipf{a}"), L=L,
                   dist="uniform" if a is None else "zipf", zipf_a=a) for L, a in loads]
        return dict(name=f"T{T}_E{E // M}M_D{D}_{precision.lower()}", T=T, E=E, D=D, precision=precision,
                    wbytes=2 if precision == "FP16" else 4, B=PROD_B, workloads=wl)

    every = [(20, None), (20, 1.05), (20, 1.2), (80, None), (80, 1.05), (80, 1.2)]
    return [
        table(8, 2 * M, 128, "FP32", every),
        table(8, 2 * M, 64, "FP32", [(20, None), (20, 1.2)]),
        table(8, 2 * M, 256, "FP32", [(20, None), (20, 1.2)]),
        table(8, 2 * M, 128, "FP16", [(20, None), (20, 1.2)]),
        table(2, 10 * M, 128, "FP32", [(20, None), (20, 1.05), (80, None)]),
        table(2, 2 * M, 128, "FP32", [(20, None), (20, 1.05), (80, None)]),
    ]


def table_bytes(method, T, E, D, wbytes):
    """Device bytes of the weights and optimizer state of ``T`` tables of ``E`` x ``D``."""
    return T * E * row_bytes(method, D, wbytes)


def workspace_bytes(T, B, L, D):
    """Transient device bytes of one step: per-lookup scratch, and the pooled output, its gradient
    and one more output-sized buffer (fp32)."""
    return T * B * L * WORKSPACE_PER_LOOKUP + 3 * T * B * D * 4


def batches_bytes(T, B, L, n):
    """``n`` batches of int64 indices ``[T*B*L]`` and offsets ``[T*B+1]``."""
    return n * 8 * (T * B * L + T * B + 1)


def memory_estimate(tbl, methods, n_batches):
    """Estimated device bytes of one production table: ``dict(batches, workspace, per_method,
    peak)``. The methods are built one at a time, so the peak is every workload's batches (all are
    kept while the table's methods run) plus the largest method's tables plus one step's workspace
    at the largest L."""
    T, E, D, B, wb = tbl["T"], tbl["E"], tbl["D"], tbl["B"], tbl["wbytes"]
    batches = sum(batches_bytes(T, B, w["L"], n_batches) for w in tbl["workloads"])
    work = max(workspace_bytes(T, B, w["L"], D) for w in tbl["workloads"])
    per = {m: table_bytes(m, T, E, D, wb) for m in methods}
    return dict(batches=batches, workspace=work, per_method=per, peak=batches + work + max(per.values()))


def run_length_histogram(indices, T, E):
    """How often each unique (table, row) of a batch is looked up. ``indices``: the batch's ids,
    feature-major (table ``t`` owns the ``t``-th of ``T`` equal slices), each in ``[0, E)``; any
    device (the counting runs where the tensor is, one host sync at the end). Returns
    ``dict(lookups, unique_rows, max_run, rows_share, lookups_share)``: the shares keyed by run
    length ``"1"``, ``"2-3"``, ``"4-31"``, ``">=32"``, of the unique rows and of the lookups."""
    idx = indices.reshape(T, -1).to(torch.int64)
    keys = idx + torch.arange(T, device=idx.device, dtype=torch.int64)[:, None] * E
    _, counts = torch.unique(keys.reshape(-1), return_counts=True)
    sums = []
    for lo, hi, _ in RUN_BINS:
        sel = counts >= lo if hi is None else (counts >= lo) & (counts <= hi)
        sums += [sel.sum(), torch.where(sel, counts, 0).sum()]
    vals = torch.stack(sums + [counts.max() if counts.numel() else counts.new_zeros(())]).tolist()
    U, N = int(counts.numel()), int(idx.numel())
    return dict(lookups=N, unique_rows=U, max_run=int(vals[-1]),
                rows_share={name: vals[2 * i] / max(U, 1) for i, (_, _, name) in enumerate(RUN_BINS)},
                lookups_share={name: vals[2 * i + 1] / max(N, 1) for i, (_, _, name) in enumerate(RUN_BINS)})


def mean_histogram(hists):
    """The mean of several ``run_length_histogram`` results (one per batch)."""
    n = len(hists)
    return dict(lookups=hists[0]["lookups"], unique_rows=sum(h["unique_rows"] for h in hists) / n,
                max_run=max(h["max_run"] for h in hists),
                rows_share={k: sum(h["rows_share"][k] for h in hists) / n for k in hists[0]["rows_share"]},
                lookups_share={k: sum(h["lookups_share"][k] for h in hists) / n
                               for k in hists[0]["lookups_share"]})


def production_batches(T, E, B, L, zipf_a, n, seed=0):
    """``n`` batches on the GPU (indices int64 [T*B*L], offsets int64 [T*B+1]), made on the device:
    uniform ids (``zipf_a`` None) or Zipf(``zipf_a``) ranks by inverting the float64 CDF
    (``searchsorted``), scattered by a random permutation of each table's rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if zipf_a is not None:
        cdf = torch.cumsum(torch.arange(1, E + 1, dtype=torch.float64, device="cuda") ** -zipf_a, 0)
        cdf /= cdf[-1].clone()
        perms = torch.stack([torch.randperm(E, device="cuda", generator=g) for _ in range(T)])
    off = torch.arange(0, T * B * L + 1, L, dtype=torch.int64, device="cuda")
    out = []
    for _ in range(n):
        if zipf_a is None:
            idx = torch.randint(0, E, (T, B * L), device="cuda", generator=g)
        else:
            u = torch.rand(T * B * L, device="cuda", generator=g, dtype=torch.float64)
            ranks = torch.searchsorted(cdf, u).clamp_(max=E - 1).view(T, B * L)
            idx = torch.gather(perms, 1, ranks)
            del u, ranks
        out.append((idx.reshape(-1).contiguous(), off))
    if zipf_a is not None:
        del cdf, perms
    return out


def bw_share(method, row, ms, bw_copy):
    """(bytes/s, share of the copy BW, share of 4.8 TB/s) of ``method``'s compulsory bytes in ``ms``."""
    fb, bb = bytes_model(method, row["lookups"], row["unique_rows"], row["T"], row["B"], row["D"],
                         row["wbytes"])
    bw = (fb + bb) / (ms * 1e-3)
    return bw, bw / bw_copy, bw / HBM_SPEC


def _gib(x):
    return x / 2 ** 30


def production_markdown(meta, rows):
    """The production suite's report: shapes and run lengths, step times, bandwidth shares, memory."""
    done = [r for r in rows if not r.get("skipped")]
    md = (_production_runs_section(meta, done) + _production_steps_section(done)
          + _production_speedup_section(done) + _production_traffic_section(meta, done)
          + _production_memory_section(meta))
    md += ["", "Host time per step with B=64 (GPU work negligible), D=64: "
           + host_floor_text(meta["host_floor_ms"]) + ".", "",
           "Wall time of the phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in meta["phases_s"].items()) + "."]
    return "\n".join(md)


def _production_runs_section(meta, done):
    """The production report's caption and its run-length table, one line per workload."""
    md = [f"Production-size TBE training steps (fwd + bwd + fused update), {meta['device']}, torch "
          f"{meta['torch']}, fbgemm_gpu {meta['fbgemm_gpu']}; B={PROD_B} bags per table, SUM pooling; "
          f"median of {meta['iters']} steps after {meta['warmup']} warm-up steps, cycling through "
          f"{meta['batches']} batches, CUDA events. Ours: Triton backend, bounds_check_mode WARNING. "
          f"Measured copy bandwidth {meta['copy_bw'] / 1e12:.2f} TB/s.", "",
          "Run lengths: the share of the batch's unique (table, row) pairs looked up once, 2-3, 4-31 "
          "and >= 32 times (torch.unique counts on the device, mean over the batches); \"lookups in "
          ">=32\" is the share of all lookups that fall in such long runs.", "",
          "| table | L | ids | lookups N | unique rows U | U / N | once | 2-3 | 4-31 | >=32 | lookups in >=32 | max run |",
          "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in done:
        rs = r["rows_share"]
        md.append(f"| {r['table']} | {r['L']} | {r['ids']} | {r['lookups']:,} | {r['unique_rows']:,.0f} | "
                  f"{r['unique_rows'] / r['lookups']:.3f} | {100 * rs['1']:.1f}% | {100 * rs['2-3']:.1f}% | "
                  f"{100 * rs['4-31']:.1f}% | {100 * rs['>=32']:.2f}% | "
                  f"{100 * r['lookups_share']['>=32']:.1f}% | {r['max_run']:,} |")
    return md


def _ms_cell(r, m):
    """Step ms of method ``m`` in workload row ``r``: "fails" where it failed, "–" where it did not run."""
    x = r["ms"].get(m)
    if x is None:
        return "fails" if m in r["errors"] else "–"
    return f"{x:.3f}"


def _ms_ratio(r, m, base):
    """``base`` ms / ``m`` ms in workload row ``r`` ("–" unless both ran)."""
    x, b = r["ms"].get(m), r["ms"].get(base)
    return f"{b / x:.2f}x" if x and b else "–"


def _kernel_cells(r, m):
    """``(kernel ms, ns per unique row)`` of method ``m`` in workload row ``r``, "–" where not measured."""
    k = r["device_ms"].get(m)
    return (f"{k:.3f}", f"{k * 1e6 / r['unique_rows']:.2f}") if k else ("–", "–")


def _adam_of(r):
    """``(ADAM method, mark)`` of workload row ``r``: ``fbgemm_adam_rbc`` marked "*" where only it ran
    (plain ADAM fails with fp16 weights), else ``fbgemm_adam`` and ""."""
    if "fbgemm_adam" not in r["ms"] and "fbgemm_adam_rbc" in r["ms"]:
        return "fbgemm_adam_rbc", "*"
    return "fbgemm_adam", ""


def _production_steps_section(done):
    """The production report's step-time table: ours (fp32 and bf16 state, step and kernel time) and
    the baselines, each against EXACT_ROWWISE_ADAGRAD."""
    md = ["", "Step time (ms). \"kernel ms\": ours' device time per step (torch.profiler, 3 steps); "
          "\"ns / U\": that kernel time per unique row; \"bf16\": ours with bf16 accum and linear "
          "(`optimizer_state_dtypes`). \"X vs RW Adagrad\" = EXACT_ROWWISE_ADAGRAD ms / X ms. Where plain "
          "ADAM fails (fp16 weights in fbgemm_gpu 1.6.0) the ADAM columns are ADAM with row-wise bias "
          "correction (marked *).", "",
          "| table | L | ids | ours ms | kernel ms | ns / U | bf16 ms | bf16 kernel ms | bf16 ns / U | "
          "ROWWISE_ADAGRAD ms | FBGEMM ADAM ms | SGD ms | ours vs RW Adagrad | bf16 vs RW Adagrad | "
          "ADAM vs RW Adagrad | SGD vs RW Adagrad |",
          "|---|---:|---|" + "---:|" * 13]
    rwa = "fbgemm_rowwise_adagrad"
    for r in done:
        adam, star = _adam_of(r)
        md.append(f"| {r['table']} | {r['L']} | {r['ids']} | {_ms_cell(r, 'ours')} | "
                  f"{' | '.join(_kernel_cells(r, 'ours'))} | {_ms_cell(r, 'ours_bf16')} | "
                  f"{' | '.join(_kernel_cells(r, 'ours_bf16'))} | {_ms_cell(r, rwa)} | {_ms_cell(r, adam)}{star} | "
                  f"{_ms_cell(r, 'fbgemm_sgd')} | {_ms_ratio(r, 'ours', rwa)} | {_ms_ratio(r, 'ours_bf16', rwa)} | "
                  f"{_ms_ratio(r, adam, rwa)}{star} | {_ms_ratio(r, 'fbgemm_sgd', rwa)} |")
    return md


def _production_speedup_section(done):
    """The production report's speed-up table: ours (fp32 and bf16 state) over ADAM and SGD, and bf16
    state over fp32 state."""
    md = ["", "Speed-up of ours (fp32 state, bf16 state) over the other baselines (X ms / ours ms), and of "
          "bf16 state over fp32 state (ours ms / bf16 ms).", "",
          "| table | L | ids | ours vs ADAM | ours vs SGD | bf16 vs ADAM | bf16 vs SGD | bf16 vs ours |",
          "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in done:
        adam, star = _adam_of(r)
        md.append(f"| {r['table']} | {r['L']} | {r['ids']} | {_ms_ratio(r, 'ours', adam)}{star} | "
                  f"{_ms_ratio(r, 'ours', 'fbgemm_sgd')} | {_ms_ratio(r, 'ours_bf16', adam)}{star} | "
                  f"{_ms_ratio(r, 'ours_bf16', 'fbgemm_sgd')} | {_ms_ratio(r, 'ours_bf16', 'ours')} |")
    return md


def _bw_share_cell(r, m, ms, bw_copy):
    """Method ``m``'s compulsory bytes in ``ms`` as "x% / y%" of the copy bandwidth and of 4.8 TB/s
    ("–" when ``ms`` is None)."""
    if ms is None:
        return "–"
    _, c, h = bw_share(m, r, ms, bw_copy)
    return f"{100 * c:.0f}% / {100 * h:.0f}%"


def _step_gb(r, m):
    """Method ``m``'s compulsory GB per step in workload row ``r`` (``bytes_model``), formatted."""
    return f"{sum(bytes_model(m, r['lookups'], r['unique_rows'], r['T'], r['B'], r['D'], r['wbytes'])) / 1e9:.2f}"


def _production_traffic_section(meta, done):
    """The production report's traffic table: compulsory bytes per step time (and ours per kernel
    time) as shares of the copy bandwidth and of 4.8 TB/s."""
    md = ["", "Compulsory traffic (benchmarks/README.md, `bytes_model()`: each method's own state bytes) per "
          "time, as a share of the measured copy bandwidth and (after the slash) of the H200's 4.8 TB/s; "
          "ours by kernel time and by step time, the baselines by step time.", "",
          "| table | L | ids | GB / step (ours) | ours, kernel | ours, step | GB / step (bf16) | bf16, kernel | "
          "bf16, step | ROWWISE_ADAGRAD | FBGEMM ADAM | SGD |",
          "|---|---:|---|" + "---:|" * 9]
    bw, rwa = meta["copy_bw"], "fbgemm_rowwise_adagrad"
    for r in done:
        adam, _ = _adam_of(r)
        ours = " | ".join(f"{_step_gb(r, m)} | {_bw_share_cell(r, m, r['device_ms'].get(m), bw)} | "
                          f"{_bw_share_cell(r, m, r['ms'].get(m), bw)}" for m in ("ours", "ours_bf16"))
        md.append(f"| {r['table']} | {r['L']} | {r['ids']} | {ours} | {_bw_share_cell(r, rwa, r['ms'].get(rwa), bw)} | "
                  f"{_bw_share_cell(r, adam, r['ms'].get(adam), bw)} | "
                  f"{_bw_share_cell(r, 'fbgemm_sgd', r['ms'].get('fbgemm_sgd'), bw)} |")
    return md


def _production_memory_section(meta):
    """The production report's memory table: per table the estimate, the free memory at its start
    and each method's measured peak."""
    md = ["", "Device memory per table (GiB): the estimate (every workload's batches + the largest "
          "method's weights and state + one step's workspace) and the measured peak allocated while "
          "each method ran (batches included).", ""]
    shown = list(PROD_METHODS) + (["fbgemm_adam_rbc"] if any("fbgemm_adam_rbc" in t.get("peak_gib", {})
                                                            for t in meta["tables"]) else [])
    md += ["| table | estimate | free at start | " + " | ".join(LABELS[m] for m in shown) + " | note |",
           "|---|---:|---:|" + "---:|" * len(shown) + "---|"]
    for t in meta["tables"]:
        peaks = " | ".join(f"{t['peak_gib'][m]:.1f}" if m in t.get("peak_gib", {}) else "–" for m in shown)
        md.append(f"| {t['name']} | {t['estimate_gib']:.1f} | {t['free_gib']:.1f} | {peaks} | "
                  f"{t.get('skipped') or ''} |")
    return md


def select_shapes(shapes, args):
    """``shapes`` (``production_shapes()``' form) cut to the workloads whose ``TABLE/WORKLOAD`` name
    contains one of ``--shapes``' comma-separated strings; with ``--quick`` the first table's first
    workload only."""
    if args.shapes:
        want = [s.strip() for s in args.shapes.split(",") if s.strip()]
        shapes = [dict(t, workloads=[w for w in t["workloads"] if any(x in f"{t['name']}/{w['name']}" for x in want)])
                  for t in shapes]
        shapes = [t for t in shapes if t["workloads"]]
    if args.quick:
        shapes = [dict(shapes[0], workloads=shapes[0]["workloads"][:1])]
    return shapes


def write_report(out_dir, name, text, lines_log, meta, rows):
    """Write ``out_dir/name.md`` (``text``, then the log) and ``name.json`` (``meta`` with the
    ``rows`` as ``results``); returns ``text``."""
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text + "\n\n```\n" + "\n".join(lines_log) + "\n```\n")
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(dict(meta, results=rows), f, indent=1, default=str)
    return text


def make_log():
    """``(log, lines)``: ``log(s)`` prints ``s`` (flushed) and appends it to ``lines``, the log a
    report ends with."""
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)
    return log, lines


class SuiteReport:
    """Log, workload rows and metadata of a ``--suite production`` or ``--layouts`` run, and its
    report ``out_dir/name.md`` / ``.json`` (``render(meta, rows)``, then the log: ``write_report``).
    ``log(s)`` prints ``s`` and keeps it for the report."""

    def __init__(self, out_dir, name, render):
        self.out_dir, self.name, self.render = out_dir, name, render
        self.t_start = time.perf_counter()
        self.log, self.lines = make_log()
        self.rows, self.meta = [], {}

    def write(self):
        """Write the report as it stands (after every table: a run cut short keeps what it
        measured), with the run's wall time so far as ``meta["total_s"]``; returns its markdown."""
        self.meta["total_s"] = time.perf_counter() - self.t_start
        return write_report(self.out_dir, self.name, self.render(self.meta, self.rows), self.lines,
                            self.meta, self.rows)

    def finish(self):
        """Print the report, log the run's total wall time and write the report with that line."""
        print(self.write())
        self.log(f"total {time.perf_counter() - self.t_start:.1f} s")
        self.write()


def table_dims(tbl):
    """``(T, E, D, B, wbytes, precision)`` of a suite table (``production_shapes()``' form), the
    precision as a ``SparseType``."""
    return tbl["T"], tbl["E"], tbl["D"], tbl["B"], tbl["wbytes"], getattr(SparseType, tbl["precision"])


def add_phase(phases, name, t0):
    """Add the seconds since ``t0`` (``time.perf_counter()``) to ``phases[name]``."""
    phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0


def memory_shortfall(method, T, E, D, wbytes, workspace):
    """Frees the cached device memory, then ``(need, reason)``: the bytes of ``method``'s ``T``
    tables of ``E`` x ``D`` plus ``workspace``, and why they cannot be built now (they and
    ``MEMORY_MARGIN`` exceed the free memory), or None when they fit."""
    gc.collect()
    torch.cuda.empty_cache()
    need = table_bytes(method, T, E, D, wbytes) + workspace
    free = torch.cuda.mem_get_info()[0]
    if need + MEMORY_MARGIN <= free:
        return need, None
    return need, (f"skipped: tables + workspace {_gib(need):.1f} GiB + margin exceed the free "
                  f"{_gib(free):.1f} GiB")


def run_production(args) -> None:
    """``--suite production`` (see the module docstring)."""
    import fbgemm_gpu
    fbgemm_version = getattr(fbgemm_gpu, "__version__", "?")
    report = SuiteReport(args.out, "bench_tbe_cuda_production", production_markdown)
    phases = {}
    props = torch.cuda.get_device_properties(0)
    t0 = time.perf_counter()
    bw_copy = copy_bandwidth()
    add_phase(phases, "copy bandwidth", t0)
    report.log(f"device {props.name}, torch {torch.__version__}, fbgemm_gpu {fbgemm_version}, "
               f"copy bandwidth {bw_copy / 1e12:.2f} TB/s; warmup {args.warmup}, iters {args.iters}, "
               f"batches {args.batches}")
    t0 = time.perf_counter()
    host_floor = measure_host_floor(8, 100_000, 20, args.method_list, args.batches)
    add_phase(phases, "host floor", t0)
    report.log(HOST_FLOOR_LINE + host_floor_text(host_floor))
    shapes = select_shapes(production_shapes(), args)
    prod_methods = [m for m in args.method_list if m in PROD_METHODS or m == "fbgemm_adam_rbc"]
    report.meta = dict(device=props.name, torch=torch.__version__, fbgemm_gpu=fbgemm_version, copy_bw=bw_copy,
                       methods=prod_methods, warmup=args.warmup, iters=args.iters, batches=args.batches,
                       B=PROD_B, host_floor_ms=host_floor, tuning=triton_backend.TUNING, tables=[],
                       phases_s=phases)
    os.makedirs(args.out, exist_ok=True)
    for tbl in shapes:
        run_production_table(args, report, tbl)
        report.write()
    report.finish()


def run_production_table(args, report, tbl) -> None:
    """One table of the production suite: skipped (the reason recorded for its workloads) when its
    estimated peak memory (``memory_estimate``) and ``MEMORY_MARGIN`` exceed the free memory; else
    its workloads' batches and run-length histograms (``production_loads``), then each method of
    ``report.meta["methods"]`` built alone and timed on every workload (``run_production_method``)."""
    T, E, D, B, _, _ = table_dims(tbl)
    gc.collect()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    est = memory_estimate(tbl, report.meta["methods"], args.batches)
    tmeta = dict(name=tbl["name"], T=T, E=E, D=D, precision=tbl["precision"],
                 estimate_gib=_gib(est["peak"]), free_gib=_gib(free),
                 estimate_parts_gib=dict(batches=_gib(est["batches"]), workspace=_gib(est["workspace"]),
                                         **{m: _gib(v) for m, v in est["per_method"].items()}),
                 peak_gib={}, phases_s={})
    report.meta["tables"].append(tmeta)
    report.log(f"[{tbl['name']}] T={T} E={E:,} D={D} {tbl['precision']} B={B}; workloads "
               f"{', '.join(w['name'] for w in tbl['workloads'])}; estimated peak {_gib(est['peak']):.1f} GiB "
               f"(largest method's tables {_gib(max(est['per_method'].values())):.1f}, batches "
               f"{_gib(est['batches']):.1f}, workspace {_gib(est['workspace']):.1f}), free {_gib(free):.1f} GiB")
    if est["peak"] + MEMORY_MARGIN > free:
        reason = (f"skipped: estimated peak {_gib(est['peak']):.1f} GiB + {_gib(MEMORY_MARGIN):.0f} GiB "
                  f"margin exceeds the free {_gib(free):.1f} GiB")
        report.log(f"  {reason}")
        tmeta["skipped"] = reason
        report.rows.extend(dict(table=tbl["name"], workload=w["name"], skipped=reason) for w in tbl["workloads"])
        return
    t0 = time.perf_counter()
    loads = production_loads(report, tbl, args.batches)
    torch.cuda.synchronize()
    tmeta["phases_s"]["batches + histograms"] = time.perf_counter() - t0
    add_phase(report.meta["phases_s"], "batches + histograms", t0)
    pending = list(report.meta["methods"])
    while pending:
        run_production_method(args, report, tbl, tmeta, est, loads, pending)


def production_loads(report, tbl, n_batches):
    """``[(workload, batches, row)]`` of one production table: each workload's ``n_batches``
    batches (``production_batches``) and its row (run-length histogram, the timings to fill),
    logged and appended to ``report.rows``."""
    T, E, D, B, wb, _ = table_dims(tbl)
    loads = []
    for i, w in enumerate(tbl["workloads"]):
        batches = production_batches(T, E, B, w["L"], w["zipf_a"], n_batches, seed=i)
        hist = mean_histogram([run_length_histogram(idx, T, E) for idx, _ in batches])
        row = dict(table=tbl["name"], workload=w["name"], T=T, E=E, B=B, L=w["L"], D=D,
                   precision=tbl["precision"], wbytes=wb, dist=w["dist"], zipf_a=w["zipf_a"],
                   ids="uniform" if w["zipf_a"] is None else f"Zipf({w['zipf_a']})",
                   **hist, ms={}, fwd_ms={}, device_ms={}, errors={})
        rs = row["rows_share"]
        report.log(f"  {w['name']}: N={row['lookups']:,} U={row['unique_rows']:,.0f}; runs of unique rows: "
                   f"1 {100 * rs['1']:.1f}%, 2-3 {100 * rs['2-3']:.1f}%, 4-31 {100 * rs['4-31']:.1f}%, "
                   f">=32 {100 * rs['>=32']:.2f}% (max {row['max_run']:,})")
        loads.append((w, batches, row))
        report.rows.append(row)
    return loads


def run_production_method(args, report, tbl, tmeta, est, loads, pending) -> None:
    """The first method of ``pending`` (taken off it) on one production table: skipped when its
    tables and one step's workspace do not fit (``memory_shortfall``), else built, timed on each of
    ``loads`` (``production_loads``) until one fails, and freed. Its build and measure times and peak
    memory go to ``tmeta`` (the table's entry of ``report.meta["tables"]``); a failure to the rows'
    ``errors``."""
    m = pending.pop(0)
    T, E, D, _, wb, prec = table_dims(tbl)
    need, reason = memory_shortfall(m, T, E, D, wb, est["workspace"])
    if reason:
        report.log(f"  {m}: {reason}")
        for _, _, row in loads:
            row["errors"][m] = reason
        return
    torch.cuda.reset_peak_memory_stats()
    mod = None
    try:
        t0 = time.perf_counter()
        mod = build_method(T, E, D, prec, m)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tmeta["phases_s"][f"build {m}"] = dt
        add_phase(report.meta["phases_s"], "build", t0)
        t0 = time.perf_counter()
        for w, batches, row in loads:
            err = time_production_workload(args, report, mod, m, batches, row)
            if err:
                record_production_failure(report, loads, m, w["name"], err, prec, pending)
                break
        torch.cuda.synchronize()
        tmeta["phases_s"][f"measure {m}"] = time.perf_counter() - t0
        add_phase(report.meta["phases_s"], "measure", t0)
        tmeta["peak_gib"][m] = _gib(torch.cuda.max_memory_allocated())
        ran = sum(m in r["ms"] for _, _, r in loads)
        report.log(f"  {m}: built in {dt:.1f} s, {ran} of {len(loads)} workloads measured in "
                   f"{tmeta['phases_s'][f'measure {m}']:.1f} s, peak allocated {tmeta['peak_gib'][m]:.1f} GiB "
                   f"(estimate {_gib(est['batches'] + need):.1f} GiB)")
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory while building
        report.log(f"  {m} FAILED: {type(exc).__name__}: {exc}"[:500])
        traceback.print_exc()
        for _, _, row in loads:
            row["errors"].setdefault(m, f"{type(exc).__name__}: {exc}"[:400])
    del mod
    gc.collect()
    torch.cuda.empty_cache()


def time_production_workload(args, report, mod, m, batches, row):
    """Time method ``m`` (its TBE ``mod``) on one workload: step and forward ms into ``row``, ours
    also its kernel time (``production_kernel_note``); logs the line. Returns the error of a step
    or forward that failed, else None."""
    T, B, D = row["T"], row["B"], row["D"]
    grad = torch.randn(B, T * D, device="cuda")
    step = tbe_step(mod, grad)
    try:
        ms = time_steps(step, batches, args.warmup, args.iters)
        with torch.no_grad():
            fwd_ms = time_steps(lambda i, o: mod(i, o), batches, 1, args.fwd_iters)
    except Exception as exc:  # noqa: BLE001 - a failing baseline is reported
        return f"{type(exc).__name__}: {exc}"[:400]
    row["ms"][m], row["fwd_ms"][m] = ms, fwd_ms
    _, c, h = bw_share(m, row, ms, report.meta["copy_bw"])
    msg = (f"    {row['workload']:16s} {m:24s} step {ms:8.3f} ms  fwd {fwd_ms:7.3f} ms  "
           f"traffic {100 * c:.0f}% of copy BW, {100 * h:.0f}% of 4.8 TB/s")
    if m in OURS:
        msg += production_kernel_note(args, report, m, step, batches, row)
    if max(c, h) > 1.0:
        msg += "  [above 100%: the bytes model or the timing is wrong]"
    report.log(msg)
    return None


def production_kernel_note(args, report, m, step, batches, row):
    """Ours' kernel time per step on one workload (``device_ms``) into ``row["device_ms"]``, and
    with ``--profile`` on T8_E2M_D128_fp32 L20_uniform / L20_zipf1.2 its kernel table logged.
    Returns the text the workload's log line ends with (a profiler failure is reported there, and
    costs the kernel time only)."""
    tp = time.perf_counter()
    msg = ""
    try:
        k = device_ms(step, batches)
        row["device_ms"][m] = k
        _, kc, kh = bw_share(m, row, k, report.meta["copy_bw"])
        msg += (f"; kernel {k:.3f} ms ({k * 1e6 / row['unique_rows']:.2f} ns per "
                f"unique row, {100 * kc:.0f}% of copy BW, {100 * kh:.0f}% of 4.8 TB/s)")
        if max(kc, kh) > 1.0:
            msg += "  [kernel share above 100%: the bytes model or the timing is wrong]"
        if args.profile and row["table"] == "T8_E2M_D128_fp32" and \
                row["workload"] in ("L20_uniform", "L20_zipf1.2"):
            report.log(f"    {row['workload']}, {m}:")
            profile_step(step, batches, report.log, m)
    except Exception as exc:  # noqa: BLE001
        msg += f"; profiler FAILED: {type(exc).__name__}: {exc}"[:300]
    add_phase(report.meta["phases_s"], "profiler", tp)
    return msg


def record_production_failure(report, loads, m, workload, err, prec, pending):
    """Method ``m`` failed on ``workload``: ``err`` recorded for it and the workloads of ``loads``
    not run after it, logged; plain ADAM failing with fp16 weights puts ADAM with row-wise bias
    correction first in ``pending`` (unless it is among the methods anyway)."""
    for _, _, r in loads:   # this workload and the ones not run after it
        if m not in r["ms"]:
            r["errors"][m] = err
    report.log(f"    {workload:16s} {m} FAILED: {err}")
    if m == "fbgemm_adam" and prec == SparseType.FP16 and "fbgemm_adam_rbc" not in report.meta["methods"]:
        pending.insert(0, "fbgemm_adam_rbc")
        report.log("    plain ADAM fails with fp16 weights: ADAM with row-wise bias "
                   "correction stands in for it")


# ======================================================================== --layouts

# Issue 38's targets, D=128 fp32 weights: kernel time of EXACT_ROWWISE_ADAGRAD / ours, (uniform, Zipf).
LAYOUT_TARGETS = {"ours_derived_elementwise_fp32": (1.0, 1.0), "ours_derived_elementwise_bf16": (1.25, 1.1),
                  "ours_derived_rowwise_fp32": (1.25, 1.1), "ours_derived_rowwise_bf16": (1.5, 1.2)}
UPDATE_KERNELS = ("segment_update_kernel", "segment_combine_kernel")


def default_shapes(args):
    """The default suite's tables in ``production_shapes()``' form: T x E (``--T``, ``--E``), B, L
    from the flags; D=128, 64, 256 fp32 and D=128 fp16; uniform and Zipf(1.15) ids."""
    loads = [dict(name=f"L{args.L}_uniform", L=args.L, dist="uniform", zipf_a=None),
             dict(name=f"L{args.L}_zipf1.15", L=args.L, dist="zipf", zipf_a=1.15)]
    return [dict(name=f"T{args.T}_E{args.E}_D{D}_{prec.lower()}", T=args.T, E=args.E, D=D, precision=prec,
                 wbytes=2 if prec == "FP16" else 4, B=args.B, workloads=loads)
            for D, prec in ((128, "FP32"), (64, "FP32"), (256, "FP32"), (128, "FP16"))]


def profile_kernels(step, batches, n=3):
    """``(total ms, {kernel: ms})`` per step: the device time of every CUDA kernel, memcpy and
    memset that torch.profiler records over ``n`` steps (cycling through ``batches``), divided by ``n``."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            step(*batches[i % len(batches)])
        torch.cuda.synchronize()
    per = {e.key: (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) / n / 1e3
           for e in prof.key_averages() if not e.key.startswith("ProfilerStep")}
    return sum(per.values()), per


def layouts_markdown(meta, rows):
    """--layouts' report: per workload, every method with its bytes per row, its compulsory bytes and
    their floor at the copy bandwidth, step and kernel time, the kernel's share of the copy
    bandwidth, the speed against EXACT_ROWWISE_ADAGRAD (kernel and step time) and issue 38's target;
    ours also the update kernels against their own floor."""
    bw = meta["copy_bw"]
    md = [f"Row layouts of ours beside FBGEMM, one TBE training step (fwd + bwd + fused update), "
          f"{meta['device']}, torch {meta['torch']}, fbgemm_gpu {meta['fbgemm_gpu']}, SUM pooling; step: "
          f"median of {meta['iters']} steps after {meta['warmup']} warm-up steps ({meta['batches']} batches, "
          f"CUDA events); kernel: device time per step (torch.profiler, 3 steps). Measured copy bandwidth "
          f"{bw / 1e12:.2f} TB/s. Floor = compulsory bytes (`bytes_model`: indices, each unique row's "
          f"forward read (weight, or z and n for derived weights) and its stored arrays read and written "
          f"in the backward, pooled outputs and their gradients) / copy bandwidth; the update's floor "
          f"(`update_bytes`): the stored arrays read and written and the pooled outputs' fp32 gradients. "
          f"Ours: Triton, bounds_check_mode WARNING; `ours_{{weights}}_{{accumulator}}_{{state dtype}}` "
          f"(both states in that dtype). \"vs RWA\" = EXACT_ROWWISE_ADAGRAD time / the method's time; "
          f"target: issue 38's kernel-time target (D=128 fp32 weights; uniform / Zipf).", "",
          "| table | ids | U | method | B / row | GB / step | floor ms | step ms | kernel ms | kernel / floor | "
          "% of copy BW | vs RWA, kernel | vs RWA, step | target | update ms | update floor ms | "
          "update % of copy BW |",
          "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rwa = r["results"].get("fbgemm_rowwise_adagrad", {})
        for m, res in r["results"].items():
            if "error" in res:
                md.append(f"| {r['table']} | {r['ids']} | {r['unique_rows']:,.0f} | {m} | "
                          f"{res.get('row_bytes', '–')} | " + " | ".join(["–"] * 11) + f" | {res['error'][:80]} |")
                continue
            gbs = res["bytes"] / 1e9
            floor = res["bytes"] / bw * 1e3
            k = res.get("kernel_ms")
            def ratio(key, res=res):
                return f"{rwa[key] / res[key]:.2f}x" if rwa.get(key) and res.get(key) else "–"
            tgt = LAYOUT_TARGETS.get(m)
            tgt = f"{tgt[0 if r['dist'] == 'uniform' else 1]:.2f}x" if tgt else "–"
            upd = res.get("update_ms")
            ufloor = res["update_bytes"] / bw * 1e3 if "update_bytes" in res else None
            md.append(
                f"| {r['table']} | {r['ids']} | {r['unique_rows']:,.0f} | {m} | {res['row_bytes']} | {gbs:.2f} | "
                f"{floor:.3f} | {res['ms']:.3f} | {f'{k:.3f}' if k else '–'} | "
                f"{f'{k / floor:.2f}x' if k else '–'} | "
                f"{f'{100 * floor / k:.0f}%' if k else '–'} | {ratio('kernel_ms')} | {ratio('ms')} | {tgt} | "
                f"{f'{upd:.3f}' if upd else '–'} | {f'{ufloor:.3f}' if ufloor else '–'} | "
                f"{f'{100 * ufloor / upd:.0f}%' if upd and ufloor else '–'} |")
    return "\n".join(md)


def run_layouts(args) -> None:
    """``--layouts`` (see the module docstring): for each table of the suite, each method built
    alone (and freed) and timed on every workload."""
    import fbgemm_gpu
    report = SuiteReport(args.out, "bench_tbe_cuda_layouts", layouts_markdown)
    props = torch.cuda.get_device_properties(0)
    bw_copy = copy_bandwidth()
    report.meta = dict(device=props.name, torch=torch.__version__,
                       fbgemm_gpu=getattr(fbgemm_gpu, "__version__", "?"), copy_bw=bw_copy,
                       methods=args.method_list, warmup=args.warmup, iters=args.iters, batches=args.batches,
                       tuning=triton_backend.TUNING,
                       layouts={m: LAYOUT_METHODS[m].describe() for m in args.method_list if m in LAYOUT_METHODS})
    report.log(f"device {props.name}, torch {torch.__version__}, fbgemm_gpu {report.meta['fbgemm_gpu']}, "
               f"copy bandwidth {bw_copy / 1e12:.2f} TB/s; methods {', '.join(args.method_list)}")
    os.makedirs(args.out, exist_ok=True)
    shapes = select_shapes(production_shapes() if args.suite == "production" else default_shapes(args), args)
    for tbl in shapes:
        loads = layout_loads(args, report, tbl)
        work = max(workspace_bytes(tbl["T"], tbl["B"], w["L"], tbl["D"]) for w in tbl["workloads"])
        for m in args.method_list:
            run_layout_method(args, report, tbl, loads, work, m)
        del loads
        report.write()
    report.finish()


def layout_loads(args, report, tbl):
    """``[(batches, row)]`` of one ``--layouts`` table: each workload's ``--batches`` batches (the
    production suite's ``production_batches``, else ``make_batches``) and its row (unique rows, the
    results to fill), logged and appended to ``report.rows``."""
    T, E, D, B, wb, _ = table_dims(tbl)
    loads = []
    for i, w in enumerate(tbl["workloads"]):
        batches = (production_batches(T, E, B, w["L"], w["zipf_a"], args.batches, seed=i)
                   if args.suite == "production" else
                   make_batches(T, E, B, w["L"], w["dist"], args.batches, zipf_a=w["zipf_a"] or 1.15))
        U = mean_unique_rows(batches, T, E)
        row = dict(table=tbl["name"], workload=w["name"], T=T, E=E, B=B, L=w["L"], D=D,
                   precision=tbl["precision"], wbytes=wb, dist=w["dist"],
                   ids="uniform" if w["zipf_a"] is None else f"Zipf({w['zipf_a']})",
                   lookups=T * B * w["L"], unique_rows=U, results={})
        loads.append((batches, row))
        report.rows.append(row)
        report.log(f"[{tbl['name']} {w['name']}] N={row['lookups']:,} U={U:,.0f}")
    return loads


def run_layout_method(args, report, tbl, loads, workspace, m) -> None:
    """Method ``m`` on one ``--layouts`` table: skipped when its tables and ``workspace`` do not fit
    (``memory_shortfall``), else built, measured on each of ``loads`` (``layout_loads``;
    ``measure_layout_workload``) and freed; a failure is recorded in the rows' results."""
    T, E, D, B, wb, prec = table_dims(tbl)
    _, reason = memory_shortfall(m, T, E, D, wb, workspace)
    if reason:
        for _, row in loads:
            row["results"][m] = dict(row_bytes=row_bytes(m, D, wb), error=reason)
        report.log(f"  {m}: skipped (memory)")
        return
    mod = None
    try:
        mod = build_method(T, E, D, prec, m)
        grad = torch.randn(B, T * D, device="cuda")
        step = tbe_step(mod, grad)
        for batches, row in loads:
            res = measure_layout_workload(args, m, step, batches, row)
            row["results"][m] = res
            report.log(f"  {row['workload']:16s} {m:34s} " + layout_result_text(res, report.meta["copy_bw"]))
            if args.profile and "top_kernels" in res:
                report.log("    top kernels: " + ", ".join(f"{k[:40]} {v:.3f} ms" for k, v in res["top_kernels"]))
        del grad, step
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory while building
        report.log(f"  {m} FAILED: {type(exc).__name__}: {exc}"[:500])
        for _, row in loads:
            row["results"].setdefault(m, dict(row_bytes=row_bytes(m, D, wb),
                                              error=f"{type(exc).__name__}: {exc}"[:400]))
    del mod


def measure_layout_workload(args, m, step, batches, row) -> dict:
    """Method ``m``'s result on one ``--layouts`` workload: bytes per row and compulsory bytes per
    step, step time, kernel time and its top kernels, and for ours the update kernels' time and
    bytes; a failure as ``error``."""
    T, B, D, wb = row["T"], row["B"], row["D"], row["wbytes"]
    N, U = row["lookups"], row["unique_rows"]
    res = dict(row_bytes=row_bytes(m, D, wb), bytes=sum(bytes_model(m, N, U, T, B, D, wb)))
    try:
        res["ms"] = time_steps(step, batches, args.warmup, args.iters)
        res["kernel_ms"], per = profile_kernels(step, batches)
        if m in LAYOUT_METHODS:
            res["update_ms"] = sum(v for k, v in per.items() if k.startswith(UPDATE_KERNELS))
            res["update_bytes"] = update_bytes(m, U, T, B, D, wb)
        res["top_kernels"] = sorted(per.items(), key=lambda kv: -kv[1])[:8]
    except Exception as exc:  # noqa: BLE001 - a failing method is reported
        res["error"] = f"{type(exc).__name__}: {exc}"[:400]
    return res


def layout_result_text(res, bw_copy) -> str:
    """A ``measure_layout_workload`` result as its log line's tail: the failure, or bytes per row,
    floor, step and kernel time (and ours' update time), with their shares of ``bw_copy``."""
    if "error" in res:
        return f"FAILED: {res['error']}"
    floor = res["bytes"] / bw_copy * 1e3
    return (f"{res['row_bytes']:5d} B/row  floor {floor:7.3f} ms  step {res['ms']:7.3f} ms  "
            f"kernel {res['kernel_ms']:7.3f} ms ({100 * floor / res['kernel_ms']:.0f}% of copy BW)"
            + (f"  update {res['update_ms']:.3f} ms "
               f"({100 * res['update_bytes'] / bw_copy * 1e3 / res['update_ms']:.0f}% of copy BW)"
               if res.get("update_ms") else ""))


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=32)
    ap.add_argument("--E", type=int, default=100_000)
    ap.add_argument("--B", type=int, default=8192)
    ap.add_argument("--L", type=int, default=20)
    ap.add_argument("--suite", choices=("default", "production"), default="default",
                    help="default: T=32 tables of 100k rows (--T --E --B --L); production: 2M- and "
                         "10M-row tables (production_shapes()), run-length histograms, one "
                         "method's tables on the device at a time")
    ap.add_argument("--warmup", type=int, default=None, help="default 5 (production: 3)")
    ap.add_argument("--iters", type=int, default=None, help="default 20 (production: 10)")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--fwd-iters", type=int, default=5, help="production: forward-only calls timed")
    ap.add_argument("--shapes", default=None,
                    help="production: only the workloads whose 'TABLE/WORKLOAD' name contains one of "
                         "these comma-separated strings (e.g. T8_E2M_D128_fp32/L20_uniform,E10M)")
    ap.add_argument("--tune", action="store_true", help="sweep the backward launch knobs first")
    ap.add_argument("--tune-forward", action="store_true",
                    help="sweep the forward launch table, log the fastest settings, then exit")
    ap.add_argument("--profile", action="store_true",
                    help="kernel time table of ours, first shape (production: T8_E2M_D128_fp32 "
                         "L20_uniform and L20_zipf1.2)")
    ap.add_argument("--quick", action="store_true", help="first shape only (production: first workload)")
    ap.add_argument("--no-eager", action="store_true", help="skip the (slow) eager baseline")
    ap.add_argument("--methods", default=None,
                    help=f"comma list of methods to time (default all: {','.join(DEFAULT_METHODS)}; production: "
                         f"{','.join(PROD_METHODS)}, and fbgemm_adam_rbc)")
    ap.add_argument("--layouts", action="store_true",
                    help="every row layout of ours (ftrl_weights x ftrl_accumulator x fp32/bf16 state: "
                         f"{','.join(LAYOUT_METHODS)}) beside {','.join(LAYOUT_BASELINES)}, on the suite's "
                         "shapes, each beside its compulsory-traffic floor")
    ap.add_argument("--tune-layouts", action="store_true",
                    help="sweep the lean layouts' launch entries (TUNING['layouts']) on the production "
                         "shape first, write DIR/tune_layouts.json; with --layouts, then measure with them")
    ap.add_argument("--tune-methods", default=None,
                    help=f"--tune-layouts: the layouts swept (comma list of {','.join(TUNE_LAYOUT_METHODS)}; "
                         "default: those among --methods, else all)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    return ap


def suite_methods(args):
    """``(allowed, default)`` methods of the run ``args`` asks for: ``--layouts``, the production
    suite or the default suite."""
    if args.layouts:
        return (tuple(LAYOUT_BASELINES) + ("fbgemm_adam_rbc",) + tuple(LAYOUT_METHODS),
                tuple(LAYOUT_BASELINES) + tuple(LAYOUT_METHODS))
    if args.suite == "production":
        return PROD_METHODS + ("fbgemm_adam_rbc",), PROD_METHODS
    return DEFAULT_METHODS, DEFAULT_METHODS


def parse_args(argv=None):
    """The flags, with ``method_list`` (``--methods``, checked against ``suite_methods``) and the
    suite's ``--warmup`` / ``--iters`` defaults filled in. Exits with a usage error on a method the
    run does not know, or on ``--tune`` / ``--tune-forward`` with the production suite or
    ``--layouts``."""
    ap = build_parser()
    args = ap.parse_args(argv)
    production = args.suite == "production"
    allowed, default = suite_methods(args)
    args.method_list = [m for m in (args.methods or ",".join(default)).split(",") if m]
    bad = [m for m in args.method_list if m not in allowed]
    if bad or not args.method_list:
        ap.error(f"--methods: {bad or args.method_list} not in {', '.join(allowed)} (suite {args.suite})")
    if args.warmup is None:
        args.warmup = 3 if production else 5
    if args.iters is None:
        args.iters = 10 if production else 20
    if (production or args.layouts) and (args.tune or args.tune_forward):
        ap.error("--tune / --tune-forward run with the default suite, without --layouts")
    return args


def run_tune_layouts(args) -> None:
    """``--tune-layouts``: ``tune_layouts``, its choice written to ``DIR/tune_layouts.json`` and
    printed as the ``TUNING["layouts"]`` and ``TUNING["rows"]`` entries."""
    os.makedirs(args.out, exist_ok=True)
    chosen = tune_layouts(args, print)
    with open(os.path.join(args.out, "tune_layouts.json"), "w") as f:
        json.dump(chosen, f, indent=1)
    print("TUNING['layouts'] = " + repr({k: {g: tuple(v[g]) for g in ("fwd", "seg_launch")}
                                          for k, v in chosen.items()}), flush=True)
    print("TUNING['rows'] = " + repr(triton_backend.TUNING["rows"]), flush=True)


def run_default(args) -> None:
    """The default suite (see the module docstring): every method of ``--methods`` on ``--T``
    tables of ``--E`` rows at D=128, 64, 256 fp32 and D=128 fp16, uniform and Zipf ids; writes
    ``DIR/bench_tbe_cuda.md`` / ``.json``. ``--tune`` sweeps the backward launch knobs first;
    ``--tune-forward`` runs its sweep only."""
    T, E, B, L = args.T, args.E, args.B, args.L
    N = T * B * L
    log, lines_log = make_log()
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
    batches_cache = {}
    if args.tune or args.tune_forward:
        for dist in ("uniform", "zipf"):
            batches_cache[dist] = make_batches(T, E, B, L, dist, args.batches)
    if args.tune_forward:
        tune_forward(T, E, B, L, batches_cache, log)
        return
    if args.tune:
        tune(T, E, B, L, batches_cache, log)
    host_floor = measure_host_floor(T, E, L, args.method_list, args.batches)
    log(HOST_FLOOR_LINE + host_floor_text(host_floor))
    results = []
    for D, prec in shapes:
        for dist in ("uniform", "zipf"):
            batches = batches_cache.get(dist) or make_batches(T, E, B, L, dist, args.batches)
            batches_cache[dist] = batches
            results.append(measure_default_row(args, log, D, prec, dist, batches))
    text = default_markdown(args, props.name, bw_copy, host_floor, results)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    write_report(args.out, "bench_tbe_cuda", text, lines_log,
                 dict(copy_bw=bw_copy, host_floor_ms=host_floor, tuning=triton_backend.TUNING,
                      methods=args.method_list), results)


def measure_default_row(args, log, D, prec, dist, batches) -> dict:
    """One shape of the default suite (dim ``D``, weights ``prec``, ids ``dist`` in ``batches``):
    its row, every method's times filled in (``measure_default_method``; the eager baseline at
    D=128 fp32 only, unless ``--no-eager``). A method that fails is logged and left out."""
    T, E, B, L = args.T, args.E, args.B, args.L
    N = T * B * L
    U = mean_unique_rows(batches, T, E)
    wbytes = 2 if prec == SparseType.FP16 else 4
    methods = [m for m in args.method_list if m != "eager" or (
        D == 128 and prec == SparseType.FP32 and not args.no_eager)]
    row = dict(D=D, precision=prec.name, wbytes=wbytes, dist=dist, unique_rows=U, lookups=N,
               ms={}, fwd_ms={}, device_ms={})
    log(f"[D={D} {prec.name} {dist}] N={N} lookups, U={U:.0f} unique rows")
    for m in methods:
        try:
            measure_default_method(args, log, row, m, prec, batches)
        except Exception as exc:  # keep the other methods running
            log(f"  {m} FAILED: {exc!r}")
            traceback.print_exc()
        gc.collect()
        torch.cuda.empty_cache()
    return row


def measure_default_method(args, log, row, m, prec, batches) -> None:
    """Method ``m`` on one default-suite shape (``row``): step time (eager: 3 steps after 1) and
    forward time into ``row``, logged with the bytes model's bandwidth; ours also its kernel time,
    and with ``--profile`` at D=128 fp32 its kernel table."""
    T, E, B = args.T, args.E, args.B
    D, N, U, wbytes = row["D"], row["lookups"], row["unique_rows"], row["wbytes"]
    eager = m == "eager"
    grad = torch.randn(B, T * D, device="cuda")
    if eager:
        mod, step = eager_step(T, E, D, B)
    else:
        mod = build_method(T, E, D, prec, m)
        step = tbe_step(mod, grad)
    ms = time_steps(step, batches, 1 if eager else args.warmup, 3 if eager else args.iters)
    with torch.no_grad():
        fwd_ms = float("nan") if eager else time_steps(lambda i, o: mod(i, o), batches, 2, 10)
    row["ms"][m], row["fwd_ms"][m] = ms, fwd_ms
    fb, bb = bytes_model(m, N, U, T, B, D, wbytes)
    log(f"  {m:24s} step {ms:8.3f} ms  fwd {fwd_ms:7.3f} ms  "
        f"model {(fb + bb) / 1e9:.2f} GB -> {(fb + bb) / (ms * 1e-3) / 1e12:.2f} TB/s")
    if m in ("ours", "ours_bf16"):
        row["device_ms"][m] = device_ms(step, batches)
        log(f"  {m:24s} kernel time {row['device_ms'][m]:.3f} ms per step")
    if args.profile and m in ("ours", "ours_bf16") and D == 128 and prec == SparseType.FP32:
        profile_step(step, batches, log, m)


def default_markdown(args, device, bw_copy, host_floor, results) -> str:
    """The default suite's report: every method's step time and bandwidth, ours' kernel time, and
    ours' speed-up over each baseline."""
    return "\n".join(_default_steps_section(args, device, bw_copy, results)
                     + _default_kernel_section(args, bw_copy, host_floor, results)
                     + _default_speedup_section(results))


def _default_steps_section(args, device, bw_copy, results):
    """The default report's caption and its table of every method's step time and bandwidth."""
    T, E, B, L = args.T, args.E, args.B, args.L
    md = [f"One training step (fwd + bwd + fused optimizer update), {device}, torch {torch.__version__}; "
          f"T={T}, E={E}, B={B}, L={L}, SUM pooling; median of {args.iters} steps (eager: 3) by CUDA "
          f"events. Measured copy bandwidth {bw_copy / 1e12:.2f} TB/s. BW = compulsory bytes "
          f"(benchmarks/README.md) / step time. Ours uses bounds_check_mode=WARNING (FBGEMM's default) "
          f"unless marked IGNORE.", "",
          "| D | weights | indices | unique rows | method | ms / step | fwd ms | vs ROWWISE_ADAGRAD | vs FBGEMM ADAM | "
          "BW TB/s | % of copy BW | % of 4.8 TB/s |",
          "|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in results:
        adam, rwa = row["ms"].get("fbgemm_adam"), row["ms"].get("fbgemm_rowwise_adagrad")
        for m, ms in row["ms"].items():
            fb, bb = bytes_model(m, T * B * L, row["unique_rows"], T, B, row["D"], row["wbytes"])
            bw = (fb + bb) / (ms * 1e-3)
            md.append(f"| {row['D']} | {row['precision']} | {row['dist']} | {row['unique_rows']:.0f} | "
                      f"{LABELS[m]} | {ms:.3f} | {row['fwd_ms'][m]:.3f} | "
                      f"{f'{rwa / ms:.2f}x' if rwa else '–'} | {f'{adam / ms:.2f}x' if adam else '–'} | "
                      f"{bw / 1e12:.2f} | "
                      f"{100 * bw / bw_copy:.0f}% | {100 * bw / HBM_SPEC:.0f}% |")
    return md


def _default_kernel_section(args, bw_copy, host_floor, results):
    """The default report's table of ours' step time against its kernel time, after the host time
    per step."""
    T, B, L = args.T, args.B, args.L
    md = ["", "Ours (WARNING; fp32 and bf16 state): step time against kernel time (device time summed by "
          "torch.profiler; a step above it waits on the host). Host time per step with B=64, where the GPU work "
          "is negligible: " + host_floor_text(host_floor) + ".", "",
          "| D | weights | indices | method | ms / step | kernel ms / step | BW by kernel time | % of copy BW | "
          "% of 4.8 TB/s |",
          "|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for row in results:
        for m in ("ours", "ours_bf16"):
            if m in row["device_ms"]:
                fb, bb = bytes_model(m, T * B * L, row["unique_rows"], T, B, row["D"], row["wbytes"])
                kbw = (fb + bb) / (row["device_ms"][m] * 1e-3)
                md.append(f"| {row['D']} | {row['precision']} | {row['dist']} | {LABELS[m]} | {row['ms'][m]:.3f} | "
                          f"{row['device_ms'][m]:.3f} | {kbw / 1e12:.2f} TB/s | "
                          f"{100 * kbw / bw_copy:.0f}% | {100 * kbw / HBM_SPEC:.0f}% |")
    return md


def _default_speedup_section(results):
    """The default report's table of ours' speed-up (fp32 and bf16 state) over each baseline."""
    md = ["", "Speed-up of ours (WARNING; fp32 and bf16 state) over each baseline (baseline ms / ours ms); "
          "\"bf16 vs fp32 state\": ours ms / ours bf16 ms:", "",
          "| D | weights | indices | method | vs ROWWISE_ADAGRAD | vs ADAM | vs ADAM, row-wise bias corr. | "
          "vs SGD | vs eager | bf16 vs fp32 state |",
          "|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in results:
        for m in ("ours", "ours_bf16"):
            o = row["ms"].get(m)
            if o is None:
                continue
            cells = [_speedup_cell(row, o, k) for k in SPEEDUP_BASELINES]
            cells.append(_speedup_cell(row, o, "ours") if m == "ours_bf16" else "-")
            md.append(f"| {row['D']} | {row['precision']} | {row['dist']} | {LABELS[m]} | "
                      + " | ".join(cells) + " |")
    return md


SPEEDUP_BASELINES = ("fbgemm_rowwise_adagrad", "fbgemm_adam", "fbgemm_adam_rbc", "fbgemm_sgd", "eager")


def _speedup_cell(row, ours_ms, k):
    """Method ``k``'s ms / ``ours_ms`` in default-suite row ``row`` ("-" where ``k`` did not run)."""
    return f"{row['ms'][k] / ours_ms:.2f}x" if ours_ms and k in row["ms"] else "-"


def main() -> None:
    args = parse_args()
    if args.tune_layouts:
        run_tune_layouts(args)
    if args.layouts:
        run_layouts(args)
        return
    if args.tune_layouts:
        return
    if args.suite == "production":
        run_production(args)
        return
    run_default(args)


if __name__ == "__main__":
    main()
