"""The pure-Python parts of the GPU benchmarks, on CPU: ``benchmarks/bench_tbe_cuda.py``'s production
shapes, memory estimate, run-length histogram and bytes model (fp32 and bf16 FTRL state);
``benchmarks/bench_uvm_caching.py``'s bytes per cache row, steady-state detection (on a CPU model of
the LRU cache), traffic model, batch stream and report; ``benchmarks/bench_dmp.py``'s fused_params,
method flags and profile attribution; ``benchmarks/bench_job.py``'s tiling of the binary folder and
summary reading; ``benchmarks/bench_torchrec_dlrm.py``'s flag mapping, 24-day view and throughput;
every GPU script's ``--help``; and (slow) CPU smoke runs of bench_dmp, bench_job and
bench_torchrec_dlrm."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

GiB = 2 ** 30


@pytest.fixture(scope="module")
def tbe_bench():
    pytest.importorskip("triton")
    import bench_tbe_cuda
    return bench_tbe_cuda


# ------------------------------------------------------------------------- bench_tbe_cuda.py


def test_production_shapes_cover_every_axis(tbe_bench):
    shapes = tbe_bench.production_shapes()
    names = [t["name"] for t in shapes]
    assert len(set(names)) == len(names)
    loads = [(t, w) for t in shapes for w in t["workloads"]]
    assert all(t["E"] >= 1_000_000 and t["B"] == 16384 for t, _ in loads)
    # D and dtype at T=8 x E=2M; E 2M vs 10M at the same T; L 20 vs 80; the three id distributions
    assert {t["D"] for t in shapes if (t["T"], t["E"]) == (8, 2_000_000)} == {64, 128, 256}
    assert {t["precision"] for t in shapes if (t["T"], t["E"], t["D"]) == (8, 2_000_000, 128)} == {"FP32", "FP16"}
    assert {t["E"] for t in shapes if t["T"] == 2} == {2_000_000, 10_000_000}
    assert {w["L"] for _, w in loads} == {20, 80}
    assert {w["zipf_a"] for _, w in loads} == {None, 1.05, 1.2}
    big = [t for t in shapes if t["E"] == 10_000_000][0]
    assert {w["L"] for w in big["workloads"]} == {20, 80}
    for t, w in loads:
        assert w["name"] == f"L{w['L']}_" + ("uniform" if w["zipf_a"] is None else f"zipf{w['zipf_a']}")
        assert t["wbytes"] == (2 if t["precision"] == "FP16" else 4)
    # every table fits one H200 (139 GiB) by the estimate, with the margin
    for t in shapes:
        est = tbe_bench.memory_estimate(t, tbe_bench.PROD_METHODS, 3)
        assert est["peak"] + tbe_bench.MEMORY_MARGIN < 139 * GiB, t["name"]


def test_memory_estimate_by_hand(tbe_bench):
    t = dict(name="x", T=2, E=1000, D=16, precision="FP32", wbytes=4, B=8,
             workloads=[dict(name="a", L=3, dist="uniform", zipf_a=None),
                        dict(name="b", L=5, dist="uniform", zipf_a=None)])
    est = tbe_bench.memory_estimate(t, ("ours", "fbgemm_rowwise_adagrad", "fbgemm_sgd"), 2)
    # weights 2*1000*16*4 = 128000 B; FTRL state 2*1000*16*8 = 256000; row-wise Adagrad 2*1000*4
    assert est["per_method"] == {"ours": 384000, "fbgemm_rowwise_adagrad": 136000, "fbgemm_sgd": 128000}
    # two batches per workload: 8 B x (indices T*B*L + offsets T*B+1)
    assert est["batches"] == 2 * 8 * (48 + 17) + 2 * 8 * (80 + 17)
    # the largest L: 80 lookups x 128 B + 3 x (T*B*D*4 = 1024 B)
    assert est["workspace"] == 80 * tbe_bench.WORKSPACE_PER_LOOKUP + 3 * 1024
    assert est["peak"] == est["batches"] + est["workspace"] + 384000
    assert tbe_bench.table_bytes("fbgemm_adam_rbc", 2, 1000, 16, 2) == 2 * 1000 * (32 + 128 + 4)


def test_run_length_histogram_by_hand(tbe_bench):
    # T=2 tables of E=10 rows, 6 lookups each (feature-major):
    # table 0: row 0 x2, row 1 x1, row 2 x3; table 1: row 0 x1, row 3 x5 (row 0 of both tables differ)
    idx = torch.tensor([0, 0, 1, 2, 2, 2, 0, 3, 3, 3, 3, 3])
    h = tbe_bench.run_length_histogram(idx, 2, 10)
    assert h["lookups"] == 12 and h["unique_rows"] == 5 and h["max_run"] == 5
    assert h["rows_share"] == pytest.approx({"1": 2 / 5, "2-3": 2 / 5, "4-31": 1 / 5, ">=32": 0.0})
    assert h["lookups_share"] == pytest.approx({"1": 2 / 12, "2-3": 5 / 12, "4-31": 5 / 12, ">=32": 0.0})
    # one row looked up 40 times, one 31 times, one 4 times
    idx = torch.tensor([7] * 40 + [1] * 31 + [2] * 4)
    h = tbe_bench.run_length_histogram(idx, 1, 10)
    assert h["rows_share"] == pytest.approx({"1": 0.0, "2-3": 0.0, "4-31": 2 / 3, ">=32": 1 / 3})
    assert h["lookups_share"][">=32"] == pytest.approx(40 / 75) and h["max_run"] == 40


def test_run_length_histogram_matches_counter(tbe_bench):
    g = torch.Generator().manual_seed(0)
    T, E = 3, 50
    idx = torch.randint(0, E, (T * 200,), generator=g)
    h = tbe_bench.run_length_histogram(idx, T, E)
    counts = collections.Counter((t, int(r)) for t in range(T) for r in idx.view(T, -1)[t])
    U = len(counts)
    assert h["unique_rows"] == U and h["lookups"] == T * 200
    for name, lo, hi in (("1", 1, 1), ("2-3", 2, 3), ("4-31", 4, 31), (">=32", 32, 10 ** 9)):
        sel = [c for c in counts.values() if lo <= c <= hi]
        assert h["rows_share"][name] == pytest.approx(len(sel) / U)
        assert h["lookups_share"][name] == pytest.approx(sum(sel) / (T * 200))
    m = tbe_bench.mean_histogram([h, h])
    assert m["unique_rows"] == U and m["rows_share"] == pytest.approx(h["rows_share"])


def test_bytes_model_readme_case(tbe_bench):
    # benchmarks/README.md: D=128 fp32 uniform, N = 5,242,880, U = 2,578,456 -> 1.50 GB forward,
    # 8.06 GB backward, 9.55 GB per step
    fwd, bwd = tbe_bench.bytes_model("ours", 5_242_880, 2_578_456, 32, 8192, 128, 4)
    assert round(fwd / 1e9, 2) == 1.50 and round(bwd / 1e9, 2) == 8.06 and round((fwd + bwd) / 1e9, 2) == 9.55
    assert tbe_bench.bytes_model("fbgemm_adam", 10, 5, 1, 2, 4, 4) == tbe_bench.bytes_model("ours", 10, 5, 1, 2, 4, 4)
    f_sgd, b_sgd = tbe_bench.bytes_model("fbgemm_sgd", 10, 5, 1, 2, 4, 2)
    assert (f_sgd, b_sgd) == (10 * 8 + 5 * 4 * 2 + 2 * 4 * 4, 2 * 4 * 4 + 5 * 2 * 4 * 2)
    row = dict(lookups=5_242_880, unique_rows=2_578_456, T=32, B=8192, D=128, wbytes=4)
    bw, c, h = tbe_bench.bw_share("ours", row, 2.25, 4.25e12)
    assert bw == pytest.approx((fwd + bwd) / 2.25e-3) and c == pytest.approx(bw / 4.25e12)
    assert h == pytest.approx(bw / 4.8e12)


def test_bench_tbe_cuda_help():
    p = subprocess.run([sys.executable, os.path.join(BENCH, "bench_tbe_cuda.py"), "--help"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--suite {default,production}" in p.stdout and "--shapes" in p.stdout
    assert "--methods" in p.stdout and "ours_bf16" in "".join(p.stdout.split())   # argparse wraps long words


def test_bench_tbe_cuda_methods_flag_refuses_unknown():
    # checked before any CUDA call; ours_ignore and eager are not in the production suite
    for argv in (["--methods", "ours,nope"], ["--suite", "production", "--methods", "eager"]):
        p = subprocess.run([sys.executable, os.path.join(BENCH, "bench_tbe_cuda.py"), *argv],
                           capture_output=True, text=True, timeout=300, cwd=REPO)
        assert p.returncode == 2 and "--methods" in p.stderr, p.stderr[-2000:]


# ------------------------------------------------------------------------- bench_preset.py


def test_bench_preset_spread_of_repeats_by_hand():
    """Repeats 100k, 110k, 105k: mean 105k, spread (110k - 100k) / 105k = 9.5%; an unrepeated
    run or a failed repeat (no rate) is left out."""
    import bench_preset
    rows = [{"name": "scaled_rowwise_adagrad_8192_r1", "steady_examples_per_s": 100_000.0},
            {"name": "scaled_rowwise_adagrad_8192_r2", "steady_examples_per_s": 110_000.0},
            {"name": "scaled_rowwise_adagrad_8192_r3", "steady_examples_per_s": 105_000.0},
            {"name": "scaled_ftrl_derived_rowwise_8192_r1", "status": "exit 1"},
            {"name": "dlrm_main.py (DCN, scaled, 8192)", "steady_examples_per_s": 300_000.0}]
    lines = bench_preset.spread_lines(rows)
    assert lines[-1] == "| scaled_rowwise_adagrad_8192 (3) | 100,000, 110,000, 105,000 | 105,000 | 9.5% |"
    assert len(lines) == 4
    assert bench_preset.spread_lines(rows[3:]) == []


def test_bench_preset_ratios_over_the_same_repeat_by_hand():
    """FTRL 110k and 90k over row-wise Adagrad's 100k and 120k of the same repeats: 1.10x and 0.75x,
    the smallest 0.75x; an unrepeated pair 50k over 40k: 1.25x; a run without its row-wise Adagrad
    twin, a failed one, a profiled one and TorchRec's example are left out."""
    import bench_preset
    rows = [{"name": "full_rowwise_adagrad_8192_r1", "steady_examples_per_s": 100_000.0},
            {"name": "full_ftrl_derived_rowwise_8192_r1", "steady_examples_per_s": 110_000.0},
            {"name": "full_rowwise_adagrad_8192_r2", "steady_examples_per_s": 120_000.0},
            {"name": "full_ftrl_derived_rowwise_8192_r2", "steady_examples_per_s": 90_000.0},
            {"name": "full_ftrl_derived_rowwise_8192_r3", "steady_examples_per_s": 95_000.0},
            {"name": "full_ftrl_derived_bf16_8192_r1", "status": "exit 1"},
            {"name": "scaled_rowwise_adagrad_65536", "steady_examples_per_s": 40_000.0},
            {"name": "scaled_ftrl_derived_rowwise_65536", "steady_examples_per_s": 50_000.0},
            {"name": "scaled_ftrl_derived_rowwise_profiled_65536", "steady_examples_per_s": 9_000.0},
            {"name": "dlrm_main.py (DCN, scaled, 8192)", "steady_examples_per_s": 300_000.0}]
    lines = bench_preset.ratio_lines(rows)
    assert lines[3:] == ["| full_ftrl_derived_rowwise_8192 | 1.10x, 0.75x | 0.75x |",
                         "| scaled_ftrl_derived_rowwise_65536 | 1.25x | 1.25x |"]
    assert bench_preset.ratio_lines(rows[4:6]) == []


