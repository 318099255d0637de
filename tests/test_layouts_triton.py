"""The row layouts in the Triton kernels: derived weights and the row-wise accumulator.

Every ``(weights, accumulator)`` layout of :class:`torchrec_ftrl.row_layout.RowLayout`, each with fp32
or bf16 ``accum`` / ``linear``, through the ops' calls of the Triton backend
(:mod:`torchrec_ftrl.kernels.calls`: ``forward_train``, ``backward_update_``) on
:class:`~torchrec_ftrl.kernels.batch.TableArrays` allocated here and batches made by a TBE
(``_make_batch``), over several steps. Expected values:

* the float64 oracle, transcribed from ``docs/ftrl.md`` in ``tests/reference.py``
  (``ftrl_reference_weight``, ``ftrl_reference_step``, ``ftrl_reference_step_rowwise``), with the
  pooled lookup and the summed row gradients by float64 autograd (``conftest.reference_forward``),
  each step from the kernels' current state;
* the PyTorch backend (``torch_backend``) run on copies of the same arrays, each step from the Triton
  backend's state before it (so a one-ulp difference of one step is not fed into the next);
* bitwise: a derived table against a stored table that starts at w = 0 (fp32 state), whose weights,
  states and forward outputs must keep the same bits step after step, since the forward's derived
  weight and the update's stored weight come from one function (``kernels/cuda/rule_gen.py``).

On a CPU-only machine the ``interp`` tests run under ``TRITON_INTERPRET=1`` in a child pytest
(:func:`test_interpreter_suite`, ``conftest.run_interpreter_suite``) with tiny launch shapes (the
``interp`` fixture: runs longer than 4 entries are cut into pieces and combined); the ``cuda`` tests
run the same checks on the compiled kernels at larger shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import pytest
import torch

from conftest import bits, cuda, index_tables, interpreter_parent, needs_cuda, reference_forward, \
    run_interpreter_suite

pytest.importorskip("triton")

from reference import (ftrl_reference_step, ftrl_reference_step_rowwise,  # noqa: E402
                       ftrl_reference_weight, reference_knobs)
from tbe_harness import bf16_spacing  # noqa: E402
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags  # noqa: E402
from torchrec_ftrl.fbgemm_enums import BoundsCheckMode, PoolingMode  # noqa: E402
from torchrec_ftrl.kernels import backend, calls  # noqa: E402
from torchrec_ftrl.kernels.pytorch import rows as torch_backend  # noqa: E402
from torchrec_ftrl.kernels.cuda import backend as triton_backend  # noqa: E402
from torchrec_ftrl.kernels.batch import TableArrays  # noqa: E402

KNOBS = dict(learning_rate=0.05, ftrl_l1_reg=0.002, ftrl_l2_reg=0.01, ftrl_beta=0.3)
LAYOUTS = [("stored", "elementwise"), ("stored", "rowwise"), ("derived", "elementwise"),
           ("derived", "rowwise")]
# Mixed dims in one TBE (D = 1 included); feature 4 shares table 0.
SPECS = [(9, 5), (13, 3), (6, 8), (4, 1)]
FMAP = [0, 1, 2, 3, 0]


@dataclasses.dataclass
class Case:
    """One layout test: tables, pooling, layout, dtypes and the batches' features."""

    weights: str
    accumulator: str
    state_dtype: torch.dtype = torch.float32
    specs: list = dataclasses.field(default_factory=lambda: list(SPECS))
    fmap: list = dataclasses.field(default_factory=lambda: list(FMAP))
    pooling: PoolingMode = PoolingMode.SUM
    weight_dtype: torch.dtype = torch.float32
    out_dtype: torch.dtype = torch.float32
    psw: bool = False
    vbe: Optional[list] = None
    B: int = 3
    max_len: int = 5
    hot: bool = False
    nan_step: Optional[int] = None      # the step whose output gradient gets a NaN
    steps: int = 3
    seed: int = 0
    knobs: dict = dataclasses.field(default_factory=lambda: dict(KNOBS))

    @property
    def rowwise(self) -> bool:
        return self.accumulator == "rowwise"


