"""Reliability of the sharded path (DistributedModelParallel, 2 gloo processes): NaN/Inf gradients
through table-wise and row-wise FTRL tables, corrupt or mismatched ``import_ftrl_tables`` files, and
DCP checkpoints loaded into models with other tables. Worker bodies: tests/reliability_scenarios.py."""

import pytest

import reliability_scenarios as rs

pytestmark = pytest.mark.slow


def test_nonfinite_gradient_rows_skipped_counted_and_bitwise_unchanged(tmp_path, run_distributed):
    run_distributed(rs.all_nonfinite, 2, str(tmp_path))


def test_corrupt_table_files_and_dcp_into_other_tables_change_nothing(tmp_path, run_distributed):
    run_distributed(rs.all_checkpoints, 2, str(tmp_path))
