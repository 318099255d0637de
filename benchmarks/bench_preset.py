#!/usr/bin/env python3
"""The job at MLPerf DLRM-DCNv2's shape on one GPU (``--preset mlperf-dcnv2``), side by side in one call.

    source .gpu/setup.sh && python3 benchmarks/bench_preset.py --out $OUT

Runs, in this order, each in a fresh process, until ``--budget-s`` (320) is spent (later runs are
then recorded as skipped; ``--skip 1,2,3,4`` runs the rest in a second call):

1. ``--plan-only`` of the full preset (204M rows at D=128) for FTRL fp32 state, FTRL bf16 state and
   row-wise Adagrad, on one H200 (139 GiB) + 128 GiB host: the JSON line of each;
2. the job with FTRL fp32 state at the full preset: it must refuse (exit 2, one line) before
   allocating; the line is recorded;
3. row-wise Adagrad at the full preset (all in HBM), batch 8,192 and 65,536;
4. the preset scaled to ``--scale`` of its rows (default 0.25: 51M rows, FTRL fp32 state 78 GB, all
   in HBM): FTRL fp32 with ``--kernel-warmup off`` and ``on``, each with an empty Triton cache of its
   own (``TRITON_CACHE_DIR``: a fresh machine's first run), row-wise Adagrad, at 8,192; FTRL
   (warm-up on) and row-wise Adagrad at 65,536;
5. ``bench_host.py`` (the TBE's host cost per step at B=64 against FBGEMM's);
6. at the scaled shape, 65,536: one profiled FTRL run (``--profile-steps 5``, 40 steps) and FTRL
   bf16 state;
7. FTRL bf16 state at the full preset, 65,536, if its plan fits (tables HBM cannot hold go to
   ``fused_uvm_caching``);
8. side by side at the scaled shape (the largest that TorchRec's example plans into one GPU: its
   planner assumes 32 GiB of HBM), at each of ``--batches``: row-wise Adagrad, each ``--lean`` layout,
   and TorchRec's ``dlrm_main.py`` itself (``bench_torchrec_dlrm.py --random-data``: DCN, the same
   tables, ``--adagrad`` (EXACT_ADAGRAD tables), its own random multi-hot batches, as the job's
   runs draw theirs) when ``.anchor/torchrec_dlrm/dlrm_main.py`` is present; then the first
   ``--lean`` layout profiled at the large batch (``--profile-steps 5``, 40 steps). On one H200
   this step takes about 10 minutes: give it calls of its own (``--skip 1,2,3,4,5,6,7,9
   --budget-s 560``; runs the budget cuts are recorded as such);
9. the lean row layouts at the full preset (docs/row-layouts.md): ``--plan-only`` of each, then, side
   by side, row-wise Adagrad and each FTRL layout whose plan fits, at 8,192 and 65,536 (``--lean``
   picks the layouts: default derived weights with bf16 z and n, 512 B a row, and derived weights
   with a row-wise fp32 n, 516 B).

``--dense-precision`` is passed to every job run (default: the job's CUDA default,
``CUDA_DEFAULT_DENSE_PRECISION``, bf16) and recorded; TorchRec's ``dlrm_main.py`` has no precision
flag, so at ``tf32`` it runs with ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` (cuBLAS TF32 from outside)
and at ``bf16`` it is recorded as not run. ``--compile-dense`` and ``--dense-cuda-graphs`` are
passed to every job run (default: the job's ``auto``) and recorded. ``--repeats N`` runs each of
steps 8 and 9's job runs N times in a row (``_r1`` .. ``_rN``); the report then gives, per run, the steady rate's mean and its spread
((max - min) / mean), and each FTRL run's steady rate over row-wise Adagrad's of the same repeat.

Every job run: ``--steps`` (300) steps, synthetic multi-hot input drawn on the GPU, no validation
until the end (one batch), ``--no-progress``. Recorded per run: ``examples_per_s`` (every step),
``steady_examples_per_s`` (after step 10), the ratio of the two, ``peak_gpu_memory_bytes``
(``torch.cuda.max_memory_allocated``), wall seconds of the process, the plan's compute kernels, and
the step profile when profiled. Writes ``--out/bench_preset.json`` and ``bench_preset.md`` after
every run (so a cut-short call still leaves its results).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANCHOR = os.path.join(REPO, ".anchor", "torchrec_dlrm", "dlrm_main.py")
sys.path.insert(0, REPO)
from torchrec_ftrl.job.dense_precision import CUDA_DEFAULT_DENSE_PRECISION, DENSE_PRECISIONS  # noqa: E402
from torchrec_ftrl.job.cli import COMPILE_DENSE, DENSE_CUDA_GRAPHS  # noqa: E402


def _env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


class Bench:
    def __init__(self, args):
        self.args, self.t0, self.rows = args, time.monotonic(), []
        self.result = {"what": "torchrec_ftrl job at the MLPerf DLRM-DCNv2 preset, one GPU",
                       "command": " ".join(sys.argv), "steps": args.steps, "scale": args.scale,
                       "dense_precision": args.dense_precision, "compile_dense": args.compile_dense,
                       "dense_cuda_graphs": args.dense_cuda_graphs, "repeats": args.repeats,
                       "runs": self.rows, "versions": _versions()}
        os.makedirs(args.out, exist_ok=True)

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def run(self, name, cmd, env=None, timeout=None, parse=None):
        row = {"name": name, "cmd": " ".join(cmd)}
        if self.left() < 20:
            row["status"] = "skipped (time budget)"
        else:
            t = time.monotonic()
            try:
                p = subprocess.run(cmd, cwd=REPO, env=_env(env), capture_output=True, text=True,
                                   timeout=min(timeout or 1e9, max(20.0, self.left())))
                row.update(rc=p.returncode, wall_s=round(time.monotonic() - t, 1),
                           tail=(p.stdout + p.stderr)[-1500:])
                row["status"] = "ok" if p.returncode == 0 else f"exit {p.returncode}"
                if parse is not None:
                    row.update(parse(p))
            except subprocess.TimeoutExpired:
                row.update(status="timeout", wall_s=round(time.monotonic() - t, 1))
        self.rows.append(row)
        self.write()
        print(f"[{time.monotonic() - self.t0:6.0f}s] {name}: {row['status']}", flush=True)
        return row

    def job(self, name, flags, batch, env=None, steps=None):
        out = os.path.join(self.args.out, "runs")
        cmd = [sys.executable, "-m", "torchrec_ftrl.job", "--preset", "mlperf-dcnv2", "--batch-size",
               str(batch), "--steps", str(steps or self.args.steps), "--eval-every", "1000000",
               "--val-batches", "1", "--no-progress", "--output-dir", out, "--run-name", name, *flags]
        cmd += ["--dense-precision", self.args.dense_precision, "--compile-dense", self.args.compile_dense,
                "--dense-cuda-graphs", self.args.dense_cuda_graphs]

        def parse(p):
            path = os.path.join(out, f"{name}_summary.json")
            if p.returncode != 0 or not os.path.exists(path):
                return {}
            with open(path) as f:
                s = json.load(f)
            ex, st = s.get("examples_per_s"), s.get("steady_examples_per_s")
            return {"batch": batch, "examples_per_s": ex, "steady_examples_per_s": st,
                    "whole_over_steady": (ex / st) if ex and st else None,
                    "peak_gpu_memory_bytes": s.get("peak_gpu_memory_bytes"),
                    "kernels": sorted({v.split(" ")[0] for v in s.get("plan", {}).values()}),
                    "dense_precision": s.get("dense_precision"),
                    "compile_dense": s.get("compile_dense"),
                    "dense_cuda_graphs": s.get("dense_cuda_graphs"),
                    "steady_kernel_events": s.get("steady_kernel_events"),
                    "first_steps_host_s": s.get("first_steps_host_s"),
                    "steady_sync_s": s.get("steady_sync_s"),
                    "dense_graph_calls": s.get("dense_graph_calls"),
                    "kernel_warmup_s": s.get("kernel_warmup_s"),
                    "kernel_warmup_tbes": s.get("kernel_warmup_tbes"),
                    "step_profile": s.get("step_profile")}
        return self.run(name, cmd, env=env, parse=parse)

    def write(self):
        with open(os.path.join(self.args.out, "bench_preset.json"), "w") as f:
            json.dump(self.result, f, indent=1)
        lines = ["# bench_preset: the job at the MLPerf DLRM-DCNv2 preset", "",
                 f"`{self.result['command']}`; {self.result['versions']}", "",
                 "| run | status | batch | examples/s | steady examples/s | whole/steady | peak GPU GB | wall s |",
                 "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in self.rows:
            def f(k, fmt="{:,.0f}"):
                v = r.get(k)
                return fmt.format(v) if isinstance(v, (int, float)) else "-"
            peak = r.get("peak_gpu_memory_bytes")
            lines.append(f"| {r['name']} | {r['status']} | {f('batch')} | {f('examples_per_s')} | "
                         f"{f('steady_examples_per_s')} | {f('whole_over_steady', '{:.2f}')} | "
                         f"{peak / 1e9 if peak else '-'} | {f('wall_s', '{:.0f}')} |")
        lines += spread_lines(self.rows)
        lines += ratio_lines(self.rows)
        lines += ["", "Plans, refusals, profiles and the tail of every run: bench_preset.json."]
        with open(os.path.join(self.args.out, "bench_preset.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


def _versions() -> str:
    import torch
    out = [f"torch {torch.__version__}"]
    try:
        import torchrec
        out.append(f"torchrec {getattr(torchrec, '__version__', '?')}")
    except Exception:   # noqa: BLE001 - report what is there
        pass
    if torch.cuda.is_available():
        out.append(torch.cuda.get_device_name(0))
    return ", ".join(out)


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/bench_preset"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--scale", type=float, default=0.25, help="--rows-scale of the scaled runs")
    ap.add_argument("--budget-s", type=float, default=320.0,
                    help="seconds: no run starts later, and a run is cut at this point")
    ap.add_argument("--batches", default="8192,65536",
                    help="comma list; its first is the small batch, its last the large one")
    ap.add_argument("--dense-precision", choices=DENSE_PRECISIONS, default=CUDA_DEFAULT_DENSE_PRECISION,
                    help="every job run's --dense-precision (default: the job's CUDA default)")
    ap.add_argument("--compile-dense", choices=COMPILE_DENSE, default="auto",
                    help="every job run's --compile-dense (default: the job's auto)")
    ap.add_argument("--dense-cuda-graphs", choices=DENSE_CUDA_GRAPHS, default="auto",
                    help="every job run's --dense-cuda-graphs (default: the job's auto)")
    ap.add_argument("--repeats", type=_at_least_one, default=1,
                    help="runs of each of steps 8 and 9's job runs")
    ap.add_argument("--skip", default="", help="comma list of step numbers (1-9) to leave out")
    ap.add_argument("--lean", default="ftrl_derived_bf16,ftrl_derived_rowwise",
                    help=f"steps 8 and 9's layouts, from {sorted(LEAN)}")
    ap.add_argument("--lean-batches", default=None, help="step 9's batches (default: --batches)")
    return ap


def _at_least_one(text: str) -> int:
    """``--repeats``: an integer >= 1 (argparse reports the value otherwise)."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _plan_json(p):
    """A ``--plan-only`` run's row fields: its last output line as ``plan`` (none if not JSON)."""
    try:
        return {"plan": json.loads(p.stdout.strip().splitlines()[-1])}
    except (ValueError, IndexError):
        return {}