class Tables:
    """Flat-buffer geometry of ``specs`` (as the TBE lays them out) and per-table views."""

    def __init__(self, specs):
        self.specs = specs
        self.w_offset = np.concatenate([[0], np.cumsum([r * d for r, d in specs])])
        self.row_base = np.concatenate([[0], np.cumsum([r for r, _ in specs])])

    def view(self, flat: torch.Tensor, t: int) -> torch.Tensor:
        rows, dim = self.specs[t]
        return flat[int(self.w_offset[t]):int(self.w_offset[t + 1])].view(rows, dim)

    def rows(self, flat: torch.Tensor, t: int) -> torch.Tensor:
        """Table ``t``'s part of a row-wise ``accum`` (``[rows]``)."""
        return flat[int(self.row_base[t]):int(self.row_base[t + 1])]


def batch_maker(case: Case, device) -> FTRLTableBatchedEmbeddingBags:
    """A stored-layout TBE of the case's tables, used only to make batches (checked: no kernel of
    its own runs)."""
    return FTRLTableBatchedEmbeddingBags(case.specs, feature_table_map=case.fmap, pooling_mode=case.pooling,
                                         device=device, backend="torch",
                                         bounds_check_mode=BoundsCheckMode.NONE, **case.knobs)


def random_batch(case: Case, rng: np.random.Generator, device):
    """Feature-major bags of 0..max_len ids (``hot``: mostly rows 0 and 1, long runs); per-sample
    weights when the case has them."""
    bags = [sum(v) for v in case.vbe] if case.vbe else [case.B] * len(case.fmap)
    lengths, idx = [], []
    for f, nb in enumerate(bags):
        rows = case.specs[case.fmap[f]][0]
        for _ in range(nb):
            L = int(rng.integers(0, case.max_len + 1))
            ids = rng.integers(0, rows, L)
            if case.hot:
                ids = np.where(rng.random(L) < 0.8, rng.integers(0, min(2, rows), L), ids)
            lengths.append(L)
            idx.extend(int(i) for i in ids)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64, device=device)
    indices = torch.tensor(idx, dtype=torch.int64, device=device)
    psw = (torch.tensor(rng.uniform(0.5, 1.5, len(idx)), dtype=torch.float32, device=device)
           if case.psw else None)
    return indices, offsets, psw


