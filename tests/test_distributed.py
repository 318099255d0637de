"""DistributedModelParallel with FTRL tables: 2 CPU processes (gloo), manual plans."""

import pytest

import dist_scenarios as sc
from dist_harness import run_distributed

pytestmark = pytest.mark.slow


def test_every_sharding_type_matches_float64_reference():
    run_distributed(sc.every_sharding_type, 2)


def test_checkpoint_round_trip_and_reshard(tmp_path):
    run_distributed(sc.checkpoint_save, 2, str(tmp_path))
    # DCP into a row-wise plan (was table-wise): bitwise state, then identical continued training.
    run_distributed(sc.checkpoint_load, 2, str(tmp_path), "rw", "dcp")
    # Plain-file import into one process (was two), row-wise.
    run_distributed(sc.checkpoint_load, 1, str(tmp_path), "rw", "npz")


def test_in_backward_mixed_optimizers_weighted_and_vbe():
    run_distributed(sc.mixed_weighted_vbe, 2)
