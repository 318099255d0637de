"""Tests of compact (bf16) FTRL optimizer state: :mod:`torchrec_ftrl.state_dtype` and the TBE with
``optimizer_state_dtypes`` on every backend.

* The hash and the rounding: :func:`sr_bits` against a pure-Python-int transcription of the formula
  in its docstring; :func:`round_bf16_stochastic` against the two bf16 neighbours of each value, its
  mean over many keys against the fp32 value (unbiasedness), Inf / NaN kept.
* The TBE (cpp, torch; triton under ``TRITON_INTERPRET=1`` in a child pytest): bf16 accum and/or
  linear, SUM / MEAN / NONE pooling, duplicates and long runs, fp32 / fp16 weights, against the
  float64 reference of ``tests/conftest.py`` run from the *stored* (rounded) state of the previous
  step, with one bf16 spacing of the reference value added to the fp32 tolerance of the states
  (``tests/tbe_harness.py``); untouched rows keep their bits.
* Reproducibility: identical runs give identical bits; each stored bf16 state is
  ``round_bf16_stochastic(fp32 update, sr_bits(row key, column, step, state))``, where the fp32
  update is the same backend's fp32-state update from the same (rounded) inputs.
* The cache path (interpreter): cached rows (bf16 state caches) end bitwise equal to the same rows
  updated in the flat buffers; the state-cache kernels move bf16 rows bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import numpy as np
import pytest
import torch

import tbe_harness as H
from conftest import INTERP, bits, cuda, interpreter_parent, needs_cuda, run_interpreter_suite
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.fbgemm_enums import BoundsCheckMode, PoolingMode, SparseType
from torchrec_ftrl.state_dtype import (parse_state_dtypes, round_bf16_stochastic, sr_bits,
                                       state_sparse_types)

BF16 = SparseType.BF16
STATES = {"both": {"accum": BF16, "linear": BF16}, "accum": {"accum": BF16},
          "linear": {"linear": BF16}}


# ------------------------------------------------------------------ the hash, transcribed
def _py_lowbias32(x: int) -> int:
    M = 0xFFFFFFFF
    x &= M
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M
    x ^= x >> 15
    x = (x * 0x846CA68B) & M
    x ^= x >> 16
    return x


def _py_sr_bits(row_key: int, col: int, step: int, state: int) -> int:
    """The docstring of ``sr_bits``, in Python ints (arbitrary precision, reduced mod 2^32)."""
    M = 0xFFFFFFFF
    h = _py_lowbias32(((step & M) * 0x9E3779B9 + state) & M)
    h = _py_lowbias32(h ^ (row_key & M) ^ ((row_key >> 32) & M))
    return ((h + (col & M) * 0x9E3779B9) & M) >> 16


def test_sr_bits_match_the_transcribed_formula():
    rng = np.random.default_rng(0)
    keys = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**40 + 123, 2**62 + 7]
    keys += [int(k) for k in rng.integers(0, 2**63 - 1, size=20)]
    cols = [0, 1, 3, 127, 1000]
    for step in (0, 1, 7, 2**31 + 3, 2**32 + 1, 10**12):
        for state in (0, 1):
            got = sr_bits(torch.tensor(keys).unsqueeze(1), torch.tensor(cols), step, state)
            want = [[_py_sr_bits(k, c, step, state) for c in cols] for k in keys]
            assert got.dtype == torch.int64
            assert got.tolist() == want
    # A step given as an int64 [1] tensor (the TBE's iter buffer) is the same step.
    assert torch.equal(sr_bits(torch.tensor(keys), torch.tensor(2), torch.tensor([9]), 1),
                       torch.tensor([_py_sr_bits(k, 2, 9, 1) for k in keys]))


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _bf16_from_bits(hi: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (hi & 0xFFFF) << 16))[0]


def test_round_bf16_stochastic_picks_a_neighbour_and_rounds_up_with_the_dropped_bits():
    """Each result is the truncation of x or the next bf16 away from zero, and it is the latter
    exactly when the dropped 16 bits plus the random bits carry (>= 2^16)."""
    rng = np.random.default_rng(1)
    xs = np.concatenate([rng.standard_normal(300) * 10.0 ** rng.integers(-30, 30, 300),
                         [1.0, -1.0, 0.0, -0.0, 1e-40, -3e-39, 3.3e38]]).astype(np.float32)
    rbits = rng.integers(0, 2**16, size=xs.size)
    got = round_bf16_stochastic(torch.from_numpy(xs), torch.from_numpy(rbits))
    assert got.dtype == torch.bfloat16
    for x, r, g in zip(xs.tolist(), rbits.tolist(), got.float().tolist()):
        u = _f32_bits(x)
        down = _bf16_from_bits(u >> 16)                          # truncation (towards zero)
        up = _bf16_from_bits((u >> 16) + 1)                      # next bf16 away from zero
        want = up if (u & 0xFFFF) + r >= 2**16 else down
        assert g == want or (math.isinf(want) and g == want), (x, r, g, down, up)
        assert min(down, up) <= x <= max(down, up) or math.isinf(up)


def test_round_bf16_stochastic_keeps_bf16_values_and_non_finite():
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e38], dtype=torch.bfloat16).float()
    for r in (0, 1, 0xFFFF):
        assert torch.equal(bits(round_bf16_stochastic(exact, torch.tensor(r))),
                           bits(exact.to(torch.bfloat16)))
    inf = torch.tensor([math.inf, -math.inf])
    for r in (0, 0xFFFF):
        assert torch.equal(round_bf16_stochastic(inf, torch.tensor(r)).float(), inf)
    # quiet NaN, a NaN whose payload sits only in the dropped low bits (truncation alone would make
    # it an Inf), a negative NaN
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0xFF800100 - 2**32], dtype=torch.int32).view(torch.float32)
    assert bool(torch.isnan(nans).all())
    for r in (0, 0x1234, 0xFFFF):
        assert bool(torch.isnan(round_bf16_stochastic(nans, torch.tensor(r)).float()).all())


@pytest.mark.parametrize("x", [1.0 + 1.0 / 3.0 * 2.0**-7, 1000.3, -0.0123456, 2.0**-100 * (1 + 0.3 * 2.0**-7)])
def test_round_bf16_stochastic_is_unbiased_over_keys(x):
    """Over n keys the mean of the rounded values converges to x: each sample is one of two
    neighbours ``ulp`` apart, so its standard deviation is at most ulp / 2 and the mean's at most
    ulp / (2 sqrt n); the test allows 5 of those. Round to nearest would be off by
    min(frac, 1 - frac) ulp, far outside for these x."""
    n = 200_000
    x32 = float(np.float32(x))
    keys = torch.arange(n, dtype=torch.int64) * 7919 + 13
    r = round_bf16_stochastic(torch.full((n,), x32), sr_bits(keys, torch.tensor(5), 42, 0))
    u = _f32_bits(x32)
    down, up = _bf16_from_bits(u >> 16), _bf16_from_bits((u >> 16) + 1)
    ulp = abs(up - down)
    vals = r.double()
    assert bool(((vals == down) | (vals == up)).all())
    tol = 5 * ulp / (2 * math.sqrt(n))
    assert abs(vals.mean().item() - x32) <= tol
    frac = abs(x32 - down) / ulp
    assert min(frac, 1 - frac) * ulp > 10 * tol      # the check could tell round-to-nearest apart


def test_state_dtypes_spellings_and_refusals():
    both = parse_state_dtypes({"accum": BF16, "linear": torch.bfloat16})
    assert both == {"accum": torch.bfloat16, "linear": torch.bfloat16}
    assert parse_state_dtypes(frozenset({("linear", BF16.as_int())})) == {
        "accum": torch.float32, "linear": torch.bfloat16}
    assert state_sparse_types(both) == {"accum": BF16, "linear": BF16}
    for bad, word in (({"accum": SparseType.FP16}, "FP16"), ({"momentum1": BF16}, "momentum1"),
                      ("bf16", "bf16")):
        with pytest.raises(ValueError, match="optimizer_state_dtypes") as e:
            FTRLTableBatchedEmbeddingBags([(4, 3)], optimizer_state_dtypes=bad)
        assert word in str(e.value)


# ------------------------------------------------------------------ the TBE
def _case(pooling, precision, seed, hp=None):
    dims = [4, 4] if pooling == PoolingMode.NONE else [5, 3]
    return H.TBECase(
        specs=[(30, dims[0]), (7, dims[1])], feature_table_map=[0, 1, 0], pooling=pooling,
        weights_precision=precision, output_dtype=SparseType.FP32,
        weighted=pooling != PoolingMode.NONE, vbe=None, B=3, max_L=4, hot=0.5, long_bag=True,
        index_dtype=torch.int64, seed=seed,
        hp=hp or dict(learning_rate=0.1, ftrl_l1_reg=0.01, ftrl_l2_reg=0.01, ftrl_beta=0.5,
                      ftrl_initial_accumulator_value=0.1))


def _tbe_module(backend, states, precision=SparseType.FP32, pooling=PoolingMode.SUM, seed=0,
                device="cpu", **kw):
    torch.manual_seed(seed)
    m = FTRLTableBatchedEmbeddingBags(
        [(30, 5), (7, 3)] if pooling != PoolingMode.NONE else [(30, 4), (7, 4)],
        feature_table_map=[0, 1, 0], pooling_mode=pooling, weights_precision=precision,
        backend=backend, bounds_check_mode=BoundsCheckMode.WARNING, learning_rate=0.1,
        ftrl_l1_reg=0.01, ftrl_l2_reg=0.01, ftrl_beta=0.5, optimizer_state_dtypes=states,
        device=device, **kw)
    m.init_embedding_weights_uniform(-0.5, 0.5)
    return m


def _batches(steps, seed, rows=(30, 7), fmap=(0, 1, 0), B=3):
    """Fixed batches with duplicates (a hot row) and one long bag (runs longer than SEG=4)."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(steps):
        idx, lengths = [], []
        for f, t in enumerate(fmap):
            for b in range(B):
                L = 9 if (f, b) == (0, 1) else int(rng.integers(0, 4))
                ids = rng.integers(0, rows[t], L)
                ids[rng.random(L) < 0.5] = 1
                idx.extend(ids.tolist())
                lengths.append(L)
        out.append((torch.tensor(idx), torch.tensor(np.concatenate([[0], np.cumsum(lengths)])),
                    int(rng.integers(1 << 30))))
    return out


