#!/usr/bin/env python3
"""DMP benchmark: the sparse step of an EmbeddingBagCollection under DistributedModelParallel, ours
(fused FTRL, fp32 and bf16 state) side by side with FBGEMM's fused EXACT_ROWWISE_ADAGRAD, ADAM and
EXACT_SGD.

One process per GPU (1 GPU: run the script directly; more: torchrun or torchx ``dist.ddp``), e.g.

    python3 benchmarks/bench_dmp.py --out DIR                       # 1 GPU, every config
    python3 -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_dmp.py --out DIR
    python3 benchmarks/bench_dmp.py --device cpu --tables 2 --rows 1000 --batch 64 --out DIR  # gloo

Each process builds an ``EmbeddingBagCollection`` of ``--tables`` (8) tables of ``--rows``
(2,000,000) x ``--dim`` (128), fp32, on the meta device; TorchRec's planner places it with the
given sharding type and ``--compute-kernel`` (``fused``, or ``fused_uvm_caching`` with
``--cache-load-factor`` as TorchRec's ``CacheParams.load_factor``), and DMP shards it with the optimizer's
sharders: ``ftrl`` through ``torchrec_ftrl.sharders(fused_params)`` (ours), ``ftrl_bf16`` the same
with ``"optimizer_state_dtypes": {"accum": BF16, "linear": BF16}`` in its ``fused_params``, ``adam`` /
``rowwise_adagrad`` / ``sgd`` through TorchRec's stock ``EmbeddingBagCollectionSharder`` with
FBGEMM's ``ADAM`` / ``EXACT_ROWWISE_ADAGRAD`` / ``EXACT_SGD`` in its ``fused_params``. Batches of
``--batch`` (8,192) samples per process with ``--pooling`` (20) uniform ids per bag are built as
KJTs on the device before timing. A step is ``dmp(kjt)`` (input all-to-all, lookup, output
all-to-all) -> ``pooled.pow(2).mean()`` -> ``backward()`` (the fused update).

Every optimizer x sharding type runs in one invocation, one after another (the DMP is rebuilt for
each and freed before the next), in two modes: ``throughput`` (``--steps`` steps back to back, one
sync at the end: ms/step and examples/s over all processes) and ``latency`` (a barrier and a sync
around each step: median ms, the slowest rank's). ``--profile`` adds a torch.profiler breakdown of
``--profile-steps`` synced steps: the TBE's kernels (ours: the Triton kernels and the FBGEMM sort
ops they call, i.e. everything launched inside ``_FTRLLookupFunction`` or the op
``torchrec_ftrl_host::train_lookup`` and their backward; the baselines: FBGEMM's TBE ops),
TorchRec's kernels (all-to-alls, permutes, bucketize, KJT ops), the loss, GPU busy and idle time,
and the host (CPU) time inside the TBE's forward and backward.

Rank 0 writes ``DIR/bench_dmp.json`` (after every config) and ``DIR/bench_dmp.md``. On CPU (gloo)
FBGEMM's TBE has no ADAM and TorchRec's planner offers no row-wise sharding: those configs are
skipped with the reason logged.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import logging
import os
import socket
import statistics
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

OPTIMIZERS = ("ftrl", "ftrl_bf16", "rowwise_adagrad", "adam", "sgd")
# Ours in the lean row layouts (docs/row-layouts.md): fused_params beside the FTRL knobs; --optimizers
# takes their names.
LEAN = {"ftrl_derived": {"ftrl_weights": "derived"},                                        # 1,024 B
        "ftrl_derived_bf16": {"ftrl_weights": "derived", "state_dtype": "bf16"},            # 512 B at D=128
        "ftrl_derived_rowwise": {"ftrl_weights": "derived", "ftrl_accumulator": "rowwise"},  # 516 B
        "ftrl_derived_rowwise_bf16z": {"ftrl_weights": "derived", "ftrl_accumulator": "rowwise",
                                       "optimizer_state_dtypes": {"linear": "bf16"}}}         # 260 B
OURS = ("ftrl", "ftrl_bf16", *LEAN)   # through torchrec_ftrl.sharders
SHARDINGS = ("table_wise", "row_wise", "table_row_wise", "column_wise")
MODES = ("throughput", "latency")
COMPUTE_KERNELS = ("fused", "fused_uvm_caching")
LABELS = {"ftrl": "torchrec_ftrl FTRL (ours)", "ftrl_bf16": "torchrec_ftrl FTRL, bf16 state (ours)",
          "rowwise_adagrad": "FBGEMM EXACT_ROWWISE_ADAGRAD", "adam": "FBGEMM ADAM", "sgd": "FBGEMM EXACT_SGD",
          **{k: f"torchrec_ftrl FTRL, {k[5:]} (ours)" for k in LEAN}}

# Profiler attribution (see breakdown()). Host ranges of our TBE: the autograd Function's forward
# (recorded under the class name by torch's Function.apply) and its backward node; on the CUDA host
# path the one op torchrec_ftrl_host::train_lookup and its C++ autograd node.
OUR_FORWARD = ("_FTRLLookupFunction", "torchrec_ftrl_host::train_lookup")
OUR_BACKWARD = ("_FTRLLookupFunctionBackward", "torch::autograd::CppNode<(anonymous namespace)::TrainLookup>")
OUR_HOST = OUR_FORWARD + OUR_BACKWARD
OUR_KERNELS = ("tbe_forward_kernel", "linearize_kernel", "segment_mark_kernel", "segment_update_kernel",
               "segment_combine_kernel", "offsets_repair_kernel", "state_cache_fill_kernel",
               "state_cache_follow_kernel")
# FBGEMM's TBE: the lookup op, its autograd node and the bounds check it runs first (CPU ranges),
# and its kernels by name where no range is linked.
FBGEMM_TBE_HOST = ("split_embedding_codegen_lookup", "SplitLookupFunction", "bounds_check_indices")
FBGEMM_TBE_KERNELS = ("split_embedding", "embedding_codegen", "bounds_check_indices", "embedding_backward",
                      "_backward_codegen", "linearize_index")
LOSS_HOST = ("bench_dmp.loss", "PowBackward", "MeanBackward")
A2A_NAMES = ("nccl", "all2all", "all_to_all", "alltoall", "All2All", "c10d::", "gloo:", "reduce_scatter",
             "all_gather")
PERMUTE_NAMES = ("permute", "bucketize", "jagged", "KJT", "kjt", "recat", "splits")
RADIX_SORT = ("RadixSort", "radix_sort", "DeviceRadixSort")
USER_RANGE_PREFIXES = ("## ", "bench_dmp.", "ProfilerStep")   # record_function ranges, not kernels


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: one GPU per process (NCCL) when CUDA is present, else CPU (gloo)")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=2_000_000, help="rows per table")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", "--batch-size", dest="batch", type=int, default=8192,
                   help="samples per process per step")
    p.add_argument("--pooling", type=int, default=20, help="uniform ids per bag")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                   help=f"comma list of {', '.join(OPTIMIZERS + tuple(LEAN))}")
    p.add_argument("--sharding", default="table_wise,row_wise",
                   help=f"comma list of sharding types ({', '.join(SHARDINGS)})")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of throughput, latency")
    p.add_argument("--warmup", type=int, default=10, help="steps before timing (per config)")
    p.add_argument("--steps", type=int, default=100, help="throughput: steps timed back to back")
    p.add_argument("--latency-steps", type=int, default=40, help="latency: steps timed one by one")
    p.add_argument("--batches", type=int, default=4, help="distinct batches, built before timing, cycled")
    p.add_argument("--lr", type=float, default=0.01, help="fused learning_rate of every optimizer")
    p.add_argument("--compute-kernel", choices=COMPUTE_KERNELS, default="fused",
                   help="the tables' compute kernel: fused (HBM) or fused_uvm_caching (UVM + HBM cache)")
    p.add_argument("--cache-load-factor", type=float, default=0.2,
                   help="fused_uvm_caching: cache rows / table rows (TorchRec's CacheParams.load_factor)")
    p.add_argument("--profile", action="store_true", help="torch.profiler breakdown of each config")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--out", default="outputs/bench_dmp")
    a = p.parse_args(argv)
    a.optimizer_list = [x for x in a.optimizers.split(",") if x]
    a.sharding_list = [x for x in a.sharding.split(",") if x]
    a.mode_list = [x for x in a.modes.split(",") if x]
    for name, vals, allowed in (("--optimizers", a.optimizer_list, OPTIMIZERS + tuple(LEAN)),
                                ("--sharding", a.sharding_list, SHARDINGS), ("--modes", a.mode_list, MODES)):
        bad = [v for v in vals if v not in allowed]
        if bad or not vals:
            p.error(f"{name}: {bad or vals} not in {', '.join(allowed)}")
    for name in ("tables", "rows", "dim", "batch", "pooling", "steps", "latency_steps", "batches",
                 "profile_steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    if not 0.0 < a.cache_load_factor <= 1.0:
        p.error(f"--cache-load-factor must be in (0, 1], got {a.cache_load_factor}")
    return a


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(device_choice):
    """Process group and device: torchrun's env, or a one-process group on localhost."""
    cuda = torch.cuda.is_available() if device_choice == "auto" else device_choice == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda asked for but torch.cuda.is_available() is False")
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    return device


