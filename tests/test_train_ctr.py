"""The CTR job end to end (``torchrec_ftrl.job``, run through examples/train_ctr.py and ``python -m
torchrec_ftrl.job``): one-process runs on synthetic and real Criteo data, summary JSON + PNG, DCP
checkpoint / exact resume, flag -> fused_params mapping, the torchx component (which launches the
installed module, not a checkout path) and a 2-process torchx launch (slow); the training loop under
TorchRec's ``TrainPipelineSparseDist`` (the default) against the plain loop (``--pipeline none``), and
``--profile-steps``. (That the library never imports the job: tests/test_layers.py.)

Independent checks: sparsity counts are recomputed from the DCP checkpoint files (converted with
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``); a resumed run must reproduce the
uninterrupted run's losses and validation metrics exactly and its final checkpoint bit for bit (same
data order, restored optimizer state); the pipelined and the plain loop write bitwise equal
checkpoints; profile phase times are recomputed from the written chrome trace, and the phase
attribution from hand-built events.
"""

import json
import os
import re
from types import SimpleNamespace

import pytest
import torch

from conftest import bits, flat_checkpoint, run_job, run_torchx

SMALL = ["--num-embeddings", "2000", "--no-progress", "--batch-size", "128"]


def _run(args):
    p = run_job(args)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p.stdout


def _summary(out_dir, name="train_ctr"):
    with open(os.path.join(out_dir, f"{name}_summary.json")) as f:
        return json.load(f)


