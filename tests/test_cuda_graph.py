"""CUDA-graph capture of an FTRL TBE training step (Triton backend, CUDA only).

A captured forward + backward, replayed on new batches copied into the captured inputs, must match
the float64 reference step by step and end bitwise equal to the same steps run eagerly. Settings a
graph cannot replay are refused at capture, before anything changes.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from conftest import cuda, needs_cuda, reference_update
from reference import reference_knobs
from tbe_harness import bf16_spacing
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.fbgemm_enums import (BoundsCheckMode, ComputeDevice, EmbeddingLocation, PoolingMode,
                                        SparseType)

pytestmark = [cuda, needs_cuda]

SPECS = [(5000, 64), (800, 32), (300, 128)]
FMAP = [0, 1, 2, 0]           # feature 3 shares table 0
KNOBS = dict(learning_rate=0.1, ftrl_l1_reg=1e-3, ftrl_l2_reg=1e-3, ftrl_beta=0.5)
B, L = 64, 6


def _batch(seed):
    """A fixed-shape batch (every bag has L ids; Zipf-like so rows repeat) and its output gradient."""
    g = torch.Generator().manual_seed(seed)
    cols = []
    for f, t in enumerate(FMAP):
        rows = SPECS[t][0]
        ranks = torch.multinomial(torch.arange(1, rows + 1, dtype=torch.float64) ** -1.1, B * L,
                                  replacement=True, generator=g)
        cols.append(ranks)
    idx = torch.cat(cols)
    off = torch.arange(0, idx.numel() + 1, L, dtype=torch.int64)
    grad = torch.randn(B, sum(SPECS[t][1] for t in FMAP), generator=g)
    return idx, off, grad


def _tbe(**kw):
    torch.manual_seed(0)
    m = FTRLTableBatchedEmbeddingBags(SPECS, feature_table_map=FMAP, device="cuda",
                                      bounds_check_mode=kw.pop("bounds_check_mode", BoundsCheckMode.WARNING),
                                      **KNOBS, **kw)
    return m


def _tables(m):
    return ([w.detach().double().cpu() for w in m.split_embedding_weights()],
            [(a.double().cpu(), z.double().cpu()) for a, z in m.split_optimizer_states()])


def _capture(m, static):
    """Warm up on a side stream, then capture one training step over the ``static`` tensors."""
    idx, off, grad = static
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m(idx, off).backward(grad)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = m(idx, off)
        out.backward(grad)
    return graph, out


def test_replayed_steps_match_the_float64_reference_and_eager_steps_bitwise():
    eager, graphed = _tbe(), _tbe()
    warm = _batch(0)
    static = tuple(t.cuda() for t in warm)
    eager(static[0], static[1]).backward(static[2])            # the graphed module's warm-up step
    graph, out = _capture(graphed, static)
    for step in range(1, 6):
        idx, off, grad = _batch(step)
        W0, S0 = _tables(graphed)
        for dst, src in zip(static, (idx, off, grad)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_update(W0, [a for a, _ in S0], [z for _, z in S0], FMAP, PoolingMode.SUM, idx,
                               off, grad, reference_knobs(graphed.hyperparams))
        np.testing.assert_allclose(out.detach().double().cpu().numpy().reshape(-1),
                                   ref.out.numpy().reshape(-1), rtol=5e-5, atol=1e-5)
        W1, S1 = _tables(graphed)
        for t in range(len(SPECS)):
            np.testing.assert_allclose(W1[t].numpy(), ref.w[t], rtol=5e-5, atol=2e-5)
            np.testing.assert_allclose(S1[t][0].numpy(), ref.n[t], rtol=3e-5, atol=1e-6)
            np.testing.assert_allclose(S1[t][1].numpy(), ref.z[t], rtol=5e-5, atol=1e-5)
        eager(idx.cuda(), off.cuda()).backward(grad.cuda())
    for name in ("weights_dev", "accum_dev", "linear_dev", "iter"):
        assert torch.equal(getattr(eager, name), getattr(graphed, name)), name


@pytest.mark.parametrize("states", [{"accum": SparseType.BF16, "linear": SparseType.BF16},
                                    {"linear": SparseType.BF16}])
def test_replays_with_bf16_state_round_with_fresh_steps(states):
    """bf16 state under a CUDA graph: the update reads the step from ``iter`` on the device, so each
    replay rounds stochastically with its own step and the replays end bitwise equal to eager steps
    (a step frozen at capture would round replay k like the capture step: different bits). Each
    replay also matches the float64 reference from the stored state within one bf16 spacing."""
    eager, graphed = _tbe(optimizer_state_dtypes=states), _tbe(optimizer_state_dtypes=states)
    warm = _batch(0)
    static = tuple(t.cuda() for t in warm)
    eager(static[0], static[1]).backward(static[2])
    graph, out = _capture(graphed, static)
    for step in range(1, 6):
        idx, off, grad = _batch(step)
        W0, S0 = _tables(graphed)
        for dst, src in zip(static, (idx, off, grad)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_update(W0, [a for a, _ in S0], [z for _, z in S0], FMAP, PoolingMode.SUM, idx,
                               off, grad, reference_knobs(graphed.hyperparams))
        W1, S1 = _tables(graphed)
        for t in range(len(SPECS)):
            np.testing.assert_allclose(W1[t].numpy(), ref.w[t], rtol=5e-5, atol=2e-5)
            for got, want, stored in ((S1[t][0], ref.n[t], graphed.accum_dev),
                                      (S1[t][1], ref.z[t], graphed.linear_dev)):
                slack = bf16_spacing(np.abs(want) * 1.01) if stored.dtype == torch.bfloat16 else 0.0
                assert np.all(np.abs(got.numpy() - want) <= 1e-5 + slack + 5e-5 * np.abs(want))
        eager(idx.cuda(), off.cuda()).backward(grad.cuda())
    assert int(graphed.iter) == 6
    for name in ("weights_dev", "accum_dev", "linear_dev", "iter"):
        assert getattr(eager, name).dtype == getattr(graphed, name).dtype
        assert torch.equal(getattr(eager, name), getattr(graphed, name)), name


BF16 = {"accum": SparseType.BF16, "linear": SparseType.BF16}


@pytest.mark.parametrize("accumulator,states", [("elementwise", None), ("elementwise", BF16), ("rowwise", None),
                                                ("rowwise", BF16)],
                         ids=["elementwise-fp32", "elementwise-bf16", "rowwise-fp32", "rowwise-bf16"])
def test_lean_layouts_replay_bitwise_as_eager_steps(accumulator, states):
    """Derived weights (no weight array), element-wise or row-wise ``accum``, fp32 or bf16 states:
    each replayed step's output and the states after it are bitwise those of the same step run
    eagerly on a table of the same layout (bf16 states round stochastically with the replay's own
    step, read from ``iter`` on the device)."""
    kw = dict(ftrl_weights="derived", ftrl_accumulator=accumulator)
    if states:
        kw["optimizer_state_dtypes"] = states
    eager, graphed = _tbe(**kw), _tbe(**kw)
    assert graphed.weights_dev.numel() == 0
    assert graphed.accum_dev.dim() == 1 and graphed.accum_dev.numel() == (
        sum(r for r, _ in SPECS) if accumulator == "rowwise" else sum(r * d for r, d in SPECS))
    static = tuple(t.cuda() for t in _batch(0))
    eager(static[0], static[1]).backward(static[2])            # the graphed module's warm-up step
    graph, out = _capture(graphed, static)
    linear0 = graphed.linear_dev.clone()
    for step in range(1, 4):
        idx, off, grad = (t.cuda() for t in _batch(step))
        for dst, src in zip(static, (idx, off, grad)):
            dst.copy_(src)
        graph.replay()
        want = eager(idx, off)
        want.backward(grad)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"output of replay {step}"
        for name in ("accum_dev", "linear_dev", "iter"):
            assert torch.equal(getattr(eager, name), getattr(graphed, name)), (name, step)
    assert not torch.equal(graphed.linear_dev, linear0), "the replays updated nothing"
    for w_eager, w_graphed in zip(eager.split_embedding_weights(), graphed.split_embedding_weights()):
        assert torch.equal(w_eager.cpu(), w_graphed.cpu())


def test_warning_repairs_are_counted_on_replay():
    m = _tbe()
    idx, off, grad = _batch(0)
    static = (idx.cuda(), off.cuda(), grad.cuda())
    graph, _ = _capture(m, static)
    before = int(m.bounds_check_warning)
    bad = idx.clone()
    bad[[3, 10]] = SPECS[0][0] + 7          # two ids past table 0's last row
    static[0].copy_(bad)
    graph.replay()
    torch.cuda.synchronize()
    assert int(m.bounds_check_warning) - before == 2


def test_changing_knobs_after_a_capture_warns():
    m = _tbe()
    static = tuple(t.cuda() for t in _batch(0))
    _capture(m, static)
    with pytest.warns(UserWarning, match="capture the step again"):
        m.set_learning_rate(0.2)
    with pytest.warns(UserWarning, match="capture the step again"):
        m.update_hyper_parameters({"ftrl_l1_reg": 0.5})
    fresh = _tbe()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.set_learning_rate(0.2)       # never captured: no warning
    eval_only = _tbe()
    idx, off, _ = static
    eval_only(idx, off)                    # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        eval_only(idx, off)                # a captured lookup replays no update
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eval_only.set_learning_rate(0.2)
    derived = _tbe(ftrl_weights="derived")     # its lookup reads the knobs: a captured one warns
    derived(idx, off)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        derived(idx, off)
    with pytest.warns(UserWarning, match="capture the step again"):
        derived.set_learning_rate(0.2)


def test_a_replay_reads_the_knobs_of_its_capture():
    """The captured kernels read the knob tensor of the hyper-parameters at capture, which the TBE
    keeps alive after the learning rate changes; a replay then updates with the captured rate, bit
    for bit as an eager step at that rate does."""
    import gc

    from torchrec_ftrl.kernels import knobs
    static = tuple(t.cuda() for t in _batch(0))
    replayed, eager = _tbe(), _tbe()
    graph, _ = _capture(replayed, static)
    key = (id(replayed.hyperparams), replayed.linear_dev.device)
    captured_knobs = knobs._knob_tensors[key]        # made by the warm-up, read by the graph
    eager(static[0], static[1]).backward(static[2])            # the warm-up step of _capture
    with pytest.warns(UserWarning, match="capture the step again"):
        replayed.set_learning_rate(0.9)
    gc.collect()
    assert knobs._knob_tensors.get(key) is captured_knobs     # kept with its hyper-parameters
    graph.replay()
    eager(static[0], static[1]).backward(static[2])            # at the captured learning rate
    torch.cuda.synchronize()
    (w_r, s_r), (w_e, s_e) = _tables(replayed), _tables(eager)
    assert all(torch.equal(a, b) for a, b in zip(w_r, w_e))
    assert all(torch.equal(a, b) for pair_r, pair_e in zip(s_r, s_e) for a, b in zip(pair_r, pair_e))


@pytest.mark.parametrize("kind", ["fatal", "caching", "vbe", "torch_backend"])
def test_uncapturable_settings_are_refused_before_any_change(kind):
    kw = {}
    if kind == "fatal":
        kw["bounds_check_mode"] = BoundsCheckMode.FATAL
    if kind == "torch_backend":
        kw["backend"] = "torch"
    m = (FTRLTableBatchedEmbeddingBags([(r, d, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA) for r, d in SPECS],
                                       feature_table_map=FMAP, device="cuda", cache_load_factor=0.5,
                                       bounds_check_mode=BoundsCheckMode.WARNING, **KNOBS)
         if kind == "caching" else _tbe(**kw))
    idx, off, grad = (t.cuda() for t in _batch(0))
    bsfpr = [[B] for _ in FMAP] if kind == "vbe" else None
    m(idx, off, batch_size_per_feature_per_rank=bsfpr).backward(grad.reshape(-1) if bsfpr else grad)
    torch.cuda.synchronize()
    before = [t.clone() for t in (m.weights_dev, m.accum_dev, m.linear_dev)]
    graph = torch.cuda.CUDAGraph()
    match = {"fatal": "FATAL", "caching": "MANAGED_CACHING", "vbe": "VBE", "torch_backend": "backend='torch'"}[kind]
    with pytest.raises(RuntimeError, match=match):
        with torch.cuda.graph(graph):
            m(idx, off, batch_size_per_feature_per_rank=bsfpr)
    torch.cuda.synchronize()
    for now, then in zip((m.weights_dev, m.accum_dev, m.linear_dev), before):
        assert torch.equal(now, then)