def start_arrays(case: Case, geo: Tables, device, w_zero: bool = False) -> TableArrays:
    """Random start state: ``n`` in [0.05, 0.5) (``[total_rows]`` row-wise), ``z`` in [-0.1, 0.1)
    (0 with ``w_zero``), stored weights in [-0.1, 0.1) (0 with ``w_zero``)."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    total, rows = int(geo.w_offset[-1]), int(geo.row_base[-1])
    n = (torch.rand(rows if case.rowwise else total, generator=g) * 0.45 + 0.05).to(case.state_dtype)
    z = torch.zeros(total) if w_zero else torch.rand(total, generator=g) * 0.2 - 0.1
    w = None
    if case.weights == "stored":
        w = (torch.zeros(total) if w_zero else torch.rand(total, generator=g) * 0.2 - 0.1)
        w = w.to(case.weight_dtype).to(device)
    return TableArrays(w, n.to(device), z.to(case.state_dtype).to(device), case.rowwise)


def set_arrays(dst: TableArrays, src: TableArrays) -> None:
    """Copy ``src``'s states (and stored weights) into ``dst``'s arrays, in place."""
    with torch.no_grad():
        for name in ("weights", "accum", "linear"):
            if getattr(dst, name) is not None:
                getattr(dst, name).copy_(getattr(src, name))


def copy_arrays(a: TableArrays, device=None) -> TableArrays:
    c = lambda t: t.detach().clone().to(device if device is not None else t.device)  # noqa: E731
    return TableArrays(None if a.weights is None else c(a.weights), c(a.accum), c(a.linear), a.rowwise)


def run_step(kernels, arrays: TableArrays, batch, grad: torch.Tensor, hp, out_dtype) -> tuple:
    """One training step through ``kernels``: ``triton_backend`` by the ops' calls
    (``calls.forward_train``, then ``calls.backward_update_`` with its context), ``torch_backend`` by
    its vectorised functions; ``(out, nonfinite rows counted)``."""
    if kernels is torch_backend:
        out = torch_backend.forward(arrays, batch, out_dtype, hp)
    else:
        out, ctx = calls.forward_train(backend._load("triton"), arrays, batch, out_dtype, hp)
    count = torch.zeros(1, dtype=torch.int64, device=out.device)
    if kernels is torch_backend:
        torch_backend.backward_update_(arrays, batch, grad.to(out.device), hp, count)
    else:
        calls.backward_update_(backend._load("triton"), arrays, batch, ctx, grad.to(out.device), hp, count)
    return out, int(count)


@dataclasses.dataclass
class OracleStep:
    """The float64 expectation of one step: output, per table the rows updated and the rows skipped
    (non-finite summed gradient), and the tables ``w``, ``z`` (``[rows, D]``), ``n`` (``[rows, D]``
    or ``[rows]``) after it."""

    out: torch.Tensor
    updated: list
    skipped: list
    w: list
    z: list
    n: list


def oracle_step(case: Case, geo: Tables, arrays: TableArrays, indices, offsets, psw, grad, knobs
                ) -> OracleStep:
    """One step from ``arrays``' state in float64: each table's weight (stored, or
    ``ftrl_reference_weight(z, n)``), the lookup and the summed row gradients by autograd, then one
    ``ftrl_reference_step`` (``_rowwise``) per touched row whose summed gradient is finite."""
    f64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    W, Z, N = [], [], []
    for t in range(len(case.specs)):
        z = f64(geo.view(arrays.linear, t))
        n = f64(geo.rows(arrays.accum, t)) if case.rowwise else f64(geo.view(arrays.accum, t))
        if arrays.weights is not None:
            w = f64(geo.view(arrays.weights, t))
        else:
            w = ftrl_reference_weight(z, n[:, None] if case.rowwise else n, **knobs)
        W.append(w), Z.append(z), N.append(n)
    tables = [torch.tensor(w, requires_grad=True) for w in W]
    out = reference_forward(tables, case.fmap, case.pooling, indices, offsets, psw, case.vbe)
    (out * grad.double().cpu().reshape(out.shape)).sum().backward()
    sizes = [sum(v) for v in case.vbe] if case.vbe else [case.B] * len(case.fmap)
    idx_table = index_tables(case.fmap, sizes, offsets)
    idx = indices.cpu().numpy()
    res = OracleStep(out.detach(), [], [], [], [], [])
    for t, (w, z, n) in enumerate(zip(W, Z, N)):
        g = tables[t].grad.numpy() if tables[t].grad is not None else np.zeros_like(w)
        touched = np.unique(idx[idx_table == t])
        finite = np.isfinite(g[touched]).all(axis=1)
        w, z, n = w.copy(), z.copy(), n.copy()
        for r in touched[finite]:
            if case.rowwise:
                nw, nz, nn = ftrl_reference_step_rowwise(w[r:r + 1], z[r:r + 1], n[r:r + 1], g[r:r + 1],
                                                         **knobs)
                w[r], z[r], n[r] = nw[0], nz[0], nn[0]
            else:
                w[r], z[r], n[r] = ftrl_reference_step(w[r], z[r], n[r], g[r], **knobs)
        res.updated.append(touched[finite]), res.skipped.append(touched[~finite])
        res.w.append(w), res.z.append(z), res.n.append(n)
    return res


def assert_near(actual, expected, rtol, atol, what):
    a = torch.as_tensor(actual).detach().double().cpu().numpy()
    e = np.asarray(expected, dtype=np.float64)
    bad = ~(np.abs(a - e) <= atol + rtol * np.abs(e))
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} off, first {np.argwhere(bad)[0]}: "
                           f"got {a[bad][0]!r}, expected {e[bad][0]!r}")


def check_against_oracle(case: Case, geo: Tables, before: TableArrays, after: TableArrays,
                         ref: OracleStep, what: str) -> None:
    """Rows updated match the oracle (a bf16 state within one bf16 spacing more: stochastic
    rounding); every other row (untouched or skipped) keeps its bits."""
    for t, (rows_t, _) in enumerate(case.specs):
        upd = ref.updated[t]
        keep = np.ones(rows_t, dtype=bool)
        keep[upd] = False
        # state name -> (its table-t view, the oracle's tables)
        states = {"linear": (geo.view, ref.z), "accum": (geo.rows if case.rowwise else geo.view, ref.n)}
        if after.weights is not None:
            states["weights"] = (geo.view, ref.w)
        for name, (view, _) in states.items():
            now, old = view(getattr(after, name), t).cpu(), view(getattr(before, name), t).cpu()
            assert torch.equal(bits(now[torch.as_tensor(keep)]), bits(old[torch.as_tensor(keep)])), \
                f"{what} table {t}: {name} of an untouched or skipped row changed"
        if not len(upd):
            continue
        for name, (view, expected) in states.items():
            exp = expected[t][upd]
            now = view(getattr(after, name), t).cpu()[torch.as_tensor(upd)]
            scale = 10.0 * max(1.0, float(np.abs(exp).max()))
            if name == "weights":
                rtol = 2e-5 if case.weight_dtype == torch.float32 else 2e-3
            else:
                rtol = 2e-5
            sr = bf16_spacing(np.abs(exp) * 1.01) if now.dtype == torch.bfloat16 else 0.0
            assert_near(now, exp, rtol, rtol * scale + 1e-7 + sr, f"{what} table {t} {name}")


def out_tol(case: Case) -> dict:
    low = case.out_dtype != torch.float32 or case.weight_dtype != torch.float32
    return dict(rtol=1.6e-2, atol=2e-3) if low else dict(rtol=5e-5, atol=1e-5)


def backend_stepper(kernels, arrays: TableArrays, hp, case: Case):
    """``(arrays, step(batch, grad, k) -> (flat out, rows counted))``: training steps through
    ``kernels`` (:func:`run_step`) on ``arrays``, bf16 states rounded with step ``7 + k``."""
    def step(batch, grad, k):
        batch = dataclasses.replace(batch, step=torch.tensor([7 + k], dtype=torch.int64,
                                                             device=arrays.linear.device))
        return run_step(kernels, arrays, batch, grad, hp, case.out_dtype)
    return arrays, step


def layout_module(backend: str, start: TableArrays, case: Case, device) -> FTRLTableBatchedEmbeddingBags:
    """An ``FTRLTableBatchedEmbeddingBags`` on ``backend`` built with the case's layout
    (``ftrl_weights``, ``ftrl_accumulator``, ``optimizer_state_dtypes``; its own allocation,
    ``bounds_check_mode`` WARNING), set to the state ``start``."""
    m = FTRLTableBatchedEmbeddingBags(
        case.specs, feature_table_map=case.fmap, pooling_mode=case.pooling, device=device, backend=backend,
        ftrl_weights=case.weights, ftrl_accumulator=case.accumulator,
        optimizer_state_dtypes={"accum": case.state_dtype, "linear": case.state_dtype},
        bounds_check_mode=BoundsCheckMode.WARNING, **case.knobs)
    with torch.no_grad():
        for name in ("weights", "accum", "linear"):
            if getattr(start, name) is not None:
                getattr(m.table_arrays, name).copy_(getattr(start, name))
    return m


def module_stepper(backend: str, start: TableArrays, case: Case, device):
    """``(arrays, step(batch, grad, k))``: training steps of :func:`layout_module` (``iter`` is the
    rounding step); ``arrays`` are its ``table_arrays``."""
    m = layout_module(backend, start, case, device)
    arrays = m.table_arrays

    def step(batch, grad, k):
        out = m(batch.indices, batch.offsets, batch.per_sample_weights, batch_size_per_feature_per_rank=case.vbe)
        before = int(m.nonfinite_grad_rows)
        out.backward(grad.to(out.device).view(out.shape))
        return out.reshape(-1), int(m.nonfinite_grad_rows) - before
    return arrays, step


def check_case(case: Case, device, through_module: bool = False) -> None:
    """``case.steps`` steps of the Triton backend on the case's layout: each step's output, states,
    skipped rows and their count against the float64 oracle from the state before it, and the
    output and states against the PyTorch backend run from the same state, the Triton backend's
    before the step (:func:`check_against_twin`). The backends' functions run on arrays allocated
    here, or (``through_module``) each backend's TBE module runs."""
    geo = Tables(case.specs)
    m = batch_maker(case, device)
    hp = m.hyperparams
    knobs = reference_knobs(hp)
    start = start_arrays(case, geo, device)
    if through_module:
        ours, ours_step = module_stepper("triton", start, case, device)
        twin, twin_step = module_stepper("torch", start, case, device)
    else:
        ours, ours_step = backend_stepper(triton_backend, start, hp, case)
        twin, twin_step = backend_stepper(torch_backend, copy_arrays(start), hp, case)
    rng = np.random.default_rng(case.seed)
    for step in range(case.steps):
        indices, offsets, psw = random_batch(case, rng, device)
        batch = m._make_batch(indices, offsets, psw, case.vbe)
        grad = torch.randn(batch.out_numel, generator=torch.Generator().manual_seed(case.seed * 31 + step))
        if step == case.nan_step and indices.numel():   # column 0 of the first lookup's output
            first_bag = int((offsets[1:] > offsets[:-1]).nonzero()[0])
            grad[0 if case.pooling == PoolingMode.NONE else int(batch.bag_out_offset[first_bag])] = float("nan")
        grad = grad.to(case.out_dtype)
        before = copy_arrays(ours, "cpu")
        ref = oracle_step(case, geo, before, indices, offsets, psw, grad, knobs)
        out, counted = ours_step(batch, grad, step)
        what = f"{case.weights}/{case.accumulator}/{case.state_dtype} step {step}"
        assert out.dtype == case.out_dtype
        assert_near(out, ref.out.reshape(-1), **out_tol(case), what=f"{what} forward")
        assert counted == sum(len(s) for s in ref.skipped), f"{what}: skipped rows counted"
        if step == case.nan_step:
            assert counted > 0, f"{what}: the NaN gradient reached no row"
        check_against_oracle(case, geo, before, ours, ref, what)
        set_arrays(twin, before)
        out2, counted2 = twin_step(batch, grad, step)
        assert counted2 == counted
        check_against_twin(case, ours, twin, out, out2, what)


