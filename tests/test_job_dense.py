"""The CTR job's dense part: ``--dense-precision`` (``torchrec_ftrl/job/dense_precision.py``), the dense
optimizer's implementation (``model.dense_optimizer_options``) and the loss log read back without a host
wait (``loss_log.LossLog``).

Independent checks: the bf16 forward's dtypes are read with hooks on the DLRM blocks; the dense
optimizers the job builds are compared bit for bit with torch's per-parameter loop, and Adagrad with a
float64 transcription of its update; the loss log's means are recomputed in float64 from the step
losses.
"""

import contextlib
import json
import math
import os
import re

import pytest
import torch

from conftest import cuda, needs_cuda, run_job

SMALL = ["--device", "cpu", "--num-embeddings", "2000", "--no-progress", "--batch-size", "64",
         "--steps", "12", "--eval-every", "12", "--log-every", "4", "--val-batches", "2"]


def _run(args, out_dir):
    p = run_job([*SMALL, *args, "--output-dir", str(out_dir)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    with open(os.path.join(out_dir, "train_ctr_summary.json")) as f:
        return p.stdout, json.load(f)


def _start_line(stdout):
    return next(ln for ln in stdout.splitlines() if ln.startswith("train_ctr: "))


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The job on the CPU without --dense-precision."""
    return _run([], tmp_path_factory.mktemp("default"))


def test_default_on_cpu_is_fp32_and_is_what_fp32_trains(default_run, tmp_path):
    stdout, s = default_run
    assert s["dense_precision"] == "fp32" and s["args"]["dense_precision"] == "fp32"
    assert "dense=adagrad lr=0.05 precision=fp32, " in _start_line(stdout)
    _, explicit = _run(["--dense-precision", "fp32"], tmp_path)
    assert explicit["loss_history"] == s["loss_history"]
    assert explicit["validation_history"] == s["validation_history"]


def test_bf16_on_cpu_trains_to_a_finite_loss_near_fp32(default_run, tmp_path):
    stdout, s = _run(["--dense-precision", "bf16"], tmp_path)
    _, fp32 = default_run
    assert s["dense_precision"] == "bf16"
    assert "dense=adagrad lr=0.05 precision=bf16, " in _start_line(stdout)
    assert [st for st, _ in s["loss_history"]] == [4, 8, 12]
    assert all(math.isfinite(v) for _, v in s["loss_history"]) and math.isfinite(s["final_train_loss"])
    assert math.isfinite(s["final_validation"]["auc"])
    # bf16 matmuls round: the losses differ from fp32's, by little over 12 steps
    assert s["loss_history"] != fp32["loss_history"]
    for (_, a), (_, b) in zip(s["loss_history"], fp32["loss_history"]):
        assert abs(a - b) < 0.05


def _main_error_lines(argv, tmp_path, capsys):
    from torchrec_ftrl.job import train

    with pytest.raises(SystemExit) as e:
        train.main([*argv, "--no-progress", "--output-dir", str(tmp_path / "out")])
    assert e.value.code == 2
    assert not (tmp_path / "out").exists()
    return capsys.readouterr().err.strip().splitlines()


def test_tf32_on_cpu_is_one_line_naming_the_flag(tmp_path, capsys):
    lines = _main_error_lines(["--device", "cpu", "--dense-precision", "tf32"], tmp_path, capsys)
    assert lines == ["train_ctr: error: --dense-precision tf32 needs a CUDA device (TF32 is a CUDA "
                     "tensor-core format); this run is on the CPU: use fp32 or bf16"]


def test_bf16_on_a_cuda_device_without_bf16_is_one_line(tmp_path, capsys, monkeypatch):
    from torchrec_ftrl.job import dense_precision, validate

    # a CUDA device, as far as the checks go
    monkeypatch.setattr(validate, "FLAG_CHECKS", tuple(c for c in validate.FLAG_CHECKS
                                                       if c is not validate.check_device))
    monkeypatch.setattr(dense_precision, "cuda_bf16_supported", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    lines = _main_error_lines(["--device", "cuda", "--dense-precision", "bf16"], tmp_path, capsys)
    assert lines == ["train_ctr: error: --dense-precision bf16: Tesla V100-SXM2-16GB has no bf16 support "
                     "(torch.cuda.is_bf16_supported() is False): use fp32 or tf32"]


@pytest.mark.parametrize("native, emulated, given, expected", [
    (True, True, None, "bf16"),     # an A100 / H100: the default
    (False, True, None, "fp32"),    # a V100 / T4: torch emulates bf16, slower than fp32
    (False, False, None, "fp32"),
    (False, True, "bf16", "bf16"),  # given: run as asked where torch can
])
def test_cuda_default_needs_native_bf16(monkeypatch, native, emulated, given, expected):
    """The CUDA default (bf16) needs bf16 in hardware (``is_bf16_supported(including_emulation=
    False)``); elsewhere it is fp32. A given bf16 runs where torch runs it, emulated or not, and is
    refused where it cannot (above)."""
    from torchrec_ftrl.job import cli, validate

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: native or (including_emulation and emulated))
    args = cli.parse_args(["--device", "cuda", *(["--dense-precision", given] if given else [])])
    assert args.dense_precision_given is (given is not None)
    validate.check_dense_precision(args)
    assert args.dense_precision == expected
    assert _precision_for_script(given) == expected


def _precision_for_script(given):
    import argparse

    from torchrec_ftrl.job import dense_precision

    parser, device = argparse.ArgumentParser(), torch.device("cuda")
    with pytest.MonkeyPatch.context() as m:   # no process-wide TF32 switch set from a test
        m.setattr(dense_precision, "set_matmul_precision", lambda precision, device_type: None)
        return dense_precision.resolve_for_script(parser, given, device)


def test_plan_only_takes_any_precision_without_a_gpu(capsys):
    """``--plan-only`` plans a GPU run on any machine: a GPU command line with tf32 plans on the CPU."""
    from torchrec_ftrl.job import train

    train.run(["--device", "cpu", "--plan-only", "--dense-precision", "tf32"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["fits"] is True


def test_a_bad_value_is_refused_by_argparse(tmp_path, capsys):
    lines = _main_error_lines(["--dense-precision", "fp16"], tmp_path, capsys)
    assert len(lines) == 1
    assert re.fullmatch(r"train_ctr: error: argument --dense-precision: invalid choice: '?fp16'? "
                        r"\(choose from '?fp32'?, '?tf32'?, '?bf16'?\)", lines[0]), lines


def test_the_default_is_resolved_per_device():
    from torchrec_ftrl.job import dense_precision as dp

    assert dp.resolve(None, "cpu") == "fp32"
    assert dp.resolve(None, "cuda") == dp.CUDA_DEFAULT_DENSE_PRECISION in dp.DENSE_PRECISIONS
    assert [dp.resolve(p, d) for p in dp.DENSE_PRECISIONS for d in ("cpu", "cuda")] == \
        [p for p in dp.DENSE_PRECISIONS for _ in range(2)]
    with pytest.raises(ValueError, match="--dense-precision must be one of fp32, tf32, bf16, got 'fp16'"):
        dp.resolve("fp16", "cpu")


def _dlrm_blocks():
    from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch

    torch.manual_seed(0)
    m = torch.nn.Module()
    m.dense_arch = DenseArch(3, [8, 4])
    m.inter_arch = InteractionArch(num_sparse_features=2)
    m.over_arch = OverArch(4 + 3, [8, 1])
    return m


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dlrm_logits_autocasts_the_dense_part_only(precision):
    """Under bf16 the bottom MLP, interaction and top MLP compute in bf16; the embedding lookup runs
    outside autocast and its output and gradient stay fp32; the logits and the parameters are fp32."""
    from torchrec_ftrl.job.dense_precision import dlrm_logits

    m = _dlrm_blocks()
    seen = {}
    for name in ("dense_arch", "inter_arch", "over_arch"):
        getattr(m, name).register_forward_hook(
            lambda mod, args, out, name=name: seen.__setitem__(name, out.dtype))
    emb = torch.randn(5, 2, 4, requires_grad=True)

    def embed():
        seen["autocast_in_embed"] = torch.is_autocast_enabled("cpu")
        return emb * 1.0

    logits = dlrm_logits(m, torch.randn(5, 3), embed, precision, "cpu")
    want = torch.bfloat16 if precision == "bf16" else torch.float32
    assert seen == {"dense_arch": want, "inter_arch": want, "over_arch": want, "autocast_in_embed": False}
    assert logits.dtype == torch.float32 and logits.shape == (5,)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.ones(5)).backward()
    assert emb.grad.dtype == torch.float32
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in m.parameters())


def test_tf32_switches_are_set_on_cuda_only(monkeypatch):
    from torchrec_ftrl.job import dense_precision as dp

    before = torch.backends.cuda.matmul.allow_tf32
    dp.set_matmul_precision("tf32", "cpu")
    assert torch.backends.cuda.matmul.allow_tf32 == before
    try:
        dp.set_matmul_precision("tf32", "cuda")
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        dp.set_matmul_precision("fp32", "cuda")
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
        torch.backends.cudnn.allow_tf32 = True


# ------------------------------------------------------------------------------- dense optimizer

def _train(cls, steps=25, **options):
    """Parameters of MLP shapes (odd sizes: vectorised and tail paths) after ``steps`` updates with
    seeded gradients."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((67, 13), (67,), (16, 67), (16,), (1, 33))]
    opt = cls(params, lr=0.05, **options)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 0.37
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("name", ["adagrad", "adam", "sgd"])
def test_the_cpu_dense_optimizer_is_bitwise_torchs_loop(name):
    from torchrec_ftrl.job.model import DENSE_OPTIMIZERS, dense_optimizer_options

    cls = DENSE_OPTIMIZERS[name]
    options = dense_optimizer_options(name, "cpu")
    assert options == {"foreach": True}
    for got, plain in zip(_train(cls, **options), _train(cls, foreach=False)):
        assert torch.equal(got, plain)


def test_adagrad_options_match_a_float64_transcription():
    """Adagrad (lr 0.05, eps 1e-10, no decay): ``G += g * g; w -= lr * g / (sqrt(G) + eps)``, in
    float64, against the job's CPU options and the fused kernel (CUDA's choice; its CPU kernel here)."""
    from torchrec_ftrl.job.model import dense_optimizer_options

    torch.manual_seed(0)
    ref = [torch.randn(s).double() for s in ((67, 13), (67,), (16, 67), (16,), (1, 33))]
    acc = [torch.zeros_like(w) for w in ref]
    g = torch.Generator().manual_seed(1)
    for _ in range(25):
        for w, a in zip(ref, acc):
            grad = (torch.randn(w.shape, generator=g) * 0.37).double()
            a += grad * grad
            w -= 0.05 * grad / (a.sqrt() + 1e-10)
    for options in (dense_optimizer_options("adagrad", "cpu"), {"fused": True}):
        for got, want in zip(_train(torch.optim.Adagrad, **options), ref):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_the_dense_optimizer_frees_gradients_between_steps():
    """``CombinedOptimizer.zero_grad()`` (TorchRec passes ``set_to_none=False``) leaves the job's dense
    gradients None, and steps through backward train the float64 Adagrad transcription of one
    gradient a step (a gradient kept and added to would double it at the second step)."""
    from torchrec.optim.keyed import CombinedOptimizer
    from torchrec_ftrl.job.model import DenseOptimizer

    torch.manual_seed(0)
    params = {"w": torch.nn.Parameter(torch.randn(7, 5)), "b": torch.nn.Parameter(torch.randn(5))}
    coef = {k: torch.randn(p.shape) for k, p in params.items()}
    opt = CombinedOptimizer([DenseOptimizer(params, lambda ps: torch.optim.Adagrad(ps, lr=0.05,
                                                                                 foreach=True))])
    ref = {k: p.detach().double().clone() for k, p in params.items()}
    acc = {k: torch.zeros_like(w) for k, w in ref.items()}
    for _ in range(3):
        opt.zero_grad()
        assert all(p.grad is None for p in params.values())
        sum((p * coef[k]).sum() for k, p in params.items()).backward()   # gradient: coef
        opt.step()
        for k, w in ref.items():
            g = coef[k].double()
            acc[k] += g * g
            w -= 0.05 * g / (acc[k].sqrt() + 1e-10)
    for k, p in params.items():
        torch.testing.assert_close(p.detach().double(), ref[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["adagrad", "adam", "sgd"])
def test_cuda_takes_the_fused_kernel_when_torch_steps_it(name):
    from torchrec_ftrl.job.model import DENSE_OPTIMIZERS, dense_optimizer_options, fused_step_runs

    cls = DENSE_OPTIMIZERS[name]
    assert dense_optimizer_options(name, "cuda", fused_runs=lambda c, d: c is cls) == {"fused": True}
    assert dense_optimizer_options(name, "cuda", fused_runs=lambda c, d: False) == {"foreach": True}
    assert fused_step_runs(cls, "cpu")   # torch >= 2.4 steps every one of them fused on the CPU
    # the fused implementation the CUDA choice names: its CPU kernel agrees with torch's loop
    for got, plain in zip(_train(cls, fused=True), _train(cls, foreach=False)):
        torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-6)


def test_fused_probe_says_no_where_torch_refuses_fused():
    """torch refuses ``fused=True`` in the step for a device its fused kernel does not take (its
    Adagrad on CUDA): the probe then says no, and the CUDA choice is foreach."""
    from torchrec_ftrl.job.model import dense_optimizer_options, fused_step_runs

    class RefusesFused(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of "
                               "supported devices")

    assert not fused_step_runs(RefusesFused, "cpu")
    assert dense_optimizer_options("sgd", "cuda", fused_runs=lambda c, d: fused_step_runs(RefusesFused, "cpu")) \
        == {"foreach": True}


@cuda
@needs_cuda
@pytest.mark.parametrize("name", ["adagrad", "adam", "sgd"])
def test_the_cuda_choice_steps(name):
    """The options chosen for CUDA construct and step on a CUDA parameter."""
    from torchrec_ftrl.job.model import DENSE_OPTIMIZERS, dense_optimizer_options

    cls = DENSE_OPTIMIZERS[name]
    p = torch.nn.Parameter(torch.ones(8, device="cuda"))
    p.grad = torch.full_like(p, 0.5)
    cls([p], lr=0.1, **dense_optimizer_options(name, "cuda")).step()
    assert torch.all(p.detach() < 1.0)


# ------------------------------------------------------------------------------------ loss log

def _losses(n):
    g = torch.Generator().manual_seed(3)
    return [torch.rand((), generator=g) for _ in range(n)]


def _expected_means(losses, windows):
    out, i = [], 0
    for step in windows:
        part = losses[i:step]
        out.append([step, math.fsum(float(x) for x in part) / len(part)])   # float32 values, exact sum
        i = step
    return out


def _log_steps(device, losses, windows):
    from torchrec_ftrl.job.loss_log import LossLog

    history = []
    log = LossLog(device, history)
    for step, loss in enumerate(losses, 1):
        log.add(loss.to(device))
        if step in windows:
            log.close_window(step)
        else:
            log.poll()
    log.flush()
    return history, log


def test_loss_log_means_on_cpu_are_read_at_each_window():
    losses = _losses(10)
    history, log = _log_steps(torch.device("cpu"), losses, (4, 8, 10))
    want = _expected_means(losses, (4, 8, 10))
    assert [s for s, _ in history] == [4, 8, 10]
    for (_, got), (_, w) in zip(history, want):
        assert got == pytest.approx(w, rel=1e-15)
    log.restore(2, 1.25)
    log.add(torch.tensor(0.5))
    assert log.window_n == 3 and log.open_sum() == 1.75


@cuda
@needs_cuda
def test_loss_log_on_cuda_reads_back_without_waiting():
    losses = _losses(10)
    history, _ = _log_steps(torch.device("cuda"), losses, (4, 8, 10))
    cpu_history, _ = _log_steps(torch.device("cpu"), losses, (4, 8, 10))
    assert history == cpu_history


# ------------------------------------------------------------------- kernel events, steady window


def test_steady_kernel_events_are_cuda_only(default_run):
    from torchrec_ftrl.job.train import _kernel_events

    assert _kernel_events(torch.device("cpu")) is None
    _, summary = default_run
    assert "steady_kernel_events" in summary and summary["steady_kernel_events"] is None


def test_variant_count_counts_every_launchers_specialisations(monkeypatch):
    pytest.importorskip("triton")
    from torchrec_ftrl.kernels.cuda import launch

    class Held:   # a launcher holding n compiled specialisations
        def __init__(self, n):
            self._compiled = {i: None for i in range(n)}

    monkeypatch.setattr(launch, "_launchers", {"a": Held(2), "b": Held(0), "c": Held(3)})
    assert launch.variant_count() == 5
    monkeypatch.setattr(launch, "_launchers", {})
    assert launch.variant_count() == 0


def _cuda_summary(out_dir, *args):
    """The summary of a small job run on CUDA (no validation before the end) with ``args``."""
    p = run_job(["--device", "cuda", "--num-embeddings", "2000", "--no-progress", "--batch-size", "64",
                 "--eval-every", "1000000", "--val-batches", "1", *args, "--output-dir", str(out_dir)])
    assert p.returncode == 0, p.stderr[-3000:]
    with open(os.path.join(out_dir, "train_ctr_summary.json")) as f:
        return json.load(f)


@cuda
@needs_cuda
def test_steady_kernel_events_on_cuda(tmp_path):
    """A CUDA run with the kernel warm-up compiles nothing inside its steady window."""
    events = _cuda_summary(tmp_path, "--steps", "30")["steady_kernel_events"]
    assert events["kernel_variants"] == 0 and events.get("python_forward", 0) == 0, events


# ------------------------------------------------------------------- --compile-dense


@pytest.mark.parametrize("value, cuda_run, batch, expected", [
    ("auto", True, 65536, "default"), ("auto", True, 32768, "default"), ("auto", True, 32767, None),
    ("auto", True, 8192, None), ("auto", False, 65536, None), ("on", False, 64, "default"),
    ("on", True, 8192, "default"), ("off", True, 65536, None), ("off", False, 64, None)])
def test_compile_dense_values_resolve_to_torch_compile_modes(value, cuda_run, batch, expected):
    from torchrec_ftrl.job.cli import resolve_compile_dense

    assert resolve_compile_dense(value, cuda_run, batch) == expected


def test_compile_dense_flag_values(default_run, tmp_path):
    from torchrec_ftrl.job.cli import parse_args

    assert parse_args([*SMALL, "--compile-dense"]).compile_dense == "default"   # the bare flag: on
    assert parse_args([*SMALL, "--compile-dense", "off"]).compile_dense is None
    _, s = default_run                                                        # auto on the CPU: off
    assert s["compile_dense"] is None and s["dense_warmup_s"] is None
    for bad in ("maybe", "reduce-overhead"):   # CUDA graphs of the dense part are not offered
        p = run_job([*SMALL, "--compile-dense", bad, "--output-dir", str(tmp_path)])
        assert p.returncode == 2 and "--compile-dense" in p.stderr and f"'{bad}'" in p.stderr


def test_compile_dense_compiles_before_the_first_step(tmp_path):
    """The dense warm-up compiles the training graphs before the loop: no frame is compiled inside
    it (without the warm-up, the first step compiles the dense part), the start line says so, and
    the run trains what the eager run trains, to float32 rounding."""
    args = ["--steps", "6", "--eval-every", "1000000", "--log-every", "2", "--val-batches", "1"]
    stdout, s = _run(["--compile-dense", *args], tmp_path / "compiled")
    assert s["compile_dense"] == "default" and s["dense_warmup_s"] > 0
    assert s["compiled_frames_in_loop"] == 0
    assert "precision=fp32 compiled, " in _start_line(stdout)
    _, eager = _run(args, tmp_path / "eager")
    assert eager["compiled_frames_in_loop"] == 0 and eager["dense_warmup_s"] is None
    assert [v for _, v in s["loss_history"]] == pytest.approx([v for _, v in eager["loss_history"]],
                                                             rel=1e-4)


@cuda
@needs_cuda
def test_compile_dense_on_cuda_compiles_before_the_first_step(tmp_path):
    """On CUDA (default precision bf16), the dense warm-up compiles the graphs the steps run, and
    the run trains what the eager run trains."""
    args = ["--steps", "8", "--log-every", "2"]
    s = _cuda_summary(tmp_path / "on", *args, "--compile-dense", "on")
    assert s["dense_precision"] == "bf16" and s["compile_dense"] == "default"
    assert s["compiled_frames_in_loop"] == 0 and s["dense_warmup_s"] > 0
    eager = _cuda_summary(tmp_path / "eager", *args, "--compile-dense", "off")
    assert [v for _, v in s["loss_history"]] == pytest.approx(
        [v for _, v in eager["loss_history"]], rel=5e-3)


# ------------------------------------------------------------------- data parallelism of one rank


@pytest.mark.parametrize("dcn", [None, (2, 8)])
def test_the_dense_part_is_built_on_the_dense_device(dcn):
    """Every parameter and buffer of the bottom MLP, the interaction (TorchRec builds its DCN cross
    net and its ``triu_indices`` on the CPU) and the top MLP is on ``dense_device`` (here ``meta``,
    told apart from the CPU), so the warm-up before sharding and a DMP of one rank (no DDP to move
    it) run the dense part on that device; the warm-up runs there."""
    from torchrec_ftrl.job import model as model_lib

    net = model_lib.build_dlrm(["a", "b"], [50, 60], 8, 3, [16], [16], torch.device("meta"), dcn=dcn)
    for name in model_lib.DENSE_PARTS:
        part = getattr(net, name)
        assert {t.device.type for t in [*part.parameters(), *part.buffers()]} == {"meta"}, name
    model_lib.warm_up_dense(net, 4)


def test_one_rank_leaves_the_dense_part_unwrapped(one_process):
    """At world size 1 the job's DMP holds the DLRM itself (no DDP: its per-step hooks and
    all-reduces would average each gradient over one rank); at 2 ranks TorchRec's default DDP
    wrapper stays."""
    import torchrec_ftrl
    from torch.nn.parallel import DistributedDataParallel
    from torchrec_ftrl.job import model as model_lib

    net = model_lib.build_dlrm(["a", "b"], [50, 60], 8, 3, [16], [16], torch.device("cpu"))
    dmp, _ = model_lib.shard(net, ["t_a", "t_b"], torchrec_ftrl.sharders(), torch.device("cpu"),
                             ["table_wise"], 1, 1, 32)
    assert dmp._dmp_wrapped_module is net
    assert not any(isinstance(m, DistributedDataParallel) for m in dmp.modules())
    assert model_lib.data_parallel_wrapper(2) is None   # DMP's default: DDP
