"""The compiled CPU kernel's argument checks and non-finite rule (torchrec_ftrl/kernels/cpu/csrc/
ftrl_tbe_cpu.cpp): every op raises for one inconsistent argument, naming it, before it touches any
state; ``tbe_count_invalid`` counts malformed offsets without reading outside its arrays; a row whose
fp32 ``sum_d g_d^2`` is not finite (a NaN/Inf gradient, or one whose square overflows) is left
unchanged and counted, while the other rows take the float64 reference's update."""

import numpy as np
import pytest
import torch

from conftest import bits
from reference import ftrl_reference_step, ftrl_reference_step_rowwise, ftrl_reference_weight
from torchrec_ftrl.kernels.batch import POOL_MEAN, POOL_NONE, POOL_SUM
from torchrec_ftrl.kernels.cpu import backend as cpp_backend

ops = torch.ops.torchrec_ftrl
ROWS, DIMS = (5, 3), (4, 8)        # two tables, one feature each
TOTAL = ROWS[0] * DIMS[0] + ROWS[1] * DIMS[1]
# lr, neg_power, l1, l2 (the L2 term), beta, shrink2 (rule_spec.KNOBS); l2 convention: "mcmahan".
KNOBS = (0.5, 0.5, 0.01, 0.04, 0.3, 0.0)
REF_KNOBS = dict(lr=0.5, lr_power=-0.5, l1=0.01, l2=0.04, beta=0.3, l2_convention="mcmahan")
# B = 2 bags per feature: f0 bags [1], [4]; f1 bags [2], [0, 2, 2]; plain [B, 12] output.
INDICES, OFFSETS = (1, 4, 2, 0, 2, 2), (0, 1, 2, 3, 6)
BAG_OUT = (0, 12, 4, 16)
LAYOUTS = ("stored", "derived-rowwise")


@pytest.fixture(scope="module", autouse=True)
def cpu_kernel():
    cpp_backend.load_extension()


def _arrays(layout):
    """``(weights, accum, linear, rowwise)`` of the two tables (fp32; derived weights: None, a row-wise
    accum ``[total_rows]``)."""
    g = torch.Generator().manual_seed(0)
    linear = torch.randn(TOTAL, generator=g)
    if layout == "stored":
        return torch.randn(TOTAL, generator=g), torch.full((TOTAL,), 0.1), linear, False
    return None, torch.full((sum(ROWS),), 0.1), linear, True


def _valid(layout="stored", op="backward"):
    """Keyword arguments of a valid call of ``op`` (``forward``, ``backward``: the ops' schemas)."""
    weights, accum, linear, rowwise = _arrays(layout)
    kw = dict(weights=weights, accum=accum, linear=linear, rowwise=rowwise,
              table_w_offset=torch.tensor([0, ROWS[0] * DIMS[0]]), table_dim=torch.tensor(DIMS),
              table_rows=torch.tensor(ROWS), table_row_base=torch.tensor([0, ROWS[0]]),
              feature_table=torch.tensor([0, 1]), bag_feature=torch.tensor([0, 0, 1, 1]),
              bag_out_offset=torch.tensor(BAG_OUT), indices=torch.tensor(INDICES),
              offsets=torch.tensor(OFFSETS), per_sample_weights=None, pooling_mode=POOL_SUM,
              max_D=max(DIMS), table_dims=list(DIMS), total_rows=sum(ROWS),
              knobs=torch.tensor(KNOBS), pow_half=True, has_shrink=False)
    if op == "forward":
        return dict(kw, out_numel=24, out_dtype=torch.float32, warn=torch.zeros(1, dtype=torch.int64),
                    check=False, row_keys=None)
    return dict(kw, grad_out=torch.linspace(-1.0, 1.0, 24), nonfinite_rows=torch.zeros(1, dtype=torch.int64),
                step=torch.tensor([0]), check=False)