def test_bench_preset_passes_the_dense_flags_to_every_job_run(tmp_path, monkeypatch):
    import bench_preset
    a = bench_preset.build_parser().parse_args(["--out", str(tmp_path), "--dense-precision", "bf16",
                                                "--batches", "8192", "--compile-dense", "off"])
    b = bench_preset.Bench(a)
    seen = []
    monkeypatch.setattr(b, "run", lambda name, cmd, **kw: seen.append(cmd) or {})
    b.job("x", ["--rows-scale", "0.25"], 8192)
    assert seen[0][-6:] == ["--dense-precision", "bf16", "--compile-dense", "off",
                            "--dense-cuda-graphs", "auto"]
    steps = bench_preset.PresetSteps(b, a)
    assert (steps.small, steps.big) == (8192, 8192)
    with pytest.raises(SystemExit):
        bench_preset.build_parser().parse_args(["--repeats", "0"])
    # no --dense-precision: every run at the job's CUDA default, named (dlrm_main.py then runs only
    # where it can run that precision)
    bench_preset.main(["--out", str(tmp_path / "default"), "--skip", "1,2,3,4,5,6,7,8,9"])
    with open(tmp_path / "default" / "bench_preset.json") as f:
        written = json.load(f)
    assert written["dense_precision"] == "bf16" and written["compile_dense"] == "auto"
    assert written["dense_cuda_graphs"] == "auto"


# ------------------------------------------------------------------------- quality_pair.py


def test_quality_pair_by_hand(tmp_path):
    """Seeds 0-2 in both files, seed 3 in one: differences +0.001, +0.003, +0.002 (mean 0.002, sd
    0.001), so the 95% paired interval is 0.002 +/- t(0.975, 2) * 0.001 / sqrt(3) = 0.002 +/- 0.002484
    (t = 4.302653); it crosses +0.001, so the verdict is inconclusive."""
    import quality_pair

    def runs(aucs):
        return [{"dataset": "teacher", "batch": 8192, "variant": "ftrl", "seed": s, "auc": a}
                for s, a in aucs.items()]
    ref = runs({0: 0.780, 1: 0.781, 2: 0.782, 3: 0.9})
    other = runs({0: 0.781, 1: 0.784, 2: 0.784})
    (row,) = quality_pair.pair(ref, other)
    half = 4.302653 * 0.001 / 3 ** 0.5
    assert row["seeds"] == [0, 1, 2] and row["verdict"] == "inconclusive"
    assert row["d_auc"]["mean"] == pytest.approx(0.002, abs=1e-12)
    assert row["d_auc"]["lo"] == pytest.approx(0.002 - half, abs=1e-6)
    assert row["d_auc"]["hi"] == pytest.approx(0.002 + half, abs=1e-6)
    paths = []
    for name, r in (("ref", ref), ("other", other)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"runs": r}))
    quality_pair.main(["--reference", str(paths[0]), "--other", f"bf16={paths[1]}",
                       "--out", str(tmp_path / "pair")])
    md = (tmp_path / "pair.md").read_text()
    assert "| teacher | 8,192 | ftrl | 3 | 0.7810 | bf16 | 0.7830 | +0.0020 [-0.0005, +0.0045] | inconclusive |" in md
    with pytest.raises(SystemExit):
        quality_pair.main(["--reference", str(paths[0]), "--other", str(paths[1]), "--out", "x"])


