"""``torchrec_ftrl.checkpoint`` on DistributedModelParallel models (2 CPU processes, gloo): DCP round trip
into another sharding, and the plain-file (``export_ftrl_tables`` / ``import_ftrl_tables``) round trip
into another world size. Worker bodies: tests/dist_scenarios.py."""

import pytest

import dist_scenarios as sc

pytestmark = pytest.mark.slow


def test_checkpoint_round_trip_and_reshard(tmp_path, run_distributed):
    run_distributed(sc.checkpoint_save, 2, str(tmp_path))
    # DCP into a row-wise plan (was table-wise): bitwise state, then identical continued training.
    run_distributed(sc.checkpoint_load, 2, str(tmp_path), "rw", "dcp")
    # Plain-file import into one process (was two), row-wise.
    run_distributed(sc.checkpoint_load, 1, str(tmp_path), "rw", "npz")