def _assert_same_checkpoint(a_dir, b_dir, tmp):
    a, b = flat_checkpoint(a_dir, tmp), flat_checkpoint(b_dir, tmp)
    assert sorted(a) == sorted(b)
    # the weights of all 26 tables, optimizer state (sparse and dense) and the touched-row masks
    assert sum(".embedding_bags." in k and k.endswith(".weight") for k in a if k.startswith("model.")) == 26
    assert any(k.startswith("optim.") for k in a) and any(k.startswith("extra.") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(bits(a[k]), bits(b[k])), k


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    """20 FTRL steps on synthetic data, checkpoint every 10."""
    d = tmp_path_factory.mktemp("syn")
    args = [*SMALL, "--steps", "20", "--eval-every", "10", "--log-every", "5",
            "--checkpoint-every", "10", "--checkpoint-dir", str(d / "ckpt")]
    stdout = _run([*args, "--output-dir", str(d / "out")])
    return d, args, stdout


def test_synthetic_run_writes_summary_and_png(synthetic_run):
    d, _, stdout = synthetic_run
    s = _summary(d / "out")
    assert s["world_size"] == 1 and s["backend"] == "gloo" and s["steps"] == 20
    assert s["data"]["kind"] == "synthetic"
    assert [h[0] for h in s["loss_history"]] == [5, 10, 15, 20]
    assert all(0.0 < h[1] < 5.0 for h in s["loss_history"])
    assert [v["step"] for v in s["validation_history"]] == [10, 20]
    v = s["final_validation"]
    assert 0.0 <= v["auc"] <= 1.0 and v["rows"] == 8 * 128 and v["logloss"] > 0
    assert len(s["sparsity"]) == 26 and set(s["plan"]) == {f"t_C{i}" for i in range(1, 27)}
    with open(d / "out" / "train_ctr.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "validation AUC" in stdout and "wrote" in stdout
    assert s["pipeline"] == "sparse_dist" and s["step_profile"] is None
    if s["ftrl_registered"] and s["sparse_optimizer"] == "ftrl":
        # per-example --ftrl-l1 over the examples of one row gradient (128 rows, one rank)
        assert s["fused_params"]["ftrl_l1_reg"] == pytest.approx(s["args"]["ftrl_l1"] / 128, rel=1e-15)


def test_checkpoints_are_complete_and_sparsity_matches_them(synthetic_run):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torchrec_ftrl.data import SyntheticCTR

    d, _, _ = synthetic_run
    ck = d / "ckpt"
    assert sorted(os.listdir(ck)) == ["latest", "step_00000010", "step_00000020"]
    assert (ck / "latest").read_text().strip() == "step_00000020"
    with open(ck / "step_00000020" / "meta.json") as f:
        assert json.load(f)["step"] == 20
    dcp_to_torch_save(str(ck / "step_00000020"), str(d / "plain.pt"))
    sd = torch.load(d / "plain.pt", weights_only=False)
    s = _summary(d / "out")
    weights = {k.split(".")[-2]: v for k, v in sd["model"].items() if ".embedding_bags." in k}
    assert len(weights) == 26
    # rows the 20 training batches looked up, regenerated from the generator (job defaults: seed 0,
    # vocab 2000; SMALL: 2000 rows, batch 128; world size 1 -> batch index = step)
    gen = SyntheticCTR(2000, seed=0, vocab=2000)
    ids = torch.cat([torch.from_numpy(gen.arrays("train", i, 128)[2]) for i in range(20)])
    for j in (0, 12, 25):
        name = f"t_C{j + 1}"
        w = weights[name]
        assert tuple(w.shape) == (2000, 16)
        touched = torch.zeros(2000, dtype=torch.bool)
        col = ids[:, j]
        touched[col[col >= 0]] = True
        rec = s["sparsity"][name]
        assert rec["zero_weights"] == int((w == 0).sum())
        assert rec["zero_rows"] == int((w == 0).all(dim=1).sum())
        assert rec["touched_rows"] == int(touched.sum())
        assert rec["zero_weights_touched"] == int((w[touched] == 0).sum())
        assert rec["zero_rows_touched"] == int((w[touched] == 0).all(dim=1).sum())


def test_resume_continues_exactly(synthetic_run, tmp_path):
    d, args, _ = synthetic_run
    args = [a if a != str(d / "ckpt") else str(tmp_path / "ckpt") for a in args]
    stdout = _run([*args, "--resume", str(d / "ckpt" / "step_00000010"), "--output-dir", str(tmp_path)])
    assert "resumed from" in stdout and "at step 10" in stdout
    full, resumed = _summary(d / "out"), _summary(tmp_path)
    assert resumed["start_step"] == 10
    # steps 11..20 ran after the resume; they must match the uninterrupted run
    assert resumed["loss_history"] == full["loss_history"]
    assert resumed["final_validation"] == full["final_validation"]
    assert resumed["sparsity"] == full["sparsity"]
    # the pipeline read ahead of step 10 before the checkpoint; the resumed run starts at batch 11
    _assert_same_checkpoint(d / "ckpt" / "step_00000020", tmp_path / "ckpt" / "step_00000020", tmp_path)


def test_resume_inside_a_log_window_logs_the_same_losses(tmp_path):
    """A checkpoint inside a --log-every window (checkpoint every 3 steps, loss logged every 4):
    the resumed runs log the uninterrupted run's window means exactly (the open window's loss sums
    travel in the checkpoint)."""
    args = [*SMALL, "--steps", "9", "--log-every", "4", "--eval-every", "100",
            "--checkpoint-every", "3", "--keep-checkpoints", "3"]
    _run([*args, "--checkpoint-dir", str(tmp_path / "full"), "--output-dir", str(tmp_path / "full")])
    full = _summary(tmp_path / "full")
    assert [s for s, _ in full["loss_history"]] == [4, 8, 9]
    for step in (3, 6):
        out = tmp_path / f"from{step}"
        _run([*args, "--checkpoint-dir", str(out), "--output-dir", str(out),
              "--resume", str(tmp_path / "full" / f"step_{step:08d}")])
        assert _summary(out)["loss_history"] == full["loss_history"], step


def test_resume_with_adam_keeps_its_moments(tmp_path):
    """``--dense-optimizer adam`` (whose state torch creates at its first step): a run resumed from
    step 3 logs the uninterrupted run's losses exactly, and its checkpoint at step 6 holds the
    uninterrupted run's Adam step counts (6.0), not a restarted count."""
    args = [*SMALL, "--dense-optimizer", "adam", "--steps", "6", "--log-every", "1", "--eval-every", "100",
            "--checkpoint-every", "3", "--keep-checkpoints", "2"]
    _run([*args, "--checkpoint-dir", str(tmp_path / "full"), "--output-dir", str(tmp_path / "full")])
    out = tmp_path / "resumed"
    _run([*args, "--checkpoint-dir", str(out), "--output-dir", str(out),
          "--resume", str(tmp_path / "full" / "step_00000003")])
    assert _summary(out)["loss_history"] == _summary(tmp_path / "full")["loss_history"]
    flat = flat_checkpoint(out / "step_00000006", tmp_path)
    steps = {k: float(v) for k, v in flat.items() if k.startswith("optim.") and k.endswith(".step")
             and "dense_arch" in k}
    assert steps and set(steps.values()) == {6.0}, steps


def test_resume_past_the_last_step_fails_in_one_line(synthetic_run, tmp_path):
    d, _, _ = synthetic_run
    p = run_job([*SMALL, "--steps", "5", "--resume", str(d / "ckpt" / "step_00000010"),
                 "--output-dir", str(tmp_path)])
    assert p.returncode == 2, p.stderr[-3000:]
    assert "train_ctr: error: --resume: the run ends at step 5" in p.stderr
    assert "step_00000010 (10)" in p.stderr and "Traceback" not in p.stderr


def test_plain_loop_gives_bitwise_the_same_model(synthetic_run, tmp_path):
    """``--pipeline none`` (one batch at a time) against the pipelined fixture run: the same losses,
    validation metrics (validation at step 10 runs between pipelined steps) and checkpoints."""
    d, args, _ = synthetic_run
    args = [a if a != str(d / "ckpt") else str(tmp_path / "ckpt") for a in args]
    _run([*args, "--pipeline", "none", "--output-dir", str(tmp_path)])
    plain, piped = _summary(tmp_path), _summary(d / "out")
    assert plain["pipeline"] == "none" and piped["pipeline"] == "sparse_dist"
    assert plain["loss_history"] == piped["loss_history"]
    assert plain["validation_history"] == piped["validation_history"]
    for step in ("step_00000010", "step_00000020"):
        _assert_same_checkpoint(d / "ckpt" / step, tmp_path / "ckpt" / step, tmp_path)


def test_the_pipeline_is_filled_before_the_first_step(synthetic_run, monkeypatch):
    """``SparseDistLoop.fill`` runs TorchRec's ``fill_pipeline`` on the loop's batches before the
    timed steps (the summary's ``pipeline_fill_s``): here a stand-in pipeline that reads two batches
    there and one a ``progress``, as TorchRec's does; the batches read stay pending in order, and the
    first step hands the first one's KJT to ``on_batch``."""
    import torchrec.distributed.train_pipeline as tp
    from torchrec_ftrl.job import pipeline

    class Pipeline:
        def __init__(self, *args, **kwargs):
            self.read = []

        def fill_pipeline(self, it):
            self.read += [next(it), next(it)]

        def progress(self, it):
            self.read.append(next(it))
            return torch.tensor(0.0), None, None

    monkeypatch.setattr(tp, "TrainPipelineSparseDist", Pipeline)
    batches = [SimpleNamespace(sparse_features=f"kjt{i}") for i in range(5)]
    seen = []
    loop = pipeline.SparseDistLoop(None, None, torch.device("cpu"), iter(batches), seen.append)
    loop.fill()
    assert list(loop._pending) == ["kjt0", "kjt1"] and seen == []
    loop.step()
    assert seen == ["kjt0"] and list(loop._pending) == ["kjt1", "kjt2"]
    assert _summary(synthetic_run[0] / "out")["pipeline_fill_s"] > 0


def test_data_workers_give_bitwise_the_same_model(synthetic_run, tmp_path):
    """Batches built on the training thread (``--data-workers 0``) and by 2 DataLoader workers against
    the fixture run (``auto``): the same losses, validation metrics and checkpoints; then a resume
    from step 10 with 2 workers reproduces the fixture's final checkpoint."""
    d, args, _ = synthetic_run
    for workers in ("0", "2"):
        out = tmp_path / f"w{workers}"
        run_args = [a if a != str(d / "ckpt") else str(out / "ckpt") for a in args]
        stdout = _run([*run_args, "--data-workers", workers, "--output-dir", str(out)])
        assert f"{workers} data worker(s)/rank" in stdout
        s, ref = _summary(out), _summary(d / "out")
        assert s["loss_history"] == ref["loss_history"]
        assert s["validation_history"] == ref["validation_history"]
        for step in ("step_00000010", "step_00000020"):
            _assert_same_checkpoint(d / "ckpt" / step, out / "ckpt" / step, tmp_path)
    res = tmp_path / "resumed"
    run_args = [a if a != str(d / "ckpt") else str(res / "ckpt") for a in args]
    _run([*run_args, "--data-workers", "2", "--resume", str(d / "ckpt" / "step_00000010"),
          "--output-dir", str(res)])
    assert _summary(res)["loss_history"] == _summary(d / "out")["loss_history"]
    _assert_same_checkpoint(d / "ckpt" / "step_00000020", res / "ckpt" / "step_00000020", tmp_path)


def test_compile_dense_trains_the_same_model_to_rounding(synthetic_run, tmp_path):
    """``--compile-dense`` (inductor) against the eager fixture run: losses and validation AUC within
    float32 rounding of the eager ones, and checkpoints with the same keys, shapes and dtypes (so
    either run resumes from the other's checkpoints)."""
    d, args, _ = synthetic_run
    args = [a if a != str(d / "ckpt") else str(tmp_path / "ckpt") for a in args]
    _run([*args, "--compile-dense", "--output-dir", str(tmp_path)])
    got, ref = _summary(tmp_path), _summary(d / "out")
    assert [s for s, _ in got["loss_history"]] == [s for s, _ in ref["loss_history"]]
    assert [v for _, v in got["loss_history"]] == pytest.approx([v for _, v in ref["loss_history"]],
                                                                 rel=1e-4)
    for g, r in zip(got["validation_history"], ref["validation_history"]):
        assert g["auc"] == pytest.approx(r["auc"], abs=2e-3) and g["rows"] == r["rows"]
    a = flat_checkpoint(d / "ckpt" / "step_00000020", tmp_path)
    b = flat_checkpoint(tmp_path / "ckpt" / "step_00000020", tmp_path)
    assert sorted(a) == sorted(b)
    assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)


PHASES = ("data", "input_dist", "sparse", "dense", "optimizer", "metrics")


def _outermost_ms(trace_events, pattern):
    """Total ms of the ranges matching ``pattern`` that lie in no other matching range."""
    rx = re.compile(pattern)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace_events if rx.search(e["name"]))
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if a >= end:
            total += b - a
            end = b
    return total / 1e3