def _call(op, kw, keyset=None):
    """``op`` with the keyword arguments ``kw`` (those left out: None), through the dispatcher or, with
    ``keyset``, straight to that dispatch key's kernel."""
    fn = ops.tbe_forward.default if op == "forward" else ops.tbe_backward_update_.default
    args = [kw.get(a.name) for a in fn._schema.arguments]
    return fn(*args) if keyset is None else fn.redispatch(keyset, *args)


def _snapshot(kw):
    return [bits(kw[k]) for k in ("weights", "accum", "linear", "nonfinite_rows", "warn") if kw.get(k) is not None]


def _knobs(**changed):
    names = ("lr", "neg_power", "l1", "l2", "beta", "shrink2")
    return torch.tensor([changed.get(n, v) for n, v in zip(names, KNOBS)], dtype=torch.float32)


def _noncontiguous(t):
    return torch.stack([t, t], 1)[:, 0]


# (id, ops it applies to, the change to the valid keyword arguments, the message's pattern)
BOTH, FWD, BWD = ("forward", "backward"), ("forward",), ("backward",)
CASES = [
    ("max_D-below-a-dim", BOTH, dict(max_D=4), r"table_dim\[1\]=8 must be in \[1, max_D=4\]"),
    ("max_D-above-every-dim", BOTH, dict(max_D=2 ** 27), r"max_D=134217728 must be the largest table dim \(8\)"),
    ("table_dim-zero", BOTH, dict(table_dim=torch.tensor([0, 8]), table_dims=[0, 8]),
     r"table_dim\[0\]=0 must be in \[1, "),
    ("step-2d", BWD, dict(step=torch.zeros(1, 1, dtype=torch.int64)), r"step must be int64 \[1\]"),
    ("nonfinite_rows-2d", BWD, dict(nonfinite_rows=torch.zeros(1, 1, dtype=torch.int64)),
     r"nonfinite_rows must be int64 \[1\]"),
    ("max_D-zero", BOTH, dict(max_D=0), r"max_D must be in \[1, "),
    ("out_numel-short", FWD, dict(out_numel=20), r"bag_out_offset\[3\]=16 .*out_numel"),
    ("out_numel-negative", FWD, dict(out_numel=-1), r"out_numel must be >= 0, got -1"),
    ("out_dtype", FWD, dict(out_dtype=torch.int64), r"out_dtype must be fp32, fp16 or bf16"),
    ("grad_out-empty", BWD, dict(grad_out=torch.zeros(0)), r"bag_out_offset\[0\]=0 .*grad_out.numel\(\)"),
    ("grad_out-short", BWD, dict(grad_out=torch.zeros(20)), r"bag_out_offset\[3\]=16 .*grad_out.numel\(\)"),
    ("grad_out-dtype", BWD, dict(grad_out=torch.zeros(24, dtype=torch.float64)), r"grad_out must be"),
    ("grad_out-strided", BWD, dict(grad_out=torch.zeros(48)[::2]), r"grad_out must be contiguous"),
    ("bag_out_offset-past", BOTH, dict(bag_out_offset=torch.tensor([0, 12, 4, 17])),
     r"bag_out_offset\[3\]=17 must be in \[0, "),
    ("bag_out_offset-negative", BOTH, dict(bag_out_offset=torch.tensor([0, -1, 4, 16])),
     r"bag_out_offset\[1\]=-1"),
    ("bag_out_offset-length", BOTH, dict(bag_out_offset=torch.tensor([0, 12, 4])),
     r"bag_out_offset must have 4 elements .*, got 3"),
    ("offsets-more-than-bags", BOTH, dict(offsets=torch.tensor([0, 1, 2, 3, 5, 6])),
     r"offsets must have 5 elements .*, got 6"),
    ("offsets-past-N", BOTH, dict(offsets=torch.tensor([0, 1, 2, 3, 7])), r"offsets must start at 0 and end at N=6"),
    ("offsets-start", BOTH, dict(offsets=torch.tensor([1, 1, 2, 3, 6])), r"offsets\[0\]=1"),
    ("offsets-decreasing", BOTH, dict(offsets=torch.tensor([0, 3, 2, 3, 6])),
     r"offsets must be non-decreasing, got offsets\[1\]=3 and offsets\[2\]=2"),
    ("offsets-int32", BOTH, dict(offsets=torch.tensor(OFFSETS, dtype=torch.int32)), r"offsets must be int64"),
    ("offsets-strided", BOTH, dict(offsets=_noncontiguous(torch.tensor(OFFSETS))),
     r"offsets must be contiguous 1-D"),
    ("indices-2d", BOTH, dict(indices=torch.tensor(INDICES).view(2, 3)), r"indices must be contiguous 1-D"),
    ("feature_table-past-T", BOTH, dict(feature_table=torch.tensor([0, 2])), r"feature_table\[1\]=2 must be in \[0, 2\)"),
    ("bag_feature-past-F", BOTH, dict(bag_feature=torch.tensor([0, 0, 1, 2])), r"bag_feature\[3\]=2 must be in \[0, 2\)"),
    ("bag_feature-negative", BOTH, dict(bag_feature=torch.tensor([0, -1, 1, 1])), r"bag_feature\[1\]=-1"),
    ("table_w_offset-past", BOTH, dict(table_w_offset=torch.tensor([0, 21])), r"table 1 \(table_w_offset=21"),
    ("table_w_offset-negative", BOTH, dict(table_w_offset=torch.tensor([-1, 20])), r"table 0 \(table_w_offset=-1"),
    ("table_w_offset-length", BOTH, dict(table_w_offset=torch.tensor([0])), r"table_w_offset must have 2 elements"),
    ("table_rows-overflow", BOTH, dict(table_rows=torch.tensor([5, 2 ** 62])), r"table 1 \(table_w_offset=20"),
    ("table_rows-negative", BOTH, dict(table_rows=torch.tensor([-5, 3])), r"table_rows\[0\]=-5 must be >= 0"),
    ("table_dim-length", BOTH, dict(table_dim=torch.tensor([4])), r"table_dim must have 2 elements"),
    ("table_dims-length", BOTH, dict(table_dims=[4]), r"table_dims must have one entry per table"),
    ("table_dims-values", BOTH, dict(table_dims=[4, 4]), r"table_dim\[1\]=8 .* table_dims\[1\]=4"),
    ("table_row_base", BOTH, dict(table_row_base=torch.tensor([0, 4])), r"table_row_base\[1\]=4 must be"),
    ("total_rows", BOTH, dict(total_rows=9), r"total_rows=9 must be the sum of table_rows \(8\)"),
    ("pooling_mode", BOTH, dict(pooling_mode=3), r"pooling_mode must be .* got 3"),
    ("psw-length", BOTH, dict(per_sample_weights=torch.ones(5)), r"per_sample_weights must be contiguous 1-D fp32 \[N=6\]"),
    ("psw-dtype", BOTH, dict(per_sample_weights=torch.ones(6, dtype=torch.float64)), r"per_sample_weights"),
    ("knob-lr-nan", BOTH, dict(knobs=_knobs(lr=float("nan"))), r"knob lr must be finite and > 0, got nan"),
    ("knob-lr-negative", BOTH, dict(knobs=_knobs(lr=-1.0)), r"knob lr must be finite and > 0, got -1"),
    ("knob-lr-zero", BOTH, dict(knobs=_knobs(lr=0.0)), r"knob lr must be finite and > 0, got 0"),
    ("knob-l1-negative", BOTH, dict(knobs=_knobs(l1=-0.5)), r"knob l1 must be finite and >= 0, got -0.5"),
    ("knob-beta-inf", BOTH, dict(knobs=_knobs(beta=float("inf"))), r"knob beta must be finite and >= 0, got inf"),
    ("knob-neg_power-negative", BOTH, dict(knobs=_knobs(neg_power=-0.5), pow_half=False),
     r"knob neg_power must be finite and >= 0"),
    ("knob-l2-subnormal", BOTH, dict(knobs=_knobs(l2=1e-40)), r"knob l2 must be 0 or >= .* normal fp32"),
    ("knob-shrink2-half-subnormal", BOTH, dict(knobs=_knobs(shrink2=1.5e-38), has_shrink=True),
     r"knob shrink2 must be 0 or >= "),
    ("knobs-dtype", BOTH, dict(knobs=torch.tensor(KNOBS, dtype=torch.float64)), r"knobs must be a contiguous 1-D fp32"),
    ("knobs-length", BOTH, dict(knobs=torch.tensor(KNOBS[:5])), r"knobs must be a contiguous 1-D fp32 tensor of 6"),
    ("knob-flags", BOTH, dict(pow_half=False), r"pow_half=.* disagree with the knobs"),
    ("accum-length", BOTH, dict(accum=torch.zeros(TOTAL - 1)), r"an element-wise accum must have as many elements as linear \(44\), got 43"),
    ("weights-dtype", BOTH, dict(weights=torch.zeros(TOTAL, dtype=torch.float64)), r"weights must be fp32, fp16 or bf16"),
    ("linear-dtype", BOTH, dict(linear=torch.zeros(TOTAL, dtype=torch.float16)), r"accum and linear must be fp32 or bf16"),
    ("warn-dtype", FWD, dict(warn=torch.zeros(1, dtype=torch.int32)), r"warn must be int64 \[1\]"),
    ("warn-2d", FWD, dict(warn=torch.zeros(1, 1, dtype=torch.int64)), r"warn must be int64 \[1\]"),
    ("check", FWD, dict(check=True), r"does not check indices \(check=True\)"),
    ("row_keys", FWD, dict(row_keys=torch.zeros(6, dtype=torch.int64)), r"does not take row_keys"),
    ("nonfinite_rows-dtype", BWD, dict(nonfinite_rows=torch.zeros(1, dtype=torch.int32)), r"nonfinite_rows must be int64 \[1\]"),
    ("step-dtype", BWD, dict(step=torch.tensor([0], dtype=torch.int32)), r"step must be int64 \[1\]"),
    ("step-missing-bf16", BWD, dict(step=None, accum=torch.zeros(TOTAL, dtype=torch.bfloat16)),
     r"needs step"),
]


