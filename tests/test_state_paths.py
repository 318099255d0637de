"""TorchRec paths that move or sync optimizer state, with FTRL tables (docs/state-paths.md): 2 CPU
processes (gloo)."""

import pytest

import state_path_scenarios as sc

pytestmark = pytest.mark.slow


def test_reshard_carries_every_ftrl_state_bitwise(run_distributed):
    run_distributed(sc.reshard_carries_ftrl_state, 2)


def test_dmp_collection_sync_averages_ftrl_replicas(run_distributed):
    run_distributed(sc.dmp_collection_syncs_ftrl, 2)
