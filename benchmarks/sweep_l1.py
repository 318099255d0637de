"""Sweep the job's per-example FTRL l1 (``--ftrl-l1``): validation AUC and share of exactly-zero weights.

Runs ``python -m torchrec_ftrl.job`` once per l1 value and data set, one process at a time, and
writes ``OUT.json`` (every run's flags, fused ``ftrl_l1_reg``, validation AUC / log loss and
sparsity) and ``OUT.png``: validation AUC (top) and the share of exactly-zero weights in the rows the
training data touched (bottom) against l1 on a log axis. l1 = 0 cannot sit on a log axis; it is drawn
as a dashed horizontal line, and row-wise Adagrad's AUC (``--adagrad-reference``) as a dotted one.

    python benchmarks/sweep_l1.py --sets synthetic criteo --l1 0 0.01 0.03 0.1 0.3 1 3 \\
        --adagrad-reference --out benchmarks/results/l1_sweep_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_job(flags: list[str], out_dir: str, name: str) -> dict:
    cmd = [sys.executable, "-m", "torchrec_ftrl.job", "--no-progress", *flags,
           "--output-dir", out_dir, "--run-name", name]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    with open(os.path.join(out_dir, f"{name}_summary.json")) as f:
        s = json.load(f)
    so, fv = s["sparsity_overall"], s["final_validation"]
    return {"flags": flags, "wall_s": time.perf_counter() - t0, "steps": s["steps"],
            "batch_size_per_rank": s["batch_size_per_rank"], "fused_params": s["fused_params"],
            "auc": fv["auc"], "logloss": fv["logloss"], "val_rows": fv["rows"],
            # --zch runs count no touched rows (their batches hold raw ids, not rows)
            "zero_weight_share_touched": so.get("zero_weight_share_touched"),
            "zero_row_share_touched": so.get("zero_row_share_touched"),
            "zero_weight_share": so["zero_weight_share"], "touched_rows": so.get("touched_rows"),
            "rows": so["rows"], "zch": s.get("zch")}


def write_table(stem: str, args, runs: list, caption: str, table: str) -> None:
    """``STEM.json`` (the flags, the machine, every run) and ``STEM.md`` (``caption``, then the
    Markdown ``table``) of a study built on :func:`run_job`."""
    with open(stem + ".json", "w") as f:
        json.dump({"args": vars(args), "machine": platform.platform(), "runs": runs}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"{caption}\n\n{table}\n")


def plot(result: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_auc, ax_zero) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for i, (name, st) in enumerate(result["sets"].items()):
        color = f"C{i}"
        r0 = st["runs"][0]
        name = f"{name}, batch {r0['batch_size_per_rank']}, {r0['steps']} steps"
        pts = sorted((r for r in st["runs"] if r["l1"] > 0), key=lambda r: r["l1"])
        xs = [r["l1"] for r in pts]
        ax_auc.plot(xs, [r["auc"] for r in pts], "o-", color=color, label=f"FTRL, {name}")
        ax_zero.plot(xs, [100 * r["zero_weight_share_touched"] for r in pts], "o-", color=color,
                     label=f"{name}")
        zero = [r for r in st["runs"] if r["l1"] == 0]
        if zero:
            ax_auc.axhline(zero[0]["auc"], color=color, ls="--", lw=1, label=f"FTRL l1 = 0, {name}")
        if st.get("adagrad") is not None:
            ax_auc.axhline(st["adagrad"]["auc"], color=color, ls=":", lw=1.5,
                           label=f"row-wise Adagrad, {name}")
    ax_auc.set_ylabel("validation AUC")
    ax_auc.set_title("FTRL l1 sweep (per-example --ftrl-l1; ftrl_l1_reg = l1 / S)")
    ax_auc.grid(True, which="both", alpha=0.3)
    ax_auc.legend(fontsize=7)
    ax_zero.set_xscale("log")
    ax_zero.set_xlabel("--ftrl-l1 (per example)")
    ax_zero.set_ylabel("exactly-zero weights, touched rows (%)")
    ax_zero.set_ylim(-2, 102)
    ax_zero.grid(True, which="both", alpha=0.3)
    ax_zero.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--l1", type=float, nargs="+", default=[0, 0.01, 0.03, 0.1, 0.3, 1, 3])
    p.add_argument("--sets", nargs="+", choices=("synthetic", "criteo"), default=["synthetic"])
    p.add_argument("--criteo", default=os.path.join(ROOT, "..", "shared", "data", "criteo",
                                                    "criteo_dac_combined.tsv"))
    p.add_argument("--synthetic-args", default="--batch-size 1024",
                   help="job flags for the synthetic set (quoted string)")
    p.add_argument("--criteo-args", default="--batch-size 256 --epochs 5",
                   help="job flags for the Criteo sample (quoted string; --data is added)")
    p.add_argument("--common-args", default="--cpu-threads 1 --eval-every 100000",
                   help="job flags for every run (final validation only by default)")
    p.add_argument("--adagrad-reference", action="store_true",
                   help="also run --sparse-optimizer rowwise_adagrad once per set")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "l1_sweep_cpu"),
                   help="output stem: writes OUT.json and OUT.png")
    p.add_argument("--machine", default="", help="free text stored in the JSON")
    p.add_argument("--replot", action="store_true", help="only redraw OUT.png from OUT.json")
    a = p.parse_args(argv)
    if a.replot:
        with open(a.out + ".json") as f:
            plot(json.load(f), a.out + ".png")
        return 0

    import torch
    result = {"machine": a.machine, "python": platform.python_version(), "torch": torch.__version__,
              "world_size": 1, "l1": a.l1, "sets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.sets:
            base = shlex.split(a.common_args) + (
                shlex.split(a.synthetic_args) if name == "synthetic"
                else ["--data", a.criteo, *shlex.split(a.criteo_args)])
            st = {"flags": base, "runs": [], "adagrad": None}
            for l1 in a.l1:
                r = run_job([*base, "--ftrl-l1", repr(l1)], tmp, f"{name}_l1")
                r["l1"] = l1
                st["runs"].append(r)
                print(f"{name} l1={l1:g}: AUC {r['auc']:.4f}, zero weights (touched rows) "
                      f"{100 * r['zero_weight_share_touched']:.1f}%, rows "
                      f"{100 * r['zero_row_share_touched']:.1f}%, {r['wall_s']:.0f}s", flush=True)
            if a.adagrad_reference:
                st["adagrad"] = run_job([*base, "--sparse-optimizer", "rowwise_adagrad"], tmp,
                                        f"{name}_adagrad")
                print(f"{name} row-wise Adagrad: AUC {st['adagrad']['auc']:.4f}", flush=True)
            result["sets"][name] = st
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, a.out + ".png")
    print(f"wrote {a.out}.json and {a.out}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