@pytest.mark.parametrize("pipeline", ["sparse_dist", "none"])
def test_profile_steps_records_every_phase_and_a_trace(tmp_path, pipeline):
    _run(["--num-embeddings", "200", "--embedding-dim", "4", "--batch-size", "32", "--steps", "8",
          "--eval-every", "100", "--no-progress", "--sharding-types", "table_wise,row_wise",
          "--pipeline", pipeline, "--profile-steps", "2", "--output-dir", str(tmp_path)])
    prof = _summary(tmp_path)["step_profile"]
    assert prof["steps"] == 2 and prof["warmup_steps"] == 3
    assert tuple(prof["host_ms"]) == PHASES and prof["device_ms"] == {}      # CPU: no device time
    # the pipeline's input all-to-all runs in TorchRec's ranges; the plain loop's inside the
    # sharded module, where TorchRec labels only its KJT all-to-all awaitables
    assert all(prof["host_ms"][p] > 0 for p in PHASES), prof["host_ms"]
    assert sum(prof["host_ms"].values()) <= prof["host_step_ms"] * (1 + 1e-9)
    trace = tmp_path / "train_ctr_trace.json"
    assert prof["trace"] == str(trace)
    with open(trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    assert len(steps) == 2
    main = [e for e in events if e.get("tid") == steps[0]["tid"]
            and any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps)]
    # phases whose ranges hold no range of another phase, summed from the trace file itself
    for phase, pattern in (("optimizer", r"^## (zero_grad|optimizer)\b"),
                           ("metrics", r"^## ctr:(metrics|touch_tracker) ##"),
                           ("data", r"^## (next_batch|copy_batch_to_gpu|wait_for_batch)\b")):
        assert prof["host_ms"][phase] == pytest.approx(_outermost_ms(main, pattern) / 2, abs=2e-3), phase
    assert any(e["name"].startswith("## forward") for e in main)


