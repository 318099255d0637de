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

import argparse
import collections
import contextlib
import gc
import logging
import os
import threading
import time
import warnings
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from . import (atomic_checkpoint, cli, dense_precision, dist_env, evaluate, faults, layout_flags,
               model as model_lib, pipeline, plan_only, profile as profile_lib, report, sparsity, validate,
               warmup as kernel_warmup, zch)
from .loss_log import LossLog
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
    device_type = "cuda" if cli.cuda_run(args.device) else "cpu"
    args.dense_cuda_graphs = cli.resolve_dense_cuda_graphs(args.dense_cuda_graphs, device_type,
                                                           world_size, args.batch_size)
    validate.check_plan(args, source, fused_params, world_size, local_world, device_type)
    env = dist_env.init(args.device)
    if env.device.type == "cpu" and args.cpu_threads > 0:
        torch.set_num_threads(args.cpu_threads)
    dense_precision.set_matmul_precision(args.dense_precision, env.device.type)
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


class _Job(NamedTuple):
    """What every phase of one run reads (the same on every rank but ``env`` and ``rank0``)."""
    args: argparse.Namespace
    env: dist_env.DistEnv
    rank0: bool
    local_world: int     # ranks on this host (LOCAL_WORLD_SIZE, else the world size)
    source: Any          # the data source: synthetic, text or binary (``make_source``)
    data_desc: dict      # ``{"kind", ...}``: the data as the summary's "data" names it
    fused_params: dict   # the sharders' fused_params (``cli.sparse_fused_params``)
    features: list       # categorical feature names; the table of feature f is "t_f"
    sizes: list          # rows per table (--zch: ZCH slots per table)
    steps: int           # the step the run ends at (--steps, or --epochs over the data)


class _Model(NamedTuple):
    """The sharded model of a run."""
    dmp: Any             # TorchRec's DistributedModelParallel around the DLRM
    opt: Any             # CombinedOptimizer: the fused sparse optimizer and the dense one
    plan: Any            # the ShardingPlan
    evictions: Any       # --zch: the zch.EvictionCounter of dmp; else None
    dense_warmup_s: Optional[float]   # seconds of model.warm_up_dense or graph_dense (None: neither ran)


class _Start(NamedTuple):
    """Where a run's steps start: step 0 with empty histories, or a checkpoint's."""
    step: int
    loss_history: list            # [[step, cross-rank mean loss of the --log-every window], ...]
    val_history: list             # validation metric dicts, each with its "step"
    loss_window: Optional[dict]   # the checkpoint's open --log-every window {"n", "sums"}, or None


class _Timing(NamedTuple):
    """``time.perf_counter`` times of the step loop, in seconds."""
    t0: float                     # before the first step
    train_time: float             # from t0 to the end of the last step's kernels
    steady_from: Optional[int]    # the step after which steady-state timing starts (None: not timed)
    t_steady: Optional[float]     # when step steady_from + 1 started (None: not timed)
    steady_kernel_events: Optional[dict] = None   # _kernel_events over the steady window
    compiled_frames: int = 0      # frames torch.compile compiled from t0 to the end of the last step
    pipeline_fill_s: float = 0.0  # seconds of the loop's fill before t0 (pipeline.SparseDistLoop.fill)
    first_steps_host_s: tuple = ()   # host seconds of each step up to steady_from (no device sync)
    steady_sync_s: Optional[float] = None   # the wait for the device at the steady timer's start


def _run(args, env, fused_params, source, data_desc, rank0) -> dict:
    """One run on this rank once the process group is up: set-up, the steps, the last validation and
    checkpoint, sparsity and (rank 0) the report. Returns the summary dict."""
    torch.manual_seed(args.seed)
    path = _checked_resume_path(args)
    if data_desc["kind"].startswith("synthetic-"):   # drawn on the device: made again on it
        source, data_desc = make_source(args, env.device)
    steps = args.steps
    if args.epochs is not None:
        steps = steps_for_epochs(source, args.epochs, env.world_size, args.batch_size)
    features = source.categorical_names
    sizes = (zch.slots_per_table(args.num_embeddings_list, len(features)) if args.zch
             else source.num_embeddings)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    job = _Job(args, env, rank0, local_world, source, data_desc, fused_params, features, sizes, steps)
    model = _build_model(job)
    # Touched rows are counted from the batches' ids; --zch batches hold raw ids, not rows.
    tracker = sparsity.TouchTracker([] if args.zch else features, [] if args.zch else sizes,
                                    env.device)
    start = (_resume(job, path, model, tracker) if args.resume is not None
             else _Start(0, [], [], None))
    val_batches, train_iter, workers = _data(job, start.step)
    warmup_s, warmed = _kernel_warmup(job, model.dmp)
    if rank0:
        _print_start(job, start.step, workers)
    training = _Training(job, model, tracker, val_batches, start)
    timing = training.run(train_iter)
    training.finish()
    tracker.reduce(env.device)
    sp = sparsity.table_sparsity(model.dmp, env.device, touched=None if args.zch else tracker.masks)
    summary = _summary(job, model, training, timing, sp, warmup_s, warmed)
    if rank0:
        _report(job, summary, sp, timing.steady_from)
    return summary


