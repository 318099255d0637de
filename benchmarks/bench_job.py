#!/usr/bin/env python3
"""Throughput of the CTR job (``torchrec_ftrl.job``) on the embedded synthetic source against TorchRec's
binary Criteo layout, for each sparse optimizer: what the data path costs a training step.

    python3 benchmarks/bench_job.py --out DIR                    # 1 GPU (or CPU), every run
    python3 benchmarks/bench_job.py --nproc 2 --out DIR          # 2 processes through torchx
    python3 benchmarks/bench_job.py --device cpu --rows 20000 --steps 5 --batch 256 --out DIR

1. The binary folder: the Criteo sample (``--tsv``; by default ``criteo/criteo_dac_combined.tsv``
   under ``$TORCHREC_FTRL_DATA``, ``shared/data`` or ``../shared/data``, 6,726 labelled rows) is
   converted once with ``python -m torchrec_ftrl.data.preprocess`` and its three arrays are tiled
   with numpy into ``--files`` day triplets (``day_0_{dense,sparse,labels}.npy`` ...) of at least
   ``--rows`` (10,000,000) rows in all, under ``--work-dir`` (outside ``--out``: the folder is
   GBs). A folder already complete for the same sample, rows and files is reused.
2. The job, one process per run (``python -m torchrec_ftrl.job``; with ``--nproc N > 1`` the torchx
   component ``torchrec_ftrl/components.py:train_ctr --nproc N``), with the same model and flags on
   both sources: ``--batch-size`` ``--batch`` (8,192) per process, ``--steps`` (500),
   ``--no-progress``, ``--eval-every`` larger than the run, each sparse optimizer of ``--optimizers``
   (ftrl, rowwise_adagrad); the binary runs also ``--max-val-rows`` (65,536: the end-of-run
   validation set is built before training).
3. The step profile (``--profile-steps`` K = 5, when the job has that flag): the job profiles K steps
   inside its timed loop and exports the trace there, so by default (``--profile-mode separate``)
   each config first runs a short profiled job (K + 5 steps, outputs under ``--work-dir``), which
   also warms Triton's and the page cache, and then the timed run without profiling.
   ``--profile-mode inline`` passes ``--profile-steps`` to the timed runs instead (their examples/s
   then include the profiler); ``off`` runs no profile (a 3-step warm-up run per config instead,
   unless ``--no-warmup-run``).
4. From each timed run's summary JSON: ``examples_per_s`` (steps x batch x processes / training-loop
   time, the job's own figure, first steps included), and ``step_profile`` (per-phase host and
   device ms) when present. Data-path cost = 1 - binary examples/s / synthetic examples/s, per
   optimizer.

Writes ``DIR/bench_job.json`` (after every run) and ``DIR/bench_job.md``; the job's own outputs go to
``DIR/runs/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time

import numpy as np

from torchrec_ftrl.job.cli import compile_words
from torchrec_ftrl.job.profile import PHASES   # the job's step-profile phases, in its order

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join("criteo", "criteo_dac_combined.tsv")
ARRAYS = ("dense", "sparse", "labels")


def default_tsv():
    """The first Criteo sample found: ``$TORCHREC_FTRL_DATA``, ``REPO/shared/data``,
    ``REPO/../shared/data``."""
    roots = [os.environ.get("TORCHREC_FTRL_DATA"), os.path.join(REPO, "shared", "data"),
             os.path.join(REPO, "..", "shared", "data")]
    for r in roots:
        if r and os.path.isfile(os.path.join(r, SAMPLE)):
            return os.path.normpath(os.path.join(r, SAMPLE))
    return None


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tsv", default=None, help="raw Criteo TSV to repeat (default: the sample, see above)")
    p.add_argument("--rows", type=int, default=10_000_000, help="rows of the binary folder, at least")
    p.add_argument("--files", type=int, default=4, help="day triplets the rows are split into")
    p.add_argument("--work-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench_job_data"),
                   help="where the binary folder is built (and reused)")
    p.add_argument("--steps", type=int, default=500, help="steps of each timed run")
    p.add_argument("--batch", "--batch-size", dest="batch", type=int, default=8192,
                   help="samples per process per step")
    p.add_argument("--optimizers", default="ftrl,rowwise_adagrad", help="comma list of the job's sparse optimizers")
    p.add_argument("--sources", default="synthetic,binary", help="comma list of synthetic, binary")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs); > 1 launches through torchx")
    p.add_argument("--profile-steps", type=int, default=5, help="the job's --profile-steps K")
    p.add_argument("--profile-mode", choices=("separate", "inline", "off"), default="separate",
                   help="separate: a short profiled run before each timed run; inline: profile inside "
                        "the timed run; off: no profile")
    p.add_argument("--max-val-rows", type=int, default=65536, help="binary runs: the job's --max-val-rows")
    p.add_argument("--job-args", default="", help="more flags for every run of the job (one string)")
    p.add_argument("--no-warmup-run", action="store_true",
                   help="--profile-mode inline/off: skip the 3-step warm-up run before each timed run")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run of the job")
    p.add_argument("--out", default="outputs/bench_job")
    a = p.parse_args(argv)
    # the runs start in the checkout: paths given relative to this directory must not move
    a.out, a.work_dir = os.path.abspath(a.out), os.path.abspath(a.work_dir)
    a.tsv = os.path.abspath(a.tsv) if a.tsv else None
    a.optimizer_list = [x for x in a.optimizers.split(",") if x]
    a.source_list = [x for x in a.sources.split(",") if x]
    bad = [s for s in a.source_list if s not in ("synthetic", "binary")]
    if bad or not a.source_list:
        p.error(f"--sources: {bad or a.source_list} not in synthetic, binary")
    for name in ("rows", "files", "steps", "batch", "nproc"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    return a


# ------------------------------------------------------------------------------ the binary folder

def tile_plan(n_sample, rows, files):
    """``(copies per file, rows per file, total rows)``: every file holds the same whole number of
    copies of the sample, and the files together hold at least ``rows`` rows."""
    per_file = max(1, math.ceil(math.ceil(rows / n_sample) / files))
    return per_file, per_file * n_sample, per_file * n_sample * files


def _save_atomic(path, arr):
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    with open(tmp, "wb") as fh:
        np.lib.format.write_array(fh, arr, allow_pickle=False)
    os.replace(tmp, path)


def tile_arrays(arrays, folder, copies, files):
    """Write ``files`` triplets ``day_K_{dense,sparse,labels}.npy`` into ``folder``, each ``copies``
    copies of ``arrays`` (``{"dense", "sparse", "labels"}`` -> 2-D array, equal row counts), labels
    last. Returns the rows written."""
    os.makedirs(folder, exist_ok=True)
    total = 0
    for k in range(files):
        for kind in ARRAYS:   # labels last: a triplet is complete once its labels exist
            _save_atomic(os.path.join(folder, f"day_{k}_{kind}.npy"), np.tile(arrays[kind], (copies, 1)))
        total += copies * arrays["labels"].shape[0]
    return total


def build_binary(args, log):
    """The binary folder for ``args`` (built, or reused when its marker matches). Returns
    ``(folder, info dict)``."""
    tsv = args.tsv or default_tsv()
    if not tsv or not os.path.isfile(tsv):
        raise SystemExit(f"bench_job: the Criteo sample is not at {args.tsv or SAMPLE!r} under "
                         f"$TORCHREC_FTRL_DATA, shared/data or ../shared/data; give --tsv")
    stem = os.path.basename(tsv).rsplit(".", 1)[0]
    key = dict(tsv=os.path.abspath(tsv), tsv_bytes=os.path.getsize(tsv), rows=args.rows, files=args.files)
    folder = os.path.join(args.work_dir, f"{stem}_x{args.rows}_f{args.files}")
    marker = os.path.join(folder, ".bench_job.json")
    if os.path.isfile(marker):
        with open(marker) as fh:
            info = json.load(fh)
        if info.get("key") == key and all(os.path.isfile(os.path.join(folder, f"day_{k}_{a}.npy"))
                                          for k in range(args.files) for a in ARRAYS):
            log(f"binary folder {folder}: reused ({info['rows']:,} rows in {args.files} files)")
            return folder, dict(info, reused=True)
    t0 = time.perf_counter()
    sample_dir = os.path.join(args.work_dir, f"{stem}_sample")
    cmd = [sys.executable, "-m", "torchrec_ftrl.data.preprocess", tsv, "--out", sample_dir, "--no-progress"]
    p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"bench_job: {' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    t_convert = time.perf_counter() - t0
    prefix = os.path.basename(tsv)
    for ext in (".gz",):
        prefix = prefix[:-len(ext)] if prefix.endswith(ext) else prefix
    for ext in (".tsv", ".txt", ".csv"):
        prefix = prefix[:-len(ext)] if prefix.endswith(ext) else prefix
    arrays = {a: np.load(os.path.join(sample_dir, f"{prefix}_{a}.npy")) for a in ARRAYS}
    n = arrays["labels"].shape[0]
    copies, per_file, total = tile_plan(n, args.rows, args.files)
    t1 = time.perf_counter()
    if os.path.isfile(marker):
        os.remove(marker)
    written = tile_arrays(arrays, folder, copies, args.files)
    t_tile = time.perf_counter() - t1
    info = dict(key=key, folder=folder, sample_rows=n, copies_per_file=copies, rows_per_file=per_file,
                rows=written, files=args.files, convert_s=t_convert, tile_s=t_tile,
                bytes=sum(os.path.getsize(os.path.join(folder, f"day_{k}_{a}.npy"))
                          for k in range(args.files) for a in ARRAYS))
    with open(marker, "w") as fh:
        json.dump(info, fh, indent=1)
    log(f"binary folder {folder}: preprocess of {n:,} rows {t_convert:.1f} s, tiled to {written:,} rows in "
        f"{args.files} files ({info['bytes'] / 1e9:.2f} GB) in {t_tile:.1f} s")
    return folder, dict(info, reused=False)


# ------------------------------------------------------------------------------------- the job

def _env():
    """This environment with the interpreter's bin folder first on PATH (torchx finds torchrun there)
    and the checkout on PYTHONPATH (so ``-m torchrec_ftrl...`` imports this checkout)."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    pp = [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x]
    if REPO not in pp:
        env["PYTHONPATH"] = os.pathsep.join(pp + [REPO])
    env.pop("TORCHREC_FTRL_FAULT", None)
    return env