def fused_params(optimizer, lr):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType

    import torchrec_ftrl  # noqa: F401  (registers EmbOptimType.FTRL)
    if optimizer in OURS:
        fp = {"optimizer": EmbOptimType.FTRL, "learning_rate": lr, "ftrl_l1_reg": 1e-4, "ftrl_beta": 1.0}
        if optimizer == "ftrl_bf16":
            fp["optimizer_state_dtypes"] = {"accum": SparseType.BF16, "linear": SparseType.BF16}
        fp.update(LEAN.get(optimizer, {}))
        return fp
    opt = {"adam": EmbOptimType.ADAM, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
           "sgd": EmbOptimType.EXACT_SGD}[optimizer]
    fp = {"optimizer": opt, "learning_rate": lr}
    if optimizer != "sgd":
        fp["eps"] = 1e-8
    return fp


def make_sharders(optimizer, lr):
    """Ours: ``torchrec_ftrl.sharders`` (which makes ``optimizer_state_dtypes`` hashable); the
    baselines: TorchRec's stock EBC sharder."""
    import torchrec_ftrl
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    fp = fused_params(optimizer, lr)
    if optimizer in OURS:
        return torchrec_ftrl.sharders(fp)
    return [EmbeddingBagCollectionSharder(fused_params=fp)]