def _train(m, batches):
    dev = m.weights_dev.device
    for idx, off, g_seed in batches:
        out = m(idx.to(dev), off.to(dev))
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(g_seed)).to(dev))


def _check_tbe_against_reference(backend, states, pooling, precision):
    for seed in (0, 1):
        H.check_case(_case(pooling, precision, seed), backend, steps=3,
                     optimizer_state_dtypes=STATES[states])


def _check_sr_of_fp32_update(backend, states, pooling, steps=3, device="cpu"):
    """Each step, from the compact module's stored state: an fp32-state twin (the same backend's
    fp32 kernels, same inputs) computes the fp32 update; the compact module must store exactly
    ``round_bf16_stochastic(that, sr_bits(row key, column, step, state))`` for its bf16 states (an
    untouched row's fp32 value is its bf16 value, which rounds to itself) and the fp32 values for
    the others, the same weights, and leave untouched rows' bits alone."""
    compact = _tbe_module(backend, STATES[states], pooling=pooling, device=device)
    twin = _tbe_module(backend, None, pooling=pooling, device=device)
    specs = [(30, compact._geometry.dims[0]), (7, compact._geometry.dims[1])]
    row_base = [0, 30]
    for step, (idx, off, g_seed) in enumerate(_batches(steps, seed=3)):
        with torch.no_grad():
            twin.weights_dev.copy_(compact.weights_dev)
            twin.accum_dev.copy_(compact.accum_dev.float())
            twin.linear_dev.copy_(compact.linear_dev.float())
        before = [t.clone() for t in (compact.weights_dev, compact.accum_dev, compact.linear_dev)]
        for m in (compact, twin):
            _train(m, [(idx, off, g_seed)])
        assert int(compact.iter) == step + 1
        assert torch.equal(bits(compact.weights_dev), bits(twin.weights_dev))
        # rows of the batch: feature f of bag k reads table fmap[f] (bags feature-major, B = 3)
        bag_table = np.repeat([0, 1, 0], 3)
        idx_table = np.repeat(bag_table, np.diff(off.numpy()))
        for s_id, name in enumerate(("accum", "linear")):
            got = getattr(compact, f"{name}_dev").cpu()
            fp32 = getattr(twin, f"{name}_dev").cpu()
            if got.dtype == torch.float32:
                assert torch.equal(bits(got), bits(fp32))
                continue
            for t, (rows, dim) in enumerate(specs):
                o = compact.weights_physical_offsets[t]
                view = slice(o, o + rows * dim)
                keys = torch.arange(rows).unsqueeze(1) + row_base[t]
                want = round_bf16_stochastic(fp32[view].view(rows, dim),
                                             sr_bits(keys, torch.arange(dim), step, s_id))
                now = got[view].view(rows, dim)
                assert torch.equal(bits(now), bits(want)), (name, t, step)
                untouched = torch.ones(rows, dtype=torch.bool)
                untouched[torch.as_tensor(idx.numpy()[idx_table == t], dtype=torch.long)] = False
                old = before[1 + s_id][view].view(rows, dim).cpu()
                assert torch.equal(bits(now[untouched]), bits(old[untouched]))