RWA = ["--sparse-optimizer", "rowwise_adagrad"]   # the job flags of row-wise Adagrad


class PresetSteps:
    """The nine steps of the module docstring, in order (``in_order()``), sharing the ``Bench``, the
    flags, the two batch sizes of ``--batches`` and the plans read so far."""

    def __init__(self, b, a):
        self.b, self.a = b, a
        self.batches = [int(x) for x in a.batches.split(",") if x]
        self.small, self.big = self.batches[0], self.batches[-1]
        self.scaled = ["--rows-scale", str(a.scale)]
        self.lean = [x for x in a.lean.split(",") if x]   # steps 8 and 9
        self.plans = {}
        self.layouts = {"ftrl_fp32": [], "ftrl_bf16": ["--ftrl-state-dtype", "bf16"],
                        "rowwise_adagrad": RWA, **LEAN}

    def in_order(self):
        """The steps' methods, step 1 first."""
        return (self.plan_only, self.full_ftrl_refusal, self.full_rowwise_adagrad, self.scaled_runs,
                self.host_cost, self.scaled_profile_and_bf16, self.full_ftrl_bf16, self.scaled_side_by_side,
                self.full_lean_layouts)

    def plan(self, name):
        """``--plan-only`` of the full preset for layout ``name``; its plan into ``plans``."""
        row = self.b.run(f"plan-only {name}", [sys.executable, "-m", "torchrec_ftrl.job", "--preset",
                                               "mlperf-dcnv2", "--plan-only", *self.layouts[name]],
                         parse=_plan_json)
        self.plans[name] = row.get("plan")

    def fits(self, name) -> bool:
        """Whether the plan read for ``name`` fits the machine."""
        return bool((self.plans.get(name) or {}).get("fits"))

    def not_run(self, name, why):
        """Record run ``name`` as not run, with the reason (the status ``not run: WHY``)."""
        self.b.rows.append({"name": name, "status": f"not run: {why}"})

    def plan_only(self):
        """Step 1: ``--plan-only`` of the full preset for every layout."""
        for name in self.layouts:
            self.plan(name)

    def full_ftrl_refusal(self):
        """Step 2: FTRL fp32 state at the full preset, which must refuse before allocating."""
        self.b.run("full preset, ftrl fp32 (must refuse)",
                   [sys.executable, "-m", "torchrec_ftrl.job", "--preset", "mlperf-dcnv2", "--steps", "1",
                    "--no-progress", "--output-dir", os.path.join(self.a.out, "runs")], timeout=120)

    def full_rowwise_adagrad(self):
        """Step 3: row-wise Adagrad at the full preset, at both batch sizes."""
        for batch in (self.small, self.big):
            self.b.job(f"full_rowwise_adagrad_{batch}", RWA, batch)

    def scaled_runs(self):
        """Step 4: the scaled preset: FTRL with kernel warm-up off and on (each with an empty Triton
        cache) and row-wise Adagrad at the small batch; FTRL and row-wise Adagrad at the large one."""
        b, scaled, small, big = self.b, self.scaled, self.small, self.big
        for mode in ("off", "on"):
            with tempfile.TemporaryDirectory() as cache:   # an empty Triton cache: a fresh machine
                b.job(f"scaled_ftrl_warmup_{mode}_{small}", [*scaled, "--kernel-warmup", mode], small,
                      env={"TRITON_CACHE_DIR": cache})
        b.job(f"scaled_rowwise_adagrad_{small}", [*scaled, *RWA], small)
        b.job(f"scaled_ftrl_{big}", scaled, big)
        b.job(f"scaled_rowwise_adagrad_{big}", [*scaled, *RWA], big)

    def host_cost(self):
        """Step 5: ``bench_host.py``, the TBE's host cost per step."""
        host_out = os.path.join(self.a.out, "bench_host")
        self.b.run("bench_host.py", [sys.executable, os.path.join("benchmarks", "bench_host.py"), "--out",
                                     host_out, "--rounds", "5"], timeout=150,
                   parse=lambda p: {"bench_host": _read_json(os.path.join(host_out, "bench_host.json"))})

    def scaled_profile_and_bf16(self):
        """Step 6: the scaled preset at the large batch: one profiled FTRL run, and FTRL bf16 state."""
        big = self.big
        self.b.job(f"scaled_ftrl_profiled_{big}", [*self.scaled, "--profile-steps", "5"], big, steps=40)
        self.b.job(f"scaled_ftrl_bf16_{big}", [*self.scaled, "--ftrl-state-dtype", "bf16"], big)

    def full_ftrl_bf16(self):
        """Step 7: FTRL bf16 state at the full preset, large batch, if its plan fits."""
        if "ftrl_bf16" not in self.plans:
            self.plan("ftrl_bf16")
        if self.fits("ftrl_bf16"):
            self.b.job(f"full_ftrl_bf16_{self.big}", ["--ftrl-state-dtype", "bf16"], self.big)
        else:
            self.not_run(f"full_ftrl_bf16_{self.big}", "its plan does not fit")

    def scaled_side_by_side(self):
        """Step 8: side by side at the scaled preset, at both batch sizes: row-wise Adagrad (unless
        step 4 ran it), each ``--lean`` layout and TorchRec's ``dlrm_main.py``; then the first layout
        profiled at the large batch."""
        b, scaled = self.b, self.scaled
        for batch in self.batches:
            for r in range(1, self.a.repeats + 1):
                tag = f"_r{r}" if self.a.repeats > 1 else ""
                if tag or not any(x["name"] == f"scaled_rowwise_adagrad_{batch}" for x in b.rows):
                    b.job(f"scaled_rowwise_adagrad_{batch}{tag}", [*scaled, *RWA], batch)
                for name in self.lean:
                    b.job(f"scaled_{name}_{batch}{tag}", [*scaled, *LEAN[name]], batch)
            if self.a.dense_precision == "bf16":
                self.not_run(f"dlrm_main.py {batch}", "dlrm_main.py has no bf16 dense precision")
            elif os.path.exists(ANCHOR):
                _dlrm_main(b, self.a, batch)
            else:
                self.not_run(f"dlrm_main.py {batch}", f"{ANCHOR} absent (bench_torchrec_dlrm.py --extract)")
        for name in self.lean[:1]:   # the step profile at the large batch
            b.job(f"scaled_{name}_profiled_{self.big}", [*scaled, *LEAN[name], "--profile-steps", "5"],
                  self.big, steps=40)

    def full_lean_layouts(self):
        """Step 9: the ``--lean`` layouts at the full preset: their plans, then row-wise Adagrad and
        each layout whose plan fits, at each of ``--lean-batches``."""
        for name in self.lean:
            self.plan(name)
        for batch in (int(x) for x in (self.a.lean_batches or self.a.batches).split(",")):
            for r in range(1, self.a.repeats + 1):
                tag = f"_r{r}" if self.a.repeats > 1 else ""
                self.b.job(f"full_rowwise_adagrad_{batch}{tag}", RWA, batch)
                for name in self.lean:
                    if self.fits(name):
                        self.b.job(f"full_{name}_{batch}{tag}", LEAN[name], batch)
                    else:
                        self.not_run(f"full_{name}_{batch}{tag}", "its plan does not fit")


