"""Tests of ``FTRLTableBatchedEmbeddingBags`` on CPU, backends "cpp" (compiled) and "torch".

Expected values come from float64 references independent of the code under test (see
``tests/tbe_harness.py`` and ``tests/conftest.py``): ``torch.nn.functional.embedding_bag`` per table for
the forward and ``ftrl_reference_rows`` (``tests/reference.py``, transcribed from ``docs/ftrl.md``) for
the update.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import tbe_harness as H
from conftest import assert_same_bits, bits, tbe_state
from reference import ftrl_reference_rows, reference_knobs
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.fbgemm_enums import BoundsCheckMode, PoolingMode, SparseType

BACKENDS = H.CPU_BACKENDS
HP = dict(learning_rate=0.1, ftrl_l1_reg=0.01, ftrl_l2_reg=0.02, ftrl_beta=0.5)


def _i64(x):
    return torch.tensor(x, dtype=torch.int64)


# ------------------------------------------------------------------ randomized harness
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", range(4))
def test_random_cases_match_reference(backend, chunk):
    for seed in range(chunk * 25, (chunk + 1) * 25):
        H.check_case(H.random_case(seed), backend, steps=3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("states", [{"accum": "bf16", "linear": "bf16"}, {"accum": "bf16"},
                                    {"linear": "bf16"}], ids=["both", "accum", "linear"])
def test_random_cases_with_bf16_state_match_reference(backend, states):
    """The randomized harness with bf16 optimizer state (VBE, shared tables, weights, all
    precisions): states within one bf16 spacing of the reference run from the stored states."""
    for seed in range(12):
        H.check_case(H.random_case(seed), backend, steps=3, optimizer_state_dtypes=states)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hot_row_duplicates_are_summed_then_updated_once(backend):
    # 200 occurrences of row 3 across bags, MEAN pooling with weights: one update with the sum.
    m = FTRLTableBatchedEmbeddingBags([(8, 5)], pooling_mode=PoolingMode.MEAN, backend=backend, **HP)
    W0 = m.split_embedding_weights()[0].detach().double().clone()
    idx = _i64([3] * 150 + [1, 3] * 25)
    off = _i64([0, 100, 150, 200])
    psw = torch.linspace(-1, 1, 200)
    out = m(idx, off, per_sample_weights=psw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    out.backward(g)
    lens = [100, 50, 50]
    bag = np.repeat([0, 1, 2], lens)
    grads = (g.double().numpy()[bag] * psw.double().numpy()[:, None] / np.array(lens)[bag][:, None])
    w, z, n = ftrl_reference_rows(W0.numpy(), np.zeros((8, 5)), np.zeros((8, 5)), idx.numpy(), grads,
                                  **reference_knobs(m.hyperparams))
    torch.testing.assert_close(m.split_embedding_weights()[0].double(), torch.from_numpy(w),
                               rtol=1e-5, atol=1e-6)
    acc, lin = m.split_optimizer_states()[0]
    torch.testing.assert_close(acc.double(), torch.from_numpy(n), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lin.double(), torch.from_numpy(z), rtol=1e-5, atol=1e-5)


def test_cpp_large_tables_and_many_indices_match_reference():
    # 5M rows (23-bit row ids: 3 radix passes), 70k indices (parallel sort chunks), D = 1 and 3.
    rng = np.random.default_rng(1)
    m = FTRLTableBatchedEmbeddingBags([(5_000_000, 1), (1000, 3)], feature_table_map=[0, 1, 0],
                                      backend="cpp", **HP)
    B = 8000
    lens = rng.integers(0, 7, size=3 * B)
    N = int(lens.sum())
    idx = np.empty(N, dtype=np.int64)
    off = np.concatenate([[0], np.cumsum(lens)])
    for f, rows in enumerate([5_000_000, 1000, 5_000_000]):
        lo, hi = off[f * B], off[(f + 1) * B]
        # table 0: 20000 distinct rows spread over all 5M (many duplicates); table 1: any row
        idx[lo:hi] = rng.integers(0, 1000, size=hi - lo) if f == 1 else \
            rng.integers(0, 20000, size=hi - lo) * 250
    assert N > 65536
    W0 = [w.detach().double().clone() for w in m.split_embedding_weights()]
    out = m(torch.from_numpy(idx), torch.from_numpy(off))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(g)
    bag = np.repeat(np.arange(3 * B), lens)
    feat = bag // B
    gd = g.double().numpy()
    for t, (feats, D, col) in enumerate([((0, 2), 1, None), ((1,), 3, 1)]):
        sel = np.isin(feat, feats)
        cols = [(0 if f == 0 else 4) if t == 0 else 1 for f in feat[sel]]
        grads = np.stack([gd[bag[i] % B, c:c + D] for i, c in zip(np.nonzero(sel)[0], cols)])
        touched = np.unique(idx[sel])
        w, z, n = ftrl_reference_rows(W0[t].numpy(),
                                      np.zeros((W0[t].shape[0], D)), np.zeros((W0[t].shape[0], D)),
                                      idx[sel], grads, **reference_knobs(m.hyperparams))
        got_w = m.split_embedding_weights()[t].double()
        acc, lin = m.split_optimizer_states()[t]
        torch.testing.assert_close(got_w[touched], torch.from_numpy(w[touched]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(acc.double()[touched], torch.from_numpy(n[touched]), rtol=1e-5,
                                   atol=1e-6)
        torch.testing.assert_close(lin.double()[touched], torch.from_numpy(z[touched]), rtol=1e-5,
                                   atol=1e-5)
        untouched = np.ones(W0[t].shape[0], dtype=bool)
        untouched[touched] = False
        assert torch.equal(got_w[untouched], W0[t][untouched])


def test_cpp_is_deterministic_across_thread_counts():
    rng = np.random.default_rng(2)
    idx = torch.from_numpy(np.where(rng.random(80_000) < 0.3, 7, rng.integers(0, 500, 80_000)))
    off = torch.arange(0, 80_001, 40)
    g = torch.randn(1000, 2 * 13, generator=torch.Generator().manual_seed(2))
    results = []
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            torch.manual_seed(0)
            m = FTRLTableBatchedEmbeddingBags([(500, 13), (500, 13)], backend="cpp", **HP)
            for _ in range(2):
                m(idx, off).backward(g)
            results.append(tbe_state(m))
    finally:
        torch.set_num_threads(threads)
    assert_same_bits(results[0], results[1])


# ------------------------------------------------------------------ bad input
def _module(backend="cpp", **kw):
    torch.manual_seed(0)
    return FTRLTableBatchedEmbeddingBags([(10, 4), (6, 3)], backend=backend, **{**HP, **kw})


BAD_INPUTS = {
    "index_too_large": (dict(indices=_i64([1, 10, 2, 3])), "out of range"),
    "index_negative": (dict(indices=_i64([1, -1, 2, 3])), "out of range"),
    "offsets_decreasing": (dict(offsets=_i64([0, 3, 1, 4, 4])), "non-decreasing"),
    "offsets_last_not_N": (dict(offsets=_i64([0, 1, 2, 3, 3])), "indices.numel"),
    "offsets_wrong_count": (dict(offsets=_i64([0, 1, 2, 4])), "offsets"),
    "psw_length": (dict(per_sample_weights=torch.ones(3)), "per_sample_weights"),
    "psw_dtype": (dict(per_sample_weights=torch.ones(4, dtype=torch.int64)), "per_sample_weights"),
    "indices_dtype": (dict(indices=torch.tensor([1.0, 2.0, 3.0, 4.0])), "indices"),
    "offsets_2d": (dict(offsets=_i64([[0, 1, 2, 3, 4]])), "offsets"),
    "indices_device": (dict(indices=torch.zeros(4, dtype=torch.int64, device="meta")), "device"),
    "vbe_sum_mismatch": (dict(batch_size_per_feature_per_rank=[[1, 1], [1, 0]]), "sums to"),
    "vbe_feature_count": (dict(batch_size_per_feature_per_rank=[[2, 2]]), "batch_size_per_feature"),
    "vbe_ragged_ranks": (dict(batch_size_per_feature_per_rank=[[2, 0], [2]]), "batch_size_per_feature"),
}


# what the bounds check repairs under WARNING (the default) and refuses under FATAL
BOUNDS_CHECKED = ("index_too_large", "index_negative", "offsets_decreasing", "offsets_last_not_N")


def _bad_call(m, name):
    args = dict(indices=_i64([1, 5, 2, 5]), offsets=_i64([0, 1, 2, 3, 4]), per_sample_weights=None,
                batch_size_per_feature_per_rank=None)
    overrides, match = BAD_INPUTS[name]
    args.update(overrides)
    before = tbe_state(m)
    with pytest.raises(ValueError, match=match):
        m(**args)
    assert_same_bits(before, tbe_state(m))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_raises_and_changes_nothing(backend, name):
    """FATAL (an explicit choice): every bad input raises before anything changes."""
    _bad_call(_module(backend, bounds_check_mode=BoundsCheckMode.FATAL), name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(set(BAD_INPUTS) - set(BOUNDS_CHECKED)))
def test_malformed_arguments_raise_under_the_default_bounds_check(backend, name):
    """Under the default (WARNING) the arguments' dtypes, shapes, devices and VBE sizes are still
    checked; only bad index / offset values are repaired (tests/test_bounds_default.py)."""
    m = _module(backend)
    assert m.bounds_check_mode == BoundsCheckMode.WARNING
    _bad_call(m, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_warning_mode_counts_and_repairs(backend):
    H.check_warning_repairs(_module(backend, bounds_check_mode=BoundsCheckMode.WARNING))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_gradient_rows_are_skipped_and_counted(backend, bad):
    m = FTRLTableBatchedEmbeddingBags([(10, 4)], backend=backend, **HP)
    before = [t.detach().clone() for t in (m.weights_dev, m.accum_dev, m.linear_dev)]
    W0 = m.split_embedding_weights()[0].detach().double().clone()
    out = m(_i64([1, 2, 2, 3]), _i64([0, 2, 4]))            # bag 0 = rows 1, 2; bag 1 = rows 2, 3
    g = torch.ones(2, 4)
    g[0, 1] = bad                                           # rows 1 and 2 get a non-finite sum
    out.backward(g)
    assert int(m.nonfinite_grad_rows) == 2
    views = [t.view(10, 4) for t in (m.weights_dev, m.accum_dev, m.linear_dev)]
    for now, old in zip(views, before):
        old = old.view(10, 4)
        keep = torch.ones(10, dtype=torch.bool)
        keep[3] = False
        assert torch.equal(bits(now[keep]), bits(old[keep]))
    w, z, n = ftrl_reference_rows(W0.numpy(), np.zeros((10, 4)), np.zeros((10, 4)), [3],
                                  np.ones((1, 4)), **reference_knobs(m.hyperparams))
    torch.testing.assert_close(views[0][3].double(), torch.from_numpy(w[3]), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(views[2][3].double(), torch.from_numpy(z[3]), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ FBGEMM-shaped methods
def test_split_embedding_weights_are_views_in_table_order():
    m = _module()
    ws = m.split_embedding_weights()
    assert [tuple(w.shape) for w in ws] == [(10, 4), (6, 3)]
    ws[1][2, 1] = 7.5
    assert float(m.weights_dev[40 + 2 * 3 + 1]) == 7.5
    assert ws[0].data_ptr() == m.weights_dev.data_ptr()


def test_split_optimizer_states_and_get_optimizer_state():
    m = _module(ftrl_initial_accumulator_value=0.25)
    states = m.split_optimizer_states()
    assert [tuple(a.shape) for a, _ in states] == [(10, 4), (6, 3)]
    for a, z in states:
        assert a.dtype == torch.float32 and z.dtype == torch.float32
        assert bool((a == 0.25).all()) and bool((z == 0).all())
    states[0][1][4, 2] = 3.0                                  # views of linear
    assert float(m.linear_dev[4 * 4 + 2]) == 3.0
    named = m.get_optimizer_state()
    assert [sorted(d) for d in named] == [["accum", "linear"]] * 2
    assert named[0]["linear"].data_ptr() == m.linear_dev.data_ptr()
    assert named[1]["accum"].data_ptr() == m.accum_dev.data_ptr() + 40 * 4


@pytest.mark.parametrize("lr", [0.0, -0.1, math.nan, math.inf, "0.1"])
def test_set_learning_rate_validates(lr):
    m = _module()
    with pytest.raises(ValueError, match="learning_rate"):
        m.set_learning_rate(lr)
    assert m.get_learning_rate() == 0.1
    m.set_learning_rate(0.5)
    assert m.get_learning_rate() == 0.5


def test_learning_rate_change_reaches_the_kernel():
    m = _module()
    m.set_learning_rate(0.7)
    W0 = m.split_embedding_weights()[0].detach().double().clone()
    m(_i64([4]), _i64([0, 1, 1])).backward(torch.ones(1, 7))
    w, _, _ = ftrl_reference_rows(W0.numpy(), np.zeros((10, 4)), np.zeros((10, 4)), [4],
                                  np.ones((1, 4)), **{**reference_knobs(m.hyperparams), "lr": 0.7})
    torch.testing.assert_close(m.split_embedding_weights()[0][4].double(), torch.from_numpy(w[4]),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("params", [{"lr": 0.5, "ftrl_l1_reg": -1.0},
                                    {"learning_rate": 0.5, "ftrl_beta": math.nan},
                                    {"lr": 0.5, "ftrl_l1": 0.1},
                                    {"lr": 0.5, "ftrl_initial_accumulator_value": 0.2},
                                    {"ftrl_l2_convention": "keras", "lr": 0.3}])
def test_update_hyper_parameters_is_atomic_on_error(params):
    m = _module()
    hp = m.hyperparams
    with pytest.raises(ValueError):
        m.update_hyper_parameters(params)
    assert m.hyperparams == hp


def test_update_hyper_parameters_applies_all_knobs():
    m = _module()
    m.update_hyper_parameters({"lr": 0.3, "ftrl_l1_reg": 0.5, "ftrl_l2_convention": "mcmahan"})
    hp = m.hyperparams
    assert (hp.learning_rate, hp.l1_reg, hp.l2_reg, hp.l2_convention) == (0.3, 0.5, 0.02, "mcmahan")


@pytest.mark.parametrize("precision", [SparseType.FP32, SparseType.FP16, SparseType.BF16])
def test_init_embedding_weights_uniform(precision):
    m = FTRLTableBatchedEmbeddingBags([(300, 4), (200, 7)], weights_precision=precision)
    m.init_embedding_weights_uniform(2.0, 3.0)
    for w in m.split_embedding_weights():
        assert bool(((w >= 2.0) & (w <= 3.0)).all())
        assert float(w.float().std()) > 0.1                     # not a constant fill
    assert m.weights_dev.dtype == {SparseType.FP32: torch.float32, SparseType.FP16: torch.float16,
                                   SparseType.BF16: torch.bfloat16}[precision]