def _checked_resume_path(args) -> Optional[str]:
    """The checkpoint folder ``--resume`` names (None without it), checked before any work.

    Raises:
        FileNotFoundError: no checkpoint there.
        CheckpointError: its FTRL state dtype is not this run's.
    """
    if args.resume is None:
        return None
    path = atomic_checkpoint.resolve(args.resume, args.checkpoint_dir)
    atomic_checkpoint.check_ftrl_state_dtype(path, atomic_checkpoint.read_meta(path), args.ftrl_state_dtype,
                                             args.sparse_optimizer)
    return path


def _build_model(job: _Job) -> _Model:
    """The DLRM of the run, sharded (``--zch``: with managed collision) with the job's sharders,
    and its optimizer.

    Raises:
        PlanDoesNotFitError: the planner finds no plan within the memory of the ranks.
    """
    import torchrec_ftrl

    args, env = job.args, job.env
    if env.device.type == "cpu":
        _load_cpu_kernel(job.rank0)
    # Derived FTRL weights start at zero, where FTRL starts a row (z = 0): an encoded uniform start
    # would keep |z| above ftrl_l1_reg and train a denser model (docs/row-layouts.md).
    net = model_lib.build_dlrm(job.features, job.sizes, args.embedding_dim, len(job.source.dense_names),
                               args.dense_arch_list, args.over_arch_list, env.device,
                               dcn=(args.dcn_layers, args.dcn_rank) if args.dcn_layers else None,
                               zero_init=layout_flags.derives_weights(args),
                               dense_precision=args.dense_precision)
    if args.compile_dense:
        model_lib.compile_dense(net, args.compile_dense)
    dense_warmup_s = None
    if args.compile_dense or env.device.type == "cuda":
        # Compiles; on CUDA also the libraries' first calls. Before sharding, because a capture
        # empties the allocator's cache: after sharding, the first steps would allocate anew.
        t = time.perf_counter()
        if args.dense_cuda_graphs:
            model_lib.graph_dense(net, args.batch_size)
        else:
            model_lib.warm_up_dense(net, args.batch_size)
        dense_warmup_s = time.perf_counter() - t
    sharders = torchrec_ftrl.sharders(job.fused_params)
    local_world = job.local_world
    tables = [f"t_{f}" for f in job.features]
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
            no_fit_message=lambda: plan_only.no_fit_message(args, job.sizes, env.world_size, hbm, ddr))
    opt = model_lib.build_optimizer(dmp, args.dense_optimizer, args.dense_lr, env.device.type)
    return _Model(dmp, opt, plan, evictions, dense_warmup_s)


def _resume(job: _Job, path: str, model: _Model, tracker: sparsity.TouchTracker) -> _Start:
    """Load the checkpoint at ``path`` into ``model`` and ``tracker``; rank 0 says so.

    Raises:
        CheckpointError: the checkpoint cannot be loaded, or its step is past the run's last step.
    """
    extra = tracker.state_dict()
    model_lib.init_dense_state(model.opt, model.dmp.fused_optimizer)   # keys for Adam's state
    meta = atomic_checkpoint.load(path, model.dmp, model.opt, extra=extra)
    tracker.load_state_dict(extra)
    start_step = int(meta["step"])
    # The TBEs' step counters (one per training step; bf16 FTRL state rounds with them) came back
    # with the optimizer state, as {table}.step; set from the checkpoint's step as well, for a
    # checkpoint that has no such keys, so the resumed run rounds as the uninterrupted one.
    model.dmp.fused_optimizer.set_optimizer_step(start_step)
    if start_step > job.steps:
        raise atomic_checkpoint.CheckpointError(
            f"--resume: the run ends at step {job.steps} (--steps / --epochs), before the step of the "
            f"checkpoint {path} ({start_step})")
    start = _Start(start_step, meta.get("loss_history", []), meta.get("val_history", []),
                   meta.get("loss_window"))
    if job.rank0:
        print(f"resumed from {path} at step {start_step}", flush=True)
    return start