def _ev(name, start, end, thread=1, kernels=()):
    return SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start, end=end),
                           device_type=torch.autograd.DeviceType.CPU,
                           kernels=[SimpleNamespace(name=k, device=0, duration=d) for k, d in kernels])


def test_phase_attribution_of_hand_built_events():
    from torchrec_ftrl.job import profile

    node = "autograd::engine::evaluate_function: "
    events = [
        _ev("ProfilerStep*", 0, 100),
        _ev("## next_batch ##", 0, 10, kernels=[("Memcpy HtoD (Pageable -> Device)", 2)]),
        _ev("## forward 1 ##", 10, 50),
        _ev("aten::mm", 12, 14, kernels=[("sm90_xmma_gemm", 3)]),
        _ev("## ctr:sparse_arch ##", 20, 30),
        _ev("aten::embedding_op", 24, 26, kernels=[("tbe_forward_kernel", 7)]),
        _ev("## runtime_forward_assemble_KJT ##", 21, 23),
        _ev("## backward 1 ##", 50, 80),
        _ev(node + "_FTRLLookupFunctionBackward", 55, 60),
        _ev(node + "AddmmBackward0", 60, 70),
        _ev("## optimizer 1 ##", 80, 90, kernels=[("multi_tensor_apply_kernel", 1)]),
        _ev("## ctr:metrics ##", 90, 95),
        _ev("aten::item", 91, 92, kernels=[("## ctr:metrics ##", 50)]),   # a range's GPU shadow
        _ev("## ctr:excluded validation ##", 95, 99),
        _ev("## forward ##", 96, 97, kernels=[("gemm", 100)]),            # inside the validation
        _ev("aten::to", 99.5, 99.7, kernels=[("ncclDevKernel_AllToAll", 4)]),   # in no range
        # the autograd engine's device thread: nodes and the kernels they launch
        _ev(node + "SplitLookupFunction_ftrl_Op", 60, 66, thread=2),
        _ev("aten::triton_launch", 61, 62, thread=2, kernels=[("_ftrl_backward_kernel", 5)]),
        _ev(node + "torch::autograd::AccumulateGrad", 66, 84, thread=2,
            kernels=[("ncclDevKernel_AllReduce", 6)]),
    ]
    got = profile.attribute(events)
    # main thread: backward 30 us = 5 sparse node + 10 dense node + 15 bare, split by the other
    # thread's node time (sparse 6, dense 18: a quarter sparse); 4 us excluded, 1 us in no range
    want_host = {"data": 10, "input_dist": 2, "sparse": 8 + 5 + 15 * 0.25, "dense": 30 + 10 + 15 * 0.75,
                 "optimizer": 10, "metrics": 5}
    assert got["steps"] == 1
    assert got["host_ms"] == pytest.approx({k: v / 1e3 for k, v in want_host.items()}, abs=1e-12)
    assert got["host_step_ms"] == pytest.approx(96 / 1e3)
    want_dev = {"data": 2, "input_dist": 4, "sparse": 7 + 5, "dense": 3 + 6, "optimizer": 1, "metrics": 0}
    assert got["device_ms"] == pytest.approx({k: v / 1e3 for k, v in want_dev.items()}, abs=1e-12)
    assert profile.attribute([e for e in events if not e.kernels])["device_ms"] == {}
    with pytest.raises(ValueError, match="no ProfilerStep"):
        profile.attribute(events[1:])


