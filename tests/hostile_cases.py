"""The cases of tests/test_hostile_sweep.py: a careless or hostile caller of the public ops
``torch.ops.torchrec_ftrl.*``, of the TBE, of its ``load_state_dict`` and of
``torchrec_ftrl.checkpoint.import_ftrl_tables``; and the server that runs each case in its own forked
child.

Every case starts from a valid call and changes ONE thing. It either expects a clear error (one of
:data:`ERRORS`, its message matching a per-case regex that names the offending argument or key) and
every tensor the call could touch bitwise unchanged, or, where the documented behaviour is to count
rather than raise, checks the count: a finite 1e20 gradient (its square overflows fp32) skips its rows
and counts them in ``nonfinite_rows`` / ``nonfinite_grad_rows`` while other rows update;
``tbe_count_invalid`` returns > 0 for a batch with bad index or offset values; ``tbe_repair_offsets``
and ``BoundsCheckMode.WARNING`` repair and count. IGNORE mode (undefined behaviour on bad indices)
has no case.

:data:`CASES` maps a case name to a function of no arguments that raises ``AssertionError`` when the
behaviour is wrong. ``python tests/hostile_cases.py`` is the server (:func:`serve`): it imports
everything once, then reads case names on stdin, forks one child per case and writes one JSON line
per case on stdout: the child's report and how it ended (exit status or signal).
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import select
import signal
import sys
import tempfile
import time
import traceback
from typing import Callable, Optional

import numpy as np
import torch

from conftest import bits
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.fbgemm_enums import BoundsCheckMode, PoolingMode, SparseType
from torchrec_ftrl.hyperparams import KernelScalars
from torchrec_ftrl.kernels.cpu import backend as cpp_backend
from torchrec_ftrl.kernels.knobs import knob_args

ops = torch.ops.torchrec_ftrl
ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError)
COMPOSITE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
CASE_TIMEOUT_S = 60
CASES: dict[str, Callable[[], None]] = {}
RAISED: list[str] = []   # the message of the error a case expected (its report shows it)

# ------------------------------------------------------------------------------ the valid op call
ROWS, DIMS, B = (6, 5), (4, 8), 3                 # two tables, one feature each, 3 bags per feature
MAX_D, TOTAL_D = max(DIMS), sum(DIMS)
TOTAL = sum(r * d for r, d in zip(ROWS, DIMS))    # 64 elements
INDICES = [1, 4, 5, 5, 0, 2, 0, 2, 2, 4]          # f0: [1, 4], [], [5, 5, 0]; f1: [2], [0, 2, 2], [4]
OFFSETS = [0, 2, 2, 5, 6, 9, 10]
N = len(INDICES)
OUT_NUMEL = B * TOTAL_D                           # 36
SCALARS = KernelScalars(lr=0.5, neg_power=0.5, l1=0.01, l2=0.04, beta=0.3, shrink2=0.1)
BATCH_NAMES = ("table_w_offset", "table_dim", "table_rows", "table_row_base", "feature_table", "bag_feature",
               "bag_out_offset", "indices", "offsets", "per_sample_weights", "pooling_mode", "max_D",
               "table_dims", "total_rows")
ARRAY_NAMES = ("weights", "accum", "linear", "rowwise")
KNOB_NAMES = ("knobs", "pow_half", "has_shrink")
CACHE_NAMES = ("cache_locations", "cache_weights", "cache_accum", "cache_linear")
NAMES = {
    "forward": ARRAY_NAMES + BATCH_NAMES + KNOB_NAMES + ("out_numel", "out_dtype", "warn", "check", "row_keys")
    + CACHE_NAMES,
    "update": ARRAY_NAMES + BATCH_NAMES + ("grad_out",) + KNOB_NAMES + (
        "nonfinite_rows", "step", "check", "lin_key", "lin_gofs", "lin_scale", "lin_tid") + CACHE_NAMES,
    "count": ("table_rows", "feature_table", "bag_feature", "indices", "offsets"),
    "repair": ("offsets", "warn", "num_indices"),
}
OPS = {"forward": "tbe_forward", "update": "tbe_backward_update_", "count": "tbe_count_invalid",
       "repair": "tbe_repair_offsets"}
I64 = dict(dtype=torch.int64)


def state_arrays(layout: str) -> dict:
    """Seeded ``weights, accum, linear, rowwise`` of ``layout`` (``"stored"``: stored weights, element-wise
    fp32 accum; ``"lean"``: derived weights, a row-wise fp32 accum, bf16 linear)."""
    g = torch.Generator().manual_seed(0)
    linear = torch.randn(TOTAL, generator=g)
    if layout == "stored":
        return dict(weights=torch.randn(TOTAL, generator=g), accum=torch.rand(TOTAL, generator=g) + 0.1,
                    linear=linear, rowwise=False)
    return dict(weights=None, accum=torch.rand(sum(ROWS), generator=g) + 0.1, linear=linear.bfloat16(),
                rowwise=True)


def batch_args() -> dict:
    """The batch arguments of :data:`INDICES` / :data:`OFFSETS`: SUM bags, the plain ``[B, 12]`` output."""
    bag_out = [b * TOTAL_D for b in range(B)] + [b * TOTAL_D + DIMS[0] for b in range(B)]
    return dict(table_w_offset=torch.tensor([0, ROWS[0] * DIMS[0]]), table_dim=torch.tensor(DIMS),
                table_rows=torch.tensor(ROWS), table_row_base=torch.tensor([0, ROWS[0]]),
                feature_table=torch.tensor([0, 1]), bag_feature=torch.tensor([0] * B + [1] * B),
                bag_out_offset=torch.tensor(bag_out), indices=torch.tensor(INDICES),
                offsets=torch.tensor(OFFSETS), per_sample_weights=None, pooling_mode=int(PoolingMode.SUM),
                max_D=MAX_D, table_dims=list(DIMS), total_rows=sum(ROWS))


def knob_dict() -> dict:
    knobs, pow_half, has_shrink = knob_args(SCALARS.to_hyperparams(), torch.device("cpu"))
    return dict(knobs=knobs.clone(), pow_half=pow_half, has_shrink=has_shrink)


def grad_out() -> torch.Tensor:
    return torch.linspace(-1.0, 1.5, OUT_NUMEL)


def valid_args(op: str, layout: str = "stored") -> dict:
    """A valid call of ``op`` by argument name (schema order: :data:`NAMES`)."""
    if op == "count":
        b = batch_args()
        return {k: b[k] for k in NAMES["count"]}
    if op == "repair":
        return dict(offsets=torch.tensor(OFFSETS), warn=torch.zeros(1, **I64), num_indices=N)
    args = dict(state_arrays(layout), **batch_args(), **knob_dict())
    args.update({k: None for k in NAMES[op] if k not in args})
    if op == "forward":
        args.update(out_numel=OUT_NUMEL, out_dtype=torch.float32, warn=torch.zeros(1, **I64), check=False)
    else:
        args.update(grad_out=grad_out(), nonfinite_rows=torch.zeros(1, **I64), step=torch.tensor([3]),
                    check=False)
    return args


def call(op: str, impl: str, args: dict):
    """``op`` by the dispatcher (``"cpp"``: the compiled kernel, loaded) or by its
    ``CompositeExplicitAutograd`` implementation (``"torch"``)."""
    fn = getattr(ops, OPS[op]).default
    values = [args[k] for k in NAMES[op]]
    return fn(*values) if impl == "cpp" else fn.redispatch(COMPOSITE, *values)


# ------------------------------------------------------------------------------ expectations
def snapshot(args: dict) -> dict:
    """Bit copies of every non-meta tensor argument."""
    return {k: bits(v) for k, v in args.items() if isinstance(v, torch.Tensor) and not v.is_meta}


def assert_unchanged(before: dict, args: dict, what: str = "argument") -> None:
    for k, b in before.items():
        assert torch.equal(b, bits(args[k])), f"{what} {k} changed by a call that raised"


def expect_error(fn: Callable[[], object], pattern: str) -> None:
    """``fn()`` raises one of :data:`ERRORS` whose message matches ``pattern`` (case-insensitive)."""
    try:
        result = fn()
    except ERRORS as e:
        msg = f"{type(e).__name__}: {e}"
        RAISED.append(msg[:300])
        assert re.search(pattern, str(e), re.I), f"message does not match /{pattern}/: {msg[:600]}"
        return
    raise AssertionError(f"no error (expected one matching /{pattern}/); returned {_brief(result)}")


def _brief(result) -> str:
    if isinstance(result, torch.Tensor):
        return f"tensor shape={tuple(result.shape)} dtype={result.dtype} device={result.device}"
    return repr(result)[:200]


def op_raises(op: str, impl: str, layout: str, mutate: Callable[[dict], None], pattern: str) -> Callable:
    def case():
        args = valid_args(op, layout)
        mutate(args)
        before = snapshot(args)
        expect_error(lambda: call(op, impl, args), pattern)
        assert_unchanged(before, args)
    return case


def add(name: str, fn: Callable[[], None]) -> None:
    assert name not in CASES, name
    CASES[name] = fn


# ------------------------------------------------------------------------------ mutations
def setter(name: str, value_fn: Callable[[], object]) -> Callable[[dict], None]:
    def mutate(args):
        args[name] = value_fn()
    return mutate


def edit(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    """Replace tensor argument ``name`` by ``fn(copy)``."""
    def mutate(args):
        args[name] = fn(args[name].clone())
    return mutate


def put(name: str, index, value) -> Callable[[dict], None]:
    def f(t):
        t[index] = value
        return t
    return edit(name, f)


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values as a strided (non-contiguous) 1-D view."""
    wide = torch.zeros(t.numel(), 2, dtype=t.dtype)
    wide[:, 0] = t
    return wide[:, 0]


