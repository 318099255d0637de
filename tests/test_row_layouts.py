"""The FTRL TBE in every row layout (derived / stored weights, element-wise / row-wise ``accum``):
training against the float64 oracle, derived against stored bit for bit, weights through the
TBE's API (encoding an initialisation, resets, learning-rate changes), and the refusals.

Backends run here: ``torch`` and ``cpp`` (CPU). The Triton kernels' layouts are tested in
``tests/test_layouts_triton.py``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.kernels.capabilities import Capabilities
from torchrec_ftrl.row_layout import RowLayout, require_kernel_layout
from torchrec_ftrl import row_layout

from conftest import bits
from reference import ftrl_reference_step, ftrl_reference_step_rowwise, ftrl_reference_weight

LAYOUTS = [("stored", "elementwise"), ("stored", "rowwise"), ("derived", "elementwise"),
           ("derived", "rowwise")]
BACKENDS = ["torch", "cpp"]
SPECS = [(12, 4), (9, 3)]          # two tables of different dims in one TBE
KNOBS = dict(learning_rate=0.2, ftrl_l1_reg=0.01, ftrl_l2_reg=0.02, ftrl_beta=0.5,
             ftrl_l2_shrinkage=0.03, ftrl_initial_accumulator_value=0.1)
REF_KNOBS = dict(lr=0.2, l1=0.01, l2=0.02, beta=0.5, l2_shrinkage=0.03)


def _tbe(backend, weights, accumulator, **kw):
    return FTRLTableBatchedEmbeddingBags(SPECS, backend=backend, ftrl_weights=weights,
                                         ftrl_accumulator=accumulator, **{**KNOBS, **kw})


def _batch(step: int):
    """Indices and offsets of 2 features x 3 bags with duplicate rows (feature-major)."""
    g = torch.Generator().manual_seed(step)
    lengths = [2, 3, 1, 2, 0, 3]
    idx = [torch.randint(0, SPECS[0 if k < 3 else 1][0], (n,), generator=g) for k, n in enumerate(lengths)]
    idx[1][0] = idx[0][0]                               # a row twice in one feature
    offsets = torch.tensor([0] + list(np.cumsum(lengths)))
    return torch.cat(idx), offsets


def _state64(m):
    """Per table float64 ``(w, z, n)`` as the TBE holds them (``n`` ``[rows]`` when row-wise)."""
    out = []
    for t, (n, z) in enumerate(m.split_optimizer_states()):
        w = m.split_embedding_weights()[t]
        out.append([w.double().numpy().copy(), z.double().numpy().copy(), n.double().numpy().copy()])
    return out


def _row_gradients(idx, offsets, grad_out, pooling):
    """``{(table, row): float64 [D]}`` summed gradient of each touched row, by hand from the bags."""
    grads = {}
    dims = [SPECS[0][1], SPECS[1][1]]
    for bag in range(len(offsets) - 1):
        f = bag // 3
        lo, hi = int(offsets[bag]), int(offsets[bag + 1])
        col = sum(dims[:f])
        g = grad_out[bag % 3, col:col + dims[f]].double().numpy()
        for i in range(lo, hi):
            scale = 1.0 / (hi - lo) if pooling == "MEAN" else 1.0
            key = (f, int(idx[i]))
            grads[key] = grads.get(key, 0.0) + g * scale
    return grads


def _oracle_step(state, grads, weights, accumulator):
    for (t, r), g in sorted(grads.items()):
        w, z, n = state[t]
        if weights == "derived":
            w_old = ftrl_reference_weight(z[r], n[r], **REF_KNOBS)   # n[r]: [D] or one value
        else:
            w_old = w[r]
        if accumulator == "rowwise":
            w_new, z_new, n_new = ftrl_reference_step_rowwise(w_old[None], z[r][None], n[r:r + 1], g[None],
                                                              **REF_KNOBS)
            w[r], z[r], n[r] = w_new[0], z_new[0], n_new[0]
        else:
            w[r], z[r], n[r] = ftrl_reference_step(w_old, z[r], n[r], g, **REF_KNOBS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weights,accumulator", LAYOUTS)
@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
def test_training_matches_float64_oracle(backend, weights, accumulator, pooling):
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    m = _tbe(backend, weights, accumulator, pooling_mode=getattr(PoolingMode, pooling))
    for t, (rows, dim) in enumerate(SPECS):   # a known start, encoded into z for derived weights
        m.load_weights(t, torch.linspace(-0.3, 0.3, rows * dim).view(rows, dim))
    state = _state64(m)
    if weights == "derived":                  # the encoding keeps the weights to a few ulps
        for t, (rows, dim) in enumerate(SPECS):
            np.testing.assert_allclose(state[t][0], torch.linspace(-0.3, 0.3, rows * dim).view(rows, dim)
                                       .double().numpy(), rtol=1e-6, atol=1e-7)
    for step in range(3):
        idx, off = _batch(step)
        out = m(idx, off)
        grad_out = torch.cos(torch.arange(out.numel(), dtype=torch.float32) * (step + 1)).view(out.shape)
        out.backward(grad_out)
        _oracle_step(state, _row_gradients(idx, off, grad_out, pooling), weights, accumulator)
    got = _state64(m)
    for t in range(len(SPECS)):
        for name, want, have in zip(("w", "z", "n"), state[t], got[t]):
            np.testing.assert_allclose(have, want, rtol=2e-5, atol=2e-6, err_msg=f"table {t} {name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("accumulator", ["elementwise", "rowwise"])
def test_derived_weights_train_bitwise_as_stored_ones(backend, accumulator):
    """fp32 states, a zero start (prox(0, n0) = 0): the same forward outputs and states, bit for
    bit, and the stored weights equal the derived ones."""
    stored = _tbe(backend, "stored", accumulator, ftrl_beta=0.0)
    stored.init_embedding_weights_uniform(0.0, 0.0)
    derived = _tbe(backend, "derived", accumulator, ftrl_beta=0.0)
    derived.init_embedding_weights_uniform(0.0, 0.0)
    for step in range(4):
        idx, off = _batch(step)
        outs = [m(idx, off) for m in (stored, derived)]
        assert torch.equal(bits(outs[0]), bits(outs[1])), f"step {step}: forward outputs differ"
        g = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(step))
        for out in outs:
            out.backward(g)
    for name in ("accum_dev", "linear_dev"):
        assert torch.equal(bits(getattr(stored, name)), bits(getattr(derived, name))), name
    for w_stored, w_derived in zip(stored.split_embedding_weights(), derived.split_embedding_weights()):
        assert torch.equal(bits(w_stored), bits(w_derived))


def test_layout_buffers_and_state_shapes():
    total = sum(r * d for r, d in SPECS)
    rows = sum(r for r, _ in SPECS)
    for weights, accumulator in LAYOUTS:
        m = _tbe("torch", weights, accumulator)
        assert m.weights_dev.numel() == (total if weights == "stored" else 0)
        assert m.accum_dev.numel() == (rows if accumulator == "rowwise" else total)
        assert m.linear_dev.numel() == total
        for (r, d), state in zip(SPECS, m.get_optimizer_state()):
            assert tuple(state["accum"].shape) == ((r,) if accumulator == "rowwise" else (r, d))
            assert tuple(state["linear"].shape) == (r, d)
        assert [tuple(w.shape) for w in m.split_embedding_weights()] == SPECS
        assert m.row_layout == RowLayout(weights=weights, accumulator=accumulator)


def test_load_weights_encodes_where_q_allows_and_warns_once_where_not(monkeypatch):
    w0 = torch.tensor([[0.5, -0.25, 0.0, 1e-3]] * SPECS[0][0])
    m = _tbe("torch", "derived", "elementwise", ftrl_l1_reg=0.0, ftrl_l2_reg=0.0)
    m.load_weights(0, w0)
    np.testing.assert_allclose(m.derived_weights(0).numpy(), w0.numpy(), rtol=1e-6)
    monkeypatch.setattr(row_layout, "_warned_dropped", False)
    zero_q = _tbe("torch", "derived", "rowwise", ftrl_beta=0.0, ftrl_l2_reg=0.0,
                  ftrl_initial_accumulator_value=0.0)
    with pytest.warns(UserWarning, match=r"cannot hold 48 non-zero initial weight\(s\)"):
        zero_q.load_weights(0, w0 * 0 + 0.5)
    assert torch.equal(zero_q.derived_weights(0), torch.zeros(SPECS[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # once per process
        zero_q.load_weights(0, w0 * 0 + 0.5)


def test_load_weights_bad_arguments_name_them():
    m = _tbe("torch", "derived", "rowwise")
    with pytest.raises(ValueError, match=r"^load_weights: t must be a table id in \[0, 2\), got 5$"):
        m.load_weights(5, torch.zeros(SPECS[0]))
    with pytest.raises(ValueError, match=r"^load_weights: weights of table 't1' must be a floating-point "
                                         r"\[k, 3\] tensor, got \[9, 4\] torch.float32$"):
        m.load_weights(1, torch.zeros(9, 4))
    before = [bits(m.linear_dev), bits(m.accum_dev)]
    for kwargs, message in (
            (dict(row_start=True), r"row_start must be an int in \[0, 7\] for 2 rows of table 't1' \(9 rows\), got True"),
            (dict(row_start=8), r"row_start must be an int in \[0, 7\] .* got 8"),
            (dict(row_ids=torch.tensor([1.0, 2.0])), r"row_ids must be an int64 or int32 tensor of 2 row ids, "
                                                     r"got torch.float32 \[2\]"),
            (dict(row_ids=torch.tensor([1, 9])), r"row_ids must be row ids of table 't1' in \[0, 9\), got \[1, 9\]")):
        with pytest.raises(ValueError, match=message):
            m.load_weights(1, torch.zeros(2, 3), **kwargs)
    with pytest.raises(ValueError, match="hold NaN or Inf"):
        m.load_weights(1, torch.full((9, 3), float("nan")))
    assert all(torch.equal(a, b) for a, b in zip([bits(m.linear_dev), bits(m.accum_dev)], before))
    stored = _tbe("torch", "stored", "elementwise")
    stored.load_weights(0, torch.full((2, 4), 0.5), row_ids=torch.tensor([1, 3]))
    assert torch.equal(stored.split_embedding_weights()[0][torch.tensor([1, 3])], torch.full((2, 4), 0.5))


@pytest.mark.parametrize("accumulator", ["elementwise", "rowwise"])
def test_learning_rate_change_moves_every_derived_weight_at_once(accumulator):
    m = _tbe("torch", "derived", accumulator, ftrl_l1_reg=0.0)
    m.load_weights(0, torch.full(SPECS[0], 0.2))
    z = m.split_optimizer_states()[0][1].double().numpy().copy()
    n = m.split_optimizer_states()[0][0].double().numpy().copy()
    n = n[:, None] if accumulator == "rowwise" else n
    m.set_learning_rate(0.05)
    want = ftrl_reference_weight(z, n, **{**REF_KNOBS, "lr": 0.05, "l1": 0.0})
    np.testing.assert_allclose(m.derived_weights(0).double().numpy(), want, rtol=1e-6)
    assert not np.allclose(want, 0.2)


@pytest.mark.parametrize("weights,accumulator", LAYOUTS)
def test_reset_rows_start_afresh(weights, accumulator):
    m = _tbe("torch", weights, accumulator)
    idx, off = _batch(0)
    m(idx, off).sum().backward()
    rows = torch.tensor([int(idx[0]), 3])
    m.reset_embedding_weight_momentum(rows, torch.tensor([0, 2]), torch.tensor([0], dtype=torch.int32),
                                      torch.tensor([0], dtype=torch.int32))
    accum, linear = m.split_optimizer_states()[0]
    assert torch.equal(linear[rows], torch.zeros(2, SPECS[0][1]))
    assert torch.equal(accum[rows].float(), torch.full(accum[rows].shape, 0.1))
    assert torch.equal(m.split_embedding_weights()[0][rows], torch.zeros(2, SPECS[0][1]))


def test_layout_refusals_name_the_layout():
    only_stored = Capabilities(cached_placement=True)
    with pytest.raises(ValueError, match=r"^tbe: the triton backend under MANAGED_CACHING implements "
                                         r"nothing; got ftrl_weights='derived', ftrl_accumulator='rowwise'$"):
        require_kernel_layout(RowLayout("derived", "rowwise"), "tbe", only_stored, "triton", cached=True)
    with pytest.raises(ValueError, match=r"^tbe: the cpp backend implements ftrl_weights='stored' with "
                                         r"ftrl_accumulator='elementwise'; got ftrl_weights='stored', "
                                         r"ftrl_accumulator='rowwise'$"):
        require_kernel_layout(RowLayout("stored", "rowwise"), "tbe", only_stored, "cpp")


def test_derived_weight_tensor_reads_and_writes_the_table(monkeypatch, tmp_path):
    """DerivedWeight: reads are prox(z, n) (float64 reference), writes encode, row views stay views,
    chunked copies and writes give the same values as whole ones, pickling gives a plain tensor."""
    from torchrec_ftrl.tbe import derived_weight
    monkeypatch.setattr(derived_weight, "CHUNK_ROWS", 5)      # several chunks per table
    m = _tbe("torch", "derived", "elementwise", ftrl_l1_reg=0.0)
    w = m.split_embedding_weights()[0]
    assert isinstance(w, derived_weight.DerivedWeight) and tuple(w.shape) == SPECS[0] and w.dtype == torch.float32
    src = torch.linspace(-0.5, 0.5, 48).view(12, 4)
    w.copy_(src)
    accum, linear = (x.double().numpy() for x in m.split_optimizer_states()[0])
    want = ftrl_reference_weight(linear, accum, **{**REF_KNOBS, "l1": 0.0})
    np.testing.assert_allclose(want, src.double().numpy(), rtol=1e-6, atol=1e-8)   # encoded
    np.testing.assert_allclose(w.to(torch.float64).numpy(), want, rtol=1e-6)      # read (chunked copy)
    np.testing.assert_allclose(w.numpy(), want, rtol=1e-6)
    view = w[3:7]
    assert isinstance(view, derived_weight.DerivedWeight) and tuple(view.shape) == (4, 4)
    view.fill_(0.25)
    got = w.clone()
    np.testing.assert_allclose(got[3:7].numpy(), np.full((4, 4), 0.25), rtol=1e-6)
    np.testing.assert_allclose(got[:3].numpy(), src[:3].numpy(), rtol=1e-6)        # other rows kept
    before = bits(m.linear_dev)
    w.copy_(w.clone())                                                             # unchanged weights
    assert torch.equal(bits(m.linear_dev), before), "a write of the same weights changed linear"
    rows = torch.tensor([1, 9, 4])
    np.testing.assert_allclose(w[rows].numpy(), got[rows].numpy())                 # w[rows]: those rows
    w[rows] = torch.full((3, 4), -0.125)                                           # w[rows] = v
    np.testing.assert_allclose(w.clone()[rows].numpy(), np.full((3, 4), -0.125), rtol=1e-6)
    np.testing.assert_allclose(w.clone()[0].numpy(), src[0].numpy(), rtol=1e-6)
    torch.save(w, tmp_path / "w.pt")
    loaded = torch.load(tmp_path / "w.pt")
    assert type(loaded) is torch.Tensor and torch.equal(loaded, w.clone())


def test_derived_weight_views_it_cannot_hold_refuse_writes():
    """Reads through any view work; a write through a view the table cannot hold (an element, part
    of a row, a column, a reshape, a split) raises instead of being lost, and so does out=; row
    indices out of a view's bounds raise IndexError as for a tensor. (One whole row, ``w[i]``, is a
    writable DerivedRow: tests/test_newcomer.py.)"""
    from torchrec_ftrl.tbe.derived_weight import DerivedRow
    m = _tbe("torch", "derived", "rowwise")
    w = m.split_embedding_weights()[0]
    full = w.clone()
    assert torch.equal(w[:, 1].clone(), full[:, 1]) and torch.equal(w.t().clone(), full.t())
    assert isinstance(w[0], DerivedRow) and float(w[2, 3]) == float(full[2, 3])
    before = bits(m.linear_dev)
    for write in (lambda: w[0].__setitem__(1, 0.5), lambda: w[:, 1].fill_(0.5), lambda: w.view(-1)[0].zero_(),
                  lambda: w.split(5)[0].fill_(0.5)):
        with pytest.raises(RuntimeError, match="the write would not reach the table"):
            write()
    with pytest.raises(RuntimeError, match="out= a derived-weights table"):
        torch.mul(full, 2, out=w)
    assert torch.equal(bits(m.linear_dev), before)
    with pytest.raises(IndexError, match="index 7 is out of bounds for dimension 0 with size 5"):
        w[0:5][torch.tensor([7])]
    with pytest.raises(IndexError, match="index -13 is out of bounds"):
        w[torch.tensor([-13])]
    np.testing.assert_allclose(w[5:10][torch.tensor([-1])].numpy(), full[9:10].numpy())