def _cases(layouts=("stored",)):
    return [pytest.param(op, layout, change, pattern, id=f"{op}-{layout}-{name}")
            for name, op_names, change, pattern in CASES for op in op_names for layout in layouts]


@pytest.mark.parametrize("op,layout,change,pattern", _cases())
def test_an_inconsistent_argument_raises_before_any_state_changes(op, layout, change, pattern):
    kw = _valid(layout, op)
    kw.update(change)
    before = _snapshot(kw)
    with pytest.raises((RuntimeError, ValueError), match=pattern):
        _call(op, kw)
    after = _snapshot(kw)
    assert len(before) == len(after) and all(torch.equal(b, a) for b, a in zip(before, after))


@pytest.mark.parametrize("op,layout,change,pattern", [
    pytest.param(op, "derived-rowwise", change, pattern, id=f"{op}-{name}")
    for name, ops_, change, pattern in [
        ("accum-not-rowwise", BOTH, dict(accum=torch.zeros(TOTAL)), r"a row-wise accum must have one element per row \(8\), got 44"),
        ("table_row_base", BOTH, dict(table_row_base=torch.tensor([0, 6])), r"table_row_base\[1\]=6"),
        ("bag_feature", BOTH, dict(bag_feature=torch.tensor([0, 0, 1, 5])), r"bag_feature\[3\]=5"),
        ("knob-lr-nan", BOTH, dict(knobs=_knobs(lr=float("nan"))), r"knob lr must be finite"),
        ("grad_out-short", BWD, dict(grad_out=torch.zeros(23)), r"grad_out.numel\(\)")]
    for op in ops_])