def _data(job: _Job, start_step: int) -> Tuple[list, Any, int]:
    """``(validation batches of this rank, iterator of its training batches from step start_step + 1,
    data workers per rank)``; rank 0 prints the reader's statistics of file data."""
    args, env, source = job.args, job.env, job.source
    # --split none: every row trains, nothing is validated.
    no_split = getattr(getattr(source, "split", None), "mode", None) == "none"
    val_batches = [] if no_split else source.validation_batches(env.rank, env.world_size,
                                                                  args.batch_size)
    if job.rank0 and source.stats() is not None:
        print(f"data: {source.stats().summary()}", flush=True)
    on_device = getattr(source, "on_device", False)   # batches drawn on the device: no workers, no pinning
    workers = 0 if on_device else cli.data_workers(args.data_workers, job.local_world)
    train_iter = train_loader(source, env.rank, env.world_size, args.batch_size, start_step,
                              job.steps - start_step, workers=workers,
                              pin_memory=env.device.type == "cuda" and not on_device)
    return val_batches, train_iter, workers


def _kernel_warmup(job: _Job, dmp) -> Tuple[Optional[float], int]:
    """``(seconds, TBEs warmed up)`` of the kernel warm-up (``(None, 0)`` when it does not run)."""
    args = job.args
    if not kernel_warmup.enabled(args.kernel_warmup, job.env.device):
        return None, 0
    t = time.perf_counter()
    warmed = kernel_warmup.warm_up(dmp, args.batch_size * job.env.world_size,
                                   getattr(job.source, "multi_hot", args.multi_hot_list), args.seed)
    return time.perf_counter() - t, warmed


def _print_start(job: _Job, start_step: int, workers: int) -> None:
    """The line that opens a run: ranks, device, data, tables, optimizers (FTRL's with its state dtype
    and row layout, ``layout={weights}-{accumulator}``; the dense one with ``--dense-precision``),
    steps and batch."""
    args, env = job.args, job.env
    opt_name = args.sparse_optimizer
    if opt_name == "ftrl":
        opt_name += f" (state {args.ftrl_state_dtype}) layout={args.ftrl_weights}-{args.ftrl_accumulator}"
    print(f"train_ctr: {env.world_size} rank(s), {env.device} ({env.backend}), data={job.data_desc['kind']}, "
          f"{len(job.features)} tables x {args.embedding_dim} dims, sparse={opt_name} "
          f"lr={args.sparse_lr}, dense={args.dense_optimizer} lr={args.dense_lr} "
          f"precision={args.dense_precision}"
          f"{cli.compile_words(args.compile_dense, args.dense_cuda_graphs)}, "
          f"steps {start_step}->{job.steps}, batch {args.batch_size}/rank, {workers} data "
          f"worker(s)/rank", flush=True)


