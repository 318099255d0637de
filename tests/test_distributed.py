"""DistributedModelParallel with FTRL tables: 2 CPU processes (gloo), manual plans."""

import pytest

import dist_scenarios as sc
from dist_harness import run_distributed

pytestmark = pytest.mark.slow


def test_every_sharding_type_matches_float64_reference():
    run_distributed(sc.every_sharding_type, 2)