def check_against_twin(case: Case, ours: TableArrays, twin: TableArrays, out, out2, what: str) -> None:
    """Triton against the PyTorch backend after one step from the same state. Their fp32 arithmetic
    differs by ulps (the Triton rule is rearranged, ``kernels/cuda/backward.py``; hot rows: the
    summation order too), so outputs, fp32 states and stored weights (computed from the fp32 states
    before their rounding) agree within ``tol``. A bf16 state is the stochastic rounding of those
    fp32 values with the same random bits (keyed by seed, step, row and column): rounding adds the
    bits to the fp32 pattern and truncates, which is monotone, so two fp32 values ``x_a``, ``x_b``
    round to bf16 values at most ``|x_a - x_b|`` plus one bf16 spacing of the larger apart, and
    most keep the same bits. The bound is per step and does not grow with the steps, since each
    step starts from the same state (:func:`check_case`)."""
    tol = dict(rtol=1e-3, atol=1e-4) if case.hot else dict(rtol=5e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), out2.double(), **out_tol(case), msg=f"{what} forward vs torch")
    for name in ("weights", "accum", "linear"):
        a, b = getattr(ours, name), getattr(twin, name)
        if a is None:
            continue
        if a.dtype == torch.bfloat16:
            x, y = a.double().cpu().numpy(), b.double().cpu().numpy()
            m = np.maximum(np.abs(x), np.abs(y))
            spacing = bf16_spacing(m)
            bound = tol["atol"] + tol["rtol"] * (m + spacing) + spacing
            bad = ~(np.abs(x - y) <= bound)
            assert not bad.any(), (f"{what} {name} vs torch: {int(bad.sum())} of {bad.size} beyond one bf16 "
                                   f"spacing + fp32 tolerance, first {x[bad][0]!r} vs {y[bad][0]!r}")
            same = (bits(a).view(torch.int16) == bits(b).view(torch.int16)).double().mean().item()
            assert same > 0.9, f"{what} {name}: only {same:.0%} of the bf16 values equal torch's"
        else:
            weight_tol = out_tol(case) if name == "weights" and a.dtype != torch.float32 else tol
            torch.testing.assert_close(a.double(), b.double(), **weight_tol, msg=f"{what} {name} vs torch")