def gpu_name():
    """The first GPU's name from nvidia-smi (this process creates no CUDA context), else "cuda"."""
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
        names = [x.strip() for x in p.stdout.splitlines() if x.strip()]
        return names[0] if p.returncode == 0 and names else "cuda"
    except (OSError, subprocess.SubprocessError):
        return "cuda"


def job_has_flag(flag):
    """Whether the job's parser knows ``flag`` (e.g. ``--profile-steps``)."""
    sys.path.insert(0, REPO)
    try:
        from torchrec_ftrl.job import cli
        return flag in cli.build_parser()._option_string_actions
    finally:
        sys.path.remove(REPO)


def job_argv(args, source, optimizer, folder, run_name, steps, profile, output_dir):
    argv = ["--batch-size", str(args.batch), "--steps", str(steps), "--no-progress",
            "--eval-every", str(10 ** 9), "--sparse-optimizer", optimizer, "--device", args.device,
            "--output-dir", output_dir, "--run-name", run_name]
    if source == "binary":
        argv += ["--data", folder, "--max-val-rows", str(args.max_val_rows)]
    else:
        argv += ["--val-batches", "1"]
    if profile:
        argv += ["--profile-steps", str(profile)]
    return argv + shlex.split(args.job_args)


def launch(args, argv):
    """Run the job; returns ``(returncode, wall s, command, output)``."""
    if args.nproc > 1:
        cmd = [sys.executable, "-m", "torchx.cli.main", "run", "-s", "local_cwd",
               "torchrec_ftrl/components.py:train_ctr", "--nproc", str(args.nproc), "--", *argv]
    else:
        cmd = [sys.executable, "-m", "torchrec_ftrl.job", *argv]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=args.timeout)
        rc, out = p.returncode, (p.stdout or "") + (p.stderr or "")
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timed out after {args.timeout} s\n{e.stdout or ''}{e.stderr or ''}"
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
    return rc, time.perf_counter() - t0, cmd, out