def knob(i: int, value: float, **flags) -> Callable[[dict], None]:
    def mutate(args):
        args["knobs"] = args["knobs"].clone()
        args["knobs"][i] = value
        args.update(flags)
    return mutate


def to_meta(name: str) -> Callable[[dict], None]:
    return edit(name, lambda t: t.to("meta"))


def names_device(arg: str) -> str:
    """A message naming argument ``arg`` and the device (or ``meta``), in either order."""
    return rf"\b{arg}\b[\s\S]*(meta|device)|(meta|device)[\s\S]*\b{arg}\b"


NAN, INF = math.nan, math.inf
# Batch mutations, valid for tbe_forward and tbe_backward_update_ alike: (name, mutate, pattern).
BATCH_MUTATIONS = [
    ("max_D_below_a_dim", setter("max_D", lambda: 4), r"max_D"),
    ("bag_out_offset_past_output", put("bag_out_offset", -1, OUT_NUMEL), r"bag_out_offset|out_numel|grad_out"),
    ("bag_out_offset_overhangs", put("bag_out_offset", -1, OUT_NUMEL - 4), r"bag_out_offset|out_numel|grad_out"),
    ("bag_out_offset_negative", put("bag_out_offset", 0, -1), r"bag_out_offset"),
    ("more_offsets_than_bags", edit("offsets", lambda t: torch.cat([t, t[-1:]])), r"offsets|bag"),
    ("fewer_offsets_than_bags", edit("offsets", lambda t: t[:-1]), r"offsets|bag"),
    ("offsets_empty", edit("offsets", lambda t: t[:0]), r"offsets"),
    ("offsets_past_N", put("offsets", -1, N + 3), r"offsets|indices"),
    ("offsets_inner_past_N", put("offsets", 3, N + 3), r"offsets|indices"),
    ("offsets_decreasing", put("offsets", 2, 1), r"offsets"),
    ("offsets_negative", put("offsets", 1, -2), r"offsets"),
    ("offsets_first_nonzero", put("offsets", 0, 1), r"offsets"),
    ("feature_table_past_T", put("feature_table", 1, 2), r"feature_table"),
    ("feature_table_negative", put("feature_table", 1, -1), r"feature_table"),
    ("feature_table_empty", edit("feature_table", lambda t: t[:0]), r"feature_table|bag_feature"),
    ("bag_feature_past_F", put("bag_feature", -1, 2), r"bag_feature"),
    ("bag_feature_negative", put("bag_feature", 0, -1), r"bag_feature"),
    ("table_w_offset_beyond_arrays", put("table_w_offset", 1, 30), r"table_w_offset"),
    ("table_w_offset_negative", put("table_w_offset", 0, -4), r"table_w_offset"),
    ("table_rows_beyond_arrays", put("table_rows", 1, 6), r"table_rows|total_rows"),
    ("table_rows_negative", put("table_rows", 0, -1), r"table_rows|total_rows"),
    ("table_row_base_inconsistent", put("table_row_base", 1, 3), r"table_row_base"),
    ("table_dim_beyond_arrays", put("table_dim", 1, 9), r"table_dim|max_D"),
    ("table_dim_zero", put("table_dim", 0, 0), r"table_dim"),
    ("table_dims_disagree", setter("table_dims", lambda: [4, 7]), r"table_dim"),
    ("total_rows_disagrees", setter("total_rows", lambda: 99), r"total_rows|table_rows"),
    ("table_w_offset_short", edit("table_w_offset", lambda t: t[:1]), r"table_w_offset"),
    ("table_dim_long", edit("table_dim", lambda t: torch.cat([t, t[:1]])), r"table_dim"),
    ("table_rows_short", edit("table_rows", lambda t: t[:1]), r"table_rows"),
    ("table_row_base_long", edit("table_row_base", lambda t: torch.cat([t, t[:1]])), r"table_row_base"),
    ("bag_feature_short", edit("bag_feature", lambda t: t[:-1]), r"bag_feature|offsets"),
    ("bag_out_offset_short", edit("bag_out_offset", lambda t: t[:-1]), r"bag_out_offset|offsets"),
    ("indices_int32", edit("indices", lambda t: t.int()), r"indices"),
    ("offsets_int32", edit("offsets", lambda t: t.int()), r"offsets"),
    ("table_w_offset_int32", edit("table_w_offset", lambda t: t.int()), r"table_w_offset"),
    ("feature_table_int32", edit("feature_table", lambda t: t.int()), r"feature_table"),
    ("bag_out_offset_int32", edit("bag_out_offset", lambda t: t.int()), r"bag_out_offset"),
    ("indices_float", edit("indices", lambda t: t.float()), r"indices"),
    ("indices_noncontiguous", edit("indices", noncontiguous), r"indices"),
    ("offsets_noncontiguous", edit("offsets", noncontiguous), r"offsets"),
    ("bag_out_offset_noncontiguous", edit("bag_out_offset", noncontiguous), r"bag_out_offset"),
    ("indices_2d", edit("indices", lambda t: t.view(2, -1)), r"indices"),
    ("offsets_2d", edit("offsets", lambda t: t.view(1, -1)), r"offsets"),
    ("table_rows_2d", edit("table_rows", lambda t: t.view(2, 1)), r"table_rows"),
    ("psw_short", setter("per_sample_weights", lambda: torch.ones(N - 1)), r"per_sample_weights"),
    ("psw_fp64", setter("per_sample_weights", lambda: torch.ones(N, dtype=torch.float64)),
     r"per_sample_weights"),
    ("psw_int64", setter("per_sample_weights", lambda: torch.ones(N, **I64)), r"per_sample_weights"),
    ("psw_2d", setter("per_sample_weights", lambda: torch.ones(N, 1)), r"per_sample_weights"),
    ("pooling_mode_7", setter("pooling_mode", lambda: 7), r"pooling_mode"),
    ("pooling_mode_negative", setter("pooling_mode", lambda: -1), r"pooling_mode"),
]
STATE_MUTATIONS = [
    ("weights_fp64", edit("weights", lambda t: t.double()), r"weights"),
    ("weights_short", edit("weights", lambda t: t[:-1]), r"weights"),
    ("weights_noncontiguous", edit("weights", noncontiguous), r"weights"),
    ("accum_fp64", edit("accum", lambda t: t.double()), r"accum"),
    ("accum_fp16", edit("accum", lambda t: t.half()), r"accum"),
    ("accum_short", edit("accum", lambda t: t[:-1]), r"accum"),
    ("accum_rowwise_flag_disagrees", setter("rowwise", lambda: True), r"accum|rowwise"),
    ("linear_fp64", edit("linear", lambda t: t.double()), r"linear"),
    ("linear_short", edit("linear", lambda t: t[:-1]), r"linear"),
    ("linear_2d", edit("linear", lambda t: t.view(-1, 4)), r"linear"),
    ("linear_noncontiguous", edit("linear", noncontiguous), r"linear"),
]
KNOB_MUTATIONS = [
    ("lr_nan", knob(0, NAN), r"lr|learning.rate|knob"),
    ("lr_minus_1", knob(0, -1.0), r"lr|learning.rate|knob"),
    ("lr_zero", knob(0, 0.0), r"lr|learning.rate|knob"),
    ("lr_inf", knob(0, INF), r"lr|learning.rate|knob"),
    ("neg_power_negative", knob(1, -0.5, pow_half=False), r"power|knob"),
    ("neg_power_nan", knob(1, NAN, pow_half=False), r"power|knob"),
    ("l1_negative", knob(2, -0.01), r"l1|knob"),
    ("l1_nan", knob(2, NAN), r"l1|knob"),
    ("l2_negative", knob(3, -1.0), r"l2|knob"),
    ("l2_inf", knob(3, INF), r"l2|knob"),
    ("beta_negative", knob(4, -0.3), r"beta|knob"),
    ("beta_nan", knob(4, NAN), r"beta|knob"),
    ("shrink_negative", knob(5, -0.1), r"shrink|knob"),
    ("shrink_inf", knob(5, INF), r"shrink|knob"),
    ("pow_half_disagrees", setter("pow_half", lambda: False), r"pow_half|knob"),
    ("has_shrink_disagrees", setter("has_shrink", lambda: False), r"has_shrink|knob"),
    ("knobs_short", edit("knobs", lambda t: t[:-1]), r"knobs"),
    ("knobs_fp64", edit("knobs", lambda t: t.double()), r"knobs"),
    ("knobs_2d", edit("knobs", lambda t: t.view(2, -1)), r"knobs"),
]
FORWARD_MUTATIONS = [
    ("out_numel_short", setter("out_numel", lambda: OUT_NUMEL - 1), r"out_numel|bag_out_offset"),
    ("out_numel_zero", setter("out_numel", lambda: 0), r"out_numel|bag_out_offset"),
    ("out_numel_negative", setter("out_numel", lambda: -1), r"out_numel"),
    ("out_dtype_int64", setter("out_dtype", lambda: torch.int64), r"out_dtype|dtype"),
    ("warn_int32", setter("warn", lambda: torch.zeros(1, dtype=torch.int32)), r"warn"),
    ("warn_shape_2", setter("warn", lambda: torch.zeros(2, **I64)), r"warn"),
    ("check_true", setter("check", lambda: True), r"check"),
]
UPDATE_MUTATIONS = [
    ("grad_out_empty", setter("grad_out", lambda: torch.empty(0)), r"grad_out|out_numel|bag_out_offset"),
    ("grad_out_short", edit("grad_out", lambda t: t[:-1]), r"grad_out|out_numel|bag_out_offset"),
    ("grad_out_int32", edit("grad_out", lambda t: t.int()), r"grad_out"),
    ("grad_out_fp64", edit("grad_out", lambda t: t.double()), r"grad_out"),
    ("grad_out_2d", edit("grad_out", lambda t: t.view(B, -1)), r"grad_out"),
    ("grad_out_noncontiguous", edit("grad_out", noncontiguous), r"grad_out"),
    ("nonfinite_rows_shape_2", setter("nonfinite_rows", lambda: torch.zeros(2, **I64)), r"nonfinite_rows"),
    ("nonfinite_rows_int32", setter("nonfinite_rows", lambda: torch.zeros(1, dtype=torch.int32)),
     r"nonfinite_rows"),
    ("nonfinite_rows_fp32", setter("nonfinite_rows", lambda: torch.zeros(1)), r"nonfinite_rows"),
    ("step_int32", edit("step", lambda t: t.int()), r"step"),
    ("step_fp32", edit("step", lambda t: t.float()), r"step"),
    ("step_shape_2", setter("step", lambda: torch.tensor([3, 4])), r"step"),
]
META_POSITIONS = {
    "forward": ("weights", "accum", "linear", "table_w_offset", "table_rows", "bag_out_offset", "indices",
                "offsets", "knobs", "warn"),
    "update": ("weights", "accum", "linear", "table_dim", "feature_table", "indices", "offsets", "grad_out",
               "knobs", "nonfinite_rows", "step"),
}
LEAN_MUTATIONS = [   # on the lean layout (derived weights, row-wise accum, bf16 linear)
    ("table_row_base_inconsistent", put("table_row_base", 1, 3), r"table_row_base"),
    ("table_rows_beyond_arrays", put("table_rows", 1, 6), r"table_rows|total_rows|accum"),
    ("accum_short", edit("accum", lambda t: t[:-1]), r"accum"),
    ("accum_elementwise", setter("accum", lambda: torch.ones(TOTAL)), r"accum|rowwise"),
    ("max_D_below_a_dim", setter("max_D", lambda: 4), r"max_D"),
    ("lr_nan", knob(0, NAN), r"lr|learning.rate|knob"),
    ("l1_negative", knob(2, -0.01), r"l1|knob"),
]
LEAN_UPDATE_MUTATIONS = [
    ("bf16_state_without_step", setter("step", lambda: None), r"step"),
    ("step_int32", edit("step", lambda t: t.int()), r"step"),
    ("grad_out_short", edit("grad_out", lambda t: t[:-1]), r"grad_out|out_numel|bag_out_offset"),
]


