"""What a newcomer to the lean layouts met (issue 51): FTRL keys without ``"optimizer"``, the unknown-key
message, whole-row writes into a derived table, docs/quality.md's account of the lean layouts, and the
job's start line naming the layout."""

from __future__ import annotations

import importlib
import json
import re
import types
from pathlib import Path

import pytest
import torch
import torchrec
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import torchrec_ftrl
from conftest import bits
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.fbgemm_enums import SparseType
from torchrec_ftrl.hyperparams import FTRL_KWARGS, NOT_KNOBS, parse_options
from torchrec_ftrl.optim_type import EmbOptimType
from torchrec_ftrl.state_dtype import OPTIMIZER_STATE_DTYPES, STATE_DTYPE

ROOT = Path(__file__).resolve().parents[1]
sharders_mod = importlib.import_module("torchrec_ftrl.integration.sharders")   # integration.sharders is the function

# Every FTRL-only fused_params key, with a value: the knobs, the row layout's keys, the state dtypes.
FTRL_ONLY = {**{k: 0.1 for k in FTRL_KWARGS}, "ftrl_learning_rate_power": -0.5, "ftrl_l2_convention": "mcmahan",
             "ftrl_weights": "derived",
             "ftrl_accumulator": "rowwise", STATE_DTYPE: "bf16", OPTIMIZER_STATE_DTYPES: {"accum": SparseType.BF16}}


# ---------------------------------------------------------------- 1. FTRL keys without "optimizer"
NO_OPTIMIZER = r"but no \"optimizer\""


def _ebc(in_backward_kwargs=None):
    """A one-table EBC on meta, its table given an in-backward FTRL optimizer when kwargs are given."""
    tables = [torchrec.EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=100, feature_names=["f0"])]
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    if in_backward_kwargs is not None:
        apply_optimizer_in_backward(torchrec_ftrl.FTRL, ebc.parameters(), in_backward_kwargs)
    return ebc


def _shard(fused_params, ebc):
    """The EBC sharder's shard() of ``ebc`` with an empty plan: our refusal runs first; past it,
    TorchRec fails on the empty plan (any other error), which this returns."""
    sharder = torchrec_ftrl.sharders(fused_params)[0]
    try:
        sharder.shard(ebc, {}, None, torch.device("cpu"))
    except Exception as e:   # noqa: BLE001 - TorchRec's own error on the empty plan
        return e
    return None


def test_the_newcomers_lean_fused_params_without_optimizer_are_refused():
    """The issue's dict (no "optimizer") would train the table with FBGEMM's EXACT_SGD: refused when
    the module is sharded, naming the FTRL keys, the table and the fix."""
    fused = {"learning_rate": 0.05, "ftrl_weights": "derived", "ftrl_accumulator": "rowwise"}
    err = _shard(fused, _ebc())
    assert isinstance(err, ValueError), err
    msg = str(err)
    assert "'ftrl_weights': 'derived'" in msg and "'ftrl_accumulator': 'rowwise'" in msg
    assert "learning_rate" not in msg.split("but no")[0] and "['t0']" in msg
    assert '"optimizer": EmbOptimType.FTRL' in msg and "EXACT_SGD" in msg
    err = _shard({"ftrl_l1_reg": 1e-3}, _ebc())
    assert isinstance(err, ValueError) and re.search(r"\{'ftrl_l1_reg': 0\.001\} " + NO_OPTIMIZER, str(err))


