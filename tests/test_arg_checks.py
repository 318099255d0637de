"""The ops' argument contract (torchrec_ftrl/kernels/arg_checks.py) in the PyTorch and Triton
implementations and the fake ones: one inconsistent argument per case, refused naming it, with every
state array bitwise unchanged; the registry of checked values (a tensor is read once per
``_version``); the overflow rule (a row whose fp32 ``sum g^2`` is not finite is skipped and counted),
against the float64 reference.

The Triton cases run in a child pytest under ``TRITON_INTERPRET=1`` (:func:`test_interpreter_suite`)."""

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import bits, interpreter_parent, run_interpreter_suite
from reference import ftrl_reference_step
from test_ops_composite import (DIMS, KNOBS, LAYOUTS, MAX_D, ROWS, _batch, _by_composite, _forward_args,
                                _state, _update_args)
from torchrec_ftrl.fbgemm_enums import PoolingMode
from torchrec_ftrl.kernels import arg_checks
from torchrec_ftrl.rule import ftrl_update_rows_, nonfinite_free_rows
from torchrec_ftrl.hyperparams import FTRLHyperparams

ops = torch.ops.torchrec_ftrl
CUDA = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
# Positions in the ops' argument lists (schema order, torchrec_ftrl/kernels/ops.py).
A = dict(weights=0, accum=1, linear=2, table_w_offset=4, table_dim=5, table_rows=6, table_row_base=7,
         feature_table=8, bag_feature=9, bag_out_offset=10, indices=11, offsets=12, psw=13, pooling_mode=14,
         max_D=15, table_dims=16, total_rows=17, knobs=18)
GRAD, NONFINITE, STEP = 18, 22, 23          # backward: grad_out, then knobs at 19
OUT_NUMEL, WARN, CHECK = 21, 23, 24         # forward


def _set(args, name, value, backward=False):
    i = A[name] + (1 if backward and name == "knobs" else 0)
    args[i] = value(args[i]) if callable(value) else value


def _knob(i, v):
    def edit(k):
        k = k.clone()
        k[i] = v
        return k
    return edit


# (name the error must contain, argument, new value or edit, exception)
COMMON = [
    ("max_D", "max_D", MAX_D - 1, ValueError),
    ("table_dim", "table_dim", lambda t: t.flip(0).contiguous(), ValueError),
    ("table 1", "table_w_offset", lambda t: t + 1, ValueError),
    ("table_row_base", "table_row_base", lambda t: t + 1, ValueError),
    ("feature_table", "feature_table", lambda t: torch.tensor([0, 2]), ValueError),
    ("bag_feature", "bag_feature", lambda t: t + 1, ValueError),
    ("bag_out_offset", "bag_out_offset", lambda t: t + 1, ValueError),
    ("must lie in", "bag_out_offset", lambda t: t + (2 ** 63 - 2 - int(t.max())), ValueError),  # no int64 wrap
    ("multiple of", "bag_out_offset", lambda t: torch.cat([t[:1] + 1, t[1:]]), ValueError),
    ("multiple of", "table_w_offset", lambda t: torch.cat([t[:1] + 1, t[1:]]), ValueError),
    ("max_D", "max_D", MAX_D + 1, ValueError),          # above every dim: sizes scratch rows

    ("offsets", "offsets", lambda t: torch.cat([t, t[-1:]]), RuntimeError),
    ("table_rows", "table_rows", lambda t: t.int(), RuntimeError),
    ("accum", "accum", lambda t: t[:-1], RuntimeError),
    ("weights", "weights", lambda t: torch.empty_like(t, device="meta"), RuntimeError),
    ("knobs", "knobs", _knob(0, float("nan")), ValueError),          # lr NaN
    ("knobs", "knobs", _knob(0, -1.0), ValueError),                  # lr -1
    ("pow_half", "knobs", _knob(1, 0.25), ValueError),               # flags disagree with the power
    ("pooling_mode", "pooling_mode", 7, ValueError),
    ("per_sample_weights", "psw", torch.ones(3), RuntimeError),
]
BACKWARD_ONLY = [("grad_out", "grad_out", lambda t: t[:0], ValueError),
                 ("grad_out", "grad_out", lambda t: t[:-1], ValueError),
                 ("nonfinite_rows", "nonfinite_rows", lambda t: t.int(), RuntimeError)]