def _register_op_cases() -> None:
    for impl in ("cpp", "torch"):
        for op in ("forward", "update"):
            extra = FORWARD_MUTATIONS if op == "forward" else UPDATE_MUTATIONS
            for name, mutate, pattern in BATCH_MUTATIONS + STATE_MUTATIONS + KNOB_MUTATIONS + extra:
                add(f"{impl}-{op}-{name}", op_raises(op, impl, "stored", mutate, pattern))
            lean = LEAN_MUTATIONS + (LEAN_UPDATE_MUTATIONS if op == "update" else [])
            for name, mutate, pattern in lean:
                add(f"{impl}-{op}-lean-{name}", op_raises(op, impl, "lean", mutate, pattern))
            for arg in META_POSITIONS[op]:
                add(f"{impl}-{op}-meta-{arg}", op_raises(op, impl, "stored", to_meta(arg), names_device(arg)))
            add(f"{impl}-{op}-meta-psw",
                op_raises(op, impl, "stored", setter("per_sample_weights", lambda: torch.ones(N, device="meta")),
                          names_device("per_sample_weights")))


# ------------------------------------------------------------------------------ the overflow rule
def _row_slices(t: int, r: int) -> slice:
    """Elements of row ``r`` of table ``t`` in a flat ``[TOTAL]`` array."""
    start = sum(ROWS[i] * DIMS[i] for i in range(t)) + r * DIMS[t]
    return slice(start, start + DIMS[t])


