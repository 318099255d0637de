"""Shared helpers and fixtures of the test suite, each defined once here.

* bit snapshots: :func:`bits`, :func:`tbe_state`, :func:`assert_same_bits`;
* the float64 TBE oracle: :func:`reference_forward` (pooled lookup through
  ``torch.nn.functional.embedding_bag`` / ``embedding`` per feature) and :func:`reference_update`
  (the summed gradient of each touched row by float64 autograd, then ONE ``ftrl_reference_rows``
  update per row; the rule itself is ``tests/reference.py``, transcribed from ``docs/ftrl.md``);
* the DMP spawn harness: :func:`run_distributed` (fixture ``run_distributed``), :func:`device_type`;
* the Triton interpreter-mode child pytest: :func:`run_interpreter_suite` and the ``INTERP`` /
  ``HAS_CUDA`` flags and marks;
* the CTR job's launchers: :func:`run_job` (one process), :func:`run_torchx` (the torchx component);
* the sample-data location: ``$TORCHREC_FTRL_DATA`` (default ``<repo>/../shared/data``), fixture
  ``sample_data`` (skips a test when a file is absent);
* TorchRec's stock objects as they were before ``import torchrec_ftrl`` patched them: :data:`STOCK`.

Plain functions are imported by name (``from conftest import bits``), also by the worker modules
that spawned processes import; nothing here imports ``torchrec_ftrl``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import subprocess
import sys
from typing import Optional, Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as Fn
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

from reference import ftrl_reference_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------------------------ bit snapshots


def bits(t: torch.Tensor) -> torch.Tensor:
    """A copy of the raw bytes of ``t`` on the CPU (bitwise comparison: NaN == NaN, -0.0 != 0.0);
    an empty tensor gives an empty byte tensor."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()


TBE_STATE = ("weights_dev", "accum_dev", "linear_dev", "bounds_check_warning", "nonfinite_grad_rows",
             "iter")


def tbe_state(m) -> list[torch.Tensor]:
    """Copies of every buffer an FTRL TBE step may change: weights, accum, linear and the counters."""
    return [getattr(m, name).detach().clone() for name in TBE_STATE]


