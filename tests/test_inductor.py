"""``torch.compile`` (default mode, the default Inductor backend) of FTRL training steps on the CPU
gives eager's bits: the output of every step, then weights, accum, linear and the counters
(``bounds_check_warning``, ``nonfinite_grad_rows``, ``iter``) after it, and an eval forward after
the steps. (a) The TBE alone, (b) a one-process DMP (gloo) of an ``EmbeddingBagCollection`` with
FTRL ``fused_params``; for the CPU backends ``cpp`` (the compiled kernel, reached through the
registered ops ``torch.ops.torchrec_ftrl.*``, whose in-place mutations Inductor functionalizes and
lowers: checked) and ``torch`` (the vectorised PyTorch implementation, traced), stored and lean row
layouts, and the ``WARNING`` (a bad index in every batch, repaired and counted) and ``FATAL`` (a bad
batch refused, the state unchanged) bounds checks. On a GPU, the Triton backend's TBE too, with
``IGNORE`` among the modes (a checked batch: ``tbe_forward`` mutates only a scratch ``warn``).

The CPU tests run in a child pytest (:func:`test_inductor_suite`): Inductor's compile workers and
its OpenMP kernels stay out of the suite's own process, whose later tests fork workers (a fork of a
process with other threads can deadlock the child)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from conftest import REPO, TBE_STATE, bits, cuda, needs_cuda
from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.fbgemm_enums import BoundsCheckMode

LAYOUTS = {"stored-elementwise": {}, "derived-elementwise": dict(ftrl_weights="derived"),
           "derived-rowwise": dict(ftrl_weights="derived", ftrl_accumulator="rowwise")}
KNOBS = dict(learning_rate=0.3, ftrl_l1_reg=0.01, ftrl_l2_reg=0.02, ftrl_beta=0.5,
             ftrl_initial_accumulator_value=0.1)
STEPS = 3
# The ops a compiled training step runs inside Inductor's graphs (backends cpp and triton).
STEP_OPS = {"tbe_forward", "tbe_backward_update_"}
_CHILD_ENV = "TORCHREC_FTRL_INDUCTOR_CHILD"
in_child = pytest.mark.skipif(os.environ.get(_CHILD_ENV) != "1",
                              reason="runs in the child pytest of test_inductor_suite")


@pytest.mark.skipif(os.environ.get(_CHILD_ENV) == "1", reason="the child process itself")
def test_inductor_suite():
    """Runs this file's CPU tests in a child pytest; asserts that it passed and skipped none."""
    env = {**os.environ, _CHILD_ENV: "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                           "-m", "not cuda", "-k", "not inductor_suite"],
                          env=env, capture_output=True, text=True, timeout=1200, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and "skipped" not in last and "deselected" in last, last


class _LoweredOps(CustomGraphPass):
    """Inductor's post-grad pass that changes nothing and records the ``torchrec_ftrl`` ops of each
    graph it lowers (no ``uuid``: Inductor's cache is skipped, so every graph passes here)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.seen.update(re.findall(r"torchrec_ftrl\.(\w+)", str(graph)))

    def uuid(self):
        return None


@pytest.fixture
def lowered():
    """The names of the ``torchrec_ftrl`` ops Inductor lowers during the test; every test compiles
    from scratch (no graph of another test's module is reused)."""
    torch._dynamo.reset()
    recorder = _LoweredOps()
    with torch._inductor.config.patch(post_grad_custom_post_pass=recorder):
        yield recorder.seen
    torch._dynamo.reset()


def _assert_same(eager, compiled, what: str) -> None:
    assert len(eager) == len(compiled), what
    for i, (e, c) in enumerate(zip(eager, compiled)):
        assert e.dtype == c.dtype, what
        assert torch.equal(bits(e), bits(c)), f"{what}: tensor {i} differs"


def _state(tbe) -> list[torch.Tensor]:
    return [getattr(tbe, name) for name in TBE_STATE]


def _upstream(step: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + step))


# ---------------------------------------------------------------------------------------- the TBE

def _tbe(backend: str, layout: str, mode: str, device: str) -> FTRLTableBatchedEmbeddingBags:
    torch.manual_seed(0)            # the same initial weights for the eager and the compiled TBE
    return FTRLTableBatchedEmbeddingBags([(20, 4), (10, 8)], feature_table_map=[0, 1, 0], backend=backend,
                                         bounds_check_mode=getattr(BoundsCheckMode, mode), device=device,
                                         **KNOBS, **LAYOUTS[layout])


def _tbe_batch(step: int, bad: bool, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """B = 2 bags of each of the 3 features (tables 0, 1, 0), bag 4 empty, random rows (one shape for
    every step: one compile); with ``bad`` the first index of bag 2 (feature 1: table 1, 10 rows) is 15."""
    offsets = torch.tensor([0, 2, 3, 6, 8, 8, 11])
    bag_rows = torch.tensor([20, 20, 10, 10, 20, 20]).repeat_interleave(offsets.diff())
    indices = (torch.rand(11, generator=torch.Generator().manual_seed(step)) * bag_rows).long()
    if bad:
        indices[3] = 15
    return indices.to(device), offsets.to(device)


def _tbe_step(tbe, indices, offsets, up):
    out = tbe(indices, offsets)
    (out * up).sum().backward()
    return out.detach()


def check_tbe_compiles(lowered: set, backend: str, layout: str, mode: str, device: str = "cpu") -> None:
    """``STEPS`` training steps (forward, ``loss.backward()`` applying the FTRL update) by the eager
    and by the compiled step on twin TBEs (``WARNING``: every batch holds a bad index), the same bits;
    the ops in Inductor's graphs unless
    the backend calls its implementation directly (``torch``); under ``FATAL`` a last bad batch
    raises in both and changes nothing; then the eval forward, eager and compiled."""
    eager, twin = _tbe(backend, layout, mode, device), _tbe(backend, layout, mode, device)
    compiled = torch.compile(_tbe_step)
    for step in range(STEPS):
        indices, offsets = _tbe_batch(step, mode == "WARNING", device)
        up = _upstream(step, (2, 16)).to(device)
        _assert_same([_tbe_step(eager, indices, offsets, up)], [compiled(twin, indices, offsets, up)],
                     f"output of step {step}")
        _assert_same(_state(eager), _state(twin), f"state after step {step}")
    if backend != "torch":
        assert STEP_OPS <= lowered, lowered
    assert int(twin.bounds_check_warning) == (STEPS if mode == "WARNING" else 0)
    if mode == "FATAL":
        indices, offsets = _tbe_batch(STEPS, True, device)
        for m, fn in ((eager, _tbe_step), (twin, compiled)):
            with pytest.raises(ValueError, match=r"indices\[3\]=15"):
                fn(m, indices, offsets, _upstream(STEPS, (2, 16)).to(device))
        _assert_same(_state(eager), _state(twin), "state after the refused batch")
    assert int(twin.iter) == STEPS
    indices, offsets = _tbe_batch(STEPS + 1, False, device)
    with torch.no_grad():
        _assert_same([eager(indices, offsets)], [torch.compile(twin)(indices, offsets)], "eval output")


@in_child
@pytest.mark.parametrize("backend,layout,mode", [
    ("cpp", "stored-elementwise", "WARNING"), ("cpp", "stored-elementwise", "FATAL"),
    ("cpp", "derived-rowwise", "WARNING"), ("cpp", "derived-rowwise", "FATAL"),
    ("torch", "stored-elementwise", "WARNING"), ("torch", "derived-elementwise", "FATAL"),
    ("torch", "derived-rowwise", "WARNING")])
def test_tbe_training_step_compiles_to_eager_bits(lowered, backend, layout, mode):
    check_tbe_compiles(lowered, backend, layout, mode)


@cuda
@needs_cuda
@pytest.mark.parametrize("layout,mode", [("stored-elementwise", "IGNORE"), ("stored-elementwise", "FATAL"),
                                         ("derived-rowwise", "WARNING"), ("derived-rowwise", "IGNORE")])
def test_cuda_tbe_training_step_compiles_to_eager_bits(lowered, layout, mode):
    """The Triton backend: a checked batch (``IGNORE``) gives ``tbe_forward`` a scratch ``warn``
    (``check`` False) and ``tbe_linearize`` none; a raw one (``WARNING``, ``FATAL``) its counter."""
    check_tbe_compiles(lowered, "triton", layout, mode, device="cuda")


# ------------------------------------------------------------------------------- a one-process DMP

def _dmp(sc, layout: str, mode: str):
    """A one-process DMP (:mod:`dist_scenarios`) of two FTRL tables of 24 rows (table-wise,
    ``fused``) with ``fused_params`` of the layout and the bounds check; the same initial weights
    on every call."""
    torch.manual_seed(0)
    return sc._ck_model(1, "tw", dict(LAYOUTS[layout], bounds_check_mode=getattr(BoundsCheckMode, mode)))


def _dmp_state(dmp) -> list[torch.Tensor]:
    from torchrec_ftrl.integration.compute_kernels import ftrl_tbes
    return [t for tbe in ftrl_tbes(dmp) for t in _state(tbe)]


def _dmp_batch(sc, step: int, bad: bool):
    """The KJT of step ``step`` (3 samples, 2 features); with ``bad`` feature 1's first bag reads row
    27 of a 24-row table."""
    gb = sc.batch(step, sc.CK_FEATS, 0, 1)
    if bad:
        gb[sc.CK_FEATS[1]][0] = [sc.ROWS + 3]
    return sc.local_kjt(gb, sc.CK_FEATS, 0)


def _dmp_step(dmp, kjt, up):
    out = dmp(kjt).values()
    (out * up).sum().backward()
    return out.detach()


@in_child
@pytest.mark.parametrize("backend,layout,mode", [
    ("cpp", "stored-elementwise", "WARNING"), ("cpp", "derived-rowwise", "FATAL"),
    ("torch", "derived-elementwise", "WARNING")])
def test_dmp_training_step_compiles_to_eager_bits(one_process, monkeypatch, lowered, backend, layout, mode):
    """``STEPS`` training steps of twin DMPs, eager and compiled (the backend: the TBEs' default,
    which DMP's kernels leave to the TBE, set to ``backend``); under ``FATAL`` a last bad batch
    raises in both and changes nothing."""
    from torchrec_ftrl.kernels import backend as backends
    from torchrec_ftrl.tbe import args as tbe_args
    sc = one_process
    monkeypatch.setattr(tbe_args, "resolve_backend",
                        lambda name, device: backends.resolve_backend(name or backend, device))
    eager, twin = _dmp(sc, layout, mode), _dmp(sc, layout, mode)
    _assert_same(_dmp_state(eager), _dmp_state(twin), "initial state")
    compiled = torch.compile(_dmp_step)
    for step in range(STEPS):
        kjt, up = _dmp_batch(sc, step, bad=mode == "WARNING"), _upstream(step, (sc.B_LOCAL, 2 * sc.DIM))
        _assert_same([_dmp_step(eager, kjt, up)], [compiled(twin, kjt, up)], f"output of step {step}")
        _assert_same(_dmp_state(eager), _dmp_state(twin), f"state after step {step}")
    if backend == "cpp":
        assert STEP_OPS <= lowered, lowered
    counted = sum(int(s) for s in _dmp_state(twin)[TBE_STATE.index("bounds_check_warning")::len(TBE_STATE)])
    assert counted == (STEPS if mode == "WARNING" else 0)
    if mode == "FATAL":
        kjt, up = _dmp_batch(sc, STEPS, bad=True), _upstream(STEPS, (sc.B_LOCAL, 2 * sc.DIM))
        for m, fn in ((eager, _dmp_step), (twin, compiled)):
            with pytest.raises(ValueError, match="=27 out of range"):
                fn(m, kjt, up)
        _assert_same(_dmp_state(eager), _dmp_state(twin), "state after the refused batch")
