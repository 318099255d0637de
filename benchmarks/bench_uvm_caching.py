"""CUDA benchmark of FTRL tables behind an HBM cache (``fused_uvm_caching``) in steady state.

What is measured: one TBE training step (forward + backward with the fused optimizer update) of
tables in unified memory behind an LRU HBM cache (``EmbeddingLocation.MANAGED_CACHING``), once the
cache is warm. Methods, side by side in one process: ours (``FTRLTableBatchedEmbeddingBags``) with
fp32 state (``ours``) and bf16 state (``ours_bf16``), FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``
under EXACT_ROWWISE_ADAGRAD and ADAM, all at cache load factors 0.05, 0.2 and 1.0, and ours with the
tables all in HBM (``ours_hbm``, ``DEVICE``) as the reference. Default shape: T=2 tables of
E=10M rows x D=128, fp32, B=16384, L=20 indices per bag, SUM pooling; ids uniform or Zipf(1.1)
(ranks scattered by a random permutation of each table's rows).

How:

* Batches: a fresh batch every step, drawn on the GPU just before the step and outside its timed
  region from one seeded stream per id distribution (every method gets the same batches, so the
  same FBGEMM LRU makes the same cache decisions and the hit rates agree across methods).
* Warm-up to steady state: train on fresh batches, reading FBGEMM's cache statistics
  (``get_uvm_cache_stats``: unique indices, unique misses, misses left uncached) and the occupied
  slots (``lxu_cache_state != -1``) after every step. Per step, ``inserted = unique misses - misses
  left uncached`` rows enter the cache, ``filled`` (the growth of the occupied slots) of them into
  empty slots, and ``evicted = inserted - filled`` displace a cached row (written back). A step is
  steady when it evicted rows and the cache grew by at most ``--fill-tol`` (1%) of the rows it
  inserted; the warm-up ends after ``--window`` (5) steady steps in a row, or at ``--max-warmup``
  steps, and the row says whether steady state was reached. A full cache (every slot holds a row)
  cannot grow; at load factor 1.0 a set-associative cache never fills (rows hash unevenly to sets
  of 32: sets with fewer distinct rows than ways keep empty slots), so there "no longer filling"
  stands in for "full"; Zipf ids at load factor 1.0 keep bringing first-seen rows into empty slots
  for far longer than a run can wait (reported as not reached).
* Time: CUDA events around each of ``--iters`` steps after the warm-up, median (and mean). The
  cache counts of the timed steps come from the statistics before and after them.
* Traffic model per step (``traffic_bytes``), from the counts of the timed steps: an inserted row
  moves in the weight plus, for ours, its cached state (``row_bytes``: D x (4 + 8) B fp32 state,
  D x (4 + 4) B bf16 state, FBGEMM D x 4 B: its cache holds weights only); an evicted row moves
  the same out (FBGEMM writes back the weight of every evicted row, ours the weight and states). A
  miss left uncached is read in place (forward: weight; update: weight and cached state) and
  written in place. FBGEMM keeps its optimizer state in unified memory, read and written for every
  unique row each step (ADAM: m and v, 2 x D x 4 B; row-wise Adagrad: 4 B, counted as one 32 B
  sector). In and out are compared with the pinned host-to-device and device-to-host copy rates
  measured at the start of the same run (PCIe is full duplex): the share of the rate the modelled
  bytes need in the measured step time, and the floor time (bytes / rate). A share above 100%
  means the model counts bytes that did not cross the link; such a row is flagged.
* ``--profile``: the kernel-time breakdown of a few steady steps of every cached method (Zipf,
  load factor 0.2, or the first one given).
* ``--methods`` also takes ours in the lean row layouts (``LEAN_METHODS``: derived weights,
  element-wise or row-wise ``accum``, fp32 or bf16 state): an inserted or evicted row moves the
  layout's stored arrays, and the forward reads ``z`` and ``n`` of an uncached miss.

Writes ``DIR/uvm_caching.json`` and ``DIR/uvm_caching.md`` after every row (a run cut short keeps
what it measured); ``--time-budget`` stops starting new measurements after that many seconds.

Usage: python benchmarks/bench_uvm_caching.py [--out DIR] [--quick] [--methods M,...]
       [--load-factors 0.05,0.2,1.0] [--dists zipf,uniform] [--max-warmup N] [--iters N] [--profile]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch

from torchrec_ftrl.fbgemm_enums import CacheAlgorithm, EmbeddingLocation, SparseType
from torchrec_ftrl.state_dtype import parse_state_dtypes, state_bytes_per_element

METHODS = ("ours", "ours_bf16", "fbgemm_rowwise_adagrad", "fbgemm_adam", "ours_hbm")
CACHED_METHODS = METHODS[:4]
# Ours in the lean row layouts (bench_tbe_cuda.LAYOUT_METHODS' names), cached; only with --methods.
LEAN_METHODS = ("ours_derived_elementwise_fp32", "ours_derived_elementwise_bf16", "ours_derived_rowwise_fp32",
                "ours_derived_rowwise_bf16")
LABELS = {"ours": "torchrec_ftrl FTRL", "ours_bf16": "torchrec_ftrl FTRL, bf16 state",
          "fbgemm_rowwise_adagrad": "FBGEMM EXACT_ROWWISE_ADAGRAD", "fbgemm_adam": "FBGEMM ADAM",
          "ours_hbm": "torchrec_ftrl FTRL, all in HBM (DEVICE)",
          **{m: "torchrec_ftrl FTRL, " + m[len("ours_"):].replace("_", " ") for m in LEAN_METHODS}}
DISTS = ("zipf", "uniform")
LOAD_FACTORS = (0.05, 0.2, 1.0)
# Ours: the TBE's optimizer_state_dtypes of each method.
OURS_STATE_DTYPES = {"ours": None, "ours_bf16": {"accum": SparseType.BF16, "linear": SparseType.BF16},
                     "ours_hbm": None}
# Cached state bytes per weight element that an inserted or evicted row moves with its weight: ours'
# accum + linear in their dtypes (8 fp32, 4 bf16; the state cache rows beside the weight's);
# FBGEMM caches only the weight.
CACHED_STATE_BYTES = {**{m: state_bytes_per_element(parse_state_dtypes(OURS_STATE_DTYPES[m]))
                         for m in ("ours", "ours_bf16")},
                      "fbgemm_adam": 0, "fbgemm_rowwise_adagrad": 0}
# Optimizer state left in unified memory, read and written for every unique row of a step:
# (bytes per weight element, bytes per row). FBGEMM places its states in unified memory under
# MANAGED_CACHING (only the weights are cached): ADAM's m and v in fp32, row-wise Adagrad's one fp32
# per row. Ours caches both states with the weight.
UVM_STATE_BYTES = {"ours": (0, 0), "ours_bf16": (0, 0), "fbgemm_adam": (8, 0), "fbgemm_rowwise_adagrad": (0, 4)}
DEVICE = "cuda"      # where the batches are drawn (the tests draw them on the CPU)
SECTOR = 32          # bytes: the smallest GPU memory transaction; a 4 B access moves one sector
STATS = ("num_calls", "num_requested_indices", "num_unique_indices", "num_unique_misses",
         "num_conflict_unique_misses", "num_conflict_misses")   # FBGEMM's order (uvm_cache_stats)


# ------------------------------------------------------------------------------ pure logic (CPU)

def row_bytes(method, D, weight_bytes=4):
    """Bytes an inserted (or evicted) row moves: the weight and the cached optimizer state
    (D=128 fp32 weights: ours 1,536 B with fp32 state, 1,024 B with bf16 state; FBGEMM 512 B); a
    lean layout's stored arrays (``RowLayout.bytes_per_row``: derived weights, no weight)."""
    if method in LEAN_METHODS:
        return _layout(method).bytes_per_row(D, weight_bytes)
    return D * (weight_bytes + CACHED_STATE_BYTES[method])