def test_profile_plan_warmup_and_active_steps():
    from torchrec_ftrl.job.profile import plan

    assert plan(200, 0) == (0, 0) and plan(0, 5) == (0, 0)
    assert plan(200, 5) == (3, 5)       # three warm-up steps, then five profiled
    assert plan(6, 5) == (1, 5) and plan(4, 5) == (0, 4)


def test_short_real_data_run(tmp_path, sample_data):
    criteo = sample_data("criteo", "criteo_dac_combined.tsv")
    _run([*SMALL, "--data", criteo, "--steps", "15", "--eval-every", "100",
          "--sparse-optimizer", "rowwise_adagrad", "--output-dir", str(tmp_path)])
    s = _summary(tmp_path)
    assert s["data"]["kind"] == "file" and s["sparse_optimizer"] == "rowwise_adagrad"
    assert s["data"]["reader"]["valid"] == 6726 and s["data"]["reader"]["malformed"] == 0
    assert s["final_validation"]["rows"] == 672  # every 10th of 6,726 rows
    # validation CTR of rows 10, 20, ... counted independently
    with open(criteo) as f:
        labels = [int(line.split("\t", 1)[0]) for i, line in enumerate(f) if i % 10 == 9]
    assert s["final_validation"]["ctr"] == pytest.approx(sum(labels) / len(labels), abs=1e-12)
    assert s["fused_params"]["optimizer"] == "EXACT_ROWWISE_ADAGRAD"


