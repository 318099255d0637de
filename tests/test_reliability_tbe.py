"""Property (hypothesis) tests of ``FTRLTableBatchedEmbeddingBags`` under bad input, non-finite gradients
and repeated runs, on the CPU backends "cpp" and "torch"; the Triton backend runs the ``interp`` tests
under ``TRITON_INTERPRET=1`` in a child pytest (``conftest.run_interpreter_suite``, as in
tests/test_tbe_triton.py), and the ``cuda`` tests on a GPU.

* malformed indices / offsets / per-sample weights / dtypes / devices / VBE sizes, bad constructor
  arguments and hyperparameters: ``ValueError`` naming the argument; weights, accum, linear and
  counters bitwise unchanged (snapshot before, compare after); the module still trains afterwards
  (bad index / offset values raise under ``FATAL``; ``WARNING``, the default, repairs and counts them);
* NaN/Inf in the output gradient: every (table, row) whose summed gradient is non-finite — found here
  by float64 autograd through ``torch.nn.functional.embedding_bag`` (tests/conftest.py) — keeps its
  weight/accum/linear bits and is counted in ``nonfinite_grad_rows``; all other touched rows match the
  float64 FTRL reference; untouched rows keep their bits;
* ``deterministic=True``: two identical runs are bitwise equal; CPU and CUDA agree within tolerance.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import tbe_harness as H
from conftest import (INTERP, assert_same_bits, bits, cuda, interp_only, interpreter_parent, needs_cuda,
                      run_interpreter_suite, tbe_state)
from knob_rules import ANY_VALUE, assert_valid_or_named_error, valid_knob
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.fbgemm_enums import BoundsCheckMode, PoolingMode, SparseType

BACKENDS = H.CPU_BACKENDS
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
cpu_only = pytest.mark.skipif(INTERP, reason="the TRITON_INTERPRET child runs only the interp tests")
MANY = settings(SETTINGS, max_examples=120)


# ------------------------------------------------------------------------------ malformed inputs
def _valid_batch(m, r):
    """A valid (indices, offsets, psw) for module ``m`` (B samples per feature, lengths 0..3)."""
    F = len(m.feature_table_map)
    B = r.randint(1, 3)
    idx, lens = [], []
    for f in range(F):
        rows = m.embedding_specs[m.feature_table_map[f]][0]
        for _ in range(B):
            L = r.randint(0, 3)
            idx += [r.randrange(rows) for _ in range(L)]
            lens.append(L)
    if not idx:                                      # at least one index, so index mutations apply
        idx, lens[0] = [0], 1
    off = np.concatenate([[0], np.cumsum(lens)])
    return torch.tensor(idx, dtype=torch.int64), torch.tensor(off, dtype=torch.int64), B


def _mutations():
    def at(t, i, v):
        t = t.clone()
        t[i] = v
        return t

    return {
        # name: (f(m, idx, off, B, r) -> kwargs overrides, argument named in the error)
        "index_too_large": (lambda m, i, o, B, r: dict(indices=at(i, r.randrange(i.numel()), 10 ** r.randint(2, 12))), "indices"),
        "index_negative": (lambda m, i, o, B, r: dict(indices=at(i, r.randrange(i.numel()), -r.randint(1, 5))), "indices"),
        "offsets_start": (lambda m, i, o, B, r: dict(offsets=at(o, 0, r.choice([-1, 1]))), "offsets"),
        "offsets_end": (lambda m, i, o, B, r: dict(offsets=at(o, -1, i.numel() + r.choice([-1, 1, 100]))), "offsets"),
        "offsets_count": (lambda m, i, o, B, r: dict(offsets=o[:-1] if len(m.feature_table_map) > 1
                                                     else at(o, -1, i.numel() + 1)), "offsets"),
        "offsets_empty": (lambda m, i, o, B, r: dict(offsets=o[:0]), "offsets"),
        "offsets_decreasing": (lambda m, i, o, B, r: dict(offsets=torch.cat([o[:1], o[1:-1].flip(0) * 0 + i.numel() + 1, o[-1:]])
                                                          if o.numel() > 2 else at(o, 0, 5)), "offsets"),
        "indices_float": (lambda m, i, o, B, r: dict(indices=i.float()), "indices"),
        "indices_int16": (lambda m, i, o, B, r: dict(indices=i.short()), "indices"),
        "indices_2d": (lambda m, i, o, B, r: dict(indices=i.view(1, -1)), "indices"),
        "indices_list": (lambda m, i, o, B, r: dict(indices=i.tolist()), "indices"),
        "offsets_float": (lambda m, i, o, B, r: dict(offsets=o.double()), "offsets"),
        "offsets_meta": (lambda m, i, o, B, r: dict(offsets=o.to("meta")), "offsets"),
        "indices_meta": (lambda m, i, o, B, r: dict(indices=i.to("meta")), "indices"),
        "psw_length": (lambda m, i, o, B, r: dict(per_sample_weights=torch.ones(i.numel() + r.choice([-1, 1]))), "per_sample_weights"),
        "psw_int": (lambda m, i, o, B, r: dict(per_sample_weights=torch.ones(i.numel(), dtype=torch.int32)), "per_sample_weights"),
        "psw_2d": (lambda m, i, o, B, r: dict(per_sample_weights=torch.ones(i.numel(), 1)), "per_sample_weights"),
        "psw_meta": (lambda m, i, o, B, r: dict(per_sample_weights=torch.ones(i.numel(), device="meta")), "per_sample_weights"),
        "vbe_sum": (lambda m, i, o, B, r: dict(batch_size_per_feature_per_rank=[[B + 1]] + [[B]] * (len(m.feature_table_map) - 1)), "batch_size_per_feature_per_rank"),
        "vbe_features": (lambda m, i, o, B, r: dict(batch_size_per_feature_per_rank=[[B]] * (len(m.feature_table_map) + 1)), "batch_size_per_feature_per_rank"),
        "vbe_ragged": (lambda m, i, o, B, r: dict(batch_size_per_feature_per_rank=[[B, 0]] + [[B]] * max(len(m.feature_table_map) - 1, 1)), "batch_size_per_feature_per_rank"),
        "vbe_negative": (lambda m, i, o, B, r: dict(batch_size_per_feature_per_rank=[[B + 1, -1]] * len(m.feature_table_map)), "batch_size_per_feature_per_rank"),
        "vbe_not_ints": (lambda m, i, o, B, r: dict(batch_size_per_feature_per_rank=[["x"]] * len(m.feature_table_map)), "batch_size_per_feature_per_rank"),
        "vbe_not_list": (lambda m, i, o, B, r: dict(batch_size_per_feature_per_rank=7), "batch_size_per_feature_per_rank"),
    }


MUTATIONS = _mutations()
# Bad values of indices / offsets: FATAL raises; WARNING (the default) repairs and counts them.
# (offsets_count with one feature sets the last offset to N + 1, a value; with several it drops one.)
BOUNDS_VALUES = ("index_too_large", "index_negative", "offsets_start", "offsets_end", "offsets_decreasing")


@cpu_only
@pytest.mark.parametrize("backend", BACKENDS)
@MANY
@given(seed=st.integers(0, 2 ** 20), kind=st.sampled_from(sorted(MUTATIONS)),
       pooling=st.sampled_from([PoolingMode.SUM, PoolingMode.MEAN]),
       mode=st.sampled_from([BoundsCheckMode.FATAL, BoundsCheckMode.WARNING]))
def test_malformed_input_raises_naming_it_and_changes_nothing(backend, seed, kind, pooling, mode):
    """Every malformed input raises under FATAL; under WARNING (the default) all but the bad index /
    offset values, which are repaired and counted in ``bounds_check_warning``."""
    import random
    r = random.Random(seed)
    T = r.randint(1, 3)
    specs = [(r.randint(1, 20), r.choice([1, 3, 4, 8])) for _ in range(T)]
    fmap = [r.randrange(T) for _ in range(r.randint(1, 3))]
    m = FTRLTableBatchedEmbeddingBags(specs, feature_table_map=fmap, pooling_mode=pooling,
                                      backend=backend, learning_rate=0.1, ftrl_l1_reg=0.01,
                                      **({} if mode == BoundsCheckMode.WARNING else dict(bounds_check_mode=mode)))
    assert m.bounds_check_mode == mode
    idx, off, B = _valid_batch(m, r)
    args = dict(indices=idx, offsets=off, per_sample_weights=None, batch_size_per_feature_per_rank=None)
    make, arg = MUTATIONS[kind]
    args.update(make(m, idx, off, B, r))
    m(idx, off).sum().backward()                    # states are non-trivial before the bad call
    if mode == BoundsCheckMode.WARNING and (kind in BOUNDS_VALUES or (kind == "offsets_count" and len(fmap) == 1)):
        m(**args).sum().backward()
        assert int(m.bounds_check_warning) > 0
        return
    before = tbe_state(m)
    with pytest.raises(ValueError, match=arg) as e:
        m(**args).sum().backward()
    assert_same_bits(before, tbe_state(m))
    assert arg in str(e.value).split(" ")[0] or arg in str(e.value), str(e.value)
    out = m(idx, off)                               # the module is still usable
    out.sum().backward()
    assert int(m.iter) == int(before[5]) + 1


# ------------------------------------------------------------------------ constructor / knobs
KNOBS = ("learning_rate", "ftrl_learning_rate_power", "ftrl_l1_reg", "ftrl_l2_reg", "ftrl_beta",
         "ftrl_l2_shrinkage", "ftrl_initial_accumulator_value")


@cpu_only
@SETTINGS
@given(knobs=st.dictionaries(st.sampled_from(KNOBS), ANY_VALUE, min_size=1, max_size=3))
def test_constructor_knobs_valid_or_clear_error(knobs):
    assert_valid_or_named_error(lambda **kw: FTRLTableBatchedEmbeddingBags([(4, 2)], backend="torch", **kw),
                                knobs)


@cpu_only
@SETTINGS
@given(knobs=st.dictionaries(st.sampled_from(KNOBS[:-1] + ("lr", "ftrl_bogus")), ANY_VALUE,
                             min_size=1, max_size=3))
def test_update_hyper_parameters_valid_or_atomic_error(knobs):
    m = FTRLTableBatchedEmbeddingBags([(4, 2)], backend="torch", learning_rate=0.1)
    hp0, before = m.hyperparams, tbe_state(m)
    # Both spellings with different values are an error; otherwise each value is checked.
    bad = [k for k, v in knobs.items() if k == "ftrl_bogus" or not valid_knob(
        "learning_rate" if k == "lr" else k, v)]
    if "lr" in knobs and "learning_rate" in knobs and knobs["lr"] != knobs["learning_rate"]:
        bad.append("lr")
    if not bad:
        m.update_hyper_parameters(knobs)
        return
    with pytest.raises(ValueError):
        m.update_hyper_parameters(knobs)
    assert m.hyperparams == hp0
    assert_same_bits(before, tbe_state(m))


BAD_CTOR = {
    "rows_zero": (dict(embedding_specs=[(0, 4)]), "rows"),
    "rows_float": (dict(embedding_specs=[(4.0, 4)]), "rows"),
    "rows_bool": (dict(embedding_specs=[(True, 4)]), "rows"),
    "dim_zero": (dict(embedding_specs=[(4, 0)]), "dim"),
    "spec_len": (dict(embedding_specs=[(4, 4, 1)]), "embedding_specs"),
    "no_tables": (dict(embedding_specs=[]), "embedding_specs"),
    "fmap_range": (dict(feature_table_map=[0, 2]), "feature_table_map"),
    "fmap_empty": (dict(feature_table_map=[]), "feature_table_map"),
    "pooling": (dict(pooling_mode=7), "pooling_mode"),
    "none_dims": (dict(embedding_specs=[(4, 4), (4, 2)], pooling_mode=PoolingMode.NONE), "pooling_mode=NONE"),
    "precision": (dict(weights_precision=SparseType.INT8), "weights_precision"),
    "precision_str": (dict(weights_precision="fp32"), "weights_precision"),
    "output_dtype": (dict(output_dtype=torch.float64), "output_dtype"),
    "bounds_mode": (dict(bounds_check_mode=9), "bounds_check_mode"),
    "names": (dict(table_names=["a", "b"]), "table_names"),
    "backend": (dict(backend="cuda"), "backend"),
    "triton_on_cpu": (dict(backend="triton"), "backend"),
    "convention": (dict(ftrl_l2_convention="keras"), "ftrl_l2_convention"),
}


@cpu_only
@pytest.mark.parametrize("name", sorted(BAD_CTOR))
def test_bad_constructor_argument_is_named(name):
    kw = dict(embedding_specs=[(4, 4)])
    over, arg = BAD_CTOR[name]
    kw.update(over)
    with pytest.raises(ValueError, match=arg):
        FTRLTableBatchedEmbeddingBags(**kw)


# ---------------------------------------------------------------------------- NaN / Inf gradients
def _nonfinite_step(case, backend, device, r, bad_values, frac):
    """One step with NaN/Inf injected into the output gradient; checks the documented policy."""
    m = H.build_module(case, backend, device)
    rng = np.random.default_rng(case.seed)
    indices, offsets, psw = H.random_batch(case, rng, device)
    W0, S0 = H.table_snapshot(m)
    out = m(indices, offsets, per_sample_weights=psw, batch_size_per_feature_per_rank=case.vbe)
    odt = out.dtype
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(case.seed), dtype=torch.float64)
    flat = grad.view(-1)
    n_bad = int(round(frac * flat.numel())) if flat.numel() else 0
    if flat.numel():
        n_bad = max(n_bad, 1)
        pos = r.sample(range(flat.numel()), min(n_bad, flat.numel()))
        for p in pos:
            flat[p] = r.choice(bad_values)
    grad_in = grad.to(odt)
    ref = H.reference_step(m, case, W0, S0, indices, offsets, grad_in, psw)
    out.backward(grad_in.to(device))
    # every row with a non-finite summed gradient (ref.flagged) keeps its bits, the others update
    H.check_tables(m, case, W0, S0, ref, "nonfinite step")
    n_flagged = sum(len(f) for f in ref.flagged)
    assert int(m.nonfinite_grad_rows) == n_flagged, (int(m.nonfinite_grad_rows), n_flagged, case.describe())
    return n_flagged


BAD_VALUES = st.sampled_from([[math.nan], [math.inf], [-math.inf], [math.nan, math.inf, -math.inf]])


@cpu_only
@pytest.mark.parametrize("backend", BACKENDS)
@settings(SETTINGS, max_examples=80)
@given(seed=st.integers(0, 2 ** 20), bad=BAD_VALUES, frac=st.sampled_from([0.0, 0.05, 0.3, 1.0]))
def test_nonfinite_gradient_rows_skipped_and_counted(backend, seed, bad, frac):
    import random
    _nonfinite_step(H.random_case(seed), backend, "cpu", random.Random(seed), bad, frac)


# --------------------------------------------------------------------------------- determinism
def _run_twice_bits(case, backend, device, steps=3):
    results = []
    for _ in range(2):
        m = H.build_module(case, backend, device, deterministic=True)
        rng = np.random.default_rng(case.seed)
        outs = []
        for s in range(steps):
            indices, offsets, psw = H.random_batch(case, rng, device)
            psw = psw.requires_grad_(True) if psw is not None else None
            out = m(indices, offsets, per_sample_weights=psw, batch_size_per_feature_per_rank=case.vbe)
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(case.seed + s)).to(out.dtype)
            out.backward(g.to(device))
            outs += [out.detach().cpu()] + ([psw.grad.cpu()] if psw is not None else [])
        results.append(outs + [t.detach().cpu().clone() for t in (m.weights_dev, m.accum_dev, m.linear_dev)])
    for a, b in zip(*results):
        assert a.shape == b.shape and torch.equal(bits(a), bits(b)), case.describe()


@cpu_only
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2 ** 20))
def test_deterministic_runs_are_bitwise_equal(backend, seed):
    _run_twice_bits(H.random_case(seed), backend, "cpu")


# ------------------------------------------------------------------ Triton under the interpreter
@interpreter_parent
def test_triton_interpreter_suite():
    """Runs this file's ``interp`` tests in a child pytest with TRITON_INTERPRET=1 (CPU tensors)."""
    run_interpreter_suite(__file__, timeout=900)