FORWARD_ONLY = [("out_numel", "out_numel", lambda n: n - 1, ValueError),
                ("warn", "warn", lambda t: t.int(), RuntimeError),
                ("warn", "warn", lambda t: t.expand(2).contiguous(), RuntimeError),
                ("check", "check", True, RuntimeError)]       # the PyTorch implementation checks nothing


def _ids(case):
    return f"{case[1]}-{case[0]}" if isinstance(case, tuple) else str(case)


def _update_case(case, layout=("stored", "elementwise")):
    """The update's arguments with ``case`` applied, and the state arrays they hold."""
    b = _batch(PoolingMode.SUM, False)
    state = _state(layout)
    args = list(_update_args(state, layout, b, torch.linspace(-1.0, 1.5, b["out_numel"]),
                             torch.zeros(1, dtype=torch.int64)))
    _, name, value, _ = case
    if name == "grad_out":
        args[GRAD] = value(args[GRAD])
    elif name == "nonfinite_rows":
        args[NONFINITE] = value(args[NONFINITE])
    else:
        _set(args, name, value, backward=True)
    return args, [s for s in state if s is not None]


def _forward_case(case, layout=("stored", "elementwise")):
    b = _batch(PoolingMode.SUM, False)
    args = list(_forward_args(_state(layout), layout, b))
    _, name, value, _ = case
    if name in ("out_numel", "warn", "check"):
        i = {"out_numel": OUT_NUMEL, "warn": WARN, "check": CHECK}[name]
        args[i] = value(args[i]) if callable(value) else value
    else:
        _set(args, name, value)
    return args


def _assert_refused_unchanged(call, op, args, arrays, case):
    word, _, _, exc = case
    before = [bits(a) for a in arrays]
    counter = bits(args[NONFINITE]) if op is ops.tbe_backward_update_.default else None
    with pytest.raises(exc, match=word):
        call(op, *args)
    for a, b0 in zip(arrays, before):
        assert torch.equal(bits(a), b0)
    if counter is not None:
        assert torch.equal(bits(args[NONFINITE]), counter)


@pytest.mark.parametrize("case", COMMON + BACKWARD_ONLY, ids=_ids)
def test_composite_update_refuses_with_state_unchanged(case):
    args, arrays = _update_case(case)
    _assert_refused_unchanged(_by_composite, ops.tbe_backward_update_.default, args, arrays, case)


@pytest.mark.parametrize("case", COMMON + FORWARD_ONLY, ids=_ids)
def test_composite_forward_refuses(case):
    args = _forward_case(case)
    with pytest.raises(case[3], match=case[0]):
        _by_composite(ops.tbe_forward.default, *args)


def test_composite_count_invalid_refuses_a_feature_table_past_the_tables():
    b = _batch(PoolingMode.SUM, False)
    with pytest.raises(ValueError, match="feature_table"):
        _by_composite(ops.tbe_count_invalid.default, b["table_rows"], torch.tensor([0, 2]),
                      b["bag_feature"], b["indices"], b["offsets"])


def test_none_pooling_needs_n_times_max_d_outputs():
    b = _batch(PoolingMode.NONE, False)
    layout = ("stored", "elementwise")
    args = list(_forward_args(_state(layout), layout, b))
    args[OUT_NUMEL] = b["indices"].numel() * MAX_D - 1
    with pytest.raises(ValueError, match=r"N \* max_D"):
        _by_composite(ops.tbe_forward.default, *args)


# ------------------------------------------------------------------------------------ fake mode

