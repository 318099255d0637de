"""The PyTorch fallback of ``torch.ops.torchrec_ftrl.*`` (torchrec_ftrl/kernels/pytorch/composite.py), the ops'
``CompositeExplicitAutograd`` implementations: against the compiled CPU kernel (bitwise but for two
sums rounded in another order) and a float64 reference for every fp32 row layout, pooling mode and
per-sample weights; bf16 states; what the dispatcher runs on a CPU without the compiled kernel
(CUDA tensors run the Triton implementations: ``test_ops_cuda_impls``); ``opcheck`` of that path; the TBE's batches through the composite as ``backend="torch"``."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as Fn

from conftest import REPO, assert_same_bits, bits, reference_forward, tbe_state
from reference import ftrl_reference_step, ftrl_reference_step_rowwise, ftrl_reference_weight
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.fbgemm_enums import PoolingMode, SparseType
from torchrec_ftrl.hyperparams import KernelScalars
from torchrec_ftrl.kernels.pytorch import composite
from torchrec_ftrl.kernels.cpu import backend as cpp_backend
from torchrec_ftrl.kernels.knobs import knob_args
from torchrec_ftrl.kernels.ops import NAMESPACE

ops = torch.ops.torchrec_ftrl
COMPOSITE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
ROWS, DIMS, B = (6, 5), (4, 8), 3                  # two tables, one feature each, 3 bags per feature
MAX_D, TOTAL_D = max(DIMS), sum(DIMS)
KNOBS = dict(lr=0.5, lr_power=-0.5, l1=0.01, l2=0.02, beta=0.3, l2_shrinkage=0.05)
SCALARS = (KNOBS["lr"], -KNOBS["lr_power"], KNOBS["l1"], 2 * KNOBS["l2"], KNOBS["beta"],
           2 * KNOBS["l2_shrinkage"])         # KernelScalars of KNOBS, written out ("tensorflow" L2)
LAYOUTS = [(w, a) for w in ("stored", "derived") for a in ("elementwise", "rowwise")]
BATCHES = [(p, psw) for p in (PoolingMode.SUM, PoolingMode.MEAN) for psw in (False, True)] + [
    (PoolingMode.NONE, False)]                      # (pooling, per-sample weights)


@pytest.fixture(scope="module")
def cpu_kernel():
    cpp_backend.load_extension()


def _batch(pooling, psw: bool) -> dict:
    """Feature-major bags (f0: [1, 4], [], [5, 5, 0]; f1: [2], [0, 2, 2], [4]): duplicates, an empty
    bag; the plain ``[B, 12]`` output (SUM/MEAN) or ``[N, MAX_D]`` (NONE)."""
    indices = torch.tensor([1, 4, 5, 5, 0, 2, 0, 2, 2, 4])
    offsets = torch.tensor([0, 2, 2, 5, 6, 9, 10])
    bag_feature = torch.tensor([0] * B + [1] * B)
    bag_out_offset = torch.tensor([b * TOTAL_D for b in range(B)] + [b * TOTAL_D + DIMS[0] for b in range(B)])
    weights = torch.linspace(0.5, 2.0, indices.numel()) if psw else None
    out_numel = indices.numel() * MAX_D if pooling == PoolingMode.NONE else B * TOTAL_D
    return dict(table_w_offset=torch.tensor([0, ROWS[0] * DIMS[0]]), table_dim=torch.tensor(DIMS),
                table_rows=torch.tensor(ROWS), feature_table=torch.tensor([0, 1]), bag_feature=bag_feature,
                bag_out_offset=bag_out_offset, indices=indices, offsets=offsets, per_sample_weights=weights,
                pooling_mode=int(pooling), table_row_base=torch.tensor([0, ROWS[0]]), out_numel=out_numel)


def _state(layout) -> tuple:
    """``(weights?, accum, linear)`` flat fp32 arrays of ``layout`` (seeded; accum > 0)."""
    g = torch.Generator().manual_seed(0)
    total = sum(r * d for r, d in zip(ROWS, DIMS))
    linear = torch.randn(total, generator=g)
    accum = torch.rand(sum(ROWS) if layout[1] == "rowwise" else total, generator=g) + 0.1
    weights = torch.randn(total, generator=g) if layout[0] == "stored" else None
    return weights, accum, linear


def _knob_args(device):
    """The ops' knob arguments ``(knobs, pow_half, has_shrink)`` of :data:`SCALARS` on ``device``."""
    return knob_args(KernelScalars(*SCALARS).to_hyperparams(), device)