def _check_repeat_is_bitwise(backend, states, device="cpu"):
    runs = []
    for _ in range(2):
        m = _tbe_module(backend, STATES[states], device=device)
        _train(m, _batches(3, seed=5))
        runs.append([bits(t) for t in (m.weights_dev, m.accum_dev, m.linear_dev)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _check_nonfinite_rows_keep_bf16_bits(backend):
    m = _tbe_module(backend, STATES["both"])
    _train(m, _batches(1, seed=6))
    before = [t.clone() for t in (m.weights_dev, m.accum_dev, m.linear_dev)]
    idx, off = torch.tensor([2, 3]), torch.tensor([0, 1, 2, 2, 2, 2, 2, 2, 2, 2])
    out = m(idx, off)
    g = torch.zeros(out.shape)
    g[0, 0] = math.nan           # bag 0 (feature 0, row 2): non-finite; bag 1 (row 3): finite
    g[1, 1] = 1.0
    out.backward(g)
    assert int(m.nonfinite_grad_rows) == 1
    D = m._geometry.dims[0]
    row2, row3 = slice(2 * D, 3 * D), slice(3 * D, 4 * D)
    for now, old in zip((m.weights_dev, m.accum_dev, m.linear_dev), before):
        assert torch.equal(bits(now[row2]), bits(old[row2]))
    assert not torch.equal(bits(m.accum_dev[row3]), bits(before[1][row3]))


CPU = ["cpp", "torch"]


@pytest.mark.parametrize("backend", CPU)
@pytest.mark.parametrize("states", sorted(STATES))
@pytest.mark.parametrize("pooling,precision", [(PoolingMode.SUM, SparseType.FP32),
                                               (PoolingMode.MEAN, SparseType.FP16),
                                               (PoolingMode.NONE, SparseType.FP32)])
def test_tbe_bf16_state_matches_reference(backend, states, pooling, precision):
    _check_tbe_against_reference(backend, states, pooling, precision)


@pytest.mark.parametrize("backend", CPU)
@pytest.mark.parametrize("states", sorted(STATES))
@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.NONE])
def test_tbe_bf16_state_is_the_sr_of_the_fp32_update(backend, states, pooling):
    _check_sr_of_fp32_update(backend, states, pooling)


