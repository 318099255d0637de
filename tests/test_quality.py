"""The quality harness (``benchmarks/quality.py``, ``quality_model.py``, ``quality_stats.py``,
``teacher.py``) on CPU at tiny shapes: paired t-intervals against hand-computed ones (t-table
quantiles), verdicts, the teacher's reproducibility and Zipf law against their formulas, its ceiling
AUC against scipy's Mann-Whitney U, the sparse-model statistics against hand counts and byte
formulas, refusal of layouts the TBE lacks, and a two-seed study end to end."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import quality  # noqa: E402
import quality_model as qm  # noqa: E402
from quality_stats import PairedInterval, paired_interval, verdict  # noqa: E402
from teacher import Teacher, TeacherConfig  # noqa: E402

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------ intervals, verdicts

def test_paired_interval_matches_hand_computed_t_interval():
    # d = (0.001, 0.003, 0.002): mean 0.002, sd 0.001, se 0.001 / sqrt(3); t(0.975, 2 df) = 4.303
    # (printed t table), half width 4.303 * 0.000577350 = 0.00248434.
    iv = paired_interval([0.701, 0.703, 0.702], [0.700, 0.700, 0.700])
    assert iv.n == 3
    assert iv.mean == pytest.approx(0.002, abs=1e-12)
    assert iv.lo == pytest.approx(0.002 - 0.00248434, abs=5e-7)
    assert iv.hi == pytest.approx(0.002 + 0.00248434, abs=5e-7)
    # d = (1, 2, 3, 4, 10) / 1000 against a varying reference: mean 0.004, sd sqrt(50/4) / 1000 =
    # 0.00353553; t(0.975, 4 df) = 2.776; half width 2.776 * 0.00353553 / sqrt(5) = 0.00438924.
    ref = [0.61, 0.72, 0.65, 0.70, 0.69]
    var = [r + d / 1000 for r, d in zip(ref, (1, 2, 3, 4, 10))]
    iv = paired_interval(var, ref)
    assert iv.mean == pytest.approx(0.004, abs=1e-12)
    assert iv.hi - iv.mean == pytest.approx(0.00438924, abs=2e-6)
    assert iv.mean - iv.lo == pytest.approx(0.00438924, abs=2e-6)


def test_paired_interval_edge_cases():
    assert paired_interval([0.5, 0.6], [0.5, 0.6]) == PairedInterval(0.0, 0.0, 0.0, 2)
    one = paired_interval([0.7], [0.6])
    assert one.n == 1 and one.lo == -math.inf and one.hi == math.inf
    with pytest.raises(ValueError, match="same non-zero number of seeds"):
        paired_interval([0.1, 0.2], [0.1])


def test_verdicts_follow_the_issue_definition():
    ok, below, wide, above = (PairedInterval(0, -0.0009, 0.0009, 3), PairedInterval(-0.003, -0.004, -0.002, 3),
                              PairedInterval(0, -0.002, 0.002, 3), PairedInterval(0.003, 0.002, 0.004, 3))
    assert verdict([ok, ok], 0.001) == "equivalent"
    assert verdict([ok, wide], 0.001) == "inconclusive"   # equivalent at one batch size only
    assert verdict([ok, below], 0.001) == "worse"         # below the margin at any batch size
    assert verdict([wide, below], 0.001) == "worse"
    assert verdict([above, above], 0.001) == "better"
    assert verdict([above, ok], 0.001) == "inconclusive"
    assert verdict([], 0.001) == "inconclusive"


# ------------------------------------------------------------------------------------------ teacher

def test_teacher_is_reproducible_and_follows_zipf():
    cfg = TeacherConfig([50, 1000, 7], num_dense=3, informative_share=0.2, seed=3)
    t = Teacher(cfg)
    a, b, c = t.sample(60_000, seed=1), t.sample(60_000, seed=1), t.sample(60_000, seed=2)
    for x, y in ((a.ids, b.ids), (a.dense, b.dense), (a.labels, b.labels)):
        assert torch.equal(x, y)
    assert not torch.equal(a.ids, c.ids)
    for f, v in enumerate(cfg.num_embeddings):
        col = a.ids[:, f]
        assert int(col.min()) >= 0 and int(col.max()) < v
        # Zipf(1): the most frequent id has probability log(2) / log(V + 1)
        top = torch.bincount(col, minlength=v).max().item() / len(a)
        assert top == pytest.approx(math.log(2) / math.log(v + 1), abs=0.01)
    # about informative_share of the distinct ids carry a weight
    ids = torch.arange(1000).repeat(3, 1).t()
    assert t.informative(ids)[:, 1].float().mean().item() == pytest.approx(0.2, abs=0.05)
    # labels are Bernoulli(sigmoid(logit))
    assert a.labels.mean().item() == pytest.approx(torch.sigmoid(a.logits.double()).mean().item(), abs=0.01)


def test_teacher_ceiling_auc_is_the_mann_whitney_auc():
    from scipy.stats import mannwhitneyu
    d = Teacher(TeacherConfig([100] * 4, num_dense=2, seed=5)).sample(3_000, seed=0)
    pos, neg = d.logits[d.labels == 1].double().numpy(), d.logits[d.labels == 0].double().numpy()
    u = mannwhitneyu(pos, neg).statistic
    assert Teacher.ceiling_auc(d) == pytest.approx(u / (len(pos) * len(neg)), abs=1e-6)  # fp32 result


def test_teacher_config_rejects_bad_values():
    with pytest.raises(ValueError, match="num_embeddings"):
        TeacherConfig([10, 0])
    with pytest.raises(ValueError, match="informative_share"):
        TeacherConfig([10], informative_share=0.0)


# ------------------------------------------------------------------------------------ model pieces

def test_unsupported_layouts_and_kernels_are_refused_by_name():
    _, bogus = qm._v("ftrl_bogus", "ftrl", "a layout value the TBE refuses", layout={"ftrl_weights": "implicit"})
    with pytest.raises(ValueError, match="'ftrl_bogus'.*ftrl_weights must be one of"):
        qm.check_supported(bogus, CPU)
    with pytest.raises(ValueError, match="'adam'.*no cpu kernel for ADAM"):
        qm.build_tbe(qm.VARIANTS["adam"], [10], 4, 8, CPU)
    runnable, skipped = quality.resolve_variants(["all"], CPU)
    assert [v.name for v in runnable][0] == qm.REFERENCE
    lean = {"ftrl_derived", "ftrl_derived_bf16_zn", "ftrl_derived_rowwise_n", "ftrl_derived_bf16_z_rowwise_n"}
    assert lean <= {v.name for v in runnable}          # every row layout runs, on every backend
    assert "adam" in skipped
    with pytest.raises(ValueError, match="unknown"):
        quality.resolve_variants(["ftrl_nope"], CPU)


def test_tbe_input_drops_missing_ids():
    idx, off = qm.tbe_input(torch.tensor([[3, -1], [5, 7]]))   # B = 2, F = 2
    assert idx.tolist() == [3, 5, 7] and off.tolist() == [0, 1, 2, 2, 3]


@pytest.mark.parametrize("name,per_element_bytes,per_row_bytes",
                         [("ftrl", 12, 0), ("ftrl_bf16_state", 8, 0), ("rowwise_adagrad", 4, 4)])
def test_sparse_model_stats_counts_by_hand(name, per_element_bytes, per_row_bytes):
    sizes, dim = [6, 4], 4
    tbe = qm.build_tbe(qm.VARIANTS[name], sizes, dim, 8, CPU)
    w0, w1 = tbe.split_embedding_weights()
    with torch.no_grad():
        w0.fill_(1.0)
        w1.fill_(1.0)
        w0[0] = 0.0             # touched, all zero
        w0[1, :2] = 0.0         # touched, 2 zeros
        w0[5] = 0.0             # untouched: not counted
        w1[2, 3] = 0.0          # touched, 1 zero
    ids = torch.tensor([[0, 2], [1, 3], [0, 2]])   # touched: table 0 rows {0, 1}, table 1 rows {2, 3}
    st = qm.sparse_model_stats(tbe, qm.touched_masks(ids, sizes))
    assert st["touched_rows"] == 4 and st["touched_weights"] == 16
    assert st["zero_weight_share_touched"] == pytest.approx(7 / 16)
    assert st["zero_row_share_touched"] == pytest.approx(1 / 4)
    assert st["nonzero_weights_touched"] == 9
    rows = sum(sizes)
    assert st["sparse_model_bytes"] == rows * dim * per_element_bytes + rows * per_row_bytes


def test_same_seed_same_variant_trains_identically():
    ds = quality.teacher_dataset("tiny", CPU)
    train = ds.train(0)
    order = qm.train_order(len(train), 512, 1, 0, False, CPU)
    v = qm.VARIANTS["ftrl"]
    r1, r2 = (qm.run(v, train, ds.evaluation, ds.sizes, 512, 0, order, qm.ModelConfig(), CPU)
              for _ in range(2))
    assert r1["auc"] == r2["auc"] and r1["zero_weight_share_touched"] == r2["zero_weight_share_touched"]
    assert 0.5 < r1["auc"] <= ds.describe["ceiling_auc"] + 0.02


def test_train_order_is_a_seeded_permutation_cut_to_whole_batches():
    o = qm.train_order(10, 4, 2, seed=1, shuffle=True, device=CPU)
    assert o.numel() == 16
    for p in (o[:8], o[8:]):
        assert len(set(p.tolist())) == 8 and max(p.tolist()) < 10
    assert torch.equal(o, qm.train_order(10, 4, 2, seed=1, shuffle=True, device=CPU))
    with pytest.raises(ValueError, match="batch_size 16 exceeds the 10 training rows"):
        qm.train_order(10, 16, 1, seed=1, shuffle=True, device=CPU)


def test_sample_dataset_holds_out_every_fifth_row(sample_data):
    from conftest import data_dir
    sample_data("criteo", "criteo_dac_combined.tsv")   # skips without the sample
    ds = quality.sample_dataset("criteo", CPU, 1000, epochs=2, data_dir=data_dir())
    train = ds.train(0)
    # 6,726 rows (data/README.md): rows 4, 9, 14, ... held out -> 1,345 evaluation, 5,381 training
    assert (len(ds.evaluation), len(train)) == (1345, 5381)
    assert train.dense.shape == (5381, 13) and train.ids.shape == (5381, 26)
    assert int(train.ids.max()) < 1000 and int(train.ids.min()) >= -1 and train.missing


# --------------------------------------------------------------------------------------- end to end

def test_two_seed_study_writes_paired_results(tmp_path):
    out = str(tmp_path / "q")
    # 'all' less sgd and the lean layouts: ftrl, ftrl_bf16_state, rowwise_adagrad on CPU (ADAM is listed
    # as not run); a zero time budget still runs 2 seeds, then starts no third
    assert quality.main(["--teacher", "tiny", "--train-rows", "4096", "--batches", "512",
                         "--seeds", "0", "1", "2", "--variants", "all", "--exclude", "sgd", "ftrl_derived",
                         "ftrl_derived_bf16_zn", "ftrl_derived_rowwise_n", "ftrl_derived_bf16_z_rowwise_n",
                         "ftrl_zero_init", "ftrl_derived_zero_init", "ftrl_derived_rowwise_n_zero_init",
                         "--time-budget-s", "0", "--threads", "1", "--out", out]) == 0
    with open(out + ".json") as f:
        res = json.load(f)
    assert res["seeds_done"] == [0, 1] and "seed 2 not started" in res["stopped"]
    assert "adam" in res["not_run"] and "sgd" not in res["variants"]
    assert {r["steps"] for r in res["runs"]} == {4096 // 512}
    assert os.path.getsize(out + ".png") > 0 and "| teacher | ftrl_bf16_state |" in open(out + ".md").read()
    runs = {(r["variant"], r["seed"]): r for r in res["runs"]}
    assert set(runs) == {(v, s) for v in ("ftrl", "ftrl_bf16_state", "rowwise_adagrad") for s in (0, 1)}
    cell = next(c for c in res["summary"]["cells"] if c["variant"] == "ftrl_bf16_state")
    d = [runs[("ftrl_bf16_state", s)]["auc"] - runs[("ftrl", s)]["auc"] for s in (0, 1)]
    assert cell["vs_reference"]["auc"]["mean"] == pytest.approx(sum(d) / 2, abs=1e-12)
    assert cell["vs_reference"]["auc"]["n"] == 2
    # FTRL with l1 zeroes weights; row-wise Adagrad does not
    assert runs[("ftrl", 0)]["zero_weight_share_touched"] > 0.3
    assert runs[("rowwise_adagrad", 0)]["zero_weight_share_touched"] == 0.0
    verdicts = {v["variant"]: v for v in res["summary"]["verdicts"]}
    assert verdicts["rowwise_adagrad"]["zero_share"] == "worse"


def test_dense_precision_is_the_jobs_flag(tmp_path, capsys):
    """``--dense-precision bf16`` trains the MLPs under autocast (AUC near fp32's, not equal); the
    run records it; tf32 on the CPU is one argparse error naming the flag and the value."""
    def study(precision):
        out = str(tmp_path / precision)
        assert quality.main(["--teacher", "tiny", "--train-rows", "2048", "--batches", "512", "--seeds", "0",
                             "--variants", "ftrl", "--threads", "1", "--dense-precision", precision,
                             "--out", out]) == 0
        with open(out + ".json") as f:
            return json.load(f)

    fp32, bf16 = study("fp32"), study("bf16")
    assert (fp32["model"]["dense_precision"], bf16["model"]["dense_precision"]) == ("fp32", "bf16")
    a, b = fp32["runs"][0]["auc"], bf16["runs"][0]["auc"]
    assert a != b and abs(a - b) < 0.02
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        quality.main(["--dense-precision", "tf32", "--out", str(tmp_path / "x")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --dense-precision tf32 needs a CUDA device (TF32 is a CUDA tensor-core format); this run "
        "is on the CPU: use fp32 or bf16")


def test_prune_to_keeps_the_largest_magnitudes_of_touched_rows():
    tbe = qm.build_tbe(qm.VARIANTS["rowwise_adagrad"], [3, 2], 4, 8, CPU)
    w0, w1 = tbe.split_embedding_weights()
    with torch.no_grad():
        w0.copy_(torch.arange(1, 13, dtype=torch.float32).view(3, 4) * torch.tensor([1, -1, 1, -1]))
        w1.copy_(torch.arange(13, 21, dtype=torch.float32).view(2, 4) / 10)   # 1.3 .. 2.0
    touched = [torch.tensor([True, True, False]), torch.tensor([True, True])]
    # touched magnitudes: 1..8 (table 0, rows 0-1) and 1.3..2.0 (table 1); the 5 largest: 8, 7, 6, 5, 4
    assert qm.prune_to(tbe, touched, 5) == 5
    assert w0[:2].abs().reshape(-1).tolist() == [0, 0, 0, 4, 5, 6, 7, 8]
    assert w0[2].abs().tolist() == [9, 10, 11, 12]          # untouched row kept
    assert w1.abs().sum().item() == 0
