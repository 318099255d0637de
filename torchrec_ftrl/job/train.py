"""The CTR training job: a DLRM whose 26 (or any number of) embedding tables use a fused sparse
optimizer (FTRL-Proximal from torchrec_ftrl by default, or stock row-wise Adagrad), sharded with
TorchRec's DistributedModelParallel.

One process:  python -m torchrec_ftrl.job                  (gloo, world size 1, synthetic data)
              python examples/train_ctr.py                 (the same, from a checkout)
Several:      torchx run -s local_cwd torchrec_ftrl/components.py:train_ctr --nproc 2 [-- FLAGS]
Real data:    python -m torchrec_ftrl.job --data DATA/criteo/criteo_dac_combined.tsv

Each step runs under TorchRec's ``TrainPipelineSparseDist`` (``--pipeline none``: one batch at a time;
``pipeline.py``); ``--profile-steps K`` profiles K steps (``profile.py``).

Prints a tqdm bar on rank 0 (step, the cross-rank mean loss of the last --log-every steps,
examples/s), validation AUC / log loss every --eval-every steps, and at the end writes
``<output-dir>/<run-name>_summary.json`` and ``<run-name>.png`` (and with ``--profile-steps`` the
chrome trace ``<run-name>_trace.json``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from . import (checkpoint, cli, dist_env, evaluate, faults, model as model_lib, pipeline, plan_only,
               profile as profile_lib, report, sparsity, validate, warmup as kernel_warmup, zch)
from .errors import JobConfigError, exit_with_error
from .source import make_source, steps_for_epochs
from torchrec_ftrl.data import train_loader


STEADY_AFTER = 10   # steps left out of ``steady_examples_per_s``
KERNEL_BUILD_NOTICE_S = 5.0   # rank 0 says the CPU kernel is being built when loading takes longer
KERNEL_BUILD_NOTICE = ("train_ctr: building the compiled CPU kernel (this install has no prebuilt one "
                       "for this torch; once, about 1-2 minutes on 2 cores)")


def _sum_over_ranks(x: float, device: torch.device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return float(t)


def _mean_over_ranks(x: float, device: torch.device) -> float:
    return _sum_over_ranks(x, device) / dist.get_world_size()


def _quiet() -> None:
    """Hide torchrec planner advice and deprecation chatter that says nothing about this run."""
    for name in ("torchrec.distributed.planner", "torchrec.distributed.planner.types",
                 "torchrec.distributed.planner.storage_reservations"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def run(argv=None) -> dict:
    """Run the job with ``argv`` (default ``sys.argv[1:]``); returns the summary dict (every rank).

    The whole configuration is checked (``validate``) before the process group, the model or any
    output exists.

    Raises:
        JobConfigError, FileNotFoundError, MalformedRowError, NoUsableRowsError, CheckpointError: a
            configuration the job cannot run, bad data or checkpoint (``main`` turns these into one
            ``train_ctr: error: ...`` line and status 2).
        SystemExit: bad flags (argparse: one ``train_ctr: error: ...`` line, status 2).
    """
    _quiet()
    args = cli.parse_args(argv)
    validate.check_flags(args)
    if args.plan_only:
        return plan_only.run(args)
    faults.parse(os.environ.get(faults.ENV))  # a malformed fault spec fails before any work
    fused_params = cli.sparse_fused_params(args)  # fails early if FTRL is not registered
    source, data_desc = validate.build_source(args)
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    validate.check_plan(args, source, fused_params, world_size, local_world,
                        "cuda" if cli.cuda_run(args.device) else "cpu")
    env = dist_env.init(args.device)
    if env.device.type == "cpu" and args.cpu_threads > 0:
        torch.set_num_threads(args.cpu_threads)
    rank0 = env.rank == 0
    try:
        summary = _run(args, env, fused_params, source, data_desc, rank0)
    except BaseException:
        dist_env.shutdown(clean=False)  # peers may be gone: no barrier
        raise
    dist_env.shutdown()
    return summary


def _load_cpu_kernel(say: bool) -> None:
    """Load (on first use of an install: build) the compiled CPU kernel now, rather than silently
    inside the model's construction; when ``say`` and it has not loaded after
    ``KERNEL_BUILD_NOTICE_S``, print ``KERNEL_BUILD_NOTICE``."""
    from torchrec_ftrl.kernels import backend

    timer = threading.Timer(KERNEL_BUILD_NOTICE_S, print, (KERNEL_BUILD_NOTICE,), {"flush": True})
    if say:
        timer.start()
    try:
        backend.resolve_backend(None, torch.device("cpu"))   # falls back to the PyTorch path, warning
    finally:
        timer.cancel()


def _run(args, env, fused_params, source, data_desc, rank0) -> dict:
    import torchrec_ftrl

    torch.manual_seed(args.seed)
    path = None
    if args.resume is not None:   # a checkpoint this run cannot resume fails before any work
        path = checkpoint.resolve(args.resume, args.checkpoint_dir)
        checkpoint.check_ftrl_state_dtype(path, checkpoint.read_meta(path), args.ftrl_state_dtype,
                                          args.sparse_optimizer)
    if data_desc["kind"].startswith("synthetic-"):   # drawn on the device: made again on it
        source, data_desc = make_source(args, env.device)
    steps = args.steps
    if args.epochs is not None:
        steps = steps_for_epochs(source, args.epochs, env.world_size, args.batch_size)
    features = source.categorical_names
    sizes = (zch.slots_per_table(args.num_embeddings_list, len(features)) if args.zch
             else source.num_embeddings)
    num_dense = len(source.dense_names)

    if env.device.type == "cpu":
        _load_cpu_kernel(rank0)
    # Derived FTRL weights start at zero, where FTRL starts a row (z = 0): an encoded uniform start
    # would keep |z| above ftrl_l1_reg and train a denser model (docs/row-layouts.md).
    net = model_lib.build_dlrm(features, sizes, args.embedding_dim, num_dense, args.dense_arch_list,
                               args.over_arch_list, env.device,
                               dcn=(args.dcn_layers, args.dcn_rank) if args.dcn_layers else None,
                               zero_init=args.sparse_optimizer == "ftrl" and args.ftrl_weights == "derived")
    if args.compile_dense:
        model_lib.compile_dense(net)
    sharders = torchrec_ftrl.sharders(fused_params)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    tables = [f"t_{f}" for f in features]
    evictions = None
    if args.zch:
        zch.add_managed_collision(net, args.zch_eviction_interval, env.device)
        dmp, plan = zch.shard(net, tables, sharders, env.device, env.world_size, local_world)
        evictions = zch.EvictionCounter(dmp)
        # A rank's MC module receives at most one id per example of the global batch and feature.
        zch.size_history_buffers(dmp, args.batch_size * env.world_size)
    else:
        hbm, ddr = model_lib.device_memory_bytes(env.device, args.hbm_gib, args.host_gib, local_world)
        dmp, plan = model_lib.shard(
            net, tables, sharders, env.device, args.sharding_types.split(","), env.world_size,
            local_world, args.batch_size, hbm, ddr,
            no_fit_message=lambda: plan_only.no_fit_message(args, sizes, env.world_size, hbm, ddr))
    opt = model_lib.build_optimizer(dmp, args.dense_optimizer, args.dense_lr)

    # Touched rows are counted from the batches' ids; --zch batches hold raw ids, not rows.
    tracker = sparsity.TouchTracker([] if args.zch else features, [] if args.zch else sizes,
                                    env.device)
    start_step, loss_history, val_history = 0, [], []
    resumed_window = None
    if args.resume is not None:
        extra = tracker.state_dict()
        meta = checkpoint.load(path, dmp, opt, extra=extra)
        tracker.load_state_dict(extra)
        start_step = int(meta["step"])
        # TorchRec does not checkpoint a TBE's step counter (one per training step); bf16 FTRL state
        # rounds with it, so the resumed run rounds as the uninterrupted one.
        dmp.fused_optimizer.set_optimizer_step(start_step)
        if start_step > steps:
            raise checkpoint.CheckpointError(
                f"--resume: the run ends at step {steps} (--steps / --epochs), before the step of the "
                f"checkpoint {path} ({start_step})")
        loss_history, val_history = meta.get("loss_history", []), meta.get("val_history", [])
        resumed_window = meta.get("loss_window")
        if rank0:
            print(f"resumed from {path} at step {start_step}", flush=True)

    # --split none: every row trains, nothing is validated.
    no_split = getattr(getattr(source, "split", None), "mode", None) == "none"
    val_batches = [] if no_split else source.validation_batches(env.rank, env.world_size,
                                                                  args.batch_size)
    if rank0 and source.stats() is not None:
        print(f"data: {source.stats().summary()}", flush=True)
    on_device = getattr(source, "on_device", False)   # batches drawn on the device: no workers, no pinning
    workers = 0 if on_device else cli.data_workers(args.data_workers, local_world)
    train_iter = train_loader(source, env.rank, env.world_size, args.batch_size, start_step,
                              steps - start_step, workers=workers,
                              pin_memory=env.device.type == "cuda" and not on_device)
    warmup_s, warmed = None, 0
    if kernel_warmup.enabled(args.kernel_warmup, args.sparse_optimizer, env.device):
        t = time.perf_counter()
        warmed = kernel_warmup.warm_up(dmp, args.batch_size * env.world_size,
                                       getattr(source, "multi_hot", args.multi_hot_list), args.seed)
        warmup_s = time.perf_counter() - t
    if rank0:
        opt_name = args.sparse_optimizer
        if opt_name == "ftrl":
            opt_name += f" (state {args.ftrl_state_dtype})"
        print(f"train_ctr: {env.world_size} rank(s), {env.device} ({env.backend}), data={data_desc['kind']}, "
              f"{len(features)} tables x {args.embedding_dim} dims, sparse={opt_name} "
              f"lr={args.sparse_lr}, dense={args.dense_optimizer} lr={args.dense_lr}, "
              f"steps {start_step}->{steps}, batch {args.batch_size}/rank, {workers} data "
              f"worker(s)/rank", flush=True)

    bar = None
    if rank0 and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=steps, initial=start_step, desc="train", mininterval=1.0, dynamic_ncols=True)

    def eval_now(step):
        if not val_batches:
            return
        with record_function(f"{profile_lib.EXCLUDED_PREFIX} validation ##"), loop.paused() as model:
            m = evaluate.validate(model, val_batches, env.device)
        m["step"] = step
        val_history.append(m)
        if rank0:
            msg = (f"step {step}: validation AUC {m['auc']:.4f}  logloss {m['logloss']:.4f}  "
                   f"NE {m['ne']:.4f}  ({m['rows']} rows)")
            (bar.write(msg) if bar else print(msg, flush=True))

    def save_ckpt(step):
        # The open --log-every window (each rank's loss sum so far): a resumed run logs the same means.
        sums = [None] * env.world_size
        dist.all_gather_object(sums, float(window_loss) if window_loss is not None else 0.0)
        meta = {"loss_history": loss_history, "val_history": val_history, "args": vars(args),
                "loss_window": {"n": window_n, "sums": sums}}
        with record_function(f"{profile_lib.EXCLUDED_PREFIX} checkpoint ##"):
            tracker.reduce(env.device)
            path = checkpoint.save(args.checkpoint_dir, step, dmp, opt, meta,
                                   keep=args.keep_checkpoints, extra=tracker.state_dict())
        if rank0:
            msg = f"step {step}: checkpoint {path}"
            (bar.write(msg) if bar else print(msg, flush=True))

    dmp.train()
    loop = pipeline.make(args.pipeline, dmp, opt, env.device, train_iter, steps - start_step,
                         (lambda kjt: None) if args.zch else tracker.update)
    prof = None
    warmup, active = profile_lib.plan(steps - start_step, args.profile_steps)
    if active:
        trace = os.path.join(args.output_dir, f"{args.run_name}_trace.json" if rank0
                             else f"{args.run_name}_trace.rank{env.rank}.json")
        prof = profile_lib.StepProfiler(active, warmup, env.device, trace, module=dmp.module)
    t0 = time.perf_counter()
    # The window's loss sum stays on the device (float64, the step losses in order) and is read
    # back every --log-every steps, so the host does not wait for each step's kernels.
    window_loss, window_n = None, 0
    if resumed_window and resumed_window.get("n") and len(resumed_window.get("sums", ())) == env.world_size:
        window_n = int(resumed_window["n"])
        window_loss = torch.tensor(resumed_window["sums"][env.rank], dtype=torch.float64, device=env.device)
    shown = {}
    # Steady-state throughput: timed from the end of the first STEADY_AFTER steps of this run (one
    # device sync there), so one-off costs (kernel compiles, first allocations) are left out.
    steady_from = start_step + STEADY_AFTER if steps - start_step > 2 * STEADY_AFTER else None
    t_steady = None
    for step in range(start_step + 1, steps + 1):
        if step - 1 == steady_from:
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)
            t_steady = time.perf_counter()
        loss = loop.step()
        faults.maybe_fail(env.rank, step, "step")
        with record_function(profile_lib.METRICS_LABEL):
            window_loss = loss.double() if window_loss is None else window_loss + loss.double()
            window_n += 1
            if step % args.log_every == 0 or step == steps:
                loss_history.append([step, _mean_over_ranks(float(window_loss) / window_n, env.device)])
                window_loss, window_n = None, 0
                shown = {"loss": f"{loss_history[-1][1]:.4f}"}
            if bar is not None:
                rate = (step - start_step) * args.batch_size * env.world_size / (time.perf_counter() - t0)
                bar.update(1)
                bar.set_postfix(**shown, ex_s=f"{rate:.0f}", refresh=False)
        if step % args.eval_every == 0 and step != steps:
            eval_now(step)
        if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0 \
                and step != steps:
            save_ckpt(step)
        if prof is not None:
            prof.step()
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)   # the last steps' kernels belong to the training time
    train_time = time.perf_counter() - t0
    if prof is not None:
        prof.close()
    if bar is not None:
        bar.close()
    if not val_history or val_history[-1]["step"] != steps:
        eval_now(steps)
    if args.checkpoint_dir:
        save_ckpt(steps)
    tracker.reduce(env.device)
    sp = sparsity.table_sparsity(dmp, env.device, touched=None if args.zch else tracker.masks)
    done = steps - start_step
    summary = {
        "run_name": args.run_name,
        "world_size": env.world_size, "device": str(env.device), "backend": env.backend,
        "data": {**data_desc, "reader": source.stats().to_dict() if source.stats() else None},
        "sparse_optimizer": args.sparse_optimizer,
        "fused_params": summary_fused_params(fused_params),
        "ftrl_state_dtype": args.ftrl_state_dtype if args.sparse_optimizer == "ftrl" else None,
        "ftrl_registered": cli_ftrl_registered(),
        "steps": steps, "start_step": start_step, "batch_size_per_rank": args.batch_size,
        "examples_per_s": done * args.batch_size * env.world_size / train_time if done else None,
        "train_time_s": train_time,
        "steady_examples_per_s": ((steps - steady_from) * args.batch_size * env.world_size
                                  / (t0 + train_time - t_steady) if t_steady is not None else None),
        "final_train_loss": loss_history[-1][1] if loss_history else None,
        "final_validation": val_history[-1] if val_history else None,
        "validation_history": val_history,
        "loss_history": loss_history,
        "sparsity_overall": sparsity.overall(sp),
        "sparsity": sp,
        "plan": model_lib.plan_summary(plan),
        "pipeline": args.pipeline,
        "zch": ({"slots_per_table": sizes, "eviction_interval": args.zch_eviction_interval,
                 "reset_slots": int(_sum_over_ranks(evictions.evicted, env.device))}
                if args.zch else None),
        "step_profile": prof.result if prof is not None else None,
        "kernel_warmup_s": warmup_s, "kernel_warmup_tbes": warmed,
        "peak_gpu_memory_bytes": (torch.cuda.max_memory_allocated(env.device)
                                  if env.device.type == "cuda" else None),
        "args": vars(args),
    }
    if rank0:
        out = os.path.join(args.output_dir, f"{args.run_name}_summary.json")
        png = os.path.join(args.output_dir, f"{args.run_name}.png")
        report.write_summary(out, summary)
        report.plot(png, loss_history, val_history, sp,
                    f"{args.run_name}: {args.sparse_optimizer}, {env.world_size} rank(s), {data_desc['kind']}")
        fv, so = summary["final_validation"], summary["sparsity_overall"]
        val = (f"validation AUC {fv['auc']:.4f}, logloss {fv['logloss']:.4f}" if fv is not None
               else "no validation (--split none)")
        if "touched_rows" in so:
            zeros = (f"of the {so['touched_rows']} embedding rows the data touched: "
                     f"{so['zero_weight_share_touched']:.1%} of weights and "
                     f"{so['zero_row_share_touched']:.1%} of rows are exactly zero (all rows: "
                     f"{so['zero_weight_share']:.1%} / {so['zero_row_share']:.1%})")
        else:   # --zch: slots, not raw ids, are rows
            z = summary["zch"]
            zeros = (f"{z['reset_slots']} slots reset; of all embedding rows "
                     f"{so['zero_weight_share']:.1%} of weights and {so['zero_row_share']:.1%} of "
                     f"rows are exactly zero")
        print(f"done: {steps} steps, final train loss {summary['final_train_loss']:.4f}, {val}; "
              f"{zeros}; {summary['examples_per_s'] or 0:.0f} examples/s"
              + (f" ({summary['steady_examples_per_s']:.0f} after step {steady_from})"
                 if summary["steady_examples_per_s"] else ""), flush=True)
        print(f"wrote {out} and {png}", flush=True)
        ps = summary["step_profile"]
        if ps is not None:
            host = ", ".join(f"{k} {v:.2f}" for k, v in ps["host_ms"].items())
            dev = ", ".join(f"{k} {v:.2f}" for k, v in ps["device_ms"].items()) or "none (CPU)"
            print(f"profile of {ps['steps']} steps (rank 0, ms per step): host {host} (step "
                  f"{ps['host_step_ms']:.2f}); device {dev}; trace {ps['trace']}", flush=True)
    return summary


def summary_fused_params(fused_params: dict) -> dict:
    """``fused_params`` as JSON-friendly values: the optimizer by name, ``optimizer_state_dtypes`` as
    ``"accum=bf16, linear=bf16"`` (:func:`torchrec_ftrl.state_dtype.describe`)."""
    from torchrec_ftrl.state_dtype import describe, parse_state_dtypes
    out = {}
    for k, v in fused_params.items():
        if k == "optimizer":
            v = getattr(v, "name", str(v))
        elif k == "optimizer_state_dtypes":
            v = describe(parse_state_dtypes(v))
        out[k] = v
    return out


def cli_ftrl_registered() -> bool:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    return getattr(EmbOptimType, "FTRL", None) is not None


def main(argv=None) -> dict:
    """Command-line entry point (``python -m torchrec_ftrl.job``, ``examples/train_ctr.py``, the torchx
    component): :func:`run`, except that a bad configuration, a missing or malformed data file and an
    unloadable checkpoint end the process with one line ``train_ctr: error: ...`` on stderr and exit
    status 2 (no traceback). Returns the summary dict (every rank)."""
    from torchrec_ftrl.data import MalformedRowError, NoUsableRowsError
    try:
        return run(argv)
    except (JobConfigError, FileNotFoundError, MalformedRowError, NoUsableRowsError,
            checkpoint.CheckpointError, model_lib.PlanDoesNotFitError) as e:  # one clear line, no traceback
        exit_with_error(str(e))


if __name__ == "__main__":
    main()