@pytest.mark.parametrize("backend", CPU)
@pytest.mark.parametrize("states", ["both", "linear"])
def test_tbe_bf16_state_repeats_bitwise(backend, states):
    _check_repeat_is_bitwise(backend, states)


@pytest.mark.parametrize("backend", CPU)
def test_tbe_bf16_state_nonfinite_rows_keep_their_bits(backend):
    _check_nonfinite_rows_keep_bf16_bits(backend)


def _assert_same_bits_where_fp32_agrees(a: str, b: str) -> None:
    """One step from the same state on backends ``a`` and ``b``, with bf16 state and with fp32 state:
    wherever the fp32-state updates agree (most elements), the bf16 states agree bitwise."""
    mods = {k: _tbe_module(k, STATES["both"]) for k in (a, b)}
    twins = {k: _tbe_module(k, None) for k in (a, b)}
    batch = _batches(1, seed=8)
    for k in (a, b):
        _train(mods[k], batch)
        _train(twins[k], batch)
    for name in ("accum_dev", "linear_dev"):
        same = getattr(twins[a], name) == getattr(twins[b], name)
        assert same.float().mean() > 0.5
        assert torch.equal(bits(getattr(mods[a], name)[same]), bits(getattr(mods[b], name)[same]))


def test_cpp_and_torch_store_the_same_bits_for_the_same_fp32_values():
    """One step from the same state on both CPU backends: wherever their fp32 updates agree (the
    twins compute the same rule; rounding differences are rare), the bf16 states agree bitwise:
    the C++ hash is the torch one."""
    _assert_same_bits_where_fp32_agrees("cpp", "torch")