def main(argv=None):
    a = build_parser().parse_args(argv)
    b = Bench(a)
    skip = {int(x) for x in a.skip.split(",") if x}
    steps = PresetSteps(b, a)
    for number, step in enumerate(steps.in_order(), 1):
        if number not in skip:
            step()
    b.result["total_s"] = round(time.monotonic() - b.t0, 1)
    b.write()


def _dlrm_main(b, a, batch):
    """TorchRec's example at the scaled preset (DCN, multi-hot, its random batches), ``batch``."""
    from torchrec_ftrl.job.presets import MLPERF_DCNV2_MULTI_HOT, MLPERF_DCNV2_ROWS
    rows = ",".join(str(max(1, math.ceil(n * a.scale))) for n in MLPERF_DCNV2_ROWS)   # as --rows-scale
    hot = ",".join(map(str, MLPERF_DCNV2_MULTI_HOT))
    out = os.path.join(a.out, f"dlrm_main_{batch}")
    b.run(f"dlrm_main.py (DCN, scaled, {batch})",
          [sys.executable, os.path.join("benchmarks", "bench_torchrec_dlrm.py"), "--dlrm-main", ANCHOR,
           "--batch", str(batch), "--steps", str(a.steps), "--warmup", "10", "--random-data",
           "--num-embeddings", rows,
           "--embedding-dim", "128", "--dense-arch", "512,256", "--over-arch", "1024,1024,512,256",
           "--out", out, f"--example-args=--interaction_type=dcn --dcn_num_layers=3 "
           f"--dcn_low_rank_dim=512 --multi_hot_sizes={hot} --multi_hot_distribution_type=uniform"],
          env={"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"} if a.dense_precision == "tf32" else None,
          parse=lambda p: _dlrm_main_row(batch, _read_json(os.path.join(out, "bench_torchrec_dlrm.json"))
                                         if p.returncode == 0 else None))