def skip_reason(optimizer, sharding, device, sharders):
    """Why a config cannot run here (the same answer on every rank, so no collective is entered), or
    None."""
    if device.type == "cpu" and optimizer == "adam":
        return "FBGEMM's CPU TBE has no ADAM"
    offered = sharders[0].sharding_types(device.type)
    if sharding not in offered:
        return f"the sharder offers no {sharding} sharding on {device.type} (offered: {', '.join(offered)})"
    return None


def build(args, optimizer, sharding, device, sharders):
    """``(dmp, plan)`` for one config."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    names = [f"t{i}" for i in range(args.tables)]
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name=n, embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"f{i}"])
        for i, n in enumerate(names)], device=torch.device("meta"))
    world = dist.get_world_size()
    topo = dict(world_size=world, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                compute_device=device.type)
    if device.type == "cuda":   # the planner's default HBM cap is 32 GB; these tables need more
        topo["hbm_cap"] = torch.cuda.get_device_properties(device).total_memory
    cache = {}
    if args.compute_kernel == "fused_uvm_caching":
        from torchrec.distributed.types import CacheParams
        cache["cache_params"] = CacheParams(load_factor=args.cache_load_factor)
    constraints = {n: ParameterConstraints(sharding_types=[sharding], compute_kernels=[args.compute_kernel],
                                           **cache) for n in names}
    planner = EmbeddingShardingPlanner(topology=Topology(**topo), batch_size=args.batch,
                                       constraints=constraints)
    plan = planner.collective_plan(ebc, sharders, dist.GroupMember.WORLD)
    model = DistributedModelParallel(ebc, device=device, sharders=sharders, plan=plan)
    return model, plan


def make_batches(args, device, rank):
    """``--batches`` KJTs of ``--batch`` samples x ``--tables`` features x ``--pooling`` uniform ids,
    on the device, lengths per key given (no host sync when a step reads them)."""
    from torchrec import KeyedJaggedTensor
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    T, B, L = args.tables, args.batch, args.pooling
    out = []
    for _ in range(args.batches):
        out.append(KeyedJaggedTensor(
            keys=[f"f{i}" for i in range(T)],
            values=torch.randint(0, args.rows, (T * B * L,), device=device, generator=gen),
            lengths=torch.full((T * B,), L, dtype=torch.int64, device=device),
            stride=B, length_per_key=[B * L] * T, offset_per_key=[i * B * L for i in range(T + 1)]))
    return out


def make_step(model):
    def step(kjt):
        with record_function("bench_dmp.forward"):
            pooled = model(kjt).values()
        with record_function("bench_dmp.loss"):
            loss = pooled.pow(2).mean()
        with record_function("bench_dmp.backward"):
            loss.backward()
    return step


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_throughput(step, batches, steps, device):
    """ms per step of ``steps`` back-to-back steps (one sync at the end), the slowest rank's."""
    _sync(device)
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    _sync(device)
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t) * 1e3 / steps