def test_tbe_state_dtype_surface():
    m = FTRLTableBatchedEmbeddingBags([(6, 4), (3, 2)], optimizer_state_dtypes={"accum": BF16},
                                      ftrl_initial_accumulator_value=0.1)
    assert m.optimizer_state_dtypes == {"accum": BF16, "linear": SparseType.FP32}
    assert (m.accum_dev.dtype, m.linear_dev.dtype) == (torch.bfloat16, torch.float32)
    (a0, z0), _ = m.split_optimizer_states()
    assert a0.dtype == torch.bfloat16 and a0.shape == (6, 4) and z0.dtype == torch.float32
    assert a0.data_ptr() == m.accum_dev.data_ptr()                  # a view, not a copy
    assert m.get_optimizer_state()[1]["accum"].dtype == torch.bfloat16
    assert "accum=bf16, linear=fp32" in repr(m)
    with torch.no_grad():
        m.accum_dev.fill_(3.0)
        m.linear_dev.fill_(2.0)
    m.reset_optimizer_state()
    assert bool((m.accum_dev.double() == 0.10009765625).all())   # 0.1 to nearest bf16: 205 / 2^11
    assert bool((m.linear_dev == 0).all())
    fp32 = FTRLTableBatchedEmbeddingBags([(6, 4)])
    assert fp32.optimizer_state_dtypes == {"accum": SparseType.FP32, "linear": SparseType.FP32}
    assert fp32.accum_dev.dtype == torch.float32 and "accum=fp32, linear=fp32" in repr(fp32)