def _batch_args(b):
    return (b["table_w_offset"], b["table_dim"], b["table_rows"], b["table_row_base"], b["feature_table"],
            b["bag_feature"], b["bag_out_offset"], b["indices"], b["offsets"], b["per_sample_weights"],
            b["pooling_mode"], MAX_D, DIMS, sum(ROWS))


def _forward_args(state, layout, b, out_dtype=torch.float32):
    warn = torch.zeros(1, dtype=torch.int64, device=state[2].device)   # unread: check False
    return (*state, layout[1] == "rowwise", *_batch_args(b), *_knob_args(state[2].device), b["out_numel"],
            out_dtype, warn, False, None, None, None, None, None)


def _update_args(state, layout, b, grad_out, nonfinite, step=0):
    step = torch.tensor([step], device=b["indices"].device)
    return (*state, layout[1] == "rowwise", *_batch_args(b), grad_out, *_knob_args(state[2].device),
            nonfinite, step, False, None, None, None, None, None, None, None, None)


def _grad_out(b) -> torch.Tensor:
    return torch.linspace(-1.0, 1.5, b["out_numel"], device=b["indices"].device)


def _train(state, layout, b, call):
    """One forward and one update by ``call(op, *args)``; returns the output, the updated arrays and
    the non-finite row count."""
    state = tuple(None if s is None else s.clone() for s in state)
    out = call(ops.tbe_forward.default, *_forward_args(state, layout, b))
    nonfinite = torch.zeros(1, dtype=torch.int64, device=out.device)
    call(ops.tbe_backward_update_.default, *_update_args(state, layout, b, _grad_out(b), nonfinite))
    return [out, *[s for s in state if s is not None], nonfinite]


def _defined(out: torch.Tensor, b) -> torch.Tensor:
    """The elements of a flat output the ops define: all for SUM/MEAN; for NONE (index ``i``'s row at
    ``i * MAX_D``) the first D of each ``MAX_D`` slot (the compiled kernel leaves the rest unset)."""
    if b["pooling_mode"] != int(PoolingMode.NONE):
        return out
    dims = torch.tensor(DIMS)[(torch.arange(len(b["indices"])) >= int(b["offsets"][B])).long()]
    return out.view(-1, MAX_D)[torch.arange(MAX_D) < dims.unsqueeze(1)]


def _by_dispatch(op, *args):
    """The kernel the dispatcher picks for the tensors' device (the compiled one once loaded)."""
    return op(*args)


def _by_composite(op, *args):
    """The ``CompositeExplicitAutograd`` implementation, whatever is registered for the device."""
    return op.redispatch(COMPOSITE, *args)


def _tables(flat, dims=DIMS):
    """Per-table float64 ``[rows, d]`` views of a flat array (``dims`` 1s for a row-wise accum)."""
    sizes = [r * d for r, d in zip(ROWS, dims)]
    return [t.double().view(r, d).numpy().copy() for t, r, d in zip(torch.split(flat, sizes), ROWS, dims)]


