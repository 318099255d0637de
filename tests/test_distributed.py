"""DistributedModelParallel with FTRL tables: 2 CPU processes (gloo), manual plans."""

import pytest

import dist_scenarios as sc

pytestmark = pytest.mark.slow


def test_every_sharding_type_matches_float64_reference(run_distributed):
    run_distributed(sc.every_sharding_type, 2)


def test_in_backward_mixed_optimizers_weighted_and_vbe(run_distributed):
    run_distributed(sc.mixed_weighted_vbe, 2)


def test_data_parallel_paths_train_ftrl_or_refuse(run_distributed):
    """In-backward FTRL under the default planner, the data-parallel recipe with the dense FTRL, and a
    data-parallel plan for an FTRL table (refused), on 2 ranks against the float64 reference."""
    run_distributed(sc.data_parallel_paths, 2)


def test_derived_weights_in_every_sharding_type(run_distributed):
    """ftrl_weights="derived" through TorchRec: the weight parameters and state_dict compute
    prox(z, n); initial weights written through them are encoded; float64 reference, 3 steps."""
    run_distributed(sc.every_sharding_type, 2, {"ftrl_weights": "derived"})


def test_derived_rowwise_checkpoint_round_trip(run_distributed, tmp_path):
    run_distributed(sc.derived_checkpoint_round_trip, 2, str(tmp_path))
