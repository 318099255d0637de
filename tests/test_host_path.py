"""The C++ host path of the eager CUDA training step (``torchrec_ftrl.kernels.cuda.host``).

On the CPU (CI): the library builds against this torch, and its specialisation rule (the key under
which a compiled Triton kernel is registered) equals the Python rule Triton's own rule is stated in,
over tensors of every dtype and alignment and integers of every class.

Tests marked ``cuda``: training steps through the C++ path (the one autograd op ``train_lookup``, and
its two directions called from the TBE's Python autograd node) are bit for bit those of the Python path
(every row layout, fp32 and bf16 state, SUM / MEAN / NONE pooling, per-sample weights, WARNING /
FATAL, misaligned user tensors, a gradient long enough to cut runs), and the C++ path is the one
that ran after the first step of each configuration.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import bits, cuda, needs_cuda

pytest.importorskip("triton")

from torchrec_ftrl import FTRLTableBatchedEmbeddingBags  # noqa: E402
from torchrec_ftrl.fbgemm_enums import BoundsCheckMode, PoolingMode  # noqa: E402
from torchrec_ftrl.kernels.cuda import host  # noqa: E402

KNOBS = dict(learning_rate=0.05, ftrl_l1_reg=0.002, ftrl_l2_reg=0.01, ftrl_beta=0.3)
SPECS = [(1000, 64), (300, 32), (5000, 64)]
SPECS_NONE = [(1000, 64), (300, 64), (5000, 64)]   # sequence (NONE) tables share one dim
FMAP = [0, 1, 2, 2]


def test_signature_rule_matches_the_library():
    """C++ ``signature_of`` == :func:`host.signature_of`, character for character, and both state
    Triton's rule: dtype and 16-byte alignment of a tensor; width and 1 / multiple of 16 / other of an
    integer."""
    ops = host.load()
    assert ops is not None
    base = torch.zeros(64, dtype=torch.int64)
    tensors = [base, base[1:], base[2:], torch.zeros(9), torch.zeros(9)[3:], torch.zeros(4, dtype=torch.bfloat16),
               torch.zeros(4, dtype=torch.float16)[1:], torch.zeros(4, dtype=torch.int32)[4:],
               torch.zeros(3, dtype=torch.uint8), torch.zeros(3, dtype=torch.bool)]
    ints = [0, 1, 2, 15, 16, 17, -1, -16, 2 ** 31 - 1, 2 ** 31, -(2 ** 31), -(2 ** 31) - 1, 48]
    order = "T" * len(tensors) + "I" * len(ints)
    args = tuple(tensors) + tuple(ints)
    expected = ("lA" + "lU" + "lA" + "fA" + "fU" + "bA" + "hU" + "iA" + "uA" + "oA"
                + "ID" + "I1" + "IN" + "IN" + "ID" + "IN" + "IN" + "ID" + "IN" + "JD" + "ID" + "JN" + "ID")
    assert host.signature_of(args) == expected
    assert ops.signature(tensors, ints, order) == expected
    mixed = (base[1:], 7, torch.zeros(5), 32)
    assert ops.signature([base[1:], torch.zeros(5)], [7, 32], "TITI") == host.signature_of(mixed) == "lUINfAID"


def test_signature_of_refuses_other_kinds():
    assert host.signature_of((torch.zeros(2, dtype=torch.float64),)) is None
    assert host.signature_of((1.5,)) is None
    assert host.signature_of((None,)) is None


# ---------------------------------------------------------------------------- CUDA
def _case(seed: int, B: int, max_len: int, psw: bool, hot: bool, misalign: bool, specs):
    rng = np.random.RandomState(seed)
    lengths, idx = [], []
    for f, t in enumerate(FMAP):
        for _ in range(B):
            L = int(rng.randint(0, max_len + 1))
            lengths.append(L)
            rows = specs[t][0]
            ids = rng.randint(0, rows, L)
            if hot:
                ids = np.where(rng.rand(L) < 0.7, rng.randint(0, 3, L), ids)
            idx.extend(int(i) for i in ids)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64, device="cuda")
    indices = torch.tensor(idx, dtype=torch.int64, device="cuda")
    weights = torch.tensor(rng.rand(len(idx)) + 0.5, dtype=torch.float32, device="cuda") if psw else None
    if misalign:   # views one element into a larger buffer: addresses not multiples of 16
        indices, offsets = (torch.cat([t[:1], t])[1:] for t in (indices, offsets))
        weights = None if weights is None else torch.cat([weights[:1], weights])[1:]
    return indices, offsets, weights


def _train(enabled: bool, layout, pooling, psw: bool, mode, state_dtype, steps: int, misalign: bool):
    host.ENABLED = enabled
    torch.manual_seed(0)
    specs = SPECS_NONE if pooling == PoolingMode.NONE else SPECS
    m = FTRLTableBatchedEmbeddingBags(
        specs, feature_table_map=FMAP, pooling_mode=pooling, bounds_check_mode=mode, device="cuda",
        ftrl_weights=layout[0], ftrl_accumulator=layout[1],
        optimizer_state_dtypes={"accum": state_dtype, "linear": state_dtype}, **KNOBS)
    with torch.no_grad():
        m.linear_dev.uniform_(-0.1, 0.1)
        m.accum_dev.uniform_(0.0, 0.5)
    outs = []
    for step in range(steps):
        indices, offsets, weights = _case(step, B=96, max_len=40, psw=psw, hot=True, misalign=misalign,
                                          specs=specs)
        out = m(indices, offsets, weights)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(step)).cuda()
        (out * g).sum().backward()
        outs.append(out.detach().clone())
    torch.cuda.synchronize()
    return outs, [t.detach().clone() for t in (m.weights_dev, m.accum_dev, m.linear_dev)]


LAYOUTS = [("stored", "elementwise"), ("stored", "rowwise"), ("derived", "elementwise"), ("derived", "rowwise")]
CASES = [
    # (pooling, psw, mode, state dtype, misalign)
    (PoolingMode.SUM, False, BoundsCheckMode.WARNING, torch.float32, False),
    (PoolingMode.MEAN, True, BoundsCheckMode.FATAL, torch.float32, True),
    (PoolingMode.SUM, True, BoundsCheckMode.IGNORE, torch.bfloat16, False),
    (PoolingMode.NONE, False, BoundsCheckMode.WARNING, torch.bfloat16, True),
]


@cuda
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=["sum-warn", "mean-psw-fatal-misaligned", "sum-psw-ignore-bf16",
                                             "none-warn-bf16-misaligned"])
@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_cuda_host_path_equals_python_path(layout, case):
    pooling, psw, mode, state_dtype, misalign = case
    try:
        host.clear()
        host.STATS.clear()
        base = host.stats()["cpp_backward"]   # the C++ lookups' count is the process's
        want = _train(False, layout, pooling, psw, mode, state_dtype, 4, misalign)
        assert host.stats()["cpp_forward"] == host.stats()["cpp_backward"] - base == 0
        got = _train(True, layout, pooling, psw, mode, state_dtype, 4, misalign)
    finally:
        host.ENABLED = True
    # the first step of a configuration runs in Python and registers its kernels; the later ones
    # (the same specialisations) in C++
    got_stats = host.stats()
    assert got_stats["cpp_forward"] >= 2 and got_stats["cpp_backward"] - base >= 2, dict(got_stats)
    for w, g in zip(want[0] + want[1], got[0] + got[1]):
        assert w.dtype == g.dtype and w.shape == g.shape
        assert torch.equal(bits(w), bits(g))


@cuda
@needs_cuda
def test_cuda_split_host_path_equals_python_path():
    """With the one autograd op off (``host.LOOKUP_OP``), the two C++ calls under the TBE's Python
    autograd node give the same bits as well."""
    layout, (pooling, psw, mode, state_dtype, misalign) = LAYOUTS[3], CASES[1]
    try:
        host.clear()
        want = _train(False, layout, pooling, psw, mode, state_dtype, 4, misalign)
        host.LOOKUP_OP = False
        host.STATS.clear()
        got = _train(True, layout, pooling, psw, mode, state_dtype, 4, misalign)
    finally:
        host.ENABLED, host.LOOKUP_OP = True, True
    assert host.STATS["cpp_forward"] >= 2 and host.STATS["cpp_backward"] >= 2, dict(host.STATS)
    for w, g in zip(want[0] + want[1], got[0] + got[1]):
        assert torch.equal(bits(w), bits(g))


def test_kinds_of_reads_the_compiled_signature():
    """Pointers, int32, int64 and specialised constants (not passed) by the compiled kernel's
    signature; a kernel needing what ``cuLaunchKernel`` alone does not give is refused (None)."""
    from types import SimpleNamespace as NS

    kernel = NS(arg_names=["x_ptr", "n", "big", "one", "BLOCK"])
    md = dict(num_ctas=1, global_scratch_size=0, profile_scratch_size=0, launch_pdl=False,
              launch_cooperative_grid=False)
    sig = {"x_ptr": "*fp32", "n": "i32", "big": "i64", "one": "constexpr", "BLOCK": "constexpr"}
    compiled = NS(metadata=NS(**md), src=NS(signature=sig))
    assert host.kinds_of(kernel, compiled, 4) == "Pilx"
    for field, value in (("num_ctas", 2), ("global_scratch_size", 64), ("launch_pdl", True)):
        assert host.kinds_of(kernel, NS(metadata=NS(**{**md, field: value}), src=NS(signature=sig)), 4) is None
    assert host.kinds_of(kernel, NS(metadata=NS(**md), src=NS(signature={**sig, "n": "fp32"})), 4) is None
    # a runtime parameter past the positional arguments cannot be passed
    assert host.kinds_of(kernel, NS(metadata=NS(**md), src=NS(signature={**sig, "BLOCK": "i32"})), 4) is None


def test_clear_makes_plans_anew(monkeypatch):
    """After :func:`host.clear` the Triton backend's plans are rebuilt from TUNING as it is then (an
    entry edited in place included), and a replaced TUNING entry makes a new plan by itself."""
    from torchrec_ftrl.kernels.cuda import backend as tb

    accum = linear = torch.zeros(8)
    args = ("bwd", None, accum, linear, True, 0, 64, (64, 64), 100, False, (True, False))
    first = tb._host_plan(*args)
    assert tb._host_plan(*args) is first
    monkeypatch.setitem(tb.TUNING, "combine_cp", 8)            # replaced: a new plan
    replaced = tb._host_plan(*args)
    assert replaced is not first and replaced.combine_cp == 8 and replaced.id != first.id
    layouts = {**tb.TUNING["layouts"], "derived/rowwise/fp32/fp32": {"fwd": (512, ""), "seg_launch": (512,)}}
    monkeypatch.setitem(tb.TUNING, "layouts", layouts)
    before = tb._host_plan(*args)
    layouts["derived/rowwise/fp32/fp32"]["seg_launch"] = (4096,)  # edited in place: seen after clear()
    assert tb._host_plan(*args) is before
    host.clear()
    after = tb._host_plan(*args)
    assert after is not before and after.update_g != before.update_g


def test_plan_ids_are_not_reused_after_clear():
    """A plan id names one configuration for the whole process: a configuration first seen after
    :func:`host.clear` gets a number no earlier configuration had (a lookup whose backward was made
    before the clear must not find another configuration's kernels)."""
    a = host.plan_id(("test_plan_ids", "a"))
    assert host.plan_id(("test_plan_ids", "a")) == a
    host.clear()
    b = host.plan_id(("test_plan_ids", "b"))
    assert b != a and host.plan_id(("test_plan_ids", "a")) not in (a, b)


def test_backward_fallback_runs_again_for_a_retained_graph(monkeypatch):
    """The Python fallback of a C++ training lookup's backward reads its arguments by the node's
    token and leaves them there: a graph kept by ``retain_graph=True`` runs the backward again
    (as the Python autograd node does), and the entry goes with the token."""
    import gc

    from torchrec_ftrl.kernels.cuda import backend as tb

    calls = []
    monkeypatch.setattr(tb, "_backward_update_eager", lambda *a: calls.append(a))
    token, offsets, fixed = torch.empty(0), torch.tensor([0, 1]), torch.tensor([0, 2])
    raw = True
    saved_knobs, now_knobs = (torch.zeros(3), False, False), (torch.ones(3), True, True)
    tb._fallbacks[token] = ((None,) * 12 + (offsets,) + (None,) * 5 + saved_knobs + (None, None, raw)
                            + (lambda: now_knobs,))
    for _ in range(2):
        tb._backward_fallback(token, torch.ones(2), *(torch.empty(0),) * 4, fixed, False)
    assert len(calls) == 2 and all(a[12] is fixed and a[24] is True for a in calls)
    assert all(a[19:22] == saved_knobs for a in calls)     # knobs unchanged since the forward
    tb._backward_fallback(token, torch.ones(2), *(torch.empty(0),) * 4, fixed, True)   # changed
    assert calls[-1][19:22] == now_knobs
    del token
    gc.collect()
    assert len(tb._fallbacks) == 0


def test_set_hp_moves_the_knob_version():
    """The TBE counts its knob changes in ``_hp_version`` (what the C++ lookup's backward compares),
    and an unchanged learning rate (TorchRec sets it every step) counts nothing."""
    tbe = FTRLTableBatchedEmbeddingBags([(10, 4)], **KNOBS)
    v0 = int(tbe._hp_version[0])
    tbe.set_learning_rate(KNOBS["learning_rate"])
    assert int(tbe._hp_version[0]) == v0
    tbe.set_learning_rate(0.5)
    assert int(tbe._hp_version[0]) == v0 + 1 and tbe._current_hp().learning_rate == 0.5


def test_recording_is_per_thread():
    """A recording on one thread neither sees another thread's launches nor stays installed after
    overlapping recordings on two threads end out of order."""
    import threading

    from torchrec_ftrl.kernels.cuda import launch

    entered, leave_a = threading.Event(), threading.Event()

    def a():
        with launch.recording() as records:
            entered.set()
            leave_a.wait(5)
            assert records == []

    t = threading.Thread(target=a)
    t.start()
    entered.wait(5)
    with launch.recording() as mine:
        leave_a.set()
        t.join(5)
    assert mine == [] and getattr(launch._recording, "records", None) is None