def _reference(state, layout, b):
    """Float64 ``(out, [w?, z, n] per table)`` of one step, transcribed from ``tests/reference.py``:
    the weights stored, or ``prox(z, n)``; the forward of FBGEMM's TBE; each touched row's summed
    gradient by float64 autograd; one step per touched row by the element or row-wise rule."""
    weights, accum, linear = state
    rowwise = layout[1] == "rowwise"
    z, n = _tables(linear), _tables(accum, (1, 1) if rowwise else DIMS)
    knobs = KNOBS
    w = _tables(weights) if weights is not None else [
        ftrl_reference_weight(zt, nt, **knobs) for zt, nt in zip(z, n)]
    W = [torch.tensor(wt, requires_grad=True) for wt in w]
    idx, first_of_f1 = b["indices"].numpy(), int(b["offsets"][B])
    table_of = np.repeat([0, 1], [first_of_f1, len(idx) - first_of_f1])
    if b["pooling_mode"] == int(PoolingMode.NONE):      # index i's row at i * MAX_D, zero-padded
        out = torch.cat([Fn.pad(W[t][int(i)], (0, MAX_D - DIMS[t])) for t, i in zip(table_of, idx)])
    else:
        out = reference_forward(W, [0, 1], PoolingMode(b["pooling_mode"]), b["indices"], b["offsets"],
                                b["per_sample_weights"]).reshape(-1)
    (out * _grad_out(b).double()).sum().backward()
    new = []
    for t in range(2):
        wt, zt, nt = w[t].copy(), z[t].copy(), n[t].copy()
        for r in np.unique(idx[table_of == t]):
            g = W[t].grad[r].numpy()
            if rowwise:
                wr, zr, nr = ftrl_reference_step_rowwise(wt[r:r + 1], zt[r:r + 1], nt[r], g[None], **knobs)
                wt[r], zt[r], nt[r] = wr[0], zr[0], nr
            else:
                wt[r], zt[r], nt[r] = ftrl_reference_step(wt[r], zt[r], nt[r], g, **knobs)
        new.append((wt, zt, nt))
    return out.detach().numpy(), new


@pytest.mark.usefixtures("cpu_kernel")
@pytest.mark.parametrize("pooling,psw", BATCHES, ids=lambda x: x.name if isinstance(x, PoolingMode) else
                         ("psw" if x else "plain"))
@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_composite_equals_cpu_kernel_and_reference(layout, pooling, psw):
    """Bitwise the compiled kernel's forward and update, but for two sums the kernel rounds in
    another order: a MEAN bag (the kernel sums, then scales by 1/L; PyTorch scales each row) and a
    row-wise accum's sum of g^2 (the kernel's 16 fixed lanes; ``torch.mean``'s reduction): there a
    few ulps. Both close to the float64 reference."""
    b = _batch(pooling, psw)
    state = _state(layout)
    expected = _train(state, layout, b, _by_dispatch)
    got = _train(state, layout, b, _by_composite)
    for i, (e, g) in enumerate(zip(expected, got)):
        is_output = i == 0
        if is_output:
            e, g = _defined(e, b), _defined(g, b)
        if (pooling == PoolingMode.MEAN) if is_output else (layout[1] == "rowwise"):
            torch.testing.assert_close(g, e, rtol=2e-6, atol=1e-6)   # another rounding order
        else:
            assert e.dtype == g.dtype and torch.equal(bits(e), bits(g)), i
    _assert_close_to_reference(got, state, layout, b)


def _assert_close_to_reference(got, state, layout, b):
    """``got`` (:func:`_train`'s list) within fp32 tolerances of the float64 :func:`_reference`."""
    got = [t.cpu() for t in got]
    ref_out, ref_tables = _reference(state, layout, b)
    np.testing.assert_allclose(_defined(got[0], b).numpy(), _defined(torch.from_numpy(ref_out), b).numpy(),
                               rtol=1e-5, atol=1e-6)
    arrays = got[1:-1]                             # [weights?], accum, linear after the update
    names = (["weights"] if layout[0] == "stored" else []) + ["accum", "linear"]
    dims = {"accum": (1, 1) if layout[1] == "rowwise" else DIMS}
    for name, flat in zip(names, arrays):
        k = {"weights": 0, "linear": 1, "accum": 2}[name]
        for t, tab in enumerate(_tables(flat, dims.get(name, DIMS))):
            np.testing.assert_allclose(tab, ref_tables[t][k].reshape(tab.shape), rtol=2e-5, atol=1e-6,
                                       err_msg=f"{name} of table {t}")
    assert int(got[-1]) == 0