def _summary(rc, path):
    """The summary JSON a run wrote, or None (failed run, or no file)."""
    if rc != 0 or not os.path.isfile(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def read_profile(summary):
    """``step_profile`` of a summary as ``{"steps", "host_ms", "device_ms"}``, or None when absent or
    malformed."""
    sp = summary.get("step_profile") if isinstance(summary, dict) else None
    if not isinstance(sp, dict):
        return None
    host, dev = sp.get("host_ms"), sp.get("device_ms")
    step = sp.get("host_step_ms")
    return dict(steps=sp.get("steps"), host_ms=host if isinstance(host, dict) else {},
                device_ms=dev if isinstance(dev, dict) else {},
                host_step_ms=step if isinstance(step, (int, float)) else None)


def data_path_cost(results):
    """``{optimizer: 1 - binary examples/s / synthetic examples/s}`` where both ran."""
    out = {}
    for opt in sorted({r["optimizer"] for r in results}):
        by = {r["source"]: r.get("examples_per_s") for r in results if r["optimizer"] == opt}
        if by.get("synthetic") and by.get("binary"):
            out[opt] = 1.0 - by["binary"] / by["synthetic"]
    return out


def binary_desc(binary) -> str:
    """The binary folder's sentence of the report ('' when no binary source ran)."""
    if not binary or "sample_rows" not in binary:
        return ""
    return (f"Binary folder: the Criteo sample ({binary['sample_rows']:,} rows) tiled to "
            f"{binary.get('rows', 0):,} rows in {binary.get('files', '?')} day files. ")


def markdown(meta, results):
    cost = data_path_cost(results)
    md = [f"CTR job throughput, {meta['nproc']} process(es) on {meta['device']}; batch {meta['batch']:,} per "
          f"process, {meta['steps']} steps, the job's default model "
          f"({' '.join(meta['job_args']) or 'no extra flags'}). " + binary_desc(meta.get('binary'))
          + "examples/s: the job's summary "
          f"(steps x batch x processes / training-loop time, first steps included); steady: the "
          f"job's steady_examples_per_s (the steps after the first 10). Data-path cost = "
          f"1 - binary / synthetic examples/s.", "",
          "| sparse optimizer | data | examples/s | steady examples/s | train time s | data-path cost | "
          "wall s (whole run) |",
          "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        ex = r.get("examples_per_s")
        c = cost.get(r["optimizer"]) if r["source"] == "binary" else None
        st = r.get("steady_examples_per_s")
        md.append(f"| {r['optimizer']} | {r['source']} | {f'{ex:,.0f}' if ex else 'failed'} | "
                  f"{f'{st:,.0f}' if st else ''} | "
                  f"{r.get('train_time_s') or float('nan'):.2f} | {'' if c is None else f'{100 * c:.1f}%'} | "
                  f"{r['wall_s']:.1f} |")
    prof = [r for r in results if r.get("step_profile")]
    if prof:
        phases = list(PHASES) + sorted({k for r in prof for k in list(r["step_profile"]["host_ms"])
                                        + list(r["step_profile"]["device_ms"]) if k not in PHASES})
        where = ("a separate short run of the same config before the timed one" if meta["profile_mode"] == "separate"
                 else "the timed run itself")
        md += ["", f"Step profile (the job's --profile-steps {meta['profile_steps']}, from {where}): ms per "
               f"step of each phase, host / device; host step = the profiled steps' host wall time per "
               f"step. Device phases overlap each other and the host.", "",
               "| sparse optimizer | data | steps | host step | " + " | ".join(phases) + " |",
               "|---|---|---:|---:|" + "---:|" * len(phases)]
        for r in prof:
            sp = r["step_profile"]

            def cell(ph):
                h, d = sp["host_ms"].get(ph), sp["device_ms"].get(ph)
                f = lambda x: "–" if not isinstance(x, (int, float)) else f"{x:.2f}"  # noqa: E731
                return f"{f(h)} / {f(d)}"
            hs = sp.get("host_step_ms")
            md.append(f"| {r['optimizer']} | {r['source']} | {sp.get('steps', '?')} | "
                      f"{'–' if hs is None else f'{hs:.2f}'} | " + " | ".join(cell(ph) for ph in phases) + " |")
    elif results:
        md += ["", "No step profile (--profile-mode off, the job has no --profile-steps, or it wrote none)."]
    return "\n".join(md)


def _quoted(cmd) -> str:
    """``cmd`` (a list of arguments) as one shell-quoted string."""
    return " ".join(shlex.quote(c) for c in cmd)


def profiled_run(args, row, name, folder, profile, log) -> None:
    """``--profile-mode separate``: a short run (``profile`` + 5 steps, outputs under
    ``--work-dir``) of ``row``'s config with the job's ``--profile-steps profile``; its run and step
    profile go to ``row``, its summary to ``DIR/runs/NAME_profile_summary.json``."""
    optimizer, source = row["optimizer"], row["source"]
    prof_dir = os.path.join(args.work_dir, "profile_runs")
    argv_ = job_argv(args, source, optimizer, folder, f"{name}_profile", profile + 5, profile, prof_dir)
    rc, wall, cmd, out = launch(args, argv_)
    summary = _summary(rc, os.path.join(prof_dir, f"{name}_profile_summary.json"))
    row["profile_run"] = dict(returncode=rc, wall_s=wall, steps=profile + 5, command=_quoted(cmd))
    row["step_profile"] = read_profile(summary) if summary else None
    log(f"[{optimizer} / {source}] profiled run ({profile + 5} steps): exit {rc}, {wall:.1f} s"
        + ("" if row["step_profile"] else "; no step profile"))
    if summary is None:
        log(out[-3000:])
    else:
        with open(os.path.join(args.out, "runs", f"{name}_profile_summary.json"), "w") as fh:
            json.dump(summary, fh, indent=1)


def warmup_run(args, row, name, folder, log) -> None:
    """A 3-step run of ``row``'s config before the timed one (outputs under ``--work-dir``)."""
    optimizer, source = row["optimizer"], row["source"]
    prof_dir = os.path.join(args.work_dir, "profile_runs")
    rc, wall, cmd, out = launch(args, job_argv(args, source, optimizer, folder, f"{name}_warmup",
                                               min(args.steps, 3), 0, prof_dir))
    log(f"[{optimizer} / {source}] warm-up run (3 steps): exit {rc}, {wall:.1f} s")
    if rc != 0:
        log(out[-3000:])


def timed_run(args, row, name, folder, inline, log) -> None:
    """The timed run of ``row``'s config (``--steps`` steps, outputs under ``DIR/runs``; ``inline``:
    the job's ``--profile-steps``, 0 for none): its figures from the summary into ``row``, or
    ``row["error"]`` (the output's tail) when it wrote none."""
    optimizer, source = row["optimizer"], row["source"]
    runs_dir = os.path.join(args.out, "runs")
    argv_ = job_argv(args, source, optimizer, folder, name, args.steps, inline, runs_dir)
    rc, wall, cmd, out = launch(args, argv_)
    row.update(returncode=rc, wall_s=wall, command=_quoted(cmd))
    summary = _summary(rc, os.path.join(runs_dir, f"{name}_summary.json"))
    if summary is None:
        row["error"] = out[-3000:]
        log(f"[{optimizer} / {source}] FAILED (exit {rc}, {wall:.1f} s):\n{out[-3000:]}")
        return
    row.update(examples_per_s=summary.get("examples_per_s"), train_time_s=summary.get("train_time_s"),
               steady_examples_per_s=summary.get("steady_examples_per_s"),
               steps=summary.get("steps"), world_size=summary.get("world_size"),
               device=summary.get("device"), plan=summary.get("plan"),
               dense_precision=summary.get("dense_precision"), compile_dense=summary.get("compile_dense"),
               dense_cuda_graphs=summary.get("dense_cuda_graphs"),
               reader=(summary.get("data") or {}).get("reader"))
    if inline:
        row["step_profile"] = read_profile(summary)
    msg = (f"[{optimizer} / {source}] {row['examples_per_s'] or 0:,.0f} examples/s, steady "
           f"{row['steady_examples_per_s'] or 0:,.0f} "
           f"(dense {row['dense_precision']}"
           f"{compile_words(row['compile_dense'], bool(row['dense_cuda_graphs']))}, "
           f"train time {row['train_time_s'] or 0:.2f} s, run {wall:.1f} s)")
    if row.get("step_profile"):
        msg += "; step profile host ms " + json.dumps(
            {k: round(v, 3) for k, v in row["step_profile"]["host_ms"].items()
             if isinstance(v, (int, float))})
    log(msg)


def run_config(args, optimizer, source, folder, profile, log) -> dict:
    """One sparse optimizer on one source: the profiled run (``--profile-mode separate``) or the
    warm-up run (unless ``--no-warmup-run``), then the timed run. ``profile``: the job's
    ``--profile-steps`` (0: no profile). Returns the config's row."""
    name = f"{source}_{optimizer}_n{args.nproc}"
    row = dict(optimizer=optimizer, source=source, nproc=args.nproc)
    inline = profile if args.profile_mode == "inline" else 0
    if profile and args.profile_mode == "separate":
        profiled_run(args, row, name, folder, profile, log)
    elif not args.no_warmup_run:
        warmup_run(args, row, name, folder, log)
    timed_run(args, row, name, folder, inline, log)
    return row


def write_report(args, meta, results, lines, t_start) -> str:
    """Write ``DIR/bench_job.json`` (``meta`` with the wall time since ``t_start`` and the data-path
    cost, the results and the log ``lines``) and ``DIR/bench_job.md`` (the report, then the log);
    returns the report."""
    meta["total_s"] = time.perf_counter() - t_start
    meta["data_path_cost"] = data_path_cost(results)
    with open(os.path.join(args.out, "bench_job.json"), "w") as fh:
        json.dump(dict(meta, results=results, log=lines), fh, indent=1)
    text = markdown(meta, results)
    with open(os.path.join(args.out, "bench_job.md"), "w") as fh:
        fh.write(text + "\n\n```\n" + "\n".join(lines) + "\n```\n")
    return text


def main(argv=None) -> int:
    args = parse(argv)
    t_start = time.perf_counter()
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    os.makedirs(os.path.join(args.work_dir, "profile_runs"), exist_ok=True)
    import torch   # no CUDA context here: the runs are other processes
    use_cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    device = gpu_name() if use_cuda else "cpu"
    want = args.profile_steps if args.profile_mode != "off" else 0
    profile = want if want > 0 and job_has_flag("--profile-steps") else 0
    if want > 0 and not profile:
        log("the job has no --profile-steps flag: runs without a step profile")
    folder, binfo = (None, {})
    if "binary" in args.source_list:
        folder, binfo = build_binary(args, log)
    meta = dict(device=device, nproc=args.nproc, batch=args.batch, steps=args.steps,
                job_args=shlex.split(args.job_args), binary=binfo, profile_steps=profile,
                profile_mode=args.profile_mode if profile else "off",
                torch=torch.__version__)
    results = []
    for optimizer in args.optimizer_list:
        for source in args.source_list:
            results.append(run_config(args, optimizer, source, folder, profile, log))
            write_report(args, meta, results, lines, t_start)
    text = write_report(args, meta, results, lines, t_start)
    print(text)
    for opt, c in data_path_cost(results).items():
        log(f"data-path cost ({opt}): {100 * c:.1f}%")
    log(f"bench_job: {time.perf_counter() - t_start:.1f} s")
    write_report(args, meta, results, lines, t_start)
    return 1 if any("error" in r for r in results) else 0

if __name__ == "__main__":
    sys.exit(main())