def _row_grads(g: np.ndarray) -> dict:
    """float64 summed gradient of each touched ``(table, row)`` of the valid SUM batch and ``g``
    (the flat ``[B, 12]`` upstream gradient)."""
    out = {}
    for bag in range(2 * B):
        t, b = divmod(bag, B)
        col = b * TOTAL_D + (DIMS[0] if t else 0)
        for i in INDICES[OFFSETS[bag]:OFFSETS[bag + 1]]:
            out[(t, i)] = out.get((t, i), 0.0) + g[col:col + DIMS[t]].astype(np.float64)
    return out


def overflow_case(impl: str, layout: str) -> Callable:
    """A finite 1e20 in bag 0 (rows 1 and 4 of table 0): g^2 overflows fp32, so those rows are skipped
    (bitwise unchanged) and counted; every other touched row updates (element-wise accum: n + g^2)."""
    def case():
        args = valid_args("update", layout)
        g = grad_out()
        g[1] = 1e20
        args["grad_out"] = g
        before = {k: args[k].clone() for k in ("weights", "accum", "linear") if args[k] is not None}
        call("update", impl, args)
        assert int(args["nonfinite_rows"]) == 2, f"nonfinite_rows = {int(args['nonfinite_rows'])}, want 2"
        grads = _row_grads(g.numpy())
        for (t, r), gr in grads.items():
            sl = _row_slices(t, r)
            acc_sl = slice(sum(ROWS[:t]) + r, sum(ROWS[:t]) + r + 1) if args["rowwise"] else sl
            skipped = bool(np.any(np.abs(gr) > 1e19))   # g^2 > fp32's max
            for k, b in before.items():
                part = acc_sl if k == "accum" else sl
                new, old = args[k][part], b[part]
                assert torch.isfinite(new.float()).all(), f"{k} of row {(t, r)} is not finite"
                if skipped:
                    assert torch.equal(bits(new), bits(old)), f"{k} of skipped row {(t, r)} changed"
            if not skipped and not args["rowwise"]:
                want = before["accum"][sl].double().numpy() + gr ** 2
                np.testing.assert_allclose(args["accum"][sl].double().numpy(), want, rtol=1e-6,
                                           err_msg=f"accum of row {(t, r)}")
            elif not skipped:
                assert not torch.equal(bits(args["linear"][sl]), bits(before["linear"][sl])), (t, r)
    return case