def assert_same_bits(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> None:
    assert len(before) == len(after)
    for i, (b, a) in enumerate(zip(before, after)):
        assert b.dtype == a.dtype and torch.equal(bits(b), bits(a)), f"tensor {i} changed"


# ------------------------------------------------------------------------------ float64 TBE oracle


def bag_sizes(num_bags: int, num_features: int, vbe: Optional[Sequence[Sequence[int]]] = None) -> list[int]:
    """Number of bags of each feature (feature-major input order): VBE's per-rank sizes summed, else
    ``num_bags / num_features`` each."""
    if vbe is not None:
        return [sum(per_rank) for per_rank in vbe]
    return [num_bags // num_features] * num_features


def index_tables(feature_table_map: Sequence[int], sizes: Sequence[int], offsets) -> np.ndarray:
    """``[N]`` table of each index, for feature-major bags of ``sizes`` bags per feature."""
    off = torch.as_tensor(offsets).long().cpu().numpy()
    bag_feature = np.repeat(np.arange(len(sizes)), sizes)
    index_bag = np.repeat(np.arange(len(bag_feature)), np.diff(off))
    if not len(index_bag):
        return np.zeros(0, dtype=np.int64)
    return np.asarray(feature_table_map, dtype=np.int64)[bag_feature[index_bag]]


def reference_forward(tables64: list[torch.Tensor], feature_table_map: Sequence[int], pooling,
                      indices, offsets, psw=None, vbe=None) -> torch.Tensor:
    """Float64 FBGEMM-TBE output (SUM/MEAN pooling, per-sample weights, empty bags give 0);
    ``tables64`` (float64 ``[rows, D]`` per table) may require grad (for the reference gradients).

    Returns ``[B, sum D_f]`` (SUM/MEAN), ``[N, D]`` (NONE) or the flat FBGEMM VBE output (ranks, then
    features, then samples)."""
    idx = torch.as_tensor(indices).long().cpu()
    off = torch.as_tensor(offsets).long().cpu()
    psw64 = psw.double().cpu() if psw is not None else None
    sizes = bag_sizes(off.numel() - 1, len(feature_table_map), vbe)
    per_feature, bag0 = [], 0
    for f, nb in enumerate(sizes):
        W = tables64[feature_table_map[f]]
        lo, hi = int(off[bag0]), int(off[bag0 + nb])
        if pooling == PoolingMode.NONE:
            per_feature.append(Fn.embedding(idx[lo:hi], W))
        else:
            foff = off[bag0:bag0 + nb] - lo
            fp = psw64[lo:hi] if psw64 is not None else None
            if pooling == PoolingMode.SUM or fp is None:
                mode = "sum" if pooling == PoolingMode.SUM else "mean"
                pooled = Fn.embedding_bag(idx[lo:hi], W, foff, mode=mode, per_sample_weights=fp,
                                          include_last_offset=False)
            else:  # MEAN with per-sample weights: weighted sum / bag length
                pooled = Fn.embedding_bag(idx[lo:hi], W, foff, mode="sum", per_sample_weights=fp)
                lens = (off[bag0 + 1:bag0 + nb + 1] - off[bag0:bag0 + nb]).double().clamp(min=1)
                pooled = pooled / lens.unsqueeze(1)
            per_feature.append(pooled)
        bag0 += nb
    if pooling == PoolingMode.NONE:
        return torch.cat(per_feature, 0)
    if vbe is None:
        return torch.cat(per_feature, 1)
    chunks = []
    for r in range(len(vbe[0])):
        for f in range(len(sizes)):
            start = sum(vbe[f][:r])
            chunks.append(per_feature[f][start:start + vbe[f][r]].reshape(-1))
    return torch.cat(chunks)


def _f64(x) -> torch.Tensor:
    """A float64 CPU copy of a tensor or array."""
    if torch.is_tensor(x):
        return x.detach().cpu().double().clone()
    return torch.tensor(np.asarray(x, dtype=np.float64))


@dataclasses.dataclass
class ReferenceStep:
    """One float64 reference training step of a TBE (see :func:`reference_update`).

    ``out``: expected forward output; ``psw_grad``: gradient of the per-sample weights (weights
    before the update) or None; per table ``t``: ``touched[t]`` the distinct rows the batch reads,
    ``flagged[t]`` those whose summed gradient is non-finite (skipped: their state must keep its
    bits), ``updated[t]`` the others, and ``w[t]``, ``z[t]``, ``n[t]`` the float64 tables after the
    step (rows not updated copied unchanged)."""

    out: torch.Tensor
    psw_grad: Optional[torch.Tensor]
    touched: list
    flagged: list
    updated: list
    w: list
    z: list
    n: list


def reference_update(weights, accums, linears, feature_table_map: Sequence[int], pooling, indices,
                     offsets, grad_out, knobs: dict, psw=None, vbe=None) -> ReferenceStep:
    """The float64 expected result of one TBE step from the tables ``weights`` / ``accums`` /
    ``linears`` (per table ``[rows, D]``, any float dtype or array) and the output gradient
    ``grad_out``: the forward by :func:`reference_forward`, each touched row's summed gradient by
    float64 autograd of ``sum(out * grad_out)``, then one ``ftrl_reference_rows`` update (``knobs``:
    its keywords) per row whose summed gradient is finite."""
    tables64 = [_f64(w).requires_grad_(True) for w in weights]
    psw64 = psw.detach().double().cpu().requires_grad_(True) if psw is not None else None
    out = reference_forward(tables64, feature_table_map, pooling, indices, offsets, psw64, vbe)
    (out * torch.as_tensor(grad_out).detach().double().cpu().reshape(out.shape)).sum().backward()
    off = torch.as_tensor(offsets).long().cpu()
    idx = torch.as_tensor(indices).long().cpu().numpy()
    idx_table = index_tables(feature_table_map, bag_sizes(off.numel() - 1, len(feature_table_map), vbe),
                             off)
    step = ReferenceStep(out.detach(), psw64.grad if psw64 is not None else None, [], [], [], [], [], [])
    for t, W in enumerate(tables64):
        rows, dim = W.shape
        g = W.grad if W.grad is not None else torch.zeros(rows, dim, dtype=torch.float64)
        touched = np.unique(idx[idx_table == t])
        finite = torch.isfinite(g[torch.as_tensor(touched, dtype=torch.long)]).all(dim=1).numpy()
        updated = touched[finite]
        w, z, n = ftrl_reference_rows(W.detach().numpy(), _f64(linears[t]).numpy(),
                                      _f64(accums[t]).numpy(), updated,
                                      g[torch.as_tensor(updated, dtype=torch.long)].numpy(), **knobs)
        for field, value in (("touched", touched), ("flagged", touched[~finite]), ("updated", updated),
                             ("w", w), ("z", z), ("n", n)):
            getattr(step, field).append(value)
    return step


# ------------------------------------------------------------------------ TorchRec's stock objects


def stock_snapshot() -> dict:
    """What ``torchrec_ftrl.integration`` patches, as comparable facts: the ``EmbOptimType`` members,
    ``torchrec.optim.FTRL``, both grouped lookups' ``_create_embedding_kernel``, the default planner's
    enumerator and storage estimator classes, and the optimizer class <-> type maps."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    import torchrec.optim as trec_optim
    from torchrec.distributed import embedding_lookup, utils as dist_utils
    from torchrec.distributed.planner import enumerators, planners

    def where(obj) -> str:
        code = getattr(obj, "__code__", None)
        loc = f"@{code.co_filename}:{code.co_firstlineno}" if code is not None else ""
        return f"{obj.__module__}.{obj.__qualname__}{loc}"

    maps = {}
    for name in ("_OPTIMIZER_CLASS_TO_EMB_OPT_TYPE", "_EMB_OPT_TYPE_TO_OPTIMIZER_CLASS"):
        mapping = getattr(dist_utils, name, None)
        maps[name] = None if mapping is None else sorted((repr(k), repr(v)) for k, v in mapping.items())
    return {
        "members": list(EmbOptimType.__members__),
        "iteration": [m.name for m in EmbOptimType],
        "values": sorted(EmbOptimType._value2member_map_),
        "EmbOptimType.FTRL": repr(getattr(EmbOptimType, "FTRL", None)),
        "torchrec.optim.FTRL": repr(vars(trec_optim).get("FTRL")),
        "kernels": {cls.__name__: where(vars(cls)["_create_embedding_kernel"])
                    for cls in (embedding_lookup.GroupedPooledEmbeddingsLookup,
                                embedding_lookup.GroupedEmbeddingsLookup)},
        "storage_estimator": where(enumerators.EmbeddingStorageEstimator),
        "planner_enumerator": where(planners.EmbeddingEnumerator),
        "maps": maps,
    }


# Taken when pytest imports this file, before any test module imports torchrec_ftrl (which installs
# the integration); None if something imported the package earlier (then a subprocess takes it).
STOCK = None if "torchrec_ftrl" in sys.modules else stock_snapshot()


# --------------------------------------------------------------------------------- DMP spawn harness


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_type() -> str:
    """``cuda`` when FTRL_TEST_DEVICE=cuda (NCCL, one GPU per process), else ``cpu`` (gloo)."""
    return os.environ.get("FTRL_TEST_DEVICE", "cpu")


def _entry(rank: int, world_size: int, port: int, fn, args) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    if device_type() == "cuda":
        torch.cuda.set_device(rank)
    # A stuck rendezvous or collective fails after 10 minutes instead of torch's default 30.
    dist.init_process_group("nccl" if device_type() == "cuda" else "gloo", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(minutes=10))
    try:
        fn(rank, world_size, *args)
        # No rank closes its gloo connections while a peer may still be sending on them (a rank
        # torn down mid-transfer aborts the peer: "terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def flat_checkpoint(step_dir, tmp) -> dict:
    """Every tensor of a DCP checkpoint as ``{dotted key: tensor}``, read by an independent reader:
    DCP's own format converter (``dcp_to_torch_save`` into ``tmp``), not the job's loading code."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = os.path.join(str(tmp), f"flat-{os.path.basename(str(step_dir))}-{abs(hash(str(step_dir)))}.pt")
    dcp_to_torch_save(str(step_dir), out)
    flat = {}

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, torch.Tensor):
            flat[prefix] = obj
    walk("", torch.load(out, weights_only=False))
    return flat


def run_distributed(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes (gloo, or NCCL with
    FTRL_TEST_DEVICE=cuda); re-raises a worker's error. ``fn`` must be importable by name (a worker
    module of tests/)."""
    import warnings

    import torch.multiprocessing as mp
    try:
        mp.spawn(_entry, args=(world_size, _free_port(), fn, args), nprocs=world_size, join=True)
    except mp.ProcessExitedException as e:
        # gloo's C++ transport sometimes aborts a CPU rank ("terminate called without an active
        # exception", SIGABRT, no Python error) in runs whose every assertion passes on rerun. Such a
        # death, and only such a death, is retried once on a fresh port; a Python error in a worker,
        # or a second abort, fails the test.
        if e.signal_name != "SIGABRT" or device_type() != "cpu":
            raise
        warnings.warn(f"rank {e.error_index} of {fn.__name__} aborted (SIGABRT); running it once more")
        mp.spawn(_entry, args=(world_size, _free_port(), fn, args), nprocs=world_size, join=True)


@pytest.fixture(name="run_distributed")
def run_distributed_fixture():
    """:func:`run_distributed`, for the multi-process (DMP) tests."""
    return run_distributed


# ------------------------------------------------------------------ Triton interpreter / CUDA marks

HAS_CUDA = torch.cuda.is_available()
# True in the child pytest of run_interpreter_suite: Triton kernels run interpreted on CPU tensors.
INTERP = os.environ.get("TRITON_INTERPRET") == "1" and not HAS_CUDA
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
interp_only = pytest.mark.skipif(not INTERP, reason="runs in the TRITON_INTERPRET=1 child process")
interpreter_parent = pytest.mark.skipif(
    INTERP or HAS_CUDA, reason="the child process itself / CUDA runs the compiled kernels")


def run_interpreter_suite(test_file: str, timeout: int = 900) -> None:
    """Run the ``interp`` tests of ``test_file`` in a child pytest with ``TRITON_INTERPRET=1``.

    Triton fixes interpret-vs-compile when ``@triton.jit`` runs, so the variable must be set before
    anything imports triton: only the child process sees it. Asserts that the child passed and ran
    every selected test (none skipped)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           test_file, "-k", "interp and not interpreter_suite"],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


