"""Quality study with paired runs: named sparse-optimizer variants against exact FTRL, with 95% intervals.

For every seed, data set and batch size, every variant trains the same DLRM (``quality_model``) on the
same examples in the same order from the same initial weights (the paired design), and is evaluated
on the same held-out examples. Per variant: AUC, log loss, normalized entropy, exact-zero share of
the touched rows' weights and of touched rows, non-zero weights and bytes of the sparse model
(weights + optimizer state). Per variant against the reference (the first variant, exact FTRL): the
mean paired difference over seeds and its 95% paired t-interval, and the verdicts of
``quality_stats`` (AUC within +/-0.001, zero share within +/-1 point, at every batch size).

Data sets: ``teacher`` (``teacher.py``, generated on the run's device: one evaluation set, one training
stream per seed; ``--teacher small`` for CPU, ``large`` = 26 features of 100k-10M ids, 10M training
and 1.5M evaluation examples), ``criteo`` / ``avazu`` (the sample files: every 5th row is held out;
a seed sets the order of ``--epochs`` passes and the initial weights). Outputs ``OUT.json`` (written
after every run, so a run cut short keeps what finished), ``OUT.md`` (tables) and ``OUT.png`` (AUC
difference against non-zero weights, with the intervals).

    python benchmarks/quality.py --datasets criteo avazu --batches 256 1024 --seeds 0 1 2 3 4 5 6 7 \\
        --out benchmarks/results/quality_samples_cpu
    python3 benchmarks/quality.py --device cuda --dense-precision fp32 --datasets teacher --teacher large --exclude sgd \\
        --batches 8192 65536 --seeds 0 1 2 3 4 5 6 7 --time-budget-s 180 --out DIR/quality_teacher_large_h200

``--dense-precision {fp32,tf32,bf16}`` is the CTR job's flag (``torchrec_ftrl.job.dense_precision``, the
same code and default): the MLPs' and the interaction's arithmetic of every run. A precision's AUC
against fp32: two studies with the same seeds, one per precision (``model`` in OUT.json names it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quality_model as qm  # noqa: E402
from torchrec_ftrl.job import dense_precision  # noqa: E402
from quality_stats import (AUC_MARGIN, ZERO_SHARE_MARGIN, PairedInterval, mean_interval,  # noqa: E402
                           paired_interval, verdict)  # noqa: E402
from teacher import Teacher, TeacherConfig, log_spaced_sizes, teacher_summary  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("TORCHREC_FTRL_DATA") or os.path.join(os.path.dirname(ROOT), "shared", "data")
SAMPLES = {"criteo": ("criteo", "criteo/criteo_dac_combined.tsv"),
           "avazu": ("avazu", "avazu/avazu_train_head9999.csv")}
# name -> (teacher table sizes, training examples, evaluation examples)
TEACHERS = {
    "tiny": (log_spaced_sizes(26, 100, 2_000), 8_192, 4_096),
    "small": (log_spaced_sizes(26, 1_000, 20_000), 100_000, 100_000),
    # 1.5M evaluation examples: AUC standard error ~0.0005 at AUC 0.75, CTR 27% (Hanley-McNeil)
    "large": (log_spaced_sizes(26, 100_000, 10_000_000), 10_000_000, 1_500_000),
}
EVAL_STREAM = 1_000_003          # the teacher's evaluation set is this stream, whatever the seed
METRICS = ("auc", "logloss", "ne", "zero_weight_share_touched", "zero_row_share_touched",
           "nonzero_weights_touched", "sparse_model_bytes")


@dataclass
class Dataset:
    """``name``, table ``sizes``, ``evaluation`` examples, ``train(seed)`` -> that seed's training
    examples, ``epochs``, ``shuffle`` (whether each pass is a seeded permutation) and ``describe``
    (a JSON dict)."""

    name: str
    sizes: list
    evaluation: qm.Examples
    train: Callable[[int], qm.Examples]
    epochs: int
    shuffle: bool
    describe: dict


def teacher_dataset(preset: str, device: torch.device, teacher_seed: int = 0,
                    train_rows: Optional[int] = None) -> Dataset:
    """The teacher of ``preset`` (``TEACHERS``) on ``device``; ``train_rows`` overrides its training
    examples per seed."""
    sizes, n_train, n_eval = TEACHERS[preset]
    n_train = train_rows or n_train
    t = Teacher(TeacherConfig(sizes, seed=teacher_seed), device)
    ev = t.sample(n_eval, EVAL_STREAM)

    def train(seed):
        d = t.sample(n_train, seed)
        return qm.Examples(d.dense, d.ids, d.labels, missing=False)

    desc = {"kind": "teacher", "preset": preset, "train_rows": n_train, **teacher_summary(t, ev)}
    desc["eval_rows"] = desc.pop("rows")
    return Dataset("teacher", sizes, qm.Examples(ev.dense, ev.ids, ev.labels, missing=False), train, 1,
                   False, desc)


def sample_dataset(name: str, device: torch.device, num_embeddings: int, epochs: int,
                   data_dir: str = DATA) -> Dataset:
    """A sample file, ids modulo ``num_embeddings``, every 5th row held out (``Split("every:5")``).

    Raises:
        FileNotFoundError: the sample is not under ``data_dir``.
    """
    from torchrec_ftrl.data import CTRFileReader, Split, get_spec
    from torchrec_ftrl.data.line_parser import RowChunk

    fmt, rel = SAMPLES[name]
    path = os.path.join(data_dir, rel)
    spec = get_spec(fmt)
    rows = RowChunk.concat(list(CTRFileReader(path, spec, num_embeddings).iter_chunks()))
    n = rows.num_rows
    split = Split.parse("every:5")
    val = np.asarray(split.is_validation(np.arange(n), n), dtype=bool)

    def ex(mask):
        return qm.Examples(torch.from_numpy(rows.dense[mask]).float().to(device),
                           torch.from_numpy(rows.ids[mask]).long().to(device),
                           torch.from_numpy(rows.labels[mask]).float().to(device))

    train = ex(~val)
    return Dataset(name, [num_embeddings] * spec.num_categorical, ex(val), lambda seed: train, epochs,
                   True, {"kind": "file", "path": rel, "rows": n, "train_rows": int((~val).sum()),
                          "eval_rows": int(val.sum()), "split": "every:5",
                          "num_embeddings": num_embeddings, "epochs": epochs})


def summarize(runs: list[dict], reference: str) -> dict:
    """Per (data set, batch, variant): means over seeds of ``METRICS`` and, against ``reference``, the
    paired intervals of AUC, log loss, NE and the zero shares (seeds where both ran). Per (data set,
    variant): the AUC and zero-share verdicts over the batch sizes studied."""
    cells, verdicts = [], []
    keys = sorted({(r["dataset"], r["batch"]) for r in runs}, key=lambda k: (k[0], k[1]))
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    for ds, b in keys:
        by = {(r["variant"], r["seed"]): r for r in runs if (r["dataset"], r["batch"]) == (ds, b)}
        for v in variants:
            seeds = sorted(s for (vv, s) in by if vv == v)
            if not seeds:
                continue
            cell = {"dataset": ds, "batch": b, "variant": v, "seeds": seeds,
                    "mean": {m: statistics.fmean(by[(v, s)][m] for s in seeds) for m in METRICS},
                    "steps": by[(v, seeds[0])]["steps"]}
            paired = [s for s in seeds if (reference, s) in by]
            if v != reference and paired:
                cell["vs_reference"] = {
                    m: paired_interval([by[(v, s)][m] for s in paired],
                                       [by[(reference, s)][m] for s in paired]).to_dict()
                    for m in ("auc", "logloss", "ne", "zero_weight_share_touched",
                              "zero_row_share_touched")}
            cells.append(cell)
    for ds in dict.fromkeys(k[0] for k in keys):
        for v in variants:
            mine = [c for c in cells if c["dataset"] == ds and c["variant"] == v and "vs_reference" in c]
            if not mine:
                continue
            iv = {m: [PairedInterval(**c["vs_reference"][m]) for c in mine]
                  for m in ("auc", "zero_weight_share_touched")}
            verdicts.append({"dataset": ds, "variant": v, "batches": [c["batch"] for c in mine],
                             "seeds": min(c["vs_reference"]["auc"]["n"] for c in mine),
                             "auc": verdict(iv["auc"], AUC_MARGIN),
                             "zero_share": verdict(iv["zero_weight_share_touched"], ZERO_SHARE_MARGIN)})
    return {"cells": cells, "verdicts": verdicts}


def _ci(iv: dict, scale: float = 1.0, digits: int = 4) -> str:
    lo, hi = iv["lo"] * scale, iv["hi"] * scale
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{iv['mean'] * scale:+.{digits}f} (one seed)"
    return f"{iv['mean'] * scale:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def markdown(result: dict) -> str:
    """The tables of ``result`` (see :func:`summarize`)."""
    s = result["summary"]
    lines = ["| data | batch | steps | variant | seeds | AUC | dAUC [95% CI] | log loss | NE | "
             "zero weights (touched) | dzero, points [95% CI] | zero rows (touched) | non-zero weights | "
             "sparse model MiB |",
             "|---|---:|---:|---|---:|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    for c in s["cells"]:
        m, vr = c["mean"], c.get("vs_reference")
        lines.append(
            f"| {c['dataset']} | {c['batch']:,} | {c['steps']:,} | {c['variant']} | {len(c['seeds'])} | "
            f"{m['auc']:.4f} | {_ci(vr['auc']) if vr else 'reference'} | {m['logloss']:.4f} | "
            f"{m['ne']:.4f} | {100 * m['zero_weight_share_touched']:.1f}% | "
            f"{_ci(vr['zero_weight_share_touched'], 100, 2) if vr else 'reference'} | "
            f"{100 * m['zero_row_share_touched']:.1f}% | {m['nonzero_weights_touched']:,.0f} | "
            f"{m['sparse_model_bytes'] / 2 ** 20:,.1f} |")
    lines += ["", "| data | variant | batches | AUC verdict (+/-0.001) | zero-share verdict (+/-1 point) |",
              "|---|---|---|---|---|"]
    for v in s["verdicts"]:
        lines.append(f"| {v['dataset']} | {v['variant']} | {', '.join(f'{b:,}' for b in v['batches'])} | "
                     f"{v['auc']} | {v['zero_share']} |")
    if result.get("not_run"):
        lines += ["", "Not run: " + "; ".join(f"{k}: {why}" for k, why in result["not_run"].items())]
    return "\n".join(lines) + "\n"


def plot(result: dict, png: str) -> None:
    """One panel per data set: AUC minus the reference's (paired mean, 95% interval) against the
    non-zero weights of the touched rows (log axis), a marker per variant, a colour per batch size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["summary"]["cells"]
    sets = list(dict.fromkeys(c["dataset"] for c in cells))
    batches = sorted({c["batch"] for c in cells})
    variants = list(dict.fromkeys(c["variant"] for c in cells))
    markers = "os^vD<>P*Xh"
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4.5), squeeze=False)
    for ax, ds in zip(axes[0], sets):
        for c in (c for c in cells if c["dataset"] == ds):
            iv = c.get("vs_reference", {}).get("auc", {"mean": 0.0, "lo": 0.0, "hi": 0.0})
            lo = iv["lo"] if math.isfinite(iv["lo"]) else iv["mean"]
            hi = iv["hi"] if math.isfinite(iv["hi"]) else iv["mean"]
            ax.errorbar(max(c["mean"]["nonzero_weights_touched"], 1), iv["mean"],
                        yerr=[[iv["mean"] - lo], [hi - iv["mean"]]], capsize=3,
                        marker=markers[variants.index(c["variant"]) % len(markers)],
                        color=f"C{batches.index(c['batch'])}", ls="none")
        ax.axhspan(-AUC_MARGIN, AUC_MARGIN, color="0.85", zorder=0)
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(f"{ds}")
        ax.set_xlabel("non-zero weights in touched rows (mean over seeds)")
        ax.set_ylabel(f"AUC - AUC({result['reference']}), 95% paired t-interval")
        ax.grid(True, which="both", alpha=0.3)
    handles = [plt.Line2D([], [], marker=markers[i % len(markers)], color="0.3", ls="none", label=v)
               for i, v in enumerate(variants)]
    handles += [plt.Line2D([], [], marker="s", color=f"C{i}", ls="none", label=f"batch {b:,}")
                for i, b in enumerate(batches)]
    axes[0][-1].legend(handles=handles, fontsize=7, loc="best")
    fig.suptitle("Paired quality study: grey band = equivalence margin +/-0.001 AUC", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def l1_sweep(ds: Dataset, examples: qm.Examples, batch: int, seed: int, order: torch.Tensor,
             l1s: list[float], cfg: qm.ModelConfig, device: torch.device) -> list[dict]:
    """FTRL at each per-example ``l1`` of ``l1s``, and row-wise Adagrad (trained once) magnitude-pruned
    to each FTRL model's non-zero weights (:func:`quality_model.prune_to`), all on the same examples,
    order and initial weights. One record per (method, l1)."""
    touched = qm.touched_masks(examples.ids[order], ds.sizes)
    out = []
    for l1 in l1s:
        v = qm.Variant(f"ftrl_l1={l1:g}", "ftrl", knobs={"ftrl_l1": l1})
        model, _ = qm.train(v, examples, ds.sizes, batch, seed, order, cfg, device)
        nz = qm.sparse_model_stats(model.tbe, touched)["nonzero_weights_touched"]
        out.append({"method": "ftrl", "l1": l1, "nonzero_weights_touched": nz,
                    **qm.evaluate(model, ds.evaluation, cfg)})
        del model
    model, _ = qm.train(qm.VARIANTS["rowwise_adagrad"], examples, ds.sizes, batch, seed, order, cfg, device)
    for rec in sorted(out, key=lambda r: -r["nonzero_weights_touched"]):   # pruning only removes
        left = qm.prune_to(model.tbe, touched, rec["nonzero_weights_touched"])
        out.append({"method": "rowwise_adagrad_pruned", "l1": rec["l1"], "nonzero_weights_touched": left,
                    **qm.evaluate(model, ds.evaluation, cfg)})
    for r in out:
        r.update(dataset=ds.name, batch=batch, seed=seed)
    return out


def summarize_l1(records: list[dict]) -> list[dict]:
    """Per (data set, batch, l1): FTRL's and pruned Adagrad's mean AUC and non-zero weights over seeds,
    the t-interval of each mean AUC, and the paired interval of AUC(pruned Adagrad) - AUC(FTRL)."""
    out = []
    for key in dict.fromkeys((r["dataset"], r["batch"], r["l1"]) for r in records):
        by = {(r["method"], r["seed"]): r for r in records if (r["dataset"], r["batch"], r["l1"]) == key}
        seeds = sorted(s for m, s in by if m == "ftrl" and ("rowwise_adagrad_pruned", s) in by)
        if not seeds:
            continue
        rec = {"dataset": key[0], "batch": key[1], "l1": key[2], "seeds": seeds}
        for m in ("ftrl", "rowwise_adagrad_pruned"):
            auc = [by[(m, s)]["auc"] for s in seeds]
            rec[m] = {"auc": mean_interval(auc).to_dict(),
                      "nonzero_weights_touched": statistics.fmean(by[(m, s)]["nonzero_weights_touched"]
                                                                  for s in seeds)}
        rec["pruned_minus_ftrl_auc"] = paired_interval(
            [by[("rowwise_adagrad_pruned", s)]["auc"] for s in seeds],
            [by[("ftrl", s)]["auc"] for s in seeds]).to_dict()
        out.append(rec)
    return out


def l1_markdown(rows: list[dict]) -> str:
    lines = ["| data | batch | l1 (per example) | seeds | non-zero weights | AUC FTRL | "
             "AUC row-wise Adagrad pruned to that size | pruned - FTRL [95% CI] |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['dataset']} | {r['batch']:,} | {r['l1']:g} | {len(r['seeds'])} | "
                     f"{r['ftrl']['nonzero_weights_touched']:,.0f} | {r['ftrl']['auc']['mean']:.4f} | "
                     f"{r['rowwise_adagrad_pruned']['auc']['mean']:.4f} | "
                     f"{_ci(r['pruned_minus_ftrl_auc'])} |")
    return "\n".join(lines) + "\n"


def plot_l1(rows: list[dict], png: str) -> None:
    """AUC (mean over seeds, 95% t-interval) against non-zero weights of the touched rows: FTRL over
    its l1 values, and row-wise Adagrad magnitude-pruned to the same sizes; a panel per data set and
    batch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["dataset"], r["batch"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (ds, b) in zip(axes[0], panels):
        mine = sorted((r for r in rows if (r["dataset"], r["batch"]) == (ds, b)), key=lambda r: r["l1"])
        for i, (m, label) in enumerate((("ftrl", "FTRL (l1 sweep)"),
                                        ("rowwise_adagrad_pruned", "row-wise Adagrad, magnitude-pruned"))):
            xs = [max(r[m]["nonzero_weights_touched"], 1) for r in mine]
            iv = [r[m]["auc"] for r in mine]
            lo = [v["mean"] - (v["lo"] if math.isfinite(v["lo"]) else v["mean"]) for v in iv]
            hi = [(v["hi"] if math.isfinite(v["hi"]) else v["mean"]) - v["mean"] for v in iv]
            ax.errorbar(xs, [v["mean"] for v in iv], yerr=[lo, hi], marker="os"[i], capsize=3, label=label)
        for r in mine:
            ax.annotate(f"l1={r['l1']:g}", (max(r["ftrl"]["nonzero_weights_touched"], 1),
                                            r["ftrl"]["auc"]["mean"]), fontsize=6)
        ax.set_xscale("log")
        ax.set_title(f"{ds}, batch {b:,}")
        ax.set_xlabel("non-zero weights in touched rows")
        ax.set_ylabel("AUC (mean over seeds, 95% t-interval)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def resolve_variants(names: list[str], device: torch.device) -> tuple[list, dict]:
    """``(variants to run, {name: why not})``. ``all``: every registered variant this installation
    can train (the others are listed with the reason); a variant named explicitly that cannot run
    raises.

    Raises:
        ValueError: an unknown name, or a named variant :func:`quality_model.check_supported` refuses.
    """
    if names == ["all"]:
        run, skipped = [], {}
        for v in qm.VARIANTS.values():
            try:
                qm.check_supported(v, device)
                run.append(v)
            except ValueError as e:
                skipped[v.name] = str(e)
        return run, skipped
    unknown = [n for n in names if n not in qm.VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; known: {list(qm.VARIANTS)}")
    out = [qm.VARIANTS[n] for n in names]
    for v in out:
        qm.check_supported(v, device)
    return out, {}


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", choices=("teacher", *SAMPLES), default=["teacher"])
    p.add_argument("--teacher", choices=tuple(TEACHERS), default="small", help="teacher preset")
    p.add_argument("--train-rows", type=int, default=None,
                   help="training examples per seed of the teacher (default: the preset's)")
    p.add_argument("--variants", nargs="+", default=["all"],
                   help=f"variant names (the reference {qm.REFERENCE!r} is always first), or 'all' "
                        f"(those this installation can train); known: {', '.join(qm.VARIANTS)}")
    p.add_argument("--batches", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=5, help="passes over a sample file's training rows")
    p.add_argument("--num-embeddings", type=int, default=10_000, help="rows per table, sample files")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    dense_precision.add_flag(p)
    p.add_argument("--exclude", nargs="*", default=[], help="variants left out of --variants all")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="start a seed only if the time so far plus the last seed's time stays within "
                        "this many seconds (at least 2 seeds run; a seed's runs stay paired)")
    p.add_argument("--l1-sweep", type=float, nargs="*", default=[],
                   help="also FTRL at these per-example l1 values against row-wise Adagrad "
                        "magnitude-pruned to the same non-zero weights (OUT_l1.png)")
    p.add_argument("--out", required=True, help="output stem: OUT.json, OUT.md, OUT.png")
    return p


def new_result(a, device: torch.device, variants: list, not_run: dict, sets: list,
               cfg: qm.ModelConfig) -> dict:
    """The study's JSON record before any run: flags, machine, versions, the variants (and those
    not run, with the reason), the data sets, and empty run lists."""
    return {"args": vars(a), "machine": platform.platform(), "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "reference": qm.REFERENCE,
            "interval": "95% paired t-interval over seeds (scipy.stats.ttest_rel)",
            "model": vars(cfg),
            "variants": {v.name: {"optimizer": v.optimizer, "knobs": v.knobs,
                                  "state_dtypes": v.state_dtypes, "layout": v.layout,
                                  "description": v.description} for v in variants},
            "not_run": not_run, "datasets": {d.name: d.describe for d in sets}, "runs": [],
            "seeds_done": [], "l1_sweep_runs": []}


def run_seed(a, result: dict, ds: Dataset, seed: int, variants: list, cfg, device: torch.device) -> None:
    """Every variant (and with ``--l1-sweep`` the sweep) on ``ds`` at every batch size for one
    seed, paired: the same training examples, order and initial weights. Each run goes to
    ``result`` (written to ``OUT.json`` after it) and is printed."""
    train = ds.train(seed)
    for b in a.batches:
        order = qm.train_order(len(train), b, ds.epochs, seed, ds.shuffle, device)
        for v in variants:
            r = qm.run(v, train, ds.evaluation, ds.sizes, b, seed, order, cfg, device)
            r.update(dataset=ds.name, batch=b, seed=seed, variant=v.name)
            result["runs"].append(r)
            print(f"{ds.name} batch {b} seed {seed} {v.name}: AUC {r['auc']:.4f} logloss "
                  f"{r['logloss']:.4f} zero {100 * r['zero_weight_share_touched']:.1f}% "
                  f"({r['steps']} steps, {r['train_s']:.1f} s)", flush=True)
            with open(a.out + ".json", "w") as f:
                json.dump(result, f, indent=1)
        if a.l1_sweep:
            recs = l1_sweep(ds, train, b, seed, order, a.l1_sweep, cfg, device)
            result["l1_sweep_runs"] += recs
            for r in recs:
                print(f"{ds.name} batch {b} seed {seed} l1 {r['l1']:g} {r['method']}: AUC "
                      f"{r['auc']:.4f}, {r['nonzero_weights_touched']:,} non-zero", flush=True)


def write_outputs(a, result: dict) -> None:
    """Summarize the runs (and the l1 sweep) into ``result`` and write ``OUT.json``, ``OUT.md``
    and ``OUT.png`` (with the sweep ``OUT_l1.png``); prints the tables."""
    result["summary"] = summarize(result["runs"], qm.REFERENCE)
    table = markdown(result)
    if a.l1_sweep:
        result["l1_sweep"] = summarize_l1(result["l1_sweep_runs"])
        table += "\nl1 sweep: FTRL against row-wise Adagrad magnitude-pruned to FTRL's non-zero weights\n\n" \
            + l1_markdown(result["l1_sweep"])
        plot_l1(result["l1_sweep"], a.out + "_l1.png")
    with open(a.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(describe(result) + "\n\n" + table)
    plot(result, a.out + ".png")
    print(table)
    print(f"wrote {a.out}.json, .md, .png ({result['wall_s']:.0f} s)")


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    device = torch.device(a.device)
    precision = dense_precision.resolve_for_script(parser, a.dense_precision, device)
    cfg = qm.ModelConfig(dense_precision=precision)
    if a.threads:
        torch.set_num_threads(a.threads)
    names = a.variants if a.variants == ["all"] else [qm.REFERENCE] + [n for n in a.variants
                                                                        if n != qm.REFERENCE]
    variants, not_run = resolve_variants(names, device)
    variants = [v for v in variants if v.name not in a.exclude or v.name == qm.REFERENCE]
    t_start = time.perf_counter()
    sets = [teacher_dataset(a.teacher, device, train_rows=a.train_rows) if d == "teacher"
            else sample_dataset(d, device, a.num_embeddings, a.epochs) for d in a.datasets]
    result = new_result(a, device, variants, not_run, sets, cfg)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    last_seed_s = 0.0
    for seed in a.seeds:
        elapsed = time.perf_counter() - t_start
        if (a.time_budget_s is not None and len(result["seeds_done"]) >= 2
                and elapsed + last_seed_s > a.time_budget_s):
            result["stopped"] = (f"time budget {a.time_budget_s} s: {elapsed:.0f} s so far, the last "
                                 f"seed took {last_seed_s:.0f} s; seed {seed} not started")
            print(result["stopped"], flush=True)
            break
        for ds in sets:
            run_seed(a, result, ds, seed, variants, cfg, device)
        result["seeds_done"].append(seed)
        last_seed_s = time.perf_counter() - t_start - elapsed
    result["wall_s"] = time.perf_counter() - t_start
    write_outputs(a, result)
    return 0


def describe(result: dict) -> str:
    """The caption of ``OUT.md``: what ran, where, and the interval used."""
    a = result["args"]
    sets = "; ".join(f"{k}: " + ", ".join(f"{kk} {vv:.4g}" if isinstance(vv, float) else f"{kk} {vv}"
                                          for kk, vv in v.items()
                                          if kk in ("preset", "rows", "train_rows", "eval_rows",
                                                    "ceiling_auc", "ctr", "epochs"))
                     for k, v in result["datasets"].items())
    return (f"Paired quality study on {result['device_name']} ({result['machine']}, torch "
            f"{result['torch']}); seeds done {result['seeds_done']}, batches {a['batches']}; "
            f"reference {result['reference']}; intervals: {result['interval']}; data: {sets}; "
            f"model: {result['model']}; wall {result.get('wall_s', 0):.0f} s.")


if __name__ == "__main__":
    raise SystemExit(main())