def test_split_none_trains_on_every_row_without_validation(tmp_path, sample_data):
    """--split none: all 6,726 rows train (the epoch count follows from them), nothing is validated."""
    criteo = sample_data("criteo", "criteo_dac_combined.tsv")
    out = _run([*SMALL, "--data", criteo, "--split", "none", "--epochs", "1", "--output-dir",
                str(tmp_path)])
    s = _summary(tmp_path)
    assert s["final_validation"] is None and s["validation_history"] == []
    assert s["steps"] == -(-6726 // 128)        # ceil(all rows / batch): no row held out
    assert "no validation (--split none)" in out


def test_missing_data_file_fails_clearly(tmp_path):
    p = run_job(["--data", str(tmp_path / "none.tsv"), "--sparse-optimizer", "rowwise_adagrad",
                 "--output-dir", str(tmp_path)])
    assert p.returncode != 0
    assert "CTR data file not found" in p.stderr and "none.tsv" in p.stderr


def test_malformed_row_read_by_a_data_worker_fails_in_one_line(tmp_path, sample_data):
    """--strict on a row that only the training stream reads (--split none: no counting pass in the
    main process), parsed by a DataLoader worker: the same one line as without workers."""
    with open(sample_data("criteo", "criteo_dac_combined.tsv")) as f:
        head = [next(f) for _ in range(300)]
    bad = tmp_path / "bad.tsv"
    bad.write_text("".join(head) + "garbage line\n" + "".join(head))
    p = run_job([*SMALL, "--data", str(bad), "--split", "none", "--strict", "--steps", "5",
                 "--data-workers", "1", "--output-dir", str(tmp_path)])
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"train_ctr: error: {bad}:301: malformed row (field_count)" in p.stderr
    assert "Traceback" not in p.stderr and "DataLoader worker" not in p.stderr


def test_wrong_data_format_fails_in_one_line(tmp_path):
    bad = tmp_path / "comma.csv"  # a comma-separated file read with the default Criteo TSV layout
    bad.write_text("".join(f"{i % 2},1,2,3\n" for i in range(30)))
    p = run_job(["--data", str(bad), "--steps", "1", "--output-dir", str(tmp_path)])
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"train_ctr: error: {bad}: the validation split --split every:10 is empty")
    assert "most rows are malformed" in last and "--data-format" in last
    assert "30 malformed rows" in last and "Traceback" not in p.stderr


def test_module_entry_point_runs_outside_the_checkout(tmp_path):
    """``python -m torchrec_ftrl.job`` from a directory that is not the checkout: the job is the
    installed package (no checkout path); same one-line error and exit status 2 as the script."""
    p = run_job(["--data", str(tmp_path / "none.tsv"), "--sparse-optimizer", "rowwise_adagrad",
                 "--output-dir", str(tmp_path)], module=True, cwd=str(tmp_path))
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("train_ctr: error: ") and "CTR data file not found" in last
    assert "none.tsv" in last and "Traceback" not in p.stderr


def test_flags_map_to_fused_params():
    from torchrec_ftrl.job import cli
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    a = cli.parse_args(["--sparse-optimizer", "rowwise_adagrad", "--sparse-lr", "0.3"])
    assert cli.sparse_fused_params(a) == {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                          "learning_rate": 0.3, "eps": 1e-8}
    a = cli.parse_args(["--sparse-lr", "0.2", "--ftrl-l1", "0.5", "--ftrl-l2", "0.25", "--ftrl-beta", "2",
                        "--ftrl-lr-power", "-0.25", "--ftrl-l2-convention", "mcmahan",
                        "--ftrl-reg-scale", "raw"])
    import torchrec_ftrl  # noqa: F401
    if getattr(EmbOptimType, "FTRL", None) is None:
        with pytest.raises(RuntimeError, match="EmbOptimType.FTRL is not registered"):
            cli.sparse_fused_params(a)
        return
    fp = cli.sparse_fused_params(a)
    assert fp["optimizer"] is EmbOptimType.FTRL
    assert (fp["learning_rate"], fp["ftrl_l1_reg"], fp["ftrl_l2_reg"], fp["ftrl_beta"],
            fp["ftrl_learning_rate_power"], fp["ftrl_l2_convention"]) == (0.2, 0.5, 0.25, 2.0, -0.25,
                                                                          "mcmahan")
    with pytest.raises(SystemExit):
        cli.parse_args(["--steps", "0"])


