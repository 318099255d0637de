#!/usr/bin/env python3
"""Anchor: throughput of TorchRec's own DLRM training example (``torchrec_dlrm/dlrm_main.py`` of
github.com/facebookresearch/dlrm, which TorchRec's ``examples/dlrm`` points to), run unmodified on
the binary Criteo folder our job reads, to report beside ``bench_job.py``'s figures.

    # once: the example's folder from a snapshot of the dlrm repository (a bare git dir), into the
    # ignored .anchor/ (the one-liner it runs: mkdir -p .anchor && git --git-dir=GITDIR archive
    # HEAD torchrec_dlrm | tar -x -C .anchor)
    python3 benchmarks/bench_torchrec_dlrm.py --extract /work/.mirror/facebookresearch+dlrm/repo
    # the run (GPU; --binary-dir left out: the folder bench_job.py builds, built here if missing)
    python3 benchmarks/bench_torchrec_dlrm.py --dlrm-main .anchor/torchrec_dlrm/dlrm_main.py \\
        --binary-dir DIR --device cuda --batch 8192 --steps 500 --num-embeddings 100000 \\
        --embedding-dim 64 --out DIR
    # CPU smoke run; --print-cmd prints the launch and the example's flags, and runs nothing
    python3 benchmarks/bench_torchrec_dlrm.py --dlrm-main .anchor/torchrec_dlrm/dlrm_main.py \\
        --device cpu --rows 60000 --files 2 --batch 512 --steps 20 --num-embeddings 1000 --out DIR

1. The data. With ``--random-data`` none: the example draws its own random batches (its
   ``RandomRecDataset``, multi-hot with ``--multi_hot_sizes`` among ``--example-args``). Otherwise
   the example reads ``DAYS`` = 24 day triplets (``torchrec.datasets.criteo.DAYS``):
   it trains on ``day_0`` .. ``day_22`` and validates / tests on the first / second half of
   ``day_23``, all loaded into memory (``InMemoryBinaryCriteoIterDataPipe``, no ``--mmap_mode``),
   ids taken modulo ``--num_embeddings``. A ``--binary-dir`` that holds all 24 is used as it is.
   Otherwise (``bench_job.py``'s folder: ``--files`` triplets ``day_0`` .. ``day_{K-1}``, K < 24)
   a view of it is made under ``--days-dir``: ``day_0`` .. ``day_{K-1}`` are symlinks to the K
   triplets (the same training rows in the same order as our job's), ``day_K`` .. ``day_22`` are
   empty arrays (0 rows, the same columns and dtypes), and ``day_23`` is a small copy of the first
   2 x batch x processes rows of ``day_{K-1}`` (one validation and one test batch per process).
   Without ``--binary-dir`` the folder is built with ``bench_job.build_binary`` (``--tsv``,
   ``--rows``, ``--files``, ``--work-dir``: the same defaults, so the same folder is reused).
2. The launch: ``python -m torch.distributed.run --standalone --nproc_per_node N`` runs this file
   as a worker (``--worker``), which imports ``--dlrm-main`` as a module (its folder first on
   ``sys.path``, as when it runs as a script), wraps two of its names from outside, and calls its
   ``main(argv)``. Its flags: ``--in_memory_binary_criteo_path`` (the view), ``--batch_size``,
   ``--epochs 1``, ``--limit_train_batches`` ``--steps``, ``--limit_val_batches 1``,
   ``--limit_test_batches 1``, ``--num_embeddings`` (or ``--num_embeddings_per_feature`` for a
   comma list), ``--embedding_dim``, ``--dense_arch_layer_sizes`` = ``--dense-arch`` +
   [embedding_dim], ``--over_arch_layer_sizes`` = ``--over-arch`` + [1] (our job's meaning and
   defaults for those two), ``--learning_rate``, ``--adagrad`` (``--optimizer adagrad``, the
   default; ``sgd`` leaves it out), ``--print_sharding_plan``, ``--pin_memory`` on CUDA (our job
   pins on CUDA too), and ``--example-args`` appended. ``--device cpu`` hides the GPUs
   (``CUDA_VISIBLE_DEVICES=``; the example picks ``cuda:LOCAL_RANK`` / NCCL whenever CUDA is
   available, else CPU / gloo) and sets ``OMP_NUM_THREADS`` to ``--cpu-threads`` (1, as our job's
   ``--cpu-threads``: torch's default thread count oversubscribes small machines, 13x slower on
   2 cores here).
3. What is timed, in each process: the example's ``_train`` (the one epoch's training loop over
   ``--steps`` batches, ``TrainPipelineSparseDist.progress`` + ``lr_scheduler.step`` + its tqdm
   bar per batch) from entry to return, with ``torch.cuda.synchronize()`` at both ends; excluded
   are imports, the in-memory load of the arrays, the model build, planning, DMP and the
   pipeline's construction (all before ``_train``), and validation / test (after it). examples/s
   = steps x batch x processes / the slowest process's ``_train`` time, first steps (the
   pipeline's fill) included, as in our job's ``examples_per_s``. Also the steady-state figure:
   from the end of the ``--warmup``-th training ``progress`` call (one synchronize there) to the
   end of ``_train``, (steps - warmup) x batch x processes / that time. Steps are counted by
   wrapping ``progress`` (a subclass put in the module's ``TrainPipelineSparseDist`` name), only
   while ``_train`` runs, and checked against the example's own "Total number of iterations".

Packages the example imports beyond TorchRec's own: ``torchmetrics`` (AUROC; with
``lightning_utilities``), ``tqdm``, ``pyre_extensions``; ``torchrec.datasets.criteo`` needs
``iopath``. They are checked before the launch.

Writes ``--out/bench_torchrec_dlrm.json`` (examples/s, steps, batch, model, flags, versions, the
example's commit and sha256, what was timed, its output's tail), ``.md`` (one table line) and
``dlrm_main.log`` (the example's whole output: its sharding plan, tqdm bar, AUROCs).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.dirname(os.path.abspath(__file__))
DAYS = 24                       # torchrec.datasets.criteo.DAYS: day_0..day_22 train, day_23 val + test
ARRAYS = ("dense", "sparse", "labels")
EXTRA_MODULES = ("torchmetrics", "lightning_utilities", "tqdm", "pyre_extensions", "iopath")
ANCHOR_DIR = os.path.join(REPO, ".anchor")
TIMED = ("the example's _train (one epoch of --steps TrainPipelineSparseDist.progress calls, "
         "lr_scheduler.step and its tqdm bar), torch.cuda.synchronize() at entry and return; setup "
         "(imports, in-memory load, model, planner, DMP, pipeline) and validation/test excluded")


def _repo_on_path():
    for p in (REPO, BENCH):
        if p not in sys.path:
            sys.path.insert(0, p)


def job_defaults():
    """Our job's ``--dense-arch`` / ``--over-arch`` defaults (``torchrec_ftrl/job/cli.py``)."""
    _repo_on_path()
    from torchrec_ftrl.job import cli
    acts = cli.build_parser()._option_string_actions
    return acts["--dense-arch"].default, acts["--over-arch"].default


