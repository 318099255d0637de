"""The CUDA implementations of ``torch.ops.torchrec_ftrl.tbe_forward`` / ``tbe_backward_update_``
(torchrec_ftrl/kernels/cuda/impls.py: the Triton backend through the ops' schemas).

On a CPU-only machine the ``interp`` tests call those implementations directly on CPU tensors under
``TRITON_INTERPRET=1`` (child pytest, :func:`test_interpreter_suite`), against the compiled CPU kernel
of the same ops and the float64 reference of ``test_ops_composite``: every fp32 row layout, pooling
mode and per-sample weights (within fp32 tolerances: the CPU and Triton kernels keep their own
arithmetic), and bf16 states. The ``cuda`` test checks that the dispatcher runs them
for CUDA tensors."""

import pytest
import torch

from conftest import bits, cuda, interpreter_parent, needs_cuda, run_interpreter_suite
from test_ops_composite import (BATCHES, LAYOUTS, NAMESPACE, _assert_close_to_reference, _batch,
                                _by_composite, _by_dispatch, _defined, _state, _train, bf16_updates,
                                cpu_kernel)  # noqa: F401  (cpu_kernel: a fixture)
from torchrec_ftrl.fbgemm_enums import PoolingMode

pytest.importorskip("triton")

CUDA = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


def _by_triton(op, *args):
    """The op's CUDA implementation (the Triton backend, registered by ``cuda_impls``), called
    directly through its dispatch key, whatever the tensors' device: CPU tensors run it under the
    interpreter."""
    return op.redispatch(CUDA, *args)


@interpreter_parent
def test_interpreter_suite():
    """Runs the ``interp`` tests below in a child pytest with TRITON_INTERPRET=1 (CPU tensors)."""
    run_interpreter_suite(__file__, timeout=600)


@pytest.mark.usefixtures("cpu_kernel")
@pytest.mark.parametrize("pooling,psw", BATCHES, ids=lambda x: x.name if isinstance(x, PoolingMode) else
                         ("psw" if x else "plain"))
@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_interp_triton_impls_close_to_cpu_kernel_and_reference(interp, layout, pooling, psw):
    """Close to the compiled kernel of the same ops (the two keep their own fp32 arithmetic: a few
    ulps apart, as between the backends) and to the float64 reference."""
    b = _batch(pooling, psw)
    state = _state(layout)
    expected = _train(state, layout, b, _by_dispatch)
    got = _train(state, layout, b, _by_triton)
    torch.testing.assert_close(_defined(got[0], b), _defined(expected[0], b), rtol=1e-6, atol=1e-7)
    for e, g in zip(expected[1:], got[1:]):
        torch.testing.assert_close(g, e, rtol=2e-5, atol=2e-6)
    _assert_close_to_reference(got, state, layout, b)


@pytest.mark.usefixtures("cpu_kernel")
@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_interp_triton_impls_bf16_states_round_like_cpu_kernel(interp, layout):
    """bf16 states: the Triton update's stochastic rounding by the op's ``step`` (the same hash in
    every backend) gives the compiled kernel's bits; a stored fp32 weight is within fp32 tolerance."""
    linear, (expected, got) = bf16_updates(layout, (_by_dispatch, _by_triton))
    assert not torch.equal(got[-1], linear)
    for e, g in zip(expected, got):
        assert e.dtype == g.dtype
        if e.dtype == torch.bfloat16:
            assert torch.equal(bits(e), bits(g))
        else:
            torch.testing.assert_close(g, e, rtol=2e-5, atol=2e-6)


def test_interp_cuda_impls_run_the_triton_backend(interp, monkeypatch):
    """The registered CUDA implementations call the Triton backend's forward and update (and no other
    backend's)."""
    from torchrec_ftrl.kernels.pytorch import rows as torch_backend
    from torchrec_ftrl.kernels.cuda import backend as triton_backend
    calls = []
    for module, name in ((triton_backend, "tbe_forward"), (triton_backend, "tbe_backward_update_"),
                         (torch_backend, "forward"), (torch_backend, "backward_update_")):
        def spy(*args, _f=getattr(module, name), _key=f"{module.__name__.split('.', 2)[2]}.{name}"):
            calls.append(_key)
            return _f(*args)
        monkeypatch.setattr(module, name, spy)
    layout = ("derived", "rowwise")
    _train(_state(layout), layout, _batch(PoolingMode.SUM, False), _by_triton)
    assert calls == ["cuda.backend.tbe_forward", "cuda.backend.tbe_backward_update_"]