def test_pipeline_and_profile_flags(capsys):
    from torchrec_ftrl.job import cli

    a = cli.parse_args([])
    assert (a.pipeline, a.profile_steps) == ("sparse_dist", 0)
    a = cli.parse_args(["--pipeline", "none", "--profile-steps", "7", "--data-workers", "3"])
    assert (a.pipeline, a.profile_steps, a.data_workers) == ("none", 7, 3)
    assert cli.data_workers(3, 8) == 3 and cli.data_workers(0, 1) == 0
    cpus = len(os.sched_getaffinity(0))
    assert cli.data_workers("auto", 1) == max(0, min(4, cpus - 1))
    assert cli.data_workers("auto", cpus) == 0   # one CPU per rank: the batches stay on the rank's thread
    for argv, text in ((["--pipeline", "fast"], "argument --pipeline: invalid choice: 'fast'"),
                       (["--profile-steps", "-1"], "argument --profile-steps: must be >= 0, got -1"),
                       (["--profile-steps", "two"], "argument --profile-steps: expected an integer"),
                       (["--data-workers", "-1"], "--data-workers must be an integer >= 0 or auto, got -1"),
                       (["--data-workers", "many"],
                        "--data-workers must be an integer >= 0 or auto, got 'many'")):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(argv)
        assert e.value.code == 2 and text in capsys.readouterr().err


def test_torchx_component_builds_ddp_appdef():
    from torchrec_ftrl.components import train_ctr

    app = train_ctr("--steps", "7", nproc=3, gpu=0)
    role = app.roles[0]
    cmd = role.args[-1]
    assert cmd.startswith("python -m torchrec_ftrl.job.torchrun ") and "--nproc_per_node 3" in cmd
    assert "--nnodes 1" in cmd and role.env["LOGLEVEL"] == "ERROR"
    assert train_ctr(env={"LOGLEVEL": "INFO"}).roles[0].env["LOGLEVEL"] == "INFO"
    assert "-m torchrec_ftrl.job --steps 7" in cmd and "examples/" not in cmd
    assert role.name == "train_ctr" and app.name == "train_ctr"
    assert role.resource.gpu == 0
    # a custom script is launched as a script
    custom = train_ctr("--steps", "7", nproc=1, gpu=0, script="my/job.py").roles[0].args[-1]
    assert "--nproc_per_node 1" in custom and "my/job.py --steps 7" in custom
    assert "-m torchrec_ftrl.job " not in custom
    with pytest.raises(ValueError, match="nproc and nnodes must be >= 1"):
        train_ctr(nproc=0)