def parse(argv=None):
    dense_d, over_d = job_defaults()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--extract", metavar="GITDIR", default=None,
                   help="only extract torchrec_dlrm/ from this bare git dir (HEAD) into --anchor-dir")
    p.add_argument("--anchor-dir", default=ANCHOR_DIR, help="where --extract puts torchrec_dlrm/")
    p.add_argument("--dlrm-main", default=os.path.join(ANCHOR_DIR, "torchrec_dlrm", "dlrm_main.py"),
                   help="an unmodified torchrec_dlrm/dlrm_main.py")
    p.add_argument("--random-data", action="store_true",
                   help="the example's own random input (its RandomRecDataset: no data path given, "
                        "multi-hot with --example-args '--multi_hot_sizes ...'); no data folder is built")
    p.add_argument("--binary-dir", default=None,
                   help="folder of day_{i}_{dense,sparse,labels}.npy (default: bench_job.py's, built if missing)")
    p.add_argument("--tsv", default=None, help="no --binary-dir: bench_job.py's --tsv")
    p.add_argument("--rows", type=int, default=10_000_000, help="no --binary-dir: bench_job.py's --rows")
    p.add_argument("--files", type=int, default=4, help="no --binary-dir: bench_job.py's --files")
    p.add_argument("--work-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench_job_data"),
                   help="no --binary-dir: bench_job.py's --work-dir")
    p.add_argument("--days-dir", default=None,
                   help="where the 24-day view is made (default: WORK_DIR/torchrec_dlrm_days)")
    p.add_argument("--batch", type=int, default=8192, help="samples per process per step")
    p.add_argument("--steps", type=int, default=500, help="training batches (--limit_train_batches)")
    p.add_argument("--warmup", type=int, default=50, help="steps before the steady-state window")
    p.add_argument("--num-embeddings", default="100000", help="rows per table: one int or 26 comma ints")
    p.add_argument("--embedding-dim", type=int, default=64)
    p.add_argument("--dense-arch", default=dense_d, help="bottom MLP hidden sizes (embedding_dim appended)")
    p.add_argument("--over-arch", default=over_d, help="top MLP hidden sizes (1 appended)")
    p.add_argument("--optimizer", choices=("adagrad", "sgd"), default="adagrad",
                   help="the example's optimizer, sparse and dense (adagrad: its --adagrad)")
    p.add_argument("--learning-rate", type=float, default=0.05)
    p.add_argument("--example-args", default="", help="more flags for dlrm_main.py (one string)")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="--device cpu: OMP_NUM_THREADS per process (our job's --cpu-threads default)")
    p.add_argument("--timeout", type=float, default=900, help="seconds for the example's run")
    p.add_argument("--print-cmd", action="store_true", help="print the command and flags; run nothing")
    p.add_argument("--out", default="outputs/bench_torchrec_dlrm")
    a = p.parse_args(argv)
    for name in ("batch", "steps", "nproc", "embedding_dim", "rows", "files"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        a.tables = [int(x) for x in a.num_embeddings.split(",")]
        a.bottom = [int(x) for x in a.dense_arch.split(",") if x] + [a.embedding_dim]
        a.top = [int(x) for x in a.over_arch.split(",") if x] + [1]
    except ValueError as e:
        p.error(f"--num-embeddings / --dense-arch / --over-arch: {e}")
    if len(a.tables) not in (1, 26):
        p.error(f"--num-embeddings: 1 or 26 values, got {len(a.tables)}")
    a.out, a.work_dir, a.anchor_dir = map(os.path.abspath, (a.out, a.work_dir, a.anchor_dir))
    a.dlrm_main = os.path.abspath(a.dlrm_main)
    a.binary_dir = os.path.abspath(a.binary_dir) if a.binary_dir else None
    a.days_dir = os.path.abspath(a.days_dir or os.path.join(a.work_dir, "torchrec_dlrm_days"))
    return a


# ------------------------------------------------------------------------------ the example's files

def extract(gitdir, anchor_dir):
    """``git archive HEAD torchrec_dlrm`` of ``gitdir`` into ``anchor_dir`` (replacing an older
    copy); writes ``anchor_dir/torchrec_dlrm.commit``. Returns the path of dlrm_main.py."""
    commit = subprocess.run(["git", f"--git-dir={gitdir}", "rev-parse", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()
    os.makedirs(anchor_dir, exist_ok=True)
    shutil.rmtree(os.path.join(anchor_dir, "torchrec_dlrm"), ignore_errors=True)
    p = subprocess.Popen(["git", f"--git-dir={gitdir}", "archive", "--format=tar", "HEAD", "torchrec_dlrm"],
                         stdout=subprocess.PIPE)
    with tarfile.open(fileobj=p.stdout, mode="r|") as tar:
        tar.extractall(anchor_dir, filter="data")
    if p.wait() != 0:
        raise SystemExit(f"bench_torchrec_dlrm: git archive failed in {gitdir}")
    with open(os.path.join(anchor_dir, "torchrec_dlrm.commit"), "w") as fh:
        fh.write(f"github:facebookresearch/dlrm {commit}\n")
    return os.path.join(anchor_dir, "torchrec_dlrm", "dlrm_main.py")


def example_source(dlrm_main):
    """``{"path", "sha256", "commit"}`` of the example (commit from ``--extract``'s note, if any)."""
    with open(dlrm_main, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    note = os.path.join(os.path.dirname(os.path.dirname(dlrm_main)), "torchrec_dlrm.commit")
    commit = open(note).read().strip() if os.path.isfile(note) else None
    return dict(path=dlrm_main, sha256=digest, commit=commit)


def missing_modules():
    """The example's extra imports not found in this interpreter."""
    return [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]


# ------------------------------------------------------------------------------ the 24-day view

def day_path(folder, day, kind):
    return os.path.join(folder, f"day_{day}_{kind}.npy")


def count_days(folder):
    """How many complete triplets ``day_0`` .. ``day_{K-1}`` the folder holds (contiguous)."""
    k = 0
    while all(os.path.isfile(day_path(folder, k, a)) for a in ARRAYS):
        k += 1
    return k


def _link(src, dst):
    if os.path.lexists(dst):
        os.remove(dst)
    os.symlink(src, dst)


def build_days(src, dest, val_rows):
    """The view of ``src`` the example reads (see the module docstring, 1). Returns ``(folder the
    example reads, info dict)``."""
    k = count_days(src)
    if k == 0:
        raise SystemExit(f"bench_torchrec_dlrm: no day_0_{{dense,sparse,labels}}.npy in {src}")
    arrs = {a: [np.load(day_path(src, d, a), mmap_mode="r") for d in range(k)] for a in ARRAYS}
    rows = [int(x.shape[0]) for x in arrs["labels"]]
    if k >= DAYS:
        return src, dict(source=src, view=False, source_days=k, train_rows=sum(rows[:DAYS - 1]),
                         val_test_rows=rows[DAYS - 1])
    os.makedirs(dest, exist_ok=True)
    for d in range(k):
        for a in ARRAYS:
            _link(day_path(src, d, a), day_path(dest, d, a))
    for d in range(k, DAYS - 1):
        for a in ARRAYS:
            like = arrs[a][0]
            out = day_path(dest, d, a)
            if os.path.lexists(out):
                os.remove(out)
            np.save(out, np.empty((0,) + like.shape[1:], dtype=like.dtype))
    n_val = min(val_rows, rows[-1])
    for a in ARRAYS:
        out = day_path(dest, DAYS - 1, a)
        if os.path.lexists(out):
            os.remove(out)
        np.save(out, np.ascontiguousarray(arrs[a][-1][:n_val]))
    return dest, dict(source=src, view=True, source_days=k, train_rows=sum(rows), empty_days=DAYS - 1 - k,
                      val_test_rows=n_val, val_test_from=f"first {n_val} rows of day_{k - 1}")


# ------------------------------------------------------------------------------------- the run

def example_argv(args, data_dir):
    """dlrm_main.py's flags for ``args`` (see the module docstring, 2); ``data_dir`` None: no data
    path, so the example draws its own random batches."""
    join = lambda xs: ",".join(str(x) for x in xs)  # noqa: E731
    argv = [] if data_dir is None else ["--in_memory_binary_criteo_path", data_dir]
    argv += ["--batch_size", str(args.batch), "--epochs", "1",
            "--limit_train_batches", str(args.steps), "--limit_val_batches", "1", "--limit_test_batches", "1",
            "--embedding_dim", str(args.embedding_dim), "--dense_arch_layer_sizes", join(args.bottom),
            "--over_arch_layer_sizes", join(args.top), "--learning_rate", str(args.learning_rate),
            "--print_sharding_plan"]
    argv += (["--num_embeddings", str(args.tables[0])] if len(args.tables) == 1
             else ["--num_embeddings_per_feature", join(args.tables)])
    if args.optimizer == "adagrad":
        argv.append("--adagrad")
    if args.device == "cuda":
        argv.append("--pin_memory")
    return argv + shlex.split(args.example_args)


def interaction(ex_argv) -> str:
    """The example's ``--interaction_type`` among its flags (its default: ``original``, the dot
    product)."""
    for i, a in enumerate(ex_argv):
        if a.startswith("--interaction_type"):
            return a.split("=", 1)[1] if "=" in a else ex_argv[i + 1]
    return "original (dot)"


def launch_cmd(args, timing_dir, ex_argv):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
            os.path.abspath(__file__), "--worker", timing_dir, args.dlrm_main, str(args.warmup), "--", *ex_argv]


def launch_env(args):
    env = dict(os.environ)
    pp = [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x]
    env["PYTHONPATH"] = os.pathsep.join(pp + ([REPO] if REPO not in pp else []))
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        if args.cpu_threads > 0:
            env["OMP_NUM_THREADS"] = str(args.cpu_threads)
    return env


def run_example(args, cmd):
    """Run it; returns ``(returncode, wall s, output)``."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=launch_env(args), capture_output=True, text=True,
                           timeout=args.timeout)
        rc, out = p.returncode, (p.stdout or "") + (p.stderr or "")
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timed out after {args.timeout} s\n{e.stdout or ''}{e.stderr or ''}"
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
    return rc, time.perf_counter() - t0, out


def read_timings(timing_dir, nproc):
    """Each process's timing record (``rank{r}.json``), or None when one is missing."""
    recs = []
    for r in range(nproc):
        path = os.path.join(timing_dir, f"rank{r}.json")
        if not os.path.isfile(path):
            return None
        with open(path) as fh:
            recs.append(json.load(fh))
    return recs


def throughput(recs, batch):
    """examples/s over the whole ``_train`` and over the steady-state window (slowest process)."""
    world = len(recs)
    steps = min(r["steps"] for r in recs)
    train_s = max(r["train_s"] for r in recs)
    res = dict(steps=steps, world_size=world, train_time_s=train_s,
               examples_per_s=steps * batch * world / train_s if steps and train_s > 0 else None,
               setup_s=max(r["setup_s"] for r in recs), after_train_s=max(r["after_train_s"] for r in recs))
    warm = [r.get("steady_s") for r in recs]
    if all(w is not None for w in warm):
        n = steps - recs[0]["warmup"]
        res.update(steady_steps=n, steady_time_s=max(warm),
                   steady_examples_per_s=n * batch * world / max(warm) if n > 0 else None)
    return res


def example_iterations(out):
    """The count the example prints at the end of its training loop ("Total number of
    iterations: N"), or None."""
    m = re.findall(r"Total number of iterations: (\d+)", out)
    return int(m[-1]) if m else None


def versions():
    import torch
    out = dict(python=sys.version.split()[0], torch=torch.__version__, numpy=np.__version__)
    for m in ("torchrec", "fbgemm_gpu", "torchmetrics"):
        try:
            out[m] = __import__(m).__version__
        except Exception:  # noqa: BLE001 - absent or broken: recorded as such
            out[m] = None
    return out


def device_name(args):
    if args.device == "cpu":
        return "cpu"
    _repo_on_path()
    from bench_job import gpu_name
    return gpu_name()


MD_HEADER = ("| run | device x processes | batch | steps | optimizer | model | examples/s (_train) | "
             "examples/s (steady) |\n|---|---|---:|---:|---|---|---:|---:|")


def markdown(res):
    """One table line (``MD_HEADER`` heads it)."""
    m, r = res["model"], res["result"]
    ex = lambda x: f"{x:,.0f}" if x else "failed"  # noqa: E731
    return (f"| TorchRec DLRM example (dlrm_main.py @ {(res['example'].get('commit') or '?').split()[-1][:9]}) "
            f"| {res['device']} x{r.get('world_size', res['nproc'])} | {res['batch']:,} | {r.get('steps', 0)} | "
            f"{res['optimizer']} (lr {res['learning_rate']}) | D={m['embedding_dim']}, rows {m['num_embeddings']}, "
            f"bottom {m['bottom']}, top {m['top']} | {ex(r.get('examples_per_s'))} | "
            f"{ex(r.get('steady_examples_per_s'))} (after {res['warmup']} steps) |")


def resolve_data(args, log):
    """``(source folder, folder the example reads, info)``; builds bench_job's folder if needed."""
    src, built = args.binary_dir, None
    if src is None:
        _repo_on_path()
        from bench_job import build_binary
        src, built = build_binary(args, log)
    data_dir, info = build_days(src, args.days_dir, 2 * args.batch * args.nproc)
    if built:
        info["bench_job_folder"] = built
    if info["train_rows"] < args.steps * args.batch * args.nproc:
        log(f"warning: {info['train_rows']:,} training rows < steps x batch x processes: fewer steps run")
    return src, data_dir, info


def main(argv=None) -> int:
    args = parse(argv)
    if args.extract:
        path = extract(args.extract, args.anchor_dir)
        print(f"extracted: {path}")
        return 0
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    if not os.path.isfile(args.dlrm_main):
        raise SystemExit(f"bench_torchrec_dlrm: no {args.dlrm_main}; run with --extract GITDIR first")
    timing_dir = os.path.join(args.out, "timing")
    if args.print_cmd:
        data_dir = None if args.random_data else (
            args.binary_dir if args.binary_dir and count_days(args.binary_dir) >= DAYS else args.days_dir)
        cmd = launch_cmd(args, timing_dir, example_argv(args, data_dir))
        pre = f"CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS={args.cpu_threads} " if args.device == "cpu" else ""
        print(pre + " ".join(shlex.quote(c) for c in cmd))
        print("dlrm_main.py flags:\n  " + " ".join(shlex.quote(c) for c in example_argv(args, data_dir)))
        miss = missing_modules()
        print("missing modules: " + (", ".join(miss) if miss else "none"))
        return 0
    miss = missing_modules()
    if miss:
        raise SystemExit(f"bench_torchrec_dlrm: dlrm_main.py needs {', '.join(miss)} (not installed)")
    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(timing_dir, ignore_errors=True)
    os.makedirs(timing_dir)
    if args.random_data:
        data_dir, data_info = None, dict(kind="random", note="dlrm_main.py's RandomRecDataset")
        log("data: the example's own random batches")
    else:
        src, data_dir, data_info = resolve_data(args, log)
        log(f"data: {data_dir} ({data_info['train_rows']:,} training rows from {data_info['source_days']} "
            f"day file(s) of {src})")
    ex_argv = example_argv(args, data_dir)
    cmd = launch_cmd(args, timing_dir, ex_argv)
    log("run: " + " ".join(shlex.quote(c) for c in cmd))
    rc, wall, out = run_example(args, cmd)
    recs = read_timings(timing_dir, args.nproc) if rc == 0 else None
    result = throughput(recs, args.batch) if recs else dict(error=out[-4000:])
    result.update(returncode=rc, wall_s=wall, example_iterations=example_iterations(out))
    with open(os.path.join(args.out, "dlrm_main.log"), "w") as fh:
        fh.write(out)
    res = dict(bench="bench_torchrec_dlrm", device=device_name(args), nproc=args.nproc, batch=args.batch,
               cpu_threads=args.cpu_threads if args.device == "cpu" else None,
               steps=args.steps, warmup=args.warmup, optimizer=args.optimizer, learning_rate=args.learning_rate,
               model=dict(num_embeddings=args.num_embeddings, embedding_dim=args.embedding_dim,
                          bottom=args.bottom, top=args.top, interaction=interaction(ex_argv)),
               example=example_source(args.dlrm_main), example_argv=ex_argv,
               command=" ".join(shlex.quote(c) for c in cmd), data=data_info, timed=TIMED,
               versions=versions(), result=result, per_rank=recs, output_tail=out[-4000:], log=lines)
    with open(os.path.join(args.out, "bench_torchrec_dlrm.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    line = markdown(res)
    with open(os.path.join(args.out, "bench_torchrec_dlrm.md"), "w") as fh:
        fh.write(MD_HEADER + "\n" + line + "\n\n" + f"examples/s (_train): {TIMED}; steps x batch x "
                 "processes / the slowest process's time. steady: from the end of step --warmup.\n")
    print(line)
    if rc != 0 or not recs:
        print(f"bench_torchrec_dlrm: the example failed (exit {rc}):\n{out[-4000:]}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------ the worker

def worker(argv) -> int:
    """Inside torchrun: ``--worker TIMING_DIR DLRM_MAIN WARMUP -- FLAGS...``. Imports the example,
    wraps its ``_train`` and ``TrainPipelineSparseDist`` names from outside, runs ``main(FLAGS)`` and
    writes ``TIMING_DIR/rank{RANK}.json``."""
    t_start = time.perf_counter()
    timing_dir, dlrm_main, warmup = argv[0], os.path.abspath(argv[1]), int(argv[2])
    flags = argv[argv.index("--") + 1:]
    import torch

    sys.path.insert(0, os.path.dirname(dlrm_main))   # its "from data.dlrm_dataloader import ..." etc.
    spec = importlib.util.spec_from_file_location("dlrm_main", dlrm_main)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["dlrm_main"] = mod
    spec.loader.exec_module(mod)
    clock = dict(training=False, steps=0, t0=None, t_warm=None, t1=None)

    def sync():
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    class CountingPipeline(mod.TrainPipelineSparseDist):
        def progress(self, dataloader_iter):
            out = super().progress(dataloader_iter)
            if clock["training"]:
                clock["steps"] += 1
                if clock["steps"] == warmup:
                    sync()
                    clock["t_warm"] = time.perf_counter()
            return out

    train = mod._train

    def timed_train(*a, **k):
        sync()
        clock.update(training=True, t0=time.perf_counter())
        try:
            return train(*a, **k)
        finally:
            sync()
            clock.update(training=False, t1=time.perf_counter())

    mod.TrainPipelineSparseDist = CountingPipeline
    mod._train = timed_train
    mod.main(flags)
    t_end = time.perf_counter()
    rank = int(os.environ.get("RANK", "0"))
    rec = dict(rank=rank, steps=clock["steps"], warmup=warmup, train_s=clock["t1"] - clock["t0"],
               steady_s=(clock["t1"] - clock["t_warm"]) if clock["t_warm"] is not None else None,
               setup_s=clock["t0"] - t_start, after_train_s=t_end - clock["t1"],
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    with open(os.path.join(timing_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(rec, fh)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2:]))
    sys.exit(main())