# ------------------------------------------------------------------------------ count and repair
def count_case(impl: str, mutate: Callable[[dict], None]) -> Callable:
    """``tbe_count_invalid`` of a batch with one bad index or offset value: > 0, inputs unchanged."""
    def case():
        args = valid_args("count")
        mutate(args)
        before = snapshot(args)
        n = call("count", impl, args)
        assert n.dtype == torch.int64 and n.numel() == 1, _brief(n)
        assert int(n) > 0, f"tbe_count_invalid returned {int(n)} for a bad batch"
        assert_unchanged(before, args)
    return case


def count_or_raise_case(impl: str, mutate: Callable[[dict], None], pattern: str) -> Callable:
    """A malformed batch structure: a clear error, or a count > 0; inputs unchanged either way."""
    def case():
        args = valid_args("count")
        mutate(args)
        before = snapshot(args)
        try:
            n = call("count", impl, args)
        except ERRORS as e:
            assert re.search(pattern, str(e), re.I), f"message does not match /{pattern}/: {e}"
        else:
            assert int(n) > 0, f"tbe_count_invalid returned {int(n)} for a malformed batch"
        assert_unchanged(before, args)
    return case


COUNT_VALUES = [   # bad values: counted
    ("index_past_rows", put("indices", 0, 6)),
    ("index_past_rows_table1", put("indices", -1, 5)),
    ("index_negative", put("indices", 3, -1)),
    ("index_huge", put("indices", 3, 2 ** 40)),
    ("offsets_decreasing", put("offsets", 2, 1)),
    ("offsets_past_N", put("offsets", -1, N + 3)),
    ("offsets_inner_past_N", put("offsets", 3, N + 3)),
    ("offsets_negative", put("offsets", 1, -2)),
    ("offsets_first_nonzero", put("offsets", 0, 1)),
    ("offsets_last_below_N", put("offsets", -1, N - 1)),
]
COUNT_STRUCTURE = [   # a malformed structure: an error (or a count)
    ("more_offsets_than_bags", edit("offsets", lambda t: torch.cat([t, t[-1:]])), r"offsets|bag"),
    ("fewer_offsets_than_bags", edit("offsets", lambda t: t[:-1]), r"offsets|bag"),
    ("offsets_empty", edit("offsets", lambda t: t[:0]), r"offsets"),
]
COUNT_RAISES = [
    ("feature_table_past_T", put("feature_table", 1, 2), r"feature_table"),
    ("feature_table_negative", put("feature_table", 1, -1), r"feature_table"),
    ("bag_feature_past_F", put("bag_feature", -1, 2), r"bag_feature"),
    ("bag_feature_negative", put("bag_feature", 0, -1), r"bag_feature"),
    ("indices_int32", edit("indices", lambda t: t.int()), r"indices"),
    ("indices_float", edit("indices", lambda t: t.float()), r"indices"),
    ("offsets_int32", edit("offsets", lambda t: t.int()), r"offsets"),
    ("table_rows_int32", edit("table_rows", lambda t: t.int()), r"table_rows"),
    ("indices_2d", edit("indices", lambda t: t.view(2, -1)), r"indices"),
    ("indices_noncontiguous", edit("indices", noncontiguous), r"indices"),
    ("meta_indices", to_meta("indices"), names_device("indices")),
    ("meta_table_rows", to_meta("table_rows"), names_device("table_rows")),
    ("meta_offsets", to_meta("offsets"), names_device("offsets")),
]


def repair_case(mutate: Callable[[dict], None], changed: int) -> Callable:
    """``tbe_repair_offsets`` of bad offsets: non-decreasing from 0 to N, ``changed`` counted."""
    def case():
        args = valid_args("repair")
        mutate(args)
        raw = args["offsets"].clone()
        out = call("repair", "torch", args)
        want = np.maximum.accumulate(np.clip(raw.numpy(), 0, N))
        want[0], want[-1] = 0, N
        assert out.tolist() == want.tolist(), (out.tolist(), want.tolist())
        assert int(args["warn"]) == changed, f"warn = {int(args['warn'])}, want {changed}"
        assert torch.equal(args["offsets"], raw), "the raw offsets changed"
    return case


REPAIR_RAISES = [
    ("warn_int32", setter("warn", lambda: torch.zeros(1, dtype=torch.int32)), r"warn"),
    ("warn_shape_2", setter("warn", lambda: torch.zeros(2, **I64)), r"warn"),
    ("warn_fp32", setter("warn", lambda: torch.zeros(1)), r"warn"),
    ("offsets_float", edit("offsets", lambda t: t.float()), r"offsets"),
    ("offsets_2d", edit("offsets", lambda t: t.view(1, -1)), r"offsets"),
    ("num_indices_negative", setter("num_indices", lambda: -1), r"num_indices"),
    ("meta_warn", to_meta("warn"), names_device("warn")),
]


def _register_count_cases() -> None:
    for impl in ("cpp", "torch"):
        for layout in ("stored", "lean"):
            add(f"{impl}-update-{layout}-grad_1e20_overflow_counted", overflow_case(impl, layout))
        for name, mutate in COUNT_VALUES:
            add(f"{impl}-count-{name}", count_case(impl, mutate))
        for name, mutate, pattern in COUNT_STRUCTURE:
            add(f"{impl}-count-{name}", count_or_raise_case(impl, mutate, pattern))
        for name, mutate, pattern in COUNT_RAISES:
            add(f"{impl}-count-{name}", op_raises("count", impl, "stored", mutate, pattern))
    add("repair-decreasing", repair_case(put("offsets", 2, 1), 1))
    add("repair-past_N", repair_case(put("offsets", 3, N + 3), 3))
    add("repair-negative", repair_case(put("offsets", 1, -2), 1))
    for name, mutate, pattern in REPAIR_RAISES:
        add(f"repair-{name}", op_raises("repair", "torch", "stored", mutate, pattern))