class _Training:
    """The steps of one run and what they record: the cross-rank mean loss of every --log-every
    window, validation every --eval-every steps and at the end, checkpoints every
    --checkpoint-every steps and at the end, the tqdm bar and the step profile (rank 0 prints).

    The loss goes to a :class:`~.loss_log.LossLog`: the window's sum stays on the device and its
    cross-rank mean is copied back without a host wait, so the loop launches step after step without
    waiting for the device (it waits at validation, checkpoints and the steady-state timer's start).
    """

    def __init__(self, job: _Job, model: _Model, tracker: sparsity.TouchTracker, val_batches: list,
                 start: _Start) -> None:
        self.job, self.model, self.tracker, self.val_batches = job, model, tracker, val_batches
        self.start_step = start.step
        self.loss_history, self.val_history = start.loss_history, start.val_history
        self.resumed_window = start.loss_window
        self.losses = LossLog(job.env.device, self.loss_history)
        self.loop = self.prof = None
        self.bar = None
        if job.rank0 and not job.args.no_progress:
            from tqdm import tqdm
            self.bar = tqdm(total=job.steps, initial=start.step, desc="train", mininterval=1.0,
                            dynamic_ncols=True)

    def run(self, train_iter) -> _Timing:
        """Train steps ``start_step + 1 .. steps`` on the batches of ``train_iter``."""
        job, env, dmp = self.job, self.job.env, self.model.dmp
        todo = job.steps - self.start_step
        dmp.train()
        self.loop = pipeline.make(job.args.pipeline, dmp, self.model.opt, env.device, train_iter, todo,
                                  (lambda kjt: None) if job.args.zch else self.tracker.update)
        self.prof = self._profiler(todo)
        self._restore_window()
        t_fill = time.perf_counter()
        self.loop.fill()              # the pipeline's set-up and first batches, outside the timed loop
        fill_s = time.perf_counter() - t_fill
        # Steady-state throughput: timed from the end of the first STEADY_AFTER steps of this run (one
        # device sync there), so one-off costs (kernel compiles, first allocations) are left out.
        steady_from = self.start_step + STEADY_AFTER if todo > 2 * STEADY_AFTER else None
        t_steady = events0 = sync_s = None
        frames0 = model_lib.compiled_frames()
        with _setup_heap_frozen():
            t0 = time.perf_counter()
            ends = [t0]   # t0, then perf_counter at the end of each step up to steady_from
            for step in range(self.start_step + 1, job.steps + 1):
                if step - 1 == steady_from:
                    _synchronize(env.device)
                    t_steady = time.perf_counter()
                    sync_s = t_steady - ends[-1]
                    events0 = _kernel_events(env.device)
                loss = self.loop.step()
                faults.maybe_fail(env.rank, step, "step")
                with record_function(profile_lib.METRICS_LABEL):
                    self._record_loss(step, loss, t0)
                self._after_step(step)
                if steady_from is not None and step <= steady_from:
                    ends.append(time.perf_counter())
            _synchronize(env.device)   # the last steps' kernels belong to the training time
            train_time = time.perf_counter() - t0
        self.losses.flush()
        if self.prof is not None:
            self.prof.close()
        if self.bar is not None:
            self.bar.close()
        events = None
        if t_steady is not None and events0 is not None:
            events1 = _kernel_events(env.device)
            events = {k: events1[k] - events0.get(k, 0) for k in sorted(events1)}
        return _Timing(t0, train_time, steady_from, t_steady, events,
                       model_lib.compiled_frames() - frames0, fill_s,
                       tuple(b - a for a, b in zip(ends, ends[1:])), sync_s)

    def finish(self) -> None:
        """Validate at the last step (unless done there) and, with --checkpoint-dir, save it."""
        steps = self.job.steps
        if not self.val_history or self.val_history[-1]["step"] != steps:
            self.evaluate(steps)
        if self.job.args.checkpoint_dir:
            self.save_checkpoint(steps)

    def _profiler(self, todo: int) -> Optional[profile_lib.StepProfiler]:
        """The --profile-steps profiler over the ``todo`` steps of the run (None: off)."""
        args, env = self.job.args, self.job.env
        warmup, active = profile_lib.plan(todo, args.profile_steps)
        if not active:
            return None
        trace = os.path.join(args.output_dir, f"{args.run_name}_trace.json" if self.job.rank0
                             else f"{args.run_name}_trace.rank{env.rank}.json")
        return profile_lib.StepProfiler(active, warmup, env.device, trace, module=self.model.dmp.module)

    def _restore_window(self) -> None:
        """Reopen the checkpoint's --log-every window when it has this rank's sum."""
        env, resumed = self.job.env, self.resumed_window
        if resumed and resumed.get("n") and len(resumed.get("sums", ())) == env.world_size:
            self.losses.restore(resumed["n"], resumed["sums"][env.rank])

    def _record_loss(self, step: int, loss: torch.Tensor, t0: float) -> None:
        """Add the step's loss to the window; close the window every --log-every steps and at the
        end; advance the bar (its loss: the last mean read back)."""
        args, env = self.job.args, self.job.env
        self.losses.add(loss)
        if step % args.log_every == 0 or step == self.job.steps:
            self.losses.close_window(step)
        else:
            self.losses.poll()
        if self.bar is not None:
            rate = (step - self.start_step) * args.batch_size * env.world_size / (time.perf_counter() - t0)
            shown = {"loss": f"{self.loss_history[-1][1]:.4f}"} if self.loss_history else {}
            self.bar.update(1)
            self.bar.set_postfix(**shown, ex_s=f"{rate:.0f}", refresh=False)

    def _after_step(self, step: int) -> None:
        """Validation and checkpoint when their schedules fall on ``step`` (not the last step:
        :meth:`finish` does that one); the profiler's step."""
        args, steps = self.job.args, self.job.steps
        if step % args.eval_every == 0 and step != steps:
            self.evaluate(step)
        if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0 \
                and step != steps:
            self.save_checkpoint(step)
        if self.prof is not None:
            self.prof.step()

    def evaluate(self, step: int) -> None:
        """Validate the model on the validation batches (none: nothing) and record the metrics."""
        if not self.val_batches:
            return
        with record_function(f"{profile_lib.EXCLUDED_PREFIX} validation ##"), \
                self.loop.paused() as model:
            m = evaluate.validate(model, self.val_batches, self.job.env.device)
        m["step"] = step
        self.val_history.append(m)
        self._say(f"step {step}: validation AUC {m['auc']:.4f}  logloss {m['logloss']:.4f}  "
                  f"NE {m['ne']:.4f}  ({m['rows']} rows)")

    def save_checkpoint(self, step: int) -> None:
        """Save the model, optimizer, histories and touched rows at ``step`` (a collective)."""
        args, env, tracker = self.job.args, self.job.env, self.tracker
        self.losses.flush()
        # The open --log-every window (each rank's loss sum so far): a resumed run logs the same means.
        sums = [None] * env.world_size
        dist.all_gather_object(sums, self.losses.open_sum())
        meta = {"loss_history": self.loss_history, "val_history": self.val_history, "args": vars(args),
                "loss_window": {"n": self.losses.window_n, "sums": sums}}
        with record_function(f"{profile_lib.EXCLUDED_PREFIX} checkpoint ##"):
            tracker.reduce(env.device)
            path = atomic_checkpoint.save(args.checkpoint_dir, step, self.model.dmp, self.model.opt, meta,
                                   keep=args.keep_checkpoints, extra=tracker.state_dict())
        self._say(f"step {step}: checkpoint {path}")

    def _say(self, msg: str) -> None:
        """Rank 0: print ``msg`` (through the bar when there is one)."""
        if self.job.rank0:
            (self.bar.write(msg) if self.bar else print(msg, flush=True))


