"""The registered operators ``torch.ops.torchrec_ftrl.*`` (torchrec_ftrl/kernels/ops.py) and their
CPU kernels: values against the float64 reference, PyTorch's ``opcheck`` (schema, fake tensors,
dispatch), ``torch.compile(fullgraph=True)``, and the prebuilt ISA variants."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import REPO, cuda, needs_cuda, reference_update
from torchrec_ftrl.fbgemm_enums import PoolingMode
from torchrec_ftrl.hyperparams import KernelScalars
from torchrec_ftrl.kernels.cpu import backend as cpp_backend
from torchrec_ftrl.kernels.cpu import build as cpu_build
from torchrec_ftrl.kernels.knobs import knob_args
from torchrec_ftrl.kernels.batch import POOL_SUM

ops = torch.ops.torchrec_ftrl
ROWS, DIMS = (5, 3), (4, 8)        # two tables, one feature each
KNOBS = dict(lr=0.5, l1=0.01, l2=0.02, beta=0.3)


@pytest.fixture(scope="module", autouse=True)
def cpu_kernel():
    cpp_backend.load_extension()


def _batch():
    """B = 2 bags per feature: f0 bags [1, 4], [] ; f1 bags [2], [0, 2, 2]; plain [B, 12] output."""
    indices = torch.tensor([1, 4, 2, 0, 2, 2])
    offsets = torch.tensor([0, 2, 2, 3, 6])
    layout = dict(table_w_offset=torch.tensor([0, ROWS[0] * DIMS[0]]), table_dim=torch.tensor(DIMS),
                  feature_table=torch.tensor([0, 1]), bag_feature=torch.tensor([0, 0, 1, 1]),
                  bag_out_offset=torch.tensor([0, 12, 4, 16]), indices=indices, offsets=offsets)
    return layout, indices, offsets


def _kernel_knobs():
    return dict(lr=KNOBS["lr"], neg_power=0.5, l1=KNOBS["l1"], l2=2 * KNOBS["l2"], beta=KNOBS["beta"],
                shrink2=0.0)


def _knob_args(device):
    """The ops' knob arguments ``(knobs, pow_half, has_shrink)`` of :func:`_kernel_knobs`."""
    return knob_args(KernelScalars(**_kernel_knobs()).to_hyperparams(), device)


def _batch_args(layout):
    """The ops' batch arguments (plain SUM bags, no per-sample weights)."""
    return (layout["table_w_offset"], layout["table_dim"], torch.tensor(ROWS), torch.tensor([0, ROWS[0]]),
            layout["feature_table"], layout["bag_feature"], layout["bag_out_offset"], layout["indices"],
            layout["offsets"], None, POOL_SUM, max(DIMS), DIMS, sum(ROWS))


def _forward_args(weights, layout, out_dtype=torch.float32, accum=None, linear=None, rowwise=False):
    """Stored ``weights``, or derived ones (``weights`` None) from ``accum`` and ``linear``."""
    if weights is not None:
        accum = linear = torch.zeros_like(weights)
    warn = torch.zeros(1, dtype=torch.int64, device=linear.device)   # unread: check False
    return (weights, accum, linear, rowwise, *_batch_args(layout), *_knob_args(linear.device), 24, out_dtype,
            warn, False, None, None, None, None, None)


def _tables(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(r, d, generator=g) for r, d in zip(ROWS, DIMS)]


def _update_args(weights, accum, linear, layout, grad_out, nonfinite, rowwise=False, step=0):
    return (weights, accum, linear, rowwise, *_batch_args(layout), grad_out, *_knob_args(linear.device),
            nonfinite, torch.tensor([step], device=linear.device), False, None, None, None, None, None, None,
            None, None)