# ------------------------------------------------------------------------------ the TBE
TBE_LAYOUTS = {
    "stored": {},
    "lean": dict(ftrl_weights="derived", ftrl_accumulator="rowwise",
                 optimizer_state_dtypes={"linear": SparseType.BF16}),
    "bf16state": dict(optimizer_state_dtypes={"accum": SparseType.BF16, "linear": SparseType.BF16}),
}
TBE_KNOBS = dict(learning_rate=0.5, ftrl_l1_reg=0.01, ftrl_l2_reg=0.02, ftrl_beta=0.3,
                 ftrl_initial_accumulator_value=0.1)


def make_tbe(layout: str, backend: str, mode: BoundsCheckMode) -> FTRLTableBatchedEmbeddingBags:
    """Two tables ``ROWS x DIMS``, one feature each, after one valid training step (states not at
    their start values)."""
    tbe = FTRLTableBatchedEmbeddingBags(list(zip(ROWS, DIMS)), bounds_check_mode=mode, backend=backend,
                                        **TBE_KNOBS, **TBE_LAYOUTS[layout])
    tbe(torch.tensor(INDICES), torch.tensor(OFFSETS)).backward(grad_out().view(B, TOTAL_D))
    return tbe


def module_bits(m: torch.nn.Module) -> dict:
    named = dict(m.named_buffers())
    named.update(m.named_parameters())
    return {k: bits(v) for k, v in named.items() if not v.is_meta}


def assert_module_unchanged(before: dict, m: torch.nn.Module) -> None:
    after = module_bits(m)
    assert before.keys() == after.keys(), (sorted(before), sorted(after))
    for k in before:
        assert torch.equal(before[k], after[k]), f"buffer {k} changed by a call that raised"


def tbe_step(tbe, indices, offsets, **kw) -> torch.Tensor:
    out = tbe(indices, offsets, **kw)
    out.backward(torch.ones_like(out))
    return out


def tbe_raises(layout: str, backend: str, mode: BoundsCheckMode, batch_fn: Callable[[], tuple],
               pattern: str) -> Callable:
    """A bad batch: the forward (and the step) raises, naming the argument; every buffer unchanged."""
    def case():
        tbe = make_tbe(layout, backend, mode)
        before = module_bits(tbe)
        indices, offsets, kw = batch_fn()
        expect_error(lambda: tbe_step(tbe, indices, offsets, **kw), pattern)
        assert_module_unchanged(before, tbe)
    return case


def tbe_warns(layout: str, backend: str, batch_fn: Callable[[], tuple]) -> Callable:
    """``WARNING``: a bad index or offset is repaired and counted; the step runs; states stay finite."""
    def case():
        tbe = make_tbe(layout, backend, BoundsCheckMode.WARNING)
        indices, offsets, kw = batch_fn()
        tbe_step(tbe, indices, offsets, **kw)
        assert int(tbe.bounds_check_warning) > 0, "bounds_check_warning is 0 after a bad batch"
        for name in ("weights_dev", "accum_dev", "linear_dev"):
            assert torch.isfinite(getattr(tbe, name).float()).all(), f"{name} not finite"
    return case


def tbe_overflow(layout: str, backend: str) -> Callable:
    """A finite 1e20 upstream gradient in bag 0 (rows 1 and 4 of table 0): those two rows are skipped
    (bitwise unchanged) and counted in ``nonfinite_grad_rows``; the other touched rows update."""
    def case():
        tbe = make_tbe(layout, backend, BoundsCheckMode.FATAL)
        names = [n for n in ("weights_dev", "accum_dev", "linear_dev") if getattr(tbe, n).numel()]
        before = {n: getattr(tbe, n).clone() for n in names}
        counted = int(tbe.nonfinite_grad_rows)
        out = tbe(torch.tensor(INDICES), torch.tensor(OFFSETS))
        g = grad_out()
        g[1] = 1e20
        out.backward(g.view(B, TOTAL_D))
        got = int(tbe.nonfinite_grad_rows) - counted
        assert got == 2, f"nonfinite_grad_rows grew by {got}, want 2"
        rowwise = tbe.accum_dev.numel() == sum(ROWS)
        for (t, r), gr in _row_grads(g.numpy()).items():
            skipped = bool(np.any(np.abs(gr) > 1e19))
            changed = []
            for n in names:
                sl = _row_slices(t, r)
                if n == "accum_dev" and rowwise:
                    sl = slice(sum(ROWS[:t]) + r, sum(ROWS[:t]) + r + 1)
                new, old = getattr(tbe, n)[sl], before[n][sl]
                assert torch.isfinite(new.float()).all(), f"{n} of row {(t, r)} not finite"
                changed.append((n, not torch.equal(bits(new), bits(old))))
            if skipped:
                assert not any(c for _, c in changed), f"skipped row {(t, r)} changed: {changed}"
            else:   # the states move (a weight may stay exactly 0 under l1)
                assert all(c for n, c in changed if n != "weights_dev"), f"row {(t, r)}: {changed}"

    return case


def _batch(indices=INDICES, offsets=OFFSETS, **kw) -> Callable[[], tuple]:
    return lambda: (torch.as_tensor(indices, dtype=torch.int64), torch.as_tensor(offsets, dtype=torch.int64), kw)


def _with(index: int, value: int) -> list:
    out = list(INDICES)
    out[index] = value
    return out


def _offsets_with(index: int, value: int) -> list:
    out = list(OFFSETS)
    out[index] = value
    return out