INTERP_SEEDS = list(range(20))   # small random cases (pooling, VBE, psw, fp16/bf16 vary)


@interp_only
@pytest.mark.parametrize("seed", INTERP_SEEDS)
def test_interp_nonfinite_gradient_rows_skipped_and_counted(seed):
    import random
    _nonfinite_step(H.random_case(seed), "triton", "cpu", random.Random(seed),
                    [math.nan, math.inf, -math.inf], 0.2)


@interp_only
@pytest.mark.parametrize("seed", INTERP_SEEDS[:8])
def test_interp_deterministic_runs_are_bitwise_equal(seed):
    _run_twice_bits(H.random_case(seed), "triton", "cpu", steps=2)


# ------------------------------------------------------------------------------------- CUDA
@cuda
@needs_cuda
@pytest.mark.parametrize("seed", range(20))
def test_cuda_nonfinite_gradient_rows_skipped_and_counted(seed):
    import random
    _nonfinite_step(H.random_case(seed), "triton", "cuda", random.Random(seed),
                    [math.nan, math.inf, -math.inf], 0.2)


@cuda
@needs_cuda
@pytest.mark.parametrize("seed", range(10))
def test_cuda_deterministic_runs_are_bitwise_equal(seed):
    _run_twice_bits(H.random_case(seed), "triton", "cuda")