@pytest.mark.parametrize("key", sorted(FTRL_ONLY))
def test_every_ftrl_only_key_is_refused_without_an_optimizer_and_with_another(key):
    """Each FTRL-only key alone: refused at shard time with no optimizer, and at construction with
    EXACT_ADAGRAD (both sharders); taken with FTRL."""
    value = FTRL_ONLY[key]
    err = _shard({"learning_rate": 0.1, key: value}, _ebc())
    # the sharders hold a state dtype as its canonical optimizer_state_dtypes
    held = OPTIMIZER_STATE_DTYPES if key == STATE_DTYPE else key
    assert isinstance(err, ValueError) and re.search(rf"FTRL option\(s\) \{{'{held}': .*\}} {NO_OPTIMIZER}",
                                                     str(err)), err
    with pytest.raises(ValueError, match=rf"{key}=.* is an FTRL option, but the optimizer is .*EXACT_ADAGRAD"):
        _build_both({"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.1, key: value})
    _build_both({"optimizer": EmbOptimType.FTRL, "learning_rate": 0.1, key: value})


def test_ftrl_keys_without_optimizer_apply_to_in_backward_ftrl_tables(one_process):
    """TorchRec merges a sharder's fused_params with a table's in-backward optimizer: with every table
    in-backward FTRL the keys apply (the lean layout is built), nothing is refused."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec_ftrl.integration.compute_kernels import ftrl_tbes
    ebc = _ebc({"lr": 0.05, "ftrl_l1_reg": 1e-3})
    assert not isinstance(_shard({"ftrl_weights": "derived"}, ebc), ValueError)
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=torchrec_ftrl.sharders(
        {"ftrl_weights": "derived", "ftrl_accumulator": "rowwise"}))
    assert [t.row_layout.key for t in ftrl_tbes(model)] == [("derived", "rowwise")]


def _build_both(fused_params):
    torchrec_ftrl.sharders(fused_params)
    sharders_mod.FTRLEmbeddingCollectionSharder(fused_params=fused_params)


def test_fused_params_without_optimizer_and_without_ftrl_keys_still_build():
    """No FTRL key: nothing to refuse (stock keys, None or empty FTRL values)."""
    for fused in ({"learning_rate": 0.1}, {"ftrl_weights": None, STATE_DTYPE: None, OPTIMIZER_STATE_DTYPES: {}},
                  None):
        _build_both(fused)
        assert not isinstance(_shard(fused, _ebc()), ValueError)


def test_unknown_key_message_lists_the_layout_keys():
    with pytest.raises(ValueError) as e:
        parse_options({"ftrl_weight": "derived"}, where="fused_params")
    listed = re.search(r"some of (\[.*?\])", str(e.value)).group(1)
    for key in ("ftrl_weights", "ftrl_accumulator", "ftrl_l1_reg", "ftrl_l2_convention"):
        assert repr(key) in listed, (key, str(e.value))


def test_strict_unknown_key_message_says_the_layout_is_not_a_knob():
    """update_hyper_parameters (strict) takes knobs only: the layout keys are not offered, and
    naming one says why."""
    with pytest.raises(ValueError) as e:
        parse_options({"ftrl_weights": "derived"}, strict=True, where="update_hyper_parameters")
    listed = re.search(r"some of (\[.*?\])", str(e.value)).group(1)
    assert "ftrl_weights" not in listed and "ftrl_l1_reg" in listed
    assert "fixed when the table is built" in str(e.value)
    assert set(NOT_KNOBS) == {"ftrl_weights", "ftrl_accumulator"}


# ---------------------------------------------------------------- 3. whole-row writes, derived table
ALPHA, BETA, L2 = 0.05, 1.0, 0.01


def _derived(accumulator):
    """A derived table of 10 x 8 with random weights encoded over a random accum (>= 0.05)."""
    tbe = FTRLTableBatchedEmbeddingBags([(10, 8)], learning_rate=ALPHA, ftrl_beta=BETA, ftrl_l2_reg=L2,
                                        ftrl_weights="derived", ftrl_accumulator=accumulator, backend="torch")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        tbe.accum_dev.copy_(torch.rand(tbe.accum_dev.shape, generator=g) + 0.05)
    start = torch.rand(10, 8, generator=g, dtype=torch.float64) - 0.5
    w = tbe.split_embedding_weights()[0]
    w.copy_(start.float())
    return tbe, w, start


def _q64(tbe, rows):
    """float64 q = (beta + sqrt(n)) / alpha + 2 l2 (docs/ftrl.md, tensorflow convention) of ``rows``,
    [len(rows), 8]."""
    n = tbe.accum_dev.detach().double()
    n = n[rows][:, None].expand(-1, 8) if n.numel() == 10 else n.view(10, 8)[rows]   # row-wise: [rows]
    return (BETA + n.sqrt()) / ALPHA + 2 * L2


WRITES = {
    "setitem": lambda w, i, v: w.__setitem__(i, v),
    "copy_": lambda w, i, v: w[i].copy_(v),
    "in a row slice": lambda w, i, v: w[i % 10 - 10:].__setitem__(0, v),
    "fill_ then add_": lambda w, i, v: (w[i].fill_(0.0), w[i].add_(v)),
}


@pytest.mark.parametrize("accumulator", ["elementwise", "rowwise"])
@pytest.mark.parametrize("index", [7, -3])
@pytest.mark.parametrize("how", sorted(WRITES))
def test_whole_row_write_by_integer_index_lands(accumulator, index, how):
    """``w[i] = v`` (and the same row written other ways) reads back as written within fp32
    rounding (lambda1 = 0, fp32 linear: the docs' "an ulp or two"), its linear is -q v (float64 q
    from accum), and every other row keeps its linear and accum bits and its weights."""
    tbe, w, start = _derived(accumulator)
    row = index % 10
    others = [r for r in range(10) if r != row]
    z0, n0 = tbe.linear_dev.detach().clone().view(10, 8), tbe.accum_dev.detach().clone()
    v = torch.linspace(-1.5, 2.0, 8, dtype=torch.float64)
    WRITES[how](w, index, v.float())
    got = w.clone().double()
    torch.testing.assert_close(got[row], v, rtol=2 * 2.0 ** -23, atol=1e-7)
    z_expected = -_q64(tbe, [row])[0] * v
    torch.testing.assert_close(tbe.linear_dev.detach().view(10, 8)[row].double(), z_expected,
                               rtol=4 * 2.0 ** -23, atol=1e-6)
    assert torch.equal(bits(tbe.linear_dev.view(10, 8)[others]), bits(z0[others]))
    assert torch.equal(bits(tbe.accum_dev), bits(n0))
    torch.testing.assert_close(got[others], start[others], rtol=2 * 2.0 ** -23, atol=1e-7)


@pytest.mark.parametrize("write", [
    lambda w: w[7].__setitem__(3, 5.0),
    lambda w: w.__setitem__((7, 3), 5.0),
    lambda w: w[7][:4].fill_(5.0),
    lambda w: w[:, 2].zero_(),
], ids=["w[7][3]", "w[7, 3]", "w[7][:4]", "w[:, 2]"])
def test_partial_row_writes_stay_refused_and_change_nothing(write):
    tbe, w, _ = _derived("elementwise")
    z0, n0 = tbe.linear_dev.detach().clone(), tbe.accum_dev.detach().clone()
    with pytest.raises(RuntimeError, match="Write whole rows instead"):
        write(w)
    assert torch.equal(bits(tbe.linear_dev), bits(z0)) and torch.equal(bits(tbe.accum_dev), bits(n0))


def test_integer_row_reads_and_bounds():
    """``w[i]`` reads the row's prox(z, n) (float64 from the states: z = -q w0); an index outside
    [-rows, rows) raises IndexError and writes nothing."""
    tbe, w, start = _derived("rowwise")
    z = tbe.linear_dev.detach().double().view(10, 8)
    expected = -z[4] / _q64(tbe, [4])[0]           # lambda1 = 0: w = -z / q
    torch.testing.assert_close(w[4].clone().double(), expected, rtol=4 * 2.0 ** -23, atol=1e-7)
    torch.testing.assert_close(w[-1].numpy(), start[9].float().numpy(), rtol=4 * 2.0 ** -23, atol=1e-7)
    z0 = tbe.linear_dev.detach().clone()
    for bad in (10, -11):
        with pytest.raises(IndexError):
            w[bad] = torch.ones(8)
    assert torch.equal(bits(tbe.linear_dev), bits(z0))


# ---------------------------------------------------------------- 4. docs/quality.md and the lean layouts
def test_quality_doc_states_the_lean_layout_results():
    """docs/quality.md no longer says the lean layouts are unimplemented, and its lean-layout table
    gives each variant's verdicts as the result files record them."""
    doc = (ROOT / "docs" / "quality.md").read_text()
    for stale in ("not in the TBE yet", "not yet implemented", "(not implemented)", "by then"):
        assert stale not in doc, stale
    section = doc.split("## The lean layouts")[1].split("\n## ")[0]
    study = {"quality_lean_teacher_small_cpu": "small", "quality_lean_zero_init_teacher_small_cpu": "small, w = 0",
             "quality_lean_teacher_large_h200": "large"}
    checked = 0
    for name, label in study.items():
        verdicts = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())["summary"]["verdicts"]
        for v in verdicts:
            if v["variant"] in ("rowwise_adagrad",) or (label == "small, w = 0" and v["variant"] == "ftrl_derived"):
                continue
            row = re.search(rf"^\| {re.escape(label)} \| {v['variant']}\b[^\n]*$", section, re.M)
            assert row, (label, v["variant"])
            cells = [c.strip() for c in row.group(0).strip("|").split("|")]
            assert cells[-2:] == [v["auc"], v["zero_share"]], (label, v["variant"], cells)
            checked += 1
    assert checked == 10


# ---------------------------------------------------------------- 5. the job's start line
@pytest.mark.parametrize("weights,accumulator", [("stored", "elementwise"), ("derived", "rowwise")])
def test_start_line_names_the_layout(capsys, weights, accumulator):
    from torchrec_ftrl.job import train
    args = types.SimpleNamespace(sparse_optimizer="ftrl", ftrl_state_dtype="bf16", ftrl_weights=weights,
                                 ftrl_accumulator=accumulator, embedding_dim=16, sparse_lr=0.05,
                                 dense_optimizer="adagrad", dense_lr=0.05, batch_size=256,
                                 dense_precision="bf16", compile_dense=False,
                                 dense_cuda_graphs=False)
    env = types.SimpleNamespace(world_size=2, device="cpu", backend="gloo")
    job = types.SimpleNamespace(args=args, env=env, data_desc={"kind": "synthetic"}, features=["a", "b"], steps=200)
    train._print_start(job, 0, 0)
    line = capsys.readouterr().out
    assert f"sparse=ftrl (state bf16) layout={weights}-{accumulator} lr=0.05" in line
    assert "dense=adagrad lr=0.05 precision=bf16," in line
    doc = (ROOT / "docs" / "main-job.md").read_text()
    example = next(ln for ln in doc.splitlines() if ln.startswith("train_ctr: 2 rank(s)"))
    assert "sparse=ftrl (state fp32) layout=stored-elementwise lr=0.05" in example