TBE_BOUNDS = [   # bad values: FATAL raises, WARNING repairs and counts
    ("index_past_rows", _batch(_with(0, 6)), r"indices|index"),
    ("index_past_rows_table1", _batch(_with(-1, 5)), r"indices|index"),
    ("index_negative", _batch(_with(3, -1)), r"indices|index"),
    ("offsets_decreasing", _batch(offsets=_offsets_with(2, 1)), r"offsets"),
    ("offsets_past_N", _batch(offsets=_offsets_with(6, N + 3)), r"offsets"),
    ("offsets_last_below_N", _batch(offsets=_offsets_with(6, N - 1)), r"offsets"),
    ("offsets_first_nonzero", _batch(offsets=_offsets_with(0, 1)), r"offsets"),
]
TBE_STRUCTURE = [   # raise in every mode
    ("offsets_wrong_length", _batch(offsets=OFFSETS[:-1]), r"offsets"),
    ("offsets_empty", _batch(offsets=[]), r"offsets"),
    ("indices_float", lambda: (torch.tensor(INDICES).float(), torch.tensor(OFFSETS), {}), r"indices"),
    ("offsets_float", lambda: (torch.tensor(INDICES), torch.tensor(OFFSETS).float(), {}), r"offsets"),
    ("indices_2d", lambda: (torch.tensor(INDICES).view(2, -1), torch.tensor(OFFSETS), {}), r"indices"),
    ("psw_short", _batch(per_sample_weights=torch.ones(N - 1)), r"per_sample_weights"),
    ("psw_int64", _batch(per_sample_weights=torch.ones(N, **I64)), r"per_sample_weights"),
    ("three_features_for_two", _batch(offsets=OFFSETS + [N, N, N]), r"offsets|feature"),
    ("vbe_sizes_disagree", _batch(batch_size_per_feature_per_rank=[[2], [2]]),
     r"batch_size_per_feature_per_rank"),
    ("indices_meta", lambda: (torch.tensor(INDICES, device="meta"), torch.tensor(OFFSETS), {}),
     names_device("indices")),
]
TBE_RUNS = [("stored", "cpp"), ("lean", "cpp"), ("bf16state", "cpp"), ("stored", "torch"), ("lean", "torch")]


def _register_tbe_cases() -> None:
    for layout, backend in TBE_RUNS:
        tag = f"tbe-{layout}-{backend}"
        for name, batch_fn, pattern in TBE_BOUNDS + TBE_STRUCTURE:
            add(f"{tag}-fatal-{name}", tbe_raises(layout, backend, BoundsCheckMode.FATAL, batch_fn, pattern))
        if layout != "bf16state":
            for name, batch_fn, _ in TBE_BOUNDS:
                add(f"{tag}-warning-{name}", tbe_warns(layout, backend, batch_fn))
            for name, batch_fn, pattern in TBE_STRUCTURE[:4]:
                add(f"{tag}-warning-{name}",
                    tbe_raises(layout, backend, BoundsCheckMode.WARNING, batch_fn, pattern))
        add(f"{tag}-grad_1e20_overflow_counted", tbe_overflow(layout, backend))


# ------------------------------------------------------------------------------ load_state_dict
def shifted_state(tbe) -> dict:
    """A valid state dict of ``tbe`` whose every entry differs from the module's (a half-applied load
    shows)."""
    sd = {k: v.clone() for k, v in tbe.state_dict().items()}
    shift = {"weights_dev": 0.5, "accum_dev": 0.25, "linear_dev": -0.25}
    for k, v in sd.items():
        sd[k] = v + shift[k] if k in shift else v + 5
    return sd


def lsd_raises(layout: str, mutate: Callable[[dict], None], pattern: str, strict: bool = True) -> Callable:
    """``load_state_dict`` of a state dict that differs from the module in every entry and holds one
    bad entry (most of them in the entries loaded last): an error naming it, every buffer unchanged."""
    def case():
        tbe = make_tbe(layout, "cpp", BoundsCheckMode.FATAL)
        sd = shifted_state(tbe)
        mutate(sd)
        before = module_bits(tbe)
        expect_error(lambda: tbe.load_state_dict(sd, strict=strict), pattern)
        assert_module_unchanged(before, tbe)
    return case


def sd_put(key: str, index: int, value: float) -> Callable[[dict], None]:
    def mutate(sd):
        sd[key][index] = value
    return mutate


def sd_set(key: str, fn: Callable) -> Callable[[dict], None]:
    def mutate(sd):
        sd[key] = fn(sd[key])
    return mutate


def sd_del(key: str) -> Callable[[dict], None]:
    def mutate(sd):
        del sd[key]
    return mutate


LSD_CASES = [
    ("linear_wrong_shape", sd_set("linear_dev", lambda t: t[:-1]), r"linear"),
    ("accum_wrong_shape", sd_set("accum_dev", lambda t: torch.cat([t, t[:1]])), r"accum"),
    ("iter_wrong_shape", sd_set("iter", lambda t: torch.cat([t, t])), r"iter"),
    ("missing_linear", sd_del("linear_dev"), r"linear_dev"),
    ("missing_iter", sd_del("iter"), r"iter"),
    ("unexpected_key", lambda sd: sd.__setitem__("bogus_key", torch.zeros(1)), r"bogus_key"),
    ("linear_meta", sd_set("linear_dev", lambda t: t.to("meta")), names_device("linear_dev")),
    ("iter_meta", sd_set("iter", lambda t: t.to("meta")), names_device("iter")),
    ("accum_minus_1", sd_put("accum_dev", 3, -1.0), r"accum"),
    ("accum_nan", sd_put("accum_dev", -1, NAN), r"accum"),
    ("accum_inf", sd_put("accum_dev", -1, INF), r"accum"),
    ("linear_inf", sd_put("linear_dev", -1, INF), r"linear"),
    ("linear_nan", sd_put("linear_dev", 0, NAN), r"linear"),
    ("linear_complex", sd_set("linear_dev", lambda t: t.to(torch.complex64)), r"linear|complex|dtype"),
    ("accum_string_value", sd_set("accum_dev", lambda t: "not a tensor"), r"accum"),
]
LSD_STORED_ONLY = [
    ("weights_nan", sd_put("weights_dev", -1, NAN), r"weights"),
    ("weights_inf", sd_put("weights_dev", 0, -INF), r"weights"),
]