def run_latency(step, batches, steps, device):
    """Per-step ms (barrier and sync around each step), the slowest rank's per step."""
    times = []
    for i in range(steps):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        step(batches[i % len(batches)])
        _sync(device)
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [x * 1e3 for x in t.tolist()]


# ------------------------------------------------------------------------------------ profile

def _matches(name, pats):
    return any(p in name for p in pats)


def _ancestors(e):
    out = []
    while e is not None:
        out.append(e.name)
        e = e.cpu_parent
    return out


def classify_kernel(kernel_name, launch_ancestry, tbe):
    """Category of one device event: ``tbe`` (ours or FBGEMM's, whichever the config runs),
    ``all_to_all``, ``permute_kjt`` (TorchRec's permutes / bucketize / KJT ops), ``loss`` or
    ``torchrec_other``. ``launch_ancestry``: names of the CPU op that launched it and its parents
    (empty when the profiler linked none); ``tbe``: "ours" or "fbgemm"."""
    anc = launch_ancestry
    if tbe == "ours" and (any(a in OUR_HOST for a in anc) or _matches(kernel_name, OUR_KERNELS)):
        return "tbe"
    if tbe == "fbgemm" and (any(_matches(a, FBGEMM_TBE_HOST) for a in anc)
                            or _matches(kernel_name, FBGEMM_TBE_KERNELS)):
        return "tbe"
    if not anc and _matches(kernel_name, RADIX_SORT):
        return "tbe"   # unlinked: TorchRec's sparse step sorts nothing, both TBEs do
    if _matches(kernel_name, A2A_NAMES) or any(_matches(a, A2A_NAMES) for a in anc):
        return "all_to_all"
    if any(_matches(a, LOSS_HOST) for a in anc):
        return "loss"
    if _matches(kernel_name, PERMUTE_NAMES) or any(_matches(a, PERMUTE_NAMES) for a in anc):
        return "permute_kjt"
    return "torchrec_other"


def _union_us(intervals):
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def breakdown(events, n_steps, tbe):
    """Where ``n_steps`` profiled steps spent their time (ms per step), from torch.profiler's
    ``prof.events()``: device time by category (``classify_kernel``), GPU busy (the union of device
    events inside the steps' ``bench_dmp.step`` ranges) and idle (the rest of those ranges), and
    host time: the TBE's forward and backward CPU ranges (inclusive and self), and TorchRec's
    forward (``bench_dmp.forward`` minus the TBE's forward)."""
    from torch.autograd import DeviceType
    cpu = [e for e in events if getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU]
    # record_function ranges are also projected onto the GPU timeline (gpu_user_annotation), as
    # device events and as "kernels" of their own range: those are no device work
    ranges = {e.name for e in cpu if getattr(e, "is_user_annotation", False)}

    def annotation(name):
        return name in ranges or name.startswith(USER_RANGE_PREFIXES)
    dev = [e for e in events if getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU
           and not getattr(e, "is_user_annotation", False) and not annotation(e.name)]
    steps = [e for e in cpu if e.name == "bench_dmp.step"]
    windows = [(e.time_range.start, e.time_range.end) for e in steps]
    wall = sum(b - a for a, b in windows)
    cats, top, linked, total_dev = _device_us_by_category(cpu, dev, tbe, annotation)
    busy = _gpu_busy_us(dev, windows)
    n = max(n_steps, 1)
    f_in, f_self, b_in, b_self = _tbe_host_us(cpu, tbe)
    fwd_total = sum(e.cpu_time_total for e in cpu if e.name == "bench_dmp.forward")
    ms = lambda us: us / n / 1e3  # noqa: E731
    return dict(
        steps=n_steps, step_ms=ms(wall),
        device_ms={c: ms(v) for c, v in sorted(cats.items())}, device_total_ms=ms(total_dev),
        linked_share=(linked / total_dev) if total_dev else None,
        gpu_busy_ms=ms(busy) if dev else None, gpu_idle_ms=ms(wall - busy) if dev else None,
        host_ms=dict(tbe_forward=ms(f_in), tbe_forward_self=ms(f_self), tbe_backward=ms(b_in),
                     tbe_backward_self=ms(b_self),
                     torchrec_forward=ms(max(fwd_total - f_in, 0.0)) if fwd_total else None),
        top_kernels={c: sorted(((k, ms(v)) for k, v in d.items()), key=lambda x: -x[1])[:8]
                     for c, d in top.items()})