@pytest.mark.usefixtures("cpu_kernel")
def test_composite_skips_and_counts_nonfinite_rows_like_cpu_kernel():
    layout = ("stored", "elementwise")
    b = _batch(PoolingMode.SUM, False)
    state = _state(layout)
    grad = _grad_out(b)
    grad[TOTAL_D + DIMS[0] + 1] = float("nan")    # bag 1 of feature 1: rows 0 and 2 of table 1
    results = []
    for call in (_by_dispatch, _by_composite):
        arrays = tuple(s.clone() for s in state)
        nonfinite = torch.zeros(1, dtype=torch.int64)
        call(ops.tbe_backward_update_.default, *_update_args(arrays, layout, b, grad, nonfinite))
        results.append([*arrays, nonfinite])
    assert int(results[1][-1]) == 2
    for e, g in zip(*results):
        assert torch.equal(bits(e), bits(g))


def bf16_updates(layout, calls) -> tuple:
    """``(linear before, [arrays after] per call)``: one update of ``layout`` with bf16 ``accum`` and
    ``linear`` (MEAN bags with per-sample weights, step 7) by each of ``calls``; the arrays are the
    weights (stored layouts), ``accum`` and ``linear``."""
    b = _batch(PoolingMode.MEAN, True)
    weights, accum, linear = _state(layout)
    state = (weights, accum.bfloat16(), linear.bfloat16())
    results = []
    for call in calls:
        arrays = tuple(None if s is None else s.clone() for s in state)
        nonfinite = torch.zeros(1, dtype=torch.int64)
        call(ops.tbe_backward_update_.default,
             *_update_args(arrays, layout, b, _grad_out(b), nonfinite, step=7))
        results.append([a for a in arrays if a is not None])
    return state[2], results


@pytest.mark.usefixtures("cpu_kernel")
def test_composite_bf16_states_round_like_cpu_kernel():
    """A bf16 state: the composite's stochastic rounding (``state_dtype``) gives the kernel's bits."""
    linear, (expected, got) = bf16_updates(("derived", "elementwise"), (_by_dispatch, _by_composite))
    assert not torch.equal(got[-1], linear)
    for e, g in zip(expected, got):
        assert torch.equal(bits(e), bits(g))


@pytest.mark.usefixtures("cpu_kernel")
def test_composite_count_invalid():
    b = _batch(PoolingMode.SUM, False)
    args = (b["table_rows"], b["feature_table"], b["bag_feature"])
    assert _by_composite(ops.tbe_count_invalid.default, *args, b["indices"], b["offsets"]).tolist() == [0]
    bad = b["indices"].clone()
    bad[0], bad[5] = ROWS[0], -1                   # one past table 0's rows; a negative row of table 1
    for call in (_by_dispatch, _by_composite):
        assert call(ops.tbe_count_invalid.default, *args, bad, b["offsets"]).tolist() == [2]
        assert call(ops.tbe_count_invalid.default, *args, b["indices"], b["offsets"][:0]).tolist() == [1]


def test_bad_knob_is_refused_by_name():
    layout = ("stored", "elementwise")
    b = _batch(PoolingMode.SUM, False)
    args = list(_forward_args(_state(layout), layout, b))
    args[18] = args[18].clone()                    # the knob tensor
    args[18][0] = 0.0                              # lr
    with pytest.raises(ValueError, match=r"learning_rate \(lr\) must be > 0"):
        _by_composite(ops.tbe_forward.default, *args)