@pytest.mark.slow
def test_torchx_two_process_launch(tmp_path):
    p = run_torchx([*SMALL, "--steps", "12", "--eval-every", "100", "--device", "cpu",
                    "--output-dir", str(tmp_path)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    s = _summary(tmp_path)
    assert s["world_size"] == 2 and s["backend"] == "gloo"
    assert s["final_validation"]["rows"] == 2 * 8 * 128  # both ranks' validation rows gathered
    ranks = {r for v in s["plan"].values() for r in v.split("ranks")[1].strip(" []").split(",")}
    assert len(s["sparsity"]) == 26 and {x.strip() for x in ranks} <= {"0", "1"}


def test_zch_run_evicts_and_resumes_exactly(tmp_path):
    """``--zch``: raw ids through TorchRec's managed collision (200 slots per table for 2,000 synthetic
    values per feature, so slots are evicted and re-used); a run resumed from its step-6 DCP
    checkpoint logs the same losses and validation and ends with a bitwise equal checkpoint (the MC
    remapping buffers included)."""
    args = ["--zch", "--num-embeddings", "200", "--no-progress", "--batch-size", "64", "--steps", "12",
            "--eval-every", "6", "--log-every", "3", "--checkpoint-every", "6"]
    full_dir, res_dir = tmp_path / "full", tmp_path / "resumed"
    _run([*args, "--checkpoint-dir", str(full_dir / "ckpt"), "--output-dir", str(full_dir)])
    _run([*args, "--checkpoint-dir", str(res_dir / "ckpt"), "--output-dir", str(res_dir),
          "--resume", str(full_dir / "ckpt" / "step_00000006")])
    full, resumed = _summary(full_dir), _summary(res_dir)
    z = full["zch"]
    assert z["slots_per_table"] == [200] * 26 and z["eviction_interval"] == 1
    # more slot (re)assignments than first fills of the 26 x 200 slots: slots were taken from ids
    assert z["reset_slots"] > 26 * 200, z
    assert resumed["loss_history"] == full["loss_history"]
    assert resumed["validation_history"] == full["validation_history"]
    a = flat_checkpoint(full_dir / "ckpt" / "step_00000012", tmp_path)
    b = flat_checkpoint(res_dir / "ckpt" / "step_00000012", tmp_path)
    assert sorted(a) == sorted(b)
    assert sum("_mch_sorted_raw_ids" in k for k in a) == 26, sorted(a)
    assert sum(".embedding_bags." in k and k.endswith(".weight") for k in a) == 26
    for k in a:
        assert torch.equal(bits(a[k]), bits(b[k])), k


def test_zch_with_rowwise_adagrad_needs_cuda(tmp_path):
    p = run_job(["--zch", "--sparse-optimizer", "rowwise_adagrad", "--device", "cpu", "--steps", "1",
                 "--output-dir", str(tmp_path)])
    assert p.returncode == 2
    assert "--zch with --sparse-optimizer rowwise_adagrad needs --device cuda" in p.stderr


def test_derived_weights_start_at_zero(tmp_path):
    """--ftrl-weights derived: the tables start at w = 0 (z = 0), so a row no batch looked up is
    still exactly zero in the checkpoint, while trained rows are not (no L1, so any gradient moves
    a weight; the stored layout keeps TorchRec's uniform start in its untouched rows)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torchrec_ftrl.data import SyntheticCTR

    _run([*SMALL, "--steps", "4", "--ftrl-weights", "derived", "--ftrl-l1", "0", "--checkpoint-every", "4",
          "--checkpoint-dir", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "out")])
    dcp_to_torch_save(str(tmp_path / "ckpt" / "step_00000004"), str(tmp_path / "plain.pt"))
    sd = torch.load(tmp_path / "plain.pt", weights_only=False)["model"]
    gen = SyntheticCTR(2000, seed=0, vocab=2000)
    ids = torch.cat([torch.from_numpy(gen.arrays("train", i, 128)[2]) for i in range(4)])
    for j in (0, 12, 25):
        w = sd[f"sparse_arch.embedding_bag_collection.embedding_bags.t_C{j + 1}.weight"]
        touched = torch.zeros(2000, dtype=torch.bool)
        col = ids[:, j]
        touched[col[col >= 0]] = True
        assert 0 < int(touched.sum()) < 2000
        assert int((w[~touched] != 0).sum()) == 0
        assert int((w[touched] != 0).sum()) > 0


def test_the_first_steps_host_time_adds_up_to_the_time_before_the_steady_window(tmp_path):
    """A run of more than 20 steps times its steady window after step 10. The summary's
    ``first_steps_host_s`` (10 entries, one per step) plus ``steady_sync_s`` is the time from the
    loop's start to the steady timer's start, which the summary also gives as ``train_time_s``
    minus the steady window's seconds (its steps' examples over ``steady_examples_per_s``)."""
    out = tmp_path / "out"
    _run([*SMALL, "--steps", "24", "--eval-every", "1000", "--val-batches", "1", "--output-dir", str(out)])
    s = _summary(out)
    first, sync = s["first_steps_host_s"], s["steady_sync_s"]
    assert len(first) == 10 and all(t > 0 for t in first) and sync >= 0
    steady_s = (24 - 10) * 128 / s["steady_examples_per_s"]
    assert sum(first) + sync == pytest.approx(s["train_time_s"] - steady_s, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("cuda", [True, False])
def test_nccl_forms_its_communicator_when_the_process_group_starts(monkeypatch, cuda):
    """``dist_env.init`` binds the NCCL group to ``cuda:LOCAL_RANK`` (``device_id``: the communicator
    is formed in ``init_process_group``, not by the first collective inside the first training
    step); a gloo group on the CPU is bound to no device. Stand-ins for CUDA and the process group."""
    import torch.distributed as dist
    from torchrec_ftrl.job import dist_env

    calls = []
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")   # recorded, so that the values init sets are undone afterwards
        monkeypatch.delenv(k)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    env = dist_env.init("auto")
    want = {"backend": "nccl", "device_id": torch.device("cuda", 0)} if cuda else \
        {"backend": "gloo", "device_id": None}
    assert calls == [want] and env.device == (want["device_id"] or torch.device("cpu"))