def _register_lsd_cases() -> None:
    for layout in ("stored", "lean"):
        extra = LSD_STORED_ONLY if layout == "stored" else []
        for name, mutate, pattern in LSD_CASES + extra:
            add(f"load_state_dict-{layout}-{name}", lsd_raises(layout, mutate, pattern))


# ------------------------------------------------------------------------------ import_ftrl_tables
def _dmp(layout: Optional[dict]):
    """A one-process (gloo) DMP with the two FTRL tables of tests/dist_scenarios.py, one step trained."""
    import torch.distributed as dist
    import dist_scenarios as sc
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dmp = sc._ck_model(1, "tw", layout)
    sc._ck_train(dmp, None, 0, 1, range(1))
    return dmp


def import_raises(layout: Optional[dict], corrupt: Callable[[dict], None], pattern: str) -> Callable:
    """A file that differs from the model in every value and holds one bad slot (the last written
    one unless said): ``ValueError`` naming it, every local shard of the model bitwise unchanged."""
    def case():
        from reliability_scenarios import assert_same, local_snapshot
        from torchrec_ftrl.checkpoint import export_ftrl_tables, import_ftrl_tables
        dmp = _dmp(layout)
        with tempfile.TemporaryDirectory() as work:
            good, bad = os.path.join(work, "good.npz"), os.path.join(work, "bad.npz")
            export_ftrl_tables(dmp, good)
            arrays = {k: v.copy() for k, v in np.load(good).items()}
            for k in arrays:   # the file's states stay valid (accum >= 0), and all differ
                arrays[k] = arrays[k] * 2 + (0.5 if k.endswith("/accum") else 0.25)
            corrupt(arrays)
            np.savez(bad, **arrays)
            before = local_snapshot(dmp)
            expect_error(lambda: import_ftrl_tables(dmp, bad), pattern)
            assert_same(before, local_snapshot(dmp), "import_ftrl_tables")
    return case


def file_put(key: str, value: float, index=-1) -> Callable[[dict], None]:
    def corrupt(arrays):
        arrays[key].reshape(-1)[index] = value
    return corrupt


def file_set(key: str, fn: Callable) -> Callable[[dict], None]:
    def corrupt(arrays):
        arrays[key] = fn(arrays[key])
    return corrupt


ROWWISE = dict(ftrl_weights="derived", ftrl_accumulator="rowwise")
IMPORT_CASES = [
    ("last_linear_nan", None, file_put("c_b/linear", NAN), r"c_b/linear|linear"),
    ("last_linear_inf", None, file_put("c_b/linear", INF), r"c_b/linear|linear"),
    ("last_accum_minus_1", None, file_put("c_b/accum", -1.0), r"c_b/accum|accum"),
    ("last_accum_nan", None, file_put("c_b/accum", NAN), r"c_b/accum|accum"),
    ("last_weight_inf", None, file_put("c_b", INF), r"c_b"),
    ("last_linear_complex", None, file_set("c_b/linear", lambda a: a.astype(np.complex64)),
     r"c_b/linear|complex|dtype"),
    ("last_linear_wrong_shape", None, file_set("c_b/linear", lambda a: a[:-1]), r"c_b/linear"),
    ("rowwise_accum_wrong_shape", ROWWISE, file_set("c_b/accum", lambda a: np.repeat(a.reshape(len(a), -1), 8, 1)),
     r"row-?wise"),
    ("rowwise_last_linear_nan", ROWWISE, file_put("c_b/linear", NAN), r"c_b/linear|linear"),
]


def _register_import_cases() -> None:
    for name, layout, corrupt, pattern in IMPORT_CASES:
        add(f"import_ftrl_tables-{name}", import_raises(layout, corrupt, pattern))


_register_op_cases()
_register_count_cases()
_register_tbe_cases()
_register_lsd_cases()
_register_import_cases()


# ------------------------------------------------------------------------------ the fork server
def _churn() -> None:
    """Allocates and frees again after the case, so a heap it corrupted aborts here, in the child."""
    for n in (1, 3, 17, 100, 4096, 1 << 16, 1 << 20):
        torch.empty(n).fill_(1.0)
        bytearray(n)


def run_child(name: str, w: int) -> None:
    """In the forked child: run case ``name``, write its report to fd ``w``, exit 0."""
    os.dup2(2, 1)   # stdout is the server's channel
    signal.alarm(CASE_TIMEOUT_S)
    try:
        CASES[name]()
        report = {"ok": True, "error": "", "raised": RAISED[-1:]}
    except BaseException as e:   # noqa: BLE001 (the report names whatever happened)
        report = {"ok": False, "error": "".join(traceback.format_exception_only(type(e), e)).strip()[:2000]}
    os.write(w, json.dumps(report).encode())
    os.close(w)
    _churn()
    os._exit(0)


def run_case(name: str) -> dict:
    """Fork, run ``name`` in the child, wait: ``{"ok", "error", "status"}`` (``status``: ``"exit 0"``,
    ``"exit 3"``, ``"signal SIGSEGV"``)."""
    start = time.monotonic()
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            run_child(name, w)
        finally:
            os._exit(70)
    os.close(w)
    chunks = []
    while True:
        ready, _, _ = select.select([r], [], [], CASE_TIMEOUT_S + 10)
        data = os.read(r, 65536) if ready else b""
        if not data:
            break
        chunks.append(data)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    report = json.loads(b"".join(chunks)) if chunks else {"ok": False, "error": "the child sent no report"}
    if os.WIFSIGNALED(status):
        report["status"] = f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    else:
        report["status"] = f"exit {os.WEXITSTATUS(status)}"
    report["seconds"] = round(time.monotonic() - start, 3)
    return report


def serve() -> None:
    """Read case names on stdin; write each one's :func:`run_case` report as a JSON line."""
    torch.set_num_threads(1)        # no OpenMP pool in the parent: forked children start clean
    cpp_backend.load_extension()
    import dist_scenarios  # noqa: F401  (the import cases' modules, imported once)
    import reliability_scenarios  # noqa: F401
    from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: F401
    gc.collect()
    gc.freeze()     # the children's collections skip the server's objects (no copy-on-write of them)
    print(json.dumps({"ready": len(CASES)}), flush=True)
    for line in sys.stdin:
        name = line.strip()
        if name:
            print(json.dumps(dict(run_case(name), name=name)), flush=True)


if __name__ == "__main__":
    serve()
