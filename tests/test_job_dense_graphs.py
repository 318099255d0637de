"""The CTR job's dense part as CUDA graphs: ``--dense-cuda-graphs`` (``cli.resolve_dense_cuda_graphs``)
and ``model.graph_dense`` (``torch.cuda.make_graphed_callables`` of the bottom MLP, interaction and top
MLP).

Independent checks: the graphed dense part's logits and gradients against a float64 copy of the same
module run eagerly; a replay does not change logits already returned; a batch of another size runs the
eager function; the job trains what the eager job trains.
"""

import copy
import json
import os
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import cuda, needs_cuda, run_job

SMALL = ["--device", "cpu", "--num-embeddings", "2000", "--no-progress", "--batch-size", "64",
         "--steps", "4", "--eval-every", "4", "--log-every", "2", "--val-batches", "1"]


@pytest.mark.parametrize("value, device_type, world_size, batch, expected", [
    ("auto", "cuda", 1, 8192, True), ("auto", "cuda", 1, 32767, True), ("auto", "cuda", 1, 32768, False),
    ("auto", "cuda", 2, 8192, False), ("auto", "cpu", 1, 8192, False), ("on", "cuda", 1, 65536, True),
    ("off", "cuda", 1, 8192, False), ("off", "cpu", 4, 64, False)])
def test_dense_cuda_graphs_resolve(value, device_type, world_size, batch, expected):
    from torchrec_ftrl.job.cli import resolve_dense_cuda_graphs

    assert resolve_dense_cuda_graphs(value, device_type, world_size, batch) is expected


def test_dense_cuda_graphs_on_several_ranks_is_refused():
    from torchrec_ftrl.job.cli import resolve_dense_cuda_graphs
    from torchrec_ftrl.job.errors import JobConfigError

    with pytest.raises(JobConfigError, match="--dense-cuda-graphs on runs on one rank; this run has 2"):
        resolve_dense_cuda_graphs("on", "cuda", 2, 8192)


def test_dense_cuda_graphs_on_the_cpu_is_one_line(tmp_path):
    p = run_job([*SMALL, "--dense-cuda-graphs", "on", "--output-dir", str(tmp_path)])
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "--dense-cuda-graphs on needs a CUDA device" in p.stderr
    p = run_job([*SMALL, "--dense-cuda-graphs", "maybe", "--output-dir", str(tmp_path)])
    assert p.returncode == 2 and "--dense-cuda-graphs" in p.stderr and "'maybe'" in p.stderr


def test_a_cpu_run_records_no_graphs(tmp_path):
    p = run_job([*SMALL, "--output-dir", str(tmp_path)])
    assert p.returncode == 0, p.stderr[-3000:]
    with open(os.path.join(tmp_path, "train_ctr_summary.json")) as f:
        s = json.load(f)
    assert s["dense_cuda_graphs"] is False and s["dense_graph_calls"] is None


def _model(device, precision="fp32"):
    from torchrec_ftrl.job import model as model_lib

    torch.manual_seed(0)
    return model_lib.build_dlrm(["a", "b"], [50, 60], 8, 3, [16], [16], torch.device(device),
                                dcn=(2, 8), dense_precision=precision)


def test_graph_dense_needs_cuda():
    from torchrec_ftrl.job import model as model_lib

    with pytest.raises(ValueError, match="need its parameters on CUDA, found cpu"):
        model_lib.graph_dense(_model("cpu"), 4)


def test_graphed_logits_replay_only_the_captured_signature():
    """Routing of ``_GraphedDenseLogits`` with a stand-in for the graphed module: the captured
    shapes (and pooled embeddings that require grad) replay and return a copy of the graph's output;
    any other call runs the fallback; both are counted (``dense_graph_calls``)."""
    from torchrec_ftrl.job.model import _GraphedDenseLogits, dense_graph_calls

    static = torch.arange(4.0)
    calls = []
    graphed = lambda d, p: calls.append("graph") or static   # noqa: E731
    fallback = lambda m, d, p, prec, dev: calls.append("eager") or torch.zeros(d.shape[0])  # noqa: E731
    probe = torch.nn.Parameter(torch.zeros(2))
    g = _GraphedDenseLogits(graphed, torch.zeros(4, 3), torch.zeros(4, 2, 8), fallback, probe)
    out = g(None, torch.ones(4, 3), torch.ones(4, 2, 8, requires_grad=True), "fp32", "cpu")
    assert calls == ["graph"] and out.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert out.data_ptr() != static.data_ptr()
    g(None, torch.ones(3, 3), torch.ones(3, 2, 8, requires_grad=True), "fp32", "cpu")   # short batch
    g(None, torch.ones(4, 3), torch.ones(4, 2, 8), "fp32", "cpu")                      # no grad
    g(None, torch.ones(4, 3), torch.ones(4, 2, 8, dtype=torch.float64, requires_grad=True), "fp32", "cpu")
    assert calls == ["graph", "eager", "eager", "eager"]
    model = types.SimpleNamespace(compiled_dense_logits=g)
    assert dense_graph_calls(model) == {"replays": 1, "fallbacks": 3}
    assert dense_graph_calls(types.SimpleNamespace(compiled_dense_logits=None)) is None