@cuda
@needs_cuda
@pytest.mark.parametrize("pooling,psw", BATCHES[1:4:2], ids=["SUM-psw", "MEAN-psw"])
@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_ops_on_cuda_tensors_run_triton(layout, pooling, psw):
    """CUDA tensors: the dispatcher runs the Triton implementations, close to the float64 reference
    and to the composite (PyTorch) implementation on the same tensors."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::tbe_forward", "CUDA")
    b = _batch(pooling, psw)
    state = _state(layout)
    on_cuda = {k: v.cuda() if torch.is_tensor(v) else v for k, v in b.items()}
    state_cuda = tuple(None if s is None else s.cuda() for s in state)
    got = _train(state_cuda, layout, on_cuda, _by_dispatch)
    assert all(t.is_cuda for t in got)
    _assert_close_to_reference(got, state, layout, b)
    composite = _train(state_cuda, layout, on_cuda, _by_composite)
    for g, c in zip(got, composite):
        torch.testing.assert_close(g, c, rtol=2e-5, atol=2e-6)


def test_knob_tensor_holds_the_knobs_while_its_hyperparams_live():
    """The Triton kernels' one knob argument: the rule's scalars as fp32 in ``rule_spec.KNOBS``
    order (lr, -p, l1, the L2 term, beta, 2 s), one tensor per hyper-parameter object, dropped with
    it; flags from the same knobs."""
    import gc

    from torchrec_ftrl.hyperparams import FTRLHyperparams
    from torchrec_ftrl.kernels import knobs as knobs_module

    hp = FTRLHyperparams(learning_rate=0.05, learning_rate_power=-0.3, l1_reg=0.01, l2_reg=0.002,
                         beta=1.5, l2_shrinkage=0.004)           # l2 as tensorflow: 2 * l2_reg
    expected = torch.tensor([0.05, 0.3, 0.01, 2 * 0.002, 1.5, 2 * 0.004], dtype=torch.float64)
    knobs = knobs_module.knob_tensor(hp, torch.device("cpu"))
    assert knobs.dtype == torch.float32 and bits(knobs).equal(bits(expected.float()))
    assert knobs_module.knob_tensor(hp, torch.device("cpu")) is knobs       # built once
    twin = FTRLHyperparams(**{f: getattr(hp, f) for f in hp.__dataclass_fields__})
    assert knobs_module.knob_tensor(twin, torch.device("cpu")) is not knobs  # per object
    assert knobs_module.knob_flags(hp) == (False, True)
    assert knobs_module.knob_flags(FTRLHyperparams(learning_rate=0.1)) == (True, False)
    key = (id(hp), torch.device("cpu"))
    assert key in knobs_module._knob_tensors
    del hp
    gc.collect()
    assert key not in knobs_module._knob_tensors


def test_knob_tensor_made_under_capture_is_not_cached(monkeypatch):
    """Under CUDA-graph capture the knobs are written by recorded fill kernels (empty until a
    replay), so that tensor never serves a later eager use: the next eager call builds its own.
    (Capture is stood in for on the CPU, where the fills run at once.)"""
    from torchrec_ftrl.hyperparams import FTRLHyperparams
    from torchrec_ftrl.kernels import knobs as knobs_module

    hp = FTRLHyperparams(learning_rate=0.25, l1_reg=0.5)
    monkeypatch.setattr(knobs_module, "capturing", lambda device: True)
    captured = knobs_module.knob_tensor(hp, torch.device("cpu"))
    assert (id(hp), torch.device("cpu")) not in knobs_module._knob_tensors
    assert captured.tolist() == [0.25, 0.5, 0.5, 0.0, 0.0, 0.0]      # lr, -p, l1, l2, beta, 2 s
    monkeypatch.setattr(knobs_module, "capturing", lambda device: False)
    eager = knobs_module.knob_tensor(hp, torch.device("cpu"))
    assert eager is not captured and (id(hp), torch.device("cpu")) in knobs_module._knob_tensors


def test_setting_the_same_knobs_keeps_the_hyperparameter_object():
    """TorchRec's fused optimizer sets the learning rate at every step: an unchanged value keeps the
    TBE's hyper-parameter object (and so the kernels' knob tensor); a new one replaces it."""
    from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
    tbe = FTRLTableBatchedEmbeddingBags([(10, 4)], backend="torch", learning_rate=0.1)
    hp = tbe.hyperparams
    tbe.set_learning_rate(0.1)
    tbe.update_hyper_parameters({"ftrl_l1_reg": 0.0})
    assert tbe.hyperparams is hp
    tbe.set_learning_rate(0.2)
    assert tbe.hyperparams is not hp and tbe.hyperparams.learning_rate == 0.2