def test_derived_rowwise_layout_checks(op, layout, change, pattern):
    test_an_inconsistent_argument_raises_before_any_state_changes(op, layout, change, pattern)


@pytest.mark.parametrize("op", BOTH)
@pytest.mark.parametrize("size,ok", [(48, True), (47, False)])
def test_sequence_output_must_hold_N_times_max_D(op, size, ok):
    """PoolingMode.NONE writes / reads index i's row at i * max_D: N * max_D = 48 elements."""
    kw = _valid("stored", op)
    kw.update(pooling_mode=POOL_NONE, **(dict(out_numel=size) if op == "forward" else
                                         dict(grad_out=torch.zeros(size))))
    if ok:
        _call(op, kw)
        return
    before = _snapshot(kw)
    with pytest.raises(RuntimeError, match=r"must hold N \* max_D = 6 \* 8"):
        _call(op, kw)
    assert all(torch.equal(b, a) for b, a in zip(before, _snapshot(kw)))


_SHARED = ("accum", "linear", "weights", "indices", "offsets", "table_rows", "knobs", "per_sample_weights")


@pytest.mark.parametrize("op,name", [("forward", n) for n in _SHARED] + [
    ("backward", n) for n in (*_SHARED, "grad_out", "nonfinite_rows", "step")])