def test_a_replay_under_kept_gradients_raises():
    """A replay while the dense parameters hold gradients (zeroed, not freed, or accumulated over
    two backwards) would add the graph's gradient into its own buffer twice: it raises instead."""
    from torchrec_ftrl.job.model import _GraphedDenseLogits

    probe = torch.nn.Parameter(torch.zeros(2))
    probe.grad = torch.zeros(2)
    g = _GraphedDenseLogits(lambda d, p: torch.zeros(4), torch.zeros(4, 3), torch.zeros(4, 2, 8),
                            None, probe)
    with pytest.raises(RuntimeError, match=r"still hold gradients: free them before each forward"):
        g(None, torch.ones(4, 3), torch.ones(4, 2, 8, requires_grad=True), "fp32", "cpu")
    assert g.replays == 0


def _step(logits_of, parts, dense, pooled_value, labels):
    """One forward and backward of ``logits_of(dense, pooled)``; returns logits, the pooled
    embeddings' gradient and the gradients of the parameters of ``parts`` (copies), and frees the
    gradients."""
    pooled = pooled_value.clone().requires_grad_()
    logits = logits_of(dense, pooled)
    F.binary_cross_entropy_with_logits(logits, labels).backward()
    params = [p for n in ("dense_arch", "inter_arch", "over_arch") for p in getattr(parts, n).parameters()]
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return logits, pooled.grad.clone(), grads


def _eager_copy(model, device, dtype):
    """The dense parts of ``model`` copied to ``device`` and ``dtype``, as a module
    ``dense_precision.dense_logits`` takes."""
    parts = torch.nn.Module()
    for name in ("dense_arch", "inter_arch", "over_arch"):
        setattr(parts, name, copy.deepcopy(getattr(model, name)).to(device, dtype))
    return parts


def _inputs(batch, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, generator=g, dtype=dtype),
            torch.randn(batch, 2, 8, generator=g, dtype=dtype),
            torch.randint(0, 2, (batch,), generator=g).to(dtype))


@cuda
@needs_cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graphed_dense_part_matches_a_float64_eager_copy(compiled, monkeypatch):
    """fp32 dense part captured after (optionally) ``compile_dense``: two replays on new inputs give
    the float64 eager copy's logits and gradients; the first call's logits survive the second
    replay; a short batch runs eagerly and matches too."""
    from torchrec_ftrl.job import model as model_lib
    from torchrec_ftrl.job.dense_precision import dense_logits

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = _model("cuda")
    ref = _eager_copy(model, "cpu", torch.float64)
    if compiled:
        model_lib.compile_dense(model, "default")
    model_lib.graph_dense(model, 16)
    first = None
    for seed, batch in ((1, 16), (2, 16), (3, 15)):
        d, p, y = _inputs(batch, torch.float64, seed)
        want = _step(lambda a, b: dense_logits(ref, a, b, "fp32", "cpu"), ref, d, p, y)
        got = _step(model.dense_logits, model, d.float().cuda(), p.float().cuda(), y.float().cuda())
        torch.testing.assert_close(got[0].detach().double().cpu(), want[0].detach().double(),
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1].double().cpu(), want[1], rtol=1e-4, atol=1e-6)
        for g, w in zip(got[2], want[2]):
            torch.testing.assert_close(g.double().cpu(), w, rtol=1e-4, atol=1e-6)
        if first is None:
            first = (got[0].detach().clone(), got[0])
    assert torch.equal(first[0], first[1].detach())   # the copy returned by the first replay


@cuda
@needs_cuda
def test_cuda_graphed_bf16_dense_part_matches_eager_bf16():
    """bf16 autocast inside the captured graphs computes what the eager bf16 dense part computes."""
    from torchrec_ftrl.job import model as model_lib
    from torchrec_ftrl.job.dense_precision import dense_logits

    model = _model("cuda", "bf16")
    eager = _eager_copy(model, "cuda", torch.float32)
    model_lib.graph_dense(model, 16)
    for seed in (1, 2):
        d, p, y = (t.cuda() for t in _inputs(16, torch.float32, seed))
        got = _step(model.dense_logits, model, d, p, y)
        want = _step(lambda a, b: dense_logits(eager, a, b, "bf16", "cuda"), eager, d, p, y)
        for g, w in zip([got[0].detach(), got[1], *got[2]], [want[0].detach(), want[1], *want[2]]):
            torch.testing.assert_close(g, w, rtol=2e-2, atol=1e-3)


def _cuda_summary(out_dir, *args):
    p = run_job(["--device", "cuda", "--num-embeddings", "2000", "--no-progress", "--batch-size", "64",
                 "--eval-every", "4", "--val-batches", "1", "--steps", "8", "--log-every", "2", *args,
                 "--output-dir", str(out_dir)])
    assert p.returncode == 0, p.stderr[-3000:]
    with open(os.path.join(out_dir, "train_ctr_summary.json")) as f:
        return p.stdout, json.load(f)


@cuda
@needs_cuda
@pytest.mark.parametrize("compile_dense", ["off", "on"])
def test_cuda_job_with_graphs_trains_what_the_eager_job_trains(tmp_path, compile_dense):
    """The job's default on one GPU captures the dense part (validation between steps runs it
    eagerly); its losses are the eager run's."""
    out, s = _cuda_summary(tmp_path / "graphs", "--compile-dense", compile_dense)
    assert s["dense_cuda_graphs"] is True and s["dense_warmup_s"] > 0
    assert s["dense_graph_calls"] == {"replays": 8, "fallbacks": 0}   # every training step replayed
    assert " in CUDA graphs, " in next(ln for ln in out.splitlines() if ln.startswith("train_ctr: "))
    _, eager = _cuda_summary(tmp_path / "eager", "--compile-dense", "off", "--dense-cuda-graphs", "off")
    assert eager["dense_cuda_graphs"] is False
    assert [v for _, v in s["loss_history"]] == pytest.approx([v for _, v in eager["loss_history"]],
                                                             rel=5e-3)
