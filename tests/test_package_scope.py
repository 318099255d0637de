"""What ``pip install torchrec-ftrl`` brings, and what ``import torchrec_ftrl`` changes.

The optimizer needs torch, torchrec and fbgemm_gpu only; the CTR job's packages are the ``[job]``
extra. Importing the package changes nothing for tables that are not FTRL.
"""

import json
import os
import subprocess
import sys
import tomllib

from conftest import REPO

from torchrec_ftrl.job.extra import JOB_MODULES


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, **(env or {})})


def test_job_packages_are_the_job_extra_only():
    meta = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["project"]
    core = {d.split(">")[0].split("=")[0].strip() for d in meta["dependencies"]}
    job = {d.split(">")[0].split("=")[0].strip() for d in meta["optional-dependencies"]["job"]}
    assert job == set(JOB_MODULES)
    assert core.isdisjoint(job)


def test_import_loads_no_job_package():
    # tqdm is left out: torchrec itself imports it.
    code = ("import sys, torchrec_ftrl; "
            "print(sorted(m for m in ('pyarrow', 'torchx', 'torchmetrics', 'matplotlib') if m in sys.modules))")
    p = _run("-c", code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]"


def test_cpu_training_needs_no_triton():
    """torch's CPU wheels come without triton, which the package does not require: with triton
    unimportable, the package imports and a CPU TBE trains (the compiled kernel), with the bits of
    the same step where triton is installed."""
    code = ("import sys\n"
            "if sys.argv[1] == '1': sys.modules['triton'] = None\n"
            "import torch, torchrec_ftrl\n"
            "torch.manual_seed(0)\n"
            "tbe = torchrec_ftrl.FTRLTableBatchedEmbeddingBags([(100, 8), (50, 4)], learning_rate=0.05,\n"
            "    ftrl_l1_reg=0.01, device='cpu')\n"
            "out = tbe(torch.tensor([1, 2, 3, 4, 1]), torch.tensor([0, 2, 3, 4, 5]))\n"
            "(out * torch.arange(1.0, out.numel() + 1).view_as(out)).sum().backward()\n"
            "print(tbe.backend, 'triton' in sys.modules and sys.modules['triton'] is not None,\n"
            "      [w.double().sum().item() for w in tbe.split_embedding_weights()])\n")
    lines = []
    for blocked in ("1", "0"):
        p = _run("-c", code, blocked)
        assert p.returncode == 0, p.stderr[-3000:]
        lines.append(p.stdout.strip().splitlines()[-1])
    assert lines[0].startswith("cpp False ["), lines[0]
    assert lines[0].split(" ", 2)[2] == lines[1].split(" ", 2)[2]


def test_job_without_its_extra_says_so_in_one_line(tmp_path):
    # A stand-in package named pyarrow that cannot be found: find_spec returns None for it.
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.util as u\n_f = u.find_spec\n"
        "u.find_spec = lambda name, *a: None if name == 'pyarrow' else _f(name, *a)\n")
    p = _run("-m", "torchrec_ftrl.job", "--steps", "1",
             env={"PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])})
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr == ("train_ctr: error: the CTR job needs the [job] extra, missing pyarrow: "
                        "pip install 'torchrec-ftrl[job]'\n")


def test_import_changes_nothing_for_stock_tables():
    probe = os.path.join(REPO, "tests", "stock_model_probe.py")
    runs = []
    for with_ftrl in ("0", "1"):
        p = _run(probe, with_ftrl)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    without, with_ = runs
    assert with_["plan"] == without["plan"]
    assert with_["state"] == without["state"]
    assert sum("momentum1" in n for n in without["state"]) == 3  # each table's optimizer state is digested
    assert with_["digest"] == without["digest"]
