"""The compiled CPU kernel ("cpp") in every row layout (stored / derived weights, element-wise /
row-wise ``accum``, each state fp32 or bf16), called through the ops' calls
(:mod:`torchrec_ftrl.kernels.calls`) on :class:`~torchrec_ftrl.kernels.batch.TableArrays` allocated
here: against the float64 oracle (``tests/reference.py``) step by step, against the PyTorch backend
over several steps, derived weights bit for bit against stored ones from a zero start, and bf16
states bit for bit against the PyTorch backend wherever the two backends' fp32 updates agree.

The two backends' fp32 arithmetic is not bitwise the same: torch's CPU fp32 ``sqrt`` is not
correctly rounded for about 16% of the inputs (the C++ kernel's is), and the gradient sums of
row-wise ``accum`` add in another order. The comparisons with the PyTorch backend therefore use a
tolerance, and the bitwise one compares only where the fp32 results agree.

Batches: mixed dims in one TBE (4, 12 and 16: below, between and at the kernel's 16 lanes), a
table read by two features, duplicate rows, empty bags; SUM with per-sample weights, MEAN, VBE,
NONE; one bag's output gradient NaN (its rows are skipped and counted).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.fbgemm_enums import PoolingMode, SparseType
from torchrec_ftrl.kernels import backend, calls
from torchrec_ftrl.kernels.cpu import backend as cpp_backend
from torchrec_ftrl.kernels.pytorch import rows as torch_backend
from torchrec_ftrl.kernels.batch import TableArrays
from torchrec_ftrl.state_dtype import store_state

from conftest import bits, index_tables, reference_forward
from reference import (ftrl_reference_step, ftrl_reference_step_rowwise, ftrl_reference_weight,
                       reference_knobs)

F32, BF16 = torch.float32, torch.bfloat16
SPECS = ((7, 4), (5, 12), (6, 16))
NONE_SPECS = ((7, 8), (5, 8), (6, 8))        # PoolingMode.NONE: one dim
FMAP = (0, 1, 2, 1)
VBE = [[2, 1], [1, 2], [3, 0], [1, 1]]       # bags per feature per rank
B = 3                                        # bags per feature without VBE
KNOBS = dict(learning_rate=0.3, ftrl_l1_reg=0.05, ftrl_l2_reg=0.01, ftrl_beta=0.5, ftrl_l2_shrinkage=0.02)
LAYOUTS = [("stored", "elementwise"), ("stored", "rowwise"), ("derived", "elementwise"),
           ("derived", "rowwise")]
STATES = {"fp32": (F32, F32), "bf16": (BF16, BF16), "bf16-accum": (BF16, F32), "bf16-linear": (F32, BF16)}
CASES = ("sum-psw", "mean", "vbe", "none")
POOLING = {"sum-psw": PoolingMode.SUM, "mean": PoolingMode.MEAN, "vbe": PoolingMode.SUM,
           "none": PoolingMode.NONE}
STEPS = 3


@dataclasses.dataclass
class Inputs:
    """One batch of a case: the raw inputs (for the oracle) and the kernel's ``TBEBatch``."""
    indices: torch.Tensor
    offsets: torch.Tensor
    psw: torch.Tensor | None
    vbe: list | None
    batch: object


def _maker(case, **knobs):
    """A stored fp32 TBE of the case's specs and pooling: it lays batches out (``_make_batch``) and
    holds the hyperparameters; its own arrays are never used."""
    return FTRLTableBatchedEmbeddingBags(list(NONE_SPECS if case == "none" else SPECS),
                                         feature_table_map=list(FMAP), pooling_mode=POOLING[case],
                                         backend="cpp", **{**KNOBS, **knobs})


