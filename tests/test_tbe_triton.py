"""Tests of the Triton backend of ``FTRLTableBatchedEmbeddingBags``.

On a CPU-only machine (CI) the Triton kernels run under ``TRITON_INTERPRET=1`` on CPU tensors. Triton
fixes interpret-vs-compile when ``@triton.jit`` runs (its own ``tl.sum``/``tl.max`` included), so the
variable must be set before anything imports triton: :func:`test_interpreter_suite` re-runs this file's
``interp`` tests in a child pytest with the variable set (``conftest.run_interpreter_suite``), and
nothing else in the parent process sees it. Expected values come from the independent float64 oracle
of tests/conftest.py (``reference_update``: pooling by ``embedding_bag``, FTRL from
``tests/reference.py``), and from the vectorised PyTorch backend.

Tests marked ``cuda`` run the compiled kernels on a GPU: randomized parity, CPU vs CUDA parity, no
host synchronisation in a training step, and bitwise repeatability.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import cuda, interpreter_parent, needs_cuda, reference_update, run_interpreter_suite

pytest.importorskip("triton")

import tbe_harness as H  # noqa: E402
from reference import reference_knobs  # noqa: E402
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags  # noqa: E402
from torchrec_ftrl.fbgemm_enums import BoundsCheckMode, PoolingMode, SparseType  # noqa: E402
from torchrec_ftrl.kernels import calls  # noqa: E402
from torchrec_ftrl.kernels.cuda import backend as triton_backend  # noqa: E402
from torchrec_ftrl.kernels.knobs import knob_args  # noqa: E402

KNOBS = dict(learning_rate=0.05, ftrl_l1_reg=0.002, ftrl_l2_reg=0.01, ftrl_beta=0.3)


# ---------------------------------------------------------------------------- case + float64 oracle
def make_case(seed, *, specs, fmap, B, pooling, max_len=5, psw=False, vbe=None, hot=False,
              int32=False):
    """Random indices/offsets (feature-major bags). ``hot`` draws most ids from row 0 or 1."""
    rng = np.random.RandomState(seed)
    F = len(fmap)
    bags_per_feature = [sum(vbe[f]) for f in range(F)] if vbe else [B] * F
    lengths, idx = [], []
    for f in range(F):
        rows = specs[fmap[f]][0]
        for _ in range(bags_per_feature[f]):
            L = int(rng.randint(0, max_len + 1))
            lengths.append(L)
            if hot:
                ids = np.where(rng.rand(L) < 0.8, rng.randint(0, min(2, rows), L), rng.randint(0, rows, L))
            else:
                ids = rng.randint(0, rows, L)
            idx.extend(int(i) for i in ids)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    dt = torch.int32 if int32 else torch.int64
    out = dict(indices=torch.tensor(idx, dtype=dt), offsets=torch.tensor(offsets, dtype=dt),
               psw=torch.tensor(rng.rand(len(idx)) + 0.5, dtype=torch.float32) if psw else None)
    return out


def build(specs, fmap, pooling, device, backend="triton", precision=SparseType.FP32, seed=0, **knobs):
    torch.manual_seed(seed)
    mode = knobs.pop("bounds_check_mode", BoundsCheckMode.WARNING)
    m = FTRLTableBatchedEmbeddingBags(
        specs, feature_table_map=fmap, pooling_mode=pooling, weights_precision=precision,
        bounds_check_mode=mode, device=device, backend=backend, **{**KNOBS, **knobs})
    return m


def run_and_check(device, *, specs, fmap, pooling, B=3, psw=False, vbe=None, hot=False,
                  precision=SparseType.FP32, seed=0, int32=False, against_torch=True, nan_bag=None,
                  max_len=5, case=None, **knobs):
    m = build(specs, fmap, pooling, device, precision=precision, seed=seed, **knobs)
    if knobs.get("ftrl_initial_accumulator_value") is None:
        with torch.no_grad():  # start from a state that is not all-zero
            m.accum_dev.uniform_(0.0, 0.5)
            m.linear_dev.uniform_(-0.1, 0.1)
    if case is None:
        case = make_case(seed, specs=specs, fmap=fmap, B=B, pooling=pooling, psw=psw, vbe=vbe,
                         hot=hot, int32=int32, max_len=max_len)
    W0, S0 = H.table_snapshot(m)
    twin = None
    if against_torch:
        twin = build(specs, fmap, pooling, "cpu", backend="torch", precision=precision, seed=seed,
                     **knobs)
        twin.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()})
    dev = lambda t: t.to(device) if t is not None else None  # noqa: E731
    kw = dict(batch_size_per_feature_per_rank=vbe) if vbe else {}
    out = m(dev(case["indices"]), dev(case["offsets"]), dev(case["psw"]), **kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out.dtype)
    if nan_bag is not None:
        g.view(-1)[nan_bag] = float("nan")
    out.backward(g.to(device))
    ref = reference_update(W0, [n for n, _ in S0], [z for _, z in S0], fmap, pooling, case["indices"],
                           case["offsets"], g, reference_knobs(m.hyperparams), psw=case["psw"], vbe=vbe)
    wtol = dict(rtol=5e-5, atol=1e-5) if precision == SparseType.FP32 else dict(rtol=1.6e-2, atol=1e-3)
    np.testing.assert_allclose(out.detach().double().cpu().reshape(-1).numpy(),
                               ref.out.reshape(-1).numpy(), **wtol)
    if nan_bag is None:
        for t, (w, (n, z)) in enumerate(zip(m.split_embedding_weights(), m.split_optimizer_states())):
            # fp32 sums of up to hundreds of gradients against float64: a few 1e-6 relative.
            np.testing.assert_allclose(n.double().cpu().numpy(), ref.n[t], rtol=3e-5, atol=1e-6)
            np.testing.assert_allclose(z.double().cpu().numpy(), ref.z[t], rtol=5e-5, atol=1e-5)
            np.testing.assert_allclose(w.double().cpu().numpy(), ref.w[t], **wtol)
        assert int(m.nonfinite_grad_rows) == 0
    if twin is not None:
        out2 = twin(case["indices"], case["offsets"], case["psw"], **kw)
        out2.backward(g)
        torch.testing.assert_close(out.detach().cpu(), out2.detach(), rtol=1e-5, atol=1e-6)
        for name in ("weights_dev", "accum_dev", "linear_dev", "nonfinite_grad_rows"):
            a, b = getattr(m, name).cpu(), getattr(twin, name)
            # The torch backend sums duplicates with index_add_ (any order): hot rows with hundreds
            # of duplicates differ by a few 1e-4 relative; the float64 check above is the tight one.
            tol = wtol if name == "weights_dev" and precision != SparseType.FP32 else \
                dict(rtol=1e-3 if hot else 5e-5, atol=1e-3 if hot else 1e-5)
            torch.testing.assert_close(a.double(), b.double(), **tol)
    return m, case


# ---------------------------------------------------------------------------- interpreter (CI)
@interpreter_parent
def test_interpreter_suite():
    """Runs the ``interp`` tests below in a child pytest with TRITON_INTERPRET=1 (CPU tensors)."""
    run_interpreter_suite(__file__, timeout=600)


SPECS = [(9, 5), (13, 3), (6, 8), (4, 1)]
FMAP = [0, 1, 2, 3, 0]


@pytest.mark.parametrize("pooling,psw,precision,seed", [
    (PoolingMode.SUM, False, SparseType.FP32, 0),
    (PoolingMode.SUM, True, SparseType.FP16, 1),
    (PoolingMode.MEAN, True, SparseType.FP32, 2),
    (PoolingMode.MEAN, False, SparseType.BF16, 3),
])
def test_interp_pooled_parity(interp, pooling, psw, precision, seed):
    run_and_check(interp, specs=SPECS, fmap=FMAP, pooling=pooling, psw=psw, precision=precision,
                  seed=seed)


def test_interp_sequence_none_int32(interp):
    run_and_check(interp, specs=[(7, 6), (11, 6)], fmap=[0, 1, 1], pooling=PoolingMode.NONE,
                  int32=True, seed=4)


def test_interp_vbe(interp):
    run_and_check(interp, specs=SPECS[:3], fmap=[0, 1, 2], pooling=PoolingMode.SUM, psw=True,
                  vbe=[[1, 2], [3, 0], [2, 2]], seed=5)


@pytest.mark.parametrize("seg", [1, 3, 4, 32])
def test_interp_hot_rows_cut_into_segments(interp, monkeypatch, seg):
    """Most ids hit rows 0/1: their runs are far longer than SEG, so they are cut into many pieces
    (partial sums + combine kernel), next to short runs that are whole segments."""
    monkeypatch.setitem(triton_backend.TUNING, "seg", seg)
    run_and_check(interp, specs=[(3, 4), (50, 4)], fmap=[0, 1], pooling=PoolingMode.SUM, B=6,
                  hot=True, max_len=8, seed=6)


@pytest.mark.parametrize("knobs", [
    dict(ftrl_learning_rate_power=-0.3),
    dict(ftrl_learning_rate_power=0.0, ftrl_l2_shrinkage=0.05),
    dict(ftrl_l2_shrinkage=0.1, ftrl_l2_convention="mcmahan", ftrl_l1_reg=0.0),
    dict(ftrl_initial_accumulator_value=0.1, ftrl_beta=0.0, ftrl_l2_reg=0.0),
])
def test_interp_knobs(interp, knobs):
    run_and_check(interp, specs=SPECS[:2], fmap=[0, 1], pooling=PoolingMode.SUM, seed=7, **knobs)


def test_interp_nonfinite_rows_skipped(interp):
    specs, fmap = [(6, 4)], [0]
    m = build(specs, fmap, PoolingMode.SUM, interp)
    twin = build(specs, fmap, PoolingMode.SUM, "cpu", backend="torch")
    twin.load_state_dict(m.state_dict())
    indices = torch.tensor([0, 1, 1, 2, 3, 3, 4])
    offsets = torch.tensor([0, 3, 5, 7])          # bags {0,1,1}, {2,3}, {3,4}
    before = [t.clone() for t in (m.weights_dev, m.accum_dev, m.linear_dev)]
    out = m(indices, offsets)
    g = torch.ones_like(out)
    g[1, 2] = float("inf")                        # bag 1: rows 2 and 3 get a non-finite sum
    out.backward(g)
    twin(indices, offsets).backward(g)
    assert int(m.nonfinite_grad_rows) == 2
    for buf, b0 in zip((m.weights_dev, m.accum_dev, m.linear_dev), before):
        rows = buf.view(6, 4)
        assert torch.equal(rows[2:4], b0.view(6, 4)[2:4])     # skipped rows bit-for-bit unchanged
        assert torch.equal(rows[5], b0.view(6, 4)[5])         # untouched row unchanged
        assert not torch.equal(rows[[0, 1, 4]], b0.view(6, 4)[[0, 1, 4]])
    for name in ("weights_dev", "accum_dev", "linear_dev"):
        torch.testing.assert_close(getattr(m, name), getattr(twin, name), rtol=2e-5, atol=2e-6)


def test_interp_repeat_is_bitwise(interp):
    states = []
    for _ in range(2):
        m, _ = run_and_check(interp, specs=[(3, 4), (20, 4)], fmap=[0, 1], pooling=PoolingMode.MEAN,
                             B=5, hot=True, psw=True, seed=8, against_torch=False)
        states.append([getattr(m, n).clone() for n in ("weights_dev", "accum_dev", "linear_dev")])
    for a, b in zip(*states):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seg", [4, 5])
def test_interp_runs_cut_at_every_alignment(interp, monkeypatch, seg):
    """Runs of 1..3*SEG+1 duplicates of one row, starting at every alignment modulo SEG in the sorted
    order, next to single-entry runs: whole-run segments, first pieces of up to 2*SEG-1 entries,
    middle and last pieces, and runs ending exactly on a cut."""
    monkeypatch.setitem(triton_backend.TUNING, "seg", seg)
    counts = [1, seg, seg + 1, 2 * seg - 1, 2 * seg, 1, 2 * seg + 1, 3 * seg + 1, 2, seg - 1, 3, 1,
              4 * seg, 1]
    rng = np.random.RandomState(20)
    ids = rng.permutation(np.repeat(np.arange(len(counts)), counts))
    B = 7
    cuts = np.sort(rng.choice(np.arange(1, len(ids)), B - 1, replace=False))
    offsets = np.concatenate([[0], cuts, [len(ids)]])
    case = dict(indices=torch.tensor(ids, dtype=torch.int64),
                offsets=torch.tensor(offsets, dtype=torch.int64),
                psw=torch.tensor(rng.rand(len(ids)) + 0.5, dtype=torch.float32))
    run_and_check(interp, specs=[(len(counts) + 2, 6)], fmap=[0], pooling=PoolingMode.MEAN, B=B,
                  psw=True, case=case, seed=21)


def _torch_warning_twin(m):
    twin = FTRLTableBatchedEmbeddingBags(
        [(r, d) for r, d, *_ in m.embedding_specs], feature_table_map=m.feature_table_map,
        pooling_mode=m.pooling_mode, bounds_check_mode=BoundsCheckMode.WARNING, backend="torch",
        **KNOBS)
    twin.load_state_dict(m.state_dict())
    return twin


def test_interp_fused_warning_bounds_check(interp):
    """Fused WARNING check: a bad index reads row 0 (forward) and its gradient goes to row 0; offsets
    are clamped and made non-decreasing; everything is counted once per forward."""
    H.check_warning_repairs(build([(10, 3), (6, 4)], [0, 1], PoolingMode.SUM, interp))


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("indices,offsets,match", [
    ([1, 10, 2, 3], [0, 1, 2, 3, 4], "out of range"),          # row 10 of a 10-row table
    ([1, -1, 2, 3], [0, 1, 2, 3, 4], "out of range"),
    ([1, 5, 2, 3], [0, 3, 1, 4, 4], "non-decreasing"),
    ([1, 5, 2, 3], [0, 1, 2, 3, 3], "indices.numel"),
])
def test_interp_fused_fatal_check_raises_before_any_update(interp, grad, indices, offsets, match):
    """FATAL on the Triton backend: the kernels count bad offsets / indices, the TBE reads the count
    once after the forward and raises the named ValueError; weights, states, counters and ``iter``
    keep their bits, and the next valid batch trains as if the bad one never came."""
    from conftest import assert_same_bits, tbe_state
    m = build([(10, 3), (6, 4)], [0, 1], PoolingMode.SUM, interp, bounds_check_mode=BoundsCheckMode.FATAL)
    ref = build([(10, 3), (6, 4)], [0, 1], PoolingMode.SUM, interp, bounds_check_mode=BoundsCheckMode.FATAL)
    i64 = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    before = tbe_state(m)
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=match):
        m(i64(indices), i64(offsets))
    assert_same_bits(before, tbe_state(m))
    assert int(m.bounds_check_warning) == 0
    g = torch.linspace(-1.0, 1.0, 2 * 7).view(2, 7)
    for mod in (m, ref):
        mod(i64([1, 5, 2, 3]), i64([0, 1, 2, 3, 4])).backward(g)
    assert_same_bits(tbe_state(ref), tbe_state(m))


def test_interp_eval_forward_matches_training_forward(interp):
    """The eval forward (no autograd: checks and counts bad indices itself) and the training forward
    (linearises first, looks up by row keys) give the float64 pooled sums and count each bad index
    once per forward."""
    m = build([(10, 3), (6, 4)], [0, 1], PoolingMode.SUM, interp)
    W = [w.detach().double().clone() for w in m.split_embedding_weights()]
    idx, off = torch.tensor([1, 99, -4, 6, 5]), torch.tensor([0, 2, 3, 3, 5])
    expected = torch.stack([torch.cat([W[0][1] + W[0][0], torch.zeros(4, dtype=torch.float64)]),
                            torch.cat([W[0][0], W[1][0] + W[1][5]])])
    with torch.no_grad():
        out_eval = m(idx, off)
    assert int(m.bounds_check_warning) == 3
    out_train = m(idx, off)
    assert out_train.requires_grad and int(m.bounds_check_warning) == 6
    for out in (out_eval, out_train):
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-7)
    out_train.backward(torch.ones_like(out_train))
    assert int(m.bounds_check_warning) == 6                 # the backward does not count again


@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN])
def test_interp_backward_without_training_forward(interp, pooling):
    """``calls.backward_update_`` on a batch that the training forward did not linearise (it linearises
    itself, without counting bad indices again) updates the states exactly as the training path."""
    specs, fmap = [(9, 4), (5, 6)], [0, 1, 0]
    case = make_case(44, specs=specs, fmap=fmap, B=5, pooling=pooling, hot=True)
    idx = case["indices"].clone()
    idx[[0, 3]] = torch.tensor([-2, 50])                     # two bad indices (WARNING: row 0)
    mods = [build(specs, fmap, pooling, interp, seed=5) for _ in range(2)]
    outs = []
    for m, train in zip(mods, (True, False)):
        b = m._make_batch(idx, case["offsets"], None, None)
        if train:
            out, ctx = calls.forward_train(m._backend, m.table_arrays, b, torch.float32, m.hyperparams)
            assert isinstance(ctx, calls.Linearized) and len(ctx.lin) == 4
        else:
            out, ctx = calls.forward(m._backend, m.table_arrays, b, torch.float32, m.hyperparams), None
        g = torch.cos(out.double() * 3).float()
        calls.backward_update_(m._backend, m.table_arrays, b, ctx, g,
                               m.hyperparams, m.nonfinite_grad_rows)
        outs.append(out)
        assert int(m.bounds_check_warning) == 2
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for name in ("weights_dev", "accum_dev", "linear_dev"):
        assert torch.equal(getattr(mods[0], name), getattr(mods[1], name))
    assert not torch.equal(mods[0].weights_dev, build(specs, fmap, pooling, interp, seed=5).weights_dev)


@pytest.mark.parametrize("which", ["indices", "offsets", "per_sample_weights"])
def test_interp_strided_inputs(interp, which):
    """Strided (non-contiguous) indices, offsets or per-sample weights give the float64 pooled sums
    of their values (the kernels read flat memory, so the module copies strided views)."""
    m = build([(9, 4), (6, 4)], [0, 1], PoolingMode.SUM, interp)
    W = [w.detach().double().clone() for w in m.split_embedding_weights()]
    vals = dict(indices=torch.tensor([1, 2, 3, 5]), offsets=torch.tensor([0, 2, 3, 3, 4]),
                per_sample_weights=torch.tensor([0.5, 2.0, 1.5, 3.0]))
    t = vals[which]
    vals[which] = torch.stack([t, torch.full_like(t, 7)], 1)[:, 0]      # same values, stride 2
    assert not vals[which].is_contiguous()
    out = m(vals["indices"], vals["offsets"], vals["per_sample_weights"])
    # feature 0: bags [1, 2] and [3]; feature 1: bags [] and [5]
    expected = torch.stack([torch.cat([0.5 * W[0][1] + 2.0 * W[0][2], torch.zeros(4, dtype=torch.float64)]),
                            torch.cat([1.5 * W[0][3], 3.0 * W[1][5]])])
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-7)
    assert int(m.bounds_check_warning) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("linearize_bags", [64, 4])
def test_interp_fused_warning_matches_index0_substitution(interp, monkeypatch, seed, linearize_bags):
    """Random bad indices and malformed offsets: the fused check gives the count, the output and the
    updated states of the PyTorch backend's torch-side repair (bad index := 0); with 4 bags per
    linearize program the training forward's offsets repair spans several tiles."""
    monkeypatch.setitem(triton_backend.TUNING, "linearize", (linearize_bags, 2, 1))
    rng = np.random.RandomState(30 + seed)
    specs, fmap, B = [(9, 4), (5, 4)], [0, 1, 0], 6
    m = build(specs, fmap, PoolingMode.MEAN, interp)
    twin = _torch_warning_twin(m)
    N = 40
    rows = np.array([specs[f][0] for f in fmap])
    idx = rng.randint(-3, 12, N)
    off = np.sort(rng.randint(0, N + 1, len(fmap) * B + 1))
    off[0], off[-1] = 0, N
    off[[3, 9]] = [off[3] + 7, -2]            # one entry too large (non-monotone), one negative
    off[-1] = N + 3 if seed == 1 else N       # last entry out of range
    indices, offsets = torch.tensor(idx), torch.tensor(off)
    outs = []
    for mod in (m, twin):
        out = mod(indices, offsets)
        out.backward(torch.cos(3 * out.detach()))
        outs.append(out.detach())
    assert int(m.bounds_check_warning) == int(twin.bounds_check_warning) > 0
    assert int(m.bounds_check_warning) >= int(((idx < 0) | (idx >= rows.max())).sum())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for name in ("weights_dev", "accum_dev", "linear_dev"):
        torch.testing.assert_close(getattr(m, name), getattr(twin, name), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("n,bags_per_tile,lookback", [(23, 4, 32), (23, 4, 1), (40, 2, 2), (41, 4, 2),
                                                      (23, 64, 32), (1, 4, 32), (2, 4, 32)])
def test_interp_repair_offsets_matches_cummax(interp, monkeypatch, n, bags_per_tile, lookback):
    """The eval forward's one-pass repair of ``n`` offsets over tiles of ``bags_per_tile`` bags (one
    tile, several, the last one full or not, look-back windows of ``lookback`` tiles; a single
    offset) equals clamp + cummax with the ends pinned (numpy), counting the changed entries."""
    monkeypatch.setitem(triton_backend.TUNING, "repair_block", bags_per_tile)
    monkeypatch.setitem(triton_backend.TUNING, "lookback", lookback)
    rng = np.random.RandomState(40 + n)
    N = 50
    off = rng.randint(-10, N + 10, n)
    warn = torch.zeros(1, dtype=torch.int64)
    fixed = triton_backend.tbe_repair_offsets(torch.tensor(off), warn, N)
    exp = np.maximum.accumulate(np.clip(off, 0, N))
    exp[-1] = N
    exp[0] = 0                                   # zero bags: offsets [x] become [0]
    assert fixed.tolist() == exp.tolist()
    assert int(warn) == int((exp != off).sum())


def _stable_argsort_cases(total_rows: int, rng) -> np.ndarray:
    """Keys in ``[0, total_rows)`` with long runs at both ends of the range, shuffled."""
    keys = np.concatenate([rng.randint(0, total_rows, 500), np.full(40, total_rows - 1), np.zeros(30),
                           np.full(20, total_rows // 2)])
    rng.shuffle(keys)
    return keys


@pytest.mark.parametrize("key_dtype", [torch.int32, torch.int64])
def test_sort_positions_fbgemm_is_a_stable_sort(monkeypatch, key_dtype):
    """FBGEMM's sort (as built for CPU here) gives numpy's stable argsort of the row keys."""
    if not hasattr(torch.ops.fbgemm, "get_unique_indices_with_inverse"):
        pytest.skip("this fbgemm_gpu has no get_unique_indices_with_inverse")
    monkeypatch.setattr(triton_backend, "_fbgemm_sort_devices", {})
    keys = _stable_argsort_cases(3000, np.random.RandomState(7))
    perm = triton_backend._sort_positions(torch.tensor(keys, dtype=key_dtype), 3000)
    if triton_backend._fbgemm_sort_devices.get("cpu") is False:
        pytest.skip("fbgemm_gpu's sort op has no CPU kernel here")
    assert perm.dtype == torch.int32                 # FBGEMM's positions (torch.sort gives int64)
    assert perm.tolist() == np.argsort(keys, kind="stable").tolist()


def test_sort_positions_fallback_is_a_stable_sort(monkeypatch):
    """Where FBGEMM's op is unavailable, torch.sort gives the same stable order."""
    monkeypatch.setattr(triton_backend, "_fbgemm_sort_devices", {"cpu": False})
    keys = _stable_argsort_cases(3000, np.random.RandomState(8))
    perm = triton_backend._sort_positions(torch.tensor(keys, dtype=torch.int32), 3000)
    assert perm.dtype == torch.int64
    assert perm.tolist() == np.argsort(keys, kind="stable").tolist()


def test_sort_positions_under_fake_tensors_keeps_fbgemm(monkeypatch):
    """Fake tensors (the implementation called under FakeTensorMode) take torch.sort and
    leaves FBGEMM's sort on for later eager calls (it has no fake implementation)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    monkeypatch.setattr(triton_backend, "_fbgemm_sort_devices", {})
    with FakeTensorMode():
        perm = triton_backend._sort_positions(torch.empty(100, dtype=torch.int32), 3000)
    assert perm.dtype == torch.int64 and tuple(perm.shape) == (100,)
    assert triton_backend._fbgemm_sort_devices == {}


@cuda
@needs_cuda
@pytest.mark.parametrize("total_rows", [2 ** 12 - 1, 2 ** 12, 2 ** 12 + 1, 3_200_000])
def test_cuda_sort_positions_covers_the_row_bits(monkeypatch, total_rows):
    """On the GPU, FBGEMM's radix sort over the bits of ``total_rows - 1`` orders keys up to
    ``total_rows - 1`` (the largest row) exactly like numpy's stable argsort."""
    monkeypatch.setattr(triton_backend, "_fbgemm_sort_devices", {})
    keys = _stable_argsort_cases(total_rows, np.random.RandomState(total_rows % 1000))
    perm = triton_backend._sort_positions(torch.tensor(keys, dtype=torch.int32, device="cuda"),
                                          total_rows)
    assert perm.dtype == torch.int32, "FBGEMM's CUDA sort did not run"
    assert perm.cpu().tolist() == np.argsort(keys, kind="stable").tolist()


def _mark_reference(keys: np.ndarray, seg: int) -> list[int]:
    """Segment starts of sorted ``keys``: run starts, and every multiple ``p`` of ``seg`` inside a run
    with ``keys[p - seg] == keys[p]`` (the cut rule of triton_backward, written out in numpy)."""
    return [p for p in range(len(keys))
            if p == 0 or keys[p] != keys[p - 1] or (p % seg == 0 and p >= seg and keys[p - seg] == keys[p])]


def _run_mark(keys, gofs, ws, tiles, *, block, seg, lookback, grid, perm_dtype=torch.int64,
              key_dtype=torch.int32):
    """Runs segment_mark_kernel on sorted ``keys`` scattered by a fixed permutation (entry p of the
    sorted order sits at position N-1-p, reversed by blocks of 5); returns (sorted keys, sorted
    gradient offsets, segment starts) and the permutation."""
    from torchrec_ftrl.kernels.cuda.backward import segment_mark_kernel
    N = len(keys)
    perm = np.concatenate([np.arange(i, min(i + 5, N))[::-1] for i in range(0, N, 5)])[::-1].copy()
    key_in = np.empty(N, dtype=np.int64)
    key_in[perm] = keys                                        # key_in[perm[p]] == keys[p]
    sk = torch.full((N,), -1, dtype=key_dtype)
    sgofs = torch.full((N,), -1, dtype=torch.int32)
    segs = torch.full((N + 1,), -1, dtype=torch.int32)
    g = torch.tensor(gofs, dtype=torch.int32)
    # no factors / tables / cache slots (HAS_SCALE, HAS_TID, CACHED off): placeholder pointers
    segment_mark_kernel[grid](torch.tensor(key_in, dtype=key_dtype), torch.tensor(perm, dtype=perm_dtype),
                              g, g, g, g, sk, sgofs, sgofs, sgofs, sgofs, segs, ws, N, tiles, SEG=seg,
                              HAS_SCALE=False, HAS_TID=False, CACHED=False, BLOCK=block,
                              LOOKBACK=lookback)
    return sk, sgofs, segs, perm


@pytest.mark.parametrize("seed,seg,lookback,block,perm_dtype,key_dtype,n", [
    (0, 4, 2, 16, torch.int64, torch.int32, None), (1, 3, 8, 16, torch.int32, torch.int32, None),
    (2, 5, 1, 16, torch.int32, torch.int64, None),
    (3, 16, 2, 8, torch.int32, torch.int32, None),   # SEG > BLOCK: every p - SEG in an earlier tile
    (4, 4, 2, 16, torch.int32, torch.int32, 1), (5, 2, 2, 16, torch.int32, torch.int64, 11)])
def test_interp_segment_mark_compacts_starts(interp, seed, seg, lookback, block, perm_dtype, key_dtype,
                                             n):
    """Over many tiles (or one, ``n`` entries), the one-pass mark kernel writes the keys in sorted
    order, exactly the numpy segment starts (then N), their count, and each sorted entry's gradient
    offset gathered through the permutation."""
    rng = np.random.RandomState(seed)
    keys = np.sort(np.repeat(rng.randint(0, 60, 40), rng.randint(1, 12, 40)))
    if seg > block:                                  # long runs, so that cuts happen
        keys = np.sort(np.repeat(rng.randint(0, 6, 8), rng.randint(10, 60, 8)))
    if n is not None:
        keys = np.sort(rng.randint(0, 3, n))
    if key_dtype == torch.int64:                     # row keys past 2**32
        keys = keys + 2 ** 33
    N = len(keys)
    tiles = -(-N // block)
    gofs = rng.randint(0, 10 ** 6, N)
    ws = torch.zeros(tiles + 2, dtype=torch.int64)
    sk, sgofs, segs, perm = _run_mark(keys, gofs, ws, tiles, block=block, seg=seg,
                                      lookback=lookback, grid=(tiles,), perm_dtype=perm_dtype,
                                      key_dtype=key_dtype)
    starts = _mark_reference(keys, seg)
    assert sk.tolist() == keys.tolist()
    assert int(ws[tiles + 1]) == len(starts)
    assert segs[:len(starts) + 1].tolist() == starts + [N]
    assert sgofs.tolist() == gofs[perm].tolist()
    # every tile ends with its inclusive count published (flag 2)
    incl = [sum(1 for s in starts if s < min(N, (t + 1) * block)) for t in range(tiles)]
    assert ws[1:tiles + 1].tolist() == [(c << 2) | 2 for c in incl]


@pytest.mark.parametrize("lookback", [1, 2, 4, 32])
def test_interp_segment_mark_looks_back_over_unfinished_tiles(interp, lookback):
    """A tile whose predecessors published only their own counts (flag 1), down to tile 0's inclusive
    prefix (flag 2), adds them all, across several look-back windows, before writing its starts."""
    block, seg, tiles = 8, 4, 7
    rng = np.random.RandomState(3)
    keys = np.sort(rng.randint(0, 20, block * tiles))
    ws = torch.zeros(tiles + 2, dtype=torch.int64)
    ws[0] = 6                                                 # this launch gets tile 6, the last
    own = [2, 3, 1, 4, 1, 5]                                  # tiles 0..5
    ws[1] = (own[0] << 2) | 2
    ws[2:7] = torch.tensor([(c << 2) | 1 for c in own[1:]])
    _, _, segs, _ = _run_mark(keys, np.zeros(len(keys), dtype=np.int64), ws, tiles, block=block,
                              seg=seg, lookback=lookback, grid=(1,))
    prefix = sum(own)
    mine = [p for p in _mark_reference(keys, seg) if p >= 6 * block]
    assert segs[prefix:prefix + len(mine) + 1].tolist() == mine + [len(keys)]
    assert int(ws[tiles + 1]) == prefix + len(mine)
    assert int(ws[7]) == ((prefix + len(mine)) << 2) | 2


@pytest.mark.parametrize("num_bags,bags_per_tile,lookback", [(16, 4, 2), (23, 4, 1), (7, 64, 32),
                                                             (40, 2, 4)])
def test_interp_linearize_repairs_offsets(interp, monkeypatch, num_bags, bags_per_tile, lookback):
    """The training forward's linearize pass repairs raw offsets as clamp + running max with the ends
    pinned (numpy), over tiles of ``bags_per_tile`` bags (the last tile full or not), and adds the
    number of changed entries (no bad indices here) to the counter."""
    monkeypatch.setitem(triton_backend.TUNING, "lookback", lookback)
    monkeypatch.setitem(triton_backend.TUNING, "linearize", (bags_per_tile, 2, 1))
    rng = np.random.RandomState(num_bags)
    N = 60
    off = np.sort(rng.randint(0, N + 1, num_bags + 1))
    off[rng.randint(0, num_bags + 1, 3)] = [-4, N + 9, 7]      # negative, too large, maybe decreasing
    idx = torch.tensor(rng.randint(0, 5, N))
    warn = torch.zeros(1, dtype=torch.int64)
    bag_feature = torch.zeros(num_bags, dtype=torch.int64)
    zeros = torch.zeros(1, dtype=torch.int64)
    # one table of 5 rows x 4 (table_w_offset, table_dim, table_rows, table_row_base, feature_table)
    key, gofs, _, _, fixed = triton_backend.tbe_linearize(
        zeros, torch.tensor([4]), torch.tensor([5]), zeros, zeros, bag_feature, torch.arange(num_bags) * 4,
        idx, torch.tensor(off), None, int(PoolingMode.SUM), 4, (4,), 5, num_bags * 4, warn)
    exp = np.maximum.accumulate(np.clip(off, 0, N))
    exp[0], exp[-1] = 0, N
    assert fixed.tolist() == exp.tolist()
    assert int(warn) == int((exp != off).sum()) > 0
    bag_of = np.repeat(np.arange(num_bags), np.diff(exp))       # each index's bag, repaired offsets
    assert key.tolist() == idx.tolist()
    assert gofs.tolist() == (bag_of * 4).tolist()


def test_interp_zero_bags_bad_first_offset_counted_once(interp):
    """A batch of zero bags whose single offset is not 0: the training forward's linearize pass (one
    tile, no bags) still repairs and counts it, once, and the step changes no row."""
    m = build([(5, 4), (6, 4)], [0, 1], PoolingMode.SUM, interp)
    before = m.weights_dev.clone()
    out = m(torch.tensor([1, 2, 3]), torch.tensor([3]))
    assert tuple(out.shape) == (0, 8) and int(m.bounds_check_warning) == 1
    out.sum().backward()
    assert int(m.bounds_check_warning) == 1 and torch.equal(m.weights_dev, before)


def test_interp_warning_with_psw_grad_falls_back(interp):
    """per_sample_weights that need a gradient use the torch-side repair: same count and output."""
    m = build([(10, 3)], [0], PoolingMode.SUM, interp)
    psw = torch.tensor([0.5, 2.0, 1.5], requires_grad=True)
    W = m.split_embedding_weights()[0].detach().double().clone()
    out = m(torch.tensor([1, 12, -1]), torch.tensor([0, 2, 3]), psw)
    assert int(m.bounds_check_warning) == 2
    expected = torch.stack([0.5 * W[1] + 2.0 * W[0], 1.5 * W[0]])
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-7)
    out.sum().backward()
    torch.testing.assert_close(psw.grad.double(), torch.stack([W[1].sum(), W[0].sum(), W[0].sum()]),
                               rtol=1e-6, atol=1e-7)


def test_interp_empty_batch_changes_nothing(interp):
    m = build([(5, 3)], [0], PoolingMode.SUM, interp)
    before = m.weights_dev.clone()
    out = m(torch.zeros(0, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    assert out.shape == (2, 3) and torch.equal(out, torch.zeros(2, 3))
    out.sum().backward()
    assert torch.equal(m.weights_dev, before)


def test_ops_registered():
    """The unified ops whose CUDA kernels are the Triton functions (torchrec_ftrl/kernels/cuda/impls.py),
    with the arguments their schemas mutate."""
    update_mutates = {"weights", "accum", "linear", "nonfinite_rows", "cache_weights", "cache_accum",
                      "cache_linear"}
    for op, want in (("tbe_forward", {"warn"}), ("tbe_linearize", {"warn"}),
                     ("tbe_repair_offsets", {"warn"}), ("tbe_backward_update_", update_mutates)):
        assert hasattr(torch.ops.torchrec_ftrl, op)
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"torchrec_ftrl::{op}", "CUDA"), op
        schema = getattr(torch.ops.torchrec_ftrl, op).default._schema
        assert {a.name for a in schema.arguments
                if a.alias_info is not None and a.alias_info.is_write} == want, op


def test_register_cap_only_for_direct_compiled_launches(monkeypatch):
    """``maxnreg`` goes to compiled kernels launched directly on an NVIDIA GPU; not to interpreted
    kernels or other callables, not to other devices or ROCm."""
    from triton.runtime.jit import JITFunction
    kernel = triton_backend.segment_update_kernel
    if not isinstance(kernel, JITFunction):
        pytest.skip("kernels are interpreted in this process")
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.version, "hip", None)
    assert triton_backend._register_cap(triton_backend._k(kernel), 40, gpu) == {"maxnreg": 40}
    assert triton_backend._register_cap(kernel, None, gpu) == {}
    assert triton_backend._register_cap(lambda: None, 40, gpu) == {}
    assert triton_backend._register_cap(kernel, 40, torch.device("cpu")) == {}
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert triton_backend._register_cap(kernel, 40, gpu) == {}


def test_interp_register_cap_reaches_the_update_launch(interp, monkeypatch):
    """The third entry of a ``seg_launch`` tuple is the cap handed to the update kernel's launch
    (the interpreter then ignores it); a two-entry tuple hands none."""
    seen = []
    real = triton_backend._register_cap

    def spy(launcher, maxnreg, dev):
        seen.append(maxnreg)
        return real(launcher, maxnreg, dev)
    monkeypatch.setattr(triton_backend, "_register_cap", spy)
    for launch, want in (((32, 4, 40), 40), ((32, 4), None)):
        monkeypatch.setitem(triton_backend.TUNING, "seg_launch", {8: launch})
        seen.clear()
        run_and_check(interp, specs=SPECS[:2], fmap=[0, 1], pooling=PoolingMode.SUM, seed=21)
        assert seen == [want]


# ---------------------------------------------------------------------------- real GPU
@cuda
@needs_cuda
@pytest.mark.parametrize("pooling,psw,precision,seed", [
    (PoolingMode.SUM, False, SparseType.FP32, 10),
    (PoolingMode.SUM, True, SparseType.FP16, 11),
    (PoolingMode.MEAN, True, SparseType.FP32, 12),
    (PoolingMode.NONE, False, SparseType.BF16, 13),
])
def test_cuda_random_parity(pooling, psw, precision, seed):
    specs = [(200, 128), (50, 33), (1000, 64), (7, 16)] if pooling != PoolingMode.NONE else \
        [(200, 64), (50, 64)]
    fmap = [0, 1, 2, 3, 0] if pooling != PoolingMode.NONE else [0, 1, 1]
    run_and_check("cuda", specs=specs, fmap=fmap, pooling=pooling, psw=psw, precision=precision,
                  B=64, max_len=12, seed=seed)


@cuda
@needs_cuda
@pytest.mark.parametrize("seg", [32, 5])
def test_cuda_hot_rows_and_vbe(monkeypatch, seg):
    monkeypatch.setitem(triton_backend.TUNING, "seg", seg)
    run_and_check("cuda", specs=[(3, 128), (400, 64)], fmap=[0, 1], pooling=PoolingMode.SUM,
                  B=256, hot=True, max_len=30, seed=14)
    run_and_check("cuda", specs=[(30, 32), (40, 8)], fmap=[0, 1], pooling=PoolingMode.MEAN,
                  psw=True, vbe=[[10, 20], [5, 0]], seed=15)


@cuda
@needs_cuda
@pytest.mark.parametrize("specs", [[(300, 256), (60, 256)], [(300, 256), (40, 200), (9, 512)]])
def test_cuda_wide_rows_with_capped_registers(monkeypatch, specs):
    """Rows of 256 and more elements (all D equal, and mixed D up to BLOCK_D 512) with the update
    kernel capped at 40 registers per thread: against the float64 reference (hot rows cut into
    pieces and combined; MEAN with per-sample weights), the launch really compiled with the cap, and
    the updated tables bitwise equal to those of the uncapped kernel."""
    def compiled():
        return {id(ck): ck for cache in triton_backend.segment_update_kernel.device_caches.values()
                for ck in cache[0].values()}

    states = {}
    for cap in (40, None):
        launch = (4096, 4, cap) if cap else (4096, 4)
        monkeypatch.setitem(triton_backend.TUNING, "seg_launch", {256: launch, 512: launch})
        before = compiled()
        m, _ = run_and_check("cuda", specs=specs, fmap=list(range(len(specs))) + [0],
                             pooling=PoolingMode.SUM, B=96, hot=True, max_len=24, seed=17)
        states[cap] = [getattr(m, n).clone() for n in ("weights_dev", "accum_dev", "linear_dev")]
        new = [ck for k, ck in compiled().items() if k not in before]
        assert new and all(ck.metadata.maxnreg == cap for ck in new)     # compiled for this launch
        if cap:
            run_and_check("cuda", specs=specs, fmap=list(range(len(specs))), pooling=PoolingMode.MEAN,
                          psw=True, B=40, max_len=10, seed=18)
    for a, b in zip(states[40], states[None]):
        assert torch.equal(a, b)


@cuda
@needs_cuda
def test_cuda_nonfinite_rows_skipped():
    m, _ = run_and_check("cuda", specs=[(20, 16)], fmap=[0], pooling=PoolingMode.SUM, B=8,
                         nan_bag=5, seed=16)
    assert int(m.nonfinite_grad_rows) >= 1


def _step(m, idx, off):
    out = m(idx, off)
    out.backward(torch.ones_like(out))


@cuda
@needs_cuda
def test_cuda_training_step_does_not_sync():
    specs, fmap = [(1000, 64), (500, 128)], [0, 1, 1]
    m = build(specs, fmap, PoolingMode.MEAN, "cuda")
    case = make_case(17, specs=specs, fmap=fmap, B=64, pooling=PoolingMode.MEAN, hot=True)
    idx, off = case["indices"].cuda(), case["offsets"].cuda()
    _step(m, idx, off)                           # compile kernels, warm allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(m, idx, off)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@cuda
@needs_cuda
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_repeat_is_bitwise(deterministic):
    specs, fmap = [(1000, 128), (20, 64)], [0, 1, 0]
    rng = np.random.RandomState(18)
    B, L = 512, 20
    ids = np.minimum(rng.zipf(1.15, size=(len(fmap) * B * L,)) - 1, 19)
    idx = torch.tensor(ids, device="cuda")
    off = torch.arange(0, len(fmap) * B * L + 1, L, device="cuda")
    results = []
    for _ in range(2):
        torch.manual_seed(0)
        m = FTRLTableBatchedEmbeddingBags(specs, feature_table_map=fmap, device="cuda",
                                          deterministic=deterministic, **KNOBS)
        for _ in range(3):
            out = m(idx, off)
            out.backward(torch.cos(out))
        results.append([getattr(m, n).clone() for n in ("weights_dev", "accum_dev", "linear_dev")])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@cuda
@needs_cuda
def test_cuda_matches_cpu_backend():
    specs, fmap = [(300, 96), (40, 48)], [0, 1, 0]
    case = make_case(19, specs=specs, fmap=fmap, B=128, pooling=PoolingMode.SUM, psw=True, hot=True,
                     max_len=16)
    mods = [build(specs, fmap, PoolingMode.SUM, d, backend=b) for d, b in (("cuda", "triton"),
                                                                            ("cpu", "torch"))]
    mods[0].load_state_dict({k: v.cuda() for k, v in mods[1].state_dict().items()})
    for _ in range(3):
        outs = []
        for m in mods:
            dev = m.weights_dev.device
            out = m(case["indices"].to(dev), case["offsets"].to(dev), case["psw"].to(dev))
            out.backward(torch.sin(out))
            outs.append(out.detach().cpu())
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for name in ("weights_dev", "accum_dev", "linear_dev"):
        torch.testing.assert_close(getattr(mods[0], name).cpu(), getattr(mods[1], name),
                                   rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- shared harness
@pytest.mark.parametrize("seed", range(20))
def test_interp_harness_random_cases(interp, seed):
    """The randomized harness of tests/tbe_harness.py (shared with the CPU backends), backend triton."""
    H.check_case(H.random_case(seed), "triton", steps=2)


@cuda
@needs_cuda
@pytest.mark.parametrize("seed", range(40))
def test_cuda_harness_random_cases(seed):
    H.check_case(H.random_case(seed), "triton", device="cuda", steps=3)


@cuda
@needs_cuda
def test_cuda_ops_under_torch_compile():
    """The registered ops trace into one torch.compile graph (fullgraph) and give the eager results:
    linearise, forward output by row keys, then the FTRL update from the compiled backward op."""
    specs, fmap = [(300, 64), (40, 64)], [0, 1, 0]
    case = make_case(21, specs=specs, fmap=fmap, B=32, pooling=PoolingMode.SUM, hot=True)
    idx, off = case["indices"].cuda(), case["offsets"].cuda()
    mods = [build(specs, fmap, PoolingMode.SUM, "cuda", seed=3) for _ in range(3)]
    ops = torch.ops.torchrec_ftrl

    def step(m, compiled):
        b = m._make_batch(idx, off, None, None)
        hp = m.hyperparams

        def batch(offsets):
            # the ops' batch arguments (torchrec_ftrl/kernels/ops.py): no per-sample weights, SUM (0)
            return (b.table_w_offset, b.table_dim, b.table_rows, b.table_row_base, b.feature_table,
                    b.bag_feature, b.bag_out_offset, b.indices, offsets, None, 0, b.max_D, b.table_dims,
                    b.total_rows)

        def fwd_bwd(w, accum, linear, nonfinite):
            # The training path: linearise once (with the WARNING check and the offsets repair),
            # look up by row keys, then the backward reuses the linearised batch.
            assert b.unchecked_counter is not None                # a raw batch: the kernels check it
            lin = ops.tbe_linearize(*batch(b.offsets), b.out_numel, b.unchecked_counter)
            fixed = lin[4]                                     # repaired offsets
            # (knobs, pow_half, has_shrink); the knob tensor, traced: a constant of the graph
            knobs = knob_args(hp, idx.device)
            out = ops.tbe_forward(w, accum, linear, False, *batch(fixed), *knobs, b.out_numel,
                                  torch.float32, b.unchecked_counter, True, lin[0],
                                  None, None, None, None)       # no cache
            ops.tbe_backward_update_(w, accum, linear, False, *batch(fixed), torch.cos(out), *knobs,
                                     nonfinite, m.iter, True, *lin[:4], None, None, None, None)
            return out
        fn = torch.compile(fwd_bwd, fullgraph=True) if compiled else fwd_bwd
        return fn(m.weights_dev, m.accum_dev, m.linear_dev, m.nonfinite_grad_rows)

    out_e, out_c = step(mods[0], False), step(mods[1], True)
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=0)
    for name in ("weights_dev", "accum_dev", "linear_dev"):
        assert torch.equal(getattr(mods[0], name), getattr(mods[1], name))
    assert not torch.equal(mods[0].weights_dev, mods[2].weights_dev)   # the step did update


def test_tbe_methods_make_the_tables_cuda_device_current(monkeypatch):
    """``forward``, ``prefetch`` and ``flush`` run with the tables' CUDA device current: Triton and the
    direct launchers launch on the current device. Stand-ins for the device calls: tables on
    ``cuda:1`` while ``cuda:0`` is current enter ``torch.cuda.device(cuda:1)``; the current device,
    the CPU and a compiled trace enter nothing."""
    import contextlib
    import types
    from torchrec_ftrl.tbe.module import on_tables_device
    entered = []

    @contextlib.contextmanager
    def device(dev):
        entered.append(torch.device(dev))
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for name in ("forward", "prefetch", "flush"):
        method = getattr(FTRLTableBatchedEmbeddingBags, name)
        assert method.__wrapped__.__name__ == name   # the guard wraps the method itself
    body = on_tables_device(lambda self, x: (x, len(entered)))
    tables = lambda dev: types.SimpleNamespace(linear_dev=types.SimpleNamespace(device=torch.device(dev)))
    assert body(tables("cuda:1"), 7) == (7, 1) and entered == [torch.device("cuda:1")]
    assert body(tables("cuda:0"), 8) == (8, 1) and body(tables("cpu"), 9) == (9, 1)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert body(tables("cuda:1"), 10) == (10, 1)


@cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_tables_on_a_device_that_is_not_current(seed):
    """Tables on ``cuda:1`` while ``cuda:0`` is current (no ``torch.cuda.set_device``): every output and
    state matches the float64 reference, as on the current device."""
    assert torch.cuda.current_device() == 0
    H.check_case(H.random_case(seed), "triton", device="cuda:1", steps=3)