def every_row_reader(case: Case, device):
    """``read(arrays, hp)``: each table's weights as the forward reads them, fp32 ``[rows, D]`` per
    table, by a SUM lookup with one feature per table, bag ``r`` of table ``t``'s feature holding
    row ``r`` alone (a sum of one fp32 weight is that weight), the others empty."""
    T, B = len(case.specs), max(r for r, _ in case.specs)
    m = FTRLTableBatchedEmbeddingBags(case.specs, feature_table_map=list(range(T)), device=device,
                                      backend="torch", bounds_check_mode=BoundsCheckMode.NONE, **case.knobs)
    indices = torch.cat([torch.arange(r) for r, _ in case.specs]).to(device)
    lengths = torch.tensor([int(b < r) for r, _ in case.specs for b in range(B)])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device)
    batch = m._make_batch(indices, offsets, None, None)
    cols = np.concatenate([[0], np.cumsum([d for _, d in case.specs])])

    def read(arrays: TableArrays, hp) -> list:
        out = calls.forward(backend._load("triton"), arrays, batch, torch.float32, hp).view(B, -1).cpu()
        return [out[:r, cols[t]:cols[t + 1]] for t, (r, _) in enumerate(case.specs)]
    return read


def check_derived_bitwise(case: Case, device) -> None:
    """A derived table and a stored table that starts at w = 0 (fp32 z = 0, the same n), fed the same
    batches: outputs, ``accum``, ``linear`` and weights (the stored buffer against the derived
    table's lookup of every row) keep the same bits at every step."""
    geo = Tables(case.specs)
    m = batch_maker(case, device)
    hp = m.hyperparams
    derived = start_arrays(dataclasses.replace(case, weights="derived"), geo, device, w_zero=True)
    stored = start_arrays(dataclasses.replace(case, weights="stored"), geo, device, w_zero=True)
    assert torch.equal(bits(stored.accum), bits(derived.accum))
    read = every_row_reader(case, device)
    rng = np.random.default_rng(case.seed)
    for step in range(case.steps):
        indices, offsets, psw = random_batch(case, rng, device)
        batch = m._make_batch(indices, offsets, psw, case.vbe)
        grad = torch.randn(batch.out_numel, generator=torch.Generator().manual_seed(step)).to(case.out_dtype)
        out_s, _ = run_step(triton_backend, stored, batch, grad, hp, case.out_dtype)
        out_d, _ = run_step(triton_backend, derived, batch, grad, hp, case.out_dtype)
        what = f"{case.accumulator} step {step}"
        assert torch.equal(bits(out_s), bits(out_d)), f"{what}: forward outputs differ"
        assert torch.equal(bits(stored.accum), bits(derived.accum)), f"{what}: accum differs"
        assert torch.equal(bits(stored.linear), bits(derived.linear)), f"{what}: linear differs"
        for t, w in enumerate(read(derived, hp)):
            assert torch.equal(bits(w), bits(geo.view(stored.weights, t))), f"{what}: table {t} weights differ"
    assert bool((stored.weights != 0).any()), "the batches trained no weight"


