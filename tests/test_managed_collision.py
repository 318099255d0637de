"""FTRL tables behind TorchRec's managed collision (ZCH) modules, under DMP: training with evictions
every step against a float64 FTRL whose evicted slots restart from zero, and DCP resume bitwise equal
to the uninterrupted run (MC's remapping state included). Gloo on CPU (``fused``); with
FTRL_TEST_DEVICE=cuda, NCCL on one GPU per process, ``fused`` and ``fused_uvm_caching``.
Worker bodies: tests/mc_scenarios.py."""

import pytest

import mc_scenarios as sc
from conftest import device_type

pytestmark = pytest.mark.slow

KERNELS = ["fused", "fused_uvm_caching"] if device_type() == "cuda" else ["fused"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_training_with_evictions_matches_float64(run_distributed, kind, kernel):
    run_distributed(sc.train_with_evictions_matches_reference, 1, kind, kernel, 8)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_dcp_resume_is_bitwise(tmp_path, run_distributed, kind, kernel):
    run_distributed(sc.resume_is_bitwise, 1, kind, kernel, str(tmp_path))


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_derived_weights_with_evictions(tmp_path, run_distributed, kind):
    """ftrl_weights="derived": an eviction resets z and n (and so w = prox(0, n0) = 0) and TorchRec's
    init_fn writes the evicted rows through the DerivedWeight parameter; float64 reference, and a
    DCP resume bitwise equal to the uninterrupted run."""
    derived = {"ftrl_weights": "derived"}
    run_distributed(sc.train_with_evictions_matches_reference, 1, kind, "fused", 8, derived)
    run_distributed(sc.resume_is_bitwise, 1, kind, "fused", str(tmp_path), derived)