def spread_lines(rows):
    """The report's lines on repeated runs (names ending ``_rN``): per run name, the repeats' steady
    examples/s, their mean and their spread (max - min) / mean; no lines when nothing repeats."""
    groups = {}
    for r in rows:
        base, _, rep = r["name"].rpartition("_r")
        if base and rep.isdigit() and isinstance(r.get("steady_examples_per_s"), (int, float)):
            groups.setdefault(base, []).append(r["steady_examples_per_s"])
    if not groups:
        return []
    out = ["", "| run (repeats) | steady examples/s of each | mean | spread |", "| --- | --- | ---: | ---: |"]
    for base, v in groups.items():
        mean = sum(v) / len(v)
        out.append(f"| {base} ({len(v)}) | {', '.join(f'{x:,.0f}' for x in v)} | {mean:,.0f} | "
                   f"{100 * (max(v) - min(v)) / mean:.1f}% |")
    return out


_JOB_RUN = re.compile(r"^(scaled|full)_(.+)_(\d+)(_r\d+)?$")   # {shape}_{optimizer}_{batch}[_rN]


def ratio_lines(rows):
    """The report's lines on each FTRL run's steady examples/s over row-wise Adagrad's at the same
    shape, batch and repeat (``scaled_ftrl_derived_rowwise_8192_r2`` over
    ``scaled_rowwise_adagrad_8192_r2``), per run name, repeats in order, and the smallest; no lines
    without such pairs."""
    rate = {r["name"]: r["steady_examples_per_s"] for r in rows
            if isinstance(r.get("steady_examples_per_s"), (int, float))}
    groups = {}
    for name, value in rate.items():
        m = _JOB_RUN.match(name)
        if not m or m.group(2) == "rowwise_adagrad" or m.group(2).endswith("_profiled"):
            continue
        shape, _, batch, tag = m.groups()
        base = rate.get(f"{shape}_rowwise_adagrad_{batch}{tag or ''}")
        if base:
            groups.setdefault(name[:m.start(4)] if tag else name, []).append(value / base)
    if not groups:
        return []
    out = ["", "| run | over row-wise Adagrad of the same repeat | smallest |", "| --- | --- | ---: |"]
    for name, v in groups.items():
        out.append(f"| {name} | {', '.join(f'{x:.2f}x' for x in v)} | {min(v):.2f}x |")
    return out


def _dlrm_main_row(batch, res):
    """The example's figures in the job rows' fields (steady: after step 10, as the job's)."""
    r = (res or {}).get("result") or {}
    ex, st = r.get("examples_per_s"), r.get("steady_examples_per_s")
    return {"batch": batch, "examples_per_s": ex, "steady_examples_per_s": st,
            "whole_over_steady": (ex / st) if ex and st else None, "dlrm_main": res}


# The lean row layouts step 9 can run (job flags), with their bytes per row at D = 128.
LEAN = {
    "ftrl_derived_bf16": ["--ftrl-weights", "derived", "--ftrl-state-dtype", "bf16"],          # 512 B
    "ftrl_derived_rowwise": ["--ftrl-weights", "derived", "--ftrl-accumulator", "rowwise"],    # 516 B
    "ftrl_derived_rowwise_bf16": ["--ftrl-weights", "derived", "--ftrl-accumulator", "rowwise",
                                  "--ftrl-state-dtype", "bf16"],                               # 258 B
}


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    main()