def test_forward_and_update_match_the_float64_reference():
    layout, indices, offsets = _batch()
    tables = _tables()
    weights = torch.cat([t.flatten() for t in tables])
    accum = torch.full_like(weights, 0.1)
    linear = torch.zeros_like(weights)
    out = ops.tbe_forward(*_forward_args(weights, layout))
    grad_out = torch.linspace(-1.0, 1.0, 24)
    ref = reference_update(tables, [torch.full((r, d), 0.1) for r, d in zip(ROWS, DIMS)],
                           [torch.zeros(r, d) for r, d in zip(ROWS, DIMS)], [0, 1], PoolingMode.SUM,
                           indices, offsets, grad_out.view(2, 12),
                           dict(KNOBS))
    np.testing.assert_allclose(out.view(2, 12).numpy(), ref.out.numpy(), rtol=1e-6, atol=1e-6)
    nonfinite = torch.zeros(1, dtype=torch.int64)
    ops.tbe_backward_update_(*_update_args(weights, accum, linear, layout, grad_out, nonfinite))
    split = [ROWS[0] * DIMS[0]]
    for t, (w, z, n) in enumerate(zip(torch.tensor_split(weights, split), torch.tensor_split(linear, split),
                                      torch.tensor_split(accum, split))):
        np.testing.assert_allclose(w.view(ROWS[t], DIMS[t]).numpy(), ref.w[t], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(z.view(ROWS[t], DIMS[t]).numpy(), ref.z[t], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(n.view(ROWS[t], DIMS[t]).numpy(), ref.n[t], rtol=1e-6, atol=1e-7)
    assert int(nonfinite) == 0


def test_count_invalid():
    layout, indices, offsets = _batch()
    args = (torch.tensor(ROWS), layout["feature_table"], layout["bag_feature"])
    assert ops.tbe_count_invalid(*args, indices, offsets).tolist() == [0]
    bad = indices.clone()
    bad[0], bad[3] = 5, 3                       # row 5 of table 0 (5 rows), row 3 of table 1 (3 rows)
    assert ops.tbe_count_invalid(*args, bad, offsets).tolist() == [2]


def test_opcheck():
    layout, _, _ = _batch()
    weights = torch.cat([t.flatten() for t in _tables()])
    torch.library.opcheck(ops.tbe_forward.default, _forward_args(weights, layout, torch.bfloat16))
    torch.library.opcheck(ops.tbe_count_invalid.default,
                          (torch.tensor(ROWS), layout["feature_table"], layout["bag_feature"],
                           layout["indices"], layout["offsets"]))
    accum, linear = torch.full_like(weights, 0.1), torch.zeros_like(weights)
    torch.library.opcheck(ops.tbe_backward_update_.default,
                          _update_args(weights, accum, linear, layout, torch.linspace(-1, 1, 24),
                                       torch.zeros(1, dtype=torch.int64)))


def test_opcheck_derived_rowwise():
    """The lean layouts through the same schemas: no weights, a row-wise bf16 accum ``[total_rows]``."""
    layout, _, _ = _batch()
    linear = torch.cat([t.flatten() for t in _tables()])
    accum = torch.full((sum(ROWS),), 0.5, dtype=torch.bfloat16)
    torch.library.opcheck(ops.tbe_forward.default,
                          _forward_args(None, layout, torch.float16, accum, linear, rowwise=True))
    torch.library.opcheck(ops.tbe_backward_update_.default,
                          _update_args(None, accum, linear, layout, torch.linspace(-1, 1, 24),
                                       torch.zeros(1, dtype=torch.int64), rowwise=True, step=3))


def test_fake_tensors_give_shape_and_dtype():
    layout, _, _ = _batch()
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) for k, v in layout.items()}
        out = ops.tbe_forward(*_forward_args(mode.from_tensor(torch.zeros(44)), fake, torch.float16))
    assert out.shape == (24,) and out.dtype == torch.float16


def test_forward_compiles_without_graph_break():
    layout, _, _ = _batch()
    weights = torch.cat([t.flatten() for t in _tables()])

    def lookup(w):
        return ops.tbe_forward(*_forward_args(w, layout)) * 2.0

    compiled = torch.compile(lookup, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(weights), lookup(weights))


@pytest.mark.parametrize("capability,variant", [("AVX512", "avx512"), ("AVX2", "avx2"),
                                                ("DEFAULT", "default"), ("ZVECTOR", "default")])
def test_isa_variant(capability, variant):
    assert cpu_build.isa_variant(capability) == variant


