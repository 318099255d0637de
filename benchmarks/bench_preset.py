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
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANCHOR = os.path.join(REPO, ".anchor", "torchrec_dlrm", "dlrm_main.py")


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/bench_preset"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--scale", type=float, default=0.25, help="--rows-scale of the scaled runs")
    ap.add_argument("--budget-s", type=float, default=320.0,
                    help="seconds: no run starts later, and a run is cut at this point")
    ap.add_argument("--batches", default="8192,65536")
    ap.add_argument("--skip", default="", help="comma list of step numbers (1-9) to leave out")
    ap.add_argument("--lean", default="ftrl_derived_bf16,ftrl_derived_rowwise",
                    help=f"steps 8 and 9's layouts, from {sorted(LEAN)}")
    ap.add_argument("--lean-batches", default=None, help="step 9's batches (default: --batches)")
    a = ap.parse_args(argv)
    b = Bench(a)
    skip = {int(x) for x in a.skip.split(",") if x}
    small, big = (int(x) for x in a.batches.split(","))
    scaled = ["--rows-scale", str(a.scale)]
    lean = [x for x in a.lean.split(",") if x]   # steps 8 and 9

    def plan_json(p):
        try:
            return {"plan": json.loads(p.stdout.strip().splitlines()[-1])}
        except (ValueError, IndexError):
            return {}
    plans = {}
    layouts = {"ftrl_fp32": [], "ftrl_bf16": ["--ftrl-state-dtype", "bf16"],
               "rowwise_adagrad": ["--sparse-optimizer", "rowwise_adagrad"], **LEAN}

    def plan(name):
        row = b.run(f"plan-only {name}", [sys.executable, "-m", "torchrec_ftrl.job", "--preset",
                                          "mlperf-dcnv2", "--plan-only", *layouts[name]], parse=plan_json)
        plans[name] = row.get("plan")
    if 1 not in skip:
        for name in layouts:
            plan(name)
    if 2 not in skip:
        b.run("full preset, ftrl fp32 (must refuse)",
              [sys.executable, "-m", "torchrec_ftrl.job", "--preset", "mlperf-dcnv2", "--steps", "1",
               "--no-progress", "--output-dir", os.path.join(a.out, "runs")], timeout=120)
    rwa = ["--sparse-optimizer", "rowwise_adagrad"]
    if 3 not in skip:
        for batch in (small, big):
            b.job(f"full_rowwise_adagrad_{batch}", rwa, batch)
    if 4 not in skip:
        for mode in ("off", "on"):
            with tempfile.TemporaryDirectory() as cache:   # an empty Triton cache: a fresh machine
                b.job(f"scaled_ftrl_warmup_{mode}_{small}", [*scaled, "--kernel-warmup", mode], small,
                      env={"TRITON_CACHE_DIR": cache})
        b.job(f"scaled_rowwise_adagrad_{small}", [*scaled, *rwa], small)
        b.job(f"scaled_ftrl_{big}", scaled, big)
        b.job(f"scaled_rowwise_adagrad_{big}", [*scaled, *rwa], big)
    if 5 not in skip:
        host_out = os.path.join(a.out, "bench_host")
        b.run("bench_host.py", [sys.executable, os.path.join("benchmarks", "bench_host.py"), "--out",
                                host_out, "--rounds", "5"], timeout=150,
              parse=lambda p: {"bench_host": _read_json(os.path.join(host_out, "bench_host.json"))})
    if 6 not in skip:
        b.job(f"scaled_ftrl_profiled_{big}", [*scaled, "--profile-steps", "5"], big, steps=40)
        b.job(f"scaled_ftrl_bf16_{big}", [*scaled, "--ftrl-state-dtype", "bf16"], big)
    if 7 not in skip:
        if "ftrl_bf16" not in plans:
            plan("ftrl_bf16")
        if (plans.get("ftrl_bf16") or {}).get("fits"):
            b.job(f"full_ftrl_bf16_{big}", ["--ftrl-state-dtype", "bf16"], big)
        else:
            b.rows.append({"name": f"full_ftrl_bf16_{big}", "status": "not run: its plan does not fit"})
    if 8 not in skip:
        for batch in (small, big):
            if not any(r["name"] == f"scaled_rowwise_adagrad_{batch}" for r in b.rows):   # step 4's
                b.job(f"scaled_rowwise_adagrad_{batch}", [*scaled, *rwa], batch)
            for name in lean:
                b.job(f"scaled_{name}_{batch}", [*scaled, *LEAN[name]], batch)
            if os.path.exists(ANCHOR):
                _dlrm_main(b, a, batch)
            else:
                b.rows.append({"name": f"dlrm_main.py {batch}",
                               "status": f"not run: {ANCHOR} absent (bench_torchrec_dlrm.py --extract)"})
        for name in lean[:1]:   # the step profile at the large batch
            b.job(f"scaled_{name}_profiled_{big}", [*scaled, *LEAN[name], "--profile-steps", "5"], big,
                  steps=40)
    if 9 not in skip:
        for name in lean:
            plan(name)
        for batch in (int(x) for x in (a.lean_batches or a.batches).split(",")):
            b.job(f"full_rowwise_adagrad_{batch}", rwa, batch)
            for name in lean:
                if (plans.get(name) or {}).get("fits"):
                    b.job(f"full_{name}_{batch}", LEAN[name], batch)
                else:
                    b.rows.append({"name": f"full_{name}_{batch}", "status": "not run: its plan does not fit"})
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
          parse=lambda p: _dlrm_main_row(batch, _read_json(os.path.join(out, "bench_torchrec_dlrm.json"))
                                         if p.returncode == 0 else None))


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
