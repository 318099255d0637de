"""Reliability of the main job (``torchrec_ftrl.job``: the torchx component and examples/train_ctr.py):
a rank killed mid-training or mid-checkpoint write in a 2-process torchx job, exact resume, and
``--resume`` on corrupt or mismatched checkpoints; the pipelined loop (``TrainPipelineSparseDist``, the
default, which reads batches ahead of the step it trains) against the plain loop (``--pipeline none``)
with validation between steps.

Faults come from the job's ``TORCHREC_FTRL_FAULT=RANK:STEP[:PHASE]`` hook (``torchrec_ftrl/job/faults.py``:
``os._exit(1)``, no cleanup). The expected final state is an uninterrupted run with the same seed and
flags; "identical" is bitwise: every tensor of the final DCP checkpoint (model weights, FTRL
accum/linear, dense Adagrad state, the job's touched-row masks), converted with ``dcp_to_torch_save``.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from conftest import bits, flat_checkpoint, run_job, run_torchx

# Small: 26 tables of 200 x 4, 32 rows per rank per step, 8 steps, checkpoints at 3 and 6 (and 8).
# Row-wise next to table-wise sharding so both ranks hold pieces of sharded tables.
JOB = ["--num-embeddings", "200", "--embedding-dim", "4", "--batch-size", "32", "--steps", "8",
       "--eval-every", "100", "--log-every", "1", "--device", "cpu", "--no-progress",
       "--sharding-types", "table_wise,row_wise", "--checkpoint-every", "3", "--keep-checkpoints", "3"]
LAUNCH_TIMEOUT_S = 300   # a hang would exceed this; torchrun stops the surviving rank within seconds


def _torchx(args, fault=None):
    t0 = time.monotonic()
    p = run_torchx(args, fault=fault, timeout=LAUNCH_TIMEOUT_S)
    return p, time.monotonic() - t0


def _assert_bitwise_equal(a, b):
    assert sorted(a) == sorted(b)
    ftrl_keys = [k for k in a if k.endswith((".accum", ".linear"))]
    assert len(ftrl_keys) == 2 * 26, ftrl_keys[:5]          # every table's FTRL states are compared
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(bits(a[k]), bits(b[k])), k


def _latest(ckpt):
    with open(os.path.join(ckpt, "latest")) as f:
        return f.read().strip()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    p, _ = _torchx([*JOB, "--checkpoint-dir", str(d / "ckpt"), "--output-dir", str(d / "out")])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return d, flat_checkpoint(str(d / "ckpt" / "step_00000008"), str(d))


@pytest.mark.slow
@pytest.mark.parametrize("fault,last_good", [
    ("1:5", "step_00000003"),              # rank 1 killed after its step-5 update (mid-training)
    ("0:6:checkpoint", "step_00000003"),   # rank 0 killed while step 6's checkpoint is being written
])
def test_killed_rank_fails_cleanly_and_resume_is_bitwise_exact(uninterrupted, tmp_path, fault, last_good):
    full_dir, full = uninterrupted
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    p, wall = _torchx([*JOB, "--checkpoint-dir", ckpt, "--output-dir", out], fault=fault)
    print(f"fault {fault}: torchx returned {p.returncode} after {wall:.1f} s")
    assert p.returncode != 0, p.stdout[-2000:]
    assert f"TORCHREC_FTRL_FAULT: rank {fault.split(':')[0]} exits" in p.stdout + p.stderr
    # The interrupted write left no committed checkpoint: latest is the previous one, complete.
    assert _latest(ckpt) == last_good
    assert sorted(d for d in os.listdir(ckpt) if d.startswith("step_")) == [last_good]
    assert os.path.isfile(os.path.join(ckpt, last_good, "meta.json"))
    if fault.endswith("checkpoint"):
        assert os.path.isdir(os.path.join(ckpt, ".tmp-step_00000006"))
        assert not os.path.exists(os.path.join(ckpt, ".tmp-step_00000006", "meta.json"))

    p, wall = _torchx([*JOB, "--checkpoint-dir", ckpt, "--output-dir", out, "--resume"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert f"resumed from {os.path.join(ckpt, last_good)} at step 3" in p.stdout + p.stderr
    _assert_bitwise_equal(flat_checkpoint(os.path.join(ckpt, "step_00000008"), str(tmp_path)), full)
    with open(os.path.join(out, "train_ctr_summary.json")) as f, \
            open(full_dir / "out" / "train_ctr_summary.json") as g:
        resumed, ref = json.load(f), json.load(g)
    assert resumed["start_step"] == 3
    assert resumed["loss_history"] == ref["loss_history"]
    assert resumed["final_validation"] == ref["final_validation"]


@pytest.mark.slow
def test_pipelined_and_plain_loops_are_bitwise_equal_on_two_ranks(uninterrupted, tmp_path):
    """Validation every 3 steps: the pipeline detaches the model for it and re-attaches it with two
    batches in flight. Both loops must end bitwise equal to the uninterrupted run (validated only at
    the end), checkpoint by checkpoint, with the same losses and the same validation metrics."""
    full_dir, _ = uninterrupted
    with open(full_dir / "out" / "train_ctr_summary.json") as f:
        ref = json.load(f)
    i = JOB.index("--eval-every")
    job = [*JOB[:i + 1], "3", *JOB[i + 2:]]      # (torchx refuses a repeated flag)
    runs = {}
    for kind in ("sparse_dist", "none"):
        ckpt, out = str(tmp_path / kind / "ckpt"), str(tmp_path / kind / "out")
        p, _ = _torchx([*job, "--pipeline", kind, "--checkpoint-dir", ckpt, "--output-dir", out])
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
        for step in ("step_00000003", "step_00000006", "step_00000008"):
            _assert_bitwise_equal(flat_checkpoint(os.path.join(ckpt, step), str(tmp_path)),
                                  flat_checkpoint(str(full_dir / "ckpt" / step), str(tmp_path)))
        with open(os.path.join(out, "train_ctr_summary.json")) as f:
            runs[kind] = json.load(f)
    assert runs["sparse_dist"]["pipeline"] == "sparse_dist" and runs["none"]["pipeline"] == "none"
    assert runs["sparse_dist"]["loss_history"] == runs["none"]["loss_history"] == ref["loss_history"]
    assert [v["step"] for v in runs["sparse_dist"]["validation_history"]] == [3, 6, 8]
    assert runs["sparse_dist"]["validation_history"] == runs["none"]["validation_history"]
    assert runs["sparse_dist"]["final_validation"] == ref["final_validation"]


# ---------------------------------------------------------------------------------- corrupt resume
ONE = ["--num-embeddings", "200", "--embedding-dim", "4", "--batch-size", "16", "--steps", "2",
       "--eval-every", "100", "--device", "cpu", "--no-progress", "--sharding-types", "table_wise"]


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("one")
    p = run_job([*ONE, "--checkpoint-dir", str(d / "ckpt"), "--output-dir", str(d / "out")])
    assert p.returncode == 0, p.stderr[-4000:]
    return str(d / "ckpt")


def _corrupt(kind, src, dst):
    shutil.copytree(src, dst)
    step = os.path.join(dst, "step_00000002")
    if kind == "truncated_shard":
        data = sorted(f for f in os.listdir(step) if f.endswith(".distcp"))[0]
        path = os.path.join(step, data)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 3)
    elif kind == "garbage_metadata":
        with open(os.path.join(step, ".metadata"), "wb") as f:
            f.write(b"\x00not a pickle" * 10)
    elif kind == "no_meta_json":
        os.unlink(os.path.join(step, "meta.json"))
    elif kind == "latest_names_missing_dir":
        with open(os.path.join(dst, "latest"), "w") as f:
            f.write("step_00000099\n")
    return dst


CORRUPT = {
    # kind: (extra flags, expected text in the one-line error)
    "truncated_shard": ([], "cannot load checkpoint"),
    "garbage_metadata": ([], "cannot load checkpoint"),
    "no_meta_json": ([], "not a complete checkpoint (no meta.json)"),
    "latest_names_missing_dir": ([], "step_00000099"),
    "other_table_sizes": (["--num-embeddings", "300"], "cannot load checkpoint"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_resume_from_corrupt_or_mismatched_checkpoint_fails_clearly(good_checkpoint, tmp_path, kind):
    extra, expected = CORRUPT[kind]
    ckpt = _corrupt(kind, good_checkpoint, str(tmp_path / "ckpt"))
    listing = sorted(os.listdir(ckpt))
    args = [*ONE, *extra, "--checkpoint-dir", ckpt, "--output-dir", str(tmp_path / "out"), "--resume"]
    p = run_job(args)
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("train_ctr: error: ") and expected in last, p.stderr[-3000:]
    # (DCP itself logs the failing rank's traceback as a WARNING before raising; the job ends with
    # the one-line error above and exit status 2.)
    assert sorted(os.listdir(ckpt)) == listing and _latest(ckpt) == _latest(good_checkpoint) \
        or kind == "latest_names_missing_dir"                     # nothing was written


def test_fault_spec_is_validated():
    from torchrec_ftrl.job import faults
    assert faults.parse(None) is None and faults.parse("") is None
    assert faults.parse("1:7") == (1, 7, "step")
    assert faults.parse("0:3:checkpoint") == (0, 3, "checkpoint")
    for bad in ("1", "a:2", "1:0", "-1:2", "1:2:later", "1:2:step:x"):
        with pytest.raises(ValueError, match="TORCHREC_FTRL_FAULT must be RANK:STEP"):
            faults.parse(bad)