def test_backends_refuse_bf16_state_without_a_step():
    from torchrec_ftrl.kernels import backend, calls
    from torchrec_ftrl.kernels.pytorch import rows as torch_backend
    m = _tbe_module("torch", STATES["linear"])
    idx, off = torch.tensor([1, 2]), torch.tensor([0, 1, 2, 2, 2, 2, 2, 2, 2, 2])
    batch = dataclasses.replace(m._make_batch(idx, off, None, None), step=None)
    g = torch.ones(3 * m.total_D)
    updates = [lambda: torch_backend.backward_update_(m.table_arrays, batch, g, m.hyperparams,
                                                      m.nonfinite_grad_rows),
               lambda: calls.backward_update_(backend._load("cpp"), m.table_arrays, batch, None, g,
                                              m.hyperparams, m.nonfinite_grad_rows)]
    for update in updates:
        with pytest.raises(ValueError, match="step"):
            update()


# ------------------------------------------------------------------ Triton under the interpreter
@interpreter_parent
def test_interpreter_suite():
    """Runs the ``interp`` tests below in a child pytest with TRITON_INTERPRET=1 (CPU tensors)."""
    run_interpreter_suite(__file__, timeout=900)


@pytest.mark.parametrize("states", sorted(STATES))
@pytest.mark.parametrize("pooling,precision", [(PoolingMode.SUM, SparseType.FP32),
                                               (PoolingMode.MEAN, SparseType.FP16),
                                               (PoolingMode.NONE, SparseType.FP32)])
def test_interp_tbe_bf16_state_matches_reference(interp, states, pooling, precision):
    H.check_case(_case(pooling, precision, 0), "triton", steps=2,
                 optimizer_state_dtypes=STATES[states])


@pytest.mark.parametrize("states", sorted(STATES))
def test_interp_tbe_bf16_state_is_the_sr_of_the_fp32_update(interp, states):
    _check_sr_of_fp32_update("triton", states, PoolingMode.SUM, steps=2)


def test_interp_tbe_bf16_state_repeats_bitwise(interp):
    _check_repeat_is_bitwise("triton", "both")


def test_interp_tbe_bf16_state_nonfinite_rows_keep_their_bits(interp):
    _check_nonfinite_rows_keep_bf16_bits("triton")


def test_interp_triton_stores_the_torch_backend_bits(interp):
    """The Triton uint32 hash is the torch one: from the same state, wherever the two backends'
    fp32 updates agree, their bf16 states agree bitwise."""
    _assert_same_bits_where_fp32_agrees("triton", "torch")


