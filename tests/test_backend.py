"""``torchrec_ftrl.kernels.backend``: every backend is a ``Backend`` record (its ops' ``OpTable``
and its ``Capabilities``), and ``resolve_backend`` picks and checks them. (What the backends
compute: tests/test_tbe.py for "cpp" and "torch", tests/test_tbe_triton.py for "triton".)"""

import dataclasses
import importlib

import pytest
import torch

from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.kernels import backend as backend_mod
from torchrec_ftrl.kernels.backend import BACKENDS, Backend, resolve_backend
from torchrec_ftrl.kernels.capabilities import Capabilities, OpTable
from torchrec_ftrl.kernels.ops import SCHEMAS

MEMBERS = ("forward", "linearize", "backward_update_", "count_invalid", "repair_offsets")
MODULES = {"triton": "cuda.backend", "cpp": "cpu.backend", "torch": "pytorch.composite"}


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_modules_implement_the_protocol(name):
    if name == "triton":
        pytest.importorskip("triton")
    backend = backend_mod._load(name)
    assert isinstance(backend, Backend) and backend.name == name
    assert isinstance(backend.ops, OpTable) and isinstance(backend.capabilities, Capabilities)
    for member in MEMBERS:
        assert callable(getattr(backend.ops, member)), member


def test_protocol_lists_the_members():
    # one entry per op, then the optional fused training forward and training lookup (a backend's
    # own, no op of :mod:`ops`)
    assert tuple(f.name for f in dataclasses.fields(OpTable)) == MEMBERS + ("train_forward", "train_lookup")
    table = OpTable(*(lambda *a: None,) * len(MEMBERS))
    assert table.train_forward is None and table.train_lookup is None
    assert {f"tbe_{m}" for m in MEMBERS} == set(SCHEMAS)           # one entry per op
    assert tuple(f.name for f in dataclasses.fields(Backend)) == ("name", "ops", "capabilities")

    with pytest.raises(TypeError):
        OpTable(forward=lambda *a: None)


@pytest.mark.parametrize("name", ["cpp", "torch"])
def test_resolve_backend_returns_the_module(name):
    got = resolve_backend(name, torch.device("cpu"))
    module = importlib.import_module(f"torchrec_ftrl.kernels.{MODULES[name]}")
    assert got.name == name and got.ops is module.OPS and got.capabilities is module.CAPABILITIES


def test_default_cpu_backend_is_cpp():
    m = FTRLTableBatchedEmbeddingBags([(10, 4)])
    assert m.backend == "cpp" and m._backend.name == "cpp"
    assert resolve_backend(None, torch.device("cpu")).name == "cpp"


def test_bad_backend_names_are_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("triton", torch.device("cpu"))


def test_load_names_missing_members():
    """A backend's OpTable names every op: one that lacks some is refused, naming them."""
    with pytest.raises(TypeError, match=r"missing 4 required positional arguments: 'linearize', "
                                        r"'backward_update_', 'count_invalid', and 'repair_offsets'"):
        OpTable(forward=lambda *a: None)