@pytest.fixture
def interp(monkeypatch):
    """Run the Triton backend under the interpreter on CPU tensors (the ``interp`` tests of a file,
    in the child pytest of :func:`run_interpreter_suite`), with tiny launch shapes: SEG=4 (runs longer
    than 4 are cut into pieces and combined), few segments per program, small 1-D blocks. Returns the
    device, ``"cpu"``."""
    if not INTERP:
        pytest.skip("runs in the child process of test_interpreter_suite (TRITON_INTERPRET=1)")
    from torchrec_ftrl.kernels.cuda import backend as triton_backend
    for k, v in dict(seg=4, seg_launch={8: (32, 4)}, combine_cp=4, combine_nb=2, block=16,
                     repair_block=4).items():
        monkeypatch.setitem(triton_backend.TUNING, k, v)
    return "cpu"


# -------------------------------------------------------------------------------- the CTR job

JOB_SCRIPT = os.path.join(REPO, "examples", "train_ctr.py")
_BIN = os.path.dirname(sys.executable)


def _job_env(fault: Optional[str] = None, venv_path: bool = False) -> dict:
    """This environment without an inherited ``TORCHREC_FTRL_FAULT`` (with ``fault`` if given); with
    ``venv_path`` the interpreter's bin folder first on PATH (torchx finds ``torchrun`` there). Only
    torchx gets that PATH: a process that finds another ``ninja`` than pytest's own (the venv's
    against the system's) rebuilds the compiled CPU kernel, since the two versions hash the build
    command differently."""
    env = dict(os.environ)
    if venv_path:
        env["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")
    env.pop("TORCHREC_FTRL_FAULT", None)
    if fault:
        env["TORCHREC_FTRL_FAULT"] = fault
    return env