# ---------------------------------------------------------------------------- interpreter (CI)
@interpreter_parent
def test_interpreter_suite():
    """Runs the ``interp`` tests below in a child pytest with TRITON_INTERPRET=1 (CPU tensors)."""
    run_interpreter_suite(__file__, timeout=600)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weights,accumulator", LAYOUTS)
def test_interp_layout_sum_hot_rows_nan(interp, weights, accumulator, state_dtype):
    """SUM pooling, duplicates and runs cut into pieces (hot rows), a NaN gradient at step 1."""
    check_case(Case(weights, accumulator, state_dtype, hot=True, max_len=8, nan_step=1), interp)


@pytest.mark.parametrize("weights,accumulator", LAYOUTS)
def test_interp_layout_sequence_bf16_out(interp, weights, accumulator):
    """NONE pooling (one output row per lookup), bf16 output."""
    check_case(Case(weights, accumulator, specs=[(r, 4) for r, _ in SPECS], pooling=PoolingMode.NONE,
                    out_dtype=torch.bfloat16, seed=2, steps=2), interp)


@pytest.mark.parametrize("weights,accumulator", LAYOUTS)
def test_interp_layout_vbe_fp16_out(interp, weights, accumulator):
    """VBE (batch sizes per feature and rank), fp16 output, bf16 states."""
    vbe = [[1, 2], [2, 0], [1, 1], [0, 3], [2, 2]]
    check_case(Case(weights, accumulator, torch.bfloat16, vbe=vbe, out_dtype=torch.float16, seed=3,
                    steps=2), interp)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weights,accumulator", LAYOUTS)
def test_interp_tbe_module_layout(interp, weights, accumulator, state_dtype):
    """The TBE module built with ``backend="triton"`` and the layout (its allocation, the fused
    WARNING bounds check, ``iter`` as the rounding step): MEAN, per-sample weights, hot rows, a NaN
    gradient, against the oracle and the torch-backend module."""
    check_case(Case(weights, accumulator, state_dtype, pooling=PoolingMode.MEAN, psw=True, hot=True,
                    max_len=8, nan_step=1, seed=7), interp, through_module=True)