def test_one_meta_tensor_among_cpu_arguments_raises():
    """The dispatcher runs the Meta (fake) implementation when any argument is meta: it refuses a
    meta tensor among CPU ones instead of returning an output."""
    args = _forward_case(("", "indices", lambda t: t.to("meta"), None))
    with pytest.raises(RuntimeError, match="indices is on meta, but every tensor argument must be on one device, cpu"):
        ops.tbe_forward.default(*args)
    upd, _ = _update_case(("", "table_dim", lambda t: t.to("meta"), None))
    with pytest.raises(RuntimeError, match="table_dim is on meta, but every tensor argument must be on one device, cpu"):
        ops.tbe_backward_update_.default(*upd)


def test_fake_mode_runs_consistent_and_refuses_inconsistent():
    layout = ("stored", "rowwise")
    good = _forward_case(("", "max_D", MAX_D, None), layout)
    bad = _forward_case(("", "accum", lambda t: t[:-1], None), layout)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in good]
        out = ops.tbe_forward.default(*fake)
        assert tuple(out.shape) == (good[OUT_NUMEL],) and out.dtype == torch.float32
        fake_bad = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in bad]
        with pytest.raises(RuntimeError, match="accum"):
            ops.tbe_forward.default(*fake_bad)


# ------------------------------------------------------------------------------------ the registry

def test_registry_reads_a_tensor_once_per_version(monkeypatch):
    """Where values are remembered (CUDA; here the CPU, by the module's switch), a remembered tensor
    is not read again: the remembered facts stand until the tensor changes in place."""
    monkeypatch.setattr(arg_checks, "REMEMBERING_DEVICE_TYPES", {"cpu"})
    t = torch.tensor([3, 4])
    arg_checks.remember_values(t, [7, 8])                    # facts that differ from the values
    assert arg_checks.small_values(t) == (7, 8)              # not read
    t.add_(0)                                                # in place: a new version
    assert arg_checks.recalled(t) is None
    assert arg_checks.small_values(t) == (3, 4)              # read, then remembered
    assert arg_checks.recalled(t) == (3, 4)
    monkeypatch.setattr(arg_checks, "REMEMBERING_DEVICE_TYPES", set())
    arg_checks.remember_values(t, [7, 8])
    assert arg_checks.small_values(t) == (3, 4)              # the CPU reads at every call


def test_registry_knobs_are_read_again_after_an_in_place_change(monkeypatch):
    monkeypatch.setattr(arg_checks, "REMEMBERING_DEVICE_TYPES", {"cpu"})
    args = _forward_case(("", "max_D", MAX_D, None))
    knobs = args[A["knobs"]].clone()
    arg_checks.check_knob_values("op", knobs, *args[19:21])  # read once, remembered
    assert arg_checks.recalled(knobs) == tuple(bool(f) for f in args[19:21])
    knobs[0] = -1.0                                          # bumps _version
    with pytest.raises(ValueError, match="knobs"):
        arg_checks.check_knob_values("op", knobs, *args[19:21])


def test_the_tbe_registers_its_own_tensors():
    from torchrec_ftrl.tbe.tables import TableGeometry
    g = TableGeometry(rows=(5, 6), dims=(4, 8), feature_table_map=(0, 1, 1), names=("a", "b"))
    tensors = g.tensors(torch.device("cpu"))
    assert arg_checks.recalled(tensors.table_rows) == (5, 6)
    assert arg_checks.recalled(tensors.table_row_base) == (0, 5)
    assert arg_checks.recalled(tensors.feature_table) == (0, 1, 1)


def test_registered_bags_are_checked_against_the_output_without_a_read(monkeypatch):
    monkeypatch.setattr(arg_checks, "REMEMBERING_DEVICE_TYPES", {"cpu"})
    bag_feature, bag_out_offset = torch.tensor([0, 1]), torch.tensor([0, 4])
    arg_checks.remember_bags(bag_feature, bag_out_offset, 2, (4, 8), 12)
    arg_checks.check_bag_values("op", bag_feature, bag_out_offset, 2, (4, 8), 12, "out_numel")
    with pytest.raises(ValueError, match="out_numel=11"):
        arg_checks.check_bag_values("op", bag_feature, bag_out_offset, 2, (4, 8), 11, "out_numel")
    bag_feature.add_(0)                                      # the layout is read again (and is valid)
    arg_checks.check_bag_values("op", bag_feature, bag_out_offset, 2, (4, 8), 12, "out_numel")