@pytest.mark.parametrize("states", ["both", "linear"])
def test_interp_cached_rows_with_bf16_state_match_the_flat_update(interp, states):
    """Half of the touched rows sit in a hand-made cache whose state caches hold bf16 (or fp32 for
    an fp32 state) copies of the same rows: after one step the cached copies equal, bit for bit,
    the same rows of a twin updated in its flat buffers (the same kernels, same rounding keys), and
    the flat copies of cached rows are untouched."""
    from torchrec_ftrl.kernels import calls
    cached, flat = (_tbe_module("triton", STATES[states]) for _ in range(2))
    for m in (cached, flat):
        _train(m, _batches(1, seed=9))                       # non-trivial states (iter 1)
    idx, off, g_seed = _batches(1, seed=10)[0]
    batch = cached._make_batch(idx, off, None, None)
    keys = (batch.table_row_base[batch.index_table()] + batch.indices).tolist()
    uniq = sorted(set(keys))
    rng = np.random.default_rng(0)
    hot = [int(k) for k in rng.permutation(uniq)[: len(uniq) // 2]]
    slots, S = len(uniq) + 2, max(cached._geometry.dims) + 3
    slot_of = dict(zip(hot, rng.permutation(slots)[: len(hot)].tolist()))
    cw = torch.full((slots, S), 7.0)
    cn = torch.full((slots, S), 9.0, dtype=cached.accum_dev.dtype)
    cz = torch.full((slots, S), 9.0, dtype=cached.linear_dev.dtype)
    row_off = {}
    for k, s in slot_of.items():
        t = 0 if k < 30 else 1
        D = cached._geometry.dims[t]
        o = cached.weights_physical_offsets[t] + (k - [0, 30][t]) * D
        row_off[k] = (o, D)
        cw[s, :D], cn[s, :D], cz[s, :D] = (cached.weights_dev[o:o + D], cached.accum_dev[o:o + D],
                                           cached.linear_dev[o:o + D])
    loc = torch.tensor([slot_of.get(k, -1) for k in keys], dtype=torch.int32)
    batch = dataclasses.replace(batch, cache_locations=loc, cache_weights=cw, cache_states=(cn, cz))
    flat_before = [t.clone() for t in (cached.weights_dev, cached.accum_dev, cached.linear_dev)]
    out, ctx = calls.forward_train(cached._backend, cached.table_arrays, batch, torch.float32,
                                   cached.hyperparams)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(g_seed)).reshape(-1)
    calls.backward_update_(cached._backend, cached.table_arrays, batch,
                           ctx, g, cached.hyperparams, cached.nonfinite_grad_rows)
    out_flat = flat(idx, off)
    out_flat.backward(g.view(out_flat.shape))                # flat.iter was 1 too: same step
    for k, s in slot_of.items():
        o, D = row_off[k]
        for cache, now, before, twin in ((cw, cached.weights_dev, flat_before[0], flat.weights_dev),
                                         (cn, cached.accum_dev, flat_before[1], flat.accum_dev),
                                         (cz, cached.linear_dev, flat_before[2], flat.linear_dev)):
            assert torch.equal(bits(cache[s, :D]), bits(twin[o:o + D]))
            assert torch.equal(bits(now[o:o + D]), bits(before[o:o + D]))
    uncached = torch.ones(cached.weights_dev.numel(), dtype=torch.bool)
    for o, D in row_off.values():
        uncached[o:o + D] = False
    for name in ("weights_dev", "accum_dev", "linear_dev"):
        assert torch.equal(bits(getattr(cached, name)[uncached]), bits(getattr(flat, name)[uncached]))


def test_interp_state_cache_kernels_move_bf16_rows_bit_for_bit(interp):
    """The follow kernel (flush / slot changes) on bf16 state caches: rows are copied as stored."""
    from torchrec_ftrl.kernels.cuda.cache import state_cache_follow_kernel
    row_base = torch.tensor([0, 5, 12])
    w_off = torch.tensor([0, 5 * 4])
    dims = torch.tensor([4, 8])
    total = 5 * 4 + 7 * 8
    gen = torch.Generator().manual_seed(0)
    accum = torch.rand(total, generator=gen).to(torch.bfloat16)
    linear = (torch.rand(total, generator=gen) - 0.5).to(torch.bfloat16)
    row_table = torch.tensor([0] * 5 + [1] * 7, dtype=torch.int32)
    S = 10
    cn = (torch.rand(6, S, generator=gen) + 100.0).to(torch.bfloat16)
    cz = (torch.rand(6, S, generator=gen) - 100.0).to(torch.bfloat16)
    before = torch.tensor([3, 6, -1, 11, 2, -1])
    after = torch.tensor([3, 8, 0, -1, 2, -1])
    acc0, lin0, cn0, cz0 = accum.clone(), linear.clone(), cn.clone(), cz.clone()
    state_cache_follow_kernel[(3,)](before, after, accum, linear, cn, cz, row_table, w_off, dims,
                                    row_base, 6, S, SLOTS=2, BLOCK_D=8, ROWWISE=False)

    def flat(row):
        t = int(row_table[row])
        start = int(w_off[t]) + (row - int(row_base[t])) * int(dims[t])
        return slice(start, start + int(dims[t])), int(dims[t])

    exp = [acc0.clone(), lin0.clone(), cn0.clone(), cz0.clone()]
    for slot, old in ((1, 6), (3, 11)):
        sl, D = flat(old)
        exp[0][sl], exp[1][sl] = cn0[slot, :D], cz0[slot, :D]
    for slot, new in ((1, 8), (2, 0)):
        sl, D = flat(new)
        exp[2][slot, :D], exp[3][slot, :D] = acc0[sl], lin0[sl]
    for got, want in zip((accum, linear, cn, cz), exp):
        assert got.dtype == torch.bfloat16 and torch.equal(bits(got), bits(want))


# ------------------------------------------------------------------ CUDA: the compiled kernels
@cuda
@needs_cuda
@pytest.mark.parametrize("states", sorted(STATES))
@pytest.mark.parametrize("pooling,precision", [(PoolingMode.SUM, SparseType.FP32),
                                               (PoolingMode.MEAN, SparseType.FP16),
                                               (PoolingMode.NONE, SparseType.FP32)])
def test_cuda_tbe_bf16_state_matches_reference(states, pooling, precision):
    for seed in (0, 1):
        H.check_case(_case(pooling, precision, seed), "triton", device="cuda", steps=3,
                     optimizer_state_dtypes=STATES[states])


@cuda
@needs_cuda
@pytest.mark.parametrize("states", sorted(STATES))
def test_cuda_tbe_bf16_state_is_the_sr_of_the_fp32_update(states):
    """The compiled uint32 hash and rounding: bit for bit the torch functions' result on the fp32
    kernels' update."""
    _check_sr_of_fp32_update("triton", states, PoolingMode.SUM, device="cuda")


@cuda
@needs_cuda
def test_cuda_tbe_bf16_state_repeats_bitwise():
    _check_repeat_is_bitwise("triton", "both", device="cuda")


@cuda
@needs_cuda
def test_cuda_large_row_keys_and_long_runs_round_like_the_torch_functions():
    """Row keys past 2^31 (int64 keys in the kernels: the hash's high word) and a run long enough
    to be cut into pieces and combined (segment_combine_kernel stores with SR too): table 1's keys
    are ``2^31 + 64 + r``. Its bf16 states equal the torch functions' rounding of an fp32-state
    twin's update (same batch, same summation order: table 0 is not touched)."""
    rows0 = 2**31 + 64                                  # D = 1: 17 GB of weights and bf16 states
    m = FTRLTableBatchedEmbeddingBags([(rows0, 1), (100, 4)], feature_table_map=[0, 1],
                                      backend="triton", device="cuda", learning_rate=0.1,
                                      bounds_check_mode=BoundsCheckMode.WARNING,
                                      optimizer_state_dtypes=STATES["both"])
    twin = FTRLTableBatchedEmbeddingBags([(100, 4)], backend="triton", device="cuda",
                                         learning_rate=0.1, bounds_check_mode=BoundsCheckMode.WARNING)
    idx = torch.cat([torch.full((3000,), 5), torch.arange(10)]).cuda()
    n = idx.numel()
    with torch.no_grad():
        m.split_embedding_weights()[1].copy_(twin.split_embedding_weights()[0])
    g = torch.randn(2, 5, generator=torch.Generator().manual_seed(0)).cuda()
    # B = 2: feature 0's bags empty, feature 1's bag 1 holds every index
    m(idx, torch.tensor([0, 0, 0, 0, n]).cuda()).backward(g)
    twin(idx, torch.tensor([0, 0, n]).cuda()).backward(g[:, 1:].contiguous())
    keys = torch.arange(100).unsqueeze(1) + rows0
    accum, linear = m.split_optimizer_states()[1]
    for s_id, (got, fp32) in enumerate(((accum, twin.accum_dev), (linear, twin.linear_dev))):
        want = round_bf16_stochastic(fp32.view(100, 4).cpu(), sr_bits(keys, torch.arange(4), 0, s_id))
        assert torch.equal(bits(got.cpu()), bits(want))
    assert torch.equal(bits(m.split_embedding_weights()[1].cpu()), bits(twin.weights_dev.view(100, 4).cpu()))