def test_a_tensor_of_another_device_raises(op, name):
    """Called through the CPU key with one meta tensor among the CPU arguments: the kernel names it."""
    kw = _valid("stored", op)
    kw["per_sample_weights"] = torch.ones(6)
    kw[name] = kw[name].to("meta")
    before = _snapshot({k: v for k, v in kw.items() if k != name})
    with pytest.raises(RuntimeError, match=rf"{name} must be a CPU tensor"):
        _call(op, kw, torch._C.DispatchKeySet(torch._C.DispatchKey.CPU))
    assert all(torch.equal(b, a) for b, a in zip(before, _snapshot({k: v for k, v in kw.items() if k != name})))


def _count(table_rows=ROWS, feature_table=(0, 1), bag_feature=(0, 0, 1, 1), indices=INDICES,
           offsets=OFFSETS):
    args = [torch.as_tensor(a) if not isinstance(a, torch.Tensor) else a
            for a in (table_rows, feature_table, bag_feature, indices, offsets)]
    return int(ops.tbe_count_invalid(*args))


@pytest.mark.parametrize("offsets,expected", [
    (OFFSETS, 0),
    ((0, 1, 2, 100, 6), 2),     # bag 2 ends past N, bag 3 starts past its end: counted, not read
    ((0, 1, 2, -3, 6), 2),      # bag 2 decreasing, bag 3 starts before 0
    ((0, 1, 2, 3, 100), 1),     # does not end at N
    ((5, 1, 2, 3, 6), 1),       # does not start at 0
])
def test_count_invalid_counts_malformed_offsets(offsets, expected):
    assert _count(offsets=offsets) == expected


def test_count_invalid_counts_empty_offsets_once():
    assert _count(bag_feature=torch.zeros(0, dtype=torch.int64), offsets=torch.zeros(0, dtype=torch.int64)) == 1


@pytest.mark.parametrize("change,pattern", [
    (dict(feature_table=(0, 2)), r"feature_table\[1\]=2 must be in \[0, 2\)"),
    (dict(feature_table=(-1, 1)), r"feature_table\[0\]=-1"),
    (dict(bag_feature=(0, 0, 1, 2)), r"bag_feature\[3\]=2 must be in \[0, 2\)"),
    (dict(bag_feature=(0, 0, 1)), r"bag_feature must have 4 elements"),
    (dict(indices=torch.tensor(INDICES, dtype=torch.int32)), r"indices must be int64"),
    (dict(offsets=_noncontiguous(torch.tensor(OFFSETS))), r"offsets must be contiguous 1-D"),
    (dict(table_rows=torch.tensor(ROWS).to("meta")), r"table_rows must be a CPU tensor"),
])
def test_count_invalid_raises_for_inconsistent_arguments(change, pattern):
    kw = dict(table_rows=ROWS, feature_table=(0, 1), bag_feature=(0, 0, 1, 1), indices=INDICES,
              offsets=OFFSETS)
    kw.update(change)
    args = [torch.as_tensor(a) if not isinstance(a, torch.Tensor) else a for a in kw.values()]
    with pytest.raises(RuntimeError, match=pattern):
        ops.tbe_count_invalid.default.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args)