@pytest.mark.parametrize("weights,accumulator", LAYOUTS)
def test_interp_eval_forward_with_bad_indices(interp, weights, accumulator):
    """An eval forward (no training forward: the lookup checks raw indices itself under WARNING)
    with an index out of range and bad offsets: read as row 0 / repaired and counted, like the
    torch-backend module (which checks before its lookup)."""
    case = Case(weights, accumulator, torch.bfloat16)
    start = start_arrays(case, Tables(case.specs), interp)
    ours, twin = (layout_module(b, start, case, interp) for b in ("triton", "torch"))
    indices = torch.tensor([1, 99, 4, 2, 12, -3, 5, 0, 3, 1, 7])
    offsets = torch.tensor([0, 2, 3, 3, 5, 4, 7, 8, 9, 9, 10, 11, 11, 11, 11, 11])   # 5 features x 3 bags
    with torch.no_grad():
        out, out2 = ours(indices, offsets), twin(indices, offsets)
    assert int(ours.bounds_check_warning) == int(twin.bounds_check_warning) > 0
    torch.testing.assert_close(out, out2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weights,accumulator", LAYOUTS)
def test_interp_layout_pow_and_shrinkage(interp, weights, accumulator):
    """A learning-rate power other than -0.5 (the pow path of n^(-p)) and l2 shrinkage (which reads
    the old weight, derived or stored), mcmahan's L2, hot rows."""
    knobs = dict(KNOBS, ftrl_learning_rate_power=-0.3, ftrl_l2_shrinkage=0.03, ftrl_l2_convention="mcmahan")
    check_case(Case(weights, accumulator, hot=True, max_len=8, seed=9, steps=2, knobs=knobs), interp)


@pytest.mark.parametrize("accumulator", ["elementwise", "rowwise"])
def test_interp_stored_fp16_weights(interp, accumulator):
    """fp16 weights_precision (stored weights)."""
    check_case(Case("stored", accumulator, weight_dtype=torch.float16, psw=True, seed=4, steps=2), interp)


@pytest.mark.parametrize("pooling,psw", [(PoolingMode.SUM, False), (PoolingMode.MEAN, True)])
@pytest.mark.parametrize("accumulator", ["elementwise", "rowwise"])
def test_interp_derived_equals_stored_from_zero(interp, accumulator, pooling, psw):
    """Derived == stored (w0 = 0), bit for bit, fp32 state, hot rows (the combine kernel too)."""
    check_derived_bitwise(Case("derived", accumulator, pooling=pooling, psw=psw, hot=True, max_len=8), interp)


@pytest.mark.parametrize("rows", [1, 2])
def test_interp_rowwise_rows_entry_shared_with_the_stored_twin(interp, monkeypatch, rows):
    """``TUNING["rows"]`` (gradient rows in flight, so a row's summation order) of a row-wise accum
    applies to a derived table and its stored twin alike: still bit for bit equal, hot rows."""
    monkeypatch.setitem(triton_backend.TUNING, "rows", {"rowwise/fp32/fp32": rows})
    check_derived_bitwise(Case("derived", "rowwise", hot=True, max_len=8), interp)


@pytest.mark.parametrize("weights,accumulator", [("derived", "elementwise"), ("stored", "rowwise"),
                                                 ("derived", "rowwise")])
def test_layout_outside_the_cached_capabilities_refused_with_a_cached_batch(monkeypatch, weights, accumulator):
    """The refusal of a cached batch follows the capability data: with ``cached_layouts`` narrowed to
    the stored / element-wise layout, a lean layout with a cached batch raises ValueError naming the
    layout, before any kernel runs or any state changes."""
    monkeypatch.setattr(triton_backend, "CAPABILITIES", dataclasses.replace(
        triton_backend.CAPABILITIES, cached_layouts=frozenset({("stored", "elementwise")})))
    case = Case(weights, accumulator)
    geo = Tables(case.specs)
    arrays = start_arrays(case, geo, "cpu")
    before = copy_arrays(arrays)
    m = batch_maker(case, "cpu")
    indices, offsets, _ = random_batch(case, np.random.default_rng(0), "cpu")
    batch = dataclasses.replace(m._make_batch(indices, offsets, None, None),
                                cache_locations=torch.full((indices.numel(),), -1, dtype=torch.int32))
    grad = torch.ones(batch.out_numel)
    triton = backend._load("triton")    # after the monkeypatch: its capabilities are the narrowed ones
    attempts = [lambda: calls.forward(triton, arrays, batch, torch.float32, m.hyperparams),
                lambda: calls.forward_train(triton, arrays, batch, torch.float32, m.hyperparams),
                lambda: calls.backward_update_(triton, arrays, batch, None, grad, m.hyperparams,
                                               torch.zeros(1, dtype=torch.int64))]
    for call in attempts:
        with pytest.raises(ValueError, match=f"ftrl_weights='{weights}', ftrl_accumulator='{accumulator}'"):
            call()
    for name in ("weights", "accum", "linear"):
        if getattr(arrays, name) is not None:
            assert torch.equal(bits(getattr(arrays, name)), bits(getattr(before, name)))


# ---------------------------------------------------------------------------- CUDA (compiled)
CUDA_SPECS = [(3000, 128), (2000, 64), (500, 40), (64, 256)]
CUDA_FMAP = [0, 1, 2, 3, 0, 1]


def cuda_specs(pooling: PoolingMode) -> list:
    """Mixed dims; one dim (128) for NONE pooling, which needs it."""
    return [(r, 128) for r, _ in CUDA_SPECS] if pooling == PoolingMode.NONE else CUDA_SPECS


@cuda
@needs_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weights,accumulator", LAYOUTS)
@pytest.mark.parametrize("pooling,psw,hot", [(PoolingMode.SUM, False, True), (PoolingMode.MEAN, True, False),
                                             (PoolingMode.NONE, False, False)])
def test_cuda_layout(weights, accumulator, state_dtype, pooling, psw, hot):
    """The interpreter checks on the compiled kernels: mixed dims up to 256, B = 64, hot rows cut
    into pieces (the tuned SEG), a NaN gradient at step 1."""
    check_case(Case(weights, accumulator, state_dtype, specs=cuda_specs(pooling), fmap=CUDA_FMAP, pooling=pooling,
                    psw=psw, hot=hot, B=64, max_len=12, nan_step=1, seed=5), "cuda")


@cuda
@needs_cuda
@pytest.mark.parametrize("weights,accumulator", LAYOUTS)
def test_cuda_layout_vbe_bf16_out(weights, accumulator):
    vbe = [[20, 30], [0, 50], [25, 25], [40, 10], [5, 45], [50, 0]]
    check_case(Case(weights, accumulator, torch.bfloat16, specs=CUDA_SPECS, fmap=CUDA_FMAP, vbe=vbe,
                    out_dtype=torch.bfloat16, max_len=12, seed=6), "cuda")


@cuda
@needs_cuda
@pytest.mark.parametrize("pooling,psw", [(PoolingMode.SUM, False), (PoolingMode.MEAN, True),
                                         (PoolingMode.NONE, False)])
@pytest.mark.parametrize("accumulator", ["elementwise", "rowwise"])
def test_cuda_derived_equals_stored_from_zero(accumulator, pooling, psw):
    check_derived_bitwise(Case("derived", accumulator, specs=cuda_specs(pooling), fmap=CUDA_FMAP, pooling=pooling,
                               psw=psw, hot=True, B=64, max_len=12, steps=4), "cuda")


@cuda
@needs_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weights,accumulator", LAYOUTS)
def test_cuda_tbe_module_layout(weights, accumulator, state_dtype):
    check_case(Case(weights, accumulator, state_dtype, specs=CUDA_SPECS, fmap=CUDA_FMAP, pooling=PoolingMode.MEAN,
                    psw=True, hot=True, B=64, max_len=12, nan_step=1, seed=8), "cuda", through_module=True)


@cuda
@needs_cuda
@pytest.mark.parametrize("weights,accumulator", LAYOUTS)
def test_cuda_layout_pow_and_shrinkage(weights, accumulator):
    knobs = dict(KNOBS, ftrl_learning_rate_power=-0.3, ftrl_l2_shrinkage=0.03, ftrl_l2_convention="mcmahan")
    check_case(Case(weights, accumulator, specs=CUDA_SPECS, fmap=CUDA_FMAP, hot=True, B=64, max_len=12, seed=10,
                    steps=2, knobs=knobs), "cuda")