_PROBE = """
import torch
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.kernels.cpu import backend as cpp_backend
# Inputs exact in fp32 and made without vectorised float ops (ATen's own kernels round differently
# per CPU capability), so only the FTRL kernel's variant differs between the runs.
tbe = FTRLTableBatchedEmbeddingBags([(50, 16), (30, 40)], learning_rate=0.3, ftrl_l1_reg=0.01,
                                    ftrl_beta=0.5, backend="cpp")
for w in tbe.split_embedding_weights():
    w.copy_(((torch.arange(w.numel()) % 13 - 6).double() / 16).view_as(w))
idx = torch.arange(40) * 7 % 30
off = torch.arange(0, 41, 5)
grad = ((torch.arange(4 * 56) % 11 - 5).double() / 8).float().view(4, 56)
# The lean layout too: derived weights, a row-wise accum (its row sums of squares in fixed lanes).
lean = FTRLTableBatchedEmbeddingBags([(50, 16), (30, 40)], learning_rate=0.3, ftrl_l1_reg=0.01,
                                     ftrl_beta=0.5, ftrl_initial_accumulator_value=0.25, backend="cpp",
                                     ftrl_weights="derived", ftrl_accumulator="rowwise")
lean.linear_dev.copy_(((torch.arange(lean.linear_dev.numel()) % 13 - 6).double() / 4))
for _ in range(3):
    tbe(idx, off).backward(grad)
    lean(idx, off).backward(grad)
print(cpp_backend.load_extension())
states = [tbe.weights, tbe.accum_dev, tbe.linear_dev, lean.accum_dev, lean.linear_dev,
          lean(idx, off).detach()]
print(torch.cat([s.flatten() for s in states]).view(torch.int32).long().sum().item(),
      tbe.weights.view(torch.int32).long().sum().item())
"""


def test_prebuilt_variants_load_and_agree_bitwise():
    """Every ISA variant ``setup.py`` built (``make venv`` installs this checkout, so CI has them) loads
    by ATEN_CPU_CAPABILITY and trains bitwise like the others."""
    built = {isa: cpp_backend._prebuilt(isa) for isa in cpu_build.ISA_FLAGS}
    if not any(built.values()):
        pytest.skip("this checkout was not installed with its CPU kernels (a plain PYTHONPATH run)")
    assert all(built.values()), built
    results = {}
    for isa in cpu_build.ISA_FLAGS:                       # ATEN_CPU_CAPABILITY takes these names
        capability = isa
        if isa == "avx512" and cpu_build.isa_variant(torch.backends.cpu.get_cpu_capability()) != "avx512":
            continue                                      # this CPU cannot run it
        p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300,
                           cwd=REPO, env={**os.environ, "ATEN_CPU_CAPABILITY": capability})
        assert p.returncode == 0, p.stderr[-2000:]
        path, digest = p.stdout.strip().splitlines()[-2:]
        assert os.path.samefile(path, built[isa])
        results[isa] = digest
    assert len(set(results.values())) == 1, results


@pytest.mark.parametrize("mode", ["WARNING", "IGNORE"])
def test_tbe_lookup_compiles_without_graph_break(mode):
    """The TBE's eval forward (CPU kernel) under torch.compile(fullgraph=True) equals eager; FATAL
    is left out: its one host read of the count is a data-dependent branch by design."""
    from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
    from torchrec_ftrl.fbgemm_enums import BoundsCheckMode
    tbe = FTRLTableBatchedEmbeddingBags([(50, 8), (30, 16)], backend="cpp",
                                        bounds_check_mode=getattr(BoundsCheckMode, mode))
    bad = 60 if mode == "WARNING" else 20          # WARNING repairs row 60 of a 30-row table to row 0
    idx, off = torch.tensor([1, 2, 3, 4, 5, 6, bad]), torch.tensor([0, 2, 3, 5, 7])
    with torch.no_grad():
        expected = tbe(idx, off)
        got = torch.compile(tbe, fullgraph=True, backend="aot_eager")(idx, off)
    assert torch.equal(got, expected)


@cuda
@needs_cuda
@pytest.mark.parametrize("weights,accumulator", [("stored", "elementwise"), ("derived", "rowwise")])
def test_cuda_tbe_lookup_compiles_without_graph_break(weights, accumulator):
    """The TBE's eval forward on the Triton backend under torch.compile(fullgraph=True, inductor)
    equals eager bit for bit, with the fused WARNING repair of a bad index; a derived-weights lookup
    reads the knobs (a constant tensor of the traced graph)."""
    from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
    from torchrec_ftrl.fbgemm_enums import BoundsCheckMode
    tbe = FTRLTableBatchedEmbeddingBags([(50, 8), (30, 16)], device="cuda", learning_rate=0.5,
                                        ftrl_weights=weights, ftrl_accumulator=accumulator,
                                        ftrl_l1_reg=0.01, bounds_check_mode=BoundsCheckMode.WARNING)
    idx = torch.tensor([1, 2, 3, 4, 5, 6, 60], device="cuda")     # 60: past table 1's 30 rows
    off = torch.tensor([0, 2, 3, 5, 7], device="cuda")
    tbe(idx, off).sum().backward()                     # non-zero states, so derived weights are too
    with torch.no_grad():
        expected = tbe(idx, off)
        got = torch.compile(tbe, fullgraph=True)(idx, off)
    assert expected.abs().sum() > 0 and torch.equal(got, expected)
