"""Quality of compact FTRL state: the CTR job with fp32 state against bf16 state, same model and seeds.

For each data set, per-rank batch size and seed, runs ``python -m torchrec_ftrl.job`` once per
``--ftrl-state-dtype`` and compares validation AUC, log loss and the share of exactly-zero weights in
the rows the training data touched. Protocol (that of docs/main-job.md's FTRL vs row-wise Adagrad
table): validation only at the end; synthetic: the default 200 steps; the Criteo and Avazu samples:
``--epochs 5`` up to batch 1,024, ``--steps 30`` above (5 epochs would be 8 steps or fewer). Runs go
``--jobs`` at a time. Writes ``OUT.json`` (every run) and ``OUT.md`` (per data set and batch: means
over seeds, the largest per-seed |AUC difference| and |zero-share difference|, and whether both are
within the targets, 0.001 AUC and 1 point of zero share).

    python benchmarks/state_dtype_quality.py --device cuda --jobs 8 \\
        --criteo ../shared/data/criteo/criteo_dac_combined.tsv \\
        --avazu ../shared/data/avazu/avazu_train_head9999.csv --out benchmarks/results/state_dtype_quality_h200
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import tempfile

from sweep_l1 import run_job, write_table

BATCHES = (256, 1024, 4096, 16384, 65536)
DTYPES = ("fp32", "bf16")
AUC_TARGET, ZERO_TARGET = 0.001, 0.01


def data_flags(name: str, path: str, batch: int) -> list[str]:
    if name == "synthetic":
        return []
    length = ["--epochs", "5"] if batch <= 1024 else ["--steps", "30"]
    fmt = ["--data-format", "avazu"] if name == "avazu" else []
    return ["--data", path, *fmt, *length]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--criteo", default=None, help="Criteo TSV sample (skipped if not given)")
    p.add_argument("--avazu", default=None, help="Avazu CSV sample (skipped if not given)")
    p.add_argument("--no-synthetic", action="store_true")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--out", required=True, help="output stem (writes OUT.json and OUT.md)")
    a = p.parse_args()
    sets = ([] if a.no_synthetic else [("synthetic", None)]) + \
        [(n, os.path.abspath(v)) for n, v in (("criteo", a.criteo), ("avazu", a.avazu)) if v]
    todo = [(name, path, b, seed, dt) for name, path in sets for b in a.batches for seed in a.seeds
            for dt in DTYPES]

    def one(tmp, k, name, path, batch, seed, dtype):
        flags = [*data_flags(name, path, batch), "--batch-size", str(batch), "--seed", str(seed),
                 "--ftrl-state-dtype", dtype, "--eval-every", "100000", "--device", a.device,
                 "--cpu-threads", "1"]
        r = run_job(flags, tmp, f"run{k}")
        r.update(dataset=name, batch=batch, seed=seed, state_dtype=dtype)
        print(f"{name} batch {batch} seed {seed} {dtype}: AUC {r['auc']:.4f} logloss {r['logloss']:.4f} "
              f"zero {r['zero_weight_share_touched']:.3f} ({r['wall_s']:.0f} s)", flush=True)
        return r

    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        runs = list(pool.map(lambda kv: one(tmp, kv[0], *kv[1]), enumerate(todo)))

    rows = ["| data | batch / rank | steps | AUC fp32 | AUC bf16 | max seed abs dAUC | log loss fp32 | "
            "log loss bf16 | zero share fp32 | zero share bf16 | max seed abs dzero (points) | "
            "within targets |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, _ in sets:
        for b in a.batches:
            by = {(r["seed"], r["state_dtype"]): r for r in runs if (r["dataset"], r["batch"]) == (name, b)}
            mean = {dt: {k: statistics.mean(by[(s, dt)][k] for s in a.seeds)
                         for k in ("auc", "logloss", "zero_weight_share_touched")} for dt in DTYPES}
            d_auc = max(abs(by[(s, "bf16")]["auc"] - by[(s, "fp32")]["auc"]) for s in a.seeds)
            d_zero = max(abs(by[(s, "bf16")]["zero_weight_share_touched"]
                             - by[(s, "fp32")]["zero_weight_share_touched"]) for s in a.seeds)
            ok = d_auc <= AUC_TARGET and d_zero <= ZERO_TARGET
            f, h = mean["fp32"], mean["bf16"]
            rows.append(f"| {name} | {b:,} | {by[(a.seeds[0], 'fp32')]['steps']} | {f['auc']:.4f} | "
                        f"{h['auc']:.4f} | {d_auc:.4f} | {f['logloss']:.4f} | {h['logloss']:.4f} | "
                        f"{100 * f['zero_weight_share_touched']:.1f}% | "
                        f"{100 * h['zero_weight_share_touched']:.1f}% | {100 * d_zero:.2f} | "
                        f"{'yes' if ok else 'no'} |")
    table = "\n".join(rows)
    print(table)
    write_table(a.out, a, runs, f"Seeds {a.seeds}, device {a.device}; means over seeds; targets: "
                f"|dAUC| <= {AUC_TARGET}, |dzero| <= {100 * ZERO_TARGET:.0f} point, every seed.", table)


if __name__ == "__main__":
    main()