# ------------------------------------------------------------------------------ the non-finite rule


def _row_grads(grad_out):
    """float64 summed gradient of every touched (table, row) of the SUM batch (from the batch's
    definition above, not the kernel's)."""
    g = np.asarray(grad_out, dtype=np.float64)
    tables = (0, 0, 1, 1)
    sums = {}
    for b, t in enumerate(tables):
        for i in range(OFFSETS[b], OFFSETS[b + 1]):
            key = (t, INDICES[i])
            part = g[BAG_OUT[b]:BAG_OUT[b] + DIMS[t]]
            sums[key] = sums[key] + part if key in sums else part.copy()
    return sums


def _table(buf, t, per_row=False):
    start = (sum(ROWS[:t]) if per_row else sum(r * d for r, d in zip(ROWS[:t], DIMS[:t])))
    n = ROWS[t] if per_row else ROWS[t] * DIMS[t]
    view = buf[start:start + n]
    return view if per_row else view.view(ROWS[t], DIMS[t])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("big", [1e20, float("inf"), float("nan"), -3e19])
def test_a_row_whose_squared_gradient_overflows_is_skipped_and_counted(layout, big):
    """grad_out[0] (bag 0: row 1 of table 0 alone) made ``big``: a finite 1e20 squares past fp32's range
    like an Inf or a NaN; that row keeps its bits, nonfinite_rows is 1, every other touched row takes the
    float64 reference's update."""
    kw = _valid(layout, "backward")
    grad = torch.linspace(-1.0, 1.0, 24)
    grad[0] = big
    kw["grad_out"] = grad
    start = {k: kw[k].clone() for k in ("weights", "accum", "linear") if kw[k] is not None}
    _call("backward", kw)
    assert int(kw["nonfinite_rows"]) == 1
    rowwise = layout != "stored"
    for (t, r), g in _row_grads(grad).items():
        z0, z1 = _table(start["linear"], t)[r], _table(kw["linear"], t)[r]
        n0 = _table(start["accum"], t, rowwise)[r]
        n1 = _table(kw["accum"], t, rowwise)[r]
        if (t, r) == (0, 1):
            assert torch.equal(bits(z1), bits(z0)) and torch.equal(bits(n1), bits(n0))
            if not rowwise:
                assert torch.equal(bits(_table(kw["weights"], t)[r]), bits(_table(start["weights"], t)[r]))
            continue
        if rowwise:
            w0 = ftrl_reference_weight(z0.double().numpy(), float(n0), **REF_KNOBS)
            w, z, n = ftrl_reference_step_rowwise(w0[None], z0.double().numpy()[None], [float(n0)], g[None],
                                                  **REF_KNOBS)
            np.testing.assert_allclose(float(n1), n[0], rtol=1e-6)
        else:
            w, z, n = ftrl_reference_step(_table(start["weights"], t)[r].double().numpy(), z0.double().numpy(),
                                          n0.double().numpy(), g, **REF_KNOBS)
            np.testing.assert_allclose(n1.numpy(), n, rtol=1e-6)
            np.testing.assert_allclose(_table(kw["weights"], t)[r].numpy(), w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(z1.numpy(), np.ravel(z), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_large_gradient_whose_square_is_finite_updates(layout):
    """1e18 squares to 1e36 < fp32's max: the row is updated, nothing counted."""
    kw = _valid(layout, "backward")
    kw["grad_out"] = torch.zeros(24)
    kw["grad_out"][0] = 1e18
    linear0 = kw["linear"].clone()
    _call("backward", kw)
    assert int(kw["nonfinite_rows"]) == 0
    assert not torch.equal(_table(kw["linear"], 0)[1], _table(linear0, 0)[1])


def test_mean_pooling_valid_call_passes_the_checks():
    kw = _valid("stored", "forward")
    kw.update(pooling_mode=POOL_MEAN, per_sample_weights=torch.ones(6))
    assert _call("forward", kw).shape == (24,)
