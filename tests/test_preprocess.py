"""``python -m torchrec_ftrl.data.preprocess``: raw Criteo files -> binary triplets.

The expected arrays are TorchRec's own: ``BinaryCriteoUtils.tsv_to_npys`` on the same valid rows
(written here as plain TSV; for the Kaggle CSV the test turns the rows into TSV itself). The files
must be byte-identical. Resume, crash safety (a raise in the middle of a write, and a worker killed
with ``os._exit``) and the one-line errors for bad paths are checked on the files left in the
output folder.
"""

import gzip
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, _job_env
from torchrec_ftrl.data import npy_convert
from torchrec_ftrl.data.preprocess import main

KINDS = ("dense", "sparse", "labels")


@pytest.fixture(scope="module")
def lines(sample_data):
    with open(sample_data("criteo", "criteo_dac_combined.tsv")) as f:
        return [line.rstrip("\n") for _, line in zip(range(400), f)]


def _write(path, rows, gz=False):
    data = "".join(r + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        path.write_text(data)
    return str(path)


def _torchrec(rows, tmp_path, name):
    """``{kind: bytes}`` of tsv_to_npys on ``rows`` (plain TSV lines)."""
    from torchrec.datasets.criteo import BinaryCriteoUtils

    d = tmp_path / f"ref_{name}"
    d.mkdir()
    tsv = _write(d / "in.tsv", rows)
    outs = [str(d / f"{k}.npy") for k in KINDS]
    BinaryCriteoUtils.tsv_to_npys(tsv, *outs)
    return {k: open(p, "rb").read() for k, p in zip(KINDS, outs)}


def _out(out, prefix):
    return {k: open(os.path.join(out, f"{prefix}_{k}.npy"), "rb").read() for k in KINDS}


def _listing(out):
    return sorted(os.listdir(out))


def test_converts_like_tsv_to_npys(lines, tmp_path, capsys):
    a = _write(tmp_path / "day_0", lines[:250])
    b = _write(tmp_path / "day_1.gz", lines[250:], gz=True)
    out = str(tmp_path / "out")
    assert main([a, b, "--out", out, "--workers", "2", "--no-progress"]) == 0
    assert _out(out, "day_0") == _torchrec(lines[:250], tmp_path, "a")
    assert _out(out, "day_1") == _torchrec(lines[250:], tmp_path, "b")
    assert _listing(out) == sorted(f"day_{i}_{k}.npy" for i in (0, 1) for k in KINDS)  # no temp left
    text = capsys.readouterr().out
    assert "day_0: 250 valid rows, 0 malformed rows skipped" in text
    assert "day_1: 150 valid rows" in text and "2 converted, 0 skipped" in text
    # the arrays as the docs describe them: dense float32 [n, 13], sparse int64 [n, 26], labels int32 [n, 1]
    arrs = {k: np.load(os.path.join(out, f"day_0_{k}.npy")) for k in KINDS}
    assert (arrs["dense"].dtype, arrs["dense"].shape) == (np.float32, (250, 13))
    assert (arrs["sparse"].dtype, arrs["sparse"].shape) == (np.int64, (250, 26))
    assert (arrs["labels"].dtype, arrs["labels"].shape) == (np.int32, (250, 1))
    assert arrs["sparse"][0, 0] == 0x68fd1e64 and arrs["labels"][:3, 0].tolist() == [0, 0, 0]


def test_torchrec_engine(lines, tmp_path, capsys):
    """``--engine torchrec`` runs tsv_to_npys itself, under the same temp-then-rename and resume."""
    a = _write(tmp_path / "day_3.tsv", lines[:120])
    out = str(tmp_path / "out")
    assert main([a, "--out", out, "--engine", "torchrec", "--no-progress"]) == 0
    assert _out(out, "day_3") == _torchrec(lines[:120], tmp_path, "t")
    assert _listing(out) == [f"day_3_{k}.npy" for k in ("dense", "labels", "sparse")]
    assert main([a, "--out", out, "--engine", "torchrec", "--no-progress"]) == 0
    assert "day_3: complete in" in capsys.readouterr().out
    blank = _write(tmp_path / "blank.tsv", lines[:5] + [""] + lines[5:10])  # tsv_to_npys fails on it
    assert main([blank, "--out", out, "--engine", "torchrec", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{blank}: BinaryCriteoUtils.tsv_to_npys failed: IndexError" in err[0]
    assert not any(n.startswith(("blank", ".blank")) for n in _listing(out))


def test_kaggle_csv_and_malformed_rows(sample_data, tmp_path, capsys):
    with open(sample_data("criteo", "kaggle2014_train.tiny.csv"), newline="") as f:
        csv_lines = f.read().split("\r\n")[:121]  # header + 120 rows, CRLF
    src = tmp_path / "train.csv"
    src.write_bytes(("\r\n".join(csv_lines) + "\r\n").encode())
    as_tsv = ["\t".join(line.split(",")[1:]) for line in csv_lines[1:]]  # drop Id
    out = str(tmp_path / "out")
    assert main([str(src), "--out", out, "--format", "kaggle-csv", "--no-progress"]) == 0
    assert _out(out, "train") == _torchrec(as_tsv, tmp_path, "csv")

    fields = as_tsv[30].split("\t")
    fields[2] = "1.5"  # I2 not an integer
    bad = as_tsv[:30] + ["", "1\t2\t3", "\t".join(fields)] + as_tsv[31:60]
    p = _write(tmp_path / "messy.tsv", bad)
    assert main([p, "--out", out, "--no-progress"]) == 0
    assert _out(out, "messy") == _torchrec(as_tsv[:30] + as_tsv[31:60], tmp_path, "messy")
    text = capsys.readouterr().out
    assert "messy: 59 valid rows, 2 malformed rows skipped (dense: 1, field_count: 1)" in text
    assert f"{p}:32: expected 40 fields, got 3" in text  # line 31 is blank

    assert main([p, "--out", str(tmp_path / "strict"), "--strict", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"preprocess: error: {p}:32: malformed row (field_count): expected 40 fields, got 3"]
    assert _listing(tmp_path / "strict") == []


def test_resume_skips_complete_and_redoes_partial(lines, tmp_path, capsys):
    ins = [_write(tmp_path / f"day_{i}.tsv", lines[i * 100:(i + 1) * 100]) for i in range(3)]
    out = str(tmp_path / "out")
    assert main([*ins, "--out", out, "--workers", "2", "--no-progress"]) == 0
    want = {f"day_{i}": _out(out, f"day_{i}") for i in range(3)}
    stat = {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in _listing(out)}
    capsys.readouterr()
    assert main([*ins, "--out", out, "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert all(f"day_{i}: complete in {out}, skipped" in text for i in range(3))
    assert "0 converted, 3 skipped" in text
    assert {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in _listing(out)} == stat

    sparse = os.path.join(out, "day_1_sparse.npy")
    os.truncate(sparse, os.path.getsize(sparse) - 8)  # one int64 short
    os.remove(os.path.join(out, "day_2_labels.npy"))
    assert main([*ins, "--out", out, "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "day_0: complete" in text and "2 converted, 1 skipped" in text
    assert os.stat(os.path.join(out, "day_0_dense.npy")).st_mtime_ns == stat["day_0_dense.npy"]
    assert {f"day_{i}": _out(out, f"day_{i}") for i in range(3)} == want


def test_raise_mid_write_leaves_no_final_file(lines, tmp_path, monkeypatch):
    p = _write(tmp_path / "day_0.tsv", lines[:300])
    out = tmp_path / "out"
    calls = []

    def failing(f, block):
        calls.append(len(block))
        if len(calls) == 4:  # the second chunk's dense block (chunks of 64 rows)
            raise OSError("disk full (simulated)")
        f.write(block.tobytes())

    monkeypatch.setattr(npy_convert, "CHUNK_ROWS", 64)
    monkeypatch.setattr(npy_convert, "write_block", failing)
    with pytest.raises(OSError, match="simulated"):
        main([p, "--out", str(out), "--workers", "1", "--no-progress"])
    assert len(calls) == 4 and _listing(out) == []  # no final name, temporaries removed
    monkeypatch.undo()
    assert main([p, "--out", str(out), "--no-progress"]) == 0
    assert _out(str(out), "day_0") == _torchrec(lines[:300], tmp_path, "r")


def test_killed_worker_leaves_no_final_file(lines, tmp_path, monkeypatch, capsys):
    ins = [_write(tmp_path / "day_0.tsv", lines[:200]), _write(tmp_path / "day_1.tsv", lines[200:400])]
    out = tmp_path / "out"
    real = npy_convert.write_block

    def dying(f, block):
        if ".day_1_" in f.name and block.dtype == np.int32 and block.ndim == 2 and block.shape[1] == 13:
            if os.path.getsize(f.name) > 128:  # the second dense chunk of day_1: die mid-file
                f.flush()
                os._exit(9)
        real(f, block)

    monkeypatch.setattr(npy_convert, "CHUNK_ROWS", 64)
    monkeypatch.setattr(npy_convert, "write_block", dying)  # inherited by the forked workers
    assert main([*ins, "--out", str(out), "--workers", "2", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "preprocess: error: a worker process died" in err and "run the same command again" in err
    assert not any(n.startswith("day_1_") for n in _listing(out))
    left = [n for n in _listing(out) if n.startswith(".")]
    assert ".day_1_dense.npy.tmp" in left  # the dead worker's partial file, under its temp name
    monkeypatch.undo()
    assert main([*ins, "--out", str(out), "--workers", "2", "--no-progress"]) == 0
    assert _listing(out) == sorted(f"day_{i}_{k}.npy" for i in (0, 1) for k in KINDS)
    assert _out(str(out), "day_1") == _torchrec(lines[200:400], tmp_path, "k")


def test_bad_paths_one_line_each(lines, sample_data, tmp_path, capsys):
    good = _write(tmp_path / "day_0.tsv", lines[:10])
    (tmp_path / "afile").write_text("x")
    (tmp_path / "folder").mkdir()
    cases = [
        ([str(tmp_path / "nope.tsv"), "--out", str(tmp_path / "o")], f"{tmp_path / 'nope.tsv'}: input file not found"),
        ([str(tmp_path / "folder"), "--out", str(tmp_path / "o")], f"{tmp_path / 'folder'}: not a file"),
        ([good, "--out", str(tmp_path / "afile")], f"{tmp_path / 'afile'}: --out exists and is not a folder"),
        ([good, _write(tmp_path / "day_0.gz", lines[:5], gz=True), "--out", str(tmp_path / "o")],
         "output prefix 'day_0' is also that of"),
        ([good, "--out", str(tmp_path / "o"), "--workers", "0"], "--workers must be >= 1, got 0"),
        ([_write(tmp_path / "day_9.gz", lines[:5], gz=True), "--out", str(tmp_path / "o"), "--engine",
          "torchrec"], "day_9.gz: --engine torchrec cannot read .gz files"),
        ([good, "--out", str(tmp_path / "afile" / "sub")], "afile/sub: cannot create the output folder"),
    ]
    for argv, msg in cases:
        assert main([*argv, "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("preprocess: error: ") and msg in err[0], err
    assert not (tmp_path / "o").exists()  # nothing is written before the inputs are checked

    unlabeled = sample_data("criteo", "kaggle2014_test.tiny.unlabeled.csv")
    assert main([unlabeled, "--out", str(tmp_path / "o"), "--format", "kaggle-csv", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{unlabeled}:1: header 'Id,I1,I2" in err[0] and "no Label column" in err[0]
    empty = _write(tmp_path / "empty.tsv", ["", ""])
    assert main([empty, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"preprocess: error: {empty}: no valid row for --format tsv (0 valid rows, 0 malformed rows skipped)"]
    assert _listing(tmp_path / "o") == []


def test_module_command_with_progress_bar(lines, tmp_path):
    p = _write(tmp_path / "day_5.tsv", lines[:50])
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "torchrec_ftrl.data.preprocess", p, "--out", str(out)],
                         cwd=str(tmp_path), env=_job_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "preprocess: 100%" in run.stderr and "day_5: 50 valid rows" in run.stdout
    assert _out(str(out), "day_5") == _torchrec(lines[:50], tmp_path, "m")
    run = subprocess.run([sys.executable, "-m", "torchrec_ftrl.data.preprocess", str(tmp_path / "x.tsv"),
                          "--out", str(out)], cwd=REPO, env=_job_env(), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"preprocess: error: {tmp_path / 'x.tsv'}: input file not found"]
