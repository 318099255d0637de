#!/usr/bin/env python3
"""Pair ``quality.py`` results files run with one setting changed (``--dense-precision``, say).

    python3 benchmarks/quality_pair.py --reference q_fp32.json --other tf32=q_tf32.json \\
        --other bf16=q_bf16.json --out benchmarks/results/quality_dense_precision

For every (dataset, batch, variant) that the reference and another file share, on the seeds both
ran: the AUC of each, and the paired difference ``other - reference`` with its 95% paired
t-interval and verdict at +/-0.001 (``quality_stats``: equivalent / worse / better / inconclusive).
Writes ``--out.md`` and ``--out.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quality_stats as qs  # noqa: E402


def aucs_by_key(runs) -> dict:
    """``{(dataset, batch, variant): {seed: auc}}`` of a quality.py result's ``runs``."""
    out = {}
    for r in runs:
        out.setdefault((r["dataset"], r["batch"], r["variant"]), {})[r["seed"]] = r["auc"]
    return out


def pair(reference_runs, other_runs) -> list:
    """One row per shared (dataset, batch, variant): seeds, mean AUCs, the paired interval of
    ``other - reference`` over the seeds both ran, and its verdict at ``quality_stats.AUC_MARGIN``."""
    ref, oth = aucs_by_key(reference_runs), aucs_by_key(other_runs)
    rows = []
    for key in sorted(ref.keys() & oth.keys()):
        seeds = sorted(ref[key].keys() & oth[key].keys())
        if not seeds:
            continue
        a = [ref[key][s] for s in seeds]
        b = [oth[key][s] for s in seeds]
        iv = qs.paired_interval(b, a)
        rows.append({"dataset": key[0], "batch": key[1], "variant": key[2], "seeds": seeds,
                     "reference_auc": sum(a) / len(a), "other_auc": sum(b) / len(b),
                     "d_auc": iv.to_dict(), "verdict": qs.verdict([iv], qs.AUC_MARGIN)})
    return rows


def markdown(reference_name, others) -> str:
    lines = [f"| data | batch | variant | seeds | AUC {reference_name} | setting | AUC | "
             f"dAUC [95% CI] | verdict (+/-{qs.AUC_MARGIN}) |",
             "|---|---:|---|---:|---:|---|---:|---|---|"]
    for name, rows in others.items():
        for r in rows:
            d = r["d_auc"]
            lines.append(f"| {r['dataset']} | {r['batch']:,} | {r['variant']} | {len(r['seeds'])} | "
                         f"{r['reference_auc']:.4f} | {name} | {r['other_auc']:.4f} | "
                         f"{d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}] | {r['verdict']} |")
    return "\n".join(lines) + "\n"


def _load(path):
    with open(path) as f:
        return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True, help="quality.py results JSON of the reference")
    ap.add_argument("--reference-name", default="reference")
    ap.add_argument("--other", action="append", required=True, metavar="NAME=PATH",
                    help="quality.py results JSON of a setting, named; repeat for several")
    ap.add_argument("--out", required=True, help="path stem of the .md and .json written")
    a = ap.parse_args(argv)
    ref = _load(a.reference)
    others = {}
    for spec in a.other:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            ap.error(f"--other must be NAME=PATH, got {spec!r}")
        others[name] = pair(ref["runs"], _load(path)["runs"])
    with open(a.out + ".json", "w") as f:
        json.dump({"reference": a.reference_name, "pairs": others}, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(markdown(a.reference_name, others))
    print(markdown(a.reference_name, others), end="")


if __name__ == "__main__":
    main()