def _inputs(m, case, step) -> Inputs:
    """Bags of 0-4 rows (bag 0 of every feature holds row 1 twice, bag 1 is empty), per-sample
    weights for ``sum-psw``, VBE sizes for ``vbe``."""
    g = torch.Generator().manual_seed(100 + step)
    specs = NONE_SPECS if case == "none" else SPECS
    sizes = [sum(v) for v in VBE] if case == "vbe" else [B] * len(FMAP)
    bags, lengths = [], []
    for f, nb in enumerate(sizes):
        rows = specs[FMAP[f]][0]
        for b in range(nb):
            n = 0 if b == 1 else int(torch.randint(1, 5, (1,), generator=g))
            idx = torch.randint(0, rows, (n,), generator=g)
            if b == 0:
                idx[:2] = 1
            bags.append(idx)
            lengths.append(n)
    indices = torch.cat(bags)
    offsets = torch.tensor([0] + np.cumsum(lengths).tolist())
    psw = torch.rand(indices.numel(), generator=g) + 0.5 if case == "sum-psw" else None
    vbe = VBE if case == "vbe" else None
    batch = dataclasses.replace(m._make_batch(indices, offsets, psw, vbe), step=torch.tensor([step]))
    return Inputs(indices, offsets, psw, vbe, batch)


def _arrays(layout, states, specs, wdtype=F32, seed=0) -> TableArrays:
    """Random states exact in bf16 (so fp32 and bf16 states can start equal); n in [0.05, 2]."""
    weights, accumulator = layout
    g = torch.Generator().manual_seed(seed)
    total, rows = sum(r * d for r, d in specs), sum(r for r, _ in specs)
    n = (torch.rand(rows if accumulator == "rowwise" else total, generator=g) * 1.95 + 0.05).to(BF16)
    z = torch.randn(total, generator=g).to(BF16)
    w = (torch.randn(total, generator=g) * 0.3).to(wdtype) if weights == "stored" else None
    return TableArrays(w, n.to(states[0]), z.to(states[1]), accumulator == "rowwise")


def _clone(a: TableArrays, states=None) -> TableArrays:
    accum_dtype, linear_dtype = states or (a.accum.dtype, a.linear.dtype)
    return TableArrays(None if a.weights is None else a.weights.clone(), a.accum.to(accum_dtype, copy=True),
                       a.linear.to(linear_dtype, copy=True), a.rowwise)


def _grad(m, inputs, out_numel, dtype=F32, seed=0):
    """Random output gradient with one NaN: in the output of the first index of feature 2."""
    g = torch.randn(out_numel, generator=torch.Generator().manual_seed(seed))
    first = int(inputs.offsets[2 * B if inputs.vbe is None else sum(map(sum, VBE[:2]))])
    g[int(inputs.batch.index_out_offset()[first])] = float("nan")
    return g.to(dtype)


def _forward(kernels, arrays, batch, out_dtype, hp):
    """The lookup of ``kernels``: ``cpp_backend`` through the ops' calls (the compiled kernel),
    ``torch_backend`` its vectorised function."""
    if kernels is torch_backend:
        return torch_backend.forward(arrays, batch, out_dtype, hp)
    return calls.forward(backend._load("cpp"), arrays, batch, out_dtype, hp)


def _backward_update_(kernels, arrays, batch, grad, hp, nonfinite_rows):
    """The fused update of ``kernels`` (see :func:`_forward`), no training forward's context."""
    if kernels is torch_backend:
        torch_backend.backward_update_(arrays, batch, grad, hp, nonfinite_rows)
    else:
        calls.backward_update_(backend._load("cpp"), arrays, batch, None, grad, hp, nonfinite_rows)


def _step(kernels, arrays, m, inputs, grad):
    """Forward, then the fused update; returns (fp32 output, rows skipped as non-finite)."""
    out = _forward(kernels, arrays, inputs.batch, F32, m.hyperparams)
    skipped = torch.zeros(1, dtype=torch.int64)
    _backward_update_(kernels, arrays, inputs.batch, grad, m.hyperparams, skipped)
    return out, int(skipped)


# ------------------------------------------------------------------------------- float64 oracle