@pytest.mark.parametrize("script", ["bench_dmp.py", "bench_uvm_caching.py"])
def test_bench_gpu_scripts_help(script):
    p = subprocess.run([sys.executable, os.path.join(BENCH, script), "--help"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    assert ("--optimizers" if script == "bench_dmp.py" else "--methods") in p.stdout


def test_state_bytes_by_method(tbe_bench):
    # one table of methods: ours' state from its optimizer_state_dtypes (8 B fp32, 4 B bf16 per element)
    assert tbe_bench.OURS["ours_bf16"][0] == {"accum": tbe_bench.SparseType.BF16, "linear": tbe_bench.SparseType.BF16}
    assert {m: tbe_bench.state_bytes_per_element(m) for m in ("ours", "ours_ignore", "ours_bf16", "eager")} == \
        {"ours": 8, "ours_ignore": 8, "ours_bf16": 4, "eager": 8}
    assert set(tbe_bench.STATE_BYTES) == set(tbe_bench.LABELS)
    assert set(tbe_bench.DEFAULT_METHODS) == set(tbe_bench.LABELS)
    assert set(tbe_bench.PROD_METHODS) <= set(tbe_bench.DEFAULT_METHODS) and "ours_bf16" in tbe_bench.PROD_METHODS
    # D=128: per row 1024 B of fp32 state, 512 B of bf16 state; row-wise Adagrad 4 B, ADAM rbc 1024 + 4
    assert [tbe_bench.state_bytes_per_row(m, 128) for m in
            ("ours", "ours_bf16", "fbgemm_adam", "fbgemm_adam_rbc", "fbgemm_rowwise_adagrad", "fbgemm_sgd")] == \
        [1024, 512, 1024, 1028, 4, 0]


def test_bytes_model_bf16_state_by_hand(tbe_bench):
    # D=128 fp32 weights: an updated row's weight + state is 512 + 1024 = 1,536 B with fp32 state and
    # 512 + 512 = 1,024 B with bf16 state, each read and written once in the backward.
    # N=10 lookups, U=5 unique rows, T=1, B=2: forward 10*8 + 5*512 + 2*512 = 3,664 B for both;
    # backward 2*512 (output gradients) + 5 * 2 * 1,536 = 16,384 B (fp32), + 5 * 2 * 1,024 = 11,264 B (bf16)
    assert tbe_bench.bytes_model("ours", 10, 5, 1, 2, 128, 4) == (3664, 16384)
    assert tbe_bench.bytes_model("ours_bf16", 10, 5, 1, 2, 128, 4) == (3664, 11264)
    # fp16 weights, D=64: a row is 128 B of weight + 256 B of bf16 state (fp32: 512 B)
    assert tbe_bench.bytes_model("ours_bf16", 10, 5, 1, 2, 64, 2)[1] == 2 * 256 + 5 * 2 * (128 + 256)
    # the README case with bf16 state: backward 134,217,728 + 2,578,456 x 2,048 B = 5.41 GB, 6.91 GB per step
    fwd, bwd = tbe_bench.bytes_model("ours_bf16", 5_242_880, 2_578_456, 32, 8192, 128, 4)
    assert bwd == 134_217_728 + 2_578_456 * 2048
    assert round(fwd / 1e9, 2) == 1.50 and round(bwd / 1e9, 2) == 5.41 and round((fwd + bwd) / 1e9, 2) == 6.91
    # memory: T=2 x 1000 x 16 fp32 weights 128,000 B + bf16 state 2*1000*16*4 = 128,000 B
    t = dict(name="x", T=2, E=1000, D=16, precision="FP32", wbytes=4, B=8,
             workloads=[dict(name="a", L=3, dist="uniform", zipf_a=None)])
    est = tbe_bench.memory_estimate(t, ("ours", "ours_bf16"), 1)
    assert est["per_method"] == {"ours": 384000, "ours_bf16": 256000}
    assert est["peak"] == est["batches"] + est["workspace"] + 384000
    assert tbe_bench.memory_estimate(t, ("ours_bf16",), 1)["peak"] == est["batches"] + est["workspace"] + 256000


# ------------------------------------------------------------------------- bench_uvm_caching.py


@pytest.fixture(scope="module")
def uvm():
    import bench_uvm_caching
    return bench_uvm_caching


def test_uvm_caching_row_bytes(uvm):
    # an inserted / evicted row moves the weight and (ours) accum + linear at the cache row, D=128 fp32
    assert [uvm.row_bytes(m, 128) for m in uvm.CACHED_METHODS] == [1536, 1024, 512, 512]
    assert set(uvm.METHODS + uvm.LEAN_METHODS) == set(uvm.LABELS) and set(uvm.CACHED_METHODS) == set(uvm.CACHED_STATE_BYTES)
    assert uvm.OURS_STATE_DTYPES["ours"] is None and set(uvm.OURS_STATE_DTYPES["ours_bf16"]) == {"accum", "linear"}
    # state left in unified memory per unique row: ADAM m + v = 2 x 128 x 4; row-wise Adagrad 4 B -> one 32 B sector
    assert [uvm.uvm_state_bytes(m, 128) for m in uvm.CACHED_METHODS] == [0, 0, 32, 1024]
    # lean layouts: derived weights (no weight row), z and n in fp32 / bf16, n per element or per row
    assert [uvm.row_bytes(m, 128) for m in uvm.LEAN_METHODS] == [1024, 512, 516, 258]
    assert [uvm.forward_row_bytes(m, 128) for m in uvm.LEAN_METHODS] == [1024, 512, 516, 258]
    assert [uvm.uvm_state_bytes(m, 128) for m in uvm.LEAN_METHODS] == [0, 0, 0, 0]
    c = dict(inserted=10, uncached=2, unique=20, evicted=4)
    b_in, b_out, _ = uvm.traffic_bytes("ours_derived_rowwise_fp32", 128, c)
    assert (b_in, b_out) == (10 * 516 + 2 * (516 + 516), 4 * 516 + 2 * 516)
    assert uvm.uvm_state_bytes("fbgemm_adam", 4) == 32 and uvm.uvm_state_bytes("fbgemm_adam", 12) == 96


def test_uvm_step_counts_by_hand(uvm):
    # stats: calls, requested, unique, unique misses, misses left uncached, uncached lookups; then occupied
    prev = [3, 300, 200, 90, 2, 5, 1000]
    cur = [4, 400, 260, 120, 3, 9, 1004]
    c = uvm.step_counts(prev, cur)
    # 30 misses, 1 left uncached -> 29 inserted; 4 into empty slots -> 25 evicted
    assert c == dict(calls=1, lookups=100, unique=60, misses=30, uncached=1, inserted=29, filled=4, evicted=25)
    assert not uvm.is_steady_step(c, 0.01)           # grew by 4 > 1% of 29
    assert uvm.is_steady_step(c, 0.2)                # 4 <= 5.8
    assert uvm.is_steady_step(dict(c, filled=0, evicted=29))
    assert not uvm.is_steady_step(dict(c, inserted=0, filled=0, evicted=0))   # nothing evicted
    assert uvm.per_step(dict(a=10, b=5), 5) == dict(a=2.0, b=1.0)


def test_uvm_steady_state_streak(uvm):
    det = uvm.SteadyState(window=3, fill_tol=0.0)
    good = dict(inserted=10, filled=0, evicted=10)
    cold = dict(inserted=10, filled=10, evicted=0)
    seq = [cold, good, good, cold, good, good]
    assert [det.update(c) for c in seq] == [False] * 6 and det.streak == 2 and det.steps == 6
    assert det.update(good) and det.reached and det.steps == 7


def test_uvm_traffic_model_by_hand(uvm):
    # per step: 1,000 unique rows, 300 inserted, 10 uncached, 250 evicted, D=128 fp32 weights
    c = dict(unique=1000, inserted=300, uncached=10, evicted=250)
    b_in, b_out, parts = uvm.traffic_bytes("ours", 128, c)
    # ours: in 300 x 1,536 + 10 x (512 + 1,536); out 250 x 1,536 + 10 x 1,536
    assert (b_in, b_out) == (300 * 1536 + 10 * 2048, 250 * 1536 + 10 * 1536)
    assert parts["state_in"] == parts["state_out"] == 0
    b_in, b_out, _ = uvm.traffic_bytes("ours_bf16", 128, c)
    assert (b_in, b_out) == (300 * 1024 + 10 * 1536, 260 * 1024)
    # FBGEMM row-wise Adagrad: weights only in the cache (512 B), its 4 B per row of state in UVM (32 B)
    b_in, b_out, _ = uvm.traffic_bytes("fbgemm_rowwise_adagrad", 128, c)
    assert (b_in, b_out) == (300 * 512 + 10 * 1024 + 1000 * 32, 260 * 512 + 1000 * 32)
    # ADAM: m + v of every unique row read and written in UVM, 1,024 B each way
    b_in, b_out, _ = uvm.traffic_bytes("fbgemm_adam", 128, c)
    assert (b_in, b_out) == (300 * 512 + 10 * 1024 + 1000 * 1024, 260 * 512 + 1000 * 1024)
    # report: 50 GB/s in, 40 GB/s out, a 2 ms step
    r = uvm.traffic_report("ours", 128, c, 2.0, 50e9, 40e9)
    assert r["floor_in_ms"] == pytest.approx(1e3 * (300 * 1536 + 10 * 2048) / 50e9)
    assert r["floor_out_ms"] == pytest.approx(1e3 * 260 * 1536 / 40e9)
    assert r["floor_ms"] == max(r["floor_in_ms"], r["floor_out_ms"])
    assert r["share_of_h2d"] == pytest.approx(r["floor_in_ms"] / 2.0) and not r["model_over_100"]
    # the same bytes in 0.005 ms would need more than the link: flagged
    assert uvm.traffic_report("ours", 128, c, 0.005, 50e9, 40e9)["model_over_100"]


def test_uvm_batch_stream_on_cpu(uvm):
    s = uvm.BatchStream(2, 1000, 8, 5, "zipf", 1.1, seed=3, device="cpu")
    idx, off = s.next()
    assert idx.shape == (2 * 8 * 5,) and idx.dtype == torch.int64 and off.tolist() == list(range(0, 81, 5))
    assert int(idx.min()) >= 0 and int(idx.max()) < 1000
    second = s.next()[0]
    assert not torch.equal(idx, second)              # a fresh batch per call
    s.restart()
    assert torch.equal(s.next()[0], idx) and torch.equal(s.next()[0], second)   # the same sequence again
    # Zipf: rank 0 (row perms[t][0]) is the most frequent row of each table
    s = uvm.BatchStream(2, 1000, 256, 20, "zipf", 1.1, seed=0, device="cpu")
    big = torch.cat([s.next()[0].view(2, -1) for _ in range(5)], 1)
    for t in range(2):
        assert int(torch.bincount(big[t], minlength=1000).argmax()) == int(s.perms[t][0])
    u = uvm.BatchStream(1, 50, 4, 3, "uniform", seed=1, device="cpu").next()[0]
    assert u.shape == (12,) and int(u.max()) < 50


class _SetLRU:
    """A CPU model of FBGEMM's set-associative LRU cache as the benchmark sees it: per populate, the
    batch's unique rows; hits refresh their slot's time; misses of a set take its least recently
    used slots, oldest first, but never a slot used by this batch (then they stay uncached); the
    statistics in FBGEMM's order, the conflict misses counted by the lookup after the populate."""

    def __init__(self, rows, slots, ways=32):
        self.C, self.W = slots // ways, ways
        self.state = np.full((self.C, ways), -1, np.int64)
        self.ts = np.zeros((self.C, ways), np.int64)
        self.stats = np.zeros(6, np.int64)
        self.t = 1

    def set_of(self, keys):
        x = keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(29)
        return (x % np.uint64(self.C)).astype(np.int64)

    def populate(self, keys):
        self.t += 1
        t, W = self.t, self.W
        u = np.unique(keys)
        sets = self.set_of(u)
        match = self.state[sets] == u[:, None]
        hit = match.any(1)
        self.ts[sets[hit], match[hit].argmax(1)] = t
        mk, ms = u[~hit], sets[~hit]
        order = np.lexsort((mk, ms))
        mk, ms = mk[order], ms[order]
        self.stats[:4] += (1, keys.size, u.size, mk.size)
        if mk.size:
            first = np.r_[0, np.flatnonzero(np.diff(ms)) + 1]
            run = np.diff(np.r_[first, ms.size])
            rank = np.arange(ms.size) - np.repeat(first, run)
            useq, inv = np.unique(ms, return_inverse=True)
            slot_order = np.argsort(self.ts[useq], axis=1, kind="stable")
            cost = np.take_along_axis(self.ts[useq], slot_order, 1)
            r = np.minimum(rank, W - 1)
            ok = (rank < W) & (cost[inv, r] != t)
            slot = slot_order[inv[ok], r[ok]]
            self.state[ms[ok], slot] = mk[ok]
            self.ts[ms[ok], slot] = t
            self.stats[4] += int((~ok).sum())
        self.stats[5] += int((~(self.state[self.set_of(keys)] == keys[:, None]).any(1)).sum())


class _FakeCachedTBE(torch.nn.Module):
    """Stands in for a cached TBE in ``bench_uvm_caching.measure`` on CPU (the cache model above)."""

    def __init__(self, T, E, D, slots):
        super().__init__()
        self.T, self.E, self.D = T, E, D
        self.sim = _SetLRU(T * E, slots)
        self.p = torch.nn.Parameter(torch.zeros(()))

    @property
    def lxu_cache_state(self):
        return torch.from_numpy(self.sim.state)

    def forward(self, idx, off):
        per = idx.numel() // self.T
        keys = idx.numpy() + np.repeat(np.arange(self.T) * self.E, per)
        self.sim.populate(keys)
        return torch.zeros((off.numel() - 1) // self.T, self.T * self.D) + self.p

    def get_uvm_cache_stats(self):
        return torch.from_numpy(self.sim.stats.copy())

    def reset_uvm_cache_stats(self):
        self.sim.stats[:] = 0

    def reset_cache_states(self):
        self.sim.state[:] = -1
        self.sim.ts[:] = 0
        self.sim.t = 1


class _FakeEvent:
    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return 1e3 * (other.t - self.t)


def _measure_fake(uvm, monkeypatch, dist, load_factor, max_warmup=400, T=2, E=2000, B=16, L=5, iters=40):
    monkeypatch.setattr(uvm, "_event", _FakeEvent)
    monkeypatch.setattr(uvm, "_sync", lambda: None)
    slots = -(-int(T * E * load_factor) // 32) * 32
    m = _FakeCachedTBE(T, E, 16, slots)
    args = SimpleNamespace(B=B, T=T, D=16, window=5, fill_tol=0.01, max_warmup=max_warmup, iters=iters,
                           hbm_warmup=2, rates=dict(h2d=50e9, d2h=50e9))
    stream = uvm.BatchStream(T, E, B, L, dist, 1.1, seed=0, device="cpu")
    return uvm.measure(m, "ours", load_factor, stream, args)


def test_uvm_measure_reaches_steady_state_on_a_cache_model(uvm, monkeypatch):
    # uniform ids, load factor 0.2: the cache fills within a few steps, then every insert evicts
    r = _measure_fake(uvm, monkeypatch, "uniform", 0.2)
    assert r["steady"] and r["full"] and r["occupancy"] == 1.0 and r["warmup_steps"] < 50
    assert r["filled_per_step"] == 0 and r["evictions_per_step"] == r["inserted_per_step"] > 0
    assert r["unique_per_step"] > 0 and r["hit_rate"] == pytest.approx(0.2, abs=0.05)   # LRU on uniform ids
    assert r["in_bytes_per_step"] == pytest.approx(r["inserted_per_step"] * 16 * 12 + r["uncached_per_step"] * 16 * 16)
    assert r["out_bytes_per_step"] == pytest.approx((r["evictions_per_step"] + r["uncached_per_step"]) * 16 * 12)
    assert r["steady_during_timing"] and r["warmup_trace"][-1]["step"] == r["warmup_steps"]
    # load factor 1.0: some sets hash fewer rows than their 32 slots and never fill, yet the cache
    # stops growing once every row was seen: steady, not full
    r = _measure_fake(uvm, monkeypatch, "uniform", 1.0)
    assert r["steady"] and not r["full"] and 0.8 < r["occupancy"] < 1.0
    assert r["filled_per_step"] <= 0.01 * r["inserted_per_step"] and r["evictions_per_step"] > 0
    # Zipf ids at load factor 1.0 keep bringing first-seen rows: not steady within 30 steps, and said so
    r = _measure_fake(uvm, monkeypatch, "zipf", 1.0, max_warmup=30)
    assert not r["steady"] and r["warmup_steps"] == 30


class _FakeHBMTBE(torch.nn.Module):
    def __init__(self, T, D):
        super().__init__()
        self.T, self.D = T, D
        self.p = torch.nn.Parameter(torch.zeros(()))

    def forward(self, idx, off):
        return torch.zeros((off.numel() - 1) // self.T, self.T * self.D) + self.p


def test_uvm_main_end_to_end_on_cpu(uvm, monkeypatch, tmp_path):
    # main() with the TBEs replaced by the cache model and the copy rates fixed: every (method,
    # load factor, dist) row is written to the JSON and the markdown, the failed build is reported
    monkeypatch.setattr(uvm, "_event", _FakeEvent)
    monkeypatch.setattr(uvm, "_sync", lambda: None)
    monkeypatch.setattr(uvm, "DEVICE", "cpu")
    monkeypatch.setattr(uvm, "pcie_rates", lambda: dict(h2d=50e9, d2h=50e9, duplex_h2d=40e9, duplex_d2h=40e9))

    def build(method, T, E, D, lf):
        if method == "fbgemm_adam":
            raise RuntimeError("no ADAM here")
        return _FakeHBMTBE(T, D) if lf is None else _FakeCachedTBE(T, E, D, -(-int(T * E * lf) // 32) * 32)
    monkeypatch.setattr(uvm, "build", build)
    uvm.main(["--out", str(tmp_path), "--E", "1000", "--B", "8", "--L", "5", "--D", "16", "--iters", "5",
              "--max-warmup", "200", "--load-factors", "0.1,1", "--methods", "ours,fbgemm_adam,ours_hbm"])
    res = json.loads((tmp_path / "uvm_caching.json").read_text())
    rows = res["rows"]
    keys = [(r["method"], r["load_factor"], r["dist"]) for r in rows]
    assert keys == [("ours_hbm", None, "zipf"), ("ours_hbm", None, "uniform"),
                    ("ours", 0.1, "zipf"), ("ours", 0.1, "uniform"),
                    ("fbgemm_adam", 0.1, "zipf"), ("fbgemm_adam", 0.1, "uniform"),
                    ("ours", 1.0, "zipf"), ("ours", 1.0, "uniform"),
                    ("fbgemm_adam", 1.0, "zipf"), ("fbgemm_adam", 1.0, "uniform")]
    assert res["h2d_GBps"] == 50 and res["duplex_d2h_GBps"] == 40 and res["iters"] == 5
    ok = [r for r in rows if r["method"] == "ours"]
    assert all(r["steady"] for r in ok if r["load_factor"] == 0.1)
    assert all("hit_rate" in r and "share_of_h2d" in r and r["build_s"] >= 0 for r in ok)
    assert all(r["error"] == "RuntimeError: no ADAM here" for r in rows if r["method"] == "fbgemm_adam")
    md = (tmp_path / "uvm_caching.md").read_text()
    assert md.count("| 0.1 | ours | yes (") == 2 and "| HBM | ours_hbm | | |" in md
    # --time-budget: past the budget nothing more is measured, and the rows say so
    uvm.main(["--out", str(tmp_path), "--E", "1000", "--B", "8", "--L", "5", "--D", "16", "--iters", "2",
              "--methods", "ours", "--load-factors", "0.5", "--dists", "zipf", "--time-budget", "1e-9"])
    rows = json.loads((tmp_path / "uvm_caching.json").read_text())["rows"]
    assert rows == [dict(method="ours", dist="zipf", load_factor=0.5, skipped="skipped: --time-budget")]


def test_uvm_markdown_renders(uvm):
    meta = dict(device="H200", torch="2.x", fbgemm_gpu="1.6.0", shape=dict(T=2, E=10_000_000, D=128, B=16384, L=20),
                h2d_GBps=55.5, d2h_GBps=55.3, duplex_h2d_GBps=50.0, duplex_d2h_GBps=49.0, window=5, fill_tol=0.01,
                max_warmup=400, iters=50, dists=["zipf", "uniform"])
    c = dict(unique=150_000, inserted=60_000, uncached=0, evicted=60_000)
    row = dict(method="ours", dist="zipf", load_factor=0.2, steady=True, warmup_steps=120, occupancy=1.0, ms=3.0,
               hit_rate=0.6, misses_per_step=60_000, evictions_per_step=60_000,
               **uvm.traffic_report("ours", 128, c, 3.0, 55.5e9, 55.3e9))
    rows = [row, dict(row, load_factor=1.0, steady=False, warmup_steps=400, occupancy=0.7),
            dict(method="ours_hbm", dist="zipf", load_factor=None, ms=1.1),
            dict(method="fbgemm_adam", dist="uniform", load_factor=0.05, error="RuntimeError: x")]
    md = uvm.markdown(meta, rows)
    # 60,000 x 1,536 B = 92.16 MB each way; 92.16e6 / 55.5e9 = 1.66 ms in, / 55.3e9 = 1.67 ms out; of 3 ms
    assert "| 0.2 | ours | yes (120) | 100.0% | 3.00 | 0.600 | 60,000 | 60,000 | 92.2 | 1.66 | 55% | 92.2 | 1.67 | 56% |" in md
    assert "| 1 | ours | NO (400) | 70.0% |" in md
    assert "| HBM | ours_hbm | | | 1.10 |" in md
    assert "## uniform ids" in md and "| 0.05 | fbgemm_adam | RuntimeError: x |" in md
    widths = {line.count("|") for line in md.splitlines() if line.startswith("| ")}
    assert widths == {15}


def test_uvm_parse_args(uvm):
    a = uvm.parse_args([])
    assert (a.E, a.B, a.max_warmup, a.iters, a.load_factors, a.dists) == \
        (10_000_000, 16384, 400, 100, [0.05, 0.2, 1.0], ["zipf", "uniform"])
    assert a.methods == list(uvm.METHODS)
    q = uvm.parse_args(["--quick", "--methods", "ours_hbm,ours", "--load-factors", "0.5", "--dists", "uniform"])
    assert (q.E, q.B, q.max_warmup, q.iters, q.methods, q.load_factors, q.dists) == \
        (200_000, 2048, 60, 10, ["ours", "ours_hbm"], [0.5], ["uniform"])
    for bad in (["--methods", "nope"], ["--load-factors", "0"], ["--load-factors", "x"], ["--dists", "normal"]):
        with pytest.raises(SystemExit):
            uvm.parse_args(bad)


def test_production_markdown_renders(tbe_bench):
    row = dict(table="T8_E2M_D128_fp32", workload="L20_uniform", T=8, E=2_000_000, B=16384, L=20, D=128,
               precision="FP32", wbytes=4, dist="uniform", zipf_a=None, ids="uniform", lookups=2_621_440,
               unique_rows=2.2e6, max_run=6, rows_share={"1": 0.8, "2-3": 0.19, "4-31": 0.01, ">=32": 0.0},
               lookups_share={"1": 0.6, "2-3": 0.35, "4-31": 0.05, ">=32": 0.0},
               ms={"ours": 3.0, "fbgemm_adam_rbc": 4.5, "fbgemm_sgd": 2.0}, fwd_ms={}, device_ms={"ours": 2.9},
               errors={"fbgemm_adam": "RuntimeError: dtype"})
    meta = dict(device="H200", torch="2.x", fbgemm_gpu="1.6.0", copy_bw=4.25e12, warmup=3, iters=10, batches=3,
                host_floor_ms={"ours": 1.0}, phases_s={"build": 1.0},
                tables=[dict(name="T8_E2M_D128_fp32", estimate_gib=25.2, free_gib=130.0, peak_gib={"ours": 24.0})])
    md = tbe_bench.production_markdown(meta, [row, dict(table="T2_x", workload="L20_uniform", skipped="skipped: x")])
    assert "| T8_E2M_D128_fp32 | 20 | uniform | 2,621,440 |" in md
    assert "4.500*" in md and "1.50x*" in md and "| fails |" not in md.split("Compulsory")[0].split("ROWWISE")[0]
    assert f"{2.9e6 / 2.2e6:.2f}" in md   # ns per unique row


def test_production_markdown_bf16_and_rowwise_ratios(tbe_bench):
    row = dict(table="T8_E2M_D128_fp32", workload="L20_uniform", T=8, E=2_000_000, B=16384, L=20, D=128,
               precision="FP32", wbytes=4, dist="uniform", zipf_a=None, ids="uniform", lookups=2_621_440,
               unique_rows=2e6, max_run=6, rows_share={"1": 0.8, "2-3": 0.19, "4-31": 0.01, ">=32": 0.0},
               lookups_share={"1": 0.6, "2-3": 0.35, "4-31": 0.05, ">=32": 0.0},
               ms={"ours": 3.0, "ours_bf16": 2.5, "fbgemm_rowwise_adagrad": 2.0, "fbgemm_adam": 4.0,
                   "fbgemm_sgd": 1.6},
               fwd_ms={}, device_ms={"ours": 2.8, "ours_bf16": 2.4}, errors={})
    meta = dict(device="H200", torch="2.x", fbgemm_gpu="1.6.0", copy_bw=4.25e12, warmup=3, iters=10, batches=3,
                host_floor_ms={"ours": 1.0, "ours_bf16": 1.0}, phases_s={},
                tables=[dict(name="T8_E2M_D128_fp32", estimate_gib=25.0, free_gib=130.0,
                             peak_gib={"ours": 24.0, "ours_bf16": 17.0})])
    md = tbe_bench.production_markdown(meta, [row])
    # step times: ours, kernel, ns/U, bf16, kernel, ns/U, ROWWISE_ADAGRAD, ADAM, SGD, then each vs ROWWISE_ADAGRAD
    assert ("| T8_E2M_D128_fp32 | 20 | uniform | 3.000 | 2.800 | 1.40 | 2.500 | 2.400 | 1.20 | 2.000 | 4.000 | "
            "1.600 | 0.67x | 0.80x | 0.50x | 1.25x |") in md
    # ours vs ADAM, ours vs SGD, bf16 vs ADAM, bf16 vs SGD, bf16 vs ours
    assert "| T8_E2M_D128_fp32 | 20 | uniform | 1.33x | 0.53x | 1.60x | 0.64x | 1.20x |" in md
    # traffic: bf16 moves U * 2 * 512 B less than fp32 state
    f32 = sum(tbe_bench.bytes_model("ours", 2_621_440, 2e6, 8, 16384, 128, 4))
    b16 = sum(tbe_bench.bytes_model("ours_bf16", 2_621_440, 2e6, 8, 16384, 128, 4))
    assert f32 - b16 == 2e6 * 1024 and f"| {f32 / 1e9:.2f} |" in md and f"| {b16 / 1e9:.2f} |" in md
    assert "torchrec_ftrl FTRL (Triton), bf16 state" in md and "| 17.0 |" in md


# -------------------------------------------------------------------------------- bench_dmp.py


def _ev(name, start, end, parent=None, kernels=(), device=False, cpu_total=None, cpu_self=None):
    from torch.autograd import DeviceType
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), cpu_parent=parent,
                           kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels],
                           device_type=DeviceType.CUDA if device else DeviceType.CPU,
                           cpu_time_total=cpu_total if cpu_total is not None else end - start,
                           self_cpu_time_total=cpu_self if cpu_self is not None else end - start)


def test_dmp_classify_kernel():
    import bench_dmp as b
    assert b.classify_kernel("void at::native::elementwise", ["aten::add", "_FTRLLookupFunction"], "ours") == "tbe"
    assert b.classify_kernel("segment_update_kernel", [], "ours") == "tbe"
    # the CUDA host path's one op and its C++ autograd node (the sort it runs in the backward)
    assert b.classify_kernel("DeviceRadixSortOnesweepKernel", ["fbgemm::get_unique_indices_with_inverse",
                             "torch::autograd::CppNode<(anonymous namespace)::TrainLookup>"], "ours") == "tbe"
    assert b.classify_kernel("k", ["torchrec_ftrl_host::train_lookup"], "ours") == "tbe"
    assert b.classify_kernel("DeviceRadixSortOnesweepKernel", [], "fbgemm") == "tbe"
    assert b.classify_kernel("k", ["fbgemm::split_embedding_codegen_lookup_adam_function_pt2"], "fbgemm") == "tbe"
    assert b.classify_kernel("k", ["torch::autograd::CppNode<SplitLookupFunction_adam_Op_pt2>"], "fbgemm") == "tbe"
    # ours' names do not count as TBE for a FBGEMM config, nor FBGEMM's for ours
    assert b.classify_kernel("k", ["_FTRLLookupFunction"], "fbgemm") == "torchrec_other"
    assert b.classify_kernel("ncclDevKernel_SendRecv", ["nccl:all_to_all"], "ours") == "all_to_all"
    assert b.classify_kernel("k", ["fbgemm::block_bucketize_sparse_features", "bench_dmp.forward"],
                             "ours") == "permute_kjt"
    assert b.classify_kernel("k", ["aten::pow", "bench_dmp.loss"], "ours") == "loss"
    assert b.classify_kernel("k", ["autograd::engine::evaluate_function: MeanBackward0"], "ours") == "loss"
    assert b.classify_kernel("k", ["aten::cat", "bench_dmp.forward"], "ours") == "torchrec_other"
    assert b._union_us([(0, 2), (1, 3), (5, 6)]) == 4


def test_dmp_breakdown_fake_profile():
    import bench_dmp as b
    # two steps of 100 us. Linked to CPU ops: ours' forward launches a Triton kernel (20 us), TorchRec's
    # permute one (5 us), the loss one (1 us), ours' backward one (30 us); one NCCL kernel (10 us) is
    # linked to no op (classified by its name). Device busy: [10, 35) + [60, 61) in step 1,
    # [110, 150) in step 2: 66 of 200 us.
    s1, s2 = _ev("bench_dmp.step", 0, 100), _ev("bench_dmp.step", 100, 200)
    fwd = _ev("bench_dmp.forward", 1, 50, s1, cpu_total=49)
    ours = _ev("_FTRLLookupFunction", 5, 25, fwd, kernels=[("tbe_forward_kernel", 20)], cpu_total=20, cpu_self=15)
    perm = _ev("fbgemm::permute_2D_sparse_data", 2, 4, fwd, kernels=[("permute_kernel", 5)])
    loss = _ev("aten::pow", 51, 52, _ev("bench_dmp.loss", 50, 53, s1), kernels=[("vectorized_elementwise", 1)])
    bwd = _ev("_FTRLLookupFunctionBackward", 120, 150, _ev("autograd::engine::evaluate_function: "
                                                           "_FTRLLookupFunctionBackward", 119, 151),
              kernels=[("segment_update_kernel", 30)], cpu_total=30, cpu_self=10)
    dev = [_ev("tbe_forward_kernel", 10, 30, device=True), _ev("permute_kernel", 30, 35, device=True),
           _ev("vectorized_elementwise", 60, 61, device=True), _ev("segment_update_kernel", 110, 140, device=True),
           _ev("ncclDevKernel_SendRecv", 140, 150, device=True)]
    # record_function ranges projected onto the GPU timeline count as no device work
    a2a = _ev("## all2all_data:kjt splits ##", 2, 3, fwd, kernels=[("## all2all_data:kjt splits ##", 40)])
    a2a.is_user_annotation = True
    fwd.kernels = [SimpleNamespace(name="bench_dmp.forward", duration=60)]
    dev += [_ev("bench_dmp.step", 0, 100, device=True), _ev("## all2all_data:kjt splits ##", 2, 42, device=True)]
    r = b.breakdown([s1, s2, fwd, ours, perm, loss, bwd, a2a] + dev, 2, "ours")
    assert r["step_ms"] == pytest.approx(0.1)
    assert r["device_ms"] == pytest.approx({"tbe": 0.025, "permute_kjt": 0.0025, "loss": 0.0005,
                                            "all_to_all": 0.005})
    assert r["device_total_ms"] == pytest.approx(0.033) and r["linked_share"] == pytest.approx(56 / 66)
    assert r["gpu_busy_ms"] == pytest.approx(0.033) and r["gpu_idle_ms"] == pytest.approx(0.067)
    h = r["host_ms"]
    assert h["tbe_forward"] == pytest.approx(0.01) and h["tbe_forward_self"] == pytest.approx(0.0075)
    assert h["tbe_backward"] == pytest.approx(0.015) and h["tbe_backward_self"] == pytest.approx(0.005)
    assert h["torchrec_forward"] == pytest.approx((49 - 20) / 2 / 1e3)
    assert r["top_kernels"]["tbe"][0][0] == "segment_update_kernel"
    # FBGEMM's names, for a baseline config
    fb = _ev("fbgemm::split_embedding_codegen_lookup_adam_function_pt2", 5, 25, fwd,
             kernels=[("split_embedding_codegen_forward_unweighted_kernel", 20)], cpu_total=20)
    node = _ev("autograd::engine::evaluate_function: torch::autograd::CppNode<SplitLookupFunction_adam_Op_pt2>",
               119, 151, kernels=[("split_embedding_backward_codegen_adam_unweighted_kernel_warp_per_row_1", 30)])
    inner = _ev("torch::autograd::CppNode<SplitLookupFunction_adam_Op_pt2>", 120, 150, node, cpu_total=30)
    r = b.breakdown([s1, s2, fwd, fb, node, inner], 2, "fbgemm")
    assert r["device_ms"] == pytest.approx({"tbe": 0.025}) and r["gpu_idle_ms"] is None
    assert r["host_ms"]["tbe_forward"] == pytest.approx(0.01)
    assert r["host_ms"]["tbe_backward"] == pytest.approx(0.016)   # the outer node range only


def test_dmp_host_time_of_the_cuda_host_path_op():
    """On the CUDA host path the TBE's host ranges are the op torchrec_ftrl_host::train_lookup and
    its C++ autograd node (the Python fallback op nested in the node counted once)."""
    import bench_dmp as b
    fwd = _ev("torchrec_ftrl_host::train_lookup", 5, 25, cpu_total=20, cpu_self=15)
    node = _ev("torch::autograd::CppNode<(anonymous namespace)::TrainLookup>", 120, 150, cpu_total=30, cpu_self=10)
    inner = _ev("torchrec_ftrl_host_py::backward_fallback", 121, 149, node)
    assert b._tbe_host_us([fwd, node, inner], "ours") == (20, 15, 30, 10)


def test_dmp_parse_and_skips():
    import bench_dmp as b
    a = b.parse(["--device", "cpu", "--optimizers", "ftrl,sgd", "--sharding", "table_wise"])
    assert a.optimizer_list == ["ftrl", "sgd"] and a.sharding_list == ["table_wise"] and a.batch == 8192
    assert b.parse([]).optimizer_list == ["ftrl", "ftrl_bf16", "rowwise_adagrad", "adam", "sgd"]
    assert b.parse(["--optimizers", "ftrl_bf16"]).optimizer_list == ["ftrl_bf16"]
    with pytest.raises(SystemExit):
        b.parse(["--optimizers", "adagrad"])
    sh = [SimpleNamespace(sharding_types=lambda dev: ["table_wise"] + (["row_wise"] if dev == "cuda" else []))]
    assert "no ADAM" in b.skip_reason("adam", "table_wise", torch.device("cpu"), sh)
    assert "row_wise" in b.skip_reason("sgd", "row_wise", torch.device("cpu"), sh)
    assert b.skip_reason("sgd", "row_wise", torch.device("cuda"), sh) is None


def test_dmp_ftrl_bf16_fused_params():
    import bench_dmp as b
    from torchrec_ftrl.fbgemm_enums import SparseType
    fp = b.fused_params("ftrl_bf16", 0.01)
    assert fp["optimizer_state_dtypes"] == {"accum": SparseType.BF16, "linear": SparseType.BF16}
    assert "optimizer_state_dtypes" not in b.fused_params("ftrl", 0.01)
    assert {k: v for k, v in fp.items() if k != "optimizer_state_dtypes"} == b.fused_params("ftrl", 0.01)
    # torchrec_ftrl.sharders holds the hashable form TorchRec groups tables by
    sh = b.make_sharders("ftrl_bf16", 0.01)
    bf16 = SparseType.BF16.as_int()
    assert sh[0].fused_params["optimizer_state_dtypes"] == frozenset({("accum", bf16), ("linear", bf16)})
    hash(frozenset(sh[0].fused_params.items()))
    assert "optimizer_state_dtypes" not in b.make_sharders("ftrl", 0.01)[0].fused_params
    # the report: ftrl_bf16 beside ftrl, ratios vs ROWWISE_ADAGRAD (first) and ADAM, same sharding
    rows = [dict(optimizer=o, sharding="table_wise", throughput_ms=ms, examples_per_s=1.0, latency_ms_median=ms)
            for o, ms in (("ftrl", 2.0), ("ftrl_bf16", 1.6), ("rowwise_adagrad", 2.4), ("adam", 3.2), ("sgd", 1.2))]
    meta = dict(world_size=1, device="H200", torch="2.x", torchrec="1.6.1", fbgemm_gpu="1.6.0", tables=8,
                rows=2_000_000, dim=128, batch=8192, pooling=20, steps=100, latency_steps=40, warmup=10)
    md = b.markdown(meta, rows)
    assert "| torchrec_ftrl FTRL, bf16 state (ours) | table_wise | 1.600 | 1 | 1.50x | 2.00x | 1.600 | 1.50x | 2.00x |" in md
    assert "| FBGEMM EXACT_SGD | table_wise | 1.200 | 1 | 2.00x | 2.67x |" in md


@pytest.mark.slow
def test_dmp_cpu_smoke(tmp_path):
    out = tmp_path / "dmp"
    p = subprocess.run([sys.executable, os.path.join(BENCH, "bench_dmp.py"), "--device", "cpu", "--tables", "2",
                        "--rows", "1000", "--dim", "16", "--batch", "64", "--warmup", "1", "--steps", "3",
                        "--latency-steps", "3", "--profile", "--profile-steps", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "bench_dmp.json").read_text())
    by = {(r["optimizer"], r["sharding"]): r for r in res["results"]}
    assert len(by) == 10
    for opt in ("ftrl", "ftrl_bf16", "rowwise_adagrad", "sgd"):
        r = by[(opt, "table_wise")]
        assert r["throughput_ms"] > 0 and r["latency_ms_median"] > 0 and r["examples_per_s"] > 0
        assert r["profile"]["host_ms"]["tbe_forward"] > 0
    assert "no ADAM" in by[("adam", "table_wise")]["skipped"]
    assert all("skipped" in by[(o, "row_wise")] for o in ("ftrl", "ftrl_bf16", "adam", "rowwise_adagrad", "sgd"))
    md = (out / "bench_dmp.md").read_text()
    assert "| torchrec_ftrl FTRL (ours) | table_wise |" in md
    assert "| torchrec_ftrl FTRL, bf16 state (ours) | table_wise |" in md


# -------------------------------------------------------------------------------- bench_job.py


def test_job_tile_plan_and_arrays(tmp_path):
    import bench_job as b
    assert b.tile_plan(6726, 10_000_000, 4) == (372, 372 * 6726, 4 * 372 * 6726)
    assert b.tile_plan(6726, 20_000, 4) == (1, 6726, 4 * 6726)
    assert b.tile_plan(100, 1000, 3) == (4, 400, 1200)
    rng = np.random.default_rng(0)
    arrays = dict(dense=rng.random((5, 13), dtype=np.float32), sparse=rng.integers(1, 1 << 30, (5, 26)),
                  labels=rng.integers(0, 2, (5, 1)).astype(np.int32))
    assert b.tile_arrays(arrays, str(tmp_path), 3, 2) == 30
    for k in range(2):
        for kind in b.ARRAYS:
            got = np.load(tmp_path / f"day_{k}_{kind}.npy")
            assert got.dtype == arrays[kind].dtype and got.shape == (15, arrays[kind].shape[1])
            assert np.array_equal(got, np.concatenate([arrays[kind]] * 3))
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]   # no temporary left
    from torchrec_ftrl.data.npy_layout import complete_triplet
    assert complete_triplet(str(tmp_path), "day_1").rows == 15


def test_job_summary_reading():
    import bench_job as b
    assert b.read_profile({}) is None and b.read_profile({"step_profile": None}) is None
    sp = b.read_profile({"step_profile": {"steps": 5, "host_ms": {"data": 1.0}, "device_ms": None,
                                          "host_step_ms": 9.0}})
    assert sp == {"steps": 5, "host_ms": {"data": 1.0}, "device_ms": {}, "host_step_ms": 9.0}
    res = [dict(optimizer="ftrl", source="synthetic", examples_per_s=100.0),
           dict(optimizer="ftrl", source="binary", examples_per_s=80.0),
           dict(optimizer="rowwise_adagrad", source="binary", examples_per_s=50.0)]
    assert b.data_path_cost(res) == pytest.approx({"ftrl": 0.2})
    argv = b.job_argv(b.parse(["--device", "cpu"]), "binary", "ftrl", "/d", "n", 7, 5, "/o")
    assert argv[argv.index("--data") + 1] == "/d" and argv[argv.index("--profile-steps") + 1] == "5"
    assert argv[argv.index("--steps") + 1] == "7" and argv[argv.index("--batch-size") + 1] == "8192"
    assert b.job_has_flag("--batch-size") and not b.job_has_flag("--no-such-flag")


@pytest.mark.slow
def test_job_cpu_smoke(tmp_path):
    import bench_job as b
    if b.default_tsv() is None:
        pytest.skip("the Criteo sample is not present")
    out = tmp_path / "job"
    p = subprocess.run([sys.executable, os.path.join(BENCH, "bench_job.py"), "--device", "cpu", "--rows", "20000",
                        "--steps", "5", "--batch", "256", "--optimizers", "ftrl", "--out", str(out),
                        "--work-dir", str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "bench_job.json").read_text())
    assert res["binary"]["rows"] == 4 * 6726 and not res["binary"]["reused"]
    assert {r["source"] for r in res["results"]} == {"synthetic", "binary"}
    assert all(r["examples_per_s"] > 0 for r in res["results"])
    assert "ftrl" in res["data_path_cost"]


# ----------------------------------------------------------------------- bench_torchrec_dlrm.py


def test_dlrm_example_argv_mapping():
    import bench_torchrec_dlrm as b
    a = b.parse(["--device", "cuda", "--dense-arch", "128,64", "--over-arch", "256", "--embedding-dim", "32",
                 "--num-embeddings", "5000", "--steps", "7", "--batch", "99", "--example-args", "--seed 3"])
    argv = b.example_argv(a, "/days")
    flag = lambda f: argv[argv.index(f) + 1]  # noqa: E731
    assert flag("--dense_arch_layer_sizes") == "128,64,32" and flag("--over_arch_layer_sizes") == "256,1"
    assert flag("--in_memory_binary_criteo_path") == "/days" and flag("--num_embeddings") == "5000"
    assert flag("--limit_train_batches") == "7" and flag("--batch_size") == "99" and flag("--epochs") == "1"
    assert flag("--limit_val_batches") == "1" and flag("--limit_test_batches") == "1"
    assert "--adagrad" in argv and "--pin_memory" in argv and argv[-2:] == ["--seed", "3"]
    a = b.parse(["--device", "cpu", "--optimizer", "sgd", "--num-embeddings", ",".join(["10"] * 26)])
    argv = b.example_argv(a, "/days")
    assert "--adagrad" not in argv and "--pin_memory" not in argv and "--num_embeddings" not in argv
    assert argv[argv.index("--num_embeddings_per_feature") + 1] == ",".join(["10"] * 26)
    # the job's defaults for the two MLPs, with the example's last layers appended
    from torchrec_ftrl.job import cli
    d = cli.build_parser().parse_args([])
    a = b.parse([])
    assert a.bottom == [int(x) for x in d.dense_arch.split(",")] + [64]
    assert a.top == [int(x) for x in d.over_arch.split(",")] + [1]
    cmd = b.launch_cmd(a, "/t", ["--x"])
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"] and cmd[-2:] == ["--", "--x"]
    assert b.launch_env(b.parse(["--device", "cpu"]))["CUDA_VISIBLE_DEVICES"] == ""
    # --random-data: no data path (the example draws its own batches); the interaction it is given
    a = b.parse(["--random-data", "--example-args", "--interaction_type=dcn --multi_hot_sizes=3,2"])
    argv = b.example_argv(a, None)
    assert "--in_memory_binary_criteo_path" not in argv and argv[:2] == ["--batch_size", "8192"]
    assert b.interaction(argv) == "dcn" and b.interaction(b.example_argv(b.parse([]), "/d")) == "original (dot)"


def test_dlrm_day_view_reads_like_the_source(tmp_path):
    """The 24-day view: symlinked training days, empty padding days, a small day_23; TorchRec's
    in-memory pipe yields the source's rows in order from it."""
    import bench_job
    import bench_torchrec_dlrm as b
    from torchrec.datasets.criteo import InMemoryBinaryCriteoIterDataPipe
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    arrays = dict(dense=rng.random((7, 13), dtype=np.float32), sparse=rng.integers(0, 1 << 32, (7, 26)),
                  labels=rng.integers(0, 2, (7, 1)).astype(np.int32))
    bench_job.tile_arrays(arrays, str(src), 1, 3)
    folder, info = b.build_days(str(src), str(tmp_path / "days"), 4)
    assert info["view"] and info["source_days"] == 3 and info["train_rows"] == 21 and info["empty_days"] == 20
    assert os.path.islink(os.path.join(folder, "day_2_sparse.npy"))
    empty = np.load(os.path.join(folder, "day_22_sparse.npy"))
    assert empty.shape == (0, 26) and empty.dtype == arrays["sparse"].dtype
    assert np.array_equal(np.load(os.path.join(folder, "day_23_dense.npy")), arrays["dense"][:4])
    paths = [[os.path.join(folder, f"day_{d}_{k}.npy") for d in range(b.DAYS - 1)] for k in b.ARRAYS]
    pipe = InMemoryBinaryCriteoIterDataPipe("train", *paths, batch_size=5, rank=0, world_size=1,
                                            hashes=[1000] * 26)
    got = list(pipe)
    assert [len(x.labels) for x in got] == [5, 5, 5, 5, 1]
    dense = torch.cat([x.dense_features for x in got]).numpy()
    assert np.array_equal(dense, np.concatenate([arrays["dense"]] * 3))
    # a folder that already has the 24 days is used as it is
    full = tmp_path / "full"
    bench_job.tile_arrays(arrays, str(full), 1, b.DAYS)
    assert b.build_days(str(full), str(tmp_path / "unused"), 4) == (str(full), dict(
        source=str(full), view=False, source_days=b.DAYS, train_rows=7 * (b.DAYS - 1), val_test_rows=7))


def test_dlrm_throughput_by_hand():
    import bench_torchrec_dlrm as b
    recs = [dict(steps=10, warmup=2, train_s=2.0, steady_s=1.0, setup_s=5.0, after_train_s=0.5),
            dict(steps=10, warmup=2, train_s=2.5, steady_s=1.6, setup_s=6.0, after_train_s=0.4)]
    r = b.throughput(recs, 100)
    assert r["examples_per_s"] == pytest.approx(10 * 100 * 2 / 2.5)
    assert r["steady_examples_per_s"] == pytest.approx(8 * 100 * 2 / 1.6) and r["setup_s"] == 6.0
    assert b.example_iterations("x\nTotal number of iterations: 42\ny") == 42
    assert b.example_iterations("nothing") is None


@pytest.mark.slow
def test_dlrm_example_cpu_smoke(tmp_path):
    """TorchRec's DLRM example, unmodified (``.anchor/torchrec_dlrm``, see the benchmark's
    ``--extract``), 2 gloo processes on the tiled sample."""
    import bench_job
    import bench_torchrec_dlrm as b
    dlrm_main = os.path.join(b.ANCHOR_DIR, "torchrec_dlrm", "dlrm_main.py")
    if not os.path.isfile(dlrm_main) or bench_job.default_tsv() is None or b.missing_modules():
        pytest.skip("no extracted dlrm_main.py, Criteo sample or the example's extra packages")
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, os.path.join(BENCH, "bench_torchrec_dlrm.py"), "--device", "cpu",
                        "--rows", "20000", "--files", "2", "--work-dir", str(tmp_path / "work"), "--batch", "256",
                        "--steps", "12", "--warmup", "4", "--num-embeddings", "1000", "--nproc", "2",
                        "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "bench_torchrec_dlrm.json").read_text())
    r = res["result"]
    assert r["steps"] == 12 == r["example_iterations"] and r["world_size"] == 2
    assert r["examples_per_s"] > 0 and r["steady_steps"] == 8 and r["steady_examples_per_s"] > 0
    assert res["example"]["sha256"] and res["data"]["view"]
    assert (out / "bench_torchrec_dlrm.md").read_text().count("TorchRec DLRM example") == 1


def test_layouts_bytes_by_hand(tbe_bench):
    # D=128, fp32 weights (512 B): z fp32 512 B or bf16 256 B; n element-wise 512 / 256 B, row-wise 4 / 2 B
    rows = {m: tbe_bench.row_bytes(m, 128, 4) for m in tbe_bench.LAYOUT_METHODS}
    assert rows == {"ours_stored_elementwise_fp32": 1536, "ours_stored_elementwise_bf16": 1024,
                    "ours_stored_rowwise_fp32": 1028, "ours_stored_rowwise_bf16": 770,
                    "ours_derived_elementwise_fp32": 1024, "ours_derived_elementwise_bf16": 512,
                    "ours_derived_rowwise_fp32": 516, "ours_derived_rowwise_bf16": 258}
    assert tbe_bench.row_bytes("fbgemm_rowwise_adagrad", 128, 4) == 516
    # N=10, U=5, T=1, B=2: a derived forward reads z and n (258 B) per unique row instead of the weight;
    # the backward reads and writes the 258 stored bytes per row: 10*8 + 5*258 + 2*512, 2*512 + 2*5*258
    assert tbe_bench.bytes_model("ours_derived_rowwise_bf16", 10, 5, 1, 2, 128, 4) == (2394, 3604)
    # a stored layout's forward reads the weight: 10*8 + 5*512 + 2*512; backward 2*512 + 2*5*1028
    assert tbe_bench.bytes_model("ours_stored_rowwise_fp32", 10, 5, 1, 2, 128, 4) == (3664, 11304)
    # the update alone: 2 x 5 rows x 516 B + the T*B = 2*3 output-gradient rows of 128 fp32
    assert tbe_bench.update_bytes("ours_derived_rowwise_fp32", 5, 2, 3, 128, 4) == 2 * 5 * 516 + 2 * 3 * 512


def test_bench_tbe_cuda_layouts_flag_refuses_other_methods():
    # --layouts runs ours' layouts and the FBGEMM baselines; checked before any CUDA call
    p = subprocess.run([sys.executable, os.path.join(BENCH, "bench_tbe_cuda.py"), "--layouts", "--methods",
                        "ours_derived_rowwise_bf16,eager"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 2 and "--methods: ['eager']" in p.stderr, p.stderr[-2000:]