def _device_us_by_category(cpu, dev, tbe, annotation):
    """``(us by category, {category: {kernel: us}}, linked us, total device us)`` of the profiled
    device work: first the kernels the profiler linked to the CPU op that launched them (classified
    with that op's ancestry), then the device events ``dev`` no CPU op claimed (by their name only).
    ``annotation(name)``: whether a name is a record_function range rather than a kernel."""
    cats, top = {}, {}
    linked = 0.0
    seen = collections.Counter()

    def add(c, name, d):
        cats[c] = cats.get(c, 0.0) + d
        top.setdefault(c, {})
        top[c][name] = top[c].get(name, 0.0) + d

    for e in cpu:   # kernels the profiler linked to the CPU op that launched them
        ks = getattr(e, "kernels", None) or []
        if not ks:
            continue
        anc = _ancestors(e)
        for k in ks:
            if annotation(k.name):
                continue
            add(classify_kernel(k.name, anc, tbe), k.name, k.duration)
            linked += k.duration
            seen[(k.name, round(k.duration, 3))] += 1
    total_dev = 0.0
    for e in dev:   # device events no CPU op claimed: by their name only
        d = e.time_range.end - e.time_range.start
        total_dev += d
        key = (e.name, round(d, 3))
        if seen[key] > 0:
            seen[key] -= 1
        else:
            add(classify_kernel(e.name, [], tbe), e.name, d)
    return cats, top, linked, total_dev


def _gpu_busy_us(dev, windows):
    """Microseconds of the ``windows`` (``(start, end)`` pairs) covered by at least one of the
    device events ``dev``."""
    busy = 0.0
    for a, b in windows:
        busy += _union_us([(max(e.time_range.start, a), min(e.time_range.end, b)) for e in dev
                           if e.time_range.end > a and e.time_range.start < b])
    return busy


def _top_level_us(cpu, pred):
    """``(inclusive us, self us)`` summed over the CPU events whose name satisfies ``pred``, each
    counted once: events nested inside another selected event are left out."""
    sel = [e for e in cpu if pred(e.name)]
    ids = {id(e) for e in sel}

    def nested(e):
        p = e.cpu_parent
        while p is not None:
            if id(p) in ids:
                return True
            p = p.cpu_parent
        return False
    sel = [e for e in sel if not nested(e)]
    return sum(e.cpu_time_total for e in sel), sum(e.self_cpu_time_total for e in sel)


def _tbe_host_us(cpu, tbe):
    """``(forward inclusive, forward self, backward inclusive, backward self)`` host us of the TBE
    (``tbe``: "ours", our autograd Function and its backward node; else FBGEMM's lookup op and its
    bounds check, and the lookup's autograd node)."""
    if tbe == "ours":
        f_in, f_self = _top_level_us(cpu, lambda s: s in OUR_FORWARD)
        b_in, b_self = _top_level_us(cpu, lambda s: s in OUR_BACKWARD)
    else:   # FBGEMM: the lookup op and its bounds check; the lookup's autograd node
        f_in, f_self = _top_level_us(cpu, lambda s: _matches(s, ("split_embedding_codegen_lookup",
                                                                 "bounds_check_indices")))
        b_in, b_self = _top_level_us(cpu, lambda s: "SplitLookupFunction" in s and _matches(
            s, ("CppNode", "Backward", "evaluate_function")))
    return f_in, f_self, b_in, b_self