@contextlib.contextmanager
def _setup_heap_frozen():
    """The training loop's garbage-collection setting: one full collection, then ``gc.freeze()``
    moves every object alive after set-up (modules, plan, traced graphs, data, tens of thousands of
    objects) to the collector's permanent generation, so a full collection during the loop traverses
    only the objects the loop made and its pauses do not grow with the set-up's heap. Collection
    stays on (reference cycles made per step are still freed). ``gc.unfreeze()`` on exit, so a
    process that runs the job again can free this run's objects."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _kernel_events(device: torch.device) -> Optional[collections.Counter]:
    """On CUDA, the Triton TBE's counts so far in this process: ``kernel_variants``
    (:func:`torchrec_ftrl.kernels.cuda.launch.variant_count`) and the training lookups by path
    (``python_forward`` ... ``cpp_backward``: :func:`torchrec_ftrl.kernels.cuda.host.stats`); None
    on other devices or without Triton."""
    if device.type != "cuda":
        return None
    try:
        from torchrec_ftrl.kernels.cuda import host, launch
    except ImportError:
        return None
    out = host.stats()
    out["kernel_variants"] = launch.variant_count()
    return out


def _synchronize(device: torch.device) -> None:
    """Wait for the device's kernels (CUDA; nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _summary(job: _Job, model: _Model, training: _Training, timing: _Timing, sp: Dict[str, dict],
             warmup_s: Optional[float], warmed: int) -> dict:
    """The run's summary dict (``<run-name>_summary.json``); ``sp``: :func:`sparsity.table_sparsity`.
    Every rank calls it (``--zch`` sums the evicted slots over the ranks)."""
    args, env, source, steps = job.args, job.env, job.source, job.steps
    start_step = training.start_step
    loss_history, val_history = training.loss_history, training.val_history
    done = steps - start_step
    examples_per_step = args.batch_size * env.world_size
    t0, train_time, steady_from, t_steady, steady_events, frames, fill_s, first_s, sync_s = timing
    return {
        "run_name": args.run_name,
        "world_size": env.world_size, "device": str(env.device), "backend": env.backend,
        "data": {**job.data_desc, "reader": source.stats().to_dict() if source.stats() else None},
        "sparse_optimizer": args.sparse_optimizer,
        "fused_params": summary_fused_params(job.fused_params),
        "ftrl_state_dtype": args.ftrl_state_dtype if args.sparse_optimizer == "ftrl" else None,
        "ftrl_registered": cli_ftrl_registered(),
        "dense_precision": args.dense_precision,
        "compile_dense": args.compile_dense, "dense_cuda_graphs": args.dense_cuda_graphs,
        "dense_warmup_s": model.dense_warmup_s,
        "dense_graph_calls": model_lib.dense_graph_calls(model.dmp.module),
        "compiled_frames_in_loop": frames,
        "dense_optimizer_options": model_lib.dense_optimizer_options(args.dense_optimizer, env.device.type),
        "steps": steps, "start_step": start_step, "batch_size_per_rank": args.batch_size,
        "examples_per_s": done * examples_per_step / train_time if done else None,
        "train_time_s": train_time, "pipeline_fill_s": fill_s,
        "first_steps_host_s": list(first_s), "steady_sync_s": sync_s,
        "steady_examples_per_s": ((steps - steady_from) * examples_per_step
                                  / (t0 + train_time - t_steady) if t_steady is not None else None),
        "final_train_loss": loss_history[-1][1] if loss_history else None,
        "final_validation": val_history[-1] if val_history else None,
        "validation_history": val_history,
        "loss_history": loss_history,
        "sparsity_overall": sparsity.overall(sp),
        "sparsity": sp,
        "plan": model_lib.plan_summary(model.plan),
        "pipeline": args.pipeline,
        "zch": ({"slots_per_table": job.sizes, "eviction_interval": args.zch_eviction_interval,
                 "reset_slots": int(_sum_over_ranks(model.evictions.evicted, env.device))}
                if args.zch else None),
        "step_profile": training.prof.result if training.prof is not None else None,
        "steady_kernel_events": steady_events,
        "kernel_warmup_s": warmup_s, "kernel_warmup_tbes": warmed,
        "peak_gpu_memory_bytes": (torch.cuda.max_memory_allocated(env.device)
                                  if env.device.type == "cuda" else None),
        "args": vars(args),
    }