# ---------------------------------------------------------------------------- the overflow rule

def _one_table(layout, big: float):
    """One table of 4 rows x 4, bags [1] and [2]; bag 0's gradient ``big`` in every column (its
    square, or the row's sum of squares, overflows fp32); bag 1's ordinary."""
    rows, D = 4, 4
    g = torch.Generator().manual_seed(1)
    linear = torch.randn(rows * D, generator=g)
    accum = torch.rand(rows if layout[1] == "rowwise" else rows * D, generator=g) + 0.1
    weights = torch.randn(rows * D, generator=g) if layout[0] == "stored" else None
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    batch = (i64([0]), i64([D]), i64([rows]), i64([0]), i64([0]), i64([0, 0]), i64([0, D]),
             i64([1, 2]), i64([0, 1, 2]), None, int(PoolingMode.SUM), D, [D], rows)
    grad = torch.cat([torch.full((D,), big), torch.tensor([0.5, -1.0, 0.25, 2.0])])
    return (weights, accum, linear), batch, grad


def _update(call, state, layout, batch, grad):
    from test_ops_composite import _knob_args
    nonfinite = torch.zeros(1, dtype=torch.int64)
    args = (*state, layout[1] == "rowwise", *batch, grad, *_knob_args(state[2].device), nonfinite,
            torch.zeros(1, dtype=torch.int64), False, *([None] * 8))
    call(ops.tbe_backward_update_.default, *args)
    return nonfinite