_NO_CPU_KERNEL = """
import sys
import torch
import torchrec_ftrl
sys.path.insert(0, "tests")
import test_ops_composite as t
from torchrec_ftrl.kernels.cpu import backend as cpp_backend
from torchrec_ftrl.fbgemm_enums import PoolingMode
assert cpp_backend._library is None
assert not torch._C._dispatch_has_kernel_for_dispatch_key("torchrec_ftrl::tbe_forward", "CPU")
layout = ("derived", "rowwise")
b = t._batch(PoolingMode.MEAN, True)
state = t._state(layout)
torch.save(t._train(state, layout, b, t._by_dispatch), sys.argv[1])
ops = torch.ops.torchrec_ftrl
args = tuple(s.clone() for s in state[1:])
torch.library.opcheck(ops.tbe_forward.default, t._forward_args((None, *args), layout, b, torch.bfloat16))
torch.library.opcheck(ops.tbe_count_invalid.default, (b["table_rows"], b["feature_table"],
                      b["bag_feature"], b["indices"], b["offsets"]))
torch.library.opcheck(ops.tbe_backward_update_.default, t._update_args(
    (None, *args), layout, b, t._grad_out(b), torch.zeros(1, dtype=torch.int64)))
print("opcheck passed")
"""


def test_cpu_without_its_kernel_runs_the_composite(tmp_path):
    """A process that never loads the compiled kernel: plain ``torch.ops`` calls on CPU tensors run
    the composite (the dispatcher's fallback: bitwise what the composite's dispatch key runs here),
    and pass ``opcheck`` (schema, fake tensors, autograd registration, AOT dispatch)."""
    layout = ("derived", "rowwise")
    b = _batch(PoolingMode.MEAN, True)
    expected = _train(_state(layout), layout, b, _by_composite)
    path = tmp_path / "composite.pt"
    p = subprocess.run([sys.executable, "-c", _NO_CPU_KERNEL, str(path)], capture_output=True, text=True,
                       timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "opcheck passed" in p.stdout
    for e, g in zip(expected, torch.load(path)):
        assert torch.equal(bits(e), bits(g))


@pytest.mark.filterwarnings("ignore:Warning only once:UserWarning")   # the CPU kernel overridden
@pytest.mark.parametrize("weights,accumulator,state_dtype", [
    ("stored", "elementwise", SparseType.FP32), ("derived", "rowwise", SparseType.BF16)])
def test_tbe_through_the_composite_ops_trains_as_backend_torch(weights, accumulator, state_dtype):
    """The TBE's own batches (per-sample weights, MEAN, duplicates, an empty bag), passed to the ops
    by the "cpp" backend with the composite standing in for the compiled kernel, train bit for bit as
    ``backend="torch"``: the ops' arguments mean to the composite what the TBE's batch means to the
    PyTorch backend."""
    idx = torch.tensor([3, 7, 7, 32, 9, 0, 5, 5])
    off = torch.tensor([0, 2, 3, 3, 5, 6, 8])          # 3 features x 2 bags
    psw = torch.linspace(0.5, 1.5, idx.numel())

    def train(backend):
        torch.manual_seed(0)
        m = FTRLTableBatchedEmbeddingBags(
            [(50, 8), (40, 16)], feature_table_map=[0, 1, 1], pooling_mode=PoolingMode.MEAN,
            learning_rate=0.3, ftrl_l1_reg=0.01, ftrl_beta=0.5, ftrl_l2_shrinkage=0.02,
            ftrl_initial_accumulator_value=0.1, backend=backend, ftrl_weights=weights,
            ftrl_accumulator=accumulator, optimizer_state_dtypes={"accum": state_dtype, "linear": state_dtype})
        for _ in range(2):
            out = m(idx, off, per_sample_weights=psw)
            out.backward(torch.linspace(-1.0, 1.0, out.numel()).view_as(out))
        return tbe_state(m)

    with torch.library._scoped_library(NAMESPACE, "IMPL") as lib:
        for name in ("tbe_forward", "tbe_count_invalid", "tbe_backward_update_"):
            lib.impl(name, getattr(composite, name), "CPU")
        via_ops = train("cpp")
    assert_same_bits(train("torch"), via_ops)