def _report(job: _Job, summary: dict, sp: Dict[str, dict], steady_from: Optional[int]) -> None:
    """Rank 0: write the summary JSON and the plot, and print the closing lines."""
    args, env, steps = job.args, job.env, job.steps
    out = os.path.join(args.output_dir, f"{args.run_name}_summary.json")
    png = os.path.join(args.output_dir, f"{args.run_name}.png")
    report.write_summary(out, summary)
    report.plot(png, summary["loss_history"], summary["validation_history"], sp,
                f"{args.run_name}: {args.sparse_optimizer}, {env.world_size} rank(s), {job.data_desc['kind']}")
    fv = summary["final_validation"]
    val = (f"validation AUC {fv['auc']:.4f}, logloss {fv['logloss']:.4f}" if fv is not None
           else "no validation (--split none)")
    print(f"done: {steps} steps, final train loss {summary['final_train_loss']:.4f}, {val}; "
          f"{_zeros_text(summary)}; {summary['examples_per_s'] or 0:.0f} examples/s"
          + (f" ({summary['steady_examples_per_s']:.0f} after step {steady_from})"
             if summary["steady_examples_per_s"] else ""), flush=True)
    print(f"wrote {out} and {png}", flush=True)
    ps = summary["step_profile"]
    if ps is not None:
        host = ", ".join(f"{k} {v:.2f}" for k, v in ps["host_ms"].items())
        dev = ", ".join(f"{k} {v:.2f}" for k, v in ps["device_ms"].items()) or "none (CPU)"
        print(f"profile of {ps['steps']} steps (rank 0, ms per step): host {host} (step "
              f"{ps['host_step_ms']:.2f}); device {dev}; trace {ps['trace']}", flush=True)


def _zeros_text(summary: dict) -> str:
    """The closing line's part on exactly-zero weights and rows (among touched rows; --zch: of all
    rows, with the reset slots)."""
    so = summary["sparsity_overall"]
    if "touched_rows" in so:
        return (f"of the {so['touched_rows']} embedding rows the data touched: "
                f"{so['zero_weight_share_touched']:.1%} of weights and "
                f"{so['zero_row_share_touched']:.1%} of rows are exactly zero (all rows: "
                f"{so['zero_weight_share']:.1%} / {so['zero_row_share']:.1%})")
    z = summary["zch"]   # --zch: slots, not raw ids, are rows
    return (f"{z['reset_slots']} slots reset; of all embedding rows "
            f"{so['zero_weight_share']:.1%} of weights and {so['zero_row_share']:.1%} of "
            f"rows are exactly zero")


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
            atomic_checkpoint.CheckpointError, model_lib.PlanDoesNotFitError) as e:  # one clear line, no traceback
        exit_with_error(str(e))


if __name__ == "__main__":
    main()