# fp32 tables: weights/states after 3 steps agree to |cuda - cpu| <= 1e-5 * |cpu| + 1e-6 * scale, where
# scale = max(1, max |value|) of that tensor (fp32 summation order differs between kernels).
CPU_CUDA_RTOL, CPU_CUDA_ATOL = 1e-5, 1e-6


@cuda
@needs_cuda
@pytest.mark.parametrize("seed", range(10))
def test_cuda_matches_cpu_within_tolerance(seed):
    case = H.random_case(seed, allow_low_precision=False)
    mods = []
    for device, backend in (("cpu", "cpp"), ("cuda", "triton")):
        torch.manual_seed(case.seed)
        m = FTRLTableBatchedEmbeddingBags(
            case.specs, feature_table_map=case.feature_table_map, pooling_mode=case.pooling,
            device=device, backend=backend, deterministic=True, **case.hp)
        mods.append(m)
    mods[1].load_state_dict({k: v.cuda() for k, v in mods[0].state_dict().items()})
    rng = {d: np.random.default_rng(case.seed) for d in ("cpu", "cuda")}
    for s in range(3):
        for m, d in zip(mods, ("cpu", "cuda")):
            indices, offsets, psw = H.random_batch(case, rng[d], d)
            out = m(indices, offsets, per_sample_weights=psw, batch_size_per_feature_per_rank=case.vbe)
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(case.seed + s))
            out.backward(g.to(d))
    for name in ("weights_dev", "accum_dev", "linear_dev"):
        a, b = getattr(mods[0], name).double(), getattr(mods[1], name).double().cpu()
        scale = max(1.0, float(a.abs().max())) if a.numel() else 1.0
        torch.testing.assert_close(b, a, rtol=CPU_CUDA_RTOL, atol=CPU_CUDA_ATOL * scale, msg=name)