def _assert_overflow_rule(call, layout, big):
    state, batch, grad = _one_table(layout, big)
    before = tuple(None if s is None else s.clone() for s in state)
    nonfinite = _update(call, state, layout, batch, grad)
    assert int(nonfinite) == 1
    D, rowwise = 4, layout[1] == "rowwise"
    w_rows = lambda s: s.view(4, D)  # noqa: E731
    n_rows = (lambda s: s.view(4, 1)) if rowwise else w_rows  # noqa: E731
    for s, s0, rows in zip(state, before, (w_rows, n_rows, w_rows)):
        if s is not None:
            assert torch.equal(bits(rows(s)[1]), bits(rows(s0)[1]))      # the overflowing row: unchanged
            assert torch.equal(bits(rows(s)[[0, 3]]), bits(rows(s0)[[0, 3]]))
    if layout == ("stored", "elementwise"):                          # row 2 against float64
        w0, n0, z0 = (s.view(4, D)[2].double().numpy() for s in before)
        w, z, n = ftrl_reference_step(w0, z0, n0, grad[D:].double().numpy(), **KNOBS)
        np.testing.assert_allclose(state[0].view(4, D)[2].numpy(), w, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(state[2].view(4, D)[2].numpy(), z, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(state[1].view(4, D)[2].numpy(), n, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("big", [1e20, 1e19], ids=["square-overflows", "sum-overflows"])
@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_composite_overflow_rule(layout, big):
    """1e20: g^2 overflows fp32; 1e19: each g^2 = 1e38 is finite, their sum over 4 columns is not."""
    _assert_overflow_rule(_by_composite, layout, big)


def test_rule_nonfinite_free_rows():
    g = torch.tensor([[1e19] * 4, [1e19, 0, 0, 0], [float("nan"), 0, 0, 0], [1e20, 0, 0, 0], [1, 2, 3, 4]])
    assert nonfinite_free_rows(g).tolist() == [False, True, False, False, True]
    hp = FTRLHyperparams(learning_rate=0.5)
    w, n, z = torch.zeros(3, 4), torch.ones(3, 4), torch.zeros(3, 4)
    ok = ftrl_update_rows_(w, n, z, torch.tensor([0, 2]), g[[0, 4]], hp, skip_nonfinite=True)
    assert ok.tolist() == [False, True]
    assert torch.equal(n[0], torch.ones(4)) and torch.equal(n[2], torch.ones(4) + g[4] ** 2)


# ------------------------------------------------------------------- the Triton implementation

def _by_triton(op, *args):
    return op.redispatch(CUDA, *args)


@interpreter_parent
def test_interpreter_suite():
    """Runs the ``interp`` tests below in a child pytest with TRITON_INTERPRET=1 (CPU tensors)."""
    run_interpreter_suite(__file__, timeout=600)


TRITON_CASES = [c for c in COMMON + BACKWARD_ONLY if c[1] in ("max_D", "grad_out", "bag_out_offset",
                                                               "knobs", "offsets", "weights")]


@pytest.mark.parametrize("case", TRITON_CASES, ids=_ids)
def test_interp_triton_update_refuses_with_state_unchanged(interp, case):
    args, arrays = _update_case(case)
    _assert_refused_unchanged(_by_triton, ops.tbe_backward_update_.default, args, arrays, case)


@pytest.mark.parametrize("case", [c for c in COMMON + FORWARD_ONLY if c[1] in ("max_D", "out_numel",
                                                                              "bag_out_offset")], ids=_ids)
def test_interp_triton_forward_refuses(interp, case):
    with pytest.raises(case[3], match=case[0]):
        _by_triton(ops.tbe_forward.default, *_forward_case(case))


@pytest.mark.parametrize("layout", [("stored", "elementwise"), ("derived", "rowwise")], ids="-".join)
def test_interp_triton_overflow_rule(interp, layout):
    _assert_overflow_rule(_by_triton, layout, 1e19)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_the_tbe_builds_and_looks_up_under_inference_mode(backend):
    """Inference tensors have no version counter: the checks read their values instead of
    remembering them. Expected output: the initial weights' bag sums, gathered independently."""
    from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
    with torch.inference_mode():
        tbe = FTRLTableBatchedEmbeddingBags([(10, 8), (6, 4)], backend=backend, learning_rate=0.1)
        w0, w1 = (w.double() for w in tbe.split_embedding_weights())
        out = tbe(torch.tensor([1, 9, 2, 5, 3]), torch.tensor([0, 2, 3, 4, 5]))   # feature-major bags, B = 2
    want = torch.stack([torch.cat([w0[1] + w0[9], w1[5]]), torch.cat([w0[2], w1[3]])])
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-6)


def test_none_pooling_refuses_per_sample_weights():
    """PoolingMode.NONE has no bags to weight: per_sample_weights are refused (the forward would
    ignore them and the update apply them)."""
    b = _batch(PoolingMode.NONE, False)
    layout = ("stored", "elementwise")
    args = list(_forward_args(_state(layout), layout, b))
    _set(args, "psw", torch.ones(b["indices"].numel()))
    with pytest.raises(ValueError, match="per_sample_weights .*NONE"):
        _by_composite(ops.tbe_forward.default, *args)


def test_load_state_dict_assign_refuses_a_buffer_the_kernels_cannot_take():
    """assign=True keeps the given tensors as the buffers: another dtype or a non-contiguous one is
    refused before any is assigned."""
    from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
    tbe = FTRLTableBatchedEmbeddingBags([(6, 4)], learning_rate=0.1)
    before = {k: bits(v) for k, v in tbe.state_dict().items()}
    for key, value in (("accum_dev", tbe.accum_dev.double()), ("linear_dev", torch.zeros(48)[::2])):
        sd = {k: v.clone() for k, v in tbe.state_dict().items()}
        sd[key] = value
        with pytest.raises(ValueError, match=f"{key}.*assign=True"):
            tbe.load_state_dict(sd, assign=True)
        assert all(torch.equal(bits(v), before[k]) for k, v in tbe.state_dict().items())