def run_job(args: Sequence[str], *, module: bool = False, cwd: str = REPO,
            timeout: float = 240) -> subprocess.CompletedProcess:
    """One process of the CTR job: ``examples/train_ctr.py ARGS`` (or ``python -m torchrec_ftrl.job``
    with ``module``), no fault injected; returns the finished process (text output captured)."""
    cmd = [sys.executable, *(["-m", "torchrec_ftrl.job"] if module else [JOB_SCRIPT]), *args]
    return subprocess.run(cmd, cwd=cwd, env=_job_env(), capture_output=True, text=True, timeout=timeout)


def run_torchx(args: Sequence[str], *, nproc: int = 2, fault: Optional[str] = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchx run -s local_cwd torchrec_ftrl/components.py:train_ctr --nproc N -- ARGS`` from the
    checkout, with the ``TORCHREC_FTRL_FAULT`` hook set to ``fault`` (or unset)."""
    return subprocess.run([os.path.join(_BIN, "torchx"), "run", "-s", "local_cwd",
                           "torchrec_ftrl/components.py:train_ctr", "--nproc", str(nproc), "--", *args],
                          cwd=REPO, env=_job_env(fault, venv_path=True), capture_output=True, text=True,
                          timeout=timeout)


# -------------------------------------------------------------------------------------- sample data


def data_dir() -> str:
    """Where the sample data sets live: ``$TORCHREC_FTRL_DATA``, default ``<repo>/../shared/data``."""
    return os.environ.get("TORCHREC_FTRL_DATA") or os.path.join(os.path.dirname(REPO), "shared", "data")


@pytest.fixture(scope="session")
def sample_data():
    """``sample_data(*parts)``: the path of a sample-data file below :func:`data_dir`; skips the test
    when it is absent."""
    def path(*parts: str) -> str:
        p = os.path.join(data_dir(), *parts)
        if not os.path.exists(p):
            pytest.skip(f"sample data {p} not present (set TORCHREC_FTRL_DATA)")
        return p
    return path


@pytest.fixture
def one_process():
    """A one-process gloo process group (DMP on the CPU) for the test; yields :mod:`dist_scenarios`."""
    import torch.distributed as dist
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield __import__("dist_scenarios")
    dist.destroy_process_group()
