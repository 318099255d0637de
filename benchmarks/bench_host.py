"""Host cost of one TBE training step on a GPU: ours (eager and replayed as a CUDA graph) against
FBGEMM's CUDA TBE (ADAM, EXACT_ROWWISE_ADAGRAD, EXACT_SGD), side by side in one process.

At B=64 (T=32 tables of 100,000 x 64 fp32, L=20, Zipf ids) the GPU work of a step is a few
microseconds per kernel, so the wall time per step of steps issued back to back is the host's:
launches, torch ops, Python. Every method runs ``--steps`` steps per round, in turn, for
``--rounds`` rounds (so drifting clocks and background load hit every method alike); the median over
rounds is reported, with the spread. Also: CUDA kernels launched per step and the host operators
of ours that cost the most (torch.profiler, self CPU time).

Usage (GPU machine, see benchmarks/README.md):
    source .gpu/setup.sh && python3 benchmarks/bench_host.py --out DIR
Writes DIR/bench_host.md and DIR/bench_host.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tbe_cuda import LABELS, build_fbgemm, build_ours, make_batches  # noqa: E402

from torchrec_ftrl.fbgemm_enums import BoundsCheckMode, SparseType  # noqa: E402
from torchrec_ftrl.kernels.cuda import host, launch  # noqa: E402
from torchrec_ftrl.kernels.cuda import backend as triton_backend  # noqa: E402

METHODS = ("ours", "ours_split", "ours_fatal", "ours_python_host", "ours_triton_run", "ours_torch_sort",
           "ours_graph", "fbgemm_adam", "fbgemm_rowwise_adagrad", "fbgemm_sgd")
OWN_LABELS = {"ours_split": ("torchrec_ftrl FTRL (Triton), forward and backward two C++ calls under a "
                             "Python autograd node"),
              "ours_graph": "torchrec_ftrl FTRL (Triton), CUDA graph replay",
              "ours_torch_sort": "torchrec_ftrl FTRL (Triton), torch.sort instead of FBGEMM's sort",
              "ours_triton_run": "torchrec_ftrl FTRL (Triton), host path off, every launch through JITFunction.run",
              "ours_python_host": "torchrec_ftrl FTRL (Triton), steps launched from Python (host path off)",
              "ours_fatal": "torchrec_ftrl FTRL (Triton), bounds check FATAL (one host read per forward)"}


def eager_step(module, batches, grad):
    """``step(i)``: forward + backward (+ fused update) of batch ``i % len(batches)``."""
    def step(i):
        idx, off = batches[i % len(batches)]
        module(idx, off).backward(grad)
    return step


def torch_sort_step(module, batches, grad):
    """:func:`eager_step` with the backward's row-key sort by ``torch.sort`` instead of FBGEMM's
    ``get_unique_indices_with_inverse`` (the backend's fallback), to compare their host cost."""
    inner = eager_step(module, batches, grad)

    def step(i):
        triton_backend._fbgemm_sort_devices["cuda"] = False
        try:
            inner(i)
        finally:
            triton_backend._fbgemm_sort_devices.pop("cuda", None)
    return step


def with_flag_step(module, batches, grad, owner, flag: str):
    """:func:`eager_step` with ``owner.flag`` False during each step: ``launch.ENABLED`` (every
    Triton launch through ``JITFunction.run`` instead of the direct launcher,
    :mod:`torchrec_ftrl.kernels.cuda.launch`) or ``host.ENABLED`` (every kernel launched from Python
    instead of the C++ host path, :mod:`torchrec_ftrl.kernels.cuda.host`), to measure what each saves."""
    inner = eager_step(module, batches, grad)

    def step(i):
        setattr(owner, flag, False)
        try:
            inner(i)
        finally:
            setattr(owner, flag, True)
    return step


def graph_step(module, batches, grad):
    """``step(i)``: copy batch ``i`` into the captured inputs, replay the captured training step.
    Captured after one warm-up step on a side stream, as ``torch.cuda.graph`` asks."""
    s_idx, s_off = (t.clone() for t in batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        module(s_idx, s_off).backward(grad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        module(s_idx, s_off).backward(grad)

    def step(i):
        idx, off = batches[i % len(batches)]
        s_idx.copy_(idx)
        s_off.copy_(off)
        graph.replay()
    step.graph = graph       # keep the graph (and its memory pool) alive with the step
    return step


def wall_ms(step, n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        step(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def kernels_per_step(step, n=10):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            step(i)
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages()
               if (getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)) / n


def top_host_ops(step, n=20, rows=15):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(n):
            step(i)
        torch.cuda.synchronize()
    ev = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    return [(e.key, e.count / n, e.self_cpu_time_total / n) for e in ev]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=32)
    ap.add_argument("--E", type=int, default=100_000)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--L", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100, help="steps per method per round")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    batches = make_batches(a.T, a.E, a.B, a.L, "zipf", 3)
    grad = torch.randn(a.B, a.T * a.D, device="cuda")
    steps, modules = {}, {}
    for m in METHODS:
        if m == "ours_graph":
            modules[m] = build_ours(a.T, a.E, a.D, SparseType.FP32)
            steps[m] = graph_step(modules[m], batches, grad)
        elif m in ("ours", "ours_split", "ours_fatal", "ours_torch_sort", "ours_triton_run",
                   "ours_python_host"):
            fatal = dict(bounds_check_mode=BoundsCheckMode.FATAL) if m == "ours_fatal" else {}
            modules[m] = build_ours(a.T, a.E, a.D, SparseType.FP32, **fatal)
            if m in ("ours_triton_run", "ours_python_host", "ours_split"):
                flags = {"ours_triton_run": (launch, "ENABLED"), "ours_python_host": (host, "ENABLED"),
                         "ours_split": (host, "LOOKUP_OP")}[m]
                steps[m] = with_flag_step(modules[m], batches, grad, *flags)
            else:
                make = torch_sort_step if m == "ours_torch_sort" else eager_step
                steps[m] = make(modules[m], batches, grad)
        else:
            modules[m] = build_fbgemm(a.T, a.E, a.D, SparseType.FP32, m)
            steps[m] = eager_step(modules[m], batches, grad)
        wall_ms(steps[m], 20)                            # warm-up (and Triton compiles)
    times = {m: [] for m in METHODS}
    for _ in range(a.rounds):
        for m in METHODS:
            times[m].append(wall_ms(steps[m], a.steps))
    launches = {m: kernels_per_step(steps[m]) for m in METHODS}
    ops = top_host_ops(steps["ours"])
    paths = dict(host.stats())
    labels = {**LABELS, **OWN_LABELS}
    med = {m: statistics.median(v) for m, v in times.items()}
    head = (f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; T={a.T}, E={a.E}, "
            f"D={a.D} fp32, B={a.B}, L={a.L}, Zipf(1.15); {a.rounds} rounds x {a.steps} steps per method")
    lines = ["# Host cost per training step", "", head, "",
             "| method | ms per step (median of rounds) | min | max | ours / row-wise Adagrad | "
             "CUDA kernels per step |", "|---|---:|---:|---:|---:|---:|"]
    for m in METHODS:
        lines.append(f"| {labels[m]} | {med[m]:.3f} | {min(times[m]):.3f} | {max(times[m]):.3f} | "
                     f"{med[m] / med['fbgemm_rowwise_adagrad']:.2f}x | {launches[m]:.0f} |")
    lines += ["", "Host operators of ours (eager) by self CPU time per step (torch.profiler; its own "
              "overhead inflates them):", "", "| operator | calls per step | self CPU us per step |",
              "|---|---:|---:|"]
    lines += [f"| `{k}` | {c:.0f} | {us:.1f} |" for k, c, us in ops]
    lines += ["", f"Steps of ours by path (C++ host path / Python), all methods: {paths}"]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_host.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, "bench_host.json"), "w") as f:
        json.dump(dict(config=vars(a), ms_per_step=times, median_ms=med, kernels_per_step=launches,
                       top_host_ops=ops, host_path_steps=paths, device=torch.cuda.get_device_name(0),
                       torch=torch.__version__), f, indent=1)


if __name__ == "__main__":
    main()