def profile_config(step, batches, n, device):
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for i in range(n):
            dist.barrier()
            _sync(device)
            with record_function("bench_dmp.step"):
                step(batches[i % len(batches)])
                _sync(device)
    return prof.events()


# ------------------------------------------------------------------------------------ report

def markdown(meta, rows):
    md = [f"Sparse step under DistributedModelParallel: {meta['world_size']} x {meta['device']}, torch "
          f"{meta['torch']}, torchrec {meta['torchrec']}, fbgemm_gpu {meta['fbgemm_gpu']}. "
          f"EmbeddingBagCollection of {meta['tables']} tables x {meta['rows']:,} rows x {meta['dim']} "
          f"(fp32), compute kernel {meta.get('compute_kernel', 'fused')}"
          + (f" (cache load factor {meta['cache_load_factor']:g})" if meta.get("cache_load_factor") else "")
          + f", {meta['batch']:,} samples per process, {meta['pooling']} uniform ids per bag; a "
          f"step = dmp(kjt) -> pooled.pow(2).mean() -> backward (fused update). Throughput: "
          f"{meta['steps']} steps back to back, one sync; latency: median of {meta['latency_steps']} "
          f"steps, barrier + sync around each, the slowest rank; {meta['warmup']} warm-up steps. "
          f"\"vs X\" = X's ms / this row's ms.", "",
          "| optimizer | sharding | throughput ms / step | examples/s | vs ROWWISE_ADAGRAD | vs ADAM | "
          "latency ms (median) | vs ROWWISE_ADAGRAD | vs ADAM |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r["optimizer"], r["sharding"]): r for r in rows}

    def ratio(r, other, key):
        o = by.get((other, r["sharding"]))
        if not o or o.get(key) is None or r.get(key) is None:
            return "–"
        return f"{o[key] / r[key]:.2f}x"

    for r in rows:
        if r.get("skipped") or r.get("error"):
            md.append(f"| {LABELS[r['optimizer']]} | {r['sharding']} | "
                      f"{r.get('skipped') or 'failed: ' + r['error'][:80]} | | | | | | |")
            continue
        tp, lat = r.get("throughput_ms"), r.get("latency_ms_median")
        md.append(_row_md(r, tp, lat, ratio))
    prof = [r for r in rows if r.get("profile")]
    if prof:
        md += ["", f"Profile (torch.profiler, {prof[0]['profile']['steps']} steps, each synced; rank 0; "
               "ms per step). TBE = the config's embedding kernels: ours (Triton kernels and the FBGEMM "
               "sort ops they call: everything launched inside our autograd Function's forward and "
               "backward) or FBGEMM's TBE ops. all-to-all: collectives of the input/output dists; "
               "permute/KJT: TorchRec's permutes, bucketize and KJT ops; other: TorchRec's remaining "
               "kernels. Host: CPU time inside the TBE's forward / backward ranges (self time in "
               "brackets), and TorchRec's forward (dmp(kjt) minus the TBE forward).", "",
               "| optimizer | sharding | step ms | TBE kernels | all-to-all | permute / KJT | TorchRec other | "
               "loss | GPU busy | GPU idle | host: TBE fwd | host: TBE bwd | host: TorchRec fwd |",
               "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in prof:
            p = r["profile"]
            d, h = p["device_ms"], p["host_ms"]
            f = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
            md.append(f"| {r['optimizer']} | {r['sharding']} | {f(p['step_ms'])} | {f(d.get('tbe', 0.0))} | "
                      f"{f(d.get('all_to_all', 0.0))} | {f(d.get('permute_kjt', 0.0))} | "
                      f"{f(d.get('torchrec_other', 0.0))} | {f(d.get('loss', 0.0))} | {f(p['gpu_busy_ms'])} | "
                      f"{f(p['gpu_idle_ms'])} | {f(h['tbe_forward'])} ({f(h['tbe_forward_self'])}) | "
                      f"{f(h['tbe_backward'])} ({f(h['tbe_backward_self'])}) | {f(h['torchrec_forward'])} |")
    md += ["", "Plans: " + "; ".join(f"{r['optimizer']}/{r['sharding']}: {r['plan_brief']}" for r in rows
                                     if r.get("plan_brief"))]
    return "\n".join(md)


def _row_md(r, tp, lat, ratio):
    tps = f"{tp:.3f}" if tp else "–"
    exs = f"{r['examples_per_s']:,.0f}" if tp else "–"
    lats = f"{lat:.3f}" if lat else "–"
    return (f"| {LABELS[r['optimizer']]} | {r['sharding']} | {tps} | {exs} | "
            f"{ratio(r, 'rowwise_adagrad', 'throughput_ms')} | {ratio(r, 'adam', 'throughput_ms')} | {lats} | "
            f"{ratio(r, 'rowwise_adagrad', 'latency_ms_median')} | {ratio(r, 'adam', 'latency_ms_median')} |")


def plan_info(plan):
    tables = {}
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():
            tables[table] = dict(sharding_type=ps.sharding_type, compute_kernel=ps.compute_kernel,
                                 ranks=list(ps.ranks or []))
    kinds = sorted({f"{v['sharding_type']}/{v['compute_kernel']}" for v in tables.values()})
    ranks = sorted({r for v in tables.values() for r in v["ranks"]})
    return tables, f"{', '.join(kinds)} on ranks {ranks}"


def _quiet():
    for name in ("torchrec.distributed.planner", "torchrec.distributed.planner.types",
                 "torchrec.distributed.planner.storage_reservations", "torchrec.distributed.planner.stats",
                 "torchrec.distributed.planner.planners", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


def run_meta(args, device, world) -> dict:
    """The run's description in ``bench_dmp.json``: processes, device, process-group backend,
    versions and the flags that shape a step."""
    import fbgemm_gpu
    import torchrec

    import torchrec_ftrl  # noqa: F401
    return dict(world_size=world, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                backend=dist.get_backend(), torch=torch.__version__, torchrec=torchrec.__version__,
                fbgemm_gpu=getattr(fbgemm_gpu, "__version__", "?"), tables=args.tables, rows=args.rows,
                dim=args.dim, batch=args.batch, pooling=args.pooling, warmup=args.warmup, steps=args.steps,
                latency_steps=args.latency_steps, batches=args.batches, lr=args.lr, modes=args.mode_list,
                compute_kernel=args.compute_kernel,
                cache_load_factor=args.cache_load_factor if args.compute_kernel != "fused" else None)


def write_results(out, meta, rows, t_start, rank) -> None:
    """Rank 0: ``out/bench_dmp.json`` (replaced atomically; ``meta`` with the wall time since
    ``t_start`` and the ``rows``) and ``out/bench_dmp.md``. Other ranks write nothing."""
    if rank != 0:
        return
    meta["total_s"] = time.perf_counter() - t_start
    with open(os.path.join(out, "bench_dmp.json.tmp"), "w") as fh:
        json.dump(dict(meta, results=rows), fh, indent=1)
    os.replace(os.path.join(out, "bench_dmp.json.tmp"), os.path.join(out, "bench_dmp.json"))
    with open(os.path.join(out, "bench_dmp.md"), "w") as fh:
        fh.write(markdown(meta, rows) + "\n")


def run_config(args, device, rank, world, row, say) -> None:
    """One optimizer x sharding config (``row``'s): skipped with the reason where it cannot run
    here (``skip_reason``, no collective entered); else measured (``measure_config``; a failure is
    recorded as ``row["error"]``), freed, and the ranks meet at a barrier."""
    optimizer, sharding = row["optimizer"], row["sharding"]
    sharders = make_sharders(optimizer, args.lr)
    reason = skip_reason(optimizer, sharding, device, sharders)
    if reason:
        row["skipped"] = f"skipped: {reason}"
        say(f"[{optimizer} / {sharding}] {row['skipped']}")
        return
    try:
        measure_config(args, device, rank, world, row, sharders, say)
    except Exception as exc:  # noqa: BLE001 - the other configs still run
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        say(f"[{optimizer} / {sharding}] FAILED: {row['error']}")
        if rank == 0:
            traceback.print_exc()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated(device) / 2 ** 30
        if left > 1.0:
            say(f"    warning: {left:.1f} GiB still allocated after freeing the model")
    dist.barrier()


def measure_config(args, device, rank, world, row, sharders, say) -> None:
    """Build the DMP of ``row``'s config, warm it up, time it in ``--modes`` (``time_config``),
    profile it with ``--profile`` (``profile_row``); the figures go to ``row``, one line to ``say``."""
    optimizer, sharding = row["optimizer"], row["sharding"]
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model, plan = build(args, optimizer, sharding, device, sharders)
    row["plan"], row["plan_brief"] = plan_info(plan)
    batches = make_batches(args, device, rank)
    step = make_step(model)
    _sync(device)
    row["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(batches[i % len(batches)])
    _sync(device)
    row["warmup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    msg = f"[{optimizer} / {sharding}] {row['plan_brief']}; built in {row['build_s']:.1f} s"
    msg += time_config(args, device, world, row, step, batches)
    row["timing_s"] = time.perf_counter() - t0
    if args.profile:
        msg += profile_row(args, device, world, row, step, batches)
    if device.type == "cuda":
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
        msg += f"\n    peak allocated {row['peak_allocated_gib']:.1f} GiB"
    say(msg)


def time_config(args, device, world, row, step, batches) -> str:
    """Throughput (ms per step, examples/s over all processes) and latency (median, min, p90 ms)
    of ``step``, as ``--modes`` asks, into ``row``; returns the text the config's line goes on with."""
    msg = ""
    if "throughput" in args.mode_list:
        ms = run_throughput(step, batches, args.steps, device)
        row["throughput_ms"] = ms
        row["examples_per_s"] = args.batch * world / (ms * 1e-3)
        msg += f"; throughput {ms:.3f} ms/step, {row['examples_per_s']:,.0f} examples/s"
    if "latency" in args.mode_list:
        lat = run_latency(step, batches, args.latency_steps, device)
        row["latency_ms_median"] = statistics.median(lat)
        row["latency_ms_min"] = min(lat)
        row["latency_ms_p90"] = sorted(lat)[int(0.9 * (len(lat) - 1))]
        msg += f"; latency median {row['latency_ms_median']:.3f} ms (min {min(lat):.3f})"
    return msg


def _round3(d):
    """``d`` with its numbers rounded to 3 decimals (None kept)."""
    return {k: (None if v is None else round(v, 3)) for k, v in d.items()}


def profile_row(args, device, world, row, step, batches) -> str:
    """``--profile``: ``--profile-steps`` profiled steps broken down (``breakdown``) on every rank,
    gathered into ``row`` (rank 0's as ``profile``); returns rank 0's figures as a line to log."""
    t0 = time.perf_counter()
    events = profile_config(step, batches, args.profile_steps, device)
    tbe = "ours" if row["optimizer"] in OURS else "fbgemm"
    mine = breakdown(events, args.profile_steps, tbe)
    del events
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    row["profile"], row["profile_all_ranks"] = gathered[0], gathered
    row["profile_s"] = time.perf_counter() - t0
    p = gathered[0]
    return (f"\n    profile (rank 0, ms/step): step {p['step_ms']:.3f}, device "
            f"{json.dumps(_round3(p['device_ms']))}, GPU busy / idle "
            f"{json.dumps(_round3(dict(busy=p['gpu_busy_ms'], idle=p['gpu_idle_ms'])))}, "
            f"host {json.dumps(_round3(p['host_ms']))}")


def main(argv=None) -> None:
    args = parse(argv)
    _quiet()
    t_start = time.perf_counter()
    device = init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(int(os.environ.get("LOCAL_WORLD_SIZE", world)), 1)))
    meta = run_meta(args, device, world)
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    say(f"bench_dmp: {world} process(es), {meta['device']} ({meta['backend']}), torch {meta['torch']}, "
        f"torchrec {meta['torchrec']}, fbgemm_gpu {meta['fbgemm_gpu']}; {args.tables} tables x "
        f"{args.rows:,} x {args.dim}, batch {args.batch}/process, pooling {args.pooling}")
    rows = []
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for sharding in args.sharding_list:
        for optimizer in args.optimizer_list:
            row = dict(optimizer=optimizer, sharding=sharding)
            rows.append(row)
            run_config(args, device, rank, world, row, say)
            write_results(args.out, meta, rows, t_start, rank)
    write_results(args.out, meta, rows, t_start, rank)
    say(markdown(meta, rows))
    say(f"bench_dmp: {time.perf_counter() - t_start:.1f} s; wrote {os.path.join(args.out, 'bench_dmp.json')} and .md")
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
