#!/usr/bin/env python3
"""Table (markdown) and PNG of bench_scaling.py results: ``python benchmarks/plot_scaling.py DIR``."""

from __future__ import annotations

import glob
import json
import os
import sys


def main(directory: str) -> None:
    rows = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(directory, "*_g*.json")))]
    if not rows:
        raise SystemExit(f"no bench_scaling results (*_g*.json) in {directory!r}")
    rows.sort(key=lambda r: (r["sharding"], r["world_size"], r["optimizer"]))
    lines = ["| sharding | GPUs | optimizer | step ms (median) | examples/s | examples/s per GPU |",
             "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['sharding']} | {r['world_size']} | {r['optimizer']} | {r['step_ms_median']:.2f} "
                     f"| {r['examples_per_s']:,.0f} | {r['examples_per_s'] / r['world_size']:,.0f} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(directory, "scaling.md"), "w") as fh:
        fh.write(table + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["sharding"], r["optimizer"]) for r in rows}):
        pts = sorted((r["world_size"], r["step_ms_median"]) for r in rows
                     if (r["sharding"], r["optimizer"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[1]} ({key[0]})")
    ax.set_xticks(sorted({r["world_size"] for r in rows}))
    ax.set_xlabel("GPUs (fixed batch per GPU)")
    ax.set_ylabel("step time, ms (median)")
    r0 = rows[0]
    ax.set_title(f"weak scaling: {r0['tables']} tables x {r0['rows']:,} x {r0['dim']}, "
                 f"B={r0['batch_size_per_gpu']}/GPU, L={r0['pooling']}", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "scaling.png"), dpi=100)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "outputs/scaling")