def _tables64(a: TableArrays, specs):
    """Per table float64 copies ``[w or None, z [R, D], n [R, D] or [R]]`` of the arrays."""
    def f64(buf, start, shape):
        return buf[start:start + int(np.prod(shape))].double().numpy().reshape(shape)

    out, element, row = [], 0, 0
    for rows, dim in specs:
        w = None if a.weights is None else f64(a.weights, element, (rows, dim))
        n = f64(a.accum, row, (rows,)) if a.rowwise else f64(a.accum, element, (rows, dim))
        out.append([w, f64(a.linear, element, (rows, dim)), n])
        element += rows * dim
        row += rows
    return out


def _oracle(state, m, case, inputs, grad, rowwise):
    """The float64 expected step from ``state`` (:func:`_tables64`): the output, the new state, and
    per table the rows updated and those skipped (non-finite summed gradient)."""
    kn = reference_knobs(m.hyperparams)
    w_old = [w if w is not None else ftrl_reference_weight(z, n[:, None] if rowwise else n, **kn)
             for w, z, n in state]
    tables = [torch.tensor(w, requires_grad=True) for w in w_old]
    psw = None if inputs.psw is None else inputs.psw.double()
    out = reference_forward(tables, FMAP, POOLING[case], inputs.indices, inputs.offsets, psw, inputs.vbe)
    (out * grad.double().reshape(out.shape)).sum().backward()
    sizes = [sum(v) for v in VBE] if inputs.vbe is not None else [B] * len(FMAP)
    idx_table = index_tables(FMAP, sizes, inputs.offsets)
    idx = inputs.indices.numpy()
    new, updated, skipped = [], [], []
    for t, ((w, z, n), wo, tab) in enumerate(zip(state, w_old, tables)):
        touched = np.unique(idx[idx_table == t])
        g = tab.grad.numpy()[touched]
        ok = np.isfinite(g).all(axis=1)
        rows, g = touched[ok], g[ok]
        step = ftrl_reference_step_rowwise if rowwise else ftrl_reference_step
        w_new, z_new, n_new = step(wo[rows], z[rows], n[rows], g, **kn)
        w2, z2, n2 = wo.copy(), z.copy(), n.copy()
        w2[rows], z2[rows], n2[rows] = w_new, z_new, n_new
        new.append([w2, z2, n2])
        updated.append(rows)
        skipped.append(touched[~ok])
    return out.detach(), new, updated, skipped


