"""``torchrec_ftrl.kernels.backend``: every backend module implements the ``Backend`` contract, and
``resolve_backend`` picks and checks them. (What the backends compute: tests/test_tbe.py for "cpp" and
"torch", tests/test_tbe_triton.py for "triton".)"""

import importlib
import sys
import types

import pytest
import torch

from torchrec_ftrl import FTRLTableBatchedEmbeddingBags
from torchrec_ftrl.kernels import backend as backend_mod
from torchrec_ftrl.kernels.backend import BACKENDS, Backend, resolve_backend

MEMBERS = ("fuses_bounds_check", "count_invalid", "forward", "forward_train", "per_sample_weight_grad",
           "backward_update_")


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_modules_implement_the_protocol(name):
    if name == "triton":
        pytest.importorskip("triton")
    module = importlib.import_module(f"torchrec_ftrl.kernels.{name}_backend")
    assert isinstance(module, Backend)
    for member in MEMBERS:
        assert callable(getattr(module, member)), member


def test_protocol_lists_the_members():
    assert {m for m in vars(Backend) if not m.startswith("_")} == set(MEMBERS)

    class Partial:
        forward = forward_train = staticmethod(lambda *a: None)
    assert not isinstance(Partial(), Backend)


@pytest.mark.parametrize("name", ["cpp", "torch"])
def test_resolve_backend_returns_the_module(name):
    got, module = resolve_backend(name, torch.device("cpu"))
    assert got == name and module is importlib.import_module(f"torchrec_ftrl.kernels.{name}_backend")


def test_default_cpu_backend_is_cpp():
    m = FTRLTableBatchedEmbeddingBags([(10, 4)])
    assert m.backend == "cpp"
    assert resolve_backend(None, torch.device("cpu"))[0] == "cpp"


def test_bad_backend_names_are_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("triton", torch.device("cpu"))


def test_load_names_missing_members(monkeypatch):
    fake = types.ModuleType("torchrec_ftrl.kernels.fake_backend")
    fake.forward = lambda *a: None
    monkeypatch.setitem(sys.modules, "torchrec_ftrl.kernels.fake_backend", fake)
    with pytest.raises(TypeError, match=r"does not implement Backend: missing \['CAPABILITIES', 'fuses_bounds_check'"):
        backend_mod._load("fake")
