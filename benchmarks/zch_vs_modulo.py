"""Managed collision (``--zch``) against modulo hashing, in the CTR job on the same data and seeds.

For each table size (``--num-embeddings``), seed and sparse optimizer, runs ``python -m
torchrec_ftrl.job`` twice: ids modulo the table size (the default), and raw ids through TorchRec's
managed collision with that many slots per table. Writes ``OUT.json`` (every run: flags, validation
AUC / log loss, share of exactly-zero weights of all rows, slots reset) and ``OUT.md`` (the table of
means over seeds).

    python benchmarks/zch_vs_modulo.py --data ../shared/data/criteo/criteo_dac_combined.tsv \\
        --epochs 5 --sizes 1000 10000 --seeds 0 1 2 --out benchmarks/results/zch_criteo_cpu
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from sweep_l1 import run_job, write_table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a CTR file (or binary folder) the job reads")
    p.add_argument("--epochs", type=float, default=5.0)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000], help="rows / slots per table")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--optimizers", nargs="+", default=["ftrl"], choices=["ftrl", "rowwise_adagrad"])
    p.add_argument("--out", required=True, help="output stem (writes OUT.json and OUT.md)")
    a = p.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes:
            for opt in a.optimizers:
                for zch in (False, True):
                    for seed in a.seeds:
                        flags = ["--data", a.data, "--epochs", str(a.epochs), "--batch-size",
                                 str(a.batch_size), "--num-embeddings", str(size), "--seed", str(seed),
                                 "--sparse-optimizer", opt, *(["--zch"] if zch else [])]
                        r = run_job(flags, tmp, f"run{len(runs)}")
                        r.update(size=size, optimizer=opt, managed_collision=zch, seed=seed)
                        runs.append(r)
                        print(f"size {size} {opt} {'zch' if zch else 'modulo'} seed {seed}: "
                              f"AUC {r['auc']:.4f} logloss {r['logloss']:.4f}", flush=True)
    rows = ["| rows / slots per table | sparse optimizer | ids | validation AUC | log loss | "
            "exact-zero weights (all rows) | slots reset per run |", "|---:|---|---|---:|---:|---:|---:|"]
    for size in a.sizes:
        for opt in a.optimizers:
            for zch in (False, True):
                rs = [r for r in runs if (r["size"], r["optimizer"], r["managed_collision"]) == (size, opt, zch)]
                auc = [r["auc"] for r in rs]
                reset = f"{statistics.mean(r['zch']['reset_slots'] for r in rs):.0f}" if zch else "-"
                rows.append(f"| {size:,} | {opt} | {'managed collision' if zch else 'modulo'} | "
                            f"{statistics.mean(auc):.4f} (min {min(auc):.4f}, max {max(auc):.4f}) | "
                            f"{statistics.mean(r['logloss'] for r in rs):.4f} | "
                            f"{100 * statistics.mean(r['zero_weight_share'] for r in rs):.1f}% | {reset} |")
    table = "\n".join(rows)
    print(table)
    write_table(a.out, a, runs, f"Seeds {a.seeds}, batch {a.batch_size}, {a.epochs} epochs of "
                f"{a.data}; means over seeds (min, max).", table)


if __name__ == "__main__":
    main()