def _tol(dtype):
    """(rtol, atol) of a kernel value against float64: one fp32 step, or a stochastic rounding to
    bf16 / fp16 (an error below one ulp: 2^-7 / 2^-10 of the value) on top."""
    return {F32: (2e-5, 2e-6), BF16: (2.0 ** -7, 1e-6), torch.float16: (2.0 ** -10, 1e-6)}[dtype]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("states", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_steps_match_the_float64_oracle(layout, states, case):
    _check_oracle(layout, STATES[states], case)


@pytest.mark.parametrize("states", ["bf16-accum", "bf16-linear"])
@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_one_bf16_state_matches_the_float64_oracle(layout, states):
    _check_oracle(layout, STATES[states], "mean")


@pytest.mark.parametrize("accumulator", ["elementwise", "rowwise"])
def test_fp16_stored_weights_match_the_float64_oracle(accumulator):
    _check_oracle(("stored", accumulator), STATES["fp32"], "sum-psw", wdtype=torch.float16)


@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_pow_learning_rate_power_matches_the_float64_oracle(layout):
    """p != -0.5: the pow instantiations."""
    _check_oracle(layout, STATES["fp32"], "mean", ftrl_learning_rate_power=-0.3)


def _check_oracle(layout, states, case, wdtype=F32, **knobs):
    m = _maker(case, **knobs)
    specs = NONE_SPECS if case == "none" else SPECS
    arrays = _arrays(layout, states, specs, wdtype)
    rowwise = layout[1] == "rowwise"
    for step in range(STEPS):
        inputs = _inputs(m, case, step)
        before = _tables64(arrays, specs)
        grad = _grad(m, inputs, inputs.batch.out_numel, seed=step)
        out, skipped = _step(cpp_backend, arrays, m, inputs, grad)
        want_out, want, updated, flagged = _oracle(before, m, case, inputs, grad, rowwise)
        np.testing.assert_allclose(out.numpy(), want_out.reshape(-1).numpy(), rtol=1e-5, atol=1e-6)
        assert skipped == sum(len(f) for f in flagged) > 0
        got = _tables64(arrays, specs)
        for t in range(len(specs)):
            for k, name, dtype in ((0, "w", wdtype), (1, "z", states[1]), (2, "n", states[0])):
                if got[t][k] is None:
                    continue
                rows = updated[t]
                rtol, atol = _tol(dtype)
                np.testing.assert_allclose(got[t][k][rows], want[t][k][rows], rtol=rtol, atol=atol,
                                           err_msg=f"step {step} table {t} {name}")
                kept = np.setdiff1d(np.arange(len(got[t][k])), rows)   # untouched and skipped rows
                np.testing.assert_array_equal(got[t][k][kept], before[t][k][kept])


# ------------------------------------------------------------------------- the PyTorch backend


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("states", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_steps_match_the_torch_backend(layout, states, case):
    m = _maker(case)
    specs = NONE_SPECS if case == "none" else SPECS
    ours = _arrays(layout, STATES[states], specs)
    theirs = _clone(ours)
    rtol = 2e-5 if states == "fp32" else 2.0 ** -6      # bf16: one ulp apart where an SR input differs
    for step in range(STEPS):
        inputs = _inputs(m, case, step)
        grad = _grad(m, inputs, inputs.batch.out_numel, seed=step)
        out_c, skipped_c = _step(cpp_backend, ours, m, inputs, grad)
        out_t, skipped_t = _step(torch_backend, theirs, m, inputs, grad)
        torch.testing.assert_close(out_c, out_t, rtol=rtol, atol=1e-6)
        assert skipped_c == skipped_t > 0
    for name in ("weights", "accum", "linear"):
        a, b = getattr(ours, name), getattr(theirs, name)
        if a is not None:
            torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=1e-6, msg=name)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_half_outputs_and_gradients_match_the_torch_backend(layout, out_dtype):
    """fp16 / bf16 forward output and output gradient (the update reads the gradient in its dtype)."""
    m = _maker("vbe")
    ours = _arrays(layout, STATES["fp32"], SPECS)
    theirs = _clone(ours)
    inputs = _inputs(m, "vbe", 0)
    outs = [_forward(b, a, inputs.batch, out_dtype, m.hyperparams) for b, a in
            ((cpp_backend, ours), (torch_backend, theirs))]
    assert outs[0].dtype == out_dtype
    torch.testing.assert_close(outs[0], outs[1])
    grad = _grad(m, inputs, inputs.batch.out_numel, dtype=out_dtype)
    for kernels, arrays in ((cpp_backend, ours), (torch_backend, theirs)):
        _backward_update_(kernels, arrays, inputs.batch, grad, m.hyperparams,
                          torch.zeros(1, dtype=torch.int64))
    for name in ("weights", "accum", "linear"):
        if getattr(ours, name) is not None:
            torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_bf16_states_are_the_torch_backend_bits_where_fp32_agrees(layout):
    """One step from one bf16-exact state: the fp32-state runs of both backends give the values the
    bf16 runs round; wherever those agree bit for bit, the two backends' bf16 states agree bit for
    bit (the same stochastic-rounding hash: row key, column 0 for a row-wise accum, step), and the
    C++ bf16 state is the independent rounding ``state_dtype.store_state`` of its fp32 value."""
    m = _maker("mean")
    start = _arrays(layout, STATES["bf16"], SPECS, seed=3)
    inputs = _inputs(m, "mean", 5)
    grad = _grad(m, inputs, inputs.batch.out_numel)
    fp32 = {b: _clone(start, STATES["fp32"]) for b in (cpp_backend, torch_backend)}
    bf16 = {b: _clone(start) for b in (cpp_backend, torch_backend)}
    for b in (cpp_backend, torch_backend):
        _step(b, fp32[b], m, inputs, grad)
        _step(b, bf16[b], m, inputs, grad)
    rows = sum(r for r, _ in SPECS)
    row_key = torch.cat([torch.arange(r).repeat_interleave(d) for r, d in SPECS]) + torch.cat(
        [torch.full((r * d,), sum(rr for rr, _ in SPECS[:t])) for t, (r, d) in enumerate(SPECS)])
    col = torch.cat([torch.arange(d).repeat(r) for r, d in SPECS])
    for name, state in (("accum", 0), ("linear", 1)):
        row_wise = name == "accum" and start.rowwise
        key, column = (row_key, col)
        if row_wise:
            key, column = torch.arange(rows), torch.zeros(rows, dtype=torch.int64)
        a32, b32 = getattr(fp32[cpp_backend], name), getattr(fp32[torch_backend], name)
        same = a32.view(torch.int32) == b32.view(torch.int32)
        assert same.float().mean() > 0.5, name
        a16, b16 = getattr(bf16[cpp_backend], name), getattr(bf16[torch_backend], name)
        assert torch.equal(bits(a16[same]), bits(b16[same])), name
        changed = a32 != getattr(start, name).float()
        rounded = store_state(a32, BF16, key, column, torch.tensor([5]), state).to(BF16)
        assert changed.any() and torch.equal(bits(a16[changed]), bits(rounded[changed])), name
    if start.weights is not None:     # the new weight is prox of the unrounded fp32 state: the same
        assert torch.equal(bits(bf16[cpp_backend].weights), bits(fp32[cpp_backend].weights))


# ------------------------------------------------------------------ derived == stored, bitwise


def _kernel_weights(arrays, hp, specs):
    """The weights as the kernel's forward reads them: a SUM lookup of one row per bag (row b of
    every table in bag b; exact: 0 + w). Returns per table ``[rows, D]``."""
    R = max(r for r, _ in specs)
    m = FTRLTableBatchedEmbeddingBags(list(specs), backend="cpp")     # one feature per table
    idx = torch.cat([torch.arange(r) for r, _ in specs])
    lengths = [int(b < r) for r, _ in specs for b in range(R)]
    batch = m._make_batch(idx, torch.tensor([0] + np.cumsum(lengths).tolist()), None, None)
    out = _forward(cpp_backend, arrays, batch, F32, hp).view(R, -1)
    cols = np.cumsum([0] + [d for _, d in specs])
    return [out[:r, cols[t]:cols[t + 1]] for t, (r, _) in enumerate(specs)]


@pytest.mark.parametrize("knobs", [{}, {"ftrl_learning_rate_power": -0.3}], ids=["sqrt", "pow"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("accumulator", ["elementwise", "rowwise"])
def test_derived_weights_train_bitwise_as_stored_ones(accumulator, case, knobs):
    """fp32 states from w = z = 0 (stored) and z = 0 (derived: prox(0, n) = 0), the same n0: every
    step's forward output, the states after it, and the weights as the kernel reads them agree bit
    for bit (prox is one C++ function, shared by the forward and the update)."""
    m = _maker(case, **knobs)
    specs = NONE_SPECS if case == "none" else SPECS
    stored = _arrays(("stored", accumulator), STATES["fp32"], specs)
    stored.weights.zero_()
    stored.linear.zero_()
    derived = TableArrays(None, stored.accum.clone(), stored.linear.clone(), stored.rowwise)
    for step in range(4):
        inputs = _inputs(m, case, step)
        grad = _grad(m, inputs, inputs.batch.out_numel, seed=step)
        outs = [_step(cpp_backend, a, m, inputs, grad) for a in (stored, derived)]
        assert torch.equal(bits(outs[0][0]), bits(outs[1][0])), f"step {step}: forward outputs differ"
        assert outs[0][1] == outs[1][1] > 0
        for name in ("accum", "linear"):
            assert torch.equal(bits(getattr(stored, name)), bits(getattr(derived, name))), (step, name)
    assert stored.weights.abs().max() > 0
    for w_stored, w_derived in zip(_kernel_weights(stored, m.hyperparams, specs),
                                   _kernel_weights(derived, m.hyperparams, specs)):
        assert torch.equal(bits(w_stored), bits(w_derived))
    assert torch.equal(bits(torch.cat([w.reshape(-1) for w in _kernel_weights(stored, m.hyperparams,
                                                                              specs)])), bits(stored.weights))


# ---------------------------------------------------------------------------- through the TBE


@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_tbe_trains_every_layout_on_the_cpp_backend(layout):
    """The TBE allocates the layout and its cpp backend trains it as the ops' calls do."""
    weights, accumulator = layout
    m = FTRLTableBatchedEmbeddingBags(list(SPECS), feature_table_map=list(FMAP), backend="cpp",
                                      ftrl_weights=weights, ftrl_accumulator=accumulator,
                                      optimizer_state_dtypes={"accum": SparseType.BF16,
                                                              "linear": SparseType.BF16},
                                      **KNOBS)
    arrays = m.table_arrays
    assert (arrays.weights is None) == (weights == "derived")
    assert arrays.accum.numel() == (sum(r for r, _ in SPECS) if accumulator == "rowwise"
                                    else sum(r * d for r, d in SPECS))
    twin = _clone(arrays)
    maker = _maker("sum-psw")
    for step in range(2):
        inputs = _inputs(maker, "sum-psw", step)
        out = m(inputs.indices, inputs.offsets, inputs.psw)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
        batch = dataclasses.replace(inputs.batch, step=m.iter.clone())
        want = _forward(cpp_backend, twin, batch, F32, m.hyperparams)
        assert torch.equal(bits(out.reshape(-1)), bits(want))
        out.backward(grad)
        _backward_update_(cpp_backend, twin, batch, grad.reshape(-1), m.hyperparams,
                          torch.zeros(1, dtype=torch.int64))
    for name in ("weights", "accum", "linear"):
        if getattr(twin, name) is not None:
            assert torch.equal(bits(getattr(m.table_arrays, name)), bits(getattr(twin, name))), name


def test_arrays_that_do_not_match_the_layout_are_refused_unchanged():
    """A row-wise flag with an element-wise accum (and a weight buffer of the wrong size) is refused
    by the kernel, naming the array and both sizes, before anything is written."""
    m = _maker("mean")
    inputs = _inputs(m, "mean", 0)
    arrays = _arrays(("derived", "elementwise"), STATES["fp32"], SPECS)
    total, rows = sum(r * d for r, d in SPECS), sum(r for r, _ in SPECS)
    before = [bits(arrays.accum), bits(arrays.linear)]
    grad = torch.ones(inputs.batch.out_numel)
    wrong = dataclasses.replace(arrays, rowwise=True)
    with pytest.raises(RuntimeError, match=rf"a row-wise accum must have one element per row \({rows}\), "
                                           rf"got {total}"):
        _backward_update_(cpp_backend, wrong, inputs.batch, grad, m.hyperparams,
                          torch.zeros(1, dtype=torch.int64))
    short = dataclasses.replace(arrays, weights=torch.zeros(total - 1))
    with pytest.raises(RuntimeError,
                       match=rf"weights must have as many elements as linear \({total}\), got {total - 1}"):
        _forward(cpp_backend, short, inputs.batch, F32, m.hyperparams)
    assert torch.equal(before[0], bits(arrays.accum)) and torch.equal(before[1], bits(arrays.linear))