def forward_row_bytes(method, D, weight_bytes=4):
    """Bytes the forward reads of a row: its weight, or with derived weights its ``z`` and ``n``."""
    return _layout(method).state_bytes_per_row(D) if method in LEAN_METHODS else D * weight_bytes


def _layout(method):
    from bench_tbe_cuda import LAYOUT_METHODS
    return LAYOUT_METHODS[method]


def uvm_state_bytes(method, D):
    """Bytes of ``method``'s optimizer state per row that stay in unified memory (read and written
    for every unique row of a step), rounded up to whole :data:`SECTOR` s: ADAM 2 x D x 4, row-wise
    Adagrad 4 -> 32, ours 0."""
    per_element, per_row = UVM_STATE_BYTES.get(method, (0, 0))     # lean layouts: all cached
    b = per_element * D + per_row
    return -(-b // SECTOR) * SECTOR


def step_counts(prev, cur):
    """Cache counts between two snapshots (``STATS`` then the occupied slots, 7 ints each).

    ``unique``: unique rows looked up; ``misses``: of them not cached before the step; ``uncached``:
    misses the populate could not insert (their set's slots all taken by this step's rows);
    ``inserted`` = misses - uncached; ``filled``: growth of the occupied slots (inserts into empty
    slots); ``evicted`` = inserted - filled (inserts that displaced a cached row); ``lookups``:
    indices; ``calls``: populates."""
    d = [int(c) - int(p) for p, c in zip(prev, cur)]
    inserted = d[3] - d[4]
    return dict(calls=d[0], lookups=d[1], unique=d[2], misses=d[3], uncached=d[4],
                inserted=inserted, filled=d[6], evicted=inserted - d[6])


def is_steady_step(counts, fill_tol=0.01):
    """A steady step evicted rows and grew the cache by at most ``fill_tol`` of the rows it inserted
    (a full cache does not grow)."""
    return counts["evicted"] > 0 and counts["filled"] <= fill_tol * counts["inserted"]


class SteadyState:
    """Counts steady steps in a row (:func:`is_steady_step`); ``reached`` after ``window`` of them."""

    def __init__(self, window=5, fill_tol=0.01):
        self.window, self.fill_tol = int(window), float(fill_tol)
        self.streak = 0
        self.steps = 0

    def update(self, counts):
        self.steps += 1
        self.streak = self.streak + 1 if is_steady_step(counts, self.fill_tol) else 0
        return self.reached

    @property
    def reached(self):
        return self.streak >= self.window


def traffic_bytes(method, D, c, weight_bytes=4):
    """Modelled bytes over the host link per step from per-step counts ``c`` (``step_counts`` keys,
    floats allowed): ``(in, out, parts)``.

    In: each inserted row (weight + cached state, :func:`row_bytes`); each uncached miss read in
    place by the forward (weight) and the update (weight + cached state); the unified-memory state
    of every unique row (:func:`uvm_state_bytes`). Out: each evicted row written back (FBGEMM: the
    weight; ours: weight and state), each uncached miss's update written in place, the
    unified-memory state of every unique row written."""
    rb = row_bytes(method, D, weight_bytes)
    us = uvm_state_bytes(method, D)
    parts = dict(insert_in=c["inserted"] * rb,
                 uncached_in=c["uncached"] * (forward_row_bytes(method, D, weight_bytes) + rb),
                 state_in=c["unique"] * us, evict_out=c["evicted"] * rb, uncached_out=c["uncached"] * rb,
                 state_out=c["unique"] * us)
    return (parts["insert_in"] + parts["uncached_in"] + parts["state_in"],
            parts["evict_out"] + parts["uncached_out"] + parts["state_out"], parts)


def traffic_report(method, D, c, ms, h2d, d2h, weight_bytes=4):
    """The traffic model of one measured row: bytes in / out per step, their floor times at the
    measured copy rates (bytes/s), the share of those rates they need in ``ms`` per step, and
    ``model_over_100`` where a share exceeds 1 (the model counts bytes that did not move)."""
    b_in, b_out, parts = traffic_bytes(method, D, c, weight_bytes)
    floor_in, floor_out = 1e3 * b_in / h2d, 1e3 * b_out / d2h
    share_in, share_out = floor_in / ms, floor_out / ms
    return dict(in_bytes_per_step=b_in, out_bytes_per_step=b_out, bytes_parts=parts,
                floor_in_ms=floor_in, floor_out_ms=floor_out, floor_ms=max(floor_in, floor_out),
                share_of_h2d=share_in, share_of_d2h=share_out, model_over_100=max(share_in, share_out) > 1.0)


def per_step(counts, steps):
    return {k: v / steps for k, v in counts.items()}


def _num(x, digits=0):
    return "" if x is None else f"{x:,.{digits}f}"


def markdown(meta, rows):
    """The report: one table per id distribution, a row per (load factor, method)."""
    sh = meta["shape"]
    out = [f"# bench_uvm_caching: {meta.get('device', '?')}", "",
           f"T={sh['T']} tables x E={sh['E']:,} rows x D={sh['D']}, fp32, B={sh['B']:,}, L={sh['L']}, SUM, LRU; "
           f"torch {meta.get('torch', '?')}, fbgemm_gpu {meta.get('fbgemm_gpu', '?')}. Pinned copies measured in "
           f"this run: {meta['h2d_GBps']:.1f} GB/s host to device, {meta['d2h_GBps']:.1f} GB/s device to host "
           f"(both at once: {meta.get('duplex_h2d_GBps', float('nan')):.1f} / "
           f"{meta.get('duplex_d2h_GBps', float('nan')):.1f}).", "",
           f"Steady state: {meta['window']} steps in a row that evicted rows and grew the cache by at most "
           f"{100 * meta['fill_tol']:g}% of the rows they inserted, within {meta['max_warmup']} warm-up steps; "
           f"then {meta['iters']} timed steps (median ms). Traffic per step from the timed steps' counts "
           "(module docstring): MB in / out, the floor time at the measured rate, and the share of the "
           "rate the bytes need in the step time.", ""]
    for dist in meta["dists"]:
        rs = [r for r in rows if r.get("dist") == dist]
        if not rs:
            continue
        out += [f"## {dist} ids", "",
                "| load factor | method | steady (warm-up steps) | occupied | ms/step | hit rate | unique misses/step "
                "| evictions/step | in MB/step | in floor ms | % of H2D | out MB/step | out floor ms | % of D2H |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rs:
            lf = "HBM" if r.get("load_factor") is None else f"{r['load_factor']:g}"
            if "error" in r or "skipped" in r:
                out.append(f"| {lf} | {r['method']} | {r.get('error') or r.get('skipped')} |" + " |" * 11)
                continue
            if r.get("load_factor") is None:
                out.append(f"| {lf} | {r['method']} | | | {r['ms']:.2f} |" + " |" * 9)
                continue
            steady = ("yes" if r["steady"] else "NO") + f" ({r['warmup_steps']})"
            flag = " (model > 100%)" if r["model_over_100"] else ""
            out.append(
                f"| {lf} | {r['method']} | {steady} | {100 * r['occupancy']:.1f}% | {r['ms']:.2f} | "
                f"{_num(r['hit_rate'], 3)} | {_num(r['misses_per_step'])} | {_num(r['evictions_per_step'])} | "
                f"{r['in_bytes_per_step'] / 1e6:,.1f} | {r['floor_in_ms']:.2f} | "
                f"{100 * r['share_of_h2d']:.0f}%{flag} | "
                f"{r['out_bytes_per_step'] / 1e6:,.1f} | {r['floor_out_ms']:.2f} | "
                f"{100 * r['share_of_d2h']:.0f}%{flag} |")
        out.append("")
    return "\n".join(out)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".", help="folder for uvm_caching.json / .md (default: .)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny smoke run: E=200,000, B=2,048, --max-warmup 60, --iters 10")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    ap.add_argument("--load-factors", default=",".join(f"{x:g}" for x in LOAD_FACTORS),
                    help="comma list of cache load factors in (0, 1] (default 0.05,0.2,1)")
    ap.add_argument("--dists", default=",".join(DISTS), help="comma list of zipf, uniform")
    ap.add_argument("--max-warmup", type=int, default=None, help="warm-up step cap (default 400; --quick 60)")
    ap.add_argument("--window", type=int, default=5, help="steady steps in a row that end the warm-up")
    ap.add_argument("--fill-tol", type=float, default=0.01,
                    help="a steady step grows the cache by at most this share of the rows it inserts")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (default 100; --quick 10)")
    ap.add_argument("--hbm-warmup", type=int, default=10, help="warm-up steps of the all-in-HBM reference")
    ap.add_argument("--T", type=int, default=2)
    ap.add_argument("--E", type=int, default=None, help="rows per table (default 10,000,000)")
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--B", type=int, default=None, help="batch (default 16,384)")
    ap.add_argument("--L", type=int, default=20)
    ap.add_argument("--zipf-a", type=float, default=1.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds after which no new measurement starts (0: none)")
    ap.add_argument("--profile", action="store_true",
                    help="kernel-time breakdown of steady steps of ours and ours_bf16 (Zipf, load factor 0.2)")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS + LEAN_METHODS]
    if bad or not methods:
        ap.error(f"--methods: {bad or methods} not in {', '.join(METHODS + LEAN_METHODS)}")
    args.methods = [m for m in METHODS + LEAN_METHODS if m in methods]
    try:
        args.load_factors = [float(x) for x in args.load_factors.split(",") if x]
    except ValueError:
        ap.error(f"--load-factors: not a comma list of numbers: {args.load_factors!r}")
    if not args.load_factors or any(not 0 < x <= 1 for x in args.load_factors):
        ap.error(f"--load-factors: each in (0, 1], got {args.load_factors}")
    dists = [d for d in args.dists.split(",") if d]
    if not dists or any(d not in DISTS for d in dists):
        ap.error(f"--dists: {dists} not in {', '.join(DISTS)}")
    args.dists = dists
    q = args.quick
    args.E = args.E or (200_000 if q else 10_000_000)
    args.B = args.B or (2048 if q else 16384)
    args.max_warmup = args.max_warmup if args.max_warmup is not None else (60 if q else 400)
    args.iters = args.iters or (10 if q else 100)
    if args.window < 1 or args.max_warmup < 1 or args.iters < 1:
        ap.error("--window, --max-warmup and --iters must be >= 1")
    return args


# ------------------------------------------------------------------------------------- GPU parts

class BatchStream:
    """Fresh batches (indices int64 ``[T*B*L]``, offsets int64 ``[T*B+1]``) drawn on ``device`` per
    call; :meth:`restart` replays the same sequence (every method gets the same batches). Zipf: rank
    ``r`` with probability ~ ``r^-a`` (inverse CDF), scattered by a fixed permutation per table."""

    def __init__(self, T, E, B, L, dist, zipf_a=1.1, seed=0, device="cuda"):
        self.T, self.E, self.B, self.L, self.dist, self.device = T, E, B, L, dist, torch.device(device)
        self.seed = seed
        g = torch.Generator(device=self.device).manual_seed(seed)
        if dist == "zipf":
            cdf = torch.cumsum(torch.arange(1, E + 1, dtype=torch.float64, device=self.device) ** -zipf_a, 0)
            self.cdf = cdf / cdf[-1]
            self.perms = torch.stack([torch.randperm(E, device=self.device, generator=g) for _ in range(T)])
        self.offsets = torch.arange(0, T * B * L + 1, L, dtype=torch.int64, device=self.device)
        self.restart()

    def restart(self):
        self.gen = torch.Generator(device=self.device).manual_seed(self.seed + 1)

    def next(self):
        T, E, n = self.T, self.E, self.B * self.L
        if self.dist == "uniform":
            idx = torch.randint(0, E, (T, n), device=self.device, generator=self.gen)
        else:
            u = torch.rand(T * n, device=self.device, generator=self.gen, dtype=torch.float64)
            ranks = torch.searchsorted(self.cdf, u).clamp_(max=E - 1).view(T, n)
            idx = torch.gather(self.perms, 1, ranks)
        return idx.reshape(-1), self.offsets


def _event():
    return torch.cuda.Event(enable_timing=True)


def _sync():
    torch.cuda.synchronize()


def pcie_rates(nbytes=1 << 30, reps=10):
    """Pinned copy rates, bytes/s: host to device and device to host alone, and each direction while
    both run at once (two streams)."""
    from bench_tbe_cuda import time_steps
    n = nbytes // 4
    host_a = torch.empty(n, dtype=torch.float32, pin_memory=True).uniform_()
    host_b = torch.empty(n, dtype=torch.float32, pin_memory=True)
    dev_a = torch.empty(n, dtype=torch.float32, device="cuda")
    dev_b = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()

    def timed(fn):
        return nbytes / (time_steps(lambda *_: fn(), [(None, None)], 1, reps) * 1e-3)

    h2d = timed(lambda: dev_a.copy_(host_a, non_blocking=True))
    d2h = timed(lambda: host_b.copy_(dev_b, non_blocking=True))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    both = []
    for _ in range(reps + 1):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        ends = []
        for s, (dst, src) in ((s1, (dev_a, host_a)), (s2, (host_b, dev_b))):
            s.wait_event(start)
            with torch.cuda.stream(s):
                dst.copy_(src, non_blocking=True)
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                ends.append(e)
        torch.cuda.synchronize()
        both.append([start.elapsed_time(e) for e in ends])
    both = both[1:]
    duplex = [nbytes / (statistics.median(x[i] for x in both) * 1e-3) for i in range(2)]
    del host_a, host_b, dev_a, dev_b
    torch.cuda.empty_cache()
    return dict(h2d=h2d, d2h=d2h, duplex_h2d=duplex[0], duplex_d2h=duplex[1])


def build(method, T, E, D, load_factor):
    """The TBE of ``method``: ours / ours_bf16 (WARNING bounds check, TorchRec's default for fused
    tables) or FBGEMM's, under MANAGED_CACHING with LRU at ``load_factor``; ours_hbm in HBM."""
    from bench_tbe_cuda import build_fbgemm, build_ours
    location = EmbeddingLocation.DEVICE if method == "ours_hbm" else EmbeddingLocation.MANAGED_CACHING
    cache = dict(cache_load_factor=load_factor or 0.2, cache_algorithm=CacheAlgorithm.LRU,
                 gather_uvm_cache_stats=location == EmbeddingLocation.MANAGED_CACHING)
    if method in LEAN_METHODS:
        return build_ours(T, E, D, SparseType.FP32, method, location, **cache)
    if method in OURS_STATE_DTYPES:
        return build_ours(T, E, D, SparseType.FP32, "ours_bf16" if method == "ours_bf16" else "ours",
                          location, **cache)
    return build_fbgemm(T, E, D, SparseType.FP32, method, location, **cache)


def cache_state(m):
    """The ``[sets, 32]`` row key of every cache slot (-1: empty): ours' ``tbe.cache``, FBGEMM's TBE."""
    return m.cache.lxu_cache_state if getattr(m, "cache", None) is not None else m.lxu_cache_state


def snapshot(m):
    """``STATS`` (cumulative) and the occupied slots, as 7 ints (one host sync)."""
    stats = m.get_uvm_cache_stats().to(torch.int64).reshape(-1)[:len(STATS)]
    occ = (cache_state(m) != -1).sum().reshape(1)
    return torch.cat([stats, occ]).tolist()


def measure(m, method, lf, stream, args, profile=False):
    """Warm-up (to steady state for a cached table), then ``args.iters`` timed steps: one row."""
    cached = lf is not None
    grad = torch.randn(args.B, args.T * args.D, device=stream.device)

    def step(idx, off):
        m(idx, off).backward(grad)

    stream.restart()
    row = dict(method=method, label=LABELS[method], dist=stream.dist, load_factor=lf,
               location="MANAGED_CACHING" if cached else "DEVICE")
    t0 = time.perf_counter()
    if cached:
        m.reset_cache_states()
        m.reset_uvm_cache_stats()
        slots = cache_state(m).numel()
        det = SteadyState(args.window, args.fill_tol)
        prev = snapshot(m)
        trace = []
        while det.steps < args.max_warmup and not det.reached:
            step(*stream.next())
            cur = snapshot(m)
            c = step_counts(prev, cur)
            prev = cur
            det.update(c)
            if det.steps <= 3 or det.steps % 25 == 0 or det.reached:
                trace.append(dict(step=det.steps, occupancy=cur[6] / slots, misses=c["misses"],
                                  filled=c["filled"], evicted=c["evicted"]))
        row.update(slots=slots, warmup_steps=det.steps, steady=det.reached, warmup_trace=trace)
        before = prev
    else:
        for _ in range(args.hbm_warmup):
            step(*stream.next())
    _sync()
    row["warmup_s"] = time.perf_counter() - t0
    evs = []
    for _ in range(args.iters):
        idx, off = stream.next()          # drawn outside the timed region
        a, b = _event(), _event()
        a.record()
        step(idx, off)
        b.record()
        evs.append((a, b))
    _sync()
    times = [a.elapsed_time(b) for a, b in evs]
    row.update(ms=statistics.median(times), ms_mean=statistics.fmean(times))
    if cached:
        after = snapshot(m)
        c = per_step(step_counts(before, after), args.iters)
        row.update(occupancy=after[6] / row["slots"], full=after[6] == row["slots"],
                   steady_during_timing=is_steady_step(c, args.fill_tol),
                   hit_rate=1.0 - c["misses"] / c["unique"] if c["unique"] else None,
                   unique_per_step=c["unique"], misses_per_step=c["misses"], inserted_per_step=c["inserted"],
                   uncached_per_step=c["uncached"], filled_per_step=c["filled"], evictions_per_step=c["evicted"],
                   row_bytes=row_bytes(method, args.D), uvm_state_bytes_per_row=uvm_state_bytes(method, args.D))
        row.update(traffic_report(method, args.D, c, row["ms"], args.rates["h2d"], args.rates["d2h"]))
    if profile:
        from bench_tbe_cuda import device_ms, kernel_ms_per_step
        row["kernels_ms_per_step"] = kernel_ms_per_step(step, [stream.next() for _ in range(3)])
        row["device_ms_per_step"] = device_ms(step, [stream.next() for _ in range(3)])
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    import fbgemm_gpu
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    print("measuring pinned copy rates", flush=True)
    args.rates = pcie_rates()
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta = dict(shape=dict(T=args.T, E=args.E, D=args.D, B=args.B, L=args.L, zipf_a=args.zipf_a,
                           precision="fp32", algorithm="LRU"),
                methods=args.methods, load_factors=args.load_factors, dists=args.dists,
                window=args.window, fill_tol=args.fill_tol, max_warmup=args.max_warmup, iters=args.iters,
                device=device_name, torch=torch.__version__,
                fbgemm_gpu=getattr(fbgemm_gpu, "__version__", "?"),
                **{f"{k}_GBps": v / 1e9 for k, v in args.rates.items()})
    print(json.dumps(meta), flush=True)
    rows = []

    def log(row):   # printed and written as it comes: a run cut short keeps what it measured
        rows.append(row)
        short = {k: v for k, v in row.items() if k not in ("warmup_trace", "bytes_parts", "kernels_ms_per_step")}
        print(f"[{time.perf_counter() - t_start:6.0f}s] " + json.dumps(short), flush=True)
        if row.get("model_over_100"):
            print("WARNING: a modelled share exceeds 100% of the measured copy rate: the traffic model "
                  "counts bytes that did not move", flush=True)
        meta["elapsed_s"] = time.perf_counter() - t_start
        with open(os.path.join(args.out, "uvm_caching.json"), "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
        with open(os.path.join(args.out, "uvm_caching.md"), "w") as f:
            f.write(markdown(meta, rows))

    streams = {}

    def stream_of(dist):
        if dist not in streams:
            streams[dist] = BatchStream(args.T, args.E, args.B, args.L, dist, args.zipf_a, args.seed, DEVICE)
        return streams[dist]

    profile_lf = 0.2 if 0.2 in args.load_factors else args.load_factors[0]
    # The all-in-HBM reference first (one build, quick), then every cached method per load factor.
    configs = [(None, "ours_hbm")] if "ours_hbm" in args.methods else []
    configs += [(lf, m) for lf in args.load_factors for m in args.methods if m in CACHED_METHODS + LEAN_METHODS]
    for lf, method in configs:
        if args.time_budget and time.perf_counter() - t_start > args.time_budget:
            for dist in args.dists:
                log(dict(method=method, dist=dist, load_factor=lf, skipped="skipped: --time-budget"))
            continue
        print(f"[{time.perf_counter() - t_start:6.0f}s] building {method} load factor {lf}", flush=True)
        m = None
        try:
            t0 = time.perf_counter()
            m = build(method, args.T, args.E, args.D, lf)
            _sync()
            build_s = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - a failed build is reported, not fatal
            for dist in args.dists:
                log(dict(method=method, dist=dist, load_factor=lf, error=f"{type(exc).__name__}: {exc}"[:300]))
            m = None
        if m is not None:
            for dist in args.dists:
                if args.time_budget and time.perf_counter() - t_start > args.time_budget:
                    log(dict(method=method, dist=dist, load_factor=lf, skipped="skipped: --time-budget"))
                    continue
                try:
                    prof = args.profile and dist == "zipf" and lf == profile_lf
                    row = measure(m, method, lf, stream_of(dist), args, prof)
                    row["build_s"] = build_s
                except Exception as exc:  # noqa: BLE001
                    row = dict(method=method, dist=dist, load_factor=lf, error=f"{type(exc).__name__}: {exc}"[:300])
                log(row)
        del m
        gc.collect()
        torch.cuda.empty_cache()
    print(f"done in {time.perf_counter() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
