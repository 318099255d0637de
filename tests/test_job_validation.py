"""Every bad input of the CTR job ends it with exactly one line ``train_ctr: error: ...`` on stderr,
exit status 2, no traceback and no output file (``torchrec_ftrl/job/validate.py``, ``errors.py``).

The configuration checks run before the process group, so most cases call ``train.main`` in this
process; the expected lines are written out here in full. Errors found while reading the data run
the job as a process; the torchx launch (``slow``) checks that torchrun adds no traceback.
"""

import os
import re

import pytest
import torch

from conftest import run_job, run_torchx

CRITEO = ("criteo", "criteo_dac_combined.tsv")
FLAG_CASES = [   # (argv, the one stderr line)
    (["--split", "foo"],
     "--split foo: a split looks like 'every:10', 'tail:0.1' or 'none', got 'foo'"),
    (["--split", "tail:0.1"],
     "--split tail:0.1 does not apply to this run: it needs --data (files or a binary folder)"),
    (["--max-val-rows", "5"],
     "--max-val-rows 5 does not apply to this run: it needs --data (files or a binary folder)"),
    (["--strict"], "--strict does not apply to this run: it needs --data files (not a binary folder)"),
    (["--checkpoint-every", "5"], "--checkpoint-every 5 does not apply to this run: it needs "
                                  "--checkpoint-dir"),
    (["--zch-eviction-interval", "4"],
     "--zch-eviction-interval 4 does not apply to this run: it needs --zch"),
    (["--zch", "--sharding-types", "row_wise"],
     "--sharding-types row_wise does not apply to this run: it needs tables without --zch (--zch "
     "places every table row-wise)"),
    (["--adagrad-eps", "1e-6"],
     "--adagrad-eps 1e-06 does not apply to this run: it needs --sparse-optimizer rowwise_adagrad"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--num-embeddings", "10,x"], "--num-embeddings must be a comma list of integers, got '10,x'"),
    (["--num-embeddings", ""], "--num-embeddings entries must be >= 1, got ''"),
    (["--data-format", "{bad json"],
     "--data-format {bad json: column spec is not valid JSON: Expecting property name enclosed in "
     "double quotes: line 1 column 2 (char 1) (presets: avazu, criteo)"),
    (["--data-format", "movielens"],
     "--data-format movielens: column spec 'movielens' is neither a JSON object nor a file "
     "(presets: avazu, criteo)"),
    (["--synthetic-vocab", "0"], "--synthetic-vocab must be >= 1, got 0"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1, got 0"),
    (["--cpu-threads", "-1"], "--cpu-threads must be >= 0, got -1"),
    (["--dense-arch", "64,0"], "--dense-arch sizes must be >= 1, got '64,0'"),
    (["--sharding-types", "bogus"],
     "--sharding-types 'bogus': 'bogus' not among table_wise, column_wise, row_wise, "
     "table_row_wise, table_column_wise, grid_shard (data_parallel is never offered: FTRL tables "
     "must be fused)"),
    (["--sharding-types", "table_wise,data_parallel"],
     "--sharding-types 'table_wise,data_parallel': 'data_parallel' not among table_wise, "
     "column_wise, row_wise, table_row_wise, table_column_wise, grid_shard (data_parallel is never "
     "offered: FTRL tables must be fused)"),
    (["--dense-lr", "nan"], "--dense-lr must be a finite number > 0, got nan"),
    (["--dense-lr", "0"], "--dense-lr must be a finite number > 0, got 0.0"),
    (["--run-name", "a/b"], "--run-name must be a plain file name, got 'a/b'"),
    (["--batch-size", "100000000"],
     "TorchRec's planner found no placement of the 26 tables on 1 cpu rank(s) for --batch-size "
     "100000000, --num-embeddings 10000, --embedding-dim 16, --sharding-types table_wise,"
     "column_wise,table_column_wise,row_wise,table_row_wise: Unable to find a plan for this model "
     "because of insufficient storage."),
    # argparse's own errors: the same prefix, no usage lines
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--steps", "two"], "argument --steps: invalid int value: 'two'"),
]
DATA_CASES = [   # (argv after --data CRITEO, the one stderr line with {data} for the file)
    (["--split", "tail:1.5"], "--split tail:1.5: split tail:f needs 0 < f < 1, got 1.5"),
    (["--data-format", '{"label": "click"}'],
     '--data-format {"label": "click"}: ColumnSpec.categorical must name at least one column, got '
     '[] (presets: avazu, criteo)'),
    (["--data-format", "avazu"],
     "--data-format avazu with --data {data}: column 'click' not in the header (1 field(s) split "
     "on ',': '0\\t1\\t1\\t5\\t0\\t1382\\t4\\t15\\t')"),
    (["--num-embeddings", "10,20"],
     "--num-embeddings 10,20 has 2 entries but --data-format criteo has 26 categorical columns "
     "(give one size, or one per column)"),
    (["--max-val-rows", "0"], "--max-val-rows must be >= 1, got 0 (--split none validates nothing)"),
    (["--epochs", "nan"], "--epochs must be a finite number > 0, got nan"),
    (["--synthetic-vocab", "5"],
     "--synthetic-vocab 5 does not apply to this run: it needs the synthetic data (no --data)"),
    (["--binary-dense", "stored"],
     "--binary-dense stored does not apply to this run: it needs a binary --data folder"),
]


def _main_error(argv, out_dir, capsys):
    """Run the job in this process; return its stderr lines after asserting status 2 and that
    ``out_dir`` was not created."""
    from torchrec_ftrl.job import train

    with pytest.raises(SystemExit) as e:
        train.main([*argv, "--no-progress"] + ([] if "--output-dir" in argv else
                                                ["--output-dir", str(out_dir)]))
    assert e.value.code == 2
    assert not os.path.exists(out_dir)
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("argv,line", FLAG_CASES, ids=[" ".join(a) for a, _ in FLAG_CASES])
def test_bad_flag_is_one_line(argv, line, tmp_path, capsys):
    assert _main_error(argv, tmp_path / "out", capsys) == [f"train_ctr: error: {line}"]


@pytest.mark.parametrize("argv,line", DATA_CASES, ids=[" ".join(a) for a, _ in DATA_CASES])
def test_bad_flag_for_the_data_is_one_line(argv, line, tmp_path, capsys, sample_data):
    data = sample_data(*CRITEO)
    lines = _main_error(["--data", data, *argv], tmp_path / "out", capsys)
    assert lines == [f"train_ctr: error: {line.replace('{data}', data)}"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_one_line(tmp_path, capsys):
    lines = _main_error(["--device", "cuda"], tmp_path / "out", capsys)
    assert lines == [f"train_ctr: error: --device cuda: no CUDA device (torch.cuda.is_available() "
                     f"is False; torch {torch.__version__})"]


@pytest.mark.parametrize("flag", ["--output-dir", "--checkpoint-dir"])
def test_output_folder_that_is_a_file_is_refused_before_training(flag, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    argv = [flag, str(a_file)] + (["--output-dir", str(tmp_path / "out")] if flag != "--output-dir"
                                  else [])
    lines = _main_error(argv, tmp_path / "out", capsys)
    assert lines == [f"train_ctr: error: {flag} '{a_file}' exists and is not a folder"]
    assert a_file.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_output_folder_is_refused(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    lines = _main_error(["--output-dir", str(ro / "out")], tmp_path / "out", capsys)
    assert lines == [f"train_ctr: error: --output-dir '{ro / 'out'}': '{ro}' is not writable"]


def test_empty_data_file_names_the_file(tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    p = run_job(["--data", str(empty), "--no-progress", "--output-dir", str(tmp_path / "out")])
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == f"train_ctr: error: {empty}: no data rows (empty file)"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_torchx_shows_the_one_line_without_a_traceback(tmp_path):
    p = run_torchx(["--split", "foo", "--output-dir", str(tmp_path / "out")])
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    errors = [ln for ln in out.splitlines() if "train_ctr: error:" in ln]
    assert len(errors) == 2   # one per rank, each prefixed by torchx with the rank
    assert all(ln.endswith("train_ctr: error: --split foo: a split looks like 'every:10', "
                           "'tail:0.1' or 'none', got 'foo'") for ln in errors), errors
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("status", [2, 3])
def test_launcher_exits_with_the_worker_status_without_a_traceback(status, capfd):
    """``torchrec_ftrl.job.torchrun`` (what the torchx component runs instead of torchrun): a worker
    that exits 2 has printed its own line, so nothing is added; another status adds one line."""
    from torchrec_ftrl.job import torchrun

    with pytest.raises(SystemExit) as e:
        torchrun.main(["--standalone", "--nproc_per_node", "1", "--monitor_interval", "0.1",
                       "--no-python", "bash", "-c", f"echo worker line >&2; exit {status}"])
    assert e.value.code == status
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ChildFailedError" not in err and "worker line" in err
    ours = [ln for ln in err.splitlines() if ln.startswith("train_ctr:")]
    if status == 2:
        assert ours == []
    else:
        assert len(ours) == 1 and re.fullmatch(
            rf"train_ctr: worker rank 0 \(pid \d+\) failed with exit status {status}", ours[0]), ours


@pytest.mark.parametrize("load_s,said", [(0.0, False), (0.6, True)])
def test_a_slow_cpu_kernel_build_is_announced(load_s, said, monkeypatch, capsys):
    """The first run of an install builds the C++ kernel: rank 0 says so when loading is slow."""
    import time

    from torchrec_ftrl.job import train
    from torchrec_ftrl.kernels import backend

    monkeypatch.setattr(train, "KERNEL_BUILD_NOTICE_S", 0.2)
    monkeypatch.setattr(backend, "resolve_backend", lambda name, device: time.sleep(load_s))
    train._load_cpu_kernel(say=True)
    train._load_cpu_kernel(say=False)   # other ranks stay quiet
    out = capsys.readouterr().out.splitlines()
    assert out == ([train.KERNEL_BUILD_NOTICE] if said else [])
